use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::Mutex;

use super::*;
use crate::openai::{EndpointKind, Prompt, PromptText, RequestInput};
use crate::pool::{Health, ReplicaSpec};

fn spec(port: u16, model: &str) -> ReplicaSpec {
    ReplicaSpec {
        address: SocketAddr::from(([127, 0, 0, 1], port)),
        models: vec![model.to_string()],
        node: None,
    }
}

/// A pool of healthy replicas on ports `1..=n` serving "m".
fn healthy_pool(n: u16) -> Arc<Pool> {
    let pool = Arc::new(Pool::new(
        (1..=n).map(|p| spec(p, "m")).collect(),
        Duration::from_secs(2),
    ));
    for r in pool.snapshot().replicas() {
        r.set_health(Health::Healthy);
    }
    pool
}

fn replica(pool: &Pool, port: u16) -> Arc<Replica> {
    Arc::clone(pool.snapshot().find(&format!("127.0.0.1:{port}")).unwrap())
}

fn request(model: &str) -> ParsedRequest {
    ParsedRequest {
        kind: EndpointKind::Completions,
        model: model.to_string(),
        input: RequestInput::Completion(Prompt::Text(PromptText::new("hi"))),
        cache_salt: None,
        stream: false,
    }
}

fn load(waiting: f64, kv: f64) -> EngineLoad {
    EngineLoad {
        waiting: Some(waiting),
        running: Some(0.0),
        kv_cache_usage: Some(kv),
    }
}

#[tokio::test]
async fn filters_map_to_their_errors() {
    let pool = healthy_pool(2);
    let scheduler = Scheduler::new(Arc::clone(&pool), SchedulerSettings::default());
    assert_eq!(
        scheduler
            .decide(&request("other"), Scope::default())
            .await
            .unwrap_err(),
        DecideError::UnknownModel("other".to_string())
    );
    let subset = ["127.0.0.1:9".to_string()];
    assert_eq!(
        scheduler
            .decide(
                &request("m"),
                Scope {
                    subset: Some(&subset)
                }
            )
            .await
            .unwrap_err(),
        DecideError::EmptySubset
    );
    for port in [1, 2] {
        replica(&pool, port).record_scrape(load(500.0, 0.1), Instant::now());
    }
    assert_eq!(
        scheduler
            .decide(&request("m"), Scope::default())
            .await
            .unwrap_err(),
        DecideError::AllSaturated
    );
    for port in [1, 2] {
        replica(&pool, port).set_health(Health::Unhealthy);
    }
    assert_eq!(
        scheduler
            .decide(&request("m"), Scope::default())
            .await
            .unwrap_err(),
        DecideError::NoReadyReplica
    );
    assert_eq!(
        scheduler.decide_any(Scope::default()).unwrap_err(),
        DecideError::NoReadyReplica
    );
}

#[tokio::test]
async fn picks_the_least_loaded_and_orders_fallbacks() {
    let pool = healthy_pool(3);
    let now = Instant::now();
    replica(&pool, 1).record_scrape(load(6.0, 0.9), now);
    replica(&pool, 2).record_scrape(load(0.0, 0.1), now);
    replica(&pool, 3).record_scrape(load(3.0, 0.5), now);
    let scheduler = Scheduler::new(Arc::clone(&pool), SchedulerSettings::default());
    let decision = scheduler
        .decide(&request("m"), Scope::default())
        .await
        .unwrap();
    assert_eq!(decision.primary().endpoint(), "127.0.0.1:2");
    assert_eq!(
        decision.destination(),
        "127.0.0.1:2,127.0.0.1:3,127.0.0.1:1"
    );
    assert_eq!(replica(&pool, 2).in_flight(), 1);
    drop(decision);
    assert_eq!(replica(&pool, 2).in_flight(), 0);
}

#[tokio::test]
async fn subset_hint_restricts_candidates() {
    let pool = healthy_pool(3);
    replica(&pool, 3).record_scrape(load(50.0, 0.9), Instant::now());
    let scheduler = Scheduler::new(Arc::clone(&pool), SchedulerSettings::default());
    let subset = ["127.0.0.1:3".to_string()];
    let decision = scheduler
        .decide(
            &request("m"),
            Scope {
                subset: Some(&subset),
            },
        )
        .await
        .unwrap();
    assert_eq!(decision.destination(), "127.0.0.1:3");
}

#[tokio::test]
async fn in_flight_spreads_concurrent_requests() {
    let pool = healthy_pool(2);
    let scheduler = Scheduler::new(Arc::clone(&pool), SchedulerSettings::default());
    let first = scheduler
        .decide(&request("m"), Scope::default())
        .await
        .unwrap();
    let second = scheduler
        .decide(&request("m"), Scope::default())
        .await
        .unwrap();
    assert_ne!(first.primary().endpoint(), second.primary().endpoint());
}

fn prompt(model: &str, text: &str) -> ParsedRequest {
    ParsedRequest {
        input: RequestInput::Completion(Prompt::Text(PromptText::new(text))),
        ..request(model)
    }
}

#[tokio::test]
async fn equal_scores_break_ties_by_request_so_routers_agree() {
    // Two routers: separate pools and schedulers over the same replicas.
    let (pool_a, pool_b) = (healthy_pool(3), healthy_pool(3));
    let a = Scheduler::new(Arc::clone(&pool_a), SchedulerSettings::default());
    let b = Scheduler::new(Arc::clone(&pool_b), SchedulerSettings::default());
    let mut seen = std::collections::HashSet::new();
    for i in 0..64 {
        let request = prompt("m", &format!("conversation {i}"));
        let from_a = a.decide(&request, Scope::default()).await.unwrap();
        let from_b = b.decide(&request, Scope::default()).await.unwrap();
        assert_eq!(from_a.destination(), from_b.destination(), "request {i}");
        let picked = from_a.primary().endpoint().to_string();
        drop((from_a, from_b));
        // The same request again, with the same (idle) state: the same pick.
        let again = a.decide(&request, Scope::default()).await.unwrap();
        assert_eq!(again.primary().endpoint(), picked, "request {i} again");
        seen.insert(picked);
    }
    // Different requests still spread over equally good replicas.
    assert_eq!(seen.len(), 3, "{seen:?}");
    // The salt is part of the request's identity.
    let mut salted = prompt("m", "conversation 0");
    let mut picks = std::collections::HashSet::new();
    for i in 0..16 {
        salted.cache_salt = Some(format!("tenant {i}"));
        let decision = a.decide(&salted, Scope::default()).await.unwrap();
        picks.insert(decision.primary().endpoint().to_string());
    }
    assert!(picks.len() > 1, "salts never moved the pick: {picks:?}");
}

#[tokio::test(start_paused = true)]
async fn stale_scrape_is_unknown_not_idle() {
    let pool = healthy_pool(2);
    // Replica 1 looked idle long ago; replica 2 is busy-ish but known now.
    replica(&pool, 1).record_scrape(load(0.0, 0.0), Instant::now());
    tokio::time::advance(Duration::from_secs(3)).await;
    replica(&pool, 2).record_scrape(load(2.0, 0.3), Instant::now());
    let settings = SchedulerSettings {
        weights: ScorerWeights {
            in_flight: 0.0,
            ..ScorerWeights::default()
        },
        ..SchedulerSettings::default()
    };
    let scheduler = Scheduler::new(Arc::clone(&pool), settings);
    let decision = scheduler
        .decide(&request("m"), Scope::default())
        .await
        .unwrap();
    assert_eq!(decision.primary().endpoint(), "127.0.0.1:2");
}

/// Prefers one endpoint with score 1, others 0; records what `after_pick` saw.
struct FixedPrefix {
    preferred: String,
    picked: Mutex<Vec<(String, Option<u64>)>>,
}

impl PrefixScorer for FixedPrefix {
    fn name(&self) -> &'static str {
        "fixed"
    }

    fn score<'a>(
        &'a self,
        _request: &'a ParsedRequest,
        candidates: &'a [Candidate],
    ) -> BoxFuture<'a, Result<PrefixScores, PrefixUnavailable>> {
        Box::pin(async move {
            tokio::task::yield_now().await;
            Ok(PrefixScores {
                per_candidate: candidates
                    .iter()
                    .map(|c| {
                        if c.replica.endpoint() == self.preferred {
                            1.0
                        } else {
                            0.0
                        }
                    })
                    .collect(),
                memo: Some(Box::new(42u64)),
            })
        })
    }

    fn after_pick(&self, _request: &ParsedRequest, chosen: &Candidate, scores: &PrefixScores) {
        let memo = scores
            .memo
            .as_ref()
            .and_then(|m| m.downcast_ref::<u64>())
            .copied();
        self.picked
            .lock()
            .push((chosen.replica.endpoint().to_string(), memo));
    }
}

#[tokio::test]
async fn prefix_slot_steers_and_hears_the_pick() {
    let pool = healthy_pool(2);
    let prefix = Arc::new(FixedPrefix {
        preferred: "127.0.0.1:2".to_string(),
        picked: Mutex::new(Vec::new()),
    });
    struct Shared(Arc<FixedPrefix>);
    impl PrefixScorer for Shared {
        fn name(&self) -> &'static str {
            self.0.name()
        }
        fn score<'a>(
            &'a self,
            request: &'a ParsedRequest,
            candidates: &'a [Candidate],
        ) -> BoxFuture<'a, Result<PrefixScores, PrefixUnavailable>> {
            self.0.score(request, candidates)
        }
        fn after_pick(&self, request: &ParsedRequest, chosen: &Candidate, scores: &PrefixScores) {
            self.0.after_pick(request, chosen, scores)
        }
    }
    let settings = SchedulerSettings {
        imbalance_threshold: 4.0,
        ..SchedulerSettings::default()
    };
    let scheduler = Scheduler::new(Arc::clone(&pool), settings)
        .with_prefix_scorer(Box::new(Shared(Arc::clone(&prefix))));

    // Balanced: affinity wins even with one request already in flight there.
    let _held = replica(&pool, 2).start_request();
    let decision = scheduler
        .decide(&request("m"), Scope::default())
        .await
        .unwrap();
    assert_eq!(decision.primary().endpoint(), "127.0.0.1:2");
    assert!(!decision.imbalance_guard_fired);
    assert_eq!(
        prefix.picked.lock().as_slice(),
        &[("127.0.0.1:2".to_string(), Some(42))]
    );
    drop(decision);

    // Lopsided: load outvotes affinity and the prefix scorer is not consulted.
    let _more: Vec<_> = (0..4).map(|_| replica(&pool, 2).start_request()).collect();
    let decision = scheduler
        .decide(&request("m"), Scope::default())
        .await
        .unwrap();
    assert_eq!(decision.primary().endpoint(), "127.0.0.1:1");
    assert!(decision.imbalance_guard_fired);
    assert_eq!(prefix.picked.lock().len(), 1);
}

#[test]
fn rank_orders_by_score_descending() {
    let order = rank(&[0.2, 0.9, 0.5], &mut rand::rng());
    assert_eq!(order, vec![1, 2, 0]);
}
