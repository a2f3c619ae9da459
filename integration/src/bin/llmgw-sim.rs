//! `llmgw-sim`: a simulated vLLM replica.

fn main() -> anyhow::Result<()> {
    anyhow::bail!("llmgw-sim is not built yet: see issue 3")
}
