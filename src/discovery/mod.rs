//! Replicas from Kubernetes, watched (list, then watch from the list's resourceVersion; relist
//! on 410 Gone; bookmarks keep a quiet watch's resourceVersion fresh), never polled:
//! - [`inference_pool`]: with `--pool-name`, the InferencePool's pods. Each Ready pod's IP at
//!   each of the pool's `targetPorts` is a replica, on the pod's node.
//! - [`endpoint_slices`]: `--k8s-service MODEL=NAMESPACE/SERVICE:PORT`, the ready endpoints of a
//!   Service's EndpointSlices (the Istio and standalone path).
//! - [`inference_objective`]: with `--pool-name`, the pool's InferenceObjectives, as flow
//!   control's priorities (not replicas).
//!
//! Each replica carries its node, so the agent feed's ownership check follows pods as they move.
//!
//! # Concurrency model
//! One task per source drives kube's watcher streams and keeps their objects in a reflector
//! store; after each change it recomputes the source's replicas and hands them to
//! [`ReplicaSources`](crate::pool::ReplicaSources), which publishes the union to the pool.
//! Nothing else shares that state.
//! A failed list or watch keeps the source's last replicas (the API server being briefly
//! unreachable must not empty the pool) and is retried with kube's default backoff.

pub mod endpoint_slices;
pub mod inference_objective;
pub mod inference_pool;

#[cfg(any(test, feature = "fake-kube-api"))]
pub mod fake_api;

use std::path::PathBuf;

use llmgw_core::kube_client::KubeClientError;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use thiserror::Error;

pub use endpoint_slices::K8sService;
pub use inference_pool::{ModelSource, PoolRef};

#[derive(Debug, Error)]
pub enum DiscoveryError {
    #[error("invalid Kubernetes service {0:?}: expected MODEL=NAMESPACE/SERVICE:PORT")]
    Spec(String),
    #[error(transparent)]
    Client(#[from] KubeClientError),
}

/// Discovery's options: flags (and `LLMGW_*` variables) with the same names as the
/// configuration file's keys.
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
#[serde(default)]
pub struct DiscoveryOptions {
    /// Replicas from a Kubernetes Service, repeatable: MODEL=NAMESPACE/SERVICE:PORT. The ready
    /// endpoints of the Service's EndpointSlices, at the pods' vLLM PORT, with their nodes;
    /// needs RBAC to get, list and watch endpointslices (discovery.k8s.io) in NAMESPACE.
    #[arg(
        long = "k8s-service",
        env = "LLMGW_K8S_SERVICES",
        value_delimiter = ','
    )]
    pub k8s_services: Vec<K8sService>,
    /// The Kubernetes client's configuration file (default: in-cluster, else $KUBECONFIG or
    /// ~/.kube/config).
    #[arg(long, env = "LLMGW_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

/// Where replicas are discovered.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DiscoverySettings {
    /// The file's Services, then the flags'.
    pub services: Vec<K8sService>,
    pub kubeconfig: Option<PathBuf>,
}

impl DiscoveryOptions {
    /// These options (the flags) after `file`'s services; the flag's kubeconfig over the file's.
    pub fn resolve(&self, file: &DiscoveryOptions) -> DiscoverySettings {
        DiscoverySettings {
            services: file
                .k8s_services
                .iter()
                .chain(&self.k8s_services)
                .cloned()
                .collect(),
            kubeconfig: self.kubeconfig.clone().or(file.kubeconfig.clone()),
        }
    }
}

/// A client from `kubeconfig` when given, else the pod's service account, else the local
/// kubeconfig.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> Result<kube::Client, DiscoveryError> {
    Ok(llmgw_core::kube_client::client(kubeconfig).await?)
}

/// Which source a problem was seen in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum SourceKind {
    inference_pool,
    endpoint_slices,
    inference_objective,
}

/// What went wrong. Each keeps the source's last replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Problem {
    /// A list or watch failed (unreachable API server, refused credentials, RBAC, ...).
    api,
    /// The InferencePool does not exist (or was deleted).
    pool_not_found,
    /// The InferencePool's spec is unusable (no selector, no or over 8 target ports, ...).
    invalid_pool,
    /// The selector matches no pods (or the Service has no endpoints).
    no_pods,
    /// A Ready pod without a usable IP, skipped.
    pod_without_ip,
    /// A pool replica's `/v1/models` could not be read (no models configured), so it is left
    /// out until it answers.
    models_unknown,
    /// An InferenceObjective's spec is unusable (a priority that is not a 32-bit integer, no
    /// poolRef); it keeps its last good priority.
    invalid_objective,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ProblemLabels {
    pub source: SourceKind,
    pub problem: Problem,
}

/// Discovery's counters; cheap to clone into each source's task.
#[derive(Debug, Clone, Default)]
pub struct DiscoveryMetrics {
    pub problems: Family<ProblemLabels, Counter>,
}

impl DiscoveryMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.sub_registry_with_prefix("llmgw_discovery").register(
            "problems",
            "Problems met while discovering replicas in Kubernetes, by source and problem (api, pool_not_found, invalid_pool, no_pods, pod_without_ip, models_unknown, invalid_objective); each keeps the last good replicas",
            self.problems.clone(),
        );
    }

    fn count(&self, source: SourceKind, problem: Problem) {
        self.problems
            .get_or_create(&ProblemLabels { source, problem })
            .inc();
    }

    /// Tests read the counter back.
    pub fn count_of(&self, source: SourceKind, problem: Problem) -> u64 {
        self.problems
            .get_or_create(&ProblemLabels { source, problem })
            .get()
    }
}

/// Whether a reflected watch `event` left its store changed: at the end of a (re)list and with
/// each watch event, not while a relist is under way. A failure is counted and logged once per
/// streak ([`Failing`]); any success ends the streak.
fn store_changed<K>(
    event: Result<kube::runtime::watcher::Event<K>, kube::runtime::watcher::Error>,
    failing: &mut Failing,
    metrics: &DiscoveryMetrics,
) -> bool {
    use kube::runtime::watcher::Event;
    match event {
        Err(error) => {
            failing.failed(metrics, &error);
            false
        }
        Ok(event) => {
            failing.succeeded();
            !matches!(event, Event::Init | Event::InitApply(_))
        }
    }
}

/// Logs a watch stream's failures once per streak, counting each.
struct Failing {
    source: SourceKind,
    what: String,
    failing: bool,
}

impl Failing {
    fn new(source: SourceKind, what: String) -> Failing {
        Failing {
            source,
            what,
            failing: false,
        }
    }

    fn failed(&mut self, metrics: &DiscoveryMetrics, error: &kube::runtime::watcher::Error) {
        metrics.count(self.source, Problem::api);
        if !self.failing {
            tracing::warn!(source = %self.what, %error, "cannot list or watch in Kubernetes; keeping the last replicas, retrying");
            self.failing = true;
        }
    }

    fn succeeded(&mut self) {
        if self.failing {
            tracing::info!(source = %self.what, "Kubernetes readable again");
            self.failing = false;
        }
    }
}
