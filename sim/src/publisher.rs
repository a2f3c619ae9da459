//! The KV-event publisher: vLLM's `ZmqEventPublisher` on pure-Rust ZeroMQ.
//!
//! * A PUB socket sends each batch as three frames: topic, 8-byte big-endian sequence number
//!   (from 0, +1 per batch), msgpack payload. It binds when the endpoint has `*` (or `::`),
//!   and connects otherwise, as vLLM decides. `tcp://*:0` and `tcp://127.0.0.1:*` bind an
//!   OS-chosen port; [`Bound`] reports what was bound.
//! * An optional ROUTER (always bound) answers replay requests `[identity, "", start_seq]` with
//!   every buffered batch whose seq ≥ start_seq, then vLLM's end marker (seq
//!   `ff ff ff ff ff ff ff ff`, empty payload). The buffer keeps the last `buffer_steps`
//!   batches. Replies carry a topic frame as vLLM ≥ 0.26 does, or none (≤ 0.25).
//! * Faults: sequence numbers in a *drop* range are consumed but not sent on the PUB socket
//!   (a slow-subscriber drop); they stay in the replay buffer, so a subscriber can detect the gap
//!   and recover by replay. An engine restart resets the sequence to 0 and empties the buffer.
//!
//! Concurrency: one task owns the PUB socket and the sequence counter and reads batches from
//! the engine's bounded channel (a full channel stalls the engine, like vLLM's blocking
//! queue); one task owns the ROUTER socket. They share the replay buffer and the drop ranges
//! through `parking_lot` mutexes held only for short, non-async sections.

use std::collections::VecDeque;
use std::ops::RangeInclusive;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::engine::EngineEvent;
use crate::events::Encoding;

/// vLLM's replay end marker: `(-1).to_bytes(8, "big", signed=True)`.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// `--kv-events-config`, vLLM's `KVEventsConfig` (unknown fields are ignored).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct KvEventsConfig {
    pub enable_kv_cache_events: bool,
    pub publisher: Option<String>,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub buffer_steps: usize,
    /// Accepted for compatibility; the pure-Rust PUB socket has its own per-peer queue.
    pub hwm: usize,
    pub max_queue_size: usize,
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    /// Whether a ZMQ publisher runs (events enabled and the publisher not `"null"`).
    pub fn publishes(&self) -> bool {
        self.enable_kv_cache_events && self.publisher.as_deref() != Some("null")
    }
}

/// Publisher errors (all at startup).
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    #[error("unsupported KV-events endpoint {0:?}: llmgw-sim speaks tcp:// only")]
    Endpoint(String),
    #[error("cannot bind {endpoint}: {source}")]
    Bind {
        endpoint: String,
        source: zeromq::ZmqError,
    },
    #[error("unknown publisher {0:?}: expected zmq or null")]
    Publisher(String),
}

/// Live fault switches shared with the admin endpoint.
#[derive(Debug, Default)]
pub struct Faults {
    drop: Mutex<Vec<RangeInclusive<u64>>>,
}

impl Faults {
    pub fn drop_seqs(&self, range: RangeInclusive<u64>) {
        self.drop.lock().push(range);
    }

    fn dropped(&self, seq: u64) -> bool {
        self.drop.lock().iter().any(|r| r.contains(&seq))
    }
}

/// Where the sockets ended up (loopback-friendly: `0.0.0.0` shown as `127.0.0.1`).
#[derive(Debug, Clone, Default)]
pub struct Bound {
    /// The bound PUB endpoint; `None` when the PUB socket connects.
    pub publisher: Option<String>,
    pub replay: Option<String>,
}

enum Mode {
    Bind(String),
    Connect(String),
}

fn parse_endpoint(endpoint: &str) -> Result<Mode, PublisherError> {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return Err(PublisherError::Endpoint(endpoint.to_owned()));
    };
    let bind = endpoint.contains('*') || endpoint.contains("::");
    let Some((host, port)) = rest.rsplit_once(':') else {
        return Err(PublisherError::Endpoint(endpoint.to_owned()));
    };
    let host = if host == "*" { "0.0.0.0" } else { host };
    let port = if port == "*" { "0" } else { port };
    if port.parse::<u16>().is_err() {
        return Err(PublisherError::Endpoint(endpoint.to_owned()));
    }
    let addr = format!("tcp://{host}:{port}");
    Ok(if bind {
        Mode::Bind(addr)
    } else {
        Mode::Connect(addr)
    })
}

fn bind_addr(endpoint: &str) -> Result<String, PublisherError> {
    match parse_endpoint(endpoint)? {
        Mode::Bind(a) | Mode::Connect(a) => Ok(a),
    }
}

fn shown(endpoint: &zeromq::Endpoint) -> String {
    endpoint.to_string().replace("0.0.0.0", "127.0.0.1")
}

struct ReplayBuffer {
    items: VecDeque<(u64, Bytes)>,
    cap: usize,
}

impl ReplayBuffer {
    fn push(&mut self, seq: u64, payload: Bytes) {
        if self.cap == 0 {
            return;
        }
        if self.items.len() == self.cap {
            self.items.pop_front();
        }
        self.items.push_back((seq, payload));
    }
}

/// Publisher settings derived from the CLI.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    pub events: KvEventsConfig,
    pub encoding: Encoding,
    /// Replay replies carry a topic frame (vLLM ≥ 0.26).
    pub replay_topic_frame: bool,
}

/// Binds (or starts connecting) the sockets and starts the publisher tasks.
pub async fn start(
    cfg: PublisherConfig,
    rx: mpsc::Receiver<EngineEvent>,
    faults: Arc<Faults>,
) -> Result<Bound, PublisherError> {
    if let Some(p) = cfg.events.publisher.as_deref()
        && p != "zmq"
        && p != "null"
    {
        return Err(PublisherError::Publisher(p.to_owned()));
    }
    let bound_failed = |addr: &str| {
        let endpoint = addr.to_owned();
        move |source| PublisherError::Bind { endpoint, source }
    };
    let mut bound = Bound::default();
    let mut socket = zeromq::PubSocket::new();
    let connect = match parse_endpoint(&cfg.events.endpoint)? {
        Mode::Bind(addr) => {
            let ep = socket.bind(&addr).await.map_err(bound_failed(&addr))?;
            bound.publisher = Some(shown(&ep));
            None
        }
        Mode::Connect(addr) => Some(addr),
    };
    let buffer = Arc::new(Mutex::new(ReplayBuffer {
        items: VecDeque::new(),
        cap: cfg.events.buffer_steps,
    }));
    let topic = Bytes::from(cfg.events.topic.clone().into_bytes());
    if let Some(replay) = &cfg.events.replay_endpoint {
        let addr = bind_addr(replay)?;
        let mut router = zeromq::RouterSocket::new();
        let ep = router.bind(&addr).await.map_err(bound_failed(&addr))?;
        bound.replay = Some(shown(&ep));
        let topic = cfg.replay_topic_frame.then(|| topic.clone());
        tokio::spawn(serve_replay(router, Arc::clone(&buffer), topic));
    }
    let publisher = Publisher {
        socket,
        seq: 0,
        buffer,
        faults,
        topic,
        encoding: cfg.encoding,
    };
    tokio::spawn(publisher.run(rx, connect));
    Ok(bound)
}

struct Publisher {
    socket: zeromq::PubSocket,
    seq: u64,
    buffer: Arc<Mutex<ReplayBuffer>>,
    faults: Arc<Faults>,
    topic: Bytes,
    encoding: Encoding,
}

impl Publisher {
    async fn run(mut self, mut rx: mpsc::Receiver<EngineEvent>, connect: Option<String>) {
        if let Some(addr) = connect {
            // Batches published before the peer is reachable are lost on the wire (but
            // consume their sequence numbers and stay replayable), as with a real PUB socket.
            let mut pending = Vec::new();
            {
                let connecting = self.socket.connect(&addr);
                tokio::pin!(connecting);
                loop {
                    tokio::select! {
                        result = &mut connecting => {
                            if let Err(e) = result {
                                tracing::error!("kv-events connect to {addr} failed: {e}");
                            }
                            break;
                        }
                        event = rx.recv() => match event {
                            Some(event) => pending.push(event),
                            None => return,
                        },
                    }
                }
            }
            for event in pending {
                self.record(event);
            }
        }
        while let Some(event) = rx.recv().await {
            if let Some(msg) = self.record(event)
                && let Err(e) = self.socket.send(msg).await
            {
                tracing::warn!("kv-events publish failed: {e}");
            }
        }
    }

    /// Numbers and buffers one engine event; returns the PUB message to send, if any.
    fn record(&mut self, event: EngineEvent) -> Option<ZmqMessage> {
        match event {
            EngineEvent::Restart => {
                self.seq = 0;
                self.buffer.lock().items.clear();
                None
            }
            EngineEvent::Batch(batch) => {
                let payload = Bytes::from(batch.encode(self.encoding));
                let seq = self.seq;
                self.seq += 1;
                self.buffer.lock().push(seq, payload.clone());
                if self.faults.dropped(seq) {
                    return None;
                }
                let frames = vec![
                    self.topic.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ];
                ZmqMessage::try_from(frames).ok()
            }
        }
    }
}

async fn serve_replay(
    mut router: zeromq::RouterSocket,
    buffer: Arc<Mutex<ReplayBuffer>>,
    topic: Option<Bytes>,
) {
    loop {
        let msg = match router.recv().await {
            Ok(msg) => msg,
            Err(e) => {
                tracing::warn!("replay socket: {e}");
                continue;
            }
        };
        let frames = msg.into_vec();
        let start = match frames.as_slice() {
            [_, _, seq] if seq.len() == 8 => {
                let mut be = [0u8; 8];
                be.copy_from_slice(seq);
                u64::from_be_bytes(be)
            }
            _ => {
                tracing::warn!("Invalid replay request: {} frames", frames.len());
                continue;
            }
        };
        let identity = frames[0].clone();
        let items: Vec<(u64, Bytes)> = buffer
            .lock()
            .items
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let reply = |seq: Bytes, payload: Bytes, end: bool| {
            let mut f = vec![identity.clone(), Bytes::new()];
            if let Some(topic) = &topic {
                f.push(if end { Bytes::new() } else { topic.clone() });
            }
            f.push(seq);
            f.push(payload);
            ZmqMessage::try_from(f).ok()
        };
        for (seq, payload) in items {
            if let Some(m) = reply(Bytes::copy_from_slice(&seq.to_be_bytes()), payload, false)
                && router.send(m).await.is_err()
            {
                break;
            }
        }
        if let Some(m) = reply(Bytes::from_static(&END_SEQ), Bytes::new(), true) {
            let _ = router.send(m).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_bind_with_a_star_and_connect_without() {
        assert!(
            matches!(parse_endpoint("tcp://*:5557"), Ok(Mode::Bind(a)) if a == "tcp://0.0.0.0:5557")
        );
        assert!(
            matches!(parse_endpoint("tcp://127.0.0.1:*"), Ok(Mode::Bind(a)) if a == "tcp://127.0.0.1:0")
        );
        assert!(
            matches!(parse_endpoint("tcp://10.0.0.5:5557"), Ok(Mode::Connect(a)) if a == "tcp://10.0.0.5:5557")
        );
        assert!(parse_endpoint("ipc:///tmp/kv").is_err());
        assert!(parse_endpoint("tcp://host:port").is_err());
    }

    #[test]
    fn kv_events_config_reads_vllms_json() {
        let cfg: KvEventsConfig = serde_json::from_str(
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
                "replay_endpoint":"tcp://*:5558","topic":"kv@10.0.0.5:8000@M","buffer_steps":4,
                "unknown_field":1}"#,
        )
        .unwrap();
        assert!(cfg.publishes());
        assert_eq!(cfg.buffer_steps, 4);
        assert_eq!(cfg.max_queue_size, 100_000);
        assert_eq!(cfg.replay_endpoint.as_deref(), Some("tcp://*:5558"));
        let off: KvEventsConfig = serde_json::from_str("{}").unwrap();
        assert!(!off.publishes());
    }

    #[test]
    fn replay_buffer_keeps_the_last_buffer_steps() {
        let mut b = ReplayBuffer {
            items: VecDeque::new(),
            cap: 2,
        };
        for seq in 0..5 {
            b.push(seq, Bytes::new());
        }
        let seqs: Vec<u64> = b.items.iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, vec![3, 4]);
        let mut none = ReplayBuffer {
            items: VecDeque::new(),
            cap: 0,
        };
        none.push(0, Bytes::new());
        assert!(none.items.is_empty());
    }
}
