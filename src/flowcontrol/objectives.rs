//! Inference objectives: the names a client puts in `x-gateway-inference-objective` (or
//! llm-d's `x-llm-d-inference-objective`), each with a priority and optionally its own queue
//! timeout. They come from the configuration file and, with the Kubernetes source on, from the
//! pool's `InferenceObjective` resources ([`crate::discovery::inference_objective`]); a name in
//! both takes the file's.
//!
//! # Concurrency model
//! An immutable [`ObjectiveSet`] behind an [`ArcSwap`]: requests read it without locks, the
//! Kubernetes watcher swaps in a new one on every change.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use serde::Deserialize;

/// One objective as the file gives it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectiveSpec {
    pub name: String,
    /// Higher is dispatched first; below 0 is sheddable (the first to be displaced).
    #[serde(default)]
    pub priority: i32,
    /// How long its requests may wait for capacity (default: the flow control's).
    #[serde(default, deserialize_with = "crate::duration::optional")]
    pub queue_timeout: Option<Duration>,
}

/// What an objective name stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Objective {
    pub priority: i32,
    pub queue_timeout: Option<Duration>,
}

/// The objectives known now, by name.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ObjectiveSet {
    by_name: BTreeMap<String, Objective>,
}

impl ObjectiveSet {
    pub fn get(&self, name: &str) -> Option<Objective> {
        self.by_name.get(name).copied()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }
}

/// The file's objectives and the cluster's, merged.
#[derive(Debug)]
pub struct Objectives {
    file: BTreeMap<String, Objective>,
    current: ArcSwap<ObjectiveSet>,
}

impl Objectives {
    pub fn new(specs: &[ObjectiveSpec]) -> Objectives {
        let file: BTreeMap<String, Objective> = specs
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    Objective {
                        priority: s.priority,
                        queue_timeout: s.queue_timeout,
                    },
                )
            })
            .collect();
        let current = ArcSwap::from_pointee(ObjectiveSet {
            by_name: file.clone(),
        });
        Objectives { file, current }
    }

    /// The objectives now (lock-free).
    pub fn current(&self) -> Arc<ObjectiveSet> {
        self.current.load_full()
    }

    /// Replaces the cluster's objectives; the file's win on a shared name.
    pub fn set_from_cluster(&self, cluster: BTreeMap<String, Objective>) {
        let mut by_name = cluster;
        by_name.extend(self.file.iter().map(|(k, v)| (k.clone(), *v)));
        self.current.store(Arc::new(ObjectiveSet { by_name }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_wins_over_the_cluster() {
        let objectives = Objectives::new(&[ObjectiveSpec {
            name: "chat".into(),
            priority: 10,
            queue_timeout: None,
        }]);
        let cluster = |priority| Objective {
            priority,
            queue_timeout: None,
        };
        objectives.set_from_cluster(BTreeMap::from([
            ("chat".to_owned(), cluster(1)),
            ("batch".to_owned(), cluster(-1)),
        ]));
        let now = objectives.current();
        assert_eq!(now.get("chat").map(|o| o.priority), Some(10));
        assert_eq!(now.get("batch").map(|o| o.priority), Some(-1));
        objectives.set_from_cluster(BTreeMap::new());
        assert_eq!(objectives.current().names().collect::<Vec<_>>(), ["chat"]);
    }
}
