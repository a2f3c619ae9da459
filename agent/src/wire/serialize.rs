//! JSON views of decoded events (for `llmgw-agent tail`): vLLM's field names, `"type"` first,
//! hashes as u64, binaries as lower-case hex strings, absent fields as `null`.

use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};

use super::{BlockRemoved, BlockStored, EventBatch, ExternalHash, KvEvent, Medium, Value};

struct Hashes<'a>(&'a [ExternalHash]);

impl Serialize for Hashes<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for h in self.0 {
            seq.serialize_element(&h.0)?;
        }
        seq.end()
    }
}

impl Serialize for Medium {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl Serialize for Value {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Value::Nil => s.serialize_none(),
            Value::Bool(b) => s.serialize_bool(*b),
            Value::Int(i) => s.serialize_i64(*i),
            Value::UInt(u) => s.serialize_u64(*u),
            Value::Float(f) => s.serialize_f64(*f),
            Value::Str(v) => s.serialize_str(v),
            Value::Bin(b) => s.serialize_str(&hex(b)),
            Value::Array(items) => items.serialize(s),
            Value::Map(items) if items.iter().all(|(k, _)| matches!(k, Value::Str(_))) => {
                let mut map = s.serialize_map(Some(items.len()))?;
                for (k, v) in items {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
            // JSON objects need string keys: other maps become lists of [key, value] pairs.
            Value::Map(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for (k, v) in items {
                    seq.serialize_element(&(k, v))?;
                }
                seq.end()
            }
            Value::Ext(ty, data) => {
                let mut map = s.serialize_map(Some(2))?;
                map.serialize_entry("ext_type", ty)?;
                map.serialize_entry("data", &hex(data))?;
                map.end()
            }
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

fn stored<M: SerializeMap>(map: &mut M, e: &BlockStored) -> Result<(), M::Error> {
    map.serialize_entry("block_hashes", &Hashes(&e.block_hashes))?;
    map.serialize_entry("parent_block_hash", &e.parent_block_hash.map(|h| h.0))?;
    map.serialize_entry("token_ids", &e.token_ids)?;
    map.serialize_entry("block_size", &e.block_size)?;
    map.serialize_entry("lora_id", &e.lora_id)?;
    map.serialize_entry("medium", &e.medium)?;
    map.serialize_entry("lora_name", &e.lora_name)?;
    map.serialize_entry("extra_keys", &e.extra_keys)?;
    map.serialize_entry("group_idx", &e.group_idx)?;
    map.serialize_entry("kv_cache_spec_kind", &e.kv_cache_spec_kind)?;
    map.serialize_entry(
        "kv_cache_spec_sliding_window",
        &e.kv_cache_spec_sliding_window,
    )?;
    map.serialize_entry("locality", &e.locality)?;
    map.serialize_entry("ownership", &e.ownership)?;
    map.serialize_entry("session_id", &e.session_id)?;
    map.serialize_entry("lookahead_token_ids", &e.lookahead_token_ids)
}

fn removed<M: SerializeMap>(map: &mut M, e: &BlockRemoved) -> Result<(), M::Error> {
    map.serialize_entry("block_hashes", &Hashes(&e.block_hashes))?;
    map.serialize_entry("medium", &e.medium)?;
    map.serialize_entry("group_idx", &e.group_idx)?;
    map.serialize_entry("locality", &e.locality)?;
    map.serialize_entry("ownership", &e.ownership)
}

impl Serialize for KvEvent {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("type", self.kind())?;
        match self {
            KvEvent::BlockStored(e) => stored(&mut map, e)?,
            KvEvent::BlockRemoved(e) => removed(&mut map, e)?,
            KvEvent::AllBlocksCleared(_) | KvEvent::Unknown { .. } => {}
        }
        map.end()
    }
}

impl Serialize for EventBatch {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(3))?;
        map.serialize_entry("ts", &self.ts)?;
        map.serialize_entry("dp_rank", &self.dp_rank)?;
        map.serialize_entry("events", &self.events)?;
        map.end()
    }
}
