//! One engine's cached blocks as its event stream says, and the net changes not yet sent.
//!
//! A [`Mirror`] keeps a reference count per [`BlockKey`] (hash, KV-cache group, tier): vLLM can
//! hold one hash in several physical blocks, and each copy is stored and evicted on its own.
//! Changes accumulate in a pending set of per-key net counts; the owner flushes them with
//! [`Mirror::take_deltas`] once its coalescing window (default [`DEFAULT_WINDOW`]) has passed,
//! so a block stored and evicted inside one window costs the routers nothing; a window with
//! more than [`DELTA_PART_CHANGES`] changes goes in several deltas.
//!
//! Every delta carries the mirror's epoch and a sequence number: a reset (engine restart,
//! cache cleared, unrecoverable gap) starts a new epoch whose first delta says "reset"; a
//! snapshot says which sequence number it includes, so a consumer applies only later deltas.
//!
//! # Concurrency model
//! Plain data, no interior locking: one engine task owns it (behind the engine's
//! `parking_lot::Mutex`, taken briefly per batch, per flush and per snapshot).

use std::collections::hash_map::Entry;
use std::time::Duration;

use llmgw_core::kv_event::Medium as Tier;

use crate::wire::{ExternalHash, KvEvent, Medium};

/// The mirror's maps hash with foldhash: block keys are engine-chosen 64-bit hashes already,
/// and SipHash cost about a tenth of decode + mirror time.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Pending-map capacity kept between windows (see [`Mirror::take_delta`]).
const PENDING_KEEP: usize = 4096;

/// Most changes (keys stored or removed, one per copy) in one delta of
/// [`Mirror::take_deltas`]: about 1 MiB on the wire, like a snapshot part, well below the
/// router's message limit. A window with more (a burst of prefills, a replay) goes in several
/// deltas of consecutive seqs instead of one the router would refuse.
pub const DELTA_PART_CHANGES: usize = 65_536;

/// The most block copies (all keys, all tiers) one engine's mirror holds: the router's default
/// ceiling per engine (`llmgw::feed::state::DEFAULT_MAX_BLOCKS_PER_ENGINE`), past which it
/// refuses the engine anyway. vLLM's cache is finite: an engine reporting more is broken or
/// lying, and its mirror is reset rather than grown without bound.
pub const MAX_COPIES: u64 = 4_000_000;

/// The default coalescing window.
pub const DEFAULT_WINDOW: Duration = Duration::from_millis(20);

/// vLLM's KV-cache group index (`group_idx`; absent means group 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct GroupIdx(pub u32);

/// One cached block as the index keys it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockKey {
    pub hash: ExternalHash,
    pub group: GroupIdx,
    pub tier: Tier,
}

/// Net changes since the previous delta of the same epoch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Delta {
    pub epoch: u64,
    /// 1 for the first delta of an epoch, then +1 per delta.
    pub seq: u64,
    /// Drop everything held for this engine before applying the rest.
    pub reset: bool,
    /// Keys newly held, each once per added copy.
    pub stored: Vec<BlockKey>,
    /// Keys released, each once per removed copy.
    pub removed: Vec<BlockKey>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        !self.reset && self.stored.is_empty() && self.removed.is_empty()
    }
}

/// Everything held, as of delta `seq` of `epoch` (0: no delta of this epoch yet).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Snapshot {
    pub epoch: u64,
    pub seq: u64,
    /// Each key with its copy count.
    pub blocks: Vec<(BlockKey, u32)>,
}

/// What applying one event did, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Applied {
    pub stored: usize,
    pub removed: usize,
    /// Removals of keys the mirror did not hold (the agent started mid-stream, or the engine
    /// evicted a block stored before the last reset): ignored.
    pub unknown_removed: usize,
    pub cleared: bool,
    /// A store would have taken the mirror past its ceiling ([`MAX_COPIES`]): the mirror was
    /// reset and the rest of the event dropped.
    pub overflowed: bool,
}

/// One engine's blocks; see the module docs.
#[derive(Debug)]
pub struct Mirror {
    blocks: HashMap<BlockKey, u32>,
    /// The sum of `blocks`' counts, at most `max_copies`.
    copies: u64,
    max_copies: u64,
    /// Net count change per key since the last delta; zero entries are dropped.
    pending: HashMap<BlockKey, i64>,
    pending_reset: bool,
    epoch: u64,
    seq: u64,
}

impl Default for Mirror {
    fn default() -> Self {
        Mirror::with_max_copies(MAX_COPIES)
    }
}

impl Mirror {
    pub fn new() -> Self {
        Mirror::default()
    }

    /// A mirror holding at most `max_copies` block copies (tests; the agent uses [`MAX_COPIES`]).
    pub fn with_max_copies(max_copies: u64) -> Self {
        Mirror {
            blocks: HashMap::default(),
            copies: 0,
            max_copies,
            pending: HashMap::default(),
            pending_reset: false,
            epoch: 0,
            seq: 0,
        }
    }

    /// The most block copies this mirror holds.
    pub fn max_copies(&self) -> u64 {
        self.max_copies
    }

    /// Block copies held, over all keys.
    pub fn copies(&self) -> u64 {
        self.copies
    }

    /// Distinct keys held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Copies held of `key` (0 when absent).
    pub fn count(&self, key: &BlockKey) -> u32 {
        self.blocks.get(key).copied().unwrap_or(0)
    }

    /// The keys held, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = &BlockKey> {
        self.blocks.keys()
    }

    /// Whether a delta is waiting to be taken.
    pub fn has_pending(&self) -> bool {
        self.pending_reset || !self.pending.is_empty()
    }

    /// Applies one decoded event.
    pub fn apply(&mut self, event: &KvEvent) -> Applied {
        let mut applied = Applied::default();
        match event {
            KvEvent::BlockStored(s) => {
                let group = group_of(s.group_idx);
                let tier = Medium::tier(s.medium.as_ref());
                for &hash in &s.block_hashes {
                    if !self.store(BlockKey { hash, group, tier }) {
                        self.reset();
                        applied.overflowed = true;
                        return applied;
                    }
                    applied.stored += 1;
                }
            }
            KvEvent::BlockRemoved(r) => {
                let group = group_of(r.group_idx);
                let tier = Medium::tier(r.medium.as_ref());
                for &hash in &r.block_hashes {
                    if self.remove(BlockKey { hash, group, tier }) {
                        applied.removed += 1;
                    } else {
                        applied.unknown_removed += 1;
                    }
                }
            }
            KvEvent::AllBlocksCleared(_) => {
                self.reset();
                applied.cleared = true;
            }
            KvEvent::Unknown { .. } => {}
        }
        applied
    }

    /// One more copy of `key`; false, with nothing changed, when the mirror already holds its
    /// ceiling of copies.
    #[must_use]
    pub fn store(&mut self, key: BlockKey) -> bool {
        if self.copies >= self.max_copies {
            return false;
        }
        let count = self.blocks.entry(key).or_insert(0);
        // Below the ceiling a count cannot reach u32::MAX; checked all the same.
        let Some(next) = count.checked_add(1) else {
            return false;
        };
        *count = next;
        self.copies += 1;
        self.bump(key, 1);
        true
    }

    /// One copy fewer of `key`; false (and no change) when none is held.
    pub fn remove(&mut self, key: BlockKey) -> bool {
        match self.blocks.entry(key) {
            Entry::Vacant(_) => return false,
            Entry::Occupied(mut e) => {
                if *e.get() <= 1 {
                    e.remove();
                } else {
                    *e.get_mut() -= 1;
                }
            }
        }
        self.copies = self.copies.saturating_sub(1);
        self.bump(key, -1);
        true
    }

    fn bump(&mut self, key: BlockKey, by: i64) {
        match self.pending.entry(key) {
            Entry::Vacant(e) => {
                e.insert(by);
            }
            Entry::Occupied(mut e) => {
                *e.get_mut() += by;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
    }

    /// Forgets everything: the next delta starts a new epoch with a reset.
    pub fn reset(&mut self) {
        self.blocks.clear();
        self.copies = 0;
        self.pending.clear();
        self.pending_reset = true;
        self.epoch += 1;
        self.seq = 0;
    }

    /// The pending net changes as one delta (`None` when there are none).
    pub fn take_delta(&mut self) -> Option<Delta> {
        if !self.has_pending() {
            return None;
        }
        self.seq += 1;
        let mut delta = Delta {
            epoch: self.epoch,
            seq: self.seq,
            reset: std::mem::take(&mut self.pending_reset),
            stored: Vec::new(),
            removed: Vec::new(),
        };
        for (key, n) in self.pending.drain() {
            let copies = usize::try_from(n.unsigned_abs()).unwrap_or(usize::MAX);
            let list = if n > 0 {
                &mut delta.stored
            } else {
                &mut delta.removed
            };
            list.extend(std::iter::repeat_n(key, copies));
        }
        // A burst (a big prefill, a snapshot-sized replay) must not pin its peak capacity.
        if self.pending.capacity() > PENDING_KEEP * 16 {
            self.pending.shrink_to(PENDING_KEEP);
        }
        Some(delta)
    }

    /// The pending net changes as deltas of at most `max_changes` changes each, with
    /// consecutive seqs (empty when there are none). Only the first carries a reset. Each
    /// key's net change is one sign, so any split applies to the same end state, and a snapshot
    /// taken after this includes every part.
    pub fn take_deltas(&mut self, max_changes: usize) -> Vec<Delta> {
        let Some(whole) = self.take_delta() else {
            return Vec::new();
        };
        let max = max_changes.max(1);
        if whole.stored.len() + whole.removed.len() <= max {
            return vec![whole];
        }
        let Delta {
            epoch,
            seq: first,
            reset,
            stored,
            removed,
        } = whole;
        let (mut stored, mut removed) = (stored.into_iter(), removed.into_iter());
        let mut parts: Vec<Delta> = Vec::new();
        loop {
            let part_stored: Vec<BlockKey> = stored.by_ref().take(max).collect();
            let part_removed: Vec<BlockKey> =
                removed.by_ref().take(max - part_stored.len()).collect();
            if part_stored.is_empty() && part_removed.is_empty() {
                break;
            }
            parts.push(Delta {
                epoch,
                seq: first + parts.len() as u64,
                reset: reset && parts.is_empty(),
                stored: part_stored,
                removed: part_removed,
            });
        }
        self.seq = first + parts.len() as u64 - 1;
        parts
    }

    /// Everything held, consistent with the deltas taken so far (pending changes excluded:
    /// they arrive in the next delta, which the snapshot's `seq` says to apply).
    pub fn snapshot(&self) -> Snapshot {
        let mut blocks: Vec<(BlockKey, u32)> = self
            .blocks
            .iter()
            .filter_map(|(k, &n)| {
                let pending = self.pending.get(k).copied().unwrap_or(0);
                let sent = i64::from(n) - pending;
                u32::try_from(sent).ok().filter(|&c| c > 0).map(|c| (*k, c))
            })
            .collect();
        // Keys fully removed in the pending window were still held as of the last delta.
        for (k, &p) in &self.pending {
            if p < 0 && !self.blocks.contains_key(k) {
                let sent = u32::try_from(-p).unwrap_or(u32::MAX);
                blocks.push((*k, sent));
            }
        }
        Snapshot {
            epoch: self.epoch,
            seq: self.seq,
            blocks,
        }
    }
}

fn group_of(group_idx: Option<i64>) -> GroupIdx {
    GroupIdx(group_idx.and_then(|g| u32::try_from(g).ok()).unwrap_or(0))
}

#[cfg(test)]
mod tests;
