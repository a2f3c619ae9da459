#!/usr/bin/env bash
# Instructions per block of llmgw's block hashing, beside SHA-256 alone over the same CBOR
# bytes, counted by callgrind: repeatable where wall-clock timings on a shared machine are not.
# Each figure is (Ir at N iterations - Ir at 0) / (N x blocks), so set-up cancels out.
#
# Under valgrind SHA-256 runs in software (valgrind does not offer SHA-NI), ~3,350 instructions
# per 64-byte compression, so the whole-hash ratio here is not the wall-clock one. "own" is
# what is left after the compression function (sha2's compress, counted inclusively): the
# CBOR encoding, padding and framing for llmgw, the streaming Digest API's buffering and
# finalisation for SHA-256 alone.
#
# Build first: cargo build --release -p llmgw -p llmgw-core --example blockhash_count
set -euo pipefail
bin=${BIN:-target/release/examples/blockhash_count}
ir() { # case what iterations -> "total compress"
  local f; f=$(mktemp)
  valgrind --tool=callgrind --callgrind-out-file="$f" "$bin" "$1" "$2" "$3" >/dev/null 2>&1
  local total comp
  total=$(awk '/^summary:|^totals:/ {print $2; exit}' "$f")
  comp=$(callgrind_annotate --inclusive=yes "$f" 2>/dev/null \
    | awk '/sha256::soft::[a-z_:]*compress( |$)/ {gsub(",","",$1); if ($1+0 > m) m=$1+0} END {print m+0}')
  rm -f "$f"; echo "$total $comp"
}
printf '%-10s %-7s %9s %9s %9s\n' case hash "Ir/block" compress own
for spec in "block16 1 20000" "block32 1 20000" "prompt32k 2048 10"; do
  read -r case blocks n <<<"$spec"
  for what in cbor alone xxhash; do
    read -r t0 c0 <<<"$(ir "$case" "$what" 0)"
    read -r t1 c1 <<<"$(ir "$case" "$what" "$n")"
    per=$(( (t1 - t0) / (n * blocks) )); comp=$(( (c1 - c0) / (n * blocks) ))
    printf '%-10s %-7s %9d %9d %9d\n' "$case" "$what" "$per" "$comp" $(( per - comp ))
  done
done
