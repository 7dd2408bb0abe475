#!/usr/bin/env bash
# The unit and integration tests under AddressSanitizer and ThreadSanitizer,
# and Miri over the pure-Rust modules: one script, nightly only (CI stays on
# stable and does not run it).
#
#   bash scripts/sanitizers.sh            # asan, then tsan, then miri
#   bash scripts/sanitizers.sh asan       # one of asan | tsan | miri
#   bash scripts/sanitizers.sh tsan --test engine_races   # extra cargo test args
#
# Needs: rustup component add miri rust-src --toolchain nightly
# (-Zsanitizer needs -Zbuild-std, which needs rust-src). Each sanitizer
# builds into its own target folder (target/san-address, target/san-thread): the
# first build takes 15–25 minutes on 2 vCPUs, a run 10–30.
#
# What runs: `cargo test -p daxkv --lib --tests` with the dev-dependency's
# `failpoints` and `test-hooks` features, so the fault tests and the soak's
# tests run sanitized too; the `daxkv` binary the CLI tests spawn is built
# with the same sanitizer. Not run under a sanitizer, each for its reason:
#
# - the loom models (`tests/loom_*`): without `--cfg daxkv_loom` they are
#   empty; loom explores the interleavings itself;
# - the Python package: LMCache's torch is not built with a sanitizer
#   runtime (its own tests run in scripts/test.sh);
# - the criterion benches and the fuzz crate's model tests: the same code
#   paths the unit tests and `tests/stress_*` drive, at several times the
#   cost.
#
# Deadlines in the tests (a task completes within the drain timeout + 1 s)
# stay as they are: a sanitizer makes the code slower, not the promise
# weaker. DAXKV_SANITIZER is set in the tests' environment so a test can
# scale a wait-for-progress budget (never a promise) by it.
#
# TSan's suppressions are in scripts/tsan.supp; every entry says why the
# report is false (TSan does not model `fence`, and does not see the other
# process behind a shared mapping).
set -euo pipefail
cd "$(dirname "$0")/.."

target="$(rustc +nightly -vV | sed -n 's/^host: //p')"
which="${1:-all}"
[ $# -gt 0 ] && shift

run_sanitizer() {
  local san="$1"
  shift
  printf '\n=== %s sanitizer (at %ds)\n' "$san" "$SECONDS"
  local flags="-Zsanitizer=$san"
  # ASan: leaks are reported too (LeakSanitizer); a test that leaks on
  # purpose must say so in scripts/lsan.supp. allocator_may_return_null:
  # the code asks for impossible sizes with try_reserve and must get an
  # error back (ASan aborts by default). handle_sigbus=0: daxkv's own
  # SIGBUS handler recovers a fault in a device copy (device::fault) and
  # must be the one that runs, as in production.
  export ASAN_OPTIONS="detect_leaks=1:detect_stack_use_after_return=1:abort_on_error=0:allocator_may_return_null=1:handle_sigbus=0"
  export LSAN_OPTIONS="suppressions=$PWD/scripts/lsan.supp:print_suppressions=0"
  # TSan: handle_sigbus=0 and allocator_may_return_null for the same reasons.
  export TSAN_OPTIONS="suppressions=$PWD/scripts/tsan.supp:halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0:handle_sigbus=0:allocator_may_return_null=1"
  DAXKV_SANITIZER="$san" RUSTFLAGS="$flags" RUSTDOCFLAGS="$flags" \
    CARGO_TARGET_DIR="target/san-$san" \
    cargo +nightly test -Zbuild-std --target "$target" -p daxkv --lib --tests "$@"
}

case "$which" in
  asan) run_sanitizer address "$@" ;;
  tsan) run_sanitizer thread "$@" ;;
  miri) bash scripts/miri.sh "$@" ;;
  all)
    run_sanitizer address "$@"
    run_sanitizer thread "$@"
    bash scripts/miri.sh
    ;;
  *)
    echo "usage: $0 [asan|tsan|miri|all] [cargo test args...]" >&2
    exit 2
    ;;
esac
printf '\n=== sanitizers: all passed (%ds)\n' "$SECONDS"
