//! The approximate tier: a prefix tree of recently routed prompt text, per model, to the
//! replicas the requests were sent to. It decides when the precise index cannot (no tokenizer
//! answer in time, no events yet for the model, unknown hash settings).
//!
//! The tree is stored the way the KV index is: the text is cut into fixed chunks of
//! `chunk_bytes`, each chunk is identified by a hash chained over the model and every chunk before
//! it, so a node *is* its chain hash and walking the tree is walking the chain. Each node keeps
//! the few replicas most recently sent that prefix. Nodes live in one LRU bounded by
//! `max_nodes`, so memory is capped and the least recently routed prefixes go first.
//!
//! Concurrency: one `parking_lot::Mutex` around the LRU (a lookup refreshes recency), held for
//! one walk of at most `prompt_len / chunk_bytes` map operations, never across an `.await`.

#[cfg(test)]
mod tests;

use std::hash::{BuildHasher, Hasher};
use std::num::NonZeroUsize;

use lru::LruCache;
use parking_lot::Mutex;

/// How many replicas one node remembers (the most recent first).
const REPLICAS_PER_NODE: usize = 4;

/// Settings of the approximate tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixTreeConfig {
    /// Bytes of prompt text per node.
    pub chunk_bytes: NonZeroUsize,
    /// Most nodes kept (each costs about 100 bytes).
    pub max_nodes: NonZeroUsize,
}

impl Default for PrefixTreeConfig {
    fn default() -> Self {
        PrefixTreeConfig {
            chunk_bytes: NonZeroUsize::new(64).unwrap_or(NonZeroUsize::MIN),
            max_nodes: NonZeroUsize::new(1 << 20).unwrap_or(NonZeroUsize::MIN),
        }
    }
}

/// A replica's key in the tree: a hash of its address (the tree forgets; a collision between two
/// addresses in one process is a 2^-64 event).
type ReplicaKey = u64;

#[derive(Debug, Clone, Default)]
struct Node {
    /// Most recent first.
    replicas: smallvec_lite::Recent<REPLICAS_PER_NODE>,
}

/// Recently routed prompt prefixes per model.
pub struct PrefixTree {
    config: PrefixTreeConfig,
    state: foldhash::fast::FixedState,
    nodes: Mutex<LruCache<u64, Node, foldhash::fast::RandomState>>,
}

impl std::fmt::Debug for PrefixTree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixTree")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl PrefixTree {
    pub fn new(config: PrefixTreeConfig) -> Self {
        PrefixTree {
            config,
            state: foldhash::fast::FixedState::with_seed(0x6c6c_6d67_7770_7265),
            nodes: Mutex::new(LruCache::with_hasher(
                config.max_nodes,
                foldhash::fast::RandomState::default(),
            )),
        }
    }

    fn replica_key(&self, replica: &str) -> ReplicaKey {
        self.state.hash_one(replica)
    }

    /// Chain hashes of each full chunk of `text` under `model`.
    fn chunk_chain<'a>(&'a self, model: &'a str, text: &'a [u8]) -> impl Iterator<Item = u64> + 'a {
        let mut parent = self.state.hash_one(model);
        text.chunks_exact(self.config.chunk_bytes.get())
            .map(move |chunk| {
                let mut h = self.state.build_hasher();
                h.write_u64(parent);
                h.write(chunk);
                parent = h.finish();
                parent
            })
    }

    /// Records that a request whose prompt is `text` was sent to `replica`.
    pub fn record(&self, model: &str, text: &[u8], replica: &str) {
        self.record_chain(&self.chain(model, text), replica);
    }

    /// The chain hashes `text` is keyed by under `model`, one per full chunk: the same in every
    /// process of this build with the same `chunk_bytes` (the hasher's seed is fixed), so peer
    /// routers can share them.
    pub fn chain(&self, model: &str, text: &[u8]) -> Vec<u64> {
        self.chunk_chain(model, text).collect()
    }

    /// Records that a prompt keyed by `chain` ([`PrefixTree::chain`]) was sent to `replica`.
    pub fn record_chain(&self, chain: &[u64], replica: &str) {
        let key = self.replica_key(replica);
        let mut nodes = self.nodes.lock();
        for &hash in chain {
            nodes
                .get_or_insert_mut(hash, Node::default)
                .replicas
                .touch(key);
        }
    }

    /// Number of full chunks in a prompt of `len` bytes.
    pub fn chunks_in(&self, len: usize) -> usize {
        len / self.config.chunk_bytes.get()
    }

    /// For each candidate, the share in `[0, 1]` of the prompt's chunks that were recently
    /// routed to it as a leading prefix. `out[i]` answers for `candidates[i]`.
    pub fn match_shares(&self, model: &str, text: &[u8], candidates: &[&str], out: &mut Vec<f64>) {
        out.clear();
        out.resize(candidates.len(), 0.0);
        let total = self.chunks_in(text.len());
        if total == 0 || candidates.is_empty() {
            return;
        }
        let keys: Vec<ReplicaKey> = candidates.iter().map(|c| self.replica_key(c)).collect();
        let mut matched = vec![0usize; candidates.len()];
        let mut alive: Vec<bool> = vec![true; candidates.len()];
        let mut nodes = self.nodes.lock();
        for (depth, hash) in self.chunk_chain(model, text).enumerate() {
            let Some(node) = nodes.get(&hash) else {
                break;
            };
            let mut any = false;
            for (i, key) in keys.iter().enumerate() {
                if alive[i] && node.replicas.contains(*key) {
                    matched[i] = depth + 1;
                    any = true;
                } else {
                    alive[i] = false;
                }
            }
            if !any {
                break;
            }
        }
        for (share, m) in out.iter_mut().zip(matched) {
            *share = m as f64 / total as f64;
        }
    }

    /// Nodes held now.
    pub fn len(&self) -> usize {
        self.nodes.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A tiny fixed-capacity most-recent-first set.
mod smallvec_lite {
    #[derive(Debug, Clone)]
    pub(super) struct Recent<const N: usize> {
        items: [u64; N],
        len: usize,
    }

    impl<const N: usize> Default for Recent<N> {
        fn default() -> Self {
            Recent {
                items: [0; N],
                len: 0,
            }
        }
    }

    impl<const N: usize> Recent<N> {
        /// Moves `key` to the front, dropping the least recent when full.
        pub(super) fn touch(&mut self, key: u64) {
            let pos = self.items[..self.len].iter().position(|k| *k == key);
            let end = match pos {
                Some(p) => p,
                None if self.len < N => {
                    self.len += 1;
                    self.len - 1
                }
                None => N - 1,
            };
            self.items.copy_within(0..end, 1);
            self.items[0] = key;
        }

        pub(super) fn contains(&self, key: u64) -> bool {
            self.items[..self.len].contains(&key)
        }
    }
}
