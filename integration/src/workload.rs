//! A realistic chat workload for `make run` and the routing benchmark: several tenants, each
//! with a long system prompt, running multi-turn conversations that grow turn by turn; one
//! tenant salts its requests (`cache_salt`). Requests are streamed, so time to first token is
//! measured as a client sees it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use parking_lot::Mutex;
use serde_json::{Value, json};

use crate::SimHandle;

/// Shape of the workload.
#[derive(Debug, Clone)]
pub struct WorkloadConfig {
    pub model: String,
    /// LoRA adapters of `model` the tenants use (0: none): tenant `t` asks for
    /// [`adapter_name`]`(t % adapters)` instead of the base model.
    pub adapters: usize,
    pub tenants: usize,
    /// Conversations in flight at once.
    pub concurrency: usize,
    pub turns_per_conversation: usize,
    /// Stop starting conversations after this long.
    pub duration: Duration,
    /// At most this many requests in all (0 = no limit).
    pub max_requests: usize,
    pub max_tokens: u32,
    /// One conversation in `bypass_every` (0: none; chosen by a hash of its id, so every tenant
    /// has some) goes straight to a replica, not through the router: tenant `t`'s to
    /// `bypass[t % len]` (base URLs), as a client that knows a replica's address would send it.
    /// Only a router that reads the replicas' KV events sees what those conversations cache.
    pub bypass_every: usize,
    pub bypass: Vec<String>,
    /// A bypassing request its replica fails (the connection refused or the stream broken: the
    /// replica is down) is sent again to the next replicas of `bypass` in turn, and its
    /// conversation goes on at the first that answers, as a client with fallback addresses
    /// would; false: the conversation ends with the error.
    pub bypass_failover: bool,
    /// Percent (0-100) of conversations that belong to tenant 0, a hot tenant, on top of its
    /// share of the rest: enough of them saturate a replica, and load must outvote affinity.
    pub hot_tenant_percent: u8,
    /// `Some(seed)`: conversations' tenants drawn by a hash of the conversation's id and
    /// `seed`, rather than in turn. In turn, tenants next to each other in the order run their
    /// conversations at the same moments, and which of them share a cache changes its hit
    /// rate (docs/results/2026-12-05-placement-trace.md); drawn, no tenant has fixed
    /// neighbours. One seed draws the same tenants in every run; another seed draws others,
    /// so seeds differ in which tenants are heavy and in which order they first arrive, not
    /// only in when conversations start.
    pub tenants_drawn: Option<u64>,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            model: "tiny".to_owned(),
            adapters: 0,
            tenants: 4,
            concurrency: 8,
            turns_per_conversation: 5,
            duration: Duration::from_secs(30),
            max_requests: 0,
            max_tokens: 12,
            bypass_every: 0,
            bypass: Vec::new(),
            bypass_failover: false,
            hot_tenant_percent: 0,
            tenants_drawn: None,
        }
    }
}

/// The name of LoRA adapter `i` in workloads with adapters.
pub fn adapter_name(i: usize) -> String {
    format!("adapter-{i}")
}

impl WorkloadConfig {
    /// Conversation `id`'s tenant: tenant 0 for `hot_tenant_percent` of them (chosen by a hash
    /// of the id, the same in every run), the others in turn (or drawn by another hash of the
    /// id and the seed with `tenants_drawn`).
    pub fn tenant_of(&self, id: usize) -> usize {
        let tenants = self.tenants.max(1);
        if id_hash(id) % 100 < u64::from(self.hot_tenant_percent) {
            0
        } else if let Some(seed) = self.tenants_drawn {
            (splitmix(id as u64 ^ splitmix(seed ^ TENANT_STREAM)) % tenants as u64) as usize
        } else {
            id % tenants
        }
    }

    /// Whether conversation `id` bypasses the router: one in `bypass_every`, by a hash of the
    /// id (not the id itself, which would pick whole tenants, as tenants are taken in turn).
    /// The hash must mix its low bits: the multiplicative `id_hash`'s parity repeats with
    /// period four over long runs of ids, so with 8 tenants in turn half of them bypassed for
    /// 20 s at a time and the other half never did.
    pub fn bypasses(&self, id: usize) -> bool {
        self.bypass_every > 0
            && splitmix(id as u64 ^ BYPASS_STREAM).is_multiple_of(self.bypass_every as u64)
    }

    /// The model a tenant's requests name: an adapter's when the workload has adapters.
    pub fn model_of(&self, tenant: usize) -> String {
        match self.adapters {
            0 => self.model.clone(),
            n => adapter_name(tenant % n),
        }
    }
}

/// SplitMix64's output for state `x`: consecutive states give unrelated values. It drives the
/// arrivals and draws tenants (the multiplicative [`id_hash`] keeps consecutive ids' order,
/// so drawn neighbours would stay neighbours).
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The replica, of `replicas`, that a tenant's bypassing conversations go to (`None` for none):
/// tenant modulo replicas, so tenants share replicas evenly.
pub fn own_replica(tenant: usize, replicas: usize) -> Option<usize> {
    (replicas > 0).then(|| tenant % replicas)
}

/// Keeps the bypass draw apart from the tenant draw.
const BYPASS_STREAM: u64 = 0xD6E8_FEB8_6659_FD93;

/// Keeps the tenant draw's seed apart from the arrivals', which start from the bare seed.
const TENANT_STREAM: u64 = 0x2545_F491_4F6C_DD1D;

/// A multiplicative hash of a conversation id, the same in every run: consecutive ids step
/// through `% 100` evenly (the hot tenant's share), but its parity repeats over long runs.
fn id_hash(id: usize) -> u64 {
    (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32
}

/// One request's outcome.
#[derive(Debug, Clone)]
pub struct Sample {
    pub replica: String,
    /// The conversation's tenant.
    pub tenant: usize,
    /// The conversation's id and this request's turn in it (from 0).
    pub conversation: usize,
    pub turn: usize,
    pub ttft: Duration,
    pub status: u16,
    pub salted: bool,
    /// Sent straight to a replica (`WorkloadConfig::bypass`), not through the router.
    pub bypassed: bool,
    /// When it was sent and when its stream ended, from the workload's start.
    pub sent_at: Duration,
    pub done_at: Duration,
}

/// Everything measured so far (shared with a progress printer).
#[derive(Debug, Default)]
pub struct Results {
    /// The wall-clock instant the samples' `sent_at` count from (set by the run functions), so
    /// that they can be lined up with the logs of the processes under test.
    pub started_at: Option<std::time::SystemTime>,
    pub samples: Vec<Sample>,
    pub errors: Vec<String>,
    /// What each response other than 200 said: status, replica, when, and its body's start.
    pub failures: Vec<String>,
}

impl Results {
    pub fn per_replica(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for s in &self.samples {
            *counts.entry(s.replica.clone()).or_default() += 1;
        }
        counts
    }

    /// TTFT percentile (0–100) over successful requests.
    pub fn ttft_percentile(&self, p: f64) -> Option<Duration> {
        let mut ttfts: Vec<Duration> = self
            .samples
            .iter()
            .filter(|s| s.status == 200)
            .map(|s| s.ttft)
            .collect();
        if ttfts.is_empty() {
            return None;
        }
        ttfts.sort_unstable();
        let rank = ((p / 100.0) * (ttfts.len() - 1) as f64).round() as usize;
        Some(ttfts[rank.min(ttfts.len() - 1)])
    }
}

/// A tenant's system prompt: long, and the same for all its conversations.
pub fn system_prompt(tenant: usize) -> String {
    let rules: Vec<String> = (0..45)
        .map(|r| {
            format!(
                "Rule {r} of tenant {tenant}: answer politely about topic {}.",
                r * 7 % 13
            )
        })
        .collect();
    format!(
        "You are the assistant of tenant {tenant}. {}",
        rules.join(" ")
    )
}

/// Runs the workload against `base_url` (Envoy) until the duration or request limit is reached,
/// or `stop` resolves; results accumulate in `results` as they arrive.
pub async fn run(
    base_url: String,
    config: WorkloadConfig,
    results: Arc<Mutex<Results>>,
    stop: impl std::future::Future<Output = ()>,
) {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(config.concurrency)
        .build()
        .unwrap_or_default();
    let started = Instant::now();
    results.lock().started_at = Some(std::time::SystemTime::now());
    let config = Arc::new(config);
    let next_conversation = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..config.concurrency {
        let (client, base_url, config, results, next) = (
            client.clone(),
            base_url.clone(),
            Arc::clone(&config),
            Arc::clone(&results),
            Arc::clone(&next_conversation),
        );
        workers.spawn(async move {
            while started.elapsed() < config.duration {
                let id = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if !conversation(&client, &base_url, &config, id, &results, started).await {
                    break;
                }
            }
        });
    }
    tokio::select! {
        _ = async { while workers.join_next().await.is_some() {} } => {}
        _ = stop => workers.abort_all(),
    }
}

/// Runs the workload open loop: conversations start at random (exponential) intervals so that,
/// with every turn answered, `requests_per_s` requests are offered on average, whatever the
/// replies' latency. The same `seed` starts the same conversations at the same instants, so
/// policies compared one after another see the same traffic. Conversations stop taking turns
/// at `config.duration`; those in flight then finish (at most `drain` longer).
pub async fn run_open_loop(
    base_url: String,
    config: WorkloadConfig,
    requests_per_s: f64,
    seed: u64,
    drain: Duration,
    results: Arc<Mutex<Results>>,
) {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .unwrap_or_default();
    let turns = config.turns_per_conversation.max(1) as f64;
    let mut arrivals = Arrivals::new(requests_per_s / turns, seed);
    let config = Arc::new(config);
    let started = Instant::now();
    results.lock().started_at = Some(std::time::SystemTime::now());
    let mut conversations = tokio::task::JoinSet::new();
    for id in 0.. {
        let at = arrivals.next_arrival();
        if at >= config.duration {
            break;
        }
        tokio::time::sleep_until((started + at).into()).await;
        let (client, base_url, config, results) = (
            client.clone(),
            base_url.clone(),
            Arc::clone(&config),
            Arc::clone(&results),
        );
        conversations.spawn(async move {
            conversation(&client, &base_url, &config, id, &results, started).await;
        });
    }
    let drained = tokio::time::timeout(drain, async {
        while conversations.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        results.lock().errors.push(format!(
            "{} conversations still running after the drain",
            conversations.len()
        ));
        conversations.abort_all();
    }
}

/// A Poisson arrival process from a fixed seed (SplitMix64 → exponential gaps): the same seed
/// gives the same instants on every run.
#[derive(Debug, Clone)]
pub struct Arrivals {
    state: u64,
    rate_per_s: f64,
    now: Duration,
}

impl Arrivals {
    pub fn new(rate_per_s: f64, seed: u64) -> Arrivals {
        Arrivals {
            state: seed,
            rate_per_s,
            now: Duration::ZERO,
        }
    }

    /// The next arrival, from the process's start; never (`Duration::MAX`) at a rate ≤ 0.
    pub fn next_arrival(&mut self) -> Duration {
        if self.rate_per_s.is_nan() || self.rate_per_s <= 0.0 {
            return Duration::MAX;
        }
        // Uniform in (0, 1]: never 0, so the logarithm stays finite.
        let uniform = ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
        let gap = -uniform.ln() / self.rate_per_s;
        self.now = self.now.saturating_add(Duration::from_secs_f64(gap));
        self.now
    }

    fn next_u64(&mut self) -> u64 {
        let z = splitmix(self.state);
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z
    }
}

/// One conversation; false when the request limit was reached.
async fn conversation(
    client: &reqwest::Client,
    base_url: &str,
    config: &WorkloadConfig,
    id: usize,
    results: &Mutex<Results>,
    started: Instant,
) -> bool {
    let tenant = config.tenant_of(id);
    // The replica a bypassing conversation is sent to, as an index into `config.bypass`.
    let mut bypass = config
        .bypasses(id)
        .then(|| own_replica(tenant, config.bypass.len()))
        .flatten();
    // The last tenant salts its requests: they must never share blocks with the others.
    let salt =
        (tenant + 1 == config.tenants && config.tenants > 1).then(|| format!("tenant-{tenant}"));
    let mut messages = vec![
        json!({"role": "system", "content": system_prompt(tenant)}),
        json!({"role": "user", "content": format!("Conversation {id}: what is rule {}?", id % 45)}),
    ];
    let model = config.model_of(tenant);
    for turn in 0..config.turns_per_conversation {
        if started.elapsed() >= config.duration {
            return true;
        }
        if config.max_requests > 0 && results.lock().samples.len() >= config.max_requests {
            return false;
        }
        let mut body = json!({
            "model": model,
            "messages": messages,
            "max_tokens": config.max_tokens,
            "stream": true,
        });
        if let Some(salt) = &salt {
            body["cache_salt"] = json!(salt);
        }
        let sent_at = started.elapsed();
        let mut sent = match bypass {
            Some(at) => streamed_chat(client, &config.bypass[at], &body).await,
            None => streamed_chat(client, base_url, &body).await,
        };
        if let (Err(_), Some(home), true) = (&sent, bypass, config.bypass_failover) {
            // Its replica is down: the next ones in turn, and the conversation stays where
            // one answers.
            for next in (1..config.bypass.len()).map(|k| (home + k) % config.bypass.len()) {
                sent = streamed_chat(client, &config.bypass[next], &body).await;
                if sent.is_ok() {
                    bypass = Some(next);
                    break;
                }
            }
        }
        match sent {
            Ok((sample, reply)) => {
                let failure = (sample.status != 200).then(|| {
                    format!(
                        "{} from {} at {:.1} s: {reply}",
                        sample.status,
                        sample.replica,
                        sent_at.as_secs_f64()
                    )
                });
                let mut results = results.lock();
                results.samples.push(Sample {
                    tenant,
                    conversation: id,
                    turn,
                    salted: salt.is_some(),
                    bypassed: bypass.is_some(),
                    sent_at,
                    done_at: started.elapsed(),
                    ..sample
                });
                if let Some(failure) = failure {
                    results.failures.push(failure);
                    return true;
                }
                drop(results);
                messages.push(json!({"role": "assistant", "content": reply}));
                messages
                    .push(json!({"role": "user", "content": format!("Turn {turn}: and then?")}));
            }
            Err(error) => {
                results.lock().errors.push(error.to_string());
                return true;
            }
        }
    }
    true
}

/// Why a streamed chat request failed.
#[derive(Debug, thiserror::Error)]
enum ChatError {
    /// No response at all (the connection was refused or broke before a status came).
    #[error("request failed: {0}")]
    Connect(String),
    /// The response broke off before its end.
    #[error("stream broke: {0}")]
    Stream(String),
}

/// How much of a failed response's body is kept.
const MAX_FAILURE_BODY: usize = 300;

/// Sends one streamed chat request; returns the sample and the assistant's text (for a status
/// other than 200, the start of the response's body).
async fn streamed_chat(
    client: &reqwest::Client,
    base_url: &str,
    body: &Value,
) -> Result<(Sample, String), ChatError> {
    let sent = Instant::now();
    let response = client
        .post(format!("{base_url}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .map_err(|e| ChatError::Connect(e.to_string()))?;
    let status = response.status().as_u16();
    let replica = response
        .headers()
        .get("x-llmgw-sim-replica")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("?")
        .to_owned();
    let mut stream = response.bytes_stream();
    let mut ttft = None;
    let mut text = String::new();
    if status != 200 {
        // Not a stream of events but an error body: its start, for the report.
        while let Some(Ok(chunk)) = stream.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk));
            if text.len() >= MAX_FAILURE_BODY {
                break;
            }
        }
        let mut end = MAX_FAILURE_BODY.min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        return Ok((
            Sample {
                replica,
                ttft: sent.elapsed(),
                status,
                tenant: 0,
                conversation: 0,
                turn: 0,
                salted: false,
                bypassed: false,
                sent_at: Duration::ZERO,
                done_at: Duration::ZERO,
            },
            text.trim().to_owned(),
        ));
    }
    let mut pending = String::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ChatError::Stream(e.to_string()))?;
        pending.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let Ok(value) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if let Some(delta) = value["choices"][0]["delta"]["content"].as_str()
                && !delta.is_empty()
            {
                ttft.get_or_insert_with(|| sent.elapsed());
                text.push_str(delta);
            }
        }
    }
    Ok((
        Sample {
            replica,
            ttft: ttft.unwrap_or_else(|| sent.elapsed()),
            status,
            tenant: 0,
            conversation: 0,
            turn: 0,
            salted: false,
            bypassed: false,
            sent_at: Duration::ZERO,
            done_at: Duration::ZERO,
        },
        text,
    ))
}

/// `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` from a replica's /metrics
/// text: (hits, queries) in tokens, summed over every sample (vLLM labels each with `engine`
/// and `model_name`, one per data-parallel engine). A counter exposed without the `_total`
/// suffix (an exporter that does not add it) is read under its bare name; `_created` samples
/// are not counts.
pub fn prefix_cache_counts(metrics: &str) -> (f64, f64) {
    let total = |name: &str| {
        crate::prom::sum(metrics, &format!("{name}_total"), &[])
            .or_else(|| crate::prom::sum(metrics, name, &[]))
            .unwrap_or(0.0)
    };
    (
        total("vllm:prefix_cache_hits"),
        total("vllm:prefix_cache_queries"),
    )
}

/// `GET url` as text; empty when it fails (a missing scrape reads as zero counters).
pub async fn get_text(http: &reqwest::Client, url: &str) -> String {
    match http.get(url).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Empties every replica's prefix cache (`POST /reset_prefix_cache`, as vLLM serves it with
/// `VLLM_SERVER_DEV_MODE=1`). The replicas must be idle, or the reset is refused: vLLM then
/// answers `{"success": false}` (the sim logs a warning), and the reset is tried again a few
/// times before a warning is printed.
pub async fn reset_prefix_caches(http: &reqwest::Client, sims: &[SimHandle]) {
    for sim in sims {
        let url = format!("{}/reset_prefix_cache", sim.url());
        for attempt in 1..=5 {
            let problem = match http.post(&url).send().await {
                Err(error) => Some(error.to_string()),
                Ok(response) if !response.status().is_success() => Some(format!(
                    "{} (a vLLM engine serves it only with VLLM_SERVER_DEV_MODE=1)",
                    response.status()
                )),
                Ok(response) => {
                    let body = response.text().await.unwrap_or_default();
                    let refused = serde_json::from_str::<Value>(&body)
                        .is_ok_and(|v| v["success"] == Value::Bool(false));
                    refused.then(|| "refused: requests still hold KV blocks".to_owned())
                }
            };
            match problem {
                None => break,
                Some(problem) if attempt == 5 => println!("warning: {url}: {problem}"),
                Some(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }
    // The reset's AllBlocksCleared event goes out with the next engine step; let it settle.
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// The sims' summed (hits, queries) prefix-cache counters, in tokens.
pub async fn cache_counters(http: &reqwest::Client, sims: &[SimHandle]) -> (f64, f64) {
    let mut total = (0.0, 0.0);
    for sim in sims {
        let (hits, queries) =
            prefix_cache_counts(&get_text(http, &format!("{}/metrics", sim.url())).await);
        total.0 += hits;
        total.1 += queries;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_failed_response_is_recorded_with_its_status_replica_and_body() {
        let app = axum::Router::new().route(
            "/v1/chat/completions",
            axum::routing::post(|| async {
                (
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    [("x-llmgw-sim-replica", "r1")],
                    format!(
                        r#"{{"error": {{"message": "no replica ready{}"}}}}"#,
                        "!".repeat(400)
                    ),
                )
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let results = Arc::new(Mutex::new(Results::default()));
        let config = WorkloadConfig {
            concurrency: 1,
            max_requests: 2,
            ..WorkloadConfig::default()
        };
        run(
            format!("http://{addr}"),
            config,
            Arc::clone(&results),
            std::future::pending(),
        )
        .await;
        server.abort();
        let results = results.lock();
        // Each failure ends its conversation: two conversations, one failed request each.
        assert_eq!(results.samples.len(), 2);
        assert!(results.samples.iter().all(|s| s.status == 503));
        assert_eq!(results.failures.len(), 2, "{:?}", results.failures);
        let first = &results.failures[0];
        assert!(first.starts_with("503 from r1 at 0."), "{first}");
        assert!(
            first.contains(r#"{"error": {"message": "no replica ready!!!"#),
            "{first}"
        );
        // The body is cut to its start.
        assert!(first.len() < MAX_FAILURE_BODY + 40, "{}", first.len());
        assert!(results.errors.is_empty());
    }

    #[test]
    fn parses_the_counters_it_reports() {
        let text = "# HELP x\nvllm:prefix_cache_hits_total{engine=\"0\",model_name=\"tiny\"} 30.0\n\
                    vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"tiny\"} 120.0\n\
                    llmgw_kv_decisions_total{decision=\"hit\"} 7\n";
        assert_eq!(prefix_cache_counts(text), (30.0, 120.0));
    }

    #[test]
    fn parses_vllms_counters_with_their_created_samples_and_without_total() {
        // As vLLM 0.32's prometheus_client exposes them (two data-parallel engines).
        let text = "\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"tiny\"} 4096.0
vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"tiny\"} 1024.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine=\"0\",model_name=\"tiny\"} 1.7649e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"tiny\"} 2048.0
vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"tiny\"} 512.0
vllm:prefix_cache_hits_created{engine=\"0\",model_name=\"tiny\"} 1.7649e+09
vllm:external_prefix_cache_hits_total{engine=\"0\",model_name=\"tiny\"} 9.0
";
        assert_eq!(prefix_cache_counts(text), (2560.0, 5120.0));
        // An exporter that leaves the suffix off.
        let bare = "vllm:prefix_cache_hits{model_name=\"tiny\"} 3\n\
                    vllm:prefix_cache_queries{model_name=\"tiny\"} 4\n";
        assert_eq!(prefix_cache_counts(bare), (3.0, 4.0));
        assert_eq!(prefix_cache_counts(""), (0.0, 0.0));
    }

    #[test]
    fn arrivals_are_reproducible_and_average_the_rate() {
        let mut a = Arrivals::new(20.0, 7);
        let mut b = Arrivals::new(20.0, 7);
        let first: Vec<Duration> = (0..2000).map(|_| a.next_arrival()).collect();
        let second: Vec<Duration> = (0..2000).map(|_| b.next_arrival()).collect();
        assert_eq!(first, second);
        assert!(first.windows(2).all(|w| w[0] <= w[1]));
        // 2000 arrivals at 20/s: about 100 s (± 10 % is many standard deviations).
        let span = first[1999].as_secs_f64();
        assert!((90.0..110.0).contains(&span), "span {span}");
        assert_ne!(Arrivals::new(20.0, 8).next_arrival(), first[0]);
        assert_eq!(Arrivals::new(0.0, 7).next_arrival(), Duration::MAX);
    }

    #[test]
    fn a_hot_tenant_takes_its_share_and_the_rest_go_in_turn() {
        let plain = WorkloadConfig::default();
        assert_eq!(
            (0..8).map(|id| plain.tenant_of(id)).collect::<Vec<_>>(),
            [0, 1, 2, 3, 0, 1, 2, 3]
        );
        let hot = WorkloadConfig {
            hot_tenant_percent: 60,
            ..WorkloadConfig::default()
        };
        let of_zero = (0..10_000).filter(|&id| hot.tenant_of(id) == 0).count();
        // 60 % hot, plus a quarter of the other 40 %: about 70 %.
        assert!((6_700..7_300).contains(&of_zero), "{of_zero} of 10000");
        assert!((0..10_000).all(|id| hot.tenant_of(id) < 4));
    }

    #[test]
    fn drawn_tenants_come_in_no_fixed_order_and_each_gets_its_share() {
        let drawn_by = |seed| WorkloadConfig {
            tenants: 12,
            tenants_drawn: Some(seed),
            ..WorkloadConfig::default()
        };
        let drawn = drawn_by(1);
        let first: Vec<usize> = (0..24).map(|id| drawn.tenant_of(id)).collect();
        let in_turn: Vec<usize> = (0..24).map(|id| id % 12).collect();
        assert_ne!(first, in_turn);
        assert_eq!(
            first,
            (0..24)
                .map(|id| drawn_by(1).tenant_of(id))
                .collect::<Vec<_>>()
        );
        // Another seed draws other tenants, not the same ones at other instants.
        assert_ne!(
            first,
            (0..24)
                .map(|id| drawn_by(2).tenant_of(id))
                .collect::<Vec<_>>()
        );
        let mut counts = [0usize; 12];
        for id in 0..12_000 {
            counts[drawn.tenant_of(id)] += 1;
        }
        assert!(
            counts.iter().all(|&n| (850..1150).contains(&n)),
            "{counts:?}"
        );
        // How often a conversation's tenant is the next one's neighbour in the order: about
        // 2 in 12 when drawn, always when in turn.
        let neighbours = (0..12_000)
            .filter(|&id| {
                let (a, b) = (drawn.tenant_of(id), drawn.tenant_of(id + 1));
                (a + 1) % 12 == b || (b + 1) % 12 == a
            })
            .count();
        assert!(
            (1_500..2_500).contains(&neighbours),
            "{neighbours} of 12000"
        );
    }

    #[test]
    fn bypassing_conversations_come_from_every_tenant() {
        let config = WorkloadConfig {
            tenants: 8,
            bypass_every: 2,
            ..WorkloadConfig::default()
        };
        assert!((0..100).all(|id| !WorkloadConfig::default().bypasses(id)));
        let bypassing: Vec<usize> = (0..8_000).filter(|&id| config.bypasses(id)).collect();
        assert!(
            (3_600..4_400).contains(&bypassing.len()),
            "{}",
            bypassing.len()
        );
        for tenant in 0..8 {
            let of_tenant = bypassing
                .iter()
                .filter(|&&id| config.tenant_of(id) == tenant)
                .count();
            assert!(
                (300..700).contains(&of_tenant),
                "tenant {tenant}: {of_tenant} of 1000"
            );
        }
        // Within a run's worth of conversations (a 30 s run at 20 req/s starts about 120), every
        // tenant sends some straight to its replica and some through the router.
        for window in (0..8_000).collect::<Vec<usize>>().chunks(160) {
            for tenant in 0..8 {
                let of_tenant: Vec<bool> = window
                    .iter()
                    .filter(|&&id| config.tenant_of(id) == tenant)
                    .map(|&id| config.bypasses(id))
                    .collect();
                let bypassed = of_tenant.iter().filter(|&&b| b).count();
                assert!(
                    (1..of_tenant.len()).contains(&bypassed),
                    "tenant {tenant}, ids from {}: {bypassed} of {} bypass",
                    window[0],
                    of_tenant.len()
                );
            }
        }
    }

    #[test]
    fn percentiles_of_successful_requests() {
        let results = Results {
            samples: (1..=10)
                .map(|ms| Sample {
                    replica: "a".into(),
                    tenant: 0,
                    conversation: 0,
                    turn: 0,
                    ttft: Duration::from_millis(ms),
                    status: if ms == 10 { 500 } else { 200 },
                    salted: false,
                    bypassed: false,
                    sent_at: Duration::ZERO,
                    done_at: Duration::from_millis(ms),
                })
                .collect(),
            ..Results::default()
        };
        assert_eq!(
            results.ttft_percentile(50.0),
            Some(Duration::from_millis(5))
        );
        assert_eq!(
            results.ttft_percentile(100.0),
            Some(Duration::from_millis(9))
        );
        assert_eq!(results.per_replica().get("a"), Some(&10));
    }
}
