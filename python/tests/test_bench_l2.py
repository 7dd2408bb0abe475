"""The LMCache bench's harness (python/bench/bench_l2.py) is honest: an
adapter that reports a store complete before copying its sources fails
the run, one that copies first passes, and the no-op ceilings (the
harness's, and LMCache's native-connector bridge's) run."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

pytest.importorskip("lmcache")
torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
# The bench quiets LMCache on import (for its own runs): give the other
# tests of this process their environment back.
_level = os.environ.get("LMCACHE_LOG_LEVEL")
import bench_l2  # noqa: E402

if _level is None:
    os.environ.pop("LMCACHE_LOG_LEVEL", None)
else:
    os.environ["LMCACHE_LOG_LEVEL"] = _level

SIZE = 8192
N = 64


class MemAdapter(bench_l2.NoopAdapter):
    """Keeps each stored object's bytes in a dict. `early`: a store is
    reported complete at once and its sources are copied only when the
    next phase (lookup) begins, after the harness has collected it."""

    def __init__(self, early: bool) -> None:
        super().__init__()
        self.early = early
        self.data: dict[Any, bytes] = {}
        self.deferred: list[tuple[list, list]] = []

    def submit_store_task(self, keys: list, objects: list) -> int:
        if self.early:
            self.deferred.append((list(keys), list(objects)))
        else:
            self._copy(keys, objects)
        return super().submit_store_task(keys, objects)

    def _copy(self, keys: list, objects: list) -> None:
        for k, o in zip(keys, objects):
            self.data[k] = bytes(o.tensor.numpy())

    def submit_lookup_and_lock_task(self, keys: list, *layout: Any) -> int:
        for ks, objs in self.deferred:
            self._copy(ks, objs)
        self.deferred.clear()
        return super().submit_lookup_and_lock_task(keys, *layout)

    def submit_load_task(self, keys: list, objects: list) -> int:
        for k, o in zip(keys, objects):
            o.tensor.copy_(torch.frombuffer(bytearray(self.data[k]), dtype=torch.uint8))
        return super().submit_load_task(keys, objects)


def run(a: Any, verify: bool = True) -> dict[str, float]:
    src_buf = torch.randint(0, 256, (N * SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    dst_buf = torch.empty(N * SIZE, dtype=torch.uint8)
    srcs = [bench_l2.memory_obj(src_buf[i * SIZE : (i + 1) * SIZE]) for i in range(N)]
    dsts = [bench_l2.memory_obj(dst_buf[i * SIZE : (i + 1) * SIZE]) for i in range(N)]
    try:
        return bench_l2.one_round(a, N, SIZE, 16, 8, 0, srcs, dsts, src_buf, dst_buf, verify)
    finally:
        a.close()


def test_an_honest_adapter_passes() -> None:
    t = run(MemAdapter(early=False))
    assert set(t) == {"store", "lookup", "load"} and all(v > 0 for v in t.values())


def test_a_store_reported_before_its_copy_fails() -> None:
    with pytest.raises(RuntimeError, match="loaded with wrong bytes"):
        run(MemAdapter(early=True))


def test_noop_ceiling_runs() -> None:
    t = run(bench_l2.NoopAdapter(), verify=False)
    assert set(t) == {"store", "lookup", "load"}


def test_noop_native_ceiling_runs_through_lmcaches_bridge() -> None:
    """The native path's ceiling: a no-op connector inside LMCache's own
    NativeConnectorL2Adapter (its demux thread and eventfds) completes
    every phase of the frozen workload; close stops the demux thread."""
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        NativeConnectorL2Adapter,
    )

    a = bench_l2.build("noop_native", "", SIZE, N * SIZE, {})
    assert isinstance(a, NativeConnectorL2Adapter)
    assert isinstance(a._client, bench_l2.NoopConnector)
    demux = a._demux_thread
    t = run(a, verify=False)
    assert set(t) == {"store", "lookup", "load"} and all(v > 0 for v in t.values())
    demux.join(10)
    assert not demux.is_alive()


def test_a_failed_store_fails_the_run() -> None:
    """`L2StoreResult` is an int, -1 on failure: truthy, yet a failure."""

    class Failing(MemAdapter):
        def pop_completed_store_tasks(self) -> dict[int, Any]:
            return {t: bench_l2.L2StoreResult(False, 0) for t in super().pop_completed_store_tasks()}

    with pytest.raises(RuntimeError, match="a store task failed"):
        run(Failing(early=False))


def test_the_plugin_caller_driver_stores_and_collects_every_task() -> None:
    """python/bench/plugin_caller.py (what perf/callgrind-plugin.sh runs
    under valgrind) drives the real `plugin` adapter through its rounds,
    its deletes included, and exits cleanly: a driver that broke would
    make the instruction counts measure a crash."""
    import subprocess

    here = os.path.join(os.path.dirname(__file__), "..", "bench", "plugin_caller.py")
    # 20 timed rounds after 16 warm-up ones: past the first delete (round
    # 15) and into the second pass over the keys.
    r = subprocess.run(
        [sys.executable, here, "20"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_in_process_ab_compares_two_builds_and_ablations() -> None:
    """python/bench/plugin_store_ab.py loads a second build of the package
    beside this one (here a copy of this build, renamed) and the ablation
    variants, runs their store rounds alternated, and prints one row per
    variant with its ratio; an unknown piece is refused by name."""
    import re
    import subprocess

    import daxkv

    here = os.path.join(os.path.dirname(__file__), "..", "bench", "plugin_store_ab.py")
    site = os.path.dirname(os.path.dirname(os.path.abspath(daxkv.__file__)))
    r = subprocess.run(
        [sys.executable, here, "--other", site, "--ablate", "spans,pop,marks", "--rounds", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"^  (this build|other build|spans free|pop free|marks free) +([0-9.]+) ", r.stdout, re.M)}
    assert set(rows) == {"this build", "other build", "spans free", "pop free", "marks free"}, r.stdout
    assert all(v > 0 for v in rows.values()), r.stdout
    # The other build's extension was loaded from its own copy, not this
    # build's module twice.
    other = re.search(r"its extension loaded from (\S+)\)", r.stdout)
    assert other and "daxkv_other" in other.group(1), r.stdout
    assert os.path.abspath(other.group(1)) != os.path.abspath(daxkv._daxkv.__file__)
    bad = subprocess.run([sys.executable, here, "--ablate", "keys"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "unknown piece 'keys'" in bad.stderr, bad.stderr[-2000:]
