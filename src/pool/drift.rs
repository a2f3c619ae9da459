//! Self-checking precise routing: what llmgw expects each replica to find cached, against what
//! the engine says it found.
//!
//! For every pick the precise tier knows how many of the prompt's tokens the chosen replica
//! should find in its prefix cache (the leading blocks the index credits it with, at most
//! vLLM's `(prompt_len - 1) // block_size` blocks, since vLLM always computes the last token).
//! The engine counts what it really found in `vllm:prefix_cache_hits_total` out of
//! `vllm:prefix_cache_queries_total`, which the scrapes llmgw already makes read, and, where
//! the proxy sends llmgw the response (`FULL_DUPLEX_STREAMED`) and the engine reports it
//! (`usage.prompt_tokens_details.cached_tokens`), per request in the response itself. Over a
//! sliding window the two **hit rates** are compared (rates, not token counts, so a second
//! router or traffic sent straight to the replica does not read as drift), once this router
//! picked the replica [`MIN_JUDGED_PICKS`] times and each side saw [`MIN_JUDGED_TOKENS`].
//! The responses, where enough were seen, are the engine's account of exactly this router's
//! requests, so they are judged first; the scrapes count every request the engine served:
//! `drift = |observed - expected| / max(observed, expected)`, 0 when they agree, 1 when one is
//! zero and the other is not. A wrong `--model` seed or block size and a tokenizer that is not
//! the engine's make the router's hashes match nothing (expected ≈ 0 while the engine hits); a
//! stale index credits blocks the engine no longer has (expected above observed). Crossing
//! [`DRIFT_ALERT`] logs one warning, and one line again when it recovers. Requests the precise
//! tier did not decide (the imbalance guard, a tokenizer timeout) are counted by the engine
//! and expected by nobody, so a router that often decides without the index reads a little
//! drift of its own.
//!
//! # Concurrency model
//! Expectations and the responses' counts are atomics added to on the request path. The
//! scraped side and the window
//! are one `parking_lot::Mutex`, taken by the scrape task once per scrape and by the metrics
//! collector; never held across an `.await`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::vllm_metrics::CacheTotals;

/// How far back the drift compares.
pub const DRIFT_WINDOW: Duration = Duration::from_secs(60);
/// Prompt tokens each side must have seen within the window before it is judged.
pub const MIN_JUDGED_TOKENS: u64 = 2048;
/// This router's picks of the replica within the window before it is judged. Where another
/// router or a client sent straight to the replica shares the engine, this router's picks are
/// a sample of what the engine served: a few picks (a tenant's first prompt, a miss, while the
/// other router sends the same tenant's next turns there, all hits) are not the engine's rate.
/// Seen with two routers on bench-routing: two first prompts, 2,048 tokens, expected 0 % while
/// the engine hit 33 %, and a false warning.
pub const MIN_JUDGED_PICKS: u64 = 16;
/// Drift from which a warning is logged.
pub const DRIFT_ALERT: f64 = 0.5;
/// Drift under which the warning is withdrawn (lower than the alert, so it does not flap).
pub const DRIFT_CLEAR: f64 = 0.25;
/// Window points kept: at most one per second.
const POINT_SPACING: Duration = Duration::from_secs(1);

/// One replica's expected and observed prefix-cache hits.
#[derive(Debug, Default)]
pub struct CacheDrift {
    expected_hits: AtomicU64,
    routed_tokens: AtomicU64,
    routed_picks: AtomicU64,
    reported_hits: AtomicU64,
    reported_tokens: AtomicU64,
    engine: Mutex<EngineSide>,
}

#[derive(Debug, Default)]
struct EngineSide {
    /// The engine's counters at the last scrape, to take differences from.
    last: Option<CacheTotals>,
    observed_hits: u64,
    observed_queries: u64,
    /// Totals of both sides at past scrapes, oldest first, spanning about [`DRIFT_WINDOW`].
    window: VecDeque<Point>,
    drift: Option<f64>,
    alarmed: bool,
}

#[derive(Debug, Clone, Copy)]
struct Point {
    at: Instant,
    expected_hits: u64,
    routed_tokens: u64,
    routed_picks: u64,
    observed_hits: u64,
    observed_queries: u64,
    reported_hits: u64,
    reported_tokens: u64,
}

/// What the collector exports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DriftView {
    /// Prompt tokens llmgw expected the replica to find cached, summed over its picks.
    pub expected_hits: u64,
    /// Prompt tokens of those picks.
    pub routed_tokens: u64,
    /// Cached prompt tokens the engine reported (increases of `vllm:prefix_cache_hits_total`).
    pub observed_hits: u64,
    /// Prompt tokens the engine reported (increases of `vllm:prefix_cache_queries_total`).
    pub observed_queries: u64,
    /// Cached prompt tokens the engine reported in the responses llmgw saw.
    pub reported_hits: u64,
    /// Prompt tokens of those responses.
    pub reported_tokens: u64,
    /// Over the last window, once both sides saw enough tokens.
    pub drift: Option<f64>,
}

/// `|a - b| / max(a, b)`, 0 when both are 0.
fn disagreement(expected: f64, observed: f64) -> f64 {
    let larger = expected.max(observed);
    if larger <= 0.0 {
        0.0
    } else {
        (expected - observed).abs() / larger
    }
}

impl CacheDrift {
    /// A pick sent `prompt_tokens` here, of which llmgw expects `cached_tokens` to hit.
    pub fn expect(&self, cached_tokens: u64, prompt_tokens: u64) {
        self.expected_hits
            .fetch_add(cached_tokens, Ordering::Relaxed);
        self.routed_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        self.routed_picks.fetch_add(1, Ordering::Relaxed);
    }

    /// A response from this replica said the engine found `cached_tokens` of its
    /// `prompt_tokens` cached.
    pub fn reported(&self, cached_tokens: u64, prompt_tokens: u64) {
        self.reported_hits
            .fetch_add(cached_tokens, Ordering::Relaxed);
        self.reported_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
    }

    /// The engine's counters as scraped at `at`; `replica` names it in the log lines. A counter
    /// that went down means the engine restarted: what it shows now is all new.
    pub fn observe(&self, replica: &str, totals: CacheTotals, at: Instant) {
        let mut engine = self.engine.lock();
        if let Some(last) = engine.last {
            let grew = |now: f64, before: f64| {
                if now >= before { now - before } else { now }
            };
            engine.observed_hits += grew(totals.hits, last.hits) as u64;
            engine.observed_queries += grew(totals.queries, last.queries) as u64;
        }
        engine.last = Some(totals);
        let point = Point {
            at,
            expected_hits: self.expected_hits.load(Ordering::Relaxed),
            routed_tokens: self.routed_tokens.load(Ordering::Relaxed),
            routed_picks: self.routed_picks.load(Ordering::Relaxed),
            observed_hits: engine.observed_hits,
            observed_queries: engine.observed_queries,
            reported_hits: self.reported_hits.load(Ordering::Relaxed),
            reported_tokens: self.reported_tokens.load(Ordering::Relaxed),
        };
        if engine
            .window
            .back()
            .is_none_or(|p| at.saturating_duration_since(p.at) >= POINT_SPACING)
        {
            engine.window.push_back(point);
        }
        // Keep one point at least a window old as the base.
        while engine.window.len() > 2
            && engine
                .window
                .get(1)
                .is_some_and(|p| at.saturating_duration_since(p.at) >= DRIFT_WINDOW)
        {
            engine.window.pop_front();
        }
        let Some(base) = engine.window.front().copied() else {
            return;
        };
        let routed = point.routed_tokens - base.routed_tokens;
        // The responses where enough were seen, else the scraped counters.
        let reported = point.reported_tokens - base.reported_tokens;
        let (engine_hits, engine_tokens) = if reported >= MIN_JUDGED_TOKENS {
            (point.reported_hits - base.reported_hits, reported)
        } else {
            (
                point.observed_hits - base.observed_hits,
                point.observed_queries - base.observed_queries,
            )
        };
        let picks = point.routed_picks - base.routed_picks;
        if routed < MIN_JUDGED_TOKENS
            || engine_tokens < MIN_JUDGED_TOKENS
            || picks < MIN_JUDGED_PICKS
        {
            engine.drift = None;
            return;
        }
        let expected = (point.expected_hits - base.expected_hits) as f64 / routed as f64;
        let observed = engine_hits as f64 / engine_tokens as f64;
        let drift = disagreement(expected, observed);
        engine.drift = Some(drift);
        if !engine.alarmed && drift >= DRIFT_ALERT {
            engine.alarmed = true;
            tracing::warn!(
                replica,
                expected_hit_rate = expected,
                observed_hit_rate = observed,
                drift,
                "the engine's prefix-cache hits disagree with the KV index: check the model's \
                 --model seed and block_size against the engine's PYTHONHASHSEED and \
                 --block-size, its tokenizer, and the feed from this replica's agent"
            );
        } else if engine.alarmed && drift < DRIFT_CLEAR {
            engine.alarmed = false;
            tracing::info!(
                replica,
                drift,
                "the engine's prefix-cache hits agree with the KV index again"
            );
        }
    }

    pub fn view(&self) -> DriftView {
        let engine = self.engine.lock();
        DriftView {
            expected_hits: self.expected_hits.load(Ordering::Relaxed),
            routed_tokens: self.routed_tokens.load(Ordering::Relaxed),
            observed_hits: engine.observed_hits,
            observed_queries: engine.observed_queries,
            reported_hits: self.reported_hits.load(Ordering::Relaxed),
            reported_tokens: self.reported_tokens.load(Ordering::Relaxed),
            drift: engine.drift,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(hits: f64, queries: f64) -> CacheTotals {
        CacheTotals { hits, queries }
    }

    /// `picks` picks of `prompt_tokens / picks` tokens each, `cached_tokens / picks` expected.
    fn expect_picks(drift: &CacheDrift, picks: u64, cached_tokens: u64, prompt_tokens: u64) {
        for _ in 0..picks {
            drift.expect(cached_tokens / picks, prompt_tokens / picks);
        }
    }

    #[test]
    fn disagreement_is_relative_and_symmetric() {
        assert_eq!(disagreement(0.0, 0.0), 0.0);
        assert_eq!(disagreement(0.5, 0.5), 0.0);
        assert_eq!(disagreement(0.0, 0.6), 1.0);
        assert_eq!(disagreement(1.0, 0.25), 0.75);
        assert_eq!(disagreement(0.25, 1.0), 0.75);
    }

    #[tokio::test(start_paused = true)]
    async fn rates_are_compared_over_the_window_once_enough_tokens_passed() {
        let drift = CacheDrift::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // The first scrape is the engine's baseline: what it counted before is not ours.
        drift.observe("r", totals(1e6, 2e6), at(0));
        expect_picks(&drift, 4, 600, 1000);
        drift.observe("r", totals(1e6 + 600.0, 2e6 + 1000.0), at(1));
        assert_eq!(drift.view().drift, None, "too few tokens to judge");
        // The router expects 60 % hits; the engine finds 60 % too (two routers share it, so it
        // sees twice the tokens): no drift.
        expect_picks(&drift, 12, 1800, 3000);
        drift.observe("r", totals(1e6 + 4800.0, 2e6 + 8000.0), at(2));
        let view = drift.view();
        assert_eq!(view.observed_hits, 4800);
        assert_eq!(view.observed_queries, 8000);
        assert_eq!((view.expected_hits, view.routed_tokens), (2400, 4000));
        assert_eq!(view.drift, Some(0.0));
        // Then the engine stops hitting what the router expects (a stale index).
        for s in 3..70 {
            drift.expect(600, 1000);
            let hits = 1e6 + 4800.0 + 60.0 * (s - 2) as f64;
            let queries = 2e6 + 8000.0 + 1000.0 * (s - 2) as f64;
            drift.observe("r", totals(hits, queries), at(s));
        }
        // Only the last window counts: 6 % observed against 60 % expected.
        let judged = drift.view().drift.expect("judged");
        assert!((judged - 0.9).abs() < 1e-9, "{judged}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_responses_judge_first_where_enough_were_seen() {
        let drift = CacheDrift::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        drift.observe("r", totals(0.0, 0.0), at(0));
        // This router expects 60 % and its responses say 60 %; the scrapes show 20 %, since
        // most of what the engine served came from elsewhere (clients sent straight to it).
        expect_picks(&drift, 20, 3000, 5000);
        drift.reported(3000, 5000);
        drift.observe("r", totals(4000.0, 20_000.0), at(1));
        let view = drift.view();
        assert_eq!((view.reported_hits, view.reported_tokens), (3000, 5000));
        assert_eq!(view.drift, Some(0.0), "{view:?}");
        // Too few responses in the window (streams without usage): the scrapes judge.
        let drift = CacheDrift::default();
        drift.observe("r", totals(0.0, 0.0), at(0));
        expect_picks(&drift, 20, 3000, 5000);
        drift.reported(300, 500);
        drift.observe("r", totals(1000.0, 5000.0), at(1));
        let judged = drift.view().drift.expect("judged");
        assert!((judged - (0.6 - 0.2) / 0.6).abs() < 1e-9, "{judged}");
        // The responses disagree with what was expected: drift, whatever the scrapes say.
        let drift = CacheDrift::default();
        drift.observe("r", totals(0.0, 0.0), at(0));
        expect_picks(&drift, 20, 3000, 5000);
        drift.reported(0, 5000);
        drift.observe("r", totals(3000.0, 5000.0), at(1));
        assert_eq!(drift.view().drift, Some(1.0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_few_picks_among_another_routers_are_not_judged() {
        let drift = CacheDrift::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        drift.observe("r", totals(0.0, 0.0), at(0));
        // Two routers start: this one's first two picks here are two tenants' first prompts
        // (misses), while the other router sends those tenants' next turns here (hits). Enough
        // tokens, too few picks: not judged.
        expect_picks(&drift, 2, 0, 2200);
        drift.observe("r", totals(2200.0, 6600.0), at(1));
        assert_eq!(drift.view().drift, None);
        // Fourteen more picks, most of them hits as the engine's: judged, and they agree.
        expect_picks(&drift, 14, 6300, 8400);
        drift.observe("r", totals(10_000.0, 20_000.0), at(2));
        let judged = drift.view().drift.expect("judged");
        // 6300 of 10,600 expected (0.594) against 0.5 observed.
        assert!(judged < DRIFT_CLEAR, "{judged}");
    }

    #[tokio::test(start_paused = true)]
    async fn an_engine_restart_counts_from_zero_and_the_window_stays_bounded() {
        let drift = CacheDrift::default();
        let t0 = Instant::now();
        drift.observe("r", totals(5000.0, 9000.0), t0);
        // Restarted: its counters went down, and what they show is new.
        drift.observe("r", totals(100.0, 400.0), t0 + Duration::from_secs(1));
        let view = drift.view();
        assert_eq!((view.observed_hits, view.observed_queries), (100, 400));
        // Scrapes five times a second for ten minutes keep about a window of points.
        for i in 0..3000u64 {
            drift.observe(
                "r",
                totals(100.0, 400.0),
                t0 + Duration::from_millis(2000 + 200 * i),
            );
        }
        let points = drift.engine.lock().window.len();
        assert!(points <= DRIFT_WINDOW.as_secs() as usize + 2, "{points}");
    }
}
