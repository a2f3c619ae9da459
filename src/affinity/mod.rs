//! The scheduler's prefix slot: precise prefix affinity from the KV index, with the approximate
//! prefix tree where the index cannot answer.
//!
//! For each request: tokenize through a replica ([`crate::tokenize`]), hash the blocks as the
//! engine does ([`crate::blockhash`]), ask the index ([`crate::kvindex`]) how many leading blocks
//! each candidate holds (speculative entries of recent picks included), and score the share of
//! the prompt held. When the model's hash settings are unknown, no candidate ever reported
//! events, or tokenization fails or misses its deadline, the prefix tree ([`crate::prefix`])
//! scores instead. After the pick, the chosen replica is credited in the tree (always) and with
//! speculative index entries (precise branch), and the branch that decided is counted.
//!
//! Concurrency: shared by every ext_proc stream behind an `Arc`; all state lives in the index,
//! tree and tokenizer, each with its own short-held locks. The hash settings table is an
//! immutable snapshot swapped atomically on reload.

mod settings;
#[cfg(test)]
mod tests;

pub use settings::{FileModel, ModelSettings, ModelSettingsError, hashers, with_local_tokenizers};

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures::future::BoxFuture;
use lru::LruCache;
use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::time::Instant;
use tracing::Instrument;

use crate::blockhash::{BlockHasher, ExternalHash};
use crate::kvindex::{KvIndex, PrefixMatch, ReplicaSlot, SpeculativeBlocks};
use crate::openai::{ParsedRequest, Prompt, RequestInput};
use crate::pool::Replica;
use crate::prefix::PrefixTree;
use crate::scheduler::{Candidate, PrefixScorer, PrefixScores, PrefixUnavailable};
use crate::tokenize::Tokenizer;

/// Settings of the prefix slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AffinityConfig {
    /// Leading blocks a replica must hold before its cache counts at all (a block or two of a
    /// shared system prompt is not worth a detour).
    pub min_blocks: u32,
    /// How long a pick credits the chosen replica with the prompt's blocks.
    pub speculative_ttl: Duration,
}

impl Default for AffinityConfig {
    fn default() -> Self {
        AffinityConfig {
            min_blocks: 1,
            speculative_ttl: Duration::from_secs(2),
        }
    }
}

/// Each model's engine hash settings, as a block hasher.
pub type HashersByModel = HashMap<String, Arc<BlockHasher>>;

/// Which tier decided, and why the precise one could not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Branch {
    Index,
    Tree(&'static str),
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    decision: &'static str,
}

/// `llmgw_kv_decisions_total{decision}` and `llmgw_prefix_decisions_total{decision}`.
#[derive(Debug, Clone, Default)]
pub struct AffinityMetrics {
    kv_decisions: Family<DecisionLabels, Counter>,
    prefix_decisions: Family<DecisionLabels, Counter>,
}

impl AffinityMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "llmgw_kv_decisions",
            "Decisions of the precise KV index tier: hit, miss, load_override, or why it could \
             not answer",
            self.kv_decisions.clone(),
        );
        registry.register(
            "llmgw_prefix_decisions",
            "Decisions of the approximate prefix tree tier: hit, miss, load_override",
            self.prefix_decisions.clone(),
        );
    }

    fn kv(&self, decision: &'static str) {
        self.kv_decisions
            .get_or_create(&DecisionLabels { decision })
            .inc();
    }

    fn tree(&self, decision: &'static str) {
        self.prefix_decisions
            .get_or_create(&DecisionLabels { decision })
            .inc();
    }

    /// Count of one `llmgw_kv_decisions_total` label (for tests and `/debug`).
    pub fn kv_count(&self, decision: &'static str) -> u64 {
        self.kv_decisions
            .get_or_create(&DecisionLabels { decision })
            .get()
    }

    /// Count of one `llmgw_prefix_decisions_total` label.
    pub fn tree_count(&self, decision: &'static str) -> u64 {
        self.prefix_decisions
            .get_or_create(&DecisionLabels { decision })
            .get()
    }
}

/// What `score` hands to `after_pick`.
struct Memo {
    branch: Branch,
    /// The prompt's external block hashes, when it was tokenized and hashed.
    hashes: Option<Arc<[ExternalHash]>>,
    /// The candidates in scoring order, with how much each matched (blocks, or tree share).
    matched: Vec<(Arc<Replica>, f64)>,
}

/// The prefix scorer: precise index first, prefix tree second.
pub struct PrefixAffinity {
    config: AffinityConfig,
    hashers: ArcSwap<HashersByModel>,
    index: Arc<KvIndex>,
    speculative: SpeculativeBlocks,
    tree: Arc<PrefixTree>,
    tokenizer: Tokenizer,
    /// Recent prompts' block hashes, keyed by their tokens, salt and model: a repeated prompt
    /// (every turn of a conversation re-sends the whole history) costs a 64-bit hash of its
    /// tokens instead of a SHA-256 per block.
    block_hashes: Mutex<LruCache<u128, Arc<[ExternalHash]>>>,
    metrics: AffinityMetrics,
}

/// Prompts whose block hashes are remembered (about 1 KB each for a 2k-token prompt).
const HASH_CACHE_ENTRIES: usize = 8192;

impl PrefixAffinity {
    pub fn new(
        config: AffinityConfig,
        hashers: HashersByModel,
        index: Arc<KvIndex>,
        tree: Arc<PrefixTree>,
        tokenizer: Tokenizer,
    ) -> Self {
        PrefixAffinity {
            config,
            hashers: ArcSwap::from_pointee(hashers),
            speculative: SpeculativeBlocks::new(config.speculative_ttl),
            index,
            tree,
            tokenizer,
            block_hashes: Mutex::new(LruCache::new(
                NonZeroUsize::new(HASH_CACHE_ENTRIES).unwrap_or(NonZeroUsize::MIN),
            )),
            metrics: AffinityMetrics::default(),
        }
    }

    pub fn metrics(&self) -> &AffinityMetrics {
        &self.metrics
    }

    /// Registers the decision counters and the gauges read at scrape time: index size, prefix
    /// tree size, speculative entries and the tokenizer cache.
    pub fn register_metrics(self: &Arc<Self>, registry: &mut Registry) {
        self.metrics.register(registry);
        registry.register_collector(Box::new(StateCollector(Arc::clone(self))));
    }

    pub fn index(&self) -> &Arc<KvIndex> {
        &self.index
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Replaces the per-model hash settings (config reload).
    pub fn set_hashers(&self, hashers: HashersByModel) {
        self.hashers.store(Arc::new(hashers));
    }

    /// The prompt's external block hashes, from the cache or computed (and remembered).
    fn block_hashes(
        &self,
        hasher: &BlockHasher,
        model: &str,
        tokens: &[u32],
        salt: Option<&str>,
    ) -> Arc<[ExternalHash]> {
        let key = tokens_key(model, salt, tokens);
        if let Some(hashes) = self.block_hashes.lock().get(&key) {
            return Arc::clone(hashes);
        }
        let mut hashes = Vec::new();
        hasher.external_hashes_into(tokens, salt, &mut hashes);
        let hashes: Arc<[ExternalHash]> = Arc::from(hashes);
        self.block_hashes.lock().put(key, Arc::clone(&hashes));
        hashes
    }

    /// The precise tier: `Ok` with scores, or `Err(reason)` to fall back.
    async fn score_precise(
        &self,
        request: &ParsedRequest,
        candidates: &[Candidate],
    ) -> Result<(Vec<f64>, Memo), &'static str> {
        let hashers = self.hashers.load();
        let hasher = hashers.get(&request.model).ok_or("unknown_settings")?;
        let slots: Vec<Option<ReplicaSlot>> = candidates
            .iter()
            .map(|c| self.index.slot(c.replica.endpoint()))
            .collect();
        if slots.iter().all(Option::is_none) {
            return Err("no_events");
        }
        // Tokenize on the least loaded candidates first.
        let mut order: Vec<&Candidate> = candidates.iter().collect();
        order.sort_by_key(|c| c.in_flight);
        let addresses: Vec<&str> = order.iter().map(|c| c.replica.endpoint()).collect();
        let tokenize = tracing::debug_span!("tokenize", tokens = tracing::field::Empty);
        let tokens = self
            .tokenizer
            .tokens(request, &addresses)
            .instrument(tokenize.clone())
            .await
            .map_err(|e| {
                tracing::debug!(model = %request.model, error = %e, "precise tier unavailable");
                e.reason()
            })?;
        tokenize.record("tokens", tokens.len() as i64);
        drop(tokenize);

        let hashes = tracing::debug_span!("hash", tokens = tokens.len() as i64).in_scope(|| {
            self.block_hashes(
                hasher,
                &request.model,
                &tokens,
                request.cache_salt.as_deref(),
            )
        });
        tracing::Span::current().record("prompt_blocks", hashes.len() as i64);
        let (matches, blocks) =
            tracing::debug_span!("index_lookup", candidates = candidates.len() as i64).in_scope(
                || {
                    let mut matches: Vec<PrefixMatch> = Vec::with_capacity(candidates.len());
                    self.index.match_prefix(&hashes, &slots, &mut matches);
                    let mut blocks: Vec<u32> = matches.iter().map(|m| m.blocks).collect();
                    self.speculative
                        .raise_matches(&hashes, &slots, Instant::now(), &mut blocks);
                    (matches, blocks)
                },
            );

        let total = hashes.len().max(1) as f64;
        let scores = matches
            .iter()
            .zip(&blocks)
            .map(|(m, &held)| {
                if held < self.config.min_blocks {
                    0.0
                } else if held > m.blocks {
                    // Speculative blocks are assumed to be on the GPU.
                    (m.weighted as f64 + f64::from(held - m.blocks)) / total
                } else {
                    m.weighted as f64 / total
                }
            })
            .collect();
        let matched = candidates
            .iter()
            .zip(&blocks)
            .map(|(c, &b)| (Arc::clone(&c.replica), f64::from(b)))
            .collect();
        Ok((
            scores,
            Memo {
                branch: Branch::Index,
                hashes: Some(hashes),
                matched,
            },
        ))
    }

    fn score_tree(
        &self,
        request: &ParsedRequest,
        candidates: &[Candidate],
        reason: &'static str,
    ) -> (Vec<f64>, Memo) {
        let _span = tracing::debug_span!("prefix_tree", reason).entered();
        let endpoints: Vec<&str> = candidates.iter().map(|c| c.replica.endpoint()).collect();
        let mut shares = Vec::with_capacity(candidates.len());
        self.tree.match_shares(
            &tree_scope(request),
            &prompt_text(request),
            &endpoints,
            &mut shares,
        );
        let matched = candidates
            .iter()
            .zip(&shares)
            .map(|(c, &s)| (Arc::clone(&c.replica), s))
            .collect();
        (
            shares,
            Memo {
                branch: Branch::Tree(reason),
                hashes: None,
                matched,
            },
        )
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplicaLabels {
    replica: String,
}

/// Gauges computed from the tiers' own state when `/metrics` is read.
struct StateCollector(Arc<PrefixAffinity>);

impl std::fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StateCollector")
    }
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let affinity = &self.0;
        let per_replica = Family::<ReplicaLabels, Gauge>::default();
        for (replica, blocks) in affinity.index.replica_block_counts() {
            per_replica
                .get_or_create(&ReplicaLabels { replica })
                .set(i64::try_from(blocks).unwrap_or(i64::MAX));
        }
        per_replica.encode(encoder.encode_descriptor(
            "llmgw_kv_index_replica_blocks",
            "Blocks the KV index believes each replica holds",
            None,
            per_replica.metric_type(),
        )?)?;
        let stats = affinity.tokenizer.stats();
        let gauges: [(&str, &str, u64); 3] = [
            (
                "llmgw_kv_index_blocks",
                "Distinct block hashes in the KV index",
                affinity.index.distinct_blocks() as u64,
            ),
            (
                "llmgw_prefix_tree_nodes",
                "Nodes in the approximate prefix tree",
                affinity.tree.len() as u64,
            ),
            (
                "llmgw_tokenize_cache_bytes",
                "Bytes held by the tokenization cache",
                affinity.tokenizer.cache_bytes() as u64,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = Gauge::<i64>::default();
            gauge.set(i64::try_from(value).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let counters: [(&str, &str, &std::sync::atomic::AtomicU64); 8] = [
            (
                "llmgw_tokenize_cache_hits",
                "Tokenizations answered from the cache",
                &stats.cache_hits,
            ),
            (
                "llmgw_tokenize_cache_misses",
                "Tokenizations not in the cache",
                &stats.cache_misses,
            ),
            ("llmgw_tokenize_calls", "/tokenize calls made", &stats.calls),
            (
                "llmgw_tokenize_call_errors",
                "/tokenize calls that failed",
                &stats.call_errors,
            ),
            (
                "llmgw_tokenize_timeouts",
                "Tokenizations that missed their deadline",
                &stats.timeouts,
            ),
            (
                "llmgw_tokenize_local",
                "Requests tokenized in process (tokenizer.json and chat template)",
                &stats.local,
            ),
            (
                "llmgw_tokenize_local_checks",
                "In-process tokenizations compared with a replica's /tokenize",
                &stats.local_checks,
            ),
            (
                "llmgw_tokenize_local_mismatches",
                "Comparisons that disagreed (each turns in-process tokenization off for its model and kind)",
                &stats.local_mismatches,
            ),
        ];
        for (name, help, value) in counters {
            let counter = Counter::<u64>::default();
            counter.inc_by(value.load(std::sync::atomic::Ordering::Relaxed));
            counter.encode(encoder.encode_descriptor(
                name,
                help,
                None,
                counter.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

/// A 128-bit key of (model, salt, tokens): the model and salt seed an XXH3 over the tokens'
/// little-endian bytes, fed through a stack buffer.
fn tokens_key(model: &str, salt: Option<&str>, tokens: &[u32]) -> u128 {
    let mut seed = xxhash_rust::xxh3::Xxh3::new();
    seed.update(model.as_bytes());
    match salt {
        Some(salt) => {
            seed.update(&[1]);
            seed.update(salt.as_bytes());
        }
        None => seed.update(&[0]),
    }
    let mut hash = xxhash_rust::xxh3::Xxh3::with_seed(seed.digest());
    let mut buf = [0u8; 1024];
    for chunk in tokens.chunks(buf.len() / 4) {
        for (bytes, token) in buf.chunks_exact_mut(4).zip(chunk) {
            bytes.copy_from_slice(&token.to_le_bytes());
        }
        hash.update(&buf[..chunk.len() * 4]);
    }
    hash.digest128()
}

/// The prefix tree's scope for a request: its model, and its `cache_salt` when it has one, since
/// requests with different salts never share cached blocks however alike their text.
fn tree_scope(request: &ParsedRequest) -> std::borrow::Cow<'_, str> {
    match &request.cache_salt {
        None => request.model.as_str().into(),
        // NUL cannot appear in a model name taken from JSON text unescaped, and the tree only
        // compares scopes for equality.
        Some(salt) => format!("{}\0{salt}", request.model).into(),
    }
}

/// The bytes the prefix tree keys a request by: the prompt text, the token ids, or the chat
/// messages' JSON (which grows by appending as a conversation goes on).
fn prompt_text(request: &ParsedRequest) -> std::borrow::Cow<'_, [u8]> {
    match &request.input {
        RequestInput::Completion(Prompt::Text(text)) => text.as_bytes().into(),
        RequestInput::Completion(Prompt::TokenIds(ids)) => ids
            .iter()
            .flat_map(|id| id.to_le_bytes())
            .collect::<Vec<u8>>()
            .into(),
        RequestInput::Chat(chat) => chat.messages.get().as_bytes().into(),
    }
}

/// hit: the chosen replica matched as much as the best; miss: nobody matched; load_override:
/// someone matched more but load decided otherwise.
fn classify(matched: &[(Arc<Replica>, f64)], chosen: &Candidate) -> &'static str {
    let best = matched.iter().map(|(_, m)| *m).fold(0.0, f64::max);
    let mine = matched
        .iter()
        .find(|(r, _)| Arc::ptr_eq(r, &chosen.replica))
        .map_or(0.0, |(_, m)| *m);
    if best <= 0.0 {
        "miss"
    } else if mine >= best {
        "hit"
    } else {
        "load_override"
    }
}

impl PrefixScorer for PrefixAffinity {
    fn name(&self) -> &'static str {
        "prefix_affinity"
    }

    fn score<'a>(
        &'a self,
        request: &'a ParsedRequest,
        candidates: &'a [Candidate],
    ) -> BoxFuture<'a, Result<PrefixScores, PrefixUnavailable>> {
        Box::pin(async move {
            let (per_candidate, memo) = match self.score_precise(request, candidates).await {
                Ok((scores, memo)) if scores.iter().all(|s| *s <= 0.0) => {
                    // No candidate holds the prompt's leading blocks (evicted everywhere, or
                    // never cached). The tree still remembers where this prefix was sent: going
                    // back there keeps one replica warm for it instead of scattering it by load.
                    let (tree_scores, tree_memo) =
                        self.score_tree(request, candidates, "index_miss");
                    if tree_scores.iter().any(|s| *s > 0.0) {
                        let memo = Memo {
                            hashes: memo.hashes,
                            ..tree_memo
                        };
                        (tree_scores, memo)
                    } else {
                        (scores, memo)
                    }
                }
                Ok(scored) => scored,
                Err(reason) => self.score_tree(request, candidates, reason),
            };
            Ok(PrefixScores {
                per_candidate,
                memo: Some(Box::new(memo)),
            })
        })
    }

    fn after_pick(&self, request: &ParsedRequest, chosen: &Candidate, scores: &PrefixScores) {
        let Some(memo) = scores.memo.as_ref().and_then(|m| m.downcast_ref::<Memo>()) else {
            return;
        };
        self.tree.record(
            &tree_scope(request),
            &prompt_text(request),
            chosen.replica.endpoint(),
        );
        let decision = classify(&memo.matched, chosen);
        // The router's `route` span (the current span) gets the tier and what the pick held.
        let route = tracing::Span::current();
        route.record("prefix_outcome", decision);
        let held = memo
            .matched
            .iter()
            .find(|(r, _)| Arc::ptr_eq(r, &chosen.replica))
            .map_or(0.0, |(_, m)| *m);
        match memo.branch {
            Branch::Index => {
                self.metrics.kv(decision);
                route.record("tier", "index");
                route.record("matched_blocks", held as i64);
            }
            Branch::Tree(reason) => {
                self.metrics.kv(reason);
                self.metrics.tree(decision);
                route.record("tier", "tree");
                route.record("tier_reason", reason);
                route.record("matched_share", held);
            }
        }
        // The chosen replica is about to cache the prompt's blocks: count them as its own
        // until its engine's events arrive.
        if let Some(hashes) = &memo.hashes
            && let Ok(slot) = self.index.slot_or_insert(chosen.replica.endpoint())
        {
            self.speculative
                .insert(slot, Arc::clone(hashes), Instant::now());
        }
    }
}
