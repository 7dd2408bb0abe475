#!/usr/bin/env bash
# The Python package's tests: `pip install --target` of ./python (maturin,
# the PEP 517 backend) with the LMCache venv's pip, then pytest python/tests
# (the connector alone, and inside LMCache 0.5.6 with the built-in dax
# adapter as the control; arguments go to pytest: -k, -x, a file).
# Needs `DAXKV_PYTHON=1 bash scripts/setup.sh` first (a cached venv). About 75 s for the install (a release build) and 10 s for the
# tests on 2 vCPUs. scripts/test.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DAXKV_VENV:-$HOME/.cache/daxkv/venv-lmcache}"
[ -x "$venv/bin/python" ] || { echo "test-python: no LMCache venv at $venv; run DAXKV_PYTHON=1 bash scripts/setup.sh first (or DAXKV_SKIP_PYTHON=1 to skip these tests)" >&2; exit 1; }
# maturin builds with cargo: keep its outputs apart from the main build's
# (the extension module is built with other features).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}/python"
# The package goes into a folder of this checkout's own (first on
# PYTHONPATH), not into the shared venv: two checkouts testing at once do
# not replace each other's build.
site="$CARGO_TARGET_DIR/site"
rm -rf "$site"
"$venv/bin/pip" install -q --no-deps --target "$site" ./python
# Run from python/ without `python -m`, so the installed package (with its
# extension module) is imported, not the source folder.
cd python && PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/pytest" -q -p no:cacheprovider -W ignore tests "$@"
