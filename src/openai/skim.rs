//! A validating JSON skimmer: walks a body once, checking that it is well-formed JSON, and tells
//! where values start and end without building them.
//!
//! Routing reads a handful of short fields from bodies that can be megabytes of prompt. A full
//! parser spends most of its time inside that prompt, stopping at every escape; here a string is
//! crossed sixty-four bytes per step with bit masks (SSE2 on x86_64, part of its baseline, so no
//! run-time detection; plain loops elsewhere), escapes included. It accepts exactly what
//! `serde_json` accepts for values it skips (property tests in `../tests.rs` hold it to that),
//! given that the caller has checked the whole body is UTF-8. Like `serde_json`'s skipping, it walks nested values with an explicit
//! stack, not recursion, so no nesting depth can overflow the thread's stack.
//!
//! Pure functions over a byte slice; no state, and no allocation below 64 levels of nesting.

use std::borrow::Cow;

use thiserror::Error;

/// Why a body is not well-formed JSON, and where.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{what} at byte {offset}")]
pub struct SkimError {
    pub offset: usize,
    pub what: &'static str,
}

fn error<T>(offset: usize, what: &'static str) -> Result<T, SkimError> {
    Err(SkimError { offset, what })
}

/// Walks the top-level object of `body`. For each member, `member` gets the key (decoded) and the
/// offset where its value starts, and returns the offset just past that value: usually
/// [`value_end`]'s answer, or its own when it reads the value itself. Fails unless the whole body
/// is one object, surrounded only by whitespace.
pub fn walk_object<E: From<SkimError>>(
    body: &[u8],
    mut member: impl FnMut(Cow<'_, str>, usize) -> Result<usize, E>,
) -> Result<(), E> {
    let start = skip_whitespace(body, 0);
    let what = match body.get(start) {
        Some(b'{') => None,
        Some(_) => Some("expected a JSON object"),
        None => Some("unexpected end of input"),
    };
    if let Some(what) = what {
        return Err(SkimError {
            offset: start,
            what,
        }
        .into());
    }
    let mut pos = skip_whitespace(body, start + 1);
    if body.get(pos) == Some(&b'}') {
        return finish(body, pos + 1).map_err(E::from);
    }
    loop {
        if body.get(pos) != Some(&b'"') {
            return Err(SkimError {
                offset: pos,
                what: "expected a member name",
            }
            .into());
        }
        let key_end = string_end(body, pos)?;
        let key = decode_key(body, pos, key_end)?;
        pos = expect(body, skip_whitespace(body, key_end), b':', "expected ':'")?;
        let value = skip_whitespace(body, pos);
        pos = skip_whitespace(body, member(key, value)?);
        match body.get(pos) {
            Some(b',') => pos = skip_whitespace(body, pos + 1),
            Some(b'}') => return finish(body, pos + 1).map_err(E::from),
            _ => {
                return Err(SkimError {
                    offset: pos,
                    what: "expected ',' or '}'",
                }
                .into());
            }
        }
    }
}

/// The offset just past the value that starts at `start` (no leading whitespace).
pub fn value_end(body: &[u8], start: usize) -> Result<usize, SkimError> {
    let mut open = OpenContainers::default();
    let mut pos = start;
    loop {
        // One value at `pos`; a container's opening only pushes it.
        match body.get(pos) {
            Some(b'"') => pos = string_end(body, pos)?,
            Some(b'{') => {
                pos = skip_whitespace(body, pos + 1);
                if body.get(pos) == Some(&b'}') {
                    pos += 1;
                } else {
                    open.push(Container::Object);
                    pos = member_name(body, pos)?;
                    continue;
                }
            }
            Some(b'[') => {
                pos = skip_whitespace(body, pos + 1);
                if body.get(pos) == Some(&b']') {
                    pos += 1;
                } else {
                    open.push(Container::Array);
                    continue;
                }
            }
            Some(b't') => pos = literal_end(body, pos, b"true")?,
            Some(b'f') => pos = literal_end(body, pos, b"false")?,
            Some(b'n') => pos = literal_end(body, pos, b"null")?,
            Some(b'-' | b'0'..=b'9') => pos = number_end(body, pos)?,
            Some(_) => return error(pos, "expected a value"),
            None => return error(pos, "unexpected end of input"),
        }
        // After a value: a comma leads to the next one; closing brackets pop.
        loop {
            let Some(container) = open.top() else {
                return Ok(pos);
            };
            pos = skip_whitespace(body, pos);
            match (container, body.get(pos)) {
                (Container::Array, Some(b',')) => {
                    pos = skip_whitespace(body, pos + 1);
                    break;
                }
                (Container::Object, Some(b',')) => {
                    pos = member_name(body, skip_whitespace(body, pos + 1))?;
                    break;
                }
                (Container::Array, Some(b']')) | (Container::Object, Some(b'}')) => {
                    open.pop();
                    pos += 1;
                }
                (Container::Array, _) => return error(pos, "expected ',' or ']'"),
                (Container::Object, _) => return error(pos, "expected ',' or '}'"),
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Container {
    Array,
    Object,
}

/// The arrays and objects a skipped value is inside: a bit per level, the first 64 inline.
#[derive(Default)]
struct OpenContainers {
    depth: usize,
    /// Bit `i` set: level `i` is an object.
    inline: u64,
    deeper: Vec<Container>,
}

impl OpenContainers {
    fn push(&mut self, container: Container) {
        if self.depth < 64 {
            let bit = 1u64 << self.depth;
            if container == Container::Object {
                self.inline |= bit;
            } else {
                self.inline &= !bit;
            }
        } else {
            self.deeper.push(container);
        }
        self.depth += 1;
    }

    fn top(&self) -> Option<Container> {
        let level = self.depth.checked_sub(1)?;
        if level < 64 {
            Some(if self.inline & (1u64 << level) != 0 {
                Container::Object
            } else {
                Container::Array
            })
        } else {
            self.deeper.last().copied()
        }
    }

    fn pop(&mut self) {
        if self.depth > 64 {
            self.deeper.pop();
        }
        self.depth = self.depth.saturating_sub(1);
    }
}

/// A member name and its colon at `pos`; the offset of the value after them.
fn member_name(body: &[u8], pos: usize) -> Result<usize, SkimError> {
    if body.get(pos) != Some(&b'"') {
        return error(pos, "expected a member name");
    }
    let end = string_end(body, pos)?;
    let value = expect(body, skip_whitespace(body, end), b':', "expected ':'")?;
    Ok(skip_whitespace(body, value))
}

/// Checks that `body` is exactly one JSON value, surrounded only by whitespace.
#[cfg(test)]
pub fn validate(body: &[u8]) -> Result<(), SkimError> {
    let start = skip_whitespace(body, 0);
    let end = value_end(body, start)?;
    finish(body, end)
}

pub fn skip_whitespace(body: &[u8], mut pos: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\r' | b'\t') = body.get(pos) {
        pos += 1;
    }
    pos
}

fn finish(body: &[u8], end: usize) -> Result<(), SkimError> {
    let rest = skip_whitespace(body, end);
    if rest == body.len() {
        Ok(())
    } else {
        error(rest, "trailing characters")
    }
}

fn expect(body: &[u8], pos: usize, byte: u8, what: &'static str) -> Result<usize, SkimError> {
    if body.get(pos) == Some(&byte) {
        Ok(pos + 1)
    } else {
        error(pos, what)
    }
}

fn literal_end(body: &[u8], start: usize, literal: &[u8]) -> Result<usize, SkimError> {
    let end = start + literal.len();
    if body.get(start..end) == Some(literal) {
        Ok(end)
    } else {
        error(start, "expected a value")
    }
}

/// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`
fn number_end(body: &[u8], start: usize) -> Result<usize, SkimError> {
    let digits = |mut pos: usize| {
        while body.get(pos).is_some_and(u8::is_ascii_digit) {
            pos += 1;
        }
        pos
    };
    let mut pos = start;
    if body.get(pos) == Some(&b'-') {
        pos += 1;
    }
    match body.get(pos) {
        Some(b'0') => pos += 1,
        Some(b'1'..=b'9') => pos = digits(pos + 1),
        _ => return error(pos, "invalid number"),
    }
    if body.get(pos) == Some(&b'.') {
        let end = digits(pos + 1);
        if end == pos + 1 {
            return error(end, "invalid number");
        }
        pos = end;
    }
    if let Some(b'e' | b'E') = body.get(pos) {
        pos += 1;
        if let Some(b'+' | b'-') = body.get(pos) {
            pos += 1;
        }
        let end = digits(pos);
        if end == pos {
            return error(end, "invalid number");
        }
        pos = end;
    }
    Ok(pos)
}

/// The offset just past the closing quote of the string whose opening quote is at `open`.
///
/// Sixty-four bytes per step, without a branch per escape: masks of quotes, backslashes and
/// control characters, the escaped bytes worked out from the runs of backslashes (the carry of
/// an add finds odd-length runs, as in simdjson), and the escape letters checked with one more
/// mask when the block has escapes.
pub fn string_end(body: &[u8], open: usize) -> Result<usize, SkimError> {
    let mut pos = open + 1;
    // Bit 0 set: the byte at `pos` is escaped by a backslash run ending the previous block.
    let mut carried_escape = 0u64;
    let mut tail = [0u8; 64];
    loop {
        let block: &[u8; 64] = match body.get(pos..pos + 64).and_then(|b| b.try_into().ok()) {
            Some(block) => block,
            None => {
                // The last bytes, padded with NULs: a control character, so the scan stops at
                // the padding, which is then reported as the end of input.
                let rest = body.get(pos..).unwrap_or_default();
                tail[..rest.len()].copy_from_slice(rest);
                tail[rest.len()..].fill(0);
                &tail
            }
        };
        let masks = structural_masks(block);
        let escaped = escaped_bytes(masks.backslash, &mut carried_escape);
        let stops = (masks.quote & !escaped) | masks.control;
        let before_stop = if stops == 0 {
            u64::MAX
        } else {
            (1u64 << stops.trailing_zeros()) - 1
        };
        let escapes = escaped & before_stop;
        if escapes != 0 {
            check_escapes(body, pos, block, escapes)?;
        }
        if stops != 0 {
            let stop = pos + stops.trailing_zeros() as usize;
            return match body.get(stop) {
                Some(b'"') => Ok(stop + 1),
                Some(_) => error(stop, "control character in a string"),
                None => error(body.len(), "unterminated string"),
            };
        }
        pos += 64;
    }
}

/// Checks the escaped bytes `escapes` of the block at `pos`: each must be an escape letter, and a
/// `u` must have four hex digits after it.
#[cold]
fn check_escapes(body: &[u8], pos: usize, block: &[u8; 64], escapes: u64) -> Result<(), SkimError> {
    let letters = escape_letter_masks(block);
    let invalid = escapes & !letters.any;
    if invalid != 0 {
        let backslash = (pos + invalid.trailing_zeros() as usize).saturating_sub(1);
        return error(backslash, "invalid escape");
    }
    let mut unicode = escapes & letters.u;
    while unicode != 0 {
        let u = pos + unicode.trailing_zeros() as usize;
        let hex = body.get(u + 1..u + 5);
        if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
            return error(u.saturating_sub(1), "invalid \\u escape");
        }
        unicode &= unicode - 1;
    }
    Ok(())
}

/// Which bytes of a block are escaped: the byte after each odd-length run of backslashes.
/// `carried` holds, in bit 0, whether the first byte is escaped by the previous block, and is
/// updated for the next one.
fn escaped_bytes(backslash: u64, carried: &mut u64) -> u64 {
    const EVEN: u64 = 0x5555_5555_5555_5555;
    // An escaped backslash starts no escape.
    let backslash = backslash & !*carried;
    let follows_backslash = (backslash << 1) | *carried;
    // Adding a run's start to the run carries past its end; where it lands tells the run's
    // parity against the start's.
    let odd_starts = backslash & !EVEN & !follows_backslash;
    let (even_starts, overflow) = odd_starts.overflowing_add(backslash);
    *carried = u64::from(overflow);
    (EVEN ^ (even_starts << 1)) & follows_backslash
}

/// One bit per byte of a 64-byte block.
struct StructuralMasks {
    quote: u64,
    backslash: u64,
    /// Bytes below 0x20, which JSON forbids inside strings.
    control: u64,
}

struct EscapeLetterMasks {
    /// `"` `\` `/` `b` `f` `n` `r` `t` `u`
    any: u64,
    u: u64,
}

const ESCAPE_LETTERS: [u8; 9] = [b'"', b'\\', b'/', b'b', b'f', b'n', b'r', b't', b'u'];

#[cfg(target_arch = "x86_64")]
fn structural_masks(block: &[u8; 64]) -> StructuralMasks {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8, _mm_set1_epi8,
    };
    let mut masks = StructuralMasks {
        quote: 0,
        backslash: 0,
        control: 0,
    };
    for (lane, chunk) in block.chunks_exact(16).enumerate() {
        let shift = 16 * lane;
        // SAFETY: SSE2 is part of the x86_64 baseline; the unaligned load reads the 16 bytes of
        // `chunk`.
        let (quote, backslash, control) = unsafe {
            let bytes = _mm_loadu_si128(chunk.as_ptr().cast::<__m128i>());
            // Unsigned `byte <= 0x1f` is `min(byte, 0x1f) == byte`.
            let control = _mm_cmpeq_epi8(_mm_min_epu8(bytes, _mm_set1_epi8(0x1f)), bytes);
            (
                _mm_movemask_epi8(_mm_cmpeq_epi8(bytes, _mm_set1_epi8(b'"' as i8))),
                _mm_movemask_epi8(_mm_cmpeq_epi8(bytes, _mm_set1_epi8(b'\\' as i8))),
                _mm_movemask_epi8(control),
            )
        };
        // movemask fills the low 16 bits only.
        masks.quote |= u64::from(quote as u16) << shift;
        masks.backslash |= u64::from(backslash as u16) << shift;
        masks.control |= u64::from(control as u16) << shift;
    }
    masks
}

#[cfg(target_arch = "x86_64")]
fn escape_letter_masks(block: &[u8; 64]) -> EscapeLetterMasks {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
        _mm_setzero_si128,
    };
    let mut masks = EscapeLetterMasks { any: 0, u: 0 };
    for (lane, chunk) in block.chunks_exact(16).enumerate() {
        let shift = 16 * lane;
        // SAFETY: as in `structural_masks`.
        let (any, u) = unsafe {
            let bytes = _mm_loadu_si128(chunk.as_ptr().cast::<__m128i>());
            let mut any = _mm_setzero_si128();
            for letter in ESCAPE_LETTERS {
                any = _mm_or_si128(any, _mm_cmpeq_epi8(bytes, _mm_set1_epi8(letter as i8)));
            }
            (
                _mm_movemask_epi8(any),
                _mm_movemask_epi8(_mm_cmpeq_epi8(bytes, _mm_set1_epi8(b'u' as i8))),
            )
        };
        masks.any |= u64::from(any as u16) << shift;
        masks.u |= u64::from(u as u16) << shift;
    }
    masks
}

#[cfg(not(target_arch = "x86_64"))]
fn structural_masks(block: &[u8; 64]) -> StructuralMasks {
    structural_masks_scalar(block)
}

#[cfg(not(target_arch = "x86_64"))]
fn escape_letter_masks(block: &[u8; 64]) -> EscapeLetterMasks {
    escape_letter_masks_scalar(block)
}

#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn structural_masks_scalar(block: &[u8; 64]) -> StructuralMasks {
    let mut masks = StructuralMasks {
        quote: 0,
        backslash: 0,
        control: 0,
    };
    for (i, &b) in block.iter().enumerate() {
        masks.quote |= u64::from(b == b'"') << i;
        masks.backslash |= u64::from(b == b'\\') << i;
        masks.control |= u64::from(b < 0x20) << i;
    }
    masks
}

#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn escape_letter_masks_scalar(block: &[u8; 64]) -> EscapeLetterMasks {
    let mut masks = EscapeLetterMasks { any: 0, u: 0 };
    for (i, &b) in block.iter().enumerate() {
        masks.any |= u64::from(ESCAPE_LETTERS.contains(&b)) << i;
        masks.u |= u64::from(b == b'u') << i;
    }
    masks
}

/// A member name between its quotes, decoded when it holds escapes (rare: borrowed otherwise).
fn decode_key(body: &[u8], open: usize, end: usize) -> Result<Cow<'_, str>, SkimError> {
    let inner = &body[open + 1..end - 1];
    if !inner.contains(&b'\\') {
        return std::str::from_utf8(inner)
            .map(Cow::Borrowed)
            .or_else(|_| error(open, "invalid UTF-8"));
    }
    let literal =
        std::str::from_utf8(&body[open..end]).or_else(|_| error(open, "invalid UTF-8"))?;
    // A lone surrogate escape cannot be a Rust string; such a key matches no field anyway.
    Ok(serde_json::from_str::<String>(literal)
        .map(Cow::Owned)
        .unwrap_or(Cow::Borrowed("")))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// The vector masks are the scalar ones.
        #[test]
        fn vector_masks_match_scalar_masks(
            bytes in proptest::collection::vec(
                prop_oneof![any::<u8>(), prop::sample::select(b"\"\\/bfnrtu\x1f\x20".to_vec())],
                64,
            ),
        ) {
            let block: [u8; 64] = bytes.try_into().unwrap();
            let (vector, scalar) = (structural_masks(&block), structural_masks_scalar(&block));
            prop_assert_eq!(
                (vector.quote, vector.backslash, vector.control),
                (scalar.quote, scalar.backslash, scalar.control)
            );
            let (vector, scalar) = (escape_letter_masks(&block), escape_letter_masks_scalar(&block));
            prop_assert_eq!((vector.any, vector.u), (scalar.any, scalar.u));
        }
    }

    /// Escaped bytes against a byte-by-byte walk, for backslash runs of every length that start
    /// anywhere around a block boundary, carried across blocks.
    #[test]
    fn escaped_bytes_follow_backslash_runs_across_blocks() {
        for start in 40..90 {
            for run in 0..8 {
                let mut text = [b'a'; 192];
                text[start..start + run].fill(b'\\');
                let mut expected = vec![false; text.len()];
                let mut i = 0;
                while i < text.len() {
                    if text[i] == b'\\' {
                        expected[i + 1] = true;
                        i += 2;
                    } else {
                        i += 1;
                    }
                }
                let mut carried = 0;
                for (n, block) in text.chunks_exact(64).enumerate() {
                    let block: &[u8; 64] = block.try_into().unwrap();
                    let escaped = escaped_bytes(structural_masks(block).backslash, &mut carried);
                    for bit in 0..64 {
                        assert_eq!(
                            escaped >> bit & 1 == 1,
                            expected[64 * n + bit],
                            "run of {run} at {start}: byte {}",
                            64 * n + bit
                        );
                    }
                }
            }
        }
    }
}
