//! What the endpoints whose bodies are converted into a chat (`anthropic`, `responses`) share:
//! reading the body whole, and the conversation being built with the first reason the router
//! cannot reproduce how vLLM renders it.
//!
//! Pure functions and plain values.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::Value;

use super::{ParseError, skim};

/// The body as one well-formed JSON object (the skimmer's errors say where it is not),
/// deserialized whole, and its non-empty `model`.
pub(super) fn read_body<'a, R: Deserialize<'a>>(
    body: &'a str,
    model: impl FnOnce(&mut R) -> Option<Cow<'a, str>>,
) -> Result<(R, String), ParseError> {
    let bytes = body.as_bytes();
    skim::walk_object(bytes, |_, start| skim::value_end(bytes, start))?;
    let mut request: R = serde_json::from_str(body).map_err(|e| invalid("request", e))?;
    let model = model(&mut request)
        .filter(|m| !m.is_empty())
        .ok_or(ParseError::MissingModel)?
        .into_owned();
    Ok((request, model))
}

pub(super) fn invalid(field: &'static str, source: serde_json::Error) -> ParseError {
    ParseError::InvalidField { field, source }
}

/// The chat messages built so far, and the first reason their rendering cannot be trusted.
#[derive(Default)]
pub(super) struct Conversion {
    pub(super) messages: Vec<Value>,
    pub(super) unreproducible: Option<&'static str>,
}

impl Conversion {
    pub(super) fn with_capacity(messages: usize) -> Conversion {
        Conversion {
            messages: Vec::with_capacity(messages),
            unreproducible: None,
        }
    }

    pub(super) fn cannot_reproduce(&mut self, why: &'static str) {
        self.unreproducible.get_or_insert(why);
    }
}

/// What the converted endpoints' tests against vLLM's vectors share.
#[cfg(test)]
pub(super) mod test_support {
    use serde_json::Value;

    use crate::openai::{ChatInput, ParsedRequest, RequestInput};

    pub(in crate::openai) fn chat_of(request: &ParsedRequest) -> &ChatInput {
        match &request.input {
            RequestInput::Chat(chat) => chat,
            RequestInput::Completion(_) => panic!("not a chat"),
        }
    }

    /// `value` without its null members (vLLM's model dumps write every optional field).
    fn strip_nulls(value: Value) -> Value {
        match value {
            Value::Object(map) => Value::Object(
                map.into_iter()
                    .filter(|(_, v)| !v.is_null())
                    .map(|(k, v)| (k, strip_nulls(v)))
                    .collect(),
            ),
            Value::Array(items) => Value::Array(items.into_iter().map(strip_nulls).collect()),
            other => other,
        }
    }

    /// The request's tools, `cache_salt`, `stream` and template kwargs are those of vLLM's
    /// vector `case`.
    pub(in crate::openai) fn assert_settings_match(
        name: &str,
        request: &ParsedRequest,
        case: &Value,
    ) {
        let chat = chat_of(request);
        let tools = chat
            .tools
            .as_ref()
            .map(|t| strip_nulls(serde_json::from_str(t.get()).expect("tools JSON")));
        assert_eq!(tools.unwrap_or(Value::Null), case["tools"], "{name}: tools");
        assert_eq!(
            request.cache_salt.as_deref(),
            case["cache_salt"].as_str(),
            "{name}: cache_salt"
        );
        assert_eq!(request.stream, case["stream"] == true, "{name}: stream");
        let kwargs = chat
            .chat_template_kwargs
            .as_ref()
            .map(|k| serde_json::from_str::<Value>(k.get()).expect("kwargs JSON"));
        assert_eq!(
            kwargs.unwrap_or(Value::Null),
            case["chat_template_kwargs"],
            "{name}: kwargs"
        );
    }
}
