//! `llmgw-agent run … -- <vLLM command>`: starts vLLM with the environment and flags that make
//! it publish to this agent with the agreed hashing (see `config::vllm_args`), restarts it when
//! it exits (with backoff), and resets its engine at every restart so the routers forget the
//! old process's blocks. One task; the child is killed when the supervisor is dropped.

use std::time::Duration;

use tokio::process::Command;

use crate::config::VllmArgs;
use crate::daemon::Agent;
use crate::engine::ResetReason;

/// Errors of the supervisor.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("no vLLM command given after `--`")]
    NoCommand,
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
}

/// Restart pacing: doubling from `initial` to `max`, back to `initial` after a run that
/// lasted `healthy`.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    pub healthy: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(30),
            healthy: Duration::from_secs(60),
        }
    }
}

/// Runs `command` (program and arguments) plus `vllm`'s flags, forever or for `max_starts`.
pub async fn supervise(
    agent: &Agent,
    engine: &str,
    command: &[String],
    vllm: &VllmArgs,
    backoff: Backoff,
    max_starts: Option<u32>,
) -> Result<(), SupervisorError> {
    let (program, args) = command.split_first().ok_or(SupervisorError::NoCommand)?;
    let mut delay = backoff.initial;
    let mut starts = 0u32;
    while max_starts.is_none_or(|m| starts < m) {
        if starts > 0 {
            // A new process: whatever the old one cached is gone.
            agent.reset(engine, ResetReason::Supervisor).await;
        }
        starts += 1;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .args(&vllm.args)
            .envs(vllm.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .kill_on_drop(true);
        let started = tokio::time::Instant::now();
        let mut child = cmd.spawn().map_err(|source| SupervisorError::Spawn {
            program: program.clone(),
            source,
        })?;
        tracing::info!(
            engine,
            program,
            pid = child.id(),
            start = starts,
            "vLLM started"
        );
        let status = child.wait().await;
        let ran = started.elapsed();
        match status {
            Ok(s) => tracing::warn!(engine, status = %s, ?ran, "vLLM exited"),
            Err(e) => tracing::error!(engine, error = %e, "waiting for vLLM failed"),
        }
        if ran >= backoff.healthy {
            delay = backoff.initial;
        }
        if max_starts.is_none_or(|m| starts < m) {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(backoff.max);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;
    use std::sync::Arc;

    use super::*;
    use crate::config::{AgentArgs, EngineSpec, vllm_args};
    use crate::metrics::Metrics;

    #[tokio::test]
    async fn vllm_gets_the_seed_and_flags_and_each_restart_resets_the_engine() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("starts.log");
        let spec: EngineSpec = "h:8000=tcp://127.0.0.1:0,bind".parse().expect("spec");
        let args = AgentArgs {
            engines: vec![spec],
            hash_seed: Some("1729".into()),
            block_size: NonZeroUsize::new(32),
            ..AgentArgs::default()
        };
        let config = args.resolve().expect("config");
        let agent = Agent::start(config).await.expect("agent starts");
        let flags = vllm_args(&agent.config, &agent.config.engines[0]);
        let script = format!(
            "echo \"$PYTHONHASHSEED $*\" >> {}; exit 3",
            log.to_string_lossy()
        );
        let command = vec![
            "/bin/sh".to_owned(),
            "-c".to_owned(),
            script,
            "vllm".to_owned(),
        ];
        let fast = Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(20),
            healthy: Duration::from_secs(60),
        };
        supervise(&agent, "h:8000", &command, &flags, fast, Some(3))
            .await
            .expect("supervises");
        let text = std::fs::read_to_string(&log).expect("log");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "started three times: {text}");
        assert!(
            lines[0].starts_with("1729 --enable-prefix-caching"),
            "{}",
            lines[0]
        );
        assert!(lines[0].contains("--prefix-caching-hash-algo sha256_cbor"));
        let agent = Arc::new(agent);
        let resets = || {
            agent
                .metrics
                .resets
                .get_or_create(&Metrics::reason("h:8000", "supervisor"))
                .get()
        };
        for _ in 0..100 {
            if resets() == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(resets(), 2, "a reset at each restart");
    }
}
