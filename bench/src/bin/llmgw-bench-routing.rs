//! `make bench-routing`: routing policies side by side on the same simulated replicas and the
//! same workload, one after another in one run; `make bench-routing-vllm`: the same on real vLLM
//! engines.
//!
//! The `llmgw-sim` replicas (latency model on, small KV caches) start once and serve every
//! policy; their prefix caches are reset before each. With `--vllm-python` and `--vllm-model`
//! every replica is a real vLLM engine instead (vLLM's CPU build serving a tiny model, started
//! in parallel as processes of their own, blocks of 32 tokens; `llmgw_integration::vllm`): the
//! rest of the bench is the same, the engines' KV events subscribed to as the sims' are.
//! Policies: Envoy's own `RANDOM` and `ROUND_ROBIN`; `pinned`, no router at all, each tenant's
//! conversations sent by hand to one replica (`pinned_failover`: to the next one while its own
//! is down, so that a restart costs no request); llmgw with load scorers only, with the
//! approximate prefix tree only, and precise (KV index fed by llmgw-agent); and the
//! `vllm-router` peer (its own HTTP proxy) with `round_robin`, `cache_aware` and `kv_aware`
//! (subscribed to the replicas' KV events).
//!
//! Load: unless `--rate` is given, the capacity is measured first as the request rate the sims
//! complete under round robin with many conversations in flight (closed loop), and every policy
//! is then offered `--load` (0.8) of it, open loop: conversations start at exponential intervals
//! from a fixed seed, so every policy sees the same conversations at the same instants.
//!
//! Per policy: TTFT percentiles of the requests sent after the warm-up, the sims' own prefix
//! cache hit rate (`vllm:prefix_cache_*` deltas) over the same span, throughput, and the
//! router's (and Envoy's) CPU per request from `/proc/PID/stat`.
//!
//! Last, the hit-rate ceiling: the same conversations at the same instants sent straight to one
//! more sim whose cache never evicts (and without the latency model), so that every prefix any
//! earlier request computed is still there. No router can beat its hit rate. With vLLM it is
//! one more engine with room for every block of the run, started with the others.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use llmgw_bench::routing::{
    Policy, PolicyReport, hit_rate_summary, markdown_table, offered_rate, percentile,
    rate_in_window, run_label,
};
use llmgw_integration::agent::AgentCommand;
use llmgw_integration::envoy::{EnvoyCommand, plain_envoy_config};
use llmgw_integration::procfs::proc_stat_cpu_seconds;
use llmgw_integration::router::{RouterAddrs, RouterCommand, RouterProcess};
use llmgw_integration::system::envoy_config_for_routers;
use llmgw_integration::vllm::{self, VllmConfig};
use llmgw_integration::workload::{self, Results, WorkloadConfig};
use llmgw_integration::{
    ChildGuard, SimHandle, cache_sim_args, free_addr, free_port, repo_root, spawn_sim_with_env,
};
use parking_lot::Mutex;

const MODEL: &str = "tiny";
/// The sims' block size (vLLM's default on GPUs); with vLLM's CPU build it is
/// [`vllm::CPU_BLOCK_SIZE`] (see [`Args::block_size`]).
const SIM_BLOCK_SIZE: usize = 16;
const SEED: &str = "1729";
const NODE: &str = "node-a";

#[derive(Parser)]
#[command(
    name = "llmgw-bench-routing",
    about = "Routing policies side by side on the same simulated (or real vLLM) replicas"
)]
struct Args {
    /// Policies to run, in order (default: all; pinned_failover only with
    /// --restart-replica-at). Names: random, round_robin, pinned, pinned_failover, least_loaded,
    /// approx_prefix, llmgw_precise, llmgw_precise_tokenize, vllm-router:round_robin,
    /// vllm-router:cache_aware, vllm-router:kv_aware.
    #[arg(long, value_delimiter = ',')]
    policies: Vec<Policy>,
    /// Seconds of traffic per policy (the first --warmup-seconds are not measured).
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Seconds at the start of each run left out of every number.
    #[arg(long, default_value_t = 5)]
    warmup_seconds: u64,
    /// Offered load as a share of the round-robin capacity.
    #[arg(long, default_value_t = 0.8)]
    load: f64,
    /// Offered requests per second (skips the capacity measurement; --load is then ignored).
    #[arg(long)]
    rate: Option<f64>,
    /// Seconds of the closed-loop capacity measurement under round robin.
    #[arg(long, default_value_t = 20)]
    calibrate_seconds: u64,
    /// Conversations in flight during the capacity measurement.
    #[arg(long, default_value_t = 48)]
    calibrate_concurrency: usize,
    /// Replicas (simulated, or vLLM engines with --vllm-python).
    #[arg(long, default_value_t = 4)]
    replicas: usize,
    /// KV-cache blocks per sim (16 tokens each): small, so that routing matters. With vLLM,
    /// --vllm-blocks.
    #[arg(long, default_value_t = 160)]
    blocks_per_replica: usize,
    /// Tenants, each with its own long system prompt (the last one salts its requests).
    #[arg(long, default_value_t = 4)]
    tenants: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 5)]
    turns: usize,
    /// Seed of the arrival process.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// llmgw's tokenization deadline (the replicas answer /tokenize on the same two cores as
    /// everything else) [default: 300ms with sims, 800ms with vLLM, under Envoy's 1 s ext_proc
    /// message timeout].
    #[arg(long)]
    tokenize_deadline: Option<String>,
    /// Extra `llmgw-router serve` flags for every llmgw policy (e.g.
    /// `--router-arg=--imbalance-threshold=16`); they come last, so they override this bench's.
    #[arg(long = "router-arg", allow_hyphen_values = true)]
    router_args: Vec<String>,
    /// Extra `llmgw-sim` flags (e.g. `--sim-arg=--sim-prefill-us-per-token=100`).
    #[arg(long = "sim-arg", allow_hyphen_values = true)]
    sim_args: Vec<String>,
    /// Real vLLM replicas: the python of a virtual environment with vLLM's CPU build
    /// (`.venv-vllm/bin/python`, `e2e/install_vllm.sh`). Needs --vllm-model. Every replica,
    /// the ceiling's too, is then a vLLM engine serving the model as `tiny`, with blocks of 32
    /// tokens. Give --rate: the capacity calibration works but takes long on real engines.
    #[arg(long, requires = "vllm_model")]
    vllm_python: Option<PathBuf>,
    /// The model directory the vLLM engines serve (`e2e/make_tiny_model.py`'s output: it
    /// tokenizes as the sims do); `llmgw_precise` reads its tokenizer.json and
    /// chat_template.jinja. Needs --vllm-python.
    #[arg(long, requires = "vllm_python")]
    vllm_model: Option<PathBuf>,
    /// KV-cache blocks of 32 tokens per measured vLLM engine (`--num-gpu-blocks-override`): 80
    /// holds about as many tokens as a sim's default 160 blocks of 16.
    #[arg(long, default_value_t = 80)]
    vllm_blocks: usize,
    /// KV-cache blocks of the vLLM ceiling engine: room for every block of the run, so that it
    /// never evicts.
    #[arg(long, default_value_t = 8192)]
    vllm_ceiling_blocks: usize,
    /// The vLLM engines' `--max-model-len` (at most (--vllm-blocks - 1) × 32: vLLM keeps one
    /// block aside).
    #[arg(long, default_value_t = 2048)]
    vllm_max_model_len: usize,
    /// How long the vLLM engines, started together, may take to answer /health.
    #[arg(long, default_value_t = 900)]
    vllm_startup_seconds: u64,
    /// Extra vLLM api_server flags for every engine (e.g. `--vllm-arg=--max-num-seqs=8`); they
    /// come last.
    #[arg(long = "vllm-arg", allow_hyphen_values = true)]
    vllm_args: Vec<String>,
    /// The vllm-router executable (`pip install vllm-router`).
    #[arg(long)]
    vllm_router: Option<PathBuf>,
    /// Where the report, the TTFT samples and Envoy configs go.
    #[arg(long, default_value = "target/bench-routing")]
    out_dir: PathBuf,
    /// Runs of each policy, the policies taking turns run by run; the report then sums up each
    /// policy's hit rate over its runs, and each run's requests, router logs and Envoy configs
    /// go to `run-N/` under --out-dir.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    runs: u16,
    /// Skip the hit-rate ceiling run (one more replica with an unbounded cache) at the end.
    #[arg(long)]
    no_ceiling: bool,
    /// llmgw routers behind the one Envoy, for every llmgw policy (the agent feeds each);
    /// Envoy spreads the requests' ext_proc streams over them round robin.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=8))]
    routers: u8,
    /// With --routers above 1: the routers do not peer (by default each is given the others'
    /// feed ports with --peer, and they share picks and requests in flight).
    #[arg(long)]
    no_peering: bool,
    /// LoRA adapters of the model (0: none): every sim serves them (`--enable-lora`), tenant
    /// `t` talks to adapter `t % adapters`, and each adapter's blocks are its own (vLLM hashes
    /// the adapter into every block).
    #[arg(long, default_value_t = 0)]
    adapters: usize,
    /// With --adapters: distinct adapters each sim runs at once (`--max-loras`); a request for
    /// another waits for a slot.
    #[arg(long, default_value_t = 2)]
    max_loras: usize,
    /// One conversation in N (0: none; by a hash of its id, so every tenant has some) bypasses
    /// the router: sent straight to a replica, the same one for each tenant (tenant modulo
    /// replicas), as a client that knows a replica's address would. Only the precise index (the
    /// agent reads every replica's KV events) sees what those conversations cache.
    #[arg(long, default_value_t = 0)]
    bypass_every: usize,
    /// Percent of conversations that belong to tenant 0 (a hot tenant), on top of its share of
    /// the rest: at a high enough rate it saturates one replica, and load must outvote
    /// affinity (see the TTFT p99 and the split over the replicas).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=100))]
    hot_tenant_percent: u8,
    /// Draw each conversation's tenant by a hash of its id and `--seed` (the same in every run
    /// of a seed) instead of taking the tenants in turn, where neighbours in the order are
    /// active together and which of them share a cache changes the hit rate. Each seed draws
    /// its own tenants: which are heavy, and in which order they first come.
    #[arg(long)]
    tenants_drawn: bool,
    /// Seconds into each policy's run (after the warm-up, 0: never) at which replica 0 is
    /// killed, as an engine crash would; it starts again on its ports, with an empty cache and
    /// its event sequence at 0, `--restart-downtime-ms` later. The ceiling run has no restart.
    #[arg(long, default_value_t = 0)]
    restart_replica_at: u64,
    /// How long the killed replica stays down.
    #[arg(long, default_value_t = 3000)]
    restart_downtime_ms: u64,
}

impl Args {
    /// The vLLM engines' settings, when the replicas are vLLM engines.
    fn vllm(&self) -> Option<VllmConfig> {
        Some(VllmConfig {
            python: self.vllm_python.clone()?,
            model: self.vllm_model.clone()?,
            served_model_name: MODEL.to_owned(),
            seed: SEED.to_owned(),
            block_size: vllm::CPU_BLOCK_SIZE,
            max_model_len: self.vllm_max_model_len,
            extra_args: self.vllm_args.clone(),
        })
    }

    /// The replicas' block size, which the router, the agent and vllm-router are told.
    fn block_size(&self) -> usize {
        match self.vllm_python {
            Some(_) => vllm::CPU_BLOCK_SIZE,
            None => SIM_BLOCK_SIZE,
        }
    }

    /// KV-cache blocks per measured replica.
    fn blocks(&self) -> usize {
        match self.vllm_python {
            Some(_) => self.vllm_blocks,
            None => self.blocks_per_replica,
        }
    }

    /// What the replicas are, for the report.
    fn engine(&self) -> &'static str {
        match self.vllm_python {
            Some(_) => "vLLM engine",
            None => "sim",
        }
    }

    fn tokenize_deadline(&self) -> String {
        self.tokenize_deadline.clone().unwrap_or_else(|| {
            match self.vllm_python {
                Some(_) => "800ms",
                None => "300ms",
            }
            .to_owned()
        })
    }

    /// `llmgw_precise`'s tokenizer and chat template: the sims' assets, or the vLLM model's
    /// (the same tokenizer, `e2e/make_tiny_model.py`).
    fn tokenizer_files(&self) -> (PathBuf, PathBuf) {
        let dir = match &self.vllm_model {
            Some(model) => model.clone(),
            None => repo_root().join("sim/assets"),
        };
        (dir.join("tokenizer.json"), dir.join("chat_template.jinja"))
    }

    /// When replica 0 goes down and for how long, if it does.
    fn restart(&self) -> Option<(Duration, Duration)> {
        (self.restart_replica_at > 0).then(|| {
            (
                Duration::from_secs(self.restart_replica_at),
                Duration::from_millis(self.restart_downtime_ms),
            )
        })
    }
}

/// The sims' `--enable-lora` flags for `args.adapters` adapters with `max_loras` slots.
fn lora_sim_args(args: &Args, max_loras: usize) -> Vec<String> {
    if args.adapters == 0 {
        return Vec::new();
    }
    let mut flags = vec![
        "--enable-lora".to_owned(),
        "--max-loras".to_owned(),
        max_loras.to_string(),
        "--lora-modules".to_owned(),
    ];
    flags.extend((0..args.adapters).map(|i| {
        let name = workload::adapter_name(i);
        format!("{name}=/adapters/{name}")
    }));
    flags
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = llmgw_bench::client_runtime().context("tokio runtime")?;
    runtime.block_on(run(args))
}

async fn run(mut args: Args) -> anyhow::Result<()> {
    if args.policies.is_empty() {
        // Without a restart, pinned_failover is pinned run again.
        let restart = args.restart_replica_at > 0;
        args.policies = Policy::ALL
            .into_iter()
            .filter(|&p| p != Policy::PinnedFailover || restart)
            .collect();
    }
    if args.warmup_seconds >= args.seconds {
        bail!("--warmup-seconds must be below --seconds");
    }
    if args.vllm_python.is_some() {
        check_vllm_args(&mut args)?;
    }
    if let Some((at, downtime)) = args.restart()
        && (at < Duration::from_secs(args.warmup_seconds)
            || at + downtime >= Duration::from_secs(args.seconds))
    {
        bail!(
            "--restart-replica-at must fall after the warm-up, and the replica must be back before --seconds"
        );
    }
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("create {}", args.out_dir.display()))?;
    let vllm_router = args
        .vllm_router
        .clone()
        .unwrap_or_else(|| repo_root().join(".venv/bin/vllm-router"));
    let machine_before = machine_state();

    let http = reqwest::Client::new();
    // With vLLM the ceiling's engine starts with the others (a start takes a minute).
    let (mut sims, ceiling_engine) = start_replicas(&args, &http).await?;

    let (rate, calibration) = match args.rate {
        Some(rate) => (
            rate,
            format!("offered rate {rate:.1} req/s, given by --rate"),
        ),
        None => {
            if args.vllm_python.is_some() {
                println!(
                    "note: no --rate: measuring the capacity of real vLLM engines ({} \
                     conversations in flight) takes long and loads the machine; give --rate",
                    args.calibrate_concurrency
                );
            }
            let capacity = measure_capacity(&args, &sims, &http).await?;
            let rate = offered_rate(capacity, args.load);
            (
                rate,
                format!(
                    "round-robin capacity {capacity:.1} req/s (closed loop, {} conversations in \
                     flight, {} s, first {} s left out); offered {:.0} % of it: {rate:.1} req/s",
                    args.calibrate_concurrency,
                    args.calibrate_seconds,
                    args.warmup_seconds.min(args.calibrate_seconds / 2),
                    args.load * 100.0
                ),
            )
        }
    };
    println!("{calibration}");

    let mut reports = Vec::new();
    // In run order, for the plot's legend.
    let mut ttfts: Vec<serde_json::Value> = Vec::new();
    let mut notes = Vec::new();
    let several = args.runs > 1;
    for run in 1..=usize::from(args.runs) {
        let run_dir = if several {
            args.out_dir.join(format!("run-{run}"))
        } else {
            args.out_dir.clone()
        };
        std::fs::create_dir_all(&run_dir)
            .with_context(|| format!("create {}", run_dir.display()))?;
        for &policy in &args.policies {
            let label = run_label(&policy.to_string(), several.then_some(run));
            if matches!(policy, Policy::VllmRouter(_)) && !vllm_router.exists() {
                let note = format!(
                    "{label}: skipped, {} not found (pip install vllm-router)",
                    vllm_router.display()
                );
                println!("{note}");
                notes.push(note);
                continue;
            }
            workload::reset_prefix_caches(&http, &sims).await;
            println!("\n== {label}: {} ==", policy.setup());
            let stack = match start_stack(policy, &args, &run_dir, &sims, &vllm_router, &http).await
            {
                Ok(stack) => stack,
                Err(error) => {
                    let note = format!("{label}: did not start: {error:#}");
                    println!("{note}");
                    notes.push(note);
                    continue;
                }
            };
            let Measured {
                mut report,
                ttft_ms: samples,
                extra,
                requests,
            } = measure_policy(
                policy,
                &stack,
                &args,
                rate,
                &mut sims,
                args.restart(),
                &http,
            )
            .await
            .with_context(|| format!("measuring {label}"))?;
            write(&run_dir.join(format!("requests-{policy}.csv")), &requests)?;
            report.run = several.then_some(run);
            println!("{}", markdown_table(std::slice::from_ref(&report)));
            if let Some(extra) = extra {
                println!("{extra}");
                notes.push(format!("{label}: {extra}"));
            }
            ttfts.push(serde_json::json!({"policy": label, "ttft_ms": samples}));
            reports.push(report);
            drop(stack);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    let ceiling = if args.no_ceiling {
        String::new()
    } else {
        println!(
            "\n== hit-rate ceiling: one {} whose cache never evicts ==",
            args.engine()
        );
        let ceiling = measure_ceiling(&args, rate, ceiling_engine, &http).await?;
        let line = match ceiling.hit_rate {
            Some(hit_rate) => format!(
                "Hit-rate ceiling: {:.1} % (the same conversations at the same instants, straight \
                 to one {} whose cache never evicts; no router can do better).\n",
                hit_rate * 100.0,
                args.engine()
            ),
            None => "Hit-rate ceiling: no requests measured.\n".to_string(),
        };
        println!("{line}");
        line
    };

    let mut table = markdown_table(&reports);
    if several {
        table = format!(
            "{table}\nHit rate over {} runs of each policy, taking turns:\n\n{}",
            args.runs,
            hit_rate_summary(&reports)
        );
    }
    let machine_after = machine_state();
    let report = format!(
        "{table}\n{ceiling}{calibration}; {} {}s × {} blocks of {} tokens{}; {} tenants{}{}, {} \
         turns per conversation; {} s per policy, first {} s not measured; seed {}; {} llmgw \
         router(s) per llmgw policy{}, extra flags {:?}.\n\
         machine before: {machine_before}\nmachine after: {machine_after}\n{}",
        args.replicas,
        args.engine(),
        args.blocks(),
        args.block_size(),
        match &args.vllm_model {
            Some(model) => format!(
                " (vLLM's CPU build serving {}, extra flags {:?})",
                model.display(),
                args.vllm_args
            ),
            None => String::new(),
        },
        args.tenants,
        match args.adapters {
            0 => String::new(),
            n => format!(" over {n} LoRA adapters ({} slots per sim)", args.max_loras),
        },
        scenario(&args),
        args.turns,
        args.seconds,
        args.warmup_seconds,
        args.seed,
        args.routers,
        match (args.routers, args.no_peering) {
            (1, _) => "",
            (_, false) => " (peering)",
            (_, true) => " (not peering)",
        },
        args.router_args,
        notes.iter().map(|n| format!("- {n}\n")).collect::<String>()
    );
    println!("\n{report}");
    write(&args.out_dir.join("report.md"), &report)?;
    write(
        &args.out_dir.join("report.json"),
        &serde_json::to_string_pretty(&reports)?,
    )?;
    write(
        &args.out_dir.join("ttft.json"),
        &serde_json::to_string(&ttfts)?,
    )?;
    println!(
        "wrote {0}/report.md, {0}/report.json and {0}/ttft.json",
        args.out_dir.display()
    );
    Ok(())
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("write {}", path.display()))
}

/// What `--vllm-python` rules out or needs; makes the model path absolute.
fn check_vllm_args(args: &mut Args) -> anyhow::Result<()> {
    if args.restart_replica_at > 0 {
        bail!(
            "--restart-replica-at needs sims: a vLLM engine takes about a minute to start again, \
             longer than a run"
        );
    }
    if args.adapters > 0 {
        bail!("--adapters needs sims (the vLLM engines serve no LoRA adapter here)");
    }
    if !args.sim_args.is_empty() {
        bail!("--sim-arg is for sims: give vLLM's flags with --vllm-arg");
    }
    // vLLM keeps one block aside (the null block) and refuses to start when the rest cannot
    // hold one sequence of the longest length.
    if args.vllm_blocks.saturating_sub(1) * vllm::CPU_BLOCK_SIZE < args.vllm_max_model_len {
        bail!(
            "--vllm-blocks {} (one of them vLLM's null block) × {} tokens must hold \
             --vllm-max-model-len {}",
            args.vllm_blocks,
            vllm::CPU_BLOCK_SIZE,
            args.vllm_max_model_len
        );
    }
    let python = args.vllm_python.as_ref().context("--vllm-python")?;
    if !python.exists() {
        bail!(
            "{} not found: install vLLM with e2e/install_vllm.sh .venv-vllm (make bench-routing-vllm does)",
            python.display()
        );
    }
    let model = args.vllm_model.as_ref().context("--vllm-model")?;
    // vLLM loads the model from its own working directory: make the path absolute.
    let model =
        std::path::absolute(model).with_context(|| format!("--vllm-model {}", model.display()))?;
    if !model.join("tokenizer.json").exists() || !model.join("config.json").exists() {
        bail!(
            "{} holds no model: build it with `.venv-vllm/bin/python e2e/make_tiny_model.py {0}`",
            model.display()
        );
    }
    args.vllm_model = Some(model);
    Ok(())
}

/// The measured replicas, once for every policy, and with vLLM the ceiling's engine (with sims
/// it is started at the end, by [`measure_ceiling`]).
async fn start_replicas(
    args: &Args,
    http: &reqwest::Client,
) -> anyhow::Result<(Vec<SimHandle>, Option<SimHandle>)> {
    let Some(vllm) = args.vllm() else {
        println!(
            "starting {} llmgw-sim replicas ({} blocks of {SIM_BLOCK_SIZE} tokens each) …",
            args.replicas, args.blocks_per_replica
        );
        let sims = (0..args.replicas)
            .map(|_| {
                spawn_sim_with_env(
                    sim_args(args, "tcp://127.0.0.1:*"),
                    [("PYTHONHASHSEED", SEED)],
                )
            })
            .collect();
        return Ok((sims, None));
    };
    let ceiling = !args.no_ceiling;
    println!(
        "starting {} vLLM engines ({} blocks of {} tokens each){} in parallel, logs in {}/vllm-*.log …",
        args.replicas,
        args.vllm_blocks,
        vllm.block_size,
        if ceiling {
            format!(" and the ceiling's ({} blocks)", args.vllm_ceiling_blocks)
        } else {
            String::new()
        },
        args.out_dir.display()
    );
    let mut engines = Vec::new();
    for i in 0..args.replicas {
        let name = i.to_string();
        let log = args.out_dir.join(format!("vllm-{name}.log"));
        engines.push(vllm.spawn(&name, args.vllm_blocks, &log)?);
    }
    if ceiling {
        let log = args.out_dir.join("vllm-ceiling.log");
        engines.push(vllm.spawn("ceiling", args.vllm_ceiling_blocks, &log)?);
    }
    let limit = Duration::from_secs(args.vllm_startup_seconds);
    let started = vllm::wait_healthy(http, &mut engines, limit).await?;
    println!(
        "every vLLM engine up after {:.0} s",
        started
            .iter()
            .max()
            .copied()
            .unwrap_or_default()
            .as_secs_f64()
    );
    let mut replicas: Vec<SimHandle> = engines.into_iter().map(|e| e.replica).collect();
    let ceiling = ceiling.then(|| replicas.pop()).flatten();
    Ok((replicas, ceiling))
}

/// A measured sim's flags, its KV events bound at `events` on vLLM's default topic (empty),
/// which every subscriber here accepts.
fn sim_args(args: &Args, events: &str) -> Vec<String> {
    let events =
        format!(r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"{events}"}}"#);
    let mut sim_args = cache_sim_args(MODEL, SIM_BLOCK_SIZE, args.blocks_per_replica, &events);
    sim_args.extend(lora_sim_args(args, args.max_loras));
    sim_args.extend(args.sim_args.iter().cloned());
    sim_args
}

/// Kills `sim`, waits `downtime`, and starts it again on its ports with an empty cache, as an
/// engine restart does. Returns its prefix-cache counters (hits, queries) just before the
/// kill, which the new process counts from 0 again.
async fn crash_and_restart(
    args: &Args,
    sim: &mut SimHandle,
    downtime: Duration,
    http: &reqwest::Client,
) -> anyhow::Result<(f64, f64)> {
    let counted = workload::cache_counters(http, std::slice::from_ref(sim)).await;
    sim.kill();
    println!("replica {} killed; back in {downtime:?}", sim.addr);
    tokio::time::sleep(downtime).await;
    let events = sim.events_rebind().context("a sim publishes no events")?;
    let mut flags = sim_args(args, &events);
    flags.extend(["--port".to_owned(), sim.addr.port().to_string()]);
    // Blocks until the new process listens (well under a second).
    let new = tokio::task::block_in_place(|| spawn_sim_with_env(flags, [("PYTHONHASHSEED", SEED)]));
    sim.restarted_as(new);
    println!("replica {} restarted with an empty cache", sim.addr);
    Ok(counted)
}

/// What the workload adds to the plain tenants ("" when nothing).
fn scenario(args: &Args) -> String {
    let mut parts = Vec::new();
    if args.bypass_every > 0 {
        parts.push(format!(
            "one conversation in {} straight to its tenant's replica, bypassing the router",
            args.bypass_every
        ));
    }
    if args.tenants_drawn {
        parts.push(
            "tenants drawn by a hash of each conversation's id and the seed, not in turn"
                .to_owned(),
        );
    }
    if args.hot_tenant_percent > 0 {
        parts.push(format!(
            "tenant 0 hot ({} % of conversations on top of its share)",
            args.hot_tenant_percent
        ));
    }
    if let Some((at, downtime)) = args.restart() {
        parts.push(format!(
            "replica 0 killed {} s into each run and restarted empty {} ms later; not in the \
             ceiling run",
            at.as_secs(),
            downtime.as_millis()
        ));
    }
    parts.iter().map(|p| format!(" ({p})")).collect()
}

/// The workload at `rate` straight to one sim with room for every block the run computes and
/// no latency model: the most any router could get from the replicas' prefix caches. With
/// vLLM, to `engine`, the ceiling's engine started with the others (room for every block; its
/// latency is real).
async fn measure_ceiling(
    args: &Args,
    rate: f64,
    engine: Option<SimHandle>,
    http: &reqwest::Client,
) -> anyhow::Result<PolicyReport> {
    let mut sim = match engine {
        Some(engine) => engine,
        None => spawn_ceiling_sim(args),
    };
    workload::reset_prefix_caches(http, std::slice::from_ref(&sim)).await;
    let stack = Stack {
        url: sim.url(),
        llmgw_admins: Vec::new(),
        router_pids: Vec::new(),
        envoy_pid: None,
        _guards: Vec::new(),
    };
    let sims = std::slice::from_mut(&mut sim);
    let measured = measure_policy(Policy::RoundRobin, &stack, args, rate, sims, None, http)
        .await
        .context("measuring the hit-rate ceiling")?;
    Ok(measured.report)
}

/// The ceiling's sim: room for every block, no latency model.
fn spawn_ceiling_sim(args: &Args) -> SimHandle {
    // The same context limit as the measured sims, so that the same requests are refused.
    let max_model_len = ((args.blocks_per_replica.saturating_sub(1)) * SIM_BLOCK_SIZE)
        .min(8192)
        .to_string();
    let block_size = SIM_BLOCK_SIZE.to_string();
    let mut sim_args: Vec<String> = [
        "--served-model-name",
        MODEL,
        "--block-size",
        &block_size,
        "--num-gpu-blocks-override",
        "1000000",
        "--max-model-len",
        &max_model_len,
        "--sim-no-latency",
    ]
    .map(str::to_owned)
    .to_vec();
    // Every adapter in a slot of its own: the ceiling waits for no adapter.
    sim_args.extend(lora_sim_args(args, args.adapters.max(1)));
    spawn_sim_with_env(sim_args, [("PYTHONHASHSEED", SEED)])
}

/// Requests per second the sims complete under Envoy round robin with many conversations in
/// flight: the capacity the offered load is a share of.
async fn measure_capacity(
    args: &Args,
    sims: &[SimHandle],
    http: &reqwest::Client,
) -> anyhow::Result<f64> {
    workload::reset_prefix_caches(http, sims).await;
    println!(
        "measuring the round-robin capacity: {} conversations in flight for {} s …",
        args.calibrate_concurrency, args.calibrate_seconds
    );
    let vllm_router = PathBuf::new();
    let stack = start_stack(
        Policy::RoundRobin,
        args,
        &args.out_dir,
        sims,
        &vllm_router,
        http,
    )
    .await?;
    let results = Arc::new(Mutex::new(Results::default()));
    let duration = Duration::from_secs(args.calibrate_seconds);
    let config = WorkloadConfig {
        tenants: args.tenants,
        adapters: args.adapters,
        turns_per_conversation: args.turns,
        concurrency: args.calibrate_concurrency,
        duration,
        ..WorkloadConfig::default()
    };
    workload::run(
        stack.url.clone(),
        config,
        Arc::clone(&results),
        std::future::pending(),
    )
    .await;
    drop(stack);
    let warmup = Duration::from_secs(args.warmup_seconds.min(args.calibrate_seconds / 2));
    let results = results.lock();
    let completed = results
        .samples
        .iter()
        .filter(|s| s.status == 200 && s.done_at >= warmup && s.done_at <= duration)
        .count();
    if completed == 0 {
        bail!(
            "no request completed during the capacity measurement ({} errors; first: {:?})",
            results.errors.len(),
            results.errors.first()
        );
    }
    Ok(rate_in_window(completed, (duration - warmup).as_secs_f64()))
}

/// What serves one policy; dropping it stops every process.
struct Stack {
    /// Where clients send requests.
    url: String,
    /// The llmgw routers' admin addresses (none for other proxies).
    llmgw_admins: Vec<SocketAddr>,
    /// Processes whose CPU counts as the router's (llmgw-router + agent, or vllm-router).
    router_pids: Vec<u32>,
    envoy_pid: Option<u32>,
    // Dropped in order: the proxy first.
    _guards: Vec<ChildGuard>,
}

/// Starts what `policy` routes through; its Envoy config and router logs go to `dir`.
async fn start_stack(
    policy: Policy,
    args: &Args,
    dir: &Path,
    sims: &[SimHandle],
    vllm_router: &Path,
    http: &reqwest::Client,
) -> anyhow::Result<Stack> {
    let replicas: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    match policy {
        // Pinned sends every request straight to a replica: its Envoy carries none.
        Policy::Random | Policy::RoundRobin | Policy::Pinned | Policy::PinnedFailover => {
            let lb = if policy == Policy::Random {
                "RANDOM"
            } else {
                "ROUND_ROBIN"
            };
            let (listen, admin) = (free_port(), free_port());
            let envoy = start_envoy(
                dir,
                policy,
                (listen, admin),
                plain_envoy_config(lb, listen, admin, &replicas),
            )?;
            wait_envoy(http, admin).await?;
            Ok(Stack {
                url: format!("http://127.0.0.1:{listen}"),
                llmgw_admins: Vec::new(),
                router_pids: Vec::new(),
                envoy_pid: Some(envoy.id()),
                _guards: vec![envoy],
            })
        }
        Policy::LeastLoaded
        | Policy::ApproxPrefix
        | Policy::LlmgwPrecise
        | Policy::LlmgwPreciseTokenize => {
            // Every router of the policy gets the same flags.
            let mut flags: Vec<String> =
                vec!["--tokenize-deadline".to_owned(), args.tokenize_deadline()];
            let block_size = args.block_size();
            // Replicas belong to the agent's node only where an agent runs: otherwise the
            // router would wait for that node's blocks before it is ready.
            let models: Vec<String> = std::iter::once(MODEL.to_owned())
                .chain((0..args.adapters).map(workload::adapter_name))
                .collect();
            for r in &replicas {
                for model in &models {
                    let spec = if policy.uses_agent() {
                        format!("{model}={r}@{NODE}")
                    } else {
                        format!("{model}={r}")
                    };
                    flags.extend(["--replica".to_owned(), spec]);
                }
            }
            match policy {
                Policy::LeastLoaded => {
                    flags.extend(["--weight-prefix".to_owned(), "0".to_owned()]);
                }
                Policy::LlmgwPrecise => {
                    // The model's own tokenizer and chat template, as a user gives them: the
                    // router tokenizes in process (checking a sample against /tokenize).
                    let (tokenizer, chat_template) = args.tokenizer_files();
                    flags.extend([
                        "--model".to_owned(),
                        format!(
                            "{MODEL}=block_size={block_size},seed={SEED},tokenizer={},chat_template={}",
                            tokenizer.display(),
                            chat_template.display()
                        ),
                    ]);
                }
                Policy::LlmgwPreciseTokenize => {
                    flags.extend([
                        "--model".to_owned(),
                        format!("{MODEL}=block_size={block_size},seed={SEED}"),
                    ]);
                }
                // No hash settings: the affinity slot can only use the prefix tree.
                _ => {}
            }
            flags.extend(args.router_args.iter().cloned());
            let mut routers: Vec<RouterAddrs> = Vec::new();
            let mut router_guards = Vec::new();
            // Feed ports chosen up front, so that each router can be told the others'.
            let feeds: Vec<SocketAddr> = (0..args.routers).map(|_| free_addr()).collect();
            for (i, feed) in feeds.iter().enumerate() {
                let peers = feeds
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| j != i && !args.no_peering)
                    .flat_map(|(_, peer)| ["--peer".to_owned(), format!("http://{peer}")]);
                let mut router = RouterCommand::new()
                    .feed(*feed)
                    .args(&flags)
                    .args(peers)
                    .env("RUST_LOG", log_filter());
                if log_filter_given() {
                    // One file per router, to tell their decisions apart.
                    let path = dir.join(format!("router-{policy}-{i}.log"));
                    let file = std::fs::File::create(&path)
                        .with_context(|| format!("create {}", path.display()))?;
                    router = router.stderr(file);
                }
                let RouterProcess { addrs, guard } = router.spawn()?;
                routers.push(addrs);
                router_guards.push(guard);
            }
            let mut router_pids: Vec<u32> = router_guards.iter().map(ChildGuard::id).collect();
            let mut guards = Vec::new();
            let agent = if policy.uses_agent() {
                let mut agent = AgentCommand::serve(NODE);
                for r in &routers {
                    agent = agent.router(r.feed);
                }
                let mut agent = agent
                    .hash_settings(MODEL, SEED, block_size)
                    .args(["--admin-addr", "127.0.0.1:0"])
                    .env("LLMGW_AGENT_LOG", "warn");
                for sim in sims {
                    let events = sim.events.as_deref().context("a sim publishes no events")?;
                    agent = agent.engine(sim.addr, events, None);
                }
                let agent = agent.spawn()?;
                router_pids.push(agent.id());
                Some(agent)
            } else {
                None
            };
            let (listen, envoy_admin) = (free_port(), free_port());
            let envoy = start_envoy(
                dir,
                policy,
                (listen, envoy_admin),
                envoy_config_for_routers(
                    &routers.iter().map(|r| r.grpc).collect::<Vec<_>>(),
                    listen,
                    envoy_admin,
                    &replicas,
                ),
            )?;
            let envoy_pid = envoy.id();
            guards.push(envoy);
            guards.extend(agent);
            guards.extend(router_guards);
            wait_envoy(http, envoy_admin).await?;
            for r in &routers {
                wait_llmgw(http, r.admin, replicas.len(), policy.uses_agent()).await?;
            }
            Ok(Stack {
                url: format!("http://127.0.0.1:{listen}"),
                llmgw_admins: routers.iter().map(|r| r.admin).collect(),
                router_pids,
                envoy_pid: Some(envoy_pid),
                _guards: guards,
            })
        }
        Policy::VllmRouter(vllm_policy) => {
            let (port, metrics_port) = (free_port(), free_port());
            let mut cmd = Command::new(vllm_router);
            cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--prometheus-port", &metrics_port.to_string()])
                .args(["--policy", vllm_policy.flag(), "--log-level", "warning"])
                .arg("--worker-urls")
                .args(sims.iter().map(SimHandle::url));
            if vllm_policy == llmgw_bench::routing::VllmRouterPolicy::KvAware {
                cmd.args(["--kv-event-model", MODEL])
                    .args(["--kv-event-block-size", &args.block_size().to_string()]);
                for sim in sims {
                    let events = sim.events.as_deref().context("a sim publishes no events")?;
                    cmd.arg("--kv-event-source")
                        .arg(format!("{}={events}", sim.url()));
                }
            }
            let router = spawn(cmd, "vllm-router")?;
            let url = format!("http://127.0.0.1:{port}");
            wait_http_ok(http, &format!("{url}/health"), "vllm-router").await?;
            Ok(Stack {
                url,
                llmgw_admins: Vec::new(),
                router_pids: vec![router.id()],
                envoy_pid: None,
                _guards: vec![router],
            })
        }
    }
}

/// The children's log filter: quiet by default; `LLMGW_BENCH_RUST_LOG` (e.g.
/// `warn,llmgw::router=debug`, a line per routed request) is what diagnosing a run needs.
fn log_filter() -> String {
    std::env::var("LLMGW_BENCH_RUST_LOG").unwrap_or_else(|_| "warn".to_owned())
}

/// Whether `LLMGW_BENCH_RUST_LOG` asks for more than the default: each router then logs to
/// `router-POLICY-N.log` in the output directory.
fn log_filter_given() -> bool {
    std::env::var_os("LLMGW_BENCH_RUST_LOG").is_some()
}

fn spawn(mut cmd: Command, name: &str) -> anyhow::Result<ChildGuard> {
    let child = cmd
        .env("RUST_LOG", log_filter())
        .env("LLMGW_AGENT_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("spawn {name}"))?;
    Ok(ChildGuard::new(name, child))
}

/// Envoy with `config`, whose listener is on `listen` and admin on `admin`.
fn start_envoy(
    out_dir: &Path,
    policy: Policy,
    (listen, admin): (u16, u16),
    config: String,
) -> anyhow::Result<ChildGuard> {
    let envoy = EnvoyCommand::new(&format!("envoy-{policy}"), config, listen, admin)
        .config_dir(out_dir.to_owned())
        .spawn()?;
    Ok(envoy.guard)
}

async fn wait_envoy(http: &reqwest::Client, admin: u16) -> anyhow::Result<()> {
    wait_http_ok(http, &format!("http://127.0.0.1:{admin}/ready"), "envoy").await
}

async fn wait_http_ok(http: &reqwest::Client, url: &str, what: &str) -> anyhow::Result<()> {
    for _ in 0..600 {
        if http
            .get(url)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("{what} not ready within 30 s ({url})")
}

/// Until the router sees every replica healthy and, with an agent, the agent's stream is up.
async fn wait_llmgw(
    http: &reqwest::Client,
    admin: SocketAddr,
    replicas: usize,
    agent: bool,
) -> anyhow::Result<()> {
    let mut status = String::new();
    for _ in 0..600 {
        let metrics = workload::get_text(http, &format!("http://{admin}/metrics")).await;
        let healthy = metrics
            .lines()
            .filter(|l| l.starts_with("llmgw_replica_healthy{") && l.ends_with(" 1"))
            .count();
        let stream_up = !agent
            || metrics
                .lines()
                .any(|l| l.starts_with("llmgw_feed_streams ") && !l.ends_with(" 0"));
        if healthy == replicas && stream_up {
            return Ok(());
        }
        status = format!("healthy replicas {healthy}/{replicas}, agent stream up: {stream_up}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("llmgw-router not ready within 30 s ({status})")
}

/// CPU seconds of some processes together.
fn cpu_seconds(pids: &[u32]) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for pid in pids {
        let path = format!("/proc/{pid}/stat");
        let text = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
        total += proc_stat_cpu_seconds(&text).with_context(|| path.clone())?;
    }
    Ok(total)
}

struct Snapshot {
    router_cpu: f64,
    envoy_cpu: f64,
    /// Each sim's prefix-cache (hits, queries).
    cache: Vec<(f64, f64)>,
}

async fn snapshot(
    stack: &Stack,
    http: &reqwest::Client,
    sims: &[SimHandle],
) -> anyhow::Result<Snapshot> {
    let mut cache = Vec::with_capacity(sims.len());
    for sim in sims {
        cache.push(workload::cache_counters(http, std::slice::from_ref(sim)).await);
    }
    Ok(Snapshot {
        router_cpu: cpu_seconds(&stack.router_pids)?,
        envoy_cpu: cpu_seconds(stack.envoy_pid.as_slice())?,
        cache,
    })
}

/// One policy's run: its report row, the TTFT of each measured request (ms), the lines under
/// its row (the split over the replicas, the tenants' homes, the decisions), and every request
/// as `requests-POLICY.csv` ([`requests_csv`]).
struct Measured {
    report: PolicyReport,
    ttft_ms: Vec<f64>,
    extra: Option<String>,
    requests: String,
}

/// Runs the open-loop workload through `stack` and measures it, crashing and restarting
/// `sims[0]` at `restart` (when, for how long).
async fn measure_policy(
    policy: Policy,
    stack: &Stack,
    args: &Args,
    rate: f64,
    sims: &mut [SimHandle],
    restart: Option<(Duration, Duration)>,
    http: &reqwest::Client,
) -> anyhow::Result<Measured> {
    let duration = Duration::from_secs(args.seconds);
    let warmup = Duration::from_secs(args.warmup_seconds);
    let results = Arc::new(Mutex::new(Results::default()));
    let config = WorkloadConfig {
        tenants: args.tenants,
        adapters: args.adapters,
        turns_per_conversation: args.turns,
        duration,
        bypass_every: if matches!(policy, Policy::Pinned | Policy::PinnedFailover) {
            1
        } else {
            args.bypass_every
        },
        bypass_failover: policy == Policy::PinnedFailover,
        bypass: sims.iter().map(|s| format!("http://{}", s.addr)).collect(),
        hot_tenant_percent: args.hot_tenant_percent,
        tenants_drawn: args.tenants_drawn.then_some(args.seed),
        ..WorkloadConfig::default()
    };
    let started = Instant::now();
    let traffic = tokio::spawn(workload::run_open_loop(
        stack.url.clone(),
        config,
        rate,
        args.seed,
        Duration::from_secs(60),
        Arc::clone(&results),
    ));
    tokio::time::sleep_until((started + warmup).into()).await;
    let before = snapshot(stack, http, sims).await?;
    // What the crashed replica had counted before its counters started again from 0.
    let mut counted_before_restart = (0.0, 0.0);
    if let (Some((at, downtime)), Some(sim)) = (restart, sims.first_mut()) {
        tokio::time::sleep_until((started + at).into()).await;
        counted_before_restart = crash_and_restart(args, sim, downtime, http).await?;
    }
    traffic.await.context("workload task")?;
    if args.vllm_python.is_some() {
        // vLLM's API server updates its counters from the engine's stats as outputs arrive:
        // let the last ones land.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let after = snapshot(stack, http, sims).await?;

    let results = std::mem::take(&mut *results.lock());
    let addresses: Vec<String> = sims.iter().map(|s| s.addr.to_string()).collect();
    let requests = requests_csv(&results, &addresses);
    let measured: Vec<&workload::Sample> = results
        .samples
        .iter()
        .filter(|s| s.sent_at >= warmup)
        .collect();
    let mut ttft_ms: Vec<f64> = measured
        .iter()
        .filter(|s| s.status == 200)
        .map(|s| s.ttft.as_secs_f64() * 1e3)
        .collect();
    ttft_ms.sort_by(f64::total_cmp);
    let completed_in_window = results
        .samples
        .iter()
        .filter(|s| s.status == 200 && s.done_at >= warmup && s.done_at <= duration)
        .count();
    let per_request =
        |seconds: f64| (!measured.is_empty()).then(|| seconds / measured.len() as f64 * 1e6);
    // Per sim over the span: (hits, queries).
    let per_sim: Vec<(f64, f64)> = before
        .cache
        .iter()
        .zip(&after.cache)
        .enumerate()
        .map(|(i, (b, a))| {
            let restarted = if i == 0 {
                counted_before_restart
            } else {
                (0.0, 0.0)
            };
            (a.0 + restarted.0 - b.0, a.1 + restarted.1 - b.1)
        })
        .collect();
    let (hits, queries) = per_sim
        .iter()
        .fold((0.0, 0.0), |t, s| (t.0 + s.0, t.1 + s.1));
    let report = PolicyReport {
        policy: policy.to_string(),
        run: None,
        requests: ttft_ms.len(),
        errors: measured.iter().filter(|s| s.status != 200).count() + results.errors.len(),
        hit_rate: (queries > 0.0).then(|| hits / queries),
        ttft_p50_ms: percentile(&ttft_ms, 50.0),
        ttft_p90_ms: percentile(&ttft_ms, 90.0),
        ttft_p99_ms: percentile(&ttft_ms, 99.0),
        throughput_rps: rate_in_window(completed_in_window, (duration - warmup).as_secs_f64()),
        router_cpu_us: (!stack.router_pids.is_empty())
            .then(|| per_request(after.router_cpu - before.router_cpu))
            .flatten(),
        envoy_cpu_us: stack
            .envoy_pid
            .and_then(|_| per_request(after.envoy_cpu - before.envoy_cpu)),
    };
    if let Some(first) = results.errors.first() {
        println!("{} client errors, first: {first}", results.errors.len());
    }
    if let Some(first) = results.failures.first() {
        println!(
            "{} failed responses, first: {first}",
            results.failures.len()
        );
    }
    // Where the prompt tokens went and how each replica's cache did with them.
    let split: Vec<String> = per_sim
        .iter()
        .enumerate()
        .map(|(i, &(h, q))| {
            let share = if queries > 0.0 { q / queries } else { 0.0 };
            let rate = if q > 0.0 { h / q } else { 0.0 };
            format!("{i}: {:.0} % at {:.1} %", share * 100.0, rate * 100.0)
        })
        .collect();
    let mut extra = format!(
        "prompt tokens per replica (share at hit rate): {}",
        split.join(", ")
    );
    if let Some(tenants) = tenants_per_replica(&measured, sims) {
        extra += "; ";
        extra += &tenants;
    }
    // The pinned policies route nothing (every conversation goes straight to its replica):
    // no routed request, no line.
    if args.bypass_every > 0
        && let Some(away) = away_from_own_replicas(&measured, sims)
    {
        extra += "; ";
        extra += &away;
    }
    if !stack.llmgw_admins.is_empty() {
        extra += "; ";
        extra += &decided_by(http, &stack.llmgw_admins).await;
    }
    Ok(Measured {
        report,
        ttft_ms,
        extra: Some(extra),
        requests,
    })
}

/// Every request of a run, one line each in the order they ended, for tracing a placement:
/// when it was sent (Unix seconds, to line it up with the routers' logs, and seconds into the
/// run), its conversation, turn and tenant, the replica that served it (its index, -1 when
/// unknown), the status, the TTFT and whether it went straight to its replica (`bypassed` 1:
/// `--bypass-every`, no router saw it). `replicas` are the replicas' addresses in index order.
/// `bench/trace_routing.py` lines these up with the routers' `routed` log lines.
fn requests_csv(results: &Results, replicas: &[String]) -> String {
    let start = results
        .started_at
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .unwrap_or_default();
    let mut csv =
        "sent_unix_s,sent_s,conversation,turn,tenant,replica,status,ttft_ms,bypassed\n".to_owned();
    for s in &results.samples {
        let replica = replicas
            .iter()
            .position(|r| *r == s.replica)
            .map_or(-1, |i| i as i64);
        csv += &format!(
            "{:.3},{:.3},{},{},{},{replica},{},{:.1},{}\n",
            (start + s.sent_at).as_secs_f64(),
            s.sent_at.as_secs_f64(),
            s.conversation,
            s.turn,
            s.tenant,
            s.status,
            s.ttft.as_secs_f64() * 1e3,
            u8::from(s.bypassed),
        );
    }
    csv
}

/// Where each tenant's measured requests went: per replica, the tenants that sent it most of
/// theirs, and the share of a tenant's requests there when some went elsewhere, then in
/// brackets the tenants that have their home elsewhere but sent it at least
/// [`GUEST_SHARE`] of theirs. The placement behind a hit rate: which tenants share a cache.
/// `None` when no response named its replica (vLLM engines send no replica header).
fn tenants_per_replica(measured: &[&workload::Sample], sims: &[SimHandle]) -> Option<String> {
    let placed: Vec<(usize, usize)> = measured
        .iter()
        .filter(|s| s.status == 200)
        .filter_map(|s| Some((s.tenant, sim_index(sims, &s.replica)?)))
        .collect();
    tenant_line(&placed, sims.len())
}

/// The index of the sim whose address a response named as its replica.
fn sim_index(sims: &[SimHandle], replica: &str) -> Option<usize> {
    sims.iter().position(|s| s.addr.to_string() == replica)
}

/// A share of a tenant's requests that makes a replica other than its home worth naming.
const GUEST_SHARE: f64 = 0.2;

/// [`tenants_per_replica`] from each request's (tenant, replica index).
fn tenant_line(placed: &[(usize, usize)], replicas: usize) -> Option<String> {
    let mut counts: BTreeMap<usize, BTreeMap<usize, usize>> = BTreeMap::new();
    for &(tenant, at) in placed.iter().filter(|&&(_, at)| at < replicas) {
        *counts.entry(tenant).or_default().entry(at).or_default() += 1;
    }
    if counts.is_empty() {
        return None;
    }
    let percent = |n: usize, total: usize| 100.0 * n as f64 / total as f64;
    let mut homes: Vec<Vec<String>> = vec![Vec::new(); replicas];
    let mut guests: Vec<Vec<String>> = vec![Vec::new(); replicas];
    for (tenant, by_replica) in &counts {
        let total: usize = by_replica.values().sum();
        // The lowest index among equal shares, so the line does not depend on map order.
        let Some((&home, &most)) = by_replica
            .iter()
            .max_by_key(|&(&at, &n)| (n, std::cmp::Reverse(at)))
        else {
            continue;
        };
        homes[home].push(if most == total {
            format!("t{tenant}")
        } else {
            format!("t{tenant} ({:.0} %)", percent(most, total))
        });
        for (&at, &n) in by_replica {
            if at != home && n as f64 >= GUEST_SHARE * total as f64 {
                guests[at].push(format!("t{tenant} {:.0} %", percent(n, total)));
            }
        }
    }
    let per_replica: Vec<String> = homes
        .iter()
        .zip(&guests)
        .enumerate()
        .map(|(i, (homes, guests))| {
            let mut line = format!("{i}: {}", homes.join(" "));
            if !guests.is_empty() {
                if !homes.is_empty() {
                    line.push(' ');
                }
                line += &format!("[{}]", guests.join(", "));
            }
            line
        })
        .collect();
    Some(format!("tenants per replica: {}", per_replica.join(", ")))
}

/// With some conversations bypassing the router: how many of the measured requests the router
/// sent elsewhere than the tenant's own replica (where its bypassing conversations go), and
/// when the last of them was sent. A router learns a tenant's replica only from that traffic,
/// so this counts what it routed before it knew, or split afterwards: what keeps a bypass run
/// under the ceiling (docs/results/2026-12-08-drawn-ten-seeds.md). `None` when no routed
/// response named its replica.
fn away_from_own_replicas(measured: &[&workload::Sample], sims: &[SimHandle]) -> Option<String> {
    let routed: Vec<(usize, usize, Duration)> = measured
        .iter()
        .filter(|s| s.status == 200 && !s.bypassed)
        .filter_map(|s| Some((s.tenant, sim_index(sims, &s.replica)?, s.sent_at)))
        .collect();
    away_line(&routed, sims.len())
}

/// [`away_from_own_replicas`] from each routed request's (tenant, replica index, sent at); a
/// tenant's own replica is where the workload's bypass sends it ([`workload::own_replica`]).
fn away_line(routed: &[(usize, usize, Duration)], replicas: usize) -> Option<String> {
    if routed.is_empty() || replicas == 0 {
        return None;
    }
    let away: Vec<Duration> = routed
        .iter()
        .filter(|&&(tenant, at, _)| Some(at) != workload::own_replica(tenant, replicas))
        .map(|&(_, _, sent)| sent)
        .collect();
    let last = away
        .iter()
        .max()
        .map(|sent| format!(", the last sent at {:.1} s", sent.as_secs_f64()))
        .unwrap_or_default();
    Some(format!(
        "routed away from the tenant's own replica: {} of {}{last}",
        away.len(),
        routed.len()
    ))
}

/// llmgw's own decision counters, summed over its routers: which tier decided, over the run,
/// and how the prompts found nowhere were placed.
async fn decided_by(http: &reqwest::Client, admins: &[SocketAddr]) -> String {
    let mut metrics = String::new();
    for admin in admins {
        metrics += &workload::get_text(http, &format!("http://{admin}/metrics")).await;
    }
    let mut parts = Vec::new();
    for (family, tier) in [
        ("llmgw_kv_decisions_total", "KV index"),
        ("llmgw_prefix_decisions_total", "prefix tree"),
        ("llmgw_cold_placements_total", "placement"),
    ] {
        let counted = llmgw_integration::prom::counted_by_label(&metrics, family, "decision");
        if !counted.is_empty() {
            parts.push(format!("{tier}: {counted}"));
        }
    }
    if parts.is_empty() {
        "decisions: no prefix-slot decisions counted".to_owned()
    } else {
        format!("decisions: {}", parts.join("; "))
    }
}

/// Cores, CPU model and load average, for the report.
fn machine_state() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    format!("{cores} cores ({model}), load average {load}")
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use llmgw_integration::workload::{Results, Sample};

    use super::{away_line, requests_csv, tenant_line};

    #[test]
    fn the_requests_file_has_a_line_per_request_with_its_wall_clock_time_replica_and_bypass() {
        let sample = |conversation, turn, replica: &str, sent_ms, bypassed| Sample {
            replica: replica.to_owned(),
            tenant: conversation % 3,
            conversation,
            turn,
            ttft: Duration::from_micros(12_345),
            status: 200,
            salted: false,
            bypassed,
            sent_at: Duration::from_millis(sent_ms),
            done_at: Duration::from_millis(sent_ms + 20),
        };
        let results = Results {
            started_at: Some(UNIX_EPOCH + Duration::from_secs(1_000)),
            samples: vec![
                sample(4, 0, "127.0.0.1:2", 1_500, false),
                sample(4, 1, "?", 1_750, false),
                sample(5, 0, "127.0.0.1:1", 1_800, true),
            ],
            ..Results::default()
        };
        let replicas = ["127.0.0.1:1".to_owned(), "127.0.0.1:2".to_owned()];
        assert_eq!(
            requests_csv(&results, &replicas),
            "sent_unix_s,sent_s,conversation,turn,tenant,replica,status,ttft_ms,bypassed\n\
             1001.500,1.500,4,0,1,1,200,12.3,0\n\
             1001.750,1.750,4,1,1,-1,200,12.3,0\n\
             1001.800,1.800,5,0,2,0,200,12.3,1\n"
        );
    }

    #[test]
    fn the_tenant_line_names_each_home_and_the_replicas_a_tenant_split_onto() {
        let mut placed = vec![(0, 0); 6];
        placed.extend([(0, 3); 4]); // t0: 60 % at home, 40 % a guest of replica 3
        placed.extend([(1, 1); 9]);
        placed.push((1, 2)); // t1: 10 % elsewhere, under the guest share
        placed.extend([(2, 2); 3]);
        placed.extend([(2, 3); 3]); // t2: an even split names the lower replica its home
        assert_eq!(
            tenant_line(&placed, 4).as_deref(),
            Some(
                "tenants per replica: 0: t0 (60 %), 1: t1 (90 %), 2: t2 (50 %), 3: [t0 40 %, t2 50 %]"
            )
        );
    }

    #[test]
    fn requests_routed_away_from_their_tenants_replica_are_counted_with_the_last_time() {
        let at = Duration::from_millis;
        let routed = [
            (0, 0, at(5_000)),
            (1, 2, at(6_500)),  // t1's own replica is 1
            (5, 1, at(7_000)),  // t5 mod 4 = 1: home
            (6, 3, at(12_240)), // t6 mod 4 = 2
            (6, 2, at(13_000)),
        ];
        assert_eq!(
            away_line(&routed, 4).as_deref(),
            Some("routed away from the tenant's own replica: 2 of 5, the last sent at 12.2 s")
        );
        assert_eq!(
            away_line(&routed[..1], 4).as_deref(),
            Some("routed away from the tenant's own replica: 0 of 1")
        );
        assert_eq!(away_line(&[], 4), None);
    }

    #[test]
    fn without_any_placed_request_there_is_no_tenant_line() {
        assert_eq!(tenant_line(&[], 4), None);
        assert_eq!(tenant_line(&[(0, 7)], 4), None);
    }
}
