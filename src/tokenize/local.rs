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
//! Plain text (a completion prompt, or a long piece of a chat) is cut further, into segments
//! that end with a line feed before an ASCII letter, each segment's ids cached: a growing
//! completion prompt is tokenized only in its new part. See [`Segmenter`] for why this is
//! exact and for which tokenizers it is done.
//!
//! Loading follows vLLM and `transformers`: the template is `chat_template=PATH` when given,
//! else the `chat_template` of the `tokenizer_config.json` beside the tokenizer, else a
//! `chat_template.jinja` beside it (what recent `save_pretrained` writes); `bos_token` and
//! `eos_token` come from `tokenizer_config.json`. Without a template, chat goes to `/tokenize`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use parking_lot::Mutex;
use serde_json::Value;

use super::TokenCache;
use super::chat::{ChatOptions, ChatTemplate};

/// Bytes of token ids the per-piece cache of one model may hold: room for the own context of
/// 500 conversations of 55 KB each, which a 16 MiB cache thrashed under bench-throughput.
const PIECE_CACHE_BYTES: usize = 64 << 20;

/// Finds the added tokens `tokenizers` splits a text at, as it does.
struct Splitter {
    matcher: AhoCorasick,
    ids: Vec<u32>,
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
        })
    }
}

/// A segment is at least this long (bytes), so that a text of many short lines is not
/// encoded a line at a time.
const MIN_SEGMENT_BYTES: usize = 256;

/// Keeps the keys of segments (encoded as followed by a letter) apart from those of whole
/// pieces (encoded as followed by an added token or the end of the text).
const SEGMENT_SEED: u64 = 0x7365_676d_656e_7400;

/// The letter a segment is encoded with, to encode it as it sits before the next one.
const PROBE: &str = "a";

/// Cuts plain text where every tokenizer it accepts always splits, whatever comes before or
/// after: right after a line feed, before an ASCII letter.
///
/// Why that is exact, for the pipelines [`Segmenter::new`] accepts:
/// - *Normalizer* none or NFC: NFC composes nothing across a line feed (a starter that
///   composes with nothing), so the text normalizes as its two halves do.
/// - *Pre-tokenizer* GPT-2's byte-level regex, or a `Split` by the cl100k/Llama-3 or Qwen2
///   regex before a byte-level mapping without prefix space. In none of these regexes can one
///   match hold a line feed followed by a letter (letters join only a space or a non-newline
///   mark before them; newline runs end at the first non-space), so a match always ends at
///   the cut. The regexes have no look-behind or anchors, so matching from the cut on sees
///   only the text after it; their only look-ahead, `\s+(?!\S)`, sees the letter there in
///   every text cut at that point.
/// - *Model* BPE without dropout: each pre-token is encoded on its own, deterministically.
/// - *Post-processor* that only puts special tokens in front (none, byte-level offsets, a
///   template `[specials…, A]`): checked again on an example at load.
///
/// A segment is encoded followed by [`PROBE`], whose single token is then dropped, so its last
/// pre-token is split as it is before the next segment's letter; the text's last segment is
/// encoded as it is, since nothing follows it. Added tokens still cut first, as the library
/// does, so each piece between them is cut in segments independently.
struct Segmenter {
    /// [`MIN_SEGMENT_BYTES`] (smaller in tests, for many cuts in short texts).
    min_bytes: usize,
    /// The token of [`PROBE`] alone.
    probe: u32,
    /// What the post-processor puts before a text encoded with special tokens.
    prefix_specials: Vec<u32>,
}

/// The pre-tokenizer regexes whose matches always end at a line feed before a letter (see
/// [`Segmenter`]); as `tokenizer.json` spells them.
const SEGMENTABLE_SPLITS: [&str; 2] = [
    // cl100k_base, Llama 3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    // Qwen2, Qwen2.5, Qwen3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

impl Segmenter {
    /// `None` unless the tokenizer's pipeline is one cutting is proven exact for.
    fn new(tokenizer: &tokenizers::Tokenizer) -> Option<Segmenter> {
        let normalizer = serde_json::to_value(tokenizer.get_normalizer()).ok()?;
        let pre_tokenizer = serde_json::to_value(tokenizer.get_pre_tokenizer()).ok()?;
        let post_processor = serde_json::to_value(tokenizer.get_post_processor()).ok()?;
        let tokenizers::ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
            return None;
        };
        let added_ok = tokenizer.get_added_tokens_decoder().values().all(|t| {
            // Normalized added tokens are matched inside pieces, after normalization.
            !t.normalized && !t.lstrip && !t.rstrip && !t.single_word
        });
        if bpe.dropout.is_some()
            || !added_ok
            || !normalizer_is_local(&normalizer)
            || !pre_tokenizer_splits_at_cuts(&pre_tokenizer)
            || !post_processor_only_prefixes(&post_processor)
        {
            return None;
        }
        let encode = |text: &str, special: bool| {
            tokenizer
                .encode_fast(text, special)
                .ok()
                .map(|e| e.get_ids().to_vec())
        };
        let (alone, with_specials) = (encode(PROBE, false)?, encode(PROBE, true)?);
        let [probe] = alone[..] else { return None };
        let prefix = with_specials.strip_suffix(&alone[..])?;
        Some(Segmenter {
            min_bytes: MIN_SEGMENT_BYTES,
            probe,
            prefix_specials: prefix.to_vec(),
        })
    }
}

/// A pipeline component's `"type"` as `tokenizer.json` writes it.
fn kind(component: &Value) -> Option<&str> {
    component.get("type").and_then(Value::as_str)
}

/// Whether every member of a `Sequence` component (listed under `key`) passes `check`.
fn sequence_all(sequence: &Value, key: &str, check: fn(&Value) -> bool) -> bool {
    sequence
        .get(key)
        .and_then(Value::as_array)
        .is_some_and(|all| all.iter().all(check))
}

fn normalizer_is_local(normalizer: &Value) -> bool {
    match kind(normalizer) {
        None => normalizer.is_null(),
        Some("NFC") => true,
        Some("Sequence") => sequence_all(normalizer, "normalizers", normalizer_is_local),
        Some(_) => false,
    }
}

fn pre_tokenizer_splits_at_cuts(pre_tokenizer: &Value) -> bool {
    let byte_level = |v: &Value, use_regex: bool| {
        kind(v) == Some("ByteLevel")
            && v.get("add_prefix_space").and_then(Value::as_bool) == Some(false)
            && v.get("use_regex").and_then(Value::as_bool) == Some(use_regex)
    };
    if byte_level(pre_tokenizer, true) {
        return true; // GPT-2's regex
    }
    let Some([split, mapping]) = (kind(pre_tokenizer) == Some("Sequence"))
        .then(|| pre_tokenizer.get("pretokenizers").and_then(Value::as_array))
        .flatten()
        .map(Vec::as_slice)
    else {
        return false;
    };
    kind(split) == Some("Split")
        && split.get("behavior").and_then(Value::as_str) == Some("Isolated")
        && split.get("invert").and_then(Value::as_bool) == Some(false)
        && split
            .pointer("/pattern/Regex")
            .and_then(Value::as_str)
            .is_some_and(|regex| SEGMENTABLE_SPLITS.contains(&regex))
        && byte_level(mapping, false)
}

fn post_processor_only_prefixes(post_processor: &Value) -> bool {
    match kind(post_processor) {
        None => post_processor.is_null(),
        Some("ByteLevel") => true,
        Some("TemplateProcessing") => post_processor
            .get("single")
            .and_then(Value::as_array)
            .and_then(|single| single.split_last())
            .is_some_and(|(last, before)| {
                last.pointer("/Sequence/id").and_then(Value::as_str) == Some("A")
                    && before.iter().all(|p| p.get("SpecialToken").is_some())
            }),
        Some("Sequence") => {
            sequence_all(post_processor, "processors", post_processor_only_prefixes)
        }
        Some(_) => false,
    }
}

/// The first cut at or after `from` (and after the text's start): a byte after a line feed
/// that is an ASCII letter.
fn next_cut(text: &str, from: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut newline_from = from.max(1) - 1;
    loop {
        let cut = newline_from
            + bytes
                .get(newline_from..)?
                .iter()
                .position(|&b| b == b'\n')?
            + 1;
        if bytes.get(cut).is_some_and(u8::is_ascii_alphabetic) {
            return Some(cut);
        }
        newline_from = cut;
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
    segmenter: Option<Arc<Segmenter>>,
    /// Ids of pieces (between added tokens) and of segments, by a hash of their text.
    pieces: Arc<Mutex<TokenCache>>,
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
        let segmenter = Segmenter::new(&inner).map(Arc::new);
        Ok(LocalTokenizer {
            inner: Arc::new(inner),
            chat: None,
            splitter,
            segmenter,
            pieces: Arc::new(Mutex::new(TokenCache::new(PIECE_CACHE_BYTES))),
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
        match &self.segmenter {
            // Short prompts have no segments to reuse.
            Some(segmenter) if prompt.len() >= 2 * segmenter.min_bytes => {
                let mut ids = Vec::with_capacity(prompt.len() / 3);
                ids.extend_from_slice(&segmenter.prefix_specials);
                self.encode_pieces(prompt, &mut ids)?;
                Ok(ids)
            }
            _ => self.encode(prompt, true),
        }
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
        // Pieces carry no special tokens of their own; the whole text does, in front only
        // where a segmenter was made.
        let prefix = match (&self.segmenter, add_special_tokens) {
            (_, false) => &[][..],
            (Some(segmenter), true) => &segmenter.prefix_specials[..],
            (None, true) => return self.encode(&text, true),
        };
        if self.splitter.is_none() && self.segmenter.is_none() {
            return self.encode(&text, false);
        }
        let mut ids = Vec::with_capacity(prefix.len() + text.len() / 3);
        ids.extend_from_slice(prefix);
        self.encode_pieces(&text, &mut ids)?;
        Ok(ids)
    }

    /// `text` without added special tokens, appended to `ids` piece by piece between the added
    /// tokens (when the tokenizer splits at them), each piece in segments (when it has a
    /// segmenter).
    pub(super) fn encode_pieces(
        &self,
        text: &str,
        ids: &mut Vec<u32>,
    ) -> Result<(), LocalTokenizerError> {
        let mut at = 0;
        if let Some(splitter) = &self.splitter {
            for m in splitter.matcher.find_iter(text) {
                self.encode_piece(&text[at..m.start()], ids)?;
                ids.push(splitter.ids[m.pattern().as_usize()]);
                at = m.end();
            }
        }
        self.encode_piece(&text[at..], ids)
    }

    /// A piece of plain text (between added tokens, or the whole text), its segments' and its
    /// end's ids from the cache when seen before.
    fn encode_piece(&self, piece: &str, ids: &mut Vec<u32>) -> Result<(), LocalTokenizerError> {
        let mut start = 0;
        if let Some(segmenter) = &self.segmenter {
            while let Some(cut) = next_cut(piece, start + segmenter.min_bytes) {
                let segment = &piece[start..cut];
                let key = xxhash_rust::xxh3::xxh3_128_with_seed(segment.as_bytes(), SEGMENT_SEED);
                if let Some(cached) = self.pieces.lock().get(key) {
                    ids.extend_from_slice(&cached);
                    start = cut;
                    continue;
                }
                let mut probed = self.encode(&[segment, PROBE].concat(), false)?;
                if probed.pop() != Some(segmenter.probe) {
                    // Not as [`Segmenter`] proves; the rest is encoded whole instead.
                    tracing::debug!(
                        "a segment did not end before its probe letter; encoding the rest whole"
                    );
                    break;
                }
                ids.extend_from_slice(&probed);
                self.pieces.lock().insert(key, probed.into());
                start = cut;
            }
        }
        let rest = &piece[start..];
        if rest.is_empty() {
            return Ok(());
        }
        let key = xxhash_rust::xxh3::xxh3_128(rest.as_bytes());
        if let Some(cached) = self.pieces.lock().get(key) {
            ids.extend_from_slice(&cached);
            return Ok(());
        }
        let encoded: super::Tokens = self.encode(rest, false)?.into();
        ids.extend_from_slice(&encoded);
        self.pieces.lock().insert(key, encoded);
        Ok(())
    }

    /// `text` piece by piece, when this tokenizer splits (for tests).
    #[cfg(test)]
    pub(super) fn encode_piecewise(
        &self,
        text: &str,
    ) -> Option<Result<Vec<u32>, LocalTokenizerError>> {
        self.splitter.as_ref()?;
        let mut ids = Vec::new();
        Some(self.encode_pieces(text, &mut ids).map(|()| ids))
    }

    /// This tokenizer cutting segments of at least `min_bytes` (for tests: many cuts in
    /// short texts).
    #[cfg(test)]
    pub(super) fn with_min_segment(mut self, min_bytes: usize) -> Self {
        if let Some(segmenter) = &self.segmenter {
            self.segmenter = Some(Arc::new(Segmenter {
                min_bytes,
                probe: segmenter.probe,
                prefix_specials: segmenter.prefix_specials.clone(),
            }));
        }
        self
    }

    /// Segments and pieces cached now (for tests).
    #[cfg(test)]
    pub(super) fn cached_pieces(&self) -> usize {
        self.pieces.lock().entries.len()
    }

    /// The whole text at once, with special tokens (what a segmented prompt must equal).
    #[cfg(test)]
    pub(super) fn encode_whole_prompt(&self, text: &str) -> Result<Vec<u32>, LocalTokenizerError> {
        self.encode(text, true)
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

    /// Whether plain text is cut into cached segments (see `Segmenter`).
    pub fn cuts_in_segments(&self) -> bool {
        self.segmenter.is_some()
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
            .field("segments", &self.segmenter.is_some())
            .finish()
    }
}
