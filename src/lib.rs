//! llmgw: a KV-cache-aware router for fleets of vLLM replicas.
//!
//! The request path reads as the module list: `extproc` → `router` → `openai` → `scheduler`,
//! whose scorer plugins call `tokenize` → [`blockhash`] → `kvindex` (precise) or `prefix`
//! (approximate), → back to `extproc`; `models` holds each model's hash settings, read by the
//! `kv_cache` scorer and the `feed`; `pool` and `feed` sit beside the path, and `discovery` feeds
//! `pool` from Kubernetes. `docs/architecture.md` draws it.

pub mod admin;
pub mod app;
pub mod config;
pub mod cputime;
pub mod discovery;
pub mod duration;
pub mod extproc;
pub mod feed;
pub mod flowcontrol;
pub mod http_body;
pub mod kvindex;
pub mod metrics;
pub mod models;
pub mod openai;
pub mod peers;
pub mod pool;
pub mod prefix;
pub mod router;
pub mod scheduler;
pub mod tls;
pub mod tokenize;

#[cfg(test)]
mod testing;

// Shared with the agent through llmgw-core; re-exported so the router's paths name them as before.
pub use llmgw_core::{blockhash, ids, telemetry};

#[doc(hidden)]
pub use llmgw_core::fixtures;
