//! Copies the routers made: which blocks each replica stores because a router (this one or, through
//! peering, a peer) sent it a prompt it did not hold. When two replicas hold a prompt's longest
//! match and a router made one copy while the other came from traffic no router sees (clients
//! that know a replica's address, another gateway), the outside copy wins: that traffic keeps
//! it warm whatever the routers do, so only the routers' copy can be left to age out. Without
//! this, load breaks the tie and the tenant lives on both caches, each crowded by one tenant
//! more than it holds (traced in bench-routing's bypass scenario: two tenants split this way
//! for 16 s; docs/results/2026-12-06-scoreboard.md).
//!
//! Keyed by block hash, for each block past what the chosen replica held when it was picked
//! (the blocks the pick makes it store); the value is the last [`HOLDERS_PER_BLOCK`] replicas
//! a router sent it to. The memory is the least recently routed [`MAX_ROUTED_BLOCKS`] blocks:
//! a copy forgotten since counts as an outside one, which only makes the older of two copies
//! win a tie. A fresh fleet's first picks, made before any engine reported a block, are
//! recorded too (`kv_cache` hashes their prompts once the agents feed the router): otherwise
//! the first tenants' homes would pass for outside copies, and win every tie against the
//! copies load makes of them.
//!
//! Routers that do not peer each see the other's copies as outside ones; a tie between two
//! such copies is then broken the other way round by each, which keeps both warm, as breaking
//! it by load does.
//!
//! Concurrency: one mutex over a bounded LRU map, held for one probe or one pick's inserts.

use std::collections::HashMap;
use std::num::NonZeroUsize;

use lru::LruCache;
use parking_lot::Mutex;

use crate::blockhash::ExternalHash;

/// Routed blocks remembered (the least recently routed are forgotten first): about 4 MB.
pub(super) const MAX_ROUTED_BLOCKS: usize = 65_536;

/// Most blocks one pick records (the first it makes the replica store: a tenant's shared
/// prefixes come first).
const MAX_BLOCKS_PER_PICK: usize = 256;

/// Replicas remembered per block: more copies than this are a hot prefix's, and the oldest
/// record gives way.
const HOLDERS_PER_BLOCK: usize = 4;

/// A replica's number here (its own numbering, not the KV index's slots: a pick made before
/// any engine reported events has no slot yet).
type ReplicaId = u16;

const VACANT: ReplicaId = ReplicaId::MAX;

/// The replicas a router sent a block to, oldest first.
#[derive(Debug, Clone, Copy)]
struct Holders([ReplicaId; HOLDERS_PER_BLOCK]);

impl Holders {
    fn of(id: ReplicaId) -> Holders {
        let mut ids = [VACANT; HOLDERS_PER_BLOCK];
        ids[0] = id;
        Holders(ids)
    }

    fn contains(&self, id: ReplicaId) -> bool {
        self.0.contains(&id)
    }

    fn add(&mut self, id: ReplicaId) {
        if self.contains(id) {
            return;
        }
        match self.0.iter_mut().find(|h| **h == VACANT) {
            Some(vacant) => *vacant = id,
            None => {
                self.0.rotate_left(1);
                self.0[HOLDERS_PER_BLOCK - 1] = id;
            }
        }
    }
}

struct Inner {
    ids: HashMap<String, ReplicaId>,
    blocks: LruCache<ExternalHash, Holders>,
}

impl Inner {
    /// `replica`'s number, given one if new; `None` once every number is taken.
    fn id(&mut self, replica: &str) -> Option<ReplicaId> {
        if let Some(&id) = self.ids.get(replica) {
            return Some(id);
        }
        let id = ReplicaId::try_from(self.ids.len()).ok().filter(|&id| id != VACANT)?;
        self.ids.insert(replica.to_owned(), id);
        Some(id)
    }
}

pub(super) struct RoutedCopies {
    enabled: bool,
    inner: Mutex<Inner>,
}

impl RoutedCopies {
    /// Disabled, nothing is recorded and every copy is as good as another.
    pub fn new(enabled: bool) -> RoutedCopies {
        RoutedCopies {
            enabled,
            inner: Mutex::new(Inner {
                ids: HashMap::new(),
                blocks: LruCache::new(
                    NonZeroUsize::new(MAX_ROUTED_BLOCKS).unwrap_or(NonZeroUsize::MIN),
                ),
            }),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// A router sent `replica` a prompt whose blocks `new` it did not hold: it is about to
    /// store them.
    pub fn routed(&self, replica: &str, new: &[ExternalHash]) {
        if !self.enabled || new.is_empty() {
            return;
        }
        let mut inner = self.inner.lock();
        let Some(id) = inner.id(replica) else {
            return;
        };
        for &block in new.iter().take(MAX_BLOCKS_PER_PICK) {
            match inner.blocks.get_mut(&block) {
                Some(holders) => holders.add(id),
                None => {
                    inner.blocks.put(block, Holders::of(id));
                }
            }
        }
    }

    /// Whether a router made `replica`'s copy of the block hashed `block` (as far as
    /// remembered).
    pub fn made_by_router(&self, replica: &str, block: ExternalHash) -> bool {
        let inner = self.inner.lock();
        let Some(&id) = inner.ids.get(replica) else {
            return false;
        };
        inner.blocks.peek(&block).is_some_and(|h| h.contains(id))
    }

    /// For each candidate among `tied` (those holding the longest match, whose last block each
    /// one's entry names), whether its copy is the routers' while another tied candidate's
    /// copy came from outside: those copies count for nothing. All `false` when no preference
    /// applies: not enabled, or every tied copy alike.
    pub fn routed_ties(&self, tied: &[Option<(&str, ExternalHash)>]) -> Vec<bool> {
        if !self.enabled {
            return vec![false; tied.len()];
        }
        let made: Vec<Option<bool>> = tied
            .iter()
            .map(|entry| entry.map(|(replica, last)| self.made_by_router(replica, last)))
            .collect();
        let routed = made.contains(&Some(true));
        let outside = made.contains(&Some(false));
        made.into_iter()
            .map(|m| routed && outside && m == Some(true))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: [&str; 3] = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];

    fn blocks(range: std::ops::Range<u64>) -> Vec<ExternalHash> {
        range.map(ExternalHash).collect()
    }

    #[test]
    fn a_routed_copy_loses_a_tie_to_an_outside_copy_and_only_then() {
        let copies = RoutedCopies::new(true);
        // The router placed the tenant's first prompt (blocks 0..6) on R[0].
        copies.routed(R[0], &blocks(0..6));
        let last = ExternalHash(3);
        // R[1] holds blocks 0..4 too, from traffic the router did not send.
        assert_eq!(
            copies.routed_ties(&[Some((R[0], last)), Some((R[1], last)), None]),
            vec![true, false, false]
        );
        // A tie between two copies the routers made (a load override copied it): no preference.
        copies.routed(R[1], &blocks(0..6));
        assert_eq!(
            copies.routed_ties(&[Some((R[0], last)), Some((R[1], last)), None]),
            vec![false; 3]
        );
        // Two outside copies: none either.
        assert_eq!(
            copies.routed_ties(&[None, Some((R[2], last)), Some((R[2], ExternalHash(40)))]),
            vec![false; 3]
        );
    }

    #[test]
    fn only_the_blocks_a_pick_makes_the_replica_store_are_recorded() {
        let copies = RoutedCopies::new(true);
        // R[1] held blocks 0..4 from outside traffic; the router sent it a prompt of 0..6.
        copies.routed(R[1], &blocks(0..6)[4..]);
        assert!(!copies.made_by_router(R[1], ExternalHash(3)));
        assert!(copies.made_by_router(R[1], ExternalHash(4)));
        assert!(!copies.made_by_router(R[0], ExternalHash(4)));
    }

    #[test]
    fn a_pick_records_a_bounded_number_of_blocks_and_disabled_nothing() {
        let copies = RoutedCopies::new(true);
        copies.routed(R[0], &blocks(0..1000));
        assert!(copies.made_by_router(R[0], ExternalHash(255)));
        assert!(!copies.made_by_router(R[0], ExternalHash(256)));
        let off = RoutedCopies::new(false);
        off.routed(R[0], &blocks(0..4));
        assert!(!off.made_by_router(R[0], ExternalHash(1)));
        assert_eq!(
            off.routed_ties(&[Some((R[0], ExternalHash(1))), Some((R[1], ExternalHash(1)))]),
            vec![false, false]
        );
    }

    #[test]
    fn a_block_remembers_its_latest_holders_and_any_number_of_replicas_is_tracked() {
        let copies = RoutedCopies::new(true);
        let replicas: Vec<String> = (0..70).map(|i| format!("10.1.0.{i}:8000")).collect();
        for replica in &replicas {
            copies.routed(replica, &blocks(0..2));
        }
        // Each block keeps the last four replicas sent it.
        assert!(copies.made_by_router(&replicas[69], ExternalHash(1)));
        assert!(copies.made_by_router(&replicas[66], ExternalHash(1)));
        assert!(!copies.made_by_router(&replicas[65], ExternalHash(1)));
        // Sending a block again to a holder it remembers does not push another out.
        copies.routed(&replicas[66], &blocks(0..2));
        assert!(copies.made_by_router(&replicas[66], ExternalHash(0)));
        assert!(copies.made_by_router(&replicas[67], ExternalHash(0)));
    }

    #[test]
    fn the_least_recently_routed_blocks_are_forgotten_first() {
        let copies = RoutedCopies::new(true);
        copies.routed(R[0], &blocks(0..1));
        for start in (1..=MAX_ROUTED_BLOCKS as u64).step_by(MAX_BLOCKS_PER_PICK) {
            copies.routed(R[0], &blocks(start..start + MAX_BLOCKS_PER_PICK as u64));
        }
        assert!(!copies.made_by_router(R[0], ExternalHash(0)));
        assert!(copies.made_by_router(R[0], ExternalHash(MAX_ROUTED_BLOCKS as u64)));
    }
}
