//! Flow control's objectives from the pool's `InferenceObjective` resources
//! (`inference.networking.x-k8s.io/v1alpha2`): each one in the pool's namespace whose
//! `spec.poolRef` names the pool gives its `metadata.name` the `spec.priority` (0 when absent).
//! The set is handed to [`Objectives::set_from_cluster`] after every change; the file's
//! objectives win on a shared name.
//!
//! An objective whose spec cannot be read (a priority that is not an integer, or one outside
//! a 32-bit integer) is logged once per version and counted in
//! `llmgw_discovery_problems_total{source="inference_objective", problem="invalid_objective"}`,
//! and keeps its last good priority if it had one. A failing API keeps the last set.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde::Deserialize;

use super::{DiscoveryMetrics, Failing, PoolRef, Problem, SourceKind, store_changed};
use crate::flowcontrol::{Objective, Objectives};

/// The InferencePool API group, the one `poolRef.group` must name when it names one.
const POOL_GROUP: &str = "inference.networking.k8s.io";

/// An InferenceObjective as the API serves it; the spec stays JSON until [`parse_spec`], so
/// that a malformed one is this module's clear error rather than a watch that cannot decode.
#[derive(Debug, Clone, Deserialize)]
pub struct InferenceObjective {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: serde_json::Value,
}

impl kube::Resource for InferenceObjective {
    type DynamicType = ();
    type Scope = kube::core::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "InferenceObjective".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "inference.networking.x-k8s.io".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1alpha2".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "inferenceobjectives".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSpec {
    #[serde(default)]
    priority: Option<serde_json::Value>,
    #[serde(default)]
    pool_ref: Option<RawPoolRef>,
}

#[derive(Deserialize)]
struct RawPoolRef {
    #[serde(default)]
    name: String,
    #[serde(default)]
    group: Option<String>,
}

/// What a spec says for `pool`: `Ok(None)` when it is another pool's, `Ok(Some(priority))`
/// when it is this pool's, `Err` when it cannot be read.
pub fn parse_spec(spec: &serde_json::Value, pool: &str) -> Result<Option<i32>, String> {
    let raw: RawSpec =
        serde_json::from_value(spec.clone()).map_err(|e| format!("unreadable spec: {e}"))?;
    let Some(pool_ref) = raw.pool_ref else {
        return Err("spec.poolRef is missing".to_owned());
    };
    let other_group = pool_ref
        .group
        .as_deref()
        .is_some_and(|g| !g.is_empty() && g != POOL_GROUP);
    if pool_ref.name != pool || other_group {
        return Ok(None);
    }
    match raw.priority {
        None | Some(serde_json::Value::Null) => Ok(Some(0)),
        Some(serde_json::Value::Number(n)) => n
            .as_i64()
            .and_then(|p| i32::try_from(p).ok())
            .map(Some)
            .ok_or_else(|| format!("spec.priority {n} is not a 32-bit integer")),
        Some(other) => Err(format!("spec.priority {other} is not an integer")),
    }
}

/// Watches the InferenceObjectives of `pool`'s namespace, keeping `objectives` current. Runs
/// until dropped.
pub async fn run(
    client: kube::Client,
    pool: PoolRef,
    objectives: Arc<Objectives>,
    metrics: DiscoveryMetrics,
) {
    let api: Api<InferenceObjective> = Api::namespaced(client, &pool.namespace);
    let (store, writer) = reflector::store();
    let mut events = watcher(api, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .boxed();
    let mut failing = Failing::new(
        SourceKind::inference_objective,
        format!("{pool} InferenceObjectives"),
    );
    let mut last_good: BTreeMap<String, i32> = BTreeMap::new();
    // (name, resourceVersion) of the invalid specs already logged.
    let mut logged: HashSet<(String, String)> = HashSet::new();
    while let Some(event) = events.next().await {
        if !store_changed(event, &mut failing, &metrics) {
            continue;
        }
        let mut current = BTreeMap::new();
        for object in store.state() {
            let name = object.metadata.name.clone().unwrap_or_default();
            match parse_spec(&object.spec, &pool.name) {
                Ok(None) => {}
                Ok(Some(priority)) => {
                    current.insert(name, priority);
                }
                Err(problem) => {
                    let version = object.metadata.resource_version.clone();
                    if logged.insert((name.clone(), version.unwrap_or_default())) {
                        metrics.count(SourceKind::inference_objective, Problem::invalid_objective);
                        tracing::warn!(%pool, objective = %name, %problem, "cannot use the InferenceObjective; keeping its last priority");
                    }
                    if let Some(&priority) = last_good.get(&name) {
                        current.insert(name, priority);
                    }
                }
            }
        }
        if current != last_good {
            tracing::info!(%pool, objectives = ?current, "inference objectives from the cluster");
        }
        objectives.set_from_cluster(
            current
                .iter()
                .map(|(name, &priority)| {
                    (
                        name.clone(),
                        Objective {
                            priority,
                            queue_timeout: None,
                        },
                    )
                })
                .collect(),
        );
        last_good = current;
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::discovery::fake_api::FakeApi;
    use crate::flowcontrol::ObjectiveSpec;
    use crate::testing::wait_until;

    const OBJECTIVES: &str =
        "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/llm/inferenceobjectives";

    fn objective(name: &str, pool: &str, priority: Value) -> Value {
        json!({
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": name, "namespace": "llm"},
            "spec": {"priority": priority, "poolRef": {"name": pool, "group": POOL_GROUP}},
        })
    }

    #[test]
    fn a_spec_is_read_for_its_pool_or_refused_with_a_reason() {
        let spec = |value: Value| parse_spec(&value, "chat");
        assert_eq!(
            spec(json!({"priority": 7, "poolRef": {"name": "chat"}})),
            Ok(Some(7))
        );
        assert_eq!(spec(json!({"poolRef": {"name": "chat"}})), Ok(Some(0)));
        assert_eq!(
            spec(json!({"priority": -1, "poolRef": {"name": "other"}})),
            Ok(None)
        );
        assert_eq!(
            spec(json!({"priority": 1, "poolRef": {"name": "chat", "group": "llm-d.ai"}})),
            Ok(None)
        );
        for bad in [
            json!({"priority": "high", "poolRef": {"name": "chat"}}),
            json!({"priority": 1.5, "poolRef": {"name": "chat"}}),
            json!({"priority": 4_294_967_296_i64, "poolRef": {"name": "chat"}}),
            json!({"priority": 1}),
            json!({"priority": 1, "poolRef": "chat"}),
        ] {
            assert!(spec(bad.clone()).is_err(), "{bad} was accepted");
        }
    }

    #[tokio::test]
    async fn the_pool_s_objectives_follow_the_cluster_and_a_bad_one_keeps_its_last_priority() {
        let (api, addr) = FakeApi::start().await;
        api.apply(OBJECTIVES, objective("interactive", "chat", json!(10)));
        api.apply(OBJECTIVES, objective("batch", "chat", json!(-1)));
        api.apply(OBJECTIVES, objective("elsewhere", "other", json!(5)));
        let objectives = Arc::new(Objectives::new(&[ObjectiveSpec {
            name: "pinned".into(),
            priority: 100,
            queue_timeout: None,
        }]));
        let metrics = DiscoveryMetrics::default();
        let task = tokio::spawn(run(
            FakeApi::client(addr),
            PoolRef {
                namespace: "llm".into(),
                name: "chat".into(),
            },
            Arc::clone(&objectives),
            metrics.clone(),
        ));
        let priorities = || {
            let set = objectives.current();
            set.names()
                .map(|n| (n.to_owned(), set.get(n).map(|o| o.priority)))
                .collect::<Vec<_>>()
        };
        let wanted = |pairs: &[(&str, i32)]| {
            pairs
                .iter()
                .map(|(n, p)| (n.to_string(), Some(*p)))
                .collect::<Vec<_>>()
        };
        wait_until(|| {
            priorities() == wanted(&[("batch", -1), ("interactive", 10), ("pinned", 100)])
        })
        .await;
        // A malformed priority: logged, counted, the last good one kept.
        api.apply(OBJECTIVES, objective("batch", "chat", json!("lowest")));
        wait_until(|| {
            metrics.count_of(SourceKind::inference_objective, Problem::invalid_objective) == 1
        })
        .await;
        assert_eq!(
            priorities(),
            wanted(&[("batch", -1), ("interactive", 10), ("pinned", 100)])
        );
        // Changed, deleted, and one naming the file's objective (the file wins).
        api.apply(OBJECTIVES, objective("batch", "chat", json!(-5)));
        api.delete(OBJECTIVES, "interactive");
        api.apply(OBJECTIVES, objective("pinned", "chat", json!(1)));
        wait_until(|| priorities() == wanted(&[("batch", -5), ("pinned", 100)])).await;
        // The API fails: the last set stays.
        api.set_broken(true);
        api.drop_watches();
        wait_until(|| metrics.count_of(SourceKind::inference_objective, Problem::api) > 0).await;
        assert_eq!(priorities(), wanted(&[("batch", -5), ("pinned", 100)]));
        task.abort();
    }
}
