#!/usr/bin/env bash
# A pinned run on real CXL / DAX hardware: workers and the bench thread on
# the CPUs of the node nearest the device (CXL nodes have no CPUs), memory
# for buffers from that node, hardware counters where the machine has them.
# Usage: perf/pinned.sh /dev/daxX.Y [extra daxkv bench arguments...]
# It passes --force: the bench overwrites what the device holds.
set -euo pipefail
cd "$(dirname "$0")/.."
dev="${1:?usage: perf/pinned.sh /dev/daxX.Y [bench args]}"; shift
name="$(basename "$dev")"
node="$(cat "/sys/bus/dax/devices/$name/target_node" 2>/dev/null || cat "/sys/bus/dax/devices/$name/numa_node" 2>/dev/null || echo -1)"
best=0; bestd=999999
if [ "$node" -ge 0 ]; then
  read -r -a dist < "/sys/devices/system/node/node$node/distance"
  for n in /sys/devices/system/node/node[0-9]*; do
    id="${n##*node}"
    [ -s "$n/cpulist" ] && [ "$(cat "$n/cpulist")" != "" ] || continue
    d="${dist[$id]:-999999}"
    if [ "$d" -lt "$bestd" ]; then best="$id"; bestd="$d"; fi
  done
fi
echo "device $dev: node $node; running on CPU node $best (distance $bestd)"
cargo build --release --quiet
cmd=(numactl --cpunodebind="$best" --membind="$best" "${CARGO_TARGET_DIR:-target}"/release/daxkv bench --path "$dev" --force "$@")
if perf stat -e instructions true >/dev/null 2>&1; then
  perf stat -e cycles,instructions,cache-misses "${cmd[@]}"
else
  "${cmd[@]}"
fi
