//! `llmgw-router`: the ext_proc routing service and its operator tools.
//!
//! `llmgw-router serve --replica tiny=127.0.0.1:8001 --replica tiny=127.0.0.1:8002` runs the
//! router; `llmgw-router serve --help` lists every option (each also an `LLMGW_*` variable).

mod hash_cmd;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use llmgw::telemetry::{self, LogFormat, TelemetryConfig};

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
    Serve(Box<ServeCommand>),
    /// Print vLLM's block hashes for a JSON array of token ids read from stdin.
    Hash(hash_cmd::HashArgs),
}

#[derive(Args)]
struct ServeCommand {
    #[command(flatten)]
    serve: llmgw::config::ServeArgs,
    #[command(flatten)]
    telemetry: TelemetryArgs,
    /// Threads that run the router's async work (default: one per core). 1 runs everything on
    /// one thread (tokio's current-thread scheduler): no wake-ups between threads, so less CPU
    /// per request for a router that needs less than a core; more threads for more requests
    /// per second than one core can route.
    #[arg(long, env = "LLMGW_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..))]
    worker_threads: Option<u16>,
}

/// Logs and traces (see docs/observability.md).
#[derive(Args)]
struct TelemetryArgs {
    /// Export a trace of every routing decision to this OTLP/gRPC collector
    /// (e.g. http://otel-collector:4317). Unset: OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing.
    #[arg(long, env = "LLMGW_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// Log lines on stderr as text or as one JSON object per line (filter: RUST_LOG).
    #[arg(long, env = "LLMGW_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// The arguments, with `serve` put first when they start with a flag other than `--help` or
/// `--version`: GIE's endpoint-picker manifests (its conformance suite's included) pass only
/// flags (`--pool-name …`) to the container's entrypoint.
fn with_default_command(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let starts_with_a_flag = args.get(1).and_then(|a| a.to_str()).is_some_and(|first| {
        first.starts_with('-') && !matches!(first, "-h" | "--help" | "-V" | "--version")
    });
    if starts_with_a_flag {
        args.insert(1, "serve".into());
    }
    args
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(with_default_command(std::env::args_os().collect()));
    match cli.command {
        Command::Serve(args) => match serve(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                // Once logging is set up, the reason goes out in the chosen format (JSON lines
                // must stay parseable).
                if tracing::dispatcher::has_been_set() {
                    tracing::error!("llmgw-router: {error:#}");
                } else {
                    eprintln!("llmgw-router: {error:#}");
                }
                ExitCode::FAILURE
            }
        },
        Command::Hash(args) => hash_cmd::run(&args),
    }
}

fn serve(command: &ServeCommand) -> anyhow::Result<()> {
    let runtime = match command.worker_threads {
        Some(1) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        Some(threads) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(usize::from(threads))
            .enable_all()
            .build()?,
        None => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?,
    };
    // The OTLP exporter's gRPC channel runs on this runtime; the guard (declared after it, so
    // dropped before it) flushes the last spans on the way out.
    let _telemetry = {
        let _entered = runtime.enter();
        telemetry::init(&TelemetryConfig {
            service_name: "llmgw-router",
            otlp_endpoint: telemetry::resolve_endpoint(command.telemetry.otlp_endpoint.clone()),
            log_format: command.telemetry.log_format,
            log_filter_var: "RUST_LOG",
            traced_targets: &["llmgw"],
        })?
    };
    let settings = llmgw::config::Settings::resolve(&command.serve)?;
    if !settings.has_replica_source() {
        anyhow::bail!(
            "no replicas: pass --replica MODEL=IP:PORT, --config FILE, \
             --k8s-service MODEL=NAMESPACE/SERVICE:PORT or --pool-name NAME"
        );
    }
    let uds = settings
        .grpc_uds
        .as_ref()
        .map(|path| format!(" grpc_uds={}", path.display()))
        .unwrap_or_default();
    runtime.block_on(llmgw::app::serve(settings, shutdown_signal(), |bound| {
        // Tests and scripts read this line to learn the ports (useful with port 0).
        let health = bound
            .grpc_health
            .map(|addr| format!(" grpc_health={addr}"))
            .unwrap_or_default();
        println!(
            "llmgw-router listening grpc={} admin={} feed={}{health}{uds}",
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

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::{Cli, Command, with_default_command};

    const BEGIN: &str = "<!-- options:begin (generated from `serve --help`; see src/main.rs) -->\n";
    const END: &str = "<!-- options:end -->";

    /// Every `serve` option as a Markdown table, in `--help` order.
    fn options_table() -> String {
        let cli = Cli::command();
        let mut table = String::from("| flag | environment | what |\n|---|---|---|\n");
        let serve = cli.find_subcommand("serve").expect("serve subcommand");
        for arg in serve.get_arguments() {
            let Some(long) = arg.get_long() else {
                continue;
            };
            let env = arg
                .get_env()
                .map(|e| format!("`{}`", e.to_string_lossy()))
                .unwrap_or_default();
            let help = arg
                .get_long_help()
                .or(arg.get_help())
                .map(|h| h.to_string())
                .unwrap_or_default();
            let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
            table.push_str(&format!(
                "| `--{long}` | {env} | {} |\n",
                help.replace('|', "\\|")
            ));
        }
        table
    }

    #[test]
    fn bare_flags_mean_serve_as_an_endpoint_picker_is_started() {
        let parse = |args: &[&str]| {
            let args = args.iter().map(std::ffi::OsString::from).collect();
            Cli::try_parse_from(with_default_command(args))
        };
        // The flags GIE's conformance manifests give their endpoint picker.
        let cli = parse(&[
            "llmgw-router",
            "--pool-name",
            "primary-inference-pool",
            "--pool-namespace",
            "gateway-conformance-app-backend",
            "--grpc-port",
            "9002",
            "--grpc-health-port",
            "9003",
        ])
        .expect("parses as serve");
        let Command::Serve(serve) = cli.command else {
            panic!("not serve");
        };
        assert_eq!(
            serve.serve.pool_name.as_deref(),
            Some("primary-inference-pool")
        );
        assert_eq!(serve.serve.grpc_port, Some(9002));
        assert!(parse(&["llmgw-router", "hash", "--block-size", "16"]).is_ok());
        // --help and --version stay the tool's own.
        let help = parse(&["llmgw-router", "--help"]).err().expect("help");
        assert_eq!(help.kind(), clap::error::ErrorKind::DisplayHelp);
        assert!(help.to_string().contains("serve"), "{help}");
    }

    /// docs/router.md lists every option as `--help` describes it. `LLMGW_UPDATE_DOCS=1 cargo
    /// test -p llmgw --bin llmgw-router` rewrites the table after a flag changes.
    #[test]
    fn the_router_docs_list_every_option() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/router.md");
        let docs = std::fs::read_to_string(&path).expect("docs/router.md");
        let (Some(start), Some(end)) = (docs.find(BEGIN), docs.find(END)) else {
            panic!("docs/router.md has no options table between {BEGIN:?} and {END:?}");
        };
        let current = &docs[start + BEGIN.len()..end];
        let expected = options_table();
        if current == expected {
            return;
        }
        if std::env::var_os("LLMGW_UPDATE_DOCS").is_some() {
            let updated = format!("{}{expected}{}", &docs[..start + BEGIN.len()], &docs[end..]);
            std::fs::write(&path, updated).expect("rewrite docs/router.md");
            return;
        }
        panic!(
            "docs/router.md's options table is out of date with `llmgw-router serve --help`; \
             rerun with LLMGW_UPDATE_DOCS=1 to regenerate it"
        );
    }
}
