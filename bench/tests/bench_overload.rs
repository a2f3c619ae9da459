//! `llmgw-bench-overload` at toy size (debug builds, from `cargo build --workspace --bins`):
//! every phase runs against real sims, a real router and a real Envoy, and the report counts
//! what it sent and how it ended. No timing is judged.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::process::Command;

use llmgw_integration::{bin_path, repo_root};

#[test]
fn every_phase_runs_and_every_request_is_accounted_for() {
    let out = repo_root()
        .join("target")
        .join(format!("bench-overload-test-{}", std::process::id()));
    let json = out.join("report.json");
    let mut command = Command::new(bin_path("llmgw-bench-overload"));
    command
        .args([
            "--calibrate-seconds",
            "2",
            "--alone-seconds",
            "2",
            "--seconds",
            "3",
        ])
        .args([
            "--warmup-seconds",
            "1",
            "--decode-us",
            "10000",
            "--max-num-seqs",
            "4",
        ])
        .arg("--out-dir")
        .arg(&out)
        .arg("--json")
        .arg(&json);
    let (stdout, report) = llmgw_bench::run_bench(command, &json);
    let _ = std::fs::remove_dir_all(&out);
    assert!(report["capacity_per_s"].as_f64().is_some_and(|c| c > 0.0));
    let count = |row: &serde_json::Value, key: &str| row[key].as_u64().unwrap_or(0);
    for (phase, classes) in [
        ("alone", &["interactive"][..]),
        (
            "overload",
            &["interactive", "batch-noisy", "batch-quiet"][..],
        ),
    ] {
        for class in classes {
            let row = &report[phase][class];
            let shed: u64 = row["shed"]
                .as_object()
                .map_or(0, |m| m.values().filter_map(|v| v.as_u64()).sum());
            assert!(count(row, "sent") > 0, "{phase} {class}: {row}");
            // Every request sent was served, shed or failed, and none failed.
            assert_eq!(
                count(row, "served") + shed + count(row, "failed"),
                count(row, "sent"),
                "{phase} {class}: {row}"
            );
            assert_eq!(count(row, "failed"), 0, "{phase} {class}: {row}");
        }
    }
    // The interactive objective reached the router's flow control with its priority.
    let outcomes = report["router_outcomes"]
        .as_object()
        .expect("router outcomes");
    assert!(outcomes.keys().any(|k| k.ends_with("@10")), "{outcomes:?}");
    assert_eq!(report["checks"].as_array().map(Vec::len), Some(2));
    assert!(stdout.contains("### checks"), "{stdout}");
}
