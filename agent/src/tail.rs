//! `llmgw-agent tail`: prints each batch an engine publishes as one JSON line,
//! `{"seq":…, "ts":…, "dp_rank":…, "events":[…]}`, with vLLM's field names and hashes as u64.
//! A payload that does not decode prints `{"seq":…, "error":"…", "payload_hex":"…"}`.
//! Single task; writes through a locked stdout handle per line.

use std::io::Write;

use serde::Serialize;

use crate::wire::{KvEvent, decode_batch};
use crate::zmq::{EngineEndpoint, Heard, Subscription, ZmqError, open_when_ready};

#[derive(Serialize)]
struct Line<'a> {
    seq: u64,
    ts: f64,
    dp_rank: Option<i64>,
    events: &'a [KvEvent],
}

/// Formats one message's line (`None` when the message is not `[topic, seq, payload]`).
pub fn format_message(frames: &[bytes::Bytes]) -> Option<String> {
    let [_topic, seq, payload] = frames else {
        return None;
    };
    let seq = u64::from_be_bytes(<[u8; 8]>::try_from(seq.as_ref()).ok()?);
    let json = match decode_batch(payload) {
        Ok(b) => serde_json::to_string(&Line {
            seq,
            ts: b.ts,
            dp_rank: b.dp_rank,
            events: &b.events,
        }),
        Err(e) => serde_json::to_string(&serde_json::json!({
            "seq": seq,
            "error": e.to_string(),
            "payload_hex": hex::encode(payload),
        })),
    };
    json.ok()
}

/// Receives forever (or `limit` messages), printing one line per batch to `out`.
pub async fn tail(
    endpoint: EngineEndpoint,
    limit: Option<u64>,
    out: &mut impl Write,
) -> Result<(), ZmqError> {
    // The engine may not listen yet: wait for it rather than give up after 30 s.
    let (sock, bound) = open_when_ready(&endpoint).await?;
    if let Some(b) = bound {
        eprintln!("listening on {b}");
    }
    // As the agent's intake: a disconnected engine is dialled afresh.
    let mut subscription = Subscription::new(endpoint, sock);
    let mut seen = 0u64;
    while limit.is_none_or(|l| seen < l) {
        let msg = match subscription.next().await? {
            Heard::Message(m) => m,
            Heard::Failed(e) => {
                eprintln!("receive failed: {e}");
                continue;
            }
            Heard::Redialled => {
                eprintln!("engine disconnected: dialled afresh");
                continue;
            }
        };
        let frames = msg.into_vec();
        match format_message(&frames) {
            Some(line) => {
                if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
                    // stdout closed (e.g. `| head`): done.
                    return Ok(());
                }
            }
            None => eprintln!(
                "skipping a message of {} frames: not [topic, 8-byte seq, payload]",
                frames.len()
            ),
        }
        seen += 1;
    }
    Ok(())
}
