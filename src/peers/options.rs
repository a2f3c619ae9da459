//! Peering's options: the other routers behind the same proxy, and TLS to them. Flags (and
//! `LLMGW_*` variables) win over the file's keys of the same names.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;
use tonic::transport::{ClientTlsConfig, Endpoint};

use crate::tls::{ClientTlsFiles, TlsPaths, allows_client_auth};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PeerOptionsError {
    #[error("peer {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error(
        "the feed port is TLS, so peers are reached over TLS: give --peer-tls-ca (the CA that \
         signed the routers' feed certificates) and list peers as https://HOST:FEED_PORT"
    )]
    FeedTlsNeedsCa,
    #[error("--peer-tls-cert and --peer-tls-key go together, and need --peer-tls-ca")]
    Identity,
    #[error(
        "the feed asks its clients for a certificate, so peers ask this router for one: the \
         feed's own certificate ({cert}) does not allow client authentication; give \
         --peer-tls-cert and --peer-tls-key"
    )]
    FeedCertNotForClients { cert: String },
    #[error("TLS to peers: {0}")]
    Tls(String),
    #[error("--peer-resolve-interval must be above 0")]
    ResolveInterval,
}

#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
#[serde(default)]
pub struct PeerOptions {
    /// Another router behind the same proxy, as http://HOST:FEED_PORT (https:// with
    /// --peer-tls-ca; repeatable, or comma-separated): this router subscribes to its picks and
    /// requests in flight, and serves its own on its feed port, so the routers decide as one
    /// would. List every router; a router that finds itself in the list skips that entry.
    #[arg(long = "peer", env = "LLMGW_PEERS", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// HOST:FEED_PORT of a headless Service naming every router (Kubernetes): this router
    /// subscribes to every address the name resolves to, follows the answer every
    /// --peer-resolve-interval, and skips its own address. With --peer, both are followed.
    /// Over TLS each peer's certificate must name HOST.
    #[arg(long, env = "LLMGW_PEER_SERVICE")]
    pub peer_service: Option<String>,
    /// How often --peer-service is resolved again (default 10s).
    #[arg(long, env = "LLMGW_PEER_RESOLVE_INTERVAL", value_parser = crate::duration::parse)]
    #[serde(deserialize_with = "crate::duration::optional")]
    pub peer_resolve_interval: Option<Duration>,
    /// PEM CA bundle that signed the other routers' feed certificates: subscribe to peers over
    /// TLS (needed when the feed port is TLS). Read again at each connection.
    #[arg(long, env = "LLMGW_PEER_TLS_CA")]
    pub peer_tls_ca: Option<PathBuf>,
    /// PEM certificate this router presents to its peers (mutual TLS; with --peer-tls-key).
    /// Default when the feed asks for client certificates: the feed's own certificate, which
    /// must then allow client authentication.
    #[arg(long, env = "LLMGW_PEER_TLS_CERT")]
    pub peer_tls_cert: Option<PathBuf>,
    /// PEM private key of --peer-tls-cert.
    #[arg(long, env = "LLMGW_PEER_TLS_KEY")]
    pub peer_tls_key: Option<PathBuf>,
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

impl PeerService {
    /// The name in `target`, which a peer's TLS certificate must carry (its address is one the
    /// name resolved to).
    pub fn host(&self) -> &str {
        let host = self
            .target
            .rsplit_once(':')
            .map_or(self.target.as_str(), |(host, _)| host);
        host.strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host)
    }
}

/// TLS to peers: the files, read again at each connection so renewed certificates need no
/// restart, and what they held when last read whole.
#[derive(Debug, Clone)]
pub struct PeerTls {
    pub files: ClientTlsFiles,
    loaded: ClientTlsConfig,
}

impl PeerTls {
    /// The settings for a new connection, checking the certificate against `server_name`
    /// (default: the URL's host). Files that no longer load (half written) keep those loaded
    /// before.
    pub fn current(&self, server_name: Option<&str>) -> ClientTlsConfig {
        let config = match self.files.load() {
            Ok(config) => config,
            Err(error) => {
                tracing::warn!(%error, "TLS files for peers do not load; keeping those loaded before");
                self.loaded.clone()
            }
        };
        match server_name {
            Some(name) => config.domain_name(name),
            None => config,
        }
    }
}

/// Peering's resolved settings.
#[derive(Debug, Clone, Default)]
pub struct PeerSettings {
    pub peers: Vec<Peer>,
    pub service: Option<PeerService>,
    pub tls: Option<PeerTls>,
}

/// How often a peer service's name is resolved again.
pub const DEFAULT_RESOLVE_INTERVAL: Duration = Duration::from_secs(10);

/// How long a connection attempt to a peer may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

impl PeerOptions {
    /// The flags' settings over the file's. `feed_tls`: the feed port's TLS files, when it is
    /// TLS (the peers' feed ports are then TLS too, and, with a client CA, ask for a
    /// certificate).
    pub fn resolve(
        &self,
        file: &PeerOptions,
        feed_tls: Option<&TlsPaths>,
    ) -> Result<PeerSettings, PeerOptionsError> {
        let given = if self.peers.is_empty() {
            &file.peers
        } else {
            &self.peers
        };
        let service = self.peer_service.as_ref().or(file.peer_service.as_ref());
        let peering = !given.is_empty() || service.is_some();
        let tls = self.tls(file, feed_tls, peering)?;
        let interval = (self.peer_resolve_interval)
            .or(file.peer_resolve_interval)
            .unwrap_or(DEFAULT_RESOLVE_INTERVAL);
        if interval.is_zero() {
            return Err(PeerOptionsError::ResolveInterval);
        }
        let service = match service {
            Some(target) => {
                endpoint(
                    &format!("{}://{target}", scheme(tls.is_some())),
                    tls.is_some(),
                )?;
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
                endpoint: endpoint(url, tls.is_some())?,
            });
        }
        Ok(PeerSettings {
            peers,
            service,
            tls,
        })
    }

    fn tls(
        &self,
        file: &PeerOptions,
        feed_tls: Option<&TlsPaths>,
        peering: bool,
    ) -> Result<Option<PeerTls>, PeerOptionsError> {
        let pick = |flag: &Option<PathBuf>, file: &Option<PathBuf>| flag.clone().or(file.clone());
        let ca = pick(&self.peer_tls_ca, &file.peer_tls_ca);
        let cert = pick(&self.peer_tls_cert, &file.peer_tls_cert);
        let key = pick(&self.peer_tls_key, &file.peer_tls_key);
        let Some(ca) = ca else {
            if cert.is_some() || key.is_some() {
                return Err(PeerOptionsError::Identity);
            }
            if peering && feed_tls.is_some() {
                return Err(PeerOptionsError::FeedTlsNeedsCa);
            }
            return Ok(None);
        };
        if !peering {
            // Nothing to connect to: a CA set for every router (say in a shared environment)
            // asks nothing of one without peers.
            return Ok(None);
        }
        let failed = |e: crate::tls::TlsError| PeerOptionsError::Tls(e.to_string());
        let identity = match (cert, key) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => match feed_tls {
                // Peers' feed ports ask for a certificate as this one does: present the feed's.
                Some(feed) if feed.client_ca.is_some() => {
                    let pem = std::fs::read(&feed.cert).map_err(|e| {
                        PeerOptionsError::Tls(format!("{}: {e}", feed.cert.display()))
                    })?;
                    if !allows_client_auth(&pem).map_err(failed)? {
                        return Err(PeerOptionsError::FeedCertNotForClients {
                            cert: feed.cert.display().to_string(),
                        });
                    }
                    Some((feed.cert.clone(), feed.key.clone()))
                }
                _ => None,
            },
            _ => return Err(PeerOptionsError::Identity),
        };
        let files = ClientTlsFiles { ca, identity };
        let loaded = files.load().map_err(failed)?;
        Ok(Some(PeerTls { files, loaded }))
    }
}

fn scheme(tls: bool) -> &'static str {
    if tls { "https" } else { "http" }
}

/// The endpoint of `url` (`http://HOST:PORT`, or `https://` when `tls`), with peering's
/// connection settings (TLS is added at each connection: see [`PeerTls::current`]).
pub fn endpoint(url: &str, tls: bool) -> Result<Endpoint, PeerOptionsError> {
    let invalid = |reason: &str| PeerOptionsError::Url {
        url: url.to_owned(),
        reason: reason.to_owned(),
    };
    let form = if tls {
        "https://HOST:FEED_PORT"
    } else {
        "http://HOST:FEED_PORT"
    };
    let Some(rest) = url.strip_prefix(&format!("{}://", scheme(tls))) else {
        return Err(invalid(&if tls {
            format!("peers are reached over TLS (--peer-tls-ca): give it as {form}")
        } else if url.starts_with("https://") {
            format!(
                "https needs --peer-tls-ca (the CA of the peers' feed certificates); else give it as {form}"
            )
        } else {
            format!("give it as {form}")
        }));
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains('/') {
        return Err(invalid(&format!("give it as {form}, without a path")));
    }
    if authority
        .rsplit_once(':')
        .is_none_or(|(_, port)| port.parse::<u16>().is_err())
    {
        return Err(invalid(&format!("it needs the peer's feed port ({form})")));
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

    /// A TLS feed port without client certificates (its files are not read).
    fn plain_feed_tls() -> TlsPaths {
        TlsPaths {
            check_node: true,
            cert: "/nonexistent/tls.crt".into(),
            key: "/nonexistent/tls.key".into(),
            client_ca: None,
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
            .resolve(&PeerOptions::default(), None)
            .expect("valid service");
        assert_eq!(
            settings.service,
            Some(PeerService {
                target: "llmgw-router-feed.llmgw.svc:9004".to_owned(),
                interval: DEFAULT_RESOLVE_INTERVAL,
            })
        );
        let error = service("llmgw-router-feed")
            .resolve(&PeerOptions::default(), None)
            .expect_err("no port");
        assert!(error.to_string().contains("llmgw-router-feed"), "{error}");
        let zero = PeerOptions {
            peer_resolve_interval: Some(Duration::ZERO),
            ..service("r:9004")
        };
        assert_eq!(
            zero.resolve(&PeerOptions::default(), None)
                .expect_err("zero"),
            PeerOptionsError::ResolveInterval
        );
        assert_eq!(
            service("r:9004")
                .resolve(&PeerOptions::default(), Some(&plain_feed_tls()))
                .expect_err("TLS feed"),
            PeerOptionsError::FeedTlsNeedsCa
        );
    }

    #[test]
    fn the_flags_win_over_the_file_and_repeats_count_once() {
        let file = options(&["http://10.0.0.1:9003"]);
        let settings = options(&["http://10.0.0.2:9003", " http://10.0.0.2:9003"])
            .resolve(&file, None)
            .expect("valid peers");
        let urls: Vec<&str> = settings.peers.iter().map(|p| p.url.as_str()).collect();
        assert_eq!(urls, ["http://10.0.0.2:9003"]);
        let from_file = options(&[]).resolve(&file, None).expect("valid peers");
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
                .resolve(&PeerOptions::default(), None)
                .expect_err(url);
            let text = error.to_string();
            assert!(text.contains(url) && text.contains(says), "{url}: {text}");
        }
        assert!(
            options(&["http://router-1.llmgw:9003/"])
                .resolve(&PeerOptions::default(), None)
                .is_ok()
        );
    }

    #[test]
    fn peers_with_a_tls_feed_port_are_refused_and_none_are_fine() {
        assert_eq!(
            options(&["http://10.0.0.1:9003"])
                .resolve(&PeerOptions::default(), Some(&plain_feed_tls()))
                .expect_err("TLS feed"),
            PeerOptionsError::FeedTlsNeedsCa
        );
        assert!(
            options(&[])
                .resolve(&PeerOptions::default(), Some(&plain_feed_tls()))
                .expect("no peers")
                .peers
                .is_empty()
        );
    }

    mod tls {
        use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};

        use super::*;
        use crate::testing::{TestCa, write_file};

        /// A CA's bundle and two of its certificates with their keys, in a temporary directory:
        /// `server` for server authentication only, `router` for both ends.
        struct Files {
            dir: tempfile::TempDir,
            ca: PathBuf,
        }

        impl Files {
            fn new() -> Files {
                let dir = tempfile::tempdir().expect("tempdir");
                let ca = TestCa::new("routers");
                let path = write_file(dir.path(), "ca.crt", &ca.pem());
                for (name, usages) in [
                    ("server", &[ServerAuth][..]),
                    ("router", &[ServerAuth, ClientAuth][..]),
                ] {
                    let (cert, key) = ca.leaf(&["localhost"], usages);
                    write_file(dir.path(), &format!("{name}.crt"), &cert);
                    write_file(dir.path(), &format!("{name}.key"), &key);
                }
                Files { dir, ca: path }
            }

            fn path(&self, name: &str) -> PathBuf {
                self.dir.path().join(name)
            }

            /// The feed port's TLS with this certificate, asking clients for one or not.
            fn feed(&self, cert: &str, client_ca: bool) -> TlsPaths {
                TlsPaths {
                    check_node: true,
                    cert: self.path(&format!("{cert}.crt")),
                    key: self.path(&format!("{cert}.key")),
                    client_ca: client_ca.then(|| self.ca.clone()),
                }
            }

            fn options(&self, peers: &[&str]) -> PeerOptions {
                PeerOptions {
                    peer_tls_ca: Some(self.ca.clone()),
                    ..options(peers)
                }
            }
        }

        #[test]
        fn with_a_peer_ca_peers_are_https_and_a_plain_url_is_refused() {
            let files = Files::new();
            let settings = files
                .options(&["https://router-1.llmgw:9004"])
                .resolve(&PeerOptions::default(), Some(&files.feed("server", false)))
                .expect("TLS peers");
            let tls = settings.tls.expect("TLS to peers");
            assert_eq!(tls.files.ca, files.ca);
            assert_eq!(tls.files.identity, None, "the feed asks for no certificate");
            let error = files
                .options(&["http://router-1.llmgw:9004"])
                .resolve(&PeerOptions::default(), None)
                .expect_err("plain URL");
            assert!(
                error.to_string().contains("https://HOST:FEED_PORT"),
                "{error}"
            );
            let error = options(&["https://router-1.llmgw:9004"])
                .resolve(&PeerOptions::default(), None)
                .expect_err("https without a CA");
            assert!(error.to_string().contains("--peer-tls-ca"), "{error}");
        }

        #[test]
        fn a_feed_asking_for_client_certificates_lends_its_own_when_it_allows_client_auth() {
            let files = Files::new();
            let settings = files
                .options(&["https://router-1.llmgw:9004"])
                .resolve(&PeerOptions::default(), Some(&files.feed("router", true)))
                .expect("the feed's certificate serves both ends");
            assert_eq!(
                settings.tls.expect("TLS").files.identity,
                Some((files.path("router.crt"), files.path("router.key")))
            );
            let error = files
                .options(&["https://router-1.llmgw:9004"])
                .resolve(&PeerOptions::default(), Some(&files.feed("server", true)))
                .expect_err("a server-only certificate");
            assert_eq!(
                error,
                PeerOptionsError::FeedCertNotForClients {
                    cert: files.path("server.crt").display().to_string()
                }
            );
            // Without peers the CA asks nothing of the feed's certificate.
            let no_peers = files
                .options(&[])
                .resolve(&PeerOptions::default(), Some(&files.feed("server", true)))
                .expect("no peers");
            assert!(no_peers.tls.is_none());
            // Given explicitly, a client certificate wins over the feed's.
            let explicit = PeerOptions {
                peer_tls_cert: Some(files.path("router.crt")),
                peer_tls_key: Some(files.path("router.key")),
                ..files.options(&["https://router-1.llmgw:9004"])
            };
            assert!(
                explicit
                    .resolve(&PeerOptions::default(), Some(&files.feed("server", true)))
                    .is_ok()
            );
        }

        #[test]
        fn half_an_identity_a_bad_file_or_a_mismatched_key_is_refused_at_start_up() {
            let files = Files::new();
            let half = PeerOptions {
                peer_tls_cert: Some(files.path("router.crt")),
                ..files.options(&["https://r:9004"])
            };
            assert_eq!(
                half.resolve(&PeerOptions::default(), None)
                    .expect_err("no key"),
                PeerOptionsError::Identity
            );
            let no_ca = PeerOptions {
                peer_tls_cert: Some(files.path("router.crt")),
                peer_tls_key: Some(files.path("router.key")),
                ..options(&[])
            };
            assert_eq!(
                no_ca
                    .resolve(&PeerOptions::default(), None)
                    .expect_err("no CA"),
                PeerOptionsError::Identity
            );
            let mismatched = PeerOptions {
                peer_tls_cert: Some(files.path("router.crt")),
                peer_tls_key: Some(files.path("server.key")),
                ..files.options(&["https://r:9004"])
            };
            let error = mismatched
                .resolve(&PeerOptions::default(), None)
                .expect_err("a key of another certificate");
            assert!(matches!(error, PeerOptionsError::Tls(_)), "{error}");
            // The cause, not tonic's bare "transport error".
            let text = error.to_string();
            assert!(
                text.contains("client certificate and key: transport error: "),
                "{text}"
            );
            let missing = PeerOptions {
                peer_tls_ca: Some(files.path("absent.crt")),
                ..options(&["https://r:9004"])
            };
            let error = missing
                .resolve(&PeerOptions::default(), None)
                .expect_err("missing CA");
            assert!(error.to_string().contains("absent.crt"), "{error}");
            let not_pem = PeerOptions {
                peer_tls_ca: Some(files.path("router.key")),
                ..options(&["https://r:9004"])
            };
            assert!(matches!(
                not_pem.resolve(&PeerOptions::default(), None),
                Err(PeerOptionsError::Tls(_))
            ));
        }

        #[test]
        fn a_service_host_is_what_a_peers_certificate_must_name() {
            for (target, host) in [
                (
                    "llmgw-router-feed.llmgw.svc:9004",
                    "llmgw-router-feed.llmgw.svc",
                ),
                ("[::1]:9004", "::1"),
            ] {
                let service = PeerService {
                    target: target.to_owned(),
                    interval: DEFAULT_RESOLVE_INTERVAL,
                };
                assert_eq!(service.host(), host);
            }
        }
    }
}
