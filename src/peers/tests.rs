//! Peering over real gRPC on loopback: a router's picks and loads reach its peer, a lost peer
//! takes its load with it, a router does not peer with itself, the token is checked, and every
//! out-of-bounds update is refused without touching state.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use llmgw_feed_proto::peer::v1 as pb;
use parking_lot::Mutex;
use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;
use tonic::Status;
use tonic::transport::Endpoint;

use super::client::{PeerClient, PeerContext, Refusal};
use super::service::Authorize;
use super::*;
use crate::pool::adapters::{AdapterCatalog, ModelCard};
use crate::pool::{Pool, ReplicaSpec};

const MODEL: &str = "m";

fn pool(ports: &[u16]) -> Arc<Pool> {
    Arc::new(Pool::new(
        ports
            .iter()
            .map(|&port| ReplicaSpec {
                address: SocketAddr::from(([127, 0, 0, 1], port)),
                models: vec![MODEL.to_owned()],
                node: None,
            })
            .collect(),
        Duration::from_secs(5),
    ))
}

/// What the scheduler would have heard.
#[derive(Default)]
struct Heard(Mutex<Vec<PeerPick>>);

impl PickSink for Heard {
    fn peer_picked(&self, pick: &PeerPick) {
        self.0.lock().push(pick.clone());
    }
}

fn open() -> Authorize {
    Arc::new(|_| Ok(()))
}

/// A router's peering service on 127.0.0.1:0, with its outbox and pool, on a runtime of its
/// own: [`Serving::kill`] drops that runtime, closing every socket as a router's exit would.
struct Serving {
    url: String,
    outbox: Arc<PickOutbox>,
    pool: Arc<Pool>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Serving {
    fn kill(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.kill();
    }
}

fn serve(router_id: u64, authorize: Authorize) -> Serving {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("non-blocking");
    let addr = listener.local_addr().expect("addr");
    let outbox = Arc::new(PickOutbox::default());
    let pool = pool(&[8001, 8002]);
    let service = PeeringService::new(
        router_id,
        Arc::clone(&outbox),
        Arc::clone(&pool),
        authorize,
        PeerMetrics::default(),
    );
    runtime.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
        let _ = tonic::transport::Server::builder()
            .add_service(service.into_server())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
    });
    Serving {
        url: format!("http://{addr}"),
        outbox,
        pool,
        runtime: Some(runtime),
    }
}

struct Subscriber {
    heard: Arc<Heard>,
    pool: Arc<Pool>,
    metrics: PeerMetrics,
    task: tokio::task::JoinHandle<()>,
}

fn client(
    url: &str,
    router_id: u64,
    token: Option<&str>,
    pool: Arc<Pool>,
) -> (PeerClient, Arc<Heard>, PeerMetrics) {
    let heard = Arc::new(Heard::default());
    let metrics = PeerMetrics::default();
    let context = PeerContext {
        router_id,
        token: token.map(str::to_owned),
        sink: Arc::clone(&heard) as Arc<dyn PickSink>,
        loads: Arc::new(PeerLoads::new(Arc::clone(&pool))),
        pool,
        metrics: metrics.clone(),
    };
    let client = context.client(
        url.to_owned(),
        Endpoint::from_shared(url.to_owned()).expect("url"),
    );
    (client, heard, metrics)
}

fn subscribe(url: &str, router_id: u64, token: Option<&str>) -> Subscriber {
    let pool = pool(&[8001, 8002, 8003]);
    let (client, heard, metrics) = client(url, router_id, token, Arc::clone(&pool));
    Subscriber {
        heard,
        pool,
        metrics,
        task: tokio::spawn(client.run()),
    }
}

fn text(metrics: &PeerMetrics) -> String {
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let mut out = String::new();
    encode(&mut out, &registry).expect("encode");
    out
}

/// Polls `check` every 10 ms until it holds, for at most 10 s.
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..1_000 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never: {what}");
}

fn is_connected(metrics: &PeerMetrics, url: &str) -> bool {
    text(metrics).contains(&format!("llmgw_peer_connected{{peer=\"{url}\"}} 1"))
}

fn peer_in_flight(pool: &Pool, port: u16) -> u32 {
    pool.snapshot()
        .find(&format!("127.0.0.1:{port}"))
        .expect("replica")
        .peer_in_flight()
}

fn pick(replica: &str, hashes: &[u64], new_blocks: u32) -> PeerPick {
    PeerPick {
        model: MODEL.to_owned(),
        replica: replica.to_owned(),
        hashes: hashes.iter().copied().map(ExternalHash).collect(),
        new_blocks,
        tree_chain: Arc::from([7, 8]),
    }
}

#[tokio::test]
async fn a_routers_picks_and_loads_reach_its_peer_and_leave_with_it() {
    let mut server = serve(1, open());
    let subscriber = subscribe(&server.url, 2, None);
    eventually("subscribed", || {
        is_connected(&subscriber.metrics, &server.url)
    })
    .await;

    // A pick published now reaches the subscriber's sink as it was made.
    let sent = pick("127.0.0.1:8002", &[11, 12, 13], 2);
    server.outbox.publish(|| sent.clone());
    eventually("the pick heard", || !subscriber.heard.0.lock().is_empty()).await;
    assert_eq!(*subscriber.heard.0.lock(), vec![sent]);

    // Its requests in flight add to the subscriber's counts of the same replicas, and only
    // its own: the subscriber's replica 8003, unknown to the server, stays at 0.
    let server_replica = server
        .pool
        .snapshot()
        .find("127.0.0.1:8001")
        .cloned()
        .expect("replica");
    let guards = [
        server_replica.start_request(),
        server_replica.start_request(),
    ];
    eventually("two in flight", || {
        peer_in_flight(&subscriber.pool, 8001) == 2
    })
    .await;
    assert_eq!(peer_in_flight(&subscriber.pool, 8002), 0);
    assert_eq!(peer_in_flight(&subscriber.pool, 8003), 0);
    drop(guards);
    eventually("none in flight", || {
        peer_in_flight(&subscriber.pool, 8001) == 0
    })
    .await;

    // The peer goes away with a request in flight: its count goes with it.
    let _guard = server_replica.start_request();
    eventually("one in flight", || {
        peer_in_flight(&subscriber.pool, 8001) == 1
    })
    .await;
    server.kill();
    eventually("the lost peer's load dropped", || {
        peer_in_flight(&subscriber.pool, 8001) == 0
    })
    .await;
    eventually("disconnected", || {
        text(&subscriber.metrics).contains(&format!(
            "llmgw_peer_connected{{peer=\"{}\"}} 0",
            server.url
        ))
    })
    .await;
    let metrics = text(&subscriber.metrics);
    assert!(
        metrics.contains(&format!(
            "llmgw_peer_updates_total{{peer=\"{}\",kind=\"pick\",outcome=\"applied\"}} 1",
            server.url
        )),
        "{metrics}"
    );
    subscriber.task.abort();
}

#[tokio::test]
async fn a_router_listed_among_its_own_peers_skips_itself() {
    let server = serve(7, open());
    let subscriber = subscribe(&server.url, 7, None);
    // The task ends instead of retrying: the peer is this router.
    tokio::time::timeout(Duration::from_secs(10), subscriber.task)
        .await
        .expect("the task ended")
        .expect("no panic");
    assert!(subscriber.heard.0.lock().is_empty());
    assert_eq!(server.outbox.sender.receiver_count(), 0);
}

#[tokio::test]
async fn a_subscriber_needs_the_token_when_one_is_configured() {
    let authorize: Authorize =
        Arc::new(
            |metadata| match metadata.get("authorization").and_then(|v| v.to_str().ok()) {
                Some("Bearer s3cret") => Ok(()),
                _ => Err(Status::unauthenticated("missing or wrong feed token")),
            },
        );
    let server = serve(1, authorize);
    let wrong = subscribe(&server.url, 2, Some("guess"));
    let right = subscribe(&server.url, 3, Some("s3cret"));
    eventually("the right token subscribed", || {
        is_connected(&right.metrics, &server.url)
    })
    .await;
    server.outbox.publish(|| pick("127.0.0.1:8001", &[1], 1));
    eventually("heard with the token", || right.heard.0.lock().len() == 1).await;
    // The wrong token was refused before any subscription: it hears nothing and is not open.
    assert!(wrong.heard.0.lock().is_empty());
    assert_eq!(server.outbox.sender.receiver_count(), 1);
    assert!(!is_connected(&wrong.metrics, &server.url));
    wrong.task.abort();
    right.task.abort();
}

#[tokio::test]
async fn without_subscribers_a_pick_is_never_built() {
    let outbox = PickOutbox::default();
    outbox.publish(|| unreachable!("no subscriber: nothing to build"));
    let mut receiver = outbox.subscribe();
    outbox.publish(|| pick("127.0.0.1:8001", &[5], 0));
    assert_eq!(
        receiver.recv().await.expect("a pick").hashes[..],
        [ExternalHash(5)]
    );
}

fn update(body: pb::peer_update::Body) -> pb::PeerUpdate {
    pb::PeerUpdate { body: Some(body) }
}

fn wire_pick(replica: &str, model: &str, blocks: usize, new_blocks: u32) -> pb::PeerUpdate {
    update(pb::peer_update::Body::Pick(pb::Pick {
        model: model.to_owned(),
        replica: replica.to_owned(),
        block_hashes: (0..blocks as u64).collect(),
        new_blocks,
        tree_chain: Vec::new(),
    }))
}

fn wire_load(loads: &[(&str, u32)]) -> pb::PeerUpdate {
    update(pb::peer_update::Body::Load(pb::Load {
        replicas: loads
            .iter()
            .map(|(replica, in_flight)| pb::ReplicaLoad {
                replica: (*replica).to_owned(),
                in_flight: *in_flight,
            })
            .collect(),
    }))
}

#[tokio::test]
async fn updates_out_of_bounds_are_refused_and_change_nothing() {
    let pool = pool(&[8001]);
    let (client, heard, _) = client("http://127.0.0.1:1", 1, None, Arc::clone(&pool));
    let long = "x".repeat(limits::MAX_NAME_BYTES + 1);
    let too_many: Vec<(String, u32)> = (0..=limits::MAX_LOAD_REPLICAS)
        .map(|i| (format!("10.0.0.1:{i}"), 1))
        .collect();
    let too_many: Vec<(&str, u32)> = too_many.iter().map(|(r, n)| (r.as_str(), *n)).collect();
    let cases: Vec<(pb::PeerUpdate, Refusal)> = vec![
        (
            wire_pick("127.0.0.1:8001", MODEL, 0, 0),
            Refusal::PickBlocks(0),
        ),
        (
            wire_pick("127.0.0.1:8001", MODEL, limits::MAX_PICK_BLOCKS + 1, 0),
            Refusal::PickBlocks(limits::MAX_PICK_BLOCKS + 1),
        ),
        (
            wire_pick("127.0.0.1:8001", MODEL, 3, 4),
            Refusal::NewBlocks { new: 4, total: 3 },
        ),
        (
            wire_pick("127.0.0.1:8001", &long, 3, 1),
            Refusal::NameLength(long.len()),
        ),
        (
            wire_load(&[("127.0.0.1:8001", limits::MAX_IN_FLIGHT + 1)]),
            Refusal::InFlight(limits::MAX_IN_FLIGHT + 1),
        ),
        (wire_load(&[(&long, 1)]), Refusal::NameLength(long.len())),
        (
            wire_load(&too_many),
            Refusal::LoadReplicas(limits::MAX_LOAD_REPLICAS + 1),
        ),
        (pb::PeerUpdate { body: None }, Refusal::Empty),
    ];
    for (update, refusal) in cases {
        assert_eq!(client.apply(update).1, Err(refusal));
    }
    assert!(heard.0.lock().is_empty());
    assert_eq!(peer_in_flight(&pool, 8001), 0);

    // A replica or model not routed here is ignored, not refused; the known ones apply.
    assert_eq!(
        client.apply(wire_pick("10.9.9.9:8001", MODEL, 3, 1)).1,
        Ok(false)
    );
    assert_eq!(
        client.apply(wire_pick("127.0.0.1:8001", "other", 3, 1)).1,
        Ok(false)
    );
    assert!(heard.0.lock().is_empty());
    assert_eq!(
        client
            .apply(wire_load(&[("127.0.0.1:8001", 3), ("10.9.9.9:8001", 9)]))
            .1,
        Ok(true)
    );
    assert_eq!(peer_in_flight(&pool, 8001), 3);
    assert_eq!(
        client.apply(wire_pick("127.0.0.1:8001", MODEL, 3, 3)).1,
        Ok(true)
    );
    assert_eq!(heard.0.lock().len(), 1);
    // A pick of the prefix tree's text chain alone (a router without the KV index) applies.
    let tree_only = update(pb::peer_update::Body::Pick(pb::Pick {
        model: MODEL.to_owned(),
        replica: "127.0.0.1:8001".to_owned(),
        block_hashes: Vec::new(),
        new_blocks: 0,
        tree_chain: vec![5, 6],
    }));
    assert_eq!(client.apply(tree_only).1, Ok(true));
    assert_eq!(heard.0.lock()[1].tree_chain[..], [5, 6]);
    heard.0.lock().pop();
    // A LoRA adapter's pick applies once the replica lists the adapter.
    let sql = || wire_pick("127.0.0.1:8001", "sql", 3, 1);
    assert_eq!(client.apply(sql()).1, Ok(false));
    let card = |id: &str, root: &str, parent: Option<&str>| ModelCard {
        id: id.into(),
        root: Some(root.into()),
        parent: parent.map(Into::into),
    };
    pool.snapshot()
        .find("127.0.0.1:8001")
        .expect("replica")
        .set_adapters(AdapterCatalog::from_cards(&[
            card(MODEL, MODEL, None),
            card("sql", "/adapters/sql", Some(MODEL)),
        ]));
    assert_eq!(client.apply(sql()).1, Ok(true));
    assert_eq!(heard.0.lock().len(), 2);
}

#[test]
fn peers_loads_add_up_and_a_cleared_peer_stops_counting() {
    let pool = pool(&[8001, 8002]);
    let loads = PeerLoads::new(Arc::clone(&pool));
    loads.set("a", HashMap::from([("127.0.0.1:8001".to_owned(), 2)]));
    loads.set(
        "b",
        HashMap::from([
            ("127.0.0.1:8001".to_owned(), 3),
            ("127.0.0.1:8002".to_owned(), u32::MAX),
        ]),
    );
    assert_eq!(peer_in_flight(&pool, 8001), 5);
    assert_eq!(peer_in_flight(&pool, 8002), u32::MAX);
    loads.set("a", HashMap::new());
    assert_eq!(peer_in_flight(&pool, 8001), 3);
    loads.clear("b");
    assert_eq!(peer_in_flight(&pool, 8001), 0);
    assert_eq!(peer_in_flight(&pool, 8002), 0);
}

/// A resolver whose answer the test sets.
#[derive(Clone, Default)]
struct FakeResolver(Arc<Mutex<Vec<SocketAddr>>>);

impl super::mesh::Resolve for FakeResolver {
    fn resolve(
        &self,
        _: &str,
    ) -> impl std::future::Future<Output = std::io::Result<Vec<SocketAddr>>> + Send {
        let answer = self.0.lock().clone();
        async move { Ok(answer) }
    }
}

fn addr_of(serving: &Serving) -> SocketAddr {
    serving
        .url
        .strip_prefix("http://")
        .and_then(|a| a.parse().ok())
        .expect("http://ip:port")
}

#[tokio::test]
async fn a_peer_service_is_followed_as_routers_come_and_go_and_its_own_address_skipped() {
    const ME: u64 = 5;
    let (a, b, me) = (serve(1, open()), serve(2, open()), serve(ME, open()));
    let resolver = FakeResolver::default();
    *resolver.0.lock() = vec![addr_of(&a), addr_of(&b), addr_of(&me)];
    let pool = pool(&[8001, 8002]);
    let heard = Arc::new(Heard::default());
    let metrics = PeerMetrics::default();
    let context = PeerContext {
        router_id: ME,
        token: None,
        sink: Arc::clone(&heard) as Arc<dyn PickSink>,
        loads: Arc::new(PeerLoads::new(Arc::clone(&pool))),
        pool: Arc::clone(&pool),
        metrics: metrics.clone(),
    };
    let service = PeerService {
        target: "routers:9004".to_owned(),
        interval: Duration::from_millis(20),
    };
    let follow = tokio::spawn(super::mesh::follow(service, resolver.clone(), context));
    eventually("subscribed to both peers", || {
        is_connected(&metrics, &a.url) && is_connected(&metrics, &b.url)
    })
    .await;
    // Its own address was refused and is not tried again: one subscriber each at A and B, and
    // none at itself, over many resolutions.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(me.outbox.sender.receiver_count(), 0);
    assert!(!is_connected(&metrics, &me.url));

    // Both peers' loads count; B leaves the service and its load with it, while A's stays.
    let in_flight = |serving: &Serving| {
        serving
            .pool
            .snapshot()
            .find("127.0.0.1:8001")
            .cloned()
            .expect("replica")
            .start_request()
    };
    let _guards = [in_flight(&a), in_flight(&b), in_flight(&b)];
    eventually("A's and B's loads", || peer_in_flight(&pool, 8001) == 3).await;
    resolver.0.lock().retain(|addr| *addr != addr_of(&b));
    eventually("B's load gone", || peer_in_flight(&pool, 8001) == 1).await;
    assert!(!is_connected(&metrics, &b.url));
    assert!(is_connected(&metrics, &a.url));
    // An empty answer keeps the peers there are.
    resolver.0.lock().clear();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(is_connected(&metrics, &a.url));
    assert_eq!(peer_in_flight(&pool, 8001), 1);
    follow.abort();
}
