//! The KV block pool: vLLM's `BlockPool` with prefix caching, reduced to what is visible from
//! outside (which hashes are cached, what is evicted and when).
//!
//! Like vLLM, block 0 is the reserved *null block* and never handed out, so a pool of `n`
//! blocks has `n - 1` usable ones. Blocks whose reference count drops to zero go to the tail of
//! an LRU free list (a request's blocks in reverse order, so its tail is evicted first); new
//! blocks are taken from the head, and taking a block that still carries a hash evicts that
//! hash from the prefix cache. The same hash may be cached in several physical blocks (two
//! requests computed the same prefix concurrently); each copy is stored and evicted on its own.
//!
//! Concurrency: none. The pool is plain data owned by the engine task (see `super`), mutated
//! only from there; tests drive it directly.

use std::collections::HashMap;

use llmgw::blockhash::BlockDigest;

/// Index of a physical block (1-based; 0 is the null block).
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    hash: Option<BlockDigest>,
    prev: u32,
    next: u32,
    in_free: bool,
}

/// What happened to the cache while allocating: hashes evicted, in order.
pub type Evicted = Vec<BlockDigest>;

/// A fixed-size pool of KV blocks with an LRU free list and a hash → blocks prefix cache.
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashMap<BlockDigest, Vec<BlockId>>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks (including the null block); every usable block starts free
    /// and uncached, in id order.
    pub fn new(num_blocks: usize) -> Self {
        let num_blocks = num_blocks.max(1);
        let mut pool = BlockPool {
            blocks: vec![
                Block {
                    ref_cnt: 0,
                    hash: None,
                    prev: NIL,
                    next: NIL,
                    in_free: false,
                };
                num_blocks
            ],
            head: NIL,
            tail: NIL,
            num_free: 0,
            cached: HashMap::new(),
        };
        for id in 1..num_blocks as u32 {
            pool.push_tail(id);
        }
        pool
    }

    /// Usable blocks (all but the null block).
    pub fn capacity(&self) -> usize {
        self.blocks.len() - 1
    }

    /// Blocks with no reference (cached-but-evictable ones included), as vLLM counts free.
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// vLLM's `kv_cache_usage_perc`: `1 - free / usable`.
    pub fn usage(&self) -> f64 {
        let cap = self.capacity();
        if cap == 0 {
            return 0.0;
        }
        1.0 - self.num_free as f64 / cap as f64
    }

    /// The longest prefix of `digests` that is cached, as one block id per digest.
    pub fn longest_prefix(&self, digests: &[BlockDigest]) -> Vec<BlockId> {
        let mut hit = Vec::new();
        for digest in digests {
            match self.cached.get(digest).and_then(|ids| ids.first()) {
                Some(&id) => hit.push(id),
                None => break,
            }
        }
        hit
    }

    /// How many of `ids` are free now (touching them takes them off the free list).
    pub fn count_free(&self, ids: &[BlockId]) -> usize {
        ids.iter()
            .filter(|&&id| self.blocks.get(id as usize).is_some_and(|b| b.in_free))
            .count()
    }

    /// Takes a reference on cached blocks (a prefix hit).
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            if self.blocks[id as usize].in_free {
                self.unlink(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
        }
    }

    /// Takes `n` blocks from the head of the free list, evicting the hashes they carried
    /// (appended to `evicted` in eviction order). `None`, and no change, if fewer are free.
    pub fn allocate(&mut self, n: usize, evicted: &mut Evicted) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            let block = &mut self.blocks[id as usize];
            block.ref_cnt = 1;
            if let Some(digest) = block.hash.take() {
                self.uncache(digest, id);
                evicted.push(digest);
            }
            out.push(id);
        }
        Some(out)
    }

    /// Marks a held block as holding the full block `digest`, so later requests can hit it.
    /// Returns false (and does nothing) if the block already has a hash or is not held.
    pub fn cache(&mut self, id: BlockId, digest: BlockDigest) -> bool {
        let Some(block) = self.blocks.get_mut(id as usize) else {
            return false;
        };
        if id == 0 || block.hash.is_some() || block.ref_cnt == 0 {
            return false;
        }
        block.hash = Some(digest);
        self.cached.entry(digest).or_default().push(id);
        true
    }

    /// Drops one reference on each block; blocks reaching zero join the free list's tail in
    /// reverse order (so a request's last blocks are evicted first, as in vLLM).
    pub fn free(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let block = &mut self.blocks[id as usize];
            if block.ref_cnt == 0 {
                continue;
            }
            block.ref_cnt -= 1;
            if block.ref_cnt == 0 {
                self.push_tail(id);
            }
        }
    }

    /// vLLM's `reset_prefix_cache`: forgets every cached hash, but only when no block is in
    /// use (returns false otherwise, changing nothing).
    pub fn reset(&mut self) -> bool {
        if self.num_free != self.capacity() {
            return false;
        }
        self.cached.clear();
        for block in &mut self.blocks {
            block.hash = None;
        }
        true
    }

    /// The external (u64) hashes now cached, sorted and deduplicated.
    pub fn cached_hashes(&self) -> Vec<u64> {
        let mut out: Vec<u64> = self.cached.keys().map(|d| d.external().0).collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Number of physical blocks carrying a hash.
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.values().map(Vec::len).sum()
    }

    fn uncache(&mut self, digest: BlockDigest, id: BlockId) {
        if let Some(ids) = self.cached.get_mut(&digest) {
            ids.retain(|&x| x != id);
            if ids.is_empty() {
                self.cached.remove(&digest);
            }
        }
    }

    fn push_tail(&mut self, id: u32) {
        let tail = self.tail;
        {
            let block = &mut self.blocks[id as usize];
            block.prev = tail;
            block.next = NIL;
            block.in_free = true;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    fn unlink(&mut self, id: u32) {
        let (prev, next) = {
            let block = &mut self.blocks[id as usize];
            let pn = (block.prev, block.next);
            block.prev = NIL;
            block.next = NIL;
            block.in_free = false;
            pn
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        self.num_free -= 1;
    }

    /// Free-list order, head first (for tests and invariants).
    #[cfg(test)]
    fn free_order(&self) -> Vec<BlockId> {
        let mut out = Vec::new();
        let mut id = self.head;
        while id != NIL {
            out.push(id);
            id = self.blocks[id as usize].next;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;

    use llmgw::blockhash::{BlockHasher, HashSettings};
    use proptest::prelude::*;

    use super::*;

    fn digest(n: u32) -> BlockDigest {
        let hasher = BlockHasher::new(&HashSettings::sha256_cbor(
            NonZeroUsize::new(1).unwrap(),
            Some("0"),
        ))
        .unwrap();
        hasher.hash_block(None, &[n], None)
    }

    #[test]
    fn null_block_is_never_handed_out() {
        let mut pool = BlockPool::new(4);
        assert_eq!(pool.capacity(), 3);
        let ids = pool.allocate(3, &mut Vec::new()).unwrap();
        assert_eq!(ids, vec![1, 2, 3]);
        assert!(pool.allocate(1, &mut Vec::new()).is_none());
        assert_eq!(pool.usage(), 1.0);
    }

    #[test]
    fn freed_blocks_evict_lru_first_and_tail_first() {
        let mut pool = BlockPool::new(5);
        let a = pool.allocate(2, &mut Vec::new()).unwrap();
        assert!(pool.cache(a[0], digest(0)));
        assert!(pool.cache(a[1], digest(1)));
        pool.free(&a);
        // Two never-used blocks first, then a's tail block, then its head.
        assert_eq!(pool.free_order(), vec![3, 4, a[1], a[0]]);
        let mut evicted = Vec::new();
        let b = pool.allocate(3, &mut evicted).unwrap();
        assert_eq!(b, vec![3, 4, a[1]]);
        assert_eq!(evicted, vec![digest(1)]);
        assert_eq!(pool.longest_prefix(&[digest(0), digest(1)]), vec![a[0]]);
        assert_eq!(pool.cached_hashes(), vec![digest(0).external().0]);
    }

    #[test]
    fn touching_a_free_cached_block_takes_it_off_the_free_list() {
        let mut pool = BlockPool::new(3);
        let a = pool.allocate(1, &mut Vec::new()).unwrap();
        pool.cache(a[0], digest(7));
        pool.free(&a);
        let hit = pool.longest_prefix(&[digest(7), digest(8)]);
        assert_eq!(hit, a);
        assert_eq!(pool.count_free(&hit), 1);
        pool.touch(&hit);
        assert_eq!(pool.num_free(), 1);
        let mut evicted = Vec::new();
        pool.allocate(1, &mut evicted).unwrap();
        assert!(evicted.is_empty(), "a held cached block is never evicted");
        assert!(!pool.reset(), "reset refuses while blocks are in use");
    }

    #[test]
    fn duplicate_hashes_are_cached_and_evicted_per_copy() {
        let mut pool = BlockPool::new(3);
        let ids = pool.allocate(2, &mut Vec::new()).unwrap();
        assert!(pool.cache(ids[0], digest(1)));
        assert!(pool.cache(ids[1], digest(1)));
        assert_eq!(pool.num_cached_blocks(), 2);
        pool.free(&ids);
        let mut evicted = Vec::new();
        pool.allocate(1, &mut evicted).unwrap();
        assert_eq!(evicted, vec![digest(1)]);
        assert_eq!(pool.cached_hashes(), vec![digest(1).external().0]);
        pool.allocate(1, &mut evicted).unwrap();
        assert!(pool.cached_hashes().is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        Cache(usize, u32),
        Free(usize),
        TouchPrefix(Vec<u32>),
        Reset,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..4).prop_map(Op::Alloc),
            (0usize..8, 0u32..6).prop_map(|(h, d)| Op::Cache(h, d)),
            (0usize..8).prop_map(Op::Free),
            proptest::collection::vec(0u32..6, 1..4).prop_map(Op::TouchPrefix),
            Just(Op::Reset),
        ]
    }

    proptest! {
        /// Against a naive model: refcounts never go negative, free + held == capacity, the
        /// cache maps exactly the hashes blocks carry, and eviction follows the free order.
        #[test]
        fn pool_invariants(ops in proptest::collection::vec(op(), 1..80)) {
            let mut pool = BlockPool::new(7);
            let mut held: Vec<Vec<BlockId>> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(n) => {
                        let before = pool.free_order();
                        let mut evicted = Vec::new();
                        match pool.allocate(n, &mut evicted) {
                            Some(ids) => {
                                prop_assert_eq!(&ids[..], &before[..n]);
                                held.push(ids);
                            }
                            None => prop_assert!(before.len() < n),
                        }
                    }
                    Op::Cache(h, d) => {
                        if let Some(&id) = held.get(h % held.len().max(1)).and_then(|ids| ids.first()) {
                            pool.cache(id, digest(d));
                        }
                    }
                    Op::Free(h) => {
                        if !held.is_empty() {
                            let ids = held.remove(h % held.len());
                            pool.free(&ids);
                        }
                    }
                    Op::TouchPrefix(ds) => {
                        let digests: Vec<_> = ds.into_iter().map(digest).collect();
                        let hit = pool.longest_prefix(&digests);
                        pool.touch(&hit);
                        held.push(hit);
                    }
                    Op::Reset => {
                        let was_idle = held.iter().all(Vec::is_empty);
                        prop_assert_eq!(pool.reset(), was_idle);
                    }
                }
                // Reference counts equal the number of holders.
                let mut refs = vec![0u32; pool.blocks.len()];
                for ids in &held {
                    for &id in ids {
                        refs[id as usize] += 1;
                    }
                }
                for (id, block) in pool.blocks.iter().enumerate().skip(1) {
                    prop_assert_eq!(block.ref_cnt, refs[id]);
                    prop_assert_eq!(block.in_free, refs[id] == 0);
                }
                let order = pool.free_order();
                prop_assert_eq!(order.len(), pool.num_free());
                prop_assert!(pool.num_free() <= pool.capacity());
                prop_assert!(!order.contains(&0));
                // The cache map and the blocks' hashes agree.
                let carried: usize = pool.blocks.iter().filter(|b| b.hash.is_some()).count();
                prop_assert_eq!(carried, pool.num_cached_blocks());
                for (digest, ids) in &pool.cached {
                    for &id in ids {
                        prop_assert_eq!(pool.blocks[id as usize].hash, Some(*digest));
                    }
                }
            }
        }
    }
}
