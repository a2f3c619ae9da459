//! The inbound half of the ext_proc wire format, decoded without copying bodies.
//!
//! `envoy-types` generates `HttpBody.body` as `Vec<u8>`, so decoding a `ProcessingRequest` copies
//! every request body out of tonic's receive buffer (a 200 KB prompt: one 200 KB copy and
//! allocation per request). [`Inbound`] is the same message with only the fields this server
//! reads and with bodies as [`Bytes`]: prost then takes the body as a slice of tonic's buffer
//! (`copy_to_bytes` on a `BytesMut` is a split, not a copy). Field numbers are those of
//! `envoy.service.ext_proc.v3.ProcessingRequest`; fields not listed here (`attributes`,
//! `observability_mode`, flow control) are skipped by prost as unknown fields.
//!
//! Answers are still `envoy-types`' `ProcessingResponse`.

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as EnvoyRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProtocolConfiguration,
};

/// `envoy.service.ext_proc.v3.ProcessingRequest`, as far as this server reads it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Inbound {
    /// Which part of the HTTP exchange this message carries.
    #[prost(oneof = "InboundPart", tags = "2, 3, 4, 5, 6, 7")]
    pub request: Option<InboundPart>,
    /// Dynamic metadata sent by the proxy (the subset hint lives in `envoy.lb`).
    #[prost(message, optional, tag = "8")]
    pub metadata_context: Option<Metadata>,
    /// The filter's processing mode, on the first message of a stream.
    #[prost(message, optional, tag = "11")]
    pub protocol_config: Option<ProtocolConfiguration>,
}

/// The `request` oneof of `ProcessingRequest`.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum InboundPart {
    #[prost(message, tag = "2")]
    RequestHeaders(HttpHeaders),
    #[prost(message, tag = "3")]
    ResponseHeaders(HttpHeaders),
    #[prost(message, tag = "4")]
    RequestBody(InboundBody),
    #[prost(message, tag = "5")]
    ResponseBody(InboundBody),
    #[prost(message, tag = "6")]
    RequestTrailers(HttpTrailers),
    #[prost(message, tag = "7")]
    ResponseTrailers(HttpTrailers),
}

/// `envoy.service.ext_proc.v3.HttpBody` with the body as [`Bytes`].
#[derive(Clone, PartialEq, prost::Message)]
pub struct InboundBody {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

impl From<HttpBody> for InboundBody {
    fn from(body: HttpBody) -> Self {
        InboundBody {
            body: Bytes::from(body.body),
            end_of_stream: body.end_of_stream,
        }
    }
}

/// The generated message (as tests and in-process callers build it) without re-encoding; the
/// bodies move, they are not copied.
impl From<ProcessingRequest> for Inbound {
    fn from(message: ProcessingRequest) -> Self {
        let request = message.request.map(|part| match part {
            EnvoyRequest::RequestHeaders(h) => InboundPart::RequestHeaders(h),
            EnvoyRequest::ResponseHeaders(h) => InboundPart::ResponseHeaders(h),
            EnvoyRequest::RequestBody(b) => InboundPart::RequestBody(b.into()),
            EnvoyRequest::ResponseBody(b) => InboundPart::ResponseBody(b.into()),
            EnvoyRequest::RequestTrailers(t) => InboundPart::RequestTrailers(t),
            EnvoyRequest::ResponseTrailers(t) => InboundPart::ResponseTrailers(t),
        });
        Inbound {
            request,
            metadata_context: message.metadata_context,
            protocol_config: message.protocol_config,
        }
    }
}
