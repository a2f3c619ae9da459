//! The simulated model's tokenizer: a byte-level BPE loaded with Hugging Face's `tokenizers`
//! from a `tokenizer.json` (the repo ships `sim/assets/tokenizer.json`; `--tokenizer`
//! picks another), and a chat template rendered the way `transformers` renders one (the
//! router's own [`ChatTemplate`]), so chat turns share prefixes exactly as they do on a real
//! model.
//!
//! Concurrency: a [`SimTokenizer`] is immutable after construction and shared by reference
//! (`Arc`) between HTTP handlers; every method takes `&self`.

use std::path::Path;

use llmgw::tokenize::{ChatTemplate, ChatTemplateError};
use serde_json::Value;

/// The tokenizer the simulator ships (trained by `assets/train_tokenizer.py`).
pub const DEFAULT_TOKENIZER_JSON: &str = include_str!("../assets/tokenizer.json");

/// The default chat template: a BOS, then `<|start|>role\ncontent<|end|>\n` per message.
pub const DEFAULT_CHAT_TEMPLATE: &str = include_str!("../assets/chat_template.jinja");

/// The shipped tokenizer's special tokens (also in `assets/tokenizer_config.json`).
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

impl From<ChatTemplateError> for TokenizerError {
    fn from(e: ChatTemplateError) -> Self {
        match e {
            ChatTemplateError::Template(t) => TokenizerError::Template(t),
            ChatTemplateError::Render(r) => TokenizerError::Render(r),
        }
    }
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
    template: ChatTemplate,
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
        let template = ChatTemplate::new(template, BOS, EOS)?;
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
            template,
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
        let opts = llmgw::tokenize::ChatOptions {
            add_generation_prompt: opts.add_generation_prompt,
            continue_final_message: opts.continue_final_message,
        };
        Ok(self.template.render(messages, opts)?)
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
