#!/usr/bin/env bash
# Miri over the unsafe modules (cell, copy, arena, ring on heap storage,
# buf) and the core protocol tests (slot, core) that run on anonymous memory (Miri has no memfd_create, eventfd or file mmap, so the
# tests that need them are ignored under Miri or not selected here).
# Needs a nightly toolchain with the miri component:
#   rustup component add miri rust-src --toolchain nightly
# Not part of CI (CI runs on stable alone); about 10 minutes on 2 vCPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation}"
cargo +nightly miri test --lib -- cell:: copy:: slot:: arena:: core::tests ring:: buf:: "$@"
