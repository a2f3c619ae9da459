//! Starting `llmgw-agent` on loopback: `serve` for engines that run on their own (simulators,
//! synthetic publishers), `run` for one it starts itself (`make e2e-vllm`). Logs go to stderr at
//! `$RUST_LOG` (default `warn`) unless the caller says otherwise.

use std::ffi::OsStr;
use std::net::SocketAddr;
use std::process::{Command, Stdio};

use crate::router::SpawnError;
use crate::{ChildGuard, bin_path};

/// `llmgw-agent serve|run` with its node, routers, hash settings and engines.
pub struct AgentCommand {
    command: Command,
    stderr: Option<Stdio>,
}

impl AgentCommand {
    /// `llmgw-agent serve --node NODE` (callers choose its `--admin-addr`).
    pub fn serve(node: &str) -> AgentCommand {
        AgentCommand::new("serve", node)
    }

    /// `llmgw-agent run --node NODE`: the caller appends `--` and the engine's command line to
    /// [`AgentCommand::into_command`].
    pub fn run(node: &str) -> AgentCommand {
        AgentCommand::new("run", node)
    }

    fn new(subcommand: &str, node: &str) -> AgentCommand {
        let mut command = Command::new(bin_path("llmgw-agent"));
        command
            .args([subcommand, "--node", node])
            .env(
                "LLMGW_AGENT_LOG",
                std::env::var_os("RUST_LOG").unwrap_or_else(|| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        AgentCommand {
            command,
            stderr: None,
        }
    }

    /// `--router ADDR`: a router's feed port (repeatable).
    pub fn router(mut self, feed: SocketAddr) -> Self {
        self.command.args(["--router", &feed.to_string()]);
        self
    }

    /// The engines' hash settings: `--model`, `--hash-seed` (their PYTHONHASHSEED) and
    /// `--block-size`.
    pub fn hash_settings(mut self, model: &str, seed: &str, block_size: usize) -> Self {
        self.command
            .args(["--model", model, "--hash-seed", seed])
            .args(["--block-size", &block_size.to_string()]);
        self
    }

    /// `--engine REPLICA=EVENTS[,replay=REPLAY]` (repeatable).
    pub fn engine(mut self, replica: SocketAddr, events: &str, replay: Option<&str>) -> Self {
        let replay = replay.map(|r| format!(",replay={r}")).unwrap_or_default();
        self.command
            .arg("--engine")
            .arg(format!("{replica}={events}{replay}"));
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.command.args(args);
        self
    }

    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.command.env(key, value);
        self
    }

    /// Where the agent's log goes, instead of this process's stderr.
    pub fn stderr(mut self, stderr: impl Into<Stdio>) -> Self {
        self.stderr = Some(stderr.into());
        self
    }

    /// The command, for a caller that starts it its own way (in a process group, say).
    pub fn into_command(mut self) -> Command {
        self.command
            .stderr(self.stderr.unwrap_or_else(Stdio::inherit));
        self.command
    }

    pub fn spawn(self) -> Result<ChildGuard, SpawnError> {
        let name = "llmgw-agent";
        let child = self
            .into_command()
            .spawn()
            .map_err(|source| SpawnError::Start { name, source })?;
        Ok(ChildGuard::new(name, child))
    }
}
