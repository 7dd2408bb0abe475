"""GPU-direct stores and loads into daxkv's leased slots.

``GpuDirect(connector)`` registers every device mapping of a
``daxkv.DaxConnector`` with CUDA (``cuMemHostRegister``, through the
driver API: the runtime API latches sticky errors), follows hotplug
through the connector's mapping observer, and copies KV chunks between
GPU tensors and leased slots with the GPU's copy engines: no staging
buffer, no CPU copy (python/README.md, "GPU-direct"; docs/leases.md for
the lease rules).

- ``store_from_gpu(keys, tensors, stream=None)``: lease a slot per key,
  ``copy_(non_blocking=True)`` each tensor into its slot on ``stream``,
  wait for the stream, commit. Per key: stored (or already present).
- ``load_to_gpu(keys, tensors, stream=None)``: read-lease each key's slot,
  copy it into its tensor on ``stream``, wait, release. Per key: loaded.

The copies of one call are all issued before the one wait (small chunks
are not bound by a synchronization each). Whatever happens between the
first copy and the wait (an exception from a copy, a bad tensor, a
``KeyboardInterrupt``), the stream is synchronized in a ``finally``
before any slot is committed, aborted or released: a slot the GPU may
still be writing or reading is never freed. If the wait itself fails,
the leases are kept (never freed, visible as open leases in ``status`` /
``/metrics``) and the error propagates.

A mapping that cannot be registered (an fsdax file, a kernel without the
support) falls back to the staged path for its device, with a warning:
GPU -> pinned bounce buffer -> a CPU copy into the slot, and back.

``import daxkv`` never imports torch; this module imports it only when
the real runtime is made (``DriverRuntime``). Tests pass a stand-in
runtime (``python/tests/fake_cuda.py``) that checks every registration
and copy against ``/proc/self/maps``.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
import weakref
from typing import Any, Optional, Protocol, Sequence

from ._daxkv import DaxConnector, LeaseError, ReadLease, StoreLease

#: The largest piece registered at once: CUDA's limit on one
#: cuMemHostRegister call on some drivers; pieces are cut on slot
#: boundaries so no slot straddles two registrations.
REGISTER_PIECE_MAX = 64 << 30


class RegistrationError(RuntimeError):
    """A mapping could not be registered with CUDA (the reason)."""


class Runtime(Protocol):
    """What ``GpuDirect`` needs of CUDA (``DriverRuntime``, or a stand-in)."""

    def register(self, base: int, length: int) -> None:
        """Page-lock ``[base, base + length)`` for every GPU of the process."""

    def unregister(self, base: int) -> None:
        """Undo the ``register`` that began at ``base``."""

    def nbytes(self, tensor: Any) -> int:
        """The tensor's byte length; ``ValueError`` unless it is a
        contiguous tensor on a GPU."""

    def to_host(self, dst: int, tensor: Any, n: int, stream: Any) -> None:
        """Start copying ``n`` bytes of ``tensor`` to host address ``dst``."""

    def to_device(self, tensor: Any, src: int, n: int, stream: Any) -> None:
        """Start copying ``n`` bytes at host address ``src`` into ``tensor``."""

    def synchronize(self, stream: Any) -> None:
        """Wait until every copy started on ``stream`` has finished."""

    def staging(self, n: int) -> Any:
        """A pinned host buffer of ``n`` bytes (a buffer-protocol object
        with an ``address``: ``(buffer, address)``)."""


def pieces(base: int, length: int, slot_bytes: int) -> list[tuple[int, int]]:
    """``[base, base + length)`` cut into pieces of at most
    ``REGISTER_PIECE_MAX`` bytes, each a whole number of slots."""
    step = max(slot_bytes, REGISTER_PIECE_MAX // slot_bytes * slot_bytes)
    return [(base + at, min(step, length - at)) for at in range(0, length, step)]


class GpuDirect:
    """GPU-direct copies into ``conn``'s leased slots (module doc).

    Registers every device mapping at once (the observer's replay) and
    follows hotplug; ``close()`` (or leaving a ``with`` block) unregisters
    them and stops following. ``runtime`` defaults to ``DriverRuntime()``
    (needs torch and a CUDA driver).
    """

    def __init__(self, conn: DaxConnector, runtime: Optional[Runtime] = None) -> None:
        self._conn = conn
        self._rt: Runtime = runtime if runtime is not None else DriverRuntime()
        self._slot = conn.slot_bytes
        self._lock = threading.Lock()
        #: (device, epoch) -> the bases registered, or None: staged.
        self._regs: dict[tuple[int, int], Optional[list[int]]] = {}
        #: Leases kept for good after a failed wait (module doc).
        self._quarantine: list[Any] = []
        # The connector holds its observers strongly, in Rust, where the
        # garbage collector cannot see a cycle: it holds a forwarder with
        # a weak reference, so a GpuDirect nobody closed is still collected
        # (and unregisters its mappings then, in __del__).
        self._forward = _Forward(self)
        self._closed = False
        if not conn.observe(self._forward):
            raise RuntimeError("daxkv.cuda: the connector refused the mapping observer")

    # -- the mapping observer (called by the engine, on any thread) --------

    def mapped(self, device: int, base: int, length: int, epoch: int) -> None:
        done: list[int] = []
        try:
            for b, n in pieces(base, length, self._slot):
                self._rt.register(b, n)
                done.append(b)
        except Exception as e:  # noqa: BLE001 - any failure falls back
            for b in done:
                try:
                    self._rt.unregister(b)
                except Exception:  # noqa: BLE001
                    pass
            warnings.warn(
                f"daxkv.cuda: device {device}'s mapping ({length} bytes) cannot be "
                f"registered with CUDA ({e}); its keys take the staged path "
                "(GPU -> pinned buffer -> CPU copy)",
                RuntimeWarning,
                stacklevel=2,
            )
            with self._lock:
                self._regs[(device, epoch)] = None
            return
        with self._lock:
            self._regs[(device, epoch)] = done

    def unmapping(self, device: int, base: int, length: int, epoch: int) -> None:
        with self._lock:
            bases = self._regs.pop((device, epoch), None)
        for b in bases or []:
            self._rt.unregister(b)

    def registered(self, device: int, epoch: int) -> Optional[bool]:
        """True: registered; False: staged; None: not a mapping seen."""
        with self._lock:
            if (device, epoch) not in self._regs:
                return None
            return self._regs[(device, epoch)] is not None

    def close(self) -> None:
        """Stop following the mappings and unregister them all (a second
        call does nothing; a connector closed first has unregistered them
        through its close's ``unmapping`` calls already)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._conn.unobserve(self._forward)
        except RuntimeError:
            pass  # the connector is closed: its mappings are gone, and told
        with self._lock:
            regs, self._regs = self._regs, {}
        for bases in regs.values():
            for b in bases or []:
                self._rt.unregister(b)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to in a finalizer
            pass

    def __enter__(self) -> "GpuDirect":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- copies -------------------------------------------------------------

    def _sizes(self, keys: Sequence[Any], tensors: Sequence[Any]) -> list[int]:
        if len(keys) != len(tensors):
            raise ValueError(f"daxkv.cuda: {len(keys)} keys but {len(tensors)} tensors")
        sizes = []
        for i, t in enumerate(tensors):
            try:
                sizes.append(self._rt.nbytes(t))
            except ValueError as e:
                raise ValueError(f"daxkv.cuda: tensor {i}: {e}") from None
        return sizes

    def _settle(self, stream: Any, leases: list[Any], copying: bool) -> None:
        """After an exception: wait for the copies begun, then end every
        lease still open; if the wait fails, keep the leases for good."""
        if copying:
            try:
                self._rt.synchronize(stream)
            except BaseException:
                self._quarantine.extend(leases)
                raise
        for l in leases:
            if isinstance(l, StoreLease):
                l.abort()
            else:
                l.release()

    def store_from_gpu(
        self, keys: Sequence[Any], tensors: Sequence[Any], stream: Any = None
    ) -> list[bool]:
        """Store ``tensors[i]`` (contiguous, on a GPU) under ``keys[i]``
        straight into leased slots: per key, stored (or already present)."""
        sizes = self._sizes(keys, tensors)
        too_big = [i for i, n in enumerate(sizes) if n > self._slot]
        if too_big:
            i = too_big[0]
            raise ValueError(
                f"daxkv.cuda: tensor {i} is {sizes[i]} bytes, more than slot_bytes {self._slot}"
            )
        given = self._conn.lease_store(keys, sizes)
        out = [g is None for g in given]
        leases = [(i, g) for i, g in enumerate(given) if isinstance(g, StoreLease)]
        held = [l for _, l in leases]
        staged: list[tuple[StoreLease, Any]] = []
        copying = False
        try:
            for i, l in leases:
                if l.size == 0:
                    continue
                copying = True
                if self.registered(l.device, l.epoch):
                    self._rt.to_host(l.ptr, tensors[i], l.size, stream)
                else:
                    buf, addr = self._rt.staging(l.size)
                    self._rt.to_host(addr, tensors[i], l.size, stream)
                    staged.append((l, buf))
            self._rt.synchronize(stream)
            copying = False
            for l, buf in staged:
                l.write(buf)
        except BaseException:
            self._settle(stream, held, copying)
            raise
        for (i, _), ok in zip(leases, self._conn.commit_leases(held)):
            out[i] = ok
        return out

    def load_to_gpu(
        self, keys: Sequence[Any], tensors: Sequence[Any], stream: Any = None
    ) -> list[bool]:
        """Load each key's bytes into ``tensors[i]`` (contiguous, on a GPU,
        at least the stored length) from its leased slot: per key, loaded."""
        sizes = self._sizes(keys, tensors)
        got = self._conn.lease_load(keys)
        reads = [(i, g) for i, g in enumerate(got) if isinstance(g, ReadLease)]
        out = [False] * len(keys)
        held = [l for _, l in reads]
        copying = False
        try:
            for i, l in reads:
                if l.size > sizes[i]:
                    continue  # the tensor is too small: this key fails
                out[i] = True
                if l.size == 0:
                    continue
                copying = True
                if self.registered(l.device, l.epoch):
                    self._rt.to_device(tensors[i], l.ptr, l.size, stream)
                else:
                    buf, addr = self._rt.staging(l.size)
                    l.read(buf)
                    self._rt.to_device(tensors[i], addr, l.size, stream)
                    # The bounce buffer lives until the wait.
                    held.append(_Keep(buf))
            self._rt.synchronize(stream)
        except BaseException:
            self._settle(stream, [l for l in held if isinstance(l, ReadLease)], copying)
            raise
        for l in held:
            if isinstance(l, ReadLease):
                l.release()
        return out


class _Forward:
    """The mapping observer the connector holds for a ``GpuDirect``: it
    forwards while the ``GpuDirect`` lives, and holds it weakly."""

    def __init__(self, target: GpuDirect) -> None:
        self._target = weakref.ref(target)

    def mapped(self, device: int, base: int, length: int, epoch: int) -> None:
        t = self._target()
        if t is not None:
            t.mapped(device, base, length, epoch)

    def unmapping(self, device: int, base: int, length: int, epoch: int) -> None:
        t = self._target()
        if t is not None:
            t.unmapping(device, base, length, epoch)


class _Keep:
    """Keeps a bounce buffer alive until the copies are waited for."""

    def __init__(self, buf: Any) -> None:
        self.buf = buf


# -- the real runtime ----------------------------------------------------

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02


class DriverRuntime:
    """CUDA through the driver API (``libcuda``, via ctypes) for
    registration, and torch for the copies on a stream. Registers with
    ``PORTABLE | DEVICEMAP`` in the device 0 primary context, pushed on the
    calling thread (observer callbacks run on any thread); every return
    code is checked."""

    def __init__(self, libcuda: str = "libcuda.so.1") -> None:
        import torch  # noqa: PLC0415 - lazily, only here

        self._torch = torch
        self._cu = ctypes.CDLL(libcuda)
        self._check(self._cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(self._cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self._ctx = ctypes.c_void_p()
        self._check(
            self._cu.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev), "cuDevicePrimaryCtxRetain"
        )
        self._cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        self._cu.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self._cu.cuGetErrorName(rc, ctypes.byref(name))
            raise RegistrationError(f"{what}: {name.value.decode() if name.value else rc}")

    def _in_ctx(self, f: Any, what: str) -> None:
        self._check(self._cu.cuCtxPushCurrent_v2(self._ctx), "cuCtxPushCurrent")
        try:
            self._check(f(), what)
        finally:
            popped = ctypes.c_void_p()
            self._cu.cuCtxPopCurrent_v2(ctypes.byref(popped))

    def register(self, base: int, length: int) -> None:
        flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
        self._in_ctx(lambda: self._cu.cuMemHostRegister_v2(base, length, flags), "cuMemHostRegister")

    def unregister(self, base: int) -> None:
        self._in_ctx(lambda: self._cu.cuMemHostUnregister(base), "cuMemHostUnregister")

    def nbytes(self, tensor: Any) -> int:
        if not getattr(tensor, "is_cuda", False):
            raise ValueError(f"not on a GPU (device {getattr(tensor, 'device', '?')})")
        if not tensor.is_contiguous():
            raise ValueError("not contiguous")
        return int(tensor.nbytes)

    def _host(self, addr: int, n: int) -> Any:
        arr = (ctypes.c_uint8 * n).from_address(addr)
        return self._torch.frombuffer(arr, dtype=self._torch.uint8)

    def _flat(self, tensor: Any, n: int) -> Any:
        return tensor.view(-1).view(self._torch.uint8)[:n]

    def _stream(self, stream: Any) -> Any:
        return stream if stream is not None else self._torch.cuda.current_stream()

    def to_host(self, dst: int, tensor: Any, n: int, stream: Any) -> None:
        with self._torch.cuda.stream(self._stream(stream)):
            self._host(dst, n).copy_(self._flat(tensor, n), non_blocking=True)

    def to_device(self, tensor: Any, src: int, n: int, stream: Any) -> None:
        with self._torch.cuda.stream(self._stream(stream)):
            self._flat(tensor, n).copy_(self._host(src, n), non_blocking=True)

    def synchronize(self, stream: Any) -> None:
        ev = self._torch.cuda.Event()
        ev.record(self._stream(stream))
        ev.synchronize()

    def staging(self, n: int) -> Any:
        t = self._torch.empty(n, dtype=self._torch.uint8, pin_memory=True)
        return t.numpy(), t.data_ptr()


__all__ = [
    "DriverRuntime",
    "GpuDirect",
    "LeaseError",
    "REGISTER_PIECE_MAX",
    "RegistrationError",
    "Runtime",
    "pieces",
]
