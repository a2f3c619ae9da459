//! Building the `ProcessingResponse` messages the state machine sends.

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

use super::{MAX_CHUNK, Rejection};
use crate::openai::ErrorStyle;

/// The namespace the `override_host` load-balancing policy (and subset LB) reads.
const LB_NAMESPACE: &str = "envoy.lb";

fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// Removes the client's copy of the destination header and changes nothing else.
pub(super) fn strip_destination(destination_header: &str) -> CommonResponse {
    CommonResponse {
        header_mutation: Some(HeaderMutation {
            remove_headers: vec![destination_header.to_string()],
            ..HeaderMutation::default()
        }),
        ..CommonResponse::default()
    }
}

/// Sets the destination header (overwriting any client copy) and the picker's `extra` headers,
/// asks Envoy to pick the route again, and optionally fixes `content-length` (Envoy drops it
/// when the body is streamed back).
pub(super) fn route_to(
    destination_header: &str,
    destination: &str,
    extra: &[(&'static str, String)],
    content_length: Option<usize>,
) -> CommonResponse {
    let mut set_headers = vec![header(destination_header, destination)];
    set_headers.extend(extra.iter().map(|(key, value)| header(key, value)));
    if let Some(length) = content_length {
        set_headers.push(header("content-length", &length.to_string()));
    }
    CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers,
            ..HeaderMutation::default()
        }),
        clear_route_cache: true,
        ..CommonResponse::default()
    }
}

/// `envoy.lb: {<destination_header>: destination}` dynamic metadata.
pub(super) fn lb_metadata(destination_header: &str, destination: &str) -> Struct {
    let inner = Struct {
        fields: [(
            destination_header.to_string(),
            Value {
                kind: Some(Kind::StringValue(destination.to_string())),
            },
        )]
        .into_iter()
        .collect(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into_iter()
        .collect(),
    }
}

pub(super) fn request_headers(
    common: CommonResponse,
    metadata: Option<Struct>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(common),
        })),
        dynamic_metadata: metadata,
        ..ProcessingResponse::default()
    }
}

pub(super) fn request_body(common: CommonResponse, metadata: Option<Struct>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(common),
        })),
        dynamic_metadata: metadata,
        ..ProcessingResponse::default()
    }
}

pub(super) fn request_trailers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestTrailers(TrailersResponse::default())),
        ..ProcessingResponse::default()
    }
}

/// The answer to response headers, setting `set` (none: unchanged).
pub(super) fn response_headers(set: &[(&'static str, String)]) -> ProcessingResponse {
    let response = (!set.is_empty()).then(|| CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: set.iter().map(|(key, value)| header(key, value)).collect(),
            ..HeaderMutation::default()
        }),
        ..CommonResponse::default()
    });
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse { response })),
        ..ProcessingResponse::default()
    }
}

/// The answer to a response-body message; `echo` sends the chunk back unchanged (full duplex).
pub(super) fn response_body(echo: Option<(Bytes, bool)>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseBody(BodyResponse {
            response: Some(CommonResponse {
                body_mutation: echo
                    .map(|(body, end_of_stream)| streamed((body.into(), end_of_stream))),
                ..CommonResponse::default()
            }),
        })),
        ..ProcessingResponse::default()
    }
}

pub(super) fn response_trailers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseTrailers(TrailersResponse::default())),
        ..ProcessingResponse::default()
    }
}

fn streamed((body, end_of_stream): (Vec<u8>, bool)) -> BodyMutation {
    BodyMutation {
        mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
            body,
            end_of_stream,
            ..StreamedBodyResponse::default()
        })),
    }
}

/// The request body echoed back as `streamed_response` chunks of at most [`MAX_CHUNK`] bytes;
/// the last chunk carries `end_of_stream` (an empty body is one empty chunk).
pub(super) fn echo_request_body(body: &[u8], end_of_stream: bool) -> Vec<ProcessingResponse> {
    let mut chunks: Vec<&[u8]> = body.chunks(MAX_CHUNK).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| {
            request_body(
                CommonResponse {
                    body_mutation: Some(streamed((chunk.to_vec(), end_of_stream && i == last))),
                    ..CommonResponse::default()
                },
                None,
            )
        })
        .collect()
}

/// The error document: OpenAI's `{"error": {"message", "type", "param", "code"}}`, or
/// Anthropic's `{"type": "error", "error": {"type", "message"}}` with Anthropic's error types.
pub fn error_body(rejection: &Rejection) -> Vec<u8> {
    let body = match rejection.style {
        ErrorStyle::OpenAi => serde_json::json!({
            "error": {
                "message": rejection.message,
                "type": rejection.error_type,
                "param": null,
                "code": rejection.status,
            }
        }),
        ErrorStyle::Anthropic => serde_json::json!({
            "type": "error",
            "error": {
                "type": anthropic_error_type(rejection),
                "message": rejection.message,
            }
        }),
    };
    body.to_string().into_bytes()
}

/// Anthropic's name for a refusal with this status.
fn anthropic_error_type(rejection: &Rejection) -> &'static str {
    match rejection.status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        500..=599 => "api_error",
        _ => rejection.error_type,
    }
}

/// A local reply with `rejection` as the JSON error body.
pub(super) fn immediate(rejection: &Rejection) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(rejection.status),
            }),
            headers: Some(HeaderMutation {
                set_headers: vec![header("content-type", "application/json")],
                ..HeaderMutation::default()
            }),
            body: error_body(rejection),
            details: format!("llmgw_{}", rejection.status),
            ..ImmediateResponse::default()
        })),
        ..ProcessingResponse::default()
    }
}
