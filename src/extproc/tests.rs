use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use parking_lot::Mutex;

use super::state::StreamState;
use super::*;

/// Routes everything to one fixed destination, or rejects when the body says "reject"; records
/// what it was asked and counts live holds.
#[derive(Default)]
struct FakePicker {
    seen: Mutex<Vec<RoutingRequest>>,
    live_holds: Arc<AtomicUsize>,
    served: Mutex<Vec<String>>,
    finished: Mutex<Vec<Exchange>>,
}

struct FakeHold(Arc<AtomicUsize>);

impl Drop for FakeHold {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Picker for FakePicker {
    type Hold = FakeHold;

    async fn pick(&self, request: RoutingRequest) -> Result<Routed<FakeHold>, Rejection> {
        let reject = request.body.as_deref() == Some(b"reject".as_slice());
        self.seen.lock().push(request);
        if reject {
            return Err(Rejection::new(429, "rate_limit_error", "busy"));
        }
        self.live_holds.fetch_add(1, Ordering::SeqCst);
        Ok(Routed {
            destination: "10.0.0.1:8000,10.0.0.2:8000".to_string(),
            hold: FakeHold(Arc::clone(&self.live_holds)),
            headers: Vec::new(),
        })
    }

    fn served(&self, _hold: &mut FakeHold, endpoint: &str) {
        self.served.lock().push(endpoint.to_string());
    }

    fn finished(&self, _hold: FakeHold, exchange: Exchange) {
        self.finished.lock().push(exchange);
    }

    /// Names the last endpoint reported as served.
    fn response_headers(&self, _hold: &FakeHold) -> Vec<(&'static str, String)> {
        let served = self.served.lock().last().cloned();
        served.map(|s| ("x-served", s)).into_iter().collect()
    }
}

/// `envoy.lb: {key: value}` metadata as Envoy forwards it.
fn lb_metadata(key: &str, value: &str) -> Metadata {
    Metadata {
        filter_metadata: [(
            "envoy.lb".to_string(),
            Struct {
                fields: [(
                    key.to_string(),
                    Value {
                        kind: Some(Kind::StringValue(value.to_string())),
                    },
                )]
                .into_iter()
                .collect(),
            },
        )]
        .into_iter()
        .collect(),
        ..Default::default()
    }
}

fn settings() -> ExtProcSettings {
    ExtProcSettings {
        max_body_bytes: 200_000,
        ..ExtProcSettings::default()
    }
}

fn headers_msg(
    mode: BodySendMode,
    end_of_stream: bool,
    extra: &[(&str, &str)],
) -> ProcessingRequest {
    let mut headers = vec![
        HeaderValue {
            key: ":method".into(),
            raw_value: b"POST".to_vec(),
            ..Default::default()
        },
        HeaderValue {
            key: ":path".into(),
            raw_value: b"/v1/completions".to_vec(),
            ..Default::default()
        },
    ];
    for (k, v) in extra {
        headers.push(HeaderValue {
            key: k.to_string(),
            raw_value: v.as_bytes().to_vec(),
            ..Default::default()
        });
    }
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: BodySendMode::None as i32,
            ..Default::default()
        }),
        request: Some(Message::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// A request-body message.
fn body_msg(body: &[u8], end_of_stream: bool) -> ProcessingRequest {
    message(Message::RequestBody(http_body(body, end_of_stream)))
}

/// A response-body message.
fn response_body_msg(body: &[u8], end_of_stream: bool) -> ProcessingRequest {
    message(Message::ResponseBody(http_body(body, end_of_stream)))
}

fn http_body(body: &[u8], end_of_stream: bool) -> HttpBody {
    HttpBody {
        body: body.to_vec(),
        end_of_stream,
        ..Default::default()
    }
}

fn message(part: Message) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(part),
        ..Default::default()
    }
}

fn common(answer: &ProcessingResponse) -> &CommonResponse {
    match answer.response.as_ref().unwrap() {
        Answer::RequestHeaders(h) => h.response.as_ref().unwrap(),
        Answer::RequestBody(b) => b.response.as_ref().unwrap(),
        other => panic!("no common response in {other:?}"),
    }
}

fn set_header<'a>(common: &'a CommonResponse, key: &str) -> Option<&'a str> {
    common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == key)
        .map(|h| std::str::from_utf8(&h.raw_value).unwrap())
}

fn lb_destination(answer: &ProcessingResponse) -> Option<&str> {
    let lb = answer.dynamic_metadata.as_ref()?.fields.get("envoy.lb")?;
    let Some(Kind::StructValue(inner)) = &lb.kind else {
        return None;
    };
    match &inner.fields.get(DESTINATION_HEADER)?.kind {
        Some(Kind::StringValue(s)) => Some(s),
        _ => None,
    }
}

fn assert_routed(answer: &ProcessingResponse) {
    let common = common(answer);
    assert!(common.clear_route_cache);
    assert_eq!(
        set_header(common, DESTINATION_HEADER),
        Some("10.0.0.1:8000,10.0.0.2:8000")
    );
    assert_eq!(lb_destination(answer), Some("10.0.0.1:8000,10.0.0.2:8000"));
}

fn state(picker: &Arc<FakePicker>) -> StreamState<FakePicker> {
    StreamState::new(Arc::clone(picker), Arc::new(settings()))
}

/// Sends `message`: the one answer it must get.
async fn only_answer(
    stream: &mut StreamState<FakePicker>,
    message: ProcessingRequest,
) -> ProcessingResponse {
    let mut answers = stream.on_message(message).await.unwrap();
    assert_eq!(answers.len(), 1, "{answers:?}");
    answers.remove(0)
}

fn is_headers_answer(answer: &ProcessingResponse) -> bool {
    matches!(answer.response, Some(Answer::RequestHeaders(_)))
}

fn is_body_answer(answer: &ProcessingResponse) -> bool {
    matches!(answer.response, Some(Answer::RequestBody(_)))
}

#[tokio::test]
async fn buffered_answers_headers_at_once_and_routes_on_the_body() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    let answer = only_answer(
        &mut stream,
        headers_msg(
            BodySendMode::Buffered,
            false,
            &[(DESTINATION_HEADER, "6.6.6.6:1")],
        ),
    )
    .await;
    let Some(Answer::RequestHeaders(headers)) = &answer.response else {
        panic!("expected a headers answer: {answer:?}")
    };
    let removed = &headers
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap()
        .remove_headers;
    assert_eq!(removed, &vec![DESTINATION_HEADER.to_string()]);

    let answer = only_answer(&mut stream, body_msg(b"{\"x\":1}", true)).await;
    assert!(is_body_answer(&answer));
    assert_routed(&answer);
    assert!(common(&answer).body_mutation.is_none());

    let seen = picker.seen.lock();
    assert_eq!(seen[0].method, "POST");
    assert_eq!(seen[0].path, "/v1/completions");
    assert_eq!(seen[0].body.as_deref(), Some(b"{\"x\":1}".as_slice()));
    drop(seen);
    assert!(stream.holding());
    assert_eq!(picker.live_holds.load(Ordering::SeqCst), 1);
    drop(stream);
    assert_eq!(picker.live_holds.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn headers_only_request_is_routed_on_the_headers() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    let answer = only_answer(&mut stream, headers_msg(BodySendMode::Buffered, true, &[])).await;
    assert!(is_headers_answer(&answer));
    assert_routed(&answer);
    assert_eq!(picker.seen.lock()[0].body.as_deref(), Some(b"".as_slice()));
}

#[tokio::test]
async fn full_duplex_holds_headers_then_echoes_body_in_64k_chunks() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    assert!(
        stream
            .on_message(headers_msg(BodySendMode::FullDuplexStreamed, false, &[]))
            .await
            .unwrap()
            .is_empty()
    );
    let body: Vec<u8> = (0..150_000u32).map(|i| (i % 251) as u8).collect();
    assert!(
        stream
            .on_message(body_msg(&body[..70_000], false))
            .await
            .unwrap()
            .is_empty()
    );
    let answers = stream
        .on_message(body_msg(&body[70_000..], true))
        .await
        .unwrap();

    assert!(is_headers_answer(&answers[0]));
    assert_routed(&answers[0]);
    assert_eq!(
        set_header(common(&answers[0]), "content-length"),
        Some("150000")
    );
    let mut echoed = Vec::new();
    for (i, answer) in answers[1..].iter().enumerate() {
        let Some(Mutation::StreamedResponse(chunk)) = common(answer)
            .body_mutation
            .as_ref()
            .and_then(|m| m.mutation.as_ref())
        else {
            panic!("expected a streamed body chunk");
        };
        assert!(chunk.body.len() <= MAX_CHUNK);
        assert_eq!(chunk.end_of_stream, i == answers.len() - 2);
        echoed.extend_from_slice(&chunk.body);
    }
    assert_eq!(answers.len(), 1 + 3);
    assert_eq!(echoed, body);
    assert_eq!(picker.seen.lock()[0].body.as_deref(), Some(body.as_slice()));
}

/// STREAMED request headers from a filter with `send_body_without_waiting_for_header_response`,
/// carrying a client's copy of the destination header.
fn streamed_ahead_headers_msg() -> ProcessingRequest {
    let mut message = headers_msg(
        BodySendMode::Streamed,
        false,
        &[(DESTINATION_HEADER, "6.6.6.6:1")],
    );
    if let Some(config) = message.protocol_config.as_mut() {
        config.send_body_without_waiting_for_header_response = true;
    }
    message
}

/// The modes that hold the header answer (full duplex, streamed ahead) route on the trailers
/// when the body ends with them: the header answer, the body's answer, the trailers' answer.
#[tokio::test]
async fn held_header_modes_route_on_the_trailers() {
    let full_duplex = headers_msg(BodySendMode::FullDuplexStreamed, false, &[]);
    for headers in [full_duplex, streamed_ahead_headers_msg()] {
        let picker = Arc::new(FakePicker::default());
        let mut stream = state(&picker);
        assert!(stream.on_message(headers).await.unwrap().is_empty());
        assert!(
            stream
                .on_message(body_msg(b"abc", false))
                .await
                .unwrap()
                .is_empty()
        );
        let answers = stream
            .on_message(ProcessingRequest {
                request: Some(Message::RequestTrailers(HttpTrailers::default())),
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(answers.len(), 3);
        assert_routed(&answers[0]);
        assert!(is_body_answer(&answers[1]));
        assert!(matches!(
            answers[2].response,
            Some(Answer::RequestTrailers(_))
        ));
    }
}

#[tokio::test]
async fn streamed_ahead_holds_headers_then_continues_each_chunk() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    assert!(
        stream
            .on_message(streamed_ahead_headers_msg())
            .await
            .unwrap()
            .is_empty(),
        "the header answer waits for the body"
    );
    for chunk in [&b"{\"prompt\":"[..], b""] {
        assert!(
            stream
                .on_message(body_msg(chunk, false))
                .await
                .unwrap()
                .is_empty()
        );
    }
    let answers = stream.on_message(body_msg(b"\"x\"}", true)).await.unwrap();

    assert_eq!(
        answers.len(),
        1 + 3,
        "headers, then one answer per body message"
    );
    assert!(is_headers_answer(&answers[0]));
    assert_routed(&answers[0]); // the client's "6.6.6.6:1" overwritten
    assert_eq!(
        set_header(common(&answers[0]), "content-length"),
        None,
        "the body passes unchanged"
    );
    for answer in &answers[1..] {
        assert!(is_body_answer(answer));
        assert_eq!(common(answer), &CommonResponse::default());
    }
    assert_eq!(
        picker.seen.lock()[0].body.as_deref(),
        Some(b"{\"prompt\":\"x\"}".as_slice())
    );
    assert!(stream.holding());
}

#[tokio::test]
async fn streamed_without_the_flag_answers_each_message_at_once() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    let answer = only_answer(&mut stream, headers_msg(BodySendMode::Streamed, false, &[])).await;
    assert!(is_headers_answer(&answer));
    assert_eq!(lb_destination(&answer), None);
    let answer = only_answer(&mut stream, body_msg(b"{", false)).await;
    assert_eq!(lb_destination(&answer), None);
    let answer = only_answer(&mut stream, body_msg(b"}", true)).await;
    assert!(is_body_answer(&answer));
    assert_routed(&answer);
}

#[tokio::test]
async fn oversized_body_gets_413_json() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    stream
        .on_message(headers_msg(BodySendMode::FullDuplexStreamed, false, &[]))
        .await
        .unwrap();
    stream
        .on_message(body_msg(&[b'a'; 150_000], false))
        .await
        .unwrap();
    let answers = stream
        .on_message(body_msg(&[b'a'; 60_000], false))
        .await
        .unwrap();
    let Some(Answer::ImmediateResponse(immediate)) = &answers[0].response else {
        panic!("expected an immediate response")
    };
    assert_eq!(immediate.status.as_ref().unwrap().code, 413);
    let error: serde_json::Value = serde_json::from_slice(&immediate.body).unwrap();
    assert_eq!(error["error"]["code"], 413);
    assert_eq!(error["error"]["type"], "invalid_request_error");
    assert!(stream.finished());
    assert!(picker.seen.lock().is_empty());
}

#[tokio::test]
async fn buffered_partial_routes_a_whole_body_and_refuses_a_cut_one() {
    for (end_of_stream, status) in [(true, None), (false, Some(413))] {
        let picker = Arc::new(FakePicker::default());
        let mut stream = state(&picker);
        stream
            .on_message(headers_msg(BodySendMode::BufferedPartial, false, &[]))
            .await
            .unwrap();
        let answers = stream
            .on_message(body_msg(b"{\"model\":", end_of_stream))
            .await
            .unwrap();
        match status {
            None => assert_routed(&answers[0]),
            Some(code) => {
                let Some(Answer::ImmediateResponse(immediate)) = &answers[0].response else {
                    panic!("expected an immediate response, got {answers:?}")
                };
                assert_eq!(immediate.status.as_ref().unwrap().code, code);
                assert!(picker.seen.lock().is_empty());
            }
        }
        assert!(
            stream.finished() || status.is_none(),
            "the stream is done with a refused request"
        );
    }
}

#[tokio::test]
async fn a_body_in_too_many_messages_gets_413_json() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    stream
        .on_message(headers_msg(BodySendMode::Streamed, false, &[]))
        .await
        .unwrap();
    for _ in 0..state::MAX_BODY_MESSAGES {
        stream.on_message(body_msg(b"", false)).await.unwrap();
    }
    let answers = stream.on_message(body_msg(b"x", false)).await.unwrap();
    let Some(Answer::ImmediateResponse(immediate)) = &answers[0].response else {
        panic!("expected an immediate response")
    };
    assert_eq!(immediate.status.as_ref().unwrap().code, 413);
    let error: serde_json::Value = serde_json::from_slice(&immediate.body).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("messages"),
        "{error}"
    );
    assert!(stream.finished());
    assert!(picker.seen.lock().is_empty());
}

#[tokio::test]
async fn picker_rejection_becomes_immediate_response() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    stream
        .on_message(headers_msg(BodySendMode::Buffered, false, &[]))
        .await
        .unwrap();
    let answers = stream.on_message(body_msg(b"reject", true)).await.unwrap();
    let Some(Answer::ImmediateResponse(immediate)) = &answers[0].response else {
        panic!("expected an immediate response")
    };
    assert_eq!(immediate.status.as_ref().unwrap().code, 429);
    let error: serde_json::Value = serde_json::from_slice(&immediate.body).unwrap();
    assert_eq!(error["error"]["message"], "busy");
    assert!(!stream.holding());
}

#[tokio::test]
async fn body_before_headers_is_a_protocol_error() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    assert_eq!(
        stream.on_message(body_msg(b"x", true)).await.unwrap_err(),
        ProtocolError::BeforeHeaders("request body")
    );
}

#[tokio::test]
async fn subset_hint_and_test_header_reach_the_picker() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    let mut message = headers_msg(
        BodySendMode::Buffered,
        true,
        &[(TEST_SELECTION_HEADER, "10.0.0.9:1")],
    );
    let hint = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: vec![
                Value {
                    kind: Some(Kind::StringValue("10.0.0.1:8000".into())),
                },
                Value {
                    kind: Some(Kind::StringValue("10.0.0.2:8000, 10.0.0.3:8000".into())),
                },
            ],
        })),
    };
    message.metadata_context = Some(Metadata {
        filter_metadata: [(
            "envoy.lb".to_string(),
            Struct {
                fields: [(SUBSET_HINT_KEY.to_string(), hint)].into_iter().collect(),
            },
        )]
        .into_iter()
        .collect(),
        ..Default::default()
    });
    stream.on_message(message).await.unwrap();
    let seen = picker.seen.lock();
    assert_eq!(
        seen[0].subset.as_deref(),
        Some(
            ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
                .map(String::from)
                .as_slice()
        )
    );
    assert_eq!(seen[0].test_selection.as_deref(), Some("10.0.0.9:1"));
}

/// The subset hint of one BUFFERED request whose metadata has `namespaces` → the hint's string.
async fn hint_seen(namespaces: &[(&str, &str)]) -> Option<Vec<String>> {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    let mut message = headers_msg(BodySendMode::Buffered, true, &[]);
    let string = |s: &str| Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    };
    message.metadata_context = Some(Metadata {
        filter_metadata: namespaces
            .iter()
            .map(|(namespace, hint)| {
                let fields = [(SUBSET_HINT_KEY.to_string(), string(hint))];
                (
                    namespace.to_string(),
                    Struct {
                        fields: fields.into_iter().collect(),
                    },
                )
            })
            .collect(),
        ..Default::default()
    });
    stream.on_message(message).await.unwrap();
    let seen = picker.seen.lock();
    seen[0].subset.clone()
}

#[tokio::test]
async fn the_subset_hint_is_read_from_gies_namespace_before_envoy_lb() {
    let gie = super::SUBSET_HINT_NAMESPACE;
    assert_eq!(
        hint_seen(&[(gie, "10.0.0.1:8000,10.0.0.2:8000")]).await,
        Some(vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()])
    );
    assert_eq!(
        hint_seen(&[("envoy.lb", "10.0.0.9:8000"), (gie, "10.0.0.1:8000")]).await,
        Some(vec!["10.0.0.1:8000".to_owned()]),
        "GIE's namespace wins over the older place"
    );
    assert_eq!(
        hint_seen(&[("envoy.lb", "10.0.0.9:8000")]).await,
        Some(vec!["10.0.0.9:8000".to_owned()]),
        "older gateways still work"
    );
    assert_eq!(hint_seen(&[("other", "10.0.0.9:8000")]).await, None);
    assert_eq!(
        hint_seen(&[(gie, "")]).await,
        Some(vec![]),
        "an empty hint is 503 downstream"
    );
}

#[tokio::test]
async fn response_messages_pass_through_and_echo_in_full_duplex() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    let mut message = headers_msg(BodySendMode::Buffered, true, &[]);
    message.protocol_config.as_mut().unwrap().response_body_mode =
        BodySendMode::FullDuplexStreamed as i32;
    stream.on_message(message).await.unwrap();
    let answers = stream
        .on_message(response_body_msg(b"data: x\n\n", true))
        .await
        .unwrap();
    let Some(Answer::ResponseBody(body)) = &answers[0].response else {
        panic!("expected a response body answer")
    };
    let Some(Mutation::StreamedResponse(chunk)) = body
        .response
        .as_ref()
        .and_then(|c| c.body_mutation.as_ref())
        .and_then(|m| m.mutation.as_ref())
    else {
        panic!("expected an echo")
    };
    assert_eq!(chunk.body, b"data: x\n\n");
    assert!(chunk.end_of_stream);
}

/// The whole gRPC path in process: a tonic server with the service, the generated client, and a
/// hold that lasts until the client closes its side of the stream.
#[tokio::test]
async fn grpc_stream_keeps_the_hold_until_the_stream_ends() {
    let picker = Arc::new(FakePicker::default());
    let (mut client, server) = serve_grpc(&picker).await;
    let (sender, mut answers) = open_stream(&mut client).await;
    sender
        .send(headers_msg(BodySendMode::Buffered, false, &[]))
        .await
        .unwrap();
    let first = answers.message().await.unwrap().unwrap();
    assert!(is_headers_answer(&first));
    sender.send(body_msg(b"{}", true)).await.unwrap();
    let second = answers.message().await.unwrap().unwrap();
    assert_routed(&second);
    assert_eq!(picker.live_holds.load(Ordering::SeqCst), 1);

    drop(sender);
    assert!(answers.message().await.unwrap().is_none());
    // The server drops the stream state once it has ended the response stream.
    for _ in 0..100 {
        if picker.live_holds.load(Ordering::SeqCst) == 0 {
            break;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(picker.live_holds.load(Ordering::SeqCst), 0);
    server.abort();
}

type Client = ExternalProcessorClient<tonic::transport::Channel>;

/// The service with `picker` in a tonic server on 127.0.0.1:0, and a client of it.
async fn serve_grpc(
    picker: &Arc<FakePicker>,
) -> (
    Client,
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
) {
    let service = ExtProcService::new(Arc::clone(picker), settings());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service.into_server())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let client = ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    (client, server)
}

/// One `Process` stream: where to send Envoy's messages, and the answers.
async fn open_stream(
    client: &mut Client,
) -> (
    tokio::sync::mpsc::Sender<ProcessingRequest>,
    tonic::Streaming<ProcessingResponse>,
) {
    let (sender, receiver) = tokio::sync::mpsc::channel(4);
    let answers = client
        .process(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    (sender, answers)
}

/// Over gRPC, a body over `max_body_bytes` still gets its 413 up to the message limit (twice
/// the body limit, so a BUFFERED body under the shipped configurations' Envoy buffers), and a
/// longer message ends the stream before the server reads it.
#[tokio::test]
async fn a_message_past_the_limit_ends_the_stream_and_a_body_past_it_gets_413() {
    let picker = Arc::new(FakePicker::default());
    let (client, server) = serve_grpc(&picker).await;
    let mut client = client.max_encoding_message_size(usize::MAX);
    let max_body = settings().max_body_bytes;
    for (body_bytes, code) in [
        (max_body + 1, Ok(413)),
        (max_body + MESSAGE_HEADROOM_BYTES + 1, Ok(413)),
        (2 * max_body + MESSAGE_HEADROOM_BYTES / 2, Ok(413)),
        (
            max_message_bytes(max_body) + 1,
            Err(tonic::Code::OutOfRange),
        ),
    ] {
        let (sender, mut answers) = open_stream(&mut client).await;
        sender
            .send(headers_msg(BodySendMode::Buffered, false, &[]))
            .await
            .unwrap();
        assert!(is_headers_answer(
            &answers.message().await.unwrap().unwrap()
        ));
        sender
            .send(body_msg(&vec![b'a'; body_bytes], true))
            .await
            .unwrap();
        let answer = match answers.message().await {
            Ok(Some(ProcessingResponse {
                response: Some(Answer::ImmediateResponse(immediate)),
                ..
            })) => Ok(immediate.status.map_or(0, |s| s.code)),
            Ok(other) => panic!("{body_bytes} bytes: {other:?}"),
            Err(status) => Err(status.code()),
        };
        assert_eq!(answer, code, "{body_bytes} bytes");
    }
    assert!(picker.seen.lock().is_empty());
    server.abort();
}

/// What Envoy sends, encoded by the generated types (with fields the wire type leaves out), decodes
/// as [`wire::Inbound`] with the same content, and the body is a slice of the receive buffer.
#[test]
fn wire_type_decodes_envoys_message_and_borrows_the_body() {
    use bytes::Bytes;
    use prost::Message as _;

    let body: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let mut original = body_msg(&body, true);
    original.metadata_context = Some(Metadata {
        filter_metadata: [(
            "envoy.lb".to_string(),
            Struct {
                fields: [(
                    SUBSET_HINT_KEY.to_string(),
                    Value {
                        kind: Some(Kind::StringValue("10.0.0.1:8000".to_string())),
                    },
                )]
                .into_iter()
                .collect(),
            },
        )]
        .into_iter()
        .collect(),
        ..Metadata::default()
    });
    original.observability_mode = true;
    original.attributes = [("k".to_string(), Struct::default())].into_iter().collect();
    original.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::FullDuplexStreamed as i32,
        ..ProtocolConfiguration::default()
    });
    let encoded = Bytes::from(original.encode_to_vec());
    let decoded = wire::Inbound::decode(encoded.clone()).unwrap();
    let Some(wire::InboundPart::RequestBody(got)) = &decoded.request else {
        panic!("expected a request body, got {decoded:?}")
    };
    assert_eq!(got.body, body);
    assert!(got.end_of_stream);
    let range = encoded.as_ptr_range();
    assert!(range.contains(&got.body.as_ptr()), "the body was copied");
    assert_eq!(decoded.metadata_context, original.metadata_context);
    assert_eq!(decoded.protocol_config, original.protocol_config);
    // The in-process conversion carries the same content.
    assert_eq!(wire::Inbound::from(original), decoded);
}

/// A method other than `Process` is answered `UNIMPLEMENTED`, as generated servers do.
#[tokio::test]
async fn unknown_method_is_unimplemented() {
    use tonic::codegen::Service as _;

    let picker = Arc::new(FakePicker::default());
    let mut server = ExtProcService::new(picker, settings()).into_server();
    let request = tonic::codegen::http::Request::builder()
        .uri("/envoy.service.ext_proc.v3.ExternalProcessor/Other")
        .body(tonic::body::Body::default())
        .unwrap();
    let response = server.call(request).await.unwrap();
    let status = response.headers().get("grpc-status").unwrap();
    assert_eq!(status, &(tonic::Code::Unimplemented as i32).to_string());
}

#[tokio::test]
async fn the_served_endpoint_is_reported_once_from_the_response_path() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    stream
        .on_message(headers_msg(BodySendMode::Buffered, true, &[]))
        .await
        .unwrap();
    let response_headers = |served: Option<&str>| ProcessingRequest {
        request: Some(Message::ResponseHeaders(HttpHeaders::default())),
        metadata_context: served.map(|s| lb_metadata(SERVED_KEY, s)),
        ..Default::default()
    };
    // A response message without the report changes nothing.
    stream.on_message(response_headers(None)).await.unwrap();
    assert!(picker.served.lock().is_empty());
    stream
        .on_message(response_headers(Some(" 10.0.0.2:8000 ")))
        .await
        .unwrap();
    let trailers = ProcessingRequest {
        request: Some(Message::ResponseTrailers(HttpTrailers::default())),
        metadata_context: Some(lb_metadata(SERVED_KEY, "10.0.0.3:8000")),
        ..Default::default()
    };
    stream.on_message(trailers).await.unwrap();
    assert_eq!(*picker.served.lock(), ["10.0.0.2:8000"]);
}

/// The header mutation of a response-headers answer, as `(key, value)` pairs.
fn response_header_mutation(answers: &[ProcessingResponse]) -> Option<Vec<(String, String)>> {
    let [answer] = answers else {
        panic!("one answer, not {answers:?}");
    };
    let Some(Answer::ResponseHeaders(headers)) = &answer.response else {
        panic!("not a response-headers answer: {answer:?}");
    };
    let mutation = headers.response.as_ref()?.header_mutation.as_ref()?;
    Some(
        mutation
            .set_headers
            .iter()
            .filter_map(|h| h.header.as_ref())
            .map(|h| {
                (
                    h.key.clone(),
                    String::from_utf8_lossy(&h.raw_value).into_owned(),
                )
            })
            .collect(),
    )
}

#[tokio::test]
async fn the_pickers_response_headers_are_set_on_a_routed_response_only() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    stream
        .on_message(headers_msg(BodySendMode::Buffered, true, &[]))
        .await
        .unwrap();
    let mut response_headers = ProcessingRequest {
        request: Some(Message::ResponseHeaders(HttpHeaders::default())),
        metadata_context: Some(lb_metadata(SERVED_KEY, "10.0.0.2:8000")),
        ..Default::default()
    };
    // The report comes with the same message, and is passed on before the headers are asked.
    let answers = stream.on_message(response_headers.clone()).await.unwrap();
    assert_eq!(
        response_header_mutation(&answers),
        Some(vec![("x-served".to_string(), "10.0.0.2:8000".to_string())])
    );

    // A stream whose request was never routed asks the picker nothing: the headers pass as
    // they are.
    let mut unrouted = state(&picker);
    response_headers.metadata_context = None;
    let answers = unrouted.on_message(response_headers).await.unwrap();
    assert_eq!(response_header_mutation(&answers), None);
}

#[tokio::test]
async fn a_served_report_before_any_pick_is_ignored() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    let mut message = headers_msg(BodySendMode::Buffered, true, &[]);
    message.metadata_context = Some(lb_metadata(SERVED_KEY, "10.0.0.2:8000"));
    stream.on_message(message).await.unwrap();
    assert!(picker.served.lock().is_empty());
}

#[tokio::test]
async fn the_exchange_is_reported_with_the_hold_when_the_stream_ends() {
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    stream
        .on_message(headers_msg(BodySendMode::Buffered, true, &[]))
        .await
        .unwrap();
    let mut status = HeaderMap::default();
    status.headers.push(HeaderValue {
        key: ":status".into(),
        raw_value: b"503".to_vec(),
        ..Default::default()
    });
    stream
        .on_message(ProcessingRequest {
            request: Some(Message::ResponseHeaders(HttpHeaders {
                headers: Some(status),
                ..Default::default()
            })),
            ..Default::default()
        })
        .await
        .unwrap();
    // A body longer than the tail kept: its bytes are counted, its end kept.
    let big = vec![b'x'; RESPONSE_TAIL + 10];
    for (chunk, end_of_stream) in [(&big[..], false), (&b"{\"usage\":1}"[..], true)] {
        stream
            .on_message(response_body_msg(chunk, end_of_stream))
            .await
            .unwrap();
    }
    assert!(
        picker.finished.lock().is_empty(),
        "not before the stream ends"
    );
    drop(stream);
    let finished = std::mem::take(&mut *picker.finished.lock());
    let [exchange] = finished.as_slice() else {
        panic!("one exchange, not {}", finished.len());
    };
    assert_eq!(exchange.status, Some(503));
    assert_eq!(exchange.response_bytes, (RESPONSE_TAIL + 10 + 11) as u64);
    let mut exchange = exchange.clone();
    let tail = exchange.response_tail();
    assert_eq!(tail.len(), RESPONSE_TAIL);
    assert!(tail.ends_with(b"x{\"usage\":1}"));
    assert!(exchange.complete);
    assert_eq!(picker.live_holds.load(Ordering::SeqCst), 0);

    // A rejected request holds nothing: nothing to report.
    let picker = Arc::new(FakePicker::default());
    let mut stream = state(&picker);
    stream
        .on_message(headers_msg(BodySendMode::Buffered, false, &[]))
        .await
        .unwrap();
    stream.on_message(body_msg(b"reject", true)).await.unwrap();
    drop(stream);
    assert!(picker.finished.lock().is_empty());
}

#[test]
fn the_response_tail_is_the_bodys_last_bytes_whatever_the_chunking() {
    let body: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
    for chunk_size in [1, 7, 4096, RESPONSE_TAIL, RESPONSE_TAIL + 3, body.len()] {
        let mut exchange = Exchange::new(tokio::time::Instant::now());
        let chunks: Vec<&[u8]> = body.chunks(chunk_size).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            exchange.response_chunk(chunk, i + 1 == chunks.len());
        }
        assert_eq!(exchange.response_bytes, body.len() as u64);
        assert!(exchange.complete);
        assert_eq!(
            exchange.response_tail(),
            &body[body.len() - RESPONSE_TAIL..],
            "chunks of {chunk_size}"
        );
    }
    let mut short = Exchange::new(tokio::time::Instant::now());
    short.response_chunk(b"ab", false);
    short.response_chunk(b"cd", false);
    assert_eq!(short.response_tail(), b"abcd");
    assert!(!short.complete);
}
