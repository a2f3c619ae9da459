//! `llmgw-agent`: mirrors each vLLM engine's KV-event stream into the routers' indexes.

use clap::Parser;

#[derive(Parser)]
#[command(name = "llmgw-agent", version, about = "llmgw node agent")]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    anyhow::bail!("llmgw-agent has no commands yet: see issue 6")
}
