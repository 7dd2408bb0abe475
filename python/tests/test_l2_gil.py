"""The plugin adapter releases the GIL: a Python thread keeps running
while the adapter's calls wait for or copy a large load (the counterpart
of test_connector.py's GIL test for the plugin path)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("torch")

from test_l2_adapter import SLOT, made, plugin, store  # noqa: E402,F401
from test_lmcache import key, obj  # noqa: E402


def test_gil_released_while_a_large_load_runs(plugin):
    a = plugin(num_load_workers=1)
    n = 48
    keys = [key(900 + i) for i in range(n)]
    data = [os.urandom(SLOT) for _ in keys]
    srcs = [obj(d) for d in data]
    assert store(a, keys, srcs).is_successful()
    count = [0]
    stop = threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1
            os.sched_yield()  # lets the main thread take the GIL back

    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)  # no forced switches: only released GILs let the counter run
    t = threading.Thread(target=counter)
    t.start()
    try:
        dsts = [obj(SLOT) for _ in keys]
        before = count[0]
        calls = 0
        tid = a.submit_load_task(keys, dsts)
        calls += 1
        bm = None
        while bm is None:
            bm = a.query_load_result(tid)
            calls += 1
        after = count[0]
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert [bool(bm.test(i)) for i in range(n)] == [True] * n
    assert [bytes(d.byte_array) for d in dsts] == data
    # The calls released the GIL, letting the counter step (with the GIL
    # held throughout it does not step at all). Not one step per call: on
    # a loaded machine the counter thread may miss a release.
    assert after - before >= min(3, calls // 2), (after - before, calls)
