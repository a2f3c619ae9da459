//! Test support shared by the integration tests and `llmgw-sim`.
