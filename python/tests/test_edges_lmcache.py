"""The LMCache faces at their edges, inside LMCache 0.5.6: exit with
LMCache-style controller threads still running, fork() after open on the
plugin adapter and the non-MP backend, listeners that raise, str / bytes
keys on the plugin path, caller-fault open errors through LMCache's own
factory and constructor. Skipped without LMCache."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("torch")

from lmcache.v1.platform import consume_fd  # noqa: E402

from test_backend import dx, key as bkey, kv, same  # noqa: E402,F401
from test_edges import in_child, refused_in_child  # noqa: E402
from test_l2_adapter import (  # noqa: E402,F401
    GB,
    SLOT,
    Events,
    build,
    drain_stores,
    made,
    params,
    plugin,
    store,
    wait_result,
)
from test_lmcache import bits, key, obj  # noqa: E402

# -- interpreter exit, LMCache's controllers' calls --------------------------------

_CONTROLLERS = """
import os, select, threading
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from test_l2_adapter import parse
from test_lmcache import key, obj

a = create_l2_adapter(parse({"type": "plugin", "module_path": "daxkv.lmcache",
    "class_name": "DaxL2Adapter", "adapter_params": {"slot_bytes": 65536,
    "device_path": "memfd", "max_dax_size_gb": 64 * 65536 / 2**30,
    "num_load_workers": 1, "spin_us": 0}}))
ready = threading.Barrier(4, timeout=60)

def loop(body):
    def run():
        n = 0
        while True:
            body(n)
            n += 1
            if n == 20:
                ready.wait()
    return run

# Made once: torch's own calls release the GIL in C++ frames, which a
# daemon thread must not be in at exit either (not daxkv's to fix).
objs = [obj(4096) for _ in range(8)]

def store_ctrl(n):  # submit, poll the store fd, pop (LMCache's store loop)
    a.submit_store_task([key(n % 8)], [objs[n % 8]])
    select.poll().poll(1)
    a.pop_completed_store_tasks()

def prefetch_ctrl(n):  # lookup and lock, query, unlock
    ks = [key(i) for i in range(8)]
    t = a.submit_lookup_and_lock_task(ks, {})
    while a.query_lookup_and_lock_result(t) is None:
        pass
    a.submit_unlock(ks)

def eviction_ctrl(n):  # usage, delete
    a.get_usage()
    a.delete([key(n % 8)])
    a.report_status()

for body in (store_ctrl, prefetch_ctrl, eviction_ctrl):
    threading.Thread(target=loop(body), daemon=True).start()
ready.wait()
print("exiting with controllers running", flush=True)
"""


def test_exit_with_lmcache_controller_threads_running_exits_0() -> None:
    """LMCache's store, prefetch and eviction controllers are daemon
    threads calling the adapter in a loop; a process that exits without
    stopping them exits 0 (it aborted with SIGABRT, exit 134)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for run in range(3):
        p = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_CONTROLLERS)],
            capture_output=True, text=True, timeout=180, cwd=here,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                [here, os.environ.get("PYTHONPATH", "")])),
        )
        assert "exiting with controllers running" in p.stdout, p.stderr[-3000:]
        assert p.returncode == 0, f"run {run}: exit status {p.returncode}: {p.stderr[-3000:]}"
        assert "FATAL" not in p.stderr


# -- fork after open ------------------------------------------------------------


def test_fork_after_open_l2_adapter(plugin) -> None:
    """DaxL2Adapter in a forked child: every call raises RuntimeError,
    close() is silent, the parent's keys and slots are untouched."""
    a = plugin()
    k = key(1)
    assert store(a, [k], [obj(b"p" * 3000)]).is_successful()

    def child() -> str:
        bad = refused_in_child({
            "submit_store_task": lambda: a.submit_store_task([key(2)], [obj(100)]),
            "submit_lookup_and_lock_task": lambda: a.submit_lookup_and_lock_task([k], {}),
            "submit_load_task": lambda: a.submit_load_task([k], [obj(3000)]),
            "pop_completed_store_tasks": a.pop_completed_store_tasks,
            "delete": lambda: a.delete([k]),
            "get_usage": a.get_usage,
            "submit_unlock": lambda: a.submit_unlock([k]),
        })
        a.close()
        return bad or "ok"

    assert in_child(child) == (0, "ok")
    assert a._core.exists([k, key(2)]) == [True, False]
    dst = obj(3000)
    tid = a.submit_load_task([k], [dst])
    bm = wait_result(a, a.query_load_result, a.get_load_event_fd(), tid)
    assert bits(bm, 1) == [True] and bytes(dst.byte_array) == b"p" * 3000


def test_fork_after_open_backend(dx) -> None:
    """DaxBackend (built by LMCache's launcher) in a forked child: its calls
    raise RuntimeError, close() is silent; the parent reads its bytes."""
    b = dx.launch(slots=16)
    o = kv(dx.lcb, 1)
    futs = b.batched_submit_put_task([bkey(1)], [o])
    for f in futs or []:
        f.result(timeout=30)

    def child() -> str:
        bad = refused_in_child({
            "contains": lambda: b.contains(bkey(1)),
            "batched_remove": lambda: b.batched_remove([bkey(1)]),
            "get_blocking": lambda: b.get_blocking(bkey(1)),
        })
        b.close()
        return bad or "ok"

    assert in_child(child) == (0, "ok")
    assert b.contains(bkey(1))
    assert same(b.get_blocking(bkey(1)), o)


# -- listeners that raise ----------------------------------------------------------


class RaisesOnce(Events):
    """A listener that raises on its first "stored" / "accessed" event."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = {"stored": True, "accessed": True}

    def on_l2_keys_stored(self, keys, sizes):
        if self.armed["stored"]:
            self.armed["stored"] = False
            raise RuntimeError("listener failed (stored)")
        super().on_l2_keys_stored(keys, sizes)

    def on_l2_keys_accessed(self, keys):
        if self.armed["accessed"]:
            self.armed["accessed"] = False
            raise RuntimeError("listener failed (accessed)")
        super().on_l2_keys_accessed(keys)


def _readable(fd: int, ms: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(ms))


def test_a_raising_listener_does_not_lose_the_store_result(plugin) -> None:
    """The store controller's loop (poll the fd, consume it, pop; an
    exception is logged and the loop goes on): the pop that meets the
    raising listener raises, the fd is signalled again, and the next pop
    returns the result, so the controller releases the task's L1 locks
    (the result is not popped from the core, then lost)."""
    a = plugin()
    lis = RaisesOnce()
    a.register_listener(lis)
    tid = a.submit_store_task([key(1)], [obj(1000)])
    fd = a.get_store_event_fd()
    got: dict = {}
    raised = 0
    deadline = time.monotonic() + 30
    while tid not in got:
        assert time.monotonic() < deadline, f"the store result never came ({raised=})"
        if not _readable(fd, 200):
            continue
        consume_fd(fd)
        try:
            got.update(a.pop_completed_store_tasks())
        except RuntimeError as e:
            assert "listener failed" in str(e)
            raised += 1
    assert raised == 1 and got[tid].is_successful()
    # Told exactly once (after the raise, to the listeners that follow it
    # and the byte counters); counted once.
    assert a.get_usage().total_bytes_used > 0
    assert a.pop_completed_store_tasks() == {}


def _pop_through_raises(a, done, message: str) -> tuple[dict, int]:
    """The store controller's loop until `done(results)`: pop, counting the
    calls a listener made raise (with `message`), poll the store fd."""
    got: dict = {}
    raised = 0
    deadline = time.monotonic() + 30
    while not done(got):
        assert time.monotonic() < deadline, f"never done ({raised=}, {got=})"
        try:
            got.update(a.pop_completed_store_tasks())
        except RuntimeError as e:
            assert message in str(e)
            raised += 1
        _readable(a.get_store_event_fd(), 50)
    return got, raised


def test_deletes_wait_out_a_raising_stored_listener(plugin) -> None:
    """The pop tells the deletes the core reported, then the call's
    "stored" event. A listener raising on the "stored" event must not cost
    the deletes: the byte counters and every listener hear each once."""
    a = plugin()
    lis = Events()
    a.register_listener(lis)
    assert store(a, [key(1)], [obj(1000)]).is_successful()
    used = a.get_usage().total_bytes_used
    assert used > 0
    # Deleted in the core, not through the adapter's delete (which reports
    # at once): the next pop reports it, in the call that tells key 2.
    assert a._core.delete([key(1)]) == [True]
    raising = RaisesOnce()
    a.register_listener(raising)
    tid = a.submit_store_task([key(2)], [obj(1001)])
    got, raised = _pop_through_raises(a, lambda got: tid in got, "listener failed (stored)")
    assert raised == 1 and got[tid].is_successful()
    assert lis.deleted.count(key(1)) == 1, lis.deleted
    assert raising.deleted.count(key(1)) == 1
    # Key 1's slot left the books; key 2's is in them.
    assert a.get_usage().total_bytes_used == used
    assert a.pop_completed_store_tasks() == {}
    assert lis.deleted.count(key(1)) == 1


class RaisesOnDeleted(Events):
    """Raises on the first "deleted" event it is told, records the rest."""

    armed = True

    def on_l2_keys_deleted(self, keys):
        if self.armed:
            self.armed = False
            raise RuntimeError("listener failed (deleted)")
        super().on_l2_keys_deleted(keys)


def _a_delete_due_and_a_listener_raising_on_it(plugin):
    """An adapter whose next pop tells key 1's delete (stored, then deleted
    in the core, not through the adapter's delete, which reports at once),
    with a recording listener and, after it, one raising on that delete."""
    a = plugin()
    lis = Events()
    a.register_listener(lis)
    assert store(a, [key(1)], [obj(1000)]).is_successful()
    assert a._core.delete([key(1)]) == [True]
    a.register_listener(RaisesOnDeleted())
    return a, lis


def test_a_raising_deleted_listener_keeps_the_calls_stored_event(plugin) -> None:
    """Deletes are told first; a listener raising on them must not cost
    the same call's "stored" event: it is told on the next call, once,
    and its key's later delete is told after it."""
    a, lis = _a_delete_due_and_a_listener_raising_on_it(plugin)
    tid = a.submit_store_task([key(2)], [obj(1001)])
    got, raised = _pop_through_raises(
        a, lambda got: tid in got and lis.stored.count(key(2)), "listener failed (deleted)"
    )
    assert raised == 1 and got[tid].is_successful()
    assert lis.stored.count(key(2)) == 1 and lis.deleted.count(key(1)) == 1
    # Key 2's delete, reported at once by the adapter's delete, comes after
    # its "stored" event (its ticket was held back with it).
    a.delete([key(2)])
    assert lis.deleted.count(key(2)) == 1
    assert a.pop_completed_store_tasks() == {}
    assert lis.stored.count(key(2)) == 1


def test_kept_stored_events_merge_with_the_next_calls(plugin) -> None:
    """A "stored" event kept behind a raising "deleted" listener is told
    with the next call's, as one event: each key with its own size — a
    first store's `slot_bytes` (the core sends no sizes when all are first
    stores) and a re-store's 0 — in the order stored, and the byte
    counters count each slot once."""
    a, lis = _a_delete_due_and_a_listener_raising_on_it(plugin)
    fd = a.get_store_event_fd()
    consume_fd(fd)
    # The only task in flight: once the fd is written it is complete, and
    # the pop that raises collects it (its event kept, untold).
    first = a.submit_store_task([key(2), key(3)], [obj(1001), obj(1002)])
    assert _readable(fd, 10_000), "the first store never completed"
    consume_fd(fd)
    with pytest.raises(RuntimeError, match="listener failed"):
        a.pop_completed_store_tasks()
    assert lis.stored == [key(1)]
    consume_fd(fd)  # the adapter's resignal
    again = a.submit_store_task([key(2), key(4)], [obj(1003), obj(1004)])
    assert _readable(fd, 10_000), "the second store never completed"
    got = a.pop_completed_store_tasks()
    assert set(got) == {first, again}
    assert lis.stored == [key(1), key(2), key(3), key(2), key(4)]
    assert lis.sizes == [SLOT, SLOT, SLOT, 0, SLOT]
    assert a.get_usage().total_bytes_used == 3 * SLOT


def test_a_listener_collecting_stores_again_gets_each_result_once(plugin) -> None:
    """A listener that calls ``pop_completed_store_tasks`` from its
    "stored" event (re-entrant: the adapter's lock is an RLock) and the
    call it interrupts return each result once between them."""
    a = plugin()
    inner: dict = {}

    class Collects(Events):
        def on_l2_keys_stored(self, keys, sizes):
            super().on_l2_keys_stored(keys, sizes)
            inner.update(a.pop_completed_store_tasks())

    a.register_listener(Collects())
    ids = {a.submit_store_task([key(i)], [obj(100 + i)]) for i in range(8)}
    outer: dict = {}
    deadline = time.monotonic() + 30
    while not ids <= (outer.keys() | inner.keys()):
        assert time.monotonic() < deadline, "stores never completed"
        got = a.pop_completed_store_tasks()
        assert not (got.keys() & outer.keys()), "a result returned twice"
        outer.update(got)
        _readable(a.get_store_event_fd(), 50)
    assert not (outer.keys() & inner.keys()), "a result returned to both calls"
    assert ids == outer.keys() | inner.keys()


def test_a_raising_listener_does_not_lose_the_load_result(plugin) -> None:
    """The prefetch controller asks query_load_result when the load fd is
    signalled: the call that meets the raising listener raises, the fd is
    signalled again, and the next call returns the bitmap."""
    a = plugin()
    k = key(3)
    assert store(a, [k], [obj(b"z" * 2000)]).is_successful()
    lis = RaisesOnce()
    lis.armed["stored"] = False
    a.register_listener(lis)
    dst = obj(2000)
    tid = a.submit_load_task([k], [dst])
    fd = a.get_load_event_fd()
    bm, raised = None, 0
    deadline = time.monotonic() + 30
    while bm is None:
        assert time.monotonic() < deadline, f"the load result never came ({raised=})"
        if not _readable(fd, 200):
            continue
        consume_fd(fd)
        try:
            bm = a.query_load_result(tid)
        except RuntimeError as e:
            assert "listener failed" in str(e)
            raised += 1
    assert raised == 1 and bits(bm, 1) == [True]
    assert bytes(dst.byte_array) == b"z" * 2000
    assert a.query_load_result(tid) is None, "a result is returned once"


# -- str / bytes keys on the plugin path --------------------------------------------


@pytest.mark.parametrize("bad", ["k1", b"k1"])
def test_str_and_bytes_keys_are_refused_at_submit(plugin, bad) -> None:
    """LMCache's base class reads key.cache_salt when it counts bytes: a str
    key was stored, then pop_completed_store_tasks raised AttributeError
    (results lost), and delete deleted, then raised. Now every entry
    refuses it with TypeError naming the type, before anything happens."""
    a = plugin()
    ev = Events()
    a.register_listener(ev)
    k = key(5)
    assert store(a, [k], [obj(500)]).is_successful()
    t = type(bad).__name__
    with pytest.raises(TypeError, match=rf"ObjectKeys, not {t}"):
        a.submit_store_task([bad], [obj(500)])
    with pytest.raises(TypeError, match=rf"not {t}"):
        a.submit_store_task([k, bad], [obj(500), obj(500)])
    assert a.pop_completed_store_tasks() == {}  # nothing was submitted
    with pytest.raises(TypeError, match=rf"not {t}"):
        a.delete([k, bad])
    assert a._core.exists([k]) == [True], "a refused delete deleted nothing"
    for call in (lambda: a.submit_lookup_and_lock_task([bad], {}),
                 lambda: a.submit_load_task([bad], [obj(500)]),
                 lambda: a.submit_unlock([bad])):
        with pytest.raises(TypeError, match=rf"not {t}"):
            call()
    assert a.pending_tasks() == 0
    a.delete([k])
    assert ev.deleted == [k] and a.get_usage().total_bytes_used == 0


# -- caller-fault open errors through LMCache ---------------------------------------


def test_duplicate_device_through_lmcaches_factory_is_a_value_error(made) -> None:
    """As LMCache's own dax adapter (its test suite expects ValueError
    "already mapped"); the built-in is the control."""
    path = made.file()
    dev = {"device_path": path, "max_dax_size_gb": GB / 2}
    for spec in (
        {"type": "plugin", "module_path": "daxkv.lmcache", "class_name": "DaxL2Adapter",
         "adapter_params": {"slot_bytes": SLOT, "devices": [dev, dict(dev)]}},
        {"type": "dax", "slot_bytes": SLOT, "devices": [dev, dict(dev)]},
    ):
        with pytest.raises(ValueError, match="already mapped"):
            build(spec)


def test_huge_worker_count_through_lmcaches_factory_is_a_value_error(made) -> None:
    path = made.file()
    for n in (10**8, 2**32):
        with pytest.raises(ValueError, match=r"num_load_workers: must be at most 1024"):
            build(params("plugin", path, num_load_workers=n))


def test_backend_missing_device_is_a_value_error(dx) -> None:
    """The non-MP backend keeps upstream's RuntimeError and words for a
    device it cannot open, and is a ValueError too."""
    dx.size_device(16 * 65536)
    with pytest.raises(ValueError, match="Failed to open dax device") as e:
        dx.construct(**{"dax.device_path": dx.path + ".missing"})
    assert isinstance(e.value, RuntimeError)
