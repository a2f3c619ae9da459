//! Understanding an OpenAI-style request body: only what routing (and, later, tokenization)
//! needs.
//!
//! The body is parsed once into [`ParsedRequest`]. Large sub-trees the router does not inspect
//! itself (chat `messages`, `tools`, `chat_template_kwargs`) are kept as raw JSON slices
//! ([`RawValue`]) so that a tokenizer can forward them byte for byte without re-serializing;
//! every other field is skipped without being materialized. A text prompt is the one large
//! field decoded into a `String`, because prefix hashing needs its characters.
//!
//! Pure functions, no shared state: safe to call from any task.

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
    Text(String),
    TokenIds(Vec<u32>),
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
        Some(b'"') => serde_json::from_str(text)
            .map(Prompt::Text)
            .map_err(invalid),
        Some(b'[') => match first_byte(&text[1..]) {
            Some(b'"') => {
                let batch: Vec<String> = serde_json::from_str(text).map_err(invalid)?;
                batch
                    .into_iter()
                    .next()
                    .map(Prompt::Text)
                    .ok_or(ParseError::InvalidPrompt)
            }
            Some(b'[') => {
                let batch: Vec<Vec<u32>> = serde_json::from_str(text).map_err(invalid)?;
                batch
                    .into_iter()
                    .next()
                    .map(Prompt::TokenIds)
                    .ok_or(ParseError::InvalidPrompt)
            }
            _ => serde_json::from_str(text)
                .map(Prompt::TokenIds)
                .map_err(invalid),
        },
        _ => Err(ParseError::InvalidPrompt),
    }
}

fn first_byte(text: &str) -> Option<u8> {
    text.bytes().find(|b| !b.is_ascii_whitespace())
}

#[cfg(test)]
mod tests;
