//! A model's own tokenizer in process: a `tokenizer.json` (HF `tokenizers`, the same library
//! behind vLLM's fast tokenizers) and, for chat requests, its chat template. No network round
//! trip; [`super::Tokenizer`] checks a sample of the answers against a replica's `/tokenize`
//! and stops using one that disagrees.
//!
//! A rendered chat is encoded piece by piece between its special tokens, with each piece's ids
//! cached: a conversation's system prompt and earlier turns are tokenized once, not on every
//! turn. This is exact because `tokenizers` itself splits a text at its (non-normalized) added
//! tokens first and encodes every piece on its own; the same leftmost-longest matching is
//! used here, and only for tokenizers whose added tokens strip no whitespace and need no word
//! boundary (otherwise the whole text is encoded at once).
//!
//! Loading follows vLLM and `transformers`: the template is `chat_template=PATH` when given,
//! else the `chat_template` of the `tokenizer_config.json` beside the tokenizer, else a
//! `chat_template.jinja` beside it (what recent `save_pretrained` writes); `bos_token` and
//! `eos_token` come from `tokenizer_config.json`. Without a template, chat goes to `/tokenize`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use lru::LruCache;
use parking_lot::Mutex;
use serde_json::Value;

use super::TokenCache;
use super::chat::{ChatOptions, ChatTemplate};

/// Bytes of token ids the per-piece cache of one model may hold.
const PIECE_CACHE_BYTES: usize = 16 << 20;

/// Finds the added tokens `tokenizers` splits a text at, as it does.
struct Splitter {
    matcher: AhoCorasick,
    ids: Vec<u32>,
    pieces: Mutex<TokenCache>,
}

impl Splitter {
    /// `None` when some added token would make piecewise encoding differ from the library's:
    /// one that strips neighbouring whitespace or must stand as a single word.
    fn new(tokenizer: &tokenizers::Tokenizer) -> Option<Splitter> {
        let added = tokenizer.get_added_tokens_decoder();
        let mut split_at: Vec<(&str, u32)> = Vec::new();
        for (id, token) in &added {
            if token.normalized {
                continue; // matched later, inside each piece, by the library itself
            }
            if token.lstrip || token.rstrip || token.single_word {
                return None;
            }
            split_at.push((token.content.as_str(), *id));
        }
        if split_at.is_empty() {
            return None;
        }
        // A fixed order, so that equal-length ties resolve the same way every time.
        split_at.sort_unstable_by_key(|(_, id)| *id);
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(split_at.iter().map(|(content, _)| content))
            .ok()?;
        Some(Splitter {
            matcher,
            ids: split_at.into_iter().map(|(_, id)| id).collect(),
            pieces: Mutex::new(TokenCache {
                max_bytes: PIECE_CACHE_BYTES,
                bytes: 0,
                entries: LruCache::unbounded(),
            }),
        })
    }
}

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
    splitter: Option<Arc<Splitter>>,
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
        let mut inner = tokenizers::Tokenizer::from_file(path).map_err(|e| load_error(path, e))?;
        // As transformers loads a fast tokenizer: no truncation or padding of its own.
        inner
            .with_truncation(None)
            .map_err(|e| load_error(path, e))?;
        inner.with_padding(None);
        let splitter = Splitter::new(&inner).map(Arc::new);
        Ok(LocalTokenizer {
            inner: Arc::new(inner),
            chat: None,
            splitter,
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
        self.encode_chat_as(messages, opts, false)
    }

    /// [`LocalTokenizer::encode_chat`], with the tokenizer's special tokens (its post-processor's
    /// BOS, say) added on top of what the template writes when `add_special_tokens` is set:
    /// what vLLM does for a chat that asks for it, and for every `/v1/responses` request.
    pub fn encode_chat_as(
        &self,
        messages: &str,
        opts: ChatOptions,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, LocalTokenizerError> {
        let template = self.chat.as_ref().ok_or_else(|| {
            LocalTokenizerError::Chat(super::chat::ChatTemplateError::Template(
                "no chat template loaded".into(),
            ))
        })?;
        let messages: Vec<Value> = serde_json::from_str(messages)
            .map_err(|e| LocalTokenizerError::Messages(e.to_string()))?;
        let text = template.render(&messages, opts)?;
        match &self.splitter {
            // Pieces carry no special tokens of their own; the whole text does.
            Some(splitter) if !add_special_tokens => self.encode_pieces(splitter, &text),
            _ => self.encode(&text, add_special_tokens),
        }
    }

    /// `text` without added special tokens, piece by piece between the added tokens, each
    /// piece's ids from the cache when it was seen before.
    fn encode_pieces(
        &self,
        splitter: &Splitter,
        text: &str,
    ) -> Result<Vec<u32>, LocalTokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        let piece = |ids: &mut Vec<u32>, piece: &str| -> Result<(), LocalTokenizerError> {
            if piece.is_empty() {
                return Ok(());
            }
            let key = xxhash_rust::xxh3::xxh3_128(piece.as_bytes());
            if let Some(cached) = splitter.pieces.lock().get(key) {
                ids.extend_from_slice(&cached);
                return Ok(());
            }
            let encoded: super::Tokens = self.encode(piece, false)?.into();
            ids.extend_from_slice(&encoded);
            splitter.pieces.lock().insert(key, encoded);
            Ok(())
        };
        let mut at = 0;
        for m in splitter.matcher.find_iter(text) {
            piece(&mut ids, &text[at..m.start()])?;
            ids.push(splitter.ids[m.pattern().as_usize()]);
            at = m.end();
        }
        piece(&mut ids, &text[at..])?;
        Ok(ids)
    }

    /// `text` piece by piece, when this tokenizer splits (for tests).
    #[cfg(test)]
    pub(super) fn encode_piecewise(
        &self,
        text: &str,
    ) -> Option<Result<Vec<u32>, LocalTokenizerError>> {
        self.splitter.as_ref().map(|s| self.encode_pieces(s, text))
    }

    /// The whole text at once (what the pieces must add up to).
    #[cfg(test)]
    pub(super) fn encode_whole(&self, text: &str) -> Result<Vec<u32>, LocalTokenizerError> {
        self.encode(text, false)
    }

    /// Whether chats are encoded piece by piece.
    pub fn splits_at_added_tokens(&self) -> bool {
        self.splitter.is_some()
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
            .field("piecewise", &self.splitter.is_some())
            .finish()
    }
}
