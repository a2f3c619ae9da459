//! The token counts an OpenAI-style response reports (`usage`), read from the response body's
//! last bytes: a JSON response ends with its `usage` member, and a stream's last event before
//! `data: [DONE]` carries it when the client asked for it (`stream_options.include_usage`).
//! Pure functions.

use serde::Deserialize;

/// A response's `usage` (Anthropic's `/v1/messages` names them `input_tokens` and
/// `output_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct Usage {
    #[serde(alias = "input_tokens")]
    pub prompt_tokens: u64,
    #[serde(default, alias = "output_tokens")]
    pub completion_tokens: u64,
}

/// The last `"usage": {...}` object in `tail`, when there is one and it is whole. A `null`
/// usage (a stream's events before the last) or a cut-off object is `None`.
pub fn usage_in_tail(tail: &[u8]) -> Option<Usage> {
    const KEY: &[u8] = b"\"usage\"";
    let at = tail.windows(KEY.len()).rposition(|w| w == KEY)?;
    let rest = &tail[at + KEY.len()..];
    let rest = rest.trim_ascii_start().strip_prefix(b":")?;
    let mut values = serde_json::Deserializer::from_slice(rest).into_iter::<Option<Usage>>();
    values.next()?.ok()?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_responses_usage_is_read() {
        let body = br#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi \"usage\"","finish_reason":"length"}],"usage": {"prompt_tokens":12,"total_tokens":16,"completion_tokens":4,"prompt_tokens_details":null},"kv_transfer_params":null}"#;
        assert_eq!(
            usage_in_tail(body),
            Some(Usage {
                prompt_tokens: 12,
                completion_tokens: 4
            })
        );
    }

    #[test]
    fn a_streams_last_usage_is_read() {
        let body = b"data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n\
                     data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3,\"total_tokens\":10}}\n\n\
                     data: [DONE]\n\n";
        assert_eq!(
            usage_in_tail(body),
            Some(Usage {
                prompt_tokens: 7,
                completion_tokens: 3
            })
        );
    }

    #[test]
    fn an_anthropic_messages_usage_is_read() {
        let body = br#"{"id":"msg_1","type":"message","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn","usage":{"input_tokens":9,"output_tokens":2}}"#;
        assert_eq!(
            usage_in_tail(body),
            Some(Usage {
                prompt_tokens: 9,
                completion_tokens: 2
            })
        );
    }

    #[test]
    fn no_whole_usage_is_none() {
        for body in [
            &b""[..],
            b"{\"choices\":[]}",
            b"data: {\"usage\":null}\n\ndata: [DONE]\n\n",
            b"\"usage\":{\"prompt_tokens\":7,\"compl",
            b"\"usage\":{\"prompt_tokens\":-1}",
            b"\"usage\" \"prompt_tokens\"",
            b"{\"error\":{\"message\":\"bad\"}}",
        ] {
            assert_eq!(
                usage_in_tail(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }
}
