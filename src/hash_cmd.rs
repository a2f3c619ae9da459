//! `llmgw-router hash`: block hashes of a token array, to compare with what an engine publishes.

use std::io::{Read, Write};
use std::num::NonZeroUsize;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Args;
use llmgw::blockhash::{BlockHasher, HashAlgo, HashSettings, SaltEncoding};

#[derive(Args, Debug)]
pub struct HashArgs {
    /// The engine's --prefix-caching-hash-algo.
    #[arg(long, default_value = "sha256_cbor")]
    algo: HashAlgo,
    /// The engine's PYTHONHASHSEED (unset: vLLM's fixed default for sha256_cbor).
    #[arg(long, env = "PYTHONHASHSEED")]
    seed: Option<String>,
    /// Tokens per KV block (the engine's --block-size).
    #[arg(long)]
    block_size: NonZeroUsize,
    /// The request's cache_salt, hashed into block 0.
    #[arg(long)]
    cache_salt: Option<String>,
    /// How the salt is hashed: tagged (vLLM ≥ 0.31) or untagged (0.9 – 0.30).
    #[arg(long, default_value = "tagged")]
    salt_encoding: SaltEncoding,
    /// Print full hex digests instead of the external u64 form.
    #[arg(long)]
    digests: bool,
}

pub fn run(args: &HashArgs) -> ExitCode {
    match hash_stdin(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("llmgw-router hash: {err:#}");
            ExitCode::from(2)
        }
    }
}

fn hash_stdin(args: &HashArgs) -> anyhow::Result<()> {
    let hasher = BlockHasher::new(&HashSettings {
        algo: args.algo,
        seed: args.seed.clone(),
        block_size: args.block_size,
        salt_encoding: args.salt_encoding,
    })?;
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .context("reading stdin")?;
    let tokens = parse_tokens(&input)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for digest in hasher.prompt_blocks(&tokens, args.cache_salt.as_deref()) {
        if args.digests {
            writeln!(out, "{}", digest.to_hex())?;
        } else {
            writeln!(out, "{}", digest.external())?;
        }
    }
    out.flush()?;
    Ok(())
}

fn parse_tokens(input: &str) -> anyhow::Result<Vec<u64>> {
    let values: Vec<serde_json::Value> = serde_json::from_str(input)
        .context("stdin must be a JSON array of token ids, e.g. [1, 2, 3]")?;
    values
        .iter()
        .enumerate()
        .map(|(i, v)| match v.as_u64() {
            Some(id) => Ok(id),
            None => bail!("token id at index {i} is {v}; ids are integers from 0 to 2^64-1"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::parse_tokens;

    #[test]
    fn parses_ids_up_to_u64_and_rejects_the_rest() {
        assert_eq!(
            parse_tokens("[0, 18446744073709551615]").unwrap(),
            vec![0, u64::MAX]
        );
        for bad in [
            "[-1]",
            "[1.5]",
            "[\"a\"]",
            "{}",
            "[1,",
            "[18446744073709551616]",
        ] {
            assert!(parse_tokens(bad).is_err(), "{bad} accepted");
        }
        let err = parse_tokens("[3, -1]").unwrap_err().to_string();
        assert!(err.contains("index 1"), "{err}");
    }
}
