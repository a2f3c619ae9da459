//! The few CBOR shapes vLLM's block hash covers, in RFC 8949 shortest form (what
//! `cbor2.dumps(obj, canonical=True)` writes for tuples, ints, bytes, text and `None`).

use std::hint::select_unpredictable;

use super::{BlockDigest, StreamHash};

/// One element of a block's extra-key tuple (LoRA name, multimodal id and offset, salt, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtraKey<'a> {
    Text(&'a str),
    Int(i64),
    Bytes(&'a [u8]),
    /// A nested tuple, e.g. vLLM ≥ 0.31's tagged `("cache_salt", salt)`.
    Tuple(&'a [ExtraKey<'a>]),
}

pub(super) trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Feeds a hash in chunks through a stack buffer: CBOR items are a few bytes each, and
/// hashing them one by one would cost a call per token.
pub(super) struct HashSink<H> {
    hash: H,
    buf: [u8; 256],
    len: usize,
}

impl<H: StreamHash> Default for HashSink<H> {
    fn default() -> Self {
        HashSink {
            hash: H::default(),
            buf: [0; 256],
            len: 0,
        }
    }
}

impl<H: StreamHash> HashSink<H> {
    pub(super) fn finish(mut self) -> BlockDigest {
        self.hash.update(&self.buf[..self.len]);
        self.hash.finish()
    }
}

impl<H: StreamHash> Sink for HashSink<H> {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        if self.len + bytes.len() > self.buf.len() {
            self.hash.update(&self.buf[..self.len]);
            self.len = 0;
            if bytes.len() > self.buf.len() {
                self.hash.update(bytes);
                return;
            }
        }
        self.buf[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }
}

const UNSIGNED: u8 = 0;
const NEGATIVE: u8 = 1 << 5;
const BYTES: u8 = 2 << 5;
const TEXT: u8 = 3 << 5;
const ARRAY: u8 = 4 << 5;
const NULL: u8 = 0xf6;

/// A major type with its argument in the shortest of the five forms.
#[inline]
fn write_head(sink: &mut impl Sink, major: u8, value: u64) {
    if value < 24 {
        sink.put(&[major | value as u8]);
    } else if value <= u64::from(u8::MAX) {
        sink.put(&[major | 24, value as u8]);
    } else if value <= u64::from(u16::MAX) {
        let b = (value as u16).to_be_bytes();
        sink.put(&[major | 25, b[0], b[1]]);
    } else if value <= u64::from(u32::MAX) {
        let b = (value as u32).to_be_bytes();
        sink.put(&[major | 26, b[0], b[1], b[2], b[3]]);
    } else {
        let b = value.to_be_bytes();
        sink.put(&[major | 27, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    }
}

pub(super) fn write_text(sink: &mut impl Sink, text: &str) {
    write_head(sink, TEXT, text.len() as u64);
    sink.put(text.as_bytes());
}

fn write_key(sink: &mut impl Sink, key: &ExtraKey<'_>) {
    match *key {
        ExtraKey::Text(text) => write_text(sink, text),
        ExtraKey::Int(n) if n >= 0 => write_head(sink, UNSIGNED, n as u64),
        // CBOR stores a negative n as -1 - n, which always fits in u64.
        ExtraKey::Int(n) => write_head(sink, NEGATIVE, !(n as u64)),
        ExtraKey::Bytes(bytes) => {
            write_head(sink, BYTES, bytes.len() as u64);
            sink.put(bytes);
        }
        ExtraKey::Tuple(items) => {
            write_head(sink, ARRAY, items.len() as u64);
            for item in items {
                write_key(sink, item);
            }
        }
    }
}

/// `[parent, [tokens…], extra_keys or null]`.
pub(super) fn write_block<T: Copy + Into<u64>>(
    sink: &mut impl Sink,
    parent: &[u8],
    tokens: &[T],
    extra_keys: Option<&[ExtraKey<'_>]>,
) {
    write_head(sink, ARRAY, 3);
    write_head(sink, BYTES, parent.len() as u64);
    sink.put(parent);
    write_head(sink, ARRAY, tokens.len() as u64);
    for &token in tokens {
        write_head(sink, UNSIGNED, token.into());
    }
    match extra_keys {
        None => sink.put(&[NULL]),
        Some(keys) => write_key(sink, &ExtraKey::Tuple(keys)),
    }
}

/// The exact bytes vLLM hashes for one block, appended to `out` (for tests and benchmarks;
/// hashing itself streams them without a buffer).
pub fn encode_block<T: Copy + Into<u64>>(
    out: &mut Vec<u8>,
    parent: &[u8],
    tokens: &[T],
    extra_keys: Option<&[ExtraKey<'_>]>,
) {
    write_block(out, parent, tokens, extra_keys);
}

/// The bytes vLLM hashes for `NONE_HASH`: the seed as a CBOR text string.
pub fn encode_text(out: &mut Vec<u8>, text: &str) {
    write_text(out, text);
}

/// Most tokens [`encode_small_block`] takes.
const SMALL_BLOCK_TOKENS: usize = 64;
/// Room for the widest small block (614 bytes: 37 of head and parent, 64 tokens of at most 9
/// bytes, the null) with SHA-256's padding after it, in whole 64-byte blocks. Every head may
/// store 9 bytes whatever its form, which the padding room also covers.
pub(super) const SMALL_BLOCK_BYTES: usize = 640;

/// Encodes a block without extra keys into `buf` with no per-item capacity checks and
/// returns its length; `None` when it does not fit (over 64 tokens or a parent over 32
/// bytes). The caller owns the buffer so the hot path neither moves nor re-zeroes it.
#[inline]
pub(super) fn encode_small_block<T: Copy + Into<u64>>(
    buf: &mut [u8; SMALL_BLOCK_BYTES],
    parent: &[u8],
    tokens: &[T],
) -> Option<usize> {
    if tokens.len() > SMALL_BLOCK_TOKENS || parent.len() > 32 {
        return None;
    }
    let mut len = put_head(buf, 0, ARRAY, 3);
    len = put_head(buf, len, BYTES, parent.len() as u64);
    buf[len..len + parent.len()].copy_from_slice(parent);
    len += parent.len();
    len = put_head(buf, len, ARRAY, tokens.len() as u64);
    for &token in tokens {
        len = put_head(buf, len, UNSIGNED, token.into());
    }
    buf[len] = NULL;
    Some(len + 1)
}

/// Stores a head at `at` in shortest form and returns the position after it, choosing the
/// form without branches: token ids of a real vocabulary straddle the 1-, 2- and 4-byte forms
/// at random, and a mispredicted branch per token cost more than the SHA-256 compression
/// itself. Always stores 8 bytes, 9 for the 8-byte form (`SMALL_BLOCK_BYTES` has the room).
#[inline(always)]
fn put_head(buf: &mut [u8; SMALL_BLOCK_BYTES], at: usize, major: u8, value: u64) -> usize {
    let Ok(v) = u32::try_from(value) else {
        // Never taken for u32 token ids, so this branch predicts well.
        buf[at] = major | 27;
        buf[at + 1..at + 9].copy_from_slice(&value.to_be_bytes());
        return at + 9;
    };
    // Each form as the little-endian word of its bytes (head first, then the payload most
    // significant byte first), with its length in the top byte. A form's word is only used
    // for values in its range, so no masking is needed: `swapped >> 8` holds a 16-bit
    // value's two bytes in order, and nothing reaches the length byte.
    let m = u64::from(major);
    let swapped = u64::from(v.swap_bytes());
    let tiny = m | u64::from(v) | 1 << 56;
    let one = m | 24 | u64::from(v) << 8 | 2 << 56;
    let two = m | 25 | swapped >> 8 | 3 << 56;
    let four = m | 26 | swapped << 8 | 5 << 56;
    let narrow = select_unpredictable(v < 24, tiny, one);
    let wide = select_unpredictable(v <= u32::from(u16::MAX), two, four);
    let word = select_unpredictable(v <= u32::from(u8::MAX), narrow, wide);
    // The bytes past the item's end (its length among them) are overwritten by what follows.
    buf[at..at + 8].copy_from_slice(&word.to_le_bytes());
    at + (word >> 56) as usize
}
