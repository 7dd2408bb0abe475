#!/usr/bin/env python3
"""LMCache's built-in ``dax`` L2 adapter against daxkv through LMCache's two
MP plugin paths, with one workload, in one run.

Every adapter is built by LMCache's own factory from the ``--l2-adapter``
JSON a user writes (``dax``; ``native_plugin`` with ``daxkv.DaxConnector``;
``plugin`` with ``daxkv.lmcache.DaxL2Adapter``) and driven through LMCache's
``L2AdapterInterface`` as its controllers drive it: tasks of ``--task``
keys, ``--in-flight`` tasks outstanding, completions found by polling the
adapter's event fds and querying. Per size (one fresh adapter per path and
size, ``slot_bytes`` = the size, the device a prefaulted /dev/shm file):

- store: every object stored;
- lookup: every key looked up and locked (then unlocked, untimed);
- load: every key loaded into preallocated LMCache memory objects, the
  bytes compared with the sources afterwards (untimed; a mismatch aborts).

So that a task reported complete before its copy is done cannot win, the
harness writes into each task's memory the moment the task is reported
complete (inside the timed phase, the same for every path): one byte per
4 KiB page of a store's sources and of a load's destinations is inverted.
A store copy still reading its sources then stores inverted bytes, and a
load copy still writing its destinations overwrites the inversion; either
way the untimed comparison after the load (sources against destinations,
both inverted at the same places) fails. Every path's objects are views
into one buffer (as LMCache's L1 allocator hands them out), so the
inversion is one strided operation per task.

``--paths noop`` (not in the default list) runs the same harness against
an adapter that copies nothing and completes every task at once: the
harness's own ceiling (its submit, poll and collect cost in Python).
``--paths noop_native`` drives a connector that copies nothing and
completes every future at once (a few lines of Python, ``NoopConnector``)
through LMCache's own ``NativeConnectorL2Adapter``, the bridge the
``native_plugin`` path goes through: that path's ceiling (the bridge's
per-key Python, its demux thread and its eventfds).

Rounds are interleaved (round 1 of every path, then round 2, ...), and the
median round is reported with the range of the rounds: objects/s, GB/s,
and daxkv's ratio to ``dax`` (the ratio of the medians; its range is that
of the per-round ratios). The same worker counts for every path
(``--store-workers``, ``--lookup-workers``, ``--load-workers``).

The workload (task size, in-flight count, polling, marks, comparison) is
fixed so figures stay comparable across runs and commits: change it only
with every published table rerun.

    python python/bench/bench_l2.py                   # 4K..8M, 3 rounds
    python python/bench/bench_l2.py --sizes 4K,2M --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import platform
import select
import statistics
import sys
import time
import uuid
import warnings
from typing import Any, Callable

# Quiet imports: LMCache's INFO lines and its dependencies' FutureWarnings.
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.internal_api import L2StoreResult  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
try:  # LMCache 0.5.x
    from lmcache.lmcache_native import Bitmap  # noqa: E402
except ImportError:  # later layouts
    from lmcache.native_storage_ops import Bitmap  # type: ignore[no-redef]  # noqa: E402
from lmcache.v1.memory_management import (  # noqa: E402
    MemoryFormat,
    MemoryObjMetadata,
    TensorMemoryObj,
)

PATHS = ("dax", "native_plugin", "plugin")
EXTRA_PATHS = ("noop", "noop_native")
#: Paths that copy nothing: no device file, no byte check, no ratio to dax.
CEILINGS = ("noop", "noop_native")
# The stride of the completion marks (module doc): one byte per page.
MARK_STRIDE = 4096
PHASES = ("store", "lookup", "load")
#: (path, its ceiling): the share of its harness ceiling a path reaches.
CEILING_OF = (("plugin", "noop"), ("native_plugin", "noop_native"))


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s.rstrip("KMG")) * mult


def human(n: int) -> str:
    for unit, m in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def spec(path_kind: str, dev: str, slot: int, cap: int, workers: dict[str, int]) -> dict:
    gb = cap / 2**30
    engine = {
        "slot_bytes": slot,
        "device_path": dev,
        "max_dax_size_gb": gb,
        **{f"num_{k}_workers": v for k, v in workers.items()},
    }
    if path_kind == "dax":
        return {"type": "dax", **engine}
    if path_kind == "native_plugin":
        return {
            "type": "native_plugin",
            "module_path": "daxkv",
            "class_name": "DaxConnector",
            "adapter_params": engine,
            "max_capacity_gb": gb,
        }
    return {
        "type": "plugin",
        "module_path": "daxkv.lmcache",
        "class_name": "DaxL2Adapter",
        "adapter_params": engine,
    }


class NoopAdapter:
    """The harness's ceiling: the adapter calls the harness makes, each
    completing at once with every key found and nothing copied."""

    def __init__(self) -> None:
        self._fds = {k: os.eventfd(0, os.EFD_NONBLOCK) for k in PHASES}
        self._next = 0
        self._stores: dict[int, Any] = {}
        self._results: dict[int, Any] = {}

    def _task(self, kind: str, n: int) -> int:
        self._next += 1
        if kind == "store":
            self._stores[self._next] = L2StoreResult(True, 0)
        else:
            bm = Bitmap(n)
            bm.batched_set(list(range(n)))
            self._results[self._next] = bm
        os.eventfd_write(self._fds[kind], 1)
        return self._next

    def get_store_event_fd(self) -> int:
        return self._fds["store"]

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._fds["lookup"]

    def get_load_event_fd(self) -> int:
        return self._fds["load"]

    def submit_store_task(self, keys: list, objects: list) -> int:
        return self._task("store", len(keys))

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        out, self._stores = self._stores, {}
        return out

    def submit_lookup_and_lock_task(self, keys: list, *layout: Any) -> int:
        return self._task("lookup", len(keys))

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        return self._results.pop(task_id, None)

    def submit_unlock(self, keys: list) -> None:
        pass

    def submit_load_task(self, keys: list, objects: list) -> int:
        return self._task("load", len(keys))

    def query_load_result(self, task_id: int) -> Any:
        return self._results.pop(task_id, None)

    def delete(self, keys: list) -> None:
        pass

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)


class NoopConnector:
    """A native connector (the contract of LMCache's
    ``NativeConnectorL2Adapter``) that copies nothing: every future
    completes at once, every key found and loaded. Submits come from the
    harness, ``drain_completions`` from the bridge's demux thread: the
    queue is a deque (atomic appends and pops) and the fd is reset before
    it is drained, so a completion queued meanwhile signals it again."""

    def __init__(self) -> None:
        self._fd = os.eventfd(0, os.EFD_NONBLOCK)
        self._next = 0
        self._done: collections.deque = collections.deque()

    def event_fd(self) -> int:
        return self._fd

    def _complete(self, n: int, per_key: bool) -> int:
        self._next += 1
        self._done.append((self._next, True, "", [True] * n if per_key else None))
        os.eventfd_write(self._fd, 1)
        return self._next

    def submit_batch_set(self, keys: list, bufs: list) -> int:
        return self._complete(len(keys), False)

    def submit_batch_get(self, keys: list, bufs: list) -> int:
        return self._complete(len(keys), True)

    def submit_batch_exists(self, keys: list) -> int:
        return self._complete(len(keys), True)

    def submit_batch_delete(self, keys: list) -> int:
        return self._complete(len(keys), True)

    def drain_completions(self) -> list:
        reset(self._fd)
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def close(self) -> None:
        os.close(self._fd)


def build(path_kind: str, dev: str, slot: int, cap: int, workers: dict[str, int]) -> Any:
    if path_kind == "noop":
        return NoopAdapter()
    if path_kind == "noop_native":
        # The class LMCache's native_plugin factory wraps every connector in.
        from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
            NativeConnectorL2Adapter,
        )

        return NativeConnectorL2Adapter(NoopConnector(), max_capacity_gb=cap / 2**30)
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    args = parser.parse_args(["--l2-adapter", json.dumps(spec(path_kind, dev, slot, cap, workers))])
    return create_l2_adapter(parse_args_to_l2_adapters_config(args).adapters[0])


def memory_obj(t: torch.Tensor) -> TensorMemoryObj:
    n = t.numel()
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


def key(i: int, run: int) -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(8, "big"), model_name=f"bench{run}", kv_rank=0)


def reset(fd: int) -> None:
    try:
        os.read(fd, 8)
    except BlockingIOError:
        pass


def pipeline(
    n_tasks: int,
    submit: Callable[[int], int],
    fd: int,
    finished: Callable[[set[int]], dict[int, Any]],
    in_flight: int,
    on_done: Callable[[int], None],
) -> dict[int, Any]:
    """Submit tasks 0..n_tasks with `in_flight` outstanding; wait on `fd`
    as LMCache's controllers do (poll, read the counter, then collect);
    `on_done(task index)` as soon as a task's result is collected.
    Returns {task index: result}."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    pending: dict[int, int] = {}
    results: dict[int, Any] = {}
    nxt = 0
    deadline = time.monotonic() + 300
    while nxt < n_tasks or pending:
        while nxt < n_tasks and len(pending) < in_flight:
            pending[submit(nxt)] = nxt
            nxt += 1
        got = finished(set(pending))
        if not got:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(pending)} tasks never completed")
            if poller.poll(100):
                reset(fd)
            continue
        for tid, r in got.items():
            i = pending.pop(tid)
            results[i] = r
            on_done(i)
    return results


def bits(bm: Any, n: int) -> int:
    return sum(1 for i in range(n) if bm.test(i))


def one_round(a: Any, n: int, size: int, task: int, in_flight: int, run: int,
              srcs: list[TensorMemoryObj], dsts: list[TensorMemoryObj],
              src_buf: torch.Tensor, dst_buf: torch.Tensor, verify: bool) -> dict[str, float]:
    keys = [key(i, run) for i in range(n)]
    n_tasks = (n + task - 1) // task
    span = [(t * task, min(n, (t + 1) * task)) for t in range(n_tasks)]
    out: dict[str, float] = {}
    stride = min(MARK_STRIDE, size)

    def marker(buf: torch.Tensor) -> Callable[[int], None]:
        # The module doc's completion mark: one byte per page inverted.
        def mark(t: int) -> None:
            buf[span[t][0] * size:span[t][1] * size:stride].bitwise_not_()
        return mark

    stored: dict[int, Any] = {}

    def store_done(ids: set[int]) -> dict[int, Any]:
        stored.update(a.pop_completed_store_tasks())
        return {t: stored.pop(t) for t in list(ids) if t in stored}

    # What the stores must keep: the sources as they are now (compared
    # after the load, when both sides carry the marks).
    t0 = time.perf_counter()
    res = pipeline(n_tasks, lambda t: a.submit_store_task(keys[span[t][0]:span[t][1]], srcs[span[t][0]:span[t][1]]),
                   a.get_store_event_fd(), store_done, in_flight, marker(src_buf))
    out["store"] = time.perf_counter() - t0
    # An L2StoreResult is an int: -1 for a failure (truthy), else the bytes.
    if any(not (r.is_successful() if hasattr(r, "is_successful") else bool(r)) for r in res.values()):
        raise RuntimeError(f"a store task failed at {human(size)}: {res}")

    def query(fn: Callable[[int], Any]) -> Callable[[set[int]], dict[int, Any]]:
        def done(ids: set[int]) -> dict[int, Any]:
            got = {}
            for t in ids:
                r = fn(t)
                if r is not None:
                    got[t] = r
            return got
        return done

    t0 = time.perf_counter()
    res = pipeline(n_tasks, lambda t: a.submit_lookup_and_lock_task(keys[span[t][0]:span[t][1]], {}),
                   a.get_lookup_and_lock_event_fd(), query(a.query_lookup_and_lock_result), in_flight,
                   lambda t: None)
    out["lookup"] = time.perf_counter() - t0
    hits = sum(bits(res[t], span[t][1] - span[t][0]) for t in range(n_tasks))
    if hits != n:
        raise RuntimeError(f"lookup found {hits} of {n} keys at {human(size)}")
    a.submit_unlock(keys)

    dst_buf.zero_()
    t0 = time.perf_counter()
    res = pipeline(n_tasks, lambda t: a.submit_load_task(keys[span[t][0]:span[t][1]], dsts[span[t][0]:span[t][1]]),
                   a.get_load_event_fd(), query(a.query_load_result), in_flight, marker(dst_buf))
    out["load"] = time.perf_counter() - t0
    hits = sum(bits(res[t], span[t][1] - span[t][0]) for t in range(n_tasks))
    if hits != n:
        raise RuntimeError(f"load found {hits} of {n} keys at {human(size)}")
    # Sources marked once after their store, destinations once after their
    # load: equal exactly when every byte stored was the source's before
    # its mark and every byte loaded landed before the destination's mark.
    if verify and not torch.equal(src_buf, dst_buf):
        bad = next(i for i in range(n) if not torch.equal(srcs[i].tensor, dsts[i].tensor))
        raise RuntimeError(f"object {bad} loaded with wrong bytes at {human(size)}")
    a.delete(keys)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4K,64K,256K,2M,8M")
    ap.add_argument("--paths", default=",".join(PATHS), help="of " + ", ".join(PATHS + EXTRA_PATHS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--task", type=int, default=16, help="keys per task")
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--total-bytes", default="256M", help="bytes per round and size (capped by --max-objects)")
    ap.add_argument("--max-objects", type=int, default=4096)
    ap.add_argument("--store-workers", type=int, default=1)
    ap.add_argument("--lookup-workers", type=int, default=1)
    ap.add_argument("--load-workers", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    paths = [p for p in args.paths.split(",") if p]
    for p in paths:
        if p not in PATHS + EXTRA_PATHS:
            ap.error(f"--paths: unknown path {p!r} (known: {', '.join(PATHS + EXTRA_PATHS)})")
    if "plugin" in paths:
        try:
            import daxkv.lmcache

            daxkv.lmcache.DaxL2Adapter  # noqa: B018 (import check)
        except (ImportError, AttributeError) as e:
            print(f"note: the plugin path is skipped ({e})", file=sys.stderr)
            paths.remove("plugin")
    workers = {"store": args.store_workers, "lookup": args.lookup_workers, "load": args.load_workers}
    total = parse_size(args.total_bytes)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), platform.processor())
    print(f"CPU: {cpu}, {os.cpu_count()} CPUs; tasks of {args.task} keys, {args.in_flight} in flight; "
          f"workers store {args.store_workers} / lookup {args.lookup_workers} / load {args.load_workers}; "
          f"median of {args.rounds} interleaved rounds")

    rows = []
    for size in sizes:
        n = max(args.task, min(args.max_objects, total // size))
        cap = n * size + (64 << 20)
        # One buffer per side, the objects views into it (as LMCache's
        # L1 allocator hands them out), so a task's mark is one operation.
        src_buf = torch.randint(0, 256, (n * size,), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(size))
        dst_buf = torch.empty(n * size, dtype=torch.uint8)
        srcs = [memory_obj(src_buf[i * size:(i + 1) * size]) for i in range(n)]
        dsts = [memory_obj(dst_buf[i * size:(i + 1) * size]) for i in range(n)]
        adapters = {}
        files = []
        for p in paths:
            if p in CEILINGS:
                adapters[p] = build(p, "", size, cap, workers)
                continue
            dev = f"/dev/shm/daxkv-bench-{uuid.uuid4().hex}"
            with open(dev, "wb") as f:  # prefaulted: the first touch of tmpfs is slow
                chunk = b"\0" * (8 << 20)
                for _ in range(0, cap, len(chunk)):
                    f.write(chunk)
                f.truncate(cap)
            files.append(dev)
            adapters[p] = build(p, dev, size, cap, workers)
        times: dict[str, dict[str, list[float]]] = {p: {ph: [] for ph in PHASES} for p in paths}
        try:
            for r in range(args.rounds):
                for p in paths:
                    gc.collect()
                    t = one_round(adapters[p], n, size, args.task, args.in_flight, r, srcs, dsts,
                                  src_buf, dst_buf, verify=p not in CEILINGS)
                    for ph in PHASES:
                        times[p][ph].append(t[ph])
        finally:
            for a in adapters.values():
                a.close()
            for f in files:
                os.unlink(f)
        for p in paths:
            for ph in PHASES:
                med = statistics.median(times[p][ph])
                rows.append({
                    "size": size, "path": p, "phase": ph, "objects": n,
                    "objects_per_s": n / med,
                    "gb_per_s": (n * size / med / 1e9) if ph != "lookup" else None,
                    "seconds": times[p][ph],
                })
        del srcs, dsts, src_buf, dst_buf

    def row(size: int, p: str, ph: str) -> dict:
        return next(x for x in rows if x["size"] == size and x["path"] == p and x["phase"] == ph)

    print()
    print("objects/s: median [min-max] of the rounds; ratio: of the medians [min-max of the per-round ratios]")
    print(f"{'size':>8} {'phase':>6} " + " ".join(f"{p + ' obj/s':>30} {'GB/s':>6}" for p in paths)
          + "".join(f" {p + ' / dax':>22}" for p in paths if p not in ("dax",) + CEILINGS and "dax" in paths)
          + "".join(f" {p + ' / ' + c:>28}" for p, c in CEILING_OF if p in paths and c in paths))
    for size in sizes:
        for ph in PHASES:
            cells = []
            ratios = []
            for p in paths:
                r = row(size, p, ph)
                lo, hi = (r["objects"] / max(r["seconds"]), r["objects"] / min(r["seconds"]))
                gbs = f"{r['gb_per_s']:6.2f}" if r["gb_per_s"] is not None else f"{'-':>6}"
                rng = f"{r['objects_per_s']:,.0f} [{lo:,.0f}-{hi:,.0f}]"
                cells.append(f"{rng:>30} {gbs}")
                if p not in ("dax",) + CEILINGS and "dax" in paths:
                    b = row(size, "dax", ph)
                    per = [bs / s_ for s_, bs in zip(r["seconds"], b["seconds"])]
                    rt = f"{r['objects_per_s'] / b['objects_per_s']:.2f}x [{min(per):.2f}-{max(per):.2f}]"
                    ratios.append(f"{rt:>22}")
            for p, c in CEILING_OF:
                if p in paths and c in paths:
                    r, b = row(size, p, ph), row(size, c, ph)
                    per = [bs / s_ for s_, bs in zip(r["seconds"], b["seconds"])]
                    rt = f"{r['objects_per_s'] / b['objects_per_s']:.2f}x [{min(per):.2f}-{max(per):.2f}]"
                    ratios.append(f"{rt:>28}")
            print(f"{human(size):>8} {ph:>6} " + " ".join(cells) + " " + " ".join(ratios))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
