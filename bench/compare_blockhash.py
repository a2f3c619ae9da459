#!/usr/bin/env python3
"""Prints llmgw's block hashing beside SHA-256 alone and vLLM's Python path.

Reads criterion's estimates (target/criterion/blockhash_<case>/<fn>/new/estimates.json) and the
JSON written by python_blockhash.py. Times are per block (mean).
"""
import json
import os
import sys

BLOCKS = {"block16": 1, "block32": 1, "prompt32k_bs16": 2048}


def criterion_ns(root, case, fn):
    path = os.path.join(root, f"blockhash_{case}", fn, "new", "estimates.json")
    with open(path) as f:
        return json.load(f)["mean"]["point_estimate"] / BLOCKS[case]


def main():
    root, python_json = sys.argv[1], sys.argv[2]
    with open(python_json) as f:
        py = json.load(f)
    print("| case | llmgw sha256_cbor ns/block | llmgw xxhash_cbor ns/block | SHA-256 alone ns/block "
          "| llmgw / SHA-256 (target ≤ 1.5) | vLLM Python ns/block | speed-up (target ≥ 15) | blocks/s |")
    print("|---|---|---|---|---|---|---|---|")
    for case in BLOCKS:
        ours = criterion_ns(root, case, "sha256_cbor")
        xxh = criterion_ns(root, case, "xxhash_cbor")
        floor = criterion_ns(root, case, "sha256_alone")
        print(f"| {case} | {ours:.0f} | {xxh:.0f} | {floor:.0f} | {ours / floor:.2f} | {py[case]:.0f} "
              f"| {py[case] / ours:.1f}× | {1e9 / ours:,.0f} |")


if __name__ == "__main__":
    main()
