use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use serde_json::{Value, json};

use super::*;
use crate::openai::{EndpointKind, parse_request};

/// A stand-in `/tokenize` that records the bodies it got and answers after `delay`.
#[derive(Clone, Default)]
struct Fake {
    calls: Arc<AtomicUsize>,
    bodies: Arc<parking_lot::Mutex<Vec<Value>>>,
    delay: Duration,
    status: Option<StatusCode>,
    /// Fixed token ids to answer with, instead of the made-up ones below.
    answer: Option<Vec<u32>>,
}

async fn tokenize(State(fake): State<Fake>, Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    fake.calls.fetch_add(1, Ordering::SeqCst);
    fake.bodies.lock().push(body.clone());
    tokio::time::sleep(fake.delay).await;
    if let Some(status) = fake.status {
        return (status, Json(json!({"error": {"message": "nope"}})));
    }
    if let Some(tokens) = &fake.answer {
        return (StatusCode::OK, Json(json!({"tokens": tokens})));
    }
    // Token ids: the byte length of the prompt or of the messages' JSON, then 1 2 3.
    let n = body["prompt"]
        .as_str()
        .map(str::len)
        .unwrap_or_else(|| body["messages"].to_string().len());
    (
        StatusCode::OK,
        Json(
            json!({"count": 4, "max_model_len": 2048, "tokens": [n, 1, 2, 3], "token_strs": null}),
        ),
    )
}

async fn serve(fake: Fake) -> SocketAddr {
    let app = axum::Router::new()
        .route("/tokenize", post(tokenize))
        .with_state(fake);
    crate::testing::serve_on_loopback(app).await
}

fn completion(prompt: &str) -> ParsedRequest {
    let body = json!({"model": "m", "prompt": prompt}).to_string();
    parse_request(EndpointKind::Completions, body.as_bytes()).expect("parses")
}

fn tokenizer(deadline_ms: u64) -> Tokenizer {
    Tokenizer::new(TokenizerConfig {
        deadline: Duration::from_millis(deadline_ms),
        ..TokenizerConfig::default()
    })
}

#[tokio::test]
async fn completion_prompt_is_tokenized_once_then_cached() {
    let fake = Fake::default();
    let addr = serve(fake.clone()).await.to_string();
    let t = tokenizer(2000);
    let first = t
        .tokens(&completion("hello"), &[&addr])
        .await
        .expect("tokens");
    assert_eq!(&first[..], &[5, 1, 2, 3]);
    let second = t
        .tokens(&completion("hello"), &[&addr])
        .await
        .expect("tokens");
    assert_eq!(first, second);
    assert_eq!(fake.calls.load(Ordering::SeqCst), 1);
    assert_eq!(t.stats().cache_hits.load(Ordering::Relaxed), 1);
    assert_eq!(t.stats().cache_misses.load(Ordering::Relaxed), 1);
    assert_eq!(
        fake.bodies.lock()[0],
        json!({"model": "m", "prompt": "hello"})
    );
}

#[tokio::test]
async fn chat_forwards_messages_tools_and_flags() {
    let fake = Fake::default();
    let addr = serve(fake.clone()).await.to_string();
    let body = json!({
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": false},
    })
    .to_string();
    let request = parse_request(EndpointKind::ChatCompletions, body.as_bytes()).expect("parses");
    tokenizer(2000)
        .tokens(&request, &[&addr])
        .await
        .expect("tokens");
    assert_eq!(
        fake.bodies.lock()[0],
        json!({
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "chat_template_kwargs": {"enable_thinking": false},
            "add_generation_prompt": true,
            "continue_final_message": false,
        })
    );
    // A Responses request is tokenized with special tokens on top, as vLLM does.
    let body = json!({"model": "m", "input": "hi"}).to_string();
    let request = parse_request(EndpointKind::Responses, body.as_bytes()).expect("parses");
    tokenizer(2000)
        .tokens(&request, &[&addr])
        .await
        .expect("tokens");
    assert_eq!(
        fake.bodies.lock()[1],
        json!({
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "add_generation_prompt": true,
            "continue_final_message": false,
            "add_special_tokens": true,
        })
    );
}

#[tokio::test]
async fn token_array_prompts_need_no_call() {
    let body = json!({"model": "m", "prompt": [7, 8, 9]}).to_string();
    let request = parse_request(EndpointKind::Completions, body.as_bytes()).expect("parses");
    let tokens = tokenizer(10).tokens(&request, &[]).await.expect("tokens");
    assert_eq!(&tokens[..], &[7, 8, 9]);
}

#[tokio::test]
async fn an_unreachable_replica_is_skipped() {
    let fake = Fake::default();
    let addr = serve(fake.clone()).await.to_string();
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").to_string()
    };
    let tokens = tokenizer(5000)
        .tokens(&completion("abc"), &[&dead, &addr])
        .await
        .expect("tokens");
    assert_eq!(&tokens[..], &[3, 1, 2, 3]);
}

#[tokio::test]
async fn an_error_status_is_an_error_not_tokens() {
    let fake = Fake {
        status: Some(StatusCode::NOT_FOUND),
        ..Fake::default()
    };
    let addr = serve(fake).await.to_string();
    let err = tokenizer(2000)
        .tokens(&completion("x"), &[&addr])
        .await
        .unwrap_err();
    assert_eq!(err.reason(), "tokenize_error");
    assert!(err.to_string().contains("404"), "{err}");
}

#[tokio::test]
async fn past_the_deadline_it_falls_back_and_the_late_answer_fills_the_cache() {
    let fake = Fake {
        delay: Duration::from_millis(300),
        ..Fake::default()
    };
    let addr = serve(fake.clone()).await.to_string();
    let t = tokenizer(20);
    let err = t.tokens(&completion("slow"), &[&addr]).await.unwrap_err();
    assert_eq!(err, TokenizeError::Timeout(Duration::from_millis(20)));
    // Wait (bounded) for the background call to land in the cache.
    for _ in 0..100 {
        if t.cache_bytes() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let tokens = t
        .tokens(&completion("slow"), &[&addr])
        .await
        .expect("cached now");
    assert_eq!(&tokens[..], &[4, 1, 2, 3]);
    assert_eq!(fake.calls.load(Ordering::SeqCst), 1);
    assert_eq!(t.stats().timeouts.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn concurrent_misses_for_one_body_share_one_call_and_a_failed_call_is_not_kept() {
    let fake = Fake {
        delay: Duration::from_millis(300),
        ..Fake::default()
    };
    let addr = serve(fake.clone()).await.to_string();
    let replicas = [addr.as_str()];
    let t = tokenizer(5_000);
    let same = completion("hello there");
    let other = completion("something else");
    let (answers, alone) = tokio::join!(
        futures::future::join_all((0..5).map(|_| t.tokens(&same, &replicas))),
        t.tokens(&other, &replicas),
    );
    for answer in answers {
        assert_eq!(&*answer.expect("tokens"), &[11, 1, 2, 3]);
    }
    assert_eq!(&*alone.expect("tokens"), &[14, 1, 2, 3]);
    assert_eq!(fake.calls.load(Ordering::SeqCst), 2, "one call per body");
    assert_eq!(t.stats().joined.load(Ordering::Relaxed), 4);
    assert!(t.calls.lock().is_empty(), "answered calls are not kept");

    // A failed call answers everyone who waited with its error, and the next miss calls again.
    let failing = Fake {
        delay: Duration::from_millis(300),
        status: Some(StatusCode::INTERNAL_SERVER_ERROR),
        ..Fake::default()
    };
    let addr = serve(failing.clone()).await.to_string();
    let replicas = [addr.as_str()];
    let request = completion("never answered");
    let answers = futures::future::join_all((0..3).map(|_| t.tokens(&request, &replicas))).await;
    for answer in answers {
        assert_eq!(answer.unwrap_err().reason(), "tokenize_error");
    }
    assert_eq!(failing.calls.load(Ordering::SeqCst), 1);
    assert!(t.calls.lock().is_empty());
    assert!(t.tokens(&request, &replicas).await.is_err());
    assert_eq!(failing.calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn past_the_calls_allowed_in_flight_a_request_falls_back_at_once() {
    let fake = Fake {
        delay: Duration::from_millis(500),
        ..Fake::default()
    };
    let addr = serve(fake.clone()).await.to_string();
    let t = Tokenizer::new(TokenizerConfig {
        deadline: Duration::from_millis(10),
        max_in_flight: 2,
        ..TokenizerConfig::default()
    });
    for prompt in ["a", "b"] {
        let err = t.tokens(&completion(prompt), &[&addr]).await.unwrap_err();
        assert_eq!(err.reason(), "tokenize_timeout");
    }
    let err = t.tokens(&completion("c"), &[&addr]).await.unwrap_err();
    assert_eq!(err, TokenizeError::Busy(2));
    assert_eq!(err.reason(), "tokenize_busy");
    assert_eq!(t.stats().shed.load(Ordering::Relaxed), 1);
    // Once the two calls have answered, their permits are back.
    for _ in 0..100 {
        if t.cache_bytes() > 0 && t.in_flight.available_permits() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(t.in_flight.available_permits(), 2);
    let slow = Tokenizer::new(TokenizerConfig {
        deadline: Duration::from_secs(5),
        ..TokenizerConfig::default()
    });
    assert!(slow.tokens(&completion("c"), &[&addr]).await.is_ok());
}

#[tokio::test]
async fn a_replica_that_times_out_is_not_followed_by_the_next() {
    let slow = Fake {
        delay: Duration::from_secs(3),
        ..Fake::default()
    };
    let next = Fake::default();
    let (slow_addr, next_addr) = (serve(slow.clone()).await, serve(next.clone()).await);
    let t = Tokenizer::new(TokenizerConfig {
        deadline: Duration::from_secs(5),
        call_timeout: Duration::from_millis(200),
        ..TokenizerConfig::default()
    });
    let err = t
        .tokens(
            &completion("x"),
            &[&slow_addr.to_string(), &next_addr.to_string()],
        )
        .await
        .unwrap_err();
    assert_eq!(err.reason(), "tokenize_error", "{err}");
    assert_eq!(slow.calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        next.calls.load(Ordering::SeqCst),
        0,
        "the next replica is not given the work"
    );
}

#[tokio::test]
async fn an_answer_over_the_cap_is_an_error_not_read() {
    // An answer that says it is longer than the cap, and one that only turns out to be.
    async fn huge(declared: bool) -> axum::response::Response {
        use axum::response::IntoResponse;
        let bytes = vec![b' '; MAX_ANSWER_BYTES + 1];
        if declared {
            bytes.into_response()
        } else {
            let chunks = futures::stream::iter(
                bytes
                    .chunks(1 << 20)
                    .map(|c| Ok::<_, std::io::Error>(bytes::Bytes::copy_from_slice(c)))
                    .collect::<Vec<_>>(),
            );
            axum::body::Body::from_stream(chunks).into_response()
        }
    }
    for declared in [true, false] {
        let app = axum::Router::new().route("/tokenize", post(move || huge(declared)));
        let addr = crate::testing::serve_on_loopback(app).await.to_string();
        let err = tokenizer(10_000)
            .tokens(&completion("x"), &[&addr])
            .await
            .unwrap_err();
        assert!(err.to_string().contains("is over"), "{declared}: {err}");
    }
}

#[test]
fn the_cache_stays_within_its_byte_bound() {
    let mut cache = TokenCache::new(1000);
    for key in 0..100u128 {
        cache.insert(key, Arc::from(vec![1u32; 50]));
        assert!(cache.bytes <= 1000);
    }
    // Each entry is 264 bytes: three fit, the newest three.
    assert_eq!(cache.entries.len(), 3);
    assert!(cache.get(99).is_some() && cache.get(97).is_some() && cache.get(96).is_none());
    // Too big for the whole cache: not kept, nothing else evicted.
    cache.insert(1000, Arc::from(vec![0u32; 1000]));
    assert_eq!(cache.entries.len(), 3);
    // Replacing a key re-accounts its size.
    cache.insert(99, Arc::from(vec![1u32; 10]));
    assert_eq!(cache.bytes, 264 * 2 + 104);
}

fn assets() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("sim/assets")
}

fn sim_tokenizer() -> LocalTokenizer {
    LocalTokenizer::from_file(&assets().join("tokenizer.json"))
        .expect("the simulator's tokenizer loads")
}

/// The simulator's tokenizer with its chat template (special tokens from the
/// tokenizer_config.json beside it).
fn sim_chat_tokenizer() -> LocalTokenizer {
    LocalTokenizer::load(
        &assets().join("tokenizer.json"),
        Some(&assets().join("chat_template.jinja")),
    )
    .expect("loads")
}

fn chat(model: &str, messages: Value) -> ParsedRequest {
    let body = json!({"model": model, "messages": messages}).to_string();
    parse_request(EndpointKind::ChatCompletions, body.as_bytes()).expect("parses")
}

fn conversation() -> Value {
    json!([
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What does the license grant?"}
    ])
}

#[tokio::test]
async fn a_chat_template_tokenizes_chats_locally_and_a_replica_that_agrees_keeps_it_on() {
    let local = sim_chat_tokenizer();
    let messages = conversation();
    let want = local
        .encode_chat(
            &messages.to_string(),
            ChatOptions {
                add_generation_prompt: true,
                continue_final_message: false,
            },
        )
        .expect("encodes");
    assert_eq!(
        want[0], 1,
        "the template starts with BOS (token 1): {want:?}"
    );
    // With special tokens on top (vLLM's /v1/responses) the post-processor adds a second BOS,
    // and the rest is the same (the whole text is encoded at once then, not piece by piece).
    let special = local
        .encode_chat_as(
            &messages.to_string(),
            ChatOptions {
                add_generation_prompt: true,
                continue_final_message: false,
            },
            true,
        )
        .expect("encodes");
    assert_eq!(special[0], 1);
    assert_eq!(&special[1..], &want[..]);
    let fake = Fake {
        answer: Some(want.clone()),
        ..Fake::default()
    };
    let addr = serve(fake.clone()).await.to_string();
    let t = tokenizer(1000).with_local("m", local);
    assert!(t.tokenizes_chat_locally("m"));
    let got = t
        .tokens(&chat("m", messages), &[&addr])
        .await
        .expect("tokens");
    assert_eq!(&got[..], &want[..]);
    // The answer came from here; the replica was only asked to check it.
    for _ in 0..100 {
        if t.stats().local_checks.load(Ordering::Relaxed) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(t.stats().local.load(Ordering::Relaxed), 1);
    assert_eq!(t.stats().local_checks.load(Ordering::Relaxed), 1);
    assert_eq!(t.stats().local_mismatches.load(Ordering::Relaxed), 0);
    assert!(t.tokenizes_chat_locally("m"));
    let sent = fake.bodies.lock()[0].clone();
    assert_eq!(
        sent["messages"],
        conversation(),
        "checked with the same request"
    );
    // Tools reach templates in ways not reproduced here: such requests go to /tokenize.
    let body = json!({"model": "m", "messages": conversation(), "tools": []}).to_string();
    let with_tools = parse_request(EndpointKind::ChatCompletions, body.as_bytes()).expect("parses");
    t.tokens(&with_tools, &[&addr]).await.expect("tokens");
    assert_eq!(t.stats().local.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn a_replica_that_disagrees_turns_local_chat_tokenization_off() {
    let fake = Fake::default(); // made-up ids: never what the template gives
    let addr = serve(fake.clone()).await.to_string();
    let t = tokenizer(1000).with_local("m", sim_chat_tokenizer());
    let local_answer = t
        .tokens(&chat("m", conversation()), &[&addr])
        .await
        .expect("tokens");
    assert_eq!(local_answer[0], 1, "answered locally first");
    for _ in 0..100 {
        if !t.tokenizes_chat_locally("m") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!t.tokenizes_chat_locally("m"), "switched off");
    assert_eq!(t.stats().local_mismatches.load(Ordering::Relaxed), 1);
    // The same chat now gets the replica's answer, not the cached local one.
    let again = t
        .tokens(&chat("m", conversation()), &[&addr])
        .await
        .expect("tokens");
    assert_ne!(again, local_answer);
    assert_eq!(again[1..], [1, 2, 3]);
    // Completion prompts were not judged by a chat mismatch.
    let before = t.stats().local.load(Ordering::Relaxed);
    t.tokens(&completion("hello"), &[&addr])
        .await
        .expect("tokens");
    assert_eq!(t.stats().local.load(Ordering::Relaxed), before + 1);
}

#[test]
fn without_a_chat_template_chats_are_not_local_and_a_model_dir_finds_its_config() {
    let t = tokenizer(10).with_local("m", sim_tokenizer());
    assert!(!t.tokenizes_chat_locally("m"));
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(
        assets().join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .expect("copy");
    let template = std::fs::read_to_string(assets().join("chat_template.jinja")).expect("read");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        json!({"bos_token": {"content": "<|bos|>"}, "eos_token": "<|eos|>", "chat_template": template})
            .to_string(),
    )
    .expect("write");
    let from_dir = LocalTokenizer::load(dir.path(), None).expect("loads");
    assert!(from_dir.has_chat_template());
    let opts = ChatOptions {
        add_generation_prompt: true,
        continue_final_message: false,
    };
    let m = conversation().to_string();
    assert_eq!(
        from_dir.encode_chat(&m, opts).expect("encodes"),
        sim_chat_tokenizer().encode_chat(&m, opts).expect("encodes")
    );
    // transformers' newer layout: the template in its own file beside the tokenizer.
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        json!({"bos_token": "<|bos|>", "eos_token": "<|eos|>"}).to_string(),
    )
    .expect("write");
    assert!(
        !LocalTokenizer::load(dir.path(), None)
            .expect("loads")
            .has_chat_template()
    );
    std::fs::write(dir.path().join("chat_template.jinja"), &template).expect("write");
    let from_file = LocalTokenizer::load(dir.path(), None).expect("loads");
    assert_eq!(
        from_file.encode_chat(&m, opts).expect("encodes"),
        sim_chat_tokenizer().encode_chat(&m, opts).expect("encodes")
    );
    std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").expect("write");
    let err = LocalTokenizer::load(dir.path(), None).expect_err("bad config");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
}

#[tokio::test]
async fn a_local_tokenizer_answers_completions_without_a_call() {
    let local = sim_tokenizer();
    let want = local
        .encode_prompt("Licensed under the Apache License")
        .expect("encodes");
    assert!(want.len() > 3, "{want:?}");
    let t = tokenizer(10).with_local("m", local);
    let got = t
        .tokens(&completion("Licensed under the Apache License"), &[])
        .await
        .expect("no replica needed");
    assert_eq!(&got[..], &want[..]);
    // Other models still need a replica.
    let body = json!({"model": "other", "prompt": "x"}).to_string();
    let other = parse_request(EndpointKind::Completions, body.as_bytes()).expect("parses");
    assert_eq!(
        t.tokens(&other, &[]).await.unwrap_err(),
        TokenizeError::NoReplica
    );
    // A LoRA adapter of "m" is tokenized by m's tokenizer, in process.
    let body = json!({"model": "sql", "prompt": "Licensed under the Apache License"}).to_string();
    let adapter = parse_request(EndpointKind::Completions, body.as_bytes()).expect("parses");
    let got = t
        .tokens_with(&adapter, "m", &[])
        .await
        .expect("no replica needed");
    assert_eq!(&got[..], &want[..]);
}

#[test]
fn a_missing_tokenizer_file_is_a_clear_error() {
    let err =
        LocalTokenizer::from_file(std::path::Path::new("/nonexistent/tokenizer.json")).unwrap_err();
    assert!(
        err.to_string().contains("/nonexistent/tokenizer.json"),
        "{err}"
    );
}

#[tokio::test]
async fn a_long_prompt_is_tokenized_off_the_runtime_under_the_deadline() {
    // Each step its own tokenizer: a local tokenizer caches the pieces it has encoded.
    let prompt = "Licensed under the Apache License, Version 2.0. ".repeat(2000); // ~96 KB
    let want = sim_tokenizer().encode_prompt(&prompt).expect("encodes");
    // Far past a 1 ms deadline: routed without tokens, but the answer still fills the cache.
    let t = tokenizer(1).with_local("m", sim_tokenizer());
    let request = completion(&prompt);
    assert_eq!(
        t.tokens(&request, &[]).await.unwrap_err(),
        TokenizeError::Timeout(Duration::from_millis(1))
    );
    for _ in 0..500 {
        if t.cache_bytes() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let got = t.tokens(&request, &[]).await.expect("from the cache");
    assert_eq!(&got[..], &want[..]);
    assert_eq!(t.stats().cache_hits.load(Ordering::Relaxed), 1);
    assert_eq!(t.stats().timeouts.load(Ordering::Relaxed), 1);
    // With time enough, the blocking pool's answer comes back directly, and its CPU time is
    // charged to the decision awaiting it (the awaiting thread itself does almost nothing).
    let direct = crate::cputime::ThreadCpu::start();
    sim_tokenizer().encode_prompt(&prompt).expect("encodes");
    let direct = direct.elapsed();
    let generous = tokenizer(30_000).with_local("m", sim_tokenizer());
    let (got, spent) = crate::cputime::CpuTimed::new(generous.tokens(&request, &[])).await;
    assert_eq!(&got.expect("tokens")[..], &want[..]);
    assert!(
        spent >= direct / 2,
        "charged {spent:?}, encoding takes {direct:?}"
    );
}

mod piecewise {
    use proptest::prelude::*;

    use super::*;

    /// Text made of words, whitespace, unicode, the tokenizer's added tokens and near misses
    /// of them, in any order.
    fn text() -> impl Strategy<Value = String> {
        let part = prop_oneof![
            "[a-zA-Z]{1,12}",
            Just(" ".to_owned()),
            Just("  ".to_owned()),
            Just("\n".to_owned()),
            Just("\n\n ".to_owned()),
            Just("ünï 🦀".to_owned()),
            Just("<|bos|>".to_owned()),
            Just("<|eos|>".to_owned()),
            Just("<|start|>".to_owned()),
            Just("<|end|>".to_owned()),
            Just("<unk>".to_owned()),
            Just("<|end".to_owned()),
            Just("|>".to_owned()),
            Just("<|".to_owned()),
        ];
        proptest::collection::vec(part, 0..24).prop_map(|parts| parts.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn pieces_between_added_tokens_add_up_to_the_whole_text(text in text()) {
            let t = sim_chat_tokenizer();
            prop_assert!(t.splits_at_added_tokens());
            let whole = t.encode_whole(&text).expect("encodes");
            // Twice: the second time the pieces come from the cache.
            for _ in 0..2 {
                let pieces = t.encode_piecewise(&text).expect("splits").expect("encodes");
                prop_assert_eq!(&pieces, &whole);
            }
        }
    }

    #[test]
    fn a_conversation_is_encoded_piecewise_as_it_is_whole() {
        let t = sim_chat_tokenizer();
        let opts = ChatOptions {
            add_generation_prompt: true,
            continue_final_message: false,
        };
        let source = std::fs::read_to_string(assets().join("chat_template.jinja")).expect("read");
        let template = ChatTemplate::new(source, "<|bos|>", "<|eos|>").expect("template");
        let mut messages = conversation().as_array().expect("array").clone();
        for turn in 0..4 {
            messages.push(json!({"role": "assistant", "content": format!("Reply {turn}.")}));
            messages.push(
                json!({"role": "user", "content": format!("Turn {turn}: and <|end|> then?")}),
            );
            let m = Value::Array(messages.clone()).to_string();
            let text = template.render(&messages, opts).expect("renders");
            assert_eq!(
                t.encode_chat(&m, opts).expect("encodes"),
                t.encode_whole(&text).expect("encodes")
            );
        }
    }
}

mod segments {
    use proptest::prelude::*;

    use super::*;

    const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    /// The simulator's tokenizer with its pipeline changed by `edit` (its vocabulary and
    /// merges stay), from a file as a model's would be.
    fn variant(edit: impl FnOnce(&mut Value)) -> LocalTokenizer {
        let mut json: Value =
            serde_json::from_slice(&std::fs::read(assets().join("tokenizer.json")).expect("read"))
                .expect("json");
        edit(&mut json);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json.to_string()).expect("write");
        LocalTokenizer::from_file(&path).expect("loads")
    }

    fn split_then_bytes(regex: &str) -> Value {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        ]})
    }

    /// The tokenizers segments are proven exact for: GPT-2's regex (the simulator's own),
    /// Qwen2's with NFC, Llama 3's behind a post-processor sequence.
    fn segmenting() -> Vec<(&'static str, LocalTokenizer)> {
        vec![
            ("gpt2", sim_tokenizer()),
            (
                "qwen2",
                variant(|t| {
                    t["normalizer"] = json!({"type": "NFC"});
                    t["pre_tokenizer"] = split_then_bytes(QWEN2_SPLIT);
                    t["post_processor"] = json!({"type": "ByteLevel", "add_prefix_space": false,
                        "trim_offsets": false, "use_regex": false});
                }),
            ),
            (
                "llama3",
                variant(|t| {
                    t["pre_tokenizer"] = split_then_bytes(LLAMA3_SPLIT);
                    let template = t["post_processor"].take();
                    t["post_processor"] = json!({"type": "Sequence", "processors": [
                        {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
                         "use_regex": true},
                        template,
                    ]});
                }),
            ),
        ]
        .into_iter()
        .map(|(name, t)| (name, t.with_min_segment(8)))
        .collect()
    }

    #[test]
    fn only_pipelines_proven_exact_are_cut() {
        for (name, t) in segmenting() {
            assert!(t.cuts_in_segments(), "{name}");
        }
        let not_cut = [
            (
                "a normalizer that is not local",
                variant(|t| t["normalizer"] = json!({"type": "Prepend", "prepend": "▁"})),
            ),
            (
                "an unknown split regex",
                variant(|t| t["pre_tokenizer"] = split_then_bytes(r"\s+|\S+")),
            ),
            (
                "a prefix space",
                variant(|t| t["pre_tokenizer"]["add_prefix_space"] = json!(true)),
            ),
            (
                "special tokens after the text",
                variant(|t| {
                    t["post_processor"]["single"] = json!([
                        {"Sequence": {"id": "A", "type_id": 0}},
                        {"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                    ])
                }),
            ),
            (
                "an added token that strips whitespace",
                variant(|t| t["added_tokens"][4]["lstrip"] = json!(true)),
            ),
            (
                "BPE dropout",
                variant(|t| t["model"]["dropout"] = json!(0.1)),
            ),
        ];
        for (why, t) in not_cut {
            assert!(!t.cuts_in_segments(), "cut despite {why}");
        }
    }

    /// Lines of words, numbers, spaces, marks and unicode (combining marks too, which NFC
    /// composes), with the tokenizer's added tokens among them: many cuts, and many line ends
    /// that are not cuts.
    fn text() -> impl Strategy<Value = String> {
        let part = prop_oneof![
            4 => "[a-zA-Z]{1,12}",
            2 => Just(" ".to_owned()),
            3 => Just("\n".to_owned()),
            1 => Just("\n\n".to_owned()),
            1 => Just(" \n \n  ".to_owned()),
            1 => Just("\r\n".to_owned()),
            1 => "[0-9]{1,5}",
            1 => "[.,;:!?'\"()-]{1,3}",
            1 => Just("'s".to_owned()),
            1 => Just("e\u{301}".to_owned()),
            1 => Just("ünï 🦀 漢字".to_owned()),
            1 => Just("\u{301}".to_owned()),
            1 => Just("<|end|>".to_owned()),
            1 => Just("<|bos|>".to_owned()),
        ];
        proptest::collection::vec(part, 0..160).prop_map(|parts| parts.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        #[test]
        fn segments_add_up_to_the_whole_text(text in text()) {
            for (name, t) in segmenting() {
                let whole = t.encode_whole_prompt(&text).expect("encodes");
                // Twice: the second time the segments come from the cache.
                for pass in 0..2 {
                    let cut = t.encode_prompt(&text).expect("encodes");
                    prop_assert_eq!(&cut, &whole, "{} pass {}", name, pass);
                }
                let mut pieces = Vec::new();
                t.encode_pieces(&text, &mut pieces).expect("encodes");
                prop_assert_eq!(pieces, t.encode_whole(&text).expect("encodes"), "{}", name);
            }
        }
    }

    #[test]
    fn a_growing_completion_reuses_its_earlier_segments() {
        let t = sim_tokenizer();
        assert!(t.cuts_in_segments());
        let document = "Licensed under the Apache License, Version 2.0. ".repeat(40);
        let mut prompt = format!("{document}\nconversation 7 starts here\n");
        let mut cached = 0;
        for turn in 0..12 {
            prompt.push_str(&format!(
                "question {turn}: where is the cache, and why?\nnoted\n"
            ));
            assert_eq!(
                t.encode_prompt(&prompt).expect("encodes"),
                t.encode_whole_prompt(&prompt).expect("encodes"),
                "turn {turn}"
            );
            // Each turn adds its own end and at most a new segment: the document and earlier
            // segments are found again, not cached anew.
            let now = t.cached_pieces();
            assert!(now <= cached + 2, "turn {turn}: {cached} -> {now} cached");
            cached = now;
        }
        assert!(
            cached >= 3,
            "the document and later turns are segments: {cached}"
        );
    }
}
