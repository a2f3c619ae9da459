#!/usr/bin/env python3
"""vLLM's own block-hash path (cbor2 + hashlib), timed on the tokens benches/blockhash.rs uses.

This is the body of vllm.v1.core.kv_cache_utils.hash_block_tokens with sha256_cbor:
    sha256(cbor2.dumps((parent, tuple(tokens), extra_keys), canonical=True)).digest()
"""
import argparse
import hashlib
import json
import time

import cbor2


def tokens(n):
    """The same xorshift32 sequence as benches/blockhash.rs."""
    x = 0x9E3779B9
    out = []
    for _ in range(n):
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        out.append(x % 151643)
    return out


def sha256_cbor(obj):
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def chain(toks, block_size, none_hash):
    parent = none_hash
    out = []
    for i in range(0, len(toks) - block_size + 1, block_size):
        parent = sha256_cbor((parent, tuple(toks[i : i + block_size]), None))
        out.append(parent)
    return out


def time_per_block(toks, block_size, none_hash, min_seconds=1.0):
    blocks = len(toks) // block_size
    runs = 0
    start = time.perf_counter()
    while True:
        chain(toks, block_size, none_hash)
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / (runs * blocks) * 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    none_hash = sha256_cbor("1729")
    # Golden vector (../shared/reference/vllm.md §3.6): this really is vLLM's chain.
    assert chain(list(range(40)), 16, none_hash)[0].hex().startswith("422a9eac71d84aa2"), "not vLLM's hash"
    results = {}
    for label, block_size, n in [("block16", 16, 16), ("block32", 32, 32), ("prompt32k_bs16", 16, 32 * 1024)]:
        results[label] = time_per_block(tokens(n), block_size, none_hash)
    # The first block of the 32k prompt, so the comparison can check both sides hash alike.
    results["first_digest_bs16"] = chain(tokens(16), 16, none_hash)[0].hex()
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
