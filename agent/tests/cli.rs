//! The `llmgw-agent` binary: `vllm-args`, `tail` and `serve` against an in-process publisher
//! replaying the recorded vLLM 0.32.0 stream.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a bench or test harness: a panic is a failed run, not a crashed router"
)]

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

mod support;
use support::{final_set, frames};

use llmgw_agent::wire::{KvEvent, decode_batch};
use llmgw_agent::zmq::Publisher;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_llmgw-agent"));
    for (k, _) in std::env::vars() {
        if k.starts_with("LLMGW_AGENT_") {
            c.env_remove(k);
        }
    }
    c
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn vllm_args_prints_the_seed_and_flags_from_flags_or_environment() {
    let out = bin()
        .args([
            "vllm-args",
            "--engine",
            "10.0.0.5:8000=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5600,bind",
            "--block-size",
            "32",
            "--topic",
            "kv",
        ])
        .env("LLMGW_AGENT_HASH_SEED", "1729")
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf8");
    assert!(text.contains("export PYTHONHASHSEED=1729"), "{text}");
    assert!(
        text.contains("--prefix-caching-hash-algo sha256_cbor"),
        "{text}"
    );
    assert!(
        text.contains(r#""endpoint":"tcp://127.0.0.1:5557""#),
        "{text}"
    );
    assert!(
        text.contains(r#""replay_endpoint":"tcp://*:5600""#),
        "{text}"
    );

    let bad = bin()
        .args(["vllm-args", "--engine", "nonsense"])
        .output()
        .expect("runs");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("REPLICA=ENDPOINT"));
}

#[tokio::test]
async fn tail_prints_each_batch_as_one_json_line() {
    let frames = frames();
    let mut publisher = Publisher::on_loopback("kv", false, 10)
        .await
        .expect("binds");
    let mut child = Killed(
        bin()
            .args(["tail", "--connect", &publisher.endpoint, "--topic", "kv"])
            .args(["--count", &frames.len().to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("tail starts"),
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    for f in &frames {
        publisher.publish(f.seq, &f.payload).await.expect("publish");
    }
    let stdout = child.0.stdout.take().expect("stdout");
    let lines: Vec<String> = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map(|l| l.expect("line"))
            .collect()
    })
    .await
    .expect("reader");
    assert_eq!(lines.len(), frames.len());
    for (line, f) in lines.iter().zip(&frames) {
        let v: serde_json::Value = serde_json::from_str(line).expect("json line");
        assert_eq!(v["seq"], f.seq);
        let batch = decode_batch(&f.payload).expect("decodes");
        // serde_json's default float parsing may differ in the last ulp.
        let ts = v["ts"].as_f64().expect("ts");
        assert!((ts - batch.ts).abs() < 1e-6, "{ts} vs {}", batch.ts);
        assert_eq!(v["dp_rank"], 0);
        let events = v["events"].as_array().expect("events");
        assert_eq!(events.len(), batch.events.len());
        for (je, e) in events.iter().zip(&batch.events) {
            assert_eq!(je["type"], e.kind());
            if let KvEvent::BlockStored(s) = e {
                let hashes: Vec<u64> = je["block_hashes"]
                    .as_array()
                    .expect("hashes")
                    .iter()
                    .map(|h| h.as_u64().expect("u64"))
                    .collect();
                let want: Vec<u64> = s.block_hashes.iter().map(|h| h.0).collect();
                assert_eq!(hashes, want);
                assert_eq!(je["block_size"], 32);
                assert_eq!(je["medium"], "GPU");
                assert!(je.get("token_ids").is_some() && je.get("extra_keys").is_some());
            }
        }
    }
}

fn free_port() -> u16 {
    llmgw_core::test_ports::loopback_port()
}

fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())
}

#[tokio::test]
async fn serve_mirrors_the_recorded_stream_and_exposes_it_on_the_admin_port() {
    let frames = frames();
    let mut publisher = Publisher::on_loopback("kv", true, 100)
        .await
        .expect("binds");
    let admin = free_port();
    let engine = format!(
        "r0:8000={},replay={}",
        publisher.endpoint,
        publisher.replay_endpoint.clone().expect("replay")
    );
    let _child = Killed(
        bin()
            .args([
                "serve", "--node", "n1", "--engine", &engine, "--topic", "kv",
            ])
            .args(["--hash-seed", "1729", "--block-size", "32"])
            .env("LLMGW_AGENT_ADMIN_ADDR", format!("127.0.0.1:{admin}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("serve starts"),
    );
    let mut up = false;
    for _ in 0..100 {
        if http_get(admin, "/healthz").is_some_and(|b| b.contains("ok")) {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(up, "admin port answers");
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Batch 7 is lost on the way: the agent must replay it.
    for f in &frames {
        if f.seq == 7 {
            publisher.publish_lost(f.seq, &f.payload);
        } else {
            publisher.publish(f.seq, &f.payload).await.expect("publish");
        }
    }
    let want = final_set(&frames);
    let mut got = HashSet::new();
    for _ in 0..100 {
        if let Some(body) = http_get(admin, "/debug/engines/r0:8000/blocks")
            && let Ok(v) = serde_json::from_str::<Vec<u64>>(&body)
        {
            got = v.into_iter().collect();
            if got == want {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(got, want);
    let engines = http_get(admin, "/debug/engines").expect("engines");
    assert!(engines.contains(r#""hash":"verified""#), "{engines}");
    let metrics = http_get(admin, "/metrics").expect("metrics");
    assert!(
        metrics.contains(r#"llmgw_agent_replays_total{engine="r0:8000",reason="filled"} 1"#),
        "{metrics}"
    );
    assert!(metrics.contains(r#"llmgw_agent_events_total{engine="r0:8000",type="BlockStored"}"#));
}

/// `serve --discover-pods` against the fake Kubernetes API server: the node's Running vLLM pod
/// becomes an engine at its named ports and is mirrored; deleted, it is gone.
#[tokio::test]
async fn serve_discovers_its_nodes_pods_through_the_kubernetes_api() {
    use llmgw::discovery::fake_api::FakeApi;
    const PODS: &str = "/api/v1/namespaces/llm/pods";
    let frames = frames();
    let mut publisher = Publisher::on_loopback("kv", false, 100)
        .await
        .expect("binds");
    let events_port: u16 = publisher
        .endpoint
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .expect("a port");
    let (api, addr) = FakeApi::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = FakeApi::kubeconfig(addr, dir.path());
    let pod = |name: &str, node: &str| {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "llm", "labels": {"app": "vllm"}},
            "spec": {"nodeName": node, "containers": [{"name": "vllm", "ports": [
                {"name": "http", "containerPort": 8000},
                {"name": "kv-events", "containerPort": events_port},
            ]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1"},
        })
    };
    api.apply(PODS, pod("vllm-0", "node-a"));
    let mut elsewhere = pod("vllm-1", "node-b");
    elsewhere["status"]["podIP"] = serde_json::json!("127.0.0.2");
    api.apply(PODS, elsewhere);

    let admin = free_port();
    let _child = Killed(
        bin()
            .args(["serve", "--node", "node-a", "--topic", "kv"])
            .args(["--discover-pods", "app=vllm", "--kubeconfig"])
            .arg(&kubeconfig)
            .args(["--hash-seed", "1729", "--block-size", "32"])
            .env("LLMGW_AGENT_ADMIN_ADDR", format!("127.0.0.1:{admin}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("serve starts"),
    );
    let engines = || {
        http_get(admin, "/debug/engines")
            .and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok())
            .map(|v| {
                v["engines"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|e| e["engine"].as_str().map(str::to_owned))
                    .collect::<Vec<_>>()
            })
    };
    let mut found = None;
    for _ in 0..200 {
        found = engines();
        if found.as_deref() == Some(&["127.0.0.1:8000".to_owned()][..]) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        found,
        Some(vec!["127.0.0.1:8000".to_owned()]),
        "the node's pod only"
    );

    // Mirrored: the recorded stream, published until the agent's SUB has subscribed.
    let want = final_set(&frames);
    let mut got = HashSet::new();
    'mirrored: for _ in 0..20 {
        for f in &frames {
            publisher.publish(f.seq, &f.payload).await.expect("publish");
        }
        for _ in 0..10 {
            if let Some(body) = http_get(admin, "/debug/engines/127.0.0.1:8000/blocks")
                && let Ok(v) = serde_json::from_str::<Vec<u64>>(&body)
            {
                got = v.into_iter().collect();
                if got == want {
                    break 'mirrored;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert_eq!(got, want);

    api.delete(PODS, "vllm-0");
    for _ in 0..200 {
        found = engines();
        if found.as_ref().is_some_and(Vec::is_empty) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(found, Some(vec![]), "a deleted pod is no engine");
    let metrics = http_get(admin, "/metrics").expect("metrics");
    assert!(
        metrics.contains(r#"llmgw_agent_engine_changes_total{change="removed"} 1"#),
        "{metrics}"
    );
}

#[test]
fn json_log_format_writes_one_json_object_per_stderr_line() {
    let output = bin()
        .args(["serve", "--log-format", "json"])
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .output()
        .expect("llmgw-agent runs");
    assert!(!output.status.success(), "serve without engines must fail");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let events: Vec<serde_json::Value> = stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let error = events
        .iter()
        .find(|e| e["level"] == "ERROR")
        .unwrap_or_else(|| panic!("no ERROR line in {stderr}"));
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("--engine")),
        "{error}"
    );
}
