#!/usr/bin/env bash
# Instructions on LMCache's calling thread per 4 KiB `plugin` store task
# (python/bench/plugin_caller.py under callgrind: the timed rounds only,
# the main thread only; the deletes of every 16th round included). Stable
# run to run; about 3 minutes on 2 vCPUs (torch's import under valgrind).
#   perf/callgrind-plugin.sh [rounds=64] [site=target/python/site]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-64}"
site="${2:-target/python/site}"
venv="${DAXKV_VENV:-$HOME/.cache/daxkv/venv-lmcache}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
PYTHONPATH="$site" valgrind --tool=callgrind --separate-threads=yes \
    --collect-atstart=no --toggle-collect=functools_reduce \
    --callgrind-out-file="$out/cg.%p.out" \
    "$venv/bin/python" python/bench/plugin_caller.py "$rounds" >"$out/log" 2>&1 || {
    tail -20 "$out/log" >&2
    exit 1
}
main="$(ls "$out"/cg.*.out-01)"
total="$(awk '/^totals:/ {print $2}' "$main")"
tasks=$(( rounds * 8 ))
echo "calling thread: $total instructions over $tasks store tasks ($((total / tasks)) per task of 16 keys)"
callgrind_annotate --inclusive=yes "$main" 2>/dev/null \
    | grep -E "^ *[0-9,]+ .*__pymethod_(submit_store|pop_completed_stores|delete)__" \
    | awk -v t="$tasks" '{gsub(",","",$1); n=$0; sub(/.*__pymethod_/,"",n); sub(/__.*/,"",n);
                          if (!seen[n]++) printf "  %-24s %8d per task\n", n, $1/t}'
