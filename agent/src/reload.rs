//! `--config` read again while the agent runs: when the file's bytes change, its `engines`
//! (resolved as at start-up: the flags' topic over the file's) become the agent's engines
//! through [`Agent::set_engines`]. Only the engines change; other settings apply at the next
//! start. A version that does not read or parse is logged once, counted in
//! `llmgw_agent_engine_source_errors_total`, and leaves the last good engines in place.
//!
//! # Concurrency model
//! One task, reading the file every `interval`. Polled rather than watched: a Kubernetes
//! ConfigMap volume changes the file by swapping a symlink above it, which a watch on the
//! file does not see; a poll sees every version.

use std::sync::Arc;

use crate::config::{AgentArgs, FileReload};
use crate::daemon::Agent;

/// Reloads the engines of `reload.path` until dropped.
pub async fn run(agent: Arc<Agent>, args: AgentArgs, reload: FileReload) {
    let path = reload.path.display().to_string();
    let mut ticker = tokio::time::interval(reload.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The version last applied (`None`: read it at the first tick, which changes nothing when
    // it is the one start-up read).
    let mut applied: Option<Vec<u8>> = None;
    let mut unreadable = false;
    loop {
        ticker.tick().await;
        let bytes = match tokio::fs::read(&reload.path).await {
            Ok(bytes) => bytes,
            Err(error) => {
                if !unreadable {
                    agent.metrics.engine_source_errors.inc();
                    tracing::warn!(path, %error, "cannot read the config file; keeping the last engines");
                    unreadable = true;
                }
                continue;
            }
        };
        unreadable = false;
        if applied.as_deref() == Some(bytes.as_slice()) {
            continue;
        }
        let engines = std::str::from_utf8(&bytes)
            .map_err(|e| format!("not UTF-8: {e}"))
            .and_then(|text| {
                args.engines_in_file(&reload.path, text)
                    .map_err(|e| e.to_string())
            });
        applied = Some(bytes);
        match engines {
            Ok(engines) => {
                let changes = agent.set_engines(engines).await;
                if !changes.is_empty() || !changes.failed.is_empty() {
                    tracing::info!(path, "engines reloaded from the config file");
                }
            }
            Err(error) => {
                agent.metrics.engine_source_errors.inc();
                tracing::warn!(path, %error, "cannot use the changed config file; keeping the last engines");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::daemon::engines_become;

    #[tokio::test]
    async fn a_changed_file_changes_the_engines_and_a_broken_one_keeps_the_last() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agent.yaml");
        let engines = |replicas: &[&str]| -> String {
            let mut text = String::from("engines:\n");
            for (i, r) in replicas.iter().enumerate() {
                text.push_str(&format!(
                    "- {{replica: \"{r}\", endpoint: \"tcp://127.0.0.1:{}\"}}\n",
                    47000 + i
                ));
            }
            text
        };
        std::fs::write(&path, engines(&["10.0.0.1:8000"])).expect("write");
        let args = AgentArgs {
            config: Some(path.clone()),
            reload_interval_ms: Some(20),
            stale_after_ms: Some(0),
            ..AgentArgs::default()
        };
        let config = args.resolve().expect("config");
        let reload = config.reload.clone().expect("the file is reloaded");
        let agent = Arc::new(Agent::start(config).await.expect("agent"));
        let mut membership = agent.membership();
        let task = tokio::spawn(run(Arc::clone(&agent), args, reload));
        engines_become(&agent, &["10.0.0.1:8000"]).await;
        let first = agent.engine("10.0.0.1:8000").expect("engine");

        std::fs::write(&path, engines(&["10.0.0.1:8000", "10.0.0.2:8000"])).expect("write");
        engines_become(&agent, &["10.0.0.1:8000", "10.0.0.2:8000"]).await;
        assert!(
            membership.has_changed().expect("agent alive"),
            "uplinks are told"
        );
        membership.mark_unchanged();
        let kept = agent.engine("10.0.0.1:8000").expect("engine");
        assert!(
            Arc::ptr_eq(&first, &kept),
            "an unchanged engine keeps its mirror"
        );

        // Broken YAML: counted, the engines stay.
        std::fs::write(&path, "engines: [{replica: \"10.0.0.3:8000\"").expect("write");
        for _ in 0..500 {
            if agent.metrics.engine_source_errors.get() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(agent.metrics.engine_source_errors.get(), 1);
        assert_eq!(agent.engines().len(), 2);
        assert!(!membership.has_changed().expect("agent alive"));

        // A valid file again: 10.0.0.1 goes, 10.0.0.3 comes.
        std::fs::write(&path, engines(&["10.0.0.3:8000", "10.0.0.2:8000"])).expect("write");
        engines_become(&agent, &["10.0.0.2:8000", "10.0.0.3:8000"]).await;
        assert_eq!(agent.metrics.engines.get(), 2);
        task.abort();
    }
}
