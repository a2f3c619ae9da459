//! The replicas llmgw routes to, their health and their load.
//!
//! # Concurrency model
//! The replica set is an immutable [`PoolSnapshot`] behind an [`ArcSwap`]: the request path loads
//! it without locks ([`Pool::snapshot`]) and a configuration reload swaps in a new one
//! ([`Pool::set_replicas`]). Each [`Replica`] is shared (`Arc`) between snapshots for as long as
//! its address, models and node stay the same, so its counters survive reloads. Per-replica state
//! changes without locks too: health is an atomic (its flips, and reloads, are announced on a
//! `watch` channel: [`Pool::health_changes`]), the in-flight count is an atomic counted by
//! [`InFlightGuard`]s (and the peers' count one the peering task writes), and the last
//! `/metrics` scrape is an immutable [`EngineLoad`] swapped in whole by the monitor
//! ([`monitor`]), so a reader never sees half of one scrape and half of another; the adapters a
//! replica's `/v1/models` lists ([`adapters`]) are swapped in whole the same way. Writers: the
//! monitor tasks (health, scrape), the peering task and the reload path; readers: every routing
//! decision, the admin endpoints and the Prometheus collector.

pub mod adapters;
pub mod drift;
pub mod monitor;
pub mod vllm_metrics;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use arc_swap::{ArcSwap, ArcSwapOption};
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::Instant;

use adapters::{AdapterCatalog, AdapterSlots};

/// One replica as configured: where it listens, what it serves, where it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSpec {
    /// The `ip:port` Envoy knows the replica by; also the value of the destination header.
    pub address: SocketAddr,
    /// Served model names, LoRA adapters included.
    pub models: Vec<String>,
    /// The node (machine) the replica runs on, when known.
    pub node: Option<String>,
}

/// What the replica's last `/health` probe said.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Not probed yet; not a candidate.
    Unknown,
    Healthy,
    Unhealthy,
}

impl Health {
    fn to_u8(self) -> u8 {
        match self {
            Health::Unknown => 0,
            Health::Healthy => 1,
            Health::Unhealthy => 2,
        }
    }

    fn from_u8(value: u8) -> Health {
        match value {
            1 => Health::Healthy,
            2 => Health::Unhealthy,
            _ => Health::Unknown,
        }
    }
}

/// The engine's own view of its load, from one `/metrics` scrape. A series missing from the
/// scrape is `None`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EngineLoad {
    /// `vllm:num_requests_waiting`, summed over engines.
    pub waiting: Option<f64>,
    /// `vllm:num_requests_running`, summed over engines.
    pub running: Option<f64>,
    /// `vllm:kv_cache_usage_perc` (0–1), the fullest engine's.
    pub kv_cache_usage: Option<f64>,
}

#[derive(Debug)]
struct Scrape {
    load: EngineLoad,
    /// `vllm:lora_requests_info`, when the engine serves adapters.
    adapter_slots: Option<Arc<AdapterSlots>>,
    at: Instant,
    /// [`Replica::started`] and [`Replica::ended`] when the scrape was stored.
    started: u64,
    ended: u64,
}

/// A replica and its live state. Shared by `Arc` between snapshots, guards and tasks.
#[derive(Debug)]
pub struct Replica {
    spec: ReplicaSpec,
    endpoint: String,
    health: AtomicU8,
    /// `/health` probes timed out in a row (only the health-check task writes it).
    slow_probes: AtomicU32,
    in_flight: AtomicU32,
    /// Requests the router's peers have in flight here, as they last reported
    /// ([`crate::peers`]); 0 without peers.
    peer_in_flight: AtomicU32,
    /// Requests started and ended here, ever: their change since a scrape is what the engine
    /// has not reported yet.
    started: AtomicU64,
    ended: AtomicU64,
    last_scrape: ArcSwapOption<Scrape>,
    /// The adapters its last good `/v1/models` listed; `None` until one answered.
    adapters: ArcSwapOption<AdapterCatalog>,
    /// Expected against engine-observed prefix-cache hits.
    drift: drift::CacheDrift,
    /// The engine's KV cache size in blocks (`vllm:cache_config_info`); 0 until a scrape told.
    cache_blocks: AtomicU64,
}

impl Replica {
    pub fn new(spec: ReplicaSpec) -> Replica {
        Replica {
            endpoint: spec.address.to_string(),
            spec,
            health: AtomicU8::new(Health::Unknown.to_u8()),
            slow_probes: AtomicU32::new(0),
            in_flight: AtomicU32::new(0),
            peer_in_flight: AtomicU32::new(0),
            started: AtomicU64::new(0),
            ended: AtomicU64::new(0),
            last_scrape: ArcSwapOption::empty(),
            adapters: ArcSwapOption::empty(),
            drift: drift::CacheDrift::default(),
            cache_blocks: AtomicU64::new(0),
        }
    }

    /// The engine's KV cache size in blocks, as its last scrape that showed it said; `None`
    /// before any did. Kept when a later scrape fails: the size is set at the engine's start.
    pub fn cache_blocks(&self) -> Option<u64> {
        Some(self.cache_blocks.load(Ordering::Relaxed)).filter(|&b| b > 0)
    }

    /// Records the engine's KV cache size in blocks (a restarted engine may have another).
    pub fn set_cache_blocks(&self, blocks: u64) {
        self.cache_blocks.store(blocks, Ordering::Relaxed);
    }

    /// What llmgw expects this replica's prefix cache to hit, and what its engine reports.
    pub fn drift(&self) -> &drift::CacheDrift {
        &self.drift
    }

    pub fn spec(&self) -> &ReplicaSpec {
        &self.spec
    }

    /// `ip:port`, as the destination header carries it.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn serves(&self, model: &str) -> bool {
        self.spec.models.iter().any(|m| m == model)
    }

    pub fn health(&self) -> Health {
        Health::from_u8(self.health.load(Ordering::Relaxed))
    }

    pub fn is_healthy(&self) -> bool {
        self.health() == Health::Healthy
    }

    /// Records a probe result; returns the previous value.
    pub fn set_health(&self, health: Health) -> Health {
        Health::from_u8(self.health.swap(health.to_u8(), Ordering::Relaxed))
    }

    /// After a `/health` probe: counts it when it timed out, else ends the streak; returns how
    /// many timed out in a row.
    pub fn record_probe_timeout(&self, timed_out: bool) -> u32 {
        if timed_out {
            self.slow_probes
                .fetch_add(1, Ordering::Relaxed)
                .saturating_add(1)
        } else {
            self.slow_probes.store(0, Ordering::Relaxed);
            0
        }
    }

    /// Requests llmgw sent here whose ext_proc stream has not ended yet.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests the router's peers reported in flight here ([`crate::peers`]).
    pub fn peer_in_flight(&self) -> u32 {
        self.peer_in_flight.load(Ordering::Relaxed)
    }

    /// Records the sum of what the peers last reported in flight here.
    pub fn set_peer_in_flight(&self, requests: u32) {
        self.peer_in_flight.store(requests, Ordering::Relaxed);
    }

    /// Counts one more request in flight until the guard is dropped.
    pub fn start_request(self: &Arc<Self>) -> InFlightGuard {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.started.fetch_add(1, Ordering::Relaxed);
        InFlightGuard {
            replica: Arc::clone(self),
        }
    }

    /// Stores a scrape taken at `at`.
    pub fn record_scrape(&self, load: EngineLoad, at: Instant) {
        self.record_scrape_with_adapters(load, None, at);
    }

    /// Stores a scrape taken at `at`, with the engine's adapter slots when it reported them.
    pub fn record_scrape_with_adapters(
        &self,
        load: EngineLoad,
        adapter_slots: Option<AdapterSlots>,
        at: Instant,
    ) {
        self.last_scrape.store(Some(Arc::new(Scrape {
            load,
            adapter_slots: adapter_slots.map(Arc::new),
            at,
            started: self.started.load(Ordering::Relaxed),
            ended: self.ended.load(Ordering::Relaxed),
        })));
    }

    /// Forgets the last scrape (the replica stopped answering).
    pub fn forget_scrape(&self) {
        self.last_scrape.store(None);
    }

    /// The engine's load if it was scraped within `staleness` of `now`; `None` means unknown,
    /// which scorers must not mistake for idle.
    pub fn engine_load(&self, now: Instant, staleness: Duration) -> Option<EngineLoad> {
        let guard = self.last_scrape.load();
        let scrape = guard.as_ref()?;
        (now.saturating_duration_since(scrape.at) <= staleness).then_some(scrape.load)
    }

    /// The engine's adapter slots if it reported them in a scrape within `staleness` of `now`.
    pub fn adapter_slots(&self, now: Instant, staleness: Duration) -> Option<Arc<AdapterSlots>> {
        let guard = self.last_scrape.load();
        let scrape = guard.as_ref()?;
        if now.saturating_duration_since(scrape.at) > staleness {
            return None;
        }
        scrape.adapter_slots.clone()
    }

    /// The adapters the replica listed last; `None` before its `/v1/models` first answered.
    pub fn adapters(&self) -> Option<Arc<AdapterCatalog>> {
        self.adapters.load_full()
    }

    /// Stores what the replica's `/v1/models` listed; returns whether it changed.
    pub fn set_adapters(&self, catalog: AdapterCatalog) -> bool {
        let changed = self.adapters.load().as_deref() != Some(&catalog);
        if changed {
            self.adapters.store(Some(Arc::new(catalog)));
        }
        changed
    }

    /// The engine's waiting queue now, estimated: the last fresh scrape's count, plus the
    /// requests started here since (each may be waiting), minus those that ended since (each
    /// let a waiting one run), never below 0. So a burst between two scrapes is counted
    /// before the next scrape reports it. `None` when the load is unknown.
    pub fn waiting_estimate(&self, now: Instant, staleness: Duration) -> Option<f64> {
        let guard = self.last_scrape.load();
        let scrape = guard.as_ref()?;
        if now.saturating_duration_since(scrape.at) > staleness {
            return None;
        }
        let waiting = scrape.load.waiting?;
        let started = self
            .started
            .load(Ordering::Relaxed)
            .saturating_sub(scrape.started);
        let ended = self
            .ended
            .load(Ordering::Relaxed)
            .saturating_sub(scrape.ended);
        Some((waiting + started as f64 - ended as f64).max(0.0))
    }
}

/// Holds one in-flight request against a replica; dropping it ends the request.
#[derive(Debug)]
pub struct InFlightGuard {
    replica: Arc<Replica>,
}

impl InFlightGuard {
    pub fn replica(&self) -> &Arc<Replica> {
        &self.replica
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.replica.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.replica.ended.fetch_add(1, Ordering::Relaxed);
    }
}

/// An immutable view of the replica set.
#[derive(Debug, Default)]
pub struct PoolSnapshot {
    replicas: Vec<Arc<Replica>>,
    by_model: HashMap<String, Vec<Arc<Replica>>>,
}

impl PoolSnapshot {
    pub fn new(replicas: Vec<Arc<Replica>>) -> PoolSnapshot {
        let mut by_model: HashMap<String, Vec<Arc<Replica>>> = HashMap::new();
        for replica in &replicas {
            for model in &replica.spec.models {
                by_model
                    .entry(model.clone())
                    .or_default()
                    .push(Arc::clone(replica));
            }
        }
        PoolSnapshot { replicas, by_model }
    }

    pub fn replicas(&self) -> &[Arc<Replica>] {
        &self.replicas
    }

    /// Replicas serving `model`, healthy or not (empty when none does).
    pub fn serving(&self, model: &str) -> &[Arc<Replica>] {
        self.by_model.get(model).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Whether any replica serves `model`.
    pub fn serves_model(&self, model: &str) -> bool {
        self.by_model.contains_key(model)
    }

    pub fn find(&self, endpoint: &str) -> Option<&Arc<Replica>> {
        self.replicas.iter().find(|r| r.endpoint() == endpoint)
    }

    /// Every replica at `ip` (any port: a pod's data-parallel ranks), lowest port first.
    pub fn at_ip(&self, ip: std::net::IpAddr) -> Vec<&Arc<Replica>> {
        let mut at: Vec<&Arc<Replica>> = self
            .replicas
            .iter()
            .filter(|r| r.spec.address.ip() == ip)
            .collect();
        at.sort_by_key(|r| r.spec.address.port());
        at
    }

    pub fn any_healthy(&self) -> bool {
        self.replicas.iter().any(|r| r.is_healthy())
    }
}

/// The live replica set.
#[derive(Debug)]
pub struct Pool {
    snapshot: ArcSwap<PoolSnapshot>,
    metrics_staleness: Duration,
    /// Ticked when a replica's health flips or the set changes, so that readiness is
    /// event-driven instead of polled.
    health_changes: watch::Sender<()>,
}

impl Pool {
    pub fn new(specs: Vec<ReplicaSpec>, metrics_staleness: Duration) -> Pool {
        let replicas = dedup(specs)
            .into_iter()
            .map(|s| Arc::new(Replica::new(s)))
            .collect();
        Pool {
            snapshot: ArcSwap::from_pointee(PoolSnapshot::new(replicas)),
            metrics_staleness,
            health_changes: watch::Sender::new(()),
        }
    }

    /// Wakes every [`Pool::health_changes`] receiver. Called by the health monitor when a
    /// replica's health flips, and by [`Pool::set_replicas`].
    pub fn announce_health_change(&self) {
        self.health_changes.send_modify(|_| {});
    }

    /// A receiver whose `changed()` completes after the next [`Pool::announce_health_change`].
    pub fn health_changes(&self) -> watch::Receiver<()> {
        self.health_changes.subscribe()
    }

    /// The current replica set (lock-free).
    pub fn snapshot(&self) -> Arc<PoolSnapshot> {
        self.snapshot.load_full()
    }

    /// How old a scrape may be and still count.
    pub fn metrics_staleness(&self) -> Duration {
        self.metrics_staleness
    }

    /// Replaces the replica set. Replicas whose spec is unchanged keep their state (health,
    /// in-flight count, last scrape); new ones start unprobed. Returns whether anything changed.
    pub fn set_replicas(&self, specs: Vec<ReplicaSpec>) -> bool {
        let specs = dedup(specs);
        let current = self.snapshot();
        let unchanged = specs.len() == current.replicas.len()
            && specs
                .iter()
                .zip(&current.replicas)
                .all(|(s, r)| s == &r.spec);
        if unchanged {
            return false;
        }
        let replicas = specs
            .into_iter()
            .map(|spec| {
                current
                    .replicas
                    .iter()
                    .find(|r| r.spec == spec)
                    .cloned()
                    .unwrap_or_else(|| Arc::new(Replica::new(spec)))
            })
            .collect();
        self.snapshot.store(Arc::new(PoolSnapshot::new(replicas)));
        self.announce_health_change();
        true
    }
}

/// The sources of the replica set: the configuration (file and flags) and each discovery source
/// (a Kubernetes Service). Each source replaces only its own list; the pool gets their union,
/// and `on_change` (the feed's node map) sees every published union. Sources publish rarely
/// (a reload, a poll), so one lock serialises them; routing never takes it.
pub struct ReplicaSources {
    pool: Arc<Pool>,
    lists: Mutex<Vec<Vec<ReplicaSpec>>>,
    on_change: OnReplicasChange,
}

/// Told every union [`ReplicaSources`] publishes.
type OnReplicasChange = Box<dyn Fn(&[ReplicaSpec]) + Send + Sync>;

impl std::fmt::Debug for ReplicaSources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaSources")
            .field("lists", &self.lists)
            .finish_non_exhaustive()
    }
}

/// The configuration's source (file and flags) in [`ReplicaSources`].
pub const CONFIG_SOURCE: usize = 0;

impl ReplicaSources {
    /// `sources` lists, the first ([`CONFIG_SOURCE`]) holding what the pool holds now.
    pub fn new(
        pool: Arc<Pool>,
        sources: usize,
        on_change: impl Fn(&[ReplicaSpec]) + Send + Sync + 'static,
    ) -> ReplicaSources {
        let mut lists = vec![Vec::new(); sources.max(1)];
        lists[CONFIG_SOURCE] = pool
            .snapshot()
            .replicas
            .iter()
            .map(|r| r.spec.clone())
            .collect();
        ReplicaSources {
            pool,
            lists: Mutex::new(lists),
            on_change: Box::new(on_change),
        }
    }

    /// Replaces one source's list and publishes the union; returns whether the pool changed.
    /// An unknown source index is ignored.
    pub fn set(&self, source: usize, replicas: Vec<ReplicaSpec>) -> bool {
        let mut lists = self.lists.lock();
        let Some(list) = lists.get_mut(source) else {
            return false;
        };
        *list = replicas;
        let union: Vec<ReplicaSpec> = lists.iter().flatten().cloned().collect();
        let changed = self.pool.set_replicas(union.clone());
        (self.on_change)(&union);
        changed
    }
}

/// Merges specs naming the same address (e.g. `--replica base=A --replica lora=A`), keeping the
/// first-seen order.
fn dedup(specs: Vec<ReplicaSpec>) -> Vec<ReplicaSpec> {
    let mut merged: Vec<ReplicaSpec> = Vec::with_capacity(specs.len());
    for spec in specs {
        match merged.iter_mut().find(|m| m.address == spec.address) {
            Some(existing) => {
                for model in spec.models {
                    if !existing.models.contains(&model) {
                        existing.models.push(model);
                    }
                }
                if existing.node.is_none() {
                    existing.node = spec.node;
                }
            }
            None => merged.push(spec),
        }
    }
    merged
}

/// A replica's state as `/debug` shows it.
#[derive(Debug, Serialize)]
pub struct ReplicaView {
    pub endpoint: String,
    pub models: Vec<String>,
    pub node: Option<String>,
    pub health: Health,
    pub in_flight: u32,
    /// What the router's peers reported in flight here.
    #[serde(skip_serializing_if = "is_zero")]
    pub peer_in_flight: u32,
    /// `None` when the last scrape is missing or stale.
    pub engine: Option<EngineLoad>,
    /// The LoRA adapters its `/v1/models` listed: name → the path their blocks are hashed
    /// with (empty before the first listing, or when it serves none).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub adapters: std::collections::BTreeMap<String, String>,
    /// Active adapters and slots, from `vllm:lora_requests_info`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapter_slots: Option<AdapterSlots>,
}

impl PoolSnapshot {
    /// Every replica's state, for `/debug`.
    pub fn views(&self, now: Instant, staleness: Duration) -> Vec<ReplicaView> {
        self.replicas
            .iter()
            .map(|r| ReplicaView {
                endpoint: r.endpoint.clone(),
                models: r.spec.models.clone(),
                node: r.spec.node.clone(),
                health: r.health(),
                in_flight: r.in_flight(),
                peer_in_flight: r.peer_in_flight(),
                engine: r.engine_load(now, staleness),
                adapters: r
                    .adapters()
                    .map(|catalog| catalog.paths().collect())
                    .unwrap_or_default(),
                adapter_slots: r.adapter_slots(now, staleness).as_deref().cloned(),
            })
            .collect()
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests;
