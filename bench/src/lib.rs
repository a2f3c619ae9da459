//! llmgw's system benchmarks, each a binary in `src/bin/` started by a `make bench-*` target:
//! `llmgw-bench-routing` (policies side by side, [`routing`]), `llmgw-bench-overhead` (latency
//! and CPU llmgw adds, beside `llmgw-extproc-floor`, an ext_proc server that routes without
//! reading requests), `llmgw-bench-scale` (resources as replicas grow, [`scale`]), `llmgw-bench-overload` (flow
//! control at 150 % of capacity, [`overload`]). Processes are
//! started with `llmgw-integration`'s harness; the criterion benches live beside the code they
//! measure. `docs/benchmarks.md` says what each measures and lists the latest figures.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

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
