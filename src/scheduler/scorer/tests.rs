//! The affinity scorers as the default profile composes them (`kv_cache` with `prefix_tree` as
//! its fallback), and `session_affinity`, driven through a scheduler built from YAML with a
//! fake `/tokenize` whose token ids are the prompt's bytes.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::routing::post;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};

use crate::blockhash::{BlockHasher, ExternalHash, HashSettings, LoraKey, RequestKeys};
use crate::kvindex::{IndexConfig, KvEventSink, KvIndex, Medium};
use crate::metrics::state::StateCollector;
use crate::models::HashersByModel;
use crate::openai::{EndpointKind, ParsedRequest, parse_request};
use crate::peers::{PeerPick, PickOutbox, PickSink};
use crate::pool::adapters::{AdapterCatalog, AdapterSlots, ModelCard};
use crate::pool::{EngineLoad, Health, Pool, ReplicaSpec};
use crate::scheduler::{DecideError, PluginResources, Scheduler, SchedulerConfig, Scope};
use crate::tokenize::{Tokenizer, TokenizerConfig};

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
    crate::testing::serve_on_loopback(app).await
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

fn hashes_of(prompt: &str, salt: Option<&str>) -> Vec<ExternalHash> {
    let tokens: Vec<u32> = prompt.bytes().map(u32::from).collect();
    let mut out = Vec::new();
    hasher().external_hashes_into(&tokens, salt, &mut out);
    out
}

fn completion(model: &str, prompt: &str, salt: Option<&str>) -> ParsedRequest {
    let mut body = json!({"model": model, "prompt": prompt});
    if let Some(salt) = salt {
        body["cache_salt"] = json!(salt);
    }
    parse_request(EndpointKind::Completions, body.to_string().as_bytes()).expect("parses")
}

/// Precise affinity with the tree as its fallback, and an in-flight scorer that only matters
/// when the test holds requests.
const AFFINITY: &str = "
profile:
  scorers:
    - type: kv_cache
      parameters: {speculative_ttl: SPECULATIVE}
      fallback: {type: prefix_tree, parameters: {chunk_bytes: 4}}
    - {type: in_flight, weight: 10}
";

struct Fixture {
    scheduler: Scheduler,
    index: Arc<KvIndex>,
    pool: Arc<Pool>,
    registry: Registry,
    /// What built the scheduler, for [`Fixture::peer`].
    config: SchedulerConfig,
    tokenizer: Arc<Tokenizer>,
    /// The picks this router publishes to its peers.
    picks: Arc<PickOutbox>,
    /// Replica 0 is the tokenizer server itself (a replica that answers /tokenize).
    endpoints: Vec<String>,
}

async fn fixture(profile: &str, deadline_ms: u64) -> Fixture {
    let tokenizer_addr = tokenizer_server().await;
    let addresses: [SocketAddr; 3] = [
        tokenizer_addr,
        "127.0.0.1:2".parse().expect("addr"),
        "127.0.0.1:3".parse().expect("addr"),
    ];
    let pool = Arc::new(Pool::new(
        addresses
            .iter()
            .map(|&address| ReplicaSpec {
                address,
                models: vec!["m".to_owned(), "other".to_owned(), "sql".to_owned()],
                node: None,
            })
            .collect(),
        Duration::from_secs(60),
    ));
    for replica in pool.snapshot().replicas() {
        replica.set_health(Health::Healthy);
    }
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let tokenizer = Arc::new(Tokenizer::new(TokenizerConfig {
        deadline: Duration::from_millis(deadline_ms),
        ..TokenizerConfig::default()
    }));
    let config: SchedulerConfig = serde_yaml::from_str(profile).expect("profile yaml");
    router(
        pool,
        index,
        tokenizer,
        config,
        addresses.iter().map(ToString::to_string).collect(),
    )
}

/// A router's scheduler over `pool` and `index`, with its own metrics and outbox.
fn router(
    pool: Arc<Pool>,
    index: Arc<KvIndex>,
    tokenizer: Arc<Tokenizer>,
    config: SchedulerConfig,
    endpoints: Vec<String>,
) -> Fixture {
    let picks = Arc::new(PickOutbox::default());
    let resources = PluginResources {
        index: Arc::clone(&index),
        tokenizer: Arc::clone(&tokenizer),
        hashers: Arc::new(HashersByModel::from([("m".to_owned(), hasher())])),
        picks: Arc::clone(&picks),
    };
    let mut registry = Registry::default();
    registry.register_collector(Box::new(StateCollector {
        index: Arc::clone(&index),
        tokenizer: Arc::clone(&tokenizer),
        pool: Arc::clone(&pool),
    }));
    let scheduler = Scheduler::build(Arc::clone(&pool), &config, &resources, &mut registry)
        .expect("profile builds");
    Fixture {
        scheduler,
        index,
        pool,
        registry,
        config,
        tokenizer,
        picks,
        endpoints,
    }
}

async fn affinity(deadline_ms: u64, speculative: &str) -> Fixture {
    fixture(&AFFINITY.replace("SPECULATIVE", speculative), deadline_ms).await
}

impl Fixture {
    /// A second router behind the same proxy: the same replicas and the same KV index (every
    /// agent feeds every router), its own speculative entries, projections and metrics.
    fn peer(&self) -> Fixture {
        router(
            Arc::clone(&self.pool),
            Arc::clone(&self.index),
            Arc::clone(&self.tokenizer),
            self.config.clone(),
            self.endpoints.clone(),
        )
    }

    fn endpoint(&self, i: usize) -> &str {
        &self.endpoints[i]
    }

    /// Decides and returns the pick (its in-flight count released at once).
    async fn pick(&self, request: &ParsedRequest) -> String {
        self.pick_with(request, &[]).await
    }

    async fn pick_with(&self, request: &ParsedRequest, headers: &[(String, String)]) -> String {
        let decision = self
            .scheduler
            .decide(request, headers, Scope::default())
            .await
            .expect("decides");
        decision.primary().endpoint().to_owned()
    }

    /// Holds `n` requests in flight on replica `i`.
    fn hold(&self, i: usize, n: usize) -> Vec<crate::pool::InFlightGuard> {
        let snapshot = self.pool.snapshot();
        let replica = snapshot.find(self.endpoint(i)).expect("replica");
        (0..n).map(|_| replica.start_request()).collect()
    }

    /// The value of one sample line of the registry's text (0 when absent).
    fn metric(&self, sample: &str) -> f64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).expect("encodes");
        text.lines()
            .find_map(|line| line.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }

    fn kv(&self, decision: &str) -> f64 {
        self.metric(&format!(
            "llmgw_kv_decisions_total{{decision=\"{decision}\"}}"
        ))
    }

    fn tree(&self, decision: &str) -> f64 {
        self.metric(&format!(
            "llmgw_prefix_decisions_total{{decision=\"{decision}\"}}"
        ))
    }
}

#[tokio::test]
async fn a_warmed_prompt_goes_to_its_owner_unless_load_outvotes_it() {
    let f = affinity(2000, "2s").await;
    let prompt = "abcdefghijklmnop"; // 4 blocks
    f.index
        .stored(f.endpoint(2), &hashes_of(prompt, None), Medium::Gpu);
    f.index
        .stored(f.endpoint(1), &hashes_of(prompt, None)[..1], Medium::Gpu);
    let request = completion("m", prompt, None);
    assert_eq!(f.pick(&request).await, f.endpoint(2));
    assert_eq!(f.kv("hit"), 1.0);
    // Replica 2 busy: the in-flight scorer (weight 10) outvotes its full match.
    let _held = f.hold(2, 8);
    assert_ne!(f.pick(&request).await, f.endpoint(2));
    assert_eq!(f.kv("load_override"), 1.0);
}

#[tokio::test]
async fn a_salted_request_does_not_match_unsalted_blocks() {
    let f = affinity(2000, "2s").await;
    let prompt = "abcdefghijklmnop";
    f.index
        .stored(f.endpoint(2), &hashes_of(prompt, None), Medium::Gpu);
    f.index
        .stored(f.endpoint(1), &hashes_of(prompt, Some("t1")), Medium::Gpu);
    assert_eq!(
        f.pick(&completion("m", prompt, Some("t1"))).await,
        f.endpoint(1)
    );
    assert_eq!(f.kv("hit"), 1.0);
    f.pick(&completion("m", prompt, Some("t2"))).await;
    assert_eq!(
        f.kv("miss"),
        1.0,
        "another salt matches nothing, in the index or the tree"
    );
}

#[tokio::test]
async fn a_pick_is_followed_before_the_engine_reports() {
    let f = affinity(2000, "2s").await;
    // Some events exist for the model (another prompt on replica 1).
    f.index
        .stored(f.endpoint(1), &hashes_of("zzzz", None), Medium::Gpu);
    let request = completion("m", "abcdefgh", None);
    let first = f.pick(&request).await;
    assert_eq!(f.kv("miss"), 1.0);
    assert_eq!(f.pick(&request).await, first);
    assert_eq!(f.kv("hit"), 1.0, "the speculative entry of the first pick");
}

#[tokio::test]
async fn an_index_miss_goes_where_the_tree_sent_the_prefix_before() {
    // No speculative entries, so that only the tree remembers the first pick.
    let f = affinity(2000, "0s").await;
    let request = completion("m", "abcdefgh", None);
    f.index
        .stored(f.endpoint(1), &hashes_of("zzzz", None), Medium::Gpu);
    let first = f.pick(&request).await;
    assert_eq!(f.kv("miss"), 1.0);
    // The engine's events for the prompt have not arrived: the index misses, the tree knows.
    assert_eq!(f.pick(&request).await, first);
    assert_eq!(f.kv("index_miss"), 1.0);
    assert_eq!(f.tree("hit"), 1.0);

    // The tree never sends a salted request after unsalted text.
    f.pick(&completion("m", "abcdefgh", Some("tenant-1"))).await;
    assert_eq!(f.kv("miss"), 2.0);
    assert_eq!(f.tree("hit"), 1.0);
}

#[tokio::test]
async fn unknown_settings_and_no_events_fall_back_to_the_tree() {
    let f = affinity(2000, "2s").await;
    let request = completion("m", "abcdefgh", None);
    let first = f.pick(&request).await;
    assert_eq!(f.kv("no_events"), 1.0);
    assert_eq!(f.tree("miss"), 1.0);
    // The tree now sends the same prompt where the first one went.
    assert_eq!(f.pick(&request).await, first);
    assert_eq!(f.tree("hit"), 1.0);

    f.pick(&completion("other", "abcdefgh", None)).await;
    assert_eq!(f.kv("unknown_settings"), 1.0);
}

#[tokio::test]
async fn a_tokenize_timeout_falls_back_within_the_deadline() {
    let f = affinity(30, "2s").await;
    f.index
        .stored(f.endpoint(2), &hashes_of("slowslowslow", None), Medium::Gpu);
    f.pick(&completion("m", "slowslowslow", None)).await;
    assert_eq!(f.kv("tokenize_timeout"), 1.0);
    assert_eq!(f.tree("miss"), 1.0);
}

#[tokio::test]
async fn metrics_expose_decisions_and_tier_sizes() {
    let f = affinity(2000, "2s").await;
    let prompt = "abcdefghijklmnop";
    f.index
        .stored(f.endpoint(2), &hashes_of(prompt, None), Medium::Gpu);
    f.pick(&completion("m", prompt, None)).await;
    assert_eq!(f.kv("hit"), 1.0);
    assert_eq!(f.metric("llmgw_kv_index_blocks"), 4.0);
    assert_eq!(f.metric("llmgw_tokenize_cache_misses_total"), 1.0);
    assert_eq!(f.metric("llmgw_prefix_tree_nodes"), 4.0);
    assert_eq!(
        f.metric(&format!(
            "llmgw_kv_index_replica_blocks{{replica=\"{}\"}}",
            f.endpoint(2)
        )),
        4.0
    );
    // The engine evicts a block and computes it again: an eviction and a rebuilt block.
    let first = &hashes_of(prompt, None)[..1];
    f.index.removed(f.endpoint(2), first, Medium::Gpu);
    f.index.stored(f.endpoint(2), first, Medium::Gpu);
    for (name, value) in [
        ("llmgw_kv_index_replica_evicted_blocks_total", 1.0),
        ("llmgw_kv_index_replica_rebuilt_blocks_total", 1.0),
    ] {
        let sample = format!("{name}{{replica=\"{}\"}}", f.endpoint(2));
        assert_eq!(f.metric(&sample), value, "{sample}");
    }
}

const SESSIONS: &str = "
profile:
  scorers:
    - {type: session_affinity, weight: 1, parameters: {max_key_bytes: 16}}
    - {type: in_flight, weight: 1}
imbalance_threshold: 4
";

fn session(key: &str) -> Vec<(String, String)> {
    vec![("x-session-id".to_owned(), key.to_owned())]
}

#[tokio::test]
async fn a_session_sticks_to_its_replica_until_load_moves_it() {
    let f = fixture(SESSIONS, 2000).await;
    assert_eq!(f.scheduler.request_headers(), ["x-session-id"]);
    let request = completion("m", "hello", None);
    let home = f.pick_with(&request, &session("alice")).await;
    assert_eq!(
        f.metric("llmgw_session_affinity_total{outcome=\"new\"}"),
        1.0
    );
    let home_index = f.endpoints.iter().position(|e| *e == home).expect("ours");
    // A little load does not move it.
    let held = f.hold(home_index, 2);
    assert_eq!(f.pick_with(&request, &session("alice")).await, home);
    assert_eq!(
        f.metric("llmgw_session_affinity_total{outcome=\"sticky\"}"),
        1.0
    );
    // Lopsided load does (the imbalance guard), and it then sticks to its new replica.
    let more = f.hold(home_index, 3);
    let new_home = f.pick_with(&request, &session("alice")).await;
    assert_ne!(new_home, home);
    assert_eq!(
        f.metric("llmgw_session_affinity_total{outcome=\"moved\"}"),
        1.0
    );
    drop((held, more));
    assert_eq!(f.pick_with(&request, &session("alice")).await, new_home);
    // A key over max_key_bytes is refused, naming the header and the limit, and counted.
    let refused = f
        .scheduler
        .decide(
            &request,
            &session("a-very-long-session-key"),
            Scope::default(),
        )
        .await
        .err();
    assert_eq!(
        refused,
        Some(DecideError::BadRequest(
            "the session header x-session-id is 23 bytes; the limit is 16".to_owned()
        ))
    );
    assert_eq!(
        f.metric("llmgw_session_affinity_total{outcome=\"too_long\"}"),
        1.0
    );
}

#[tokio::test]
async fn a_session_cookie_works_like_a_header() {
    let profile = SESSIONS.replace("max_key_bytes: 16", "cookie: sid");
    let f = fixture(&profile, 2000).await;
    assert_eq!(f.scheduler.request_headers(), ["cookie"]);
    let request = completion("m", "hello", None);
    let cookie = |v: &str| vec![("cookie".to_owned(), format!("theme=dark; sid={v}"))];
    let home = f.pick_with(&request, &cookie("s1")).await;
    for _ in 0..4 {
        let _held = f.hold(0, 1);
        assert_eq!(f.pick_with(&request, &cookie("s1")).await, home);
    }
}

/// The default profile's cache scorers: precise affinity, its tree fallback, and placement by
/// cache footprint, with llmgw's in-flight count as the load.
const PLACEMENT: &str = "
profile:
  scorers:
    - type: kv_cache
      weight: 2
      parameters: {speculative_ttl: 2s}
      fallback: {type: prefix_tree, parameters: {chunk_bytes: 4}}
    - {type: cache_footprint, weight: 2}
    - {type: in_flight, weight: 1}
";

/// Every cache of 12 blocks holds 8, `fullest` 10: none has room for a 4-block prompt.
fn no_room_but_fullest(f: &Fixture, fullest: usize) {
    for (i, replica) in f.pool.snapshot().replicas().iter().enumerate() {
        replica.set_cache_blocks(12);
        fill(f, i, if i == fullest { 10 } else { 8 });
    }
}

/// The placement profile without speculative entries (nor projections), so that only the
/// count of placements tells caches apart.
async fn counting_placements_only() -> Fixture {
    fixture(
        &PLACEMENT.replace("speculative_ttl: 2s", "speculative_ttl: 0s"),
        2000,
    )
    .await
}

/// `n` blocks of nobody's prompt reported by replica `i`'s engine.
fn fill(f: &Fixture, i: usize, n: u64) {
    let hashes: Vec<ExternalHash> = (0..n)
        .map(|k| ExternalHash(((i as u64) << 32) | k))
        .collect();
    f.index.stored(f.endpoint(i), &hashes, Medium::Gpu);
}

fn placements(f: &Fixture, decision: &str) -> f64 {
    f.metric(&format!(
        "llmgw_cold_placements_total{{decision=\"{decision}\"}}"
    ))
}

#[tokio::test]
async fn a_prompt_found_nowhere_goes_to_the_emptiest_cache_unless_load_outvotes_it() {
    let f = fixture(PLACEMENT, 2000).await;
    fill(&f, 0, 50);
    fill(&f, 1, 10);
    fill(&f, 2, 30);
    assert_eq!(
        f.pick(&completion("m", "abcdefgh", None)).await,
        f.endpoint(1)
    );
    assert_eq!((f.kv("miss"), placements(&f, "emptiest")), (1.0, 1.0));

    // The next turn of that prompt follows it there, by affinity, not placement.
    assert_eq!(
        f.pick(&completion("m", "abcdefghijkl", None)).await,
        f.endpoint(1)
    );
    assert_eq!((f.kv("hit"), placements(&f, "emptiest")), (1.0, 1.0));

    // Replica 1 busy: a fuller idle cache beats it (footprints 1.0 / 0.8 / 0.4 of the fullest,
    // weight 2; in flight 0 / 8 / 0 of 8, weight 1).
    let _held = f.hold(1, 8);
    assert_eq!(
        f.pick(&completion("m", "qrstuvwx", None)).await,
        f.endpoint(2)
    );
    assert_eq!(placements(&f, "load_override"), 1.0);
}

#[tokio::test]
async fn new_prompts_spread_over_equal_caches_before_their_events_arrive() {
    let f = fixture(PLACEMENT, 2000).await;
    for i in 0..3 {
        fill(&f, i, 20);
    }
    // Nine new 4-block prompts, no event coming back: each pick counts against its replica.
    let mut per_replica = [0; 3];
    let mut first_home = None;
    for prompt in [
        "aaaa", "bbbb", "cccc", "dddd", "eeee", "ffff", "gggg", "hhhh", "iiii",
    ] {
        let picked = f.pick(&completion("m", &prompt.repeat(4), None)).await;
        first_home.get_or_insert_with(|| picked.clone());
        let i = f
            .endpoints
            .iter()
            .position(|e| *e == picked)
            .expect("a candidate");
        per_replica[i] += 1;
    }
    assert_eq!(per_replica, [3, 3, 3]);
    assert_eq!(placements(&f, "emptiest"), 9.0);
    // A first prompt sent again still goes home. (When picks stop counting is tested beside
    // `Projections`, in paused time: here /tokenize is a real socket.)
    let home = first_home.expect("picked");
    assert_eq!(
        f.pick(&completion("m", &"aaaa".repeat(5), None)).await,
        home
    );
}

/// The placement fixture with engines of 12 blocks, one held each: room (10.8 blocks at the
/// default fill of 0.9) for two 4-block prompts per cache.
async fn small_caches() -> Fixture {
    let f = fixture(PLACEMENT, 2000).await;
    for (i, replica) in f.pool.snapshot().replicas().iter().enumerate() {
        replica.set_cache_blocks(12);
        fill(&f, i, 1);
    }
    f
}

/// Where `f` sent each of the first `n` of nine new 4-block prompts, counted per replica.
async fn place_new_prompts(
    f: &Fixture,
    n: usize,
    mut check: impl FnMut(&[usize; 3]),
) -> [usize; 3] {
    let mut per_replica = [0; 3];
    for prompt in [
        "aaaa", "bbbb", "cccc", "dddd", "eeee", "ffff", "gggg", "hhhh", "iiii",
    ]
    .into_iter()
    .take(n)
    {
        let picked = f.pick(&completion("m", &prompt.repeat(4), None)).await;
        per_replica[f
            .endpoints
            .iter()
            .position(|e| *e == picked)
            .expect("a candidate")] += 1;
        check(&per_replica);
    }
    per_replica
}

#[tokio::test]
async fn once_no_cache_has_room_new_prompts_pack_onto_a_few_instead_of_spreading() {
    let f = small_caches().await;
    let mut per_replica = place_new_prompts(&f, 9, |per_replica| {
        // While any cache has room, the prompts spread: two each before any cache takes a third.
        let placed: usize = per_replica.iter().sum();
        if placed <= 6 {
            assert!(
                per_replica.iter().all(|&n| n <= placed.div_ceil(3)),
                "{per_replica:?}"
            );
        }
    })
    .await;
    // The overflow piled onto one cache (two more there) until it held more than 1.5 even
    // shares; only then another took one, and the third cache kept room for its two.
    per_replica.sort_unstable();
    assert_eq!(per_replica, [2, 3, 4]);
    assert_eq!(
        (placements(&f, "emptiest"), placements(&f, "packed")),
        (6.0, 3.0)
    );
}

#[tokio::test]
async fn while_a_replica_is_down_new_prompts_spread_instead_of_packing() {
    let f = small_caches().await;
    f.pool.snapshot().replicas()[2].set_health(Health::Unhealthy);
    // Room for two each on the two up; the two prompts beyond spread too.
    let per_replica = place_new_prompts(&f, 6, |_| {}).await;
    assert_eq!(per_replica, [3, 3, 0]);
    assert_eq!(
        (placements(&f, "emptiest"), placements(&f, "packed")),
        (6.0, 0.0)
    );
}

/// Replica `i` lists adapter `sql` of base `m`, loaded from `path`.
fn list_sql_adapter(f: &Fixture, i: usize, path: &str) {
    let snapshot = f.pool.snapshot();
    let replica = snapshot.find(f.endpoint(i)).expect("replica");
    let card = |id: &str, root: &str, parent: Option<&str>| ModelCard {
        id: id.into(),
        root: Some(root.into()),
        parent: parent.map(Into::into),
    };
    replica.set_adapters(AdapterCatalog::from_cards(&[
        card("m", "m", None),
        card("sql", path, Some("m")),
    ]));
}

fn adapter_hashes_of(prompt: &str, path: &str) -> Vec<ExternalHash> {
    let tokens: Vec<u32> = prompt.bytes().map(u32::from).collect();
    let keys = RequestKeys {
        lora: Some(LoraKey { name: "sql", path }),
        cache_salt: None,
    };
    let mut out = Vec::new();
    hasher().request_hashes_into(&tokens, keys, &mut out);
    out
}

#[tokio::test]
async fn an_adapter_request_matches_the_blocks_hashed_with_each_replicas_adapter_path() {
    let f = affinity(2000, "0s").await;
    let prompt = "abcdefghijklmnop"; // 4 blocks
    list_sql_adapter(&f, 0, "/other/sql");
    list_sql_adapter(&f, 1, "/adapters/sql");
    list_sql_adapter(&f, 2, "/adapters/sql");
    // Replica 1 holds the base model's blocks of the prompt, replica 2 the adapter's.
    f.index
        .stored(f.endpoint(1), &hashes_of(prompt, None), Medium::Gpu);
    f.index.stored(
        f.endpoint(2),
        &adapter_hashes_of(prompt, "/adapters/sql"),
        Medium::Gpu,
    );
    let request = completion("sql", prompt, None);
    assert_eq!(f.pick(&request).await, f.endpoint(2));
    assert_eq!(f.kv("hit"), 1.0);

    // Replica 0 loaded the adapter from another path, so its engine hashes the prompt otherwise:
    // the whole prompt under its own path beats two blocks under replica 2's.
    f.index.removed(
        f.endpoint(2),
        &adapter_hashes_of(prompt, "/adapters/sql")[2..],
        Medium::Gpu,
    );
    f.index.stored(
        f.endpoint(0),
        &adapter_hashes_of(prompt, "/other/sql"),
        Medium::Gpu,
    );
    assert_eq!(f.pick(&request).await, f.endpoint(0));
    assert_eq!(f.kv("hit"), 2.0);

    // The base model never matches the adapter's blocks: only replica 1's count for it.
    assert_eq!(f.pick(&completion("m", prompt, None)).await, f.endpoint(1));
    assert_eq!(f.kv("hit"), 3.0);
}

#[tokio::test]
async fn an_adapter_no_replica_lists_yet_falls_back_to_the_tree() {
    let f = affinity(2000, "0s").await;
    f.index
        .stored(f.endpoint(1), &hashes_of("zzzz", None), Medium::Gpu);
    f.pick(&completion("sql", "abcdefgh", None)).await;
    assert_eq!(f.kv("unknown_settings"), 1.0);
    assert_eq!(f.tree("miss"), 1.0);
}

/// Adapter-slot filter, adapter affinity, and an in-flight scorer the test can tip.
const ADAPTERS: &str = "
profile:
  filters: [{type: adapter_slots}]
  scorers:
    - {type: adapter_affinity, weight: 1}
    - {type: in_flight, weight: 4}
";

/// Replica `i`'s engine reports `running` adapters in `max_loras` slots.
fn report_slots(f: &Fixture, i: usize, max_loras: u32, running: &[&str]) {
    let snapshot = f.pool.snapshot();
    let replica = snapshot.find(f.endpoint(i)).expect("replica");
    let load = EngineLoad {
        waiting: Some(0.0),
        running: Some(running.len() as f64),
        kv_cache_usage: Some(0.1),
    };
    let slots = AdapterSlots {
        max_loras,
        running: running.iter().map(|a| a.to_string()).collect(),
        waiting: Vec::new(),
    };
    replica.record_scrape_with_adapters(load, Some(slots), tokio::time::Instant::now());
}

#[tokio::test]
async fn adapter_requests_go_where_the_adapter_runs_and_never_wait_for_a_slot_if_avoidable() {
    let f = fixture(ADAPTERS, 2000).await;
    for i in 0..3 {
        list_sql_adapter(&f, i, "/adapters/sql");
    }
    report_slots(&f, 0, 1, &["chat"]); // every slot holds another adapter
    report_slots(&f, 1, 2, &["sql"]); // running here
    report_slots(&f, 2, 2, &["chat"]); // a free slot
    let request = completion("sql", "abcdefgh", None);
    assert_eq!(f.pick(&request).await, f.endpoint(1));
    let picks = |outcome: &str| {
        f.metric(&format!(
            "llmgw_adapter_affinity_total{{outcome=\"{outcome}\"}}"
        ))
    };
    assert_eq!(picks("running"), 1.0);

    // Replica 1 busy: load moves the request to the free slot, never to the full replica 0,
    // however idle it is.
    let _busy = f.hold(1, 4);
    let _also = f.hold(2, 2);
    assert_eq!(f.pick(&request).await, f.endpoint(2));
    assert_eq!(picks("free_slot"), 1.0);

    // Every slot everywhere full of other adapters: all stay candidates (a preference, not a
    // refusal), and load decides.
    report_slots(&f, 1, 1, &["chat"]);
    report_slots(&f, 2, 1, &["chat"]);
    assert_eq!(f.pick(&request).await, f.endpoint(0));
    assert_eq!(picks("full"), 1.0);

    // Base-model requests are not the adapter plugins' business.
    f.pick(&completion("m", "abcdefgh", None)).await;
    assert_eq!(picks("running") + picks("free_slot") + picks("full"), 3.0);
}

const WITH_PLACEMENT: &str = "
profile:
  scorers:
    - type: kv_cache
      parameters: {speculative_ttl: 0s, rebuild_cost: 2}
      fallback: {type: prefix_tree, parameters: {chunk_bytes: 4}}
    - {type: cache_footprint, weight: 1}
    - {type: in_flight, weight: 1}
";

#[tokio::test]
async fn a_holder_that_just_evicted_the_rest_of_the_prompt_leaves_it_to_placement() {
    let f = fixture(WITH_PLACEMENT, 2000).await;
    let prompt = "abcdefghijklmnop"; // 4 blocks
    let blocks = hashes_of(prompt, None);
    let request = completion("m", prompt, None);
    f.index.stored(f.endpoint(2), &blocks, Medium::Gpu);
    f.index.stored(
        f.endpoint(2),
        &hashes_of("qrstuvwxyz012345", None),
        Medium::Gpu,
    );
    f.index
        .stored(f.endpoint(1), &hashes_of("zzzz", None), Medium::Gpu);
    // The routing tree learns that the prompt went to replica 2.
    assert_eq!(f.pick(&request).await, f.endpoint(2));
    assert_eq!(f.kv("hit"), 1.0);

    // Its engine evicts the last block: 3 held, 1 to compute again, still worth going to.
    f.index.removed(f.endpoint(2), &blocks[3..], Medium::Gpu);
    assert_eq!(f.pick(&request).await, f.endpoint(2));
    assert_eq!(f.kv("hit"), 2.0);

    // It evicts the last two: 2 held against 2 to compute again (and as much to evict anew) is
    // worth nothing, so the emptiest cache gets it, not the tree's memory of replica 2.
    f.index.removed(f.endpoint(2), &blocks[2..3], Medium::Gpu);
    assert_ne!(f.pick(&request).await, f.endpoint(2));
    assert_eq!(f.kv("churn_placement"), 1.0);
    assert_eq!(
        f.metric("llmgw_cold_placements_total{decision=\"emptiest\"}"),
        1.0
    );
    assert_eq!(
        f.tree("hit") + f.tree("miss"),
        0.0,
        "the fallback is not asked"
    );

    // Its engine evicts the whole prompt: the index knows it was there and is gone, so the
    // tree's memory of replica 2 is not asked either.
    let before = f.kv("churn_placement");
    f.index.removed(f.endpoint(2), &blocks[..2], Medium::Gpu);
    assert_ne!(f.pick(&request).await, f.endpoint(2));
    assert_eq!(f.kv("churn_placement"), before + 1.0);
    assert_eq!(f.tree("hit") + f.tree("miss"), 0.0);
    f.index.stored(f.endpoint(2), &blocks[..2], Medium::Gpu);

    // Once later evictions have taken their cells in the replica's memory of recent
    // evictions, those blocks are forgotten, and what it holds counts in full again.
    let later: Vec<ExternalHash> = blocks.iter().map(|h| ExternalHash(h.0 ^ 1)).collect();
    f.index.stored(f.endpoint(2), &later, Medium::Gpu);
    f.index.removed(f.endpoint(2), &later, Medium::Gpu);
    assert_eq!(f.pick(&request).await, f.endpoint(2));
    assert_eq!(f.kv("hit"), 3.0);
}

#[tokio::test]
async fn a_new_prompt_is_placed_away_from_caches_that_churn() {
    let f = fixture(WITH_PLACEMENT, 2000).await;
    let fillers = ["0000111122223333", "4444555566667777", "88889999aaaabbbb"];
    for (replica, filler) in fillers.iter().enumerate() {
        f.index
            .stored(f.endpoint(replica), &hashes_of(filler, None), Medium::Gpu);
    }
    // A first cold placement reads every replica's churn (nothing so far).
    f.pick(&completion("m", "alpha beta gamma", None)).await;
    // Replicas 0 and 1 compute again two blocks they had just evicted; replica 2 is calm.
    for replica in [0, 1] {
        let again = &hashes_of(fillers[replica], None)[..2];
        f.index.removed(f.endpoint(replica), again, Medium::Gpu);
        f.index.stored(f.endpoint(replica), again, Medium::Gpu);
    }
    assert_eq!(
        f.pick(&completion("m", "omega psi chi ph", None)).await,
        f.endpoint(2)
    );
    assert_eq!(
        f.metric("llmgw_cold_placements_total{decision=\"emptiest\"}"),
        2.0
    );
}

#[tokio::test]
async fn by_default_churn_is_ignored() {
    let profile = WITH_PLACEMENT.replace(", rebuild_cost: 2", "");
    let f = fixture(&profile, 2000).await;
    let prompt = "abcdefghijklmnop";
    let blocks = hashes_of(prompt, None);
    f.index.stored(f.endpoint(2), &blocks, Medium::Gpu);
    f.index
        .stored(f.endpoint(1), &hashes_of("zzzz", None), Medium::Gpu);
    // Two held against two just evicted: with churn weighed, placement would decide.
    f.index.removed(f.endpoint(2), &blocks[2..], Medium::Gpu);
    assert_eq!(f.pick(&completion("m", prompt, None)).await, f.endpoint(2));
    assert_eq!(f.kv("hit"), 1.0);
    assert_eq!(f.kv("churn_placement"), 0.0);
}

const EVICTED_HOLD: &str = "
profile:
  scorers:
    - type: kv_cache
      parameters: {speculative_ttl: 0sHOLD}
      fallback: {type: prefix_tree, parameters: {chunk_bytes: 4}}
    - {type: cache_footprint, weight: 1}
    - {type: in_flight, weight: 1}
";

/// `hold`: `evicted_hold`'s value; `None`, the default.
async fn evicted_hold(hold: Option<&str>) -> Fixture {
    let parameter = hold.map_or(String::new(), |h| format!(", evicted_hold: {h}"));
    fixture(&EVICTED_HOLD.replace("HOLD", &parameter), 2000).await
}

#[tokio::test]
async fn a_replica_keeps_its_claim_on_the_blocks_of_the_prompt_it_just_evicted() {
    for (hold, winner, decision) in [(Some("1"), 2, "evicted_claim"), (None, 1, "hit")] {
        let f = evicted_hold(hold).await;
        let prompt = "abcdefghijklmnop"; // 4 blocks
        let blocks = hashes_of(prompt, None);
        // Replica 2 held the whole prompt, replica 1 a copy of its first three blocks; then
        // replica 2's engine evicted the last two.
        f.index.stored(f.endpoint(2), &blocks, Medium::Gpu);
        f.index.stored(f.endpoint(1), &blocks[..3], Medium::Gpu);
        f.index.removed(f.endpoint(2), &blocks[2..], Medium::Gpu);
        assert_eq!(
            f.pick(&completion("m", prompt, None)).await,
            f.endpoint(winner),
            "evicted_hold {hold:?}"
        );
        assert_eq!(f.kv(decision), 1.0, "evicted_hold {hold:?}");
    }
}

#[tokio::test]
async fn a_replica_that_holds_the_prompt_wins_a_tie_against_one_that_evicted_it() {
    let f = evicted_hold(Some("1")).await;
    let prompt = "abcdefghijklmnop";
    let blocks = hashes_of(prompt, None);
    // Replica 2 held all four blocks and evicted the last two; replica 1 holds all four.
    f.index.stored(f.endpoint(2), &blocks, Medium::Gpu);
    f.index.removed(f.endpoint(2), &blocks[2..], Medium::Gpu);
    f.index.stored(f.endpoint(1), &blocks, Medium::Gpu);
    assert_eq!(f.pick(&completion("m", prompt, None)).await, f.endpoint(1));
    assert_eq!(f.kv("hit"), 1.0);
    assert_eq!(f.kv("evicted_claim"), 0.0);
}

#[tokio::test]
async fn a_prompt_its_holder_evicted_whole_goes_back_there() {
    for hold in [Some("1"), Some("0")] {
        let f = evicted_hold(hold).await;
        let prompt = "abcdefghijklmnop";
        let blocks = hashes_of(prompt, None);
        // Replica 2 is the fullest cache and evicted the whole prompt moments ago; replica 0
        // is empty, where placement would put a prompt nobody held.
        f.index.stored(f.endpoint(2), &blocks, Medium::Gpu);
        f.index.stored(
            f.endpoint(2),
            &hashes_of("qrstuvwxyz012345", None),
            Medium::Gpu,
        );
        f.index
            .stored(f.endpoint(1), &hashes_of("zzzz", None), Medium::Gpu);
        f.index.removed(f.endpoint(2), &blocks, Medium::Gpu);
        let chosen = f.pick(&completion("m", prompt, None)).await;
        if hold == Some("1") {
            assert_eq!(chosen, f.endpoint(2));
            assert_eq!(f.kv("evicted_claim"), 1.0);
            assert_eq!(f.tree("hit") + f.tree("miss"), 0.0, "the index answered");
        } else {
            assert_eq!(chosen, f.endpoint(0), "placement: the emptiest cache");
            assert_eq!(f.kv("miss"), 1.0);
        }
    }
}

#[tokio::test]
async fn a_prompt_goes_back_to_the_replica_that_lost_it_unless_it_went_on_elsewhere() {
    let f = affinity(2000, "0s").await;
    let prompt = "abcdefghijklmnop"; // 4 blocks
    let blocks = hashes_of(prompt, None);
    // Replica 1 held the prompt and restarted; meanwhile replica 2 computed it.
    f.index.stored(f.endpoint(1), &blocks, Medium::Gpu);
    let lost: Vec<_> = blocks.iter().map(|&h| (h, Medium::Gpu)).collect();
    f.index.lost_blocks(f.endpoint(1), &lost);
    f.index.stored(f.endpoint(2), &blocks, Medium::Gpu);
    // Replica 2 is no better a holder than replica 1 was: the prompt goes home.
    assert_eq!(f.pick(&completion("m", prompt, None)).await, f.endpoint(1));
    assert_eq!(f.kv("homecoming"), 1.0);
    // Once computed at home again, it stays there rather than splitting with the refugee copy.
    f.index.stored(f.endpoint(1), &blocks, Medium::Gpu);
    assert_eq!(f.pick(&completion("m", prompt, None)).await, f.endpoint(1));
    assert_eq!(f.kv("hit"), 1.0);
    // A conversation that went on at replica 2 holds more there than home remembers: it stays.
    let longer = "abcdefghijklmnopqrstuvwx";
    f.index
        .stored(f.endpoint(2), &hashes_of(longer, None)[4..], Medium::Gpu);
    assert_eq!(f.pick(&completion("m", longer, None)).await, f.endpoint(2));
    // Evicted at home after all, the prompt is no longer drawn there.
    f.index.removed(f.endpoint(1), &blocks, Medium::Gpu);
    assert_eq!(f.pick(&completion("m", prompt, None)).await, f.endpoint(2));
    assert_eq!(f.kv("homecoming"), 1.0);
}

#[tokio::test]
async fn a_cache_restated_by_a_snapshot_is_no_home() {
    let f = affinity(2000, "0s").await;
    let prompt = "abcdefghijklmnop";
    let blocks = hashes_of(prompt, None);
    f.index.stored(f.endpoint(1), &blocks, Medium::Gpu);
    f.index.cleared(f.endpoint(1));
    f.index.stored(f.endpoint(2), &blocks, Medium::Gpu);
    assert_eq!(f.pick(&completion("m", prompt, None)).await, f.endpoint(2));
    assert_eq!(f.kv("homecoming"), 0.0);
}

/// `kv_cache` against in-flight load, weighed so that one request in flight on the holder
/// decides a tie of copies but not its full match against none, and eight outvote its match.
const LENDING: &str = "
profile:
  scorers:
    - type: kv_cache
      parameters: {speculative_ttl: 0s, lend_memory: MEMORY}
      fallback: {type: prefix_tree, parameters: {chunk_bytes: 4}}
    - {type: in_flight, weight: 4}
";

/// Replica 1 holds a 4-block prompt alone; load sends it elsewhere, whose engine computes it.
/// Returns the replica it was lent to.
async fn lend_from_replica_1(f: &Fixture, prompt: &str) -> usize {
    f.index
        .stored(f.endpoint(1), &hashes_of(prompt, None), Medium::Gpu);
    let busy = f.hold(1, 8);
    let borrower = f.pick(&completion("m", prompt, None)).await;
    drop(busy);
    assert_ne!(borrower, f.endpoint(1));
    assert_eq!(f.kv("load_override"), 1.0);
    let borrower = (0..3)
        .find(|&i| f.endpoint(i) == borrower)
        .expect("a replica");
    f.index
        .stored(f.endpoint(borrower), &hashes_of(prompt, None), Medium::Gpu);
    borrower
}

#[tokio::test]
async fn a_tenants_prompts_return_to_the_replica_that_lent_one_under_load() {
    let f = fixture(&LENDING.replace("MEMORY", "60s"), 2000).await;
    let lent = "abcdefghijklmnop";
    let borrower = lend_from_replica_1(&f, lent).await;
    // Both hold the tenant's first three blocks and the holder is a little busier: the copy is
    // a loan, and the tenant's next prompt goes back to the holder.
    let _one = f.hold(1, 1);
    assert_eq!(
        f.pick(&completion("m", "abcdefghijklyyyy", None)).await,
        f.endpoint(1)
    );
    assert_eq!(f.kv("reclaim"), 1.0);
    // The lent conversation's next turn (the whole lent prompt and more) goes on at the
    // borrower: sending it back would compute each turn on alternate replicas.
    assert_eq!(
        f.pick(&completion("m", "abcdefghijklmnopqrst", None)).await,
        f.endpoint(borrower)
    );
    assert_eq!(f.kv("reclaim"), 1.0);
    // The holder's crowded cache evicted part of the shared blocks meanwhile: the lend stands,
    // and the holder computes them again rather than leaving the tenant on the copy.
    let third = &hashes_of(lent, None)[2..3];
    f.index.removed(f.endpoint(1), third, Medium::Gpu);
    assert_eq!(
        f.pick(&completion("m", "abcdefghijklxxxx", None)).await,
        f.endpoint(1)
    );
    assert_eq!(f.kv("reclaim"), 2.0);
    f.index.stored(f.endpoint(1), third, Medium::Gpu);
    // Lent again within the memory: the prompts are hot and the copy stands.
    let busy = f.hold(1, 8);
    assert_ne!(
        f.pick(&completion("m", "abcdefghijklwwww", None)).await,
        f.endpoint(1)
    );
    assert_eq!(f.kv("load_override"), 2.0);
    drop(busy);
    assert_eq!(
        f.pick(&completion("m", "abcdefghijklvvvv", None)).await,
        f.endpoint(borrower)
    );
    assert_eq!(f.kv("reclaim"), 2.0);
}

#[tokio::test]
async fn without_lend_memory_a_copy_made_under_load_keeps_the_prompt() {
    let f = fixture(&LENDING.replace("MEMORY", "0s"), 2000).await;
    let borrower = lend_from_replica_1(&f, "abcdefghijklmnop").await;
    let _one = f.hold(1, 1);
    assert_eq!(
        f.pick(&completion("m", "abcdefghijklyyyy", None)).await,
        f.endpoint(borrower)
    );
    assert_eq!(f.kv("reclaim"), 0.0);
}

#[tokio::test]
async fn a_lend_does_not_draw_prompts_to_a_holder_of_shared_blocks_alone() {
    let f = fixture(&LENDING.replace("MEMORY", "60s"), 2000).await;
    // Every replica holds the first block (a system prompt all tenants share); replica 1 alone
    // holds the rest of the lent prompt.
    let shared = &hashes_of("abcd", None);
    for i in 0..3 {
        f.index.stored(f.endpoint(i), shared, Medium::Gpu);
    }
    let prompt = "abcdefghijklmnop";
    lend_from_replica_1(&f, prompt).await;
    // A new tenant's prompt matches only the shared block: the lend has no say.
    let _one = f.hold(1, 1);
    assert_ne!(
        f.pick(&completion("m", "abcdyyyyyyyy", None)).await,
        f.endpoint(1)
    );
    assert_eq!(f.kv("reclaim"), 0.0);
}

#[tokio::test]
async fn a_prefix_copied_to_several_replicas_is_spread_and_no_lend_gathers_it() {
    let f = fixture(&LENDING.replace("MEMORY", "60s"), 2000).await;
    let lent = "abcdefghijklmnop";
    let borrower = lend_from_replica_1(&f, lent).await;
    // A hot tenant: load spread its prefix to the third replica as well.
    let third = (0..3)
        .find(|&i| i != 1 && i != borrower)
        .expect("a third replica");
    f.index
        .stored(f.endpoint(third), &hashes_of(lent, None), Medium::Gpu);
    let _one = f.hold(1, 1);
    assert_ne!(
        f.pick(&completion("m", "abcdefghijklyyyy", None)).await,
        f.endpoint(1)
    );
    assert_eq!(f.kv("reclaim"), 0.0);
}

/// Tells `to` every pick `from` published since `picks` subscribed, as peering would.
fn relay(picks: &mut tokio::sync::broadcast::Receiver<Arc<PeerPick>>, to: &Fixture) -> usize {
    let listeners = to.scheduler.pick_listeners();
    let mut relayed = 0;
    while let Ok(pick) = picks.try_recv() {
        listeners.peer_picked(&pick);
        relayed += 1;
    }
    relayed
}

#[tokio::test]
async fn a_peer_routers_picks_count_as_this_routers_own() {
    let a = fixture(PLACEMENT, 2000).await;
    let b = a.peer();
    for i in 0..3 {
        fill(&a, i, 20);
    }
    let mut from_a = a.picks.subscribe();
    // Router A places a new prompt; router B hears of it before any engine event.
    let first = completion("m", &"aaaa".repeat(4), None);
    let home = a.pick(&first).await;
    // Three messages: the KV index's blocks (from `kv_cache`), the text (from its fallback,
    // `prefix_tree`, which records every pick) and the placement (from `cache_footprint`).
    assert_eq!(relay(&mut from_a, &b), 3);
    // B sends the same prompt after it (a speculative hit, as if B had picked it) ...
    assert_eq!(b.pick(&first).await, home);
    assert_eq!(b.kv("hit"), 1.0);
    // ... and counts what A's pick is about to store there: two more new prompts from B go
    // to the two other caches, as one router would have spread the three.
    let mut homes = vec![home.clone()];
    for prompt in ["bbbb", "cccc"] {
        homes.push(b.pick(&completion("m", &prompt.repeat(4), None)).await);
    }
    homes.sort();
    homes.dedup();
    assert_eq!(homes.len(), 3, "one prompt per cache: {homes:?}");
}

#[tokio::test]
async fn a_peer_routers_placements_count_toward_each_caches_share() {
    let a = counting_placements_only().await;
    let (b, c) = (a.peer(), a.peer());
    no_room_but_fullest(&a, 0);
    let mut from_a = a.picks.subscribe();
    // No cache has room for a 4-block prompt: router A packs the first onto the fullest.
    assert_eq!(
        a.pick(&completion("m", &"aaaa".repeat(4), None)).await,
        a.endpoint(0)
    );
    assert_eq!(relay(&mut from_a, &b), 3);
    // B counts A's placement as its own: a second there would pass 1.5 even shares of two
    // (2 > 1), so B's new prompt goes to another cache, as one router's would.
    let next = completion("m", &"bbbb".repeat(4), None);
    assert_ne!(b.pick(&next).await, a.endpoint(0));
    // C, not peered, counts nothing and packs it onto the fullest too.
    assert_eq!(c.pick(&next).await, a.endpoint(0));
}

#[tokio::test]
async fn a_prompt_placed_before_any_engine_reported_counts_toward_its_caches_share() {
    let a = counting_placements_only().await;
    let b = a.peer();
    let mut from_a = a.picks.subscribe();
    // No engine has reported an event: `cache_footprint` has nothing to weigh, and the first
    // tenant's prompt goes where load and the tie-break send it.
    let home = a.pick(&completion("m", &"aaaa".repeat(4), None)).await;
    let home_index = a
        .endpoints
        .iter()
        .position(|e| *e == home)
        .expect("a candidate");
    assert_eq!(placements(&a, "no_events"), 1.0);
    // Its placement reaches the peer router too (the prefix tree's text and the placement).
    assert_eq!(relay(&mut from_a, &b), 2);
    // Then the engines report: no cache has room for another 4-block prompt, and the first
    // tenant's home is the fullest.
    no_room_but_fullest(&a, home_index);
    // A second tenant there would pass 1.5 even shares of the two placements (2 > 1): it
    // goes to another cache, on either router, as it would have had the first placement been
    // weighed.
    let next = completion("m", &"bbbb".repeat(4), None);
    assert_ne!(a.pick(&next).await, home);
    assert_ne!(b.pick(&next).await, home);
    // A router that heard of no placement packs it onto the fullest.
    assert_eq!(a.peer().pick(&next).await, home);
}

#[tokio::test]
async fn caches_known_to_be_empty_take_the_first_prompts_one_each() {
    let f = fixture(PLACEMENT, 2000).await;
    // The agents' snapshots: every engine reports, none holds a block yet.
    for (i, replica) in f.pool.snapshot().replicas().iter().enumerate() {
        replica.set_cache_blocks(100);
        f.index.reporting(f.endpoint(i));
    }
    // Three new prompts are weighed, not left to load: each goes to a cache none of the others
    // is about to fill.
    let mut homes = HashSet::new();
    for tenant in ["aaaa", "bbbb", "cccc"] {
        homes.insert(f.pick(&completion("m", &tenant.repeat(4), None)).await);
    }
    assert_eq!(homes.len(), 3, "{homes:?}");
    assert_eq!(placements(&f, "emptiest"), 3.0);
    assert_eq!(placements(&f, "no_events"), 0.0);
}

#[tokio::test]
async fn without_peering_a_second_router_misses_the_firsts_pick() {
    let a = fixture(PLACEMENT, 2000).await;
    let b = a.peer();
    for i in 0..3 {
        fill(&a, i, 20);
    }
    let first = completion("m", &"aaaa".repeat(4), None);
    a.pick(&first).await;
    b.pick(&first).await;
    assert_eq!(b.kv("hit"), 0.0, "B knows nothing of A's pick");
    assert_eq!(b.kv("index_miss") + b.kv("miss"), 1.0);
}

#[tokio::test]
async fn a_peers_requests_in_flight_weigh_as_load() {
    let f = affinity(2000, "2s").await;
    let prompt = "abcdefghijklmnop";
    f.index
        .stored(f.endpoint(2), &hashes_of(prompt, None), Medium::Gpu);
    let request = completion("m", prompt, None);
    assert_eq!(f.pick(&request).await, f.endpoint(2));
    // The peer routers have 8 requests in flight at replica 2: the in-flight scorer (weight
    // 10) outvotes its match, as it does for this router's own 8.
    let snapshot = f.pool.snapshot();
    let replica = snapshot.find(f.endpoint(2)).expect("replica");
    replica.set_peer_in_flight(8);
    assert_ne!(f.pick(&request).await, f.endpoint(2));
    assert_eq!(f.kv("load_override"), 1.0);
}

/// The prefix tree alone, with load: the tree-only routing a router without agents does.
const TREE_AND_LOAD: &str = "
profile:
  scorers:
    - {type: prefix_tree, parameters: {chunk_bytes: 4}}
    - {type: in_flight, weight: 1}
";

#[tokio::test]
async fn a_peer_routers_text_goes_into_this_routers_prefix_tree() {
    let a = fixture(TREE_AND_LOAD, 2000).await;
    let (b, c) = (a.peer(), a.peer());
    let mut from_a = a.picks.subscribe();
    // Router A sends the prompt to replica 1, the only idle one.
    let request = completion("m", "abcdefghijklmnop", None);
    let held = [a.hold(0, 1), a.hold(2, 1)];
    assert_eq!(a.pick(&request).await, a.endpoint(1));
    drop(held);
    // B heard of it and sends the prompt after it, a tree hit; C, not peered, has no idea.
    assert_eq!(relay(&mut from_a, &b), 1);
    assert_eq!(b.pick(&request).await, a.endpoint(1));
    assert_eq!(b.tree("hit"), 1.0);
    c.pick(&request).await;
    assert_eq!(c.tree("hit"), 0.0);
    assert_eq!(c.tree("miss"), 1.0);
}
