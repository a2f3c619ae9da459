//! The feed's state as a pure state machine: which stream owns which node, each engine's epoch,
//! seq and blocks, and the rules a stream must keep (see the [module docs](super)). Messages go
//! in, replies and index changes come out; no clock (callers pass `now`), no I/O, no tokio.
//!
//! Every wire number is checked before it costs anything: counts are summed in `u64` against
//! the engine's ceiling before a block is touched, seq arithmetic is checked, names and engine
//! lists are bounded, and a message that breaks the protocol is refused whole ([`StreamEnd`]),
//! never applied in part.
//!
//! Copy counts stay here, exact, per engine. The index hears one reference per engine that
//! holds a block on a tier (stored when the engine's count leaves zero, removed when it returns
//! there), so its small saturating reference counters (15 per tier) stay exact however many
//! copies an engine reports, up to 15 data-parallel engines on one replica. The index is only
//! ever told differences: a snapshot that restates an engine's blocks withdraws what it no
//! longer lists and stores what is new, and an engine that goes takes its own references with
//! it, so lookups never see a replica emptied and refilled.
//!
//! # Ownership
//! One stream owns a node at a time. A Hello for a node that another live stream owns takes
//! the node over: everything the old owner reported is dropped from the index at once, the old
//! stream is superseded (the service ends it with `ABORTED`, saying why, and its later messages
//! are refused), and the new stream starts from its own snapshots. The newest stream wins
//! because a restarted agent must not wait for its old, half-open stream to time out; a stranger
//! is kept out by the token and mutual TLS, not by arriving second.
//!
//! # Concurrency model
//! None inside: [`FeedState`] is plain data. The service keeps it behind one mutex and calls it
//! with the index as the [`KvEventSink`], so two streams never interleave one replica's changes.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use llmgw_feed_proto::v1 as pb;
use tokio::time::Instant;

use super::{FeedMetrics, NodeMap, RefusalReason};
use crate::blockhash::{ExternalHash, HashSettings};
use crate::kvindex::{KvEventSink, Medium};

/// The default ceiling on block copies one engine may hold in the feed (the index's default
/// per-replica cap).
pub const DEFAULT_MAX_BLOCKS_PER_ENGINE: u64 = 4_000_000;

/// Bounds on what one stream may claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeedLimits {
    /// Most block copies (over all tiers) one engine may hold; a snapshot or delta that would
    /// take it past this refuses the engine. vLLM's cache is finite: an engine reporting more
    /// than it can hold is broken or lying.
    pub max_blocks_per_engine: u64,
    /// Most engines one Hello may list.
    pub max_engines_per_hello: usize,
    /// Longest node, engine, replica or model name, in bytes.
    pub max_name_bytes: usize,
}

impl Default for FeedLimits {
    fn default() -> Self {
        FeedLimits {
            max_blocks_per_engine: DEFAULT_MAX_BLOCKS_PER_ENGINE,
            max_engines_per_hello: 1024,
            max_name_bytes: 512,
        }
    }
}

/// One stream's identity inside the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(u64);

/// A way of breaking the feed protocol; its name is the metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Violation {
    /// A snapshot or delta before the stream's Hello.
    BeforeHello,
    /// A second Hello on one stream.
    HelloTwice,
    TooManyEngines,
    /// An empty or over-long name.
    BadName,
    /// One engine listed twice in a Hello.
    DuplicateEngine,
    /// A snapshot or delta for an engine the stream's Hello did not list.
    UnknownEngine,
    DeltaBeforeSnapshot,
    /// A delta while the engine's snapshot is still arriving in parts.
    DeltaDuringSnapshot,
    /// A snapshot part whose epoch or seq differs from the parts before it.
    SnapshotPartsDiffer,
    /// An epoch lower than the one the stream already reported for the engine.
    EpochBack,
    /// A seq at or below the one the stream already reported in the same epoch.
    SeqBack,
}

impl Violation {
    pub fn label(self) -> &'static str {
        match self {
            Violation::BeforeHello => "before_hello",
            Violation::HelloTwice => "hello_twice",
            Violation::TooManyEngines => "too_many_engines",
            Violation::BadName => "bad_name",
            Violation::DuplicateEngine => "duplicate_engine",
            Violation::UnknownEngine => "unknown_engine",
            Violation::DeltaBeforeSnapshot => "delta_before_snapshot",
            Violation::DeltaDuringSnapshot => "delta_during_snapshot",
            Violation::SnapshotPartsDiffer => "snapshot_parts_differ",
            Violation::EpochBack => "epoch_back",
            Violation::SeqBack => "seq_back",
        }
    }

    /// Every violation, for tests and docs.
    pub const ALL: [Violation; 11] = [
        Violation::BeforeHello,
        Violation::HelloTwice,
        Violation::TooManyEngines,
        Violation::BadName,
        Violation::DuplicateEngine,
        Violation::UnknownEngine,
        Violation::DeltaBeforeSnapshot,
        Violation::DeltaDuringSnapshot,
        Violation::SnapshotPartsDiffer,
        Violation::EpochBack,
        Violation::SeqBack,
    ];
}

/// Why a stream must end now. Nothing of the message that caused it was applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamEnd {
    /// A delta skipped ahead: deltas were lost, so the agent must resend snapshots.
    #[error("{0}")]
    Gap(String),
    /// The stream broke the protocol.
    #[error("feed protocol violation ({}): {detail}", .violation.label())]
    Violation {
        violation: Violation,
        detail: String,
    },
    /// A newer stream took this stream's node over.
    #[error("node {0:?} was taken over by a newer stream")]
    Superseded(String),
}

/// What one applied message produced.
#[derive(Debug, Default)]
pub struct Applied {
    /// Messages for the agent (refusals, then the acknowledgement).
    pub replies: Vec<pb::RouterMessage>,
    /// A stream this message's Hello took the node from: the service ends it.
    pub superseded: Option<StreamId>,
}

/// An engine's blocks by (hash, tier), with their copies. Hashed with foldhash (seeded per
/// process): the keys are digests already, and a snapshot of a million blocks is built and
/// compared under the feed's lock, where SipHash took most of the time.
type Blocks = HashMap<(ExternalHash, Medium), u32, foldhash::fast::RandomState>;

/// A snapshot being received in parts.
#[derive(Debug)]
struct PendingSnapshot {
    epoch: u64,
    seq: u64,
    blocks: Blocks,
    held: u64,
}

/// One engine's blocks as the feed applied them (group 0 only).
#[derive(Debug)]
struct EngineView {
    replica: String,
    /// Whether the owning stream has sent this engine's snapshot; deltas apply only after.
    synced: bool,
    epoch: u64,
    seq: u64,
    blocks: Blocks,
    /// Sum of `blocks`' copies.
    held: u64,
    pending: Option<PendingSnapshot>,
}

impl EngineView {
    fn new(replica: String) -> Self {
        EngineView {
            replica,
            synced: false,
            epoch: 0,
            seq: 0,
            blocks: Blocks::default(),
            held: 0,
            pending: None,
        }
    }
}

#[derive(Debug, Default)]
struct NodeState {
    /// The stream that owns the node; `None` once it ended (the node waits out its grace).
    owner: Option<StreamId>,
    gone_since: Option<Instant>,
    engines: HashMap<String, EngineView>,
    /// Engines of the owner's Hello that were refused: their messages are ignored.
    refused: HashSet<String>,
}

#[derive(Debug, Default)]
struct Session {
    node: Option<String>,
    superseded: bool,
}

/// The feed's whole state.
#[derive(Debug)]
pub struct FeedState {
    configured: NodeMap,
    expected: HashMap<String, HashSettings>,
    limits: FeedLimits,
    grace: Duration,
    metrics: FeedMetrics,
    next_stream: u64,
    streams: HashMap<StreamId, Session>,
    nodes: HashMap<String, NodeState>,
}

fn medium_of(m: i32) -> Medium {
    if m == pb::Medium::Gpu as i32 {
        Medium::Gpu
    } else {
        Medium::Offloaded
    }
}

fn violation(violation: Violation, detail: String) -> StreamEnd {
    StreamEnd::Violation { violation, detail }
}

fn refused_reply(engine: String, replica: String, reason: String) -> pb::RouterMessage {
    pb::RouterMessage {
        body: Some(pb::router_message::Body::Refused(pb::Refused {
            engine,
            replica,
            reason,
        })),
    }
}

/// The copies `blocks` report in group 0, summed without overflow.
fn copies_of(blocks: &[pb::Block]) -> u64 {
    blocks
        .iter()
        .filter(|b| b.group == 0)
        .fold(0u64, |sum, b| sum.saturating_add(u64::from(b.count)))
}

/// Where a tier's changes go in the per-tier arrays below (in [`MEDIA`] order).
fn tier(medium: Medium) -> usize {
    usize::from(medium == Medium::Offloaded)
}

/// Adds `blocks` (group 0 only) to `into` and their copies to `held`, unless that would take
/// `held` over `max`: then nothing is added and the error is the total they would make.
fn add_blocks(
    into: &mut Blocks,
    held: &mut u64,
    blocks: &[pb::Block],
    max: u64,
) -> Result<(), u64> {
    let total = held.saturating_add(copies_of(blocks));
    if total > max {
        return Err(total);
    }
    for b in blocks.iter().filter(|b| b.group == 0 && b.count > 0) {
        let copies = into
            .entry((ExternalHash(b.hash), medium_of(b.medium)))
            .or_insert(0);
        // Cannot overflow: the sum of every count is at most `max`, which is below u32::MAX.
        *copies = copies.saturating_add(b.count);
    }
    *held = total;
    Ok(())
}

/// The index changes of a set of blocks, split by tier.
fn by_medium(
    blocks: impl Iterator<Item = ((ExternalHash, Medium), u32)>,
) -> [Vec<(ExternalHash, u32)>; 2] {
    let mut out = [Vec::new(), Vec::new()];
    for ((hash, medium), copies) in blocks {
        out[tier(medium)].push((hash, copies));
    }
    out
}

const MEDIA: [Medium; 2] = [Medium::Gpu, Medium::Offloaded];

/// Most blocks in one call to the index: a call holds the replica's book lock, which lookups of
/// its churn and homes take too, so a large change goes in slices they can pass between.
const SINK_SLICE: usize = 4096;

/// Tells the index that one engine of `replica` went from holding `old` to holding `new`: one
/// reference withdrawn for each block only `old` has, one stored for each only `new` has.
/// Nothing else is touched, so a report restated whole (a reconnecting agent's snapshot) leaves
/// what lookups see in the index as it was, instead of emptying the replica and filling it again.
fn replace(sink: &dyn KvEventSink, replica: &str, old: &Blocks, new: &Blocks) {
    let gone = by_medium(old.keys().filter(|k| !new.contains_key(k)).map(|k| (*k, 1)));
    for (medium, blocks) in MEDIA.iter().zip(&gone) {
        for slice in blocks.chunks(SINK_SLICE) {
            sink.withdrawn_copies(replica, slice, *medium);
        }
    }
    let came = by_medium(new.keys().filter(|k| !old.contains_key(k)).map(|k| (*k, 1)));
    for (medium, blocks) in MEDIA.iter().zip(&came) {
        for slice in blocks.chunks(SINK_SLICE) {
            sink.stored_copies(replica, slice, *medium);
        }
    }
}

/// Withdraws from the index everything one engine reported (its engine refused or gone).
fn withdraw(sink: &dyn KvEventSink, view: &EngineView) {
    replace(sink, &view.replica, &view.blocks, &Blocks::default());
}

impl FeedState {
    pub fn new(
        configured: NodeMap,
        expected: HashMap<String, HashSettings>,
        limits: FeedLimits,
        grace: Duration,
        metrics: FeedMetrics,
    ) -> Self {
        let limits = FeedLimits {
            // Per-block counts are u32 and sum to at most this.
            max_blocks_per_engine: limits.max_blocks_per_engine.min(u64::from(u32::MAX)),
            ..limits
        };
        FeedState {
            configured,
            expected,
            limits,
            grace,
            metrics,
            next_stream: 0,
            streams: HashMap::new(),
            nodes: HashMap::new(),
        }
    }

    pub fn set_expected(&mut self, expected: HashMap<String, HashSettings>) {
        self.expected = expected;
    }

    /// A new stream.
    pub fn open(&mut self) -> StreamId {
        self.next_stream += 1;
        let id = StreamId(self.next_stream);
        self.streams.insert(id, Session::default());
        id
    }

    /// The node a stream's Hello claimed.
    pub fn node_of(&self, stream: StreamId) -> Option<&str> {
        self.streams.get(&stream)?.node.as_deref()
    }

    /// A stream ended: its node, if it still owns it, waits out the grace period.
    pub fn close(&mut self, stream: StreamId, now: Instant) {
        let Some(session) = self.streams.remove(&stream) else {
            return;
        };
        if let Some(node) = session.node.and_then(|n| self.nodes.get_mut(&n))
            && node.owner == Some(stream)
        {
            node.owner = None;
            node.gone_since = Some(now);
        }
    }

    /// Applies one agent message from `stream`.
    pub fn apply(
        &mut self,
        sink: &dyn KvEventSink,
        stream: StreamId,
        msg: pb::AgentMessage,
    ) -> Result<Applied, StreamEnd> {
        let Some(session) = self.streams.get(&stream) else {
            return Err(StreamEnd::Superseded(String::new()));
        };
        if session.superseded {
            return Err(StreamEnd::Superseded(
                session.node.clone().unwrap_or_default(),
            ));
        }
        let node = session.node.clone();
        let mut applied = Applied::default();
        match msg.body {
            // An empty body (or a message kind newer than this router) changes nothing.
            None | Some(pb::agent_message::Body::Heartbeat(_)) => {}
            Some(pb::agent_message::Body::Hello(hello)) => {
                if let Some(node) = node {
                    return Err(violation(
                        Violation::HelloTwice,
                        format!("a second Hello on a stream of node {node:?}"),
                    ));
                }
                self.hello(sink, stream, hello, &mut applied)?;
            }
            Some(pb::agent_message::Body::Snapshot(s)) => {
                let node = node.ok_or_else(|| {
                    violation(Violation::BeforeHello, "a snapshot before Hello".into())
                })?;
                self.snapshot(sink, &node, s, &mut applied)?;
            }
            Some(pb::agent_message::Body::Delta(d)) => {
                let node = node.ok_or_else(|| {
                    violation(Violation::BeforeHello, "a delta before Hello".into())
                })?;
                self.delta(sink, &node, d, &mut applied)?;
            }
        }
        applied.replies.push(pb::RouterMessage {
            body: Some(pb::router_message::Body::Ack(pb::Ack { id: msg.id })),
        });
        Ok(applied)
    }

    fn check_hello(&self, hello: &pb::Hello) -> Result<(), StreamEnd> {
        let max = self.limits.max_name_bytes;
        // A name of 1 to max bytes, or 0 to max when `optional`.
        let check = |what: &str, name: &str, optional: bool| {
            let min = usize::from(!optional);
            if name.len() < min || name.len() > max {
                return Err(violation(
                    Violation::BadName,
                    format!("{what} name of {} bytes ({min} to {max})", name.len()),
                ));
            }
            Ok(())
        };
        check("node", &hello.node, false)?;
        if hello.engines.len() > self.limits.max_engines_per_hello {
            return Err(violation(
                Violation::TooManyEngines,
                format!(
                    "Hello lists {} engines (at most {})",
                    hello.engines.len(),
                    self.limits.max_engines_per_hello
                ),
            ));
        }
        let mut seen = HashSet::new();
        for e in &hello.engines {
            check("engine", &e.engine, false)?;
            check("replica", &e.replica, false)?;
            check("model", &e.model, true)?;
            if !seen.insert(e.engine.as_str()) {
                return Err(violation(
                    Violation::DuplicateEngine,
                    format!("engine {:?} listed twice", e.engine),
                ));
            }
        }
        Ok(())
    }

    /// Why an engine's hashes cannot match the router's, if they cannot.
    fn settings_mismatch(&self, engine: &pb::EngineInfo) -> Option<String> {
        let want = self.expected.get(&engine.model)?;
        let mut problems = Vec::new();
        if engine.block_size != 0 && engine.block_size as usize != want.block_size.get() {
            problems.push(format!(
                "block size {} (router: {})",
                engine.block_size, want.block_size
            ));
        }
        if !engine.hash_algo.is_empty() && engine.hash_algo != want.algo.as_str() {
            problems.push(format!(
                "hash algo {} (router: {})",
                engine.hash_algo, want.algo
            ));
        }
        if engine.hash_seed_set != want.seed.is_some() {
            problems.push(format!(
                "PYTHONHASHSEED {} (router: {})",
                if engine.hash_seed_set { "set" } else { "unset" },
                if want.seed.is_some() { "set" } else { "unset" },
            ));
        }
        (!problems.is_empty()).then(|| {
            format!(
                "engine hash settings differ from the router's for model {:?}: {}",
                engine.model,
                problems.join(", ")
            )
        })
    }

    fn hello(
        &mut self,
        sink: &dyn KvEventSink,
        stream: StreamId,
        hello: pb::Hello,
        applied: &mut Applied,
    ) -> Result<(), StreamEnd> {
        self.check_hello(&hello)?;
        let name = hello.node;
        // Judge every engine before changing anything. Past the copies the index counts per
        // replica, an engine is refused (first come in the Hello, first kept).
        let mut engines_of: HashMap<String, usize> = HashMap::new();
        let judged: Vec<(pb::EngineInfo, Option<(RefusalReason, String)>)> = hello
            .engines
            .into_iter()
            .map(|e| {
                let configured = self
                    .configured
                    .get(&name)
                    .is_some_and(|rs| rs.contains(&e.replica));
                let refusal = if !configured {
                    Some((
                        RefusalReason::NotConfigured,
                        format!("replica not configured on node {name:?}"),
                    ))
                } else {
                    self.settings_mismatch(&e)
                        .map(|why| (RefusalReason::HashSettings, why))
                }
                .or_else(|| {
                    let engines = engines_of.entry(e.replica.clone()).or_default();
                    *engines += 1;
                    (*engines > crate::kvindex::MAX_COPIES_PER_REPLICA).then(|| {
                        (
                            RefusalReason::TooManyEngines,
                            format!(
                                "replica {:?} has {} engines already, the most the index counts",
                                e.replica,
                                crate::kvindex::MAX_COPIES_PER_REPLICA
                            ),
                        )
                    })
                });
                (e, refusal)
            })
            .collect();

        let node = self.nodes.entry(name.clone()).or_default();
        if let Some(old) = node.owner.filter(|old| *old != stream) {
            // Taken over: the old owner's view goes whole, now.
            tracing::warn!(
                node = name,
                "a new stream claims a node another stream owns: it takes the node over and the old stream's blocks are dropped"
            );
            self.metrics.takeovers.inc();
            if let Some(session) = self.streams.get_mut(&old) {
                session.superseded = true;
            }
            applied.superseded = Some(old);
            node.refused.clear();
            for (_, view) in node.engines.drain() {
                withdraw(sink, &view);
            }
        }
        let node = self.nodes.entry(name.clone()).or_default();
        node.owner = Some(stream);
        node.gone_since = None;
        node.refused.clear();
        if let Some(session) = self.streams.get_mut(&stream) {
            session.node = Some(name.clone());
        }

        // Engines the new Hello no longer lists, or lists for another replica, go; the others
        // keep their blocks (a reconnecting agent causes no dip) until their snapshot replaces
        // them, and take no delta before it.
        let listed: HashMap<&str, &str> = judged
            .iter()
            .filter(|(_, refusal)| refusal.is_none())
            .map(|(e, _)| (e.engine.as_str(), e.replica.as_str()))
            .collect();
        let stale: Vec<String> = node
            .engines
            .iter()
            .filter(|(engine, view)| listed.get(engine.as_str()) != Some(&view.replica.as_str()))
            .map(|(engine, _)| engine.clone())
            .collect();
        for engine in stale {
            if let Some(view) = node.engines.remove(&engine) {
                withdraw(sink, &view);
            }
        }
        for view in node.engines.values_mut() {
            view.synced = false;
            view.pending = None;
        }
        for (e, refusal) in judged {
            match refusal {
                Some((reason, why)) => {
                    tracing::warn!(
                        node = name,
                        engine = e.engine,
                        replica = e.replica,
                        reason = why,
                        "refusing an engine's KV events"
                    );
                    self.metrics.refused(reason);
                    node.refused.insert(e.engine.clone());
                    applied
                        .replies
                        .push(refused_reply(e.engine, e.replica, why));
                }
                None => {
                    node.engines
                        .entry(e.engine)
                        .or_insert_with(|| EngineView::new(e.replica));
                }
            }
        }
        Ok(())
    }

    /// The engine a snapshot or delta names, or why the stream must end; `Ok(None)` for a
    /// refused engine, whose messages are ignored.
    fn engine_mut<'a>(
        nodes: &'a mut HashMap<String, NodeState>,
        node: &str,
        engine: &str,
    ) -> Result<Option<&'a mut EngineView>, StreamEnd> {
        let Some(n) = nodes.get_mut(node) else {
            return Err(violation(
                Violation::UnknownEngine,
                format!("engine {engine:?}: node {node:?} has no state"),
            ));
        };
        if n.refused.contains(engine) {
            return Ok(None);
        }
        match n.engines.get_mut(engine) {
            Some(view) => Ok(Some(view)),
            None => Err(violation(
                Violation::UnknownEngine,
                format!("engine {engine:?} was not in the stream's Hello"),
            )),
        }
    }

    fn snapshot(
        &mut self,
        sink: &dyn KvEventSink,
        node: &str,
        s: pb::Snapshot,
        applied: &mut Applied,
    ) -> Result<(), StreamEnd> {
        let max = self.limits.max_blocks_per_engine;
        let Some(view) = Self::engine_mut(&mut self.nodes, node, &s.engine)? else {
            return Ok(());
        };
        if view.synced && s.epoch < view.epoch {
            return Err(violation(
                Violation::EpochBack,
                format!(
                    "engine {}: snapshot of epoch {} after epoch {}",
                    s.engine, s.epoch, view.epoch
                ),
            ));
        }
        if view.synced && s.epoch == view.epoch && s.seq < view.seq {
            return Err(violation(
                Violation::SeqBack,
                format!(
                    "engine {}: snapshot at {}.{} after {}.{}",
                    s.engine, s.epoch, s.seq, view.epoch, view.seq
                ),
            ));
        }
        let mut pending = match view.pending.take() {
            Some(p) if (p.epoch, p.seq) != (s.epoch, s.seq) => {
                return Err(violation(
                    Violation::SnapshotPartsDiffer,
                    format!(
                        "engine {}: snapshot part at {}.{} after parts at {}.{}",
                        s.engine, s.epoch, s.seq, p.epoch, p.seq
                    ),
                ));
            }
            Some(p) => p,
            None => PendingSnapshot {
                epoch: s.epoch,
                seq: s.seq,
                blocks: Blocks::default(),
                held: 0,
            },
        };
        if let Err(total) = add_blocks(&mut pending.blocks, &mut pending.held, &s.blocks, max) {
            let why = format!(
                "snapshot of engine {} holds at least {total} block copies, over the ceiling of {max}",
                s.engine
            );
            self.refuse_engine(
                sink,
                node,
                &s.engine,
                RefusalReason::OverBlockCeiling,
                why,
                applied,
            );
            return Ok(());
        }
        if s.more {
            view.pending = Some(pending);
            return Ok(());
        }
        view.epoch = pending.epoch;
        view.seq = pending.seq;
        let old = std::mem::replace(&mut view.blocks, pending.blocks);
        view.held = pending.held;
        view.synced = true;
        replace(sink, &view.replica, &old, &view.blocks);
        sink.reporting(&view.replica);
        self.metrics.snapshots.inc();
        Ok(())
    }

    fn delta(
        &mut self,
        sink: &dyn KvEventSink,
        node: &str,
        d: pb::Delta,
        applied: &mut Applied,
    ) -> Result<(), StreamEnd> {
        let max = self.limits.max_blocks_per_engine;
        let Some(view) = Self::engine_mut(&mut self.nodes, node, &d.engine)? else {
            return Ok(());
        };
        if view.pending.is_some() {
            return Err(violation(
                Violation::DeltaDuringSnapshot,
                format!(
                    "engine {}: a delta between the parts of its snapshot",
                    d.engine
                ),
            ));
        }
        if !view.synced {
            return Err(violation(
                Violation::DeltaBeforeSnapshot,
                format!(
                    "engine {}: delta {}.{} before its snapshot",
                    d.engine, d.epoch, d.seq
                ),
            ));
        }
        if d.epoch < view.epoch {
            return Err(violation(
                Violation::EpochBack,
                format!(
                    "engine {}: delta of epoch {} after epoch {}",
                    d.engine, d.epoch, view.epoch
                ),
            ));
        }
        if d.epoch == view.epoch && d.seq <= view.seq {
            return Err(violation(
                Violation::SeqBack,
                format!(
                    "engine {}: delta {}.{} at or before {}.{}",
                    d.engine, d.epoch, d.seq, view.epoch, view.seq
                ),
            ));
        }
        let next_in_epoch = d.epoch == view.epoch && view.seq.checked_add(1) == Some(d.seq);
        let new_epoch = d.epoch > view.epoch && d.reset && d.seq == 1;
        if !next_in_epoch && !new_epoch {
            self.metrics.out_of_order.inc();
            return Err(StreamEnd::Gap(format!(
                "engine {}: delta {}.{} after {}.{}",
                d.engine, d.epoch, d.seq, view.epoch, view.seq
            )));
        }
        // Check the ceiling on what the engine would hold before touching anything.
        let base = if d.reset { 0 } else { view.held };
        let total = base.saturating_add(copies_of(&d.stored));
        if total > max {
            let why = format!(
                "delta {}.{} of engine {} would hold {total} block copies, over the ceiling of {max}",
                d.epoch, d.seq, d.engine,
            );
            self.refuse_engine(
                sink,
                node,
                &d.engine,
                RefusalReason::OverBlockCeiling,
                why,
                applied,
            );
            return Ok(());
        }

        view.epoch = d.epoch;
        view.seq = d.seq;
        let replica = view.replica.clone();
        if d.reset {
            let lost: Vec<(ExternalHash, Medium)> = view.blocks.drain().map(|(k, _)| k).collect();
            view.held = 0;
            sink.lost_blocks(&replica, &lost);
        }
        // The index hears only an engine starting or ceasing to hold a block (see the module
        // docs), so a stored block already held changes nothing there.
        let mut stored = [Vec::new(), Vec::new()];
        for b in d.stored.iter().filter(|b| b.group == 0 && b.count > 0) {
            let key = (ExternalHash(b.hash), medium_of(b.medium));
            let copies = view.blocks.entry(key).or_insert(0);
            if *copies == 0 {
                stored[tier(key.1)].push((key.0, 1));
            }
            // Bounded: the delta's copies were checked against the ceiling above.
            *copies = copies.saturating_add(b.count);
            view.held = view.held.saturating_add(u64::from(b.count));
        }
        let mut removed = [Vec::new(), Vec::new()];
        for b in d.removed.iter().filter(|b| b.group == 0 && b.count > 0) {
            let medium = medium_of(b.medium);
            let key = (ExternalHash(b.hash), medium);
            let Some(copies) = view.blocks.get_mut(&key) else {
                continue;
            };
            let n = b.count.min(*copies);
            *copies -= n;
            view.held = view.held.saturating_sub(u64::from(n));
            if *copies == 0 {
                view.blocks.remove(&key);
                removed[tier(medium)].push((key.0, 1));
            }
        }
        for (medium, blocks) in MEDIA.iter().zip(&stored) {
            for slice in blocks.chunks(SINK_SLICE) {
                sink.stored_copies(&replica, slice, *medium);
            }
        }
        for (medium, blocks) in MEDIA.iter().zip(&removed) {
            for slice in blocks.chunks(SINK_SLICE) {
                sink.removed_copies(&replica, slice, *medium);
            }
        }
        self.metrics.deltas.inc();
        Ok(())
    }

    /// Refuses one engine for the rest of the stream: its blocks leave the index and the agent
    /// is told why.
    fn refuse_engine(
        &mut self,
        sink: &dyn KvEventSink,
        node: &str,
        engine: &str,
        reason: RefusalReason,
        why: String,
        applied: &mut Applied,
    ) {
        let Some(n) = self.nodes.get_mut(node) else {
            return;
        };
        let Some(view) = n.engines.remove(engine) else {
            return;
        };
        n.refused.insert(engine.to_owned());
        tracing::warn!(
            node,
            engine,
            replica = view.replica,
            reason = why,
            "refusing an engine's KV events"
        );
        self.metrics.refused(reason);
        withdraw(sink, &view);
        applied
            .replies
            .push(refused_reply(engine.to_owned(), view.replica, why));
    }

    /// Drops nodes whose owner has been gone longer than the grace period; returns their names.
    pub fn reap(&mut self, sink: &dyn KvEventSink, now: Instant) -> Vec<String> {
        let expired: Vec<String> = self
            .nodes
            .iter()
            .filter(|(_, n)| {
                n.owner.is_none()
                    && n.gone_since
                        .is_some_and(|t| now.saturating_duration_since(t) >= self.grace)
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in &expired {
            if let Some(node) = self.nodes.remove(name) {
                for view in node.engines.values() {
                    withdraw(sink, view);
                }
                self.metrics.nodes_expired.inc();
            }
        }
        expired
    }

    /// Applies a reloaded node map. Engines whose replica is no longer configured on their
    /// node are dropped (their replica rebuilt from whatever else reports it); returns the
    /// streams of every node whose replica set changed, which must resync, or `None` when the
    /// map did not change.
    pub fn set_nodes(&mut self, sink: &dyn KvEventSink, nodes: NodeMap) -> Option<Vec<StreamId>> {
        if self.configured == nodes {
            return None;
        }
        let changed: HashSet<String> = self
            .configured
            .keys()
            .chain(nodes.keys())
            .filter(|n| self.configured.get(*n) != nodes.get(*n))
            .cloned()
            .collect();
        self.configured = nodes;
        let mut kick = Vec::new();
        for name in changed {
            let Some(node) = self.nodes.get_mut(&name) else {
                continue;
            };
            let allowed = self.configured.get(&name);
            let gone: Vec<String> = node
                .engines
                .iter()
                .filter(|(_, e)| !allowed.is_some_and(|rs| rs.contains(&e.replica)))
                .map(|(engine, _)| engine.clone())
                .collect();
            for engine in gone {
                if let Some(view) = node.engines.remove(&engine) {
                    tracing::warn!(
                        node = name,
                        engine,
                        replica = view.replica,
                        "replica no longer configured on the node: its blocks are dropped"
                    );
                    self.metrics.refused(RefusalReason::NotConfigured);
                    node.refused.insert(engine);
                    withdraw(sink, &view);
                }
            }
            kick.extend(node.owner);
        }
        Some(kick)
    }

    /// Block hashes the feed holds per replica (for `/debug` and tests).
    /// Configured nodes whose blocks the index does not hold in full yet: no stream owns the
    /// node, its agent named no engine it may report, or one of them has not finished its
    /// snapshot. Sorted. Empty once every node's agent has sent everything it holds.
    pub fn unsynced_nodes(&self) -> Vec<String> {
        let mut unsynced: Vec<String> = self
            .configured
            .iter()
            .filter(|(_, replicas)| !replicas.is_empty())
            .filter(|(name, _)| {
                let Some(node) = self.nodes.get(name.as_str()) else {
                    return true;
                };
                node.owner.is_none()
                    || node.engines.is_empty()
                    || node
                        .engines
                        .values()
                        .any(|e| !e.synced || e.pending.is_some())
            })
            .map(|(name, _)| name.clone())
            .collect();
        unsynced.sort();
        unsynced
    }

    pub fn replica_blocks(&self) -> HashMap<String, HashSet<ExternalHash>> {
        let mut out: HashMap<String, HashSet<ExternalHash>> = HashMap::new();
        for node in self.nodes.values() {
            for e in node.engines.values() {
                out.entry(e.replica.clone())
                    .or_default()
                    .extend(e.blocks.keys().map(|(h, _)| *h));
            }
        }
        out
    }

    /// Per replica, how many of its engines hold each (hash, tier): the references the index
    /// must count (for tests and the fuzz target).
    pub fn replica_holders(&self) -> HashMap<String, HashMap<(ExternalHash, Medium), u64>> {
        let mut out: HashMap<String, HashMap<(ExternalHash, Medium), u64>> = HashMap::new();
        for node in self.nodes.values() {
            for e in node.engines.values() {
                let r = out.entry(e.replica.clone()).or_default();
                for k in e.blocks.keys() {
                    *r.entry(*k).or_insert(0) += 1;
                }
            }
        }
        out.retain(|_, r| !r.is_empty());
        out
    }
}

#[cfg(test)]
mod tests;
