//! `llmgw-router`: the ext_proc routing service and its operator tools.

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
    /// Print vLLM's block hashes for a JSON array of token ids read from stdin.
    Hash(hash_cmd::HashArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Hash(args) => hash_cmd::run(&args),
    }
}
