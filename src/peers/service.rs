//! The sending end: `llmgw.peer.v1.Peering/Picks` streams this router's picks and, at least
//! every [`LOAD_EVERY`], its requests in flight per replica, to one subscribed peer.
//!
//! Concurrency: one task per subscription reads the outbox's broadcast and a timer and writes
//! the stream's channel; it ends when the subscriber goes away (its send fails).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use llmgw_feed_proto::peer::v1 as pb;
use pb::peering_server::{Peering, PeeringServer};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use super::{PeerMetrics, PeerPick, PickOutbox, limits};
use crate::pool::Pool;

/// How often the loads are looked at; they are sent when they changed.
pub const LOAD_CHECK: Duration = Duration::from_millis(50);
/// The longest time between two loads, changed or not: the subscriber's sign of life.
pub const LOAD_EVERY: Duration = Duration::from_secs(1);
/// Updates queued for one subscriber's stream.
const STREAM_BUFFER: usize = 256;

/// Checks a subscriber's credentials (the feed's token).
pub type Authorize = Arc<dyn Fn(&MetadataMap) -> Result<(), Status> + Send + Sync>;

/// Serves this router's picks and loads to its peers.
#[derive(Clone)]
pub struct PeeringService {
    router_id: u64,
    outbox: Arc<PickOutbox>,
    pool: Arc<Pool>,
    authorize: Authorize,
    metrics: PeerMetrics,
}

impl std::fmt::Debug for PeeringService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeeringService")
            .field("router_id", &self.router_id)
            .finish_non_exhaustive()
    }
}

impl PeeringService {
    pub fn new(
        router_id: u64,
        outbox: Arc<PickOutbox>,
        pool: Arc<Pool>,
        authorize: Authorize,
        metrics: PeerMetrics,
    ) -> PeeringService {
        PeeringService {
            router_id,
            outbox,
            pool,
            authorize,
            metrics,
        }
    }

    pub fn into_server(self) -> PeeringServer<PeeringService> {
        PeeringServer::new(self)
    }
}

type UpdateStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::PeerUpdate, Status>> + Send>>;

#[tonic::async_trait]
impl Peering for PeeringService {
    type PicksStream = UpdateStream;

    async fn picks(
        &self,
        request: Request<pb::Subscribe>,
    ) -> Result<Response<Self::PicksStream>, Status> {
        (self.authorize)(request.metadata())?;
        if request.get_ref().router_id == self.router_id {
            return Err(Status::failed_precondition(
                "a router does not peer with itself",
            ));
        }
        let picks = self.outbox.subscribe();
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        tokio::spawn(send_updates(
            picks,
            Arc::clone(&self.pool),
            tx,
            self.metrics.clone(),
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Feeds one subscriber until it leaves.
async fn send_updates(
    mut picks: broadcast::Receiver<Arc<PeerPick>>,
    pool: Arc<Pool>,
    tx: mpsc::Sender<Result<pb::PeerUpdate, Status>>,
    metrics: PeerMetrics,
) {
    let mut check = tokio::time::interval(LOAD_CHECK);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_load: Option<(pb::Load, tokio::time::Instant)> = None;
    loop {
        let update = tokio::select! {
            pick = picks.recv() => match pick {
                Ok(pick) => pick_update(&pick),
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    metrics.skipped.inc_by(missed);
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = check.tick() => {
                let now = tokio::time::Instant::now();
                let load = load_of(&pool);
                let due = last_load
                    .as_ref()
                    .is_none_or(|(last, at)| *last != load || now - *at >= LOAD_EVERY);
                if !due {
                    continue;
                }
                last_load = Some((load.clone(), now));
                pb::PeerUpdate { body: Some(pb::peer_update::Body::Load(load)) }
            }
        };
        if tx.send(Ok(update)).await.is_err() {
            return;
        }
    }
}

fn pick_update(pick: &PeerPick) -> pb::PeerUpdate {
    pb::PeerUpdate {
        body: Some(pb::peer_update::Body::Pick(pb::Pick {
            model: pick.model.clone(),
            replica: pick.replica.clone(),
            block_hashes: pick.hashes.iter().map(|h| h.0).collect(),
            new_blocks: pick.new_blocks,
            tree_chain: pick.tree_chain.to_vec(),
            placed: pick.placed,
        })),
    }
}

/// This router's own requests in flight at each replica (never what peers reported: each
/// router speaks only for itself, so nothing is counted twice).
fn load_of(pool: &Pool) -> pb::Load {
    let snapshot = pool.snapshot();
    pb::Load {
        replicas: snapshot
            .replicas()
            .iter()
            .take(limits::MAX_LOAD_REPLICAS)
            .map(|r| pb::ReplicaLoad {
                replica: r.endpoint().to_owned(),
                in_flight: r.in_flight().min(limits::MAX_IN_FLIGHT),
            })
            .collect(),
    }
}
