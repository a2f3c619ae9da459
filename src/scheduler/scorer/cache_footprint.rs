//! `cache_footprint`: a home for a prompt no replica holds. A placement scorer: the scheduler
//! asks it only when no affinity scorer found the request anywhere (a tenant's first turn, a
//! new document). Left to the tie-break, such prompts pile onto whichever replica the hash
//! favours while another sits nearly empty, and the crowded one evicts what its tenants come
//! back for. So each candidate scores by its **cache footprint**, fewer blocks being better:
//! the blocks its engine reports holding (the KV index's own count, from the engines' events)
//! plus those recent picks are about to store there ([`Projections`], recorded by `kv_cache`
//! for every pick until the engine's events can have arrived), relative to the fullest
//! candidate, so a burst of new prompts spreads before any event comes back. It is weighed with
//! the load scorers like any scorer, so a busy empty replica does not win by emptiness alone.
//!
//! Unlike a least-recently-picked rotation (llm-d's `no-hit-lru`), it sees blocks that reached
//! a replica by any path: other routers, traffic sent straight to the replica, a restart that
//! emptied it.
//!
//! A cache that keeps computing again what it evicted moments before ([`crate::kvindex`]'s
//! rebuilt blocks) is fuller than its block count says: whatever a new prompt evicts there, its
//! tenants come back for. So the blocks each replica rebuilt over about the last
//! [`REBUILD_WINDOW`] (an exponential decay) are added to its footprint, and while some cache
//! has room, a prompt that `kv_cache` found only where it is being churned does not land on
//! another churning cache.
//!
//! Once the caches are full, spreading is wrong where tenants take turns (it is right where they
//! come back at random; [`Packing`] has the measurements): with each engine's cache size
//! (`vllm:cache_config_info`) and the prompt's length (from `kv_cache`), a prompt goes to the
//! emptiest cache only while some cache has room for it, and otherwise packs onto the caches
//! that are past their working set anyway ([`Packing`]); there the same rebuilt blocks mark the
//! cache that loses least by one more prompt, and a count of the prompts placed on each cache
//! ([`RecentPlacements`]: this router's placements and, through peering, its peers') keeps
//! any one cache from taking more than its share and, where the footprints no longer differ,
//! tells the fuller cache.
//!
//! It abstains (`no_events`) when no candidate's engine ever reported (no events, nor an agent's
//! snapshot, even an empty one: a router without agents): there is nothing to weigh.
//! The replica chosen without it still counts as a placement (see [`RecentPlacements`]).
//!
//! Metrics: `llmgw_cold_placements_total{decision}`: `emptiest` (the emptiest cache with room),
//! `packed` (no cache had room: the fullest within its share), `load_override` (load chose
//! another), `no_events` (no candidate had reported events: load and the tie-break chose).
//!
//! Concurrency: the projections and the rebuild rates are each one `parking_lot::Mutex` over a
//! vector by index slot, and the placement counts one over a map by endpoint, each held for a
//! few arithmetic operations per candidate; the index's counts have their own locks, and each
//! replica's cache size is an atomic the scrape task writes.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tokio::time::Instant;

use super::{DecisionLabels, relative_lower_is_better};
use crate::kvindex::{KvIndex, ReplicaSlot};
use crate::peers::{PeerPick, PickOutbox};
use crate::scheduler::Candidate;
use crate::scheduler::plugin::{
    Answer, Category, Pick, Role, Scorer, Scores, Scoring, ScoringContext,
};
use crate::scheduler::registry::{BuildContext, PluginError, ScorerPlugin, parameters};

pub(super) static PLUGIN: ScorerPlugin = ScorerPlugin {
    kind: "cache_footprint",
    build,
};

/// How full a cache may get before new prompts go elsewhere, and where they go once every cache
/// is that full ([`Packing`]).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Parameters {
    /// The share of a replica's cache (`num_gpu_blocks`) its footprint may reach with a new
    /// prompt and still count as having room for it; 0 turns packing off (the emptiest cache,
    /// always). The rest is left for the running requests' decode blocks and what the prompts
    /// grow into. Too low a share packs while the caches could still hold every prompt, which
    /// costs more than spreading: 0.75 did, with 12 tenants whose system prompts take 0.42 of
    /// a cache each, while 0.9 and 1 packed right (docs/results/2026-12-05-packing.md).
    fill: f64,
    /// Once no replica has room, a replica takes more new prompts only while its footprint,
    /// and the number of prompts placed on it lately, stay within this many times an even
    /// share of all the candidates', so the overflow lands on a few caches without piling
    /// onto one.
    max_share: f64,
}

impl Default for Parameters {
    fn default() -> Self {
        Parameters {
            fill: 0.9,
            max_share: 1.5,
        }
    }
}

fn build(
    context: &mut BuildContext<'_>,
    value: serde_yaml::Value,
) -> Result<Arc<dyn Scorer>, PluginError> {
    let Parameters { fill, max_share } = parameters(value)?;
    if !(fill.is_finite() && (0.0..=1.0).contains(&fill)) {
        return Err(PluginError::Invalid(format!(
            "fill must be a share of a cache, from 0 (off) to 1 (got {fill})"
        )));
    }
    if !(max_share.is_finite() && max_share >= 1.0) {
        return Err(PluginError::Invalid(format!(
            "max_share must be a multiple of an even share, 1 or more (got {max_share})"
        )));
    }
    Ok(Arc::new(CacheFootprint {
        index: Arc::clone(&context.resources.index),
        projections: context.shared(|_| Projections::default()),
        rebuilds: RecentRebuilds::default(),
        placements: RecentPlacements::default(),
        metrics: context.shared(PlacementMetrics::register),
        packing: Packing { fill, max_share },
        picks: Arc::clone(&context.resources.picks),
    }))
}

/// Shared by every `cache_footprint` of a scheduler.
#[derive(Debug, Default)]
struct PlacementMetrics {
    decisions: Family<DecisionLabels, Counter>,
}

impl PlacementMetrics {
    fn register(registry: &mut Registry) -> PlacementMetrics {
        let metrics = PlacementMetrics::default();
        registry.register(
            "llmgw_cold_placements",
            "Placements of prompts no replica held: emptiest (the emptiest cache with room), \
             packed (no cache had room: the fullest within its share), load_override, or \
             no_events (no candidate had reported events)",
            metrics.decisions.clone(),
        );
        metrics
    }
}

/// A decision's scores and how they were made (the mode is the memo, for its metric).
struct Placed {
    scores: Vec<f64>,
    mode: Mode,
}

impl Placed {
    fn emptiest(scores: Vec<f64>) -> Placed {
        Placed {
            scores,
            mode: Mode::Emptiest,
        }
    }
}

/// How a decision placed its prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Among the caches with room for it, the emptiest.
    Emptiest,
    /// No cache had room: onto the fullest within its share.
    Packed,
}

/// Where a prompt no replica holds goes, given each candidate's footprint and cache size.
///
/// An LRU cache's hit rate falls off a cliff once the working sets placed there outgrow it,
/// and past the cliff it stays about as low whether it is a little or much over: it keeps what
/// every request reuses (the shared prefixes) and loses the rest either way. So once the caches
/// together cannot hold every prompt, spreading new prompts evenly puts every cache just past
/// its cliff, the worst placement there is; packing the overflow onto a few caches that are
/// past it anyway keeps the others under theirs (bench-routing with 12 tenants on 4 replicas:
/// 2/4/4/2 tenants hit 85.9 %, 3/3/3/3 80 %). That workload's tenants take turns in a fixed
/// order, an LRU cache's worst case; with tenants drawn at random an even spread is the best
/// (3/3/3/3 by hand: 90.0 %), and packing with both share limits below comes close (89.55 %
/// against 88.2 % spreading; docs/results/2026-12-05-drawn-tenants.md). Hence:
///
/// - while some candidate has room for the prompt (footprint plus prompt within `fill` of its
///   cache), the emptiest of those, as without packing;
/// - once none has, the fullest of those whose footprint with the prompt stays within
///   `max_share` times an even share of all the candidates' footprints, and whose placements
///   (the prompts placed there lately, [`RecentPlacements`]) stay within `max_share`
///   times an even share of all placements: the footprint counts what the cache rebuilt
///   lately, so the cache that churns most, which loses least by one more prompt. The count
///   matters once every cache is full of old blocks: the footprints are then all about a
///   cache's size, and without it the tenants that arrive last piled onto the one cache that
///   churned most (five or six on one cache, one on another, with tenants drawn at random).
///   For the same reason a cache is as full as the prompts placed there (each counted at this
///   prompt's length) where those come to more than its footprint: with tenants coming back
///   further apart than [`REBUILD_WINDOW`], a cache home to three prompts rebuilds nothing that
///   shows and reports its size as one home to two does, and the tie-break chose between them
///   (bench-routing, 12 tenants in turn at about one request in flight: 3/2/3/4 splits).
///
/// While a replica of the model is down, no packing either: the prompts it held wait elsewhere
/// for its return (homecoming draws them back), and a cache packed with them would be left
/// crowded with what stays (bench-routing's restart runs on one seed: 88.9 and 89.6 % with
/// packing during the downtime, 94.4 and 95.0 % without). Without the cache sizes or the
/// prompt's length (no `kv_cache`), or with `fill` 0, the emptiest, always.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Packing {
    fill: f64,
    max_share: f64,
}

impl Packing {
    /// Each candidate's score, aligned with `footprints` and `sizes` (blocks) and with `placed`
    /// (the prompts placed on each lately, [`RecentPlacements`]), for a prompt of
    /// `prompt_blocks`.
    fn scores(
        &self,
        footprints: &[f64],
        placed: &[f64],
        sizes: &[Option<u64>],
        prompt_blocks: Option<u32>,
        replicas_down: usize,
    ) -> Placed {
        let emptiest = relative_lower_is_better(footprints.iter().map(|&f| Some(f)), 1.0);
        let sizes: Option<Vec<f64>> = sizes.iter().map(|s| s.map(|s| s as f64)).collect();
        let packs = self.fill > 0.0 && replicas_down == 0;
        let (Some(sizes), Some(prompt), true) = (sizes, prompt_blocks, packs) else {
            return Placed::emptiest(emptiest);
        };
        let prompt = f64::from(prompt);
        let room: Vec<bool> = footprints
            .iter()
            .zip(&sizes)
            .map(|(&footprint, &size)| footprint + prompt <= self.fill * size)
            .collect();
        if room.iter().all(|&r| r) {
            return Placed::emptiest(emptiest);
        }
        if room.iter().any(|&r| r) {
            // Any cache with room beats every cache without; among them, the emptiest.
            return Placed::emptiest(
                room.iter()
                    .zip(&emptiest)
                    .map(|(&room, &e)| if room { 0.5 + 0.5 * e } else { 0.0 })
                    .collect(),
            );
        }
        let candidates = footprints.len().max(1) as f64;
        let total: f64 = footprints.iter().sum::<f64>() + prompt;
        let limit = self.max_share * total / candidates;
        // The same share in prompts placed: once the caches are full of old blocks, their
        // footprints are all about their size and no longer tell a cache that holds five
        // tenants' prompts from one that holds one.
        let placements: f64 = placed.iter().sum::<f64>() + 1.0;
        let placed_limit = (self.max_share * placements / candidates).max(1.0);
        let within: Vec<bool> = footprints
            .iter()
            .zip(placed)
            .map(|(&f, &p)| f + prompt <= limit && p + 1.0 <= placed_limit)
            .collect();
        // How full each is: its footprint, or the blocks of the prompts placed there where those
        // are more. A cache past its cliff holds about its size whether it is home to three
        // prompts or five, and while its tenants come back more than `REBUILD_WINDOW` apart
        // nothing it rebuilds shows it either; only the count does.
        let fullness: Vec<f64> = footprints
            .iter()
            .zip(placed)
            .map(|(&f, &p)| f.max(p * prompt))
            .collect();
        let fullest = fullness
            .iter()
            .zip(&within)
            .filter(|&(_, &w)| w)
            .map(|(&f, _)| f)
            .fold(f64::NEG_INFINITY, f64::max);
        if fullest == f64::NEG_INFINITY {
            return Placed::emptiest(emptiest);
        }
        let scores = fullness
            .iter()
            .zip(&within)
            .map(|(&f, &w)| if w { f / fullest.max(1.0) } else { 0.0 })
            .collect();
        Placed {
            scores,
            mode: Mode::Packed,
        }
    }
}

struct CacheFootprint {
    index: Arc<KvIndex>,
    projections: Arc<Projections>,
    rebuilds: RecentRebuilds,
    placements: RecentPlacements,
    metrics: Arc<PlacementMetrics>,
    packing: Packing,
    /// Where this router's placements go to its peer routers.
    picks: Arc<PickOutbox>,
}

impl CacheFootprint {
    /// Each candidate's index slot; `None` when no candidate is in the index.
    fn slots(&self, candidates: &[Candidate]) -> Option<Vec<Option<ReplicaSlot>>> {
        let slots: Vec<Option<ReplicaSlot>> = candidates
            .iter()
            .map(|c| self.index.slot(c.replica.endpoint()))
            .collect();
        slots.iter().any(Option::is_some).then_some(slots)
    }

    /// Each candidate's footprint in blocks, aligned with its `slots`.
    fn footprints(&self, slots: &[Option<ReplicaSlot>], now: Instant) -> Vec<f64> {
        let reported: Vec<u64> = slots
            .iter()
            .map(|slot| slot.map_or(0, |s| self.index.block_count(s)))
            .collect();
        let mut footprints = self.projections.footprints(slots, &reported, now);
        for (footprint, recent) in footprints
            .iter_mut()
            .zip(self.rebuilds.read(&self.index, slots, now))
        {
            *footprint += recent;
        }
        footprints
    }
}

/// `slot`'s entry of a vector indexed by slot, grown with defaults to reach it.
fn slot_entry<T: Default>(by_slot: &mut Vec<T>, slot: ReplicaSlot) -> &mut T {
    if by_slot.len() <= slot.index() {
        by_slot.resize_with(slot.index() + 1, T::default);
    }
    &mut by_slot[slot.index()]
}

/// The time constant of the rebuilt blocks added to a footprint.
pub const REBUILD_WINDOW: Duration = Duration::from_secs(10);

/// Blocks each replica rebuilt recently, from the index's cumulative counts read at decisions.
#[derive(Debug, Default)]
struct RecentRebuilds {
    by_slot: Mutex<Vec<RebuildRate>>,
}

#[derive(Debug, Default, Clone, Copy)]
struct RebuildRate {
    /// The cumulative count when last read.
    seen: u64,
    /// Rebuilt blocks since the first read, decayed with [`REBUILD_WINDOW`].
    decayed: DecayedSum,
}

impl RecentRebuilds {
    /// Each candidate's blocks rebuilt over about the last window, read from `index` now.
    fn read(&self, index: &KvIndex, slots: &[Option<ReplicaSlot>], now: Instant) -> Vec<f64> {
        let rebuilt: Vec<Option<u64>> = slots
            .iter()
            .map(|slot| slot.map(|s| index.churn(s).rebuilt))
            .collect();
        self.recent(slots, &rebuilt, now)
    }

    /// For each slot (aligned with its cumulative `rebuilt` count), the blocks rebuilt over about
    /// the last window; what was rebuilt before the first read is history, not pressure.
    fn recent(&self, slots: &[Option<ReplicaSlot>], rebuilt: &[Option<u64>], now: Instant) -> Vec<f64> {
        let mut by_slot = self.by_slot.lock();
        slots
            .iter()
            .zip(rebuilt)
            .map(|(slot, &rebuilt)| {
                let (Some(slot), Some(rebuilt)) = (slot, rebuilt) else {
                    return 0.0;
                };
                let rate = slot_entry(&mut by_slot, *slot);
                let new = if rate.decayed.started() {
                    rebuilt.saturating_sub(rate.seen) as f64
                } else {
                    0.0
                };
                rate.seen = rebuilt;
                rate.decayed.add(new, now, REBUILD_WINDOW)
            })
            .collect()
    }
}

/// How long a placement counts toward its replica's share ([`RecentPlacements`]), as the time
/// constant of its decay: long enough to span a fleet's tenants arriving one by one, short
/// enough that a tenant gone for good stops counting.
pub const PLACEMENT_MEMORY: Duration = Duration::from_secs(300);

/// How many prompts this scorer, or a peer router's, placed on each replica lately, each
/// decayed with [`PLACEMENT_MEMORY`] as time constant: the number of tenants whose home a cache
/// is, which its block count stops telling once every cache is full.
///
/// Keyed by endpoint, not index slot: the first prompts are placed before any engine reported
/// an event, so before their replicas have slots, and a count without them let a cache that
/// took one of them take a share more later (five tenants of twelve on one of four caches).
#[derive(Debug, Default)]
struct RecentPlacements {
    by_replica: Mutex<HashMap<Box<str>, DecayedSum>>,
}

/// A replica's placements below this are forgotten (after about 23 minutes for one), so
/// endpoints that left the pool do not stay in the map.
const FORGOTTEN_PLACEMENTS: f64 = 1e-2;

/// Replicas counted at most: peer routers name the replicas of their placements, and a
/// misbehaving one must not grow the map without bound (a pool's size is far below it).
const MAX_COUNTED_REPLICAS: usize = 4096;

impl RecentPlacements {
    fn record(&self, replica: &str, now: Instant) {
        let mut by_replica = self.by_replica.lock();
        if let Some(placed) = by_replica.get_mut(replica) {
            placed.add(1.0, now, PLACEMENT_MEMORY);
            return;
        }
        // Only a new replica grows the map: the faded ones go first.
        by_replica.retain(|_, placed| placed.at(now, PLACEMENT_MEMORY) >= FORGOTTEN_PLACEMENTS);
        if by_replica.len() < MAX_COUNTED_REPLICAS {
            by_replica
                .entry(replica.into())
                .or_default()
                .add(1.0, now, PLACEMENT_MEMORY);
        } else {
            tracing::debug!(replica, "placement not counted: too many replicas counted");
        }
    }

    /// Each replica's placements as of `now`.
    fn read<'a>(&self, replicas: impl Iterator<Item = &'a str>, now: Instant) -> Vec<f64> {
        let by_replica = self.by_replica.lock();
        replicas
            .map(|replica| {
                by_replica
                    .get(replica)
                    .map_or(0.0, |placed| placed.at(now, PLACEMENT_MEMORY))
            })
            .collect()
    }
}

/// A sum whose terms fade exponentially with a time constant (rebuilt blocks, placements).
#[derive(Debug, Default, Clone, Copy)]
struct DecayedSum {
    value: f64,
    /// When `value` was last decayed; `None` before the first term.
    at: Option<Instant>,
}

impl DecayedSum {
    /// Whether any term, even 0, was added: its clock runs from then.
    fn started(&self) -> bool {
        self.at.is_some()
    }

    /// The sum as of `now`.
    fn at(&self, now: Instant, time_constant: Duration) -> f64 {
        self.at.map_or(0.0, |at| {
            let elapsed = now.saturating_duration_since(at).as_secs_f64();
            self.value * (-elapsed / time_constant.as_secs_f64()).exp()
        })
    }

    /// Adds `amount` at `now`; returns the sum.
    fn add(&mut self, amount: f64, now: Instant, time_constant: Duration) -> f64 {
        self.value = self.at(now, time_constant) + amount;
        self.at = Some(now);
        self.value
    }
}

impl Scorer for CacheFootprint {
    fn category(&self) -> Category {
        Category::Placement
    }

    fn score<'a>(&'a self, context: &'a ScoringContext<'a>, candidates: &'a [Candidate]) -> Scoring<'a> {
        let Some(slots) = self.slots(candidates) else {
            return Scoring::Ready(Answer::Abstain(NO_EVENTS));
        };
        let now = Instant::now();
        let footprints = self.footprints(&slots, now);
        let endpoints = candidates.iter().map(|c| c.replica.endpoint());
        let placements = self.placements.read(endpoints, now);
        let sizes: Vec<Option<u64>> = candidates
            .iter()
            .map(|c| c.replica.cache_blocks())
            .collect();
        let placed = self.packing.scores(
            &footprints,
            &placements,
            &sizes,
            context.prompt_blocks,
            context.replicas_down,
        );
        let memo = Memo {
            mode: placed.mode,
            footprints,
            placements,
        };
        Scoring::Ready(Answer::Scored(Scores::with_memo(placed.scores, memo)))
    }

    fn after_pick(&self, context: &ScoringContext<'_>, pick: Pick<'_>, role: Role<'_>) {
        // A prompt placed before any engine reported events (this scorer was asked but had
        // nothing to weigh) still made the chosen cache a tenant's home: it counts toward the
        // share as any placement does.
        if let Role::NotCounted {
            abstained: Some(NO_EVENTS),
            ..
        } = role
        {
            self.placed(context, pick);
            self.count(NO_EVENTS);
        }
        if let Role::Counted(scores) = role
            && let Some(memo) = scores.memo::<Memo>()
        {
            let scores = &scores.per_candidate;
            let best = scores.iter().copied().fold(0.0, f64::max);
            self.placed(context, pick);
            let decision = match (scores.get(pick.chosen).is_some_and(|&s| s >= best), memo.mode) {
                (false, _) => "load_override",
                (true, Mode::Emptiest) => "emptiest",
                (true, Mode::Packed) => "packed",
            };
            self.count(decision);
            let route = tracing::Span::current();
            route.record("tier", "placement");
            route.record(
                "placement",
                tracing::field::display(PlacementTrace {
                    decision,
                    memo,
                    scores,
                }),
            );
        }
    }

    fn peer_picked(&self, pick: &PeerPick) {
        // A peer's placement counts toward the replica's share as this router's own do, so
        // routers behind one proxy keep one count between them.
        if pick.placed {
            self.placements.record(&pick.replica, Instant::now());
        }
    }
}

/// Why the scorer abstains when no candidate ever reported events.
const NO_EVENTS: &str = "no_events";

impl CacheFootprint {
    fn count(&self, decision: &'static str) {
        self.metrics
            .decisions
            .get_or_create(&DecisionLabels { decision })
            .inc();
    }

    /// Counts a placement on the chosen replica, and tells the peer routers.
    fn placed(&self, context: &ScoringContext<'_>, pick: Pick<'_>) {
        let replica = pick.chosen().replica.endpoint();
        self.placements.record(replica, Instant::now());
        self.picks.publish(|| PeerPick {
            model: context.request.model.clone(),
            replica: replica.to_owned(),
            hashes: Arc::from([]),
            new_blocks: 0,
            tree_chain: Arc::from([]),
            placed: true,
        });
    }
}

/// What a decision saw, for after its pick: how it placed, and per candidate the footprint
/// and the count of recent placements it weighed.
struct Memo {
    mode: Mode,
    footprints: Vec<f64>,
    placements: Vec<f64>,
}

/// A placement as the route span's `placement` field: the decision, then per candidate (in
/// the candidates' order) its footprint in blocks, recent placements and score. Formatted only
/// when the span is recorded (`llmgw::router=debug`).
struct PlacementTrace<'a> {
    decision: &'static str,
    memo: &'a Memo,
    scores: &'a [f64],
}

impl std::fmt::Display for PlacementTrace<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.decision)?;
        let rows = self
            .memo
            .footprints
            .iter()
            .zip(&self.memo.placements)
            .zip(self.scores);
        for ((footprint, placed), score) in rows {
            write!(f, "|{footprint:.0}:{placed:.1}:{score:.2}")?;
        }
        Ok(())
    }
}

/// Most recent picks remembered per replica: beyond it the oldest is forgotten early (so the
/// footprint is underestimated, never unbounded).
const MAX_PENDING_PER_REPLICA: usize = 4096;

/// What recent picks are about to store on each replica, until its engine can have reported
/// them. Written by `kv_cache` after every pick, read by `cache_footprint`.
#[derive(Debug, Default)]
pub(super) struct Projections {
    by_slot: Mutex<Vec<Pending>>,
}

/// One replica's recent picks, oldest first.
#[derive(Debug, Default)]
struct Pending {
    picks: VecDeque<PendingPick>,
    /// Sum of `picks[..].new_blocks`.
    blocks: u64,
}

#[derive(Debug, Clone, Copy)]
struct PendingPick {
    expires: Instant,
    /// Blocks the prompt adds beyond what the replica held.
    new_blocks: u64,
    /// The replica's reported count when the pick was made.
    reported_then: u64,
}

impl Pending {
    fn sweep(&mut self, now: Instant) {
        while let Some(front) = self.picks.front() {
            if front.expires > now {
                break;
            }
            self.blocks -= front.new_blocks;
            self.picks.pop_front();
        }
    }

    /// The reported count as of the oldest live pick, plus everything picked since: what the
    /// engine will report once those picks are stored (more, if it evicts meanwhile).
    fn footprint(&self, reported: u64) -> u64 {
        match self.picks.front() {
            Some(oldest) => reported.max(oldest.reported_then + self.blocks),
            None => reported,
        }
    }
}

impl Projections {
    /// A pick sent a prompt to `slot`, whose engine will store `new_blocks` more than the
    /// `reported` it holds now; it counts for `ttl`.
    pub(super) fn record(
        &self,
        slot: ReplicaSlot,
        reported: u64,
        new_blocks: u64,
        now: Instant,
        ttl: Duration,
    ) {
        if new_blocks == 0 || ttl.is_zero() {
            return;
        }
        let mut by_slot = self.by_slot.lock();
        let pending = slot_entry(&mut by_slot, slot);
        pending.sweep(now);
        if pending.picks.len() >= MAX_PENDING_PER_REPLICA
            && let Some(oldest) = pending.picks.pop_front()
        {
            pending.blocks -= oldest.new_blocks;
        }
        pending.picks.push_back(PendingPick {
            expires: now + ttl,
            new_blocks,
            reported_then: reported,
        });
        pending.blocks += new_blocks;
    }

    /// Each slot's footprint given its `reported` count (aligned; no slot: the report alone).
    fn footprints(&self, slots: &[Option<ReplicaSlot>], reported: &[u64], now: Instant) -> Vec<f64> {
        let mut by_slot = self.by_slot.lock();
        slots
            .iter()
            .zip(reported)
            .map(|(slot, &reported)| {
                let footprint = match slot.and_then(|s| by_slot.get_mut(s.index())) {
                    Some(pending) => {
                        pending.sweep(now);
                        pending.footprint(reported)
                    }
                    None => reported,
                };
                footprint as f64
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two slots of one index.
    fn slots() -> (ReplicaSlot, ReplicaSlot) {
        let index = KvIndex::new(crate::kvindex::IndexConfig::default());
        let slot = |name| index.slot_or_insert(name).expect("slot");
        (slot("a"), slot("b"))
    }

    #[tokio::test(start_paused = true)]
    async fn picks_count_until_they_expire_and_reports_catch_up() {
        let projections = Projections::default();
        let (a, b) = slots();
        let ttl = Duration::from_secs(2);
        let t0 = Instant::now();
        projections.record(a, 10, 5, t0, ttl);
        projections.record(a, 10, 3, t0 + Duration::from_secs(1), ttl);
        let slots = [Some(a), Some(b), None];
        // Nothing reported yet: 10 + 5 + 3 for a; b and the unknown one as reported.
        assert_eq!(
            projections.footprints(&slots, &[10, 7, 4], t0 + Duration::from_millis(1500)),
            [18.0, 7.0, 4.0]
        );
        // The engine reported the first pick's blocks: still 18, not 23.
        assert_eq!(
            projections.footprints(&slots, &[15, 7, 4], t0 + Duration::from_millis(1500)),
            [18.0, 7.0, 4.0]
        );
        // The first pick expired: the second counts over what was reported when it was made
        // (10 + 3), which the 15 reported now already covers.
        assert_eq!(
            projections.footprints(&slots, &[15, 7, 4], t0 + Duration::from_millis(2500)),
            [15.0, 7.0, 4.0]
        );
        projections.record(b, 7, 4, t0 + Duration::from_millis(2500), ttl);
        assert_eq!(
            projections.footprints(&slots, &[15, 7, 4], t0 + Duration::from_millis(2600)),
            [15.0, 11.0, 4.0]
        );
        // Everything expired: the reports alone.
        assert_eq!(
            projections.footprints(&slots, &[1, 2, 3], t0 + Duration::from_secs(10)),
            [1.0, 2.0, 3.0]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn rebuilt_blocks_count_from_the_first_read_and_fade_with_the_window() {
        let rebuilds = RecentRebuilds::default();
        let (a, b) = slots();
        let slots = [Some(a), Some(b), None];
        let t0 = Instant::now();
        // History before the first read does not count.
        assert_eq!(
            rebuilds.recent(&slots, &[Some(100), Some(0), None], t0),
            [0.0, 0.0, 0.0]
        );
        assert_eq!(
            rebuilds.recent(&slots, &[Some(150), Some(0), None], t0),
            [50.0, 0.0, 0.0]
        );
        // One window later a factor e less, plus what was rebuilt since.
        let later = t0 + REBUILD_WINDOW;
        let recent = rebuilds.recent(&slots, &[Some(150), Some(8), None], later);
        assert!((recent[0] - 50.0 / std::f64::consts::E).abs() < 1e-9, "{recent:?}");
        assert_eq!(recent[1..], [8.0, 0.0]);
    }

    const PACKING: Packing = Packing {
        fill: 0.75,
        max_share: 1.5,
    };

    /// Four caches of 160 blocks.
    const SIZES: [Option<u64>; 4] = [Some(160); 4];

    #[test]
    fn with_room_anywhere_the_emptiest_cache_with_room_wins() {
        // A 45-block prompt fits everywhere (45 + 45 <= 120): as without packing.
        let placed = PACKING.scores(&[45.0, 0.0, 45.0, 45.0], &[0.0; 4], &SIZES, Some(45), 0);
        assert_eq!(placed.mode, Mode::Emptiest);
        assert_eq!(placed.scores, [0.0, 1.0, 0.0, 0.0]);
        // Room at two of four (90 + 45 > 120): those two, the emptier first, and the others 0.
        let placed = PACKING.scores(&[90.0, 70.0, 90.0, 60.0], &[0.0; 4], &SIZES, Some(45), 0);
        assert_eq!(placed.mode, Mode::Emptiest);
        let s = &placed.scores;
        assert_eq!((s[0], s[2]), (0.0, 0.0), "{s:?}");
        assert!(s[3] > s[1] && s[1] >= 0.5, "{s:?}");
    }

    #[test]
    fn without_room_anywhere_the_overflow_packs_onto_the_fullest_within_its_share() {
        // Eight tenants' 45-block system prompts, two per cache: a ninth fits nowhere. Every
        // cache is as full: any of them (the tie-break decides), none preferred.
        let placed = PACKING.scores(&[90.0; 4], &[0.0; 4], &SIZES, Some(45), 0);
        assert_eq!(placed.mode, Mode::Packed);
        assert_eq!(placed.scores, [1.0; 4]);
        // The ninth went to the third cache: the tenth joins it rather than spread, while that
        // stays within 1.5 even shares of all the footprints (135 + 45 = 180 > 1.5 × 450 / 4
        // here: not yet; with more placed, yes).
        let placed = PACKING.scores(&[90.0, 90.0, 135.0, 90.0], &[0.0; 4], &SIZES, Some(45), 0);
        assert_eq!(placed.mode, Mode::Packed);
        assert_eq!(placed.scores, [1.0, 1.0, 0.0, 1.0], "the share limit");
        let placed = PACKING.scores(&[135.0, 90.0, 135.0, 90.0], &[0.0; 4], &SIZES, Some(45), 0);
        assert_eq!(placed.scores, [1.0, 90.0 / 135.0, 1.0, 90.0 / 135.0]);
        // Caches full of stale blocks: the one that rebuilt most (a larger footprint) is past
        // its cliff and loses least.
        let placed = PACKING.scores(&[160.0, 160.0, 240.0, 200.0], &[0.0; 4], &SIZES, Some(45), 0);
        assert_eq!(placed.mode, Mode::Packed);
        assert_eq!(placed.scores, [160.0 / 240.0, 160.0 / 240.0, 1.0, 200.0 / 240.0]);
        // One cache past every limit: the others.
        let placed = PACKING.scores(&[160.0, 160.0, 600.0, 160.0], &[0.0; 4], &SIZES, Some(45), 0);
        assert_eq!(placed.scores, [1.0, 1.0, 0.0, 1.0]);
    }

    #[test]
    fn a_cache_that_was_given_more_than_its_share_of_new_prompts_takes_no_more() {
        // Full of old blocks, the churning third cache is the fullest; but it was given four
        // of the eleven prompts placed, and a fifth would pass 1.5 even shares (4.5 of 12):
        // the next fullest within both shares instead.
        let footprints = [160.0, 160.0, 240.0, 200.0];
        let placed = PACKING.scores(&footprints, &[1.0, 3.0, 4.0, 3.0], &SIZES, Some(45), 0);
        assert_eq!(placed.mode, Mode::Packed);
        assert_eq!(placed.scores, [160.0 / 200.0, 160.0 / 200.0, 0.0, 1.0]);
        // A fourth is within its share (3.5 + 1 <= 4.5).
        let placed = PACKING.scores(&footprints, &[1.0, 3.0, 3.5, 3.5], &SIZES, Some(45), 0);
        assert_eq!(placed.scores, [160.0 / 240.0, 160.0 / 240.0, 1.0, 200.0 / 240.0]);
        // Before anything is placed the count limits nothing.
        let placed = PACKING.scores(&footprints, &[0.0; 4], &SIZES, Some(45), 0);
        assert_eq!(placed.scores[2], 1.0);
    }

    #[test]
    fn among_caches_full_to_their_size_the_one_home_to_more_prompts_is_the_fullest() {
        // bench-routing, 12 tenants in turn at one request in flight: every cache reports
        // about its size, and tenants come back 15 s apart, so none shows rebuilt blocks. The
        // first cache is home to three 66-block prompts, the second and third to two, the
        // fourth to four (past its share: 3.9 + 1 > 1.5 × 11.8 / 4). The twelfth prompt goes
        // to the first, for a 4/2/2/4 split (before, the first three scored alike and the
        // tie-break sent it to a cache of two: 3/2/3/4).
        let placed = PACKING.scores(&[150.0; 4], &[2.9, 2.0, 2.0, 3.9], &SIZES, Some(66), 0);
        assert_eq!(placed.mode, Mode::Packed);
        let fullest = 2.9 * 66.0;
        assert_eq!(placed.scores, [1.0, 150.0 / fullest, 150.0 / fullest, 0.0]);
        // Where a footprint tells more than the counts (200 blocks against 2.9 × 66), it decides.
        let footprints = [150.0, 150.0, 200.0, 150.0];
        let placed = PACKING.scores(&footprints, &[2.9, 2.0, 2.0, 2.0], &SIZES, Some(66), 0);
        assert_eq!(placed.scores[2], 1.0);
    }

    #[tokio::test(start_paused = true)]
    async fn placements_count_per_replica_and_fade_with_the_memory() {
        let placements = RecentPlacements::default();
        let replicas = || ["a", "b", "c"].into_iter();
        let t0 = Instant::now();
        assert_eq!(placements.read(replicas(), t0), [0.0, 0.0, 0.0]);
        placements.record("a", t0);
        placements.record("a", t0);
        placements.record("b", t0);
        assert_eq!(placements.read(replicas(), t0), [2.0, 1.0, 0.0]);
        // One memory later a factor e less; a new placement adds a whole one.
        let later = t0 + PLACEMENT_MEMORY;
        placements.record("b", later);
        let read = placements.read(replicas(), later);
        let e = std::f64::consts::E;
        assert!((read[0] - 2.0 / e).abs() < 1e-9, "{read:?}");
        assert!((read[1] - (1.0 / e + 1.0)).abs() < 1e-9, "{read:?}");
        // A replica placed on once and never since is forgotten (its endpoint may be gone),
        // while one placed on lately is kept.
        let much_later = t0 + PLACEMENT_MEMORY * 6;
        placements.record("c", much_later);
        assert_eq!(placements.by_replica.lock().len(), 1);
        assert_eq!(placements.read(replicas(), much_later)[2], 1.0);
        // Never more replicas than the bound, whatever peers name.
        for i in 0..MAX_COUNTED_REPLICAS + 10 {
            placements.record(&format!("peer-named-{i}"), much_later);
        }
        assert_eq!(placements.by_replica.lock().len(), MAX_COUNTED_REPLICAS);
        assert_eq!(placements.read(replicas(), much_later)[2], 1.0);
    }

    #[test]
    fn without_sizes_a_prompt_length_or_fill_or_with_a_replica_down_the_emptiest() {
        let footprints = [90.0, 90.0, 135.0, 45.0];
        let emptiest = relative_lower_is_better(footprints.iter().map(|&f| Some(f)), 1.0);
        let cases = [
            (PACKING, [Some(160), None, Some(160), Some(160)], Some(45)),
            (PACKING, SIZES, None),
            (Packing { fill: 0.0, ..PACKING }, SIZES, Some(45)),
        ];
        for (packing, sizes, prompt) in cases {
            let placed = packing.scores(&footprints, &[0.0; 4], &sizes, prompt, 0);
            assert_eq!(placed.mode, Mode::Emptiest);
            assert_eq!(placed.scores, emptiest, "{packing:?} {sizes:?} {prompt:?}");
        }
        // Nor while a replica is down: its prompts are refugees, not tenants to pack.
        let placed = PACKING.scores(&[90.0, 90.0, 135.0], &[0.0; 3], &SIZES[..3], Some(45), 1);
        assert_eq!(placed.mode, Mode::Emptiest);
        assert_eq!(placed.scores, [1.0 - 90.0 / 135.0, 1.0 - 90.0 / 135.0, 0.0]);
    }

    #[test]
    fn a_placement_is_traced_with_each_candidate_s_footprint_count_and_score() {
        let memo = Memo {
            mode: Mode::Packed,
            footprints: vec![160.0, 201.4],
            placements: vec![2.0, 2.96],
        };
        let trace = PlacementTrace {
            decision: "packed",
            memo: &memo,
            scores: &[0.0, 1.0],
        };
        assert_eq!(trace.to_string(), "packed|160:2.0:0.00|201:3.0:1.00");
    }

    #[tokio::test(start_paused = true)]
    async fn a_replica_remembers_a_bounded_number_of_picks() {
        let projections = Projections::default();
        let (a, b) = slots();
        let now = Instant::now();
        for _ in 0..MAX_PENDING_PER_REPLICA + 10 {
            projections.record(a, 0, 1, now, Duration::from_secs(60));
        }
        assert_eq!(
            projections.footprints(&[Some(a)], &[0], now),
            [MAX_PENDING_PER_REPLICA as f64]
        );
        // Nothing counts without a time to live or new blocks.
        projections.record(b, 0, 5, now, Duration::ZERO);
        projections.record(b, 0, 0, now, Duration::from_secs(1));
        assert_eq!(projections.footprints(&[Some(b)], &[0], now), [0.0]);
    }
}
