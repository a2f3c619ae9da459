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
