//! A stand-in for vLLM's `ZmqEventPublisher`: a PUB socket sending `[topic, seq, payload]` and an
//! optional replay ROUTER answering `[b"", start_seq]` from a bounded buffer, in either reply
//! shape. Used by the tests and by `llmgw-agent publish-capture`, which replays a recorded
//! stream faithfully.
//!
//! # Concurrency model
//! The [`Publisher`] owns its PUB socket; the replay ROUTER runs in its own task and shares the
//! buffer through a `parking_lot::Mutex` (held only to copy out the requested items).

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend};

use super::{END_SEQ, ZmqError, multipart};

/// The replay reply layout, which changed in vLLM 0.26.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyShape {
    /// `[identity, b"", seq, payload]` (vLLM 0.9 – 0.25).
    WithoutTopic,
    /// `[identity, b"", topic, seq, payload]` (vLLM ≥ 0.26).
    WithTopic,
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// See the module docs.
pub struct Publisher {
    sock: PubSocket,
    topic: Bytes,
    buffer: Buffer,
    buffer_steps: usize,
    replay_task: Option<JoinHandle<()>>,
    /// The PUB endpoint (resolved when bound to port 0).
    pub endpoint: String,
    /// The replay endpoint (resolved when bound to port 0).
    pub replay_endpoint: Option<String>,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Some(t) = self.replay_task.take() {
            t.abort();
        }
    }
}

fn sock_err(action: &'static str, endpoint: &str) -> impl FnOnce(zeromq::ZmqError) -> ZmqError {
    let endpoint = endpoint.to_owned();
    move |source| ZmqError::Socket {
        action,
        endpoint,
        source,
    }
}

impl Publisher {
    /// A PUB bound on a free loopback port (vLLM's default mode) publishing `topic`, with a
    /// replay ROUTER on another when `replay`, keeping `buffer_steps` batches to replay.
    pub async fn on_loopback(
        topic: &str,
        replay: bool,
        buffer_steps: usize,
    ) -> Result<Publisher, ZmqError> {
        const ANY_PORT: &str = "tcp://127.0.0.1:0";
        let replay = replay.then_some(ANY_PORT);
        let shape = ReplyShape::WithTopic;
        Publisher::start(ANY_PORT, false, replay, topic, shape, buffer_steps).await
    }

    /// Binds the PUB at `endpoint` (vLLM's default mode) or connects it to an agent's bound SUB
    /// (`connect`), and binds a replay ROUTER at `replay` if given.
    pub async fn start(
        endpoint: &str,
        connect: bool,
        replay: Option<&str>,
        topic: &str,
        shape: ReplyShape,
        buffer_steps: usize,
    ) -> Result<Publisher, ZmqError> {
        let mut sock = PubSocket::new();
        let endpoint = if connect {
            sock.connect(endpoint)
                .await
                .map_err(sock_err("connect to", endpoint))?;
            endpoint.to_owned()
        } else {
            sock.bind(endpoint)
                .await
                .map_err(sock_err("bind", endpoint))?
                .to_string()
        };
        let buffer: Buffer = Arc::default();
        let topic = Bytes::copy_from_slice(topic.as_bytes());
        let (replay_endpoint, replay_task) = match replay {
            None => (None, None),
            Some(at) => {
                let mut router = RouterSocket::new();
                let bound = router
                    .bind(at)
                    .await
                    .map_err(sock_err("bind", at))?
                    .to_string();
                let task = tokio::spawn(serve_replay(
                    router,
                    Arc::clone(&buffer),
                    topic.clone(),
                    shape,
                ));
                (Some(bound), Some(task))
            }
        };
        Ok(Publisher {
            sock,
            topic,
            buffer,
            buffer_steps: buffer_steps.max(1),
            replay_task,
            endpoint,
            replay_endpoint,
        })
    }

    /// Buffers and publishes one batch.
    pub async fn publish(&mut self, seq: u64, payload: &[u8]) -> Result<(), ZmqError> {
        let payload = Bytes::copy_from_slice(payload);
        self.remember(seq, payload.clone());
        let msg = multipart(
            self.topic.clone(),
            [Bytes::copy_from_slice(&seq.to_be_bytes()), payload],
        );
        self.sock
            .send(msg)
            .await
            .map_err(sock_err("publish on", &self.endpoint))
    }

    /// Buffers a batch for replay without publishing it live (a message the network lost).
    pub fn publish_lost(&self, seq: u64, payload: &[u8]) {
        self.remember(seq, Bytes::copy_from_slice(payload));
    }

    /// Sends an arbitrary multipart message (for testing malformed input).
    pub async fn send_raw(&mut self, first: Bytes, rest: Vec<Bytes>) -> Result<(), ZmqError> {
        let msg = multipart(first, rest);
        self.sock
            .send(msg)
            .await
            .map_err(sock_err("publish on", &self.endpoint))
    }

    fn remember(&self, seq: u64, payload: Bytes) {
        let mut buf = self.buffer.lock();
        if buf.len() >= self.buffer_steps {
            buf.pop_front();
        }
        buf.push_back((seq, payload));
    }
}

async fn serve_replay(mut router: RouterSocket, buffer: Buffer, topic: Bytes, shape: ReplyShape) {
    loop {
        let Ok(request) = router.recv().await else {
            continue;
        };
        let frames = request.into_vec();
        // [identity, b"", start_seq]; anything else is ignored, as vLLM does.
        let [identity, empty, start] = frames.as_slice() else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
            continue;
        };
        if !empty.is_empty() {
            continue;
        }
        let items: Vec<(u64, Bytes)> = buffer
            .lock()
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        let reply = |seq: Bytes, payload: Bytes, topic: Bytes| {
            let mut f = vec![Bytes::new()];
            if shape == ReplyShape::WithTopic {
                f.push(topic);
            }
            f.extend([seq, payload]);
            multipart(identity.clone(), f)
        };
        for (seq, payload) in items {
            let frames = reply(
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
                topic.clone(),
            );
            let _ = router.send(frames).await;
        }
        let end = reply(Bytes::from_static(&END_SEQ), Bytes::new(), Bytes::new());
        let _ = router.send(end).await;
    }
}
