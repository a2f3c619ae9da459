use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;
use serde_json::{Value, json};

use super::*;
use crate::pool::{CONFIG_SOURCE, Pool};

fn source() -> K8sService {
    "tiny=llm/vllm:8000".parse().unwrap()
}

fn slices(value: Value) -> Vec<EndpointSlice> {
    serde_json::from_value(value).unwrap()
}

#[test]
fn service_specs_parse_and_print() {
    let spec = source();
    assert_eq!(
        spec,
        K8sService {
            model: "tiny".into(),
            namespace: "llm".into(),
            service: "vllm".into(),
            port: 8000,
        }
    );
    assert_eq!(spec.to_string(), "tiny=llm/vllm:8000");
    for bad in [
        "",
        "tiny",
        "tiny=vllm:8000",
        "tiny=llm/vllm",
        "tiny=llm/vllm:http",
        "=llm/vllm:8000",
        "tiny=/vllm:8000",
        "tiny=llm/:8000",
        "tiny=llm/vllm:70000",
    ] {
        assert!(bad.parse::<K8sService>().is_err(), "{bad:?} accepted");
    }
}

#[test]
fn ready_endpoints_become_replicas_with_their_nodes() {
    let slices = slices(json!([
        {
            "metadata": {"name": "vllm-a"},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.0.0.2"], "conditions": {"ready": true}, "nodeName": "node-b"},
                {"addresses": ["10.0.0.1"], "nodeName": "node-a"},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": false}, "nodeName": "node-a"},
                {"addresses": ["not-an-ip"], "conditions": {"ready": true}},
            ],
        },
        {
            "metadata": {"name": "vllm-b"},
            "addressType": "IPv6",
            "endpoints": [{"addresses": ["fd00::7"], "conditions": {"ready": true}}],
        },
    ]));
    let replicas = replicas_from_slices(&source(), &slices);
    let seen: Vec<(String, Option<&str>)> = replicas
        .iter()
        .map(|r| (r.address.to_string(), r.node.as_deref()))
        .collect();
    assert_eq!(
        seen,
        [
            ("10.0.0.1:8000".to_string(), Some("node-a")),
            ("10.0.0.2:8000".to_string(), Some("node-b")),
            ("[fd00::7]:8000".to_string(), None),
        ]
    );
    assert!(replicas.iter().all(|r| r.models == ["tiny"]));
}

/// A stand-in for the API server's EndpointSlice list: answers what `slices` holds for the
/// label selector `kubernetes.io/service-name=vllm` in namespace `llm`, or 500 while `broken`.
#[derive(Default)]
struct FakeApi {
    slices: Mutex<Value>,
    broken: Mutex<bool>,
}

async fn list_endpoint_slices(
    State(api): State<Arc<FakeApi>>,
    Path(namespace): Path<String>,
    Query(query): Query<std::collections::HashMap<String, String>>,
) -> Response {
    if *api.broken.lock() {
        return (StatusCode::INTERNAL_SERVER_ERROR, "etcd is sad").into_response();
    }
    let selected = namespace == "llm"
        && query.get("labelSelector").map(String::as_str)
            == Some("kubernetes.io/service-name=vllm");
    let items = if selected {
        api.slices.lock().clone()
    } else {
        json!([])
    };
    axum::Json(json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSliceList",
        "metadata": {"resourceVersion": "1"},
        "items": items,
    }))
    .into_response()
}

fn slice_with(endpoints: Value) -> Value {
    json!([{"metadata": {"name": "vllm-x"}, "addressType": "IPv4", "endpoints": endpoints}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polled_endpoints_follow_pods_and_survive_an_api_outage() {
    let api = Arc::new(FakeApi::default());
    *api.slices.lock() = slice_with(json!([
        {"addresses": ["10.1.0.1"], "conditions": {"ready": true}, "nodeName": "node-a"},
    ]));
    let app = axum::Router::new()
        .route(
            "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
            axum::routing::get(list_endpoint_slices),
        )
        .with_state(Arc::clone(&api));
    let addr = crate::testing::serve_on_loopback(app).await;

    // A static replica from the configuration stays beside the discovered ones.
    let static_replica = ReplicaSpec {
        address: "127.0.0.1:9".parse().unwrap(),
        models: vec!["other".into()],
        node: None,
    };
    let pool = Arc::new(Pool::new(vec![static_replica], Duration::from_secs(5)));
    let published = Arc::new(Mutex::new(Vec::<ReplicaSpec>::new()));
    let sink = Arc::clone(&published);
    let sources = Arc::new(ReplicaSources::new(Arc::clone(&pool), 2, move |all| {
        *sink.lock() = all.to_vec();
    }));
    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let poller = tokio::spawn(run(
        client,
        vec![source()],
        Duration::from_millis(20),
        Arc::clone(&sources),
        CONFIG_SOURCE + 1,
    ));

    let endpoints = |pool: &Pool| -> Vec<String> {
        pool.snapshot()
            .replicas()
            .iter()
            .map(|r| r.endpoint().to_string())
            .collect()
    };
    // The pool is swapped before the change is published (the feed's node map): wait for both.
    let nodes =
        || -> Vec<Option<String>> { published.lock().iter().map(|r| r.node.clone()).collect() };
    wait_until(|| {
        endpoints(&pool) == ["127.0.0.1:9", "10.1.0.1:8000"]
            && nodes() == [None, Some("node-a".to_string())]
    })
    .await;

    // The pod moves to another node and a second one starts, not ready yet.
    *api.slices.lock() = slice_with(json!([
        {"addresses": ["10.1.0.9"], "conditions": {"ready": true}, "nodeName": "node-b"},
        {"addresses": ["10.1.0.5"], "conditions": {"ready": false}, "nodeName": "node-a"},
    ]));
    // The feed's node map follows the pod.
    wait_until(|| {
        endpoints(&pool) == ["127.0.0.1:9", "10.1.0.9:8000"]
            && nodes() == [None, Some("node-b".to_string())]
    })
    .await;

    // The API server fails: the last replicas stay.
    *api.broken.lock() = true;
    *api.slices.lock() = json!([]);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(endpoints(&pool), ["127.0.0.1:9", "10.1.0.9:8000"]);
    // It recovers with no endpoints: the discovered replicas go, the static one stays.
    *api.broken.lock() = false;
    wait_until(|| endpoints(&pool) == ["127.0.0.1:9"]).await;
    poller.abort();
}

/// Polls `check` every 10 ms, failing after 10 s.
async fn wait_until(mut check: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("condition not met within 10 s");
}
