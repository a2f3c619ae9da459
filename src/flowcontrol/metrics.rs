//! Flow control's metrics: GIE's names for the queue and the wait, beside llmgw's counts.
//!
//! * `inference_extension_flow_control_queue_size{fairness_id, priority, inference_pool,
//!   model_name, target_model_name}`: requests waiting now;
//! * `inference_extension_flow_control_request_queue_duration_seconds{…, outcome}`: the time
//!   from arrival to the outcome (`Dispatched`, `RejectedCapacity`, `EvictedTTL`,
//!   `EvictedContextCancelled`), 0 for a request that found capacity at once;
//! * `llmgw_flow_control_requests_total{outcome, priority}`: `admitted` (never waited),
//!   `dispatched` (after waiting), `queue_full`, `displaced`, `expired`, `cancelled`;
//! * `llmgw_flow_control_bad_requests_total{reason}`: `unknown_objective`, `fairness_id`,
//!   `queue_timeout` (a malformed header).
//!
//! Tenants are client-chosen, so `fairness_id` names only the first [`MAX_TENANT_LABELS`]
//! seen; later ones share `other`.

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Distinct `fairness_id` label values before the rest read `other`.
pub const MAX_TENANT_LABELS: usize = 64;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    fairness_id: String,
    priority: String,
    inference_pool: String,
    model_name: String,
    target_model_name: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DurationLabels {
    fairness_id: String,
    priority: String,
    outcome: &'static str,
    inference_pool: String,
    model_name: String,
    target_model_name: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
    priority: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// How a request left flow control.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowOutcome {
    Admitted,
    Dispatched,
    QueueFull,
    Displaced,
    Expired,
    Cancelled,
}

impl FlowOutcome {
    fn llmgw(self) -> &'static str {
        match self {
            FlowOutcome::Admitted => "admitted",
            FlowOutcome::Dispatched => "dispatched",
            FlowOutcome::QueueFull => "queue_full",
            FlowOutcome::Displaced => "displaced",
            FlowOutcome::Expired => "expired",
            FlowOutcome::Cancelled => "cancelled",
        }
    }

    fn gie(self) -> &'static str {
        match self {
            FlowOutcome::Admitted | FlowOutcome::Dispatched => "Dispatched",
            FlowOutcome::QueueFull | FlowOutcome::Displaced => "RejectedCapacity",
            FlowOutcome::Expired => "EvictedTTL",
            FlowOutcome::Cancelled => "EvictedContextCancelled",
        }
    }
}

/// Which label values a flow carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct FlowLabels {
    pub fairness_id: String,
    pub priority: String,
    pub model_name: String,
}

fn queue_duration_buckets() -> Histogram {
    Histogram::new([
        0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        60.0,
    ])
}

#[derive(Debug)]
pub struct FlowMetrics {
    pool_name: String,
    queue_size: Family<QueueLabels, Gauge>,
    queue_duration: Family<DurationLabels, Histogram>,
    requests: Family<OutcomeLabels, Counter>,
    bad_requests: Family<ReasonLabels, Counter>,
    tenants: Mutex<HashSet<Arc<str>>>,
}

impl FlowMetrics {
    /// Registered in `registry`; `pool_name` is the InferencePool's (empty if none).
    pub fn new(registry: &mut Registry, pool_name: &str) -> FlowMetrics {
        let metrics = FlowMetrics::unregistered(pool_name);
        registry.register(
            "inference_extension_flow_control_queue_size",
            "Requests waiting in flow control's queue now",
            metrics.queue_size.clone(),
        );
        registry.register(
            "inference_extension_flow_control_request_queue_duration_seconds",
            "Time from a request's arrival in flow control to its outcome",
            metrics.queue_duration.clone(),
        );
        registry.register(
            "llmgw_flow_control_requests",
            "Requests through flow control by outcome and priority",
            metrics.requests.clone(),
        );
        registry.register(
            "llmgw_flow_control_bad_requests",
            "Requests refused for a malformed flow control header or an unknown objective",
            metrics.bad_requests.clone(),
        );
        metrics
    }

    pub fn unregistered(pool_name: &str) -> FlowMetrics {
        FlowMetrics {
            pool_name: pool_name.to_owned(),
            queue_size: Family::default(),
            queue_duration: Family::new_with_constructor(queue_duration_buckets),
            requests: Family::default(),
            bad_requests: Family::default(),
            tenants: Mutex::new(HashSet::new()),
        }
    }

    /// The `fairness_id` label of `tenant`.
    pub(super) fn tenant_label(&self, tenant: &Arc<str>) -> String {
        let mut seen = self.tenants.lock();
        if seen.contains(tenant) || seen.len() < MAX_TENANT_LABELS {
            seen.insert(Arc::clone(tenant));
            tenant.to_string()
        } else {
            "other".to_owned()
        }
    }

    fn queue_labels(&self, flow: &FlowLabels) -> QueueLabels {
        QueueLabels {
            fairness_id: flow.fairness_id.clone(),
            priority: flow.priority.clone(),
            inference_pool: self.pool_name.clone(),
            model_name: flow.model_name.clone(),
            target_model_name: flow.model_name.clone(),
        }
    }

    pub(super) fn queued(&self, flow: &FlowLabels) {
        self.queue_size
            .get_or_create(&self.queue_labels(flow))
            .inc();
    }

    pub(super) fn left_queue(&self, flow: &FlowLabels) {
        self.queue_size
            .get_or_create(&self.queue_labels(flow))
            .dec();
    }

    pub(super) fn outcome(&self, flow: &FlowLabels, outcome: FlowOutcome, waited: f64) {
        self.queue_duration
            .get_or_create(&DurationLabels {
                fairness_id: flow.fairness_id.clone(),
                priority: flow.priority.clone(),
                outcome: outcome.gie(),
                inference_pool: self.pool_name.clone(),
                model_name: flow.model_name.clone(),
                target_model_name: flow.model_name.clone(),
            })
            .observe(waited);
        self.requests
            .get_or_create(&OutcomeLabels {
                outcome: outcome.llmgw(),
                priority: flow.priority.clone(),
            })
            .inc();
    }

    pub(super) fn bad_request(&self, reason: &'static str) {
        self.bad_requests
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Requests counted with `outcome` at `priority`, for tests and the bench.
    pub fn count(&self, outcome: FlowOutcome, priority: i32) -> u64 {
        self.requests
            .get_or_create(&OutcomeLabels {
                outcome: outcome.llmgw(),
                priority: priority.to_string(),
            })
            .get()
    }

    /// Bad requests counted for `reason`.
    pub fn bad_requests(&self, reason: &'static str) -> u64 {
        self.bad_requests
            .get_or_create(&ReasonLabels { reason })
            .get()
    }
}
