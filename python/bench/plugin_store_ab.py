#!/usr/bin/env python3
"""In-process A/B of the `plugin` path's 4 KiB store phase.

`bench_l2.py`'s store phase (tasks of 16 keys, 8 in flight, the same
poll loop, each source marked once its store is collected), run for two
or more variants of the adapter in one process, rounds alternated (the
order reversed every other round), so each round's ratio compares runs a
few milliseconds apart. On a shared 2-vCPU VM the store rate moves by
±40 % between processes (docs/performance.md, "A third look"); within
one process the per-round ratios stay within a few percent.

Variants:

- ``--other SITE``: the package built elsewhere (a `pip install --target`
  folder, e.g. a copy of `target/python/site` kept from an earlier
  build) against the one on `sys.path`: a before / after of a change.
  The other build is imported as a renamed package (`daxkv_other`; an
  extension module's init function is named after the last part of its
  module name, so both load side by side).
- ``--ablate spans,notify,pop,marks``: one piece of the calling thread's
  work made free, each against the unchanged adapter: ``spans`` the
  objects' reads (`_spans`, precomputed once per task), ``notify``
  LMCache's `_notify_keys_stored` (a no-op: its byte counters go wrong
  and LMCache warns when the round's keys are deleted), ``pop`` the
  adapter's collection glue (the core's collection and ticket report
  only, no listener told), ``marks`` the harness's completion marks. An
  upper bound on what cutting that piece could save, not a safe
  configuration.

    PYTHONPATH=target/python/site python python/bench/plugin_store_ab.py --other /tmp/site-old
    PYTHONPATH=target/python/site python python/bench/plugin_store_ab.py --ablate spans,notify
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_l2 as B  # noqa: E402
import torch  # noqa: E402

SIZE, N, TASK, IN_FLIGHT = 4096, 4096, 16, 8


def import_other(site: str, into: str) -> Any:
    """The adapter class of the build in `site`, imported as `daxkv_other`."""
    pkg = os.path.join(into, "daxkv_other")
    shutil.copytree(os.path.join(site, "daxkv"), pkg)
    for root, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(root, f)
                with open(p) as fh:
                    s = fh.read()
                s = (s.replace("from daxkv.", "from daxkv_other.")
                      .replace("from daxkv ", "from daxkv_other ")
                      .replace("import daxkv\n", "import daxkv_other\n")
                      .replace('"daxkv.lmcache', '"daxkv_other.lmcache'))
                with open(p, "w") as fh:
                    fh.write(s)
    sys.path.insert(0, into)
    from daxkv_other.lmcache._l2_adapter import DaxL2Adapter as Other  # type: ignore[import-not-found]

    ext = sys.modules["daxkv_other._daxkv"].__file__
    if not ext or not ext.startswith(pkg) or sys.modules["daxkv._daxkv"].__file__ == ext:
        raise SystemExit(f"the other build did not load from its own copy ({ext})")
    print(f"other build: {site} (its extension loaded from {ext})")
    return Other


def make(cls: Any) -> Any:
    cap = N * SIZE + (64 << 20)
    dev = f"/dev/shm/daxkv-store-ab-{uuid.uuid4().hex}"
    with open(dev, "wb") as f:
        f.write(b"\0" * cap)
    try:
        return cls(B.spec("plugin", dev, SIZE, cap, {"store": 1, "lookup": 1, "load": 2})["adapter_params"])
    finally:
        os.unlink(dev)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", help="a pip --target folder holding the other build")
    ap.add_argument("--ablate", default="", help="of spans, notify, pop, marks")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    import daxkv._daxkv  # noqa: F401 (this build's extension, named in the check above)
    from daxkv.lmcache import _l2_adapter as A

    src = torch.randint(0, 256, (N * SIZE,), dtype=torch.uint8)
    srcs = [B.memory_obj(src[i * SIZE:(i + 1) * SIZE]) for i in range(N)]
    span = [(t * TASK, (t + 1) * TASK) for t in range(N // TASK)]
    chunks = [srcs[a:b] for a, b in span]

    def mark(t: int) -> None:
        src[span[t][0] * SIZE:span[t][1] * SIZE:4096].bitwise_not_()

    # name -> (adapter, submit(keys, objs), on_done)
    variants: dict[str, tuple[Any, Callable, Callable]] = {}
    base = make(A.DaxL2Adapter)
    variants["this build"] = (base, base.submit_store_task, mark)
    tmp = tempfile.mkdtemp(prefix="daxkv-store-ab-")
    try:
        if args.other:
            o = make(import_other(args.other, tmp))
            variants["other build"] = (o, o.submit_store_task, mark)
        for v in filter(None, args.ablate.split(",")):
            a = make(A.DaxL2Adapter)
            sub, on_done = a.submit_store_task, mark
            core = a._core
            if v == "spans":
                pre = {id(c): A._spans(c) for c in chunks}
                sub = (lambda core, pre: lambda keys, objs: core.submit_store(keys, objs, pre[id(objs)]))(core, pre)
            elif v == "notify":
                a._notify_keys_stored = lambda keys, sizes: None
            elif v == "pop":
                def pop(core: Any = core) -> dict:
                    ticket, done, _keys, _sizes, _deleted = core.pop_completed_stores()
                    if ticket:
                        core.stored_reported(ticket)
                    return {tid: nbytes for tid, _ok, nbytes in done}
                a.pop_completed_store_tasks = pop
            elif v == "marks":
                on_done = lambda t: None  # noqa: E731
            else:
                ap.error(f"--ablate: unknown piece {v!r}")
            variants[f"{v} free"] = (a, sub, on_done)
        if len(variants) < 2:
            ap.error("nothing to compare: give --other or --ablate")

        def store_round(a: Any, sub: Callable, on_done: Callable, run: int) -> float:
            keys = [B.key(i, run) for i in range(N)]
            stored: dict = {}

            def done(ids: set[int]) -> dict:
                stored.update(a.pop_completed_store_tasks())
                return {t: stored.pop(t) for t in list(ids) if t in stored}

            t0 = time.perf_counter()
            B.pipeline(len(span), lambda t: sub(keys[span[t][0]:span[t][1]], chunks[t]),
                       a.get_store_event_fd(), done, IN_FLIGHT, on_done)
            dt = time.perf_counter() - t0
            a.delete(keys)
            return dt / len(span) * 1e6

        us: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for r in range(args.rounds):
            for k in names if r % 2 == 0 else names[::-1]:
                us[k].append(store_round(*variants[k], r))
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        print(f"CPU: {cpu}, {os.cpu_count()} CPUs; 4 KiB stores, tasks of {TASK}, {IN_FLIGHT} in flight; "
              f"{args.rounds} alternating rounds; µs a task: median [min-max]; ratio: median of the per-round ratios")
        ref = us["this build"]
        for k, v in us.items():
            ratios = [b / a for a, b in zip(ref, v)]
            print(f"  {k:12s} {statistics.median(v):7.2f} [{min(v):.2f}-{max(v):.2f}]  "
                  f"{16 / statistics.median(v) * 1e6:11,.0f} obj/s  "
                  f"time / this build {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
    finally:
        for a, _, _ in variants.values():
            a.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
