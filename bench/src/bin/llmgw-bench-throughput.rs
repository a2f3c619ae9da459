//! `make bench-throughput`: how far llmgw goes as concurrency grows, per router core.
//!
//! The whole system as `make run` starts it (two `llmgw-sim` replicas with the latency model off,
//! so that they answer as fast as they can; `llmgw-router` routing precisely on the index the
//! agent feeds), plus `llmgw-extproc-floor` (llmgw's protocol layer with a round-robin picker
//! that reads nothing) and one Envoy per path, each with one worker thread (`--concurrency 1`):
//! * **baseline**: Envoy → replica, round robin, no ext_proc;
//! * **floor**: `envoy/envoy.yaml` with the floor server in the router's place;
//! * **buffered**: `envoy/envoy.yaml` (ext_proc BUFFERED → llmgw);
//! * **full_duplex**: `envoy/envoy-original-dst.yaml` (FULL_DUPLEX_STREAMED both ways).
//!
//! Each ext_proc server runs pinned to one core (`taskset`) for the per-core figure, and the
//! floor and buffered paths again on every core. For each prompt size and concurrency, each path
//! in turn gets `C` closed-loop clients (each sends its next request when the last is answered)
//! for a warm-up (at least `--warmup-seconds`, and until `C` requests were answered) and then a
//! measured window. The traffic is shaped as chat traffic is: every
//! request starts with one long shared document, then its conversation's own context, then the
//! conversation's turns so far and a new one, so that a conversation's next request extends its
//! last; half the conversations are `/v1/chat/completions`, half `/v1/completions`, and each
//! starts over after 16 turns.
//!
//! Per point: requests/s through the gateway; latency p50/p99 and what it adds over the baseline
//! at the same concurrency; the CPU of the ext_proc server and of the path's Envoy per request
//! and in cores (all threads, from /proc, over the window); and for llmgw the decisions and the
//! index's hits. The bench fails when a routed Envoy failed open instead of asking its ext_proc
//! server, so every routed request counted went through ext_proc.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use llmgw_bench::gateway::{
    Client, EnvoyProcess, Processor, baseline_config, check_answered,
    process_cpu_with_exited_threads, repo_config, size_label, start_envoy, start_floor, summary,
    wait_ready,
};
use llmgw_integration::free_port;
use llmgw_integration::system::{self, SystemConfig};
use parking_lot::Mutex;

#[derive(Parser)]
#[command(about = "Throughput and added latency of llmgw under closed-loop concurrency")]
struct Args {
    /// Prompt sizes in bytes.
    #[arg(long, value_delimiter = ',', default_value = "8192,225280")]
    sizes: Vec<usize>,
    /// Closed-loop clients per point.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128,200,512")]
    concurrency: Vec<usize>,
    /// Measured seconds per path and point.
    #[arg(long, default_value_t = 4.0)]
    seconds: f64,
    /// Unmeasured seconds before each measured window.
    #[arg(long, default_value_t = 1.0)]
    warmup_seconds: f64,
    /// Which of the cores this bench may use (the first, the second...) a pinned ext_proc
    /// server runs on.
    #[arg(long, default_value_t = 0)]
    pin_core: usize,
    /// The router tokenizes through a replica's `/tokenize` instead of in process with the
    /// model's tokenizer and chat template (as `--model ...,tokenizer=` gives them).
    #[arg(long)]
    replica_tokenize: bool,
    /// Also write the results as JSON here (`bench/plot_throughput.py` plots them).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Only these paths (by name, as the table prints them; the baseline always runs, for the
    /// added latency), e.g. `--paths "floor 1 core,buffered 1 core"`.
    #[arg(long, value_delimiter = ',')]
    paths: Vec<String>,
    /// One more `llmgw-router serve` flag (repeatable), e.g. `--router-arg=--worker-threads=1`
    /// to measure the router on tokio's current-thread scheduler.
    #[arg(long = "router-arg", allow_hyphen_values = true)]
    router_args: Vec<String>,
}

/// Which process answers a path's ext_proc.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ExtProc {
    None,
    Floor,
    Llmgw,
}

/// One way through the gateway.
struct Path {
    name: &'static str,
    ext_proc: ExtProc,
    /// Index into the Envoys.
    envoy: usize,
    /// The ext_proc server runs on one core (else on all of them).
    pinned: bool,
}

const PATHS: [Path; 6] = [
    Path {
        name: "baseline",
        ext_proc: ExtProc::None,
        envoy: 0,
        pinned: false,
    },
    Path {
        name: "floor 1 core",
        ext_proc: ExtProc::Floor,
        envoy: 1,
        pinned: true,
    },
    Path {
        name: "buffered 1 core",
        ext_proc: ExtProc::Llmgw,
        envoy: 2,
        pinned: true,
    },
    Path {
        name: "full_duplex 1 core",
        ext_proc: ExtProc::Llmgw,
        envoy: 3,
        pinned: true,
    },
    Path {
        name: "floor all cores",
        ext_proc: ExtProc::Floor,
        envoy: 1,
        pinned: false,
    },
    Path {
        name: "buffered all cores",
        ext_proc: ExtProc::Llmgw,
        envoy: 2,
        pinned: false,
    },
];

/// The anchor's plateau (llm-d's picker, llm-d-router #1109), requests/s.
const ANCHOR_PLATEAU_RPS: f64 = 130.0;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    llmgw_bench::client_runtime()?.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    // The cores this process may run on (a container's cpuset need not start at 0).
    let allowed = allowed_cores()?;
    let cores = allowed.len();
    let Some(&pinned_core) = allowed.get(args.pin_core) else {
        bail!(
            "--pin-core {} but this bench may use {cores} cores",
            args.pin_core
        );
    };
    if let Some(unknown) = args
        .paths
        .iter()
        .find(|name| !PATHS.iter().any(|p| p.name == name.as_str()))
    {
        let known: Vec<&str> = PATHS.iter().map(|p| p.name).collect();
        bail!("--paths: no path {unknown:?} (paths: {})", known.join(", "));
    }
    let runs = |path: &Path| {
        path.ext_proc == ExtProc::None
            || args.paths.is_empty()
            || args.paths.iter().any(|name| name == path.name)
    };
    let largest = args.sizes.iter().copied().max().unwrap_or(0);
    // Every conversation's prompt fits a replica's context, and the replicas' caches hold the
    // shared document and many conversations.
    // (The simulator's tokenizer makes about one token of two bytes of these words.)
    let max_model_len = largest.max(8192);
    // ORIGINAL_DST (the full duplex path) takes one address.
    let mut router_args = vec!["--fallbacks".to_owned(), "0".to_owned()];
    // The simulator tokenizes on the one thread that also answers /health, so at 220 KB and
    // 100+ clients its health check answers seconds late while it serves: patient probes keep
    // the router from taking working replicas out (the harness probes every 200 ms).
    router_args.extend(["--probe-timeout".to_owned(), "10s".to_owned()]);
    if !args.replica_tokenize {
        // The simulator's own tokenizer and chat template, as a user gives the model's: a later
        // `--model` for the same model replaces the harness's.
        let assets = llmgw_integration::repo_root().join("sim/assets");
        router_args.extend([
            "--model".to_owned(),
            format!(
                "tiny=block_size=16,seed=1729,tokenizer={},chat_template={}",
                assets.join("tokenizer.json").display(),
                assets.join("chat_template.jinja").display()
            ),
        ]);
    }
    router_args.extend(args.router_args.iter().cloned());
    let system = system::start(SystemConfig {
        replicas: 2,
        blocks_per_replica: 65_536,
        sim_args: [
            "--sim-no-latency",
            "--max-model-len",
            &max_model_len.to_string(),
            "--max-num-seqs",
            "1024",
        ]
        .map(str::to_owned)
        .to_vec(),
        router_args,
        ..SystemConfig::default()
    })
    .await;
    let replicas = [system.sims[0].addr, system.sims[1].addr];
    let defaults = SystemConfig::default();
    if (defaults.block_size, defaults.seed.as_str()) != (16, "1729") {
        bail!("the harness's hash settings changed: update the router's --model above");
    }
    let router = Processor {
        pid: system.router_pid(0).context("the router runs")?,
        admin: Some(system.router.admin),
        guard: None,
    };
    let floor_port = free_port();
    let floor = start_floor(floor_port, None, &replicas)?;
    let grpc = system.router.grpc.port();
    let configs = [
        ("baseline", patient(baseline_config()), grpc),
        ("floor", patient(repo_config("envoy.yaml")?), floor_port),
        ("buffered", patient(repo_config("envoy.yaml")?), grpc),
        (
            "full_duplex",
            patient(repo_config("envoy-original-dst.yaml")?),
            grpc,
        ),
    ];
    let mut envoys = Vec::new();
    for (name, config, port) in &configs {
        envoys.push(start_envoy(
            name,
            config,
            replicas,
            *port,
            "bench-throughput",
        )?);
    }
    for envoy in &envoys {
        wait_ready(envoy.admin).await?;
    }

    let mut rows = Vec::new();
    println!(
        "\n| prompt | clients | path | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | \
         ext_proc CPU µs/req | ext_proc cores | Envoy CPU µs/req | Envoy cores | index hits (+ load overrides) | tokenize timeouts |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut conversations_started = 0;
    for &size in &args.sizes {
        let shared = Arc::new(words(size * 3 / 4, 0));
        for &clients in &args.concurrency {
            let mut baseline = None;
            for path in PATHS.iter().filter(|p| runs(p)) {
                let processor = match path.ext_proc {
                    ExtProc::None => None,
                    ExtProc::Floor => Some(&floor),
                    ExtProc::Llmgw => Some(&router),
                };
                if let Some(processor) = processor {
                    pin(processor.pid, path.pinned.then_some(pinned_core), &allowed)?;
                }
                let workload = Workload {
                    shared: Arc::clone(&shared),
                    size,
                    first_conversation: conversations_started,
                };
                conversations_started += clients;
                let point = measure(
                    &envoys[path.envoy],
                    processor,
                    workload,
                    clients,
                    Duration::from_secs_f64(args.warmup_seconds),
                    Duration::from_secs_f64(args.seconds),
                )
                .await
                .with_context(|| {
                    format!("{} at {clients} clients, {}", path.name, size_label(size))
                })?;
                let latency = summary(&point.latencies_ms);
                let base = *baseline.get_or_insert((latency.p50, latency.p99));
                let routed = path.ext_proc != ExtProc::None;
                let added = routed.then_some((latency.p50 - base.0, latency.p99 - base.1));
                let per_request = |cpu_s: f64| cpu_s / point.requests as f64 * 1e6;
                let window = point.window.as_secs_f64();
                let rps = point.requests as f64 / window;
                let ext_proc_cpu = point.ext_proc_cpu_s.map(per_request);
                let ext_proc_cores = point.ext_proc_cpu_s.map(|s| s / window);
                println!(
                    "| {} | {clients} | {} | {rps:.0} | {:.2} | {:.2} | {} | {} | {} | {} | {:.0} | {:.2} | {} | {} |",
                    size_label(size),
                    path.name,
                    latency.p50,
                    latency.p99,
                    added.map_or("–".into(), |a| format!("{:+.2}", a.0)),
                    added.map_or("–".into(), |a| format!("{:+.2}", a.1)),
                    ext_proc_cpu.map_or("–".into(), |us| format!("{us:.0}")),
                    ext_proc_cores.map_or("–".into(), |c| format!("{c:.2}")),
                    per_request(point.envoy_cpu_s),
                    point.envoy_cpu_s / window,
                    point.decisions.map_or("–".into(), |d| format!(
                        "{:.0} % (+{:.0} %)",
                        d.hit_share() * 100.0,
                        d.share(d.load_overrides) * 100.0
                    )),
                    point.decisions.map_or("–".into(), |d| format!(
                        "{:.0} %",
                        d.share(d.tokenize_timeouts) * 100.0
                    )),
                );
                rows.push(serde_json::json!({
                    "prompt_bytes": size,
                    "clients": clients,
                    "path": path.name,
                    "ext_proc": match path.ext_proc {
                        ExtProc::None => "none",
                        ExtProc::Floor => "floor",
                        ExtProc::Llmgw => "llmgw",
                    },
                    "ext_proc_cores": if path.pinned { 1 } else { cores },
                    "requests": point.requests,
                    "window_s": window,
                    "requests_per_s": rps,
                    "p50_ms": latency.p50,
                    "p99_ms": latency.p99,
                    "added_p50_ms": added.map(|a| a.0),
                    "added_p99_ms": added.map(|a| a.1),
                    "ext_proc_cpu_us_per_request": ext_proc_cpu,
                    "ext_proc_cores_used": ext_proc_cores,
                    "envoy_cpu_us_per_request": per_request(point.envoy_cpu_s),
                    "envoy_cores_used": point.envoy_cpu_s / window,
                    "decisions": point.decisions.map(|d| d.picks),
                    "index_hits": point.decisions.map(|d| d.index_hits),
                    "tokenize_timeouts": point.decisions.map(|d| d.tokenize_timeouts),
                    "load_overrides": point.decisions.map(|d| d.load_overrides),
                }));
            }
        }
        // Back to every core for the next size's first path.
        pin(router.pid, None, &allowed)?;
        pin(floor.pid, None, &allowed)?;
    }
    println!(
        "\n{} s measured per point after {} s of warm-up; two simulated replicas without their \
         latency model; one Envoy worker per path; the pinned ext_proc server on core {} of {cores}; \
         the router tokenizing {}; load average at the end: {}.",
        args.seconds,
        args.warmup_seconds,
        pinned_core,
        if args.replica_tokenize {
            "through a replica's /tokenize"
        } else {
            "in process"
        },
        llmgw_integration::procfs::load_avg(),
    );
    println!("\nGoals (ratios from this run):");
    for verdict in verdicts(&rows) {
        println!("* {verdict}");
    }
    // Reported before the check below, so that a run that fails it keeps its numbers.
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
        println!("wrote {}", path.display());
    }
    for (i, (name, _, _)) in configs.iter().enumerate().skip(1) {
        let sent: u64 = rows
            .iter()
            .filter(|r| PATHS.iter().any(|p| p.envoy == i && r["path"] == p.name))
            .filter_map(|r| r["requests"].as_u64())
            .sum();
        check_answered(name, envoys[i].admin, sent as usize).await?;
    }

    drop((envoys, floor));
    drop(system);
    Ok(())
}

/// `config` with 10 s, not 1 s, for Envoy to connect to a replica: at 220 KB and 512 clients a
/// simulator busy tokenizing on its one thread accepts connections seconds late, and every
/// path, the baseline first, would answer 503 "connection timeout" for a replica that works.
fn patient(config: String) -> String {
    config.replace("connect_timeout: 1s", "connect_timeout: 10s")
}

/// Sets `pid`'s threads (and the ones they start later) on `core`, or on every allowed core.
fn pin(pid: u32, core: Option<usize>, allowed: &[usize]) -> anyhow::Result<()> {
    let list = match core {
        Some(core) => core.to_string(),
        None => allowed
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(","),
    };
    let status = Command::new("taskset")
        .args(["-a", "-p", "-c", &list, &pid.to_string()])
        .stdout(std::process::Stdio::null())
        .status()
        .context("run taskset (util-linux)")?;
    if !status.success() {
        bail!("taskset -a -p -c {list} {pid}: {status}");
    }
    Ok(())
}

/// The cores this process may run on, from `Cpus_allowed_list` in `/proc/self/status`
/// (`0-1`, `2,4-5`).
fn allowed_cores() -> anyhow::Result<Vec<usize>> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let list = status
        .lines()
        .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
        .context("no Cpus_allowed_list in /proc/self/status")?;
    cpu_list(list.trim()).with_context(|| format!("unreadable Cpus_allowed_list {list:?}"))
}

/// The cores of a Linux CPU list (`0-1`, `2,4-5`); `None` when it is empty or malformed.
fn cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cores = Vec::new();
    for range in list.split(',') {
        let (first, last) = range.split_once('-').unwrap_or((range, range));
        let (first, last) = (first.parse::<usize>().ok()?, last.parse::<usize>().ok()?);
        if first > last {
            return None;
        }
        cores.extend(first..=last);
    }
    Some(cores)
}

/// What one path at one point measured.
struct Point {
    /// Requests answered within the window.
    requests: usize,
    latencies_ms: Vec<f64>,
    window: Duration,
    ext_proc_cpu_s: Option<f64>,
    envoy_cpu_s: f64,
    decisions: Option<Decisions>,
}

#[derive(Clone, Copy)]
struct Decisions {
    picks: f64,
    /// `llmgw_kv_decisions_total{decision="hit"}`: picks the index answered with cached blocks.
    index_hits: f64,
    /// `llmgw_kv_decisions_total{decision="load_override"}`: the index found the prompt's blocks
    /// but load outvoted them (with two replicas under hundreds of clients, often).
    load_overrides: f64,
    /// `llmgw_tokenize_timeouts_total`: tokenizations past `--tokenize-deadline` (their picks
    /// went to the prefix tree).
    tokenize_timeouts: f64,
}

impl Decisions {
    fn hit_share(self) -> f64 {
        self.share(self.index_hits)
    }

    /// `count` as a share of the picks.
    fn share(self, count: f64) -> f64 {
        if self.picks > 0.0 {
            count / self.picks
        } else {
            0.0
        }
    }
}

/// Runs `clients` closed-loop clients through `envoy` for `warmup` and then `window`; counts the
/// requests answered within the window and the CPU the processes spent in it.
async fn measure(
    envoy: &EnvoyProcess,
    processor: Option<&Processor>,
    workload: Workload,
    clients: usize,
    warmup: Duration,
    window: Duration,
) -> anyhow::Result<Point> {
    let client = Client::new(envoy.listen);
    let clock = Arc::new(Window::default());
    let latencies: Arc<Mutex<Vec<f64>>> = Arc::default();
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..clients {
        let client = client.clone();
        let (clock, latencies) = (Arc::clone(&clock), Arc::clone(&latencies));
        let mut conversation = workload.conversation(worker);
        tasks.spawn(async move {
            while !clock.ended(Instant::now()) {
                let (endpoint, body) = conversation.next_request();
                let sent = Instant::now();
                client.post_to(endpoint, &body).await?;
                let answered = Instant::now();
                clock.answered.fetch_add(1, Ordering::Relaxed);
                if clock.within(answered) {
                    latencies.lock().push((answered - sent).as_secs_f64() * 1e3);
                }
            }
            anyhow::Ok(())
        });
    }
    // Warm-up: at least `warmup`, and until as many requests were answered as there are
    // clients, so that the measured window sees the loop's steady state.
    tokio::time::sleep(warmup).await;
    let warm_by = Instant::now() + MAX_WARMUP;
    while clock.answered.load(Ordering::Relaxed) < clients {
        if Instant::now() > warm_by || tasks.is_empty() {
            let answered = clock.answered.load(Ordering::Relaxed);
            tasks.shutdown().await;
            bail!("only {answered} requests answered in {MAX_WARMUP:?} of warm-up");
        }
        if let Some(Ok(Err(error))) = tasks.try_join_next() {
            return Err(error);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let envoy_pid = envoy.guard.id();
    let before = Counters::read(envoy_pid, processor).await?;
    let mut until = clock.open(window);
    let mut measured = window;
    loop {
        tokio::time::sleep_until(until.into()).await;
        if !latencies.lock().is_empty() || measured >= MAX_WARMUP {
            break;
        }
        // A point so slow that no request finished in the window (220 KB, 512 clients: a
        // minute each): it stays open until one does. Clients that saw it end meanwhile
        // stopped; the requests in flight still finish in it.
        until = clock.extend(window).context("the window is open")?;
        measured += window;
    }
    let after = Counters::read(envoy_pid, processor).await?;
    while let Some(result) = tasks.join_next().await {
        result??;
    }
    let latencies_ms = std::mem::take(&mut *latencies.lock());
    if latencies_ms.is_empty() {
        bail!("no request was answered within the measured window");
    }
    Ok(Point {
        requests: latencies_ms.len(),
        latencies_ms,
        window: measured,
        ext_proc_cpu_s: after
            .ext_proc_cpu_s
            .zip(before.ext_proc_cpu_s)
            .map(|(a, b)| a - b),
        envoy_cpu_s: after.envoy_cpu_s - before.envoy_cpu_s,
        decisions: after
            .decisions
            .zip(before.decisions)
            .map(|(a, b)| Decisions {
                picks: a.picks - b.picks,
                index_hits: a.index_hits - b.index_hits,
                load_overrides: a.load_overrides - b.load_overrides,
                tokenize_timeouts: a.tokenize_timeouts - b.tokenize_timeouts,
            }),
    })
}

/// The longest warm-up before a point fails.
const MAX_WARMUP: Duration = Duration::from_secs(120);

/// The measured window, opened once the loop is warm, and the requests answered so far.
#[derive(Default)]
struct Window {
    span: Mutex<Option<(Instant, Instant)>>,
    answered: AtomicUsize,
}

impl Window {
    /// Opens the window now for `length`; returns its end.
    fn open(&self, length: Duration) -> Instant {
        let now = Instant::now();
        self.span.lock().get_or_insert((now, now + length)).1
    }

    /// Moves the open window's end `by` later; returns the new end.
    fn extend(&self, by: Duration) -> Option<Instant> {
        let mut span = self.span.lock();
        let (_, until) = span.as_mut()?;
        *until += by;
        Some(*until)
    }

    fn within(&self, at: Instant) -> bool {
        self.span
            .lock()
            .is_some_and(|(from, until)| at >= from && at <= until)
    }

    fn ended(&self, at: Instant) -> bool {
        self.span.lock().is_some_and(|(_, until)| at >= until)
    }
}

/// CPU and decision totals at one moment.
struct Counters {
    ext_proc_cpu_s: Option<f64>,
    envoy_cpu_s: f64,
    decisions: Option<Decisions>,
}

impl Counters {
    async fn read(envoy_pid: u32, processor: Option<&Processor>) -> anyhow::Result<Counters> {
        let decisions = match processor.and_then(|p| p.admin) {
            Some(admin) => {
                // One scrape for both, so that they count the same decisions.
                let (_, text) = Client::new(admin).get("/metrics").await?;
                let text = String::from_utf8_lossy(&text);
                let total = |name: &str, labels: &[(&str, &str)]| {
                    llmgw_integration::prom::sum(&text, name, labels).unwrap_or(0.0)
                };
                Some(Decisions {
                    picks: total("llmgw_pick_duration_seconds_count", &[]),
                    index_hits: total("llmgw_kv_decisions_total", &[("decision", "hit")]),
                    load_overrides: total(
                        "llmgw_kv_decisions_total",
                        &[("decision", "load_override")],
                    ),
                    tokenize_timeouts: total("llmgw_tokenize_timeouts_total", &[]),
                })
            }
            None => None,
        };
        Ok(Counters {
            ext_proc_cpu_s: processor
                .map(|p| process_cpu_with_exited_threads(p.pid))
                .transpose()?,
            envoy_cpu_s: process_cpu_with_exited_threads(envoy_pid)?,
            decisions,
        })
    }
}

/// The traffic of one path at one point: chat-shaped conversations over a shared document.
struct Workload {
    /// The long document every request starts with.
    shared: Arc<String>,
    /// Roughly each request's size in bytes.
    size: usize,
    /// Conversations are numbered from here, so that no two points share one.
    first_conversation: usize,
}

/// Turns per conversation before it starts over.
const TURNS: usize = 16;

impl Workload {
    fn conversation(&self, worker: usize) -> Conversation {
        Conversation {
            shared: Arc::clone(&self.shared),
            // A quarter of each request is the conversation's own: its context, then its turns.
            own_bytes: (self.size / 4).saturating_sub(TURNS * 64).max(64),
            id: self.first_conversation + worker,
            chat: worker.is_multiple_of(2),
            context: String::new(),
            turns: Vec::new(),
        }
    }
}

struct Conversation {
    shared: Arc<String>,
    own_bytes: usize,
    id: usize,
    chat: bool,
    context: String,
    turns: Vec<String>,
}

impl Conversation {
    /// The next request: the endpoint and its JSON body.
    fn next_request(&mut self) -> (&'static str, Vec<u8>) {
        if self.turns.len() >= TURNS || self.context.is_empty() {
            if !self.context.is_empty() {
                // Started over: a new conversation, as a new user's would be.
                self.id += 1_000_000;
            }
            self.context = format!(
                "conversation {} {}",
                self.id,
                words(self.own_bytes, self.id)
            );
            self.turns.clear();
        }
        let n = self.turns.len();
        self.turns.push(format!(
            "question {n} of conversation {}: {}",
            self.id,
            words(40, n)
        ));
        if self.chat {
            let mut messages = vec![
                serde_json::json!({"role": "system", "content": *self.shared}),
                serde_json::json!({"role": "user", "content": self.context}),
            ];
            for (i, turn) in self.turns.iter().enumerate() {
                if i > 0 {
                    messages.push(serde_json::json!({"role": "assistant", "content": "noted"}));
                }
                messages.push(serde_json::json!({"role": "user", "content": turn}));
            }
            let body = serde_json::json!({"model": "tiny", "messages": messages, "max_tokens": 1});
            ("/v1/chat/completions", body.to_string().into_bytes())
        } else {
            let prompt = format!(
                "{}\n{}\n{}\n",
                self.shared,
                self.context,
                self.turns.join("\nnoted\n")
            );
            let body = serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 1});
            ("/v1/completions", body.to_string().into_bytes())
        }
    }
}

/// About `bytes` bytes of words, different for each `seed`, so that the simulator's tokenizer
/// sees ordinary text.
fn words(bytes: usize, seed: usize) -> String {
    const WORDS: [&str; 12] = [
        "alpha", "beta", "gamma", "delta", "router", "cache", "block", "token", "prefix", "engine",
        "replica", "envoy",
    ];
    let mut text = String::with_capacity(bytes + 16);
    let mut state = seed as u64 ^ 0x9e37_79b9_7f4a_7c15;
    while text.len() < bytes {
        // xorshift: cheap, and the same text for the same seed.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        text.push_str(WORDS[(state % WORDS.len() as u64) as usize]);
        text.push(' ');
    }
    text
}

/// Each goal of the throughput issue, met or missed, with its figures.
fn verdicts(rows: &[serde_json::Value]) -> Vec<String> {
    let of = |size: usize, path: &str| -> Vec<&serde_json::Value> {
        rows.iter()
            .filter(|r| r["prompt_bytes"] == size && r["path"] == path)
            .collect()
    };
    let peak = |size: usize, path: &str| {
        of(size, path)
            .iter()
            .filter_map(|r| r["requests_per_s"].as_f64())
            .fold(0.0, f64::max)
    };
    let met = |ok: bool| if ok { "met" } else { "missed" };
    let mut verdicts = Vec::new();
    let sizes: Vec<usize> = {
        let mut sizes: Vec<usize> = rows
            .iter()
            .filter_map(|r| r["prompt_bytes"].as_u64().map(|s| s as usize))
            .collect();
        sizes.dedup();
        sizes
    };
    for &size in &sizes {
        let label = size_label(size);
        let (llmgw, floor) = (peak(size, "buffered 1 core"), peak(size, "floor 1 core"));
        let envoy_at_peak = of(size, "buffered 1 core")
            .iter()
            .max_by(|a, b| {
                a["requests_per_s"]
                    .as_f64()
                    .unwrap_or(0.0)
                    .total_cmp(&b["requests_per_s"].as_f64().unwrap_or(0.0))
            })
            .and_then(|r| r["envoy_cores_used"].as_f64())
            .unwrap_or(f64::NAN);
        if floor > 0.0 {
            verdicts.push(format!(
                "{label}: peak throughput at one router core {llmgw:.0} req/s = {:.0} % of the floor's \
                 {floor:.0} (goal ≥ 90 % at 8 KB: {}); its Envoy used {envoy_at_peak:.2} cores there",
                llmgw / floor * 100.0,
                met(llmgw >= 0.9 * floor),
            ));
        }
        if size > 100_000 {
            verdicts.push(format!(
                "{label}: peak {llmgw:.0} req/s at one router core vs 10 × the anchor's plateau \
                 ({:.0} req/s): {}",
                10.0 * ANCHOR_PLATEAU_RPS,
                met(llmgw >= 10.0 * ANCHOR_PLATEAU_RPS),
            ));
            for row in of(size, "buffered 1 core") {
                if row["clients"] == 200
                    && let Some(added) = row["added_p99_ms"].as_f64()
                {
                    verdicts.push(format!(
                        "{label}, 200 clients: added p99 {added:+.2} ms (goal ≤ 20 ms; the anchor \
                         adds 1,450 ms): {}",
                        met(added <= 20.0)
                    ));
                }
            }
        }
        // CPU per request over the whole sweep, llmgw over the floor, both on one core.
        let cpu_per_request = |path: &str| {
            let (cpu, requests) = of(size, path).iter().fold((0.0, 0.0), |(c, n), r| {
                let requests = r["requests"].as_f64().unwrap_or(0.0);
                let per = r["ext_proc_cpu_us_per_request"].as_f64().unwrap_or(0.0);
                (c + per * requests, n + requests)
            });
            cpu / requests
        };
        let (ours, floors) = (
            cpu_per_request("buffered 1 core"),
            cpu_per_request("floor 1 core"),
        );
        if floors > 0.0 {
            verdicts.push(format!(
                "{label}: router CPU {ours:.0} µs/request vs the floor's {floors:.0} = {:.2}× \
                 (goal ≤ 1.2×): {}",
                ours / floors,
                met(ours <= 1.2 * floors),
            ));
        }
    }
    verdicts
}

#[cfg(test)]
mod tests {
    use super::cpu_list;

    #[test]
    fn cpu_lists_read_as_linux_writes_them() {
        assert_eq!(cpu_list("0-1"), Some(vec![0, 1]));
        assert_eq!(cpu_list("3"), Some(vec![3]));
        assert_eq!(cpu_list("2,4-5"), Some(vec![2, 4, 5]));
        for bad in ["", "1-", "a", "3-1", "0,,1"] {
            assert_eq!(cpu_list(bad), None, "{bad:?}");
        }
    }
}
