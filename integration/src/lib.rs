//! Test support shared by the integration tests, the benchmarks and `make run`: locating the
//! workspace's binaries and Envoy, picking loopback ports, and child processes that never
//! outlive a test.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

pub mod agent;
pub mod envoy;
pub mod extproc_client;
pub mod feed_client;
pub mod procfs;
pub mod prom;
pub mod router;
pub mod soak;
pub mod system;
pub mod vllm;
pub mod workload;

use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("integration/ has a parent")
        .to_path_buf()
}

/// A workspace binary (`llmgw-router`, `llmgw-agent`, `llmgw-sim`) from the same target
/// directory and profile as the running test. `make test` builds them all first
/// (`cargo build --workspace --bins`); a missing one fails with that hint.
pub fn bin_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|d| {
            if d.ends_with("deps") {
                d.parent()
            } else {
                Some(d)
            }
        })
        .expect("exe dir");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} not built: run `cargo build --workspace --bins` (make test does)",
        path.display()
    );
    path
}

/// The Envoy binary: `$ENVOY_BIN`, else the one `make envoy` installs into `.venv`.
pub fn envoy_bin() -> PathBuf {
    let path = std::env::var_os("ENVOY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/envoy"));
    assert!(
        path.exists(),
        "envoy not found at {}: run `make envoy`",
        path.display()
    );
    path
}

/// A loopback port for processes (like Envoy) that take fixed ports in their configuration,
/// from outside the kernel's ephemeral range so no outgoing connection takes it meanwhile.
pub fn free_port() -> u16 {
    llmgw_core::test_ports::loopback_port()
}

/// An Envoy configuration from `envoy/` pointed at this run's ports: the listener (10000), the
/// admin port (9901), llmgw's gRPC port (9002) and two replicas (8001, 8002).
pub fn retarget_envoy_config(
    text: &str,
    listen: u16,
    admin: u16,
    grpc: u16,
    replicas: [SocketAddr; 2],
) -> String {
    text.replace("port_value: 10000", &format!("port_value: {listen}"))
        .replace("port_value: 9901", &format!("port_value: {admin}"))
        .replace("port_value: 9002", &format!("port_value: {grpc}"))
        .replace(
            "port_value: 8001",
            &format!("port_value: {}", replicas[0].port()),
        )
        .replace(
            "port_value: 8002",
            &format!("port_value: {}", replicas[1].port()),
        )
}

/// An Envoy configuration whose `llmgw` cluster reaches the router over the Unix socket `socket`
/// (the router's `--grpc-uds`) instead of TCP port 9002.
pub fn envoy_config_over_uds(text: &str, socket: &std::path::Path) -> String {
    const TCP: &str = "socket_address: {address: 127.0.0.1, port_value: 9002}";
    assert_eq!(
        text.matches(TCP).count(),
        1,
        "expected one llmgw endpoint at 127.0.0.1:9002"
    );
    text.replace(TCP, &format!("pipe: {{path: {}}}", socket.display()))
}

/// `envoy/envoy.yaml` with the request body STREAMED and
/// `send_body_without_waiting_for_header_response`: Envoy sends the headers and the body chunks
/// without waiting, and llmgw holds the header answer until the body is complete (one round
/// trip, no echo).
pub fn envoy_config_streamed_ahead(text: &str) -> String {
    const BUFFERED: &str = "request_body_mode: BUFFERED";
    const FAIL_OPEN: &str = "              failure_mode_allow: true\n";
    assert_eq!(
        text.matches(BUFFERED).count(),
        1,
        "expected one BUFFERED ext_proc filter"
    );
    assert_eq!(
        text.matches(FAIL_OPEN).count(),
        1,
        "expected one failure_mode_allow"
    );
    text.replace(BUFFERED, "request_body_mode: STREAMED")
        .replace(
            FAIL_OPEN,
            &format!(
                "{FAIL_OPEN}              send_body_without_waiting_for_header_response: true\n"
            ),
        )
}

/// Asks `done` every 50 ms until it says yes (true) or `timeout` passes (false).
pub async fn poll_until<F, Fut>(timeout: std::time::Duration, mut done: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if done().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A loopback address with a free port.
pub fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// A child process killed (and reaped) when dropped, so a failing test leaves nothing running.
/// One made by [`ChildGuard::group`] leads its own process group, and the whole group is
/// killed (vLLM's API server leaves EngineCore and worker processes behind otherwise).
pub struct ChildGuard {
    pub child: Child,
    pub name: String,
    /// The child leads a process group of its own: kill the group, not just the child.
    group: bool,
    /// Already killed and reaped: its group id may belong to someone else by now.
    killed: bool,
}

impl ChildGuard {
    pub fn new(name: impl Into<String>, child: Child) -> Self {
        ChildGuard {
            child,
            name: name.into(),
            group: false,
            killed: false,
        }
    }

    /// A child started with `process_group(0)` (it leads its own group): [`ChildGuard::kill`]
    /// and dropping the guard kill every process of the group.
    pub fn group(name: impl Into<String>, child: Child) -> Self {
        ChildGuard {
            child,
            name: name.into(),
            group: true,
            killed: false,
        }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL to the child (to its whole process group for [`ChildGuard::group`]), then reaps
    /// it. A group outlives its leader: it is signalled even when the leader has exited (Linux
    /// never hands out a pid that is still a live group's id).
    pub fn kill(&mut self) {
        if self.killed {
            return;
        }
        self.killed = true;
        if self.group {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.child.id())])
                .stderr(Stdio::null())
                .status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM (as Kubernetes does to stop a pod) and waits at most `timeout` for the
    /// process to exit; returns its status, or `None` if it is still running.
    pub fn terminate(&mut self, timeout: std::time::Duration) -> Option<std::process::ExitStatus> {
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(sent, "kill -TERM {} failed", self.name);
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        None
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A running replica, killed when dropped: an `llmgw-sim` process ([`spawn_sim`]), or any
/// engine that speaks vLLM's API and was started some other way ([`SimHandle::from_process`],
/// e.g. a real vLLM engine from [`vllm`]).
pub struct SimHandle {
    /// The HTTP address (`http://{addr}/v1/completions`).
    pub addr: SocketAddr,
    /// The bound KV-events PUB endpoint (`tcp://127.0.0.1:PORT`), when events bind.
    pub events: Option<String>,
    /// The bound replay ROUTER endpoint, when configured.
    pub replay: Option<String>,
    pub guard: ChildGuard,
}

impl SimHandle {
    /// A replica started by the caller (its `guard` kills it): serving HTTP at `addr`, its KV
    /// events on the PUB endpoint `events` (what subscribers dial, `tcp://127.0.0.1:PORT`).
    pub fn from_process(addr: SocketAddr, events: Option<String>, guard: ChildGuard) -> SimHandle {
        SimHandle {
            addr,
            events,
            replay: None,
            guard,
        }
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops the process at once, as an engine crash would; its ports are then free for a
    /// restart ([`SimHandle::restarted_as`]).
    pub fn kill(&mut self) {
        self.guard.kill();
    }

    /// What a restarted engine binds for its KV events: the same port on every interface
    /// (`tcp://*:PORT`, vLLM's convention), so subscribers keep dialing the endpoint they had.
    pub fn events_rebind(&self) -> Option<String> {
        rebind(self.events.as_deref()?)
    }

    /// The same for the replay endpoint.
    pub fn replay_rebind(&self) -> Option<String> {
        rebind(self.replay.as_deref()?)
    }

    /// Takes the place of the killed process with `new`, started on the same HTTP port (add
    /// `--port` with it) and the `*_rebind` endpoints; keeps the endpoints subscribers dial.
    pub fn restarted_as(&mut self, new: SimHandle) {
        assert_eq!(new.addr, self.addr, "replica restarted on its port");
        let (events, replay) = (self.events.take(), self.replay.take());
        *self = new;
        self.events = events;
        self.replay = replay;
    }
}

fn rebind(endpoint: &str) -> Option<String> {
    let (_, port) = endpoint.rsplit_once(':')?;
    Some(format!("tcp://*:{port}"))
}

/// `llmgw-sim` flags for a replica of `model` whose cache holds `gpu_blocks` blocks of
/// `block_size` tokens (the longest prompt fits the cache, at most 8,192 tokens), publishing
/// KV events as `kv_events_config` (vLLM's `--kv-events-config` JSON) says.
pub fn cache_sim_args(
    model: &str,
    block_size: usize,
    gpu_blocks: usize,
    kv_events_config: &str,
) -> Vec<String> {
    let max_model_len = (gpu_blocks.saturating_sub(1) * block_size).min(8192);
    [
        "--served-model-name",
        model,
        "--block-size",
        &block_size.to_string(),
        "--num-gpu-blocks-override",
        &gpu_blocks.to_string(),
        "--max-model-len",
        &max_model_len.to_string(),
        "--kv-events-config",
        kv_events_config,
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Starts `llmgw-sim` on `127.0.0.1:0` with `args` added (later flags win, so `--host` or
/// `--port` may be overridden), waits until it listens, and returns its addresses. The
/// simulator prints its bound endpoints on stdout; this reads them. Test-support code: it panics
/// with a clear message if the binary is missing or does not start.
pub fn spawn_sim<I, S>(args: I) -> SimHandle
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    spawn_sim_with_env(args, std::iter::empty::<(String, String)>())
}

/// [`spawn_sim`] with extra environment variables (e.g. `PYTHONHASHSEED`).
pub fn spawn_sim_with_env<I, S, E, K, V>(args: I, env: E) -> SimHandle
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
    E: IntoIterator<Item = (K, V)>,
    K: AsRef<std::ffi::OsStr>,
    V: AsRef<std::ffi::OsStr>,
{
    let mut cmd = Command::new(bin_path("llmgw-sim"));
    cmd.args(["--host", "127.0.0.1", "--port", "0"])
        .args(args)
        .envs(env)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd.spawn().expect("spawn llmgw-sim");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut guard = ChildGuard::new("llmgw-sim", child);
    let mut lines = BufReader::new(stdout).lines();
    let (mut events, mut replay) = (None, None);
    loop {
        let line = match lines.next() {
            Some(Ok(line)) => line,
            _ => {
                let status = guard.child.wait().ok();
                panic!("llmgw-sim exited before listening ({status:?})");
            }
        };
        if let Some(ep) = line.strip_prefix("llmgw-sim kv-events on ") {
            events = Some(ep.trim().to_owned());
        } else if let Some(ep) = line.strip_prefix("llmgw-sim kv-replay on ") {
            replay = Some(ep.trim().to_owned());
        } else if let Some(url) = line.strip_prefix("llmgw-sim listening on http://") {
            let addr = url.trim().parse().expect("listening address");
            // Keep draining stdout so the child never blocks on a full pipe.
            std::thread::spawn(move || for _ in lines {});
            return SimHandle {
                addr,
                events,
                replay,
                guard,
            };
        }
    }
}
