//! The router's end of the agent feed (`llmgw.feed.v1.Feed/Stream`, see
//! `proto/llmgw/feed/v1/feed.proto`): applies each node agent's snapshots and deltas to the KV
//! index through [`KvEventSink`]. The protocol's rules live in [`state`], a pure state machine;
//! this module is the gRPC service around it.
//!
//! Rules enforced here and there:
//! * with TLS configured ([`FeedService::with_tls`]), every connection is TLS, and with a
//!   client CA every agent must present a certificate that CA signed (see [`tls`]), and its
//!   Hello must claim a node that certificate names (else `PERMISSION_DENIED`, counted in
//!   `llmgw_feed_tls_refused_total{reason="node_not_in_cert"}`), unless turned off;
//! * the agent presents the shared token (`authorization: Bearer …`, compared in constant
//!   time) when one is configured;
//! * no message over [`MAX_MESSAGE_BYTES`] is decoded; snapshots arrive in parts below it;
//! * a node may only report replicas configured on it ([`FeedConfig::nodes`]); others are
//!   refused (a `Refused` message, `llmgw_feed_refused_total{reason}` and a log line) and their
//!   changes ignored; so is an engine that reports more blocks than
//!   [`FeedLimits::max_blocks_per_engine`], checked before any of them is applied;
//! * one stream owns a node: a newer stream's Hello takes it over, the old stream's blocks are
//!   dropped at once and it ends with `ABORTED` (`llmgw_feed_takeovers_total`);
//! * a snapshot replaces what the feed held for that engine; a delta applies only after the
//!   stream's snapshot of it and only if it is the next of its engine's epoch (a new epoch must
//!   start with a reset). A delta that skips ahead ends the stream with `DATA_LOSS`, so the
//!   agent reconnects and resends snapshots; one that breaks the protocol (before Hello or the
//!   snapshot, an unknown engine, epoch or seq going back, …) ends it with `INVALID_ARGUMENT`,
//!   counted in `llmgw_feed_violations_total{reason}`, and nothing of it is applied;
//! * only KV-cache group 0 (the full-attention group) reaches the index;
//! * a node whose stream has been gone longer than [`FeedConfig::grace`] is dropped: its
//!   replicas are cleared from the index;
//! * the node → replica map follows configuration reloads ([`FeedService::set_nodes`]): an
//!   engine whose replica left its node is dropped from the index at once, and the stream of
//!   every node whose replicas changed is ended with `UNAVAILABLE`, so its agent reconnects
//!   and resends Hello and snapshots, judged against the new map.
//!
//! # Concurrency model
//! One tonic task per stream. All feed state ([`FeedState`]) sits behind one
//! `parking_lot::Mutex`, held while one message is applied, never across an `.await`. The index
//! is written through the sink while that lock is held, so two streams never interleave one
//! replica's changes. A message is applied on tokio's blocking pool: a snapshot can hold the
//! lock for long, and streams waiting for it must not take the runtime's workers, which serve
//! requests. A reaper task drops expired nodes; streams are ended from outside (node map
//! reloads, takeovers) through a oneshot channel per stream.

mod options;
pub mod state;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use llmgw_feed_proto::peer::v1::peering_server::PeeringServer;
use llmgw_feed_proto::v1 as pb;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use subtle::ConstantTimeEq as _;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::blockhash::ExternalHash;
use crate::kvindex::KvEventSink;
use crate::models::ModelSettings;
use crate::peers::PeeringService;
use crate::tls;

pub use options::{DEFAULT_SILENCE, FeedOptions, FeedOptionsError, FeedSettings};
pub use state::{FeedLimits, FeedState, StreamEnd, StreamId, Violation};

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
    /// Bounds on what one stream may claim.
    pub limits: FeedLimits,
    /// How long a stream may send nothing (agents send a heartbeat every few seconds) before
    /// the router ends it, so that a node whose agent vanished without closing its connection
    /// goes into its grace period; zero: never.
    pub silence: Duration,
}

/// Why an engine's KV events are refused; the label of `llmgw_feed_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusalReason {
    /// Its replica is not configured on the agent's node.
    NotConfigured,
    /// It hashes with other settings than the router's for its model.
    HashSettings,
    /// It reported more block copies than [`FeedLimits::max_blocks_per_engine`].
    OverBlockCeiling,
    /// Its replica already has [`crate::kvindex::MAX_COPIES_PER_REPLICA`] engines in the Hello.
    TooManyEngines,
}

impl RefusalReason {
    pub fn label(self) -> &'static str {
        match self {
            RefusalReason::NotConfigured => "not_configured",
            RefusalReason::HashSettings => "hash_settings",
            RefusalReason::OverBlockCeiling => "over_block_ceiling",
            RefusalReason::TooManyEngines => "engines_per_replica",
        }
    }
}

/// A metric label: one reason.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

/// Counters of the feed (register them with [`FeedMetrics::register`]).
#[derive(Debug, Clone, Default)]
pub struct FeedMetrics {
    pub streams: Gauge,
    pub snapshots: Counter,
    pub deltas: Counter,
    /// Engines refused, by [`RefusalReason`].
    pub refused: Family<ReasonLabel, Counter>,
    /// Streams ended for breaking the protocol, by [`Violation`].
    pub violations: Family<ReasonLabel, Counter>,
    /// Nodes taken over by a newer stream.
    pub takeovers: Counter,
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
            "Engines refused, by reason: not_configured (replica not on the agent's node), hash_settings, over_block_ceiling",
            self.refused.clone(),
        );
        r.register(
            "violations",
            "Agent streams ended for breaking the feed protocol, by violation",
            self.violations.clone(),
        );
        r.register(
            "takeovers",
            "Nodes taken over by a newer stream (the older one ended, its blocks dropped)",
            self.takeovers.clone(),
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

    pub(crate) fn refused(&self, reason: RefusalReason) {
        self.refused
            .get_or_create(&ReasonLabel {
                reason: reason.label(),
            })
            .inc();
    }

    /// Engines refused so far, over every reason.
    pub fn refused_total(&self) -> u64 {
        [
            RefusalReason::NotConfigured,
            RefusalReason::HashSettings,
            RefusalReason::OverBlockCeiling,
            RefusalReason::TooManyEngines,
        ]
        .into_iter()
        .map(|r| {
            self.refused
                .get_or_create(&ReasonLabel { reason: r.label() })
                .get()
        })
        .sum()
    }

    /// Streams ended for breaking the protocol so far, over every violation.
    pub fn violations_total(&self) -> u64 {
        Violation::ALL
            .into_iter()
            .map(|v| {
                self.violations
                    .get_or_create(&ReasonLabel { reason: v.label() })
                    .get()
            })
            .sum()
    }

    fn violation(&self, violation: Violation) {
        self.violations
            .get_or_create(&ReasonLabel {
                reason: violation.label(),
            })
            .inc();
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

/// Why the service ends a stream from outside it.
#[derive(Debug, Clone)]
enum Kick {
    /// Its node's replicas changed: reconnect and resend Hello and snapshots.
    NodeMapChanged,
    /// A newer stream took its node over.
    Superseded(String),
}

/// The feed service; clone-cheap (shares its state).
#[derive(Clone)]
pub struct FeedService {
    sink: Arc<dyn KvEventSink>,
    config: Arc<FeedConfig>,
    state: Arc<Mutex<FeedState>>,
    /// Flipped by [`FeedService::shutdown`]: every open stream then ends with `UNAVAILABLE`.
    stop: Arc<tokio::sync::watch::Sender<bool>>,
    /// One sender per open stream, to end it and say why: a stream is told even when many
    /// are at once (a reloaded node map).
    kicks: Arc<Mutex<HashMap<StreamId, tokio::sync::oneshot::Sender<Kick>>>>,
    /// TLS on the feed port; `None` serves plain text.
    tls: Option<tls::ServerTls>,
    /// The file the token came from, read again for each stream (a rotated Secret).
    token_file: Option<Arc<PathBuf>>,
    pub metrics: FeedMetrics,
}

impl FeedService {
    pub fn new(sink: Arc<dyn KvEventSink>, config: FeedConfig) -> Self {
        let metrics = FeedMetrics::default();
        let state = FeedState::new(
            config.nodes.clone(),
            HashMap::new(),
            config.limits,
            config.grace,
            metrics.clone(),
        );
        FeedService {
            sink,
            config: Arc::new(config),
            state: Arc::new(Mutex::new(state)),
            stop: Arc::new(tokio::sync::watch::channel(false).0),
            kicks: Arc::default(),
            tls: None,
            token_file: None,
            metrics,
        }
    }

    /// Reads the token from `path` again for each agent stream, so that a rotated token is
    /// accepted without a restart; while the file cannot be read the configured token stands.
    pub fn with_token_file(mut self, path: Option<PathBuf>) -> Self {
        self.token_file = path.map(Arc::new);
        self
    }

    /// The token agents must present now.
    pub fn current_token(&self) -> Option<String> {
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
    pub fn with_tls(mut self, tls: Option<tls::ServerTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Checks each engine's reported hash settings against the router's for its model: an
    /// engine reporting others is refused, since its blocks could never match the hashes the
    /// router computes.
    pub fn expect_settings(self, models: &[ModelSettings]) -> Self {
        self.state.lock().set_expected(
            models
                .iter()
                .map(|m| (m.model.clone(), m.hashing.clone()))
                .collect(),
        );
        self
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
        self.serve_with_peering(listener, None).await
    }

    /// [`FeedService::serve_with_listener`], and peer routers' subscriptions on the same port
    /// ([`crate::peers`]).
    pub async fn serve_with_peering(
        self,
        listener: tokio::net::TcpListener,
        peering: Option<PeeringServer<PeeringService>>,
    ) -> Result<(), FeedServeError> {
        let reaper = tokio::spawn(self.clone().reap_forever());
        let tls = self.tls.clone();
        let refused = self.metrics.tls_refused.clone();
        let server = tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .http2_keepalive_interval(Some(crate::app::GRPC_KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(crate::app::GRPC_KEEPALIVE_TIMEOUT))
            .add_service(FeedServer::new(self).max_decoding_message_size(MAX_MESSAGE_BYTES))
            .add_optional_service(peering);
        let result = match tls {
            Some(tls) => {
                server
                    .serve_with_incoming(tls::TlsIncoming::new("feed", listener, tls, refused))
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
        let expired = self.state.lock().reap(&*self.sink, now);
        for node in &expired {
            tracing::warn!(node, "agent gone past the grace period: node dropped");
        }
        expired.len()
    }

    /// Configured nodes whose agent has not sent all its blocks yet ([`FeedState::unsynced_nodes`]).
    pub fn unsynced_nodes(&self) -> Vec<String> {
        self.state.lock().unsynced_nodes()
    }

    /// Block hashes the feed holds per replica (for `/debug` and tests).
    pub fn replica_blocks(&self) -> HashMap<String, HashSet<ExternalHash>> {
        self.state.lock().replica_blocks()
    }

    /// Applies a reloaded node map. Engines whose replica is no longer configured on their
    /// node are dropped (their replica cleared from the index and rebuilt from any other node
    /// still reporting it); every connected node whose replica set changed has its stream
    /// ended, so its agent reconnects and resends Hello and snapshots under the new map (an
    /// engine refused before may now be accepted). Returns whether the map changed.
    pub fn set_nodes(&self, nodes: NodeMap) -> bool {
        let Some(kick) = self.state.lock().set_nodes(&*self.sink, nodes) else {
            return false;
        };
        self.metrics.node_map_reloads.inc();
        for stream in kick {
            tracing::info!("a node's replicas changed: asking its agent to resync");
            self.kick(stream, Kick::NodeMapChanged);
        }
        true
    }

    /// Ends `stream` (if it is still open) for `why`.
    fn kick(&self, stream: StreamId, why: Kick) {
        if let Some(tx) = self.kicks.lock().remove(&stream) {
            let _ = tx.send(why);
        }
    }

    fn check_token<T>(&self, req: &Request<T>) -> Result<(), Status> {
        self.authorize(req.metadata(), "feed stream")
    }

    /// Checks the shared token in `metadata` (`authorization: Bearer …`) when one is
    /// configured; `what` names the refused call in the log line. Peer routers present the same
    /// token ([`crate::peers`]).
    pub fn authorize(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        what: &str,
    ) -> Result<(), Status> {
        let Some(token) = self.current_token() else {
            return Ok(());
        };
        let presented = metadata
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Constant time in the token's bytes: a wrong guess says nothing of how close it was.
        if presented.is_some_and(|p| bool::from(p.as_bytes().ct_eq(token.as_bytes()))) {
            Ok(())
        } else {
            tracing::warn!("{what} refused: missing or wrong token");
            Err(Status::unauthenticated("missing or wrong feed token"))
        }
    }

    /// Applies one message of `stream`: the replies to send, or the status that ends it.
    fn apply(
        &self,
        stream: StreamId,
        msg: pb::AgentMessage,
    ) -> Result<Vec<pb::RouterMessage>, Status> {
        let mut state = self.state.lock();
        match state.apply(&*self.sink, stream, msg) {
            Ok(applied) => {
                if let Some(old) = applied.superseded {
                    let node = state.node_of(stream).unwrap_or_default().to_owned();
                    drop(state);
                    self.kick(old, Kick::Superseded(node));
                }
                Ok(applied.replies)
            }
            Err(end) => {
                let node = state.node_of(stream).map(str::to_owned);
                drop(state);
                Err(self.end_status(node.as_deref(), end))
            }
        }
    }

    /// Logs and counts why a stream ends, as the status the agent receives.
    fn end_status(&self, node: Option<&str>, end: StreamEnd) -> Status {
        match &end {
            StreamEnd::Gap(_) => {
                tracing::warn!(node, "{end}: asking for snapshots");
                Status::data_loss(end.to_string())
            }
            StreamEnd::Violation { violation, .. } => {
                self.metrics.violation(*violation);
                tracing::warn!(node, "{end}: stream refused");
                Status::invalid_argument(end.to_string())
            }
            StreamEnd::Superseded(_) => Status::aborted(end.to_string()),
        }
    }
}

/// The largest agent message the feed decodes. Snapshots come in parts well below it
/// (`Snapshot.more`), so this bounds what one message can make the router allocate.
pub const MAX_MESSAGE_BYTES: usize = 8 << 20;

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

/// The next message of `inbound`, or `None` when `silence` (unless zero) passes first.
async fn next_within(
    inbound: &mut Streaming<pb::AgentMessage>,
    silence: Duration,
) -> Option<Option<Result<pb::AgentMessage, Status>>> {
    if silence.is_zero() {
        return Some(inbound.next().await);
    }
    tokio::time::timeout(silence, inbound.next()).await.ok()
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
        let stream = self.state.lock().open();
        let (kick_tx, mut kicked) = tokio::sync::oneshot::channel();
        self.kicks.lock().insert(stream, kick_tx);
        let silence = self.config.silence;
        tokio::spawn(async move {
            tokio::pin!(stopped);
            svc.metrics.streams.inc();
            loop {
                let next = tokio::select! {
                    next = next_within(&mut inbound, silence) => match next {
                        Some(next) => next,
                        None => {
                            let node = svc.state.lock().node_of(stream).map(str::to_owned);
                            tracing::warn!(
                                node,
                                silence = ?silence,
                                "feed stream silent (not even a heartbeat): ended, the node's grace period starts"
                            );
                            let status = Status::deadline_exceeded(format!(
                                "nothing heard from the agent for {silence:?}"
                            ));
                            let _ = tx.send(Err(status)).await;
                            break;
                        }
                    },
                    () = &mut stopped => {
                        let _ = tx.send(Err(Status::unavailable("router shutting down"))).await;
                        break;
                    }
                    why = &mut kicked => {
                        // The sender is only dropped once sent, or with the service: resync.
                        let status = match why.unwrap_or(Kick::NodeMapChanged) {
                            Kick::NodeMapChanged => Status::unavailable(
                                "this node's replicas changed: reconnect and resend snapshots",
                            ),
                            Kick::Superseded(node) => {
                                tracing::warn!(node, "feed stream superseded by a newer stream of its node");
                                Status::aborted(format!(
                                    "node {node:?} was taken over by a newer stream; this stream's blocks were dropped"
                                ))
                            }
                        };
                        let _ = tx.send(Err(status)).await;
                        break;
                    }
                };
                let Some(msg) = next else { break };
                let msg = match msg {
                    Ok(m) => m,
                    Err(status) => {
                        let node = svc.state.lock().node_of(stream).map(str::to_owned);
                        if status.code() == tonic::Code::OutOfRange {
                            // A message over MAX_MESSAGE_BYTES, refused before decoding: tell
                            // the agent, whose stream is otherwise intact.
                            tracing::warn!(node, %status, "feed stream refused: message too large");
                            let _ = tx.send(Err(status)).await;
                        } else {
                            tracing::info!(node, %status, "feed stream ended");
                        }
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
                let applying = svc.clone();
                let applied = tokio::task::spawn_blocking(move || applying.apply(stream, msg))
                    .await
                    .unwrap_or_else(|join| {
                        tracing::error!(error = %join, "applying a feed message failed");
                        Err(Status::internal("the router failed to apply the message"))
                    });
                match applied {
                    Ok(replies) => {
                        for r in replies {
                            if tx.send(Ok(r)).await.is_err() {
                                break;
                            }
                        }
                    }
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        break;
                    }
                }
            }
            svc.kicks.lock().remove(&stream);
            svc.state.lock().close(stream, Instant::now());
            svc.metrics.streams.dec();
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
