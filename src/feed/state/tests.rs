//! The feed state machine: rules one by one, then a property test of random operation
//! sequences (honest and hostile) against a reference model, through the real index as well.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use parking_lot::Mutex;
use proptest::prelude::*;
use tokio::time::Instant;

use super::*;
use crate::kvindex::{IndexConfig, KvIndex, MAX_COPIES_PER_REPLICA};
use crate::models::ModelSettings;

type Copies = HashMap<(ExternalHash, Medium), u64>;

/// An index stand-in: exact copies per (replica, hash, tier), panicking on a removal of
/// copies it does not hold (the sink contract), and on a replica cleared whole (the feed tells
/// only differences).
#[derive(Default)]
struct Recorder {
    held: Mutex<HashMap<String, Copies>>,
    /// Replicas told they lost their cache, in order.
    losses: Mutex<Vec<String>>,
    /// Blocks in every change told so far, and how many of them were evictions.
    touched: Mutex<(u64, u64)>,
}

impl KvEventSink for Recorder {
    fn stored_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        self.touched.lock().0 += blocks.len() as u64;
        let mut held = self.held.lock();
        let r = held.entry(replica.to_owned()).or_default();
        for &(h, n) in blocks.iter().filter(|(_, n)| *n > 0) {
            *r.entry((h, medium)).or_insert(0) += u64::from(n);
        }
    }
    fn removed_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        self.touched.lock().1 += blocks.len() as u64;
        self.withdrawn_copies(replica, blocks, medium);
    }
    fn withdrawn_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        self.touched.lock().0 += blocks.len() as u64;
        let mut held = self.held.lock();
        let r = held.entry(replica.to_owned()).or_default();
        for &(h, n) in blocks.iter().filter(|(_, n)| *n > 0) {
            let copies = r
                .get_mut(&(h, medium))
                .unwrap_or_else(|| panic!("removed {h} from {replica} without holding it"));
            *copies = copies
                .checked_sub(u64::from(n))
                .unwrap_or_else(|| panic!("removed more copies of {h} than {replica} held"));
            if *copies == 0 {
                r.remove(&(h, medium));
            }
        }
        held.retain(|_, r| !r.is_empty());
    }
    fn cleared(&self, replica: &str) {
        panic!("{replica} cleared whole: the feed tells the index differences only");
    }
    fn lost_blocks(&self, replica: &str, blocks: &[(ExternalHash, Medium)]) {
        self.losses.lock().push(replica.to_owned());
        for &(hash, medium) in blocks {
            self.withdrawn_copies(replica, &[(hash, 1)], medium);
        }
    }
}

impl Recorder {
    fn hashes(&self, replica: &str) -> HashSet<u64> {
        self.held
            .lock()
            .get(replica)
            .map(|r| r.keys().map(|(h, _)| h.0).collect())
            .unwrap_or_default()
    }
    fn copies(&self) -> HashMap<String, Copies> {
        self.held.lock().clone()
    }
    /// Blocks touched by changes since the last call, and how many of them were evictions.
    fn take_touched(&self) -> (u64, u64) {
        std::mem::take(&mut *self.touched.lock())
    }
}

/// Both the recorder and the real index.
struct Tee<'a>(&'a Recorder, &'a KvIndex);

impl KvEventSink for Tee<'_> {
    fn stored_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        self.0.stored_copies(replica, blocks, medium);
        self.1.stored_copies(replica, blocks, medium);
    }
    fn removed_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        self.0.removed_copies(replica, blocks, medium);
        self.1.removed_copies(replica, blocks, medium);
    }
    fn withdrawn_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        self.0.withdrawn_copies(replica, blocks, medium);
        self.1.withdrawn_copies(replica, blocks, medium);
    }
    fn cleared(&self, replica: &str) {
        self.0.cleared(replica);
        self.1.cleared(replica);
    }
    fn lost_blocks(&self, replica: &str, blocks: &[(ExternalHash, Medium)]) {
        self.0.lost_blocks(replica, blocks);
        self.1.lost_blocks(replica, blocks);
    }
    fn reporting(&self, replica: &str) {
        self.0.reporting(replica);
        self.1.reporting(replica);
    }
}

fn configured() -> NodeMap {
    [
        ("n1".to_owned(), ["r1".to_owned(), "r2".to_owned()].into()),
        ("n2".to_owned(), ["r3".to_owned()].into()),
    ]
    .into()
}

fn limits(max_blocks: u64) -> FeedLimits {
    FeedLimits {
        max_blocks_per_engine: max_blocks,
        max_engines_per_hello: 4,
        max_name_bytes: 16,
    }
}

fn state(grace: Duration) -> FeedState {
    FeedState::new(
        configured(),
        HashMap::new(),
        limits(1000),
        grace,
        FeedMetrics::default(),
    )
}

fn msg(id: u64, body: pb::agent_message::Body) -> pb::AgentMessage {
    pb::AgentMessage::numbered(id, body)
}

fn hello(node: &str, engines: &[(&str, &str)]) -> pb::agent_message::Body {
    let engines = engines
        .iter()
        .map(|(e, r)| pb::EngineInfo::serving(e, r))
        .collect();
    pb::agent_message::Body::hello(node, "test", engines)
}

fn block(hash: u64, count: u32) -> pb::Block {
    pb::Block::copies(hash, count)
}

fn snapshot(engine: &str, epoch: u64, seq: u64, blocks: &[u64]) -> pb::agent_message::Body {
    snapshot_part(
        engine,
        epoch,
        seq,
        blocks.iter().map(|h| block(*h, 1)).collect(),
        false,
    )
}

fn snapshot_part(
    engine: &str,
    epoch: u64,
    seq: u64,
    blocks: Vec<pb::Block>,
    more: bool,
) -> pb::agent_message::Body {
    pb::agent_message::Body::Snapshot(pb::Snapshot {
        engine: engine.into(),
        epoch,
        seq,
        blocks,
        hash_status: 0,
        more,
    })
}

fn delta(
    engine: &str,
    epoch: u64,
    seq: u64,
    reset: bool,
    stored: &[u64],
    removed: &[u64],
) -> pb::agent_message::Body {
    pb::agent_message::Body::Delta(pb::Delta {
        engine: engine.into(),
        epoch,
        seq,
        reset,
        stored: stored.iter().map(|h| block(*h, 1)).collect(),
        removed: removed.iter().map(|h| block(*h, 1)).collect(),
        oldest_event_ts: 0.0,
    })
}

/// A state, its sink and one stream that said Hello for n1 with engine e1 on r1.
struct Fixture {
    st: FeedState,
    rec: Recorder,
    stream: StreamId,
    next_id: u64,
}

impl Fixture {
    fn new() -> Fixture {
        let mut st = state(Duration::from_secs(30));
        let stream = st.open();
        let mut f = Fixture {
            st,
            rec: Recorder::default(),
            stream,
            next_id: 0,
        };
        f.ok(hello("n1", &[("e1", "r1")]));
        f
    }

    fn send(&mut self, body: pb::agent_message::Body) -> Result<Applied, StreamEnd> {
        self.next_id += 1;
        self.st
            .apply(&self.rec, self.stream, msg(self.next_id, body))
    }

    fn ok(&mut self, body: pb::agent_message::Body) -> Vec<pb::RouterMessage> {
        self.send(body).unwrap_or_else(|e| panic!("{e}")).replies
    }

    fn violation(&mut self, body: pb::agent_message::Body) -> Violation {
        match self.send(body) {
            Err(StreamEnd::Violation { violation, .. }) => violation,
            other => panic!("expected a violation, got {other:?}"),
        }
    }
}

fn refusal(replies: &[pb::RouterMessage]) -> Option<&pb::Refused> {
    replies.iter().find_map(|r| match &r.body {
        Some(pb::router_message::Body::Refused(f)) => Some(f),
        _ => None,
    })
}

#[test]
fn snapshots_and_deltas_reach_the_index_and_are_acknowledged() {
    let mut f = Fixture::new();
    let replies = f.ok(snapshot_part(
        "e1",
        0,
        2,
        vec![
            block(1, 1),
            block(2, 1),
            pb::Block {
                group: 1,
                ..block(9, 1)
            },
        ],
        false,
    ));
    assert!(matches!(
        replies.last().and_then(|r| r.body.clone()),
        Some(pb::router_message::Body::Ack(pb::Ack { id: 2 }))
    ));
    assert_eq!(f.rec.hashes("r1"), [1, 2].into(), "group 1 stays out");
    f.ok(delta("e1", 0, 3, false, &[3], &[1]));
    assert_eq!(f.rec.hashes("r1"), [2, 3].into());
    // A new epoch starts with a reset.
    f.ok(delta("e1", 1, 1, true, &[4], &[]));
    assert_eq!(f.rec.hashes("r1"), [4].into());
    // A skipped delta ends the stream so the agent resends snapshots; nothing of it applies.
    assert!(matches!(
        f.send(delta("e1", 1, 3, false, &[5], &[])),
        Err(StreamEnd::Gap(_))
    ));
    assert_eq!(f.rec.hashes("r1"), [4].into());
    assert_eq!(f.st.metrics.out_of_order.get(), 1);
}

#[test]
fn an_empty_snapshot_makes_its_replica_known_to_the_index_as_empty() {
    // A freshly started engine caches nothing: its snapshot tells the index that the replica
    // reports events, so the scorers weigh it as an empty cache rather than abstaining as if
    // no agent ran.
    let mut st = state(Duration::from_secs(30));
    let stream = st.open();
    let index = KvIndex::new(IndexConfig::default());
    let mut apply = |id, body| {
        st.apply(&index, stream, msg(id, body))
            .unwrap_or_else(|e| panic!("{e}"));
    };
    apply(1, hello("n1", &[("e1", "r1"), ("e2", "r2")]));
    assert_eq!(
        index.slot("r1"),
        None,
        "a Hello alone says nothing of the cache"
    );
    apply(2, snapshot("e1", 0, 0, &[]));
    assert!(index.slot("r1").is_some());
    assert_eq!(index.replica_block_count("r1"), 0);
    assert_eq!(index.slot("r2"), None, "its snapshot has not come yet");
}

#[test]
fn a_node_is_synced_once_its_owner_has_sent_every_engine_s_snapshot() {
    let mut st = state(Duration::from_secs(30));
    let rec = Recorder::default();
    assert_eq!(st.unsynced_nodes(), ["n1", "n2"]);
    let n1 = st.open();
    let send = |st: &mut FeedState, stream, id, body| {
        st.apply(&rec, stream, msg(id, body))
            .unwrap_or_else(|e| panic!("{e}"))
    };
    send(&mut st, n1, 1, hello("n1", &[("e1", "r1"), ("e2", "r2")]));
    assert_eq!(st.unsynced_nodes(), ["n1", "n2"], "no snapshot yet");
    send(&mut st, n1, 2, snapshot("e1", 0, 1, &[1, 2]));
    // A snapshot in parts counts once its last part arrived.
    send(
        &mut st,
        n1,
        3,
        snapshot_part("e2", 0, 1, vec![block(3, 1)], true),
    );
    assert_eq!(st.unsynced_nodes(), ["n1", "n2"]);
    send(
        &mut st,
        n1,
        4,
        snapshot_part("e2", 0, 1, vec![block(4, 1)], false),
    );
    assert_eq!(st.unsynced_nodes(), ["n2"]);
    let n2 = st.open();
    send(&mut st, n2, 1, hello("n2", &[("e3", "r3")]));
    send(&mut st, n2, 2, snapshot("e3", 0, 1, &[]));
    assert!(st.unsynced_nodes().is_empty());
    // The agent's stream ends: its node waits for the next stream's snapshots.
    st.close(n2, Instant::now());
    assert_eq!(st.unsynced_nodes(), ["n2"]);
}

#[test]
fn a_stream_that_breaks_the_protocol_is_refused_and_nothing_of_the_message_applies() {
    // Before Hello.
    let mut st = state(Duration::from_secs(30));
    let rec = Recorder::default();
    let s = st.open();
    for body in [
        snapshot("e1", 0, 0, &[1]),
        delta("e1", 0, 1, false, &[1], &[]),
    ] {
        assert!(matches!(
            st.apply(&rec, s, msg(1, body)),
            Err(StreamEnd::Violation {
                violation: Violation::BeforeHello,
                ..
            })
        ));
    }
    // A delta before the engine's snapshot, even a reset.
    let mut f = Fixture::new();
    assert_eq!(
        f.violation(delta("e1", 1, 1, true, &[1], &[])),
        Violation::DeltaBeforeSnapshot
    );
    // An engine the Hello did not list.
    let mut f = Fixture::new();
    assert_eq!(
        f.violation(snapshot("e9", 0, 0, &[1])),
        Violation::UnknownEngine
    );
    // A second Hello.
    assert_eq!(
        f.violation(hello("n1", &[("e1", "r1")])),
        Violation::HelloTwice
    );
    // Epoch and seq going back.
    let mut f = Fixture::new();
    f.ok(snapshot("e1", 2, 5, &[1]));
    assert_eq!(
        f.violation(delta("e1", 1, 9, true, &[7], &[])),
        Violation::EpochBack
    );
    assert_eq!(
        f.violation(delta("e1", 2, 5, false, &[7], &[])),
        Violation::SeqBack
    );
    assert_eq!(
        f.violation(snapshot("e1", 1, 0, &[7])),
        Violation::EpochBack
    );
    assert_eq!(f.violation(snapshot("e1", 2, 4, &[7])), Violation::SeqBack);
    assert_eq!(f.rec.hashes("r1"), [1].into(), "none of those applied");
    // seq at u64::MAX: the next one does not exist, and nothing overflows.
    let mut f = Fixture::new();
    f.ok(snapshot("e1", 0, u64::MAX, &[1]));
    assert_eq!(
        f.violation(delta("e1", 0, u64::MAX, false, &[2], &[])),
        Violation::SeqBack
    );
    f.ok(delta("e1", 1, 1, true, &[2], &[]));
    assert_eq!(f.rec.hashes("r1"), [2].into());
    // Hellos out of bounds.
    let mut st = state(Duration::from_secs(30));
    for (body, want) in [
        (hello("", &[]), Violation::BadName),
        (hello(&"n".repeat(17), &[]), Violation::BadName),
        (hello("n1", &[("e", "r1"); 5]), Violation::TooManyEngines),
        (
            hello("n1", &[("e", "r1"), ("e", "r2")]),
            Violation::DuplicateEngine,
        ),
        (hello("n1", &[("e", &"r".repeat(17))]), Violation::BadName),
    ] {
        let s = st.open();
        match st.apply(&rec, s, msg(1, body)) {
            Err(StreamEnd::Violation { violation, .. }) => assert_eq!(violation, want),
            other => panic!("{want:?}: {other:?}"),
        }
        st.close(s, Instant::now());
    }
    // Every violation has its own label.
    let labels: HashSet<&str> = Violation::ALL.iter().map(|v| v.label()).collect();
    assert_eq!(labels.len(), Violation::ALL.len());
}

#[test]
fn counts_are_carried_as_counts_and_a_ceiling_refuses_an_engine_that_reports_too_many() {
    // The reported attack: one block of count u32::MAX, or two of 3e9 for one hash.
    for blocks in [
        vec![block(1, u32::MAX)],
        vec![block(1, 3_000_000_000), block(1, 3_000_000_000)],
    ] {
        let mut f = Fixture::new();
        f.ok(snapshot("e1", 0, 0, &[5]));
        let replies = f.ok(snapshot_part("e1", 0, 1, blocks, false));
        let refused = refusal(&replies).expect("the engine is refused");
        assert!(
            refused.reason.contains("over the ceiling of 1000"),
            "{}",
            refused.reason
        );
        assert!(
            f.rec.hashes("r1").is_empty(),
            "its earlier blocks are dropped too"
        );
        assert_eq!(
            f.st.metrics
                .refused
                .get_or_create(&super::super::ReasonLabel {
                    reason: "over_block_ceiling"
                })
                .get(),
            1
        );
        // Its later messages are ignored, not applied.
        f.ok(delta("e1", 0, 2, false, &[6], &[]));
        assert!(f.rec.hashes("r1").is_empty());
    }
    // Under the ceiling, copies are counts: three stored, three removals to go; the index
    // hears one reference, the engine's.
    let mut f = Fixture::new();
    f.ok(snapshot_part("e1", 0, 0, vec![block(1, 3)], false));
    assert_eq!(f.rec.copies()["r1"][&(ExternalHash(1), Medium::Gpu)], 1);
    for seq in 1..=3 {
        assert_eq!(f.rec.hashes("r1"), [1].into(), "{seq}");
        f.ok(delta("e1", 0, seq, false, &[], &[1]));
    }
    assert!(f.rec.hashes("r1").is_empty());
    // A delta over the ceiling is refused before any of it applies.
    let mut f = Fixture::new();
    f.ok(snapshot_part("e1", 0, 0, vec![block(1, 600)], false));
    let replies = f.ok(pb::agent_message::Body::Delta(pb::Delta {
        engine: "e1".into(),
        epoch: 0,
        seq: 1,
        stored: vec![block(2, 401)],
        ..pb::Delta::default()
    }));
    assert!(refusal(&replies).is_some());
    assert!(f.rec.hashes("r1").is_empty());
    // A removal of more copies than held removes what is held, no more.
    let mut f = Fixture::new();
    f.ok(snapshot_part("e1", 0, 0, vec![block(1, 2)], false));
    f.ok(pb::agent_message::Body::Delta(pb::Delta {
        engine: "e1".into(),
        epoch: 0,
        seq: 1,
        removed: vec![block(1, u32::MAX), block(8, 5)],
        ..pb::Delta::default()
    }));
    assert!(f.rec.hashes("r1").is_empty());
}

#[test]
fn a_snapshot_in_parts_applies_whole_once_its_last_part_arrives() {
    let mut f = Fixture::new();
    f.ok(snapshot("e1", 0, 0, &[1]));
    f.ok(snapshot_part("e1", 1, 4, vec![block(2, 1)], true));
    f.ok(snapshot_part("e1", 1, 4, vec![block(3, 1)], true));
    assert_eq!(
        f.rec.hashes("r1"),
        [1].into(),
        "nothing of a partial snapshot applies"
    );
    f.ok(snapshot_part("e1", 1, 4, vec![block(4, 1)], false));
    assert_eq!(f.rec.hashes("r1"), [2, 3, 4].into());
    f.ok(delta("e1", 1, 5, false, &[5], &[2]));
    assert_eq!(f.rec.hashes("r1"), [3, 4, 5].into());

    // Parts that disagree, or a delta between parts, break the protocol.
    let mut f = Fixture::new();
    f.ok(snapshot_part("e1", 1, 4, vec![block(2, 1)], true));
    assert_eq!(
        f.violation(snapshot_part("e1", 1, 5, vec![block(3, 1)], false)),
        Violation::SnapshotPartsDiffer
    );
    let mut f = Fixture::new();
    f.ok(snapshot("e1", 0, 0, &[1]));
    f.ok(snapshot_part("e1", 0, 1, vec![block(2, 1)], true));
    assert_eq!(
        f.violation(delta("e1", 0, 2, false, &[3], &[])),
        Violation::DeltaDuringSnapshot
    );
    // The ceiling counts every part.
    let mut f = Fixture::new();
    f.ok(snapshot_part("e1", 0, 0, vec![block(1, 600)], true));
    let replies = f.ok(snapshot_part("e1", 0, 0, vec![block(2, 600)], false));
    assert!(refusal(&replies).is_some());
    assert!(f.rec.hashes("r1").is_empty());
}

#[test]
fn a_replica_not_configured_on_the_node_is_refused() {
    let mut st = state(Duration::from_secs(30));
    let rec = Recorder::default();
    let s = st.open();
    let replies = st
        .apply(&rec, s, msg(1, hello("n1", &[("x", "other:9")])))
        .unwrap()
        .replies;
    assert_eq!(
        refusal(&replies).map(|f| f.replica.as_str()),
        Some("other:9")
    );
    st.apply(&rec, s, msg(2, snapshot("x", 1, 1, &[1])))
        .unwrap();
    assert!(rec.hashes("other:9").is_empty());
}

#[test]
fn an_engine_hashing_differently_from_the_router_is_refused() {
    let settings = "tiny=block_size=16,seed=1729"
        .parse::<ModelSettings>()
        .expect("settings");
    let engine = |block_size: u32, algo: &str, seed_set: bool| pb::EngineInfo {
        engine: "e1".into(),
        replica: "r1".into(),
        model: "tiny".into(),
        block_size,
        hash_algo: algo.into(),
        hash_seed_set: seed_set,
    };
    let mut st = state(Duration::from_secs(30));
    st.set_expected([(settings.model.clone(), settings.hashing.clone())].into());
    let rec = Recorder::default();
    for (bad, expect) in [
        (engine(32, "sha256_cbor", true), "block size 32"),
        (engine(16, "xxhash_cbor", true), "hash algo xxhash_cbor"),
        (engine(16, "sha256_cbor", false), "PYTHONHASHSEED unset"),
        (engine(16, "sha256_cbor", true), ""),
    ] {
        let s = st.open();
        let hello = pb::agent_message::Body::hello("n1", "test", vec![bad]);
        let replies = st.apply(&rec, s, msg(1, hello)).unwrap().replies;
        st.apply(&rec, s, msg(2, snapshot("e1", 1, 1, &[7])))
            .unwrap();
        if expect.is_empty() {
            assert!(refusal(&replies).is_none());
            assert_eq!(
                rec.hashes("r1"),
                [7].into(),
                "matching settings are accepted"
            );
        } else {
            assert!(
                refusal(&replies).is_some_and(|f| f.reason.contains(expect)),
                "{expect}"
            );
            assert!(rec.hashes("r1").is_empty(), "{expect}");
        }
        st.close(s, Instant::now());
    }
}

#[test]
fn engines_of_one_replica_past_the_copies_the_index_counts_are_refused() {
    let mut st = FeedState::new(
        configured(),
        HashMap::new(),
        FeedLimits {
            max_engines_per_hello: 64,
            ..limits(1000)
        },
        Duration::from_secs(30),
        FeedMetrics::default(),
    );
    let rec = Recorder::default();
    let s = st.open();
    let names: Vec<String> = (0..=MAX_COPIES_PER_REPLICA)
        .map(|i| format!("e{i}"))
        .collect();
    let mut engines: Vec<(&str, &str)> = names.iter().map(|e| (e.as_str(), "r1")).collect();
    engines.push(("other", "r2"));
    let replies = st
        .apply(&rec, s, msg(1, hello("n1", &engines)))
        .unwrap()
        .replies;
    let refused: Vec<&pb::Refused> = replies
        .iter()
        .filter_map(|m| match &m.body {
            Some(pb::router_message::Body::Refused(f)) => Some(f),
            _ => None,
        })
        .collect();
    let last = format!("e{MAX_COPIES_PER_REPLICA}");
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].engine, last);
    assert!(refused[0].reason.contains("engines already"), "{refused:?}");
    st.apply(&rec, s, msg(2, snapshot(&last, 1, 1, &[9])))
        .unwrap();
    st.apply(&rec, s, msg(3, snapshot("e0", 1, 1, &[1])))
        .unwrap();
    st.apply(&rec, s, msg(4, snapshot("other", 1, 1, &[2])))
        .unwrap();
    assert_eq!(
        rec.hashes("r1"),
        [1].into(),
        "the refused engine's blocks are not taken"
    );
    assert_eq!(rec.hashes("r2"), [2].into());
}

#[test]
fn data_parallel_engines_of_one_replica_survive_each_others_resets() {
    let mut f = Fixture::new();
    let mut st = state(Duration::from_secs(30));
    let s = st.open();
    f.stream = s;
    std::mem::swap(&mut f.st, &mut st);
    f.next_id = 0;
    f.ok(hello("n1", &[("e1", "r1"), ("e1#dp1", "r1")]));
    f.ok(snapshot("e1", 0, 0, &[1]));
    f.ok(snapshot("e1#dp1", 0, 0, &[2]));
    f.ok(delta("e1", 1, 1, true, &[3], &[]));
    assert_eq!(f.rec.hashes("r1"), [2, 3].into());
}

#[test]
fn a_delta_that_resets_tells_the_index_the_cache_was_lost_and_a_snapshot_does_not() {
    let mut f = Fixture::new();
    f.ok(snapshot("e1", 0, 0, &[1, 2]));
    assert!(
        f.rec.losses.lock().is_empty(),
        "a snapshot restates the cache"
    );
    f.ok(delta("e1", 1, 1, true, &[3], &[]));
    assert_eq!(*f.rec.losses.lock(), ["r1"]);
    assert_eq!(f.rec.hashes("r1"), [3].into());
    f.ok(delta("e1", 1, 2, false, &[4], &[3]));
    assert_eq!(
        f.rec.losses.lock().len(),
        1,
        "an ordinary delta loses nothing"
    );
}

#[tokio::test(start_paused = true)]
async fn a_node_gone_past_the_grace_period_is_dropped() {
    let mut f = Fixture::new();
    f.st.grace = Duration::from_secs(10);
    f.ok(snapshot("e1", 1, 1, &[1]));
    f.st.close(f.stream, Instant::now());
    tokio::time::advance(Duration::from_secs(5)).await;
    assert!(
        f.st.reap(&f.rec, Instant::now()).is_empty(),
        "still within the grace period"
    );
    assert_eq!(f.rec.hashes("r1"), [1].into());
    tokio::time::advance(Duration::from_secs(6)).await;
    assert_eq!(f.st.reap(&f.rec, Instant::now()), ["n1"]);
    assert!(f.rec.hashes("r1").is_empty());
}

#[test]
fn a_reconnecting_agent_keeps_its_blocks_until_its_new_snapshot_replaces_them() {
    let mut f = Fixture::new();
    f.ok(snapshot("e1", 0, 3, &[1, 2]));
    f.st.close(f.stream, Instant::now());
    let s = f.st.open();
    f.stream = s;
    f.ok(hello("n1", &[("e1", "r1")]));
    assert_eq!(f.rec.hashes("r1"), [1, 2].into(), "no dip while it resyncs");
    // A delta before the new stream's snapshot is refused, even the next one in sequence.
    assert_eq!(
        f.violation(delta("e1", 0, 4, false, &[3], &[])),
        Violation::DeltaBeforeSnapshot
    );
    f.st.close(f.stream, Instant::now());
    let s = f.st.open();
    f.stream = s;
    f.ok(hello("n1", &[("e1", "r1")]));
    // The agent restarted: epochs start again, and a snapshot may go back.
    f.ok(snapshot("e1", 0, 0, &[9]));
    assert_eq!(f.rec.hashes("r1"), [9].into());
    assert_eq!(f.st.metrics.takeovers.get(), 0, "the old streams had ended");
}

#[test]
fn a_restated_snapshot_tells_the_index_only_what_changed_and_no_eviction() {
    let mut f = Fixture::new();
    f.ok(snapshot("e1", 0, 3, &[1, 2, 3]));
    assert_eq!(f.rec.take_touched(), (3, 0));
    f.st.close(f.stream, Instant::now());
    f.stream = f.st.open();
    f.ok(hello("n1", &[("e1", "r1")]));
    f.ok(snapshot("e1", 0, 3, &[1, 2, 3]));
    assert_eq!(
        f.rec.take_touched(),
        (0, 0),
        "the same blocks again: the index is not touched"
    );
    f.ok(snapshot_part(
        "e1",
        0,
        9,
        vec![block(2, 1), block(3, 4)],
        true,
    ));
    f.ok(snapshot_part("e1", 0, 9, vec![block(4, 1)], false));
    assert_eq!(
        f.rec.take_touched(),
        (2, 0),
        "1 withdrawn and 4 stored; more copies of 3 are the feed's own count"
    );
    assert_eq!(f.rec.hashes("r1"), [2, 3, 4].into());
    // An engine that the next stream's Hello leaves out takes its blocks, still no eviction.
    f.st.close(f.stream, Instant::now());
    f.stream = f.st.open();
    f.ok(hello("n1", &[("e2", "r2")]));
    assert_eq!(f.rec.take_touched(), (3, 0));
    assert!(f.rec.hashes("r1").is_empty());
}

#[test]
fn a_newer_stream_for_a_node_takes_it_over_and_no_block_of_the_old_one_remains() {
    let mut st = state(Duration::from_secs(30));
    let rec = Recorder::default();
    let real = st.open();
    st.apply(
        &rec,
        real,
        msg(1, hello("n1", &[("e1", "r1"), ("e2", "r2")])),
    )
    .unwrap();
    st.apply(&rec, real, msg(2, snapshot("e1", 0, 0, &[1, 2])))
        .unwrap();
    st.apply(&rec, real, msg(3, snapshot("e2", 0, 0, &[3])))
        .unwrap();

    // An intruder claims the node while the real agent's stream is alive.
    let intruder = st.open();
    let applied = st
        .apply(&rec, intruder, msg(1, hello("n1", &[("e1", "r1")])))
        .unwrap();
    assert_eq!(applied.superseded, Some(real), "the old stream is ended");
    assert!(rec.hashes("r1").is_empty() && rec.hashes("r2").is_empty());
    st.apply(&rec, intruder, msg(2, snapshot("e1", 0, 0, &[66])))
        .unwrap();
    assert_eq!(rec.hashes("r1"), [66].into());
    // The old stream's later messages are refused.
    assert!(matches!(
        st.apply(&rec, real, msg(4, delta("e1", 0, 1, false, &[4], &[]))),
        Err(StreamEnd::Superseded(node)) if node == "n1"
    ));
    st.close(real, Instant::now());

    // The real agent reconnects and takes the node back: none of the intruder's blocks remain.
    let again = st.open();
    let applied = st
        .apply(
            &rec,
            again,
            msg(1, hello("n1", &[("e1", "r1"), ("e2", "r2")])),
        )
        .unwrap();
    assert_eq!(applied.superseded, Some(intruder));
    assert!(rec.hashes("r1").is_empty());
    st.apply(&rec, again, msg(2, snapshot("e1", 0, 0, &[1, 2])))
        .unwrap();
    st.apply(&rec, again, msg(3, snapshot("e2", 0, 0, &[3])))
        .unwrap();
    st.apply(&rec, again, msg(4, delta("e1", 0, 1, false, &[4], &[])))
        .unwrap();
    assert_eq!(rec.hashes("r1"), [1, 2, 4].into());
    assert_eq!(rec.hashes("r2"), [3].into());
    // The intruder's stream ending later changes nothing.
    st.close(intruder, Instant::now());
    assert!(
        st.reap(&rec, Instant::now() + Duration::from_secs(60))
            .is_empty()
    );
    assert_eq!(rec.hashes("r1"), [1, 2, 4].into());
    assert_eq!(st.metrics.takeovers.get(), 2);
}

#[test]
fn a_reloaded_node_map_drops_engines_whose_replica_left_and_names_the_streams_to_resync() {
    let mut st = state(Duration::from_secs(30));
    let rec = Recorder::default();
    let s = st.open();
    st.apply(&rec, s, msg(1, hello("n1", &[("a", "r1"), ("b", "r3")])))
        .unwrap();
    st.apply(&rec, s, msg(2, snapshot("a", 0, 0, &[1])))
        .unwrap();
    st.apply(&rec, s, msg(3, snapshot("b", 0, 0, &[2])))
        .unwrap();
    assert_eq!(rec.hashes("r1"), [1].into());
    assert!(rec.hashes("r3").is_empty(), "r3 is n2's");

    assert_eq!(
        st.set_nodes(&rec, configured()),
        None,
        "an unchanged map is no reload"
    );
    let mut moved = configured();
    moved.insert("n1".into(), ["r3".to_owned()].into());
    assert_eq!(st.set_nodes(&rec, moved), Some(vec![s]));
    assert!(rec.hashes("r1").is_empty(), "r1 left n1: its blocks go");
    // Its later messages for the dropped engine are ignored.
    st.apply(&rec, s, msg(4, delta("a", 0, 1, false, &[5], &[])))
        .unwrap();
    assert!(rec.hashes("r1").is_empty());
}

// ---------------------------------------------------------------------------------------------
// Random operation sequences against a reference model.

const NODES: [&str; 2] = ["n1", "n2"];
/// (engine, replica); the last is configured on no node.
const ENGINES: [(&str, &str); 4] = [("e1", "r1"), ("e2", "r2"), ("e3", "r3"), ("x", "rx")];
const MAX_BLOCKS: u64 = 40;

#[derive(Debug, Clone)]
enum Op {
    /// A new stream, in a free or dead stream slot.
    Open(usize),
    Close(usize),
    /// An honest Hello lists the node's configured engines; another lists `engines`.
    Hello {
        stream: usize,
        node: usize,
        honest: bool,
        engines: Vec<usize>,
    },
    /// A snapshot at the engine's current position plus `ahead` seqs, maybe in parts.
    Snapshot {
        stream: usize,
        engine: usize,
        ahead: u64,
        blocks: Vec<(u64, u32)>,
        parts: usize,
    },
    /// The next delta (or, with `skew`, one off by that much in seq, or a new epoch). An
    /// honest agent sends a snapshot instead while the engine has none.
    Delta {
        honest: bool,
        stream: usize,
        engine: usize,
        skew: i8,
        reset: bool,
        stored: Vec<(u64, u32)>,
        removed: Vec<(u64, u32)>,
    },
    Heartbeat(usize),
    /// Time passes by this many seconds, then the reaper runs.
    Advance(u64),
}

fn count() -> impl Strategy<Value = u32> {
    prop_oneof![24 => 1u32..3, 1 => Just(0u32), 1 => Just(u32::MAX), 2 => 20u32..45]
}

fn blocks() -> impl Strategy<Value = Vec<(u64, u32)>> {
    prop::collection::vec((0u64..8, count()), 0..5)
}

fn op() -> impl Strategy<Value = Op> {
    let stream = 0usize..3;
    // See `pick_engine`: mostly one of the stream's node's own engines.
    let engine = 0usize..10;
    prop_oneof![
        2 => stream.clone().prop_map(Op::Open),
        1 => stream.clone().prop_map(Op::Close),
        2 => (stream.clone(), 0usize..2, prop::bool::weighted(0.8), prop::collection::vec(0usize..ENGINES.len(), 0..4))
            .prop_map(|(stream, node, honest, engines)| Op::Hello { stream, node, honest, engines }),
        3 => (stream.clone(), engine.clone(), prop_oneof![4 => Just(0u64), 1 => 0u64..3], blocks(), 1usize..4)
            .prop_map(|(stream, engine, ahead, blocks, parts)| Op::Snapshot { stream, engine, ahead, blocks, parts }),
        8 => (prop::bool::weighted(0.9), stream.clone(), engine, prop_oneof![8 => Just(0i8), 1 => -2i8..3], prop::bool::weighted(0.2), blocks(), blocks())
            .prop_map(|(honest, stream, engine, skew, reset, stored, removed)| Op::Delta { honest, stream, engine, skew, reset, stored, removed }),
        1 => stream.prop_map(Op::Heartbeat),
        1 => (0u64..40).prop_map(Op::Advance),
    ]
}

/// One engine as the model sees it.
#[derive(Debug, Clone, Default)]
struct MEngine {
    replica: &'static str,
    synced: bool,
    epoch: u64,
    seq: u64,
    blocks: HashMap<u64, u64>,
}

#[derive(Debug, Default)]
struct MNode {
    owner: Option<usize>,
    gone_since: Option<u64>,
    engines: HashMap<&'static str, MEngine>,
    refused: HashSet<&'static str>,
}

/// The reference model: the protocol's rules written as plainly as possible, with the expected
/// index recomputed from scratch.
#[derive(Debug, Default)]
struct Model {
    /// Per model stream: the node its Hello claimed, and whether it still may speak.
    streams: Vec<(Option<usize>, bool)>,
    nodes: HashMap<usize, MNode>,
    now: u64,
}

/// The engine (index into [`ENGINES`]) an operation's `choice` names for a stream of `node`:
/// below 8 one of the node's own, 8 the unconfigured one, 9 one of the other node's.
fn pick_engine(node: Option<usize>, choice: usize) -> usize {
    let own: &[usize] = match node {
        Some(0) => &[0, 1],
        Some(_) => &[2],
        None => return choice % ENGINES.len(),
    };
    match choice {
        8 => 3,
        9 => {
            if node == Some(0) {
                2
            } else {
                0
            }
        }
        c => own[c % own.len()],
    }
}

fn configured_on(node: usize, replica: &str) -> bool {
    configured()
        .get(NODES[node])
        .is_some_and(|rs| rs.contains(replica))
}

impl Model {
    /// Per replica, how many engines hold each block: what the index must count.
    fn index(&self) -> HashMap<String, HashMap<u64, u64>> {
        let mut out: HashMap<String, HashMap<u64, u64>> = HashMap::new();
        for node in self.nodes.values() {
            for e in node.engines.values() {
                for h in e.blocks.keys() {
                    *out.entry(e.replica.to_owned())
                        .or_default()
                        .entry(*h)
                        .or_insert(0) += 1;
                }
            }
        }
        out.retain(|_, r| !r.is_empty());
        out
    }

    fn end(&mut self, stream: usize) {
        let (node, live) = &mut self.streams[stream];
        if !*live {
            return;
        }
        *live = false;
        if let Some(n) = node.and_then(|n| self.nodes.get_mut(&n))
            && n.owner == Some(stream)
        {
            n.owner = None;
            n.gone_since = Some(self.now);
        }
    }

    /// Whether the engine an operation names for stream `s` has had its snapshot.
    fn synced(&self, s: usize, choice: usize) -> bool {
        let node = self.streams[s].0;
        let (name, _) = ENGINES[pick_engine(node, choice)];
        node.and_then(|n| self.nodes.get(&n))
            .and_then(|n| n.engines.get(name))
            .is_some_and(|e| e.synced)
    }

    fn refuse(node: &mut MNode, engine: &'static str) {
        node.engines.remove(engine);
        node.refused.insert(engine);
    }
}

/// A model stream's wire stream, with its message ids.
struct Wire {
    id: StreamId,
    next: u64,
}

fn wire_blocks(blocks: &[(u64, u32)]) -> Vec<pb::Block> {
    blocks.iter().map(|&(h, n)| block(h, n)).collect()
}

fn sum(blocks: &[(u64, u32)]) -> u64 {
    blocks.iter().map(|(_, n)| u64::from(*n)).sum()
}

/// Sends one message on model stream `s`; a stream the state ends is closed on both sides.
fn send_one(
    sink: &dyn KvEventSink,
    wires: &mut [Wire],
    model: &mut Model,
    st: &mut FeedState,
    s: usize,
    body: pb::agent_message::Body,
    start: Instant,
) -> Result<(), StreamEnd> {
    let now = start + Duration::from_secs(model.now);
    let w = &mut wires[s];
    w.next += 1;
    let result = st.apply(sink, w.id, msg(w.next, body)).map(|applied| {
        if let Some(old) = applied.superseded {
            st.close(old, now);
        }
    });
    if result.is_err() {
        model.end(s);
        st.close(w.id, now);
    }
    result
}

/// Runs `ops` on the state (through the recorder and a real index) and on the model, checking
/// after each that the recorder equals the model and the index holds exactly its blocks.
/// Returns the state's metrics, so a test can check what the sequences reached.
fn run(ops: Vec<Op>) -> FeedMetrics {
    let mut st = FeedState::new(
        configured(),
        HashMap::new(),
        FeedLimits {
            max_blocks_per_engine: MAX_BLOCKS,
            ..FeedLimits::default()
        },
        Duration::from_secs(30),
        FeedMetrics::default(),
    );
    let rec = Recorder::default();
    let index = KvIndex::new(IndexConfig::default());
    let sink = Tee(&rec, &index);
    let start = Instant::now();
    let mut model = Model::default();
    let mut wires: Vec<Wire> = Vec::new();

    for op in ops {
        // An honest agent opens a stream, says Hello and snapshots before its deltas.
        let op = match op {
            Op::Delta {
                honest: true,
                stream,
                ..
            } if stream >= wires.len() || !model.streams[stream].1 => Op::Open(stream),
            Op::Delta {
                honest: true,
                stream,
                engine,
                ..
            } if model.streams[stream].0.is_none() => Op::Hello {
                stream,
                node: engine % 2,
                honest: true,
                engines: Vec::new(),
            },
            Op::Delta {
                honest: true,
                stream,
                engine,
                stored,
                ..
            } if !model.synced(stream, engine) => Op::Snapshot {
                stream,
                engine,
                ahead: 0,
                blocks: stored,
                parts: 1,
            },
            op => op,
        };
        let n_wires = wires.len();
        let mut send = |model: &mut Model, st: &mut FeedState, s: usize, body| {
            send_one(&sink, &mut wires, model, st, s, body, start)
        };
        match op {
            Op::Open(slot) => {
                if wires.len() < 3 {
                    wires.push(Wire {
                        id: st.open(),
                        next: 0,
                    });
                    model.streams.push((None, true));
                } else if !model.streams[slot].1 {
                    wires[slot] = Wire {
                        id: st.open(),
                        next: 0,
                    };
                    model.streams[slot] = (None, true);
                }
            }
            Op::Close(s) if s < n_wires => {
                model.end(s);
                st.close(wires[s].id, start + Duration::from_secs(model.now));
            }
            Op::Hello {
                stream: s,
                node,
                honest,
                engines,
            } if s < n_wires => {
                let engines = if honest {
                    if node == 0 { vec![0, 1] } else { vec![2] }
                } else {
                    engines
                };
                let body = hello(
                    NODES[node],
                    &engines.iter().map(|&e| ENGINES[e]).collect::<Vec<_>>(),
                );
                let result = send(&mut model, &mut st, s, body);
                let (claimed, live) = model.streams[s];
                let duplicate = engines.iter().collect::<HashSet<_>>().len() != engines.len();
                let expect_ok = live && claimed.is_none() && !duplicate;
                assert_eq!(result.is_ok(), expect_ok, "Hello: {result:?}");
                if expect_ok {
                    model.streams[s].0 = Some(node);
                    let n = model.nodes.entry(node).or_default();
                    if let Some(old) = n.owner.filter(|o| *o != s) {
                        n.engines.clear();
                        model.streams[old].1 = false;
                    }
                    let n = model.nodes.entry(node).or_default();
                    n.owner = Some(s);
                    n.gone_since = None;
                    n.refused.clear();
                    let listed: HashMap<&str, &str> = engines
                        .iter()
                        .map(|&e| ENGINES[e])
                        .filter(|(_, r)| configured_on(node, r))
                        .collect();
                    n.engines.retain(|e, v| listed.get(e) == Some(&v.replica));
                    for v in n.engines.values_mut() {
                        v.synced = false;
                    }
                    for &e in &engines {
                        let (engine, replica) = ENGINES[e];
                        if configured_on(node, replica) {
                            n.engines.entry(engine).or_insert_with(|| MEngine {
                                replica,
                                ..MEngine::default()
                            });
                        } else {
                            n.refused.insert(engine);
                        }
                    }
                }
            }
            Op::Snapshot {
                stream: s,
                engine,
                ahead,
                blocks,
                parts,
            } if s < n_wires => {
                let (name, _) = ENGINES[pick_engine(model.streams[s].0, engine)];
                let (claimed, live) = model.streams[s];
                let view = claimed
                    .and_then(|n| model.nodes.get(&n))
                    .and_then(|n| n.engines.get(name))
                    .cloned();
                let (epoch, seq) = view.as_ref().map_or((0, 0), |v| (v.epoch, v.seq + ahead));
                let chunk = blocks.len().div_ceil(parts).max(1);
                let pieces: Vec<&[(u64, u32)]> = if blocks.is_empty() {
                    vec![&[]]
                } else {
                    blocks.chunks(chunk).collect()
                };
                let last = pieces.len() - 1;
                for (i, piece) in pieces.iter().enumerate() {
                    let body = snapshot_part(name, epoch, seq, wire_blocks(piece), i < last);
                    let result = send(&mut model, &mut st, s, body);
                    let refused_here = claimed
                        .and_then(|n| model.nodes.get(&n))
                        .is_some_and(|n| n.refused.contains(name));
                    let expect_ok = live && claimed.is_some() && (view.is_some() || refused_here);
                    assert_eq!(result.is_ok(), expect_ok, "snapshot part {i}: {result:?}");
                    if !expect_ok || refused_here {
                        break;
                    }
                    let total: u64 = sum(&blocks[..(chunk * (i + 1)).min(blocks.len())]);
                    let n = model
                        .nodes
                        .get_mut(&claimed.unwrap_or_default())
                        .expect("claimed node");
                    if total > MAX_BLOCKS {
                        Model::refuse(n, name);
                        break;
                    }
                    if i == last {
                        let v = n.engines.get_mut(name).expect("listed engine");
                        v.epoch = epoch;
                        v.seq = seq;
                        v.synced = true;
                        v.blocks.clear();
                        for &(h, c) in blocks.iter().filter(|(_, c)| *c > 0) {
                            *v.blocks.entry(h).or_insert(0) += u64::from(c);
                        }
                    }
                }
            }
            Op::Delta {
                stream: s,
                engine,
                skew,
                reset,
                stored,
                removed,
                ..
            } if s < n_wires => {
                let (name, _) = ENGINES[pick_engine(model.streams[s].0, engine)];
                let (claimed, live) = model.streams[s];
                let node = claimed.and_then(|n| model.nodes.get(&n));
                let view = node.and_then(|n| n.engines.get(name)).cloned();
                let refused_here = node.is_some_and(|n| n.refused.contains(name));
                let (mut epoch, mut seq) = view
                    .as_ref()
                    .map_or((0, 1), |v| (v.epoch, v.seq.saturating_add(1)));
                if (reset && skew == 1) || skew == 2 {
                    // A new epoch: valid only with a reset.
                    epoch += 1;
                    seq = 1;
                } else {
                    seq = seq.saturating_add_signed(i64::from(skew));
                }
                let body = pb::agent_message::Body::Delta(pb::Delta {
                    engine: name.into(),
                    epoch,
                    seq,
                    reset,
                    stored: wire_blocks(&stored),
                    removed: wire_blocks(&removed),
                    oldest_event_ts: 0.0,
                });
                let result = send(&mut model, &mut st, s, body);
                let in_order = view.as_ref().is_some_and(|v| {
                    v.synced
                        && ((epoch == v.epoch && v.seq.checked_add(1) == Some(seq))
                            || (epoch > v.epoch && reset && seq == 1))
                });
                let expect_ok = live && claimed.is_some() && (refused_here || in_order);
                assert_eq!(
                    result.is_ok(),
                    expect_ok,
                    "delta {epoch}.{seq} after {view:?}: {result:?}"
                );
                if expect_ok && !refused_here {
                    let n = model
                        .nodes
                        .get_mut(&claimed.unwrap_or_default())
                        .expect("claimed node");
                    let v = n.engines.get_mut(name).expect("listed engine");
                    let base = if reset { 0 } else { v.blocks.values().sum() };
                    if base + sum(&stored) > MAX_BLOCKS {
                        Model::refuse(n, name);
                    } else {
                        v.epoch = epoch;
                        v.seq = seq;
                        if reset {
                            v.blocks.clear();
                        }
                        for &(h, c) in stored.iter().filter(|(_, c)| *c > 0) {
                            *v.blocks.entry(h).or_insert(0) += u64::from(c);
                        }
                        for &(h, c) in &removed {
                            if let Some(held) = v.blocks.get_mut(&h) {
                                *held -= u64::from(c).min(*held);
                                if *held == 0 {
                                    v.blocks.remove(&h);
                                }
                            }
                        }
                    }
                }
            }
            Op::Heartbeat(s) if s < n_wires => {
                let body = pb::agent_message::Body::Heartbeat(pb::Heartbeat { unix_ms: 0 });
                let result = send(&mut model, &mut st, s, body);
                assert_eq!(result.is_ok(), model.streams[s].1 || result.is_ok());
                if model.streams[s].1 {
                    assert!(result.is_ok(), "{result:?}");
                }
            }
            Op::Advance(secs) => {
                model.now += secs;
                let now = model.now;
                let expired: Vec<usize> = model
                    .nodes
                    .iter()
                    .filter(|(_, n)| {
                        n.owner.is_none() && n.gone_since.is_some_and(|t| now - t >= 30)
                    })
                    .map(|(k, _)| *k)
                    .collect();
                for k in expired {
                    model.nodes.remove(&k);
                }
                st.reap(&sink, start + Duration::from_secs(now));
            }
            _ => {}
        }

        // The recorder equals the model, and the state's own view of itself.
        let want = model.index();
        let got: HashMap<String, HashMap<u64, u64>> = rec
            .copies()
            .into_iter()
            .map(|(r, copies)| (r, copies.into_iter().map(|((h, _), n)| (h.0, n)).collect()))
            .collect();
        assert_eq!(got, want, "index against the model");
        let state_view: HashMap<String, HashMap<u64, u64>> = st
            .replica_holders()
            .into_iter()
            .map(|(r, copies)| (r, copies.into_iter().map(|((h, _), n)| (h.0, n)).collect()))
            .collect();
        assert_eq!(state_view, want, "state against the model");
        // The real index holds exactly the model's blocks.
        for (engine, replica) in ENGINES {
            let held: HashSet<u64> = index
                .replica_blocks(replica)
                .into_iter()
                .map(|h| h.0)
                .collect();
            let want: HashSet<u64> = want
                .get(replica)
                .map(|r| r.keys().copied().collect())
                .unwrap_or_default();
            assert_eq!(held, want, "real index, {engine} on {replica}");
        }
    }
    st.metrics
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_state_and_the_index_equal_the_model_after_every_operation(
        ops in prop::collection::vec(op(), 1..60)
    ) {
        run(ops);
    }
}

/// The generated sequences reach what the property claims to check: applied snapshots and
/// deltas, gaps, takeovers, refusals over the ceiling and violations.
#[test]
fn the_operation_sequences_reach_every_rule() {
    use proptest::strategy::ValueTree as _;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = prop::collection::vec(op(), 1..60);
    let (mut snapshots, mut deltas, mut gaps, mut takeovers, mut over) = (0, 0, 0, 0, 0);
    for _ in 0..300 {
        let ops = strategy
            .new_tree(&mut runner)
            .expect("a sequence")
            .current();
        let m = run(ops);
        snapshots += m.snapshots.get();
        deltas += m.deltas.get();
        gaps += m.out_of_order.get();
        takeovers += m.takeovers.get();
        over += m
            .refused
            .get_or_create(&super::super::ReasonLabel {
                reason: "over_block_ceiling",
            })
            .get();
    }
    for (what, n) in [
        ("snapshots", snapshots),
        ("deltas", deltas),
        ("gaps", gaps),
        ("takeovers", takeovers),
        ("refusals over the ceiling", over),
    ] {
        assert!(n >= 10, "only {n} {what} in 300 sequences");
    }
}
