use super::*;
use crate::models::ModelSettings;

type Copies = HashMap<(ExternalHash, Medium), u32>;

/// An index stand-in: copies per (replica, hash, medium), as the sink contract counts them.
#[derive(Default)]
struct Recorder {
    held: Mutex<HashMap<String, Copies>>,
}

impl KvEventSink for Recorder {
    fn stored(&self, replica: &str, hashes: &[ExternalHash], medium: Medium) {
        let mut h = self.held.lock();
        let r = h.entry(replica.to_owned()).or_default();
        for x in hashes {
            *r.entry((*x, medium)).or_insert(0) += 1;
        }
    }
    fn removed(&self, replica: &str, hashes: &[ExternalHash], medium: Medium) {
        let mut h = self.held.lock();
        let r = h.entry(replica.to_owned()).or_default();
        for x in hashes {
            let n = r
                .get_mut(&(*x, medium))
                .expect("removed only what was stored");
            *n -= 1;
            if *n == 0 {
                r.remove(&(*x, medium));
            }
        }
    }
    fn cleared(&self, replica: &str) {
        self.held.lock().remove(replica);
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
}

fn service(grace: Duration) -> (FeedService, Arc<Recorder>) {
    let rec = Arc::new(Recorder::default());
    let nodes = [(
        "n1".to_owned(),
        ["r1:8000".to_owned()].into_iter().collect::<HashSet<_>>(),
    )]
    .into_iter()
    .collect();
    let svc = FeedService::new(
        rec.clone(),
        FeedConfig {
            token: None,
            nodes,
            grace,
        },
    );
    (svc, rec)
}

fn msg(id: u64, body: pb::agent_message::Body) -> pb::AgentMessage {
    pb::AgentMessage {
        id,
        body: Some(body),
    }
}

fn hello(engines: &[(&str, &str)]) -> pb::agent_message::Body {
    pb::agent_message::Body::Hello(pb::Hello {
        node: "n1".into(),
        agent_version: "test".into(),
        engines: engines
            .iter()
            .map(|(e, r)| pb::EngineInfo {
                engine: (*e).into(),
                replica: (*r).into(),
                ..pb::EngineInfo::default()
            })
            .collect(),
    })
}

fn block(h: u64) -> pb::Block {
    pb::Block {
        hash: h,
        group: 0,
        medium: pb::Medium::Gpu as i32,
        count: 1,
    }
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
        stored: stored.iter().map(|h| block(*h)).collect(),
        removed: removed.iter().map(|h| block(*h)).collect(),
        oldest_event_ts: 0.0,
    })
}

fn ok(svc: &FeedService, node: &mut Option<String>, m: pb::AgentMessage) -> Vec<pb::RouterMessage> {
    svc.apply(node, m)
        .unwrap_or_else(|OutOfOrder(w)| panic!("{w}"))
}

#[test]
fn snapshots_and_deltas_reach_the_index_and_are_acknowledged() {
    let (svc, rec) = service(Duration::from_secs(30));
    let mut node = None;
    ok(&svc, &mut node, msg(1, hello(&[("r1:8000", "r1:8000")])));
    let snap = pb::agent_message::Body::Snapshot(pb::Snapshot {
        engine: "r1:8000".into(),
        epoch: 0,
        seq: 2,
        blocks: vec![
            block(1),
            block(2),
            pb::Block {
                group: 1,
                ..block(9)
            },
        ],
        hash_status: 0,
    });
    let replies = ok(&svc, &mut node, msg(2, snap));
    assert!(matches!(
        replies.last().and_then(|r| r.body.clone()),
        Some(pb::router_message::Body::Ack(pb::Ack { id: 2 }))
    ));
    assert_eq!(
        rec.hashes("r1:8000"),
        [1, 2].into_iter().collect(),
        "group 1 stays out"
    );
    // Delta 2 is in the snapshot already; 3 applies.
    ok(
        &svc,
        &mut node,
        msg(3, delta("r1:8000", 0, 2, false, &[7], &[])),
    );
    ok(
        &svc,
        &mut node,
        msg(4, delta("r1:8000", 0, 3, false, &[3], &[1])),
    );
    assert_eq!(rec.hashes("r1:8000"), [2, 3].into_iter().collect());
    // A new epoch starts with a reset.
    ok(
        &svc,
        &mut node,
        msg(5, delta("r1:8000", 1, 1, true, &[4], &[])),
    );
    assert_eq!(rec.hashes("r1:8000"), [4].into_iter().collect());
    // A skipped delta ends the stream so the agent resends snapshots.
    assert!(
        svc.apply(&mut node, msg(6, delta("r1:8000", 1, 3, false, &[5], &[])))
            .is_err()
    );
    assert_eq!(svc.metrics.out_of_order.get(), 1);
}

#[test]
fn a_replica_not_configured_on_the_node_is_refused() {
    let (svc, rec) = service(Duration::from_secs(30));
    let mut node = None;
    let replies = ok(&svc, &mut node, msg(1, hello(&[("other:9", "other:9")])));
    assert!(replies.iter().any(|r| matches!(
        &r.body,
        Some(pb::router_message::Body::Refused(f)) if f.replica == "other:9"
    )));
    ok(
        &svc,
        &mut node,
        msg(2, delta("other:9", 1, 1, true, &[1], &[])),
    );
    assert!(rec.hashes("other:9").is_empty());
    assert_eq!(svc.metrics.refused.get(), 1);
}

#[test]
fn data_parallel_engines_of_one_replica_survive_each_others_resets() {
    let (svc, rec) = service(Duration::from_secs(30));
    let mut node = None;
    ok(
        &svc,
        &mut node,
        msg(
            1,
            hello(&[("r1:8000", "r1:8000"), ("r1:8000#dp1", "r1:8000")]),
        ),
    );
    ok(
        &svc,
        &mut node,
        msg(2, delta("r1:8000", 1, 1, true, &[1], &[])),
    );
    ok(
        &svc,
        &mut node,
        msg(3, delta("r1:8000#dp1", 1, 1, true, &[2], &[])),
    );
    ok(
        &svc,
        &mut node,
        msg(4, delta("r1:8000", 2, 1, true, &[3], &[])),
    );
    assert_eq!(rec.hashes("r1:8000"), [2, 3].into_iter().collect());
}

#[tokio::test(start_paused = true)]
async fn a_node_gone_past_the_grace_period_is_dropped() {
    let (svc, rec) = service(Duration::from_secs(10));
    let mut node = None;
    ok(&svc, &mut node, msg(1, hello(&[("r1:8000", "r1:8000")])));
    ok(
        &svc,
        &mut node,
        msg(2, delta("r1:8000", 1, 1, true, &[1], &[])),
    );
    FeedService::stream_ended(&mut svc.state.lock(), "n1");
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(svc.reap(Instant::now()), 0, "still within the grace period");
    assert_eq!(rec.hashes("r1:8000").len(), 1);
    tokio::time::advance(Duration::from_secs(6)).await;
    assert_eq!(svc.reap(Instant::now()), 1);
    assert!(rec.hashes("r1:8000").is_empty());
}

#[test]
fn an_engine_hashing_differently_from_the_router_is_refused() {
    let (svc, rec) = service(Duration::from_secs(30));
    let svc = svc.expect_settings(&["tiny=block_size=16,seed=1729"
        .parse::<ModelSettings>()
        .expect("settings")]);
    let engine = |block_size: u32, algo: &str, seed_set: bool| pb::EngineInfo {
        engine: "r1:8000".into(),
        replica: "r1:8000".into(),
        model: "tiny".into(),
        block_size,
        hash_algo: algo.into(),
        hash_seed_set: seed_set,
    };
    let hello_with = |e: pb::EngineInfo| {
        pb::agent_message::Body::Hello(pb::Hello {
            node: "n1".into(),
            agent_version: "test".into(),
            engines: vec![e],
        })
    };
    for (i, (bad, expect)) in [
        (engine(32, "sha256_cbor", true), "block size 32"),
        (engine(16, "xxhash_cbor", true), "hash algo xxhash_cbor"),
        (engine(16, "sha256_cbor", false), "PYTHONHASHSEED unset"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut node = None;
        let replies = ok(&svc, &mut node, msg(i as u64 + 1, hello_with(bad)));
        assert!(
            replies.iter().any(|r| matches!(
                &r.body,
                Some(pb::router_message::Body::Refused(f)) if f.reason.contains(expect)
            )),
            "{expect}: {replies:?}"
        );
        ok(
            &svc,
            &mut node,
            msg(10 + i as u64, delta("r1:8000", 1, 1, true, &[7], &[])),
        );
        assert!(rec.hashes("r1:8000").is_empty(), "{expect}");
    }
    assert_eq!(svc.metrics.refused.get(), 3);
    // Matching settings are accepted.
    let mut node = None;
    ok(
        &svc,
        &mut node,
        msg(20, hello_with(engine(16, "sha256_cbor", true))),
    );
    ok(
        &svc,
        &mut node,
        msg(21, delta("r1:8000", 1, 1, true, &[7], &[])),
    );
    assert_eq!(rec.hashes("r1:8000"), HashSet::from([7]));
}

#[test]
fn a_reloaded_node_map_drops_engines_whose_replica_left_and_admits_new_ones() {
    let (svc, rec) = service(Duration::from_secs(30));
    let mut node = None;
    let replies = ok(
        &svc,
        &mut node,
        msg(1, hello(&[("a", "r1:8000"), ("b", "r2:8000")])),
    );
    assert!(
        replies
            .iter()
            .any(|r| matches!(r.body, Some(pb::router_message::Body::Refused(_)))),
        "r2 is not n1's"
    );
    for (id, engine, h) in [(2, "a", 1), (3, "b", 2)] {
        let snap = pb::agent_message::Body::Snapshot(pb::Snapshot {
            engine: engine.into(),
            epoch: 0,
            seq: 0,
            blocks: vec![block(h)],
            hash_status: 0,
        });
        ok(&svc, &mut node, msg(id, snap));
    }
    assert_eq!(rec.hashes("r1:8000"), [1].into());
    assert!(rec.hashes("r2:8000").is_empty());

    let same: NodeMap = [("n1".to_owned(), ["r1:8000".to_owned()].into())].into();
    assert!(!svc.set_nodes(same), "an unchanged map is no reload");
    let moved: NodeMap = [("n1".to_owned(), ["r2:8000".to_owned()].into())].into();
    assert!(svc.set_nodes(moved));
    assert!(
        rec.hashes("r1:8000").is_empty(),
        "r1 left n1: its blocks go"
    );
    assert_eq!(svc.metrics.node_map_reloads.get(), 1);
    // Deltas for the dropped engine are ignored.
    ok(&svc, &mut node, msg(4, delta("a", 0, 1, false, &[5], &[])));
    assert!(rec.hashes("r1:8000").is_empty());

    // The agent reconnects (its stream was ended) and is judged by the new map.
    let mut node = None;
    ok(
        &svc,
        &mut node,
        msg(1, hello(&[("a", "r1:8000"), ("b", "r2:8000")])),
    );
    let snap = pb::agent_message::Body::Snapshot(pb::Snapshot {
        engine: "b".into(),
        epoch: 0,
        seq: 0,
        blocks: vec![block(2)],
        hash_status: 0,
    });
    ok(&svc, &mut node, msg(2, snap));
    assert_eq!(rec.hashes("r2:8000"), [2].into());
    assert!(rec.hashes("r1:8000").is_empty());
}
