use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus as Status;
use tonic_health::pb::health_client::HealthClient;

use super::*;
use crate::config::{ServeArgs, Settings};
use crate::discovery::DiscoveryOptions;
use crate::discovery::fake_api::FakeApi;
use crate::feed::FeedOptions;
use crate::pool::monitor::ProbeOptions;

/// `serve` flags for ports the OS picks on loopback.
fn on_loopback() -> ServeArgs {
    let any = || Some("127.0.0.1:0".parse().unwrap());
    ServeArgs {
        grpc_addr: any(),
        admin_addr: any(),
        feed: FeedOptions {
            feed_addr: any(),
            ..FeedOptions::default()
        },
        ..ServeArgs::default()
    }
}

/// A router serving in this process until [`Running::stop`].
struct Running {
    bound: BoundAddrs,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<Result<(), ServeError>>,
}

impl Running {
    /// Serves `settings`; returns once every listener is bound.
    async fn start(settings: Settings) -> Running {
        let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(
            settings,
            async move {
                let _ = stop_rx.await;
            },
            move |bound| {
                let _ = bound_tx.send(bound);
            },
        ));
        Running {
            bound: bound_rx.await.unwrap(),
            stop,
            server,
        }
    }

    /// Shuts down and waits (at most 5 s) for `serve` to return, which must be `Ok`.
    async fn stop(self) {
        let _ = self.stop.send(());
        match tokio::time::timeout(Duration::from_secs(5), self.server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => panic!("serve failed: {error}"),
            Ok(Err(join)) => panic!("serve panicked: {join}"),
            Err(_) => panic!("serve did not return within 5 s of the shutdown"),
        }
    }
}

/// `GET url`'s body.
async fn text_of(url: &str) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

/// A replica stand-in whose /health answers 200 or 503 as `up` says.
async fn fake_replica(up: Arc<AtomicBool>) -> SocketAddr {
    let app = axum::Router::new()
        .route(
            "/health",
            axum::routing::get(move || {
                let up = up.load(Ordering::SeqCst);
                async move {
                    if up {
                        axum::http::StatusCode::OK
                    } else {
                        axum::http::StatusCode::SERVICE_UNAVAILABLE
                    }
                }
            }),
        )
        .route(
            "/metrics",
            axum::routing::get(|| async { "vllm:num_requests_waiting{engine=\"0\"} 2\n" }),
        );
    crate::testing::serve_on_loopback(app).await
}

async fn status_of(client: &mut HealthClient<tonic::transport::Channel>, service: &str) -> Status {
    let response = client
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .unwrap();
    response.into_inner().status()
}

/// A gRPC health client of the plaintext server at `addr`.
async fn health_client(addr: SocketAddr) -> HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
}

async fn wait_for(
    client: &mut HealthClient<tonic::transport::Channel>,
    service: &str,
    wanted: Status,
) {
    for _ in 0..200 {
        if status_of(client, service).await == wanted {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{service} never became {wanted:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_grpc_health_admin_endpoints_and_stops_on_shutdown() {
    let up = Arc::new(AtomicBool::new(true));
    let replica = fake_replica(Arc::clone(&up)).await;
    let settings = Settings::resolve(&ServeArgs {
        replicas: vec![format!("tiny={replica}")],
        probes: ProbeOptions {
            health_interval: Some(Duration::from_millis(50)),
            scrape_interval: Some(Duration::from_millis(50)),
            ..ProbeOptions::default()
        },
        ..on_loopback()
    })
    .unwrap();
    let running = Running::start(settings).await;
    let bound = running.bound;

    let mut health = health_client(bound.grpc).await;
    assert_eq!(status_of(&mut health, "liveness").await, Status::Serving);
    wait_for(&mut health, "readiness", Status::Serving).await;
    wait_for(&mut health, EXT_PROC_HEALTH_SERVICE, Status::Serving).await;

    let admin = format!("http://{}", bound.admin);
    let healthz = reqwest::get(format!("{admin}/healthz")).await.unwrap();
    assert_eq!(healthz.status().as_u16(), 200);
    let mut metrics = String::new();
    for _ in 0..100 {
        metrics = text_of(&format!("{admin}/metrics")).await;
        if metrics.contains(&format!("llmgw_replica_waiting{{replica=\"{replica}\"}} 2")) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        metrics.contains(&format!("llmgw_replica_waiting{{replica=\"{replica}\"}} 2")),
        "{metrics}"
    );
    assert!(metrics.contains(&format!("llmgw_replica_healthy{{replica=\"{replica}\"}} 1")));
    let debug: serde_json::Value =
        serde_json::from_str(&text_of(&format!("{admin}/debug")).await).unwrap();
    assert_eq!(debug["replicas"][0]["endpoint"], replica.to_string());
    assert_eq!(debug["replicas"][0]["models"][0], "tiny");
    assert_eq!(debug["scheduler"]["fallbacks"], 2);

    // The only replica fails its health check: not ready any more, still live.
    up.store(false, Ordering::SeqCst);
    wait_for(&mut health, "readiness", Status::NotServing).await;
    wait_for(&mut health, EXT_PROC_HEALTH_SERVICE, Status::NotServing).await;
    assert_eq!(status_of(&mut health, "liveness").await, Status::Serving);
    let healthz = reqwest::get(format!("{admin}/healthz")).await.unwrap();
    assert_eq!(healthz.status().as_u16(), 503);

    drop(health);
    running.stop().await;
}

/// One hand-driven agent stream on the feed port.
struct FeedStream {
    tx: tokio::sync::mpsc::Sender<llmgw_feed_proto::v1::AgentMessage>,
    rx: tonic::Streaming<llmgw_feed_proto::v1::RouterMessage>,
}

impl FeedStream {
    /// Connects as node `n1` with one engine on `replica`, holding `blocks`.
    async fn open(feed: SocketAddr, replica: &str, blocks: &[u64]) -> FeedStream {
        use llmgw_feed_proto::v1 as pb;
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{feed}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let engine = pb::EngineInfo::serving("e", replica);
        let hello = pb::agent_message::Body::hello("n1", "test", vec![engine]);
        let blocks = blocks
            .iter()
            .map(|&hash| pb::Block::copies(hash, 1))
            .collect();
        let snapshot = pb::agent_message::Body::snapshot("e", blocks);
        for (id, body) in [(1, hello), (2, snapshot)] {
            tx.send(pb::AgentMessage::numbered(id, body)).await.unwrap();
        }
        let rx = pb::feed_client::FeedClient::new(channel)
            .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        FeedStream { tx, rx }
    }

    /// Reads until the snapshot's acknowledgement; says whether the engine was refused.
    async fn refused(&mut self) -> bool {
        use llmgw_feed_proto::v1::router_message::Body;
        let mut refused = false;
        loop {
            let message = tokio::time::timeout(Duration::from_secs(5), self.rx.message())
                .await
                .expect("the snapshot is acknowledged within 5 s")
                .unwrap_or_else(|status| {
                    panic!("stream ended before the snapshot's ack: {status}")
                });
            match message.and_then(|m| m.body) {
                Some(Body::Refused(_)) => refused = true,
                Some(Body::Ack(ack)) if ack.id == 2 => return refused,
                Some(_) => {}
                None => panic!("stream ended before the snapshot's ack"),
            }
        }
    }

    /// The status the router ends the stream with.
    async fn ended(mut self) -> tonic::Status {
        let _keep_open = &self.tx;
        loop {
            match tokio::time::timeout(Duration::from_secs(5), self.rx.message()).await {
                Ok(Ok(Some(_))) => {}
                Ok(Ok(None)) => panic!("stream closed without a status"),
                Ok(Err(status)) => return status,
                Err(_) => panic!("the router never ended the stream"),
            }
        }
    }
}

async fn blocks_of(admin: SocketAddr, replica: &str) -> Vec<u64> {
    let body: serde_json::Value =
        reqwest::get(format!("http://{admin}/debug/replicas/{replica}/blocks"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    let mut hashes: Vec<u64> = body["block_hashes"]
        .as_array()
        .unwrap_or_else(|| panic!("{body}"))
        .iter()
        .filter_map(serde_json::Value::as_u64)
        .collect();
    hashes.sort_unstable();
    hashes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_feeds_node_map_follows_configuration_reloads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("llmgw.yaml");
    let write = |nodes: (&str, &str)| {
        let text = format!(
            "replicas:\n  - address: 127.0.0.1:8001\n    models: [tiny]\n    node: {}\n  \
             - address: 127.0.0.1:8002\n    models: [tiny]\n    node: {}\n",
            nodes.0, nodes.1
        );
        // Replaced whole, as a ConfigMap update is: this test is about the node map, not about
        // half-written files (the watcher's own tests cover those).
        let next = dir.path().join("llmgw.yaml.next");
        std::fs::write(&next, text).unwrap();
        std::fs::rename(&next, &path).unwrap();
    };
    write(("n1", "n2"));
    let settings = Settings::resolve(&ServeArgs {
        config: Some(path.clone()),
        config_poll_interval: Some(Duration::from_millis(20)),
        ..on_loopback()
    })
    .unwrap();
    let running = Running::start(settings).await;
    let bound = running.bound;

    // 127.0.0.1:8002 belongs to n2: n1's agent is refused.
    let mut stream = FeedStream::open(bound.feed, "127.0.0.1:8002", &[7, 8]).await;
    assert!(stream.refused().await, "8002 is not n1's yet");
    assert!(blocks_of(bound.admin, "127.0.0.1:8002").await.is_empty());

    // The file moves 8002 to n1: n1's stream is ended so its agent resends Hello and snapshots,
    // which are now accepted.
    write(("n1", "n1"));
    let status = stream.ended().await;
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status}");
    let mut stream = FeedStream::open(bound.feed, "127.0.0.1:8002", &[7, 8]).await;
    assert!(!stream.refused().await, "8002 is n1's now");
    assert_eq!(blocks_of(bound.admin, "127.0.0.1:8002").await, [7, 8]);

    // And back to n2: n1's blocks for it leave the index at once.
    write(("n1", "n2"));
    let status = stream.ended().await;
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status}");
    assert!(blocks_of(bound.admin, "127.0.0.1:8002").await.is_empty());
    let metrics = text_of(&format!("http://{}/metrics", bound.admin)).await;
    assert!(
        metrics.contains("llmgw_feed_node_map_reloads_total 2"),
        "{metrics}"
    );

    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_only_port_and_the_inference_pools_replicas() {
    let up = Arc::new(AtomicBool::new(true));
    let replica = fake_replica(Arc::clone(&up)).await;
    // The pool's one pod is the replica stand-in; its port is the pool's target port.
    let (api, kube_addr) = FakeApi::start().await;
    api.apply(
        "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools",
        serde_json::json!({
            "metadata": {"name": "chat-pool", "namespace": "llm"},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}},
                     "targetPorts": [{"number": replica.port()}]},
        }),
    );
    api.apply(
        "/api/v1/namespaces/llm/pods",
        serde_json::json!({
            "metadata": {"name": "vllm-0", "namespace": "llm", "labels": {"app": "vllm"}},
            "spec": {"nodeName": "node-a", "containers": []},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }),
    );
    // A Ready pod without an IP yet is skipped, and counted.
    api.apply(
        "/api/v1/namespaces/llm/pods",
        serde_json::json!({
            "metadata": {"name": "vllm-1", "namespace": "llm", "labels": {"app": "vllm"}},
            "spec": {"nodeName": "node-b", "containers": []},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }),
    );
    let dir = tempfile::tempdir().unwrap();
    let mut settings = Settings::resolve(&ServeArgs {
        models: vec!["tiny=block_size=16".to_string()],
        probes: ProbeOptions {
            health_interval: Some(Duration::from_millis(50)),
            ..ProbeOptions::default()
        },
        discovery: DiscoveryOptions {
            kubeconfig: Some(FakeApi::kubeconfig(kube_addr, dir.path())),
            ..DiscoveryOptions::default()
        },
        pool_name: Some("chat-pool".to_string()),
        pool_namespace: Some("llm".to_string()),
        feed: FeedOptions {
            feed_addr: Some("127.0.0.1:0".parse().unwrap()),
            // The pods run on nodes, but no agent feeds this router: ready without waiting.
            feed_sync_timeout: Some(Duration::ZERO),
            ..FeedOptions::default()
        },
        ..on_loopback()
    })
    .unwrap();
    // --grpc-health-port listens on every interface; a test stays on loopback.
    settings.grpc_health_addr = Some("127.0.0.1:0".parse().unwrap());
    let running = Running::start(settings).await;
    let bound = running.bound;
    let health_addr = bound.grpc_health.expect("a health-only listener");
    assert_ne!(health_addr, bound.grpc);

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{health_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel.clone());
    assert_eq!(status_of(&mut health, "liveness").await, Status::Serving);
    wait_for(&mut health, "readiness", Status::Serving).await;
    wait_for(&mut health, EXT_PROC_HEALTH_SERVICE, Status::Serving).await;
    wait_for(&mut health, "inference-extension", Status::Serving).await;
    up.store(false, Ordering::SeqCst);
    wait_for(&mut health, "readiness", Status::NotServing).await;
    wait_for(&mut health, "inference-extension", Status::NotServing).await;
    // Only health lives there: ext_proc is not served on that port.
    let mut ext_proc = envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient::new(channel);
    let refused = ext_proc
        .process(futures::stream::empty())
        .await
        .expect_err("no ext_proc on the health port");
    assert_eq!(refused.code(), tonic::Code::Unimplemented);

    let admin = format!("http://{}", bound.admin);
    let metrics = text_of(&format!("{admin}/metrics")).await;
    assert!(
        metrics.contains("llmgw_pool_info{pool_name=\"chat-pool\",pool_namespace=\"llm\"} 1"),
        "{metrics}"
    );
    let debug: serde_json::Value =
        serde_json::from_str(&text_of(&format!("{admin}/debug")).await).unwrap();
    assert_eq!(
        debug["inference_pool"],
        serde_json::json!({"name": "chat-pool", "namespace": "llm"})
    );
    // The replica came from the pool's pod, on the pod's node.
    assert_eq!(debug["replicas"][0]["endpoint"], replica.to_string());
    assert_eq!(debug["replicas"][0]["node"], "node-a");
    assert_eq!(debug["replicas"][0]["models"], serde_json::json!(["tiny"]));
    assert_eq!(debug["replicas"].as_array().map(Vec::len), Some(1));
    assert!(
        metrics.contains(
            "llmgw_discovery_problems_total{source=\"inference_pool\",problem=\"pod_without_ip\"} 1"
        ),
        "{metrics}"
    );

    running.stop().await;
}

/// `--grpc-uds`: listening once bound, the socket file removed on shutdown; a file of another
/// kind in the way is an error naming the path, and is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_listener_and_what_is_in_its_way() {
    let replica = fake_replica(Arc::new(AtomicBool::new(true))).await;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("llmgw.sock");
    let settings = |uds: &Path| {
        Settings::resolve(&ServeArgs {
            replicas: vec![format!("tiny={replica}")],
            grpc_uds: Some(uds.to_owned()),
            ..on_loopback()
        })
        .unwrap()
    };
    let running = Running::start(settings(&socket)).await;
    std::os::unix::net::UnixStream::connect(&socket).expect("listening on the socket");
    running.stop().await;
    assert!(!socket.exists(), "socket file left behind");

    let in_the_way = dir.path().join("notes.txt");
    std::fs::write(&in_the_way, "keep me").unwrap();
    let error = serve(settings(&in_the_way), std::future::pending(), |_| {})
        .await
        .expect_err("a regular file is in the way");
    assert!(matches!(error, ServeError::BindUnix { .. }), "{error}");
    assert!(error.to_string().contains("notes.txt"), "{error}");
    assert_eq!(std::fs::read_to_string(&in_the_way).unwrap(), "keep me");
}

/// A CA's certificate and a `localhost` server certificate it signed, written into `dir` as
/// tls.crt and tls.key; returns the CA's PEM.
fn write_signed_certificate(dir: &Path, ca_name: &str) -> String {
    let ca = crate::testing::TestCa::new(ca_name);
    let (cert, key) = ca.leaf(&["localhost"], &[]);
    // Written whole, then renamed, as a Secret volume's update swaps its files.
    for (name, text) in [("tls.crt", cert), ("tls.key", key)] {
        let partial = dir.join(format!(".{name}.new"));
        std::fs::write(&partial, text).unwrap();
        std::fs::rename(&partial, dir.join(name)).unwrap();
    }
    ca.pem()
}

/// A health client over TLS to `addr`, trusting `ca` for `localhost`.
async fn health_over_tls(
    addr: SocketAddr,
    ca: &str,
) -> Result<HealthClient<tonic::transport::Channel>, tonic::transport::Error> {
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(ca))
        .domain_name("localhost");
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(HealthClient::new(channel))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext_proc_over_tls_from_a_certificate_directory_that_is_reloaded() {
    let up = Arc::new(AtomicBool::new(true));
    let replica = fake_replica(Arc::clone(&up)).await;
    let dir = tempfile::tempdir().unwrap();
    let first_ca = write_signed_certificate(dir.path(), "first CA");
    let settings = Settings::resolve(&ServeArgs {
        replicas: vec![format!("tiny={replica}")],
        serving: crate::tls::ServingOptions {
            cert_path: Some(dir.path().to_path_buf()),
            enable_cert_reload: Some(true),
            ..Default::default()
        },
        ..on_loopback()
    })
    .unwrap();
    let running = Running::start(settings).await;
    let grpc = running.bound.grpc;

    // A client that trusts the first CA is served, health services included.
    let mut health = health_over_tls(grpc, &first_ca).await.unwrap();
    assert_eq!(status_of(&mut health, "liveness").await, Status::Serving);
    // A plaintext client is refused at the handshake, and counted.
    let plain = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    assert!(
        HealthClient::new(plain)
            .check(HealthCheckRequest::default())
            .await
            .is_err()
    );
    // Counted once per attempt (the client may reconnect once), in the handshake's own task.
    let metrics_url = format!("http://{}/metrics", running.bound.admin);
    let not_tls = |text: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(r#"llmgw_extproc_tls_refused_total{reason="not_tls"} "#))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let mut refused = 0.0;
    for _ in 0..200 {
        refused = not_tls(&text_of(&metrics_url).await);
        if refused >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(refused >= 1.0, "no not_tls refusal counted");

    // The Secret is renewed under another CA: the next connection gets the new certificate,
    // and a client trusting only the old CA no longer connects.
    let second_ca = write_signed_certificate(dir.path(), "second CA");
    let mut renewed = health_over_tls(grpc, &second_ca).await.unwrap();
    assert_eq!(status_of(&mut renewed, "liveness").await, Status::Serving);
    let stale = match health_over_tls(grpc, &first_ca).await {
        Ok(mut client) => client.check(HealthCheckRequest::default()).await.is_err(),
        Err(_) => true,
    };
    assert!(stale, "the old certificate is still served");
    // The connection opened before the renewal keeps working.
    assert_eq!(status_of(&mut health, "liveness").await, Status::Serving);

    running.stop().await;
}

#[test]
fn tls_options_read_as_gies_endpoint_picker_flags() {
    use crate::tls::{ServingOptions, ServingOptionsError, ServingTls};
    use clap::Parser as _;
    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        serving: ServingOptions,
    }
    let resolve = |args: &[&str]| {
        let mut all = vec!["serve"];
        all.extend_from_slice(args);
        Flags::try_parse_from(all)
            .unwrap()
            .serving
            .resolve(&ServingOptions::default())
    };
    assert_eq!(resolve(&[]), Ok(None));
    assert_eq!(resolve(&["--secure-serving=false"]), Ok(None));
    assert_eq!(
        resolve(&["--secure-serving"]),
        Ok(Some(ServingTls::SelfSigned))
    );
    assert_eq!(
        resolve(&["--secure-serving=true"]),
        Ok(Some(ServingTls::SelfSigned))
    );
    let Ok(Some(ServingTls::Files { paths, reload })) =
        resolve(&["--cert-path", "/etc/llmgw/tls", "--enable-cert-reload"])
    else {
        panic!("a certificate directory");
    };
    assert_eq!(paths.cert, Path::new("/etc/llmgw/tls/tls.crt"));
    assert_eq!(paths.key, Path::new("/etc/llmgw/tls/tls.key"));
    assert!(reload);
    assert_eq!(
        resolve(&["--secure-serving=false", "--cert-path", "/x"]),
        Err(ServingOptionsError::CertPathWithoutTls)
    );
    assert_eq!(
        resolve(&["--secure-serving", "--enable-cert-reload"]),
        Err(ServingOptionsError::ReloadWithoutFiles)
    );
}

/// Opens an ext_proc stream and sends the headers of `GET /v1/models` (routed at once, no
/// body); the stream stays open, as a request in flight does, until the returned sender drops.
async fn open_request(
    grpc: SocketAddr,
) -> (
    tokio::sync::mpsc::Sender<envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest>,
    tonic::Streaming<envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse>,
) {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
    use envoy_types::pb::envoy::service::ext_proc::v3::{HttpHeaders, ProcessingRequest};
    let header = |key: &str, value: &str| HeaderValue {
        key: key.to_string(),
        raw_value: value.as_bytes().to_vec(),
        ..HeaderValue::default()
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![header(":method", "GET"), header(":path", "/v1/models")],
            }),
            end_of_stream: true,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    })
    .await
    .unwrap();
    let mut client = envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient::connect(format!("http://{grpc}")).await.unwrap();
    let mut answers = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let routed = answers.message().await.unwrap().expect("the header answer");
    assert!(routed.response.is_some());
    (tx, answers)
}

async fn draining_router(delay: Duration, timeout: Duration) -> (Running, Arc<AtomicBool>) {
    let up = Arc::new(AtomicBool::new(true));
    let replica = fake_replica(Arc::clone(&up)).await;
    let settings = Settings::resolve(&ServeArgs {
        replicas: vec![format!("tiny={replica}")],
        probes: ProbeOptions {
            health_interval: Some(Duration::from_millis(50)),
            ..ProbeOptions::default()
        },
        drain_delay: Some(delay),
        drain_timeout: Some(timeout),
        ..on_loopback()
    })
    .unwrap();
    (Running::start(settings).await, up)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_reports_not_ready_first_then_lets_open_requests_finish() {
    let (running, _up) = draining_router(Duration::from_millis(400), Duration::from_secs(10)).await;
    let grpc = running.bound.grpc;
    let mut health = health_client(grpc).await;
    wait_for(&mut health, "readiness", Status::Serving).await;
    let (in_flight, _answers) = open_request(grpc).await;

    // SIGTERM: not ready at once, alive, and still accepting during the delay.
    running.stop.send(()).unwrap();
    for service in READINESS_SERVICES {
        wait_for(&mut health, service, Status::NotServing).await;
    }
    assert_eq!(status_of(&mut health, "liveness").await, Status::Serving);
    let (late, _late_answers) = open_request(grpc).await;
    drop(late);

    // After the delay the listener closes, but the open request keeps the router up.
    let mut refused = false;
    for _ in 0..300 {
        if tokio::net::TcpStream::connect(grpc).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(refused, "the listener never closed");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!running.server.is_finished(), "exited with a request open");

    // The request ends: the router exits cleanly.
    drop(in_flight);
    let served = tokio::time::timeout(Duration::from_secs(5), running.server)
        .await
        .expect("exits once the request ended");
    served.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_open_past_the_drain_timeout_does_not_keep_the_router() {
    let (running, _up) = draining_router(Duration::ZERO, Duration::from_millis(300)).await;
    let (_in_flight, _answers) = open_request(running.bound.grpc).await;
    running.stop.send(()).unwrap();
    let served = tokio::time::timeout(Duration::from_secs(5), running.server)
        .await
        .expect("exits at the drain timeout");
    served.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_every_node_s_agent_to_send_its_blocks() {
    use llmgw_feed_proto::v1 as pb;
    let up = Arc::new(AtomicBool::new(true));
    let replica = fake_replica(Arc::clone(&up)).await;
    let start = |timeout| {
        let args = ServeArgs {
            replicas: vec![format!("tiny={replica}@node-a")],
            probes: ProbeOptions {
                health_interval: Some(Duration::from_millis(50)),
                ..ProbeOptions::default()
            },
            ..on_loopback()
        };
        let mut args = args;
        args.feed.feed_sync_timeout = Some(timeout);
        Running::start(Settings::resolve(&args).unwrap())
    };
    let running = start(Duration::from_secs(3600)).await;
    let bound = running.bound;
    let mut health = health_client(bound.grpc).await;
    // From the first moment the server answers, readiness is known (not "not registered").
    assert_eq!(
        status_of(&mut health, "readiness").await,
        Status::NotServing
    );
    // The replica is healthy, but node-a's agent has not sent its blocks: not ready.
    let admin = format!("http://{}", bound.admin);
    for _ in 0..200 {
        let debug: serde_json::Value =
            serde_json::from_str(&text_of(&format!("{admin}/debug")).await).unwrap();
        if debug["replicas"][0]["health"] == "healthy" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        status_of(&mut health, "readiness").await,
        Status::NotServing
    );
    assert_eq!(
        status_of(&mut health, "inference-extension").await,
        Status::NotServing
    );
    assert_eq!(status_of(&mut health, "liveness").await, Status::Serving);

    // node-a's agent says Hello and sends its engine's snapshot: ready.
    let feed = tonic::transport::Endpoint::from_shared(format!("http://{}", bound.feed))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let engine = pb::EngineInfo::serving("e1", &replica.to_string());
    for (id, body) in [
        pb::agent_message::Body::hello("node-a", "test", vec![engine]),
        pb::agent_message::Body::snapshot("e1", vec![pb::Block::copies(7, 1)]),
    ]
    .into_iter()
    .enumerate()
    {
        tx.send(pb::AgentMessage::numbered(id as u64 + 1, body))
            .await
            .unwrap();
    }
    let mut replies = pb::feed_client::FeedClient::new(feed)
        .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    wait_for(&mut health, "readiness", Status::Serving).await;
    wait_for(&mut health, "inference-extension", Status::Serving).await;
    // The agent leaving later does not take readiness away (the feed's grace handles it).
    drop(tx);
    while replies.message().await.ok().flatten().is_some() {}
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(status_of(&mut health, "readiness").await, Status::Serving);
    drop(health);
    running.stop().await;

    // With no agent at all, the router is ready once --feed-sync-timeout has passed.
    let running = start(Duration::from_millis(300)).await;
    let mut health = health_client(running.bound.grpc).await;
    wait_for(&mut health, "readiness", Status::Serving).await;
    drop(health);
    running.stop().await;
}

/// Two routers whose feed ports ask for client certificates: one peers with the other over
/// mutual TLS, presenting its feed certificate (the default), and subscribes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_peers_over_mutual_tls_with_its_feed_certificate() {
    use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};

    use crate::peers::PeerOptions;
    use crate::testing::{TestCa, write_file};

    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("routers");
    let (cert, key) = ca.leaf(&["127.0.0.1"], &[ServerAuth, ClientAuth]);
    let ca_path = write_file(dir.path(), "ca.crt", &ca.pem());
    let feed_tls = |args: ServeArgs| ServeArgs {
        feed: FeedOptions {
            feed_tls_cert: Some(write_file(dir.path(), "tls.crt", &cert)),
            feed_tls_key: Some(write_file(dir.path(), "tls.key", &key)),
            feed_tls_client_ca: Some(ca_path.clone()),
            ..args.feed
        },
        ..args
    };
    let replica = fake_replica(Arc::new(AtomicBool::new(true))).await;
    let with_replica = |args: ServeArgs| ServeArgs {
        replicas: vec![format!("tiny={replica}")],
        ..args
    };
    let b =
        Running::start(Settings::resolve(&with_replica(feed_tls(on_loopback()))).unwrap()).await;
    let peer = format!("https://{}", b.bound.feed);
    let a = Running::start(
        Settings::resolve(&ServeArgs {
            peers: PeerOptions {
                peers: vec![peer.clone()],
                peer_tls_ca: Some(ca_path.clone()),
                ..PeerOptions::default()
            },
            ..with_replica(feed_tls(on_loopback()))
        })
        .unwrap(),
    )
    .await;
    let connected = format!("llmgw_peer_connected{{peer=\"{peer}\"}} 1");
    let metrics = format!("http://{}/metrics", a.bound.admin);
    let mut text = String::new();
    for _ in 0..500 {
        text = text_of(&metrics).await;
        if text.contains(&connected) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(text.contains(&connected), "{connected} not in:\n{text}");
    a.stop().await;
    b.stop().await;
}
