use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;

use super::*;
use crate::pool::{EngineLoad, Health, Pool, ReplicaSpec};

fn pool() -> Arc<Pool> {
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
    pool
}

fn router(pool: &Arc<Pool>, allow_test_selection: bool) -> Router {
    let metrics = Arc::new(Metrics::new(Arc::clone(pool)));
    Router::new(
        Scheduler::load_only(Arc::clone(pool)).expect("builds"),
        metrics,
        allow_test_selection,
    )
}

fn post(path: &str, body: &str) -> RoutingRequest {
    RoutingRequest {
        method: "POST".to_string(),
        path: path.to_string(),
        body: Some(Bytes::from(body.to_string())),
        ..RoutingRequest::default()
    }
}

async fn status_of(router: &Router, request: RoutingRequest) -> u16 {
    match router.pick(request).await {
        Ok(_) => 200,
        Err(rejection) => rejection.status,
    }
}

#[tokio::test]
async fn completions_and_chat_are_routed_and_counted() {
    let pool = pool();
    let router = router(&pool, false);
    let routed = router
        .pick(post("/v1/completions", r#"{"model":"tiny","prompt":"hi"}"#))
        .await
        .unwrap();
    assert!(routed.destination.starts_with("127.0.0.1:800"));
    assert_eq!(routed.hold.in_flight.replica().in_flight(), 1);
    let chat = router
        .pick(post(
            "/v1/chat/completions",
            r#"{"model":"tiny","messages":[{"role":"user","content":"hi"}]}"#,
        ))
        .await
        .unwrap();
    // The second request goes to the replica without one in flight.
    assert_ne!(
        chat.hold.in_flight.replica().endpoint(),
        routed.hold.in_flight.replica().endpoint()
    );
    let text = router.metrics.encode().unwrap();
    assert!(
        text.contains("llmgw_decisions_total{outcome=\"routed\"} 2"),
        "{text}"
    );
    // Both decisions timed, in CPU as in wall-clock time, and CPU spent is never zero.
    assert!(
        text.contains("llmgw_pick_duration_seconds_count 2"),
        "{text}"
    );
    assert!(text.contains("llmgw_pick_cpu_seconds_count 2"), "{text}");
    let cpu_sum: f64 = text
        .lines()
        .find_map(|line| line.strip_prefix("llmgw_pick_cpu_seconds_sum "))
        .and_then(|v| v.parse().ok())
        .expect("llmgw_pick_cpu_seconds_sum");
    assert!(cpu_sum > 0.0 && cpu_sum < 1.0, "{cpu_sum}");
}

/// What the log says while the guard lives (this thread only: the tests' runtimes are
/// current-thread).
#[derive(Clone, Default)]
struct CapturedLog(Arc<parking_lot::Mutex<Vec<u8>>>);

impl std::io::Write for CapturedLog {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl CapturedLog {
    fn start(&self) -> tracing::subscriber::DefaultGuard {
        let log = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || log.clone())
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock()).into_owned()
    }
}

#[tokio::test]
async fn bad_inputs_get_their_statuses() {
    let pool = pool();
    let router = router(&pool, false);
    let log = CapturedLog::default();
    let _logging = log.start();
    assert_eq!(
        status_of(&router, post("/v1/completions", "{oops")).await,
        400
    );
    assert_eq!(
        status_of(&router, post("/v1/completions", r#"{"prompt":"x"}"#)).await,
        400
    );
    assert_eq!(
        status_of(&router, post("/v1/completions", r#"{"model":"tiny"}"#)).await,
        400
    );
    assert_eq!(
        status_of(
            &router,
            post("/v1/completions", r#"{"model":"big","prompt":"x"}"#)
        )
        .await,
        404
    );
    for replica in pool.snapshot().replicas() {
        replica.record_scrape(
            EngineLoad {
                waiting: Some(1000.0),
                running: None,
                kv_cache_usage: None,
            },
            Instant::now(),
        );
    }
    assert_eq!(
        status_of(
            &router,
            post("/v1/completions", r#"{"model":"tiny","prompt":"x"}"#)
        )
        .await,
        429
    );
    for replica in pool.snapshot().replicas() {
        replica.set_health(Health::Unhealthy);
    }
    assert_eq!(
        status_of(
            &router,
            post("/v1/completions", r#"{"model":"tiny","prompt":"x"}"#)
        )
        .await,
        503
    );
    // The client's mistakes are logged, naming what was wrong; capacity refusals are not.
    let logged = log.text();
    assert!(
        logged.contains("request refused: 400, unparsable body")
            && logged.contains(r#"request body has no "model""#),
        "{logged}"
    );
    assert!(
        logged.contains(r#"status=404 error=model "big" is not served by any replica"#),
        "{logged}"
    );
    assert!(!logged.contains("status=429"), "{logged}");
    let text = router.metrics.encode().unwrap();
    for outcome in [
        "bad_request\"} 3",
        "unknown_model\"} 1",
        "saturated\"} 1",
        "no_ready_replica\"} 1",
    ] {
        assert!(text.contains(outcome), "{outcome} in {text}");
    }
}

#[tokio::test]
async fn messages_are_routed_and_refused_in_anthropics_shape() {
    let pool = pool();
    let router = router(&pool, false);
    let routed = router
        .pick(post(
            "/v1/messages",
            r#"{"model":"tiny","max_tokens":8,"system":"s","messages":[{"role":"user","content":"hi"}]}"#,
        ))
        .await
        .expect("routed");
    assert!(routed.destination.starts_with("127.0.0.1:800"));
    for (body, status, kind) in [
        (
            r#"{"model":"tiny","messages":[{"role":"robot","content":"x"}]}"#,
            400,
            "invalid_request_error",
        ),
        ("{oops", 400, "invalid_request_error"),
        (
            r#"{"model":"big","messages":[{"role":"user","content":"x"}]}"#,
            404,
            "not_found_error",
        ),
    ] {
        let rejection = router
            .pick(post("/v1/messages", body))
            .await
            .expect_err(body);
        assert_eq!(rejection.status, status, "{body}");
        assert_eq!(rejection.style, crate::openai::ErrorStyle::Anthropic);
        let error: serde_json::Value =
            serde_json::from_slice(&crate::extproc::error_body(&rejection)).expect("JSON");
        assert_eq!(error["type"], "error", "{error}");
        assert_eq!(error["error"]["type"], kind, "{error}");
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    // The same refusal on an OpenAI path keeps OpenAI's shape.
    let rejection = router
        .pick(post("/v1/chat/completions", "{oops"))
        .await
        .expect_err("bad JSON");
    let error: serde_json::Value =
        serde_json::from_slice(&crate::extproc::error_body(&rejection)).expect("JSON");
    assert_eq!(error["error"]["code"], 400);
}

#[tokio::test]
async fn responses_are_routed_and_refused_in_openais_shape() {
    let pool = pool();
    let router = router(&pool, false);
    let routed = router
        .pick(post(
            "/v1/responses",
            r#"{"model":"tiny","instructions":"s","input":[{"role":"user","content":"hi"}]}"#,
        ))
        .await
        .expect("routed");
    assert!(routed.destination.starts_with("127.0.0.1:800"));
    for (body, status, kind) in [
        (
            r#"{"model":"tiny","input":[{"role":"robot","content":"x"}]}"#,
            400,
            "invalid_request_error",
        ),
        (r#"{"model":"tiny"}"#, 400, "invalid_request_error"),
        ("{oops", 400, "invalid_request_error"),
        (r#"{"model":"big","input":"x"}"#, 404, "not_found_error"),
    ] {
        let rejection = router
            .pick(post("/v1/responses", body))
            .await
            .expect_err(body);
        assert_eq!(rejection.status, status, "{body}");
        assert_eq!(rejection.style, crate::openai::ErrorStyle::OpenAi);
        let error: serde_json::Value =
            serde_json::from_slice(&crate::extproc::error_body(&rejection)).expect("JSON");
        assert_eq!(error["error"]["code"], status, "{error}");
        assert_eq!(error["error"]["type"], kind, "{error}");
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{error}"
        );
    }
}

#[tokio::test]
async fn non_completions_go_to_any_ready_replica() {
    let pool = pool();
    let router = router(&pool, false);
    let request = RoutingRequest {
        method: "GET".to_string(),
        path: "/v1/models".to_string(),
        body: Some(Bytes::new()),
        ..RoutingRequest::default()
    };
    let routed = router.pick(request).await.unwrap();
    assert!(routed.destination.starts_with("127.0.0.1:800"));
    // A completion path without a body (body mode NONE) is routed on load alone too.
    let headers_only = RoutingRequest {
        body: None,
        ..post("/v1/completions", "")
    };
    assert!(router.pick(headers_only).await.is_ok());
}

#[tokio::test]
async fn test_selection_header_only_behind_the_flag() {
    let pool = pool();
    let selection = |value: &str| RoutingRequest {
        test_selection: Some(value.to_string()),
        ..post("/v1/completions", r#"{"model":"tiny","prompt":"x"}"#)
    };
    let allowed = router(&pool, true);
    let routed = allowed
        .pick(selection("127.0.0.1:8002, 127.0.0.1:8001"))
        .await
        .unwrap();
    assert_eq!(routed.destination, "127.0.0.1:8002,127.0.0.1:8001");
    assert_eq!(status_of(&allowed, selection("10.9.9.9:1")).await, 503);

    // Without the flag the header is ignored: load decides, so 8002 (already holding one
    // request) loses.
    let _busy = routed;
    let ignored = router(&pool, false);
    let routed = ignored.pick(selection("127.0.0.1:8002")).await.unwrap();
    assert_eq!(routed.hold.in_flight.replica().endpoint(), "127.0.0.1:8001");
}

#[tokio::test]
async fn a_test_selection_by_ip_takes_every_port_of_that_ip() {
    // A pod with two data-parallel ranks (8001, 8002) and one with one.
    let specs = [("10.0.0.1", 8002), ("10.0.0.2", 8000), ("10.0.0.1", 8001)]
        .map(|(ip, port)| ReplicaSpec {
            address: SocketAddr::new(ip.parse().unwrap(), port),
            models: vec!["tiny".to_string()],
            node: None,
        })
        .to_vec();
    let pool = Arc::new(Pool::new(specs, Duration::from_secs(60)));
    let router = router(&pool, true);
    let selection = |value: &str| RoutingRequest {
        test_selection: Some(value.to_string()),
        ..post("/v1/completions", r#"{"model":"tiny","prompt":"x"}"#)
    };
    let routed = router.pick(selection("10.0.0.1")).await.unwrap();
    assert_eq!(routed.destination, "10.0.0.1:8001,10.0.0.1:8002");
    // IPs and ip:port mix, in the order given, each replica once.
    let routed = router
        .pick(selection("10.0.0.2, 10.0.0.1:8002,10.0.0.1"))
        .await
        .unwrap();
    assert_eq!(
        routed.destination,
        "10.0.0.2:8000,10.0.0.1:8002,10.0.0.1:8001"
    );
    // An IP with no replica is skipped; none left is a 503.
    let routed = router.pick(selection("10.9.9.9,10.0.0.2")).await.unwrap();
    assert_eq!(routed.destination, "10.0.0.2:8000");
    assert_eq!(
        status_of(&router, selection("10.9.9.9, not-an-ip")).await,
        503
    );
}

#[tokio::test]
async fn the_conformance_hooks_name_the_pick_and_the_endpoint_that_served() {
    let pool = pool();
    let request = || RoutingRequest {
        test_selection: Some("127.0.0.1:8001,127.0.0.1:8002".to_string()),
        ..post("/v1/completions", r#"{"model":"tiny","prompt":"x"}"#)
    };
    let hooked = router(&pool, true);
    let mut routed = hooked.pick(request()).await.unwrap();
    let echo: Vec<_> = routed
        .headers
        .iter()
        .filter(|(name, _)| *name == ECHO_SET_HEADER)
        .collect();
    assert_eq!(
        echo,
        [&(
            ECHO_SET_HEADER,
            "x-conformance-test-served-endpoint:127.0.0.1:8001".to_string()
        )]
    );
    assert_eq!(
        hooked.response_headers(&routed.hold),
        [(CONFORMANCE_SERVED_HEADER, "127.0.0.1:8001".to_string())]
    );
    // The proxy reports that the fallback served: the response names it.
    hooked.served(&mut routed.hold, "127.0.0.1:8002");
    assert_eq!(
        hooked.response_headers(&routed.hold),
        [(CONFORMANCE_SERVED_HEADER, "127.0.0.1:8002".to_string())]
    );

    // Without the flag, neither header.
    let plain = router(&pool, false);
    let routed = plain.pick(request()).await.unwrap();
    assert!(
        routed
            .headers
            .iter()
            .all(|(name, _)| *name != ECHO_SET_HEADER)
    );
    assert!(plain.response_headers(&routed.hold).is_empty());
}

#[tokio::test]
async fn a_fallback_that_served_takes_the_in_flight_count() {
    let pool = pool();
    let router = router(&pool, true);
    let mut request = post("/v1/completions", r#"{"model":"tiny","prompt":"hi"}"#);
    request.test_selection = Some("127.0.0.1:8001,127.0.0.1:8002".to_string());
    let mut routed = router.pick(request).await.unwrap();
    let snapshot = pool.snapshot();
    let in_flight = |endpoint: &str| snapshot.find(endpoint).unwrap().in_flight();
    let counts = || (in_flight("127.0.0.1:8001"), in_flight("127.0.0.1:8002"));
    assert_eq!(counts(), (1, 0));

    router.served(&mut routed.hold, "127.0.0.1:8001");
    assert_eq!(counts(), (1, 0));
    router.served(&mut routed.hold, "127.0.0.1:8002");
    assert_eq!(counts(), (0, 1));
    router.served(&mut routed.hold, "10.9.9.9:1");
    assert_eq!(counts(), (0, 1));
    drop(routed);
    assert_eq!(counts(), (0, 0));

    let text = router.metrics.encode().unwrap();
    for line in [
        "llmgw_served_reports_total{served_by=\"picked\"} 1",
        "llmgw_served_reports_total{served_by=\"other_replica\"} 1",
        "llmgw_served_reports_total{served_by=\"unknown\"} 1",
    ] {
        assert!(text.contains(line), "{line} missing from\n{text}");
    }
}

/// The sample `name{labels} value` in `metrics`, if there.
fn sample(metrics: &Metrics, line_start: &str) -> Option<f64> {
    let text = metrics.encode().unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(line_start)?.trim().parse().ok())
}

#[tokio::test]
async fn the_cached_tokens_a_response_reports_go_to_its_replicas_drift_check() {
    let pool = pool();
    let router = router(&pool, false);
    let reported = |endpoint: &str| {
        let view = pool
            .snapshot()
            .find(endpoint)
            .expect("replica")
            .drift()
            .view();
        (view.reported_hits, view.reported_tokens)
    };
    let usage = br#"{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}}"#;
    // The destination lists the pick first, then its fallbacks.
    let primary = |routed: &Routed<RoutedRequest>| {
        routed
            .destination
            .split(',')
            .next()
            .expect("a pick")
            .to_owned()
    };
    let finish = |routed: Routed<RoutedRequest>, body: &[u8], complete: bool| {
        let mut exchange = Exchange::new(Instant::now());
        exchange.status = Some(200);
        exchange.response_chunk(body, complete);
        router.finished(routed.hold, exchange);
    };
    let first = router
        .pick(post("/v1/completions", r#"{"model":"tiny","prompt":"hi"}"#))
        .await
        .unwrap();
    let picked = primary(&first);
    finish(first, usage, true);
    assert_eq!(reported(&picked), (32, 40));
    // A response cut off, or one without the details, reports nothing.
    for (body, complete) in [
        (&usage[..], false),
        (
            br#"{"usage":{"prompt_tokens":40,"completion_tokens":2}}"#,
            true,
        ),
    ] {
        let routed = router
            .pick(post("/v1/completions", r#"{"model":"tiny","prompt":"hi"}"#))
            .await
            .unwrap();
        let endpoint = primary(&routed);
        let before = reported(&endpoint);
        finish(routed, body, complete);
        assert_eq!(reported(&endpoint), before);
    }
    // Served elsewhere (the proxy's fallback): the replica that served it is credited.
    let mut routed = router
        .pick(post("/v1/completions", r#"{"model":"tiny","prompt":"hi"}"#))
        .await
        .unwrap();
    let picked = primary(&routed);
    let other = if picked == "127.0.0.1:8001" {
        "127.0.0.1:8002"
    } else {
        "127.0.0.1:8001"
    };
    let (other_before, picked_before) = (reported(other), reported(&picked));
    router.served(&mut routed.hold, other);
    finish(routed, usage, true);
    assert_eq!(reported(other), (other_before.0 + 32, other_before.1 + 40));
    assert_eq!(reported(&picked), picked_before);
}

#[tokio::test]
async fn gies_request_metrics_follow_each_request_by_model() {
    let pool = pool();
    let metrics = Arc::new(Metrics::new(Arc::clone(&pool)));
    let router = Router::new(
        Scheduler::load_only(Arc::clone(&pool)).expect("builds"),
        Arc::clone(&metrics),
        false,
    );
    let tiny = r#"{model_name="tiny",target_model_name="tiny"}"#;
    let routed = router
        .pick(post("/v1/completions", r#"{"model":"tiny","prompt":"hi"}"#))
        .await
        .unwrap();
    let running = r#"inference_objective_running_requests{model_name="tiny"}"#;
    assert_eq!(sample(&metrics, running), Some(1.0));
    assert_eq!(
        sample(
            &metrics,
            &format!("inference_objective_request_total{tiny}")
        ),
        Some(1.0)
    );
    // The stream ends with the upstream's 500 and a usage.
    let mut exchange = Exchange::new(Instant::now());
    exchange.status = Some(500);
    exchange.response_chunk(
        br#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}"#,
        true,
    );
    router.finished(routed.hold, exchange);
    assert_eq!(sample(&metrics, running), Some(0.0));
    let count = |name: &str| sample(&metrics, &format!("inference_objective_{name}_count{tiny}"));
    assert_eq!(count("request_duration_seconds"), Some(1.0));
    assert_eq!(count("response_sizes"), Some(1.0));
    assert_eq!(count("input_tokens"), Some(1.0));
    assert_eq!(
        sample(
            &metrics,
            &format!("inference_objective_input_tokens_sum{tiny}")
        ),
        Some(5.0)
    );
    assert_eq!(
        sample(
            &metrics,
            &format!("inference_objective_output_tokens_sum{tiny}")
        ),
        Some(3.0)
    );
    assert_eq!(count("normalized_time_per_output_token_seconds"), Some(1.0));
    assert_eq!(
        sample(
            &metrics,
            r#"inference_objective_request_error_total{model_name="tiny",target_model_name="tiny",error_code="ModelServerError"}"#
        ),
        Some(1.0)
    );

    // A model no replica serves is counted as `unknown`, with GIE's code for the 404.
    let refused = router
        .pick(post(
            "/v1/completions",
            r#"{"model":"made-up-1","prompt":"hi"}"#,
        ))
        .await
        .expect_err("unknown model");
    assert_eq!(refused.status, 404);
    assert_eq!(
        sample(
            &metrics,
            r#"inference_objective_request_error_total{model_name="unknown",target_model_name="unknown",error_code="BadRequest"}"#
        ),
        Some(1.0)
    );
    assert!(!metrics.encode().unwrap().contains("made-up-1"));
    // A dropped hold (the stream went away) leaves the running count too.
    let routed = router
        .pick(post("/v1/completions", r#"{"model":"tiny","prompt":"x"}"#))
        .await
        .unwrap();
    assert_eq!(sample(&metrics, running), Some(1.0));
    drop(routed);
    assert_eq!(sample(&metrics, running), Some(0.0));
}

#[tokio::test]
async fn a_session_key_over_its_limit_is_a_400_naming_the_header() {
    let pool = pool();
    let mut metrics = Metrics::new(Arc::clone(&pool));
    let config: crate::scheduler::SchedulerConfig = serde_yaml::from_str(
        "profile:\n  scorers:\n    - {type: session_affinity, weight: 1, parameters: {max_key_bytes: 8}}\n    - {type: in_flight, weight: 1}\n",
    )
    .unwrap();
    let scheduler = Scheduler::build(
        Arc::clone(&pool),
        &config,
        &crate::scheduler::PluginResources::standalone(),
        metrics.registry_mut(),
    )
    .unwrap();
    let metrics = Arc::new(metrics);
    let router = Router::new(scheduler, Arc::clone(&metrics), false);
    let with_session = |key: &str| RoutingRequest {
        headers: vec![("x-session-id".to_string(), key.to_string())],
        ..post("/v1/completions", r#"{"model":"tiny","prompt":"hi"}"#)
    };
    assert!(router.pick(with_session("short")).await.is_ok());
    let Err(refused) = router.pick(with_session("far-too-long-a-key")).await else {
        panic!("an 18-byte key over an 8-byte limit was routed");
    };
    assert_eq!(
        (refused.status, refused.error_type),
        (400, "invalid_request_error")
    );
    assert_eq!(
        refused.message,
        "the session header x-session-id is 18 bytes; the limit is 8"
    );
    let text = metrics.encode().unwrap();
    assert!(
        text.contains(r#"llmgw_decisions_total{outcome="bad_request"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"llmgw_session_affinity_total{outcome="too_long"} 1"#),
        "{text}"
    );
}

/// A router whose flow control knows the objective `batch` and waits at most 50ms.
fn router_with_flow_control(pool: &Arc<Pool>) -> Router {
    use crate::flowcontrol::{FlowMetrics, FlowSettings, ObjectiveSpec, Objectives};
    let scheduler = Scheduler::load_only(Arc::clone(pool)).expect("builds");
    let settings = FlowSettings {
        queue_timeout: Duration::from_millis(50),
        objectives: vec![ObjectiveSpec {
            name: "batch".into(),
            priority: -1,
            queue_timeout: None,
        }],
        ..FlowSettings::default()
    };
    let flow = Arc::new(FlowControl::new(
        settings.clone(),
        Arc::new(Objectives::new(&settings.objectives)),
        scheduler.capacity(),
        FlowMetrics::unregistered(""),
    ));
    tokio::spawn(Arc::clone(&flow).run(Duration::from_millis(10)));
    let metrics = Arc::new(Metrics::new(Arc::clone(pool)));
    Router::new(scheduler, metrics, false).with_flow_control(flow)
}

fn with_headers(mut request: RoutingRequest, headers: &[(&str, &str)]) -> RoutingRequest {
    request.headers = headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    request
}

#[tokio::test(start_paused = true)]
async fn flow_control_answers_map_to_statuses_and_a_freed_replica_serves_the_waiting() {
    let pool = pool();
    let router = router_with_flow_control(&pool);
    let completion = || post("/v1/completions", r#"{"model":"tiny","prompt":"x"}"#);
    assert!(
        router
            .request_headers()
            .iter()
            .any(|h| h == "x-gateway-inference-objective")
    );
    let unknown = with_headers(completion(), &[("x-gateway-inference-objective", "gold")]);
    assert_eq!(status_of(&router, unknown).await, 400);
    let negative = with_headers(completion(), &[("x-llmgw-queue-timeout", "-2s")]);
    assert_eq!(status_of(&router, negative).await, 400);
    assert_eq!(
        status_of(
            &router,
            post("/v1/completions", r#"{"model":"big","prompt":"x"}"#)
        )
        .await,
        404
    );
    // Saturated: a request waits for its deadline, then 429.
    let saturate = |waiting| {
        for replica in pool.snapshot().replicas() {
            replica.record_scrape(
                EngineLoad {
                    waiting: Some(waiting),
                    running: None,
                    kv_cache_usage: None,
                },
                Instant::now(),
            );
        }
    };
    saturate(1000.0);
    let started = Instant::now();
    assert_eq!(status_of(&router, completion()).await, 429);
    assert_eq!(started.elapsed(), Duration::from_millis(50));
    // Capacity returns while one waits: it is routed.
    let waiting = router.pick(with_headers(
        completion(),
        &[("x-gateway-inference-objective", "batch")],
    ));
    let free = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        saturate(0.0);
    };
    let (routed, ()) = tokio::join!(waiting, free);
    assert!(routed.is_ok());
    // The replicas fail while one waits: 503 at its deadline.
    saturate(1000.0);
    let waiting = router.pick(completion());
    let fail = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        for replica in pool.snapshot().replicas() {
            replica.set_health(Health::Unhealthy);
        }
    };
    let (failed, ()) = tokio::join!(waiting, fail);
    assert_eq!(failed.err().map(|r| r.status), Some(503));
    let text = router.metrics.encode().unwrap();
    assert!(
        text.contains("llmgw_decisions_total{outcome=\"saturated\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("llmgw_decisions_total{outcome=\"bad_request\"} 2"),
        "{text}"
    );
}

#[tokio::test]
async fn a_replica_a_filter_takes_out_is_counted_by_filter() {
    let pool = pool();
    let router = router(&pool, false);
    let full = pool
        .snapshot()
        .find("127.0.0.1:8001")
        .cloned()
        .expect("replica");
    full.record_scrape(
        EngineLoad {
            waiting: Some(0.0),
            running: Some(2.0),
            kv_cache_usage: Some(0.995),
        },
        Instant::now(),
    );
    let line = "llmgw_filtered_out_total{filter=\"saturation\"}";
    assert_eq!(
        sample(&router.metrics, line),
        None,
        "nothing counted before a decision"
    );
    for expected in [1.0, 2.0] {
        let routed = router
            .pick(post("/v1/completions", r#"{"model":"tiny","prompt":"hi"}"#))
            .await
            .unwrap();
        assert_eq!(routed.destination, "127.0.0.1:8002");
        assert_eq!(sample(&router.metrics, line), Some(expected));
    }
}
