//! Flow control: admission between parsing a request and scheduling it. A request whose model
//! has capacity (some ready replica below the `saturation` filter's limits,
//! [`crate::scheduler::Capacity`]) and no queue goes straight on; otherwise it waits in its
//! model's bounded queue (its `queue` module) until capacity returns, and is answered 429 at its
//! deadline (503 when no replica is ready then), never left hanging.
//!
//! * **Priority** comes from the request's inference objective ([`objectives`]): higher bands
//!   are dispatched first, and a full queue displaces the newest request of a lower band (the
//!   sheddable ones, priority < 0, first of all).
//! * **Fairness**: within a band, tenants (the fairness-id header) take turns.
//! * **Deadline**: the flow control's `queue_timeout`, shortened by the objective's and by the
//!   request's `x-llmgw-queue-timeout`.
//!
//! A dispatched request holds an [`Admission`] while the scheduler decides; the decision
//! raises the chosen replica's in-flight count, so capacity stays exact when it is released.
//! Should the decision still find every replica saturated (a concurrent decision took the
//! last slot), the request goes back to the front of its queue ([`FlowControl::readmit`]).
//!
//! It is the scheduling framework's admission stage: its saturation signal is the headroom the
//! profile's refusing filters report ([`crate::scheduler::Filter::headroom`]), so a new
//! saturation filter plugin gates dispatch too. Capacity is per model, not per proxy subset
//! hint: a request whose subset stays saturated while other replicas have room is dispatched
//! and readmitted until its deadline.
//!
//! # Concurrency model
//! One mutex over every model's queue and count of admissions, held for a queue operation (with
//! the model's headroom, read lock-free from the pool and only as far as needed) or one
//! dispatch pass, never across an await. Each waiting request is its own task's future,
//! woken by a oneshot (dispatched or displaced) or its deadline; dropping it (the client left)
//! takes it out of the queue. The dispatcher ([`FlowControl::run`]) is one task, woken when
//! an admission ends or a routed request finishes, and every `tick` for what the scrapes and
//! health checks change.

pub mod metrics;
pub mod objectives;
pub mod options;
mod queue;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use thiserror::Error;
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

pub use metrics::{FlowMetrics, FlowOutcome};
pub use objectives::{Objective, ObjectiveSet, ObjectiveSpec, Objectives};
pub use options::{FlowControlOptions, FlowOptionsError, FlowSettings};

use crate::scheduler::{Capacity, DecideError, Headroom};
use metrics::FlowLabels;
use queue::{ModelQueue, Pushed, Waiting};

/// Headers naming the request's inference objective: GIE's, then llm-d's.
pub const OBJECTIVE_HEADERS: [&str; 2] = [
    "x-gateway-inference-objective",
    "x-llm-d-inference-objective",
];
/// llm-d's fairness-id header, read after the configured one.
pub const LLMD_FAIRNESS_HEADER: &str = "x-llm-d-inference-fairness-id";
/// A request's own bound on its wait, as a duration (`500ms`, `2s`).
pub const QUEUE_TIMEOUT_HEADER: &str = "x-llmgw-queue-timeout";
/// The longest fairness id taken.
pub const MAX_FAIRNESS_ID_BYTES: usize = 256;

/// Why flow control answered a request itself.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FlowError {
    #[error("unknown inference objective {name:?} (known: {known})")]
    UnknownObjective { name: String, known: String },
    #[error("header {header}: {reason}")]
    BadHeader {
        header: &'static str,
        reason: String,
    },
    /// The model is unknown or has no ready replica: as a decision would say.
    #[error(transparent)]
    Decide(DecideError),
    #[error(
        "every replica serving {model:?} is saturated and {max_queued} requests of the same or higher priority are waiting"
    )]
    QueueFull { model: String, max_queued: usize },
    #[error("displaced from the queue for {model:?} by a request of higher priority")]
    Displaced { model: String },
    #[error("no replica serving {model:?} had capacity within the queue timeout ({timeout:?})")]
    Expired { model: String, timeout: Duration },
    #[error("no replica serving {model:?} became ready within the queue timeout ({timeout:?})")]
    ExpiredNoneReady { model: String, timeout: Duration },
}

/// Who a request is for flow control, read from its headers ([`FlowControl::classify`]).
#[derive(Debug, Clone)]
pub struct Flow {
    pub priority: i32,
    pub tenant: Arc<str>,
    pub timeout: Duration,
}

/// A request on its way through flow control.
#[derive(Debug, Clone)]
pub struct Ask {
    model: String,
    flow: Flow,
    labels: FlowLabels,
    arrived: Instant,
    deadline: Instant,
}

/// Held while a dispatched request is being scheduled; dropping it lets the next one go.
#[derive(Debug)]
pub struct Admission {
    flow: Arc<FlowControl>,
    model: String,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.flow.release(&self.model);
    }
}

#[derive(Debug)]
struct Ticket {
    reply: oneshot::Sender<Reply>,
    labels: FlowLabels,
    arrived: Instant,
}

#[derive(Debug)]
enum Reply {
    Dispatched(Admission),
    Displaced,
}

#[derive(Debug, Default)]
struct ModelState {
    queue: ModelQueue<Ticket>,
    /// Admissions whose decision has not ended: capacity they will take.
    admitted: u64,
}

fn fits(headroom: Headroom, admitted: u64) -> bool {
    match headroom {
        Headroom::Unlimited => true,
        Headroom::Requests(n) => admitted < n,
    }
}

/// The admission layer of one router.
#[derive(Debug)]
pub struct FlowControl {
    settings: FlowSettings,
    objectives: Arc<Objectives>,
    capacity: Capacity,
    metrics: FlowMetrics,
    models: Mutex<HashMap<String, ModelState>>,
    wake: Notify,
    next_id: AtomicU64,
}

impl FlowControl {
    pub fn new(
        settings: FlowSettings,
        objectives: Arc<Objectives>,
        capacity: Capacity,
        metrics: FlowMetrics,
    ) -> FlowControl {
        FlowControl {
            settings,
            objectives,
            capacity,
            metrics,
            models: Mutex::new(HashMap::new()),
            wake: Notify::new(),
            next_id: AtomicU64::new(1),
        }
    }

    pub fn metrics(&self) -> &FlowMetrics {
        &self.metrics
    }

    /// The request headers (lower-case) flow control reads.
    pub fn request_headers(&self) -> Vec<String> {
        let mut headers: Vec<String> = OBJECTIVE_HEADERS.iter().map(|h| h.to_string()).collect();
        headers.push(self.settings.fairness_header.clone());
        headers.push(LLMD_FAIRNESS_HEADER.to_owned());
        headers.push(QUEUE_TIMEOUT_HEADER.to_owned());
        headers.sort();
        headers.dedup();
        headers
    }

    /// Reads the objective, tenant and timeout of a request for `model` (`model_label`: its
    /// bounded metrics label). A malformed header or an unknown objective is an error, logged
    /// and counted.
    pub fn classify(
        &self,
        model: &str,
        model_label: &str,
        headers: &[(String, String)],
    ) -> Result<Ask, FlowError> {
        let header = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        let objective = match OBJECTIVE_HEADERS.iter().find_map(|h| header(h)) {
            None => None,
            Some(name) => {
                let set = self.objectives.current();
                let Some(objective) = set.get(name) else {
                    self.metrics.bad_request("unknown_objective");
                    let known = set.names().collect::<Vec<_>>().join(", ");
                    tracing::info!(objective = %name, "request names an unknown inference objective");
                    return Err(FlowError::UnknownObjective {
                        name: name.to_owned(),
                        known: if known.is_empty() {
                            "none".into()
                        } else {
                            known
                        },
                    });
                };
                Some(objective)
            }
        };
        let tenant = header(&self.settings.fairness_header)
            .or_else(|| header(LLMD_FAIRNESS_HEADER))
            .unwrap_or("");
        if tenant.len() > MAX_FAIRNESS_ID_BYTES {
            self.metrics.bad_request("fairness_id");
            tracing::info!(bytes = tenant.len(), "request's fairness id is too long");
            return Err(FlowError::BadHeader {
                header: "fairness id",
                reason: format!(
                    "{} bytes, more than the {MAX_FAIRNESS_ID_BYTES} allowed",
                    tenant.len()
                ),
            });
        }
        let mut timeout = objective
            .and_then(|o| o.queue_timeout)
            .unwrap_or(self.settings.queue_timeout)
            .min(self.settings.queue_timeout);
        if let Some(value) = header(QUEUE_TIMEOUT_HEADER) {
            let asked = parse_timeout(value).inspect_err(|_| {
                self.metrics.bad_request("queue_timeout");
                tracing::info!(value = %value.escape_debug(), "request's queue timeout is malformed");
            })?;
            timeout = timeout.min(asked);
        }
        let priority = objective.map_or(self.settings.default_priority, |o| o.priority);
        let tenant: Arc<str> = Arc::from(tenant);
        let arrived = Instant::now();
        Ok(Ask {
            model: model.to_owned(),
            labels: FlowLabels {
                fairness_id: self.metrics.tenant_label(&tenant),
                priority: priority.to_string(),
                model_name: model_label.to_owned(),
            },
            flow: Flow {
                priority,
                tenant,
                timeout,
            },
            arrived,
            deadline: arrived + timeout,
        })
    }

    /// Lets the request go on now if its model has capacity and nothing waits for it, else
    /// queues it until it is dispatched, displaced or out of time.
    pub async fn admit(self: &Arc<Self>, ask: &Ask) -> Result<Admission, FlowError> {
        self.wait(ask, false).await
    }

    /// Takes back an admission whose decision found every replica saturated after all, and
    /// queues the request again, first in line, until its original deadline.
    pub async fn readmit(
        self: &Arc<Self>,
        ask: &Ask,
        lost: Admission,
    ) -> Result<Admission, FlowError> {
        drop(lost);
        self.wait(ask, true).await
    }

    async fn wait(self: &Arc<Self>, ask: &Ask, again: bool) -> Result<Admission, FlowError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, mut answer) = oneshot::channel();
        let displaced = {
            let mut models = self.models.lock();
            let admitted = models.get(&ask.model).map_or(0, |s| s.admitted);
            // Before the model gets a state: a model no replica serves must not get one.
            let headroom = self
                .capacity
                .headroom(&ask.model, admitted.saturating_add(1))
                .map_err(FlowError::Decide)?;
            let state = match models.get_mut(&ask.model) {
                Some(state) => state,
                None => models.entry(ask.model.clone()).or_default(),
            };
            if !again && state.queue.is_empty() && fits(headroom, state.admitted) {
                state.admitted += 1;
                drop(models);
                self.metrics
                    .outcome(&ask.labels, FlowOutcome::Admitted, 0.0);
                return Ok(Admission {
                    flow: Arc::clone(self),
                    model: ask.model.clone(),
                });
            }
            if Instant::now() >= ask.deadline {
                drop(models);
                self.metrics.outcome(
                    &ask.labels,
                    FlowOutcome::Expired,
                    ask.arrived.elapsed().as_secs_f64(),
                );
                return Err(self.expire(ask));
            }
            let waiting = Waiting {
                id,
                priority: ask.flow.priority,
                tenant: Arc::clone(&ask.flow.tenant),
                item: Ticket {
                    reply,
                    labels: ask.labels.clone(),
                    arrived: ask.arrived,
                },
            };
            let displaced = if again {
                state.queue.push_front(waiting);
                None
            } else {
                match state.queue.push(waiting, self.settings.max_queued) {
                    Pushed::Queued => None,
                    Pushed::Displaced(displaced) => Some(displaced),
                    Pushed::Refused(_) => {
                        drop(models);
                        self.metrics.outcome(
                            &ask.labels,
                            FlowOutcome::QueueFull,
                            ask.arrived.elapsed().as_secs_f64(),
                        );
                        tracing::debug!(model = %ask.model, "queue full; request refused");
                        return Err(FlowError::QueueFull {
                            model: ask.model.clone(),
                            max_queued: self.settings.max_queued,
                        });
                    }
                }
            };
            self.metrics.queued(&ask.labels);
            displaced
        };
        if let Some(displaced) = displaced {
            let ticket = displaced.item;
            self.metrics.left_queue(&ticket.labels);
            self.metrics.outcome(
                &ticket.labels,
                FlowOutcome::Displaced,
                ticket.arrived.elapsed().as_secs_f64(),
            );
            // A displaced request whose client already left needs no answer.
            let _ = ticket.reply.send(Reply::Displaced);
        }
        // Capacity may have returned since the last dispatch pass.
        self.wake.notify_one();

        let queued = Queued {
            flow: self,
            ask,
            id,
            armed: true,
        };
        let answered = tokio::select! {
            reply = &mut answer => Some(reply),
            () = tokio::time::sleep_until(ask.deadline) => None,
        };
        let reply = match answered {
            Some(reply) => reply,
            None if queued.take_out(FlowOutcome::Expired) => {
                queued.disarm();
                return Err(self.expire(ask));
            }
            // Answered as the deadline passed: the answer is in the channel.
            None => answer.await,
        };
        queued.disarm();
        match reply {
            Ok(Reply::Dispatched(admission)) => Ok(admission),
            Ok(Reply::Displaced) => Err(FlowError::Displaced {
                model: ask.model.clone(),
            }),
            // The dispatcher never drops a ticket unanswered; were it to, time out.
            Err(_) => Err(self.expire(ask)),
        }
    }

    /// The error of a request out of time (already counted when it was queued).
    fn expire(&self, ask: &Ask) -> FlowError {
        let none_ready = matches!(
            self.capacity.headroom(&ask.model, 1),
            Err(DecideError::NoReadyReplica | DecideError::UnknownModel(_))
        );
        let (model, timeout) = (ask.model.clone(), ask.flow.timeout);
        if none_ready {
            FlowError::ExpiredNoneReady { model, timeout }
        } else {
            FlowError::Expired { model, timeout }
        }
    }

    fn release(&self, model: &str) {
        if let Some(state) = self.models.lock().get_mut(model) {
            state.admitted = state.admitted.saturating_sub(1);
        }
        self.wake.notify_one();
    }

    /// A routed request ended: its replica has room again.
    pub fn request_finished(&self) {
        self.wake.notify_one();
    }

    /// Dispatches queued requests while their models have capacity: the dispatcher task.
    pub async fn run(self: Arc<Self>, tick: Duration) {
        loop {
            tokio::select! {
                () = self.wake.notified() => {}
                () = tokio::time::sleep(tick) => {}
            }
            self.dispatch();
        }
    }

    /// One dispatch pass over every model with requests waiting.
    pub fn dispatch(self: &Arc<Self>) {
        let mut undelivered = Vec::new();
        let mut models = self.models.lock();
        for (model, state) in models.iter_mut() {
            if state.queue.is_empty() {
                continue;
            }
            // No ready replica: the requests wait for one, or for their deadline.
            let wanted = state.admitted.saturating_add(state.queue.len() as u64);
            let Ok(headroom) = self.capacity.headroom(model, wanted) else {
                continue;
            };
            while fits(headroom, state.admitted) {
                let Some(waiting) = state.queue.pop() else {
                    break;
                };
                state.admitted += 1;
                let ticket = waiting.item;
                self.metrics.left_queue(&ticket.labels);
                let admission = Admission {
                    flow: Arc::clone(self),
                    model: model.clone(),
                };
                let waited = ticket.arrived.elapsed().as_secs_f64();
                match ticket.reply.send(Reply::Dispatched(admission)) {
                    Ok(()) => self
                        .metrics
                        .outcome(&ticket.labels, FlowOutcome::Dispatched, waited),
                    Err(reply) => {
                        self.metrics
                            .outcome(&ticket.labels, FlowOutcome::Cancelled, waited);
                        // Its admission takes the lock when dropped: after this pass.
                        undelivered.push(reply);
                    }
                }
            }
        }
        drop(models);
        drop(undelivered);
    }

    /// What `/debug` shows: the settings, the objectives in force and what waits per model.
    pub fn view(&self) -> FlowView {
        let objectives = self.objectives.current();
        FlowView {
            queue_timeout_ms: self.settings.queue_timeout.as_millis(),
            max_queued: self.settings.max_queued,
            default_priority: self.settings.default_priority,
            objectives: objectives
                .names()
                .filter_map(|name| Some((name.to_owned(), objectives.get(name)?.priority)))
                .collect(),
            queued: self
                .models
                .lock()
                .iter()
                .filter(|(_, s)| !s.queue.is_empty() || s.admitted > 0)
                .map(|(model, s)| {
                    (
                        model.clone(),
                        ModelView {
                            queued: s.queue.len(),
                            deciding: s.admitted,
                        },
                    )
                })
                .collect(),
        }
    }

    /// Requests waiting for `model` now.
    pub fn queued(&self, model: &str) -> usize {
        self.models.lock().get(model).map_or(0, |s| s.queue.len())
    }
}

/// Flow control as `/debug` shows it.
#[derive(Debug, serde::Serialize)]
pub struct FlowView {
    pub queue_timeout_ms: u128,
    pub max_queued: usize,
    pub default_priority: i32,
    /// Objective name → priority.
    pub objectives: std::collections::BTreeMap<String, i32>,
    /// Models with requests waiting or being decided.
    pub queued: std::collections::BTreeMap<String, ModelView>,
}

/// One model's queue in [`FlowView`].
#[derive(Debug, serde::Serialize)]
pub struct ModelView {
    pub queued: usize,
    /// Admitted requests whose decision has not ended.
    pub deciding: u64,
}

/// A request in a queue; dropped before it is answered (its client left), it takes itself out.
struct Queued<'a> {
    flow: &'a FlowControl,
    ask: &'a Ask,
    id: u64,
    armed: bool,
}

impl Queued<'_> {
    /// Takes the request out of its queue, counting `outcome`; false when it is not there
    /// (already answered).
    fn take_out(&self, outcome: FlowOutcome) -> bool {
        let taken = self
            .flow
            .models
            .lock()
            .get_mut(&self.ask.model)
            .and_then(|s| {
                s.queue
                    .remove(self.id, self.ask.flow.priority, &self.ask.flow.tenant)
            });
        let Some(waiting) = taken else {
            return false;
        };
        let ticket = waiting.item;
        self.flow.metrics.left_queue(&ticket.labels);
        self.flow.metrics.outcome(
            &ticket.labels,
            outcome,
            ticket.arrived.elapsed().as_secs_f64(),
        );
        true
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.take_out(FlowOutcome::Cancelled);
        }
    }
}

/// `x-llmgw-queue-timeout`: a duration such as `500ms` or `2s`; a negative one (a deadline
/// already past) or any other text is an error naming the header.
fn parse_timeout(value: &str) -> Result<Duration, FlowError> {
    let trimmed = value.trim();
    let reason = if trimmed.starts_with('-') {
        format!("{trimmed:?} is negative: the deadline would already have passed")
    } else {
        match crate::duration::parse(trimmed) {
            Ok(timeout) => return Ok(timeout),
            Err(error) => error.to_string(),
        }
    };
    Err(FlowError::BadHeader {
        header: QUEUE_TIMEOUT_HEADER,
        reason,
    })
}

#[cfg(test)]
mod tests;
