//! The admin HTTP server (axum): `/metrics` (Prometheus text), `/healthz` (200 once a replica is
//! healthy, else 503), `/debug` (the pool's state as JSON) and
//! `/debug/replicas/{replica}/blocks` (the block hashes the KV index believes a replica holds).
//!
//! # Concurrency model
//! Handlers only read: the metrics registry (atomics) and lock-free pool snapshots.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;
use tokio::time::Instant;

use crate::config::PoolIdentity;
use crate::flowcontrol::{FlowControl, FlowView};
use crate::kvindex::KvIndex;
use crate::metrics::Metrics;
use crate::pool::{Pool, ReplicaView};
use crate::scheduler::SchedulerConfig;

/// What the handlers read.
#[derive(Debug)]
pub struct AdminState {
    pub pool: Arc<Pool>,
    pub metrics: Arc<Metrics>,
    pub scheduler: SchedulerConfig,
    pub index: Arc<KvIndex>,
    /// The InferencePool this router picks for, if named.
    pub inference_pool: Option<PoolIdentity>,
    /// `None` when flow control is off.
    pub flow_control: Option<Arc<FlowControl>>,
}

/// The admin routes.
pub fn routes(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/debug", get(debug))
        .route("/debug/replicas/{replica}/blocks", get(replica_blocks))
        .with_state(state)
}

async fn metrics(State(state): State<Arc<AdminState>>) -> Response {
    match state.metrics.encode() {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn healthz(State(state): State<Arc<AdminState>>) -> (StatusCode, &'static str) {
    if state.pool.snapshot().any_healthy() {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no healthy replica\n")
    }
}

#[derive(Serialize)]
struct DebugView<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    inference_pool: Option<&'a PoolIdentity>,
    replicas: Vec<ReplicaView>,
    scheduler: &'a SchedulerConfig,
    #[serde(skip_serializing_if = "Option::is_none")]
    flow_control: Option<FlowView>,
}

async fn debug(State(state): State<Arc<AdminState>>) -> Response {
    let view = DebugView {
        inference_pool: state.inference_pool.as_ref(),
        replicas: state
            .pool
            .snapshot()
            .views(Instant::now(), state.pool.metrics_staleness()),
        scheduler: &state.scheduler,
        flow_control: state.flow_control.as_ref().map(|f| f.view()),
    };
    axum::Json(view).into_response()
}

#[derive(Serialize)]
struct ReplicaBlocks {
    replica: String,
    /// Sorted external block hashes (what engines publish as u64).
    block_hashes: Vec<u64>,
}

async fn replica_blocks(
    State(state): State<Arc<AdminState>>,
    Path(replica): Path<String>,
) -> Response {
    if state.pool.snapshot().find(&replica).is_none() {
        let body = serde_json::json!({"error": {
            "message": format!("no replica {replica} in the pool"),
            "type": "NotFoundError",
            "code": 404,
        }});
        return (StatusCode::NOT_FOUND, axum::Json(body)).into_response();
    }
    let block_hashes = state
        .index
        .replica_blocks(&replica)
        .into_iter()
        .map(|h| h.0)
        .collect();
    axum::Json(ReplicaBlocks {
        replica,
        block_hashes,
    })
    .into_response()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::blockhash::ExternalHash;
    use crate::kvindex::{IndexConfig, KvEventSink, Medium};
    use crate::pool::ReplicaSpec;

    #[tokio::test]
    async fn replica_blocks_and_debug_show_what_the_router_believes() {
        let pool = Arc::new(Pool::new(
            vec![ReplicaSpec {
                address: "127.0.0.1:8001".parse().expect("addr"),
                models: vec!["m".to_owned()],
                node: None,
            }],
            Duration::from_secs(2),
        ));
        let index = Arc::new(KvIndex::new(IndexConfig::default()));
        index.stored(
            "127.0.0.1:8001",
            &[ExternalHash(9), ExternalHash(3)],
            Medium::Gpu,
        );
        let settings = crate::flowcontrol::FlowSettings {
            objectives: vec![crate::flowcontrol::ObjectiveSpec {
                name: "chat".into(),
                priority: 5,
                queue_timeout: None,
            }],
            ..crate::flowcontrol::FlowSettings::default()
        };
        let flow_control = Arc::new(FlowControl::new(
            settings.clone(),
            Arc::new(crate::flowcontrol::Objectives::new(&settings.objectives)),
            crate::scheduler::Scheduler::load_only(Arc::clone(&pool))
                .expect("builds")
                .capacity(),
            crate::flowcontrol::FlowMetrics::unregistered(""),
        ));
        let replica = Arc::clone(&pool.snapshot().replicas()[0]);
        replica.set_adapters(crate::pool::adapters::AdapterCatalog::from_cards(&[
            crate::pool::adapters::ModelCard {
                id: "sql".into(),
                root: Some("/adapters/sql".into()),
                parent: Some("m".into()),
            },
        ]));
        let state = Arc::new(AdminState {
            metrics: Arc::new(Metrics::new(Arc::clone(&pool))),
            pool,
            scheduler: SchedulerConfig::default(),
            index,
            inference_pool: None,
            flow_control: Some(flow_control),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, routes(state)).await });

        let url = format!("http://{addr}/debug/replicas/127.0.0.1:8001/blocks");
        let body: serde_json::Value = reqwest::get(url)
            .await
            .expect("get")
            .json()
            .await
            .expect("json");
        assert_eq!(
            body,
            serde_json::json!({"replica": "127.0.0.1:8001", "block_hashes": [3, 9]})
        );
        let missing = reqwest::get(format!("http://{addr}/debug/replicas/10.9.9.9:1/blocks"))
            .await
            .expect("get");
        assert_eq!(missing.status(), 404);

        // /debug shows flow control's settings and objectives.
        let debug: serde_json::Value = reqwest::get(format!("http://{addr}/debug"))
            .await
            .expect("get")
            .json()
            .await
            .expect("json");
        assert_eq!(
            debug["replicas"][0]["adapters"],
            serde_json::json!({"sql": "/adapters/sql"}),
            "the adapter paths its blocks are hashed with"
        );
        let flow = &debug["flow_control"];
        assert_eq!(flow["objectives"], serde_json::json!({"chat": 5}));
        assert_eq!(flow["queue_timeout_ms"], 30000);
        assert_eq!(flow["queued"], serde_json::json!({}));
    }
}
