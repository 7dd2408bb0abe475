//! # `DaxL2Core`: the Rust half of `daxkv.lmcache.DaxL2Adapter`
//!
//! LMCache's `plugin` path (docs/lmcache-dax-behavior.md §7.2) loads a
//! Python subclass of `L2AdapterInterface`; that subclass
//! (`python/daxkv/lmcache/_l2_adapter.py`) is a thin shell over this class,
//! which holds the [`Engine`] and speaks in LMCache's terms:
//!
//! | LMCache (docs/lmcache-dax-behavior.md §1.2) | here | engine |
//! |---|---|---|
//! | three event fds | [`DaxL2Core::event_fds`] | the engine's own three eventfds |
//! | `submit_store_task` / `pop_completed_store_tasks` | `submit_store` / `pop_completed_stores` | `submit_store` (raw sources) / `pop_completed_stores` |
//! | `submit_lookup_and_lock_task` / `query_lookup_and_lock_result` | `submit_lookup` / `query_lookup` | `lookup_and_lock_into` on the calling thread, completed here (locks held in the engine) |
//! | `submit_unlock` | `submit_unlock` | `submit_unlock` (one lock, wherever the key is, under its claim) |
//! | `submit_load_task` / `query_load_result` | `submit_load` / `query_load` | `submit_load_raw` / `query_load` |
//! | `delete`, `get_usage`, `report_status` | `delete`, `usage`, `status` | the same |
//! | `reconfigure_status` / `reconfigure` | the same | [`DaxReconfigure`] (upstream's envelope and codes) |
//! | `owns_device` | `owns_device` | [`Engine::owns_device`] |
//!
//! ## Keys
//!
//! An `ObjectKey` becomes the native connector's wire string
//! `model@rank(08x)@group(x)@hash(hex)[@salt]`
//! (docs/lmcache-dax-behavior.md §7.1), digested as the
//! connector digests it: one key names one engine entry on both paths.
//! `str` and `bytes` keys are refused with `TypeError` at every entry
//! (submit, unlock, exists, delete) before anything is submitted or
//! deleted: LMCache's base class reads `key.cache_salt` when it counts a
//! task's bytes, so such a key would be stored (or deleted) and its result
//! then lost in the listener bookkeeping.
//!
//! ## Buffers and their lifetime
//!
//! Each object's bytes (what its `byte_array` describes: the logical size,
//! so a tail chunk keeps its own length; or the object itself when it
//! exports a buffer) are handed to the engine as [`RawBuf`]s: zero-copy.
//! An LMCache `MemoryObj` over a contiguous CPU tensor is read from the
//! tensor (`raw_data.data_ptr()`, `get_size()` bytes, the tensor
//! referenced by the view), since building `byte_array` (a torch view and
//! a ctypes array per call) costs more than the rest of a submit; one
//! over a tensor that is not on the CPU or not contiguous is refused with
//! `BufferError` (`byte_array` would describe bytes that are not the
//! tensor's); anything else is exported with `PyObject_GetBuffer`. The
//! task entry keeps the exports *and* a
//! reference to the caller's lists (the objects, whose memory the exports
//! describe, and the keys, for the listener events) until the result is
//! collected or the adapter is closed (which waits for every task), so the
//! memory outlives every worker that may touch it even if the caller drops
//! its objects early.
//!
//! Two destinations of one load that overlap would be written by two
//! workers at once (two `&mut` to the same bytes): a load whose destinations
//! overlap is refused with `ValueError` before anything is submitted
//! (`daxkv::plumbing::busy`; `test_l2_adapter.py::test_overlapping_load_destinations_refused`).
//! Across tasks the same record refuses a buffer another task in flight
//! writes or reads (`test_l2_races.py`).
//!
//! ## Locks and the GIL (the interleaving that would deadlock)
//!
//! `state` is locked only with the GIL released (inside `allow_threads`),
//! and the GIL is never taken while `state` is held: an export (`View`) or
//! a Python reference dropped under the lock would take the GIL, and
//!
//! ```text
//! thread A: allow_threads { lock(state); drop(View) → wait for GIL }
//! thread B: holds the GIL; lock(state) → waits for A          (deadlock)
//! ```
//!
//! So everything Python-owned leaves the critical section in a `Released`
//! bag and is dropped after `allow_threads` returns, with the GIL held.
//! The one callback into Python under `allow_threads` (`device_owners`,
//! during a reconfigure `add`) runs with no lock of ours held
//! (`test_reconfigure_add_with_owners_callback_under_load` calls it while
//! other threads submit).
//!
//! ## Completions that never reach the engine
//!
//! A submit the engine refuses for a reason other than closing (its task
//! table full) completes at once as a failure, under a negative id (engine
//! ids are never negative, so the two can never meet, however long the
//! engine runs), and writes the kind's eventfd, so every task the caller
//! got an id for completes. A lookup is completed here the same way, with
//! its answer: it is done on the calling thread (`submit_lookup`). The
//! write goes through [`Engine::signal`], which holds the engine's worker
//! pools (and so their fds) for the write: it lands on this engine's
//! eventfd or, once the engine closed, nowhere — never on a closed and
//! reused fd number. (The same call re-signals a kind whose result a
//! raising listener left behind, `resignal`, and announces deletes the
//! engine made on its own, `KnownKeys::on_keys_deleted`.) The submit
//! itself runs under `state` while it is not closed, so a task is never
//! recorded after `close` has collected the table.
//!
//! ## Worker panics
//!
//! A panic in a task part fails that task in the engine (its result is
//! published, the worker keeps serving): the task completes like any other
//! and its exports are released when it is collected
//! (`test_l2_adapter.py::test_worker_panic_fails_only_its_task`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use daxkv::control::reconfigure::{DaxReconfigure, Reconfigurable};
use daxkv::engine::{Answer, Engine, EngineError, Listener, TaskId, TaskKind};
use daxkv::plumbing::buf::{Buf, RawBuf};
use daxkv::plumbing::busy::{Busy, Clash, Held};
use daxkv::plumbing::hash::Map;
use daxkv::Key;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};
use serde_json::Value;

use crate::{json_to_py, open_engine, parse_config, View};

mod known;
use known::Known;

/// A task id as the caller sees it: an engine [`TaskId`] (never
/// negative), or a negative id for a task completed here without the
/// engine (a refused submit).
///
/// A Python `int` both ways. Not a plain `i128`: under the stable ABI
/// pyo3 converts 128-bit integers with Python arithmetic (a shift and an
/// or, three objects), once per submit and per result; every id up to
/// `i64::MAX` (all of them, in practice: an engine id's sequence would
/// take years to reach the top bit) converts with one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Id(i128);

impl From<u64> for Id {
    fn from(v: u64) -> Id {
        Id(i128::from(v))
    }
}

impl<'py> IntoPyObject<'py> for Id {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(match i64::try_from(self.0) {
            Ok(v) => v.into_pyobject(py)?.into_any(),
            Err(_) => self.0.into_pyobject(py)?.into_any(),
        })
    }
}

impl FromPyObject<'_> for Id {
    fn extract_bound(ob: &Bound<'_, PyAny>) -> PyResult<Id> {
        match ob.extract::<i64>() {
            Ok(v) => Ok(Id(i128::from(v))),
            Err(_) => ob.extract::<i128>().map(Id),
        }
    }
}

/// The message of a submit after `close` (upstream's words).
const CLOSING: &str = "DaxL2Adapter is closing";

/// One task the caller has an id for and has not collected.
struct Task {
    kind: TaskKind,
    /// Keys in the task (the bitmap's length).
    n: usize,
    /// The caller's key objects (stores and loads: the listeners' events).
    keys: Vec<Py<PyAny>>,
    /// Their engine keys (stores: checked and recorded at collection).
    digests: Vec<Key>,
    /// Stores: a second reference to each key object, moved into
    /// [`KnownKeys`] at collection (a `Py` is cloned only with the GIL).
    record: Vec<Py<PyAny>>,
    /// The caller's object list: keeps the memory the exports describe.
    objs: Option<Py<PyAny>>,
    /// The exports handed to the engine (empty for lookups).
    views: Vec<View>,
    /// Their ranges in [`State::busy`], given back when the task leaves
    /// the table ([`State::remove`]) or the engine has stopped (`close`).
    held: Held,
    /// A task completed here under a negative id: its result bits (a
    /// lookup done on the caller), or `None` (a refused submit: every key
    /// failed).
    bits: Option<Vec<bool>>,
}

/// Python-owned things to drop once the GIL is held again
/// ([`Released::release`]; dropped any other way, each part takes the GIL
/// itself).
#[derive(Default)]
struct Released {
    views: Vec<View>,
    objs: Vec<Py<PyAny>>,
}

impl Released {
    /// Give everything back, with the GIL held.
    fn release(self, py: Python<'_>) {
        for v in self.views {
            v.release(py);
        }
        for o in self.objs {
            o.drop_ref(py);
        }
    }

    /// Keep the task's Python-owned parts for dropping; hand back its key
    /// objects and engine keys.
    fn task(&mut self, t: Task) -> (Vec<Py<PyAny>>, Vec<Key>, Vec<Py<PyAny>>) {
        self.views.extend(t.views);
        self.objs.extend(t.objs);
        (t.keys, t.digests, t.record)
    }
}

/// The engine's delete events in LMCache's terms ([`known`] module doc):
/// the key objects of the keys the engine holds, registered as the
/// engine's listener.
#[derive(Default)]
struct KnownKeys {
    map: Mutex<Known<Py<PyAny>>>,
    /// The engine, to ask whether a deleted key is held again (set once,
    /// right after the engine opens; weak: the engine holds this).
    engine: std::sync::OnceLock<std::sync::Weak<Engine>>,
}

impl KnownKeys {
    fn lock(&self) -> MutexGuard<'_, Known<Py<PyAny>>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Listener for KnownKeys {
    /// Called with no engine state held (a deleting thread, or the
    /// hotplug thread), never holding the GIL: it only moves references.
    ///
    /// Deletes made due here are announced on the store eventfd: LMCache's
    /// store controller collects (`pop_completed_store_tasks`, which tells
    /// them) only when that fd polls readable, and a delete the engine
    /// makes on its own — a failed device's keys, reported by an idle
    /// worker, a status call or a `/metrics` scrape; a hotplug evict —
    /// has no store completion behind it: without the write LMCache's
    /// eviction policy and byte counters would keep keys the engine no
    /// longer holds until some unrelated store completed. (The adapter's
    /// own `delete` tells its deletes at once; the write then wakes the
    /// store controller for an empty collection, a few µs.)
    fn on_keys_deleted(&self, keys: &[Key]) {
        let mut map = self.lock();
        let engine = self.engine.get().and_then(std::sync::Weak::upgrade);
        // Under `map`, as `record_stored` checks `exists` (known.rs,
        // interleaving 3): a key the engine holds again was re-stored
        // between the delete and this call; its entry stands for the
        // newer copy.
        let held = match &engine {
            Some(e) => e.exists(keys),
            None => vec![false; keys.len()],
        };
        if map.on_deleted(keys, &held) > 0 {
            if let Some(e) = &engine {
                // Holds the pool for the write: never another file's fd
                // after a racing close (`Engine::signal`).
                e.signal(TaskKind::Store);
            }
        }
    }
}

/// Everything behind the core's one mutex (locked only off the GIL).
struct State {
    /// Tasks not collected, by id.
    tasks: Map<Id, Task>,
    /// Refused stores, for the next `pop_completed_stores`.
    refused_stores: Vec<Id>,
    /// Set (first thing) by `close`: submits raise from then on.
    closed: bool,
    /// The memory of the tasks in flight (`daxkv::plumbing::busy`): a load into a
    /// buffer another task still reads or writes is refused.
    busy: Busy,
    /// Tags [`Busy`] entries with the submit they belong to.
    busy_tag: u64,
}

impl State {
    /// Take a task out of the table, giving its ranges back.
    fn remove(&mut self, id: &Id) -> Option<Task> {
        let mut t = self.tasks.remove(id)?;
        self.busy.release(std::mem::take(&mut t.held));
        Some(t)
    }
}

/// The daxkv engine in LMCache's L2 adapter terms (module doc). Thread
/// safe: LMCache's store and prefetch controllers, its eviction controller
/// and the HTTP reconfigure thread call it at once.
#[pyclass(module = "daxkv._daxkv", frozen)]
pub struct DaxL2Core {
    engine: Arc<Engine>,
    known: Arc<KnownKeys>,
    reconf: DaxReconfigure,
    state: Mutex<State>,
    next_local: AtomicU64,
    slot_bytes: usize,
    /// Held by `close` from start to end.
    closing: Mutex<()>,
    /// The `l2_name` label of `metrics_text` (`adapter_params["l2_name"]`,
    /// default `"plugin"`).
    l2_name: String,
    /// The process that opened it (`fork` module doc).
    owner: crate::fork::Owner,
    /// `/metrics` and `/health` from `adapter_params["http"]` (control
    /// module doc); stopped first by `close`.
    http: Mutex<Option<daxkv::control::http::HttpServer>>,
    /// Its address, while it runs.
    http_addr: Option<std::net::SocketAddr>,
}

/// `adapter_params["http"]` on the plugin path serves `/metrics` and
/// `/health` only: an `add` allow-list would allow nothing.
fn plugin_http_check(control: &crate::control::ControlParams) -> PyResult<()> {
    match &control.http {
        Some(h) if !h.allow_prefixes.is_empty() => Err(pyo3::exceptions::PyValueError::new_err(
            "config: http.allow_prefixes: not on the plugin path (its port serves \
                 /metrics and /health; hotplug goes through LMCache's \
                 /reconfigure/plugin/l2/*)",
        )),
        _ => Ok(()),
    }
}

/// A collection ticket ([`known`]), per store `(task id, success,
/// bytes)`, the keys those stores hold now (every task's, in order), their
/// sizes (`None`: each is a first store, `slot_bytes`), and the keys
/// deleted since the last call ([`DaxL2Core::take_deleted`]).
type Collected = (
    u64,
    Vec<(Id, bool, u64)>,
    Vec<Py<PyAny>>,
    Option<Vec<usize>>,
    Vec<Py<PyAny>>,
);

fn closing_err() -> PyErr {
    PyRuntimeError::new_err(CLOSING)
}

/// Append `v` as LMCache's f-string writes it, `format(v, "08x")` for
/// `width` 8 and `format(v, "x")` for 0: a plain `int` that fits a `u64`
/// here, as lowercase hex zero-padded to `width`; anything else (negative,
/// past `u64`, an `int` subclass with its own `__format__`, not an
/// integer: a `TypeError`) by Python itself.
fn push_hex(out: &mut Vec<u8>, v: &Bound<'_, PyAny>, width: usize) -> PyResult<()> {
    if v.is_exact_instance_of::<pyo3::types::PyInt>() {
        if let Some(n) = crate::as_usize(v) {
            push_hex_u64(out, n as u64, width);
            return Ok(());
        }
    }
    push_formatted(out, v, if width == 0 { "x" } else { "08x" })
}

/// Append `format(v, spec)` (what an f-string's `{v:spec}` writes: the
/// value's own `__format__`).
fn push_formatted(out: &mut Vec<u8>, v: &Bound<'_, PyAny>, spec: &str) -> PyResult<()> {
    let py = v.py();
    let spec = PyString::new(py, spec);
    // SAFETY: both are live objects and we hold the GIL; the result is a
    // new reference (or NULL with an exception set), owned below.
    let s = unsafe { ffi::PyObject_Format(v.as_ptr(), spec.as_ptr()) };
    // SAFETY: as above.
    let s = unsafe { Bound::from_owned_ptr_or_err(py, s) }?;
    out.extend_from_slice(s.downcast::<PyString>()?.to_str()?.as_bytes());
    Ok(())
}

/// Append a `str` field as `f"{v}"` writes it: a plain `str` as it is,
/// anything else (a `str` subclass such as a `(str, Enum)` member, which
/// Python 3.11 formats as `Class.NAME`) through its `__format__`.
fn push_str_field(out: &mut Vec<u8>, v: &Bound<'_, PyAny>) -> PyResult<()> {
    if v.is_exact_instance_of::<PyString>() {
        out.extend_from_slice(v.downcast::<PyString>()?.to_str()?.as_bytes());
        Ok(())
    } else {
        push_formatted(out, v, "")
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// `format!("{n:0width$x}")` appended to `out`, without `core::fmt` (two
/// of these run per key on every submit; `fmt` was most of the key's
/// conversion): the digits written into a stack buffer, then one copy.
fn push_hex_u64(out: &mut Vec<u8>, n: u64, width: usize) {
    let digits = (64 - n.leading_zeros() as usize).div_ceil(4).max(1);
    if digits < width {
        out.resize(out.len() + (width - digits), b'0');
    }
    let mut buf = [0u8; 16];
    for (i, d) in buf[16 - digits..].iter_mut().rev().enumerate() {
        *d = HEX[((n >> (4 * i)) & 15) as usize];
    }
    out.extend_from_slice(&buf[16 - digits..]);
}

/// `bytes.hex()` appended to `out`: two digits a byte, written in place.
fn push_hex_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    let start = out.len();
    out.resize(start + 2 * bytes.len(), 0);
    for (pair, &b) in out[start..].chunks_exact_mut(2).zip(bytes) {
        pair[0] = HEX[usize::from(b >> 4)];
        pair[1] = HEX[usize::from(b & 15)];
    }
}

/// The wire string of an `ObjectKey` (module doc), into `out` (its UTF-8
/// bytes: what the digest is taken of).
fn wire_string(out: &mut Vec<u8>, k: &Bound<'_, PyAny>) -> PyResult<()> {
    // Interned names: a `&str` name would build a new Python string per
    // attribute per key.
    let py = k.py();
    out.clear();
    // As LMCache's `_object_key_to_string` writes each field (its
    // f-string: `__format__`, `chunk_hash.hex()`, the salt only when
    // truthy), with a fast path for the plain types LMCache makes; a
    // subclass goes through Python, so one ObjectKey is one string on the
    // `plugin` and `native_plugin` paths alike.
    push_str_field(out, &k.getattr(pyo3::intern!(py, "model_name"))?)?;
    out.push(b'@');
    push_hex(out, &k.getattr(pyo3::intern!(py, "kv_rank"))?, 8)?;
    out.push(b'@');
    push_hex(out, &k.getattr(pyo3::intern!(py, "object_group_id"))?, 0)?;
    out.push(b'@');
    let hash = k.getattr(pyo3::intern!(py, "chunk_hash"))?;
    if hash.is_exact_instance_of::<PyBytes>() {
        push_hex_bytes(out, hash.downcast::<PyBytes>()?.as_bytes());
    } else {
        // `{key.chunk_hash.hex()}`: the result formatted too.
        push_str_field(out, &hash.call_method0(pyo3::intern!(py, "hex"))?)?;
    }
    let salt = k.getattr(pyo3::intern!(py, "cache_salt"))?;
    if salt.is_exact_instance_of::<PyString>() {
        let salt = salt.downcast::<PyString>()?.to_str()?;
        if !salt.is_empty() {
            out.push(b'@');
            out.extend_from_slice(salt.as_bytes());
        }
    } else if salt.is_truthy()? {
        out.push(b'@');
        push_formatted(out, &salt, "")?;
    }
    Ok(())
}

/// Engine keys of LMCache's `ObjectKey`s (`str` / `bytes` are refused with
/// `TypeError`: module doc, "Keys").
fn object_keys(keys: &Bound<'_, PyAny>) -> PyResult<Vec<Key>> {
    // A key's attributes may be properties (Python code): `gil::held`.
    let _stretch = crate::gil::held(keys.py());
    object_keys_kept(keys, None)
}

/// [`object_keys`], keeping each key object in `kept` too. (Reading the
/// five fields in Python instead, as the adapter reads its objects,
/// measured no faster: a tuple per key costs what the C API's reads do.)
fn object_keys_kept(
    keys: &Bound<'_, PyAny>,
    mut kept: Option<&mut Vec<Py<PyAny>>>,
) -> PyResult<Vec<Key>> {
    // Sized once for a list (LMCache's), grown as they come otherwise.
    let n = keys.downcast::<PyList>().map_or(0, |l| l.len());
    let mut out = Vec::with_capacity(n);
    if let Some(v) = kept.as_deref_mut() {
        v.reserve(n);
    }
    let mut s = Vec::with_capacity(128);
    for (i, k) in keys.try_iter()?.enumerate() {
        let k = k?;
        if let Some(v) = kept.as_deref_mut() {
            v.push(k.clone().unbind());
        }
        let type_name = || {
            k.get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        };
        // Refused before anything is submitted or deleted: LMCache's base
        // class reads `key.cache_salt` when it counts a task's bytes, so a
        // `str` key would be stored or deleted and then fail (its result
        // lost) in the listener bookkeeping.
        if k.is_instance_of::<PyString>() || k.is_instance_of::<PyBytes>() {
            return Err(PyTypeError::new_err(format!(
                "daxkv: key {i}: the plugin path takes LMCache ObjectKeys, not {} (LMCache's \
                 listeners read each key's cache_salt; DaxConnector takes string keys)",
                type_name()
            )));
        }
        // An `Exception` from a field (a missing attribute, a value that
        // does not format) names the key, the original as its cause;
        // anything else (a `KeyboardInterrupt` arriving in a field's
        // `__format__`, `SystemExit`) goes through as it was raised, as it
        // would from LMCache's own `_object_key_to_string`.
        wire_string(&mut s, &k).map_err(|e| {
            let py = k.py();
            if !e.is_instance_of::<pyo3::exceptions::PyException>(py) {
                return e;
            }
            let named = PyTypeError::new_err(format!(
                "daxkv: key {i}: not an ObjectKey ({}: {})",
                type_name(),
                e.value(py)
            ));
            named.set_cause(py, Some(e));
            named
        })?;
        out.push(Key::digest(&s));
    }
    Ok(out)
}

/// A store's or a load's keys (engine keys and the key objects, kept for
/// the listeners) and its exported objects (writable for a load), of
/// equal counts. `spans`: what the adapter read of the objects in Python
/// ([`crate::export_objs_read`]).
#[allow(clippy::type_complexity)]
fn keys_and_views(
    keys: &Bound<'_, PyAny>,
    objs: &Bound<'_, PyAny>,
    writable: bool,
    spans: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Vec<Key>, Vec<Py<PyAny>>, Vec<View>)> {
    // Python code may run (`byte_array` is a property): `gil::held`.
    let _stretch = crate::gil::held(keys.py());
    let mut kept = Vec::new();
    let ks = object_keys_kept(keys, Some(&mut kept))?;
    let views = match spans {
        Some(sp) => crate::export_objs_read(sp, writable)?,
        None => crate::export_objs(objs, writable)?,
    };
    if ks.len() != views.len() {
        return Err(PyValueError::new_err(format!(
            "keys and objects must have the same length, got {} and {}",
            ks.len(),
            views.len()
        )));
    }
    Ok((ks, kept, views))
}

/// Indices of the set bits.
fn hits(bits: impl Iterator<Item = bool>) -> Vec<usize> {
    bits.enumerate()
        .filter(|(_, b)| *b)
        .map(|(i, _)| i)
        .collect()
}

impl DaxL2Core {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Complete a task here, under a negative id (module doc): a refused
    /// submit, or a lookup done on the caller. The caller holds `state`,
    /// which is not closed; the kind's eventfd is written through
    /// [`Engine::signal`].
    fn complete_here(&self, st: &mut State, t: Task) -> Id {
        // ORDERING: Relaxed — a unique number; nothing is published
        // through it (the task is published under `state`).
        let id = Id(-1 - i128::from(self.next_local.fetch_add(1, Ordering::Relaxed)));
        let kind = t.kind;
        st.tasks.insert(id, t);
        if kind == TaskKind::Store {
            st.refused_stores.push(id);
        }
        self.engine.signal(kind);
        id
    }

    /// Submit under `state` (closed → raise) and record the task, so its
    /// completion cannot be collected before the record exists.
    fn submit(
        &self,
        task: Task,
        go: impl FnOnce(&Engine, Vec<View>) -> (Result<TaskId, EngineError>, Vec<View>),
    ) -> (PyResult<Id>, Released) {
        let mut rel = Released::default();
        let mut st = self.lock();
        if st.closed {
            let (keys, _, record) = rel.task(task);
            rel.objs.extend(keys.into_iter().chain(record));
            return (Err(closing_err()), rel);
        }
        let mut task = task;
        let kind = task.kind;
        // No buffer of this task may be written while another task in
        // flight uses it, nor be read while another writes it (two
        // workers on the same bytes: undefined behaviour).
        let ranges: Vec<(usize, usize)> = task.views.iter().map(|v| (v.addr(), v.len())).collect();
        st.busy_tag += 1;
        let tag = st.busy_tag;
        let held = match kind {
            TaskKind::Load => st.busy.hold_writes(tag, &ranges),
            TaskKind::Store => st.busy.hold_reads(tag, &ranges),
            TaskKind::Lookup => Ok(Held::default()),
        };
        task.held = match held {
            Ok(h) => h,
            Err((i, clash)) => {
                let msg = match clash {
                    // Two destinations of one load: each key needs its own.
                    Clash::Batch(j) => format!(
                        "daxkv: load destinations {j} and {i} overlap (each key needs its own \
                         buffer)"
                    ),
                    Clash::InFlight(_) => format!(
                        "daxkv: {} {i} shares memory with a buffer of a task still in flight \
                         (not yet collected): a buffer being written must not alias any other \
                         buffer in flight",
                        if kind == TaskKind::Load {
                            "load destination"
                        } else {
                            "store source"
                        }
                    ),
                };
                let (keys, _, record) = rel.task(task);
                rel.objs.extend(keys.into_iter().chain(record));
                return (Err(PyValueError::new_err(msg)), rel);
            }
        };
        let (r, views) = go(&self.engine, std::mem::take(&mut task.views));
        task.views = views;
        match r {
            Ok(id) => {
                st.tasks.insert(Id::from(id.0), task);
                (Ok(Id::from(id.0)), rel)
            }
            Err(EngineError::Closing) => {
                st.busy.release(std::mem::take(&mut task.held));
                let (keys, _, record) = rel.task(task);
                rel.objs.extend(keys.into_iter().chain(record));
                (Err(closing_err()), rel)
            }
            Err(e) => {
                eprintln!(
                    "daxkv: {} task refused ({e}); it completes as failed",
                    kind.name()
                );
                // The engine never saw the buffers: release them now.
                st.busy.release(std::mem::take(&mut task.held));
                rel.views.append(&mut task.views);
                (Ok(self.complete_here(&mut st, task)), rel)
            }
        }
    }

    /// Record a collected store's keys that the engine holds now, under
    /// `ticket` ([`known`] module doc: `exists` and the record under one
    /// lock); appends them to `out.0`, and to `out.1` whether each is a
    /// first store (false: a key already recorded). Keys not held go to
    /// `rel`.
    fn record_stored(
        &self,
        keys: Vec<Py<PyAny>>,
        digests: &[Key],
        record: Vec<Py<PyAny>>,
        ticket: u64,
        rel: &mut Released,
        out: &mut (Vec<Py<PyAny>>, Vec<bool>),
    ) {
        let mut known = self.known.lock();
        let held = self.engine.exists(digests);
        for (((k, r), d), h) in keys.into_iter().zip(record).zip(digests).zip(held) {
            if !h {
                rel.objs.extend([k, r]);
                continue;
            }
            let (first, back) = known.record(*d, r, ticket);
            rel.objs.extend(back);
            out.0.push(k);
            out.1.push(first);
        }
    }

    /// Take a finished lookup or load out of the table: `Some((bitmap
    /// bits, task))` once, `None` while it runs or for an unknown id or a
    /// task of another kind.
    fn take(&self, id: Id, kind: TaskKind) -> Option<(Vec<bool>, Task)> {
        let mut st = self.lock();
        let t = st.tasks.get(&id)?;
        if t.kind != kind {
            return None;
        }
        // A task completed here (negative id): a lookup done on the
        // caller, or a refused submit (a failure).
        let Ok(engine_id) = u64::try_from(id.0).map(TaskId) else {
            let mut t = st.remove(&id)?;
            let bits = t.bits.take().unwrap_or_else(|| vec![false; t.n]);
            return Some((bits, t));
        };
        let bits = match kind {
            TaskKind::Lookup => self.engine.query_lookup(engine_id).map(|b| b.to_vec()),
            _ => self.engine.query_load(engine_id).map(|r| r.bitmap.to_vec()),
        };
        let bits = match bits {
            Answer::Pending => return None,
            Answer::Ready(b) => b,
            // Never finishes (the engine stopped under it) or its result is
            // gone: a miss on every key, so the caller never waits forever.
            Answer::Closed | Answer::Unknown | Answer::WrongKind(_) => {
                eprintln!(
                    "daxkv: {} task {}: result lost; every key missed",
                    kind.name(),
                    id.0
                );
                vec![false; t.n]
            }
        };
        let t = st.remove(&id)?;
        Some((bits, t))
    }
}

#[pymethods]
impl DaxL2Core {
    /// `DaxL2Core(**adapter_params)`: the engine's config keys (those of
    /// LMCache's `dax` adapter); opens the devices and starts the workers.
    #[new]
    #[pyo3(signature = (**adapter_params))]
    fn new(py: Python<'_>, adapter_params: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let (engine, cfg, control) =
            open_engine(py, adapter_params, crate::control::PLUGIN_L2_NAME)?;
        if let Err(e) = plugin_http_check(&control) {
            engine.close();
            return Err(e);
        }
        let engine = Arc::new(engine);
        let http = match control.http {
            Some(h) => {
                let e = engine.clone();
                let l2_name = &control.l2_name;
                Some(crate::control::start_or_close(py, &engine, || {
                    crate::control::start_metrics_http(h, e, l2_name)
                })?)
            }
            None => None,
        };
        // Hand the fds out now: with `signal: when_waiting` a kind signals
        // every completion only once its fd has a poller.
        let _ = engine.event_fds();
        let slot_bytes = engine.slot_bytes();
        let known = Arc::new(KnownKeys::default());
        // The listener asks the engine whether a deleted key is held again
        // (a newer copy); a weak handle, as the engine holds the listener.
        let _ = known.engine.set(Arc::downgrade(&engine));
        let listener: Arc<dyn Listener> = known.clone();
        engine.register_listener(&listener);
        Ok(DaxL2Core {
            known,
            reconf: DaxReconfigure::probing(engine.clone(), cfg.sysfs_root.clone()),
            slot_bytes,
            l2_name: control.l2_name,
            engine,
            state: Mutex::new(State {
                tasks: Map::default(),
                refused_stores: Vec::new(),
                closed: false,
                busy: Busy::new(slot_bytes),
                busy_tag: 0,
            }),
            next_local: AtomicU64::new(0),
            closing: Mutex::new(()),
            owner: crate::fork::Owner::here(),
            http_addr: http
                .as_ref()
                .map(daxkv::control::http::HttpServer::local_addr),
            http: Mutex::new(http),
        })
    }

    /// Validate adapter params without opening anything (`ValueError`
    /// naming the field).
    #[staticmethod]
    #[pyo3(signature = (**adapter_params))]
    fn check_config(py: Python<'_>, adapter_params: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
        let (_, _, control) = parse_config(py, adapter_params, crate::control::PLUGIN_L2_NAME)?;
        plugin_http_check(&control)
    }

    /// `"host:port"` of the `/metrics` and `/health` server started from
    /// `adapter_params["http"]`, or `None` when none was asked for (also
    /// after `close()`, which stops it).
    #[getter]
    fn http_address(&self) -> PyResult<Option<String>> {
        self.owner.check("DaxL2Adapter")?;
        Ok(crate::control::running_address(&self.http, self.http_addr))
    }

    /// The engine's metrics in the Prometheus text format, every series
    /// labelled `l2_name` (the names of `daxkv serve`'s `/metrics`).
    fn metrics_text(&self, py: Python<'_>) -> PyResult<String> {
        self.owner.check("DaxL2Adapter")?;
        Ok(crate::gil::release(py, || {
            crate::control::metrics_text(&self.engine, &self.l2_name)
        }))
    }

    /// The `l2_name` label value.
    #[getter]
    fn l2_name(&self) -> &str {
        &self.l2_name
    }

    /// The wire string an `ObjectKey` is digested from (module doc).
    #[staticmethod]
    fn key_string(key: &Bound<'_, PyAny>) -> PyResult<String> {
        let mut s = Vec::new();
        wire_string(&mut s, key)?;
        // UTF-8: built from `str`s and ASCII.
        String::from_utf8(s).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Bytes per slot (the largest object a key holds).
    #[getter]
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Whether runtime add / remove / resize are on.
    #[getter]
    fn hotplug_enabled(&self) -> bool {
        self.engine.hotplug_enabled()
    }

    /// True once `close` has begun.
    #[getter]
    fn closed(&self, py: Python<'_>) -> PyResult<bool> {
        self.owner.check("DaxL2Adapter")?;
        Ok(crate::gil::release(py, || self.lock().closed))
    }

    /// The engine's completion eventfds (store, lookup, load): distinct,
    /// non-blocking; `-1` each after `close`.
    fn event_fds(&self) -> PyResult<(i32, i32, i32)> {
        self.owner.check("DaxL2Adapter")?;
        let [s, l, d] = self.engine.event_fds();
        Ok((s, l, d))
    }

    /// Store `objs[i]` under `keys[i]` (zero-copy; each object's own
    /// length). Returns the task id. `spans`: the objects' tensors as the
    /// adapter read them in Python (`_spans` in
    /// daxkv/lmcache/_l2_adapter.py: cheaper there), or `None` to read
    /// them here.
    #[pyo3(signature = (keys, objs, spans=None))]
    fn submit_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        objs: &Bound<'_, PyAny>,
        spans: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Id> {
        self.owner.check("DaxL2Adapter")?;
        let (ks, kept, views) = keys_and_views(keys, objs, false, spans)?;
        // Again: the conversion above ran the caller's Python code, which
        // may have forked (`fork` module doc).
        self.owner.check("DaxL2Adapter")?;
        let record = kept.iter().map(|k| k.clone_ref(py)).collect();
        let task = Task {
            kind: TaskKind::Store,
            n: ks.len(),
            keys: kept,
            digests: ks.clone(),
            record,
            objs: Some(objs.clone().unbind()),
            views,
            held: Held::default(),
            bits: None,
        };
        let (r, rel) = crate::gil::release(py, || {
            self.submit(task, |e, views| {
                // SAFETY: the views stay in the task entry until the
                // store's completion is collected (`pop_completed_stores`)
                // or `close` has waited for every task; the caller's
                // objects are referenced there too; no load in flight
                // writes these bytes (`busy`). A read-only export may be a
                // source: the engine only reads sources (`View::raw`).
                let srcs = views.iter().map(|v| Buf::Raw(unsafe { v.raw() })).collect();
                match e.submit_store(ks, srcs) {
                    Ok(id) => (Ok(id), views),
                    Err(r) => (Err(r.error), views),
                }
            })
        });
        rel.release(py);
        r
    }

    /// Every store finished since the last call, each once, with a ticket,
    /// and the keys deleted since the last call (as `take_deleted`):
    /// `(ticket, [(task id, success, bytes)], keys stored, sizes,
    /// deleted)`. `keys stored` are these tasks' keys the engine holds now
    /// (in task order), recorded for the delete events ([`known`]); a
    /// key's size is `slot_bytes` the first time it is stored and 0 for a
    /// store of a key already held, so LMCache's byte counters count each
    /// slot once (upstream counts re-stores twice,
    /// docs/lmcache-dax-behavior.md §9.4 item 3); `sizes` is `None` when
    /// every key is a first store (each `slot_bytes`: one list fewer, and
    /// no integer object per key). Once their "stored" events are told,
    /// call `stored_reported(ticket)` (ticket 0: nothing to report).
    fn pop_completed_stores(&self, py: Python<'_>) -> PyResult<Collected> {
        self.owner.check("DaxL2Adapter")?;
        let (out, rel) = crate::gil::release(py, || {
            let mut rel = Released::default();
            let mut done = Vec::new();
            {
                let mut st = self.lock();
                for id in std::mem::take(&mut st.refused_stores) {
                    if let Some(t) = st.remove(&id) {
                        done.push((id, false, 0, Some(t)));
                    }
                }
                for (id, r) in self.engine.pop_completed_stores() {
                    let id = Id::from(id.0);
                    let t = st.remove(&id);
                    done.push((id, r.success, r.bytes_transferred, t));
                }
            }
            let mut out = Vec::with_capacity(done.len());
            let mut ticket = 0;
            let mut stored = (Vec::new(), Vec::new());
            for (id, ok, bytes, t) in done {
                let (keys, digests, record) = t.map(|t| rel.task(t)).unwrap_or_default();
                if bytes > 0 {
                    if ticket == 0 {
                        ticket = self.known.lock().ticket();
                    }
                    self.record_stored(keys, &digests, record, ticket, &mut rel, &mut stored);
                } else {
                    rel.objs.extend(keys.into_iter().chain(record));
                }
                out.push((id, ok, bytes));
            }
            // A size per key only when a key was stored again (size 0):
            // else the adapter writes `slot_bytes` for each, without an
            // integer object per key here.
            let (keys, first) = stored;
            let sizes = (!first.iter().all(|&f| f)).then(|| {
                first
                    .iter()
                    .map(|&f| if f { self.slot_bytes } else { 0 })
                    .collect()
            });
            // The deletes due now (their "stored" was told before this
            // call), in the same call: one crossing fewer per collection.
            let deleted = self.known.lock().take_deleted();
            ((ticket, out, keys, sizes, deleted), rel)
        });
        rel.release(py);
        Ok(out)
    }

    /// The "stored" events of a `pop_completed_stores` ticket are told:
    /// deletes of those keys may be reported now. Returns the deletes due
    /// now (as `take_deleted`), those this report released among them: the
    /// caller tells them, else nothing would until some later call.
    fn stored_reported(&self, py: Python<'_>, ticket: u64) -> PyResult<Vec<Py<PyAny>>> {
        self.owner.check("DaxL2Adapter")?;
        Ok(crate::gil::release(py, || {
            let mut known = self.known.lock();
            if ticket != 0 {
                known.reported(ticket);
            }
            known.take_deleted()
        }))
    }

    /// Keys deleted since the last call (by `delete`, a hotplug evict or a
    /// forced shrink) whose "stored" event was told, each once, for
    /// LMCache's listeners.
    fn take_deleted(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        self.owner.check("DaxL2Adapter")?;
        Ok(crate::gil::release(py, || self.known.lock().take_deleted()))
    }

    /// Look the keys up and take one lock in the engine on each hit
    /// (release with `submit_unlock`). Returns the task id.
    ///
    /// Done here, on the calling thread with the GIL released
    /// ([`Engine::lookup_and_lock_into`]: index work only, no copy), and
    /// completed at once under a negative id, with the lookup eventfd
    /// written, as LMCache's controllers poll it before they query. A
    /// worker hop (wake, completion, eventfd, the caller's poll) costs
    /// more than the lookup itself. The locks are the same as a worker's:
    /// `delete` skips them until `submit_unlock`; a lookup racing `close`
    /// either completes (its result stays collectable) or raises.
    fn submit_lookup(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Id> {
        self.owner.check("DaxL2Adapter")?;
        let ks = object_keys(keys)?;
        // Again: the conversion above ran the caller's Python code, which
        // may have forked (`fork` module doc).
        self.owner.check("DaxL2Adapter")?;
        crate::gil::release(py, || {
            // Without `state`: the lookup may wait for a device's pending
            // remap, which must not hold every other call of this adapter.
            let mut bits = vec![false; ks.len()];
            self.engine.lookup_and_lock_into(&ks, &mut bits);
            let task = Task {
                kind: TaskKind::Lookup,
                n: ks.len(),
                keys: Vec::new(),
                digests: Vec::new(),
                record: Vec::new(),
                objs: None,
                views: Vec::new(),
                held: Held::default(),
                bits: Some(bits),
            };
            let mut st = self.lock();
            if st.closed {
                // The engine is closing: the locks just taken (if any) go
                // with it.
                return Err(closing_err());
            }
            Ok(self.complete_here(&mut st, task))
        })
    }

    /// A finished lookup, once: `(number of keys, indices of the hits)`;
    /// `None` while it runs, after it was returned, or for an id that is
    /// not a lookup of this adapter.
    fn query_lookup(&self, py: Python<'_>, task_id: Id) -> PyResult<Option<(usize, Vec<usize>)>> {
        self.owner.check("DaxL2Adapter")?;
        let r = crate::gil::release(py, || {
            let (bits, t) = self.take(task_id, TaskKind::Lookup)?;
            let mut rel = Released::default();
            let n = t.n;
            let (keys, _, record) = rel.task(t);
            rel.objs.extend(keys.into_iter().chain(record));
            Some(((n, hits(bits.into_iter())), rel))
        });
        Ok(r.map(|(v, rel)| {
            rel.release(py);
            v
        }))
    }

    /// Write the eventfd of `kind` (`"store"`, `"lookup"` or `"load"`)
    /// again: a result the caller could not take (a listener raised) is
    /// kept for the next call, and a poller must come back for it.
    /// [`Engine::signal`] (module doc, "Completions that never reach the
    /// engine"): a no-op once the engine closed.
    fn resignal(&self, kind: &str) -> PyResult<()> {
        self.owner.check("DaxL2Adapter")?;
        let kind = match kind {
            "store" => TaskKind::Store,
            "lookup" => TaskKind::Lookup,
            "load" => TaskKind::Load,
            other => {
                return Err(PyValueError::new_err(format!(
                    "daxkv: resignal: kind must be store, lookup or load (got {other:?})"
                )))
            }
        };
        // One non-blocking eventfd write: no lock, no GIL release.
        self.engine.signal(kind);
        Ok(())
    }

    /// Release one lookup lock per key (on every device). Never fails.
    fn submit_unlock(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        self.owner.check("DaxL2Adapter")?;
        let ks = object_keys(keys)?;
        // Again: the conversion above ran the caller's Python code, which
        // may have forked (`fork` module doc).
        self.owner.check("DaxL2Adapter")?;
        crate::gil::release(py, || self.engine.submit_unlock(&ks));
        Ok(())
    }

    /// Load `keys[i]` into `objs[i]` (zero-copy; a key loads when its
    /// object is at least the stored payload's length). Returns the id.
    /// `spans`: as for `submit_store`.
    #[pyo3(signature = (keys, objs, spans=None))]
    fn submit_load(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        objs: &Bound<'_, PyAny>,
        spans: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Id> {
        self.owner.check("DaxL2Adapter")?;
        let (ks, kept, views) = keys_and_views(keys, objs, true, spans)?;
        // Again: the conversion above ran the caller's Python code, which
        // may have forked (`fork` module doc).
        self.owner.check("DaxL2Adapter")?;
        let task = Task {
            kind: TaskKind::Load,
            n: ks.len(),
            keys: kept,
            digests: Vec::new(),
            record: Vec::new(),
            objs: Some(objs.clone().unbind()),
            views,
            held: Held::default(),
            bits: None,
        };
        let (r, rel) = crate::gil::release(py, || {
            self.submit(task, |e, views| {
                // SAFETY: the views stay in the task entry until the load
                // is collected (`query_load`) or `close` has waited for
                // every task; they overlap neither each other nor any
                // buffer of another task in flight (`busy`), and the caller leaves the objects to
                // this task (LMCache's contract for a load's
                // destinations).
                let dsts: Vec<RawBuf> = views.iter().map(|v| unsafe { v.raw() }).collect();
                match e.submit_load_raw(ks, dsts) {
                    Ok(id) => (Ok(id), views),
                    Err(r) => (Err(r.error), views),
                }
            })
        });
        rel.release(py);
        r
    }

    /// A finished load, once: `(number of keys, indices loaded, the keys
    /// loaded)`; `None` while it runs, after it was returned, or for an id
    /// that is not a load of this adapter.
    #[allow(clippy::type_complexity)]
    fn query_load(
        &self,
        py: Python<'_>,
        task_id: Id,
    ) -> PyResult<Option<(usize, Vec<usize>, Vec<Py<PyAny>>)>> {
        self.owner.check("DaxL2Adapter")?;
        let r = crate::gil::release(py, || {
            let (bits, t) = self.take(task_id, TaskKind::Load)?;
            let mut rel = Released::default();
            let n = t.n;
            let (keys, _, record) = rel.task(t);
            rel.objs.extend(record);
            let mut loaded = Vec::new();
            for (k, b) in keys.into_iter().zip(bits.iter()) {
                if *b {
                    loaded.push(k);
                } else {
                    rel.objs.push(k);
                }
            }
            Some(((n, hits(bits.into_iter()), loaded), rel))
        });
        Ok(r.map(|(v, rel)| {
            rel.release(py);
            v
        }))
    }

    /// Which keys are stored now (no lock taken).
    fn exists(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        self.owner.check("DaxL2Adapter")?;
        let ks = object_keys(keys)?;
        // Again: the conversion above ran the caller's Python code, which
        // may have forked (`fork` module doc).
        self.owner.check("DaxL2Adapter")?;
        Ok(crate::gil::release(py, || self.engine.exists(&ks)))
    }

    /// Delete committed keys no lookup holds locked; per key, whether it
    /// was deleted (a key listed twice is deleted once).
    fn delete(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        self.owner.check("DaxL2Adapter")?;
        let ks = object_keys(keys)?;
        // Again: the conversion above ran the caller's Python code, which
        // may have forked (`fork` module doc).
        self.owner.check("DaxL2Adapter")?;
        Ok(crate::gil::release(py, || {
            crate::deleted_bits(&ks, self.engine.delete(&ks))
        }))
    }

    /// `(bytes used, capacity bytes)` by slots, over the devices that count.
    fn usage(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        self.owner.check("DaxL2Adapter")?;
        Ok(crate::gil::release(py, || self.engine.usage()))
    }

    /// The engine's status (LMCache's `report_status` fields and more).
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.owner.check("DaxL2Adapter")?;
        let v = crate::gil::release(py, || self.engine.status());
        json_to_py(py, &v)
    }

    /// `{backend, supported_operations, status}` (LMCache's envelope).
    fn reconfigure_status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.owner.check("DaxL2Adapter")?;
        let v = crate::gil::release(py, || self.reconf.reconfigure_status());
        json_to_py(py, &v)
    }

    /// Run a reconfigure operation (`status`, `add`, `remove`, `resize`)
    /// with its payload (a dict); `device_owners(path) -> list[str]` names
    /// other owners of a device to add. Returns `(code, body)`: 200 and the
    /// result, or upstream's error code and payload. An exception raised
    /// by `device_owners` propagates.
    #[pyo3(signature = (operation, payload, device_owners=None))]
    fn reconfigure<'py>(
        &self,
        py: Python<'py>,
        operation: &str,
        payload: &Bound<'py, PyAny>,
        device_owners: Option<Py<PyAny>>,
    ) -> PyResult<(u16, Bound<'py, PyAny>)> {
        self.owner.check("DaxL2Adapter")?;
        let bad = |py: Python<'py>| -> PyResult<(u16, Bound<'py, PyAny>)> {
            let d = PyDict::new(py);
            d.set_item("error", "payload must be a JSON object")?;
            Ok((400, d.into_any()))
        };
        if !payload.is_instance_of::<PyDict>() {
            return bad(py);
        }
        let stretch = crate::gil::held(py);
        let Ok(text) = py
            .import("json")?
            .call_method1("dumps", (payload,))
            .and_then(|s| s.extract::<String>())
        else {
            return bad(py);
        };
        let Ok(v) = serde_json::from_str::<Value>(&text) else {
            return bad(py);
        };
        drop(stretch);
        let raised: Mutex<Option<PyErr>> = Mutex::new(None);
        let owners = |path: &str| -> Vec<String> {
            let Some(cb) = device_owners.as_ref() else {
                return Vec::new();
            };
            crate::gil::with_gil(|py| {
                match cb
                    .call1(py, (path,))
                    .and_then(|r| r.extract::<Vec<String>>(py))
                {
                    Ok(v) => v,
                    Err(e) => {
                        *raised.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
                        // Non-empty: the add stops at the owner check.
                        vec!["(device_owners raised)".into()]
                    }
                }
            })
        };
        let r = crate::gil::release(py, || self.reconf.reconfigure(operation, &v, Some(&owners)));
        if let Some(e) = raised.into_inner().unwrap_or_else(PoisonError::into_inner) {
            return Err(e);
        }
        match r {
            Ok(body) => Ok((200, json_to_py(py, &body)?)),
            Err(e) => Ok((e.status, json_to_py(py, &e.body)?)),
        }
    }

    /// Whether an open device of this adapter is the same physical device
    /// or file as `path` (by identity, whatever the path string).
    fn owns_device(&self, py: Python<'_>, path: &str) -> PyResult<bool> {
        self.owner.check("DaxL2Adapter")?;
        Ok(crate::gil::release(py, || {
            self.engine.owns_device(std::path::Path::new(path))
        }))
    }

    /// Tasks submitted and not collected (each holds its exports).
    fn pending(&self, py: Python<'_>) -> PyResult<usize> {
        self.owner.check("DaxL2Adapter")?;
        Ok(crate::gil::release(py, || self.lock().tasks.len()))
    }

    /// Refuse new tasks, wait for those in flight, close the engine (its
    /// fds and devices) and release every export. Results of finished
    /// tasks can still be collected. Idempotent.
    fn close(&self, py: Python<'_>) {
        if self.owner.forked() {
            return;
        }
        if let Some(h) = self
            .http
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            crate::fork::stops_listening(py, h.listener_fd());
        }
        let rel = crate::gil::release(py, || {
            // A second `close` returns when the first has finished (the
            // engine closed, the exports released), not before: a caller
            // may free its memory once close returns.
            let _one_closer = self.closing.lock().unwrap_or_else(PoisonError::into_inner);
            // The metrics server first: the port is free when close
            // returns.
            let http = self
                .http
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some(h) = http {
                h.shutdown();
            }
            {
                let mut st = self.lock();
                if st.closed {
                    return Released::default();
                }
                st.closed = true;
            }
            self.engine.close();
            // Every task has finished: no worker touches a buffer any more.
            // The exports go; the tasks (and their keys, for the listeners)
            // stay for collection.
            let mut rel = Released::default();
            let mut st = self.lock();
            let st = &mut *st;
            for t in st.tasks.values_mut() {
                rel.views.append(&mut t.views);
                rel.objs.extend(t.objs.take());
                st.busy.release(std::mem::take(&mut t.held));
            }
            // Nothing is deleted any more: the record goes (events not
            // yet taken stay for `take_deleted`).
            rel.objs.extend(self.known.lock().clear());
            rel
        });
        rel.release(py);
    }
}

impl Drop for DaxL2Core {
    fn drop(&mut self) {
        if self.owner.forked() {
            // A forked child (`fork` module doc): the engine is leaked
            // (one reference never dropped), never closed here; so is the
            // metrics server (its threads are the parent's).
            std::mem::forget(self.engine.clone());
            let http = self
                .http
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            std::mem::forget(http);
            return;
        }
        let http = self
            .http
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(h) = &http {
            // Dropped by Python (the GIL is held).
            Python::with_gil(|py| crate::fork::stops_listening(py, h.listener_fd()));
        }
        drop(http);
        // The exports in `state` (dropped after this) outlive the tasks.
        self.engine.close();
    }
}

/// Register the module's L2 classes.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DaxL2Core>()?;
    Ok(())
}
