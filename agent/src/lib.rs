//! `llmgw-agent`: the node daemon that keeps the routers' KV indexes true.
//!
//! Per vLLM engine on the node: [`zmq`] receives the engine's KV-event stream (SUB, sequence
//! tracking, replay over DEALER), [`wire`] decodes each batch, [`engine`] applies it to the
//! engine's [`mirror`] (checking block-0 hashes with [`hashcheck`]) and flushes coalesced
//! deltas to the [`uplink`]s, one gRPC stream per router ([`routers`] follows a DNS name to
//! every router). [`daemon`] wires these together with the admin server ([`metrics`], `/debug`); [`supervisor`] runs vLLM itself; [`tail`] prints a stream; [`config`] reads
//! flags, `LLMGW_AGENT_…` environment variables and YAML; [`capture`] reads recorded streams.

pub mod capture;
pub mod config;
pub mod daemon;
pub mod engine;
pub mod hashcheck;
pub mod health;
pub mod metrics;
pub mod mirror;
pub mod pods;
pub mod reload;
pub mod routers;
pub mod supervisor;
pub mod tail;
pub mod uplink;
pub mod wire;
pub mod zmq;
