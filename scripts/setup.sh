#!/usr/bin/env bash
# Install the system packages daxkv's build and tests need, on Debian or
# Ubuntu. Idempotent; installs nothing when everything is present.
#   - a C toolchain: the `blake3` dev-dependency (a benchmark baseline)
#     compiles C / assembly through the `cc` crate;
#   - rustfmt and clippy components for the lint steps.
# The default build uses no -sys crate (NUMA topology comes from sysfs, not
# hwloc), so no C library or pkg-config is needed. With DAXKV_HWLOC=1 it
# also installs what the optional `hwloc` feature links (libhwloc >= 2.0,
# libudev, pkg-config), so scripts/test.sh runs that feature's tests.
set -euo pipefail

need=()
command -v cc >/dev/null 2>&1 || need+=(build-essential)
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
echo "setup: ok"
