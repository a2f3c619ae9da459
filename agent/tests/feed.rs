//! End to end inside one process: the recorded vLLM stream on a PUB socket → the agent (intake,
//! mirror, uplink) → the router's feed service (`llmgw::feed`) → an index stand-in.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a bench or test harness: a panic is a failed run, not a crashed router"
)]

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use llmgw::tls::{ServerTls, TlsRefusal};
use llmgw_agent::daemon::Agent;
use llmgw_agent::engine::HashStatus;
use llmgw_agent::routers::{self, Resolve, RouterService};
use llmgw_agent::uplink::{self, UplinkConfig, UplinkError};
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

mod support;
use support::*;

#[tokio::test]
async fn two_routers_receive_the_recorded_streams_final_block_set() {
    let frames = frames();
    let want = final_set(&frames);
    let (a, b) = (router(None, None).await, router(None, None).await);
    let mut n = node(REPLICA, "1729", &[&a, &b], None).await;
    publish(&mut n, &frames).await;
    eventually("router a", || a.index.hashes(REPLICA) == want).await;
    eventually("router b", || b.index.hashes(REPLICA) == want).await;
    let fed = a.feed.replica_blocks();
    let fed: HashSet<u64> = fed[REPLICA].iter().map(|h| h.0).collect();
    assert_eq!(fed, want, "the feed's own view agrees with the index");
    let m = n.agent.metrics.encode();
    assert!(
        m.contains("llmgw_agent_event_to_router_seconds_count"),
        "{m}"
    );
}

/// A resolver whose answer the test sets, counting lookups.
#[derive(Clone, Default)]
struct Answer {
    addrs: Arc<Mutex<Vec<std::net::SocketAddr>>>,
    lookups: Arc<std::sync::atomic::AtomicUsize>,
}

impl Answer {
    fn set(&self, routers: &[&Router]) {
        *self.addrs.lock() = routers
            .iter()
            .map(|r| r.addr.parse().expect("socket address"))
            .collect();
    }

    fn lookups(&self) -> usize {
        self.lookups.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Resolve for Answer {
    fn resolve(
        &self,
        _target: &str,
    ) -> impl Future<Output = std::io::Result<Vec<std::net::SocketAddr>>> + Send {
        self.lookups
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let addrs = self.addrs.lock().clone();
        async move { Ok(addrs) }
    }
}

/// Waits until two of `n`'s sessions to `r` have ended for `reason`: the first may have ended
/// before anything was published, the second began after.
async fn uplink_failed_twice(n: &Node, r: &Router, reason: &str) {
    eventually(&format!("two sessions ended for {reason}"), || {
        uplink_errors(n, &r.addr, Some(reason)) >= 2
    })
    .await;
}

fn streams(r: &Router) -> i64 {
    r.feed.metrics.streams.get()
}

#[tokio::test]
async fn a_router_service_is_followed_as_routers_join_and_leave() {
    let frames = frames();
    let want = final_set(&frames);
    let (a, b) = (router(None, None).await, router(None, None).await);
    let mut n = node(REPLICA, "1729", &[], None).await;
    let answer = Answer::default();
    answer.set(&[&a]);
    let mut uplink = UplinkConfig::new("routers.test:9004", None);
    uplink.backoff_initial = Duration::from_millis(20);
    let service = RouterService {
        target: "routers.test:9004".into(),
        interval: Duration::from_millis(50),
        uplink,
    };
    let follower = tokio::spawn(routers::follow(
        service,
        answer.clone(),
        Arc::clone(&n.agent.metrics),
        n.agent.uplink_spawner(),
    ));
    publish(&mut n, &frames).await;
    eventually("the first router", || a.index.hashes(REPLICA) == want).await;
    assert!(
        b.index.hashes(REPLICA).is_empty(),
        "b is not in the answer yet"
    );

    // A second router joins: it gets a snapshot.
    answer.set(&[&a, &b]);
    eventually("the router that joined", || b.index.hashes(REPLICA) == want).await;
    assert_eq!(streams(&a), 1, "one stream per router, not one per lookup");

    // The first leaves the answer: its stream is closed, the other keeps its own.
    answer.set(&[&b]);
    eventually("the stream to the router that left", || streams(&a) == 0).await;
    let m = n.agent.metrics.encode();
    assert!(!m.contains(&format!("router=\"{}\"", a.addr)), "{m}");
    assert!(
        m.contains("llmgw_agent_router_addresses{service=\"routers.test:9004\"} 1"),
        "{m}"
    );

    // An empty answer (DNS trouble) keeps the routers we have.
    answer.set(&[]);
    let seen = answer.lookups();
    eventually("more lookups", || answer.lookups() >= seen + 3).await;
    assert_eq!(streams(&b), 1, "an empty answer must not cut the feed");

    // Stopping the follower stops its uplinks.
    follower.abort();
    eventually("the follower's uplinks to stop", || streams(&b) == 0).await;
}

#[tokio::test]
async fn a_restarted_router_gets_a_snapshot_and_converges_again() {
    let frames = frames();
    let first = router(None, None).await;
    let addr = first.addr.clone();
    let mut n = node(REPLICA, "1729", &[&first], None).await;
    publish(&mut n, &frames[..12]).await;
    let want_12 = final_set(&frames[..12]);
    eventually("first life", || first.index.hashes(REPLICA) == want_12).await;
    drop(first);
    eventually("the agent to see the router go", || {
        connected(&n, &addr) == 0
    })
    .await;
    // While the router is down the engine moves on.
    publish(&mut n, &frames[12..20]).await;
    let want_20 = final_set(&frames[..20]);
    eventually("the mirror to move on", || flushed_hashes(&n) == want_20).await;
    let second = router(Some(&addr), None).await;
    eventually("snapshot after restart", || {
        second.index.hashes(REPLICA) == want_20
    })
    .await;
    publish(&mut n, &frames[20..]).await;
    let want = final_set(&frames);
    eventually("deltas after the snapshot", || {
        second.index.hashes(REPLICA) == want
    })
    .await;
}

#[tokio::test]
async fn an_agent_claiming_another_nodes_replica_is_refused() {
    let frames = frames();
    let r = router(None, None).await;
    let mut n = node("10.9.9.9:8000", "1729", &[&r], None).await;
    let flushed = Flushed::new(&n);
    publish(&mut n, &frames).await;
    eventually("the refusal", || r.feed.metrics.refused_total() >= 1).await;
    all_acknowledged(&n, &r, frames.len(), &flushed).await;
    assert!(
        flushed.count() > 0,
        "the engine's deltas went to the router"
    );
    assert!(r.index.hashes("10.9.9.9:8000").is_empty());
    assert!(r.index.held.lock().is_empty());
}

#[tokio::test]
async fn the_shared_token_is_checked() {
    let frames = frames();
    let r = router(None, Some("s3cret")).await;
    let mut wrong = node(REPLICA, "1729", &[&r], Some("guess")).await;
    publish(&mut wrong, &frames).await;
    uplink_failed_twice(&wrong, &r, "unauthenticated").await;
    assert!(
        r.index.hashes(REPLICA).is_empty(),
        "a wrong token sends nothing"
    );
    assert_eq!(r.feed.metrics.snapshots.get(), 0);
    drop(wrong);
    let mut right = node(REPLICA, "1729", &[&r], Some("s3cret")).await;
    publish(&mut right, &frames).await;
    let want = final_set(&frames);
    eventually("the right token", || r.index.hashes(REPLICA) == want).await;
}

#[tokio::test]
async fn a_wrong_seed_is_a_hash_mismatch_and_the_router_gets_nothing() {
    let frames = frames();
    let r = router(None, None).await;
    let mut n = node(REPLICA, "31337", &[&r], None).await;
    let flushed = Flushed::new(&n);
    publish(&mut n, &frames).await;
    eventually("the mismatch", || {
        n.agent.engines()[0].hash_status() == HashStatus::Mismatch
    })
    .await;
    all_acknowledged(&n, &r, frames.len(), &flushed).await;
    assert!(r.index.hashes(REPLICA).is_empty());
    let m = n.agent.metrics.encode();
    assert!(
        m.contains(r#"llmgw_agent_hash_mismatches_total{engine="10.0.0.5:8000"}"#),
        "{m}"
    );
}

/// A test CA that signs server and client certificates.
struct TestCa {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

/// A certificate and its key, PEM.
struct Pem {
    cert: String,
    key: String,
}

impl TestCa {
    fn new(name: &str) -> TestCa {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().expect("CA key");
        TestCa {
            issuer: rcgen::CertifiedIssuer::self_signed(params, key).expect("CA cert"),
        }
    }

    fn pem(&self) -> String {
        self.issuer.pem()
    }

    fn leaf(&self, names: &[&str], usage: rcgen::ExtendedKeyUsagePurpose) -> Pem {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = rcgen::CertificateParams::new(names).expect("params");
        params.extended_key_usages = vec![usage];
        let key = rcgen::KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("leaf cert");
        Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    /// The router's feed certificate, for 127.0.0.1 and localhost.
    fn server(&self) -> Pem {
        self.leaf(
            &["127.0.0.1", "localhost"],
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// An agent's client certificate.
    fn client(&self, node: &str) -> Pem {
        self.leaf(&[node], rcgen::ExtendedKeyUsagePurpose::ClientAuth)
    }

    /// An agent's client certificate naming `cn` in its subject only (no alt names).
    fn client_cn_only(&self, cn: &str) -> Pem {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let key = rcgen::KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("leaf cert");
        Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

/// A router requiring client certificates from `ca` (and the token `s3cret`).
async fn mtls_router(ca: &TestCa) -> Router {
    mtls_router_checking(ca, true).await
}

/// The same, checking (or not) that a certificate names the node its agent claims.
async fn mtls_router_checking(ca: &TestCa, check_node: bool) -> Router {
    let server = ca.server();
    let tls = ServerTls::from_pem(
        server.cert.as_bytes(),
        server.key.as_bytes(),
        Some(ca.pem().as_bytes()),
    )
    .expect("feed TLS")
    .with_node_check(check_node);
    assert!(tls.requires_client_cert());
    assert_eq!(tls.checks_node(), check_node);
    router_tls(None, Some("s3cret"), Some(tls)).await
}

fn client_tls(ca: &TestCa, identity: Option<&Pem>) -> ClientTlsConfig {
    let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca.pem()));
    match identity {
        Some(id) => tls.identity(Identity::from_pem(&id.cert, &id.key)),
        None => tls,
    }
}

/// An agent on node "n1" streaming to `r` over TLS with `id` as its client certificate.
async fn mtls_node(r: &Router, ca: &TestCa, id: Option<&Pem>, token: &str) -> Node {
    node_tls(REPLICA, "1729", &[r], Some(token), Some(client_tls(ca, id))).await
}

fn refused(r: &Router, reason: &'static str) -> u64 {
    r.feed
        .metrics
        .tls_refused
        .get_or_create(&TlsRefusal { reason })
        .get()
}

#[tokio::test]
async fn an_agent_with_a_good_client_certificate_streams_over_mutual_tls() {
    let frames = frames();
    let ca = TestCa::new("llmgw test CA");
    let r = mtls_router(&ca).await;
    let id = ca.client("n1");
    let mut n = mtls_node(&r, &ca, Some(&id), "s3cret").await;
    publish(&mut n, &frames).await;
    let want = final_set(&frames);
    eventually("the index over mTLS", || r.index.hashes(REPLICA) == want).await;
    assert_eq!(
        r.feed.metrics.snapshots.get(),
        1,
        "one snapshot, one stream"
    );
}

#[tokio::test]
async fn the_token_is_still_checked_over_mutual_tls() {
    let frames = frames();
    let ca = TestCa::new("llmgw test CA");
    let r = mtls_router(&ca).await;
    let id = ca.client("n1");
    let mut n = mtls_node(&r, &ca, Some(&id), "guess").await;
    publish(&mut n, &frames).await;
    uplink_failed_twice(&n, &r, "unauthenticated").await;
    assert!(
        r.index.hashes(REPLICA).is_empty(),
        "a wrong token sends nothing"
    );
    assert_eq!(r.feed.metrics.snapshots.get(), 0);
    assert_eq!(
        refused(&r, "no_client_cert") + refused(&r, "bad_client_cert"),
        0
    );
}

#[tokio::test]
async fn agents_without_a_client_certificate_or_with_another_cas_are_refused() {
    let frames = frames();
    let ca = TestCa::new("llmgw test CA");
    let r = mtls_router(&ca).await;

    let mut anonymous = mtls_node(&r, &ca, None, "s3cret").await;
    publish(&mut anonymous, &frames).await;
    eventually("a no_client_cert refusal", || {
        refused(&r, "no_client_cert") >= 1
    })
    .await;
    drop(anonymous);

    let other = TestCa::new("someone else's CA");
    let foreign = other.client("n1");
    let mut stranger = mtls_node(&r, &ca, Some(&foreign), "s3cret").await;
    publish(&mut stranger, &frames).await;
    eventually("a bad_client_cert refusal", || {
        refused(&r, "bad_client_cert") >= 1
    })
    .await;
    drop(stranger);

    assert!(r.index.held.lock().is_empty(), "nothing reached the index");
    assert_eq!(r.feed.metrics.snapshots.get(), 0);
    let mut registry = prometheus_client::registry::Registry::default();
    r.feed.metrics.register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    assert!(
        text.contains("llmgw_feed_tls_refused_total{reason=\"no_client_cert\"}"),
        "{text}"
    );
}

#[tokio::test]
async fn a_plain_text_agent_against_a_tls_router_fails_clearly() {
    let ca = TestCa::new("llmgw test CA");
    let r = mtls_router(&ca).await;
    let n = node(REPLICA, "1729", &[], Some("s3cret")).await;
    let config = UplinkConfig::new(r.addr.clone(), Some("s3cret".into()));
    let error = tokio::time::timeout(
        Duration::from_secs(10),
        uplink::session_once(&*n.agent, &config),
    )
    .await
    .expect("the session fails promptly")
    .expect_err("a plain-text session cannot work");
    let text = error.to_string();
    assert!(text.contains("TLS"), "the error says why: {text}");
    eventually("a not_tls refusal", || refused(&r, "not_tls") >= 1).await;
    assert!(r.index.held.lock().is_empty());
}

/// An agent on node "n1" (see [`node_tls`]) presenting `id` to `r`: its first session's end.
async fn claim_n1_with(r: &Router, ca: &TestCa, id: &Pem) -> (Node, Result<(), UplinkError>) {
    let n = node_tls(REPLICA, "1729", &[], Some("s3cret"), None).await;
    let mut config = UplinkConfig::new(r.addr.clone(), Some("s3cret".into()));
    config.tls = Some(client_tls(ca, Some(id)));
    let first = tokio::time::timeout(
        Duration::from_secs(10),
        uplink::session_once(&*n.agent, &config),
    )
    .await;
    (n, first.unwrap_or(Ok(())))
}

#[tokio::test]
async fn an_agent_whose_certificate_names_another_node_is_refused() {
    let ca = TestCa::new("llmgw test CA");
    let r = mtls_router(&ca).await;
    // A valid certificate of node n2, used by an agent claiming n1 (whose replica it reports).
    let (_n, first) = claim_n1_with(&r, &ca, &ca.client("n2")).await;
    match first {
        Err(UplinkError::Stream { status, .. }) => {
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status}");
            assert!(status.message().contains("n2"), "names the cert: {status}");
        }
        other => panic!("expected PERMISSION_DENIED, got {other:?}"),
    }
    assert_eq!(refused(&r, "node_not_in_cert"), 1);
    assert_eq!(r.feed.metrics.snapshots.get(), 0);
    assert!(r.index.held.lock().is_empty(), "nothing reached the index");
}

#[tokio::test]
async fn a_certificate_naming_the_node_in_its_cn_only_is_accepted() {
    let frames = frames();
    let ca = TestCa::new("llmgw test CA");
    let r = mtls_router(&ca).await;
    let id = ca.client_cn_only("n1");
    let mut n = mtls_node(&r, &ca, Some(&id), "s3cret").await;
    publish(&mut n, &frames).await;
    let want = final_set(&frames);
    eventually("the index", || r.index.hashes(REPLICA) == want).await;
    assert_eq!(refused(&r, "node_not_in_cert"), 0);
}

#[tokio::test]
async fn with_the_node_check_off_any_valid_certificate_may_claim_a_node() {
    let frames = frames();
    let ca = TestCa::new("llmgw test CA");
    let r = mtls_router_checking(&ca, false).await;
    let id = ca.client("agent-cert-named-otherwise");
    let mut n = mtls_node(&r, &ca, Some(&id), "s3cret").await;
    publish(&mut n, &frames).await;
    let want = final_set(&frames);
    eventually("the index", || r.index.hashes(REPLICA) == want).await;
    assert_eq!(refused(&r, "node_not_in_cert"), 0);
}

/// Spawns the uplink loop of `agent` with short backoffs.
fn spawn_uplink(agent: &Arc<Agent>, mut config: UplinkConfig) -> JoinHandle<()> {
    config.backoff_initial = Duration::from_millis(20);
    config.backoff_max = Duration::from_millis(100);
    tokio::spawn(uplink::run(Arc::clone(agent), config))
}

#[tokio::test]
async fn a_rotated_token_file_is_read_at_the_next_connection() {
    let frames = frames();
    let want = final_set(&frames);
    let r = router(None, Some("new-token")).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "old-token\n").expect("write");
    let mut n = node(REPLICA, "1729", &[], None).await;
    let mut config = UplinkConfig::new(r.addr.clone(), Some("old-token".into()));
    config.token_file = Some(token_file.clone());
    let _uplink = spawn_uplink(&n.agent, config);
    publish(&mut n, &frames).await;
    uplink_failed_twice(&n, &r, "unauthenticated").await;
    assert!(
        r.index.hashes(REPLICA).is_empty(),
        "the old token is refused"
    );
    // The Secret is rotated: the next attempt presents the new token.
    std::fs::write(&token_file, "new-token\n").expect("write");
    eventually("the rotated token", || r.index.hashes(REPLICA) == want).await;
}

#[tokio::test]
async fn rotated_client_certificates_are_loaded_at_the_next_connection() {
    let frames = frames();
    let want = final_set(&frames);
    let ca = TestCa::new("llmgw test CA");
    let r = mtls_router(&ca).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = |name: &str| dir.path().join(name);
    let install = |id: &Pem| {
        std::fs::write(path("tls.crt"), &id.cert).expect("write");
        std::fs::write(path("tls.key"), &id.key).expect("write");
    };
    std::fs::write(path("ca.crt"), ca.pem()).expect("write");
    install(&ca.client("n2"));
    let files = llmgw_agent::config::TlsFiles {
        router_ca: Some(path("ca.crt")),
        cert: Some(path("tls.crt")),
        key: Some(path("tls.key")),
    };
    let mut n = node(REPLICA, "1729", &[], None).await;
    let mut config = UplinkConfig::new(r.addr.clone(), Some("s3cret".into()));
    config.tls = files.load().expect("loads");
    config.tls_files = Some(files);
    let _uplink = spawn_uplink(&n.agent, config);
    publish(&mut n, &frames).await;
    eventually("the wrong node's certificate refused", || {
        refused(&r, "node_not_in_cert") >= 1
    })
    .await;
    assert!(r.index.hashes(REPLICA).is_empty());
    // cert-manager renews the certificate, now naming this node.
    install(&ca.client("n1"));
    eventually("the renewed certificate", || {
        r.index.hashes(REPLICA) == want
    })
    .await;
}

#[tokio::test]
async fn over_tls_a_router_service_is_checked_against_its_host_name() {
    let frames = frames();
    let want = final_set(&frames);
    let ca = TestCa::new("llmgw test CA");
    let id = ca.client("n1");
    let follow = |n: &Node, r: &Router, target: &str| {
        let answer = Answer::default();
        answer.set(&[r]);
        let mut uplink = UplinkConfig::new(target, Some("s3cret".into()));
        uplink.tls = Some(client_tls(&ca, Some(&id)));
        uplink.backoff_initial = Duration::from_millis(20);
        let service = RouterService {
            target: target.into(),
            interval: Duration::from_millis(50),
            uplink,
        };
        tokio::spawn(routers::follow(
            service,
            answer,
            Arc::clone(&n.agent.metrics),
            n.agent.uplink_spawner(),
        ))
    };
    // The routers' certificate names localhost (and 127.0.0.1), not routers.test.
    let wrong = mtls_router(&ca).await;
    let mut n = node(REPLICA, "1729", &[], None).await;
    let _follower = follow(&n, &wrong, "routers.test:9004");
    publish(&mut n, &frames).await;
    uplink_failed_twice(&n, &wrong, "tls").await;
    assert_eq!(
        streams(&wrong),
        0,
        "a certificate for another name is refused"
    );
    assert!(wrong.index.hashes(REPLICA).is_empty());

    let right = mtls_router(&ca).await;
    let mut n = node(REPLICA, "1729", &[], None).await;
    let _follower = follow(&n, &right, "localhost:9004");
    publish(&mut n, &frames).await;
    eventually("the service named by the certificate", || {
        right.index.hashes(REPLICA) == want
    })
    .await;
}

#[tokio::test]
async fn the_router_reads_its_rotated_token_file_for_each_stream() {
    let frames = frames();
    let want = final_set(&frames);
    let dir = tempfile::tempdir().expect("tempdir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "old-token\n").expect("write");
    let (index, feed) = feed_for_n1(Some("old-token"));
    let r = serve_router(
        None,
        (index, feed.with_token_file(Some(token_file.clone()))),
    )
    .await;
    let mut n = node(REPLICA, "1729", &[], None).await;
    let _uplink = spawn_uplink(
        &n.agent,
        UplinkConfig::new(r.addr.clone(), Some("new-token".into())),
    );
    publish(&mut n, &frames).await;
    uplink_failed_twice(&n, &r, "unauthenticated").await;
    assert!(
        r.index.hashes(REPLICA).is_empty(),
        "not the router's token yet"
    );
    std::fs::write(&token_file, "new-token\n").expect("write");
    eventually("the rotated token", || r.index.hashes(REPLICA) == want).await;
}

#[tokio::test]
async fn the_router_serves_renewed_certificates_without_a_restart() {
    let frames = frames();
    let want = final_set(&frames);
    let ca = TestCa::new("llmgw test CA");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = |name: &str| dir.path().join(name);
    let install = |id: &Pem| {
        std::fs::write(path("tls.crt"), &id.cert).expect("write");
        std::fs::write(path("tls.key"), &id.key).expect("write");
    };
    // First a certificate that does not name the address the agent dials.
    install(&ca.leaf(
        &["elsewhere.example"],
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
    ));
    let paths = llmgw::tls::TlsPaths {
        check_node: true,
        cert: path("tls.crt"),
        key: path("tls.key"),
        client_ca: None,
    };
    let tls = ServerTls::load(&paths).expect("loads");
    let r = router_tls(None, None, Some(tls)).await;
    let mut n = node(REPLICA, "1729", &[], None).await;
    let mut config = UplinkConfig::new(r.addr.clone(), None);
    config.tls = Some(client_tls(&ca, None));
    let _uplink = spawn_uplink(&n.agent, config);
    publish(&mut n, &frames).await;
    uplink_failed_twice(&n, &r, "tls").await;
    assert!(
        r.index.hashes(REPLICA).is_empty(),
        "the agent rejects that name"
    );
    // Renewed for the right name: the next handshake uses it.
    install(&ca.server());
    eventually("the renewed certificate", || {
        r.index.hashes(REPLICA) == want
    })
    .await;
}
