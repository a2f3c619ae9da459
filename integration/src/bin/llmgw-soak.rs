//! `make soak`: the fault soak (see `llmgw_integration::soak`), printing its table; exits 1
//! when a goal was missed.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::time::Duration;

use clap::Parser;
use llmgw_integration::soak::{self, SoakConfig};

#[derive(Debug, Parser)]
#[command(
    about = "Envoy, two routers, the agent and four simulated replicas under steady load while faults run"
)]
struct Args {
    /// Requests per second through Envoy.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Seconds each fault's window lasts at least.
    #[arg(long, default_value_t = 30)]
    fault_window_secs: u64,
    /// Longest wait, in seconds, for the indexes to equal the replicas after a fault.
    #[arg(long, default_value_t = 20)]
    converge_within_secs: u64,
    /// Quiet seconds under load before the first fault and after the last.
    #[arg(long, default_value_t = 10)]
    settle_secs: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.rate > 0.0 && args.rate.is_finite(),
        "--rate must be positive"
    );
    let report = soak::run(SoakConfig {
        rate: args.rate,
        fault_window: Duration::from_secs(args.fault_window_secs),
        converge_within: Duration::from_secs(args.converge_within_secs),
        settle: Duration::from_secs(args.settle_secs),
    })
    .await;
    println!("{}", report.table());
    let missed = report.missed(4, 30.0);
    if missed.is_empty() {
        println!("goals: met");
        Ok(())
    } else {
        for m in &missed {
            println!("goal missed: {m}");
        }
        std::process::exit(1);
    }
}
