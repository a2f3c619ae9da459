//! Gauges and counters read from the routing state when `/metrics` is read: the KV index's
//! size (per replica and distinct blocks), each replica's evictions and rebuilt blocks, and the
//! tokenizer's cache and call counters. Per-replica series are those of the pool's replicas
//! only: the index remembers every replica it has seen, and a fleet whose pods come and go
//! would otherwise add series for ever.
//!
//! Concurrency: encoding takes each structure's own short read locks and atomics; nothing on the
//! request path waits for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use crate::kvindex::KvIndex;
use crate::pool::Pool;
use crate::tokenize::Tokenizer;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplicaLabels {
    replica: String,
}

/// The index's and the tokenizer's state as metrics.
pub struct StateCollector {
    pub index: Arc<KvIndex>,
    pub tokenizer: Arc<Tokenizer>,
    /// Whose per-replica series are written.
    pub pool: Arc<Pool>,
}

impl std::fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StateCollector")
    }
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let pool = self.pool.snapshot();
        let per_replica = Family::<ReplicaLabels, Gauge>::default();
        for (replica, blocks) in self.index.replica_block_counts() {
            if pool.find(&replica).is_none() {
                continue;
            }
            per_replica
                .get_or_create(&ReplicaLabels { replica })
                .set(i64::try_from(blocks).unwrap_or(i64::MAX));
        }
        per_replica.encode(encoder.encode_descriptor(
            "llmgw_kv_index_replica_blocks",
            "Blocks the KV index believes each replica holds",
            None,
            per_replica.metric_type(),
        )?)?;
        let evicted = Family::<ReplicaLabels, Counter>::default();
        let rebuilt = Family::<ReplicaLabels, Counter>::default();
        for (replica, churn) in self.index.replica_churn() {
            if pool.find(&replica).is_none() {
                continue;
            }
            evicted
                .get_or_create(&ReplicaLabels {
                    replica: replica.clone(),
                })
                .inc_by(churn.evicted);
            rebuilt
                .get_or_create(&ReplicaLabels { replica })
                .inc_by(churn.rebuilt);
        }
        evicted.encode(encoder.encode_descriptor(
            "llmgw_kv_index_replica_evicted_blocks",
            "Blocks each replica's engine evicted (removed from every tier), from its KV events",
            None,
            evicted.metric_type(),
        )?)?;
        rebuilt.encode(encoder.encode_descriptor(
            "llmgw_kv_index_replica_rebuilt_blocks",
            "Blocks each replica's engine stored again soon after evicting them: a cache that \
             recomputes what it just dropped holds less than it is asked for",
            None,
            rebuilt.metric_type(),
        )?)?;
        let gauges: [(&str, &str, u64); 2] = [
            (
                "llmgw_kv_index_blocks",
                "Distinct block hashes in the KV index",
                self.index.distinct_blocks() as u64,
            ),
            (
                "llmgw_tokenize_cache_bytes",
                "Bytes held by the tokenization cache",
                self.tokenizer.cache_bytes() as u64,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = Gauge::<i64>::default();
            gauge.set(i64::try_from(value).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let stats = self.tokenizer.stats();
        let counters: [(&str, &str, &AtomicU64); 10] = [
            (
                "llmgw_tokenize_cache_hits",
                "Tokenizations answered from the cache",
                &stats.cache_hits,
            ),
            (
                "llmgw_tokenize_cache_misses",
                "Tokenizations not in the cache",
                &stats.cache_misses,
            ),
            ("llmgw_tokenize_calls", "/tokenize calls made", &stats.calls),
            (
                "llmgw_tokenize_call_errors",
                "/tokenize calls that failed",
                &stats.call_errors,
            ),
            (
                "llmgw_tokenize_timeouts",
                "Tokenizations that missed their deadline",
                &stats.timeouts,
            ),
            (
                "llmgw_tokenize_local",
                "Requests tokenized in process (tokenizer.json and chat template)",
                &stats.local,
            ),
            (
                "llmgw_tokenize_local_checks",
                "In-process tokenizations compared with a replica's /tokenize",
                &stats.local_checks,
            ),
            (
                "llmgw_tokenize_local_mismatches",
                "Comparisons that disagreed (each turns in-process tokenization off for its model and kind)",
                &stats.local_mismatches,
            ),
            (
                "llmgw_tokenize_shed",
                "Tokenizations not started because as many as allowed were running (the request fell back to the prefix tree)",
                &stats.shed,
            ),
            (
                "llmgw_tokenize_joined",
                "Cache misses that waited for a /tokenize call already running for the same body instead of making another",
                &stats.joined,
            ),
        ];
        for (name, help, value) in counters {
            let counter = Counter::<u64>::default();
            counter.inc_by(value.load(Ordering::Relaxed));
            counter.encode(encoder.encode_descriptor(
                name,
                help,
                None,
                counter.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::Duration;

    use prometheus_client::registry::Registry;

    use super::*;
    use crate::blockhash::ExternalHash;
    use crate::kvindex::{IndexConfig, KvEventSink, Medium};
    use crate::pool::ReplicaSpec;
    use crate::tokenize::TokenizerConfig;

    #[test]
    fn per_replica_series_are_the_pools_replicas_only() {
        let index = Arc::new(KvIndex::new(IndexConfig::default()));
        let (member, departed) = ("127.0.0.1:8001", "127.0.0.1:8002");
        for replica in [member, departed] {
            index.stored(replica, &[ExternalHash(1), ExternalHash(2)], Medium::Gpu);
            index.removed(replica, &[ExternalHash(2)], Medium::Gpu);
        }
        let pool = Arc::new(Pool::new(
            vec![ReplicaSpec {
                address: member.parse::<SocketAddr>().expect("address"),
                models: vec!["m".to_owned()],
                node: None,
            }],
            Duration::from_secs(60),
        ));
        let mut registry = Registry::default();
        registry.register_collector(Box::new(StateCollector {
            index,
            tokenizer: Arc::new(Tokenizer::new(TokenizerConfig::default())),
            pool,
        }));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        assert!(
            text.contains(&format!(
                "llmgw_kv_index_replica_blocks{{replica=\"{member}\"}} 1"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "llmgw_kv_index_replica_evicted_blocks_total{{replica=\"{member}\"}} 1"
            )),
            "{text}"
        );
        assert!(!text.contains(departed), "{text}");
        assert!(text.contains("llmgw_kv_index_blocks 1"), "{text}");
    }
}
