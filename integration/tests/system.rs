//! The whole system as users run it: Envoy → llmgw-router (ext_proc) → llmgw-sim replicas, with
//! llmgw-agent streaming each replica's KV events into the router's index over the feed.

use std::time::Duration;

use llmgw_integration::system::{self, System, SystemConfig};
use serde_json::{Value, json};

async fn start(replicas: usize) -> System {
    system::start(SystemConfig {
        replicas,
        sim_args: vec!["--sim-no-latency".to_owned()],
        // Routing correctness, not tokenization speed, is under test: a loaded 2-core machine
        // must not turn a precise decision into a fallback.
        router_args: vec!["--tokenize-deadline".to_owned(), "2s".to_owned()],
        ..SystemConfig::default()
    })
    .await
}

/// Sends a request through Envoy; returns the replica that served it and the body.
async fn via_envoy(system: &System, path: &str, body: &Value) -> (String, Value) {
    let response = reqwest::Client::new()
        .post(system.url(path))
        .json(body)
        .send()
        .await
        .expect("envoy answers");
    assert_eq!(response.status().as_u16(), 200);
    let served = response
        .headers()
        .get("x-llmgw-sim-replica")
        .and_then(|v| v.to_str().ok())
        .expect("sim names itself")
        .to_owned();
    (served, response.json().await.expect("json body"))
}

fn document(i: usize) -> String {
    let clauses: Vec<String> = (0..40).map(|c| format!("section{i} clause{c}")).collect();
    format!("Contract {i}. {}", clauses.join("; "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_cached_on_one_replica_is_routed_there_through_envoy() {
    let system = start(3).await;
    let body = json!({"model": "tiny", "prompt": document(1), "max_tokens": 4});
    // Warm replica 2 directly, behind the router's back: only its KV events tell the router.
    let direct = reqwest::Client::new()
        .post(format!("{}/v1/completions", system.sims[2].url()))
        .json(&body)
        .send()
        .await
        .expect("sim answers");
    assert_eq!(direct.status().as_u16(), 200);
    assert!(
        system::converged(&system, Duration::from_secs(10)).await,
        "the router's index equals the sims' caches"
    );
    assert!(
        !system::router_blocks(&system, system.sims[2].addr)
            .await
            .is_empty()
    );
    for _ in 0..3 {
        let (served, answer) = via_envoy(&system, "/v1/completions", &body).await;
        assert_eq!(served, system.sims[2].addr.to_string());
        let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached_tokens");
        assert!(cached > 0, "{answer}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_follows_its_replica_turn_after_turn_and_the_index_stays_true() {
    let system = start(3).await;
    let mut messages = vec![
        json!({"role": "system", "content": document(2)}),
        json!({"role": "user", "content": "Summarise the first clause."}),
    ];
    let mut owner = None;
    for turn in 0..4 {
        let body = json!({"model": "tiny", "messages": messages, "max_tokens": 8});
        let (served, answer) = via_envoy(&system, "/v1/chat/completions", &body).await;
        if let Some(owner) = &owner {
            assert_eq!(&served, owner, "turn {turn}");
        }
        owner = Some(served);
        let reply = answer["choices"][0]["message"]["content"]
            .as_str()
            .expect("assistant text")
            .to_owned();
        messages.push(json!({"role": "assistant", "content": reply}));
        messages.push(json!({"role": "user", "content": format!("And clause {turn}?")}));
    }
    assert!(system::converged(&system, Duration::from_secs(10)).await);
    let metrics = reqwest::get(format!("http://{}/metrics", system.router.admin))
        .await
        .expect("router metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains("llmgw_kv_decisions_total{decision=\"hit\"}"),
        "{metrics}"
    );
}
