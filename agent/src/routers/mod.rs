//! Routers found through DNS: `--router-service HOST:PORT` names every router at once, as a
//! Kubernetes headless Service does (one address per router pod). The agent streams to each
//! address the name resolves to and follows the answer: a router that appears gets its own
//! uplink (Hello and snapshots, like any new stream), one that leaves the answer has its
//! uplink stopped. So routers can run as a Deployment and scale without touching the agents.
//!
//! A failed or empty lookup changes nothing: DNS trouble must not cut the index feed of
//! routers that are still there. With TLS the agent connects to the address but checks the
//! router's certificate against the service's host name.
//!
//! The follower does not start uplinks itself: it is handed a spawner (the daemon's runs
//! [`crate::uplink::run`] against the agent), so it needs neither the agent nor the network.
//!
//! # Concurrency model
//! One task per service name ([`follow`]). It owns the uplink tasks it has the spawner start (one
//! per address) and aborts them when their address leaves the answer or when the follower itself
//! is dropped.

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::metrics::{Metrics, RouterLabel, ServiceLabel, UplinkErrorLabel};
use crate::uplink::{ERROR_REASONS, UplinkConfig};

/// Looks a `HOST:PORT` name up.
pub trait Resolve: Send + Sync + 'static {
    fn resolve(&self, target: &str) -> impl Future<Output = io::Result<Vec<SocketAddr>>> + Send;
}

/// The system resolver (`getaddrinfo` through tokio).
#[derive(Debug, Clone, Copy, Default)]
pub struct Dns;

impl Resolve for Dns {
    fn resolve(&self, target: &str) -> impl Future<Output = io::Result<Vec<SocketAddr>>> + Send {
        let target = target.to_owned();
        async move { Ok(tokio::net::lookup_host(target).await?.collect()) }
    }
}

/// One `--router-service`.
#[derive(Debug, Clone)]
pub struct RouterService {
    /// `HOST:PORT`.
    pub target: String,
    /// How often the name is resolved again.
    pub interval: Duration,
    /// Settings for each address's uplink (its `router` is replaced by the address).
    pub uplink: UplinkConfig,
}

/// The uplinks of one service, aborted together when dropped.
struct Uplinks {
    metrics: Arc<Metrics>,
    running: BTreeMap<SocketAddr, JoinHandle<()>>,
}

impl Uplinks {
    fn stop(&mut self, addr: &SocketAddr) {
        if let Some(task) = self.running.remove(addr) {
            task.abort();
            // A departed router's series would only mislead.
            let label = RouterLabel {
                router: addr.to_string(),
            };
            self.metrics.uplink_connected.remove(&label);
            self.metrics.event_to_router.remove(&label);
            for reason in ERROR_REASONS {
                self.metrics.uplink_errors.remove(&UplinkErrorLabel {
                    router: label.router.clone(),
                    reason,
                });
            }
        }
    }
}

impl Drop for Uplinks {
    fn drop(&mut self) {
        let addrs: Vec<SocketAddr> = self.running.keys().copied().collect();
        for addr in &addrs {
            self.stop(addr);
        }
    }
}

/// Resolves `service.target` every `service.interval` and keeps one uplink per address, each
/// started by `spawn_uplink` (which returns its task). Runs until dropped.
pub async fn follow(
    service: RouterService,
    resolver: impl Resolve,
    metrics: Arc<Metrics>,
    spawn_uplink: impl Fn(UplinkConfig) -> JoinHandle<()> + Send + 'static,
) {
    let host = match crate::config::split_host_port(&service.target) {
        Ok((host, _)) => host.to_owned(),
        Err(error) => {
            // Checked when the configuration was read; reaching this is a caller's mistake.
            tracing::error!(%error, "not following the router service");
            return;
        }
    };
    let label = ServiceLabel {
        service: service.target.clone(),
    };
    let mut uplinks = Uplinks {
        metrics: Arc::clone(&metrics),
        running: BTreeMap::new(),
    };
    let mut tick = tokio::time::interval(service.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let found: BTreeSet<SocketAddr> = match resolver.resolve(&service.target).await {
            Ok(addrs) if !addrs.is_empty() => addrs.into_iter().collect(),
            Ok(_) => {
                tracing::warn!(
                    service = service.target,
                    kept = uplinks.running.len(),
                    "router service resolved to no address; keeping the routers we have"
                );
                continue;
            }
            Err(error) => {
                tracing::warn!(
                    service = service.target,
                    %error,
                    kept = uplinks.running.len(),
                    "cannot resolve the router service; keeping the routers we have"
                );
                continue;
            }
        };
        let gone: Vec<SocketAddr> = uplinks
            .running
            .keys()
            .filter(|a| !found.contains(a))
            .copied()
            .collect();
        for addr in gone {
            tracing::info!(service = service.target, router = %addr, "router left the service");
            uplinks.stop(&addr);
        }
        for addr in found {
            if uplinks.running.contains_key(&addr) {
                continue;
            }
            tracing::info!(service = service.target, router = %addr, "router joined the service");
            let config = UplinkConfig {
                router: addr.to_string(),
                tls_server_name: Some(host.clone()),
                ..service.uplink.clone()
            };
            uplinks.running.insert(addr, spawn_uplink(config));
        }
        let count = i64::try_from(uplinks.running.len()).unwrap_or(i64::MAX);
        metrics.router_addresses.get_or_create(&label).set(count);
    }
}
