//! The agent→router feed protocol, `llmgw.feed.v1` (see `llmgw/feed/v1/feed.proto` for the
//! stream's rules), and router peering, `llmgw.peer.v1`: the generated code, and constructors
//! for the messages both ends and their tests build. The agent's `uplink` and the router's `feed`
//! module implement the feed's two ends; the router's `peers` module both ends of peering.

mod messages;

/// `llmgw.feed.v1`.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("llmgw.feed.v1");
}

/// `llmgw.peer.v1`: router to router (see `llmgw/peer/v1/peer.proto`); the router's `peers`
/// module implements both ends.
pub mod peer {
    /// `llmgw.peer.v1`.
    pub mod v1 {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("llmgw.peer.v1");
    }
}
