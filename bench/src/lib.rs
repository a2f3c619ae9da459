//! llmgw's system benchmarks, each a binary in `src/bin/` started by a `make bench-*` target:
//! `llmgw-bench-routing` (policies side by side, [`routing`]), `llmgw-bench-overhead` (latency
//! and CPU llmgw adds, beside `llmgw-extproc-floor`, an ext_proc server that routes without
//! reading requests; the shared harness is [`gateway`]), `llmgw-bench-throughput` (requests/s and
//! added latency under closed-loop load, per router core), `llmgw-bench-scale` (resources as replicas grow, [`scale`]), `llmgw-bench-overload` (flow
//! control at 150 % of capacity, [`overload`]). Processes are
//! started with `llmgw-integration`'s harness; the criterion benches live beside the code they
//! measure. `docs/benchmarks.md` says what each measures and lists the latest figures.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

pub mod gateway;
pub mod overload;
pub mod routing;
pub mod scale;

/// The runtime a bench's own clients and harness run on: two workers, as many as this
/// project's development machine has cores, whatever the machine it runs on.
pub fn client_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// A bench binary's toy-size run, for its smoke test: runs `command` (stdout captured) and
/// returns its stdout and the JSON it wrote to `json` (which is removed); panics with the
/// bench's output when it fails.
pub fn run_bench(
    mut command: std::process::Command,
    json: &std::path::Path,
) -> (String, serde_json::Value) {
    let output = command.output().expect("run the bench");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "bench failed: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let report = serde_json::from_slice(&std::fs::read(json).expect("bench JSON")).expect("JSON");
    let _ = std::fs::remove_file(json);
    (stdout, report)
}
