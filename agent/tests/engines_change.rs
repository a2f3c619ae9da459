//! The agent's engine set changing while it streams to a real router feed over gRPC: the
//! uplink opens a new stream whose Hello lists the new set, the router keeps what the kept
//! engines hold, learns the new engine's blocks and forgets the removed engine's.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test: a panic is a failed test"
)]

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use llmgw_agent::config::{AgentArgs, EngineConfig, EngineSpec};
use llmgw_agent::daemon::Agent;
use llmgw_agent::uplink::{self, UplinkConfig};
use llmgw_agent::wire::{BlockStored, EventBatch, EventForm, ExternalHash, KvEvent, encode_batch};
use llmgw_agent::zmq::Publisher;

mod support;
use support::*;

const FIRST: &str = "10.0.0.5:8000";
const SECOND: &str = "10.0.0.6:8000";

fn stored(hashes: &[u64]) -> Vec<u8> {
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.iter().map(|&h| ExternalHash(h)).collect(),
            ..BlockStored::default()
        })],
        dp_rank: Some(0),
    };
    encode_batch(&batch, EventForm::TaggedMap)
}

fn engine(replica: &str, publisher: &Publisher) -> EngineConfig {
    let spec: EngineSpec = format!("{replica}={}", publisher.endpoint)
        .parse()
        .expect("spec");
    spec.expand("kv").expect("expands").remove(0)
}

/// Publishes `hashes` (from `seq` on) until the router's index holds them for `replica`; PUB
/// drops messages until the agent's SUB has subscribed, which nothing reports.
async fn publish_until_indexed(
    publisher: &mut Publisher,
    seq: &mut u64,
    router: &Router,
    replica: &str,
    hashes: &[u64],
) {
    let want: HashSet<u64> = hashes.iter().copied().collect();
    for _ in 0..200 {
        if want.is_subset(&router.index.hashes(replica)) {
            return;
        }
        publisher
            .publish(*seq, &stored(hashes))
            .await
            .expect("publish");
        *seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "{replica}: router holds {:?}, want {want:?}",
        router.index.hashes(replica)
    );
}

#[tokio::test]
async fn engines_added_and_removed_reach_the_router_on_a_new_stream() {
    let router = serve_router(None, feed_for("n1", &[FIRST, SECOND], None)).await;

    let mut first = Publisher::on_loopback("kv", false, 100)
        .await
        .expect("publisher");
    let mut second = Publisher::on_loopback("kv", false, 100)
        .await
        .expect("publisher");
    let config = AgentArgs {
        node: Some("n1".into()),
        engines: vec![format!("{FIRST}={}", first.endpoint).parse().expect("spec")],
        topic: Some("kv".into()),
        stale_after_ms: Some(0),
        ..AgentArgs::default()
    }
    .resolve()
    .expect("config");
    let agent = Arc::new(Agent::start(config).await.expect("agent"));
    let mut cfg = UplinkConfig::new(router.addr.clone(), None);
    cfg.backoff_initial = Duration::from_millis(20);
    let uplink = tokio::spawn(uplink::run(Arc::clone(&agent), cfg));
    let (mut seq1, mut seq2) = (1, 1);
    publish_until_indexed(&mut first, &mut seq1, &router, FIRST, &[11, 12]).await;
    let snapshots_before = router.feed.metrics.snapshots.get();

    // A second engine: a new stream, on which the first engine's blocks are resent.
    let changes = agent
        .set_engines(vec![engine(FIRST, &first), engine(SECOND, &second)])
        .await;
    assert_eq!(changes.added, [SECOND]);
    eventually("a new stream's snapshots", || {
        router.feed.metrics.snapshots.get() > snapshots_before
    })
    .await;
    publish_until_indexed(&mut second, &mut seq2, &router, SECOND, &[21]).await;
    publish_until_indexed(&mut first, &mut seq1, &router, FIRST, &[13]).await;
    assert_eq!(
        router.index.hashes(FIRST),
        [11, 12, 13].into_iter().collect(),
        "the kept engine's mirror went on"
    );

    // The first engine goes: the router forgets its blocks, the second's stay.
    let changes = agent.set_engines(vec![engine(SECOND, &second)]).await;
    assert_eq!(changes.removed, [FIRST]);
    eventually("the removed engine forgotten", || {
        router.index.hashes(FIRST).is_empty()
    })
    .await;
    publish_until_indexed(&mut second, &mut seq2, &router, SECOND, &[22]).await;
    assert_eq!(router.index.hashes(SECOND), [21, 22].into_iter().collect());
    assert_eq!(
        router.feed.metrics.violations_total(),
        0,
        "no stream broke the protocol"
    );
    assert_eq!(
        uplink_errors_of(&agent, &router.addr),
        0,
        "no session failed"
    );
    uplink.abort();
}

fn uplink_errors_of(agent: &Agent, router: &str) -> u64 {
    let series = format!("llmgw_agent_uplink_errors_total{{router=\"{router}\",");
    agent
        .metrics
        .encode()
        .lines()
        .filter_map(|l| l.strip_prefix(series.as_str()))
        .filter_map(|rest| rest.rsplit_once(' '))
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .sum::<f64>() as u64
}
