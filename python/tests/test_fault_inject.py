"""Under LMCache's own `fault_inject` wrapper (built by LMCache's factory
from the `--l2-adapter` JSON, the inner adapter from its own spec): keys
the wrapper drops at load are reported as misses — the load still
completes, never hangs — and every key it lets through carries its own
bytes. daxkv's `native_plugin` connector and LMCache's built-in `dax`
adapter (the control) run the same scenario."""

from __future__ import annotations

import argparse
import json
import os

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("torch")

from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)

from conftest import SLOT  # noqa: E402
from test_lmcache import bits, key, obj, result, spec, stores  # noqa: E402


def build(kind: str, path: str, **fault: object):
    wrapped = {"type": "fault_inject", "inner": spec(kind, path), **fault}
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    args = parser.parse_args(["--l2-adapter", json.dumps(wrapped)])
    a = create_l2_adapter(parse_args_to_l2_adapters_config(args).adapters[0])
    assert type(a).__name__ == "FaultInjectL2Adapter"
    return a


@pytest.fixture(params=["native_plugin", "dax"])
def kind(request):
    return request.param


def store_all(a, keys, data) -> None:
    srcs = [obj(d) for d in data]  # alive until the stores complete
    ids = {a.submit_store_task(keys[i : i + 8], srcs[i : i + 8]) for i in range(0, len(keys), 8)}
    got = stores(a, ids)
    assert all(int(got[t]) >= 0 for t in ids), got


def test_dropped_loads_are_misses_not_hangs(kind, dax_file):
    # Drop positions 1 and 5 of each load, and its last chunk.
    a = build(kind, dax_file, gap_indices=[1, 5], gap_tail_ratios=[0.0])
    try:
        n = 24
        keys = [key(50_000 + i) for i in range(n)]
        sizes = [SLOT] * (n - 1) + [SLOT // 2 + 3]  # a tail chunk
        data = [os.urandom(s) for s in sizes]
        store_all(a, keys, data)

        # Lookup is not faulted: every key is there (and locked).
        tid = a.submit_lookup_and_lock_task(keys, {})
        bm = result(a, a.query_lookup_and_lock_result, a.get_lookup_and_lock_event_fd(), tid)
        assert bits(bm, n) == [True] * n

        dsts = [obj(s) for s in sizes]
        tid = a.submit_load_task(keys, dsts)
        got = bits(result(a, a.query_load_result, a.get_load_event_fd(), tid), n)
        dropped = {1, 5, n - 1}
        assert got == [i not in dropped for i in range(n)]
        for i in range(n):
            if i not in dropped:
                assert bytes(dsts[i].byte_array) == data[i], f"key {i}"
        # One-shot: the result is gone once read.
        assert a.query_load_result(tid) is None
        a.submit_unlock(keys)

        # The wrapper only rewrites results: the same keys load whole in a
        # batch where they sit at positions it keeps.
        again = [keys[1], keys[5], keys[0], keys[2], keys[3], keys[4], keys[6]]
        want = [data[1], data[5], data[0], data[2], data[3], data[4], data[6]]
        dsts = [obj(len(w)) for w in want]
        tid = a.submit_load_task(again, dsts)
        got = bits(result(a, a.query_load_result, a.get_load_event_fd(), tid), len(again))
        # Positions 1, 5 and the last (6) of this batch are dropped.
        assert got == [True, False, True, True, True, False, False]
        assert bytes(dsts[0].byte_array) == want[0]
        assert bytes(dsts[2].byte_array) == want[2]
        assert "fault_inject" in a.report_status()
    finally:
        a.close()


def test_every_key_dropped_still_completes(kind, dax_file):
    a = build(kind, dax_file, rate=1.0, seed=7)
    try:
        keys = [key(60_000 + i) for i in range(16)]
        data = [os.urandom(SLOT) for _ in keys]
        store_all(a, keys, data)
        # The destinations stay referenced until the loads complete (the L2
        # contract; the bridge's memoryviews do not own the tensors).
        dsts = [obj(SLOT) for _ in keys]
        tids = [a.submit_load_task(keys[i : i + 4], dsts[i : i + 4]) for i in range(0, 16, 4)]
        for t in tids:
            assert bits(result(a, a.query_load_result, a.get_load_event_fd(), t), 4) == [False] * 4
        # The store and lookup paths are untouched by the wrapper.
        tid = a.submit_lookup_and_lock_task(keys, {})
        bm = result(a, a.query_lookup_and_lock_result, a.get_lookup_and_lock_event_fd(), tid)
        assert bits(bm, 16) == [True] * 16
        a.submit_unlock(keys)
    finally:
        a.close()
