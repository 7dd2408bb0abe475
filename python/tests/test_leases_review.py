"""Hostile review of the Python leases, observers and daxkv.cuda: each test
here failed on the code it was written against (see the report)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np

import daxkv
from conftest import SLOT, drain_until
from fake_cuda import FakeRuntime, FakeTensor


def exists(c: daxkv.DaxConnector, keys: list[str]) -> list[bool]:
    f = c.submit_batch_exists(keys)
    return drain_until(c, {f})[f][2]


def test_gpu_direct_never_answers_stored_for_a_key_another_lease_holds(make_connector):
    """`store_from_gpu` answers per key "stored (or already present)", and
    maps every `None` from `lease_store` to True; but `None` also means
    "leased already" by a lease that has not committed and may never
    commit (docs/leases.md: a store of a leased key must never answer
    success). Here the other lease aborts: the key GpuDirect answered
    stored is not stored at all."""
    from daxkv.cuda import GpuDirect

    c = make_connector()
    (other,) = c.lease_store(["k"], [16])
    assert isinstance(other, daxkv.StoreLease)
    g = GpuDirect(c, FakeRuntime())
    try:
        src = FakeTensor(np.arange(16, dtype=np.uint8))
        answered = g.store_from_gpu(["k"], [src])
        other.abort()
        assert answered == exists(c, ["k"]), (
            f"store_from_gpu answered {answered} but the key is "
            f"{'stored' if exists(c, ['k'])[0] else 'not stored'}"
        )
    finally:
        g.close()


def run_script(body: str, tmp_path, timeout: float = 60) -> subprocess.CompletedProcess:
    script = textwrap.dedent(
        f"""
        import json, sys, threading, time, urllib.request, urllib.error, daxkv
        SLOT = {SLOT}
        def request(addr, path, body):
            req = urllib.request.Request("http://" + addr + path, data=json.dumps(body).encode(),
                                         method="POST", headers={{"Content-Type": "application/json"}})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()
        """
    ) + textwrap.dedent(body)
    try:
        return subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"deadlocked (no exit in {timeout} s): {e.stdout!r} {e.stderr!r}")


def test_releasing_a_read_lease_never_deadlocks_a_thread_asking_is_open(tmp_path):
    """`ReadLease.release` drops the engine lease while it holds the
    lease's own mutex (the guard is a temporary of the statement
    `drop(self.lease.lock()...take())`). When that drop is the last use of
    a removed device, the device's `unmapping` observer runs there and
    takes the GIL; any thread holding the GIL that touches the same lease
    (`is_open`, `repr`) waits on that mutex: a deadlock. docs/leases.md:
    every call that may wait on a lock an observer callback holds must
    release the GIL first."""
    r = run_script(
        """
        c = daxkv.DaxConnector(slot_bytes=SLOT, device_path="memfd",
                               max_dax_size_gb=16 * SLOT / 2**30, hotplug_enabled=True,
                               http={"port": 0})
        st, body = request(c.http_address, "/reconfigure/dax/l2/add",
                           {"device_path": "memfd:two", "size": 16 * SLOT})
        assert st == 200, body
        # A key on device 1 (the emptier one gets the next lease).
        key = None
        for i in range(8):
            (l,) = c.lease_store(["k%d" % i], [8])
            l.write(b"x" * 8)
            dev = l.device
            l.commit()
            if dev == 1:
                key = "k%d" % i
                break
        assert key is not None
        (rl,) = c.lease_load([key])
        assert rl.device == 1
        entered = threading.Event()
        class Obs:
            def mapped(self, d, b, n, e): pass
            def unmapping(self, d, b, n, e):
                if d == 1:
                    entered.set()
                    time.sleep(0.5)
        c.observe(Obs())
        st, body = request(c.http_address, "/reconfigure/dax/l2/remove",
                           {"device_path": "memfd:two", "mode": "migrate", "force": True})
        assert st == 200, body
        t = threading.Thread(target=rl.release, daemon=True)
        t.start()
        assert entered.wait(10), "the removed device's unmapping came at the release"
        print("open?", rl.is_open, flush=True)
        t.join()
        print("ok", flush=True)
        """,
        tmp_path,
        timeout=30,
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_dropping_a_connector_never_deadlocks_with_an_observer_callback(tmp_path):
    """A connector dropped without `close()` (garbage: LMCache let go of
    it) closes its engine from `Drop`, with the GIL held, and that close
    waits for the engine's admin lock. A control-plane resize holds that
    lock while it runs the observers, whose Python callback needs the
    GIL: neither ever goes on. `close()` releases the GIL for this very
    reason (python/src/lease.rs, docs/leases.md); the drop does not."""
    r = run_script(
        """
        c = daxkv.DaxConnector(slot_bytes=SLOT, device_path="memfd",
                               max_dax_size_gb=16 * SLOT / 2**30, hotplug_enabled=True,
                               http={"port": 0})
        addr = c.http_address
        entered = threading.Event()
        class Obs:
            def mapped(self, d, b, n, e):
                if e == 2:
                    entered.set()
                    time.sleep(0.5)
            def unmapping(self, d, b, n, e): pass
        c.observe(Obs())
        out = []
        t = threading.Thread(target=lambda: out.append(
            request(addr, "/reconfigure/dax/l2/resize", {"device_index": 0, "size": 32 * SLOT})),
            daemon=True)
        t.start()
        assert entered.wait(10)
        del c  # the last reference: DaxConnector's Drop, with the GIL held
        t.join(20)
        print("ok", out, flush=True)
        """,
        tmp_path,
        timeout=30,
    )
    assert r.returncode == 0 and "ok" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])
