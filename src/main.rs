//! `llmgw-router`: the ext_proc routing service and its operator tools.
//!
//! `llmgw-router serve --replica tiny=127.0.0.1:8001 --replica tiny=127.0.0.1:8002` runs the
//! router; `llmgw-router serve --help` lists every option (each also an `LLMGW_*` variable).

mod hash_cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "llmgw-router",
    version,
    about = "KV-cache-aware router for vLLM fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the router: Envoy ext_proc on --grpc-addr, Prometheus and debug on --admin-addr.
    Serve(Box<llmgw::config::ServeArgs>),
    /// Print vLLM's block hashes for a JSON array of token ids read from stdin.
    Hash(hash_cmd::HashArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => match serve(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("llmgw-router: {error:#}");
                ExitCode::FAILURE
            }
        },
        Command::Hash(args) => hash_cmd::run(&args),
    }
}

fn serve(args: &llmgw::config::ServeArgs) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let settings = llmgw::config::Settings::resolve(args)?;
    if settings.replicas.is_empty() && settings.k8s_services.is_empty() {
        anyhow::bail!(
            "no replicas: pass --replica MODEL=IP:PORT, --config FILE or \
             --k8s-service MODEL=NAMESPACE/SERVICE:PORT"
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(llmgw::app::serve(settings, shutdown_signal(), |bound| {
        // Tests and scripts read this line to learn the ports (useful with port 0).
        let health = bound
            .grpc_health
            .map(|addr| format!(" grpc_health={addr}"))
            .unwrap_or_default();
        println!(
            "llmgw-router listening grpc={} admin={} feed={}{health}",
            bound.grpc, bound.admin, bound.feed
        );
    }))?;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
