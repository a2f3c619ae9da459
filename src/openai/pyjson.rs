//! Python's `json.dumps` (default settings) of a JSON value, from the JSON text: vLLM writes a
//! tool call's arguments into the chat template that way (`json.dumps(block.input)` in its
//! Anthropic conversion), so the router must produce the same characters to render the same
//! tokens. Default `json.dumps` means: `", "` and `": "` separators, `ensure_ascii` (every
//! character outside printable ASCII as `\uXXXX`, astral ones as surrogate pairs), keys in the
//! order the text gives them (a repeated key keeps its first place and its last value, as a
//! Python dict does), integers as written (`-0` is `0`), other numbers as Python's float `repr`
//! (`1e-07`, `1e+20`, `100000.0`, `Infinity` past f64).
//!
//! A recursive walk over text the caller has checked is JSON, at most [`MAX_DEPTH`] deep.

use std::collections::HashMap;
use std::fmt::Write as _;

use super::skim;

/// Nesting deeper than this is refused (each level is a stack frame here).
pub const MAX_DEPTH: usize = 128;

/// Objects up to this many keys find a repeated key by scanning; past it, by a map, so that a
/// body of many keys costs linear time, not quadratic.
const SCANNED_KEYS: usize = 16;

/// Why a value cannot be rewritten.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PyJsonError {
    #[error("nested deeper than {MAX_DEPTH} levels")]
    TooDeep,
    #[error("not JSON: {0}")]
    Invalid(#[from] skim::SkimError),
}

/// `json.dumps(json.loads(raw))`.
pub fn dumps(raw: &str) -> Result<String, PyJsonError> {
    let mut out = String::with_capacity(raw.len() + raw.len() / 8);
    let bytes = raw.as_bytes();
    let start = skim::skip_whitespace(bytes, 0);
    let end = write_value(raw, start, 0, &mut out)?;
    if skim::skip_whitespace(bytes, end) != bytes.len() {
        return Err(PyJsonError::Invalid(skim::SkimError {
            offset: end,
            what: "trailing characters",
        }));
    }
    Ok(out)
}

/// Writes the value at `pos` (no leading whitespace); returns where it ends.
fn write_value(
    raw: &str,
    pos: usize,
    depth: usize,
    out: &mut String,
) -> Result<usize, PyJsonError> {
    let bytes = raw.as_bytes();
    match bytes.get(pos) {
        Some(b'{') => {
            if depth >= MAX_DEPTH {
                return Err(PyJsonError::TooDeep);
            }
            // (key, rendered value), in first-seen order.
            let mut members: Vec<(String, String)> = Vec::new();
            // The position of `members[..positions.len()]`'s keys, filled once the object
            // outgrows a scan.
            let mut positions: HashMap<String, usize> = HashMap::new();
            let mut at = skim::skip_whitespace(bytes, pos + 1);
            if bytes.get(at) == Some(&b'}') {
                out.push_str("{}");
                return Ok(at + 1);
            }
            loop {
                let key_end = skim::string_end(bytes, at)?;
                let key: String = decode_string(&raw[at..key_end])?;
                at = skim::skip_whitespace(bytes, key_end);
                at = skim::skip_whitespace(bytes, at + 1); // past ':'
                let mut value = String::new();
                at = skim::skip_whitespace(bytes, write_value(raw, at, depth + 1, &mut value)?);
                let seen = if members.len() <= SCANNED_KEYS {
                    members.iter().position(|(k, _)| *k == key)
                } else {
                    for (i, (k, _)) in members.iter().enumerate().skip(positions.len()) {
                        positions.insert(k.clone(), i);
                    }
                    positions.get(&key).copied()
                };
                match seen.and_then(|i| members.get_mut(i)) {
                    Some(existing) => existing.1 = value,
                    None => members.push((key, value)),
                }
                match bytes.get(at) {
                    Some(b',') => at = skim::skip_whitespace(bytes, at + 1),
                    _ => break,
                }
            }
            out.push('{');
            for (i, (key, value)) in members.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_string(key, out);
                out.push_str(": ");
                out.push_str(value);
            }
            out.push('}');
            Ok(at + 1)
        }
        Some(b'[') => {
            if depth >= MAX_DEPTH {
                return Err(PyJsonError::TooDeep);
            }
            let mut at = skim::skip_whitespace(bytes, pos + 1);
            out.push('[');
            if bytes.get(at) == Some(&b']') {
                out.push(']');
                return Ok(at + 1);
            }
            let mut first = true;
            loop {
                if !first {
                    out.push_str(", ");
                }
                first = false;
                at = skim::skip_whitespace(bytes, write_value(raw, at, depth + 1, out)?);
                match bytes.get(at) {
                    Some(b',') => at = skim::skip_whitespace(bytes, at + 1),
                    _ => break,
                }
            }
            out.push(']');
            Ok(at + 1)
        }
        Some(b'"') => {
            let end = skim::string_end(bytes, pos)?;
            write_string(&decode_string(&raw[pos..end])?, out);
            Ok(end)
        }
        _ => {
            let end = skim::value_end(bytes, pos)?;
            let text = &raw[pos..end];
            match text {
                "true" | "false" | "null" => out.push_str(text),
                _ if text.contains(['.', 'e', 'E']) => write_float(text, out),
                // Python reads an integer exactly, however long.
                "-0" => out.push('0'),
                _ => out.push_str(text),
            }
            Ok(end)
        }
    }
}

fn decode_string(quoted: &str) -> Result<String, PyJsonError> {
    serde_json::from_str(quoted).map_err(|_| {
        PyJsonError::Invalid(skim::SkimError {
            offset: 0,
            what: "invalid string",
        })
    })
}

/// A string as `json.dumps` writes it with `ensure_ascii`.
fn write_string(text: &str, out: &mut String) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    // Writing into a String cannot fail.
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

/// A JSON number with a fraction or an exponent, as Python's `repr(float(text))`.
fn write_float(text: &str, out: &mut String) {
    let value: f64 = text.parse().unwrap_or(f64::NAN);
    if value.is_infinite() {
        out.push_str(if value > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    if value.is_nan() {
        out.push_str("NaN");
        return;
    }
    // The shortest digits that read back as `value`, and the decimal exponent of the first.
    let sci = format!("{value:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if negative {
        out.push('-');
    }
    // Python's repr switches to an exponent when the point would sit past 16 digits, or more
    // than four zeros in.
    if !(-4..16).contains(&exponent) {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let sign = if exponent < 0 { '-' } else { '+' };
        let _ = write!(out, "e{sign}{:02}", exponent.unsigned_abs());
    } else if exponent >= 0 {
        let point = exponent as usize + 1;
        if digits.len() <= point {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', point - digits.len()));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..point]);
            out.push('.');
            out.push_str(&digits[point..]);
        }
    } else {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-exponent - 1) as usize));
        out.push_str(&digits);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_what_pythons_json_dumps_writes() {
        // Each right-hand side is CPython 3.12's json.dumps(json.loads(left)).
        for (raw, python) in [
            (r#"{}"#, r#"{}"#),
            (r#"[]"#, r#"[]"#),
            (
                r#"{"a":1,"b":[1,2.5,true,null]}"#,
                r#"{"a": 1, "b": [1, 2.5, true, null]}"#,
            ),
            (r#"{"z":1,"a":2}"#, r#"{"z": 1, "a": 2}"#),
            (r#"{"k":1,"j":2,"k":3}"#, r#"{"k": 3, "j": 2}"#),
            (r#" [ 1 , { "x" : "y" } ] "#, r#"[1, {"x": "y"}]"#),
            (r#""caf\u00e9 é 😀""#, r#""caf\u00e9 \u00e9 \ud83d\ude00""#),
            (
                r#""q\"b\\s/\n\r\t\b\f\u0001\u007f""#,
                r#""q\"b\\s/\n\r\t\b\f\u0001\u007f""#,
            ),
            (r#"-0"#, r#"0"#),
            (
                r#"123456789012345678901234567890"#,
                r#"123456789012345678901234567890"#,
            ),
            (r#"-0.0"#, r#"-0.0"#),
            (r#"1.0"#, r#"1.0"#),
            (r#"1e5"#, r#"100000.0"#),
            (r#"1e15"#, r#"1000000000000000.0"#),
            (r#"1e16"#, r#"1e+16"#),
            (r#"1.5e16"#, r#"1.5e+16"#),
            (r#"123456789012345678.0"#, r#"1.2345678901234568e+17"#),
            (r#"0.0001"#, r#"0.0001"#),
            (r#"0.00001"#, r#"1e-05"#),
            (r#"1.5e-10"#, r#"1.5e-10"#),
            (r#"0.1"#, r#"0.1"#),
            (r#"2.675"#, r#"2.675"#),
            (r#"1e400"#, r#"Infinity"#),
            (r#"-1e400"#, r#"-Infinity"#),
            (r#"5e-324"#, r#"5e-324"#),
            (r#"1.7976931348623157e308"#, r#"1.7976931348623157e+308"#),
        ] {
            assert_eq!(dumps(raw).as_deref(), Ok(python), "{raw}");
        }
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert_eq!(dumps(&deep), Err(PyJsonError::TooDeep));
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(dumps(&ok).is_ok());
    }

    #[test]
    fn a_repeated_key_past_the_scan_keeps_its_first_place_and_last_value() {
        // Keys k0..k39 with values 0..39, then k3, k20 and k39 again (beyond the scanned
        // keys, so the map finds them): Python keeps each key where it first came.
        let mut raw: Vec<String> = (0..40).map(|i| format!(r#""k{i}":{i}"#)).collect();
        raw.extend([r#""k3":"a""#, r#""k20":"b""#, r#""k39":"c""#, r#""new":0"#].map(String::from));
        let raw = format!("{{{}}}", raw.join(","));
        let mut python: Vec<String> = (0..40)
            .map(|i| match i {
                3 => r#""k3": "a""#.to_owned(),
                20 => r#""k20": "b""#.to_owned(),
                39 => r#""k39": "c""#.to_owned(),
                _ => format!(r#""k{i}": {i}"#),
            })
            .collect();
        python.push(r#""new": 0"#.to_owned());
        assert_eq!(dumps(&raw), Ok(format!("{{{}}}", python.join(", "))));
    }
}
