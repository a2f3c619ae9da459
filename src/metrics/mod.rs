//! Prometheus metrics, all prefixed `llmgw_`.
//!
//! * `llmgw_decisions_total{outcome}`: every routing decision by outcome ([`Outcome`]).
//! * `llmgw_pick_duration_seconds`: time from a complete request to the routing answer (parse +
//!   filters + scorers + picker).
//! * `llmgw_pick_cpu_seconds`: the CPU time of that decision (its own polls, plus tokenization
//!   done for it on the blocking pool; [`crate::cputime`]), so waiting and preemption by other
//!   work are not counted.
//! * `llmgw_imbalance_guard_total`, `llmgw_prefix_unavailable_total`.
//! * `llmgw_filtered_out_total{filter}`: ready replicas a profile filter took out of a routed
//!   decision's candidates (`saturation` dropping a request's home, say); the route span's
//!   `filtered_out` field names them.
//! * Read from the index and tokenizer at scrape time ([`state`]): `llmgw_kv_index_*`,
//!   `llmgw_tokenize_*`. The scheduler's plugins register their own (`llmgw_kv_decisions_total`,
//!   `llmgw_prefix_decisions_total`, `llmgw_prefix_tree_nodes`, ...).
//! * Per replica, read from the pool at scrape time: `llmgw_replica_in_flight`,
//!   `llmgw_replica_healthy`, and, while the last scrape is fresh, `llmgw_replica_waiting`,
//!   `llmgw_replica_running`, `llmgw_replica_kv_cache_usage`; the self-check of the precise
//!   tier ([`crate::pool::drift`]): `llmgw_expected_cached_tokens_total` of
//!   `llmgw_routed_prompt_tokens_total` against the engine's `llmgw_observed_cached_tokens_total`
//!   of `llmgw_observed_prompt_tokens_total` (scraped) and `llmgw_reported_cached_tokens_total`
//!   of `llmgw_reported_prompt_tokens_total` (the responses' usage), and
//!   `llmgw_cache_drift_ratio` once judged.
//! * With a named InferencePool, GIE's standard pool gauges (`inference_pool_*`, see the `gie`
//!   module).
//! * GIE's request metrics (`inference_objective_*`, see [`ObjectiveMetrics`]): requests, errors
//!   by GIE's error code, duration, request and response sizes, token counts from the
//!   response's usage (when the proxy sends the response body), running requests.
//!
//! # Concurrency model
//! Counters and the histogram are atomics updated from every stream; the per-replica gauges are
//! computed from a lock-free pool snapshot when `/metrics` is read, so the request path never
//! touches them. The registry itself is only read (encoded) after start-up.

mod gie;
pub mod state;

pub use gie::{Finished, ObjectiveMetrics, RunningRequest, error_code};

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use tokio::time::Instant;

use crate::pool::{Health, Pool};

/// How a routing decision ended.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Outcome {
    /// A completion routed by the scheduler.
    Routed,
    /// A non-completion request (e.g. `GET /v1/models`) sent to any ready replica.
    RoutedAny,
    /// Steered by `test-epp-endpoint-selection` (only when allowed).
    RoutedTestSelection,
    BadRequest,
    UnknownModel,
    BodyTooLarge,
    NoReadyReplica,
    Saturated,
}

impl Outcome {
    /// Every outcome, in the order of `Outcome::index`.
    pub const ALL: [Outcome; 8] = [
        Outcome::Routed,
        Outcome::RoutedAny,
        Outcome::RoutedTestSelection,
        Outcome::BadRequest,
        Outcome::UnknownModel,
        Outcome::BodyTooLarge,
        Outcome::NoReadyReplica,
        Outcome::Saturated,
    ];

    /// This outcome's position in [`Outcome::ALL`].
    fn index(self) -> usize {
        self as usize
    }

    /// The `outcome` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Routed => "routed",
            Outcome::RoutedAny => "routed_any",
            Outcome::RoutedTestSelection => "routed_test_selection",
            Outcome::BadRequest => "bad_request",
            Outcome::UnknownModel => "unknown_model",
            Outcome::BodyTooLarge => "body_too_large",
            Outcome::NoReadyReplica => "no_ready_replica",
            Outcome::Saturated => "saturated",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// A profile filter's name (from the configuration: a bounded set).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FilterLabels {
    filter: Arc<str>,
}

/// How the endpoint the proxy reports as having served a request compares with the pick.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Served {
    /// The picked replica served it.
    Picked,
    /// Another replica of the pool served it (a fallback after the pick failed).
    OtherReplica,
    /// An endpoint the pool does not know served it.
    Unknown,
}

impl Served {
    const ALL: [Served; 3] = [Served::Picked, Served::OtherReplica, Served::Unknown];

    fn as_str(self) -> &'static str {
        match self {
            Served::Picked => "picked",
            Served::OtherReplica => "other_replica",
            Served::Unknown => "unknown",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool_name: String,
    pool_namespace: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServedLabels {
    served_by: &'static str,
}

/// The router's metrics and their registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// One counter per [`Outcome`] (by [`Outcome::index`]), each a member of the
    /// `llmgw_decisions` family, made at start-up so that counting is one atomic add (no label
    /// hashing or lock on the request path) and every outcome is exported from the start.
    decisions: [Counter; Outcome::ALL.len()],
    pick_duration: Histogram,
    pick_cpu: Histogram,
    imbalance_guard: Counter,
    prefix_unavailable: Counter,
    filtered_out: Family<FilterLabels, Counter>,
    /// `llmgw_served_reports` by [`Served`], made at start-up like `decisions`.
    served: [Counter; Served::ALL.len()],
    /// GIE's `inference_objective_*` request metrics.
    objective: ObjectiveMetrics,
    /// Read at scrape time by the collectors.
    pool: Arc<Pool>,
}

impl Metrics {
    /// Registers everything, including per-replica gauges read from `pool`.
    pub fn new(pool: Arc<Pool>) -> Metrics {
        let mut registry = Registry::default();
        let decisions = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "llmgw_decisions",
            "Routing decisions by outcome",
            decisions.clone(),
        );
        let decisions = Outcome::ALL.map(|outcome| {
            decisions
                .get_or_create(&OutcomeLabels {
                    outcome: outcome.as_str(),
                })
                .clone()
        });
        // 10 µs … ~0.33 s.
        let pick_duration = Histogram::new(exponential_buckets(10e-6, 2.0, 16));
        registry.register(
            "llmgw_pick_duration_seconds",
            "Time from a complete request to the routing answer",
            pick_duration.clone(),
        );
        // 1 µs … ~0.5 s.
        let pick_cpu = Histogram::new(exponential_buckets(1e-6, 2.0, 20));
        registry.register(
            "llmgw_pick_cpu_seconds",
            "CPU time of a routing decision (its polls and the tokenization it offloaded)",
            pick_cpu.clone(),
        );
        let imbalance_guard = Counter::default();
        registry.register(
            "llmgw_imbalance_guard",
            "Decisions where load imbalance overruled affinity scorers",
            imbalance_guard.clone(),
        );
        let prefix_unavailable = Counter::default();
        registry.register(
            "llmgw_prefix_unavailable",
            "Decisions made on load alone because the prefix scorer failed",
            prefix_unavailable.clone(),
        );
        let filtered_out = Family::<FilterLabels, Counter>::default();
        registry.register(
            "llmgw_filtered_out",
            "Ready replicas a profile filter took out of a routed decision's candidates",
            filtered_out.clone(),
        );
        let served = Family::<ServedLabels, Counter>::default();
        registry.register(
            "llmgw_served_reports",
            "Served-endpoint reports from the proxy, by how they compare with the pick",
            served.clone(),
        );
        let served = Served::ALL.map(|s| {
            served
                .get_or_create(&ServedLabels {
                    served_by: s.as_str(),
                })
                .clone()
        });
        registry.register_collector(Box::new(ReplicaCollector {
            pool: Arc::clone(&pool),
        }));
        let objective = ObjectiveMetrics::new();
        objective.register(&mut registry);
        Metrics {
            registry,
            decisions,
            pick_duration,
            pick_cpu,
            imbalance_guard,
            prefix_unavailable,
            filtered_out,
            served,
            objective,
            pool,
        }
    }

    /// GIE's request metrics.
    pub fn objective(&self) -> &ObjectiveMetrics {
        &self.objective
    }

    /// The `model_name` a request's model is counted under: itself when some replica serves
    /// it, else `unknown` (request bodies must not grow the label set).
    pub fn model_label<'a>(&self, model: &'a str) -> &'a str {
        if self.pool.snapshot().serves_model(model) {
            model
        } else {
            "unknown"
        }
    }

    /// The registry, for other modules to register their metrics before the server starts.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    pub fn record(&self, outcome: Outcome) {
        self.decisions[outcome.index()].inc();
    }

    /// One decision: its wall-clock time since `started`, and the CPU time it used.
    pub fn observe_pick(&self, started: Instant, cpu: std::time::Duration) {
        self.pick_duration.observe(started.elapsed().as_secs_f64());
        self.pick_cpu.observe(cpu.as_secs_f64());
    }

    pub fn imbalance_guard_fired(&self) {
        self.imbalance_guard.inc();
    }

    pub fn prefix_unavailable(&self) {
        self.prefix_unavailable.inc();
    }

    /// A filter took a ready replica out of a routed decision's candidates.
    pub fn filtered_out(&self, filter: &Arc<str>) {
        self.filtered_out
            .get_or_create(&FilterLabels {
                filter: Arc::clone(filter),
            })
            .inc();
    }

    /// `llmgw_pool_info{pool_name, pool_namespace} 1`: which InferencePool this router serves;
    /// and GIE's `inference_pool_*` gauges for it.
    pub fn pool_info(&mut self, name: &str, namespace: &str) {
        let info = Family::<PoolLabels, Gauge>::default();
        info.get_or_create(&PoolLabels {
            pool_name: name.to_owned(),
            pool_namespace: namespace.to_owned(),
        })
        .set(1);
        self.registry.register(
            "llmgw_pool_info",
            "The InferencePool this router is the endpoint picker of",
            info,
        );
        self.registry
            .register_collector(Box::new(gie::InferencePoolCollector {
                pool: Arc::clone(&self.pool),
                name: name.to_owned(),
            }));
    }

    pub fn served(&self, served: Served) {
        self.served[served as usize].inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplicaLabels {
    replica: String,
}

/// Per-replica gauges computed from the pool at scrape time.
#[derive(Debug)]
struct ReplicaCollector {
    pool: Arc<Pool>,
}

impl Collector for ReplicaCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let in_flight = Family::<ReplicaLabels, Gauge>::default();
        let healthy = Family::<ReplicaLabels, Gauge>::default();
        let waiting = Family::<ReplicaLabels, Gauge<f64, AtomicU64>>::default();
        let running = Family::<ReplicaLabels, Gauge<f64, AtomicU64>>::default();
        let kv_usage = Family::<ReplicaLabels, Gauge<f64, AtomicU64>>::default();
        let expected_hits = Family::<ReplicaLabels, Counter>::default();
        let routed_tokens = Family::<ReplicaLabels, Counter>::default();
        let observed_hits = Family::<ReplicaLabels, Counter>::default();
        let observed_queries = Family::<ReplicaLabels, Counter>::default();
        let reported_hits = Family::<ReplicaLabels, Counter>::default();
        let reported_tokens = Family::<ReplicaLabels, Counter>::default();
        let drift = Family::<ReplicaLabels, Gauge<f64, AtomicU64>>::default();
        let snapshot = self.pool.snapshot();
        let now = Instant::now();
        for replica in snapshot.replicas() {
            let labels = ReplicaLabels {
                replica: replica.endpoint().to_string(),
            };
            in_flight
                .get_or_create(&labels)
                .set(i64::from(replica.in_flight()));
            healthy
                .get_or_create(&labels)
                .set(i64::from(replica.health() == Health::Healthy));
            if let Some(load) = replica.engine_load(now, self.pool.metrics_staleness()) {
                if let Some(v) = load.waiting {
                    waiting.get_or_create(&labels).set(v);
                }
                if let Some(v) = load.running {
                    running.get_or_create(&labels).set(v);
                }
                if let Some(v) = load.kv_cache_usage {
                    kv_usage.get_or_create(&labels).set(v);
                }
            }
            let view = replica.drift().view();
            for (family, tokens) in [
                (&expected_hits, view.expected_hits),
                (&routed_tokens, view.routed_tokens),
                (&observed_hits, view.observed_hits),
                (&observed_queries, view.observed_queries),
                (&reported_hits, view.reported_hits),
                (&reported_tokens, view.reported_tokens),
            ] {
                family.get_or_create(&labels).inc_by(tokens);
            }
            if let Some(v) = view.drift {
                drift.get_or_create(&labels).set(v);
            }
        }
        let families: [(&str, &str, &dyn EncodeMetric); 12] = [
            (
                "llmgw_replica_in_flight",
                "Requests llmgw has in flight to the replica",
                &in_flight,
            ),
            (
                "llmgw_replica_healthy",
                "1 when the replica's last health check passed",
                &healthy,
            ),
            (
                "llmgw_replica_waiting",
                "vllm:num_requests_waiting from a fresh scrape",
                &waiting,
            ),
            (
                "llmgw_replica_running",
                "vllm:num_requests_running from a fresh scrape",
                &running,
            ),
            (
                "llmgw_replica_kv_cache_usage",
                "vllm:kv_cache_usage_perc from a fresh scrape",
                &kv_usage,
            ),
            (
                "llmgw_expected_cached_tokens",
                "Prompt tokens the precise tier expected the replica to find in its prefix cache",
                &expected_hits,
            ),
            (
                "llmgw_routed_prompt_tokens",
                "Prompt tokens of the requests the precise tier sent to the replica",
                &routed_tokens,
            ),
            (
                "llmgw_observed_cached_tokens",
                "Prompt tokens the engine found cached (increases of \
                 vllm:prefix_cache_hits_total)",
                &observed_hits,
            ),
            (
                "llmgw_observed_prompt_tokens",
                "Prompt tokens the engine looked up (increases of \
                 vllm:prefix_cache_queries_total)",
                &observed_queries,
            ),
            (
                "llmgw_reported_cached_tokens",
                "Prompt tokens the engine found cached, as its responses' \
                 usage.prompt_tokens_details.cached_tokens said (responses llmgw saw)",
                &reported_hits,
            ),
            (
                "llmgw_reported_prompt_tokens",
                "Prompt tokens of the responses that said how many were cached",
                &reported_tokens,
            ),
            (
                "llmgw_cache_drift_ratio",
                "Disagreement of expected and engine-observed prefix-cache hit rates over the \
                 last minute (the responses' where enough were seen, else the scraped): \
                 |o - e| / max(o, e), 0 agreeing, 1 when one is 0",
                &drift,
            ),
        ];
        for (name, help, family) in families {
            family.encode(encoder.encode_descriptor(name, help, None, family.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::Duration;

    use super::*;
    use crate::pool::{EngineLoad, ReplicaSpec};

    #[test]
    fn exposition_has_decisions_latency_and_replica_load() {
        let pool = Arc::new(Pool::new(
            vec![ReplicaSpec {
                address: SocketAddr::from(([127, 0, 0, 1], 8001)),
                models: vec!["m".to_string()],
                node: None,
            }],
            Duration::from_secs(60),
        ));
        let replica = Arc::clone(&pool.snapshot().replicas()[0]);
        replica.set_health(Health::Healthy);
        replica.record_scrape(
            EngineLoad {
                waiting: Some(3.0),
                running: None,
                kv_cache_usage: Some(0.5),
            },
            Instant::now(),
        );
        let _guard = replica.start_request();
        // The precise tier expected half of 4096 tokens cached, over enough picks to judge; the
        // engine found none.
        let totals = |hits, queries| crate::pool::vllm_metrics::CacheTotals { hits, queries };
        let t0 = Instant::now();
        replica.drift().observe("r", totals(10.0, 20.0), t0);
        let picks = crate::pool::drift::MIN_JUDGED_PICKS;
        for _ in 0..picks {
            replica.drift().expect(2048 / picks, 4096 / picks);
        }
        replica.drift().reported(30, 40);
        replica
            .drift()
            .observe("r", totals(10.0, 4116.0), t0 + Duration::from_secs(1));
        let metrics = Metrics::new(Arc::clone(&pool));
        metrics.record(Outcome::Routed);
        metrics.record(Outcome::Saturated);
        metrics.observe_pick(Instant::now(), Duration::from_micros(12));
        let text = metrics.encode().unwrap();
        for expected in [
            "llmgw_decisions_total{outcome=\"routed\"} 1",
            "llmgw_decisions_total{outcome=\"saturated\"} 1",
            "llmgw_pick_duration_seconds_count 1",
            "llmgw_pick_cpu_seconds_sum 0.000012",
            "llmgw_pick_cpu_seconds_count 1",
            "llmgw_replica_in_flight{replica=\"127.0.0.1:8001\"} 1",
            "llmgw_replica_healthy{replica=\"127.0.0.1:8001\"} 1",
            "llmgw_replica_waiting{replica=\"127.0.0.1:8001\"} 3.0",
            "llmgw_replica_kv_cache_usage{replica=\"127.0.0.1:8001\"} 0.5",
            "llmgw_expected_cached_tokens_total{replica=\"127.0.0.1:8001\"} 2048",
            "llmgw_reported_cached_tokens_total{replica=\"127.0.0.1:8001\"} 30",
            "llmgw_reported_prompt_tokens_total{replica=\"127.0.0.1:8001\"} 40",
            "llmgw_routed_prompt_tokens_total{replica=\"127.0.0.1:8001\"} 4096",
            "llmgw_observed_cached_tokens_total{replica=\"127.0.0.1:8001\"} 0",
            "llmgw_observed_prompt_tokens_total{replica=\"127.0.0.1:8001\"} 4096",
            "llmgw_cache_drift_ratio{replica=\"127.0.0.1:8001\"} 1.0",
        ] {
            assert!(text.contains(expected), "missing {expected:?} in\n{text}");
        }
        assert!(!text.contains("llmgw_replica_running{"));
    }

    #[test]
    fn a_named_pool_exports_gies_pool_gauges_over_ready_replicas() {
        let spec = |port| ReplicaSpec {
            address: SocketAddr::from(([127, 0, 0, 1], port)),
            models: vec!["m".to_string()],
            node: None,
        };
        let pool = Arc::new(Pool::new(
            vec![spec(8001), spec(8002), spec(8003)],
            Duration::from_secs(60),
        ));
        let replicas = pool.snapshot().replicas().to_vec();
        for (replica, (waiting, kv)) in replicas.iter().zip([(4.0, 0.2), (2.0, 0.6), (9.0, 0.9)]) {
            replica.record_scrape(
                EngineLoad {
                    waiting: Some(waiting),
                    running: Some(1.0),
                    kv_cache_usage: Some(kv),
                },
                Instant::now(),
            );
        }
        // The third replica fails its health checks: not ready, not averaged.
        replicas[0].set_health(Health::Healthy);
        replicas[1].set_health(Health::Healthy);
        replicas[2].set_health(Health::Unhealthy);

        let mut metrics = Metrics::new(Arc::clone(&pool));
        assert!(
            !metrics.encode().unwrap().contains("inference_pool_"),
            "no pool named, no pool gauges"
        );
        metrics.pool_info("chat", "llm");
        let text = metrics.encode().unwrap();
        for expected in [
            "inference_pool_ready_pods{name=\"chat\"} 2",
            "inference_pool_average_kv_cache_utilization{name=\"chat\"} 0.4",
            "inference_pool_average_queue_size{name=\"chat\"} 3.0",
            "inference_pool_per_pod_queue_size{name=\"chat\",model_server_pod=\"127.0.0.1:8001\"} 4.0",
            "inference_pool_per_pod_queue_size{name=\"chat\",model_server_pod=\"127.0.0.1:8002\"} 2.0",
        ] {
            assert!(text.contains(expected), "missing {expected:?} in\n{text}");
        }
        assert!(
            !text.contains("model_server_pod=\"127.0.0.1:8003\""),
            "{text}"
        );

        // No fresh scrape anywhere: no averages rather than zeros.
        let idle = Arc::new(Pool::new(vec![spec(8004)], Duration::from_secs(60)));
        idle.snapshot().replicas()[0].set_health(Health::Healthy);
        let mut metrics = Metrics::new(idle);
        metrics.pool_info("chat", "");
        let text = metrics.encode().unwrap();
        assert!(
            text.contains("inference_pool_ready_pods{name=\"chat\"} 1"),
            "{text}"
        );
        assert!(
            !text.contains("inference_pool_average_queue_size{"),
            "{text}"
        );
    }

    #[test]
    fn every_outcome_is_exported_and_counted_under_its_own_label() {
        let pool = Arc::new(Pool::new(Vec::new(), Duration::from_secs(60)));
        let metrics = Metrics::new(pool);
        for (i, outcome) in Outcome::ALL.into_iter().enumerate() {
            assert_eq!(outcome.index(), i);
            for _ in 0..=i {
                metrics.record(outcome);
            }
        }
        let text = metrics.encode().unwrap();
        for (i, outcome) in Outcome::ALL.into_iter().enumerate() {
            let line = format!(
                "llmgw_decisions_total{{outcome=\"{}\"}} {}",
                outcome.as_str(),
                i + 1
            );
            assert!(text.contains(&line), "missing {line:?} in\n{text}");
        }
    }
}
