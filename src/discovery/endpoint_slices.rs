//! Replicas from a Service's EndpointSlices: `--k8s-service MODEL=NAMESPACE/SERVICE:PORT`
//! makes every ready address of the EndpointSlices labelled `kubernetes.io/service-name=SERVICE`
//! in NAMESPACE a replica of MODEL at `address:PORT` (the vLLM port of the pod), on the
//! endpoint's node. Watched, one task per Service (see the module above).

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};

use super::{DiscoveryError, DiscoveryMetrics, Failing, Problem, SourceKind, store_changed};
use crate::pool::{ReplicaSources, ReplicaSpec};

/// The label Kubernetes puts on a Service's EndpointSlices.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// One `--k8s-service`: the replicas of `model` behind a Service.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct K8sService {
    pub model: String,
    pub namespace: String,
    pub service: String,
    /// The pods' vLLM port.
    pub port: u16,
}

impl FromStr for K8sService {
    type Err = DiscoveryError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let invalid = || DiscoveryError::Spec(spec.to_string());
        let (model, rest) = spec.trim().split_once('=').ok_or_else(invalid)?;
        let (namespace, rest) = rest.split_once('/').ok_or_else(invalid)?;
        let (service, port) = rest.rsplit_once(':').ok_or_else(invalid)?;
        let port = port.parse().map_err(|_| invalid())?;
        if [model, namespace, service].iter().any(|s| s.is_empty()) {
            return Err(invalid());
        }
        Ok(K8sService {
            model: model.to_string(),
            namespace: namespace.to_string(),
            service: service.to_string(),
            port,
        })
    }
}

impl fmt::Display for K8sService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}={}/{}:{}",
            self.model, self.namespace, self.service, self.port
        )
    }
}

/// The replicas a Service's EndpointSlices describe: ready endpoints only (an absent `ready`
/// condition means ready, as the API defines it), one replica per address.
pub fn replicas_from_slices(source: &K8sService, slices: &[EndpointSlice]) -> Vec<ReplicaSpec> {
    let mut replicas = Vec::new();
    for endpoint in slices.iter().flat_map(|slice| &slice.endpoints) {
        let ready = endpoint
            .conditions
            .as_ref()
            .and_then(|c| c.ready)
            .unwrap_or(true);
        if !ready {
            continue;
        }
        for address in &endpoint.addresses {
            let Ok(ip) = address.parse::<IpAddr>() else {
                tracing::warn!(%address, service = %source, "skipping an endpoint address that is not an IP");
                continue;
            };
            replicas.push(ReplicaSpec {
                address: SocketAddr::new(ip, source.port),
                models: vec![source.model.clone()],
                node: endpoint.node_name.clone(),
            });
        }
    }
    replicas.sort_by_key(|r| r.address);
    replicas
}

/// Watches every Service and publishes each one's replicas as source `first_source + i` of
/// `sources`. Runs until dropped.
pub async fn run(
    client: kube::Client,
    services: Vec<K8sService>,
    sources: Arc<ReplicaSources>,
    first_source: usize,
    metrics: DiscoveryMetrics,
) {
    let watches = services.into_iter().enumerate().map(|(i, service)| {
        watch_service(
            client.clone(),
            service,
            Arc::clone(&sources),
            first_source + i,
            metrics.clone(),
        )
    });
    futures::future::join_all(watches).await;
}

async fn watch_service(
    client: kube::Client,
    service: K8sService,
    sources: Arc<ReplicaSources>,
    source: usize,
    metrics: DiscoveryMetrics,
) {
    let api: Api<EndpointSlice> = Api::namespaced(client, &service.namespace);
    let selector = format!("{SERVICE_NAME_LABEL}={}", service.service);
    let (store, writer) = reflector::store();
    let mut events = watcher(api, watcher::Config::default().labels(&selector))
        .default_backoff()
        .reflect(writer)
        .boxed();
    let mut failing = Failing::new(SourceKind::endpoint_slices, service.to_string());
    let mut warned_empty = false;
    while let Some(event) = events.next().await {
        if !store_changed(event, &mut failing, &metrics) {
            continue;
        }
        let slices: Vec<EndpointSlice> = store.state().iter().map(|s| s.as_ref().clone()).collect();
        let replicas = replicas_from_slices(&service, &slices);
        if replicas.is_empty() && !warned_empty {
            tracing::warn!(%service, "the Service has no ready endpoints");
            metrics.count(SourceKind::endpoint_slices, Problem::no_pods);
        }
        warned_empty = replicas.is_empty();
        let count = replicas.len();
        if sources.set(source, replicas) {
            tracing::info!(%service, replicas = count, "replicas from Kubernetes changed");
        }
    }
}

#[cfg(test)]
mod tests;
