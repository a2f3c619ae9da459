//! Flow control against a real pool and scheduler capacity, on a paused clock.

use std::net::SocketAddr;
use std::time::Duration;

use prometheus_client::registry::Registry;

use super::*;
use crate::pool::{Health, InFlightGuard, Pool, ReplicaSpec};
use crate::scheduler::{PluginResources, Scheduler, SchedulerArgs, SchedulerConfig};

const TICK: Duration = Duration::from_millis(50);

/// Two healthy replicas of "m", each saturated at one request in flight.
fn pool() -> Arc<Pool> {
    let specs = (1..=2)
        .map(|port| ReplicaSpec {
            address: SocketAddr::from(([127, 0, 0, 1], port)),
            models: vec!["m".to_owned()],
            node: None,
        })
        .collect();
    let pool = Arc::new(Pool::new(specs, Duration::from_secs(2)));
    for replica in pool.snapshot().replicas() {
        replica.set_health(Health::Healthy);
    }
    pool
}

fn capacity(pool: &Arc<Pool>) -> Capacity {
    let mut config = SchedulerConfig::load_only();
    config
        .apply(&SchedulerArgs {
            max_in_flight: Some(1),
            ..SchedulerArgs::default()
        })
        .expect("flags apply");
    Scheduler::build(
        Arc::clone(pool),
        &config,
        &PluginResources::standalone(),
        &mut Registry::default(),
    )
    .expect("profile builds")
    .capacity()
}

fn objective(name: &str, priority: i32, queue_timeout: Option<Duration>) -> ObjectiveSpec {
    ObjectiveSpec {
        name: name.to_owned(),
        priority,
        queue_timeout,
    }
}

/// Flow control over [`pool`] with objectives `high` (10), `batch` (-1) and `quick` (0,
/// 100ms), its dispatcher running.
fn flow_control(pool: &Arc<Pool>, max_queued: usize) -> Arc<FlowControl> {
    let settings = FlowSettings {
        max_queued,
        queue_timeout: Duration::from_secs(10),
        objectives: vec![
            objective("high", 10, None),
            objective("batch", -1, None),
            objective("quick", 0, Some(Duration::from_millis(100))),
        ],
        ..FlowSettings::default()
    };
    let objectives = Arc::new(Objectives::new(&settings.objectives));
    let flow = Arc::new(FlowControl::new(
        settings,
        objectives,
        capacity(pool),
        FlowMetrics::unregistered("pool"),
    ));
    tokio::spawn(Arc::clone(&flow).run(TICK));
    flow
}

fn headers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

fn ask(flow: &FlowControl, pairs: &[(&str, &str)]) -> Ask {
    flow.classify("m", "m", &headers(pairs))
        .expect("valid headers")
}

/// Occupies every replica of the pool.
fn saturate(pool: &Pool) -> Vec<InFlightGuard> {
    pool.snapshot()
        .replicas()
        .iter()
        .map(|r| r.start_request())
        .collect()
}

/// Spawns an admission that, once dispatched, reports `label` and holds a replica (as a
/// decision would) until the test drops what it sent.
fn queue(
    flow: &Arc<FlowControl>,
    pool: &Arc<Pool>,
    pairs: &[(&str, &str)],
    label: &'static str,
    done: tokio::sync::mpsc::UnboundedSender<(&'static str, Result<InFlightGuard, FlowError>)>,
) -> tokio::task::JoinHandle<()> {
    let ask = ask(flow, pairs);
    let (flow, pool) = (Arc::clone(flow), Arc::clone(pool));
    tokio::spawn(async move {
        let result = flow.admit(&ask).await.map(|admission| {
            let replica = pool
                .snapshot()
                .replicas()
                .iter()
                .min_by_key(|r| r.in_flight())
                .cloned()
                .expect("a replica");
            let guard = replica.start_request();
            drop(admission);
            guard
        });
        let _ = done.send((label, result));
    })
}

/// Lets every task run that can, with the clock paused.
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn capacity_admits_at_once_and_saturation_queues() {
    let pool = pool();
    let flow = flow_control(&pool, 16);
    let first = flow.admit(&ask(&flow, &[])).await.expect("capacity");
    let second = flow.admit(&ask(&flow, &[])).await.expect("capacity");
    // Two admissions deciding take both replicas' headroom until they end.
    let (done, mut results) = tokio::sync::mpsc::unbounded_channel();
    queue(&flow, &pool, &[], "third", done.clone());
    settle().await;
    assert_eq!(flow.queued("m"), 1);
    drop(first);
    let (label, third) = results.recv().await.expect("dispatched");
    assert_eq!(label, "third");
    assert!(third.is_ok());
    assert_eq!(flow.metrics().count(FlowOutcome::Admitted, 0), 2);
    assert_eq!(flow.metrics().count(FlowOutcome::Dispatched, 0), 1);
    drop(second);
}

#[tokio::test(start_paused = true)]
async fn priorities_go_first_and_tenants_take_turns() {
    let pool = pool();
    let flow = flow_control(&pool, 64);
    let mut busy = saturate(&pool);
    let (done, mut results) = tokio::sync::mpsc::unbounded_channel();
    // In arrival order: a sheddable one, a noisy tenant's three, a quiet one's, a high one.
    let order: [(&[(&str, &str)], &'static str); 6] = [
        (&[("x-gateway-inference-objective", "batch")], "batch"),
        (&[("x-gateway-inference-fairness-id", "noisy")], "noisy-1"),
        (&[("x-gateway-inference-fairness-id", "noisy")], "noisy-2"),
        (&[("x-gateway-inference-fairness-id", "noisy")], "noisy-3"),
        (&[("x-llm-d-inference-fairness-id", "quiet")], "quiet"),
        (&[("x-llm-d-inference-objective", "high")], "high"),
    ];
    for (pairs, label) in order {
        queue(&flow, &pool, pairs, label, done.clone());
        settle().await;
    }
    assert_eq!(flow.queued("m"), 6);
    // Free one slot at a time; each dispatched request takes it again, so the order shows.
    let mut served = Vec::new();
    for _ in 0..6 {
        busy.pop();
        flow.request_finished();
        let (label, guard) = results.recv().await.expect("one dispatched");
        served.push(label);
        busy.push(guard.expect("dispatched"));
    }
    assert_eq!(
        served,
        ["high", "noisy-1", "quiet", "noisy-2", "noisy-3", "batch"]
    );
}

#[tokio::test(start_paused = true)]
async fn the_deadline_answers_429_or_503_when_nothing_is_ready() {
    let pool = pool();
    let flow = flow_control(&pool, 16);
    let _busy = saturate(&pool);
    let quick = ask(&flow, &[("x-gateway-inference-objective", "quick")]);
    let started = Instant::now();
    let error = flow
        .admit(&quick)
        .await
        .expect_err("no capacity comes back");
    assert_eq!(started.elapsed(), Duration::from_millis(100));
    assert!(matches!(error, FlowError::Expired { .. }), "{error:?}");
    // The request's own header shortens the wait; a zero timeout does not wait at all.
    let own = ask(&flow, &[(QUEUE_TIMEOUT_HEADER, "20ms")]);
    let started = Instant::now();
    assert!(flow.admit(&own).await.is_err());
    assert_eq!(started.elapsed(), Duration::from_millis(20));
    let none = ask(&flow, &[(QUEUE_TIMEOUT_HEADER, "0s")]);
    let started = Instant::now();
    assert!(matches!(
        flow.admit(&none).await,
        Err(FlowError::Expired { .. })
    ));
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!(flow.queued("m"), 0);
    assert_eq!(flow.metrics().count(FlowOutcome::Expired, 0), 3);

    // The replicas fail while a request waits: it ends with 503's error.
    let waiting = ask(&flow, &[(QUEUE_TIMEOUT_HEADER, "1s")]);
    let pending = {
        let flow = Arc::clone(&flow);
        tokio::spawn(async move { flow.admit(&waiting).await })
    };
    settle().await;
    for replica in pool.snapshot().replicas() {
        replica.set_health(Health::Unhealthy);
    }
    let error = pending.await.expect("joins").expect_err("none ready");
    assert!(
        matches!(error, FlowError::ExpiredNoneReady { .. }),
        "{error:?}"
    );
    // Nothing ready at arrival: answered at once, as a decision would be.
    assert_eq!(
        flow.admit(&ask(&flow, &[])).await.expect_err("none ready"),
        FlowError::Decide(DecideError::NoReadyReplica)
    );
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_displaces_sheddable_requests_first() {
    let pool = pool();
    let flow = flow_control(&pool, 2);
    let _busy = saturate(&pool);
    let (done, mut results) = tokio::sync::mpsc::unbounded_channel();
    queue(
        &flow,
        &pool,
        &[("x-gateway-inference-objective", "batch")],
        "batch",
        done.clone(),
    );
    queue(&flow, &pool, &[], "normal", done.clone());
    settle().await;
    // Full: the lowest priority is refused, a higher one displaces it.
    let batch = ask(&flow, &[("x-gateway-inference-objective", "batch")]);
    let refused = flow.admit(&batch).await.expect_err("full");
    assert!(
        matches!(refused, FlowError::QueueFull { max_queued: 2, .. }),
        "{refused:?}"
    );
    queue(
        &flow,
        &pool,
        &[("x-gateway-inference-objective", "high")],
        "high",
        done.clone(),
    );
    let (label, result) = results.recv().await.expect("an answer");
    assert_eq!(label, "batch");
    assert!(
        matches!(result, Err(FlowError::Displaced { .. })),
        "{result:?}"
    );
    assert_eq!(flow.queued("m"), 2);
    // Now the lowest waiting is of the default priority: another one is refused.
    assert!(matches!(
        flow.admit(&ask(&flow, &[])).await,
        Err(FlowError::QueueFull { .. })
    ));
    assert_eq!(flow.metrics().count(FlowOutcome::Displaced, -1), 1);
    assert_eq!(flow.metrics().count(FlowOutcome::QueueFull, -1), 1);
    assert_eq!(flow.metrics().count(FlowOutcome::QueueFull, 0), 1);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_leaves_the_queue() {
    let pool = pool();
    let flow = flow_control(&pool, 16);
    let busy = saturate(&pool);
    let (done, mut results) = tokio::sync::mpsc::unbounded_channel();
    let gone = queue(&flow, &pool, &[], "gone", done.clone());
    queue(&flow, &pool, &[], "stays", done.clone());
    settle().await;
    gone.abort();
    settle().await;
    assert_eq!(flow.queued("m"), 1);
    assert_eq!(flow.metrics().count(FlowOutcome::Cancelled, 0), 1);
    drop(busy);
    flow.request_finished();
    let (label, result) = results.recv().await.expect("dispatched");
    assert_eq!(label, "stays");
    assert!(result.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_lost_race_waits_again_first_in_line() {
    let pool = pool();
    let flow = flow_control(&pool, 16);
    let mut busy = saturate(&pool);
    let (admitted_tx, admitted) = tokio::sync::oneshot::channel();
    let (taken_tx, taken) = tokio::sync::oneshot::channel::<()>();
    let first = ask(&flow, &[]);
    let raced = {
        let (flow, pool) = (Arc::clone(&flow), Arc::clone(&pool));
        tokio::spawn(async move {
            let admission = flow.admit(&first).await.expect("dispatched");
            let _ = admitted_tx.send(());
            // Meanwhile a concurrent decision took the replica: the decision fails.
            let _ = taken.await;
            let again = flow.readmit(&first, admission).await?;
            // This time the decision holds the freed replica.
            let free = pool
                .snapshot()
                .replicas()
                .iter()
                .find(|r| r.in_flight() == 0)
                .cloned();
            let guard = free.expect("a free replica").start_request();
            drop(again);
            Ok::<_, FlowError>(guard)
        })
    };
    settle().await;
    let (done, mut results) = tokio::sync::mpsc::unbounded_channel();
    queue(&flow, &pool, &[], "second", done.clone());
    settle().await;
    busy.pop();
    flow.request_finished();
    admitted.await.expect("the first was dispatched");
    let free = pool
        .snapshot()
        .replicas()
        .iter()
        .find(|r| r.in_flight() == 0)
        .cloned()
        .expect("the freed replica");
    let thief = free.start_request();
    let _ = taken_tx.send(());
    settle().await;
    assert_eq!(flow.queued("m"), 2, "both wait again");
    drop(thief);
    flow.request_finished();
    let _first = raced.await.expect("joins").expect("dispatched again");
    settle().await;
    assert!(results.try_recv().is_err(), "the second still waits");
    busy.clear();
    flow.request_finished();
    let (label, result) = results.recv().await.expect("dispatched too");
    assert_eq!(label, "second");
    assert!(result.is_ok());
}

#[test]
fn malformed_headers_and_unknown_objectives_are_refused_and_counted() {
    let pool = pool();
    let settings = FlowSettings {
        objectives: vec![objective("chat", 5, None)],
        ..FlowSettings::default()
    };
    let flow = FlowControl::new(
        settings.clone(),
        Arc::new(Objectives::new(&settings.objectives)),
        capacity(&pool),
        FlowMetrics::unregistered(""),
    );
    let classify = |pairs: &[(&str, &str)]| flow.classify("m", "m", &headers(pairs));
    assert_eq!(
        classify(&[("x-gateway-inference-objective", "nope")]).unwrap_err(),
        FlowError::UnknownObjective {
            name: "nope".into(),
            known: "chat".into()
        }
    );
    let long = "t".repeat(MAX_FAIRNESS_ID_BYTES + 1);
    assert!(matches!(
        classify(&[("x-gateway-inference-fairness-id", &long)]),
        Err(FlowError::BadHeader { .. })
    ));
    for bad in ["soon", "-5s", "", "5 s"] {
        let error = classify(&[(QUEUE_TIMEOUT_HEADER, bad)]).unwrap_err();
        assert!(
            matches!(&error, FlowError::BadHeader { header, .. } if *header == QUEUE_TIMEOUT_HEADER),
            "{bad}: {error:?}"
        );
    }
    assert!(
        classify(&[(QUEUE_TIMEOUT_HEADER, "-5s")])
            .unwrap_err()
            .to_string()
            .contains("already have passed")
    );
    assert_eq!(flow.metrics().bad_requests("unknown_objective"), 1);
    assert_eq!(flow.metrics().bad_requests("fairness_id"), 1);
    assert_eq!(flow.metrics().bad_requests("queue_timeout"), 5);
    let chat = classify(&[
        ("x-gateway-inference-objective", "chat"),
        (QUEUE_TIMEOUT_HEADER, "90s"),
    ])
    .expect("valid");
    assert_eq!(chat.flow.priority, 5);
    // A request cannot wait longer than the configuration allows.
    assert_eq!(chat.flow.timeout, settings.queue_timeout);
}
