//! Durations as flags and configuration files write them: `250ms`, `2s`, `1m`, or a bare
//! number of seconds. A leaf module: every module that declares a duration option uses it.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};
use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid duration {0:?}: expected e.g. 250ms, 2s, 1m")]
pub struct DurationError(pub String);

/// `250ms`, `2s`, `1m`, or a bare number of seconds.
pub fn parse(text: &str) -> Result<Duration, DurationError> {
    let text = text.trim();
    let invalid = || DurationError(text.to_string());
    let (number, unit) = match text.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => text.split_at(i),
        None => (text, "s"),
    };
    let value: f64 = number.parse().map_err(|_| invalid())?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "s" => value,
        "m" => value * 60.0,
        _ => return Err(invalid()),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| invalid())
}

/// A duration as a file writes it: text, or a number of seconds.
#[derive(Deserialize)]
#[serde(untagged)]
enum Written {
    Seconds(f64),
    Text(String),
}

impl Written {
    fn duration<E: serde::de::Error>(self) -> Result<Duration, E> {
        match self {
            Written::Seconds(seconds) => Duration::try_from_secs_f64(seconds)
                .map_err(|_| E::custom(format!("invalid duration {seconds}"))),
            Written::Text(text) => parse(&text).map_err(E::custom),
        }
    }
}

/// `serde(with = "crate::duration::text")`: a duration field, written back as milliseconds.
pub mod text {
    use super::*;

    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&format!("{}ms", value.as_millis()))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        Written::deserialize(deserializer)?.duration()
    }
}

/// `serde(deserialize_with = "crate::duration::optional")`: an optional duration field.
pub fn optional<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
    Option::<Written>::deserialize(deserializer)?
        .map(Written::duration)
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_in_every_written_form() {
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse("1m"), Ok(Duration::from_secs(60)));
        assert!(parse("fast").is_err());
        assert!(parse("5h").is_err());
        assert!(parse("-1s").is_err());
    }

    #[test]
    fn a_file_may_write_text_or_seconds() {
        #[derive(Deserialize)]
        struct File {
            #[serde(default, deserialize_with = "optional")]
            grace: Option<Duration>,
        }
        let read = |yaml: &str| serde_yaml::from_str::<File>(yaml).map(|f| f.grace);
        assert_eq!(read("grace: 5s").unwrap(), Some(Duration::from_secs(5)));
        assert_eq!(
            read("grace: 0.5").unwrap(),
            Some(Duration::from_millis(500))
        );
        assert_eq!(read("{}").unwrap(), None);
        let err = read("grace: soon").unwrap_err().to_string();
        assert!(err.contains("invalid duration"), "{err}");
    }
}
