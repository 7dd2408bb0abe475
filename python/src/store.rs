//! # `daxkv._daxkv.DaxStore`: the Rust half of `daxkv.lmcache.DaxBackend`
//!
//! LMCache's non-MP storage plugin (docs/lmcache-dax-behavior.md §6) over
//! [`daxkv::DaxStore`]. The Python class (`python/daxkv/lmcache/_backend.py`)
//! keeps LMCache's surface: validation, callbacks, the event loop, the CPU
//! allocator; this one holds the slots and moves the bytes.
//!
//! ## Keys
//!
//! A key is a `str` or `bytes`, or any object with a `to_string()` method
//! (LMCache's `CacheEngineKey`, whose string names every field its `__eq__`
//! compares); the store keeps its 128-bit digest.
//!
//! ## Tags and cached positions
//!
//! Each payload is stored with a 32-bit tag. Bits 0..31 are the caller's
//! (the backend's id for the `(shape, dtype, fmt)` of the object); bit 31
//! ([`HAS_POSITIONS`]) says the object had `cached_positions`, a tensor per
//! object that does not fit a tag. Those live here, in `positions`
//! (key → tensor), kept in step with the slots by one lock:
//!
//! - a put with positions holds the lock from before its slot is reserved
//!   until its tensor is in the map (after the commit);
//! - a restore holds it while it reserves its keys and reads their tensors;
//! - a remove, after deleting, drops the key's tensor under the lock unless
//!   the key is stored again with positions.
//!
//! So a restore that pinned an incarnation with the flag finds that
//! incarnation's tensor: a newer put of the key with positions cannot
//! commit while the restore holds the lock, and an older one's tensor was
//! replaced when this incarnation committed. The interleaving this rules
//! out: restore reserves K (positions P1); K is removed and put again with
//! P2; the restore then reads the map and returns K's old bytes with P2.
//!
//! ## The GIL and the lock
//!
//! Nobody waits for the `positions` lock while holding the GIL (every path
//! that takes it has released the GIL first), so a thread holding the lock
//! may take the GIL (the restore's allocator call, the test write hook)
//! without a deadlock. Whatever waits for other threads (a put's copy,
//! `close`) runs with the GIL released.
//!
//! ## Buffers
//!
//! Sources and destinations are LMCache `MemoryObj`s, read from their
//! tensor (`raw_data.data_ptr()`, `get_size()` bytes: what `byte_array`
//! describes, without building its torch view and ctypes array), or any
//! other buffer, exported (`crate::export_objs`); held until the call
//! returns and released with the GIL held. Destinations must be writable and must not overlap
//! (checked): each becomes one `&mut [u8]` for the copy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use daxkv::device::arena::{ArenaSource, ArenaSpec};
use daxkv::plumbing::hash::Map;
use daxkv::{
    CoreConfig, DaxStore, Key, OpenError, PutError, PutOutcome, RestoreError, SlotWriter,
    StoreConfig, StoreError,
};
use pyo3::exceptions::{PyBufferError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use crate::View;

/// Tag bit: the object was stored with `cached_positions` (kept in
/// [`PyDaxStore::positions`]).
pub const HAS_POSITIONS: u32 = 1 << 31;

/// `put_batch` outcome: copied and committed.
const PUT_STORED: u8 = 0;
/// `put_batch` outcome: the key was already stored or in flight (no-op).
const PUT_PRESENT: u8 = 1;
/// `put_batch` outcome: a forced remove canceled the store while it ran.
const PUT_CANCELED: u8 = 2;
/// `put_batch` outcome: the store was closing.
const PUT_CLOSED: u8 = 3;
/// `put_batch` outcome: the copy failed (or the write hook raised).
const PUT_FAILED: u8 = 4;
/// `put_batch` outcome: not tried (the arena was found full before it).
const PUT_NOT_TRIED: u8 = 5;

type Positions = Map<Key, Arc<Py<PyAny>>>;

/// The slots of LMCache's non-MP `DaxBackend` over [`DaxStore`].
/// Thread-safe; every copy runs with the GIL released.
#[pyclass(module = "daxkv._daxkv", name = "DaxStore", frozen)]
pub struct PyDaxStore {
    /// `None` once closed (the last in-flight call drops the store, which
    /// closes the device fd).
    store: RwLock<Option<Arc<DaxStore>>>,
    slot_bytes: usize,
    max_slots: usize,
    arena_bytes: usize,
    device_path: String,
    /// `cached_positions` of the objects stored with [`HAS_POSITIONS`]
    /// (module doc).
    positions: Mutex<Positions>,
    /// Test hook run (with the GIL) inside each put's copy, while the key is
    /// in flight; `has_hook` keeps the common path to one load.
    write_hook: Mutex<Option<Arc<Py<PyAny>>>>,
    has_hook: AtomicBool,
    /// The process that opened it (`fork` module doc).
    owner: crate::fork::Owner,
}

/// Digest one key (module doc, "Keys").
fn key_of(k: &Bound<'_, PyAny>) -> PyResult<Key> {
    if let Ok(s) = k.downcast::<PyString>() {
        return Ok(Key::digest(s.to_str()?.as_bytes()));
    }
    if let Ok(b) = k.downcast::<PyBytes>() {
        return Ok(Key::digest(b.as_bytes()));
    }
    // `to_string()` is Python code run under this Rust frame: `gil::held`.
    let _stretch = crate::gil::held(k.py());
    match k.call_method0("to_string") {
        Ok(s) => Ok(Key::digest(s.downcast::<PyString>()?.to_str()?.as_bytes())),
        Err(_) => Err(PyTypeError::new_err(format!(
            "daxkv: a key must be str, bytes or have to_string() (got {})",
            k.get_type().name()?
        ))),
    }
}

fn keys_of(keys: &Bound<'_, PyAny>) -> PyResult<Vec<Key>> {
    // Iterating `keys` may run Python code (a generator): `gil::held`.
    let _stretch = crate::gil::held(keys.py());
    keys.try_iter()?.map(|k| key_of(&k?)).collect()
}

/// Open errors in the wording of LMCache's `DaxCore`
/// (docs/lmcache-dax-behavior.md §2.1), with ours after. The caller's
/// faults (a bad size, a missing or too small device) are
/// `daxkv.DaxConfigError`, a `ValueError` that is also the `RuntimeError`
/// upstream raises for a device it cannot open or that is too small.
fn open_error(py: Python<'_>, path: &str, size_bytes: usize, e: StoreError) -> PyErr {
    let callers = |msg: String| crate::config_error(py, msg);
    match e {
        StoreError::Open(
            OpenError::FileTooSmall { file_bytes, .. }
            | OpenError::DeviceTooSmall {
                device_bytes: file_bytes,
                ..
            },
        ) => callers(format!(
            "max_dax_size_bytes ({size_bytes} bytes) exceeds device capacity ({file_bytes} bytes)"
        )),
        StoreError::Open(
            e @ (OpenError::Missing { .. }
            | OpenError::IsDirectory { .. }
            | OpenError::Unsupported { .. }),
        ) => callers(format!("Failed to open dax device {path}: {e}")),
        StoreError::Open(e @ OpenError::Open { .. }) => {
            PyRuntimeError::new_err(format!("Failed to open dax device {path}: {e}"))
        }
        StoreError::Open(OpenError::NoSlot { .. }) => {
            callers("configured arena does not fit even one slot".into())
        }
        StoreError::Open(e) if crate::device_is_callers_fault(&e) => callers(e.to_string()),
        e @ StoreError::Config { .. } => callers(e.to_string()),
        e => PyRuntimeError::new_err(format!(
            "Failed to mmap dax arena ({size_bytes} bytes) from {path}: {e}"
        )),
    }
}

thread_local! {
    /// Set on a thread while it runs the test write hook inside a put.
    static IN_WRITE_HOOK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Refuse a call from inside the test write hook that would take the
/// `positions` lock: a put with positions holds it around the hook, and the
/// lock is not reentrant, so the thread would wait for itself. The hook is
/// test-only; its error fails that put's item.
fn not_from_write_hook(what: &str) -> PyResult<()> {
    if IN_WRITE_HOOK.with(std::cell::Cell::get) {
        return Err(PyRuntimeError::new_err(format!(
            "daxkv: DaxStore.{what}() called from the store's own write hook"
        )));
    }
    Ok(())
}

/// (address, length) of an export, to use off the GIL.
fn span(v: &View) -> (usize, usize) {
    (v.addr(), v.len())
}

/// Why the restore's allocator gave no destinations.
#[derive(Debug)]
enum AllocFailed {
    /// It returned `None` (LMCache's allocator is out of memory).
    NoMemory,
    /// It raised, or returned something unusable.
    Err(PyErr),
}

impl std::fmt::Display for AllocFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AllocFailed::NoMemory => f.write_str("the allocator returned None"),
            AllocFailed::Err(e) => write!(f, "{e}"),
        }
    }
}

impl PyDaxStore {
    /// The store, for a call about to use it. Checks the owner again: the
    /// call's argument conversion before this ran the caller's Python code
    /// (a key's `to_string()`, a generator), which may have forked (`fork`
    /// module doc).
    fn store(&self) -> PyResult<Option<Arc<DaxStore>>> {
        self.owner.check("DaxStore")?;
        Ok(self
            .store
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone())
    }

    fn positions(&self) -> MutexGuard<'_, Positions> {
        self.positions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// After `keys` were removed: drop their tensors unless a key is stored
    /// again with positions. Takes the `positions` lock (call without the
    /// GIL); returns the tensors, to drop with the GIL.
    fn forget_positions(&self, store: &DaxStore, keys: &[Key]) -> Vec<Arc<Py<PyAny>>> {
        let mut m = self.positions();
        if m.is_empty() {
            return Vec::new();
        }
        let mut gone = Vec::new();
        for k in keys {
            let again = || {
                store
                    .info(*k)
                    .is_some_and(|(_, tag)| tag & HAS_POSITIONS != 0)
            };
            if m.contains_key(k) && !again() {
                gone.extend(m.remove(k));
            }
        }
        gone
    }

    fn hook(&self) -> Option<Arc<Py<PyAny>>> {
        // ORDERING: Relaxed — the hook itself is read under its mutex; this
        // flag only skips that lock when no hook was ever set.
        if !self.has_hook.load(Ordering::Relaxed) {
            return None;
        }
        self.write_hook
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[pymethods]
impl PyDaxStore {
    /// Map `size_bytes` of `device_path` (an existing device-dax node or
    /// file, or `"memfd"`) as slots of `slot_bytes`. The restore settings
    /// are LMCache's `dax.restore_workers`, `dax.restore_max_regions` and
    /// `dax.retrieve_staging_slab_bytes`; `put_workers` (threads copying one
    /// large `put_batch`) defaults to `restore_workers`. Errors use LMCache's wording:
    /// a missing or too small device is `daxkv.DaxConfigError` (a
    /// ValueError and upstream's RuntimeError), a device the system cannot
    /// open or map a RuntimeError, bad sizes ValueError. Nothing stays
    /// open on failure.
    // Python keyword arguments, each with a default: a struct would only
    // move them into a dict.
    #[allow(clippy::too_many_arguments)]
    #[new]
    #[pyo3(signature = (device_path, size_bytes, slot_bytes, restore_workers = 1, restore_max_regions = 1, staging_slab_bytes = None, put_workers = None))]
    fn new(
        py: Python<'_>,
        device_path: &str,
        size_bytes: usize,
        slot_bytes: usize,
        restore_workers: usize,
        restore_max_regions: usize,
        staging_slab_bytes: Option<usize>,
        put_workers: Option<usize>,
    ) -> PyResult<Self> {
        if device_path.is_empty() {
            return Err(PyValueError::new_err(
                "device_path must be a non-empty string",
            ));
        }
        // As the engine's config and hotplug refuse it: a path with control
        // or invisible characters shows in logs as another path.
        daxkv::engine::check_device_path(device_path)
            .map_err(|why| PyValueError::new_err(format!("device_path {why}")))?;
        let source = if device_path == "memfd" {
            ArenaSource::Memfd
        } else {
            ArenaSource::Path(device_path.into())
        };
        // No growth here: the index is sized for this mapping, not for
        // the whole file or device.
        let arena = ArenaSpec::new(source, size_bytes).max_size_bytes(size_bytes);
        let mut cfg = StoreConfig::new(CoreConfig::new(arena, slot_bytes));
        cfg.async_put_workers = 0;
        cfg.restore_workers = restore_workers;
        cfg.restore_max_regions = restore_max_regions;
        cfg.put_workers = put_workers.unwrap_or(restore_workers);
        cfg.staging_slab_bytes = staging_slab_bytes.unwrap_or_else(|| {
            (256 << 20usize).max(restore_max_regions.saturating_mul(slot_bytes))
        });
        let store = crate::gil::release(py, || DaxStore::open(&cfg))
            .map_err(|e| open_error(py, device_path, size_bytes, e))?;
        let core = store.core();
        Ok(PyDaxStore {
            slot_bytes: core.slot_bytes(),
            max_slots: core.max_slots(),
            arena_bytes: core.arena_bytes(),
            device_path: device_path.to_string(),
            store: RwLock::new(Some(Arc::new(store))),
            positions: Mutex::new(Map::default()),
            write_hook: Mutex::new(None),
            has_hook: AtomicBool::new(false),
            owner: crate::fork::Owner::here(),
        })
    }

    /// Bytes per slot: the largest object.
    #[getter]
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Slots in the arena.
    #[getter]
    fn max_slots(&self) -> usize {
        self.max_slots
    }

    /// Bytes addressable as slots (`max_slots × slot_bytes`).
    #[getter]
    fn arena_bytes(&self) -> usize {
        self.arena_bytes
    }

    /// The path given (or `"memfd"`).
    #[getter]
    fn device_path(&self) -> &str {
        &self.device_path
    }

    /// True once `close()` was called.
    #[getter]
    fn closed(&self) -> PyResult<bool> {
        self.owner.check("DaxStore")?;
        Ok(self.store()?.is_none_or(|s| s.core().is_closing()))
    }

    /// Committed? With `pin`, a hit also takes one lookup lock.
    #[pyo3(signature = (key, pin = false))]
    fn contains(&self, key: &Bound<'_, PyAny>, pin: bool) -> PyResult<bool> {
        self.owner.check("DaxStore")?;
        let k = key_of(key)?;
        Ok(self.store()?.is_some_and(|s| s.contains(k, pin)))
    }

    /// True while a put of `key` is in flight.
    fn has_inflight(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.owner.check("DaxStore")?;
        let k = key_of(key)?;
        Ok(self.store()?.is_some_and(|s| s.exists_in_put_tasks(k)))
    }

    /// Lock + 1 if present; whether it is present.
    fn pin(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.owner.check("DaxStore")?;
        let k = key_of(key)?;
        Ok(self.store()?.is_some_and(|s| s.pin(k)))
    }

    /// Lock − 1; whether the key still exists.
    fn unpin(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.owner.check("DaxStore")?;
        let k = key_of(key)?;
        Ok(self.store()?.is_some_and(|s| s.unpin(k)))
    }

    /// The key's lookup lock count (0 if absent).
    fn lock_count(&self, key: &Bound<'_, PyAny>) -> PyResult<u32> {
        self.owner.check("DaxStore")?;
        let k = key_of(key)?;
        Ok(self.store()?.map_or(0, |s| s.core().lock_count(k)))
    }

    /// Number of consecutive hits from the start; pins each if asked.
    #[pyo3(signature = (keys, pin = false))]
    fn batched_contains(&self, keys: &Bound<'_, PyAny>, pin: bool) -> PyResult<usize> {
        self.owner.check("DaxStore")?;
        let keys = keys_of(keys)?;
        Ok(self.store()?.map_or(0, |s| s.batched_contains(&keys, pin)))
    }

    /// Remove (`force`: also locked keys, and cancel an in-flight put).
    #[pyo3(signature = (key, force = true))]
    fn remove(&self, py: Python<'_>, key: &Bound<'_, PyAny>, force: bool) -> PyResult<bool> {
        Ok(self.remove_many(py, PyList::new(py, [key])?.as_any(), force)? == 1)
    }

    /// Remove many; how many were removed.
    #[pyo3(signature = (keys, force = true))]
    fn remove_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, force: bool) -> PyResult<usize> {
        self.owner.check("DaxStore")?;
        not_from_write_hook("remove")?;
        let keys = keys_of(keys)?;
        let Some(store) = self.store()? else {
            return Ok(0);
        };
        let (n, dropped) = crate::gil::release(py, || {
            let done = store.core().delete_many(&keys, force);
            let removed: Vec<Key> = keys
                .iter()
                .zip(&done)
                .filter(|(_, &d)| d)
                .map(|(k, _)| *k)
                .collect();
            (removed.len(), self.forget_positions(&store, &removed))
        });
        drop(dropped);
        Ok(n)
    }

    /// Store `bufs[i]` (`MemoryObj`s or C-contiguous buffers, each at
    /// most `slot_bytes`)
    /// under `keys[i]` with tag `tags[i]` (< 2^31) and, where
    /// `positions[i]` is not None, that object as its cached positions,
    /// with the GIL released ([`DaxStore::put_batch_with`]: in order,
    /// stopping at the first key that finds no free slot; a large batch
    /// that fits is copied on several threads; a batch with positions runs
    /// in order on this thread). Returns `(outcomes, full_at)`: one outcome
    /// per key (0 stored, 1 already stored or in flight, 2 canceled by a
    /// forced remove, 3 closing, 4 copy failed, 5 not tried) and the index
    /// of the key that found the arena full, or -1. Callers keep the
    /// buffers unchanged meanwhile.
    #[pyo3(signature = (keys, bufs, tags, positions = None))]
    fn put_batch(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        bufs: &Bound<'_, PyAny>,
        tags: Vec<u32>,
        positions: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Vec<u8>, isize)> {
        self.owner.check("DaxStore")?;
        not_from_write_hook("put_batch")?;
        let keys = keys_of(keys)?;
        let views = crate::export_objs(bufs, false)?;
        let pos: Vec<Option<Arc<Py<PyAny>>>> = match positions {
            None => vec![None; keys.len()],
            Some(p) => {
                // Iterating may run Python code (a generator): `gil::held`.
                let _stretch = crate::gil::held(py);
                p.try_iter()?
                    .map(|p| {
                        let p = p?;
                        Ok((!p.is_none()).then(|| Arc::new(p.unbind())))
                    })
                    .collect::<PyResult<_>>()?
            }
        };
        if views.len() != keys.len() || tags.len() != keys.len() || pos.len() != keys.len() {
            return Err(PyValueError::new_err(format!(
                "daxkv: put_batch: {} keys, {} buffers, {} tags, {} positions",
                keys.len(),
                views.len(),
                tags.len(),
                pos.len()
            )));
        }
        if let Some(t) = tags.iter().find(|&&t| t & HAS_POSITIONS != 0) {
            return Err(PyValueError::new_err(format!(
                "daxkv: put_batch: tag {t} uses bit 31 (reserved)"
            )));
        }
        if let Some((i, v)) = views
            .iter()
            .enumerate()
            .find(|(_, v)| v.len() > self.slot_bytes)
        {
            return Err(PyValueError::new_err(format!(
                "daxkv: put_batch: buffer {i} is {} bytes, more than slot_bytes {}",
                v.len(),
                self.slot_bytes
            )));
        }
        let Some(store) = self.store()? else {
            return Ok((vec![PUT_CLOSED; keys.len()], -1));
        };
        let spans: Vec<(usize, usize)> = views.iter().map(span).collect();
        let hook = self.hook();
        // The copy of item `i`: the test hook, if any, then the bytes.
        let write = |i: usize, w: &SlotWriter<'_>| -> bool {
            if let Some(h) = &hook {
                IN_WRITE_HOOK.with(|f| f.set(true));
                let ok = crate::gil::with_gil(|py| match h.call0(py) {
                    Ok(_) => true,
                    Err(e) => {
                        e.print(py);
                        false
                    }
                });
                IN_WRITE_HOOK.with(|f| f.set(false));
                if !ok {
                    return false;
                }
            }
            let (addr, len) = spans[i];
            // An empty object may export a null address (`torch.empty(0)`),
            // which no slice may be made from.
            let src: &[u8] = if len == 0 {
                &[]
            } else {
                // SAFETY: `views[i]` (alive until after `allow_threads`
                // returns) exports `len` readable bytes at `addr`, which
                // stay in place until the export is released. LMCache does
                // not write an object while it is being put (it holds a
                // reference for the put), the contract its own
                // memmove-based backend relies on.
                unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
            };
            w.write(0, src)
        };
        let n = keys.len();
        let (codes, full_at, replaced) = crate::gil::release(py, || {
            let mut replaced = Vec::new();
            let mut results: Vec<Option<Result<PutOutcome, StoreError>>> = Vec::with_capacity(n);
            let mut full_at = None;
            if pos.iter().all(Option::is_none) {
                let items: Vec<(Key, usize, u32)> =
                    (0..n).map(|i| (keys[i], spans[i].1, tags[i])).collect();
                let b = store.put_batch_with(&items, write);
                results = b.results;
                full_at = b.full_at;
            } else {
                // In order on this thread; an item with positions holds
                // the `positions` lock from before its reservation until
                // its tensor is in the map (module doc).
                for (i, &k) in keys.iter().enumerate() {
                    let len = spans[i].1;
                    let r = match &pos[i] {
                        None => store.put_with_writer(k, len, tags[i], |w| write(i, w)),
                        Some(p) => {
                            let mut m = self.positions();
                            let r = store
                                .put_with_writer(k, len, tags[i] | HAS_POSITIONS, |w| write(i, w));
                            if matches!(r, Ok(PutOutcome::Stored)) {
                                replaced.extend(m.insert(k, p.clone()));
                            }
                            r
                        }
                    };
                    if matches!(
                        r,
                        Err(StoreError::Full | StoreError::Put(PutError::IndexFull))
                    ) {
                        full_at = Some(i);
                        break;
                    }
                    results.push(Some(r));
                }
                results.resize_with(n, || None);
            }
            let codes: Vec<u8> = results
                .into_iter()
                .map(|r| match r {
                    None => PUT_NOT_TRIED,
                    Some(Ok(PutOutcome::Stored)) => PUT_STORED,
                    Some(Ok(PutOutcome::AlreadyPresent)) => PUT_PRESENT,
                    Some(Err(StoreError::Put(PutError::Canceled))) => PUT_CANCELED,
                    Some(Err(StoreError::Closed)) => PUT_CLOSED,
                    Some(Err(_)) => PUT_FAILED,
                })
                .collect();
            (codes, full_at.map_or(-1, |i| i as isize), replaced)
        });
        drop(replaced);
        drop(views);
        Ok((codes, full_at))
    }

    /// Batched restore (docs/lmcache-dax-behavior.md §6.4), in Rust with
    /// the GIL released except for `alloc`.
    ///
    /// The keys are reserved (positional, or the hit prefix with
    /// `prefix_only`), then `alloc(hits)` is called with one
    /// `(index, tag, nbytes)` per hit (key order; `index` is the key's
    /// position) and returns one `MemoryObj` or writable, C-contiguous
    /// buffer per hit (at least `nbytes` long), or None when
    /// memory is short. The payloads are copied straight into the buffers,
    /// sorted by device offset, in regions on up to `restore_workers`
    /// threads. A key removed meanwhile keeps its slot until this returns.
    ///
    /// Returns None if `alloc` returned None, else one entry per hit: the
    /// object stored as its cached positions, or None. An exception from
    /// `alloc` propagates; a short or overlapping buffer is a RuntimeError;
    /// either way nothing was copied. After close: an empty list.
    fn restore(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        prefix_only: bool,
        alloc: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Vec<PyObject>>> {
        self.owner.check("DaxStore")?;
        not_from_write_hook("restore")?;
        let keys = keys_of(keys)?;
        let Some(store) = self.store()? else {
            return Ok(Some(Vec::new()));
        };
        let alloc = alloc.clone().unbind();
        // Filled inside `alloc` below; outlive the copies (released here,
        // with the GIL, after `allow_threads`).
        let mut views: Vec<View> = Vec::new();
        let mut found: Vec<Option<Arc<Py<PyAny>>>> = Vec::new();
        let r = crate::gil::release(py, || {
            // Held across the reservation until the tensors are read.
            let mut lock = Some(self.positions());
            let r = store.restore_into(&keys, prefix_only, |rs| {
                let m = lock.take().expect("alloc runs once");
                found = rs
                    .iter()
                    .map(|r| {
                        (r.meta & HAS_POSITIONS != 0)
                            .then(|| m.get(&r.key).cloned())
                            .flatten()
                    })
                    .collect();
                drop(m);
                let hits: Vec<(usize, u32, usize)> = rs
                    .iter()
                    .map(|r| (r.index, r.meta & !HAS_POSITIONS, r.len))
                    .collect();
                let spans =
                    crate::gil::with_gil(|py| -> Result<Vec<(usize, usize)>, AllocFailed> {
                        let out = alloc.call1(py, (hits,)).map_err(AllocFailed::Err)?;
                        let out = out.bind(py);
                        if out.is_none() {
                            return Err(AllocFailed::NoMemory);
                        }
                        views = crate::export_objs(out, true).map_err(AllocFailed::Err)?;
                        Ok(views.iter().map(span).collect())
                    })?;
                let mut by_addr = spans.clone();
                by_addr.sort_unstable();
                if let Some(w) = by_addr.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
                    return Err(AllocFailed::Err(PyBufferError::new_err(format!(
                        "daxkv: restore destinations overlap ({:#x}+{} and {:#x})",
                        w[0].0, w[0].1, w[1].0
                    ))));
                }
                Ok(spans
                    .into_iter()
                    .map(|(addr, len)| -> &mut [u8] {
                        // An empty object may export a null address.
                        if len == 0 {
                            return &mut [];
                        }
                        // SAFETY: each (addr, len) is a live writable export
                        // (kept in `views` until after `restore_into`
                        // returns); the exports do not overlap (checked just
                        // above), so these are the only references to those
                        // bytes in this process while the copy runs, and
                        // the objects are fresh outputs nobody else uses yet.
                        unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
                    })
                    .collect())
            });
            drop(lock);
            r
        });
        let out = match r {
            Ok(_) => Ok(Some(
                found
                    .iter()
                    .map(|p| p.as_ref().map_or_else(|| py.None(), |p| p.clone_ref(py)))
                    .collect(),
            )),
            Err(RestoreError::Alloc(AllocFailed::NoMemory)) => Ok(None),
            Err(RestoreError::Alloc(AllocFailed::Err(e))) => Err(e),
            Err(RestoreError::Closed) => Ok(Some(Vec::new())),
            Err(e) => Err(PyRuntimeError::new_err(format!("daxkv: restore: {e}"))),
        };
        drop(views);
        drop(found);
        out
    }

    /// Core status: `live_slot_count`, `locked_key_count`,
    /// `borrowed_slot_count`, `active_read_count`, `active_write_count`,
    /// `committed_key_count`, `max_slots`, `slot_bytes`, `closing`, … plus
    /// `positions_count`. `{"closing": True}` after close.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.owner.check("DaxStore")?;
        not_from_write_hook("status")?;
        let d = PyDict::new(py);
        let Some(store) = self.store()? else {
            d.set_item("closing", true)?;
            d.set_item("is_healthy", false)?;
            return Ok(d);
        };
        let s = crate::gil::release(py, || store.core().status());
        d.set_item("is_healthy", s.is_healthy)?;
        d.set_item("device_path", &self.device_path)?;
        d.set_item("max_dax_size_bytes", s.max_dax_size_bytes)?;
        d.set_item("slot_bytes", s.slot_bytes)?;
        d.set_item("max_slots", s.max_slots)?;
        d.set_item("live_slot_count", s.live_slot_count)?;
        d.set_item("committed_key_count", s.committed_key_count)?;
        d.set_item("locked_key_count", s.locked_key_count)?;
        d.set_item("borrowed_slot_count", s.borrowed_slot_count)?;
        d.set_item("pending_free_slot_count", s.pending_free_slot_count)?;
        d.set_item("active_read_count", s.active_read_count)?;
        d.set_item("active_write_count", s.active_write_count)?;
        d.set_item("closing", s.closing)?;
        d.set_item("supports_restart_recovery", false)?;
        let n = crate::gil::release(py, || self.positions().len());
        d.set_item("positions_count", n)?;
        Ok(d)
    }

    /// Raise RuntimeError if the slot bookkeeping is inconsistent (tests;
    /// meaningful only while nothing is in flight).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.owner.check("DaxStore")?;
        not_from_write_hook("check_invariants")?;
        let Some(store) = self.store()? else {
            return Ok(());
        };
        crate::gil::release(py, || store.core().check_invariants())
            .map_err(|e| PyRuntimeError::new_err(format!("daxkv: invariants: {e}")))
    }

    /// Test hook: `hook()` runs inside every put's copy (with the key in
    /// flight and its slot reserved); raising fails that put. None clears.
    fn _set_write_hook(&self, hook: Option<Py<PyAny>>) {
        let on = hook.is_some();
        *self
            .write_hook
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = hook.map(Arc::new);
        // ORDERING: Relaxed — see `hook`: the mutex orders the hook itself.
        self.has_hook.store(on, Ordering::Relaxed);
    }

    /// Refuse new work, wait for in-flight puts and reads (at most the
    /// arena's drain timeout, 5 s; a straggler keeps the mapping alive
    /// until it ends), unmap, and close the fd once no call uses the store.
    /// Idempotent.
    fn close(&self, py: Python<'_>) {
        if self.owner.forked() {
            return;
        }
        let dropped = crate::gil::release(py, || {
            let store = self
                .store
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some(s) = store {
                s.close();
            }
            std::mem::take(&mut *self.positions())
        });
        drop(dropped);
    }
}

impl Drop for PyDaxStore {
    fn drop(&mut self) {
        if self.owner.forked() {
            // A forked child (`fork` module doc): the store is leaked, never
            // closed here (its close would wait on the parent's work).
            let store = self
                .store
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            std::mem::forget(store);
        }
    }
}
