//! `make bench-overhead`: the latency llmgw adds to a request, and the router CPU it costs.
//!
//! Two `llmgw-sim` replicas (no simulated latency), one `llmgw-router`, one
//! `llmgw-extproc-floor`, and five Envoys on loopback, all started here:
//! * **baseline**: Envoy → replica, round robin, no ext_proc;
//! * **floor**: `envoy/envoy.yaml` with `llmgw-extproc-floor` in the router's place: llmgw's
//!   protocol layer with a round-robin picker that reads nothing. What it adds is what an
//!   ext_proc exchange itself costs on this machine; `buffered` minus `floor` is the cost of
//!   llmgw's routing (parsing, scheduling, accounting);
//! * **buffered**: `envoy/envoy.yaml` (ext_proc BUFFERED → llmgw → override_host);
//! * **streamed**: the same with the body STREAMED and
//!   `send_body_without_waiting_for_header_response` (one round trip: llmgw holds the header
//!   answer until the body is complete);
//! * **full_duplex**: `envoy/envoy-original-dst.yaml` (FULL_DUPLEX_STREAMED both ways).
//!
//! For each prompt size, requests go out open-loop at a fixed rate, the paths interleaved
//! so that they share the machine's state; each path's p50/p99 is reported and the added latency
//! is the difference from the baseline's. Then, for the CPU, each routed path runs alone at the
//! same rate: server CPU per request is the CPU time of the process that answers ext_proc (all
//! threads, from /proc: the router, or the floor server for `floor`) during those requests,
//! minus its idle CPU (health checks and scrapes) over a window of the same length, divided by
//! the requests (`router_cpu_us_per_request` in the JSON). Two numbers from the router's own
//! metrics over the same requests: decision CPU, `llmgw_pick_cpu_seconds` (the CPU time of
//! parse + scheduling, waiting and preemption excluded), and the wall-clock mean pick,
//! `llmgw_pick_duration_seconds`.
//!
//! The HTTP client is a minimal HTTP/1.1 keep-alive client over TCP, so that the client's own
//! cost stays small and identical for every path.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use llmgw_bench::gateway::{
    Client, Processor, baseline_config, check_answered, pick_stats, process_cpu, repo_config,
    size_label, start_envoy, start_floor, summary, wait_ready,
};
use llmgw_integration::router::RouterCommand;
use llmgw_integration::{envoy_config_over_uds, envoy_config_streamed_ahead, free_port, spawn_sim};
use parking_lot::Mutex;

#[derive(Parser)]
#[command(about = "Latency and CPU llmgw adds over Envoy → replica")]
struct Args {
    /// Prompt sizes in bytes.
    #[arg(long, value_delimiter = ',', default_value = "8192,204800")]
    sizes: Vec<usize>,
    /// Requests per second for each path.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Measured requests per path and size.
    #[arg(long, default_value_t = 300)]
    requests: usize,
    /// Unmeasured requests per path first.
    #[arg(long, default_value_t = 30)]
    warmup: usize,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Extra `llmgw-router serve` flags, e.g. `--router-arg=--weight-prefix=0` to measure
    /// load-based picking alone (no tokenization for the prefix slot).
    #[arg(long = "router-arg", allow_hyphen_values = true)]
    router_args: Vec<String>,
    /// Envoy reaches the router over a Unix socket (`llmgw-router --grpc-uds`) instead of TCP.
    #[arg(long)]
    uds: bool,
}

/// The added p99 each prompt size should stay within (BUFFERED), where one is set.
fn added_p99_target_ms(size: usize) -> Option<f64> {
    match size {
        8192 => Some(1.0),
        204_800 => Some(5.0),
        _ => None,
    }
}

const DECISION_CPU_TARGET_US: f64 = 50.0;

fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "missed" }
}

const PATHS: [&str; 5] = ["baseline", "floor", "buffered", "streamed", "full_duplex"];

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    llmgw_bench::client_runtime()?.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let sim_args = [
        "--served-model-name",
        "tiny",
        "--sim-no-latency",
        "--max-model-len",
        "131072",
        "--num-gpu-blocks-override",
        "16384",
    ];
    let sims = [spawn_sim(sim_args), spawn_sim(sim_args)];
    let replicas = [sims[0].addr, sims[1].addr];

    let grpc_port = free_port();
    let floor_port = free_port();
    let socket_of = |name: &str| {
        args.uds.then(|| {
            std::env::temp_dir().join(format!("llmgw-bench-{name}-{}.sock", std::process::id()))
        })
    };
    let (socket, floor_socket) = (socket_of("router"), socket_of("floor"));
    let mut router_args = args.router_args.clone();
    if let Some(socket) = &socket {
        router_args.extend(["--grpc-uds".to_owned(), socket.display().to_string()]);
    }
    let router = start_router(grpc_port, &replicas, &router_args)?;
    let floor = start_floor(floor_port, floor_socket.as_deref(), &replicas)?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let over = |socket: &Option<PathBuf>, config: String| match socket {
        Some(socket) => envoy_config_over_uds(&config, socket),
        None => config,
    };

    // One Envoy per path, in the order of PATHS, with the ext_proc server's port.
    let configs = [
        (baseline_config(), grpc_port),
        (over(&floor_socket, repo_config("envoy.yaml")?), floor_port),
        (over(&socket, repo_config("envoy.yaml")?), grpc_port),
        (
            over(
                &socket,
                envoy_config_streamed_ahead(&repo_config("envoy.yaml")?),
            ),
            grpc_port,
        ),
        (
            over(&socket, repo_config("envoy-original-dst.yaml")?),
            grpc_port,
        ),
    ];
    let mut envoys = Vec::new();
    for (path, (config, port)) in PATHS.into_iter().zip(&configs) {
        envoys.push(start_envoy(
            path,
            config,
            replicas,
            *port,
            "bench-overhead",
        )?);
    }
    for envoy in &envoys {
        wait_ready(envoy.admin).await?;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;

    let mut results = Vec::new();
    let mut verdicts = Vec::new();
    println!(
        "\n| prompt | path | p50 ms | p99 ms | added p50 ms | added p99 ms | server CPU µs/req | decision CPU µs | mean pick µs |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for &size in &args.sizes {
        let prompt = prompt_of(size);
        let clients: Vec<Client> = envoys.iter().map(|e| Client::new(e.listen)).collect();
        // Warm-up: connections, Envoy and router caches.
        for i in 0..args.warmup {
            for client in &clients {
                client.post(&body(&prompt, i)).await?;
            }
        }
        let paths: Vec<(&'static str, Client)> = PATHS.into_iter().zip(clients).collect();
        let latencies = measure(&paths, &prompt, &args, 1_000_000).await?;
        let mut cpu = HashMap::new();
        for (phase, routed_path) in paths.iter().enumerate().skip(1) {
            let first_id = 1_000_000 * (phase + 1);
            let processor = if routed_path.0 == "floor" {
                &floor
            } else {
                &router
            };
            let cost = measure_cpu(processor, routed_path, &prompt, &args, first_id).await?;
            cpu.insert(routed_path.0, cost);
        }
        for (path, envoy) in PATHS.into_iter().zip(&envoys).skip(1) {
            check_answered(path, envoy.admin, 2 * args.requests).await?;
        }

        let base = summary(&latencies["baseline"]);
        for path in PATHS {
            let s = summary(&latencies[path]);
            let routed_path = path != "baseline";
            println!(
                "| {} | {path} | {:.3} | {:.3} | {} | {} | {} | {} | {} |",
                size_label(size),
                s.p50,
                s.p99,
                if routed_path {
                    format!("{:.3}", s.p50 - base.p50)
                } else {
                    "–".into()
                },
                if routed_path {
                    format!("{:.3}", s.p99 - base.p99)
                } else {
                    "–".into()
                },
                cpu.get(path)
                    .map_or("–".into(), |c| format!("{:.1}", c.router_us_per_request)),
                cpu.get(path)
                    .and_then(|c| c.decisions)
                    .map_or("–".into(), |d| format!("{:.1}", d.cpu_us)),
                cpu.get(path)
                    .and_then(|c| c.decisions)
                    .map_or("–".into(), |d| format!("{:.1}", d.mean_pick_us)),
            );
            results.push(serde_json::json!({
                "prompt_bytes": size,
                "path": path,
                "requests": latencies[path].len(),
                "p50_ms": s.p50,
                "p99_ms": s.p99,
                "added_p50_ms": routed_path.then_some(s.p50 - base.p50),
                "added_p99_ms": routed_path.then_some(s.p99 - base.p99),
                "router_cpu_us_per_request": cpu.get(path).map(|c| c.router_us_per_request),
                "router_cpu_busy_s": cpu.get(path).map(|c| c.busy_s),
                "router_cpu_idle_s": cpu.get(path).map(|c| c.idle_s),
                "decision_cpu_us": cpu.get(path).and_then(|c| c.decisions).map(|d| d.cpu_us),
                "mean_pick_us": cpu.get(path).and_then(|c| c.decisions).map(|d| d.mean_pick_us),
            }));
        }
        // Both BUFFERED through the same Envoy configuration: the difference is llmgw's routing.
        let (floor_s, buffered_s) = (
            summary(&latencies["floor"]),
            summary(&latencies["buffered"]),
        );
        let cpu_over_floor =
            cpu["buffered"].router_us_per_request - cpu["floor"].router_us_per_request;
        println!(
            "| {} | buffered − floor | – | – | {:.3} | {:.3} | {:.1} | – | – |",
            size_label(size),
            buffered_s.p50 - floor_s.p50,
            buffered_s.p99 - floor_s.p99,
            cpu_over_floor,
        );
        results.push(serde_json::json!({
            "prompt_bytes": size,
            "path": "buffered_over_floor",
            "added_p50_ms": buffered_s.p50 - floor_s.p50,
            "added_p99_ms": buffered_s.p99 - floor_s.p99,
            "router_cpu_us_per_request": cpu_over_floor,
        }));

        if let Some(target) = added_p99_target_ms(size) {
            let (added, floor_added) = (buffered_s.p99 - base.p99, floor_s.p99 - base.p99);
            verdicts.push(format!(
                "{}: BUFFERED added p99 {added:+.2} ms, target ≤ {target} ms: {} \
                 (the floor: {floor_added:+.2} ms)",
                size_label(size),
                met(added <= target),
            ));
        }
        if let Some(decision) = cpu["buffered"].decisions {
            verdicts.push(format!(
                "{}: decision CPU {:.1} µs, target ≤ {DECISION_CPU_TARGET_US} µs: {}",
                size_label(size),
                decision.cpu_us,
                met(decision.cpu_us <= DECISION_CPU_TARGET_US),
            ));
        }
    }
    println!(
        "\nrate {} req/s per path, {} requests per path and size; latency with the paths \
         interleaved, CPU with each routed path alone; Envoy to router over {}; router flags \
         {:?}.",
        args.rate,
        args.requests,
        if args.uds { "a Unix socket" } else { "TCP" },
        args.router_args
    );
    println!("\nTargets (BUFFERED):");
    for verdict in &verdicts {
        println!("* {verdict}");
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)?;
        println!("wrote {}", path.display());
    }
    drop((envoys, router, floor));
    for socket in [socket, floor_socket].into_iter().flatten() {
        let _ = std::fs::remove_file(socket);
    }
    Ok(())
}

/// Sends `requests` per path at `rate` per path, open loop, round-robin over the paths; request
/// bodies are numbered from `first_id`, so that no two phases send the same prompt.
async fn measure(
    paths: &[(&'static str, Client)],
    prompt: &str,
    args: &Args,
    first_id: usize,
) -> anyhow::Result<HashMap<&'static str, Vec<f64>>> {
    let interval = Duration::from_secs_f64(1.0 / (args.rate * paths.len() as f64));
    let results: Arc<Mutex<HashMap<&'static str, Vec<f64>>>> = Arc::default();
    let mut tasks = tokio::task::JoinSet::new();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    for i in 0..args.requests * paths.len() {
        ticker.tick().await;
        let (path, client) = paths[i % paths.len()].clone();
        let body = body(prompt, first_id + i);
        let results = Arc::clone(&results);
        tasks.spawn(async move {
            let started = Instant::now();
            client.post(&body).await?;
            let ms = started.elapsed().as_secs_f64() * 1e3;
            results.lock().entry(path).or_default().push(ms);
            anyhow::Ok(())
        });
    }
    while let Some(result) = tasks.join_next().await {
        result??;
    }
    let results = std::mem::take(&mut *results.lock());
    Ok(results)
}

/// What one routed path costs the process answering ext_proc, per request.
struct CpuCost {
    router_us_per_request: f64,
    busy_s: f64,
    idle_s: f64,
    /// From the router's metrics; `None` for the floor server, which has none.
    decisions: Option<DecisionCost>,
}

#[derive(Clone, Copy)]
struct DecisionCost {
    cpu_us: f64,
    mean_pick_us: f64,
}

/// CPU of `requests` requests on one path alone (at `rate`), less the idle CPU of a window as
/// long; and, for the router, the decisions' own CPU and wall-clock means from its metrics.
async fn measure_cpu(
    processor: &Processor,
    path: &(&'static str, Client),
    prompt: &str,
    args: &Args,
    first_id: usize,
) -> anyhow::Result<CpuCost> {
    let picks_before = match processor.admin {
        Some(admin) => Some(pick_stats(admin).await?),
        None => None,
    };
    let cpu_before = process_cpu(processor.pid)?;
    let started = Instant::now();
    measure(std::slice::from_ref(path), prompt, args, first_id).await?;
    let window = started.elapsed();
    let busy_s = process_cpu(processor.pid)? - cpu_before;
    let picks_after = match processor.admin {
        Some(admin) => Some(pick_stats(admin).await?),
        None => None,
    };
    let idle_before = process_cpu(processor.pid)?;
    tokio::time::sleep(window).await;
    let idle_s = process_cpu(processor.pid)? - idle_before;
    let decisions = picks_before.zip(picks_after).map(|(before, after)| {
        let picks = after.count - before.count;
        let per_pick = |after: f64, before: f64| {
            if picks > 0.0 {
                (after - before) / picks * 1e6
            } else {
                f64::NAN
            }
        };
        DecisionCost {
            cpu_us: per_pick(after.cpu_s, before.cpu_s),
            mean_pick_us: per_pick(after.wall_s, before.wall_s),
        }
    });
    Ok(CpuCost {
        router_us_per_request: (busy_s - idle_s).max(0.0) / args.requests as f64 * 1e6,
        busy_s,
        idle_s,
        decisions,
    })
}

/// Words, so that the simulator's tokenizer sees ordinary text.
fn prompt_of(size: usize) -> String {
    let words = [
        "alpha ", "beta ", "gamma ", "delta ", "epsilon ", "router ", "cache ",
    ];
    let mut prompt = String::with_capacity(size + 16);
    let mut i = 0usize;
    while prompt.len() < size {
        prompt.push_str(words[(i * 7 + i / 3) % words.len()]);
        i += 1;
    }
    prompt.truncate(size);
    prompt
}

/// A unique first word per request, so that no request hits the simulator's prefix cache.
fn body(prompt: &str, i: usize) -> Vec<u8> {
    serde_json::json!({"model": "tiny", "prompt": format!("r{i} {prompt}"), "max_tokens": 1})
        .to_string()
        .into_bytes()
}

fn start_router(
    grpc_port: u16,
    replicas: &[SocketAddr; 2],
    extra: &[String],
) -> anyhow::Result<Processor> {
    let process = RouterCommand::new()
        .grpc(SocketAddr::from(([127, 0, 0, 1], grpc_port)))
        .replica("tiny", replicas[0], None)
        .replica("tiny", replicas[1], None)
        // ORIGINAL_DST (full duplex path) takes one address.
        .args(["--fallbacks", "0"])
        .args(extra)
        .env("RUST_LOG", "warn")
        .spawn()?;
    Ok(Processor {
        pid: process.pid(),
        admin: Some(process.addrs.admin),
        guard: Some(process.guard),
    })
}
