use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::adapters::ModelCard;
use super::monitor::{
    ProbeError, ProbeSettings, Prober, SLOW_PROBES_TO_UNHEALTHY, run_health_checks,
    run_model_listings, run_scrapes,
};
use super::*;

fn spec(port: u16, models: &[&str]) -> ReplicaSpec {
    ReplicaSpec {
        address: SocketAddr::from(([127, 0, 0, 1], port)),
        models: models.iter().map(|m| m.to_string()).collect(),
        node: None,
    }
}

#[test]
fn same_address_specs_merge_models() {
    let pool = Pool::new(
        vec![spec(1, &["base"]), spec(2, &["base"]), spec(1, &["lora-a"])],
        Duration::from_secs(2),
    );
    let snapshot = pool.snapshot();
    assert_eq!(snapshot.replicas().len(), 2);
    assert_eq!(snapshot.serving("base").len(), 2);
    let lora: Vec<_> = snapshot
        .serving("lora-a")
        .iter()
        .map(|r| r.endpoint())
        .collect();
    assert_eq!(lora, vec!["127.0.0.1:1"]);
    assert!(snapshot.serving("other").is_empty());
}

#[test]
fn in_flight_guard_counts_until_dropped() {
    let replica = Arc::new(Replica::new(spec(1, &["m"])));
    let first = replica.start_request();
    let second = replica.start_request();
    assert_eq!(replica.in_flight(), 2);
    drop(first);
    assert_eq!(replica.in_flight(), 1);
    drop(second);
    assert_eq!(replica.in_flight(), 0);
}

#[test]
fn reload_keeps_state_of_unchanged_replicas() {
    let pool = Pool::new(
        vec![spec(1, &["m"]), spec(2, &["m"])],
        Duration::from_secs(2),
    );
    let kept = Arc::clone(&pool.snapshot().replicas()[0]);
    kept.set_health(Health::Healthy);
    let _guard = kept.start_request();
    assert!(!pool.set_replicas(vec![spec(1, &["m"]), spec(2, &["m"])]));
    assert!(pool.set_replicas(vec![spec(1, &["m"]), spec(3, &["m"])]));
    let snapshot = pool.snapshot();
    assert!(Arc::ptr_eq(&snapshot.replicas()[0], &kept));
    assert_eq!(snapshot.replicas()[0].in_flight(), 1);
    assert_eq!(snapshot.replicas()[1].health(), Health::Unknown);
    assert!(snapshot.find("127.0.0.1:2").is_none());
}

#[tokio::test(start_paused = true)]
async fn scrape_goes_stale_and_reads_as_unknown() {
    let replica = Replica::new(spec(1, &["m"]));
    let staleness = Duration::from_secs(2);
    assert_eq!(replica.engine_load(Instant::now(), staleness), None);
    let load = EngineLoad {
        waiting: Some(1.0),
        running: Some(2.0),
        kv_cache_usage: Some(0.5),
    };
    replica.record_scrape(load, Instant::now());
    tokio::time::advance(Duration::from_millis(1999)).await;
    assert_eq!(replica.engine_load(Instant::now(), staleness), Some(load));
    tokio::time::advance(Duration::from_millis(2)).await;
    assert_eq!(replica.engine_load(Instant::now(), staleness), None);
}

#[tokio::test(start_paused = true)]
async fn waiting_estimate_counts_what_started_and_ended_since_the_scrape() {
    let replica = Arc::new(Replica::new(spec(1, &["m"])));
    let staleness = Duration::from_secs(2);
    let before = replica.start_request();
    let running = replica.start_request();
    assert_eq!(replica.waiting_estimate(Instant::now(), staleness), None);
    let load = |waiting| EngineLoad {
        waiting: Some(waiting),
        running: Some(2.0),
        kv_cache_usage: None,
    };
    replica.record_scrape(load(3.0), Instant::now());
    // Requests counted by the scrape do not count again.
    assert_eq!(
        replica.waiting_estimate(Instant::now(), staleness),
        Some(3.0)
    );
    let burst: Vec<_> = (0..4).map(|_| replica.start_request()).collect();
    assert_eq!(
        replica.waiting_estimate(Instant::now(), staleness),
        Some(7.0)
    );
    drop(before);
    drop(running);
    assert_eq!(
        replica.waiting_estimate(Instant::now(), staleness),
        Some(5.0)
    );
    // A fresh scrape replaces the estimate with the engine's own count.
    replica.record_scrape(load(1.0), Instant::now());
    assert_eq!(
        replica.waiting_estimate(Instant::now(), staleness),
        Some(1.0)
    );
    drop(burst);
    assert_eq!(
        replica.waiting_estimate(Instant::now(), staleness),
        Some(0.0)
    );
    tokio::time::advance(Duration::from_millis(2001)).await;
    assert_eq!(replica.waiting_estimate(Instant::now(), staleness), None);
}

/// A prober whose answers the test sets: replicas in `down` fail, others succeed.
#[derive(Default)]
struct FakeProber {
    down: Mutex<HashSet<String>>,
    hang: Mutex<HashSet<String>>,
    /// Where `/v1/models` says adapter `m-lora` was loaded from (none listed when empty).
    adapter_path: Mutex<String>,
}

impl FakeProber {
    async fn answer(&self, replica: &Replica) -> Result<(), ProbeError> {
        if self.hang.lock().contains(replica.endpoint()) {
            std::future::pending::<()>().await;
        }
        if self.down.lock().contains(replica.endpoint()) {
            Err(ProbeError::Status(503))
        } else {
            Ok(())
        }
    }
}

impl Prober for FakeProber {
    async fn health(&self, replica: &Replica) -> Result<(), ProbeError> {
        self.answer(replica).await
    }

    async fn metrics(&self, replica: &Replica) -> Result<String, ProbeError> {
        self.answer(replica).await?;
        Ok(concat!(
            "vllm:num_requests_waiting 4\nvllm:kv_cache_usage_perc 0.1\n",
            "vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"m-lora\",",
            "waiting_lora_adapters=\"\"} 1.7e9\n",
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"160\"} 1.0\n"
        )
        .to_string())
    }

    async fn models(&self, replica: &Replica) -> Result<Vec<ModelCard>, ProbeError> {
        self.answer(replica).await?;
        let mut cards = vec![ModelCard {
            id: "m".into(),
            root: Some("m".into()),
            parent: None,
        }];
        let path = self.adapter_path.lock().clone();
        if !path.is_empty() {
            cards.push(ModelCard {
                id: "m-lora".into(),
                root: Some(path),
                parent: Some("m".into()),
            });
        }
        Ok(cards)
    }
}

fn settings() -> ProbeSettings {
    ProbeSettings {
        health_interval: Duration::from_secs(1),
        scrape_interval: Duration::from_millis(100),
        timeout: Duration::from_millis(300),
        ..ProbeSettings::default()
    }
}

#[tokio::test(start_paused = true)]
async fn failed_health_checks_remove_and_restore_a_replica() {
    let pool = Arc::new(Pool::new(
        vec![spec(1, &["m"]), spec(2, &["m"])],
        Duration::from_secs(2),
    ));
    let prober = Arc::new(FakeProber::default());
    let mut changes = pool.health_changes();
    let task = tokio::spawn(run_health_checks(
        Arc::clone(&pool),
        Arc::clone(&prober),
        settings(),
    ));
    let snapshot = pool.snapshot();
    let (one, two) = (&snapshot.replicas()[0], &snapshot.replicas()[1]);

    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        (one.health(), two.health()),
        (Health::Healthy, Health::Healthy)
    );
    assert!(changes.has_changed().unwrap(), "first probes announced");
    changes.mark_unchanged();

    // A round in which nothing flips announces nothing.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!changes.has_changed().unwrap());

    prober.down.lock().insert("127.0.0.1:2".to_string());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        (one.health(), two.health()),
        (Health::Healthy, Health::Unhealthy)
    );
    assert!(changes.has_changed().unwrap(), "a flip is announced");

    // A probe that never answers times out; a replica busy enough to answer late stays a
    // candidate until SLOW_PROBES_TO_UNHEALTHY probes in a row timed out.
    prober.down.lock().clear();
    prober.hang.lock().insert("127.0.0.1:1".to_string());
    tokio::time::sleep(Duration::from_millis(1400)).await;
    assert_eq!(
        (one.health(), two.health()),
        (Health::Healthy, Health::Healthy)
    );
    tokio::time::sleep(Duration::from_secs(u64::from(SLOW_PROBES_TO_UNHEALTHY) - 1)).await;
    assert_eq!(one.health(), Health::Unhealthy);
    // An answer ends the streak: the next late one counts from one again.
    prober.hang.lock().clear();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(one.health(), Health::Healthy);
    prober.hang.lock().insert("127.0.0.1:1".to_string());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        one.health(),
        Health::Healthy,
        "one late answer after a good one"
    );

    prober.hang.lock().clear();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        (one.health(), two.health()),
        (Health::Healthy, Health::Healthy)
    );
    task.abort();
}

#[test]
fn a_changed_replica_set_is_announced_an_unchanged_one_is_not() {
    let pool = Pool::new(vec![spec(1, &["m"])], Duration::from_secs(2));
    let mut changes = pool.health_changes();
    assert!(!pool.set_replicas(vec![spec(1, &["m"])]));
    assert!(!changes.has_changed().unwrap());
    assert!(pool.set_replicas(vec![spec(1, &["m"]), spec(2, &["m"])]));
    assert!(changes.has_changed().unwrap());
    changes.mark_unchanged();
    pool.announce_health_change();
    assert!(changes.has_changed().unwrap());
}

/// The load is forgotten with a failed scrape; the cache size, set when the engine started,
/// is kept.
#[tokio::test(start_paused = true)]
async fn failed_scrape_forgets_load_at_once() {
    let pool = Arc::new(Pool::new(vec![spec(1, &["m"])], Duration::from_secs(2)));
    let prober = Arc::new(FakeProber::default());
    let task = tokio::spawn(run_scrapes(
        Arc::clone(&pool),
        Arc::clone(&prober),
        settings(),
    ));
    let replica = Arc::clone(&pool.snapshot().replicas()[0]);
    let staleness = pool.metrics_staleness();

    tokio::time::sleep(Duration::from_millis(10)).await;
    let load = replica.engine_load(Instant::now(), staleness).unwrap();
    assert_eq!(load.waiting, Some(4.0));
    assert_eq!(load.running, None);
    assert_eq!(load.kv_cache_usage, Some(0.1));
    let slots = replica.adapter_slots(Instant::now(), staleness).unwrap();
    assert!(slots.is_running("m-lora") && !slots.has_free_slot());
    assert_eq!(replica.cache_blocks(), Some(160));

    prober.down.lock().insert("127.0.0.1:1".to_string());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(replica.engine_load(Instant::now(), staleness), None);
    assert_eq!(replica.adapter_slots(Instant::now(), staleness), None);
    assert_eq!(replica.cache_blocks(), Some(160));
    task.abort();
}

#[tokio::test(start_paused = true)]
async fn adapter_listings_follow_the_replica_and_survive_a_failed_ask() {
    let pool = Arc::new(Pool::new(vec![spec(1, &["m"])], Duration::from_secs(2)));
    let prober = Arc::new(FakeProber::default());
    *prober.adapter_path.lock() = "/adapters/one".into();
    let settings = ProbeSettings {
        models_interval: Duration::from_secs(10),
        ..settings()
    };
    let task = tokio::spawn(run_model_listings(
        Arc::clone(&pool),
        Arc::clone(&prober),
        settings,
    ));
    let replica = Arc::clone(&pool.snapshot().replicas()[0]);
    let path = |r: &Replica| {
        r.adapters()
            .and_then(|c| c.get("m-lora").map(|a| a.path.clone()))
    };
    assert_eq!(path(&replica), None, "nothing before the first answer");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(path(&replica).as_deref(), Some("/adapters/one"));
    assert_eq!(
        replica.adapters().unwrap().get("m").map(|a| a.base.clone()),
        None
    );

    // A failed ask keeps the last listing; the next good one replaces it.
    prober.down.lock().insert("127.0.0.1:1".to_string());
    *prober.adapter_path.lock() = "/adapters/two".into();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(path(&replica).as_deref(), Some("/adapters/one"));
    prober.down.lock().clear();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(path(&replica).as_deref(), Some("/adapters/two"));
    task.abort();
}

/// A replica's `/metrics` is read up to [`MAX_METRICS_BODY`]: a longer answer is an error, by
/// its length header or as it streams, and a normal one is read whole.
#[tokio::test]
async fn a_metrics_answer_over_the_cap_is_an_error_not_read() {
    use super::monitor::{HttpProber, MAX_METRICS_BODY};
    use axum::response::IntoResponse;

    async fn answer(kind: &'static str) -> axum::response::Response {
        let text = "vllm:num_requests_waiting 3\n";
        match kind {
            "small" => text.into_response(),
            "declared" => vec![b'#'; MAX_METRICS_BODY + 1].into_response(),
            _ => {
                let chunks = (0..=MAX_METRICS_BODY >> 20)
                    .map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'#'; 1 << 20])));
                axum::body::Body::from_stream(futures::stream::iter(chunks)).into_response()
            }
        }
    }
    let prober = HttpProber::new(Duration::from_secs(10)).expect("prober");
    for kind in ["small", "declared", "streamed"] {
        let app = axum::Router::new().route("/metrics", axum::routing::get(move || answer(kind)));
        let addr = crate::testing::serve_on_loopback(app).await;
        let replica = Replica::new(ReplicaSpec {
            address: addr,
            models: vec!["m".to_owned()],
            node: None,
        });
        let result = prober.metrics(&replica).await;
        match kind {
            "small" => assert_eq!(result.expect("read"), "vllm:num_requests_waiting 3\n"),
            _ => {
                let err = result.expect_err(kind);
                assert!(err.to_string().contains("is over"), "{kind}: {err}");
            }
        }
    }
}
