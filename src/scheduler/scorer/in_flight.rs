//! `in_flight`: fewer requests llmgw itself has in flight to the replica is better, relative to
//! the busiest and to at least [`IN_FLIGHT_SCALE`] requests. Always known, and fresher than any
//! scrape.

use std::sync::Arc;

use super::relative_lower_is_better;
use crate::scheduler::Candidate;
use crate::scheduler::plugin::{Answer, Category, Scorer, Scores, Scoring, ScoringContext};
use crate::scheduler::registry::{BuildContext, PluginError, ScorerPlugin, parameters};

pub(super) static PLUGIN: ScorerPlugin = ScorerPlugin {
    kind: "in_flight",
    build,
};

/// The smallest in-flight count that scores 0.
pub const IN_FLIGHT_SCALE: f64 = 8.0;

fn build(_: &mut BuildContext<'_>, value: serde_yaml::Value) -> Result<Arc<dyn Scorer>, PluginError> {
    let super::NoParameters {} = parameters(value)?;
    Ok(Arc::new(InFlight))
}

#[derive(Debug)]
struct InFlight;

impl Scorer for InFlight {
    fn category(&self) -> Category {
        Category::Load
    }

    fn score<'a>(&'a self, _: &'a ScoringContext<'a>, candidates: &'a [Candidate]) -> Scoring<'a> {
        let in_flight = candidates.iter().map(|c| Some(f64::from(c.in_flight)));
        Scoring::Ready(Answer::Scored(Scores::new(relative_lower_is_better(
            in_flight,
            IN_FLIGHT_SCALE,
        ))))
    }
}
