//! Following a name that resolves to every router (a Kubernetes headless Service): one
//! subscription per address, started when the address appears and stopped when it goes. This
//! router's own address is among them; its subscription ends at once, refused as itself, and is
//! not tried again while the address stays. Over TLS each address is checked against the
//! service's host name, as the agents check the routers' service.
//!
//! Concurrency: one task resolves and owns the map of subscriptions (tasks it spawned).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::io;
use std::net::SocketAddr;

use tokio::task::JoinHandle;

use super::client::PeerContext;
use super::options::{PeerService, endpoint};

/// Resolves a `HOST:PORT` to addresses.
pub trait Resolve: Send + Sync + 'static {
    fn resolve(&self, target: &str) -> impl Future<Output = io::Result<Vec<SocketAddr>>> + Send;
}

/// The system resolver (`getaddrinfo` through tokio).
#[derive(Debug, Clone, Copy)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve(&self, target: &str) -> impl Future<Output = io::Result<Vec<SocketAddr>>> + Send {
        let target = target.to_owned();
        async move { Ok(tokio::net::lookup_host(target).await?.collect()) }
    }
}

/// Subscriptions by address; each is stopped when dropped from the map.
struct Subscriptions {
    context: PeerContext,
    /// The service's host name, which each peer's TLS certificate must carry.
    host: String,
    running: BTreeMap<SocketAddr, (String, JoinHandle<()>)>,
}

impl Subscriptions {
    fn start(&mut self, addr: SocketAddr) {
        let tls = self.context.tls.is_some();
        let url = format!("{}://{addr}", if tls { "https" } else { "http" });
        let Ok(endpoint) = endpoint(&url, tls) else {
            // A resolved socket address always makes a valid URL.
            return;
        };
        let client = self
            .context
            .client(url.clone(), endpoint)
            .with_server_name(self.host.clone());
        let task = tokio::spawn(client.run());
        self.running.insert(addr, (url, task));
    }

    fn stop(&mut self, addr: &SocketAddr) {
        if let Some((url, task)) = self.running.remove(addr) {
            task.abort();
            // Once the task has stopped: an update it was applying on another worker when
            // aborted would otherwise set the peer's loads again after they were cleared.
            let context = self.context.clone();
            tokio::spawn(async move {
                let _ = task.await;
                context.remove(&url);
            });
        }
    }
}

impl Drop for Subscriptions {
    fn drop(&mut self) {
        for (_, task) in self.running.values() {
            task.abort();
        }
    }
}

/// Resolves `service.target` every `service.interval` and keeps one subscription per address
/// it names. Runs until dropped. A failed or empty answer keeps the peers there are.
pub async fn follow(service: PeerService, resolver: impl Resolve, context: PeerContext) {
    let mut subscriptions = Subscriptions {
        context,
        host: service.host().to_owned(),
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
                    kept = subscriptions.running.len(),
                    "peer service resolved to no address; keeping the peers there are"
                );
                continue;
            }
            Err(error) => {
                tracing::warn!(service = service.target, %error, kept = subscriptions.running.len(), "cannot resolve the peer service; keeping the peers there are");
                continue;
            }
        };
        let gone: Vec<SocketAddr> = subscriptions
            .running
            .keys()
            .filter(|addr| !found.contains(addr))
            .copied()
            .collect();
        for addr in gone {
            tracing::info!(service = service.target, peer = %addr, "peer router left the service");
            subscriptions.stop(&addr);
        }
        for addr in found {
            if !subscriptions.running.contains_key(&addr) {
                tracing::debug!(service = service.target, peer = %addr, "peer router in the service");
                subscriptions.start(addr);
            }
        }
    }
}
