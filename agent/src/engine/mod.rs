//! One vLLM engine inside the agent: its mirror, hash-check state, and the task that applies
//! decoded batches and flushes coalesced deltas.
//!
//! # Concurrency model
//! The intake task (`zmq`) decodes and orders batches and sends them as [`Input`]s over an
//! `mpsc` channel to the engine's [`MirrorTask`], the only writer of the engine's state. The
//! state sits behind a `parking_lot::Mutex` in [`Engine`], held only for one batch, one flush or
//! one snapshot (never across an `.await`), so uplinks can take a snapshot at any moment.
//! Deltas leave through a `tokio::sync::broadcast` channel shared by all engines of the agent;
//! each uplink subscribes *before* taking snapshots, so no delta falls between the two.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;

use crate::hashcheck::{HashCheck, Verdict};
use crate::metrics::{EventLabel, Metrics};
use crate::mirror::{BlockKey, DELTA_PART_CHANGES, Delta, Mirror, Snapshot};
use crate::wire::{EventBatch, KvEvent};

pub use llmgw_core::ids::ReplicaId;

/// An engine's name inside the agent: its replica, plus `#dpN` for data-parallel rank N > 0.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineId(pub Arc<str>);

impl fmt::Display for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why an engine's mirror was emptied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetReason {
    /// The sequence number went backwards: the engine restarted.
    Restart,
    /// `AllBlocksCleared`.
    Cleared,
    /// Batches were lost and replay could not fill the gap.
    Gap,
    /// A payload could not be decoded, so its changes are unknown.
    Decode,
    /// The supervisor restarted the engine.
    Supervisor,
    /// The engine went silent and its `/health` fails.
    Stale,
    /// The engine reported more block copies than its mirror holds (`--max-blocks-per-engine`).
    Overflow,
}

impl ResetReason {
    pub const fn as_str(self) -> &'static str {
        match self {
            ResetReason::Restart => "restart",
            ResetReason::Cleared => "cleared",
            ResetReason::Gap => "gap",
            ResetReason::Decode => "decode_error",
            ResetReason::Supervisor => "supervisor",
            ResetReason::Stale => "stale",
            ResetReason::Overflow => "overflow",
        }
    }

    /// Whether the engine may now run with other settings (so a hash mismatch is re-judged).
    const fn new_process(self) -> bool {
        matches!(self, ResetReason::Restart | ResetReason::Supervisor)
    }
}

/// What the intake hands the mirror task.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Batch {
        seq: u64,
        batch: EventBatch,
        /// The batch's trace span ([`batch_span`]); `Span::none()` when not traced.
        span: tracing::Span,
    },
    Reset(ResetReason),
}

/// The `batch` span of one event batch (DEBUG, so free unless traces are exported): the intake
/// opens it with a `decode` child, the mirror task adds `mirror`, each uplink `uplink`.
/// (Integers are recorded as `i64`: OpenTelemetry has no unsigned attributes.)
pub fn batch_span(engine: &str, seq: u64) -> tracing::Span {
    tracing::debug_span!(
        "batch",
        engine,
        seq = seq as i64,
        events = tracing::field::Empty
    )
}

/// Where the engine's hashes stand against the configured settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashStatus {
    /// No checkable block 0 seen yet (or no settings configured).
    #[default]
    Unchecked,
    Verified,
    /// Blocks withheld from the precise index until the engine restarts.
    Mismatch,
}

/// A delta of one engine, as broadcast to uplinks.
#[derive(Debug, Clone)]
pub struct Update {
    pub engine: EngineId,
    pub replica: ReplicaId,
    pub delta: Arc<Delta>,
    /// Engine publish time (Unix seconds) of the oldest batch in the delta.
    pub oldest_event_ts: Option<f64>,
    /// The trace span of the oldest batch in the delta, parent of the uplinks' spans.
    pub batch_span: Option<tracing::Span>,
}

/// One engine's snapshot, as an uplink sends it.
#[derive(Debug, Clone)]
pub struct EngineSnapshot {
    pub engine: EngineId,
    pub replica: ReplicaId,
    pub hash: HashStatus,
    /// Empty while the engine's blocks are withheld.
    pub snapshot: Snapshot,
}

#[derive(Debug, Default)]
struct State {
    mirror: Mirror,
    hash: HashStatus,
    /// When the last batch arrived (or the engine was created).
    last_batch: Option<Instant>,
    /// Silent with `/health` failing: reset, and waiting for the engine to speak again.
    stale: bool,
    /// Engine publish time (Unix seconds) of the oldest batch in the pending window.
    oldest_pending_ts: Option<f64>,
    /// That batch's trace span, when traced.
    oldest_pending_span: Option<tracing::Span>,
}

/// An engine's shared state; see the module docs.
#[derive(Debug)]
pub struct Engine {
    pub id: EngineId,
    pub replica: ReplicaId,
    state: Mutex<State>,
}

impl Engine {
    pub fn new(id: EngineId, replica: ReplicaId) -> Arc<Self> {
        Engine::with_max_copies(id, replica, crate::mirror::MAX_COPIES)
    }

    /// An engine whose mirror holds at most `max_copies` block copies.
    pub fn with_max_copies(id: EngineId, replica: ReplicaId, max_copies: u64) -> Arc<Self> {
        Arc::new(Engine {
            id,
            replica,
            state: Mutex::new(State {
                mirror: Mirror::with_max_copies(max_copies),
                ..State::default()
            }),
        })
    }

    pub fn snapshot(&self) -> EngineSnapshot {
        let st = self.state.lock();
        EngineSnapshot {
            engine: self.id.clone(),
            replica: self.replica.clone(),
            hash: st.hash,
            snapshot: st.mirror.snapshot(),
        }
    }

    /// The keys mirrored now (pending changes included).
    pub fn block_set(&self) -> HashSet<BlockKey> {
        self.state.lock().mirror.keys().copied().collect()
    }

    pub fn hash_status(&self) -> HashStatus {
        self.state.lock().hash
    }

    /// How long since the last batch (or since `since`, when none arrived yet).
    pub fn quiet_for(&self, now: Instant, since: Instant) -> Duration {
        now.saturating_duration_since(self.state.lock().last_batch.unwrap_or(since))
    }

    pub fn is_stale(&self) -> bool {
        self.state.lock().stale
    }

    /// Marks the engine stale; false when it already was.
    pub(crate) fn mark_stale(&self) -> bool {
        !std::mem::replace(&mut self.state.lock().stale, true)
    }
}

/// The sending half of the agent-wide delta channel.
pub type Updates = broadcast::Sender<Update>;

/// Applies an engine's inputs and flushes deltas after the coalescing window.
pub struct MirrorTask {
    pub engine: Arc<Engine>,
    pub check: Option<HashCheck>,
    pub window: Duration,
    pub metrics: Arc<Metrics>,
    pub updates: Updates,
}

impl MirrorTask {
    /// Runs until the input channel closes, then flushes what is pending.
    pub async fn run(self, mut inputs: mpsc::Receiver<Input>) {
        if self.check.is_some() {
            // Exported as 0 from the start, so that an alert on its increase sees the first one.
            let _zero = self
                .metrics
                .hash_mismatches
                .get_or_create(&Metrics::engine(&self.engine.id.0));
        }
        let mut deadline: Option<Instant> = None;
        loop {
            tokio::select! {
                input = inputs.recv() => {
                    let Some(input) = input else { break };
                    if self.handle(input) && deadline.is_none() {
                        deadline = Some(Instant::now() + self.window);
                    }
                }
                () = sleep_until(deadline), if deadline.is_some() => {
                    deadline = None;
                    self.flush();
                }
            }
        }
        self.flush();
    }

    /// Applies one input; says whether a delta is now pending.
    pub fn handle(&self, input: Input) -> bool {
        let engine = &*self.engine.id.0;
        let mut st = self.engine.state.lock();
        match input {
            Input::Reset(reason) => {
                self.metrics
                    .resets
                    .get_or_create(&Metrics::reason(engine, reason.as_str()))
                    .inc();
                tracing::info!(engine, reason = reason.as_str(), "engine reset");
                st.mirror.reset();
                if reason.new_process() {
                    st.hash = HashStatus::Unchecked;
                }
            }
            Input::Batch { seq, batch, span } => {
                let _mirror = tracing::debug_span!(parent: &span, "mirror").entered();
                self.metrics
                    .batches
                    .get_or_create(&Metrics::engine(engine))
                    .inc();
                st.last_batch = Some(Instant::now());
                if std::mem::take(&mut st.stale) {
                    tracing::info!(engine, seq, "engine speaks again: no longer stale");
                    self.metrics
                        .engine_stale
                        .get_or_create(&Metrics::engine(engine))
                        .set(0);
                }
                for ev in &batch.events {
                    self.apply(&mut st, engine, seq, ev);
                }
                if st.mirror.has_pending() && st.oldest_pending_ts.is_none() {
                    st.oldest_pending_ts = Some(batch.ts);
                    st.oldest_pending_span = (!span.is_disabled()).then(|| span.clone());
                }
            }
        }
        self.metrics
            .mirror_blocks
            .get_or_create(&Metrics::engine(engine))
            .set(i64::try_from(st.mirror.len()).unwrap_or(i64::MAX));
        st.mirror.has_pending()
    }

    fn apply(&self, st: &mut State, engine: &str, seq: u64, ev: &KvEvent) {
        self.metrics
            .events
            .get_or_create(&EventLabel {
                engine: engine.to_owned(),
                r#type: event_type_label(ev).to_owned(),
            })
            .inc();
        if let KvEvent::Unknown { kind } = ev {
            // The tag is the engine's word, of any length: logged cut short, never a label.
            tracing::debug!(
                engine,
                seq,
                tag = truncate_chars(kind, MAX_LOGGED_TAG_CHARS),
                "event of an unknown type, counted as type=\"unknown\""
            );
        }
        if let (KvEvent::BlockStored(s), Some(check)) = (ev, &self.check) {
            let verdict = check.check(s);
            match verdict {
                Verdict::Match if st.hash == HashStatus::Unchecked => {
                    tracing::info!(engine, seq, "block hashes verified against the settings");
                    st.hash = HashStatus::Verified;
                }
                Verdict::Mismatch { .. } | Verdict::BlockSizeMismatch { .. } => {
                    self.metrics
                        .hash_mismatches
                        .get_or_create(&Metrics::engine(engine))
                        .inc();
                    if st.hash != HashStatus::Mismatch {
                        if let Some(line) = check.explain(engine, &verdict) {
                            tracing::error!(engine, seq, "{line}");
                        }
                        st.hash = HashStatus::Mismatch;
                        // Routers drop what they had; nothing more is sent until a restart.
                        st.mirror.reset();
                    }
                }
                Verdict::Match | Verdict::Skipped => {}
            }
        }
        if st.hash == HashStatus::Mismatch {
            return;
        }
        let applied = st.mirror.apply(ev);
        if applied.unknown_removed > 0 {
            self.metrics
                .unknown_removals
                .get_or_create(&Metrics::engine(engine))
                .inc_by(applied.unknown_removed as u64);
        }
        if applied.overflowed {
            self.metrics
                .resets
                .get_or_create(&Metrics::reason(engine, ResetReason::Overflow.as_str()))
                .inc();
            // Routers refuse an engine past this ceiling: send them a reset and start over.
            tracing::error!(
                engine,
                seq,
                max_copies = st.mirror.max_copies(),
                "engine reports more block copies than a mirror holds: engine reset"
            );
        }
        if applied.cleared {
            self.metrics
                .resets
                .get_or_create(&Metrics::reason(engine, ResetReason::Cleared.as_str()))
                .inc();
            tracing::info!(engine, seq, "AllBlocksCleared: engine reset");
        }
    }

    /// Sends the pending changes, if any: one delta, or several of consecutive seqs when the
    /// window holds more than one message should carry.
    pub fn flush(&self) {
        let (deltas, oldest, batch_span) = {
            let mut st = self.engine.state.lock();
            (
                st.mirror.take_deltas(DELTA_PART_CHANGES),
                st.oldest_pending_ts.take(),
                st.oldest_pending_span.take(),
            )
        };
        if deltas.is_empty() {
            return;
        }
        if let Some(ts) = oldest {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            if now >= ts {
                self.metrics
                    .event_to_flush
                    .get_or_create(&Metrics::engine(&self.engine.id.0))
                    .observe(now - ts);
            }
        }
        // No subscriber (no router connected yet) is fine: each uplink starts from a snapshot.
        for delta in deltas {
            let _ = self.updates.send(Update {
                engine: self.engine.id.clone(),
                replica: self.engine.replica.clone(),
                delta: Arc::new(delta),
                oldest_event_ts: oldest,
                batch_span: batch_span.clone(),
            });
        }
    }
}

/// The most characters of an unknown event's tag a log line carries.
const MAX_LOGGED_TAG_CHARS: usize = 64;

/// The `type` label of an event's counter: the known types by name, every other tag as
/// `"unknown"`, so no tag an engine sends can add a series.
fn event_type_label(ev: &KvEvent) -> &'static str {
    match ev {
        KvEvent::BlockStored(_) => "BlockStored",
        KvEvent::BlockRemoved(_) => "BlockRemoved",
        KvEvent::AllBlocksCleared(_) => "AllBlocksCleared",
        KvEvent::Unknown { .. } => "unknown",
    }
}

/// `s` cut to its first `max` characters.
fn truncate_chars(s: &str, max: usize) -> &str {
    s.char_indices().nth(max).map_or(s, |(end, _)| &s[..end])
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
