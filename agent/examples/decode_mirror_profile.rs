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
use llmgw_agent::wire::{EventForm, decode_batch};

/// The criterion bench's synthetic steady state.
#[path = "../benches/support/mod.rs"]
mod support;
use support::steady;

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
