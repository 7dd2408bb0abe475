"""A stand-in CUDA runtime for ``daxkv.cuda`` on machines without a GPU.

"GPU tensors" are numpy arrays wrapped in ``FakeTensor`` (``is_cuda``,
``is_contiguous()``, ``nbytes``). Copies are asynchronous as a copy engine's
are: queued by ``to_host`` / ``to_device`` and carried out only at
``synchronize``. Every check a real driver would make, or that a wrong
order would need to be caught, is an assertion here:

- ``register`` / ``unregister``: the range is mapped now
  (``/proc/self/maps``), a register overlaps no registered range, an
  unregister names one;
- a copy touches only host memory inside a registered (or staging) range
  that is mapped, when queued and again when it runs;
- at ``synchronize``, when ``leases_open`` is given: at least one lease is
  still open for each queued copy's slot, i.e. no slot was freed (aborted,
  released) before the copies into or out of it were waited for.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional

import numpy as np


def mapped(base: int, length: int) -> bool:
    """Whether ``[base, base + length)`` lies in this process's mappings."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            a, b = line.split()[0].split("-")
            ranges.append((int(a, 16), int(b, 16)))
    at, end = base, base + length
    while at < end:
        hit = [b for a, b in ranges if a <= at < b]
        if not hit:
            return False
        at = hit[0]
    return True


class FakeTensor:
    """A numpy array standing in for a tensor on a GPU."""

    def __init__(self, arr: np.ndarray, on_gpu: bool = True) -> None:
        self.arr = arr
        self.is_cuda = on_gpu
        self.device = "cuda:0" if on_gpu else "cpu"
        self.nbytes = arr.nbytes

    def is_contiguous(self) -> bool:
        return bool(self.arr.flags["C_CONTIGUOUS"])

    def data_ptr(self) -> int:
        return int(self.arr.ctypes.data)


class InjectedError(RuntimeError):
    """Raised by a copy the test asked to fail."""


class FakeRuntime:
    def __init__(
        self,
        unpinnable: Callable[[int, int], bool] = lambda base, length: False,
        fail_copy_at: Optional[int] = None,
        leases_open: Optional[Callable[[], int]] = None,
    ) -> None:
        self.unpinnable = unpinnable
        self.fail_copy_at = fail_copy_at
        self.leases_open = leases_open
        self.registered: dict[int, int] = {}
        self.staging_bufs: list[np.ndarray] = []
        self.pending: list[tuple[str, Any, int, int]] = []
        self.copies = 0
        self.log: list[tuple[str, int, int]] = []
        self.synced_with_open_leases: list[int] = []

    # -- registration -----------------------------------------------------

    def register(self, base: int, length: int) -> None:
        assert mapped(base, length), f"register of an unmapped range {base:#x}+{length}"
        for b, n in self.registered.items():
            assert base + length <= b or b + n <= base, "register overlapping a registered range"
        if self.unpinnable(base, length):
            raise RuntimeError("CUDA_ERROR_NOT_SUPPORTED (fake: an fsdax file)")
        self.registered[base] = length
        self.log.append(("register", base, length))

    def unregister(self, base: int) -> None:
        assert base in self.registered, f"unregister of {base:#x}, never registered"
        assert mapped(base, self.registered[base]), "unregister after the unmap"
        self.log.append(("unregister", base, self.registered.pop(base)))

    def _pinned(self, addr: int, n: int) -> bool:
        if any(b <= addr and addr + n <= b + l for b, l in self.registered.items()):
            return True
        return any(
            s.ctypes.data <= addr and addr + n <= s.ctypes.data + s.nbytes for s in self.staging_bufs
        )

    def _check_host(self, addr: int, n: int, when: str) -> None:
        assert self._pinned(addr, n), f"{when}: a copy at {addr:#x}+{n} outside every registered range"
        assert mapped(addr, n), f"{when}: a copy at {addr:#x}+{n} into an unmapped range"

    # -- tensors and copies ---------------------------------------------

    def nbytes(self, tensor: Any) -> int:
        if not getattr(tensor, "is_cuda", False):
            raise ValueError(f"not on a GPU (device {getattr(tensor, 'device', '?')})")
        if not tensor.is_contiguous():
            raise ValueError("not contiguous")
        return int(tensor.nbytes)

    def _count(self) -> None:
        self.copies += 1
        if self.fail_copy_at is not None and self.copies == self.fail_copy_at:
            raise InjectedError(f"copy {self.copies} failed (injected)")

    def to_host(self, dst: int, tensor: FakeTensor, n: int, stream: Any) -> None:
        self._count()
        self._check_host(dst, n, "to_host")
        self.pending.append(("to_host", tensor, dst, n))

    def to_device(self, tensor: FakeTensor, src: int, n: int, stream: Any) -> None:
        self._count()
        self._check_host(src, n, "to_device")
        self.pending.append(("to_device", tensor, src, n))

    def synchronize(self, stream: Any) -> None:
        if self.pending and self.leases_open is not None:
            open_now = self.leases_open()
            # Staged copies use bounce buffers, not slots.
            slots = sum(1 for _, _, a, n in self.pending if not self._staged(a, n))
            assert open_now >= min(slots, 1), "a slot was freed before its copies were waited for"
            self.synced_with_open_leases.append(open_now)
        for kind, t, addr, n in self.pending:
            self._check_host(addr, n, "synchronize")
            if kind == "to_host":
                ctypes.memmove(addr, t.data_ptr(), n)
            else:
                ctypes.memmove(t.data_ptr(), addr, n)
        self.pending.clear()

    def _staged(self, addr: int, n: int) -> bool:
        return any(
            s.ctypes.data <= addr and addr + n <= s.ctypes.data + s.nbytes for s in self.staging_bufs
        )

    def staging(self, n: int) -> tuple[np.ndarray, int]:
        buf = np.zeros(n, dtype=np.uint8)
        self.staging_bufs.append(buf)
        return buf, int(buf.ctypes.data)
