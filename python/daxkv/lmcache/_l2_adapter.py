"""``daxkv.lmcache.DaxL2Adapter``: LMCache's ``plugin`` path over the daxkv engine.

A subclass of LMCache's ``L2AdapterInterface`` (docs/lmcache-dax-behavior.md
§1, §7.2), loaded by LMCache's own factory from::

    --l2-adapter '{"type": "plugin", "module_path": "daxkv.lmcache",
                   "class_name": "DaxL2Adapter",
                   "adapter_params": {"slot_bytes": 2097152,
                                      "device_path": "/dev/dax0.0",
                                      "max_dax_size_gb": 64}}'

The factory finds the config class by convention (``DaxL2AdapterConfig``),
builds it from ``adapter_params`` (the keys of LMCache's built-in ``dax``
adapter) and calls ``DaxL2Adapter(config, l1_memory_desc=...)``.

Everything that waits, copies or touches a device runs in Rust
(``daxkv._daxkv.DaxL2Core``, python/src/l2.rs) with the GIL released; this
class converts results to LMCache's types and tells the listeners through
the base class's ``_notify_*`` helpers (which keep the per-salt byte
counters). The store, lookup and load eventfds are the engine's own.

This module imports LMCache; ``import daxkv`` does not.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable, Optional

from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.distributed.l2_adapters.reconfiguration import L2ReconfigureError

try:  # LMCache 0.5.x
    from lmcache.lmcache_native import Bitmap
except ImportError:  # pragma: no cover - later layouts
    from lmcache.native_storage_ops import Bitmap  # type: ignore[no-redef]

from lmcache.logging import init_logger

from daxkv._daxkv import DaxL2Core

__all__ = ["DaxL2Adapter", "DaxL2AdapterConfig"]

# LMCache's own logger setup, so the line below shows in `lmcache server`'s
# log as its built-in adapters' lines do.
logger = init_logger(__name__)

_FAULT_INJECT_MODULE = "lmcache.v1.distributed.l2_adapters.fault_inject_l2_adapter"


class DaxL2AdapterConfig(L2AdapterConfigBase):
    """The ``adapter_params`` of the plugin JSON: the engine's config keys.

    Those of LMCache's ``dax`` adapter (``slot_bytes``, ``devices`` or
    ``device_path`` / ``max_dax_size_gb``, ``hotplug_enabled``, worker
    counts) plus daxkv's own (``task_slots``, ``spin_us``, ``signal``, ...;
    python/README.md). ``from_dict`` validates them without opening
    anything: a bad value raises ``ValueError`` naming the field.
    """

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.params: dict[str, Any] = dict(params)

    @classmethod
    def from_dict(cls, d: dict) -> "DaxL2AdapterConfig":
        if not isinstance(d, Mapping):
            raise ValueError("adapter_params must be a JSON object")
        params = dict(d)
        DaxL2Core.check_config(**params)
        return cls(params)

    @classmethod
    def help(cls) -> str:
        return (
            "daxkv plugin L2 adapter (module_path daxkv.lmcache, class_name "
            "DaxL2Adapter); adapter_params takes LMCache's dax adapter keys:\n"
            "- slot_bytes (int, required): bytes per slot (the largest chunk)\n"
            "- device_path (str) and max_dax_size_gb (float), or devices "
            "([{device_path, max_dax_size_gb}]); device_path 'memfd' maps "
            "anonymous memory\n"
            "- hotplug_enabled (bool): runtime add / remove / resize through "
            "/reconfigure/plugin/l2/*\n"
            "- num_store_workers, num_lookup_workers, num_load_workers (int)\n"
            "See python/README.md for daxkv's own keys."
        )


def _bitmap(n: int, hits: list[int]) -> Bitmap:
    bm = Bitmap(n)
    if hits:
        batched = getattr(bm, "batched_set", None)
        if batched is not None:
            batched(hits)
        else:  # pragma: no cover - older Bitmap
            for i in hits:
                bm.set(i)
    return bm


def _spans(objects: Any) -> Optional[list]:
    """Per ``MemoryObj``: ``(obj, raw_data, data_ptr(), nbytes, is_cpu,
    is_cpu and is_contiguous(), get_size())``, each read once: the reads
    the core makes of an object, done here because the interpreter's
    attribute caches and method calls make them cheaper than the C API's
    ``PyObject_GetAttr`` and bound-method calls from Rust
    (docs/performance.md, "The plugin path's submit"). The core decides
    from these values alone, without reading the object again: a view, or
    the error the unread path gives. An object one of whose reads raises
    (not a ``MemoryObj``: a plain buffer) is passed as ``(obj,)``, and the
    core reads it itself, from the start (that object is read twice).
    ``None`` for anything but a list: the core then reads each object
    itself (and names what is wrong with one)."""
    if type(objects) is not list:
        return None
    out = []
    add = out.append
    for o in objects:
        try:
            t = o.raw_data
            cpu = t.is_cpu
            add((o, t, t.data_ptr(), t.nbytes, cpu, cpu and t.is_contiguous(), o.get_size()))
        except Exception:
            add((o,))
    return out


def _message(body: Any) -> str:
    if isinstance(body, dict):
        for field in ("error", "reason"):
            if isinstance(body.get(field), str):
                return body[field]
    return str(body)


def _log_init(core: DaxL2Core) -> None:
    """One INFO line naming daxkv in the server's log: the devices, the slot
    size, hotplug, and daxkv's own HTTP address if there is one."""
    status = core.status()
    devices = ", ".join(
        f"{d.get('device_path')} ({d.get('max_dax_size_bytes', 0) >> 20} MiB)"
        for d in status.get("devices", [])
    )
    logger.info(
        "daxkv DaxL2Adapter init: devices=%s slot_bytes=%d hotplug=%s http=%s",
        f"[{devices}]" if devices else "none",
        core.slot_bytes,
        "on" if core.hotplug_enabled else "off",
        core.http_address or "off",
    )


def _expose_through_fault_inject() -> None:
    """Let LMCache's storage manager reach a ``DaxL2Adapter`` wrapped by
    ``fault_inject``.

    The storage manager unwraps one ``inner_adapter`` level to find
    ``reconfigure`` / ``owns_device`` (the serde wrapper has it); LMCache
    0.5.6's ``FaultInjectL2Adapter`` keeps its inner adapter as ``_inner``
    and has no such attribute, so a wrapped adapter's hotplug routes and
    device-ownership checks vanish. This adds a read-only ``inner_adapter``
    to that class, only if it has none, and only answering for a daxkv
    adapter (``None`` for any other inner adapter, as before: getattr's
    default), so LMCache's behaviour for its own adapters is unchanged.
    Called when an adapter is built; the fault_inject factory imports its
    module before it builds the inner adapter, so a wrapper built later
    sees the property.
    """
    mod = sys.modules.get(_FAULT_INJECT_MODULE)
    cls = getattr(mod, "FaultInjectL2Adapter", None) if mod is not None else None
    if cls is None or hasattr(cls, "inner_adapter"):
        return

    def inner_adapter(self: Any) -> Optional["DaxL2Adapter"]:
        inner = getattr(self, "_inner", None)
        return inner if isinstance(inner, DaxL2Adapter) else None

    cls.inner_adapter = property(
        inner_adapter,
        doc="The wrapped adapter when it is a daxkv DaxL2Adapter (added by daxkv.lmcache).",
    )


class DaxL2Adapter(L2AdapterInterface):
    """LMCache MP L2 adapter over the daxkv engine (full parity with ``dax``).

    - three distinct non-blocking eventfds (the engine's store, lookup and
      load fds), ``-1`` after ``close()`` (which closes them);
    - lookup locks held in the engine: ``delete`` and eviction skip a locked
      key until ``submit_unlock``; results are ``Bitmap`` s, one-shot;
    - slot-based ``get_usage`` (per-salt bytes from the base counters),
      ``delete`` with listener events, ``report_status``;
    - ``reconfigure_status()`` / ``reconfigure(op, payload, *,
      device_owners=None)``: upstream's envelope and status codes (add,
      remove, resize, status), and ``owns_device(path)``.
    """

    #: The factory's third way to find the config class.
    config_class_name = "DaxL2AdapterConfig"

    def __init__(
        self, config: "DaxL2AdapterConfig | Mapping[str, Any] | None" = None, **kwargs: Any
    ) -> None:
        """``config``: a ``DaxL2AdapterConfig`` or the params dict. Other
        keywords (``l1_memory_desc``) are accepted and ignored: the engine
        copies into any buffer it is given."""
        if config is None:
            params: dict[str, Any] = {}
        elif isinstance(config, DaxL2AdapterConfig):
            params = dict(config.params)
        elif isinstance(config, Mapping):
            params = dict(config)
        else:
            raise TypeError(
                "DaxL2Adapter(config): a DaxL2AdapterConfig or a dict of adapter params, "
                f"got {type(config).__name__}"
            )
        core = DaxL2Core(**params)
        _, capacity = core.usage()
        super().__init__(max_capacity_bytes=capacity)
        self._core = core
        self._slot_bytes: int = core.slot_bytes
        self._hotplug_enabled: bool = core.hotplug_enabled
        # Results taken from the core and not yet returned to the caller
        # (a listener raised while they were being told): returned by the
        # next call, never lost. One lock per kind: the store and prefetch
        # controllers never wait on each other.
        self._store_lock = threading.RLock()
        self._stores_kept: dict[int, L2StoreResult] = {}
        #: Keys the core reported deleted, "deleted" not yet told.
        self._deleted_untold: list = []
        #: ``(keys, sizes)`` collected, "stored" not yet told (a delete
        #: listener raised first), and the tickets they hold back.
        self._stored_untold: list = []
        self._tickets: list[int] = []
        #: Frames telling "deleted" events now (a listener's re-entrant
        #: collection keeps its "stored" events for the outer frame).
        self._telling_deleted = 0
        #: One ``L2StoreResult`` per value (immutable ints).
        self._results: dict[int, L2StoreResult] = {}
        self._load_lock = threading.RLock()
        self._loads_kept: dict[int, Bitmap] = {}
        self._pid = os.getpid()
        _expose_through_fault_inject()
        _log_init(core)

    def _not_forked(self) -> None:
        # Before taking this class's own locks: a parent thread may have
        # held one at fork(), and the core raises only once reached.
        if os.getpid() != self._pid:
            self._core.event_fds()  # raises the core's RuntimeError (a fork)

    # -- event fds ------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._core.event_fds()[0]

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._core.event_fds()[1]

    def get_load_event_fd(self) -> int:
        return self._core.event_fds()[2]

    # -- store ----------------------------------------------------------------

    def submit_store_task(self, keys: list, objects: list) -> int:
        return self._core.submit_store(keys, objects, _spans(objects))

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        """Every store finished since the last call, each once.

        The results are kept here before any listener is told: if a listener
        raises, the exception propagates, the results stay for the next
        call, and the store eventfd is written again so a poller (LMCache's
        store controller) makes that call. Each event is told at most once:
        a raising listener's followers miss that call's event."""
        self._not_forked()
        with self._store_lock:
            # One call into the core: the stores finished and the keys
            # deleted since the last call, each once.
            ticket, done, keys, sizes, deleted = self._core.pop_completed_stores()
            if deleted:
                self._deleted_untold += deleted
            if ticket:
                self._tickets.append(ticket)
            kept = self._stores_kept
            results = self._results
            for task_id, ok, nbytes in done:
                # L2StoreResult is an immutable int: one object per value.
                value = nbytes if ok else -1
                r = results.get(value)
                if r is None:
                    if len(results) > 64:
                        results.clear()
                    r = results[value] = L2StoreResult(ok, nbytes)
                kept[task_id] = r
            # The tasks' keys the engine holds (those of a failed task that
            # did go in too); a re-stored key has size 0, so the byte
            # counters count each slot once (sizes None: all first stores).
            if keys:
                self._stored_untold.append((keys, sizes))
            # Inside a "deleted" listener (re-entrant): the outer frame
            # tells these, after its deletes.
            if (self._deleted_untold or self._stored_untold or self._tickets) and (
                not self._telling_deleted
            ):
                self._tell_stores()
            # Read again: a listener may have collected these (re-entrant;
            # the lock is an RLock), and each result is returned once.
            out, self._stores_kept = self._stores_kept, {}
        return out

    def _tell_stores(self) -> None:
        """Tell the "deleted" events due, then the "stored" ones, each taken
        out before it is told (told at most once). Deletes first: each
        is of a key whose "stored" was told in an earlier call (the core
        hands a delete out only then), and a key deleted and stored again
        must reach LMCache's eviction policy as deleted, then stored (the
        other order drops a key the engine holds). One "stored" event for
        every task collected: the base class's per-call cost (its lock, an
        Event, the listener calls) once per call, not once per task (1.7 µs
        a 16-key task at 4 KiB: docs/performance.md, "The plugin path's
        submit"); it counts the bytes before it calls the listeners."""
        while True:
            self._tell_stores_once()
            # Reporting the tickets may have released deletes waiting for
            # those "stored" events: tell them now, not at some later call
            # (nothing else would signal them).
            if not self._deleted_untold:
                return

    def _tell_deleted(self) -> None:
        """Tell the "deleted" events due, until none is: a listener's
        re-entrant call may add more. While they are told, a re-entrant
        collection keeps its "stored" events (`_telling_deleted`): told
        there, a new copy's "stored" would reach the listeners after this
        one and before the rest, ahead of its old copy's "deleted"
        (LMCache's LRU would then drop a key the engine holds)."""
        while self._deleted_untold:
            gone, self._deleted_untold = self._deleted_untold, []
            self._telling_deleted += 1
            try:
                self._notify_keys_deleted(gone, [self._slot_bytes] * len(gone))
            finally:
                self._telling_deleted -= 1

    def _tell_stores_once(self) -> None:
        # The tickets of the events this call tells, taken out with them:
        # a listener's re-entrant call must not report them before every
        # listener has heard them (then a delete of those keys could be
        # told first).
        tickets: list[int] = []
        try:
            self._tell_deleted()
            if self._stored_untold:
                told, self._stored_untold = self._stored_untold, []
                tickets, self._tickets = self._tickets, []
                slot = self._slot_bytes
                if len(told) == 1:
                    keys, sizes = told[0]
                    if sizes is None:
                        sizes = [slot] * len(keys)
                else:
                    keys, sizes = [], []
                    for k, z in told:
                        keys += k
                        sizes += [slot] * len(k) if z is None else z
                self._notify_keys_stored(keys, sizes)
        except BaseException:
            self._core.resignal("store")
            raise
        finally:
            # Told (or lost to a raising listener): deletes of those keys
            # may be handed out now (python/src/l2/known.rs), and the core
            # hands back those due. Tickets with no event waiting (their
            # tasks held no key) go too; stored events kept back by a
            # raising delete listener keep theirs. On a raise, deletes due
            # wait in `_deleted_untold` for the next call (the store fd is
            # written above).
            if not self._stored_untold:
                tickets, self._tickets = tickets + self._tickets, []
            for t in tickets:
                due = self._core.stored_reported(t)
                if due:
                    self._deleted_untold += due

    # -- lookup and lock ------------------------------------------------------

    def submit_lookup_and_lock_task(self, keys: list, *layout: Any, **kw: Any) -> int:
        """Look up and lock, on this thread (index work only, GIL
        released): the result is ready when this returns and the lookup fd
        is written, so no worker wakes for it. The second argument (a
        ``MemoryLayoutDesc`` or the ``group_layout_descs`` dict, by LMCache
        version) is advisory and ignored: the engine needs no layout."""
        return self._core.submit_lookup(keys)

    def query_lookup_and_lock_result(self, task_id: int) -> Optional[Bitmap]:
        r = self._core.query_lookup(task_id)
        if r is None:
            return None
        n, hits = r
        return _bitmap(n, hits)

    def submit_unlock(self, keys: list) -> None:
        self._core.submit_unlock(keys)

    # -- load -----------------------------------------------------------------

    def submit_load_task(self, keys: list, objects: list) -> int:
        return self._core.submit_load(keys, objects, _spans(objects))

    def query_load_result(self, task_id: int) -> Optional[Bitmap]:
        """A finished load's bitmap, once. Kept before the listeners are
        told: if one raises, the exception propagates, the bitmap is
        returned by the next call for this id, and the load eventfd is
        written again so a poller (LMCache's prefetch controller) asks."""
        self._not_forked()
        with self._load_lock:
            kept = self._loads_kept.pop(task_id, None)
            if kept is not None:
                return kept
            r = self._core.query_load(task_id)
            if r is None:
                return None
            n, hits, loaded = r
            bm = _bitmap(n, hits)
            if loaded:
                self._loads_kept[task_id] = bm
                try:
                    self._notify_keys_accessed(loaded)
                except BaseException:
                    self._core.resignal("load")
                    raise
                # Not `del`: a listener may have asked for this task again
                # (re-entrant, the lock is an RLock) and taken it already.
                self._loads_kept.pop(task_id, None)
            return bm

    # -- eviction, usage, status ------------------------------------------------

    @property
    def supports_global_eviction(self) -> bool:
        # Upstream decides at build time from the configured capacity, so a
        # server started with hotplug only never evicts (reference §3.2
        # quirk); capacity added later counts here.
        return self._max_capacity_bytes > 0 or self._hotplug_enabled

    def delete(self, keys: list) -> None:
        """Delete the keys no lookup holds locked (locked and unknown keys
        are skipped), then report every key deleted since the last report."""
        if not keys or self._core.closed:
            return
        self._core.delete(keys)
        self._report_deleted()

    def _report_deleted(self) -> None:
        """Tell the keys the engine deleted (this adapter's delete, a hotplug
        evict, a forced shrink), each once, with the size it was counted
        at: taken and told under the store lock, as a collection tells
        its events. Taken here but told after another thread's collection
        told the key's new copy "stored", the old copy's "deleted" would
        reach LMCache's LRU last, which would drop a key the engine holds
        (test_l2_collect.py, the `delete_racing` tests). Only "deleted"
        events: "stored" events kept back by a raising listener wait for
        the store controller's next collection (the store fd was written
        for it), so no "stored" listener runs on the deleting thread
        (LMCache's eviction thread, which does not survive an exception);
        deletes that collection releases, it tells too."""
        # A forked child: raise (the core's error) before the lock, which a
        # parent's thread may have held at fork().
        self._not_forked()
        with self._store_lock:
            deleted = self._core.take_deleted()
            if deleted:
                self._deleted_untold += deleted
            try:
                self._tell_deleted()
            finally:
                # "stored" events a listener's re-entrant collection kept
                # (above): the store controller's next call tells them.
                if self._stored_untold and not self._telling_deleted:
                    self._core.resignal("store")

    def get_usage(self) -> AdapterUsage:
        used, capacity = self._core.usage()
        base = super().get_usage()
        return AdapterUsage(
            total_bytes_used=used,
            total_capacity_bytes=capacity,
            bytes_by_cache_salt=MappingProxyType(dict(base.bytes_by_cache_salt)),
        )

    def report_status(self) -> dict:
        status = dict(self._core.status())
        status["is_healthy"] = bool(status.get("is_healthy")) and not self._core.closed
        status["adapter"] = "daxkv.lmcache.DaxL2Adapter"
        return status

    # -- runtime reconfiguration (reference §4) ---------------------------------

    def hotplug_status(self) -> dict:
        return dict(self._core.reconfigure_status()["status"])

    def reconfigure_status(self) -> dict:
        return dict(self._core.reconfigure_status())

    def reconfigure(
        self,
        operation: str,
        payload: dict,
        *,
        device_owners: Optional[Callable[[str], list[str]]] = None,
        **kwargs: Any,
    ) -> dict:
        try:
            code, body = self._core.reconfigure(operation, payload, device_owners)
        finally:
            self._report_deleted()
        if code >= 400:
            raise L2ReconfigureError(code, _message(body), payload=body)
        return body

    def hotplug_add_device(self, device_path: str, size_bytes: int) -> dict:
        return self.reconfigure("add", {"device_path": device_path, "size_bytes": size_bytes})

    def hotplug_remove_device(self, device_path: str, mode: str, force: bool = False) -> dict:
        return self.reconfigure(
            "remove", {"device_path": device_path, "mode": mode, "force": force}
        )

    def hotplug_resize_device(
        self, device_path: str, size_bytes: int, mode: str, force: bool = False
    ) -> dict:
        return self.reconfigure(
            "resize",
            {"device_path": device_path, "size_bytes": size_bytes, "mode": mode, "force": force},
        )

    def owns_device(self, device_path: str) -> bool:
        if not isinstance(device_path, str) or not device_path.strip():
            return False
        return self._core.owns_device(device_path.strip())

    # -- cleanup --------------------------------------------------------------

    def close(self) -> None:
        """Wait for the tasks in flight, close the engine (its three fds and
        its devices). Results already finished stay collectable. Idempotent."""
        self._core.close()

    @property
    def http_address(self) -> Optional[str]:
        """``"host:port"`` of daxkv's ``/metrics`` and ``/health`` server
        (``adapter_params["http"]``), or ``None`` (none asked for, or
        closed)."""
        return self._core.http_address

    def metrics_text(self) -> str:
        """The engine's metrics in the Prometheus text format, every series
        labelled ``l2_name`` (``adapter_params["l2_name"]``, default
        ``"plugin"``, the name LMCache's own L2 metrics carry)."""
        return self._core.metrics_text()

    def pending_tasks(self) -> int:
        """Tasks submitted and not collected (a diagnostic)."""
        return self._core.pending()
