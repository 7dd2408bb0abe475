#!/usr/bin/env bash
# Install the system packages daxkv's build and tests need, on Debian or
# Ubuntu. Idempotent; installs nothing when everything is present.
#   - a C toolchain: the `blake3` dev-dependency (a benchmark baseline)
#     compiles C / assembly through the `cc` crate;
#   - rustfmt and clippy components for the lint steps;
#   - curl, which the README's commands use (tests/examples.rs runs them).
# The default build uses no -sys crate (NUMA topology comes from sysfs, not
# hwloc), so no C library or pkg-config is needed. With DAXKV_HWLOC=1 it
# also installs what the optional `hwloc` feature links (libhwloc >= 2.0,
# libudev, pkg-config), so scripts/test.sh runs that feature's tests.
set -euo pipefail

need=()
command -v cc >/dev/null 2>&1 || need+=(build-essential)
command -v curl >/dev/null 2>&1 || need+=(curl)
if [ "${DAXKV_HWLOC:-0}" = 1 ]; then
  command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
  pkg-config --exists hwloc 2>/dev/null || need+=(libhwloc-dev)
  pkg-config --exists libudev 2>/dev/null || need+=(libudev-dev)
fi

if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install a Rust toolchain (rustup) first" >&2
  exit 1
fi
for tool in rustfmt clippy; do
  sub=fmt; [ "$tool" = clippy ] && sub=clippy
  if ! cargo "$sub" --version >/dev/null 2>&1; then
    if command -v rustup >/dev/null 2>&1; then
      rustup component add "$tool" || { echo "setup: cannot install the $tool component" >&2; exit 1; }
    else
      echo "setup: cargo $tool is missing and rustup is not available" >&2
      exit 1
    fi
  fi
done

# The Python package's tests (python/, scripts/test-python.sh): with
# DAXKV_PYTHON=1, a venv with LMCache 0.5.6 (about 6.3 GB with torch and
# the CUDA wheels, ~5 min on a fast mirror; imports fine on a CPU-only
# machine) at DAXKV_VENV (default ~/.cache/daxkv/venv-lmcache). Cached: a
# venv that already imports lmcache 0.5.6 is left as it is.
if [ "${DAXKV_PYTHON:-0}" = 1 ]; then
  venv="${DAXKV_VENV:-$HOME/.cache/daxkv/venv-lmcache}"
  if "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("lmcache") != "0.5.6")' 2>/dev/null; then
    echo "setup: LMCache 0.5.6 venv at $venv (cached)"
  else
    py="${DAXKV_PYTHON_BIN:-python3}"
    "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
      { echo "setup: $py is older than 3.11 (the daxkv module is abi3 for 3.11+)" >&2; exit 1; }
    mkdir -p "$(dirname "$venv")"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q lmcache==0.5.6 pytest
    echo "setup: LMCache 0.5.6 installed into $venv"
  fi
fi
echo "setup: ok"
