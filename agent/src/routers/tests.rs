//! The follower against a scripted resolver and a spawner that records what it starts, on a
//! paused clock: no DNS, no network, no real uplink.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::*;

const TARGET: &str = "routers.test:9004";
const INTERVAL: Duration = Duration::from_secs(1);

fn addr(last: u8) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, last], 9004))
}

/// What the fake resolver answers next.
#[derive(Debug, Clone)]
enum Answer {
    Found(Vec<SocketAddr>),
    Empty,
    Fails,
}

/// A resolver whose answer the test sets, recording when each lookup started.
#[derive(Clone)]
struct Scripted {
    answer: Arc<Mutex<Answer>>,
    lookups: Arc<Mutex<Vec<Instant>>>,
    /// How long the first lookup takes (a slow DNS server).
    first_takes: Duration,
}

impl Scripted {
    fn new(answer: Answer) -> Scripted {
        Scripted {
            answer: Arc::new(Mutex::new(answer)),
            lookups: Arc::new(Mutex::new(Vec::new())),
            first_takes: Duration::ZERO,
        }
    }

    fn set(&self, answer: Answer) {
        *self.answer.lock() = answer;
    }

    fn lookups(&self) -> Vec<Instant> {
        self.lookups.lock().clone()
    }
}

impl Resolve for Scripted {
    fn resolve(&self, target: &str) -> impl Future<Output = io::Result<Vec<SocketAddr>>> + Send {
        assert_eq!(target, TARGET, "the service's own name is looked up");
        let first = {
            let mut lookups = self.lookups.lock();
            lookups.push(Instant::now());
            lookups.len() == 1
        };
        let answer = self.answer.lock().clone();
        let takes = if first {
            self.first_takes
        } else {
            Duration::ZERO
        };
        async move {
            tokio::time::sleep(takes).await;
            match answer {
                Answer::Found(addrs) => Ok(addrs),
                Answer::Empty => Ok(Vec::new()),
                Answer::Fails => Err(io::Error::other("SERVFAIL")),
            }
        }
    }
}

/// The uplinks the follower had started and stopped, as the fake spawner saw them.
#[derive(Clone, Default)]
struct Spawned {
    started: Arc<Mutex<Vec<UplinkConfig>>>,
    stopped: Arc<Mutex<Vec<String>>>,
}

/// Records its router in `stopped` when its task is dropped (the follower aborted it).
struct StopGuard {
    router: String,
    stopped: Arc<Mutex<Vec<String>>>,
}

impl Drop for StopGuard {
    fn drop(&mut self) {
        self.stopped.lock().push(std::mem::take(&mut self.router));
    }
}

impl Spawned {
    fn spawner(&self) -> impl Fn(UplinkConfig) -> JoinHandle<()> + Send + 'static {
        let this = self.clone();
        move |config: UplinkConfig| {
            let guard = StopGuard {
                router: config.router.clone(),
                stopped: Arc::clone(&this.stopped),
            };
            this.started.lock().push(config);
            tokio::spawn(async move {
                let _guard = guard;
                std::future::pending::<()>().await;
            })
        }
    }

    fn started(&self) -> Vec<String> {
        self.started
            .lock()
            .iter()
            .map(|c| c.router.clone())
            .collect()
    }

    fn stopped(&self) -> Vec<String> {
        self.stopped.lock().clone()
    }
}

fn service() -> RouterService {
    let mut uplink = UplinkConfig::new(TARGET, Some("s3cret".into()));
    uplink.heartbeat = Duration::from_secs(7);
    RouterService {
        target: TARGET.into(),
        interval: INTERVAL,
        uplink,
    }
}

fn addresses(metrics: &Metrics) -> i64 {
    metrics
        .router_addresses
        .get_or_create(&ServiceLabel {
            service: TARGET.into(),
        })
        .get()
}

/// Starts a follower; the first lookup happens at once.
fn start(resolver: &Scripted, spawned: &Spawned) -> (Arc<Metrics>, JoinHandle<()>) {
    let metrics = Arc::new(Metrics::new());
    let task = tokio::spawn(follow(
        service(),
        resolver.clone(),
        Arc::clone(&metrics),
        spawned.spawner(),
    ));
    (metrics, task)
}

/// Lets the follower run until just after its next lookup.
async fn next_lookup() {
    tokio::time::sleep(INTERVAL).await;
}

#[tokio::test(start_paused = true)]
async fn routers_get_an_uplink_when_they_join_the_answer_and_lose_it_when_they_leave() {
    let (a, b) = (addr(1), addr(2));
    let resolver = Scripted::new(Answer::Found(vec![a]));
    let spawned = Spawned::default();
    let (metrics, follower) = start(&resolver, &spawned);
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(spawned.started(), [a.to_string()]);
    let first = spawned.started.lock()[0].clone();
    assert_eq!(
        first.tls_server_name.as_deref(),
        Some("routers.test"),
        "the certificate is checked against the service's name, not the address"
    );
    assert_eq!(
        first.token.as_deref(),
        Some("s3cret"),
        "the service's settings"
    );
    assert_eq!(
        first.heartbeat,
        Duration::from_secs(7),
        "the service's settings"
    );
    assert_eq!(addresses(&metrics), 1);

    // The departing router's series exist, as its uplink would have made them.
    let a_label = RouterLabel {
        router: a.to_string(),
    };
    metrics.uplink_connected.get_or_create(&a_label).set(1);
    metrics
        .event_to_router
        .get_or_create(&a_label)
        .observe(0.01);
    metrics
        .uplink_errors
        .get_or_create(&UplinkErrorLabel {
            router: a.to_string(),
            reason: "connect",
        })
        .inc();

    resolver.set(Answer::Found(vec![b, a]));
    next_lookup().await;
    assert_eq!(
        spawned.started(),
        [a.to_string(), b.to_string()],
        "one uplink per router, not one per lookup"
    );
    assert!(spawned.stopped().is_empty());
    assert_eq!(addresses(&metrics), 2);

    resolver.set(Answer::Found(vec![b]));
    next_lookup().await;
    assert_eq!(spawned.stopped(), [a.to_string()]);
    assert_eq!(spawned.started().len(), 2, "b keeps its uplink");
    assert_eq!(addresses(&metrics), 1);
    let text = metrics.encode();
    assert!(
        !text.contains(&format!("router=\"{a}\"")),
        "a departed router's series are gone: {text}"
    );

    // A router that comes back gets a new uplink.
    resolver.set(Answer::Found(vec![a, b]));
    next_lookup().await;
    assert_eq!(
        spawned.started(),
        [a.to_string(), b.to_string(), a.to_string()]
    );

    // Dropping the follower stops every uplink it started.
    follower.abort();
    let _ = follower.await;
    let mut stopped = spawned.stopped();
    stopped.sort();
    assert_eq!(stopped, [a.to_string(), a.to_string(), b.to_string()]);
}

#[tokio::test(start_paused = true)]
async fn a_failed_or_empty_lookup_keeps_the_uplinks_it_has() {
    let (a, b) = (addr(1), addr(2));
    let resolver = Scripted::new(Answer::Found(vec![a, b]));
    let spawned = Spawned::default();
    let (metrics, _follower) = start(&resolver, &spawned);
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(spawned.started().len(), 2);

    resolver.set(Answer::Fails);
    next_lookup().await;
    resolver.set(Answer::Empty);
    next_lookup().await;
    assert_eq!(resolver.lookups().len(), 3, "both lookups happened");
    assert!(spawned.stopped().is_empty(), "DNS trouble cuts no feed");
    assert_eq!(spawned.started().len(), 2, "and restarts none");
    assert_eq!(addresses(&metrics), 2, "the last answer that held");

    // Still following: the next real answer applies.
    resolver.set(Answer::Found(vec![a]));
    next_lookup().await;
    assert_eq!(spawned.stopped(), [b.to_string()]);
    assert_eq!(addresses(&metrics), 1);
}

#[tokio::test(start_paused = true)]
async fn the_name_is_looked_up_again_every_interval_and_a_slow_lookup_causes_no_burst() {
    let resolver = Scripted::new(Answer::Found(vec![addr(1)]));
    let spawned = Spawned::default();
    let started = Instant::now();
    let _follower = start(&resolver, &spawned);
    tokio::time::sleep(INTERVAL * 3 + Duration::from_millis(500)).await;
    let offsets: Vec<Duration> = resolver
        .lookups()
        .iter()
        .map(|t| t.duration_since(started))
        .collect();
    assert_eq!(
        offsets,
        [Duration::ZERO, INTERVAL, INTERVAL * 2, INTERVAL * 3]
    );

    // A lookup that takes longer than the interval: the next ones keep the interval between
    // them rather than catching up on the ticks it missed.
    let mut slow = Scripted::new(Answer::Found(vec![addr(1)]));
    slow.first_takes = INTERVAL * 5 / 2;
    let _follower = start(&slow, &Spawned::default());
    tokio::time::sleep(INTERVAL * 6).await;
    let lookups = slow.lookups();
    assert!(lookups.len() >= 4, "{lookups:?}");
    for pair in lookups.windows(2) {
        assert!(
            pair[1] - pair[0] >= INTERVAL,
            "lookups closer than the interval: {lookups:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_target_without_a_port_follows_nothing() {
    let resolver = Scripted::new(Answer::Found(vec![addr(1)]));
    let spawned = Spawned::default();
    let service = RouterService {
        target: "routers.test".into(),
        ..service()
    };
    // Returns on its own: nothing to follow.
    follow(
        service,
        resolver.clone(),
        Arc::new(Metrics::new()),
        spawned.spawner(),
    )
    .await;
    assert!(resolver.lookups().is_empty());
    assert!(spawned.started().is_empty());
}
