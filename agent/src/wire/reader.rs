//! A bounds-checked, allocation-free msgpack cursor over one payload.
//!
//! Only what the event decoder needs: markers, lengths, integers, floats, strings, binaries and
//! skipping any value. Every read checks the remaining length first, so no input can make it
//! index out of bounds; skipping is iterative, so no nesting depth can overflow the stack.

use super::WireError;

/// Byte offset in the payload, for error messages.
pub(crate) type Offset = usize;

/// An integer as msgpack carried it: non-negative values as `U`, negative as `I`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int {
    U(u64),
    I(i64),
}

impl Int {
    pub(crate) fn as_i64(self) -> Option<i64> {
        match self {
            Int::U(u) => i64::try_from(u).ok(),
            Int::I(i) => Some(i),
        }
    }
}

/// The kind of the next value, read from its marker byte without consuming anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
    /// 0xc1, which msgpack never uses.
    Reserved,
}

#[derive(Clone)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(crate) fn pos(&self) -> Offset {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn truncated(&self) -> WireError {
        WireError::Truncated { offset: self.pos }
    }

    fn unexpected(&self, expected: &'static str) -> WireError {
        WireError::UnexpectedType {
            offset: self.pos,
            expected,
            found: self.peek_kind().map_or("end of input", kind_name),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).ok_or_else(|| self.truncated())?;
        let slice = self
            .buf
            .get(self.pos..end)
            .ok_or_else(|| self.truncated())?;
        self.pos = end;
        Ok(slice)
    }

    fn byte(&mut self) -> Result<u8, WireError> {
        let b = *self.buf.get(self.pos).ok_or_else(|| self.truncated())?;
        self.pos += 1;
        Ok(b)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<usize, WireError> {
        Ok(usize::from(self.byte()?))
    }

    fn u16(&mut self) -> Result<usize, WireError> {
        Ok(usize::from(u16::from_be_bytes(self.be()?)))
    }

    fn u32(&mut self) -> Result<usize, WireError> {
        // usize is at least 32 bits on every target this builds for.
        usize::try_from(u32::from_be_bytes(self.be()?)).map_err(|_| self.truncated())
    }

    pub(crate) fn peek_kind(&self) -> Option<Kind> {
        self.buf.get(self.pos).map(|&m| marker_kind(m))
    }

    pub(crate) fn at_end(&self) -> bool {
        self.pos >= self.buf.len()
    }

    /// Consumes a nil if one is next; says whether it did.
    pub(crate) fn nil(&mut self) -> bool {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    pub(crate) fn array_len(&mut self) -> Result<usize, WireError> {
        self.container_len(0x90, 0xdc, "array")
    }

    pub(crate) fn map_len(&mut self) -> Result<usize, WireError> {
        self.container_len(0x80, 0xde, "map")
    }

    /// The length of an array or map: `fix` is the fix-form marker with length 0 (lengths up to
    /// 15 in its low nibble), `wide` the 16-bit form's marker (the 32-bit form follows it).
    fn container_len(&mut self, fix: u8, wide: u8, what: &'static str) -> Result<usize, WireError> {
        match self.buf.get(self.pos) {
            Some(&m) if m & 0xf0 == fix => {
                self.pos += 1;
                Ok(usize::from(m & 0x0f))
            }
            Some(&m) if m == wide => {
                self.pos += 1;
                self.u16()
            }
            Some(&m) if m == wide + 1 => {
                self.pos += 1;
                self.u32()
            }
            _ => Err(self.unexpected(what)),
        }
    }

    pub(crate) fn int(&mut self) -> Result<Int, WireError> {
        let Some(&m) = self.buf.get(self.pos) else {
            return Err(self.truncated());
        };
        let v = match m {
            0x00..=0x7f => {
                self.pos += 1;
                Int::U(u64::from(m))
            }
            0xe0..=0xff => {
                self.pos += 1;
                Int::I(i64::from(m as i8))
            }
            0xcc => {
                self.pos += 1;
                Int::U(u64::from(self.byte()?))
            }
            0xcd => {
                self.pos += 1;
                Int::U(u64::from(u16::from_be_bytes(self.be()?)))
            }
            0xce => {
                self.pos += 1;
                Int::U(u64::from(u32::from_be_bytes(self.be()?)))
            }
            0xcf => {
                self.pos += 1;
                Int::U(u64::from_be_bytes(self.be()?))
            }
            0xd0 => {
                self.pos += 1;
                Int::I(i64::from(i8::from_be_bytes(self.be()?)))
            }
            0xd1 => {
                self.pos += 1;
                Int::I(i64::from(i16::from_be_bytes(self.be()?)))
            }
            0xd2 => {
                self.pos += 1;
                Int::I(i64::from(i32::from_be_bytes(self.be()?)))
            }
            0xd3 => {
                self.pos += 1;
                Int::I(i64::from_be_bytes(self.be()?))
            }
            _ => return Err(self.unexpected("integer")),
        };
        // Signed encodings of non-negative values are legal msgpack; normalise them.
        Ok(match v {
            Int::I(i) if i >= 0 => Int::U(i.unsigned_abs()),
            other => other,
        })
    }

    /// A float, or an integer read as one (a defensive reading of `ts`).
    pub(crate) fn f64(&mut self) -> Result<f64, WireError> {
        match self.buf.get(self.pos) {
            Some(0xca) => {
                self.pos += 1;
                Ok(f64::from(f32::from_be_bytes(self.be()?)))
            }
            Some(0xcb) => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            Some(_) if self.peek_kind() == Some(Kind::Int) => Ok(match self.int()? {
                Int::U(u) => u as f64,
                Int::I(i) => i as f64,
            }),
            _ => Err(self.unexpected("float")),
        }
    }

    pub(crate) fn bool(&mut self) -> Result<bool, WireError> {
        match self.buf.get(self.pos) {
            Some(0xc2) => {
                self.pos += 1;
                Ok(false)
            }
            Some(0xc3) => {
                self.pos += 1;
                Ok(true)
            }
            _ => Err(self.unexpected("bool")),
        }
    }

    /// An unsigned integer that fits in u32, in the forms token ids take (fixint, u8, u16,
    /// u32), consumed only when it is one; `None` leaves the cursor for [`Reader::int`]'s
    /// general path and its errors. The hot loop of `token_ids`.
    #[inline]
    pub(crate) fn small_uint(&mut self) -> Option<u32> {
        let rest = self.buf.get(self.pos..)?;
        let (value, width) = match *rest {
            [m @ 0x00..=0x7f, ..] => (u32::from(m), 1),
            [0xcc, b, ..] => (u32::from(b), 2),
            [0xcd, a, b, ..] => (u32::from(u16::from_be_bytes([a, b])), 3),
            [0xce, a, b, c, d, ..] => (u32::from_be_bytes([a, b, c, d]), 5),
            _ => return None,
        };
        self.pos += width;
        Some(value)
    }

    /// A u64 in its 8-byte form (how vLLM writes block hashes), consumed only when it is one.
    #[inline]
    pub(crate) fn u64_exact(&mut self) -> Option<u64> {
        let rest = self.buf.get(self.pos..)?;
        match *rest {
            [0xcf, a, b, c, d, e, f, g, h, ..] => {
                self.pos += 9;
                Some(u64::from_be_bytes([a, b, c, d, e, f, g, h]))
            }
            _ => None,
        }
    }

    pub(crate) fn str(&mut self) -> Result<&'a str, WireError> {
        let start = self.pos;
        let bytes = self.str_bytes()?;
        std::str::from_utf8(bytes).map_err(|_| WireError::InvalidUtf8 { offset: start })
    }

    /// A string's bytes, not checked for UTF-8: for comparing against known keys and tags,
    /// where a string that is not UTF-8 simply matches none of them.
    pub(crate) fn str_bytes(&mut self) -> Result<&'a [u8], WireError> {
        let len = match self.buf.get(self.pos) {
            Some(&m @ 0xa0..=0xbf) => {
                self.pos += 1;
                usize::from(m & 0x1f)
            }
            Some(0xd9) => {
                self.pos += 1;
                self.u8()?
            }
            Some(0xda) => {
                self.pos += 1;
                self.u16()?
            }
            Some(0xdb) => {
                self.pos += 1;
                self.u32()?
            }
            _ => return Err(self.unexpected("string")),
        };
        self.take(len)
    }

    pub(crate) fn bin(&mut self) -> Result<&'a [u8], WireError> {
        let len = match self.buf.get(self.pos) {
            Some(0xc4) => {
                self.pos += 1;
                self.u8()?
            }
            Some(0xc5) => {
                self.pos += 1;
                self.u16()?
            }
            Some(0xc6) => {
                self.pos += 1;
                self.u32()?
            }
            _ => return Err(self.unexpected("binary")),
        };
        self.take(len)
    }

    /// An extension value: its type byte and data.
    pub(crate) fn ext(&mut self) -> Result<(i8, &'a [u8]), WireError> {
        if self.peek_kind() != Some(Kind::Ext) {
            return Err(self.unexpected("extension"));
        }
        let len = match self.byte()? {
            0xd4 => 1,
            0xd5 => 2,
            0xd6 => 4,
            0xd7 => 8,
            0xd8 => 16,
            0xc7 => self.u8()?,
            0xc8 => self.u16()?,
            _ => self.u32()?,
        };
        let ty = self.byte()? as i8;
        Ok((ty, self.take(len)?))
    }

    /// Skips one complete value of any kind, however deeply nested, without recursion.
    pub(crate) fn skip(&mut self) -> Result<(), WireError> {
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            let Some(&m) = self.buf.get(self.pos) else {
                return Err(self.truncated());
            };
            match marker_kind(m) {
                Kind::Nil | Kind::Bool => self.pos += 1,
                Kind::Int => {
                    self.int()?;
                }
                Kind::Float => {
                    self.f64()?;
                }
                Kind::Str => {
                    self.str_bytes()?;
                }
                Kind::Bin => {
                    self.bin()?;
                }
                Kind::Ext => {
                    self.ext()?;
                }
                Kind::Array => {
                    let n = self.array_len()?;
                    // Each element takes at least one byte: a larger count is a lie.
                    if n > self.remaining() {
                        return Err(self.truncated());
                    }
                    pending += n as u64;
                }
                Kind::Map => {
                    let n = self.map_len()?;
                    if n.saturating_mul(2) > self.remaining() {
                        return Err(self.truncated());
                    }
                    pending += 2 * n as u64;
                }
                Kind::Reserved => {
                    return Err(WireError::UnexpectedType {
                        offset: self.pos,
                        expected: "any value",
                        found: "reserved marker 0xc1",
                    });
                }
            }
        }
        Ok(())
    }
}

pub(crate) fn marker_kind(m: u8) -> Kind {
    match m {
        0x00..=0x7f | 0xcc..=0xd3 | 0xe0..=0xff => Kind::Int,
        0x80..=0x8f | 0xde | 0xdf => Kind::Map,
        0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
        0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
        0xc0 => Kind::Nil,
        0xc1 => Kind::Reserved,
        0xc2 | 0xc3 => Kind::Bool,
        0xc4..=0xc6 => Kind::Bin,
        0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
        0xca | 0xcb => Kind::Float,
    }
}

pub(crate) fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Nil => "nil",
        Kind::Bool => "bool",
        Kind::Int => "integer",
        Kind::Float => "float",
        Kind::Str => "string",
        Kind::Bin => "binary",
        Kind::Array => "array",
        Kind::Map => "map",
        Kind::Ext => "extension",
        Kind::Reserved => "reserved marker 0xc1",
    }
}
