//! Staleness: an engine that has published nothing for a while *and* whose `/health` says it is
//! gone is presumed dead; its blocks are reset so the routers stop sending it prefix-heavy
//! traffic on the strength of a cache that no longer exists. A silent engine whose `/health`
//! answers is simply idle and keeps its blocks. The engine becomes live again with its next
//! batch.
//!
//! What counts as gone: a refused connection (nothing listens: the process is gone) or an
//! answer other than success (vLLM answers 503 once its engine core died), at once; a probe left
//! unanswered only when [`UNANSWERED_TO_STALE`] in a row are. A busy engine answers late: on a
//! loaded host (four or five vLLM engines, a router and Envoy on two cores) single probes timed
//! out and reset live caches, so the routers forgot what those engines still held
//! (docs/results/2026-12-07-real-vllm-again.md).
//!
//! # Concurrency model
//! One task per engine; it reads the engine's last-batch time through its short lock and
//! resets through the engine's input channel, like the intake.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::engine::{Engine, Input, ResetReason};
use crate::metrics::Metrics;

/// Probes of a silent engine left unanswered in a row before it counts as dead. With the defaults
/// (a probe every 5 s, each waiting 2 s), a hung engine is reset about 16 s after the first
/// unanswered probe was sent.
pub const UNANSWERED_TO_STALE: u32 = 3;

/// One engine's health watch.
pub struct HealthWatch {
    pub engine: Arc<Engine>,
    /// e.g. `http://10.0.0.5:8000/health`.
    pub url: String,
    /// Silence that triggers a health check.
    pub silence: Duration,
    /// How long one probe may take before it counts as unanswered.
    pub probe_timeout: Duration,
    pub inputs: mpsc::Sender<Input>,
    pub metrics: Arc<Metrics>,
}

/// What one `/health` probe said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    Healthy,
    /// Refused, or answered with a failure status: the engine is gone.
    Gone,
    /// Timed out or broke off: maybe gone, maybe only busy.
    Unanswered,
}

impl HealthWatch {
    /// The probe timeout for a given silence: 2 s, or the silence when shorter.
    pub fn probe_timeout_for(silence: Duration) -> Duration {
        Duration::from_secs(2).min(silence.max(Duration::from_millis(50)))
    }

    pub async fn run(self) {
        let client = match reqwest::Client::builder()
            .timeout(self.probe_timeout)
            .build()
        {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(engine = &*self.engine.id.0, error = %e, "no HTTP client: staleness not watched");
                return;
            }
        };
        let started = Instant::now();
        let period = (self.silence / 2).max(Duration::from_millis(10));
        let mut unanswered = 0u32;
        loop {
            tokio::time::sleep(period).await;
            if self.engine.is_stale()
                || self.engine.quiet_for(Instant::now(), started) < self.silence
            {
                unanswered = 0;
                continue;
            }
            let probe = match client.get(&self.url).send().await {
                Ok(r) if r.status().is_success() => Probe::Healthy,
                Ok(_) => Probe::Gone,
                Err(e) if e.is_connect() && !e.is_timeout() => Probe::Gone,
                Err(_) => Probe::Unanswered,
            };
            let dead = match probe {
                Probe::Healthy => {
                    unanswered = 0;
                    false
                }
                Probe::Gone => true,
                Probe::Unanswered => {
                    unanswered += 1;
                    if unanswered < UNANSWERED_TO_STALE {
                        tracing::debug!(
                            engine = &*self.engine.id.0,
                            url = self.url,
                            unanswered,
                            "a silent engine left its health probe unanswered; busy or gone"
                        );
                    }
                    unanswered >= UNANSWERED_TO_STALE
                }
            };
            if !dead || !self.engine.mark_stale() {
                continue;
            }
            unanswered = 0;
            let engine = &*self.engine.id.0;
            tracing::warn!(
                engine,
                url = self.url,
                silence = ?self.silence,
                ?probe,
                "engine silent and its health check fails: stale, resetting"
            );
            self.metrics
                .engine_stale
                .get_or_create(&Metrics::engine(engine))
                .set(1);
            if self
                .inputs
                .send(Input::Reset(ResetReason::Stale))
                .await
                .is_err()
            {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::sync::broadcast;

    use super::*;
    use crate::engine::{EngineId, MirrorTask, ReplicaId};
    use crate::mirror::DEFAULT_WINDOW;
    use crate::wire::{BlockStored, EventBatch, ExternalHash, KvEvent};

    async fn watched(url: String) -> (Arc<Engine>, Arc<Metrics>, mpsc::Sender<Input>) {
        let metrics = Arc::new(Metrics::new());
        let engine = Engine::new(EngineId(Arc::from("e0")), ReplicaId(Arc::from("h:1")));
        let (tx, rx) = mpsc::channel(16);
        let mirror = MirrorTask {
            engine: Arc::clone(&engine),
            check: None,
            window: DEFAULT_WINDOW,
            metrics: Arc::clone(&metrics),
            updates: broadcast::channel(16).0,
        };
        tokio::spawn(mirror.run(rx));
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![ExternalHash(5)],
                ..BlockStored::default()
            })],
            dp_rank: None,
        };
        tx.send(Input::Batch {
            seq: 0,
            batch,
            span: tracing::Span::none(),
        })
        .await
        .expect("send");
        tokio::spawn(
            HealthWatch {
                engine: Arc::clone(&engine),
                url,
                silence: Duration::from_millis(100),
                // Long enough that a loopback answer is never late on a loaded test machine.
                probe_timeout: Duration::from_secs(1),
                inputs: tx.clone(),
                metrics: Arc::clone(&metrics),
            }
            .run(),
        );
        (engine, metrics, tx)
    }

    #[tokio::test]
    async fn a_silent_engine_whose_health_fails_is_reset_as_stale() {
        // Nothing listens on this port.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port")
            .port();
        let (engine, metrics, tx) = watched(format!("http://127.0.0.1:{port}/health")).await;
        for _ in 0..200 {
            if engine.is_stale() && engine.block_set().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(engine.is_stale());
        assert!(engine.block_set().is_empty(), "blocks reset");
        let m = metrics.encode();
        assert!(
            m.contains(r#"llmgw_agent_engine_stale{engine="e0"} 1"#),
            "{m}"
        );
        assert!(m.contains(r#"llmgw_agent_resets_total{engine="e0",reason="stale"} 1"#));
        // The engine speaks again: live.
        let batch = EventBatch::default();
        tx.send(Input::Batch {
            seq: 1,
            batch,
            span: tracing::Span::none(),
        })
        .await
        .expect("send");
        for _ in 0..100 {
            if !engine.is_stale() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!engine.is_stale());
    }

    #[tokio::test]
    async fn a_silent_but_healthy_engine_keeps_its_blocks() {
        let (url, probes) = health_server(|_| Some(axum::http::StatusCode::OK)).await;
        let (engine, _metrics, _tx) = watched(url).await;
        // The watch probes one at a time: once the second probe is answered, it has judged
        // the first answer.
        for _ in 0..500 {
            if probes.load(Ordering::SeqCst) >= 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(probes.load(Ordering::SeqCst) >= 2, "the health was checked");
        assert!(!engine.is_stale());
        assert_eq!(engine.block_set().len(), 1);
    }

    /// A `/health` that answers each probe as `answer` says (by the probe's number, from 1),
    /// counting the probes; `None` never answers.
    async fn health_server(
        answer: impl Fn(usize) -> Option<axum::http::StatusCode> + Clone + Send + Sync + 'static,
    ) -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let probes = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&probes);
        let app = axum::Router::new().route(
            "/health",
            axum::routing::get(move || {
                let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                let status = answer(n);
                async move {
                    match status {
                        Some(status) => status,
                        None => std::future::pending().await,
                    }
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        (format!("http://{addr}/health"), probes)
    }

    async fn until_stale(engine: &Engine) {
        for _ in 0..3000 {
            if engine.is_stale() && engine.block_set().is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the engine never went stale");
    }

    #[tokio::test]
    async fn an_engine_answering_its_health_check_with_a_failure_is_stale_at_once() {
        let (url, probes) =
            health_server(|_| Some(axum::http::StatusCode::SERVICE_UNAVAILABLE)).await;
        let (engine, _metrics, _tx) = watched(url).await;
        until_stale(&engine).await;
        // A stale engine is not probed again until it speaks.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(probes.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_busy_engine_is_reset_only_after_three_unanswered_probes_in_a_row() {
        // Two probes time out, the third is answered, then none is: the count starts again
        // after the answer, so the sixth probe is the third unanswered in a row.
        let (url, probes) = health_server(|n| (n == 3).then_some(axum::http::StatusCode::OK)).await;
        let (engine, _metrics, _tx) = watched(url).await;
        until_stale(&engine).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            probes.load(Ordering::SeqCst),
            3 + UNANSWERED_TO_STALE as usize
        );
    }
}
