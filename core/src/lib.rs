//! llmgw-core: what the router and the agent share, and nothing else.
//!
//! * [`blockhash`]: vLLM's block hashes, bit for bit (chained SHA-256 over canonical CBOR, or
//!   xxHash), and the settings that select them.
//! * [`kv_event`]: the consumer side of an engine's KV events (`KvEventSink`, `Medium`).
//! * [`ids`]: replica, node and model names as types.
//! * [`telemetry`]: logging and OpenTelemetry set-up, and W3C trace-context propagation.
//! * [`kube_client`]: the Kubernetes client, built the same way by both.
//!
//! The crate holds no state shared between threads; every type here is plain data or a pure
//! function, and `telemetry::init` installs the process's global subscriber once.

pub mod blockhash;
pub mod ids;
pub mod kube_client;
pub mod kv_event;
pub mod telemetry;

#[doc(hidden)]
pub mod fixtures;
#[doc(hidden)]
pub mod test_ports;
