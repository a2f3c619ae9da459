use std::sync::atomic::{AtomicBool, Ordering};

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus as Status;
use tonic_health::pb::health_client::HealthClient;

use super::*;
use crate::config::{ServeArgs, Settings};

/// A replica stand-in whose /health answers 200 or 503 as `up` says.
async fn fake_replica(up: Arc<AtomicBool>) -> SocketAddr {
    let app = axum::Router::new()
        .route(
            "/health",
            axum::routing::get(move || {
                let up = up.load(Ordering::SeqCst);
                async move {
                    if up {
                        axum::http::StatusCode::OK
                    } else {
                        axum::http::StatusCode::SERVICE_UNAVAILABLE
                    }
                }
            }),
        )
        .route(
            "/metrics",
            axum::routing::get(|| async { "vllm:num_requests_waiting{engine=\"0\"} 2\n" }),
        );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn status_of(client: &mut HealthClient<tonic::transport::Channel>, service: &str) -> Status {
    let response = client
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .unwrap();
    response.into_inner().status()
}

async fn wait_for(
    client: &mut HealthClient<tonic::transport::Channel>,
    service: &str,
    wanted: Status,
) {
    for _ in 0..200 {
        if status_of(client, service).await == wanted {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{service} never became {wanted:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_grpc_health_admin_endpoints_and_stops_on_shutdown() {
    let up = Arc::new(AtomicBool::new(true));
    let replica = fake_replica(Arc::clone(&up)).await;
    let settings = Settings::resolve(&ServeArgs {
        replicas: vec![format!("tiny={replica}")],
        grpc_addr: Some("127.0.0.1:0".parse().unwrap()),
        admin_addr: Some("127.0.0.1:0".parse().unwrap()),
        feed_addr: Some("127.0.0.1:0".parse().unwrap()),
        health_interval: Some(Duration::from_millis(50)),
        scrape_interval: Some(Duration::from_millis(50)),
        ..ServeArgs::default()
    })
    .unwrap();
    let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(
        settings,
        async move {
            let _ = stop_rx.await;
        },
        move |bound| {
            let _ = bound_tx.send(bound);
        },
    ));
    let bound = bound_rx.await.unwrap();

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", bound.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    assert_eq!(status_of(&mut health, "liveness").await, Status::Serving);
    wait_for(&mut health, "readiness", Status::Serving).await;
    wait_for(&mut health, EXT_PROC_HEALTH_SERVICE, Status::Serving).await;

    let admin = format!("http://{}", bound.admin);
    let healthz = reqwest::get(format!("{admin}/healthz")).await.unwrap();
    assert_eq!(healthz.status().as_u16(), 200);
    let mut metrics = String::new();
    for _ in 0..100 {
        metrics = reqwest::get(format!("{admin}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if metrics.contains(&format!("llmgw_replica_waiting{{replica=\"{replica}\"}} 2")) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        metrics.contains(&format!("llmgw_replica_waiting{{replica=\"{replica}\"}} 2")),
        "{metrics}"
    );
    assert!(metrics.contains(&format!("llmgw_replica_healthy{{replica=\"{replica}\"}} 1")));
    let debug: serde_json::Value = reqwest::get(format!("{admin}/debug"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(debug["replicas"][0]["endpoint"], replica.to_string());
    assert_eq!(debug["replicas"][0]["models"][0], "tiny");
    assert_eq!(debug["scheduler"]["fallbacks"], 2);

    // The only replica fails its health check: not ready any more, still live.
    up.store(false, Ordering::SeqCst);
    wait_for(&mut health, "readiness", Status::NotServing).await;
    wait_for(&mut health, EXT_PROC_HEALTH_SERVICE, Status::NotServing).await;
    assert_eq!(status_of(&mut health, "liveness").await, Status::Serving);
    let healthz = reqwest::get(format!("{admin}/healthz")).await.unwrap();
    assert_eq!(healthz.status().as_u16(), 503);

    stop_tx.send(()).unwrap();
    drop(health);
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("serve returns after shutdown")
        .unwrap()
        .unwrap();
}
