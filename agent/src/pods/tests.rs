use std::time::Duration;

use llmgw::discovery::fake_api::FakeApi;
use serde_json::{Value, json};

use super::*;
use crate::config::AgentArgs;
use crate::daemon::engines_become;

const PODS: &str = "/api/v1/namespaces/llm/pods";

/// A vLLM pod as the API serves it: named ports, phase, IP and node.
fn pod(name: &str, node: &str, phase: &str, ip: Option<&str>) -> Value {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "llm", "labels": {"app": "vllm"}},
        "spec": {"nodeName": node, "containers": [
            {"name": "vllm", "image": "vllm", "ports": [
                {"name": "http", "containerPort": 8000},
                {"name": "kv-events", "containerPort": 5557},
                {"name": "kv-replay", "containerPort": 5558},
            ]},
        ]},
        "status": {"phase": phase},
    });
    if let Some(ip) = ip {
        pod["status"]["podIP"] = json!(ip);
    }
    pod
}

fn parsed(objects: &[Value]) -> Vec<Arc<Pod>> {
    objects
        .iter()
        .map(|o| Arc::new(serde_json::from_value(o.clone()).expect("a pod")))
        .collect()
}

fn discovery(node: &str) -> PodDiscovery {
    AgentArgs {
        node: Some(node.into()),
        discover_pods: Some("app=vllm".into()),
        pod_namespace: Some("llm".into()),
        ..AgentArgs::default()
    }
    .resolve()
    .expect("config")
    .pods
    .expect("discovery")
}

#[test]
fn each_running_pod_is_an_engine_at_its_named_ports() {
    let mut no_replay = pod("c-no-replay", "n", "Running", Some("10.1.0.3"));
    no_replay["spec"]["containers"][0]["ports"]
        .as_array_mut()
        .expect("ports")
        .truncate(2);
    let mut dp = pod("d-dp", "n", "Running", Some("10.1.0.4"));
    dp["metadata"]["annotations"] = json!({DATA_PARALLEL_ANNOTATION: "2"});
    let mut deleting = pod("e-deleting", "n", "Running", Some("10.1.0.5"));
    deleting["metadata"]["deletionTimestamp"] = json!("2026-12-02T07:00:00Z");
    let pods = parsed(&[
        pod("b-pending", "n", "Pending", None),
        pod("a-running", "n", "Running", Some("10.1.0.1")),
        no_replay,
        dp,
        deleting,
        pod("f-done", "n", "Succeeded", Some("10.1.0.6")),
        pod("g-v6", "n", "Running", Some("fd00::7")),
    ]);
    let (engines, skipped) = engines_of(&pods, &discovery("n"), "kv");
    assert_eq!(skipped, vec![]);
    let found: Vec<(&str, &str, &str, Option<&str>)> = engines
        .iter()
        .map(|e| {
            (
                e.name.as_str(),
                e.replica.as_str(),
                e.endpoint.as_str(),
                e.replay.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        found,
        vec![
            (
                "10.1.0.1:8000",
                "10.1.0.1:8000",
                "tcp://10.1.0.1:5557",
                Some("tcp://10.1.0.1:5558")
            ),
            (
                "10.1.0.3:8000",
                "10.1.0.3:8000",
                "tcp://10.1.0.3:5557",
                None
            ),
            (
                "10.1.0.4:8000",
                "10.1.0.4:8000",
                "tcp://10.1.0.4:5557",
                Some("tcp://10.1.0.4:5558")
            ),
            (
                "10.1.0.4:8000#dp1",
                "10.1.0.4:8000",
                "tcp://10.1.0.4:5558",
                Some("tcp://10.1.0.4:5559")
            ),
            (
                "[fd00::7]:8000",
                "[fd00::7]:8000",
                "tcp://[fd00::7]:5557",
                Some("tcp://[fd00::7]:5558")
            ),
        ]
    );
    assert!(engines.iter().all(|e| e.topic == "kv" && !e.bind));
}

#[test]
fn ports_given_as_numbers_need_no_names() {
    let mut unnamed = pod("a", "n", "Running", Some("10.1.0.1"));
    unnamed["spec"]["containers"][0]["ports"] = json!([]);
    let discovery = PodDiscovery {
        http_port: PodPort::Number(8100),
        kv_events_port: PodPort::Number(6000),
        kv_replay_port: PodPort::Number(6001),
        ..discovery("n")
    };
    let (engines, skipped) = engines_of(&parsed(&[unnamed]), &discovery, "");
    assert_eq!(skipped, vec![]);
    assert_eq!(engines[0].replica, "10.1.0.1:8100");
    assert_eq!(engines[0].endpoint, "tcp://10.1.0.1:6000");
    assert_eq!(engines[0].replay.as_deref(), Some("tcp://10.1.0.1:6001"));
}

#[test]
fn a_pod_that_cannot_be_mirrored_is_left_out_with_the_reason() {
    let mut no_events = pod("a-no-events", "n", "Running", Some("10.1.0.1"));
    no_events["spec"]["containers"][0]["ports"] = json!([{"name": "http", "containerPort": 8000}]);
    let mut bad_dp = pod("b-bad-dp", "n", "Running", Some("10.1.0.2"));
    bad_dp["metadata"]["annotations"] = json!({DATA_PARALLEL_ANNOTATION: "65"});
    let mut zero_dp = pod("c-zero-dp", "n", "Running", Some("10.1.0.3"));
    zero_dp["metadata"]["annotations"] = json!({DATA_PARALLEL_ANNOTATION: "none"});
    let mut bad_port = pod("d-bad-port", "n", "Running", Some("10.1.0.4"));
    bad_port["spec"]["containers"][0]["ports"][0]["containerPort"] = json!(70000);
    let twin = pod("f-twin", "n", "Running", Some("10.1.0.9"));
    let pods = parsed(&[
        no_events,
        bad_dp,
        zero_dp,
        bad_port,
        pod("e-no-ip", "n", "Running", None),
        pod("e-one", "n", "Running", Some("10.1.0.9")),
        twin,
        pod("g-fine", "n", "Running", Some("10.1.0.10")),
    ]);
    let (engines, skipped) = engines_of(&pods, &discovery("n"), "");
    let names: Vec<&str> = engines.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["10.1.0.9:8000", "10.1.0.10:8000"]);
    let why: Vec<(&str, &str)> = skipped
        .iter()
        .map(|s| (s.pod.as_str(), s.why.as_str()))
        .collect();
    let expected = [
        ("a-no-events", "no container port named \"kv-events\""),
        ("b-bad-dp", "\"65\" is not 1 to 64"),
        ("c-zero-dp", "\"none\" is not 1 to 64"),
        ("d-bad-port", "port \"http\" is 70000"),
        ("e-no-ip", "Running without an IP"),
        ("f-twin", "engine 10.1.0.9:8000 is already another pod's"),
    ];
    assert_eq!(why.len(), expected.len(), "{why:?}");
    for ((pod, why), (want_pod, want_why)) in why.iter().zip(expected) {
        assert_eq!(*pod, want_pod);
        assert!(why.contains(want_why), "{pod}: {why}");
    }
}

#[test]
fn discovery_settings_are_checked_at_start_up() {
    let base = AgentArgs {
        node: Some("n".into()),
        discover_pods: Some("app=vllm".into()),
        ..AgentArgs::default()
    };
    for (args, why) in [
        (
            AgentArgs {
                engines: vec!["h:1=tcp://h:2".parse().expect("spec")],
                ..base.clone()
            },
            "drop --engine",
        ),
        (
            AgentArgs {
                node: None,
                ..base.clone()
            },
            "needs --node",
        ),
        (
            AgentArgs {
                discover_pods: Some(" ".into()),
                ..base.clone()
            },
            "needs a label selector",
        ),
        (
            AgentArgs {
                pod_kv_events_port: Some("KV_Events".into()),
                ..base.clone()
            },
            "neither a port number nor a container port name",
        ),
        (
            AgentArgs {
                pod_http_port: Some("0".into()),
                ..base.clone()
            },
            "port 0",
        ),
    ] {
        let err = args.resolve().expect_err(why).to_string();
        assert!(err.contains(why), "{err}");
    }
    let config = base.resolve().expect("config");
    assert!(config.engines.is_empty() && config.reload.is_none());
}

/// Against the fake API server: only this node's matching pods, followed as they start, stop
/// and move, and through an API outage.
#[tokio::test]
async fn the_agent_follows_its_nodes_pods() {
    let (api, addr) = FakeApi::start().await;
    api.apply(PODS, pod("a", "node-a", "Running", Some("10.1.0.1")));
    api.apply(PODS, pod("b", "node-a", "Pending", None));
    api.apply(
        PODS,
        pod("elsewhere", "node-b", "Running", Some("10.2.0.1")),
    );
    let mut other = pod("other-app", "node-a", "Running", Some("10.1.0.9"));
    other["metadata"]["labels"]["app"] = json!("other");
    api.apply(PODS, other);

    let args = AgentArgs {
        node: Some("node-a".into()),
        discover_pods: Some("app=vllm".into()),
        pod_namespace: Some("llm".into()),
        stale_after_ms: Some(0),
        ..AgentArgs::default()
    };
    let config = args.resolve().expect("config");
    let discovery = config.pods.clone().expect("discovery");
    let agent = Arc::new(Agent::start(config).await.expect("agent"));
    let mut membership = agent.membership();
    let task = tokio::spawn(run(Arc::clone(&agent), FakeApi::client(addr), discovery));
    engines_become(&agent, &["10.1.0.1:8000"]).await;
    let (lists, _) = api.requests(PODS);
    assert!(lists >= 1);
    assert!(membership.has_changed().expect("alive"));
    membership.mark_unchanged();

    // b starts; a stops; a pod moves here from node-b.
    api.apply(PODS, pod("b", "node-a", "Running", Some("10.1.0.2")));
    engines_become(&agent, &["10.1.0.1:8000", "10.1.0.2:8000"]).await;
    api.delete(PODS, "a");
    engines_become(&agent, &["10.1.0.2:8000"]).await;
    api.apply(
        PODS,
        pod("elsewhere", "node-a", "Running", Some("10.2.0.1")),
    );
    engines_become(&agent, &["10.1.0.2:8000", "10.2.0.1:8000"]).await;
    assert!(membership.has_changed().expect("alive"));

    // An outage keeps the engines; the watch resumes after it.
    let errors_before = agent.metrics.engine_source_errors.get();
    api.set_broken(true);
    api.drop_watches();
    for _ in 0..1000 {
        if agent.metrics.engine_source_errors.get() > errors_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(agent.metrics.engine_source_errors.get() > errors_before);
    assert_eq!(agent.engines().len(), 2, "the last engines stay");
    api.set_broken(false);
    api.delete(PODS, "b");
    engines_become(&agent, &["10.2.0.1:8000"]).await;
    task.abort();
}
