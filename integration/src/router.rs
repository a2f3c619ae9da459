//! Starting `llmgw-router serve` on loopback: the one way the system tests, the benches and
//! `make run` start a router. A [`RouterCommand`] collects flags; [`RouterCommand::spawn`] starts
//! the process and waits for the line on which the router prints the ports it bound.

use std::ffi::{OsStr, OsString};
use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use thiserror::Error;

use crate::{ChildGuard, bin_path};

#[derive(Debug, Error)]
pub enum SpawnError {
    #[error("cannot start {name}: {source}")]
    Start {
        name: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{name} exited before it printed where it listens")]
    Exited { name: &'static str },
    #[error("{name} printed no {key} address: {line:?}")]
    Address {
        name: &'static str,
        key: &'static str,
        line: String,
    },
}

/// The router's bound addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterAddrs {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    pub feed: SocketAddr,
}

impl RouterAddrs {
    /// The addresses in the router's `llmgw-router listening grpc=… admin=… feed=…` line, or
    /// `None` for any other line.
    pub fn from_listening_line(line: &str) -> Option<Result<RouterAddrs, SpawnError>> {
        let rest = line.strip_prefix("llmgw-router listening ")?;
        let addr = |key: &'static str| {
            rest.split_whitespace()
                .find_map(|part| part.strip_prefix(key))
                .and_then(|a| a.parse().ok())
                .ok_or_else(|| SpawnError::Address {
                    name: "llmgw-router",
                    key,
                    line: line.to_owned(),
                })
        };
        Some((|| {
            Ok(RouterAddrs {
                grpc: addr("grpc=")?,
                admin: addr("admin=")?,
                feed: addr("feed=")?,
            })
        })())
    }
}

/// A running router, stopped when dropped.
pub struct RouterProcess {
    pub addrs: RouterAddrs,
    pub guard: ChildGuard,
}

impl RouterProcess {
    pub fn pid(&self) -> u32 {
        self.guard.id()
    }
}

/// `llmgw-router serve` with its listen addresses, replicas and other flags.
pub struct RouterCommand {
    binary: PathBuf,
    grpc: Option<SocketAddr>,
    admin: Option<SocketAddr>,
    feed: Option<SocketAddr>,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    stderr: Option<Stdio>,
}

impl Default for RouterCommand {
    fn default() -> Self {
        RouterCommand::new()
    }
}

impl RouterCommand {
    /// The workspace's router binary on free loopback ports, logging at `$RUST_LOG` (default
    /// `warn`) to this process's stderr.
    pub fn new() -> Self {
        RouterCommand::with_binary(bin_path("llmgw-router"))
    }

    /// Another router binary (a release build for benches).
    pub fn with_binary(binary: PathBuf) -> Self {
        RouterCommand {
            binary,
            grpc: None,
            admin: None,
            feed: None,
            args: Vec::new(),
            env: vec![(
                "RUST_LOG".into(),
                std::env::var_os("RUST_LOG").unwrap_or_else(|| "warn".into()),
            )],
            stderr: None,
        }
    }

    /// Listens where `addrs` says: a restart on the same ports.
    pub fn at(self, addrs: RouterAddrs) -> Self {
        self.grpc(addrs.grpc).admin(addrs.admin).feed(addrs.feed)
    }

    pub fn grpc(mut self, addr: SocketAddr) -> Self {
        self.grpc = Some(addr);
        self
    }

    pub fn admin(mut self, addr: SocketAddr) -> Self {
        self.admin = Some(addr);
        self
    }

    pub fn feed(mut self, addr: SocketAddr) -> Self {
        self.feed = Some(addr);
        self
    }

    /// `--replica MODEL=ADDR[@NODE]`.
    pub fn replica(self, model: &str, addr: SocketAddr, node: Option<&str>) -> Self {
        let spec = match node {
            Some(node) => format!("{model}={addr}@{node}"),
            None => format!("{model}={addr}"),
        };
        self.args(["--replica", &spec])
    }

    /// `--model MODEL=block_size=N,seed=S` (the engines' hash settings).
    pub fn model(self, model: &str, block_size: usize, seed: &str) -> Self {
        self.args([
            "--model".to_owned(),
            format!("{model}=block_size={block_size},seed={seed}"),
        ])
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.env
            .push((key.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    /// Where the router's logs go (a bench's log file), instead of this process's stderr.
    pub fn stderr(mut self, stderr: impl Into<Stdio>) -> Self {
        self.stderr = Some(stderr.into());
        self
    }

    /// Starts the router and waits until it has bound its ports.
    pub fn spawn(self) -> Result<RouterProcess, SpawnError> {
        let listen = |addr: Option<SocketAddr>| {
            addr.map_or_else(|| "127.0.0.1:0".to_owned(), |a| a.to_string())
        };
        let mut command = Command::new(&self.binary);
        command
            .arg("serve")
            .args(["--grpc-addr", &listen(self.grpc)])
            .args(["--admin-addr", &listen(self.admin)])
            .args(["--feed-addr", &listen(self.feed)])
            .args(&self.args)
            .envs(self.env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(self.stderr.unwrap_or_else(Stdio::inherit));
        let name = "llmgw-router";
        let mut child = command
            .spawn()
            .map_err(|source| SpawnError::Start { name, source })?;
        let stdout = child.stdout.take().ok_or(SpawnError::Exited { name })?;
        let guard = ChildGuard::new(name, child);
        let mut lines = BufReader::new(stdout).lines();
        for line in lines.by_ref() {
            let Ok(line) = line else { break };
            if let Some(addrs) = RouterAddrs::from_listening_line(&line) {
                let addrs = addrs?;
                // Keep draining stdout so the router never blocks on a full pipe.
                std::thread::spawn(move || for _ in lines {});
                return Ok(RouterProcess { addrs, guard });
            }
        }
        Err(SpawnError::Exited { name })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listening_line_gives_every_address_or_names_the_missing_one() {
        let line = "llmgw-router listening grpc=127.0.0.1:1 admin=127.0.0.1:2 feed=127.0.0.1:3";
        let addrs = RouterAddrs::from_listening_line(line)
            .expect("a listening line")
            .expect("every address");
        assert_eq!(addrs.admin, "127.0.0.1:2".parse().expect("addr"));
        assert!(RouterAddrs::from_listening_line("llmgw-router ready").is_none());
        let missing = RouterAddrs::from_listening_line("llmgw-router listening grpc=127.0.0.1:1")
            .expect("a listening line")
            .expect_err("no admin address");
        assert!(missing.to_string().contains("admin="), "{missing}");
    }
}
