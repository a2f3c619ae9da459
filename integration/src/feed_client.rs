//! A hand-driven agent stream on a router's feed port, for tests and the soak: send one
//! message, read the router's replies up to its acknowledgement or the status that ended the
//! stream. Test-support code: it panics when the router does not answer in time.

use std::net::SocketAddr;
use std::time::Duration;

use llmgw_feed_proto::v1 as pb;
use tokio::sync::mpsc;

/// How long a reply may take.
const REPLY_TIMEOUT: Duration = Duration::from_secs(20);

/// One agent stream.
pub struct FeedClient {
    tx: mpsc::Sender<pb::AgentMessage>,
    rx: tonic::Streaming<pb::RouterMessage>,
    next_id: u64,
}

impl FeedClient {
    /// Opens a stream to the feed at `addr`.
    pub async fn connect(addr: SocketAddr) -> Result<FeedClient, tonic::Status> {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?
            .connect()
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let (tx, rx) = mpsc::channel(4);
        let rx = pb::feed_client::FeedClient::new(channel)
            .max_encoding_message_size(usize::MAX)
            .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(FeedClient { tx, rx, next_id: 0 })
    }

    /// Sends `body`; returns the replies up to its acknowledgement, or the status the router
    /// ended the stream with.
    pub async fn send(
        &mut self,
        body: pb::agent_message::Body,
    ) -> Result<Vec<pb::RouterMessage>, tonic::Status> {
        self.next_id += 1;
        let id = self.next_id;
        let message = pb::AgentMessage::numbered(id, body);
        if self.tx.send(message).await.is_err() {
            return Err(tonic::Status::cancelled("stream gone"));
        }
        let mut replies = Vec::new();
        loop {
            let reply = tokio::time::timeout(REPLY_TIMEOUT, self.rx.message())
                .await
                .expect("the router answers")?
                .ok_or_else(|| tonic::Status::cancelled("stream closed"))?;
            let acked = matches!(reply.body, Some(pb::router_message::Body::Ack(pb::Ack { id: a })) if a == id);
            replies.push(reply);
            if acked {
                return Ok(replies);
            }
        }
    }

    /// The status that ends the stream (`OK` when it closed without one).
    pub async fn ended(mut self) -> tonic::Status {
        loop {
            match tokio::time::timeout(REPLY_TIMEOUT, self.rx.message()).await {
                Ok(Ok(Some(_))) => {}
                Ok(Ok(None)) => return tonic::Status::ok("closed"),
                Ok(Err(status)) => return status,
                Err(_) => panic!("the router never ended the stream"),
            }
        }
    }
}

/// The reason of the first `Refused` among `replies`.
pub fn refusal(replies: &[pb::RouterMessage]) -> Option<String> {
    replies.iter().find_map(|r| match &r.body {
        Some(pb::router_message::Body::Refused(f)) => Some(f.reason.clone()),
        _ => None,
    })
}
