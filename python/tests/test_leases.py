"""Slot leases, mapping observers and ``daxkv.cuda`` from Python
(docs/leases.md; python/README.md "Leases" and "GPU-direct"): numpy arrays
stand in for GPU memory and ``fake_cuda.FakeRuntime`` for CUDA, checking
every registration and copy against /proc/self/maps. Real connectors over
memfds, a real control plane on 127.0.0.1 for hotplug."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import daxkv
from conftest import SLOT, drain_until
from fake_cuda import FakeRuntime, FakeTensor, InjectedError, mapped
from test_control import request


def arr(i: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint32) * 31 + i * 7) & 0xFF).astype(np.uint8)


def leases_open(c: daxkv.DaxConnector) -> int:
    return int(
        sum(float(v) for v in re.findall(r"^daxkv_leases\{[^}]*\} (\S+)$", c.metrics_text(), re.M))
    )


def exists(c: daxkv.DaxConnector, keys: list[str]) -> list[bool]:
    f = c.submit_batch_exists(keys)
    return drain_until(c, {f})[f][2]


def test_store_leases_fill_by_dma_stand_in_then_commit(make_connector):
    c = make_connector()
    keys = [f"l@{i}" for i in range(4)]
    srcs = [arr(i, 1000 + i) for i in range(4)]
    got = c.lease_store(keys, [s.nbytes for s in srcs])
    assert all(isinstance(l, daxkv.StoreLease) for l in got), got
    for l, s in zip(got, srcs):
        assert l.size == s.nbytes and l.offset % SLOT == 0 and l.epoch == 1 and l.is_open
        # A copy engine's write, through the raw pointer.
        ctypes.memmove(l.ptr, s.ctypes.data, s.nbytes)
    assert leases_open(c) == 4
    # In flight until the commit: invisible, and a store of it fails.
    assert exists(c, keys) == [False] * 4
    f = c.submit_batch_set(keys[:1], [memoryview(b"x" * 10)])
    assert drain_until(c, {f})[f][0] is False
    (again,) = c.lease_store(keys[:1], [10])
    assert isinstance(again, daxkv.LeaseError) and "in flight" in str(again), again
    assert c.commit_leases(got) == [True] * 4
    assert leases_open(c) == 0
    assert exists(c, keys) == [True] * 4
    with pytest.raises(daxkv.LeaseError, match="already ended"):
        got[0].commit()
    # Read leases: the bytes, read by pointer and by copy.
    reads = c.lease_load(keys + ["l@missing"])
    assert reads[4] is None
    for r, s in zip(reads[:4], srcs):
        out = np.zeros(r.size, dtype=np.uint8)
        ctypes.memmove(out.ctypes.data, r.ptr, r.size)
        assert (out == s).all()
        back = bytearray(SLOT)
        assert r.read(back) == s.nbytes and bytes(back[: s.nbytes]) == s.tobytes()
        r.release()
        assert not r.is_open
    # A stored key: no lease, no pointer.
    assert c.lease_store(keys[:1], [1]) == [None]


def test_refused_leases_say_why_and_abandoned_ones_free_their_slots(make_connector):
    c = make_connector(max_dax_size_gb=2 * SLOT / 2**30)
    got = c.lease_store(["a", "b", "c", "big"], [10, 10, 10, SLOT + 1])
    assert isinstance(got[0], daxkv.StoreLease) and isinstance(got[1], daxkv.StoreLease)
    assert isinstance(got[2], daxkv.LeaseError) and "no free slot" in str(got[2]).lower() or "full" in str(got[2]).lower(), got[2]
    assert isinstance(got[3], daxkv.LeaseError) and "exceeds the slot size" in str(got[3]), got[3]
    with pytest.raises(ValueError, match="2 keys but 1"):
        c.lease_store(["x", "y"], [1])
    with got[0]:
        got[0].write(b"abc")
        with pytest.raises(ValueError, match="outside"):
            got[0].write(b"z" * 11)
    assert not got[0].is_open, "leaving the block aborted it"
    del got
    import gc

    gc.collect()
    assert leases_open(c) == 0, "a dropped lease is aborted"
    assert exists(c, ["a", "b"]) == [False, False]
    got = c.lease_store(["a", "b"], [1, 1])
    assert all(isinstance(l, daxkv.StoreLease) for l in got), "both slots free again"
    for l in got:
        l.abort()


def observer_log():
    events: list[tuple[str, int, int]] = []

    class Obs:
        def mapped(self, device, base, length, epoch):
            assert mapped(base, length)
            events.append(("mapped", device, epoch))

        def unmapping(self, device, base, length, epoch):
            assert mapped(base, length)
            events.append(("unmapping", device, epoch))

    return Obs(), events


def resize(addr: str, index: int, size: int) -> None:
    status, body = request(
        addr, "POST", "/reconfigure/dax/l2/resize", {"device_index": index, "size": size}
    )
    assert status == 200, body


def test_observers_follow_remaps_and_close(make_connector):
    c = make_connector(hotplug_enabled=True, http={"port": 0})
    obs, events = observer_log()
    assert c.observe(obs)
    assert not c.observe(obs), "registered once"
    assert events == [("mapped", 0, 1)]
    ((dev, base, length, epoch),) = c.regions()
    assert (dev, epoch) == (0, 1) and mapped(base, length)
    resize(c.http_address, 0, 2 * length)
    assert events[1:] == [("unmapping", 0, 1), ("mapped", 0, 2)]
    # A lease blocks a remap: 409 with the count.
    (l,) = c.lease_store(["k"], [8])
    status, body = request(
        c.http_address, "POST", "/reconfigure/dax/l2/resize", {"device_index": 0, "size": length}
    )
    assert status == 409 and '"lease_count":1' in body.replace(" ", ""), body
    l.commit()
    assert c.unobserve(obs) and not c.unobserve(obs)
    c.close()
    assert events[3:] == [], "not told after unobserve"


def test_an_observer_never_deadlocks_against_a_thread_holding_the_gil(tmp_path):
    """Remaps over HTTP (whose observer callbacks need the GIL) while the
    main thread holds the GIL and calls the connector in a loop: every
    call releases the GIL before it waits on an engine lock, so neither
    waits for ever. In a subprocess: a deadlock fails on the timeout
    instead of hanging the suite."""
    script = textwrap.dedent(
        f"""
        import json, threading, urllib.error, urllib.request, daxkv
        c = daxkv.DaxConnector(slot_bytes={SLOT}, device_path="memfd",
                               max_dax_size_gb={64 * SLOT / 2**30}, hotplug_enabled=True,
                               http={{"port": 0}})
        seen = []
        class Obs:
            def mapped(self, d, b, n, e): seen.append(e)
            def unmapping(self, d, b, n, e): pass
        c.observe(Obs())
        stop = False
        def remaps():
            for i in range(40):
                size = {SLOT} * (64 + (i % 2) * 64)
                req = urllib.request.Request(
                    "http://" + c.http_address + "/reconfigure/dax/l2/resize",
                    data=json.dumps({{"device_index": 0, "size": size}}).encode(),
                    method="POST", headers={{"Content-Type": "application/json"}})
                while True:  # 409 while the main thread holds its lease
                    try:
                        urllib.request.urlopen(req, timeout=30).read()
                        break
                    except urllib.error.HTTPError as e:
                        assert e.code == 409, e

        t = threading.Thread(target=remaps)
        t.start()
        n = 0
        while t.is_alive():
            c.regions(); c.lease_load(["x"])
            for l in c.lease_store(["k%d" % n], [8]):
                if isinstance(l, daxkv.StoreLease):
                    l.abort()
            n += 1
        t.join()
        # The first resize asks for the size it has: 39 remaps.
        assert seen == list(range(1, 41)), seen
        c.close()
        print("ok", n)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=90, cwd=tmp_path
    )
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]


def test_import_daxkv_and_daxkv_cuda_without_torch(tmp_path):
    script = "import sys; sys.modules['torch'] = None\n" + textwrap.dedent(
        """
        import daxkv, daxkv.cuda
        try:
            daxkv.cuda.DriverRuntime()
        except ImportError:
            print("ok")
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def gpu(i: int, n: int) -> FakeTensor:
    return FakeTensor(arr(i, n))


def test_gpu_direct_round_trip_into_fragmented_slots(make_connector):
    from daxkv.cuda import GpuDirect

    c = make_connector(max_dax_size_gb=64 * SLOT / 2**30)
    # Fragment the slots: store 32 keys, delete every other one.
    fill = [f"f@{i}" for i in range(32)]
    f = c.submit_batch_set(fill, [memoryview(b"." * 100)] * 32)
    assert drain_until(c, {f})[f][0]
    f = c.submit_batch_delete(fill[::2])
    drain_until(c, {f})
    rt = FakeRuntime(leases_open=lambda: leases_open(c))
    with GpuDirect(c, rt) as g:
        assert len(rt.registered) == 1 and g.registered(0, 1)
        sizes = [SLOT, 4096, SLOT // 2, 1, SLOT]
        keys = [f"g@{i}" for i in range(len(sizes))]
        src = [gpu(i, n) for i, n in enumerate(sizes)]
        assert g.store_from_gpu(keys, src) == [True] * len(keys)
        assert rt.synced_with_open_leases, "the wait came before the commit"
        assert leases_open(c) == 0 and exists(c, keys) == [True] * len(keys)
        # Already present: success, nothing copied.
        before = rt.copies
        assert g.store_from_gpu(keys[:1], src[:1]) == [True] and rt.copies == before
        dst = [FakeTensor(np.zeros(SLOT, dtype=np.uint8)) for _ in keys]
        assert g.load_to_gpu(keys + ["g@none"], dst + [FakeTensor(np.zeros(8, np.uint8))]) == [True] * len(keys) + [False]
        for s, d in zip(src, dst):
            assert (d.arr[: s.nbytes] == s.arr).all()
        # A tensor smaller than the payload: that key fails, nothing copied into it.
        small = FakeTensor(np.zeros(10, dtype=np.uint8))
        assert g.load_to_gpu(keys[:1], [small]) == [False] and not small.arr.any()
        # Bad tensors: named, nothing leased.
        with pytest.raises(ValueError, match="tensor 1: not contiguous"):
            g.store_from_gpu(["b0", "b1"], [gpu(0, 8), FakeTensor(np.zeros((4, 4), np.uint8)[:, :2])])
        with pytest.raises(ValueError, match="tensor 0: not on a GPU"):
            g.store_from_gpu(["b0"], [FakeTensor(arr(0, 8), on_gpu=False)])
        with pytest.raises(ValueError, match="more than slot_bytes"):
            g.store_from_gpu(["b0"], [gpu(0, SLOT + 1)])
        assert leases_open(c) == 0 and exists(c, ["b0", "b1"]) == [False, False]
    assert rt.registered == {}, "close unregistered every mapping"


def test_gpu_direct_follows_hotplug(make_connector, dax_file):
    from daxkv.cuda import GpuDirect

    c = make_connector(hotplug_enabled=True, http={"port": 0}, max_dax_size_gb=16 * SLOT / 2**30)
    rt = FakeRuntime(leases_open=lambda: leases_open(c))
    g = GpuDirect(c, rt)
    resize(c.http_address, 0, 32 * SLOT)
    with open(dax_file, "wb") as f:
        f.truncate(16 * SLOT)
    status, body = request(c.http_address, "POST", "/reconfigure/dax/l2/add", {"device_path": dax_file, "size": 16 * SLOT})
    assert status == 200, body
    regions = c.regions()
    assert sorted(rt.registered.items()) == sorted((b, n) for _, b, n, _ in regions)
    kinds = [k for k, _, _ in rt.log]
    assert kinds == ["register", "unregister", "register", "register"], rt.log
    keys = [f"h@{i}" for i in range(24)]
    assert g.store_from_gpu(keys, [gpu(i, 3000) for i in range(24)]) == [True] * 24
    status, body = request(c.http_address, "POST", "/reconfigure/dax/l2/remove", {"device_path": dax_file, "mode": "migrate"})
    assert status == 200, body
    assert len(rt.registered) == 1, "the removed device's mapping was unregistered"
    dst = [FakeTensor(np.zeros(3000, dtype=np.uint8)) for _ in keys]
    assert g.load_to_gpu(keys, dst) == [True] * 24
    assert all((d.arr == arr(i, 3000)).all() for i, d in enumerate(dst))
    g.close()
    assert rt.registered == {}


def test_an_unpinnable_mapping_falls_back_to_the_staged_path(make_connector):
    from daxkv.cuda import GpuDirect

    c = make_connector()
    rt = FakeRuntime(unpinnable=lambda base, length: True)
    with pytest.warns(RuntimeWarning, match="staged path"):
        g = GpuDirect(c, rt)
    assert g.registered(0, 1) is False and rt.registered == {}
    keys = ["s0", "s1"]
    assert g.store_from_gpu(keys, [gpu(0, 5000), gpu(1, 7)]) == [True, True]
    dst = [FakeTensor(np.zeros(5000, np.uint8)), FakeTensor(np.zeros(7, np.uint8))]
    assert g.load_to_gpu(keys, dst) == [True, True]
    assert (dst[0].arr == arr(0, 5000)).all() and (dst[1].arr == arr(1, 7)).all()
    g.close()


@pytest.mark.parametrize("way", ["store", "load"])
def test_an_exception_between_copy_and_wait_never_frees_a_busy_slot(make_connector, way):
    """The third copy of eight raises: the two already queued (still
    "running" on the fake copy engine until the wait) must be waited for
    while their leases are open, and only then the leases end."""
    from daxkv.cuda import GpuDirect

    c = make_connector()
    keys = [f"x@{i}" for i in range(8)]
    ok = GpuDirect(c, FakeRuntime())
    assert ok.store_from_gpu(keys, [gpu(i, 2000) for i in range(8)]) == [True] * 8
    ok.close()
    rt = FakeRuntime(fail_copy_at=3, leases_open=lambda: leases_open(c))
    g = GpuDirect(c, rt)
    with pytest.raises(InjectedError):
        if way == "store":
            g.store_from_gpu([f"y@{i}" for i in range(8)], [gpu(i, 2000) for i in range(8)])
        else:
            g.load_to_gpu(keys, [FakeTensor(np.zeros(2000, np.uint8)) for _ in keys])
    assert rt.synced_with_open_leases and rt.synced_with_open_leases[-1] > 0
    assert rt.pending == [], "every queued copy was waited for"
    assert leases_open(c) == 0, "and then every lease ended"
    if way == "store":
        assert exists(c, [f"y@{i}" for i in range(8)]) == [False] * 8
    g.close()


def test_gpu_check_script_runs_or_says_why_not():
    """scripts/gpu-check.sh with this interpreter: on a machine without a
    GPU it is skipped (exit 77, saying why); with one, a short run must
    verify its bytes."""
    import os
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, DAXKV_GPU_PYTHON=sys.executable)
    site = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p.endswith("site")]
    if site:
        env["DAXKV_SITE"] = site[0]
    r = subprocess.run(
        ["bash", str(root / "scripts/gpu-check.sh"), "--sizes", "64K,2M", "--total-mib", "16", "--rounds", "1"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    if r.returncode == 77:
        assert "skipped" in r.stderr, r.stderr
    else:
        assert r.returncode == 0 and "bytes verified" in r.stdout, r.stdout + r.stderr


def test_registration_pieces_are_whole_slots_of_at_most_64_gib():
    from daxkv.cuda import REGISTER_PIECE_MAX, pieces

    slot = 3 << 20  # 64 GiB is not a whole number of these
    base = 1 << 40
    length = 50 * REGISTER_PIECE_MAX // 7 // slot * slot
    ps = pieces(base, length, slot)
    assert ps[0][0] == base and sum(n for _, n in ps) == length
    for (b, n), (b2, _) in zip(ps, ps[1:]):
        assert b + n == b2, "contiguous"
    for b, n in ps:
        assert n <= REGISTER_PIECE_MAX and (b - base) % slot == 0 and n % slot == 0
    assert len(ps) == -(-length // (REGISTER_PIECE_MAX // slot * slot))
    assert pieces(base, 8 * slot, slot) == [(base, 8 * slot)]


def test_a_gpu_direct_nobody_closed_is_collected_and_unregisters(make_connector):
    """The connector holds its observer in Rust, out of the garbage
    collector's sight: a GpuDirect dropped without close() is still
    collected, and unregisters its mappings; one whose connector closed
    first was told unmapping by the close."""
    import gc
    import weakref

    from daxkv.cuda import GpuDirect

    c = make_connector()
    rt = FakeRuntime()
    g = GpuDirect(c, rt)
    assert len(rt.registered) == 1
    w = weakref.ref(g)
    del g
    gc.collect()
    assert w() is None, "collected"
    assert rt.registered == {}, "its mapping unregistered"
    d = make_connector()
    rt2 = FakeRuntime()
    g2 = GpuDirect(d, rt2)
    d.close()
    assert rt2.registered == {}, "the connector's close told unmapping"
    g2.close()
    g2.close()
