//! The running agent: one intake and one mirror task per engine, plus the admin HTTP server
//! (`/metrics`, `/healthz`, `/debug/engines`, `/debug/engines/{name}/blocks`).
//!
//! It also wires the feed: [`Agent`] is the [`FeedSource`] every uplink reads, and the spawner
//! handed to each [`routers::follow`] starts an uplink on it. Neither `uplink` nor `routers`
//! knows the agent, so no module here imports one that imports it back.
//!
//! The engines may change while it runs ([`Agent::set_engines`], from a reloaded `--config`
//! file or the pods on the node, see [`crate::pods`]): a new engine starts from an empty
//! mirror, a removed one's tasks stop, and every uplink then opens a new stream whose Hello
//! lists the new set.
//!
//! # Concurrency model
//! Tasks are spawned on the ambient tokio runtime and owned by [`Agent`]: each engine's by its
//! entry in the engine map (aborted when the engine is removed or the agent dropped). The map
//! sits behind a `parking_lot::RwLock` held only to read or swap entries, never across an
//! `.await`; `set_engines` calls are serialised by an async mutex.
//! Uplink tasks and router followers are owned by whoever called [`Agent::start_uplinks`]; each
//! uplink holds the agent through an `Arc`. The admin server reads engine state through each
//! [`Engine`]'s short-held lock and the metrics registry; it never blocks the intake.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use parking_lot::RwLock;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::JoinHandle;

use crate::config::{AgentConfig, EngineConfig};
use crate::engine::{
    Engine, EngineId, EngineSnapshot, HashStatus, Input, MirrorTask, ReplicaId, Update, Updates,
};
use crate::hashcheck::HashCheck;
use crate::metrics::{ChangeLabel, Metrics};
use crate::routers::{self, RouterService};
use crate::uplink::{self, FeedSource, NodeInfo, UplinkConfig};
use crate::zmq::{EngineEndpoint, Intake, ZmqError};

/// Errors starting the agent.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("hash settings: {0}")]
    Hash(#[from] llmgw_core::blockhash::BlockHashError),
    #[error("engine {engine}: {source}")]
    Zmq {
        engine: String,
        #[source]
        source: ZmqError,
    },
    #[error("admin server on {addr}: {source}")]
    Admin {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Capacity of the agent-wide delta channel (deltas, not events: one per engine per window).
const UPDATE_CAPACITY: usize = 4096;

/// A started agent.
pub struct Agent {
    pub config: AgentConfig,
    pub metrics: Arc<Metrics>,
    pub updates: Updates,
    check: Option<HashCheck>,
    /// The engines mirrored now, by name. Read briefly by uplinks and the admin server;
    /// written only by [`Agent::set_engines`] (never across an `.await`).
    engines: RwLock<BTreeMap<String, RunningEngine>>,
    /// Bumped each time the set of engines changes: uplinks then start a new stream, whose
    /// Hello lists the new set (a router drops what the old stream sent at the takeover).
    membership: watch::Sender<u64>,
    /// Serialises [`Agent::set_engines`] calls.
    changing: tokio::sync::Mutex<()>,
}

/// One mirrored engine: its state, its settings and its tasks (aborted when dropped).
struct RunningEngine {
    engine: Arc<Engine>,
    config: EngineConfig,
    inputs: mpsc::Sender<Input>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for RunningEngine {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// What [`Agent::set_engines`] changed, by engine name.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EngineChanges {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Engines whose settings changed: stopped and started again.
    pub restarted: Vec<String>,
    /// Engines that could not be started (a bound SUB whose address fails), with why.
    pub failed: Vec<(String, String)>,
}

impl EngineChanges {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.restarted.is_empty()
    }
}

impl Agent {
    /// Opens every configured engine's socket and starts its tasks.
    pub async fn start(config: AgentConfig) -> Result<Agent, DaemonError> {
        let (updates, _) = broadcast::channel(UPDATE_CAPACITY);
        let check = config.hash_settings().map(HashCheck::new).transpose()?;
        let agent = Agent {
            metrics: Arc::new(Metrics::new()),
            updates,
            check,
            engines: RwLock::new(BTreeMap::new()),
            membership: watch::Sender::new(0),
            changing: tokio::sync::Mutex::new(()),
            config,
        };
        let mut started = BTreeMap::new();
        for ec in agent.config.engines.clone() {
            let running = agent.start_engine(ec).await?;
            started.insert(running.config.name.clone(), running);
        }
        agent.metrics.engines.set(started.len() as i64);
        *agent.engines.write() = started;
        Ok(agent)
    }

    /// The engines mirrored now, in name order.
    pub fn engines(&self) -> Vec<Arc<Engine>> {
        self.engines
            .read()
            .values()
            .map(|r| Arc::clone(&r.engine))
            .collect()
    }

    /// The engine named `name`, if mirrored now.
    pub fn engine(&self, name: &str) -> Option<Arc<Engine>> {
        self.engines.read().get(name).map(|r| Arc::clone(&r.engine))
    }

    /// A receiver of the membership generation, bumped when the engine set changes.
    pub fn membership(&self) -> watch::Receiver<u64> {
        self.membership.subscribe()
    }

    /// Makes `wanted` the engines mirrored: starts the new ones, stops those gone (their
    /// mirrors are dropped), restarts those whose settings changed and leaves the rest
    /// untouched (their mirrors stay). An engine that cannot start is left out and reported;
    /// the others still change. When anything changed, every uplink starts a new stream.
    pub async fn set_engines(&self, wanted: Vec<EngineConfig>) -> EngineChanges {
        let _one_at_a_time = self.changing.lock().await;
        let mut changes = EngineChanges::default();
        let current: BTreeMap<String, EngineConfig> = self
            .engines
            .read()
            .iter()
            .map(|(name, r)| (name.clone(), r.config.clone()))
            .collect();
        let wanted: BTreeMap<String, EngineConfig> =
            wanted.into_iter().map(|e| (e.name.clone(), e)).collect();
        for (name, ec) in &wanted {
            match current.get(name) {
                Some(old) if old == ec => {}
                Some(_) => changes.restarted.push(name.clone()),
                None => changes.added.push(name.clone()),
            }
        }
        changes.removed = current
            .keys()
            .filter(|name| !wanted.contains_key(*name))
            .cloned()
            .collect();
        if changes.is_empty() {
            return changes;
        }
        // Stopped before anything starts, so a restarted engine's bound address is free again.
        let stopped: Vec<RunningEngine> = {
            let mut engines = self.engines.write();
            changes
                .removed
                .iter()
                .chain(&changes.restarted)
                .filter_map(|name| engines.remove(name))
                .collect()
        };
        // Dropped outside the lock: dropping aborts the engine's tasks.
        drop(stopped);
        let mut started = Vec::new();
        for name in changes.added.iter().chain(&changes.restarted) {
            let Some(ec) = wanted.get(name) else { continue };
            match self.start_engine(ec.clone()).await {
                Ok(running) => started.push(running),
                Err(e) => {
                    tracing::error!(engine = %name, error = %e, "engine not started");
                    changes.failed.push((name.clone(), e.to_string()));
                }
            }
        }
        // A failed new engine changed nothing; a failed restart leaves the engine removed.
        for (name, _) in &changes.failed {
            changes.added.retain(|n| n != name);
            if let Some(at) = changes.restarted.iter().position(|n| n == name) {
                changes.removed.push(changes.restarted.remove(at));
            }
        }
        let count = {
            let mut engines = self.engines.write();
            for running in started {
                engines.insert(running.config.name.clone(), running);
            }
            engines.len()
        };
        self.metrics.engines.set(count as i64);
        let bump = !changes.is_empty();
        for (change, n) in [
            ("added", changes.added.len()),
            ("removed", changes.removed.len()),
            ("restarted", changes.restarted.len()),
            ("failed", changes.failed.len()),
        ] {
            self.metrics
                .engine_changes
                .get_or_create(&ChangeLabel { change })
                .inc_by(n as u64);
        }
        if !bump {
            return changes;
        }
        for name in &changes.removed {
            self.metrics.forget_engine(name);
        }
        self.membership.send_modify(|generation| *generation += 1);
        tracing::info!(
            added = ?changes.added,
            removed = ?changes.removed,
            restarted = ?changes.restarted,
            "engines changed"
        );
        changes
    }

    /// Starts one engine's intake, mirror and health tasks.
    async fn start_engine(&self, ec: EngineConfig) -> Result<RunningEngine, DaemonError> {
        let engine = Engine::with_max_copies(
            EngineId(Arc::from(ec.name.as_str())),
            ReplicaId(Arc::from(ec.replica.as_str())),
            self.config.max_blocks_per_engine,
        );
        let endpoint = EngineEndpoint {
            endpoint: ec.endpoint.clone(),
            bind: ec.bind,
            replay: ec.replay.clone(),
            topic: ec.topic.clone(),
        };
        // A bound SUB is opened now, so that a bad address fails start-up. A connecting one
        // is opened by the intake task: the engine may not listen yet (`run` starts vLLM
        // only once the agent is up, and vLLM takes a minute or more to bind).
        let bound_sock = if ec.bind {
            let (sock, bound) =
                crate::zmq::open(&endpoint)
                    .await
                    .map_err(|source| DaemonError::Zmq {
                        engine: ec.name.clone(),
                        source,
                    })?;
            Some((sock, bound))
        } else {
            None
        };
        tracing::info!(
            engine = ec.name,
            replica = ec.replica,
            endpoint = bound_sock
                .as_ref()
                .and_then(|(_, b)| b.as_deref())
                .unwrap_or(&ec.endpoint),
            bind = ec.bind,
            replay = ec.replay.as_deref().unwrap_or("none"),
            "engine intake started"
        );
        let (tx, rx) = mpsc::channel(1024);
        let mirror = MirrorTask {
            engine: Arc::clone(&engine),
            check: self.check.clone(),
            window: self.config.window,
            metrics: Arc::clone(&self.metrics),
            updates: self.updates.clone(),
        };
        let intake = Intake {
            engine: Arc::from(ec.name.as_str()),
            endpoint,
            inputs: tx.clone(),
            metrics: Arc::clone(&self.metrics),
            replay_timeout: self.config.replay_timeout,
        };
        let mut tasks = vec![tokio::spawn(mirror.run(rx))];
        let name = ec.name.clone();
        tasks.push(tokio::spawn(async move {
            let sock = match bound_sock {
                Some((sock, _)) => sock,
                None => match crate::zmq::open_when_ready(&intake.endpoint).await {
                    Ok((sock, _)) => sock,
                    Err(e) => {
                        tracing::error!(engine = name, error = %e, "intake not started");
                        return;
                    }
                },
            };
            if let Err(e) = intake.run(sock).await {
                tracing::error!(engine = name, error = %e, "intake stopped");
            }
        }));
        if let Some(silence) = self.config.stale_after {
            let watch = crate::health::HealthWatch {
                engine: Arc::clone(&engine),
                url: ec.health.clone(),
                silence,
                probe_timeout: crate::health::HealthWatch::probe_timeout_for(silence),
                inputs: tx.clone(),
                metrics: Arc::clone(&self.metrics),
            };
            tasks.push(tokio::spawn(watch.run()));
        }
        Ok(RunningEngine {
            engine,
            config: ec,
            inputs: tx,
            tasks,
        })
    }

    /// Starts one uplink per configured router, and one follower per router service (which
    /// runs an uplink per address its name resolves to).
    pub fn start_uplinks(self: &Arc<Self>) -> Vec<JoinHandle<()>> {
        let spawn_uplink = self.uplink_spawner();
        let config_for = |router: &str| UplinkConfig::for_agent(router, &self.config);
        let fixed = self
            .config
            .routers
            .iter()
            .map(|r| spawn_uplink(config_for(r)));
        let followed = self.config.router_services.iter().map(|s| {
            let service = RouterService {
                target: s.clone(),
                interval: self.config.router_resolve_interval,
                uplink: config_for(s),
            };
            tokio::spawn(routers::follow(
                service,
                routers::Dns,
                Arc::clone(&self.metrics),
                spawn_uplink.clone(),
            ))
        });
        fixed.chain(followed).collect()
    }

    /// Starts an uplink on this agent for each config it is given (what a router follower
    /// needs to start one per address).
    pub fn uplink_spawner(
        self: &Arc<Self>,
    ) -> impl Fn(UplinkConfig) -> JoinHandle<()> + Clone + Send + 'static {
        let agent = Arc::clone(self);
        move |config| tokio::spawn(uplink::run(Arc::clone(&agent), config))
    }

    /// Resets an engine (the supervisor calls this when it restarts vLLM).
    pub async fn reset(&self, engine: &str, reason: crate::engine::ResetReason) -> bool {
        let inputs = self.engines.read().get(engine).map(|r| r.inputs.clone());
        match inputs {
            Some(tx) => tx.send(Input::Reset(reason)).await.is_ok(),
            None => false,
        }
    }

    /// Serves the admin endpoints until the listener fails.
    pub async fn serve_admin(self: Arc<Self>, addr: SocketAddr) -> Result<(), DaemonError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| DaemonError::Admin { addr, source })?;
        tracing::info!(%addr, "admin server listening");
        axum::serve(listener, admin_router(self))
            .await
            .map_err(|source| DaemonError::Admin { addr, source })
    }
}

impl FeedSource for Agent {
    fn node(&self) -> NodeInfo {
        NodeInfo::of(&self.config)
    }

    fn subscribe(&self) -> broadcast::Receiver<Update> {
        self.updates.subscribe()
    }

    fn snapshot_engines(&self) -> Vec<EngineSnapshot> {
        self.engines().iter().map(|e| e.snapshot()).collect()
    }

    fn membership(&self) -> Option<watch::Receiver<u64>> {
        Some(Agent::membership(self))
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// The admin routes (exposed for tests).
pub fn admin_router(agent: Arc<Agent>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/debug/engines", get(engines))
        .route("/debug/engines/{name}/blocks", get(blocks))
        .with_state(agent)
}

async fn metrics(State(agent): State<Arc<Agent>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        agent.metrics.encode(),
    )
        .into_response()
}

fn hash_status(h: HashStatus) -> &'static str {
    match h {
        HashStatus::Unchecked => "unchecked",
        HashStatus::Verified => "verified",
        HashStatus::Mismatch => "hash mismatch",
    }
}

async fn engines(State(agent): State<Arc<Agent>>) -> Response {
    let list: Vec<serde_json::Value> = agent
        .engines()
        .iter()
        .map(|e| {
            let snap = e.snapshot();
            serde_json::json!({
                "engine": &*e.id.0,
                "replica": &*e.replica.0,
                "hash": hash_status(snap.hash),
                "epoch": snap.snapshot.epoch,
                "delta_seq": snap.snapshot.seq,
                "blocks": e.block_set().len(),
            })
        })
        .collect();
    axum::Json(serde_json::json!({ "node": agent.config.node, "engines": list })).into_response()
}

async fn blocks(State(agent): State<Arc<Agent>>, Path(name): Path<String>) -> Response {
    let Some(engine) = agent.engine(&name) else {
        return (StatusCode::NOT_FOUND, format!("no engine {name:?}\n")).into_response();
    };
    let mut hashes: Vec<u64> = engine.block_set().into_iter().map(|k| k.hash.0).collect();
    hashes.sort_unstable();
    hashes.dedup();
    axum::Json(hashes).into_response()
}

/// Test support: waits (at most 10 s) until `agent`'s engines are named `want`, in order.
#[cfg(test)]
pub(crate) async fn engines_become(agent: &Agent, want: &[&str]) {
    let names = || -> Vec<String> { agent.engines().iter().map(|e| e.id.0.to_string()).collect() };
    for _ in 0..1000 {
        if names() == want {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("engines {:?}, want {want:?}", names());
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::AgentArgs;
    use crate::wire::{BlockStored, EventBatch, EventForm, ExternalHash, KvEvent, encode_batch};
    use crate::zmq::{Publisher, ReplyShape};

    /// Found against real vLLM (`make e2e-vllm`): `llmgw-agent run` starts vLLM only once the
    /// agent is up, and vLLM binds its PUB a minute or more later. Start-up used to wait for
    /// the connection and fail after zeromq's 30 s, so vLLM was never started.
    #[tokio::test]
    async fn starts_before_a_connecting_engine_listens_and_mirrors_it_once_it_binds() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let endpoint = format!("tcp://127.0.0.1:{port}");
        let args = AgentArgs {
            engines: vec![format!("127.0.0.1:1={endpoint}").parse().expect("spec")],
            stale_after_ms: Some(0),
            ..AgentArgs::default()
        };
        let agent = tokio::time::timeout(
            Duration::from_secs(5),
            Agent::start(args.resolve().expect("config")),
        )
        .await
        .expect("start-up does not wait for the engine")
        .expect("agent starts");

        // The engine binds late.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let mut publisher = Publisher::start(&endpoint, false, None, "", ReplyShape::WithTopic, 16)
            .await
            .expect("engine binds");
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![ExternalHash(7)],
                ..BlockStored::default()
            })],
            dp_rank: Some(0),
        };
        let payload = encode_batch(&batch, EventForm::TaggedMap);
        // PUB drops messages until the SUB has connected and subscribed: keep publishing.
        for seq in 0..100 {
            if !agent.engines()[0].block_set().is_empty() {
                break;
            }
            publisher.publish(seq, &payload).await.expect("publish");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let hashes: Vec<u64> = agent.engines()[0]
            .block_set()
            .into_iter()
            .map(|k| k.hash.0)
            .collect();
        assert!(hashes.contains(&7), "mirrored: {hashes:?}");
    }
}
