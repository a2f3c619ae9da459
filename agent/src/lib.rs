//! `llmgw-agent`: the node daemon that keeps the routers' KV indexes true.
//!
//! Per vLLM engine on the node it subscribes to the engine's KV-event stream, decodes it
//! ([`wire`]), and mirrors the engine's cached blocks.

pub mod capture;
pub mod engine;
pub mod hashcheck;
pub mod metrics;
pub mod mirror;
pub mod wire;
pub mod zmq;
