//! Peering: routers behind one proxy tell each other what they routed (`llmgw.peer.v1`, see
//! `proto/llmgw/peer/v1/peer.proto`), so that two routers decide as one would.
//!
//! The KV index is the same in every router (every agent feeds every router), but some state
//! lives only in the router that made a pick until the engines' events arrive: the speculative
//! entries that send a burst of one prompt after its first request, the projections that tell
//! the placement scorer how full each cache is about to be, the count of new prompts it placed
//! on each cache lately, and the requests in flight. Without
//! peering, each router sees only its own half of these and places the overflow of new prompts
//! as if the other did not exist.
//!
//! * **Outgoing** ([`PickOutbox`]): `kv_cache` publishes each pick (model, replica, the
//!   prompt's block hashes, the blocks it adds), `prefix_tree` each pick's text chain, and
//!   `cache_footprint` each placement of a prompt found nowhere (`placed`, no blocks); the
//!   [`service`] streams them, and each replica's in-flight count, to every subscribed peer.
//! * **Incoming** ([`client`]): one task per peer subscribes, hands its picks to the scheduler
//!   ([`PickSink`]: `kv_cache` credits the replica as it does its own picks, `prefix_tree`
//!   records where the text went, `cache_footprint` counts the placement) and keeps its
//!   loads, whose sum over peers the pool adds to its own in-flight counts
//!   ([`crate::pool::Replica::peer_in_flight`]) while the peer's stream lasts. Peers are given
//!   by URL (`--peer`) or by a name that resolves to every router (`--peer-service`, followed
//!   by [`mesh`]); a router never subscribes to itself.
//!
//! Peering runs over the feed port and shares its security: the subscriber presents the feed
//! token, and over a TLS feed port subscribes over TLS (`--peer-tls-ca`, and a client
//! certificate when the feed asks for one; see [`options`]).
//!
//! Every number from a peer is bounded before it is used ([`limits`]); a message that breaks a
//! bound, or names a replica or model this router does not route to, is skipped and counted,
//! and the stream goes on: peering is advice, never state the router cannot do without.
//!
//! # Concurrency model
//! The outbox is a `tokio::sync::broadcast` channel: publishing never blocks, and a subscriber
//! that falls behind skips what it missed (counted). Each subscription is one tonic stream fed
//! by one task; each peer's client is one task (and the service's resolver one more, owning
//! the clients it started). The peers' loads sit behind one
//! `parking_lot::Mutex`, held while one peer's counts are replaced and the sums written to the
//! pool's atomics, never across an `.await`.

pub mod client;
pub mod mesh;
pub mod options;
pub mod service;

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::broadcast;

use crate::blockhash::ExternalHash;

pub use client::PeerLoads;
pub use options::{PeerOptions, PeerOptionsError, PeerService, PeerSettings};
pub use service::PeeringService;

/// Bounds on what a peer may send.
pub mod limits {
    /// Most block hashes in one pick: 2²⁰ tokens at 16 per block.
    pub const MAX_PICK_BLOCKS: usize = 65_536;
    /// Longest model or replica name.
    pub const MAX_NAME_BYTES: usize = 512;
    /// Most replicas in one load report.
    pub const MAX_LOAD_REPLICAS: usize = 16_384;
    /// Most requests one peer may claim in flight at one replica.
    pub const MAX_IN_FLIGHT: u32 = 1_000_000;
    /// Largest message a subscriber decodes (a pick of [`MAX_PICK_BLOCKS`] is 512 KiB).
    pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
}

/// A pick as routers share it: `replica` was chosen for a prompt of `hashes` (as its engine
/// will store them; empty when the router did not hash it), `new_blocks` of which it did not
/// hold, and whose text the prefix tree keys by `tree_chain` (empty when no tree recorded it);
/// `placed` when the prompt was found nowhere and a placement scorer chose the replica. Each
/// scorer publishes the part it knows, so one decision may send more than one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerPick {
    pub model: String,
    /// `ip:port`, as the destination header carries it.
    pub replica: String,
    pub hashes: Arc<[ExternalHash]>,
    pub new_blocks: u32,
    pub tree_chain: Arc<[u64]>,
    pub placed: bool,
}

/// What learns from peers' picks: the scheduler, whose scorers credit them.
pub trait PickSink: Send + Sync {
    fn peer_picked(&self, pick: &PeerPick);
}

/// How many picks the outbox keeps for a subscriber that is behind before it skips them.
const OUTBOX_CAPACITY: usize = 4_096;

/// This router's picks, for its peers' subscriptions.
#[derive(Debug)]
pub struct PickOutbox {
    sender: broadcast::Sender<Arc<PeerPick>>,
}

impl Default for PickOutbox {
    fn default() -> Self {
        PickOutbox {
            sender: broadcast::Sender::new(OUTBOX_CAPACITY),
        }
    }
}

impl PickOutbox {
    /// Publishes the pick `make` builds, if any peer is subscribed (else `make` is not called:
    /// a router without peers allocates nothing).
    pub fn publish(&self, make: impl FnOnce() -> PeerPick) {
        if self.sender.receiver_count() > 0 {
            // Fails only when the last subscriber left meanwhile: nobody to tell.
            let _ = self.sender.send(Arc::new(make()));
        }
    }

    /// Picks published from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<PeerPick>> {
        self.sender.subscribe()
    }
}

/// `kind` and `outcome` of a peer update, for `llmgw_peer_updates_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpdateLabels {
    pub peer: String,
    pub kind: &'static str,
    pub outcome: &'static str,
}

/// The `kind` and `outcome` labels of `llmgw_peer_updates_total`.
const UPDATE_KINDS: [&str; 3] = ["pick", "load", "unknown"];
const UPDATE_OUTCOMES: [&str; 3] = ["applied", "ignored", "refused"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerLabel {
    pub peer: String,
}

/// Peering's metrics, both ends.
#[derive(Debug, Clone, Default)]
pub struct PeerMetrics {
    /// Updates received, by peer, kind (pick, load) and outcome (applied; ignored: names a
    /// replica or model not routed here; refused: breaks a bound).
    pub updates: Family<UpdateLabels, Counter>,
    /// 1 while the stream from the peer is open.
    pub connected: Family<PeerLabel, Gauge>,
    /// Picks a subscriber missed because it fell behind.
    pub skipped: Counter,
}

impl PeerMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "llmgw_peer_updates",
            "Updates received from peer routers, by peer, kind (pick, load) and outcome \
             (applied; ignored: a replica or model not routed here; refused: out of bounds)",
            self.updates.clone(),
        );
        registry.register(
            "llmgw_peer_connected",
            "1 while the stream of picks from the peer router is open",
            self.connected.clone(),
        );
        registry.register(
            "llmgw_peer_picks_skipped",
            "Picks not sent to a subscribed peer because it fell behind",
            self.skipped.clone(),
        );
    }

    fn set_connected(&self, peer: &str, open: bool) {
        self.connected
            .get_or_create(&PeerLabel {
                peer: peer.to_owned(),
            })
            .set(i64::from(open));
    }

    /// Drops every series of `peer`.
    fn remove(&self, peer: &str) {
        self.connected.remove(&PeerLabel {
            peer: peer.to_owned(),
        });
        for kind in UPDATE_KINDS {
            for outcome in UPDATE_OUTCOMES {
                self.updates.remove(&UpdateLabels {
                    peer: peer.to_owned(),
                    kind,
                    outcome,
                });
            }
        }
    }

    fn count(&self, peer: &str, kind: &'static str, outcome: &'static str) {
        self.updates
            .get_or_create(&UpdateLabels {
                peer: peer.to_owned(),
                kind,
                outcome,
            })
            .inc();
    }
}

/// A random id for this router process, so it can refuse a subscription from itself.
pub fn router_id() -> u64 {
    rand::random()
}

#[cfg(test)]
mod tests;
