//! `make fuzz-feed`: the router's feed state machine, driven with arbitrary sequences of agent
//! streams and messages (structured ones with small value domains, so that sequences get deep,
//! and raw protobuf bytes as the wire would carry them), in front of the real KV index. After
//! every operation the index must hold exactly what the state says each replica's engines hold:
//! no panic, no block left behind by a refused, superseded or expired stream, no count
//! expanded into memory.

#![no_main]

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use llmgw::feed::{FeedLimits, FeedMetrics, FeedState, NodeMap, StreamId};
use llmgw::kvindex::{IndexConfig, KvIndex};
use llmgw_feed_proto::v1 as pb;
use prost::Message as _;
use tokio::time::Instant;

const NODES: [&str; 3] = ["n1", "n2", ""];
const ENGINES: [&str; 4] = ["e1", "e2", "e3", "x"];
const REPLICAS: [&str; 4] = ["r1", "r2", "r3", "rx"];

#[derive(Debug, Arbitrary)]
enum Op {
    Open,
    Close(u8),
    Raw(u8, Vec<u8>),
    Hello {
        stream: u8,
        node: u8,
        engines: Vec<(u8, u8)>,
    },
    Snapshot {
        stream: u8,
        engine: u8,
        epoch: u8,
        seq: u8,
        blocks: Vec<(u8, u8, u32)>,
        more: bool,
    },
    Delta {
        stream: u8,
        engine: u8,
        epoch: u8,
        seq: u8,
        reset: bool,
        stored: Vec<(u8, u8, u32)>,
        removed: Vec<(u8, u8, u32)>,
    },
    Advance(u8),
    Reload(bool),
}

fn blocks(list: &[(u8, u8, u32)]) -> Vec<pb::Block> {
    list.iter()
        .map(|&(hash, flags, count)| pb::Block {
            hash: u64::from(hash % 16),
            group: u32::from(flags & 1),
            medium: i32::from((flags >> 1) & 1),
            count,
        })
        .collect()
}

fn configured(moved: bool) -> NodeMap {
    let mut map: NodeMap = HashMap::new();
    map.insert("n1".into(), ["r1".to_owned(), "r2".to_owned()].into());
    map.insert(
        "n2".into(),
        if moved {
            ["r1".to_owned()]
        } else {
            ["r3".to_owned()]
        }
        .into(),
    );
    map
}

/// What the index says each replica holds.
fn index_view(index: &KvIndex) -> BTreeMap<String, BTreeSet<u64>> {
    REPLICAS
        .iter()
        .map(|r| {
            (
                r.to_string(),
                index.replica_blocks(r).into_iter().map(|h| h.0).collect(),
            )
        })
        .filter(|(_, held): &(String, BTreeSet<u64>)| !held.is_empty())
        .collect()
}

fuzz_target!(|ops: Vec<Op>| {
    let mut st = FeedState::new(
        configured(false),
        HashMap::new(),
        FeedLimits {
            max_blocks_per_engine: 64,
            max_engines_per_hello: 8,
            max_name_bytes: 16,
        },
        Duration::from_secs(30),
        FeedMetrics::default(),
    );
    let index = KvIndex::new(IndexConfig::default());
    let start = Instant::now();
    let mut now = Duration::ZERO;
    let mut streams: Vec<StreamId> = Vec::new();
    let mut ids: HashMap<StreamId, u64> = HashMap::new();
    for op in ops.into_iter().take(256) {
        let at = start + now;
        let pick = |i: u8| streams.get(usize::from(i) % streams.len().max(1)).copied();
        let message = match op {
            Op::Open => {
                streams.push(st.open());
                None
            }
            Op::Close(i) => {
                if let Some(s) = pick(i) {
                    st.close(s, at);
                }
                None
            }
            Op::Advance(secs) => {
                now += Duration::from_secs(u64::from(secs));
                st.reap(&index, start + now);
                None
            }
            Op::Reload(moved) => {
                for s in st.set_nodes(&index, configured(moved)).unwrap_or_default() {
                    st.close(s, at);
                }
                None
            }
            Op::Raw(i, bytes) => pick(i).zip(pb::AgentMessage::decode(bytes.as_slice()).ok()),
            Op::Hello {
                stream,
                node,
                engines,
            } => pick(stream).map(|s| {
                let body = pb::agent_message::Body::Hello(pb::Hello {
                    node: NODES[usize::from(node) % NODES.len()].into(),
                    agent_version: String::new(),
                    engines: engines
                        .iter()
                        .map(|&(e, r)| pb::EngineInfo {
                            engine: ENGINES[usize::from(e) % ENGINES.len()].into(),
                            replica: REPLICAS[usize::from(r) % REPLICAS.len()].into(),
                            ..pb::EngineInfo::default()
                        })
                        .collect(),
                });
                (
                    s,
                    pb::AgentMessage {
                        id: 0,
                        body: Some(body),
                    },
                )
            }),
            Op::Snapshot {
                stream,
                engine,
                epoch,
                seq,
                blocks: list,
                more,
            } => pick(stream).map(|s| {
                let body = pb::agent_message::Body::Snapshot(pb::Snapshot {
                    engine: ENGINES[usize::from(engine) % ENGINES.len()].into(),
                    epoch: u64::from(epoch % 4),
                    seq: u64::from(seq % 8),
                    blocks: blocks(&list),
                    hash_status: 0,
                    more,
                });
                (
                    s,
                    pb::AgentMessage {
                        id: 0,
                        body: Some(body),
                    },
                )
            }),
            Op::Delta {
                stream,
                engine,
                epoch,
                seq,
                reset,
                stored,
                removed,
            } => pick(stream).map(|s| {
                let body = pb::agent_message::Body::Delta(pb::Delta {
                    engine: ENGINES[usize::from(engine) % ENGINES.len()].into(),
                    epoch: u64::from(epoch % 4),
                    seq: u64::from(seq % 8),
                    reset,
                    stored: blocks(&stored),
                    removed: blocks(&removed),
                    oldest_event_ts: 0.0,
                });
                (
                    s,
                    pb::AgentMessage {
                        id: 0,
                        body: Some(body),
                    },
                )
            }),
        };
        if let Some((stream, mut msg)) = message {
            let id = ids.entry(stream).or_insert(0);
            *id += 1;
            msg.id = *id;
            match st.apply(&index, stream, msg) {
                Ok(applied) => {
                    if let Some(old) = applied.superseded {
                        st.close(old, at);
                    }
                }
                // The service ends the stream: so does the fuzzer.
                Err(_) => st.close(stream, at),
            }
        }
        // The index equals the state's own account of each replica's engines.
        let want: BTreeMap<String, BTreeSet<u64>> = st
            .replica_holders()
            .into_iter()
            .map(|(r, held)| (r, held.keys().map(|(h, _)| h.0).collect()))
            .filter(|(_, held): &(String, BTreeSet<u64>)| !held.is_empty())
            .collect();
        assert_eq!(index_view(&index), want);
        let distinct: HashSet<u64> = want.values().flatten().copied().collect();
        assert_eq!(index.distinct_blocks(), distinct.len());
    }
});
