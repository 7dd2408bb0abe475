"""A short soak through LMCache's ``plugin`` path (``daxkv.lmcache.DaxL2Adapter``
built by LMCache's factory), driven as LMCache's controllers drive it, while
a control thread adds, drains, migrates, evicts, resizes and force-removes
devices through the adapter's reconfigure API (LMCache's hotplug entry).

- a store controller thread stores tasks of 1-8 new keys, each payload
  stamped with its key number and filled from a generator seeded by it;
- a prefetch controller thread looks up and locks, loads into fresh memory
  objects, checks every byte, and unlocks;
- an eviction thread deletes keys when the pool is more than half full;
- a listener records the keys the adapter reports deleted.

An acknowledged key (its store task succeeded) that a lookup misses and no
listener reported gone is looked at again once hotplug has stopped: still
missing, it is lost. Any load with bytes other than the key's own is
corrupted. At the end every key is deleted and the adapter must hold no
slot, lock or task. The Rust ``daxkv soak`` is the long form of this run.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

pytest.importorskip("lmcache")
torch = pytest.importorskip("torch")

from lmcache.v1.distributed.l2_adapters.reconfiguration import L2ReconfigureError  # noqa: E402

from conftest import SLOT  # noqa: E402
from test_l2_adapter import drain_stores, lookup, load, made  # noqa: E402, F401
from test_lmcache import key, obj  # noqa: E402

SLOTS = 64
SECONDS = 8.0


def payload(n: int) -> bytes:
    """Key ``n``'s bytes: its number and length, then a stream seeded by it."""
    length = 64 + (n * 7919) % (SLOT - 64)
    head = n.to_bytes(8, "little") + length.to_bytes(8, "little")
    return head + random.Random(n).randbytes(length - len(head))


class Gone:
    """An L2 listener: the keys the adapter reported deleted."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: set = set()
        self.stored: set = set()
        self.count = 0

    def on_l2_keys_stored(self, keys, sizes) -> None:
        with self.lock:
            self.stored.update(keys)

    def on_l2_keys_accessed(self, keys) -> None:
        pass

    def on_l2_keys_deleted(self, keys) -> None:
        with self.lock:
            self.keys.update(keys)
            self.count += len(keys)


def test_plugin_soak_under_reconfigure(made) -> None:
    a = made.adapter({
        "type": "plugin", "module_path": "daxkv.lmcache", "class_name": "DaxL2Adapter",
        "adapter_params": {"slot_bytes": SLOT, "device_path": "memfd",
                           "max_dax_size_gb": SLOTS * SLOT / 2**30,
                           "num_load_workers": 2, "hotplug_enabled": True},
    })
    gone = Gone()
    a.register_listener(gone)
    stop = threading.Event()
    errors: list[str] = []
    lock = threading.Lock()
    acked: dict[int, bool] = {}  # number -> acknowledged (False: its task failed)
    suspects: set[int] = set()
    stats = {"stores": 0, "loads": 0, "verified": 0, "corrupted": 0, "hotplug_ok": 0,
             "hotplug_refused": 0, "deletes": 0}

    def guard(fn):
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001
                errors.append(f"{fn.__name__}: {e!r}")
                stop.set()
        return run

    submitted = [0]  # keys numbered below it were submitted (stored or not)
    # Evicting hotplug operations begun / ended, and the keys whose store
    # one overlapped (submit to collection): an evict may delete such a key
    # before its store is collected; the adapter then never tells it
    # stored (the engine no longer holds it), so never deleted either.
    evicting = [0, 0]
    raced: set[int] = set()

    @guard
    def storer() -> None:
        n = 0
        rng = random.Random(1)
        while not stop.is_set():
            batch = list(range(n, n + rng.randint(1, 8)))
            n = batch[-1] + 1
            submitted[0] = n
            began, ended = evicting
            r = drain_stores(a, {a.submit_store_task([key(i) for i in batch],
                                                     [obj(payload(i)) for i in batch])})
            ok = next(iter(r.values())).is_successful()
            with lock:
                if began != ended or evicting[0] != began:
                    raced.update(batch)
                for i in batch:
                    acked[i] = ok
            stats["stores"] += 1

    @guard
    def prefetcher() -> None:
        rng = random.Random(2)
        while not stop.is_set():
            with lock:
                pool = list(acked)
            if not pool:
                time.sleep(0.01)
                continue
            nums = sorted(set(rng.choice(pool) for _ in range(rng.randint(1, 8))))
            keys = [key(i) for i in nums]
            hit = lookup(a, keys)
            hits = [i for i, h in zip(nums, hit) if h]
            dsts = [obj(SLOT) for _ in hits]
            got = load(a, [key(i) for i in hits], dsts) if hits else []
            a.submit_unlock([key(i) for i in hits])
            stats["loads"] += 1
            loaded = dict(zip(hits, zip(got, dsts)))
            for i, h in zip(nums, hit):
                ok, dst = loaded.get(i, (False, None))
                if ok:
                    want = payload(i)
                    if bytes(dst.tensor[: len(want)].numpy()) != want:
                        stats["corrupted"] += 1
                        errors.append(f"key {i}: loaded bytes are not its own")
                    else:
                        stats["verified"] += len(want)
                    continue
                with lock, gone.lock:
                    if acked.get(i) and key(i) not in gone.keys:
                        suspects.add(i)

    @guard
    def evictor() -> None:
        rng = random.Random(3)
        while not stop.is_set():
            u = a.get_usage()
            if u.total_capacity_bytes and u.total_bytes_used * 2 > u.total_capacity_bytes:
                with lock:
                    victims = rng.sample(sorted(set(acked) - suspects),
                                         min(16, len(set(acked) - suspects)))
                    for i in victims:
                        del acked[i]
                a.delete([key(i) for i in victims])
                stats["deletes"] += 1
            time.sleep(0.005)

    @guard
    def operator() -> None:
        rng = random.Random(4)
        added = 0
        while not stop.is_set():
            time.sleep(rng.uniform(0.03, 0.1))
            devs = [d for d in a.reconfigure_status()["status"]["devices"]
                    if d["state"] in ("active", "draining")]
            active = [d for d in devs if d["state"] == "active"]
            choice = rng.random()
            try:
                if len(devs) < 2 or (choice < 0.25 and len(devs) < 5):
                    added += 1
                    a.reconfigure("add", {"device_path": f"memfd:soak{added}",
                                          "size_bytes": rng.randint(16, 64) * SLOT})
                elif choice < 0.4 and active:
                    d = rng.choice(active)
                    a.reconfigure("remove", {"device_index": d["index"], "mode": "drain"})
                elif choice < 0.7:
                    d = max(devs, key=lambda d: d["live_slot_count"]) if rng.random() < 0.5 \
                        else rng.choice(devs)
                    mode = rng.choice(["migrate", "evict"])
                    evicting[0] += mode == "evict"
                    try:
                        a.reconfigure("remove", {"device_index": d["index"], "mode": mode,
                                                 "force": rng.random() < 0.5})
                    finally:
                        evicting[1] += mode == "evict"
                elif active:
                    d = rng.choice(active)
                    slots = d["max_slots"] if rng.random() < 0.5 else max(1, d["max_slots"] // 3)
                    mode = rng.choice(["migrate", "evict"])
                    evicting[0] += mode == "evict"
                    try:
                        a.reconfigure("resize", {"device_index": d["index"],
                                                 "size_bytes": slots * SLOT, "mode": mode,
                                                 "force": rng.random() < 0.5})
                    finally:
                        evicting[1] += mode == "evict"
                else:
                    continue
                stats["hotplug_ok"] += 1
            except L2ReconfigureError as e:
                if e.status_code not in (400, 404, 409, 507):
                    raise
                stats["hotplug_refused"] += 1

    threads = [threading.Thread(target=f) for f in (storer, prefetcher, evictor, operator)]
    for t in threads:
        t.start()
    stop.wait(SECONDS)
    stop.set()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a soak thread did not stop"
    assert not errors, errors[:5]

    # Hotplug has stopped: every suspect is found with its bytes or was
    # reported gone; everything acknowledged and not gone still loads.
    lost = []
    with gone.lock:
        check = [i for i, ok in acked.items() if ok and key(i) not in gone.keys]
    for start in range(0, len(check), 16):
        nums = check[start:start + 16]
        hit = lookup(a, [key(i) for i in nums])
        hits = [i for i, h in zip(nums, hit) if h]
        dsts = [obj(SLOT) for _ in hits]
        got = load(a, [key(i) for i in hits], dsts) if hits else []
        a.submit_unlock([key(i) for i in hits])
        for i, ok, dst in zip(hits, got, dsts):
            want = payload(i)
            assert ok and bytes(dst.tensor[: len(want)].numpy()) == want, f"key {i} corrupted"
        with gone.lock:
            lost += [i for i, h in zip(nums, hit) if not h and key(i) not in gone.keys]
    # Evicted before their store was collected (see `raced`): never told
    # stored nor deleted, which keeps LMCache's books; not lost.
    lost = [i for i in lost if key(i) in gone.stored or i not in raced]
    told = [i for i in lost if key(i) in gone.stored]
    assert not lost, (f"{len(lost)} acknowledged keys lost (first {lost[:5]}); suspects "
                      f"{len(suspects)}; reported stored: {told[:5]}")
    assert stats["stores"] > 10 and stats["loads"] > 10 and stats["verified"] > 0, stats
    assert stats["hotplug_ok"] > 0, stats
    print(f"plugin soak: {stats} acknowledged={sum(acked.values())} reported_gone={gone.count}")

    # One slot per key: every slot in use holds a key a lookup finds (a
    # key held twice, on two devices, or a slot no key names, would show
    # here). Counted over every key ever submitted: the evictor forgets
    # its victims, and a victim locked by a lookup at that moment is
    # skipped by the delete (as LMCache's eviction expects), so it stays.
    everything = [key(i) for i in range(submitted[0])]
    present = 0
    for start in range(0, len(everything), 64):
        part = everything[start:start + 64]
        hit = lookup(a, part)
        a.submit_unlock([k for k, h in zip(part, hit) if h])
        present += sum(hit)
    st = a.report_status()
    assert st["live_slot_count"] == present, (st["live_slot_count"], present)

    # Nothing held: delete every key, then no slot, lock or task is left.
    a.delete(everything)
    st = a.report_status()
    for field in ("live_slot_count", "borrowed_slot_count", "locked_key_count"):
        assert st[field] == 0, (field, st[field])
    assert a.pending_tasks() == 0
    assert a.get_usage().total_bytes_used == 0


def test_a_key_evicted_before_its_store_is_collected_is_told_neither_way(made) -> None:
    """The interleaving the soak's `raced` set allows: a store completes in
    the engine, an evicting remove deletes its key before LMCache pops the
    result; the task still reports success, and the listener is told
    neither "stored" nor "deleted" (the engine no longer holds it), so
    LMCache's books never count it."""
    a = made.adapter({
        "type": "plugin", "module_path": "daxkv.lmcache", "class_name": "DaxL2Adapter",
        "adapter_params": {"slot_bytes": SLOT, "device_path": "memfd",
                           "max_dax_size_gb": 8 * SLOT / 2**30, "hotplug_enabled": True},
    })
    gone = Gone()
    a.register_listener(gone)
    tid = a.submit_store_task([key(1)], [obj(payload(1))])
    deadline = time.monotonic() + 30
    while a.report_status()["live_slot_count"] == 0:  # committed, not popped
        assert time.monotonic() < deadline
        time.sleep(0.001)
    a.reconfigure("add", {"device_path": "memfd:other", "size_bytes": 8 * SLOT})
    a.reconfigure("remove", {"device_index": 0, "mode": "evict", "force": True})
    r = drain_stores(a, {tid})[tid]
    assert r.is_successful()
    assert lookup(a, [key(1)]) == [False]
    assert key(1) not in gone.stored and key(1) not in gone.keys
