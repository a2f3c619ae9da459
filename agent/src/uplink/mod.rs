//! The agent's end of the feed: one bidirectional gRPC stream to each router
//! (`llmgw.feed.v1.Feed/Stream`, see `proto/llmgw/feed/v1/feed.proto`).
//!
//! Per session: subscribe to the agent's delta channel *first*, then send Hello and one
//! snapshot per engine, then forward every delta newer than that engine's snapshot, plus a
//! heartbeat every few seconds. The router acknowledges message ids; the time from the oldest
//! event in a delta to its acknowledgement is the `event_to_router_seconds` metric. When the
//! stream fails (router restarted, network), reconnect with doubling backoff and start again
//! with snapshots; each failed session counts in `uplink_errors_total{router, reason}`. If the
//! delta channel overflows (a very slow router), snapshots are resent on the same stream. When
//! the agent's set of engines changes, the session ends and the next starts at once: a Hello
//! lists its engines once per stream, and the router drops the old stream's blocks when the new
//! one takes the node over.
//!
//! The uplink sees the agent only through a [`FeedSource`] (the daemon's `Agent` in production,
//! a fake in tests): it never names the daemon, so the daemon can start uplinks without the two
//! modules importing each other. Likewise a session reaches its router through a private
//! two-step transport (connect, then open the stream): tonic in production, channels in the
//! unit tests.
//!
//! # Concurrency model
//! One task per router ([`run`]), running one session at a time. It reads engine state only
//! through [`FeedSource::snapshot_engines`] (the agent takes each engine's short lock in turn)
//! and the broadcast receiver of [`FeedSource::subscribe`]; nothing is shared between uplinks
//! but the metrics. Within a session one `select!` loop forwards deltas, reads the router's
//! acknowledgements and sends heartbeats; messages to the router go through a bounded `mpsc`
//! channel that tonic drains, so a slow router makes the loop wait (and the delta channel lag).

#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use llmgw_core::ids::{ModelName, NodeName};
use llmgw_core::kv_event::Medium as Tier;
use llmgw_feed_proto::v1 as pb;
use tokio::sync::{broadcast, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt as _};
use tonic::transport::ClientTlsConfig;
use tracing::Instrument;

use crate::config::{AgentConfig, TlsFiles, read_token};
use crate::engine::{EngineSnapshot, HashStatus, Update};
use crate::metrics::{Metrics, RouterLabel, UplinkErrorLabel};
use crate::mirror::{BlockKey, Delta};

/// Errors of one uplink session (each ends it; the uplink reconnects).
#[derive(Debug, thiserror::Error)]
pub enum UplinkError {
    #[error("router address {0:?}: {1}")]
    Address(String, String),
    #[error("connecting to {router}: {source}")]
    Connect {
        router: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("stream to {router}: {status}")]
    Stream {
        router: String,
        status: Box<tonic::Status>,
    },
    #[error(
        "stream to {router} broke before the router answered ({status}): if the router's feed \
         port uses TLS, give the agent --router-ca (and --tls-cert/--tls-key for mutual TLS)"
    )]
    PlainTextRefused {
        router: String,
        status: Box<tonic::Status>,
    },
    #[error("stream to {0} closed by the router")]
    Closed(String),
    #[error("the agent's delta channel closed")]
    AgentGone,
}

/// Every [`UplinkError::reason`], so that a departed router's series can all be removed.
pub const ERROR_REASONS: [&str; 23] = [
    "address",
    "connect",
    "tls",
    "plain_text_refused",
    "closed",
    "agent_gone",
    "ok",
    "cancelled",
    "unknown",
    "invalid_argument",
    "deadline_exceeded",
    "not_found",
    "already_exists",
    "permission_denied",
    "resource_exhausted",
    "failed_precondition",
    "aborted",
    "out_of_range",
    "unimplemented",
    "internal",
    "unavailable",
    "data_loss",
    "unauthenticated",
];

impl UplinkError {
    /// A short name for the `reason` label of `llmgw_agent_uplink_errors_total`: what failed
    /// (`address`, `connect`, `tls` when connecting failed in the TLS handshake, say on a
    /// router certificate for another name, ...), or the gRPC status a stream ended with, in
    /// snake case (`unauthenticated`, `permission_denied`, ...).
    pub fn reason(&self) -> &'static str {
        match self {
            UplinkError::Address(..) => "address",
            UplinkError::Connect { source, .. } if caused_by_tls(source) => "tls",
            UplinkError::Connect { .. } => "connect",
            UplinkError::Stream { status, .. } => status_reason(status.code()),
            UplinkError::PlainTextRefused { .. } => "plain_text_refused",
            UplinkError::Closed(_) => "closed",
            UplinkError::AgentGone => "agent_gone",
        }
    }
}

/// Whether a TLS error lies somewhere in `error`'s causes. (An `io::Error` hides the error it
/// wraps from `source()`, so those are opened with `get_ref`.)
fn caused_by_tls(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(e) = cause {
        let wrapped = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|inner| inner as &(dyn std::error::Error + 'static));
        if e.is::<tokio_rustls::rustls::Error>()
            || wrapped.is_some_and(|w| w.is::<tokio_rustls::rustls::Error>())
        {
            return true;
        }
        cause = e.source();
    }
    false
}

fn status_reason(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

/// What an uplink reads from the agent.
pub trait FeedSource: Send + Sync + 'static {
    /// What Hello says about the node besides its engines.
    fn node(&self) -> NodeInfo;
    /// A receiver of every delta flushed from now on. Taken before the snapshots, so that no
    /// delta falls between a snapshot and the deltas after it.
    fn subscribe(&self) -> broadcast::Receiver<Update>;
    /// One snapshot per engine, always in the same order (Hello lists the engines in it).
    fn snapshot_engines(&self) -> Vec<EngineSnapshot>;
    /// Where the uplink reports its connection state and acknowledgement latency.
    fn metrics(&self) -> &Metrics;
    /// A generation that changes whenever the set of engines does (`None`: it never changes).
    /// Taken before the snapshots: a change ends the session, and the next one's Hello lists
    /// the new set.
    fn membership(&self) -> Option<watch::Receiver<u64>> {
        None
    }
}

/// Waits until the engine set changes; never when it cannot.
async fn membership_changed(membership: &mut Option<watch::Receiver<u64>>) {
    match membership {
        Some(rx) => {
            if rx.changed().await.is_err() {
                // The agent is gone; the delta channel says so too.
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

/// The node-wide part of Hello: the same for every engine of the node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub node: NodeName,
    /// Empty when not configured.
    pub model: ModelName,
    /// 0 when not configured.
    pub block_size: u32,
    pub hash_algo: String,
    pub hash_seed_set: bool,
}

impl NodeInfo {
    /// What the agent's configuration says.
    pub fn of(config: &AgentConfig) -> NodeInfo {
        NodeInfo {
            node: NodeName::from(config.node.as_str()),
            model: config
                .model
                .as_deref()
                .map(ModelName::from)
                .unwrap_or_default(),
            block_size: config
                .block_size
                .map_or(0, |b| u32::try_from(b.get()).unwrap_or(u32::MAX)),
            hash_algo: config.algo.as_str().to_owned(),
            hash_seed_set: config.seed.is_some(),
        }
    }
}

/// How one uplink behaves.
#[derive(Debug, Clone)]
pub struct UplinkConfig {
    /// `HOST:PORT` of the router's feed service.
    pub router: String,
    pub token: Option<String>,
    /// Read again before each connection (a rotated token); `token` while it cannot be read.
    pub token_file: Option<PathBuf>,
    /// TLS (with a client identity for mutual TLS); `None` connects in plain text.
    pub tls: Option<tonic::transport::ClientTlsConfig>,
    /// Read again before each connection (rotated certificates); `tls` while they do not load.
    pub tls_files: Option<TlsFiles>,
    /// The name the router's certificate must carry, when `router` is an address resolved
    /// from it (see [`crate::routers`]).
    pub tls_server_name: Option<String>,
    pub heartbeat: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Messages the outbound queue holds beyond a session's opening (its Hello and snapshot
    /// parts, which it always holds whole): deltas and heartbeats wait for room past this.
    pub queue: usize,
}

impl UplinkConfig {
    /// An uplink to `router` with the agent's credentials.
    pub fn for_agent(router: impl Into<String>, config: &AgentConfig) -> Self {
        UplinkConfig {
            token_file: config.token_file.clone(),
            tls: config.tls.clone(),
            tls_files: config.tls_files.clone(),
            ..UplinkConfig::new(router, config.token.clone())
        }
    }

    /// The token to present now: the token file as it reads today, else the one from start-up.
    fn current_token(&self) -> Option<String> {
        match &self.token_file {
            Some(path) => match read_token(path) {
                Ok(token) => Some(token),
                Err(error) => {
                    tracing::warn!(router = self.router, %error, "keeping the token read before");
                    self.token.clone()
                }
            },
            None => self.token.clone(),
        }
    }

    /// The TLS settings to connect with now (files as they read today, else those from
    /// start-up), naming the router as `tls_server_name` when set.
    fn current_tls(&self) -> Option<ClientTlsConfig> {
        let tls = match &self.tls_files {
            Some(files) => match files.load() {
                Ok(tls) => tls,
                Err(error) => {
                    tracing::warn!(
                        router = self.router,
                        %error,
                        "keeping the TLS settings loaded before"
                    );
                    self.tls.clone()
                }
            },
            None => self.tls.clone(),
        }?;
        Some(match &self.tls_server_name {
            Some(name) => tls.domain_name(name.clone()),
            None => tls,
        })
    }

    pub fn new(router: impl Into<String>, token: Option<String>) -> Self {
        UplinkConfig {
            router: router.into(),
            token,
            token_file: None,
            tls: None,
            tls_files: None,
            tls_server_name: None,
            heartbeat: Duration::from_secs(5),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            queue: 1024,
        }
    }
}

fn medium(tier: Tier) -> i32 {
    if tier == Tier::Gpu {
        pb::Medium::Gpu as i32
    } else {
        pb::Medium::Offloaded as i32
    }
}

/// Keys with their copy counts, as protocol blocks.
fn blocks(keys: impl IntoIterator<Item = (BlockKey, u32)>) -> Vec<pb::Block> {
    let mut counted: HashMap<BlockKey, u32> = HashMap::new();
    for (k, n) in keys {
        *counted.entry(k).or_insert(0) += n;
    }
    counted
        .into_iter()
        .map(|(k, count)| pb::Block {
            hash: k.hash.0,
            group: k.group.0,
            medium: medium(k.tier),
            count,
        })
        .collect()
}

/// Blocks per snapshot part: about 1 MiB on the wire, well below the router's message limit
/// (`llmgw::feed::MAX_MESSAGE_BYTES`).
pub const SNAPSHOT_PART_BLOCKS: usize = 65_536;

/// An engine's snapshot as feed messages: one, or parts of at most [`SNAPSHOT_PART_BLOCKS`]
/// blocks, all but the last marked `more`.
fn snapshot_messages(s: &EngineSnapshot) -> Vec<pb::agent_message::Body> {
    let all = blocks(s.snapshot.blocks.iter().copied());
    let hash_status = match s.hash {
        HashStatus::Unchecked => pb::HashStatus::Unchecked as i32,
        HashStatus::Verified => pb::HashStatus::Verified as i32,
        HashStatus::Mismatch => pb::HashStatus::Mismatch as i32,
    };
    let count = all.len().div_ceil(SNAPSHOT_PART_BLOCKS).max(1);
    // Each block moves once, into its part.
    let mut blocks = all.into_iter();
    (0..count)
        .map(|i| {
            pb::agent_message::Body::Snapshot(pb::Snapshot {
                engine: s.engine.0.to_string(),
                epoch: s.snapshot.epoch,
                seq: s.snapshot.seq,
                blocks: blocks.by_ref().take(SNAPSHOT_PART_BLOCKS).collect(),
                hash_status,
                more: i + 1 < count,
            })
        })
        .collect()
}

fn hello_message(node: NodeInfo, snapshots: &[EngineSnapshot]) -> pb::agent_message::Body {
    let engines = snapshots
        .iter()
        .map(|s| pb::EngineInfo {
            engine: s.engine.0.to_string(),
            replica: s.replica.0.to_string(),
            model: node.model.to_string(),
            block_size: node.block_size,
            hash_algo: node.hash_algo.clone(),
            hash_seed_set: node.hash_seed_set,
        })
        .collect();
    pb::agent_message::Body::Hello(pb::Hello {
        node: node.node.to_string(),
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        engines,
    })
}

fn delta_message(engine: &str, d: &Delta, oldest_ts: f64) -> pb::agent_message::Body {
    pb::agent_message::Body::Delta(pb::Delta {
        engine: engine.to_owned(),
        epoch: d.epoch,
        seq: d.seq,
        reset: d.reset,
        stored: blocks(d.stored.iter().map(|k| (*k, 1))),
        removed: blocks(d.removed.iter().map(|k| (*k, 1))),
        oldest_event_ts: oldest_ts,
    })
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Runs one router's uplink until the agent's delta channel closes.
pub async fn run<S: FeedSource + ?Sized>(source: Arc<S>, config: UplinkConfig) {
    reconnect(&*source, &Grpc, &config).await;
}

/// One session: connect, Hello, snapshots, then deltas until the stream fails (an error) or the
/// engine set changes (`Ok`). For diagnostics and tests; [`run`] is the reconnecting loop.
pub async fn session_once<S: FeedSource + ?Sized>(
    source: &S,
    config: &UplinkConfig,
) -> Result<(), UplinkError> {
    let mut delay = config.backoff_initial;
    session(source, &Grpc, config, &mut delay).await
}

/// Sessions one after another, with doubling backoff between them, until the agent is gone.
async fn reconnect<S: FeedSource + ?Sized, T: Transport>(
    source: &S,
    transport: &T,
    config: &UplinkConfig,
) {
    let label = RouterLabel {
        router: config.router.clone(),
    };
    let mut delay = config.backoff_initial;
    loop {
        let result = session(source, transport, config, &mut delay).await;
        source
            .metrics()
            .uplink_connected
            .get_or_create(&label)
            .set(0);
        match result {
            Err(UplinkError::AgentGone) => return,
            Err(e) => tracing::warn!(router = config.router, error = %e, ?delay, "uplink down"),
            // The engines changed: a new stream at once.
            Ok(()) => continue,
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(config.backoff_max);
    }
}

/// Sends to the outbound stream, numbering messages.
struct Outbound {
    tx: mpsc::Sender<pb::AgentMessage>,
    next_id: u64,
}

impl Outbound {
    async fn send(&mut self, body: pb::agent_message::Body) -> Option<u64> {
        self.next_id += 1;
        let id = self.next_id;
        self.tx
            .send(pb::AgentMessage::numbered(id, body))
            .await
            .ok()
            .map(|()| id)
    }
}

/// What a session presents to its router, read afresh before each connection.
struct Credentials {
    /// `None`: plain text.
    tls: Option<ClientTlsConfig>,
    token: Option<String>,
}

/// The router's messages on one stream.
type Inbound = Pin<Box<dyn Stream<Item = Result<pb::RouterMessage, tonic::Status>> + Send>>;

/// How a session reaches its router: gRPC ([`Grpc`]) in the agent, a fake in the unit tests.
/// Two steps, so that the agent subscribes and snapshots only once the router is reachable, and
/// the stream opens with those snapshots already queued.
trait Transport: Send + Sync {
    type Connection: Send;

    /// Connects to `router` (TCP, and the TLS handshake when `credentials.tls` is set).
    fn connect(
        &self,
        router: &str,
        credentials: &Credentials,
    ) -> impl Future<Output = Result<Self::Connection, UplinkError>> + Send;

    /// Opens the feed stream on `connection`, sending what `outbound` yields; returns the
    /// router's side of it once the router has accepted the call.
    fn open(
        &self,
        connection: Self::Connection,
        router: &str,
        credentials: &Credentials,
        outbound: mpsc::Receiver<pb::AgentMessage>,
    ) -> impl Future<Output = Result<Inbound, UplinkError>> + Send;
}

/// `llmgw.feed.v1.Feed/Stream` over tonic.
struct Grpc;

impl Transport for Grpc {
    type Connection = tonic::transport::Channel;

    async fn connect(
        &self,
        router: &str,
        credentials: &Credentials,
    ) -> Result<tonic::transport::Channel, UplinkError> {
        let scheme = if credentials.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let mut endpoint = tonic::transport::Endpoint::from_shared(format!("{scheme}://{router}"))
            .map_err(|e| UplinkError::Address(router.to_owned(), e.to_string()))?
            .connect_timeout(Duration::from_secs(3))
            .tcp_nodelay(true);
        if let Some(tls) = &credentials.tls {
            endpoint = endpoint
                .tls_config(tls.clone())
                .map_err(|source| UplinkError::Connect {
                    router: router.to_owned(),
                    source,
                })?;
        }
        endpoint
            .connect()
            .await
            .map_err(|source| UplinkError::Connect {
                router: router.to_owned(),
                source,
            })
    }

    async fn open(
        &self,
        connection: tonic::transport::Channel,
        router: &str,
        credentials: &Credentials,
        outbound: mpsc::Receiver<pb::AgentMessage>,
    ) -> Result<Inbound, UplinkError> {
        let mut client = pb::feed_client::FeedClient::new(connection);
        let mut request = tonic::Request::new(ReceiverStream::new(outbound));
        if let Some(token) = &credentials.token {
            let value = format!("Bearer {token}").parse().map_err(|_| {
                UplinkError::Address(router.to_owned(), "token is not ASCII".into())
            })?;
            request.metadata_mut().insert("authorization", value);
        }
        let inbound = client
            .stream(request)
            .await
            .map_err(|status| {
                // A TLS port answers a plain-text HTTP/2 preface by closing the connection: the
                // call fails at the transport level, not with a gRPC status from the router.
                let transport = std::error::Error::source(&status).is_some()
                    && matches!(
                        status.code(),
                        tonic::Code::Unknown | tonic::Code::Unavailable
                    );
                if credentials.tls.is_none() && transport {
                    UplinkError::PlainTextRefused {
                        router: router.to_owned(),
                        status: Box::new(status),
                    }
                } else {
                    UplinkError::Stream {
                        router: router.to_owned(),
                        status: Box::new(status),
                    }
                }
            })?
            .into_inner();
        Ok(Box::pin(inbound))
    }
}

/// One session, its failure counted in `uplink_errors` (the agent going away is no failure).
async fn session<S: FeedSource + ?Sized, T: Transport>(
    source: &S,
    transport: &T,
    config: &UplinkConfig,
    delay: &mut Duration,
) -> Result<(), UplinkError> {
    let result = stream_session(source, transport, config, delay).await;
    if let Err(error) = &result
        && !matches!(error, UplinkError::AgentGone)
    {
        source
            .metrics()
            .uplink_errors
            .get_or_create(&UplinkErrorLabel {
                router: config.router.clone(),
                reason: error.reason(),
            })
            .inc();
    }
    result
}

async fn stream_session<S: FeedSource + ?Sized, T: Transport>(
    source: &S,
    transport: &T,
    config: &UplinkConfig,
    delay: &mut Duration,
) -> Result<(), UplinkError> {
    let router = config.router.clone();
    let credentials = Credentials {
        tls: config.current_tls(),
        token: config.current_token(),
    };
    let connection = transport.connect(&router, &credentials).await?;

    // Subscribe before snapshotting, so every delta after a snapshot is seen; and take the
    // membership before that, so a change after the snapshots ends this session.
    let mut membership = source.membership();
    if let Some(m) = membership.as_mut() {
        m.mark_unchanged();
    }
    let mut updates = source.subscribe();
    let snapshots = source.snapshot_engines();
    let engines = snapshots.len();
    let mut opening = vec![hello_message(source.node(), &snapshots)];
    // Per engine of the Hello: the instance snapshotted (a removed engine's late delta, or a
    // restarted one's under the same name, is another instance) and the last epoch/seq sent.
    let mut sent_upto: HashMap<Arc<str>, (u64, u64)> = HashMap::new();
    for s in snapshots {
        sent_upto.insert(Arc::clone(&s.engine.0), (s.snapshot.epoch, s.snapshot.seq));
        opening.extend(snapshot_messages(&s));
    }
    // Nothing drains the queue before `open` returns, so it holds the whole opening however
    // many parts the snapshots take: queueing it never waits.
    let (tx, rx) = mpsc::channel(opening.len() + config.queue.max(1));
    let mut out = Outbound { tx, next_id: 0 };
    for body in opening {
        out.send(body).await;
    }

    let mut inbound = transport
        .open(connection, &router, &credentials, rx)
        .await?;
    let label = RouterLabel {
        router: router.clone(),
    };
    let metrics = source.metrics();
    metrics.uplink_connected.get_or_create(&label).set(1);
    tracing::info!(router, engines, "uplink connected");

    // Delta ids awaiting acknowledgement, with their oldest event time.
    let mut in_flight: VecDeque<(u64, f64)> = VecDeque::new();
    let mut heartbeat = tokio::time::interval(config.heartbeat);
    heartbeat.tick().await;
    loop {
        tokio::select! {
            update = updates.recv() => match update {
                Ok(Update { engine, delta, oldest_event_ts, batch_span, .. }) => {
                    // Only the instances this stream's Hello listed (keys compare by pointer
                    // below): any other engine's delta waits for the next session's snapshot.
                    let Some((listed, &(epoch, seq))) = sent_upto.get_key_value(&engine.0) else {
                        continue;
                    };
                    if !Arc::ptr_eq(listed, &engine.0)
                        || delta.epoch < epoch
                        || (delta.epoch == epoch && delta.seq <= seq)
                    {
                        continue;
                    }
                    let listed = Arc::clone(listed);
                    sent_upto.insert(listed, (delta.epoch, delta.seq));
                    let ts = oldest_event_ts.unwrap_or_else(unix_now);
                    let span = match &batch_span {
                        Some(parent) => tracing::debug_span!(
                            parent: parent, "uplink", router, epoch = delta.epoch as i64, seq = delta.seq as i64
                        ),
                        None => tracing::Span::none(),
                    };
                    let sent = out
                        .send(delta_message(&engine.0, &delta, ts))
                        .instrument(span)
                        .await;
                    if let Some(id) = sent {
                        in_flight.push_back((id, ts));
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    if membership.as_ref().is_some_and(|m| m.has_changed().unwrap_or(false)) {
                        // The set changed too: snapshots of it belong on a new stream.
                        return Ok(());
                    }
                    tracing::warn!(router, missed = n, "uplink fell behind: resending snapshots");
                    for s in source.snapshot_engines() {
                        // The Hello's instances only (a change since ends this session anyway).
                        let Some(listed) = sent_upto
                            .get_key_value(&s.engine.0)
                            .map(|(listed, _)| Arc::clone(listed))
                            .filter(|listed| Arc::ptr_eq(listed, &s.engine.0))
                        else {
                            continue;
                        };
                        sent_upto.insert(listed, (s.snapshot.epoch, s.snapshot.seq));
                        for part in snapshot_messages(&s) {
                            out.send(part).await;
                        }
                    }
                }
                Err(broadcast::error::RecvError::Closed) => return Err(UplinkError::AgentGone),
            },
            msg = inbound.next() => match msg {
                Some(Ok(pb::RouterMessage { body: Some(pb::router_message::Body::Ack(ack)) })) => {
                    // A working session: the next outage starts from the short backoff.
                    *delay = config.backoff_initial;
                    let now = unix_now();
                    while in_flight.front().is_some_and(|(id, _)| *id <= ack.id) {
                        if let Some((_, ts)) = in_flight.pop_front() {
                            metrics
                                .event_to_router
                                .get_or_create(&label)
                                .observe((now - ts).max(0.0));
                        }
                    }
                }
                Some(Ok(pb::RouterMessage { body: Some(pb::router_message::Body::Refused(r)) })) => {
                    tracing::error!(
                        router,
                        engine = r.engine,
                        replica = r.replica,
                        reason = r.reason,
                        "router refused an engine: is the replica configured on this node?"
                    );
                }
                Some(Ok(_)) => {}
                None => return Err(UplinkError::Closed(router)),
                Some(Err(status)) => {
                    return Err(UplinkError::Stream { router, status: Box::new(status) });
                }
            },
            () = membership_changed(&mut membership) => {
                tracing::info!(router, "engines changed: opening a new stream");
                return Ok(());
            }
            _ = heartbeat.tick() => {
                let unix_ms = u64::try_from(
                    SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis()),
                )
                .unwrap_or(u64::MAX);
                out.send(pb::agent_message::Body::Heartbeat(pb::Heartbeat { unix_ms })).await;
            }
        }
    }
}
