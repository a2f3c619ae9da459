//! Tokenization: the exact token ids the engine will hash for a request, from a replica's own
//! `/tokenize` (same text, or same messages, tools, template kwargs and generation flags).
//!
//! Answers are cached in a byte-bounded LRU keyed by a 128-bit hash of the model and the
//! request's content (the raw JSON of messages/tools/kwargs as the client sent them, so two
//! spellings of one conversation are two entries, never a wrong answer). A call has a deadline:
//! past it the caller falls back to the approximate tier, while the call itself runs on in its
//! own task and its late answer still fills the cache for the next request.
//!
//! A model may also be tokenized in process ([`LocalTokenizer`]: its `tokenizer.json` and chat
//! template), which saves the round trip to a busy replica before every pick. Local answers are
//! trusted but checked: the first [`LOCAL_CHECKS_FIRST`] per model and kind (completion, chat),
//! then one in [`LOCAL_CHECK_EVERY`], are compared in the background with a replica's
//! `/tokenize`; one disagreement turns local tokenization of that kind off for the model (logged,
//! counted in `llmgw_tokenize_local_mismatches_total`), and its requests go to `/tokenize` again.
//! Requests whose rendering depends on more than messages and flags (`tools`,
//! `chat_template_kwargs`) always go to `/tokenize`.
//!
//! Concurrency: the cache is one `parking_lot::Mutex` held for a map operation; HTTP calls run
//! in spawned tasks and report back through a `watch` channel, which every request missing the
//! cache for the same body while the call runs waits on (one call per body at a time, in a map
//! behind its own `parking_lot::Mutex`, taken before the cache's when both are). Local
//! tokenization of short inputs runs on the caller's task, of long ones on tokio's blocking
//! pool under the same deadline as a call; its on/off switches and counters are atomics.

mod chat;
mod local;
#[cfg(test)]
mod tests;

pub use chat::{ChatOptions, ChatTemplate, ChatTemplateError};
pub use local::{LocalTokenizer, LocalTokenizerError};

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lru::LruCache;
use parking_lot::Mutex;
use serde::Deserialize;

use crate::cputime::{self, ThreadCpu};
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
    /// `/tokenize` calls (each runs on past its request's deadline) and long local
    /// tokenizations on the blocking pool that may run at once; past it a request falls back
    /// to the approximate tier at once instead of queueing more work on busy replicas.
    pub max_in_flight: usize,
}

impl Default for TokenizerConfig {
    fn default() -> Self {
        TokenizerConfig {
            deadline: Duration::from_millis(50),
            call_timeout: Duration::from_secs(5),
            cache_bytes: 64 << 20,
            max_in_flight: 256,
        }
    }
}

/// The tokenizer's options: flags (and `LLMGW_*` variables) with the same names as the
/// configuration file's keys. What neither sets is [`TokenizerConfig::default`].
#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
#[serde(default)]
pub struct TokenizerOptions {
    /// How long a request waits for its tokens before the prefix tree decides (default 50ms).
    #[arg(long, env = "LLMGW_TOKENIZE_DEADLINE", value_parser = crate::duration::parse)]
    #[serde(deserialize_with = "crate::duration::optional")]
    pub tokenize_deadline: Option<Duration>,
    /// Bytes the tokenization cache may hold (default 64 MiB).
    #[arg(long, env = "LLMGW_TOKENIZE_CACHE_BYTES")]
    pub tokenize_cache_bytes: Option<usize>,
}

impl TokenizerOptions {
    /// These options (the flags) over `file`'s, over the defaults.
    pub fn resolve(&self, file: &TokenizerOptions) -> TokenizerConfig {
        let default = TokenizerConfig::default();
        TokenizerConfig {
            deadline: (self.tokenize_deadline)
                .or(file.tokenize_deadline)
                .unwrap_or(default.deadline),
            cache_bytes: (self.tokenize_cache_bytes)
                .or(file.tokenize_cache_bytes)
                .unwrap_or(default.cache_bytes),
            ..default
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
    /// vLLM renders the conversation in a way the router cannot reproduce.
    #[error("the prompt vLLM renders cannot be reproduced: {0}")]
    NotReproducible(&'static str),
    /// [`TokenizerConfig::max_in_flight`] tokenizations are running already.
    #[error("{0} tokenizations are running already")]
    Busy(usize),
}

impl TokenizeError {
    /// A short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            TokenizeError::NoReplica => "tokenize_no_replica",
            TokenizeError::Timeout(_) => "tokenize_timeout",
            TokenizeError::Call { .. } => "tokenize_error",
            TokenizeError::NotReproducible(_) => "tokenize_not_reproducible",
            TokenizeError::Busy(_) => "tokenize_busy",
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
    /// Requests tokenized in process.
    pub local: AtomicU64,
    /// Local answers compared with a replica's `/tokenize`.
    pub local_checks: AtomicU64,
    /// Of those, the ones that disagreed (each turns local tokenization off for its kind).
    pub local_mismatches: AtomicU64,
    /// Tokenizations (and local answers' checks) not started: too many were running.
    pub shed: AtomicU64,
    /// Cache misses that waited for a `/tokenize` call already running for the same body
    /// instead of making another.
    pub joined: AtomicU64,
}

/// The longest `/tokenize` answer read: several million tokens, more than any prompt under
/// the body limit has.
pub const MAX_ANSWER_BYTES: usize = 64 << 20;

/// Local answers checked against `/tokenize` first, per model and kind …
pub const LOCAL_CHECKS_FIRST: u64 = 8;
/// … then one in this many.
pub const LOCAL_CHECK_EVERY: u64 = 64;

/// Requests whose `/tokenize` body is at most this long are tokenized on the caller's task
/// (a few hundred µs at most); longer ones on the blocking pool, under the tokenize deadline.
const LOCAL_INLINE_BYTES: usize = 1024;

/// What a local tokenizer is given, owned so that it can move to the blocking pool.
enum LocalInput {
    Prompt(String),
    /// Messages, template options, and whether special tokens are added on top.
    Chat(String, ChatOptions, bool),
}

impl LocalInput {
    fn encode(&self, tokenizer: &LocalTokenizer) -> Result<Vec<u32>, LocalTokenizerError> {
        match self {
            LocalInput::Prompt(text) => tokenizer.encode_prompt(text),
            LocalInput::Chat(messages, opts, special) => {
                tokenizer.encode_chat_as(messages, *opts, *special)
            }
        }
    }
}

/// Completion prompts or chats: checked and switched off separately, since a wrong chat
/// template says nothing about the tokenizer itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LocalKind {
    Completion = 0,
    Chat = 1,
}

impl LocalKind {
    fn as_str(self) -> &'static str {
        match self {
            LocalKind::Completion => "completion",
            LocalKind::Chat => "chat",
        }
    }
}

/// One model's local tokenizer with, per kind, whether it is still trusted and how many
/// answers it has given.
struct LocalModel {
    tokenizer: LocalTokenizer,
    enabled: [std::sync::atomic::AtomicBool; 2],
    answered: [AtomicU64; 2],
}

impl LocalModel {
    fn usable(&self, kind: LocalKind) -> bool {
        self.enabled[kind as usize].load(Ordering::Relaxed)
            && (kind == LocalKind::Completion || self.tokenizer.has_chat_template())
    }

    /// Whether the answer just given should be checked against a replica.
    fn due_for_check(&self, kind: LocalKind) -> bool {
        let n = self.answered[kind as usize].fetch_add(1, Ordering::Relaxed);
        n < LOCAL_CHECKS_FIRST || n.is_multiple_of(LOCAL_CHECK_EVERY)
    }
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
    /// An empty cache of at most `max_bytes`.
    fn new(max_bytes: usize) -> TokenCache {
        TokenCache {
            max_bytes,
            bytes: 0,
            entries: LruCache::unbounded(),
        }
    }

    fn entry_bytes(tokens: &Tokens) -> usize {
        tokens.len() * std::mem::size_of::<u32>() + ENTRY_OVERHEAD
    }

    fn get(&mut self, key: CacheKey) -> Option<Tokens> {
        self.entries.get(&key).cloned()
    }

    fn remove(&mut self, key: CacheKey) {
        if let Some(old) = self.entries.pop(&key) {
            self.bytes -= Self::entry_bytes(&old);
        }
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
/// Public so that checks against a real engine send exactly what the router sends.
pub fn tokenize_body(request: &ParsedRequest) -> Vec<u8> {
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
            // Only when set, so that the common body (and its cache key) stays as it was.
            if chat.add_special_tokens == Some(true) {
                member(&mut body, "add_special_tokens", "true");
            }
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

/// What a `/tokenize` call answers, once it has (`None` before).
type CallAnswer = Option<Result<Tokens, TokenizeError>>;

/// `/tokenize` calls running, by cache key: a miss for a body already being tokenized waits for
/// that call (a burst of one request, a client's retries) instead of making another.
type RunningCalls = Arc<Mutex<HashMap<CacheKey, tokio::sync::watch::Receiver<CallAnswer>>>>;

/// Takes a call off [`RunningCalls`] when its task ends, answered or not (a panic included), so
/// that a later miss never waits on a call nobody will answer.
struct RunningCall {
    calls: RunningCalls,
    key: CacheKey,
}

impl Drop for RunningCall {
    fn drop(&mut self) {
        self.calls.lock().remove(&self.key);
    }
}

/// Tokenizes requests through replicas' `/tokenize`, with a cache and a deadline.
pub struct Tokenizer {
    config: TokenizerConfig,
    client: reqwest::Client,
    cache: Arc<Mutex<TokenCache>>,
    calls: RunningCalls,
    stats: Arc<TokenizeStats>,
    /// Models tokenized in process.
    local: HashMap<String, Arc<LocalModel>>,
    /// Permits for work that outlives its request: `/tokenize` calls and long local jobs.
    in_flight: Arc<tokio::sync::Semaphore>,
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
            cache: Arc::new(Mutex::new(TokenCache::new(config.cache_bytes))),
            calls: RunningCalls::default(),
            stats: Arc::new(TokenizeStats::default()),
            local: HashMap::new(),
            in_flight: Arc::new(tokio::sync::Semaphore::new(config.max_in_flight)),
        }
    }

    /// Tokenizes `model`'s completion prompts (and chats, when `tokenizer` has a chat
    /// template) with `tokenizer` instead of calling `/tokenize`.
    pub fn with_local(mut self, model: impl Into<String>, tokenizer: LocalTokenizer) -> Self {
        let local = LocalModel {
            tokenizer,
            enabled: [
                std::sync::atomic::AtomicBool::new(true),
                std::sync::atomic::AtomicBool::new(true),
            ],
            answered: [AtomicU64::new(0), AtomicU64::new(0)],
        };
        self.local.insert(model.into(), Arc::new(local));
        self
    }

    /// Whether `model`'s chats are tokenized in process now (false after a disagreement).
    pub fn tokenizes_chat_locally(&self, model: &str) -> bool {
        self.local
            .get(model)
            .is_some_and(|l| l.usable(LocalKind::Chat))
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
        self.tokens_with(request, &request.model, replicas).await
    }

    /// [`Tokenizer::tokens`] with the in-process tokenizer of `local_model`: a LoRA adapter's
    /// request is tokenized by its base model's tokenizer and chat template, as vLLM does
    /// (replicas are still asked with the adapter's name).
    pub async fn tokens_with(
        &self,
        request: &ParsedRequest,
        local_model: &str,
        replicas: &[&str],
    ) -> Result<Tokens, TokenizeError> {
        match &request.input {
            RequestInput::Completion(Prompt::TokenIds(ids)) => {
                return Ok(Arc::from(ids.as_slice()));
            }
            RequestInput::Chat(crate::openai::ChatInput {
                unreproducible: Some(why),
                ..
            }) => return Err(TokenizeError::NotReproducible(why)),
            _ => {}
        }
        // Writing the body once gives both the cache key and the bytes to send.
        let body = tokenize_body(request);
        if let Some((local, kind)) = self.local_for(request, local_model) {
            return self
                .tokens_locally(&local, kind, request, body, replicas)
                .await;
        }
        let key = xxhash_rust::xxh3::xxh3_128(&body);
        if let Some(tokens) = self.cache.lock().get(key) {
            self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(tokens);
        }
        self.stats.cache_misses.fetch_add(1, Ordering::Relaxed);
        if replicas.is_empty() {
            return Err(TokenizeError::NoReplica);
        }

        let mut answer = self.call_or_join(key, body, replicas)?;
        match tokio::time::timeout(self.config.deadline, answer.wait_for(Option::is_some)).await {
            Ok(Ok(answered)) => answered.clone().unwrap_or_else(|| Err(Self::unanswered())),
            Ok(Err(_)) => Err(Self::unanswered()),
            Err(_) => {
                self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                Err(TokenizeError::Timeout(self.config.deadline))
            }
        }
    }

    fn unanswered() -> TokenizeError {
        TokenizeError::Call {
            replica: String::new(),
            reason: "tokenize task ended without an answer".to_owned(),
        }
    }

    /// The answer of the `/tokenize` call for `key`: the one running already, else a new one
    /// (which takes a permit, and fills the cache when it answers, however long after).
    fn call_or_join(
        &self,
        key: CacheKey,
        body: Vec<u8>,
        replicas: &[&str],
    ) -> Result<tokio::sync::watch::Receiver<CallAnswer>, TokenizeError> {
        let mut calls = self.calls.lock();
        if let Some(running) = calls.get(&key) {
            self.stats.joined.fetch_add(1, Ordering::Relaxed);
            return Ok(running.clone());
        }
        // The call for this body may have answered since the caller missed the cache.
        if let Some(tokens) = self.cache.lock().get(key) {
            return Ok(tokio::sync::watch::channel(Some(Ok(tokens))).1);
        }
        let permit = self.permit()?;
        let (tx, rx) = tokio::sync::watch::channel(None);
        calls.insert(key, rx.clone());
        drop(calls);
        let running = RunningCall {
            calls: Arc::clone(&self.calls),
            key,
        };
        let client = self.client.clone();
        let cache = Arc::clone(&self.cache);
        let stats = Arc::clone(&self.stats);
        let replicas: Vec<String> = replicas.iter().map(|r| (*r).to_owned()).collect();
        tokio::spawn(async move {
            let _permit = permit;
            let result = call_first_reachable(&client, &replicas, body, &stats).await;
            if let Ok(tokens) = &result {
                cache.lock().insert(key, Arc::clone(tokens));
            }
            // Off the running calls before answering: a miss from now on finds the cache (or,
            // after a failure, makes a call of its own).
            drop(running);
            tx.send_replace(Some(result));
        });
        Ok(rx)
    }
}

impl Tokenizer {
    /// A permit for work that may outlive its request, or `Busy` (counted) when none is left.
    fn permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, TokenizeError> {
        Arc::clone(&self.in_flight)
            .try_acquire_owned()
            .map_err(|_| {
                self.stats.shed.fetch_add(1, Ordering::Relaxed);
                TokenizeError::Busy(self.config.max_in_flight)
            })
    }

    /// The local tokenizer of `model` that may answer `request`, if any.
    fn local_for(
        &self,
        request: &ParsedRequest,
        model: &str,
    ) -> Option<(Arc<LocalModel>, LocalKind)> {
        let local = self.local.get(model)?;
        let kind = match &request.input {
            RequestInput::Completion(Prompt::Text(_)) => LocalKind::Completion,
            // Tools and template kwargs reach templates in ways not reproduced here.
            RequestInput::Chat(chat)
                if chat.tools.is_none() && chat.chat_template_kwargs.is_none() =>
            {
                LocalKind::Chat
            }
            _ => return None,
        };
        local.usable(kind).then(|| (Arc::clone(local), kind))
    }

    async fn tokens_locally(
        &self,
        local: &Arc<LocalModel>,
        kind: LocalKind,
        request: &ParsedRequest,
        body: Vec<u8>,
        replicas: &[&str],
    ) -> Result<Tokens, TokenizeError> {
        let key = xxhash_rust::xxh3::xxh3_128_with_seed(&body, local_seed(&request.model));
        if let Some(tokens) = self.cache.lock().get(key) {
            self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(tokens);
        }
        self.stats.cache_misses.fetch_add(1, Ordering::Relaxed);
        let input = match &request.input {
            RequestInput::Completion(Prompt::Text(text)) => {
                LocalInput::Prompt(text.as_str().to_owned())
            }
            RequestInput::Chat(chat) => LocalInput::Chat(
                chat.messages.get().to_owned(),
                ChatOptions {
                    add_generation_prompt: chat.add_generation_prompt.unwrap_or(true),
                    continue_final_message: chat.continue_final_message.unwrap_or(false),
                },
                chat.add_special_tokens.unwrap_or(false),
            ),
            RequestInput::Completion(Prompt::TokenIds(ids)) => {
                return Ok(Arc::from(ids.as_slice()));
            }
        };
        let job = {
            let (local, cache, stats) = (
                Arc::clone(local),
                Arc::clone(&self.cache),
                Arc::clone(&self.stats),
            );
            move || -> Result<Tokens, TokenizeError> {
                let tokens: Tokens = input
                    .encode(&local.tokenizer)
                    .map_err(|e| TokenizeError::Call {
                        replica: "local".to_owned(),
                        reason: e.to_string(),
                    })?
                    .into();
                stats.local.fetch_add(1, Ordering::Relaxed);
                cache.lock().insert(key, Arc::clone(&tokens));
                Ok(tokens)
            }
        };
        let tokens = if body.len() <= LOCAL_INLINE_BYTES {
            job()?
        } else {
            // Long inputs take milliseconds (a 1 MB prompt, a quarter second): off the
            // runtime's workers, and under the same deadline as a /tokenize call. A late answer
            // still fills the cache.
            let permit = self.permit()?;
            let timed_job = move || {
                let _permit = permit;
                let cpu = ThreadCpu::start();
                (job(), cpu.elapsed())
            };
            match tokio::time::timeout(self.config.deadline, tokio::task::spawn_blocking(timed_job))
                .await
            {
                Ok(Ok((result, cpu))) => {
                    // This decision's CPU, though another thread spent it.
                    cputime::charge_offloaded(cpu);
                    result?
                }
                Ok(Err(join)) => {
                    return Err(TokenizeError::Call {
                        replica: "local".to_owned(),
                        reason: join.to_string(),
                    });
                }
                Err(_) => {
                    self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                    return Err(TokenizeError::Timeout(self.config.deadline));
                }
            }
        };
        if !replicas.is_empty() && local.due_for_check(kind) {
            self.check_in_background(local, kind, request, body, key, &tokens, replicas);
        }
        Ok(tokens)
    }

    /// Compares a local answer with a replica's `/tokenize`; on disagreement switches that
    /// kind off for the model and drops the cached local answer.
    #[allow(clippy::too_many_arguments)]
    fn check_in_background(
        &self,
        local: &Arc<LocalModel>,
        kind: LocalKind,
        request: &ParsedRequest,
        body: Vec<u8>,
        key: CacheKey,
        tokens: &Tokens,
        replicas: &[&str],
    ) {
        let (client, cache, stats) = (
            self.client.clone(),
            Arc::clone(&self.cache),
            Arc::clone(&self.stats),
        );
        // No permit: no check this time; a later answer is checked instead.
        let Ok(permit) = self.permit() else { return };
        let (local, model, ours) = (Arc::clone(local), request.model.clone(), Arc::clone(tokens));
        let replicas: Vec<String> = replicas.iter().map(|r| (*r).to_owned()).collect();
        tokio::spawn(async move {
            let _permit = permit;
            let theirs = match call_first_reachable(&client, &replicas, body, &stats).await {
                Ok(theirs) => theirs,
                // No verdict: the replica could not answer (it may reject the request too).
                Err(_) => return,
            };
            stats.local_checks.fetch_add(1, Ordering::Relaxed);
            if theirs == ours {
                return;
            }
            stats.local_mismatches.fetch_add(1, Ordering::Relaxed);
            local.enabled[kind as usize].store(false, Ordering::Relaxed);
            cache.lock().remove(key);
            let first_difference = ours
                .iter()
                .zip(theirs.iter())
                .position(|(a, b)| a != b)
                .unwrap_or(ours.len().min(theirs.len()));
            tracing::error!(
                model,
                kind = kind.as_str(),
                local_tokens = ours.len(),
                replica_tokens = theirs.len(),
                first_difference,
                "local tokenization disagrees with the replica's /tokenize: using /tokenize for \
                 this model from now on (check the tokenizer.json and chat template given to \
                 --model)"
            );
        });
    }
}

/// Keeps local-tokenizer cache keys apart from `/tokenize` ones and per model.
fn local_seed(model: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(model.as_bytes()) ^ 0x6c6f_6361_6c00_0000
}

/// Tries each replica in order until one answers; only a replica that cannot be reached is
/// passed for the next (one that timed out is busy, and the next would get the same body to
/// work on); an HTTP error status from a reachable replica is the answer (the request itself is
/// bad for the model).
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
            Err(e) if e.is_connect() => {
                stats.call_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%replica, error = %e, "tokenize call failed; trying the next replica");
                last = error(e.to_string());
                continue;
            }
            Err(e) => {
                stats.call_errors.fetch_add(1, Ordering::Relaxed);
                return Err(error(e.to_string()));
            }
        };
        let status = response.status();
        let bytes = crate::http_body::read_capped(response, MAX_ANSWER_BYTES)
            .await
            .map_err(|e| error(e.to_string()));
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
