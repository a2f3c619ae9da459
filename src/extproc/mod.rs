//! Envoy's external processing protocol (`envoy.service.ext_proc.v3.ExternalProcessor`), as the
//! Endpoint Picker Protocol uses it. This module knows the protocol only: it collects a request's
//! headers and body, asks a [`Picker`] where the request goes, and answers Envoy in protocol
//! order. It knows nothing of models, replicas or scoring.
//!
//! # Body modes
//! The first message of a stream carries the filter's `protocol_config`:
//! * **BUFFERED** (our fast path): the header message is answered at once (removing any client
//!   copy of the destination header), Envoy then sends the whole body in one message, and the
//!   body answer carries the routing.
//! * **FULL_DUPLEX_STREAMED** (what Gateway API Inference Extension gateways send): the header
//!   answer is held until the body is complete, then sent with the routing, followed by the body
//!   echoed back in order as `streamed_response` chunks of at most [`MAX_CHUNK`] bytes.
//! * **STREAMED with `send_body_without_waiting_for_header_response`**: Envoy sends the headers
//!   and the body chunks without waiting for answers; the header answer is held until the body
//!   is complete and carries the routing, followed by one pass-through answer per chunk (the
//!   body is not echoed). One round trip instead of BUFFERED's two.
//! * **STREAMED** (without that flag) / **BUFFERED_PARTIAL**: answered chunk by chunk, routing
//!   on the last chunk. Envoy may have chosen the upstream before then; use BUFFERED instead.
//! * **NONE**, or a request without a body: routed on the headers.
//!
//! The response direction is not processed; when Envoy is configured to send it anyway it gets
//! pass-through answers (echo in full duplex). The end of the gRPC stream is the end of the HTTP
//! request, so the picker's hold (an in-flight count) lives exactly as long as the stream.
//!
//! # Concurrency model
//! One gRPC stream per HTTP request; each stream's state ([`state::StreamState`]) is owned by the
//! stream's own response future and polled inline by tonic, with no task spawned per request.
//! The picker is shared (`Arc`) and must be `Sync`.
//!
//! # Copies
//! Inbound messages are decoded as [`wire::Inbound`], whose bodies are slices of tonic's receive
//! buffer: a BUFFERED body reaches the picker without being copied by this module.

mod response;
pub mod state;
pub mod wire;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse;
use futures::Stream;
use futures::future::BoxFuture;
use thiserror::Error;
use tonic::body::Body as GrpcBody;
use tonic::codegen::{Body, StdError, http};
use tonic::{Request, Response, Status, Streaming};

pub use response::error_body;
pub use state::served_endpoint;
use wire::Inbound;

/// The largest body chunk echoed back in FULL_DUPLEX_STREAMED mode (Envoy's 64 KiB guidance).
pub const MAX_CHUNK: usize = 64 * 1024;

/// The header and `envoy.lb` metadata key of the Endpoint Picker Protocol.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The subset hint key Envoy may send in `envoy.lb` metadata.
pub const SUBSET_HINT_KEY: &str = "x-gateway-destination-endpoint-subset";

/// The filter-metadata namespace GIE gateways put the subset hint in (GIE's `pkg/epp` and lwepp
/// read it there). Older gateways put it under `envoy.lb`, which is read when this is absent.
pub const SUBSET_HINT_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key under which the proxy reports, on the response path, the endpoint that actually
/// served the request (Envoy's `override_host` `selected_host_key`).
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// The Gateway API conformance suite's steering header.
pub const TEST_SELECTION_HEADER: &str = "test-epp-endpoint-selection";

/// What the picker gets to decide on.
#[derive(Debug, Clone, Default)]
pub struct RoutingRequest {
    pub method: String,
    /// `:path`, query string included.
    pub path: String,
    /// The complete body, or `None` when the filter does not send bodies (mode NONE). An
    /// empty body (a GET) is `Some` and empty.
    pub body: Option<Bytes>,
    /// The proxy's subset hint: pick only among these `ip:port`s.
    pub subset: Option<Vec<String>>,
    /// The value of `test-epp-endpoint-selection`, if the client sent one. Whether to honour it
    /// is the picker's business.
    pub test_selection: Option<String>,
    /// The caller's W3C trace headers, when it sent any (boxed: most requests carry none).
    pub trace: Option<Box<CallerTrace>>,
    /// The headers named in [`ExtProcSettings::request_headers`] that the request carried.
    pub headers: Vec<(String, String)>,
}

/// The W3C Trace Context headers of the request, for the picker to continue the caller's trace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallerTrace {
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

/// A routing answer: where to go and what to hold until the request ends.
#[derive(Debug)]
pub struct Routed<H> {
    /// `ip:port`, or an ordered list `ip:port,ip:port,…` (primary first).
    pub destination: String,
    /// Dropped when the ext_proc stream (so the HTTP request) ends.
    pub hold: H,
    /// Further request headers to set for the upstream (the trace context); usually empty.
    pub headers: Vec<(&'static str, String)>,
}

/// A refusal, answered to the client as a JSON error in the shape of the API it speaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// HTTP status.
    pub status: u16,
    /// OpenAI error `type` (e.g. `invalid_request_error`).
    pub error_type: &'static str,
    pub message: String,
    /// The error body's shape (OpenAI's, or Anthropic's for `/v1/messages`).
    pub style: crate::openai::ErrorStyle,
}

impl Rejection {
    /// An OpenAI-style refusal (see [`Rejection::for_path`] for the API's own shape).
    pub fn new(status: u16, error_type: &'static str, message: impl Into<String>) -> Rejection {
        Rejection {
            status,
            error_type,
            message: message.into(),
            style: crate::openai::ErrorStyle::OpenAi,
        }
    }

    /// This refusal shaped for the API the request at `path` speaks.
    pub fn for_path(mut self, path: &str) -> Rejection {
        self.style = crate::openai::ErrorStyle::for_path(path);
        self
    }
}

/// Decides where a request goes. Implemented by the router over the scheduler, and by fakes in
/// tests.
pub trait Picker: Send + Sync + 'static {
    /// Kept for the request's lifetime (the in-flight count).
    type Hold: Send + 'static;

    fn pick(
        &self,
        request: RoutingRequest,
    ) -> impl Future<Output = Result<Routed<Self::Hold>, Rejection>> + Send;

    /// Told when the protocol layer refuses a request itself (413), for accounting.
    fn rejected_by_protocol(&self, _rejection: &Rejection) {}

    /// Told, once per request, which endpoint the proxy reports as having served it (a
    /// fallback when the pick failed), with the hold of the routed request.
    fn served(&self, _hold: &mut Self::Hold, _endpoint: &str) {}

    /// Headers to set on the response to a routed request (after [`Picker::served`]); usually
    /// none.
    fn response_headers(&self, _hold: &Self::Hold) -> Vec<(&'static str, String)> {
        Vec::new()
    }

    /// Told once, with the hold, when a routed request's stream ends, and what the protocol saw
    /// of the exchange.
    fn finished(&self, _hold: Self::Hold, _exchange: Exchange) {}
}

/// The response body's last bytes kept for [`Exchange::response_tail`]: an OpenAI response
/// ends with its `usage` (a JSON response's last field, a stream's last event).
pub const RESPONSE_TAIL: usize = 16 * 1024;

/// What the protocol layer saw of one routed exchange.
#[derive(Debug, Clone)]
pub struct Exchange {
    /// When the request's headers arrived.
    pub received: tokio::time::Instant,
    /// The upstream's `:status`, when the proxy sent the response headers.
    pub status: Option<u16>,
    /// Response body bytes seen (none when the proxy does not send the response body).
    pub response_bytes: u64,
    /// The last [`RESPONSE_TAIL`] bytes of the response body ([`Exchange::response_tail`]): a
    /// ring, so that a stream of small chunks costs each chunk's length, not the tail's.
    tail: std::collections::VecDeque<u8>,
    /// Whether the response's end (its last body chunk or trailers) was seen.
    pub complete: bool,
}

impl Exchange {
    pub fn new(received: tokio::time::Instant) -> Exchange {
        Exchange {
            received,
            status: None,
            response_bytes: 0,
            tail: std::collections::VecDeque::new(),
            complete: false,
        }
    }

    /// Counts a response body chunk and keeps the tail.
    pub fn response_chunk(&mut self, chunk: &[u8], end_of_stream: bool) {
        self.response_bytes += chunk.len() as u64;
        let kept = &chunk[chunk.len().saturating_sub(RESPONSE_TAIL)..];
        let overflow = (self.tail.len() + kept.len()).saturating_sub(RESPONSE_TAIL);
        self.tail.drain(..overflow);
        self.tail.extend(kept);
        self.complete |= end_of_stream;
    }

    /// The last [`RESPONSE_TAIL`] bytes of the response body, in order.
    pub fn response_tail(&mut self) -> &[u8] {
        self.tail.make_contiguous()
    }
}

/// Settings of the protocol layer.
#[derive(Debug, Clone)]
pub struct ExtProcSettings {
    /// The destination header (and `envoy.lb` metadata key) to set.
    pub destination_header: String,
    /// Bodies above this many bytes are refused with 413.
    pub max_body_bytes: usize,
    /// Request headers (lower-case names) to hand to the picker in [`RoutingRequest::headers`].
    pub request_headers: Vec<String>,
}

impl Default for ExtProcSettings {
    fn default() -> Self {
        ExtProcSettings {
            destination_header: DESTINATION_HEADER.to_string(),
            max_body_bytes: 16 * 1024 * 1024,
            request_headers: Vec::new(),
        }
    }
}

/// A message that breaks the protocol's order; the stream is closed with an error, which Envoy
/// handles according to `failure_mode_allow`.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("{0} before the request headers")]
    BeforeHeaders(&'static str),
    #[error("empty processing request")]
    Empty,
}

/// The gRPC service: one [`state::StreamState`] per stream.
#[derive(Debug)]
pub struct ExtProcService<P> {
    picker: Arc<P>,
    settings: Arc<ExtProcSettings>,
}

impl<P: Picker> ExtProcService<P> {
    pub fn new(picker: Arc<P>, settings: ExtProcSettings) -> Self {
        ExtProcService {
            picker,
            settings: Arc::new(settings),
        }
    }

    /// The tonic service for this processor (add it to a `tonic::transport::Server`).
    pub fn into_server(self) -> ExtProcServer<P> {
        ExtProcServer {
            inner: Arc::new(self),
        }
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

/// What a message from Envoy may carry beyond its body (headers, trailers, metadata, framing).
pub const MESSAGE_HEADROOM_BYTES: usize = 1024 * 1024;

/// The longest message Envoy may send: twice the body limit and the headroom. A BUFFERED body
/// arrives in one message, up to Envoy's buffer limit (the shipped configurations: twice the
/// default body limit), and must reach the state machine to be answered with llmgw's 413.
/// Anything longer ends the stream with `OUT_OF_RANGE` before it is read, rather than having
/// its length, a number from the wire, reserved.
pub fn max_message_bytes(max_body_bytes: usize) -> usize {
    max_body_bytes
        .saturating_mul(2)
        .saturating_add(MESSAGE_HEADROOM_BYTES)
}

/// `envoy.service.ext_proc.v3.ExternalProcessor` as a tonic service. Written out instead of the
/// `envoy-types` generated server so that requests decode as [`wire::Inbound`] (bodies not
/// copied); answers are the generated `ProcessingResponse`. No compression; messages from Envoy
/// up to [`max_message_bytes`].
#[derive(Debug)]
pub struct ExtProcServer<P> {
    inner: Arc<ExtProcService<P>>,
}

impl<P> Clone for ExtProcServer<P> {
    fn clone(&self) -> Self {
        ExtProcServer {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<P> tonic::server::NamedService for ExtProcServer<P> {
    const NAME: &'static str = "envoy.service.ext_proc.v3.ExternalProcessor";
}

/// The one method, `Process`, for tonic's streaming handler.
struct ProcessMethod<P>(Arc<ExtProcService<P>>);

impl<P: Picker> tonic::server::StreamingService<Inbound> for ProcessMethod<P> {
    type Response = ProcessingResponse;
    type ResponseStream = ResponseStream;
    type Future = std::future::Ready<Result<Response<ResponseStream>, Status>>;

    fn call(&mut self, request: Request<Streaming<Inbound>>) -> Self::Future {
        let service = &self.0;
        let state =
            state::StreamState::new(Arc::clone(&service.picker), Arc::clone(&service.settings));
        let answers: ResponseStream = Box::pin(state::drive(request.into_inner(), state));
        std::future::ready(Ok(Response::new(answers)))
    }
}

impl<P, B> tonic::codegen::Service<http::Request<B>> for ExtProcServer<P>
where
    P: Picker,
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<GrpcBody>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != "/envoy.service.ext_proc.v3.ExternalProcessor/Process" {
            return Box::pin(async { Ok(Status::unimplemented("").into_http()) });
        }
        let method = ProcessMethod(Arc::clone(&self.inner));
        let max_message = max_message_bytes(self.inner.settings.max_body_bytes);
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::<ProcessingResponse, Inbound>::default();
            let mut grpc = tonic::server::Grpc::new(codec)
                .apply_max_message_size_config(Some(max_message), Some(usize::MAX));
            Ok(grpc.streaming(method, request).await)
        })
    }
}

#[cfg(test)]
mod tests;
