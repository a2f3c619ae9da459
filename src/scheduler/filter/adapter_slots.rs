//! `adapter_slots`: for a LoRA adapter's request, a replica whose engine has every adapter slot
//! taken by other adapters (`vllm:lora_requests_info`: as many running adapters as `max_lora`,
//! this one not among them) leaves the candidates, since the request would wait there until a
//! slot frees. A preference, not a rule: when every candidate is full, all stay. A replica whose
//! slots are unknown (no fresh scrape, LoRA off) stays; base-model requests pass untouched.
//!
//! No parameters.

use std::sync::Arc;

use crate::openai::ParsedRequest;
use crate::scheduler::Candidate;
use crate::scheduler::plugin::{Filter, WhenNonePass};
use crate::scheduler::registry::{BuildContext, FilterPlugin, PluginError, parameters};

pub(super) static PLUGIN: FilterPlugin = FilterPlugin {
    kind: "adapter_slots",
    build,
};

/// The filter takes no parameters; any key is refused.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NoParameters {}

fn build(_: &mut BuildContext<'_>, value: serde_yaml::Value) -> Result<Arc<dyn Filter>, PluginError> {
    let NoParameters {} = parameters(value)?;
    Ok(Arc::new(AdapterSlotsFilter))
}

/// The filter.
#[derive(Debug)]
pub struct AdapterSlotsFilter;

impl Filter for AdapterSlotsFilter {
    fn filter(&self, request: Option<&ParsedRequest>, candidates: &mut Vec<Candidate>) {
        let Some(request) = request else {
            return;
        };
        let adapter = request.model.as_str();
        if !candidates.iter().any(|c| c.lists_adapter(adapter)) {
            return;
        }
        candidates.retain(|c| {
            !c.adapter_slots
                .as_ref()
                .is_some_and(|slots| slots.is_full_without(adapter))
        });
    }

    fn when_none_pass(&self) -> WhenNonePass {
        WhenNonePass::KeepAll
    }
}
