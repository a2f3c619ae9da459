//! A whole routing decision (parse → cached tokenization → hash → index lookup → score → pick)
//! for a ~2,000-token completion over 16 replicas, one of which holds the whole prompt.
//!
//! `cargo bench -p llmgw --bench decision`: criterion's mean, then p50/p99 over 20,000 timed
//! decisions (printed), since the target is a tail latency.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a bench or test harness: a panic is a failed run, not a crashed router"
)]

use std::hint::black_box;
use std::num::NonZeroUsize;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use llmgw::blockhash::{BlockHasher, HashSettings};
use llmgw::kvindex::{IndexConfig, KvEventSink, KvIndex, Medium};
use llmgw::models::HashersByModel;
use llmgw::openai::{EndpointKind, parse_request};
use llmgw::pool::{Health, Pool, ReplicaSpec};
use llmgw::scheduler::{PluginResources, Scheduler, SchedulerArgs, SchedulerConfig, Scope};
use llmgw::tokenize::{LocalTokenizer, Tokenizer, TokenizerConfig};

const REPLICAS: usize = 16;

struct Setup {
    scheduler: Scheduler,
    body: Vec<u8>,
}

fn setup() -> Setup {
    let tokenizer_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("sim/assets/tokenizer.json");
    let local = LocalTokenizer::from_file(&tokenizer_path).expect("tokenizer");
    let words: Vec<String> = (0..700).map(|i| format!("clause{i}")).collect();
    let prompt = format!("You are a careful assistant. {}", words.join(" "));
    let tokens = local.encode_prompt(&prompt).expect("encodes");

    let hasher = BlockHasher::new(&HashSettings::sha256_cbor(
        NonZeroUsize::new(16).expect("nonzero"),
        Some("0"),
    ))
    .expect("hasher");
    let mut hashes = Vec::new();
    hasher.external_hashes_into(&tokens, None, &mut hashes);

    let specs: Vec<ReplicaSpec> = (0..REPLICAS)
        .map(|i| ReplicaSpec {
            address: format!("10.0.0.{}:8000", i + 1).parse().expect("addr"),
            models: vec!["m".to_owned()],
            node: None,
        })
        .collect();
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    for (i, spec) in specs.iter().enumerate() {
        // Replica 5 holds the whole prompt; the others a little of it and much else.
        let held = if i == 5 {
            hashes.len()
        } else {
            i.min(hashes.len())
        };
        index.stored(&spec.address.to_string(), &hashes[..held], Medium::Gpu);
        let other: Vec<_> = (0..5_000u64)
            .map(|k| llmgw::blockhash::ExternalHash(k * 1_000 + i as u64))
            .collect();
        index.stored(&spec.address.to_string(), &other, Medium::Gpu);
    }
    let pool = Arc::new(Pool::new(specs, Duration::from_secs(5)));
    for replica in pool.snapshot().replicas() {
        replica.set_health(Health::Healthy);
    }
    let resources = PluginResources {
        index,
        // A deadline no loaded machine misses: the first decision tokenizes in process (a debug
        // build under `cargo test` beside other work once took longer than the default, and the
        // tree decided), and the measured ones hit the cache.
        tokenizer: Arc::new(
            Tokenizer::new(TokenizerConfig {
                deadline: Duration::from_secs(60),
                ..TokenizerConfig::default()
            })
            .with_local("m", local),
        ),
        hashers: Arc::new(HashersByModel::from([("m".to_owned(), Arc::new(hasher))])),
        picks: Arc::default(),
    };
    let mut config = SchedulerConfig::default();
    config
        .apply(&SchedulerArgs {
            // Keep the speculative entries out of the measurement: each pick would add one.
            speculative_ttl: Some(Duration::ZERO),
            ..SchedulerArgs::default()
        })
        .expect("flags apply");
    let scheduler = Scheduler::build(
        pool,
        &config,
        &resources,
        &mut prometheus_client::registry::Registry::default(),
    )
    .expect("default profile");
    let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 16})
        .to_string()
        .into_bytes();
    Setup { scheduler, body }
}

async fn decide(setup: &Setup) -> String {
    let request = parse_request(EndpointKind::Completions, &setup.body).expect("parses");
    let decision = setup
        .scheduler
        .decide(&request, &[], Scope::default())
        .await
        .expect("decides");
    decision.primary().endpoint().to_owned()
}

fn bench_decision(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let setup = setup();
    // Warm the tokenization cache, and check the decision is the one the index supports.
    assert_eq!(runtime.block_on(decide(&setup)), "10.0.0.6:8000");

    c.bench_function("decision/cached_tokens_2k_tokens_16_replicas", |b| {
        b.iter(|| black_box(runtime.block_on(decide(&setup))))
    });

    // `cargo bench` passes --bench; under `cargo test` a short run only checks that it works.
    let runs = if std::env::args().any(|a| a == "--bench") {
        20_000
    } else {
        50
    };
    let mut samples: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            black_box(runtime.block_on(decide(&setup)));
            start.elapsed()
        })
        .collect();
    samples.sort_unstable();
    let pct = |p: f64| samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)];
    println!(
        "decision/cached_tokens_2k_tokens_16_replicas: p50 {:?}, p99 {:?}, max {:?} over {} decisions",
        pct(0.50),
        pct(0.99),
        samples[samples.len() - 1],
        samples.len()
    );
}

criterion_group!(benches, bench_decision);
criterion_main!(benches);
