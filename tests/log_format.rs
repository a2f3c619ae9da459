//! `--log-format json` makes every stderr line of `llmgw-router serve` one JSON object; the
//! default stays human text.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a bench or test harness: a panic is a failed run, not a crashed router"
)]

use std::process::{Command, Output};

use serde_json::Value;

/// `serve` with a replica that does not parse: the error is logged, then the router exits.
fn serve_with_bad_replica(format: Option<&str>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_llmgw-router"));
    command
        .args(["serve", "--replica", "not-a-replica"])
        .env_remove("RUST_LOG")
        .env_remove("LLMGW_LOG_FORMAT")
        .env_remove("LLMGW_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    if let Some(format) = format {
        command.args(["--log-format", format]);
    }
    command.output().expect("llmgw-router runs")
}

fn stderr_lines(output: &Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect()
}

#[test]
fn json_log_lines_parse_and_carry_level_and_message() {
    let output = serve_with_bad_replica(Some("json"));
    assert!(!output.status.success());
    let lines = stderr_lines(&output);
    assert!(!lines.is_empty(), "no log lines");
    let events: Vec<Value> = lines
        .iter()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect();
    let error = events
        .iter()
        .find(|e| e["level"] == "ERROR")
        .unwrap_or_else(|| panic!("no ERROR event in {lines:?}"));
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("not-a-replica")),
        "{error}"
    );
    assert!(error["timestamp"].is_string(), "{error}");
}

#[test]
fn text_is_the_default() {
    let output = serve_with_bad_replica(None);
    assert!(!output.status.success());
    let lines = stderr_lines(&output);
    assert!(
        lines.iter().any(|l| l.contains("not-a-replica")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .all(|l| serde_json::from_str::<Value>(l).is_err()),
        "{lines:?}"
    );
}
