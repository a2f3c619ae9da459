//! `llmgw-bench-scale` at toy scale: two synthetic engines, each behind its own real
//! `llmgw-agent`, and a real `llmgw-router` (debug builds, from `cargo build --workspace
//! --bins`). Checks what the benchmark's numbers rest on: the router's index holds exactly what
//! the generator published (shared system prompts counted once), before and after the steady
//! event window, and every routing request went to the one replica holding its whole prompt,
//! decided by the index. No timing is judged.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::time::Duration;

use llmgw_bench::scale::{self, ScaleConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_holds_what_the_generator_published_and_routes_by_it() {
    let config = ScaleConfig {
        replicas: 2,
        engines_per_agent: 1,
        blocks_per_replica: 400,
        // Four system prompts: both replicas use all four, so blocks are shared.
        prefixes: 4,
        event_rate: 200.0,
        quiet: Duration::from_millis(500),
        steady: Duration::from_secs(1),
        lookups: 20,
        lookup_rate: 0.0,
        converge_timeout: Duration::from_secs(30),
        log_dir: llmgw_integration::repo_root()
            .join("target")
            .join("bench-scale-test"),
        ..ScaleConfig::default()
    };
    let report = scale::run(&config).await.expect("bench run");
    println!("{}", scale::markdown_table(std::slice::from_ref(&report)));

    assert_eq!(report.agents, 2);
    assert_eq!(report.replicas_matching_after_fill, 2, "{report:?}");
    assert_eq!(report.index_pairs, report.published_pairs, "{report:?}");
    assert_eq!(
        report.index_distinct, report.published_distinct,
        "{report:?}"
    );
    // 2 × (marker + 4 prompts of 32 blocks + conversations), prompts shared.
    assert!(report.published_pairs > 700, "{report:?}");
    assert_eq!(
        report.published_pairs - report.published_distinct,
        4 * 32,
        "the four shared system prompts count once: {report:?}"
    );
    assert_eq!(report.replicas_matching_after_steady, 2, "{report:?}");
    assert!(report.steady_block_events_per_s > 0.0, "{report:?}");
    assert_eq!(report.lookups, 20);
    assert_eq!(report.routed_to_holder, 20, "{report:?}");
    assert_eq!(report.kv_hits, 20, "{report:?}");
    assert!(report.router_rss_mib > 0.0 && report.agent_rss_mib_total > 0.0);
}
