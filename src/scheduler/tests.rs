use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::openai::{EndpointKind, Prompt, PromptText, RequestInput};
use crate::pool::{Health, ReplicaSpec};

/// A scheduler built from `config` through the registry, with no shared state.
fn build(pool: &Arc<Pool>, config: &SchedulerConfig) -> Scheduler {
    Scheduler::build(
        Arc::clone(pool),
        config,
        &PluginResources::standalone(),
        &mut Registry::default(),
    )
    .expect("profile builds")
}

/// The default profile without affinity.
fn load_only(pool: &Arc<Pool>) -> Scheduler {
    build(pool, &SchedulerConfig::load_only())
}

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
    let scheduler = load_only(&pool);
    assert_eq!(
        scheduler
            .decide(&request("other"), &[], Scope::default())
            .await
            .unwrap_err(),
        DecideError::UnknownModel("other".to_string())
    );
    let subset = ["127.0.0.1:9".to_string()];
    assert_eq!(
        scheduler
            .decide(
                &request("m"),
                &[],
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
            .decide(&request("m"), &[], Scope::default())
            .await
            .unwrap_err(),
        DecideError::AllSaturated
    );
    for port in [1, 2] {
        replica(&pool, port).set_health(Health::Unhealthy);
    }
    assert_eq!(
        scheduler
            .decide(&request("m"), &[], Scope::default())
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
    let scheduler = load_only(&pool);
    let decision = scheduler
        .decide(&request("m"), &[], Scope::default())
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
    let scheduler = load_only(&pool);
    let subset = ["127.0.0.1:3".to_string()];
    let decision = scheduler
        .decide(
            &request("m"),
            &[],
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
    let scheduler = load_only(&pool);
    let first = scheduler
        .decide(&request("m"), &[], Scope::default())
        .await
        .unwrap();
    let second = scheduler
        .decide(&request("m"), &[], Scope::default())
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
    let a = load_only(&pool_a);
    let b = load_only(&pool_b);
    let mut seen = std::collections::HashSet::new();
    for i in 0..64 {
        let request = prompt("m", &format!("conversation {i}"));
        let from_a = a.decide(&request, &[], Scope::default()).await.unwrap();
        let from_b = b.decide(&request, &[], Scope::default()).await.unwrap();
        assert_eq!(from_a.destination(), from_b.destination(), "request {i}");
        let picked = from_a.primary().endpoint().to_string();
        drop((from_a, from_b));
        // The same request again, with the same (idle) state: the same pick.
        let again = a.decide(&request, &[], Scope::default()).await.unwrap();
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
        let decision = a.decide(&salted, &[], Scope::default()).await.unwrap();
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
    let mut config = SchedulerConfig::load_only();
    config.weights.insert("in_flight".to_owned(), 0.0);
    let scheduler = build(&pool, &config);
    let decision = scheduler
        .decide(&request("m"), &[], Scope::default())
        .await
        .unwrap();
    assert_eq!(decision.primary().endpoint(), "127.0.0.1:2");
}

/// What a test scorer heard after a pick: the chosen endpoint and its role.
#[derive(Debug, Clone, PartialEq)]
enum Heard {
    Counted(String),
    NotCounted(String, Option<&'static str>),
    NotAsked(String),
}

/// A test scorer: answers `answer` (1 for `preferred`, else 0; or abstains), awaiting once,
/// and records what it heard after each pick.
struct Fixed {
    category: Category,
    preferred: Option<String>,
    abstain: Option<&'static str>,
    asked: AtomicUsize,
    heard: Mutex<Vec<Heard>>,
}

impl Fixed {
    fn new(preferred: Option<&str>, abstain: Option<&'static str>) -> Arc<Fixed> {
        Arc::new(Fixed {
            category: Category::Affinity,
            preferred: preferred.map(str::to_owned),
            abstain,
            asked: AtomicUsize::new(0),
            heard: Mutex::new(Vec::new()),
        })
    }

    fn preferring(endpoint: &str) -> Arc<Fixed> {
        Fixed::new(Some(endpoint), None)
    }

    fn zeros() -> Arc<Fixed> {
        Fixed::new(None, None)
    }

    fn abstaining(reason: &'static str) -> Arc<Fixed> {
        Fixed::new(None, Some(reason))
    }

    fn heard(&self) -> Vec<Heard> {
        self.heard.lock().clone()
    }
}

impl Scorer for Fixed {
    fn category(&self) -> Category {
        self.category
    }

    fn score<'a>(&'a self, _: &'a ScoringContext<'a>, candidates: &'a [Candidate]) -> Scoring<'a> {
        self.asked.fetch_add(1, Ordering::Relaxed);
        Scoring::Pending(Box::pin(async move {
            tokio::task::yield_now().await;
            if let Some(reason) = self.abstain {
                return Answer::Abstain(reason);
            }
            let scores = candidates
                .iter()
                .map(|c| {
                    f64::from(u8::from(
                        Some(c.replica.endpoint()) == self.preferred.as_deref(),
                    ))
                })
                .collect();
            Answer::Scored(Scores::with_memo(scores, 42u64))
        }))
    }

    fn after_pick(&self, _: &ScoringContext<'_>, pick: Pick<'_>, role: Role<'_>) {
        let chosen = pick.chosen().replica.endpoint().to_owned();
        self.heard.lock().push(match role {
            Role::Counted(scores) => {
                assert_eq!(scores.memo::<u64>(), Some(&42), "the memo comes back");
                Heard::Counted(chosen)
            }
            Role::NotCounted { abstained, .. } => Heard::NotCounted(chosen, abstained),
            Role::NotAsked => Heard::NotAsked(chosen),
        });
    }
}

fn with_entries(
    pool: &Arc<Pool>,
    imbalance_threshold: f64,
    scorers: Vec<ScorerEntry>,
) -> Scheduler {
    Scheduler::with_plugins(
        Arc::clone(pool),
        SchedulerOptions {
            imbalance_threshold,
            ..SchedulerOptions::default()
        },
        Vec::new(),
        scorers,
    )
}

/// One entry: `primary`, with `fallback` as its fallback.
fn with_fallback(pool: &Arc<Pool>, primary: Arc<Fixed>, fallback: Arc<Fixed>) -> Scheduler {
    with_entries(
        pool,
        16.0,
        vec![ScorerEntry::new("p", 1.0, primary as Arc<dyn Scorer>).with_fallback("f", fallback)],
    )
}

async fn pick(scheduler: &Scheduler) -> Decision {
    scheduler
        .decide(&request("m"), &[], Scope::default())
        .await
        .expect("decides")
}

#[tokio::test]
async fn an_affinity_scorer_steers_hears_the_pick_and_yields_to_imbalance() {
    let pool = healthy_pool(2);
    let affinity = Fixed::preferring("127.0.0.1:2");
    let in_flight = build(&pool, &SchedulerConfig::load_only())
        .scorers
        .into_iter()
        .find(|e| e.name == "in_flight")
        .expect("in_flight in the default profile");
    let scheduler = with_entries(
        &pool,
        4.0,
        vec![
            ScorerEntry::new("fixed", 2.0, affinity.clone() as Arc<dyn Scorer>),
            in_flight,
        ],
    );

    // Balanced: affinity wins even with one request already in flight there.
    let _held = replica(&pool, 2).start_request();
    let decision = pick(&scheduler).await;
    assert_eq!(decision.primary().endpoint(), "127.0.0.1:2");
    assert!(!decision.imbalance_guard_fired);
    assert_eq!(affinity.heard(), [Heard::Counted("127.0.0.1:2".into())]);
    drop(decision);

    // Lopsided: load outvotes affinity and the affinity scorer is not asked.
    let _more: Vec<_> = (0..4).map(|_| replica(&pool, 2).start_request()).collect();
    let decision = pick(&scheduler).await;
    assert_eq!(decision.primary().endpoint(), "127.0.0.1:1");
    assert!(decision.imbalance_guard_fired);
    assert_eq!(affinity.asked.load(Ordering::Relaxed), 1);
    assert_eq!(affinity.heard()[1], Heard::NotAsked("127.0.0.1:1".into()));
}

#[tokio::test]
async fn a_fallback_answers_when_its_primary_abstains_or_matches_nothing() {
    let pool = healthy_pool(3);
    // Abstains → the fallback decides, with the primary's weight.
    let primary = Fixed::abstaining("no_events");
    let fallback = Fixed::preferring("127.0.0.1:3");
    let scheduler = with_fallback(&pool, primary.clone(), fallback.clone());
    let decision = pick(&scheduler).await;
    assert_eq!(decision.primary().endpoint(), "127.0.0.1:3");
    assert!(!decision.prefix_unavailable);
    assert_eq!(
        primary.heard(),
        [Heard::NotCounted("127.0.0.1:3".into(), Some("no_events"))]
    );
    assert_eq!(fallback.heard(), [Heard::Counted("127.0.0.1:3".into())]);
    drop(decision);

    // Only zeros → the fallback's signal wins; the primary hears it was not counted.
    let primary = Fixed::zeros();
    let fallback = Fixed::preferring("127.0.0.1:1");
    let scheduler = with_fallback(&pool, primary.clone(), fallback.clone());
    assert_eq!(pick(&scheduler).await.primary().endpoint(), "127.0.0.1:1");
    assert_eq!(
        primary.heard(),
        [Heard::NotCounted("127.0.0.1:1".into(), None)]
    );

    // A primary with a signal: the fallback is not asked, but hears the pick.
    let primary = Fixed::preferring("127.0.0.1:2");
    let fallback = Fixed::preferring("127.0.0.1:1");
    let scheduler = with_fallback(&pool, primary.clone(), fallback.clone());
    assert_eq!(pick(&scheduler).await.primary().endpoint(), "127.0.0.1:2");
    assert_eq!(fallback.asked.load(Ordering::Relaxed), 0);
    assert_eq!(fallback.heard(), [Heard::NotAsked("127.0.0.1:2".into())]);

    // Both abstain: decided on the other scorers (none here), counted as unavailable.
    let scheduler = with_fallback(
        &pool,
        Fixed::abstaining("no_events"),
        Fixed::abstaining("x"),
    );
    assert!(pick(&scheduler).await.prefix_unavailable);
}

#[tokio::test]
async fn a_placement_scorer_decides_only_what_no_affinity_scorer_found() {
    let pool = healthy_pool(3);
    let placement = |endpoint| {
        let mut fixed = Fixed::preferring(endpoint);
        Arc::get_mut(&mut fixed).expect("unshared").category = Category::Placement;
        fixed
    };
    let entries = |affinity: &Arc<Fixed>, placement: &Arc<Fixed>| {
        vec![
            // Placement listed first: it is still asked after the affinity scorers.
            ScorerEntry::new("place", 1.0, Arc::clone(placement) as Arc<dyn Scorer>),
            ScorerEntry::new("affinity", 1.0, Arc::clone(affinity) as Arc<dyn Scorer>),
        ]
    };

    // Affinity found the prompt: placement is not asked, and hears it.
    let (affinity, place) = (Fixed::preferring("127.0.0.1:2"), placement("127.0.0.1:3"));
    let scheduler = with_entries(&pool, 16.0, entries(&affinity, &place));
    assert_eq!(pick(&scheduler).await.primary().endpoint(), "127.0.0.1:2");
    assert_eq!(place.asked.load(Ordering::Relaxed), 0);
    assert_eq!(place.heard(), [Heard::NotAsked("127.0.0.1:2".into())]);

    // Affinity found nothing (zeros, or abstained): placement decides.
    for affinity in [Fixed::zeros(), Fixed::abstaining("no_events")] {
        let place = placement("127.0.0.1:3");
        let scheduler = with_entries(&pool, 16.0, entries(&affinity, &place));
        let decision = pick(&scheduler).await;
        assert_eq!(decision.primary().endpoint(), "127.0.0.1:3");
        assert_eq!(place.heard(), [Heard::Counted("127.0.0.1:3".into())]);
    }

    // Lopsided load: neither is asked, and load decides.
    let (affinity, place) = (Fixed::zeros(), placement("127.0.0.1:3"));
    let scheduler = with_entries(&pool, 4.0, entries(&affinity, &place));
    let _held: Vec<_> = (0..4).map(|_| replica(&pool, 3).start_request()).collect();
    let decision = pick(&scheduler).await;
    assert!(decision.imbalance_guard_fired);
    assert_eq!(place.asked.load(Ordering::Relaxed), 0);
    assert_eq!(affinity.asked.load(Ordering::Relaxed), 0);

    // Without affinity scorers nothing is looked for, so nothing is new: placement is idle.
    let place = placement("127.0.0.1:1");
    let scheduler = with_entries(
        &pool,
        16.0,
        vec![ScorerEntry::new(
            "place",
            1.0,
            Arc::clone(&place) as Arc<dyn Scorer>,
        )],
    );
    pick(&scheduler).await;
    assert_eq!(place.asked.load(Ordering::Relaxed), 0);
}

/// Keeps only replica 1, as a preference.
struct PreferOne;

impl Filter for PreferOne {
    fn filter(&self, _: Option<&ParsedRequest>, candidates: &mut Vec<Candidate>) {
        candidates.retain(|c| c.replica.endpoint() == "127.0.0.1:1");
    }

    fn when_none_pass(&self) -> WhenNonePass {
        WhenNonePass::KeepAll
    }
}

#[tokio::test]
async fn a_preference_filter_that_removes_everyone_is_ignored() {
    let with_filter = |pool: &Arc<Pool>| {
        Scheduler::with_plugins(
            Arc::clone(pool),
            SchedulerOptions::default(),
            vec![(
                "prefer_one".to_owned(),
                Arc::new(PreferOne) as Arc<dyn Filter>,
            )],
            Vec::new(),
        )
    };
    let pool = healthy_pool(3);
    let named = |d: &Decision| -> Vec<String> {
        d.filtered_out
            .iter()
            .map(|o| format!("{}={}", o.filter, o.replica.endpoint()))
            .collect()
    };
    for _ in 0..4 {
        let decision = pick(&with_filter(&pool)).await;
        assert_eq!(decision.destination(), "127.0.0.1:1");
        assert_eq!(
            named(&decision),
            ["prefer_one=127.0.0.1:2", "prefer_one=127.0.0.1:3"]
        );
    }
    // Replica 1 is not ready: the filter would leave nobody, so it is ignored and takes
    // nobody out.
    replica(&pool, 1).set_health(Health::Unhealthy);
    let decision = pick(&with_filter(&pool)).await;
    assert_ne!(decision.primary().endpoint(), "127.0.0.1:1");
    assert_eq!(decision.fallbacks.len(), 1);
    assert!(decision.filtered_out.is_empty());
}

/// A filter that takes one replica out.
struct Without(&'static str);

impl Filter for Without {
    fn filter(&self, _: Option<&ParsedRequest>, candidates: &mut Vec<Candidate>) {
        candidates.retain(|c| c.replica.endpoint() != self.0);
    }

    fn when_none_pass(&self) -> WhenNonePass {
        WhenNonePass::KeepAll
    }
}

#[tokio::test]
async fn each_removed_replica_is_named_once_with_the_filter_that_removed_it() {
    let filter = |name: &str, endpoint: &'static str| {
        (
            name.to_owned(),
            Arc::new(Without(endpoint)) as Arc<dyn Filter>,
        )
    };
    let pool = healthy_pool(3);
    let scheduler = Scheduler::with_plugins(
        Arc::clone(&pool),
        SchedulerOptions::default(),
        vec![
            filter("a", "127.0.0.1:3"),
            filter("b", "127.0.0.1:2"),
            // Takes out one already gone: it names nobody.
            filter("c", "127.0.0.1:3"),
        ],
        Vec::new(),
    );
    let decision = pick(&scheduler).await;
    assert_eq!(decision.destination(), "127.0.0.1:1");
    assert_eq!(
        decision.filtered_out_trace().to_string(),
        "a=127.0.0.1:3,b=127.0.0.1:2"
    );
}

#[tokio::test]
async fn saturated_replicas_are_named_with_their_filter() {
    let pool = healthy_pool(3);
    let scheduler = load_only(&pool);
    assert!(
        pick(&scheduler).await.filtered_out.is_empty(),
        "nobody saturated"
    );
    let now = Instant::now();
    replica(&pool, 1).record_scrape(load(0.0, 0.995), now);
    replica(&pool, 3).record_scrape(load(500.0, 0.1), now);
    let decision = pick(&scheduler).await;
    assert_eq!(decision.destination(), "127.0.0.1:2");
    let out: Vec<(&str, &str)> = decision
        .filtered_out
        .iter()
        .map(|o| (&*o.filter, o.replica.endpoint()))
        .collect();
    assert_eq!(
        out,
        [("saturation", "127.0.0.1:1"), ("saturation", "127.0.0.1:3")]
    );
    assert_eq!(
        decision.filtered_out_trace().to_string(),
        "saturation=127.0.0.1:1,saturation=127.0.0.1:3"
    );
}

#[test]
fn profiles_are_built_by_name_and_errors_name_the_key() {
    let pool = healthy_pool(1);
    let attempt = |yaml: &str| {
        let config: SchedulerConfig = serde_yaml::from_str(yaml).expect("yaml");
        Scheduler::build(
            Arc::clone(&pool),
            &config,
            &PluginResources::standalone(),
            &mut Registry::default(),
        )
        .map(|s| {
            s.scorers
                .iter()
                .map(|e| (e.name.clone(), e.weight))
                .collect::<Vec<_>>()
        })
        .map_err(|e| e.to_string())
    };
    let names = |yaml: &str| attempt(yaml).expect("builds");

    // The default profile, and weights by name over it (0 drops one).
    assert_eq!(
        names("{}"),
        [
            ("kv_cache".into(), 2.0),
            ("adapter_affinity".into(), 1.0),
            ("cache_footprint".into(), 2.0),
            ("queue".into(), 1.0),
            ("in_flight".into(), 1.0),
            ("kv_utilization".into(), 1.0)
        ]
    );
    assert_eq!(
        names("weights: {queue: 3, kv_cache: 0}"),
        [
            ("adapter_affinity".into(), 1.0),
            ("cache_footprint".into(), 2.0),
            ("queue".into(), 3.0),
            ("in_flight".into(), 1.0),
            ("kv_utilization".into(), 1.0)
        ]
    );
    // A second load scorer of one type, under another name.
    assert_eq!(
        names(
            "profile:\n  scorers:\n    - {type: queue, weight: 2}\n    - {type: queue, name: queue_b, weight: 0.5}\n"
        ),
        [("queue".into(), 2.0), ("queue_b".into(), 0.5)]
    );

    for (yaml, expect) in [
        (
            "profile: {scorers: [{type: prefix}]}",
            "scheduler.profile.scorers[0]: unknown scorer type \"prefix\"",
        ),
        (
            "profile: {filters: [{type: lora}]}",
            "scheduler.profile.filters[0]: unknown filter type",
        ),
        (
            "profile: {scorers: [{type: kv_cache, parameters: {min_block: 2}}]}",
            "scheduler.profile.scorers[0] (kv_cache) parameters: unknown field `min_block`",
        ),
        (
            "profile: {scorers: [{type: kv_cache, parameters: {rebuild_cost: -1}}]}",
            "scheduler.profile.scorers[0] (kv_cache): rebuild_cost must be a number of blocks",
        ),
        (
            "profile: {scorers: [{type: kv_cache, parameters: {evicted_hold: 1.5}}]}",
            "scheduler.profile.scorers[0] (kv_cache): evicted_hold must be a share of a held block",
        ),
        (
            "profile: {scorers: [{type: kv_cache, parameters: {rebuild_cost: 2, evicted_hold: 1}}]}",
            "in opposite directions; turn one off",
        ),
        (
            "profile: {scorers: [{type: cache_footprint, parameters: {fill: 1.5}}]}",
            "scheduler.profile.scorers[0] (cache_footprint): fill must be a share of a cache",
        ),
        (
            "profile: {scorers: [{type: cache_footprint, parameters: {max_share: 0.5}}]}",
            "scheduler.profile.scorers[0] (cache_footprint): max_share must be a multiple",
        ),
        (
            "profile: {scorers: [{type: queue, parameters: {scale: 2}}]}",
            "scheduler.profile.scorers[0] (queue) parameters: unknown field `scale`",
        ),
        (
            "profile: {filters: [{type: saturation, parameters: {max_waiting: many}}]}",
            "scheduler.profile.filters[0] (saturation) parameters",
        ),
        (
            "profile: {scorers: [{type: queue, weight: -1}]}",
            "weight must be a finite number >= 0",
        ),
        (
            "profile: {filters: [{type: saturation, weight: 1}]}",
            "filters take no weight",
        ),
        (
            "profile: {scorers: [{type: queue}, {type: queue}]}",
            "the name \"queue\" is used twice",
        ),
        (
            "profile: {scorers: [{type: kv_cache, fallback: {type: prefix_tree, fallback: {type: queue}}}]}",
            "scheduler.profile.scorers[0].fallback: a fallback cannot have a fallback",
        ),
        (
            "weights: {prefix: 1}",
            "no scorer named \"prefix\" in the profile",
        ),
        ("imbalance_threshold: 0", "imbalance_threshold must be > 0"),
    ] {
        let error = attempt(yaml).expect_err(yaml);
        assert!(error.contains(expect), "{yaml}: {error}");
    }
    // The section itself refuses unknown keys.
    assert!(serde_yaml::from_str::<SchedulerConfig>("saturation: {max_waiting: 1}").is_err());
}

#[test]
fn flags_set_weights_and_parameters_by_plugin() {
    let mut config = SchedulerConfig::default();
    config
        .apply(&SchedulerArgs {
            weight_prefix: Some(3.0),
            weights: vec!["queue=0.5".to_owned()],
            max_waiting: Some(7.0),
            min_prefix_blocks: Some(4),
            speculative_ttl: Some(std::time::Duration::from_millis(1500)),
            fallbacks: Some(0),
            ..SchedulerArgs::default()
        })
        .expect("applies");
    let profile = config.effective_profile().expect("valid");
    let kv = &profile.scorers[0];
    assert_eq!((kv.kind.as_str(), kv.weight), ("kv_cache", Some(3.0)));
    assert_eq!(kv.parameters["min_blocks"], serde_yaml::Value::from(4));
    assert_eq!(
        kv.parameters["speculative_ttl"],
        serde_yaml::Value::from("1500ms")
    );
    let queue = profile.scorers.iter().find(|s| s.kind == "queue");
    assert_eq!(queue.and_then(|s| s.weight), Some(0.5));
    assert_eq!(
        profile.filters[0].parameters["max_waiting"],
        serde_yaml::Value::from(7.0)
    );
    assert_eq!(config.fallbacks, 0);
    let bad = SchedulerConfig::default().apply(&SchedulerArgs {
        weights: vec!["queue".to_owned()],
        ..SchedulerArgs::default()
    });
    assert!(bad.unwrap_err().to_string().contains("NAME=WEIGHT"));
}

#[test]
fn rank_orders_by_score_descending() {
    let order = rank(&[0.2, 0.9, 0.5], &mut rand::rng());
    assert_eq!(order, vec![1, 2, 0]);
}

#[tokio::test]
async fn capacity_counts_what_the_saturation_limits_leave() {
    let pool = healthy_pool(2);
    let mut config = SchedulerConfig::load_only();
    config
        .apply(&SchedulerArgs {
            max_in_flight: Some(3),
            max_waiting: Some(4.0),
            ..SchedulerArgs::default()
        })
        .expect("flags apply");
    let scheduler = build(&pool, &config);
    let capacity = scheduler.capacity();
    // Unknown load: only the in-flight limit applies.
    assert_eq!(capacity.headroom("m", u64::MAX), Ok(Headroom::Requests(6)));
    // Counting stops once it has enough: the first replica's 3 suffice for 2.
    assert_eq!(capacity.headroom("m", 2), Ok(Headroom::Requests(3)));
    let held = replica(&pool, 1).start_request();
    assert_eq!(capacity.headroom("m", u64::MAX), Ok(Headroom::Requests(5)));
    // Replica 2's engine reports 2 waiting: 2 more before max_waiting.
    replica(&pool, 2).record_scrape(load(2.0, 0.1), Instant::now());
    assert_eq!(capacity.headroom("m", u64::MAX), Ok(Headroom::Requests(4)));
    // What starts there before the next scrape counts as waiting at once.
    let burst = [
        replica(&pool, 2).start_request(),
        replica(&pool, 2).start_request(),
    ];
    assert_eq!(capacity.headroom("m", u64::MAX), Ok(Headroom::Requests(2)));
    assert_eq!(
        scheduler
            .decide(&request("m"), &[], Scope::default())
            .await
            .expect("replica 1 has room")
            .primary()
            .endpoint(),
        "127.0.0.1:1"
    );
    // A full KV cache leaves no room.
    replica(&pool, 1).record_scrape(load(0.0, 0.995), Instant::now());
    assert_eq!(capacity.headroom("m", u64::MAX), Ok(Headroom::Requests(0)));
    drop((held, burst));
    assert_eq!(
        capacity.headroom("other", u64::MAX),
        Err(DecideError::UnknownModel("other".into()))
    );
    for port in [1, 2] {
        replica(&pool, port).set_health(Health::Unhealthy);
    }
    assert_eq!(
        capacity.headroom("m", u64::MAX),
        Err(DecideError::NoReadyReplica)
    );
    // Without a refusing filter nothing limits.
    let free = Scheduler::with_plugins(
        healthy_pool(1),
        SchedulerOptions::default(),
        Vec::new(),
        Vec::new(),
    );
    assert_eq!(
        free.capacity().headroom("m", u64::MAX),
        Ok(Headroom::Unlimited)
    );
}

#[test]
fn a_decisions_scores_are_traced_per_candidate_by_the_scorers_that_counted() {
    let scored = |scores: &[f64]| Some(Answer::Scored(Scores::new(scores.to_vec())));
    let scorers = vec![
        ScorerEntry::new("kv_cache", 2.0, Fixed::zeros())
            .with_fallback("prefix_tree", Fixed::zeros()),
        ScorerEntry::new("cache_footprint", 2.0, Fixed::zeros()),
        ScorerEntry::new("in_flight", 1.0, Fixed::zeros()),
    ];
    let evaluated = vec![
        // The primary abstained; its fallback's answer counted, under the fallback's name.
        Evaluated {
            primary: Some(Answer::Abstain("no_events")),
            fallback: scored(&[1.0, 0.0]),
            counted: Counted::Fallback,
        },
        Evaluated::not_asked(),
        Evaluated {
            primary: scored(&[0.5, 1.0]),
            fallback: None,
            counted: Counted::Primary,
        },
    ];
    let trace = ScoresTrace {
        scorers: &scorers,
        evaluated: &evaluated,
        total: &[2.5 / 3.0, 1.0 / 3.0],
    };
    assert_eq!(
        trace.to_string(),
        "prefix_tree,in_flight|0.83/1.00/0.50|0.33/0.00/1.00"
    );
}
