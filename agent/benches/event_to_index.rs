//! Event-to-router-index latency: from a vLLM-format batch published on a real ZMQ PUB socket
//! to the moment the router's `KvIndex` holds its block, through the whole real path in one
//! process: ZMQ SUB intake → decode → mirror (default 20 ms coalescing window) → gRPC uplink
//! over loopback TCP → the router's feed service → `KvIndex`.
//!
//! ```sh
//! cargo bench -p llmgw-agent --bench event_to_index              # 2,000 events, ~12 s
//! cargo bench -p llmgw-agent --bench event_to_index -- --events 5000 --window-ms 20
//! ```
//!
//! Events are one-block `BlockStored`s (32 tokens, with a parent, as decode steps produce them)
//! published at random intervals (uniform 0–2×`--gap-ms`, default mean 5 ms), so they land at
//! every phase of the coalescing window. The arrival time is taken inside the index's sink
//! wrapper right after `KvIndex::stored` returns. Goal: p99 ≤ 25 ms at the default window.
//! Under `cargo test` (no `--bench` argument) it is a short smoke run and no goal is judged.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use llmgw::blockhash::ExternalHash;
use llmgw::feed::{FeedConfig, FeedService};
use llmgw::kvindex::{IndexConfig, KvEventSink, KvIndex, Medium};
use llmgw_agent::config::{AgentArgs, EngineSpec};
use llmgw_agent::daemon::Agent;
use llmgw_agent::uplink::{self, UplinkConfig};
use llmgw_agent::wire::{self, BlockStored, EventBatch, EventForm, KvEvent};
use llmgw_agent::zmq::Publisher;
use parking_lot::Mutex;

const REPLICA: &str = "10.0.0.5:8000";
const GOAL_P99: Duration = Duration::from_millis(25);

/// The real index, noting when each block hash first arrives.
struct TimedIndex {
    index: KvIndex,
    arrived: Mutex<HashMap<u64, Instant>>,
}

impl KvEventSink for TimedIndex {
    fn stored_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        self.index.stored_copies(replica, blocks, medium);
        let now = Instant::now();
        let mut arrived = self.arrived.lock();
        for (h, _) in blocks {
            arrived.entry(h.0).or_insert(now);
        }
    }
    fn removed_copies(&self, replica: &str, blocks: &[(ExternalHash, u32)], medium: Medium) {
        self.index.removed_copies(replica, blocks, medium);
    }
    fn cleared(&self, replica: &str) {
        self.index.cleared(replica);
    }
}

struct Options {
    events: usize,
    gap: Duration,
    window_ms: u64,
    judged: bool,
}

fn options() -> Options {
    let args: Vec<String> = std::env::args().collect();
    let judged = args.iter().any(|a| a == "--bench");
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    Options {
        events: value("--events").map_or(if judged { 2000 } else { 40 }, |n| n as usize),
        gap: Duration::from_millis(value("--gap-ms").unwrap_or(5)),
        window_ms: value("--window-ms").unwrap_or(20),
        judged,
    }
}

/// A small deterministic generator (the bench needs no statistical quality).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

fn payload(hash: u64, parent: u64, ts: f64) -> Vec<u8> {
    let batch = EventBatch {
        ts,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: vec![ExternalHash(hash)],
            parent_block_hash: Some(ExternalHash(parent)),
            token_ids: (0..32).map(|t| (hash as u32 ^ t) % 50_000).collect(),
            block_size: 32,
            medium: Some(wire::Medium::Gpu),
            extra_keys: Some(vec![wire::Value::Nil]),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            ..BlockStored::default()
        })],
        dp_rank: Some(0),
    };
    wire::encode_batch(&batch, EventForm::TaggedMap)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

async fn run(opts: Options) -> anyhow::Result<()> {
    // The router: the real index behind the real feed service on a loopback port.
    let sink = Arc::new(TimedIndex {
        index: KvIndex::new(IndexConfig::default()),
        arrived: Mutex::default(),
    });
    let nodes = [("n1".to_owned(), [REPLICA.to_owned()].into_iter().collect())]
        .into_iter()
        .collect();
    let feed = FeedService::new(
        Arc::clone(&sink) as Arc<dyn KvEventSink>,
        FeedConfig {
            limits: llmgw::feed::FeedLimits::default(),
            token: None,
            nodes,
            grace: Duration::from_secs(60),
            silence: llmgw::feed::DEFAULT_SILENCE,
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let router_addr = listener.local_addr()?.to_string();
    let server = tokio::spawn(feed.clone().serve_with_listener(listener));

    // The engine's PUB (with a replay socket, as vLLM offers) and the agent mirroring it.
    let mut publisher = Publisher::on_loopback("kv", true, 10_000).await?;
    let replay = publisher
        .replay_endpoint
        .clone()
        .ok_or_else(|| anyhow::anyhow!("publisher has no replay endpoint"))?;
    let spec: EngineSpec = format!("{REPLICA}={},replay={replay}", publisher.endpoint).parse()?;
    let config = AgentArgs {
        node: Some("n1".into()),
        engines: vec![spec],
        topic: Some("kv".into()),
        window_ms: Some(opts.window_ms),
        stale_after_ms: Some(0),
        ..AgentArgs::default()
    }
    .resolve()?;
    let agent = Arc::new(Agent::start(config).await?);
    let uplink = tokio::spawn(uplink::run(
        Arc::clone(&agent),
        UplinkConfig::new(router_addr, None),
    ));

    // Warm up: publish until blocks arrive (the SUB joins late, the uplink connects).
    let mut rng = SplitMix(0x5eed);
    let mut seq = 0u64;
    let mut parent = rng.next();
    let warm_until = Instant::now() + Duration::from_secs(20);
    loop {
        let h = rng.next();
        publisher
            .publish(seq, &payload(h, parent, unix_now()))
            .await?;
        seq += 1;
        parent = h;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if sink.arrived.lock().contains_key(&h) {
            break;
        }
        anyhow::ensure!(Instant::now() < warm_until, "no block reached the index");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Measure.
    let mut sent: Vec<(u64, Instant)> = Vec::with_capacity(opts.events);
    let max_gap_us = u64::try_from(opts.gap.as_micros() * 2)
        .unwrap_or(u64::MAX)
        .max(1);
    for _ in 0..opts.events {
        let h = rng.next();
        let bytes = payload(h, parent, unix_now());
        let t0 = Instant::now();
        publisher.publish(seq, &bytes).await?;
        sent.push((h, t0));
        seq += 1;
        parent = h;
        tokio::time::sleep(Duration::from_micros(rng.next() % max_gap_us)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let all_arrived = {
            let arrived = sink.arrived.lock();
            sent.iter().all(|(h, _)| arrived.contains_key(h))
        };
        if all_arrived {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let arrived = sink.arrived.lock().clone();
    let mut latencies: Vec<Duration> = sent
        .iter()
        .filter_map(|(h, t0)| arrived.get(h).map(|t1| t1.saturating_duration_since(*t0)))
        .collect();
    let lost = sent.len() - latencies.len();
    let held: std::collections::HashSet<u64> = sink
        .index
        .replica_blocks(REPLICA)
        .into_iter()
        .map(|h| h.0)
        .collect();
    let missing = sent.iter().filter(|(h, _)| !held.contains(h)).count();
    latencies.sort_unstable();

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let p99 = percentile(&latencies, 99.0);
    println!(
        "event_to_index: {} events (window {} ms, mean gap {:?}): p50 {:.2} ms, p90 {:.2} ms, \
         p99 {:.2} ms, max {:.2} ms, mean {:.2} ms; {} never arrived, {} not in the index",
        latencies.len(),
        opts.window_ms,
        opts.gap,
        ms(percentile(&latencies, 50.0)),
        ms(percentile(&latencies, 90.0)),
        ms(p99),
        ms(latencies.last().copied().unwrap_or_default()),
        ms(latencies.iter().sum::<Duration>()) / latencies.len().max(1) as f64,
        lost,
        missing,
    );
    if opts.judged && opts.window_ms == 20 {
        let met = p99 <= GOAL_P99 && lost == 0 && missing == 0;
        println!(
            "goal p99 ≤ {} ms at the default window: {}",
            GOAL_P99.as_millis(),
            if met { "met" } else { "MISSED" }
        );
    }
    anyhow::ensure!(lost == 0, "{lost} events never reached the index");
    uplink.abort();
    feed.shutdown();
    server.abort();
    drop(agent);
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let opts = options();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(opts))
}
