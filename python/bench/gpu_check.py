"""GPU-direct check and figures (scripts/gpu-check.sh runs it).

For each chunk size: N separately allocated GPU tensors are stored with
``daxkv.cuda.GpuDirect.store_from_gpu`` into slots fragmented by earlier
deletes (every other slot of a filled device deleted), loaded back into
fresh tensors with ``load_to_gpu``, and compared on the GPU. Printed next
to the same run's:

- **registered**: one ``copy_(non_blocking=True)`` per chunk straight
  into (and out of) the device mapping registered with CUDA, no leases:
  the ceiling of the GPU-direct path;
- **staged**: GPU -> pinned bounce buffer, then the engine's CPU copy into
  its slots (``submit_batch_set``), and back (``submit_batch_get``, then
  pinned -> GPU): the path without GPU-direct;
- **contiguous**: ``store_from_gpu`` / ``load_to_gpu`` into a fresh device
  (consecutive slots), on its own line.

Exit 77 (skipped) without torch or a CUDA GPU. Bounded by ``--deadline``
(seconds, checked between sizes). Prints a table and, with ``--json``, one
JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import select
import sys
import time

SIZES = {"64K": 64 << 10, "256K": 256 << 10, "2M": 2 << 20, "8M": 8 << 20, "32M": 32 << 20}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64K,256K,2M,8M,32M")
    ap.add_argument("--total-mib", type=int, default=1024, help="bytes moved per size and phase")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=400.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("gpu-check: skipped: no torch in this python", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("gpu-check: skipped: no CUDA GPU", file=sys.stderr)
        return 77
    import daxkv
    from daxkv.cuda import DriverRuntime, GpuDirect

    start = time.monotonic()
    rt = DriverRuntime()
    dev = torch.cuda.get_device_name(0)
    print(f"gpu-check: {dev}; torch {torch.__version__}; {a.total_mib} MiB per size and phase")
    print(f"{'chunk':>6} {'case':>11} {'store GB/s':>10} {'load GB/s':>10} {'vs registered':>14}")
    stream = torch.cuda.Stream()
    ok = True
    for name in a.sizes.split(","):
        if time.monotonic() - start > a.deadline:
            print(f"gpu-check: deadline reached before {name}", file=sys.stderr)
            break
        size = SIZES[name]
        n = max(2, (a.total_mib << 20) // size)
        srcs = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda") for _ in range(n)]
        dsts = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(n)]

        def timed(f, before=None) -> float:
            """Best of the rounds, GB/s; `before` runs untimed each round."""
            best = float("inf")
            for _ in range(a.rounds):
                if before is not None:
                    before()
                torch.cuda.synchronize()
                t = time.perf_counter()
                f()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t)
            return n * size / best / 1e9

        rows = {}
        for case in ("fragmented", "contiguous"):
            slots = 2 * n + 2 if case == "fragmented" else n + 1
            conn = daxkv.DaxConnector(
                slot_bytes=size,
                device_path="memfd",
                max_dax_size_gb=slots * size / 2**30,
                num_store_workers=8,
                num_load_workers=8,
            )
            if case == "fragmented":
                fill = [f"fill{i}" for i in range(2 * n)]
                one = bytes(size)
                fid = conn.submit_batch_set(fill, [one] * len(fill))
                wait(conn, {fid})
                fid = conn.submit_batch_delete(fill[::2])
                wait(conn, {fid})
                # The rest go too once the deletes made their holes.
                fid = conn.submit_batch_delete(fill[1::2][: n // 2])
                wait(conn, {fid})
            g = GpuDirect(conn, rt)
            round_no = [0]

            def store() -> None:
                round_no[0] += 1
                keys = [f"r{round_no[0]}k{i}" for i in range(n)]
                with torch.cuda.stream(stream):
                    res = g.store_from_gpu(keys, srcs, stream)
                assert all(res), "store_from_gpu failed a key"
                last_keys[:] = keys

            last_keys: list[str] = []

            def load() -> None:
                with torch.cuda.stream(stream):
                    res = g.load_to_gpu(last_keys, dsts, stream)
                assert all(res), "load_to_gpu missed a key"

            def drop_keys() -> None:
                if last_keys:
                    fid = conn.submit_batch_delete(last_keys)
                    wait(conn, {fid})

            s_rate = timed(store, before=drop_keys)
            l_rate = timed(load)
            same = all(torch.equal(s, d) for s, d in zip(srcs, dsts))
            ok &= same
            rows[case] = (s_rate, l_rate, same)
            if case == "fragmented":
                # The registered-copy ceiling and the staged path, same run.
                ((_, base, length, _),) = conn.regions()
                reg_s = timed(lambda: [rt.to_host(base + i * size, srcs[i], size, stream) for i in range(n)])
                reg_l = timed(lambda: [rt.to_device(dsts[i], base + i * size, size, stream) for i in range(n)])
                rows["registered"] = (reg_s, reg_l, True)
                pinned = torch.empty(n * size, dtype=torch.uint8, pin_memory=True)
                views = [memoryview(pinned[i * size : (i + 1) * size].numpy()) for i in range(n)]

                def staged_store() -> None:
                    for i in range(n):
                        pinned[i * size : (i + 1) * size].copy_(srcs[i], non_blocking=True)
                    torch.cuda.synchronize()
                    keys = [f"st{time.perf_counter_ns()}k{i}" for i in range(n)]
                    fid = conn.submit_batch_set(keys, views)
                    assert wait(conn, {fid})[fid][0]
                    staged_keys[:] = keys

                staged_keys: list[str] = []

                def staged_load() -> None:
                    fid = conn.submit_batch_get(staged_keys, views)
                    assert wait(conn, {fid})[fid][0]
                    for i in range(n):
                        dsts[i].copy_(pinned[i * size : (i + 1) * size], non_blocking=True)

                drop_keys()
                last_keys.clear()
                st_s = timed(staged_store, before=lambda: drop_staged(conn, staged_keys))
                st_l = timed(staged_load)
                rows["staged"] = (st_s, st_l, True)
            g.close()
            conn.close()
        reg = rows["registered"]
        for case in ("fragmented", "registered", "staged", "contiguous"):
            s_rate, l_rate, same = rows[case]
            vs = f"{s_rate / reg[0]:.2f}x / {l_rate / reg[1]:.2f}x"
            flag = "" if same else "  BYTES DIFFER"
            print(f"{name:>6} {case:>11} {s_rate:>10.1f} {l_rate:>10.1f} {vs:>14}{flag}")
            if a.json:
                print(json.dumps({"chunk": name, "case": case, "store_gbps": s_rate,
                                  "load_gbps": l_rate, "bytes_equal": same, "device": dev}))
        del srcs, dsts
        torch.cuda.empty_cache()
    print("gpu-check: bytes verified" if ok else "gpu-check: BYTES DIFFER")
    return 0 if ok else 1


def drop_staged(conn, keys: list[str]) -> None:
    if keys:
        fid = conn.submit_batch_delete(keys)
        wait(conn, {fid})


def wait(conn, fids: set[int], timeout_s: float = 60.0) -> dict:
    out: dict = {}
    p = select.poll()
    p.register(conn.event_fd(), select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while not fids.issubset(out):
        if time.monotonic() > deadline:
            raise TimeoutError(f"futures never completed: {fids - set(out)}")
        p.poll(200)
        for fid, ok, err, bools in conn.drain_completions():
            out[fid] = (ok, err, bools)
    return out


if __name__ == "__main__":
    sys.exit(main())
