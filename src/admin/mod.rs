//! The admin HTTP server (axum): `/metrics` (Prometheus text), `/healthz` (200 once a replica is
//! healthy, else 503) and `/debug` (the pool's state as JSON).
//!
//! # Concurrency model
//! Handlers only read: the metrics registry (atomics) and lock-free pool snapshots.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;
use tokio::time::Instant;

use crate::metrics::Metrics;
use crate::pool::{Pool, ReplicaView};
use crate::scheduler::SchedulerSettings;

/// What the handlers read.
#[derive(Debug)]
pub struct AdminState {
    pub pool: Arc<Pool>,
    pub metrics: Arc<Metrics>,
    pub scheduler: SchedulerSettings,
}

/// The admin routes.
pub fn routes(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/debug", get(debug))
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
struct DebugView {
    replicas: Vec<ReplicaView>,
    scheduler: SchedulerSettings,
}

async fn debug(State(state): State<Arc<AdminState>>) -> Response {
    let view = DebugView {
        replicas: state
            .pool
            .snapshot()
            .views(Instant::now(), state.pool.metrics_staleness()),
        scheduler: state.scheduler,
    };
    axum::Json(view).into_response()
}
