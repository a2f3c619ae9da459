//! `session_affinity`: keeps a client's session on the replica its previous request went to,
//! for clients that name their session (a header, or a cookie). The replica a session was last
//! sent to scores 1, every other 0; weighed like any scorer, so load and the imbalance guard can
//! still move a session, which then sticks to its new replica. A request without a session
//! abstains.
//!
//! Parameters: `header` (default `x-session-id`), `cookie` (a cookie name to read instead of a
//! header), `max_sessions` (sessions remembered, least recently used forgotten first; default
//! 100,000), `max_key_bytes` (a longer key is refused with 400, logged and counted; default
//! 256).
//!
//! Metrics: `llmgw_session_affinity_total{outcome}`: `sticky` (sent where it went last), `moved`
//! (sent elsewhere), `new`, and `too_long`.
//!
//! Concurrency: one mutex around the LRU, held for one lookup or insert.

use std::num::NonZeroUsize;
use std::sync::Arc;

use lru::LruCache;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Deserialize;

use crate::scheduler::Candidate;
use crate::scheduler::plugin::{Answer, Category, Pick, Role, Scorer, Scores, Scoring, ScoringContext};
use crate::scheduler::registry::{BuildContext, PluginError, ScorerPlugin, parameters};

pub(super) static PLUGIN: ScorerPlugin = ScorerPlugin {
    kind: "session_affinity",
    build,
};

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Parameters {
    header: String,
    cookie: Option<String>,
    max_sessions: NonZeroUsize,
    max_key_bytes: usize,
}

impl Default for Parameters {
    fn default() -> Self {
        Parameters {
            header: "x-session-id".to_owned(),
            cookie: None,
            max_sessions: NonZeroUsize::new(100_000).unwrap_or(NonZeroUsize::MIN),
            max_key_bytes: 256,
        }
    }
}

fn build(context: &mut BuildContext<'_>, value: serde_yaml::Value) -> Result<Arc<dyn Scorer>, PluginError> {
    let parameters: Parameters = parameters(value)?;
    let source = match parameters.cookie {
        Some(cookie) if !cookie.is_empty() => Source::Cookie(cookie),
        Some(_) => return Err(PluginError::Invalid("cookie must not be empty".to_owned())),
        None if parameters.header.is_empty() => {
            return Err(PluginError::Invalid("header must not be empty".to_owned()));
        }
        None => Source::Header(parameters.header.to_ascii_lowercase()),
    };
    Ok(Arc::new(SessionAffinity {
        source,
        max_key_bytes: parameters.max_key_bytes,
        last: Mutex::new(LruCache::new(parameters.max_sessions)),
        metrics: context.shared(SessionMetrics::register),
    }))
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Debug, Default)]
struct SessionMetrics {
    outcomes: Family<OutcomeLabels, Counter>,
}

impl SessionMetrics {
    fn register(registry: &mut Registry) -> SessionMetrics {
        let metrics = SessionMetrics::default();
        registry.register(
            "llmgw_session_affinity",
            "Requests with a session key: sticky, moved, new, or too_long (refused with 400)",
            metrics.outcomes.clone(),
        );
        metrics
    }

    fn count(&self, outcome: &'static str) {
        self.outcomes.get_or_create(&OutcomeLabels { outcome }).inc();
    }
}

#[derive(Debug)]
enum Source {
    Header(String),
    Cookie(String),
}

struct SessionAffinity {
    source: Source,
    max_key_bytes: usize,
    /// Session key (hashed) → the endpoint its last request was sent to.
    last: Mutex<LruCache<u64, Arc<str>>>,
    metrics: Arc<SessionMetrics>,
}

impl SessionAffinity {
    /// The request's session key, hashed; `None` without one or when it is too long.
    fn key(&self, context: &ScoringContext<'_>) -> Option<u64> {
        let key = match &self.source {
            Source::Header(name) => context.header(name)?,
            Source::Cookie(name) => cookie(context.header("cookie")?, name)?,
        };
        if key.is_empty() {
            return None;
        }
        if key.len() > self.max_key_bytes {
            return None;
        }
        Some(xxhash_rust::xxh3::xxh3_64(key.as_bytes()))
    }

    /// Where the key comes from, as a client would name it.
    fn source_name(&self) -> String {
        match &self.source {
            Source::Header(name) => format!("session header {name}"),
            Source::Cookie(name) => format!("session cookie {name}"),
        }
    }
}

/// The value of cookie `name` in a `Cookie:` header (`a=1; b=2`).
fn cookie<'h>(header: &'h str, name: &str) -> Option<&'h str> {
    header.split(';').find_map(|pair| {
        let (key, value) = pair.trim().split_once('=')?;
        (key == name).then_some(value.trim_matches('"'))
    })
}

impl Scorer for SessionAffinity {
    fn category(&self) -> Category {
        Category::Affinity
    }

    /// A key over `max_key_bytes` is the client's mistake: 400, logged and counted.
    fn check(&self, context: &ScoringContext<'_>) -> Result<(), String> {
        let key = match &self.source {
            Source::Header(name) => context.header(name),
            Source::Cookie(name) => context.header("cookie").and_then(|c| cookie(c, name)),
        };
        let Some(key) = key.filter(|k| k.len() > self.max_key_bytes) else {
            return Ok(());
        };
        let source = self.source_name();
        tracing::warn!(%source, bytes = key.len(), limit = self.max_key_bytes, "session key too long; refused");
        self.metrics.count("too_long");
        Err(format!(
            "the {source} is {} bytes; the limit is {}",
            key.len(),
            self.max_key_bytes
        ))
    }

    fn score<'a>(&'a self, context: &'a ScoringContext<'a>, candidates: &'a [Candidate]) -> Scoring<'a> {
        let Some(key) = self.key(context) else {
            return Scoring::Ready(Answer::Abstain("no_session"));
        };
        let last = self.last.lock().get(&key).cloned();
        let scores = candidates
            .iter()
            .map(|c| match &last {
                Some(endpoint) if **endpoint == *c.replica.endpoint() => 1.0,
                _ => 0.0,
            })
            .collect();
        Scoring::Ready(Answer::Scored(Scores::with_memo(scores, key)))
    }

    fn after_pick(&self, context: &ScoringContext<'_>, pick: Pick<'_>, role: Role<'_>) {
        let key = match role {
            Role::Counted(scores) | Role::NotCounted { scores: Some(scores), .. } => {
                scores.memo::<u64>().copied()
            }
            // Skipped by the imbalance guard: the session still moves to where it went.
            Role::NotAsked => self.key(context),
            Role::NotCounted { scores: None, .. } => None,
        };
        let Some(key) = key else {
            return;
        };
        let chosen: Arc<str> = Arc::from(pick.chosen().replica.endpoint());
        let previous = self.last.lock().put(key, Arc::clone(&chosen));
        self.metrics.count(match previous {
            None => "new",
            Some(previous) if previous == chosen => "sticky",
            Some(_) => "moved",
        });
    }

    fn request_headers(&self) -> Vec<String> {
        match &self.source {
            Source::Header(name) => vec![name.clone()],
            Source::Cookie(_) => vec!["cookie".to_owned()],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::cookie;

    #[test]
    fn cookies_are_found_by_name() {
        assert_eq!(cookie("a=1; session=abc; b=2", "session"), Some("abc"));
        assert_eq!(cookie("session=\"q\"", "session"), Some("q"));
        assert_eq!(cookie("sessions=x", "session"), None);
        assert_eq!(cookie("", "session"), None);
    }
}
