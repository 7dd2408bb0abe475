"""Races of the plugin adapter (python/src/l2.rs, l2/known.rs,
daxkv/lmcache/_l2_adapter.py) across tasks: a re-store inside a delete's
listener window, buffers shared between tasks in flight, two closers. Each
docstring gives the interleaving and what breaks without the rule."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("torch")

from test_l2_adapter import (  # noqa: E402,F401
    Events,
    SLOT,
    drain_stores,
    made,
    plugin,
    store,
)
from test_lmcache import key, obj  # noqa: E402


def test_a_restore_inside_a_delete_window_keeps_its_slot_counted(plugin):
    """known.rs interleaving 3: `Engine::delete_into` deletes a key and
    tells the listener only after the whole key list, outside
    `KnownKeys.map`. A store of the same key collected in that window finds
    exists(K)=true (the new incarnation) and the *old* entry still
    recorded: size 0, pending on the old generation. If the late listener
    call then removed the entry and reported "deleted", LMCache would end
    with K counted 0 bytes (and dropped from its LRU) while the engine
    holds K, and K no longer recorded, a later evict of K would never be
    reported; the listener asks the engine whether it holds K again.

    eviction thread: l2.rs:814 engine.delete([K, ...]) ─ K gone ─────────────── listener(K) → deleted(K)
    store ctrl:                     submit K; pop: record_stored l2.rs:650 → "stored"(K, 0)
    """
    a = plugin(num_store_workers=1)
    ev = Events()
    a.register_listener(ev)
    k = key(7, salt="w")
    assert store(a, [k], [obj(100)]).is_successful()
    # A long delete list: K first, then keys that are not there (each costs
    # a claim and a device probe), so the listener call comes late.
    # (ObjectKeys: the plugin path refuses str / bytes keys.)
    filler = [key(10_000_000 + i) for i in range(1000)] * 1500
    done = threading.Event()

    def deleter() -> None:
        a.delete([k] + filler)
        done.set()

    t = threading.Thread(target=deleter)
    t.start()
    deadline = time.monotonic() + 30
    while a._core.exists([k])[0]:
        assert time.monotonic() < deadline
        time.sleep(0.0005)
    assert store(a, [k], [obj(100)]).is_successful()
    in_window = not done.is_set()
    t.join(60)
    if not in_window:
        pytest.skip("the delete finished before the re-store was collected")
    assert a._core.exists([k]) == [True]
    books = sum(ev.sizes) - SLOT * len(ev.deleted)
    # The engine holds K: LMCache's books must count its slot.
    assert books == SLOT, (ev.sizes, len(ev.deleted))
    assert a.get_usage().bytes_by_cache_salt.get("w", 0) == SLOT


def test_load_into_an_uncollected_stores_source_is_refused(plugin):
    """Aliasing across tasks: a load into the object a store is still
    reading (its export is in the task entry, the worker may be copying
    from it) is refused. Accepted, a worker would write bytes another
    worker reads — a data race on memory `RawBuf::new` says is reachable
    only through one descriptor. The adapter's record of the memory of
    tasks in flight (`daxkv::plumbing::busy`) refuses it."""
    a = plugin()
    k1, k2 = key(1), key(2)
    assert store(a, [k2], [obj(4096)]).is_successful()
    x = obj(4096)
    sid = a.submit_store_task([k1], [x])
    try:
        with pytest.raises((ValueError, BufferError)):
            a.submit_load_task([k2], [x])
    finally:
        drain_stores(a, {sid})


def test_two_loads_into_one_object_are_refused(plugin):
    """The same object as the destination of two loads in flight is
    refused: accepted, two workers would write the same bytes (the record
    of the memory of tasks in flight enforces the SAFETY note's 'the
    caller leaves the objects to this task')."""
    a = plugin()
    k1, k2 = key(1), key(2)
    assert store(a, [k1, k2], [obj(4096), obj(4096)]).is_successful()
    x = obj(4096)
    a.submit_load_task([k1], [x])
    with pytest.raises((ValueError, BufferError)):
        a.submit_load_task([k2], [x])


def test_a_second_close_waits_like_the_first(plugin):
    """A second `close` returns only when the first has finished. A close
    that set `closed` and returned early for any later caller, *before* the
    first caller's engine.close() had waited for the tasks in flight, would
    let a second closer return while workers still copy from the caller's
    buffers and the fds are still open, so a caller that frees its memory
    after close() (LMCache frees L1 after the L2 adapters close) would free
    memory a worker reads.

    thread A: close → closed=true → engine.close() waits inflight …
    thread B: close → sees closed → returns; frees buffers → UAF
    """
    big = 8 * 1024 * 1024
    a = plugin(slot_bytes=big, max_dax_size_gb=64 * big / 2**30, num_store_workers=1)
    srcs = [obj(big) for _ in range(6)]
    ids = [a.submit_store_task([key(100 + i)], [s]) for i, s in enumerate(srcs)]
    t = threading.Thread(target=a.close)
    t.start()
    while not a._core.closed:
        pass
    a.close()  # the second caller
    fds = a._core.event_fds()
    pending = a._core.status().get("inflight_store_tasks")
    t.join(60)
    assert fds == (-1, -1, -1), f"close() returned with the engine open ({pending=}, {ids=})"
