//! A hostile node against a real `llmgw-router` process behind a real Envoy: every feed message
//! the issue reported as fatal (a count of u32::MAX, two counts of 3e9 for one hash, a message
//! far over the size limit, a stream breaking the protocol, a second stream claiming a node) is
//! refused with the router alive, its peak RSS under 100 MB, and still routing through Envoy;
//! an intruder's blocks do not outlive the real agent's return.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

mod router_support;

use std::net::SocketAddr;

use llmgw_feed_proto::v1 as pb;
use llmgw_integration::feed_client::{FeedClient, refusal};
use llmgw_integration::free_port;
use router_support::*;
use tonic::Code;

fn hello(replica: SocketAddr) -> pb::agent_message::Body {
    let engine = pb::EngineInfo::serving("e1", &replica.to_string());
    pb::agent_message::Body::hello("n1", "hostile", vec![engine])
}

/// A feed stream of node n1 that has said Hello for `replica`.
async fn said_hello(feed: SocketAddr, replica: SocketAddr) -> FeedClient {
    let mut client = FeedClient::connect(feed)
        .await
        .expect("connect to the feed");
    client.send(hello(replica)).await.expect("Hello");
    client
}

fn snapshot(blocks: Vec<pb::Block>) -> pb::agent_message::Body {
    pb::agent_message::Body::snapshot("e1", blocks)
}

/// The router's peak resident memory so far, in MiB.
fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("router status");
    llmgw_integration::procfs::parse_status_rss_mib(&status).1
}

async fn blocks_of(router: &RouterProcess, replica: SocketAddr) -> Vec<u64> {
    let body: serde_json::Value = reqwest::get(format!(
        "http://{}/debug/replicas/{replica}/blocks",
        router.admin
    ))
    .await
    .expect("GET blocks")
    .json()
    .await
    .expect("blocks JSON");
    let mut hashes: Vec<u64> = body["block_hashes"]
        .as_array()
        .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
        .unwrap_or_default();
    hashes.sort_unstable();
    hashes
}

/// The router is alive, under 100 MB at its peak, and Envoy still routes through it.
async fn still_routing(router: &RouterProcess, envoy: &EnvoyProcess, after: &str) {
    let peak = peak_rss_mib(router.guard.id());
    eprintln!("after {after}: router peak RSS {peak:.1} MiB");
    assert!(peak < 100.0, "after {after}: router peak RSS {peak:.1} MiB");
    let (status, replica, body) = post(
        envoy,
        "/v1/completions",
        completion("tiny", "still routing?"),
        &[],
    )
    .await;
    assert_eq!(status, 200, "after {after}: {body}");
    assert!(replica.is_some(), "after {after}: served by a replica");
    assert!(
        router.decisions("routed").await >= 1,
        "after {after}: llmgw decided"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hostile_feed_message_is_refused_and_the_router_keeps_routing() {
    let a = sim("a", &["tiny"], 0, &[]);
    let b = sim("b", &["tiny"], 0, &[]);
    let grpc = free_port();
    let router = start_router(
        grpc,
        &[format!("tiny={}@n1", a.addr), format!("tiny={}@n2", b.addr)],
        &[],
    );
    router.wait_healthy(&[a.addr, b.addr]).await;
    let envoy = start_envoy("envoy.yaml", grpc, [a.addr, b.addr]).await;
    still_routing(&router, &envoy, "start").await;

    // One block of count u32::MAX, then two of 3e9 for one hash: refused over the ceiling.
    for (what, blocks) in [
        ("a count of u32::MAX", vec![pb::Block::copies(1, u32::MAX)]),
        (
            "two counts of 3e9",
            vec![
                pb::Block::copies(1, 3_000_000_000),
                pb::Block::copies(1, 3_000_000_000),
            ],
        ),
    ] {
        let mut feed = said_hello(router.feed, a.addr).await;
        let replies = feed
            .send(snapshot(blocks))
            .await
            .expect("the stream stays up");
        let reason =
            refusal(&replies).unwrap_or_else(|| panic!("{what}: not refused: {replies:?}"));
        assert!(reason.contains("over the ceiling"), "{what}: {reason}");
        assert!(blocks_of(&router, a.addr).await.is_empty(), "{what}");
        still_routing(&router, &envoy, what).await;
    }

    // A message far over the size limit is refused before it is decoded.
    let mut feed = said_hello(router.feed, a.addr).await;
    let huge: Vec<pb::Block> = (0..1_500_000u64).map(|h| pb::Block::copies(h, 1)).collect();
    let status = feed.send(snapshot(huge)).await.expect_err("too large");
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    still_routing(&router, &envoy, "an oversized message").await;

    // A stream breaking the protocol ends, unapplied.
    let mut feed = said_hello(router.feed, a.addr).await;
    let status = feed
        .send(pb::agent_message::Body::delta(
            "e1",
            1,
            vec![pb::Block::copies(5, 1)],
        ))
        .await
        .expect_err("a delta before the snapshot");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(blocks_of(&router, a.addr).await.is_empty());
    still_routing(&router, &envoy, "a protocol violation").await;

    // The real agent streams; an intruder claims its node; the agent comes back. No block of
    // the intruder remains, and the agent's later changes apply.
    let mut agent = said_hello(router.feed, a.addr).await;
    agent
        .send(snapshot(vec![
            pb::Block::copies(10, 1),
            pb::Block::copies(11, 1),
        ]))
        .await
        .expect("snapshot");
    assert_eq!(blocks_of(&router, a.addr).await, [10, 11]);
    let mut intruder = said_hello(router.feed, a.addr).await;
    intruder
        .send(snapshot(vec![pb::Block::copies(66, 1)]))
        .await
        .expect("snapshot");
    assert_eq!(blocks_of(&router, a.addr).await, [66]);
    let status = agent.ended().await;
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    let mut agent = said_hello(router.feed, a.addr).await;
    assert!(
        blocks_of(&router, a.addr).await.is_empty(),
        "the intruder's blocks are gone"
    );
    agent
        .send(snapshot(vec![
            pb::Block::copies(10, 1),
            pb::Block::copies(11, 1),
        ]))
        .await
        .expect("snapshot");
    agent
        .send(pb::agent_message::Body::delta(
            "e1",
            1,
            vec![pb::Block::copies(12, 1)],
        ))
        .await
        .expect("delta");
    assert_eq!(blocks_of(&router, a.addr).await, [10, 11, 12]);
    assert_eq!(intruder.ended().await.code(), Code::Aborted);
    still_routing(&router, &envoy, "a takeover").await;

    let metrics = router.metrics().await;
    for series in [
        "llmgw_feed_refused_total{reason=\"over_block_ceiling\"} 2",
        "llmgw_feed_violations_total{reason=\"delta_before_snapshot\"} 1",
        "llmgw_feed_takeovers_total 2",
    ] {
        assert!(metrics.contains(series), "{series} in\n{metrics}");
    }
}
