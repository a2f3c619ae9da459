//! `make run`: the whole system on loopback — Envoy, llmgw-router, llmgw-agent and simulated
//! vLLM replicas with small caches — driven by a multi-tenant chat workload, with live progress
//! and a closing table. Ctrl-C stops the workload early; every process is stopped on exit.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
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
    let config = WorkloadConfig {
        tenants: args.tenants,
        concurrency: args.concurrency,
        duration: Duration::from_secs(args.seconds),
        ..WorkloadConfig::default()
    };
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
    println!("\nstopping Envoy, llmgw-agent, llmgw-router and the replicas.");
    drop(system);
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
    match reqwest::get(url).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

async fn print_summary(system: &system::System, results: &Results) {
    let per = results.per_replica();
    println!("\n| replica | requests | prefix-cache hit rate (sim's own vllm:prefix_cache_*) |");
    println!("|---|---:|---:|");
    let (mut all_hits, mut all_queries) = (0.0, 0.0);
    for sim in &system.sims {
        let (hits, queries) =
            workload::prefix_cache_counts(&get_text(format!("{}/metrics", sim.url())).await);
        all_hits += hits;
        all_queries += queries;
        let rate = if queries > 0.0 {
            hits / queries * 100.0
        } else {
            0.0
        };
        println!(
            "| {} | {} | {rate:.1} % |",
            sim.addr,
            per.get(&sim.addr.to_string()).copied().unwrap_or(0)
        );
    }
    let total_rate = if all_queries > 0.0 {
        all_hits / all_queries * 100.0
    } else {
        0.0
    };
    println!("| all | {} | {total_rate:.1} % |", results.samples.len());
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

    let metrics = get_text(format!("http://{}/metrics", system.router.admin)).await;
    println!("\nwhich tier decided (llmgw-router /metrics):");
    for (family, tier) in [
        ("llmgw_kv_decisions_total", "precise KV index"),
        ("llmgw_prefix_decisions_total", "approximate prefix tree"),
    ] {
        let counts = llmgw_integration::prom::by_label(&metrics, family, "decision");
        let text: Vec<String> = counts.iter().map(|(k, v)| format!("{k} {v:.0}")).collect();
        println!(
            "  {tier}: {}",
            if text.is_empty() {
                "none".to_owned()
            } else {
                text.join(", ")
            }
        );
    }
    let guard = metrics
        .lines()
        .find(|l| l.starts_with("llmgw_imbalance_guard_total "))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap_or("0");
    println!("  load over affinity (imbalance guard): {guard}");
}
