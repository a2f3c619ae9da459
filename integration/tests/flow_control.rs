//! Flow control through a real Envoy, with real `llmgw-sim` replicas, all on loopback: while
//! every replica is saturated requests wait in the router, go by priority and then by tenant
//! in turn, a full queue displaces the sheddable ones, a deadline answers 429, and malformed
//! flow-control headers get 400 with an OpenAI-style error.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test harness: a panic is a failed run, never a crashed router"
)]

mod router_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use llmgw_integration::{free_port, prom};
use parking_lot::Mutex;
use router_support::*;

const OBJECTIVE: &str = "x-gateway-inference-objective";
const TENANT: &str = "x-gateway-inference-fairness-id";

/// POSTs a completion to `url` with `headers`; returns the status and the body.
async fn send(url: String, prompt: &str, headers: Vec<(&'static str, String)>) -> (u16, String) {
    let body = serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 1});
    let mut request = client().post(url).json(&body);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let response = request.send().await.expect("request through envoy");
    let status = response.status().as_u16();
    (status, response.text().await.expect("body"))
}

fn error_of(body: &str) -> serde_json::Value {
    let error: serde_json::Value = serde_json::from_str(body).expect("JSON error body");
    error["error"].clone()
}

async fn queue_size(router: &RouterProcess) -> f64 {
    prom::sum(
        &router.metrics().await,
        "inference_extension_flow_control_queue_size",
        &[],
    )
    .unwrap_or(0.0)
}

async fn wait_queued(router: &RouterProcess, n: f64) {
    for _ in 0..200 {
        if queue_size(router).await == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the queue never held {n}: {}", queue_size(router).await);
}

async fn flow_requests(router: &RouterProcess, outcome: &str, priority: &str) -> f64 {
    prom::sum(
        &router.metrics().await,
        "llmgw_flow_control_requests_total",
        &[("outcome", outcome), ("priority", priority)],
    )
    .unwrap_or(0.0)
}

/// BUFFERED request bodies (the default configuration).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturated_requests_wait_by_priority_and_tenant_and_bad_headers_get_400() {
    flow_control_behind("envoy.yaml", false).await;
}

/// FULL_DUPLEX_STREAMED, as GIE gateways run it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_control_behind_a_gie_gateway() {
    flow_control_behind("envoy-gie.yaml", true).await;
}

async fn flow_control_behind(envoy_config: &str, envoy_checks_llmgw: bool) {
    // Slow decoding, so a held stream keeps its replica busy for as long as the test wants.
    let slow = [
        "--sim-decode-us-per-token",
        "50000",
        "--sim-output-len",
        "1000",
    ];
    let a = sim("a", &["tiny"], 0, &slow);
    let b = sim("b", &["tiny"], 0, &slow);
    let config = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "flow-control-{}-{envoy_config}",
        std::process::id()
    ));
    std::fs::write(
        &config,
        "flow_control:\n  max_queued: 4\n  queue_timeout: 20s\n  objectives:\n    - {name: interactive, priority: 10}\n    - {name: batch, priority: -1}\n",
    )
    .expect("write config");
    let grpc = free_port();
    let router = start_router(
        grpc,
        &[format!("tiny={}", a.addr), format!("tiny={}", b.addr)],
        &[
            "--config",
            config.to_str().expect("utf-8 path"),
            "--max-in-flight",
            "1",
        ],
    );
    router.wait_healthy(&[a.addr, b.addr]).await;
    let envoy = start_envoy(envoy_config, grpc, [a.addr, b.addr]).await;
    if envoy_checks_llmgw {
        envoy.wait_llmgw_marked_up().await;
    }
    let url = envoy.url("/v1/completions");

    // Malformed flow-control input: 400, an OpenAI-style error naming it, a metric.
    let long_tenant = "t".repeat(300);
    for (header, value, says) in [
        (
            OBJECTIVE,
            "premium",
            "unknown inference objective \"premium\"",
        ),
        ("x-llmgw-queue-timeout", "-1s", "already have passed"),
        ("x-llmgw-queue-timeout", "soon", "invalid duration"),
        (TENANT, long_tenant.as_str(), "more than the 256 allowed"),
    ] {
        let (status, body) = send(url.clone(), "bad", vec![(header, value.to_owned())]).await;
        assert_eq!(status, 400, "{header}: {body}");
        let error = error_of(&body);
        assert_eq!(error["type"], "invalid_request_error");
        let message = error["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{header}: {message}");
    }
    let metrics = router.metrics().await;
    for (reason, count) in [
        ("unknown_objective", 1.0),
        ("queue_timeout", 2.0),
        ("fairness_id", 1.0),
    ] {
        assert_eq!(
            prom::sum(
                &metrics,
                "llmgw_flow_control_bad_requests_total",
                &[("reason", reason)]
            ),
            Some(count),
            "{reason}"
        );
    }
    // A known objective with capacity: straight through.
    let (status, body) = send(
        url.clone(),
        "hello",
        vec![(OBJECTIVE, "interactive".to_owned())],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(flow_requests(&router, "admitted", "10").await, 1.0);

    // Saturate both replicas (--max-in-flight 1) with a long stream each.
    let long =
        serde_json::json!({"model": "tiny", "prompt": "busy", "max_tokens": 400, "stream": true});
    let mut held = Vec::new();
    for _ in 0..2 {
        let response = client()
            .post(&url)
            .json(&long)
            .send()
            .await
            .expect("long request");
        assert_eq!(response.status().as_u16(), 200);
        held.push(response);
    }

    // Nothing frees up within the request's own deadline: 429 when it passes (longer than
    // envoy.yaml's old 1s message timeout, after which Envoy failed the request over).
    let started = Instant::now();
    let (status, body) = send(
        url.clone(),
        "in a hurry",
        vec![("x-llmgw-queue-timeout", "1500ms".to_owned())],
    )
    .await;
    assert_eq!(status, 429, "{body}");
    assert!(started.elapsed() >= Duration::from_millis(1500));
    let error = error_of(&body);
    assert_eq!(error["type"], "rate_limit_error");
    assert!(
        error["message"]
            .as_str()
            .unwrap_or_default()
            .contains("within the queue timeout"),
        "{error}"
    );

    // Queue, in this order, each once the one before is waiting.
    let finished: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let mut answers = Vec::new();
    // What shows that an arrival has been taken in: the queue's size, or its displacing or
    // refusing an earlier request.
    enum Taken {
        Queued(f64),
        Counted(&'static str, &'static str, f64),
    }
    type Headers = Vec<(&'static str, String)>;
    let arrivals: [(&'static str, Headers, Taken); 7] = [
        (
            "batch-1",
            vec![(OBJECTIVE, "batch".into())],
            Taken::Queued(1.0),
        ),
        (
            "batch-2",
            vec![(OBJECTIVE, "batch".into())],
            Taken::Queued(2.0),
        ),
        (
            "noisy-1",
            vec![(TENANT, "noisy".into())],
            Taken::Queued(3.0),
        ),
        (
            "noisy-2",
            vec![(TENANT, "noisy".into())],
            Taken::Queued(4.0),
        ),
        // The queue is full (4): each of these displaces the newest sheddable request...
        (
            "quiet-1",
            vec![(TENANT, "quiet".into())],
            Taken::Counted("displaced", "-1", 1.0),
        ),
        (
            "interactive-1",
            vec![(OBJECTIVE, "interactive".into())],
            Taken::Counted("displaced", "-1", 2.0),
        ),
        // ...and this one, of the lowest priority left, finds no room at all.
        (
            "batch-3",
            vec![(OBJECTIVE, "batch".into())],
            Taken::Counted("queue_full", "-1", 1.0),
        ),
    ];
    for (label, headers, taken) in arrivals {
        let (url, finished) = (url.clone(), Arc::clone(&finished));
        answers.push((
            label,
            tokio::spawn(async move {
                let answer = send(url, label, headers).await;
                if answer.0 == 200 {
                    finished.lock().push(label);
                }
                answer
            }),
        ));
        match taken {
            Taken::Queued(n) => wait_queued(&router, n).await,
            Taken::Counted(outcome, priority, n) => {
                let mut seen = 0.0;
                for _ in 0..200 {
                    seen = flow_requests(&router, outcome, priority).await;
                    if seen == n {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
                assert_eq!(seen, n, "{label}: {outcome}");
            }
        }
    }
    assert_eq!(queue_size(&router).await, 4.0);

    // One replica frees up: the waiting requests run one at a time, in the flow's order.
    drop(held.pop());
    let mut statuses = Vec::new();
    for (label, answer) in answers {
        let (status, body) = answer.await.expect("joins");
        statuses.push((label, status));
        if status == 429 {
            let message = error_of(&body)["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let displaced = message.contains("displaced");
            assert_eq!(displaced, label != "batch-3", "{label}: {message}");
        }
    }
    assert_eq!(
        statuses,
        [
            ("batch-1", 429),
            ("batch-2", 429),
            ("noisy-1", 200),
            ("noisy-2", 200),
            ("quiet-1", 200),
            ("interactive-1", 200),
            ("batch-3", 429),
        ]
    );
    assert_eq!(
        *finished.lock(),
        ["interactive-1", "noisy-1", "quiet-1", "noisy-2"]
    );
    assert_eq!(flow_requests(&router, "displaced", "-1").await, 2.0);
    assert_eq!(flow_requests(&router, "queue_full", "-1").await, 1.0);
    assert_eq!(flow_requests(&router, "dispatched", "10").await, 1.0);
    assert_eq!(flow_requests(&router, "dispatched", "0").await, 3.0);
    assert_eq!(flow_requests(&router, "expired", "0").await, 1.0);
    assert_eq!(queue_size(&router).await, 0.0);
    drop(held);
    let _ = std::fs::remove_file(&config);
}
