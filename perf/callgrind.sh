#!/usr/bin/env bash
# Instruction counts of the per-object path (stable run to run; usable as a
# regression check). Usage: perf/callgrind.sh [objects] [size_bytes]
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-4096}"; size="${2:-4096}"
cargo build --release --quiet --example per_object
out="${TMPDIR:-/tmp}/daxkv-callgrind.out"
valgrind --tool=callgrind --callgrind-out-file="$out" "${CARGO_TARGET_DIR:-target}"/release/examples/per_object "$n" "$size" >/dev/null 2>&1
objects=$((n * 4))
echo "per-object instruction counts ($objects objects: put, lookup+lock, load, unlock, delete):"
callgrind_annotate "$out" 2>/dev/null \
  | sed -nE 's/^ *([0-9,]+) \([^)]*\) +([^ ]+).*/\1 \2/p' \
  | awk -v n="$objects" '{ gsub(",", "", $1); sub(/^.*:daxkv::/, "daxkv::", $2); if ($2 == "PROGRAM") $2 = "total"; if ($2 ~ /daxkv::|total/) printf "  %8.0f  %s\n", $1 / n, $2 }' \
  | head -25
