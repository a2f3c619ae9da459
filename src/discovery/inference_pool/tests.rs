use std::time::Duration;

use parking_lot::Mutex;
use serde_json::{Value, json};

use super::*;
use crate::discovery::fake_api::FakeApi;
use crate::pool::{CONFIG_SOURCE, Pool};
use crate::testing::{addresses_and_nodes, wait_until};

const POOLS: &str = "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools";
const PODS: &str = "/api/v1/namespaces/llm/pods";

/// The replicas of pods a, b and c at the pool's two target ports (data-parallel ranks).
const POD_A: [(&str, &str); 2] = [("10.0.0.1:8000", "node-a"), ("10.0.0.1:8001", "node-a")];
const POD_B: [(&str, &str); 2] = [("10.0.0.2:8000", "node-b"), ("10.0.0.2:8001", "node-b")];
const POD_C: [(&str, &str); 2] = [("10.0.0.3:8000", "node-a"), ("10.0.0.3:8001", "node-a")];

fn pool_object(spec: Value) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "chat", "namespace": "llm"},
        "spec": spec,
    })
}

fn spec(app: &str, ports: &[u16]) -> Value {
    let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
    json!({
        "selector": {"matchLabels": {"app": app}},
        "targetPorts": ports,
        "endpointPickerRef": {"name": "llmgw-epp", "port": {"number": 9002}},
    })
}

/// A pod labelled `app`; `ready` sets its Ready condition, `ip` its pod IP.
fn pod(name: &str, app: &str, node: &str, ip: Option<&str>, ready: bool) -> Value {
    let mut status = json!({
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": if ready { "True" } else { "False" }},
        ],
    });
    if let Some(ip) = ip {
        status["podIP"] = json!(ip);
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "llm", "labels": {"app": app}},
        "spec": {"nodeName": node, "containers": [{"name": "vllm", "image": "vllm"}]},
        "status": status,
    })
}

#[test]
fn a_pool_spec_is_read_or_refused_with_a_reason() {
    let parsed = PoolSpec::parse(&spec("vllm", &[8000, 8001])).unwrap();
    assert_eq!(
        parsed,
        PoolSpec {
            selector: "app=vllm".to_string(),
            target_ports: vec![8000, 8001],
        }
    );
    // Expressions are selectors too.
    let expressions = json!({
        "selector": {"matchLabels": {"app": "vllm"},
                     "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}]},
        "targetPorts": [{"number": 8000}],
    });
    let parsed = PoolSpec::parse(&expressions).unwrap();
    assert!(parsed.selector.contains("app=vllm"), "{}", parsed.selector);
    assert!(
        parsed.selector.contains("tier in (a,b)"),
        "{}",
        parsed.selector
    );

    let nine: Vec<u16> = (8000..8009).collect();
    for (bad, why) in [
        (
            json!({"targetPorts": [{"number": 8000}]}),
            "selector is missing",
        ),
        (
            json!({"selector": {}, "targetPorts": [{"number": 8000}]}),
            "selector is empty",
        ),
        (spec("vllm", &[]), "has 0 ports"),
        (spec("vllm", &nine), "has 9 ports"),
        (
            json!({"selector": {"matchLabels": {"app": "v"}}, "targetPorts": [{"number": 70000}]}),
            "70000 is not a port",
        ),
        (
            json!({"selector": {"matchLabels": {"app": "v"}}, "targetPorts": [{"number": 0}]}),
            "0 is not a port",
        ),
        (json!({"selector": "app=vllm"}), "unreadable spec"),
        (
            json!({"selector": {"matchExpressions": [{"key": "k", "operator": "Sideways"}]},
                   "targetPorts": [{"number": 1}]}),
            "spec.selector",
        ),
    ] {
        let err = PoolSpec::parse(&bad).expect_err(why);
        assert!(err.contains(why), "{bad}: {err}");
    }
}

#[test]
fn ready_pods_times_ports_are_the_replicas() {
    let pods: Vec<Arc<Pod>> = [
        pod("b", "vllm", "node-b", Some("10.0.0.2"), true),
        pod("a", "vllm", "node-a", Some("10.0.0.1"), true),
        pod("starting", "vllm", "node-a", Some("10.0.0.3"), false),
        pod("pending", "vllm", "node-a", None, true),
        pod("bad-ip", "vllm", "node-a", Some("ten.zero"), true),
    ]
    .into_iter()
    .map(|p| Arc::new(serde_json::from_value(p).unwrap()))
    .chain([{
        let mut leaving: Pod =
            serde_json::from_value(pod("leaving", "vllm", "node-c", Some("10.0.0.4"), true))
                .unwrap();
        leaving.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ));
        Arc::new(leaving)
    }])
    .collect();
    let (replicas, without_ip) = replicas_of(&pods, &[8000, 8001], &["tiny".to_string()]);
    assert_eq!(
        addresses_and_nodes(&replicas),
        [
            ("10.0.0.1:8000".to_string(), Some("node-a")),
            ("10.0.0.1:8001".to_string(), Some("node-a")),
            ("10.0.0.2:8000".to_string(), Some("node-b")),
            ("10.0.0.2:8001".to_string(), Some("node-b")),
        ]
    );
    assert!(replicas.iter().all(|r| r.models == ["tiny"]));
    assert_eq!(without_ip, ["pending", "bad-ip"]);
}

/// A pool fed by a pool watcher, and what it publishes.
struct Watched {
    pool: Arc<Pool>,
    published: Arc<Mutex<Vec<ReplicaSpec>>>,
    metrics: DiscoveryMetrics,
    task: tokio::task::JoinHandle<()>,
}

impl Watched {
    async fn start(addr: std::net::SocketAddr) -> Watched {
        Watched::with_models(addr, ModelSource::Configured(vec!["tiny".to_string()])).await
    }

    async fn with_models(addr: std::net::SocketAddr, models: ModelSource) -> Watched {
        let pool = Arc::new(Pool::new(Vec::new(), Duration::from_secs(5)));
        let published = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&published);
        let sources = Arc::new(ReplicaSources::new(Arc::clone(&pool), 2, move |all| {
            *sink.lock() = all.to_vec();
        }));
        let metrics = DiscoveryMetrics::default();
        let task = tokio::spawn(run(
            FakeApi::client(addr),
            PoolRef {
                namespace: "llm".to_string(),
                name: "chat".to_string(),
            },
            models,
            sources,
            CONFIG_SOURCE + 1,
            metrics.clone(),
        ));
        Watched {
            pool,
            published,
            metrics,
            task,
        }
    }

    /// The replicas published, with their models.
    fn models(&self) -> Vec<(String, Vec<String>)> {
        self.published
            .lock()
            .iter()
            .map(|r| (r.address.to_string(), r.models.clone()))
            .collect()
    }

    /// The replicas published, with their nodes.
    fn replicas(&self) -> Vec<(String, Option<String>)> {
        self.published
            .lock()
            .iter()
            .map(|r| (r.address.to_string(), r.node.clone()))
            .collect()
    }

    fn endpoints(&self) -> Vec<String> {
        self.pool
            .snapshot()
            .replicas()
            .iter()
            .map(|r| r.endpoint().to_string())
            .collect()
    }

    async fn until_replicas(&self, want: &[(&str, &str)]) {
        let want: Vec<(String, Option<String>)> = want
            .iter()
            .map(|(a, n)| (a.to_string(), Some(n.to_string())))
            .collect();
        let endpoints: Vec<String> = want.iter().map(|(a, _)| a.clone()).collect();
        wait_until(|| self.replicas() == want && self.endpoints() == endpoints).await;
    }

    async fn until_problem(&self, problem: Problem, at_least: u64) {
        wait_until(|| self.metrics.count_of(SourceKind::inference_pool, problem) >= at_least).await;
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pools_ready_pods_are_watched_through_changes_gaps_and_bad_specs() {
    let (api, addr) = FakeApi::start().await;
    api.apply(POOLS, pool_object(spec("vllm", &[8000, 8001])));
    api.apply(PODS, pod("a", "vllm", "node-a", Some("10.0.0.1"), true));
    api.apply(PODS, pod("b", "vllm", "node-b", Some("10.0.0.2"), true));
    api.apply(PODS, pod("c", "vllm", "node-a", Some("10.0.0.3"), false));
    api.apply(PODS, pod("web", "web", "node-a", Some("10.0.0.8"), true));
    let watched = Watched::start(addr).await;

    // Each Ready pod at each target port (data-parallel ranks), on its node.
    watched.until_replicas(&[POD_A, POD_B].concat()).await;

    // A pod leaving Ready leaves at once; one becoming Ready joins.
    api.apply(PODS, pod("b", "vllm", "node-b", Some("10.0.0.2"), false));
    api.apply(PODS, pod("c", "vllm", "node-a", Some("10.0.0.3"), true));
    watched.until_replicas(&[POD_A, POD_C].concat()).await;
    assert_eq!(api.requests(PODS).0, 1, "one list of pods, then watch");

    // A bookmark moves the quiet pod watch's resourceVersion past changes it does not see (a
    // pod of another app), so resuming after the history is compacted needs no relist.
    api.apply(PODS, pod("web", "web", "node-b", Some("10.0.0.8"), true));
    api.bookmark();
    wait_until(|| api.bookmarks_sent(PODS) == 1).await;
    api.compact();
    api.drop_watches();
    api.apply(PODS, pod("b", "vllm", "node-b", Some("10.0.0.2"), true));
    watched
        .until_replicas(&[POD_A, POD_B, POD_C].concat())
        .await;
    assert_eq!(api.requests(PODS).0, 1, "resumed from the bookmark");

    // Without a bookmark, a gap the history no longer covers is 410 Gone: the client lists
    // again, and a pod deleted during the gap is gone. The API server is down across the gap,
    // so that no watch can resume before the history is compacted.
    api.apply(PODS, pod("web", "web", "node-a", Some("10.0.0.8"), true));
    api.set_broken(true);
    api.drop_watches();
    api.delete(PODS, "c");
    api.compact();
    api.set_broken(false);
    watched.until_replicas(&[POD_A, POD_B].concat()).await;
    assert!(api.requests(PODS).0 >= 2, "relisted after 410");

    // A Ready pod without an IP is skipped, logged and counted.
    api.apply(PODS, pod("d", "vllm", "node-c", None, true));
    watched.until_problem(Problem::pod_without_ip, 1).await;

    // Unusable specs keep the last replicas: over 8 ports, then a selector matching nothing.
    let nine: Vec<u16> = (8000..8009).collect();
    api.apply(POOLS, pool_object(spec("vllm", &nine)));
    watched.until_problem(Problem::invalid_pool, 1).await;
    api.apply(POOLS, pool_object(spec("nothing", &[8000])));
    watched.until_problem(Problem::no_pods, 1).await;
    assert_eq!(watched.endpoints().len(), 4);

    // A new selector and port: the pod watch restarts on it.
    api.apply(PODS, pod("e", "chat", "node-d", Some("10.0.1.1"), true));
    api.apply(POOLS, pool_object(spec("chat", &[9000])));
    watched.until_replicas(&[("10.0.1.1:9000", "node-d")]).await;

    // The pool is deleted: its last replicas stay, still following their pods.
    api.delete(POOLS, "chat");
    watched.until_problem(Problem::pool_not_found, 1).await;
    api.apply(PODS, pod("f", "chat", "node-d", Some("10.0.1.2"), true));
    watched
        .until_replicas(&[("10.0.1.1:9000", "node-d"), ("10.0.1.2:9000", "node-d")])
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_pool_or_a_failing_api_is_counted_until_it_recovers() {
    let (api, addr) = FakeApi::start().await;
    api.apply(PODS, pod("a", "vllm", "node-a", Some("10.0.0.1"), true));
    api.set_broken(true);
    let watched = Watched::start(addr).await;
    watched.until_problem(Problem::api, 1).await;
    assert!(watched.replicas().is_empty());

    // The API answers, but there is no such pool yet.
    api.set_broken(false);
    watched.until_problem(Problem::pool_not_found, 1).await;
    assert!(watched.replicas().is_empty());

    // It is created: its pods become replicas.
    api.apply(POOLS, pool_object(spec("vllm", &[8000])));
    watched.until_replicas(&[("10.0.0.1:8000", "node-a")]).await;
}

#[tokio::test]
async fn an_unreadable_service_account_token_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("token");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: k\n  cluster: {{server: 'http://127.0.0.1:1'}}\nusers:\n- name: u\n  user: {{tokenFile: '{}'}}\ncontexts:\n- name: c\n  context: {{cluster: k, user: u, namespace: llm}}\n",
            missing.display()
        ),
    )
    .unwrap();
    let Err(err) = crate::discovery::client(Some(&kubeconfig)).await else {
        panic!("a client without its token");
    };
    let text = format!("{err}: {:?}", std::error::Error::source(&err));
    assert!(text.contains(&missing.display().to_string()), "{text}");

    // With the token there, the same file gives a client in the context's namespace.
    std::fs::write(&missing, "secret").unwrap();
    let client = crate::discovery::client(Some(&kubeconfig)).await.unwrap();
    assert_eq!(client.default_namespace(), "llm");
}

#[test]
fn a_model_listing_is_read_with_bounds() {
    let listing = br#"{"object":"list","data":[
        {"id":"base","object":"model","root":"meta/base","parent":null},
        {"id":"lora-a","object":"model","root":"/adapters/a","parent":"base"}]}"#;
    assert_eq!(models_in(listing).unwrap(), ["base", "lora-a"]);
    for (bad, why) in [
        (br#"{"data":[]}"#.to_vec(), "lists no model"),
        (b"<html>".to_vec(), "not a model list"),
        (
            format!(r#"{{"data":[{}]}}"#, vec![r#"{"id":"m"}"#; 1025].join(",")).into_bytes(),
            "over 1024 models",
        ),
        (vec![b' '; 1024 * 1024 + 1], "over 1048576 bytes"),
    ] {
        let err = models_in(&bad).expect_err(why);
        assert!(err.contains(why), "{err}");
    }
}

/// Serves `/v1/models` listing `models` on `listener`.
fn serve_models(listener: tokio::net::TcpListener, models: &'static [&'static str]) {
    let app = axum::Router::new().route(
        "/v1/models",
        axum::routing::get(move || async move {
            let data: Vec<Value> = models
                .iter()
                .map(|m| json!({"id": m, "object": "model"}))
                .collect();
            axum::Json(json!({"object": "list", "data": data}))
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_configured_models_each_replica_says_its_own() {
    let first = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let first_port = first.local_addr().unwrap().port();
    serve_models(first, &["base", "lora-a"]);
    // The second rank answers nothing yet.
    let second_port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let (api, addr) = FakeApi::start().await;
    api.apply(POOLS, pool_object(spec("vllm", &[first_port, second_port])));
    api.apply(PODS, pod("a", "vllm", "node-a", Some("127.0.0.1"), true));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let watched = Watched::with_models(addr, ModelSource::Discovered(client)).await;
    let first_replica = format!("127.0.0.1:{first_port}");
    wait_until(|| {
        watched.models()
            == [(
                first_replica.clone(),
                vec!["base".to_string(), "lora-a".to_string()],
            )]
    })
    .await;
    watched.until_problem(Problem::models_unknown, 1).await;

    // The second rank starts answering: it joins at the next retry.
    let second = tokio::net::TcpListener::bind(("127.0.0.1", second_port))
        .await
        .unwrap();
    serve_models(second, &["base"]);
    let second_replica = format!("127.0.0.1:{second_port}");
    let mut want = vec![
        (
            first_replica,
            vec!["base".to_string(), "lora-a".to_string()],
        ),
        (second_replica, vec!["base".to_string()]),
    ];
    want.sort();
    wait_until(|| {
        let mut got = watched.models();
        got.sort();
        got == want
    })
    .await;
}
