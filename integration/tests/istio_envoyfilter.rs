//! The Istio EnvoyFilters as a gateway runs them: `envoy/istio/gateway-envoyfilter.yaml`'s and
//! `sidecar-envoyfilter.yaml`'s patches are applied, as istiod applies them, to a proxy
//! configuration with two virtual hosts (the LLM host the filter names, and another), then a
//! real Envoy serves it in front of a real router and simulated replicas. What the patches must
//! do: requests to the LLM host are routed by llmgw and may carry bodies far over the proxy's
//! default buffer (llmgw's own 413 past `--max-body-bytes`); requests to the other host never
//! reach llmgw and are not buffered.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

mod router_support;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use llmgw_integration::envoy::EnvoyCommand;
use llmgw_integration::{free_port, repo_root};
use router_support::*;
use serde_json::{Value, json};

/// The router's default `--max-body-bytes`.
const MAX_BODY_BYTES: u64 = 16 * 1024 * 1024;

/// An EnvoyFilter's patches, as YAML says them.
fn patches_of(file: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(repo_root().join("envoy/istio").join(file)).expect("read");
    let filter: Value = serde_yaml::from_str(&text).expect("one YAML document");
    filter["spec"]["configPatches"]
        .as_array()
        .expect("configPatches")
        .clone()
}

/// Istio's MERGE: messages merge field by field, repeated fields append, scalars replace.
fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Object(base), Value::Object(patch)) => {
            for (key, value) in patch {
                match base.get_mut(key) {
                    Some(existing) => merge(existing, value),
                    None => {
                        base.insert(key.clone(), value.clone());
                    }
                }
            }
        }
        (Value::Array(base), Value::Array(patch)) => base.extend(patch.iter().cloned()),
        (base, patch) => *base = patch.clone(),
    }
}

/// The Istio cluster name of a `cluster: {service, portNumber}` match.
fn istio_cluster_name(m: &Value) -> String {
    format!(
        "outbound|{}||{}",
        m["portNumber"].as_u64().expect("portNumber"),
        m["service"].as_str().expect("service")
    )
}

fn static_cluster(name: &str, hosts: &[SocketAddr], h2: bool) -> Value {
    let endpoints: Vec<Value> = hosts
        .iter()
        .map(|a| {
            json!({"endpoint": {"address": {"socket_address": {
                "address": a.ip().to_string(), "port_value": a.port()}}}})
        })
        .collect();
    let mut cluster = json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s", "lb_policy": "LEAST_REQUEST",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
    });
    if h2 {
        cluster["typed_extension_protocol_options"] = json!({
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        });
    }
    cluster
}

/// A proxy as istiod builds one for a gateway (or an outbound sidecar listener), with `file`'s
/// patches applied: one HTTP connection manager whose routes are the LLM virtual host the
/// patches name (to the vLLM cluster) and `other.example.com` (to `other`), the router filter
/// last; the vLLM Service's cluster; the ext_proc cluster the filter calls. Returns the
/// configuration and the LLM host's domain.
fn patched_proxy(
    file: &str,
    listen: u16,
    admin: u16,
    router: SocketAddr,
    replicas: &[SocketAddr],
    other: SocketAddr,
) -> (Value, String) {
    let patches = patches_of(file);
    let vhost_name = patches
        .iter()
        .find(|p| p["applyTo"] == "VIRTUAL_HOST")
        .and_then(|p| p["match"]["routeConfiguration"]["vhost"]["name"].as_str())
        .expect("a VIRTUAL_HOST patch naming the LLM host")
        .to_owned();
    let domain = vhost_name.split(':').next().unwrap_or_default().to_owned();
    let vllm = patches
        .iter()
        .find(|p| p["applyTo"] == "CLUSTER")
        .map(|p| istio_cluster_name(&p["match"]["cluster"]))
        .expect("a CLUSTER patch");
    let route_to = |cluster: &str| json!([{"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "60s"}}]);
    let mut virtual_hosts = vec![
        json!({"name": vhost_name, "domains": [domain], "routes": route_to(&vllm)}),
        json!({"name": "other.example.com:80", "domains": ["*"], "routes": route_to("other")}),
    ];
    let router_filter = json!({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}});
    let mut http_filters = vec![router_filter];
    let mut vllm_cluster = static_cluster(&vllm, replicas, false);
    let mut ext_proc_clusters = Vec::new();
    let mut listener_patch = None;
    for patch in &patches {
        let value = &patch["patch"]["value"];
        let operation = patch["patch"]["operation"].as_str().unwrap_or_default();
        match (patch["applyTo"].as_str().unwrap_or_default(), operation) {
            ("HTTP_FILTER", "INSERT_BEFORE") => {
                assert_eq!(
                    patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"],
                    "envoy.filters.http.router"
                );
                let cluster = value["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
                    .as_str()
                    .expect("the ext_proc cluster");
                ext_proc_clusters.push(static_cluster(cluster, &[router], true));
                let at = http_filters.len() - 1;
                http_filters.insert(at, value.clone());
            }
            ("VIRTUAL_HOST", "MERGE") => {
                let name = &patch["match"]["routeConfiguration"]["vhost"]["name"];
                let host = virtual_hosts
                    .iter_mut()
                    .find(|v| v["name"] == *name)
                    .expect("the patched virtual host");
                merge(host, value);
            }
            ("CLUSTER", "MERGE") => merge(&mut vllm_cluster, value),
            ("LISTENER", "MERGE") => listener_patch = Some(value.clone()),
            (kind, op) => panic!("{file}: a {kind} {op} patch this test does not apply"),
        }
    }
    let address =
        |port: u16| json!({"socket_address": {"address": "127.0.0.1", "port_value": port}});
    let mut listener = json!({
        "name": "gateway", "address": address(listen),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "gateway",
                "route_config": {"name": "http.80", "virtual_hosts": virtual_hosts},
                "http_filters": http_filters,
            },
        }]}],
    });
    if let Some(patch) = listener_patch {
        merge(&mut listener, &patch);
    }
    let mut clusters = vec![vllm_cluster, static_cluster("other", &[other], false)];
    clusters.extend(ext_proc_clusters);
    let config = json!({
        "admin": {"address": address(admin)},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    });
    (config, domain)
}

/// Envoy's counter `name` from its admin `/stats`, 0 when absent.
async fn envoy_stat(admin: u16, name: String) -> u64 {
    let text = reqwest::get(format!(
        "http://127.0.0.1:{admin}/stats?filter=upstream_rq_total"
    ))
    .await
    .expect("GET /stats")
    .text()
    .await
    .expect("stats text");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

async fn send(
    envoy: SocketAddr,
    host: &str,
    body: String,
) -> (u16, Option<String>, Option<String>, Vec<u8>) {
    let response = client()
        .post(format!("http://{envoy}/v1/completions"))
        .header("host", host)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("request to {host}: {e}"));
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
    };
    let (replica, content_type) = (header(REPLICA_HEADER), header("content-type"));
    let body = response.bytes().await.expect("body").to_vec();
    (status, replica, content_type, body.to_vec())
}

async fn llm_host_is_routed_by_llmgw_and_no_other_host_is(file: &str) {
    let (a, b, _, router) = two_replicas_and_a_router(&[]).await;
    let other = echo_server("other").await;
    let (listen, admin) = (free_port(), free_port());
    let (config, domain) = patched_proxy(
        file,
        listen,
        admin,
        router.grpc,
        &[a.addr, b.addr],
        other.addr,
    );
    let ext_proc_cluster = config["static_resources"]["clusters"][2]["name"]
        .as_str()
        .expect("the ext_proc cluster")
        .to_owned();
    let envoy = EnvoyCommand::new(file, config.to_string(), listen, admin)
        .config_dir(PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("envoy-configs"))
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        envoy.ready(Duration::from_secs(10)).await,
        "{file}: Envoy not ready"
    );
    let llmgw_streams = || {
        envoy_stat(
            admin,
            format!("cluster.{ext_proc_cluster}.upstream_rq_total"),
        )
    };

    // The LLM host: llmgw picks (the replica header is a sim's), one ext_proc stream each.
    let decided = router.decisions("routed").await;
    for i in 0..4 {
        let (status, replica, _, body) = send(
            envoy.listen,
            &domain,
            completion("tiny", &format!("hello {i}")),
        )
        .await;
        assert_eq!(status, 200, "{file}: {}", String::from_utf8_lossy(&body));
        assert!(
            matches!(replica.as_deref(), Some("a" | "b")),
            "{file}: {replica:?}"
        );
    }
    assert!(
        router.decisions("routed").await >= decided + 4,
        "{file}: llmgw decided each"
    );
    let streams = llmgw_streams().await;
    assert!(streams >= 4, "{file}: {streams} ext_proc streams");

    // Another host: never sent to llmgw; a 1.5 MiB body (over the proxy's 1 MiB default
    // buffer, under the echo server's 2 MiB) streams through untouched, so nothing buffered it.
    let upload = "x".repeat(3 << 19);
    let (status, replica, _, body) = send(envoy.listen, "other.example.com", upload.clone()).await;
    assert_eq!((status, replica.as_deref()), (200, Some("other")), "{file}");
    assert_eq!(body.len(), upload.len(), "{file}: echoed whole");
    assert_eq!(
        llmgw_streams().await,
        streams,
        "{file}: the other host reached llmgw"
    );

    // The LLM host takes the same 1.5 MiB as a prompt (its virtual host's buffer: the listener
    // keeps Envoy's 1 MiB default; the simulator takes at most 2 MiB): llmgw routes it and the
    // replica itself answers, refusing a prompt longer than its context; and a body over
    // llmgw's --max-body-bytes gets llmgw's own JSON 413, not Envoy's.
    let decided = router.decisions("routed").await;
    let (status, replica, _, body) = send(envoy.listen, &domain, completion("tiny", &upload)).await;
    let text = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
    assert!(
        replica.is_some(),
        "{file}: not a replica's answer: {status} {text}"
    );
    assert_eq!(status, 400, "{file}: {text}");
    assert!(text.contains("maximum context length"), "{file}: {text}");
    assert_eq!(router.decisions("routed").await, decided + 1, "{file}");
    let over = completion("tiny", &"x".repeat(MAX_BODY_BYTES as usize + (1 << 20)));
    let (status, _, content_type, body) = send(envoy.listen, &domain, over).await;
    assert_eq!(status, 413, "{file}");
    assert_eq!(content_type.as_deref(), Some("application/json"), "{file}");
    let error: Value = serde_json::from_slice(&body).expect("a JSON error");
    assert_eq!(
        error["error"]["type"], "invalid_request_error",
        "{file}: {error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_filter_routes_the_llm_host_only() {
    llm_host_is_routed_by_llmgw_and_no_other_host_is("gateway-envoyfilter.yaml").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_filter_routes_the_vllm_service_only() {
    llm_host_is_routed_by_llmgw_and_no_other_host_is("sidecar-envoyfilter.yaml").await;
}

/// The buffer the filters give the LLM host is above the router's body limit, so a body llmgw
/// refuses reaches llmgw (its JSON 413) instead of being cut off by Envoy (plain text).
#[test]
fn the_llm_hosts_buffer_is_above_the_routers_body_limit() {
    for file in ["gateway-envoyfilter.yaml", "sidecar-envoyfilter.yaml"] {
        let patches = patches_of(file);
        let limit = patches
            .iter()
            .find(|p| p["applyTo"] == "VIRTUAL_HOST")
            .and_then(|p| p["patch"]["value"]["request_body_buffer_limit"].as_u64())
            .expect("the LLM host's request_body_buffer_limit");
        assert!(
            limit > MAX_BODY_BYTES,
            "{file}: {limit} <= {MAX_BODY_BYTES}"
        );
        // And no patch raises the whole listener's limit.
        assert!(
            patches.iter().all(|p| p["applyTo"] != "LISTENER"),
            "{file}: a LISTENER patch touches every host"
        );
    }
}
