//! Prompts lent under load: when load sends a prompt away from the one replica that held it,
//! the copy the other replica computes is treated as a loan, not a move. Without this memory
//! the two replicas tie on the tenant's next prompt, load breaks the tie, and the tenant can
//! stay with the borrower, whose cache then holds one tenant more than it can keep (traced
//! after a replica restart: one survivor serving three tenants for 10+ s). With it, the lender
//! wins the tenant back once its load allows. A prompt lent again within the memory is hot:
//! one replica cannot serve it, so its copies stand. Measured, it narrowed the restart runs'
//! spread without raising their mean and cost a hot tenant about a point of hit rate, so
//! `kv_cache` keeps it off by default (docs/results/2026-12-03-lending.md).
//!
//! Keyed by the hash of each block of the lent prompt past what any other candidate held (the
//! holder's crowded cache may have evicted some of them), so that the tenant's other prompts
//! that share those blocks find the lend with one map probe at their longest match's last
//! block. The lent conversation itself goes on at the borrower: a prompt that contains the
//! lent prompt's last block (its next turn) finds no lend, or its turns would alternate
//! between the two replicas. Blocks another candidate held too (a system prompt common to all
//! tenants) are never keyed, so a lend does not draw new tenants to the lender.
//!
//! Concurrency: one mutex over a bounded LRU map, held for one probe or one lend's inserts.

use std::num::NonZeroUsize;
use std::time::Duration;

use lru::LruCache;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::blockhash::ExternalHash;
use crate::kvindex::ReplicaSlot;

/// Lent blocks remembered (the least recently lent are forgotten first).
const MAX_LENT_BLOCKS: usize = 65_536;

/// Most blocks one lend keys (the first ones the holder held alone: those a tenant's prompts
/// share).
const MAX_BLOCKS_PER_LEND: usize = 256;

/// The last block of a lent prompt: a prompt with this block at this position continues it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PromptEnd {
    pub position: usize,
    pub hash: ExternalHash,
}

impl PromptEnd {
    pub fn of(prompt: &[ExternalHash]) -> Option<PromptEnd> {
        Some(PromptEnd {
            position: prompt.len().checked_sub(1)?,
            hash: *prompt.last()?,
        })
    }

    fn continued_by(self, prompt: &[ExternalHash]) -> bool {
        prompt.get(self.position) == Some(&self.hash)
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    holder: ReplicaSlot,
    end: PromptEnd,
    at: Instant,
    /// Lent again while remembered: the prompt needs more than one replica.
    hot: bool,
}

pub(super) struct Lends {
    memory: Duration,
    entries: Mutex<LruCache<ExternalHash, Entry>>,
}

impl Lends {
    /// `memory` 0 turns lending off: every copy counts as much as the holder's.
    pub fn new(memory: Duration) -> Lends {
        Lends {
            memory,
            entries: Mutex::new(LruCache::new(
                NonZeroUsize::new(MAX_LENT_BLOCKS).unwrap_or(NonZeroUsize::MIN),
            )),
        }
    }

    pub fn enabled(&self) -> bool {
        !self.memory.is_zero()
    }

    /// Load sent away from `holder` the prompt ending at `end`, whose blocks `alone` (hashes) no
    /// other candidate held. A block lent again within the memory marks it hot.
    pub fn lent(&self, alone: &[ExternalHash], end: PromptEnd, holder: ReplicaSlot, now: Instant) {
        if !self.enabled() {
            return;
        }
        let mut entries = self.entries.lock();
        for &block in alone.iter().take(MAX_BLOCKS_PER_LEND) {
            let hot = entries
                .get(&block)
                .is_some_and(|e| now.saturating_duration_since(e.at) < self.memory);
            entries.put(block, Entry { holder, end, at: now, hot });
        }
    }

    /// The replica that lent a prompt whose blocks `prompt`'s longest match ends in, at the
    /// block hashed `last`: `None` when none did, the lend is older than the memory, the prompt
    /// is hot, or `prompt` continues the lent prompt (the lent conversation's next turn).
    pub fn holder(&self, last: ExternalHash, prompt: &[ExternalHash], now: Instant) -> Option<ReplicaSlot> {
        if !self.enabled() {
            return None;
        }
        let mut entries = self.entries.lock();
        let entry = *entries.peek(&last)?;
        if now.saturating_duration_since(entry.at) >= self.memory {
            entries.pop(&last);
            return None;
        }
        (!entry.hot && !entry.end.continued_by(prompt)).then_some(entry.holder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvindex::{IndexConfig, KvIndex};

    fn slots() -> [ReplicaSlot; 2] {
        let index = KvIndex::new(IndexConfig::default());
        let slot = |a: &str| index.slot_or_insert(a).expect("slot");
        [slot("10.0.0.1:8000"), slot("10.0.0.2:8000")]
    }

    fn blocks(range: std::ops::Range<u64>) -> Vec<ExternalHash> {
        range.map(ExternalHash).collect()
    }

    /// Lends `prompt[alone_from..]` from `holder`.
    fn lend(lends: &Lends, prompt: &[ExternalHash], alone_from: usize, holder: ReplicaSlot) {
        let end = PromptEnd::of(prompt).expect("a prompt");
        lends.lent(&prompt[alone_from..], end, holder, Instant::now());
    }

    /// A prompt that shares the lent prompt's first `shared` blocks (0, 1, ...) and then goes
    /// its own way.
    fn sibling(shared: u64) -> Vec<ExternalHash> {
        let mut prompt = blocks(0..shared);
        prompt.extend(blocks(1000..1003));
        prompt
    }

    #[tokio::test(start_paused = true)]
    async fn a_lend_is_found_at_each_block_held_alone_until_the_memory_passes() {
        let [one, _] = slots();
        let lends = Lends::new(Duration::from_secs(30));
        let lent = blocks(0..6);
        assert_eq!(lends.holder(ExternalHash(3), &sibling(4), Instant::now()), None);
        lend(&lends, &lent, 2, one);
        for shared in 3..6 {
            let last = ExternalHash(shared - 1);
            assert_eq!(lends.holder(last, &sibling(shared), Instant::now()), Some(one));
        }
        // Blocks others held too (a prefix every replica holds) draw nothing to the holder.
        assert_eq!(lends.holder(ExternalHash(1), &sibling(2), Instant::now()), None);
        tokio::time::advance(Duration::from_secs(29)).await;
        assert_eq!(lends.holder(ExternalHash(4), &sibling(5), Instant::now()), Some(one));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(lends.holder(ExternalHash(4), &sibling(5), Instant::now()), None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_lent_conversations_next_turn_finds_no_lend() {
        let [one, _] = slots();
        let lends = Lends::new(Duration::from_secs(30));
        let lent = blocks(0..6);
        lend(&lends, &lent, 0, one);
        // The next turn holds the whole lent prompt and more: it goes on at the borrower.
        let next_turn = blocks(0..9);
        assert_eq!(lends.holder(ExternalHash(5), &next_turn, Instant::now()), None);
        assert_eq!(lends.holder(ExternalHash(5), &lent, Instant::now()), None);
        assert_eq!(lends.holder(ExternalHash(4), &sibling(5), Instant::now()), Some(one));
    }

    #[tokio::test(start_paused = true)]
    async fn a_block_lent_twice_within_the_memory_is_hot_until_it_passes() {
        let [one, two] = slots();
        let lends = Lends::new(Duration::from_secs(30));
        let lent = blocks(0..6);
        lend(&lends, &lent, 0, one);
        tokio::time::advance(Duration::from_secs(10)).await;
        // The tenant's next prompt, which found the lend and was lent again.
        let mut next = blocks(0..4);
        next.extend(blocks(2000..2002));
        lend(&lends, &next, 3, one);
        let found = |last, shared| lends.holder(ExternalHash(last), &sibling(shared), Instant::now());
        assert_eq!(found(3, 4), None, "hot: copies stand");
        assert_eq!(found(2, 3), Some(one));
        // The memory runs from the last lend; once it passes, a new lend is honoured again.
        tokio::time::advance(Duration::from_secs(29)).await;
        assert_eq!(found(3, 4), None);
        tokio::time::advance(Duration::from_secs(1)).await;
        lend(&lends, &next, 3, two);
        assert_eq!(found(3, 4), Some(two));
    }

    #[tokio::test(start_paused = true)]
    async fn a_lend_keys_a_bounded_number_of_blocks_and_zero_memory_none() {
        let [one, _] = slots();
        let lends = Lends::new(Duration::from_secs(30));
        lend(&lends, &blocks(0..1000), 0, one);
        let found = |shared| lends.holder(ExternalHash(shared - 1), &sibling(shared), Instant::now());
        assert_eq!(found(256), Some(one));
        assert_eq!(found(257), None);
        let off = Lends::new(Duration::ZERO);
        lend(&off, &blocks(0..4), 0, one);
        assert_eq!(off.holder(ExternalHash(1), &sibling(2), Instant::now()), None);
    }
}
