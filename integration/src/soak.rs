//! The fault soak (`make soak`, and a short run in `make test`): the whole system on loopback
//! (Envoy, two routers, the agent, four simulated replicas serving vLLM's replay socket) under
//! a steady request rate while a schedule of faults runs, one after another: a replica killed
//! and restarted, the agent killed and restarted, the router Envoy asks killed and restarted, a
//! replica's prefix cache reset, `/tokenize` made slow on every replica, and a hostile feed
//! client claiming the agent's node with counts of u32::MAX. Per fault it reports the requests
//! sent during the fault's window and how many got no 2xx, how long from the fault's end until
//! every router's index equals every replica's own block list again, and the routers' RSS at
//! the window's end; the run ends by itself.
//!
//! Concurrency model: one task sends requests on a fixed schedule (each request its own task,
//! so a slow answer never delays the next) and records outcomes behind a short mutex; the
//! fault schedule, the convergence checks and the RSS readings run on the caller's task.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use llmgw_feed_proto::v1 as pb;
use parking_lot::Mutex;
use serde_json::json;

use crate::feed_client::{FeedClient, refusal};
use crate::procfs::parse_status_rss_mib;
use crate::system::{self, System, SystemConfig};

/// What the soak runs.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    /// Requests per second through Envoy.
    pub rate: f64,
    /// How long each fault's window lasts at least (the fault, then the wait for the indexes).
    pub fault_window: Duration,
    /// The longest wait for the indexes to equal the replicas' truth after a fault.
    pub converge_within: Duration,
    /// Quiet time with the load running before the first fault and after the last.
    pub settle: Duration,
}

impl Default for SoakConfig {
    fn default() -> Self {
        SoakConfig {
            rate: 20.0,
            fault_window: Duration::from_secs(10),
            converge_within: Duration::from_secs(20),
            settle: Duration::from_secs(5),
        }
    }
}

/// The faults, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    ReplicaRestart,
    AgentRestart,
    RouterRestart,
    PrefixCacheReset,
    SlowTokenize,
    HostileFeed,
}

impl Fault {
    pub const ALL: [Fault; 6] = [
        Fault::ReplicaRestart,
        Fault::AgentRestart,
        Fault::RouterRestart,
        Fault::PrefixCacheReset,
        Fault::SlowTokenize,
        Fault::HostileFeed,
    ];

    pub fn describe(self) -> &'static str {
        match self {
            Fault::ReplicaRestart => "replica killed and restarted",
            Fault::AgentRestart => "agent killed and restarted",
            Fault::RouterRestart => "router (Envoy's) killed and restarted",
            Fault::PrefixCacheReset => "replica's prefix cache reset",
            Fault::SlowTokenize => "/tokenize 300 ms slow on every replica for 3 s",
            Fault::HostileFeed => "hostile feed client (u32::MAX counts, node takeover)",
        }
    }
}

/// One fault's outcome.
#[derive(Debug, Clone)]
pub struct FaultReport {
    pub fault: Fault,
    /// Requests sent during the fault's window, and those that got no 2xx.
    pub requests: usize,
    pub failed: usize,
    /// Statuses of the failures (0: no response).
    pub failure_statuses: Vec<u16>,
    /// From the fault's end (the process back, the cache reset, the hostile stream refused) to
    /// every router's index equal to every replica's blocks; `None`: not within the bound.
    pub converged_after: Option<Duration>,
    /// Each router's RSS at the window's end, MiB.
    pub rss_mib: Vec<f64>,
    /// When the indexes never equalled the replicas: how they differed at the bound.
    pub divergence: Option<String>,
}

/// The whole run.
#[derive(Debug, Clone)]
pub struct SoakReport {
    pub faults: Vec<FaultReport>,
    /// Whether every router refused the hostile client's engine over the block ceiling.
    pub hostile_refused: bool,
    /// Requests and failures outside any fault's window.
    pub quiet_requests: usize,
    pub quiet_failed: usize,
    /// Each router's RSS after the first settle and at the end, MiB (router 0 restarts in the
    /// run, so its figure after that is a fresh process's).
    pub rss_start_mib: Vec<f64>,
    pub rss_end_mib: Vec<f64>,
    pub duration: Duration,
}

impl SoakReport {
    /// The goals a run must meet, as the reasons it missed them (empty: all met): no non-2xx
    /// outside a replica's restart (whose in-flight requests may fail, at most `in_flight_allowance`),
    /// every index equal to the truth within the bound after every fault, and no router that
    /// ran throughout grown by more than `rss_growth_mib`.
    pub fn missed(&self, in_flight_allowance: usize, rss_growth_mib: f64) -> Vec<String> {
        let mut missed = Vec::new();
        for f in &self.faults {
            let allowed = if f.fault == Fault::ReplicaRestart {
                in_flight_allowance
            } else {
                0
            };
            if f.failed > allowed {
                missed.push(format!(
                    "{}: {} non-2xx ({:?}), at most {allowed} allowed",
                    f.fault.describe(),
                    f.failed,
                    f.failure_statuses
                ));
            }
            if f.converged_after.is_none() {
                missed.push(format!(
                    "{}: the indexes never equalled the replicas",
                    f.fault.describe()
                ));
            }
        }
        if !self.hostile_refused {
            missed.push("a router did not refuse the hostile engine over the ceiling".to_owned());
        }
        if self.quiet_failed > 0 {
            missed.push(format!("{} non-2xx outside the faults", self.quiet_failed));
        }
        // Router 0 restarts during the run; the others ran throughout.
        for (i, (start, end)) in self
            .rss_start_mib
            .iter()
            .zip(&self.rss_end_mib)
            .enumerate()
            .skip(1)
        {
            if end - start > rss_growth_mib {
                missed.push(format!("router {i} grew from {start:.1} to {end:.1} MiB"));
            }
        }
        missed
    }

    /// A markdown table, one row per fault.
    pub fn table(&self) -> String {
        let mut out = String::from(
            "| fault | requests | non-2xx | index equal to the replicas after | routers' RSS (MiB) |\n|---|---|---|---|---|\n",
        );
        for f in &self.faults {
            let converged = f
                .converged_after
                .map_or("not within the bound".to_owned(), |d| {
                    format!("{:.2} s", d.as_secs_f64())
                });
            let failed = if f.failed == 0 {
                "0".to_owned()
            } else {
                format!("{} ({:?})", f.failed, f.failure_statuses)
            };
            let rss: Vec<String> = f.rss_mib.iter().map(|r| format!("{r:.1}")).collect();
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                f.fault.describe(),
                f.requests,
                failed,
                converged,
                rss.join(", ")
            ));
        }
        out.push_str(&format!(
            "\nOutside the faults: {} requests, {} non-2xx. Routers' RSS after settling {:?} MiB, at the end {:?} MiB; {:.0} s in all.\n",
            self.quiet_requests,
            self.quiet_failed,
            self.rss_start_mib.iter().map(|r| (r * 10.0).round() / 10.0).collect::<Vec<_>>(),
            self.rss_end_mib.iter().map(|r| (r * 10.0).round() / 10.0).collect::<Vec<_>>(),
            self.duration.as_secs_f64()
        ));
        out
    }
}

/// One request's outcome: when it was sent and its status (0: no response).
type Outcome = (Instant, u16);

/// Sends requests at `rate` through Envoy until `stop` is set: eight tenants, each a long
/// shared system prompt and a growing conversation, so caches matter as in production.
async fn load(
    envoy: SocketAddr,
    rate: f64,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("http client");
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let mut n: usize = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        tick.tick().await;
        n += 1;
        let tenant = n % 8;
        let turn = (n / 8) % 12;
        let system: String = (0..48).map(|w| format!("tenant{tenant}word{w} ")).collect();
        let history: String = (0..turn)
            .map(|t| format!("turn {t} of tenant {tenant}. "))
            .collect();
        let body = json!({
            "model": "tiny",
            "prompt": format!("{system}{history}now turn {turn}"),
            "max_tokens": 4,
        });
        let client = client.clone();
        let outcomes = Arc::clone(&outcomes);
        tokio::spawn(async move {
            let sent = Instant::now();
            let status = match client
                .post(format!("http://{envoy}/v1/completions"))
                .json(&body)
                .send()
                .await
            {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let _ = response.bytes().await;
                    status
                }
                Err(_) => 0,
            };
            outcomes.lock().push((sent, status));
        });
    }
}

fn rss_mib(pid: Option<u32>) -> f64 {
    pid.and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok())
        .map_or(0.0, |status| parse_status_rss_mib(&status).0)
}

fn routers_rss(system: &System) -> Vec<f64> {
    (0..system.routers().len())
        .map(|i| rss_mib(system.router_pid(i)))
        .collect()
}

/// A hostile node: claims the agent's node on every router (taking it over from the agent)
/// with one engine on a real replica and a snapshot of one block of count u32::MAX, then goes
/// away. Returns whether every router refused the engine (and stayed up).
async fn hostile_feed(system: &System) -> bool {
    let engine = system.sims[0].addr.to_string();
    let hello = pb::agent_message::Body::Hello(pb::Hello {
        node: system.config.node.clone(),
        agent_version: "hostile".into(),
        engines: vec![pb::EngineInfo {
            engine: engine.clone(),
            replica: engine.clone(),
            model: system.config.model.clone(),
            // The router's own settings, so that the ceiling is what refuses it.
            block_size: u32::try_from(system.config.block_size).unwrap_or(16),
            hash_algo: "sha256_cbor".into(),
            hash_seed_set: true,
        }],
    });
    let snapshot = pb::agent_message::Body::Snapshot(pb::Snapshot {
        engine,
        blocks: vec![pb::Block {
            hash: 1,
            count: u32::MAX,
            ..pb::Block::default()
        }],
        ..pb::Snapshot::default()
    });
    let mut refused_everywhere = true;
    for router in system.routers() {
        let Ok(mut stream) = FeedClient::connect(router.feed).await else {
            return false;
        };
        let refused = match stream.send(hello.clone()).await {
            Ok(_) => stream
                .send(snapshot.clone())
                .await
                .is_ok_and(|replies| refusal(&replies).is_some()),
            Err(_) => false,
        };
        refused_everywhere &= refused;
    }
    refused_everywhere
}

/// Per replica and router where they differ: blocks the replica holds that the index lacks, and
/// blocks the index holds that the replica does not.
async fn divergence(system: &System) -> String {
    let mut out = Vec::new();
    for sim in &system.sims {
        let truth: std::collections::BTreeSet<u64> =
            system::sim_blocks(sim).await.into_iter().collect();
        for (i, router) in system.routers().into_iter().enumerate() {
            let held: std::collections::BTreeSet<u64> = system::router_blocks_at(router, sim.addr)
                .await
                .into_iter()
                .collect();
            let missing = truth.difference(&held).count();
            let extra = held.difference(&truth).count();
            if missing + extra > 0 {
                out.push(format!(
                    "replica {} on router {i}: {missing} missing, {extra} extra of {}",
                    sim.addr,
                    truth.len()
                ));
            }
        }
    }
    out.join("; ")
}

/// Runs the soak; panics (test-support code) only when the system cannot start or restart a
/// process.
pub async fn run(config: SoakConfig) -> SoakReport {
    let begun = Instant::now();
    let mut system = system::start(SystemConfig {
        routers: 2,
        blocks_per_replica: 256,
        replay: true,
        ..SystemConfig::default()
    })
    .await;
    let outcomes: Arc<Mutex<Vec<Outcome>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let loader = tokio::spawn(load(
        system.envoy,
        config.rate,
        Arc::clone(&outcomes),
        Arc::clone(&stop),
    ));
    tokio::time::sleep(config.settle).await;
    let rss_start_mib = routers_rss(&system);

    let mut windows: Vec<(Instant, Instant)> = Vec::new();
    let mut hostile_refused = false;
    let mut faults = Vec::new();
    for fault in Fault::ALL {
        let start = Instant::now();
        match fault {
            Fault::ReplicaRestart => {
                system.restart_replica(0);
            }
            Fault::AgentRestart => {
                system.kill_agent();
                tokio::time::sleep(Duration::from_secs(1)).await;
                system.restart_agent();
            }
            Fault::RouterRestart => {
                system.kill_router(0);
                tokio::time::sleep(Duration::from_secs(1)).await;
                system.restart_router(0);
            }
            Fault::PrefixCacheReset => {
                let url = format!("{}/reset_prefix_cache", system.sims[1].url());
                let _ = reqwest::Client::new().post(url).send().await;
            }
            Fault::SlowTokenize => {
                let client = reqwest::Client::new();
                for ms in [300, 0] {
                    for sim in &system.sims {
                        let url = format!("{}/sim/tokenize_delay", sim.url());
                        let _ = client.post(url).json(&json!({ "ms": ms })).send().await;
                    }
                    if ms > 0 {
                        tokio::time::sleep(Duration::from_secs(3)).await;
                    }
                }
            }
            Fault::HostileFeed => {
                hostile_refused = hostile_feed(&system).await;
            }
        }
        let fault_done = Instant::now();
        let converged = system::converged(&system, config.converge_within).await;
        let converged_after = converged.then(|| fault_done.elapsed());
        let divergence = if converged {
            None
        } else {
            Some(divergence(&system).await)
        };
        let end = (start + config.fault_window).max(Instant::now());
        tokio::time::sleep(end.saturating_duration_since(Instant::now())).await;
        windows.push((start, end));
        faults.push(FaultReport {
            fault,
            requests: 0,
            failed: 0,
            failure_statuses: Vec::new(),
            converged_after,
            rss_mib: routers_rss(&system),
            divergence,
        });
    }
    tokio::time::sleep(config.settle).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = loader.await;
    // Let the last requests answer.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let outcomes = outcomes.lock().clone();
    let (mut quiet_requests, mut quiet_failed) = (0, 0);
    for (sent, status) in outcomes {
        let ok = (200..300).contains(&status);
        match windows.iter().position(|(a, b)| sent >= *a && sent < *b) {
            Some(i) => {
                faults[i].requests += 1;
                if !ok {
                    faults[i].failed += 1;
                    faults[i].failure_statuses.push(status);
                }
            }
            None => {
                quiet_requests += 1;
                quiet_failed += usize::from(!ok);
            }
        }
    }
    SoakReport {
        faults,
        hostile_refused,
        quiet_requests,
        quiet_failed,
        rss_start_mib,
        rss_end_mib: routers_rss(&system),
        duration: begun.elapsed(),
    }
}
