use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use tokio::time::Instant;

use super::*;

fn h(v: u64) -> ExternalHash {
    ExternalHash(v)
}

fn hashes(vs: &[u64]) -> Vec<ExternalHash> {
    vs.iter().copied().map(ExternalHash).collect()
}

/// `vs` on the GPU tier, as a loss lists them.
fn gpu(vs: &[u64]) -> Vec<(ExternalHash, Medium)> {
    vs.iter().map(|&v| (h(v), Medium::Gpu)).collect()
}

fn matches(index: &KvIndex, prompt: &[u64], replicas: &[&str]) -> Vec<u32> {
    let candidates: Vec<_> = replicas.iter().map(|r| index.slot(r)).collect();
    let mut out = Vec::new();
    index.match_prefix(&hashes(prompt), &candidates, &mut out);
    out.iter().map(|m| m.blocks).collect()
}

#[test]
fn leading_blocks_per_replica() {
    let index = KvIndex::new(IndexConfig::default());
    index.stored("a:1", &hashes(&[1, 2, 3]), Medium::Gpu);
    index.stored("b:1", &hashes(&[1, 2]), Medium::Gpu);
    index.stored("c:1", &hashes(&[2, 3]), Medium::Gpu);
    assert_eq!(
        matches(&index, &[1, 2, 3, 4], &["a:1", "b:1", "c:1", "unknown:1"]),
        vec![3, 2, 0, 0]
    );
    // A hole stops the match even if later blocks are held.
    index.removed("a:1", &hashes(&[2]), Medium::Gpu);
    assert_eq!(matches(&index, &[1, 2, 3], &["a:1", "b:1"]), vec![1, 2]);
}

#[test]
fn duplicates_need_as_many_removes() {
    let index = KvIndex::new(IndexConfig::default());
    index.stored("a:1", &hashes(&[7]), Medium::Gpu);
    index.stored("a:1", &hashes(&[7]), Medium::Gpu);
    assert_eq!(index.replica_block_count("a:1"), 1);
    index.removed("a:1", &hashes(&[7]), Medium::Gpu);
    assert_eq!(matches(&index, &[7], &["a:1"]), vec![1]);
    index.removed("a:1", &hashes(&[7]), Medium::Gpu);
    assert_eq!(matches(&index, &[7], &["a:1"]), vec![0]);
    assert_eq!(index.distinct_blocks(), 0);
    assert_eq!(index.replica_block_count("a:1"), 0);
}

#[test]
fn copies_are_applied_as_counts_and_saturate_without_expanding() {
    let index = KvIndex::new(IndexConfig::default());
    index.stored_copies("a:1", &[(h(7), 3), (h(8), 0)], Medium::Gpu);
    assert_eq!(
        index.replica_block_count("a:1"),
        1,
        "a pair with no copies is ignored"
    );
    index.removed_copies("a:1", &[(h(7), 2)], Medium::Gpu);
    assert_eq!(
        matches(&index, &[7], &["a:1"]),
        vec![1],
        "one copy of three is left"
    );
    index.removed_copies("a:1", &[(h(7), 1)], Medium::Gpu);
    assert_eq!(matches(&index, &[7], &["a:1"]), vec![0]);

    // A count from the wire near u32::MAX costs one holder: it saturates, and as many
    // removals take it out again.
    index.stored_copies("a:1", &[(h(9), u32::MAX), (h(9), u32::MAX)], Medium::Gpu);
    assert_eq!(index.replica_block_count("a:1"), 1);
    assert_eq!(index.distinct_blocks(), 1);
    index.removed_copies("a:1", &[(h(9), u32::MAX)], Medium::Gpu);
    assert_eq!(index.replica_block_count("a:1"), 0);
    assert_eq!(index.distinct_blocks(), 0);
}

#[test]
fn offloaded_blocks_count_with_their_weight() {
    let index = KvIndex::new(IndexConfig {
        offloaded_weight: 0.25,
        ..IndexConfig::default()
    });
    index.stored("a:1", &hashes(&[1, 2]), Medium::Gpu);
    index.stored("a:1", &hashes(&[2, 3]), Medium::Offloaded);
    let mut out = Vec::new();
    index.match_prefix(&hashes(&[1, 2, 3]), &[index.slot("a:1")], &mut out);
    assert_eq!(out[0].blocks, 3);
    assert!((out[0].weighted - 2.25).abs() < 1e-6, "{:?}", out[0]);
    // Removing the GPU copy of block 2 leaves the offloaded one.
    index.removed("a:1", &hashes(&[2]), Medium::Gpu);
    index.match_prefix(&hashes(&[1, 2, 3]), &[index.slot("a:1")], &mut out);
    assert_eq!(out[0].blocks, 3);
    assert!((out[0].weighted - 1.5).abs() < 1e-6, "{:?}", out[0]);
}

#[test]
fn clear_forgets_one_replica_only() {
    let index = KvIndex::new(IndexConfig::default());
    index.stored("a:1", &hashes(&[1, 2]), Medium::Gpu);
    index.stored("b:1", &hashes(&[1, 2]), Medium::Gpu);
    index.cleared("a:1");
    assert_eq!(matches(&index, &[1, 2], &["a:1", "b:1"]), vec![0, 2]);
    assert!(index.replica_blocks("a:1").is_empty());
    assert_eq!(index.replica_blocks("b:1"), hashes(&[1, 2]));
}

#[test]
fn over_the_cap_the_oldest_blocks_go_first() {
    let index = KvIndex::new(IndexConfig {
        max_blocks_per_replica: 100,
        ..IndexConfig::default()
    });
    let all: Vec<u64> = (1..=101).collect();
    index.stored("a:1", &hashes(&all), Medium::Gpu);
    let held = index.replica_blocks("a:1");
    assert!(held.len() <= 90, "{}", held.len());
    assert_eq!(index.replica_block_count("a:1"), held.len() as u64);
    // The newest survive, the oldest are gone.
    assert!(held.contains(&h(101)));
    assert!(!held.contains(&h(1)));
    let oldest_kept = held.iter().min().copied().unwrap_or(h(0));
    assert_eq!(held, hashes(&(oldest_kept.0..=101).collect::<Vec<_>>()));
}

#[test]
fn more_than_64_candidates() {
    let index = KvIndex::new(IndexConfig::default());
    let names: Vec<String> = (0..130).map(|i| format!("r{i}:1")).collect();
    for (i, name) in names.iter().enumerate() {
        let n = (i % 5) as u64;
        index.stored(name, &hashes(&(0..n).collect::<Vec<_>>()), Medium::Gpu);
    }
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let got = matches(&index, &[0, 1, 2, 3, 4], &refs);
    let want: Vec<u32> = (0..130).map(|i| (i % 5) as u32).collect();
    assert_eq!(got, want);
}

#[tokio::test(start_paused = true)]
async fn speculative_entries_expire() {
    let spec = SpeculativeBlocks::new(Duration::from_secs(2));
    let index = KvIndex::new(IndexConfig::default());
    let a = index.slot_or_insert("a:1").expect("slot");
    let b = index.slot_or_insert("b:1").expect("slot");
    spec.insert(a, Arc::from(hashes(&[1, 2, 3])), Instant::now());
    let mut out = vec![0, 0];
    spec.raise_matches(
        &hashes(&[1, 2, 9]),
        &[Some(a), Some(b)],
        Instant::now(),
        &mut out,
    );
    assert_eq!(out, vec![2, 0]);
    tokio::time::advance(Duration::from_millis(2001)).await;
    let mut out = vec![0, 0];
    spec.raise_matches(
        &hashes(&[1, 2, 9]),
        &[Some(a), Some(b)],
        Instant::now(),
        &mut out,
    );
    assert_eq!(out, vec![0, 0]);
    spec.insert(b, Arc::from(hashes(&[5])), Instant::now());
    assert_eq!(spec.len(), 1, "the expired entry was swept");
}

#[derive(Debug, Clone)]
enum Op {
    Store(u8, Vec<u8>, bool),
    Remove(u8, Vec<u8>, bool),
    Clear(u8),
    Lose(u8),
    Query(Vec<u8>),
}

fn op() -> impl Strategy<Value = Op> {
    let replica = 0u8..5;
    let blocks = prop::collection::vec(0u8..12, 0..6);
    prop_oneof![
        4 => (replica.clone(), blocks.clone(), any::<bool>()).prop_map(|(r, b, g)| Op::Store(r, b, g)),
        3 => (replica.clone(), blocks.clone(), any::<bool>()).prop_map(|(r, b, g)| Op::Remove(r, b, g)),
        1 => replica.clone().prop_map(Op::Clear),
        1 => replica.prop_map(Op::Lose),
        // Longer than EVICTED_RUN_GAP, so runs with gaps, and gaps that end them, come up.
        3 => prop::collection::vec(0u8..12, 0..20).prop_map(Op::Query),
    ]
}

/// The obvious model: reference counts per (replica, block, tier), and what each replica held
/// when it last lost its cache less what it evicted since.
#[derive(Default)]
struct Model {
    refs: HashMap<(u8, u8, bool), u32>,
    home: HashMap<u8, std::collections::HashSet<u8>>,
}

impl Model {
    /// Every reference replica `r` holds, one entry each: what its engine loses in a loss.
    fn references(&self, r: u8, hash: impl Fn(u8) -> ExternalHash) -> Vec<(ExternalHash, Medium)> {
        let mut out = Vec::new();
        for (&(replica, b, gpu), &n) in &self.refs {
            if replica == r {
                out.extend(std::iter::repeat_n((hash(b), medium(gpu)), n as usize));
            }
        }
        out
    }

    fn holds(&self, r: u8, b: u8) -> bool {
        self.refs.get(&(r, b, true)).copied().unwrap_or(0) > 0
            || self.refs.get(&(r, b, false)).copied().unwrap_or(0) > 0
    }
}

fn medium(gpu: bool) -> Medium {
    if gpu { Medium::Gpu } else { Medium::Offloaded }
}

proptest! {
    #[test]
    fn index_agrees_with_a_naive_model(ops in prop::collection::vec(op(), 1..80)) {
        let index = KvIndex::new(IndexConfig::default());
        let mut model = Model::default();
        let name = |r: u8| format!("10.0.0.{r}:8000");
        for op in ops {
            match op {
                Op::Store(r, blocks, gpu) => {
                    let hs: Vec<u64> = blocks.iter().map(|&b| u64::from(b)).collect();
                    index.stored(&name(r), &hashes(&hs), medium(gpu));
                    for b in blocks {
                        // The index saturates reference counts at 15 (see `shard::Holder`).
                        let n = model.refs.entry((r, b, gpu)).or_default();
                        *n = (*n + 1).min(15);
                    }
                }
                Op::Remove(r, blocks, gpu) => {
                    let hs: Vec<u64> = blocks.iter().map(|&b| u64::from(b)).collect();
                    index.removed(&name(r), &hashes(&hs), medium(gpu));
                    for b in blocks {
                        let held = model.holds(r, b);
                        if let Some(n) = model.refs.get_mut(&(r, b, gpu)) {
                            *n = n.saturating_sub(1);
                        }
                        if held && !model.holds(r, b) && let Some(home) = model.home.get_mut(&r) {
                            home.remove(&b);
                        }
                    }
                }
                Op::Clear(r) => {
                    index.cleared(&name(r));
                    model.refs.retain(|k, _| k.0 != r);
                }
                Op::Lose(r) => {
                    index.lost_blocks(&name(r), &model.references(r, |b| h(u64::from(b))));
                    let held: std::collections::HashSet<u8> =
                        (0..12u8).filter(|&b| model.holds(r, b)).collect();
                    if !held.is_empty() {
                        model.home.insert(r, held);
                    }
                    model.refs.retain(|k, _| k.0 != r);
                }
                Op::Query(prompt) => {
                    let names: Vec<String> = (0..5).map(name).collect();
                    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                    let hs: Vec<u64> = prompt.iter().map(|&b| u64::from(b)).collect();
                    let got = matches(&index, &hs, &refs);
                    let want: Vec<u32> = (0..5u8)
                        .map(|r| prompt.iter().take_while(|&&b| model.holds(r, b)).count() as u32)
                        .collect();
                    prop_assert_eq!(got, want.clone());
                    // Tier weights, and the general path agrees with the masked one.
                    let candidates: Vec<_> = refs.iter().map(|r| index.slot(r)).collect();
                    let mut masked = Vec::new();
                    index.match_prefix(&hashes(&hs), &candidates, &mut masked);
                    let mut general = vec![PrefixMatch::default(); candidates.len()];
                    index.match_prefix_general(&hashes(&hs), &candidates, &mut general);
                    prop_assert_eq!(&masked, &general);
                    for (r, slot) in (0..5u8).zip(&candidates) {
                        let want = model.home.get(&r).map_or(0, |home| {
                            prompt.iter().take_while(|b| home.contains(b)).count() as u32
                        });
                        let got = slot.map_or(0, |s| index.home_prefix(s, &hashes(&hs), Instant::now()));
                        prop_assert_eq!(got, want, "home of replica {}", r);
                    }
                    for (r, m) in (0..5u8).zip(&masked) {
                        let weight: f32 = prompt
                            .iter()
                            .take(want[usize::from(r)] as usize)
                            .map(|&b| if model.refs.get(&(r, b, true)).copied().unwrap_or(0) > 0 { 1.0 } else { 0.5 })
                            .sum();
                        prop_assert!((m.weighted - weight).abs() < 1e-4, "{} vs {}", m.weighted, weight);
                    }
                }
            }
            // Invariants after every step: the per-replica view and counts agree with the model.
            for r in 0..5u8 {
                let want: Vec<ExternalHash> = (0..12u8)
                    .filter(|&b| model.holds(r, b))
                    .map(|b| h(u64::from(b)))
                    .collect();
                prop_assert_eq!(index.replica_blocks(&name(r)), want.clone());
                prop_assert_eq!(index.replica_block_count(&name(r)), want.len() as u64);
            }
        }
    }
}

#[test]
fn shared_blocks_collapse_back_when_all_but_one_holder_leaves() {
    let index = KvIndex::new(IndexConfig::default());
    for r in ["a:1", "b:1", "c:1"] {
        index.stored(r, &hashes(&[5, 6]), Medium::Gpu);
    }
    index.removed("a:1", &hashes(&[5]), Medium::Gpu);
    index.cleared("b:1");
    assert_eq!(
        matches(&index, &[5, 6], &["a:1", "b:1", "c:1"]),
        vec![0, 0, 2]
    );
    index.removed("c:1", &hashes(&[5, 6]), Medium::Gpu);
    assert_eq!(matches(&index, &[6], &["a:1", "c:1"]), vec![1, 0]);
    assert_eq!(index.distinct_blocks(), 1);
    index.removed("a:1", &hashes(&[6]), Medium::Gpu);
    assert_eq!(index.distinct_blocks(), 0);
}

#[test]
fn the_evicted_run_is_the_leading_blocks_evicted_and_not_stored_since() {
    let index = KvIndex::new(IndexConfig::default());
    let spread = |bs: &[u8]| bs.iter().map(|&b| spread(b)).collect::<Vec<_>>();
    index.stored("a:1", &spread(&[1, 2, 3, 4, 5]), Medium::Gpu);
    index.removed("a:1", &spread(&[3, 4, 5]), Medium::Gpu);
    let slot = index.slot("a:1").expect("seen");
    // After the two it holds: the three it evicted, then a block it never had.
    assert_eq!(index.evicted_run(slot, &spread(&[3, 4, 5, 6])), 3);
    // A block missing from the table (its cell lost to a later eviction) does not end the
    // run: it reaches the last evicted block before EVICTED_RUN_GAP missing in a row.
    assert_eq!(index.evicted_run(slot, &spread(&[3, 6, 4, 5])), 4);
    assert_eq!(index.evicted_run(slot, &spread(&[6, 3, 4])), 3);
    assert_eq!(index.recently_evicted(slot, &spread(&[6, 3, 4])), 2);
    let mut gap = vec![3];
    gap.extend(std::iter::repeat_n(6, EVICTED_RUN_GAP - 1));
    gap.push(4);
    assert_eq!(index.evicted_run(slot, &spread(&gap)), EVICTED_RUN_GAP + 1);
    gap.insert(1, 7);
    assert_eq!(index.evicted_run(slot, &spread(&gap)), 1);
    // A block stored again is held, no longer evicted.
    index.stored("a:1", &spread(&[3]), Medium::Gpu);
    assert_eq!(index.evicted_run(slot, &spread(&[3])), 0);
    assert_eq!(index.recently_evicted(slot, &spread(&[3, 4, 5])), 2);
    assert_eq!(index.evicted_run(slot, &spread(&[4, 5])), 2);
    // Another replica's evictions are its own; an empty prompt has no run.
    index.stored("b:1", &spread(&[4]), Medium::Gpu);
    let other = index.slot("b:1").expect("seen");
    assert_eq!(index.evicted_run(other, &spread(&[4, 5])), 0);
    assert_eq!(index.evicted_run(slot, &[]), 0);
}

#[test]
fn blocks_stored_again_after_an_eviction_count_as_rebuilt() {
    let index = KvIndex::new(IndexConfig::default());
    let spread = |bs: &[u8]| bs.iter().map(|&b| spread(b)).collect::<Vec<_>>();
    let churn = |index: &KvIndex| index.churn(index.slot("a:1").expect("seen"));
    index.stored("a:1", &spread(&[1, 2, 3]), Medium::Gpu);
    index.removed("a:1", &spread(&[1, 2]), Medium::Gpu);
    assert_eq!(
        churn(&index),
        ReplicaChurn {
            evicted: 2,
            rebuilt: 0
        }
    );
    // Block 1 comes back, block 4 is new.
    index.stored("a:1", &spread(&[1, 4]), Medium::Gpu);
    assert_eq!(
        churn(&index),
        ReplicaChurn {
            evicted: 2,
            rebuilt: 1
        }
    );
    let slot = index.slot("a:1").expect("seen");
    assert_eq!(
        index.recently_evicted(slot, &spread(&[1, 2, 3, 4])),
        1,
        "2 only"
    );
    // Once rebuilt it is no longer a recent eviction; a second store changes nothing.
    index.stored("a:1", &spread(&[1]), Medium::Gpu);
    assert_eq!(churn(&index).rebuilt, 1);

    // Offloading is not eviction: the block stays held on the CPU tier.
    index.stored("a:1", &spread(&[3]), Medium::Offloaded);
    index.removed("a:1", &spread(&[3]), Medium::Gpu);
    index.stored("a:1", &spread(&[3]), Medium::Gpu);
    assert_eq!(
        churn(&index),
        ReplicaChurn {
            evicted: 2,
            rebuilt: 1
        }
    );

    // A clear is not an eviction, and what a restarted engine computes again is not counted.
    index.cleared("a:1");
    index.stored("a:1", &spread(&[2]), Medium::Gpu);
    assert_eq!(
        churn(&index),
        ReplicaChurn {
            evicted: 2,
            rebuilt: 1
        }
    );
    // Another replica's evictions are its own.
    index.stored("b:1", &spread(&[4]), Medium::Gpu);
    index.removed("b:1", &spread(&[4]), Medium::Gpu);
    assert_eq!(churn(&index).evicted, 2);
    assert_eq!(
        index.replica_churn(),
        vec![
            (
                "a:1".to_owned(),
                ReplicaChurn {
                    evicted: 2,
                    rebuilt: 1
                }
            ),
            (
                "b:1".to_owned(),
                ReplicaChurn {
                    evicted: 1,
                    rebuilt: 0
                }
            ),
        ]
    );
}

#[test]
fn a_newer_eviction_in_the_same_cell_replaces_the_older() {
    let index = KvIndex::new(IndexConfig::default());
    // Small hashes share cell 0 (the cell is chosen by the high bits).
    index.stored("a:1", &hashes(&[5, 6]), Medium::Gpu);
    index.removed("a:1", &hashes(&[5, 6]), Medium::Gpu);
    index.stored("a:1", &hashes(&[5, 6]), Medium::Gpu);
    let churn = index.churn(index.slot("a:1").expect("seen"));
    assert_eq!(
        churn,
        ReplicaChurn {
            evicted: 2,
            rebuilt: 1
        },
        "a lower bound"
    );
}

/// Block `b` as a hash alone in its cell of the table of recent evictions.
fn spread(b: u8) -> ExternalHash {
    ExternalHash(((u64::from(b) + 1) << 40) | u64::from(b))
}

proptest! {
    #[test]
    fn churn_agrees_with_a_model(ops in prop::collection::vec(op(), 1..80)) {
        let index = KvIndex::new(IndexConfig::default());
        let mut model = Model::default();
        // Per replica: (evicted, rebuilt, blocks evicted and not stored since).
        let mut churn: HashMap<u8, (u64, u64, std::collections::HashSet<u8>)> = HashMap::new();
        let name = |r: u8| format!("10.0.0.{r}:8000");
        for op in ops {
            let lose = matches!(op, Op::Lose(_));
            match op {
                Op::Store(r, blocks, gpu) => {
                    let hs: Vec<ExternalHash> = blocks.iter().map(|&b| spread(b)).collect();
                    index.stored(&name(r), &hs, medium(gpu));
                    let entry = churn.entry(r).or_default();
                    for b in blocks {
                        if !model.holds(r, b) && entry.2.remove(&b) {
                            entry.1 += 1;
                        }
                        let n = model.refs.entry((r, b, gpu)).or_default();
                        *n = (*n + 1).min(15);
                    }
                }
                Op::Remove(r, blocks, gpu) => {
                    let hs: Vec<ExternalHash> = blocks.iter().map(|&b| spread(b)).collect();
                    index.removed(&name(r), &hs, medium(gpu));
                    for b in blocks {
                        let held = model.holds(r, b);
                        if let Some(n) = model.refs.get_mut(&(r, b, gpu)) {
                            *n = n.saturating_sub(1);
                        }
                        if held && !model.holds(r, b) {
                            let entry = churn.entry(r).or_default();
                            entry.0 += 1;
                            entry.2.insert(b);
                        }
                    }
                }
                // A loss resets the churn as a clear does: the engine lost its cache, it did
                // not evict.
                Op::Clear(r) | Op::Lose(r) => {
                    if lose {
                        index.lost_blocks(&name(r), &model.references(r, spread));
                    } else {
                        index.cleared(&name(r));
                    }
                    model.refs.retain(|k, _| k.0 != r);
                    if let Some(entry) = churn.get_mut(&r) {
                        entry.2.clear();
                    }
                }
                // What a replica evicted and has not stored since, as the scorers ask for it.
                Op::Query(blocks) => {
                    let hs: Vec<ExternalHash> = blocks.iter().map(|&b| spread(b)).collect();
                    for r in 0..5u8 {
                        let Some(slot) = index.slot(&name(r)) else { continue };
                        let evicted = churn.get(&r).map(|e| &e.2);
                        let was_evicted = |b: &u8| evicted.is_some_and(|set| set.contains(b));
                        // The run ends where the first EVICTED_RUN_GAP blocks in a row
                        // that were not evicted begin, and reaches the last evicted block
                        // before that.
                        let end = blocks
                            .windows(EVICTED_RUN_GAP)
                            .position(|w| !w.iter().any(&was_evicted))
                            .unwrap_or(blocks.len());
                        let run = blocks[..end].iter().rposition(&was_evicted).map_or(0, |p| p + 1);
                        prop_assert_eq!(index.evicted_run(slot, &hs), run);
                        prop_assert_eq!(
                            index.recently_evicted(slot, &hs),
                            blocks.iter().filter(|b| was_evicted(b)).count()
                        );
                    }
                }
            }
            for r in 0..5u8 {
                let got = index.slot(&name(r)).map(|s| index.churn(s)).unwrap_or_default();
                let (evicted, rebuilt) = churn.get(&r).map_or((0, 0), |e| (e.0, e.1));
                prop_assert_eq!(got, ReplicaChurn { evicted, rebuilt });
            }
        }
    }
}

#[test]
fn a_lost_cache_is_remembered_as_home_until_evicted_again_or_forgotten() {
    let index = KvIndex::new(IndexConfig::default());
    index.stored("a:1", &hashes(&[1, 2, 3]), Medium::Gpu);
    index.stored("b:1", &hashes(&[1, 2]), Medium::Gpu);
    let prompt = hashes(&[1, 2, 3, 4]);
    let (a, b) = (index.slot("a:1").unwrap(), index.slot("b:1").unwrap());
    let now = Instant::now();
    assert_eq!(index.home_prefix(a, &prompt, now), 0, "nothing lost yet");

    index.lost_blocks("a:1", &gpu(&[1, 2, 3]));
    assert_eq!(matches(&index, &[1, 2, 3], &["a:1", "b:1"]), vec![0, 2]);
    assert_eq!(index.replica_block_count("a:1"), 0);
    assert_eq!(index.home_prefix(a, &prompt, Instant::now()), 3);
    assert_eq!(index.home_prefix(b, &prompt, Instant::now()), 0);
    // A plain clear (a snapshot restating the cache) remembers nothing.
    index.cleared("b:1");
    assert_eq!(index.home_prefix(b, &prompt, Instant::now()), 0);

    // Computed again, the prompt stays home; evicted again, the cache let it go.
    index.stored("a:1", &hashes(&[1, 2]), Medium::Gpu);
    assert_eq!(index.home_prefix(a, &prompt, Instant::now()), 3);
    index.removed("a:1", &hashes(&[2]), Medium::Gpu);
    assert_eq!(index.home_prefix(a, &prompt, Instant::now()), 1);

    // A second loss with nothing cached keeps the first memory; after `home_memory` it is gone.
    index.removed("a:1", &hashes(&[1]), Medium::Gpu);
    index.stored("a:1", &hashes(&[9]), Medium::Gpu);
    index.lost_blocks("a:1", &gpu(&[9]));
    assert_eq!(index.home_prefix(a, &hashes(&[9]), Instant::now()), 1);
    index.lost_blocks("a:1", &[]);
    assert_eq!(index.home_prefix(a, &hashes(&[9]), Instant::now()), 1);
    let later = Instant::now() + IndexConfig::default().home_memory + Duration::from_secs(1);
    assert_eq!(index.home_prefix(a, &hashes(&[9]), later), 0);
    assert_eq!(
        index.home_prefix(a, &hashes(&[9]), Instant::now()),
        0,
        "dropped"
    );
}

#[test]
fn with_no_home_memory_a_loss_remembers_nothing() {
    let index = KvIndex::new(IndexConfig {
        home_memory: Duration::ZERO,
        ..IndexConfig::default()
    });
    index.stored("a:1", &hashes(&[1, 2]), Medium::Gpu);
    index.lost_blocks("a:1", &gpu(&[1, 2]));
    let a = index.slot("a:1").unwrap();
    assert_eq!(index.home_prefix(a, &hashes(&[1, 2]), Instant::now()), 0);
    assert_eq!(index.replica_block_count("a:1"), 0);
}

#[test]
fn a_withdrawn_report_leaves_the_index_without_counting_as_evictions() {
    let index = KvIndex::new(IndexConfig::default());
    let blocks = |bs: &[u8]| bs.iter().map(|&b| (spread(b), 1)).collect::<Vec<_>>();
    let slot = |index: &KvIndex| index.slot("a:1").expect("seen");
    index.stored_copies("a:1", &blocks(&[1, 2, 3]), Medium::Gpu);
    index.stored_copies("a:1", &blocks(&[1]), Medium::Gpu);
    index.withdrawn_copies("a:1", &blocks(&[1, 2]), Medium::Gpu);
    assert_eq!(
        matches(&index, &[spread(1).0], &["a:1"]),
        vec![1],
        "a second reference holds block 1"
    );
    assert_eq!(index.replica_block_count("a:1"), 2);
    assert_eq!(index.churn(slot(&index)), ReplicaChurn::default());
    assert_eq!(index.recently_evicted(slot(&index), &[spread(2)]), 0);
    // Stored again, a withdrawn block is no rebuild either.
    index.stored_copies("a:1", &blocks(&[2]), Medium::Gpu);
    assert_eq!(index.churn(slot(&index)), ReplicaChurn::default());
}

#[test]
fn a_lost_engine_takes_only_its_blocks_and_they_become_the_replica_s_home() {
    let index = KvIndex::new(IndexConfig::default());
    // Two engines of one replica: the first holds 1 2 3 (3 offloaded too), the second 1 9.
    index.stored("a:1", &hashes(&[1, 2, 3]), Medium::Gpu);
    index.stored("a:1", &hashes(&[3]), Medium::Offloaded);
    index.stored("a:1", &hashes(&[1, 9]), Medium::Gpu);
    index.removed("a:1", &hashes(&[9]), Medium::Gpu);
    let a = index.slot("a:1").expect("seen");
    assert_eq!(index.recently_evicted(a, &hashes(&[9])), 1);

    let lost = [
        (h(1), Medium::Gpu),
        (h(2), Medium::Gpu),
        (h(3), Medium::Gpu),
        (h(3), Medium::Offloaded),
    ];
    index.lost_blocks("a:1", &lost);
    assert_eq!(
        index.replica_blocks("a:1"),
        hashes(&[1]),
        "the other engine's copy of 1 stays"
    );
    let prompt = hashes(&[1, 2, 3, 4]);
    assert_eq!(index.home_prefix(a, &prompt, Instant::now()), 3);
    assert_eq!(index.churn(a).evicted, 1, "a loss is not evictions");
    assert_eq!(
        index.recently_evicted(a, &hashes(&[9])),
        0,
        "what the replica computes again after a loss is not its cache's pressure"
    );
    // A loss of nothing keeps the memory.
    index.lost_blocks("a:1", &[]);
    assert_eq!(index.home_prefix(a, &prompt, Instant::now()), 3);
}

#[tokio::test(start_paused = true)]
async fn a_full_table_gives_a_long_departed_empty_replica_s_slot_to_a_new_one() {
    let index = KvIndex::new(IndexConfig::default());
    let name = |i: usize| format!("10.{}.{}.{}:8000", i >> 16, (i >> 8) & 255, i & 255);
    for i in 0..shard::MAX_SLOTS {
        index.slot_or_insert(&name(i)).expect("room");
    }
    assert_eq!(
        index.slot_or_insert("new:1"),
        Err(KvIndexError::TooManyReplicas {
            max: shard::MAX_SLOTS
        })
    );
    // Replicas 0 and 1 leave the pool; 1 still holds a block (its agent reports it), and 0
    // remembers a lost cache and has churned.
    index.stored(&name(0), &hashes(&[1, 2]), Medium::Gpu);
    index.removed(&name(0), &hashes(&[2]), Medium::Gpu);
    index.lost_blocks(&name(0), &gpu(&[1]));
    index.stored(&name(1), &hashes(&[1]), Medium::Gpu);
    let present: HashSet<String> = (2..shard::MAX_SLOTS).map(name).collect();
    index.pool_changed(&present, Instant::now());
    tokio::time::advance(SLOT_QUARANTINE - Duration::from_secs(1)).await;
    assert!(
        index.slot_or_insert("new:1").is_err(),
        "still in quarantine"
    );
    // Back in the pool and out again: the quarantine starts over.
    index.pool_changed(
        &present.iter().cloned().chain([name(0)]).collect(),
        Instant::now(),
    );
    index.pool_changed(&present, Instant::now());
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(
        index.slot_or_insert("new:1").is_err(),
        "quarantine restarted"
    );

    tokio::time::advance(SLOT_QUARANTINE).await;
    let old = index.slot(&name(0)).expect("known");
    let new = index.slot_or_insert("new:1").expect("replica 0's slot");
    assert_eq!(new, old);
    assert_eq!(
        index.slot(&name(0)),
        None,
        "the departed replica is forgotten"
    );
    assert_eq!(index.replica_block_count("new:1"), 0);
    assert_eq!(index.churn(new), ReplicaChurn::default());
    assert_eq!(index.home_prefix(new, &hashes(&[1]), Instant::now()), 0);
    assert_eq!(matches(&index, &[1], &["new:1", &name(1)]), vec![0, 1]);
    // Replica 1 holds a block: its slot is not given away; nothing else is free.
    assert!(index.slot_or_insert("new:2").is_err());
    let one = index.slot(&name(1)).expect("known");
    index.removed(&name(1), &hashes(&[1]), Medium::Gpu);
    assert_eq!(index.slot_or_insert("new:2"), Ok(one));
    index.stored("new:1", &hashes(&[7]), Medium::Gpu);
    assert_eq!(matches(&index, &[7], &["new:1", "new:2"]), vec![1, 0]);
}
