//! What the library's unit tests share (compiled only for them).

use std::net::SocketAddr;

/// Serves `app` on a free loopback port for the rest of the test; returns where.
pub(crate) async fn serve_on_loopback(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Polls `check` every 10 ms until it holds, failing the test after 20 s.
pub(crate) async fn wait_until(mut check: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if check() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("condition not met within 20 s");
}

/// Each replica's `ip:port` and node, as tests compare them.
pub(crate) fn addresses_and_nodes(
    replicas: &[crate::pool::ReplicaSpec],
) -> Vec<(String, Option<&str>)> {
    replicas
        .iter()
        .map(|r| (r.address.to_string(), r.node.as_deref()))
        .collect()
}

/// A certificate authority for TLS tests, and the certificates it signs.
pub(crate) struct TestCa {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl TestCa {
    pub(crate) fn new(name: &str) -> TestCa {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().expect("CA key");
        TestCa {
            issuer: rcgen::CertifiedIssuer::self_signed(params, key).expect("CA cert"),
        }
    }

    pub(crate) fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate for `names` allowing the extended key `usages` (none: any use), and its
    /// key, both PEM.
    pub(crate) fn leaf(
        &self,
        names: &[&str],
        usages: &[rcgen::ExtendedKeyUsagePurpose],
    ) -> (String, String) {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = rcgen::CertificateParams::new(names).expect("params");
        params.extended_key_usages = usages.to_vec();
        let key = rcgen::KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("leaf cert");
        (cert.pem(), key.serialize_pem())
    }
}

/// Writes `text` to `dir/name`; returns its path.
pub(crate) fn write_file(dir: &std::path::Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write test file");
    path
}
