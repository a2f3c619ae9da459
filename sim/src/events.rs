//! KV cache events and their msgpack encoding, byte for byte as vLLM's msgspec structs encode
//! them (see `shared/reference/vllm.md` §2 and `shared/fixtures/event_batches.json`).
//!
//! * [`EventFormat::Map`]: vLLM 0.24 – 0.32, events are maps tagged by `"type"`; fields equal
//!   to their default (`None`) after `extra_keys` are omitted.
//! * [`EventFormat::Map033`]: the same maps as vLLM ≥ 0.33 writes them: BlockStored declares 15
//!   fields there, so msgspec sizes its header as map16 (`de 00 0b`) whatever the count.
//! * [`EventFormat::Array`]: vLLM 0.20 – 0.23, events are tagged arrays with every declared
//!   field present (`nil` for `None`).
//!
//! A LoRA request's BlockStored carries the adapter's `lora_id` and `lora_name` and, per block,
//! the untagged extra keys vLLM publishes: `[NAME]`, or `[NAME, SALT]` on a salted block 0
//! (`[SALT]` without an adapter); base-model events keep both LoRA fields nil.
//!
//! The batch is always the array `[ts, events, data_parallel_rank]`. Hashes are either the
//! digest's last 8 bytes as a u64 (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, vLLM's default) or
//! the raw digest as msgpack bin.
//!
//! Pure functions over owned data; no concurrency.

use std::str::FromStr;
use std::sync::Arc;

use llmgw::blockhash::BlockDigest;

use crate::lora::LoraAdapter;

/// How events are laid out inside a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventFormat {
    /// Tagged maps (vLLM 0.24 – 0.32).
    #[default]
    Map,
    /// Tagged maps with vLLM 0.33's map16 BlockStored header.
    Map033,
    /// Tagged arrays (vLLM ≤ 0.23; the 0.20 – 0.23 field list).
    Array,
}

impl FromStr for EventFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "map" => Ok(EventFormat::Map),
            "map-0.33" => Ok(EventFormat::Map033),
            "array" => Ok(EventFormat::Array),
            other => Err(format!(
                "unknown event format {other:?}: expected map, map-0.33 or array"
            )),
        }
    }
}

/// How block hashes are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashForm {
    /// Last 8 digest bytes, big-endian, as a msgpack uint (vLLM's default).
    #[default]
    Int,
    /// The full digest as msgpack bin (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    Bytes,
}

/// Encoding settings for a publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Encoding {
    pub format: EventFormat,
    pub hashes: HashForm,
}

/// One of a block's extra keys, in vLLM's order (LoRA, then cache_salt). Published untagged:
/// the adapter's name, the salt.
#[derive(Debug, Clone, PartialEq)]
pub enum BlockKey {
    /// The request's LoRA adapter (on every block of its requests).
    Lora(Arc<LoraAdapter>),
    /// The request's `cache_salt` (on block 0 only).
    CacheSalt(String),
}

impl BlockKey {
    /// The published (untagged) form.
    pub fn published(&self) -> &str {
        match self {
            BlockKey::Lora(adapter) => &adapter.name,
            BlockKey::CacheSalt(salt) => salt,
        }
    }
}

/// A block was cached: one or more consecutive full blocks of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<BlockDigest>,
    pub parent_block_hash: Option<BlockDigest>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    /// One entry per block: `None`, or the block's extra keys (a LoRA request's adapter on
    /// every block, then the cache_salt on block 0), published untagged. `None` for the whole
    /// field omits it (vLLM < 0.17 shape). The event's `lora_id` and `lora_name` are those of
    /// the adapter its blocks carry (all blocks of one event are one request's), nil without.
    pub extra_keys: Option<Vec<Option<Vec<BlockKey>>>>,
    pub group_idx: Option<u32>,
    pub kv_cache_spec_kind: Option<&'static str>,
}

impl BlockStored {
    /// The LoRA adapter whose blocks these are (`lora_id`, `lora_name`), if any.
    pub fn lora(&self) -> Option<&LoraAdapter> {
        self.extra_keys
            .iter()
            .flatten()
            .flatten()
            .flatten()
            .find_map(|key| match key {
                BlockKey::Lora(adapter) => Some(&**adapter),
                BlockKey::CacheSalt(_) => None,
            })
    }
}

/// One KV cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved {
        block_hashes: Vec<BlockDigest>,
        group_idx: Option<u32>,
    },
    AllBlocksCleared,
}

/// A batch: everything one engine step produced.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<u32>,
}

/// The medium every simulated block lives on.
pub const MEDIUM_GPU: &str = "GPU";

impl EventBatch {
    /// The payload frame.
    pub fn encode(&self, enc: Encoding) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.events.len() * 96);
        mp::array_len(&mut out, 3);
        mp::f64(&mut out, self.ts);
        mp::array_len(&mut out, self.events.len());
        for event in &self.events {
            encode_event(&mut out, event, enc);
        }
        opt_uint(&mut out, self.data_parallel_rank.map(u64::from));
        out
    }
}

fn hash(out: &mut Vec<u8>, digest: &BlockDigest, form: HashForm) {
    match form {
        HashForm::Int => mp::uint(out, digest.external().0),
        HashForm::Bytes => mp::bin(out, digest.as_bytes()),
    }
}

fn hashes(out: &mut Vec<u8>, digests: &[BlockDigest], form: HashForm) {
    mp::array_len(out, digests.len());
    for d in digests {
        hash(out, d, form);
    }
}

fn opt_uint(out: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(v) => mp::uint(out, v),
        None => mp::nil(out),
    }
}

fn extra_keys(out: &mut Vec<u8>, keys: &Option<Vec<Option<Vec<BlockKey>>>>) {
    match keys {
        None => mp::nil(out),
        Some(per_block) => {
            mp::array_len(out, per_block.len());
            for block in per_block {
                match block {
                    None => mp::nil(out),
                    Some(items) => {
                        mp::array_len(out, items.len());
                        for item in items {
                            mp::str(out, item.published());
                        }
                    }
                }
            }
        }
    }
}

fn lora_id(out: &mut Vec<u8>, lora: Option<&LoraAdapter>) {
    opt_uint(out, lora.map(|a| u64::from(a.id)));
}

fn lora_name(out: &mut Vec<u8>, lora: Option<&LoraAdapter>) {
    match lora {
        Some(a) => mp::str(out, &a.name),
        None => mp::nil(out),
    }
}

fn encode_event(out: &mut Vec<u8>, event: &KvEvent, enc: Encoding) {
    match (event, enc.format) {
        (KvEvent::BlockStored(s), EventFormat::Array) => {
            mp::array_len(out, 12);
            mp::str(out, "BlockStored");
            hashes(out, &s.block_hashes, enc.hashes);
            match &s.parent_block_hash {
                Some(p) => hash(out, p, enc.hashes),
                None => mp::nil(out),
            }
            tokens(out, &s.token_ids);
            mp::uint(out, u64::from(s.block_size));
            let lora = s.lora();
            lora_id(out, lora);
            mp::str(out, MEDIUM_GPU);
            lora_name(out, lora);
            extra_keys(out, &s.extra_keys);
            opt_uint(out, s.group_idx.map(u64::from));
            match s.kv_cache_spec_kind {
                Some(kind) => mp::str(out, kind),
                None => mp::nil(out),
            }
            mp::nil(out); // kv_cache_spec_sliding_window
        }
        (KvEvent::BlockStored(s), format @ (EventFormat::Map | EventFormat::Map033)) => {
            let n = 8
                + usize::from(s.extra_keys.is_some())
                + usize::from(s.group_idx.is_some())
                + usize::from(s.kv_cache_spec_kind.is_some());
            if format == EventFormat::Map033 {
                mp::map16_len(out, n);
            } else {
                mp::map_len(out, n);
            }
            mp::str(out, "type");
            mp::str(out, "BlockStored");
            mp::str(out, "block_hashes");
            hashes(out, &s.block_hashes, enc.hashes);
            mp::str(out, "parent_block_hash");
            match &s.parent_block_hash {
                Some(p) => hash(out, p, enc.hashes),
                None => mp::nil(out),
            }
            mp::str(out, "token_ids");
            tokens(out, &s.token_ids);
            mp::str(out, "block_size");
            mp::uint(out, u64::from(s.block_size));
            let lora = s.lora();
            mp::str(out, "lora_id");
            lora_id(out, lora);
            mp::str(out, "medium");
            mp::str(out, MEDIUM_GPU);
            mp::str(out, "lora_name");
            lora_name(out, lora);
            if s.extra_keys.is_some() {
                mp::str(out, "extra_keys");
                extra_keys(out, &s.extra_keys);
            }
            if let Some(g) = s.group_idx {
                mp::str(out, "group_idx");
                mp::uint(out, u64::from(g));
            }
            if let Some(kind) = s.kv_cache_spec_kind {
                mp::str(out, "kv_cache_spec_kind");
                mp::str(out, kind);
            }
        }
        (
            KvEvent::BlockRemoved {
                block_hashes,
                group_idx,
            },
            EventFormat::Array,
        ) => {
            mp::array_len(out, 4);
            mp::str(out, "BlockRemoved");
            hashes(out, block_hashes, enc.hashes);
            mp::str(out, MEDIUM_GPU);
            opt_uint(out, group_idx.map(u64::from));
        }
        (
            KvEvent::BlockRemoved {
                block_hashes,
                group_idx,
            },
            EventFormat::Map | EventFormat::Map033,
        ) => {
            mp::map_len(out, 3 + usize::from(group_idx.is_some()));
            mp::str(out, "type");
            mp::str(out, "BlockRemoved");
            mp::str(out, "block_hashes");
            hashes(out, block_hashes, enc.hashes);
            mp::str(out, "medium");
            mp::str(out, MEDIUM_GPU);
            if let Some(g) = group_idx {
                mp::str(out, "group_idx");
                mp::uint(out, u64::from(*g));
            }
        }
        (KvEvent::AllBlocksCleared, EventFormat::Array) => {
            mp::array_len(out, 1);
            mp::str(out, "AllBlocksCleared");
        }
        (KvEvent::AllBlocksCleared, EventFormat::Map | EventFormat::Map033) => {
            mp::map_len(out, 1);
            mp::str(out, "type");
            mp::str(out, "AllBlocksCleared");
        }
    }
}

fn tokens(out: &mut Vec<u8>, ids: &[u32]) {
    mp::array_len(out, ids.len());
    for &t in ids {
        mp::uint(out, u64::from(t));
    }
}

/// The few msgpack encoders needed, each choosing the smallest form as msgspec does. Writing
/// into a `Vec` cannot fail, so none returns an error.
mod mp {
    pub fn nil(out: &mut Vec<u8>) {
        out.push(0xc0);
    }

    pub fn uint(out: &mut Vec<u8>, v: u64) {
        if v < 0x80 {
            out.push(v as u8);
        } else if v <= u64::from(u8::MAX) {
            out.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= u64::from(u16::MAX) {
            out.push(0xcd);
            out.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u64::from(u32::MAX) {
            out.push(0xce);
            out.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            out.push(0xcf);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub fn f64(out: &mut Vec<u8>, v: f64) {
        out.push(0xcb);
        out.extend_from_slice(&v.to_be_bytes());
    }

    pub fn str(out: &mut Vec<u8>, s: &str) {
        let n = s.len();
        if n < 32 {
            out.push(0xa0 | n as u8);
        } else if n <= usize::from(u8::MAX) {
            out.extend_from_slice(&[0xd9, n as u8]);
        } else if n <= usize::from(u16::MAX) {
            out.push(0xda);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            out.push(0xdb);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
        out.extend_from_slice(s.as_bytes());
    }

    pub fn bin(out: &mut Vec<u8>, b: &[u8]) {
        let n = b.len();
        if n <= usize::from(u8::MAX) {
            out.extend_from_slice(&[0xc4, n as u8]);
        } else if n <= usize::from(u16::MAX) {
            out.push(0xc5);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            out.push(0xc6);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
        out.extend_from_slice(b);
    }

    pub fn array_len(out: &mut Vec<u8>, n: usize) {
        if n < 16 {
            out.push(0x90 | n as u8);
        } else if n <= usize::from(u16::MAX) {
            out.push(0xdc);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            out.push(0xdd);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }

    /// A map header always in the map16 form (msgspec does this for structs declaring more
    /// than 15 fields).
    pub fn map16_len(out: &mut Vec<u8>, n: usize) {
        out.push(0xde);
        out.extend_from_slice(&(n.min(usize::from(u16::MAX)) as u16).to_be_bytes());
    }

    pub fn map_len(out: &mut Vec<u8>, n: usize) {
        if n < 16 {
            out.push(0x80 | n as u8);
        } else if n <= usize::from(u16::MAX) {
            out.push(0xde);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            out.push(0xdf);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;

    use llmgw::blockhash::{BlockHasher, HashSettings};

    use super::*;

    fn fixture(prefix: &str) -> Vec<u8> {
        let json: serde_json::Value =
            serde_json::from_str(&llmgw::fixtures::read("event_batches.json")).unwrap();
        let entry = json["batches"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["vllm"].as_str().unwrap().starts_with(prefix))
            .unwrap_or_else(|| panic!("no fixture {prefix}"));
        hex::decode(entry["hex"].as_str().unwrap()).unwrap()
    }

    /// The fixtures' sample: two blocks of tokens 0..31 (block size 16, seed 1729,
    /// sha256_cbor), then a removal of block 0, then a clear.
    fn sample(group_removed: Option<u32>) -> (EventBatch, Vec<BlockDigest>) {
        let hasher = BlockHasher::new(&HashSettings::sha256_cbor(
            NonZeroUsize::new(16).unwrap(),
            Some("1729"),
        ))
        .unwrap();
        let tokens: Vec<u32> = (0..32).collect();
        let digests: Vec<_> = hasher.prompt_blocks(&tokens, None).collect();
        let batch = EventBatch {
            ts: 1_700_000_000.5,
            events: vec![
                KvEvent::BlockStored(BlockStored {
                    block_hashes: digests.clone(),
                    parent_block_hash: None,
                    token_ids: tokens,
                    block_size: 16,
                    extra_keys: Some(vec![None, None]),
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention"),
                }),
                KvEvent::BlockRemoved {
                    block_hashes: vec![digests[0]],
                    group_idx: group_removed,
                },
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
        };
        (batch, digests)
    }

    #[test]
    fn array_form_matches_vllm_0_23_bytes() {
        let (batch, _) = sample(None);
        let enc = Encoding {
            format: EventFormat::Array,
            hashes: HashForm::Int,
        };
        assert_eq!(
            hex::encode(batch.encode(enc)),
            hex::encode(fixture("vLLM 0.23.0"))
        );
    }

    #[test]
    fn map_form_matches_vllm_0_24_and_0_33_bytes() {
        let (batch, _) = sample(None);
        let ours = hex::encode(batch.encode(Encoding::default()));
        assert_eq!(ours, hex::encode(fixture("vLLM 0.24.0")));
        let enc = Encoding {
            format: EventFormat::Map033,
            hashes: HashForm::Int,
        };
        let ours = hex::encode(batch.encode(enc));
        assert_eq!(ours, hex::encode(fixture("vLLM 0.33.0:")));
    }

    #[test]
    fn bytes_hashes_match_vllm_0_33_raw_digest_batch() {
        let (_, digests) = sample(None);
        let batch = EventBatch {
            ts: 1_700_000_000.5,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![digests[1]],
                parent_block_hash: Some(digests[0]),
                token_ids: (16..32).collect(),
                block_size: 16,
                extra_keys: Some(vec![None]),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention"),
            })],
            data_parallel_rank: Some(0),
        };
        let enc = Encoding {
            format: EventFormat::Map033,
            hashes: HashForm::Bytes,
        };
        assert_eq!(
            hex::encode(batch.encode(enc)),
            hex::encode(fixture("vLLM 0.33.0 with"))
        );
    }

    #[test]
    fn removal_with_group_idx_matches_the_real_0_32_capture_shape() {
        // vLLM 0.32's engine sets group_idx 0 on removals: {"type","block_hashes","medium",
        // "group_idx"}.
        let (batch, digests) = sample(Some(0));
        let bytes = batch.encode(Encoding::default());
        let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let removed = &value[1][1];
        let map = removed.as_map().unwrap();
        let keys: Vec<_> = map.iter().map(|(k, _)| k.as_str().unwrap()).collect();
        assert_eq!(keys, ["type", "block_hashes", "medium", "group_idx"]);
        assert_eq!(
            map[1].1[0].as_u64().unwrap(),
            digests[0].external().0,
            "int hash is the digest's last 8 bytes"
        );
    }

    #[test]
    fn salt_extra_keys_are_published_untagged_on_block_zero() {
        let (mut batch, _) = sample(None);
        if let KvEvent::BlockStored(s) = &mut batch.events[0] {
            s.extra_keys = Some(vec![
                Some(vec![BlockKey::CacheSalt("tenant-a".into())]),
                None,
            ]);
        }
        let bytes = batch.encode(Encoding::default());
        let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let stored = value[1][0].as_map().unwrap();
        let (_, keys) = stored
            .iter()
            .find(|(k, _)| k.as_str() == Some("extra_keys"))
            .unwrap();
        assert_eq!(keys[0][0].as_str(), Some("tenant-a"));
        assert!(keys[1].is_nil());
    }

    #[test]
    fn lora_blocks_publish_the_adapter_and_its_name_on_every_block() {
        let (mut batch, _) = sample(None);
        let adapter = Arc::new(LoraAdapter {
            id: 2,
            name: "sql".into(),
            path: "/adapters/sql".into(),
            base_model_name: None,
        });
        if let KvEvent::BlockStored(s) = &mut batch.events[0] {
            s.extra_keys = Some(vec![
                Some(vec![
                    BlockKey::Lora(Arc::clone(&adapter)),
                    BlockKey::CacheSalt("tenant-a".into()),
                ]),
                Some(vec![BlockKey::Lora(Arc::clone(&adapter))]),
            ]);
        }
        // Map form: the fields by name.
        let bytes = batch.encode(Encoding::default());
        let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let stored = value[1][0].as_map().unwrap();
        let field = |name: &str| {
            stored
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        assert_eq!(field("lora_id").as_u64(), Some(2));
        assert_eq!(field("lora_name").as_str(), Some("sql"));
        let keys = field("extra_keys");
        let strs = |v: &rmpv::Value| -> Vec<String> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(strs(&keys[0]), ["sql", "tenant-a"], "lora first, then salt");
        assert_eq!(strs(&keys[1]), ["sql"]);
        // Array form: lora_id at 5, lora_name at 7 (after medium).
        let enc = Encoding {
            format: EventFormat::Array,
            hashes: HashForm::Int,
        };
        let bytes = batch.encode(enc);
        let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let event = &value[1][0];
        assert_eq!(event[5].as_u64(), Some(2));
        assert_eq!(event[6].as_str(), Some(MEDIUM_GPU));
        assert_eq!(event[7].as_str(), Some("sql"));
        assert_eq!(strs(&event[8][1]), ["sql"]);
        // The agent reads them back.
        let decoded = llmgw_agent::wire::decode_batch(&bytes).unwrap();
        let llmgw_agent::wire::KvEvent::BlockStored(b) = &decoded.events[0] else {
            panic!("BlockStored expected");
        };
        assert_eq!((b.lora_id, b.lora_name.as_deref()), (Some(2), Some("sql")));
        // A base-model event keeps them nil.
        let (batch, _) = sample(None);
        let value = rmpv::decode::read_value(&mut &batch.encode(Encoding::default())[..]).unwrap();
        let stored = value[1][0].as_map().unwrap();
        for name in ["lora_id", "lora_name"] {
            let (_, v) = stored
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .unwrap();
            assert!(v.is_nil(), "{name}");
        }
    }

    fn digest_strategy() -> impl proptest::strategy::Strategy<Value = BlockDigest> {
        use proptest::prelude::*;
        (any::<u32>(), 1usize..64).prop_map(|(t, bs)| {
            let hasher = BlockHasher::new(&HashSettings::sha256_cbor(
                NonZeroUsize::new(bs).unwrap(),
                Some("7"),
            ))
            .unwrap();
            hasher.hash_block(None, &[t], None)
        })
    }

    fn event_strategy() -> impl proptest::strategy::Strategy<Value = KvEvent> {
        use proptest::prelude::*;
        let stored = (
            proptest::collection::vec(digest_strategy(), 1..4),
            proptest::option::of(digest_strategy()),
            proptest::collection::vec(any::<u32>(), 0..40),
            1u32..128,
            proptest::option::of("[a-z]{1,40}"),
            proptest::option::of((1u32..300, "[a-z0-9-]{1,40}")),
        )
            .prop_map(
                |(block_hashes, parent, token_ids, block_size, salt, lora)| {
                    let lora = lora.map(|(id, name)| {
                        Arc::new(LoraAdapter {
                            id,
                            path: format!("/adapters/{name}"),
                            name,
                            base_model_name: None,
                        })
                    });
                    let extra_keys = Some(
                        (0..block_hashes.len())
                            .map(|i| {
                                let keys: Vec<BlockKey> = lora
                                    .iter()
                                    .map(|a| BlockKey::Lora(Arc::clone(a)))
                                    .chain(
                                        salt.iter()
                                            .filter(|_| i == 0)
                                            .map(|s| BlockKey::CacheSalt(s.clone())),
                                    )
                                    .collect();
                                (!keys.is_empty()).then_some(keys)
                            })
                            .collect(),
                    );
                    KvEvent::BlockStored(BlockStored {
                        block_hashes,
                        parent_block_hash: parent,
                        token_ids,
                        block_size,
                        extra_keys,
                        group_idx: Some(0),
                        kv_cache_spec_kind: Some("full_attention"),
                    })
                },
            );
        prop_oneof![
            stored,
            (
                proptest::collection::vec(digest_strategy(), 1..3),
                proptest::option::of(0u32..3)
            )
                .prop_map(|(block_hashes, group_idx)| KvEvent::BlockRemoved {
                    block_hashes,
                    group_idx
                }),
            Just(KvEvent::AllBlocksCleared),
        ]
    }

    proptest::proptest! {
        /// Differential: whatever we encode, in every format and hash form, the agent's decoder
        /// (written independently from vLLM's shapes) reads back as the same events.
        #[test]
        fn every_encoding_decodes_with_the_agents_decoder(
            events in proptest::collection::vec(event_strategy(), 0..6),
            format in proptest::prop_oneof![
                proptest::strategy::Just(EventFormat::Map),
                proptest::strategy::Just(EventFormat::Map033),
                proptest::strategy::Just(EventFormat::Array),
            ],
            bytes in proptest::bool::ANY,
        ) {
            use llmgw_agent::wire;
            let batch = EventBatch { ts: 1.5e9, events: events.clone(), data_parallel_rank: Some(3) };
            let hashes = if bytes { HashForm::Bytes } else { HashForm::Int };
            let decoded = wire::decode_batch(&batch.encode(Encoding { format, hashes })).unwrap();
            proptest::prop_assert_eq!(decoded.ts, 1.5e9);
            proptest::prop_assert_eq!(decoded.dp_rank, Some(3));
            proptest::prop_assert_eq!(decoded.events.len(), events.len());
            let ext = |ds: &[BlockDigest]| ds.iter().map(|d| d.external().0).collect::<Vec<_>>();
            for (ours, theirs) in events.iter().zip(&decoded.events) {
                match (ours, theirs) {
                    (KvEvent::BlockStored(a), wire::KvEvent::BlockStored(b)) => {
                        proptest::prop_assert_eq!(ext(&a.block_hashes), b.block_hashes.iter().map(|h| h.0).collect::<Vec<_>>());
                        proptest::prop_assert_eq!(a.parent_block_hash.map(|d| d.external().0), b.parent_block_hash.map(|h| h.0));
                        proptest::prop_assert_eq!(&a.token_ids, &b.token_ids);
                        proptest::prop_assert_eq!(a.block_size, b.block_size);
                        proptest::prop_assert_eq!(b.group_idx, Some(0));
                        proptest::prop_assert_eq!(b.kv_cache_spec_kind.as_deref(), Some("full_attention"));
                        proptest::prop_assert_eq!(b.lora_id, a.lora().map(|l| i64::from(l.id)));
                        proptest::prop_assert_eq!(b.lora_name.as_deref(), a.lora().map(|l| l.name.as_str()));
                        let published: Vec<Option<Vec<String>>> = a.extra_keys.iter().flatten().map(|k| {
                            k.as_ref().map(|k| k.iter().map(|x| x.published().to_owned()).collect())
                        }).collect();
                        let decoded: Vec<Option<Vec<String>>> = b.extra_keys.iter().flatten().map(|v| match v {
                            wire::Value::Nil => None,
                            wire::Value::Array(items) => Some(items.iter().map(|x| x.as_str().unwrap_or("?").to_owned()).collect()),
                            other => Some(vec![format!("{other:?}")]),
                        }).collect();
                        proptest::prop_assert_eq!(published, decoded);
                    }
                    (KvEvent::BlockRemoved { block_hashes, group_idx }, wire::KvEvent::BlockRemoved(b)) => {
                        proptest::prop_assert_eq!(ext(block_hashes), b.block_hashes.iter().map(|h| h.0).collect::<Vec<_>>());
                        proptest::prop_assert_eq!(group_idx.map(i64::from), b.group_idx);
                    }
                    (KvEvent::AllBlocksCleared, wire::KvEvent::AllBlocksCleared(_)) => {}
                    (a, b) => proptest::prop_assert!(false, "{a:?} decoded as {b:?}"),
                }
            }
        }
    }

    #[test]
    fn msgpack_ints_use_the_smallest_form() {
        let mut out = Vec::new();
        for v in [
            0u64,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            u64::from(u32::MAX) + 1,
        ] {
            mp::uint(&mut out, v);
        }
        assert_eq!(
            hex::encode(out),
            "007fcc80ccffcd0100cdffffce00010000cf0000000100000000"
        );
    }
}
