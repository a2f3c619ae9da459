//! `kv_utilization`: more free KV cache is better, `1 - vllm:kv_cache_usage_perc`.

use std::sync::Arc;

use crate::scheduler::Candidate;
use crate::scheduler::plugin::{Answer, Category, Scorer, Scores, Scoring, ScoringContext};
use crate::scheduler::registry::{BuildContext, PluginError, ScorerPlugin, parameters};

pub(super) static PLUGIN: ScorerPlugin = ScorerPlugin {
    kind: "kv_utilization",
    build,
};

fn build(_: &mut BuildContext<'_>, value: serde_yaml::Value) -> Result<Arc<dyn Scorer>, PluginError> {
    let super::NoParameters {} = parameters(value)?;
    Ok(Arc::new(KvUtilization))
}

#[derive(Debug)]
struct KvUtilization;

impl Scorer for KvUtilization {
    fn category(&self) -> Category {
        Category::Load
    }

    fn score<'a>(&'a self, _: &'a ScoringContext<'a>, candidates: &'a [Candidate]) -> Scoring<'a> {
        let free = candidates
            .iter()
            .map(|c| {
                c.engine
                    .and_then(|e| e.kv_cache_usage)
                    .map_or(0.0, |usage| (1.0 - usage).clamp(0.0, 1.0))
            })
            .collect();
        Scoring::Ready(Answer::Scored(Scores::new(free)))
    }
}
