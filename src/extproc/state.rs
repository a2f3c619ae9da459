//! One ext_proc stream as an explicit state machine.
//!
//! ```text
//! AwaitingHeaders ──headers, no body──────────────────────────────▶ Routed
//!        │ headers, body follows (header answer now, or held: full duplex, streamed ahead)
//!        ▼
//! CollectingBody ──last chunk / trailers──▶ (pick) ──────────────▶ Routed
//!        │ too large / rejected                                       │ response messages
//!        ▼                                                            ▼ answered pass-through
//!   Finished (immediate response sent; the stream ends)         (until Envoy closes)
//! ```

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpHeaders, ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::value::Kind;
use futures::Stream;
use tokio::time::Instant;
use tonic::{Status, Streaming};

use super::response;
use super::wire::{Inbound, InboundBody, InboundPart as Message};
use super::{
    Exchange, ExtProcSettings, Picker, ProtocolError, Rejection, RoutingRequest, SERVED_KEY,
    SUBSET_HINT_KEY, SUBSET_HINT_NAMESPACE, TEST_SELECTION_HEADER,
};

/// How the filter sends the request body (from `protocol_config`; BUFFERED when absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestBodyMode {
    None,
    /// BUFFERED: one message with the whole body.
    Buffered,
    /// STREAMED: chunks, each answered.
    Chunked,
    /// BUFFERED_PARTIAL: one message, the whole body or as much as the proxy buffers; the rest
    /// (if any) goes upstream without being shown.
    Partial,
    /// STREAMED with `send_body_without_waiting_for_header_response`: the chunks follow the
    /// headers at once, so the header answer is held until the body is complete and then
    /// carries the routing, followed by one pass-through answer per chunk. One round trip,
    /// and the body is not echoed.
    ChunkedAhead,
    /// FULL_DUPLEX_STREAMED: chunks answered when we like, in order, echoed back.
    FullDuplex,
}

impl RequestBodyMode {
    fn from_wire(config: &ProtocolConfiguration) -> RequestBodyMode {
        match BodySendMode::try_from(config.request_body_mode) {
            Ok(BodySendMode::None) => RequestBodyMode::None,
            Ok(BodySendMode::Streamed) if config.send_body_without_waiting_for_header_response => {
                RequestBodyMode::ChunkedAhead
            }
            Ok(BodySendMode::Streamed) => RequestBodyMode::Chunked,
            Ok(BodySendMode::BufferedPartial) => RequestBodyMode::Partial,
            Ok(BodySendMode::FullDuplexStreamed | BodySendMode::Grpc) => {
                RequestBodyMode::FullDuplex
            }
            Ok(BodySendMode::Buffered) | Err(_) => RequestBodyMode::Buffered,
        }
    }
}

enum Phase {
    AwaitingHeaders,
    CollectingBody {
        /// Boxed: the largest part of the phase, only while a body comes.
        request: Box<RoutingRequest>,
        body: BodyChunks,
        /// Body messages received so far (empty ones included: each is answered).
        messages: usize,
    },
    Routed,
    Finished,
}

/// The state of one stream.
pub struct StreamState<P: Picker> {
    picker: Arc<P>,
    settings: Arc<ExtProcSettings>,
    request_mode: RequestBodyMode,
    echo_response_body: bool,
    phase: Phase,
    hold: Option<P::Hold>,
    /// Whether the proxy's served-endpoint report was passed on (once per request).
    served_reported: bool,
    /// What this stream saw of the exchange, for [`Picker::finished`].
    exchange: Exchange,
}

impl<P: Picker> Drop for StreamState<P> {
    /// The stream is over (the response ended, or the client or proxy went away).
    fn drop(&mut self) {
        if let Some(hold) = self.hold.take() {
            let exchange = std::mem::replace(&mut self.exchange, Exchange::new(Instant::now()));
            self.picker.finished(hold, exchange);
        }
    }
}

impl<P: Picker> StreamState<P> {
    pub fn new(picker: Arc<P>, settings: Arc<ExtProcSettings>) -> Self {
        StreamState {
            picker,
            settings,
            request_mode: RequestBodyMode::Buffered,
            echo_response_body: false,
            phase: Phase::AwaitingHeaders,
            hold: None,
            served_reported: false,
            exchange: Exchange::new(Instant::now()),
        }
    }

    /// Whether an immediate response ended the exchange.
    pub fn finished(&self) -> bool {
        matches!(self.phase, Phase::Finished)
    }

    /// Whether the picker's hold is still held (the request counts as in flight).
    pub fn holding(&self) -> bool {
        self.hold.is_some()
    }

    /// Handles one message from Envoy and returns the answers to send, in order. Takes the wire
    /// form ([`Inbound`]) or the generated `ProcessingRequest`.
    pub async fn on_message(
        &mut self,
        message: impl Into<Inbound>,
    ) -> Result<Vec<ProcessingResponse>, ProtocolError> {
        let message: Inbound = message.into();
        if let Some(config) = &message.protocol_config {
            self.request_mode = RequestBodyMode::from_wire(config);
            self.echo_response_body = matches!(
                BodySendMode::try_from(config.response_body_mode),
                Ok(BodySendMode::FullDuplexStreamed | BodySendMode::Grpc)
            );
        }
        let part = message.request.ok_or(ProtocolError::Empty)?;
        if matches!(
            part,
            Message::ResponseHeaders(_) | Message::ResponseBody(_) | Message::ResponseTrailers(_)
        ) {
            self.report_served(message.metadata_context.as_ref());
        }
        match part {
            Message::RequestHeaders(headers) => {
                self.on_request_headers(headers, message.metadata_context.as_ref())
                    .await
            }
            Message::RequestBody(body) => self.on_request_body(body).await,
            Message::RequestTrailers(_) => self.on_request_trailers().await,
            Message::ResponseHeaders(headers) => {
                self.exchange.status = response_status(headers.headers.as_ref());
                self.exchange.complete |= headers.end_of_stream;
                let headers = match &self.hold {
                    Some(hold) => self.picker.response_headers(hold),
                    None => Vec::new(),
                };
                Ok(vec![response::response_headers(&headers)])
            }
            Message::ResponseBody(body) => {
                self.exchange.response_chunk(&body.body, body.end_of_stream);
                Ok(vec![response::response_body(
                    self.echo_response_body
                        .then_some((body.body, body.end_of_stream)),
                )])
            }
            Message::ResponseTrailers(_) => {
                self.exchange.complete = true;
                Ok(vec![response::response_trailers()])
            }
        }
    }

    /// Passes the proxy's served-endpoint report, from the first response-path message that
    /// carries one, to the picker.
    fn report_served(&mut self, metadata: Option<&Metadata>) {
        if self.served_reported {
            return;
        }
        let (Some(hold), Some(endpoint)) = (self.hold.as_mut(), served_endpoint(metadata)) else {
            return;
        };
        self.served_reported = true;
        self.picker.served(hold, endpoint);
    }

    async fn on_request_headers(
        &mut self,
        headers: HttpHeaders,
        metadata: Option<&Metadata>,
    ) -> Result<Vec<ProcessingResponse>, ProtocolError> {
        self.exchange.received = Instant::now();
        let mut request = read_headers(headers.headers.as_ref(), &self.settings.request_headers);
        request.subset = subset_hint(metadata);
        if headers.end_of_stream || self.request_mode == RequestBodyMode::None {
            if headers.end_of_stream {
                request.body = Some(Bytes::new());
            }
            return Ok(self.route(request, Answer::Headers).await);
        }
        self.phase = Phase::CollectingBody {
            request: Box::new(request),
            body: BodyChunks::default(),
            messages: 0,
        };
        match self.request_mode {
            RequestBodyMode::FullDuplex | RequestBodyMode::ChunkedAhead => Ok(Vec::new()),
            _ => Ok(vec![response::request_headers(
                response::strip_destination(&self.settings.destination_header),
                None,
            )]),
        }
    }

    async fn on_request_body(
        &mut self,
        chunk: InboundBody,
    ) -> Result<Vec<ProcessingResponse>, ProtocolError> {
        let Phase::CollectingBody {
            request,
            body,
            messages,
        } = &mut self.phase
        else {
            return match self.phase {
                Phase::AwaitingHeaders => Err(ProtocolError::BeforeHeaders("request body")),
                // Late chunks after routing (STREAMED mode) pass unchanged.
                _ => Ok(vec![response::request_body(Default::default(), None)]),
            };
        };
        let too_large = if body.len() + chunk.body.len() > self.settings.max_body_bytes {
            Some(format!(
                "request body exceeds the limit of {} bytes",
                self.settings.max_body_bytes
            ))
        } else if self.request_mode == RequestBodyMode::Partial && !chunk.end_of_stream {
            // No more of it will be shown, and a request cannot be read from part of its body.
            Some("request body is over the proxy's buffer limit (BUFFERED_PARTIAL)".to_owned())
        } else if *messages >= MAX_BODY_MESSAGES {
            Some(format!(
                "request body sent in more than {MAX_BODY_MESSAGES} messages"
            ))
        } else {
            None
        };
        if let Some(why) = too_large {
            tracing::info!(
                path = request.path,
                bytes_so_far = body.len() + chunk.body.len(),
                messages = *messages + 1,
                "request refused: 413, {why}"
            );
            let rejection =
                Rejection::new(413, "invalid_request_error", why).for_path(&request.path);
            self.picker.rejected_by_protocol(&rejection);
            return Ok(self.reject(rejection));
        }
        let complete = chunk.end_of_stream || self.request_mode == RequestBodyMode::Buffered;
        body.push(chunk.body);
        *messages += 1;
        if complete {
            return Ok(self.finish_body(true).await);
        }
        match self.request_mode {
            RequestBodyMode::Chunked => Ok(vec![response::request_body(Default::default(), None)]),
            _ => Ok(Vec::new()),
        }
    }

    async fn on_request_trailers(&mut self) -> Result<Vec<ProcessingResponse>, ProtocolError> {
        match self.phase {
            Phase::AwaitingHeaders => Err(ProtocolError::BeforeHeaders("request trailers")),
            Phase::CollectingBody { .. }
                if matches!(
                    self.request_mode,
                    RequestBodyMode::FullDuplex | RequestBodyMode::ChunkedAhead
                ) =>
            {
                let mut answers = self.finish_body(false).await;
                if !self.finished() {
                    answers.push(response::request_trailers());
                }
                Ok(answers)
            }
            Phase::CollectingBody { ref request, .. } => {
                // STREAMED: the headers are gone upstream, and a trailers answer cannot name
                // the destination.
                tracing::warn!(
                    path = request.path,
                    "request body ended with trailers in STREAMED mode: not routed (use \
                     FULL_DUPLEX_STREAMED or BUFFERED)"
                );
                Ok(vec![response::request_trailers()])
            }
            _ => Ok(vec![response::request_trailers()]),
        }
    }

    /// The body is complete: pick, and answer as the mode requires.
    async fn finish_body(&mut self, body_end_of_stream: bool) -> Vec<ProcessingResponse> {
        let Phase::CollectingBody {
            mut request,
            body,
            messages,
        } = std::mem::replace(&mut self.phase, Phase::Routed)
        else {
            return Vec::new();
        };
        let body = body.into_bytes();
        request.body = Some(body.clone());
        let answer = match self.request_mode {
            RequestBodyMode::FullDuplex => Answer::HeadersThenEcho {
                body,
                end_of_stream: body_end_of_stream,
            },
            RequestBodyMode::ChunkedAhead => Answer::HeadersThenContinue { chunks: messages },
            _ => Answer::Body,
        };
        self.route(*request, answer).await
    }

    async fn route(&mut self, request: RoutingRequest, answer: Answer) -> Vec<ProcessingResponse> {
        let routed = match self.picker.pick(request).await {
            Ok(routed) => routed,
            Err(rejection) => return self.reject(rejection),
        };
        self.hold = Some(routed.hold);
        self.phase = Phase::Routed;
        let header = &self.settings.destination_header;
        let metadata = Some(response::lb_metadata(header, &routed.destination));
        match answer {
            Answer::Headers => vec![response::request_headers(
                response::route_to(header, &routed.destination, &routed.headers, None),
                metadata,
            )],
            Answer::Body => vec![response::request_body(
                response::route_to(header, &routed.destination, &routed.headers, None),
                metadata,
            )],
            Answer::HeadersThenEcho {
                body,
                end_of_stream,
            } => {
                let mut answers = vec![response::request_headers(
                    response::route_to(
                        header,
                        &routed.destination,
                        &routed.headers,
                        Some(body.len()),
                    ),
                    metadata,
                )];
                answers.extend(response::echo_request_body(&body, end_of_stream));
                answers
            }
            Answer::HeadersThenContinue { chunks } => {
                let mut answers = Vec::with_capacity(1 + chunks);
                answers.push(response::request_headers(
                    response::route_to(header, &routed.destination, &routed.headers, None),
                    metadata,
                ));
                answers.extend(
                    std::iter::repeat_with(|| response::request_body(Default::default(), None))
                        .take(chunks),
                );
                answers
            }
        }
    }

    fn reject(&mut self, rejection: Rejection) -> Vec<ProcessingResponse> {
        self.phase = Phase::Finished;
        vec![response::immediate(&rejection)]
    }
}

/// The most messages one request body may come in (empty ones included: each is answered, and
/// in STREAMED mode with held headers all answers go out at once). Envoy reads a client's body
/// in pieces of up to 16 KiB or more, so a 16 MiB body comes in about a thousand.
pub const MAX_BODY_MESSAGES: usize = 1 << 18;

/// Chunks under this size are copied into one buffer as they come instead of kept: a slice
/// keeps its whole receive buffer alive, so many small ones could hold far more memory than
/// the body limit counts.
const KEPT_CHUNK_BYTES: usize = 64 * 1024;

/// A request body as it arrives: the first chunk and large ones are kept as received (slices of
/// the gRPC receive buffer), other small ones copied together, and all joined once, when the
/// body is complete. A body sent in one message (BUFFERED) is never copied.
#[derive(Default)]
struct BodyChunks {
    chunks: Vec<Bytes>,
    /// Small chunks since the last kept one, copied.
    small: BytesMut,
    len: usize,
}

impl BodyChunks {
    fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, chunk: Bytes) {
        self.len += chunk.len();
        if self.chunks.is_empty() && self.small.is_empty() {
            if !chunk.is_empty() {
                self.chunks.push(chunk);
            }
            return;
        }
        if chunk.len() < KEPT_CHUNK_BYTES {
            self.small.extend_from_slice(&chunk);
            return;
        }
        if !self.small.is_empty() {
            self.chunks.push(self.small.split().freeze());
        }
        self.chunks.push(chunk);
    }

    /// The whole body: the only chunk as it is, or all chunks copied once into one buffer.
    fn into_bytes(mut self) -> Bytes {
        if !self.small.is_empty() {
            self.chunks.push(self.small.split().freeze());
        }
        match self.chunks.len() {
            0 => Bytes::new(),
            1 => self.chunks.swap_remove(0),
            _ => {
                let mut joined = BytesMut::with_capacity(self.len);
                for chunk in &self.chunks {
                    joined.extend_from_slice(chunk);
                }
                joined.freeze()
            }
        }
    }
}

/// Which message carries the routing.
enum Answer {
    /// The request-headers answer (no body).
    Headers,
    /// The request-body answer (BUFFERED, chunked).
    Body,
    /// The deferred request-headers answer, then the body echoed (FULL_DUPLEX_STREAMED).
    HeadersThenEcho { body: Bytes, end_of_stream: bool },
    /// The deferred request-headers answer, then a pass-through answer for each body message
    /// received (STREAMED with `send_body_without_waiting_for_header_response`).
    HeadersThenContinue { chunks: usize },
}

fn header_value(header: &envoy_types::pb::envoy::config::core::v3::HeaderValue) -> String {
    if header.raw_value.is_empty() {
        header.value.clone()
    } else {
        String::from_utf8_lossy(&header.raw_value).into_owned()
    }
}

/// The request fields the picker reads, and the headers among `wanted` (lower-case names, as
/// Envoy sends them).
fn read_headers(headers: Option<&HeaderMap>, wanted: &[String]) -> RoutingRequest {
    let mut request = RoutingRequest::default();
    for header in headers.map(|h| h.headers.as_slice()).unwrap_or(&[]) {
        if wanted.contains(&header.key) {
            request
                .headers
                .push((header.key.clone(), header_value(header)));
        }
        match header.key.as_str() {
            ":method" => request.method = header_value(header),
            ":path" => request.path = header_value(header),
            TEST_SELECTION_HEADER => request.test_selection = Some(header_value(header)),
            "traceparent" => {
                request.trace.get_or_insert_default().traceparent = Some(header_value(header))
            }
            "tracestate" => {
                request.trace.get_or_insert_default().tracestate = Some(header_value(header))
            }
            _ => {}
        }
    }
    request
}

/// The response's `:status`.
fn response_status(headers: Option<&HeaderMap>) -> Option<u16> {
    let headers = headers.map(|h| h.headers.as_slice()).unwrap_or(&[]);
    let status = headers.iter().find(|h| h.key == ":status")?;
    header_value(status).trim().parse().ok()
}

/// `envoy.lb` → `x-gateway-destination-endpoint-served`: the `ip:port` that served the request.
pub fn served_endpoint(metadata: Option<&Metadata>) -> Option<&str> {
    let lb = metadata?.filter_metadata.get("envoy.lb")?;
    match lb.fields.get(SERVED_KEY)?.kind.as_ref()? {
        Kind::StringValue(s) if !s.trim().is_empty() => Some(s.trim()),
        _ => None,
    }
}

/// `envoy.lb.subset_hint` (GIE's namespace; else `envoy.lb`, as older gateways sent it) →
/// `x-gateway-destination-endpoint-subset`, a list of strings or one comma-separated string.
fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let namespaces = &metadata?.filter_metadata;
    let value = [SUBSET_HINT_NAMESPACE, "envoy.lb"]
        .iter()
        .find_map(|namespace| namespaces.get(*namespace)?.fields.get(SUBSET_HINT_KEY))?;
    let mut endpoints = Vec::new();
    let mut push_all = |s: &str| {
        endpoints.extend(
            s.split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .map(String::from),
        )
    };
    match value.kind.as_ref()? {
        Kind::StringValue(s) => push_all(s),
        Kind::ListValue(list) => {
            for item in &list.values {
                if let Some(Kind::StringValue(s)) = &item.kind {
                    push_all(s);
                }
            }
        }
        _ => return None,
    }
    Some(endpoints)
}

/// Runs one stream: reads Envoy's messages, answers them, and ends when Envoy closes the stream
/// (the request is over) or after an immediate response. The state, and with it the picker's
/// hold, is dropped when the returned stream is.
pub fn drive<P: Picker>(
    inbound: Streaming<Inbound>,
    state: StreamState<P>,
) -> impl Stream<Item = Result<ProcessingResponse, Status>> + Send {
    let queue = std::collections::VecDeque::new();
    futures::stream::unfold(
        (inbound, state, queue, false),
        |(mut inbound, mut state, mut queue, failed)| async move {
            loop {
                if let Some(answer) = queue.pop_front() {
                    return Some((Ok(answer), (inbound, state, queue, failed)));
                }
                if failed || state.finished() {
                    return None;
                }
                let message = match inbound.message().await {
                    Ok(Some(message)) => message,
                    Ok(None) => return None,
                    // A message too long or not decodable: said to Envoy and logged.
                    Err(status)
                        if matches!(
                            status.code(),
                            tonic::Code::OutOfRange | tonic::Code::Internal
                        ) =>
                    {
                        tracing::warn!(%status, "ext_proc message refused");
                        return Some((Err(status), (inbound, state, queue, true)));
                    }
                    Err(status) => {
                        tracing::debug!(%status, "ext_proc stream ended by the proxy");
                        return None;
                    }
                };
                match state.on_message(message).await {
                    Ok(answers) => queue.extend(answers),
                    Err(error) => {
                        tracing::warn!(%error, "ext_proc protocol error");
                        let status = Status::failed_precondition(error.to_string());
                        return Some((Err(status), (inbound, state, queue, true)));
                    }
                }
            }
        },
    )
}

#[cfg(test)]
mod body_tests {
    use bytes::Bytes;

    use super::{BodyChunks, KEPT_CHUNK_BYTES};

    #[test]
    fn chunks_of_every_size_join_in_order_and_small_ones_are_not_kept_one_by_one() {
        let large = |byte: u8| Bytes::from(vec![byte; KEPT_CHUNK_BYTES]);
        let mut body = BodyChunks::default();
        let mut expected = Vec::new();
        let mut pieces = vec![Bytes::new(), Bytes::from_static(b"first"), large(b'L')];
        pieces.extend((0..10_000).map(|i| Bytes::from(vec![b'a' + (i % 26) as u8])));
        pieces.extend([Bytes::new(), large(b'M'), Bytes::from_static(b"end")]);
        for piece in pieces {
            expected.extend_from_slice(&piece);
            body.push(piece);
        }
        assert_eq!(body.len(), expected.len());
        assert!(
            body.chunks.len() <= 4,
            "{} chunks kept: small ones must be copied together",
            body.chunks.len()
        );
        assert_eq!(body.into_bytes(), Bytes::from(expected));
    }

    #[test]
    fn a_body_in_one_message_is_not_copied() {
        let one = Bytes::from_static(b"{\"prompt\": \"hi\"}");
        let mut body = BodyChunks::default();
        body.push(one.clone());
        assert_eq!(body.into_bytes().as_ptr(), one.as_ptr());
    }
}

#[cfg(test)]
mod header_tests {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};

    use super::read_headers;

    #[test]
    fn only_the_headers_a_plugin_asked_for_reach_the_picker() {
        let header = |key: &str, value: &str| HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        };
        let headers = HeaderMap {
            headers: vec![
                header(":method", "POST"),
                header(":path", "/v1/completions"),
                header("x-session-id", "abc"),
                header("authorization", "Bearer secret"),
                header("cookie", "sid=1"),
            ],
        };
        let wanted = ["cookie".to_owned(), "x-session-id".to_owned()];
        let request = read_headers(Some(&headers), &wanted);
        assert_eq!(request.method, "POST");
        assert_eq!(
            request.headers,
            [
                ("x-session-id".to_owned(), "abc".to_owned()),
                ("cookie".to_owned(), "sid=1".to_owned())
            ]
        );
        assert!(read_headers(Some(&headers), &[]).headers.is_empty());
    }
}
