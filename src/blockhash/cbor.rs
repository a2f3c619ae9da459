//! The few CBOR shapes vLLM's block hash covers, in RFC 8949 shortest form (what
//! `cbor2.dumps(obj, canonical=True)` writes for tuples, ints, bytes, text and `None`).

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

/// Most tokens a [`StackBlock`] holds: 64 tokens of at most 9 bytes each, plus the parent.
const STACK_TOKENS: usize = 64;
const STACK_BYTES: usize = 1 + 2 + 32 + 9 + STACK_TOKENS * 9 + 1;

/// A block without extra keys, encoded on the stack with no per-item capacity checks.
pub(super) struct StackBlock {
    buf: [u8; STACK_BYTES],
    len: usize,
}

impl StackBlock {
    /// `None` when the block does not fit (more than 64 tokens or a parent over 32 bytes).
    #[inline]
    pub(super) fn encode<T: Copy + Into<u64>>(parent: &[u8], tokens: &[T]) -> Option<Self> {
        if tokens.len() > STACK_TOKENS || parent.len() > 32 {
            return None;
        }
        let mut block = StackBlock {
            buf: [0; STACK_BYTES],
            len: 0,
        };
        block.head(ARRAY, 3);
        block.head(BYTES, parent.len() as u64);
        block.buf[block.len..block.len + parent.len()].copy_from_slice(parent);
        block.len += parent.len();
        block.head(ARRAY, tokens.len() as u64);
        for &token in tokens {
            block.head(UNSIGNED, token.into());
        }
        block.buf[block.len] = NULL;
        block.len += 1;
        Some(block)
    }

    #[inline(always)]
    fn head(&mut self, major: u8, value: u64) {
        let (buf, n) = (&mut self.buf, self.len);
        self.len += if value < 24 {
            buf[n] = major | value as u8;
            1
        } else if value <= u64::from(u8::MAX) {
            buf[n] = major | 24;
            buf[n + 1] = value as u8;
            2
        } else if value <= u64::from(u16::MAX) {
            buf[n] = major | 25;
            buf[n + 1..n + 3].copy_from_slice(&(value as u16).to_be_bytes());
            3
        } else if value <= u64::from(u32::MAX) {
            buf[n] = major | 26;
            buf[n + 1..n + 5].copy_from_slice(&(value as u32).to_be_bytes());
            5
        } else {
            buf[n] = major | 27;
            buf[n + 1..n + 9].copy_from_slice(&value.to_be_bytes());
            9
        };
    }

    pub(super) fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}
