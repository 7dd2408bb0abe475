//! # `daxkv._daxkv`: the Python extension module
//!
//! [`DaxConnector`] is LMCache's `native_plugin` connector contract
//! (docs/lmcache-dax-behavior.md §7.1) over the Rust [`Engine`]:
//! `submit_batch_set / get / exists / delete` return a future id without
//! blocking, `drain_completions()` hands back `(future_id, ok, error,
//! per_key_bools_or_None)` tuples and resets the one pollable fd,
//! `close()` is idempotent.
//!
//! ## The one fd
//!
//! The engine has three completion eventfds (store, lookup, load); the
//! bridge polls one. `event_fd()` is an epoll fd watching the engine's
//! three plus one eventfd of our own (for futures completed on the caller
//! thread: exists, delete, refusals). An epoll fd is readable while any
//! watched fd is, so `select.poll` on it works; `drain_completions` reads
//! the readable ones to zero *before* collecting, so a completion published
//! after the collection signals again and is never lost.
//!
//! A syscall costs about a microsecond on a VM and a lookup of 16 keys a
//! few, so the fds are touched as little as correctness allows: one
//! `epoll_wait` (timeout 0) says which of the four are readable and only
//! those are read (a lookup's drain: two syscalls, where it was four),
//! and a future completed here writes our eventfd only if it is not
//! written and unread already (`State::own_signalled`). Both happen under
//! the state's mutex, in the same critical section as the completion's
//! push and the collection, so the flag is true exactly while our
//! eventfd's count is non-zero: a completion either finds it written (a
//! drain still to come collects it) or writes it.
//!
//! ## Buffers
//!
//! Each memoryview is exported with `PyObject_GetBuffer` (C-contiguous;
//! writable for `get` destinations) and described to the engine as a
//! [`RawBuf`]: zero-copy. The export (a `View`) is kept in the pending
//! future until the completion is drained (or the connector is closed), so
//! the memory stays valid while workers use it; it is released with the
//! GIL held, after the collection.
//!
//! ## Exists does not lock
//!
//! LMCache's bridge keeps lookup locks on its own side and never sends an
//! unlock to a native connector, so `submit_batch_exists` runs
//! [`Engine::exists_counted`] (a lookup without lock, counted in the
//! metrics as `op="lookup"`, the bridge's name for it) on the caller
//! thread, with the GIL released, and completes its future at once. A key deleted
//! between exists and get loads as a miss; a load in progress is kept
//! safe by the slot's read pin in the engine, not by a lookup lock.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use daxkv::control::config::EngineConfig;
use daxkv::engine::{Answer, Engine, EngineError, TaskId};
use daxkv::plumbing::buf::{Buf, RawBuf};
use daxkv::plumbing::busy::{Busy, Clash, Held};
use daxkv::plumbing::hash::Map;
use daxkv::Key;
use pyo3::exceptions::{PyBufferError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

mod control;
mod fork;
mod gil;
mod l2;
mod lease;
mod store;

/// One completion as the bridge reads it.
type Completion = (u64, bool, String, Option<Vec<bool>>);

/// A Python object's bytes as the engine sees them: a buffer export
/// (`PyObject_GetBuffer`), or an LMCache memory object's tensor read as
/// LMCache's own `byte_array` reads it (`raw_data.data_ptr()`,
/// `get_size()` bytes) without building that property's torch view and
/// ctypes array. Either is released (with the GIL) on drop.
pub(crate) struct View {
    inner: Inner,
}

enum Inner {
    Export(Box<ffi::Py_buffer>),
    /// `len` bytes at `ptr`, inside the CPU tensor `owner` (a strong
    /// reference: the tensor and its storage live as long as the view).
    Tensor {
        ptr: *mut u8,
        len: usize,
        owner: Option<Py<PyAny>>,
    },
}

// SAFETY: the pointer and length are only read off the GIL; releasing the
// export or the tensor reference (`Drop`) takes the GIL. What keeps the
// memory alive: an exporter that owns it (bytearray, numpy) keeps it until
// the release; a tensor view keeps its tensor (and so its storage) until
// the drop; memory neither owns (LMCache's `byte_array`, a ctypes overlay
// on L1 memory; the L1 allocator's slot behind a tensor) is kept for the
// task by the caller — the submit methods' documented contract, which
// LMCache's controllers keep by holding the memory objects for the task.
unsafe impl Send for View {}

impl View {
    /// Export `obj`'s buffer: C-contiguous, and writable when `writable`.
    pub(crate) fn get(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<View> {
        let mut buf = Box::new(std::mem::MaybeUninit::<ffi::Py_buffer>::zeroed());
        let flags = ffi::PyBUF_C_CONTIGUOUS | if writable { ffi::PyBUF_WRITABLE } else { 0 };
        // SAFETY: `obj` is a live object (we hold a reference and the
        // GIL); `buf` points to room for one Py_buffer.
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), buf.as_mut_ptr(), flags) };
        if rc != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        // SAFETY: a successful PyObject_GetBuffer filled the struct.
        let buf = unsafe { Box::from_raw(Box::into_raw(buf).cast::<ffi::Py_buffer>()) };
        Ok(View {
            inner: Inner::Export(buf),
        })
    }

    /// The bytes LMCache's `MemoryObj.byte_array` would describe, read
    /// from the object's tensor directly: `raw_data.data_ptr()` and
    /// `get_size()` bytes. `None` (nothing taken) unless `obj` has a
    /// `raw_data` tensor (an object with `is_cpu`) and a `get_size`; the
    /// caller then falls back to `byte_array`. `BufferError` when the
    /// tensor is not on the CPU or not contiguous, or `get_size()` is past
    /// its bytes: `byte_array` would then describe memory that is not the
    /// tensor's (device memory read as host memory; for a strided or
    /// expanded tensor, bytes between and past its elements, another
    /// object's), which a put would store and a restore overwrite
    /// (`test_backend.py::test_a_memory_object_over_a_non_contiguous_tensor_is_never_read_or_written_past_it`).
    pub(crate) fn memory_obj(obj: &Bound<'_, PyAny>) -> PyResult<Option<View>> {
        let py = obj.py();
        let Ok(t) = obj.getattr(pyo3::intern!(py, "raw_data")) else {
            return Ok(None);
        };
        // Not a tensor (`BytesBufferMemoryObj`'s bytes): its `byte_array`.
        let Ok(is_cpu) = t.getattr(pyo3::intern!(py, "is_cpu")) else {
            return Ok(None);
        };
        if !is_cpu.is_truthy().unwrap_or(false) {
            return Err(not_on_cpu(&t));
        }
        let contiguous = t
            .call_method0(pyo3::intern!(py, "is_contiguous"))
            .and_then(|v| v.is_truthy())
            .unwrap_or(false);
        if !contiguous {
            return Err(not_contiguous());
        }
        let (Ok(ptr), Ok(nbytes)) = (
            t.call_method0(pyo3::intern!(py, "data_ptr"))
                .and_then(|v| v.extract::<usize>()),
            t.getattr(pyo3::intern!(py, "nbytes"))
                .and_then(|v| v.extract::<usize>()),
        ) else {
            return Ok(None);
        };
        let Ok(get_size) = obj.getattr(pyo3::intern!(py, "get_size")) else {
            return Ok(None);
        };
        let len = get_size.call0()?.extract::<usize>()?;
        View::tensor(ptr, nbytes, len, || t.unbind())
    }

    /// The last checks of a tensor's reads (`memory_obj`, `from_span`):
    /// `get_size()` within its bytes, else `BufferError`; a null pointer
    /// under a non-empty length is not exported as a tensor (`None`: its
    /// `byte_array`).
    fn tensor(
        ptr: usize,
        nbytes: usize,
        len: usize,
        owner: impl FnOnce() -> Py<PyAny>,
    ) -> PyResult<Option<View>> {
        if len > nbytes {
            return Err(past_tensor(len, nbytes));
        }
        if ptr == 0 && len != 0 {
            return Ok(None);
        }
        Ok(Some(View {
            inner: Inner::Tensor {
                ptr: ptr as *mut u8,
                len,
                owner: Some(owner()),
            },
        }))
    }

    /// A tensor view from one 7-entry of the adapter's spans
    /// ([`export_objs_read`]), decided as [`View::memory_obj`] decides from
    /// the same reads: `BufferError` for a tensor not on the CPU, not
    /// contiguous or shorter than `get_size()`; `None` (export the
    /// object's `byte_array`) where `memory_obj` falls back.
    pub(crate) fn from_span(t: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<Option<View>> {
        // Borrowed: the tuple holds them; no reference count traffic.
        let tensor = t.get_borrowed_item(1)?;
        if !t.get_borrowed_item(4)?.is_truthy().unwrap_or(false) {
            return Err(not_on_cpu(&tensor));
        }
        if !t.get_borrowed_item(5)?.is_truthy().unwrap_or(false) {
            return Err(not_contiguous());
        }
        // A plain `int` the fast way; anything else as the unread path
        // extracts it (`__index__`: a numpy integer), so the checks below
        // see the same numbers.
        let int = |v: &Bound<'_, PyAny>| as_usize(v).or_else(|| v.extract::<usize>().ok());
        let (Some(ptr), Some(nbytes)) = (
            int(&*t.get_borrowed_item(2)?),
            int(&*t.get_borrowed_item(3)?),
        ) else {
            return Ok(None);
        };
        let size = t.get_borrowed_item(6)?;
        let len = match as_usize(&size) {
            Some(n) => n,
            // The unread path's error for it (a float, a negative int).
            None => size.extract::<usize>()?,
        };
        View::tensor(ptr, nbytes, len, || tensor.to_owned().unbind())
    }

    pub(crate) fn len(&self) -> usize {
        match &self.inner {
            Inner::Export(buf) => usize::try_from(buf.len).unwrap_or(0),
            Inner::Tensor { len, .. } => *len,
        }
    }

    /// The first byte's address (for overlap checks; never dereferenced).
    pub(crate) fn addr(&self) -> usize {
        match &self.inner {
            Inner::Export(buf) => buf.buf as usize,
            Inner::Tensor { ptr, .. } => *ptr as usize,
        }
    }

    /// The engine's descriptor of these bytes.
    ///
    /// # Safety
    /// The caller keeps `self` alive until the task using the descriptor
    /// has completed (drained or collected at close), and — for a load
    /// destination — nobody else reads or writes the bytes meanwhile (the
    /// bridge's contract: LMCache holds the objects for the task; other
    /// buffers of the connector's own tasks are ruled out by `busy`). A
    /// read-only export (`bytes`) may only be a store source: the engine
    /// only reads sources, though `RawBuf::new` is written for both ways.
    pub(crate) unsafe fn raw(&self) -> RawBuf {
        let ptr = match &self.inner {
            Inner::Export(buf) => buf.buf.cast::<u8>(),
            Inner::Tensor { ptr, .. } => *ptr,
        };
        // SAFETY: valid for `len` bytes while the view lives (an export:
        // see the `Send` note; a tensor view: `len` ≤ the tensor's
        // `nbytes` from its contiguous start, checked in `memory_obj` or `from_span`, the
        // tensor held by `owner`), which the caller extends past the task.
        unsafe { RawBuf::new(ptr, self.len()) }
    }

    /// Drop with the GIL held (`py` proves it): a tensor view gives its
    /// reference back at once, without `Drop`'s `with_gil` round trip (16
    /// per collected 4 KiB task: docs/performance.md).
    pub(crate) fn release(mut self, py: Python<'_>) {
        if let Inner::Tensor { owner, .. } = &mut self.inner {
            if let Some(o) = owner.take() {
                o.drop_ref(py);
            }
        }
    }
}

impl Drop for View {
    fn drop(&mut self) {
        if let Inner::Tensor { owner: None, .. } = self.inner {
            return; // released already
        }
        Python::with_gil(|_| match &mut self.inner {
            // SAFETY: the struct was filled by PyObject_GetBuffer and is
            // released exactly once, here, with the GIL held.
            Inner::Export(buf) => unsafe { ffi::PyBuffer_Release(&mut **buf) },
            Inner::Tensor { owner, .. } => drop(owner.take()),
        });
    }
}

/// The refusal of a tensor not on the CPU, naming its device.
fn not_on_cpu(tensor: &Bound<'_, PyAny>) -> PyErr {
    let device = tensor
        .getattr(pyo3::intern!(tensor.py(), "device"))
        .and_then(|d| d.str().map(|s| s.to_string()))
        .unwrap_or_else(|_| "?".into());
    PyBufferError::new_err(format!(
        "raw_data is a tensor on {device}, not on the CPU: its data_ptr() is not host memory"
    ))
}

fn not_contiguous() -> PyErr {
    PyBufferError::new_err(
        "raw_data is a tensor that is not contiguous: the get_size() bytes at its data_ptr() \
         are not its elements and may run past it",
    )
}

fn past_tensor(len: usize, nbytes: usize) -> PyErr {
    PyBufferError::new_err(format!(
        "get_size() is {len} bytes, past its tensor's {nbytes}"
    ))
}

/// `v` as a `usize` when it is a non-negative `int` that fits, else `None`
/// (the error cleared). `PyLong_AsUnsignedLong` rather than pyo3's `u64`
/// extraction: 3.11's `PyLong_AsUnsignedLongLong` takes the generic
/// byte-array path for every int past one digit (a data pointer), about
/// a hundred instructions more per call (docs/performance.md).
pub(crate) fn as_usize(v: &Bound<'_, PyAny>) -> Option<usize> {
    // `unsigned long` is 64 bits on the LP64 targets this builds for.
    const _: () = assert!(std::mem::size_of::<std::ffi::c_ulong>() == std::mem::size_of::<usize>());
    if !v.is_instance_of::<pyo3::types::PyInt>() {
        return None;
    }
    // SAFETY: `v` is a live `int` (checked above) and we hold the GIL.
    let n = unsafe { ffi::PyLong_AsUnsignedLong(v.as_ptr()) };
    if n == std::ffi::c_ulong::MAX && PyErr::take(v.py()).is_some() {
        return None;
    }
    usize::try_from(n).ok()
}

/// A future waiting for an engine task.
struct Pending {
    fid: u64,
    keys: usize,
    /// Keeps the buffers exported until the task completes.
    views: Vec<View>,
    /// Its buffers' ranges in [`State::busy`], given back with the views.
    held: Held,
}

/// Everything behind the connector's one mutex.
struct State {
    /// `None` once closed.
    engine: Option<Arc<Engine>>,
    /// Sets in flight, by engine task id.
    sets: Map<TaskId, Pending>,
    /// Gets in flight, by engine task id.
    gets: Map<TaskId, Pending>,
    /// Completed, not yet drained.
    ready: Vec<Completion>,
    /// Exports whose tasks completed, to release with the GIL.
    release: Vec<View>,
    /// The memory of the tasks in flight: a submit whose buffers would
    /// alias one in flight is refused (`daxkv::plumbing::busy`).
    busy: Busy,
    /// Our own eventfd was written and not read since: a completion made
    /// here writes it only when this is false (module doc, "The one fd").
    /// Changed only under this state's mutex, as is the fd's count.
    own_signalled: bool,
}

impl State {
    /// A task's end: its exports to release, its ranges given back.
    fn finish(&mut self, p: Pending) {
        self.busy.release(p.held);
        self.release.extend(p.views);
    }
}

/// The `ValueError` of a buffer refused by [`Busy`].
fn clash_error(what: &str, i: usize, c: &Clash) -> PyErr {
    let with = match c {
        Clash::Batch(j) => format!("{what} buffer {j} of the same call"),
        Clash::InFlight(fid) => format!("a buffer of future {fid}, still in flight"),
    };
    PyValueError::new_err(format!(
        "daxkv: {what} buffer {i} shares memory with {with} (a load destination must not \
         alias any other buffer in flight)"
    ))
}

/// `(address, length)` of each export.
fn ranges(views: &[View]) -> Vec<(usize, usize)> {
    views.iter().map(|v| (v.addr(), v.len())).collect()
}

/// LMCache's `native_plugin` connector over the daxkv engine
/// (docs/lmcache-dax-behavior.md §7.1). Thread-safe: the bridge's store
/// and prefetch controllers call it concurrently.
#[pyclass(module = "daxkv._daxkv", frozen)]
pub struct DaxConnector {
    state: Mutex<State>,
    next: AtomicU64,
    slot_bytes: usize,
    /// The epoll fd handed out by `event_fd` (`None` once closed).
    epoll: Mutex<Option<OwnedFd>>,
    /// Our own eventfd, for futures completed on the caller thread.
    efd: Mutex<Option<OwnedFd>>,
    /// The numbers of `epoll` and `efd`, for `drain_completions`, which
    /// uses them (and the engine's three fds in the epoll set) only while
    /// the state holds the engine: `close` takes the engine out, under the
    /// state's mutex, before any of them is closed.
    epoll_fd: RawFd,
    own_fd: RawFd,
    /// The `l2_name` label of `metrics_text` and the control plane.
    l2_name: String,
    /// The control plane, when `adapter_params` asked for one.
    http: Mutex<Option<daxkv::control::http::HttpServer>>,
    /// Its address (kept after close, for error messages).
    http_addr: Option<std::net::SocketAddr>,
    /// Held by `close` from start to end: a second `close` returns when
    /// the first has finished, not before.
    closing: Mutex<()>,
    /// The process that opened it (`fork` module doc).
    owner: crate::fork::Owner,
    /// Mapping observers registered through `observe` (`lease` module).
    observers: lease::Observers,
}

fn closed() -> PyErr {
    PyRuntimeError::new_err("daxkv: connector is closed")
}

/// The fds (their `epoll_event` data) of the epoll set `epfd` that are
/// readable now (`epoll_wait`, timeout 0); none when the call fails.
fn readable(epfd: RawFd) -> [Option<RawFd>; 4] {
    // SAFETY: `epoll_event` is plain old data; all-zero is valid.
    let mut evs: [libc::epoll_event; 4] = unsafe { std::mem::zeroed() };
    // SAFETY: the kernel writes at most 4 events into `evs`. The caller
    // holds the connector's state with its engine, so `epfd` is open and
    // ours (`drain_completions`).
    let n = unsafe { libc::epoll_wait(epfd, evs.as_mut_ptr(), 4, 0) };
    let mut out = [None; 4];
    for (o, ev) in out.iter_mut().zip(&evs[..usize::try_from(n).unwrap_or(0)]) {
        // Copied out of the packed struct before use.
        let data = ev.u64;
        *o = RawFd::try_from(data).ok();
    }
    out
}

/// Per key of a delete's input, whether it was deleted: a key listed
/// twice reads `true` at as many of its places, first ones first, as
/// `deleted` holds it (once, unless it was stored again between the two
/// and deleted again). Counts in a map, not a scan of `deleted` per key:
/// LMCache's eviction deletes thousands of keys in one call (a scan per
/// key cost 4096² key compares there).
pub(crate) fn deleted_bits(keys: &[Key], deleted: Vec<Key>) -> Vec<bool> {
    let mut left: Map<Key, usize> =
        Map::with_capacity_and_hasher(deleted.len(), Default::default());
    for k in deleted {
        *left.entry(k).or_default() += 1;
    }
    keys.iter()
        .map(|k| match left.get_mut(k) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        })
        .collect()
}

/// Read an eventfd (or any non-blocking fd) to zero; errors ignored.
pub(crate) fn reset_fd(fd: RawFd) {
    let mut v = 0u64;
    // SAFETY: reads 8 bytes into a local. Callers pass an fd that is open
    // and ours: the connector's eventfd under its mutex, or an engine
    // eventfd while the state (whose mutex the caller holds) still has the
    // engine — `close` takes it out before the engine closes those fds, so
    // the number never names another file here.
    let _ = unsafe { libc::read(fd, std::ptr::addr_of_mut!(v).cast(), 8) };
}

pub(crate) fn notify_fd(fd: RawFd) {
    let v = 1u64;
    // SAFETY: writes 8 bytes from a local to an eventfd we own.
    let _ = unsafe { libc::write(fd, std::ptr::addr_of!(v).cast(), 8) };
}

/// Digest LMCache's key strings (`str`, or `bytes`) as the Rust side does.
fn digest_keys(keys: &Bound<'_, PyAny>) -> PyResult<Vec<Key>> {
    // Iterating `keys` may run Python code (a generator): `gil::held`.
    let _stretch = crate::gil::held(keys.py());
    let mut out = Vec::new();
    for k in keys.try_iter()? {
        let k = k?;
        if let Ok(s) = k.downcast::<PyString>() {
            out.push(Key::digest(s.to_str()?.as_bytes()));
        } else if let Ok(b) = k.downcast::<PyBytes>() {
            out.push(Key::digest(b.as_bytes()));
        } else {
            return Err(PyTypeError::new_err(format!(
                "daxkv: keys must be str or bytes (got {})",
                k.get_type().name()?
            )));
        }
    }
    Ok(out)
}

/// A JSON value as Python objects, built directly (no Python code runs:
/// see the `gil` module doc for why a daxkv frame avoids running any).
pub(crate) fn json_to_py<'py>(
    py: Python<'py>,
    v: &serde_json::Value,
) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => pyo3::types::PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                u.into_pyobject(py)?.into_any()
            } else if let Some(i) = n.as_i64() {
                i.into_pyobject(py)?.into_any()
            } else {
                n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any()
            }
        }
        Value::String(s) => PyString::new(py, s).into_any(),
        Value::Array(a) => {
            let l = pyo3::types::PyList::empty(py);
            for x in a {
                l.append(json_to_py(py, x)?)?;
            }
            l.into_any()
        }
        Value::Object(o) => {
            let d = PyDict::new(py);
            for (k, x) in o {
                d.set_item(k, json_to_py(py, x)?)?;
            }
            d.into_any()
        }
    })
}

/// Export each object's bytes: an LMCache `MemoryObj`'s tensor
/// (`View::memory_obj`: what its `byte_array` describes, without building
/// it), else its `byte_array`, else the object itself (any buffer).
pub(crate) fn export_objs(objs: &Bound<'_, PyAny>, writable: bool) -> PyResult<Vec<View>> {
    // Iterating `objs` and reading a `MemoryObj` (properties, methods)
    // run Python code: `gil::held`.
    let _stretch = crate::gil::held(objs.py());
    let mut out = Vec::new();
    for (i, o) in objs.try_iter()?.enumerate() {
        out.push(export_obj(&o?, i, writable)?);
    }
    Ok(out)
}

/// Export object `i` of a task (`export_objs`).
fn export_obj(o: &Bound<'_, PyAny>, i: usize, writable: bool) -> PyResult<View> {
    let what = if writable { "destination" } else { "source" };
    if let Some(v) = View::memory_obj(o).map_err(|e| {
        PyBufferError::new_err(format!("daxkv: {what} object {i}: {}", e.value(o.py())))
    })? {
        return Ok(v);
    }
    export_buffer(o, i, writable)
}

/// Export object `i` that is not read as a tensor: its `byte_array`, else
/// the object itself (any buffer).
fn export_buffer(o: &Bound<'_, PyAny>, i: usize, writable: bool) -> PyResult<View> {
    let what = if writable { "destination" } else { "source" };
    let bytes = if o.hasattr("byte_array")? {
        o.getattr("byte_array")?
    } else {
        o.clone()
    };
    View::get(&bytes, writable).map_err(|e| {
        PyBufferError::new_err(format!(
            "daxkv: {what} object {i}: {} (need a MemoryObj, or a C-contiguous{} buffer)",
            e.value(bytes.py()),
            if writable { ", writable" } else { "" }
        ))
    })
}

/// [`export_objs`] from `spans`, what the adapter read of each object in
/// Python (`daxkv.lmcache._l2_adapter._spans`: per object `(obj, raw_data,
/// raw_data.data_ptr(), raw_data.nbytes, raw_data.is_cpu, is_cpu and
/// raw_data.is_contiguous(), obj.get_size())`, or `(obj,)` when reading it
/// raised): the reads `View::memory_obj` makes, several times cheaper
/// from Python (docs/performance.md, "The plugin path's submit"). Each
/// entry is decided from its values alone, as `View::memory_obj` decides
/// from the same reads, so an object read cleanly is not read twice (a
/// `get_size()` that answers differently the second time cannot turn a
/// refusal into a store); a `(obj,)` entry (one of its reads raised) is
/// exported by [`export_obj`], which reads it from the start.
///
/// The caller (the adapter, a private interface) makes each entry from
/// the object in it; the tensor is kept as the view's owner, as on the
/// unread path.
pub(crate) fn export_objs_read(spans: &Bound<'_, PyAny>, writable: bool) -> PyResult<Vec<View>> {
    let _stretch = crate::gil::held(spans.py());
    let what = if writable { "destination" } else { "source" };
    let spans = spans.downcast::<PyList>()?;
    let mut out = Vec::with_capacity(spans.len());
    for (i, sp) in spans.iter().enumerate() {
        let t = sp.downcast_into::<pyo3::types::PyTuple>()?;
        let o = t.get_item(0)?;
        let v = match t.len() {
            1 => export_obj(&o, i, writable)?,
            7 => match View::from_span(&t).map_err(|e| {
                PyBufferError::new_err(format!("daxkv: {what} object {i}: {}", e.value(o.py())))
            })? {
                Some(v) => v,
                None => export_buffer(&o, i, writable)?,
            },
            n => {
                return Err(PyTypeError::new_err(format!(
                    "spans: a tuple of 7 (or 1) per object, got {n}"
                )))
            }
        };
        out.push(v);
    }
    Ok(out)
}

/// Export every buffer (writable for destinations).
fn export(bufs: &Bound<'_, PyAny>, writable: bool) -> PyResult<Vec<View>> {
    let what = if writable { "destination" } else { "source" };
    // Iterating `bufs` (a generator) or exporting one (a class with
    // `__buffer__`) may run Python code: `gil::held`.
    let _stretch = crate::gil::held(bufs.py());
    let mut out = Vec::new();
    for (i, b) in bufs.try_iter()?.enumerate() {
        let b = b?;
        out.push(View::get(&b, writable).map_err(|e| {
            PyBufferError::new_err(format!(
                "daxkv: {what} buffer {i}: {} (need a C-contiguous{} buffer)",
                e.value(b.py()),
                if writable { ", writable" } else { "" }
            ))
        })?);
    }
    Ok(out)
}

fn new_fd(fd: libc::c_int, what: &str) -> PyResult<OwnedFd> {
    if fd < 0 {
        return Err(PyRuntimeError::new_err(format!(
            "daxkv: {what}: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: a fresh fd just returned by the kernel, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The engine's config from adapter params (the keys of LMCache's `dax`
/// adapter, `type` optional), without opening anything. `_panic_on_key` (a
/// key string) is taken out and returned digested: a test hook, a task
/// part meeting that key panics.
pub(crate) fn parse_config(
    py: Python<'_>,
    adapter_params: Option<&Bound<'_, PyDict>>,
    default_l2_name: &str,
) -> PyResult<(EngineConfig, Option<Key>, control::ControlParams)> {
    // `json.dumps` is Python code run under this Rust frame: `gil::held`.
    let _stretch = crate::gil::held(py);
    let params = match adapter_params {
        Some(d) => d.copy()?,
        None => PyDict::new(py),
    };
    let panic_key = match params.get_item("_panic_on_key")? {
        Some(k) => {
            params.del_item("_panic_on_key")?;
            Some(Key::digest(k.extract::<String>()?.as_bytes()))
        }
        None => None,
    };
    let control = control::take_control_params(py, &params, default_l2_name)?;
    let json: String = py
        .import("json")?
        .call_method1("dumps", (params,))?
        .extract()?;
    let cfg = EngineConfig::from_json(&json).map_err(|e| config_error(py, e.to_string()))?;
    Ok((cfg, panic_key, control))
}

/// `daxkv.DaxConfigError`, made once: raised for a config or open error
/// that is the caller's fault. A `ValueError` (what LMCache's own adapters
/// raise for these: its test suite expects `ValueError("… already
/// mapped")`) that is also a `RuntimeError` (what daxkv's faces raised for
/// an open error before, and what upstream's non-MP `DaxBackend` raises for
/// a device it cannot open), so callers catching either keep working.
pub(crate) fn config_error_type(py: Python<'_>) -> PyResult<&Bound<'_, pyo3::types::PyType>> {
    static TYPE: pyo3::sync::GILOnceCell<Py<pyo3::types::PyType>> = pyo3::sync::GILOnceCell::new();
    TYPE.get_or_try_init(py, || {
        let ns = PyDict::new(py);
        ns.set_item("__module__", "daxkv")?;
        ns.set_item(
            "__doc__",
            "A daxkv config or open error that is the caller's fault (a bad value, a \
             duplicate or missing device, a device too small): both a ValueError and a \
             RuntimeError.",
        )?;
        let bases = pyo3::types::PyTuple::new(
            py,
            [
                py.get_type::<PyValueError>(),
                py.get_type::<PyRuntimeError>(),
            ],
        )?;
        let t = py
            .get_type::<pyo3::types::PyType>()
            .call1(("DaxConfigError", bases, ns))?;
        Ok(t.downcast_into::<pyo3::types::PyType>()?.unbind())
    })
    .map(|t| t.bind(py))
}

/// A [`config_error_type`] error with `msg`.
pub(crate) fn config_error(py: Python<'_>, msg: String) -> PyErr {
    match config_error_type(py) {
        Ok(t) => PyErr::from_type(t.clone(), msg),
        Err(e) => e,
    }
}

/// Whether an open error of a device is the caller's fault (a bad path,
/// size or kind, a file system that holds no memory, a size past the
/// memory limit), not the system's (mmap, sysfs, permissions).
pub(crate) fn device_is_callers_fault(e: &daxkv::OpenError) -> bool {
    use daxkv::OpenError as O;
    matches!(
        e,
        O::Zero { .. }
            | O::NoSlot { .. }
            | O::SlotTooLarge { .. }
            | O::TooManySlots { .. }
            | O::Missing { .. }
            | O::IsDirectory { .. }
            | O::Unsupported { .. }
            | O::FileTooSmall { .. }
            | O::DeviceTooSmall { .. }
            | O::Misaligned { .. }
            | O::FileSystem { .. }
            | O::MemoryLimit { .. }
            | O::TableAlloc { .. }
            | O::FileShorterThanGrow { .. }
    )
}

/// An engine's open error: [`config_error`] when it is the caller's
/// fault (config values, a device listed twice, a device that is missing
/// or too small), else `RuntimeError`.
fn open_error(py: Python<'_>, e: &EngineError) -> PyErr {
    let msg = format!("daxkv: open: {e}");
    let callers = match e {
        EngineError::Invalid { .. }
        | EngineError::NoDevices
        | EngineError::TableTooLarge { .. }
        | EngineError::AlreadyMapped { .. }
        | EngineError::SizeConflict { .. } => true,
        EngineError::Device { source, .. } => device_is_callers_fault(source),
        _ => false,
    };
    if callers {
        config_error(py, msg)
    } else {
        PyRuntimeError::new_err(msg)
    }
}

/// Open an engine from adapter params ([`parse_config`]), with the GIL
/// released while devices are mapped; returns it with its config.
pub(crate) fn open_engine(
    py: Python<'_>,
    adapter_params: Option<&Bound<'_, PyDict>>,
    default_l2_name: &str,
) -> PyResult<(Engine, EngineConfig, control::ControlParams)> {
    let (cfg, panic_key, control) = parse_config(py, adapter_params, default_l2_name)?;
    let mut opts = cfg.options();
    opts.panic_on_key = panic_key;
    let engine = crate::gil::release(py, || {
        Engine::open(
            cfg.device_specs(),
            cfg.slot_bytes,
            cfg.hotplug_enabled,
            opts,
        )
    })
    .map_err(|e| open_error(py, &e))?;
    Ok((engine, cfg, control))
}

impl DaxConnector {
    /// The engine, or the closed error. (Taken without the GIL released:
    /// the state's mutex is never held across an engine wait.)
    fn engine(&self) -> PyResult<Arc<Engine>> {
        self.lock().engine.clone().ok_or_else(closed)
    }

    fn fid(&self) -> u64 {
        // ORDERING: Relaxed — a unique number, nothing published through it.
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    fn signal(&self) {
        if let Some(fd) = self
            .efd
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            notify_fd(fd.as_raw_fd());
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Complete a future at once (on the caller thread) and signal.
    fn complete_now(&self, st: &mut State, c: Completion) -> u64 {
        let fid = c.0;
        st.ready.push(c);
        // Written and unread: the drain that reads it collects this too
        // (module doc, "The one fd").
        if !st.own_signalled {
            self.signal();
            st.own_signalled = true;
        }
        fid
    }

    /// Move every finished task into `ready` (no GIL needed).
    fn collect(st: &mut State) {
        if let Some(engine) = st.engine.clone() {
            Self::collect_from(&engine, st);
        }
    }

    /// [`collect`](Self::collect) from `engine` (which `close` has already
    /// taken out of the state).
    fn collect_from(engine: &Engine, st: &mut State) {
        for (id, r) in engine.pop_completed_stores() {
            if let Some(p) = st.sets.remove(&id) {
                let err = if r.success {
                    String::new()
                } else {
                    format!(
                        "daxkv: store of {} keys failed (a key did not fit: device full, or \
                         the engine is closing)",
                        p.keys
                    )
                };
                st.ready.push((p.fid, r.success, err, None));
                st.finish(p);
            }
        }
        let ids: Vec<TaskId> = st.gets.keys().copied().collect();
        for id in ids {
            let done = match engine.query_load(id) {
                Answer::Pending => continue,
                Answer::Ready(r) => Ok(r.bitmap.to_vec()),
                Answer::Closed => Err("daxkv: engine closed before the load ran".to_string()),
                Answer::Unknown | Answer::WrongKind(_) => {
                    Err("daxkv: load result lost (unknown task)".to_string())
                }
            };
            let p = st.gets.remove(&id).expect("listed above");
            let c = match done {
                Ok(bits) => {
                    let hits = bits.iter().filter(|&&b| b).count();
                    let ok = hits == bits.len();
                    let err = if ok {
                        String::new()
                    } else {
                        format!(
                            "daxkv: {} of {} keys not loaded (missing, or the destination is \
                             smaller than the stored payload)",
                            bits.len() - hits,
                            bits.len()
                        )
                    };
                    (p.fid, ok, err, Some(bits))
                }
                Err(e) => (p.fid, false, e, Some(vec![false; p.keys])),
            };
            st.ready.push(c);
            st.finish(p);
        }
    }
}

#[pymethods]
impl DaxConnector {
    /// `DaxConnector(**adapter_params)`: the engine's config keys (those of
    /// LMCache's `dax` adapter, `type` optional). `_panic_on_key` (a key
    /// string) is a test hook: a task part meeting that key panics.
    #[new]
    #[pyo3(signature = (**adapter_params))]
    fn new(py: Python<'_>, adapter_params: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let (engine, cfg, control) = open_engine(py, adapter_params, control::DEFAULT_L2_NAME)?;
        let engine_fds = engine.event_fds();
        // SAFETY: plain syscalls creating new fds.
        let efd = new_fd(
            unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) },
            "eventfd",
        )?;
        // SAFETY: as above.
        let epoll = new_fd(
            unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) },
            "epoll_create1",
        )?;
        for fd in engine_fds.iter().copied().chain([efd.as_raw_fd()]) {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: fd as u64,
            };
            // SAFETY: both fds are open; `ev` is a valid event.
            let rc =
                unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) };
            if rc != 0 {
                engine.close();
                return Err(PyRuntimeError::new_err(format!(
                    "daxkv: epoll_ctl: {}",
                    std::io::Error::last_os_error()
                )));
            }
        }
        let engine = Arc::new(engine);
        let slot_bytes = engine.slot_bytes();
        let http = match control.http {
            Some(h) => {
                let (e, root) = (engine.clone(), cfg.sysfs_root.clone());
                Some(control::start_or_close(py, &engine, || {
                    control::start_http(h, e, root, &control.l2_name)
                })?)
            }
            None => None,
        };
        Ok(DaxConnector {
            slot_bytes,
            l2_name: control.l2_name,
            http_addr: http
                .as_ref()
                .map(daxkv::control::http::HttpServer::local_addr),
            http: Mutex::new(http),
            state: Mutex::new(State {
                engine: Some(engine),
                sets: Map::default(),
                gets: Map::default(),
                ready: Vec::new(),
                release: Vec::new(),
                busy: Busy::new(slot_bytes),
                own_signalled: false,
            }),
            next: AtomicU64::new(1),
            closing: Mutex::new(()),
            owner: crate::fork::Owner::here(),
            observers: lease::Observers::default(),
            epoll_fd: epoll.as_raw_fd(),
            own_fd: efd.as_raw_fd(),
            epoll: Mutex::new(Some(epoll)),
            efd: Mutex::new(Some(efd)),
        })
    }

    /// Reserve a slot per key for the caller to fill (docs/leases.md):
    /// `sizes[i]` bytes for `keys[i]`. Per key, in order: a `StoreLease`,
    /// `None` when the key is stored or leased already, or a `LeaseError`
    /// instance saying why not (no room, a remap pending, too many
    /// leases). Until its commit a leased key is invisible and a store of
    /// it fails.
    fn lease_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        sizes: Vec<usize>,
    ) -> PyResult<Py<pyo3::types::PyList>> {
        self.owner.check("DaxConnector")?;
        let keys = digest_keys(keys)?;
        self.owner.check("DaxConnector")?;
        let engine = self.engine()?;
        lease::lease_store(py, &engine, keys, sizes)
    }

    /// Commit `leases` (store leases of this connector) as one batch:
    /// per lease, whether its key is now stored (False: canceled, the
    /// connector closing, or the lease already ended).
    fn commit_leases(&self, py: Python<'_>, leases: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        self.owner.check("DaxConnector")?;
        let engine = self.engine()?;
        lease::commit_leases(py, &engine, leases)
    }

    /// Borrow each key's slot for the caller to read: per key a
    /// `ReadLease`, `None` on a miss, or a `LeaseError` instance.
    fn lease_load(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Py<pyo3::types::PyList>> {
        self.owner.check("DaxConnector")?;
        let keys = digest_keys(keys)?;
        self.owner.check("DaxConnector")?;
        let engine = self.engine()?;
        lease::lease_load(py, &engine, keys)
    }

    /// Every device mapping now: `(device, base, length, epoch)`.
    fn regions(&self, py: Python<'_>) -> PyResult<Vec<(u32, usize, usize, u64)>> {
        self.owner.check("DaxConnector")?;
        let engine = self.engine()?;
        Ok(lease::regions(py, &engine))
    }

    /// Follow every device mapping (docs/leases.md, "Following the
    /// mapping"): `observer.mapped(device, base, length, epoch)` at once
    /// for each mapping now, then after every add and remap;
    /// `observer.unmapping(...)` before every remap, remove and close.
    /// The callbacks run on the thread that maps or unmaps, and must not
    /// call this connector. False if already registered, or from a
    /// callback.
    fn observe(&self, py: Python<'_>, observer: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.owner.check("DaxConnector")?;
        let engine = self.engine()?;
        self.observers.observe(py, &engine, observer)
    }

    /// Stop calling `observer`; false if it was not registered.
    fn unobserve(&self, py: Python<'_>, observer: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.owner.check("DaxConnector")?;
        let engine = self.engine()?;
        Ok(self.observers.unobserve(py, &engine, observer))
    }

    /// The one pollable fd (an epoll fd; POLLIN when completions wait).
    /// -1 after `close()`.
    fn event_fd(&self) -> PyResult<i32> {
        self.owner.check("DaxConnector")?;
        Ok(self
            .epoll
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(-1, AsRawFd::as_raw_fd))
    }

    /// `"host:port"` of the control plane started from
    /// `adapter_params["http"]`, or `None` when none was asked for (also
    /// after `close()`, which stops it).
    #[getter]
    fn http_address(&self) -> PyResult<Option<String>> {
        self.owner.check("DaxConnector")?;
        Ok(crate::control::running_address(&self.http, self.http_addr))
    }

    /// The `l2_name` label value (`adapter_params["l2_name"]`).
    #[getter]
    fn l2_name(&self) -> &str {
        &self.l2_name
    }

    /// The engine's metrics in the Prometheus text format, every series
    /// labelled `l2_name` (the names of `daxkv serve`'s `/metrics`).
    fn metrics_text(&self, py: Python<'_>) -> PyResult<String> {
        self.owner.check("DaxConnector")?;
        crate::gil::release(py, || {
            let engine = self.lock().engine.clone().ok_or_else(closed)?;
            Ok(control::metrics_text(&engine, &self.l2_name))
        })
    }

    /// Bytes per slot: the largest value a key can hold.
    #[getter]
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Store `bufs[i]` under `keys[i]` (zero-copy; the caller keeps the
    /// buffers unchanged until the future completes). Returns a future id.
    fn submit_batch_set(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        bufs: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        self.owner.check("DaxConnector")?;
        let keys = digest_keys(keys)?;
        let views = export(bufs, false)?;
        // Again: the conversion above ran the caller's Python code, which
        // may have forked (`fork` module doc).
        self.owner.check("DaxConnector")?;
        if keys.len() != views.len() {
            return Err(PyValueError::new_err(format!(
                "daxkv: submit_batch_set: {} keys but {} buffers",
                keys.len(),
                views.len()
            )));
        }
        let fid = self.fid();
        let slot = self.slot_bytes;
        crate::gil::release(py, move || {
            let mut st = self.lock();
            let engine = st.engine.clone().ok_or_else(closed)?;
            if let Some((i, v)) = views.iter().enumerate().find(|(_, v)| v.len() > slot) {
                let err = format!(
                    "daxkv: source buffer {i} is {} bytes, more than slot_bytes {slot}",
                    v.len()
                );
                st.release.extend(views);
                return Ok(self.complete_now(&mut st, (fid, false, err, None)));
            }
            let held = match st.busy.hold_reads(fid, &ranges(&views)) {
                Ok(h) => h,
                Err((i, c)) => {
                    st.release.extend(views);
                    return Err(clash_error("source", i, &c));
                }
            };
            // SAFETY: `views` is kept in the pending entry until the
            // store's completion is collected (`collect`, or `close`), and
            // no load destination in flight shares their bytes (`busy`).
            let srcs: Vec<Buf> = views.iter().map(|v| Buf::Raw(unsafe { v.raw() })).collect();
            let n = keys.len();
            let p = Pending {
                fid,
                keys: n,
                views,
                held,
            };
            match engine.submit_store(keys, srcs) {
                Ok(id) => {
                    st.sets.insert(id, p);
                    Ok(fid)
                }
                Err(r) => {
                    let closing = matches!(r.error, EngineError::Closing);
                    let err = format!("daxkv: {}", r.error);
                    drop(r);
                    st.finish(p);
                    if closing {
                        return Err(closed());
                    }
                    Ok(self.complete_now(&mut st, (fid, false, err, None)))
                }
            }
        })
    }

    /// Load `keys[i]` into `bufs[i]` (zero-copy; each must be writable,
    /// C-contiguous and at least the stored payload's length). Returns a
    /// future id; its per-key bools say which keys were loaded.
    fn submit_batch_get(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        bufs: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        self.owner.check("DaxConnector")?;
        let keys = digest_keys(keys)?;
        let views = export(bufs, true)?;
        // Again: the conversion above ran the caller's Python code, which
        // may have forked (`fork` module doc).
        self.owner.check("DaxConnector")?;
        if keys.len() != views.len() {
            return Err(PyValueError::new_err(format!(
                "daxkv: submit_batch_get: {} keys but {} buffers",
                keys.len(),
                views.len()
            )));
        }
        let fid = self.fid();
        crate::gil::release(py, move || {
            let mut st = self.lock();
            let engine = st.engine.clone().ok_or_else(closed)?;
            let held = match st.busy.hold_writes(fid, &ranges(&views)) {
                Ok(h) => h,
                Err((i, c)) => {
                    st.release.extend(views);
                    return Err(clash_error("destination", i, &c));
                }
            };
            // SAFETY: `views` is kept in the pending entry until the load's
            // completion is collected; no other buffer in flight shares
            // their bytes (`busy`), and the bridge leaves the destinations
            // alone until then.
            let dsts: Vec<RawBuf> = views.iter().map(|v| unsafe { v.raw() }).collect();
            let n = keys.len();
            let p = Pending {
                fid,
                keys: n,
                views,
                held,
            };
            match engine.submit_load_raw(keys, dsts) {
                Ok(id) => {
                    st.gets.insert(id, p);
                    Ok(fid)
                }
                Err(r) => {
                    let closing = matches!(r.error, EngineError::Closing);
                    let err = format!("daxkv: {}", r.error);
                    drop(r);
                    st.finish(p);
                    if closing {
                        return Err(closed());
                    }
                    Ok(self.complete_now(&mut st, (fid, false, err, Some(vec![false; n]))))
                }
            }
        })
    }

    /// Which keys are stored now, without locking them (see the module
    /// doc). Completes at once; returns its future id.
    fn submit_batch_exists(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<u64> {
        self.owner.check("DaxConnector")?;
        let keys = digest_keys(keys)?;
        // Again: the conversion above ran the caller's Python code, which
        // may have forked (`fork` module doc).
        self.owner.check("DaxConnector")?;
        let fid = self.fid();
        crate::gil::release(py, move || {
            let engine = self.lock().engine.clone().ok_or_else(closed)?;
            let hits = engine.exists_counted(&keys);
            let mut st = self.lock();
            Ok(self.complete_now(&mut st, (fid, true, String::new(), Some(hits))))
        })
    }

    /// Delete the keys (committed and not locked in the engine); per-key
    /// bools say which were deleted. Completes at once.
    fn submit_batch_delete(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<u64> {
        self.owner.check("DaxConnector")?;
        let keys = digest_keys(keys)?;
        // Again: the conversion above ran the caller's Python code, which
        // may have forked (`fork` module doc).
        self.owner.check("DaxConnector")?;
        let fid = self.fid();
        crate::gil::release(py, move || {
            let engine = self.lock().engine.clone().ok_or_else(closed)?;
            let bits = deleted_bits(&keys, engine.delete(&keys));
            let mut st = self.lock();
            Ok(self.complete_now(&mut st, (fid, true, String::new(), Some(bits))))
        })
    }

    /// Every completion not drained before, as `(future_id, ok, error,
    /// per_key_bools_or_None)`; resets the event fd. Never blocks on the
    /// engine.
    fn drain_completions(&self, py: Python<'_>) -> PyResult<Vec<Completion>> {
        self.owner.check("DaxConnector")?;
        let (out, release) = crate::gil::release(py, || {
            // Reset first, then collect: a completion published after the
            // collection signals again. Only the readable fds are read
            // (module doc, "The one fd"). While the state holds the engine,
            // `close` has not begun closing any of these fds: it takes the
            // engine out first, under this mutex.
            let mut st = self.lock();
            if st.engine.is_some() {
                let own = self.own_fd;
                let ready = readable(self.epoll_fd);
                for fd in ready.iter().flatten().copied() {
                    reset_fd(fd);
                }
                // Read with the others when readable; the flag follows
                // the count (it is never true with the count at zero, but
                // a failed `epoll_wait` reads nothing: read ours anyway).
                if st.own_signalled && !ready.iter().flatten().any(|&fd| fd == own) {
                    reset_fd(own);
                }
                st.own_signalled = false;
            }
            Self::collect(&mut st);
            (
                std::mem::take(&mut st.ready),
                std::mem::take(&mut st.release),
            )
        });
        drop(release);
        Ok(out)
    }

    /// Engine status (a dict: `is_healthy`, `locked_key_count`, devices…).
    /// `{"is_healthy": False, "closed": True}` after `close()`.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.owner.check("DaxConnector")?;
        let v = crate::gil::release(py, || {
            self.lock().engine.clone().map_or_else(
                || serde_json::json!({"is_healthy": false, "closed": true}),
                |e| e.status(),
            )
        });
        json_to_py(py, &v)
    }

    /// Futures submitted and not yet drained.
    fn pending(&self) -> PyResult<usize> {
        self.owner.check("DaxConnector")?;
        let st = self.lock();
        Ok(st.sets.len() + st.gets.len() + st.ready.len())
    }

    /// Wait for the tasks in flight, stop the engine, release every buffer
    /// and close the fds. Completions not drained stay drainable.
    /// Idempotent.
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
        let release = crate::gil::release(py, || {
            let _one_closer = self.closing.lock().unwrap_or_else(PoisonError::into_inner);
            // The control plane first: it stops accepting, and the port is
            // free when close returns. An operation it already runs goes
            // on, on its own thread; `Engine::close` waits for it (the
            // engine's admin lock orders hotplug against close).
            let http = self
                .http
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some(h) = http {
                h.shutdown();
            }
            // Closed for everyone else before the engine closes its fds: a
            // submit now fails with "closed", and `drain_completions`,
            // seeing no engine, no longer reads the engine's eventfds
            // (their numbers may belong to another file by then).
            let Some(engine) = self.lock().engine.take() else {
                return Vec::new();
            };
            engine.close();
            let mut st = self.lock();
            Self::collect_from(&engine, &mut st);
            // Anything still pending can no longer complete: fail it so
            // every future completes.
            let st = &mut *st;
            let left: Vec<Pending> = st
                .sets
                .drain()
                .chain(st.gets.drain())
                .map(|(_, p)| p)
                .collect();
            for p in left {
                st.ready
                    .push((p.fid, false, "daxkv: connector closed".into(), None));
                st.finish(p);
            }
            // Wake a poller blocked on `event_fd()` for the last
            // completions (its fd then reads as closed).
            self.signal();
            *self.epoll.lock().unwrap_or_else(PoisonError::into_inner) = None;
            *self.efd.lock().unwrap_or_else(PoisonError::into_inner) = None;
            std::mem::take(&mut st.release)
        });
        drop(release);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }
}

impl Drop for DaxConnector {
    fn drop(&mut self) {
        if self.owner.forked() {
            // A forked child: stopping the control plane or closing the
            // engine would join threads that do not exist here and touch
            // the parent's slots; both are leaked (`fork` module doc).
            let http = self
                .http
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            std::mem::forget(http);
            let engine = self
                .state
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .engine
                .take();
            std::mem::forget(engine);
            return;
        }
        // The control plane first (as in `close`).
        let http = self
            .http
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let engine = self
            .state
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .engine
            .take();
        // Dropped by Python (the GIL is held). Stopping the control plane
        // and closing the engine wait for an operation in progress, whose
        // mapping observer may be a Python callback waiting for the GIL:
        // both run with the GIL released, as `close` does
        // (`python/tests/test_leases.py::test_dropping_a_connector_never_deadlocks_with_an_observer_callback`).
        Python::with_gil(|py| {
            if let Some(h) = &http {
                crate::fork::stops_listening(py, h.listener_fd());
            }
            crate::gil::release(py, move || {
                drop(http);
                if let Some(e) = engine {
                    // Tasks using exported buffers finish before the
                    // exports are released (the state, dropped after
                    // this, holds them).
                    e.close();
                }
            });
        });
    }
}

/// The extension module.
#[pymodule]
fn _daxkv(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DaxConnector>()?;
    m.add_class::<lease::StoreLease>()?;
    m.add_class::<lease::ReadLease>()?;
    m.add("LeaseError", m.py().get_type::<lease::LeaseError>())?;
    gil::register(m)?;
    // The fork mark's page, before any face records its owner.
    let _ = fork::mark();
    m.add("DaxConfigError", config_error_type(m.py())?)?;
    l2::register(m)?;
    m.add_class::<store::PyDaxStore>()?;
    Ok(())
}
