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
