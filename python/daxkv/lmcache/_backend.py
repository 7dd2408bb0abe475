"""``daxkv.lmcache.DaxBackend``: LMCache's non-MP DAX storage plugin over daxkv.

LMCache loads it with its own plugin launcher from the configuration a user
writes (python/README.md)::

    storage_plugins: ["dax"]
    extra_config:
      storage_plugin.dax.module_path: daxkv.lmcache
      storage_plugin.dax.class_name: DaxBackend
      dax.device_path: /dev/dax0.0
      dax.max_dax_size: 64          # GiB (older configs: dax.arena_size_gb)

It keeps the surface and the behaviour of LMCache's own
``lmcache.v1.storage_backend.plugins.dax_backend.DaxBackend``
(docs/lmcache-dax-behavior.md §6): the same constructor checks in the same
order and words, the same API mapping, optional async puts through the event
loop, restores serialized on one ``dax-restore-dispatch`` thread. The slots,
the copies and the batched restore are daxkv's (``daxkv._daxkv.DaxStore``):

- a put copies each object into its slot in Rust with the GIL released
  (non-temporal stores), a whole batch per call; a batch of 2 MiB or more
  that fits the free slots is shared by ``dax.restore_workers`` threads;
- a restore reserves the keys (read pins: a key removed meanwhile keeps its
  slot until the restore ends), allocates the outputs through LMCache's
  ``local_cpu_backend`` grouped by (shape, dtype, fmt) as upstream does,
  then copies from the device straight into them with the GIL released,
  sorted by device offset, in regions of at most
  ``dax.retrieve_staging_slab_bytes / dax.restore_max_regions`` bytes, at
  most ``min(dax.restore_workers, dax.restore_max_regions)`` at a time
  (streaming stores for a batch of 16 MiB or more). There is no staging
  copy: outputs are CPU memory, so the slab upstream copies through would
  only double the traffic; its size is still validated and bounds each
  region.

Each object's (shape, dtype, fmt) is interned here and stored with its
payload as a 31-bit tag; ``cached_positions``, when set, are kept by the
Rust store next to the slot (see python/src/store.rs).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

import torch
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from .._daxkv import DaxStore

if TYPE_CHECKING:
    from concurrent.futures import Future

    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

logger = init_logger(__name__)

__all__ = ["DaxBackend"]

#: ``DaxStore.put_batch`` outcome: copied and committed.
_PUT_STORED = 0

_NO_SLOTS = "No free slots available; eviction required"

#: Largest (shape, dtype, fmt) id: bit 31 of a tag is the store's.
_META_IDS_MAX = 1 << 31


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if value is None:
        return False
    return str(value).strip().lower() in {"true", "1", "yes", "on"}


def _positive_int(extra: dict[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    try:
        parsed = int(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"extra_config['{key}'] must be a positive integer") from exc
    if parsed <= 0:
        raise ValueError(f"extra_config['{key}'] must be a positive integer")
    return parsed


class DaxBackend(StoragePluginInterface):
    """LMCache non-MP storage plugin keeping KV chunks in a DAX device
    (or a file / memfd standing in for one), over daxkv's Rust store."""

    def __init__(
        self,
        config: Optional[LMCacheEngineConfig] = None,
        metadata: Optional[LMCacheMetadata] = None,
        local_cpu_backend: Optional[LocalCPUBackend] = None,
        loop: Optional[asyncio.AbstractEventLoop] = None,
        dst_device: str = "cpu",
    ) -> None:
        """Validate the configuration (LMCache's order and wording), map the
        device and get ready to restore.

        Raises:
            ValueError: missing config, metadata, ``local_cpu_backend`` or
                ``dax.device_path``; TP > 1; more than one KV group; a size
                or restore setting that is not a positive number.
            RuntimeError: the device cannot be opened, or is smaller than
                ``dax.max_dax_size`` (upstream's type and words; a missing or
                too small device is ``daxkv.DaxConfigError``, a ValueError
                too: the caller's fault).
        """
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        # Set first: close() (and __del__ paths) must work on a half-built one.
        self._close_lock = threading.Lock()
        self._pid = os.getpid()
        self._closing = False
        self._closed = False
        self._store: Optional[DaxStore] = None
        self._restore_dispatch_executor: Optional[ThreadPoolExecutor] = None

        if self.config is None:
            raise ValueError("DaxBackend requires config")
        if self.metadata is None:
            raise ValueError("DaxBackend requires metadata")
        if self.metadata.world_size != 1:
            raise ValueError(
                "DaxBackend currently only supports TP=1 "
                f"(world_size={self.metadata.world_size})"
            )
        if self.metadata.get_num_groups() != 1:
            raise ValueError("DaxBackend currently supports only single-group KV layout")

        extra = self.config.extra_config or {}
        self.device_path = str(extra.get("dax.device_path", "")).strip()
        if not self.device_path:
            raise ValueError("extra_config['dax.device_path'] is required")

        self.async_put = _to_bool(extra.get("dax.async_put", False))
        if self.async_put and self.loop is None:
            raise ValueError("DaxBackend async_put=true requires an asyncio event loop")

        # `dax.arena_size_gb` is the older name of the same setting.
        size = extra.get("dax.max_dax_size", extra.get("dax.arena_size_gb", 0))
        self.max_dax_size = float(size)
        if self.max_dax_size <= 0:
            raise ValueError("extra_config['dax.max_dax_size'] must be > 0")

        if self.local_cpu_backend is None:
            raise ValueError("DaxBackend requires local_cpu_backend")

        self.slot_bytes = max(1, int(self.local_cpu_backend.get_full_chunk_size_bytes()))

        # The restore settings are checked after the device is opened (as
        # upstream: a bad device is reported first), but the store needs
        # them to open: parse now, raise later.
        tuning_error: Optional[ValueError] = None
        workers = regions = slab = 0
        try:
            workers = _positive_int(
                extra, "dax.restore_workers", min(8, max(1, os.cpu_count() or 1))
            )
            regions = _positive_int(extra, "dax.restore_max_regions", workers)
            slab = _positive_int(
                extra,
                "dax.retrieve_staging_slab_bytes",
                max(256 * 1024 * 1024, regions * self.slot_bytes),
            )
            min_slab = regions * self.slot_bytes
            if slab < min_slab:
                raise ValueError(
                    "extra_config['dax.retrieve_staging_slab_bytes'] must be at "
                    f"least {min_slab} bytes"
                )
            if slab // regions < self.slot_bytes:
                raise ValueError(
                    "dax.retrieve_staging_slab_bytes does not leave enough space "
                    "per restore region for one full chunk"
                )
        except ValueError as exc:
            tuning_error = exc
            workers = regions = 1
            slab = self.slot_bytes

        # Raises RuntimeError / ValueError with nothing left open.
        self._store = DaxStore(
            self.device_path,
            int(self.max_dax_size * 1024**3),
            self.slot_bytes,
            restore_workers=workers,
            restore_max_regions=regions,
            staging_slab_bytes=slab,
        )
        try:
            if tuning_error is not None:
                raise tuning_error
            self._restore_workers = workers
            self._restore_max_regions = regions
            self._retrieve_staging_slab_bytes = slab
            self._restore_region_bytes = slab // regions
            self._arena_bytes = self._store.arena_bytes
            self._max_slots = self._store.max_slots
            # (shape, dtype, fmt) interned: the id is the tag stored with
            # each payload. Ids only grow (one per distinct chunk layout).
            self._meta_lock = threading.Lock()
            self._metas: list[tuple[torch.Size, torch.dtype, MemoryFormat]] = []
            self._meta_ids: dict[tuple[Any, ...], int] = {}
            self._restore_dispatch_executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="dax-restore-dispatch"
            )
        except BaseException:
            self._release_restore_resources()
            self._store.close()
            raise

        logger.info(
            "daxkv DaxBackend init: device=%s dax_size=%d slot=%d max_slots=%d "
            "restore_workers=%d restore_regions=%d region_bytes=%d",
            self.device_path,
            self._arena_bytes,
            self.slot_bytes,
            self._max_slots,
            self._restore_workers,
            self._restore_max_regions,
            self._restore_region_bytes,
        )

    def __str__(self) -> str:
        return "DaxBackend"

    # ----- lookups, pins, removal -----

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        """Whether ``key`` is committed; with ``pin``, a hit is also pinned."""
        return self._store_or_closed().contains(key, pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        """Whether a put of ``key`` is in flight."""
        return self._store_or_closed().has_inflight(key)

    def pin(self, key: CacheEngineKey) -> bool:
        """Pin (refcounted) if present; returns whether it is present."""
        return self._store_or_closed().pin(key)

    def unpin(self, key: CacheEngineKey) -> bool:
        """Drop one pin; returns whether the key still exists."""
        return self._store_or_closed().unpin(key)

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """Remove ``key``. ``force`` (the default) also removes a pinned key
        and cancels an in-flight put; a restore reading it keeps its bytes."""
        return self._store_or_closed().remove(key, force)

    def batched_remove(self, keys: list[CacheEngineKey], force: bool = True) -> int:
        """Remove many; returns how many were removed."""
        return self._store_or_closed().remove_many(keys, force)

    def batched_contains(self, keys: List[CacheEngineKey], pin: bool = False) -> int:
        """Number of consecutive hits from the start; pins each if asked."""
        return self._store_or_closed().batched_contains(keys, pin)

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        """:meth:`batched_contains` for the async lookup path."""
        del lookup_id
        return self.batched_contains(keys, pin=pin)

    # ----- puts -----

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: List[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Optional[Callable[[CacheEngineKey], None]] = None,
    ) -> Optional[List[Future]]:
        """Store ``objs[i]`` under ``keys[i]``.

        Per key, in order: a multi-tensor object is skipped (logged); an
        object larger than a slot raises ValueError (the keys before it are
        stored); a key already stored or in flight is skipped without a
        callback. With ``dax.async_put`` and a running loop each put runs on
        a thread through the loop, the object referenced until its copy is
        done, and the futures are returned. Otherwise the batch is copied
        now; a full arena raises RuntimeError ("No free slots available…")
        after the keys before it were stored. ``on_complete_callback(key)``
        runs for each key stored.
        """
        del transfer_spec
        if len(keys) != len(objs):
            raise ValueError(
                "keys and objs must have the same length, "
                f"got {len(keys)} and {len(objs)}"
            )
        if self._is_closed_or_closing():
            raise RuntimeError("DaxBackend is closing")
        store = self._store_or_closed()
        loop = self.loop
        use_async = self.async_put and loop is not None and loop.is_running()

        futures: list[Future] = []
        batch_keys: list[CacheEngineKey] = []
        bufs: list[Any] = []
        tags: list[int] = []
        positions: list[Any] = []
        error: Optional[BaseException] = None
        for key, obj in zip(keys, objs, strict=True):
            num_shapes = len(obj.get_shapes())
            if num_shapes > 1:
                logger.error(
                    "DaxBackend does not support multi-tensor allocations: "
                    "key=%s has %d tensors. "
                    "Use single-tensor format or extend metadata.",
                    key,
                    num_shapes,
                )
                continue
            size = int(obj.get_size())
            if size > self.slot_bytes:
                error = ValueError(
                    f"DaxBackend: object size {size} for key {key} "
                    f"exceeds slot size {self.slot_bytes}"
                )
                break
            if use_async:
                assert loop is not None
                if store.contains(key) or store.has_inflight(key):
                    continue
                obj.ref_count_up()
                try:
                    future = asyncio.run_coroutine_threadsafe(
                        self._submit_write(key, obj, on_complete_callback), loop
                    )
                except BaseException:
                    obj.ref_count_down()
                    raise
                futures.append(future)
                continue
            tag, pos = self._tag_of(obj)
            batch_keys.append(key)
            bufs.append(obj)
            tags.append(tag)
            positions.append(pos)

        if batch_keys:
            codes, full_at = store.put_batch(batch_keys, bufs, tags, positions)
            for key, code in zip(batch_keys, codes):
                if code == _PUT_STORED:
                    self._invoke_on_complete_callback(key, on_complete_callback)
            if full_at >= 0:
                raise RuntimeError(_NO_SLOTS)
        if error is not None:
            raise error
        return futures or None

    async def _submit_write(
        self,
        key: CacheEngineKey,
        memory_obj: MemoryObj,
        on_complete_callback: Optional[Callable[[CacheEngineKey], None]],
    ) -> None:
        try:
            committed = await asyncio.to_thread(self._put_one, key, memory_obj)
            if committed:
                self._invoke_on_complete_callback(key, on_complete_callback)
        finally:
            memory_obj.ref_count_down()

    def _put_one(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        """One put (upstream's ``put_one``): True when stored; a full arena
        raises; closing or an existing key gives False."""
        tag, pos = self._tag_of(obj)
        codes, full_at = self._store_or_closed().put_batch(
            [key], [obj], [tag], [pos]
        )
        if full_at >= 0:
            raise RuntimeError(_NO_SLOTS)
        return codes[0] == _PUT_STORED

    def _tag_of(self, obj: MemoryObj) -> tuple[int, Optional[torch.Tensor]]:
        meta = obj.metadata
        return self._meta_id(meta.shape, meta.dtype, meta.fmt), meta.cached_positions

    def _meta_id(self, shape: torch.Size, dtype: torch.dtype, fmt: MemoryFormat) -> int:
        k = (tuple(shape), dtype, fmt)
        mid = self._meta_ids.get(k)
        if mid is None:
            with self._meta_lock:
                mid = self._meta_ids.get(k)
                if mid is None:
                    mid = len(self._metas)
                    if mid >= _META_IDS_MAX:
                        raise RuntimeError("DaxBackend: too many distinct chunk layouts")
                    # Appended before it is published in the dict: a reader
                    # holding an id always finds its entry.
                    self._metas.append((torch.Size(shape), dtype, fmt))
                    self._meta_ids[k] = mid
        return mid

    # ----- gets -----

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        """Load one key into a CPU object from ``local_cpu_backend`` (its
        stored shape, dtype and fmt). None on a miss, after close, or if the
        allocator has no memory. A failed copy releases the object and
        raises; the key stays."""
        if self._is_closed_or_closing():
            return None
        store = self._store
        if store is None:
            return None
        lcb = self.local_cpu_backend
        assert lcb is not None
        out: list[MemoryObj] = []

        def alloc(hits: list[tuple[int, int, int]]) -> Optional[list[Any]]:
            ((_, tag, _),) = hits
            shape, dtype, fmt = self._metas[tag]
            obj = lcb.allocate(shape, dtype, fmt)
            if obj is None:
                return None
            out.append(obj)
            return [obj]

        try:
            positions = store.restore([key], False, alloc)
        except BaseException:
            for obj in out:
                obj.ref_count_down()
            raise
        if not positions or not out:
            for obj in out:
                obj.ref_count_down()
            return None
        obj = out[0]
        obj.metadata.cached_positions = positions[0]
        return obj

    def batched_get_blocking(
        self, keys: List[CacheEngineKey]
    ) -> List[Optional[MemoryObj]]:
        """Restore a batch on the dispatch thread: a list aligned with
        ``keys``, None for a key that missed. ``[]`` if empty or closing."""
        if not keys or self._is_closed_or_closing():
            return []
        executor = self._restore_dispatch_executor
        if executor is None:
            raise RuntimeError("DaxBackend restore dispatch executor is not available")
        batch = list(keys)
        if threading.current_thread().name.startswith("dax-restore-dispatch"):
            return self._restore_batch(batch, False)
        return executor.submit(self._restore_batch, batch, False).result()

    async def batched_get_non_blocking(
        self,
        lookup_id: str,
        keys: list[CacheEngineKey],
        transfer_spec: Any = None,
    ) -> list[MemoryObj]:
        """The same on the dispatch thread through the running loop, but
        only the consecutive hit prefix."""
        del lookup_id, transfer_spec
        if not keys or self._is_closed_or_closing():
            return []
        executor = self._restore_dispatch_executor
        if executor is None:
            raise RuntimeError("DaxBackend restore dispatch executor is not available")
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(executor, self._restore_batch, list(keys), True)
        return [obj for obj in result if obj is not None]

    def _restore_batch(
        self, keys: list[CacheEngineKey], prefix_only: bool
    ) -> list[Optional[MemoryObj]]:
        store = self._store
        results: list[Optional[MemoryObj]] = [None] * len(keys)
        if store is None:
            return [] if prefix_only else results
        outs: list[MemoryObj] = []
        index: list[int] = []

        def alloc(hits: list[tuple[int, int, int]]) -> list[Any]:
            index.extend(h[0] for h in hits)
            outs.extend(self._allocate_restore_outputs(hits))
            return outs

        try:
            positions = store.restore(keys, prefix_only, alloc)
        except BaseException:
            for obj in outs:
                obj.ref_count_down()
            raise
        if not positions:
            return [] if prefix_only else results
        for i, obj, pos in zip(index, outs, positions, strict=True):
            obj.metadata.cached_positions = pos
            results[i] = obj
        if prefix_only:
            return list(outs)
        return results

    def _allocate_restore_outputs(self, hits: list[tuple[int, int, int]]) -> list[MemoryObj]:
        """One CPU object per hit, grouped by (shape, dtype, fmt) with
        ``batched_allocate`` for groups of several (per-object fallback),
        as upstream. All or nothing: a failure releases what was taken."""
        lcb = self.local_cpu_backend
        assert lcb is not None
        groups: OrderedDict[int, list[int]] = OrderedDict()
        for j, (_, tag, _) in enumerate(hits):
            groups.setdefault(tag, []).append(j)
        objs: list[Optional[MemoryObj]] = [None] * len(hits)
        taken: list[MemoryObj] = []
        try:
            for tag, js in groups.items():
                shape, dtype, fmt = self._metas[tag]
                outputs: Optional[list[MemoryObj]] = None
                if len(js) > 1:
                    outputs = lcb.batched_allocate(shape, dtype, len(js), fmt)
                    if outputs is not None:
                        taken.extend(outputs)
                if outputs is None:
                    outputs = []
                    for _ in js:
                        obj = lcb.allocate(shape, dtype, fmt)
                        if obj is None:
                            raise RuntimeError("DaxBackend batched restore allocation failed")
                        taken.append(obj)
                        outputs.append(obj)
                for j, obj in zip(js, outputs, strict=True):
                    objs[j] = obj
        except BaseException:
            for obj in taken:
                obj.ref_count_down()
            raise
        return [obj for obj in objs if obj is not None]

    # ----- the rest of the interface -----

    def get_allocator_backend(self) -> LocalCPUBackend:
        """The CPU allocator restores allocate from."""
        if self.local_cpu_backend is None:
            raise RuntimeError("DaxBackend has no allocator backend available")
        return self.local_cpu_backend

    def close(self) -> None:
        """Stop restores (waiting for the one running), then close the
        store: it refuses new work, waits for in-flight puts and gets, unmaps
        and closes the device. Idempotent; afterwards gets return None and
        puts raise "DaxBackend is closing"."""
        if os.getpid() != self._pid:
            # A forked child: the store, its threads and the restore thread
            # are the parent's (the store's calls raise RuntimeError here).
            return
        with self._close_lock:
            if self._closed:
                return
            self._closing = True
        self._release_restore_resources()
        if self._store is not None:
            self._store.close()
        with self._close_lock:
            self._closed = True

    def status(self) -> dict[str, Any]:
        """The store's slot counters (``live_slot_count``,
        ``locked_key_count``, ``borrowed_slot_count``, …)."""
        store = self._store
        return {"closing": True} if store is None else store.status()

    # ----- helpers -----

    def _store_or_closed(self) -> DaxStore:
        store = self._store
        if store is None:
            raise RuntimeError("DaxBackend is closing")
        return store

    def _is_closed_or_closing(self) -> bool:
        with self._close_lock:
            return self._closing or self._closed

    def _release_restore_resources(self) -> None:
        executor = self._restore_dispatch_executor
        self._restore_dispatch_executor = None
        if executor is not None:
            executor.shutdown(wait=True)

    @staticmethod
    def _invoke_on_complete_callback(
        key: CacheEngineKey,
        on_complete_callback: Optional[Callable[[CacheEngineKey], None]],
    ) -> None:
        if on_complete_callback is None:
            return
        try:
            on_complete_callback(key)
        except Exception as exc:
            logger.warning("on_complete_callback failed for key %s: %s", key, exc)
