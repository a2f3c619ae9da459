//! Replicas from a Gateway API Inference Extension InferencePool
//! (`inference.networking.k8s.io/v1`): the pool's `selector` picks pods in its namespace, and
//! each Ready pod's IP at each of its `targetPorts` (one per data-parallel rank) is a replica,
//! on the pod's `spec.nodeName`, serving the configured models or, with none configured, the
//! models its `/v1/models` lists (LoRA adapters included), asked once per replica address.
//!
//! One task watches the pool (by name) and the pods its selector matches; a changed selector
//! or port list restarts the pod watch. A pod leaving Ready, or being deleted, leaves the
//! candidates with the watch event that says so. What cannot be used is logged, counted in
//! `llmgw_discovery_problems_total{source="inference_pool"}` and leaves the last good replicas
//! in place: a missing pool, an unusable spec, a selector matching nothing, a failing API.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::api::Api;
use kube::runtime::reflector::Store;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde::Deserialize;

use super::{DiscoveryMetrics, Failing, Problem, SourceKind};
use crate::pool::{ReplicaSources, ReplicaSpec};

/// InferencePool allows 1 to 8 target ports.
pub const MAX_TARGET_PORTS: usize = 8;

/// Which pool: `--pool-name` in `--pool-namespace`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRef {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for PoolRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Where a pool replica's models come from.
#[derive(Debug, Clone)]
pub enum ModelSource {
    /// The configured models (`--model`, the file): every replica serves them.
    Configured(Vec<String>),
    /// Each replica's own `GET /v1/models`, asked with this client.
    Discovered(reqwest::Client),
}

/// A replica whose `/v1/models` could not be read is asked again after this long.
const MODELS_RETRY: std::time::Duration = std::time::Duration::from_secs(5);

/// The model ids a vLLM `/v1/models` answer lists, bounded.
pub fn models_in(body: &[u8]) -> Result<Vec<String>, String> {
    let cards = crate::pool::adapters::model_cards(body).map_err(|e| e.to_string())?;
    Ok(cards.into_iter().map(|c| c.id).collect())
}

/// Asks `address` for its models.
async fn fetch_models(
    client: &reqwest::Client,
    address: SocketAddr,
) -> Result<Vec<String>, String> {
    let cards = crate::pool::adapters::fetch_model_cards(client, &address.to_string()).await?;
    Ok(cards.into_iter().map(|c| c.id).collect())
}

/// Each replica's discovered models, kept while its address stays in the pool.
#[derive(Default)]
struct DiscoveredModels {
    by_address: std::collections::HashMap<SocketAddr, Vec<String>>,
    /// Addresses whose last ask failed, logged once each.
    failing: BTreeSet<SocketAddr>,
}

impl DiscoveredModels {
    /// Fills in `replicas`' models from the cache, asking the replicas not in it. Returns the
    /// replicas with models, and whether some could not be asked (to try again later).
    async fn apply(
        &mut self,
        client: &reqwest::Client,
        replicas: Vec<ReplicaSpec>,
        pool: &PoolRef,
        metrics: &DiscoveryMetrics,
    ) -> (Vec<ReplicaSpec>, bool) {
        let current: HashSet<SocketAddr> = replicas.iter().map(|r| r.address).collect();
        self.by_address
            .retain(|address, _| current.contains(address));
        self.failing.retain(|address| current.contains(address));
        // Asked together, so that one slow replica does not hold up the others' answers.
        let unknown: Vec<SocketAddr> = replicas
            .iter()
            .map(|r| r.address)
            .filter(|address| !self.by_address.contains_key(address))
            .collect();
        let answers = futures::future::join_all(
            unknown
                .iter()
                .map(|&address| async move { (address, fetch_models(client, address).await) }),
        )
        .await;
        let mut incomplete = false;
        for (address, answer) in answers {
            match answer {
                Ok(models) => {
                    self.failing.remove(&address);
                    tracing::info!(%pool, replica = %address, ?models, "models from the replica's /v1/models");
                    self.by_address.insert(address, models);
                }
                Err(problem) => {
                    incomplete = true;
                    metrics.count(SourceKind::inference_pool, Problem::models_unknown);
                    if self.failing.insert(address) {
                        tracing::warn!(%pool, replica = %address, %problem, "cannot read the replica's /v1/models; leaving it out until it answers");
                    }
                }
            }
        }
        let known = replicas
            .into_iter()
            .filter_map(|mut replica| {
                replica.models = self.by_address.get(&replica.address)?.clone();
                Some(replica)
            })
            .collect();
        (known, incomplete)
    }
}

/// An InferencePool as the API serves it. The spec stays JSON until [`PoolSpec::parse`], so
/// that an unusable spec is this module's clear error rather than a watch that cannot decode.
#[derive(Debug, Clone, Deserialize)]
pub struct InferencePool {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: serde_json::Value,
}

impl kube::Resource for InferencePool {
    type DynamicType = ();
    type Scope = kube::core::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "InferencePool".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "inference.networking.k8s.io".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "inferencepools".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// What llmgw needs of a pool's spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// The pods' label selector, as the API's query syntax.
    pub selector: String,
    pub target_ports: Vec<u16>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSpec {
    selector: Option<LabelSelector>,
    #[serde(default)]
    target_ports: Vec<RawPort>,
}

#[derive(Deserialize)]
struct RawPort {
    number: i64,
}

impl PoolSpec {
    /// The spec, or why it cannot be used.
    pub fn parse(spec: &serde_json::Value) -> Result<PoolSpec, String> {
        let raw: RawSpec =
            serde_json::from_value(spec.clone()).map_err(|e| format!("unreadable spec: {e}"))?;
        let selector = raw.selector.ok_or("spec.selector is missing")?;
        let selector: kube::core::Selector = selector
            .try_into()
            .map_err(|e| format!("spec.selector: {e}"))?;
        if selector.selects_all() {
            return Err("spec.selector is empty (it would select every pod)".to_string());
        }
        if raw.target_ports.is_empty() || raw.target_ports.len() > MAX_TARGET_PORTS {
            return Err(format!(
                "spec.targetPorts has {} ports; an InferencePool has 1 to {MAX_TARGET_PORTS}",
                raw.target_ports.len()
            ));
        }
        let mut target_ports = Vec::with_capacity(raw.target_ports.len());
        for port in raw.target_ports {
            let number = u16::try_from(port.number)
                .ok()
                .filter(|n| *n != 0)
                .ok_or_else(|| format!("spec.targetPorts: {} is not a port", port.number))?;
            if !target_ports.contains(&number) {
                target_ports.push(number);
            }
        }
        Ok(PoolSpec {
            selector: selector.to_string(),
            target_ports,
        })
    }
}

/// The replicas `pods` make: each Ready pod that is not being deleted, at each port. A Ready
/// pod without a usable IP is skipped and returned in the second list.
pub fn replicas_of(
    pods: &[Arc<Pod>],
    ports: &[u16],
    models: &[String],
) -> (Vec<ReplicaSpec>, Vec<String>) {
    let mut replicas = Vec::new();
    let mut without_ip = Vec::new();
    for pod in pods {
        if pod.metadata.deletion_timestamp.is_some() || !is_ready(pod) {
            continue;
        }
        let ip = pod.status.as_ref().and_then(|s| s.pod_ip.as_deref());
        let Some(ip) = ip.and_then(|ip| ip.parse::<IpAddr>().ok()) else {
            without_ip.push(pod.metadata.name.clone().unwrap_or_default());
            continue;
        };
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        for &port in ports {
            replicas.push(ReplicaSpec {
                address: SocketAddr::new(ip, port),
                models: models.to_vec(),
                node: node.clone(),
            });
        }
    }
    replicas.sort_by_key(|r| r.address);
    (replicas, without_ip)
}

/// The pod's `Ready` condition is `True`.
fn is_ready(pod: &Pod) -> bool {
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.is_some_and(|conditions| {
        conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    })
}

/// The pod watch for one spec.
struct PodWatch {
    spec: PoolSpec,
    store: Store<Pod>,
    events: BoxStream<'static, Result<watcher::Event<Pod>, watcher::Error>>,
    failing: Failing,
}

/// The next event of `pods`, or never when there is no pod watch yet.
async fn next_pod_event(
    pods: &mut Option<PodWatch>,
) -> Option<Result<watcher::Event<Pod>, watcher::Error>> {
    match pods {
        Some(watch) => watch.events.next().await,
        None => std::future::pending().await,
    }
}

/// Watches `pool` and its pods, publishing the replicas as `source` of `sources`. Runs until
/// dropped.
pub async fn run(
    client: kube::Client,
    pool: PoolRef,
    models: ModelSource,
    sources: Arc<ReplicaSources>,
    source: usize,
    metrics: DiscoveryMetrics,
) {
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), &pool.namespace);
    let by_name = format!("metadata.name={}", pool.name);
    let mut pool_events = backed_off(watcher(pools, watcher::Config::default().fields(&by_name)));
    let mut pool_failing = Failing::new(SourceKind::inference_pool, pool.to_string());
    let mut pods: Option<PodWatch> = None;
    // Whether this (re)list of the pool found it.
    let mut listed_pool = false;
    let mut reported = Reported::default();
    let mut publisher = Publisher {
        pool: &pool,
        models: &models,
        sources: &sources,
        source,
        metrics: &metrics,
        discovered: DiscoveredModels::default(),
    };
    // When replicas whose models could not be read are asked again.
    let mut retry: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            () = sleep_until(retry), if retry.is_some() => {
                retry = None;
                if let Some(watch) = &pods {
                    let (store, spec) = (watch.store.clone(), watch.spec.clone());
                    retry = publisher.publish(&store, &spec, &mut reported).await;
                }
            }
            event = pool_events.next() => {
                let Some(event) = event else { return };
                let found = match event {
                    Err(error) => {
                        pool_failing.failed(&metrics, &error);
                        continue;
                    }
                    Ok(watcher::Event::Init) => {
                        listed_pool = false;
                        None
                    }
                    Ok(watcher::Event::InitApply(found) | watcher::Event::Apply(found)) => {
                        listed_pool = true;
                        Some(found)
                    }
                    Ok(watcher::Event::InitDone) => {
                        if !listed_pool {
                            reported.pool_missing(&metrics, &pool, "does not exist");
                        }
                        None
                    }
                    Ok(watcher::Event::Delete(_)) => {
                        reported.pool_missing(&metrics, &pool, "was deleted");
                        None
                    }
                };
                pool_failing.succeeded();
                let Some(found) = found else { continue };
                reported.pool_found();
                match PoolSpec::parse(&found.spec) {
                    Err(problem) => {
                        metrics.count(SourceKind::inference_pool, Problem::invalid_pool);
                        tracing::warn!(%pool, %problem, "cannot use the InferencePool's spec; keeping the last replicas");
                    }
                    Ok(spec) if pods.as_ref().is_some_and(|w| w.spec == spec) => {}
                    Ok(spec) => {
                        tracing::info!(%pool, selector = %spec.selector, ports = ?spec.target_ports, "watching the InferencePool's pods");
                        pods = Some(watch_pods(&client, &pool, spec));
                    }
                }
            }
            event = next_pod_event(&mut pods) => {
                let (Some(event), Some(watch)) = (event, pods.as_mut()) else { continue };
                match event {
                    Err(error) => watch.failing.failed(&metrics, &error),
                    // The store changes at the end of a (re)list and with each watch event.
                    Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => watch.failing.succeeded(),
                    Ok(_) => {
                        watch.failing.succeeded();
                        let (store, spec) = (watch.store.clone(), watch.spec.clone());
                        retry = publisher.publish(&store, &spec, &mut reported).await;
                    }
                }
            }
        }
    }
}

fn watch_pods(client: &kube::Client, pool: &PoolRef, spec: PoolSpec) -> PodWatch {
    let api: Api<Pod> = Api::namespaced(client.clone(), &pool.namespace);
    let (store, writer) = reflector::store();
    let events = backed_off(watcher(
        api,
        watcher::Config::default().labels(&spec.selector),
    ))
    .reflect(writer)
    .boxed();
    PodWatch {
        spec,
        store,
        events,
        failing: Failing::new(SourceKind::inference_pool, format!("{pool} pods")),
    }
}

fn backed_off<K: Send + 'static>(
    events: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
) -> BoxStream<'static, Result<watcher::Event<K>, watcher::Error>> {
    events.default_backoff().boxed()
}

/// Sleeps until `at`; never when there is no `at`.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Turns the pods into the source's replicas and hands them to the pool.
struct Publisher<'a> {
    pool: &'a PoolRef,
    models: &'a ModelSource,
    sources: &'a ReplicaSources,
    source: usize,
    metrics: &'a DiscoveryMetrics,
    discovered: DiscoveredModels,
}

impl Publisher<'_> {
    /// Sends the pods' replicas to the pool, unless the selector matches nothing. Returns when
    /// to try again, if some replica's models could not be read.
    async fn publish(
        &mut self,
        store: &Store<Pod>,
        spec: &PoolSpec,
        reported: &mut Reported,
    ) -> Option<tokio::time::Instant> {
        let (pool, metrics) = (self.pool, self.metrics);
        let pods = store.state();
        if pods.is_empty() {
            reported.no_pods(metrics, pool, &spec.selector);
            return None;
        }
        reported.pods_found();
        let configured: &[String] = match self.models {
            ModelSource::Configured(models) => models,
            ModelSource::Discovered(_) => &[],
        };
        let (replicas, without_ip) = replicas_of(&pods, &spec.target_ports, configured);
        reported.pods_without_ip(metrics, pool, without_ip);
        let (replicas, incomplete) = match self.models {
            ModelSource::Configured(_) => (replicas, false),
            ModelSource::Discovered(client) => {
                self.discovered.apply(client, replicas, pool, metrics).await
            }
        };
        let count = replicas.len();
        if self.sources.set(self.source, replicas) {
            tracing::info!(%pool, replicas = count, "replicas from the InferencePool changed");
        }
        incomplete.then(|| tokio::time::Instant::now() + MODELS_RETRY)
    }
}

/// What has been logged, so that a lasting problem is one log line, not one per event.
#[derive(Default)]
struct Reported {
    pool_missing: bool,
    no_pods: bool,
    /// The pods logged as Ready without an IP; one leaves when it has an IP (or is gone).
    without_ip: BTreeSet<String>,
}

impl Reported {
    fn pool_missing(&mut self, metrics: &DiscoveryMetrics, pool: &PoolRef, how: &str) {
        metrics.count(SourceKind::inference_pool, Problem::pool_not_found);
        if !self.pool_missing {
            tracing::warn!(%pool, "the InferencePool {how}; keeping the last replicas");
            self.pool_missing = true;
        }
    }

    fn pool_found(&mut self) {
        self.pool_missing = false;
    }

    fn no_pods(&mut self, metrics: &DiscoveryMetrics, pool: &PoolRef, selector: &str) {
        metrics.count(SourceKind::inference_pool, Problem::no_pods);
        if !self.no_pods {
            tracing::warn!(%pool, %selector, "the InferencePool's selector matches no pods; keeping the last replicas");
            self.no_pods = true;
        }
    }

    fn pods_found(&mut self) {
        self.no_pods = false;
    }

    fn pods_without_ip(&mut self, metrics: &DiscoveryMetrics, pool: &PoolRef, pods: Vec<String>) {
        let now: HashSet<&String> = pods.iter().collect();
        self.without_ip.retain(|pod| now.contains(pod));
        for pod in pods {
            if self.without_ip.insert(pod.clone()) {
                metrics.count(SourceKind::inference_pool, Problem::pod_without_ip);
                tracing::warn!(%pool, %pod, "a Ready pod has no usable IP; skipping it");
            }
        }
    }
}

#[cfg(test)]
mod tests;
