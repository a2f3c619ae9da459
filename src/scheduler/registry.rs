//! The one place plugins are looked up by type name, and the context they are built in.
//!
//! Each filter lives in a file of [`super::filter`] and each scorer in a file of
//! [`super::scorer`]; a file exports a `PLUGIN` descriptor (its type name and a build
//! function), and the `plugins!` line in its folder's `mod.rs` registers it. Building a profile
//! (`build_profile`) turns each [`PluginSpec`] into a plugin, checking the type, the
//! parameters (each plugin deserializes its own settings struct with unknown keys refused) and
//! the weights, and naming the key at fault in every error.
//!
//! # Concurrency model
//! Runs once at start-up, single-threaded; what it builds is immutable afterwards, except the
//! plugins' own state.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::Arc;

use prometheus_client::registry::Registry;
use serde::de::DeserializeOwned;

use super::plugin::{Filter, Scorer};
use super::profile::{PluginSpec, Profile, ProfileError};
use super::{ScorerEntry, filter, scorer};
use crate::kvindex::KvIndex;
use crate::models::HashersByModel;
use crate::peers::PickOutbox;
use crate::tokenize::Tokenizer;

/// What plugins may share: the router's KV index, tokenizer and per-model hash settings, and
/// the outbox of picks its peer routers subscribe to.
#[derive(Clone)]
pub struct PluginResources {
    pub index: Arc<KvIndex>,
    pub tokenizer: Arc<Tokenizer>,
    pub hashers: Arc<HashersByModel>,
    pub picks: Arc<PickOutbox>,
}

impl PluginResources {
    /// Nothing shared: an empty index, a tokenizer with the default settings, no model's hash
    /// settings (so `kv_cache` abstains). For load-only schedulers, tests and benches.
    pub fn standalone() -> PluginResources {
        PluginResources {
            index: Arc::new(KvIndex::new(crate::kvindex::IndexConfig::default())),
            tokenizer: Arc::new(Tokenizer::new(crate::tokenize::TokenizerConfig::default())),
            hashers: Arc::new(HashersByModel::new()),
            picks: Arc::default(),
        }
    }
}

impl std::fmt::Debug for PluginResources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginResources")
            .field("models", &self.hashers.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// Why a plugin refused its parameters (wrapped with the key and type by the caller).
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error(transparent)]
    Parameters(#[from] serde_yaml::Error),
    #[error("{0}")]
    Invalid(String),
}

/// Handed to each plugin's build function.
pub struct BuildContext<'a> {
    pub resources: &'a PluginResources,
    registry: &'a mut Registry,
    shared: &'a mut HashMap<TypeId, Arc<dyn Any + Send + Sync>>,
}

impl BuildContext<'_> {
    /// One `T` per scheduler, made by the first plugin that asks (which registers its metrics
    /// with `make`); later plugins of the same type share it, so two instances of one type
    /// never register a metric twice.
    pub fn shared<T: Any + Send + Sync>(
        &mut self,
        make: impl FnOnce(&mut Registry) -> T,
    ) -> Arc<T> {
        let id = TypeId::of::<T>();
        if let Some(existing) = self.shared.get(&id)
            && let Ok(typed) = Arc::clone(existing).downcast::<T>()
        {
            return typed;
        }
        let made = Arc::new(make(self.registry));
        self.shared
            .insert(id, Arc::clone(&made) as Arc<dyn Any + Send + Sync>);
        made
    }
}

/// Builds a plugin from its `parameters:`.
pub type Build<T> = fn(&mut BuildContext<'_>, serde_yaml::Value) -> Result<Arc<T>, PluginError>;

/// A scorer type: its name in profiles and how to build one.
pub struct ScorerPlugin {
    pub kind: &'static str,
    pub build: Build<dyn Scorer>,
}

/// A filter type: its name in profiles and how to build one.
pub struct FilterPlugin {
    pub kind: &'static str,
    pub build: Build<dyn Filter>,
}

/// A plugin's settings from its `parameters:` (none: the defaults).
pub fn parameters<T: DeserializeOwned + Default>(
    value: serde_yaml::Value,
) -> Result<T, PluginError> {
    if value.is_null() {
        return Ok(T::default());
    }
    Ok(serde_yaml::from_value(value)?)
}

/// The registered scorer types' names, for error messages and docs.
pub fn scorer_kinds() -> impl Iterator<Item = &'static str> {
    scorer::PLUGINS.iter().map(|p| p.kind)
}

/// The registered filter types' names.
pub fn filter_kinds() -> impl Iterator<Item = &'static str> {
    filter::PLUGINS.iter().map(|p| p.kind)
}

/// A profile's plugins, built.
pub(super) struct BuiltProfile {
    pub filters: Vec<(String, Arc<dyn Filter>)>,
    pub scorers: Vec<ScorerEntry>,
}

/// Builds every plugin of `profile` (weights already applied: see
/// [`super::SchedulerConfig::effective_profile`]).
pub(super) fn build_profile(
    profile: &Profile,
    resources: &PluginResources,
    registry: &mut Registry,
) -> Result<BuiltProfile, ProfileError> {
    let mut shared = HashMap::new();
    let mut context = BuildContext {
        resources,
        registry,
        shared: &mut shared,
    };
    let mut names: Vec<String> = Vec::new();
    let mut claim = |at: &str, name: &str| {
        if names.iter().any(|n| n == name) {
            return Err(ProfileError::DuplicateName {
                at: at.to_owned(),
                name: name.to_owned(),
            });
        }
        names.push(name.to_owned());
        Ok(())
    };

    let mut filters = Vec::with_capacity(profile.filters.len());
    for (i, spec) in profile.filters.iter().enumerate() {
        let at = format!("scheduler.profile.filters[{i}]");
        if spec.weight.is_some() {
            return Err(ProfileError::FilterKey { at, key: "weight" });
        }
        if spec.fallback.is_some() {
            return Err(ProfileError::FilterKey {
                at,
                key: "fallback",
            });
        }
        claim(&at, spec.name())?;
        let plugin = filter::PLUGINS
            .iter()
            .find(|p| p.kind == spec.kind)
            .ok_or_else(|| ProfileError::UnknownType {
                at: at.clone(),
                role: "filter",
                kind: spec.kind.clone(),
                known: filter_kinds().collect::<Vec<_>>().join(", "),
            })?;
        let built = (plugin.build)(&mut context, spec.parameters.clone())
            .map_err(|e| wrap(e, &at, spec))?;
        filters.push((spec.name().to_owned(), built));
    }

    let mut scorers = Vec::with_capacity(profile.scorers.len());
    for (i, spec) in profile.scorers.iter().enumerate() {
        let at = format!("scheduler.profile.scorers[{i}]");
        let weight = spec.weight.unwrap_or(1.0);
        if !weight.is_finite() || weight < 0.0 {
            return Err(ProfileError::Weight { at, weight });
        }
        claim(&at, spec.name())?;
        let scorer = build_scorer(&mut context, spec, &at)?;
        let fallback = match spec.fallback.as_deref() {
            None => None,
            Some(fallback) => {
                let at = format!("{at}.fallback");
                if fallback.fallback.is_some() {
                    return Err(ProfileError::NestedFallback { at });
                }
                if fallback.weight.is_some() {
                    return Err(ProfileError::Invalid {
                        at,
                        kind: fallback.kind.clone(),
                        message: "a fallback takes its primary's weight; remove `weight`"
                            .to_owned(),
                    });
                }
                claim(&at, fallback.name())?;
                Some((
                    fallback.name().to_owned(),
                    build_scorer(&mut context, fallback, &at)?,
                ))
            }
        };
        scorers.push(ScorerEntry {
            name: spec.name().to_owned(),
            weight,
            scorer,
            fallback,
        });
    }
    Ok(BuiltProfile { filters, scorers })
}

fn build_scorer(
    context: &mut BuildContext<'_>,
    spec: &PluginSpec,
    at: &str,
) -> Result<Arc<dyn Scorer>, ProfileError> {
    let plugin = scorer::PLUGINS
        .iter()
        .find(|p| p.kind == spec.kind)
        .ok_or_else(|| ProfileError::UnknownType {
            at: at.to_owned(),
            role: "scorer",
            kind: spec.kind.clone(),
            known: scorer_kinds().collect::<Vec<_>>().join(", "),
        })?;
    (plugin.build)(context, spec.parameters.clone()).map_err(|e| wrap(e, at, spec))
}

fn wrap(error: PluginError, at: &str, spec: &PluginSpec) -> ProfileError {
    match error {
        PluginError::Parameters(source) => ProfileError::Parameters {
            at: at.to_owned(),
            kind: spec.kind.clone(),
            source,
        },
        PluginError::Invalid(message) => ProfileError::Invalid {
            at: at.to_owned(),
            kind: spec.kind.clone(),
            message,
        },
    }
}

/// Declares the plugin files of a folder and registers their `PLUGIN`s, one name per plugin:
/// adding a plugin is its file plus its name here.
macro_rules! plugins {
    ($descriptor:ty: $($module:ident),+ $(,)?) => {
        $(mod $module;)+
        /// Every plugin of this folder, by type name.
        pub(crate) static PLUGINS: &[&$descriptor] = &[$(&$module::PLUGIN),+];
    };
}
pub(super) use plugins;
