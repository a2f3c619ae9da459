//! The routing policy behind the ext_proc protocol: parse the body ([`crate::openai`]), let the
//! [`Scheduler`] choose, and turn every failure into the HTTP status a client should see.
//!
//! # Tracing
//! Each pick is one `route` span (DEBUG, so free when no OTLP endpoint is configured), a child of
//! the caller's `traceparent` when one came with the request; the stages below it add `parse`,
//! `tokenize`, `hash`, `index_lookup` and `score` spans and record the decision's fields on it
//! (declared where `Router::pick` opens it, listed in `docs/observability.md`). The replica gets a
//! `traceparent` naming the `route` span.
//!
//! # Concurrency model
//! A [`Router`] is immutable and shared by all streams; a pick touches only lock-free pool
//! snapshots, atomics and the metrics' atomics.

use std::sync::Arc;

use tokio::time::Instant;
use tracing::Instrument;
use tracing::field::Empty;

use crate::cputime::CpuTimed;
use crate::extproc::{Picker, Rejection, Routed, RoutingRequest};
use crate::metrics::{Metrics, Outcome, Served};
use crate::openai::{EndpointKind, parse_request};
use crate::pool::InFlightGuard;
use crate::scheduler::{DecideError, Decision, Scheduler, Scope};
use crate::telemetry::{self, TraceHeaders};

/// Parses, schedules and accounts.
#[derive(Debug)]
pub struct Router {
    scheduler: Scheduler,
    metrics: Arc<Metrics>,
    allow_test_selection: bool,
}

impl Router {
    /// `allow_test_selection` honours the conformance suite's `test-epp-endpoint-selection`
    /// header; it lets any client choose among the pool's replicas.
    pub fn new(scheduler: Scheduler, metrics: Arc<Metrics>, allow_test_selection: bool) -> Router {
        Router {
            scheduler,
            metrics,
            allow_test_selection,
        }
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    async fn route(
        &self,
        request: RoutingRequest,
        span: &tracing::Span,
    ) -> Result<(Decision, Outcome), Rejection> {
        let scope = Scope {
            subset: request.subset.as_deref(),
        };
        if self.allow_test_selection
            && let Some(selection) = &request.test_selection
        {
            span.record("tier", "test_selection");
            return self.test_selection(selection);
        }
        let kind = EndpointKind::from_path(&request.path).filter(|_| request.method == "POST");
        let (Some(kind), Some(body)) = (kind, &request.body) else {
            span.record("tier", "any");
            return self
                .scheduler
                .decide_any(scope)
                .map(|d| (d, Outcome::RoutedAny))
                .map_err(|e| self.refuse(e));
        };
        let parsed = tracing::debug_span!("parse", bytes = body.len() as i64)
            .in_scope(|| parse_request(kind, body))
            .map_err(|error| {
                self.metrics.record(Outcome::BadRequest);
                Rejection {
                    status: 400,
                    error_type: "invalid_request_error",
                    message: error.to_string(),
                }
            })?;
        span.record("model", parsed.model.as_str());
        let decision = self
            .scheduler
            .decide(&parsed, &request.headers, scope)
            .await
            .map_err(|e| self.refuse(e))?;
        if decision.imbalance_guard_fired {
            self.metrics.imbalance_guard_fired();
        }
        if decision.prefix_unavailable {
            self.metrics.prefix_unavailable();
        }
        Ok((decision, Outcome::Routed))
    }

    /// `test-epp-endpoint-selection: ip:port[,ip:port]`, restricted to the pool's replicas.
    fn test_selection(&self, selection: &str) -> Result<(Decision, Outcome), Rejection> {
        let snapshot = self.scheduler.pool().snapshot();
        let mut chosen = selection
            .split(',')
            .map(str::trim)
            .filter_map(|endpoint| snapshot.find(endpoint).cloned());
        let Some(primary) = chosen.next() else {
            return Err(self.refuse(DecideError::EmptySubset));
        };
        let decision = Decision {
            in_flight: primary.start_request(),
            fallbacks: chosen.collect(),
            imbalance_guard_fired: false,
            prefix_unavailable: false,
        };
        Ok((decision, Outcome::RoutedTestSelection))
    }

    fn refuse(&self, error: DecideError) -> Rejection {
        let (status, error_type, outcome) = match &error {
            DecideError::UnknownModel(_) => (404, "not_found_error", Outcome::UnknownModel),
            DecideError::NoReadyReplica | DecideError::EmptySubset => {
                (503, "service_unavailable_error", Outcome::NoReadyReplica)
            }
            DecideError::AllSaturated => (429, "rate_limit_error", Outcome::Saturated),
        };
        self.metrics.record(outcome);
        Rejection {
            status,
            error_type,
            message: error.to_string(),
        }
    }
}

impl Picker for Router {
    type Hold = InFlightGuard;

    async fn pick(&self, request: RoutingRequest) -> Result<Routed<InFlightGuard>, Rejection> {
        let span = tracing::debug_span!(
            "route",
            model = Empty,
            prompt_blocks = Empty,
            matched_blocks = Empty,
            matched_share = Empty,
            tier = Empty,
            tier_reason = Empty,
            prefix_outcome = Empty,
            pick = Empty,
            fallbacks = Empty,
            rejected_status = Empty,
            otel.status_code = Empty,
        );
        if let Some(trace) = &request.trace {
            telemetry::parent_from_headers(
                &span,
                TraceHeaders {
                    traceparent: trace.traceparent.as_deref(),
                    tracestate: trace.tracestate.as_deref(),
                },
            );
        }
        let started = Instant::now();
        let (result, cpu) =
            CpuTimed::new(self.route(request, &span).instrument(span.clone())).await;
        self.metrics.observe_pick(started, cpu);
        let (decision, outcome) = match result {
            Ok(routed) => routed,
            Err(rejection) => {
                span.record("rejected_status", i64::from(rejection.status));
                span.record("otel.status_code", "ERROR");
                return Err(rejection);
            }
        };
        self.metrics.record(outcome);
        let destination = decision.destination();
        span.record("pick", decision.primary().endpoint());
        span.record("fallbacks", decision.fallbacks.len() as i64);
        span.in_scope(|| tracing::debug!(%destination, ?outcome, "routed"));
        Ok(Routed {
            destination,
            hold: decision.in_flight,
            headers: telemetry::propagation_headers(&span),
        })
    }

    fn rejected_by_protocol(&self, rejection: &Rejection) {
        if rejection.status == 413 {
            self.metrics.record(Outcome::BodyTooLarge);
        }
    }

    /// A fallback served the request: the in-flight count moves to it, so load reflects where
    /// requests really run.
    fn served(&self, hold: &mut InFlightGuard, endpoint: &str) {
        if hold.replica().endpoint() == endpoint {
            self.metrics.served(Served::Picked);
            return;
        }
        let picked = hold.replica().endpoint().to_owned();
        match self.scheduler.pool().snapshot().find(endpoint) {
            Some(replica) => {
                self.metrics.served(Served::OtherReplica);
                *hold = replica.start_request();
            }
            None => self.metrics.served(Served::Unknown),
        }
        tracing::debug!(%picked, served = %endpoint, "the proxy served a request elsewhere");
    }
}

#[cfg(test)]
mod tests;
