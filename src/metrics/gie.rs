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
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
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
