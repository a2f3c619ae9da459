//! A fixed amount of decode + mirror work, for instruction-counting profilers (callgrind counts
//! reliably on a shared machine where criterion's times do not):
//!
//! ```sh
//! cargo build --profile bench -p llmgw-agent --example decode_mirror_profile
//! valgrind --tool=callgrind target/release/examples/decode_mirror_profile capture 200
//! ```
//!
//! Prints the block events processed; instructions / block events is the figure of merit.
//! Workloads: `capture` (the recorded vLLM 0.32.0 stream), `steady-map`, `steady-array` (the
//! synthetic one-block events of `benches/decode_mirror.rs`).

use std::hint::black_box;

use llmgw_agent::capture::Capture;
use llmgw_agent::mirror::Mirror;
use llmgw_agent::wire::{
    BlockRemoved, BlockStored, EventBatch, EventForm, ExternalHash, KvEvent, Medium, Value,
    decode_batch, encode_batch,
};

/// The same synthetic steady state as the criterion bench.
fn steady(form: EventForm, batches: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::with_capacity(batches);
    let mut next = 1u64;
    for b in 0..batches {
        let mut events = Vec::with_capacity(64);
        for _ in 0..32 {
            let h = next.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            events.push(KvEvent::BlockStored(BlockStored {
                block_hashes: vec![ExternalHash(h)],
                parent_block_hash: Some(ExternalHash(h ^ 1)),
                token_ids: (0..32).map(|t| (t * 97 + next as u32) % 50_000).collect(),
                block_size: 32,
                medium: Some(Medium::Gpu),
                extra_keys: Some(vec![Value::Nil]),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                ..BlockStored::default()
            }));
            if next > 64 {
                let old = (next - 64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                events.push(KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![ExternalHash(old)],
                    medium: Some(Medium::Gpu),
                    group_idx: Some(0),
                    ..BlockRemoved::default()
                }));
            }
            next += 1;
        }
        let batch = EventBatch {
            ts: 1.7e9 + b as f64,
            events,
            dp_rank: Some(0),
        };
        out.push(encode_batch(&batch, form));
    }
    out
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let workload = args.next().unwrap_or_else(|| "capture".to_owned());
    let rounds: usize = args.next().map_or(Ok(200), |s| s.parse())?;
    let payloads: Vec<Vec<u8>> = match workload.as_str() {
        "capture" => Capture::parse(&llmgw::fixtures::read("vllm-0.32.0-capture.jsonl"))?
            .frames
            .into_iter()
            .map(|f| f.payload)
            .collect(),
        "steady-map" => steady(EventForm::TaggedMap, 32),
        "steady-array" => steady(EventForm::TaggedArray, 32),
        other => anyhow::bail!("unknown workload {other:?}"),
    };
    let mut mirror = Mirror::new();
    let mut events = 0u64;
    for _ in 0..rounds {
        for p in &payloads {
            if let Ok(batch) = decode_batch(black_box(p)) {
                for e in &batch.events {
                    let a = mirror.apply(e);
                    events += (a.stored + a.removed + a.unknown_removed) as u64;
                }
            }
        }
        black_box(mirror.take_delta());
    }
    println!("{workload}: {rounds} rounds, {events} block events");
    Ok(())
}
