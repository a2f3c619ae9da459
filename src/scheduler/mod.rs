//! Choosing a replica: filters → weighted scorers → picker.
//!
//! 1. **Filters** keep the replicas that serve the model (404 if none), are healthy (503 if
//!    none), lie in the proxy's subset hint when one is given, and are not saturated (429 if
//!    every remaining one is).
//! 2. **Scorers** each give every candidate a score in `[0, 1]`: the built-in load scorers
//!    ([`scorers`]) and, in the prefix slot, an optional [`PrefixScorer`]. The total is the
//!    weighted mean, so it stays in `[0, 1]`.
//! 3. **Picker**: the highest total wins, ties broken by rendezvous hashing of the request with
//!    each replica (so routers agree; at random for requests without a prompt); the next best
//!    become the ordered fallback list.
//!
//! The **imbalance guard** lets load outvote affinity: when the most loaded candidate has at
//! least `imbalance_threshold` more requests (in flight + waiting) than the least loaded, the
//! prefix score is ignored for that decision.
//!
//! # Concurrency model
//! A [`Scheduler`] is immutable after construction and shared by every ext_proc stream; a
//! decision reads the pool snapshot lock-free and allocates only its small candidate vectors.
//! The in-flight count of the chosen replica rises inside [`Scheduler::decide`] (the returned
//! [`Decision`] holds the guard), so concurrent decisions see each other at once.

pub mod prefix;
pub mod scorers;

use std::sync::Arc;

use rand::Rng;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::time::Instant;

pub use prefix::{PrefixScorer, PrefixScores, PrefixUnavailable};
pub use scorers::Scorer;

use crate::openai::{ParsedRequest, Prompt, RequestInput};
use crate::pool::{EngineLoad, InFlightGuard, Pool, Replica};

/// Weights of the scorers; a weight of 0 turns a scorer off.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScorerWeights {
    pub queue: f64,
    pub in_flight: f64,
    pub kv_cache: f64,
    pub prefix: f64,
}

impl Default for ScorerWeights {
    fn default() -> Self {
        ScorerWeights {
            queue: 1.0,
            in_flight: 1.0,
            kv_cache: 1.0,
            prefix: 2.0,
        }
    }
}

/// When a replica counts as saturated and leaves the candidates.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SaturationLimits {
    /// `vllm:num_requests_waiting` at or above this saturates.
    pub max_waiting: f64,
    /// `vllm:kv_cache_usage_perc` at or above this saturates.
    pub max_kv_cache_usage: f64,
    /// llmgw's own in-flight count at or above this saturates (0 = no limit).
    pub max_in_flight: u32,
}

impl Default for SaturationLimits {
    fn default() -> Self {
        SaturationLimits {
            max_waiting: 128.0,
            max_kv_cache_usage: 0.99,
            max_in_flight: 0,
        }
    }
}

/// Everything that shapes decisions.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerSettings {
    pub weights: ScorerWeights,
    pub saturation: SaturationLimits,
    /// Load spread (requests in flight + waiting) from which prefix affinity is ignored.
    pub imbalance_threshold: f64,
    /// How many next-best replicas follow the pick in the destination list.
    pub fallbacks: usize,
}

impl Default for SchedulerSettings {
    fn default() -> Self {
        SchedulerSettings {
            weights: ScorerWeights::default(),
            saturation: SaturationLimits::default(),
            imbalance_threshold: 16.0,
            fallbacks: 2,
        }
    }
}

/// A replica that passed the filters, with its load read once for the whole decision.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub replica: Arc<Replica>,
    /// llmgw's in-flight count when the decision started.
    pub in_flight: u32,
    /// The engine's scraped load; `None` when unknown (stale or failed scrape).
    pub engine: Option<EngineLoad>,
}

impl Candidate {
    /// Requests in flight plus requests the engine reports waiting (unknown counts as 0).
    fn pending(&self) -> f64 {
        f64::from(self.in_flight) + self.engine.and_then(|e| e.waiting).unwrap_or(0.0)
    }

    fn saturated(&self, limits: &SaturationLimits) -> bool {
        let engine = self.engine.unwrap_or(EngineLoad {
            waiting: None,
            running: None,
            kv_cache_usage: None,
        });
        engine.waiting.is_some_and(|w| w >= limits.max_waiting)
            || engine
                .kv_cache_usage
                .is_some_and(|u| u >= limits.max_kv_cache_usage)
            || (limits.max_in_flight > 0 && self.in_flight >= limits.max_in_flight)
    }
}

/// What scorers may look at besides the candidates.
#[derive(Debug, Clone, Copy)]
pub struct ScoringContext<'a> {
    pub request: &'a ParsedRequest,
}

/// Restrictions the proxy puts on a decision.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scope<'a> {
    /// The Endpoint Picker Protocol's subset hint: pick only among these `ip:port`s.
    pub subset: Option<&'a [String]>,
}

/// The outcome of a decision: where to send the request, and its in-flight count.
#[derive(Debug)]
pub struct Decision {
    /// Counts the request against the primary replica until dropped.
    pub in_flight: InFlightGuard,
    /// Next-best replicas, best first, for the proxy's retries.
    pub fallbacks: Vec<Arc<Replica>>,
    /// Whether the imbalance guard overruled prefix affinity.
    pub imbalance_guard_fired: bool,
    /// Whether the prefix scorer was asked and failed.
    pub prefix_unavailable: bool,
}

impl Decision {
    pub fn primary(&self) -> &Arc<Replica> {
        self.in_flight.replica()
    }

    /// `primary,fallback1,…` as the destination header and `envoy.lb` metadata carry it.
    pub fn destination(&self) -> String {
        let mut value = self.primary().endpoint().to_string();
        for fallback in &self.fallbacks {
            value.push(',');
            value.push_str(fallback.endpoint());
        }
        value
    }
}

/// Why no replica was chosen. Each maps to one HTTP status.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecideError {
    #[error("model {0:?} is not served by any replica")]
    UnknownModel(String),
    #[error("no replica serving the model is ready")]
    NoReadyReplica,
    #[error("no replica in the proxy's endpoint subset is ready")]
    EmptySubset,
    #[error("every replica serving the model is saturated")]
    AllSaturated,
}

/// Filters, scorers and picker over one pool.
pub struct Scheduler {
    pool: Arc<Pool>,
    settings: SchedulerSettings,
    scorers: Vec<(f64, Box<dyn Scorer>)>,
    prefix: Option<Box<dyn PrefixScorer>>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("settings", &self.settings)
            .field("prefix", &self.prefix.as_ref().map(|p| p.name()))
            .finish_non_exhaustive()
    }
}

impl Scheduler {
    /// A scheduler with the built-in load scorers and an empty prefix slot.
    pub fn new(pool: Arc<Pool>, settings: SchedulerSettings) -> Scheduler {
        let weights = settings.weights;
        let scorers: Vec<(f64, Box<dyn Scorer>)> = vec![
            (weights.queue, Box::new(scorers::QueueScorer)),
            (weights.in_flight, Box::new(scorers::InFlightScorer)),
            (weights.kv_cache, Box::new(scorers::KvCacheScorer)),
        ];
        Scheduler {
            pool,
            settings,
            scorers: scorers.into_iter().filter(|(w, _)| *w > 0.0).collect(),
            prefix: None,
        }
    }

    /// Fills the prefix slot (weighted by `settings.weights.prefix`).
    pub fn with_prefix_scorer(mut self, scorer: Box<dyn PrefixScorer>) -> Scheduler {
        self.prefix = Some(scorer);
        self
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    pub fn settings(&self) -> &SchedulerSettings {
        &self.settings
    }

    /// Chooses a replica for a completion request.
    pub async fn decide(
        &self,
        request: &ParsedRequest,
        scope: Scope<'_>,
    ) -> Result<Decision, DecideError> {
        let snapshot = self.pool.snapshot();
        let serving = snapshot.serving(&request.model);
        if serving.is_empty() {
            return Err(DecideError::UnknownModel(request.model.clone()));
        }
        let candidates = self.candidates(serving, scope)?;

        // Prefix first (it may wait on a tokenizer); the load scorers read the loads the
        // filters captured, so their order does not matter. Fields of the router's `route`
        // span are recorded on the current span.
        let route = tracing::Span::current();
        let mut imbalance_guard_fired = false;
        let mut prefix_unavailable = false;
        let mut prefix_scores = None;
        if let Some(prefix) = &self.prefix
            && self.settings.weights.prefix > 0.0
        {
            let (lo, hi) = candidates
                .iter()
                .map(Candidate::pending)
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
                    (lo.min(p), hi.max(p))
                });
            if hi - lo >= self.settings.imbalance_threshold {
                imbalance_guard_fired = true;
                route.record("tier", "load");
                route.record("tier_reason", "imbalance_guard");
            } else {
                match prefix.score(request, &candidates).await {
                    Ok(result) if result.per_candidate.len() == candidates.len() => {
                        prefix_scores = Some(result);
                    }
                    Ok(result) => {
                        tracing::warn!(
                            scorer = prefix.name(),
                            got = result.per_candidate.len(),
                            expected = candidates.len(),
                            "prefix scorer returned the wrong number of scores; ignored"
                        );
                        prefix_unavailable = true;
                    }
                    Err(e) => {
                        tracing::debug!(scorer = prefix.name(), error = %e, "deciding on load alone");
                        prefix_unavailable = true;
                    }
                }
                if prefix_unavailable {
                    route.record("tier", "load");
                    route.record("tier_reason", "prefix_unavailable");
                }
            }
        } else {
            route.record("tier", "load");
        }

        let order = {
            let _score =
                tracing::debug_span!("score", candidates = candidates.len() as i64).entered();
            let context = ScoringContext { request };
            let mut total = vec![0.0; candidates.len()];
            let mut weight_sum = 0.0;
            let mut scores = vec![0.0; candidates.len()];
            for (weight, scorer) in &self.scorers {
                scorer.score(&context, &candidates, &mut scores);
                for (t, s) in total.iter_mut().zip(&scores) {
                    *t += weight * s.clamp(0.0, 1.0);
                }
                weight_sum += weight;
            }
            if let Some(result) = &prefix_scores {
                let weight = self.settings.weights.prefix;
                for (t, s) in total.iter_mut().zip(&result.per_candidate) {
                    *t += weight * s.clamp(0.0, 1.0);
                }
                weight_sum += weight;
            }
            if weight_sum > 0.0 {
                total.iter_mut().for_each(|t| *t /= weight_sum);
            }
            rank_for(request, &total, &candidates)
        };
        let chosen = &candidates[order[0]];
        if let (Some(prefix), Some(scores)) = (&self.prefix, &prefix_scores) {
            prefix.after_pick(request, chosen, scores);
        }
        let fallbacks = order[1..]
            .iter()
            .take(self.settings.fallbacks)
            .map(|&i| Arc::clone(&candidates[i].replica))
            .collect();
        Ok(Decision {
            in_flight: chosen.replica.start_request(),
            fallbacks,
            imbalance_guard_fired,
            prefix_unavailable,
        })
    }

    /// Chooses any ready replica (least in flight, ties at random) for a request that is not a
    /// completion, such as `GET /v1/models`.
    pub fn decide_any(&self, scope: Scope<'_>) -> Result<Decision, DecideError> {
        let snapshot = self.pool.snapshot();
        let candidates = self.candidates(snapshot.replicas(), scope)?;
        let scores: Vec<f64> = candidates.iter().map(|c| -f64::from(c.in_flight)).collect();
        let order = rank(&scores, &mut rand::rng());
        Ok(Decision {
            in_flight: candidates[order[0]].replica.start_request(),
            fallbacks: order[1..]
                .iter()
                .take(self.settings.fallbacks)
                .map(|&i| Arc::clone(&candidates[i].replica))
                .collect(),
            imbalance_guard_fired: false,
            prefix_unavailable: false,
        })
    }

    /// The healthy, in-scope, unsaturated replicas among `replicas`.
    fn candidates(
        &self,
        replicas: &[Arc<Replica>],
        scope: Scope<'_>,
    ) -> Result<Vec<Candidate>, DecideError> {
        let now = Instant::now();
        let staleness = self.pool.metrics_staleness();
        let mut healthy: Vec<&Arc<Replica>> = replicas.iter().filter(|r| r.is_healthy()).collect();
        if healthy.is_empty() {
            return Err(DecideError::NoReadyReplica);
        }
        if let Some(subset) = scope.subset {
            healthy.retain(|r| subset.iter().any(|e| e == r.endpoint()));
            if healthy.is_empty() {
                return Err(DecideError::EmptySubset);
            }
        }
        let candidates: Vec<Candidate> = healthy
            .into_iter()
            .map(|replica| Candidate {
                in_flight: replica.in_flight(),
                engine: replica.engine_load(now, staleness),
                replica: Arc::clone(replica),
            })
            .filter(|c| !c.saturated(&self.settings.saturation))
            .collect();
        if candidates.is_empty() {
            return Err(DecideError::AllSaturated);
        }
        Ok(candidates)
    }
}

/// How many leading bytes of a prompt identify a request for tie-breaking: enough to tell
/// conversations apart, bounded so a long prompt costs nothing extra.
const TIE_KEY_BYTES: usize = 4096;

/// Candidate indices, best score first; equal scores ordered by rendezvous hashing of the
/// request (its model, salt and prompt's first bytes) with each replica's address. So routers
/// that see the same state pick the same replica for the same request, while different
/// requests still spread over equally good replicas.
fn rank_for(request: &ParsedRequest, scores: &[f64], candidates: &[Candidate]) -> Vec<usize> {
    let request_key = tie_key(request);
    let keys: Vec<u64> = candidates
        .iter()
        .map(|c| xxhash_rust::xxh3::xxh3_64_with_seed(c.replica.endpoint().as_bytes(), request_key))
        .collect();
    rank_by(scores, &keys)
}

fn head(bytes: &[u8]) -> &[u8] {
    &bytes[..bytes.len().min(TIE_KEY_BYTES)]
}

fn tie_key(request: &ParsedRequest) -> u64 {
    use xxhash_rust::xxh3::Xxh3;
    let mut hash = Xxh3::new();
    hash.update(request.model.as_bytes());
    hash.update(&[0]);
    if let Some(salt) = &request.cache_salt {
        hash.update(salt.as_bytes());
    }
    hash.update(&[0]);
    match &request.input {
        RequestInput::Completion(Prompt::Text(text)) => {
            hash.update(head(text.raw_json().get().as_bytes()))
        }
        RequestInput::Completion(Prompt::TokenIds(ids)) => {
            for id in ids.iter().take(TIE_KEY_BYTES / 4) {
                hash.update(&id.to_le_bytes());
            }
        }
        RequestInput::Chat(chat) => hash.update(head(chat.messages.get().as_bytes())),
    }
    hash.digest()
}

/// Candidate indices, best score first; equal scores in random order.
fn rank(scores: &[f64], rng: &mut impl Rng) -> Vec<usize> {
    let keys: Vec<u64> = (0..scores.len()).map(|_| rng.random()).collect();
    rank_by(scores, &keys)
}

/// Candidate indices, best score first; equal scores in ascending order of `keys`.
fn rank_by(scores: &[f64], keys: &[u64]) -> Vec<usize> {
    let mut keyed: Vec<(usize, u64)> = (0..scores.len()).map(|i| (i, keys[i])).collect();
    keyed.sort_by(|(a, ka), (b, kb)| {
        scores[*b]
            .partial_cmp(&scores[*a])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(ka.cmp(kb))
    });
    keyed.into_iter().map(|(i, _)| i).collect()
}

#[cfg(test)]
mod tests;
