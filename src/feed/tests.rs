//! The feed service over real gRPC on loopback: what a hostile or broken agent sends ends its
//! own stream, with a status saying why, and never the router. The protocol's rules are tested
//! one by one (and against a model) in `state`.

use std::time::Duration;

use tokio::sync::mpsc;
use tonic::Code;

use super::*;
use crate::kvindex::{IndexConfig, KvIndex};

/// A feed service on 127.0.0.1:0 in front of a real index, node n1 owning r1.
async fn serve(token: Option<&str>) -> (SocketAddr, FeedService, Arc<KvIndex>) {
    let nodes = [("n1".to_owned(), ["r1:8000".to_owned()].into())].into();
    serve_config(FeedConfig {
        token: token.map(str::to_owned),
        nodes,
        grace: Duration::from_secs(30),
        limits: FeedLimits::default(),
        silence: Duration::ZERO,
    })
    .await
}

async fn serve_config(config: FeedConfig) -> (SocketAddr, FeedService, Arc<KvIndex>) {
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let svc = FeedService::new(Arc::clone(&index) as Arc<dyn KvEventSink>, config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(svc.clone().serve_with_listener(listener));
    (addr, svc, index)
}

/// One hand-driven agent stream.
struct Agent {
    tx: mpsc::Sender<pb::AgentMessage>,
    rx: Streaming<pb::RouterMessage>,
    next_id: u64,
}

impl Agent {
    async fn connect(addr: SocketAddr, token: Option<&str>) -> Result<Agent, Status> {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let (tx, rx) = mpsc::channel(16);
        let mut request = Request::new(ReceiverStream::new(rx));
        if let Some(token) = token {
            request
                .metadata_mut()
                .insert("authorization", format!("Bearer {token}").parse().unwrap());
        }
        let rx = pb::feed_client::FeedClient::new(channel)
            .max_encoding_message_size(usize::MAX)
            .stream(request)
            .await?
            .into_inner();
        Ok(Agent { tx, rx, next_id: 0 })
    }

    /// An agent that has said Hello (engine e1 of node n1) and sent a snapshot of `blocks`, one
    /// copy each.
    async fn synced(addr: SocketAddr, blocks: &[u64]) -> Agent {
        let mut agent = Agent::connect(addr, None).await.unwrap();
        agent.send(hello()).await.unwrap();
        let blocks = blocks.iter().map(|&h| pb::Block::copies(h, 1)).collect();
        agent.send(snapshot(blocks)).await.unwrap();
        agent
    }

    /// Sends `body` and reads the replies up to its acknowledgement, or the status that ended
    /// the stream.
    async fn send(
        &mut self,
        body: pb::agent_message::Body,
    ) -> Result<Vec<pb::RouterMessage>, Status> {
        self.next_id += 1;
        let id = self.next_id;
        self.tx
            .send(pb::AgentMessage::numbered(id, body))
            .await
            .map_err(|_| Status::cancelled("stream gone"))?;
        let mut replies = Vec::new();
        loop {
            let reply = tokio::time::timeout(Duration::from_secs(10), self.rx.message())
                .await
                .map_err(|_| Status::deadline_exceeded("no reply"))??
                .ok_or_else(|| Status::cancelled("stream closed"))?;
            let acked = matches!(reply.body, Some(pb::router_message::Body::Ack(pb::Ack { id: a })) if a == id);
            replies.push(reply);
            if acked {
                return Ok(replies);
            }
        }
    }

    /// The status the router ends the stream with.
    async fn ended(mut self) -> Status {
        loop {
            match tokio::time::timeout(Duration::from_secs(10), self.rx.message()).await {
                Ok(Ok(Some(_))) => {}
                Ok(Ok(None)) => return Status::ok("closed"),
                Ok(Err(status)) => return status,
                Err(_) => panic!("the router never ended the stream"),
            }
        }
    }
}

fn hello() -> pb::agent_message::Body {
    let engine = pb::EngineInfo::serving("e1", "r1:8000");
    pb::agent_message::Body::hello("n1", "test", vec![engine])
}

fn snapshot(blocks: Vec<pb::Block>) -> pb::agent_message::Body {
    pb::agent_message::Body::snapshot("e1", blocks)
}

/// Delta `seq` of engine e1 (epoch 0) storing one copy of each of `stored`.
fn delta(seq: u64, stored: &[u64]) -> pb::agent_message::Body {
    let stored = stored.iter().map(|&h| pb::Block::copies(h, 1)).collect();
    pb::agent_message::Body::delta("e1", seq, stored)
}

fn held(index: &KvIndex) -> Vec<u64> {
    index
        .replica_blocks("r1:8000")
        .into_iter()
        .map(|h| h.0)
        .collect()
}

#[tokio::test]
async fn a_count_of_u32_max_is_refused_and_the_router_keeps_serving() {
    let (addr, svc, index) = serve(None).await;
    // The reported attacks: one block of count u32::MAX, two of 3e9 for one hash.
    for blocks in [
        vec![pb::Block::copies(2, u32::MAX)],
        vec![
            pb::Block::copies(2, 3_000_000_000),
            pb::Block::copies(2, 3_000_000_000),
        ],
    ] {
        let mut agent = Agent::synced(addr, &[1]).await;
        assert_eq!(held(&index), [1]);
        let replies = agent.send(snapshot(blocks)).await.unwrap();
        let refused = replies.iter().find_map(|r| match &r.body {
            Some(pb::router_message::Body::Refused(f)) => Some(f.reason.clone()),
            _ => None,
        });
        assert!(
            refused
                .as_deref()
                .is_some_and(|r| r.contains("over the ceiling")),
            "{replies:?}"
        );
        assert!(held(&index).is_empty(), "the engine's blocks are dropped");
        // The stream stays open, the engine's later changes ignored.
        agent.send(delta(1, &[5])).await.unwrap();
        assert!(held(&index).is_empty());
    }
    assert_eq!(svc.metrics.refused_total(), 2);
    // A fresh stream resyncs the engine.
    let _agent = Agent::synced(addr, &[3]).await;
    assert_eq!(held(&index), [3]);
}

#[tokio::test]
async fn a_protocol_violation_ends_only_that_stream_with_invalid_argument() {
    let (addr, svc, index) = serve(None).await;
    let mut agent = Agent::connect(addr, None).await.unwrap();
    let status = agent.send(delta(1, &[1])).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("before_hello"), "{status:?}");
    assert_eq!(
        svc.metrics
            .violations
            .get_or_create(&ReasonLabel {
                reason: "before_hello"
            })
            .get(),
        1
    );
    assert!(held(&index).is_empty());
    // The router still serves other streams.
    let _agent = Agent::synced(addr, &[1]).await;
    assert_eq!(held(&index), [1]);
}

#[tokio::test]
async fn a_message_over_the_size_limit_is_refused_before_it_is_decoded() {
    let (addr, _svc, index) = serve(None).await;
    let mut agent = Agent::connect(addr, None).await.unwrap();
    agent.send(hello()).await.unwrap();
    // About 14 bytes a block: this is over MAX_MESSAGE_BYTES.
    let huge: Vec<pb::Block> = (0..(MAX_MESSAGE_BYTES / 10) as u64)
        .map(|h| pb::Block::copies(h, 1))
        .collect();
    let status = agent.send(snapshot(huge)).await.unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    assert!(held(&index).is_empty());
    let _agent = Agent::synced(addr, &[1]).await;
    assert_eq!(
        held(&index),
        [1],
        "the router is alive and applies the next stream"
    );
}

#[tokio::test]
async fn a_second_stream_for_a_node_takes_it_over_and_the_first_is_told_why() {
    let (addr, svc, index) = serve(None).await;
    let first = Agent::synced(addr, &[1, 2]).await;
    let mut second = Agent::connect(addr, None).await.unwrap();
    second.send(hello()).await.unwrap();
    assert!(
        held(&index).is_empty(),
        "no block of the first stream remains"
    );
    let status = first.ended().await;
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    assert!(status.message().contains("taken over"), "{status:?}");
    second
        .send(snapshot(vec![pb::Block::copies(7, 1)]))
        .await
        .unwrap();
    assert_eq!(held(&index), [7]);
    assert_eq!(svc.metrics.takeovers.get(), 1);
}

#[tokio::test]
async fn a_wrong_token_of_the_right_length_is_refused() {
    let (addr, _svc, _index) = serve(Some("s3cret-token")).await;
    for token in [
        None,
        Some("s3cret-tokeN"),
        Some("s3cret"),
        Some("s3cret-token-and-more"),
    ] {
        let status = match Agent::connect(addr, token).await {
            Err(status) => status,
            Ok(mut agent) => agent.send(hello()).await.unwrap_err(),
        };
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "{token:?}: {status:?}"
        );
    }
    let mut agent = Agent::connect(addr, Some("s3cret-token")).await.unwrap();
    agent.send(hello()).await.unwrap();
}

#[tokio::test]
async fn a_stream_silent_past_the_limit_is_ended_and_heartbeats_keep_one_open() {
    let silence = Duration::from_secs(1);
    let (addr, svc, index) = serve_config(FeedConfig {
        token: None,
        nodes: [("n1".to_owned(), ["r1:8000".to_owned()].into())].into(),
        grace: Duration::from_secs(30),
        limits: FeedLimits::default(),
        silence,
    })
    .await;
    let mut agent = Agent::synced(addr, &[1]).await;
    for _ in 0..8 {
        tokio::time::sleep(silence / 5).await;
        let heartbeat = pb::agent_message::Body::Heartbeat(pb::Heartbeat { unix_ms: 0 });
        agent
            .send(heartbeat)
            .await
            .expect("a stream that beats stays open");
    }
    assert!(svc.unsynced_nodes().is_empty());
    let status = agent.ended().await;
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert_eq!(
        svc.unsynced_nodes(),
        ["n1"],
        "the node lost its stream and waits for its agent"
    );
    assert_eq!(held(&index), [1], "its blocks stay for the grace period");
}

#[tokio::test]
async fn every_stream_of_a_reloaded_node_map_is_told_to_resync_however_many() {
    // More nodes than any fixed buffer of kicks would hold.
    let nodes = 100;
    let node_map = |replica_of: &dyn Fn(usize) -> String| -> NodeMap {
        (0..nodes)
            .map(|n| (format!("n{n}"), [replica_of(n)].into()))
            .collect()
    };
    let (addr, svc, _index) = serve_config(FeedConfig {
        token: None,
        nodes: node_map(&|n| format!("r{n}:8000")),
        grace: Duration::from_secs(30),
        limits: FeedLimits::default(),
        silence: Duration::ZERO,
    })
    .await;
    let mut agents = Vec::new();
    for n in 0..nodes {
        let mut agent = Agent::connect(addr, None).await.unwrap();
        let engine = pb::EngineInfo::serving("e1", &format!("r{n}:8000"));
        agent
            .send(pb::agent_message::Body::hello(
                &format!("n{n}"),
                "test",
                vec![engine],
            ))
            .await
            .unwrap();
        agents.push(agent);
    }
    assert!(svc.set_nodes(node_map(&|n| format!("r{n}:9000"))));
    for (n, agent) in agents.into_iter().enumerate() {
        let status = agent.ended().await;
        assert_eq!(status.code(), Code::Unavailable, "n{n}: {status:?}");
        assert!(
            status.message().contains("replicas changed"),
            "n{n}: {status:?}"
        );
    }
}

#[tokio::test]
async fn a_stream_waiting_for_the_feed_lock_leaves_the_runtime_free() {
    let (addr, svc, index) = serve(None).await;
    let mut agent = Agent::connect(addr, None).await.unwrap();
    agent.send(hello()).await.unwrap();
    // Another thread holds the feed's lock (as a long snapshot of another stream would) until
    // told to let go, or for 5 s.
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let state = Arc::clone(&svc.state);
    let holder = std::thread::spawn(move || {
        let _held = state.lock();
        locked_tx.send(()).unwrap();
        release_rx.recv_timeout(Duration::from_secs(5)).is_ok()
    });
    locked_rx.recv().unwrap();
    agent.next_id += 1;
    let snapshot =
        pb::AgentMessage::numbered(agent.next_id, snapshot(vec![pb::Block::copies(5, 1)]));
    agent.tx.send(snapshot).await.unwrap();
    // The stream now waits for the lock; this test's task shares the runtime with it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    // (Gone already if the holder gave up waiting.)
    let _ = release_tx.send(());
    assert!(
        holder.join().unwrap(),
        "the runtime was blocked while the stream waited for the lock"
    );
    let ack = tokio::time::timeout(Duration::from_secs(10), agent.rx.message())
        .await
        .unwrap()
        .unwrap();
    assert!(ack.is_some());
    assert_eq!(held(&index), [5]);
}
