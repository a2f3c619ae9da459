//! The agent→router feed protocol, `llmgw.feed.v1` (see `llmgw/feed/v1/feed.proto` for the
//! stream's rules). Generated code only; the agent's `uplink` and the router's `feed` module
//! implement the two ends.

/// `llmgw.feed.v1`.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("llmgw.feed.v1");
}
