"""The plugin path copies without the GIL: a large load makes progress while
a Python thread holds the GIL the whole time (the counterpart of
test_connector.py's GIL test, which checks the connector's calls release
it; the plugin API never blocks, so here what matters is that the
engine's workers need no GIL to copy)."""

from __future__ import annotations

import os
import sys
import time

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("torch")

from test_l2_adapter import SLOT, made, plugin, store  # noqa: E402,F401
from test_lmcache import key, obj  # noqa: E402


def test_a_large_load_runs_while_python_holds_the_gil(plugin):
    a = plugin(num_load_workers=1)
    n = 48
    keys = [key(900 + i) for i in range(n)]
    data = [os.urandom(SLOT) for _ in keys]
    srcs = [obj(d) for d in data]
    assert store(a, keys, srcs).is_successful()
    dsts = [obj(SLOT) for _ in keys]
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)  # no forced switches: this thread keeps the GIL
    try:
        tid = a.submit_load_task(keys, dsts)
        # Pure Python, no call that releases the GIL, for 2 s: a worker
        # that needed the GIL could not copy meanwhile.
        end = time.monotonic() + 2.0
        spins = 0
        while time.monotonic() < end:
            spins += 1
        bm = a.query_load_result(tid)
    finally:
        sys.setswitchinterval(old)
    assert spins > 0
    assert bm is not None, "the load made no progress while Python held the GIL"
    assert [bool(bm.test(i)) for i in range(n)] == [True] * n
    assert [bytes(d.byte_array) for d in dsts] == data
