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

/// Shape of the workload.
#[derive(Debug, Clone)]
pub struct WorkloadConfig {
    pub model: String,
    pub tenants: usize,
    /// Conversations in flight at once.
    pub concurrency: usize,
    pub turns_per_conversation: usize,
    /// Stop starting conversations after this long.
    pub duration: Duration,
    /// At most this many requests in all (0 = no limit).
    pub max_requests: usize,
    pub max_tokens: u32,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            model: "tiny".to_owned(),
            tenants: 4,
            concurrency: 8,
            turns_per_conversation: 5,
            duration: Duration::from_secs(30),
            max_requests: 0,
            max_tokens: 12,
        }
    }
}

/// One request's outcome.
#[derive(Debug, Clone)]
pub struct Sample {
    pub replica: String,
    pub ttft: Duration,
    pub status: u16,
    pub salted: bool,
}

/// Everything measured so far (shared with a progress printer).
#[derive(Debug, Default)]
pub struct Results {
    pub samples: Vec<Sample>,
    pub errors: Vec<String>,
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

/// One conversation; false when the request limit was reached.
async fn conversation(
    client: &reqwest::Client,
    base_url: &str,
    config: &WorkloadConfig,
    id: usize,
    results: &Mutex<Results>,
    started: Instant,
) -> bool {
    let tenant = id % config.tenants;
    // The last tenant salts its requests: they must never share blocks with the others.
    let salt =
        (tenant + 1 == config.tenants && config.tenants > 1).then(|| format!("tenant-{tenant}"));
    let mut messages = vec![
        json!({"role": "system", "content": system_prompt(tenant)}),
        json!({"role": "user", "content": format!("Conversation {id}: what is rule {}?", id % 45)}),
    ];
    for turn in 0..config.turns_per_conversation {
        if started.elapsed() >= config.duration {
            return true;
        }
        if config.max_requests > 0 && results.lock().samples.len() >= config.max_requests {
            return false;
        }
        let mut body = json!({
            "model": config.model,
            "messages": messages,
            "max_tokens": config.max_tokens,
            "stream": true,
        });
        if let Some(salt) = &salt {
            body["cache_salt"] = json!(salt);
        }
        match streamed_chat(client, base_url, &body).await {
            Ok((sample, reply)) => {
                let ok = sample.status == 200;
                results.lock().samples.push(Sample {
                    salted: salt.is_some(),
                    ..sample
                });
                if !ok {
                    return true;
                }
                messages.push(json!({"role": "assistant", "content": reply}));
                messages
                    .push(json!({"role": "user", "content": format!("Turn {turn}: and then?")}));
            }
            Err(error) => {
                results.lock().errors.push(error);
                return true;
            }
        }
    }
    true
}

/// Sends one streamed chat request; returns the sample and the assistant's text.
async fn streamed_chat(
    client: &reqwest::Client,
    base_url: &str,
    body: &Value,
) -> Result<(Sample, String), String> {
    let sent = Instant::now();
    let response = client
        .post(format!("{base_url}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .map_err(|e| format!("request failed: {e}"))?;
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
    let mut pending = String::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| format!("stream broke: {e}"))?;
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
            salted: false,
        },
        text,
    ))
}

/// `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` from a replica's /metrics
/// text: (hits, queries) in tokens.
pub fn prefix_cache_counts(metrics: &str) -> (f64, f64) {
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    (
        value("vllm:prefix_cache_hits_total"),
        value("vllm:prefix_cache_queries_total"),
    )
}

/// A counter family's values by label value, from Prometheus text (e.g. the router's
/// `llmgw_kv_decisions_total{decision="hit"}`).
pub fn counters_by_label(metrics: &str, family: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix(family).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = labels
            .split_once('"')
            .and_then(|(_, v)| v.split_once('"'))
            .map(|(v, _)| v.to_owned())
            .unwrap_or_default();
        if let Ok(v) = value.trim().parse::<f64>() {
            out.insert(label, v);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_counters_it_reports() {
        let text = "# HELP x\nvllm:prefix_cache_hits_total{engine=\"0\",model_name=\"tiny\"} 30.0\n\
                    vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"tiny\"} 120.0\n\
                    llmgw_kv_decisions_total{decision=\"hit\"} 7\n\
                    llmgw_kv_decisions_total{decision=\"miss\"} 2\n";
        assert_eq!(prefix_cache_counts(text), (30.0, 120.0));
        let d = counters_by_label(text, "llmgw_kv_decisions_total");
        assert_eq!(d.get("hit"), Some(&7.0));
        assert_eq!(d.get("miss"), Some(&2.0));
    }

    #[test]
    fn percentiles_of_successful_requests() {
        let results = Results {
            samples: (1..=10)
                .map(|ms| Sample {
                    replica: "a".into(),
                    ttft: Duration::from_millis(ms),
                    status: if ms == 10 { 500 } else { 200 },
                    salted: false,
                })
                .collect(),
            errors: Vec::new(),
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
