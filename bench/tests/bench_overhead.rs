//! `llmgw-bench-overhead` at toy size (debug builds, from `cargo build --workspace --bins`):
//! the whole bench runs against a real router, the protocol-floor server, two sims and five
//! real Envoys, and reports every path. The bench itself fails when any routed Envoy failed open
//! instead of asking its ext_proc server, so a zero exit status means every routed request was
//! answered over ext_proc. No timing is judged.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::process::Command;

use llmgw_integration::{bin_path, repo_root};

#[test]
fn every_path_is_measured_and_answered_over_ext_proc() {
    let json = repo_root()
        .join("target")
        .join(format!("bench-overhead-test-{}.json", std::process::id()));
    let mut command = Command::new(bin_path("llmgw-bench-overhead"));
    command
        .args(["--sizes", "1024", "--rate", "50", "--requests", "20"])
        .args(["--warmup", "2", "--router-arg=--weight-prefix=0"])
        .arg("--json")
        .arg(&json);
    let (stdout, rows) = llmgw_bench::run_bench(command, &json);
    let rows = rows.as_array().cloned().expect("JSON rows");
    let row = |path: &str| {
        rows.iter()
            .find(|r| r["path"] == path)
            .unwrap_or_else(|| panic!("no {path} row in {rows:?}"))
    };
    for path in ["baseline", "floor", "buffered", "streamed", "full_duplex"] {
        assert_eq!(row(path)["requests"], 20, "{path}: {rows:?}");
        assert!(row(path)["p50_ms"].as_f64().is_some_and(|ms| ms > 0.0));
    }
    // The router reports its decisions; the floor server has no metrics.
    for path in ["buffered", "streamed", "full_duplex"] {
        let decision = row(path)["decision_cpu_us"].as_f64();
        assert!(decision.is_some_and(|us| us > 0.0), "{path}: {rows:?}");
    }
    assert!(row("floor")["decision_cpu_us"].is_null(), "{rows:?}");
    assert!(row("floor")["router_cpu_us_per_request"].is_number());
    assert!(row("buffered_over_floor")["added_p50_ms"].is_number());
    assert!(stdout.contains("| 1 KB | buffered − floor |"), "{stdout}");
    assert!(stdout.contains("* 1 KB: decision CPU "), "{stdout}");
}
