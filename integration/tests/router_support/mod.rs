//! Real-process stacks for the router's integration tests: `llmgw-sim` replicas, `llmgw-router`
//! and Envoy (with one of the repository's configurations, ports rewritten), all on loopback,
//! all killed when the test ends. Test support: panics with a message when something does not
//! start.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use llmgw_integration::envoy::EnvoyCommand;
use llmgw_integration::router::RouterCommand;
use llmgw_integration::{
    ChildGuard, SimHandle, bin_path, free_port, repo_root, retarget_envoy_config, spawn_sim,
};

pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
pub const REPLICA_HEADER: &str = "x-llmgw-sim-replica";

/// A simulated replica named `name` (its `x-llmgw-sim-replica`) serving `models`, on `port`
/// (0 = any free port), with a short decode time per token unless `extra` says otherwise.
pub fn sim(name: &str, models: &[&str], port: u16, extra: &[&str]) -> SimHandle {
    let mut args = vec!["--served-model-name"];
    args.extend_from_slice(models);
    args.extend_from_slice(&["--sim-replica", name]);
    if !extra.contains(&"--sim-decode-us-per-token") {
        args.extend_from_slice(&["--sim-decode-us-per-token", "2000"]);
    }
    args.extend_from_slice(extra);
    if port == 0 {
        return spawn_sim(args);
    }
    // `spawn_sim` always passes `--port 0`, and the simulator refuses a second `--port`: start
    // it here on the fixed port (a restarted replica must come back at its old address).
    let mut child = Command::new(bin_path("llmgw-sim"))
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn llmgw-sim");
    let stdout = child.stdout.take().expect("piped stdout");
    let guard = ChildGuard::new("llmgw-sim", child);
    let mut lines = BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        let line = line.expect("sim stdout");
        if let Some(url) = line.strip_prefix("llmgw-sim listening on http://") {
            let addr = url.trim().parse().expect("listening address");
            std::thread::spawn(move || for _ in lines {});
            return SimHandle {
                addr,
                events: None,
                replay: None,
                guard,
            };
        }
    }
    panic!("llmgw-sim exited before listening on port {port}");
}

/// A running `llmgw-router serve`.
pub struct RouterProcess {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    /// The agent feed's port.
    pub feed: SocketAddr,
    pub guard: ChildGuard,
}

/// Starts the router on the given gRPC port with `replicas` (`MODEL=IP:PORT`) and extra flags,
/// and waits until it has bound its ports.
pub fn start_router(grpc_port: u16, replicas: &[String], extra: &[&str]) -> RouterProcess {
    let mut command = RouterCommand::new()
        .grpc(SocketAddr::from(([127, 0, 0, 1], grpc_port)))
        .args(["--health-interval", "200ms", "--scrape-interval", "100ms"])
        .args(["--probe-timeout", "500ms"]);
    for replica in replicas {
        command = command.args(["--replica", replica]);
    }
    let process = command
        .args(extra)
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    RouterProcess {
        grpc: process.addrs.grpc,
        admin: process.addrs.admin,
        feed: process.addrs.feed,
        guard: process.guard,
    }
}

impl RouterProcess {
    /// The router's `/debug` JSON.
    pub async fn debug(&self) -> serde_json::Value {
        reqwest::get(format!("http://{}/debug", self.admin))
            .await
            .expect("GET /debug")
            .json()
            .await
            .expect("debug JSON")
    }

    /// The router's Prometheus text.
    pub async fn metrics(&self) -> String {
        reqwest::get(format!("http://{}/metrics", self.admin))
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("metrics text")
    }

    /// Waits until exactly the replicas in `healthy` are healthy (by endpoint).
    pub async fn wait_healthy(&self, healthy: &[SocketAddr]) {
        let wanted: Vec<String> = healthy.iter().map(|a| a.to_string()).collect();
        for _ in 0..200 {
            let debug = self.debug().await;
            let mut now: Vec<String> = debug["replicas"]
                .as_array()
                .expect("replicas")
                .iter()
                .filter(|r| r["health"] == "healthy")
                .map(|r| r["endpoint"].as_str().unwrap_or_default().to_string())
                .collect();
            now.sort();
            let mut wanted_sorted = wanted.clone();
            wanted_sorted.sort();
            if now == wanted_sorted {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "replicas never became exactly {wanted:?}: {}",
            self.debug().await
        );
    }

    /// The current `llmgw_replica_in_flight` of `replica`, 0 when absent.
    pub async fn in_flight(&self, replica: SocketAddr) -> u64 {
        let needle = format!("llmgw_replica_in_flight{{replica=\"{replica}\"}} ");
        self.metrics()
            .await
            .lines()
            .find_map(|l| l.strip_prefix(&needle).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0)
    }

    /// The `llmgw_decisions_total` count for `outcome`.
    pub async fn decisions(&self, outcome: &str) -> u64 {
        let needle = format!("llmgw_decisions_total{{outcome=\"{outcome}\"}} ");
        self.metrics()
            .await
            .lines()
            .find_map(|l| l.strip_prefix(&needle).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0)
    }
}

/// Replicas `a` and `b` serving `tiny`, and a router for both on a free gRPC port with `flags`,
/// once it has seen both healthy.
pub async fn two_replicas_and_a_router(
    flags: &[&str],
) -> (SimHandle, SimHandle, u16, RouterProcess) {
    let a = sim("a", &["tiny"], 0, &[]);
    let b = sim("b", &["tiny"], 0, &[]);
    let grpc = free_port();
    let router = start_router(
        grpc,
        &[format!("tiny={}", a.addr), format!("tiny={}", b.addr)],
        flags,
    );
    router.wait_healthy(&[a.addr, b.addr]).await;
    (a, b, grpc, router)
}

/// A running Envoy with one of the repository's configurations.
pub struct EnvoyProcess {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub guard: ChildGuard,
    pub config: PathBuf,
}

/// Starts Envoy with `envoy/<config>` rewritten to: the router's gRPC port, fresh listener and
/// admin ports, and `replicas` as the replica cluster's hosts (replacing 8001 and 8002).
pub async fn start_envoy(config: &str, grpc_port: u16, replicas: [SocketAddr; 2]) -> EnvoyProcess {
    start_envoy_with(config, grpc_port, replicas, |text| text).await
}

/// [`start_envoy`], with `edit` applied to the configuration's text before the ports are moved.
pub async fn start_envoy_with(
    config: &str,
    grpc_port: u16,
    replicas: [SocketAddr; 2],
    edit: impl FnOnce(String) -> String,
) -> EnvoyProcess {
    let text =
        std::fs::read_to_string(repo_root().join("envoy").join(config)).expect("read envoy config");
    let listen = free_port();
    let admin = free_port();
    let text = retarget_envoy_config(&edit(text), listen, admin, grpc_port, replicas);
    let envoy = EnvoyCommand::new(config, text, listen, admin)
        .config_dir(PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("envoy-configs"))
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        envoy.ready(Duration::from_secs(10)).await,
        "envoy never became ready with {}",
        envoy.config.display()
    );
    EnvoyProcess {
        listen: envoy.listen,
        admin: envoy.admin,
        guard: envoy.guard,
        config: envoy.config,
    }
}

impl EnvoyProcess {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.listen, path)
    }

    /// Waits until Envoy's active health check has marked the `llmgw` cluster's host down
    /// (configurations that health-check llmgw only).
    pub async fn wait_llmgw_marked_down(&self) {
        self.wait_llmgw_health(true).await;
    }

    /// Waits until Envoy's active health check has found llmgw serving (configurations that
    /// health-check llmgw only).
    pub async fn wait_llmgw_marked_up(&self) {
        self.wait_llmgw_health(false).await;
    }

    async fn wait_llmgw_health(&self, down: bool) {
        for _ in 0..100 {
            let clusters = reqwest::get(format!("http://{}/clusters", self.admin))
                .await
                .expect("GET /clusters")
                .text()
                .await
                .expect("clusters text");
            let flags = clusters
                .lines()
                .find(|l| l.starts_with("llmgw::") && l.contains("::health_flags::"))
                .unwrap_or_default();
            if flags.contains("failed_active_hc") == down {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "envoy never marked llmgw {}",
            if down { "down" } else { "up" }
        );
    }
}

/// A client that never pools connections across tests and never follows redirects.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("http client")
}

/// POSTs JSON `body` to `path` through Envoy with optional extra headers; returns status, the
/// serving replica's name (if any) and the body.
pub async fn post(
    envoy: &EnvoyProcess,
    path: &str,
    body: impl Into<reqwest::Body>,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, String) {
    let mut request = client()
        .post(envoy.url(path))
        .header("content-type", "application/json")
        .body(body);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let response = request.send().await.expect("request through envoy");
    let status = response.status().as_u16();
    let replica = response
        .headers()
        .get(REPLICA_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let text = response.text().await.expect("response body");
    (status, replica, text)
}

/// A completion request body.
pub fn completion(model: &str, prompt: &str) -> String {
    serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 4}).to_string()
}

/// An HTTP server in this process that answers everything with 200, the header
/// `x-llmgw-sim-replica: <name>` and the request body echoed back, and counts hits. Used as an
/// echo replica (byte-for-byte checks) and as an attacker's host outside the cluster.
pub struct EchoServer {
    pub addr: SocketAddr,
    pub hits: std::sync::Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn echo_server(name: &'static str) -> EchoServer {
    use axum::body::Bytes;
    let hits = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = std::sync::Arc::clone(&hits);
    let app = axum::Router::new().fallback(move |body: Bytes| {
        let counter = std::sync::Arc::clone(&counter);
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            ([(REPLICA_HEADER, name)], body)
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind echo");
    let addr = listener.local_addr().expect("echo addr");
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    EchoServer { addr, hits, task }
}
