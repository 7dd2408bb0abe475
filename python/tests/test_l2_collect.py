"""The plugin path's store collection (python/src/l2.rs
`pop_completed_stores`: one list of keys, sizes only when a key was stored
again; the adapter's `pop_completed_store_tasks` / `_tell_stores`):
sizes, duplicates, byte counters and the order of the events LMCache's own
LRU hears, inside the real LMCache 0.5.6.

From a hostile review of that format. The two `restore_behind_a_deferred_
delete` tests failed before python/src/l2/known.rs interleaving 4 (a key
stored again while its delete waited behind an untold "stored" was told
deleted after its new copy's "stored": LMCache's LRU lost a key the engine
holds)."""

from __future__ import annotations

import random
import threading

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("torch")

from lmcache.v1.distributed.eviction import L2EvictionPolicy  # noqa: E402
from lmcache.v1.distributed.eviction_policy.lru import LRUEvictionPolicy  # noqa: E402
from lmcache.v1.platform import consume_fd  # noqa: E402

from test_edges_lmcache import RaisesOnDeleted, _readable  # noqa: E402
from test_l2_adapter import SLOT, Events, drain_stores, made, plugin, store  # noqa: E402,F401
from test_lmcache import key, obj  # noqa: E402


class Log:
    """One ordered log of (event, repr(key), size)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, int]] = []

    def on_l2_keys_stored(self, keys, sizes):
        self.log += [("stored", repr(k), s) for k, s in zip(keys, sizes)]

    def on_l2_keys_accessed(self, keys):
        pass

    def on_l2_keys_deleted(self, keys):
        self.log += [("deleted", repr(k), SLOT) for k in keys]


def _books(log: Log) -> dict[str, int]:
    per: dict[str, int] = {}
    for ev, k, s in log.log:
        per[k] = per.get(k, 0) + (s if ev == "stored" else -s)
    return {k: v for k, v in per.items() if v}


def _wait_pop(a, tid: int, got: dict | None = None) -> dict:
    got = {} if got is None else got
    fd = a.get_store_event_fd()
    for _ in range(200):
        got.update(a.pop_completed_store_tasks())
        if tid in got:
            return got
        if _readable(fd, 100):
            consume_fd(fd)
    raise AssertionError(f"store {tid} never collected")


def test_restore_behind_a_deferred_delete_reentrant(plugin) -> None:
    """A first listener that, on K's "stored", deletes K and stores it
    again, collecting that store (re-entrant pop). The later listeners
    (LMCache's own L2EvictionPolicy over its LRU) must end with K stored
    and counted once, as the engine holds it (before the fix they heard
    the old copy's "deleted" after the new copy's "stored", and the LRU
    dropped K)."""
    a = plugin()
    K = key(1, salt="s")
    seen: dict = {}  # every result, whichever call returned it

    class Reenter:
        armed = True

        def on_l2_keys_stored(self, keys, sizes):
            if self.armed and any(repr(k) == repr(K) for k in keys):
                self.armed = False
                assert a.delete([K]) is None
                tid = a.submit_store_task([K], [obj(200)])
                _wait_pop(a, tid, seen)

        def on_l2_keys_accessed(self, keys):
            pass

        def on_l2_keys_deleted(self, keys):
            pass

    lru = LRUEvictionPolicy()
    log = Log()
    a.register_listener(Reenter())
    a.register_listener(L2EvictionPolicy(lru))
    a.register_listener(log)
    tid = a.submit_store_task([K], [obj(100)])
    _wait_pop(a, tid, seen)
    a.pop_completed_store_tasks()  # any deletes due
    a.pop_completed_store_tasks()
    assert a._core.exists([K]) == [True]
    assert dict(a.get_usage().bytes_by_cache_salt) == {"s": SLOT}
    assert _books(log) == {repr(K): SLOT}
    events_k = [ev for ev, k, _ in log.log if k == repr(K)]
    assert events_k[-1] == "stored", f"K held by the engine, last event {events_k}"
    assert K in lru._order, "LMCache's LRU lost a key the engine holds"


def test_one_collection_of_many_tasks_sizes_and_counters(plugin) -> None:
    """Several tasks finished before one pop: first stores, a key twice in
    a task, a key in two tasks, a re-store of a held key, a refused task
    (an object over the slot) and a failed one (device full): one list, in
    task order, each key's size right, counters equal to the engine's."""
    a = plugin(num_store_workers=1)
    log = Log()
    a.register_listener(log)
    assert store(a, [key(100)], [obj(10)]).is_successful()
    fd = a.get_store_event_fd()
    ids = [
        a.submit_store_task([key(1), key(2)], [obj(10), obj(10)]),
        a.submit_store_task([key(3), key(3)], [obj(10), obj(10)]),
        a.submit_store_task([key(2), key(4)], [obj(10), obj(10)]),
        a.submit_store_task([key(100)], [obj(10)]),
        a.submit_store_task([key(5)], [obj(SLOT + 1)]),
    ]
    got = drain_stores(a, set(ids))
    assert len(got) == 5
    held = a._core.exists([key(i) for i in (1, 2, 3, 4, 5, 100)])
    books = _books(log)
    assert books == {repr(key(i)): SLOT for i, h in zip((1, 2, 3, 4, 5, 100), held) if h}
    stored = [k for ev, k, _ in log.log if ev == "stored"]
    assert len(stored) == len(set(stored)) + stored.count(repr(key(2))) - 1 + \
        stored.count(repr(key(3))) - 1 + stored.count(repr(key(100))) - 1
    assert a.get_usage().total_bytes_used == sum(held) * SLOT
    assert dict(a.get_usage().bytes_by_cache_salt) == {"": sum(held) * SLOT}
    # Full device: a task that stores some keys and fails.
    n = 64
    big = [key(1000 + i) for i in range(n + 4)]
    tid = a.submit_store_task(big, [obj(10) for _ in big])
    r = drain_stores(a, {tid})[tid]
    held = a._core.exists(big)
    assert not r.is_successful() or all(held)
    u = a.get_usage()
    assert u.bytes_by_cache_salt.get("", 0) == u.total_bytes_used, (u, _books(log))


def test_concurrent_stores_deletes_raising_and_reentrant_listeners(plugin) -> None:
    """Threads store and delete overlapping keys; a listener raises now
    and then on either event and another collects again from inside its
    "stored" event. At the end each key's books (stored sizes minus
    deletes) match the engine, no "deleted" without a "stored" before it,
    and LMCache's counters equal the engine's slots."""
    a = plugin(num_store_workers=2)
    log = Log()
    rnd = random.Random(7)

    class Chaos:
        depth = 0

        def on_l2_keys_stored(self, keys, sizes):
            if rnd.random() < 0.1:
                raise RuntimeError("listener failed (stored)")
            if rnd.random() < 0.1 and self.depth == 0:
                self.depth += 1
                try:
                    a.pop_completed_store_tasks()
                finally:
                    self.depth -= 1

        def on_l2_keys_accessed(self, keys):
            pass

        def on_l2_keys_deleted(self, keys):
            if rnd.random() < 0.1:
                raise RuntimeError("listener failed (deleted)")

    a.register_listener(log)  # first: hears every event told
    a.register_listener(Chaos())
    ks = [key(i, salt="c") for i in range(12)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def deleter() -> None:
        r = random.Random(3)
        try:
            while not stop.is_set():
                try:
                    a.delete(r.sample(ks, 3))
                except RuntimeError as e:
                    if "listener failed" not in str(e):
                        raise
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def storer(seed: int) -> None:
        r = random.Random(seed)
        try:
            for _ in range(150):
                sub = r.sample(ks, 3)
                a.submit_store_task(sub, [obj(64) for _ in sub])
                try:
                    a.pop_completed_store_tasks()
                except RuntimeError as e:
                    if "listener failed" not in str(e):
                        raise
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=deleter)] + [
        threading.Thread(target=storer, args=(s,)) for s in (1, 2)]
    for t in threads[1:]:
        t.start()
    threads[0].start()
    for t in threads[1:]:
        t.join(120)
    stop.set()
    threads[0].join(30)
    assert not errors, errors
    # Quiesce: everything collected and told.
    for _ in range(50):
        try:
            a.pop_completed_store_tasks()
            a.delete([key(999)])
        except RuntimeError:
            pass
    held = a._core.exists(ks)
    live: dict[str, bool] = {}
    for ev, k, _ in log.log:
        if ev == "deleted":
            assert live.get(k), f"{k}: deleted without a live stored before it"
        live[k] = ev == "stored"
    u = a.get_usage()
    assert u.total_bytes_used == sum(held) * SLOT
    assert u.bytes_by_cache_salt.get("c", 0) == sum(held) * SLOT, (dict(u.bytes_by_cache_salt), sum(held))
    assert _books(log) == {repr(k): SLOT for k, h in zip(ks, held) if h}
    assert {k for k, v in live.items() if v} == {repr(k) for k, h in zip(ks, held) if h}


def _a_kept_stored_event(plugin):
    """An adapter whose last pop collected K's store but kept its "stored"
    event untold (its ticket unreported): a "deleted" listener, ahead of
    LMCache's own LRU policy and a log, raised on that pop. Returns (the
    adapter, K, K's task id, the LRU, the log)."""
    a = plugin()
    K = key(1, salt="s")
    assert store(a, [key(50)], [obj(10)]).is_successful()
    assert a._core.delete([key(50)]) == [True]  # a "deleted" due at the next pop
    lru = LRUEvictionPolicy()
    log = Log()
    a.register_listener(RaisesOnDeleted())
    a.register_listener(L2EvictionPolicy(lru))
    a.register_listener(log)
    fd = a.get_store_event_fd()
    consume_fd(fd)
    first = a.submit_store_task([K], [obj(100)])
    assert _readable(fd, 10_000)
    consume_fd(fd)
    with pytest.raises(RuntimeError, match="listener failed"):
        a.pop_completed_store_tasks()
    consume_fd(fd)  # the resignal
    assert [ev for ev, k, _ in log.log if k == repr(K)] == []
    return a, K, first, lru, log


def test_restore_behind_a_deferred_delete_after_a_raising_listener(plugin) -> None:
    """No re-entrancy: a "deleted" listener raises once, so the call's
    "stored" event for K (first copy) is kept, its ticket unreported. K is
    then deleted (deferred: its "stored" is pending) and stored again. The
    new copy takes the deferred delete back: LMCache hears K stored twice
    (the second of size 0) and never deleted, counts one slot and keeps K
    in its LRU, as the engine holds it."""
    a, K, first, lru, log = _a_kept_stored_event(plugin)
    a.delete([K])
    again = a.submit_store_task([K], [obj(200)])
    got = drain_stores(a, {first, again})
    assert set(got) == {first, again}
    a.pop_completed_store_tasks()
    a.pop_completed_store_tasks()
    assert a._core.exists([K]) == [True]
    assert dict(a.get_usage().bytes_by_cache_salt) == {"s": SLOT}
    events_k = [ev for ev, k, _ in log.log if k == repr(K)]
    assert events_k[-1] == "stored", f"K held by the engine, last event {events_k}"
    assert K in lru._order, "LMCache's LRU lost a key the engine holds"


def test_delete_racing_a_restore_reaches_lmcaches_lru_in_order(plugin) -> None:
    """LMCache's eviction controller calls `delete([K])` (K stored and told
    long ago); the engine deletes K and `_report_deleted` takes K's
    "deleted" out of the core. Before it reaches LMCache's LRU (a slow
    listener ahead of it here; a thread switch after `take_deleted`
    returns does the same) the store controller's thread stores K again
    and collects it. The old copy's "deleted" must reach LMCache before
    the new copy's "stored": the adapter takes and tells deletes under its
    store lock, as a collection does. (Before, the "deleted" landed last:
    the engine held K, LMCache's LRU did not, and never evicted that slot;
    its books counted it only by luck, slot + slot - slot.)"""
    a = plugin()
    K = key(7, salt="s")
    in_delete, restored = threading.Event(), threading.Event()

    class Slow(Events):
        """A listener ahead of the LRU that takes its time over "deleted"
        on the deleting thread (I/O, a lock another thread holds...)."""
        tid = None

        def on_l2_keys_deleted(self, keys):
            if threading.get_ident() == self.tid:
                in_delete.set()
                restored.wait(30)

    slow = Slow()
    lru = LRUEvictionPolicy()
    log = Log()
    a.register_listener(slow)
    a.register_listener(L2EvictionPolicy(lru))
    a.register_listener(log)
    assert store(a, [K], [obj(100)]).is_successful()
    a.pop_completed_store_tasks()
    assert K in lru._order

    def evict() -> None:
        slow.tid = threading.get_ident()
        a.delete([K])

    t = threading.Thread(target=evict)
    t.start()
    assert in_delete.wait(30)
    seen: dict = {}
    tid = a.submit_store_task([K], [obj(200)])
    _wait_pop(a, tid, seen)
    restored.set()
    t.join(30)
    for _ in range(3):
        a.pop_completed_store_tasks()
    assert a._core.exists([K]) == [True]
    events_k = [ev for ev, k, _ in log.log if k == repr(K)]
    assert dict(a.get_usage().bytes_by_cache_salt) == {"s": SLOT}
    assert _books(log) == {repr(K): SLOT}
    assert events_k[-1] == "stored", f"K held by the engine, events {events_k}"
    assert K in lru._order, "LMCache's LRU lost a key the engine holds"


def test_delete_racing_restores_hunt(plugin) -> None:
    """The same race with nothing but two threads (LMCache's eviction
    controller deleting, its store controller storing and collecting) and
    a short GIL switch interval: the first listener must never hear a
    key "deleted" twice without a "stored" between (the second is the old
    copy's "deleted" told after the new copy's "stored")."""
    import sys
    import time

    a = plugin(num_store_workers=1)
    log = Log()
    a.register_listener(log)
    K = key(9, salt="t")
    stop = threading.Event()
    errors: list[BaseException] = []

    def deleter() -> None:
        try:
            while not stop.is_set():
                a.delete([K])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    t = threading.Thread(target=deleter)
    t.start()
    try:
        end = time.monotonic() + 20
        while time.monotonic() < end:
            tid = a.submit_store_task([K], [obj(64)])
            _wait_pop(a, tid)
    finally:
        stop.set()
        t.join(30)
        sys.setswitchinterval(old)
    assert not errors, errors
    live = False
    bad = 0
    where = []
    for i, (ev, _, _) in enumerate(log.log):
        if ev == "deleted" and not live:
            bad += 1
            where.append([(e, s) for e, _, s in log.log[max(0, i - 3):i + 1]])
        live = ev == "stored"
    n = sum(ev == "stored" for ev, _, _ in log.log)
    assert bad == 0, f"{bad} 'deleted' without a live 'stored' before it, in {n} stores; e.g. {where[:2]}"


def test_a_delete_released_by_a_kept_stored_event_is_told_with_it(plugin) -> None:
    """A "deleted" listener raised once, so K's "stored" is kept untold
    (its ticket held) and the store fd written for the next collection.
    LMCache's eviction thread deletes K first: the core defers the delete
    (K's "stored" pending), and `delete()` tells no "stored" event (no
    "stored" listener runs on the eviction thread). The store controller's
    collection then tells the kept "stored" K, reports its ticket, which
    releases K's delete, and tells that delete in the same call, so
    LMCache's books and LRU let K go with the engine. (Before, the
    released delete waited, unsignalled, for some later call.)"""
    a, K, first, lru, log = _a_kept_stored_event(plugin)
    a.delete([K])  # LMCache's eviction thread, before the next pop
    assert a._core.exists([K]) == [False]
    assert [ev for ev, k, _ in log.log if k == repr(K)] == []
    # The raising call's result, kept for this one.
    assert set(a.pop_completed_store_tasks()) == {first}
    events_k = [ev for ev, k, _ in log.log if k == repr(K)]
    assert events_k == ["stored", "deleted"], (
        f"after the pop: K events {events_k}, books {dict(a.get_usage().bytes_by_cache_salt)}, "
        f"K in LMCache's LRU: {K in lru._order}")
    assert dict(a.get_usage().bytes_by_cache_salt) == {}
    assert K not in lru._order


# A "deleted" listener that stores the key again and collects it
# (re-entrant): the new copy's "stored" must reach every listener after
# the old copy's "deleted" (the collection inside the listener keeps its
# events for the outer call). From a hostile review: LMCache's LRU heard
# them the other way round and dropped a key the engine holds.


def _a_deleted_listener_that_stores_again(plugin):
    a = plugin()
    K = key(3, salt="s")
    seen: dict = {}

    class ReenterOnDeleted(Events):
        armed = False

        def on_l2_keys_deleted(self, keys):
            if self.armed and any(repr(k) == repr(K) for k in keys):
                self.armed = False
                tid = a.submit_store_task([K], [obj(200)])
                _wait_pop(a, tid, seen)

    r = ReenterOnDeleted()
    lru = LRUEvictionPolicy()
    log = Log()
    a.register_listener(r)
    a.register_listener(L2EvictionPolicy(lru))
    a.register_listener(log)
    assert store(a, [K], [obj(100)]).is_successful()
    assert K in lru._order
    r.armed = True
    return a, K, lru, log


def _check(a, K, lru, log):
    for _ in range(3):
        a.pop_completed_store_tasks()
    assert a._core.exists([K]) == [True]
    events_k = [ev for ev, k, _ in log.log if k == repr(K)]
    assert dict(a.get_usage().bytes_by_cache_salt) == {"s": SLOT}
    assert events_k[-1] == "stored", f"engine holds K; K events {events_k}, books {_books(log)}"
    assert K in lru._order, "LMCache's LRU lost a key the engine holds"


def test_a_deleted_listener_storing_the_key_again_via_delete(plugin) -> None:
    a, K, lru, log = _a_deleted_listener_that_stores_again(plugin)
    a.delete([K])  # _report_deleted tells "deleted" K; listener re-stores K
    _check(a, K, lru, log)


def test_a_deleted_listener_storing_the_key_again_via_pop(plugin) -> None:
    a, K, lru, log = _a_deleted_listener_that_stores_again(plugin)
    assert a._core.delete([K]) == [True]  # due at the next pop
    a.pop_completed_store_tasks()  # _tell_stores_once tells "deleted" K
    _check(a, K, lru, log)
