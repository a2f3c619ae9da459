//! What the gateway benches share: the ext_proc servers they start (the router, the
//! protocol-floor server) with Envoy in front, a minimal HTTP/1.1 client whose own cost is small
//! and the same for every path, the processes' CPU from `/proc`, the router's decision totals
//! from its metrics, and the check that a path really went over ext_proc.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use llmgw_integration::envoy::{EnvoyCommand, plain_envoy_config};
use llmgw_integration::{ChildGuard, bin_path, free_port, repo_root, retarget_envoy_config};
use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

pub struct Summary {
    pub p50: f64,
    pub p99: f64,
}

/// p50 and p99 of `samples` (nearest rank); `samples` must not be empty.
pub fn summary(samples: &[f64]) -> Summary {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = |q: f64| sorted[((sorted.len() as f64 - 1.0) * q).round() as usize];
    Summary {
        p50: at(0.50),
        p99: at(0.99),
    }
}

pub fn size_label(size: usize) -> String {
    if size >= 1024 {
        format!("{} KB", size / 1024)
    } else {
        format!("{size} B")
    }
}

/// A process that answers Envoy's ext_proc: the router, or the floor server.
pub struct Processor {
    pub pid: u32,
    /// The router's admin address (its metrics); the floor server has none.
    pub admin: Option<SocketAddr>,
    /// Stops the process when dropped; `None` where another owner stops it.
    pub guard: Option<ChildGuard>,
}

pub fn start_floor(
    grpc_port: u16,
    socket: Option<&std::path::Path>,
    replicas: &[SocketAddr; 2],
) -> anyhow::Result<Processor> {
    let mut command = Command::new(bin_path("llmgw-extproc-floor"));
    command.args(["--grpc-addr", &format!("127.0.0.1:{grpc_port}")]);
    if let Some(socket) = socket {
        command.arg("--grpc-uds").arg(socket);
    }
    for replica in replicas {
        command.args(["--replica", &replica.to_string()]);
    }
    let child = spawn_quiet(&mut command, "llmgw-extproc-floor")?;
    Ok(Processor {
        pid: child.id(),
        admin: None,
        guard: Some(ChildGuard::new("llmgw-extproc-floor", child)),
    })
}

/// Starts a child with no input, its output discarded and its errors on ours.
pub fn spawn_quiet(command: &mut Command, what: &str) -> anyhow::Result<std::process::Child> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("spawn {what}"))
}

pub struct EnvoyProcess {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub guard: ChildGuard,
}

pub fn repo_config(name: &str) -> anyhow::Result<String> {
    let path = repo_root().join("envoy").join(name);
    std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))
}

/// Envoy → replicas, round robin, nothing in between: the routing bench's plain Envoy (the same
/// listener, buffer limits and cluster as `envoy/envoy.yaml`, without the ext_proc filter), on
/// the default ports, which `start_envoy` moves.
pub fn baseline_config() -> String {
    let defaults = [8001, 8002].map(|port| SocketAddr::from(([127, 0, 0, 1], port)));
    plain_envoy_config("ROUND_ROBIN", 10000, 9901, &defaults)
}

pub fn start_envoy(
    name: &str,
    config: &str,
    replicas: [SocketAddr; 2],
    grpc_port: u16,
    config_dir: &str,
) -> anyhow::Result<EnvoyProcess> {
    let listen = free_port();
    let admin = free_port();
    let config = retarget_envoy_config(config, listen, admin, grpc_port, replicas);
    let envoy = EnvoyCommand::new(name, config, listen, admin)
        .config_dir(repo_root().join("target").join(config_dir))
        .spawn()?;
    Ok(EnvoyProcess {
        listen: envoy.listen,
        admin: envoy.admin,
        guard: envoy.guard,
    })
}

pub async fn wait_ready(admin: SocketAddr) -> anyhow::Result<()> {
    let client = Client::new(admin);
    for _ in 0..200 {
        if let Ok((200, _)) = client.get("/ready").await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("envoy at {admin} never became ready")
}

/// Fails unless the path's Envoy had its ext_proc server answer every request so far: with the
/// server down or too slow, Envoy fails open (`failure_mode_allow`) and the path would measure
/// Envoy alone.
pub async fn check_answered(path: &str, admin: SocketAddr, at_least: usize) -> anyhow::Result<()> {
    let (_, text) = Client::new(admin).get("/stats?filter=ext_proc").await?;
    let text = String::from_utf8_lossy(&text);
    let stat = |name: &str| -> u64 {
        let suffix = format!(".ext_proc.{name}");
        text.lines()
            .filter_map(|line| line.split_once(": "))
            .filter(|(key, _)| key.ends_with(&suffix))
            .filter_map(|(_, value)| value.trim().parse::<u64>().ok())
            .sum()
    };
    let started = stat("streams_started");
    let failed_open = stat("failure_mode_allowed");
    let timeouts = stat("message_timeouts");
    let failed = stat("streams_failed");
    if started < at_least as u64 || failed_open + timeouts + failed > 0 {
        // Where Envoy health-checks the ext_proc server, a check it counted failed takes the
        // server out and requests fail open while it is out: say so, it is the likely cause.
        let (_, checks) = Client::new(admin)
            .get("/stats?filter=cluster\\.llmgw\\.health_check\\.")
            .await?;
        let checks = String::from_utf8_lossy(&checks);
        let checks: Vec<&str> = checks
            .lines()
            .filter(|line| line.contains("failure") || line.contains("attempt"))
            .collect();
        bail!(
            "{path}: Envoy started {started} ext_proc streams for at least {at_least} requests, \
             failed open {failed_open} times, timed out {timeouts} messages and lost {failed} \
             streams, so this path did not measure ext_proc exchanges (its health checks of \
             llmgw: {})",
            if checks.is_empty() {
                "none".to_owned()
            } else {
                checks.join(", ")
            }
        );
    }
    Ok(())
}

/// The router's decision totals so far.
pub struct PickStats {
    pub count: f64,
    /// `llmgw_pick_duration_seconds_sum`.
    pub wall_s: f64,
    /// `llmgw_pick_cpu_seconds_sum`.
    pub cpu_s: f64,
}

pub async fn pick_stats(admin: SocketAddr) -> anyhow::Result<PickStats> {
    let (_, text) = Client::new(admin).get("/metrics").await?;
    let text = String::from_utf8_lossy(&text);
    let value = |name: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)
                    .and_then(|v| v.trim().parse::<f64>().ok())
            })
            .unwrap_or(0.0)
    };
    Ok(PickStats {
        count: value("llmgw_pick_duration_seconds_count "),
        wall_s: value("llmgw_pick_duration_seconds_sum "),
        cpu_s: value("llmgw_pick_cpu_seconds_sum "),
    })
}

/// CPU seconds used by every thread of `pid` so far (`/proc/<pid>/task/*/schedstat`, ns).
pub fn process_cpu(pid: u32) -> anyhow::Result<f64> {
    let mut total_ns = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let path = task?.path().join("schedstat");
        if let Ok(text) = std::fs::read_to_string(path) {
            total_ns += text
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Ok(total_ns as f64 / 1e9)
}

/// CPU seconds used by `pid` so far, threads that have exited included (`/proc/<pid>/stat`,
/// 10 ms ticks): where worker threads come and go during a window (tokio's blocking pool), the
/// per-thread sum of [`process_cpu`] would lose the exited threads' time.
pub fn process_cpu_with_exited_threads(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    Ok(llmgw_integration::procfs::proc_stat_cpu_seconds(&stat)?)
}

/// A minimal HTTP/1.1 client with a pool of keep-alive connections to one address.
#[derive(Clone)]
pub struct Client {
    addr: SocketAddr,
    idle: Arc<Mutex<Vec<BufReader<TcpStream>>>>,
}

impl Client {
    pub fn new(addr: SocketAddr) -> Client {
        Client {
            addr,
            idle: Arc::default(),
        }
    }

    pub async fn get(&self, path: &str) -> anyhow::Result<(u16, Vec<u8>)> {
        let head = format!("GET {path} HTTP/1.1\r\nhost: bench\r\n\r\n");
        self.exchange(head.as_bytes(), &[]).await
    }

    /// POSTs a JSON completion; fails unless the answer is 200.
    pub async fn post(&self, body: &[u8]) -> anyhow::Result<()> {
        self.post_to("/v1/completions", body).await
    }

    /// POSTs a JSON body to `path`; fails unless the answer is 200.
    pub async fn post_to(&self, path: &str, body: &[u8]) -> anyhow::Result<()> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let (status, response) = self.exchange(head.as_bytes(), body).await?;
        if status != 200 {
            bail!(
                "HTTP {status} from {}: {}",
                self.addr,
                String::from_utf8_lossy(&response[..response.len().min(300)])
            );
        }
        Ok(())
    }

    async fn exchange(&self, head: &[u8], body: &[u8]) -> anyhow::Result<(u16, Vec<u8>)> {
        let pooled = self.idle.lock().pop();
        let mut conn = match pooled {
            Some(conn) => conn,
            None => {
                let stream = TcpStream::connect(self.addr).await?;
                stream.set_nodelay(true)?;
                BufReader::with_capacity(64 * 1024, stream)
            }
        };
        conn.get_mut().write_all(head).await?;
        conn.get_mut().write_all(body).await?;
        let (status, response, keep_alive) = read_response(&mut conn).await?;
        if keep_alive {
            self.idle.lock().push(conn);
        }
        Ok((status, response))
    }
}

async fn read_response(conn: &mut BufReader<TcpStream>) -> anyhow::Result<(u16, Vec<u8>, bool)> {
    let mut line = String::new();
    conn.read_line(&mut line).await?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("status line")?;
    let mut content_length = None;
    let mut chunked = false;
    let mut keep_alive = true;
    loop {
        line.clear();
        conn.read_line(&mut line).await?;
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            let value = value.trim();
            match name.to_ascii_lowercase().as_str() {
                "content-length" => content_length = value.parse::<usize>().ok(),
                "transfer-encoding" => chunked = value.eq_ignore_ascii_case("chunked"),
                "connection" => keep_alive = !value.eq_ignore_ascii_case("close"),
                _ => {}
            }
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            line.clear();
            conn.read_line(&mut line).await?;
            let size = usize::from_str_radix(line.trim(), 16).context("chunk size")?;
            let mut chunk = vec![0; size + 2];
            conn.read_exact(&mut chunk).await?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else if let Some(length) = content_length {
        body.resize(length, 0);
        conn.read_exact(&mut body).await?;
    } else {
        conn.read_to_end(&mut body).await?;
        keep_alive = false;
    }
    Ok((status, body, keep_alive))
}
