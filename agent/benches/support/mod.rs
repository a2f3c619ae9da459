//! The synthetic event stream shared by `benches/decode_mirror.rs` and
//! `examples/decode_mirror_profile.rs`, so that the criterion times and the instruction counts
//! measure the same work.

use llmgw_agent::wire::{
    BlockRemoved, BlockStored, EventBatch, EventForm, ExternalHash, KvEvent, Medium, Value,
    encode_batch,
};

/// 64-event batches: each stores one new block (parent = previous) and removes an old one.
pub fn steady(form: EventForm, batches: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::with_capacity(batches);
    let mut next = 1u64;
    for b in 0..batches {
        let mut events = Vec::with_capacity(64);
        for _ in 0..32 {
            let h = next.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            events.push(KvEvent::BlockStored(BlockStored {
                block_hashes: vec![ExternalHash(h)],
                parent_block_hash: Some(ExternalHash(h ^ 1)),
                token_ids: (0..32).map(|t| (t * 97 + next as u32) % 50_000).collect(),
                block_size: 32,
                medium: Some(Medium::Gpu),
                extra_keys: Some(vec![Value::Nil]),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                ..BlockStored::default()
            }));
            if next > 64 {
                let old = (next - 64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                events.push(KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![ExternalHash(old)],
                    medium: Some(Medium::Gpu),
                    group_idx: Some(0),
                    ..BlockRemoved::default()
                }));
            }
            next += 1;
        }
        let batch = EventBatch {
            ts: 1.7e9 + b as f64,
            events,
            dp_rank: Some(0),
        };
        out.push(encode_batch(&batch, form));
    }
    out
}
