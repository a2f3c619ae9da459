//! The simulated model's tokenizer: a byte-level BPE loaded with Hugging Face's `tokenizers`
//! from a `tokenizer.json` (the repo ships `integration/assets/tokenizer.json`; `--tokenizer`
//! picks another), and a chat template rendered the way `transformers` renders one (Jinja with
//! `trim_blocks` and `lstrip_blocks`, through minijinja), so chat turns share prefixes exactly
//! as they do on a real model.
//!
//! Concurrency: a [`SimTokenizer`] is immutable after construction and shared by reference
//! (`Arc`) between HTTP handlers; every method takes `&self`.

use std::path::Path;

use serde_json::Value;

/// The tokenizer the simulator ships (trained by `assets/train_tokenizer.py`).
pub const DEFAULT_TOKENIZER_JSON: &str = include_str!("../../assets/tokenizer.json");

/// The default chat template: a BOS, then `<|start|>role\ncontent<|end|>\n` per message.
pub const DEFAULT_CHAT_TEMPLATE: &str = include_str!("../../assets/chat_template.jinja");

const BOS: &str = "<|bos|>";
const EOS: &str = "<|eos|>";

/// Tokenizer errors; each becomes a 400 (bad template input) or a startup failure.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load tokenizer: {0}")]
    Load(String),
    #[error("invalid chat template: {0}")]
    Template(String),
    #[error("{0}")]
    Render(String),
    #[error("tokenization failed: {0}")]
    Encode(String),
    #[error("token id {0} is out of vocabulary")]
    UnknownToken(u64),
}

/// How to render a chat request (the fields vLLM passes to `apply_chat_template`).
#[derive(Debug, Clone, Copy)]
pub struct ChatOptions {
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    pub add_special_tokens: bool,
}

/// Tokenizer plus chat template.
pub struct SimTokenizer {
    tok: tokenizers::Tokenizer,
    templates: minijinja::Environment<'static>,
    vocab_size: u32,
    /// Tokens that decode to a plain word with a leading space: what the simulated model emits.
    word_ids: Vec<u32>,
}

impl std::fmt::Debug for SimTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimTokenizer")
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl SimTokenizer {
    /// The shipped tokenizer and template.
    pub fn builtin() -> Result<Self, TokenizerError> {
        Self::from_parts(
            DEFAULT_TOKENIZER_JSON.as_bytes(),
            DEFAULT_CHAT_TEMPLATE.to_owned(),
        )
    }

    /// `tokenizer`: a tokenizer.json file or a directory holding one; `chat_template`: a file
    /// or an inline template (vLLM's `--chat-template` accepts both).
    pub fn load(
        tokenizer: Option<&Path>,
        chat_template: Option<&str>,
    ) -> Result<Self, TokenizerError> {
        let json = match tokenizer {
            None => DEFAULT_TOKENIZER_JSON.as_bytes().to_vec(),
            Some(path) => {
                let file = if path.is_dir() {
                    path.join("tokenizer.json")
                } else {
                    path.to_path_buf()
                };
                std::fs::read(&file)
                    .map_err(|e| TokenizerError::Load(format!("{}: {e}", file.display())))?
            }
        };
        let template = match chat_template {
            None => DEFAULT_CHAT_TEMPLATE.to_owned(),
            Some(t) if Path::new(t).is_file() => std::fs::read_to_string(t)
                .map_err(|e| TokenizerError::Template(format!("{t}: {e}")))?,
            Some(t) => t.to_owned(),
        };
        Self::from_parts(&json, template)
    }

    fn from_parts(json: &[u8], template: String) -> Result<Self, TokenizerError> {
        let tok = tokenizers::Tokenizer::from_bytes(json)
            .map_err(|e| TokenizerError::Load(e.to_string()))?;
        let mut templates = minijinja::Environment::new();
        templates.set_trim_blocks(true);
        templates.set_lstrip_blocks(true);
        templates.add_function(
            "raise_exception",
            |msg: String| -> Result<(), minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        templates
            .add_template_owned("chat", template)
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        let vocab_size = tok.get_vocab_size(true) as u32;
        let mut word_ids: Vec<u32> = tok
            .get_vocab(false)
            .into_iter()
            .filter(|(s, _)| {
                s.len() >= 3
                    && s.starts_with('Ġ')
                    && s.chars().skip(1).all(|c| c.is_ascii_alphabetic())
            })
            .map(|(_, id)| id)
            .collect();
        word_ids.sort_unstable();
        if word_ids.is_empty() {
            word_ids = (0..vocab_size).collect();
        }
        Ok(SimTokenizer {
            tok,
            templates,
            vocab_size,
            word_ids,
        })
    }

    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    /// Token ids the simulated model samples from.
    pub fn word_ids(&self) -> &[u32] {
        &self.word_ids
    }

    /// Tokenizes text; `add_special_tokens` prepends BOS as the post-processor says.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        self.tok
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// Text of token ids, special tokens skipped (as vLLM detokenizes output).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        if let Some(&bad) = ids.iter().find(|&&id| id >= self.vocab_size) {
            return Err(TokenizerError::UnknownToken(u64::from(bad)));
        }
        self.tok
            .decode(ids, true)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// The raw token strings (`convert_ids_to_tokens`).
    pub fn token_strs(&self, ids: &[u32]) -> Vec<String> {
        ids.iter()
            .map(|&id| self.tok.id_to_token(id).unwrap_or_default())
            .collect()
    }

    /// Renders messages with the chat template, as `apply_chat_template(tokenize=False)`.
    pub fn render_chat(
        &self,
        messages: &[Value],
        opts: ChatOptions,
    ) -> Result<String, TokenizerError> {
        let messages: Vec<Value> = messages.iter().map(normalize_message).collect();
        let template = self
            .templates
            .get_template("chat")
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        let ctx = minijinja::context! {
            messages => &messages,
            add_generation_prompt => opts.add_generation_prompt,
            bos_token => BOS,
            eos_token => EOS,
        };
        let mut rendered = template
            .render(ctx)
            .map_err(|e| TokenizerError::Render(e.to_string()))?;
        if opts.continue_final_message {
            let final_content = messages
                .last()
                .and_then(|m| m.get("content"))
                .and_then(Value::as_str)
                .unwrap_or_default();
            // transformers: cut right after the final message's content.
            let stripped = final_content.trim();
            match rendered.rfind(stripped) {
                Some(loc) if !stripped.is_empty() => {
                    let lstripped = final_content.trim_start();
                    let end = if rendered[loc..].starts_with(lstripped) {
                        loc + lstripped.len()
                    } else {
                        loc + stripped.len()
                    };
                    rendered.truncate(end);
                }
                _ => {
                    return Err(TokenizerError::Render(
                        "continue_final_message is set but the final message does not appear \
                         in the chat history"
                            .into(),
                    ));
                }
            }
        }
        Ok(rendered)
    }

    /// Renders and tokenizes a chat (vLLM's chat-style `/tokenize` and chat completions).
    pub fn encode_chat(
        &self,
        messages: &[Value],
        opts: ChatOptions,
    ) -> Result<Vec<u32>, TokenizerError> {
        let text = self.render_chat(messages, opts)?;
        self.encode(&text, opts.add_special_tokens)
    }
}

/// vLLM's "string" content format: a list of parts becomes their texts joined by newlines;
/// `null` content becomes empty.
fn normalize_message(message: &Value) -> Value {
    let mut message = message.clone();
    if let Some(obj) = message.as_object_mut() {
        let content = match obj.get("content") {
            Some(Value::Array(parts)) => Value::String(
                parts
                    .iter()
                    .filter_map(|p| match p {
                        Value::String(s) => Some(s.as_str()),
                        other => other.get("text").and_then(Value::as_str),
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
            Some(Value::Null) | None => Value::String(String::new()),
            Some(other) => other.clone(),
        };
        obj.insert("content".into(), content);
    }
    message
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn tok() -> SimTokenizer {
        SimTokenizer::builtin().unwrap()
    }

    const GEN: ChatOptions = ChatOptions {
        add_generation_prompt: true,
        continue_final_message: false,
        add_special_tokens: false,
    };

    #[test]
    fn encode_decode_round_trips_and_bos_is_optional() {
        let t = tok();
        let text = "Licensed under the Apache License, Version 2.0";
        let plain = t.encode(text, false).unwrap();
        let with_bos = t.encode(text, true).unwrap();
        assert_eq!(with_bos[0], 1, "BOS is token 1");
        assert_eq!(&with_bos[1..], &plain[..]);
        assert!(
            plain.len() < text.len() / 2,
            "BPE merges: {} tokens",
            plain.len()
        );
        assert_eq!(t.decode(&with_bos).unwrap(), text);
        assert!(matches!(
            t.decode(&[t.vocab_size()]),
            Err(TokenizerError::UnknownToken(_))
        ));
    }

    #[test]
    fn chat_turns_share_a_token_prefix() {
        let t = tok();
        let turn1 = vec![
            json!({"role": "system", "content": "You are a careful assistant."}),
            json!({"role": "user", "content": "What does the license grant?"}),
        ];
        let mut turn2 = turn1.clone();
        turn2.push(json!({"role": "assistant", "content": "A copyright license."}));
        turn2.push(json!({"role": "user", "content": "And patents?"}));
        let a = t.encode_chat(&turn1, GEN).unwrap();
        let no_gen = ChatOptions {
            add_generation_prompt: false,
            ..GEN
        };
        let a_hist = t.encode_chat(&turn1, no_gen).unwrap();
        let b = t.encode_chat(&turn2, GEN).unwrap();
        assert_eq!(&b[..a_hist.len()], &a_hist[..]);
        assert!(a.len() > a_hist.len());
        let text = t.render_chat(&turn1, GEN).unwrap();
        assert!(text.starts_with("<|bos|><|start|>system\nYou are a careful assistant.<|end|>\n"));
        assert!(text.ends_with("<|start|>assistant\n"), "{text:?}");
    }

    #[test]
    fn continue_final_message_stops_after_its_content() {
        let t = tok();
        let msgs = vec![
            json!({"role": "user", "content": "Hi"}),
            json!({"role": "assistant", "content": [{"type": "text", "text": "The answer is"}]}),
        ];
        let opts = ChatOptions {
            add_generation_prompt: false,
            continue_final_message: true,
            add_special_tokens: false,
        };
        let text = t.render_chat(&msgs, opts).unwrap();
        assert!(
            text.ends_with("<|start|>assistant\nThe answer is"),
            "{text:?}"
        );
    }

    #[test]
    fn a_bad_template_is_a_load_error_and_raise_exception_a_render_error() {
        assert!(matches!(
            SimTokenizer::load(None, Some("{% for %}")),
            Err(TokenizerError::Template(_))
        ));
        let t = SimTokenizer::load(None, Some("{{ raise_exception('nope') }}")).unwrap();
        assert!(matches!(
            t.render_chat(&[], GEN),
            Err(TokenizerError::Render(_))
        ));
    }
}
