//! `GET /metrics`: vLLM's Prometheus names and labels (`model_name`, `engine`), rendered as
//! prometheus_client renders them (counters as `_total` plus `_created`, floats with a
//! decimal point). Pure formatting over a stats snapshot.

use std::fmt::Write as _;

use crate::engine::StatsSnapshot;
use crate::lora::LoraInfoSample;

/// Static facts for the metric labels.
#[derive(Debug, Clone)]
pub struct MetricsInfo {
    pub model_name: String,
    pub engine: String,
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub prefix_caching: bool,
    pub hash_algo: String,
    /// Process start, seconds since the epoch (for `_created`).
    pub created: f64,
    /// `--max-loras` with `--enable-lora` (`vllm:lora_requests_info` is exported only then).
    pub max_loras: Option<usize>,
}

fn py_bool(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

fn float(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

/// Renders the exposition text; `lora` are the series of `vllm:lora_requests_info`.
pub fn render(info: &MetricsInfo, s: &StatsSnapshot, lora: &[LoraInfoSample]) -> String {
    let labels = format!(
        "model_name=\"{}\",engine=\"{}\"",
        escape(&info.model_name),
        info.engine
    );
    let mut out = String::with_capacity(2048);
    let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        let _ = writeln!(out, "{name}{{{labels}}} {}", float(v));
    };
    let counter = |out: &mut String, name: &str, help: &str, v: u64| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} counter");
        let _ = writeln!(out, "{name}_total{{{labels}}} {}", float(v as f64));
        let _ = writeln!(out, "{name}_created{{{labels}}} {}", float(info.created));
    };
    gauge(
        &mut out,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        s.running as f64,
    );
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        s.waiting as f64,
    );
    gauge(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        s.kv_cache_usage,
    );
    counter(
        &mut out,
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        s.prefix_cache_queries,
    );
    counter(
        &mut out,
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        s.prefix_cache_hits,
    );
    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig"
    );
    let _ = writeln!(out, "# TYPE vllm:cache_config_info gauge");
    let _ = writeln!(
        out,
        "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"{}\",\
         num_gpu_blocks=\"{}\",num_gpu_blocks_override=\"{}\",prefix_caching_hash_algo=\"{}\",\
         engine=\"{}\"}} 1.0",
        info.block_size,
        py_bool(info.prefix_caching),
        info.num_gpu_blocks,
        info.num_gpu_blocks,
        info.hash_algo,
        info.engine,
    );
    if let Some(max_lora) = info.max_loras {
        // vLLM's v1 logger: labels (max_lora, waiting_lora_adapters, running_lora_adapters),
        // in that declaration order; the value is when the series was last set.
        let _ = writeln!(
            out,
            "# HELP vllm:lora_requests_info Running stats on lora requests."
        );
        let _ = writeln!(out, "# TYPE vllm:lora_requests_info gauge");
        for series in lora {
            let _ = writeln!(
                out,
                "vllm:lora_requests_info{{max_lora=\"{max_lora}\",waiting_lora_adapters=\"{}\",\
                 running_lora_adapters=\"{}\"}} {}",
                escape(&series.waiting),
                escape(&series.running),
                float(series.value),
            );
        }
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_and_labels() {
        let info = MetricsInfo {
            model_name: "tiny".into(),
            engine: "0".into(),
            block_size: 16,
            num_gpu_blocks: 48,
            prefix_caching: true,
            hash_algo: "sha256_cbor".into(),
            created: 1.7e9,
            max_loras: None,
        };
        let s = StatsSnapshot {
            running: 2,
            waiting: 1,
            kv_cache_usage: 0.25,
            prefix_cache_queries: 100,
            prefix_cache_hits: 64,
            steps: 0,
        };
        let text = render(&info, &s, &[]);
        for line in [
            "vllm:num_requests_running{model_name=\"tiny\",engine=\"0\"} 2.0",
            "vllm:num_requests_waiting{model_name=\"tiny\",engine=\"0\"} 1.0",
            "vllm:kv_cache_usage_perc{model_name=\"tiny\",engine=\"0\"} 0.25",
            "vllm:prefix_cache_queries_total{model_name=\"tiny\",engine=\"0\"} 100.0",
            "vllm:prefix_cache_hits_total{model_name=\"tiny\",engine=\"0\"} 64.0",
            "# TYPE vllm:prefix_cache_hits counter",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(text.contains("vllm:cache_config_info{block_size=\"16\""));
        assert!(text.contains("prefix_caching_hash_algo=\"sha256_cbor\""));
        assert!(
            !text.contains("lora_requests_info"),
            "exported only with --enable-lora"
        );
    }

    #[test]
    fn lora_requests_info_is_one_series_per_label_set_valued_by_time() {
        let info = MetricsInfo {
            model_name: "tiny".into(),
            engine: "0".into(),
            block_size: 16,
            num_gpu_blocks: 48,
            prefix_caching: true,
            hash_algo: "sha256_cbor".into(),
            created: 1.7e9,
            max_loras: Some(2),
        };
        let s = StatsSnapshot {
            running: 0,
            waiting: 0,
            kv_cache_usage: 0.0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            steps: 0,
        };
        let series = [
            LoraInfoSample {
                running: "a,b".into(),
                waiting: "a,b".into(),
                value: 1_733_000_000.25,
            },
            LoraInfoSample {
                running: String::new(),
                waiting: String::new(),
                value: 1_733_000_001.0,
            },
        ];
        let text = render(&info, &s, &series);
        for line in [
            "# TYPE vllm:lora_requests_info gauge",
            "vllm:lora_requests_info{max_lora=\"2\",waiting_lora_adapters=\"a,b\",\
             running_lora_adapters=\"a,b\"} 1733000000.25",
            "vllm:lora_requests_info{max_lora=\"2\",waiting_lora_adapters=\"\",\
             running_lora_adapters=\"\"} 1733000001.0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }
}
