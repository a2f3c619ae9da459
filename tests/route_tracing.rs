//! A routing decision driven through the ext_proc state machine with the real router, exported
//! over OTLP/gRPC to an in-process collector.
//!
//! A test binary of its own: `tracing` caches each span callsite's interest process-wide, and a
//! library test that reaches the same callsites without a subscriber while this test installs
//! its own can leave a span disabled for it; the likely cause of one `make test` run in which
//! the `tokenize` span was missing when this test ran among the library's tests.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test harness: a panic is a failed test"
)]

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span as OtlpSpan;
use parking_lot::Mutex;
use tracing_subscriber::layer::SubscriberExt;

use llmgw::blockhash::{BlockHasher, ExternalHash, HashSettings};
use llmgw::extproc::state::StreamState;
use llmgw::extproc::{DESTINATION_HEADER, ExtProcSettings};
use llmgw::kvindex::{IndexConfig, KvEventSink, KvIndex, Medium};
use llmgw::metrics::Metrics;
use llmgw::models::HashersByModel;
use llmgw::pool::{Health, Pool, ReplicaSpec};
use llmgw::router::Router;
use llmgw::scheduler::{PluginResources, Scheduler, SchedulerConfig};
use llmgw::telemetry::{TRACEPARENT, otel_layer, tracer_provider};
use llmgw::tokenize::{Tokenizer, TokenizerConfig};

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";
const BLOCK: usize = 4;

/// An OTLP collector that keeps every span it is sent.
#[derive(Default, Clone)]
struct Collector {
    spans: Arc<Mutex<Vec<OtlpSpan>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans = request
            .into_inner()
            .resource_spans
            .into_iter()
            .flat_map(|r| r.scope_spans)
            .flat_map(|s| s.spans);
        self.spans.lock().extend(spans);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

async fn collector() -> (Collector, SocketAddr) {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(collector.clone()))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(server);
    (collector, addr)
}

/// Two healthy replicas of `tiny`; the index says 127.0.0.1:8002 holds `tokens`' blocks.
fn router(tokens: &[u32]) -> Router {
    let specs = [8001, 8002]
        .map(|port| ReplicaSpec {
            address: SocketAddr::from(([127, 0, 0, 1], port)),
            models: vec!["tiny".to_string()],
            node: None,
        })
        .to_vec();
    let pool = Arc::new(Pool::new(specs, Duration::from_secs(60)));
    for replica in pool.snapshot().replicas() {
        replica.set_health(Health::Healthy);
    }
    let hasher = Arc::new(
        BlockHasher::new(&HashSettings::sha256_cbor(
            NonZeroUsize::new(BLOCK).expect("nonzero"),
            Some("0"),
        ))
        .expect("hasher"),
    );
    let mut hashes: Vec<ExternalHash> = Vec::new();
    hasher.external_hashes_into(tokens, None, &mut hashes);
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    index.stored("127.0.0.1:8002", &hashes, Medium::Gpu);
    let resources = PluginResources {
        index,
        tokenizer: Arc::new(Tokenizer::new(TokenizerConfig::default())),
        hashers: Arc::new(HashersByModel::from([("tiny".to_string(), hasher)])),
        picks: Arc::default(),
    };
    let scheduler = Scheduler::build(
        Arc::clone(&pool),
        &SchedulerConfig::default(),
        &resources,
        &mut prometheus_client::registry::Registry::default(),
    )
    .expect("default profile");
    Router::new(scheduler, Arc::new(Metrics::new(pool)), false)
}

fn header(key: &str, value: &str) -> HeaderValue {
    HeaderValue {
        key: key.to_string(),
        raw_value: value.as_bytes().to_vec(),
        ..HeaderValue::default()
    }
}

/// Sends one BUFFERED request (headers with `traceparent`, then the body) and returns the
/// body answer, which carries the routing.
async fn route_one(router: Router, body: &str) -> ProcessingResponse {
    let mut state = StreamState::new(Arc::new(router), Arc::new(ExtProcSettings::default()));
    let headers = ProcessingRequest {
        request: Some(Message::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":method", "POST"),
                    header(":path", "/v1/completions"),
                    header(TRACEPARENT, &format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01")),
                ],
            }),
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    };
    state.on_message(headers).await.expect("headers answered");
    let body = ProcessingRequest {
        request: Some(Message::RequestBody(HttpBody {
            body: body.as_bytes().to_vec(),
            end_of_stream: true,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    };
    let mut answers = state.on_message(body).await.expect("body answered");
    assert_eq!(answers.len(), 1, "{answers:?}");
    answers.remove(0)
}

fn set_headers(answer: &ProcessingResponse) -> Vec<(String, String)> {
    let Some(Answer::RequestBody(body)) = &answer.response else {
        panic!("not a body answer: {answer:?}");
    };
    body.response
        .as_ref()
        .and_then(|c| c.header_mutation.as_ref())
        .map(|m| m.set_headers.as_slice())
        .unwrap_or_default()
        .iter()
        .filter_map(|h| h.header.as_ref())
        .map(|h| {
            (
                h.key.clone(),
                String::from_utf8_lossy(&h.raw_value).into_owned(),
            )
        })
        .collect()
}

fn attribute(span: &OtlpSpan, key: &str) -> Option<AnyValue> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.clone())
}

fn string_attribute(span: &OtlpSpan, key: &str) -> Option<String> {
    match attribute(span, key)? {
        AnyValue::StringValue(s) => Some(s),
        _ => None,
    }
}

fn int_attribute(span: &OtlpSpan, key: &str) -> Option<i64> {
    match attribute(span, key)? {
        AnyValue::IntValue(i) => Some(i),
        _ => None,
    }
}

/// The collected spans once one named `route` has arrived, or whatever arrived by a generous
/// deadline (the assertions then say what is missing).
async fn spans_with_route(collector: &Collector) -> Vec<OtlpSpan> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let spans = collector.spans.lock().clone();
        if spans.iter().any(|s| s.name == "route") || tokio::time::Instant::now() > deadline {
            return spans;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routing_decision_is_exported_as_a_child_of_the_callers_span() {
    let (collector, addr) = collector().await;
    let provider = tracer_provider(&format!("http://{addr}"), "llmgw-router").expect("provider");
    let subscriber =
        tracing_subscriber::registry().with(otel_layer(&provider, "llmgw-router", &["llmgw"]));
    // The test body runs on this thread: the subscriber sees the whole decision.
    let default = tracing::subscriber::set_default(subscriber);

    let tokens: Vec<u32> = (1..=16).collect(); // 4 blocks
    let body = serde_json::json!({"model": "tiny", "prompt": tokens}).to_string();
    let answer = route_one(router(&tokens), &body).await;
    drop(default);

    let headers = set_headers(&answer);
    let destination = headers
        .iter()
        .find(|(k, _)| k == DESTINATION_HEADER)
        .map(|(_, v)| v.as_str());
    assert!(
        destination.is_some_and(|d| d.starts_with("127.0.0.1:8002")),
        "{headers:?}"
    );
    let traceparent = headers
        .iter()
        .find(|(k, _)| k == TRACEPARENT)
        .map(|(_, v)| v.clone())
        .expect("a traceparent for the replica");

    // Export now rather than on the batch timer.
    tokio::task::spawn_blocking(move || provider.force_flush())
        .await
        .expect("flush task")
        .expect("flush");
    let spans = spans_with_route(&collector).await;
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    let route = spans
        .iter()
        .find(|s| s.name == "route")
        .unwrap_or_else(|| panic!("no route span among {names:?}"));

    assert_eq!(hex::encode(&route.trace_id), CALLER_TRACE);
    assert_eq!(hex::encode(&route.parent_span_id), CALLER_SPAN);
    let route_id = hex::encode(&route.span_id);
    assert_eq!(
        traceparent,
        format!("00-{CALLER_TRACE}-{route_id}-01"),
        "the replica continues the route span"
    );

    for child in ["parse", "tokenize", "hash", "index_lookup", "score"] {
        let span = spans
            .iter()
            .find(|s| s.name == child)
            .unwrap_or_else(|| panic!("no {child} span among {names:?}"));
        assert_eq!(span.trace_id, route.trace_id, "{child}");
        assert_eq!(
            span.parent_span_id, route.span_id,
            "{child} is a child of route"
        );
    }

    assert_eq!(string_attribute(route, "model").as_deref(), Some("tiny"));
    assert_eq!(string_attribute(route, "tier").as_deref(), Some("index"));
    assert_eq!(
        string_attribute(route, "prefix_outcome").as_deref(),
        Some("hit")
    );
    assert_eq!(
        string_attribute(route, "pick").as_deref(),
        Some("127.0.0.1:8002")
    );
    assert_eq!(int_attribute(route, "prompt_blocks"), Some(4));
    assert_eq!(int_attribute(route, "matched_blocks"), Some(4));
    // The decision's scores: the counted scorers, then per candidate (8001, 8002) its total and
    // each score; kv_cache first, holding the whole prompt at 8002 only.
    let scores = string_attribute(route, "scores").expect("a scores attribute");
    let parts: Vec<&str> = scores.split('|').collect();
    assert_eq!(parts.len(), 3, "{scores}");
    assert!(parts[0].starts_with("kv_cache,"), "{scores}");
    let kv_cache_score = |part: &str| part.split('/').nth(1).map(str::to_owned);
    assert_eq!(
        kv_cache_score(parts[1]).as_deref(),
        Some("0.00"),
        "{scores}"
    );
    assert_eq!(
        kv_cache_score(parts[2]).as_deref(),
        Some("1.00"),
        "{scores}"
    );
}
