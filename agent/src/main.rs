//! `llmgw-agent`: mirrors each vLLM engine's KV-event stream into the routers' indexes.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use llmgw_agent::config::{AgentArgs, vllm_args};
use llmgw_agent::daemon::Agent;
use llmgw_agent::supervisor::{Backoff, supervise};
use llmgw_agent::zmq::{EngineEndpoint, Publisher, ReplyShape};
use llmgw_core::telemetry::{self, LogFormat, TelemetryConfig, TelemetryGuard};

#[derive(Parser)]
#[command(name = "llmgw-agent", version, about = "llmgw node agent")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Mirror the engines' KV events (vLLM started elsewhere): the --engine flags, a --config
    /// file's engines (read again as it changes), or the vLLM pods on this node (--discover-pods).
    Serve {
        #[command(flatten)]
        agent: AgentArgs,
        #[command(flatten)]
        telemetry: TelemetryArgs,
    },
    /// Start vLLM (the command after `--`) pointed at this agent, restart it when it exits,
    /// and mirror its events.
    Run {
        #[command(flatten)]
        agent: AgentArgs,
        #[command(flatten)]
        telemetry: TelemetryArgs,
        /// The vLLM command and its own arguments.
        #[arg(last = true, required = true)]
        vllm: Vec<String>,
    },
    /// Print the environment and flags vLLM needs to publish to this agent.
    VllmArgs {
        #[command(flatten)]
        agent: AgentArgs,
        /// Print JSON (`{"env":[[k,v]…],"args":[…]}`) instead of shell lines.
        #[arg(long)]
        json: bool,
    },
    /// Print each KV-event batch an engine publishes, one JSON line per batch.
    Tail {
        /// The engine's PUB endpoint, tcp://HOST:PORT.
        #[arg(
            long,
            env = "LLMGW_AGENT_TAIL_CONNECT",
            required_unless_present = "bind"
        )]
        connect: Option<String>,
        /// Bind tcp://HOST:PORT instead, for an engine configured to connect.
        #[arg(long, env = "LLMGW_AGENT_TAIL_BIND", conflicts_with = "connect")]
        bind: Option<String>,
        /// Topic prefix (default: all).
        #[arg(long, env = "LLMGW_AGENT_TOPIC", default_value = "")]
        topic: String,
        /// Stop after this many messages.
        #[arg(long)]
        count: Option<u64>,
    },
    /// Publish a recorded stream (fixtures' JSON-lines format) like a vLLM engine would.
    PublishCapture {
        /// The capture file.
        file: std::path::PathBuf,
        /// PUB endpoint to bind.
        #[arg(long, default_value = "tcp://127.0.0.1:5557")]
        bind: String,
        /// Replay ROUTER endpoint to bind.
        #[arg(long)]
        replay: Option<String>,
        #[arg(long, default_value = "kv")]
        topic: String,
        /// Pause between batches, in milliseconds.
        #[arg(long, default_value_t = 20)]
        interval_ms: u64,
        /// Wait this long for subscribers before publishing, in milliseconds.
        #[arg(long, default_value_t = 1000)]
        warmup_ms: u64,
    },
}

/// Logs and traces (see docs/observability.md).
#[derive(Args)]
struct TelemetryArgs {
    /// Export a trace of every KV-event batch (decode → mirror → uplink) to this OTLP/gRPC
    /// collector (e.g. http://otel-collector:4317). Unset: OTEL_EXPORTER_OTLP_ENDPOINT, else none.
    #[arg(long, env = "LLMGW_AGENT_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// Log lines on stderr as text or as one JSON object per line (filter: LLMGW_AGENT_LOG).
    #[arg(long, env = "LLMGW_AGENT_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// Installs logging (and tracing, when configured); the guard flushes spans when dropped.
fn init_telemetry(args: TelemetryArgs) -> anyhow::Result<TelemetryGuard> {
    Ok(telemetry::init(&TelemetryConfig {
        service_name: "llmgw-agent",
        otlp_endpoint: telemetry::resolve_endpoint(args.otlp_endpoint),
        log_format: args.log_format,
        log_filter_var: "LLMGW_AGENT_LOG",
        traced_targets: &["llmgw_agent"],
    })?)
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@".contains(c))
    {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // Once logging is set up, the reason goes out in the chosen format (JSON lines must
            // stay parseable).
            if tracing::dispatcher::has_been_set() {
                tracing::error!("llmgw-agent: {error:#}");
            } else {
                eprintln!("llmgw-agent: {error:#}");
            }
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve { agent, telemetry } => {
            let args_for_reload = agent.clone();
            let _telemetry = init_telemetry(telemetry)?;
            let config = agent.resolve()?;
            anyhow::ensure!(
                !config.engines.is_empty() || config.pods.is_some() || config.reload.is_some(),
                "no engine: give --engine, a --config file with `engines`, or --discover-pods"
            );
            let admin = config.admin_addr;
            let (pods, reload) = (config.pods.clone(), config.reload.clone());
            let pods_client = match &pods {
                Some(p) => Some(llmgw_agent::pods::client(p.kubeconfig.as_deref()).await?),
                None => None,
            };
            let agent = Arc::new(Agent::start(config).await?);
            let _uplinks = agent.start_uplinks();
            let _engine_source = match (pods, pods_client, reload) {
                (Some(pods), Some(client), _) => Some(tokio::spawn(llmgw_agent::pods::run(
                    Arc::clone(&agent),
                    client,
                    pods,
                ))),
                (_, _, Some(reload)) => Some(tokio::spawn(llmgw_agent::reload::run(
                    Arc::clone(&agent),
                    args_for_reload,
                    reload,
                ))),
                _ => None,
            };
            tokio::select! {
                r = Arc::clone(&agent).serve_admin(admin) => r?,
                r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
            }
        }
        Command::Run {
            agent,
            telemetry,
            vllm,
        } => {
            let _telemetry = init_telemetry(telemetry)?;
            let config = agent.resolve()?;
            let first = config
                .engines
                .first()
                .cloned()
                .context("`run` needs one --engine for the vLLM it starts")?;
            let flags = vllm_args(&config, &first);
            let admin = config.admin_addr;
            let agent = Arc::new(Agent::start(config).await?);
            let _uplinks = agent.start_uplinks();
            tokio::select! {
                r = Arc::clone(&agent).serve_admin(admin) => r?,
                r = supervise(&agent, &first.name, &vllm, &flags, Backoff::default(), None) => r?,
                r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
            }
        }
        Command::VllmArgs { agent, json } => {
            let config = agent.resolve()?;
            anyhow::ensure!(!config.engines.is_empty(), "no --engine configured");
            let mut out = std::io::stdout().lock();
            for engine in config.engines.iter().filter(|e| !e.name.contains("#dp")) {
                let v = vllm_args(&config, engine);
                if json {
                    writeln!(out, "{}", serde_json::to_string(&v)?)?;
                } else {
                    if config.seed.is_none() {
                        eprintln!(
                            "warning: no --hash-seed: vLLM < 0.29 then picks a random \
                             PYTHONHASHSEED and no router can reproduce its hashes"
                        );
                    }
                    writeln!(out, "# engine {}", engine.name)?;
                    for (k, val) in &v.env {
                        writeln!(out, "export {k}={}", shell_quote(val))?;
                    }
                    let args: Vec<String> = v.args.iter().map(|a| shell_quote(a)).collect();
                    writeln!(out, "{}", args.join(" "))?;
                }
            }
        }
        Command::Tail {
            connect,
            bind,
            topic,
            count,
        } => {
            let (endpoint, bind) = match (connect, bind) {
                (Some(c), _) => (c, false),
                (None, Some(b)) => (b, true),
                (None, None) => anyhow::bail!("give --connect or --bind"),
            };
            let ep = EngineEndpoint {
                endpoint,
                bind,
                replay: None,
                topic,
            };
            let mut out = std::io::stdout();
            llmgw_agent::tail::tail(ep, count, &mut out).await?;
        }
        Command::PublishCapture {
            file,
            bind,
            replay,
            topic,
            interval_ms,
            warmup_ms,
        } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let capture = llmgw_agent::capture::Capture::parse(&text)?;
            let mut publisher = Publisher::start(
                &bind,
                false,
                replay.as_deref(),
                &topic,
                ReplyShape::WithTopic,
                10_000,
            )
            .await?;
            eprintln!(
                "publishing {} batches on {} (replay: {})",
                capture.frames.len(),
                publisher.endpoint,
                publisher.replay_endpoint.as_deref().unwrap_or("none")
            );
            tokio::time::sleep(std::time::Duration::from_millis(warmup_ms)).await;
            for f in &capture.frames {
                publisher.publish(f.seq, &f.payload).await?;
                tokio::time::sleep(std::time::Duration::from_millis(interval_ms)).await;
            }
            // Keep serving replays until interrupted.
            if publisher.replay_endpoint.is_some() {
                tokio::signal::ctrl_c().await?;
            }
        }
    }
    Ok(())
}
