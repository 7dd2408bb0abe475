"""Shared fixtures: connectors over memfds or /dev/shm files."""

from __future__ import annotations

import os
import select
import uuid
from typing import Callable, Iterator

import pytest

import daxkv

SLOT = 64 * 1024


def shm_path() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    return os.path.join(base, f"daxkv-pytest-{uuid.uuid4().hex}")


@pytest.fixture
def dax_file() -> Iterator[str]:
    """A file standing in for a DAX device, removed afterwards."""
    p = shm_path()
    yield p
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


@pytest.fixture
def make_connector() -> Iterator[Callable[..., daxkv.DaxConnector]]:
    made: list[daxkv.DaxConnector] = []

    def make(**kw: object) -> daxkv.DaxConnector:
        params: dict[str, object] = {
            "slot_bytes": SLOT,
            "device_path": "memfd",
            "max_dax_size_gb": 256 * SLOT / 2**30,
            "num_load_workers": 2,
            "spin_us": 20,
        }
        params.update(kw)
        c = daxkv.DaxConnector(**params)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def wait_readable(fd: int, timeout_s: float = 10.0) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN)
    assert p.poll(int(timeout_s * 1000)), f"fd {fd} not readable after {timeout_s}s"


def drain_until(c: daxkv.DaxConnector, fids: set[int], timeout_s: float = 20.0) -> dict:
    """Poll the connector's fd as LMCache's bridge does and drain until every
    future in `fids` has completed; returns {fid: (ok, error, bools)}."""
    import time

    out: dict = {}
    p = select.poll()
    p.register(c.event_fd(), select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while not fids.issubset(out):
        assert time.monotonic() < deadline, f"futures never completed: {fids - set(out)}"
        if not p.poll(500):
            continue
        for fid, ok, err, bools in c.drain_completions():
            assert fid not in out, f"future {fid} completed twice"
            out[fid] = (ok, err, bools)
    return out


def payload(i: int, n: int) -> bytes:
    return bytes(((j * 31 + i * 7) & 0xFF) for j in range(n)) if n < 4096 else (
        bytes([(i * 7) & 0xFF]) * 17 + os.urandom(64) + bytes(range(256)) * ((n - 81) // 256)
        + bytes((n - 81) % 256)
    )[:n]
