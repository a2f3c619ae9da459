//! The token counts an OpenAI-style response reports (`usage`), read from the response body's
//! last bytes: a JSON response ends with its `usage` member, and a stream's last event before
//! `data: [DONE]` carries it when the client asked for it (`stream_options.include_usage`).
//! Pure functions.

use serde::Deserialize;

/// A response's `usage` (Anthropic's `/v1/messages` names them `input_tokens` and
/// `output_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(from = "WireUsage")]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Prompt tokens the engine found in its prefix cache, where the response says
    /// (`prompt_tokens_details.cached_tokens`, or `input_tokens_details.cached_tokens` from
    /// `/v1/responses`; vLLM fills them with `--enable-prompt-tokens-details`). Both count
    /// within the prompt tokens. Anthropic's `cache_read_input_tokens` is not read: in
    /// Anthropic's API it is not part of `input_tokens`, and engines differ on that.
    pub cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(alias = "input_tokens")]
    prompt_tokens: u64,
    #[serde(default, alias = "output_tokens")]
    completion_tokens: u64,
    #[serde(default, alias = "input_tokens_details")]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl From<WireUsage> for Usage {
    fn from(wire: WireUsage) -> Usage {
        Usage {
            prompt_tokens: wire.prompt_tokens,
            completion_tokens: wire.completion_tokens,
            // More cached than prompt tokens is a broken count, not a hit rate above 1.
            cached_tokens: wire
                .prompt_tokens_details
                .and_then(|d| d.cached_tokens)
                .filter(|&cached| cached <= wire.prompt_tokens),
        }
    }
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
                completion_tokens: 4,
                cached_tokens: None,
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
                completion_tokens: 3,
                cached_tokens: None,
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
                completion_tokens: 2,
                cached_tokens: None,
            })
        );
    }

    #[test]
    fn the_engines_cached_prompt_tokens_are_read_where_reported() {
        // vLLM with --enable-prompt-tokens-details, a JSON completion and a stream's last event.
        let json = br#"{"choices":[],"usage":{"prompt_tokens":40,"total_tokens":44,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        let stream = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n";
        // /v1/responses names them input_tokens(_details).
        let responses = br#"{"status":"completed","usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":32},"output_tokens":4,"total_tokens":44}}"#;
        for body in [&json[..], stream, responses] {
            let usage = usage_in_tail(body).expect("a usage");
            assert_eq!(
                usage.cached_tokens,
                Some(32),
                "{}",
                String::from_utf8_lossy(body)
            );
            assert_eq!(usage.prompt_tokens, 40);
        }
        // Not reported, reported as null, or more than the prompt: unknown.
        for details in [
            "",
            r#","prompt_tokens_details":null"#,
            r#","prompt_tokens_details":{"cached_tokens":null}"#,
            r#","prompt_tokens_details":{"cached_tokens":41}"#,
        ] {
            let body =
                format!(r#"{{"usage":{{"prompt_tokens":40,"completion_tokens":4{details}}}}}"#);
            assert_eq!(
                usage_in_tail(body.as_bytes())
                    .expect("a usage")
                    .cached_tokens,
                None,
                "{body}"
            );
        }
        // Anthropic's cache reads are not taken for a part of input_tokens.
        let messages =
            br#"{"usage":{"input_tokens":9,"output_tokens":2,"cache_read_input_tokens":8}}"#;
        assert_eq!(
            usage_in_tail(messages).expect("a usage").cached_tokens,
            None
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
