//! The router's configuration: a YAML file, flags and `LLMGW_*` environment variables saying the
//! same things. A flag (or its environment variable) overrides the file, and the file overrides
//! the defaults. Replicas from `--replica` are added to the file's.
//!
//! ```yaml
//! grpc_addr: 127.0.0.1:9002
//! admin_addr: 127.0.0.1:9090
//! health_interval: 1s
//! scrape_interval: 200ms
//! replicas:
//!   - address: 127.0.0.1:8001
//!     models: [tiny, tiny-lora]
//!     node: node-a
//! scheduler:                   # the scheduling profile: see `scheduler::profile`
//!   weights: {queue: 1, in_flight: 1, kv_utilization: 1, kv_cache: 2}
//!   imbalance_threshold: 16
//! flow_control:                # queueing while saturated: see `flowcontrol::options`
//!   queue_timeout: 30s
//!   objectives: [{name: interactive, priority: 100}, {name: batch, priority: -1}]
//! models:                      # engine settings for precise prefix routing
//!   - name: tiny
//!     block_size: 16
//!     hash_algo: sha256_cbor
//!     hash_seed: "1729"        # the engines' PYTHONHASHSEED
//! tokenize_deadline: 50ms
//! feed_addr: 0.0.0.0:9003      # agents stream KV events here
//! feed_token_file: /etc/llmgw/feed-token
//! feed_max_blocks_per_engine: 4000000   # an engine reporting more block copies is refused
//! feed_tls_cert: /etc/llmgw/feed.pem        # TLS on the feed port (with feed_tls_key)
//! feed_tls_key: /etc/llmgw/feed-key.pem
//! feed_tls_client_ca: /etc/llmgw/agents-ca.pem   # mutual TLS: agents need a cert it signed
//! feed_tls_skip_node_check: false   # true: a cert need not name the node its agent claims
//! peers: [https://router-2.llmgw:9003]   # the other routers' feed ports: share picks and load
//! peer_tls_ca: /etc/llmgw/routers-ca.pem # over TLS, as the feed is (the feed's cert is lent)
//! ```
//!
//! Each module owns its group of options: `tokenize::TokenizerOptions`, `kvindex::IndexOptions`,
//! `feed::FeedOptions`, `peers::PeerOptions`, `pool::monitor::ProbeOptions`,
//! `discovery::DiscoveryOptions` (and the scheduler's `SchedulerArgs` and `scheduler:` section).
//! A group is one struct that is both its flags (`#[command(flatten)]` here) and its file keys
//! (`#[serde(flatten)]`), with a `resolve(flags, file)` that applies the module's own defaults.
//! This module assembles the groups and keeps what belongs to no other module: listen
//! addresses, replicas, models, the file's reloading. A file key no group takes is an error
//! naming it.
//!
//! The file is polled for changes ([`watch_replicas`]); a change re-reads the replica list and
//! swaps it into the pool and the agent feed's node map. Other settings need a restart.
//!
//! Replica addresses are `IP:PORT` (or `localhost:PORT`): Envoy's `override_host` policy matches
//! the destination against the cluster's host addresses, so names would never match.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use serde::Deserialize;
use thiserror::Error;

use crate::discovery::{DiscoveryOptions, DiscoverySettings};
use crate::duration::DurationError;
use crate::extproc::DESTINATION_HEADER;
use crate::feed::{FeedOptions, FeedOptionsError, FeedSettings};
use crate::flowcontrol::{FlowControlOptions, FlowOptionsError, FlowSettings};
use crate::kvindex::{IndexConfig, IndexOptions};
use crate::models::{FileModel, ModelSettings};
use crate::peers::{PeerOptions, PeerOptionsError, PeerSettings};
use crate::pool::monitor::{ProbeOptions, ProbeSettings};
use crate::pool::{CONFIG_SOURCE, ReplicaSources, ReplicaSpec};
use crate::scheduler::{ProfileError, SchedulerArgs, SchedulerConfig};
use crate::tls::{ServingOptions, ServingOptionsError, ServingTls};
use crate::tokenize::{TokenizerConfig, TokenizerOptions};

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid configuration file {path}: {source}")]
    Yaml {
        path: PathBuf,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("invalid replica {0:?}: expected MODEL=IP:PORT[@NODE]")]
    ReplicaFlag(String),
    #[error("invalid replica address {0:?}: expected IP:PORT or localhost:PORT")]
    Address(String),
    #[error("replica {0} serves no model")]
    NoModels(String),
    #[error(transparent)]
    Model(#[from] crate::models::ModelSettingsError),
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error(transparent)]
    Duration(#[from] DurationError),
    #[error("{0} must be positive")]
    NotPositive(&'static str),
    #[error("unknown keys in {path}: {keys}")]
    UnknownKeys { path: PathBuf, keys: String },
    #[error(transparent)]
    Feed(#[from] FeedOptionsError),
    #[error(transparent)]
    Peers(#[from] PeerOptionsError),
    #[error(transparent)]
    Serving(#[from] ServingOptionsError),
    #[error(transparent)]
    FlowControl(#[from] FlowOptionsError),
    #[error("--pool-namespace needs --pool-name")]
    PoolNamespaceWithoutName,
}

/// `0.0.0.0:port`: the `--*-port` flags listen on every interface, as in a pod.
fn every_interface(port: u16) -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], port))
}

/// `serve` options. Every one is also an `LLMGW_*` environment variable.
#[derive(Debug, Clone, Default, Args)]
pub struct ServeArgs {
    /// YAML configuration file (reloaded when it changes).
    #[arg(long, env = "LLMGW_CONFIG")]
    pub config: Option<PathBuf>,
    /// A replica, repeatable: `MODEL=IP:PORT[@NODE]`. The same address under several models (a
    /// base model and its LoRA adapters) is one replica.
    #[arg(long = "replica", env = "LLMGW_REPLICAS", value_delimiter = ',')]
    pub replicas: Vec<String>,
    /// ext_proc gRPC listen address (default 127.0.0.1:9002).
    #[arg(long, env = "LLMGW_GRPC_ADDR")]
    pub grpc_addr: Option<SocketAddr>,
    /// ext_proc gRPC port on every interface (0.0.0.0:PORT), as Gateway API Inference
    /// Extension deployments pass it to an endpoint picker; --grpc-addr wins.
    #[arg(long, env = "LLMGW_GRPC_PORT")]
    pub grpc_port: Option<u16>,
    /// Also serve the gRPC health services (liveness, readiness, ext_proc) alone on
    /// 0.0.0.0:PORT, for Kubernetes gRPC probes (off by default; they are always on the
    /// ext_proc port too).
    #[arg(long, env = "LLMGW_GRPC_HEALTH_PORT")]
    pub grpc_health_port: Option<u16>,
    /// Also serve ext_proc (and the gRPC health services) on this Unix socket, for an Envoy on
    /// the same host or in the same pod (a `pipe` address in its cluster): no TCP stack between
    /// them. A stale socket file there is replaced.
    #[arg(long, env = "LLMGW_GRPC_UDS")]
    pub grpc_uds: Option<PathBuf>,
    #[command(flatten)]
    pub discovery: DiscoveryOptions,
    /// The InferencePool this router is the endpoint picker of: its Ready pods at its
    /// targetPorts are replicas (watched; serving the --models, else what each one's /v1/models
    /// lists), and it labels the metrics (`llmgw_pool_info`), /debug and logs.
    #[arg(long, env = "LLMGW_POOL_NAME")]
    pub pool_name: Option<String>,
    /// The InferencePool's namespace (see --pool-name; default the Kubernetes client's).
    #[arg(long, env = "LLMGW_POOL_NAMESPACE")]
    pub pool_namespace: Option<String>,
    /// Admin HTTP listen address: /metrics, /healthz, /debug (default 127.0.0.1:9090).
    #[arg(long, env = "LLMGW_ADMIN_ADDR")]
    pub admin_addr: Option<SocketAddr>,
    #[command(flatten)]
    pub probes: ProbeOptions,
    /// How often the configuration file is checked for changes (default 2s).
    #[arg(long, env = "LLMGW_CONFIG_POLL_INTERVAL", value_parser = crate::duration::parse)]
    pub config_poll_interval: Option<Duration>,
    /// On SIGTERM, how long to report not ready (readiness, ext_proc and inference-extension
    /// health) before closing the listeners, so that proxies and Kubernetes move new requests
    /// away first (default 0s; the Kubernetes manifests use 5s).
    #[arg(long, env = "LLMGW_DRAIN_DELAY", value_parser = crate::duration::parse)]
    pub drain_delay: Option<Duration>,
    /// Then how long open ext_proc streams (requests in flight) may take to finish before the
    /// router exits anyway (default 30s).
    #[arg(long, env = "LLMGW_DRAIN_TIMEOUT", value_parser = crate::duration::parse)]
    pub drain_timeout: Option<Duration>,
    /// Request bodies above this many bytes get 413 (default 16 MiB).
    #[arg(long, env = "LLMGW_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// The destination header and envoy.lb metadata key (default x-gateway-destination-endpoint).
    #[arg(long, env = "LLMGW_DESTINATION_HEADER")]
    pub destination_header: Option<String>,
    /// Turn on the GIE conformance suite's hooks: the `test-epp-endpoint-selection` header
    /// (IP or ip:port, comma-separated) picks the replicas, and responses name the endpoint that
    /// served in `x-conformance-test-served-endpoint`. Never in production.
    #[arg(long, env = "LLMGW_ALLOW_TEST_ENDPOINT_SELECTION")]
    pub allow_test_endpoint_selection: bool,
    /// The scheduling profile's common knobs.
    #[command(flatten)]
    pub scheduler: SchedulerArgs,
    #[command(flatten)]
    pub flow_control: FlowControlOptions,
    /// A model's engine settings for precise prefix routing, repeatable:
    /// `MODEL=block_size=N[,algo=sha256_cbor|xxhash_cbor][,seed=PYTHONHASHSEED]
    /// [,salt=tagged|untagged][,tokenizer=PATH/tokenizer.json]`. Models without one are routed by
    /// the approximate prefix tree.
    #[arg(long = "model", env = "LLMGW_MODEL")]
    pub models: Vec<String>,
    #[command(flatten)]
    pub tokenizer: TokenizerOptions,
    #[command(flatten)]
    pub index: IndexOptions,
    #[command(flatten)]
    pub feed: FeedOptions,
    #[command(flatten)]
    pub peers: PeerOptions,
    #[command(flatten)]
    pub serving: ServingOptions,
}

/// The configuration file. Every field is optional; the modules' own groups of keys are
/// flattened in, so the file stays one flat map.
#[derive(Debug, Default, Deserialize)]
pub struct FileConfig {
    pub grpc_addr: Option<SocketAddr>,
    pub grpc_health_addr: Option<SocketAddr>,
    pub grpc_uds: Option<PathBuf>,
    pub admin_addr: Option<SocketAddr>,
    pub pool_name: Option<String>,
    pub pool_namespace: Option<String>,
    #[serde(default, deserialize_with = "crate::duration::optional")]
    pub config_poll_interval: Option<Duration>,
    pub max_body_bytes: Option<usize>,
    pub destination_header: Option<String>,
    pub allow_test_endpoint_selection: Option<bool>,
    #[serde(default, deserialize_with = "crate::duration::optional")]
    pub drain_delay: Option<Duration>,
    #[serde(default, deserialize_with = "crate::duration::optional")]
    pub drain_timeout: Option<Duration>,
    #[serde(default)]
    pub replicas: Vec<FileReplica>,
    #[serde(default)]
    pub scheduler: Option<SchedulerConfig>,
    #[serde(default)]
    pub flow_control: FlowControlOptions,
    #[serde(default)]
    pub models: Vec<FileModel>,
    #[serde(flatten)]
    pub discovery: DiscoveryOptions,
    #[serde(flatten)]
    pub probes: ProbeOptions,
    #[serde(flatten)]
    pub tokenizer: TokenizerOptions,
    #[serde(flatten)]
    pub index: IndexOptions,
    #[serde(flatten)]
    pub feed: FeedOptions,
    #[serde(flatten)]
    pub peers: PeerOptions,
    #[serde(flatten)]
    pub serving: ServingOptions,
    /// Keys no field above took. Serde cannot deny unknown fields of a struct with flattened
    /// parts, so this catches them, last, and [`read_file`] refuses the file when any is here.
    #[serde(flatten)]
    unknown: std::collections::BTreeMap<String, serde_yaml::Value>,
}

/// One replica in the file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileReplica {
    /// `IP:PORT`.
    pub address: String,
    /// Served model names, LoRA adapters included.
    pub models: Vec<String>,
    #[serde(default)]
    pub node: Option<String>,
}

/// The Gateway API Inference Extension InferencePool a router serves.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PoolIdentity {
    pub name: String,
    /// Empty when not given.
    pub namespace: String,
}

/// The resolved configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    pub grpc_addr: SocketAddr,
    /// A listener serving only the gRPC health services, if wanted.
    pub grpc_health_addr: Option<SocketAddr>,
    /// A Unix socket serving what `grpc_addr` serves, if wanted.
    pub grpc_uds: Option<PathBuf>,
    pub admin_addr: SocketAddr,
    /// The InferencePool this router picks for, if named.
    pub pool: Option<PoolIdentity>,
    /// Kubernetes Services whose endpoints are replicas.
    pub discovery: DiscoverySettings,
    pub replicas: Vec<ReplicaSpec>,
    /// Health checks and load scrapes of the replicas.
    pub probes: ProbeSettings,
    pub config_poll_interval: Duration,
    pub max_body_bytes: usize,
    pub destination_header: String,
    pub allow_test_endpoint_selection: bool,
    /// The scheduling profile and its options, flags applied.
    pub scheduler: SchedulerConfig,
    /// Admission: queueing, priorities, fairness.
    pub flow_control: FlowSettings,
    /// The file, for reloads.
    pub config_path: Option<PathBuf>,
    /// The `--replica` flags, re-added on every reload.
    pub flag_replicas: Vec<ReplicaSpec>,
    /// Engine settings per model, for the precise tier.
    pub models: Vec<ModelSettings>,
    pub tokenizer: TokenizerConfig,
    pub index: IndexConfig,
    pub feed: FeedSettings,
    /// The other routers behind the same proxy.
    pub peers: PeerSettings,
    /// TLS on the ext_proc port, or plaintext.
    pub ext_proc_tls: Option<ServingTls>,
    /// How the router leaves on SIGTERM.
    pub drain: DrainSettings,
}

/// How a router leaves on SIGTERM: `delay` reporting not ready while still serving, then the
/// listeners close and open streams get `timeout` to finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainSettings {
    pub delay: Duration,
    pub timeout: Duration,
}

impl Settings {
    /// Whether anything can give the router replicas: the configuration, a Kubernetes
    /// Service, or the InferencePool.
    pub fn has_replica_source(&self) -> bool {
        !self.replicas.is_empty()
            || self.config_path.is_some()
            || !self.discovery.services.is_empty()
            || self.pool.is_some()
    }

    /// Flags over file over defaults.
    pub fn resolve(args: &ServeArgs) -> Result<Settings, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let flag_replicas = args
            .replicas
            .iter()
            .map(|r| parse_replica_flag(r))
            .collect::<Result<Vec<_>, _>>()?;
        let mut replicas = file_replicas(&file)?;
        replicas.extend(flag_replicas.iter().cloned());

        let mut scheduler = file.scheduler.clone().unwrap_or_default();
        scheduler.apply(&args.scheduler)?;
        // Unknown weights are refused at start-up, with the rest of the profile when built.
        scheduler.effective_profile()?;

        let models = resolve_models(args, &file)?;
        let feed = args.feed.resolve(&file.feed)?;
        let peers = args.peers.resolve(&file.peers, feed.tls.as_ref())?;
        let settings = Settings {
            grpc_addr: args
                .grpc_addr
                .or(args.grpc_port.map(every_interface))
                .or(file.grpc_addr)
                .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 9002))),
            discovery: args.discovery.resolve(&file.discovery),
            grpc_uds: args.grpc_uds.clone().or(file.grpc_uds.clone()),
            grpc_health_addr: args
                .grpc_health_port
                .map(every_interface)
                .or(file.grpc_health_addr),
            pool: match (
                args.pool_name.clone().or(file.pool_name.clone()),
                args.pool_namespace.clone().or(file.pool_namespace.clone()),
            ) {
                (Some(name), namespace) => Some(PoolIdentity {
                    name,
                    namespace: namespace.unwrap_or_default(),
                }),
                (None, None) => None,
                (None, Some(_)) => return Err(ConfigError::PoolNamespaceWithoutName),
            },
            admin_addr: args
                .admin_addr
                .or(file.admin_addr)
                .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 9090))),
            replicas,
            probes: args.probes.resolve(&file.probes),
            config_poll_interval: args
                .config_poll_interval
                .or(file.config_poll_interval)
                .unwrap_or(Duration::from_secs(2)),
            max_body_bytes: args
                .max_body_bytes
                .or(file.max_body_bytes)
                .unwrap_or(16 * 1024 * 1024),
            destination_header: args
                .destination_header
                .clone()
                .or(file.destination_header)
                .unwrap_or_else(|| DESTINATION_HEADER.to_string())
                .to_ascii_lowercase(),
            allow_test_endpoint_selection: args.allow_test_endpoint_selection
                || file.allow_test_endpoint_selection.unwrap_or(false),
            scheduler,
            flow_control: args.flow_control.resolve(&file.flow_control)?,
            config_path: args.config.clone(),
            flag_replicas,
            models,
            tokenizer: args.tokenizer.resolve(&file.tokenizer),
            index: args.index.resolve(&file.index),
            feed,
            peers,
            ext_proc_tls: args.serving.resolve(&file.serving)?,
            drain: DrainSettings {
                delay: (args.drain_delay)
                    .or(file.drain_delay)
                    .unwrap_or(Duration::ZERO),
                timeout: (args.drain_timeout)
                    .or(file.drain_timeout)
                    .unwrap_or(Duration::from_secs(30)),
            },
        };
        for (name, value) in [
            ("health_interval", settings.probes.health_interval),
            ("scrape_interval", settings.probes.scrape_interval),
            ("probe_timeout", settings.probes.timeout),
            ("models_interval", settings.probes.models_interval),
            ("config_poll_interval", settings.config_poll_interval),
        ] {
            if value.is_zero() {
                return Err(ConfigError::NotPositive(name));
            }
        }
        Ok(settings)
    }
}

/// The file's models, then the flags' (a flag for the same model replaces the file's entry).
fn resolve_models(args: &ServeArgs, file: &FileConfig) -> Result<Vec<ModelSettings>, ConfigError> {
    let mut models: Vec<ModelSettings> = file
        .models
        .iter()
        .cloned()
        .map(ModelSettings::try_from)
        .collect::<Result<_, _>>()?;
    for flag in &args.models {
        let model: ModelSettings = flag.parse()?;
        models.retain(|m| m.model != model.model);
        models.push(model);
    }
    // Refuse settings no engine could have (xxhash without a seed) at start-up, not per request.
    crate::models::hashers(&models)?;
    Ok(models)
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_file(path, &text)
}

/// `text`, the contents of the file at `path`, as a configuration.
fn parse_file(path: &Path, text: &str) -> Result<FileConfig, ConfigError> {
    if text.trim().is_empty() {
        return Ok(FileConfig::default());
    }
    let file: FileConfig = serde_yaml::from_str(text).map_err(|source| ConfigError::Yaml {
        path: path.to_path_buf(),
        source,
    })?;
    if !file.unknown.is_empty() {
        return Err(ConfigError::UnknownKeys {
            path: path.to_path_buf(),
            keys: file.unknown.into_keys().collect::<Vec<_>>().join(", "),
        });
    }
    Ok(file)
}

fn file_replicas(file: &FileConfig) -> Result<Vec<ReplicaSpec>, ConfigError> {
    file.replicas
        .iter()
        .map(|r| {
            if r.models.is_empty() {
                return Err(ConfigError::NoModels(r.address.clone()));
            }
            Ok(ReplicaSpec {
                address: parse_address(&r.address)?,
                models: r.models.clone(),
                node: r.node.clone(),
            })
        })
        .collect()
}

/// `MODEL=IP:PORT[@NODE]`.
pub fn parse_replica_flag(flag: &str) -> Result<ReplicaSpec, ConfigError> {
    let invalid = || ConfigError::ReplicaFlag(flag.to_string());
    let (model, rest) = flag.trim().split_once('=').ok_or_else(invalid)?;
    let (address, node) = match rest.split_once('@') {
        Some((address, node)) if !node.is_empty() => (address, Some(node.to_string())),
        Some(_) => return Err(invalid()),
        None => (rest, None),
    };
    if model.is_empty() {
        return Err(invalid());
    }
    Ok(ReplicaSpec {
        address: parse_address(address)?,
        models: vec![model.to_string()],
        node,
    })
}

/// `IP:PORT`, `[IPv6]:PORT` or `localhost:PORT` (127.0.0.1).
pub fn parse_address(address: &str) -> Result<SocketAddr, ConfigError> {
    if let Ok(addr) = address.parse::<SocketAddr>() {
        return Ok(addr);
    }
    match address.split_once(':') {
        Some(("localhost", port)) => port
            .parse::<u16>()
            .map(|port| SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port))
            .map_err(|_| ConfigError::Address(address.to_string())),
        _ => Err(ConfigError::Address(address.to_string())),
    }
}

/// Polls the configuration file every `interval` and hands a changed replica list (the file's
/// and the flags') to `sources` as the configuration's list. A file that fails to parse is
/// reported and the replicas kept as they are. The file's contents at the time of the call are
/// the baseline; the returned future runs until dropped.
pub fn watch_replicas(
    path: PathBuf,
    interval: Duration,
    flag_replicas: Vec<ReplicaSpec>,
    sources: Arc<ReplicaSources>,
) -> impl Future<Output = ()> + Send {
    let baseline = std::fs::read(&path).ok();
    watch_from(path, interval, flag_replicas, sources, baseline)
}

async fn watch_from(
    path: PathBuf,
    interval: Duration,
    flag_replicas: Vec<ReplicaSpec>,
    sources: Arc<ReplicaSources>,
    last: Option<Vec<u8>>,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut changes = SettledChanges::new(last);
    loop {
        ticker.tick().await;
        let current = tokio::fs::read(&path).await;
        if !changes.settled(current.as_deref().ok()) {
            continue;
        }
        // The contents that held still are the ones parsed: a second read could catch the next
        // write half-done.
        let replicas = current
            .and_then(|bytes| {
                String::from_utf8(bytes).map_err(|e| {
                    std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error())
                })
            })
            .map_err(|source| ConfigError::Read {
                path: path.clone(),
                source,
            })
            .and_then(|text| parse_file(&path, &text))
            .and_then(|file| file_replicas(&file));
        match replicas {
            Ok(mut replicas) => {
                replicas.extend(flag_replicas.iter().cloned());
                // Node names can change while the pool's endpoints do not: always published.
                if sources.set(CONFIG_SOURCE, replicas) {
                    tracing::info!(path = %path.display(), "replica list reloaded");
                }
            }
            Err(error) => {
                tracing::warn!(%error, "configuration reload failed; keeping the replicas")
            }
        }
    }
}

/// Tells when a polled file has changed and then held still for a whole poll: a file being
/// written (most editors and `echo >` truncate, then write) can be read half-written, and a half
/// that parses would drop replicas for one interval.
#[derive(Debug)]
struct SettledChanges {
    applied: Option<Vec<u8>>,
    /// A new content seen once, not yet confirmed by the next poll.
    pending: Option<Option<Vec<u8>>>,
}

impl SettledChanges {
    fn new(applied: Option<Vec<u8>>) -> Self {
        SettledChanges {
            applied,
            pending: None,
        }
    }

    /// Feeds one poll's content; true when it is a change that held since the previous poll.
    fn settled(&mut self, current: Option<&[u8]>) -> bool {
        if current == self.applied.as_deref() {
            self.pending = None;
            return false;
        }
        if self.pending.as_ref().map(Option::as_deref) != Some(current) {
            self.pending = Some(current.map(<[u8]>::to_vec));
            return false;
        }
        self.applied = self.pending.take().flatten();
        true
    }
}

#[cfg(test)]
mod tests;
