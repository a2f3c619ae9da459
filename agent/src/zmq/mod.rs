//! Event intake: one ZMQ SUB socket per engine, sequence tracking, and replay over DEALER.
//!
//! The wire contract is vLLM's (../shared/reference/vllm.md §1): each message is `[topic,
//! seq (8 bytes big-endian), payload]`; `seq` counts batches from 0 for the life of the
//! publisher. A jump is a gap: the missing batches are asked of the engine's replay ROUTER
//! (`[b"", start_seq]` from a DEALER; replies `[b"", seq, payload]` before vLLM 0.26 and
//! `[b"", topic, seq, payload]` from 0.26, then an end marker whose seq is all ones). A first
//! replayed seq above the one asked, a replay that fails or times out, or no replay endpoint at
//! all resets the engine. A seq going backwards means the engine restarted: reset, and replay
//! the new life's batches from 0 up to the first one heard (vLLM buffers them; they went by while
//! the SUB was reconnecting). The first batch heard at all, if above 0, is replayed from 0 too,
//! and with a replay socket the intake asks for everything buffered from 0 as soon as it starts,
//! so an engine idle since before the agent started is mirrored without waiting for its next
//! batch.
//! Messages that are not 3 frames are counted and dropped.
//!
//! # Concurrency model
//! [`Intake::run`] is one task per engine owning its SUB socket (and, during a replay, a
//! short-lived DEALER); it never touches shared state, only sends ordered [`Input`]s to the
//! engine's mirror task over a bounded `mpsc` (back-pressure reaches the socket, whose
//! high-water mark then drops, which shows up as a gap).

mod publisher;
mod seq;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt as _;
use futures::channel::mpsc as mpsc_futures;
use tokio::sync::mpsc;
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

pub use publisher::{Publisher, ReplyShape};
pub use seq::{SeqTracker, SeqVerdict};

use crate::engine::{Input, ResetReason};
use crate::metrics::Metrics;
use crate::wire::decode_batch;

/// The replay end marker's seq frame: `(-1).to_bytes(8, "big", signed=True)`.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// How long a whole replay may take before the engine is reset instead.
pub const DEFAULT_REPLAY_TIMEOUT: Duration = Duration::from_secs(3);

/// Errors of the intake.
#[derive(Debug, thiserror::Error)]
pub enum ZmqError {
    #[error("cannot {action} {endpoint}: {source}")]
    Socket {
        action: &'static str,
        endpoint: String,
        #[source]
        source: zeromq::ZmqError,
    },
    #[error("replay from {endpoint} timed out after {0:?}", timeout)]
    ReplayTimeout { endpoint: String, timeout: Duration },
    #[error("replay from {endpoint}: {what}")]
    ReplayReply { endpoint: String, what: String },
    #[error("the engine's mirror task has stopped")]
    MirrorGone,
}

/// Where and how to receive one engine's events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineEndpoint {
    /// `tcp://HOST:PORT`.
    pub endpoint: String,
    /// Bind the SUB (vLLM connects) rather than connect to vLLM's bound PUB.
    pub bind: bool,
    /// vLLM's replay ROUTER, if it has one.
    pub replay: Option<String>,
    /// Topic prefix filter ("" for all).
    pub topic: String,
}

/// How long one attempt to reach a connect-mode engine may take before the next.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(1);

/// Opens the SUB socket; returns it with the endpoint actually bound (port 0 resolved) when
/// binding. Connecting waits for the engine to accept, at most zeromq's default 30 s: use
/// [`open_when_ready`] for an engine that may not be listening yet.
pub async fn open(ep: &EngineEndpoint) -> Result<(SubSocket, Option<String>), ZmqError> {
    open_with(ep, SubSocket::new()).await
}

/// [`open`] for an engine that may not listen yet (vLLM takes a minute or more to start, and
/// `llmgw-agent run` starts it only after the agent is up): connecting retries, briefly and
/// forever, until the engine's PUB accepts. Binding fails at once, as with [`open`].
pub async fn open_when_ready(ep: &EngineEndpoint) -> Result<(SubSocket, Option<String>), ZmqError> {
    if ep.bind {
        return open(ep).await;
    }
    let started = tokio::time::Instant::now();
    let mut announced = false;
    loop {
        // zeromq's own connect backs off up to 30 s between attempts; short attempts of our
        // own catch the engine within about a second of it binding.
        let mut options = zeromq::SocketOptions::default();
        options.connect_timeout(CONNECT_ATTEMPT);
        match open_with(ep, SubSocket::with_options(options)).await {
            Ok(opened) => {
                if announced {
                    tracing::info!(endpoint = ep.endpoint, waited = ?started.elapsed(), "engine's PUB reached");
                }
                return Ok(opened);
            }
            Err(e) => {
                if !announced {
                    tracing::info!(endpoint = ep.endpoint, error = %e, "engine's PUB not reachable yet (starting?): retrying");
                    announced = true;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn open_with(
    ep: &EngineEndpoint,
    mut sock: SubSocket,
) -> Result<(SubSocket, Option<String>), ZmqError> {
    let bound = if ep.bind {
        let at = sock
            .bind(&ep.endpoint)
            .await
            .map_err(|source| ZmqError::Socket {
                action: "bind",
                endpoint: ep.endpoint.clone(),
                source,
            })?;
        Some(at.to_string())
    } else {
        sock.connect(&ep.endpoint)
            .await
            .map_err(|source| ZmqError::Socket {
                action: "connect to",
                endpoint: ep.endpoint.clone(),
                source,
            })?;
        None
    };
    sock.subscribe(&ep.topic)
        .await
        .map_err(|source| ZmqError::Socket {
            action: "subscribe on",
            endpoint: ep.endpoint.clone(),
            source,
        })?;
    Ok((sock, bound))
}

/// One engine's intake task.
pub struct Intake {
    pub engine: Arc<str>,
    pub endpoint: EngineEndpoint,
    pub inputs: mpsc::Sender<Input>,
    pub metrics: Arc<Metrics>,
    pub replay_timeout: Duration,
}

/// The next event of a socket monitor; never, without one.
async fn next_event(
    events: &mut Option<mpsc_futures::Receiver<SocketEvent>>,
) -> Option<SocketEvent> {
    match events {
        Some(rx) => rx.next().await,
        None => std::future::pending().await,
    }
}

/// What [`Subscription::next`] heard.
pub enum Heard {
    Message(ZmqMessage),
    /// A receive failed; the socket stays open.
    Failed(zeromq::ZmqError),
    /// The engine's PUB disconnected and the SUB has dialled it afresh.
    Redialled,
}

/// A SUB that dials afresh when its connect-mode engine disconnects. zeromq re-dials a lost
/// connect-mode peer with a backoff that grows to 30 s, so a restarted vLLM's first batches
/// went by unheard (seen with `make e2e-vllm`). A bound SUB waits for vLLM, which re-dials
/// every 100 ms.
pub struct Subscription {
    endpoint: EngineEndpoint,
    sock: SubSocket,
    events: Option<mpsc_futures::Receiver<SocketEvent>>,
}

impl Subscription {
    /// Receives on `sock`, opened for `endpoint`.
    pub fn new(endpoint: EngineEndpoint, mut sock: SubSocket) -> Subscription {
        let events = (!endpoint.bind).then(|| sock.monitor());
        Subscription {
            endpoint,
            sock,
            events,
        }
    }

    /// The next message, failure or re-dial. Errs only when the engine cannot be dialled again.
    pub async fn next(&mut self) -> Result<Heard, ZmqError> {
        loop {
            tokio::select! {
                r = self.sock.recv() => {
                    return Ok(r.map_or_else(Heard::Failed, Heard::Message));
                }
                Some(event) = next_event(&mut self.events) => {
                    if matches!(event, SocketEvent::Disconnected(_)) {
                        break;
                    }
                }
            }
        }
        // Dropping the old socket first stops its own slow re-dialling.
        drop(std::mem::replace(&mut self.sock, SubSocket::new()));
        (self.sock, _) = open_when_ready(&self.endpoint).await?;
        self.events = Some(self.sock.monitor());
        Ok(Heard::Redialled)
    }
}

/// One message split into its seq and payload.
struct Message {
    seq: u64,
    payload: Bytes,
}

impl Intake {
    /// Receives until the socket fails or the mirror task stops.
    pub async fn run(self, sock: SubSocket) -> Result<(), ZmqError> {
        let mut tracker = SeqTracker::default();
        let mut subscription = Subscription::new(self.endpoint.clone(), sock);
        self.replay_at_start(&mut tracker).await?;
        loop {
            let msg = match subscription.next().await? {
                Heard::Message(m) => m,
                Heard::Failed(e) => {
                    tracing::warn!(engine = &*self.engine, error = %e, "SUB receive failed");
                    continue;
                }
                Heard::Redialled => {
                    tracing::info!(
                        engine = &*self.engine,
                        endpoint = self.endpoint.endpoint,
                        "engine's PUB disconnected: dialled afresh"
                    );
                    continue;
                }
            };
            let Some(msg) = self.split(msg) else { continue };
            match tracker.observe(msg.seq) {
                // First contact mid-stream: the mirror is empty and vLLM may still buffer the
                // batches from 0, so ask for them rather than start from a partial state.
                SeqVerdict::InOrder
                    if tracker.expected().is_none()
                        && msg.seq > 0
                        && self.endpoint.replay.is_some() =>
                {
                    tracing::info!(
                        engine = &*self.engine,
                        seq = msg.seq,
                        "first batch heard is not seq 0: replaying from 0"
                    );
                    tracker = SeqTracker::expecting(0);
                    self.fill_gap(&mut tracker, 0, msg, true).await?;
                }
                SeqVerdict::InOrder => {
                    self.deliver(msg.seq, &msg.payload).await?;
                    tracker.applied(msg.seq);
                }
                SeqVerdict::Duplicate => {}
                SeqVerdict::Restart { expected } => {
                    tracing::warn!(
                        engine = &*self.engine,
                        seq = msg.seq,
                        expected,
                        "sequence went backwards: engine restarted"
                    );
                    self.reset(ResetReason::Restart).await?;
                    // The new life counts from 0: batches before the first one heard are a gap.
                    tracker = SeqTracker::expecting(0);
                    if msg.seq == 0 {
                        self.deliver(msg.seq, &msg.payload).await?;
                        tracker.applied(msg.seq);
                    } else {
                        self.count_gap(0, msg.seq);
                        self.fill_gap(&mut tracker, 0, msg, true).await?;
                    }
                }
                SeqVerdict::Gap { from } => {
                    self.count_gap(from, msg.seq);
                    self.fill_gap(&mut tracker, from, msg, false).await?;
                }
            }
        }
    }

    /// An engine may have cached blocks before this agent started and then publish nothing for
    /// long (an idle replica), so waiting for its first live batch would leave the mirror empty
    /// meanwhile: with a replay socket, ask for everything buffered from 0 at once. The SUB is
    /// already subscribed, so batches published during the replay arrive after it (as
    /// duplicates, or as a gap filled as usual). A buffer that no longer starts at 0 is left to
    /// the first live batch, as without replay.
    async fn replay_at_start(&self, tracker: &mut SeqTracker) -> Result<(), ZmqError> {
        let Some(ep) = &self.endpoint.replay else {
            return Ok(());
        };
        let items = match replay(ep, 0, self.replay_timeout).await {
            Ok(items) => items,
            Err(e) => {
                tracing::info!(engine = &*self.engine, error = %e, "no replay at start");
                return Ok(());
            }
        };
        if items.first().is_none_or(|(seq, _)| *seq != 0) {
            return Ok(());
        }
        let mut next = SeqTracker::expecting(0);
        for (seq, payload) in items {
            if !matches!(next.observe(seq), SeqVerdict::InOrder) {
                break;
            }
            self.deliver(seq, &payload).await?;
            next.applied(seq);
        }
        tracing::info!(
            engine = &*self.engine,
            upto = next.expected().unwrap_or(0),
            "replayed the engine's buffered batches at start"
        );
        self.count_replay("at_start");
        *tracker = next;
        Ok(())
    }

    fn count_gap(&self, from: u64, to: u64) {
        self.metrics
            .gaps
            .get_or_create(&Metrics::engine(&self.engine))
            .inc();
        tracing::warn!(engine = &*self.engine, from, to, "sequence gap");
    }

    /// Validates the frames; counts and drops anything that is not a vLLM message.
    fn split(&self, msg: ZmqMessage) -> Option<Message> {
        let frames = msg.into_vec();
        let parsed = match frames.as_slice() {
            [_topic, seq, payload] => seq_of(seq).map(|seq| Message {
                seq,
                payload: payload.clone(),
            }),
            _ => None,
        };
        if parsed.is_none() {
            self.metrics
                .bad_messages
                .get_or_create(&Metrics::engine(&self.engine))
                .inc();
            tracing::warn!(
                engine = &*self.engine,
                frames = frames.len(),
                "dropping a message that is not [topic, 8-byte seq, payload]"
            );
        }
        parsed
    }

    async fn send(&self, input: Input) -> Result<(), ZmqError> {
        self.inputs
            .send(input)
            .await
            .map_err(|_| ZmqError::MirrorGone)
    }

    async fn reset(&self, reason: ResetReason) -> Result<(), ZmqError> {
        self.send(Input::Reset(reason)).await
    }

    /// Decodes and forwards one batch; an undecodable one resets the engine.
    async fn deliver(&self, seq: u64, payload: &[u8]) -> Result<(), ZmqError> {
        let span = crate::engine::batch_span(&self.engine, seq);
        let decoded = tracing::debug_span!(parent: &span, "decode", bytes = payload.len() as i64)
            .in_scope(|| decode_batch(payload));
        match decoded {
            Ok(batch) => {
                span.record("events", batch.events.len() as i64);
                self.send(Input::Batch { seq, batch, span }).await
            }
            Err(e) => {
                self.metrics
                    .decode_errors
                    .get_or_create(&Metrics::engine(&self.engine))
                    .inc();
                tracing::error!(
                    engine = &*self.engine,
                    seq,
                    error = %e,
                    payload_len = payload.len(),
                    "undecodable KV-event batch: its changes are lost, resetting the engine"
                );
                self.reset(ResetReason::Decode).await
            }
        }
    }

    /// Fills `from..live.seq` by replay, then applies `live`. `clean`: the mirror was reset and
    /// nothing applied since, so a loss needs no second reset.
    async fn fill_gap(
        &self,
        tracker: &mut SeqTracker,
        from: u64,
        live: Message,
        mut clean: bool,
    ) -> Result<(), ZmqError> {
        let replayed = match &self.endpoint.replay {
            None => None,
            Some(ep) => match replay(ep, from, self.replay_timeout).await {
                Ok(items) => Some(items),
                Err(e) => {
                    tracing::warn!(engine = &*self.engine, error = %e, "replay failed");
                    self.count_replay("failed");
                    None
                }
            },
        };
        let Some(items) = replayed else {
            if !clean {
                self.reset(ResetReason::Gap).await?;
            }
            self.deliver(live.seq, &live.payload).await?;
            tracker.restart_at(live.seq);
            return Ok(());
        };
        let mut lost = false;
        for (seq, payload) in items {
            match tracker.observe(seq) {
                SeqVerdict::InOrder => {
                    self.deliver(seq, &payload).await?;
                    tracker.applied(seq);
                    clean = false;
                }
                SeqVerdict::Duplicate | SeqVerdict::Restart { .. } => {}
                SeqVerdict::Gap { .. } => {
                    // vLLM no longer buffers what was asked for: the loss is permanent.
                    lost = true;
                    if !std::mem::take(&mut clean) {
                        self.reset(ResetReason::Gap).await?;
                    }
                    self.deliver(seq, &payload).await?;
                    tracker.restart_at(seq);
                }
            }
        }
        // The live message that revealed the gap, unless the replay already carried it.
        match tracker.observe(live.seq) {
            SeqVerdict::InOrder => {
                self.deliver(live.seq, &live.payload).await?;
                tracker.applied(live.seq);
            }
            SeqVerdict::Gap { .. } => {
                // The replay ended short of it (nothing buffered, or a gap at its end).
                lost = true;
                if !clean {
                    self.reset(ResetReason::Gap).await?;
                }
                self.deliver(live.seq, &live.payload).await?;
                tracker.restart_at(live.seq);
            }
            SeqVerdict::Duplicate | SeqVerdict::Restart { .. } => {}
        }
        self.count_replay(if lost { "loss" } else { "filled" });
        // Live messages queued during the replay down to this one are duplicates now.
        tracker.allow_duplicates_from(live.seq);
        Ok(())
    }

    fn count_replay(&self, outcome: &str) {
        self.metrics
            .replays
            .get_or_create(&Metrics::reason(&self.engine, outcome))
            .inc();
    }
}

/// A message of `first` and then `rest` (infallible, unlike `ZmqMessage::try_from(Vec)`).
pub(crate) fn multipart(first: Bytes, rest: impl IntoIterator<Item = Bytes>) -> ZmqMessage {
    let mut msg = ZmqMessage::from(first);
    for frame in rest {
        msg.push_back(frame);
    }
    msg
}

fn seq_of(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

/// Asks a vLLM replay ROUTER for every buffered batch from `from` on; returns them in order.
pub async fn replay(
    endpoint: &str,
    from: u64,
    timeout: Duration,
) -> Result<Vec<(u64, Bytes)>, ZmqError> {
    tokio::time::timeout(timeout, replay_inner(endpoint, from))
        .await
        .map_err(|_| ZmqError::ReplayTimeout {
            endpoint: endpoint.to_owned(),
            timeout,
        })?
}

async fn replay_inner(endpoint: &str, from: u64) -> Result<Vec<(u64, Bytes)>, ZmqError> {
    let sock_err = |action: &'static str| {
        move |source| ZmqError::Socket {
            action,
            endpoint: endpoint.to_owned(),
            source,
        }
    };
    let mut dealer = DealerSocket::new();
    dealer
        .connect(endpoint)
        .await
        .map_err(sock_err("connect to"))?;
    let request = multipart(Bytes::new(), [Bytes::copy_from_slice(&from.to_be_bytes())]);
    dealer.send(request).await.map_err(sock_err("send to"))?;
    let mut out = Vec::new();
    loop {
        let reply = dealer.recv().await.map_err(sock_err("receive from"))?;
        let mut frames = reply.into_vec();
        if frames.first().is_some_and(|f| f.is_empty()) {
            frames.remove(0);
        }
        // ≤ 0.25: [seq, payload]; ≥ 0.26: [topic, seq, payload].
        let (seq, payload) = match frames.as_slice() {
            [seq, payload] | [_, seq, payload] => (seq, payload),
            _ => {
                return Err(ZmqError::ReplayReply {
                    endpoint: endpoint.to_owned(),
                    what: format!("a reply of {} frames", frames.len()),
                });
            }
        };
        if seq.as_ref() == END_SEQ {
            return Ok(out);
        }
        let Some(seq) = seq_of(seq) else {
            return Err(ZmqError::ReplayReply {
                endpoint: endpoint.to_owned(),
                what: format!("a seq frame of {} bytes", seq.len()),
            });
        };
        out.push((seq, payload.clone()));
    }
}
