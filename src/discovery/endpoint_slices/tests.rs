use std::time::Duration;

use parking_lot::Mutex;
use serde_json::{Value, json};

use super::*;
use crate::discovery::fake_api::FakeApi;
use crate::pool::{CONFIG_SOURCE, Pool};
use crate::testing::{addresses_and_nodes, wait_until};

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
    assert_eq!(
        addresses_and_nodes(&replicas),
        [
            ("10.0.0.1:8000".to_string(), Some("node-a")),
            ("10.0.0.2:8000".to_string(), Some("node-b")),
            ("[fd00::7]:8000".to_string(), None),
        ]
    );
    assert!(replicas.iter().all(|r| r.models == ["tiny"]));
}

const SLICES: &str = "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices";

fn slice(name: &str, service: &str, endpoints: Value) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "llm",
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": endpoints,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watched_endpoints_follow_pods_and_survive_an_api_outage() {
    let (api, addr) = FakeApi::start().await;
    api.apply(
        SLICES,
        slice(
            "vllm-x",
            "vllm",
            json!([
                {"addresses": ["10.1.0.1"], "conditions": {"ready": true}, "nodeName": "node-a"},
            ]),
        ),
    );
    // Another Service's slice in the namespace is not ours.
    api.apply(
        SLICES,
        slice("other-x", "other", json!([{"addresses": ["10.9.9.9"]}])),
    );

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
    let metrics = DiscoveryMetrics::default();
    let watcher = tokio::spawn(run(
        FakeApi::client(addr),
        vec![source()],
        Arc::clone(&sources),
        CONFIG_SOURCE + 1,
        metrics.clone(),
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

    // The pod moves to another node and a second one starts, not ready yet: a watch event.
    api.apply(
        SLICES,
        slice(
            "vllm-x",
            "vllm",
            json!([
                {"addresses": ["10.1.0.9"], "conditions": {"ready": true}, "nodeName": "node-b"},
                {"addresses": ["10.1.0.5"], "conditions": {"ready": false}, "nodeName": "node-a"},
            ]),
        ),
    );
    wait_until(|| {
        endpoints(&pool) == ["127.0.0.1:9", "10.1.0.9:8000"]
            && nodes() == [None, Some("node-b".to_string())]
    })
    .await;
    // One list, then watches: nothing polls.
    let (lists, watches) = api.requests(SLICES);
    assert_eq!(lists, 1, "{:?}", api.requests(SLICES));
    assert!(watches >= 1);

    // The API server fails and its watches drop: the last replicas stay.
    api.set_broken(true);
    api.drop_watches();
    wait_until(|| metrics.count_of(SourceKind::endpoint_slices, Problem::api) > 0).await;
    assert_eq!(endpoints(&pool), ["127.0.0.1:9", "10.1.0.9:8000"]);
    // It recovers having compacted its history (the watch's resourceVersion is gone: 410, so
    // the client lists again), and the Service has no endpoints now: the discovered replicas
    // go, the static one stays.
    api.delete(SLICES, "vllm-x");
    api.compact();
    api.set_broken(false);
    wait_until(|| endpoints(&pool) == ["127.0.0.1:9"]).await;
    assert!(metrics.count_of(SourceKind::endpoint_slices, Problem::no_pods) >= 1);
    watcher.abort();
}
