//! `queue`: fewer requests waiting in the engine's queue is better, relative to the longest
//! queue and to at least [`QUEUE_SCALE`] requests.

use std::sync::Arc;

use super::relative_lower_is_better;
use crate::scheduler::Candidate;
use crate::scheduler::plugin::{Answer, Category, Scorer, Scores, Scoring, ScoringContext};
use crate::scheduler::registry::{BuildContext, PluginError, ScorerPlugin, parameters};

pub(super) static PLUGIN: ScorerPlugin = ScorerPlugin {
    kind: "queue",
    build,
};

/// The smallest queue length that scores 0: below it, a queue's score is its share of this.
pub const QUEUE_SCALE: f64 = 4.0;

fn build(_: &mut BuildContext<'_>, value: serde_yaml::Value) -> Result<Arc<dyn Scorer>, PluginError> {
    let super::NoParameters {} = parameters(value)?;
    Ok(Arc::new(Queue))
}

#[derive(Debug)]
struct Queue;

impl Scorer for Queue {
    fn category(&self) -> Category {
        Category::Load
    }

    fn score<'a>(&'a self, _: &'a ScoringContext<'a>, candidates: &'a [Candidate]) -> Scoring<'a> {
        let waiting = candidates.iter().map(|c| c.engine.and_then(|e| e.waiting));
        Scoring::Ready(Answer::Scored(Scores::new(relative_lower_is_better(
            waiting,
            QUEUE_SCALE,
        ))))
    }
}
