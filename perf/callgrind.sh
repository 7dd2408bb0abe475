#!/usr/bin/env bash
# Instructions per object, by function (stable run to run; usable as a
# regression check). Usage: perf/callgrind.sh [objects] [size_bytes] [example]
#   example: per_object (DaxCore calls, the default) or per_object_engine
#   (the engine through a Submitter: submit, worker, collect).
# Both run four rounds over `objects` keys, so the divisor is objects x 4;
# the total is the whole run's Ir (start-up included) over that. The copy
# kernel is fixed with DAXKV_COPY_KERNEL (default avx2; valgrind hides
# AVX-512, so that is also what an AVX-512 host runs under it).
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-4096}"; size="${2:-4096}"; example="${3:-per_object}"
cargo build --release --quiet --example "$example"
out="${TMPDIR:-/tmp}/daxkv-callgrind-$example.out"
DAXKV_COPY_KERNEL="${DAXKV_COPY_KERNEL:-avx2}" valgrind --tool=callgrind \
  --callgrind-out-file="$out" "${CARGO_TARGET_DIR:-target}"/release/examples/"$example" "$n" "$size" >/dev/null 2>&1
objects=$((n * 4))
echo "$example: instructions per object ($objects objects; copy kernel ${DAXKV_COPY_KERNEL:-avx2}; exclusive, inlined code counted in its caller):"
callgrind_annotate --auto=no --threshold=100 "$out" 2>/dev/null \
  | sed -nE 's/^ *([0-9,]+) \([^)]*\) +(.*)$/\1\t\2/p' \
  | awk -F'\t' -v n="$objects" '
      { gsub(",", "", $1); f = $2; sub(/ \[[^]]*\]$/, "", f)
        if (f ~ /^PROGRAM TOTALS/) { total = $1; next }
        sub(/^[^:]*:/, "", f); ir[f] += $1 }
      END { printf "  %8.0f  total\n", total / n
            for (f in ir) if (ir[f] / n >= 5) printf "  %8.0f  %s\n", ir[f] / n, f }' \
  | sort -k1,1nr | head -40
echo "copy (reported apart): nt_* is the store kernel; __memcpy_* is the load copy (plus any caller memcpy)"
