//! The pure parts of `make bench-routing` (`llmgw-bench-routing`): the policies compared, the
//! round-robin Envoy configuration, reading a process's CPU time from `/proc`, the offered rate,
//! percentiles and the Markdown table. The binary starts the processes and drives the workload.

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

/// One routing policy of the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Envoy alone, `lb_policy: RANDOM`.
    Random,
    /// Envoy alone, `lb_policy: ROUND_ROBIN`.
    RoundRobin,
    /// No router: every tenant's conversations sent straight to one replica (tenant modulo
    /// replicas), placement by hand, to compare the routers with.
    Pinned,
    /// The same, but a conversation whose replica is down goes on at the next one (tenant + 1
    /// modulo replicas) rather than failing: hand placement that serves every request, to
    /// compare the routers with in the restart scenario.
    PinnedFailover,
    /// llmgw with the prefix slot's weight at 0: load scorers only.
    LeastLoaded,
    /// llmgw without engine hash settings or agent: the approximate prefix tree and load.
    ApproxPrefix,
    /// llmgw with hash settings and an agent mirroring the engines' KV events, tokenizing in
    /// process with the model's tokenizer.
    LlmgwPrecise,
    /// The same, tokenizing through the replicas' `/tokenize` (the default: no tokenizer file).
    LlmgwPreciseTokenize,
    /// The `vllm-router` peer (an HTTP proxy, no Envoy) with one of its policies.
    VllmRouter(VllmRouterPolicy),
}

/// `vllm-router --policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VllmRouterPolicy {
    RoundRobin,
    CacheAware,
    KvAware,
}

impl VllmRouterPolicy {
    pub fn flag(self) -> &'static str {
        match self {
            VllmRouterPolicy::RoundRobin => "round_robin",
            VllmRouterPolicy::CacheAware => "cache_aware",
            VllmRouterPolicy::KvAware => "kv_aware",
        }
    }
}

impl Policy {
    /// Every policy, in the order they run.
    pub const ALL: [Policy; 11] = [
        Policy::Random,
        Policy::RoundRobin,
        Policy::Pinned,
        Policy::PinnedFailover,
        Policy::LeastLoaded,
        Policy::ApproxPrefix,
        Policy::LlmgwPrecise,
        Policy::LlmgwPreciseTokenize,
        Policy::VllmRouter(VllmRouterPolicy::RoundRobin),
        Policy::VllmRouter(VllmRouterPolicy::CacheAware),
        Policy::VllmRouter(VllmRouterPolicy::KvAware),
    ];

    /// Whether requests go through Envoy (the vLLM router is its own proxy).
    pub fn uses_envoy(self) -> bool {
        !matches!(self, Policy::VllmRouter(_))
    }

    /// Whether an llmgw-router decides.
    pub fn uses_llmgw(self) -> bool {
        matches!(self, Policy::LeastLoaded | Policy::ApproxPrefix) || self.uses_agent()
    }

    /// Whether an llmgw-agent feeds the router's KV index (the precise policies).
    pub fn uses_agent(self) -> bool {
        matches!(self, Policy::LlmgwPrecise | Policy::LlmgwPreciseTokenize)
    }

    /// How the policy is set up, for the report.
    pub fn setup(self) -> &'static str {
        match self {
            Policy::Random => "Envoy `RANDOM`, no ext_proc",
            Policy::RoundRobin => "Envoy `ROUND_ROBIN`, no ext_proc",
            Policy::Pinned => "no router: each tenant's conversations straight to one replica",
            Policy::PinnedFailover => {
                "no router: each tenant's conversations straight to one replica, the next one while it is down"
            }
            Policy::LeastLoaded => "llmgw, `--weight-prefix 0`, no agent",
            Policy::ApproxPrefix => "llmgw without `--model` hash settings or agent (prefix tree)",
            Policy::LlmgwPrecise => {
                "llmgw + llmgw-agent (KV index from the sims' events), tokenizing in process"
            }
            Policy::LlmgwPreciseTokenize => {
                "llmgw + llmgw-agent, tokenizing through the replicas' /tokenize (the default)"
            }
            Policy::VllmRouter(VllmRouterPolicy::RoundRobin) => "vllm-router `round_robin`",
            Policy::VllmRouter(VllmRouterPolicy::CacheAware) => "vllm-router `cache_aware`",
            Policy::VllmRouter(VllmRouterPolicy::KvAware) => {
                "vllm-router `kv_aware`, `--kv-event-source` per sim"
            }
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::Random => f.write_str("random"),
            Policy::RoundRobin => f.write_str("round_robin"),
            Policy::Pinned => f.write_str("pinned"),
            Policy::PinnedFailover => f.write_str("pinned_failover"),
            Policy::LeastLoaded => f.write_str("least_loaded"),
            Policy::ApproxPrefix => f.write_str("approx_prefix"),
            Policy::LlmgwPrecise => f.write_str("llmgw_precise"),
            Policy::LlmgwPreciseTokenize => f.write_str("llmgw_precise_tokenize"),
            Policy::VllmRouter(p) => write!(f, "vllm-router:{}", p.flag()),
        }
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
#[error(
    "unknown policy {0:?}: expected random, round_robin, pinned, pinned_failover, least_loaded, approx_prefix, \
     llmgw_precise, llmgw_precise_tokenize, vllm-router:round_robin, vllm-router:cache_aware or vllm-router:kv_aware"
)]
pub struct UnknownPolicy(pub String);

impl FromStr for Policy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Policy, UnknownPolicy> {
        Policy::ALL
            .into_iter()
            .find(|p| p.to_string() == s)
            .ok_or_else(|| UnknownPolicy(s.to_owned()))
    }
}

/// The offered request rate: `load` (0.8 for 80 %) of the measured capacity.
pub fn offered_rate(capacity_per_s: f64, load: f64) -> f64 {
    capacity_per_s * load
}

/// Requests per second completed within a window.
pub fn rate_in_window(completed: usize, window_s: f64) -> f64 {
    if window_s > 0.0 {
        completed as f64 / window_s
    } else {
        0.0
    }
}

/// Percentile `p` (0–100) of sorted values, nearest rank.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted.get(rank.min(sorted.len() - 1)).copied()
}

/// One policy's measured row.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PolicyReport {
    pub policy: String,
    /// Which of the policy's runs (from 1) when it ran more than once (`--runs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run: Option<usize>,
    /// Successful requests sent within the measured window.
    pub requests: usize,
    pub errors: usize,
    /// The sims' own prefix-cache hit rate (tokens), 0–1.
    pub hit_rate: Option<f64>,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    /// Requests completed per second within the window.
    pub throughput_rps: f64,
    /// The router process's CPU per request (llmgw: router + agent; vllm-router: the proxy).
    pub router_cpu_us: Option<f64>,
    /// Envoy's CPU per request, where Envoy proxies.
    pub envoy_cpu_us: Option<f64>,
}

/// The reports as a Markdown table.
pub fn markdown_table(reports: &[PolicyReport]) -> String {
    let ms = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.1}"));
    let us = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.0}"));
    let mut out = String::from(
        "| policy | requests | errors | hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | \
         throughput req/s | router CPU µs/req | Envoy CPU µs/req |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in reports {
        let policy = run_label(&r.policy, r.run);
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} |\n",
            policy,
            r.requests,
            r.errors,
            r.hit_rate
                .map_or("–".to_owned(), |h| format!("{:.1} %", h * 100.0)),
            ms(r.ttft_p50_ms),
            ms(r.ttft_p90_ms),
            ms(r.ttft_p99_ms),
            r.throughput_rps,
            us(r.router_cpu_us),
            us(r.envoy_cpu_us),
        ));
    }
    out
}

/// How tables and notes name one run of a policy: `policy (run N)` when it ran more than once
/// (`--runs`), else the policy alone.
pub fn run_label(policy: &str, run: Option<usize>) -> String {
    match run {
        Some(run) => format!("{policy} (run {run})"),
        None => policy.to_owned(),
    }
}

/// Each policy's hit rate over its runs, as a Markdown table in the order the policies first
/// ran: every run's (– where a run measured none), then the mean and the range of those
/// measured. One 30-s run of a policy can differ from the next by points (where the first
/// tenants land decides much), so a comparison needs them all.
pub fn hit_rate_summary(reports: &[PolicyReport]) -> String {
    let mut policies: Vec<(&str, Vec<Option<f64>>)> = Vec::new();
    for report in reports {
        let index = match policies.iter().position(|(p, _)| *p == report.policy) {
            Some(index) => index,
            None => {
                policies.push((&report.policy, Vec::new()));
                policies.len() - 1
            }
        };
        policies[index].1.push(report.hit_rate.map(|h| h * 100.0));
    }
    let mut out = String::from(
        "| policy | hit rate per run | mean | lowest | highest |\n|---|---|---:|---:|---:|\n",
    );
    for (policy, per_run) in policies {
        let runs: Vec<String> = per_run
            .iter()
            .map(|r| r.map_or("–".to_owned(), |r| format!("{r:.1}")))
            .collect();
        let rates: Vec<f64> = per_run.into_iter().flatten().collect();
        let (mean, low, high) = if rates.is_empty() {
            ("–".to_owned(), "–".to_owned(), "–".to_owned())
        } else {
            let mean = rates.iter().sum::<f64>() / rates.len() as f64;
            let low = rates.iter().copied().fold(f64::INFINITY, f64::min);
            let high = rates.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            (
                format!("{mean:.2} %"),
                format!("{low:.1} %"),
                format!("{high:.1} %"),
            )
        };
        out.push_str(&format!(
            "| {policy} | {} | {mean} | {low} | {high} |\n",
            runs.join(", ")
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_round_trip_through_their_names() {
        for policy in Policy::ALL {
            assert_eq!(policy.to_string().parse::<Policy>(), Ok(policy));
        }
        assert!("sticky".parse::<Policy>().is_err());
        assert!(!Policy::VllmRouter(VllmRouterPolicy::KvAware).uses_envoy());
        assert!(Policy::LlmgwPrecise.uses_llmgw() && !Policy::RoundRobin.uses_llmgw());
        assert_eq!(
            "llmgw_precise_tokenize".parse::<Policy>(),
            Ok(Policy::LlmgwPreciseTokenize)
        );
        // Only the precise policies run an agent (the others' routers must not wait for one).
        let with_agent: Vec<Policy> = Policy::ALL.into_iter().filter(|p| p.uses_agent()).collect();
        assert_eq!(
            with_agent,
            [Policy::LlmgwPrecise, Policy::LlmgwPreciseTokenize]
        );
        assert!(with_agent.iter().all(|p| p.uses_llmgw()));
    }

    #[test]
    fn rates_and_percentiles() {
        assert_eq!(offered_rate(50.0, 0.8), 40.0);
        assert_eq!(rate_in_window(300, 20.0), 15.0);
        assert_eq!(rate_in_window(3, 0.0), 0.0);
        let sorted: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&sorted, 50.0), Some(51.0));
        assert_eq!(percentile(&sorted, 90.0), Some(90.0));
        assert_eq!(percentile(&sorted, 100.0), Some(100.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn table_has_a_row_per_policy_and_dashes_for_unmeasured_cells() {
        let rows = vec![
            PolicyReport {
                policy: "round_robin".into(),
                requests: 500,
                hit_rate: Some(0.4567),
                ttft_p50_ms: Some(12.34),
                ttft_p90_ms: Some(99.0),
                ttft_p99_ms: Some(250.0),
                throughput_rps: 20.04,
                envoy_cpu_us: Some(310.4),
                ..PolicyReport::default()
            },
            PolicyReport {
                policy: "llmgw_precise".into(),
                requests: 501,
                errors: 2,
                router_cpu_us: Some(812.6),
                ..PolicyReport::default()
            },
        ];
        let table = markdown_table(&rows);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(
            lines[2],
            "| round_robin | 500 | 0 | 45.7 % | 12.3 | 99.0 | 250.0 | 20.0 | – | 310 |"
        );
        assert_eq!(
            lines[3],
            "| llmgw_precise | 501 | 2 | – | – | – | – | 0.0 | 813 | – |"
        );
    }

    #[test]
    fn runs_are_named_in_the_table_and_summed_up_per_policy_in_first_run_order() {
        let run = |policy: &str, run: usize, hit_rate: Option<f64>| PolicyReport {
            policy: policy.into(),
            run: Some(run),
            hit_rate,
            ..PolicyReport::default()
        };
        let reports = [
            run("llmgw_precise", 1, Some(0.824)),
            run("approx_prefix", 1, Some(0.83)),
            run("round_robin", 1, None),
            run("llmgw_precise", 2, Some(0.801)),
            run("approx_prefix", 2, None),
            run("round_robin", 2, None),
            run("llmgw_precise", 3, Some(0.846)),
        ];
        assert!(
            markdown_table(&reports)
                .lines()
                .any(|l| l.starts_with("| llmgw_precise (run 2) | 0 |"))
        );
        let summary = hit_rate_summary(&reports);
        let lines: Vec<&str> = summary.lines().collect();
        assert_eq!(
            lines[2..],
            [
                "| llmgw_precise | 82.4, 80.1, 84.6 | 82.37 % | 80.1 % | 84.6 % |",
                // A run that measured nothing is shown, and left out of the mean.
                "| approx_prefix | 83.0, – | 83.00 % | 83.0 % | 83.0 % |",
                "| round_robin | –, – | – | – | – |",
            ]
        );
    }
}
