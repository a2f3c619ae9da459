//! Engines from the vLLM pods on the agent's node (`--discover-pods SELECTOR`), for an agent
//! run as a DaemonSet: each Running pod on `--node` that matches the selector is one engine
//! (or one per data-parallel rank), found at the pod's IP:
//! - the replica is `POD_IP:HTTP` (`--pod-http-port`, default the container port named
//!   `http`), the address the routers know the pod by;
//! - events come from `tcp://POD_IP:KV` (`--pod-kv-events-port`, default `kv-events`), replay
//!   from `--pod-kv-replay-port` (default `kv-replay`; a pod without it has no replay);
//! - the annotation `llmgw.io/data-parallel-size: "N"` expands a pod into N engines on
//!   consecutive ports, as vLLM offsets its ranks.
//!
//! A pod that cannot be mirrored (a port missing, a bad annotation, a Running pod without an
//! IP) is left out, logged once and counted in `llmgw_agent_engine_source_errors_total`. A
//! pod being deleted, not yet Running or finished is simply not an engine.
//!
//! # Concurrency model
//! One task drives kube's watcher (list, then watch; relist on 410 Gone; kube's default
//! backoff on failure) over the node's pods and keeps them in a reflector store. After each
//! (re)list and each change it computes the engines and hands them to
//! [`Agent::set_engines`]. A failing list or watch keeps the last engines: an API server that
//! is briefly away must not stop the mirrors.

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};

use crate::config::{EngineConfig, EngineSpec, PodDiscovery, PodPort};
use crate::daemon::Agent;

/// The annotation naming a pod's data-parallel size.
pub const DATA_PARALLEL_ANNOTATION: &str = "llmgw.io/data-parallel-size";

/// At most this many data-parallel ranks per pod (an annotation is input).
pub const MAX_DATA_PARALLEL: u16 = 64;

pub use llmgw_core::kube_client::{KubeClientError, client};

/// A pod left out, and why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Skipped {
    pub pod: String,
    pub why: String,
}

/// The engines `pods` make, in pod-name order, and the pods that cannot be mirrored.
pub fn engines_of(
    pods: &[Arc<Pod>],
    discovery: &PodDiscovery,
    topic: &str,
) -> (Vec<EngineConfig>, Vec<Skipped>) {
    let by_name: BTreeMap<String, &Pod> = pods
        .iter()
        .map(|p| (p.metadata.name.clone().unwrap_or_default(), &**p))
        .collect();
    let mut engines = Vec::new();
    let mut skipped = Vec::new();
    let mut names = HashSet::new();
    for (name, pod) in by_name {
        match engines_of_pod(pod, discovery, topic) {
            Ok(None) => {}
            Ok(Some(found)) => {
                if let Some(twice) = found.iter().find(|e| names.contains(&e.name)) {
                    skipped.push(Skipped {
                        why: format!("engine {} is already another pod's", twice.name),
                        pod: name,
                    });
                    continue;
                }
                names.extend(found.iter().map(|e| e.name.clone()));
                engines.extend(found);
            }
            Err(why) => skipped.push(Skipped { pod: name, why }),
        }
    }
    (engines, skipped)
}

/// One pod's engines; `None` when it is not (or no longer, or not yet) running.
fn engines_of_pod(
    pod: &Pod,
    discovery: &PodDiscovery,
    topic: &str,
) -> Result<Option<Vec<EngineConfig>>, String> {
    let status = pod.status.as_ref();
    if pod.metadata.deletion_timestamp.is_some()
        || status.and_then(|s| s.phase.as_deref()) != Some("Running")
    {
        return Ok(None);
    }
    let ip = status
        .and_then(|s| s.pod_ip.as_deref())
        .ok_or("it is Running without an IP")?;
    let ip: IpAddr = ip
        .parse()
        .map_err(|_| format!("its IP {ip:?} is not an address"))?;
    let http = port_of(pod, &discovery.http_port)?
        .ok_or_else(|| missing(&discovery.http_port, "--pod-http-port"))?;
    let events = port_of(pod, &discovery.kv_events_port)?
        .ok_or_else(|| missing(&discovery.kv_events_port, "--pod-kv-events-port"))?;
    let replay = port_of(pod, &discovery.kv_replay_port)?;
    let dp = match pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(DATA_PARALLEL_ANNOTATION))
    {
        None => 1,
        Some(text) => text
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|n| (1..=MAX_DATA_PARALLEL).contains(n))
            .ok_or_else(|| {
                format!("{DATA_PARALLEL_ANNOTATION} {text:?} is not 1 to {MAX_DATA_PARALLEL}")
            })?,
    };
    let spec = EngineSpec {
        replica: SocketAddr::new(ip, http).to_string(),
        endpoint: format!("tcp://{}", SocketAddr::new(ip, events)),
        replay: replay.map(|port| format!("tcp://{}", SocketAddr::new(ip, port))),
        bind: false,
        topic: None,
        dp,
        health: None,
    };
    spec.expand(topic).map(Some).map_err(|e| e.to_string())
}

fn missing(port: &PodPort, flag: &str) -> String {
    match port {
        PodPort::Named(name) => format!("no container port named {name:?} ({flag})"),
        PodPort::Number(n) => format!("no port {n} ({flag})"),
    }
}

/// The port `wanted` names in `pod`'s containers (a number is taken as it is).
fn port_of(pod: &Pod, wanted: &PodPort) -> Result<Option<u16>, String> {
    let name = match wanted {
        PodPort::Number(n) => return Ok(Some(*n)),
        PodPort::Named(name) => name,
    };
    let containers = pod.spec.iter().flat_map(|s| &s.containers);
    let port = containers
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(name.as_str()));
    match port {
        None => Ok(None),
        Some(p) => u16::try_from(p.container_port)
            .ok()
            .filter(|n| *n != 0)
            .map(Some)
            .ok_or_else(|| format!("port {name:?} is {}", p.container_port)),
    }
}

/// Follows the pods of `discovery` and keeps `agent`'s engines equal to theirs. Runs until
/// dropped.
pub async fn run(agent: Arc<Agent>, client: kube::Client, discovery: PodDiscovery) {
    let api: Api<Pod> = match &discovery.namespace {
        Some(namespace) => Api::namespaced(client, namespace),
        None => Api::default_namespaced(client),
    };
    let on_node = format!("spec.nodeName={}", discovery.node);
    let config = watcher::Config::default()
        .labels(&discovery.selector)
        .fields(&on_node);
    let (store, writer) = reflector::store();
    let mut events = watcher(api, config)
        .default_backoff()
        .reflect(writer)
        .boxed();
    tracing::info!(
        selector = discovery.selector,
        node = discovery.node,
        "following the node's pods"
    );
    let mut failing = false;
    let mut reported: BTreeSet<Skipped> = BTreeSet::new();
    while let Some(event) = events.next().await {
        match event {
            Err(error) => {
                agent.metrics.engine_source_errors.inc();
                if !failing {
                    tracing::warn!(%error, selector = discovery.selector, "cannot list or watch the node's pods; keeping the last engines");
                    failing = true;
                }
            }
            // The store changes at the end of a (re)list and with each watch event.
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
            Ok(_) => {
                if std::mem::take(&mut failing) {
                    tracing::info!("watching the node's pods again");
                }
                let (engines, skipped) =
                    engines_of(&store.state(), &discovery, &agent.config.topic);
                report(&agent, &mut reported, skipped);
                agent.set_engines(engines).await;
            }
        }
    }
}

/// Logs and counts each pod's problem once, for as long as it lasts.
fn report(agent: &Agent, reported: &mut BTreeSet<Skipped>, skipped: Vec<Skipped>) {
    let now: BTreeSet<Skipped> = skipped.into_iter().collect();
    for s in now.difference(reported) {
        agent.metrics.engine_source_errors.inc();
        tracing::warn!(
            pod = s.pod,
            why = s.why,
            "cannot mirror the pod's engine; leaving it out"
        );
    }
    *reported = now;
}
