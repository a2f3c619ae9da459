//! The Gateway API Inference Extension's standard InferencePool gauges, beside `llmgw_*`, so
//! that GIE's dashboards and alerts read an llmgw picker as they read GIE's own:
//!
//! * `inference_pool_ready_pods{name}`: replicas whose last health check passed;
//! * `inference_pool_average_kv_cache_utilization{name}`: mean `vllm:kv_cache_usage_perc` (0–1);
//! * `inference_pool_average_queue_size{name}`: mean `vllm:num_requests_waiting`;
//! * `inference_pool_per_pod_queue_size{name, model_server_pod}`: each replica's waiting queue.
//!
//! `name` is the InferencePool's (`--pool-name`); they are exported only when the router names
//! its pool. A replica is a "pod" here: `model_server_pod` is its `host:port`, the name llmgw
//! knows it by. The averages are over ready replicas with a fresh scrape, and absent when there
//! is none (rather than a 0 that reads as an idle pool). Computed from the pool snapshot at
//! scrape time, like the per-replica gauges: nothing on the request path.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

use crate::pool::{Health, Pool};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolName {
    name: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodOfPool {
    name: String,
    model_server_pod: String,
}

#[derive(Debug)]
pub(super) struct InferencePoolCollector {
    pub(super) pool: Arc<Pool>,
    pub(super) name: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

impl Collector for InferencePoolCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let pool_name = PoolName {
            name: self.name.clone(),
        };
        let ready = Family::<PoolName, Gauge>::default();
        let average_kv = Family::<PoolName, FloatGauge>::default();
        let average_queue = Family::<PoolName, FloatGauge>::default();
        let per_pod_queue = Family::<PodOfPool, FloatGauge>::default();

        let snapshot = self.pool.snapshot();
        let now = Instant::now();
        let (mut ready_count, mut kv, mut queue) = (0i64, Mean::default(), Mean::default());
        for replica in snapshot.replicas() {
            if replica.health() != Health::Healthy {
                continue;
            }
            ready_count += 1;
            let Some(load) = replica.engine_load(now, self.pool.metrics_staleness()) else {
                continue;
            };
            if let Some(usage) = load.kv_cache_usage {
                kv.add(usage);
            }
            if let Some(waiting) = load.waiting {
                queue.add(waiting);
                per_pod_queue
                    .get_or_create(&PodOfPool {
                        name: self.name.clone(),
                        model_server_pod: replica.endpoint().to_string(),
                    })
                    .set(waiting);
            }
        }
        ready.get_or_create(&pool_name).set(ready_count);
        if let Some(mean) = kv.value() {
            average_kv.get_or_create(&pool_name).set(mean);
        }
        if let Some(mean) = queue.value() {
            average_queue.get_or_create(&pool_name).set(mean);
        }

        let families: [(&str, &str, &dyn EncodeMetric); 4] = [
            (
                "inference_pool_ready_pods",
                "The number of ready pods in the inference server pool",
                &ready,
            ),
            (
                "inference_pool_average_kv_cache_utilization",
                "The average kv cache utilization for an inference server pool",
                &average_kv,
            ),
            (
                "inference_pool_average_queue_size",
                "The average number of requests pending in the model server queue",
                &average_queue,
            ),
            (
                "inference_pool_per_pod_queue_size",
                "The total number of requests pending in the model server queue for each \
                 underlying pod",
                &per_pod_queue,
            ),
        ];
        for (name, help, family) in families {
            family.encode(encoder.encode_descriptor(name, help, None, family.metric_type())?)?;
        }
        Ok(())
    }
}

#[derive(Debug, Default)]
struct Mean {
    sum: f64,
    count: u32,
}

impl Mean {
    fn add(&mut self, value: f64) {
        self.sum += value;
        self.count += 1;
    }

    fn value(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / f64::from(self.count))
    }
}

/// GIE's request metrics (`inference_objective_*`), with GIE's names, labels and buckets.
/// `model_name` is the request's model and `target_model_name` the same (llmgw does not rewrite
/// models); a model no replica serves is counted as `unknown`, so request bodies cannot grow the
/// label set. Updated on the request path: atomics behind a family lookup.
#[derive(Debug, Clone)]
pub struct ObjectiveMetrics {
    requests: Family<ModelLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    duration: Family<ModelLabels, Histogram, fn() -> Histogram>,
    request_sizes: Family<ModelLabels, Histogram, fn() -> Histogram>,
    response_sizes: Family<ModelLabels, Histogram, fn() -> Histogram>,
    input_tokens: Family<ModelLabels, Histogram, fn() -> Histogram>,
    output_tokens: Family<ModelLabels, Histogram, fn() -> Histogram>,
    time_per_output_token: Family<ModelLabels, Histogram, fn() -> Histogram>,
    running: Family<RunningLabels, Gauge>,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model_name: String,
    target_model_name: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    model_name: String,
    target_model_name: String,
    error_code: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RunningLabels {
    model_name: String,
}

/// GIE's error codes (`pkg/epp/util/error`) for the statuses llmgw answers.
pub fn error_code(status: u16) -> &'static str {
    match status {
        400 | 404 | 413 | 422 => "BadRequest",
        429 => "InferencePoolResourceExhausted",
        503 => "ServiceUnavailable",
        500 => "Internal",
        _ => "Unknown",
    }
}

/// The upstream's answer was not a success: GIE counts it as `ModelServerError`.
pub const MODEL_SERVER_ERROR: &str = "ModelServerError";

fn duration_buckets() -> Histogram {
    Histogram::new([
        0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0,
        10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 180.0, 240.0, 300.0, 360.0, 480.0, 600.0, 900.0,
        1200.0, 1800.0, 2700.0, 3600.0,
    ])
}

/// 64 B … 1 GiB, doubling.
fn size_buckets() -> Histogram {
    Histogram::new([
        64.0,
        128.0,
        256.0,
        512.0,
        1024.0,
        2048.0,
        4096.0,
        8192.0,
        16384.0,
        32768.0,
        65536.0,
        131072.0,
        262144.0,
        524288.0,
        1048576.0,
        2097152.0,
        4194304.0,
        8388608.0,
        16777216.0,
        33554432.0,
        67108864.0,
        134217728.0,
        268435456.0,
        536870912.0,
        1073741824.0,
    ])
}

fn input_token_buckets() -> Histogram {
    Histogram::new([
        1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
        32778.0, 65536.0, 131072.0, 262144.0, 524288.0, 1048576.0,
    ])
}

fn output_token_buckets() -> Histogram {
    Histogram::new([
        1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
    ])
}

fn time_per_token_buckets() -> Histogram {
    Histogram::new([
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
    ])
}

/// One routed request of a model, counted in `inference_objective_running_requests` until
/// it is finished or dropped.
#[derive(Debug)]
pub struct RunningRequest {
    labels: ModelLabels,
    running: Gauge,
}

impl Drop for RunningRequest {
    fn drop(&mut self) {
        self.running.dec();
    }
}

/// What the response said, when the proxy showed it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Finished {
    pub elapsed: std::time::Duration,
    /// The upstream's status, when seen.
    pub status: Option<u16>,
    pub response_bytes: u64,
    /// `(prompt_tokens, completion_tokens)` from the response's usage.
    pub tokens: Option<(u64, u64)>,
}

impl Default for ObjectiveMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ObjectiveMetrics {
    pub fn new() -> ObjectiveMetrics {
        ObjectiveMetrics {
            requests: Family::default(),
            errors: Family::default(),
            duration: Family::new_with_constructor(duration_buckets),
            request_sizes: Family::new_with_constructor(size_buckets),
            response_sizes: Family::new_with_constructor(size_buckets),
            input_tokens: Family::new_with_constructor(input_token_buckets),
            output_tokens: Family::new_with_constructor(output_token_buckets),
            time_per_output_token: Family::new_with_constructor(time_per_token_buckets),
            running: Family::default(),
        }
    }

    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("inference_objective");
        r.register(
            "request",
            "Counter of inference objective requests broken out for each model and target model",
            self.requests.clone(),
        );
        r.register(
            "request_error",
            "Counter of inference objective requests errors broken out for each model and target model",
            self.errors.clone(),
        );
        r.register(
            "request_duration_seconds",
            "Inference objective response latency distribution in seconds for each model and target model",
            self.duration.clone(),
        );
        r.register(
            "request_sizes",
            "Inference objective requests size distribution in bytes for each model and target model",
            self.request_sizes.clone(),
        );
        r.register(
            "response_sizes",
            "Inference objective responses size distribution in bytes for each model and target model",
            self.response_sizes.clone(),
        );
        r.register(
            "input_tokens",
            "Inference objective input token count distribution for requests in each model",
            self.input_tokens.clone(),
        );
        r.register(
            "output_tokens",
            "Inference objective output token count distribution for requests in each model",
            self.output_tokens.clone(),
        );
        r.register(
            "normalized_time_per_output_token_seconds",
            "Inference objective latency divided by number of output tokens in seconds for each model and target model",
            self.time_per_output_token.clone(),
        );
        r.register(
            "running_requests",
            "Inference objective number of running requests in each model",
            self.running.clone(),
        );
    }

    fn labels(model: &str) -> ModelLabels {
        ModelLabels {
            model_name: model.to_owned(),
            target_model_name: model.to_owned(),
        }
    }

    /// A request for `model` with a body of `bytes`.
    pub fn request(&self, model: &str, bytes: usize) {
        let labels = Self::labels(model);
        self.requests.get_or_create(&labels).inc();
        self.request_sizes
            .get_or_create(&labels)
            .observe(bytes as f64);
    }

    pub fn error(&self, model: &str, code: &'static str) {
        let labels = ErrorLabels {
            model_name: model.to_owned(),
            target_model_name: model.to_owned(),
            error_code: code,
        };
        self.errors.get_or_create(&labels).inc();
    }

    /// A request of `model` was routed: it runs until [`ObjectiveMetrics::finish`].
    pub fn start(&self, model: &str) -> RunningRequest {
        let running = self
            .running
            .get_or_create(&RunningLabels {
                model_name: model.to_owned(),
            })
            .clone();
        running.inc();
        RunningRequest {
            labels: Self::labels(model),
            running,
        }
    }

    /// The routed request's exchange ended.
    pub fn finish(&self, request: RunningRequest, finished: Finished) {
        let labels = &request.labels;
        let seconds = finished.elapsed.as_secs_f64();
        self.duration.get_or_create(labels).observe(seconds);
        if finished.response_bytes > 0 {
            self.response_sizes
                .get_or_create(labels)
                .observe(finished.response_bytes as f64);
        }
        if finished.status.is_some_and(|s| !(200..300).contains(&s)) {
            self.error(&labels.model_name, MODEL_SERVER_ERROR);
        }
        if let Some((prompt, completion)) = finished.tokens {
            if prompt > 0 {
                self.input_tokens
                    .get_or_create(labels)
                    .observe(prompt as f64);
            }
            if completion > 0 {
                self.output_tokens
                    .get_or_create(labels)
                    .observe(completion as f64);
                self.time_per_output_token
                    .get_or_create(labels)
                    .observe(seconds / completion as f64);
            }
        }
    }
}
