//! The receiving end: one task per peer subscribes to its `Peering/Picks`, hands its picks to
//! the scheduler and keeps its loads, reconnecting with backoff when the stream ends.
//!
//! A peer's loads count only while its stream is open and not silent for [`PEER_SILENCE`]
//! (the peer sends one at least every [`super::service::LOAD_EVERY`]): a router that died does
//! not leave its requests in flight behind.
//!
//! Concurrency: each peer's task owns its stream; [`PeerLoads`] is shared by them all, one
//! mutex held while one peer's counts are replaced and the sums written to the pool.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use llmgw_feed_proto::peer::v1 as pb;
use parking_lot::Mutex;
use pb::peering_client::PeeringClient;
use thiserror::Error;
use tonic::Request;
use tonic::transport::Endpoint;

use super::options::PeerTls;
use super::{PeerMetrics, PeerPick, PickSink, limits};
use crate::blockhash::ExternalHash;
use crate::pool::Pool;
use crate::tls::with_causes;

/// A peer whose stream carried nothing for this long is taken for dead.
pub const PEER_SILENCE: Duration = Duration::from_secs(3);
/// The first wait before subscribing again; it doubles up to [`RETRY_MAX`].
pub const RETRY_MIN: Duration = Duration::from_millis(100);
pub const RETRY_MAX: Duration = Duration::from_secs(5);
/// Failed attempts, never subscribed, after which a peer's absence is worth a warning (about
/// 20 s of retries).
const UNREACHABLE_WARN_AFTER: u32 = 8;

/// Each peer's last reported requests in flight per replica, summed into the pool.
#[derive(Debug)]
pub struct PeerLoads {
    pool: Arc<Pool>,
    by_peer: Mutex<HashMap<String, HashMap<String, u32>>>,
}

impl PeerLoads {
    pub fn new(pool: Arc<Pool>) -> PeerLoads {
        PeerLoads {
            pool,
            by_peer: Mutex::new(HashMap::new()),
        }
    }

    /// Replaces what `peer` has in flight, per replica endpoint.
    pub fn set(&self, peer: &str, loads: HashMap<String, u32>) {
        let mut by_peer = self.by_peer.lock();
        by_peer.insert(peer.to_owned(), loads);
        self.write_sums(&by_peer);
    }

    /// Forgets `peer`'s requests in flight (its stream ended).
    pub fn clear(&self, peer: &str) {
        let mut by_peer = self.by_peer.lock();
        if by_peer.remove(peer).is_some() {
            self.write_sums(&by_peer);
        }
    }

    fn write_sums(&self, by_peer: &HashMap<String, HashMap<String, u32>>) {
        for replica in self.pool.snapshot().replicas() {
            let sum = by_peer
                .values()
                .filter_map(|loads| loads.get(replica.endpoint()))
                .fold(0u32, |sum, n| sum.saturating_add(*n));
            replica.set_peer_in_flight(sum);
        }
    }
}

/// Why a peer's update was not applied (logged once per stream, counted always).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum Refusal {
    #[error("a pick with {0} hashes of one kind (at most {max}), or with none", max = limits::MAX_PICK_BLOCKS)]
    PickBlocks(usize),
    #[error("a pick adding {new} blocks of {total}")]
    NewBlocks { new: u32, total: usize },
    #[error("a name of {0} bytes (at most {max})", max = limits::MAX_NAME_BYTES)]
    NameLength(usize),
    #[error("a load of {0} replicas (at most {max})", max = limits::MAX_LOAD_REPLICAS)]
    LoadReplicas(usize),
    #[error("{0} requests in flight at one replica (at most {max})", max = limits::MAX_IN_FLIGHT)]
    InFlight(u32),
    #[error("an update with no body (a newer peer's kind of message?)")]
    Empty,
}

/// Why a subscription ended.
#[derive(Debug, Error)]
enum StreamEnd {
    #[error("cannot connect: {}", with_causes(.0))]
    Connect(#[from] tonic::transport::Error),
    #[error("refused: {0}")]
    Status(#[from] tonic::Status),
    #[error("silent for {PEER_SILENCE:?}")]
    Silent,
    #[error("the peer ended the stream")]
    Ended,
}

/// The token to present, read when a subscription starts.
pub type TokenSource = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// What every peer's subscription shares.
#[derive(Clone)]
pub struct PeerContext {
    pub router_id: u64,
    /// TLS to peers, when their feed ports are TLS.
    pub tls: Option<Arc<PeerTls>>,
    /// The feed's token as it reads now (its file is read again, so a rotated token reaches
    /// the next subscription), presented to the peer.
    pub token: TokenSource,
    pub sink: Arc<dyn PickSink>,
    pub pool: Arc<Pool>,
    pub loads: Arc<PeerLoads>,
    pub metrics: PeerMetrics,
}

impl PeerContext {
    /// A subscription to the peer at `url`.
    pub fn client(&self, url: String, endpoint: Endpoint) -> PeerClient {
        PeerClient {
            url,
            endpoint,
            server_name: None,
            context: self.clone(),
        }
    }

    /// Forgets what the peer at `url` reported (its subscription ended or was stopped).
    pub fn forget(&self, url: &str) {
        self.loads.clear(url);
        self.metrics.set_connected(url, false);
    }

    /// Forgets the peer at `url` for good (it left the peer service): what it reported and its
    /// metric series, so that routers coming and going do not add series for ever.
    pub fn remove(&self, url: &str) {
        self.loads.clear(url);
        self.metrics.remove(url);
    }
}

/// Subscribes to one peer for as long as the router runs.
pub struct PeerClient {
    pub url: String,
    pub endpoint: Endpoint,
    /// Over TLS, the name the peer's certificate must carry when it is not the URL's host (an
    /// address a service name resolved to).
    server_name: Option<String>,
    context: PeerContext,
}

impl PeerClient {
    /// Checks the peer's TLS certificate against `name` rather than the URL's host.
    pub fn with_server_name(mut self, name: impl Into<String>) -> PeerClient {
        self.server_name = Some(name.into());
        self
    }

    pub async fn run(self) {
        let mut retry = RETRY_MIN;
        // Failed attempts since the last subscription, and whether that streak was logged.
        let mut failures: u32 = 0;
        let mut warned = false;
        let mut ever_subscribed = false;
        loop {
            let mut subscribed = false;
            let end = self.subscribe(&mut subscribed).await;
            self.context.forget(&self.url);
            if subscribed {
                retry = RETRY_MIN;
                failures = 0;
                warned = false;
                ever_subscribed = true;
            }
            failures = failures.saturating_add(1);
            match end {
                StreamEnd::Status(status) if status.code() == tonic::Code::FailedPrecondition => {
                    tracing::info!(peer = %self.url, "peer is this router itself: skipped");
                    return;
                }
                // Routers started together find each other's ports closed for a moment.
                end if !ever_subscribed && failures == 1 => {
                    tracing::info!(peer = %self.url, %end, "peer router not reachable yet; retrying");
                }
                end if !warned && (ever_subscribed || failures >= UNREACHABLE_WARN_AFTER) => {
                    tracing::warn!(peer = %self.url, %end, retry = ?retry, "peer router stream lost; subscribing again");
                    warned = true;
                }
                end => tracing::debug!(peer = %self.url, %end, "peer router still unreachable"),
            }
            tokio::time::sleep(retry).await;
            retry = (retry * 2).min(RETRY_MAX);
        }
    }

    async fn subscribe(&self, subscribed: &mut bool) -> StreamEnd {
        let endpoint = match &self.context.tls {
            Some(tls) => {
                match (self.endpoint.clone()).tls_config(tls.current(self.server_name.as_deref())) {
                    Ok(endpoint) => endpoint,
                    Err(error) => return error.into(),
                }
            }
            None => self.endpoint.clone(),
        };
        let channel = match endpoint.connect().await {
            Ok(channel) => channel,
            Err(error) => return error.into(),
        };
        let mut client =
            PeeringClient::new(channel).max_decoding_message_size(limits::MAX_MESSAGE_BYTES);
        let mut request = Request::new(pb::Subscribe {
            router_id: self.context.router_id,
        });
        if let Some(token) = (self.context.token)()
            && let Ok(value) = format!("Bearer {token}").parse()
        {
            request.metadata_mut().insert("authorization", value);
        }
        let mut stream = match client.picks(request).await {
            Ok(response) => response.into_inner(),
            Err(status) => return status.into(),
        };
        *subscribed = true;
        self.context.metrics.set_connected(&self.url, true);
        tracing::info!(peer = %self.url, "subscribed to peer router");
        let mut logged = false;
        loop {
            let update = match tokio::time::timeout(PEER_SILENCE, stream.message()).await {
                Err(_) => return StreamEnd::Silent,
                Ok(Err(status)) => return status.into(),
                Ok(Ok(None)) => return StreamEnd::Ended,
                Ok(Ok(Some(update))) => update,
            };
            let (kind, result) = self.apply(update);
            let outcome = match result {
                Ok(true) => "applied",
                Ok(false) => "ignored",
                Err(refusal) => {
                    if !logged {
                        tracing::warn!(peer = %self.url, kind, %refusal, "peer update refused (logged once per stream)");
                        logged = true;
                    }
                    "refused"
                }
            };
            self.context.metrics.count(&self.url, kind, outcome);
        }
    }

    /// Applies one update: its kind, and whether it was applied (`false`: it named nothing this
    /// router routes to).
    pub fn apply(&self, update: pb::PeerUpdate) -> (&'static str, Result<bool, Refusal>) {
        match update.body {
            Some(pb::peer_update::Body::Pick(pick)) => ("pick", self.apply_pick(pick)),
            Some(pb::peer_update::Body::Load(load)) => ("load", self.apply_load(load)),
            None => ("unknown", Err(Refusal::Empty)),
        }
    }

    fn apply_pick(&self, pick: pb::Pick) -> Result<bool, Refusal> {
        let (blocks, chunks) = (pick.block_hashes.len(), pick.tree_chain.len());
        // A placement alone (`placed`, from `cache_footprint`) carries no blocks; any other
        // pick says what was sent.
        if (blocks + chunks == 0 && !pick.placed) || blocks > limits::MAX_PICK_BLOCKS {
            return Err(Refusal::PickBlocks(blocks));
        }
        if chunks > limits::MAX_PICK_BLOCKS {
            return Err(Refusal::PickBlocks(chunks));
        }
        if pick.new_blocks as usize > blocks {
            return Err(Refusal::NewBlocks {
                new: pick.new_blocks,
                total: blocks,
            });
        }
        for name in [&pick.model, &pick.replica] {
            if name.len() > limits::MAX_NAME_BYTES {
                return Err(Refusal::NameLength(name.len()));
            }
        }
        // The model is the request's: a base model, or a LoRA adapter the replica lists.
        let routed_here = self
            .context
            .pool
            .snapshot()
            .find(&pick.replica)
            .is_some_and(|r| {
                r.serves(&pick.model)
                    || r.adapters()
                        .is_some_and(|catalog| catalog.get(&pick.model).is_some())
            });
        if !routed_here {
            return Ok(false);
        }
        self.context.sink.peer_picked(&PeerPick {
            model: pick.model,
            replica: pick.replica,
            hashes: pick.block_hashes.into_iter().map(ExternalHash).collect(),
            new_blocks: pick.new_blocks,
            tree_chain: pick.tree_chain.into(),
            placed: pick.placed,
        });
        Ok(true)
    }

    fn apply_load(&self, load: pb::Load) -> Result<bool, Refusal> {
        if load.replicas.len() > limits::MAX_LOAD_REPLICAS {
            return Err(Refusal::LoadReplicas(load.replicas.len()));
        }
        let snapshot = self.context.pool.snapshot();
        let mut loads: HashMap<String, u32> = HashMap::new();
        for replica in load.replicas {
            if replica.replica.len() > limits::MAX_NAME_BYTES {
                return Err(Refusal::NameLength(replica.replica.len()));
            }
            if replica.in_flight > limits::MAX_IN_FLIGHT {
                return Err(Refusal::InFlight(replica.in_flight));
            }
            if snapshot.find(&replica.replica).is_some() {
                let count = loads.entry(replica.replica).or_default();
                *count = count.saturating_add(replica.in_flight);
            }
        }
        self.context.loads.set(&self.url, loads);
        Ok(true)
    }
}
