//! The feed's options: where agents connect, what they must present, how much one may claim.
//! Flags (and `LLMGW_*` variables) have the same names as the configuration file's keys; a flag
//! wins over the file, the file over the defaults here.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

use super::FeedLimits;
use super::state::DEFAULT_MAX_BLOCKS_PER_ENGINE;
use crate::tls::TlsPaths;

/// Six of the agents' default heartbeat intervals.
pub const DEFAULT_SILENCE: Duration = Duration::from_secs(30);

#[derive(Debug, Error)]
pub enum FeedOptionsError {
    #[error("cannot read the feed token file {path}: {source}")]
    TokenFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("feed TLS: {0}")]
    Tls(&'static str),
}

#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
#[serde(default)]
pub struct FeedOptions {
    /// Where agents stream KV-cache changes (llmgw.feed.v1; default 127.0.0.1:9003).
    #[arg(long, env = "LLMGW_FEED_ADDR")]
    pub feed_addr: Option<SocketAddr>,
    /// A file holding the token agents must present (see also LLMGW_FEED_TOKEN).
    #[arg(long, env = "LLMGW_FEED_TOKEN_FILE")]
    pub feed_token_file: Option<PathBuf>,
    /// The token agents must present; without one (or a file) any agent is accepted.
    // Not a file key: a secret belongs in a file of its own (feed_token_file).
    #[arg(long, env = "LLMGW_FEED_TOKEN", hide_env_values = true)]
    #[serde(skip)]
    pub feed_token: Option<String>,
    /// How long a node's blocks stay in the index after its agent's stream ended (default 30s).
    #[arg(long, env = "LLMGW_FEED_GRACE", value_parser = crate::duration::parse)]
    #[serde(deserialize_with = "crate::duration::optional")]
    pub feed_grace: Option<Duration>,
    /// How long an agent's stream may send nothing, not even its heartbeat (every 5s by
    /// default), before the router ends it and the node's grace period starts: an agent whose
    /// host vanished without closing the connection (default 30s; 0s: never).
    #[arg(long, env = "LLMGW_FEED_SILENCE", value_parser = crate::duration::parse)]
    #[serde(deserialize_with = "crate::duration::optional")]
    pub feed_silence: Option<Duration>,
    /// At start, how long the router waits for the agents of every node its replicas run on to
    /// send their blocks before it reports ready anyway (default 30s; 0s: do not wait). Until
    /// then gRPC readiness is not serving, so a new router takes no traffic with an empty index.
    #[arg(long, env = "LLMGW_FEED_SYNC_TIMEOUT", value_parser = crate::duration::parse)]
    #[serde(deserialize_with = "crate::duration::optional")]
    pub feed_sync_timeout: Option<Duration>,
    /// Most block copies one engine may report over the feed (all tiers); an engine reporting
    /// more is refused, its blocks dropped (default 4000000, at most 4294967295). The agent's
    /// own ceiling, `llmgw-agent --max-blocks-per-engine` (same default), must be raised with
    /// it: past it the agent resets the engine's mirror.
    #[arg(long, env = "LLMGW_FEED_MAX_BLOCKS_PER_ENGINE")]
    pub feed_max_blocks_per_engine: Option<u64>,
    /// PEM certificate (chain) of the feed port: serve the feed over TLS (needs --feed-tls-key).
    #[arg(long, env = "LLMGW_FEED_TLS_CERT")]
    pub feed_tls_cert: Option<PathBuf>,
    /// PEM private key of --feed-tls-cert.
    #[arg(long, env = "LLMGW_FEED_TLS_KEY")]
    pub feed_tls_key: Option<PathBuf>,
    /// PEM CA bundle: require every agent to present a client certificate it signed (mTLS).
    #[arg(long, env = "LLMGW_FEED_TLS_CLIENT_CA")]
    pub feed_tls_client_ca: Option<PathBuf>,
    /// With --feed-tls-client-ca: accept an agent whose certificate does not name (DNS SAN or
    /// CN) the node it claims. By default such a stream is refused.
    #[arg(long, env = "LLMGW_FEED_TLS_SKIP_NODE_CHECK")]
    pub feed_tls_skip_node_check: bool,
}

/// The feed's resolved settings.
#[derive(Debug, Clone)]
pub struct FeedSettings {
    pub addr: SocketAddr,
    /// The shared token of agents; `None` accepts any.
    pub token: Option<String>,
    /// Where `token` was read from: read again for each agent stream (rotation).
    pub token_file: Option<PathBuf>,
    /// How long a node's state survives after its last stream ended.
    pub grace: Duration,
    /// How long readiness waits at start for every node's agent to send its blocks.
    pub sync_timeout: Duration,
    /// How long a stream may be silent before the router ends it (zero: never).
    pub silence: Duration,
    /// Bounds on what one agent stream may claim.
    pub limits: FeedLimits,
    /// TLS on the feed port (`None`: plain text).
    pub tls: Option<TlsPaths>,
}

impl FeedOptions {
    /// These options (the flags) over `file`'s, over the defaults. Reads the token file.
    pub fn resolve(&self, file: &FeedOptions) -> Result<FeedSettings, FeedOptionsError> {
        let (token, token_file) = match (
            &self.feed_token,
            self.feed_token_file
                .as_ref()
                .or(file.feed_token_file.as_ref()),
        ) {
            (Some(token), _) => (Some(token.trim().to_owned()), None),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path).map_err(|source| {
                    FeedOptionsError::TokenFile {
                        path: path.clone(),
                        source,
                    }
                })?;
                (Some(text.trim().to_owned()), Some(path.clone()))
            }
            (None, None) => (None, None),
        };
        Ok(FeedSettings {
            addr: (self.feed_addr)
                .or(file.feed_addr)
                .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 9003))),
            token,
            token_file,
            grace: (self.feed_grace)
                .or(file.feed_grace)
                .unwrap_or(Duration::from_secs(30)),
            sync_timeout: (self.feed_sync_timeout)
                .or(file.feed_sync_timeout)
                .unwrap_or(Duration::from_secs(30)),
            silence: (self.feed_silence)
                .or(file.feed_silence)
                .unwrap_or(DEFAULT_SILENCE),
            limits: FeedLimits {
                max_blocks_per_engine: (self.feed_max_blocks_per_engine)
                    .or(file.feed_max_blocks_per_engine)
                    .unwrap_or(DEFAULT_MAX_BLOCKS_PER_ENGINE)
                    .min(u64::from(u32::MAX)),
                ..FeedLimits::default()
            },
            tls: self.tls(file)?,
        })
    }

    /// The certificate, key and client CA: each flag over the file's key.
    fn tls(&self, file: &FeedOptions) -> Result<Option<TlsPaths>, FeedOptionsError> {
        let pick = |flag: &Option<PathBuf>, key: &Option<PathBuf>| flag.clone().or(key.clone());
        let cert = pick(&self.feed_tls_cert, &file.feed_tls_cert);
        let key = pick(&self.feed_tls_key, &file.feed_tls_key);
        let client_ca = pick(&self.feed_tls_client_ca, &file.feed_tls_client_ca);
        match (cert, key) {
            (Some(cert), Some(key)) => Ok(Some(TlsPaths {
                check_node: !(self.feed_tls_skip_node_check || file.feed_tls_skip_node_check),
                cert,
                key,
                client_ca,
            })),
            (Some(_), None) => Err(FeedOptionsError::Tls(
                "a certificate needs its key (--feed-tls-key)",
            )),
            (None, Some(_)) => Err(FeedOptionsError::Tls(
                "a key needs its certificate (--feed-tls-cert)",
            )),
            (None, None) if client_ca.is_some() => Err(FeedOptionsError::Tls(
                "a client CA needs the feed's own certificate and key (--feed-tls-cert, \
                 --feed-tls-key)",
            )),
            (None, None) => Ok(None),
        }
    }
}
