//! Choosing a replica: a plugin host running filters → weighted scorers → picker.
//!
//! 1. **Eligibility** (fixed, not plugins): the replicas that serve the model (404 if none),
//!    are healthy (503 if none) and lie in the proxy's subset hint when one is given (503).
//! 2. **Filters** ([`filter`]): the profile's filter plugins in order; a filter that removes
//!    every candidate refuses the request (429 for `saturation`) or, if it only states a
//!    preference, is ignored.
//! 3. **Scorers** ([`scorer`]): each gives every candidate a score in `[0, 1]`; the total is the
//!    weighted mean over the scorers that answered, so it stays in `[0, 1]`. A scorer may have a
//!    **fallback**, asked with its weight when it abstains or scores every candidate 0 (the
//!    default profile: the precise `kv_cache` scorer, with the approximate `prefix_tree` as its
//!    fallback).
//! 4. **Picker**: the highest total wins, ties broken by rendezvous hashing of the request with
//!    each replica (so routers agree; at random for requests without a prompt); the next best
//!    become the ordered fallback list. Every scorer then hears the pick ([`plugin::Role`]).
//!
//! **Placement scorers** (the default profile's `cache_footprint`) are asked last, and only
//! for a request the profile's affinity scorers found nowhere (each abstained or scored every
//! candidate 0; a profile without affinity scorers never asks them): they choose a home for a
//! new prefix by what it would evict. An affinity scorer's all-zero answer marked
//! [`Scores::placement_decides`] (`kv_cache` found the prompt only where it is being churned)
//! hands the request to them without asking its fallback.
//!
//! The **imbalance guard** lets load outvote affinity: when the most loaded candidate has at
//! least `imbalance_threshold` more requests (in flight + waiting) than the least loaded, the
//! affinity and placement scorers are not asked for that decision.
//!
//! Which plugins run with which weights is the scheduling profile ([`profile`]), built by name
//! through the registry ([`registry`]).
//!
//! # Concurrency model
//! A [`Scheduler`] is immutable after construction and shared by every ext_proc stream; a
//! decision reads the pool snapshot lock-free and allocates only its small candidate and score
//! vectors; plugins keep their own state behind short-held locks. The in-flight count of the
//! chosen replica rises inside [`Scheduler::decide`] (the returned [`Decision`] holds the
//! guard), so concurrent decisions see each other at once.

pub mod filter;
pub mod plugin;
pub mod profile;
pub mod registry;
pub mod scorer;

use std::sync::Arc;

use prometheus_client::registry::Registry;
use rand::Rng;
use thiserror::Error;
use tokio::time::Instant;

pub use plugin::{
    Answer, Category, Filter, Pick, Role, Scorer, Scores, Scoring, ScoringContext, WhenNonePass,
};
pub use profile::{PluginSpec, Profile, ProfileError, SchedulerArgs, SchedulerConfig};
pub use registry::PluginResources;

use crate::openai::{ParsedRequest, Prompt, RequestInput};
use crate::pool::adapters::AdapterSlots;
use crate::pool::{EngineLoad, InFlightGuard, Pool, Replica};

/// A replica that passed the filters, with its load read once for the whole decision.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub replica: Arc<Replica>,
    /// Requests in flight when the decision started: this router's, plus what its peers last
    /// reported ([`crate::peers`]).
    pub in_flight: u32,
    /// The engine's scraped load; `None` when unknown (stale or failed scrape).
    pub engine: Option<EngineLoad>,
    /// The engine's waiting queue with what llmgw started and saw end since the scrape
    /// ([`Replica::waiting_estimate`]); `None` when unknown.
    pub waiting_estimate: Option<f64>,
    /// The engine's LoRA adapter slots at the scrape; `None` when unknown or LoRA is off.
    pub adapter_slots: Option<Arc<AdapterSlots>>,
}

impl Candidate {
    /// `replica` with its load as of `now`.
    fn of(replica: &Arc<Replica>, now: Instant, staleness: std::time::Duration) -> Candidate {
        Candidate {
            in_flight: replica.in_flight().saturating_add(replica.peer_in_flight()),
            engine: replica.engine_load(now, staleness),
            waiting_estimate: replica.waiting_estimate(now, staleness),
            adapter_slots: replica.adapter_slots(now, staleness),
            replica: Arc::clone(replica),
        }
    }

    /// Whether the replica's `/v1/models` lists `model` as a LoRA adapter.
    pub fn lists_adapter(&self, model: &str) -> bool {
        self.replica
            .adapters()
            .is_some_and(|catalog| catalog.get(model).is_some())
    }

    /// Requests in flight plus requests the engine reports waiting (unknown counts as 0).
    fn pending(&self) -> f64 {
        f64::from(self.in_flight) + self.engine.and_then(|e| e.waiting).unwrap_or(0.0)
    }
}

/// The scorers that hear peer routers' picks ([`Scheduler::pick_listeners`]).
pub struct PickListeners(Vec<Arc<dyn Scorer>>);

impl crate::peers::PickSink for PickListeners {
    fn peer_picked(&self, pick: &crate::peers::PeerPick) {
        for scorer in &self.0 {
            scorer.peer_picked(pick);
        }
    }
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
    /// Whether the imbalance guard overruled affinity.
    pub imbalance_guard_fired: bool,
    /// Whether an affinity scorer (and its fallback) was asked and none answered.
    pub prefix_unavailable: bool,
    /// Ready replicas a filter took out of the candidates (empty, with no allocation, when
    /// none was).
    pub filtered_out: Vec<FilteredOut>,
}

/// A replica a filter removed from a decision's candidates: why a request did not go where
/// its prefix is, when that is the reason.
#[derive(Debug, Clone)]
pub struct FilteredOut {
    /// The filter's name in the profile.
    pub filter: Arc<str>,
    pub replica: Arc<Replica>,
}

/// The route span's `filtered_out` field ([`Decision::filtered_out_trace`]).
pub struct FilteredOutTrace<'a>(&'a [FilteredOut]);

impl std::fmt::Display for FilteredOutTrace<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, out) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            write!(f, "{sep}{}={}", out.filter, out.replica.endpoint())?;
        }
        Ok(())
    }
}

impl Decision {
    /// `FILTER=ENDPOINT` per replica a filter took out, comma-separated (empty when none).
    pub fn filtered_out_trace(&self) -> FilteredOutTrace<'_> {
        FilteredOutTrace(&self.filtered_out)
    }

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
    /// A scorer refused the request ([`plugin::Scorer::check`]).
    #[error("{0}")]
    BadRequest(String),
}

/// A scorer of the profile with its weight and optional fallback.
pub struct ScorerEntry {
    pub name: String,
    pub weight: f64,
    pub scorer: Arc<dyn Scorer>,
    pub fallback: Option<(String, Arc<dyn Scorer>)>,
}

impl ScorerEntry {
    pub fn new(name: impl Into<String>, weight: f64, scorer: Arc<dyn Scorer>) -> ScorerEntry {
        ScorerEntry {
            name: name.into(),
            weight,
            scorer,
            fallback: None,
        }
    }

    pub fn with_fallback(mut self, name: impl Into<String>, scorer: Arc<dyn Scorer>) -> Self {
        self.fallback = Some((name.into(), scorer));
        self
    }
}

/// Which answer of an entry counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Counted {
    Primary,
    Fallback,
    Neither,
}

/// What one entry said in a decision.
struct Evaluated {
    /// `None`: not asked (the imbalance guard).
    primary: Option<Answer>,
    /// `None`: not asked (the primary answered) or no fallback.
    fallback: Option<Answer>,
    counted: Counted,
}

impl Evaluated {
    fn not_asked() -> Evaluated {
        Evaluated {
            primary: None,
            fallback: None,
            counted: Counted::Neither,
        }
    }

    fn counted_scores(&self) -> Option<&Scores> {
        match self.counted {
            Counted::Primary => self.primary.as_ref().and_then(Answer::scores),
            Counted::Fallback => self.fallback.as_ref().and_then(Answer::scores),
            Counted::Neither => None,
        }
    }
}

/// The role of an answer after the pick.
fn role(answer: Option<&Answer>, counted: bool) -> Role<'_> {
    match (answer, counted) {
        (None, _) => Role::NotAsked,
        (Some(Answer::Scored(scores)), true) => Role::Counted(scores),
        (Some(answer), _) => Role::NotCounted {
            scores: answer.scores(),
            abstained: answer.abstained(),
        },
    }
}

/// A decision's scores as the route span's `scores` field: the names of the scorers that
/// counted, then per candidate (in the candidates' order) its weighted mean and each counted
/// score, `/`-separated: `kv_cache,in_flight|0.67/1.00/0.00|0.33/0.00/1.00`. Formatted only when
/// the span is recorded (`llmgw::router=debug`).
struct ScoresTrace<'a> {
    scorers: &'a [ScorerEntry],
    evaluated: &'a [Evaluated],
    total: &'a [f64],
}

impl std::fmt::Display for ScoresTrace<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The counted answers, each named by the scorer that gave it (a fallback by its own).
        let counted = || {
            self.scorers
                .iter()
                .zip(self.evaluated)
                .filter_map(|(entry, ev)| {
                    let name = match (ev.counted, &entry.fallback) {
                        (Counted::Fallback, Some((fallback, _))) => fallback,
                        _ => &entry.name,
                    };
                    Some((name, ev.counted_scores()?))
                })
        };
        for (k, (name, _)) in counted().enumerate() {
            write!(f, "{}{name}", if k == 0 { "" } else { "," })?;
        }
        for (i, total) in self.total.iter().enumerate() {
            write!(f, "|{total:.2}")?;
            for (_, scores) in counted() {
                let score = scores.per_candidate.get(i).copied().unwrap_or(0.0);
                write!(f, "/{score:.2}")?;
            }
        }
        Ok(())
    }
}

/// Everything but the plugins.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedulerOptions {
    /// Load spread (requests in flight + waiting) from which affinity scorers are skipped.
    pub imbalance_threshold: f64,
    /// How many next-best replicas follow the pick in the destination list.
    pub fallbacks: usize,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        let config = SchedulerConfig::default();
        SchedulerOptions {
            imbalance_threshold: config.imbalance_threshold,
            fallbacks: config.fallbacks,
        }
    }
}

/// Filters, scorers and picker over one pool.
pub struct Scheduler {
    pool: Arc<Pool>,
    options: SchedulerOptions,
    /// Names are shared with each decision's [`FilteredOut`], so naming a removal allocates
    /// nothing.
    filters: Vec<(Arc<str>, Arc<dyn Filter>)>,
    scorers: Vec<ScorerEntry>,
    /// The request headers the plugins read.
    request_headers: Vec<String>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("options", &self.options)
            .field(
                "filters",
                &self.filters.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field(
                "scorers",
                &self
                    .scorers
                    .iter()
                    .map(|e| (&e.name, e.weight, e.fallback.as_ref().map(|(n, _)| n)))
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Scheduler {
    /// Builds the profile of `config` by name (weights applied, zero weights dropped); the
    /// plugins register their metrics in `registry`.
    pub fn build(
        pool: Arc<Pool>,
        config: &SchedulerConfig,
        resources: &PluginResources,
        registry: &mut Registry,
    ) -> Result<Scheduler, ProfileError> {
        if config.imbalance_threshold.is_nan() || config.imbalance_threshold <= 0.0 {
            return Err(ProfileError::ImbalanceThreshold(config.imbalance_threshold));
        }
        let profile = config.effective_profile()?;
        let built = registry::build_profile(&profile, resources, registry)?;
        Ok(Scheduler::with_plugins(
            pool,
            SchedulerOptions {
                imbalance_threshold: config.imbalance_threshold,
                fallbacks: config.fallbacks,
            },
            built.filters,
            built.scorers,
        ))
    }

    /// The default profile without affinity scorers and with nothing shared (its metrics
    /// unregistered): load-only routing, for tests and benches.
    pub fn load_only(pool: Arc<Pool>) -> Result<Scheduler, ProfileError> {
        Scheduler::build(
            pool,
            &SchedulerConfig::load_only(),
            &PluginResources::standalone(),
            &mut Registry::default(),
        )
    }

    /// A scheduler with the given plugins (the registry's path is [`Scheduler::build`]).
    pub fn with_plugins(
        pool: Arc<Pool>,
        options: SchedulerOptions,
        filters: Vec<(String, Arc<dyn Filter>)>,
        scorers: Vec<ScorerEntry>,
    ) -> Scheduler {
        let mut request_headers: Vec<String> = scorers
            .iter()
            .flat_map(|e| {
                std::iter::once(&e.scorer)
                    .chain(e.fallback.as_ref().map(|(_, s)| s))
                    .flat_map(|s| s.request_headers())
            })
            .collect();
        request_headers.sort();
        request_headers.dedup();
        Scheduler {
            pool,
            options,
            filters: filters
                .into_iter()
                .map(|(name, filter)| (Arc::from(name), filter))
                .collect(),
            scorers: scorers.into_iter().filter(|e| e.weight > 0.0).collect(),
            request_headers,
        }
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    pub fn options(&self) -> &SchedulerOptions {
        &self.options
    }

    /// What hears the picks of peer routers: every scorer of the profile (fallbacks included).
    pub fn pick_listeners(&self) -> PickListeners {
        PickListeners(
            self.scorers
                .iter()
                .flat_map(|e| std::iter::once(&e.scorer).chain(e.fallback.as_ref().map(|(_, s)| s)))
                .cloned()
                .collect(),
        )
    }

    /// Request headers (lower-case) some plugin reads, for the protocol layer to pass on.
    pub fn request_headers(&self) -> &[String] {
        &self.request_headers
    }

    /// Chooses a replica for a completion request. `headers` are the request's headers among
    /// [`Scheduler::request_headers`].
    pub async fn decide(
        &self,
        request: &ParsedRequest,
        headers: &[(String, String)],
        scope: Scope<'_>,
    ) -> Result<Decision, DecideError> {
        let snapshot = self.pool.snapshot();
        let serving = snapshot.serving(&request.model);
        if serving.is_empty() {
            return Err(DecideError::UnknownModel(request.model.clone()));
        }
        let context = ScoringContext {
            request,
            headers,
            prompt_blocks: None,
            replicas_down: serving.iter().filter(|r| !r.is_healthy()).count(),
        };
        for entry in &self.scorers {
            entry
                .scorer
                .check(&context)
                .map_err(DecideError::BadRequest)?;
        }
        let (candidates, filtered_out) = self.candidates(serving, Some(request), scope)?;

        // Fields of the router's `route` span are recorded on the current span.
        let route = tracing::Span::current();
        let imbalance_guard_fired = self.has_affinity() && self.imbalanced(&candidates);
        // Load and affinity scorers first; placement scorers only for a request the affinity
        // scorers looked for and found nowhere (without them, "new" would mean every request).
        let mut evaluated = Vec::with_capacity(self.scorers.len());
        for entry in &self.scorers {
            let category = entry.scorer.category();
            evaluated.push(
                if category == Category::Placement
                    || (imbalance_guard_fired && category == Category::Affinity)
                {
                    Evaluated::not_asked()
                } else {
                    evaluate(entry, &context, &candidates).await
                },
            );
        }
        let is_affinity = |e: &ScorerEntry| e.scorer.category() == Category::Affinity;
        let affinity_counted = self
            .scorers
            .iter()
            .zip(&evaluated)
            .any(|(e, ev)| is_affinity(e) && ev.counted != Counted::Neither);
        let affinity_found =
            self.scorers.iter().zip(&evaluated).any(|(e, ev)| {
                is_affinity(e) && ev.counted_scores().is_some_and(Scores::any_positive)
            });
        if !imbalance_guard_fired && self.has_affinity() && !affinity_found {
            let placement_context = ScoringContext {
                prompt_blocks: evaluated
                    .iter()
                    .filter_map(|ev| ev.primary.as_ref()?.scores()?.prompt_blocks)
                    .max(),
                ..context
            };
            for (entry, slot) in self.scorers.iter().zip(evaluated.iter_mut()) {
                if entry.scorer.category() == Category::Placement {
                    *slot = evaluate(entry, &placement_context, &candidates).await;
                }
            }
        }
        let prefix_unavailable = !imbalance_guard_fired && self.has_affinity() && !affinity_counted;
        if !affinity_counted {
            route.record("tier", "load");
            if imbalance_guard_fired {
                route.record("tier_reason", "imbalance_guard");
            } else if prefix_unavailable {
                route.record("tier_reason", "prefix_unavailable");
            }
        }

        let order = {
            let _score =
                tracing::debug_span!("score", candidates = candidates.len() as i64).entered();
            let mut total = vec![0.0; candidates.len()];
            let mut weight_sum = 0.0;
            for (entry, result) in self.scorers.iter().zip(&evaluated) {
                if let Some(scores) = result.counted_scores() {
                    for (t, s) in total.iter_mut().zip(&scores.per_candidate) {
                        *t += entry.weight * s.clamp(0.0, 1.0);
                    }
                    weight_sum += entry.weight;
                }
            }
            if weight_sum > 0.0 {
                total.iter_mut().for_each(|t| *t /= weight_sum);
            }
            if !route.is_disabled() {
                route.record(
                    "scores",
                    tracing::field::display(ScoresTrace {
                        scorers: &self.scorers,
                        evaluated: &evaluated,
                        total: &total,
                    }),
                );
            }
            rank_for(request, &total, &candidates)
        };
        let pick = Pick {
            candidates: &candidates,
            chosen: order[0],
        };
        for (entry, result) in self.scorers.iter().zip(&evaluated) {
            entry.scorer.after_pick(
                &context,
                pick,
                role(result.primary.as_ref(), result.counted == Counted::Primary),
            );
            if let Some((_, fallback)) = &entry.fallback {
                fallback.after_pick(
                    &context,
                    pick,
                    role(
                        result.fallback.as_ref(),
                        result.counted == Counted::Fallback,
                    ),
                );
            }
        }
        let chosen = pick.chosen();
        let fallbacks = order[1..]
            .iter()
            .take(self.options.fallbacks)
            .map(|&i| Arc::clone(&candidates[i].replica))
            .collect();
        Ok(Decision {
            in_flight: chosen.replica.start_request(),
            fallbacks,
            imbalance_guard_fired,
            prefix_unavailable,
            filtered_out,
        })
    }

    /// Chooses any ready replica (least in flight, ties at random) for a request that is not a
    /// completion, such as `GET /v1/models`.
    pub fn decide_any(&self, scope: Scope<'_>) -> Result<Decision, DecideError> {
        let snapshot = self.pool.snapshot();
        let (candidates, filtered_out) = self.candidates(snapshot.replicas(), None, scope)?;
        let scores: Vec<f64> = candidates.iter().map(|c| -f64::from(c.in_flight)).collect();
        let order = rank(&scores, &mut rand::rng());
        Ok(Decision {
            in_flight: candidates[order[0]].replica.start_request(),
            fallbacks: order[1..]
                .iter()
                .take(self.options.fallbacks)
                .map(|&i| Arc::clone(&candidates[i].replica))
                .collect(),
            imbalance_guard_fired: false,
            prefix_unavailable: false,
            filtered_out,
        })
    }

    /// What flow control asks before it dispatches: how many more requests for a model the
    /// refusing filters (`saturation`) let through.
    pub fn capacity(&self) -> Capacity {
        Capacity {
            pool: Arc::clone(&self.pool),
            limits: self
                .filters
                .iter()
                .filter(|(_, f)| f.when_none_pass() == WhenNonePass::RefuseSaturated)
                .map(|(_, f)| Arc::clone(f))
                .collect(),
        }
    }

    fn has_affinity(&self) -> bool {
        self.scorers
            .iter()
            .any(|e| e.scorer.category() == Category::Affinity)
    }

    /// Whether the load spread reaches the imbalance threshold.
    fn imbalanced(&self, candidates: &[Candidate]) -> bool {
        let (lo, hi) = candidates
            .iter()
            .map(Candidate::pending)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
                (lo.min(p), hi.max(p))
            });
        hi - lo >= self.options.imbalance_threshold
    }

    /// The healthy, in-scope replicas among `replicas` that pass the filters, and those the
    /// filters took out (a preference filter that would leave nobody is ignored, and takes
    /// nobody out).
    fn candidates(
        &self,
        replicas: &[Arc<Replica>],
        request: Option<&ParsedRequest>,
        scope: Scope<'_>,
    ) -> Result<(Vec<Candidate>, Vec<FilteredOut>), DecideError> {
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
        let mut candidates: Vec<Candidate> = healthy
            .iter()
            .map(|replica| Candidate::of(replica, now, staleness))
            .collect();
        let mut filtered_out: Vec<FilteredOut> = Vec::new();
        for (name, filter) in &self.filters {
            let before =
                (filter.when_none_pass() == WhenNonePass::KeepAll).then(|| candidates.clone());
            let count = candidates.len();
            filter.filter(request, &mut candidates);
            if candidates.is_empty() {
                match (filter.when_none_pass(), before) {
                    (WhenNonePass::KeepAll, Some(before)) => {
                        tracing::debug!(filter = %name, "no candidate passed; filter ignored");
                        candidates = before;
                        continue;
                    }
                    _ => return Err(DecideError::AllSaturated),
                }
            }
            // Rare, so found by search rather than by copying the candidates before each filter.
            if candidates.len() < count {
                for replica in &healthy {
                    let kept = candidates.iter().any(|c| Arc::ptr_eq(&c.replica, replica));
                    let counted = filtered_out
                        .iter()
                        .any(|o| Arc::ptr_eq(&o.replica, replica));
                    if !kept && !counted {
                        filtered_out.push(FilteredOut {
                            filter: Arc::clone(name),
                            replica: Arc::clone(replica),
                        });
                    }
                }
            }
        }
        Ok((candidates, filtered_out))
    }
}

/// How many more requests a model's ready replicas can take before every one is saturated:
/// the sum over them of the least headroom any refusing filter leaves. A replica under no
/// limit (no refusing filter, or its load unknown) makes it unlimited.
#[derive(Clone)]
pub struct Capacity {
    pool: Arc<Pool>,
    limits: Vec<Arc<dyn Filter>>,
}

impl std::fmt::Debug for Capacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capacity")
            .field("limits", &self.limits.len())
            .finish_non_exhaustive()
    }
}

/// What [`Capacity::headroom`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Headroom {
    /// This many more requests (0: every ready replica is saturated).
    Requests(u64),
    /// Some ready replica has no limit.
    Unlimited,
}

impl Capacity {
    /// The headroom of `model`'s ready replicas, counted only until it reaches `enough` (the
    /// caller needs no more, and a large pool is not walked whole for every request); an
    /// unknown model or none ready is an error, as it would be for a decision.
    pub fn headroom(&self, model: &str, enough: u64) -> Result<Headroom, DecideError> {
        let snapshot = self.pool.snapshot();
        let serving = snapshot.serving(model);
        if serving.is_empty() {
            return Err(DecideError::UnknownModel(model.to_owned()));
        }
        let now = Instant::now();
        let staleness = self.pool.metrics_staleness();
        let mut total = 0u64;
        let mut any_ready = false;
        for replica in serving.iter().filter(|r| r.is_healthy()) {
            any_ready = true;
            let candidate = Candidate::of(replica, now, staleness);
            let Some(least) = self
                .limits
                .iter()
                .filter_map(|f| f.headroom(&candidate))
                .min()
            else {
                return Ok(Headroom::Unlimited);
            };
            total += u64::from(least);
            if total >= enough {
                break;
            }
        }
        if !any_ready {
            return Err(DecideError::NoReadyReplica);
        }
        Ok(Headroom::Requests(total))
    }
}

/// Asks an entry's scorer, and its fallback when it abstains or has nothing but zeros.
async fn evaluate(
    entry: &ScorerEntry,
    context: &ScoringContext<'_>,
    candidates: &[Candidate],
) -> Evaluated {
    let primary = ask(&entry.name, &*entry.scorer, context, candidates).await;
    if primary
        .scores()
        .is_some_and(|s| s.any_positive() || s.placement_decides)
    {
        return Evaluated {
            primary: Some(primary),
            fallback: None,
            counted: Counted::Primary,
        };
    }
    let primary_scored = primary.scores().is_some();
    let Some((name, fallback)) = &entry.fallback else {
        return Evaluated {
            primary: Some(primary),
            fallback: None,
            counted: if primary_scored {
                Counted::Primary
            } else {
                Counted::Neither
            },
        };
    };
    let second = ask(name, &**fallback, context, candidates).await;
    // The fallback counts when it has something to say, or when the primary said nothing.
    let counted = match second.scores() {
        Some(scores) if scores.any_positive() || !primary_scored => Counted::Fallback,
        _ if primary_scored => Counted::Primary,
        _ => Counted::Neither,
    };
    Evaluated {
        primary: Some(primary),
        fallback: Some(second),
        counted,
    }
}

/// One scorer's answer, a wrong number of scores counted as an abstention.
async fn ask(
    name: &str,
    scorer: &dyn Scorer,
    context: &ScoringContext<'_>,
    candidates: &[Candidate],
) -> Answer {
    let answer = scorer.score(context, candidates).answer().await;
    match answer {
        Answer::Scored(scores) if scores.per_candidate.len() != candidates.len() => {
            tracing::warn!(
                scorer = name,
                got = scores.per_candidate.len(),
                expected = candidates.len(),
                "scorer returned the wrong number of scores; ignored"
            );
            Answer::Abstain("wrong_length")
        }
        answer => answer,
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
