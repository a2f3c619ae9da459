//! `llmgw-bench-throughput` at toy size (debug builds, from `cargo build --workspace --bins`):
//! the whole system (two sims, router, agent) with the protocol-floor server and four real
//! Envoys, two concurrency levels for a second each. The bench itself fails when a routed Envoy
//! failed open instead of asking its ext_proc server; this checks that every path and point is
//! reported with requests counted, that CPU is measured, and that llmgw routed on the agent's
//! index (conversations come back to blocks it reported). No timing is judged.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::process::Command;

use llmgw_integration::{bin_path, repo_root};

#[test]
fn every_path_and_point_is_measured_through_ext_proc() {
    let json = repo_root()
        .join("target")
        .join(format!("bench-throughput-test-{}.json", std::process::id()));
    let mut command = Command::new(bin_path("llmgw-bench-throughput"));
    command
        .args(["--sizes", "4096", "--concurrency", "1,3"])
        .args(["--seconds", "1", "--warmup-seconds", "0.3"])
        .arg("--json")
        .arg(&json);
    let (stdout, rows) = llmgw_bench::run_bench(command, &json);
    let rows = rows.as_array().cloned().expect("JSON rows");
    let paths = [
        "baseline",
        "floor 1 core",
        "buffered 1 core",
        "full_duplex 1 core",
        "floor all cores",
        "buffered all cores",
    ];
    assert_eq!(rows.len(), 2 * paths.len(), "{rows:?}");
    for clients in [1, 3] {
        for path in paths {
            let row = rows
                .iter()
                .find(|r| r["path"] == path && r["clients"] == clients)
                .unwrap_or_else(|| panic!("no {path} row at {clients} clients in {rows:?}"));
            let requests = row["requests"].as_u64().unwrap_or(0);
            assert!(requests > 0, "{row}");
            assert!(
                row["requests_per_s"].as_f64().is_some_and(|r| r > 0.0),
                "{row}"
            );
            assert!(
                row["envoy_cpu_us_per_request"]
                    .as_f64()
                    .is_some_and(|us| us > 0.0)
            );
            if path == "baseline" {
                assert!(row["added_p99_ms"].is_null(), "{row}");
                assert!(row["ext_proc_cpu_us_per_request"].is_null(), "{row}");
                continue;
            }
            assert!(row["added_p99_ms"].is_number(), "{row}");
            assert!(
                row["ext_proc_cpu_us_per_request"]
                    .as_f64()
                    .is_some_and(|us| us > 0.0),
                "{row}"
            );
            if path.starts_with("floor") {
                assert!(row["decisions"].is_null(), "{row}");
            } else {
                // Every answered request was a decision (the window's edges may add a few).
                let decisions = row["decisions"].as_f64().unwrap_or(0.0);
                assert!(decisions >= requests as f64 - 3.0, "{row}");
                // A conversation's next turn extends its last: the index holds its blocks.
                assert!(row["index_hits"].as_f64().is_some_and(|h| h > 0.0), "{row}");
                assert!(row["tokenize_timeouts"].is_number(), "{row}");
            }
        }
    }
    assert!(stdout.contains("router CPU"), "{stdout}");
    assert!(
        stdout.contains("peak throughput at one router core"),
        "{stdout}"
    );
}

/// `--paths` runs only the paths named (and the baseline, for the added latency), and
/// `--router-arg` reaches the router: here its current-thread scheduler.
#[test]
fn chosen_paths_only_with_a_router_flag() {
    let json = repo_root().join("target").join(format!(
        "bench-throughput-paths-{}.json",
        std::process::id()
    ));
    let mut command = Command::new(bin_path("llmgw-bench-throughput"));
    command
        .args(["--sizes", "4096", "--concurrency", "2"])
        .args(["--seconds", "1", "--warmup-seconds", "0.3"])
        .args([
            "--paths",
            "buffered 1 core",
            "--router-arg=--worker-threads=1",
        ])
        .arg("--json")
        .arg(&json);
    let (_, rows) = llmgw_bench::run_bench(command, &json);
    let paths: Vec<&str> = rows
        .as_array()
        .expect("JSON rows")
        .iter()
        .filter_map(|r| r["path"].as_str())
        .collect();
    assert_eq!(paths, ["baseline", "buffered 1 core"]);
    let unknown = Command::new(bin_path("llmgw-bench-throughput"))
        .args(["--paths", "sideways"])
        .output()
        .expect("runs");
    assert!(!unknown.status.success());
    assert!(
        String::from_utf8_lossy(&unknown.stderr).contains("no path \"sideways\""),
        "{}",
        String::from_utf8_lossy(&unknown.stderr)
    );
}
