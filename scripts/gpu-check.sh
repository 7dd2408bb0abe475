#!/usr/bin/env bash
# GPU-direct check and figures on a machine with an NVIDIA GPU
# (python/bench/gpu_check.py has what it measures). Uses the machine's own
# python3 and torch: installs nothing, reaches no network. Needs the daxkv
# package built into target/python/site (bash scripts/test-python.sh
# builds it; carry that folder to the GPU machine). Bounded: the Python
# side stops between chunk sizes at --deadline (400 s by default) and this
# wrapper kills it at DAXKV_GPU_CHECK_TIMEOUT seconds (480). Exit 77: no
# GPU or no torch (skipped). Arguments go to gpu_check.py (--sizes 64K,2M,
# --total-mib 256, --rounds 3, --json).
set -euo pipefail
cd "$(dirname "$0")/.."
site="${DAXKV_SITE:-$PWD/target/python/site}"
py="${DAXKV_GPU_PYTHON:-python3}"
if [ ! -d "$site/daxkv" ]; then
  echo "gpu-check: no daxkv package at $site: run bash scripts/test-python.sh (or pip install --target $site ./python) on a build machine and carry it" >&2
  exit 2
fi
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" exec timeout "${DAXKV_GPU_CHECK_TIMEOUT:-480}" \
  "$py" python/bench/gpu_check.py "$@"
