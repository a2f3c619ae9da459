//! llmgw: a KV-cache-aware router for fleets of vLLM replicas.
//!
//! The request path reads as the module list: `extproc` → `openai` → `tokenize` →
//! [`blockhash`] → `kvindex` / `prefix` → `scheduler` → back to `extproc`, with `pool` and
//! `feed` beside it, and `discovery` feeding `pool` from Kubernetes.

pub mod admin;
pub mod affinity;
pub mod app;
pub mod blockhash;
pub mod config;
pub mod cputime;
pub mod discovery;
pub mod extproc;
pub mod feed;
pub mod kvindex;
pub mod metrics;
pub mod openai;
pub mod pool;
pub mod prefix;
pub mod router;
pub mod scheduler;
pub mod telemetry;
pub mod tokenize;

#[doc(hidden)]
pub mod fixtures;
