"""daxkv.lmcache.DaxBackend against LMCache's built-in non-MP DaxBackend.

Both backends are built by LMCache's own ``storage_plugin_launcher`` in one
process, over one real ``LocalCPUBackend`` (its ``MixedMemoryAllocator``),
each on its own /dev/shm file standing in for a DAX device, each with its
default restore settings. Per object size (default 256 KiB and 2 MiB, one
full LMCache chunk each, so the slot size):

- ``put``: ``batched_submit_put_task`` of N objects (synchronous puts) into
  an emptied arena (the keys are removed, untimed, before each round);
- ``restore``: ``batched_get_blocking`` of the N keys: outputs allocated
  from the local CPU backend, filled from the device.

Rounds alternate between the backends (and which goes first), after one
untimed warm-up round each (page faults of the device file and of the CPU
buffers), with the garbage collector run before and off during each timed
call. Every restored object is compared with its source and every
stored key checked after each round. Prints objects/s and GB/s (medians
over the rounds), the daxkv / LMCache ratio of each pair of rounds run back
to back (median, min–max: the machine may be shared), and what a plain
copy of the same objects (torch ``copy_``) reaches, the ceiling of a put.

Run (LMCache's venv, daxkv installed or on PYTHONPATH)::

    python python/bench/bench_backend.py [--objects 256] [--sizes 256K,2M] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import logging
import os
import platform
import statistics
import subprocess
import time
import uuid

import torch

logging.disable(logging.WARNING)

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend import storage_plugin_launcher  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402

BACKENDS = {
    "daxkv": ("daxkv.lmcache", "DaxBackend"),
    "lmcache": ("lmcache.v1.storage_backend.plugins.dax_backend", "DaxBackend"),
}
CHUNK = 256
HEADS, HEAD_SIZE = 8, 8  # 64 bf16 per token per layer and K/V: 128 bytes


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(s.rstrip("KMG")) * mult


def layers_for(size: int) -> int:
    per_layer = 2 * CHUNK * HEADS * HEAD_SIZE * 2
    assert size % per_layer == 0, f"{size} is not a whole number of layers"
    return size // per_layer


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(
            (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in out.splitlines())
        )
        return f"{fields.get('Model name', '?')}, {fields.get('CPU(s)', '?')} CPUs"
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "?"


class Side:
    def __init__(self, kind: str, cfg_base: dict, lcb, md, loop, n: int, slot: int) -> None:
        self.kind = kind
        self.path = f"/dev/shm/daxkv-bench-{kind}-{uuid.uuid4().hex}"
        with open(self.path, "wb") as f:
            f.truncate(n * slot)
        cfg = LMCacheEngineConfig.from_defaults(**cfg_base)
        module, cls = BACKENDS[kind]
        cfg.storage_plugins = ["dax"]
        cfg.extra_config = {
            "storage_plugin.dax.module_path": module,
            "storage_plugin.dax.class_name": cls,
            "dax.device_path": self.path,
            "dax.max_dax_size": n * slot / 2**30,
        }
        out: collections.OrderedDict = collections.OrderedDict()
        storage_plugin_launcher(cfg, md, loop, lcb, "cpu", out)
        assert "dax" in out, f"{kind}: the launcher could not build the backend"
        self.b = out["dax"]
        self.put_s: list[float] = []
        self.get_s: list[float] = []

    def close(self) -> None:
        self.b.close()
        os.unlink(self.path)


def run_size(size: int, n: int, rounds: int) -> dict[str, dict[str, float]]:
    layers = layers_for(size)
    md = LMCacheMetadata(
        model_name="bench",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(layers, 2, CHUNK, HEADS, HEAD_SIZE),
        role="worker",
    )
    # Sources, plus one restore's outputs, plus room.
    cpu_gb = (2 * n + 8) * size / 2**30 + 0.05
    cfg_base = dict(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=cpu_gb, lmcache_instance_id="bench"
    )
    cfg = LMCacheEngineConfig.from_defaults(**cfg_base)
    lcb = LocalCPUBackend(config=cfg, metadata=md, dst_device="cpu")
    assert lcb.get_full_chunk_size_bytes() == size
    loop = asyncio.new_event_loop()
    shape = torch.Size([2, layers, CHUNK, HEADS * HEAD_SIZE])
    keys = [CacheEngineKey("bench", 1, 0, i, torch.bfloat16) for i in range(n)]
    objs = lcb.batched_allocate(shape, torch.bfloat16, n, MemoryFormat.KV_2LTD)
    assert objs is not None
    g = torch.Generator().manual_seed(size)
    for o in objs:
        o.tensor.view(torch.int16).copy_(
            torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16)
        )
    want = [o.tensor.view(torch.uint8) for o in objs]
    sides = [Side(k, cfg_base, lcb, md, loop, n, size) for k in BACKENDS]
    try:
        for r in range(rounds + 1):  # round 0: warm-up, untimed
            order = sides if r % 2 == 0 else sides[::-1]
            for s in order:
                assert s.b.batched_remove(keys) in (0, n)
                # As timeit does: no garbage collection inside a timing (a
                # full collection of the objects a restore leaves behind
                # takes milliseconds, whichever backend it lands in).
                gc.collect()
                gc.disable()
                t0 = time.perf_counter()
                s.b.batched_submit_put_task(keys, objs)
                t1 = time.perf_counter()
                gc.enable()
                assert s.b.batched_contains(keys) == n, f"{s.kind}: not every key stored"
                gc.collect()
                gc.disable()
                t2 = time.perf_counter()
                res = s.b.batched_get_blocking(keys)
                t3 = time.perf_counter()
                gc.enable()
                for i, (got, w) in enumerate(zip(res, want)):
                    assert got is not None, f"{s.kind}: key {i} missing"
                    assert got.get_shape() == shape
                    assert torch.equal(got.tensor.view(torch.uint8), w), f"{s.kind}: key {i} bytes"
                    got.ref_count_down()
                if r:
                    s.put_s.append(t1 - t0)
                    s.get_s.append(t3 - t2)
        out: dict[str, dict[str, float]] = {}
        for s in sides:
            put_t = statistics.median(s.put_s)
            get_t = statistics.median(s.get_s)
            out[s.kind] = {
                "put_obj_s": n / put_t,
                "put_gb_s": n * size / put_t / 1e9,
                "get_obj_s": n / get_t,
                "get_gb_s": n * size / get_t / 1e9,
            }
        # Ratios of the rounds run back to back (the machine may be shared:
        # a paired ratio cancels what both runs of a round went through).
        d, u = sides[0], sides[1]
        for op, dt, ut in (("put", d.put_s, u.put_s), ("get", d.get_s, u.get_s)):
            ratios = sorted(b / a for a, b in zip(dt, ut))
            out["ratio"] = out.get("ratio", {})
            out["ratio"][op] = statistics.median(ratios)
            out["ratio"][op + "_min"] = ratios[0]
            out["ratio"][op + "_max"] = ratios[-1]
        # What a plain copy of the same bytes does here: torch's copy_ of
        # every source object into a CPU buffer (its intra-op threads).
        dst = torch.empty(n, size, dtype=torch.uint8)
        dst.fill_(0)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for i, w in enumerate(want):
                dst[i].copy_(w.reshape(-1))
            times.append(time.perf_counter() - t0)
        out["memcpy"] = {"gb_s": n * size / statistics.median(times) / 1e9}
        return out
    finally:
        for s in sides:
            s.close()
        for o in objs:
            o.ref_count_down()
        loop.close()
        lcb.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=256)
    ap.add_argument("--sizes", default="256K,2M")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    print(f"# {cpu_model()}; load average {os.getloadavg()[0]:.2f} at start")
    print(f"# {args.objects} objects per batch, median of {args.rounds} interleaved rounds")
    rows = []
    memcpy = []
    for size_s in args.sizes.split(","):
        size = parse_size(size_s)
        r = run_size(size, args.objects, args.rounds)
        memcpy.append(f"{size_s.strip()}: {r['memcpy']['gb_s']:.2f} GB/s")
        for op, key in (("restore", "get"), ("put", "put")):
            d, u, q = r["daxkv"], r["lmcache"], r["ratio"]
            rows.append(
                (
                    f"{op} {size_s.strip()}",
                    d[f"{key}_obj_s"],
                    d[f"{key}_gb_s"],
                    u[f"{key}_obj_s"],
                    u[f"{key}_gb_s"],
                    q[key],
                    q[f"{key}_min"],
                    q[f"{key}_max"],
                )
            )
    print()
    print(
        "| op | daxkv obj/s | daxkv GB/s | LMCache obj/s | LMCache GB/s "
        "| ratio (paired rounds: median, min–max) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, do, dg, uo, ug, ratio, lo, hi in rows:
        print(
            f"| {name} | {do:,.0f} | {dg:.2f} | {uo:,.0f} | {ug:.2f} "
            f"| {ratio:.2f}x ({lo:.2f}–{hi:.2f}) |"
        )
    print(f"\n# plain copy of the same objects (torch copy_): {', '.join(memcpy)}")
    print(f"# load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
