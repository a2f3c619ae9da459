//! `saturation`: a replica whose engine queue, KV cache or llmgw in-flight count is at its
//! limit leaves the candidates; when every one is, the request is refused with 429 rather than
//! piled onto an engine that cannot start it. Unknown load (a stale or failed scrape) never
//! saturates.
//!
//! Parameters: `max_waiting` (`vllm:num_requests_waiting`, default 128), `max_kv_cache_usage`
//! (`vllm:kv_cache_usage_perc`, default 0.99), `max_in_flight` (0 = no limit, the default).

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::openai::ParsedRequest;
use crate::scheduler::Candidate;
use crate::scheduler::plugin::{Filter, WhenNonePass};
use crate::scheduler::registry::{BuildContext, FilterPlugin, PluginError, parameters};

pub(super) static PLUGIN: FilterPlugin = FilterPlugin {
    kind: "saturation",
    build,
};

/// When a replica counts as saturated.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SaturationLimits {
    /// `vllm:num_requests_waiting` at or above this saturates.
    pub max_waiting: f64,
    /// `vllm:kv_cache_usage_perc` at or above this saturates.
    pub max_kv_cache_usage: f64,
    /// llmgw's own in-flight count at or above this saturates (0 = no limit).
    pub max_in_flight: u32,
}

impl Default for SaturationLimits {
    fn default() -> Self {
        SaturationLimits {
            max_waiting: 128.0,
            max_kv_cache_usage: 0.99,
            max_in_flight: 0,
        }
    }
}

fn build(
    _: &mut BuildContext<'_>,
    value: serde_yaml::Value,
) -> Result<Arc<dyn Filter>, PluginError> {
    let limits: SaturationLimits = parameters(value)?;
    let positive = |v: f64| v > 0.0;
    if !positive(limits.max_waiting) || !positive(limits.max_kv_cache_usage) {
        return Err(PluginError::Invalid(
            "max_waiting and max_kv_cache_usage must be > 0".to_owned(),
        ));
    }
    Ok(Arc::new(Saturation { limits }))
}

/// The filter.
#[derive(Debug)]
pub struct Saturation {
    limits: SaturationLimits,
}

impl Saturation {
    fn saturated(&self, candidate: &Candidate) -> bool {
        let limits = &self.limits;
        candidate.engine.is_some_and(|engine| {
            engine.waiting.is_some_and(|w| w >= limits.max_waiting)
                || engine
                    .kv_cache_usage
                    .is_some_and(|u| u >= limits.max_kv_cache_usage)
        }) || (limits.max_in_flight > 0 && candidate.in_flight >= limits.max_in_flight)
    }
}

impl Filter for Saturation {
    fn filter(&self, _: Option<&ParsedRequest>, candidates: &mut Vec<Candidate>) {
        candidates.retain(|c| !self.saturated(c));
    }

    fn when_none_pass(&self) -> WhenNonePass {
        WhenNonePass::RefuseSaturated
    }
}
