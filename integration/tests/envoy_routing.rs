//! The router behind a real Envoy, with real `llmgw-sim` replicas, all on loopback: picks are
//! obeyed, streams work and are counted to their last byte, bad inputs get their statuses,
//! traffic survives llmgw going down, replicas leave and return, FULL_DUPLEX_STREAMED returns
//! the body byte for byte, and a client's destination header steers nothing in either Envoy
//! configuration.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

mod router_support;

use std::collections::HashSet;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use llmgw_integration::prom;
use llmgw_integration::{
    SimHandle, envoy_bin, envoy_config_over_uds, envoy_config_streamed_ahead, free_port, repo_root,
};
use router_support::*;

#[test]
fn every_envoy_config_in_the_repo_validates() {
    let mut checked = 0;
    for entry in std::fs::read_dir(repo_root().join("envoy")).expect("envoy/") {
        let path = entry.expect("dir entry").path();
        if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            let output = Command::new(envoy_bin())
                .args(["--mode", "validate", "-c"])
                .arg(&path)
                .output()
                .expect("run envoy --mode validate");
            assert!(
                output.status.success(),
                "{} does not validate:\n{}",
                path.display(),
                String::from_utf8_lossy(&output.stderr)
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 3,
        "expected envoy.yaml, envoy-original-dst.yaml and envoy-gie.yaml"
    );
}

/// Replica `a` serves `tiny`; replica `b` serves `tiny` and `other`, but the router is told
/// only `other=b`. So with llmgw up, `tiny` must always land on `a` and `other` on `b` (Envoy's
/// own balancing would spread them); with llmgw down, anything lands anywhere and succeeds.
///
/// How Envoy is wired to the router, beyond the configuration file.
#[derive(Clone, Copy)]
enum Wiring<'a> {
    /// As the file says.
    AsIs,
    /// The router also listens on this Unix socket and Envoy reaches it only there.
    Uds(&'a Path),
    /// The body STREAMED with `send_body_without_waiting_for_header_response`.
    StreamedAhead,
}

async fn picks_spoofing_and_failover(
    config: &str,
    router_flags: &[&str],
    envoy_checks_llmgw: bool,
    wiring: Wiring<'_>,
) {
    let a = sim("a", &["tiny"], 0, &[]);
    let b = sim("b", &["tiny", "other"], 0, &[]);
    let evil = echo_server("evil").await;
    let grpc = free_port();
    let mut flags: Vec<&str> = router_flags.to_vec();
    if let Wiring::Uds(path) = wiring {
        flags.extend(["--grpc-uds", path.to_str().expect("utf-8 socket path")]);
    }
    let router = start_router(
        grpc,
        &[format!("tiny={}", a.addr), format!("other={}", b.addr)],
        &flags,
    );
    router.wait_healthy(&[a.addr, b.addr]).await;
    let envoy = start_envoy_with(config, grpc, [a.addr, b.addr], |text| match wiring {
        Wiring::AsIs => text,
        Wiring::Uds(path) => envoy_config_over_uds(&text, path),
        Wiring::StreamedAhead => envoy_config_streamed_ahead(&text),
    })
    .await;
    if envoy_checks_llmgw {
        envoy.wait_llmgw_marked_up().await;
    }

    // llmgw's picks are obeyed.
    for _ in 0..6 {
        let (status, replica, body) =
            post(&envoy, "/v1/completions", completion("tiny", "hello"), &[]).await;
        assert_eq!((status, replica.as_deref()), (200, Some("a")), "{body}");
        let (status, replica, body) =
            post(&envoy, "/v1/completions", completion("other", "hello"), &[]).await;
        assert_eq!((status, replica.as_deref()), (200, Some("b")), "{body}");
    }
    let chat = serde_json::json!({
        "model": "other",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    })
    .to_string();
    let (status, replica, body) = post(&envoy, "/v1/chat/completions", chat, &[]).await;
    assert_eq!((status, replica.as_deref()), (200, Some("b")), "{body}");
    assert!(router.decisions("routed").await >= 13);

    // Requests that are not completions go to any ready replica.
    let response = client()
        .get(envoy.url("/v1/models"))
        .send()
        .await
        .expect("GET /v1/models");
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(router.decisions("routed_any").await, 1);

    // A client's destination header steers nothing while llmgw is up.
    let spoof_b = b.addr.to_string();
    let spoof_evil = evil.addr.to_string();
    for spoof in [&spoof_b, &spoof_evil] {
        let (status, replica, body) = post(
            &envoy,
            "/v1/completions",
            completion("tiny", "steer me"),
            &[(DESTINATION_HEADER, spoof)],
        )
        .await;
        assert_eq!(
            (status, replica.as_deref()),
            (200, Some("a")),
            "spoof {spoof}: {body}"
        );
    }

    // llmgw down: Envoy still serves through its fallback, and still ignores the header.
    drop(router);
    if envoy_checks_llmgw {
        envoy.wait_llmgw_marked_down().await;
    }
    for _ in 0..6 {
        let (status, replica, body) = post(
            &envoy,
            "/v1/completions",
            completion("tiny", "fallback"),
            &[],
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert!(matches!(replica.as_deref(), Some("a" | "b")), "{replica:?}");
        let (status, replica, body) = post(
            &envoy,
            "/v1/completions",
            completion("tiny", "steer me"),
            &[(DESTINATION_HEADER, &spoof_evil)],
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert!(matches!(replica.as_deref(), Some("a" | "b")), "{replica:?}");
    }
    assert_eq!(
        evil.hits.load(Ordering::SeqCst),
        0,
        "a spoofed header reached a foreign host"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_config_obeys_picks_ignores_spoofing_and_fails_open() {
    picks_spoofing_and_failover("envoy.yaml", &[], false, Wiring::AsIs).await;
}

/// STREAMED with `send_body_without_waiting_for_header_response`: the pick rides on the held
/// header answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_ahead_config_obeys_picks_ignores_spoofing_and_fails_open() {
    picks_spoofing_and_failover("envoy.yaml", &[], false, Wiring::StreamedAhead).await;
}

/// `--grpc-uds`: Envoy's llmgw cluster is a `pipe` address, the router's TCP port unused; a
/// stale socket file left by an earlier (killed) run is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_config_over_a_unix_socket() {
    let socket = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("llmgw-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("a stale socket"));
    picks_spoofing_and_failover("envoy.yaml", &[], false, Wiring::Uds(&socket)).await;
    let _ = std::fs::remove_file(&socket);
}

/// `--worker-threads 1`: the whole router (ext_proc, health checks, scrapes, admin) on tokio's
/// current-thread scheduler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_config_on_one_router_thread() {
    picks_spoofing_and_failover(
        "envoy.yaml",
        &["--worker-threads", "1"],
        false,
        Wiring::AsIs,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn original_dst_config_obeys_picks_ignores_spoofing_and_fails_open() {
    // Full duplex fails open only while Envoy knows llmgw is down (see the configuration).
    picks_spoofing_and_failover(
        "envoy-original-dst.yaml",
        &["--fallbacks", "0"],
        true,
        Wiring::AsIs,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gie_config_obeys_picks_ignores_spoofing_and_fails_open() {
    picks_spoofing_and_failover("envoy-gie.yaml", &[], true, Wiring::AsIs).await;
}

/// Through the GIE wiring, Envoy reports which host served each request: the pick when it
/// answers, the next address when it refuses connections (a retry), and the router counts both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gie_config_reports_the_served_endpoint_and_a_fallback_that_served() {
    let a = sim("a", &["tiny"], 0, &[]);
    // A replica that refuses connections: the router knows it (so a test selection may name
    // it), Envoy's cluster lists it, nothing listens there.
    let dead = llmgw_integration::free_addr();
    let grpc = free_port();
    let router = start_router(
        grpc,
        &[format!("tiny={}", a.addr), format!("tiny={dead}")],
        &["--allow-test-endpoint-selection"],
    );
    router.wait_healthy(&[a.addr]).await;
    let envoy = start_envoy("envoy-gie.yaml", grpc, [a.addr, dead]).await;
    envoy.wait_llmgw_marked_up().await;
    let served = |metrics: &str, by: &str| {
        prom::sum(metrics, "llmgw_served_reports_total", &[("served_by", by)]).unwrap_or(0.0)
    };
    let (picked, other) = ("picked", "other_replica");

    let (status, replica, body) =
        post(&envoy, "/v1/completions", completion("tiny", "hello"), &[]).await;
    assert_eq!((status, replica.as_deref()), (200, Some("a")), "{body}");
    // The report arrives with the response; the router's counter follows shortly after.
    wait_for(|| async { served(&router.metrics().await, picked) >= 1.0 }).await;

    let selection = format!("{dead},{}", a.addr);
    let (status, replica, body) = post(
        &envoy,
        "/v1/completions",
        completion("tiny", "dead first"),
        &[("test-epp-endpoint-selection", &selection)],
    )
    .await;
    assert_eq!((status, replica.as_deref()), (200, Some("a")), "{body}");
    wait_for(|| async { served(&router.metrics().await, other) >= 1.0 }).await;
    let metrics = router.metrics().await;
    assert_eq!(served(&metrics, picked), 1.0, "{metrics}");
    assert_eq!(served(&metrics, other), 1.0, "{metrics}");
    // Both requests are over, and nothing is left counted in flight anywhere.
    wait_for(|| async { router.in_flight(a.addr).await == 0 }).await;
    assert_eq!(router.in_flight(dead).await, 0);
}

/// `envoy-gie.yaml` as a GIE gateway that sends a subset hint: a `set_metadata` filter before
/// ext_proc puts `hint` in `envoy.lb.subset_hint`, which ext_proc forwards to the picker.
fn with_subset_hint(text: String, hint: std::net::SocketAddr) -> String {
    const EXT_PROC: &str = "          - name: envoy.filters.http.ext_proc\n";
    const FORWARDING: &str =
        "                forwarding_namespaces:\n                  untyped: [\"envoy.lb\"]";
    assert_eq!(text.matches(EXT_PROC).count(), 1, "one ext_proc filter");
    assert_eq!(text.matches(FORWARDING).count(), 1, "one forwarding list");
    let set_metadata = format!(
        "          - name: envoy.filters.http.set_metadata\n\
         \x20           typed_config:\n\
         \x20             \"@type\": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config\n\
         \x20             metadata:\n\
         \x20             - metadata_namespace: envoy.lb.subset_hint\n\
         \x20               value: {{x-gateway-destination-endpoint-subset: [\"{hint}\"]}}\n"
    );
    text.replace(EXT_PROC, &format!("{set_metadata}{EXT_PROC}")).replace(
        FORWARDING,
        "                forwarding_namespaces:\n                  untyped: [\"envoy.lb\", \"envoy.lb.subset_hint\"]",
    )
}

/// A completion through Envoy: status, the replica that answered, and the conformance header
/// naming the endpoint that served.
async fn post_for_conformance(
    envoy: &EnvoyProcess,
    prompt: &str,
    selection: Option<&str>,
) -> (u16, Option<String>, Option<String>) {
    let mut request = client()
        .post(envoy.url("/v1/completions"))
        .header("content-type", "application/json")
        .body(completion("tiny", prompt));
    if let Some(selection) = selection {
        request = request.header("test-epp-endpoint-selection", selection);
    }
    let response = request.send().await.expect("request through envoy");
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
    };
    let replica = header("x-llmgw-sim-replica");
    let served = header("x-conformance-test-served-endpoint");
    let status = response.status().as_u16();
    let body = response.text().await.expect("body");
    assert_eq!(status, 200, "{body}");
    (status, replica, served)
}

/// The endpoint-picker contract GIE's conformance suite checks, behind a real Envoy with the
/// GIE wiring: the gateway's subset hint confines every pick, the test selection (an `ip:port`
/// or a bare IP: every port of that pod) steers it, and every response names the endpoint that
/// served in `x-conformance-test-served-endpoint`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gie_conformance_hooks_behind_envoy_with_a_subset_hint() {
    let (a, b, grpc, router) =
        two_replicas_and_a_router(&["--allow-test-endpoint-selection"]).await;
    let envoy = start_envoy_with("envoy-gie.yaml", grpc, [a.addr, b.addr], |text| {
        with_subset_hint(text, b.addr)
    })
    .await;
    envoy.wait_llmgw_marked_up().await;

    // Three long requests keep b busy (steered there by the test selection), so load alone
    // would send new prompts to a; the hint keeps every one on b.
    let long = serde_json::json!({"model": "tiny", "prompt": "a long answer", "max_tokens": 1500})
        .to_string();
    let b_addr = b.addr.to_string();
    let busy: Vec<_> = (0..3)
        .map(|_| {
            let request = client()
                .post(envoy.url("/v1/completions"))
                .header("content-type", "application/json")
                .header("test-epp-endpoint-selection", b_addr.clone())
                .body(long.clone());
            tokio::spawn(async move { request.send().await.map(|r| r.status().as_u16()) })
        })
        .collect();
    wait_for(|| async { router.in_flight(b.addr).await >= 3 }).await;
    let b_served = (Some("b".to_string()), Some(b_addr.clone()));
    for (i, prompt) in [
        "alpha beta",
        "gamma delta",
        "epsilon",
        "zeta eta theta",
        "iota",
    ]
    .iter()
    .enumerate()
    {
        let (_, replica, served) = post_for_conformance(&envoy, prompt, None).await;
        assert_eq!((replica, served), b_served, "request {i}");
    }
    for request in busy {
        assert_eq!(request.await.unwrap().unwrap(), 200);
    }

    // The test selection overrides: by ip:port, and by bare IP (both replicas share 127.0.0.1,
    // so the lowest port is the pick and the other the fallback).
    let a_addr = a.addr.to_string();
    let (_, replica, served) = post_for_conformance(&envoy, "steered", Some(&a_addr)).await;
    assert_eq!((replica.as_deref(), served), (Some("a"), Some(a_addr)));
    let (lowest, name) = if a.addr.port() < b.addr.port() {
        (a.addr, "a")
    } else {
        (b.addr, "b")
    };
    let (_, replica, served) = post_for_conformance(&envoy, "by ip", Some("127.0.0.1")).await;
    assert_eq!(
        (replica.as_deref(), served),
        (Some(name), Some(lowest.to_string()))
    );

    // GIE's request metrics saw the five scheduled requests end, with the replica's usage (the
    // GIE wiring sends the response body); the steered ones are not parsed, so not counted.
    let count = |metrics: &str, name: &str| {
        prom::sum(metrics, name, &[("model_name", "tiny")]).unwrap_or(0.0)
    };
    wait_for(|| async {
        count(
            &router.metrics().await,
            "inference_objective_request_duration_seconds_count",
        ) >= 5.0
    })
    .await;
    let metrics = router.metrics().await;
    assert_eq!(count(&metrics, "inference_objective_request_total"), 5.0);
    assert_eq!(
        count(&metrics, "inference_objective_output_tokens_count"),
        5.0
    );
    assert_eq!(
        count(&metrics, "inference_objective_input_tokens_count"),
        5.0
    );
    assert_eq!(count(&metrics, "inference_objective_running_requests"), 0.0);
}

/// `envoy-gie.yaml` with the `llmgw` cluster reached over TLS, as gateways configured for GIE's
/// endpoint picker reach it (Istio's DestinationRule `tls: SIMPLE, insecureSkipVerify: true`):
/// no validation context, so the router's self-signed certificate is accepted.
fn with_upstream_tls_to_llmgw(text: String) -> String {
    const LLMGW_ENDPOINTS: &str = "    load_assignment:\n      cluster_name: llmgw\n";
    assert_eq!(
        text.matches(LLMGW_ENDPOINTS).count(),
        1,
        "one llmgw cluster"
    );
    let tls = "    transport_socket:\n\
               \x20     name: envoy.transport_sockets.tls\n\
               \x20     typed_config:\n\
               \x20       \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n\
               \x20       sni: llmgw-router\n\
               \x20       common_tls_context: {alpn_protocols: [h2]}\n";
    text.replace(LLMGW_ENDPOINTS, &format!("{tls}{LLMGW_ENDPOINTS}"))
}

/// `--secure-serving` with no certificate: the router makes one, and a real Envoy whose ext_proc
/// cluster speaks TLS (its health checks too) routes through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gie_config_over_tls_to_a_self_signed_router() {
    let (a, b, grpc, router) =
        two_replicas_and_a_router(&["--secure-serving", "--allow-test-endpoint-selection"]).await;
    let envoy = start_envoy_with(
        "envoy-gie.yaml",
        grpc,
        [a.addr, b.addr],
        with_upstream_tls_to_llmgw,
    )
    .await;
    envoy.wait_llmgw_marked_up().await;
    for (target, name) in [(a.addr, "a"), (b.addr, "b")] {
        let (_, replica, served) =
            post_for_conformance(&envoy, "over tls", Some(&target.to_string())).await;
        assert_eq!(
            (replica.as_deref(), served),
            (Some(name), Some(target.to_string()))
        );
    }
    let metrics = router.metrics().await;
    assert_eq!(
        prom::sum(
            &metrics,
            "llmgw_decisions_total",
            &[("outcome", "routed_test_selection")]
        ),
        Some(2.0),
        "{metrics}"
    );
    // Envoy never fell back to plaintext: nothing was refused.
    assert_eq!(
        prom::sum(&metrics, "llmgw_extproc_tls_refused_total", &[]),
        None
    );
}

/// `envoy-gie.yaml` with a second router in the `llmgw` cluster, at `second`.
fn with_second_router(text: String, second: u16) -> String {
    const FIRST: &str = "              socket_address: {address: 127.0.0.1, port_value: 9002}\n";
    assert_eq!(text.matches(FIRST).count(), 1, "one llmgw endpoint");
    let second = format!(
        "        - endpoint:\n            address:\n\
         \x20             socket_address: {{address: 127.0.0.1, port_value: {second}}}\n"
    );
    text.replace(FIRST, &format!("{FIRST}{second}"))
}

/// How many routers Envoy's health checks of the `llmgw` cluster count as up.
async fn routers_up(envoy: &EnvoyProcess) -> usize {
    let clusters = reqwest::get(format!("http://{}/clusters", envoy.admin))
        .await
        .expect("GET /clusters")
        .text()
        .await
        .expect("clusters text");
    clusters
        .lines()
        .filter(|l| l.starts_with("llmgw::") && l.contains("::health_flags::"))
        .filter(|l| l.ends_with("::healthy"))
        .count()
}

/// A rolling restart of two routers behind one Envoy, each stopped with SIGTERM (as Kubernetes
/// stops a pod) and started again on its port, fails no request: every answer is a 200 that a
/// router routed (the conformance header says which replica served it; a request that failed
/// open would lack it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_two_routers_fails_no_request() {
    let a = sim("a", &["tiny"], 0, &[]);
    let b = sim("b", &["tiny"], 0, &[]);
    let replicas = [format!("tiny={}", a.addr), format!("tiny={}", b.addr)];
    // The delay outlasts several of Envoy's 0.5 s health checks, so new streams move first,
    // even on a loaded machine.
    let flags = [
        "--allow-test-endpoint-selection",
        "--drain-delay",
        "2500ms",
        "--drain-timeout",
        "10s",
    ];
    let ports = [free_port(), free_port()];
    let start = |port: u16| start_router(port, &replicas, &flags);
    let mut routers = [start(ports[0]), start(ports[1])];
    for router in &routers {
        router.wait_healthy(&[a.addr, b.addr]).await;
    }
    let envoy = start_envoy_with("envoy-gie.yaml", ports[0], [a.addr, b.addr], |text| {
        with_second_router(text, ports[1])
    })
    .await;
    wait_for(|| async { routers_up(&envoy).await == 2 }).await;

    // Closed-loop clients, each request a slow one (the sims decode at 2 ms per token), so
    // some are in flight whenever a router is told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let url = envoy.url("/v1/completions");
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let (stop, url) = (Arc::clone(&stop), url.clone());
            tokio::spawn(async move {
                let (mut sent, mut failed) = (0usize, Vec::new());
                while !stop.load(Ordering::SeqCst) {
                    let body = serde_json::json!({"model": "tiny", "prompt": format!("client {i} request {sent}"), "max_tokens": 50});
                    let outcome = client().post(&url).json(&body).send().await;
                    sent += 1;
                    match outcome {
                        Ok(r) if r.status() == 200
                            && r.headers().contains_key("x-conformance-test-served-endpoint") => {}
                        Ok(r) => failed.push(format!("{} {:?}", r.status(), r.headers())),
                        Err(e) => failed.push(e.to_string()),
                    }
                }
                (sent, failed)
            })
        })
        .collect();

    tokio::time::sleep(Duration::from_secs(1)).await;
    for (i, port) in ports.into_iter().enumerate() {
        let status = routers[i]
            .guard
            .terminate(Duration::from_secs(20))
            .expect("the router exits after draining");
        assert!(status.success(), "router {i} exited with {status}");
        routers[i] = start(port);
        routers[i].wait_healthy(&[a.addr, b.addr]).await;
        wait_for(|| async { routers_up(&envoy).await == 2 }).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let mut sent = 0;
    for client in clients {
        let (n, failed) = client.await.unwrap();
        assert!(failed.is_empty(), "failed requests: {failed:?}");
        sent += n;
    }
    assert!(sent >= 20, "only {sent} requests sent");
}

/// Polls `check` until it holds, failing after 10 s.
async fn wait_for<F, Fut>(mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..200 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("condition not met within 10 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_response_is_counted_in_flight_until_its_last_byte() {
    let slow = ["--sim-decode-us-per-token", "60000"];
    let a = sim("a", &["tiny"], 0, &slow);
    let b = sim("b", &["tiny"], 0, &slow);
    let grpc = free_port();
    let router = start_router(
        grpc,
        &[format!("tiny={}", a.addr), format!("tiny={}", b.addr)],
        &[],
    );
    router.wait_healthy(&[a.addr, b.addr]).await;
    let envoy = start_envoy("envoy.yaml", grpc, [a.addr, b.addr]).await;

    let body = serde_json::json!({"model": "tiny", "prompt": "count slowly", "max_tokens": 12, "stream": true});
    let response = client()
        .post(envoy.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("streamed request");
    assert_eq!(response.status().as_u16(), 200);
    let served = match response
        .headers()
        .get(REPLICA_HEADER)
        .and_then(|v| v.to_str().ok())
    {
        Some("a") => a.addr,
        Some("b") => b.addr,
        other => panic!("served by {other:?}"),
    };
    let mut stream = response.bytes_stream();
    let mut text = String::new();
    let mut chunks = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("stream chunk");
        text.push_str(&String::from_utf8_lossy(&chunk));
        if text.contains("[DONE]") {
            break;
        }
        chunks += 1;
        assert_eq!(
            router.in_flight(served).await,
            1,
            "in flight while streaming, after {chunks} chunks"
        );
    }
    assert!(
        chunks >= 3,
        "expected several SSE chunks, got {chunks}: {text}"
    );
    assert!(text.contains("data: "));
    drop(stream);
    let mut in_flight = u64::MAX;
    for _ in 0..100 {
        in_flight = router.in_flight(served).await;
        if in_flight == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        in_flight, 0,
        "the request still counts after its stream ended"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_their_status_and_a_json_error() {
    let slow = ["--sim-decode-us-per-token", "100000"];
    let a = sim("a", &["tiny"], 0, &slow);
    let b = sim("b", &["tiny"], 0, &slow);
    let ghost = format!("ghost=127.0.0.1:{}", free_port());
    let grpc = free_port();
    let router = start_router(
        grpc,
        &[
            format!("tiny={}", a.addr),
            format!("tiny={}", b.addr),
            ghost,
        ],
        &[
            "--max-body-bytes",
            "100000",
            "--max-in-flight",
            "1",
            "--queue-timeout",
            "300ms",
        ],
    );
    router.wait_healthy(&[a.addr, b.addr]).await;
    let envoy = start_envoy("envoy.yaml", grpc, [a.addr, b.addr]).await;

    let big_prompt = "x".repeat(150_000);
    let cases: Vec<(&str, String, u16, &str)> = vec![
        (
            "/v1/completions",
            "{not json".to_string(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"x"}"#.to_string(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            r#"{"model":"tiny"}"#.to_string(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"tiny"}"#.to_string(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            completion("nope", "x"),
            404,
            "not_found_error",
        ),
        (
            "/v1/completions",
            completion("tiny", &big_prompt),
            413,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            completion("ghost", "x"),
            503,
            "service_unavailable_error",
        ),
    ];
    for (path, body, status, error_type) in cases {
        let response = client()
            .post(envoy.url(path))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .expect("request");
        assert_eq!(
            response.status().as_u16(),
            status,
            "{path} {}",
            &body[..body.len().min(60)]
        );
        assert_eq!(
            response
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok()),
            Some("application/json")
        );
        let error: serde_json::Value = response.json().await.expect("JSON error body");
        assert_eq!(error["error"]["code"], status);
        assert_eq!(error["error"]["type"], error_type);
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }

    // 429: both replicas hold one slow request each (--max-in-flight 1), and none frees up
    // within the queue timeout.
    let slow_body =
        serde_json::json!({"model": "tiny", "prompt": "busy", "max_tokens": 20, "stream": true});
    let mut held = Vec::new();
    for _ in 0..2 {
        let response = client()
            .post(envoy.url("/v1/completions"))
            .json(&slow_body)
            .send()
            .await
            .expect("slow request");
        assert_eq!(response.status().as_u16(), 200);
        held.push(response);
    }
    let (status, _, body) = post(
        &envoy,
        "/v1/completions",
        completion("tiny", "one more"),
        &[],
    )
    .await;
    assert_eq!(status, 429, "{body}");
    let error: serde_json::Value = serde_json::from_str(&body).expect("JSON error body");
    assert_eq!(error["error"]["type"], "rate_limit_error");
    drop(held);

    assert_eq!(router.decisions("bad_request").await, 4);
    assert_eq!(router.decisions("unknown_model").await, 1);
    assert_eq!(router.decisions("body_too_large").await, 1);
    assert_eq!(router.decisions("no_ready_replica").await, 1);
    assert_eq!(router.decisions("saturated").await, 1);
}

/// Anthropic's `/v1/messages` through Envoy: routed like a chat and answered by the replica in
/// Anthropic's shape; a malformed body, an unknown model and an over-limit body are refused
/// by llmgw in Anthropic's error shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_are_routed_and_refused_in_anthropics_shape() {
    let (a, b, grpc, router) = two_replicas_and_a_router(&[]).await;
    let envoy = start_envoy("envoy.yaml", grpc, [a.addr, b.addr]).await;
    let body = serde_json::json!({"model": "tiny", "max_tokens": 4, "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]});
    let (status, replica, text) = post(&envoy, "/v1/messages", body.to_string(), &[]).await;
    assert_eq!(status, 200, "{text}");
    assert!(matches!(replica.as_deref(), Some("a" | "b")), "{replica:?}");
    let answer: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(answer["type"], "message", "{answer}");
    assert!(
        answer["usage"]["input_tokens"]
            .as_u64()
            .is_some_and(|n| n > 0)
    );

    let over = serde_json::json!({"model": "tiny", "messages": [
        {"role": "user", "content": "x".repeat(17 << 20)}]});
    for (body, status, kind) in [
        (
            r#"{"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}"#.to_owned(),
            400,
            "invalid_request_error",
        ),
        ("{not json".to_owned(), 400, "invalid_request_error"),
        (
            r#"{"model": "big", "messages": [{"role": "user", "content": "x"}]}"#.to_owned(),
            404,
            "not_found_error",
        ),
        (over.to_string(), 413, "request_too_large"),
    ] {
        let (got, replica, text) = post(&envoy, "/v1/messages", body, &[]).await;
        assert_eq!(
            (got, replica),
            (status, None),
            "{}",
            &text[..text.len().min(200)]
        );
        let error: serde_json::Value = serde_json::from_str(&text).expect("JSON error body");
        assert_eq!(error["type"], "error", "{error}");
        assert_eq!(error["error"]["type"], kind, "{error}");
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    assert_eq!(router.decisions("bad_request").await, 2);
    assert_eq!(router.decisions("unknown_model").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_replica_leaves_the_candidates_and_comes_back() {
    let a = sim("a", &["tiny"], 0, &[]);
    let b = sim("b", &["tiny"], 0, &[]);
    let b_addr = b.addr;
    let grpc = free_port();
    let router = start_router(
        grpc,
        &[format!("tiny={}", a.addr), format!("tiny={b_addr}")],
        &[],
    );
    router.wait_healthy(&[a.addr, b_addr]).await;
    let envoy = start_envoy("envoy.yaml", grpc, [a.addr, b_addr]).await;

    drop(b);
    router.wait_healthy(&[a.addr]).await;
    for _ in 0..8 {
        let (status, replica, body) = post(
            &envoy,
            "/v1/completions",
            completion("tiny", "still here"),
            &[],
        )
        .await;
        assert_eq!((status, replica.as_deref()), (200, Some("a")), "{body}");
    }

    let _b = sim("b", &["tiny"], b_addr.port(), &[]);
    router.wait_healthy(&[a.addr, b_addr]).await;
    let mut seen = HashSet::new();
    for _ in 0..40 {
        let (status, replica, body) = post(
            &envoy,
            "/v1/completions",
            completion("tiny", "welcome back"),
            &[],
        )
        .await;
        assert_eq!(status, 200, "{body}");
        seen.extend(replica);
        if seen.contains("b") {
            break;
        }
    }
    assert!(seen.contains("b"), "b never served again: {seen:?}");
}

/// A ~300 KB completion request for the model `echo`, of multi-byte characters; the model comes
/// last, so that only the complete body names it.
fn large_echo_body() -> String {
    let prompt: String = (0..100_000)
        .map(|i| ["ab", "é", "漢", "\\n", "🙂"][i % 5])
        .collect();
    let body = format!(
        "{{\"prompt\": {}, \"max_tokens\": 1, \"model\": \"echo\"}}",
        serde_json::Value::String(prompt)
    );
    assert!(body.len() > 200_000);
    body
}

/// Replica `a` serving `tiny`, an echo replica serving `echo`, and a healthy router (on the
/// returned gRPC port) that knows both.
async fn tiny_and_echo_behind_a_router(
    router_flags: &[&str],
) -> (SimHandle, EchoServer, u16, RouterProcess) {
    let a = sim("a", &["tiny"], 0, &[]);
    let echo = echo_server("echo").await;
    let grpc = free_port();
    let router = start_router(
        grpc,
        &[format!("tiny={}", a.addr), format!("echo={}", echo.addr)],
        router_flags,
    );
    router.wait_healthy(&[a.addr, echo.addr]).await;
    (a, echo, grpc, router)
}

/// Posts `body` through Envoy: the echo replica must serve it and get it byte for byte.
async fn assert_echo_returns(envoy: &EnvoyProcess, body: &str) {
    let response = client()
        .post(envoy.url("/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .expect("request to the echo replica");
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(
        response
            .headers()
            .get(REPLICA_HEADER)
            .and_then(|v| v.to_str().ok()),
        Some("echo")
    );
    let echoed = response.bytes().await.expect("echoed body");
    assert!(
        echoed == body.as_bytes(),
        "the body changed on its way through ext_proc ({} bytes back of {})",
        echoed.len(),
        body.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_streamed_returns_the_body_byte_for_byte() {
    let (a, _echo, grpc, _router) = tiny_and_echo_behind_a_router(&["--fallbacks", "0"]).await;
    // The echo replica is reached through ORIGINAL_DST; the plain cluster lists `a` twice.
    let envoy = start_envoy("envoy-original-dst.yaml", grpc, [a.addr, a.addr]).await;

    // Several 64 KiB chunks each way, with multi-byte characters across chunk edges.
    assert_echo_returns(&envoy, &large_echo_body()).await;

    // And a normal streamed completion through full duplex in both directions.
    let streamed =
        serde_json::json!({"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": true});
    let response = client()
        .post(envoy.url("/v1/completions"))
        .json(&streamed)
        .send()
        .await
        .expect("streamed request");
    assert_eq!(response.status().as_u16(), 200);
    let text = response.text().await.expect("SSE body");
    assert!(text.contains("[DONE]"), "{text}");
}

/// Where Envoy sends llmgw the response (full duplex), the cached tokens each response's usage
/// reports are counted for the replica that served it: the engine's own account of this
/// router's requests, which the drift check prefers to the scraped counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cached_tokens_responses_report_reach_the_drift_check() {
    let (a, _echo, grpc, router) = tiny_and_echo_behind_a_router(&["--fallbacks", "0"]).await;
    let envoy = start_envoy("envoy-original-dst.yaml", grpc, [a.addr, a.addr]).await;
    let prompt = "The same long report, sent again and again. ".repeat(12);
    let (mut cached, mut prompt_tokens) = (0, 0);
    for stream in [false, false, true] {
        let mut body = serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 2});
        if stream {
            body["stream"] = true.into();
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        let (status, replica, text) = post(&envoy, "/v1/completions", body.to_string(), &[]).await;
        assert_eq!((status, replica.as_deref()), (200, Some("a")), "{text}");
        let usage_json = if stream {
            text.lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .rfind(|l| l.contains("prompt_tokens_details"))
                .expect("a usage event")
                .to_owned()
        } else {
            text
        };
        let usage = &serde_json::from_str::<serde_json::Value>(&usage_json).expect("JSON")["usage"];
        cached += usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached tokens");
        prompt_tokens += usage["prompt_tokens"].as_u64().expect("prompt tokens");
    }
    assert!(cached > 0, "the repeated prompt hit the sim's cache");
    let replica = a.addr.to_string();
    let counted = |metrics: &str, family: &str| {
        prom::sum(metrics, family, &[("replica", &replica)]).unwrap_or(-1.0)
    };
    // The ext_proc stream (and so the count) ends just after the client has the response.
    wait_for(|| async {
        let metrics = router.metrics().await;
        counted(&metrics, "llmgw_reported_prompt_tokens_total") == prompt_tokens as f64
    })
    .await;
    let metrics = router.metrics().await;
    assert_eq!(
        counted(&metrics, "llmgw_reported_cached_tokens_total"),
        cached as f64
    );
}

/// STREAMED with `send_body_without_waiting_for_header_response`: a body of many chunks reaches
/// the picked replica unchanged (llmgw answers each chunk without touching it), and the pick
/// waited for the whole body (the model is read from its end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_ahead_passes_a_large_body_unchanged() {
    let (a, echo, grpc, _router) = tiny_and_echo_behind_a_router(&[]).await;
    let envoy = start_envoy_with("envoy.yaml", grpc, [a.addr, echo.addr], |text| {
        envoy_config_streamed_ahead(&text)
    })
    .await;

    let body = large_echo_body();
    for _ in 0..3 {
        assert_echo_returns(&envoy, &body).await;
    }
    let (status, replica, text) =
        post(&envoy, "/v1/completions", completion("tiny", "hello"), &[]).await;
    assert_eq!((status, replica.as_deref()), (200, Some("a")), "{text}");
}

/// A body over the router's `--max-body-bytes` (16 MiB by default) through each shipped Envoy
/// configuration: llmgw's own 413 with an OpenAI-style JSON error, never a reset or Envoy's
/// plain-text answer, and the next request is routed as usual.
async fn over_limit_body_gets_llmgws_413(config: &str, router_flags: &[&str], wiring: Wiring<'_>) {
    let (a, b, grpc, _router) = two_replicas_and_a_router(router_flags).await;
    let envoy = start_envoy_with(config, grpc, [a.addr, b.addr], |text| match wiring {
        Wiring::StreamedAhead => envoy_config_streamed_ahead(&text),
        _ => text,
    })
    .await;
    if config != "envoy.yaml" {
        // These check llmgw's health and fail closed until it is up (see the configurations).
        envoy.wait_llmgw_marked_up().await;
    }

    let body = completion("tiny", &"x".repeat(17 << 20));
    let response = client()
        .post(envoy.url("/v1/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{config}: the 17 MiB request failed: {e}"));
    assert_eq!(response.status().as_u16(), 413, "{config}");
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/json"),
        "{config}"
    );
    let error: serde_json::Value = response.json().await.expect("JSON error body");
    assert_eq!(error["error"]["code"], 413, "{config}: {error}");
    assert_eq!(
        error["error"]["type"], "invalid_request_error",
        "{config}: {error}"
    );
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("16777216")),
        "{config}: {error}"
    );
    let (status, replica, body) =
        post(&envoy, "/v1/completions", completion("tiny", "after"), &[]).await;
    assert_eq!((status, replica.is_some()), (200, true), "{config}: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_config_answers_an_over_limit_body_with_llmgws_413() {
    over_limit_body_gets_llmgws_413("envoy.yaml", &[], Wiring::AsIs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_ahead_config_answers_an_over_limit_body_with_llmgws_413() {
    over_limit_body_gets_llmgws_413("envoy.yaml", &[], Wiring::StreamedAhead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gie_config_answers_an_over_limit_body_with_llmgws_413() {
    over_limit_body_gets_llmgws_413("envoy-gie.yaml", &[], Wiring::AsIs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn original_dst_config_answers_an_over_limit_body_with_llmgws_413() {
    // Original destination takes one address: no fallbacks (see the configuration).
    over_limit_body_gets_llmgws_413(
        "envoy-original-dst.yaml",
        &["--fallbacks", "0"],
        Wiring::AsIs,
    )
    .await;
}
