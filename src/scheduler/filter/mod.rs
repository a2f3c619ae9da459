//! Filter plugins: each removes candidates that must not (or should not) get the request.
//!
//! | type | removes | when none pass |
//! |---|---|---|
//! | `saturation` | replicas whose queue, KV cache or llmgw in-flight count is at its limit | 429 |
//! | `adapter_slots` | for a LoRA adapter's request, replicas whose adapter slots all hold other adapters | all stay |

use super::registry::{FilterPlugin, plugins};

plugins!(FilterPlugin: saturation, adapter_slots);
