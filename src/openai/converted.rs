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
