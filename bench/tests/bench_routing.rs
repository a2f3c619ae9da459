//! `llmgw-bench-routing` at toy size (debug builds, from `cargo build --workspace --bins`): a
//! hand-placed and a precise run against real sims, a real agent, router and Envoy, with
//! replica 0 killed and restarted mid-run. It checks that both runs finish, count their
//! requests, account for the restarted replica's counters and report where each tenant went; no
//! timing or hit rate is judged.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::path::PathBuf;
use std::process::Command;

use llmgw_integration::{bin_path, repo_root};

/// A toy-sized run's output directory (under `target/`, named for `test`), its report.json, and
/// the bench's command writing there, without its flags.
fn toy_bench(test: &str) -> (PathBuf, PathBuf, Command) {
    let out = repo_root()
        .join("target")
        .join(format!("bench-routing-{test}-{}", std::process::id()));
    let json = out.join("report.json");
    let mut command = Command::new(bin_path("llmgw-bench-routing"));
    command.arg("--out-dir").arg(&out);
    (out, json, command)
}

#[test]
fn a_replica_restarted_mid_run_is_measured_for_every_policy() {
    let (out, json, mut command) = toy_bench("restart");
    command
        .args([
            "--policies",
            "pinned,pinned_failover,llmgw_precise_tokenize",
            "--no-ceiling",
        ])
        .args(["--replicas", "2", "--tenants", "2", "--rate", "6"])
        .args(["--seconds", "6", "--warmup-seconds", "1"])
        .args(["--restart-replica-at", "2", "--restart-downtime-ms", "500"]);
    let (stdout, report) = llmgw_bench::run_bench(command, &json);
    let _ = std::fs::remove_dir_all(&out);
    assert_eq!(
        stdout.matches("restarted with an empty cache").count(),
        3,
        "once per policy:\n{stdout}"
    );
    let rows = report.as_array().expect("one row per policy");
    assert_eq!(rows.len(), 3, "{report}");
    // Hand placement with failover loses no request to the restart.
    assert_eq!(rows[1]["policy"], "pinned_failover", "{report}");
    assert_eq!(rows[1]["errors"], 0, "{report}");
    for row in rows {
        assert!(row["requests"].as_u64().is_some_and(|n| n > 0), "{row}");
        // The restarted sim's counters start again from 0: what it counted before the kill is
        // added back, so the rate stays a rate.
        let hit_rate = row["hit_rate"].as_f64().expect("a hit rate");
        assert!((0.0..=1.0).contains(&hit_rate), "{row}");
    }
    assert!(
        stdout.contains("prompt tokens per replica (share at hit rate): 0: "),
        "{stdout}"
    );
    // Hand placement puts tenant t on replica t: its summary line says so.
    assert!(
        stdout.lines().any(|line| line.starts_with("- pinned:")
            && line.ends_with("tenants per replica: 0: t0, 1: t1")),
        "{stdout}"
    );
}

#[test]
fn policies_take_turns_over_several_runs_and_each_is_summed_up() {
    let (out, json, mut command) = toy_bench("runs");
    command
        .args([
            "--policies",
            "round_robin,pinned",
            "--runs",
            "2",
            "--no-ceiling",
        ])
        .args(["--replicas", "2", "--tenants", "2", "--rate", "6"])
        .args(["--seconds", "4", "--warmup-seconds", "1"]);
    let (stdout, report) = llmgw_bench::run_bench(command, &json);
    let files: Vec<bool> = [
        "run-1/requests-round_robin.csv",
        "run-2/requests-pinned.csv",
    ]
    .iter()
    .map(|f| out.join(f).is_file())
    .collect();
    let _ = std::fs::remove_dir_all(&out);
    assert_eq!(
        files,
        [true, true],
        "each run's requests in its own directory"
    );
    let rows = report.as_array().expect("one row per run of each policy");
    let order: Vec<(&str, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["policy"].as_str().unwrap_or("?"),
                r["run"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        order,
        [
            ("round_robin", 1),
            ("pinned", 1),
            ("round_robin", 2),
            ("pinned", 2)
        ],
        "{report}"
    );
    assert!(
        stdout.contains("Hit rate over 2 runs of each policy, taking turns:"),
        "{stdout}"
    );
    // Each policy's line of the summary lists both runs' hit rates.
    for policy in ["round_robin", "pinned"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("| {policy} | ")) && l.ends_with(" % |"))
            .unwrap_or_else(|| panic!("no summary line for {policy}:\n{stdout}"));
        assert_eq!(
            line.split(" | ")
                .nth(1)
                .map(|runs| runs.split(", ").count()),
            Some(2),
            "{line}"
        );
    }
}
