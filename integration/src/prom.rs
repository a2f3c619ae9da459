//! Reading a Prometheus text page (`/metrics` of the router, the agent, vLLM or the simulator)
//! in tests and benches: samples by name and labels. Comment lines and lines that are not a
//! sample are skipped; a label value's `\"` and `\\` escapes are understood.

use std::collections::BTreeMap;

/// One sample line: `name{label="value",...} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    /// In the order written; values with their escapes undone.
    pub labels: Vec<(&'a str, String)>,
    pub value: f64,
}

impl Sample<'_> {
    /// The value of label `key`, if the sample has it.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Whether the sample carries every `(key, value)` of `labels`.
    pub fn has(&self, labels: &[(&str, &str)]) -> bool {
        labels.iter().all(|(k, v)| self.label(k) == Some(*v))
    }
}

/// Every sample of `text`.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(parse_line)
}

/// The sum of the samples named `name` that carry every pair of `labels` (data-parallel engines
/// report one sample each), or `None` when none does.
pub fn sum(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples(text)
        .filter(|s| s.name == name && s.has(labels))
        .map(|s| s.value)
        .reduce(|a, b| a + b)
}

/// The samples named `name`, keyed by their label `key` (samples without it are skipped; a
/// repeated key keeps the sum).
pub fn by_label(text: &str, name: &str, key: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for sample in samples(text).filter(|s| s.name == name) {
        if let Some(value) = sample.label(key) {
            *out.entry(value.to_owned()).or_insert(0.0) += sample.value;
        }
    }
    out
}

/// The samples named `name` as `KEY-VALUE COUNT` by their label `key`, joined with ", ",
/// counts at zero left out: a series exported from the start says nothing until it counts.
/// Empty when nothing counted.
pub fn counted_by_label(text: &str, name: &str, key: &str) -> String {
    let counted: Vec<String> = by_label(text, name, key)
        .iter()
        .filter(|&(_, &count)| count > 0.0)
        .map(|(value, count)| format!("{value} {count:.0}"))
        .collect();
    counted.join(", ")
}

/// `GET url` as text (a scrape).
pub async fn scrape(url: &str) -> Result<String, reqwest::Error> {
    reqwest::get(url).await?.error_for_status()?.text().await
}

fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .unwrap_or(line.len());
    let (name, mut rest) = line.split_at(name_end);
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = after;
        loop {
            rest = rest.trim_start_matches([',', ' ']);
            if let Some(after) = rest.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, after) = rest.split_once("=\"")?;
            let (value, after) = unescape_until_quote(after)?;
            labels.push((key.trim(), value));
            rest = after;
        }
    }
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// A label value up to its closing quote, escapes undone, and the text after the quote.
fn unescape_until_quote(text: &str) -> Option<(String, &str)> {
    let mut value = String::new();
    let mut chars = text.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((value, &text[i + 1..])),
            '\\' => match chars.next()?.1 {
                'n' => value.push('\n'),
                other => value.push(other),
            },
            other => value.push(other),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "\
# HELP vllm:prefix_cache_hits_total Hits.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"tiny\"} 30.0
vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"tiny\"} 12
llmgw_feed_streams 2
llmgw_replica_in_flight{replica=\"127.0.0.1:8001\"} 0
llmgw_replica_in_flight{replica=\"127.0.0.1:8002\"} 3
odd{path=\"a \\\"quoted\\\" \\\\ value\"} 1 1700000000
not a sample
";

    #[test]
    fn sums_by_name_and_labels_and_keys_by_a_label() {
        assert_eq!(sum(PAGE, "vllm:prefix_cache_hits_total", &[]), Some(42.0));
        assert_eq!(
            sum(PAGE, "vllm:prefix_cache_hits_total", &[("engine", "1")]),
            Some(12.0)
        );
        assert_eq!(sum(PAGE, "llmgw_feed_streams", &[]), Some(2.0));
        assert_eq!(
            sum(PAGE, "llmgw_feed", &[]),
            None,
            "a name is matched whole"
        );
        assert_eq!(sum(PAGE, "vllm:prefix_cache_queries_total", &[]), None);
        let in_flight = by_label(PAGE, "llmgw_replica_in_flight", "replica");
        assert_eq!(in_flight.get("127.0.0.1:8002"), Some(&3.0));
        assert_eq!(in_flight.len(), 2);
    }

    #[test]
    fn counted_by_label_leaves_out_counts_at_zero() {
        assert_eq!(
            counted_by_label(PAGE, "llmgw_replica_in_flight", "replica"),
            "127.0.0.1:8002 3"
        );
        assert_eq!(
            counted_by_label(PAGE, "vllm:prefix_cache_hits_total", "engine"),
            "0 30, 1 12"
        );
        assert_eq!(counted_by_label(PAGE, "absent", "replica"), "");
    }

    #[test]
    fn escaped_label_values_and_timestamps_parse() {
        let odd = samples(PAGE).find(|s| s.name == "odd").expect("parsed");
        assert_eq!(odd.label("path"), Some("a \"quoted\" \\ value"));
        assert_eq!(odd.value, 1.0);
        assert_eq!(samples(PAGE).count(), 6);
    }
}
