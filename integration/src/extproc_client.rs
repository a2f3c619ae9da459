//! Asking a router over ext_proc directly, as Envoy's BUFFERED filter does: the request
//! headers, their answer, then the whole body, whose answer carries the routing.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use thiserror::Error;
use tonic::transport::Channel;

#[derive(Debug, Error)]
pub enum RouteError {
    #[error("cannot reach the router's ext_proc port: {0}")]
    Connect(#[from] tonic::transport::Error),
    #[error("ext_proc stream: {0}")]
    Stream(#[from] tonic::Status),
    #[error("the router closed the stream before answering the {0}")]
    NoAnswer(&'static str),
}

/// One router's ext_proc service.
pub struct ExtProcClient {
    client: ExternalProcessorClient<Channel>,
}

/// A routed request: the body's answer, and the time from sending the body to it.
pub struct Routed {
    pub answer: ProcessingResponse,
    pub rtt: Duration,
}

impl Routed {
    /// The destination the answer sets (primary first, then fallbacks), if it routes.
    pub fn destination(&self) -> Option<String> {
        destination_of(&self.answer)
    }
}

impl ExtProcClient {
    pub async fn connect(grpc: SocketAddr) -> Result<ExtProcClient, RouteError> {
        let client = ExternalProcessorClient::connect(format!("http://{grpc}")).await?;
        Ok(ExtProcClient { client })
    }

    /// Sends a POST to `path` with `body` on a stream of its own.
    pub async fn route(&mut self, path: &str, body: &[u8]) -> Result<Routed, RouteError> {
        let (sender, receiver) = tokio::sync::mpsc::channel(4);
        let mut answers = self
            .client
            .process(tokio_stream::wrappers::ReceiverStream::new(receiver))
            .await?
            .into_inner();
        let header = |key: &str, value: &str| HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        };
        let headers = ProcessingRequest {
            protocol_config: Some(ProtocolConfiguration {
                request_body_mode: BodySendMode::Buffered as i32,
                response_body_mode: BodySendMode::None as i32,
                ..Default::default()
            }),
            request: Some(Message::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: vec![
                        header(":method", "POST"),
                        header(":path", path),
                        header(":authority", "llmgw-test"),
                        header("content-type", "application/json"),
                    ],
                }),
                end_of_stream: false,
                ..Default::default()
            })),
            ..Default::default()
        };
        // A send fails only when the stream is gone; the next read says why.
        let _ = sender.send(headers).await;
        answers
            .message()
            .await?
            .ok_or(RouteError::NoAnswer("request headers"))?;
        let started = Instant::now();
        let body = ProcessingRequest {
            request: Some(Message::RequestBody(HttpBody {
                body: body.to_vec(),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        };
        let _ = sender.send(body).await;
        let answer = answers
            .message()
            .await?
            .ok_or(RouteError::NoAnswer("request body"))?;
        Ok(Routed {
            answer,
            rtt: started.elapsed(),
        })
    }
}

/// The destination header (`x-gateway-destination-endpoint`) an answer sets, if any.
pub fn destination_of(answer: &ProcessingResponse) -> Option<String> {
    let common = match answer.response.as_ref()? {
        Answer::RequestBody(b) => b.response.as_ref()?,
        Answer::RequestHeaders(h) => h.response.as_ref()?,
        _ => return None,
    };
    common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == llmgw::extproc::DESTINATION_HEADER)
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
}
