//! Sessions against a fake source and a fake router (channels, no network), on a paused clock,
//! so backoff and heartbeat times are exact.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::*;
use crate::engine::{EngineId, ReplicaId};
use crate::mirror::{GroupIdx, Snapshot};
use crate::wire::ExternalHash;

const ROUTER: &str = "router.test:9003";

fn key(hash: u64) -> BlockKey {
    BlockKey {
        hash: ExternalHash(hash),
        group: GroupIdx(0),
        tier: Tier::Gpu,
    }
}

fn replica_of(engine: &str) -> String {
    format!("{engine}.replica:8000")
}

thread_local! {
    /// One id per engine name, as one running engine has: the uplink tells an engine's
    /// instances apart by the id's pointer.
    static IDS: RefCell<HashMap<String, EngineId>> = RefCell::new(HashMap::new());
}

/// The id of the engine named `engine`, the same instance each time.
fn id_of(engine: &str) -> EngineId {
    IDS.with(|ids| {
        ids.borrow_mut()
            .entry(engine.to_owned())
            .or_insert_with(|| EngineId(Arc::from(engine)))
            .clone()
    })
}

fn snapshot(engine: &str, epoch: u64, seq: u64, blocks: &[u64]) -> EngineSnapshot {
    EngineSnapshot {
        engine: id_of(engine),
        replica: ReplicaId(Arc::from(replica_of(engine).as_str())),
        hash: HashStatus::Verified,
        snapshot: Snapshot {
            epoch,
            seq,
            blocks: blocks.iter().map(|h| (key(*h), 1)).collect(),
        },
    }
}

/// A delta storing block `seq` (so each delta is told apart by its blocks too).
fn update(engine: &str, epoch: u64, seq: u64) -> Update {
    Update {
        engine: id_of(engine),
        replica: ReplicaId(Arc::from(replica_of(engine).as_str())),
        delta: Arc::new(Delta {
            epoch,
            seq,
            reset: false,
            stored: vec![key(seq)],
            removed: Vec::new(),
        }),
        oldest_event_ts: Some(1.0),
        batch_span: None,
    }
}

/// The agent as an uplink sees it: snapshots the test sets and a delta channel it feeds.
struct FakeSource {
    updates: Mutex<Option<broadcast::Sender<Update>>>,
    engines: Mutex<Vec<EngineSnapshot>>,
    snapshots_taken: AtomicUsize,
    /// Flushed right after the next snapshot is taken, as a mirror task may do meanwhile.
    after_snapshot: Mutex<Vec<Update>>,
    metrics: Metrics,
    /// The engine-set generation, bumped by [`FakeSource::set_engines`].
    membership: watch::Sender<u64>,
}

impl FakeSource {
    fn new(capacity: usize, engines: Vec<EngineSnapshot>) -> Arc<FakeSource> {
        Arc::new(FakeSource {
            updates: Mutex::new(Some(broadcast::channel(capacity).0)),
            engines: Mutex::new(engines),
            snapshots_taken: AtomicUsize::new(0),
            after_snapshot: Mutex::new(Vec::new()),
            metrics: Metrics::new(),
            membership: watch::Sender::new(0),
        })
    }

    /// The agent's engines change.
    fn set_engines(&self, engines: Vec<EngineSnapshot>) {
        *self.engines.lock() = engines;
        self.membership.send_modify(|g| *g += 1);
    }

    fn flush(&self, update: Update) {
        if let Some(tx) = &*self.updates.lock() {
            let _ = tx.send(update);
        }
    }

    /// The agent shuts down: its delta channel closes.
    fn close(&self) {
        self.updates.lock().take();
    }

    fn connected(&self) -> i64 {
        self.metrics
            .uplink_connected
            .get_or_create(&RouterLabel {
                router: ROUTER.into(),
            })
            .get()
    }

    fn errors(&self, reason: &'static str) -> u64 {
        self.metrics
            .uplink_errors
            .get_or_create(&UplinkErrorLabel {
                router: ROUTER.into(),
                reason,
            })
            .get()
    }

    /// Deltas whose acknowledgement was timed.
    fn acked_deltas(&self) -> u64 {
        let text = self.metrics.encode();
        let series = format!("llmgw_agent_event_to_router_seconds_count{{router=\"{ROUTER}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&series))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }
}

impl FeedSource for FakeSource {
    fn node(&self) -> NodeInfo {
        NodeInfo {
            node: "n1".into(),
            model: "m".into(),
            block_size: 16,
            hash_algo: "sha256_cbor".into(),
            hash_seed_set: true,
        }
    }

    fn subscribe(&self) -> broadcast::Receiver<Update> {
        match &*self.updates.lock() {
            Some(tx) => tx.subscribe(),
            // Closed already: a receiver whose sender is gone.
            None => broadcast::channel(1).1,
        }
    }

    fn snapshot_engines(&self) -> Vec<EngineSnapshot> {
        self.snapshots_taken.fetch_add(1, Ordering::SeqCst);
        let snapshots = self.engines.lock().clone();
        let racing: Vec<Update> = std::mem::take(&mut *self.after_snapshot.lock());
        for u in racing {
            self.flush(u);
        }
        snapshots
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn membership(&self) -> Option<watch::Receiver<u64>> {
        Some(self.membership.subscribe())
    }
}

/// The router's end of one stream.
struct RouterEnd {
    from_agent: mpsc::Receiver<pb::AgentMessage>,
    to_agent: mpsc::UnboundedSender<Result<pb::RouterMessage, tonic::Status>>,
}

impl RouterEnd {
    /// Everything the agent has sent so far.
    fn received(&mut self) -> Vec<pb::AgentMessage> {
        let mut got = Vec::new();
        while let Ok(m) = self.from_agent.try_recv() {
            got.push(m);
        }
        got
    }

    fn ack(&self, id: u64) {
        let ack = pb::RouterMessage {
            body: Some(pb::router_message::Body::Ack(pb::Ack { id })),
        };
        self.to_agent.send(Ok(ack)).expect("the session listens");
    }
}

/// A router reached over channels: it refuses the first `refuse` connections, then hands each
/// stream the agent opens to the test.
#[derive(Clone)]
struct FakeRouter {
    attempts: Arc<Mutex<Vec<Instant>>>,
    refuse: Arc<AtomicUsize>,
    streams: mpsc::UnboundedSender<RouterEnd>,
}

impl FakeRouter {
    fn new(refuse: usize) -> (FakeRouter, mpsc::UnboundedReceiver<RouterEnd>) {
        let (streams, rx) = mpsc::unbounded_channel();
        let router = FakeRouter {
            attempts: Arc::new(Mutex::new(Vec::new())),
            refuse: Arc::new(AtomicUsize::new(refuse)),
            streams,
        };
        (router, rx)
    }

    fn attempts(&self) -> Vec<Instant> {
        self.attempts.lock().clone()
    }
}

impl Transport for FakeRouter {
    type Connection = ();

    async fn connect(&self, router: &str, _: &Credentials) -> Result<(), UplinkError> {
        self.attempts.lock().push(Instant::now());
        let refused = self
            .refuse
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if refused {
            return Err(UplinkError::Stream {
                router: router.to_owned(),
                status: Box::new(tonic::Status::unavailable("connection refused")),
            });
        }
        Ok(())
    }

    async fn open(
        &self,
        (): (),
        _: &str,
        _: &Credentials,
        outbound: mpsc::Receiver<pb::AgentMessage>,
    ) -> Result<Inbound, UplinkError> {
        let (to_agent, inbound) = mpsc::unbounded_channel();
        let _ = self.streams.send(RouterEnd {
            from_agent: outbound,
            to_agent,
        });
        Ok(Box::pin(UnboundedReceiverStream::new(inbound)))
    }
}

fn config() -> UplinkConfig {
    let mut config = UplinkConfig::new(ROUTER, None);
    config.heartbeat = Duration::from_secs(5);
    config.backoff_initial = Duration::from_millis(100);
    config.backoff_max = Duration::from_secs(1);
    config
}

fn start(source: &Arc<FakeSource>, router: &FakeRouter, config: UplinkConfig) -> JoinHandle<()> {
    let (source, router) = (Arc::clone(source), router.clone());
    tokio::spawn(async move { reconnect(&*source, &router, &config).await })
}

/// Lets the uplink act on what the test just did (no timer is due this soon).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

/// A message as `kind engine epoch/seq`, enough to tell the sequence apart.
fn describe(m: &pb::AgentMessage) -> String {
    match &m.body {
        Some(pb::agent_message::Body::Hello(h)) => format!("hello {}", h.node),
        Some(pb::agent_message::Body::Snapshot(s)) => {
            format!("snapshot {} {}/{}", s.engine, s.epoch, s.seq)
        }
        Some(pb::agent_message::Body::Delta(d)) => {
            format!("delta {} {}/{}", d.engine, d.epoch, d.seq)
        }
        Some(pb::agent_message::Body::Heartbeat(_)) => "heartbeat".into(),
        None => "empty".into(),
    }
}

fn describe_all(messages: &[pb::AgentMessage]) -> Vec<String> {
    messages.iter().map(describe).collect()
}

#[tokio::test(start_paused = true)]
async fn hello_then_a_snapshot_per_engine_then_only_the_deltas_newer_than_each() {
    let source = FakeSource::new(
        64,
        vec![snapshot("a", 1, 3, &[30, 31]), snapshot("b", 2, 0, &[])],
    );
    // While the agent snapshots, engine a flushes its next delta: it must still go out, so the
    // uplink must have subscribed before snapshotting.
    *source.after_snapshot.lock() = vec![update("a", 1, 3), update("a", 1, 4)];
    let (router, mut streams) = FakeRouter::new(0);
    let _uplink = start(&source, &router, config());
    let mut end = streams.recv().await.expect("a stream");
    settle().await;
    let first = end.received();
    assert_eq!(
        describe_all(&first),
        [
            "hello n1",
            "snapshot a 1/3",
            "snapshot b 2/0",
            "delta a 1/4"
        ],
        "a 1/3 is inside the snapshot already"
    );
    let Some(pb::agent_message::Body::Hello(hello)) = &first[0].body else {
        panic!("not a hello: {:?}", first[0]);
    };
    let engines: Vec<(&str, &str, u32, &str, bool)> = hello
        .engines
        .iter()
        .map(|e| {
            (
                e.engine.as_str(),
                e.replica.as_str(),
                e.block_size,
                e.hash_algo.as_str(),
                e.hash_seed_set,
            )
        })
        .collect();
    assert_eq!(
        engines,
        [
            ("a", "a.replica:8000", 16, "sha256_cbor", true),
            ("b", "b.replica:8000", 16, "sha256_cbor", true)
        ]
    );
    let Some(pb::agent_message::Body::Snapshot(snap)) = &first[1].body else {
        panic!("not a snapshot: {:?}", first[1]);
    };
    let mut hashes: Vec<u64> = snap.blocks.iter().map(|b| b.hash).collect();
    hashes.sort_unstable();
    assert_eq!(hashes, [30, 31]);
    assert_eq!(snap.hash_status, pb::HashStatus::Verified as i32);
    assert_eq!(source.connected(), 1);

    // A refusal from the router is only logged: the stream goes on.
    end.to_agent
        .send(Ok(pb::RouterMessage {
            body: Some(pb::router_message::Body::Refused(pb::Refused {
                engine: "b".into(),
                replica: replica_of("b"),
                reason: "not on this node".into(),
            })),
        }))
        .expect("send");
    for u in [
        update("b", 2, 1),
        update("a", 1, 2), // older than a's snapshot
        update("a", 1, 5),
        update("a", 2, 1), // a reset engine: a new epoch
        update("b", 1, 9), // an epoch b has left
    ] {
        source.flush(u);
    }
    settle().await;
    let next = end.received();
    assert_eq!(
        describe_all(&next),
        ["delta b 2/1", "delta a 1/5", "delta a 2/1"]
    );
    let ids: Vec<u64> = first.iter().chain(&next).map(|m| m.id).collect();
    assert_eq!(ids, [1, 2, 3, 4, 5, 6, 7], "numbered in sending order");

    // Acknowledgements time the deltas up to the acknowledged id.
    end.ack(5);
    settle().await;
    assert_eq!(source.acked_deltas(), 2, "deltas 4 and 5");
    end.ack(7);
    settle().await;
    assert_eq!(source.acked_deltas(), 4);
    assert_eq!(router.attempts().len(), 1, "one stream all along");
}

#[tokio::test(start_paused = true)]
async fn heartbeats_go_out_once_per_interval_after_the_snapshots() {
    let source = FakeSource::new(64, vec![snapshot("a", 1, 0, &[])]);
    let (router, mut streams) = FakeRouter::new(0);
    let config = config();
    let every = config.heartbeat;
    let _uplink = start(&source, &router, config);
    let mut end = streams.recv().await.expect("a stream");
    settle().await;
    assert_eq!(
        describe_all(&end.received()),
        ["hello n1", "snapshot a 1/0"]
    );
    tokio::time::sleep(every - Duration::from_millis(2)).await;
    assert!(end.received().is_empty(), "none before the first interval");
    tokio::time::sleep(every * 2 + Duration::from_millis(2)).await;
    let beats = end.received();
    assert_eq!(
        describe_all(&beats),
        ["heartbeat", "heartbeat", "heartbeat"]
    );
    for b in &beats {
        let Some(pb::agent_message::Body::Heartbeat(h)) = &b.body else {
            unreachable!("checked above");
        };
        assert!(h.unix_ms > 0, "carries the agent's clock");
    }
}

#[tokio::test(start_paused = true)]
async fn a_lagging_subscription_resends_every_snapshot_on_the_same_stream() {
    let source = FakeSource::new(4, vec![snapshot("a", 1, 3, &[]), snapshot("b", 2, 0, &[])]);
    let (router, mut streams) = FakeRouter::new(0);
    let _uplink = start(&source, &router, config());
    let mut end = streams.recv().await.expect("a stream");
    settle().await;
    assert_eq!(end.received().len(), 3, "hello and two snapshots");

    // Ten deltas before the uplink reads one: the channel keeps four, the rest are lost to it.
    source.engines.lock()[0] = snapshot("a", 1, 13, &[7]);
    for seq in 4..=13 {
        source.flush(update("a", 1, seq));
    }
    settle().await;
    source.flush(update("a", 1, 14));
    settle().await;
    assert_eq!(
        describe_all(&end.received()),
        ["snapshot a 1/13", "snapshot b 2/0", "delta a 1/14"],
        "the deltas kept in the channel are inside the new snapshot"
    );
    assert_eq!(source.snapshots_taken.load(Ordering::SeqCst), 2);
    assert_eq!(router.attempts().len(), 1, "no reconnection");
}

/// Gaps between successive connection attempts.
fn gaps(attempts: &[Instant]) -> Vec<Duration> {
    attempts.windows(2).map(|w| w[1] - w[0]).collect()
}

#[tokio::test(start_paused = true)]
async fn the_backoff_doubles_after_each_failure_up_to_its_cap() {
    let source = FakeSource::new(64, vec![snapshot("a", 1, 0, &[])]);
    let (router, _streams) = FakeRouter::new(usize::MAX);
    let _uplink = start(&source, &router, config());
    tokio::time::sleep(Duration::from_millis(3600)).await;
    let ms = Duration::from_millis;
    assert_eq!(
        gaps(&router.attempts()),
        [ms(100), ms(200), ms(400), ms(800), ms(1000), ms(1000)]
    );
    assert_eq!(
        source.snapshots_taken.load(Ordering::SeqCst),
        0,
        "nothing is snapshotted for a router that cannot be reached"
    );
    assert_eq!(source.errors("unavailable"), 7, "each failure counted");
}

#[tokio::test(start_paused = true)]
async fn an_acknowledged_session_starts_the_next_backoff_from_the_initial_delay() {
    let source = FakeSource::new(64, vec![snapshot("a", 1, 0, &[])]);
    let (router, mut streams) = FakeRouter::new(2);
    let _uplink = start(&source, &router, config());

    // Refused twice (backoff 100 ms, then 200 ms), then a stream the router acknowledges.
    let end = streams.recv().await.expect("a stream");
    settle().await;
    assert_eq!(source.connected(), 1);
    end.ack(1);
    settle().await;
    let acked_ended = Instant::now();
    drop(end);
    settle().await;
    assert_eq!(
        source.connected(),
        0,
        "down once the router closed the stream"
    );

    // The backoff starts over: 100 ms, not 400. This stream is closed unacknowledged...
    let end = streams.recv().await.expect("a second stream");
    let unacked_ended = Instant::now();
    drop(end);
    // ...so the next wait doubles.
    let _third = streams.recv().await.expect("a third stream");
    let attempts = router.attempts();
    let ms = Duration::from_millis;
    assert_eq!(gaps(&attempts[..3]), [ms(100), ms(200)]);
    assert_eq!(attempts[3] - acked_ended, ms(100));
    assert_eq!(attempts[4] - unacked_ended, ms(200));
    assert_eq!(source.errors("unavailable"), 2, "the refused connections");
    assert_eq!(source.errors("closed"), 2, "the streams the router closed");
}

#[tokio::test(start_paused = true)]
async fn the_uplink_ends_when_the_agent_is_gone() {
    let source = FakeSource::new(64, vec![snapshot("a", 1, 0, &[])]);
    let (router, mut streams) = FakeRouter::new(0);
    let uplink = start(&source, &router, config());
    let _end = streams.recv().await.expect("a stream");
    settle().await;
    source.close();
    tokio::time::timeout(Duration::from_secs(3600), uplink)
        .await
        .expect("the uplink returns")
        .expect("without panicking");
    assert_eq!(router.attempts().len(), 1, "and does not reconnect");
    assert_eq!(source.connected(), 0);
    let text = source.metrics.encode();
    assert!(
        !text.contains("llmgw_agent_uplink_errors_total{"),
        "shutting down is no uplink error: {text}"
    );
}

#[test]
fn every_error_reason_is_listed_once() {
    let mut seen = std::collections::HashSet::new();
    for reason in ERROR_REASONS {
        assert!(seen.insert(reason), "{reason} listed twice");
    }
    let stream = |code: i32| UplinkError::Stream {
        router: ROUTER.into(),
        status: Box::new(tonic::Status::new(tonic::Code::from_i32(code), "")),
    };
    let mut errors: Vec<UplinkError> = (0..=16).map(stream).collect();
    errors.extend([
        UplinkError::Address(ROUTER.into(), "bad".into()),
        UplinkError::PlainTextRefused {
            router: ROUTER.into(),
            status: Box::new(tonic::Status::unavailable("")),
        },
        UplinkError::Closed(ROUTER.into()),
        UplinkError::AgentGone,
    ]);
    let reasons: std::collections::HashSet<&str> = errors.iter().map(UplinkError::reason).collect();
    assert_eq!(
        reasons.len(),
        errors.len(),
        "one reason per status code and kind"
    );
    for reason in &reasons {
        assert!(seen.contains(reason), "{reason} missing from ERROR_REASONS");
    }
    assert_eq!(stream(16).reason(), "unauthenticated");
    assert_eq!(stream(7).reason(), "permission_denied");
}

#[test]
fn a_large_snapshot_goes_in_parts_below_the_routers_message_limit() {
    use prost::Message as _;
    let hashes: Vec<u64> = (0..(2 * SNAPSHOT_PART_BLOCKS as u64 + 5)).collect();
    let parts = snapshot_messages(&snapshot("r1:8000", 3, 9, &hashes));
    assert_eq!(parts.len(), 3);
    let mut seen = 0;
    for (i, part) in parts.iter().enumerate() {
        let pb::agent_message::Body::Snapshot(s) = part else {
            panic!("part {i} is not a snapshot");
        };
        assert_eq!((s.epoch, s.seq, s.more), (3, 9, i < 2), "part {i}");
        assert!(s.blocks.len() <= SNAPSHOT_PART_BLOCKS);
        let wire = pb::AgentMessage {
            id: u64::MAX,
            body: Some(part.clone()),
        }
        .encoded_len();
        assert!(
            wire < llmgw::feed::MAX_MESSAGE_BYTES / 4,
            "part {i}: {wire} bytes"
        );
        seen += s.blocks.len();
    }
    assert_eq!(seen, hashes.len());
    // An empty engine still sends one (final) snapshot.
    let parts = snapshot_messages(&snapshot("r1:8000", 0, 0, &[]));
    assert!(
        matches!(&parts[..], [pb::agent_message::Body::Snapshot(s)] if !s.more && s.blocks.is_empty())
    );
}

#[test]
fn a_large_window_goes_in_deltas_below_the_routers_message_limit_and_applies_whole() {
    use llmgw::feed::{FeedLimits, FeedState};
    use llmgw::kvindex::{IndexConfig, KvIndex};
    use prost::Message as _;

    let mut mirror = crate::mirror::Mirror::new();
    let blocks = 2 * crate::mirror::DELTA_PART_CHANGES as u64 + 5;
    for hash in 1..=blocks {
        assert!(mirror.store(key(hash)));
    }
    let parts = mirror.take_deltas(crate::mirror::DELTA_PART_CHANGES);
    assert_eq!(parts.len(), 3);

    let index = KvIndex::new(IndexConfig::default());
    let mut feed = FeedState::new(
        [("n1".to_owned(), ["r1:8000".to_owned()].into())].into(),
        HashMap::new(),
        FeedLimits::default(),
        Duration::from_secs(30),
        Default::default(),
    );
    let stream = feed.open();
    let opening = [
        pb::agent_message::Body::hello("n1", "test", vec![pb::EngineInfo::serving("e", "r1:8000")]),
        pb::agent_message::Body::Snapshot(pb::Snapshot {
            engine: "e".into(),
            ..pb::Snapshot::default()
        }),
    ];
    let deltas = parts.iter().map(|d| delta_message("e", d, 0.0));
    for (id, body) in (1..).zip(opening.into_iter().chain(deltas)) {
        let message = pb::AgentMessage::numbered(id, body);
        let wire = message.encoded_len();
        assert!(
            wire < llmgw::feed::MAX_MESSAGE_BYTES / 4,
            "message {id}: {wire} bytes"
        );
        feed.apply(&index, stream, message)
            .unwrap_or_else(|e| panic!("message {id}: {e}"));
    }
    assert_eq!(index.replica_block_count("r1:8000"), blocks);
}

#[tokio::test(start_paused = true)]
async fn an_opening_longer_than_the_queue_is_queued_whole_before_the_stream_opens() {
    // Three snapshot parts against a queue of one stand in for a node whose snapshots take
    // more parts than the default queue (1024): before the stream opens nothing drains it.
    let hashes: Vec<u64> = (0..(2 * SNAPSHOT_PART_BLOCKS as u64 + 5)).collect();
    let source = FakeSource::new(64, vec![snapshot("a", 1, 3, &hashes)]);
    let (router, mut streams) = FakeRouter::new(0);
    let mut config = config();
    config.queue = 1;
    let _uplink = start(&source, &router, config);
    let mut end = tokio::time::timeout(Duration::from_secs(30), streams.recv())
        .await
        .expect("the stream opens: queueing the opening did not wait")
        .expect("a stream");
    settle().await;
    assert_eq!(
        describe_all(&end.received()),
        [
            "hello n1",
            "snapshot a 1/3",
            "snapshot a 1/3",
            "snapshot a 1/3"
        ]
    );
    // Past the opening the queue still carries deltas.
    source.flush(update("a", 1, 4));
    settle().await;
    assert_eq!(describe_all(&end.received()), ["delta a 1/4"]);
}

#[tokio::test(start_paused = true)]
async fn a_changed_engine_set_opens_a_new_stream_at_once_listing_it() {
    let source = FakeSource::new(64, vec![snapshot("a", 1, 3, &[30])]);
    let (router, mut streams) = FakeRouter::new(0);
    let _uplink = start(&source, &router, config());
    let mut first = streams.recv().await.expect("a stream");
    settle().await;
    assert_eq!(
        describe_all(&first.received()),
        ["hello n1", "snapshot a 1/3"]
    );

    // An engine the stream's Hello did not list flushes: not on this stream.
    let b_delta = update("b", 1, 1);
    source.flush(b_delta.clone());
    settle().await;
    assert_eq!(describe_all(&first.received()), Vec::<String>::new());

    // The set changes: a new stream at once (no backoff), its Hello listing both.
    let changed_at = Instant::now();
    source.set_engines(vec![snapshot("a", 1, 3, &[30]), snapshot("b", 1, 1, &[1])]);
    let mut second = streams.recv().await.expect("a second stream");
    settle().await;
    let messages = second.received();
    assert_eq!(
        describe_all(&messages),
        ["hello n1", "snapshot a 1/3", "snapshot b 1/1"]
    );
    let Some(pb::agent_message::Body::Hello(hello)) = &messages[0].body else {
        panic!("not a hello");
    };
    let listed: Vec<&str> = hello.engines.iter().map(|e| e.engine.as_str()).collect();
    assert_eq!(listed, ["a", "b"]);
    let attempts = router.attempts();
    assert_eq!(attempts.len(), 2);
    assert!(
        attempts[1] - changed_at < config().backoff_initial,
        "reconnected without backing off"
    );
    assert_eq!(source.errors("closed"), 0, "a change is no failure");

    // A restarted engine under the same name is another instance: the old one's late delta
    // is not sent on the new stream.
    IDS.with(|ids| ids.borrow_mut().remove("b"));
    let stale = Update {
        delta: Arc::new(Delta {
            epoch: 1,
            seq: 2,
            reset: false,
            stored: vec![key(2)],
            removed: Vec::new(),
        }),
        ..b_delta
    };
    source.set_engines(vec![snapshot("a", 1, 3, &[30]), snapshot("b", 0, 0, &[])]);
    let mut third = streams.recv().await.expect("a third stream");
    source.flush(stale);
    source.flush(update("b", 0, 1));
    settle().await;
    assert_eq!(
        describe_all(&third.received()),
        [
            "hello n1",
            "snapshot a 1/3",
            "snapshot b 0/0",
            "delta b 0/1"
        ]
    );
}
