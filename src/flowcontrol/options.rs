//! Flow control's options: flags (and `LLMGW_*` variables) over the file's `flow_control:`
//! section over the defaults.
//!
//! ```yaml
//! flow_control:
//!   enabled: true               # false: a saturated pool answers 429 at once
//!   queue_timeout: 30s          # longest wait for capacity; then 429 (503 if none is ready)
//!   max_queued: 1024            # per model; a full queue displaces lower priorities
//!   default_priority: 0         # requests naming no objective
//!   fairness_header: x-gateway-inference-fairness-id
//!   objectives:
//!     - {name: interactive, priority: 100}
//!     - {name: batch, priority: -1, queue_timeout: 5s}
//! ```

use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

use super::objectives::ObjectiveSpec;

/// The fairness-id header of GIE; llm-d's `x-llm-d-inference-fairness-id` is read too.
pub const FAIRNESS_HEADER: &str = "x-gateway-inference-fairness-id";

/// Flags and file keys.
#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowControlOptions {
    /// Queue requests while every replica of their model is saturated (default true); false
    /// answers them 429 at once.
    #[arg(long = "flow-control", env = "LLMGW_FLOW_CONTROL")]
    pub enabled: Option<bool>,
    /// The longest a request waits for capacity before it is answered 429 (503 when no
    /// replica is ready); default 30s. An objective or the request's `x-llmgw-queue-timeout`
    /// may shorten it.
    #[arg(long, env = "LLMGW_QUEUE_TIMEOUT", value_parser = crate::duration::parse)]
    #[serde(deserialize_with = "crate::duration::optional")]
    pub queue_timeout: Option<Duration>,
    /// Requests that may wait per model (default 1024); beyond, a request displaces the newest
    /// of a lower priority or is answered 429.
    #[arg(long, env = "LLMGW_MAX_QUEUED")]
    pub max_queued: Option<usize>,
    /// The priority of requests that name no objective (default 0).
    #[arg(long, env = "LLMGW_DEFAULT_PRIORITY", allow_negative_numbers = true)]
    pub default_priority: Option<i32>,
    /// The header naming a request's tenant for fair queueing (default
    /// x-gateway-inference-fairness-id; x-llm-d-inference-fairness-id is read as well).
    #[arg(long, env = "LLMGW_FAIRNESS_HEADER")]
    pub fairness_header: Option<String>,
    /// File only: the objectives by name.
    #[arg(skip)]
    pub objectives: Vec<ObjectiveSpec>,
}

/// Resolved flow control settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowSettings {
    pub enabled: bool,
    pub queue_timeout: Duration,
    pub max_queued: usize,
    pub default_priority: i32,
    /// Lower-case.
    pub fairness_header: String,
    pub objectives: Vec<ObjectiveSpec>,
}

impl Default for FlowSettings {
    fn default() -> Self {
        FlowSettings {
            enabled: true,
            queue_timeout: Duration::from_secs(30),
            max_queued: 1024,
            default_priority: 0,
            fairness_header: FAIRNESS_HEADER.to_owned(),
            objectives: Vec::new(),
        }
    }
}

/// A setting flow control cannot work with.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FlowOptionsError {
    #[error("flow_control.max_queued must be at least 1")]
    MaxQueued,
    #[error("flow_control.objectives: {0:?} is given twice")]
    DuplicateObjective(String),
    #[error("flow_control.objectives: an objective needs a non-empty name")]
    EmptyObjectiveName,
    #[error("flow_control.fairness_header {0:?} is not a valid header name")]
    FairnessHeader(String),
}

impl FlowControlOptions {
    /// These options (the flags) over `file`'s, over the defaults.
    pub fn resolve(&self, file: &FlowControlOptions) -> Result<FlowSettings, FlowOptionsError> {
        let default = FlowSettings::default();
        let settings = FlowSettings {
            enabled: self.enabled.or(file.enabled).unwrap_or(default.enabled),
            queue_timeout: self
                .queue_timeout
                .or(file.queue_timeout)
                .unwrap_or(default.queue_timeout),
            max_queued: self
                .max_queued
                .or(file.max_queued)
                .unwrap_or(default.max_queued),
            default_priority: self
                .default_priority
                .or(file.default_priority)
                .unwrap_or(default.default_priority),
            fairness_header: self
                .fairness_header
                .clone()
                .or_else(|| file.fairness_header.clone())
                .unwrap_or(default.fairness_header)
                .to_ascii_lowercase(),
            objectives: file.objectives.clone(),
        };
        if settings.max_queued == 0 {
            return Err(FlowOptionsError::MaxQueued);
        }
        if http::HeaderName::from_bytes(settings.fairness_header.as_bytes()).is_err() {
            return Err(FlowOptionsError::FairnessHeader(settings.fairness_header));
        }
        let mut seen = std::collections::HashSet::new();
        for objective in &settings.objectives {
            if objective.name.is_empty() {
                return Err(FlowOptionsError::EmptyObjectiveName);
            }
            if !seen.insert(objective.name.as_str()) {
                return Err(FlowOptionsError::DuplicateObjective(objective.name.clone()));
            }
        }
        Ok(settings)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(yaml: &str) -> FlowControlOptions {
        serde_yaml::from_str(yaml).expect("flow_control section")
    }

    #[test]
    fn flags_over_file_over_defaults() {
        let file = file(
            "{queue_timeout: 2s, max_queued: 8, objectives: [{name: a, priority: 5}, {name: b, priority: -1, queue_timeout: 0s}]}",
        );
        let flags = FlowControlOptions {
            max_queued: Some(16),
            fairness_header: Some("X-Tenant".into()),
            ..FlowControlOptions::default()
        };
        let settings = flags.resolve(&file).expect("valid");
        assert!(settings.enabled);
        assert_eq!(settings.queue_timeout, Duration::from_secs(2));
        assert_eq!(settings.max_queued, 16);
        assert_eq!(settings.fairness_header, "x-tenant");
        assert_eq!(settings.objectives.len(), 2);
        assert_eq!(settings.objectives[1].queue_timeout, Some(Duration::ZERO));
        assert_eq!(
            FlowControlOptions::default().resolve(&FlowControlOptions::default()),
            Ok(FlowSettings::default())
        );
    }

    #[test]
    fn bad_settings_are_named() {
        let none = FlowControlOptions::default();
        assert_eq!(
            none.resolve(&file("{max_queued: 0}")),
            Err(FlowOptionsError::MaxQueued)
        );
        assert_eq!(
            none.resolve(&file("{objectives: [{name: a}, {name: a, priority: 1}]}")),
            Err(FlowOptionsError::DuplicateObjective("a".into()))
        );
        assert_eq!(
            none.resolve(&file("{fairness_header: 'bad header'}")),
            Err(FlowOptionsError::FairnessHeader("bad header".into()))
        );
        for bad in [
            "{objectives: [{name: a, priority: high}]}",
            "{objectives: [{name: a, priority: 99999999999}]}",
            "{objectives: [{name: a, criticality: Critical}]}",
            "{queue_timeout: soon}",
            "{max_queue: 3}",
        ] {
            assert!(
                serde_yaml::from_str::<FlowControlOptions>(bad).is_err(),
                "{bad} was accepted"
            );
        }
    }
}
