//! `saturation`: a replica whose engine queue, KV cache or llmgw in-flight count is at its
//! limit leaves the candidates; when every one is, the request waits in flow control's queue
//! ([`crate::flowcontrol`]) or, with flow control off, is refused with 429, rather than piled
//! onto an engine that cannot start it. Unknown load (a stale or failed scrape) never
//! saturates. The engine queue is the scrape's count with what llmgw started and saw end since
//! ([`crate::pool::Replica::waiting_estimate`]), so a burst between scrapes is seen at once.
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
        self.headroom_of(candidate) == Some(0)
    }

    /// Requests the candidate can take before a limit is reached; `None`: no limit applies.
    fn headroom_of(&self, candidate: &Candidate) -> Option<u32> {
        let limits = &self.limits;
        let kv_full = candidate
            .engine
            .and_then(|e| e.kv_cache_usage)
            .is_some_and(|u| u >= limits.max_kv_cache_usage);
        if kv_full {
            return Some(0);
        }
        // Saturating float → int conversion: a huge limit is simply no practical limit.
        let queue = candidate
            .waiting_estimate
            .map(|w| (limits.max_waiting - w).ceil().max(0.0) as u32);
        let in_flight =
            (limits.max_in_flight > 0).then(|| limits.max_in_flight.saturating_sub(candidate.in_flight));
        match (queue, in_flight) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

impl Filter for Saturation {
    fn filter(&self, _: Option<&ParsedRequest>, candidates: &mut Vec<Candidate>) {
        candidates.retain(|c| !self.saturated(c));
    }

    fn when_none_pass(&self) -> WhenNonePass {
        WhenNonePass::RefuseSaturated
    }

    fn headroom(&self, candidate: &Candidate) -> Option<u32> {
        self.headroom_of(candidate)
    }
}
