use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::wire::{AllBlocksCleared, BlockRemoved, BlockStored};

fn key(h: u64) -> BlockKey {
    BlockKey {
        hash: ExternalHash(h),
        group: GroupIdx(0),
        tier: Tier::Gpu,
    }
}

/// What a router holds after applying a snapshot and then deltas (the consumer's side).
#[derive(Default, Debug)]
struct Consumer {
    epoch: u64,
    seq: u64,
    blocks: HashMap<BlockKey, u32>,
}

impl Consumer {
    fn load(&mut self, s: &Snapshot) {
        self.epoch = s.epoch;
        self.seq = s.seq;
        self.blocks = s.blocks.iter().copied().collect();
    }

    fn apply(&mut self, d: &Delta) {
        if d.epoch < self.epoch || (d.epoch == self.epoch && d.seq <= self.seq) {
            return; // already in the snapshot
        }
        assert!(
            d.epoch > self.epoch || d.seq == self.seq + 1,
            "no delta skipped: had {}.{}, got {}.{}",
            self.epoch,
            self.seq,
            d.epoch,
            d.seq
        );
        if d.epoch > self.epoch {
            assert!(d.reset && d.seq == 1, "a new epoch starts with a reset");
        }
        if d.reset {
            self.blocks.clear();
        }
        for k in &d.stored {
            *self.blocks.entry(*k).or_insert(0) += 1;
        }
        for k in &d.removed {
            let n = self
                .blocks
                .get_mut(k)
                .expect("removed only what was stored");
            *n -= 1;
            if *n == 0 {
                self.blocks.remove(k);
            }
        }
        self.epoch = d.epoch;
        self.seq = d.seq;
    }
}

fn held(m: &Mirror) -> HashMap<BlockKey, u32> {
    m.keys().map(|k| (*k, m.count(k))).collect()
}

#[test]
fn copies_are_counted_and_unknown_removals_ignored() {
    let mut m = Mirror::new();
    assert!(m.store(key(1)));
    assert!(m.store(key(1)));
    assert_eq!(m.count(&key(1)), 2);
    assert!(m.remove(key(1)));
    assert_eq!(m.count(&key(1)), 1);
    assert!(m.remove(key(1)));
    assert!(m.is_empty());
    assert!(!m.remove(key(1)), "nothing left to remove");
    assert!(!m.remove(key(2)));
}

#[test]
fn a_store_undone_within_the_window_sends_nothing() {
    let mut m = Mirror::new();
    assert!(m.store(key(1)));
    assert!(m.store(key(2)));
    assert!(m.remove(key(1)));
    let d = m.take_delta().expect("key 2 is new");
    assert_eq!(
        (d.stored.as_slice(), d.removed.len()),
        ([key(2)].as_slice(), 0)
    );
    assert!(m.store(key(3)));
    assert!(m.remove(key(3)));
    assert!(!m.has_pending());
    assert_eq!(m.take_delta(), None);
}

#[test]
fn events_map_to_keys_by_group_and_tier() {
    let mut m = Mirror::new();
    let stored = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![ExternalHash(5), ExternalHash(6)],
        medium: Some(Medium::Cpu),
        group_idx: Some(1),
        ..BlockStored::default()
    });
    let a = m.apply(&stored);
    assert_eq!(a.stored, 2);
    let cpu5 = BlockKey {
        hash: ExternalHash(5),
        group: GroupIdx(1),
        tier: Tier::from_vllm(Some("CPU")),
    };
    assert_eq!(m.count(&cpu5), 1);
    assert_eq!(m.count(&key(5)), 0, "GPU group 0 is another key");
    let removed = KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![ExternalHash(5), ExternalHash(7)],
        medium: Some(Medium::Other("cpu".into())),
        group_idx: Some(1),
        ..BlockRemoved::default()
    });
    let a = m.apply(&removed);
    assert_eq!((a.removed, a.unknown_removed), (1, 1));
    let a = m.apply(&KvEvent::AllBlocksCleared(AllBlocksCleared));
    assert!(a.cleared && m.is_empty());
    let d = m.take_delta().expect("reset pending");
    assert!(d.reset && d.stored.is_empty() && d.removed.is_empty());
    assert_eq!((d.epoch, d.seq), (1, 1));
}

#[derive(Debug, Clone)]
enum Op {
    Store(u64),
    Remove(u64),
    Reset,
    /// Take the pending changes in deltas of at most this many.
    Flush(usize),
    Snapshot,
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..12).prop_map(Op::Store),
        5 => (0u64..12).prop_map(Op::Remove),
        1 => Just(Op::Reset),
        3 => prop_oneof![(1usize..4), Just(usize::MAX)].prop_map(Op::Flush),
        1 => Just(Op::Snapshot),
    ]
}

proptest! {
    /// A consumer that loads a snapshot taken at any moment and then applies every later delta
    /// ends up holding exactly what the mirror holds.
    #[test]
    fn snapshot_plus_later_deltas_equals_the_mirror(ops in proptest::collection::vec(arb_op(), 0..120)) {
        let mut m = Mirror::new();
        let mut deltas: Vec<Delta> = Vec::new();
        let mut snapshots: Vec<(Snapshot, usize)> = vec![(m.snapshot(), 0)];
        let mut model: HashMap<u64, u32> = HashMap::new();
        for op in ops {
            match op {
                Op::Store(h) => {
                    prop_assert!(m.store(key(h)));
                    *model.entry(h).or_insert(0) += 1;
                }
                Op::Remove(h) => {
                    let had = model.get(&h).copied().unwrap_or(0);
                    prop_assert_eq!(m.remove(key(h)), had > 0);
                    if had > 1 { model.insert(h, had - 1); } else { model.remove(&h); }
                }
                Op::Reset => {
                    m.reset();
                    model.clear();
                }
                Op::Flush(max) => deltas.extend(m.take_deltas(max)),
                Op::Snapshot => snapshots.push((m.snapshot(), deltas.len())),
            }
            let expect: HashMap<BlockKey, u32> = model.iter().map(|(h, n)| (key(*h), *n)).collect();
            prop_assert_eq!(held(&m), expect);
            prop_assert_eq!(m.copies(), model.values().map(|&n| u64::from(n)).sum::<u64>());
        }
        deltas.extend(m.take_delta());
        for (snap, taken_before) in snapshots {
            let mut c = Consumer::default();
            c.load(&snap);
            // The consumer may also see deltas from before its snapshot; it must skip them.
            for d in &deltas[taken_before.saturating_sub(1)..] {
                c.apply(d);
            }
            prop_assert_eq!(&c.blocks, &held(&m));
        }
    }
}

#[test]
fn a_store_past_the_ceiling_is_refused_and_changes_nothing() {
    let mut m = Mirror::with_max_copies(3);
    assert!(m.store(key(1)));
    assert!(m.store(key(1)));
    assert!(m.store(key(2)));
    assert!(!m.store(key(3)));
    assert!(!m.store(key(1)));
    assert_eq!(held(&m), HashMap::from([(key(1), 2), (key(2), 1)]));
    assert_eq!(m.copies(), 3);
    // A removal frees room again.
    assert!(m.remove(key(1)));
    assert!(m.store(key(3)));
    assert_eq!(m.copies(), 3);
}

#[test]
fn an_event_past_the_ceiling_resets_the_mirror() {
    let mut m = Mirror::with_max_copies(4);
    let stored = |hashes: std::ops::Range<u64>| {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.map(ExternalHash).collect(),
            ..BlockStored::default()
        })
    };
    let applied = m.apply(&stored(0..3));
    assert_eq!((applied.stored, applied.overflowed), (3, false));
    let first = m.take_delta().expect("three stores");
    let applied = m.apply(&stored(10..13));
    assert!(applied.overflowed);
    assert!(m.is_empty() && m.copies() == 0, "reset, not partly applied");
    let d = m.take_delta().expect("the reset");
    assert!(d.reset && d.stored.is_empty() && d.epoch == first.epoch + 1);
    // The mirror keeps working from empty.
    let applied = m.apply(&stored(20..22));
    assert_eq!((applied.stored, applied.overflowed), (2, false));
    assert_eq!(m.copies(), 2);
}

#[test]
fn the_ceiling_is_the_routers_per_engine_default() {
    assert_eq!(
        MAX_COPIES,
        llmgw::feed::state::DEFAULT_MAX_BLOCKS_PER_ENGINE
    );
    assert_eq!(Mirror::new().max_copies, MAX_COPIES);
}

#[test]
fn a_window_past_the_part_size_goes_in_deltas_of_consecutive_seqs_with_one_reset() {
    let mut m = Mirror::new();
    for h in 0..4 {
        assert!(m.store(key(h)));
    }
    m.take_delta();
    m.reset();
    for h in 10..17 {
        assert!(m.store(key(h)));
    }
    assert!(m.store(key(10)));
    let parts = m.take_deltas(3);
    let shape: Vec<(u64, u64, bool, usize)> = parts
        .iter()
        .map(|d| (d.epoch, d.seq, d.reset, d.stored.len() + d.removed.len()))
        .collect();
    assert_eq!(
        shape,
        [(1, 1, true, 3), (1, 2, false, 3), (1, 3, false, 2)],
        "eight changes (block 10 twice) in parts of three"
    );
    let mut c = Consumer::default();
    c.load(&Snapshot::default());
    for d in &parts {
        c.apply(d);
    }
    assert_eq!(c.blocks, held(&m));
    assert_eq!(c.blocks[&key(10)], 2);
    // The next delta and a snapshot follow the last part.
    assert_eq!(m.snapshot().seq, 3);
    assert!(m.remove(key(11)));
    let next = m.take_deltas(3);
    assert_eq!(
        next.iter().map(|d| (d.seq, d.reset)).collect::<Vec<_>>(),
        [(4, false)]
    );
    assert!(m.take_deltas(3).is_empty());
}
