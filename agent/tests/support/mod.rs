//! Shared by the agent's integration tests: a router's feed service over an index stand-in, an
//! engine publisher with an agent mirroring it, and the recorded vLLM stream.
#![allow(dead_code)] // each test binary uses its own subset
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a panic is a failed test"
)]

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use llmgw::blockhash::ExternalHash;
use llmgw::feed::{FeedConfig, FeedService};
use llmgw::kvindex::{KvEventSink, Medium};
use llmgw::tls::ServerTls;
use llmgw_agent::capture::{Capture, Frame};
use llmgw_agent::config::{AgentArgs, EngineSpec};
use llmgw_agent::daemon::Agent;
use llmgw_agent::engine::Update;
use llmgw_agent::metrics::Metrics;
use llmgw_agent::uplink::{self, UplinkConfig};
use llmgw_agent::wire::{KvEvent, decode_batch};
use llmgw_agent::zmq::Publisher;
use parking_lot::Mutex;
use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use tonic::transport::ClientTlsConfig;

pub const REPLICA: &str = "10.0.0.5:8000";

pub type Copies = HashMap<(ExternalHash, Medium), u32>;

/// The index stand-in: copies per replica, exactly as the sink contract counts them.
#[derive(Default)]
pub struct Index {
    pub held: Mutex<HashMap<String, Copies>>,
}

impl KvEventSink for Index {
    fn stored_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        let mut h = self.held.lock();
        let r = h.entry(replica.to_owned()).or_default();
        for &(x, n) in blocks {
            *r.entry((x, medium)).or_insert(0) += n;
        }
    }
    fn removed_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        let mut h = self.held.lock();
        let r = h.entry(replica.to_owned()).or_default();
        for &(x, n) in blocks {
            match r.get_mut(&(x, medium)) {
                Some(held) if *held > n => *held -= n,
                Some(held) if *held == n => {
                    r.remove(&(x, medium));
                }
                _ => panic!("router removed {n} copies of {x} from {replica} without holding them"),
            }
        }
    }
    fn cleared(&self, replica: &str) {
        self.held.lock().remove(replica);
    }
}

impl Index {
    pub fn hashes(&self, replica: &str) -> HashSet<u64> {
        self.held
            .lock()
            .get(replica)
            .map(|r| r.keys().map(|(h, _)| h.0).collect())
            .unwrap_or_default()
    }
}

pub struct Router {
    pub index: Arc<Index>,
    pub feed: FeedService,
    pub addr: String,
    pub task: JoinHandle<()>,
}

impl Drop for Router {
    fn drop(&mut self) {
        self.feed.shutdown();
        self.task.abort();
    }
}

/// A router feed on `addr` (a free port when `None`) that knows `REPLICA` on node "n1".
pub async fn router(addr: Option<&str>, token: Option<&str>) -> Router {
    router_tls(addr, token, None).await
}

/// The same, serving TLS when `tls` is given.
pub async fn router_tls(addr: Option<&str>, token: Option<&str>, tls: Option<ServerTls>) -> Router {
    let (index, feed) = feed_for_n1(token);
    serve_router(addr, (index, feed.with_tls(tls))).await
}

/// An index stand-in and a feed service knowing `REPLICA` on node "n1".
pub fn feed_for_n1(token: Option<&str>) -> (Arc<Index>, FeedService) {
    feed_for("n1", &[REPLICA], token)
}

/// An index stand-in and a feed service knowing `replicas` on `node`.
pub fn feed_for(node: &str, replicas: &[&str], token: Option<&str>) -> (Arc<Index>, FeedService) {
    let index = Arc::new(Index::default());
    let nodes = [(
        node.to_owned(),
        replicas
            .iter()
            .map(|r| (*r).to_owned())
            .collect::<HashSet<_>>(),
    )]
    .into_iter()
    .collect();
    let feed = FeedService::new(
        index.clone(),
        FeedConfig {
            limits: llmgw::feed::FeedLimits::default(),
            token: token.map(str::to_owned),
            nodes,
            grace: Duration::from_secs(60),
            silence: llmgw::feed::DEFAULT_SILENCE,
        },
    );
    (index, feed)
}

/// Serves `feed` on `addr` (a free port when `None`).
pub async fn serve_router(addr: Option<&str>, (index, feed): (Arc<Index>, FeedService)) -> Router {
    let listener = tokio::net::TcpListener::bind(addr.unwrap_or("127.0.0.1:0"))
        .await
        .expect("router binds");
    let addr = listener.local_addr().expect("addr").to_string();
    let svc = feed.clone();
    let task = tokio::spawn(async move {
        let _ = svc.serve_with_listener(listener).await;
    });
    Router {
        index,
        feed,
        addr,
        task,
    }
}

pub fn frames() -> Vec<Frame> {
    Capture::parse(&llmgw::fixtures::read("vllm-0.32.0-capture.jsonl"))
        .expect("capture")
        .frames
}

pub fn final_set(frames: &[Frame]) -> HashSet<u64> {
    let mut held: HashMap<u64, u32> = HashMap::new();
    for f in frames {
        for e in decode_batch(&f.payload).expect("decodes").events {
            match e {
                KvEvent::BlockStored(s) => {
                    for h in s.block_hashes {
                        *held.entry(h.0).or_default() += 1;
                    }
                }
                KvEvent::BlockRemoved(r) => {
                    for h in r.block_hashes {
                        if let Some(n) = held.get_mut(&h.0) {
                            *n -= 1;
                            if *n == 0 {
                                held.remove(&h.0);
                            }
                        }
                    }
                }
                KvEvent::AllBlocksCleared(_) => held.clear(),
                KvEvent::Unknown { .. } => {}
            }
        }
    }
    held.into_keys().collect()
}

pub struct Node {
    pub agent: Arc<Agent>,
    pub publisher: Publisher,
    pub uplinks: Vec<JoinHandle<()>>,
}

impl Drop for Node {
    fn drop(&mut self) {
        for u in &self.uplinks {
            u.abort();
        }
    }
}

/// An engine publisher and an agent on node "n1" mirroring it as `replica`, uplinked to
/// `routers`.
pub async fn node(replica: &str, seed: &str, routers: &[&Router], token: Option<&str>) -> Node {
    node_tls(replica, seed, routers, token, None).await
}

/// The same, with TLS (and a client identity) towards the routers.
pub async fn node_tls(
    replica: &str,
    seed: &str,
    routers: &[&Router],
    token: Option<&str>,
    tls: Option<ClientTlsConfig>,
) -> Node {
    let publisher = Publisher::on_loopback("kv", true, 1000)
        .await
        .expect("publisher");
    let spec: EngineSpec = format!(
        "{replica}={},replay={}",
        publisher.endpoint,
        publisher.replay_endpoint.clone().expect("replay")
    )
    .parse()
    .expect("spec");
    let config = AgentArgs {
        node: Some("n1".into()),
        engines: vec![spec],
        topic: Some("kv".into()),
        hash_seed: Some(seed.into()),
        block_size: std::num::NonZeroUsize::new(32),
        ..AgentArgs::default()
    }
    .resolve()
    .expect("config");
    let agent = Arc::new(Agent::start(config).await.expect("agent"));
    let uplinks = routers
        .iter()
        .map(|r| {
            let mut cfg = UplinkConfig::new(r.addr.clone(), token.map(str::to_owned));
            cfg.tls = tls.clone();
            cfg.backoff_initial = Duration::from_millis(20);
            cfg.backoff_max = Duration::from_millis(200);
            tokio::spawn(uplink::run(Arc::clone(&agent), cfg))
        })
        .collect();
    // PUB drops messages until the agent's SUB has subscribed, which nothing reports.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let node = Node {
        agent,
        publisher,
        uplinks,
    };
    // Each uplink's first session has got somewhere: streaming (so its snapshots were taken
    // before anything was published), or failed.
    for r in routers {
        eventually("the uplink's first session", || {
            connected(&node, &r.addr) == 1 || uplink_errors(&node, &r.addr, None) >= 1
        })
        .await;
    }
    node
}

/// The sum of the agent's samples whose series starts with `series` (name and labels so far).
pub fn agent_metric(node: &Node, series: &str) -> f64 {
    node.agent
        .metrics
        .encode()
        .lines()
        .filter_map(|l| l.strip_prefix(series))
        .filter_map(|rest| rest.rsplit_once(' '))
        .filter_map(|(_, value)| value.parse::<f64>().ok())
        .sum()
}

/// Whether the agent's uplink to `router` is streaming (1) or not (0).
pub fn connected(node: &Node, router: &str) -> i64 {
    agent_metric(
        node,
        &format!("llmgw_agent_uplink_connected{{router=\"{router}\"}}"),
    ) as i64
}

/// Sessions to `router` that ended with `reason` (any reason when `None`).
pub fn uplink_errors(node: &Node, router: &str, reason: Option<&str>) -> u64 {
    let series = match reason {
        Some(reason) => {
            format!("llmgw_agent_uplink_errors_total{{router=\"{router}\",reason=\"{reason}\"}}")
        }
        None => format!("llmgw_agent_uplink_errors_total{{router=\"{router}\","),
    };
    agent_metric(node, &series) as u64
}

/// Deltas `router` has acknowledged to the agent.
pub fn acked_deltas(node: &Node, router: &str) -> u64 {
    agent_metric(
        node,
        &format!("llmgw_agent_event_to_router_seconds_count{{router=\"{router}\"}}"),
    ) as u64
}

/// The hashes the agent's (first) engine has flushed, pending changes excluded.
pub fn flushed_hashes(node: &Node) -> HashSet<u64> {
    node.agent.engines()[0]
        .snapshot()
        .snapshot
        .blocks
        .iter()
        .map(|(k, _)| k.hash.0)
        .collect()
}

/// Counts the deltas the agent flushes from its creation on (make it before publishing).
pub struct Flushed(Mutex<(broadcast::Receiver<Update>, u64)>);

impl Flushed {
    pub fn new(node: &Node) -> Flushed {
        Flushed(Mutex::new((node.agent.updates.subscribe(), 0)))
    }

    pub fn count(&self) -> u64 {
        let mut guard = self.0.lock();
        let (rx, n) = &mut *guard;
        loop {
            match rx.try_recv() {
                Ok(_) => *n += 1,
                Err(broadcast::error::TryRecvError::Lagged(missed)) => *n += missed,
                Err(_) => return *n,
            }
        }
    }
}

/// Waits until the agent has applied all `batches` and flushed them, and `router` has
/// acknowledged every delta in `flushed`: the router has seen all there was to see.
pub async fn all_acknowledged(node: &Node, router: &Router, batches: usize, flushed: &Flushed) {
    let engines = node.agent.engines();
    let engine = &engines[0];
    let applied = || {
        node.agent
            .metrics
            .batches
            .get_or_create(&Metrics::engine(&engine.id.0))
            .get()
    };
    eventually("every delta flushed and acknowledged", || {
        let keys: HashSet<_> = engine
            .snapshot()
            .snapshot
            .blocks
            .iter()
            .map(|(k, _)| *k)
            .collect();
        applied() == batches as u64
            && keys == engine.block_set()
            && acked_deltas(node, &router.addr) == flushed.count()
    })
    .await;
}

pub async fn publish(node: &mut Node, frames: &[Frame]) {
    for f in frames {
        node.publisher
            .publish(f.seq, &f.payload)
            .await
            .expect("publish");
    }
}

pub async fn eventually(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..300 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}
