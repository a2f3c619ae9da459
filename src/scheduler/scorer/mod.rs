//! Scorer plugins: each gives every candidate a score in `[0, 1]`, higher meaning "send it
//! here"; the scheduler takes the weighted mean.
//!
//! | type | category | reads | parameters |
//! |---|---|---|---|
//! | `kv_cache` | affinity | tokenize → blockhash → kvindex (+ speculative picks, each holder's recent evictions, restarted replicas' homes, lent prompts) | `min_blocks`, `speculative_ttl`, `evicted_hold`, `rebuild_cost`, `lend_memory` |
//! | `prefix_tree` | affinity | the approximate prefix tree of routed prompt text | `chunk_bytes`, `max_nodes` |
//! | `session_affinity` | affinity | a session header or cookie → the replica it went to last | `header`, `cookie`, `max_sessions`, `max_key_bytes` |
//! | `adapter_affinity` | affinity | `vllm:lora_requests_info`: the adapter running, waiting, or a free slot | — |
//! | `cache_footprint` | placement | kvindex block counts per replica + what recent picks will store | — |
//! | `queue` | load | `vllm:num_requests_waiting` | — |
//! | `in_flight` | load | llmgw's own in-flight count | — |
//! | `kv_utilization` | load | `vllm:kv_cache_usage_perc` | — |
//!
//! Load scorers never treat unknown load (a stale or failed scrape) as idle: unknown scores 0.

use super::registry::{ScorerPlugin, plugins};

plugins!(ScorerPlugin: kv_cache, prefix_tree, session_affinity, adapter_affinity, cache_footprint, queue, in_flight, kv_utilization);

/// The label of the affinity scorers' decision counters.
#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct DecisionLabels {
    decision: &'static str,
}

/// The settings of a scorer that has none: any key under `parameters:` is refused.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NoParameters {}

/// `1 - v / max(largest known v, scale)`; unknown → 0.
///
/// Not min-max: stretching the spread of the candidates' loads to [0, 1] would make one request
/// more in flight (3 against 4) weigh as much as the whole scale, and outvote a replica holding
/// the request's whole prompt for one holding a fraction of it. Scores stay proportional to load,
/// and `scale` keeps an almost idle pool from looking lopsided.
fn relative_lower_is_better(
    values: impl Iterator<Item = Option<f64>> + Clone,
    scale: f64,
) -> Vec<f64> {
    let max = values.clone().flatten().fold(scale, f64::max);
    values
        .map(|value| value.map_or(0.0, |v| (1.0 - v.max(0.0) / max).clamp(0.0, 1.0)))
        .collect()
}

/// Share of each candidate's match in the best one's (`matched[i]` blocks or share), as the
/// affinity scorers classify a pick: `hit` (the chosen one matched as much as the best),
/// `miss` (nobody matched), `load_override` (someone matched more, load decided otherwise).
fn classify(matched: impl Iterator<Item = f64> + Clone, chosen: usize) -> &'static str {
    let best = matched.clone().fold(0.0, f64::max);
    let mine = matched.clone().nth(chosen).unwrap_or(0.0);
    if best <= 0.0 {
        "miss"
    } else if mine >= best {
        "hit"
    } else {
        "load_override"
    }
}

#[cfg(test)]
mod unit_tests {
    use super::*;

    #[test]
    fn loads_score_relative_to_the_busiest_and_unknown_zero() {
        let values = [Some(0.0), Some(10.0), None, Some(5.0)];
        assert_eq!(
            relative_lower_is_better(values.iter().copied(), 8.0),
            [1.0, 0.0, 0.0, 0.5]
        );
    }

    #[test]
    fn small_differences_stay_small() {
        // 3 against 4 in flight is not "idle against busy".
        let values = [Some(3.0), Some(4.0)];
        assert_eq!(
            relative_lower_is_better(values.iter().copied(), 8.0),
            [0.625, 0.5]
        );
        let equal = [Some(3.0), Some(3.0), None];
        assert_eq!(
            relative_lower_is_better(equal.iter().copied(), 8.0),
            [0.625, 0.625, 0.0]
        );
    }

    #[test]
    fn a_pick_is_a_hit_a_miss_or_a_load_override() {
        let matched = [0.0, 2.0, 4.0];
        assert_eq!(classify(matched.iter().copied(), 2), "hit");
        assert_eq!(classify(matched.iter().copied(), 1), "load_override");
        assert_eq!(classify([0.0, 0.0].iter().copied(), 1), "miss");
    }
}

#[cfg(test)]
mod tests;
