use std::num::NonZeroUsize;

use llmgw_core::blockhash::HashSettings;
use llmgw_core::kv_event::Medium as Tier;

use super::*;
use crate::capture::Capture;
use crate::mirror::{DEFAULT_WINDOW, GroupIdx};
use crate::wire::{BlockRemoved, BlockStored, ExternalHash, decode_batch};

fn task(check_seed: Option<&str>) -> (MirrorTask, broadcast::Receiver<Update>) {
    let (updates, rx) = broadcast::channel(1024);
    let check = check_seed.map(|seed| {
        let size = NonZeroUsize::new(32).expect("non-zero");
        HashCheck::new(HashSettings::sha256_cbor(size, Some(seed))).expect("settings")
    });
    let engine = Engine::new(
        EngineId(Arc::from("e0")),
        ReplicaId(Arc::from("10.0.0.1:8000")),
    );
    let t = MirrorTask {
        engine,
        check,
        window: DEFAULT_WINDOW,
        metrics: Arc::new(Metrics::new()),
        updates,
    };
    (t, rx)
}

fn stored(h: u64) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: vec![ExternalHash(h)],
        parent_block_hash: Some(ExternalHash(1)),
        ..BlockStored::default()
    })
}

fn removed(h: u64) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![ExternalHash(h)],
        ..BlockRemoved::default()
    })
}

fn batch(seq: u64, events: Vec<KvEvent>) -> Input {
    Input::Batch {
        seq,
        batch: EventBatch {
            ts: 0.0,
            events,
            dp_rank: Some(0),
        },
        span: tracing::Span::none(),
    }
}

fn key(h: u64) -> BlockKey {
    BlockKey {
        hash: ExternalHash(h),
        group: GroupIdx(0),
        tier: Tier::Gpu,
    }
}

#[tokio::test(start_paused = true)]
async fn deltas_leave_after_the_window_and_undone_stores_never_do() {
    let (t, mut rx) = task(None);
    let (tx, inputs) = mpsc::channel(16);
    let run = tokio::spawn(t.run(inputs));
    tx.send(batch(0, vec![stored(7), stored(8)]))
        .await
        .expect("send");
    tokio::time::sleep(Duration::from_millis(5)).await;
    tx.send(batch(1, vec![removed(8)])).await.expect("send");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(rx.try_recv().is_err(), "still inside the 20 ms window");
    tokio::time::sleep(Duration::from_millis(6)).await;
    let u = rx.try_recv().expect("flushed at 20 ms");
    assert_eq!(
        u.delta.stored,
        vec![key(7)],
        "8 was stored and removed in the window"
    );
    assert!(u.delta.removed.is_empty() && !u.delta.reset);
    assert_eq!(&*u.replica.0, "10.0.0.1:8000");

    // A store undone inside the next window sends nothing at all.
    tx.send(batch(2, vec![stored(9)])).await.expect("send");
    tx.send(batch(3, vec![removed(9)])).await.expect("send");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(rx.try_recv().is_err());
    drop(tx);
    run.await.expect("task ends when the intake closes");
}

#[tokio::test(start_paused = true)]
async fn a_reset_reaches_the_routers_as_a_new_epoch() {
    let (t, mut rx) = task(None);
    let engine = t.engine.clone();
    let (tx, inputs) = mpsc::channel(16);
    let run = tokio::spawn(t.run(inputs));
    tx.send(batch(0, vec![stored(1), stored(2)]))
        .await
        .expect("send");
    tokio::time::sleep(Duration::from_millis(30)).await;
    let first = rx.try_recv().expect("first delta");
    tx.send(Input::Reset(ResetReason::Restart))
        .await
        .expect("send");
    tx.send(batch(0, vec![stored(3)])).await.expect("send");
    tokio::time::sleep(Duration::from_millis(30)).await;
    let second = rx.try_recv().expect("delta after reset");
    assert!(second.delta.reset && second.delta.epoch == first.delta.epoch + 1);
    assert_eq!(second.delta.stored, vec![key(3)]);
    assert_eq!(engine.block_set(), [key(3)].into_iter().collect());
    drop(tx);
    run.await.expect("ends");
}

fn capture_inputs() -> Vec<Input> {
    let cap =
        Capture::parse(&llmgw_core::fixtures::read("vllm-0.32.0-capture.jsonl")).expect("parse");
    cap.frames
        .iter()
        .map(|f| Input::Batch {
            seq: f.seq,
            batch: decode_batch(&f.payload).expect("decodes"),
            span: tracing::Span::none(),
        })
        .collect()
}

#[test]
fn the_capture_is_verified_with_the_right_seed() {
    let (t, _rx) = task(Some("1729"));
    for input in capture_inputs() {
        t.handle(input);
    }
    assert_eq!(t.engine.hash_status(), HashStatus::Verified);
    assert!(!t.engine.block_set().is_empty());
    let text = t.metrics.encode();
    assert!(
        !text.contains("llmgw_agent_hash_mismatches_total{"),
        "{text}"
    );
}

#[test]
fn a_wrong_seed_is_a_hash_mismatch_and_withholds_the_blocks() {
    let (t, mut rx) = task(Some("42"));
    for input in capture_inputs() {
        t.handle(input);
    }
    t.flush();
    assert_eq!(t.engine.hash_status(), HashStatus::Mismatch);
    assert!(t.engine.block_set().is_empty(), "withheld from the index");
    let snap = t.engine.snapshot();
    assert!(snap.snapshot.blocks.is_empty() && snap.hash == HashStatus::Mismatch);
    let u = rx.try_recv().expect("the reset that withdraws the blocks");
    assert!(u.delta.reset && u.delta.stored.is_empty());
    let text = t.metrics.encode();
    assert!(
        text.contains(r#"llmgw_agent_hash_mismatches_total{engine="e0"}"#),
        "{text}"
    );
    // A restarted engine is judged afresh.
    t.handle(Input::Reset(ResetReason::Restart));
    assert_eq!(t.engine.hash_status(), HashStatus::Unchecked);
}

#[test]
fn an_untraced_batch_leaves_no_span_on_its_delta() {
    let (t, mut rx) = task(None);
    t.handle(batch(0, vec![stored(1)]));
    t.flush();
    assert!(rx.try_recv().expect("a delta").batch_span.is_none());
}

#[test]
fn unknown_event_types_share_one_series() {
    let (t, _rx) = task(None);
    let unknown = |kind: &str| KvEvent::Unknown {
        kind: kind.to_owned(),
    };
    t.handle(batch(
        0,
        vec![
            unknown("FutureEvent"),
            unknown(&"x".repeat(10_000)),
            stored(1),
        ],
    ));
    t.handle(batch(1, vec![unknown("AnotherOne")]));
    let text = t.metrics.encode();
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("llmgw_agent_events_total{"))
        .collect();
    assert_eq!(series.len(), 2, "{text}");
    assert!(
        text.contains(r#"llmgw_agent_events_total{engine="e0",type="unknown"} 3"#),
        "{text}"
    );
    assert!(
        text.contains(r#"llmgw_agent_events_total{engine="e0",type="BlockStored"} 1"#),
        "{text}"
    );
}

#[test]
fn logged_tags_are_cut_on_a_character_boundary() {
    assert_eq!(truncate_chars("short", 64), "short");
    assert_eq!(truncate_chars("ééé", 2), "éé");
    assert_eq!(truncate_chars(&"x".repeat(100), 64).len(), 64);
}

#[test]
fn an_engine_past_the_mirror_ceiling_is_reset_and_counted() {
    let (t, mut rx) = task(None);
    // Copies of one block: the cheapest way past the ceiling.
    let too_many = usize::try_from(crate::mirror::MAX_COPIES).expect("fits") + 1;
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![ExternalHash(1); too_many],
        ..BlockStored::default()
    });
    t.handle(batch(0, vec![ev]));
    t.handle(batch(1, vec![stored(7)]));
    t.flush();
    assert_eq!(t.engine.block_set(), HashSet::from([key(7)]));
    let u = rx.try_recv().expect("a delta");
    assert!(u.delta.reset && u.delta.stored == [key(7)]);
    let text = t.metrics.encode();
    assert!(
        text.contains(r#"llmgw_agent_resets_total{engine="e0",reason="overflow"} 1"#),
        "{text}"
    );
}
