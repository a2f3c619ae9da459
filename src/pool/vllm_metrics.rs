//! Reading the series llmgw needs out of a vLLM `/metrics` page (Prometheus text format),
//! without a general parser: the three load series in one pass over the lines, the prefix-cache
//! counters in another, everything else skipped.

use super::EngineLoad;
use super::adapters::AdapterSlots;

const WAITING: &str = "vllm:num_requests_waiting";
const RUNNING: &str = "vllm:num_requests_running";
const KV_CACHE_USAGE: &str = "vllm:kv_cache_usage_perc";

/// Extracts the load series. Waiting and running are summed over label sets (data-parallel
/// engines); KV-cache usage is the highest of them, the engine closest to evicting.
pub fn parse_engine_load(text: &str) -> EngineLoad {
    let mut load = EngineLoad {
        waiting: None,
        running: None,
        kv_cache_usage: None,
    };
    for line in text.lines() {
        if !line.starts_with("vllm:") {
            continue;
        }
        if let Some(v) = sample_value(line, WAITING) {
            load.waiting = Some(load.waiting.unwrap_or(0.0) + v);
        } else if let Some(v) = sample_value(line, RUNNING) {
            load.running = Some(load.running.unwrap_or(0.0) + v);
        } else if let Some(v) = sample_value(line, KV_CACHE_USAGE) {
            load.kv_cache_usage = Some(load.kv_cache_usage.map_or(v, |u: f64| u.max(v)));
        }
    }
    load
}

const PREFIX_CACHE_HITS: &str = "vllm:prefix_cache_hits_total";
const PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries_total";

/// The engine's prefix-cache counters, in tokens, summed over engines.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheTotals {
    /// `vllm:prefix_cache_hits_total`: prompt tokens found cached.
    pub hits: f64,
    /// `vllm:prefix_cache_queries_total`: prompt tokens looked up.
    pub queries: f64,
}

/// The prefix-cache counters, when the page has both (an engine without prefix caching, or an
/// old vLLM, has neither).
pub fn parse_cache_totals(text: &str) -> Option<CacheTotals> {
    let mut hits = None;
    let mut queries = None;
    for line in text.lines().filter(|l| l.starts_with("vllm:prefix_cache_")) {
        if let Some(v) = sample_value(line, PREFIX_CACHE_HITS) {
            hits = Some(hits.unwrap_or(0.0) + v);
        } else if let Some(v) = sample_value(line, PREFIX_CACHE_QUERIES) {
            queries = Some(queries.unwrap_or(0.0) + v);
        }
    }
    Some(CacheTotals {
        hits: hits?,
        queries: queries?,
    })
}

const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";

/// A bound on one engine's cache, in blocks: far above what any accelerator's memory holds (an
/// H200's 141 GB hold under a million 16-token blocks of a 1B model), so a wrong label is not
/// trusted as a size.
const MAX_ENGINE_BLOCKS: u64 = 1 << 32;

/// The engine's KV cache size in blocks: the `num_gpu_blocks` label of `vllm:cache_config_info`,
/// summed over engines (data-parallel engines each export theirs, with an `engine` label). `None`
/// when the page has no such sample, or one whose label is not a whole number from 1 to
/// `MAX_ENGINE_BLOCKS` (vLLM writes `None` before the cache is allocated).
pub fn parse_cache_blocks(text: &str) -> Option<u64> {
    let mut total: Option<u64> = None;
    for line in text.lines().filter(|l| l.starts_with(CACHE_CONFIG_INFO)) {
        let Some(labels) = line[CACHE_CONFIG_INFO.len()..].strip_prefix('{') else {
            continue;
        };
        let Some(end) = closing_brace(labels) else {
            continue;
        };
        let blocks = label_pairs(&labels[..end])
            .find(|(key, _)| *key == "num_gpu_blocks")
            .and_then(|(_, value)| value.parse::<u64>().ok())
            .filter(|&b| b > 0 && b <= MAX_ENGINE_BLOCKS)?;
        total = Some(total.unwrap_or(0).saturating_add(blocks));
    }
    total
}

const LORA_INFO: &str = "vllm:lora_requests_info";

/// At most this many adapter names are read from one label (vLLM's `max_loras` is small).
const MAX_ADAPTERS_LISTED: usize = 256;

/// The engine's adapter slots: vLLM exports `vllm:lora_requests_info` as a gauge set to the
/// current time under labels `max_lora`, `running_lora_adapters` and `waiting_lora_adapters`
/// (names comma-separated), and every label set it ever had stays on the page, so the sample
/// with the largest value is the current one. `None` when the page has none (LoRA off) or its
/// newest sample has no valid `max_lora`.
pub fn parse_adapter_slots(text: &str) -> Option<AdapterSlots> {
    let mut newest: Option<(f64, &str)> = None;
    for line in text.lines().filter(|l| l.starts_with(LORA_INFO)) {
        let Some(value) = sample_value(line, LORA_INFO) else {
            continue;
        };
        if newest.is_none_or(|(best, _)| value > best) {
            newest = Some((value, line));
        }
    }
    let (_, line) = newest?;
    let labels = &line[LORA_INFO.len()..];
    let labels = labels.strip_prefix('{')?;
    let labels = &labels[..closing_brace(labels)?];
    let mut slots = AdapterSlots::default();
    let mut max_loras = None;
    for (key, value) in label_pairs(labels) {
        let names = || {
            value
                .split(',')
                .filter(|n| !n.is_empty())
                .take(MAX_ADAPTERS_LISTED)
                .map(str::to_owned)
                .collect()
        };
        match key {
            "max_lora" => max_loras = value.parse::<u32>().ok(),
            "running_lora_adapters" => slots.running = names(),
            "waiting_lora_adapters" => slots.waiting = names(),
            _ => {}
        }
    }
    slots.max_loras = max_loras?;
    Some(slots)
}

/// The `key="value"` pairs of a label set (without its braces). Values are taken raw: the
/// labels read here (numbers, adapter names) hold no escapes, and a value that does is only
/// compared, never trusted further.
fn label_pairs(labels: &str) -> impl Iterator<Item = (&str, &str)> {
    let mut rest = labels;
    std::iter::from_fn(move || {
        let (key, after) = rest.split_once("=\"")?;
        let mut end = None;
        let mut escaped = false;
        for (i, b) in after.bytes().enumerate() {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let end = end?;
        let value = &after[..end];
        rest = after[end + 1..].trim_start_matches([',', ' ']);
        Some((key.trim(), value))
    })
}

/// The value of `line` if it is a sample of exactly the series `name` (not `name_total` or a
/// longer name) with a finite, non-negative value.
fn sample_value(line: &str, name: &str) -> Option<f64> {
    let rest = line.strip_prefix(name)?;
    let after_labels = match rest.as_bytes().first()? {
        b'{' => &rest[closing_brace(rest)? + 1..],
        b' ' | b'\t' => rest,
        _ => return None,
    };
    let value: f64 = after_labels.split_ascii_whitespace().next()?.parse().ok()?;
    (value.is_finite() && value >= 0.0).then_some(value)
}

/// The index of the `}` ending a label set, skipping braces inside quoted label values.
fn closing_brace(labels: &str) -> Option<usize> {
    let mut in_quotes = false;
    let mut escaped = false;
    for (i, b) in labels.bytes().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if in_quotes => escaped = true,
            b'"' => in_quotes = !in_quotes,
            b'}' if !in_quotes => return Some(i),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_series_and_skips_the_rest() {
        let page = r#"# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 2.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0
vllm:num_requests_running{engine="0",model_name="ti}ny \"q\""} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
vllm:prefix_cache_queries_total{engine="0"} 100.0
python_gc_objects_collected_total{generation="0"} 7.0
"#;
        let load = parse_engine_load(page);
        assert_eq!(load.waiting, Some(5.0));
        assert_eq!(load.running, Some(4.0));
        assert_eq!(load.kv_cache_usage, Some(0.5));
    }

    #[test]
    fn missing_or_garbage_series_are_unknown() {
        let load = parse_engine_load(
            "vllm:num_requests_waiting NaN\nvllm:num_requests_running{engine=\"0\" 1\nvllm:kv_cache_usage_perc -1\n",
        );
        assert_eq!(load.waiting, None);
        assert_eq!(load.running, None);
        assert_eq!(load.kv_cache_usage, None);
        let unlabelled = parse_engine_load("vllm:num_requests_running 7 1700000000000\n");
        assert_eq!(unlabelled.running, Some(7.0));
    }

    #[test]
    fn cache_blocks_come_from_the_cache_config_labels() {
        // As vLLM 0.32 writes it (labels abridged), one sample per engine.
        let page = r#"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="160",prefix_caching_hash_algo="sha256_cbor"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="90",num_gpu_blocks_override="None"} 1.0
vllm:num_requests_waiting 0
"#;
        assert_eq!(parse_cache_blocks(page), Some(250));
        assert_eq!(parse_cache_blocks("vllm:num_requests_waiting 0\n"), None);
        for garbage in [
            "None",
            "-3",
            "0",
            "1.5",
            "99999999999999999999",
            "4294967297",
        ] {
            let page = format!("vllm:cache_config_info{{num_gpu_blocks=\"{garbage}\"}} 1.0\n");
            assert_eq!(parse_cache_blocks(&page), None, "{garbage}");
        }
        assert_eq!(
            parse_cache_blocks("vllm:cache_config_info{block_size=\"16\"} 1.0\n"),
            None,
            "no num_gpu_blocks label"
        );
    }

    #[test]
    fn the_newest_adapter_slots_sample_wins() {
        // As vLLM 0.32 writes it: every adapter with a request in flight in both lists.
        let page = r#"# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",waiting_lora_adapters="sql",running_lora_adapters="sql"} 1.7000000015e+09
vllm:lora_requests_info{max_lora="2",waiting_lora_adapters="sql,chat",running_lora_adapters="sql,chat"} 1.7000000030e+09
vllm:lora_requests_info{max_lora="2",waiting_lora_adapters="",running_lora_adapters=""} 1.7000000020e+09
"#;
        assert_eq!(
            parse_adapter_slots(page),
            Some(AdapterSlots {
                max_loras: 2,
                running: vec!["sql".into(), "chat".into()],
                waiting: vec!["sql".into(), "chat".into()],
            })
        );
        assert_eq!(parse_adapter_slots("vllm:num_requests_running 1\n"), None);
        let no_limit =
            r#"vllm:lora_requests_info{running_lora_adapters="a",waiting_lora_adapters=""} 1.0"#;
        assert_eq!(parse_adapter_slots(no_limit), None);
        let bad_limit = r#"vllm:lora_requests_info{max_lora="-1",running_lora_adapters="a"} 1.0"#;
        assert_eq!(parse_adapter_slots(bad_limit), None);
    }

    #[test]
    fn prefix_cache_counters_are_summed_over_engines_and_need_both() {
        let page = r#"# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 50.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 64.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 16.0
vllm:external_prefix_cache_hits_total{engine="0"} 999.0
"#;
        assert_eq!(
            parse_cache_totals(page),
            Some(CacheTotals {
                hits: 80.0,
                queries: 150.0
            })
        );
        assert_eq!(
            parse_cache_totals(
                "vllm:prefix_cache_queries_total 10\nvllm:prefix_cache_hits_total NaN\n"
            ),
            None
        );
        assert_eq!(parse_cache_totals("vllm:num_requests_running 1\n"), None);
    }
}
