//! Peering's options: the other routers behind the same proxy. The flag (and `LLMGW_PEERS`)
//! wins over the file's `peers:` list.

use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;
use tonic::transport::Endpoint;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PeerOptionsError {
    #[error("peer {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error(
        "peering runs over the feed port, and a router cannot yet subscribe to a peer's feed port \
         over TLS: remove --peer or the feed's TLS"
    )]
    FeedTls,
    #[error("--peer-resolve-interval must be above 0")]
    ResolveInterval,
}

#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
#[serde(default)]
pub struct PeerOptions {
    /// Another router behind the same proxy, as http://HOST:FEED_PORT (repeatable, or
    /// comma-separated): this router subscribes to its picks and requests in flight, and serves
    /// its own on its feed port, so the routers decide as one would. List every router; a
    /// router that finds itself in the list skips that entry.
    #[arg(long = "peer", env = "LLMGW_PEERS", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// HOST:FEED_PORT of a headless Service naming every router (Kubernetes): this router
    /// subscribes to every address the name resolves to, follows the answer every
    /// --peer-resolve-interval, and skips its own address. With --peer, both are followed.
    #[arg(long, env = "LLMGW_PEER_SERVICE")]
    pub peer_service: Option<String>,
    /// How often --peer-service is resolved again (default 10s).
    #[arg(long, env = "LLMGW_PEER_RESOLVE_INTERVAL", value_parser = crate::duration::parse)]
    #[serde(deserialize_with = "crate::duration::optional")]
    pub peer_resolve_interval: Option<Duration>,
}

/// One peer router.
#[derive(Debug, Clone)]
pub struct Peer {
    /// As given: the label of its metrics and log lines.
    pub url: String,
    pub endpoint: Endpoint,
}

/// A name that resolves to every router's address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerService {
    /// `HOST:PORT`.
    pub target: String,
    pub interval: Duration,
}

/// Peering's resolved settings.
#[derive(Debug, Clone, Default)]
pub struct PeerSettings {
    pub peers: Vec<Peer>,
    pub service: Option<PeerService>,
}

/// How often a peer service's name is resolved again.
pub const DEFAULT_RESOLVE_INTERVAL: Duration = Duration::from_secs(10);

/// How long a connection attempt to a peer may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

impl PeerOptions {
    /// The flags' peers, else the file's. `feed_tls`: whether the feed port (where peers are
    /// served) is TLS, which peering cannot subscribe over yet.
    pub fn resolve(
        &self,
        file: &PeerOptions,
        feed_tls: bool,
    ) -> Result<PeerSettings, PeerOptionsError> {
        let given = if self.peers.is_empty() {
            &file.peers
        } else {
            &self.peers
        };
        let service = self.peer_service.as_ref().or(file.peer_service.as_ref());
        if (!given.is_empty() || service.is_some()) && feed_tls {
            return Err(PeerOptionsError::FeedTls);
        }
        let interval = (self.peer_resolve_interval)
            .or(file.peer_resolve_interval)
            .unwrap_or(DEFAULT_RESOLVE_INTERVAL);
        if interval.is_zero() {
            return Err(PeerOptionsError::ResolveInterval);
        }
        let service = match service {
            Some(target) => {
                endpoint(&format!("http://{target}"))?;
                Some(PeerService {
                    target: target.clone(),
                    interval,
                })
            }
            None => None,
        };
        let mut peers: Vec<Peer> = Vec::with_capacity(given.len());
        for url in given {
            let url = url.trim();
            if peers.iter().any(|p| p.url == url) {
                continue;
            }
            peers.push(Peer {
                url: url.to_owned(),
                endpoint: endpoint(url)?,
            });
        }
        Ok(PeerSettings { peers, service })
    }
}

/// The endpoint of `url` (`http://HOST:PORT`), with peering's connection settings.
pub fn endpoint(url: &str) -> Result<Endpoint, PeerOptionsError> {
    let invalid = |reason: &str| PeerOptionsError::Url {
        url: url.to_owned(),
        reason: reason.to_owned(),
    };
    let Some(rest) = url.strip_prefix("http://") else {
        return Err(invalid("give it as http://HOST:FEED_PORT"));
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains('/') {
        return Err(invalid("give it as http://HOST:FEED_PORT, without a path"));
    }
    if authority
        .rsplit_once(':')
        .is_none_or(|(_, port)| port.parse::<u16>().is_err())
    {
        return Err(invalid("it needs the peer's feed port (http://HOST:PORT)"));
    }
    Endpoint::from_shared(url.to_owned())
        .map(|e| {
            e.connect_timeout(CONNECT_TIMEOUT)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(10))
                .keep_alive_timeout(Duration::from_secs(5))
        })
        .map_err(|e| invalid(&e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(peers: &[&str]) -> PeerOptions {
        PeerOptions {
            peers: peers.iter().map(|p| (*p).to_owned()).collect(),
            ..PeerOptions::default()
        }
    }

    fn service(target: &str) -> PeerOptions {
        PeerOptions {
            peer_service: Some(target.to_owned()),
            ..PeerOptions::default()
        }
    }

    #[test]
    fn a_peer_service_is_host_and_port_resolved_every_interval() {
        let settings = service("llmgw-router-feed.llmgw.svc:9004")
            .resolve(&PeerOptions::default(), false)
            .expect("valid service");
        assert_eq!(
            settings.service,
            Some(PeerService {
                target: "llmgw-router-feed.llmgw.svc:9004".to_owned(),
                interval: DEFAULT_RESOLVE_INTERVAL,
            })
        );
        let error = service("llmgw-router-feed")
            .resolve(&PeerOptions::default(), false)
            .expect_err("no port");
        assert!(error.to_string().contains("llmgw-router-feed"), "{error}");
        let zero = PeerOptions {
            peer_resolve_interval: Some(Duration::ZERO),
            ..service("r:9004")
        };
        assert_eq!(
            zero.resolve(&PeerOptions::default(), false)
                .expect_err("zero"),
            PeerOptionsError::ResolveInterval
        );
        assert_eq!(
            service("r:9004")
                .resolve(&PeerOptions::default(), true)
                .expect_err("TLS feed"),
            PeerOptionsError::FeedTls
        );
    }

    #[test]
    fn the_flags_win_over_the_file_and_repeats_count_once() {
        let file = options(&["http://10.0.0.1:9003"]);
        let settings = options(&["http://10.0.0.2:9003", " http://10.0.0.2:9003"])
            .resolve(&file, false)
            .expect("valid peers");
        let urls: Vec<&str> = settings.peers.iter().map(|p| p.url.as_str()).collect();
        assert_eq!(urls, ["http://10.0.0.2:9003"]);
        let from_file = options(&[]).resolve(&file, false).expect("valid peers");
        assert_eq!(from_file.peers.len(), 1);
        assert_eq!(from_file.peers[0].url, "http://10.0.0.1:9003");
    }

    #[test]
    fn a_peer_without_scheme_or_port_or_with_a_path_is_refused_by_name() {
        for (url, says) in [
            ("10.0.0.1:9003", "http://HOST:FEED_PORT"),
            ("https://10.0.0.1:9003", "http://HOST:FEED_PORT"),
            ("http://10.0.0.1", "feed port"),
            ("http://10.0.0.1:99999", "feed port"),
            ("http://10.0.0.1:9003/feed", "without a path"),
            ("http://", "without a path"),
        ] {
            let error = options(&[url])
                .resolve(&PeerOptions::default(), false)
                .expect_err(url);
            let text = error.to_string();
            assert!(text.contains(url) && text.contains(says), "{url}: {text}");
        }
        assert!(
            options(&["http://router-1.llmgw:9003/"])
                .resolve(&PeerOptions::default(), false)
                .is_ok()
        );
    }

    #[test]
    fn peers_with_a_tls_feed_port_are_refused_and_none_are_fine() {
        assert_eq!(
            options(&["http://10.0.0.1:9003"])
                .resolve(&PeerOptions::default(), true)
                .expect_err("TLS feed"),
            PeerOptionsError::FeedTls
        );
        assert!(
            options(&[])
                .resolve(&PeerOptions::default(), true)
                .expect("no peers")
                .peers
                .is_empty()
        );
    }
}
