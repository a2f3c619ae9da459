//! Speculative entries: the blocks of a prompt just routed, credited to the chosen replica for a
//! short time, so a burst of the same prompt follows the first request before the engine's own
//! events arrive.
//!
//! Concurrency: one `parking_lot::Mutex`, held for a map lookup and a short prefix comparison;
//! expired entries are swept on insert. Time is passed in by the caller (tokio's `Instant`), so
//! tests control it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::ReplicaSlot;
use crate::blockhash::ExternalHash;

struct Entry {
    slot: ReplicaSlot,
    expires: Instant,
    hashes: Arc<[ExternalHash]>,
}

#[derive(Default)]
struct Inner {
    /// Recent picks keyed by the prompt's first block hash.
    by_first: HashMap<ExternalHash, Vec<Entry>, foldhash::fast::RandomState>,
    /// (expiry, first block) in insertion order, for sweeping.
    expiries: VecDeque<(Instant, ExternalHash)>,
}

/// Recently routed prompts, per replica, with a time to live.
pub struct SpeculativeBlocks {
    ttl: Duration,
    inner: Mutex<Inner>,
}

impl SpeculativeBlocks {
    pub fn new(ttl: Duration) -> Self {
        SpeculativeBlocks {
            ttl,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Credits `slot` with the prompt's blocks until `now + ttl`.
    pub fn insert(&self, slot: ReplicaSlot, hashes: Arc<[ExternalHash]>, now: Instant) {
        let Some(&first) = hashes.first() else {
            return;
        };
        if self.ttl.is_zero() {
            return;
        }
        let mut inner = self.inner.lock();
        Self::sweep(&mut inner, now);
        let expires = now + self.ttl;
        let entries = inner.by_first.entry(first).or_default();
        entries.retain(|e| e.slot != slot || e.hashes.len() > hashes.len());
        entries.push(Entry {
            slot,
            expires,
            hashes,
        });
        inner.expiries.push_back((expires, first));
    }

    fn sweep(inner: &mut Inner, now: Instant) {
        while let Some(&(expires, first)) = inner.expiries.front() {
            if expires > now {
                break;
            }
            inner.expiries.pop_front();
            if let Some(entries) = inner.by_first.get_mut(&first) {
                entries.retain(|e| e.expires > now);
                if entries.is_empty() {
                    inner.by_first.remove(&first);
                }
            }
        }
    }

    /// For each candidate, the most leading blocks of `prompt` it was speculatively credited
    /// with; raises `out[i]` to that where larger.
    pub fn raise_matches(
        &self,
        prompt: &[ExternalHash],
        candidates: &[Option<ReplicaSlot>],
        now: Instant,
        out: &mut [u32],
    ) {
        let Some(first) = prompt.first() else {
            return;
        };
        let inner = self.inner.lock();
        let Some(entries) = inner.by_first.get(first) else {
            return;
        };
        for entry in entries.iter().filter(|e| e.expires > now) {
            // Chained hashes: equal at i means equal before i, so the common prefix is exact.
            let common = prompt
                .iter()
                .zip(entry.hashes.iter())
                .take_while(|(a, b)| a == b)
                .count();
            let common = u32::try_from(common).unwrap_or(u32::MAX);
            for (i, candidate) in candidates.iter().enumerate() {
                if *candidate == Some(entry.slot) && out[i] < common {
                    out[i] = common;
                }
            }
        }
    }

    /// Live entries (for metrics).
    pub fn len(&self) -> usize {
        self.inner.lock().by_first.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
