//! Recorded KV-event streams in the shared fixtures' JSON-lines format
//! (`../shared/fixtures/vllm-0.32.0-capture.jsonl`): one object a line, `{"kind":"frames",
//! "topic":HEX,"seq":N,"payload":HEX}` for each ZMQ message, plus `request` and `action`
//! lines. Tests, benchmarks and `llmgw-agent publish-capture` replay them; plain data, no
//! shared state.

use serde::Deserialize;

/// Why a capture could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("capture line {line}: {source}")]
    Json {
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("capture line {line}: field {field} is not hex: {source}")]
    Hex {
        line: usize,
        field: &'static str,
        #[source]
        source: hex::FromHexError,
    },
}

/// One ZMQ message as the engine published it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub topic: Vec<u8>,
    pub seq: u64,
    pub payload: Vec<u8>,
}

/// A request the capture's workload sent, with the engine's own tokenization of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub endpoint: String,
    pub cache_salt: Option<String>,
    pub tokens: Vec<u32>,
}

/// A recorded stream, in arrival order.
#[derive(Debug, Clone, Default)]
pub struct Capture {
    pub frames: Vec<Frame>,
    pub requests: Vec<Request>,
}

#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum Line {
    Frames {
        topic: String,
        seq: u64,
        payload: String,
    },
    Request {
        endpoint: String,
        body: serde_json::Value,
        tokenize: Tokenize,
    },
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
struct Tokenize {
    tokens: Vec<u32>,
}

impl Capture {
    /// Parses a capture's text.
    pub fn parse(text: &str) -> Result<Capture, CaptureError> {
        let mut capture = Capture::default();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            if raw.trim().is_empty() {
                continue;
            }
            let parsed: Line =
                serde_json::from_str(raw).map_err(|source| CaptureError::Json { line, source })?;
            match parsed {
                Line::Frames {
                    topic,
                    seq,
                    payload,
                } => {
                    let hex_field = |field: &'static str, s: &str| {
                        hex::decode(s).map_err(|source| CaptureError::Hex {
                            line,
                            field,
                            source,
                        })
                    };
                    capture.frames.push(Frame {
                        topic: hex_field("topic", &topic)?,
                        seq,
                        payload: hex_field("payload", &payload)?,
                    });
                }
                Line::Request {
                    endpoint,
                    body,
                    tokenize,
                } => capture.requests.push(Request {
                    endpoint,
                    cache_salt: body
                        .get("cache_salt")
                        .and_then(|s| s.as_str())
                        .map(str::to_owned),
                    tokens: tokenize.tokens,
                }),
                Line::Other => {}
            }
        }
        Ok(capture)
    }
}
