//! Constructors for the messages every party builds the same way: the agent's uplink, the
//! router's tests and the hostile clients of the integration tests.

use crate::v1::{AgentMessage, Block, Delta, EngineInfo, Hello, Snapshot, agent_message};

impl AgentMessage {
    /// Message `id` of a stream (ids count from 1; the router acknowledges each).
    pub fn numbered(id: u64, body: agent_message::Body) -> AgentMessage {
        AgentMessage {
            id,
            body: Some(body),
        }
    }
}

impl Block {
    /// `count` copies of block `hash` in group 0, in GPU memory.
    pub fn copies(hash: u64, count: u32) -> Block {
        Block {
            hash,
            count,
            ..Block::default()
        }
    }
}

impl EngineInfo {
    /// An engine and the replica it serves, hash settings unset.
    pub fn serving(engine: &str, replica: &str) -> EngineInfo {
        EngineInfo {
            engine: engine.to_owned(),
            replica: replica.to_owned(),
            ..EngineInfo::default()
        }
    }
}

impl agent_message::Body {
    /// The Hello that opens a node's stream.
    pub fn hello(node: &str, agent_version: &str, engines: Vec<EngineInfo>) -> Self {
        agent_message::Body::Hello(Hello {
            node: node.to_owned(),
            agent_version: agent_version.to_owned(),
            engines,
        })
    }

    /// A whole snapshot of `engine` at epoch 0, seq 0, in one part.
    pub fn snapshot(engine: &str, blocks: Vec<Block>) -> Self {
        agent_message::Body::Snapshot(Snapshot {
            engine: engine.to_owned(),
            blocks,
            ..Snapshot::default()
        })
    }

    /// Delta `seq` of `engine` at epoch 0, storing `stored`.
    pub fn delta(engine: &str, seq: u64, stored: Vec<Block>) -> Self {
        agent_message::Body::Delta(Delta {
            engine: engine.to_owned(),
            seq,
            stored,
            ..Delta::default()
        })
    }
}
