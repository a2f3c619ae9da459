//! Anthropic-style `POST /v1/messages` (vLLM serves it: `vllm/entrypoints/anthropic/`), turned
//! into the chat conversation vLLM renders for it, so that it is tokenized, hashed and routed
//! exactly as a `/v1/chat/completions` request with the same conversation.
//!
//! The conversion follows vLLM 0.32's `AnthropicServingMessages.to_chat_completion_request`,
//! and is checked against vectors made with that code (`fixtures/vllm-*-anthropic-messages.json`,
//! `make fixtures-vllm`):
//! - `system` (a string, or text blocks joined; Claude Code's `x-anthropic-billing-header`
//!   block dropped, since its per-request hash would defeat prefix caching) becomes the leading
//!   system message;
//! - text blocks become text content (one block: a plain string), images `image_url` parts,
//!   `thinking` the message's `reasoning`, `tool_use` a tool call whose `arguments` are Python's
//!   `json.dumps` of the input ([`super::pyjson`]), a user's `tool_result` a `tool` message;
//! - `tools` become functions (`input_schema` as `parameters`, byte for byte);
//! - a system message inside `messages` stays in place. (vLLM merges those into the leading
//!   one for chat templates that refuse a system message after the first turn; such a request
//!   renders differently there, which the cache-drift self-check shows.)
//!
//! What vLLM renders in a way the router cannot reproduce (`thinking: disabled`, whose effort vLLM
//! probes per model; a `tool_use` without an id, which vLLM names by the clock; a tool result
//! in an assistant turn, which vLLM writes as a Python repr; tool additions and removals) is
//! still converted, but marked so the precise tier does not trust its tokens: the prefix tree
//! routes it instead.
//!
//! Pure functions, no shared state.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::converted::{Conversion, invalid, read_body};
use super::{ChatInput, EndpointKind, ParseError, ParsedRequest, RawJson, RequestInput, pyjson};

/// Claude Code's per-request attribution, which vLLM leaves out of the prompt.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

#[derive(Deserialize)]
struct Request<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    system: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<Vec<RawMessage<'a>>>,
    #[serde(borrow, default)]
    tools: Option<Vec<Tool<'a>>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(borrow, default)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(default)]
    thinking: Option<Thinking>,
    #[serde(default)]
    output_config: Option<OutputConfig>,
}

#[derive(Deserialize)]
struct RawMessage<'a> {
    role: Cow<'a, str>,
    #[serde(borrow)]
    content: &'a RawValue,
}

/// A message with its content read: a string, or content blocks.
struct Message<'a> {
    role: Cow<'a, str>,
    content: Content<'a>,
}

enum Content<'a> {
    Text(String),
    Blocks(Vec<Block<'a>>),
}

impl<'a> Message<'a> {
    /// (serde's untagged enums cannot hold borrowed raw values, so the content's shape is
    /// chosen by its first byte.)
    fn read(raw: RawMessage<'a>) -> Result<Message<'a>, ParseError> {
        let text = raw.content.get();
        let content = match text.as_bytes().first() {
            Some(b'"') => {
                Content::Text(serde_json::from_str(text).map_err(|e| invalid("content", e))?)
            }
            Some(b'[') => {
                Content::Blocks(serde_json::from_str(text).map_err(|e| invalid("content", e))?)
            }
            _ => return Err(ParseError::InvalidContent),
        };
        Ok(Message {
            role: raw.role,
            content,
        })
    }
}

#[derive(Deserialize)]
struct Block<'a> {
    #[serde(rename = "type")]
    kind: Cow<'a, str>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    source: Option<Value>,
    #[serde(default)]
    thinking: Option<String>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(default)]
    tool_use_id: Option<String>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Tool<'a> {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(borrow)]
    input_schema: &'a RawValue,
    #[serde(default)]
    strict: Option<bool>,
    #[serde(default)]
    defer_loading: Option<bool>,
}

#[derive(Deserialize)]
struct Thinking {
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize)]
struct OutputConfig {
    #[serde(default)]
    effort: Option<String>,
}

/// The conversation so far, and whether vLLM's rendering of it can be reproduced.
/// Parses a `/v1/messages` body into the chat request vLLM renders for it.
pub fn parse_messages(body: &str) -> Result<ParsedRequest, ParseError> {
    let (request, model) = read_body(body, |r: &mut Request<'_>| r.model.take())?;
    let messages = request
        .messages
        .ok_or(ParseError::MissingMessages)?
        .into_iter()
        .map(Message::read)
        .collect::<Result<Vec<_>, _>>()?;
    let mut conversion = Conversion::with_capacity(messages.len() + 1);
    if let Some(system) = request.system {
        let text = system_text(system)?;
        if !text.is_empty() {
            conversion
                .messages
                .push(json!({"role": "system", "content": text}));
        }
    }
    for message in &messages {
        convert_message(message, &mut conversion)?;
    }
    let tools = request.tools.as_deref().map(tools_json);
    if messages.iter().any(|m| {
        matches!(&m.content, Content::Blocks(blocks)
            if blocks.iter().any(|b| b.kind == "tool_addition" || b.kind == "tool_removal"))
    }) {
        conversion.cannot_reproduce("tool additions or removals");
    }
    let mut chat_template_kwargs = request.chat_template_kwargs.map(|k| k.get().to_owned());
    if request.thinking.is_some_and(|t| t.kind == "disabled") {
        conversion.cannot_reproduce("thinking disabled");
    }
    if let Some(effort) = request.output_config.and_then(|c| c.effort) {
        // vLLM passes the effort to the template as `reasoning_effort`, and turns thinking on
        // unless the request set it.
        chat_template_kwargs = Some(with_reasoning_effort(
            chat_template_kwargs.as_deref(),
            &effort,
        )?);
    }
    let messages =
        serde_json::to_string(&conversion.messages).map_err(|e| invalid("messages", e))?;
    Ok(ParsedRequest {
        kind: EndpointKind::Messages,
        model,
        input: RequestInput::Chat(ChatInput {
            messages: RawJson::from_checked(&messages),
            tools: tools.map(|t| RawJson::from_checked(&t)),
            chat_template_kwargs: chat_template_kwargs.map(|k| RawJson::from_checked(&k)),
            add_generation_prompt: None,
            continue_final_message: None,
            // vLLM renders it as a chat completion: no special tokens on top.
            add_special_tokens: None,
            unreproducible: conversion.unreproducible,
        }),
        cache_salt: request.cache_salt,
        stream: request.stream.unwrap_or(false),
    })
}

/// The top-level `system`: a string, or its text blocks joined (the billing header left out).
fn system_text(system: &RawValue) -> Result<String, ParseError> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum System {
        Text(String),
        Blocks(Vec<SystemBlock>),
    }
    #[derive(Deserialize)]
    struct SystemBlock {
        #[serde(rename = "type")]
        kind: String,
        #[serde(default)]
        text: Option<String>,
    }
    let system: Option<System> =
        serde_json::from_str(system.get()).map_err(|e| invalid("system", e))?;
    Ok(match system {
        None => String::new(),
        Some(System::Text(text)) => text,
        Some(System::Blocks(blocks)) => blocks
            .into_iter()
            .filter(|b| b.kind == "text")
            .filter_map(|b| b.text)
            .filter(|t| !t.is_empty() && !t.starts_with(BILLING_HEADER))
            .collect(),
    })
}

fn convert_message(message: &Message<'_>, out: &mut Conversion) -> Result<(), ParseError> {
    let role = &*message.role;
    if !matches!(role, "user" | "assistant" | "system") {
        return Err(ParseError::InvalidRole);
    }
    if role == "system" {
        let text = match &message.content {
            Content::Text(text) if !text.starts_with(BILLING_HEADER) => text.clone(),
            Content::Text(_) => String::new(),
            Content::Blocks(blocks) => blocks
                .iter()
                .filter(|b| b.kind == "text")
                .filter_map(|b| b.text.as_deref())
                .filter(|t| !t.is_empty() && !t.starts_with(BILLING_HEADER))
                .collect(),
        };
        if !text.is_empty() {
            out.messages
                .push(json!({"role": "system", "content": text}));
        }
        return Ok(());
    }
    let blocks = match &message.content {
        Content::Text(text) => {
            out.messages.push(json!({"role": role, "content": text}));
            return Ok(());
        }
        Content::Blocks(blocks) => blocks,
    };
    let mut parts: Vec<Value> = Vec::new();
    let mut tool_calls: Vec<Value> = Vec::new();
    let mut reasoning = String::new();
    let mut has_reasoning = false;
    for block in blocks {
        match &*block.kind {
            "text" => {
                if let Some(text) = block.text.as_deref().filter(|t| !t.is_empty()) {
                    parts.push(json!({"type": "text", "text": text}));
                }
            }
            "image" => {
                if let Some(source) = &block.source {
                    parts.push(
                        json!({"type": "image_url", "image_url": {"url": image_url(source)}}),
                    );
                }
            }
            "thinking" => {
                if let Some(thinking) = &block.thinking {
                    reasoning.push_str(thinking);
                    has_reasoning = true;
                }
            }
            "tool_use" => {
                let Some(id) = block.id.clone().filter(|id| !id.is_empty()) else {
                    out.cannot_reproduce("a tool_use without an id");
                    continue;
                };
                let arguments = match block.input.map(|i| i.get().trim()) {
                    // `json.dumps(block.input or {})`: a falsy input is written as `{}`.
                    None => "{}".to_owned(),
                    Some(input) if python_falsy(input) => "{}".to_owned(),
                    Some(input) => match pyjson::dumps(input) {
                        Ok(arguments) => arguments,
                        Err(_) => {
                            out.cannot_reproduce("a tool_use input nested too deep");
                            input.to_owned()
                        }
                    },
                };
                tool_calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": {"name": block.name.clone().unwrap_or_default(), "arguments": arguments},
                }));
            }
            "tool_result" if role == "user" => tool_result(block, out)?,
            "tool_result" => match block.content.map(|c| c.get()) {
                None | Some("null" | "\"\"") => {
                    parts.push(json!({"type": "text", "text": "Tool result: "}))
                }
                Some(raw) if raw.starts_with('"') => {
                    let text: String =
                        serde_json::from_str(raw).map_err(|e| invalid("content", e))?;
                    parts.push(json!({"type": "text", "text": format!("Tool result: {text}")}));
                }
                Some(_) => out.cannot_reproduce("a tool result in an assistant turn"),
            },
            // Opaque, or expanded elsewhere by vLLM: nothing of them reaches the prompt.
            "redacted_thinking" | "tool_reference" | "tool_addition" | "tool_removal" => {}
            _ => {}
        }
    }
    let mut message = serde_json::Map::new();
    message.insert("role".into(), Value::from(role));
    if has_reasoning {
        message.insert("reasoning".into(), Value::from(reasoning));
    }
    let has_tool_calls = !tool_calls.is_empty();
    if has_tool_calls {
        message.insert("tool_calls".into(), Value::from(tool_calls));
    }
    let has_content = !parts.is_empty();
    if has_content {
        let content = match parts.as_slice() {
            [only] if only["type"] == "text" => only["text"].clone(),
            _ => Value::from(parts),
        };
        message.insert("content".into(), content);
    }
    if role != "user" || has_content {
        out.messages.push(Value::Object(message));
    }
    Ok(())
}

/// A user's `tool_result`: a `tool` message with its text (text parts joined by newlines), then
/// a user message with its images, then any tool references.
fn tool_result(block: &Block<'_>, out: &mut Conversion) -> Result<(), ParseError> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ResultContent {
        Text(String),
        Items(Vec<Value>),
        Other(serde::de::IgnoredAny),
    }
    let content: Option<ResultContent> = match block.content {
        Some(raw) => serde_json::from_str(raw.get()).map_err(|e| invalid("content", e))?,
        None => None,
    };
    let mut text = String::new();
    let mut images = Vec::new();
    let mut references = Vec::new();
    match content {
        Some(ResultContent::Text(t)) => text = t,
        Some(ResultContent::Items(items)) => {
            let mut texts = Vec::new();
            for item in &items {
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        texts.push(item.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    Some("image") => {
                        let source = item.get("source").cloned().unwrap_or_else(|| json!({}));
                        let url = image_url(&source);
                        if !url.is_empty() {
                            images.push(json!({"type": "image_url", "image_url": {"url": url}}));
                        }
                    }
                    Some("tool_reference") => {
                        let name = item
                            .get("tool_name")
                            .and_then(Value::as_str)
                            .filter(|n| !n.is_empty())
                            .or_else(|| item.get("name").and_then(Value::as_str));
                        if let Some(name) = name.filter(|n| !n.is_empty()) {
                            references.push(json!({"type": "tool_reference", "name": name}));
                        }
                    }
                    _ => {}
                }
            }
            text = texts.join("\n");
        }
        Some(ResultContent::Other(_)) | None => {}
    }
    let id = block.tool_use_id.clone().unwrap_or_default();
    out.messages
        .push(json!({"role": "tool", "tool_call_id": id, "content": text}));
    if !images.is_empty() {
        out.messages
            .push(json!({"role": "user", "content": images}));
    }
    if !references.is_empty() {
        out.messages
            .push(json!({"role": "tool", "tool_call_id": id, "content": references}));
    }
    Ok(())
}

/// Whether Python reads the JSON value `raw` as false (`None`, `False`, a zero, an empty string,
/// list or dict).
fn python_falsy(raw: &str) -> bool {
    match raw {
        "null" | "false" | "\"\"" => true,
        _ if raw.starts_with('{') || raw.starts_with('[') => {
            let inner = raw[1..raw.len().saturating_sub(1)].trim();
            inner.is_empty()
        }
        _ if raw.starts_with(['-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9']) => {
            raw.parse::<f64>().is_ok_and(|n| n == 0.0)
        }
        _ => false,
    }
}

/// An Anthropic image source as the URL vLLM's media loader reads.
fn image_url(source: &Value) -> String {
    let field = |name: &str, default: &str| {
        source
            .get(name)
            .and_then(Value::as_str)
            .unwrap_or(default)
            .to_owned()
    };
    if source.get("type").and_then(Value::as_str) == Some("url") {
        return field("url", "");
    }
    format!(
        "data:{};base64,{}",
        field("media_type", "image/jpeg"),
        field("data", "")
    )
}

/// `tools` as OpenAI functions, each `input_schema` written through unchanged.
fn tools_json(tools: &[Tool<'_>]) -> String {
    let mut out = String::from("[");
    for (i, tool) in tools.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"type\":\"function\",\"function\":{\"name\":");
        out.push_str(&Value::from(tool.name.as_str()).to_string());
        if let Some(description) = &tool.description {
            out.push_str(",\"description\":");
            out.push_str(&Value::from(description.as_str()).to_string());
        }
        out.push_str(",\"parameters\":");
        out.push_str(tool.input_schema.get());
        if let Some(strict) = tool.strict {
            out.push_str(if strict {
                ",\"strict\":true"
            } else {
                ",\"strict\":false"
            });
        }
        if let Some(defer) = tool.defer_loading {
            out.push_str(if defer {
                ",\"defer_loading\":true"
            } else {
                ",\"defer_loading\":false"
            });
        }
        out.push_str("}}");
    }
    out.push(']');
    out
}

/// The request's template kwargs with vLLM's `reasoning_effort` (and `enable_thinking`, unless
/// set) added.
pub(super) fn with_reasoning_effort(
    kwargs: Option<&str>,
    effort: &str,
) -> Result<String, ParseError> {
    let mut map: serde_json::Map<String, Value> = match kwargs {
        Some(raw) => serde_json::from_str::<Option<_>>(raw)
            .map_err(|e| invalid("chat_template_kwargs", e))?
            .unwrap_or_default(),
        None => serde_json::Map::new(),
    };
    if !map.contains_key("enable_thinking") {
        map.insert("enable_thinking".into(), Value::from(effort != "none"));
    }
    map.insert("reasoning_effort".into(), Value::from(effort));
    serde_json::to_string(&map).map_err(|e| invalid("chat_template_kwargs", e))
}

#[cfg(test)]
mod tests;
