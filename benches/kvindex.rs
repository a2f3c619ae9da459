//! KV index: apply throughput (block events/s), prefix lookup latency for a 512-block prompt over
//! 64 replicas, lookup latency and memory at 4, 64 and 256 replicas of 8,000 blocks each (the
//! shape `make bench-scale` fills a real router with), memory per (block, replica) entry, and
//! what lookups see while the feed applies an agent's restated snapshot of a million blocks
//! (a reconnect): how long it takes and how many lookups found the replica short of its blocks.
//!
//! `cargo bench -p llmgw --bench kvindex`. Memory is printed once, measured by counting the bytes
//! the global allocator holds before and after filling the index, at several sizes.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a bench or test harness: a panic is a failed run, not a crashed router"
)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use llmgw::blockhash::ExternalHash;
use llmgw::feed::{FeedLimits, FeedState, NodeMap, StreamId};
use llmgw::kvindex::{IndexConfig, KvEventSink, KvIndex, Medium, PrefixMatch};
use llmgw_feed_proto::v1 as pb;

struct Counting;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        ALLOCATED.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn hashes(seed: u64, n: usize) -> Vec<ExternalHash> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ExternalHash(x)
        })
        .collect()
}

fn replica(i: usize) -> String {
    format!("10.0.{}.{}:8000", i / 250, i % 250)
}

fn bench_apply(c: &mut Criterion) {
    let mut group = c.benchmark_group("kvindex/apply");
    let batch = hashes(1, 64);
    group.throughput(Throughput::Elements(2 * batch.len() as u64));
    let index = KvIndex::new(IndexConfig::default());
    // A store and the matching remove of a 64-block batch: the index's size stays flat.
    group.bench_function("store_remove_64_blocks", |b| {
        b.iter(|| {
            index.stored("10.0.0.1:8000", black_box(&batch), Medium::Gpu);
            index.removed("10.0.0.1:8000", black_box(&batch), Medium::Gpu);
        })
    });
    group.finish();
}

fn bench_lookup(c: &mut Criterion) {
    let index = KvIndex::new(IndexConfig::default());
    let prompt = hashes(7, 512);
    // 64 replicas; replica i holds the first 8·i blocks of the prompt plus 2,000 blocks of its own.
    for i in 0..64 {
        index.stored(&replica(i), &prompt[..(8 * i).min(512)], Medium::Gpu);
        index.stored(&replica(i), &hashes(1000 + i as u64, 2000), Medium::Gpu);
    }
    let candidates: Vec<_> = (0..64).map(|i| index.slot(&replica(i))).collect();
    let mut out: Vec<PrefixMatch> = Vec::with_capacity(64);
    let mut group = c.benchmark_group("kvindex/lookup");
    group.bench_function("512_blocks_64_replicas", |b| {
        b.iter(|| {
            index.match_prefix(black_box(&prompt), &candidates, &mut out);
            black_box(out[63].blocks)
        })
    });
    // Every replica holds the whole prompt: the longest walk.
    let full = KvIndex::new(IndexConfig::default());
    for i in 0..64 {
        full.stored(&replica(i), &prompt, Medium::Gpu);
    }
    let candidates: Vec<_> = (0..64).map(|i| full.slot(&replica(i))).collect();
    group.bench_function("512_blocks_64_replicas_all_hold_all", |b| {
        b.iter(|| {
            full.match_prefix(black_box(&prompt), &candidates, &mut out);
            black_box(out[63].blocks)
        })
    });
    group.finish();

    // The target is a tail latency: time single lookups (`cargo bench` passes --bench; under
    // `cargo test` a short run only checks that it works).
    let runs = if std::env::args().any(|a| a == "--bench") {
        100_000
    } else {
        100
    };
    let mut samples: Vec<std::time::Duration> = (0..runs)
        .map(|_| {
            let start = std::time::Instant::now();
            full.match_prefix(black_box(&prompt), &candidates, &mut out);
            black_box(out[63].blocks);
            start.elapsed()
        })
        .collect();
    samples.sort_unstable();
    println!(
        "kvindex/lookup 512 blocks × 64 replicas (all hold all): p50 {:?}, p99 {:?} over {runs} lookups",
        samples[samples.len() / 2],
        samples[samples.len() * 99 / 100]
    );
}

/// Lookup latency as the fleet grows: every replica holds a 32-block system prompt and 8,000
/// blocks of its own, one of them also the prompt's 32 remaining blocks; a 64-block prompt is
/// matched against all replicas (what the router asks for every request of a model they all
/// serve). Also prints the index's memory at that fill.
fn bench_lookup_scale(c: &mut Criterion) {
    let full = std::env::args().any(|a| a == "--bench");
    let own_blocks = if full { 8_000 } else { 100 };
    let runs = if full { 20_000 } else { 100 };
    let prompt = hashes(11, 64);
    let mut group = c.benchmark_group("kvindex/lookup_scale");
    for n in [4usize, 64, 256] {
        let own: Vec<Vec<ExternalHash>> = (0..n)
            .map(|i| hashes(50_000 + i as u64, own_blocks))
            .collect();
        let before = ALLOCATED.load(Ordering::Relaxed);
        let index = KvIndex::new(IndexConfig::default());
        for (i, blocks) in own.iter().enumerate() {
            let held = if i == 0 { &prompt[..] } else { &prompt[..32] };
            index.stored(&replica(i), held, Medium::Gpu);
            index.stored(&replica(i), blocks, Medium::Gpu);
        }
        let bytes = ALLOCATED.load(Ordering::Relaxed) - before;
        let pairs = n * (own_blocks + 32) + 32;
        drop(own);
        let candidates: Vec<_> = (0..n).map(|i| index.slot(&replica(i))).collect();
        let mut out: Vec<PrefixMatch> = Vec::with_capacity(n);
        group.bench_function(format!("64_blocks_{n}_replicas"), |b| {
            b.iter(|| {
                index.match_prefix(black_box(&prompt), &candidates, &mut out);
                black_box(out[0].blocks)
            })
        });
        let mut samples: Vec<std::time::Duration> = (0..runs)
            .map(|_| {
                let start = std::time::Instant::now();
                index.match_prefix(black_box(&prompt), &candidates, &mut out);
                black_box(out[0].blocks);
                start.elapsed()
            })
            .collect();
        samples.sort_unstable();
        assert_eq!(out[0].blocks, 64);
        assert!(out.iter().skip(1).all(|m| m.blocks == 32));
        println!(
            "kvindex/lookup_scale 64 blocks × {n} replicas: p50 {:?}, p99 {:?} over {runs} lookups; \
             index {:.1} MiB for {pairs} (block, replica) pairs = {:.1} bytes per pair",
            samples[samples.len() / 2],
            samples[samples.len() * 99 / 100],
            bytes as f64 / (1 << 20) as f64,
            bytes as f64 / pairs as f64,
        );
    }
    group.finish();
}

fn report_memory(_: &mut Criterion) {
    // A hash table's spare room depends on where its size falls between two growths (hashbrown
    // doubles at 7/8 full), so each shape is measured at sizes spread over one doubling and the
    // mean and the worst are reported.
    let full = std::env::args().any(|a| a == "--bench");
    let sizes: &[usize] = if full {
        &[600_000, 700_000, 800_000, 900_000, 1_000_000, 1_100_000]
    } else {
        &[10_000]
    };
    for replicas_per_block in [1, 2, 4] {
        let mut per_entry = Vec::new();
        for &blocks in sizes {
            // The input is made before counting starts: only the index's own memory is measured.
            let all = hashes(3, blocks);
            let before = ALLOCATED.load(Ordering::Relaxed);
            let index = KvIndex::new(IndexConfig::default());
            for r in 0..replicas_per_block {
                index.stored(&replica(r), &all, Medium::Gpu);
            }
            let bytes = ALLOCATED.load(Ordering::Relaxed) - before;
            let entries = blocks * replicas_per_block;
            per_entry.push(bytes as f64 / entries as f64);
            println!(
                "kvindex/memory ({replicas_per_block} replica(s) per block, {blocks} blocks): {:.1} MiB = {:.1} bytes per (block, replica)",
                bytes as f64 / (1 << 20) as f64,
                bytes as f64 / entries as f64
            );
            drop(index);
        }
        let mean = per_entry.iter().sum::<f64>() / per_entry.len() as f64;
        let worst = per_entry.iter().copied().fold(0.0, f64::max);
        println!(
            "kvindex/memory ({replicas_per_block} replica(s) per block): mean {mean:.1}, worst {worst:.1} bytes per (block, replica) over {} sizes",
            per_entry.len()
        );
    }
}

/// One node's agent reconnecting: a new stream, its Hello and its engine's snapshot.
fn reconnect(
    feed: &mut FeedState,
    index: &KvIndex,
    node: usize,
    snapshot: &pb::Snapshot,
    id: &mut u64,
) -> StreamId {
    let stream = feed.open();
    let engines = vec![pb::EngineInfo::serving(&format!("e{node}"), &replica(node))];
    let hello = pb::agent_message::Body::hello(&format!("n{node}"), "bench", engines);
    for body in [hello, pb::agent_message::Body::Snapshot(snapshot.clone())] {
        *id += 1;
        feed.apply(index, stream, pb::AgentMessage::numbered(*id, body))
            .unwrap();
    }
    stream
}

/// Four nodes of one engine each hold `blocks` blocks; node 0's agent reconnects and restates
/// the same snapshot three times while another thread looks up a 64-block prompt that replica 0
/// holds. Prints the time each restatement took to apply, the lookups' worst latencies, and how
/// many lookups found replica 0 holding less of the prompt than it does (none should).
fn report_restated_snapshot(_: &mut Criterion) {
    let full = std::env::args().any(|a| a == "--bench");
    let blocks = if full { 1_000_000 } else { 10_000 };
    let nodes = 4;
    let configured: NodeMap = (0..nodes)
        .map(|i| (format!("n{i}"), [replica(i)].into()))
        .collect();
    let mut feed = FeedState::new(
        configured,
        Default::default(),
        FeedLimits::default(),
        std::time::Duration::from_secs(30),
        Default::default(),
    );
    let index = KvIndex::new(IndexConfig::default());
    let snapshots: Vec<pb::Snapshot> = (0..nodes)
        .map(|i| pb::Snapshot {
            engine: format!("e{i}"),
            epoch: 0,
            seq: 0,
            blocks: hashes(100 + i as u64, blocks)
                .into_iter()
                .map(|h| pb::Block::copies(h.0, 1))
                .collect(),
            hash_status: 0,
            more: false,
        })
        .collect();
    let mut id = 0;
    let mut stream = reconnect(&mut feed, &index, 0, &snapshots[0], &mut id);
    for (i, snapshot) in snapshots.iter().enumerate().skip(1) {
        reconnect(&mut feed, &index, i, snapshot, &mut id);
    }
    let prompt: Vec<ExternalHash> = snapshots[0].blocks[..64]
        .iter()
        .map(|b| ExternalHash(b.hash))
        .collect();
    let candidates: Vec<_> = (0..nodes).map(|i| index.slot(&replica(i))).collect();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let mut applied = Vec::new();
    let (mut latencies, short) = std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let mut out: Vec<PrefixMatch> = Vec::with_capacity(nodes);
            let (mut latencies, mut short) = (Vec::new(), 0usize);
            while !stop.load(Ordering::Relaxed) {
                let start = std::time::Instant::now();
                index.match_prefix(&prompt, &candidates, &mut out);
                latencies.push(start.elapsed());
                short += usize::from(out[0].blocks < 64);
            }
            (latencies, short)
        });
        for _ in 0..3 {
            feed.close(stream, tokio::time::Instant::now());
            let start = std::time::Instant::now();
            stream = reconnect(&mut feed, &index, 0, &snapshots[0], &mut id);
            applied.push(start.elapsed());
        }
        stop.store(true, Ordering::Relaxed);
        reader.join().unwrap()
    });
    latencies.sort_unstable();
    let quantile = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    println!(
        "feed/restated_snapshot ({blocks} blocks, {nodes} replicas): applied in {applied:?}; \
         {} lookups meanwhile: p99 {:?}, p99.9 {:?}, max {:?}; {short} found replica 0 short",
        latencies.len(),
        quantile(0.99),
        quantile(0.999),
        quantile(1.0),
    );
    assert_eq!(index.replica_block_count(&replica(0)), blocks as u64);
}

criterion_group!(
    benches,
    bench_apply,
    bench_lookup,
    bench_lookup_scale,
    report_memory,
    report_restated_snapshot
);
criterion_main!(benches);
