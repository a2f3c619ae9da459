//! Starting Envoy on loopback from a configuration text: the one way the system harness, the
//! router tests, the benches and `make e2e-vllm` start it. The caller retargets a configuration
//! from `envoy/` at its run's ports (see `retarget_envoy_config`); [`EnvoyCommand::spawn`]
//! writes it where it can be read after a failure and starts Envoy with one worker.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::router::SpawnError;
use crate::{ChildGuard, envoy_bin, repo_root};

/// Files written by this process, numbered so that no two runs overwrite each other's.
static CONFIGS: AtomicUsize = AtomicUsize::new(0);

/// A running Envoy, stopped when dropped.
pub struct EnvoyProcess {
    /// The listener clients send requests to.
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// The configuration it runs.
    pub config: PathBuf,
    pub guard: ChildGuard,
}

impl EnvoyProcess {
    /// `http://LISTEN{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.listen, path)
    }

    /// Waits (at most `timeout`) until the admin port says `/ready`; returns whether it did.
    pub async fn ready(&self, timeout: Duration) -> bool {
        let ready = format!("http://{}/ready", self.admin);
        crate::poll_until(timeout, || async {
            reqwest::get(&ready)
                .await
                .is_ok_and(|r| r.status().is_success())
        })
        .await
    }
}

/// Envoy with a configuration whose listener is on `listen` and admin on `admin`.
pub struct EnvoyCommand {
    config: String,
    name: String,
    listen: u16,
    admin: u16,
    dir: PathBuf,
    log_level: String,
    stderr: Option<Stdio>,
}

impl EnvoyCommand {
    /// `name` names the file the configuration is written to (under `target/llmgw-envoy`).
    pub fn new(name: &str, config: String, listen: u16, admin: u16) -> EnvoyCommand {
        EnvoyCommand {
            config,
            name: name.replace(['/', ':'], "-"),
            listen,
            admin,
            dir: repo_root().join("target/llmgw-envoy"),
            log_level: "error".to_owned(),
            stderr: None,
        }
    }

    /// Where the configuration file goes instead (a bench's output folder).
    pub fn config_dir(mut self, dir: PathBuf) -> Self {
        self.dir = dir;
        self
    }

    pub fn log_level(mut self, level: &str) -> Self {
        level.clone_into(&mut self.log_level);
        self
    }

    /// Where Envoy's log goes, instead of this process's stderr.
    pub fn stderr(mut self, stderr: impl Into<Stdio>) -> Self {
        self.stderr = Some(stderr.into());
        self
    }

    pub fn spawn(self) -> Result<EnvoyProcess, SpawnError> {
        let name = "envoy";
        let start = |source| SpawnError::Start { name, source };
        std::fs::create_dir_all(&self.dir).map_err(start)?;
        let path = self.dir.join(format!(
            "{}-{}-{}.yaml",
            self.name,
            std::process::id(),
            CONFIGS.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, &self.config).map_err(start)?;
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&path)
            .args(["--use-dynamic-base-id", "--concurrency", "1"])
            .args(["--log-level", &self.log_level])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(self.stderr.unwrap_or_else(Stdio::inherit))
            .spawn()
            .map_err(start)?;
        Ok(EnvoyProcess {
            listen: SocketAddr::from(([127, 0, 0, 1], self.listen)),
            admin: SocketAddr::from(([127, 0, 0, 1], self.admin)),
            config: path,
            guard: ChildGuard::new(name, child),
        })
    }
}

/// Envoy in front of `replicas` with one of its own load-balancing policies and nothing else:
/// the same listener and cluster settings as `envoy/envoy.yaml`, without ext_proc.
pub fn plain_envoy_config(
    lb_policy: &str,
    listen: u16,
    admin: u16,
    replicas: &[SocketAddr],
) -> String {
    let endpoints: String = replicas
        .iter()
        .map(|r| {
            format!(
                "        - endpoint:\n            address:\n              socket_address: {{address: {}, port_value: {}}}\n",
                r.ip(),
                r.port()
            )
        })
        .collect();
    format!(
        r#"admin:
  address:
    socket_address: {{address: 127.0.0.1, port_value: {admin}}}
static_resources:
  listeners:
  - name: llm
    address:
      socket_address: {{address: 127.0.0.1, port_value: {listen}}}
    per_connection_buffer_limit_bytes: 33554432
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: llm
          codec_type: AUTO
          stream_idle_timeout: 300s
          route_config:
            name: llm
            virtual_hosts:
            - name: llm
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: vllm_replicas, timeout: 0s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: vllm_replicas
    type: STATIC
    connect_timeout: 1s
    lb_policy: {lb_policy}
    per_connection_buffer_limit_bytes: 33554432
    load_assignment:
      cluster_name: vllm_replicas
      endpoints:
      - lb_endpoints:
{endpoints}"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_envoy_lists_every_replica_with_the_policy() {
        let replicas: Vec<SocketAddr> = vec![
            "127.0.0.1:4001".parse().unwrap_or_else(|_| unreachable!()),
            "127.0.0.1:4002".parse().unwrap_or_else(|_| unreachable!()),
            "127.0.0.1:4003".parse().unwrap_or_else(|_| unreachable!()),
        ];
        let yaml = plain_envoy_config("RANDOM", 10123, 9123, &replicas);
        assert!(yaml.contains("lb_policy: RANDOM"));
        assert!(yaml.contains("port_value: 10123") && yaml.contains("port_value: 9123"));
        for r in &replicas {
            assert!(yaml.contains(&format!("port_value: {}}}", r.port())));
        }
        assert!(!yaml.contains("ext_proc"));
    }
}
