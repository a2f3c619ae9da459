//! The precise KV index: which replicas hold which blocks, as their engines reported them.
//!
//! Fed through [`KvEventSink`] (by the `feed` module from agents, or directly by tests); read
//! by the prefix scorer. The index knows nothing of gRPC, HTTP or ZMQ.

use crate::blockhash::ExternalHash;

/// Where a cached block lives on its replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    Gpu,
    Cpu,
    /// Disk, remote or any other tier vLLM names.
    Other,
}

impl Medium {
    /// vLLM's `medium` field: absent or "GPU" for device memory, "CPU" for offloaded blocks.
    pub fn from_vllm(medium: Option<&str>) -> Medium {
        match medium {
            None => Medium::Gpu,
            Some(m) if m.eq_ignore_ascii_case("gpu") => Medium::Gpu,
            Some(m) if m.eq_ignore_ascii_case("cpu") => Medium::Cpu,
            Some(_) => Medium::Other,
        }
    }
}

/// Net changes to one replica's cached blocks. `replica` is the `host:port` the router knows the
/// replica by; only full-attention groups are fed here.
pub trait KvEventSink: Send + Sync {
    /// Blocks now cached (each hash counts once per report: a hash stored twice needs two
    /// removes).
    fn stored(&self, replica: &str, hashes: &[ExternalHash], medium: Medium);
    /// Blocks no longer cached.
    fn removed(&self, replica: &str, hashes: &[ExternalHash], medium: Medium);
    /// Everything the replica held is gone (engine restart, cache reset, stream gap).
    fn cleared(&self, replica: &str);
}
