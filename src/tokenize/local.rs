//! A model's own tokenizer in process: a `tokenizer.json` (HF `tokenizers`, the same library
//! behind vLLM's fast tokenizers) and, for chat requests, its chat template. No network round
//! trip; [`super::Tokenizer`] checks a sample of the answers against a replica's `/tokenize`
//! and stops using one that disagrees.
//!
//! Loading follows vLLM and `transformers`: the template is `chat_template=PATH` when given,
//! else the `chat_template` of the `tokenizer_config.json` beside the tokenizer, else a
//! `chat_template.jinja` beside it (what recent `save_pretrained` writes); `bos_token` and
//! `eos_token` come from `tokenizer_config.json`. Without a template, chat goes to `/tokenize`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use super::chat::{ChatOptions, ChatTemplate};

/// Why a local tokenizer could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LocalTokenizerError {
    #[error("cannot load tokenizer {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("local tokenization failed: {0}")]
    Encode(String),
    #[error("chat template: {0}")]
    Chat(#[from] super::chat::ChatTemplateError),
    #[error("messages are not a JSON array of objects: {0}")]
    Messages(String),
}

/// A loaded tokenizer (and chat template), shared by every request for its model.
#[derive(Clone)]
pub struct LocalTokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    chat: Option<Arc<ChatTemplate>>,
}

fn load_error(path: &Path, reason: impl ToString) -> LocalTokenizerError {
    LocalTokenizerError::Load {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// A special token as `tokenizer_config.json` writes it: a string or `{"content": …}`.
fn special_token(config: &Value, key: &str) -> String {
    match config.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        None => String::new(),
    }
}

impl LocalTokenizer {
    /// A `tokenizer.json` alone: completion prompts only.
    pub fn from_file(path: &Path) -> Result<Self, LocalTokenizerError> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| load_error(path, e))?;
        Ok(LocalTokenizer {
            inner: Arc::new(inner),
            chat: None,
        })
    }

    /// `tokenizer`: a `tokenizer.json` or a model directory holding one; `chat_template`: a
    /// Jinja file overriding the one in `tokenizer_config.json`.
    pub fn load(
        tokenizer: &Path,
        chat_template: Option<&Path>,
    ) -> Result<Self, LocalTokenizerError> {
        let file: PathBuf = if tokenizer.is_dir() {
            tokenizer.join("tokenizer.json")
        } else {
            tokenizer.to_path_buf()
        };
        let mut local = LocalTokenizer::from_file(&file)?;
        let config_path = file.with_file_name("tokenizer_config.json");
        let config: Value = match std::fs::read(&config_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| load_error(&config_path, e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Value::Null,
            Err(e) => return Err(load_error(&config_path, e)),
        };
        let source = match chat_template {
            Some(path) => Some(std::fs::read_to_string(path).map_err(|e| load_error(path, e))?),
            None => match config.get("chat_template") {
                Some(Value::String(t)) => Some(t.clone()),
                // Named templates: vLLM uses "default".
                Some(Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                _ => {
                    let beside = file.with_file_name("chat_template.jinja");
                    match std::fs::read_to_string(&beside) {
                        Ok(t) => Some(t),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                        Err(e) => return Err(load_error(&beside, e)),
                    }
                }
            },
        };
        if let Some(source) = source {
            let template = ChatTemplate::new(
                source,
                special_token(&config, "bos_token"),
                special_token(&config, "eos_token"),
            )?;
            local.chat = Some(Arc::new(template));
        }
        Ok(local)
    }

    /// Whether chat requests can be tokenized here.
    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// Token ids of a completion prompt, with special tokens added as vLLM's
    /// `/v1/completions` does by default.
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>, LocalTokenizerError> {
        self.encode(prompt, true)
    }

    /// Token ids of a chat (`messages` as raw JSON), rendered with the template and encoded
    /// without added special tokens, as vLLM's chat endpoints do by default.
    pub fn encode_chat(
        &self,
        messages: &str,
        opts: ChatOptions,
    ) -> Result<Vec<u32>, LocalTokenizerError> {
        let template = self.chat.as_ref().ok_or_else(|| {
            LocalTokenizerError::Chat(super::chat::ChatTemplateError::Template(
                "no chat template loaded".into(),
            ))
        })?;
        let messages: Vec<Value> = serde_json::from_str(messages)
            .map_err(|e| LocalTokenizerError::Messages(e.to_string()))?;
        let text = template.render(&messages, opts)?;
        self.encode(&text, false)
    }

    fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, LocalTokenizerError> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| LocalTokenizerError::Encode(e.to_string()))
    }
}

impl std::fmt::Debug for LocalTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTokenizer")
            .field("vocab", &self.inner.get_vocab_size(true))
            .field("chat_template", &self.chat.is_some())
            .finish()
    }
}
