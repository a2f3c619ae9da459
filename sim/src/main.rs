//! `llmgw-sim`: a simulated vLLM replica (see the `llmgw_sim` library).

use clap::Parser as _;
use llmgw_sim::cli::Cli;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    // One simulated replica, one core: a current-thread runtime.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(llmgw_sim::run(cli))?;
    Ok(())
}
