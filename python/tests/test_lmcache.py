"""Inside the real LMCache (0.5.6): LMCache's own factory builds the
`native_plugin` path from the `--l2-adapter` JSON a user would write, and
the same scenario runs on LMCache's built-in `dax` adapter as the control.
Skipped when LMCache is not installed (scripts/setup.sh installs it with
DAXKV_PYTHON=1)."""

from __future__ import annotations

import argparse
import json
import os
import select
import threading
import time

import pytest

pytest.importorskip("lmcache")
torch = pytest.importorskip("torch")

from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.memory_management import (  # noqa: E402
    MemoryFormat,
    MemoryObjMetadata,
    TensorMemoryObj,
)

from conftest import SLOT, shm_path  # noqa: E402

SLOTS = 512
GB = SLOTS * SLOT / 2**30


def spec(kind: str, path: str) -> dict:
    with open(path, "wb") as f:  # LMCache's DaxCore and the engine map an existing file
        f.truncate(SLOTS * SLOT)
    if kind == "native_plugin":
        return {
            "type": "native_plugin",
            "module_path": "daxkv",
            "class_name": "DaxConnector",
            "adapter_params": {
                "slot_bytes": SLOT,
                "device_path": path,
                "max_dax_size_gb": GB,
                "num_load_workers": 2,
            },
            "max_capacity_gb": GB,
        }
    return {"type": "dax", "device_path": path, "max_dax_size_gb": GB, "slot_bytes": SLOT}


@pytest.fixture(params=["native_plugin", "dax"])
def adapter(request):
    path = shm_path()
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    args = parser.parse_args(["--l2-adapter", json.dumps(spec(request.param, path))])
    cfg = parse_args_to_l2_adapters_config(args)
    a = create_l2_adapter(cfg.adapters[0])
    if request.param == "native_plugin":
        assert type(a).__name__ == "NativeConnectorL2Adapter"
        assert type(a._client).__name__ == "DaxConnector"
    yield a
    a.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def obj(data: bytes | int) -> TensorMemoryObj:
    n = data if isinstance(data, int) else len(data)
    t = torch.zeros(n, dtype=torch.uint8)
    if not isinstance(data, int):
        t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    meta = MemoryObjMetadata(
        shape=torch.Size([n]),
        dtype=torch.uint8,
        address=0,
        phy_size=n,
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
        shapes=[torch.Size([n])],
        dtypes=[torch.uint8],
    )
    return TensorMemoryObj(t, meta, None)


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(8, "big"), model_name="m", kv_rank=0, cache_salt=salt)


def wait_fd(fd: int, timeout_s: float = 20.0) -> None:
    """As LMCache's controllers: poll for POLLIN, then drain the counter."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    assert p.poll(int(timeout_s * 1000)), f"fd {fd} never signalled"
    try:
        os.read(fd, 8)
    except BlockingIOError:
        pass


def stores(a, ids: set[int]) -> dict:
    got: dict = {}
    deadline = time.monotonic() + 30
    while not ids.issubset(got):
        assert time.monotonic() < deadline
        got.update(a.pop_completed_store_tasks())
        if not ids.issubset(got):
            wait_fd(a.get_store_event_fd(), 1.0) if _readable(a.get_store_event_fd()) else None
    return got


def _readable(fd: int, ms: int = 200) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(ms))


def result(a, query, fd: int, tid: int):
    deadline = time.monotonic() + 30
    while True:
        r = query(tid)
        if r is not None:
            return r
        assert time.monotonic() < deadline, f"task {tid} never finished"
        if _readable(fd):
            try:
                os.read(fd, 8)
            except BlockingIOError:
                pass


def bits(b, n: int) -> list[bool]:
    return [bool(b.test(i)) for i in range(n)]


def test_store_lookup_load_delete(adapter):
    a = adapter
    fds = {a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()}
    assert len(fds) == 3
    n = 40
    keys = [key(i, salt="s" if i % 5 == 0 else "") for i in range(n)]
    sizes = [SLOT] * (n - 1) + [SLOT // 3 + 7]  # a tail chunk
    data = [os.urandom(s) for s in sizes]
    # Many tasks in flight before any result is collected.
    # The caller keeps the objects alive until the stores complete (the L2
    # contract): the bridge's memoryviews do not own the tensors.
    srcs = [obj(d) for d in data]
    ids = {a.submit_store_task(keys[i : i + 8], srcs[i : i + 8]) for i in range(0, n, 8)}
    got = stores(a, ids)
    del srcs
    assert all(int(got[t]) >= 0 for t in ids), got

    absent = [key(10_000 + i) for i in range(3)]
    tid = a.submit_lookup_and_lock_task(keys + absent, {})
    bm = result(a, a.query_lookup_and_lock_result, a.get_lookup_and_lock_event_fd(), tid)
    assert bits(bm, n + 3) == [True] * n + [False] * 3
    assert bm.count_leading_ones() == n

    dsts = [obj(s) for s in sizes]
    tids = [a.submit_load_task(keys[i : i + 10], dsts[i : i + 10]) for i in range(0, n, 10)]
    for i, t in zip(range(0, n, 10), tids):
        bm = result(a, a.query_load_result, a.get_load_event_fd(), t)
        assert bits(bm, 10) == [True] * 10
    assert [bytes(d.byte_array) for d in dsts] == data
    a.submit_unlock(keys)

    a.delete(keys[:10])
    tid = a.submit_lookup_and_lock_task(keys, {})
    bm = result(a, a.query_lookup_and_lock_result, a.get_lookup_and_lock_event_fd(), tid)
    assert bits(bm, n) == [False] * 10 + [True] * (n - 10)
    a.submit_unlock(keys[10:])
    miss = [obj(s) for s in sizes[:2]]
    tid = a.submit_load_task(keys[:2], miss)
    assert bits(result(a, a.query_load_result, a.get_load_event_fd(), tid), 2) == [False, False]
    assert a.report_status()["is_healthy"]


def test_two_threads_submitting_at_once(adapter):
    a = adapter
    lock = threading.Lock()  # one collector at a time per result kind
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            for r in range(10):
                ks = [key(100_000 * (t + 1) + r * 16 + i) for i in range(6)]
                ds = [os.urandom(SLOT if i < 5 else 999) for i in range(6)]
                srcs = [obj(d) for d in ds]  # alive until the store completes
                tid = a.submit_store_task(ks, srcs)
                deadline = time.monotonic() + 30
                while True:
                    # pop_completed_store_tasks hands every finished store to
                    # whichever thread pops: share them, as the store
                    # controller's one dict would.
                    with lock:
                        shared.update(a.pop_completed_store_tasks())
                        res = shared.pop(tid, None)
                    if res is not None:
                        assert int(res) >= 0
                        break
                    assert time.monotonic() < deadline, f"store {tid} never completed"
                    time.sleep(0.001)
                dst = [obj(len(d)) for d in ds]
                lt = a.submit_load_task(ks, dst)
                bm = result(a, a.query_load_result, a.get_load_event_fd(), lt)
                assert bits(bm, 6) == [True] * 6
                assert [bytes(d.byte_array) for d in dst] == ds
                a.delete(ks)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    shared: dict = {}
    ts = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
        assert not t.is_alive(), "a submitting thread hung"
    assert not errors, errors
    assert not shared
