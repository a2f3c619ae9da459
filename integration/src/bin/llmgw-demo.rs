//! `make run`: the whole system on loopback — Envoy, llmgw-router, llmgw-agent and simulated
//! vLLM replicas with small caches — driven by a multi-tenant chat workload, with live progress
//! and a closing table (the engines' hit rates beside what llmgw expected), then the same
//! workload through Envoy round robin alone for comparison. Ctrl-C stops the workload early
//! (and skips the comparison); every process is stopped on exit.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use llmgw_integration::envoy::{EnvoyCommand, plain_envoy_config};
use llmgw_integration::free_port;
use llmgw_integration::system::{self, SystemConfig};
use llmgw_integration::workload::{self, Results, WorkloadConfig};
use parking_lot::Mutex;

#[derive(Parser)]
#[command(
    name = "llmgw-demo",
    about = "Run llmgw end to end on simulated replicas"
)]
struct Args {
    /// Simulated vLLM replicas.
    #[arg(long, default_value_t = 4)]
    replicas: usize,
    /// KV-cache blocks per replica (16 tokens each): small, so routing matters.
    #[arg(long, default_value_t = 160)]
    blocks_per_replica: usize,
    /// How long to drive the workload, in seconds.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Conversations in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Tenants, each with its own long system prompt (the last one salts its requests).
    #[arg(long, default_value_t = 4)]
    tenants: usize,
    /// The router's tokenization deadline. Generous by default: here the replicas share two
    /// cores with everything else, while a GPU-backed vLLM answers /tokenize in a few ms.
    #[arg(long, default_value = "300ms")]
    tokenize_deadline: String,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    runtime.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    println!(
        "starting {} llmgw-sim replicas, llmgw-router, llmgw-agent and Envoy on 127.0.0.1 …",
        args.replicas
    );
    let system = system::start(SystemConfig {
        replicas: args.replicas,
        blocks_per_replica: args.blocks_per_replica,
        router_args: vec![
            "--tokenize-deadline".to_owned(),
            args.tokenize_deadline.clone(),
        ],
        ..SystemConfig::default()
    })
    .await;
    println!(
        "  Envoy (send requests here): {}",
        system.url("/v1/chat/completions")
    );
    println!(
        "  llmgw-router: ext_proc {}, admin http://{}/metrics, feed {}",
        system.router.grpc, system.router.admin, system.router.feed
    );
    for (i, sim) in system.sims.iter().enumerate() {
        println!("  replica {i}: {}", sim.url());
    }
    println!(
        "driving {} tenants × multi-turn chats, {} at a time, for {} s (Ctrl-C stops early) …\n",
        args.tenants, args.concurrency, args.seconds
    );

    let results = Arc::new(Mutex::new(Results::default()));
    let progress = tokio::spawn(print_progress(Arc::clone(&results), system.replicas()));
    let config = config_for(&args);
    let interrupted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = Arc::clone(&interrupted);
    workload::run(system.url(""), config, Arc::clone(&results), async move {
        let _ = tokio::signal::ctrl_c().await;
        flag.store(true, std::sync::atomic::Ordering::Relaxed);
    })
    .await;
    progress.abort();
    if interrupted.load(std::sync::atomic::Ordering::Relaxed) {
        println!("\ninterrupted: stopping the workload");
    }

    let final_results = std::mem::take(&mut *results.lock());
    print_summary(&system, &final_results).await;
    if !interrupted.load(std::sync::atomic::Ordering::Relaxed) {
        round_robin_baseline(&system, &config_for(&args)).await?;
    }
    println!("\nstopping Envoy, llmgw-agent, llmgw-router and the replicas.");
    drop(system);
    Ok(())
}

fn config_for(args: &Args) -> WorkloadConfig {
    WorkloadConfig {
        tenants: args.tenants,
        concurrency: args.concurrency,
        duration: Duration::from_secs(args.seconds),
        ..WorkloadConfig::default()
    }
}

/// The same workload on the same replicas, their caches emptied first, through an Envoy that
/// balances round robin on its own: what llmgw's routing buys, in one line.
async fn round_robin_baseline(
    system: &system::System,
    config: &WorkloadConfig,
) -> anyhow::Result<()> {
    println!(
        "\nnow the same workload through Envoy round robin (no llmgw), caches emptied first, {} s …",
        config.duration.as_secs()
    );
    let http = reqwest::Client::new();
    workload::reset_prefix_caches(&http, &system.sims).await;
    let (listen, admin) = (free_port(), free_port());
    let envoy = EnvoyCommand::new(
        "demo-round-robin",
        plain_envoy_config("ROUND_ROBIN", listen, admin, &system.replicas()),
        listen,
        admin,
    )
    .spawn()
    .context("start the round-robin Envoy")?;
    if !envoy.ready(Duration::from_secs(30)).await {
        anyhow::bail!("the round-robin Envoy was not ready within 30 s");
    }
    let before = workload::cache_counters(&http, &system.sims).await;
    let results = Arc::new(Mutex::new(Results::default()));
    workload::run(
        envoy.url(""),
        config.clone(),
        Arc::clone(&results),
        std::future::pending(),
    )
    .await;
    let after = workload::cache_counters(&http, &system.sims).await;
    let results = results.lock();
    let ttft = results
        .ttft_percentile(50.0)
        .map_or("-".to_owned(), |d| format!("{:.1} ms", ms(d)));
    println!(
        "Envoy round robin, same conversations: prefix-cache hit rate {:.1} % over {} requests \
         ({} errors), TTFT p50 {ttft}",
        percent(after.0 - before.0, after.1 - before.1),
        results.samples.len(),
        results.errors.len(),
    );
    Ok(())
}

async fn print_progress(results: Arc<Mutex<Results>>, replicas: Vec<std::net::SocketAddr>) {
    let started = Instant::now();
    let mut ticker = tokio::time::interval(Duration::from_secs(2));
    ticker.tick().await;
    loop {
        ticker.tick().await;
        let r = results.lock();
        let per = r.per_replica();
        let spread: Vec<String> = replicas
            .iter()
            .map(|a| per.get(&a.to_string()).copied().unwrap_or(0).to_string())
            .collect();
        println!(
            "[{:>3.0}s] {} requests ({:.1}/s), {} errors; per replica [{}]; TTFT p50 {}",
            started.elapsed().as_secs_f64(),
            r.samples.len(),
            r.samples.len() as f64 / started.elapsed().as_secs_f64(),
            r.errors.len(),
            spread.join(" "),
            r.ttft_percentile(50.0)
                .map_or("-".to_owned(), |d| format!("{:.1} ms", ms(d))),
        );
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

async fn get_text(url: String) -> String {
    workload::get_text(&reqwest::Client::new(), &url).await
}

/// `part / whole` in percent, 0 for an empty whole.
fn percent(part: f64, whole: f64) -> f64 {
    if whole > 0.0 {
        part / whole * 100.0
    } else {
        0.0
    }
}

async fn print_summary(system: &system::System, results: &Results) {
    let per = results.per_replica();
    let metrics = get_text(format!("http://{}/metrics", system.router.admin)).await;
    let by_replica = |family| llmgw_integration::prom::by_label(&metrics, family, "replica");
    let expected = by_replica("llmgw_expected_cached_tokens_total");
    let routed = by_replica("llmgw_routed_prompt_tokens_total");
    let drift = by_replica("llmgw_cache_drift_ratio");
    println!(
        "\n| replica | requests | prefix-cache hit rate (sim's own vllm:prefix_cache_*) | expected by llmgw | drift |"
    );
    println!("|---|---:|---:|---:|---:|");
    let (mut all_hits, mut all_queries) = (0.0, 0.0);
    for sim in &system.sims {
        let (hits, queries) =
            workload::prefix_cache_counts(&get_text(format!("{}/metrics", sim.url())).await);
        all_hits += hits;
        all_queries += queries;
        let replica = sim.addr.to_string();
        let of = |map: &std::collections::BTreeMap<String, f64>| map.get(&replica).copied();
        println!(
            "| {} | {} | {:.1} % | {:.1} % | {} |",
            sim.addr,
            per.get(&replica).copied().unwrap_or(0),
            percent(hits, queries),
            percent(of(&expected).unwrap_or(0.0), of(&routed).unwrap_or(0.0)),
            of(&drift).map_or("-".to_owned(), |d| format!("{d:.2}")),
        );
    }
    let total_rate = percent(all_hits, all_queries);
    let total_expected = percent(expected.values().sum(), routed.values().sum());
    println!(
        "| all | {} | {total_rate:.1} % | {total_expected:.1} % | |",
        results.samples.len()
    );
    println!(
        "(expected: the prompt tokens llmgw's KV index said each replica held, of those it sent \
         there; drift: how far the two hit rates are apart, 0 to 1, over the last minute)"
    );
    let pct = |p| {
        results
            .ttft_percentile(p)
            .map_or("-".to_owned(), |d| format!("{:.1} ms", ms(d)))
    };
    println!(
        "\nTTFT (first streamed token, through Envoy): p50 {}, p90 {}",
        pct(50.0),
        pct(90.0)
    );
    println!(
        "errors: {}{}",
        results.errors.len(),
        results
            .errors
            .first()
            .map(|e| format!(" (first: {e})"))
            .unwrap_or_default()
    );

    println!("\nwhich tier decided (llmgw-router /metrics):");
    for (family, tier) in [
        ("llmgw_kv_decisions_total", "precise KV index"),
        ("llmgw_prefix_decisions_total", "approximate prefix tree"),
        (
            "llmgw_cold_placements_total",
            "new prompts placed by cache footprint",
        ),
    ] {
        let counted = llmgw_integration::prom::counted_by_label(&metrics, family, "decision");
        println!(
            "  {tier}: {}",
            if counted.is_empty() { "none" } else { &counted }
        );
    }
    let guard = metrics
        .lines()
        .find(|l| l.starts_with("llmgw_imbalance_guard_total "))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap_or("0");
    println!("  load over affinity (imbalance guard): {guard}");
}
