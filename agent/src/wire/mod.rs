//! vLLM's KV-event payloads: the msgpack `KVEventBatch` frame, decoded into typed events.
//!
//! The wire contract (../shared/reference/vllm.md §2): a batch is `[ts, events, dp_rank?]` (a map
//! with the same names is accepted defensively); each event is a tagged array
//! `["BlockStored", f1, f2, …]` (vLLM ≤ 0.23) or a tagged map `{"type": "BlockStored", …}`
//! (≥ 0.24). Fields missing at the end of an array or absent from a map take their defaults,
//! unknown map keys and extra array elements are skipped, and unknown event types decode to
//! [`KvEvent::Unknown`] so the caller can count them. Block hashes arrive as u64, i64 (vLLM's
//! old `builtin` hashes) or raw digest bytes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`); all
//! become the engine's [`ExternalHash`]: the last 8 bytes big-endian, exactly vLLM's own int
//! form.
//!
//! Decoding is a single pass over the payload with a bounds-checked cursor (`reader`): no
//! intermediate value tree, one allocation per hash list, token list and string kept. Nothing in
//! it can panic on any input (a fuzz target under `agent/fuzz/` and a property test check that).
//! All types are plain data, `Send + Sync`, with no shared state.
//!
//! [`encode_batch`] writes the same shapes back (used by tests, the replay benchmark and the
//! simulator).

use std::borrow::Cow;

mod decode;
mod encode;
mod reader;
mod serialize;

#[cfg(test)]
mod tests;

pub use decode::decode_batch;
pub use encode::{EventForm, encode_batch};
pub use llmgw_core::blockhash::ExternalHash;

/// Why a payload could not be decoded. Offsets are byte positions in the payload.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WireError {
    #[error("payload truncated at byte {offset}")]
    Truncated { offset: usize },
    #[error("expected {expected} at byte {offset}, found {found}")]
    UnexpectedType {
        offset: usize,
        expected: &'static str,
        found: &'static str,
    },
    #[error("invalid UTF-8 in string at byte {offset}")]
    InvalidUtf8 { offset: usize },
    #[error("integer out of range for {what} at byte {offset}")]
    OutOfRange { offset: usize, what: &'static str },
    #[error("batch is {0}, expected [ts, events, dp_rank?] or a map with those keys")]
    BadBatch(String),
    #[error("event {index} is empty: no type tag")]
    MissingTag { index: usize },
    #[error("{} trailing bytes after the batch at byte {offset}", len)]
    TrailingBytes { offset: usize, len: usize },
    #[error("nesting deeper than {0} levels")]
    TooDeep(usize),
    #[error("event {index} ({kind}), field {field}: {source}")]
    Field {
        index: usize,
        kind: &'static str,
        field: &'static str,
        #[source]
        source: Box<WireError>,
    },
}

/// One decoded `KVEventBatch`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventBatch {
    /// The engine's `time.time()` when it published the batch, in seconds.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// `data_parallel_rank` (vLLM ≥ 0.9.1); `None` when absent or nil.
    pub dp_rank: Option<i64>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
#[expect(
    clippy::large_enum_variant,
    reason = "events live briefly in one batch's Vec; boxing would cost an allocation per store"
)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared(AllBlocksCleared),
    /// An event type this decoder does not know; its fields were skipped.
    Unknown {
        kind: String,
    },
}

impl KvEvent {
    /// vLLM's tag for this event (the class name).
    pub fn kind(&self) -> &str {
        match self {
            KvEvent::BlockStored(_) => "BlockStored",
            KvEvent::BlockRemoved(_) => "BlockRemoved",
            KvEvent::AllBlocksCleared(_) => "AllBlocksCleared",
            KvEvent::Unknown { kind } => kind,
        }
    }
}

/// Blocks newly cached (`BlockStored`), with vLLM's field names. Fields a release does not send
/// are `None` (or empty).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// Full blocks in chain order.
    pub block_hashes: Vec<ExternalHash>,
    /// The block before the first one here; `None` when this event starts at block 0.
    pub parent_block_hash: Option<ExternalHash>,
    /// The tokens of all `block_hashes`, concatenated (empty for offload placeholders).
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Option<Medium>,
    pub lora_name: Option<String>,
    /// One entry per block: nil or the block's (untagged) extra-key tuple.
    pub extra_keys: Option<Vec<Value>>,
    pub group_idx: Option<i64>,
    /// vLLM's known kinds are borrowed (no allocation per event); others are owned.
    pub kv_cache_spec_kind: Option<Cow<'static, str>>,
    pub kv_cache_spec_sliding_window: Option<i64>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
    pub session_id: Option<String>,
    pub lookahead_token_ids: Option<Value>,
}

/// Blocks no longer cached (`BlockRemoved`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    pub block_hashes: Vec<ExternalHash>,
    pub medium: Option<Medium>,
    pub group_idx: Option<i64>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
}

/// Everything the engine cached is gone (`reset_prefix_cache`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AllBlocksCleared;

/// vLLM's `medium` string, without allocating for the two common tiers. The exact text is kept
/// (Mooncake writes lower-case `"cpu"`); [`Medium::tier`] normalises.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Medium {
    /// `"GPU"`
    Gpu,
    /// `"CPU"`
    Cpu,
    Other(String),
}

impl Medium {
    pub fn from_wire(s: &str) -> Medium {
        match s {
            "GPU" => Medium::Gpu,
            "CPU" => Medium::Cpu,
            other => Medium::Other(other.to_owned()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Other(s) => s,
        }
    }

    /// The index's tier, case-insensitively; an absent medium means GPU.
    pub fn tier(medium: Option<&Medium>) -> llmgw_core::kv_event::Medium {
        llmgw_core::kv_event::Medium::from_vllm(medium.map(Medium::as_str))
    }
}

/// Any msgpack value, for the few fields whose shape varies by release (`extra_keys`,
/// `lookahead_token_ids`). Non-negative integers are [`Value::UInt`], negative ones
/// [`Value::Int`].
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Nil,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
    Ext(i8, Vec<u8>),
}

impl Value {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// What block 0's published extra keys say, for recomputing its hash from `token_ids`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstBlockKeys<'a> {
    /// No extra keys: block 0 hashes its tokens alone.
    Plain,
    /// A `cache_salt` and nothing else.
    Salt(&'a str),
    /// LoRA, multimodal or prompt-embedding keys, which cannot be recomputed from the event
    /// alone (≥ 0.31 hashes the LoRA path, which is not published).
    Other,
}

impl BlockStored {
    /// Classifies the extra keys of the event's first block (meaningful when
    /// `parent_block_hash` is `None`, i.e. the first block is block 0). vLLM publishes them
    /// untagged, in the order LoRA name, MM items, salt, prompt-embeds digest; with no LoRA
    /// and a single string the string is the salt. (vLLM 0.17–0.18 published MM identifiers
    /// as bare strings too; a multimodal block 0 there reads as salted.)
    pub fn first_block_keys(&self) -> FirstBlockKeys<'_> {
        if self.lora_name.is_some() || self.lora_id.is_some() {
            return FirstBlockKeys::Other;
        }
        let Some(first) = self.extra_keys.as_ref().and_then(|keys| keys.first()) else {
            return FirstBlockKeys::Plain;
        };
        match first {
            Value::Nil => FirstBlockKeys::Plain,
            Value::Array(items) => match items.as_slice() {
                [] => FirstBlockKeys::Plain,
                [Value::Str(salt)] => FirstBlockKeys::Salt(salt),
                _ => FirstBlockKeys::Other,
            },
            _ => FirstBlockKeys::Other,
        }
    }
}
