"""Deletes the engine makes on its own (a failed device's keys, reported
by an idle worker tick, a status call or a /metrics scrape) are announced
on the store eventfd. LMCache's store controller calls
`pop_completed_store_tasks` (which tells them) only when that fd polls
readable (store_controller.py `_store_loop`); before the fix
(`KnownKeys::on_keys_deleted` in python/src/l2.rs writes the fd through
`Engine::signal`) they waited in the core, and with no store in flight
LMCache's eviction policy and per-salt books kept keys the engine no
longer held. Found by a hostile review (the fifth); failed before the
fix."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("torch")

from lmcache.v1.distributed.eviction import L2EvictionPolicy  # noqa: E402
from lmcache.v1.distributed.eviction_policy.lru import LRUEvictionPolicy  # noqa: E402
from lmcache.v1.platform import consume_fd  # noqa: E402

from test_edges_lmcache import _readable  # noqa: E402
from test_l2_adapter import SLOT, SLOTS, Events, load, made, params, store  # noqa: E402,F401
from test_lmcache import key, obj  # noqa: E402


def test_a_failed_devices_deletes_signal_the_store_fd(made) -> None:
    path = made.file()
    a = made.adapter(params("plugin", path))
    ev = Events()
    lru = LRUEvictionPolicy()
    a.register_listener(ev)
    a.register_listener(L2EvictionPolicy(lru))
    ks = [key(7100 + i, salt="s") for i in range(4)]
    assert store(a, ks, [obj(os.urandom(SLOT)) for _ in ks]).is_successful()
    assert all(k in lru._order for k in ks)
    fd = a.get_store_event_fd()
    # LMCache's store loop has consumed the fd and is back in poll().
    while _readable(fd, 0):
        consume_fd(fd)

    os.truncate(path, 0)  # the device goes bad under its mapping
    assert load(a, ks[:1], [obj(SLOT)]) == [False]  # SIGBUS in the copy: failed
    st = a.report_status()  # reports the failed device's keys deleted
    assert st["degraded"] is True, st
    deadline = time.monotonic() + 2
    while a._core.exists(ks) != [False] * 4:
        assert time.monotonic() < deadline, "the failed device's keys were never deleted"
        time.sleep(0.01)

    # The engine no longer holds them; LMCache's store controller would
    # hear of it only through the store fd.
    signalled = _readable(fd, 2000)
    # (What a pop would have told: they are waiting, due.)
    a.pop_completed_store_tasks()
    assert sorted(map(repr, ev.deleted)) == sorted(map(repr, ks))
    assert signalled, (
        "the engine deleted 4 keys of a failed device and their 'deleted' events are due, "
        "but the store fd was never written: LMCache's store controller never calls "
        "pop_completed_store_tasks, so its LRU and per-salt books keep keys the engine "
        "no longer holds until some unrelated store completes")
