//! A fixed amount of block hashing, for instruction counts under callgrind (repeatable where
//! criterion's wall-clock figures are not) and for a min-of-many wall-clock check.
//!
//! ```text
//! blockhash_count <case> <what> <iterations>
//!   case: block16 | block32 | prompt32k      (one 16-token block, one 32-token block, or a
//!                                             32,768-token prompt in 16-token blocks)
//!   what: cbor | xxhash | alone              (sha256_cbor, xxhash_cbor, or SHA-256 alone over
//!                                             the same CBOR bytes, as benches/blockhash.rs)
//! blockhash_count time <iterations>          (min-of-201-batches ns per block, every pair)
//! ```
//!
//! Instructions per block: run it under `valgrind --tool=callgrind` with `iterations` N and
//! with 0, and divide the difference of the totals by N × blocks (`bench/blockhash_ir.sh`).
//! Under valgrind SHA-256 runs in software (valgrind hides SHA-NI), so the `alone` count is
//! the software compression's; the difference between `cbor` and `alone` is what llmgw adds.

use std::hint::black_box;
use std::num::NonZeroUsize;
use std::process::ExitCode;
use std::time::Instant;

use llmgw_core::blockhash::{BlockHasher, ExternalHash, HashAlgo, HashSettings, encode_block};
use sha2::Digest as _;

/// The token ids of benches/blockhash.rs: spread like a 150k vocabulary.
fn tokens(n: usize) -> Vec<u32> {
    let mut x: u32 = 0x9e37_79b9;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % 151_643
        })
        .collect()
}

fn hasher(algo: HashAlgo, block_size: usize) -> Option<BlockHasher> {
    let mut settings = HashSettings::sha256_cbor(NonZeroUsize::new(block_size)?, Some("1729"));
    settings.algo = algo;
    BlockHasher::new(&settings).ok()
}

struct Case {
    toks: Vec<u32>,
    sha: BlockHasher,
    xxh: BlockHasher,
    encoded: Vec<Vec<u8>>,
}

impl Case {
    fn new(name: &str) -> Option<Case> {
        let (block_size, n) = match name {
            "block16" => (16, 16),
            "block32" => (32, 32),
            "prompt32k" => (16, 32 * 1024),
            _ => return None,
        };
        let toks = tokens(n);
        let sha = hasher(HashAlgo::Sha256Cbor, block_size)?;
        let xxh = hasher(HashAlgo::XxhashCbor, block_size)?;
        let mut parent = *sha.none_hash();
        let encoded = toks
            .chunks_exact(block_size)
            .map(|block| {
                let mut bytes = Vec::new();
                encode_block(&mut bytes, parent.as_bytes(), block, None);
                parent = sha.hash_block(Some(&parent), block, None);
                bytes
            })
            .collect();
        Some(Case {
            toks,
            sha,
            xxh,
            encoded,
        })
    }

    fn blocks(&self) -> usize {
        self.encoded.len()
    }

    fn run(&self, what: &str, iterations: usize, out: &mut Vec<ExternalHash>) -> Option<()> {
        match what {
            "cbor" | "xxhash" => {
                let h = if what == "cbor" { &self.sha } else { &self.xxh };
                for _ in 0..iterations {
                    out.clear();
                    h.external_hashes_into(black_box(&self.toks), None, out);
                    black_box(out.len());
                }
            }
            "alone" => {
                for _ in 0..iterations {
                    for bytes in &self.encoded {
                        black_box(sha2::Sha256::digest(black_box(bytes)));
                    }
                }
            }
            _ => return None,
        }
        Some(())
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let usage = || {
        eprintln!("usage: blockhash_count <block16|block32|prompt32k> <cbor|xxhash|alone> <n>");
        eprintln!("       blockhash_count time <n>");
        ExitCode::FAILURE
    };
    match args[..] {
        ["time", n] => {
            let Ok(n) = n.parse::<usize>() else {
                return usage();
            };
            for name in ["block16", "block32", "prompt32k"] {
                let Some(case) = Case::new(name) else {
                    return usage();
                };
                let mut out = Vec::with_capacity(case.blocks());
                let per_block = |what: &str, out: &mut Vec<ExternalHash>| {
                    let iterations = (n / case.blocks()).max(1);
                    let mut best = f64::INFINITY;
                    for _ in 0..201 {
                        let start = Instant::now();
                        case.run(what, iterations, out);
                        let ns = start.elapsed().as_nanos() as f64;
                        best = best.min(ns / (iterations * case.blocks()) as f64);
                    }
                    best
                };
                let cbor = per_block("cbor", &mut out);
                let alone = per_block("alone", &mut out);
                let xxh = per_block("xxhash", &mut out);
                println!(
                    "{name}: sha256_cbor {cbor:.1} ns, sha256_alone {alone:.1} ns, ratio {:.2}, \
                     xxhash_cbor {xxh:.1} ns (min of 201 batches of ~{n} blocks)",
                    cbor / alone
                );
            }
            ExitCode::SUCCESS
        }
        [name, what, n] => {
            let (Some(case), Ok(n)) = (Case::new(name), n.parse::<usize>()) else {
                return usage();
            };
            let mut out = Vec::with_capacity(case.blocks());
            if case.run(what, n, &mut out).is_none() {
                return usage();
            }
            println!("{} blocks", n * case.blocks());
            ExitCode::SUCCESS
        }
        _ => usage(),
    }
}
