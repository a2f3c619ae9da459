//! Decode + mirror throughput, counted in block events (one per hash in a BlockStored or
//! BlockRemoved). `cargo bench -p llmgw-agent --bench decode_mirror`.
//!
//! * `capture`: the recorded vLLM 0.32.0 stream (26 batches, map-form events, 32-token blocks).
//! * `steady/{map,array}`: a synthetic steady state of one-block stores and removes (the shape
//!   decode steps produce), 64 events per batch, in both event encodings.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a bench or test harness: a panic is a failed run, not a crashed router"
)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use llmgw_agent::capture::Capture;
use llmgw_agent::mirror::Mirror;
use llmgw_agent::wire::{EventBatch, EventForm, KvEvent, decode_batch};

mod support;
use support::steady;

fn block_events(batch: &EventBatch) -> u64 {
    batch
        .events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => s.block_hashes.len() as u64,
            KvEvent::BlockRemoved(r) => r.block_hashes.len() as u64,
            _ => 0,
        })
        .sum()
}

fn run(c: &mut Criterion, name: &str, payloads: &[Vec<u8>]) {
    let events: u64 = payloads
        .iter()
        .map(|p| block_events(&decode_batch(p).expect("bench payload decodes")))
        .sum();
    let mut g = c.benchmark_group(name);
    g.throughput(Throughput::Elements(events));
    g.bench_function("decode", |b| {
        b.iter(|| {
            for p in payloads {
                black_box(decode_batch(black_box(p)).ok());
            }
        })
    });
    g.bench_function("decode+mirror", |b| {
        let mut mirror = Mirror::new();
        b.iter(|| {
            for p in payloads {
                if let Ok(batch) = decode_batch(black_box(p)) {
                    for e in &batch.events {
                        mirror.apply(e);
                    }
                }
            }
            black_box(mirror.take_delta());
        })
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    let capture = Capture::parse(&llmgw::fixtures::read("vllm-0.32.0-capture.jsonl"))
        .expect("capture parses");
    let frames: Vec<Vec<u8>> = capture.frames.into_iter().map(|f| f.payload).collect();
    run(c, "capture", &frames);
    run(c, "steady/map", &steady(EventForm::TaggedMap, 32));
    run(c, "steady/array", &steady(EventForm::TaggedArray, 32));
}

criterion_group!(group, benches);
criterion_main!(group);
