//! `make bench-overload`: flow control at 150 % of capacity. Simulated replicas with their
//! latency model on (a running-batch limit, a decode time per step) behind a real Envoy and
//! llmgw-router, whose saturation limit is each replica's batch plus `--engine-queue` (2)
//! waiting (`--max-in-flight`), so that what the engines cannot take waits in the router's
//! queues, ordered by priority and tenant.
//!
//! 1. **Capacity**: closed loop, more requests in flight than the batches hold; completions
//!    per second.
//! 2. **Alone**: the interactive objective (priority 10) alone at 0.3 × capacity, open loop.
//! 3. **Overload**: the same interactive traffic plus the sheddable batch objective
//!    (priority -1, 2 s queue timeout) from a noisy tenant at 1.0 × and a quiet one at 0.2 ×:
//!    1.5 × capacity in all.
//!
//! Per phase and class: requests sent, served, shed by flow control (displaced, queue full,
//! deadline), failed, and TTFT p50/p99 of the served ones (time to the first streamed chunk).
//! Then the checks: interactive p99 under overload within 1.5 × of its p99 alone, and
//! the quiet tenant's p99 within 1.5 × of the noisy tenant's. Arrivals are Poisson from a fixed
//! seed. A Markdown report on stdout and in `--out-dir`, the numbers in `--json`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use llmgw_bench::overload::{
    Check, Class, ClassReport, Ending, OBJECTIVES_YAML, ShedReason, checks, markdown, overload_mix,
};
use llmgw_integration::envoy::EnvoyCommand;
use llmgw_integration::router::RouterCommand;
use llmgw_integration::system::envoy_config;
use llmgw_integration::{SimHandle, free_port, prom, spawn_sim};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use serde::Serialize;

const MODEL: &str = "tiny";

#[derive(Parser)]
#[command(
    name = "llmgw-bench-overload",
    about = "Flow control at 150 % of capacity: priorities, fairness, shedding"
)]
struct Args {
    /// Simulated replicas.
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// Each replica's running-batch limit.
    #[arg(long, default_value_t = 16)]
    max_num_seqs: usize,
    /// Requests the router lets wait in each engine's own queue beyond its batch: the router's
    /// `--max-in-flight` is the batch plus this. With 0 a freed slot is refilled only after
    /// the router hears that a request ended, an engine step later than an engine with a
    /// request waiting; docs/results/2026-12-02-overload.md compares 0, 1 and 2.
    #[arg(long, default_value_t = 2)]
    engine_queue: usize,
    /// The replicas' decode time per step, in microseconds.
    #[arg(long, default_value_t = 40_000)]
    decode_us: u64,
    /// Tokens per response.
    #[arg(long, default_value_t = 8)]
    output_tokens: u32,
    /// Seconds of the closed-loop capacity measurement.
    #[arg(long, default_value_t = 8)]
    calibrate_seconds: u64,
    /// Seconds of the interactive traffic alone.
    #[arg(long, default_value_t = 15)]
    alone_seconds: u64,
    /// Seconds of the overload.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Seconds at the start of each phase left out of every number.
    #[arg(long, default_value_t = 3)]
    warmup_seconds: u64,
    /// Seed of the arrival processes.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Where the report, the objectives file and the Envoy config go.
    #[arg(long, default_value = "target/bench-overload")]
    out_dir: PathBuf,
    /// The numbers as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Report {
    capacity_per_s: f64,
    alone: BTreeMap<String, ClassReport>,
    overload: BTreeMap<String, ClassReport>,
    checks: Vec<Check>,
    /// The router's own counts over the whole run, `llmgw_flow_control_requests_total` by
    /// outcome and priority.
    router_outcomes: BTreeMap<String, f64>,
    /// The router's mean wait in its queue before dispatch, by priority, in milliseconds, over
    /// the whole run (GIE's queue-duration histogram, outcome `Dispatched`).
    router_mean_wait_ms: BTreeMap<String, f64>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    llmgw_bench::client_runtime()?.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("create {}", args.out_dir.display()))?;
    let sims: Vec<SimHandle> = (0..args.replicas)
        .map(|_| {
            spawn_sim([
                "--served-model-name".to_owned(),
                MODEL.to_owned(),
                "--max-num-seqs".to_owned(),
                args.max_num_seqs.to_string(),
                "--sim-decode-us-per-token".to_owned(),
                args.decode_us.to_string(),
                "--sim-output-len".to_owned(),
                (args.output_tokens + 100).to_string(),
            ])
        })
        .collect();
    let replicas: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    let objectives = args.out_dir.join("objectives.yaml");
    std::fs::write(&objectives, OBJECTIVES_YAML).context("write the objectives file")?;
    let grpc = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut router = RouterCommand::new().grpc(grpc);
    for replica in &replicas {
        router = router.replica(MODEL, *replica, None);
    }
    let router = router
        .args(["--config".as_ref(), objectives.as_os_str()])
        .args([
            "--max-in-flight",
            &(args.max_num_seqs + args.engine_queue).to_string(),
        ])
        .args(["--scrape-interval", "100ms", "--health-interval", "200ms"])
        .env("RUST_LOG", "warn")
        .spawn()?;
    let (listen, admin) = (free_port(), free_port());
    let envoy = EnvoyCommand::new(
        "overload",
        envoy_config(grpc, listen, admin, &replicas),
        listen,
        admin,
    )
    .config_dir(args.out_dir.clone())
    .log_level("error")
    .spawn()?;
    if !envoy.ready(Duration::from_secs(10)).await {
        bail!("envoy never became ready");
    }
    let url = envoy.url("/v1/completions");
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .timeout(Duration::from_secs(60))
        .build()?;
    wait_routable(&client, &url).await?;

    let slots = args.replicas * args.max_num_seqs;
    let capacity = calibrate(&client, &url, &args, 2 * slots).await;
    eprintln!("capacity: {capacity:.1} requests/s ({slots} batch slots)");
    if capacity <= 0.0 {
        bail!("no request completed while measuring the capacity");
    }
    let mix = overload_mix();
    let interactive = vec![mix[0].clone()];
    let alone = phase(
        &client,
        &url,
        &args,
        &interactive,
        capacity,
        args.alone_seconds,
    )
    .await;
    let overload = phase(&client, &url, &args, &mix, capacity, args.seconds).await;
    let checks = checks(&alone["interactive"], &overload);
    let metrics = reqwest::get(format!("http://{}/metrics", router.addrs.admin))
        .await?
        .text()
        .await?;
    let mut router_outcomes = BTreeMap::new();
    for sample in prom::samples(&metrics).filter(|s| s.name == "llmgw_flow_control_requests_total")
    {
        let key = format!(
            "{}@{}",
            sample.label("outcome").unwrap_or_default(),
            sample.label("priority").unwrap_or_default()
        );
        router_outcomes.insert(key, sample.value);
    }
    let mut router_mean_wait_ms = BTreeMap::new();
    for priority in ["10", "-1"] {
        let labels = [("priority", priority), ("outcome", "Dispatched")];
        let name = "inference_extension_flow_control_request_queue_duration_seconds";
        let sum = prom::sum(&metrics, &format!("{name}_sum"), &labels);
        let count = prom::sum(&metrics, &format!("{name}_count"), &labels);
        if let (Some(sum), Some(count)) = (sum, count.filter(|c| *c > 0.0)) {
            router_mean_wait_ms.insert(priority.to_owned(), sum / count * 1000.0);
        }
    }
    let report = Report {
        capacity_per_s: capacity,
        alone,
        overload,
        checks,
        router_outcomes,
        router_mean_wait_ms,
    };
    let text = render(&args, &report);
    println!("{text}");
    std::fs::write(args.out_dir.join("report.md"), &text)?;
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)?;
    }
    drop((envoy, router, sims));
    Ok(())
}

fn render(args: &Args, report: &Report) -> String {
    let mut text = format!(
        "## bench-overload\n\n{} replicas × batch {} (decode {} ms/step), the router's limit {} in flight per replica, {} tokens per answer: capacity {:.1} requests/s, measured closed loop. Overload offers 1.5 × that: interactive (priority 10) 0.3 ×, batch (priority -1, 2 s queue timeout) from a noisy tenant 1.0 × and a quiet one 0.2 ×.\n\n",
        args.replicas,
        args.max_num_seqs,
        args.decode_us as f64 / 1000.0,
        args.max_num_seqs + args.engine_queue,
        args.output_tokens,
        report.capacity_per_s
    );
    text.push_str(&markdown(
        "interactive alone (0.3 × capacity)",
        &report.alone,
    ));
    text.push('\n');
    text.push_str(&markdown("overload (1.5 × capacity)", &report.overload));
    text.push_str("\n### checks\n\n");
    for check in &report.checks {
        text.push_str(&format!(
            "* {}: {} (limit {}) — {}\n",
            check.what,
            check.ratio.map_or("–".to_owned(), |r| format!("{r:.2}")),
            check.limit,
            if check.met { "met" } else { "missed" }
        ));
    }
    text.push_str("\nRouter's flow-control outcomes (outcome@priority): ");
    let outcomes: Vec<String> = report
        .router_outcomes
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    text.push_str(&outcomes.join(", "));
    text.push_str(".\nMean wait in the router's queue before dispatch (whole run), by priority: ");
    let waits: Vec<String> = report
        .router_mean_wait_ms
        .iter()
        .map(|(k, v)| format!("{k}: {v:.1} ms"))
        .collect();
    text.push_str(&waits.join(", "));
    text.push('\n');
    text
}

/// Sends a request until one is served (the router's health checks take a moment).
async fn wait_routable(client: &reqwest::Client, url: &str) -> anyhow::Result<()> {
    for _ in 0..100 {
        if let Ending::Served { .. } = request(client, url, None, 0, 1).await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("no request was served through Envoy and llmgw within 10 s")
}

/// Requests completed per second with `in_flight` requests always open.
async fn calibrate(client: &reqwest::Client, url: &str, args: &Args, in_flight: usize) -> f64 {
    let started = Instant::now();
    let warmup = Duration::from_secs(1);
    let until = Duration::from_secs(args.calibrate_seconds.max(2));
    let done = Arc::new(Mutex::new(0usize));
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..in_flight {
        let (client, url, done, tokens) = (
            client.clone(),
            url.to_owned(),
            Arc::clone(&done),
            args.output_tokens,
        );
        workers.spawn(async move {
            let mut id = worker * 1_000_000;
            while started.elapsed() < until {
                id += 1;
                let ending = request(&client, &url, None, id, tokens).await;
                let at = started.elapsed();
                if matches!(ending, Ending::Served { .. }) && at > warmup && at <= until {
                    *done.lock() += 1;
                }
            }
        });
    }
    while workers.join_next().await.is_some() {}
    let completed = *done.lock();
    completed as f64 / (until - warmup).as_secs_f64()
}

/// Offers each class its share of `capacity` for `seconds`, open loop; the requests sent after
/// the warm-up are reported.
async fn phase(
    client: &reqwest::Client,
    url: &str,
    args: &Args,
    classes: &[Class],
    capacity: f64,
    seconds: u64,
) -> BTreeMap<String, ClassReport> {
    let started = Instant::now();
    let warmup = Duration::from_secs(args.warmup_seconds);
    let until = warmup + Duration::from_secs(seconds);
    let endings: Arc<Mutex<BTreeMap<String, Vec<Ending>>>> = Arc::default();
    let mut generators = tokio::task::JoinSet::new();
    for (index, class) in classes.iter().enumerate() {
        let (client, url, endings, class) = (
            client.clone(),
            url.to_owned(),
            Arc::clone(&endings),
            class.clone(),
        );
        let rate = class.share * capacity;
        let tokens = args.output_tokens;
        let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed + index as u64);
        generators.spawn(async move {
            let mut requests = tokio::task::JoinSet::new();
            let mut next = Duration::ZERO;
            let mut id = index * 10_000_000;
            while next < until {
                tokio::time::sleep_until(tokio::time::Instant::from_std(started + next)).await;
                id += 1;
                let counted = next >= warmup;
                let (client, url, endings, class) = (
                    client.clone(),
                    url.clone(),
                    Arc::clone(&endings),
                    class.clone(),
                );
                requests.spawn(async move {
                    let ending = request(&client, &url, Some(&class), id, tokens).await;
                    if counted {
                        endings
                            .lock()
                            .entry(class.name.to_owned())
                            .or_default()
                            .push(ending);
                    }
                });
                // Exponential gaps: a Poisson process at `rate`.
                let uniform: f64 = rng.random_range(f64::EPSILON..1.0);
                next += Duration::from_secs_f64(-uniform.ln() / rate);
            }
            while requests.join_next().await.is_some() {}
        });
    }
    while generators.join_next().await.is_some() {}
    let endings = endings.lock();
    classes
        .iter()
        .map(|class| {
            let ended = endings.get(class.name).map_or(&[][..], Vec::as_slice);
            (class.name.to_owned(), ClassReport::of(ended))
        })
        .collect()
}

/// One streamed completion with a prompt of its own; TTFT is the first chunk of the body.
async fn request(
    client: &reqwest::Client,
    url: &str,
    class: Option<&Class>,
    id: usize,
    max_tokens: u32,
) -> Ending {
    let name = class.map_or("calibrate", |c| c.name);
    let body = serde_json::json!({
        "model": MODEL,
        "prompt": format!("Request {id} of {name}: summarise the ticket in one short line, please."),
        "max_tokens": max_tokens,
        "stream": true,
    });
    let mut builder = client.post(url).json(&body);
    if let Some(class) = class {
        builder = builder
            .header("x-gateway-inference-objective", class.objective)
            .header("x-gateway-inference-fairness-id", class.tenant);
    }
    let started = Instant::now();
    let mut response = match builder.send().await {
        Ok(response) => response,
        Err(error) => return Ending::Failed(error.to_string()),
    };
    let status = response.status().as_u16();
    if status == 429 || status == 503 {
        let text = response.text().await.unwrap_or_default();
        let message = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
            .unwrap_or(text);
        return Ending::Shed {
            status,
            reason: ShedReason::of(&message),
        };
    }
    if status != 200 {
        return Ending::Failed(format!("status {status}"));
    }
    let mut ttft = None;
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) if !chunk.is_empty() => {
                ttft.get_or_insert_with(|| started.elapsed());
            }
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(error) => return Ending::Failed(error.to_string()),
        }
    }
    match ttft {
        Some(ttft) => Ending::Served {
            ttft_ms: ttft.as_secs_f64() * 1000.0,
        },
        None => Ending::Failed("an empty stream".to_owned()),
    }
}
