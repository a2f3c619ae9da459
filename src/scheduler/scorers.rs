//! The built-in load scorers. Each maps every candidate to `[0, 1]`, higher meaning "send it
//! here", and never treats unknown load (a stale or failed scrape) as idle: unknown scores 0.

use super::{Candidate, ScoringContext};

/// A load scorer: fills `scores[i]` for `candidates[i]`.
pub trait Scorer: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    fn score(&self, context: &ScoringContext<'_>, candidates: &[Candidate], scores: &mut [f64]);
}

/// Fewer requests waiting in the engine's queue is better (relative to the longest queue, and to
/// at least [`QUEUE_SCALE`] requests).
#[derive(Debug, Default)]
pub struct QueueScorer;

impl Scorer for QueueScorer {
    fn name(&self) -> &'static str {
        "queue"
    }

    fn score(&self, _: &ScoringContext<'_>, candidates: &[Candidate], scores: &mut [f64]) {
        relative_lower_is_better(
            candidates.iter().map(|c| c.engine.and_then(|e| e.waiting)),
            QUEUE_SCALE,
            scores,
        );
    }
}

/// Fewer requests llmgw itself has in flight to the replica is better (relative to the busiest,
/// and to at least [`IN_FLIGHT_SCALE`] requests). Always known, and fresher than any scrape.
#[derive(Debug, Default)]
pub struct InFlightScorer;

impl Scorer for InFlightScorer {
    fn name(&self) -> &'static str {
        "in_flight"
    }

    fn score(&self, _: &ScoringContext<'_>, candidates: &[Candidate], scores: &mut [f64]) {
        relative_lower_is_better(
            candidates.iter().map(|c| Some(f64::from(c.in_flight))),
            IN_FLIGHT_SCALE,
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

/// The smallest queue length that scores 0: below it, a queue's score is its share of this.
pub const QUEUE_SCALE: f64 = 4.0;

/// The smallest in-flight count that scores 0.
pub const IN_FLIGHT_SCALE: f64 = 8.0;

/// `1 - v / max(largest known v, scale)`; unknown → 0.
///
/// Not min-max: stretching the spread of the candidates' loads to [0, 1] would make one request
/// more in flight (3 against 4) weigh as much as the whole scale, and outvote a replica holding
/// the request's whole prompt for one holding a fraction of it. Scores stay proportional to load,
/// and `scale` keeps an almost idle pool from looking lopsided.
fn relative_lower_is_better(
    values: impl Iterator<Item = Option<f64>> + Clone,
    scale: f64,
    scores: &mut [f64],
) {
    let max = values.clone().flatten().fold(scale, f64::max);
    for (value, score) in values.zip(scores.iter_mut()) {
        *score = value.map_or(0.0, |v| (1.0 - v.max(0.0) / max).clamp(0.0, 1.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_score_relative_to_the_busiest_and_unknown_zero() {
        let values = [Some(0.0), Some(10.0), None, Some(5.0)];
        let mut scores = [9.0; 4];
        relative_lower_is_better(values.iter().copied(), 8.0, &mut scores);
        assert_eq!(scores, [1.0, 0.0, 0.0, 0.5]);
    }

    #[test]
    fn small_differences_stay_small() {
        // 3 against 4 in flight is not "idle against busy".
        let values = [Some(3.0), Some(4.0)];
        let mut scores = [9.0; 2];
        relative_lower_is_better(values.iter().copied(), 8.0, &mut scores);
        assert_eq!(scores, [0.625, 0.5]);
        let equal = [Some(3.0), Some(3.0), None];
        let mut scores = [9.0; 3];
        relative_lower_is_better(equal.iter().copied(), 8.0, &mut scores);
        assert_eq!(scores, [0.625, 0.625, 0.0]);
    }
}
