#!/usr/bin/env python3
"""The `plugin` path's calling-thread work per 4 KiB store task, for
callgrind (perf/callgrind-plugin.sh).

LMCache's store controller's calls, as `bench_l2.py` makes them: tasks of
16 keys and 16 `TensorMemoryObj`s of 4 KiB, 8 in flight; wait on the store
fd; `pop_completed_store_tasks()` until all 8 are back; every 16 rounds
the 2,048 keys are deleted (so each store is of a new key). The timed part
runs inside `functools.reduce`, so `valgrind --toggle-collect=functools_reduce`
counts exactly it (imports, set-up and 16 warm-up rounds excluded); the
engine's workers run on other threads (`--separate-threads=yes`: read the
main thread's file). `spin_us: 0`: under valgrind a spinning worker would
only burn the serialised CPU.

    python plugin_caller.py ROUNDS        # ROUNDS × 8 tasks timed
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import select
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_l2 as B  # noqa: E402
import torch  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)

SIZE, N, TASK, IN_FLIGHT = 4096, 2048, 16, 8


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    src = torch.randint(0, 256, (N * SIZE,), dtype=torch.uint8)
    objs = [B.memory_obj(src[i * SIZE:(i + 1) * SIZE]) for i in range(N)]
    keys = [B.key(i, 0) for i in range(N)]
    dev = f"/dev/shm/daxkv-plugin-caller-{uuid.uuid4().hex}"
    cap = N * SIZE + (16 << 20)
    with open(dev, "wb") as f:
        f.write(b"\0" * cap)
    try:
        spec = B.spec("plugin", dev, SIZE, cap, {"store": 1, "lookup": 1, "load": 2})
        spec["adapter_params"]["spin_us"] = 0
        args = add_l2_adapters_args(argparse.ArgumentParser()).parse_args(
            ["--l2-adapter", json.dumps(spec)]
        )
        a = create_l2_adapter(parse_args_to_l2_adapters_config(args).adapters[0])
    finally:
        os.unlink(dev)
    fd = a.get_store_event_fd()
    per_round = TASK * IN_FLIGHT

    def one(_acc: object, r: int) -> None:
        base = (r % (N // per_round)) * per_round
        for i in range(IN_FLIGHT):
            s = slice(base + i * TASK, base + (i + 1) * TASK)
            a.submit_store_task(keys[s], objs[s])
        got = 0
        while got < IN_FLIGHT:
            select.select([fd], [], [], 1)
            try:
                os.read(fd, 8)
            except BlockingIOError:
                pass
            done = a.pop_completed_store_tasks()
            if not all(r.is_successful() for r in done.values()):
                raise SystemExit(f"a store task failed: {done}")
            got += len(done)
        if r % (N // per_round) == N // per_round - 1:
            a.delete(keys)

    for r in range(16):
        one(None, r)
    functools.reduce(one, range(16, 16 + rounds), None)
    # The keys of the last pass are held, or none after its delete.
    last = (16 + rounds - 1) % (N // per_round)
    upto = 0 if last == N // per_round - 1 else (last + 1) * per_round
    held = a._core.exists(keys)
    a.close()
    if held != [True] * upto + [False] * (N - upto):
        raise SystemExit(f"held {held.count(True)} keys, expected the first {upto}")


if __name__ == "__main__":
    main()
