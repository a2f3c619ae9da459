//! The routing policy behind the ext_proc protocol: parse the body ([`crate::openai`]), admit it
//! ([`crate::flowcontrol`]: it may wait for capacity), let the [`Scheduler`] choose, and turn
//! every failure into the HTTP status a client should see.
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
use crate::extproc::{Exchange, Picker, Rejection, Routed, RoutingRequest};
use crate::flowcontrol::{Admission, Ask, FlowControl, FlowError};
use crate::metrics::{Finished, Metrics, Outcome, RunningRequest, Served, error_code};
use crate::openai::{EndpointKind, ParsedRequest, parse_request, usage_in_tail};
use crate::pool::InFlightGuard;
use crate::scheduler::{DecideError, Decision, Scheduler, Scope};
use crate::telemetry::{self, TraceHeaders};

/// The response header naming the endpoint that served, for the Gateway API Inference
/// Extension conformance suite (with `--allow-test-endpoint-selection` only).
pub const CONFORMANCE_SERVED_HEADER: &str = "x-conformance-test-served-endpoint";
/// The request header the conformance suite's echo backend turns into a response header
/// (`NAME:VALUE`); lwepp sets it to name the pick.
pub const ECHO_SET_HEADER: &str = "x-echo-set-header";

/// Parses, schedules and accounts.
#[derive(Debug)]
pub struct Router {
    scheduler: Scheduler,
    metrics: Arc<Metrics>,
    allow_test_selection: bool,
    /// `None`: flow control is off, and a saturated pool answers 429 at once.
    flow: Option<Arc<FlowControl>>,
}

impl Router {
    /// `allow_test_selection` turns on the conformance suite's hooks: its
    /// `test-epp-endpoint-selection` header (which lets any client choose among the pool's
    /// replicas) and the served endpoint echoed in [`CONFORMANCE_SERVED_HEADER`].
    pub fn new(scheduler: Scheduler, metrics: Arc<Metrics>, allow_test_selection: bool) -> Router {
        Router {
            scheduler,
            metrics,
            allow_test_selection,
            flow: None,
        }
    }

    /// Requests wait in `flow`'s queues while their model is saturated.
    pub fn with_flow_control(mut self, flow: Arc<FlowControl>) -> Router {
        self.flow = Some(flow);
        self
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Request headers (lower-case) the scheduler's plugins and flow control read, for the
    /// protocol layer to pass on.
    pub fn request_headers(&self) -> Vec<String> {
        let mut headers = self.scheduler.request_headers().to_vec();
        if let Some(flow) = &self.flow {
            headers.extend(flow.request_headers());
        }
        headers.sort();
        headers.dedup();
        headers
    }

    /// Decides, leaving the request's model in `model` once its body parsed.
    async fn route(
        &self,
        request: RoutingRequest,
        span: &tracing::Span,
        model: &mut Option<String>,
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
                tracing::info!(endpoint = kind.as_str(), %error, "request refused: 400, unparsable body");
                Rejection::new(400, "invalid_request_error", error.to_string())
            })?;
        span.record("model", parsed.model.as_str());
        *model = Some(parsed.model.clone());
        let mut admitted = self.admit(&parsed, &request.headers).await?;
        let decision = loop {
            let decided = self
                .scheduler
                .decide(&parsed, &request.headers, scope)
                .await;
            match (decided, admitted.take()) {
                // A concurrent decision took the capacity this one was admitted for.
                (Err(DecideError::AllSaturated), Some(lost)) => {
                    admitted = Some(self.readmit(lost).await?);
                }
                (decided, _) => break decided.map_err(|e| self.refuse(e))?,
            }
        };
        if decision.imbalance_guard_fired {
            self.metrics.imbalance_guard_fired();
        }
        if decision.prefix_unavailable {
            self.metrics.prefix_unavailable();
        }
        Ok((decision, Outcome::Routed))
    }

    /// `test-epp-endpoint-selection: ENDPOINT[,ENDPOINT]`, each `ip:port` or a bare IP (every
    /// replica at that IP, lowest port first: a pod's data-parallel ranks), restricted to the
    /// pool's replicas, in the order given.
    fn test_selection(&self, selection: &str) -> Result<(Decision, Outcome), Rejection> {
        let snapshot = self.scheduler.pool().snapshot();
        let mut chosen: Vec<&Arc<crate::pool::Replica>> = Vec::new();
        for endpoint in selection.split(',').map(str::trim) {
            let found = match endpoint.parse::<std::net::IpAddr>() {
                Ok(ip) => snapshot.at_ip(ip),
                Err(_) => snapshot.find(endpoint).into_iter().collect(),
            };
            for replica in found {
                if !chosen.iter().any(|c| Arc::ptr_eq(c, replica)) {
                    chosen.push(replica);
                }
            }
        }
        let mut chosen = chosen.into_iter();
        let Some(primary) = chosen.next() else {
            return Err(self.refuse(DecideError::EmptySubset));
        };
        let decision = Decision {
            in_flight: primary.start_request(),
            fallbacks: chosen.cloned().collect(),
            imbalance_guard_fired: false,
            prefix_unavailable: false,
            filtered_out: Vec::new(),
        };
        Ok((decision, Outcome::RoutedTestSelection))
    }

    /// Lets the request through flow control (it may wait there for capacity); `None` when
    /// flow control is off.
    async fn admit(
        &self,
        parsed: &ParsedRequest,
        headers: &[(String, String)],
    ) -> Result<Option<Admitted<'_>>, Rejection> {
        let Some(flow) = &self.flow else {
            return Ok(None);
        };
        let model_label = self.metrics.model_label(&parsed.model);
        let ask = flow
            .classify(&parsed.model, model_label, headers)
            .map_err(|e| self.refuse_flow(e))?;
        let admission = flow
            .admit(&ask)
            .instrument(tracing::debug_span!("queue"))
            .await
            .map_err(|e| self.refuse_flow(e))?;
        Ok(Some(Admitted {
            flow,
            ask,
            admission,
        }))
    }

    /// Queues a request again whose decision found every replica taken after all.
    async fn readmit<'a>(&self, lost: Admitted<'a>) -> Result<Admitted<'a>, Rejection> {
        let Admitted {
            flow,
            ask,
            admission,
        } = lost;
        let admission = flow
            .readmit(&ask, admission)
            .instrument(tracing::debug_span!("queue"))
            .await
            .map_err(|e| self.refuse_flow(e))?;
        Ok(Admitted {
            flow,
            ask,
            admission,
        })
    }

    /// Flow control's answers: a malformed header or unknown objective is the client's error
    /// (400); a queue that is full, a displaced request and a deadline passed are 429, or 503
    /// when no replica was ready at the deadline.
    fn refuse_flow(&self, error: FlowError) -> Rejection {
        if let FlowError::Decide(error) = error {
            return self.refuse(error);
        }
        let (status, error_type, outcome) = match &error {
            // `Decide` was answered above.
            FlowError::Decide(_)
            | FlowError::UnknownObjective { .. }
            | FlowError::BadHeader { .. } => (400, "invalid_request_error", Outcome::BadRequest),
            FlowError::QueueFull { .. }
            | FlowError::Displaced { .. }
            | FlowError::Expired { .. } => (429, "rate_limit_error", Outcome::Saturated),
            FlowError::ExpiredNoneReady { .. } => {
                (503, "service_unavailable_error", Outcome::NoReadyReplica)
            }
        };
        self.metrics.record(outcome);
        Rejection::new(status, error_type, error.to_string())
    }

    fn refuse(&self, error: DecideError) -> Rejection {
        let (status, error_type, outcome) = match &error {
            DecideError::UnknownModel(_) => (404, "not_found_error", Outcome::UnknownModel),
            DecideError::NoReadyReplica | DecideError::EmptySubset => {
                (503, "service_unavailable_error", Outcome::NoReadyReplica)
            }
            DecideError::AllSaturated => (429, "rate_limit_error", Outcome::Saturated),
            DecideError::BadRequest(_) => (400, "invalid_request_error", Outcome::BadRequest),
        };
        self.metrics.record(outcome);
        // The client's mistakes name what was wrong; capacity refusals are counted, not logged
        // one by one (an overload would flood the log).
        if status < 429 {
            tracing::info!(status, %error, "request refused");
        } else {
            tracing::debug!(status, %error, "request refused");
        }
        Rejection::new(status, error_type, error.to_string())
    }
}

/// A request flow control let through, until its decision ends.
struct Admitted<'a> {
    flow: &'a Arc<FlowControl>,
    ask: Ask,
    /// Dropped when the decision ends, so the next request may go.
    admission: Admission,
}

/// What a routed request holds until its ext_proc stream ends: its place in the replica's
/// in-flight count and, when its model is known, in GIE's running requests.
#[derive(Debug)]
pub struct RoutedRequest {
    pub in_flight: InFlightGuard,
    running: Option<RunningRequest>,
}

impl Picker for Router {
    type Hold = RoutedRequest;

    async fn pick(&self, request: RoutingRequest) -> Result<Routed<RoutedRequest>, Rejection> {
        let span = tracing::debug_span!(
            "route",
            model = Empty,
            prompt_blocks = Empty,
            matched_blocks = Empty,
            matched_share = Empty,
            tier = Empty,
            tier_reason = Empty,
            prefix_outcome = Empty,
            placement = Empty,
            filtered_out = Empty,
            scores = Empty,
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
        let body_bytes = request.body.as_ref().map_or(0, |b| b.len());
        let path = request.path.clone();
        let mut model = None;
        let (result, cpu) = CpuTimed::new(
            self.route(request, &span, &mut model)
                .instrument(span.clone()),
        )
        .await;
        self.metrics.observe_pick(started, cpu);
        let model = model.as_deref().map(|m| self.metrics.model_label(m));
        let objective = self.metrics.objective();
        if let Some(model) = model {
            objective.request(model, body_bytes);
        }
        let (decision, outcome) = match result {
            Ok(routed) => routed,
            Err(rejection) => {
                span.record("rejected_status", i64::from(rejection.status));
                span.record("otel.status_code", "ERROR");
                if let Some(model) = model {
                    objective.error(model, error_code(rejection.status));
                }
                return Err(rejection.for_path(&path));
            }
        };
        self.metrics.record(outcome);
        if !decision.filtered_out.is_empty() {
            span.record(
                "filtered_out",
                tracing::field::display(decision.filtered_out_trace()),
            );
            for out in &decision.filtered_out {
                self.metrics.filtered_out(&out.filter);
            }
        }
        let destination = decision.destination();
        span.record("pick", decision.primary().endpoint());
        span.record("fallbacks", decision.fallbacks.len() as i64);
        span.in_scope(|| tracing::debug!(%destination, ?outcome, "routed"));
        let mut headers = telemetry::propagation_headers(&span);
        if self.allow_test_selection {
            // The conformance suite's echo backend copies this into its response.
            headers.push((
                ECHO_SET_HEADER,
                format!(
                    "{CONFORMANCE_SERVED_HEADER}:{}",
                    decision.primary().endpoint()
                ),
            ));
        }
        Ok(Routed {
            destination,
            hold: RoutedRequest {
                in_flight: decision.in_flight,
                running: model.map(|m| objective.start(m)),
            },
            headers,
        })
    }

    fn rejected_by_protocol(&self, rejection: &Rejection) {
        if rejection.status == 413 {
            self.metrics.record(Outcome::BodyTooLarge);
        }
    }

    /// With the conformance hooks on, the endpoint that served (as the proxy reported it, else
    /// the pick).
    fn response_headers(&self, hold: &RoutedRequest) -> Vec<(&'static str, String)> {
        if !self.allow_test_selection {
            return Vec::new();
        }
        let served = hold.in_flight.replica().endpoint();
        vec![(CONFORMANCE_SERVED_HEADER, served.to_owned())]
    }

    /// GIE's per-request metrics (duration, response size, the usage's token counts, the
    /// upstream's error status) and the cached tokens the engine reported, for its drift check.
    fn finished(&self, hold: RoutedRequest, mut exchange: Exchange) {
        let RoutedRequest { in_flight, running } = hold;
        // The replica that served: the pick, or where the proxy says a fallback went.
        let served = Arc::clone(in_flight.replica());
        // Its replica has room again: a queued request may go (before any parsing below).
        drop(in_flight);
        if let Some(flow) = &self.flow {
            flow.request_finished();
        }
        let usage = exchange
            .complete
            .then(|| usage_in_tail(exchange.response_tail()))
            .flatten();
        // The engine's own count of what it found cached, for that replica's drift check.
        if let Some(usage) = usage
            && let Some(cached) = usage.cached_tokens
        {
            served.drift().reported(cached, usage.prompt_tokens);
        }
        let Some(running) = running else {
            return;
        };
        self.metrics.objective().finish(
            running,
            Finished {
                elapsed: exchange.received.elapsed(),
                status: exchange.status,
                response_bytes: exchange.response_bytes,
                tokens: usage.map(|u| (u.prompt_tokens, u.completion_tokens)),
            },
        );
    }

    /// A fallback served the request: the in-flight count moves to it, so load reflects where
    /// requests really run.
    fn served(&self, hold: &mut RoutedRequest, endpoint: &str) {
        let in_flight = &mut hold.in_flight;
        if in_flight.replica().endpoint() == endpoint {
            self.metrics.served(Served::Picked);
            return;
        }
        let picked = in_flight.replica().endpoint().to_owned();
        match self.scheduler.pool().snapshot().find(endpoint) {
            Some(replica) => {
                self.metrics.served(Served::OtherReplica);
                *in_flight = replica.start_request();
            }
            None => self.metrics.served(Served::Unknown),
        }
        tracing::debug!(%picked, served = %endpoint, "the proxy served a request elsewhere");
    }
}

#[cfg(test)]
mod tests;
