//! The agent→router feed protocol, `llmgw.feed.v1` (see `llmgw/feed/v1/feed.proto` for the
//! stream's rules): the generated code, and constructors for the messages both ends and their
//! tests build. The agent's `uplink` and the router's `feed` module implement the two ends.

mod messages;

/// `llmgw.feed.v1`.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("llmgw.feed.v1");
}
