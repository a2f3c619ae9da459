//! The fault soak, short: about a minute of steady load through Envoy while a replica, the
//! agent and a router are killed and restarted, a prefix cache is reset and a hostile client
//! claims the agent's node. Nothing but a restarted replica's in-flight requests may fail, and
//! every index must equal the replicas' truth again within 15 s of each fault.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::time::Duration;

use llmgw_integration::soak::{self, Fault, SoakConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_under_load_lose_nothing_and_every_index_recovers() {
    let report = soak::run(SoakConfig {
        rate: 15.0,
        fault_window: Duration::from_secs(8),
        converge_within: Duration::from_secs(15),
        settle: Duration::from_secs(3),
    })
    .await;
    eprintln!("{}", report.table());
    assert_eq!(report.faults.len(), Fault::ALL.len());
    assert!(
        report.faults.iter().all(|f| f.requests > 0),
        "every fault ran under load"
    );
    let missed = report.missed(4, 30.0);
    assert!(missed.is_empty(), "{missed:#?}\n{}", report.table());
}
