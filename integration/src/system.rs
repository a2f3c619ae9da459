//! The whole system on loopback, as `make run`, the benchmarks and the system tests start it:
//! simulated replicas, `llmgw-router`, one `llmgw-agent` for the node, and Envoy in front, all
//! real processes killed when the [`System`] is dropped.

use std::net::SocketAddr;
use std::time::Duration;

use crate::agent::AgentCommand;
use crate::envoy::EnvoyCommand;
use crate::prom;
pub use crate::router::RouterAddrs;
use crate::router::RouterCommand;
use crate::{
    ChildGuard, SimHandle, cache_sim_args, free_port, poll_until, repo_root, spawn_sim_with_env,
};

/// What to start.
#[derive(Debug, Clone)]
pub struct SystemConfig {
    pub replicas: usize,
    pub model: String,
    pub block_size: usize,
    /// Cache capacity of each replica, in blocks.
    pub blocks_per_replica: usize,
    /// PYTHONHASHSEED of every engine.
    pub seed: String,
    pub node: String,
    /// Extra `llmgw-sim` flags (latency model, output length…).
    pub sim_args: Vec<String>,
    /// Extra `llmgw-router serve` flags.
    pub router_args: Vec<String>,
    /// Start the agent (without it, the router routes by load and the prefix tree only).
    pub agent: bool,
    /// How many routers (at least one); Envoy asks the first, the agent feeds them all.
    pub routers: usize,
    /// Envoy's log level.
    pub envoy_log_level: String,
    /// Replicas serve vLLM's replay socket and the agent uses it (as `deploy/` runs them), so
    /// that a restarted agent recovers the blocks cached before it started.
    pub replay: bool,
    /// With several routers: each is given the others' feed ports (`--peer`), so they share
    /// picks and requests in flight.
    pub peering: bool,
}

impl Default for SystemConfig {
    fn default() -> Self {
        SystemConfig {
            replicas: 4,
            model: "tiny".to_owned(),
            block_size: 16,
            blocks_per_replica: 512,
            seed: "1729".to_owned(),
            node: "node-a".to_owned(),
            sim_args: Vec::new(),
            router_args: Vec::new(),
            agent: true,
            routers: 1,
            envoy_log_level: "error".to_owned(),
            replay: false,
            peering: false,
        }
    }
}

/// Everything running. Dropping it stops every process.
pub struct System {
    pub config: SystemConfig,
    /// The router Envoy asks.
    pub router: RouterAddrs,
    /// The other routers (`SystemConfig::routers` - 1), fed by the same agent.
    pub other_routers: Vec<RouterAddrs>,
    /// Envoy's listener: where clients send requests.
    pub envoy: SocketAddr,
    pub envoy_admin: SocketAddr,
    // Fields drop in declaration order: Envoy first, the replicas last. A `None` process is
    // stopped (a fault injected with `kill_*`) until its `restart_*`.
    _envoy: ChildGuard,
    agent: Option<ChildGuard>,
    /// The agent's admin address (`/metrics`), while one runs.
    pub agent_admin: Option<SocketAddr>,
    /// Every router's process, the one Envoy asks first.
    router_guards: Vec<Option<ChildGuard>>,
    pub sims: Vec<SimHandle>,
}

impl System {
    /// `http://ENVOY{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.envoy, path)
    }

    /// Every router, the one Envoy asks first.
    pub fn routers(&self) -> Vec<RouterAddrs> {
        std::iter::once(self.router)
            .chain(self.other_routers.iter().copied())
            .collect()
    }

    /// The replica addresses, in start order.
    pub fn replicas(&self) -> Vec<SocketAddr> {
        self.sims.iter().map(|s| s.addr).collect()
    }

    /// The process id of router `i` (0: the one Envoy asks), while it runs.
    pub fn router_pid(&self, i: usize) -> Option<u32> {
        self.router_guards.get(i)?.as_ref().map(ChildGuard::id)
    }

    /// Envoy's process id.
    pub fn envoy_pid(&self) -> u32 {
        self._envoy.id()
    }

    /// Stops router `i` (0: the one Envoy asks) at once, as a crash would.
    pub fn kill_router(&mut self, i: usize) {
        if let Some(slot) = self.router_guards.get_mut(i) {
            *slot = None;
        }
    }

    /// Starts router `i` again on the ports it had, so Envoy and the agent find it.
    pub fn restart_router(&mut self, i: usize) {
        let routers = self.routers();
        let at = routers[i];
        let peers: Vec<SocketAddr> = match self.config.peering {
            true => routers
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(_, r)| r.feed)
                .collect(),
            false => Vec::new(),
        };
        let (addrs, guard) = start_router_at(&self.config, &self.sims, at, &peers);
        assert_eq!(addrs.grpc, at.grpc, "router restarted on its ports");
        self.router_guards[i] = Some(guard);
    }

    /// Stops the agent at once.
    pub fn kill_agent(&mut self) {
        self.agent = None;
        self.agent_admin = None;
    }

    /// Starts the agent again, streaming to every router.
    pub fn restart_agent(&mut self) {
        let feeds: Vec<SocketAddr> = self.routers().iter().map(|r| r.feed).collect();
        let (agent, admin) = start_agent(&self.config, &self.sims, &feeds);
        self.agent = Some(agent);
        self.agent_admin = Some(admin);
    }

    /// Kills replica `i` and starts it again on the same HTTP port and KV-events endpoint (an
    /// engine restart: its cache starts empty); returns once it listens.
    pub fn restart_replica(&mut self, i: usize) {
        // Kill first: the new process binds the same ports.
        self.sims[i].kill();
        let port = self.sims[i].addr.port().to_string();
        let events = self.sims[i].events_rebind().expect("sim publishes events");
        let replay = self.sims[i].replay_rebind();
        let new = spawn_replica(&self.config, Some((&port, &events, replay.as_deref())));
        self.sims[i].restarted_as(new);
    }
}

/// Starts one replica; `at` is (HTTP port, KV-events endpoint, replay endpoint) to restart one
/// on its ports.
fn spawn_replica(config: &SystemConfig, at: Option<(&str, &str, Option<&str>)>) -> SimHandle {
    let endpoint = at.map_or("tcp://127.0.0.1:*", |(_, events, _)| events);
    let replay = match at {
        Some((_, _, Some(replay))) => format!(r#","replay_endpoint":"{replay}""#),
        _ if config.replay => r#","replay_endpoint":"tcp://127.0.0.1:*""#.to_owned(),
        _ => String::new(),
    };
    let events = format!(
        r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"{endpoint}"{replay},"topic":"kv"}}"#
    );
    let mut args = cache_sim_args(
        &config.model,
        config.block_size,
        config.blocks_per_replica,
        &events,
    );
    args.extend(config.sim_args.iter().cloned());
    if let Some((port, _, _)) = at {
        args.extend(["--port".to_owned(), port.to_owned()]);
    }
    spawn_sim_with_env(args, [("PYTHONHASHSEED", config.seed.as_str())])
}

/// Starts the system and waits until Envoy is ready, the router sees every replica healthy and
/// (with an agent) the agent's stream is up. Test-support code: panics with a clear message
/// when a part does not start.
pub async fn start(config: SystemConfig) -> System {
    let sims: Vec<SimHandle> = (0..config.replicas)
        .map(|_| spawn_replica(&config, None))
        .collect();

    // Feed ports chosen up front when the routers peer: each is told the others'.
    let preset: Vec<Option<SocketAddr>> = (0..config.routers.max(1))
        .map(|_| config.peering.then(crate::free_addr))
        .collect();
    let peers_of = |i: usize| -> Vec<SocketAddr> {
        let others = preset.iter().enumerate().filter(|&(j, _)| j != i);
        others.filter_map(|(_, feed)| *feed).collect()
    };
    let (router, router_guard) = start_router(&config, &sims, preset[0], &peers_of(0));
    let (other_routers, other_guards): (Vec<_>, Vec<_>) = (1..config.routers)
        .map(|i| start_router(&config, &sims, preset[i], &peers_of(i)))
        .unzip();
    let feeds: Vec<SocketAddr> = std::iter::once(router.feed)
        .chain(other_routers.iter().map(|r| r.feed))
        .collect();
    let (agent, agent_admin) = match config.agent.then(|| start_agent(&config, &sims, &feeds)) {
        Some((agent, admin)) => (Some(agent), Some(admin)),
        None => (None, None),
    };
    let (envoy, envoy_admin, envoy_guard) = start_envoy(&config, router.grpc, &sims).await;
    let system = System {
        config,
        sims,
        router,
        other_routers,
        envoy,
        envoy_admin,
        _envoy: envoy_guard,
        agent,
        agent_admin,
        router_guards: std::iter::once(Some(router_guard))
            .chain(other_guards.into_iter().map(Some))
            .collect(),
    };
    wait_ready(&system).await;
    system
}

/// Starts a router for `sims`, on `at`'s ports when given (a restart), else on free ones.
/// Starts a router on fresh ports (its feed port `feed` when given), peering with `peers`.
fn start_router(
    config: &SystemConfig,
    sims: &[SimHandle],
    feed: Option<SocketAddr>,
    peers: &[SocketAddr],
) -> (RouterAddrs, ChildGuard) {
    let mut router = router_command(config, sims, peers);
    if let Some(feed) = feed {
        router = router.feed(feed);
    }
    spawn_router(router, config)
}

/// Starts a router again on the ports `at` it had.
fn start_router_at(
    config: &SystemConfig,
    sims: &[SimHandle],
    at: RouterAddrs,
    peers: &[SocketAddr],
) -> (RouterAddrs, ChildGuard) {
    spawn_router(router_command(config, sims, peers).at(at), config)
}

fn router_command(
    config: &SystemConfig,
    sims: &[SimHandle],
    peers: &[SocketAddr],
) -> RouterCommand {
    let mut router = RouterCommand::new()
        .args(["--health-interval", "200ms", "--scrape-interval", "100ms"])
        .args(["--feed-grace", "5s"])
        .model(&config.model, config.block_size, &config.seed);
    for sim in sims {
        router = router.replica(&config.model, sim.addr, Some(&config.node));
    }
    for peer in peers {
        router = router.args(["--peer".to_owned(), format!("http://{peer}")]);
    }
    router
}

fn spawn_router(router: RouterCommand, config: &SystemConfig) -> (RouterAddrs, ChildGuard) {
    let process = router
        .args(&config.router_args)
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    (process.addrs, process.guard)
}

/// Starts the agent; returns it and its admin address.
fn start_agent(
    config: &SystemConfig,
    sims: &[SimHandle],
    feeds: &[SocketAddr],
) -> (ChildGuard, SocketAddr) {
    let admin = crate::free_addr();
    let mut agent = AgentCommand::serve(&config.node)
        .hash_settings(&config.model, &config.seed, config.block_size)
        .args(["--admin-addr", &admin.to_string()]);
    for feed in feeds {
        agent = agent.router(*feed);
    }
    for sim in sims {
        let events = sim.events.as_deref().expect("sim publishes events");
        agent = agent.engine(sim.addr, events, sim.replay.as_deref());
    }
    (agent.spawn().unwrap_or_else(|e| panic!("{e}")), admin)
}

/// The default Envoy config (`envoy/envoy.yaml`) pointed at these ports and replicas.
pub fn envoy_config(grpc: SocketAddr, listen: u16, admin: u16, replicas: &[SocketAddr]) -> String {
    envoy_config_for_routers(&[grpc], listen, admin, replicas)
}

/// The same, with several routers behind Envoy's ext_proc cluster (Envoy balances the
/// requests' ext_proc streams over them round robin).
pub fn envoy_config_for_routers(
    grpcs: &[SocketAddr],
    listen: u16,
    admin: u16,
    replicas: &[SocketAddr],
) -> String {
    let text = std::fs::read_to_string(repo_root().join("envoy/envoy.yaml"))
        .expect("read envoy/envoy.yaml");
    let endpoint = |port: u16| {
        format!(
            "        - endpoint:\n            address:\n              socket_address: {{address: 127.0.0.1, port_value: {port}}}\n"
        )
    };
    let defaults = format!("{}{}", endpoint(8001), endpoint(8002));
    assert!(
        text.contains(&defaults),
        "envoy/envoy.yaml no longer lists the replicas as expected"
    );
    let ours: String = replicas.iter().map(|r| endpoint(r.port())).collect();
    let router_default = endpoint(9002);
    assert!(
        text.contains(&router_default),
        "envoy/envoy.yaml no longer lists the router as expected"
    );
    let routers: String = grpcs.iter().map(|g| endpoint(g.port())).collect();
    text.replace(&defaults, &ours)
        .replace(&router_default, &routers)
        .replace("port_value: 10000", &format!("port_value: {listen}"))
        .replace("port_value: 9901", &format!("port_value: {admin}"))
}

async fn start_envoy(
    config: &SystemConfig,
    grpc: SocketAddr,
    sims: &[SimHandle],
) -> (SocketAddr, SocketAddr, ChildGuard) {
    let (listen, admin) = (free_port(), free_port());
    let replicas: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    let envoy = EnvoyCommand::new(
        "system",
        envoy_config(grpc, listen, admin, &replicas),
        listen,
        admin,
    )
    .log_level(&config.envoy_log_level)
    .spawn()
    .unwrap_or_else(|e| panic!("{e}"));
    (envoy.listen, envoy.admin, envoy.guard)
}

async fn wait_ready(system: &System) {
    let client = reqwest::Client::new();
    let envoy_ready = format!("http://{}/ready", system.envoy_admin);
    let mut status = String::new();
    for _ in 0..300 {
        let envoy_up = client
            .get(&envoy_ready)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        let mut routers_ready = true;
        for router in system.routers() {
            let metrics = match client
                .get(format!("http://{}/metrics", router.admin))
                .send()
                .await
            {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            let healthy = metrics
                .lines()
                .filter(|l| l.starts_with("llmgw_replica_healthy{") && l.ends_with(" 1"))
                .count();
            let streams_up = !system.config.agent
                || metrics
                    .lines()
                    .any(|l| l.starts_with("llmgw_feed_streams ") && !l.ends_with(" 0"));
            if healthy != system.sims.len() || !streams_up {
                routers_ready = false;
                status = format!(
                    "envoy ready: {envoy_up}, router {}: healthy replicas {healthy}/{}, agent \
                     stream up: {streams_up}",
                    router.admin,
                    system.sims.len()
                );
                break;
            }
        }
        if envoy_up && routers_ready {
            return;
        }
        if routers_ready {
            status = format!("envoy ready: {envoy_up}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the system did not become ready within 15 s ({status})");
}

/// The block hashes the (first) router's index holds for `replica`.
pub async fn router_blocks(system: &System, replica: SocketAddr) -> Vec<u64> {
    router_blocks_at(system.router, replica).await
}

/// The block hashes `router`'s index holds for `replica`.
pub async fn router_blocks_at(router: RouterAddrs, replica: SocketAddr) -> Vec<u64> {
    let url = format!("http://{}/debug/replicas/{replica}/blocks", router.admin);
    let v: serde_json::Value = reqwest::get(url)
        .await
        .expect("router admin")
        .json()
        .await
        .expect("json");
    serde_json::from_value(v["block_hashes"].clone()).expect("u64 list")
}

/// The block hashes a sim holds now (`/debug/blocks`), sorted.
pub async fn sim_blocks(sim: &SimHandle) -> Vec<u64> {
    let v: serde_json::Value = reqwest::get(format!("{}/debug/blocks", sim.url()))
        .await
        .expect("sim debug/blocks")
        .json()
        .await
        .expect("json");
    let mut blocks: Vec<u64> = serde_json::from_value(v["block_hashes"].clone()).expect("u64 list");
    blocks.sort_unstable();
    blocks
}

/// Waits (at most `timeout`) until every router's index equals every sim's own block list;
/// returns whether it did.
pub async fn converged(system: &System, timeout: Duration) -> bool {
    poll_until(timeout, || async {
        for sim in &system.sims {
            let blocks = sim_blocks(sim).await;
            for router in system.routers() {
                if router_blocks_at(router, sim.addr).await != blocks {
                    return false;
                }
            }
        }
        true
    })
    .await
}

/// Waits (at most `timeout`) until every router's last scrape of every replica shows the load
/// the replica reports now (waiting, running, KV-cache usage); returns whether it did. A pick
/// that no cached block decides is a load decision: two routers agree on it only once both
/// have scraped the same state, which the index converging earlier does not imply.
pub async fn load_seen(system: &System, timeout: Duration) -> bool {
    poll_until(timeout, || async {
        for sim in &system.sims {
            let own = sim_load(sim).await;
            for router in system.routers() {
                if router_load_of(router, sim.addr).await != own {
                    return false;
                }
            }
        }
        true
    })
    .await
}

/// The load a sim reports on its own `/metrics`, read as the router reads it.
async fn sim_load(sim: &SimHandle) -> [Option<f64>; 3] {
    let text = prom::scrape(&format!("{}/metrics", sim.url()))
        .await
        .expect("sim metrics");
    let load = llmgw::pool::vllm_metrics::parse_engine_load(&text);
    [load.waiting, load.running, load.kv_cache_usage]
}

/// The load `router` last scraped from `replica` (its `llmgw_replica_*` gauges).
async fn router_load_of(router: RouterAddrs, replica: SocketAddr) -> [Option<f64>; 3] {
    let text = prom::scrape(&format!("http://{}/metrics", router.admin))
        .await
        .expect("router metrics");
    let replica = replica.to_string();
    ["waiting", "running", "kv_cache_usage"].map(|gauge| {
        prom::sum(
            &text,
            &format!("llmgw_replica_{gauge}"),
            &[("replica", &replica)],
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_asks_every_router_and_routes_to_every_replica() {
        let addr = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let yaml = envoy_config_for_routers(
            &[addr(7101), addr(7102)],
            10500,
            9500,
            &[addr(8101), addr(8102), addr(8103)],
        );
        for port in [7101, 7102, 8101, 8102, 8103, 10500, 9500] {
            assert!(yaml.contains(&format!("port_value: {port}}}")), "{port}");
        }
        for default in [9002, 8001, 8002, 10000, 9901] {
            assert!(
                !yaml.contains(&format!("port_value: {default}}}")),
                "{default}"
            );
        }
        // The result is still one valid YAML document.
        serde_yaml::from_str::<serde_yaml::Value>(&yaml).expect("yaml");
    }
}
