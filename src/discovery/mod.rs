//! Replicas from Kubernetes: the ready endpoints of a Service's EndpointSlices, each with the
//! node it runs on (so the agent feed's ownership check keeps working as pods move).
//!
//! `--k8s-service MODEL=NAMESPACE/SERVICE:PORT` names a source: every ready address of the
//! EndpointSlices labelled `kubernetes.io/service-name=SERVICE` in NAMESPACE is a replica of
//! MODEL at `address:PORT` (the vLLM port of the pod).
//!
//! # Concurrency model
//! One task lists every source's EndpointSlices each poll interval and hands each source's
//! replicas to [`ReplicaSources`], which publishes the union to the pool. A failed list keeps the
//! source's last replicas (the API server being briefly unreachable must not empty the pool).

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use thiserror::Error;

use crate::pool::{ReplicaSources, ReplicaSpec};

/// The label Kubernetes puts on a Service's EndpointSlices.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

#[derive(Debug, Error)]
pub enum DiscoveryError {
    #[error("invalid Kubernetes service {0:?}: expected MODEL=NAMESPACE/SERVICE:PORT")]
    Spec(String),
    #[error("no Kubernetes client configuration (in-cluster or kubeconfig): {0}")]
    Config(#[from] kube::config::InferConfigError),
    #[error("Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

/// Discovery's options: flags (and `LLMGW_*` variables) with the same names as the
/// configuration file's keys.
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
#[serde(default)]
pub struct DiscoveryOptions {
    /// Replicas from a Kubernetes Service, repeatable: MODEL=NAMESPACE/SERVICE:PORT. The ready
    /// endpoints of the Service's EndpointSlices, at the pods' vLLM PORT, with their nodes;
    /// needs RBAC to list endpointslices (discovery.k8s.io) in NAMESPACE.
    #[arg(
        long = "k8s-service",
        env = "LLMGW_K8S_SERVICES",
        value_delimiter = ','
    )]
    pub k8s_services: Vec<K8sService>,
    /// How often Kubernetes EndpointSlices are listed (default 5s).
    #[arg(long, env = "LLMGW_K8S_POLL_INTERVAL", value_parser = crate::duration::parse)]
    #[serde(deserialize_with = "crate::duration::optional")]
    pub k8s_poll_interval: Option<Duration>,
}

/// Where replicas are discovered, and how often.
#[derive(Debug, Clone, PartialEq)]
pub struct DiscoverySettings {
    /// The file's Services, then the flags'.
    pub services: Vec<K8sService>,
    pub poll_interval: Duration,
}

impl DiscoveryOptions {
    /// These options (the flags) after `file`'s services; the flag's interval over the file's.
    pub fn resolve(&self, file: &DiscoveryOptions) -> DiscoverySettings {
        DiscoverySettings {
            services: file
                .k8s_services
                .iter()
                .chain(&self.k8s_services)
                .cloned()
                .collect(),
            poll_interval: (self.k8s_poll_interval)
                .or(file.k8s_poll_interval)
                .unwrap_or(Duration::from_secs(5)),
        }
    }
}

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

/// Lists one source's EndpointSlices.
pub async fn list_service(
    client: &kube::Client,
    source: &K8sService,
) -> Result<Vec<ReplicaSpec>, kube::Error> {
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), &source.namespace);
    let selector = format!("{SERVICE_NAME_LABEL}={}", source.service);
    let slices = api.list(&ListParams::default().labels(&selector)).await?;
    Ok(replicas_from_slices(source, &slices.items))
}

/// A client from the pod's service account, or the local kubeconfig.
pub async fn default_client() -> Result<kube::Client, DiscoveryError> {
    let config = kube::Config::infer().await?;
    Ok(kube::Client::try_from(config)?)
}

/// Polls every source each `interval` and publishes each one's replicas as source
/// `first_source + i` of `sources`. Runs until dropped.
pub async fn run(
    client: kube::Client,
    services: Vec<K8sService>,
    interval: Duration,
    sources: Arc<ReplicaSources>,
    first_source: usize,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Log a failing source once until it recovers, not every poll.
    let mut failing = vec![false; services.len()];
    loop {
        ticker.tick().await;
        for (i, service) in services.iter().enumerate() {
            match list_service(&client, service).await {
                Ok(replicas) => {
                    if failing[i] {
                        tracing::info!(%service, "Kubernetes endpoints readable again");
                        failing[i] = false;
                    }
                    let count = replicas.len();
                    if sources.set(first_source + i, replicas) {
                        tracing::info!(%service, replicas = count, "replicas from Kubernetes changed");
                    }
                }
                Err(error) => {
                    if !failing[i] {
                        tracing::warn!(%service, %error, "cannot list Kubernetes endpoints; keeping the last replicas");
                        failing[i] = true;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
