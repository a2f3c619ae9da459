//! llmgw: a KV-cache-aware router for fleets of vLLM replicas.
//!
//! The request path reads as the module list: `extproc` → `openai` → `tokenize` →
//! [`blockhash`] → `kvindex` / `prefix` → `scheduler` → back to `extproc`, with `pool` and
//! `feed` beside it.

pub mod blockhash;
pub mod kvindex;

#[doc(hidden)]
pub mod fixtures;
