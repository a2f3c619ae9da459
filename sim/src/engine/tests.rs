use std::num::NonZeroUsize;

use llmgw::blockhash::HashSettings;
use tokio::time::Instant;

use super::*;

fn config(num_blocks: usize, latency: LatencyModel) -> EngineConfig {
    EngineConfig {
        num_blocks,
        max_num_seqs: 8,
        prefix_caching: true,
        kv_events: true,
        latency,
        output_len: 4,
        hasher: BlockHasher::new(&HashSettings::sha256_cbor(
            NonZeroUsize::new(16).unwrap(),
            Some("1729"),
        ))
        .unwrap(),
        vocab: (100..200).collect::<Vec<u32>>().into(),
        data_parallel_rank: 0,
        max_loras: None,
    }
}

const MS: Duration = Duration::from_millis(1);

fn latency() -> LatencyModel {
    LatencyModel {
        prefill_per_token: MS,
        decode_per_step: MS * 10,
        step_overhead: Duration::ZERO,
    }
}

struct Run {
    first_token_after: Duration,
    total: Duration,
    tokens: Vec<u32>,
    finished: Finished,
}

async fn run(
    engine: &EngineHandle,
    prompt: Vec<u32>,
    max_tokens: usize,
    salt: Option<&str>,
) -> Run {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let start = Instant::now();
    engine
        .submit(Submit {
            prompt,
            max_tokens,
            cache_salt: salt.map(str::to_owned),
            lora: None,
            out: tx,
        })
        .unwrap();
    let mut first = None;
    let mut tokens = Vec::new();
    loop {
        match rx.recv().await.unwrap() {
            Output::Token(t) => {
                first.get_or_insert(start.elapsed());
                tokens.push(t);
            }
            Output::Finished(f) => {
                return Run {
                    first_token_after: first.unwrap(),
                    total: start.elapsed(),
                    tokens,
                    finished: f,
                };
            }
            Output::Failed(msg) => panic!("failed: {msg}"),
        }
    }
}

fn batches(rx: &mut mpsc::Receiver<EngineEvent>) -> Vec<EventBatch> {
    let mut out = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        match ev {
            EngineEvent::Batch(b) => out.push(b),
            EngineEvent::Restart => panic!("unexpected restart"),
        }
    }
    out
}

fn stored(batches: &[EventBatch]) -> Vec<u64> {
    batches
        .iter()
        .flat_map(|b| &b.events)
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s.block_hashes.iter().map(|d| d.external().0)),
            _ => None,
        })
        .flatten()
        .collect()
}

#[tokio::test(start_paused = true)]
async fn cached_prefix_cuts_time_to_first_token() {
    let engine = Engine::spawn(config(64, latency()), None);
    let prompt: Vec<u32> = (0..320).collect();
    let cold = run(&engine, prompt.clone(), 4, None).await;
    // 320 uncached tokens × 1 ms + one 10 ms decode step.
    assert_eq!(cold.first_token_after, MS * 330);
    assert_eq!(cold.finished.cached_tokens, 0);
    // Three more decode steps.
    assert_eq!(cold.total, MS * 360);

    let warm = run(&engine, prompt.clone(), 4, None).await;
    // vLLM never hits the whole prompt: 19 of 20 blocks (304 tokens) are hits.
    assert_eq!(warm.finished.cached_tokens, 304);
    assert_eq!(warm.first_token_after, MS * (16 + 10));
    assert_eq!(warm.tokens, cold.tokens, "same prompt, same answer");

    let salted = run(&engine, prompt, 4, Some("tenant-a")).await;
    assert_eq!(
        salted.finished.cached_tokens, 0,
        "a salt never shares blocks"
    );
    let stats = engine.stats();
    assert_eq!(stats.prefix_cache_queries, 960);
    assert_eq!(stats.prefix_cache_hits, 304);
}

#[tokio::test(start_paused = true)]
async fn stores_exactly_the_blockhash_chain_then_generated_blocks() {
    let (tx, mut rx) = mpsc::channel(64);
    let cfg = config(64, LatencyModel::default());
    let hasher = cfg.hasher.clone();
    let engine = Engine::spawn(cfg, Some(tx));
    // 40 tokens: 2 full prompt blocks. max_tokens 30 but output_len 4 → "stop" after 4.
    let prompt: Vec<u32> = (0..40).collect();
    let r = run(&engine, prompt.clone(), 30, None).await;
    assert_eq!(r.finished.reason, FinishReason::Stop);
    assert_eq!(r.finished.completion_tokens, 4);
    let expected: Vec<u64> = hasher
        .prompt_blocks(&prompt, None)
        .map(|d| d.external().0)
        .collect();
    assert_eq!(expected, vec![11226395625952643563, 16132170753569463687]);
    let got = batches(&mut rx);
    assert_eq!(
        stored(&got),
        expected,
        "44 tokens computed at most: no third block"
    );
    assert_eq!(engine.cached_hashes().await.unwrap(), {
        let mut e = expected.clone();
        e.sort_unstable();
        e
    });

    // 30 prompt tokens + 4 generated: the block 16..32 fills with generated tokens, and is
    // cached one step after its last token is sampled.
    let prompt: Vec<u32> = (1000..1030).collect();
    let r = run(&engine, prompt.clone(), 4, None).await;
    assert_eq!(r.finished.reason, FinishReason::Length);
    let got = batches(&mut rx);
    let all: Vec<u32> = prompt
        .iter()
        .copied()
        .chain(r.tokens.iter().copied())
        .collect();
    let chain: Vec<u64> = hasher
        .prompt_blocks(&all[..32], None)
        .map(|d| d.external().0)
        .collect();
    assert_eq!(stored(&got), chain);
    let KvEvent::BlockStored(second) = &got[1].events[0] else {
        panic!("expected BlockStored");
    };
    assert_eq!(
        second.parent_block_hash.map(|d| d.external().0),
        Some(chain[0])
    );
    assert_eq!(second.token_ids, all[16..32]);
}

#[tokio::test(start_paused = true)]
async fn eviction_is_lru_and_published_as_removals() {
    let (tx, mut rx) = mpsc::channel(64);
    // 8 usable blocks of 16 tokens.
    let engine = Engine::spawn(config(9, LatencyModel::default()), Some(tx));
    let a: Vec<u32> = (0..64).collect(); // 4 blocks (+1 for generation)
    let b: Vec<u32> = (100..164).collect();
    run(&engine, a.clone(), 1, None).await;
    let a_hashes = stored(&batches(&mut rx));
    assert_eq!(a_hashes.len(), 4);
    run(&engine, b, 1, None).await;
    let got = batches(&mut rx);
    let removed: Vec<u64> = got
        .iter()
        .flat_map(|b| &b.events)
        .filter_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes, .. } => Some(block_hashes[0].external().0),
            _ => None,
        })
        .collect();
    // b needs 5 blocks; 4 are free and never used, so a's last block is evicted first.
    assert_eq!(removed, vec![a_hashes[3]]);
    let cached = engine.cached_hashes().await.unwrap();
    assert!(cached.contains(&a_hashes[0]) && !cached.contains(&a_hashes[3]));
    assert!(engine.stats().kv_cache_usage == 0.0);
}

#[tokio::test(start_paused = true)]
async fn batch_limit_queues_requests_and_reset_clears_on_the_next_step() {
    let (tx, mut rx) = mpsc::channel(64);
    let mut cfg = config(64, latency());
    cfg.max_num_seqs = 1;
    let engine = Engine::spawn(cfg, Some(tx));
    let e2 = engine.clone();
    let first = tokio::spawn(async move { run(&e2, (0..32).collect(), 4, None).await });
    tokio::task::yield_now().await;
    let second = run(&engine, (500..532).collect(), 4, None).await;
    let first = first.await.unwrap();
    // The second waited for the first to finish (32 ms prefill + 4 × 10 ms decode).
    assert!(
        second.first_token_after >= first.total,
        "{:?} vs {:?}",
        second.first_token_after,
        first.total
    );
    batches(&mut rx);
    assert!(engine.reset_prefix_cache().await.unwrap());
    assert!(engine.cached_hashes().await.unwrap().is_empty());
    assert!(
        batches(&mut rx).is_empty(),
        "AllBlocksCleared waits for a step"
    );
    run(&engine, (0..8).collect(), 1, None).await;
    let got = batches(&mut rx);
    assert_eq!(got[0].events, vec![KvEvent::AllBlocksCleared]);
}

#[tokio::test(start_paused = true)]
async fn restart_fails_requests_in_flight_and_empties_the_cache() {
    let (tx, mut rx) = mpsc::channel(64);
    let engine = Engine::spawn(config(64, latency()), Some(tx));
    run(&engine, (0..32).collect(), 1, None).await;
    assert_eq!(engine.cached_hashes().await.unwrap().len(), 2);
    let (otx, mut orx) = mpsc::unbounded_channel();
    engine
        .submit(Submit {
            prompt: (0..200).collect(),
            max_tokens: 4,
            cache_salt: None,
            lora: None,
            out: otx,
        })
        .unwrap();
    tokio::time::sleep(MS).await;
    engine.restart().unwrap();
    let mut failed = false;
    while let Some(o) = orx.recv().await {
        failed |= matches!(o, Output::Failed(_));
    }
    assert!(failed);
    assert!(engine.cached_hashes().await.unwrap().is_empty());
    let mut saw_restart = false;
    while let Ok(ev) = rx.try_recv() {
        saw_restart |= matches!(ev, EngineEvent::Restart);
    }
    assert!(saw_restart);
    assert_eq!(engine.stats().prefix_cache_queries, 0);
}

#[tokio::test(start_paused = true)]
async fn stall_delays_the_next_step() {
    let engine = Engine::spawn(config(64, LatencyModel::default()), None);
    engine.stall(MS * 500).unwrap();
    let r = run(&engine, (0..8).collect(), 1, None).await;
    assert!(r.first_token_after >= MS * 499, "{:?}", r.first_token_after);
}

fn adapter(id: u32, name: &str) -> Arc<LoraAdapter> {
    Arc::new(LoraAdapter {
        id,
        name: name.into(),
        path: format!("/adapters/{name}"),
        base_model_name: None,
    })
}

fn submit(
    engine: &EngineHandle,
    prompt: Vec<u32>,
    max_tokens: usize,
    salt: Option<&str>,
    lora: Option<&Arc<LoraAdapter>>,
) -> mpsc::UnboundedReceiver<Output> {
    let (tx, rx) = mpsc::unbounded_channel();
    engine
        .submit(Submit {
            prompt,
            max_tokens,
            cache_salt: salt.map(str::to_owned),
            lora: lora.cloned(),
            out: tx,
        })
        .unwrap();
    rx
}

/// Reads a request's outputs to the end: its tokens and how it finished.
async fn finish(rx: &mut mpsc::UnboundedReceiver<Output>) -> (Vec<u32>, Finished) {
    let mut tokens = Vec::new();
    loop {
        match rx.recv().await.unwrap() {
            Output::Token(t) => tokens.push(t),
            Output::Finished(f) => return (tokens, f),
            Output::Failed(msg) => panic!("failed: {msg}"),
        }
    }
}

fn stored_events(batches: &[EventBatch]) -> Vec<&BlockStored> {
    batches
        .iter()
        .flat_map(|b| &b.events)
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s),
            _ => None,
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn lora_blocks_hash_the_adapter_into_every_block_and_publish_it() {
    use llmgw::blockhash::{LoraKey, RequestKeys};

    let (tx, mut rx) = mpsc::channel(64);
    let mut cfg = config(64, LatencyModel::default());
    cfg.max_loras = Some(2);
    let hasher = cfg.hasher.clone();
    let engine = Engine::spawn(cfg, Some(tx));
    let sql = adapter(1, "sql");
    let key = LoraKey {
        name: "sql",
        path: "/adapters/sql",
    };
    // 30 prompt tokens + 4 generated: block 0 from the prompt, block 1 filled by generation.
    let prompt: Vec<u32> = (0..30).collect();
    let mut out = submit(&engine, prompt.clone(), 4, Some("tenant-a"), Some(&sql));
    let (generated, _) = finish(&mut out).await;
    let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
    let keys = RequestKeys {
        lora: Some(key),
        cache_salt: Some("tenant-a"),
    };
    let expected: Vec<u64> = hasher
        .request_blocks(&all[..32], keys)
        .map(|d| d.external().0)
        .collect();
    let got = batches(&mut rx);
    assert_eq!(
        stored(&got),
        expected,
        "prompt block, then the generated one"
    );
    let base: Vec<u64> = hasher
        .prompt_blocks(&all[..32], Some("tenant-a"))
        .map(|d| d.external().0)
        .collect();
    assert!(
        expected.iter().all(|h| !base.contains(h)),
        "an adapter's blocks never match the base model's"
    );
    let events = stored_events(&got);
    for s in &events {
        assert_eq!(s.lora().map(|a| (a.id, a.name.as_str())), Some((1, "sql")));
    }
    let published = |s: &BlockStored| -> Vec<Option<Vec<String>>> {
        s.extra_keys
            .iter()
            .flatten()
            .map(|k| {
                k.as_ref()
                    .map(|k| k.iter().map(|x| x.published().to_owned()).collect())
            })
            .collect()
    };
    assert_eq!(
        published(events[0]),
        vec![Some(vec!["sql".to_owned(), "tenant-a".to_owned()])]
    );
    assert_eq!(published(events[1]), vec![Some(vec!["sql".to_owned()])]);

    // On the wire, as the agent reads it.
    let batch = crate::events::EventBatch {
        ts: 1.0,
        events: got.iter().flat_map(|b| b.events.clone()).collect(),
        data_parallel_rank: Some(0),
    };
    let decoded =
        llmgw_agent::wire::decode_batch(&batch.encode(crate::events::Encoding::default())).unwrap();
    for event in &decoded.events {
        let llmgw_agent::wire::KvEvent::BlockStored(b) = event else {
            panic!("BlockStored expected, got {event:?}");
        };
        assert_eq!((b.lora_id, b.lora_name.as_deref()), (Some(1), Some("sql")));
    }

    // The same prompt on the base model or another adapter hits none of them; on the same
    // adapter it does.
    let mut out = submit(&engine, all.clone(), 1, Some("tenant-a"), None);
    assert_eq!(finish(&mut out).await.1.cached_tokens, 0);
    let other = adapter(2, "chat");
    let mut out = submit(&engine, all.clone(), 1, Some("tenant-a"), Some(&other));
    assert_eq!(finish(&mut out).await.1.cached_tokens, 0);
    let mut out = submit(&engine, all.clone(), 1, Some("tenant-a"), Some(&sql));
    assert_eq!(finish(&mut out).await.1.cached_tokens, 32);
    for s in stored_events(&batches(&mut rx)) {
        match s.lora() {
            None => assert_eq!(
                published(s).first().cloned().flatten(),
                Some(vec!["tenant-a".to_owned()]),
                "a salted base block 0 publishes [SALT]"
            ),
            Some(a) => assert_eq!(a.name, "chat"),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn max_loras_holds_back_a_second_adapter_until_the_first_finishes() {
    let mut cfg = config(64, latency());
    cfg.max_loras = Some(1);
    let engine = Engine::spawn(cfg, None);
    let (a, b) = (adapter(1, "a"), adapter(2, "b"));
    let mut ra = submit(&engine, (0..20).collect(), 4, None, Some(&a));
    let mut rb = submit(&engine, (100..120).collect(), 4, None, Some(&b));
    let mut rc = submit(&engine, (200..220).collect(), 4, None, None);

    // The first step ran a and, past b, the base-model request c.
    assert!(matches!(ra.recv().await, Some(Output::Token(_))));
    assert!(matches!(rc.recv().await, Some(Output::Token(_))));
    assert!(
        rb.try_recv().is_err(),
        "b waits while a holds the only slot"
    );
    let stats = engine.stats();
    assert_eq!((stats.running, stats.waiting), (2, 1));
    let latest = |engine: &EngineHandle| {
        engine
            .lora_info()
            .into_iter()
            .max_by(|x, y| x.value.total_cmp(&y.value))
            .unwrap()
    };
    let info = latest(&engine);
    // vLLM ≥ 0.30 names every adapter with a request in both labels.
    assert_eq!(
        (info.running.as_str(), info.waiting.as_str()),
        ("a,b", "a,b")
    );

    let (_, fa) = finish(&mut ra).await;
    assert_eq!(fa.completion_tokens, 4);
    assert!(
        rb.try_recv().is_err(),
        "b has not started in the step a finished in"
    );
    let (tokens, fb) = finish(&mut rb).await;
    assert_eq!((tokens.len(), fb.completion_tokens), (4, 4));
    finish(&mut rc).await;
    let info = latest(&engine);
    assert_eq!((info.running.as_str(), info.waiting.as_str()), ("", ""));
    assert!(
        engine
            .lora_info()
            .iter()
            .any(|s| s.running == "b" && s.waiting == "b"),
        "b alone once a finished: {:?}",
        engine.lora_info()
    );
}

#[tokio::test(start_paused = true)]
async fn without_lora_there_is_no_lora_info_and_no_slot_limit() {
    let engine = Engine::spawn(config(64, LatencyModel::default()), None);
    let (a, b) = (adapter(1, "a"), adapter(2, "b"));
    let mut ra = submit(&engine, (0..20).collect(), 2, None, Some(&a));
    let mut rb = submit(&engine, (100..120).collect(), 2, None, Some(&b));
    assert!(matches!(ra.recv().await, Some(Output::Token(_))));
    assert!(matches!(rb.try_recv(), Ok(Output::Token(_))), "same step");
    finish(&mut ra).await;
    finish(&mut rb).await;
    assert!(engine.lora_info().is_empty());
}
