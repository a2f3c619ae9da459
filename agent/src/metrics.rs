//! Prometheus metrics of the agent, served as text on the admin port (`/metrics`).
//!
//! # Concurrency model
//! One [`Metrics`] per process, shared as `Arc`; every metric is a lock-free atomic
//! (prometheus-client families take a short read lock per label lookup). The registry is only
//! read when `/metrics` is scraped.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineLabel {
    pub engine: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabel {
    pub engine: String,
    pub r#type: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub engine: String,
    pub reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouterLabel {
    pub router: String,
}

/// Why an uplink session ended (see `UplinkError::reason`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UplinkErrorLabel {
    pub router: String,
    pub reason: &'static str,
}

/// How the set of engines changed (`added`, `removed`, `restarted`, `failed`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ChangeLabel {
    pub change: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabel {
    pub service: String,
}

fn latency_histogram() -> Histogram {
    // 0.5 ms … ~2 s.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.0005, 2.0, 13,
    ))
}

/// Every metric the agent exports.
pub struct Metrics {
    registry: Registry,
    pub events: Family<EventLabel, Counter>,
    pub batches: Family<EngineLabel, Counter>,
    pub gaps: Family<EngineLabel, Counter>,
    pub replays: Family<ReasonLabel, Counter>,
    pub resets: Family<ReasonLabel, Counter>,
    pub hash_mismatches: Family<EngineLabel, Counter>,
    pub decode_errors: Family<EngineLabel, Counter>,
    pub bad_messages: Family<EngineLabel, Counter>,
    pub unknown_removals: Family<EngineLabel, Counter>,
    pub mirror_blocks: Family<EngineLabel, Gauge>,
    pub engine_stale: Family<EngineLabel, Gauge>,
    pub uplink_connected: Family<RouterLabel, Gauge>,
    pub uplink_errors: Family<UplinkErrorLabel, Counter>,
    pub router_addresses: Family<ServiceLabel, Gauge>,
    pub engines: Gauge,
    pub engine_changes: Family<ChangeLabel, Counter>,
    pub engine_source_errors: Counter,
    pub event_to_flush: Family<EngineLabel, Histogram, fn() -> Histogram>,
    pub event_to_router: Family<RouterLabel, Histogram, fn() -> Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("llmgw_agent");
        let events = Family::<EventLabel, Counter>::default();
        let batches = Family::<EngineLabel, Counter>::default();
        let gaps = Family::<EngineLabel, Counter>::default();
        let replays = Family::<ReasonLabel, Counter>::default();
        let resets = Family::<ReasonLabel, Counter>::default();
        let hash_mismatches = Family::<EngineLabel, Counter>::default();
        let decode_errors = Family::<EngineLabel, Counter>::default();
        let bad_messages = Family::<EngineLabel, Counter>::default();
        let unknown_removals = Family::<EngineLabel, Counter>::default();
        let mirror_blocks = Family::<EngineLabel, Gauge>::default();
        let engine_stale = Family::<EngineLabel, Gauge>::default();
        let uplink_connected = Family::<RouterLabel, Gauge>::default();
        let uplink_errors = Family::<UplinkErrorLabel, Counter>::default();
        let router_addresses = Family::<ServiceLabel, Gauge>::default();
        let engines = Gauge::default();
        let engine_changes = Family::<ChangeLabel, Counter>::default();
        let engine_source_errors = Counter::default();
        let event_to_flush: Family<EngineLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        let event_to_router: Family<RouterLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "events",
            "KV events received, by engine and type (unknown types all count as \"unknown\")",
            events.clone(),
        );
        registry.register("batches", "KV event batches applied", batches.clone());
        registry.register(
            "gaps",
            "Sequence-number gaps seen on the live stream",
            gaps.clone(),
        );
        registry.register(
            "replays",
            "Replay requests by outcome (filled, loss, failed; at_start: the buffer replayed when the intake started)",
            replays.clone(),
        );
        registry.register("resets", "Engine resets by reason", resets.clone());
        registry.register(
            "hash_mismatches",
            "Block-0 hashes that differ from the configured algo and seed",
            hash_mismatches.clone(),
        );
        registry.register(
            "decode_errors",
            "Payloads that failed to decode",
            decode_errors.clone(),
        );
        registry.register(
            "bad_messages",
            "ZMQ messages without 3 frames or an 8-byte sequence number",
            bad_messages.clone(),
        );
        registry.register(
            "unknown_removals",
            "BlockRemoved for blocks the mirror did not hold",
            unknown_removals.clone(),
        );
        registry.register(
            "mirror_blocks",
            "Distinct blocks mirrored per engine",
            mirror_blocks.clone(),
        );
        registry.register(
            "engine_stale",
            "1 while an engine is silent and its /health fails",
            engine_stale.clone(),
        );
        registry.register(
            "uplink_connected",
            "1 while the feed stream to a router is up",
            uplink_connected.clone(),
        );
        registry.register(
            "uplink_errors",
            "Uplink sessions ended by an error, by router and reason (connect, tls, a gRPC status \
             such as unauthenticated or permission_denied, closed...)",
            uplink_errors.clone(),
        );
        registry.register(
            "router_addresses",
            "Router addresses a --router-service name resolved to last",
            router_addresses.clone(),
        );
        registry.register("engines", "Engines mirrored now", engines.clone());
        registry.register(
            "engine_changes",
            "Engines added, removed, restarted (settings changed) or failed to start, as the \
             reloaded --config file or the pods on the node changed",
            engine_changes.clone(),
        );
        registry.register(
            "engine_source_errors",
            "Reloads of the --config file that could not be used, and failed lists or watches \
             of the node's pods (the last good engines stay)",
            engine_source_errors.clone(),
        );
        registry.register(
            "event_to_flush_seconds",
            "Engine publish time to the delta leaving the coalescing window",
            event_to_flush.clone(),
        );
        registry.register(
            "event_to_router_seconds",
            "Engine publish time to the router acknowledging the delta",
            event_to_router.clone(),
        );
        Metrics {
            registry,
            events,
            batches,
            gaps,
            replays,
            resets,
            hash_mismatches,
            decode_errors,
            bad_messages,
            unknown_removals,
            mirror_blocks,
            engine_stale,
            uplink_connected,
            uplink_errors,
            router_addresses,
            engines,
            engine_changes,
            engine_source_errors,
            event_to_flush,
            event_to_router,
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    pub fn engine(engine: &str) -> EngineLabel {
        EngineLabel {
            engine: engine.to_owned(),
        }
    }

    /// Drops a removed engine's gauges, so it no longer reads as holding blocks or stale (its
    /// counters stay: they only stop rising).
    pub fn forget_engine(&self, engine: &str) {
        let label = Metrics::engine(engine);
        self.mirror_blocks.remove(&label);
        self.engine_stale.remove(&label);
    }

    pub fn reason(engine: &str, reason: &str) -> ReasonLabel {
        ReasonLabel {
            engine: engine.to_owned(),
            reason: reason.to_owned(),
        }
    }
}
