//! OpenAI-style `POST /v1/responses` (vLLM serves it: `vllm/entrypoints/openai/responses/`),
//! turned into the chat conversation vLLM renders for it, so that it is tokenized, hashed and
//! routed exactly as a `/v1/chat/completions` request with the same conversation.
//!
//! The conversion follows vLLM 0.32's `OnlineRenderer.render_responses` (non-Harmony models):
//! `construct_tool_dicts`, `construct_input_messages` (with `_construct_message_from_response_item`)
//! and `ResponsesRequest.build_chat_params`, and is checked against vectors made with that code
//! (`fixtures/vllm-*-responses.json`, `make fixtures-vllm`):
//! - `instructions` (when not empty) becomes the leading system message; a string `input` one
//!   user message;
//! - input messages (`user`, `system`, `developer`) keep their content, their `input_text`
//!   parts written as chat `text` parts and `input_image` URLs as `image_url` parts (vLLM's chat
//!   parser reads both alike); an assistant message becomes its first part's text;
//! - `function_call` and `custom_tool_call` items become tool calls (a namespaced function as
//!   `namespace__name`, a custom tool's input as `{"input": ...}`), `reasoning` items the
//!   message's `reasoning` (its first content text, else its first summary text); both, and
//!   assistant text, join the assistant message just before when it has no such part yet, as
//!   vLLM merges them;
//! - `function_call_output` and `custom_tool_call_output` become `tool` messages;
//! - `tools`: functions as chat functions, namespaces flattened to `namespace__name`, custom
//!   tools as vLLM's one-string function; other tool types (web search, MCP, ...) are not shown
//!   to the template and are dropped;
//! - `reasoning.effort` reaches the template as `reasoning_effort` (and `enable_thinking`,
//!   unless `chat_template_kwargs` sets it); a final assistant message or reasoning item still
//!   `in_progress` or `incomplete` is continued (`continue_final_message`).
//!
//! What vLLM renders from state the router does not have is still converted, but marked so the
//! precise tier does not trust its tokens (the prefix tree routes it): `previous_response_id`
//! (vLLM prepends the stored conversation only the replica that answered it holds), an
//! `item_reference` (a stored item), file inputs and images by file id (stored files), encrypted
//! reasoning (vLLM refuses it), and item shapes vLLM does not convert (it refuses them).
//! Not reproduced either, as for chats: Harmony models (gpt-oss), which vLLM renders with its
//! own encoder, and a server's `--exclude-tools-when-tool-choice-none` and default template
//! kwargs.
//!
//! Pure functions, no shared state.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use super::converted::{Conversion, invalid, read_body};
use super::{ChatInput, EndpointKind, ParseError, ParsedRequest, RawJson, RequestInput};

/// The separator vLLM puts between a namespace and its function's name.
const NAMESPACE_SEPARATOR: &str = "__";

#[derive(Deserialize)]
struct Request<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(borrow, default)]
    tools: Option<Vec<Tool<'a>>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(borrow, default)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(default)]
    reasoning: Option<Reasoning>,
    #[serde(default)]
    previous_response_id: Option<String>,
}

#[derive(Deserialize)]
struct Reasoning {
    #[serde(default)]
    effort: Option<String>,
}

#[derive(Deserialize)]
struct Tool<'a> {
    #[serde(rename = "type")]
    kind: Cow<'a, str>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(borrow, default)]
    parameters: Option<&'a RawValue>,
    #[serde(default)]
    strict: Option<bool>,
    #[serde(default)]
    defer_loading: Option<bool>,
    /// A namespace's functions.
    #[serde(borrow, default)]
    tools: Option<Vec<Tool<'a>>>,
}

/// One `input` item: every field any item kind uses (serde's untagged enums cannot hold
/// borrowed raw values, so the kind is read from `type` and `role`).
#[derive(Deserialize)]
struct Item<'a> {
    #[serde(rename = "type", default)]
    kind: Option<Cow<'a, str>>,
    #[serde(default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
    #[serde(default)]
    input: Option<String>,
    #[serde(borrow, default)]
    output: Option<&'a RawValue>,
    #[serde(default)]
    summary: Option<Vec<TextPart>>,
    #[serde(default)]
    encrypted_content: Option<String>,
}

#[derive(Deserialize)]
struct TextPart {
    #[serde(default)]
    text: Option<String>,
}

/// The conversation so far, and whether vLLM's rendering of it can be reproduced.
impl Conversion {
    /// The last message, when it is the assistant's: what vLLM merges a call, reasoning or
    /// text into.
    fn last_assistant(&mut self) -> Option<&mut Map<String, Value>> {
        self.messages
            .last_mut()
            .and_then(Value::as_object_mut)
            .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
    }

    /// Sets `key` on the assistant message just before when it has none yet (vLLM's
    /// `prev_msg.get(key) is None`), or adds a new assistant message with it.
    fn merge_into_assistant(&mut self, key: &str, value: Value) {
        if let Some(previous) = self.last_assistant()
            && previous.get(key).is_none_or(Value::is_null)
        {
            previous.insert(key.to_owned(), value);
            return;
        }
        let mut message = Map::new();
        message.insert("role".into(), Value::from("assistant"));
        message.insert(key.to_owned(), value);
        self.messages.push(Value::Object(message));
    }

    /// A tool call: appended to the assistant message just before, or a new one.
    fn push_tool_call(&mut self, call: Value) {
        if let Some(previous) = self.last_assistant() {
            match previous.get_mut("tool_calls") {
                None | Some(Value::Null) => {
                    previous.insert("tool_calls".into(), Value::from(vec![call]));
                    return;
                }
                Some(Value::Array(calls)) => {
                    calls.push(call);
                    return;
                }
                // vLLM logs and starts a new message.
                Some(_) => {}
            }
        }
        self.messages
            .push(json!({"role": "assistant", "tool_calls": [call]}));
    }
}

/// Parses a `/v1/responses` body into the chat request vLLM renders for it.
pub fn parse_responses(body: &str) -> Result<ParsedRequest, ParseError> {
    let (request, model) = read_body(body, |r: &mut Request<'_>| r.model.take())?;
    let input = request
        .input
        .filter(|i| i.get() != "null")
        .ok_or(ParseError::MissingInput)?;
    let mut conversion = Conversion::default();
    if request.previous_response_id.is_some() {
        conversion.cannot_reproduce("previous_response_id");
    }
    if let Some(instructions) = request.instructions.filter(|i| !i.is_empty()) {
        conversion
            .messages
            .push(json!({"role": "system", "content": instructions}));
    }
    let mut continue_final = false;
    match input.get().as_bytes().first() {
        Some(b'"') => {
            let text: String =
                serde_json::from_str(input.get()).map_err(|e| invalid("input", e))?;
            conversion
                .messages
                .push(json!({"role": "user", "content": text}));
        }
        Some(b'[') => {
            let items: Vec<&RawValue> =
                serde_json::from_str(input.get()).map_err(|e| invalid("input", e))?;
            let items = items
                .into_iter()
                .map(|raw| {
                    if !raw.get().starts_with('{') {
                        return Err(ParseError::InvalidItem);
                    }
                    serde_json::from_str::<Item<'_>>(raw.get()).map_err(|e| invalid("input", e))
                })
                .collect::<Result<Vec<_>, _>>()?;
            for item in &items {
                convert_item(item, &mut conversion)?;
            }
            continue_final = items
                .last()
                .is_some_and(|last| is_partial(last, &mut conversion));
        }
        _ => return Err(ParseError::InvalidInput),
    }
    let tools = request.tools.as_deref().map(tools_json).transpose()?;
    let mut chat_template_kwargs = request.chat_template_kwargs.map(|k| k.get().to_owned());
    if let Some(raw) = &chat_template_kwargs
        && !(raw.starts_with('{') || raw == "null")
    {
        return Err(invalid(
            "chat_template_kwargs",
            serde::de::Error::custom("expected an object"),
        ));
    }
    if let Some(effort) = request.reasoning.and_then(|r| r.effort) {
        chat_template_kwargs = Some(super::anthropic::with_reasoning_effort(
            chat_template_kwargs.as_deref(),
            &effort,
        )?);
    }
    let messages = serde_json::to_string(&conversion.messages).map_err(|e| invalid("input", e))?;
    Ok(ParsedRequest {
        kind: EndpointKind::Responses,
        model,
        input: RequestInput::Chat(ChatInput {
            messages: RawJson::from_checked(&messages),
            tools: tools.map(|t| RawJson::from_checked(&t)),
            chat_template_kwargs: chat_template_kwargs
                .filter(|k| k != "null")
                .map(|k| RawJson::from_checked(&k)),
            add_generation_prompt: Some(!continue_final),
            continue_final_message: Some(continue_final),
            // vLLM 0.32 tokenizes a Responses prompt with `TokenizeParams`' default
            // `add_special_tokens=True` (`ResponsesRequest.build_tok_params` sets no other), so a
            // tokenizer whose post-processor adds a BOS puts it before the template's own:
            // seen on a real engine (`make e2e-vllm`).
            add_special_tokens: Some(true),
            unreproducible: conversion.unreproducible,
        }),
        cache_salt: request.cache_salt,
        stream: request.stream.unwrap_or(false),
    })
}

/// vLLM's `should_continue_final_message`: the last item is a message or reasoning item still
/// being written. (Only an assistant's is reproduced: how vLLM reads a status on another role's
/// message depends on which of its input shapes pydantic picks.)
fn is_partial(last: &Item<'_>, out: &mut Conversion) -> bool {
    let kind = last.kind.as_deref().unwrap_or("message");
    let partial = matches!(kind, "message" | "reasoning")
        && matches!(last.status.as_deref(), Some("in_progress" | "incomplete"));
    if partial && kind == "message" && last.role.as_deref() != Some("assistant") {
        out.cannot_reproduce("a partial input message");
    }
    partial
}

fn convert_item(item: &Item<'_>, out: &mut Conversion) -> Result<(), ParseError> {
    let kind = match (item.kind.as_deref(), item.role.as_deref()) {
        (Some(kind), _) => kind,
        (None, Some(_)) => "message",
        (None, None) => return Err(ParseError::InvalidItem),
    };
    match kind {
        "message" => convert_message(item, out),
        "function_call" => {
            let (Some(call_id), Some(name), Some(arguments)) =
                (&item.call_id, &item.name, &item.arguments)
            else {
                return Err(ParseError::InvalidItem);
            };
            let name = match item.namespace.as_deref().filter(|n| !n.is_empty()) {
                Some(namespace) => format!("{namespace}{NAMESPACE_SEPARATOR}{name}"),
                None => name.clone(),
            };
            out.push_tool_call(json!({
                "id": call_id,
                "function": {"name": name, "arguments": arguments},
                "type": "function",
            }));
            Ok(())
        }
        "custom_tool_call" => {
            let (Some(call_id), Some(name)) = (&item.call_id, &item.name) else {
                return Err(ParseError::InvalidItem);
            };
            // `json.dumps({"input": payload}, ensure_ascii=False)`: serde_json escapes a
            // string exactly as Python does without `ensure_ascii`.
            let payload = serde_json::to_string(item.input.as_deref().unwrap_or_default())
                .map_err(|e| invalid("input", e))?;
            out.push_tool_call(json!({
                "id": call_id,
                "function": {"name": name, "arguments": format!("{{\"input\": {payload}}}")},
                "type": "function",
            }));
            Ok(())
        }
        "function_call_output" | "custom_tool_call_output" => {
            let content = match item.output {
                None => Value::Null,
                Some(raw) => match raw.get().as_bytes().first() {
                    Some(b'[') => parts(raw, out)?,
                    _ => serde_json::from_str(raw.get()).map_err(|e| invalid("input", e))?,
                },
            };
            out.messages.push(json!({
                "role": "tool",
                "content": content,
                "tool_call_id": item.call_id,
            }));
            Ok(())
        }
        "reasoning" => {
            if item
                .encrypted_content
                .as_deref()
                .is_some_and(|c| !c.is_empty())
            {
                out.cannot_reproduce("encrypted reasoning");
            }
            let content: Option<Vec<TextPart>> = match item.content {
                Some(raw) => serde_json::from_str(raw.get()).map_err(|e| invalid("input", e))?,
                None => None,
            };
            let first_text = |parts: Option<&Vec<TextPart>>| {
                parts
                    .and_then(|p| p.first())
                    .map(|p| p.text.clone().unwrap_or_default())
            };
            let reasoning = first_text(content.as_ref().filter(|c| !c.is_empty()))
                .or_else(|| first_text(item.summary.as_ref()))
                .unwrap_or_default();
            out.merge_into_assistant("reasoning", Value::from(reasoning));
            Ok(())
        }
        "item_reference" => {
            out.cannot_reproduce("an item reference");
            Ok(())
        }
        _ if item.role.is_some() => convert_message(item, out),
        _ => {
            out.cannot_reproduce("an unsupported input item");
            Ok(())
        }
    }
}

fn convert_message(item: &Item<'_>, out: &mut Conversion) -> Result<(), ParseError> {
    let role = item.role.as_deref().ok_or(ParseError::InvalidItem)?;
    if !matches!(role, "user" | "assistant" | "system" | "developer") {
        return Err(ParseError::InvalidInputRole);
    }
    let content = item.content.ok_or(ParseError::InvalidContent)?;
    let first = content.get().as_bytes().first();
    if role == "assistant" {
        // vLLM reads an assistant message's first part only.
        let text = match first {
            Some(b'"') => Some(
                serde_json::from_str::<String>(content.get()).map_err(|e| invalid("input", e))?,
            ),
            Some(b'[') => {
                let parts: Vec<Value> =
                    serde_json::from_str(content.get()).map_err(|e| invalid("input", e))?;
                parts
                    .first()
                    .and_then(|p| p.get("text"))
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            }
            _ => return Err(ParseError::InvalidContent),
        };
        match text {
            Some(text) => out.merge_into_assistant("content", Value::from(text)),
            None => out.cannot_reproduce("an assistant message without text first"),
        }
        return Ok(());
    }
    let content = match first {
        Some(b'"') => serde_json::from_str(content.get()).map_err(|e| invalid("input", e))?,
        Some(b'[') => parts(content, out)?,
        _ => return Err(ParseError::InvalidContent),
    };
    out.messages.push(json!({"role": role, "content": content}));
    Ok(())
}

/// Input content parts as chat content parts: text kinds as `text`, image URLs as `image_url`.
fn parts(raw: &RawValue, out: &mut Conversion) -> Result<Value, ParseError> {
    let parts: Vec<Value> = serde_json::from_str(raw.get()).map_err(|e| invalid("input", e))?;
    let mut converted = Vec::with_capacity(parts.len());
    for part in &parts {
        let kind = part.get("type").and_then(Value::as_str);
        match kind {
            Some("input_text" | "output_text" | "text") => {
                match part.get("text").and_then(Value::as_str) {
                    Some(text) => converted.push(json!({"type": "text", "text": text})),
                    None => return Err(ParseError::InvalidContent),
                }
            }
            Some("input_image") => match part.get("image_url").and_then(Value::as_str) {
                Some(url) => {
                    converted.push(json!({"type": "image_url", "image_url": {"url": url}}))
                }
                None => out.cannot_reproduce("an image by file id"),
            },
            Some("input_file") => out.cannot_reproduce("a file input"),
            _ => out.cannot_reproduce("an unsupported content part"),
        }
    }
    Ok(Value::from(converted))
}

/// `tools` as the chat functions vLLM shows the template.
fn tools_json(tools: &[Tool<'_>]) -> Result<String, ParseError> {
    let mut functions = Vec::new();
    for tool in tools {
        match &*tool.kind {
            "function" => functions.push(function(tool, None)?),
            "namespace" => {
                let namespace = tool.name.as_deref().unwrap_or_default();
                for inner in tool.tools.iter().flatten() {
                    if inner.kind == "function" {
                        functions.push(function(inner, Some(namespace))?);
                    }
                }
            }
            "custom" => {
                let name = tool.name.as_deref().ok_or(ParseError::InvalidTool)?;
                let mut out = String::from("{\"type\":\"function\",\"function\":{\"name\":");
                out.push_str(&Value::from(name).to_string());
                if let Some(description) = &tool.description {
                    out.push_str(",\"description\":");
                    out.push_str(&Value::from(description.as_str()).to_string());
                }
                out.push_str(
                    ",\"parameters\":{\"type\":\"object\",\"properties\":{\"input\":{\"type\":\
                     \"string\",\"description\":\"The freeform text payload for this tool.\"}},\
                     \"required\":[\"input\"],\"additionalProperties\":false}}}",
                );
                functions.push(out);
            }
            // Built-in tools (web search, MCP, ...) never reach the template.
            _ => {}
        }
    }
    Ok(format!("[{}]", functions.join(",")))
}

/// One function tool, `parameters` written through unchanged.
fn function(tool: &Tool<'_>, namespace: Option<&str>) -> Result<String, ParseError> {
    let name = tool.name.as_deref().ok_or(ParseError::InvalidTool)?;
    let name = match namespace {
        Some(namespace) => Cow::Owned(format!("{namespace}{NAMESPACE_SEPARATOR}{name}")),
        None => Cow::Borrowed(name),
    };
    let mut out = String::from("{\"type\":\"function\",\"function\":{\"name\":");
    out.push_str(&Value::from(&*name).to_string());
    if let Some(description) = &tool.description {
        out.push_str(",\"description\":");
        out.push_str(&Value::from(description.as_str()).to_string());
    }
    if let Some(parameters) = tool.parameters {
        out.push_str(",\"parameters\":");
        out.push_str(parameters.get());
    }
    for (key, flag) in [
        ("strict", tool.strict),
        ("defer_loading", tool.defer_loading),
    ] {
        if let Some(flag) = flag {
            out.push_str(&format!(",\"{key}\":{flag}"));
        }
    }
    out.push_str("}}");
    Ok(out)
}

#[cfg(test)]
mod tests;
