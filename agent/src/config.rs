//! The agent's settings: flags, `LLMGW_AGENT_…` environment variables, or a YAML file, in that
//! order of precedence (a flag beats the environment, both beat the file).
//!
//! An engine is written `REPLICA=ENDPOINT[,replay=ENDPOINT][,bind][,topic=T][,dp=N]` on the
//! command line, or as a map with the same names in YAML. `REPLICA` is the `host:port` the
//! routers know the replica by; `bind` makes the agent bind the SUB (vLLM then connects to
//! it); `dp=N` expands into N engines, rank r on the endpoint's (and replay's) port + r, as
//! vLLM offsets them. Plain data, validated once at start-up.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use llmgw_core::blockhash::{HashAlgo, HashSettings, SaltEncoding};
use serde::Deserialize;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// Configuration errors, each naming the offending value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("engine {spec:?}: {why}")]
    Engine { spec: String, why: String },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Yaml {
        path: PathBuf,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = ConfigError> = std::result::Result<T, E>;

/// One `--engine` (before data-parallel expansion).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSpec {
    pub replica: String,
    pub endpoint: String,
    #[serde(default)]
    pub replay: Option<String>,
    #[serde(default)]
    pub bind: bool,
    /// Overrides the agent-wide topic.
    #[serde(default)]
    pub topic: Option<String>,
    /// Data-parallel size: ranks 0..dp on consecutive ports.
    #[serde(default = "one")]
    pub dp: u16,
    /// The engine's health URL (default `http://REPLICA/health`).
    #[serde(default)]
    pub health: Option<String>,
}

fn one() -> u16 {
    1
}

impl FromStr for EngineSpec {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self> {
        let err = |why: &str| ConfigError::Engine {
            spec: s.to_owned(),
            why: why.to_owned(),
        };
        let mut parts = s.split(',');
        let head = parts.next().unwrap_or_default();
        let Some((replica, endpoint)) = head.split_once('=') else {
            return Err(err("expected REPLICA=ENDPOINT first"));
        };
        let mut spec = EngineSpec {
            replica: replica.trim().to_owned(),
            endpoint: endpoint.trim().to_owned(),
            replay: None,
            bind: false,
            topic: None,
            dp: 1,
            health: None,
        };
        for opt in parts {
            match opt.trim().split_once('=') {
                None if opt.trim() == "bind" => spec.bind = true,
                Some(("replay", v)) => spec.replay = Some(v.trim().to_owned()),
                Some(("topic", v)) => spec.topic = Some(v.to_owned()),
                Some(("health", v)) => spec.health = Some(v.trim().to_owned()),
                Some(("dp", v)) => {
                    spec.dp = v
                        .trim()
                        .parse()
                        .map_err(|_| err("dp must be a small positive integer"))?;
                }
                _ => return Err(err(&format!("unknown option {opt:?}"))),
            }
        }
        spec.validate().map_err(|why| err(&why))?;
        Ok(spec)
    }
}

/// Splits `tcp://HOST:PORT` into its host part and port.
fn tcp_parts(endpoint: &str) -> Option<(&str, u16)> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    Some((host, port.parse().ok()?))
}

impl EngineSpec {
    fn validate(&self) -> std::result::Result<(), String> {
        if self.replica.is_empty() || !self.replica.contains(':') {
            return Err(format!("replica {:?} is not host:port", self.replica));
        }
        for ep in std::iter::once(&self.endpoint).chain(self.replay.iter()) {
            if tcp_parts(ep).is_none() {
                return Err(format!("endpoint {ep:?} is not tcp://HOST:PORT"));
            }
        }
        if self.dp == 0 {
            return Err("dp must be at least 1".into());
        }
        Ok(())
    }

    /// One engine per data-parallel rank.
    pub fn expand(&self, default_topic: &str) -> Result<Vec<EngineConfig>> {
        self.validate().map_err(|why| ConfigError::Engine {
            spec: self.replica.clone(),
            why,
        })?;
        let offset = |ep: &str, rank: u16| -> Result<String> {
            let (host, port) = tcp_parts(ep).ok_or_else(|| ConfigError::Engine {
                spec: self.replica.clone(),
                why: format!("endpoint {ep:?} is not tcp://HOST:PORT"),
            })?;
            // vLLM leaves port 0 alone (an OS-chosen port per rank).
            let port = if port == 0 {
                0
            } else {
                port.checked_add(rank).ok_or_else(|| ConfigError::Engine {
                    spec: self.replica.clone(),
                    why: format!("port {port} + rank {rank} overflows"),
                })?
            };
            Ok(format!("tcp://{host}:{port}"))
        };
        (0..self.dp)
            .map(|rank| {
                Ok(EngineConfig {
                    name: if rank == 0 {
                        self.replica.clone()
                    } else {
                        format!("{}#dp{rank}", self.replica)
                    },
                    replica: self.replica.clone(),
                    endpoint: offset(&self.endpoint, rank)?,
                    replay: self
                        .replay
                        .as_deref()
                        .map(|r| offset(r, rank))
                        .transpose()?,
                    bind: self.bind,
                    health: self
                        .health
                        .clone()
                        .unwrap_or_else(|| format!("http://{}/health", self.replica)),
                    topic: self
                        .topic
                        .clone()
                        .unwrap_or_else(|| default_topic.to_owned()),
                })
            })
            .collect()
    }
}

/// One engine, after expansion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// The engine's name in logs and metrics.
    pub name: String,
    pub replica: String,
    pub endpoint: String,
    pub replay: Option<String>,
    pub bind: bool,
    pub topic: String,
    /// Checked when the engine has been silent for `stale_after`.
    pub health: String,
}

/// The YAML file: the same settings as the flags, all optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub node: Option<String>,
    #[serde(default)]
    pub engines: Vec<EngineSpec>,
    #[serde(default)]
    pub routers: Vec<String>,
    #[serde(default)]
    pub router_services: Vec<String>,
    pub router_resolve_interval_ms: Option<u64>,
    pub topic: Option<String>,
    pub model: Option<String>,
    pub hash_algo: Option<String>,
    pub hash_seed: Option<String>,
    pub block_size: Option<NonZeroUsize>,
    pub window_ms: Option<u64>,
    pub admin_addr: Option<SocketAddr>,
    pub replay_timeout_ms: Option<u64>,
    pub token_file: Option<PathBuf>,
    pub stale_after_ms: Option<u64>,
    pub max_blocks_per_engine: Option<u64>,
    /// PEM CA that signed the routers' feed certificates: connect over TLS.
    pub router_ca: Option<PathBuf>,
    /// PEM client certificate (chain) presented to routers that require mutual TLS.
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// As `--discover-pods`.
    pub discover_pods: Option<String>,
    pub pod_namespace: Option<String>,
    pub pod_http_port: Option<String>,
    pub pod_kv_events_port: Option<String>,
    pub pod_kv_replay_port: Option<String>,
    pub kubeconfig: Option<PathBuf>,
    pub reload_interval_ms: Option<u64>,
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<FileConfig> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        serde_yaml::from_str(&text).map_err(|source| ConfigError::Yaml {
            path: path.to_owned(),
            source,
        })
    }
}

/// Settings shared by `serve`, `run` and `vllm-args` (flags and environment).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct AgentArgs {
    /// YAML file with any of these settings (flags and environment win).
    #[arg(long, env = "LLMGW_AGENT_CONFIG")]
    pub config: Option<PathBuf>,
    /// This node's name, as the routers know it.
    #[arg(long, env = "LLMGW_AGENT_NODE")]
    pub node: Option<String>,
    /// `REPLICA=ENDPOINT[,replay=ENDPOINT][,bind][,topic=T][,dp=N]`; repeatable (or `;`-separated
    /// in the environment).
    #[arg(long = "engine", env = "LLMGW_AGENT_ENGINE", value_delimiter = ';')]
    pub engines: Vec<EngineSpec>,
    /// A router's feed address HOST:PORT; repeatable.
    #[arg(long = "router", env = "LLMGW_AGENT_ROUTER", value_delimiter = ',')]
    pub routers: Vec<String>,
    /// HOST:PORT of a DNS name with one address per router (a Kubernetes headless Service):
    /// the agent streams to every address it resolves to, following the answer as routers
    /// come and go; repeatable.
    #[arg(
        long = "router-service",
        env = "LLMGW_AGENT_ROUTER_SERVICE",
        value_delimiter = ','
    )]
    pub router_services: Vec<String>,
    /// How often (ms) each --router-service is resolved again (default 10000).
    #[arg(long, env = "LLMGW_AGENT_ROUTER_RESOLVE_INTERVAL_MS")]
    pub router_resolve_interval_ms: Option<u64>,
    /// ZMQ topic prefix of the engines' events (default: all).
    #[arg(long, env = "LLMGW_AGENT_TOPIC")]
    pub topic: Option<String>,
    /// The served model name, reported to the routers.
    #[arg(long, env = "LLMGW_AGENT_MODEL")]
    pub model: Option<String>,
    /// vLLM's --prefix-caching-hash-algo: sha256_cbor or xxhash_cbor.
    #[arg(long, env = "LLMGW_AGENT_HASH_ALGO")]
    pub hash_algo: Option<String>,
    /// The engines' PYTHONHASHSEED.
    #[arg(long, env = "LLMGW_AGENT_HASH_SEED")]
    pub hash_seed: Option<String>,
    /// The engines' block size; enables the block-0 hash check.
    #[arg(long, env = "LLMGW_AGENT_BLOCK_SIZE")]
    pub block_size: Option<NonZeroUsize>,
    /// Coalescing window in milliseconds (default 20).
    #[arg(long, env = "LLMGW_AGENT_WINDOW_MS")]
    pub window_ms: Option<u64>,
    /// Admin HTTP address for /metrics and /debug (default 127.0.0.1:9101).
    #[arg(long, env = "LLMGW_AGENT_ADMIN_ADDR")]
    pub admin_addr: Option<SocketAddr>,
    /// How long a replay may take before the engine is reset instead (default 3000).
    #[arg(long, env = "LLMGW_AGENT_REPLAY_TIMEOUT_MS")]
    pub replay_timeout_ms: Option<u64>,
    /// File holding the shared token the routers check.
    #[arg(long, env = "LLMGW_AGENT_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Silence (ms) after which an engine's /health is checked; a refused or failing check
    /// resets it, as do three checks in a row left unanswered (a busy engine answers late).
    /// 0 disables (default 10000).
    #[arg(long, env = "LLMGW_AGENT_STALE_AFTER_MS")]
    pub stale_after_ms: Option<u64>,
    /// Most block copies (all tiers) one engine's mirror holds; an engine reporting more is
    /// reset. Keep it at the routers' --feed-max-blocks-per-engine (default 4000000).
    #[arg(long, env = "LLMGW_AGENT_MAX_BLOCKS_PER_ENGINE")]
    pub max_blocks_per_engine: Option<u64>,
    /// The shared token itself (prefer --token-file).
    #[arg(long, env = "LLMGW_AGENT_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// PEM CA that signed the routers' feed certificates: connect to routers over TLS.
    #[arg(long, env = "LLMGW_AGENT_ROUTER_CA")]
    pub router_ca: Option<PathBuf>,
    /// PEM client certificate for routers that require mutual TLS (needs --tls-key, --router-ca).
    #[arg(long, env = "LLMGW_AGENT_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "LLMGW_AGENT_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Find the engines among the pods on this node (--node: the node's name) that match this
    /// label selector (e.g. app.kubernetes.io/name=vllm), and follow them as they come and go.
    /// Needs RBAC to list and watch pods; instead of --engine and the file's `engines`.
    #[arg(long, env = "LLMGW_AGENT_DISCOVER_PODS")]
    pub discover_pods: Option<String>,
    /// The namespace of --discover-pods' pods (default: the client's, in a pod its own).
    #[arg(long, env = "LLMGW_AGENT_POD_NAMESPACE")]
    pub pod_namespace: Option<String>,
    /// vLLM's HTTP port in each discovered pod: a container port's name or a number (default
    /// http). The replica is POD_IP:PORT, as the routers know it.
    #[arg(long, env = "LLMGW_AGENT_POD_HTTP_PORT")]
    pub pod_http_port: Option<String>,
    /// The KV-event PUB port in each discovered pod, a name or a number (default kv-events).
    #[arg(long, env = "LLMGW_AGENT_POD_KV_EVENTS_PORT")]
    pub pod_kv_events_port: Option<String>,
    /// The KV-event replay port, a name or a number (default kv-replay; a pod without a port of
    /// that name is mirrored without replay).
    #[arg(long, env = "LLMGW_AGENT_POD_KV_REPLAY_PORT")]
    pub pod_kv_replay_port: Option<String>,
    /// The Kubernetes client's configuration file for --discover-pods (default: in-cluster,
    /// else $KUBECONFIG or ~/.kube/config).
    #[arg(long, env = "LLMGW_AGENT_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// How often (ms) the --config file is read again, its changed `engines` applied without a
    /// restart (default 5000; 0: never). Other settings apply at the next start.
    #[arg(long, env = "LLMGW_AGENT_RELOAD_INTERVAL_MS")]
    pub reload_interval_ms: Option<u64>,
}

/// Where a discovered pod's ports are: a container port's name, or a number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodPort {
    Named(String),
    Number(u16),
}

impl PodPort {
    fn parse(text: &str, flag: &str) -> Result<PodPort> {
        let text = text.trim();
        if let Ok(n) = text.parse::<u16>() {
            return match n {
                0 => Err(ConfigError::Invalid(format!("{flag}: port 0"))),
                n => Ok(PodPort::Number(n)),
            };
        }
        // A container port name: an IANA_SVC_NAME (at most 15 lowercase alphanumerics or '-').
        let valid = !text.is_empty()
            && text.len() <= 15
            && text
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !valid {
            return Err(ConfigError::Invalid(format!(
                "{flag} {text:?}: neither a port number nor a container port name"
            )));
        }
        Ok(PodPort::Named(text.to_owned()))
    }
}

/// `--discover-pods`: which pods are this node's engines, and where their ports are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodDiscovery {
    /// The label selector, in the API's query syntax.
    pub selector: String,
    /// `None`: the client's default namespace.
    pub namespace: Option<String>,
    /// The node whose pods count (the agent's `--node`).
    pub node: String,
    pub http_port: PodPort,
    pub kv_events_port: PodPort,
    pub kv_replay_port: PodPort,
    pub kubeconfig: Option<PathBuf>,
}

/// Reading the `--config` file again for changed engines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileReload {
    pub path: PathBuf,
    pub interval: Duration,
}

/// Everything resolved and validated.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub node: String,
    pub engines: Vec<EngineConfig>,
    pub routers: Vec<String>,
    /// DNS names (HOST:PORT) resolving to every router, followed by [`crate::routers`].
    pub router_services: Vec<String>,
    pub router_resolve_interval: Duration,
    pub model: Option<String>,
    pub algo: HashAlgo,
    pub seed: Option<String>,
    pub block_size: Option<NonZeroUsize>,
    pub window: Duration,
    pub admin_addr: SocketAddr,
    pub replay_timeout: Duration,
    /// The shared token presented to routers.
    pub token: Option<String>,
    /// Where `token` came from: read again before each connection, so a rotated Secret is
    /// picked up without a restart.
    pub token_file: Option<PathBuf>,
    /// Silence before a health check; `None` disables staleness.
    pub stale_after: Option<Duration>,
    /// Most block copies one engine's mirror holds.
    pub max_blocks_per_engine: u64,
    /// TLS towards the routers (`None`: plain text), checked at start-up.
    pub tls: Option<ClientTlsConfig>,
    /// The files `tls` was built from: read again before each connection (rotated
    /// certificates), falling back to `tls` while they do not load.
    pub tls_files: Option<TlsFiles>,
    /// The engine-wide topic, for engines found later (reload, pods).
    pub topic: String,
    /// Engines from the pods on this node (then `engines` starts empty).
    pub pods: Option<PodDiscovery>,
    /// Engines from the `--config` file, read again while the agent runs.
    pub reload: Option<FileReload>,
}

/// The PEM files of the uplinks' TLS settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub router_ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl TlsFiles {
    /// Builds and checks the TLS settings (`None`: no CA, so plain text).
    pub fn load(&self) -> Result<Option<ClientTlsConfig>> {
        resolve_tls(self.router_ca.clone(), self.cert.clone(), self.key.clone())
    }
}

/// Splits `HOST:PORT` (or `[V6]:PORT`) into the host and the port.
pub fn split_host_port(target: &str) -> Result<(&str, u16)> {
    let bad = |why: &str| ConfigError::Invalid(format!("router service {target:?}: {why}"));
    let (host, port) = target
        .rsplit_once(':')
        .ok_or_else(|| bad("expected HOST:PORT"))?;
    let port = port.parse().map_err(|_| bad("the port is not a number"))?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return Err(bad("no host name"));
    }
    Ok((host, port))
}

pub const DEFAULT_ADMIN_ADDR: &str = "127.0.0.1:9101";

impl AgentArgs {
    /// Merges flags/environment over the YAML file (if any) and validates.
    pub fn resolve(&self) -> Result<AgentConfig> {
        let file = match &self.config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        let topic = self
            .topic
            .clone()
            .or(file.topic.clone())
            .unwrap_or_default();
        let engines = self.engines_with(&file, &topic)?;
        let discover_pods = self.discover_pods.clone().or(file.discover_pods.clone());
        if discover_pods.is_some() && !engines.is_empty() {
            return Err(ConfigError::Invalid(
                "--discover-pods finds the engines itself: drop --engine and the file's engines"
                    .into(),
            ));
        }
        let node = self
            .node
            .clone()
            .or(file.node.clone())
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_else(|| "node".to_owned());
        let pods = match discover_pods {
            None => None,
            Some(selector) => Some(self.pod_discovery(selector, &file, &node)?),
        };
        let reload_interval = self
            .reload_interval_ms
            .or(file.reload_interval_ms)
            .unwrap_or(5000);
        // The file's engines are reloaded only where they count: no --engine, no discovery.
        let reload = match &self.config {
            Some(path) if self.engines.is_empty() && pods.is_none() => {
                (reload_interval > 0).then(|| FileReload {
                    path: path.clone(),
                    interval: Duration::from_millis(reload_interval),
                })
            }
            _ => None,
        };
        let algo_text = self
            .hash_algo
            .clone()
            .or(file.hash_algo)
            .unwrap_or_else(|| HashAlgo::Sha256Cbor.as_str().to_owned());
        let algo = algo_text
            .parse::<HashAlgo>()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let admin_addr = match self.admin_addr.or(file.admin_addr) {
            Some(a) => a,
            None => DEFAULT_ADMIN_ADDR
                .parse()
                .map_err(|_| ConfigError::Invalid("bad default admin address".into()))?,
        };
        let (token, token_file) = match (&self.token, self.token_file.clone().or(file.token_file)) {
            (Some(t), _) => (Some(t.clone()), None),
            (None, Some(path)) => (Some(read_token(&path)?), Some(path)),
            (None, None) => (None, None),
        };
        let router_services = if self.router_services.is_empty() {
            file.router_services
        } else {
            self.router_services.clone()
        };
        for s in &router_services {
            split_host_port(s)?;
        }
        let router_resolve_interval = match self
            .router_resolve_interval_ms
            .or(file.router_resolve_interval_ms)
            .unwrap_or(10_000)
        {
            0 => {
                return Err(ConfigError::Invalid(
                    "--router-resolve-interval-ms must be above 0".into(),
                ));
            }
            ms => Duration::from_millis(ms),
        };
        let stale_after = match self
            .stale_after_ms
            .or(file.stale_after_ms)
            .unwrap_or(10_000)
        {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        };
        let max_blocks_per_engine = self
            .max_blocks_per_engine
            .or(file.max_blocks_per_engine)
            .unwrap_or(crate::mirror::MAX_COPIES);
        if max_blocks_per_engine == 0 {
            return Err(ConfigError::Invalid(
                "--max-blocks-per-engine must be above 0".into(),
            ));
        }
        let tls_files = TlsFiles {
            router_ca: self.router_ca.clone().or(file.router_ca),
            cert: self.tls_cert.clone().or(file.tls_cert),
            key: self.tls_key.clone().or(file.tls_key),
        };
        let tls = tls_files.load()?;
        Ok(AgentConfig {
            topic,
            pods,
            reload,
            tls_files: tls.is_some().then_some(tls_files),
            tls,
            stale_after,
            max_blocks_per_engine,
            token,
            token_file,
            router_services,
            router_resolve_interval,
            node,
            engines,
            routers: if self.routers.is_empty() {
                file.routers
            } else {
                self.routers.clone()
            },
            model: self.model.clone().or(file.model),
            algo,
            seed: self.hash_seed.clone().or(file.hash_seed),
            block_size: self.block_size.or(file.block_size),
            window: Duration::from_millis(self.window_ms.or(file.window_ms).unwrap_or(20)),
            admin_addr,
            replay_timeout: Duration::from_millis(
                self.replay_timeout_ms
                    .or(file.replay_timeout_ms)
                    .unwrap_or(3000),
            ),
        })
    }
}

impl AgentArgs {
    /// The engines of the flags, else of `file`, expanded; each name once.
    fn engines_with(&self, file: &FileConfig, topic: &str) -> Result<Vec<EngineConfig>> {
        let specs = if self.engines.is_empty() {
            &file.engines
        } else {
            &self.engines
        };
        let mut engines = Vec::new();
        for spec in specs {
            engines.extend(spec.expand(topic)?);
        }
        let mut names = std::collections::HashSet::new();
        for e in &engines {
            if !names.insert(e.name.as_str()) {
                return Err(ConfigError::Invalid(format!(
                    "engine {} is configured twice",
                    e.name
                )));
            }
        }
        Ok(engines)
    }

    /// The engines `path` lists now, as `resolve` would take them (for a reload).
    pub fn engines_in_file(&self, path: &Path, text: &str) -> Result<Vec<EngineConfig>> {
        let file: FileConfig = serde_yaml::from_str(text).map_err(|source| ConfigError::Yaml {
            path: path.to_owned(),
            source,
        })?;
        let topic = self
            .topic
            .clone()
            .or(file.topic.clone())
            .unwrap_or_default();
        self.engines_with(&file, &topic)
    }

    fn pod_discovery(
        &self,
        selector: String,
        file: &FileConfig,
        node: &str,
    ) -> Result<PodDiscovery> {
        let selector = selector.trim().to_owned();
        if selector.is_empty() {
            return Err(ConfigError::Invalid(
                "--discover-pods needs a label selector (an empty one selects every pod)".into(),
            ));
        }
        if self.node.is_none() && file.node.is_none() {
            return Err(ConfigError::Invalid(
                "--discover-pods needs --node: the name of the node whose pods are mirrored".into(),
            ));
        }
        let port = |flag: &Option<String>, key: &Option<String>, name: &str, default: &str| {
            let text = flag
                .clone()
                .or(key.clone())
                .unwrap_or_else(|| default.to_owned());
            PodPort::parse(&text, name)
        };
        Ok(PodDiscovery {
            selector,
            namespace: self.pod_namespace.clone().or(file.pod_namespace.clone()),
            node: node.to_owned(),
            http_port: port(
                &self.pod_http_port,
                &file.pod_http_port,
                "--pod-http-port",
                "http",
            )?,
            kv_events_port: port(
                &self.pod_kv_events_port,
                &file.pod_kv_events_port,
                "--pod-kv-events-port",
                "kv-events",
            )?,
            kv_replay_port: port(
                &self.pod_kv_replay_port,
                &file.pod_kv_replay_port,
                "--pod-kv-replay-port",
                "kv-replay",
            )?,
            kubeconfig: self.kubeconfig.clone().or(file.kubeconfig.clone()),
        })
    }
}

/// The shared token in `path` (surrounding whitespace dropped).
pub fn read_token(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    let token = text.trim();
    if token.is_empty() {
        return Err(ConfigError::Invalid(format!(
            "{}: the token file is empty",
            path.display()
        )));
    }
    Ok(token.to_owned())
}

fn read_pem(path: PathBuf) -> Result<Vec<u8>> {
    std::fs::read(&path).map_err(|source| ConfigError::Read { path, source })
}

/// A PEM file holding at least one certificate.
fn pem_certs(path: PathBuf) -> Result<Vec<u8>> {
    let shown = path.display().to_string();
    let pem = read_pem(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| ConfigError::Invalid(format!("{shown}: {e}")))?;
    if certs.is_empty() {
        return Err(ConfigError::Invalid(format!(
            "{shown}: no PEM certificate (TLS to routers)"
        )));
    }
    Ok(pem)
}

/// The uplinks' TLS settings from the CA, certificate and key files, validated here (a bad
/// file fails start-up, not every connection attempt).
fn resolve_tls(
    router_ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> Result<Option<ClientTlsConfig>> {
    let identity = match (cert, key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        (Some(_), None) => return Err(ConfigError::Invalid("--tls-cert needs --tls-key".into())),
        (None, Some(_)) => return Err(ConfigError::Invalid("--tls-key needs --tls-cert".into())),
    };
    let Some(ca) = router_ca else {
        return match identity {
            None => Ok(None),
            Some(_) => Err(ConfigError::Invalid(
                "a client certificate needs --router-ca (the CA of the routers' feed certificate)"
                    .into(),
            )),
        };
    };
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem_certs(ca)?));
    if let Some((cert, key)) = identity {
        let key_path = key.display().to_string();
        let key = read_pem(key)?;
        PrivateKeyDer::from_pem_slice(&key).map_err(|e| {
            ConfigError::Invalid(format!("{key_path}: not a PEM private key ({e})"))
        })?;
        tls = tls.identity(Identity::from_pem(pem_certs(cert)?, key));
    }
    // Building a connector checks that the certificate and key go together.
    tonic::transport::Endpoint::from_static("https://localhost")
        .tls_config(tls.clone())
        .map_err(|e| ConfigError::Invalid(format!("TLS to routers: {e}")))?;
    Ok(Some(tls))
}

impl AgentConfig {
    /// The hash settings the engines must run with, when the block size is known.
    pub fn hash_settings(&self) -> Option<HashSettings> {
        self.block_size.map(|block_size| HashSettings {
            algo: self.algo,
            seed: self.seed.clone(),
            block_size,
            salt_encoding: SaltEncoding::Tagged,
        })
    }
}

/// How vLLM must be started to publish to this agent: environment and arguments.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct VllmArgs {
    pub env: Vec<(String, String)>,
    pub args: Vec<String>,
}

/// vLLM's flags for one engine (rank 0 of a spec: vLLM offsets the other ranks itself).
pub fn vllm_args(config: &AgentConfig, engine: &EngineConfig) -> VllmArgs {
    // The agent binds → vLLM connects to that address; the agent connects → vLLM binds `*`.
    let endpoint = if engine.bind {
        engine.endpoint.clone()
    } else {
        star(&engine.endpoint)
    };
    let mut events = serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": engine.topic,
    });
    if let Some(replay) = &engine.replay {
        events["replay_endpoint"] = serde_json::Value::String(star(replay));
    }
    let mut env = Vec::new();
    if let Some(seed) = &config.seed {
        env.push(("PYTHONHASHSEED".to_owned(), seed.clone()));
    }
    let mut args = vec![
        "--enable-prefix-caching".to_owned(),
        "--prefix-caching-hash-algo".to_owned(),
        config.algo.as_str().to_owned(),
        "--kv-events-config".to_owned(),
        events.to_string(),
    ];
    if let Some(bs) = config.block_size {
        args.extend(["--block-size".to_owned(), bs.to_string()]);
    }
    VllmArgs { env, args }
}

/// `tcp://HOST:PORT` → `tcp://*:PORT` (what a binding vLLM socket needs).
fn star(endpoint: &str) -> String {
    match tcp_parts(endpoint) {
        Some((_, port)) => format!("tcp://*:{port}"),
        None => endpoint.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_specs_parse_and_reject_with_the_reason() {
        let e: EngineSpec = "10.0.0.5:8000=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5600,bind"
            .parse()
            .expect("parses");
        assert_eq!(e.replica, "10.0.0.5:8000");
        assert_eq!(e.replay.as_deref(), Some("tcp://127.0.0.1:5600"));
        assert!(e.bind && e.dp == 1);
        for (bad, why) in [
            ("tcp://x:1", "REPLICA=ENDPOINT"),
            ("r:1=ipc:///tmp/x", "not tcp://"),
            ("r:1=tcp://h:1,colour=red", "unknown option"),
            ("r:1=tcp://h:1,dp=0", "at least 1"),
            ("noport=tcp://h:1", "host:port"),
        ] {
            let err = bad.parse::<EngineSpec>().expect_err(bad).to_string();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn data_parallel_ranks_are_separate_engines_on_offset_ports() {
        let e: EngineSpec = "h:8000=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5600,dp=3,topic=t"
            .parse()
            .expect("parses");
        let engines = e.expand("default").expect("expands");
        let eps: Vec<(&str, &str, Option<&str>)> = engines
            .iter()
            .map(|e| (e.name.as_str(), e.endpoint.as_str(), e.replay.as_deref()))
            .collect();
        assert_eq!(
            eps,
            [
                ("h:8000", "tcp://10.0.0.5:5557", Some("tcp://10.0.0.5:5600")),
                (
                    "h:8000#dp1",
                    "tcp://10.0.0.5:5558",
                    Some("tcp://10.0.0.5:5601")
                ),
                (
                    "h:8000#dp2",
                    "tcp://10.0.0.5:5559",
                    Some("tcp://10.0.0.5:5602")
                ),
            ]
        );
        assert!(
            engines
                .iter()
                .all(|e| e.topic == "t" && e.replica == "h:8000")
        );
    }

    #[test]
    fn flags_win_over_the_yaml_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agent.yaml");
        std::fs::write(
            &path,
            "node: from-file\nhash_seed: '7'\nblock_size: 16\nwindow_ms: 50\n\
             engines:\n  - {replica: 'a:1', endpoint: 'tcp://127.0.0.1:5557', bind: true}\n",
        )
        .expect("write");
        let args = AgentArgs {
            config: Some(path.clone()),
            node: Some("from-flag".into()),
            ..AgentArgs::default()
        };
        let c = args.resolve().expect("resolves");
        assert_eq!(c.node, "from-flag");
        assert_eq!(c.seed.as_deref(), Some("7"));
        assert_eq!(c.window, Duration::from_millis(50));
        assert_eq!(c.engines.len(), 1);
        assert!(c.engines[0].bind);
        let settings = c.hash_settings().expect("block size known");
        assert_eq!(settings.block_size.get(), 16);

        std::fs::write(&path, "nodes: typo\n").expect("write");
        let err = args.resolve().expect_err("unknown key").to_string();
        assert!(err.contains("nodes"), "{err}");
    }

    #[test]
    fn the_mirror_ceiling_comes_from_the_flag_or_the_file_and_is_above_zero() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agent.yaml");
        let engines = "engines:\n  - {replica: 'a:1', endpoint: 'tcp://127.0.0.1:5557'}\n";
        let resolve = |file: &str, flag: Option<u64>| {
            std::fs::write(&path, format!("node: n\n{file}{engines}")).expect("write");
            AgentArgs {
                config: Some(path.clone()),
                max_blocks_per_engine: flag,
                ..AgentArgs::default()
            }
            .resolve()
        };
        let ceiling =
            |file: &str, flag| resolve(file, flag).expect("resolves").max_blocks_per_engine;
        assert_eq!(ceiling("", None), crate::mirror::MAX_COPIES);
        assert_eq!(ceiling("max_blocks_per_engine: 9000000\n", None), 9_000_000);
        assert_eq!(ceiling("max_blocks_per_engine: 9000000\n", Some(5)), 5);
        let err = resolve("", Some(0)).expect_err("zero").to_string();
        assert!(err.contains("--max-blocks-per-engine"), "{err}");
    }

    #[test]
    fn router_services_need_a_host_and_port_and_come_from_flags_or_the_file() {
        assert_eq!(
            split_host_port("llmgw-router-feed.llmgw.svc:9004").expect("ok"),
            ("llmgw-router-feed.llmgw.svc", 9004)
        );
        assert_eq!(split_host_port("[::1]:9004").expect("ok"), ("::1", 9004));
        for (bad, why) in [
            ("llmgw-router-feed", "HOST:PORT"),
            ("host:http", "port"),
            (":9004", "no host"),
        ] {
            let err = split_host_port(bad).expect_err(bad).to_string();
            assert!(err.contains(why) && err.contains(bad), "{err}");
        }

        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agent.yaml");
        std::fs::write(
            &path,
            "router_services: ['routers.example:9004']\nrouter_resolve_interval_ms: 2500\n",
        )
        .expect("write");
        let args = AgentArgs {
            config: Some(path),
            ..AgentArgs::default()
        };
        let c = args.resolve().expect("resolves");
        assert_eq!(c.router_services, ["routers.example:9004"]);
        assert_eq!(c.router_resolve_interval, Duration::from_millis(2500));
        let flags = AgentArgs {
            router_services: vec!["other.example:1".into()],
            ..args.clone()
        };
        assert_eq!(
            flags.resolve().expect("resolves").router_services,
            ["other.example:1"]
        );
        let no_port = AgentArgs {
            router_services: vec!["routers.example".into()],
            ..AgentArgs::default()
        };
        assert!(no_port.resolve().is_err());
        let zero = AgentArgs {
            router_resolve_interval_ms: Some(0),
            ..AgentArgs::default()
        };
        assert!(zero.resolve().is_err());
        assert_eq!(
            AgentArgs::default()
                .resolve()
                .expect("ok")
                .router_resolve_interval,
            Duration::from_secs(10)
        );
    }

    #[test]
    fn a_token_file_is_remembered_and_must_not_be_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("token");
        std::fs::write(&path, "  s3cret\n").expect("write");
        let args = AgentArgs {
            token_file: Some(path.clone()),
            ..AgentArgs::default()
        };
        let c = args.resolve().expect("resolves");
        assert_eq!(c.token.as_deref(), Some("s3cret"));
        assert_eq!(c.token_file.as_deref(), Some(path.as_path()));
        std::fs::write(&path, "\n").expect("write");
        let err = args.resolve().expect_err("empty").to_string();
        assert!(err.contains("empty"), "{err}");
        // A token given directly has no file to re-read.
        let direct = AgentArgs {
            token: Some("t".into()),
            ..args
        };
        assert_eq!(direct.resolve().expect("ok").token_file, None);
    }

    #[test]
    fn tls_to_routers_needs_a_ca_and_complete_readable_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).expect("write");
            p
        };
        let not_pem = file("junk.pem", "not a certificate\n");
        let resolve = |ca: Option<&PathBuf>, cert: Option<&PathBuf>, key: Option<&PathBuf>| {
            AgentArgs {
                router_ca: ca.cloned(),
                tls_cert: cert.cloned(),
                tls_key: key.cloned(),
                ..AgentArgs::default()
            }
            .resolve()
        };
        assert!(resolve(None, None, None).expect("plain").tls.is_none());
        let cert_only = resolve(None, Some(&not_pem), Some(&not_pem)).expect_err("no CA");
        assert!(cert_only.to_string().contains("--router-ca"), "{cert_only}");
        let half = resolve(Some(&not_pem), Some(&not_pem), None).expect_err("no key");
        assert!(half.to_string().contains("--tls-key"), "{half}");
        let missing = dir.path().join("absent.pem");
        let unread = resolve(Some(&missing), None, None).expect_err("missing file");
        assert!(unread.to_string().contains("absent.pem"), "{unread}");
        let junk = resolve(Some(&not_pem), None, None).expect_err("not PEM");
        assert!(junk.to_string().contains("no PEM certificate"), "{junk}");
    }

    #[test]
    fn vllm_args_point_the_engine_at_the_agent() {
        let spec: EngineSpec = "h:8000=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5600,bind"
            .parse()
            .expect("parses");
        let args = AgentArgs {
            engines: vec![spec],
            hash_seed: Some("1729".into()),
            block_size: NonZeroUsize::new(32),
            topic: Some("kv".into()),
            ..AgentArgs::default()
        };
        let c = args.resolve().expect("resolves");
        let v = vllm_args(&c, &c.engines[0]);
        assert_eq!(v.env, [("PYTHONHASHSEED".to_owned(), "1729".to_owned())]);
        let i = v
            .args
            .iter()
            .position(|a| a == "--kv-events-config")
            .expect("flag");
        let cfg: serde_json::Value = serde_json::from_str(&v.args[i + 1]).expect("json");
        assert_eq!(cfg["endpoint"], "tcp://127.0.0.1:5557", "vLLM connects");
        assert_eq!(
            cfg["replay_endpoint"], "tcp://*:5600",
            "replay always binds"
        );
        assert_eq!(cfg["topic"], "kv");
        assert!(
            v.args
                .windows(2)
                .any(|w| w == ["--prefix-caching-hash-algo", "sha256_cbor"])
        );
    }
}
