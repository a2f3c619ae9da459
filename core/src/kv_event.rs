//! What a KV-event consumer is told: net changes to one replica's cached blocks, by tier.
//!
//! The agent's mirror speaks these types to its uplink, and the router's feed speaks them to the
//! index; neither side needs the other's crate for it. Implementations decide their own
//! concurrency: the trait is `Send + Sync` and every method takes `&self`.

use crate::blockhash::ExternalHash;

/// Where a cached block lives on its replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    Gpu,
    /// CPU, disk, remote or any other tier vLLM names: slower to reuse than device memory.
    Offloaded,
}

impl Medium {
    /// vLLM's `medium` field: absent or "GPU" for device memory, anything else offloaded.
    pub fn from_vllm(medium: Option<&str>) -> Medium {
        match medium {
            None => Medium::Gpu,
            Some(m) if m.eq_ignore_ascii_case("gpu") => Medium::Gpu,
            Some(_) => Medium::Offloaded,
        }
    }
}

/// Net changes to one replica's cached blocks. `replica` is the `host:port` the router knows the
/// replica by; only full-attention groups are fed here.
///
/// Copies are counted: a block stored twice needs two removals. Counted forms take `(hash,
/// copies)` pairs, so a wire count is applied as a number and never expanded into entries; an
/// implementation may saturate large counts (the index keeps at most 15 references per tier).
pub trait KvEventSink: Send + Sync {
    /// `copies` more references to each block (pairs with 0 copies are ignored).
    fn stored_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium);
    /// `copies` fewer references to each block.
    fn removed_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium);
    /// Forget everything the replica held (vLLM's `AllBlocksCleared`, for a sink fed straight
    /// from one engine's events).
    fn cleared(&self, replica: &str);

    /// `copies` fewer references to each block, though no engine evicted them: a report that a
    /// newer one replaces, or one withdrawn with its engine (refused, gone). Unlike
    /// [`removed_copies`](Self::removed_copies), an index counts no eviction.
    fn withdrawn_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        self.removed_copies(replica, blocks, medium);
    }
    /// One of the replica's engines lost `blocks` at once (an engine restart, a cache reset, a
    /// gap in its events): one reference fewer to each, as
    /// [`withdrawn_copies`](Self::withdrawn_copies), and an index may remember them as the home
    /// of their prompts. Other engines of the replica keep what they hold.
    fn lost_blocks(&self, replica: &str, blocks: &[(ExternalHash, Medium)]) {
        for medium in [Medium::Gpu, Medium::Offloaded] {
            let tier: Vec<(ExternalHash, u32)> = blocks
                .iter()
                .filter(|(_, m)| *m == medium)
                .map(|&(hash, _)| (hash, 1))
                .collect();
            if !tier.is_empty() {
                self.withdrawn_copies(replica, &tier, medium);
            }
        }
    }

    /// The replica's engines report their events (the router holds a full copy of what they
    /// cache), even while they hold nothing: an index can tell an empty cache from one it
    /// hears nothing about.
    fn reporting(&self, _replica: &str) {}

    /// One more reference to each block.
    fn stored(&self, replica: &str, hashes: &[ExternalHash], medium: Medium) {
        for &hash in hashes {
            self.stored_copies(replica, &[(hash, 1)], medium);
        }
    }
    /// One reference fewer to each block.
    fn removed(&self, replica: &str, hashes: &[ExternalHash], medium: Medium) {
        for &hash in hashes {
            self.removed_copies(replica, &[(hash, 1)], medium);
        }
    }
}
