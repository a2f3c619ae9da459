//! The built-in load scorers. Each maps every candidate to `[0, 1]`, higher meaning "send it
//! here", and never treats unknown load (a stale or failed scrape) as idle: unknown scores 0.

use super::{Candidate, ScoringContext};

/// A load scorer: fills `scores[i]` for `candidates[i]`.
pub trait Scorer: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    fn score(&self, context: &ScoringContext<'_>, candidates: &[Candidate], scores: &mut [f64]);
}

/// Fewer requests waiting in the engine's queue is better (min-max normalized over candidates).
#[derive(Debug, Default)]
pub struct QueueScorer;

impl Scorer for QueueScorer {
    fn name(&self) -> &'static str {
        "queue"
    }

    fn score(&self, _: &ScoringContext<'_>, candidates: &[Candidate], scores: &mut [f64]) {
        min_max_lower_is_better(
            candidates.iter().map(|c| c.engine.and_then(|e| e.waiting)),
            scores,
        );
    }
}

/// Fewer requests llmgw itself has in flight to the replica is better. Always known, and fresher
/// than any scrape.
#[derive(Debug, Default)]
pub struct InFlightScorer;

impl Scorer for InFlightScorer {
    fn name(&self) -> &'static str {
        "in_flight"
    }

    fn score(&self, _: &ScoringContext<'_>, candidates: &[Candidate], scores: &mut [f64]) {
        min_max_lower_is_better(
            candidates.iter().map(|c| Some(f64::from(c.in_flight))),
            scores,
        );
    }
}

/// More free KV cache is better: `1 - vllm:kv_cache_usage_perc`.
#[derive(Debug, Default)]
pub struct KvCacheScorer;

impl Scorer for KvCacheScorer {
    fn name(&self) -> &'static str {
        "kv_cache"
    }

    fn score(&self, _: &ScoringContext<'_>, candidates: &[Candidate], scores: &mut [f64]) {
        for (candidate, score) in candidates.iter().zip(scores.iter_mut()) {
            *score = candidate
                .engine
                .and_then(|e| e.kv_cache_usage)
                .map_or(0.0, |usage| (1.0 - usage).clamp(0.0, 1.0));
        }
    }
}

/// `(max - v) / (max - min)` over the known values; all equal → 1; unknown → 0.
fn min_max_lower_is_better(values: impl Iterator<Item = Option<f64>> + Clone, scores: &mut [f64]) {
    let (min, max) = values
        .clone()
        .flatten()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    for (value, score) in values.zip(scores.iter_mut()) {
        *score = match value {
            None => 0.0,
            Some(_) if max <= min => 1.0,
            Some(v) => (max - v) / (max - min),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_max_normalizes_and_scores_unknown_zero() {
        let values = [Some(0.0), Some(10.0), None, Some(5.0)];
        let mut scores = [9.0; 4];
        min_max_lower_is_better(values.iter().copied(), &mut scores);
        assert_eq!(scores, [1.0, 0.0, 0.0, 0.5]);
    }

    #[test]
    fn all_equal_known_values_score_one() {
        let values = [Some(3.0), Some(3.0), None];
        let mut scores = [9.0; 3];
        min_max_lower_is_better(values.iter().copied(), &mut scores);
        assert_eq!(scores, [1.0, 1.0, 0.0]);
    }
}
