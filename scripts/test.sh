#!/usr/bin/env bash
# The whole test suite: lints, unit and integration tests, the bolero model
# tests, the criterion benches (one pass each, so they never rot), loom, the
# Python package inside the real LMCache, and a small `daxkv bench` run. Exits non-zero on any failure.
#
# Knobs: BOLERO_RANDOM_TEST_TIME_MS (model test time per target, default
# 15000); DAXKV_SKIP_LOOM=1 to skip the loom build; DAXKV_HWLOC=1 to
# require the `hwloc` feature's tests (by default they run when libhwloc
# and libudev are installed, `DAXKV_HWLOC=1 bash scripts/setup.sh`, and are
# skipped with a note otherwise); DAXKV_SKIP_PYTHON=1 to skip the Python
# package's tests (they need the LMCache venv of `DAXKV_PYTHON=1 bash
# scripts/setup.sh`, at DAXKV_VENV); CARGO_TARGET_DIR is honoured (the loom
# build goes to its `loom/` subfolder, the Python build to `python/`).
set -euo pipefail
cd "$(dirname "$0")/.."
# Build outputs go wherever CARGO_TARGET_DIR says (default: ./target).
out="${CARGO_TARGET_DIR:-target}"

step() { printf '\n=== %s (at %ds)\n' "$*" "$SECONDS"; }

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
# The library as an application links it: without the test-hooks and
# failpoints features (the tests above all build with them, through the
# self dev-dependency).
cargo clippy -p daxkv --lib --release -- -D warnings

step "the default build has no fault hooks (failpoints compiles to nothing)"
cargo build -p daxkv --lib --release
# The rlib's metadata names every item compiled in; the hooks' names must
# not be among them (a failpoints build's rlib holds each of them).
for name in inject_device_failure inject_worker_panics inject_eventfd_write_failures \
            inject_copy_delay inject_copy_faults worker_panic_point fail_writes; do
  if grep -a -q "$name" "$out/release/libdaxkv.rlib"; then
    echo "the default release build holds the fault hook $name" >&2
    exit 1
  fi
done

step "cargo doc -D warnings"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace --quiet

step "unit, integration and model tests"
BOLERO_RANDOM_TEST_TIME_MS="${BOLERO_RANDOM_TEST_TIME_MS:-15000}" cargo test --workspace

if [ "${DAXKV_HWLOC:-0}" = 1 ] || pkg-config --exists hwloc libudev 2>/dev/null; then
  step "hwloc feature: clippy, and its reader against the sysfs reader"
  cargo clippy --lib --tests --features hwloc -- -D warnings
  cargo test --lib --features hwloc numa::
else
  step "hwloc feature: skipped (no libhwloc / libudev; DAXKV_HWLOC=1 bash scripts/setup.sh installs them)"
fi

step "criterion benches, one pass each"
# `--bench '*'` selects the bench targets only (`--benches` would rerun the
# library's unit tests too).
cargo test --bench '*'

if [ "${DAXKV_SKIP_LOOM:-0}" != 1 ]; then
  step "loom (slot word + bitmap, core index/slot protocols and leases, ring, task-table mailbox, record set + completion ring, key claims, gate leases)"
  RUSTFLAGS="--cfg daxkv_loom" CARGO_TARGET_DIR="$out/loom" cargo test --release \
    --test loom_slot --test loom_core --test loom_ring --test loom_cell \
    --test loom_task_table --test loom_claims --test loom_gate
fi

if [ "${DAXKV_SKIP_PYTHON:-0}" != 1 ]; then
  step "Python package (pip install ./python) inside LMCache 0.5.6, built-in dax as the control"
  bash scripts/test-python.sh
else
  step "Python package: skipped (DAXKV_SKIP_PYTHON=1)"
fi

step "daxkv bench (small)"
mkdir -p "$out"
cargo run --release --quiet -- bench --sizes 4K,256K --total-bytes 8MiB --max-objects 256 --json "$out/bench-smoke.json"

echo
echo "all tests passed"
