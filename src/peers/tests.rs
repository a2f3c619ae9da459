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

use super::client::{PeerClient, PeerContext, Refusal, TokenSource};
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
    serve_with(router_id, authorize, None)
}

/// [`serve`], over TLS when `tls` is given, counting refused handshakes there.
fn serve_with(
    router_id: u64,
    authorize: Authorize,
    tls: Option<(crate::tls::ServerTls, crate::tls::TlsRefusals)>,
) -> Serving {
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
    let scheme = if tls.is_some() { "https" } else { "http" };
    runtime.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
        let server = tonic::transport::Server::builder().add_service(service.into_server());
        let _ = match tls {
            Some((tls, refused)) => {
                server
                    .serve_with_incoming(crate::tls::TlsIncoming::new(
                        "feed", listener, tls, refused,
                    ))
                    .await
            }
            None => {
                server
                    .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                    .await
            }
        };
    });
    Serving {
        url: format!("{scheme}://{addr}"),
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

/// A token that never changes.
fn fixed(token: Option<&str>) -> TokenSource {
    let token = token.map(str::to_owned);
    Arc::new(move || token.clone())
}

fn client(
    url: &str,
    router_id: u64,
    token: TokenSource,
    pool: Arc<Pool>,
) -> (PeerClient, Arc<Heard>, PeerMetrics) {
    let heard = Arc::new(Heard::default());
    let metrics = PeerMetrics::default();
    let context = PeerContext {
        router_id,
        tls: None,
        token,
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
    let (client, heard, metrics) = client(url, router_id, fixed(token), Arc::clone(&pool));
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
        placed: false,
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

    // A pick published now reaches the subscriber's sink as it was made (a placement, so
    // that the flag is seen to travel too).
    let sent = PeerPick {
        placed: true,
        ..pick("127.0.0.1:8002", &[11, 12, 13], 2)
    };
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
async fn a_rotated_token_is_presented_at_the_next_subscription() {
    let authorize: Authorize =
        Arc::new(
            |metadata| match metadata.get("authorization").and_then(|v| v.to_str().ok()) {
                Some("Bearer new") => Ok(()),
                _ => Err(Status::unauthenticated("missing or wrong feed token")),
            },
        );
    let server = serve(1, authorize);
    // The token as its file reads: "old" until the first refusal has been seen, then "new".
    let reads = Arc::new(Mutex::new(0u32));
    let token: TokenSource = {
        let reads = Arc::clone(&reads);
        Arc::new(move || {
            let mut reads = reads.lock();
            *reads += 1;
            Some(if *reads == 1 { "old" } else { "new" }.to_owned())
        })
    };
    let (client, _, metrics) = client(&server.url, 2, token, pool(&[8001]));
    let task = tokio::spawn(client.run());
    eventually("subscribed with the rotated token", || {
        is_connected(&metrics, &server.url)
    })
    .await;
    assert!(*reads.lock() >= 2, "read again after the refusal");
    task.abort();
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
        placed: false,
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
    let (client, heard, _) = client("http://127.0.0.1:1", 1, fixed(None), Arc::clone(&pool));
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
        placed: false,
    }));
    assert_eq!(client.apply(tree_only).1, Ok(true));
    assert_eq!(heard.0.lock()[1].tree_chain[..], [5, 6]);
    heard.0.lock().pop();
    // A placement alone carries no blocks, and applies.
    let placement = update(pb::peer_update::Body::Pick(pb::Pick {
        model: MODEL.to_owned(),
        replica: "127.0.0.1:8001".to_owned(),
        block_hashes: Vec::new(),
        new_blocks: 0,
        tree_chain: Vec::new(),
        placed: true,
    }));
    assert_eq!(client.apply(placement).1, Ok(true));
    assert!(heard.0.lock()[1].placed);
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
        .rsplit_once("://")
        .and_then(|(_, a)| a.parse().ok())
        .expect("SCHEME://ip:port")
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
        tls: None,
        token: Arc::new(|| None),
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
    let b_label = format!("peer=\"{}\"", b.url);
    eventually("B's series gone", || !text(&metrics).contains(&b_label)).await;
    assert!(text(&metrics).contains(&format!("peer=\"{}\"", a.url)));
    // An empty answer keeps the peers there are.
    resolver.0.lock().clear();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(is_connected(&metrics, &a.url));
    assert_eq!(peer_in_flight(&pool, 8001), 1);
    follow.abort();
}

mod tls {
    use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};

    use std::path::PathBuf;

    use super::*;
    use crate::peers::options::{PeerTls, endpoint};
    use crate::testing::{TestCa, write_file};
    use crate::tls::{ServerTls, TlsRefusal, TlsRefusals};

    /// A feed port over mutual TLS: its certificate (for `names`, both ends' usages) and
    /// `ca` for its clients, as written under `dir` (ca.crt, router.crt, router.key).
    fn serve_mtls(ca: &TestCa, names: &[&str], dir: &std::path::Path) -> (Serving, TlsRefusals) {
        let (cert, key) = ca.leaf(names, &[ServerAuth, ClientAuth]);
        write_file(dir, "ca.crt", &ca.pem());
        write_file(dir, "router.crt", &cert);
        write_file(dir, "router.key", &key);
        let tls = ServerTls::from_pem(cert.as_bytes(), key.as_bytes(), Some(ca.pem().as_bytes()))
            .expect("server TLS");
        let refused = TlsRefusals::default();
        (serve_with(1, open(), Some((tls, refused.clone()))), refused)
    }

    /// TLS to peers as `--peer-tls-*` set it up: trusting `ca`, presenting `identity`.
    fn peer_tls(url: &str, ca: PathBuf, identity: Option<(PathBuf, PathBuf)>) -> Arc<PeerTls> {
        let (peer_tls_cert, peer_tls_key) = identity.unzip();
        let options = PeerOptions {
            peers: vec![url.to_owned()],
            peer_tls_ca: Some(ca),
            peer_tls_cert,
            peer_tls_key,
            ..PeerOptions::default()
        };
        Arc::new(
            options
                .resolve(&PeerOptions::default(), None)
                .expect("TLS options")
                .tls
                .expect("TLS"),
        )
    }

    fn tls_context(tls: Arc<PeerTls>) -> (PeerContext, Arc<Heard>, PeerMetrics) {
        let pool = pool(&[8001, 8002]);
        let heard = Arc::new(Heard::default());
        let metrics = PeerMetrics::default();
        let context = PeerContext {
            router_id: 2,
            tls: Some(tls),
            token: Arc::new(|| None),
            sink: Arc::clone(&heard) as Arc<dyn PickSink>,
            loads: Arc::new(PeerLoads::new(Arc::clone(&pool))),
            pool,
            metrics: metrics.clone(),
        };
        (context, heard, metrics)
    }

    fn refusals(refused: &TlsRefusals, reason: &'static str) -> u64 {
        refused.get_or_create(&TlsRefusal { reason }).get()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn over_mutual_tls_a_peer_with_a_certificate_subscribes_and_one_without_is_refused() {
        let ca = TestCa::new("routers");
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, refused) = serve_mtls(&ca, &["127.0.0.1"], dir.path());
        assert!(a.url.starts_with("https://"), "{}", a.url);

        // Without a certificate: the handshake is refused, and the peer never counts as
        // subscribed.
        let (context, _, metrics) = tls_context(peer_tls(&a.url, dir.path().join("ca.crt"), None));
        let anonymous = tokio::spawn(
            context
                .client(a.url.clone(), endpoint(&a.url, true).expect("endpoint"))
                .run(),
        );
        eventually("a refused handshake", || {
            refusals(&refused, "no_client_cert") > 0
        })
        .await;
        assert!(!is_connected(&metrics, &a.url));
        anonymous.abort();

        // With the router's certificate: subscribed, and a pick arrives.
        let identity = (dir.path().join("router.crt"), dir.path().join("router.key"));
        let (context, heard, metrics) =
            tls_context(peer_tls(&a.url, dir.path().join("ca.crt"), Some(identity)));
        let subscriber = tokio::spawn(
            context
                .client(a.url.clone(), endpoint(&a.url, true).expect("endpoint"))
                .run(),
        );
        eventually("subscribed over mutual TLS", || {
            is_connected(&metrics, &a.url)
        })
        .await;
        eventually("a pick over TLS", || {
            a.outbox.publish(|| pick("127.0.0.1:8001", &[7, 8], 2));
            !heard.0.lock().is_empty()
        })
        .await;
        assert_eq!(
            heard.0.lock()[0].hashes[..],
            [ExternalHash(7), ExternalHash(8)]
        );
        subscriber.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_whose_certificate_another_ca_signed_is_not_trusted_and_the_log_says_why() {
        let ca = TestCa::new("routers");
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, _) = serve_mtls(&ca, &["127.0.0.1"], dir.path());
        let other = write_file(dir.path(), "other-ca.crt", &TestCa::new("other").pem());
        let identity = (dir.path().join("router.crt"), dir.path().join("router.key"));
        let tls = peer_tls(&a.url, other, Some(identity));
        let error = endpoint(&a.url, true)
            .expect("endpoint")
            .tls_config(tls.current(None))
            .expect("TLS config")
            .connect()
            .await
            .expect_err("an untrusted certificate");
        let text = crate::tls::with_causes(&error);
        assert!(text.contains("certificate"), "{text}");

        let (context, _, metrics) = tls_context(tls);
        let subscriber = tokio::spawn(
            context
                .client(a.url.clone(), endpoint(&a.url, true).expect("endpoint"))
                .run(),
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!is_connected(&metrics, &a.url));
        subscriber.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_followed_service_checks_each_address_against_the_service_name() {
        let ca = TestCa::new("routers");
        let dir = tempfile::tempdir().expect("tempdir");
        // The certificate names the service, not the address it resolves to.
        let (a, _) = serve_mtls(&ca, &["localhost"], dir.path());
        let resolver = FakeResolver::default();
        *resolver.0.lock() = vec![addr_of(&a)];
        let identity = (dir.path().join("router.crt"), dir.path().join("router.key"));
        let (context, heard, metrics) =
            tls_context(peer_tls(&a.url, dir.path().join("ca.crt"), Some(identity)));
        let service = PeerService {
            target: format!("localhost:{}", addr_of(&a).port()),
            interval: Duration::from_millis(20),
        };
        let follow = tokio::spawn(super::super::mesh::follow(service, resolver, context));
        eventually("subscribed to the service's address over TLS", || {
            is_connected(&metrics, &a.url)
        })
        .await;
        eventually("a pick over TLS", || {
            a.outbox.publish(|| pick("127.0.0.1:8002", &[9], 1));
            !heard.0.lock().is_empty()
        })
        .await;
        follow.abort();
    }
}
