//! The whole system as users run it: Envoy → llmgw-router (ext_proc) → llmgw-sim replicas, with
//! llmgw-agent streaming each replica's KV events into the router's index over the feed.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::time::Duration;

use llmgw_integration::extproc_client::ExtProcClient;
use llmgw_integration::prom;
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
        if turn > 0 {
            // The previous turn's blocks have reached the router's index (the agent streams
            // them a few milliseconds after the engine step), so this turn is the index's call.
            assert!(system::converged(&system, Duration::from_secs(10)).await);
        }
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

/// Asks `router` over ext_proc, as Envoy does in BUFFERED mode, where `body` would go; returns
/// the destination (primary first). The stream ends with the answer, so nothing stays in flight.
async fn pick(router: system::RouterAddrs, path: &str, body: &Value) -> String {
    let mut client = ExtProcClient::connect(router.grpc)
        .await
        .expect("connect to the router's ext_proc port");
    client
        .route(path, body.to_string().as_bytes())
        .await
        .expect("ext_proc answers")
        .destination()
        .expect("the body answer routes")
}

/// Waits until `router` counts no request in flight on any replica.
async fn wait_idle(router: system::RouterAddrs) {
    for _ in 0..200 {
        let metrics = prom::scrape(&format!("http://{}/metrics", router.admin))
            .await
            .expect("router metrics");
        let busy =
            prom::samples(&metrics).any(|s| s.name == "llmgw_replica_in_flight" && s.value != 0.0);
        if !busy {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("router {} still has requests in flight", router.admin);
}

/// Two routers fed by one agent agree on every pick of the same request stream: prompts cached
/// on one replica, their extensions, chats, salted and fresh prompts (ties included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_routers_fed_by_one_agent_pick_identically() {
    let system = system::start(SystemConfig {
        replicas: 3,
        routers: 2,
        sim_args: vec!["--sim-no-latency".to_owned()],
        // A pick credits its replica with the prompt's blocks for the speculative TTL. Routers
        // asked in turn see those credits expire a moment apart, so the test keeps them for
        // its whole length: both routers then hold the same state at every request.
        router_args: ["--tokenize-deadline", "2s", "--speculative-ttl", "120s"]
            .map(str::to_owned)
            .to_vec(),
        ..SystemConfig::default()
    })
    .await;
    // Warm each replica with its own documents, behind the routers' backs.
    for (i, sim) in system.sims.iter().enumerate() {
        for doc in [10 + i, 20 + i] {
            let body = json!({"model": "tiny", "prompt": document(doc), "max_tokens": 4});
            let response = reqwest::Client::new()
                .post(format!("{}/v1/completions", sim.url()))
                .json(&body)
                .send()
                .await
                .expect("sim answers");
            assert_eq!(response.status().as_u16(), 200);
        }
    }
    assert!(
        system::converged(&system, Duration::from_secs(10)).await,
        "both routers' indexes equal the sims' caches"
    );
    assert!(
        system::load_seen(&system, Duration::from_secs(10)).await,
        "both routers have scraped the sims' load after the warm-up"
    );

    let mut stream: Vec<(&str, Value)> = Vec::new();
    for i in 0..3 {
        for doc in [10 + i, 20 + i] {
            stream.push((
                "/v1/completions",
                json!({"model": "tiny", "prompt": format!("{} Question {i}?", document(doc))}),
            ));
        }
        stream.push((
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [
                {"role": "system", "content": document(10 + i)},
                {"role": "user", "content": "Summarise."},
            ]}),
        ));
        stream.push((
            "/v1/completions",
            json!({"model": "tiny", "prompt": document(10 + i), "cache_salt": "tenant-b"}),
        ));
    }
    for fresh in 0..8 {
        stream.push((
            "/v1/completions",
            json!({"model": "tiny", "prompt": format!("A fresh prompt number {fresh}.")}),
        ));
    }

    let [first, second] = system.routers()[..] else {
        panic!("two routers expected");
    };
    let mut cached_picks = Vec::new();
    for (n, (path, body)) in stream.iter().enumerate() {
        // Same state on both sides: the previous request's in-flight count released everywhere
        // (a stream's end reaches the router asynchronously).
        for router in [first, second] {
            wait_idle(router).await;
        }
        let a = pick(first, path, body).await;
        let b = pick(second, path, body).await;
        // The pick is the primary. The fallbacks' order may differ: it follows each router's
        // own scrape of the replicas' load, taken at its own moments.
        let primary = |d: &str| d.split(',').next().unwrap_or_default().to_owned();
        assert_eq!(
            primary(&a),
            primary(&b),
            "request {n} ({path}) was picked differently: {a} vs {b}"
        );
        let sorted = |d: &str| {
            let mut all: Vec<String> = d.split(',').map(str::to_owned).collect();
            all.sort();
            all
        };
        assert_eq!(sorted(&a), sorted(&b), "request {n}: fallbacks differ");
        if n < 12 && n % 4 < 2 {
            cached_picks.push(primary(&a));
        }
    }
    // The cached documents' extensions went where their documents are.
    let owners: Vec<String> = (0..3)
        .flat_map(|i| vec![system.sims[i].addr.to_string(); 2])
        .collect();
    assert_eq!(cached_picks, owners);
}

/// Peered routers (`--peer`): a prompt one router placed, which no engine has reported yet, is a
/// hit at the other, which heard of the pick over peering and credits it as its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peered_router_credits_the_other_routers_pick() {
    let system = system::start(SystemConfig {
        replicas: 3,
        routers: 2,
        peering: true,
        sim_args: vec!["--sim-no-latency".to_owned()],
        router_args: ["--tokenize-deadline", "2s", "--speculative-ttl", "120s"]
            .map(str::to_owned)
            .to_vec(),
        ..SystemConfig::default()
    })
    .await;
    let [first, second] = system.routers()[..] else {
        panic!("two routers expected");
    };
    let metric = |router: system::RouterAddrs,
                  name: &'static str,
                  labels: &'static [(&str, &str)]| async move {
        let text = prom::scrape(&format!("http://{}/metrics", router.admin))
            .await
            .expect("router metrics");
        prom::sum(&text, name, labels).unwrap_or(0.0)
    };
    for router in [first, second] {
        let mut connected = 0.0;
        for _ in 0..500 {
            connected = metric(router, "llmgw_peer_connected", &[]).await;
            if connected == 1.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            connected, 1.0,
            "router {} subscribed to its peer",
            router.admin
        );
    }
    // Some events exist (the index knows the engines), none of this prompt: it is asked of
    // the routers only, never sent to a replica.
    let warm = json!({"model": "tiny", "prompt": document(1), "max_tokens": 4});
    let (_, _) = via_envoy(&system, "/v1/completions", &warm).await;
    assert!(system::converged(&system, Duration::from_secs(10)).await);

    let body = json!({"model": "tiny", "prompt": document(2)});
    let applied = &[("kind", "pick"), ("outcome", "applied")];
    let heard_before = metric(second, "llmgw_peer_updates_total", applied).await;
    let placed = pick(first, "/v1/completions", &body).await;
    // Three updates: the pick's blocks (from `kv_cache`), its text's chain (from the
    // `prefix_tree` fallback, which records every pick), and the placement (from
    // `cache_footprint`: the prompt was found nowhere).
    let mut heard = heard_before;
    for _ in 0..500 {
        heard = metric(second, "llmgw_peer_updates_total", applied).await;
        if heard >= heard_before + 3.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        heard - heard_before,
        3.0,
        "the second router heard the first's pick"
    );
    let hits_before = metric(second, "llmgw_kv_decisions_total", &[("decision", "hit")]).await;
    let again = pick(second, "/v1/completions", &body).await;
    let primary = |d: &str| d.split(',').next().unwrap_or_default().to_owned();
    assert_eq!(primary(&again), primary(&placed));
    let hits = metric(second, "llmgw_kv_decisions_total", &[("decision", "hit")]).await;
    assert_eq!(
        hits - hits_before,
        1.0,
        "a hit on the peer's pick, not a miss"
    );
}
