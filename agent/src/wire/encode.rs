//! Writes batches in vLLM's shapes (an independent path through `rmpv`, so round-trip tests
//! compare two implementations rather than one with itself).

use rmpv::Value as Mp;

use super::{BlockRemoved, BlockStored, EventBatch, ExternalHash, KvEvent, Value};

/// How events are laid out inside the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventForm {
    /// `["BlockStored", f1, f2, …]`, every declared field present (vLLM ≤ 0.23).
    TaggedArray,
    /// `{"type": "BlockStored", …}`, fields with a `None` default omitted (vLLM ≥ 0.24).
    TaggedMap,
}

/// Encodes a batch as vLLM would: `[ts, events, dp_rank]`, hashes as u64 integers.
pub fn encode_batch(batch: &EventBatch, form: EventForm) -> Vec<u8> {
    let events = batch.events.iter().map(|e| event(e, form)).collect();
    let dp_rank = batch.dp_rank.map_or(Mp::Nil, Mp::from);
    let root = Mp::Array(vec![Mp::F64(batch.ts), Mp::Array(events), dp_rank]);
    let mut out = Vec::with_capacity(64);
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &root);
    out
}

fn hash(h: ExternalHash) -> Mp {
    Mp::from(h.0)
}

fn hashes(hs: &[ExternalHash]) -> Mp {
    Mp::Array(hs.iter().copied().map(hash).collect())
}

fn opt<T>(v: &Option<T>, f: impl Fn(&T) -> Mp) -> Mp {
    v.as_ref().map_or(Mp::Nil, f)
}

fn opt_str(v: &Option<String>) -> Mp {
    v.as_deref().map_or(Mp::Nil, Mp::from)
}

fn value(v: &Value) -> Mp {
    match v {
        Value::Nil => Mp::Nil,
        Value::Bool(b) => Mp::Boolean(*b),
        Value::Int(i) => Mp::from(*i),
        Value::UInt(u) => Mp::from(*u),
        Value::Float(f) => Mp::F64(*f),
        Value::Str(s) => Mp::from(s.as_str()),
        Value::Bin(b) => Mp::Binary(b.clone()),
        Value::Array(items) => Mp::Array(items.iter().map(value).collect()),
        Value::Map(items) => Mp::Map(items.iter().map(|(k, v)| (value(k), value(v))).collect()),
        Value::Ext(ty, data) => Mp::Ext(*ty, data.clone()),
    }
}

/// `(name, value, omittable)`: omittable fields are left out of maps when nil.
fn stored_fields(e: &BlockStored) -> Vec<(&'static str, Mp, bool)> {
    vec![
        ("block_hashes", hashes(&e.block_hashes), false),
        (
            "parent_block_hash",
            opt(&e.parent_block_hash, |h| hash(*h)),
            false,
        ),
        (
            "token_ids",
            Mp::Array(e.token_ids.iter().map(|&t| Mp::from(t)).collect()),
            false,
        ),
        ("block_size", Mp::from(e.block_size), false),
        ("lora_id", opt(&e.lora_id, |&i| Mp::from(i)), false),
        ("medium", opt(&e.medium, |m| Mp::from(m.as_str())), false),
        ("lora_name", opt_str(&e.lora_name), false),
        (
            "extra_keys",
            opt(&e.extra_keys, |ks| {
                Mp::Array(ks.iter().map(value).collect())
            }),
            true,
        ),
        ("group_idx", opt(&e.group_idx, |&i| Mp::from(i)), true),
        (
            "kv_cache_spec_kind",
            e.kv_cache_spec_kind.as_deref().map_or(Mp::Nil, Mp::from),
            true,
        ),
        (
            "kv_cache_spec_sliding_window",
            opt(&e.kv_cache_spec_sliding_window, |&i| Mp::from(i)),
            true,
        ),
        ("locality", opt_str(&e.locality), true),
        ("ownership", opt_str(&e.ownership), true),
        ("session_id", opt_str(&e.session_id), true),
        (
            "lookahead_token_ids",
            opt(&e.lookahead_token_ids, value),
            true,
        ),
    ]
}

fn removed_fields(e: &BlockRemoved) -> Vec<(&'static str, Mp, bool)> {
    vec![
        ("block_hashes", hashes(&e.block_hashes), false),
        ("medium", opt(&e.medium, |m| Mp::from(m.as_str())), false),
        ("group_idx", opt(&e.group_idx, |&i| Mp::from(i)), true),
        ("locality", opt_str(&e.locality), true),
        ("ownership", opt_str(&e.ownership), true),
    ]
}

fn event(e: &KvEvent, form: EventForm) -> Mp {
    let fields = match e {
        KvEvent::BlockStored(s) => stored_fields(s),
        KvEvent::BlockRemoved(r) => removed_fields(r),
        KvEvent::AllBlocksCleared(_) | KvEvent::Unknown { .. } => Vec::new(),
    };
    let tag = Mp::from(e.kind());
    match form {
        EventForm::TaggedArray => {
            let mut items = Vec::with_capacity(fields.len() + 1);
            items.push(tag);
            items.extend(fields.into_iter().map(|(_, v, _)| v));
            Mp::Array(items)
        }
        EventForm::TaggedMap => {
            let mut items = Vec::with_capacity(fields.len() + 1);
            items.push((Mp::from("type"), tag));
            items.extend(
                fields
                    .into_iter()
                    .filter(|(_, v, omittable)| !(*omittable && v.is_nil()))
                    .map(|(k, v, _)| (Mp::from(k), v)),
            );
            Mp::Map(items)
        }
    }
}
