//! Where the shared test data produced by vLLM's own code lives (`../shared/fixtures` beside the
//! repository, or `$LLMGW_FIXTURES`). Tests read it; a missing file fails the test loudly.

use std::path::PathBuf;

/// The fixtures directory.
pub fn dir() -> PathBuf {
    match std::env::var_os("LLMGW_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures"),
    }
}

/// Reads one fixture file as text, panicking with the path when it is missing (test-only).
pub fn read(name: &str) -> String {
    let path = dir().join(name);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("fixture {} unreadable: {e}", path.display()))
}
