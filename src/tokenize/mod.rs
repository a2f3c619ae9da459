//! Tokenization: the exact token ids the engine will hash for a request, from a replica's own
//! `/tokenize` (same text, or same messages, tools, template kwargs and generation flags).
//!
//! Answers are cached in a byte-bounded LRU keyed by a 128-bit hash of the model and the
//! request's content (the raw JSON of messages/tools/kwargs as the client sent them, so two
//! spellings of one conversation are two entries, never a wrong answer). A call has a deadline:
//! past it the caller falls back to the approximate tier, while the call itself runs on in its
//! own task and its late answer still fills the cache for the next request.
//!
//! Concurrency: the cache is one `parking_lot::Mutex` held for a map operation; HTTP calls run
//! in spawned tasks and report back through a oneshot channel.

mod local;
#[cfg(test)]
mod tests;

pub use local::{LocalTokenizer, LocalTokenizerError};

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lru::LruCache;
use parking_lot::Mutex;
use serde::Deserialize;

use crate::openai::{ParsedRequest, Prompt, RequestInput};

/// Settings of the tokenizer client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// How long a request waits for tokens before routing without them.
    pub deadline: Duration,
    /// How long a call may run in the background to fill the cache.
    pub call_timeout: Duration,
    /// Bytes of token ids (plus per-entry overhead) the cache may hold.
    pub cache_bytes: usize,
}

impl Default for TokenizerConfig {
    fn default() -> Self {
        TokenizerConfig {
            deadline: Duration::from_millis(50),
            call_timeout: Duration::from_secs(5),
            cache_bytes: 64 << 20,
        }
    }
}

/// Why no tokens are available for a request.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum TokenizeError {
    #[error("no replica to tokenize with")]
    NoReplica,
    #[error("tokenization took longer than the {0:?} deadline")]
    Timeout(Duration),
    #[error("tokenize call to {replica} failed: {reason}")]
    Call { replica: String, reason: String },
}

impl TokenizeError {
    /// A short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            TokenizeError::NoReplica => "tokenize_no_replica",
            TokenizeError::Timeout(_) => "tokenize_timeout",
            TokenizeError::Call { .. } => "tokenize_error",
        }
    }
}

/// Cache counters (read by the metrics exporter).
#[derive(Debug, Default)]
pub struct TokenizeStats {
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub calls: AtomicU64,
    pub call_errors: AtomicU64,
    pub timeouts: AtomicU64,
}

/// Token ids of a request.
pub type Tokens = Arc<[u32]>;

type CacheKey = u128;

/// Per-entry bookkeeping beyond the ids themselves (key, Arc header, LRU links).
const ENTRY_OVERHEAD: usize = 64;

struct TokenCache {
    max_bytes: usize,
    bytes: usize,
    entries: LruCache<CacheKey, Tokens>,
}

impl TokenCache {
    fn entry_bytes(tokens: &Tokens) -> usize {
        tokens.len() * std::mem::size_of::<u32>() + ENTRY_OVERHEAD
    }

    fn get(&mut self, key: CacheKey) -> Option<Tokens> {
        self.entries.get(&key).cloned()
    }

    fn insert(&mut self, key: CacheKey, tokens: Tokens) {
        let size = Self::entry_bytes(&tokens);
        if size > self.max_bytes {
            return;
        }
        if let Some(old) = self.entries.put(key, tokens) {
            self.bytes -= Self::entry_bytes(&old);
        }
        self.bytes += size;
        while self.bytes > self.max_bytes {
            match self.entries.pop_lru() {
                Some((_, evicted)) => self.bytes -= Self::entry_bytes(&evicted),
                None => break,
            }
        }
    }
}

/// The body of a `/tokenize` call, written by hand so that the request's raw JSON (a prompt
/// literal, chat messages, tools) is forwarded byte for byte instead of decoded and re-encoded.
fn tokenize_body(request: &ParsedRequest) -> Vec<u8> {
    let raw_size = match &request.input {
        RequestInput::Completion(Prompt::Text(text)) => text.raw_json().get().len(),
        RequestInput::Completion(Prompt::TokenIds(_)) => 0,
        RequestInput::Chat(chat) => {
            chat.messages.get().len()
                + chat.tools.as_ref().map_or(0, |t| t.get().len())
                + chat
                    .chat_template_kwargs
                    .as_ref()
                    .map_or(0, |k| k.get().len())
        }
    };
    let mut body = Vec::with_capacity(raw_size + request.model.len() + 160);
    body.extend_from_slice(b"{\"model\":");
    json_string(&mut body, &request.model);
    match &request.input {
        RequestInput::Completion(Prompt::Text(text)) => {
            member(&mut body, "prompt", text.raw_json().get());
        }
        // Token-id prompts never reach /tokenize.
        RequestInput::Completion(Prompt::TokenIds(_)) => {}
        RequestInput::Chat(chat) => {
            member(&mut body, "messages", chat.messages.get());
            if let Some(tools) = &chat.tools {
                member(&mut body, "tools", tools.get());
            }
            if let Some(kwargs) = &chat.chat_template_kwargs {
                member(&mut body, "chat_template_kwargs", kwargs.get());
            }
            let flag = |on: bool| if on { "true" } else { "false" };
            member(
                &mut body,
                "add_generation_prompt",
                flag(chat.add_generation_prompt.unwrap_or(true)),
            );
            member(
                &mut body,
                "continue_final_message",
                flag(chat.continue_final_message.unwrap_or(false)),
            );
        }
    }
    body.push(b'}');
    body
}

/// Appends `,"name":raw`.
fn member(body: &mut Vec<u8>, name: &str, raw: &str) {
    body.extend_from_slice(b",\"");
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(b"\":");
    body.extend_from_slice(raw.as_bytes());
}

fn json_string(out: &mut Vec<u8>, text: &str) {
    // Writing a string into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, text);
}

#[derive(Deserialize)]
struct TokenizeResponse {
    tokens: Vec<u32>,
}

/// Tokenizes requests through replicas' `/tokenize`, with a cache and a deadline.
pub struct Tokenizer {
    config: TokenizerConfig,
    client: reqwest::Client,
    cache: Arc<Mutex<TokenCache>>,
    stats: Arc<TokenizeStats>,
    /// Models whose completion prompts are tokenized in process.
    local: HashMap<String, LocalTokenizer>,
}

impl Tokenizer {
    pub fn new(config: TokenizerConfig) -> Self {
        Tokenizer {
            config,
            client: reqwest::Client::builder()
                .timeout(config.call_timeout)
                .pool_idle_timeout(Duration::from_secs(30))
                .build()
                .unwrap_or_default(),
            cache: Arc::new(Mutex::new(TokenCache {
                max_bytes: config.cache_bytes,
                bytes: 0,
                entries: LruCache::unbounded(),
            })),
            stats: Arc::new(TokenizeStats::default()),
            local: HashMap::new(),
        }
    }

    /// Tokenizes `model`'s completion prompts with `tokenizer` instead of calling `/tokenize`.
    pub fn with_local(mut self, model: impl Into<String>, tokenizer: LocalTokenizer) -> Self {
        self.local.insert(model.into(), tokenizer);
        self
    }

    pub fn stats(&self) -> &Arc<TokenizeStats> {
        &self.stats
    }

    /// Bytes the cache holds now.
    pub fn cache_bytes(&self) -> usize {
        self.cache.lock().bytes
    }

    /// The request's token ids: given directly for token-array prompts, else from the cache or
    /// from the first reachable of `replicas` (`host:port`, least loaded first) within the
    /// deadline.
    pub async fn tokens(
        &self,
        request: &ParsedRequest,
        replicas: &[&str],
    ) -> Result<Tokens, TokenizeError> {
        match &request.input {
            RequestInput::Completion(Prompt::TokenIds(ids)) => {
                return Ok(Arc::from(ids.as_slice()));
            }
            RequestInput::Completion(Prompt::Text(text))
                if self.local.contains_key(&request.model) =>
            {
                return self.tokens_locally(&request.model, text);
            }
            _ => {}
        }
        // Writing the body once gives both the cache key and the bytes to send.
        let body = tokenize_body(request);
        let key = xxhash_rust::xxh3::xxh3_128(&body);
        if let Some(tokens) = self.cache.lock().get(key) {
            self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(tokens);
        }
        self.stats.cache_misses.fetch_add(1, Ordering::Relaxed);
        if replicas.is_empty() {
            return Err(TokenizeError::NoReplica);
        }

        let (tx, rx) = tokio::sync::oneshot::channel();
        let client = self.client.clone();
        let cache = Arc::clone(&self.cache);
        let stats = Arc::clone(&self.stats);
        let replicas: Vec<String> = replicas.iter().map(|r| (*r).to_owned()).collect();
        tokio::spawn(async move {
            let result = call_first_reachable(&client, &replicas, body, &stats).await;
            if let Ok(tokens) = &result {
                cache.lock().insert(key, Arc::clone(tokens));
            }
            let _ = tx.send(result);
        });
        match tokio::time::timeout(self.config.deadline, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(TokenizeError::Call {
                replica: String::new(),
                reason: "tokenize task ended without an answer".to_owned(),
            }),
            Err(_) => {
                self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                Err(TokenizeError::Timeout(self.config.deadline))
            }
        }
    }
}

impl Tokenizer {
    fn tokens_locally(&self, model: &str, text: &str) -> Result<Tokens, TokenizeError> {
        let local = self.local.get(model).ok_or(TokenizeError::NoReplica)?;
        let key = xxhash_rust::xxh3::xxh3_128_with_seed(text.as_bytes(), local_seed(model));
        if let Some(tokens) = self.cache.lock().get(key) {
            self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(tokens);
        }
        self.stats.cache_misses.fetch_add(1, Ordering::Relaxed);
        let tokens: Tokens = local
            .encode_prompt(text)
            .map_err(|e| TokenizeError::Call {
                replica: "local".to_owned(),
                reason: e.to_string(),
            })?
            .into();
        self.cache.lock().insert(key, Arc::clone(&tokens));
        Ok(tokens)
    }
}

/// Keeps local-tokenizer cache keys apart from `/tokenize` ones and per model.
fn local_seed(model: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(model.as_bytes()) ^ 0x6c6f_6361_6c00_0000
}

/// Tries each replica in order until one answers; connection failures move on, an HTTP error
/// status from a reachable replica is the answer (the request itself is bad for the model).
async fn call_first_reachable(
    client: &reqwest::Client,
    replicas: &[String],
    body: Vec<u8>,
    stats: &TokenizeStats,
) -> Result<Tokens, TokenizeError> {
    let mut last = TokenizeError::NoReplica;
    for replica in replicas {
        stats.calls.fetch_add(1, Ordering::Relaxed);
        let sent = client
            .post(format!("http://{replica}/tokenize"))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.clone())
            .send()
            .await;
        let error = |reason: String| TokenizeError::Call {
            replica: replica.clone(),
            reason,
        };
        let response = match sent {
            Ok(response) => response,
            Err(e) => {
                stats.call_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%replica, error = %e, "tokenize call failed; trying the next replica");
                last = error(e.to_string());
                continue;
            }
        };
        let status = response.status();
        let bytes = response.bytes().await.map_err(|e| error(e.to_string()));
        let result = bytes.and_then(|bytes| {
            if !status.is_success() {
                return Err(error(format!(
                    "HTTP {status}: {}",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
                )));
            }
            serde_json::from_slice::<TokenizeResponse>(&bytes)
                .map(|r| Arc::from(r.tokens))
                .map_err(|e| error(format!("unreadable /tokenize answer: {e}")))
        });
        if result.is_err() {
            stats.call_errors.fetch_add(1, Ordering::Relaxed);
        }
        return result;
    }
    Err(last)
}
