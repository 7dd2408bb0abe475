"""``daxkv.lmcache.DaxL2Adapter`` (LMCache's ``plugin`` path) inside the real
LMCache 0.5.6, built by LMCache's own factory from the ``--l2-adapter`` JSON a
user writes. Scenarios marked ``both`` also run on LMCache's built-in ``dax``
adapter in the same run, as the control (docs/lmcache-dax-behavior.md §1, §3,
§4, §8.1). Skipped when LMCache is not installed."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import select
import sys
import threading
import time
from typing import Any, Callable

import pytest

pytest.importorskip("lmcache")
torch = pytest.importorskip("torch")

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (  # noqa: E402
    _object_key_to_string,
)
from lmcache.v1.distributed.l2_adapters.reconfiguration import (  # noqa: E402
    L2DeviceOwner,
    L2ReconfigurableAdapter,
    L2ReconfigureError,
)
from lmcache.v1.distributed.storage_controllers.utils import (  # noqa: E402
    L2AdapterDescriptor,
)
from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: E402
from lmcache.v1.platform import consume_fd  # noqa: E402

import daxkv.lmcache  # noqa: E402
from daxkv._daxkv import DaxL2Core  # noqa: E402
from conftest import SLOT, shm_path  # noqa: E402
from test_lmcache import bits, key, obj  # noqa: E402

SLOTS = 64
GB = SLOTS * SLOT / 2**30


# -- building adapters the way a user does --------------------------------------


def parse(spec: dict):
    """LMCache's own CLI path: ``--l2-adapter <JSON>`` → config object."""
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    args = parser.parse_args(["--l2-adapter", json.dumps(spec)])
    return parse_args_to_l2_adapters_config(args).adapters[0]


def build(spec: dict):
    return create_l2_adapter(parse(spec))


def dax_file(size: int) -> str:
    path = shm_path()
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def params(kind: str, path: str, **extra: Any) -> dict:
    """The adapter spec of ``kind`` ("plugin" or the built-in "dax") on one
    device file, with the dax adapter's keys."""
    p: dict[str, Any] = {"slot_bytes": SLOT, "device_path": path, "max_dax_size_gb": GB}
    p.update(extra)
    if kind == "plugin":
        return {
            "type": "plugin",
            "module_path": "daxkv.lmcache",
            "class_name": "DaxL2Adapter",
            "adapter_params": p,
        }
    return {"type": "dax", **p}


class Made:
    """Adapters and files a test made, closed and removed afterwards."""

    def __init__(self) -> None:
        self.adapters: list = []
        self.files: list[str] = []

    def file(self, size: int = SLOTS * SLOT) -> str:
        p = dax_file(size)
        self.files.append(p)
        return p

    def adapter(self, spec: dict):
        a = build(spec)
        self.adapters.append(a)
        return a

    def cleanup(self) -> None:
        for a in self.adapters:
            a.close()
        for p in self.files:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


@pytest.fixture
def made():
    m = Made()
    yield m
    m.cleanup()


@pytest.fixture(params=["plugin", "dax"])
def kind(request) -> str:
    return request.param


# -- driving an adapter the way LMCache's controllers do ------------------------


def _poll(fd: int, ms: int) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN)
    for f, ev in p.poll(ms):
        if ev & select.POLLIN:
            consume_fd(f)


def drain_stores(a, ids: set[int], timeout_s: float = 30.0) -> dict:
    """The store controller: poll the store fd, consume it, pop everything."""
    got: dict = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for tid, r in a.pop_completed_store_tasks().items():
            assert tid not in got, f"store {tid} popped twice"
            got[tid] = r
        if ids <= got.keys():
            return got
        assert time.monotonic() < deadline, f"stores never completed: {ids - got.keys()}"
        _poll(a.get_store_event_fd(), 200)


def wait_result(a, query: Callable, fd: int, tid: int, timeout_s: float = 30.0):
    """The prefetch controller: query; poll and consume the fd while pending."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = query(tid)
        if r is not None:
            return r
        assert time.monotonic() < deadline, f"task {tid} never finished"
        _poll(fd, 200)


def lookup(a, keys: list) -> list[bool]:
    tid = a.submit_lookup_and_lock_task(keys, {})
    bm = wait_result(a, a.query_lookup_and_lock_result, a.get_lookup_and_lock_event_fd(), tid)
    return bits(bm, len(keys))


def load(a, keys: list, dsts: list) -> list[bool]:
    tid = a.submit_load_task(keys, dsts)
    bm = wait_result(a, a.query_load_result, a.get_load_event_fd(), tid)
    return bits(bm, len(keys))


def store(a, keys: list, srcs: list) -> Any:
    tid = a.submit_store_task(keys, srcs)
    return drain_stores(a, {tid})[tid]


class Events:
    """An ``L2AdapterListener`` that records what it is told."""

    def __init__(self) -> None:
        self.stored: list = []
        self.sizes: list = []
        self.accessed: list = []
        self.deleted: list = []

    def on_l2_keys_stored(self, keys, sizes):
        self.stored += keys
        self.sizes += sizes

    def on_l2_keys_accessed(self, keys):
        self.accessed += keys

    def on_l2_keys_deleted(self, keys):
        self.deleted += keys


def status_of(a) -> dict:
    return a.report_status()


def eventually(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """The built-in tells its listeners on a worker thread after publishing
    the result: wait for the event (a hang check, not a timing assert)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


# -- inside LMCache: the factory, the scenario, both adapters -------------------


def test_factory_builds_the_plugin_from_the_user_json(made):
    """`type: plugin` needs module_path, class_name and adapter_params; the
    factory finds DaxL2AdapterConfig by convention and passes the config."""
    path = made.file()
    cfg = parse(params("plugin", path))
    assert type(cfg).__name__ == "PluginL2AdapterConfig"
    a = create_l2_adapter(cfg)
    made.adapters.append(a)
    assert type(a) is daxkv.lmcache.DaxL2Adapter
    assert isinstance(a, L2AdapterInterface)
    assert isinstance(a, L2ReconfigurableAdapter) and isinstance(a, L2DeviceOwner)
    assert a.supports_global_eviction
    assert a.get_usage().total_capacity_bytes == SLOTS * SLOT
    # The l1_memory_desc keyword the storage manager passes is accepted.
    b = daxkv.lmcache.DaxL2Adapter(
        daxkv.lmcache.DaxL2AdapterConfig.from_dict({"slot_bytes": SLOT, "device_path": "memfd",
                                                    "max_dax_size_gb": GB}),
        l1_memory_desc=object(),
    )
    made.adapters.append(b)
    fds = [x.get_store_event_fd() for x in (a, b)] + [
        x.get_lookup_and_lock_event_fd() for x in (a, b)
    ] + [x.get_load_event_fd() for x in (a, b)]
    assert len(set(fds)) == 6, "fds must be distinct across adapters too"
    # A bad adapter param names the field, before anything is mapped.
    bad = params("plugin", path)
    bad["adapter_params"]["slot_bytes"] = 0
    with pytest.raises(ValueError, match="slot_bytes"):
        build(bad)
    bad["adapter_params"] = {"slot_bytes": SLOT, "device_path": path, "max_dax_size_gb": GB,
                             "num_load_workerz": 2}
    with pytest.raises(ValueError, match="num_load_workerz"):
        build(bad)


def test_round_trip_inside_lmcache(kind, made):
    """both: store (many tasks in flight, a tail chunk) → lookup (lock) →
    load (bytes verified) → unlock → delete, fds polled as the controllers
    poll them; listener events and slot-based usage."""
    a = made.adapter(params(kind, made.file()))
    ev = Events()
    a.register_listener(ev)
    fds = [a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()]
    assert len(set(fds)) == 3
    for fd in fds:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK, "fds must be non-blocking"

    n = 40
    keys = [key(i, salt="s" if i % 5 == 0 else "") for i in range(n)]
    sizes = [SLOT] * (n - 1) + [SLOT // 3 + 7]  # the last is a tail chunk
    data = [os.urandom(s) for s in sizes]
    srcs = [obj(d) for d in data]
    ids = {a.submit_store_task(keys[i : i + 8], srcs[i : i + 8]) for i in range(0, n, 8)}
    assert len(ids) == 5
    got = drain_stores(a, ids)
    assert all(r.is_successful() and r.bytes_transferred() == 8 * SLOT for r in got.values())
    eventually(lambda: len(ev.stored) == n, "stored events")
    assert sorted(map(repr, ev.stored)) == sorted(map(repr, keys)) and set(ev.sizes) == {SLOT}
    u = a.get_usage()
    assert (u.total_bytes_used, u.total_capacity_bytes) == (n * SLOT, SLOTS * SLOT)
    assert dict(u.bytes_by_cache_salt) == {"s": 8 * SLOT, "": 32 * SLOT}

    absent = [key(10_000 + i) for i in range(3)]
    assert lookup(a, keys + absent) == [True] * n + [False] * 3
    assert status_of(a)["locked_key_count"] == n

    dsts = [obj(s) for s in sizes]
    tids = [a.submit_load_task(keys[i : i + 10], dsts[i : i + 10]) for i in range(0, n, 10)]
    for t in tids:
        bm = wait_result(a, a.query_load_result, a.get_load_event_fd(), t)
        assert bits(bm, 10) == [True] * 10
    assert [bytes(d.byte_array) for d in dsts] == data
    eventually(lambda: len(ev.accessed) == n, "accessed events")
    assert sorted(map(repr, ev.accessed)) == sorted(map(repr, keys))
    a.submit_unlock(keys)
    assert status_of(a)["locked_key_count"] == 0

    a.delete(keys[:10])
    assert sorted(map(repr, ev.deleted)) == sorted(map(repr, keys[:10]))
    assert lookup(a, keys) == [False] * 10 + [True] * (n - 10)
    a.submit_unlock(keys[10:])
    miss = [obj(b"\xab" * s) for s in sizes[:2]]
    assert load(a, keys[:2], miss) == [False, False]
    assert all(bytes(m.byte_array) == b"\xab" * len(m.byte_array) for m in miss), "a miss must leave the buffer alone"
    u = a.get_usage()
    assert u.total_bytes_used == (n - 10) * SLOT
    assert dict(u.bytes_by_cache_salt) == {"s": 6 * SLOT, "": 24 * SLOT}
    st = status_of(a)
    assert st["is_healthy"] and st["live_slot_count"] == n - 10 and st["locked_key_count"] == 0


def test_one_shot_results_and_unknown_ids(kind, made):
    """both: a finished task's result is returned once; unknown ids give None."""
    a = made.adapter(params(kind, made.file()))
    ks = [key(i) for i in range(3)]
    store(a, ks, [obj(100) for _ in ks])
    tid = a.submit_lookup_and_lock_task(ks, {})
    wait_result(a, a.query_lookup_and_lock_result, a.get_lookup_and_lock_event_fd(), tid)
    assert a.query_lookup_and_lock_result(tid) is None
    a.submit_unlock(ks)
    tid = a.submit_load_task(ks, [obj(100) for _ in ks])
    wait_result(a, a.query_load_result, a.get_load_event_fd(), tid)
    assert a.query_load_result(tid) is None
    assert a.query_load_result(987_654) is None
    assert a.query_lookup_and_lock_result(987_654) is None
    assert a.pop_completed_store_tasks() == {}


def test_lookup_locks_prevent_delete(kind, made):
    """both (§8.1 item 13): two lookups need two unlocks before delete works;
    eviction (delete) skips a locked key."""
    a = made.adapter(params(kind, made.file()))
    k = key(1)
    store(a, [k], [obj(b"x" * 100)])
    assert lookup(a, [k]) == [True]
    assert lookup(a, [k]) == [True]
    assert status_of(a)["locked_key_count"] == 1  # one key, refcount 2
    a.delete([k])
    assert lookup(a, [k]) == [True], "a locked key must survive delete"
    a.submit_unlock([k])  # the lookup just above
    a.submit_unlock([k])
    a.delete([k])
    assert status_of(a)["locked_key_count"] == 1, "one lookup still holds it"
    assert a.get_usage().total_bytes_used == SLOT
    a.submit_unlock([k])
    a.delete([k])
    assert a.get_usage().total_bytes_used == 0
    assert lookup(a, [k]) == [False]
    assert status_of(a)["locked_key_count"] == 0


def test_full_device_fails_the_store(kind, made):
    """both (§8.1 item 15): a full arena fails the store task, no internal
    eviction; usage 1.0; the keys that fit are there."""
    a = made.adapter(params(kind, made.file(), max_dax_size_gb=2 * SLOT / 2**30))
    ks = [key(i) for i in range(3)]
    r = store(a, ks, [obj(SLOT) for _ in ks])
    assert not r.is_successful()
    assert a.get_usage().usage_fraction == 1.0
    assert lookup(a, ks) == [True, True, False]
    a.submit_unlock(ks)


def test_close_waits_and_invalidates_fds(kind, made):
    """both (§8.1 item 17, §3.11): close waits for a load in flight (its
    result stays collectable); the fds are closed; submits raise."""
    a = made.adapter(params(kind, made.file()))
    ks = [key(i) for i in range(16)]
    data = [os.urandom(SLOT) for _ in ks]
    store(a, ks, [obj(d) for d in data])
    dsts = [obj(SLOT) for _ in ks]
    tid = a.submit_load_task(ks, dsts)
    fds = [a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()]
    a.close()
    a.close()  # idempotent
    bm = a.query_load_result(tid)
    assert bm is not None and bits(bm, 16) == [True] * 16
    assert [bytes(d.byte_array) for d in dsts] == data
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    with pytest.raises(RuntimeError):
        a.submit_store_task([key(99)], [obj(10)])
    with pytest.raises(RuntimeError):
        a.submit_lookup_and_lock_task([key(99)], {})
    with pytest.raises(RuntimeError):
        a.submit_load_task([key(99)], [obj(10)])
    a.delete(ks)  # a no-op after close, as upstream
    assert not status_of(a)["is_healthy"]


def test_restart_is_volatile(kind, made):
    """both (§8.1 item 18): a new adapter on the same file starts empty."""
    path = made.file()
    a = made.adapter(params(kind, path))
    store(a, [key(1)], [obj(100)])
    a.close()
    b = made.adapter(params(kind, path))
    assert lookup(b, [key(1)]) == [False]
    assert b.get_usage().total_bytes_used == 0


# -- reconfigure: the same requests on both, the same answers ------------------


def _call(a, op: str, payload: Any, owners: Callable | None = None) -> tuple[int, Any]:
    try:
        return 200, a.reconfigure(op, payload, device_owners=owners or (lambda p: []))
    except L2ReconfigureError as e:
        return e.status_code, e.payload


def _steady(v: Any) -> Any:
    """`v` without the fields that change while nothing happens: a
    worker's `last_cpu` is read from /proc when asked, and a parked worker
    that wakes for its timeout may have moved."""
    if isinstance(v, dict):
        return {k: _steady(x) for k, x in v.items() if k != "last_cpu"}
    if isinstance(v, list):
        return [_steady(x) for x in v]
    return v


def test_reconfigure_codes_match_the_builtin(kind, made):
    """both (§4.2–§4.5, §8.1 items 2–7): add / remove / resize / status on
    tmpfs files; the answers' codes and messages are upstream's."""
    a_path, b_path, c_path = made.file(), made.file(4 * SLOTS * SLOT), made.file()
    spec = params(kind, a_path, hotplug_enabled=True)
    a = made.adapter(spec)
    ev = Events()
    a.register_listener(ev)
    got: dict[str, tuple[int, Any]] = {}

    def run(name: str, op: str, payload: Any, owners: Callable | None = None) -> Any:
        got[name] = _call(a, op, payload, owners)
        return got[name][1]

    env = run("status", "status", {})
    assert set(env) == {"backend", "supported_operations", "status"}
    assert env["backend"] == "dax" and env["supported_operations"] == ["status", "add", "remove", "resize"]
    st = env["status"]
    assert {"hotplug_enabled", "slot_bytes", "total_capacity_bytes", "total_used_bytes", "devices"} <= set(st)
    assert (st["total_capacity_bytes"], st["total_used_bytes"]) == (SLOTS * SLOT, 0)
    assert _steady(env) == _steady(a.reconfigure_status())

    run("add no path", "add", {"size_bytes": SLOT})
    run("add bool size", "add", {"device_path": b_path, "size_bytes": True})
    run("add float size", "add", {"device_path": b_path, "size_bytes": 1.5})
    run("add size 0", "add", {"device_path": b_path, "size_bytes": 0})
    run("add under a slot", "add", {"device_path": b_path, "size_bytes": SLOT - 1})
    run("add missing", "add", {"device_path": b_path + ".missing", "size_bytes": SLOT})
    run("add owned", "add", {"device_path": b_path, "size_bytes": SLOTS * SLOT}, lambda p: ["L1"])
    run("add", "add", {"device_path": b_path, "size_bytes": SLOTS * SLOT})
    run("add again", "add", {"device_path": b_path, "size_bytes": SLOTS * SLOT})
    run("add other size", "add", {"device_path": b_path, "size_bytes": 2 * SLOTS * SLOT})
    run("remove unknown", "remove", {"device_path": c_path})
    run("remove bad mode", "remove", {"device_path": b_path, "mode": "bogus"})
    run("remove mode type", "remove", {"device_path": b_path, "mode": 5})
    run("remove force type", "remove", {"device_path": b_path, "force": "yes"})
    run("resize unknown", "resize", {"device_path": c_path, "size_bytes": SLOT})
    run("resize bad mode", "resize", {"device_path": b_path, "size_bytes": SLOT, "mode": "drain"})
    run("unknown op", "flip", {})

    # A locked key blocks migrate (409), and the state goes back to active.
    k_locked = key(500)
    store(a, [k_locked], [obj(b"L" * 1000)])
    assert lookup(a, [k_locked]) == [True]
    src = next(d["device_path"] for d in a.reconfigure_status()["status"]["devices"]
               if d["live_slot_count"] == 1)
    body = run("remove locked", "remove", {"device_path": src, "mode": "migrate"})
    assert body["status"] == "blocked" and body["locked_key_count"] == 1
    states = {d["device_path"]: d["state"] for d in a.reconfigure_status()["status"]["devices"]}
    assert states[src] == "active"
    a.submit_unlock([k_locked])

    # Drain the device holding it: data stays readable, new stores go elsewhere.
    run("drain", "remove", {"device_path": src, "mode": "drain"})
    other = b_path if src == a_path else a_path
    k_new = key(501)
    store(a, [k_new], [obj(b"N" * 10)])
    devs = {d["device_path"]: d for d in a.reconfigure_status()["status"]["devices"]}
    assert devs[src]["state"] == "draining" and devs[other]["live_slot_count"] == 1
    dst = [obj(1000)]
    assert load(a, [k_locked], dst) == [True] and bytes(dst[0].byte_array) == b"L" * 1000

    # Migrate it away: the key moves, no delete events, bytes still served.
    deleted_before = len(ev.deleted)
    body = run("remove migrate", "remove", {"device_path": src, "mode": "migrate"})
    assert (body["moved_keys"], body["deleted_keys"], body["source_slots_freed"]) == (1, 0, 1)
    assert body["state"] == "removed" and len(ev.deleted) == deleted_before
    dst = [obj(1000)]
    assert load(a, [k_locked], dst) == [True] and bytes(dst[0].byte_array) == b"L" * 1000
    run("remove removed", "remove", {"device_path": src})

    # Grow and shrink the one left (its file is large enough for a grow
    # only when it is b_path).
    if other == b_path:
        run("grow", "resize", {"device_path": other, "size_bytes": 2 * SLOTS * SLOT})
    run("shrink live evict", "resize", {"device_path": other, "size_bytes": SLOT, "mode": "evict"})

    # Evict: the listener hears the deletes.
    body = run("remove evict", "remove", {"device_path": other, "mode": "evict"})
    assert body["deleted_keys"] == 2 and len(ev.deleted) == deleted_before + 2
    assert a.get_usage().total_bytes_used == 0

    expect = {
        "status": 200,
        "add no path": 400,
        "add bool size": 400,
        "add float size": 400,
        "add size 0": 400,
        "add under a slot": 400,
        "add missing": 400,
        "add owned": 409,
        "add": 200,
        "add again": 200,
        "add other size": 409,
        "remove unknown": 404,
        "remove bad mode": 400,
        "remove mode type": 400,
        "remove force type": 400,
        "resize unknown": 404,
        "resize bad mode": 400,
        "unknown op": 400,
        "remove locked": 409,
        "drain": 200,
        "remove migrate": 200,
        "remove removed": 404,
        "shrink live evict": 409,
        "remove evict": 200,
    }
    if other == b_path:
        expect["grow"] = 200
    assert {k: v[0] for k, v in got.items()} == expect, got
    messages = {
        "add no path": "device_path must be a non-empty string",
        "add bool size": "size_bytes must be a positive integer",
        "add owned": "physical device is already mapped by L1",
        "add other size": "device_path already active with a different size",
        "remove unknown": "DAX device not found",
        "remove bad mode": "mode must be migrate, evict, or drain",
        "remove force type": "force must be a boolean",
        "resize bad mode": "mode must be migrate or evict",
        "unknown op": "unsupported DAX reconfigure operation: flip",
        "shrink live evict": "resize shrink would drop live keys without migration",
    }
    assert {k: got[k][1].get("error") for k in messages} == messages
    assert got["add"][1]["device"]["state"] == "active"
    assert got["add again"][1]["device"]["device_path"] == b_path
    assert got["drain"][1]["state"] == "draining"


def test_reconfigure_with_hotplug_off_is_403(kind, made):
    """both: hotplug off answers add, remove and resize 403, whatever the path."""
    a = made.adapter(params(kind, made.file()))
    other = made.file()
    assert _call(a, "add", {"device_path": other, "size_bytes": SLOT})[0] == 403
    assert _call(a, "remove", {"device_path": other})[0] == 403
    assert _call(a, "resize", {"device_path": other, "size_bytes": SLOT})[0] == 403
    assert _call(a, "status", {})[0] == 200


def test_owns_device_by_identity(kind, made):
    """both (§3.2): the same file by another path (a symlink) is owned; a
    missing or other path is not; nothing is owned after close."""
    path = made.file()
    a = made.adapter(params(kind, path))
    link = path + ".link"
    os.symlink(path, link)
    made.files.append(link)
    assert a.owns_device(path) and a.owns_device(link)
    assert not a.owns_device(made.file()) and not a.owns_device(path + ".missing")
    a.close()
    assert not a.owns_device(path)


# -- the plugin's own contract ------------------------------------------------------


@pytest.fixture
def plugin(made):
    def make(**extra: Any):
        p = {"slot_bytes": SLOT, "device_path": "memfd", "max_dax_size_gb": GB,
             "num_load_workers": 2}
        p.update(extra)
        return made.adapter({"type": "plugin", "module_path": "daxkv.lmcache",
                             "class_name": "DaxL2Adapter", "adapter_params": p})

    return make


def test_delete_answers_each_key_once_and_scales(plugin):
    """The core's delete says per key whether it was deleted: a key listed
    twice reads True at its first place only, an unknown key False, and a
    delete of thousands of keys (LMCache's eviction batch) answers each
    (it once scanned the deleted list per key: 4096² compares)."""
    a = plugin(slot_bytes=4096, max_dax_size_gb=16 / 1024)
    ks = [key(i) for i in range(3000)]
    data = b"y" * 4096
    for i in range(0, len(ks), 500):
        assert store(a, ks[i:i + 500], [obj(data) for _ in ks[i:i + 500]]) == 500 * 4096
    assert a._core.delete([ks[0], ks[0], ks[1], key(99999)]) == [True, False, True, False]
    got = a._core.delete(ks[::-1])
    assert got == [i > 1 for i in range(len(ks))][::-1]
    assert a.get_usage().total_bytes_used == 0


def test_key_wire_format_is_the_native_connectors():
    """An ObjectKey names the same engine entry on the plugin and the
    native_plugin paths: the same wire string is digested."""
    ks = [
        ObjectKey(chunk_hash=b"\x00\x01\xfe", model_name="org/model-7b", kv_rank=0),
        ObjectKey(chunk_hash=os.urandom(32), model_name="m", kv_rank=0xDEADBEEF,
                  object_group_id=300, cache_salt="user-1"),
        ObjectKey(chunk_hash=b"", model_name="", kv_rank=1 << 40, object_group_id=0),
    ]
    # The hex of every digit count, padded (kv_rank, 8) and not (group).
    for v in [0, 1, 0xF, 0x10, 0xFF, 0x1234567, 0xFFFFFFFF, 1 << 32, 0x123456789ABCDEF0, (1 << 64) - 1]:
        ks.append(ObjectKey(chunk_hash=b"\xab", model_name="m", kv_rank=v, object_group_id=v))
    for k in ks:
        assert DaxL2Core.key_string(k) == _object_key_to_string(k)


def test_lookup_signatures_of_lmcache_versions(plugin):
    a = plugin()
    ks = [key(1), key(2)]
    store(a, ks[:1], [obj(10)])
    layout = MemoryLayoutDesc(shapes=[torch.Size([10])], dtypes=[torch.uint8])
    for extra in [(), (layout,), ({0: layout},)]:
        tid = a.submit_lookup_and_lock_task(ks, *extra)
        bm = wait_result(a, a.query_lookup_and_lock_result, a.get_lookup_and_lock_event_fd(), tid)
        assert bits(bm, 2) == [True, False]
    assert a.report_status()["locked_key_count"] == 1
    for _ in range(3):
        a.submit_unlock(ks)
    assert a.report_status()["locked_key_count"] == 0


def test_many_tasks_in_flight_and_a_full_task_table(plugin):
    """More tasks than the engine's task table: the refused ones complete
    at once as failures (signalled on the fd), every id exactly once."""
    a = plugin(task_slots=8)
    ks = [key(i) for i in range(24)]
    srcs = [obj(1000 + i) for i in range(24)]
    ids = [a.submit_store_task([k], [s]) for k, s in zip(ks, srcs)]
    assert len(set(ids)) == 24
    got = drain_stores(a, set(ids))
    local = {t for t in ids if t < 0}  # completed without the engine
    assert local, "a table of 8 must refuse some of 24 uncollected stores"
    assert all(not got[t].is_successful() for t in local)
    assert all(got[t].is_successful() for t in set(ids) - local)
    stored = a._core.exists(ks)
    assert sum(stored) == 24 - len(local)
    assert a.pending_tasks() == 0
    # Lookups are done on the caller, outside the engine's table: more of
    # them than the table holds all complete, each with its own answer.
    lids = [a.submit_lookup_and_lock_task([k], {}) for k in ks]
    assert len(set(lids)) == 24
    lres = [bits(wait_result(a, a.query_lookup_and_lock_result,
                             a.get_lookup_and_lock_event_fd(), t), 1)[0] for t in lids]
    assert lres == stored
    assert a.report_status()["locked_key_count"] == sum(stored)
    a.submit_unlock([k for k, r in zip(ks, lres) if r])
    assert a.report_status()["locked_key_count"] == 0
    assert a.pending_tasks() == 0


def test_worker_panic_fails_only_its_task(plugin):
    """A panic in a task part fails that task; the task still completes (its
    fd is signalled, its buffers released), the others are untouched."""
    bad = key(666)
    a = plugin(_panic_on_key=_object_key_to_string(bad), num_store_workers=1)
    good = [key(i) for i in range(4)]
    data = [os.urandom(500) for _ in good]
    t_bad = a.submit_store_task([bad], [obj(10)])
    t_good = a.submit_store_task(good, [obj(d) for d in data])
    got = drain_stores(a, {t_bad, t_good})
    assert not got[t_bad].is_successful() and got[t_good].is_successful()
    # A load meeting the key completes too (the panicking part's keys all
    # miss: one part, here the whole task). Lookups run on the caller, not
    # in a worker: they answer (the failed store left no key) and lock.
    assert lookup(a, [bad] + good) == [False] + [True] * 4
    assert lookup(a, good) == [True] * 4
    a.submit_unlock(good)
    a.submit_unlock(good)
    assert load(a, [bad], [obj(10)]) == [False]
    dsts = [obj(500) for _ in good]
    assert load(a, good, dsts) == [True] * 4
    assert [bytes(d.byte_array) for d in dsts] == data
    st = a.report_status()
    assert st["worker_panics"] >= 2 and st["locked_key_count"] == 0
    assert a.pending_tasks() == 0
    assert a.get_usage().total_bytes_used == 4 * SLOT


def test_restore_counts_a_slot_once(plugin):
    """A store of a key already held succeeds and is told to the listeners
    with size 0: the per-salt bytes count each slot once (upstream counts
    it twice, reference §9.4 item 3)."""
    a = plugin()
    ev = Events()
    a.register_listener(ev)
    k = key(1, salt="u")
    assert store(a, [k], [obj(100)]).is_successful()
    assert store(a, [k], [obj(100)]).is_successful()
    assert ev.sizes == [SLOT, 0]
    u = a.get_usage()
    assert u.total_bytes_used == SLOT and dict(u.bytes_by_cache_salt) == {"u": SLOT}
    a.delete([k])
    assert [repr(x) for x in ev.deleted] == [repr(k)]
    assert dict(a.get_usage().bytes_by_cache_salt) == {}


def test_delete_racing_store_collection(plugin):
    """The interleaving of l2.rs (`KnownKeys`): a delete that lands between
    a store's completion and its collection. Whatever the order, each key
    is reported stored and deleted consistently: at the end the listener's
    books match the engine (no key counted that is not there). Without the
    deferral of known.rs (a delete told before its key's "stored") this
    failed: LMCache's base class clamped an underflow and kept 3 slots
    counted for a salt with nothing stored."""
    a = plugin(num_store_workers=2)
    ev = Events()
    a.register_listener(ev)
    ks = [key(i, salt="r") for i in range(8)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def deleter() -> None:
        try:
            while not stop.is_set():
                a.delete(ks)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=deleter)
    t.start()
    try:
        for r in range(200):
            ids = {a.submit_store_task([k], [obj(64)]) for k in ks}
            drain_stores(a, ids)
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    held = a._core.exists(ks)
    per_key: dict[str, int] = {}
    for k, size in zip(ev.stored, ev.sizes):
        per_key[repr(k)] = per_key.get(repr(k), 0) + size
    for k in ev.deleted:
        per_key[repr(k)] = per_key.get(repr(k), 0) - SLOT
    assert {k: v for k, v in per_key.items() if v} == {
        repr(k): SLOT for k, h in zip(ks, held) if h
    }
    u = a.get_usage()
    assert u.bytes_by_cache_salt.get("r", 0) == u.total_bytes_used == sum(held) * SLOT
    a.delete(ks)
    assert dict(a.get_usage().bytes_by_cache_salt) == {}


def test_bad_input_raises_or_misses_and_leaks_nothing(plugin):
    a = plugin()
    ks = [key(i) for i in range(3)]
    # Wrong lengths.
    with pytest.raises(ValueError, match="same length"):
        a.submit_store_task(ks, [obj(10)])
    with pytest.raises(ValueError, match="same length"):
        a.submit_load_task(ks, [obj(10)])
    # Not keys, not buffers.
    with pytest.raises(TypeError, match="key 1"):
        a.submit_store_task([ks[0], 42], [obj(1), obj(1)])
    with pytest.raises(TypeError, match="key 0"):
        a.submit_lookup_and_lock_task([object()], {})
    with pytest.raises(BufferError, match="destination object 0"):
        a.submit_load_task([ks[0]], [b"read-only"])
    with pytest.raises(BufferError, match="source object 0"):
        a.submit_store_task([ks[0]], [object()])
    # An object larger than a slot: that key fails, the task fails, the
    # others are stored; no slot is taken for it.
    r = store(a, ks, [obj(10), obj(SLOT + 1), obj(SLOT)])
    assert not r.is_successful()
    assert a._core.exists(ks) == [True, False, True]
    assert a.get_usage().total_bytes_used == 2 * SLOT
    # A destination shorter than the payload: that key misses, untouched.
    small = obj(b"\x11" * (SLOT - 1))
    assert load(a, [ks[2]], [small]) == [False]
    assert bytes(small.byte_array) == b"\x11" * (SLOT - 1)
    # Unknown keys miss everywhere and delete is a no-op.
    assert lookup(a, [key(999)]) == [False]
    assert load(a, [key(999)], [obj(10)]) == [False]
    a.delete([key(999)])
    # Empty tasks complete.
    assert store(a, [], []).is_successful()
    assert lookup(a, []) == []
    # Bad reconfigure payloads are a 400, not an exception of another kind.
    for payload in [None, [1], {"device_path": object()}]:
        with pytest.raises(L2ReconfigureError) as e:
            a.reconfigure("add", payload)
        assert e.value.status_code == 400
    assert not a.owns_device(None) and not a.owns_device("")
    # Nothing leaked.
    st = a.report_status()
    assert st["locked_key_count"] == 0 and st["live_slot_count"] == 2
    assert a.pending_tasks() == 0


def test_overlapping_load_destinations_refused(plugin):
    """Two destinations of one load that overlap would be written by two
    workers at once: refused before anything is submitted."""
    a = plugin()
    ks = [key(1), key(2)]
    store(a, ks, [obj(100), obj(100)])
    buf = bytearray(300)
    mv = memoryview(buf)
    with pytest.raises(ValueError, match="overlap"):
        a.submit_load_task(ks, [mv[0:100], mv[50:150]])
    same = obj(100)
    with pytest.raises(ValueError, match="overlap"):
        a.submit_load_task(ks, [same, same])
    assert load(a, ks, [mv[0:100], mv[100:200]]) == [True, True]
    assert a.pending_tasks() == 0


def padded(data: bytes, phys: int):
    """An LMCache memory object of `len(data)` logical bytes over a tensor
    of `phys` bytes (the L1 allocator's alignment padding), the padding
    0xEE."""
    o = obj(data)
    t = torch.full((phys,), 0xEE, dtype=torch.uint8)
    t[: len(data)] = o.raw_data
    o.raw_data = t
    return o


def test_memory_obj_read_from_its_tensor(plugin):
    """A MemoryObj is read from its tensor (`raw_data.data_ptr()`,
    `get_size()` bytes), as `byte_array` describes it: a padded tail chunk
    stores and loads its logical bytes only; the task holds the tensor
    until it is collected; a tensor that is not one contiguous CPU range
    is still read through `byte_array`."""
    a = plugin()
    ks = [key(1), key(2)]
    src = padded(b"t" * 1000, 4096)
    assert src.get_size() == 1000 and src.raw_data.nbytes == 4096
    t = src.raw_data
    refs = sys.getrefcount(t)
    tid = a.submit_store_task(ks[:1], [src])
    assert sys.getrefcount(t) == refs + 1, "the task must hold the tensor"
    r = drain_stores(a, {tid})[tid]
    assert r.is_successful() and sys.getrefcount(t) == refs, "collected: the tensor let go"
    dst = padded(b"\0" * 1000, 4096)
    assert load(a, ks[:1], [dst]) == [True]
    assert bytes(dst.raw_data[:1000].numpy()) == b"t" * 1000
    assert bytes(dst.raw_data[1000:].numpy()) == b"\xee" * 3096, "the padding must stay untouched"
    # A logical size past the tensor's bytes is refused (`byte_array`
    # would describe memory past the tensor).
    bad = obj(b"u" * 100)
    bad.raw_data = bad.raw_data[:50]
    with pytest.raises(BufferError, match="source object 0: get_size.. is 100 bytes, past its tensor's 50"):
        a.submit_store_task(ks[1:], [bad])
    assert a._core.exists(ks[1:]) == [False]
    # A tensor that is not contiguous (one byte expanded: stride 0): the
    # get_size() bytes at its data_ptr() are its neighbour's. Refused both
    # ways; the neighbour is neither stored nor written.
    backing = torch.arange(512, dtype=torch.int32).to(torch.uint8)
    neighbour = bytes(backing[256:].numpy())
    strided = obj(256)
    strided.raw_data = backing[255:256].expand(256)
    with pytest.raises(BufferError, match="source object 0: .*not contiguous"):
        a.submit_store_task(ks[1:], [strided])
    assert a._core.exists(ks[1:]) == [False]
    with pytest.raises(BufferError, match="destination object 0: .*not contiguous"):
        a.submit_load_task(ks[:1], [strided])
    assert bytes(backing[256:].numpy()) == neighbour
    a.submit_unlock(ks)
    assert a.pending_tasks() == 0


def test_use_after_close(plugin):
    a = plugin()
    store(a, [key(1)], [obj(10)])
    a.close()
    assert a.get_store_event_fd() == -1
    with pytest.raises(RuntimeError, match="closing"):
        a.submit_store_task([key(2)], [obj(10)])
    a.submit_unlock([key(1)])  # never fails
    a.delete([key(1)])
    assert a.pop_completed_store_tasks() == {}
    with pytest.raises(L2ReconfigureError) as e:
        a.reconfigure("add", {"device_path": "memfd", "size_bytes": SLOT})
    assert e.value.status_code in (403, 503)
    assert not a.report_status()["is_healthy"]


def test_close_racing_submits(plugin):
    """The interleaving of l2.rs ("Completions that never reach the engine"):
    threads submit into a full task table while close runs; each submit
    either raises (closing) or gets an id, and every id completes once.
    (A write to an fd close had closed would be silent unless the number
    were reused; what this asserts is that no submit is lost or errs.)"""
    for _ in range(5):
        a = plugin(task_slots=4)
        ids: list[int] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def spam(t: int) -> None:
            for i in range(200):
                try:
                    tid = a.submit_store_task([key(t * 1000 + i)], [obj(64)])
                except RuntimeError:
                    return
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)
                    return
                with lock:
                    ids.append(tid)

        ts = [threading.Thread(target=spam, args=(t,)) for t in range(3)]
        for t in ts:
            t.start()
        time.sleep(0.002)
        a.close()
        for t in ts:
            t.join(30)
            assert not t.is_alive()
        assert not errors, errors
        got: dict = {}
        for tid, r in a.pop_completed_store_tasks().items():
            got[tid] = r
        assert set(got) == set(ids), "every id completes exactly once"
        assert a.pending_tasks() == 0


def test_controllers_at_once(plugin):
    """A store thread, a prefetch thread (lookup → load → unlock), an
    eviction thread (delete + usage) and a status thread, on one adapter,
    each polling its fds as LMCache's controllers do."""
    a = plugin(max_dax_size_gb=512 * SLOT / 2**30)
    errors: list[BaseException] = []
    stored: dict = {}
    stored_lock = threading.Lock()
    stop = threading.Event()

    def payload(i: int) -> bytes:
        n = SLOT if i % 3 else 777 + i
        return (i.to_bytes(4, "big") * (n // 4 + 1))[:n]

    def storer() -> None:
        try:
            for r in range(15):
                ks = [key(r * 16 + i) for i in range(16)]
                ps = [payload(r * 16 + i) for i in range(16)]
                res = store(a, ks, [obj(p) for p in ps])
                assert res.is_successful()
                with stored_lock:
                    stored.update({r * 16 + i: ps[i] for i in range(16)})
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def prefetcher() -> None:
        try:
            loaded = 0
            while loaded < 100 and not errors:
                with stored_lock:
                    ids = sorted(stored)[-8:]
                if not ids:
                    time.sleep(0.001)
                    continue
                ks = [key(i) for i in ids]
                hit = lookup(a, ks)
                got = [k for k, h in zip(ks, hit) if h]
                dsts = [obj(len(payload(i))) for i, h in zip(ids, hit) if h]
                ok = load(a, got, dsts)
                a.submit_unlock(got)
                for i, d, o in zip([i for i, h in zip(ids, hit) if h], dsts, ok):
                    assert o, "a locked key must load"
                    assert bytes(d.byte_array) == payload(i)
                    loaded += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def evictor() -> None:
        try:
            while not stop.is_set():
                with stored_lock:
                    old = sorted(stored)[:4]
                a.delete([key(i) for i in old])
                u = a.get_usage()
                assert 0 <= u.total_bytes_used <= u.total_capacity_bytes
                time.sleep(0.002)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def watcher() -> None:
        try:
            while not stop.is_set():
                assert a.reconfigure_status()["backend"] == "dax"
                assert a.report_status()["is_healthy"]
                time.sleep(0.002)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    workers = [threading.Thread(target=f) for f in (storer, prefetcher)]
    bg = [threading.Thread(target=f) for f in (evictor, watcher)]
    for t in workers + bg:
        t.start()
    for t in workers:
        t.join(120)
        assert not t.is_alive(), "a controller thread hung"
    stop.set()
    for t in bg:
        t.join(30)
    assert not errors, errors
    st = a.report_status()
    assert st["locked_key_count"] == 0 and a.pending_tasks() == 0
    assert a.get_usage().total_bytes_used == st["live_slot_count"] * SLOT


def test_reconfigure_add_with_owners_callback_under_load(plugin, made):
    """device_owners runs (in Python, GIL taken again) while the call has
    the GIL released and other threads submit; it may call back into the
    adapter. An exception it raises propagates."""
    a = plugin(hotplug_enabled=True)
    path = made.file()
    stop = threading.Event()
    errors: list[BaseException] = []

    def busy() -> None:
        try:
            i = 0
            while not stop.is_set():
                store(a, [key(i)], [obj(100)])
                i += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=busy)
    t.start()
    seen: list[str] = []

    def owners(p: str) -> list[str]:
        seen.append(p)
        assert not a.owns_device(p)
        a.report_status()
        return []

    try:
        r = a.reconfigure("add", {"device_path": path, "size_bytes": SLOTS * SLOT},
                          device_owners=owners)
        assert r["status"] == "ok" and seen == [path]

        def boom(p: str) -> list[str]:
            raise KeyError("owners failed")

        with pytest.raises(KeyError, match="owners failed"):
            a.reconfigure("add", {"device_path": made.file(), "size_bytes": SLOT},
                          device_owners=boom)
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    assert a.owns_device(path)
    assert len(a.reconfigure_status()["status"]["devices"]) == 2


def test_memfd_devices_and_reconfigure(plugin):
    """Add, drain, remove and resize anonymous memfd devices (the plugin
    only: the built-in maps files)."""
    a = plugin(hotplug_enabled=True)
    # "memfd" names the configured device: at another size, 409 with the
    # way out; further anonymous devices are "memfd:NAME".
    with pytest.raises(L2ReconfigureError) as e:
        a.hotplug_add_device("memfd", 4 * SLOT)
    assert e.value.status_code == 409 and "memfd:NAME" in e.value.payload["error"]
    r = a.hotplug_add_device("memfd:b", 4 * SLOT)
    assert r["device"]["state"] == "active"
    assert r["device"]["device_path"] == "memfd:b"
    idx = r["device"]["index"]
    assert a.hotplug_add_device("memfd:b", 4 * SLOT)["device"]["index"] == idx
    assert a.get_usage().total_capacity_bytes == (SLOTS + 4) * SLOT
    ks = [key(i) for i in range(SLOTS + 2)]
    assert store(a, ks, [obj(8) for _ in ks]).is_successful()
    assert a.get_usage().total_bytes_used == (SLOTS + 2) * SLOT
    assert idx == 1
    r = a.hotplug_remove_device("memfd:b", "evict", force=True)
    assert r["state"] == "removed"


# -- LMCache's wrappers: fault_inject (and the storage manager's unwrap) -------


def fault_spec(inner: dict, **kw: Any) -> dict:
    return {"type": "fault_inject", "inner": inner, **kw}


def native_plugin_spec() -> dict:
    return {
        "type": "native_plugin",
        "module_path": "daxkv",
        "class_name": "DaxConnector",
        "adapter_params": {"slot_bytes": SLOT, "device_path": "memfd", "max_dax_size_gb": GB},
        "max_capacity_gb": GB,
    }


@pytest.mark.parametrize("inner", ["plugin", "native_plugin"])
def test_fault_inject_drops_are_misses_not_hangs(inner, made):
    """Under LMCache's fault_inject wrapper, a dropped load is reported as a
    miss (its bit cleared); lookup is untouched; nothing hangs or leaks."""
    spec = params("plugin", "memfd") if inner == "plugin" else native_plugin_spec()
    a = made.adapter(fault_spec(spec, gap_indices=[1, 3]))
    assert type(a).__name__ == "FaultInjectL2Adapter"
    ks = [key(i) for i in range(5)]
    data = [os.urandom(300) for _ in ks]
    assert store(a, ks, [obj(d) for d in data]).is_successful()
    assert lookup(a, ks) == [True] * 5
    dsts = [obj(300) for _ in ks]
    assert load(a, ks, dsts) == [True, False, True, False, True]
    assert [bytes(dsts[i].byte_array) for i in (0, 2, 4)] == [data[i] for i in (0, 2, 4)]
    a.submit_unlock(ks)
    if inner == "plugin":
        st = a.report_status()
        assert st["fault_inject"]["gap_indices"] == [1, 3] and st["locked_key_count"] == 0
        assert a._inner.pending_tasks() == 0


def _stub_storage_manager(adapters: list) -> StorageManager:
    """A StorageManager holding `adapters` (with their configs), none of its
    L1 side: enough for LMCache's own reconfigure routing and owner checks
    (the upstream test does the same, §8.1 items 10–11)."""
    sm = object.__new__(StorageManager)
    sm._adapters_lock = threading.Lock()
    sm._lifecycle_lock = threading.RLock()
    sm._l1_by_tag = {}
    sm._l2_adapters = {i: a for i, (a, _) in enumerate(adapters)}
    sm._adapter_descriptors = {
        i: L2AdapterDescriptor(index=i, config=c) for i, (_, c) in enumerate(adapters)
    }
    sm._publish_capacity_changed = lambda: None
    return sm


def test_reconfigure_and_owns_device_reachable_through_fault_inject(made):
    """LMCache's storage manager unwraps one `inner_adapter` level: the
    daxkv adapter wrapped by fault_inject stays reconfigurable and a device
    owner; the built-in dax wrapped the same way stays as LMCache has it."""
    p_file, d_file, new_file = made.file(), made.file(), made.file()
    p_cfg = parse(fault_spec(params("plugin", p_file, hotplug_enabled=True), gap_indices=[0]))
    wrapped = create_l2_adapter(p_cfg)
    made.adapters.append(wrapped)
    d_cfg = parse(params("dax", d_file, hotplug_enabled=True))
    builtin = create_l2_adapter(d_cfg)
    made.adapters.append(builtin)
    wd_cfg = parse(fault_spec(params("dax", made.file())))
    wrapped_builtin = create_l2_adapter(wd_cfg)
    made.adapters.append(wrapped_builtin)

    sm = _stub_storage_manager([(wrapped, p_cfg), (builtin, d_cfg), (wrapped_builtin, wd_cfg)])
    assert sm._unwrap_reconfigurable_l2_adapter(wrapped) is wrapped._inner
    assert sm._unwrap_reconfigurable_l2_adapter(wrapped_builtin) is None, "LMCache's own: unchanged"

    st = sm.get_l2_adapter_reconfigure_status()
    assert st["num_adapters"] == 2
    first, second = st["adapters"]
    assert (first["backend"], first["adapter_index"], first["l2_adapter_index"]) == ("fault_inject", 0, 0)
    assert (second["backend"], second["adapter_index"]) == ("dax", 1)

    # Owner checks both ways, through the wrapper.
    with pytest.raises(L2ReconfigureError) as e:
        sm.reconfigure_l2_adapter(0, "add", {"device_path": d_file, "size_bytes": SLOTS * SLOT})
    assert (e.value.status_code, e.value.payload["error"]) == (409, "physical device is already mapped by dax")
    with pytest.raises(L2ReconfigureError) as e:
        sm.reconfigure_l2_adapter(1, "add", {"device_path": p_file, "size_bytes": SLOTS * SLOT})
    assert e.value.payload["error"] == "physical device is already mapped by fault_inject"
    assert sm._l2_device_owner_names(p_file) == ["fault_inject"]

    r = sm.reconfigure_l2_adapter(0, "add", {"device_path": new_file, "size_bytes": SLOTS * SLOT})
    assert r["status"] == "ok" and r["adapter_index"] == 0
    assert wrapped._inner.owns_device(new_file)
    r = sm.reconfigure_l2_adapter(0, "remove", {"device_path": new_file, "mode": "evict"})
    assert r["state"] == "removed"
    assert sm.reconfigure_l2_adapter(0, "status", {})["backend"] == "dax"


# -- lookups completed on the calling thread ----------------------------------------


def test_a_lookup_completes_on_the_caller_and_its_locks_hold(plugin):
    """A lookup is done on the calling thread: when the submit returns, the
    result is there and the lookup fd is readable (LMCache's prefetch
    controller queries only a signalled adapter); it is returned once; its
    hits are locked in the engine, so eviction skips them until unlocked;
    it is counted as one lookup in the metrics."""
    from test_control import sample

    a = plugin()
    ks = [key(i) for i in range(6)]
    assert store(a, ks[:4], [obj(100 + i) for i in range(4)]).is_successful()
    fd = a.get_lookup_and_lock_event_fd()
    consume_fd(fd)
    tid = a.submit_lookup_and_lock_task(ks, {})
    assert tid < 0, "completed here: the id space of tasks the engine never ran"
    assert select.select([fd], [], [], 0)[0] == [fd], "the fd is signalled by the submit"
    bm = a.query_lookup_and_lock_result(tid)
    assert bm is not None and bits(bm, 6) == [True] * 4 + [False] * 2
    assert a.query_lookup_and_lock_result(tid) is None, "returned once"
    assert a.pending_tasks() == 0
    assert status_of(a)["locked_key_count"] == 4
    a.delete(ks)
    assert a._core.exists(ks[:4]) == [True] * 4, "eviction skips locked keys"
    a.submit_unlock(ks)
    assert status_of(a)["locked_key_count"] == 0
    a.delete(ks[:2])
    assert a._core.exists(ks[:4]) == [False, False, True, True]
    text = a.metrics_text()
    assert sample(text, "daxkv_ops_total", l2_name="plugin", op="lookup") == 1
    assert sample(text, "daxkv_keys_total", l2_name="plugin", op="lookup", result="ok") == 4


def test_lookups_racing_evictions_never_lose_a_locked_key(plugin):
    """A hunting test: one thread looks keys up (locking the hits on the
    caller) while another deletes them all and stores them back. Every hit
    must stay stored until its unlock: eviction skips locked keys, and a
    lookup that found a key holds it. After each store-back the evictor
    waits (bounded) for a lookup that hit, so hits are certain however the
    threads are scheduled; the next delete then races the next lookup.
    Bounded in rounds and time."""
    a = plugin()
    ks = [key(i) for i in range(8)]
    srcs = [obj(200 + i) for i in range(8)]
    assert store(a, ks, srcs).is_successful()
    stop = threading.Event()
    hit = threading.Event()
    errors: list = []

    def evict() -> None:
        try:
            while not stop.is_set():
                a.delete(ks)
                gone = [k for k, e in zip(ks, a._core.exists(ks)) if not e]
                if gone:
                    store(a, gone, [srcs[ks.index(k)] for k in gone])
                if not hit.wait(10) and not stop.is_set():
                    raise AssertionError("no lookup hit keys nobody deleted")
                hit.clear()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    t = threading.Thread(target=evict)
    t.start()
    hits = 0
    deadline = time.monotonic() + 20
    try:
        for _ in range(400):
            if time.monotonic() > deadline:
                break
            found = lookup(a, ks)
            held = [k for k, f in zip(ks, found) if f]
            hits += len(held)
            a.delete(held)  # this thread's own eviction too: never past a lock
            assert all(a._core.exists(held)), "a locked hit was deleted"
            a.submit_unlock(held)
            if held:
                hit.set()
    finally:
        stop.set()
        hit.set()
        t.join(30)
    assert not t.is_alive() and not errors, errors
    assert hits > 0
    assert status_of(a)["locked_key_count"] == 0


def test_a_lookup_racing_close_completes_or_raises(plugin):
    """A lookup before close stays collectable after it; one after close
    raises upstream's error; lookups on threads racing close each either
    return an id whose result is collectable or raise that error."""
    a = plugin()
    ks = [key(i) for i in range(4)]
    assert store(a, ks, [obj(300 + i) for i in range(4)]).is_successful()
    before = a.submit_lookup_and_lock_task(ks, {})
    outcomes: list = []

    def racer() -> None:
        for _ in range(200):
            try:
                outcomes.append(a.submit_lookup_and_lock_task(ks, {}))
            except RuntimeError as e:
                outcomes.append(str(e))
                return

    ts = [threading.Thread(target=racer) for _ in range(2)]
    for t in ts:
        t.start()
    a.close()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts)
    with pytest.raises(RuntimeError, match="DaxL2Adapter is closing"):
        a.submit_lookup_and_lock_task(ks, {})
    assert bits(a.query_lookup_and_lock_result(before), 4) == [True] * 4
    for o in outcomes:
        if isinstance(o, str):
            assert o == "DaxL2Adapter is closing"
        else:
            assert a.query_lookup_and_lock_result(o) is not None
    assert a.pending_tasks() == 0


def test_a_lookup_in_a_forked_child_raises(plugin):
    """The child of a fork has no engine workers and shares the parent's
    mapping: a lookup there (done on the calling thread) must raise, not
    lock keys in the parent's slots."""
    a = plugin()
    ks = [key(i) for i in range(2)]
    assert store(a, ks, [obj(400), obj(401)]).is_successful()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave at once
        try:
            a.submit_lookup_and_lock_task(ks, {})
            os.write(w, b"submitted")
        except RuntimeError as e:
            os.write(w, f"raised {e}".encode()[:200])
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 256).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert got.startswith("raised") and "fork" in got, got
    assert status_of(a)["locked_key_count"] == 0
    assert lookup(a, ks) == [True, True]
    a.submit_unlock(ks)


def test_a_truncated_device_fails_alone_and_lmcache_hears_its_keys_deleted(made):
    """A device file truncated under its mapping (what a device that goes
    bad looks like: a SIGBUS in the copy) fails that device alone: its keys
    read as misses and reach LMCache's listener as deleted, once; the other
    device's keys load with their bytes; new stores go to it; status says
    degraded and names the device; remove evicts it (docs/hotplug.md,
    "Failed devices")."""
    a_path, b_path = made.file(), made.file()
    a = made.adapter(params("plugin", a_path, hotplug_enabled=True))
    ev = Events()
    a.register_listener(ev)
    on_a = [key(700 + i) for i in range(6)]
    data_a = [os.urandom(SLOT) for _ in on_a]
    r = store(a, on_a, [obj(d) for d in data_a])
    assert r.is_successful()
    _call(a, "add", {"device_path": b_path, "size_bytes": SLOTS * SLOT})
    # The least used device takes each new key: all of these go to b.
    on_b = [key(800 + i) for i in range(4)]
    data_b = [os.urandom(SLOT // 2) for _ in on_b]
    assert store(a, on_b, [obj(d) for d in data_b]).is_successful()
    live = {d["device_path"]: d["live_slot_count"] for d in a.reconfigure_status()["status"]["devices"]}
    assert live == {a_path: 6, b_path: 4}

    os.truncate(a_path, 0)
    # LMCache looks up (the index is in DRAM: found), then loads: a miss.
    assert lookup(a, on_a) == [True] * 6
    assert load(a, on_a[:2], [obj(SLOT) for _ in range(2)]) == [False, False]
    a.submit_unlock(on_a)

    st = a.report_status()
    assert st["degraded"] is True and st["is_healthy"] is True, st
    # `failed_devices` indexes `devices`.
    assert [st["devices"][i]["device_path"] for i in st["failed_devices"]] == [a_path], st
    # The keys are deleted: the store controller's next pop tells LMCache.
    a.pop_completed_store_tasks()
    assert sorted(map(repr, ev.deleted)) == sorted(map(repr, on_a))
    assert lookup(a, on_a) == [False] * 6
    # b serves on: its bytes, new stores.
    dsts = [obj(SLOT // 2) for _ in on_b]
    assert load(a, on_b, dsts) == [True] * 4
    assert [bytes(d.byte_array) for d in dsts] == data_b
    a.submit_unlock(on_b)
    again = [key(900 + i) for i in range(3)]
    assert store(a, again, [obj(b"n" * 100) for _ in again]).is_successful()
    devs = {d["device_path"]: d for d in a.reconfigure_status()["status"]["devices"]}
    assert devs[a_path]["state"] == "failed" and devs[b_path]["live_slot_count"] == 7
    # Re-adding it while failed is refused by its size (the file is empty)
    # and, once its file is whole again, as failed (remove it first); remove
    # evicts it (nothing more to tell: its keys were reported once).
    code, body = _call(a, "add", {"device_path": a_path, "size_bytes": SLOTS * SLOT})
    assert code == 400 and "file size 0" in body["error"], body
    os.truncate(a_path, SLOTS * SLOT)
    code, body = _call(a, "add", {"device_path": a_path, "size_bytes": SLOTS * SLOT})
    assert code == 409, body
    told = len(ev.deleted)
    code, body = _call(a, "remove", {"device_path": a_path, "mode": "evict"})
    assert code == 200 and body["state"] == "removed", body
    a.pop_completed_store_tasks()
    assert len(ev.deleted) == told
    st = a.report_status()
    assert st["is_healthy"] and not st["degraded"], st
