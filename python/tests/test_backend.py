"""``daxkv.lmcache.DaxBackend`` (LMCache non-MP) inside the real
LMCache 0.5.6.

LMCache's own ``storage_plugin_launcher`` builds the backend from an
``LMCacheEngineConfig`` carrying the user's ``storage_plugins`` /
``extra_config``, next to LMCache's real ``LocalCPUBackend`` (its
``MixedMemoryAllocator``), and every object put or restored is one of
LMCache's memory objects. Most scenarios (docs/lmcache-dax-behavior.md
§8.4) run twice: on daxkv's backend and, as the control, on LMCache's
built-in ``DaxBackend``; where the two are reached differently (where a
test holds a copy open) the ``Gate`` helper holds each at the same point
of the protocol: daxkv's copies run in Rust, so a read is held in the
allocation of its outputs (the keys are reserved by then) and a write in
the store's write hook (the key is in flight by then).

No timing assertions: every wait is on an event, with a timeout only as a
hang guard. Skipped when LMCache is not installed.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import pytest

pytest.importorskip("lmcache")
torch = pytest.importorskip("torch")

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObj  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend import storage_plugin_launcher  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.plugins import dax_backend as upstream  # noqa: E402

import daxkv.lmcache  # noqa: E402
from conftest import shm_path  # noqa: E402

CHUNK = 16
#: kv_shape (layers, 2, chunk, heads, head_size) in bf16: one full chunk
#: is 2 * 2 * 16 * 2 * 8 * 2 = 2048 bytes, the slot size.
KV_SHAPE = (2, 2, CHUNK, 2, 8)
SLOT = 2048
HANG_S = 10.0

MODULES = {
    "daxkv": ("daxkv.lmcache", "DaxBackend"),
    "lmcache": ("lmcache.v1.storage_backend.plugins.dax_backend", "DaxBackend"),
}
KINDS = list(MODULES)


# ----- building backends the way LMCache does -----


def metadata(world_size: int = 1) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="m",
        world_size=world_size,
        local_world_size=world_size,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=KV_SHAPE,
        role="worker",
    )


def engine_config(kind: str, extra: dict[str, Any]) -> LMCacheEngineConfig:
    """The configuration a user writes: ``storage_plugins: ["dax"]`` plus
    the plugin's module / class and the ``dax.*`` keys in extra_config."""
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.05,
        lmcache_instance_id=f"test_backend_{kind}",
    )
    module_path, class_name = MODULES[kind]
    cfg.storage_plugins = ["dax"]
    cfg.extra_config = {
        "storage_plugin.dax.module_path": module_path,
        "storage_plugin.dax.class_name": class_name,
        "dax.restore_workers": 2,
        "dax.restore_max_regions": 2,
        "dax.retrieve_staging_slab_bytes": 1 << 20,
        **extra,
    }
    return cfg


class Env:
    """One LMCache engine's pieces: config, metadata, loop, local CPU
    backend, and the DAX backends built over them."""

    def __init__(self, kind: str, path: str) -> None:
        self.kind = kind
        self.path = path
        self.loop = asyncio.new_event_loop()
        self.loop_thread: Optional[threading.Thread] = None
        self.backends: list[Any] = []
        self.lcb: Optional[LocalCPUBackend] = None

    def size_device(self, nbytes: int) -> None:
        with open(self.path, "wb") as f:  # both map an existing file
            f.truncate(nbytes)

    def config(self, slots: int = 64, **extra: Any) -> LMCacheEngineConfig:
        extra.setdefault("dax.device_path", self.path)
        extra.setdefault("dax.max_dax_size", slots * SLOT / 2**30)
        return engine_config(self.kind, extra)

    def local_cpu(self, cfg: LMCacheEngineConfig, md: LMCacheMetadata) -> LocalCPUBackend:
        if self.lcb is None:
            self.lcb = LocalCPUBackend(config=cfg, metadata=md, dst_device="cpu")
        return self.lcb

    def launch(self, slots: int = 64, file_slots: Optional[int] = None, **extra: Any) -> Any:
        """LMCache's ``storage_plugin_launcher`` over a fresh device file of
        ``file_slots`` (default ``slots``) slots."""
        self.size_device((file_slots or slots) * SLOT)
        cfg = self.config(slots, **extra)
        md = metadata()
        backends: collections.OrderedDict[str, Any] = collections.OrderedDict()
        storage_plugin_launcher(cfg, md, self.loop, self.local_cpu(cfg, md), "cpu", backends)
        assert list(backends) == ["dax"], "the launcher logged the failure"
        b = backends["dax"]
        want = daxkv.lmcache.DaxBackend if self.kind == "daxkv" else upstream.DaxBackend
        assert type(b) is want
        self.backends.append(b)
        return b

    def construct(self, slots: int = 64, md: Optional[LMCacheMetadata] = None, lcb: Any = "auto",
                  loop: Any = "auto", **extra: Any) -> Any:
        """The class called directly (for constructor errors: the launcher
        logs them instead of raising)."""
        module_path, class_name = MODULES[self.kind]
        cls = getattr(__import__(module_path, fromlist=[class_name]), class_name)
        cfg = self.config(slots, **extra)
        md = md or metadata()
        b = cls(
            config=cfg,
            metadata=md,
            local_cpu_backend=self.local_cpu(cfg, metadata()) if lcb == "auto" else lcb,
            loop=self.loop if loop == "auto" else loop,
            dst_device="cpu",
        )
        self.backends.append(b)
        return b

    def run_loop(self) -> None:
        self.loop_thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.loop_thread.start()

    def close(self) -> None:
        for b in self.backends:
            b.close()
        if self.loop_thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop_thread.join(HANG_S)
        self.loop.close()
        if self.lcb is not None:
            self.lcb.close()


@pytest.fixture(params=KINDS)
def env(request) -> Iterator[Env]:
    e = Env(request.param, shm_path())
    yield e
    e.close()
    try:
        os.unlink(e.path)
    except FileNotFoundError:
        pass


@pytest.fixture
def dx(request) -> Iterator[Env]:
    """daxkv's backend only (scenarios the control has no counterpart for)."""
    e = Env("daxkv", shm_path())
    yield e
    e.close()
    try:
        os.unlink(e.path)
    except FileNotFoundError:
        pass


# ----- objects, keys, bytes -----


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, i, torch.bfloat16)


def shape_of(tokens: int, fmt: MemoryFormat) -> torch.Size:
    if fmt == MemoryFormat.KV_T2D:
        return torch.Size([tokens, 2, 32])
    return torch.Size([2, 2, tokens, 16])  # KV_2LTD: [2, layers, tokens, hidden]


def kv(lcb: LocalCPUBackend, seed: int, tokens: int = CHUNK,
       fmt: MemoryFormat = MemoryFormat.KV_2LTD) -> MemoryObj:
    """One of LMCache's own memory objects (from the local CPU backend's
    allocator), filled with a pattern of `seed`."""
    shape = shape_of(tokens, fmt)
    obj = lcb.allocate(shape, torch.bfloat16, fmt)
    assert obj is not None
    g = torch.Generator().manual_seed(seed)
    obj.tensor.view(torch.int16).copy_(
        torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16)
    )
    return obj


def data(obj: MemoryObj) -> bytes:
    return bytes(obj.byte_array)


def same(got: Optional[MemoryObj], want: MemoryObj) -> bool:
    assert got is not None
    assert got.get_shape() == want.get_shape()
    assert got.metadata.dtype == want.metadata.dtype
    assert got.metadata.fmt == want.metadata.fmt
    return data(got) == data(want)


def put(b: Any, k: CacheEngineKey, obj: MemoryObj, **kw: Any) -> None:
    futs = b.batched_submit_put_task([k], [obj], **kw)
    for f in futs or []:
        f.result(timeout=HANG_S)


def release(*objs: Optional[MemoryObj]) -> None:
    for o in objs:
        if o is not None:
            o.ref_count_down()


def counters(b: Any) -> dict[str, Any]:
    """Slot counters of either backend (upstream: its core's report)."""
    s = b.status() if isinstance(b, daxkv.lmcache.DaxBackend) else b._core.report_status()
    return {
        k: s[k]
        for k in (
            "live_slot_count",
            "locked_key_count",
            "borrowed_slot_count",
            "active_read_count",
            "active_write_count",
        )
    }


def settled(b: Any, live: int) -> None:
    """Nothing leaked: `live` slots used, no pin, borrow, read or write left."""
    assert counters(b) == {
        "live_slot_count": live,
        "locked_key_count": 0,
        "borrowed_slot_count": 0,
        "active_read_count": 0,
        "active_write_count": 0,
    }
    if isinstance(b, daxkv.lmcache.DaxBackend):
        b._store.check_invariants()


class Gate:
    """Hold the first read (or write) of a backend at the same point of
    the protocol in both implementations: a read once its keys are
    reserved, a write once its slot is reserved and the key in flight."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, b: Any, what: str) -> None:
        self.started = threading.Event()
        self.allow = threading.Event()
        self.calls = 0
        self.threads: list[str] = []
        daxkv_side = isinstance(b, daxkv.lmcache.DaxBackend)
        if what == "write":
            if daxkv_side:
                b._store._set_write_hook(self._hold)
            else:
                orig = upstream.DaxBackend._do_write

                def do_write(this, offset, obj, size):
                    self._hold()
                    orig(this, offset, obj, size)

                monkeypatch.setattr(upstream.DaxBackend, "_do_write", do_write)
        elif daxkv_side:
            # The outputs are allocated after the reservation, before the
            # copy: holding the allocation holds a reserved read.
            lcb = b.local_cpu_backend
            for name in ("allocate", "batched_allocate"):
                monkeypatch.setattr(lcb, name, self._wrap(getattr(lcb, name)))
        else:
            for name in ("_do_read", "_batched_memcpy"):
                orig = getattr(upstream.DaxBackend, name)

                def held(this, *a, _orig=orig):
                    self._hold()
                    return _orig(this, *a)

                monkeypatch.setattr(upstream.DaxBackend, name, held)

    def _wrap(self, f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **kw: Any) -> Any:
            self._hold()
            return f(*a, **kw)

        return wrapped

    def _hold(self) -> None:
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        if self.calls == 1:
            self.started.set()
            assert self.allow.wait(HANG_S), "the gate was never opened"

    def wait_started(self) -> None:
        assert self.started.wait(HANG_S), "the held operation never started"


def in_thread(f: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(f())
        except BaseException as e:  # noqa: BLE001 — handed to the test
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def joined(t: threading.Thread, out: list[Any]) -> Any:
    t.join(HANG_S)
    assert not t.is_alive(), "hung"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


# ----- the launcher path and a full round trip (both backends) -----


def test_launcher_builds_it_and_a_round_trip_verifies_bytes(env: Env) -> None:
    """put → contains → pin → get → batched restore → remove, on LMCache's
    memory objects, the backend built by LMCache's launcher."""
    b = env.launch(slots=64)
    lcb = env.lcb
    assert str(b) == "DaxBackend" and b.slot_bytes == SLOT
    objs = [kv(lcb, i) for i in range(6)]
    done: list[CacheEngineKey] = []
    assert b.batched_submit_put_task([key(i) for i in range(6)], objs, None, done.append) is None
    assert done == [key(i) for i in range(6)], "one callback per stored key"
    assert all(b.contains(key(i)) for i in range(6)) and not b.contains(key(99))
    assert not b.exists_in_put_tasks(key(0))
    assert b.pin(key(0)) and not b.pin(key(99))
    assert b.get_allocator_backend() is lcb

    got = b.get_blocking(key(0))
    assert same(got, objs[0])
    batch = b.batched_get_blocking([key(i) for i in range(6)])
    assert all(same(g, o) for g, o in zip(batch, objs))
    assert b.batched_contains([key(0), key(1), key(99), key(2)]) == 2

    assert b.remove(key(0)), "forced remove takes a pinned key"
    assert not b.contains(key(0)) and b.get_blocking(key(0)) is None
    assert b.batched_remove([key(1), key(2), key(99)]) == 2
    settled(b, live=3)
    release(got, *batch, *objs)


def test_positional_holes_in_batched_get_blocking(env: Env) -> None:
    b = env.launch()
    objs = [kv(env.lcb, 11), kv(env.lcb, 13)]
    put(b, key(11), objs[0])
    put(b, key(13), objs[1])
    res = b.batched_get_blocking([key(11), key(12), key(13)])
    assert len(res) == 3 and res[1] is None
    assert same(res[0], objs[0]) and same(res[2], objs[1])
    assert b.batched_get_blocking([]) == []
    release(res[0], res[2], *objs)
    settled(b, live=2)


def test_the_allocator_gets_the_stored_format(env: Env, monkeypatch) -> None:
    b = env.launch()
    seen: list[MemoryFormat] = []
    orig = env.lcb.batched_allocate

    def tracking(shapes, dtypes, batch_size, fmt=None, eviction=True, busy_loop=True):
        assert fmt is not None
        seen.append(fmt)
        return orig(shapes, dtypes, batch_size, fmt, eviction=eviction, busy_loop=busy_loop)

    objs = [kv(env.lcb, i, fmt=MemoryFormat.KV_T2D) for i in range(2)]
    put(b, key(14), objs[0])
    put(b, key(15), objs[1])
    monkeypatch.setattr(env.lcb, "batched_allocate", tracking)
    res = b.batched_get_blocking([key(14), key(15)])
    assert seen == [MemoryFormat.KV_T2D], "one batched allocation, in the stored fmt"
    assert all(same(r, o) for r, o in zip(res, objs))
    release(*res, *objs)


def test_heterogeneous_chunk_shapes_round_trip(env: Env) -> None:
    """A 16-token chunk and an 8-token tail (and a KV_T2D one): each comes
    back in its own shape, dtype and fmt."""
    b = env.launch()
    objs = [
        kv(env.lcb, 1, tokens=16),
        kv(env.lcb, 2, tokens=8),
        kv(env.lcb, 3, tokens=16),
        kv(env.lcb, 4, tokens=5, fmt=MemoryFormat.KV_T2D),
    ]
    for i, o in enumerate(objs):
        put(b, key(21 + i), o)
    res = b.batched_get_blocking([key(21 + i) for i in range(4)])
    assert [r.get_shape() for r in res] == [o.get_shape() for o in objs]
    assert all(same(r, o) for r, o in zip(res, objs))
    one = b.get_blocking(key(22))
    assert same(one, objs[1])
    release(*res, one, *objs)


def test_non_blocking_get_stops_at_the_first_miss(env: Env) -> None:
    b = env.launch()
    objs = [kv(env.lcb, 31), kv(env.lcb, 33)]
    put(b, key(31), objs[0])
    put(b, key(33), objs[1])
    res = asyncio.run(b.batched_get_non_blocking("lookup", [key(31), key(32), key(33)]))
    assert len(res) == 1 and same(res[0], objs[0])
    assert asyncio.run(b.batched_get_non_blocking("lookup", [key(32), key(31)])) == []
    assert asyncio.run(b.batched_async_contains("l", [key(31), key(32)])) == 1
    release(*res, *objs)
    settled(b, live=2)


def test_blocking_and_async_restores_serialize_on_the_dispatch_thread(env: Env, monkeypatch) -> None:
    b = env.launch()
    objs = [kv(env.lcb, 43), kv(env.lcb, 44)]
    put(b, key(43), objs[0])
    put(b, key(44), objs[1])
    first, second = threading.Event(), threading.Event()
    allow = threading.Event()
    names: list[str] = []
    orig = b._restore_batch

    def gated(keys, prefix_only):
        names.append(threading.current_thread().name)
        if len(names) == 1:
            first.set()
            assert allow.wait(HANG_S)
        else:
            second.set()
        return orig(keys, prefix_only)

    monkeypatch.setattr(b, "_restore_batch", gated)
    with ThreadPoolExecutor(max_workers=2) as ex:
        blocking = ex.submit(b.batched_get_blocking, [key(43)])
        assert first.wait(HANG_S)
        nonblocking = ex.submit(
            lambda: asyncio.run(b.batched_get_non_blocking("lookup", [key(44)]))
        )
        # The second restore cannot start while the first holds the thread.
        assert not second.is_set()
        allow.set()
        r1 = blocking.result(HANG_S)
        r2 = nonblocking.result(HANG_S)
    assert second.is_set()
    assert all(n.startswith("dax-restore-dispatch") for n in names), names
    assert same(r1[0], objs[0]) and same(r2[0], objs[1])
    release(*r1, *r2, *objs)


def test_many_regions_and_waves_restore_every_byte(env: Env) -> None:
    """A slab of two slots over two regions: 40 objects (full chunks and
    tails, stored out of order) restore through 20 waves of one-object
    regions on two workers, each into its own output."""
    b = env.launch(**{"dax.retrieve_staging_slab_bytes": 2 * SLOT})
    objs = [kv(env.lcb, 100 + i, tokens=16 if i % 3 else 8) for i in range(40)]
    for i in reversed(range(40)):
        put(b, key(100 + i), objs[i])
    want = [key(100 + i) for i in range(40)]
    res = b.batched_get_blocking(want)
    assert all(same(r, o) for r, o in zip(res, objs))
    release(*res, *objs)
    settled(b, live=40)


def test_cached_positions_round_trip(env: Env) -> None:
    b = env.launch()
    objs = [kv(env.lcb, 51), kv(env.lcb, 52)]
    pos = torch.arange(CHUNK, dtype=torch.long) + 1000
    objs[0].metadata.cached_positions = pos
    put(b, key(51), objs[0])
    put(b, key(52), objs[1])
    res = b.batched_get_blocking([key(51), key(52)])
    one = b.get_blocking(key(51))
    assert torch.equal(res[0].metadata.cached_positions, pos)
    assert torch.equal(one.metadata.cached_positions, pos)
    assert res[1].metadata.cached_positions is None
    release(*res, one, *objs)


# ----- constructor validation (order, wording) and leaks -----


def dax_threads() -> int:
    """Live threads named ``dax-*`` (upstream's and our Python pools, and
    the Rust workers, whose OS names /proc shows)."""
    py = sum(1 for t in threading.enumerate() if t.name.startswith("dax-"))

    def walk() -> frozenset[str]:
        tids = set()
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().startswith("dax-"):
                        tids.add(tid)
            except OSError:
                pass
        return frozenset(tids)

    # The kernel resumes a /proc/self/task walk by index, so a walk can skip
    # live threads while others exit: take two walks that agree.
    last = walk()
    for _ in range(20):
        now = walk()
        if now == last:
            break
        last = now
    return py + len(last)


def resources(path: str) -> tuple[int, int, int]:
    """fds and mappings of `path`, and the backends' threads."""

    def target(fd: str) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""

    fds = sum(1 for fd in os.listdir("/proc/self/fd") if target(fd) == path)
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if line.rstrip().endswith(path))
    return fds, maps, dax_threads()


def test_constructor_checks_in_order_with_lmcaches_words(env: Env) -> None:
    env.size_device(64 * SLOT)
    cls = daxkv.lmcache.DaxBackend if env.kind == "daxkv" else upstream.DaxBackend
    with pytest.raises(ValueError, match="requires config"):
        cls(config=None, metadata=metadata())
    with pytest.raises(ValueError, match="requires metadata"):
        cls(config=env.config(), metadata=None)
    # TP > 1 is reported before a missing local CPU backend.
    with pytest.raises(ValueError, match=r"only supports TP=1 \(world_size=2\)"):
        env.construct(md=metadata(world_size=2), lcb=None)
    two_groups = metadata()
    two_groups.kv_layer_groups_manager = types.SimpleNamespace(
        kernel_groups=[object(), object()], num_kernel_groups=2
    )
    with pytest.raises(ValueError, match="single-group KV layout"):
        env.construct(md=two_groups, lcb=None)
    with pytest.raises(ValueError, match=r"extra_config\['dax.device_path'\] is required"):
        env.construct(**{"dax.device_path": " "})
    with pytest.raises(ValueError, match="async_put=true requires an asyncio event loop"):
        env.construct(loop=None, **{"dax.async_put": "yes"})
    with pytest.raises(ValueError, match=r"extra_config\['dax.max_dax_size'\] must be > 0"):
        env.construct(**{"dax.max_dax_size": 0})
    with pytest.raises(ValueError, match="requires local_cpu_backend"):
        env.construct(lcb=None)
    for bad in (0, -1, "x", None):
        with pytest.raises(ValueError, match=r"extra_config\['dax.restore_workers'\] must be a positive integer"):
            env.construct(**{"dax.restore_workers": bad})
    with pytest.raises(ValueError, match=r"'dax.restore_max_regions'\] must be a positive integer"):
        env.construct(**{"dax.restore_max_regions": "0"})
    with pytest.raises(
        ValueError, match=rf"retrieve_staging_slab_bytes'\] must be at least {3 * SLOT} bytes"
    ):
        env.construct(**{"dax.restore_max_regions": 3, "dax.retrieve_staging_slab_bytes": 3 * SLOT - 1})
    # A device too small is reported before bad restore settings.
    with pytest.raises(RuntimeError, match="exceeds device capacity"):
        env.construct(slots=65, **{"dax.restore_workers": 0})
    with pytest.raises(RuntimeError, match="Failed to open dax device"):
        env.construct(**{"dax.device_path": env.path + ".missing"})
    # And with every setting right, it opens.
    b = env.construct(**{"dax.restore_workers": "3", "dax.async_put": "off"})
    assert b.slot_bytes == SLOT


def test_failed_constructors_release_fds_mappings_and_threads(env: Env) -> None:
    env.size_device(16 * SLOT)
    env.local_cpu(env.config(), metadata())  # built outside the measurement
    before = resources(env.path)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="exceeds device capacity"):
            env.construct(slots=32)
        # Opened, then refused: the device must be closed and unmapped.
        with pytest.raises(ValueError, match="positive integer"):
            env.construct(slots=16, **{"dax.restore_max_regions": -2})
        with pytest.raises(ValueError, match="must be at least"):
            env.construct(slots=16, **{"dax.retrieve_staging_slab_bytes": SLOT})
    assert resources(env.path) == before
    b = env.construct(slots=16)
    b.batched_get_blocking([key(1)])  # starts the dispatch thread
    fds, maps, threads = resources(env.path)
    assert fds > before[0] and maps > before[1] and threads > before[2], "the probe sees it"
    b.close()
    assert resources(env.path) == before, "close releases the fd, the mapping and the threads"


def test_older_arena_size_gb_key(dx: Env) -> None:
    """Configs written for older LMCache name the size `dax.arena_size_gb`."""
    dx.size_device(8 * SLOT)
    cfg = engine_config(
        "daxkv", {"dax.device_path": dx.path, "dax.arena_size_gb": 8 * SLOT / 2**30}
    )
    md = metadata()
    b = daxkv.lmcache.DaxBackend(cfg, md, dx.local_cpu(cfg, md), dx.loop)
    dx.backends.append(b)
    assert b.status()["max_slots"] == 8


# ----- bad calls -----


def test_oversized_put_raises_after_storing_the_keys_before_it(env: Env) -> None:
    b = env.launch(slots=4)
    small = kv(env.lcb, 1)
    big = env.lcb.allocate(torch.Size([2, 2, CHUNK + 1, 16]), torch.bfloat16)
    assert big.get_size() > b.slot_bytes
    with pytest.raises(ValueError, match="exceeds slot size"):
        b.batched_submit_put_task([key(1), key(2), key(3)], [small, big, small])
    assert b.contains(key(1)) and not b.contains(key(2)) and not b.contains(key(3))
    settled(b, live=1)
    release(small, big)


def test_unequal_key_and_object_counts_raise(env: Env) -> None:
    b = env.launch(slots=4)
    o = kv(env.lcb, 1)
    with pytest.raises(ValueError, match="same length"):
        b.batched_submit_put_task([key(801), key(802)], [o])
    settled(b, live=0)
    release(o)


def test_a_multi_tensor_put_is_skipped_without_leaking_a_slot(env: Env) -> None:
    b = env.launch(slots=1)
    half = torch.Size([2, 2, CHUNK // 2, 16])
    multi = env.lcb.allocate([half, half], [torch.bfloat16, torch.bfloat16])
    assert multi is not None and len(multi.get_shapes()) == 2
    b.batched_submit_put_task([key(706)], [multi])
    assert not b.contains(key(706)) and b.get_blocking(key(706)) is None
    settled(b, live=0)
    o = kv(env.lcb, 708)
    put(b, key(708), o)  # the one slot is still free
    got = b.get_blocking(key(708))
    assert same(got, o)
    release(multi, o, got)


def test_a_read_failure_releases_the_cpu_object_and_keeps_the_key(env: Env, monkeypatch) -> None:
    b = env.launch(slots=2)
    o = kv(env.lcb, 707)
    put(b, key(707), o)
    allocated: list[MemoryObj] = []
    orig = env.lcb.allocate
    if env.kind == "daxkv":
        # The copy is Rust's: make it fail by allocating an output too short.
        def short(shape, dtype, fmt=None, **kw):
            obj = orig(torch.Size([2, 2, CHUNK // 2, 16]), dtype, fmt, **kw)
            allocated.append(obj)
            return obj

        monkeypatch.setattr(env.lcb, "allocate", short)
        match = "too small"
    else:
        def tracking(shape, dtype, fmt=None, **kw):
            obj = orig(shape, dtype, fmt, **kw)
            allocated.append(obj)
            return obj

        def failing(this, offset, obj, size):
            raise RuntimeError("simulated read failure")

        monkeypatch.setattr(env.lcb, "allocate", tracking)
        monkeypatch.setattr(upstream.DaxBackend, "_do_read", failing)
        match = "simulated read failure"
    with pytest.raises(RuntimeError, match=match):
        b.get_blocking(key(707))
    assert len(allocated) == 1 and allocated[0].get_ref_count() == 0
    assert b.contains(key(707))
    settled(b, live=1)
    release(o)


def test_a_failed_batched_allocation_releases_everything(dx: Env, monkeypatch) -> None:
    b = dx.launch(slots=4)
    objs = [kv(dx.lcb, i, tokens=8 + i) for i in range(3)]  # three groups
    for i, o in enumerate(objs):
        put(b, key(i), o)
    got: list[MemoryObj] = []
    orig = dx.lcb.allocate

    def third_fails(shape, dtype, fmt=None, **kw):
        if len(got) == 2:
            return None
        obj = orig(shape, dtype, fmt, **kw)
        got.append(obj)
        return obj

    monkeypatch.setattr(dx.lcb, "allocate", third_fails)
    with pytest.raises(RuntimeError, match="batched restore allocation failed"):
        b.batched_get_blocking([key(0), key(1), key(2)])
    assert [o.get_ref_count() for o in got] == [0, 0]
    settled(b, live=3)
    # get_blocking: an allocator out of memory is a miss.
    monkeypatch.setattr(dx.lcb, "allocate", lambda *a, **kw: None)
    assert b.get_blocking(key(0)) is None
    settled(b, live=3)
    release(*objs)


def test_a_full_arena_raises_and_evicts_nothing_pinned_or_not(env: Env) -> None:
    b = env.launch(slots=2)
    objs = [kv(env.lcb, i) for i in range(4)]
    done: list[CacheEngineKey] = []
    put(b, key(201), objs[0])
    assert b.pin(key(201))
    with pytest.raises(RuntimeError, match="No free slots available"):
        b.batched_submit_put_task([key(202), key(203), key(204)], objs[1:], None, done.append)
    assert done == [key(202)], "the key before the full one was stored and reported"
    assert b.contains(key(201)) and b.contains(key(202)) and not b.contains(key(203))
    outs = [b.get_blocking(key(201)), b.get_blocking(key(202))]
    assert same(outs[0], objs[0]) and same(outs[1], objs[1])
    assert b.get_blocking(key(203)) is None
    assert counters(b)["locked_key_count"] == 1
    b.unpin(key(201))
    settled(b, live=2)
    release(*outs, *objs)


def test_overlapping_pins_are_refcounted(env: Env) -> None:
    b = env.launch(slots=2)
    objs = [kv(env.lcb, i) for i in range(4)]
    put(b, key(401), objs[0])
    put(b, key(402), objs[1])
    assert b.pin(key(401)) and b.pin(key(401))
    assert b.unpin(key(401)), "still there after one unpin"
    assert not b.remove(key(401), force=False), "one pin left"
    assert b.remove(key(402), force=False)
    put(b, key(403), objs[2])
    assert b.contains(key(401)) and not b.contains(key(402)) and b.contains(key(403))
    b.unpin(key(401))
    assert b.remove(key(401), force=False)
    put(b, key(404), objs[3])
    assert not b.contains(key(401)) and b.contains(key(404))
    settled(b, live=2)
    release(*objs)


def test_close_is_idempotent_and_rejects_new_work(env: Env) -> None:
    b = env.launch()
    o = kv(env.lcb, 1)
    put(b, key(1), o)
    b.close()
    b.close()
    assert b.get_blocking(key(1)) is None
    assert b.batched_get_blocking([key(1)]) == []
    assert asyncio.run(b.batched_get_non_blocking("l", [key(1)])) == []
    assert not b.contains(key(1))
    with pytest.raises(RuntimeError, match="closing"):
        b.batched_submit_put_task([key(1000)], [o])
    release(o)


# ----- concurrency: a held copy -----


def test_a_remove_finishes_while_a_get_copies(env: Env, monkeypatch) -> None:
    b = env.launch()
    objs = [kv(env.lcb, 701), kv(env.lcb, 702)]
    put(b, key(701), objs[0])
    put(b, key(702), objs[1])
    for what in ("get", "batched"):
        gate = Gate(monkeypatch, b, "read")
        t, out = in_thread(
            (lambda: b.get_blocking(key(701)))
            if what == "get"
            else (lambda: b.batched_get_blocking([key(701)])[0])
        )
        gate.wait_started()
        # Not blocked by the read in progress (no lock held over the copy).
        assert b.remove(key(702))
        gate.allow.set()
        got = joined(t, out)
        assert same(got, objs[0])
        release(got)
        monkeypatch.undo()
        put(b, key(702), objs[1])
    settled(b, live=2)
    release(*objs)


@pytest.mark.parametrize("how", ["get", "batched"])
def test_a_remove_during_a_read_defers_slot_reuse(env: Env, monkeypatch, how: str) -> None:
    """The interleaving the read pin exists for: the key is removed while its
    bytes are being read; its slot must not be handed to a new put until
    the read is over, and the reader gets the removed key's bytes intact."""
    b = env.launch(slots=1)
    o, blocked, recycled = kv(env.lcb, 7), kv(env.lcb, 11), kv(env.lcb, 9)
    put(b, key(703), o)
    gate = Gate(monkeypatch, b, "read")
    t, out = in_thread(
        (lambda: b.get_blocking(key(703)))
        if how == "get"
        else (lambda: b.batched_get_blocking([key(703)])[0])
    )
    gate.wait_started()
    assert b.remove(key(703))
    with pytest.raises(RuntimeError, match="No free slots available"):
        b.batched_submit_put_task([key(704)], [blocked])
    gate.allow.set()
    got = joined(t, out)
    assert same(got, o), "the removed key's bytes, intact"
    monkeypatch.undo()
    put(b, key(705), recycled)
    back = b.batched_get_blocking([key(705)])
    assert same(back[0], recycled)
    assert b.get_blocking(key(703)) is None
    settled(b, live=1)
    release(got, *back, o, blocked, recycled)


def test_removing_an_in_flight_put_reclaims_its_slot(env: Env, monkeypatch) -> None:
    b = env.launch(slots=1)
    o, o2 = kv(env.lcb, 301), kv(env.lcb, 302)
    gate = Gate(monkeypatch, b, "write")
    done: list[CacheEngineKey] = []
    t, out = in_thread(lambda: b.batched_submit_put_task([key(301)], [o], None, done.append))
    gate.wait_started()
    assert b.exists_in_put_tasks(key(301)) and not b.contains(key(301))
    assert b.remove(key(301)), "a forced remove cancels the put in flight"
    gate.allow.set()
    joined(t, out)
    assert done == [] and not b.contains(key(301))
    settled(b, live=0)
    put(b, key(302), o2)  # the one slot was reclaimed
    got = b.get_blocking(key(302))
    assert same(got, o2)
    release(got, o, o2)


def test_threads_put_and_get_concurrently(env: Env) -> None:
    b = env.launch(slots=64)
    lcb = env.lcb

    def worker(i: int) -> None:
        o = kv(lcb, 400 + i, tokens=8 + i % 9)
        put(b, key(400 + i), o)
        got = b.get_blocking(key(400 + i))
        assert same(got, o)
        many = b.batched_get_blocking([key(400 + i), key(9999)])
        assert same(many[0], o) and many[1] is None
        release(got, many[0], o)

    with ThreadPoolExecutor(max_workers=4) as ex:
        for f in [ex.submit(worker, i) for i in range(24)]:
            f.result(HANG_S)
    settled(b, live=24)


@pytest.mark.parametrize("what", ["put", "get", "batched"])
def test_close_waits_for_the_operation_in_progress(env: Env, monkeypatch, what: str) -> None:
    b = env.launch()
    o = kv(env.lcb, 6)
    if what != "put":
        put(b, key(6), o)
    gate = Gate(monkeypatch, b, "write" if what == "put" else "read")
    op = {
        "put": lambda: b.batched_submit_put_task([key(6)], [o]),
        "get": lambda: b.get_blocking(key(6)),
        "batched": lambda: b.batched_get_blocking([key(6)]),
    }[what]
    t, out = in_thread(op)
    gate.wait_started()
    closing = threading.Event()
    c, cout = in_thread(lambda: (closing.set(), b.close()))
    assert closing.wait(HANG_S)
    # Whatever the scheduling, close cannot have finished: the operation
    # is still held.
    assert c.is_alive()
    gate.allow.set()
    r = joined(t, out)
    joined(c, cout)
    if what == "get":
        assert same(r, o)
        release(r)
    elif what == "batched":
        assert same(r[0], o)
        release(r[0])
    release(o)


def test_async_put_runs_through_the_loop_and_close_waits_for_it(env: Env, monkeypatch) -> None:
    """``dax.async_put``: the put runs on a thread through the event loop,
    the object is referenced until its copy is done, the callback runs on
    commit, and close waits for the copy in flight."""
    b = env.launch(**{"dax.async_put": "true"})
    env.run_loop()
    o = kv(env.lcb, 411)
    done: list[CacheEngineKey] = []
    gate = Gate(monkeypatch, b, "write")
    futs = b.batched_submit_put_task([key(411)], [o], None, done.append)
    assert futs is not None and len(futs) == 1
    gate.wait_started()
    assert o.get_ref_count() == 2, "referenced while the copy runs"
    # An existing or in-flight key is skipped.
    assert b.batched_submit_put_task([key(411)], [o]) is None
    gate.allow.set()
    futs[0].result(HANG_S)
    assert o.get_ref_count() == 1 and done == [key(411)]
    got = b.get_blocking(key(411))
    assert same(got, o)
    release(got)

    gate2 = Gate(monkeypatch, b, "write")
    futs = b.batched_submit_put_task([key(412)], [o])
    gate2.wait_started()
    closing = threading.Event()
    c, cout = in_thread(lambda: (closing.set(), b.close()))
    assert closing.wait(HANG_S)
    assert c.is_alive()
    gate2.allow.set()
    joined(c, cout)
    futs[0].result(HANG_S)
    assert o.get_ref_count() == 1
    release(o)


# ----- daxkv only: its store's own guarantees -----


def test_a_key_removed_and_stored_again_during_a_restore(dx: Env, monkeypatch) -> None:
    """The restore returns the incarnation it reserved, bytes and cached
    positions, even when the key is removed and stored again (with other
    bytes and positions) while the outputs are being allocated. (A store
    that read the positions after the allocation instead of with the
    reservation would return the old bytes with the new positions.)"""
    b = dx.launch(slots=2)
    old, new = kv(dx.lcb, 1), kv(dx.lcb, 2)
    old.metadata.cached_positions = torch.arange(CHUNK)
    new.metadata.cached_positions = torch.arange(CHUNK) * 7
    put(b, key(1), old)
    orig = dx.lcb.allocate

    def swap(*a, **kw):
        assert b.remove(key(1))
        put(b, key(1), new)  # the second slot: the first is still read
        return orig(*a, **kw)

    monkeypatch.setattr(dx.lcb, "allocate", swap)
    got = b.batched_get_blocking([key(1)])[0]
    monkeypatch.undo()
    assert same(got, old)
    assert torch.equal(got.metadata.cached_positions, old.metadata.cached_positions)
    now = b.get_blocking(key(1))
    assert same(now, new)
    assert torch.equal(now.metadata.cached_positions, new.metadata.cached_positions)
    assert b.remove(key(1))
    assert b.status()["positions_count"] == 0, "a removed key's positions are dropped"
    settled(b, live=0)
    release(got, now, old, new)


def test_a_large_restore_allocates_on_the_dispatch_thread(dx: Env, monkeypatch) -> None:
    """600 objects through 75 waves of 8 KiB regions: one batched
    allocation, on the dispatch thread, and every byte right."""
    b = dx.launch(slots=600, **{"dax.retrieve_staging_slab_bytes": 8 * SLOT})
    objs = [kv(dx.lcb, i) for i in range(600)]
    b.batched_submit_put_task([key(i) for i in range(600)], objs)
    seen: list[str] = []
    orig = dx.lcb.batched_allocate

    def tracking(*a, **kw):
        seen.append(threading.current_thread().name)
        return orig(*a, **kw)

    monkeypatch.setattr(dx.lcb, "batched_allocate", tracking)
    res = b.batched_get_blocking([key(i) for i in range(600)])
    assert seen and all(n.startswith("dax-restore-dispatch") for n in seen)
    assert all(same(r, o) for r, o in zip(res, objs))
    release(*res, *objs)
    settled(b, live=600)


def test_bad_calls_leave_the_store_consistent(dx: Env) -> None:
    b = dx.launch(slots=3)
    objs = [kv(dx.lcb, i) for i in range(5)]
    with pytest.raises(TypeError):
        b.contains(object())
    put(b, key(1), objs[0])
    with pytest.raises(ValueError, match="same length"):
        b.batched_submit_put_task([key(2)], objs[:2])
    with pytest.raises(RuntimeError, match="No free slots"):
        b.batched_submit_put_task([key(i) for i in range(2, 6)], objs[1:5])
    assert b.pin(key(1)) and b.pin(key(1))
    b.unpin(key(1))
    b.unpin(key(1))
    b.unpin(key(1))  # one too many: ignored
    assert b._store.lock_count(key(1)) == 0
    assert not b.remove(key(99)) and b.batched_remove([key(99)]) == 0
    settled(b, live=3)
    release(*objs)


def test_puts_and_restores_read_memory_objects_without_byte_array(dx: Env, monkeypatch) -> None:
    """Puts (batched and async) and restores (one key, a batch, the async
    prefix) read each ``MemoryObj`` from its tensor: ``byte_array`` (a torch
    view and a ctypes array per call) is never built, and every byte
    still round-trips, a short tail chunk at its own length."""
    b = dx.launch(slots=16, **{"dax.async_put": "true"})
    dx.run_loop()
    objs = [kv(dx.lcb, 900 + i) for i in range(4)] + [kv(dx.lcb, 904, tokens=CHUNK // 2)]
    want = [bytes(o.byte_array) for o in objs]
    built: list[str] = []
    cls = type(objs[0])
    real = cls.byte_array

    def counting(self):  # type: ignore[no-untyped-def]
        built.append(type(self).__name__)
        return real.fget(self)

    monkeypatch.setattr(cls, "byte_array", property(counting))
    # Synchronous (the loop is running but this call is not async): patch
    # async off for the batch, then the async path for one key.
    b.async_put = False
    assert b.batched_submit_put_task([key(900 + i) for i in range(5)], objs) is None
    b.async_put = True
    extra = kv(dx.lcb, 950)
    extra_bytes = bytes(extra.raw_data[: extra.get_size()].numpy())
    put(b, key(950), extra)
    assert b.contains(key(950))

    got = b.get_blocking(key(904))
    batch = b.batched_get_blocking([key(900 + i) for i in range(5)] + [key(950)])
    prefix = asyncio.run_coroutine_threadsafe(
        b.batched_get_non_blocking("l", [key(900), key(901), key(999), key(902)]), dx.loop
    ).result(HANG_S)
    assert built == [], f"byte_array built on {built}"
    monkeypatch.undo()

    assert got is not None and bytes(got.byte_array) == want[4]
    assert got.get_size() == objs[4].get_size()
    assert [bytes(r.byte_array) for r in batch[:5]] == want
    assert bytes(batch[5].byte_array) == extra_bytes
    assert [bytes(r.byte_array) for r in prefix] == want[:2]
    release(got, *batch, *prefix, *objs, extra)
    settled(b, live=6)


def test_a_memory_object_whose_size_is_past_its_tensor_is_refused(dx: Env) -> None:
    """``get_size()`` past the tensor's bytes (``byte_array`` would describe
    memory past it): the put raises ``BufferError`` naming the object,
    nothing is stored and no slot is leaked; a restore into such an output
    raises the same and keeps the key."""
    b = dx.launch(slots=4)
    good = kv(dx.lcb, 960)
    put(b, key(960), good)
    bad = kv(dx.lcb, 961, tokens=CHUNK // 2)  # under a slot, past its tensor
    bad.get_size = lambda: bad.raw_data.nbytes + 1  # type: ignore[method-assign]
    with pytest.raises(BufferError, match="source object 0: get_size.. is .* past its tensor"):
        b.batched_submit_put_task([key(961)], [bad])
    assert not b.contains(key(961))
    settled(b, live=1)

    def past(hits):  # type: ignore[no-untyped-def]
        o = kv(dx.lcb, 962)
        o.get_size = lambda: o.raw_data.nbytes + 1  # type: ignore[method-assign]
        outs.append(o)
        return [o]

    outs: list[MemoryObj] = []
    with pytest.raises(BufferError, match="destination object 0: get_size.. is .* past its tensor"):
        b._store.restore([key(960)], False, past)
    assert b.contains(key(960))
    got = b.get_blocking(key(960))
    assert same(got, good)
    release(got, good, bad, *outs)
    settled(b, live=1)


def _strided_obj(raw: Any) -> MemoryObj:
    """A real LMCache ``TensorMemoryObj`` over ``raw`` (a flat uint8 CPU
    tensor), no allocator: ``get_size()`` is ``raw.numel()`` bytes."""
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    shape = torch.Size([raw.numel()])
    meta = MemoryObjMetadata(
        shape, torch.uint8, 0, raw.numel(), 1, 0, MemoryFormat.KV_2LTD,
        shapes=[shape], dtypes=[torch.uint8],
    )
    return TensorMemoryObj(raw, meta, parent_allocator=None)


def test_a_memory_object_over_a_non_contiguous_tensor_is_never_read_or_written_past_it(
    dx: Env,
) -> None:
    """A ``MemoryObj`` whose ``raw_data`` is a CPU tensor that is not
    contiguous (here one byte expanded to 256: stride 0): its elements are
    not the ``get_size()`` bytes at ``data_ptr()``, which run past the
    tensor into memory it does not own (``byte_array`` describes exactly
    those). A put must not store the neighbour's bytes as this object's,
    and a restore into such an output must not write the neighbour: both
    are refused with ``BufferError`` naming the object, nothing stored,
    the neighbour untouched, nothing leaked."""
    b = dx.launch(slots=4)
    n = 256
    # One storage: byte `n - 1` is the tensor's, the `n` bytes after it a
    # neighbour's (another object's memory, in LMCache's shared buffer).
    backing = torch.arange(2 * n, dtype=torch.int32).to(torch.uint8)
    neighbour = bytes(backing[n:].numpy())
    src = _strided_obj(backing[n - 1 : n].expand(n))
    assert not src.raw_data.is_contiguous() and src.get_size() == n
    with pytest.raises(BufferError, match="source object 0: .*not contiguous"):
        b.batched_submit_put_task([key(970)], [src])
    assert not b.contains(key(970)), "stored bytes that are not the object's"
    settled(b, live=0)

    good = kv(dx.lcb, 971)
    put(b, key(971), good)

    def strided(hits):  # type: ignore[no-untyped-def]
        ((_, _, nbytes),) = hits
        return [_strided_obj(backing[n - 1 : n].expand(nbytes))]

    with pytest.raises(BufferError, match="destination object 0: .*not contiguous"):
        b._store.restore([key(971)], False, strided)
    assert bytes(backing[n:].numpy()) == neighbour, "the restore wrote past its object"
    assert b.contains(key(971))
    release(good)
    settled(b, live=1)
