//! Test support shared by the integration tests, the benchmarks and `make run`: locating the
//! workspace's binaries and Envoy, picking loopback ports, and child processes that never
//! outlive a test.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Child;

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
        .and_then(|d| if d.ends_with("deps") { d.parent() } else { Some(d) })
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

/// A loopback port free at the time of the call, for processes (like Envoy) that take fixed
/// ports in their configuration.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    listener.local_addr().expect("local addr").port()
}

/// A loopback address with a free port.
pub fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// A child process killed (and reaped) when dropped, so a failing test leaves nothing running.
pub struct ChildGuard {
    pub child: Child,
    pub name: String,
}

impl ChildGuard {
    pub fn new(name: impl Into<String>, child: Child) -> Self {
        ChildGuard {
            child,
            name: name.into(),
        }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
