//! `adapter_affinity`: for a LoRA adapter's request, prefers the replicas where the adapter is
//! active, as the engine's `vllm:lora_requests_info` says at the last scrape: running there
//! scores 1 (its weights are loaded and its requests batch together), waiting there 0.75 (it is
//! about to be loaded; only engines before vLLM 0.30 tell waiting from running, see
//! [`AdapterSlots`]), a free adapter slot 0.5 (it can be loaded without waiting), and every
//! slot taken by other adapters 0. Unknown slots score 0. Base-model requests abstain
//! (`not_an_adapter`), as do adapters no candidate lists in its `/v1/models`.
//!
//! No parameters.
//!
//! Metrics: `llmgw_adapter_affinity_total{outcome}` for each adapter request's pick: `running`,
//! `waiting`, `free_slot`, `full` (every slot there held other adapters) or `unknown`.
//!
//! Concurrency: stateless apart from its counters.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::NoParameters;
use crate::pool::adapters::AdapterSlots;
use crate::scheduler::Candidate;
use crate::scheduler::plugin::{Answer, Category, Pick, Role, Scorer, Scores, Scoring, ScoringContext};
use crate::scheduler::registry::{BuildContext, PluginError, ScorerPlugin, parameters};

pub(super) static PLUGIN: ScorerPlugin = ScorerPlugin {
    kind: "adapter_affinity",
    build,
};

fn build(context: &mut BuildContext<'_>, value: serde_yaml::Value) -> Result<Arc<dyn Scorer>, PluginError> {
    let NoParameters {} = parameters(value)?;
    Ok(Arc::new(AdapterAffinity {
        metrics: context.shared(AdapterMetrics::register),
    }))
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Debug, Default)]
struct AdapterMetrics {
    picks: Family<OutcomeLabels, Counter>,
}

impl AdapterMetrics {
    fn register(registry: &mut Registry) -> AdapterMetrics {
        let metrics = AdapterMetrics::default();
        registry.register(
            "llmgw_adapter_affinity",
            "LoRA adapter requests by the adapter's state on the chosen replica: running, \
             waiting, free_slot, full or unknown",
            metrics.picks.clone(),
        );
        metrics
    }
}

struct AdapterAffinity {
    metrics: Arc<AdapterMetrics>,
}

/// The adapter's state on one engine, best first.
fn state(slots: Option<&AdapterSlots>, adapter: &str) -> (&'static str, f64) {
    match slots {
        None => ("unknown", 0.0),
        Some(slots) if slots.is_running(adapter) => ("running", 1.0),
        Some(slots) if slots.is_waiting(adapter) => ("waiting", 0.75),
        Some(slots) if slots.has_free_slot() => ("free_slot", 0.5),
        Some(_) => ("full", 0.0),
    }
}

impl Scorer for AdapterAffinity {
    fn category(&self) -> Category {
        Category::Affinity
    }

    fn score<'a>(&'a self, context: &'a ScoringContext<'a>, candidates: &'a [Candidate]) -> Scoring<'a> {
        let adapter = context.request.model.as_str();
        if !candidates.iter().any(|c| c.lists_adapter(adapter)) {
            return Scoring::Ready(Answer::Abstain("not_an_adapter"));
        }
        let scores = candidates
            .iter()
            .map(|c| state(c.adapter_slots.as_deref(), adapter).1)
            .collect();
        Scoring::Ready(Answer::Scored(Scores::new(scores)))
    }

    fn after_pick(&self, context: &ScoringContext<'_>, pick: Pick<'_>, role: Role<'_>) {
        // Abstained: not an adapter's request.
        if matches!(role, Role::NotCounted { scores: None, .. }) {
            return;
        }
        let adapter = context.request.model.as_str();
        if !pick.candidates.iter().any(|c| c.lists_adapter(adapter)) {
            return;
        }
        let (outcome, _) = state(pick.chosen().adapter_slots.as_deref(), adapter);
        self.metrics
            .picks
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_beats_waiting_beats_a_free_slot_beats_full() {
        let slots = |running: &[&str], waiting: &[&str]| AdapterSlots {
            max_loras: 2,
            running: running.iter().map(|s| s.to_string()).collect(),
            waiting: waiting.iter().map(|s| s.to_string()).collect(),
        };
        assert_eq!(state(Some(&slots(&["a", "b"], &[])), "a"), ("running", 1.0));
        assert_eq!(state(Some(&slots(&["b", "c"], &["a"])), "a"), ("waiting", 0.75));
        assert_eq!(state(Some(&slots(&["b"], &[])), "a"), ("free_slot", 0.5));
        assert_eq!(state(Some(&slots(&["b", "c"], &[])), "a"), ("full", 0.0));
        assert_eq!(state(None, "a"), ("unknown", 0.0));
    }
}
