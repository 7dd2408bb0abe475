"""The `plugin` adapter's pre-read path (`_spans`: each MemoryObj read in
Python, python/daxkv/lmcache/_l2_adapter.py) against the core's own reads
(`core_unread`), and the order of its listener events.

Found by a hostile review of the pre-read path; each test failed before
its fix: a key list changed by an object's `get_size()` (the key told was
not the key stored, when keys were read in Python too), an object read
twice (a refused object stored), and a delete deferred behind a "stored"
event told after the next "stored" of the same key (LMCache's eviction
policy then forgets a key the engine holds)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("lmcache")
torch = pytest.importorskip("torch")

from lmcache.v1.memory_management import TensorMemoryObj  # noqa: E402

from test_l2_adapter import (  # noqa: E402,F401
    Events,
    drain_stores,
    made,
    plugin,
    store,
)
from test_lmcache import key, obj  # noqa: E402


class _Swapping(TensorMemoryObj):
    """A MemoryObj whose get_size() replaces keys[0] (a list the caller
    passed to submit_store_task) with another key."""

    def get_size(self):
        swap = getattr(self, "_swap", None)
        if swap is not None:
            keys, new = swap
            keys[0] = new
            self._swap = None
        return super().get_size()


def _swapping(data: bytes, keys: list, new) -> TensorMemoryObj:
    o = obj(data)
    o.__class__ = _Swapping
    o._swap = (keys, new)
    return o


@pytest.mark.parametrize("path", ["adapter", "core_unread"])
def test_event_key_is_the_key_stored_when_get_size_mutates_keys(plugin, path) -> None:
    """The key a "stored" event names is the key the engine holds, on
    both paths, when an object's `get_size()` replaces `keys[0]` between
    the keys' read and the objects' (each key travels with its fields)."""
    a = plugin()
    lis = Events()
    a.register_listener(lis)
    keys = [key(1)]
    o = _swapping(b"x" * 1000, keys, key(2))
    if path == "adapter":
        tid = a.submit_store_task(keys, [o])
    else:
        tid = a._core.submit_store(keys, [o])
    assert drain_stores(a, {tid})[tid].is_successful()
    told = lis.stored
    held = a._core.exists([key(1), key(2)])
    assert len(told) == 1
    told_i = 1 if told[0] == key(1) else 2
    # The engine holds the key the listeners were told.
    assert held[told_i - 1], (f"told stored key({told_i}), engine holds "
                              f"key(1)={held[0]} key(2)={held[1]}")


def test_deleted_of_old_copy_not_told_after_stored_of_new_copy(plugin) -> None:
    """A delete deferred behind K's "stored" event (an eviction racing the
    store controller; here a listener deletes K) is released after the
    call's take. K stored again: the next pop must tell "deleted" K (the
    old copy) before "stored" K (the new one), or LMCache's eviction
    policy drops a key the engine holds. The adapter tells deletes first."""
    a = plugin()
    order: list = []
    armed = [True]

    class Deleter(Events):
        def on_l2_keys_stored(self, keys, sizes):
            order.extend(("stored", k) for k in keys)
            if armed[0]:
                armed[0] = False
                a.delete([key(1)])  # eviction while "stored" is being told

        def on_l2_keys_deleted(self, keys):
            order.extend(("deleted", k) for k in keys)

    a.register_listener(Deleter())
    assert store(a, [key(1)], [obj(1000)]).is_successful()
    assert a._core.exists([key(1)]) == [False]
    # K stored again (LMCache re-stores an evicted chunk); committed
    # before the store controller's next pop.
    src = obj(1000)
    tid = a.submit_store_task([key(1)], [src])
    deadline = time.monotonic() + 30
    while a._core.exists([key(1)]) != [True]:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert drain_stores(a, {tid})[tid].is_successful()
    a.pop_completed_store_tasks()
    # The last event about key(1) must leave it present.
    last = [e for e, k in order if k == key(1)][-1]
    assert last == "stored", order


class _Flip(TensorMemoryObj):
    """get_size(): past its tensor on odd calls, 50 on even ones."""

    def get_size(self):
        self._n = getattr(self, "_n", 0) + 1
        return 10**9 if self._n % 2 else 50


@pytest.mark.parametrize("path", ["adapter", "core_unread"])
def test_get_size_is_read_once_per_submit(plugin, path) -> None:
    """`get_size()` is read once per object on both paths: an object
    whose first answer is past its tensor is refused, never stored on a
    second read that answers 50."""
    a = plugin()
    o = obj(100)
    o.__class__ = _Flip
    submit = a.submit_store_task if path == "adapter" else a._core.submit_store
    with pytest.raises(BufferError, match="past its tensor"):
        submit([key(1)], [o])


def test_a_reentrant_collection_does_not_release_the_outer_calls_deletes(plugin) -> None:
    """A listener that collects again (re-entrant) while the outer call is
    telling "stored" K must not report the outer call's ticket: a delete
    of K made right then (here by that listener) must reach every
    listener after K's "stored", not between two listeners' "stored"."""
    a = plugin()
    order: dict = {"first": [], "second": []}
    acted = [False]
    results: dict = {}

    class First(Events):
        def on_l2_keys_stored(self, keys, sizes):
            order["first"].extend(("stored", k) for k in keys)
            if key(1) in keys and not acted[0]:
                acted[0] = True
                # A second store completes; collect it from in here.
                tid2 = a.submit_store_task([key(2)], [obj(1002)])
                deadline = time.monotonic() + 30
                while a._core.exists([key(2)]) != [True]:
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                while tid2 not in results:
                    assert time.monotonic() < deadline
                    results.update(a.pop_completed_store_tasks())
                    time.sleep(0.001)
                a.delete([key(1)])  # an eviction, right then

        def on_l2_keys_deleted(self, keys):
            order["first"].extend(("deleted", k) for k in keys)

    class Second(Events):
        def on_l2_keys_stored(self, keys, sizes):
            order["second"].extend(("stored", k) for k in keys)

        def on_l2_keys_deleted(self, keys):
            order["second"].extend(("deleted", k) for k in keys)

    a.register_listener(First())
    a.register_listener(Second())
    tid = a.submit_store_task([key(1)], [obj(1001)])
    deadline = time.monotonic() + 30
    # Each result once, to the outer call or the listener's inner one.
    while tid not in results:
        assert time.monotonic() < deadline, "the store never came"
        got = a.pop_completed_store_tasks()
        assert not (got.keys() & results.keys())
        results.update(got)
        time.sleep(0.001)
    assert results[tid].is_successful()
    # The delete, deferred behind the outer call's ticket, is told by a
    # later call (here the next collection or delete).
    deadline = time.monotonic() + 30
    while ("deleted", key(1)) not in order["second"]:
        assert time.monotonic() < deadline, order
        a.pop_completed_store_tasks()
        a.delete([key(3)])
        time.sleep(0.001)
    for name, seen in order.items():
        k1 = [e for e, k in seen if k == key(1)]
        assert k1 == ["stored", "deleted"], (name, seen)
