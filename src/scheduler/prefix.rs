//! The prefix slot: where precise prefix-cache scoring plugs into the scheduler.
//!
//! The scheduler owns at most one [`PrefixScorer`]. For each completion request it is called
//! after the filters, with the parsed request and the surviving candidates, and may take its
//! time (tokenize over HTTP, hash, look up an index): it is async. After the pick,
//! [`PrefixScorer::after_pick`] tells it which replica was chosen, handing back the
//! [`PrefixScores`] it produced, so an index can record the routing (speculative entries) without
//! recomputing hashes.

use std::any::Any;

use futures::future::BoxFuture;
use thiserror::Error;

use super::Candidate;
use crate::openai::ParsedRequest;

/// Per-candidate prefix scores, aligned with the `candidates` slice the scorer was given.
pub struct PrefixScores {
    /// One score in `[0, 1]` per candidate (1 = the whole prompt is cached there). Values outside
    /// the range are clamped; a wrong length is treated as "no prefix information".
    pub per_candidate: Vec<f64>,
    /// Whatever the scorer wants back in [`PrefixScorer::after_pick`] (e.g. the request's block
    /// hashes).
    pub memo: Option<Box<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for PrefixScores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixScores")
            .field("per_candidate", &self.per_candidate)
            .field("memo", &self.memo.is_some())
            .finish()
    }
}

/// The prefix scorer could not score this request (tokenizer down, unsupported input...). The
/// scheduler then decides on load alone and counts the miss.
#[derive(Debug, Error)]
#[error("prefix scoring unavailable: {reason}")]
pub struct PrefixUnavailable {
    pub reason: String,
}

/// A prefix-affinity scorer for the scheduler's prefix slot.
pub trait PrefixScorer: Send + Sync + 'static {
    /// A short name for logs and metrics.
    fn name(&self) -> &'static str;

    /// Scores each candidate by how much of the request's prefix it holds.
    fn score<'a>(
        &'a self,
        request: &'a ParsedRequest,
        candidates: &'a [Candidate],
    ) -> BoxFuture<'a, Result<PrefixScores, PrefixUnavailable>>;

    /// Called once per successful decision with the chosen candidate and the scores this scorer
    /// returned for the request. Must not block: it runs on the request path.
    fn after_pick(&self, request: &ParsedRequest, chosen: &Candidate, scores: &PrefixScores);
}

/// A shared scorer (the router keeps a handle for metrics and `/debug`).
impl<T: PrefixScorer> PrefixScorer for std::sync::Arc<T> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn score<'a>(
        &'a self,
        request: &'a ParsedRequest,
        candidates: &'a [Candidate],
    ) -> BoxFuture<'a, Result<PrefixScores, PrefixUnavailable>> {
        (**self).score(request, candidates)
    }

    fn after_pick(&self, request: &ParsedRequest, chosen: &Candidate, scores: &PrefixScores) {
        (**self).after_pick(request, chosen, scores)
    }
}
