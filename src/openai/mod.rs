//! Understanding an OpenAI-style request body: only what routing (and, later, tokenization)
//! needs.
//!
//! The body is parsed once into [`ParsedRequest`]. Large sub-trees the router does not inspect
//! itself (chat `messages`, `tools`, `chat_template_kwargs`) are kept as raw JSON slices
//! ([`RawValue`]) so that a tokenizer can forward them byte for byte without re-serializing;
//! every other field is skipped without being materialized. A text prompt is kept the same way
//! ([`PromptText`]) and decoded into a `String` only on first use: load-based routing never
//! needs its characters, and decoding a megabyte of escaped JSON costs milliseconds, skipping it
//! a fraction of that.
//!
//! Pure functions, no shared state: safe to call from any task. A [`PromptText`] decodes at
//! most once, thread-safely ([`OnceLock`]).

use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::value::RawValue;
use thiserror::Error;

/// Which OpenAI endpoint a request was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointKind {
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/chat/completions`
    ChatCompletions,
}

impl EndpointKind {
    /// The endpoint for a request path (query string ignored), or `None` for a path that is not a
    /// completion (`/v1/models`, `/health`, ...), which is routed without parsing its body.
    pub fn from_path(path: &str) -> Option<EndpointKind> {
        let path = path.split(['?', '#']).next().unwrap_or(path);
        let path = path.strip_suffix('/').unwrap_or(path);
        match path {
            "/v1/completions" => Some(EndpointKind::Completions),
            "/v1/chat/completions" => Some(EndpointKind::ChatCompletions),
            _ => None,
        }
    }

    /// A short stable name, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            EndpointKind::Completions => "completions",
            EndpointKind::ChatCompletions => "chat_completions",
        }
    }
}

/// A `/v1/completions` prompt: text or token ids (vLLM also accepts a batch of either; a batch is
/// routed by its first element, since one replica serves the whole request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(PromptText),
    TokenIds(Vec<u32>),
}

/// A text prompt: its JSON string literal as sent, decoded on first use. Dereferences to the
/// decoded `str`.
#[derive(Clone)]
pub struct PromptText {
    raw: Box<RawValue>,
    decoded: OnceLock<String>,
}

impl PromptText {
    /// A prompt from already decoded text.
    pub fn new(text: impl Into<String>) -> PromptText {
        let text = text.into();
        let raw =
            serde_json::value::to_raw_value(&text).unwrap_or_else(|_| RawValue::NULL.to_owned());
        PromptText {
            raw,
            decoded: OnceLock::from(text),
        }
    }

    /// `raw` must be a JSON string literal (the parser checked it).
    fn from_raw(raw: Box<RawValue>) -> PromptText {
        PromptText {
            raw,
            decoded: OnceLock::new(),
        }
    }

    /// The prompt's characters (decoded on the first call).
    pub fn as_str(&self) -> &str {
        self.decoded.get_or_init(|| {
            // Decoding a literal the parser already skipped only fails on a lone UTF-16
            // surrogate escape, which Rust strings cannot hold; keep the literal's inside then.
            serde_json::from_str(self.raw.get()).unwrap_or_else(|_| {
                let literal = self.raw.get();
                literal
                    .get(1..literal.len().saturating_sub(1))
                    .unwrap_or_default()
                    .to_string()
            })
        })
    }

    /// The JSON string literal as the client sent it, quotes included: forward it (to a
    /// tokenizer) without decoding and re-encoding.
    pub fn raw_json(&self) -> &RawValue {
        &self.raw
    }
}

impl std::ops::Deref for PromptText {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for PromptText {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for PromptText {}

impl std::fmt::Debug for PromptText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptText")
            .field("raw_bytes", &self.raw.get().len())
            .finish()
    }
}

/// A chat request's conversation, kept as raw JSON for a tokenizer's chat template.
#[derive(Debug, Clone)]
pub struct ChatInput {
    /// The `messages` array, verbatim.
    pub messages: Box<RawValue>,
    /// The `tools` array, verbatim, when present.
    pub tools: Option<Box<RawValue>>,
    /// `chat_template_kwargs`, verbatim, when present.
    pub chat_template_kwargs: Option<Box<RawValue>>,
    /// vLLM's `add_generation_prompt` (its default is `true`).
    pub add_generation_prompt: Option<bool>,
    /// vLLM's `continue_final_message`.
    pub continue_final_message: Option<bool>,
}

/// What the request asks the model to read.
#[derive(Debug, Clone)]
pub enum RequestInput {
    Completion(Prompt),
    Chat(ChatInput),
}

/// Everything routing needs from one request body.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    pub kind: EndpointKind,
    /// The served model name; a LoRA adapter is addressed by its own name.
    pub model: String,
    pub input: RequestInput,
    /// vLLM's `cache_salt`: requests with different salts never share cached blocks.
    pub cache_salt: Option<String>,
    /// Whether the client asked for a streamed (SSE) response.
    pub stream: bool,
}

/// Why a body cannot be routed. Each maps to HTTP 400.
#[derive(Debug, Error)]
pub enum ParseError {
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(#[source] serde_json::Error),
    #[error("request body has no \"model\"")]
    MissingModel,
    #[error("request body has no \"prompt\"")]
    MissingPrompt,
    #[error("request body has no \"messages\"")]
    MissingMessages,
    #[error("\"prompt\" must be a string, an array of token ids, or a non-empty batch of either")]
    InvalidPrompt,
    #[error("\"messages\" must be an array")]
    InvalidMessages,
}

/// The fields routing reads; everything else is skipped by serde without allocation.
#[derive(Deserialize)]
struct WireRequest<'a> {
    #[serde(default)]
    model: Option<String>,
    #[serde(default, borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(default)]
    messages: Option<Box<RawValue>>,
    #[serde(default)]
    tools: Option<Box<RawValue>>,
    #[serde(default)]
    chat_template_kwargs: Option<Box<RawValue>>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: Option<bool>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
}

/// Parses a request body sent to `kind`'s endpoint.
pub fn parse_request(kind: EndpointKind, body: &[u8]) -> Result<ParsedRequest, ParseError> {
    let wire: WireRequest<'_> = serde_json::from_slice(body).map_err(ParseError::InvalidJson)?;
    let model = wire
        .model
        .filter(|m| !m.is_empty())
        .ok_or(ParseError::MissingModel)?;
    let input = match kind {
        EndpointKind::Completions => {
            let raw = wire.prompt.ok_or(ParseError::MissingPrompt)?;
            RequestInput::Completion(parse_prompt(raw)?)
        }
        EndpointKind::ChatCompletions => {
            let messages = wire.messages.ok_or(ParseError::MissingMessages)?;
            if !messages.get().trim_start().starts_with('[') {
                return Err(ParseError::InvalidMessages);
            }
            RequestInput::Chat(ChatInput {
                messages,
                tools: wire.tools.filter(|t| t.get() != "null"),
                chat_template_kwargs: wire.chat_template_kwargs.filter(|k| k.get() != "null"),
                add_generation_prompt: wire.add_generation_prompt,
                continue_final_message: wire.continue_final_message,
            })
        }
    };
    Ok(ParsedRequest {
        kind,
        model,
        input,
        cache_salt: wire.cache_salt,
        stream: wire.stream.unwrap_or(false),
    })
}

/// Decodes `prompt` by looking at its first bytes instead of trying each shape in turn (serde's
/// untagged enums would buffer a copy of a megabyte prompt first).
fn parse_prompt(raw: &RawValue) -> Result<Prompt, ParseError> {
    let text = raw.get();
    let invalid = |_| ParseError::InvalidPrompt;
    match first_byte(text) {
        Some(b'"') => Ok(Prompt::Text(PromptText::from_raw(raw.to_owned()))),
        Some(b'[') => match first_byte(&text[1..]) {
            Some(b'"') => {
                let batch: Vec<&RawValue> = serde_json::from_str(text).map_err(invalid)?;
                if !batch.iter().all(|item| item.get().starts_with('"')) {
                    return Err(ParseError::InvalidPrompt);
                }
                let first = batch.first().ok_or(ParseError::InvalidPrompt)?;
                Ok(Prompt::Text(PromptText::from_raw((*first).to_owned())))
            }
            Some(b'[') => {
                let batch: Vec<Vec<u32>> = serde_json::from_str(text).map_err(invalid)?;
                batch
                    .into_iter()
                    .next()
                    .map(Prompt::TokenIds)
                    .ok_or(ParseError::InvalidPrompt)
            }
            _ => token_ids(text)
                .map(Prompt::TokenIds)
                .ok_or(ParseError::InvalidPrompt),
        },
        _ => Err(ParseError::InvalidPrompt),
    }
}

/// A JSON array of unsigned 32-bit integers, read in one pass (serde's generic path costs ~50 ns
/// per id; prompts carry tens of thousands). `None` for anything else: fractions, exponents,
/// signs, leading zeros, overflow, trailing garbage.
fn token_ids(text: &str) -> Option<Vec<u32>> {
    let bytes = text.trim_ascii().as_bytes();
    let inner = bytes.strip_prefix(b"[")?.strip_suffix(b"]")?;
    let mut ids = Vec::with_capacity(inner.len() / 4);
    if inner.trim_ascii().is_empty() {
        return Some(ids);
    }
    for item in inner.split(|&b| b == b',') {
        let digits = item.trim_ascii();
        if digits.is_empty()
            || digits.len() > 10
            || (digits.len() > 1 && digits[0] == b'0')
            || !digits.iter().all(u8::is_ascii_digit)
        {
            return None;
        }
        let value = digits
            .iter()
            .fold(0u64, |acc, &d| acc * 10 + u64::from(d - b'0'));
        ids.push(u32::try_from(value).ok()?);
    }
    Some(ids)
}

fn first_byte(text: &str) -> Option<u8> {
    text.bytes().find(|b| !b.is_ascii_whitespace())
}

#[cfg(test)]
mod tests;
