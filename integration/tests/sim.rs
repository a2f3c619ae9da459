//! `llmgw-sim` end to end: the real binary on 127.0.0.1, spoken to over HTTP and ZMQ.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::collections::{BTreeSet, HashMap};
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use bytes::Bytes;
use llmgw::blockhash::{BlockHasher, HashSettings};
use llmgw_agent::wire::{self, KvEvent};
use llmgw_integration::{SimHandle, spawn_sim_with_env};
use serde_json::{Value, json};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const SEED: &str = "1729";

fn sim(args: &[&str]) -> SimHandle {
    sim_env(args, &[])
}

fn sim_env(args: &[&str], env: &[(&str, &str)]) -> SimHandle {
    let mut all = vec!["--served-model-name", "tiny", "--sim-no-latency"];
    all.extend_from_slice(args);
    let mut vars = vec![("PYTHONHASHSEED", SEED)];
    vars.extend_from_slice(env);
    spawn_sim_with_env(all, vars)
}

fn events_config(extra: &str) -> String {
    format!(
        r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:*",
            "topic":"kv"{extra}}}"#
    )
}

fn hasher(block_size: usize) -> BlockHasher {
    BlockHasher::new(&HashSettings::sha256_cbor(
        NonZeroUsize::new(block_size).unwrap(),
        Some(SEED),
    ))
    .unwrap()
}

struct Http {
    client: reqwest::Client,
    base: String,
}

impl Http {
    fn new(sim: &SimHandle) -> Self {
        Http {
            client: reqwest::Client::new(),
            base: sim.url(),
        }
    }

    async fn post_raw(&self, path: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
        let res = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        let text = res.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.post_raw(path, body.to_string()).await
    }

    async fn get_text(&self, path: &str) -> String {
        self.client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    async fn client_get_json(&self, path: &str) -> (u16, Value) {
        let res = self
            .client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        (status, res.json().await.unwrap_or(Value::Null))
    }

    async fn tokens(&self, body: Value) -> Vec<u32> {
        let (status, v) = self.post("/tokenize", body).await;
        assert_eq!(status, 200, "{v}");
        serde_json::from_value(v["tokens"].clone()).unwrap()
    }

    async fn debug_blocks(&self) -> BTreeSet<u64> {
        let v: Value = serde_json::from_str(&self.get_text("/debug/blocks").await).unwrap();
        serde_json::from_value(v["block_hashes"].clone()).unwrap()
    }
}

async fn subscribe(endpoint: &str) -> zeromq::SubSocket {
    let mut sub = zeromq::SubSocket::new();
    sub.connect(endpoint).await.unwrap();
    sub.subscribe("kv").await.unwrap();
    // Let the subscription reach the publisher (ZMQ's slow-joiner window).
    tokio::time::sleep(Duration::from_millis(300)).await;
    sub
}

struct Frames {
    topic: Bytes,
    seq: u64,
    payload: Bytes,
}

async fn next_frames(sub: &mut zeromq::SubSocket) -> Frames {
    let msg = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .expect("an event batch within 10 s")
        .unwrap();
    let f = msg.into_vec();
    assert_eq!(f.len(), 3, "topic, seq, payload");
    Frames {
        topic: f[0].clone(),
        seq: u64::from_be_bytes(f[1][..].try_into().expect("8-byte seq")),
        payload: f[2].clone(),
    }
}

fn filler(i: usize, words: usize) -> String {
    (0..words)
        .map(|w| format!("w{}x{}", i, w % 7))
        .collect::<Vec<_>>()
        .join(" ")
}

const PROMPT: &str = "You are a careful assistant for the Apache Software Foundation. Answer using \
    the license text. Licensed under the Apache License, Version 2.0 (the License); you may not \
    use this file except in compliance with the License. Question 0?";

#[tokio::test]
async fn events_store_exactly_the_blockhash_chain_of_the_tokenized_prompt() {
    let cfg = events_config("");
    let sim = sim(&["--block-size", "16", "--kv-events-config", &cfg]);
    let http = Http::new(&sim);
    let mut sub = subscribe(sim.events.as_deref().unwrap()).await;

    let tokens = http.tokens(json!({"prompt": PROMPT})).await;
    let expected: Vec<u64> = hasher(16)
        .prompt_blocks(&tokens, None)
        .map(|d| d.external().0)
        .collect();
    assert!(expected.len() >= 2, "{} tokens", tokens.len());
    let (status, v) = http
        .post(
            "/v1/completions",
            json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], tokens.len());

    let frames = next_frames(&mut sub).await;
    assert_eq!(&frames.topic[..], b"kv");
    assert_eq!(frames.seq, 0);
    let batch = wire::decode_batch(&frames.payload).unwrap();
    assert_eq!(batch.dp_rank, Some(0));
    let [KvEvent::BlockStored(stored)] = &batch.events[..] else {
        panic!("one BlockStored expected, got {:?}", batch.events);
    };
    let got: Vec<u64> = stored.block_hashes.iter().map(|h| h.0).collect();
    assert_eq!(got, expected);
    assert_eq!(stored.parent_block_hash, None);
    assert_eq!(stored.block_size, 16);
    assert_eq!(stored.token_ids, tokens[..expected.len() * 16]);
    assert_eq!(stored.group_idx, Some(0));
    assert_eq!(
        http.debug_blocks().await,
        expected.iter().copied().collect::<BTreeSet<_>>()
    );

    // The same prompt again: every block but the last is a hit, and nothing new is stored.
    let (_, v) = http
        .post(
            "/v1/completions",
            json!({"prompt": PROMPT, "max_tokens": 1}),
        )
        .await;
    let hit_blocks = (tokens.len() - 1) / 16;
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"],
        hit_blocks * 16
    );
}

#[tokio::test]
async fn salted_requests_hash_the_salt_into_block_zero_and_publish_it() {
    let cfg = events_config("");
    let sim = sim(&["--block-size", "16", "--kv-events-config", &cfg]);
    let http = Http::new(&sim);
    let mut sub = subscribe(sim.events.as_deref().unwrap()).await;
    let tokens = http.tokens(json!({"prompt": PROMPT})).await;
    let (status, _) = http
        .post(
            "/v1/completions",
            json!({"prompt": PROMPT, "max_tokens": 1, "cache_salt": "tenant-a"}),
        )
        .await;
    assert_eq!(status, 200);
    let batch = wire::decode_batch(&next_frames(&mut sub).await.payload).unwrap();
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("BlockStored expected");
    };
    let expected: Vec<u64> = hasher(16)
        .prompt_blocks(&tokens, Some("tenant-a"))
        .map(|d| d.external().0)
        .collect();
    let got: Vec<u64> = stored.block_hashes.iter().map(|h| h.0).collect();
    assert_eq!(got, expected);
    let keys = stored.extra_keys.as_ref().unwrap();
    assert_eq!(keys.len(), expected.len());
    assert!(
        format!("{:?}", keys[0]).contains("tenant-a"),
        "{:?}",
        keys[0]
    );
}

/// LoRA adapters as vLLM 0.32 serves them: listed by `/v1/models`, served under their names,
/// their blocks hashed with the adapter (name and path) so they never match the base model's,
/// and published with `lora_id`, `lora_name` and the name as every block's extra key.
#[tokio::test]
async fn lora_adapters_are_listed_served_and_hashed_apart_from_the_base_model() {
    use llmgw::blockhash::{LoraKey, RequestKeys};

    let cfg = events_config("");
    let sim = sim(&[
        "--block-size",
        "16",
        "--kv-events-config",
        &cfg,
        "--enable-lora",
        "--lora-modules",
        "a=/adapters/a",
        "b=/adapters/b",
    ]);
    let http = Http::new(&sim);

    let (status, models) = http.client_get_json("/v1/models").await;
    assert_eq!(status, 200);
    let cards: Vec<(&str, &Value, &Value)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["id"].as_str().unwrap(), &c["root"], &c["parent"]))
        .collect();
    assert_eq!(
        cards,
        vec![
            ("tiny", &json!("llmgw-sim/tiny"), &Value::Null),
            ("a", &json!("/adapters/a"), &json!("tiny")),
            ("b", &json!("/adapters/b"), &json!("tiny")),
        ]
    );

    let mut sub = subscribe(sim.events.as_deref().unwrap()).await;
    let tokens = http.tokens(json!({"model": "a", "prompt": PROMPT})).await;
    let lora = RequestKeys {
        lora: Some(LoraKey {
            name: "a",
            path: "/adapters/a",
        }),
        cache_salt: None,
    };
    let expected: Vec<u64> = hasher(16)
        .request_blocks(&tokens, lora)
        .map(|d| d.external().0)
        .collect();
    assert!(expected.len() >= 2, "{} tokens", tokens.len());
    let complete = |model: &str| {
        http.post(
            "/v1/completions",
            json!({"model": model, "prompt": PROMPT, "max_tokens": 1}),
        )
    };
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();

    let (status, v) = complete("a").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["model"], "a", "responses name the adapter");
    assert_eq!(cached(&v), Some(0));
    let batch = wire::decode_batch(&next_frames(&mut sub).await.payload).unwrap();
    let [KvEvent::BlockStored(stored)] = &batch.events[..] else {
        panic!("one BlockStored expected, got {:?}", batch.events);
    };
    let got: Vec<u64> = stored.block_hashes.iter().map(|h| h.0).collect();
    assert_eq!(got, expected, "request_blocks with LoraKey a");
    assert_eq!(stored.lora_id, Some(1));
    assert_eq!(stored.lora_name.as_deref(), Some("a"));
    let keys = stored.extra_keys.as_ref().unwrap();
    assert_eq!(keys.len(), expected.len());
    for key in keys {
        assert_eq!(
            key,
            &wire::Value::Array(vec![wire::Value::Str("a".into())]),
            "the adapter's name on every block"
        );
    }

    // Again on a: a prefix hit.
    let (_, v) = complete("a").await;
    assert_eq!(v["model"], "a");
    let hit_blocks = (tokens.len() as u64 - 1) / 16;
    assert_eq!(cached(&v), Some(hit_blocks * 16));

    // The base model and adapter b share none of a's blocks.
    for model in ["tiny", "b"] {
        let (status, v) = complete(model).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["model"], model);
        assert_eq!(cached(&v), Some(0), "{model} must not hit a's blocks");
    }
    let metrics = http.get_text("/metrics").await;
    let value = |name: &str| {
        llmgw_integration::prom::sum(&metrics, name, &[("model_name", "tiny")]).unwrap()
    };
    assert_eq!(
        value("vllm:prefix_cache_hits_total"),
        (hit_blocks * 16) as f64,
        "the only hits are a's second request"
    );
    // vllm:lora_requests_info: the series set last (largest value) names no adapter now that
    // every request has finished.
    let latest = llmgw_integration::prom::samples(&metrics)
        .filter(|s| s.name == "vllm:lora_requests_info")
        .max_by(|x, y| x.value.total_cmp(&y.value))
        .expect("vllm:lora_requests_info with --enable-lora");
    assert_eq!(latest.label("max_lora"), Some("1"));
    assert_eq!(latest.label("running_lora_adapters"), Some(""));
    assert_eq!(latest.label("waiting_lora_adapters"), Some(""));

    // An unknown model is still vLLM's 404.
    let (status, v) = complete("c").await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["message"], "The model `c` does not exist.");
}

#[tokio::test]
async fn array_events_with_raw_digest_hashes_decode_too() {
    let cfg = events_config("");
    let sim = sim_env(
        &[
            "--block-size",
            "32",
            "--sim-event-format",
            "array",
            "--kv-events-config",
            &cfg,
        ],
        &[("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")],
    );
    let http = Http::new(&sim);
    let mut sub = subscribe(sim.events.as_deref().unwrap()).await;
    let tokens = http.tokens(json!({"prompt": PROMPT})).await;
    http.post(
        "/v1/completions",
        json!({"prompt": PROMPT, "max_tokens": 1}),
    )
    .await;
    let payload = next_frames(&mut sub).await.payload;
    // Positional tagged arrays with 32-byte bin hashes (vLLM ≤ 0.23, USE_INT_BLOCK_HASHES=0).
    let raw = rmpv::decode::read_value(&mut &payload[..]).unwrap();
    let event = &raw[1][0];
    assert_eq!(event[0].as_str(), Some("BlockStored"));
    assert_eq!(event.as_array().unwrap().len(), 12);
    let digests: Vec<_> = hasher(32).prompt_blocks(&tokens, None).collect();
    assert_eq!(event[1][0].as_slice(), Some(digests[0].as_bytes()));
    let batch = wire::decode_batch(&payload).unwrap();
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("BlockStored expected");
    };
    let got: Vec<u64> = stored.block_hashes.iter().map(|h| h.0).collect();
    let expected: Vec<u64> = digests.iter().map(|d| d.external().0).collect();
    assert_eq!(got, expected);
}

/// An index built from the event stream alone converges to the engine's cache, through
/// prompt stores, generated-block stores, LRU evictions and a reset.
#[tokio::test]
async fn an_index_fed_by_events_converges_to_debug_blocks() {
    let cfg = events_config("");
    let sim = sim(&[
        "--block-size",
        "16",
        "--num-gpu-blocks-override",
        "24",
        "--max-model-len",
        "256",
        "--kv-events-config",
        &cfg,
    ]);
    let http = Http::new(&sim);
    let mut sub = subscribe(sim.events.as_deref().unwrap()).await;
    let mut index: HashMap<u64, usize> = HashMap::new();
    let mut next_seq = 0;
    let mut removed = 0;
    for round in 0..3 {
        for i in 0..6 {
            let prompt = filler(i, 25 + 3 * i);
            let (status, v) = http
                .post(
                    "/v1/completions",
                    json!({"prompt": prompt, "max_tokens": 20 + round}),
                )
                .await;
            assert_eq!(status, 200, "{v}");
        }
        if round == 1 {
            let (status, _) = http.post("/reset_prefix_cache", json!({})).await;
            assert_eq!(status, 200);
        }
    }
    let truth = http.debug_blocks().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let have: BTreeSet<u64> = index.keys().copied().collect();
        // Converged once the index equals the cache and no further batch is in flight.
        let wait = if have == truth {
            Duration::from_millis(300)
        } else {
            deadline.saturating_duration_since(Instant::now())
        };
        let msg = match tokio::time::timeout(wait, sub.recv()).await {
            Ok(msg) => msg.unwrap().into_vec(),
            Err(_) if have == truth => break,
            Err(_) => panic!("index {have:?} != cache {truth:?}"),
        };
        let seq = u64::from_be_bytes(msg[1][..].try_into().unwrap());
        assert_eq!(seq, next_seq, "no gaps");
        next_seq += 1;
        for event in wire::decode_batch(&msg[2]).unwrap().events {
            match event {
                KvEvent::BlockStored(s) => {
                    for h in s.block_hashes {
                        *index.entry(h.0).or_default() += 1;
                    }
                }
                KvEvent::BlockRemoved(r) => {
                    for h in r.block_hashes {
                        removed += 1;
                        let n = index.get_mut(&h.0).expect("removal of a stored hash");
                        *n -= 1;
                        if *n == 0 {
                            index.remove(&h.0);
                        }
                    }
                }
                KvEvent::AllBlocksCleared(_) => index.clear(),
                KvEvent::Unknown { kind } => panic!("unknown event {kind}"),
            }
        }
    }
    assert!(removed > 0, "the small cache evicted");
    assert!(!truth.is_empty());
}

/// An endpoint without `*` makes the simulator connect, as vLLM does (llm-d's centralized
/// mode, where the indexer binds the SUB socket).
#[tokio::test]
async fn a_plain_endpoint_connects_to_a_bound_subscriber() {
    let mut sub = zeromq::SubSocket::new();
    let bound = sub.bind("tcp://127.0.0.1:0").await.unwrap();
    sub.subscribe("").await.unwrap();
    let cfg =
        format!(r#"{{"enable_kv_cache_events":true,"endpoint":"{bound}","topic":"kv@pod@tiny"}}"#);
    let sim = sim(&["--block-size", "16", "--kv-events-config", &cfg]);
    assert_eq!(sim.events, None, "a connecting publisher binds nothing");
    let http = Http::new(&sim);
    // Let the connection and the subscription settle.
    tokio::time::sleep(Duration::from_millis(500)).await;
    http.post(
        "/v1/completions",
        json!({"prompt": PROMPT, "max_tokens": 1}),
    )
    .await;
    let msg = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .expect("a batch within 10 s")
        .unwrap()
        .into_vec();
    assert_eq!(&msg[0][..], b"kv@pod@tiny");
    assert_eq!(msg[1][..], 0u64.to_be_bytes());
    assert!(matches!(
        wire::decode_batch(&msg[2]).unwrap().events[0],
        KvEvent::BlockStored(_)
    ));
}

#[tokio::test]
async fn replay_returns_the_buffer_then_the_end_marker() {
    let cfg = events_config(r#","replay_endpoint":"tcp://127.0.0.1:*","buffer_steps":3"#);
    let sim = sim(&["--block-size", "16", "--kv-events-config", &cfg]);
    let http = Http::new(&sim);
    for i in 0..5 {
        // One step with events per request: a fresh prompt, one token.
        http.post(
            "/v1/completions",
            json!({"prompt": filler(i, 40), "max_tokens": 1}),
        )
        .await;
    }
    let mut dealer = zeromq::DealerSocket::new();
    dealer
        .connect(sim.replay.as_deref().unwrap())
        .await
        .unwrap();
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&0u64.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(request).await.unwrap();
    let mut seqs = Vec::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), dealer.recv())
            .await
            .expect("replay reply")
            .unwrap()
            .into_vec();
        // DEALER sees ["", topic, seq, payload] (vLLM ≥ 0.26).
        assert_eq!(msg.len(), 4, "{msg:?}");
        assert!(msg[0].is_empty());
        if msg[2][..] == [0xff; 8] {
            assert!(msg[1].is_empty() && msg[3].is_empty(), "end marker");
            break;
        }
        assert_eq!(&msg[1][..], b"kv");
        wire::decode_batch(&msg[3]).unwrap();
        seqs.push(u64::from_be_bytes(msg[2][..].try_into().unwrap()));
    }
    assert_eq!(seqs, vec![2, 3, 4], "buffer_steps=3 keeps the last three");
}

#[tokio::test]
async fn dropped_seqs_leave_a_gap_that_replay_fills_and_restart_resets_seq() {
    let cfg = events_config(r#","replay_endpoint":"tcp://127.0.0.1:*""#);
    let sim = sim(&[
        "--block-size",
        "16",
        "--kv-events-config",
        &cfg,
        "--sim-drop-seqs",
        "1",
    ]);
    let http = Http::new(&sim);
    let mut sub = subscribe(sim.events.as_deref().unwrap()).await;
    for i in 0..3 {
        http.post(
            "/v1/completions",
            json!({"prompt": filler(i, 40), "max_tokens": 1}),
        )
        .await;
    }
    assert_eq!(next_frames(&mut sub).await.seq, 0);
    assert_eq!(
        next_frames(&mut sub).await.seq,
        2,
        "seq 1 was dropped on the wire"
    );
    let mut dealer = zeromq::DealerSocket::new();
    dealer
        .connect(sim.replay.as_deref().unwrap())
        .await
        .unwrap();
    dealer
        .send(
            ZmqMessage::try_from(vec![
                Bytes::new(),
                Bytes::copy_from_slice(&1u64.to_be_bytes()),
            ])
            .unwrap(),
        )
        .await
        .unwrap();
    let first = dealer.recv().await.unwrap().into_vec();
    assert_eq!(u64::from_be_bytes(first[2][..].try_into().unwrap()), 1);

    // Admin faults: drop by endpoint, then restart.
    let (status, _) = http
        .post("/sim/drop_seqs", json!({"from": 3, "to": 3}))
        .await;
    assert_eq!(status, 200);
    http.post(
        "/v1/completions",
        json!({"prompt": filler(7, 40), "max_tokens": 1}),
    )
    .await;
    http.post(
        "/v1/completions",
        json!({"prompt": filler(8, 40), "max_tokens": 1}),
    )
    .await;
    assert_eq!(next_frames(&mut sub).await.seq, 4);
    let (status, _) = http.post("/sim/restart", json!({})).await;
    assert_eq!(status, 200);
    assert!(
        http.debug_blocks().await.is_empty(),
        "a restarted engine has an empty cache"
    );
    http.post(
        "/v1/completions",
        json!({"prompt": filler(9, 40), "max_tokens": 1}),
    )
    .await;
    assert_eq!(next_frames(&mut sub).await.seq, 0, "seq restarts at 0");
}

#[tokio::test]
async fn completions_stream_and_report_cached_tokens_and_the_replica() {
    let sim = sim(&["--sim-replica", "replica-a"]);
    let http = Http::new(&sim);
    let res = http
        .client
        .post(format!("{}/v1/completions", http.base))
        .json(&json!({"prompt": PROMPT, "max_tokens": 5}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.headers()["x-llmgw-sim-replica"], "replica-a");
    let v: Value = res.json().await.unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let text = v["choices"][0]["text"].as_str().unwrap().to_owned();

    let res = http
        .client
        .post(format!("{}/v1/completions", http.base))
        .json(&json!({"prompt": PROMPT, "max_tokens": 5, "stream": true,
                      "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert!(
        res.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let body = res.text().await.unwrap();
    let frames: Vec<&str> = body
        .split("\n\n")
        .filter(|f| !f.is_empty())
        .map(|f| f.strip_prefix("data: ").expect("SSE data frame"))
        .collect();
    assert_eq!(frames.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = frames[..frames.len() - 1]
        .iter()
        .map(|f| serde_json::from_str(f).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"]
                .get(0)
                .map(|ch| ch["text"].as_str().unwrap().to_owned())
        })
        .collect();
    assert_eq!(streamed, text, "same prompt, same answer, streamed or not");
    let usage = &chunks.last().unwrap()["usage"];
    assert!(
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );
}

#[tokio::test]
async fn chat_tokenize_agrees_with_usage_and_turns_share_cached_prefixes() {
    let sim = sim(&["--block-size", "16"]);
    let http = Http::new(&sim);
    let turn1 = json!([
        {"role": "system", "content": PROMPT},
        {"role": "user", "content": "What does section 4 say about redistribution?"},
    ]);
    let tokens = http.tokens(json!({"messages": turn1})).await;
    let (status, v) = http
        .post(
            "/v1/chat/completions",
            json!({"messages": turn1, "max_tokens": 8}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["usage"]["prompt_tokens"], tokens.len());
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    let mut turn2 = turn1.as_array().unwrap().clone();
    turn2.push(json!({"role": "assistant", "content": answer}));
    turn2.push(json!({"role": "user", "content": "And section 5?"}));
    let (_, v2) = http
        .post(
            "/v1/chat/completions",
            json!({"messages": turn2, "max_tokens": 8}),
        )
        .await;
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= (tokens.len() as u64 / 16 - 1) * 16,
        "cached {cached} of {}",
        tokens.len()
    );

    // /tokenize options: token strings, no generation prompt, and the forbidden combination.
    let (_, t) = http
        .post(
            "/tokenize",
            json!({"messages": turn1, "add_generation_prompt": false,
                                  "return_token_strs": true}),
        )
        .await;
    assert_eq!(
        t["count"].as_u64().unwrap() as usize,
        t["tokens"].as_array().unwrap().len()
    );
    assert!(t["count"].as_u64().unwrap() < tokens.len() as u64);
    assert_eq!(t["token_strs"][0], "<|bos|>");
    assert!(t["max_model_len"].as_u64().unwrap() > 0);
    let (status, e) = http
        .post(
            "/tokenize",
            json!({"messages": turn1, "add_generation_prompt": true,
                                  "continue_final_message": true}),
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(e["error"]["type"], "BadRequestError");
    let plain = http
        .tokens(json!({"prompt": "Licensed under the License", "add_special_tokens": false}))
        .await;
    let (_, d) = http.post("/detokenize", json!({"tokens": plain})).await;
    assert_eq!(d["prompt"], "Licensed under the License");
}

#[tokio::test]
async fn messages_speak_anthropic_and_share_cached_prefixes() {
    let sim = sim(&["--block-size", "16"]);
    let http = Http::new(&sim);
    let (_, models) = http.client_get_json("/v1/models").await;
    let model = models["data"][0]["id"]
        .as_str()
        .expect("a model")
        .to_owned();
    // The conversation vLLM renders for this request: system first, then the user's turn.
    let chat = json!([
        {"role": "system", "content": PROMPT},
        {"role": "user", "content": "What does section 4 say?"},
    ]);
    let tokens = http.tokens(json!({"messages": chat})).await;
    let turn1 = json!({"model": model, "max_tokens": 8, "system": [{"type": "text", "text": PROMPT}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What does section 4 say?"}]}]});
    let (status, v) = http.post("/v1/messages", turn1.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["type"].as_str(), v["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    assert_eq!(v["usage"]["input_tokens"], tokens.len(), "{v}");
    assert_eq!(v["stop_reason"], "max_tokens");
    let answer = v["content"][0]["text"].as_str().expect("text").to_owned();

    // The next turn reads the first from the cache.
    let mut turn2 = turn1.clone();
    let messages = turn2["messages"].as_array_mut().expect("messages");
    messages.push(json!({"role": "assistant", "content": [{"type": "text", "text": answer}]}));
    messages.push(json!({"role": "user", "content": "And section 5?"}));
    turn2["stream"] = json!(true);
    let text = http
        .client
        .post(format!("{}/v1/messages", http.base))
        .json(&turn2)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(events.first(), Some(&"message_start"), "{text}");
    assert_eq!(events.last(), Some(&"message_stop"), "{text}");
    assert!(events.contains(&"content_block_delta"), "{text}");
    let delta: Value = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|d| d["type"] == "message_delta")
        .expect("a message_delta");
    let cached = delta["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!(
        cached >= (tokens.len() as u64 / 16 - 1) * 16,
        "cached {cached}: {delta}"
    );

    // Errors in Anthropic's shape.
    for (body, status, kind) in [
        (
            json!({"model": model, "messages": [{"role": "robot", "content": "x"}]}),
            400,
            "invalid_request_error",
        ),
        (
            json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "not_found_error",
        ),
    ] {
        let (got, e) = http.post("/v1/messages", body).await;
        assert_eq!(got, status, "{e}");
        assert_eq!(
            (e["type"].as_str(), e["error"]["type"].as_str()),
            (Some("error"), Some(kind)),
            "{e}"
        );
    }
}

#[tokio::test]
async fn responses_speak_the_responses_api_and_share_cached_prefixes() {
    let sim = sim(&["--block-size", "16"]);
    let http = Http::new(&sim);
    let (_, models) = http.client_get_json("/v1/models").await;
    let model = models["data"][0]["id"]
        .as_str()
        .expect("a model")
        .to_owned();
    // The conversation vLLM renders for this request: instructions first, then the user's turn,
    // tokenized with special tokens on top (vLLM's /v1/responses adds them: a second BOS here).
    let chat = json!([
        {"role": "system", "content": PROMPT},
        {"role": "user", "content": "What does section 4 say?"},
    ]);
    let tokens = http
        .tokens(json!({"messages": chat, "add_special_tokens": true}))
        .await;
    let plain = http.tokens(json!({"messages": chat})).await;
    assert_eq!(tokens[0], 1, "the tokenizer's BOS");
    assert_eq!(&tokens[1..], &plain[..], "on top of the template's own");
    let turn1 = json!({"model": model, "max_output_tokens": 8, "instructions": PROMPT,
        "input": [{"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "What does section 4 say?"}]}]});
    let (status, v) = http.post("/v1/responses", turn1.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "response", "{v}");
    assert_eq!(v["status"], "incomplete", "{v}");
    assert_eq!(
        v["incomplete_details"]["reason"], "max_output_tokens",
        "{v}"
    );
    assert_eq!(v["usage"]["input_tokens"], tokens.len(), "{v}");
    assert_eq!(v["usage"]["output_tokens"], 8, "{v}");
    let message = &v["output"][0];
    assert_eq!(
        (message["type"].as_str(), message["role"].as_str()),
        (Some("message"), Some("assistant")),
        "{v}"
    );
    let answer = message["content"][0]["text"]
        .as_str()
        .expect("text")
        .to_owned();

    // The next turn, streamed, reads the first from the cache.
    let mut turn2 = turn1.clone();
    let input = turn2["input"].as_array_mut().expect("input");
    input.push(
        json!({"type": "message", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": answer, "annotations": []}]}),
    );
    input.push(json!({"role": "user", "content": "And section 5?"}));
    turn2["stream"] = json!(true);
    let text = http
        .client
        .post(format!("{}/v1/responses", http.base))
        .json(&turn2)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(events.first(), Some(&"response.created"), "{text}");
    assert_eq!(events.last(), Some(&"response.completed"), "{text}");
    assert!(events.contains(&"response.output_text.delta"), "{text}");
    let data: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .collect();
    let numbers: Vec<u64> = data
        .iter()
        .filter_map(|d| d["sequence_number"].as_u64())
        .collect();
    assert_eq!(
        numbers,
        (0..data.len() as u64).collect::<Vec<_>>(),
        "{text}"
    );
    let deltas: String = data
        .iter()
        .filter(|d| d["type"] == "response.output_text.delta")
        .filter_map(|d| d["delta"].as_str())
        .collect();
    let completed = &data.last().expect("events")["response"];
    assert_eq!(
        completed["output"][0]["content"][0]["text"], deltas,
        "{text}"
    );
    let cached = completed["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= (tokens.len() as u64 / 16 - 1) * 16,
        "cached {cached}: {completed}"
    );

    // Errors in OpenAI's shape.
    for (body, status) in [
        (
            json!({"model": model, "input": [{"role": "robot", "content": "x"}]}),
            400,
        ),
        (json!({"model": model}), 400),
        (json!({"model": "nope", "input": "x"}), 404),
        (
            json!({"model": model, "input": "x", "previous_response_id": "resp_1"}),
            404,
        ),
    ] {
        let (got, e) = http.post("/v1/responses", body).await;
        assert_eq!(got, status, "{e}");
        assert!(e["error"]["message"].as_str().is_some(), "{e}");
    }
}

#[tokio::test]
async fn bad_input_gets_vllm_statuses_and_error_bodies() {
    let sim = sim(&["--max-model-len", "64"]);
    let http = Http::new(&sim);
    let long = "word ".repeat(200);
    let cases: Vec<(&str, String, u16)> = vec![
        ("/v1/completions", "{\"prompt\": ".into(), 400),
        ("/v1/completions", "[1, 2]".into(), 400),
        ("/v1/completions", json!({"max_tokens": 3}).to_string(), 400),
        (
            "/v1/completions",
            json!({"model": "nope", "prompt": "hi"}).to_string(),
            404,
        ),
        ("/v1/completions", json!({"prompt": long}).to_string(), 400),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 0}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 1000}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": {"a": 1}}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, -5]}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "cache_salt": ""}).to_string(),
            400,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}).to_string(),
            400,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"content": "x"}]}).to_string(),
            400,
        ),
        (
            "/v1/chat/completions",
            json!({"model": "nope", "messages": []}).to_string(),
            404,
        ),
        (
            "/tokenize",
            json!({"model": "nope", "prompt": "hi"}).to_string(),
            404,
        ),
        ("/tokenize", json!({"nothing": true}).to_string(), 400),
        ("/detokenize", json!({"tokens": [-1]}).to_string(), 400),
        (
            "/detokenize",
            json!({"tokens": [99999999]}).to_string(),
            400,
        ),
        ("/sim/stall", "{}".into(), 400),
        ("/sim/stall", json!({"ms": u64::MAX}).to_string(), 400),
        ("/sim/stall", json!({"ms": 60_001}).to_string(), 400),
    ];
    for (path, body, want) in cases {
        let (status, v) = http.post_raw(path, body.clone()).await;
        assert_eq!(status, want, "{path} {body}: {v}");
        let err = &v["error"];
        assert_eq!(err["code"], want, "{path} {body}: {v}");
        assert!(err["message"].is_string() && err["type"].is_string(), "{v}");
        assert!(err.get("param").is_some(), "{v}");
    }
    let (_, v) = http
        .post("/v1/completions", json!({"model": "nope", "prompt": "hi"}))
        .await;
    assert_eq!(v["error"]["type"], "NotFoundError");
    assert_eq!(v["error"]["message"], "The model `nope` does not exist.");
    // Still serving.
    let (status, _) = http
        .post("/v1/completions", json!({"prompt": "hi", "max_tokens": 2}))
        .await;
    assert_eq!(status, 200);
    let res = http
        .client
        .get(format!("{}/health", http.base))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let res = http
        .client
        .get(format!("{}/nope", http.base))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 404);
}

#[tokio::test]
async fn models_and_metrics_speak_vllm() {
    let sim = sim(&[
        "--block-size",
        "16",
        "--num-gpu-blocks-override",
        "128",
        "--max-model-len",
        "1024",
    ]);
    let http = Http::new(&sim);
    let models: Value = serde_json::from_str(&http.get_text("/v1/models").await).unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["owned_by"], "vllm");
    for _ in 0..2 {
        http.post(
            "/v1/completions",
            json!({"prompt": PROMPT, "max_tokens": 2}),
        )
        .await;
    }
    let text = http.get_text("/metrics").await;
    let value = |name: &str| -> f64 {
        let prefix = format!("{name}{{model_name=\"tiny\",engine=\"0\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
            .parse()
            .unwrap()
    };
    assert_eq!(value("vllm:num_requests_running"), 0.0);
    assert_eq!(value("vllm:num_requests_waiting"), 0.0);
    assert!(value("vllm:prefix_cache_queries_total") > value("vllm:prefix_cache_hits_total"));
    assert!(value("vllm:prefix_cache_hits_total") > 0.0);
    assert!((0.0..=1.0).contains(&value("vllm:kv_cache_usage_perc")));
    assert!(text.contains("vllm:cache_config_info{block_size=\"16\""));
    assert!(text.contains("num_gpu_blocks=\"128\""));
}

/// The latency model end to end: a cached prefix must visibly cut time to first token. Wide
/// margins (hundreds of ms of prefill against one decode step) keep this robust on a busy
/// machine; exact timings are checked with paused time in the engine's unit tests.
#[tokio::test]
async fn a_cached_prefix_cuts_time_to_first_token() {
    let sim = spawn_sim_with_env(
        [
            "--block-size",
            "16",
            "--sim-prefill-us-per-token",
            "2000",
            "--sim-decode-us-per-token",
            "1000",
        ],
        [("PYTHONHASHSEED", SEED)],
    );
    let http = Http::new(&sim);
    let prompt = filler(1, 200);
    let timed = |http: &Http, prompt: String| {
        let req = http
            .client
            .post(format!("{}/v1/completions", http.base))
            .json(&json!({"prompt": prompt, "max_tokens": 1}));
        async move {
            let start = Instant::now();
            let v: Value = req.send().await.unwrap().json().await.unwrap();
            (start.elapsed(), v)
        }
    };
    let (cold, v) = timed(&http, prompt.clone()).await;
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 200, "{prompt_tokens}");
    let (warm, v) = timed(&http, prompt).await;
    assert!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(cold >= Duration::from_millis(400), "cold {cold:?}");
    assert!(warm * 3 < cold, "warm {warm:?} vs cold {cold:?}");
}

/// The router's in-process tokenizer, given the simulator's tokenizer.json and chat template,
/// agrees with the simulator's own `/tokenize` on completions and varied chats: the router checks
/// its first answers against the replica, and none disagrees.
#[tokio::test]
async fn the_routers_local_tokenizer_agrees_with_the_sims_tokenize() {
    use llmgw::openai::{EndpointKind, parse_request};
    use llmgw::tokenize::{LocalTokenizer, Tokenizer, TokenizerConfig};
    use std::sync::atomic::Ordering;

    let s = sim(&[]);
    let assets = llmgw_integration::repo_root().join("sim/assets");
    let local = LocalTokenizer::load(
        &assets.join("tokenizer.json"),
        Some(&assets.join("chat_template.jinja")),
    )
    .expect("loads");
    let t = Tokenizer::new(TokenizerConfig::default()).with_local("tiny", local);
    let replica = s.addr.to_string();
    let bodies = [
        (
            EndpointKind::Completions,
            json!({"model": "tiny", "prompt": "Licensed under the Apache License, Version 2.0"}),
        ),
        (
            EndpointKind::Completions,
            json!({"model": "tiny", "prompt": "  leading spaces\nand lines\t"}),
        ),
        (
            EndpointKind::ChatCompletions,
            json!({"model": "tiny", "messages": [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": "What does the license grant?"}]}),
        ),
        (
            EndpointKind::ChatCompletions,
            json!({"model": "tiny", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
            {"role": "assistant", "content": null},
            {"role": "user", "content": "ünïcödé and emoji 🦀"}]}),
        ),
        (
            EndpointKind::ChatCompletions,
            json!({"model": "tiny", "add_generation_prompt": false, "messages": [
            {"role": "user", "content": "no generation prompt"}]}),
        ),
        (
            EndpointKind::ChatCompletions,
            json!({"model": "tiny", "add_generation_prompt": false,
            "continue_final_message": true, "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "The answer is"}]}),
        ),
    ];
    for (kind, body) in &bodies {
        let request = parse_request(*kind, body.to_string().as_bytes()).expect("parses");
        t.tokens(&request, &[&replica]).await.expect("tokens");
    }
    let stats = t.stats();
    let n = bodies.len() as u64;
    assert_eq!(
        stats.local.load(Ordering::Relaxed),
        n,
        "all answered in process"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while stats.local_checks.load(Ordering::Relaxed) < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        stats.local_checks.load(Ordering::Relaxed),
        n,
        "each checked with the sim"
    );
    assert_eq!(stats.local_mismatches.load(Ordering::Relaxed), 0);
    assert!(t.tokenizes_chat_locally("tiny"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_can_be_made_slow_at_run_time_within_a_bound() {
    let sim = llmgw_integration::spawn_sim(["--served-model-name", "tiny"]);
    let client = reqwest::Client::new();
    let tokenize = || async {
        let started = std::time::Instant::now();
        let response = client
            .post(format!("{}/tokenize", sim.url()))
            .json(&serde_json::json!({"model": "tiny", "prompt": "hello there"}))
            .send()
            .await
            .expect("tokenize");
        assert_eq!(response.status().as_u16(), 200);
        started.elapsed()
    };
    let set = |ms: u64| {
        let client = client.clone();
        let url = format!("{}/sim/tokenize_delay", sim.url());
        async move {
            client
                .post(url)
                .json(&serde_json::json!({ "ms": ms }))
                .send()
                .await
                .expect("set delay")
                .status()
                .as_u16()
        }
    };
    assert_eq!(set(2000).await, 200);
    assert!(tokenize().await >= std::time::Duration::from_millis(2000));
    // Back to none: far below the delay even on a loaded machine.
    assert_eq!(set(0).await, 200);
    assert!(tokenize().await < std::time::Duration::from_millis(2000));
    assert_eq!(set(10_000_000).await, 400, "an absurd delay is refused");
}

/// The workload's failover (the bench's `pinned_failover`): conversations whose replica is
/// down go on at the next one, where without failover they end with an error.
#[tokio::test]
async fn bypassing_conversations_fail_over_to_the_next_replica_while_theirs_is_down() {
    use llmgw_integration::workload::{Results, WorkloadConfig, run_open_loop};
    use parking_lot::Mutex;
    use std::sync::Arc;

    let live = sim(&[]);
    // A port nothing listens on: bound, then closed.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let run = |failover: bool| {
        let config = WorkloadConfig {
            tenants: 1,
            turns_per_conversation: 2,
            duration: Duration::from_millis(800),
            bypass_every: 1,
            bypass: vec![format!("http://{dead}"), format!("http://{}", live.addr)],
            bypass_failover: failover,
            ..WorkloadConfig::default()
        };
        let results = Arc::new(Mutex::new(Results::default()));
        let done = run_open_loop(
            "http://127.0.0.1:9".to_owned(),
            config,
            20.0,
            7,
            Duration::from_secs(10),
            Arc::clone(&results),
        );
        async move {
            done.await;
            Arc::try_unwrap(results).unwrap().into_inner()
        }
    };

    let failed_over = run(true).await;
    assert!(failed_over.errors.is_empty(), "{:?}", failed_over.errors);
    assert!(!failed_over.samples.is_empty());
    assert!(
        failed_over
            .samples
            .iter()
            .all(|s| s.status == 200 && s.bypassed),
        "{:?}",
        failed_over.samples
    );

    let without = run(false).await;
    assert!(without.samples.is_empty(), "{:?}", without.samples);
    assert!(
        without
            .errors
            .iter()
            .all(|e| e.starts_with("request failed")),
        "{:?}",
        without.errors
    );
    assert!(!without.errors.is_empty());
}
