//! The router's request-path costs: parsing a request body (1 MB text prompt, 1 MB chat, 200 KB
//! token ids), one scheduling decision over 8 and 64 replicas (filters, three load scorers,
//! picker, in-flight guard), and decoding Envoy's BUFFERED body message (the ext_proc wire type
//! that keeps the body a slice of the receive buffer, beside `envoy-types`' generated message,
//! which copies it). `cargo bench -p llmgw --bench router`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a bench or test harness: a panic is a failed run, not a crashed router"
)]

use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use llmgw::openai::{EndpointKind, parse_request};
use llmgw::pool::{EngineLoad, Health, Pool, ReplicaSpec};
use llmgw::scheduler::{Scheduler, Scope};

/// JSON-escaped prose with quotes, newlines and non-ASCII, about `bytes` long.
fn escaped_text(bytes: usize) -> String {
    let words = [
        "the ",
        "quick ",
        "brown ",
        "fox ",
        "jumps\\n",
        "über ",
        "\\\"lazy\\\" ",
        "dog. ",
    ];
    let mut text = String::with_capacity(bytes + 16);
    let mut i = 0;
    while text.len() < bytes {
        text.push_str(words[i % words.len()]);
        i += 1;
    }
    text
}

fn text_body(bytes: usize) -> String {
    let prompt = escaped_text(bytes);
    format!(
        r#"{{"model":"tiny","prompt":"{prompt}","max_tokens":16,"stream":true,"temperature":0.2}}"#
    )
}

fn chat_body(bytes: usize) -> String {
    let content = escaped_text(bytes / 4);
    let message = format!(r#"{{"role":"user","content":"{content}"}}"#);
    format!(
        r#"{{"model":"tiny","messages":[{m},{{"role":"assistant","content":"ok"}},{m},{m},{m}],"tools":[{{"type":"function","function":{{"name":"f","parameters":{{}}}}}}],"chat_template_kwargs":{{"enable_thinking":false}},"stream":true}}"#,
        m = message
    )
}

fn token_body(count: usize) -> String {
    let ids: Vec<String> = (0..count)
        .map(|i| ((i * 7919) % 151_000).to_string())
        .collect();
    format!(
        r#"{{"model":"tiny","prompt":[{}],"max_tokens":1}}"#,
        ids.join(",")
    )
}

fn parsing(c: &mut Criterion) {
    let mut group = c.benchmark_group("openai_parse");
    let cases = [
        (
            "completion_text_1MB",
            EndpointKind::Completions,
            text_body(1 << 20),
        ),
        (
            "chat_1MB",
            EndpointKind::ChatCompletions,
            chat_body(1 << 20),
        ),
        (
            "completion_text_8KB",
            EndpointKind::Completions,
            text_body(8 << 10),
        ),
        (
            "completion_token_ids_40k",
            EndpointKind::Completions,
            token_body(40_000),
        ),
    ];
    for (name, kind, body) in cases {
        assert!(
            parse_request(kind, body.as_bytes()).is_ok(),
            "{name} must parse"
        );
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function(name, |b| {
            b.iter(|| parse_request(kind, black_box(body.as_bytes())))
        });
    }
    group.finish();
}

fn decision(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("scheduler_decide");
    for replicas in [8u16, 64] {
        let specs = (0..replicas)
            .map(|i| ReplicaSpec {
                address: SocketAddr::from(([10, 0, 0, 1], 8000 + i)),
                models: vec!["tiny".to_string()],
                node: None,
            })
            .collect();
        let pool = Arc::new(Pool::new(specs, Duration::from_secs(3600)));
        let now = runtime.block_on(async { tokio::time::Instant::now() });
        for (i, replica) in pool.snapshot().replicas().iter().enumerate() {
            replica.set_health(Health::Healthy);
            replica.record_scrape(
                EngineLoad {
                    waiting: Some((i % 5) as f64),
                    running: Some((i % 7) as f64),
                    kv_cache_usage: Some((i % 10) as f64 / 10.0),
                },
                now,
            );
        }
        let scheduler = Scheduler::load_only(pool).expect("load-only profile");
        let request = parse_request(EndpointKind::Completions, text_body(8 << 10).as_bytes())
            .expect("request parses");
        group.bench_function(format!("{replicas}_replicas"), |b| {
            b.iter(|| {
                runtime.block_on(async {
                    let decision = scheduler
                        .decide(black_box(&request), &[], Scope::default())
                        .await
                        .expect("decision");
                    black_box(decision.destination())
                })
            })
        });
    }
    group.finish();
}

/// One `ProcessingRequest{request_body}` message as tonic hands it to the decoder: encoded bytes
/// in a shared buffer.
fn extproc_decode(c: &mut Criterion) {
    use bytes::Bytes;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
    use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, ProcessingRequest};
    use llmgw::extproc::wire::{Inbound, InboundPart};
    use prost::Message;

    let mut group = c.benchmark_group("extproc_decode_body");
    for (name, bytes) in [("8KB", 8usize << 10), ("200KB", 200 << 10)] {
        let message = ProcessingRequest {
            request: Some(Request::RequestBody(HttpBody {
                body: text_body(bytes).into_bytes(),
                end_of_stream: true,
                ..HttpBody::default()
            })),
            ..ProcessingRequest::default()
        };
        let encoded = Bytes::from(message.encode_to_vec());
        group.throughput(Throughput::Bytes(encoded.len() as u64));
        group.bench_function(format!("envoy_types_{name}"), |b| {
            b.iter(|| {
                let decoded =
                    ProcessingRequest::decode(black_box(encoded.clone())).expect("decodes");
                match decoded.request {
                    Some(Request::RequestBody(body)) => black_box(body.body.len()),
                    _ => unreachable!(),
                }
            })
        });
        group.bench_function(format!("wire_inbound_{name}"), |b| {
            b.iter(|| {
                let decoded = Inbound::decode(black_box(encoded.clone())).expect("decodes");
                match decoded.request {
                    Some(InboundPart::RequestBody(body)) => black_box(body.body.len()),
                    _ => unreachable!(),
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, parsing, decision, extproc_decode);
criterion_main!(benches);
