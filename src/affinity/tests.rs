use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::routing::post;
use serde_json::{Value, json};

use super::*;
use crate::blockhash::HashSettings;
use crate::kvindex::{IndexConfig, KvEventSink, Medium};
use crate::openai::{EndpointKind, parse_request};
use crate::pool::ReplicaSpec;
use crate::prefix::PrefixTreeConfig;
use crate::tokenize::TokenizerConfig;

const BLOCK: usize = 4;

/// `/tokenize` whose token ids are the prompt's bytes; prompts starting "slow" answer after 500 ms.
async fn fake_tokenize(Json(body): Json<Value>) -> Json<Value> {
    let prompt = body["prompt"].as_str().unwrap_or_default().to_owned();
    if prompt.starts_with("slow") {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let tokens: Vec<u32> = prompt.bytes().map(u32::from).collect();
    Json(json!({"count": tokens.len(), "max_model_len": 4096, "tokens": tokens}))
}

async fn tokenizer_server() -> SocketAddr {
    let app = axum::Router::new().route("/tokenize", post(fake_tokenize));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

fn hasher() -> Arc<BlockHasher> {
    Arc::new(
        BlockHasher::new(&HashSettings::sha256_cbor(
            NonZeroUsize::new(BLOCK).expect("nonzero"),
            Some("0"),
        ))
        .expect("hasher"),
    )
}

struct Fixture {
    affinity: PrefixAffinity,
    index: Arc<KvIndex>,
    /// Candidate 0 is the tokenizer server itself (a replica that answers /tokenize).
    candidates: Vec<Candidate>,
}

async fn fixture(deadline_ms: u64) -> Fixture {
    let tokenizer_addr = tokenizer_server().await;
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let tree = Arc::new(PrefixTree::new(PrefixTreeConfig {
        chunk_bytes: NonZeroUsize::new(BLOCK).expect("nonzero"),
        ..PrefixTreeConfig::default()
    }));
    let tokenizer = Tokenizer::new(TokenizerConfig {
        deadline: Duration::from_millis(deadline_ms),
        ..TokenizerConfig::default()
    });
    let hashers = HashersByModel::from([("m".to_owned(), hasher())]);
    let affinity = PrefixAffinity::new(
        AffinityConfig::default(),
        hashers,
        Arc::clone(&index),
        tree,
        tokenizer,
    );
    let addresses = [
        tokenizer_addr,
        "127.0.0.1:2".parse().expect("addr"),
        "127.0.0.1:3".parse().expect("addr"),
    ];
    let candidates = addresses
        .into_iter()
        .map(|address| Candidate {
            replica: Arc::new(Replica::new(ReplicaSpec {
                address,
                models: vec!["m".to_owned()],
                node: None,
            })),
            in_flight: 0,
            engine: None,
        })
        .collect();
    Fixture {
        affinity,
        index,
        candidates,
    }
}

fn completion(model: &str, prompt: &str, salt: Option<&str>) -> ParsedRequest {
    let mut body = json!({"model": model, "prompt": prompt});
    if let Some(salt) = salt {
        body["cache_salt"] = json!(salt);
    }
    parse_request(EndpointKind::Completions, body.to_string().as_bytes()).expect("parses")
}

fn hashes_of(prompt: &str, salt: Option<&str>) -> Vec<ExternalHash> {
    let tokens: Vec<u32> = prompt.bytes().map(u32::from).collect();
    let mut out = Vec::new();
    hasher().external_hashes_into(&tokens, salt, &mut out);
    out
}

impl Fixture {
    fn endpoint(&self, i: usize) -> &str {
        self.candidates[i].replica.endpoint()
    }

    async fn score(&self, request: &ParsedRequest) -> PrefixScores {
        self.affinity
            .score(request, &self.candidates)
            .await
            .expect("always scores")
    }

    fn branch(scores: &PrefixScores) -> Branch {
        scores
            .memo
            .as_ref()
            .and_then(|m| m.downcast_ref::<Memo>())
            .map(|m| m.branch)
            .expect("memo")
    }
}

#[tokio::test]
async fn a_warmed_prompt_scores_its_owner() {
    let f = fixture(2000).await;
    let prompt = "abcdefghijklmnop"; // 4 blocks
    f.index
        .stored(f.endpoint(2), &hashes_of(prompt, None), Medium::Gpu);
    f.index
        .stored(f.endpoint(1), &hashes_of(prompt, None)[..1], Medium::Gpu);
    let request = completion("m", prompt, None);
    let scores = f.score(&request).await;
    assert_eq!(Fixture::branch(&scores), Branch::Index);
    assert_eq!(scores.per_candidate, vec![0.0, 0.25, 1.0]);
    f.affinity.after_pick(&request, &f.candidates[2], &scores);
    assert_eq!(f.affinity.metrics().kv_count("hit"), 1);
    f.affinity.after_pick(&request, &f.candidates[1], &scores);
    assert_eq!(f.affinity.metrics().kv_count("load_override"), 1);
}

#[tokio::test]
async fn a_salted_request_does_not_match_unsalted_blocks() {
    let f = fixture(2000).await;
    let prompt = "abcdefghijklmnop";
    f.index
        .stored(f.endpoint(2), &hashes_of(prompt, None), Medium::Gpu);
    f.index
        .stored(f.endpoint(1), &hashes_of(prompt, Some("t1")), Medium::Gpu);
    let scores = f.score(&completion("m", prompt, Some("t1"))).await;
    assert_eq!(scores.per_candidate, vec![0.0, 1.0, 0.0]);
    let scores = f.score(&completion("m", prompt, Some("t2"))).await;
    assert_eq!(scores.per_candidate, vec![0.0, 0.0, 0.0]);
}

#[tokio::test]
async fn a_pick_is_followed_before_the_engine_reports() {
    let f = fixture(2000).await;
    // Some events exist for the model (another prompt on replica 1).
    f.index
        .stored(f.endpoint(1), &hashes_of("zzzz", None), Medium::Gpu);
    let request = completion("m", "abcdefgh", None);
    let first = f.score(&request).await;
    assert_eq!(first.per_candidate, vec![0.0, 0.0, 0.0]);
    f.affinity.after_pick(&request, &f.candidates[0], &first);
    assert_eq!(f.affinity.metrics().kv_count("miss"), 1);
    let second = f.score(&request).await;
    assert_eq!(
        second.per_candidate,
        vec![1.0, 0.0, 0.0],
        "speculative entry"
    );
}

#[tokio::test]
async fn an_index_miss_goes_where_the_tree_sent_the_prefix_before() {
    let f = fixture(2000).await;
    let request = completion("m", "abcdefgh", None);
    // The prompt went to replica 2 once; its engine has since evicted the blocks (the index
    // knows other blocks only).
    f.index
        .stored(f.endpoint(1), &hashes_of("zzzz", None), Medium::Gpu);
    f.affinity
        .tree
        .record("m", &prompt_text(&request), f.endpoint(2));
    let scores = f.score(&request).await;
    assert_eq!(Fixture::branch(&scores), Branch::Tree("index_miss"));
    assert_eq!(scores.per_candidate, vec![0.0, 0.0, 1.0]);
    f.affinity.after_pick(&request, &f.candidates[2], &scores);
    assert_eq!(f.affinity.metrics().kv_count("index_miss"), 1);
    assert_eq!(f.affinity.metrics().tree_count("hit"), 1);
    // The pick is followed through the index too, before the engine reports.
    let again = f.score(&request).await;
    assert_eq!(Fixture::branch(&again), Branch::Index);
    assert_eq!(again.per_candidate, vec![0.0, 0.0, 1.0]);
}

#[tokio::test]
async fn the_tree_never_sends_a_salted_request_after_unsalted_text() {
    let f = fixture(2000).await;
    f.index
        .stored(f.endpoint(1), &hashes_of("zzzz", None), Medium::Gpu);
    let plain = completion("m", "abcdefgh", None);
    f.affinity
        .tree
        .record(&tree_scope(&plain), &prompt_text(&plain), f.endpoint(2));
    let salted = completion("m", "abcdefgh", Some("tenant-1"));
    let scores = f.score(&salted).await;
    assert_eq!(Fixture::branch(&scores), Branch::Index, "an index miss");
    assert_eq!(scores.per_candidate, vec![0.0, 0.0, 0.0]);
    f.affinity.after_pick(&salted, &f.candidates[1], &scores);
    assert_eq!(f.affinity.metrics().kv_count("miss"), 1);
    // The same salt again follows the first salted pick.
    let again = completion("m", "abcdefgh", Some("tenant-1"));
    let scores = f.score(&again).await;
    assert_eq!(scores.per_candidate, vec![0.0, 1.0, 0.0]);
}

#[tokio::test]
async fn unknown_settings_and_no_events_fall_back_to_the_tree() {
    let f = fixture(2000).await;
    let request = completion("m", "abcdefgh", None);
    let scores = f.score(&request).await;
    assert_eq!(Fixture::branch(&scores), Branch::Tree("no_events"));
    f.affinity.after_pick(&request, &f.candidates[1], &scores);
    assert_eq!(f.affinity.metrics().kv_count("no_events"), 1);
    assert_eq!(f.affinity.metrics().tree_count("miss"), 1);
    // The tree now sends the same prompt to where the first one went.
    let scores = f.score(&request).await;
    assert_eq!(scores.per_candidate, vec![0.0, 1.0, 0.0]);
    f.affinity.after_pick(&request, &f.candidates[1], &scores);
    assert_eq!(f.affinity.metrics().tree_count("hit"), 1);

    let other_model = completion("other", "abcdefgh", None);
    let scores = f.score(&other_model).await;
    assert_eq!(Fixture::branch(&scores), Branch::Tree("unknown_settings"));
}

#[tokio::test]
async fn a_tokenize_timeout_falls_back_within_the_deadline() {
    let f = fixture(30).await;
    f.index
        .stored(f.endpoint(2), &hashes_of("slowslowslow", None), Medium::Gpu);
    let request = completion("m", "slowslowslow", None);
    let scores = f.score(&request).await;
    assert_eq!(Fixture::branch(&scores), Branch::Tree("tokenize_timeout"));
    f.affinity.after_pick(&request, &f.candidates[1], &scores);
    assert_eq!(f.affinity.metrics().kv_count("tokenize_timeout"), 1);
}

#[tokio::test]
async fn metrics_expose_decisions_and_tier_sizes() {
    let f = fixture(2000).await;
    let affinity = Arc::new(f.affinity);
    let mut registry = prometheus_client::registry::Registry::default();
    affinity.register_metrics(&mut registry);
    let prompt = "abcdefghijklmnop";
    f.index.stored(
        f.candidates[2].replica.endpoint(),
        &hashes_of(prompt, None),
        Medium::Gpu,
    );
    let request = completion("m", prompt, None);
    let scores = affinity
        .score(&request, &f.candidates)
        .await
        .expect("scores");
    affinity.after_pick(&request, &f.candidates[2], &scores);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
    for line in [
        "llmgw_kv_decisions_total{decision=\"hit\"} 1",
        "llmgw_kv_index_blocks 4",
        "llmgw_tokenize_cache_misses_total 1",
        "llmgw_prefix_tree_nodes 4",
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }
    assert!(text.contains(&format!(
        "llmgw_kv_index_replica_blocks{{replica=\"{}\"}} 4",
        f.candidates[2].replica.endpoint()
    )));
}

#[test]
fn the_hash_cache_key_separates_models_salts_and_tokens() {
    let tokens: Vec<u32> = (0..600).collect();
    let base = super::tokens_key("m", None, &tokens);
    assert_eq!(base, super::tokens_key("m", None, &tokens));
    assert_ne!(base, super::tokens_key("m2", None, &tokens));
    assert_ne!(base, super::tokens_key("m", Some(""), &tokens));
    assert_ne!(
        super::tokens_key("m", Some("a"), &tokens),
        super::tokens_key("m", Some("b"), &tokens)
    );
    let mut other = tokens.clone();
    other[599] = 7;
    assert_ne!(base, super::tokens_key("m", None, &other));
    assert_ne!(base, super::tokens_key("m", None, &tokens[..599]));
}
