//! `make bench-scale`: router and agent memory and CPU, and routing-decision latency, at 4, 64
//! and 256 replicas (synthetic engines; see `llmgw_bench::scale` for what runs and
//! how each number is taken). Prints a Markdown table; `--json` also writes the raw reports.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use llmgw_bench::scale::{self, ScaleConfig};

#[derive(Parser)]
#[command(about = "llmgw-router and llmgw-agent resources and decision latency as replicas grow")]
struct Args {
    /// Replica counts, one run each.
    #[arg(long, value_delimiter = ',', default_value = "4,64,256")]
    replicas: Vec<usize>,
    /// Engines per agent (GPUs per node): one agent process per this many replicas.
    #[arg(long, default_value_t = 8)]
    engines_per_agent: usize,
    /// Blocks each replica's cache holds (16 tokens each).
    #[arg(long, default_value_t = 8192)]
    blocks_per_replica: usize,
    /// Steady-state block events per second per replica (half stores, half removals).
    #[arg(long, default_value_t = 200.0)]
    event_rate: f64,
    /// Seconds of the quiet window (no events, no requests).
    #[arg(long, default_value_t = 5.0)]
    quiet_secs: f64,
    /// Seconds of the steady event window.
    #[arg(long, default_value_t = 10.0)]
    steady_secs: f64,
    /// Routing requests per run.
    #[arg(long, default_value_t = 1000)]
    lookups: usize,
    /// Routing requests per second (sent one at a time; 0 = back to back).
    #[arg(long, default_value_t = 200.0)]
    lookup_rate: f64,
    /// Extra `llmgw-router serve` flags.
    #[arg(long = "router-arg", allow_hyphen_values = true)]
    router_args: Vec<String>,
    /// Also write the reports as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = llmgw_bench::client_runtime()?;
    let mut reports = Vec::new();
    for &replicas in &args.replicas {
        let config = ScaleConfig {
            replicas,
            engines_per_agent: args.engines_per_agent,
            blocks_per_replica: args.blocks_per_replica,
            event_rate: args.event_rate,
            quiet: Duration::from_secs_f64(args.quiet_secs),
            steady: Duration::from_secs_f64(args.steady_secs),
            lookups: args.lookups,
            lookup_rate: args.lookup_rate,
            router_args: args.router_args.clone(),
            ..ScaleConfig::default()
        };
        eprintln!("bench-scale: {replicas} replicas…");
        let report = runtime.block_on(scale::run(&config))?;
        eprintln!(
            "bench-scale: {replicas} replicas: index {} pairs / {} distinct (published {} / {}), \
             filled in {:.1} s",
            report.index_pairs,
            report.index_distinct,
            report.published_pairs,
            report.published_distinct,
            report.fill_s
        );
        reports.push(report);
    }
    println!("\n{}", scale::markdown_table(&reports));
    println!(
        "Synthetic engines (ZMQ PUB in this process, vLLM-format batches, sha256_cbor block \
         hashes, block size {}), each with an idle /health and /metrics endpoint; one llmgw-agent \
         per {} engines; a release llmgw-router with default probe intervals. Fill: {} blocks \
         per replica (4 of 32 shared 32-block system prompts, then 32-block conversations). \
         Quiet window {:.0} s (probes only); {} routing requests at {} req/s over ext_proc gRPC \
         (token-id prompts of {} blocks, one replica holding all, others the system prompt); \
         steady window {:.0} s at {} block events/s per replica. CPU: /proc/PID/stat \
         utime+stime, % of one core; RSS: /proc/PID/status VmRSS (VmHWM).",
        scale::BLOCK_SIZE,
        args.engines_per_agent,
        args.blocks_per_replica,
        args.quiet_secs,
        args.lookups,
        args.lookup_rate,
        reports.first().map_or(0, |r| r.prompt_blocks),
        args.steady_secs,
        args.event_rate,
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&reports)?)?;
        println!("wrote {}", path.display());
    }
    let bad: Vec<usize> = reports
        .iter()
        .filter(|r| r.replicas_matching_after_fill != r.replicas)
        .map(|r| r.replicas)
        .collect();
    anyhow::ensure!(
        bad.is_empty(),
        "the router's index never matched the generator at {bad:?} replicas"
    );
    Ok(())
}
