//! The router's end of the agent feed (`llmgw.feed.v1.Feed/Stream`, see
//! `proto/llmgw/feed/v1/feed.proto`): applies each node agent's snapshots and deltas to the KV
//! index through [`KvEventSink`].
//!
//! Rules enforced here:
//! * with TLS configured ([`FeedService::with_tls`]), every connection is TLS, and with a
//!   client CA every agent must present a certificate that CA signed (see [`tls`]), and its
//!   Hello must claim a node that certificate names (else `PERMISSION_DENIED`, counted in
//!   `llmgw_feed_tls_refused_total{reason="node_not_in_cert"}`), unless turned off;
//! * the agent presents the shared token (`authorization: Bearer …`) when one is configured;
//! * a node may only report replicas configured on it ([`FeedConfig::nodes`]); others are
//!   refused (a `Refused` message, a metric and a log line) and their changes ignored;
//! * a snapshot replaces what the feed held for that engine; a delta applies only if it is the
//!   next of its engine's epoch (a new epoch must start with a reset); a delta out of order ends
//!   the stream with `DATA_LOSS`, so the agent reconnects and resends snapshots;
//! * only KV-cache group 0 (the full-attention group) reaches the index;
//! * a node whose streams have all been gone longer than [`FeedConfig::grace`] is dropped:
//!   its replicas are cleared from the index;
//! * the node → replica map follows configuration reloads ([`FeedService::set_nodes`]): an
//!   engine whose replica left its node is dropped from the index at once, and the streams of
//!   every node whose replicas changed are ended with `UNAVAILABLE`, so its agent reconnects
//!   and resends Hello and snapshots, judged against the new map.
//!
//! # Concurrency model
//! One tonic task per stream. All feed state (per node, per engine: epoch, seq and the blocks
//! held, so a replica shared by several data-parallel engines can be rebuilt after one of them
//! resets) sits behind one `parking_lot::Mutex`, held while one message is applied, never across
//! an `.await`. The index is written through the sink while that lock is held, so two streams
//! never interleave one replica's changes. A reaper task drops expired nodes.

#[cfg(test)]
mod tests;
pub mod tls;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use llmgw_feed_proto::v1 as pb;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::StreamExt as _;

use crate::blockhash::HashSettings;
use crate::models::ModelSettings;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::blockhash::ExternalHash;
use crate::kvindex::{KvEventSink, Medium};

pub use pb::feed_server::FeedServer;

/// The default address of the feed service.
pub const DEFAULT_FEED_ADDR: &str = "127.0.0.1:9003";

/// Node name → the replicas (`host:port`) configured on that node.
pub type NodeMap = HashMap<String, HashSet<String>>;

/// The node map of a replica list (replicas without a node are not fed by any agent).
pub fn node_map(replicas: &[crate::pool::ReplicaSpec]) -> NodeMap {
    let mut nodes = NodeMap::new();
    for replica in replicas {
        if let Some(node) = &replica.node {
            nodes
                .entry(node.clone())
                .or_default()
                .insert(replica.address.to_string());
        }
    }
    nodes
}

/// Who may report what.
#[derive(Debug, Clone)]
pub struct FeedConfig {
    /// The shared token agents must present; `None` accepts any agent (tests, loopback).
    pub token: Option<String>,
    /// The node map at start; [`FeedService::set_nodes`] replaces it.
    pub nodes: NodeMap,
    /// How long a node's state survives after its last stream ended.
    pub grace: Duration,
}

/// Counters of the feed (register them with [`FeedMetrics::register`]).
#[derive(Debug, Clone, Default)]
pub struct FeedMetrics {
    pub streams: Gauge,
    pub snapshots: Counter,
    pub deltas: Counter,
    pub refused: Counter,
    pub out_of_order: Counter,
    pub nodes_expired: Counter,
    /// Node maps applied after a configuration reload changed them.
    pub node_map_reloads: Counter,
    /// TLS handshakes refused, by reason (no client certificate, bad certificate, not TLS…).
    pub tls_refused: tls::TlsRefusals,
}

impl FeedMetrics {
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("llmgw_feed");
        r.register("streams", "Agent streams connected", self.streams.clone());
        r.register(
            "snapshots",
            "Engine snapshots applied",
            self.snapshots.clone(),
        );
        r.register("deltas", "Engine deltas applied", self.deltas.clone());
        r.register(
            "refused",
            "Engines refused: replica not configured on the agent's node",
            self.refused.clone(),
        );
        r.register(
            "out_of_order",
            "Deltas out of sequence (stream reset)",
            self.out_of_order.clone(),
        );
        r.register(
            "nodes_expired",
            "Nodes dropped after their grace period",
            self.nodes_expired.clone(),
        );
        r.register(
            "node_map_reloads",
            "Configuration reloads that changed the node to replica map",
            self.node_map_reloads.clone(),
        );
        r.register(
            "tls_refused",
            "TLS handshakes (and streams whose client certificate does not name the claimed node) refused on the feed port, by reason",
            self.tls_refused.clone(),
        );
    }
}

/// One engine's blocks as the feed applied them (group 0 only).
#[derive(Debug, Default)]
struct EngineView {
    replica: String,
    epoch: u64,
    seq: u64,
    blocks: HashMap<(ExternalHash, Medium), u32>,
}

#[derive(Debug, Default)]
struct NodeState {
    streams: usize,
    gone_since: Option<Instant>,
    engines: HashMap<String, EngineView>,
    refused: HashSet<String>,
}

#[derive(Default)]
struct State {
    nodes: HashMap<String, NodeState>,
    /// Which replicas each node may report (the configuration, swapped on reloads).
    configured: NodeMap,
}

/// The feed service; clone-cheap (shares its state).
#[derive(Clone)]
pub struct FeedService {
    sink: Arc<dyn KvEventSink>,
    config: Arc<FeedConfig>,
    state: Arc<Mutex<State>>,
    /// Flipped by [`FeedService::shutdown`]: every open stream then ends with `UNAVAILABLE`.
    stop: Arc<tokio::sync::watch::Sender<bool>>,
    /// Names of nodes whose streams must end (their replicas changed): they reconnect.
    kick: Arc<tokio::sync::broadcast::Sender<String>>,
    /// The router's own hash settings per model: an engine reporting others is refused, since
    /// its blocks could never match the hashes the router computes.
    expected: Arc<HashMap<String, HashSettings>>,
    /// TLS on the feed port; `None` serves plain text.
    tls: Option<tls::FeedTls>,
    /// The file the token came from, read again for each stream (a rotated Secret).
    token_file: Option<Arc<PathBuf>>,
    pub metrics: FeedMetrics,
}

fn medium_of(m: i32) -> Medium {
    if m == pb::Medium::Gpu as i32 {
        Medium::Gpu
    } else {
        Medium::from_vllm(Some("offloaded"))
    }
}

/// Why the feed server stopped.
#[derive(Debug, thiserror::Error)]
pub enum FeedServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("feed server failed: {0}")]
    Grpc(#[source] tonic::transport::Error),
}

/// A delta out of sequence: the stream must restart from snapshots.
struct OutOfOrder(String);

impl FeedService {
    pub fn new(sink: Arc<dyn KvEventSink>, config: FeedConfig) -> Self {
        let state = State {
            nodes: HashMap::new(),
            configured: config.nodes.clone(),
        };
        FeedService {
            sink,
            config: Arc::new(config),
            state: Arc::new(Mutex::new(state)),
            stop: Arc::new(tokio::sync::watch::channel(false).0),
            kick: Arc::new(tokio::sync::broadcast::channel(64).0),
            expected: Arc::default(),
            tls: None,
            token_file: None,
            metrics: FeedMetrics::default(),
        }
    }

    /// Reads the token from `path` again for each agent stream, so that a rotated token is
    /// accepted without a restart; while the file cannot be read the configured token stands.
    pub fn with_token_file(mut self, path: Option<PathBuf>) -> Self {
        self.token_file = path.map(Arc::new);
        self
    }

    /// The token agents must present now.
    fn current_token(&self) -> Option<String> {
        let fallback = || self.config.token.clone();
        let Some(path) = &self.token_file else {
            return fallback();
        };
        match std::fs::read_to_string(path.as_path()) {
            Ok(text) if !text.trim().is_empty() => Some(text.trim().to_owned()),
            Ok(_) => {
                tracing::warn!(path = %path.display(), "feed token file is empty; keeping the token read at start");
                fallback()
            }
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "cannot read the feed token file; keeping the token read at start");
                fallback()
            }
        }
    }

    /// Serves TLS (mutual TLS when `tls` has a client CA) instead of plain text.
    pub fn with_tls(mut self, tls: Option<tls::FeedTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Checks each engine's reported hash settings against the router's for its model.
    pub fn expect_settings(mut self, models: &[ModelSettings]) -> Self {
        self.expected = Arc::new(
            models
                .iter()
                .map(|m| (m.model.clone(), m.hashing.clone()))
                .collect(),
        );
        self
    }

    /// Why an engine's hashes cannot match the router's, if they cannot.
    fn settings_mismatch(&self, engine: &pb::EngineInfo) -> Option<String> {
        let want = self.expected.get(&engine.model)?;
        let mut problems = Vec::new();
        if engine.block_size != 0 && engine.block_size as usize != want.block_size.get() {
            problems.push(format!(
                "block size {} (router: {})",
                engine.block_size, want.block_size
            ));
        }
        if !engine.hash_algo.is_empty() && engine.hash_algo != want.algo.as_str() {
            problems.push(format!(
                "hash algo {} (router: {})",
                engine.hash_algo, want.algo
            ));
        }
        if engine.hash_seed_set != want.seed.is_some() {
            problems.push(format!(
                "PYTHONHASHSEED {} (router: {})",
                if engine.hash_seed_set { "set" } else { "unset" },
                if want.seed.is_some() { "set" } else { "unset" },
            ));
        }
        (!problems.is_empty()).then(|| {
            format!(
                "engine hash settings differ from the router's for model {:?}: {}",
                engine.model,
                problems.join(", ")
            )
        })
    }

    /// Ends every open stream (the router is going away); agents reconnect elsewhere or later
    /// and start again from snapshots.
    pub fn shutdown(&self) {
        self.stop.send_replace(true);
    }

    /// Serves the feed on `addr` until the server fails; also runs the reaper.
    pub async fn serve(self, addr: SocketAddr) -> Result<(), FeedServeError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| FeedServeError::Bind { addr, source })?;
        self.serve_with_listener(listener).await
    }

    /// Serves on an already-bound listener (tests bind 127.0.0.1:0), with TLS when configured.
    pub async fn serve_with_listener(
        self,
        listener: tokio::net::TcpListener,
    ) -> Result<(), FeedServeError> {
        let reaper = tokio::spawn(self.clone().reap_forever());
        let tls = self.tls.clone();
        let refused = self.metrics.tls_refused.clone();
        let server = tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .add_service(FeedServer::new(self));
        let result = match tls {
            Some(tls) => {
                server
                    .serve_with_incoming(tls::TlsIncoming::new(listener, tls, refused))
                    .await
            }
            None => {
                server
                    .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                    .await
            }
        };
        reaper.abort();
        result.map_err(FeedServeError::Grpc)
    }

    async fn reap_forever(self) {
        let period = (self.config.grace / 4).max(Duration::from_millis(10));
        loop {
            tokio::time::sleep(period).await;
            self.reap(Instant::now());
        }
    }

    /// Drops nodes gone longer than the grace period; returns how many.
    pub fn reap(&self, now: Instant) -> usize {
        let mut st = self.state.lock();
        let expired: Vec<String> = st
            .nodes
            .iter()
            .filter(|(_, n)| {
                n.streams == 0
                    && n.gone_since
                        .is_some_and(|t| now.duration_since(t) >= self.config.grace)
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in &expired {
            if let Some(node) = st.nodes.remove(name) {
                let replicas: HashSet<&String> =
                    node.engines.values().map(|e| &e.replica).collect();
                for r in replicas {
                    self.sink.cleared(r);
                }
                tracing::warn!(
                    node = name,
                    "agent gone past the grace period: node dropped"
                );
                self.metrics.nodes_expired.inc();
            }
        }
        expired.len()
    }

    /// Block hashes the feed holds per replica (for `/debug` and tests).
    pub fn replica_blocks(&self) -> HashMap<String, HashSet<ExternalHash>> {
        let st = self.state.lock();
        let mut out: HashMap<String, HashSet<ExternalHash>> = HashMap::new();
        for node in st.nodes.values() {
            for e in node.engines.values() {
                out.entry(e.replica.clone())
                    .or_default()
                    .extend(e.blocks.keys().map(|(h, _)| *h));
            }
        }
        out
    }

    fn allowed(st: &State, node: &str, replica: &str) -> bool {
        st.configured
            .get(node)
            .is_some_and(|rs| rs.contains(replica))
    }

    /// Applies a reloaded node map. Engines whose replica is no longer configured on their
    /// node are dropped (their replica cleared from the index and rebuilt from any other node
    /// still reporting it); every connected node whose replica set changed has its streams
    /// ended, so its agent reconnects and resends Hello and snapshots under the new map (an
    /// engine refused before may now be accepted). Returns whether the map changed.
    pub fn set_nodes(&self, nodes: NodeMap) -> bool {
        let mut kick = Vec::new();
        {
            let mut st = self.state.lock();
            if st.configured == nodes {
                return false;
            }
            let changed: HashSet<String> = st
                .configured
                .keys()
                .chain(nodes.keys())
                .filter(|n| st.configured.get(*n) != nodes.get(*n))
                .cloned()
                .collect();
            st.configured = nodes;
            let mut cleared: HashSet<String> = HashSet::new();
            for name in changed {
                let State { nodes, configured } = &mut *st;
                let Some(node) = nodes.get_mut(&name) else {
                    continue;
                };
                let allowed = configured.get(&name);
                let gone: Vec<String> = node
                    .engines
                    .iter()
                    .filter(|(_, e)| !allowed.is_some_and(|rs| rs.contains(&e.replica)))
                    .map(|(engine, _)| engine.clone())
                    .collect();
                for engine in gone {
                    if let Some(view) = node.engines.remove(&engine) {
                        tracing::warn!(
                            node = name,
                            engine,
                            replica = view.replica,
                            "replica no longer configured on the node: its blocks are dropped"
                        );
                        self.metrics.refused.inc();
                        node.refused.insert(engine);
                        cleared.insert(view.replica);
                    }
                }
                if node.streams > 0 {
                    kick.push(name);
                }
            }
            for replica in &cleared {
                self.sink.cleared(replica);
                for node in st.nodes.values() {
                    for e in node.engines.values().filter(|e| &e.replica == replica) {
                        self.store_all(replica, &e.blocks);
                    }
                }
            }
        }
        self.metrics.node_map_reloads.inc();
        for name in kick {
            tracing::info!(
                node = name,
                "node's replicas changed: asking its agent to resync"
            );
            let _ = self.kick.send(name);
        }
        true
    }

    /// Applies one agent message; returns what to send back.
    fn apply(
        &self,
        node: &mut Option<String>,
        msg: pb::AgentMessage,
    ) -> Result<Vec<pb::RouterMessage>, OutOfOrder> {
        let mut replies = Vec::new();
        let Some(body) = msg.body else {
            return Ok(replies);
        };
        let mut st = self.state.lock();
        match body {
            pb::agent_message::Body::Hello(hello) => {
                if node.as_deref() != Some(hello.node.as_str()) {
                    if let Some(old) = node.take() {
                        Self::stream_ended(&mut st, &old);
                    }
                    let n = st.nodes.entry(hello.node.clone()).or_default();
                    n.streams += 1;
                    n.gone_since = None;
                    *node = Some(hello.node.clone());
                }
                let allowed: Vec<bool> = hello
                    .engines
                    .iter()
                    .map(|e| Self::allowed(&st, &hello.node, &e.replica))
                    .collect();
                let n = st.nodes.entry(hello.node.clone()).or_default();
                for (e, allowed) in hello.engines.into_iter().zip(allowed) {
                    let refusal = if !allowed {
                        Some(format!("replica not configured on node {:?}", hello.node))
                    } else {
                        self.settings_mismatch(&e)
                    };
                    if let Some(reason) = refusal {
                        tracing::warn!(
                            node = hello.node,
                            engine = e.engine,
                            replica = e.replica,
                            %reason,
                            "refusing an engine's KV events"
                        );
                        self.metrics.refused.inc();
                        n.refused.insert(e.engine.clone());
                        replies.push(pb::RouterMessage {
                            body: Some(pb::router_message::Body::Refused(pb::Refused {
                                engine: e.engine,
                                replica: e.replica,
                                reason,
                            })),
                        });
                    } else {
                        n.refused.remove(&e.engine);
                        n.engines.entry(e.engine).or_default().replica = e.replica;
                    }
                }
            }
            pb::agent_message::Body::Snapshot(s) => {
                if let Some(n) = node.as_ref().and_then(|n| st.nodes.get_mut(n)) {
                    self.apply_snapshot(n, s);
                }
            }
            pb::agent_message::Body::Delta(d) => {
                if let Some(n) = node.as_ref().and_then(|n| st.nodes.get_mut(n)) {
                    self.apply_delta(n, d)?;
                }
            }
            pb::agent_message::Body::Heartbeat(_) => {}
        }
        replies.push(pb::RouterMessage {
            body: Some(pb::router_message::Body::Ack(pb::Ack { id: msg.id })),
        });
        Ok(replies)
    }

    fn stream_ended(st: &mut State, node: &str) {
        if let Some(n) = st.nodes.get_mut(node) {
            n.streams = n.streams.saturating_sub(1);
            if n.streams == 0 {
                n.gone_since = Some(Instant::now());
            }
        }
    }

    /// Clears `replica` in the index and re-stores what its other engines hold.
    fn rebuild_replica(&self, node: &NodeState, replica: &str) {
        self.sink.cleared(replica);
        for e in node.engines.values().filter(|e| e.replica == replica) {
            self.store_all(replica, &e.blocks);
        }
    }

    fn store_all(&self, replica: &str, blocks: &HashMap<(ExternalHash, Medium), u32>) {
        let mut by_medium: HashMap<Medium, Vec<ExternalHash>> = HashMap::new();
        for ((h, m), &n) in blocks {
            let list = by_medium.entry(*m).or_default();
            list.extend(std::iter::repeat_n(*h, n as usize));
        }
        for (m, hashes) in by_medium {
            self.sink.stored(replica, &hashes, m);
        }
    }

    fn apply_snapshot(&self, node: &mut NodeState, s: pb::Snapshot) {
        if node.refused.contains(&s.engine) {
            return;
        }
        let Some(view) = node.engines.get_mut(&s.engine) else {
            return;
        };
        view.epoch = s.epoch;
        view.seq = s.seq;
        view.blocks.clear();
        for b in s.blocks.iter().filter(|b| b.group == 0 && b.count > 0) {
            *view
                .blocks
                .entry((ExternalHash(b.hash), medium_of(b.medium)))
                .or_insert(0) += b.count;
        }
        let replica = view.replica.clone();
        self.rebuild_replica(node, &replica);
        self.metrics.snapshots.inc();
    }

    fn apply_delta(&self, node: &mut NodeState, d: pb::Delta) -> Result<(), OutOfOrder> {
        if node.refused.contains(&d.engine) {
            return Ok(());
        }
        let Some(view) = node.engines.get_mut(&d.engine) else {
            return Ok(());
        };
        let next_in_epoch = d.epoch == view.epoch && d.seq == view.seq + 1;
        let new_epoch = d.epoch > view.epoch && d.reset && d.seq == 1;
        if d.epoch < view.epoch || (d.epoch == view.epoch && d.seq <= view.seq) {
            return Ok(()); // already covered by a snapshot
        }
        if !next_in_epoch && !new_epoch {
            self.metrics.out_of_order.inc();
            return Err(OutOfOrder(format!(
                "engine {}: delta {}.{} after {}.{}",
                d.engine, d.epoch, d.seq, view.epoch, view.seq
            )));
        }
        view.epoch = d.epoch;
        view.seq = d.seq;
        let replica = view.replica.clone();
        if d.reset {
            view.blocks.clear();
            self.rebuild_replica(node, &replica);
        }
        let Some(view) = node.engines.get_mut(&d.engine) else {
            return Ok(());
        };
        let mut stored: HashMap<Medium, Vec<ExternalHash>> = HashMap::new();
        for b in d.stored.iter().filter(|b| b.group == 0) {
            let key = (ExternalHash(b.hash), medium_of(b.medium));
            *view.blocks.entry(key).or_insert(0) += b.count;
            stored
                .entry(key.1)
                .or_default()
                .extend(std::iter::repeat_n(key.0, b.count as usize));
        }
        let mut removed: HashMap<Medium, Vec<ExternalHash>> = HashMap::new();
        for b in d.removed.iter().filter(|b| b.group == 0) {
            let key = (ExternalHash(b.hash), medium_of(b.medium));
            let Some(held) = view.blocks.get_mut(&key) else {
                continue;
            };
            let n = b.count.min(*held);
            *held -= n;
            if *held == 0 {
                view.blocks.remove(&key);
            }
            removed
                .entry(key.1)
                .or_default()
                .extend(std::iter::repeat_n(key.0, n as usize));
        }
        for (m, hashes) in &stored {
            self.sink.stored(&replica, hashes, *m);
        }
        for (m, hashes) in &removed {
            self.sink.removed(&replica, hashes, *m);
        }
        self.metrics.deltas.inc();
        Ok(())
    }

    fn check_token<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let Some(token) = self.current_token() else {
            return Ok(());
        };
        let presented = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if presented == Some(token.as_str()) {
            Ok(())
        } else {
            tracing::warn!("feed stream refused: missing or wrong token");
            Err(Status::unauthenticated("missing or wrong feed token"))
        }
    }
}

/// Resolves once the service is shut down.
async fn stopped(mut rx: tokio::sync::watch::Receiver<bool>) {
    loop {
        let is_stopped = *rx.borrow_and_update();
        if is_stopped {
            return;
        }
        if rx.changed().await.is_err() {
            // The service is gone without a shutdown: nothing will ever stop this stream.
            std::future::pending::<()>().await;
        }
    }
}

type RouterStream = Pin<Box<dyn Stream<Item = Result<pb::RouterMessage, Status>> + Send>>;

#[tonic::async_trait]
impl pb::feed_server::Feed for FeedService {
    type StreamStream = RouterStream;

    async fn stream(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        self.check_token(&request)?;
        // The names the agent's certificate vouches for, when the node it claims is checked.
        let cert_names: Option<Vec<String>> =
            self.tls.as_ref().filter(|t| t.checks_node()).map(|_| {
                request
                    .peer_certs()
                    .and_then(|chain| chain.first().map(tls::cert_names))
                    .unwrap_or_default()
            });
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel::<Result<pb::RouterMessage, Status>>(256);
        let svc = self.clone();
        let stopped = stopped(self.stop.subscribe());
        let mut kicks = self.kick.subscribe();
        tokio::spawn(async move {
            tokio::pin!(stopped);
            svc.metrics.streams.inc();
            let mut node: Option<String> = None;
            loop {
                let next = tokio::select! {
                    next = inbound.next() => next,
                    () = &mut stopped => {
                        let _ = tx.send(Err(Status::unavailable("router shutting down"))).await;
                        break;
                    }
                    kicked = kicks.recv() => {
                        // Lagged: a burst of reloads; any kick for this node is among the
                        // newest, which the next receive returns.
                        if let Ok(name) = kicked
                            && node.as_deref() == Some(name.as_str())
                        {
                            let _ = tx
                                .send(Err(Status::unavailable(
                                    "this node's replicas changed: reconnect and resend snapshots",
                                )))
                                .await;
                            break;
                        }
                        continue;
                    }
                };
                let Some(msg) = next else { break };
                let msg = match msg {
                    Ok(m) => m,
                    Err(status) => {
                        tracing::info!(node = node.as_deref(), %status, "feed stream ended");
                        break;
                    }
                };
                if let (Some(names), Some(pb::agent_message::Body::Hello(hello))) =
                    (&cert_names, &msg.body)
                    && !tls::names_node(names, &hello.node)
                {
                    svc.metrics
                        .tls_refused
                        .get_or_create(&tls::TlsRefusal {
                            reason: "node_not_in_cert",
                        })
                        .inc();
                    tracing::warn!(
                        claimed = hello.node,
                        cert_names = ?names,
                        "feed stream refused: the client certificate does not name the node it claims"
                    );
                    let status = Status::permission_denied(format!(
                        "node {:?} is not named by the client certificate (names: {names:?})",
                        hello.node
                    ));
                    let _ = tx.send(Err(status)).await;
                    break;
                }
                match svc.apply(&mut node, msg) {
                    Ok(replies) => {
                        for r in replies {
                            if tx.send(Ok(r)).await.is_err() {
                                break;
                            }
                        }
                    }
                    Err(OutOfOrder(what)) => {
                        tracing::warn!(node = node.as_deref(), "{what}: asking for snapshots");
                        let _ = tx.send(Err(Status::data_loss(what))).await;
                        break;
                    }
                }
            }
            if let Some(n) = &node {
                Self::stream_ended(&mut svc.state.lock(), n);
            }
            svc.metrics.streams.dec();
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
