//! Understanding an OpenAI-style request body: only what routing (and, later, tokenization)
//! needs.
//!
//! The body is walked once by a validating skimmer (`skim`) that checks it is JSON and finds
//! the top-level members without building values: a megabyte prompt is crossed sixteen bytes per
//! step instead of being parsed. The few small fields routing reads (`model`, `cache_salt`,
//! `stream`, ...) are then read with `serde_json`. Large values the router does not inspect
//! itself (chat `messages`, `tools`, `chat_template_kwargs`) are kept verbatim as [`RawJson`], so
//! that a tokenizer can forward them byte for byte. A text prompt is kept the same way
//! ([`PromptText`]) and decoded into a `String` only on first use: load-based routing never needs
//! its characters. Token-id prompts are read into integers in the same single pass.
//!
//! Two endpoints are not OpenAI chats but are routed as the chat vLLM renders for them:
//! Anthropic's `/v1/messages` (`anthropic`) and OpenAI's Responses API, `/v1/responses`
//! (`responses`). Each is converted into the conversation vLLM's own code builds (checked
//! against vectors made with that code), and marked `unreproducible` where vLLM renders from
//! state the router does not have.
//!
//! Pure functions, no shared state: safe to call from any task. A [`PromptText`] decodes at
//! most once, thread-safely ([`OnceLock`]).

mod anthropic;
mod converted;
mod pyjson;
mod responses;
mod skim;
mod usage;

use std::borrow::Cow;
use std::sync::OnceLock;

use thiserror::Error;

pub use skim::SkimError;
pub use usage::{Usage, usage_in_tail};

/// Which OpenAI endpoint a request was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointKind {
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/messages` (Anthropic's Messages API, as vLLM serves it)
    Messages,
    /// `POST /v1/responses` (OpenAI's Responses API, as vLLM serves it)
    Responses,
}

impl EndpointKind {
    /// The endpoint for a request path (query string ignored), or `None` for a path that is not a
    /// completion (`/v1/models`, `/health`, ...), which is routed without parsing its body. The
    /// path is percent-decoded first, as vLLM's server does before it matches its routes: else
    /// `/v1/%63ompletions` would reach a completion endpoint past parsing, admission and
    /// model routing.
    pub fn from_path(path: &str) -> Option<EndpointKind> {
        let path = path.split(['?', '#']).next().unwrap_or(path);
        let decoded = percent_encoding::percent_decode_str(path).decode_utf8_lossy();
        let path = decoded.strip_suffix('/').unwrap_or(&decoded);
        match path {
            "/v1/completions" => Some(EndpointKind::Completions),
            "/v1/chat/completions" => Some(EndpointKind::ChatCompletions),
            "/v1/messages" => Some(EndpointKind::Messages),
            "/v1/responses" => Some(EndpointKind::Responses),
            _ => None,
        }
    }

    /// A short stable name, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            EndpointKind::Completions => "completions",
            EndpointKind::ChatCompletions => "chat_completions",
            EndpointKind::Messages => "messages",
            EndpointKind::Responses => "responses",
        }
    }

    /// The shape of this endpoint's error bodies.
    pub fn error_style(self) -> ErrorStyle {
        match self {
            EndpointKind::Messages => ErrorStyle::Anthropic,
            EndpointKind::Completions | EndpointKind::ChatCompletions | EndpointKind::Responses => {
                ErrorStyle::OpenAi
            }
        }
    }
}

/// How an error body is shaped: the API the client speaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ErrorStyle {
    /// `{"error": {"message", "type", "param", "code"}}`
    #[default]
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`
    Anthropic,
}

impl ErrorStyle {
    /// The style of the endpoint at `path` (OpenAI's for any other path).
    pub fn for_path(path: &str) -> ErrorStyle {
        EndpointKind::from_path(path).map_or(ErrorStyle::OpenAi, EndpointKind::error_style)
    }
}

/// A `/v1/completions` prompt: text or token ids (vLLM also accepts a batch of either; a batch is
/// routed by its first element, since one replica serves the whole request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(PromptText),
    TokenIds(Vec<u32>),
}

/// A JSON value exactly as the client sent it (the parser checked it is well-formed): forwarded
/// byte for byte, never re-encoded.
#[derive(Clone, PartialEq, Eq)]
pub struct RawJson(Box<str>);

impl RawJson {
    /// The JSON text.
    pub fn get(&self) -> &str {
        &self.0
    }

    /// `text` must be well-formed JSON (the parser checked it).
    fn from_checked(text: &str) -> RawJson {
        RawJson(text.into())
    }
}

impl std::fmt::Debug for RawJson {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Values can be megabytes: show the start only.
        const SHOWN: usize = 64;
        match self.0.char_indices().nth(SHOWN) {
            Some((cut, _)) => write!(f, "RawJson({}… {} bytes)", &self.0[..cut], self.0.len()),
            None => write!(f, "RawJson({})", self.0),
        }
    }
}

/// A text prompt: its JSON string literal as sent, decoded on first use. Dereferences to the
/// decoded `str`.
#[derive(Clone)]
pub struct PromptText {
    raw: RawJson,
    decoded: OnceLock<String>,
}

impl PromptText {
    /// A prompt from already decoded text.
    pub fn new(text: impl Into<String>) -> PromptText {
        let text = text.into();
        // Serializing a string cannot fail.
        let raw = RawJson(serde_json::to_string(&text).unwrap_or_default().into());
        PromptText {
            raw,
            decoded: OnceLock::from(text),
        }
    }

    /// `raw` must be a JSON string literal (the parser checked it).
    fn from_raw(raw: RawJson) -> PromptText {
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
    pub fn raw_json(&self) -> &RawJson {
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
    pub messages: RawJson,
    /// The `tools` array, verbatim, when present.
    pub tools: Option<RawJson>,
    /// `chat_template_kwargs`, verbatim, when present.
    pub chat_template_kwargs: Option<RawJson>,
    /// vLLM's `add_generation_prompt` (its default is `true`).
    pub add_generation_prompt: Option<bool>,
    /// vLLM's `continue_final_message`.
    pub continue_final_message: Option<bool>,
    /// vLLM's `add_special_tokens`: the tokenizer's special tokens (a BOS) added on top of what
    /// the template writes. Chats default to `false`; vLLM's `/v1/responses` always adds them.
    pub add_special_tokens: Option<bool>,
    /// Set when vLLM renders this conversation in a way the router cannot reproduce (see
    /// `anthropic` and `responses`): its tokens are not trusted for the KV index, and the prefix tree routes it.
    pub unreproducible: Option<&'static str>,
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
    InvalidJson(#[source] SkimError),
    #[error("\"{field}\" is invalid: {source}")]
    InvalidField {
        field: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("request body has \"{0}\" more than once")]
    DuplicateField(&'static str),
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
    #[error("a message's \"role\" must be \"user\", \"assistant\" or \"system\"")]
    InvalidRole,
    #[error("a message's \"content\" must be a string or an array of content blocks")]
    InvalidContent,
    #[error("request body has no \"input\"")]
    MissingInput,
    #[error("\"input\" must be a string or an array of input items")]
    InvalidInput,
    #[error("an input item must be an object with a \"type\" or a \"role\"")]
    InvalidItem,
    #[error(
        "an input message's \"role\" must be \"user\", \"assistant\", \"system\" or \"developer\""
    )]
    InvalidInputRole,
    #[error("a tool must have a \"name\"")]
    InvalidTool,
}

impl From<SkimError> for ParseError {
    fn from(error: SkimError) -> Self {
        ParseError::InvalidJson(error)
    }
}

/// A `prompt` as found: token ids are read during the walk, anything else kept as text.
enum PromptField<'a> {
    TokenIds(Vec<u32>),
    Json(&'a str),
}

/// The members routing reads, as raw JSON slices of the body; every other member is skipped.
#[derive(Default)]
struct Members<'a> {
    model: Option<&'a str>,
    prompt: Option<PromptField<'a>>,
    messages: Option<&'a str>,
    tools: Option<&'a str>,
    chat_template_kwargs: Option<&'a str>,
    add_generation_prompt: Option<&'a str>,
    continue_final_message: Option<&'a str>,
    add_special_tokens: Option<&'a str>,
    cache_salt: Option<&'a str>,
    stream: Option<&'a str>,
}

impl<'a> Members<'a> {
    /// Records the member `key` whose value starts at `start`; returns where the value ends.
    fn read(
        &mut self,
        body: &'a str,
        key: Cow<'_, str>,
        start: usize,
    ) -> Result<usize, ParseError> {
        let bytes = body.as_bytes();
        let (name, slot) = match &*key {
            "prompt" => {
                if self.prompt.is_some() {
                    return Err(ParseError::DuplicateField("prompt"));
                }
                if let Some((ids, end)) = token_id_array(bytes, start) {
                    self.prompt = Some(PromptField::TokenIds(ids));
                    return Ok(end);
                }
                let end = skim::value_end(bytes, start)?;
                self.prompt = Some(PromptField::Json(&body[start..end]));
                return Ok(end);
            }
            "model" => ("model", &mut self.model),
            "messages" => ("messages", &mut self.messages),
            "tools" => ("tools", &mut self.tools),
            "chat_template_kwargs" => ("chat_template_kwargs", &mut self.chat_template_kwargs),
            "add_generation_prompt" => ("add_generation_prompt", &mut self.add_generation_prompt),
            "continue_final_message" => {
                ("continue_final_message", &mut self.continue_final_message)
            }
            "add_special_tokens" => ("add_special_tokens", &mut self.add_special_tokens),
            "cache_salt" => ("cache_salt", &mut self.cache_salt),
            "stream" => ("stream", &mut self.stream),
            _ => return Ok(skim::value_end(bytes, start)?),
        };
        if slot.is_some() {
            return Err(ParseError::DuplicateField(name));
        }
        let end = skim::value_end(bytes, start)?;
        *slot = Some(&body[start..end]);
        Ok(end)
    }
}

/// Reads a small member (`null` counts as absent) with serde.
fn field<'de, T: serde::Deserialize<'de>>(
    name: &'static str,
    raw: Option<&'de str>,
) -> Result<Option<T>, ParseError> {
    match raw {
        None => Ok(None),
        Some(raw) => {
            serde_json::from_str::<Option<T>>(raw).map_err(|source| ParseError::InvalidField {
                field: name,
                source,
            })
        }
    }
}

/// A verbatim member, `null` counting as absent.
fn raw_member(raw: Option<&str>) -> Option<RawJson> {
    raw.filter(|r| *r != "null").map(RawJson::from_checked)
}

/// Parses a request body sent to `kind`'s endpoint.
pub fn parse_request(kind: EndpointKind, body: &[u8]) -> Result<ParsedRequest, ParseError> {
    let text = simdutf8::compat::from_utf8(body).map_err(|e| {
        ParseError::InvalidJson(SkimError {
            offset: e.valid_up_to(),
            what: "invalid UTF-8",
        })
    })?;
    match kind {
        EndpointKind::Messages => return anthropic::parse_messages(text),
        EndpointKind::Responses => return responses::parse_responses(text),
        EndpointKind::Completions | EndpointKind::ChatCompletions => {}
    }
    let mut members = Members::default();
    skim::walk_object(body, |key, start| members.read(text, key, start))?;

    let model = field::<String>("model", members.model)?
        .filter(|m| !m.is_empty())
        .ok_or(ParseError::MissingModel)?;
    let input = match kind {
        EndpointKind::Completions => match members.prompt {
            None => return Err(ParseError::MissingPrompt),
            Some(PromptField::TokenIds(ids)) => RequestInput::Completion(Prompt::TokenIds(ids)),
            Some(PromptField::Json("null")) => return Err(ParseError::MissingPrompt),
            Some(PromptField::Json(raw)) => RequestInput::Completion(parse_prompt(raw)?),
        },
        EndpointKind::ChatCompletions => {
            let messages = raw_member(members.messages).ok_or(ParseError::MissingMessages)?;
            if !messages.get().starts_with('[') {
                return Err(ParseError::InvalidMessages);
            }
            RequestInput::Chat(ChatInput {
                messages,
                tools: raw_member(members.tools),
                chat_template_kwargs: raw_member(members.chat_template_kwargs),
                add_generation_prompt: field(
                    "add_generation_prompt",
                    members.add_generation_prompt,
                )?,
                continue_final_message: field(
                    "continue_final_message",
                    members.continue_final_message,
                )?,
                add_special_tokens: field("add_special_tokens", members.add_special_tokens)?,
                unreproducible: None,
            })
        }
        // Parsed above, before the OpenAI walk.
        EndpointKind::Messages => return anthropic::parse_messages(text),
        EndpointKind::Responses => return responses::parse_responses(text),
    };
    Ok(ParsedRequest {
        kind,
        model,
        input,
        cache_salt: field("cache_salt", members.cache_salt)?,
        stream: field("stream", members.stream)?.unwrap_or(false),
    })
}

/// Decodes a `prompt` that is not a plain token-id array (those are read during the walk): a
/// string, or a batch of strings or of token-id arrays. `raw` is well-formed JSON.
fn parse_prompt(raw: &str) -> Result<Prompt, ParseError> {
    let invalid = |_| ParseError::InvalidPrompt;
    match raw.as_bytes().first() {
        Some(b'"') => Ok(Prompt::Text(PromptText::from_raw(RawJson::from_checked(
            raw,
        )))),
        Some(b'[') => match first_byte(&raw[1..]) {
            Some(b'"') => {
                let batch: Vec<&serde_json::value::RawValue> =
                    serde_json::from_str(raw).map_err(invalid)?;
                if !batch.iter().all(|item| item.get().starts_with('"')) {
                    return Err(ParseError::InvalidPrompt);
                }
                let first = batch.first().ok_or(ParseError::InvalidPrompt)?;
                Ok(Prompt::Text(PromptText::from_raw(RawJson::from_checked(
                    first.get(),
                ))))
            }
            Some(b'[') => {
                let batch: Vec<Vec<u32>> = serde_json::from_str(raw).map_err(invalid)?;
                batch
                    .into_iter()
                    .next()
                    .map(Prompt::TokenIds)
                    .ok_or(ParseError::InvalidPrompt)
            }
            _ => token_ids(raw)
                .map(Prompt::TokenIds)
                .ok_or(ParseError::InvalidPrompt),
        },
        _ => Err(ParseError::InvalidPrompt),
    }
}

/// A whole text (whitespace around it aside) that is one JSON array of unsigned 32-bit integers.
fn token_ids(text: &str) -> Option<Vec<u32>> {
    let bytes = text.trim_ascii().as_bytes();
    token_id_array(bytes, 0)
        .filter(|(_, end)| *end == bytes.len())
        .map(|(ids, _)| ids)
}

/// The JSON array of unsigned 32-bit integers starting at `start`, read in one pass, and the
/// offset just past it (serde's generic path costs ~50 ns per id; prompts carry tens of
/// thousands). `None` for anything else: fractions, exponents, signs, leading zeros, overflow,
/// other values; the caller falls back to the general path for those.
fn token_id_array(body: &[u8], start: usize) -> Option<(Vec<u32>, usize)> {
    if body.get(start) != Some(&b'[') {
        return None;
    }
    let mut pos = skim::skip_whitespace(body, start + 1);
    let mut ids = Vec::new();
    if body.get(pos) == Some(&b']') {
        return Some((ids, pos + 1));
    }
    if !body.get(pos).is_some_and(u8::is_ascii_digit) {
        return None;
    }
    // A guess at the count from the bytes left (ids of a few digits, a comma and maybe a space)
    // saves most regrowth.
    ids.reserve((body.len() - pos).min(1 << 24) / 8);
    loop {
        let digits_start = pos;
        let mut value: u64 = 0;
        while let Some(&d @ b'0'..=b'9') = body.get(pos) {
            value = value * 10 + u64::from(d - b'0');
            pos += 1;
            if pos - digits_start > 10 {
                return None;
            }
        }
        let len = pos - digits_start;
        if len == 0 || (len > 1 && body[digits_start] == b'0') {
            return None;
        }
        ids.push(u32::try_from(value).ok()?);
        pos = skim::skip_whitespace(body, pos);
        match body.get(pos) {
            Some(b',') => pos = skim::skip_whitespace(body, pos + 1),
            Some(b']') => return Some((ids, pos + 1)),
            _ => return None,
        }
    }
}

fn first_byte(text: &str) -> Option<u8> {
    text.bytes().find(|b| !b.is_ascii_whitespace())
}

#[cfg(test)]
mod tests;
