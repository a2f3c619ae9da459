//! The intake against real zeromq sockets on 127.0.0.1, fed the recorded vLLM 0.32.0 stream.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;

use super::*;
use crate::capture::{Capture, Frame};
use crate::engine::{Engine, EngineId, MirrorTask, ReplicaId};
use crate::metrics::Metrics;
use crate::mirror::DEFAULT_WINDOW;
use crate::wire::{EventBatch, ExternalHash, KvEvent, decode_batch};

fn frames() -> Vec<Frame> {
    Capture::parse(&llmgw_core::fixtures::read("vllm-0.32.0-capture.jsonl"))
        .expect("capture")
        .frames
}

/// The block set a stream leaves, computed naively from the events (copies counted).
fn expected_blocks<'a>(batches: impl IntoIterator<Item = &'a Frame>) -> HashSet<ExternalHash> {
    let mut held: HashMap<ExternalHash, u32> = HashMap::new();
    for f in batches {
        let EventBatch { events, .. } = decode_batch(&f.payload).expect("decodes");
        for ev in events {
            match ev {
                KvEvent::BlockStored(s) => {
                    for h in s.block_hashes {
                        *held.entry(h).or_default() += 1;
                    }
                }
                KvEvent::BlockRemoved(r) => {
                    for h in r.block_hashes {
                        if let Some(n) = held.get_mut(&h) {
                            *n -= 1;
                            if *n == 0 {
                                held.remove(&h);
                            }
                        }
                    }
                }
                KvEvent::AllBlocksCleared(_) => held.clear(),
                KvEvent::Unknown { .. } => {}
            }
        }
    }
    held.into_keys().collect()
}

struct Rig {
    engine: Arc<Engine>,
    metrics: Arc<Metrics>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Rig {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Rig {
    fn hashes(&self) -> HashSet<ExternalHash> {
        self.engine
            .block_set()
            .into_iter()
            .map(|k| k.hash)
            .collect()
    }

    fn count(&self, f: impl Fn(&Metrics) -> u64) -> u64 {
        f(&self.metrics)
    }

    fn batches(&self) -> u64 {
        self.count(|m| m.batches.get_or_create(&Metrics::engine("e0")).get())
    }

    fn resets(&self, reason: &str) -> u64 {
        self.count(|m| m.resets.get_or_create(&Metrics::reason("e0", reason)).get())
    }

    fn replays(&self, outcome: &str) -> u64 {
        self.count(|m| {
            m.replays
                .get_or_create(&Metrics::reason("e0", outcome))
                .get()
        })
    }

    async fn wait_for(&self, what: &str, cond: impl Fn(&Rig) -> bool) {
        for _ in 0..500 {
            if cond(self) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "timed out waiting for {what}; metrics:\n{}",
            self.metrics.encode()
        );
    }
}

/// Starts an intake for `endpoint` and its mirror task.
async fn rig(endpoint: EngineEndpoint) -> (Rig, Option<String>) {
    let metrics = Arc::new(Metrics::new());
    let engine = Engine::new(EngineId(Arc::from("e0")), ReplicaId(Arc::from("r0:8000")));
    let (updates, _) = broadcast::channel(64);
    let (tx, rx) = mpsc::channel(64);
    let mirror = MirrorTask {
        engine: Arc::clone(&engine),
        check: None,
        window: DEFAULT_WINDOW,
        metrics: Arc::clone(&metrics),
        updates,
    };
    let (sock, bound) = open(&endpoint).await.expect("SUB opens");
    let intake = Intake {
        engine: Arc::from("e0"),
        endpoint,
        inputs: tx,
        metrics: Arc::clone(&metrics),
        replay_timeout: Duration::from_secs(2),
    };
    let tasks = vec![
        tokio::spawn(mirror.run(rx)),
        tokio::spawn(async move {
            let _ = intake.run(sock).await;
        }),
    ];
    (
        Rig {
            engine,
            metrics,
            tasks,
        },
        bound,
    )
}

/// A publisher bound on a free port (with a replay ROUTER when `shape` is given) and an
/// intake connected to it, subscribed once the subscription has had time to propagate.
/// An engine's PUB on a free port, with a replay ROUTER answering in `shape` when given.
async fn publisher(shape: Option<ReplyShape>, buffer_steps: usize) -> Publisher {
    Publisher::start(
        "tcp://127.0.0.1:0",
        false,
        shape.map(|_| "tcp://127.0.0.1:0"),
        "kv",
        shape.unwrap_or(ReplyShape::WithTopic),
        buffer_steps,
    )
    .await
    .expect("publisher binds")
}

/// An intake dialling `publisher` (and its replay socket, if any).
async fn rig_on(publisher: &Publisher) -> Rig {
    rig(EngineEndpoint {
        endpoint: publisher.endpoint.clone(),
        bind: false,
        replay: publisher.replay_endpoint.clone(),
        topic: "kv".into(),
    })
    .await
    .0
}

async fn connected(shape: Option<ReplyShape>, buffer_steps: usize) -> (Publisher, Rig) {
    let publisher = publisher(shape, buffer_steps).await;
    let rig = rig_on(&publisher).await;
    // PUB drops messages until the SUB's subscription has arrived.
    tokio::time::sleep(Duration::from_millis(300)).await;
    (publisher, rig)
}

#[tokio::test]
async fn the_recorded_stream_leaves_exactly_its_final_block_set() {
    let frames = frames();
    let (mut publisher, rig) = connected(None, 100).await;
    for f in &frames {
        publisher.publish(f.seq, &f.payload).await.expect("publish");
    }
    let n = frames.len() as u64;
    rig.wait_for("every batch", |r| r.batches() == n).await;
    let want = expected_blocks(&frames);
    assert!(!want.is_empty());
    assert_eq!(rig.hashes(), want);
    assert_eq!(rig.resets("cleared"), 1, "the capture's AllBlocksCleared");
    assert_eq!(rig.resets("gap") + rig.resets("restart"), 0);
}

/// A rig whose SUB is bound on 127.0.0.1:0, and its endpoint.
async fn bound_rig() -> (Rig, String) {
    let (rig, bound) = rig(EngineEndpoint {
        endpoint: "tcp://127.0.0.1:0".into(),
        bind: true,
        replay: None,
        topic: String::new(),
    })
    .await;
    (rig, bound.expect("bound endpoint"))
}

/// An engine dials `bound` and publishes `frames`: the rig must mirror exactly their blocks.
async fn an_engine_connects_and_its_recording_arrives_whole(
    bound: &str,
    rig: &Rig,
    frames: &[Frame],
) {
    let mut publisher = Publisher::start(bound, true, None, "kv", ReplyShape::WithTopic, 10)
        .await
        .expect("engine connects");
    tokio::time::sleep(Duration::from_millis(300)).await;
    for f in frames {
        publisher.publish(f.seq, &f.payload).await.expect("publish");
    }
    rig.wait_for("every batch", |r| r.batches() == frames.len() as u64)
        .await;
    assert_eq!(rig.hashes(), expected_blocks(frames));
}

#[tokio::test]
async fn a_bound_sub_receives_from_a_connecting_engine() {
    let frames = frames();
    let (rig, bound) = bound_rig().await;
    an_engine_connects_and_its_recording_arrives_whole(&bound, &rig, &frames).await;
}

/// A ZMTP 3.0 greeting, NULL mechanism, as a client (RFC 23: signature, version, mechanism,
/// as-server, filler).
fn zmtp_greeting() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// The READY command of a PUB peer.
fn zmtp_ready_pub() -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"PUB");
    let mut frame = vec![0x04, u8::try_from(body.len()).expect("short command")];
    frame.extend(body);
    frame
}

/// A message frame header declaring `len` bytes (the long form), with the "more" flag if asked.
fn long_frame_header(len: u64, more: bool) -> Vec<u8> {
    let mut h = vec![0x02 | u8::from(more)];
    h.extend_from_slice(&len.to_be_bytes());
    h
}

/// Dials the SUB bound at `endpoint` as a raw ZMTP peer claiming to be a PUB, sends `hostile`
/// after the handshake, and waits (bounded) for the SUB to hang up.
async fn hostile_peer(endpoint: &str, what: &str, hostile: &[u8]) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let addr = endpoint.strip_prefix("tcp://").expect("a tcp endpoint");
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("dials the SUB");
    let mut hello = zmtp_greeting();
    hello.extend(zmtp_ready_pub());
    stream.write_all(&hello).await.expect("handshake sent");
    // The SUB may hang up before it has read everything: a failed write is the expected end.
    let _ = stream.write_all(hostile).await;
    let hung_up = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = vec![0u8; 4096];
        while let Ok(n) = stream.read(&mut buf).await
            && n > 0
        {}
    })
    .await;
    assert!(hung_up.is_ok(), "the SUB kept a peer that sent {what}");
}

#[tokio::test]
async fn a_bound_sub_drops_peers_sending_oversized_frames_and_keeps_receiving() {
    let frames = frames();
    let (rig, bound) = bound_rig().await;
    // Unpatched, zeromq 0.7.0 reserved the declared length up front and aborted the process.
    hostile_peer(
        &bound,
        "a 2^62-byte frame header",
        &long_frame_header(1 << 62, false),
    )
    .await;
    let just_over = u64::try_from(zeromq::MAX_FRAME_BYTES).expect("fits") + 1;
    hostile_peer(
        &bound,
        "a frame just over the limit",
        &long_frame_header(just_over, false),
    )
    .await;
    // Empty frames flagged "more", one past the frame limit.
    let endless: Vec<u8> = [0x01, 0x00].repeat(zeromq::MAX_MESSAGE_FRAMES + 1);
    hostile_peer(&bound, "endless multipart frames", &endless).await;
    // Two frames of half the byte limit each (allowed), then one more byte (not).
    let half = zeromq::MAX_MESSAGE_BYTES / 2;
    let mut too_big = Vec::with_capacity(2 * (half + 9) + 10);
    for _ in 0..2 {
        too_big.extend(long_frame_header(half as u64, true));
        too_big.resize(too_big.len() + half, 0);
    }
    too_big.extend([0x00, 0x01, 0x00]);
    hostile_peer(&bound, "a multipart message over the byte limit", &too_big).await;
    // The SUB still takes a real engine's stream.
    an_engine_connects_and_its_recording_arrives_whole(&bound, &rig, &frames).await;
}

#[tokio::test]
async fn the_topic_filter_keeps_other_topics_out() {
    let frames = frames();
    let mut publisher = Publisher::on_loopback("kv", false, 10)
        .await
        .expect("binds");
    let (other, _) = rig(EngineEndpoint {
        endpoint: publisher.endpoint.clone(),
        bind: false,
        replay: None,
        topic: "other".into(),
    })
    .await;
    let (kv, _) = rig(EngineEndpoint {
        endpoint: publisher.endpoint.clone(),
        bind: false,
        replay: None,
        topic: "k".into(),
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for f in &frames[..3] {
        publisher.publish(f.seq, &f.payload).await.expect("publish");
    }
    kv.wait_for("the prefix-matching subscriber", |r| r.batches() == 3)
        .await;
    // One message on "other" after those: once it has arrived, so would have any before it.
    publisher
        .send_raw(
            Bytes::from_static(b"other"),
            vec![Bytes::from_static(b"not three frames")],
        )
        .await
        .expect("send");
    let bad = |r: &Rig| r.count(|m| m.bad_messages.get_or_create(&Metrics::engine("e0")).get());
    other
        .wait_for("the message on its own topic", |r| bad(r) == 1)
        .await;
    assert_eq!(other.batches(), 0);
    assert!(other.hashes().is_empty());
}

async fn dropped_batches_are_replayed(shape: ReplyShape) {
    let frames = frames();
    let (mut publisher, rig) = connected(Some(shape), 10_000).await;
    let lost: HashSet<u64> = [3, 4, 5, 11].into_iter().collect();
    for f in &frames {
        if lost.contains(&f.seq) {
            publisher.publish_lost(f.seq, &f.payload);
        } else {
            publisher.publish(f.seq, &f.payload).await.expect("publish");
            // One gap at a time, so each is its own replay.
            rig.wait_for("the batch", |r| r.batches() == f.seq + 1)
                .await;
        }
    }
    rig.wait_for("every batch", |r| r.batches() == frames.len() as u64)
        .await;
    assert_eq!(rig.hashes(), expected_blocks(&frames));
    assert_eq!(rig.replays("filled"), 2, "two gaps, both filled");
    assert_eq!(rig.resets("gap") + rig.resets("restart"), 0);
}

#[tokio::test]
async fn dropped_batches_are_replayed_without_topic_frame() {
    dropped_batches_are_replayed(ReplyShape::WithoutTopic).await;
}

#[tokio::test]
async fn dropped_batches_are_replayed_with_topic_frame() {
    dropped_batches_are_replayed(ReplyShape::WithTopic).await;
}

#[tokio::test]
async fn without_replay_a_gap_resets_the_engine() {
    let frames = frames();
    let (mut publisher, rig) = connected(None, 10).await;
    // Seq 16 holds a BlockRemoved; losing 15 loses stores.
    for f in frames.iter().filter(|f| f.seq != 15) {
        publisher.publish(f.seq, &f.payload).await.expect("publish");
    }
    let n = frames.len() as u64 - 1;
    rig.wait_for("every batch", |r| r.batches() == n).await;
    assert_eq!(rig.resets("gap"), 1);
    // After the reset the mirror holds what the batches from 16 on say.
    assert_eq!(rig.hashes(), expected_blocks(frames.iter().skip(16)));
}

#[tokio::test]
async fn a_replay_buffer_that_no_longer_covers_the_gap_is_loss() {
    let frames = frames();
    // vLLM keeps only the last 2 batches: losing 2..=6 cannot be repaired.
    let (mut publisher, rig) = connected(Some(ReplyShape::WithTopic), 2).await;
    for f in &frames[..8] {
        if (2..=6).contains(&f.seq) {
            publisher.publish_lost(f.seq, &f.payload);
        } else {
            publisher.publish(f.seq, &f.payload).await.expect("publish");
        }
    }
    rig.wait_for("the loss", |r| r.replays("loss") == 1).await;
    rig.wait_for("a reset", |r| r.resets("gap") == 1).await;
    // Replay returned 6 and 7 (first replayed seq 6 > asked 2): state restarts from 6.
    rig.wait_for("the rest", |r| r.hashes() == expected_blocks(&frames[6..8]))
        .await;
}

#[tokio::test]
async fn a_restarted_engine_resets_and_reconverges() {
    let frames = frames();
    let (mut publisher, rig) = connected(None, 10).await;
    for f in &frames[..10] {
        publisher.publish(f.seq, &f.payload).await.expect("publish");
    }
    rig.wait_for("first life", |r| r.batches() == 10).await;
    // The engine restarts: its seq starts again at 0, with the later batches' content.
    for (i, f) in frames[14..].iter().enumerate() {
        publisher
            .publish(i as u64, &f.payload)
            .await
            .expect("publish");
    }
    let n = 10 + frames.len() as u64 - 14;
    rig.wait_for("second life", |r| r.batches() == n).await;
    assert_eq!(rig.resets("restart"), 1);
    assert_eq!(rig.hashes(), expected_blocks(&frames[14..]));
}

/// Found with `make e2e-vllm`: a killed vLLM restarted by the supervisor binds its PUB again a
/// minute later, and zeromq's own re-dialling had backed off to tens of seconds by then, so the
/// new engine's first batches were lost. The intake now dials afresh on a disconnect.
#[tokio::test]
async fn a_restarted_engine_is_heard_within_seconds_of_binding_again() {
    let frames = frames();
    let (mut publisher, rig) = connected(None, 10).await;
    let endpoint = publisher.endpoint.clone();
    for f in &frames[..3] {
        publisher.publish(f.seq, &f.payload).await.expect("publish");
    }
    rig.wait_for("first life", |r| r.batches() == 3).await;
    drop(publisher);
    // Down long enough for zeromq's own re-dialling (0.1 s, doubling) to have backed off:
    // its attempts fall near 5 s, 10.5 s and 21 s, so it would hear the engine ~9 s late.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let mut publisher = Publisher::start(&endpoint, false, None, "kv", ReplyShape::WithTopic, 10)
        .await
        .expect("the engine binds again");
    let rebound = tokio::time::Instant::now();
    // PUB drops messages until the SUB is back: publish the new life's batch 0 until heard.
    let f = &frames[0];
    while rig.resets("restart") == 0 && rebound.elapsed() < Duration::from_secs(4) {
        publisher.publish(0, &f.payload).await.expect("publish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        rig.resets("restart"),
        1,
        "the new engine was not heard within 4 s of binding"
    );
}

#[tokio::test]
async fn messages_that_are_not_three_frames_are_counted_and_dropped() {
    let frames = frames();
    let (mut publisher, rig) = connected(None, 10).await;
    publisher
        .send_raw(Bytes::from_static(b"kv"), vec![Bytes::from_static(b"x")])
        .await
        .expect("send");
    publisher
        .send_raw(
            Bytes::from_static(b"kv"),
            vec![Bytes::from_static(b"short"), Bytes::from_static(b"\x90")],
        )
        .await
        .expect("send");
    publisher
        .publish(0, &frames[0].payload)
        .await
        .expect("publish");
    // A payload that is not msgpack: lost changes, so a reset.
    publisher.publish(1, b"\xc1garbage").await.expect("publish");
    rig.wait_for("the decode error", |r| r.resets("decode_error") == 1)
        .await;
    let bad = rig.count(|m| m.bad_messages.get_or_create(&Metrics::engine("e0")).get());
    assert_eq!(bad, 2);
    assert_eq!(rig.batches(), 1);
}

#[tokio::test]
async fn replay_reads_both_reply_shapes_and_stops_at_the_end_marker() {
    for shape in [ReplyShape::WithoutTopic, ReplyShape::WithTopic] {
        let publisher = Publisher::start(
            "tcp://127.0.0.1:0",
            false,
            Some("tcp://127.0.0.1:0"),
            "kv",
            shape,
            3,
        )
        .await
        .expect("binds");
        for seq in 10..15u64 {
            publisher.publish_lost(seq, &seq.to_le_bytes());
        }
        let ep = publisher.replay_endpoint.clone().expect("replay endpoint");
        let got = replay(&ep, 11, Duration::from_secs(2))
            .await
            .expect("replay");
        let seqs: Vec<u64> = got.iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, [12, 13, 14], "{shape:?}: the buffer keeps 3");
        assert_eq!(got[0].1.as_ref(), 12u64.to_le_bytes());
    }
}

/// Stops `old` and starts a new engine life on the same PUB and replay endpoints (its seq and
/// replay buffer start afresh), retrying while the old sockets release their ports.
async fn restarted(old: Publisher, shape: ReplyShape) -> Publisher {
    let endpoint = old.endpoint.clone();
    let replay = old.replay_endpoint.clone();
    drop(old);
    for _ in 0..100 {
        if let Ok(p) = Publisher::start(&endpoint, false, replay.as_deref(), "kv", shape, 100).await
        {
            return p;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the restarted engine could not bind {endpoint} / {replay:?} again");
}

/// The new life: frames[14..] renumbered from 0 (their stores are not the first life's).
fn second_life(frames: &[Frame]) -> Vec<Frame> {
    frames[14..]
        .iter()
        .enumerate()
        .map(|(i, f)| Frame {
            seq: i as u64,
            ..f.clone()
        })
        .collect()
}

/// Runs a first life of 10 batches, restarts the engine, buffers the new life's 0..=2 unheard,
/// publishes its 3 until the intake has noticed the restart, then its 4. Returns the engine too
/// (dropping it would close its PUB before 4 left).
async fn restart_with_unheard_batches(shape: Option<ReplyShape>) -> (Publisher, Rig, Vec<Frame>) {
    let frames = frames();
    let (mut publisher, rig) = connected(shape, 100).await;
    for f in &frames[..10] {
        publisher.publish(f.seq, &f.payload).await.expect("publish");
    }
    rig.wait_for("first life", |r| r.batches() == 10).await;
    let mut publisher = restarted(publisher, shape.unwrap_or(ReplyShape::WithTopic)).await;
    let life = second_life(&frames);
    for f in &life[..3] {
        publisher.publish_lost(f.seq, &f.payload);
    }
    // PUB drops messages until the re-dialled SUB is subscribed: probe with a malformed
    // message (counted and dropped, leaving the seq state alone) until one is heard.
    let bad = |r: &Rig| r.count(|m| m.bad_messages.get_or_create(&Metrics::engine("e0")).get());
    for _ in 0..100 {
        if bad(&rig) > 0 {
            break;
        }
        publisher
            .send_raw(
                Bytes::from_static(b"kv"),
                vec![Bytes::from_static(b"probe")],
            )
            .await
            .expect("probe");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(bad(&rig) > 0, "the restarted engine was never heard");
    publisher
        .publish(life[3].seq, &life[3].payload)
        .await
        .expect("publish");
    rig.wait_for("the restart", |r| r.resets("restart") == 1)
        .await;
    publisher
        .publish(life[4].seq, &life[4].payload)
        .await
        .expect("publish");
    (publisher, rig, life)
}

#[tokio::test]
async fn a_restart_heard_after_seq_0_replays_the_new_life_from_0() {
    for shape in [ReplyShape::WithoutTopic, ReplyShape::WithTopic] {
        let (_engine, rig, life) = restart_with_unheard_batches(Some(shape)).await;
        let want = expected_blocks(&life[..5]);
        assert_ne!(
            want,
            expected_blocks(&life[3..5]),
            "batches 0..=2 must hold blocks for this test to mean anything"
        );
        rig.wait_for("the new life's 0..=4", |r| r.hashes() == want)
            .await;
        assert_eq!(rig.replays("filled"), 1, "{shape:?}");
        assert_eq!(rig.resets("gap"), 0, "{shape:?}");
        assert_eq!(rig.batches(), 10 + 5, "{shape:?}: each batch applied once");
    }
}

#[tokio::test]
async fn without_replay_a_restart_heard_after_seq_0_resets_and_takes_what_follows() {
    let (_engine, rig, life) = restart_with_unheard_batches(None).await;
    let want = expected_blocks(&life[3..5]);
    rig.wait_for("the new life's 3..=4", |r| r.batches() == 10 + 2)
        .await;
    assert_eq!(rig.hashes(), want);
    assert_eq!(rig.resets("restart"), 1);
    assert_eq!(rig.resets("gap"), 0, "the restart's reset suffices");
    let gaps = rig.count(|m| m.gaps.get_or_create(&Metrics::engine("e0")).get());
    assert_eq!(gaps, 1, "0..3 of the new life went unheard");
}

#[tokio::test]
async fn an_engine_first_heard_after_seq_0_is_replayed_from_0() {
    let frames = frames();
    let (mut publisher, rig) = connected(Some(ReplyShape::WithTopic), 100).await;
    // Published before the agent came up.
    for f in &frames[..3] {
        publisher.publish_lost(f.seq, &f.payload);
    }
    publisher
        .publish(frames[3].seq, &frames[3].payload)
        .await
        .expect("publish");
    let want = expected_blocks(&frames[..4]);
    assert_ne!(want, expected_blocks(&frames[3..4]));
    rig.wait_for("batches 0..=3", |r| r.hashes() == want).await;
    assert_eq!(rig.replays("filled"), 1);
    assert_eq!(rig.resets("gap") + rig.resets("restart"), 0);
}

#[tokio::test]
async fn an_idle_engines_buffered_batches_are_replayed_when_the_intake_starts() {
    let frames = frames();
    let mut publisher = publisher(Some(ReplyShape::WithTopic), 100).await;
    // Published before the agent came up; the engine then stays idle.
    for f in &frames[..4] {
        publisher.publish_lost(f.seq, &f.payload);
    }
    let rig = rig_on(&publisher).await;
    let want = expected_blocks(&frames[..4]);
    assert!(!want.is_empty());
    rig.wait_for("batches 0..=3 without a live one", |r| r.hashes() == want)
        .await;
    assert_eq!(rig.replays("at_start"), 1);
    // The next live batch follows on in order.
    tokio::time::sleep(Duration::from_millis(300)).await;
    publisher
        .publish(frames[4].seq, &frames[4].payload)
        .await
        .expect("publish");
    let want = expected_blocks(&frames[..5]);
    rig.wait_for("batch 4", |r| r.hashes() == want).await;
    assert_eq!(rig.resets("gap") + rig.resets("restart"), 0);
}
