//! Block hashing throughput, beside SHA-256 alone over the same CBOR bytes (the floor).
//!
//! `make bench-hash` runs this and `bench/python_blockhash.py` (vLLM's own cbor2 + hashlib
//! path over the same tokens) and prints the comparison.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a bench or test harness: a panic is a failed run, not a crashed router"
)]

use std::hint::black_box;
use std::num::NonZeroUsize;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use llmgw::blockhash::{BlockHasher, ExternalHash, HashAlgo, HashSettings, encode_block};
use sha2::Digest;

/// Deterministic token ids spread like a 150k vocabulary (mostly 3- and 5-byte CBOR ints).
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

fn hasher(algo: HashAlgo, block_size: usize) -> BlockHasher {
    let mut settings = HashSettings::sha256_cbor(
        NonZeroUsize::new(block_size).expect("nonzero"),
        Some("1729"),
    );
    settings.algo = algo;
    BlockHasher::new(&settings).expect("valid settings")
}

/// The CBOR bytes of every block of the prompt, chained, as vLLM would hash them.
fn encoded_blocks(h: &BlockHasher, toks: &[u32]) -> Vec<Vec<u8>> {
    let mut parent = *h.none_hash();
    toks.chunks_exact(h.block_size())
        .map(|block| {
            let mut bytes = Vec::new();
            encode_block(&mut bytes, parent.as_bytes(), block, None);
            parent = h.hash_block(Some(&parent), block, None);
            bytes
        })
        .collect()
}

fn bench_blocks(c: &mut Criterion) {
    for (label, block_size, n_tokens) in [
        ("block16", 16, 16),
        ("block32", 32, 32),
        ("prompt32k_bs16", 16, 32 * 1024),
    ] {
        let toks = tokens(n_tokens);
        let h = hasher(HashAlgo::Sha256Cbor, block_size);
        let blocks = n_tokens / block_size;
        let mut group = c.benchmark_group(format!("blockhash/{label}"));
        group.throughput(Throughput::Elements(blocks as u64));
        let mut out: Vec<ExternalHash> = Vec::with_capacity(blocks);
        group.bench_function("sha256_cbor", |b| {
            b.iter(|| {
                out.clear();
                h.external_hashes_into(black_box(&toks), None, &mut out);
                black_box(out.len())
            })
        });
        let xh = hasher(HashAlgo::XxhashCbor, block_size);
        group.bench_function("xxhash_cbor", |b| {
            b.iter(|| {
                out.clear();
                xh.external_hashes_into(black_box(&toks), None, &mut out);
                black_box(out.len())
            })
        });
        let encoded = encoded_blocks(&h, &toks);
        group.bench_function("sha256_alone", |b| {
            b.iter(|| {
                for bytes in &encoded {
                    black_box(sha2::Sha256::digest(black_box(bytes)));
                }
            })
        });
        group.finish();
    }
}

criterion_group!(benches, bench_blocks);
criterion_main!(benches);
