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

/// Writes into a buffer known to have room (the heads of a [`BlockEncoder`]).
struct Cursor<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl Sink for Cursor<'_> {
    fn put(&mut self, bytes: &[u8]) {
        self.buf[self.at..self.at + bytes.len()].copy_from_slice(bytes);
        self.at += bytes.len();
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

/// Most tokens a [`BlockEncoder`] block holds (vLLM's block sizes are 16 by default, up to 64
/// for the kernels that take larger ones); longer blocks stream through [`HashSink`].
pub(super) const SMALL_BLOCK_TOKENS: usize = 64;
/// The encoder's buffer: the widest block it takes (37 bytes of heads and parent, 64 tokens
/// of at most 5 bytes, the null: 358) with SHA-256's padding after it (the 0x80, a 64-byte
/// window of zeros, the length) and room for the 8-byte stores the token loop makes.
const ENC_BYTES: usize = 512 + 8;
/// Every position the token loop stores at is below this (358 < 512); masking the position
/// with `ENC_MASK` shows the compiler the 8-byte store fits without a check per token.
const ENC_MASK: usize = 511;

/// Encodes one block after another of the same shape (`[parent, [n tokens], null]`, a parent
/// of one length) into a buffer owned for a whole prompt: the array heads are written once,
/// the parent's digest goes into its slot, and nothing is zeroed per block (every byte the
/// hash reads is written first: the block, then the padding).
#[derive(Clone)]
pub(super) struct BlockEncoder {
    buf: [u8; ENC_BYTES],
    parent_at: usize,
    parent_len: usize,
    tokens_at: usize,
    n_tokens: usize,
}

impl BlockEncoder {
    /// An encoder for no block yet; [`BlockEncoder::start`] sets its shape. Built and then
    /// started in place: moving it would copy its buffer.
    #[inline]
    pub(super) fn empty() -> Self {
        BlockEncoder {
            buf: [0; ENC_BYTES],
            parent_at: 0,
            parent_len: 0,
            tokens_at: 0,
            n_tokens: usize::MAX,
        }
    }

    /// Writes the heads of a block with a parent of `parent_len` bytes and `n_tokens` tokens;
    /// `false` (and the encoder takes no block) for blocks it does not take: over 64 tokens
    /// or a parent over 32 bytes.
    pub(super) fn start(&mut self, parent_len: usize, n_tokens: usize) -> bool {
        if n_tokens > SMALL_BLOCK_TOKENS || parent_len > 32 {
            self.n_tokens = usize::MAX;
            return false;
        }
        let mut cursor = Cursor {
            buf: &mut self.buf,
            at: 0,
        };
        write_head(&mut cursor, ARRAY, 3);
        write_head(&mut cursor, BYTES, parent_len as u64);
        let parent_at = cursor.at;
        cursor.at += parent_len;
        write_head(&mut cursor, ARRAY, n_tokens as u64);
        self.tokens_at = cursor.at;
        self.parent_at = parent_at;
        self.parent_len = parent_len;
        self.n_tokens = n_tokens;
        true
    }

    /// Puts the parent digest in its slot; it stays there for every block until the next call.
    /// A digest of another length than the encoder was started for (or an encoder not
    /// started) is ignored: such an encoder takes no block.
    #[inline]
    pub(super) fn set_parent(&mut self, parent: &[u8]) {
        if parent.len() != self.parent_len {
            return;
        }
        let slot = &mut self.buf[self.parent_at..self.parent_at + self.parent_len];
        // The two digest lengths as fixed-size copies (two or one vector moves) rather than
        // a call to `memcpy` per block.
        match (<&[u8; 32]>::try_from(parent), <&[u8; 16]>::try_from(parent)) {
            (Ok(digest), _) => slot.copy_from_slice(digest),
            (_, Ok(digest)) => slot.copy_from_slice(digest),
            _ => slot.copy_from_slice(parent),
        }
    }

    /// Encodes `tokens` after the heads and the parent and hashes the block; `None` when a
    /// token id is over `u32::MAX` (the 9-byte form, which only the streaming path writes) or
    /// `tokens` is not the length the encoder was started for.
    #[inline]
    pub(super) fn hash<H: StreamHash, T: Copy + Into<u64>>(
        &mut self,
        tokens: &[T],
    ) -> Option<BlockDigest> {
        if tokens.len() != self.n_tokens {
            return None;
        }
        let end = put_tokens(&mut self.buf, self.tokens_at, tokens)?;
        self.buf[end] = NULL;
        Some(H::one_shot(&mut self.buf, end + 1))
    }
}

/// SHA-256's padding of a `len`-byte message in place after it (FIPS 180-4 §5.1.1: 0x80,
/// zeros, the length in bits as a big-endian u64), returning the padded length. The zeros are
/// one fixed 64-byte store window rather than a fill of varying length.
#[inline]
pub(super) fn pad_sha256(buf: &mut [u8; ENC_BYTES], len: usize) -> usize {
    let padded = (len + 9).next_multiple_of(64);
    buf[len] = 0x80;
    buf[len + 1..][..64].fill(0);
    buf[padded - 8..padded].copy_from_slice(&(len as u64 * 8).to_be_bytes());
    padded
}

/// The buffer [`StreamHash::one_shot`] hashes from.
pub(super) type EncBuf = [u8; ENC_BYTES];

/// Stores `tokens` as CBOR unsigned ints from `at` and returns the position after them;
/// `None` if one is over `u32::MAX`. One store per token, of its form picked without branches
/// (token ids of a real vocabulary straddle the 1-, 2- and 4-byte forms at random, and a
/// mispredicted branch per token cost more than the SHA-256 compression itself), at a position
/// that advances by the form's length.
#[inline(always)]
fn put_tokens<T: Copy + Into<u64>>(
    buf: &mut [u8; ENC_BYTES],
    mut at: usize,
    tokens: &[T],
) -> Option<usize> {
    debug_assert!(tokens.len() <= SMALL_BLOCK_TOKENS && at <= 40);
    let mut wide = 0;
    for &token in tokens {
        let v: u64 = token.into();
        wide |= v >> 32;
        at = put_word(buf, at, token_word(v as u32));
    }
    (wide == 0).then_some(at)
}

/// Stores a token's word at `at` (the bytes past its form's end are overwritten by what
/// follows) and returns the position after the form.
#[inline(always)]
fn put_word(buf: &mut [u8; ENC_BYTES], at: usize, word: u64) -> usize {
    let at = at & ENC_MASK;
    buf[at..at + 8].copy_from_slice(&word.to_le_bytes());
    at + (word >> 56) as usize
}

/// A token id's CBOR form as the little-endian word of its bytes (head first, then the
/// payload most significant byte first), with its length in the top byte.
///
/// The id's bytes most significant first (`[b3, b2, b1, b0]`), rotated up a byte, are the
/// 4-byte form's payload (`[0, b3, b2, b1, b0]`); rotated down by 8, 16 or 24 bits they are the
/// 2-byte, 1-byte and inline forms' (the bytes above the value's width are zero, so nothing
/// wraps round but zeros). The form follows from the value's bit length, looked up in two
/// tables, except for the inline form, which ends at 23 rather than at a power of two and
/// takes a select of its own.
#[inline(always)]
fn token_word(v: u32) -> u64 {
    // `2v + 1` is never zero, and one `lea` where `v | 1` is a copy and an `or`.
    let bits = (u64::from(v) * 2 + 1).ilog2() as usize;
    let payload = u64::from(v.swap_bytes()).rotate_right(FORM_ROTATE[bits]);
    let word = payload | FORM_HEAD[bits];
    select_unpredictable(v < 24, u64::from(v) | 1 << 56, word)
}

/// How far the payload rotates down for a value of `i - 1` bits (`i` is the bit length of
/// `2v + 1`): 16 for the 1-byte form (below 2^8), 8 for the 2-byte form (below 2^16), and 56,
/// a byte up, for the 4-byte form.
const FORM_ROTATE: [u32; 34] = {
    let mut table = [56; 34];
    let mut i = 0;
    while i <= 16 {
        table[i] = if i <= 8 { 16 } else { 8 };
        i += 1;
    }
    table
};

/// The form's head byte (`0x18`, `0x19`, `0x1a`) and its length in the top byte, by the same
/// index as [`FORM_ROTATE`].
const FORM_HEAD: [u64; 34] = {
    let mut table = [0; 34];
    let mut i = 0;
    while i < 34 {
        table[i] = match i {
            0..=8 => 24 | 2 << 56,
            9..=16 => 25 | 3 << 56,
            _ => 26 | 5 << 56,
        };
        i += 1;
    }
    table
};
