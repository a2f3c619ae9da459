//! The single-pass decoder: payload bytes → [`EventBatch`].

use std::borrow::Cow;

use super::reader::{Int, Kind, Reader};
use super::{
    AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, ExternalHash, KvEvent, Medium, Value,
    WireError,
};

/// Deepest nesting accepted inside a generic [`Value`] (extra keys are two levels deep).
const MAX_VALUE_DEPTH: usize = 32;

/// The most memory one vector's up-front reservation may take. A count on the wire is only a
/// claim: a payload padded to megabytes may declare billions of elements, and reserving
/// `count × size_of::<T>()` for it (an event is hundreds of bytes) could ask for gigabytes before
/// the first element fails to decode. Past this budget vectors grow as elements actually arrive.
pub(super) const RESERVE_BUDGET_BYTES: usize = 64 * 1024;

/// How many `T`s to reserve for a container that declares `declared` elements, each encoded in
/// at least `min_encoded` bytes, with `remaining` bytes of payload left: never more than the
/// payload could hold, nor more than [`RESERVE_BUDGET_BYTES`] of memory.
pub(super) fn reserve_for<T>(declared: usize, remaining: usize, min_encoded: usize) -> usize {
    let by_input = remaining / min_encoded.max(1);
    let by_budget = RESERVE_BUDGET_BYTES / std::mem::size_of::<T>().max(1);
    declared.min(by_input).min(by_budget)
}

/// A vector for `declared` elements of at least `min_encoded` bytes each, reserved within
/// [`RESERVE_BUDGET_BYTES`].
fn vec_for<T>(r: &Reader<'_>, declared: usize, min_encoded: usize) -> Vec<T> {
    Vec::with_capacity(reserve_for::<T>(declared, r.remaining(), min_encoded))
}

/// BlockStored's fields in declaration order (= array position after the tag), vLLM 0.9–0.33.
pub(super) const STORED_FIELDS: [&str; 15] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];

/// BlockRemoved's fields in declaration order.
pub(super) const REMOVED_FIELDS: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

/// A BlockStored map key's position in [`STORED_FIELDS`] (a `match` compiles to a length
/// switch plus one comparison, far cheaper than scanning the list per key).
pub(super) fn stored_pos(key: &[u8]) -> Option<usize> {
    Some(match key {
        b"block_hashes" => 0,
        b"parent_block_hash" => 1,
        b"token_ids" => 2,
        b"block_size" => 3,
        b"lora_id" => 4,
        b"medium" => 5,
        b"lora_name" => 6,
        b"extra_keys" => 7,
        b"group_idx" => 8,
        b"kv_cache_spec_kind" => 9,
        b"kv_cache_spec_sliding_window" => 10,
        b"locality" => 11,
        b"ownership" => 12,
        b"session_id" => 13,
        b"lookahead_token_ids" => 14,
        _ => return None,
    })
}

/// A BlockRemoved map key's position in [`REMOVED_FIELDS`].
pub(super) fn removed_pos(key: &[u8]) -> Option<usize> {
    Some(match key {
        b"block_hashes" => 0,
        b"medium" => 1,
        b"group_idx" => 2,
        b"locality" => 3,
        b"ownership" => 4,
        _ => return None,
    })
}

/// Decodes one `KVEventBatch` payload (the third frame of a vLLM KV-event message).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, WireError> {
    let mut r = Reader::new(payload);
    let batch = match r.peek_kind() {
        Some(Kind::Array) => array_batch(&mut r)?,
        Some(Kind::Map) => map_batch(&mut r)?,
        Some(kind) => {
            return Err(WireError::BadBatch(format!(
                "a {}",
                super::reader::kind_name(kind)
            )));
        }
        None => return Err(WireError::BadBatch("empty".to_owned())),
    };
    if !r.at_end() {
        return Err(WireError::TrailingBytes {
            offset: r.pos(),
            len: r.remaining(),
        });
    }
    Ok(batch)
}

fn array_batch(r: &mut Reader<'_>) -> Result<EventBatch, WireError> {
    let len = r.array_len()?;
    // Extra trailing elements are tolerated; ts and events are required.
    if len < 2 {
        return Err(WireError::BadBatch(format!("an array of {len} elements")));
    }
    let ts = r.f64()?;
    let events = events(r)?;
    let dp_rank = if len >= 3 {
        opt_i64(r, "dp_rank")?
    } else {
        None
    };
    for _ in 3..len {
        r.skip()?;
    }
    Ok(EventBatch {
        ts,
        events,
        dp_rank,
    })
}

fn map_batch(r: &mut Reader<'_>) -> Result<EventBatch, WireError> {
    let len = r.map_len()?;
    let mut ts = None;
    let mut events_seen = None;
    let mut dp_rank = None;
    for _ in 0..len {
        if r.peek_kind() != Some(Kind::Str) {
            r.skip()?;
            r.skip()?;
            continue;
        }
        match r.str_bytes()? {
            b"ts" => ts = Some(r.f64()?),
            b"events" => events_seen = Some(events(r)?),
            b"data_parallel_rank" => dp_rank = opt_i64(r, "dp_rank")?,
            _ => r.skip()?,
        }
    }
    match (ts, events_seen) {
        (Some(ts), Some(events)) => Ok(EventBatch {
            ts,
            events,
            dp_rank,
        }),
        _ => Err(WireError::BadBatch(
            "a map without ts and events".to_owned(),
        )),
    }
}

fn events(r: &mut Reader<'_>) -> Result<Vec<KvEvent>, WireError> {
    let n = r.array_len()?;
    let mut out = vec_for(r, n, 1);
    for index in 0..n {
        out.push(event(r, index)?);
    }
    Ok(out)
}

/// Which event a tag names.
#[derive(Clone, Copy)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn tag_of(s: &str) -> Tag {
    match s {
        "BlockStored" => Tag::Stored,
        "BlockRemoved" => Tag::Removed,
        "AllBlocksCleared" => Tag::Cleared,
        _ => Tag::Unknown,
    }
}

fn event(r: &mut Reader<'_>, index: usize) -> Result<KvEvent, WireError> {
    match r.peek_kind() {
        Some(Kind::Array) => array_event(r, index),
        Some(Kind::Map) => map_event(r, index),
        _ => {
            let offset = r.pos();
            Err(WireError::Field {
                index,
                kind: "event",
                field: "(itself)",
                source: Box::new(WireError::UnexpectedType {
                    offset,
                    expected: "tagged array or map",
                    found: r
                        .peek_kind()
                        .map_or("end of input", super::reader::kind_name),
                }),
            })
        }
    }
}

fn array_event(r: &mut Reader<'_>, index: usize) -> Result<KvEvent, WireError> {
    let len = r.array_len()?;
    if len == 0 {
        return Err(WireError::MissingTag { index });
    }
    let tag_str = r.str().map_err(|e| field_err(index, "event", "tag", e))?;
    let fields = len - 1;
    match tag_of(tag_str) {
        Tag::Stored => {
            let mut ev = BlockStored::default();
            for (pos, name) in STORED_FIELDS.iter().enumerate().take(fields) {
                stored_field(r, &mut ev, pos)
                    .map_err(|e| field_err(index, "BlockStored", name, e))?;
            }
            for _ in STORED_FIELDS.len()..fields {
                r.skip()?;
            }
            Ok(KvEvent::BlockStored(ev))
        }
        Tag::Removed => {
            let mut ev = BlockRemoved::default();
            for (pos, name) in REMOVED_FIELDS.iter().enumerate().take(fields) {
                removed_field(r, &mut ev, pos)
                    .map_err(|e| field_err(index, "BlockRemoved", name, e))?;
            }
            for _ in REMOVED_FIELDS.len()..fields {
                r.skip()?;
            }
            Ok(KvEvent::BlockRemoved(ev))
        }
        Tag::Cleared => {
            for _ in 0..fields {
                r.skip()?;
            }
            Ok(KvEvent::AllBlocksCleared(AllBlocksCleared))
        }
        Tag::Unknown => {
            let kind = tag_str.to_owned();
            for _ in 0..fields {
                r.skip()?;
            }
            Ok(KvEvent::Unknown { kind })
        }
    }
}

fn map_event(r: &mut Reader<'_>, index: usize) -> Result<KvEvent, WireError> {
    // vLLM writes "type" first; anywhere else costs one extra pass over the keys.
    let tag_str = {
        let mut probe = r.clone();
        find_type(&mut probe).map_err(|e| field_err(index, "event", "type", e))?
    };
    let Some(tag_str) = tag_str else {
        return Err(WireError::MissingTag { index });
    };
    let len = r.map_len()?;
    let tag = tag_of(tag_str);
    let mut stored = BlockStored::default();
    let mut removed = BlockRemoved::default();
    for _ in 0..len {
        if r.peek_kind() != Some(Kind::Str) {
            r.skip()?;
            r.skip()?;
            continue;
        }
        let key = r.str_bytes()?;
        match tag {
            Tag::Stored => match stored_pos(key) {
                Some(pos) => stored_field(r, &mut stored, pos)
                    .map_err(|e| field_err(index, "BlockStored", STORED_FIELDS[pos], e))?,
                None => r.skip()?,
            },
            Tag::Removed => match removed_pos(key) {
                Some(pos) => removed_field(r, &mut removed, pos)
                    .map_err(|e| field_err(index, "BlockRemoved", REMOVED_FIELDS[pos], e))?,
                None => r.skip()?,
            },
            Tag::Cleared | Tag::Unknown => r.skip()?,
        }
    }
    Ok(match tag {
        Tag::Stored => KvEvent::BlockStored(stored),
        Tag::Removed => KvEvent::BlockRemoved(removed),
        Tag::Cleared => KvEvent::AllBlocksCleared(AllBlocksCleared),
        Tag::Unknown => KvEvent::Unknown {
            kind: tag_str.to_owned(),
        },
    })
}

/// The `"type"` value of the map at the cursor, scanning keys only.
fn find_type<'a>(r: &mut Reader<'a>) -> Result<Option<&'a str>, WireError> {
    let len = r.map_len()?;
    for _ in 0..len {
        if r.peek_kind() == Some(Kind::Str) {
            if r.str_bytes()? == b"type" {
                return r.str().map(Some);
            }
        } else {
            r.skip()?;
        }
        r.skip()?;
    }
    Ok(None)
}

fn field_err(index: usize, kind: &'static str, field: &'static str, e: WireError) -> WireError {
    WireError::Field {
        index,
        kind,
        field,
        source: Box::new(e),
    }
}

/// Decodes field `pos` of [`STORED_FIELDS`] into `ev`.
fn stored_field(r: &mut Reader<'_>, ev: &mut BlockStored, pos: usize) -> Result<(), WireError> {
    match pos {
        0 => ev.block_hashes = hashes(r)?,
        1 => ev.parent_block_hash = opt_hash(r)?,
        2 => ev.token_ids = tokens(r)?,
        3 => {
            ev.block_size = if r.nil() {
                0
            } else {
                let offset = r.pos();
                match r.int()? {
                    Int::U(u) => u32::try_from(u).map_err(|_| WireError::OutOfRange {
                        offset,
                        what: "block_size",
                    })?,
                    Int::I(_) => {
                        return Err(WireError::OutOfRange {
                            offset,
                            what: "block_size",
                        });
                    }
                }
            }
        }
        4 => ev.lora_id = opt_i64(r, "lora_id")?,
        5 => ev.medium = opt_medium(r)?,
        6 => ev.lora_name = opt_string(r)?,
        7 => {
            ev.extra_keys = if r.nil() {
                None
            } else {
                let n = r.array_len()?;
                let mut keys = vec_for(r, n, 1);
                for _ in 0..n {
                    keys.push(value(r, 0)?);
                }
                Some(keys)
            }
        }
        8 => ev.group_idx = opt_i64(r, "group_idx")?,
        9 => ev.kv_cache_spec_kind = opt_spec_kind(r)?,
        10 => ev.kv_cache_spec_sliding_window = opt_i64(r, "kv_cache_spec_sliding_window")?,
        11 => ev.locality = opt_string(r)?,
        12 => ev.ownership = opt_string(r)?,
        13 => ev.session_id = opt_string(r)?,
        14 => ev.lookahead_token_ids = if r.nil() { None } else { Some(value(r, 0)?) },
        _ => r.skip()?,
    }
    Ok(())
}

/// Decodes field `pos` of [`REMOVED_FIELDS`] into `ev`.
fn removed_field(r: &mut Reader<'_>, ev: &mut BlockRemoved, pos: usize) -> Result<(), WireError> {
    match pos {
        0 => ev.block_hashes = hashes(r)?,
        1 => ev.medium = opt_medium(r)?,
        2 => ev.group_idx = opt_i64(r, "group_idx")?,
        3 => ev.locality = opt_string(r)?,
        4 => ev.ownership = opt_string(r)?,
        _ => r.skip()?,
    }
    Ok(())
}

/// A block hash: u64, i64 reinterpreted, or digest bytes (last 8, big-endian).
fn hash(r: &mut Reader<'_>) -> Result<ExternalHash, WireError> {
    if let Some(u) = r.u64_exact() {
        return Ok(ExternalHash(u));
    }
    match r.peek_kind() {
        Some(Kind::Bin) => Ok(ExternalHash::from_digest_bytes(r.bin()?)),
        _ => Ok(ExternalHash(match r.int()? {
            Int::U(u) => u,
            Int::I(i) => i as u64,
        })),
    }
}

fn opt_hash(r: &mut Reader<'_>) -> Result<Option<ExternalHash>, WireError> {
    if r.nil() { Ok(None) } else { hash(r).map(Some) }
}

fn hashes(r: &mut Reader<'_>) -> Result<Vec<ExternalHash>, WireError> {
    if r.nil() {
        return Ok(Vec::new());
    }
    let n = r.array_len()?;
    let mut out = vec_for(r, n, 1);
    for _ in 0..n {
        out.push(hash(r)?);
    }
    Ok(out)
}

fn tokens(r: &mut Reader<'_>) -> Result<Vec<u32>, WireError> {
    if r.nil() {
        return Ok(Vec::new());
    }
    let n = r.array_len()?;
    let mut out = vec_for(r, n, 1);
    for _ in 0..n {
        if let Some(t) = r.small_uint() {
            out.push(t);
            continue;
        }
        // Anything else (a signed or 64-bit form, or not an integer): the general path.
        let offset = r.pos();
        let t = match r.int()? {
            Int::U(u) => u32::try_from(u).ok(),
            Int::I(_) => None,
        };
        out.push(t.ok_or(WireError::OutOfRange {
            offset,
            what: "token id",
        })?);
    }
    Ok(out)
}

fn opt_i64(r: &mut Reader<'_>, what: &'static str) -> Result<Option<i64>, WireError> {
    if r.nil() {
        return Ok(None);
    }
    let offset = r.pos();
    r.int()?
        .as_i64()
        .map(Some)
        .ok_or(WireError::OutOfRange { offset, what })
}

fn opt_string(r: &mut Reader<'_>) -> Result<Option<String>, WireError> {
    if r.nil() {
        Ok(None)
    } else {
        r.str().map(|s| Some(s.to_owned()))
    }
}

/// vLLM's `kv_cache_spec_kind` values (0.33), shared rather than allocated per event.
const SPEC_KINDS: [&str; 10] = [
    "full_attention",
    "mla_attention",
    "sliding_window",
    "sliding_window_mla",
    "mamba",
    "chunked_local_attention",
    "sink_full_attention",
    "encoder_only_attention",
    "cross_attention",
    "unknown",
];

fn opt_spec_kind(r: &mut Reader<'_>) -> Result<Option<Cow<'static, str>>, WireError> {
    if r.nil() {
        return Ok(None);
    }
    let start = r.pos();
    let bytes = r.str_bytes()?;
    if let Some(known) = SPEC_KINDS.iter().find(|k| k.as_bytes() == bytes) {
        return Ok(Some(Cow::Borrowed(known)));
    }
    std::str::from_utf8(bytes)
        .map(|s| Some(Cow::Owned(s.to_owned())))
        .map_err(|_| WireError::InvalidUtf8 { offset: start })
}

fn opt_medium(r: &mut Reader<'_>) -> Result<Option<Medium>, WireError> {
    if r.nil() {
        return Ok(None);
    }
    let start = r.pos();
    Ok(Some(match r.str_bytes()? {
        b"GPU" => Medium::Gpu,
        b"CPU" => Medium::Cpu,
        other => Medium::Other(
            std::str::from_utf8(other)
                .map_err(|_| WireError::InvalidUtf8 { offset: start })?
                .to_owned(),
        ),
    }))
}

/// Any value, recursively, to a bounded depth.
fn value(r: &mut Reader<'_>, depth: usize) -> Result<Value, WireError> {
    if depth >= MAX_VALUE_DEPTH {
        return Err(WireError::TooDeep(MAX_VALUE_DEPTH));
    }
    let Some(kind) = r.peek_kind() else {
        return Err(WireError::Truncated { offset: r.pos() });
    };
    Ok(match kind {
        Kind::Nil => {
            r.nil();
            Value::Nil
        }
        Kind::Bool => Value::Bool(r.bool()?),
        Kind::Int => match r.int()? {
            Int::U(u) => Value::UInt(u),
            Int::I(i) => Value::Int(i),
        },
        Kind::Float => Value::Float(r.f64()?),
        Kind::Str => Value::Str(r.str()?.to_owned()),
        Kind::Bin => Value::Bin(r.bin()?.to_vec()),
        Kind::Ext => {
            let (ty, data) = r.ext()?;
            Value::Ext(ty, data.to_vec())
        }
        Kind::Array => {
            let n = r.array_len()?;
            let mut items = vec_for(r, n, 1);
            for _ in 0..n {
                items.push(value(r, depth + 1)?);
            }
            Value::Array(items)
        }
        Kind::Map => {
            let n = r.map_len()?;
            let mut items = vec_for(r, n, 2);
            for _ in 0..n {
                let k = value(r, depth + 1)?;
                let v = value(r, depth + 1)?;
                items.push((k, v));
            }
            Value::Map(items)
        }
        Kind::Reserved => {
            return Err(WireError::UnexpectedType {
                offset: r.pos(),
                expected: "any value",
                found: "reserved marker 0xc1",
            });
        }
    })
}
