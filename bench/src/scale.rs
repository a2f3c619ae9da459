//! `make bench-scale`: router and agent memory and CPU, and routing-decision latency, as the
//! fleet grows. One [`run`] starts, for N replicas:
//!
//! * N **synthetic engines** in this process: a ZMQ PUB socket each publishing vLLM-format
//!   KV-event batches (the simulator's msgpack encoder, hashes computed with llmgw's vLLM
//!   block hasher, so the router's own hashing of a prompt finds them), and a tiny HTTP server
//!   each answering `/health` and a vLLM-style `/metrics` (idle engine), so that the router's
//!   health checks and scrapes run against N endpoints as in production;
//! * a real release `llmgw-router` with N `--replica` flags and `--model` hash settings (the
//!   precise index on);
//! * real `llmgw-agent`s, one per "node" of `engines_per_agent` engines, mirroring those streams
//!   into the router over gRPC.
//!
//! Then: **fill** every replica's cache (shared system prompts across replicas, unique
//! conversations per replica) and wait until the router's index reports every published block;
//! a **quiet** window (no events, no requests: health checks and scrapes only); **lookups**:
//! ext_proc requests sent straight to the router's gRPC port (as Envoy's BUFFERED filter
//! would), token-id prompts that one replica holds entirely and others partly; a **steady**
//! window at a fixed event rate per replica (stores and as many removals, so caches keep their
//! size); and a final check that the index still agrees with the generator. RSS from
//! `/proc/PID/status`, CPU from `/proc/PID/stat` (utime + stime).

use std::collections::{HashSet, VecDeque};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use bytes::Bytes;
use llmgw::blockhash::{BlockDigest, BlockHasher, HashSettings};
use zeromq::{PubSocket, Socket as _, SocketSend as _, ZmqMessage};

use crate::routing::percentile;
use llmgw_integration::ChildGuard;
use llmgw_integration::agent::AgentCommand;
use llmgw_integration::extproc_client::ExtProcClient;
use llmgw_integration::procfs::{load_avg, parse_status_rss_mib, proc_stat_cpu_seconds};
use llmgw_integration::prom;
use llmgw_integration::router::{RouterCommand, RouterProcess};
use llmgw_sim::events::{BlockStored, Encoding, EventBatch, KvEvent};

/// The served model, its block size and the engines' PYTHONHASHSEED.
pub const MODEL: &str = "tiny";
pub const BLOCK_SIZE: usize = 16;
pub const SEED: &str = "1729";
/// Token ids are drawn below this (a Llama-sized vocabulary).
const VOCAB: u64 = 32_000;
/// Steady-state batches per engine per second (vLLM publishes one batch per engine step).
const STEADY_TICKS_PER_S: f64 = 10.0;

/// What to run.
#[derive(Debug, Clone)]
pub struct ScaleConfig {
    pub replicas: usize,
    /// Engines mirrored by one agent (GPUs per node).
    pub engines_per_agent: usize,
    /// Blocks each replica's cache holds after the fill.
    pub blocks_per_replica: usize,
    /// Shared system prompts in the fleet; each replica serves four of them.
    pub prefixes: usize,
    /// Blocks of a shared system prompt.
    pub prefix_blocks: usize,
    /// Blocks of a conversation after its system prompt.
    pub suffix_blocks: usize,
    /// Steady-state block events per second per replica (half stores, half removals).
    pub event_rate: f64,
    pub quiet: Duration,
    pub steady: Duration,
    /// ext_proc routing requests, sent one after another.
    pub lookups: usize,
    /// Requests per second (sequential; 0 = back to back).
    pub lookup_rate: f64,
    /// Extra `llmgw-router serve` flags.
    pub router_args: Vec<String>,
    /// Where the processes' logs go.
    pub log_dir: PathBuf,
    /// How long the fill may take to show up in the router's index.
    pub converge_timeout: Duration,
}

impl Default for ScaleConfig {
    fn default() -> Self {
        ScaleConfig {
            replicas: 4,
            engines_per_agent: 8,
            blocks_per_replica: 8192,
            prefixes: 32,
            prefix_blocks: 32,
            suffix_blocks: 32,
            event_rate: 200.0,
            quiet: Duration::from_secs(5),
            steady: Duration::from_secs(10),
            lookups: 1000,
            lookup_rate: 200.0,
            router_args: Vec::new(),
            log_dir: llmgw_integration::repo_root()
                .join("target")
                .join("bench-scale"),
            converge_timeout: Duration::from_secs(120),
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ScaleReport {
    pub replicas: usize,
    pub agents: usize,
    /// (block, replica) pairs the generator left cached after the fill.
    pub published_pairs: u64,
    /// Distinct block hashes among them.
    pub published_distinct: u64,
    /// What the router's `/metrics` reported after the fill.
    pub index_pairs: u64,
    pub index_distinct: u64,
    /// Replicas whose index count equals the generator's, after the fill and after the steady
    /// window.
    pub replicas_matching_after_fill: usize,
    pub replicas_matching_after_steady: usize,
    pub fill_s: f64,
    pub router_rss_mib: f64,
    pub router_peak_rss_mib: f64,
    /// Router CPU, % of one core, with no events and no requests (probes only).
    pub router_cpu_quiet_pct: f64,
    /// Router CPU during the steady event window.
    pub router_cpu_steady_pct: f64,
    /// Router CPU per routing request during the lookups (quiet share subtracted), µs.
    pub router_cpu_per_lookup_us: f64,
    pub agent_rss_mib_total: f64,
    pub agent_rss_mib_max: f64,
    pub agent_cpu_quiet_pct: f64,
    pub agent_cpu_steady_pct: f64,
    /// Block events per second the generator actually published in the steady window.
    pub steady_block_events_per_s: f64,
    /// CPU of this process (generator + fake engines' HTTP) during the steady window.
    pub generator_cpu_steady_pct: f64,
    pub lookups: usize,
    /// Lookups routed to the one replica holding the whole prompt.
    pub routed_to_holder: usize,
    /// `llmgw_kv_decisions_total{decision="hit"}` gained during the lookups.
    pub kv_hits: u64,
    pub prompt_blocks: usize,
    /// ext_proc round trip, body message sent → routing answer received, µs.
    pub rtt_p50_us: f64,
    pub rtt_p99_us: f64,
    /// The router's own `llmgw_pick_duration_seconds` over the lookups.
    pub pick_mean_us: f64,
    /// Upper bound of the histogram bucket holding the p50 / p99 pick (µs).
    pub pick_p50_le_us: f64,
    pub pick_p99_le_us: f64,
    pub load_avg: String,
}

/// Runs one scale point. Every process it starts is killed when it returns.
pub async fn run(config: &ScaleConfig) -> anyhow::Result<ScaleReport> {
    ensure!(config.replicas > 0, "at least one replica");
    ensure!(
        config.engines_per_agent > 0,
        "at least one engine per agent"
    );
    ensure!(config.prefixes > 0 && config.prefix_blocks > 0 && config.suffix_blocks > 0);
    std::fs::create_dir_all(&config.log_dir)
        .with_context(|| format!("create {}", config.log_dir.display()))?;
    let hasher = BlockHasher::new(&HashSettings::sha256_cbor(
        std::num::NonZeroUsize::new(BLOCK_SIZE).context("block size")?,
        Some(SEED),
    ))?;
    let workload = Workload::new(config, &hasher);

    // Fake engines' HTTP endpoints and their event publishers.
    let http = FakeEngines::start(config.replicas).await?;
    let mut engines = Vec::with_capacity(config.replicas);
    for (i, addr) in http.addrs.iter().enumerate() {
        engines.push(Engine::start(i, *addr).await?);
    }

    let agents_n = config.replicas.div_ceil(config.engines_per_agent);
    let router = start_router(config, &http.addrs)?;
    let admin = Admin::new(router.addrs.admin);
    let mut agents = Vec::with_capacity(agents_n);
    for a in 0..agents_n {
        let members = &engines
            [a * config.engines_per_agent..((a + 1) * config.engines_per_agent).min(engines.len())];
        agents.push(start_agent(config, a, members, router.addrs.feed)?);
    }

    // Agents subscribe late: send each engine a marker block until the router has one from
    // every replica (messages before the subscription are simply lost, as with vLLM).
    let joined_by = Instant::now() + Duration::from_secs(60);
    loop {
        for engine in &mut engines {
            if !engine.marked {
                let batch = workload.marker(engine.index);
                engine.publish(&batch).await?;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let counts = admin.replica_blocks().await?;
        let mut all = true;
        for engine in &mut engines {
            engine.marked = counts.iter().any(|(r, n)| r == &engine.replica && *n >= 1);
            all &= engine.marked;
        }
        if all {
            break;
        }
        ensure!(
            Instant::now() < joined_by,
            "not every agent subscribed within 60 s"
        );
    }

    // Fill.
    let fill_started = Instant::now();
    let mut distinct: HashSet<u64> = HashSet::new();
    for engine in &engines {
        distinct.insert(workload.marker_hash(engine.index));
    }
    let mut fills: Vec<VecDeque<EventBatch>> = engines
        .iter_mut()
        .map(|e| workload.fill(e, &mut distinct).into())
        .collect();
    loop {
        let mut sent = 0;
        for (engine, batches) in engines.iter_mut().zip(fills.iter_mut()) {
            if let Some(batch) = batches.pop_front() {
                engine.publish(&batch).await?;
                sent += 1;
            }
        }
        if sent == 0 {
            break;
        }
        // Pace the fill a little: a PUB socket drops what a slow subscriber cannot take.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let expected: Vec<(String, u64)> = engines
        .iter()
        .map(|e| (e.replica.clone(), e.held as u64))
        .collect();
    let published_pairs: u64 = expected.iter().map(|(_, n)| n).sum();
    let published_distinct = distinct.len() as u64;
    drop(distinct);
    let matching_after_fill = admin
        .wait_for_counts(&expected, config.converge_timeout)
        .await?;
    let fill_s = fill_started.elapsed().as_secs_f64();
    let (index_pairs, index_distinct) = admin.index_totals().await?;

    let router_pid = router.guard.id();
    let agent_pids: Vec<u32> = agents.iter().map(ChildGuard::id).collect();
    let me = std::process::id();

    // Quiet window: probes only.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = CpuSample::take(router_pid, &agent_pids, me)?;
    tokio::time::sleep(config.quiet).await;
    let quiet = CpuSample::take(router_pid, &agent_pids, me)?.since(&before);

    // Lookups through the router's ext_proc port.
    let lookup = run_lookups(config, &workload, &engines, &router, &admin).await?;
    let lookup_cpu = lookup.router_cpu_s - quiet.router_pct / 100.0 * lookup.window_s;
    let router_cpu_per_lookup_us = if lookup.samples.is_empty() {
        f64::NAN
    } else {
        lookup_cpu.max(0.0) / lookup.samples.len() as f64 * 1e6
    };

    // Steady window: a fixed event rate per replica.
    let before = CpuSample::take(router_pid, &agent_pids, me)?;
    let published = steady(config, &workload, &mut engines).await?;
    let steady_sample = CpuSample::take(router_pid, &agent_pids, me)?.since(&before);
    let expected: Vec<(String, u64)> = engines
        .iter()
        .map(|e| (e.replica.clone(), e.held as u64))
        .collect();
    let matching_after_steady = admin
        .wait_for_counts(&expected, Duration::from_secs(10))
        .await?;

    let (router_rss, router_peak) = rss_mib(router_pid)?;
    let mut agent_total = 0.0f64;
    let mut agent_max = 0.0f64;
    for pid in &agent_pids {
        let (rss, _) = rss_mib(*pid)?;
        agent_total += rss;
        agent_max = agent_max.max(rss);
    }

    let mut sorted = lookup.samples.clone();
    sorted.sort_by(f64::total_cmp);
    let report = ScaleReport {
        replicas: config.replicas,
        agents: agents_n,
        published_pairs,
        published_distinct,
        index_pairs,
        index_distinct,
        replicas_matching_after_fill: matching_after_fill,
        replicas_matching_after_steady: matching_after_steady,
        fill_s,
        router_rss_mib: router_rss,
        router_peak_rss_mib: router_peak,
        router_cpu_quiet_pct: quiet.router_pct,
        router_cpu_steady_pct: steady_sample.router_pct,
        router_cpu_per_lookup_us,
        agent_rss_mib_total: agent_total,
        agent_rss_mib_max: agent_max,
        agent_cpu_quiet_pct: quiet.agents_pct,
        agent_cpu_steady_pct: steady_sample.agents_pct,
        steady_block_events_per_s: published as f64 / steady_sample.window_s,
        generator_cpu_steady_pct: steady_sample.me_pct,
        lookups: lookup.samples.len(),
        routed_to_holder: lookup.routed_to_holder,
        kv_hits: lookup.kv_hits,
        prompt_blocks: workload.prefix_blocks + workload.suffix_blocks,
        rtt_p50_us: percentile(&sorted, 50.0).unwrap_or(f64::NAN),
        rtt_p99_us: percentile(&sorted, 99.0).unwrap_or(f64::NAN),
        pick_mean_us: lookup.pick.mean_us(),
        pick_p50_le_us: lookup.pick.quantile_le_us(0.50),
        pick_p99_le_us: lookup.pick.quantile_le_us(0.99),
        load_avg: load_avg(),
    };
    drop(agents);
    drop(router);
    drop(http);
    Ok(report)
}

/// The deterministic workload: token ids from seeds, digests from llmgw's vLLM hasher.
struct Workload<'h> {
    hasher: &'h BlockHasher,
    prefixes: usize,
    prefix_blocks: usize,
    suffix_blocks: usize,
    blocks_per_replica: usize,
    event_rate: f64,
    /// Each shared system prompt's tokens and digests.
    prefix_tokens: Vec<Vec<u32>>,
    prefix_digests: Vec<Vec<BlockDigest>>,
}

/// SplitMix64: small, deterministic, good enough for token ids.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = mix(seed);
    (0..n)
        .map(|_| {
            x = mix(x);
            // Below VOCAB, so it fits a u32.
            u32::try_from(x % VOCAB).unwrap_or(0)
        })
        .collect()
}

fn chain(hasher: &BlockHasher, parent: Option<&BlockDigest>, tokens: &[u32]) -> Vec<BlockDigest> {
    let mut out = Vec::with_capacity(tokens.len() / BLOCK_SIZE);
    let mut parent = parent.copied();
    for block in tokens.chunks_exact(BLOCK_SIZE) {
        let digest = hasher.hash_block(parent.as_ref(), block, None);
        out.push(digest);
        parent = Some(digest);
    }
    out
}

fn stored(digests: Vec<BlockDigest>, parent: Option<BlockDigest>, tokens: Vec<u32>) -> KvEvent {
    let n = digests.len();
    KvEvent::BlockStored(BlockStored {
        block_hashes: digests,
        parent_block_hash: parent,
        token_ids: tokens,
        block_size: BLOCK_SIZE as u32,
        extra_keys: Some(vec![None; n]),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention"),
    })
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        ts: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
        events,
        data_parallel_rank: None,
    }
}

impl<'h> Workload<'h> {
    fn new(config: &ScaleConfig, hasher: &'h BlockHasher) -> Self {
        let prefix_tokens: Vec<Vec<u32>> = (0..config.prefixes)
            .map(|p| tokens(0x1000_0000 + p as u64, config.prefix_blocks * BLOCK_SIZE))
            .collect();
        let prefix_digests = prefix_tokens
            .iter()
            .map(|t| chain(hasher, None, t))
            .collect();
        Workload {
            hasher,
            prefixes: config.prefixes,
            prefix_blocks: config.prefix_blocks,
            suffix_blocks: config.suffix_blocks,
            blocks_per_replica: config.blocks_per_replica,
            event_rate: config.event_rate,
            prefix_tokens,
            prefix_digests,
        }
    }

    /// The shared system prompt of replica `r`'s conversation `j`: four per replica.
    fn prefix_of(&self, r: usize, j: usize) -> usize {
        (r + (j % 4) * self.prefixes.div_ceil(4)) % self.prefixes
    }

    fn suffix_tokens(&self, r: usize, j: usize) -> Vec<u32> {
        tokens(
            ((r as u64) << 32) | j as u64,
            self.suffix_blocks * BLOCK_SIZE,
        )
    }

    /// The whole prompt of replica `r`'s conversation `j`.
    fn prompt(&self, r: usize, j: usize) -> Vec<u32> {
        let mut t = self.prefix_tokens[self.prefix_of(r, j)].clone();
        t.extend(self.suffix_tokens(r, j));
        t
    }

    fn marker_tokens(r: usize) -> Vec<u32> {
        tokens(0x7000_0000_0000 + r as u64, BLOCK_SIZE)
    }

    fn marker_hash(&self, r: usize) -> u64 {
        self.hasher
            .hash_block(None, &Self::marker_tokens(r), None)
            .external()
            .0
    }

    fn marker(&self, r: usize) -> EventBatch {
        let t = Self::marker_tokens(r);
        let digests = chain(self.hasher, None, &t);
        batch(vec![stored(digests, None, t)])
    }

    /// Fills one replica to `blocks_per_replica` (the marker included): batches of a few
    /// conversations each, a system prompt stored the first time the replica uses it.
    fn fill(&self, engine: &mut Engine, distinct: &mut HashSet<u64>) -> Vec<EventBatch> {
        let mut batches = Vec::new();
        let mut events = Vec::new();
        let mut used = vec![false; self.prefixes];
        let mut j = 0;
        while engine.held + self.suffix_blocks <= self.blocks_per_replica
            || engine.held < self.prefix_blocks * 4
        {
            let p = self.prefix_of(engine.index, j);
            if !used[p] {
                used[p] = true;
                let digests = self.prefix_digests[p].clone();
                distinct.extend(digests.iter().map(|d| d.external().0));
                engine.held += digests.len();
                events.push(stored(digests, None, self.prefix_tokens[p].clone()));
            }
            let parent = self.prefix_digests[p].last().copied();
            let t = self.suffix_tokens(engine.index, j);
            let digests = chain(self.hasher, parent.as_ref(), &t);
            distinct.extend(digests.iter().map(|d| d.external().0));
            engine.held += digests.len();
            engine.unique.extend(digests.iter().copied());
            events.push(stored(digests, parent, t));
            engine.conversations = j + 1;
            j += 1;
            if events.len() >= 8 {
                batches.push(batch(std::mem::take(&mut events)));
            }
        }
        if !events.is_empty() {
            batches.push(batch(events));
        }
        batches
    }

    /// One steady-state step of one replica: `n` new blocks of a growing conversation stored,
    /// the `n` oldest conversation blocks removed.
    fn step(&self, engine: &mut Engine, n: usize) -> EventBatch {
        let mut events = Vec::new();
        let mut left = n;
        while left > 0 {
            if engine.growing.is_none() || engine.growing_len >= self.suffix_blocks {
                let p = self.prefix_of(engine.index, engine.next_growing);
                engine.growing = self.prefix_digests[p].last().copied();
                engine.growing_len = 0;
                engine.next_growing += 1;
            }
            let take = left.min(self.suffix_blocks - engine.growing_len);
            let seed = (1u64 << 63)
                | ((engine.index as u64) << 40)
                | ((engine.next_growing as u64) << 12)
                | engine.growing_len as u64;
            let t = tokens(seed, take * BLOCK_SIZE);
            let parent = engine.growing;
            let digests = chain(self.hasher, parent.as_ref(), &t);
            engine.growing = digests.last().copied();
            engine.growing_len += take;
            engine.unique.extend(digests.iter().copied());
            events.push(stored(digests, parent, t));
            left -= take;
        }
        let mut removed = Vec::with_capacity(n);
        for _ in 0..n {
            if let Some(d) = engine.unique.pop_front() {
                removed.push(d);
            }
        }
        // Stored n, removed as many as there were.
        engine.held = engine.held + n - removed.len();
        if !removed.is_empty() {
            events.push(KvEvent::BlockRemoved {
                block_hashes: removed,
                group_idx: Some(0),
            });
        }
        batch(events)
    }
}

/// One synthetic engine: its PUB socket and what its cache holds.
struct Engine {
    index: usize,
    replica: String,
    endpoint: String,
    sock: PubSocket,
    seq: u64,
    marked: bool,
    /// Blocks held (the marker included).
    held: usize,
    /// Conversations of the fill (0..conversations).
    conversations: usize,
    /// Conversation blocks, oldest first (what steady state evicts).
    unique: VecDeque<BlockDigest>,
    growing: Option<BlockDigest>,
    growing_len: usize,
    next_growing: usize,
}

impl Engine {
    async fn start(index: usize, replica: SocketAddr) -> anyhow::Result<Engine> {
        let mut sock = PubSocket::new();
        let endpoint = sock
            .bind("tcp://127.0.0.1:0")
            .await
            .context("bind a PUB socket")?
            .to_string();
        Ok(Engine {
            index,
            replica: replica.to_string(),
            endpoint,
            sock,
            seq: 0,
            marked: false,
            held: 1,
            conversations: 0,
            unique: VecDeque::new(),
            growing: None,
            growing_len: 0,
            next_growing: 1_000_000,
        })
    }

    async fn publish(&mut self, batch: &EventBatch) -> anyhow::Result<()> {
        let payload = batch.encode(Encoding::default());
        let frames = vec![
            Bytes::from_static(b"kv"),
            Bytes::copy_from_slice(&self.seq.to_be_bytes()),
            Bytes::from(payload),
        ];
        let msg = ZmqMessage::try_from(frames).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        self.sock.send(msg).await.context("publish")?;
        self.seq += 1;
        Ok(())
    }
}

/// N HTTP endpoints answering `/health` and an idle engine's `/metrics`, one port each.
struct FakeEngines {
    addrs: Vec<SocketAddr>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

const FAKE_METRICS: &str = "# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 0.0\n\
# TYPE vllm:num_requests_running gauge\n\
vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 0.0\n\
# TYPE vllm:kv_cache_usage_perc gauge\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"tiny\"} 0.5\n";

impl FakeEngines {
    async fn start(n: usize) -> anyhow::Result<FakeEngines> {
        let app = axum::Router::new()
            .route("/health", axum::routing::get(|| async { "" }))
            .route("/metrics", axum::routing::get(|| async { FAKE_METRICS }));
        let mut addrs = Vec::with_capacity(n);
        let mut tasks = Vec::with_capacity(n);
        for _ in 0..n {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            addrs.push(listener.local_addr()?);
            let app = app.clone();
            tasks.push(tokio::spawn(async move {
                let _ = axum::serve(listener, app).await;
            }));
        }
        Ok(FakeEngines { addrs, tasks })
    }
}

impl Drop for FakeEngines {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn log_file(config: &ScaleConfig, name: &str) -> anyhow::Result<std::fs::File> {
    let path = config
        .log_dir
        .join(format!("{name}-n{}.log", config.replicas));
    std::fs::File::create(&path).with_context(|| format!("create {}", path.display()))
}

fn node(a: usize) -> String {
    format!("node-{a}")
}

fn start_router(config: &ScaleConfig, replicas: &[SocketAddr]) -> anyhow::Result<RouterProcess> {
    let mut router = RouterCommand::new().model(MODEL, BLOCK_SIZE, SEED);
    for (i, addr) in replicas.iter().enumerate() {
        let node = node(i / config.engines_per_agent);
        router = router.replica(MODEL, *addr, Some(&node));
    }
    router
        .args(&config.router_args)
        .stderr(log_file(config, "router")?)
        .spawn()
        .with_context(|| format!("llmgw-router (logs in {})", config.log_dir.display()))
}

fn start_agent(
    config: &ScaleConfig,
    a: usize,
    engines: &[Engine],
    feed: SocketAddr,
) -> anyhow::Result<ChildGuard> {
    let mut agent = AgentCommand::serve(&node(a))
        .router(feed)
        .hash_settings(MODEL, SEED, BLOCK_SIZE)
        .args(["--topic", "kv", "--admin-addr", "127.0.0.1:0"]);
    for engine in engines {
        agent = agent.args([
            "--engine",
            &format!("{}={}", engine.replica, engine.endpoint),
        ]);
    }
    Ok(agent
        .stderr(log_file(config, &format!("agent-{a}"))?)
        .spawn()?)
}

/// The router's admin port.
struct Admin {
    client: reqwest::Client,
    base: String,
}

impl Admin {
    fn new(addr: SocketAddr) -> Admin {
        Admin {
            client: reqwest::Client::new(),
            base: format!("http://{addr}"),
        }
    }

    async fn metrics(&self) -> anyhow::Result<String> {
        let response = self
            .client
            .get(format!("{}/metrics", self.base))
            .send()
            .await?;
        ensure!(
            response.status().is_success(),
            "router /metrics answered {}",
            response.status()
        );
        Ok(response.text().await?)
    }

    /// `llmgw_kv_index_replica_blocks{replica=…}`.
    async fn replica_blocks(&self) -> anyhow::Result<Vec<(String, u64)>> {
        Ok(replica_blocks(&self.metrics().await?))
    }

    /// (Σ replica blocks, distinct blocks).
    async fn index_totals(&self) -> anyhow::Result<(u64, u64)> {
        let text = self.metrics().await?;
        let pairs = replica_blocks(&text).iter().map(|(_, n)| n).sum();
        let distinct = prom::sum(&text, "llmgw_kv_index_blocks", &[]).unwrap_or(0.0) as u64;
        Ok((pairs, distinct))
    }

    /// Waits until every replica's count equals the expected one, or the timeout; returns how
    /// many matched at the end.
    async fn wait_for_counts(
        &self,
        expected: &[(String, u64)],
        timeout: Duration,
    ) -> anyhow::Result<usize> {
        let until = Instant::now() + timeout;
        loop {
            let counts = self.replica_blocks().await?;
            let matching = expected
                .iter()
                .filter(|(r, n)| counts.iter().any(|(cr, cn)| cr == r && cn == n))
                .count();
            if matching == expected.len() || Instant::now() >= until {
                return Ok(matching);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// `llmgw_pick_duration_seconds`: cumulative buckets, sum and count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PickHistogram {
    /// (upper bound in seconds, cumulative count), ascending.
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

impl PickHistogram {
    pub fn parse(text: &str) -> PickHistogram {
        let mut buckets: Vec<(f64, f64)> = prom::samples(text)
            .filter(|s| s.name == "llmgw_pick_duration_seconds_bucket")
            .filter_map(|s| {
                let le = match s.label("le")? {
                    "+Inf" => f64::INFINITY,
                    le => le.parse().ok()?,
                };
                Some((le, s.value))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let total = |name| prom::sum(text, name, &[]).unwrap_or(0.0);
        PickHistogram {
            buckets,
            sum: total("llmgw_pick_duration_seconds_sum"),
            count: total("llmgw_pick_duration_seconds_count"),
        }
    }

    /// The observations between `earlier` and `self`.
    pub fn since(&self, earlier: &PickHistogram) -> PickHistogram {
        PickHistogram {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, n)| {
                    let before = earlier
                        .buckets
                        .iter()
                        .find(|(l, _)| *l == le)
                        .map_or(0.0, |b| b.1);
                    (le, n - before)
                })
                .collect(),
            sum: self.sum - earlier.sum,
            count: self.count - earlier.count,
        }
    }

    pub fn mean_us(&self) -> f64 {
        if self.count > 0.0 {
            self.sum / self.count * 1e6
        } else {
            f64::NAN
        }
    }

    /// The upper bound (µs) of the first bucket holding quantile `q`.
    pub fn quantile_le_us(&self, q: f64) -> f64 {
        let target = q * self.count;
        self.buckets
            .iter()
            .find(|(_, n)| *n >= target && *n > 0.0)
            .map_or(f64::NAN, |(le, _)| le * 1e6)
    }
}

struct LookupResult {
    samples: Vec<f64>,
    routed_to_holder: usize,
    kv_hits: u64,
    pick: PickHistogram,
    router_cpu_s: f64,
    window_s: f64,
}

fn kv_hits(text: &str) -> u64 {
    prom::sum(text, "llmgw_kv_decisions_total", &[("decision", "hit")]).unwrap_or(0.0) as u64
}

/// `llmgw_kv_index_replica_blocks{replica=…}`, in replica order.
fn replica_blocks(text: &str) -> Vec<(String, u64)> {
    prom::by_label(text, "llmgw_kv_index_replica_blocks", "replica")
        .into_iter()
        .map(|(replica, n)| (replica, n as u64))
        .collect()
}

async fn run_lookups(
    config: &ScaleConfig,
    workload: &Workload<'_>,
    engines: &[Engine],
    router: &RouterProcess,
    admin: &Admin,
) -> anyhow::Result<LookupResult> {
    let mut client = ExtProcClient::connect(router.addrs.grpc)
        .await
        .context("connect to the router's ext_proc port")?;
    // Prompts: each replica's last fill conversation (held whole by it alone; its system
    // prompt by others too), plus a few tokens short of a block.
    let bodies: Vec<(String, Vec<u8>)> = engines
        .iter()
        .filter(|e| e.conversations > 0)
        .map(|e| {
            let mut prompt = workload.prompt(e.index, e.conversations - 1);
            prompt.extend([1, 2, 3]);
            let body = serde_json::json!({
                "model": MODEL, "prompt": prompt, "max_tokens": 16,
            })
            .to_string()
            .into_bytes();
            (e.replica.clone(), body)
        })
        .collect();
    ensure!(!bodies.is_empty(), "no replica holds a whole conversation");
    // Warm-up: connections and the router's hash cache for these prompts.
    for (_, body) in bodies.iter().take(20) {
        route_once(&mut client, body).await?;
    }
    let text = admin.metrics().await?;
    let pick_before = PickHistogram::parse(&text);
    let hits_before = kv_hits(&text);
    let cpu_before = process_cpu_s(router.guard.id())?;
    let started = Instant::now();
    let gap = if config.lookup_rate > 0.0 {
        Duration::from_secs_f64(1.0 / config.lookup_rate)
    } else {
        Duration::ZERO
    };
    let mut samples = Vec::with_capacity(config.lookups);
    let mut routed_to_holder = 0;
    for i in 0..config.lookups {
        let due = started + gap * u32::try_from(i).unwrap_or(u32::MAX);
        tokio::time::sleep_until(due.into()).await;
        let (holder, body) = &bodies[i % bodies.len()];
        let (destination, rtt) = route_once(&mut client, body).await?;
        samples.push(rtt.as_secs_f64() * 1e6);
        if destination.split(',').next() == Some(holder.as_str()) {
            routed_to_holder += 1;
        }
    }
    let window_s = started.elapsed().as_secs_f64();
    let router_cpu_s = process_cpu_s(router.guard.id())? - cpu_before;
    let text = admin.metrics().await?;
    Ok(LookupResult {
        samples,
        routed_to_holder,
        kv_hits: kv_hits(&text).saturating_sub(hits_before),
        pick: PickHistogram::parse(&text).since(&pick_before),
        router_cpu_s,
        window_s,
    })
}

/// One request as Envoy's BUFFERED ext_proc filter sends it: headers, then the whole body.
/// Returns the destination the router set and the time from sending the body to the answer.
async fn route_once(client: &mut ExtProcClient, body: &[u8]) -> anyhow::Result<(String, Duration)> {
    let routed = client.route("/v1/completions", body).await?;
    let destination = routed.destination().with_context(|| {
        format!(
            "the router did not route the request: {:?}",
            routed.answer.response
        )
    })?;
    Ok((destination, routed.rtt))
}

/// Publishes at `event_rate` per replica for `config.steady`; returns the block events sent.
async fn steady(
    config: &ScaleConfig,
    workload: &Workload<'_>,
    engines: &mut [Engine],
) -> anyhow::Result<u64> {
    let per_tick = workload.event_rate / 2.0 / STEADY_TICKS_PER_S;
    let mut owed = 0.0f64;
    let mut sent = 0u64;
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / STEADY_TICKS_PER_S));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let until = Instant::now() + config.steady;
    while Instant::now() < until {
        ticker.tick().await;
        owed += per_tick;
        let n = owed.floor() as usize;
        owed -= n as f64;
        if n == 0 {
            continue;
        }
        for engine in engines.iter_mut() {
            let batch = workload.step(engine, n);
            for event in &batch.events {
                sent += match event {
                    KvEvent::BlockStored(s) => s.block_hashes.len() as u64,
                    KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.len() as u64,
                    KvEvent::AllBlocksCleared => 0,
                };
            }
            engine.publish(&batch).await?;
        }
    }
    Ok(sent)
}

/// CPU seconds of the router, the agents together and this process.
struct CpuSample {
    at: Instant,
    router: f64,
    agents: f64,
    me: f64,
}

/// CPU % of one core over a window.
struct CpuWindow {
    window_s: f64,
    router_pct: f64,
    agents_pct: f64,
    me_pct: f64,
}

fn process_cpu_s(pid: u32) -> anyhow::Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
    Ok(proc_stat_cpu_seconds(&text)?)
}

impl CpuSample {
    fn take(router: u32, agents: &[u32], me: u32) -> anyhow::Result<CpuSample> {
        let mut agents_s = 0.0;
        for pid in agents {
            agents_s += process_cpu_s(*pid)?;
        }
        Ok(CpuSample {
            at: Instant::now(),
            router: process_cpu_s(router)?,
            agents: agents_s,
            me: process_cpu_s(me)?,
        })
    }

    fn since(&self, earlier: &CpuSample) -> CpuWindow {
        let window_s = self.at.duration_since(earlier.at).as_secs_f64().max(1e-9);
        let pct = |now: f64, then: f64| (now - then) / window_s * 100.0;
        CpuWindow {
            window_s,
            router_pct: pct(self.router, earlier.router),
            agents_pct: pct(self.agents, earlier.agents),
            me_pct: pct(self.me, earlier.me),
        }
    }
}

/// (VmRSS, VmHWM) in MiB from `/proc/PID/status`.
fn rss_mib(pid: u32) -> anyhow::Result<(f64, f64)> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
    Ok(parse_status_rss_mib(&text))
}

/// The Markdown table of several runs.
pub fn markdown_table(reports: &[ScaleReport]) -> String {
    let mut out = String::from(
        "| replicas | agents | (block, replica) pairs | distinct blocks | index matches | router RSS MiB (peak) | router CPU quiet % | router CPU events % | router CPU µs/decision | agents RSS MiB total (max) | agents CPU quiet % | agents CPU events % | block events/s | decision RTT p50 / p99 µs | pick mean µs (p50 / p99 ≤) | routed to holder | load avg |\n\
         |---:|---:|---:|---:|---|---|---:|---:|---:|---|---:|---:|---:|---|---|---|---|\n",
    );
    for r in reports {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {}/{} fill, {}/{} after events | {:.1} ({:.1}) | {:.1} | {:.1} | {:.0} | {:.1} ({:.1}) | {:.1} | {:.1} | {:.0} | {:.0} / {:.0} | {:.0} ({:.0} / {:.0}) | {}/{} ({} index hits) | {} |\n",
            r.replicas,
            r.agents,
            r.index_pairs,
            r.index_distinct,
            r.replicas_matching_after_fill,
            r.replicas,
            r.replicas_matching_after_steady,
            r.replicas,
            r.router_rss_mib,
            r.router_peak_rss_mib,
            r.router_cpu_quiet_pct,
            r.router_cpu_steady_pct,
            r.router_cpu_per_lookup_us,
            r.agent_rss_mib_total,
            r.agent_rss_mib_max,
            r.agent_cpu_quiet_pct,
            r.agent_cpu_steady_pct,
            r.steady_block_events_per_s,
            r.rtt_p50_us,
            r.rtt_p99_us,
            r.pick_mean_us,
            r.pick_p50_le_us,
            r.pick_p99_le_us,
            r.routed_to_holder,
            r.lookups,
            r.kv_hits,
            r.load_avg,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_blocks_and_values_parse() {
        let text = "# TYPE llmgw_kv_index_replica_blocks gauge\n\
llmgw_kv_index_replica_blocks{replica=\"127.0.0.1:8001\"} 12\n\
llmgw_kv_index_replica_blocks{replica=\"127.0.0.1:8002\"} 3\n\
llmgw_kv_index_blocks 14\n\
llmgw_kv_decisions_total{decision=\"hit\"} 7\n";
        assert_eq!(
            replica_blocks(text),
            vec![
                ("127.0.0.1:8001".to_owned(), 12),
                ("127.0.0.1:8002".to_owned(), 3)
            ]
        );
        assert_eq!(kv_hits(text), 7);
    }

    #[test]
    fn pick_histogram_quantiles_come_from_bucket_bounds() {
        let before = PickHistogram::parse(
            "llmgw_pick_duration_seconds_sum 0.0\nllmgw_pick_duration_seconds_count 0\n\
llmgw_pick_duration_seconds_bucket{le=\"1e-5\"} 0\nllmgw_pick_duration_seconds_bucket{le=\"2e-5\"} 0\n\
llmgw_pick_duration_seconds_bucket{le=\"+Inf\"} 0\n",
        );
        let after = PickHistogram::parse(
            "llmgw_pick_duration_seconds_sum 0.0015\nllmgw_pick_duration_seconds_count 100\n\
llmgw_pick_duration_seconds_bucket{le=\"1e-5\"} 40\nllmgw_pick_duration_seconds_bucket{le=\"2e-5\"} 98\n\
llmgw_pick_duration_seconds_bucket{le=\"+Inf\"} 100\n",
        );
        let h = after.since(&before);
        assert!((h.mean_us() - 15.0).abs() < 1e-9);
        assert!((h.quantile_le_us(0.5) - 20.0).abs() < 1e-9);
        assert!(h.quantile_le_us(0.99).is_infinite());
    }

    #[test]
    fn fill_reaches_the_size_and_steady_keeps_it() {
        let hasher = BlockHasher::new(&HashSettings::sha256_cbor(
            std::num::NonZeroUsize::new(BLOCK_SIZE).expect("nonzero"),
            Some(SEED),
        ))
        .expect("hasher");
        let config = ScaleConfig {
            blocks_per_replica: 500,
            ..ScaleConfig::default()
        };
        let workload = Workload::new(&config, &hasher);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let mut engine = rt
            .block_on(Engine::start(3, "127.0.0.1:1".parse().expect("addr")))
            .expect("engine");
        let mut distinct = HashSet::new();
        let batches = workload.fill(&mut engine, &mut distinct);
        let stored: usize = batches
            .iter()
            .flat_map(|b| &b.events)
            .map(|e| match e {
                KvEvent::BlockStored(s) => s.block_hashes.len(),
                _ => 0,
            })
            .sum();
        // The marker block is counted in `held` but published separately.
        assert_eq!(engine.held, stored + 1);
        assert!(
            engine.held <= 500 && engine.held > 500 - 32,
            "{}",
            engine.held
        );
        assert_eq!(distinct.len(), stored);
        // The last conversation's prompt hashes to blocks the fill published.
        let prompt = workload.prompt(3, engine.conversations - 1);
        let hashes: Vec<u64> = hasher
            .prompt_blocks(&prompt, None)
            .map(|d| d.external().0)
            .collect();
        assert_eq!(hashes.len(), 64);
        assert!(hashes.iter().all(|h| distinct.contains(h)));
        let held = engine.held;
        let step = workload.step(&mut engine, 10);
        assert_eq!(engine.held, held);
        assert_eq!(step.events.len(), 2);
    }
}
