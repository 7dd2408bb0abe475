#!/usr/bin/env bash
# Sample where time goes with software events (works where hardware
# counters are not exposed, e.g. this VM). Writes perf.data and, when
# inferno is installed, flame.svg.
# Usage: perf/record.sh [daxkv bench arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
out="${TMPDIR:-/tmp}/daxkv-perf.data"
perf record -e cpu-clock -F 5000 -g -o "$out" "${CARGO_TARGET_DIR:-target}"/release/daxkv bench "$@" >/dev/null
perf report -i "$out" --no-children --sort comm,symbol 2>/dev/null | grep -v '^#' | grep '%' | head -30
if command -v inferno-collapse-perf >/dev/null && command -v inferno-flamegraph >/dev/null; then
  perf script -i "$out" | inferno-collapse-perf | inferno-flamegraph > flame.svg
  echo "wrote flame.svg"
fi
