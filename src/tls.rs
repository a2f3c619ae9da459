//! TLS (and mutual TLS) on the router's gRPC listeners, with rustls and ring: the agent feed
//! (`--feed-tls-*`) and ext_proc (`--secure-serving`, as GIE's endpoint picker offers it). The
//! router is also a TLS client of its peers' feed ports ([`ClientTlsFiles`], `--peer-tls-*`);
//! tonic's client TLS does that side.
//!
//! The router terminates TLS itself rather than through tonic's `ServerTlsConfig`, so that a
//! refused handshake (no client certificate, one from another CA, a plain-text client) is
//! logged with the peer's address and counted (`llmgw_feed_tls_refused_total{reason}`,
//! `llmgw_extproc_tls_refused_total{reason}`); tonic would drop it at debug level. The streams
//! handed to tonic are ordinary `tokio_rustls` server streams, so the services see nothing
//! different.
//!
//! With mutual TLS the feed also checks, per stream, that the node an agent's Hello claims is
//! named by its certificate ([`cert_names`]: DNS subject alt names and the subject's CN, matched
//! exactly, ASCII case ignored); otherwise any agent with a valid certificate could speak for
//! another node's replicas. [`ServerTls::with_node_check`] turns that off.
//!
//! Certificates loaded from files with reloading on ([`ServerTls::load`]) are checked for
//! changes at each new connection and rebuilt when they changed, so renewed certificates need
//! no restart. Without files, [`ServerTls::self_signed`] makes a certificate at start.
//!
//! # Concurrency model
//! One accept task owns the listener; each handshake runs in its own task (bounded by
//! [`HANDSHAKE_TIMEOUT`]) so a slow or silent client never holds up the others; finished
//! streams reach tonic through a channel. Dropping the [`TlsIncoming`] stream ends both.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use thiserror::Error;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::server::TlsStream;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// How long a client may take to complete its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a listener's certificate, key and (for mutual TLS) client CA live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsPaths {
    /// With a client CA: refuse a stream whose Hello names a node its certificate does not.
    pub check_node: bool,
    /// PEM certificate chain presented to clients.
    pub cert: PathBuf,
    /// PEM private key of `cert`.
    pub key: PathBuf,
    /// PEM CA bundle: when given, every client must present a certificate it signed.
    pub client_ca: Option<PathBuf>,
}

/// ext_proc's TLS options, named as GIE's endpoint picker names them: flags (and `LLMGW_*`
/// variables) with the same names as the configuration file's keys.
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
#[serde(default)]
pub struct ServingOptions {
    /// Serve ext_proc (and the gRPC health services on its port) over TLS: true or false
    /// (default false; a bare --secure-serving means true). With no --cert-path a self-signed
    /// certificate is made at start, as GIE's endpoint picker does. The Unix socket and the
    /// health-only port stay plaintext (kubelet's gRPC probes speak no TLS).
    #[arg(
        long,
        env = "LLMGW_SECURE_SERVING",
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub secure_serving: Option<bool>,
    /// A directory holding ext_proc's certificate and key as tls.crt and tls.key (a Kubernetes
    /// TLS Secret mounted as a volume); implies --secure-serving.
    #[arg(long, env = "LLMGW_CERT_PATH")]
    pub cert_path: Option<PathBuf>,
    /// Read --cert-path's files again when they change (checked at each new connection).
    #[arg(
        long,
        env = "LLMGW_ENABLE_CERT_RELOAD",
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub enable_cert_reload: Option<bool>,
}

/// How ext_proc is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServingTls {
    /// A certificate made at start.
    SelfSigned,
    /// `tls.crt` and `tls.key` in a directory, read again when they change if `reload`.
    Files { paths: TlsPaths, reload: bool },
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ServingOptionsError {
    #[error("--cert-path needs TLS, but --secure-serving is false")]
    CertPathWithoutTls,
    #[error("--enable-cert-reload needs --cert-path (a self-signed certificate has no files)")]
    ReloadWithoutFiles,
}

impl ServingOptions {
    /// These options (the flags) over `file`'s; `None` is plaintext.
    pub fn resolve(
        &self,
        file: &ServingOptions,
    ) -> Result<Option<ServingTls>, ServingOptionsError> {
        let cert_path = self.cert_path.clone().or(file.cert_path.clone());
        let secure = (self.secure_serving)
            .or(file.secure_serving)
            .unwrap_or(cert_path.is_some());
        let reload = (self.enable_cert_reload)
            .or(file.enable_cert_reload)
            .unwrap_or(false);
        match (secure, cert_path) {
            (false, Some(_)) => Err(ServingOptionsError::CertPathWithoutTls),
            (_, None) if reload => Err(ServingOptionsError::ReloadWithoutFiles),
            (false, None) => Ok(None),
            (true, None) => Ok(Some(ServingTls::SelfSigned)),
            (true, Some(dir)) => Ok(Some(ServingTls::Files {
                paths: TlsPaths {
                    check_node: false,
                    cert: dir.join("tls.crt"),
                    key: dir.join("tls.key"),
                    client_ca: None,
                },
                reload,
            })),
        }
    }
}

impl ServingTls {
    /// The acceptor: the certificate made or read now.
    pub fn acceptor(&self) -> Result<ServerTls, TlsError> {
        match self {
            ServingTls::SelfSigned => {
                ServerTls::self_signed(&["llmgw-router".to_string(), "localhost".to_string()])
            }
            ServingTls::Files {
                paths,
                reload: true,
            } => ServerTls::load(paths),
            ServingTls::Files {
                paths,
                reload: false,
            } => ServerTls::load_once(paths),
        }
    }
}

/// Errors setting TLS up (all at start-up).
#[derive(Debug, Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{what}: {why}")]
    Pem { what: &'static str, why: String },
    #[error("client CA: {0}")]
    ClientCa(#[from] rustls::server::VerifierBuilderError),
    #[error("certificate and key: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("self-signed certificate: {0}")]
    SelfSigned(#[from] rcgen::Error),
}

/// A ready TLS acceptor.
#[derive(Clone)]
pub struct ServerTls {
    acceptor: TlsAcceptor,
    client_auth: bool,
    check_node: bool,
    /// Set when loaded from files: they are checked for changes at each connection.
    reload: Option<Arc<Reload>>,
}

/// A file's modification time and length, `None` while it cannot be read.
type Stamp = Option<(std::time::SystemTime, u64)>;

/// The files of a [`ServerTls`] and the acceptor last built from them.
struct Reload {
    paths: TlsPaths,
    current: parking_lot::Mutex<(Vec<Stamp>, TlsAcceptor)>,
}

impl Reload {
    fn stamps(paths: &TlsPaths) -> Vec<Stamp> {
        [
            Some(&paths.cert),
            Some(&paths.key),
            paths.client_ca.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(|p| {
            let m = std::fs::metadata(p).ok()?;
            Some((m.modified().ok()?, m.len()))
        })
        .collect()
    }

    /// The acceptor for a new connection: rebuilt first if a file changed since the last
    /// build (certificates renewed by cert-manager or a rotated Secret). A change that does
    /// not load (a file half written) keeps the previous acceptor and is retried at the next
    /// connection. Connections are rare (an agent's reconnect, a proxy's new HTTP/2 connection), so checking
    /// costs nothing.
    fn acceptor(&self) -> TlsAcceptor {
        let mut current = self.current.lock();
        let stamps = Reload::stamps(&self.paths);
        if stamps != current.0 {
            match ServerTls::load_files(&self.paths) {
                Ok(fresh) => {
                    tracing::info!(cert = %self.paths.cert.display(), "TLS files changed: reloaded");
                    *current = (stamps, fresh.acceptor);
                }
                Err(error) => {
                    tracing::warn!(cert = %self.paths.cert.display(), %error, "TLS files changed but do not load; keeping the previous ones");
                }
            }
        }
        current.1.clone()
    }
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("client_auth", &self.client_auth)
            .field("check_node", &self.check_node)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn certs(pem: &[u8], what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            what,
            why: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            what,
            why: "no PEM certificate found".into(),
        });
    }
    Ok(certs)
}

impl ServerTls {
    /// Reads the files named in `paths` once.
    pub fn load_once(paths: &TlsPaths) -> Result<ServerTls, TlsError> {
        ServerTls::load_files(paths)
    }

    /// A self-signed certificate for `names` (DNS names or IPs), made now, as GIE's endpoint
    /// picker makes one when it is given none: the connection is encrypted, and a client must
    /// skip verification (Istio's `insecureSkipVerify`, an Envoy upstream TLS context without
    /// a validation context).
    pub fn self_signed(names: &[String]) -> Result<ServerTls, TlsError> {
        let key = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::new(names.to_vec())?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "llmgw-router");
        let cert = params.self_signed(&key)?;
        ServerTls::from_pem(cert.pem().as_bytes(), key.serialize_pem().as_bytes(), None)
    }

    /// Reads the files named in `paths`, and reads them again when they change.
    pub fn load(paths: &TlsPaths) -> Result<ServerTls, TlsError> {
        let stamps = Reload::stamps(paths);
        let mut tls = ServerTls::load_files(paths)?;
        tls.reload = Some(Arc::new(Reload {
            paths: paths.clone(),
            current: parking_lot::Mutex::new((stamps, tls.acceptor.clone())),
        }));
        Ok(tls)
    }

    fn load_files(paths: &TlsPaths) -> Result<ServerTls, TlsError> {
        let ca = paths.client_ca.as_deref().map(read).transpose()?;
        Ok(
            ServerTls::from_pem(&read(&paths.cert)?, &read(&paths.key)?, ca.as_deref())?
                .with_node_check(paths.check_node),
        )
    }

    /// The acceptor for the next connection.
    fn acceptor(&self) -> TlsAcceptor {
        match &self.reload {
            Some(reload) => reload.acceptor(),
            None => self.acceptor.clone(),
        }
    }

    /// From PEM text: the server's chain and key, and optionally the CA that signs clients'
    /// certificates (then a client certificate is required).
    pub fn from_pem(
        cert: &[u8],
        key: &[u8],
        client_ca: Option<&[u8]>,
    ) -> Result<ServerTls, TlsError> {
        let chain = certs(cert, "certificate")?;
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| TlsError::Pem {
            what: "key",
            why: e.to_string(),
        })?;
        let builder = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(pem) => {
                let mut roots = rustls::RootCertStore::empty();
                for ca in certs(pem, "client CA")? {
                    roots.add(ca)?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    Arc::new(rustls::crypto::ring::default_provider()),
                )
                .build()?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_single_cert(chain, key)?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(ServerTls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            client_auth: client_ca.is_some(),
            check_node: true,
            reload: None,
        })
    }

    /// Whether a client certificate must name the node the agent claims (the feed's check;
    /// default: yes).
    pub fn with_node_check(mut self, on: bool) -> Self {
        self.check_node = on;
        self
    }

    /// Whether clients must present a certificate.
    pub fn requires_client_cert(&self) -> bool {
        self.client_auth
    }

    /// Whether streams are checked against their certificate's names.
    pub fn checks_node(&self) -> bool {
        self.client_auth && self.check_node
    }
}

/// The names a client certificate gives its holder: DNS subject alt names, then the subject's
/// common names. Nothing when the certificate cannot be parsed (rustls verified it, so that
/// would be a certificate naming nothing we understand).
pub fn cert_names(cert: &CertificateDer<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(cert.as_ref()) else {
        return Vec::new();
    };
    let mut names: Vec<String> = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let GeneralName::DNSName(dns) = name {
                names.push((*dns).to_owned());
            }
        }
    }
    for cn in cert.subject().iter_common_name() {
        if let Ok(cn) = cn.as_str() {
            names.push(cn.to_owned());
        }
    }
    names
}

/// Whether `node` is one of `names` (exactly; DNS names ignore ASCII case).
pub fn names_node(names: &[String], node: &str) -> bool {
    names.iter().any(|n| n.eq_ignore_ascii_case(node))
}

/// Why a handshake was refused (the `reason` label).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TlsRefusal {
    pub reason: &'static str,
}

/// Counts of refused handshakes by reason.
pub type TlsRefusals = Family<TlsRefusal, Counter>;

/// A short reason for a failed handshake, for the metric and the log line.
pub fn refusal_reason(error: &io::Error) -> &'static str {
    if error.kind() == io::ErrorKind::TimedOut {
        return "timeout";
    }
    match error
        .get_ref()
        .and_then(|e| e.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::NoCertificatesPresented) => "no_client_cert",
        Some(rustls::Error::InvalidCertificate(_)) => "bad_client_cert",
        Some(rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. }) => {
            "not_tls"
        }
        Some(rustls::Error::AlertReceived(_)) => "client_alert",
        Some(_) => "tls_error",
        None => "io_error",
    }
}

/// TLS streams accepted on a listener, as tonic's `serve_with_incoming` takes them.
pub struct TlsIncoming {
    rx: mpsc::Receiver<TlsStream<TcpStream>>,
    accept: JoinHandle<()>,
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Stream for TlsIncoming {
    type Item = Result<TlsStream<TcpStream>, io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx).map(|s| s.map(Ok))
    }
}

impl TlsIncoming {
    /// Accepts on `listener`, handshakes with `tls`, counts refusals in `refused`; `name`
    /// names the listener in logs.
    pub fn new(
        name: &'static str,
        listener: TcpListener,
        tls: ServerTls,
        refused: TlsRefusals,
    ) -> TlsIncoming {
        let (tx, rx) = mpsc::channel(64);
        let accept = tokio::spawn(accept_loop(name, listener, tls, refused, tx));
        TlsIncoming { rx, accept }
    }
}

async fn accept_loop(
    name: &'static str,
    listener: TcpListener,
    tls: ServerTls,
    refused: TlsRefusals,
    tx: mpsc::Sender<TlsStream<TcpStream>>,
) {
    let mut handshakes = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            // Reap finished handshakes so the set does not grow.
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => continue,
        };
        let (tcp, peer) = match accepted {
            Ok(a) => a,
            Err(error) => {
                // Out of descriptors and the like: back off briefly rather than spin.
                tracing::warn!(listener = name, %error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if tx.is_closed() {
            return;
        }
        let _ = tcp.set_nodelay(true);
        let acceptor = tls.acceptor();
        let tx = tx.clone();
        let refused = refused.clone();
        handshakes.spawn(async move {
            let result = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp))
                .await
                .unwrap_or_else(|_| Err(io::Error::from(io::ErrorKind::TimedOut)));
            match result {
                Ok(stream) => {
                    let _ = tx.send(stream).await;
                }
                Err(error) => {
                    let reason = refusal_reason(&error);
                    refused.get_or_create(&TlsRefusal { reason }).inc();
                    tracing::warn!(listener = name, %peer, reason, %error, "TLS handshake refused");
                }
            }
        });
    }
}

/// `error` and its causes, joined by ": ". tonic's transport error says only "transport
/// error"; the causes name what failed (refused, a certificate for another name, a key that
/// does not match its certificate, ...).
pub fn with_causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        // Some errors repeat their cause's text in their own.
        let said = e.to_string();
        if !text.ends_with(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = e.source();
    }
    text
}

/// The files a TLS client reads: the CA it trusts, and a certificate and key when the server
/// asks for one (mutual TLS). The router is a client of its peers' feed ports
/// ([`crate::peers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTlsFiles {
    /// PEM CA bundle that signed the servers' certificates.
    pub ca: PathBuf,
    /// PEM certificate chain and key presented to the server.
    pub identity: Option<(PathBuf, PathBuf)>,
}

impl ClientTlsFiles {
    /// Reads and checks the files: the CA holds a certificate, the key is a key and matches
    /// the certificate (tonic builds the connector here, so a bad pair fails now rather than at
    /// each connection).
    pub fn load(&self) -> Result<ClientTlsConfig, TlsError> {
        let ca = read(&self.ca)?;
        certs(&ca, "CA")?;
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        if let Some((cert, key)) = &self.identity {
            let (cert, key) = (read(cert)?, read(key)?);
            certs(&cert, "client certificate")?;
            PrivateKeyDer::from_pem_slice(&key).map_err(|e| TlsError::Pem {
                what: "client key",
                why: e.to_string(),
            })?;
            config = config.identity(Identity::from_pem(cert, key));
        }
        tonic::transport::Endpoint::from_static("https://localhost")
            .tls_config(config.clone())
            .map_err(|e| TlsError::Pem {
                what: "client certificate and key",
                why: with_causes(&e),
            })?;
        Ok(config)
    }
}

/// Whether the first certificate in `pem` may identify a TLS client: it has no extended key
/// usage (then any use is allowed) or one naming client authentication (or any use).
pub fn allows_client_auth(pem: &[u8]) -> Result<bool, TlsError> {
    let chain = certs(pem, "certificate")?;
    let Some(leaf) = chain.first() else {
        return Ok(false);
    };
    let (_, cert) =
        x509_parser::parse_x509_certificate(leaf.as_ref()).map_err(|e| TlsError::Pem {
            what: "certificate",
            why: e.to_string(),
        })?;
    Ok(match cert.extended_key_usage() {
        Ok(None) => true,
        Ok(Some(usage)) => usage.value.client_auth || usage.value.any,
        Err(_) => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(sans: &[&str], cn: Option<&str>) -> CertificateDer<'static> {
        let sans: Vec<String> = sans.iter().map(|s| (*s).to_owned()).collect();
        let mut params = rcgen::CertificateParams::new(sans).expect("params");
        if let Some(cn) = cn {
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, cn);
        }
        let key = rcgen::KeyPair::generate().expect("key");
        params.self_signed(&key).expect("cert").der().clone()
    }

    #[test]
    fn a_certificate_names_its_dns_alt_names_and_common_name_but_not_its_ips() {
        let names = cert_names(&cert(
            &["node-a", "10.0.0.7", "Node-B.example"],
            Some("n-cn"),
        ));
        assert_eq!(names, ["node-a", "Node-B.example", "n-cn"]);
        assert!(names_node(&names, "node-b.example"), "DNS ignores case");
        assert!(names_node(&names, "n-cn"));
        assert!(
            !names_node(&names, "10.0.0.7"),
            "an IP SAN is not a node name"
        );
        assert!(!names_node(&names, "node"), "no prefix match");
        assert!(cert_names(&CertificateDer::from(vec![0x30, 0x03, 1, 2, 3])).is_empty());
    }
}
