//! The scheduling profile: which filters and scorers decide, with which weights and parameters.
//!
//! In the YAML file under `scheduler:` (the default shown; a `profile:` replaces it whole):
//!
//! ```yaml
//! scheduler:
//!   profile:
//!     filters:
//!       - type: saturation
//!         parameters: {max_waiting: 128, max_kv_cache_usage: 0.99, max_in_flight: 0}
//!       - type: adapter_slots        # LoRA: not where every adapter slot holds another one
//!     scorers:
//!       - type: kv_cache             # precise: tokenize → blockhash → kvindex
//!         weight: 2
//!         parameters: {min_blocks: 1, speculative_ttl: 2s, rebuild_cost: 0, evicted_hold: 0, lend_memory: 0s}
//!         fallback:                  # asked when kv_cache abstains or matches nothing
//!           type: prefix_tree
//!       - {type: adapter_affinity, weight: 1} # LoRA: where the adapter is running
//!       - type: cache_footprint      # a prompt found nowhere: the emptiest cache with room,
//!         weight: 2                  # else packed onto the fullest within its share
//!         parameters: {fill: 0.9, max_share: 1.5}
//!       - {type: queue, weight: 1}
//!       - {type: in_flight, weight: 1}
//!       - {type: kv_utilization, weight: 1}
//!   weights: {queue: 2}              # by name, over the profile's weights (0 turns one off)
//!   imbalance_threshold: 16          # load spread from which affinity scorers are skipped
//!   fallbacks: 2                     # next-best replicas after the pick
//! ```
//!
//! A plugin's `name` defaults to its `type`; give two of one type different names. Flags set
//! the common knobs ([`SchedulerArgs`]): weights by name, the saturation limits, the prefix
//! parameters, the guard and the fallbacks. Unknown types, unknown or ill-typed parameters and
//! weights naming no plugin are start-up errors naming the key.

use std::collections::BTreeMap;
use std::time::Duration;

use clap::Args;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// One plugin of the profile.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PluginSpec {
    /// The plugin's type, as registered ([`super::registry`]).
    #[serde(rename = "type")]
    pub kind: String,
    /// The instance name (for weights, logs and `/debug`); defaults to `type`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Scorers only: the weight in the weighted mean (default 1; 0 turns it off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    /// The plugin's own settings; each type documents and checks its keys.
    #[serde(default, skip_serializing_if = "serde_yaml::Value::is_null")]
    pub parameters: serde_yaml::Value,
    /// Scorers only: asked, with this scorer's weight, when this one abstains or scores every
    /// candidate 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<Box<PluginSpec>>,
}

impl PluginSpec {
    pub fn of(kind: &str) -> PluginSpec {
        PluginSpec {
            kind: kind.to_owned(),
            name: None,
            weight: None,
            parameters: serde_yaml::Value::Null,
            fallback: None,
        }
    }

    pub fn weighted(kind: &str, weight: f64) -> PluginSpec {
        PluginSpec {
            weight: Some(weight),
            ..PluginSpec::of(kind)
        }
    }

    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.kind)
    }

    /// Sets parameter `key` to `value` (a mapping is made when there are no parameters).
    fn set_parameter(&mut self, key: &str, value: serde_yaml::Value) {
        if !self.parameters.is_mapping() {
            self.parameters = serde_yaml::Value::Mapping(serde_yaml::Mapping::new());
        }
        if let serde_yaml::Value::Mapping(map) = &mut self.parameters {
            map.insert(serde_yaml::Value::String(key.to_owned()), value);
        }
    }
}

/// The filters and scorers that decide.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    #[serde(default)]
    pub filters: Vec<PluginSpec>,
    #[serde(default)]
    pub scorers: Vec<PluginSpec>,
}

impl Default for Profile {
    /// Saturation and adapter-slot filters; precise KV affinity (approximate prefix tree as its
    /// fallback), LoRA adapter affinity, and
    /// for a prompt neither finds the smallest cache footprint, weighed against queue,
    /// in-flight and KV-utilization load.
    fn default() -> Self {
        Profile {
            filters: vec![
                PluginSpec::of("saturation"),
                PluginSpec::of("adapter_slots"),
            ],
            scorers: vec![
                PluginSpec {
                    fallback: Some(Box::new(PluginSpec::of("prefix_tree"))),
                    ..PluginSpec::weighted("kv_cache", 2.0)
                },
                PluginSpec::weighted("adapter_affinity", 1.0),
                PluginSpec::weighted("cache_footprint", 2.0),
                PluginSpec::weighted("queue", 1.0),
                PluginSpec::weighted("in_flight", 1.0),
                PluginSpec::weighted("kv_utilization", 1.0),
            ],
        }
    }
}

/// The `scheduler:` section of the file, and the resolved scheduler configuration.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    pub profile: Profile,
    /// Weights by plugin name, over the profile's.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub weights: BTreeMap<String, f64>,
    /// Load spread (requests in flight + waiting) from which affinity scorers are skipped.
    pub imbalance_threshold: f64,
    /// How many next-best replicas follow the pick in the destination list.
    pub fallbacks: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            profile: Profile::default(),
            weights: BTreeMap::new(),
            imbalance_threshold: 16.0,
            fallbacks: 2,
        }
    }
}

impl SchedulerConfig {
    /// The default profile without its cache scorers (affinity and placement): load only.
    pub fn load_only() -> SchedulerConfig {
        let mut config = SchedulerConfig::default();
        config.profile.scorers.retain(|s| {
            !matches!(
                s.kind.as_str(),
                "kv_cache" | "prefix_tree" | "cache_footprint" | "adapter_affinity"
            )
        });
        config
    }

    /// Applies `weights` to the profile and drops the scorers whose weight is 0.
    pub fn effective_profile(&self) -> Result<Profile, ProfileError> {
        let mut profile = self.profile.clone();
        for (name, weight) in &self.weights {
            let scorer = profile
                .scorers
                .iter_mut()
                .find(|s| s.name() == name)
                .ok_or_else(|| ProfileError::UnknownWeight {
                    name: name.clone(),
                    known: profile_names(&self.profile),
                })?;
            scorer.weight = Some(*weight);
        }
        profile.scorers.retain(|s| s.weight != Some(0.0));
        Ok(profile)
    }

    /// Sets parameter `key` on every plugin of type `kind` (fallbacks included).
    fn set_parameter(&mut self, kind: &str, key: &str, value: serde_yaml::Value) {
        let Profile { filters, scorers } = &mut self.profile;
        for spec in filters.iter_mut().chain(scorers.iter_mut()) {
            set_in_chain(spec, kind, key, &value);
        }
    }

    /// Flags over the file's section.
    pub fn apply(&mut self, args: &SchedulerArgs) -> Result<(), ProfileError> {
        for (name, weight) in [
            ("queue", args.weight_queue),
            ("in_flight", args.weight_in_flight),
            ("kv_utilization", args.weight_kv_utilization),
            ("kv_cache", args.weight_prefix),
        ] {
            if let Some(weight) = weight {
                self.weights.insert(name.to_owned(), weight);
            }
        }
        for spec in &args.weights {
            let (name, weight) = spec
                .split_once('=')
                .and_then(|(n, w)| Some((n.trim(), w.trim().parse::<f64>().ok()?)))
                .ok_or_else(|| ProfileError::WeightFlag(spec.clone()))?;
            self.weights.insert(name.to_owned(), weight);
        }
        let number = |v: f64| serde_yaml::Value::Number(serde_yaml::Number::from(v));
        for (key, value) in [
            ("max_waiting", args.max_waiting.map(number)),
            ("max_kv_cache_usage", args.max_kv_cache_usage.map(number)),
            (
                "max_in_flight",
                args.max_in_flight
                    .map(|n| serde_yaml::Value::Number(n.into())),
            ),
        ] {
            if let Some(value) = value {
                self.set_parameter("saturation", key, value);
            }
        }
        if let Some(blocks) = args.min_prefix_blocks {
            self.set_parameter(
                "kv_cache",
                "min_blocks",
                serde_yaml::Value::Number(blocks.into()),
            );
        }
        if let Some(ttl) = args.speculative_ttl {
            self.set_parameter(
                "kv_cache",
                "speculative_ttl",
                serde_yaml::Value::String(format!("{}ms", ttl.as_millis())),
            );
        }
        if let Some(threshold) = args.imbalance_threshold {
            self.imbalance_threshold = threshold;
        }
        if let Some(fallbacks) = args.fallbacks {
            self.fallbacks = fallbacks;
        }
        Ok(())
    }
}

fn set_in_chain(spec: &mut PluginSpec, kind: &str, key: &str, value: &serde_yaml::Value) {
    if spec.kind == kind {
        spec.set_parameter(key, value.clone());
    }
    if let Some(fallback) = spec.fallback.as_deref_mut() {
        set_in_chain(fallback, kind, key, value);
    }
}

fn profile_names(profile: &Profile) -> String {
    let names: Vec<&str> = profile.scorers.iter().map(PluginSpec::name).collect();
    names.join(", ")
}

/// The scheduler's flags (each also an `LLMGW_*` environment variable); they override the
/// file's `scheduler:` section.
#[derive(Debug, Clone, Default, Args)]
pub struct SchedulerArgs {
    /// Weight of the queue-length scorer (`queue`; 0 turns it off).
    #[arg(long, env = "LLMGW_WEIGHT_QUEUE")]
    pub weight_queue: Option<f64>,
    /// Weight of the in-flight scorer (`in_flight`; 0 turns it off).
    #[arg(long, env = "LLMGW_WEIGHT_IN_FLIGHT")]
    pub weight_in_flight: Option<f64>,
    /// Weight of the free-KV-cache scorer (`kv_utilization`; 0 turns it off).
    #[arg(long, env = "LLMGW_WEIGHT_KV_UTILIZATION")]
    pub weight_kv_utilization: Option<f64>,
    /// Weight of prefix affinity (the `kv_cache` scorer and its `prefix_tree` fallback; 0 turns
    /// both off).
    #[arg(long, env = "LLMGW_WEIGHT_PREFIX")]
    pub weight_prefix: Option<f64>,
    /// Weight of any scorer of the profile by name, repeatable: NAME=WEIGHT.
    #[arg(long = "weight", env = "LLMGW_WEIGHTS", value_delimiter = ',')]
    pub weights: Vec<String>,
    /// `saturation` filter: vllm:num_requests_waiting at or above this saturates (default 128).
    #[arg(long, env = "LLMGW_MAX_WAITING")]
    pub max_waiting: Option<f64>,
    /// `saturation` filter: vllm:kv_cache_usage_perc at or above this saturates (default 0.99).
    #[arg(long, env = "LLMGW_MAX_KV_CACHE_USAGE")]
    pub max_kv_cache_usage: Option<f64>,
    /// `saturation` filter: llmgw's own in-flight count at or above this saturates (0 = no
    /// limit; the default).
    #[arg(long, env = "LLMGW_MAX_IN_FLIGHT")]
    pub max_in_flight: Option<u32>,
    /// Load spread (requests in flight + waiting) from which affinity scorers are skipped
    /// (default 16).
    #[arg(long, env = "LLMGW_IMBALANCE_THRESHOLD")]
    pub imbalance_threshold: Option<f64>,
    /// Next-best replicas after the pick in the destination list (default 2). Use 0 with
    /// ORIGINAL_DST clusters, which take a single address.
    #[arg(long, env = "LLMGW_FALLBACKS")]
    pub fallbacks: Option<usize>,
    /// `kv_cache` scorer: leading blocks a replica must hold before its cache counts (default 1).
    #[arg(long, env = "LLMGW_MIN_PREFIX_BLOCKS")]
    pub min_prefix_blocks: Option<u32>,
    /// `kv_cache` scorer: how long a pick credits the chosen replica with the prompt's blocks
    /// (default 2s; 0 off).
    #[arg(long, env = "LLMGW_SPECULATIVE_TTL", value_parser = crate::duration::parse)]
    pub speculative_ttl: Option<Duration>,
}

/// Why a profile cannot be built. Each names the key at fault.
#[derive(Debug, Error)]
pub enum ProfileError {
    #[error("{at}: unknown {role} type {kind:?} (known: {known})")]
    UnknownType {
        at: String,
        role: &'static str,
        kind: String,
        known: String,
    },
    #[error("{at} ({kind}) parameters: {source}")]
    Parameters {
        at: String,
        kind: String,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("{at} ({kind}): {message}")]
    Invalid {
        at: String,
        kind: String,
        message: String,
    },
    #[error("{at}: weight must be a finite number >= 0, got {weight}")]
    Weight { at: String, weight: f64 },
    #[error("{at}: filters take no {key}")]
    FilterKey { at: String, key: &'static str },
    #[error("{at}: a fallback cannot have a fallback")]
    NestedFallback { at: String },
    #[error("{at}: the name {name:?} is used twice; give one a different `name`")]
    DuplicateName { at: String, name: String },
    #[error("scheduler.weights: no scorer named {name:?} in the profile (it has: {known})")]
    UnknownWeight { name: String, known: String },
    #[error("--weight {0:?}: expected NAME=WEIGHT")]
    WeightFlag(String),
    #[error("scheduler.imbalance_threshold must be > 0, got {0}")]
    ImbalanceThreshold(f64),
}
