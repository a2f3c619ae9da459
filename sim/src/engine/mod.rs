//! The simulated engine: vLLM's scheduler loop over a [`BlockPool`], with a latency model.
//!
//! Concurrency model: one tokio task (the *engine task*, started by [`Engine::spawn`]) owns all
//! engine state — the pool, the running batch and the waiting queue — and is driven by
//! [`Command`]s over an unbounded channel, the actor pattern. HTTP handlers hold an
//! [`EngineHandle`]; each request gets its own output channel. Gauges and counters for
//! `/metrics` are published by the engine task into [`EngineStats`] atomics that anyone may
//! read without locking; the one exception, `vllm:lora_requests_info`'s label sets, sits
//! behind a short lock written once per step and read by `/metrics`. Nothing else is shared
//! mutably across tasks.
//!
//! Each loop iteration is one *engine step*, as in vLLM:
//! 1. every running request computes its pending tokens and samples one more (decode);
//! 2. waiting requests are admitted first-come first-served while the running batch is below
//!    `max_num_seqs` and the pool has blocks: a prefix-cache lookup, then allocation (which may
//!    evict LRU cached blocks), then the prompt's full blocks are cached; the first token is
//!    sampled in the same step. With LoRA on, a request whose adapter is not among the running
//!    requests' while `max_loras` adapters already run is skipped (it keeps its place; later
//!    requests may be admitted past it), as vLLM's scheduler does;
//! 3. the step "takes" `step_overhead + uncached_prompt_tokens × prefill_per_token +
//!    decode_per_step` (slept on tokio's clock, so paused-time tests are exact);
//! 4. the step's KV events go out as one batch, then outputs are delivered, then the stats
//!    (and, with LoRA on, `vllm:lora_requests_info`) are updated.
//!
//! Blocks are cached as soon as their tokens are computed: prompt blocks at prefill, blocks
//! filled by generated tokens one step after their last token was sampled (the last sampled
//! token of a request is never computed), exactly as vLLM's events show.

pub mod pool;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use llmgw::blockhash::{BlockDigest, BlockHasher, RequestKeys};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use self::pool::{BlockId, BlockPool};
use crate::events::{BlockKey, BlockStored, EventBatch, KvEvent};
use crate::lora::{LoraActivity, LoraAdapter, LoraInfoGauge, LoraInfoSample};

/// The latency model (all zero: as fast as the CPU allows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LatencyModel {
    /// Prefill time per prompt token not found in the prefix cache.
    pub prefill_per_token: Duration,
    /// Time of one decode step (every running request gains one token).
    pub decode_per_step: Duration,
    /// Fixed time added to every step.
    pub step_overhead: Duration,
}

impl LatencyModel {
    fn step_time(&self, prefill_tokens: usize, decoded: bool) -> Duration {
        let prefill = self
            .prefill_per_token
            .saturating_mul(u32::try_from(prefill_tokens).unwrap_or(u32::MAX));
        let decode = if decoded {
            self.decode_per_step
        } else {
            Duration::ZERO
        };
        self.step_overhead + prefill + decode
    }
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Blocks in the pool, the null block included (`--num-gpu-blocks-override`).
    pub num_blocks: usize,
    pub max_num_seqs: usize,
    pub prefix_caching: bool,
    /// Whether KV events are produced at all (`enable_kv_cache_events`).
    pub kv_events: bool,
    pub latency: LatencyModel,
    /// How many tokens the model "wants" to say before its end-of-sequence.
    pub output_len: usize,
    pub hasher: BlockHasher,
    /// Token ids the model samples from.
    pub vocab: Arc<[u32]>,
    pub data_parallel_rank: u32,
    /// `--max-loras` when LoRA is enabled (`--enable-lora`), else `None`: at most this many
    /// distinct adapters among the running requests.
    pub max_loras: Option<usize>,
}

/// Why a request finished (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Final accounting of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

/// What a request's output channel carries, in order: tokens, then one `Finished` or `Failed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    Token(u32),
    Finished(Finished),
    Failed(String),
}

/// A request for the engine.
#[derive(Debug)]
pub struct Submit {
    pub prompt: Vec<u32>,
    /// At least 1.
    pub max_tokens: usize,
    pub cache_salt: Option<String>,
    /// The LoRA adapter serving it (`None`: the base model).
    pub lora: Option<Arc<LoraAdapter>>,
    pub out: mpsc::UnboundedSender<Output>,
}

impl Submit {
    /// What the request adds to its blocks' hashes.
    fn keys(&self) -> RequestKeys<'_> {
        request_keys(self.lora.as_deref(), self.cache_salt.as_deref())
    }
}

fn request_keys<'a>(lora: Option<&'a LoraAdapter>, cache_salt: Option<&'a str>) -> RequestKeys<'a> {
    RequestKeys {
        lora: lora.map(LoraAdapter::key),
        cache_salt,
    }
}

/// What the engine hands the event publisher.
#[derive(Debug)]
pub enum EngineEvent {
    Batch(EventBatch),
    /// The engine restarted: sequence numbers start again at 0, the replay buffer is emptied.
    Restart,
}

/// Messages to the engine task.
#[derive(Debug)]
pub enum Command {
    Submit(Submit),
    ResetPrefixCache(oneshot::Sender<bool>),
    CachedHashes(oneshot::Sender<Vec<u64>>),
    Restart,
    Stall(Duration),
}

/// Engine gauges and counters, written by the engine task, read by `/metrics`.
#[derive(Debug, Default)]
pub struct EngineStats {
    running: AtomicU64,
    waiting: AtomicU64,
    usage_bits: AtomicU64,
    prefix_queries: AtomicU64,
    prefix_hits: AtomicU64,
    steps: AtomicU64,
    lora_info: parking_lot::Mutex<LoraInfoGauge>,
}

/// A consistent-enough copy of [`EngineStats`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StatsSnapshot {
    pub running: u64,
    pub waiting: u64,
    pub kv_cache_usage: f64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub steps: u64,
}

impl EngineStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            kv_cache_usage: f64::from_bits(self.usage_bits.load(Ordering::Relaxed)),
            prefix_cache_queries: self.prefix_queries.load(Ordering::Relaxed),
            prefix_cache_hits: self.prefix_hits.load(Ordering::Relaxed),
            steps: self.steps.load(Ordering::Relaxed),
        }
    }
}

/// The engine is gone (its task ended).
#[derive(Debug, thiserror::Error)]
#[error("the engine is not running")]
pub struct EngineGone;

/// A cheap, cloneable handle on the engine task.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    stats: Arc<EngineStats>,
}

impl EngineHandle {
    pub fn submit(&self, req: Submit) -> Result<(), EngineGone> {
        self.tx.send(Command::Submit(req)).map_err(|_| EngineGone)
    }

    /// vLLM's `reset_prefix_cache`: false while requests hold blocks. The AllBlocksCleared
    /// event goes out with the engine's next step, as in vLLM.
    pub async fn reset_prefix_cache(&self) -> Result<bool, EngineGone> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Command::ResetPrefixCache(tx))
            .map_err(|_| EngineGone)?;
        rx.await.map_err(|_| EngineGone)
    }

    /// The external hashes now cached (sorted, unique).
    pub async fn cached_hashes(&self) -> Result<Vec<u64>, EngineGone> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Command::CachedHashes(tx))
            .map_err(|_| EngineGone)?;
        rx.await.map_err(|_| EngineGone)
    }

    /// Fault: the engine restarts — requests in flight fail, the cache empties, event sequence
    /// numbers start again at 0.
    pub fn restart(&self) -> Result<(), EngineGone> {
        self.tx.send(Command::Restart).map_err(|_| EngineGone)
    }

    /// Fault: no engine step runs for `d` (requests queue, no events).
    pub fn stall(&self, d: Duration) -> Result<(), EngineGone> {
        self.tx.send(Command::Stall(d)).map_err(|_| EngineGone)
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Every series of `vllm:lora_requests_info` (empty unless LoRA is on).
    pub fn lora_info(&self) -> Vec<LoraInfoSample> {
        self.stats.lora_info.lock().samples()
    }
}

struct Running {
    prompt_len: usize,
    tokens: Vec<u32>,
    blocks: Vec<BlockId>,
    /// Digests of the blocks cached so far for this request (prefix hits included).
    digests: Vec<BlockDigest>,
    /// Prompt digests computed at arrival, used at prefill.
    prompt_digests: Vec<BlockDigest>,
    cache_salt: Option<String>,
    lora: Option<Arc<LoraAdapter>>,
    max_tokens: usize,
    target: usize,
    generated: usize,
    cached_tokens: usize,
    seed: u64,
    out: mpsc::UnboundedSender<Output>,
}

/// The engine task's state.
pub struct Engine {
    cfg: EngineConfig,
    pool: BlockPool,
    running: Vec<Running>,
    waiting: std::collections::VecDeque<Submit>,
    pending_events: Vec<KvEvent>,
    events: Option<mpsc::Sender<EngineEvent>>,
    stats: Arc<EngineStats>,
    stalled_until: Option<Instant>,
    /// Adapters with a waiting or running request, for `vllm:lora_requests_info`.
    lora_activity: LoraActivity,
}

impl Engine {
    /// Starts the engine task on the current runtime. `events` receives one batch per step
    /// that produced events (blocking when full, like vLLM's queue).
    pub fn spawn(cfg: EngineConfig, events: Option<mpsc::Sender<EngineEvent>>) -> EngineHandle {
        let (tx, rx) = mpsc::unbounded_channel();
        let stats = Arc::new(EngineStats::default());
        let engine = Engine {
            pool: BlockPool::new(cfg.num_blocks),
            cfg,
            running: Vec::new(),
            waiting: std::collections::VecDeque::new(),
            pending_events: Vec::new(),
            events,
            stats: Arc::clone(&stats),
            stalled_until: None,
            lora_activity: LoraActivity::default(),
        };
        engine.publish_stats();
        tokio::spawn(engine.run(rx));
        EngineHandle { tx, stats }
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match rx.recv().await {
                    Some(cmd) => self.handle(cmd).await,
                    None => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd).await,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            }
            if let Some(until) = self.stalled_until {
                if Instant::now() < until {
                    tokio::select! {
                        () = tokio::time::sleep_until(until) => {}
                        cmd = rx.recv() => match cmd {
                            Some(cmd) => self.handle(cmd).await,
                            None => return,
                        },
                    }
                    continue;
                }
                self.stalled_until = None;
            }
            if self.running.is_empty() && self.waiting.is_empty() {
                continue;
            }
            let step = self.step();
            if step.duration.is_zero() {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(step.duration).await;
            }
            if !step.events.is_empty() {
                self.publish(EngineEvent::Batch(EventBatch {
                    ts: unix_now(),
                    events: step.events,
                    data_parallel_rank: Some(self.cfg.data_parallel_rank),
                }))
                .await;
            }
            for (out, output) in step.outputs {
                let _ = out.send(output);
            }
            self.publish_stats();
            self.record_lora_info();
        }
    }

    async fn publish(&mut self, event: EngineEvent) {
        if let Some(tx) = &self.events
            && tx.send(event).await.is_err()
        {
            self.events = None;
        }
    }

    async fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(req) => {
                if let Some(adapter) = &req.lora {
                    self.lora_activity.arrived(adapter);
                }
                self.waiting.push_back(req);
                self.publish_stats();
            }
            Command::ResetPrefixCache(reply) => {
                let ok = self.pool.reset();
                if ok && self.cfg.kv_events {
                    self.pending_events.push(KvEvent::AllBlocksCleared);
                }
                let _ = reply.send(ok);
                self.publish_stats();
            }
            Command::CachedHashes(reply) => {
                let _ = reply.send(self.pool.cached_hashes());
            }
            Command::Restart => {
                for r in self.running.drain(..) {
                    let _ = r.out.send(Output::Failed("engine restarted".into()));
                }
                for w in self.waiting.drain(..) {
                    let _ = w.out.send(Output::Failed("engine restarted".into()));
                }
                self.pool = BlockPool::new(self.cfg.num_blocks);
                self.pending_events.clear();
                self.lora_activity.clear();
                self.stalled_until = None;
                for counter in [&self.stats.prefix_queries, &self.stats.prefix_hits] {
                    counter.store(0, Ordering::Relaxed);
                }
                self.publish(EngineEvent::Restart).await;
                self.publish_stats();
            }
            Command::Stall(d) => {
                self.stalled_until = Some(Instant::now() + d);
            }
        }
    }

    fn publish_stats(&self) {
        let s = &self.stats;
        s.running
            .store(self.running.len() as u64, Ordering::Relaxed);
        s.waiting
            .store(self.waiting.len() as u64, Ordering::Relaxed);
        s.usage_bits
            .store(self.pool.usage().to_bits(), Ordering::Relaxed);
    }

    /// vLLM's per-step `vllm:lora_requests_info` update: the adapters with requests left, as
    /// labels, set to the current time.
    fn record_lora_info(&mut self) {
        if self.cfg.max_loras.is_none() {
            return;
        }
        let (running, waiting) = (&self.running, &self.waiting);
        self.lora_activity.retain(|adapter| {
            running
                .iter()
                .filter_map(|r| r.lora.as_deref())
                .chain(waiting.iter().filter_map(|w| w.lora.as_deref()))
                .any(|a| a.id == adapter.id)
        });
        let (running, waiting) = self.lora_activity.labels();
        self.stats
            .lora_info
            .lock()
            .set(&running, &waiting, unix_now());
    }

    /// One scheduler step: decode the running batch, admit waiting requests, cache the blocks
    /// that filled. Pure state change; the caller sleeps, publishes and delivers.
    fn step(&mut self) -> Step {
        let mut step = Step {
            duration: Duration::ZERO,
            events: std::mem::take(&mut self.pending_events),
            outputs: Vec::new(),
        };
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        // Clients that went away.
        let pool = &mut self.pool;
        self.running.retain(|r| {
            let keep = !r.out.is_closed();
            if !keep {
                pool.free(&r.blocks);
            }
            keep
        });
        self.waiting.retain(|w| !w.out.is_closed());

        let mut decoded = false;
        let mut prefill_tokens = 0;

        // 1. Decode: compute every known token, sample one more.
        for i in 0..self.running.len() {
            let computed = self.running[i].tokens.len();
            self.cache_full_blocks(i, computed, &mut step.events);
            self.sample(i, &mut step.outputs);
            decoded = true;
        }

        // 2. Admit waiting requests, FCFS; with LoRA on, a request whose adapter would exceed
        // max_loras is skipped and keeps its place (vLLM's `skipped_waiting_requests`).
        let mut scheduled_loras: Vec<u32> = self
            .running
            .iter()
            .filter_map(|r| r.lora.as_ref().map(|a| a.id))
            .collect();
        scheduled_loras.sort_unstable();
        scheduled_loras.dedup();
        let mut i = 0;
        while self.running.len() < self.cfg.max_num_seqs {
            let Some(req) = self.waiting.get(i) else {
                break;
            };
            if let (Some(max_loras), Some(adapter)) = (self.cfg.max_loras, &req.lora)
                && scheduled_loras.len() >= max_loras
                && !scheduled_loras.contains(&adapter.id)
            {
                i += 1;
                continue;
            }
            match self.admit_check(req) {
                Admit::Yes {
                    hit,
                    new_blocks,
                    prompt_digests,
                } => {
                    let Some(req) = self.waiting.remove(i) else {
                        break;
                    };
                    if let Some(adapter) = &req.lora
                        && !scheduled_loras.contains(&adapter.id)
                    {
                        scheduled_loras.push(adapter.id);
                    }
                    prefill_tokens += self.admit(req, hit, new_blocks, prompt_digests, &mut step);
                    decoded = true;
                }
                Admit::NotNow => break,
                Admit::Never(msg) => {
                    if let Some(req) = self.waiting.remove(i) {
                        step.outputs.push((req.out, Output::Failed(msg)));
                    }
                }
            }
        }

        // 3. Finish.
        let pool = &mut self.pool;
        self.running.retain(|r| {
            if r.generated < r.target {
                return true;
            }
            pool.free(&r.blocks);
            let reason = if r.generated >= r.max_tokens {
                FinishReason::Length
            } else {
                FinishReason::Stop
            };
            step.outputs.push((
                r.out.clone(),
                Output::Finished(Finished {
                    reason,
                    prompt_tokens: r.prompt_len,
                    cached_tokens: r.cached_tokens,
                    completion_tokens: r.generated,
                }),
            ));
            false
        });
        step.duration = self.cfg.latency.step_time(prefill_tokens, decoded);
        step
    }

    fn admit_check(&self, req: &Submit) -> Admit {
        let bs = self.cfg.hasher.block_size();
        let target = req.max_tokens.min(self.cfg.output_len.max(1));
        let total_blocks = (req.prompt.len() + target).div_ceil(bs);
        if total_blocks > self.pool.capacity() {
            return Admit::Never(format!(
                "request needs {total_blocks} KV blocks but the cache has {}",
                self.pool.capacity()
            ));
        }
        let prompt_digests: Vec<BlockDigest> = if self.cfg.prefix_caching {
            self.cfg
                .hasher
                .request_blocks(&req.prompt, req.keys())
                .collect()
        } else {
            Vec::new()
        };
        // vLLM never hits the whole prompt: at least one token is computed.
        let max_hit = req.prompt.len().saturating_sub(1) / bs;
        let hit = self
            .pool
            .longest_prefix(&prompt_digests[..prompt_digests.len().min(max_hit)]);
        let new_blocks = total_blocks - hit.len();
        if self.pool.num_free() - self.pool.count_free(&hit) < new_blocks {
            return Admit::NotNow;
        }
        Admit::Yes {
            hit,
            new_blocks,
            prompt_digests,
        }
    }

    /// Takes the blocks, caches the prompt, samples the first token; returns the prompt tokens
    /// that had to be computed.
    fn admit(
        &mut self,
        req: Submit,
        hit: Vec<BlockId>,
        new_blocks: usize,
        prompt_digests: Vec<BlockDigest>,
        step: &mut Step,
    ) -> usize {
        let bs = self.cfg.hasher.block_size();
        self.pool.touch(&hit);
        let mut evicted = Vec::new();
        let Some(new) = self.pool.allocate(new_blocks, &mut evicted) else {
            // admit_check guaranteed room; fail the request rather than the engine.
            self.pool.free(&hit);
            step.outputs
                .push((req.out, Output::Failed("no free KV blocks".into())));
            return 0;
        };
        if self.cfg.kv_events {
            step.events
                .extend(evicted.into_iter().map(|d| KvEvent::BlockRemoved {
                    block_hashes: vec![d],
                    group_idx: Some(0),
                }));
        }
        let cached_tokens = hit.len() * bs;
        let prompt_len = req.prompt.len();
        self.stats
            .prefix_queries
            .fetch_add(prompt_len as u64, Ordering::Relaxed);
        self.stats
            .prefix_hits
            .fetch_add(cached_tokens as u64, Ordering::Relaxed);
        let mut blocks = hit;
        let digests = prompt_digests[..blocks.len()].to_vec();
        blocks.extend(new);
        let seed = seed_of(
            &req.prompt,
            req.cache_salt.as_deref(),
            req.lora.as_deref().map(|a| a.name.as_str()),
        );
        let mut tokens = req.prompt;
        tokens.reserve(req.max_tokens.min(self.cfg.output_len.max(1)));
        self.running.push(Running {
            prompt_len,
            target: req.max_tokens.min(self.cfg.output_len.max(1)),
            tokens,
            blocks,
            digests,
            prompt_digests,
            cache_salt: req.cache_salt,
            lora: req.lora,
            max_tokens: req.max_tokens,
            generated: 0,
            cached_tokens,
            seed,
            out: req.out,
        });
        let i = self.running.len() - 1;
        self.cache_full_blocks(i, prompt_len, &mut step.events);
        self.sample(i, &mut step.outputs);
        prompt_len - cached_tokens
    }

    /// Caches request `i`'s blocks that are full within its first `computed` tokens and emits
    /// one BlockStored for them.
    fn cache_full_blocks(&mut self, i: usize, computed: usize, events: &mut Vec<KvEvent>) {
        if !self.cfg.prefix_caching {
            return;
        }
        let bs = self.cfg.hasher.block_size();
        let r = &mut self.running[i];
        let full = (computed / bs).min(r.blocks.len());
        let first = r.digests.len();
        if full <= first {
            return;
        }
        for b in first..full {
            let digest = match r.prompt_digests.get(b) {
                Some(d) => *d,
                None => {
                    // A block filled by generated tokens: the request's keys as on its prompt
                    // blocks (the LoRA adapter on every block, the salt on block 0 only).
                    let block = &r.tokens[b * bs..(b + 1) * bs];
                    let keys = request_keys(r.lora.as_deref(), r.cache_salt.as_deref());
                    self.cfg.hasher.request_block(r.digests.last(), block, keys)
                }
            };
            self.pool.cache(r.blocks[b], digest);
            r.digests.push(digest);
        }
        if self.cfg.kv_events {
            let extra_keys = (first..full)
                .map(|b| {
                    let mut keys = Vec::new();
                    if let Some(adapter) = &r.lora {
                        keys.push(BlockKey::Lora(Arc::clone(adapter)));
                    }
                    if let (Some(salt), 0) = (&r.cache_salt, b) {
                        keys.push(BlockKey::CacheSalt(salt.clone()));
                    }
                    (!keys.is_empty()).then_some(keys)
                })
                .collect();
            events.push(KvEvent::BlockStored(BlockStored {
                block_hashes: r.digests[first..full].to_vec(),
                parent_block_hash: first.checked_sub(1).map(|p| r.digests[p]),
                token_ids: r.tokens[first * bs..full * bs].to_vec(),
                block_size: bs as u32,
                extra_keys: Some(extra_keys),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention"),
            }));
        }
    }

    fn sample(&mut self, i: usize, outputs: &mut Vec<(mpsc::UnboundedSender<Output>, Output)>) {
        let r = &mut self.running[i];
        let vocab = &self.cfg.vocab;
        let token = if vocab.is_empty() {
            0
        } else {
            let x = splitmix64(r.seed ^ (r.generated as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            vocab[(x % vocab.len() as u64) as usize]
        };
        r.tokens.push(token);
        r.generated += 1;
        outputs.push((r.out.clone(), Output::Token(token)));
    }
}

enum Admit {
    Yes {
        hit: Vec<BlockId>,
        new_blocks: usize,
        prompt_digests: Vec<BlockDigest>,
    },
    NotNow,
    Never(String),
}

struct Step {
    duration: Duration,
    events: Vec<KvEvent>,
    outputs: Vec<(mpsc::UnboundedSender<Output>, Output)>,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Same prompt (salt and adapter) → same answer on every replica, like greedy decoding; an
/// adapter answers differently from the base model.
fn seed_of(prompt: &[u32], salt: Option<&str>, lora: Option<&str>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in prompt {
        h = (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
    }
    for b in salt.unwrap_or_default().bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    if let Some(name) = lora {
        h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
        for b in name.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests;
