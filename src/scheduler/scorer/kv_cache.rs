//! `kv_cache`: precise prefix affinity from the engines' own KV events. For each request:
//! tokenize it ([`crate::tokenize`]: in process or through a candidate's `/tokenize`, least
//! loaded first), hash its blocks as the engines do ([`crate::blockhash`], per-model settings
//! from [`crate::models`]), ask the index ([`crate::kvindex`]) how many leading blocks each
//! candidate holds (plus the speculative entries of recent picks), and score the share of the
//! prompt held. It abstains, with the reason as a metric label, when the model's hash settings
//! are unknown (`unknown_settings`), no candidate's engine ever reported (`no_events`: no
//! events, nor an agent's snapshot, even an empty one), or tokenization fails or misses its
//! deadline (`tokenize_timeout`, ...): the profile's fallback (the `prefix_tree` by default)
//! then decides. After each pick the chosen replica is credited with the prompt's blocks until
//! its engine's events arrive.
//!
//! A LoRA adapter's request is hashed with its base model's settings and the adapter in every
//! block (`("lora", name, path)`, vLLM ≥ 0.31), the path being where each candidate's
//! `/v1/models` says it loaded the adapter from ([`crate::pool::adapters`]); candidates that
//! loaded it from different paths are matched against their own hashes.
//!
//! A holder whose engine evicted the rest of the prompt moments ago (the KV index remembers each
//! replica's recent evictions) is **churning** that prefix: its cache holds more working set
//! than fits, and sending the request there recomputes the evicted blocks and evicts others'
//! again. With `rebuild_cost` above 0 (off by default; 2 is the measured setting), each such
//! block costs that many held blocks of its score. When that leaves no replica worth its cache,
//! and also when no replica holds the prompt's first block but one evicted its blocks moments
//! ago (the fallback's memory of where the text went is then known to be stale), the answer is
//! final (`churn_placement`): the placement scorers choose a home by footprint, churn and load,
//! and the fallback is not asked.
//!
//! With `evicted_hold` above 0 (off by default), a replica keeps an **evicted claim** on the
//! prompts its engine evicted in part: each block right after the prefix it holds (or from the
//! prompt's start) that it evicted moments ago counts for `evicted_hold` held blocks (a hair
//! less, so a replica that still holds the blocks wins a tie). The tenant then computes them
//! again where the rest of its working set is instead of splitting between two caches. Off by
//! default: where every cache is over-full, a tenant evicted from two caches claims both and
//! load splits it between them (docs/results/2026-12-07-evicted-runs.md; until the evicted run
//! read past the eviction table's lost cells, claims were a few blocks and evened the split,
//! docs/results/2026-12-04-evicted-claim.md). `rebuild_cost` weighs the same blocks the other
//! way (a cost to the churning holder); at most one of the two is on.
//!
//! A replica whose engine lost its cache (a restart, a cache reset) is the **home** of the
//! prompts it held, for as long as the index remembers them ([`KvIndex::home_prefix`],
//! `--index-home-memory`): it scores as if it still held them, and a copy another replica made
//! meanwhile that holds no more of the prompt counts for nothing, so the tenants that left a
//! restarted replica come back instead of crowding the caches they fled to. A conversation
//! that went on elsewhere (a longer match there) stays where it is.
//!
//! With `lend_memory` above 0 (off by default), a prompt that load sent away from the one
//! replica holding it is **lent** ([`lends`]): for the tenant's next prompts that share its
//! blocks, the borrower's copy counts for nothing and the lender scores as if it held the
//! match, so they return once the lender's load allows instead of staying wherever load broke
//! the tie. The lent conversation's own next turn stays at the borrower; a prompt lent again
//! within the memory, or copied to more than one borrower, is a hot tenant's and its copies
//! stand.
//!
//! Parameters: `min_blocks` (leading blocks a replica must hold before its cache counts,
//! default 1), `speculative_ttl` (how long a pick credits the chosen replica, default 2s; 0
//! off), `rebuild_cost` (held blocks a block the holder evicted moments ago costs; default 0,
//! churn ignored; 2 is the measured setting), `evicted_hold` (held blocks a block the replica
//! evicted moments ago counts for, 0 to 1; default 0, off; 1 is the measured setting),
//! `lend_memory` (how long a lend is remembered, default 0s, off; 60s is the measured setting).
//!
//! Metrics: `llmgw_kv_decisions_total{decision}`: hit, miss, load_override when its scores
//! decided, homecoming when the pick went home to compute the prompt again, reclaim when a
//! lender won its prompt back from a copy as long, evicted_claim when the pick won by blocks
//! its engine evicted moments ago, churn_placement when churn left the placement scorers to
//! decide; `index_miss` when
//! it matched nothing and the fallback decided; else the reason it abstained.
//!
//! Each pick also records the blocks it adds to the chosen replica ([`Projections`]), which
//! `cache_footprint` counts until the engine's events can have arrived, and the tokens the
//! replica should find cached ([`crate::pool::drift`]), which its engine's own counters check.
//! It goes to the peer routers too ([`crate::peers`]), whose `kv_cache` credits the replica's
//! speculative entries and projections with it, as they do their own picks.
//!
//! Concurrency: the index, tokenizer and speculative entries have their own short-held locks;
//! the block-hash cache is one mutex held for a map lookup or insert, never across an `.await`.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use lru::LruCache;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tokio::time::Instant;
use tracing::Instrument;

use self::lends::{Lends, PromptEnd};
use super::cache_footprint::Projections;
use super::{DecisionLabels, classify};
use crate::blockhash::{BlockHasher, ExternalHash, LoraKey, RequestKeys};
use crate::kvindex::{KvIndex, PrefixMatch, ReplicaSlot, SpeculativeBlocks};
use crate::models::HashersByModel;
use crate::openai::ParsedRequest;
use crate::peers::{PeerPick, PickOutbox};
use crate::scheduler::Candidate;
use crate::scheduler::plugin::{Answer, Category, Pick, Role, Scorer, Scores, Scoring, ScoringContext};
use crate::scheduler::registry::{BuildContext, PluginError, ScorerPlugin, parameters};
use crate::tokenize::Tokenizer;

mod lends;

pub(super) static PLUGIN: ScorerPlugin = ScorerPlugin {
    kind: "kv_cache",
    build,
};

#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Parameters {
    min_blocks: u32,
    #[serde(with = "crate::duration::text")]
    speculative_ttl: Duration,
    /// What a block its holder evicted moments ago costs, in blocks it holds (0: churn
    /// ignored). 2 is the measured setting: this request's prefill of the block, and as much
    /// again for what storing it evicts there, which a cache that churns will be asked for
    /// again. Off by default: it shortens the recovery after a replica restart, but where every
    /// cache holds less than its tenants need, moving prompts only moves the churn
    /// (docs/results/2026-12-03-churn-and-real-vllm.md).
    rebuild_cost: f64,
    /// What a block the replica evicted moments ago, right after the prefix it holds (or from
    /// the prompt's start), counts for, in held blocks (0: off). 1 is the measured setting:
    /// the replica that held the prompt moments ago keeps its claim on it, so a tenant whose
    /// prompt was evicted in part computes it again where its working set was. Off by default:
    /// after a replica restart it raised the mean hit rate by about a point, but where every
    /// cache holds less than its tenants need it evened the split, and there an uneven one hits
    /// more (docs/results/2026-12-04-evicted-claim.md). Part of that evening was claims cut
    /// short by the eviction table's lost cells ([`KvIndex::evicted_run`] now reads past
    /// them); whole claims keep the uneven split, but with tenants drawn at random a tenant
    /// evicted from two caches claims both and load splits it
    /// (docs/results/2026-12-07-evicted-runs.md). Weighs the same blocks as `rebuild_cost`,
    /// the other way: at most one of the two is above 0.
    evicted_hold: f64,
    /// How long a prompt load sent away from the one replica that held it stays that
    /// replica's ([`lends`]); 0, the default, off. Off by default: in the measured restart runs
    /// it narrowed the spread but did not raise the mean hit rate, and with a hot tenant it
    /// cost a point of hit rate for a lower TTFT p99 (docs/results/2026-12-03-lending.md).
    #[serde(with = "crate::duration::text")]
    lend_memory: Duration,
}

impl Default for Parameters {
    fn default() -> Self {
        Parameters {
            min_blocks: 1,
            speculative_ttl: Duration::from_secs(2),
            rebuild_cost: 0.0,
            evicted_hold: 0.0,
            lend_memory: Duration::ZERO,
        }
    }
}

fn build(context: &mut BuildContext<'_>, value: serde_yaml::Value) -> Result<Arc<dyn Scorer>, PluginError> {
    let parameters: Parameters = parameters(value)?;
    if !(parameters.rebuild_cost.is_finite() && parameters.rebuild_cost >= 0.0) {
        return Err(PluginError::Invalid(format!(
            "rebuild_cost must be a number of blocks, 0 or more (got {})",
            parameters.rebuild_cost
        )));
    }
    if !(parameters.evicted_hold.is_finite() && (0.0..=1.0).contains(&parameters.evicted_hold)) {
        return Err(PluginError::Invalid(format!(
            "evicted_hold must be a share of a held block, from 0 to 1 (got {})",
            parameters.evicted_hold
        )));
    }
    if parameters.rebuild_cost > 0.0 && parameters.evicted_hold > 0.0 {
        return Err(PluginError::Invalid(format!(
            "rebuild_cost ({}) and evicted_hold ({}) weigh a replica's recent evictions of the \
             prompt in opposite directions; turn one off (0)",
            parameters.rebuild_cost, parameters.evicted_hold
        )));
    }
    let resources = context.resources.clone();
    Ok(Arc::new(KvCacheScorer {
        min_blocks: parameters.min_blocks,
        rebuild_cost: parameters.rebuild_cost,
        evicted_hold: parameters.evicted_hold,
        hashers: resources.hashers,
        index: resources.index,
        tokenizer: resources.tokenizer,
        speculative: SpeculativeBlocks::new(parameters.speculative_ttl),
        speculative_ttl: parameters.speculative_ttl,
        lends: Lends::new(parameters.lend_memory),
        projections: context.shared(|_| Projections::default()),
        picks: resources.picks,
        block_hashes: Mutex::new(LruCache::new(
            NonZeroUsize::new(HASH_CACHE_ENTRIES).unwrap_or(NonZeroUsize::MIN),
        )),
        metrics: context.shared(KvMetrics::register),
    }))
}

/// Shared by every `kv_cache` of a scheduler.
#[derive(Debug, Default)]
struct KvMetrics {
    decisions: Family<DecisionLabels, Counter>,
}

impl KvMetrics {
    fn register(registry: &mut Registry) -> KvMetrics {
        let metrics = KvMetrics::default();
        registry.register(
            "llmgw_kv_decisions",
            "Decisions of the precise KV index tier: hit, miss, load_override, homecoming, \
             reclaim, evicted_claim, churn_placement, or why it could not answer",
            metrics.decisions.clone(),
        );
        metrics
    }

    fn count(&self, decision: &'static str) {
        self.decisions
            .get_or_create(&DecisionLabels { decision })
            .inc();
    }
}


/// Most blocks past a holder's match looked up among its recent evictions (a bound on the
/// work per candidate; a longer run of evicted blocks already outweighs most matches).
const MAX_REBUILD_CHECK: usize = 256;

/// Prompts whose block hashes are remembered (about 1 KB each for a 2k-token prompt).
const HASH_CACHE_ENTRIES: usize = 8192;

/// Held blocks an evicted claim counts for less than the blocks it names: a replica that holds
/// a prompt wins a tie against one that held it and must compute it again.
const EVICTED_TIE: f64 = 1e-3;

struct KvCacheScorer {
    min_blocks: u32,
    /// Held blocks a block the holder must compute again costs its score (0: churn ignored).
    rebuild_cost: f64,
    /// Held blocks a block the replica evicted moments ago counts for (0: off).
    evicted_hold: f64,
    hashers: Arc<HashersByModel>,
    index: Arc<KvIndex>,
    tokenizer: Arc<Tokenizer>,
    speculative: SpeculativeBlocks,
    speculative_ttl: Duration,
    /// Prompts load sent away from the one replica that held them.
    lends: Lends,
    /// What each pick is about to store on its replica, for `cache_footprint`.
    projections: Arc<Projections>,
    /// Where this router's picks go to its peer routers.
    picks: Arc<PickOutbox>,
    /// Recent prompts' block hashes, keyed by their tokens, salt and model: a repeated prompt
    /// (every turn of a conversation re-sends the whole history) costs a 64-bit hash of its
    /// tokens instead of a SHA-256 per block.
    block_hashes: Mutex<LruCache<u128, Arc<[ExternalHash]>>>,
    metrics: Arc<KvMetrics>,
}

/// How a request's blocks are hashed: its (base) model's hasher, and the candidates grouped by
/// what else goes into the hashes.
struct HashPlan {
    hasher: Arc<BlockHasher>,
    /// An adapter's base model (whose tokenizer it uses); `None` for a base model's request.
    adapter_base: Option<String>,
    groups: Vec<HashGroup>,
}

/// Candidates whose engines hash the request's blocks alike.
struct HashGroup {
    /// The path the members loaded the request's adapter from; `None` for a base model.
    adapter_path: Option<String>,
    /// Indices into the candidates.
    members: Vec<usize>,
}

/// What `score` hands to `after_pick`.
struct Memo {
    /// The prompt's external block hashes as each candidate's engine computes them (an
    /// adapter's depend on the path the candidate loaded it from; empty for a candidate that
    /// does not list the adapter).
    hashes: Vec<Arc<[ExternalHash]>>,
    /// Leading blocks each candidate holds (speculative ones included).
    held: Vec<u32>,
    /// Blocks right after those each candidate's engine evicted moments ago (counted while
    /// `evicted_hold` is on).
    evicted: Vec<u32>,
    /// Leading blocks each candidate held when its engine last lost its cache (remembered).
    home: Vec<u32>,
    /// The candidate that lent this prompt under load, while the lend is remembered.
    lender: Option<Lender>,
    prompt_tokens: usize,
    block_size: usize,
}

/// A candidate that lent the prompt under load, and the block its lend was found at (the
/// longest match's last).
#[derive(Debug, Clone, Copy)]
struct Lender {
    candidate: usize,
    last: ExternalHash,
}

impl Memo {
    /// Whether the candidate at `i` was chosen for blocks its engine evicted moments ago: it
    /// does not hold the longest match (or none does), and with what it evicted its claim is
    /// longer.
    fn claimed_by_evictions(&self, i: usize) -> bool {
        let evicted = self.evicted.get(i).copied().unwrap_or(0);
        let held = self.held.get(i).copied().unwrap_or(0);
        let longest = self.held.iter().copied().max().unwrap_or(0);
        evicted > 0 && (held < longest || longest == 0) && held + evicted > longest
    }

    /// Prompt tokens the candidate at `i` should find cached: its held blocks, at most those
    /// before the prompt's last token (vLLM always computes that one).
    fn expected_cached_tokens(&self, i: usize) -> u64 {
        let held = self.held.get(i).map_or(0, |&b| b as usize);
        let most = self.prompt_tokens.saturating_sub(1) / self.block_size.max(1);
        (held.min(most) * self.block_size) as u64
    }
}

impl KvCacheScorer {
    /// The prompt's external block hashes, from the cache or computed (and remembered).
    fn block_hashes(
        &self,
        hasher: &BlockHasher,
        model: &str,
        tokens: &[u32],
        keys: RequestKeys<'_>,
    ) -> Arc<[ExternalHash]> {
        let key = tokens_key(model, keys, tokens);
        if let Some(hashes) = self.block_hashes.lock().get(&key) {
            return Arc::clone(hashes);
        }
        let mut hashes = Vec::new();
        hasher.request_hashes_into(tokens, keys, &mut hashes);
        let hashes: Arc<[ExternalHash]> = Arc::from(hashes);
        self.block_hashes.lock().put(key, Arc::clone(&hashes));
        hashes
    }

    /// How the request's blocks are hashed for each candidate: one group for a base model; for
    /// a LoRA adapter, one group per path the candidates loaded it from (vLLM ≥ 0.31 hashes the
    /// path), a candidate that does not list the adapter in none. `Err` is why the precise tier
    /// cannot answer.
    fn hash_plan(
        &self,
        model: &str,
        candidates: &[Candidate],
    ) -> Result<HashPlan, &'static str> {
        if let Some(hasher) = self.hashers.get(model) {
            let group = HashGroup {
                adapter_path: None,
                members: (0..candidates.len()).collect(),
            };
            return Ok(HashPlan {
                hasher: Arc::clone(hasher),
                adapter_base: None,
                groups: vec![group],
            });
        }
        let mut base: Option<String> = None;
        let mut groups: Vec<HashGroup> = Vec::new();
        for (i, candidate) in candidates.iter().enumerate() {
            let Some(catalog) = candidate.replica.adapters() else {
                continue;
            };
            let Some(adapter) = catalog.get(model) else {
                continue;
            };
            match &base {
                Some(known) if known != &adapter.base => continue,
                Some(_) => {}
                None => base = Some(adapter.base.clone()),
            }
            match groups
                .iter_mut()
                .find(|g| g.adapter_path.as_deref() == Some(adapter.path.as_str()))
            {
                Some(group) => group.members.push(i),
                None => groups.push(HashGroup {
                    adapter_path: Some(adapter.path.clone()),
                    members: vec![i],
                }),
            }
        }
        let base = base.ok_or("unknown_settings")?;
        let hasher = self.hashers.get(&base).ok_or("unknown_settings")?;
        Ok(HashPlan {
            hasher: Arc::clone(hasher),
            adapter_base: Some(base),
            groups,
        })
    }

    async fn score_precise(&self, request: &ParsedRequest, candidates: &[Candidate]) -> Answer {
        let HashPlan {
            hasher,
            adapter_base,
            groups,
        } = match self.hash_plan(&request.model, candidates) {
            Ok(plan) => plan,
            Err(reason) => return Answer::Abstain(reason),
        };
        let slots: Vec<Option<ReplicaSlot>> = candidates
            .iter()
            .map(|c| self.index.slot(c.replica.endpoint()))
            .collect();
        if slots.iter().all(Option::is_none) {
            return Answer::Abstain("no_events");
        }
        // Tokenize on the least loaded candidates first.
        let mut order: Vec<&Candidate> = candidates.iter().collect();
        order.sort_by_key(|c| c.in_flight);
        let addresses: Vec<&str> = order.iter().map(|c| c.replica.endpoint()).collect();
        let tokenize = tracing::debug_span!("tokenize", tokens = tracing::field::Empty);
        let tokens = match self
            .tokenizer
            .tokens_with(
                request,
                adapter_base.as_deref().unwrap_or(&request.model),
                &addresses,
            )
            .instrument(tokenize.clone())
            .await
        {
            Ok(tokens) => tokens,
            Err(e) => {
                tracing::debug!(model = %request.model, error = %e, "precise tier unavailable");
                return Answer::Abstain(e.reason());
            }
        };
        tokenize.record("tokens", tokens.len() as i64);
        drop(tokenize);

        let salt = request.cache_salt.as_deref();
        let mut hashes: Vec<Arc<[ExternalHash]>> = vec![Arc::from([]); candidates.len()];
        let mut weighted = vec![0f32; candidates.len()];
        let mut stored = vec![0u32; candidates.len()];
        let mut held = vec![0u32; candidates.len()];
        // Blocks of the prompt past what each holds that its engine evicted moments ago.
        let mut rebuilt = vec![0u32; candidates.len()];
        // Blocks right after those each holds that its engine evicted moments ago.
        let mut evicted = vec![0u32; candidates.len()];
        // Leading blocks of the prompt each held when its engine last lost its cache.
        let mut home = vec![0u32; candidates.len()];
        let now = Instant::now();
        let mut matches: Vec<PrefixMatch> = Vec::with_capacity(candidates.len());
        let mut group_slots: Vec<Option<ReplicaSlot>> = vec![None; candidates.len()];
        let mut group_held: Vec<u32> = vec![0; candidates.len()];
        for group in &groups {
            let keys = RequestKeys {
                lora: group.adapter_path.as_deref().map(|path| LoraKey {
                    name: &request.model,
                    path,
                }),
                cache_salt: salt,
            };
            let group_hashes = tracing::debug_span!("hash", tokens = tokens.len() as i64)
                .in_scope(|| self.block_hashes(&hasher, &request.model, &tokens, keys));
            tracing::Span::current().record("prompt_blocks", group_hashes.len() as i64);
            tracing::debug_span!("index_lookup", candidates = group.members.len() as i64)
                .in_scope(|| {
                    group_slots.fill(None);
                    for &i in &group.members {
                        group_slots[i] = slots[i];
                    }
                    self.index
                        .match_prefix(&group_hashes, &group_slots, &mut matches);
                    group_held.clear();
                    group_held.extend(matches.iter().map(|m| m.blocks));
                    self.speculative.raise_matches(
                        &group_hashes,
                        &group_slots,
                        now,
                        &mut group_held,
                    );
                });
            for &i in &group.members {
                hashes[i] = Arc::clone(&group_hashes);
                weighted[i] = matches[i].weighted;
                stored[i] = matches[i].blocks;
                held[i] = group_held[i];
                if let Some(slot) = slots[i] {
                    home[i] = self.index.home_prefix(slot, &group_hashes, now);
                }
                if let Some(slot) = slots[i] {
                    let rest = group_hashes.get(held[i] as usize..).unwrap_or_default();
                    let rest = &rest[..rest.len().min(MAX_REBUILD_CHECK)];
                    if self.rebuild_cost > 0.0 {
                        rebuilt[i] = self.index.recently_evicted(slot, rest) as u32;
                    } else if self.evicted_hold > 0.0 {
                        evicted[i] = self.index.evicted_run(slot, rest) as u32;
                    }
                }
            }
        }

        // A replica whose engine lost this prompt (a restart) is its home; copies the others
        // made meanwhile hold it no longer than the home remembers and are refugees: without
        // this, the tenants that left a restarted replica stay where they went, crowding those
        // caches while it stays nearly empty. A longer match (a conversation that went on
        // elsewhere) keeps its worth: moving it would compute it all again.
        let best_home = home.iter().copied().max().unwrap_or(0);
        let homecoming = best_home >= self.min_blocks.max(1);
        // A replica that held this prompt alone until load lent it to another: the copy is a
        // loan and counts for nothing, and the lender scores as if it still held the prompt
        // (its crowded cache may have evicted some of it meanwhile), so the prompt returns once
        // the lender's load allows instead of staying wherever load broke the tie. A loan has
        // one borrower: a match several others hold is a hot tenant's, spread on purpose.
        let longest = held.iter().copied().max().unwrap_or(0);
        let copies = held.iter().filter(|&&h| h == longest).count();
        let lender = if !self.lends.enabled()
            || homecoming
            || longest < self.min_blocks.max(1)
            || copies > 2
        {
            None
        } else {
            held.iter()
                .position(|&h| h == longest)
                .and_then(|i| Some((&hashes[i], *hashes[i].get(longest as usize - 1)?)))
                .and_then(|(prompt, last)| {
                    let holder = self.lends.holder(last, prompt, now)?;
                    let candidate = (0..candidates.len()).find(|&i| slots[i] == Some(holder))?;
                    // With the lender among them, two hold it; without, only the borrower.
                    let borrowers = copies - usize::from(held[candidate] == longest);
                    (borrowers == 1).then_some(Lender { candidate, last })
                })
        };
        let scores: Vec<f64> = (0..candidates.len())
            .map(|i| {
                let total = hashes[i].len().max(1) as f64;
                let mut value = if held[i] < self.min_blocks {
                    0.0
                } else if held[i] > stored[i] {
                    // Speculative blocks are assumed to be on the GPU.
                    f64::from(weighted[i]) + f64::from(held[i] - stored[i])
                } else {
                    f64::from(weighted[i])
                };
                // What the replica evicted of this prompt moments ago is still its claim: where
                // every cache is full, a prompt that moves for the blocks it lost evicts another
                // tenant's there, and the tenant's next prompts split between two caches.
                if evicted[i] > 0 && held[i] + evicted[i] >= self.min_blocks.max(1) {
                    value += (self.evicted_hold * f64::from(evicted[i]) - EVICTED_TIE).max(0.0);
                }
                if homecoming {
                    if home[i] > 0 {
                        value = value.max(f64::from(home[i]));
                    } else if held[i] <= best_home {
                        value = 0.0;
                    }
                }
                match lender {
                    Some(Lender { candidate, .. }) if candidate == i => {
                        value = value.max(f64::from(longest));
                    }
                    Some(_) => value = 0.0,
                    None => {}
                }
                // A holder that evicted the rest of this prompt moments ago is churning it: what
                // it holds is worth less than what it will compute again and evict anew.
                (value - self.rebuild_cost * f64::from(rebuilt[i])).max(0.0) / total
            })
            .collect();
        // No replica worth its cache, and one that evicted this very prompt moments ago: the
        // index knows where the prompt was and that it is gone, so the prefix tree's memory of
        // where its text went is stale, and placement decides.
        let churning = scores.iter().all(|&s| s <= 0.0) && rebuilt.iter().any(|&r| r > 0);
        let prompt_blocks = hashes.iter().map(|h| h.len()).max().unwrap_or(0);
        let memo = Memo {
            hashes,
            held,
            evicted,
            home,
            lender,
            prompt_tokens: tokens.len(),
            block_size: hasher.block_size(),
        };
        let scores = Scores::with_memo(scores, memo)
            .with_prompt_blocks(u32::try_from(prompt_blocks).unwrap_or(u32::MAX));
        Answer::Scored(if churning {
            scores.placement_decides()
        } else {
            scores
        })
    }

    /// Remembers a lend when load sent the prompt away from the one candidate that held the
    /// most of it, or away from its lender again (the prompt is hot). Names the decision when a
    /// lend decided it: `reclaim` when the lender won over a copy as long, `load_override` when
    /// load outvoted the lender.
    fn settle_lend(&self, memo: &Memo, pick: Pick<'_>) -> Option<&'static str> {
        if !self.lends.enabled() {
            return None;
        }
        let now = Instant::now();
        let slot_of = |i: usize| self.index.slot(pick.candidates.get(i)?.replica.endpoint());
        let held = |i: usize| memo.held.get(i).copied().unwrap_or(0) as usize;
        if let Some(Lender { candidate, last }) = memo.lender {
            if pick.chosen == candidate {
                let mine = held(candidate);
                let copied = (0..memo.held.len()).any(|i| i != candidate && held(i) >= mine);
                return copied.then_some("reclaim");
            }
            let end = memo.hashes.get(candidate).and_then(|h| PromptEnd::of(h));
            if let (Some(slot), Some(end)) = (slot_of(candidate), end) {
                self.lends.lent(&[last], end, slot, now);
            }
            return Some("load_override");
        }
        let best = (0..memo.held.len()).max_by_key(|&i| held(i))?;
        let longest = held(best);
        let runner_up = (0..memo.held.len())
            .filter(|&i| i != best)
            .map(held)
            .max()
            .unwrap_or(0);
        // Not an override, or a prompt others already hold as much of (copies made earlier).
        if held(pick.chosen) >= longest || runner_up >= longest {
            return None;
        }
        // The whole prompt past what the others held, not only what the holder still held: a
        // crowded holder may have evicted the tail of the tenant's shared prefix, which the
        // borrower now holds whole, and the tenant's next prompts must still find the lend.
        let prompt = memo.hashes.get(best)?;
        if let (Some(slot), Some(alone), Some(end)) =
            (slot_of(best), prompt.get(runner_up..), PromptEnd::of(prompt))
        {
            self.lends.lent(alone, end, slot, now);
        }
        None
    }

    /// The chosen replica is about to cache the prompt's blocks: count them as its own until its
    /// engine's events arrive, tell its drift check what it should find cached, and tell the
    /// peer routers.
    fn credit(&self, model: &str, memo: &Memo, pick: Pick<'_>) {
        let replica = &pick.chosen().replica;
        replica.drift().expect(
            memo.expected_cached_tokens(pick.chosen),
            memo.prompt_tokens as u64,
        );
        let held = memo.held.get(pick.chosen).copied().unwrap_or(0);
        let Some(hashes) = memo.hashes.get(pick.chosen).filter(|h| !h.is_empty()) else {
            return;
        };
        let new_blocks = (hashes.len() as u64).saturating_sub(u64::from(held));
        self.credit_blocks(replica.endpoint(), hashes, new_blocks);
        self.picks.publish(|| PeerPick {
            model: model.to_owned(),
            replica: replica.endpoint().to_owned(),
            hashes: Arc::clone(hashes),
            new_blocks: u32::try_from(new_blocks).unwrap_or(u32::MAX),
            tree_chain: Arc::from([]),
            placed: false,
        });
    }

    /// Credits `replica` with a prompt's blocks for the speculative window: the blocks
    /// themselves, and the `new_blocks` it is about to store for `cache_footprint`.
    fn credit_blocks(&self, replica: &str, hashes: &Arc<[ExternalHash]>, new_blocks: u64) {
        let Ok(slot) = self.index.slot_or_insert(replica) else {
            return;
        };
        let now = Instant::now();
        self.projections.record(
            slot,
            self.index.block_count(slot),
            new_blocks,
            now,
            self.speculative_ttl,
        );
        self.speculative.insert(slot, Arc::clone(hashes), now);
    }
}

impl Scorer for KvCacheScorer {
    fn category(&self) -> Category {
        Category::Affinity
    }

    fn score<'a>(&'a self, context: &'a ScoringContext<'a>, candidates: &'a [Candidate]) -> Scoring<'a> {
        Scoring::Pending(Box::pin(self.score_precise(context.request, candidates)))
    }

    fn after_pick(&self, context: &ScoringContext<'_>, pick: Pick<'_>, role: Role<'_>) {
        // The router's `route` span (the current span) gets the tier and what the pick held.
        let route = tracing::Span::current();
        match role {
            Role::Counted(scores) => {
                let Some(memo) = scores.memo::<Memo>() else {
                    return;
                };
                let chosen_home = memo.home.get(pick.chosen).copied().unwrap_or(0);
                let decision = if scores.placement_decides {
                    "churn_placement"
                } else if chosen_home > memo.held.get(pick.chosen).copied().unwrap_or(0) {
                    "homecoming"
                } else if memo.claimed_by_evictions(pick.chosen) {
                    "evicted_claim"
                } else if let Some(decision) = self.settle_lend(memo, pick) {
                    decision
                } else {
                    classify(memo.held.iter().map(|&b| f64::from(b)), pick.chosen)
                };
                self.metrics.count(decision);
                route.record("prefix_outcome", decision);
                route.record("tier", "index");
                route.record(
                    "matched_blocks",
                    memo.held.get(pick.chosen).copied().map_or(0, i64::from),
                );
                self.credit(&context.request.model, memo, pick);
            }
            Role::NotCounted { scores, abstained } => {
                let reason = abstained.unwrap_or("index_miss");
                self.metrics.count(reason);
                route.record("tier_reason", reason);
                if let Some(memo) = scores.and_then(|s| s.memo::<Memo>()) {
                    self.credit(&context.request.model, memo, pick);
                }
            }
            Role::NotAsked => {}
        }
    }

    fn peer_picked(&self, pick: &PeerPick) {
        // The peer's drift check and lends are its own: only what the blocks are is shared.
        if !pick.hashes.is_empty() {
            self.credit_blocks(&pick.replica, &pick.hashes, u64::from(pick.new_blocks));
        }
    }
}

/// A 128-bit key of (model, adapter path, salt, tokens): the model, path and salt seed an XXH3
/// over the tokens' little-endian bytes, fed through a stack buffer.
fn tokens_key(model: &str, keys: RequestKeys<'_>, tokens: &[u32]) -> u128 {
    let mut seed = xxhash_rust::xxh3::Xxh3::new();
    seed.update(model.as_bytes());
    match keys.lora {
        Some(lora) => {
            seed.update(&[1]);
            seed.update(&(lora.path.len() as u64).to_le_bytes());
            seed.update(lora.path.as_bytes());
        }
        None => seed.update(&[0]),
    }
    match keys.cache_salt {
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

#[cfg(test)]
mod tests {
    #[test]
    fn the_hash_cache_key_separates_models_adapters_salts_and_tokens() {
        use super::tokens_key;
        use crate::blockhash::{LoraKey, RequestKeys};
        let salted = RequestKeys::salted;
        let lora = |path| RequestKeys {
            lora: Some(LoraKey { name: "m", path }),
            cache_salt: None,
        };
        let tokens: Vec<u32> = (0..600).collect();
        let base = tokens_key("m", salted(None), &tokens);
        assert_eq!(base, tokens_key("m", salted(None), &tokens));
        assert_ne!(base, tokens_key("m2", salted(None), &tokens));
        assert_ne!(base, tokens_key("m", salted(Some("")), &tokens));
        assert_ne!(
            tokens_key("m", salted(Some("a")), &tokens),
            tokens_key("m", salted(Some("b")), &tokens)
        );
        assert_ne!(base, tokens_key("m", lora(""), &tokens));
        assert_ne!(tokens_key("m", lora("/a"), &tokens), tokens_key("m", lora("/b"), &tokens));
        let mut other = tokens.clone();
        other[599] = 7;
        assert_ne!(base, tokens_key("m", salted(None), &other));
        assert_ne!(base, tokens_key("m", salted(None), &tokens[..599]));
    }
}
