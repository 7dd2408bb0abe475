//! # Slot leases and mapping observers from Python
//!
//! `DaxConnector.lease_store` / `lease_load` / `commit_leases` / `regions`
//! / `observe` over the engine's leases (docs/leases.md): a caller copies
//! into or out of a slot itself (a GPU's copy engine into the mapping
//! registered with CUDA: `daxkv.cuda`), between calls. Every method that
//! may wait on an engine lock releases the GIL first (`gil::release`):
//! an observer's callback takes the GIL under a device's admin lock, so a
//! thread holding the GIL while it waited on that lock would deadlock
//! with it (`python/tests/test_leases.py` hunts it during remaps).

use std::sync::{Arc, Mutex, PoisonError};

use daxkv::device::arena::Region;
use daxkv::engine::{
    DeviceId, DeviceObserver, Engine, EngineLeased, EngineReadLease, EngineStoreLease,
};
use daxkv::{Key, LeaseError as CoreLeaseError};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::View;

pyo3::create_exception!(
    _daxkv,
    LeaseError,
    PyRuntimeError,
    "A slot lease was refused, canceled, or is already ended (the message says which)."
);

fn lease_err(e: &CoreLeaseError) -> PyErr {
    LeaseError::new_err(format!("daxkv: {e}"))
}

fn ended(what: &str) -> PyErr {
    LeaseError::new_err(format!("daxkv: this {what} has already ended"))
}

/// A slot reserved for a key (`DaxConnector.lease_store`): write `size`
/// bytes at `ptr` (a GPU copy into the registered mapping, or
/// `write(buf)` from host memory), then `commit()`; `abort()`, leaving a
/// `with` block without a commit, or dropping it frees the slot. Finish
/// every copy (stream synchronized) before you commit or abort.
#[pyclass(module = "daxkv._daxkv", frozen)]
pub(crate) struct StoreLease {
    lease: Mutex<Option<EngineStoreLease>>,
    /// In a forked child every call raises and abort / drop do nothing:
    /// the slot, its state word and the parent's copy of this lease are
    /// the parent's (`fork` module doc).
    owner: crate::fork::Owner,
    key: Key,
    /// Where the payload goes (an address in this process).
    #[pyo3(get)]
    ptr: usize,
    /// The payload's length, bytes.
    #[pyo3(get)]
    size: usize,
    /// The slot's byte offset in its device's mapping.
    #[pyo3(get)]
    offset: usize,
    /// The device the slot is on.
    #[pyo3(get)]
    device: u32,
    /// The epoch of the mapping `ptr` is in (`DaxConnector.regions()`).
    #[pyo3(get)]
    epoch: u64,
}

impl StoreLease {
    fn new(l: EngineStoreLease) -> StoreLease {
        StoreLease {
            owner: crate::fork::Owner::here(),
            key: l.key(),
            ptr: l.ptr() as usize,
            size: l.len(),
            offset: l.offset(),
            device: l.device().0,
            epoch: l.epoch(),
            lease: Mutex::new(Some(l)),
        }
    }

    fn take(&self) -> Option<EngineStoreLease> {
        self.lease
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

#[pymethods]
impl StoreLease {
    /// Copy `buf` (any C-contiguous buffer: bytes, bytearray, a numpy
    /// array) into the payload at byte `at`. The buffer must not change
    /// while the call runs.
    #[pyo3(signature = (buf, at = 0))]
    fn write(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, at: usize) -> PyResult<()> {
        self.owner.check("StoreLease")?;
        let view = View::get(buf, false)?;
        // Again: exporting `buf` may run Python code, which may fork.
        self.owner.check("StoreLease")?;
        let (addr, len) = (view.addr(), view.len());
        let r = crate::gil::release(py, || {
            let mut g = self.lease.lock().unwrap_or_else(PoisonError::into_inner);
            let l = g.as_mut().ok_or_else(|| ended("store lease"))?;
            // SAFETY: the export keeps `len` bytes at `addr` alive while
            // `view` lives (past this call: dropped below, with the GIL);
            // the caller leaves them unchanged meanwhile (the method's
            // contract).
            let src = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
            l.write(at, src)
                .map_err(|e| PyValueError::new_err(format!("daxkv: write: {e}")))
        });
        drop(view);
        r
    }

    /// The key is stored (readable, the listeners told). Raises
    /// `LeaseError` if it was canceled (a forced remove of its device),
    /// the connector is closing, or the lease already ended.
    fn commit(&self, py: Python<'_>) -> PyResult<()> {
        self.owner.check("StoreLease")?;
        crate::gil::release(py, || {
            let l = self.take().ok_or_else(|| ended("store lease"))?;
            l.commit().map_err(|e| lease_err(&e))
        })
    }

    /// Free the slot without storing the key (nothing if already ended,
    /// or in a forked child).
    fn abort(&self, py: Python<'_>) {
        if self.owner.forked() {
            return;
        }
        crate::gil::release(py, || {
            if let Some(l) = self.take() {
                l.abort();
            }
        });
    }

    /// True until committed or aborted.
    #[getter]
    fn is_open(&self) -> bool {
        self.lease
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Leaving the block aborts a lease that was not committed.
    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.abort(py);
    }

    fn __repr__(&self) -> String {
        format!(
            "<daxkv.StoreLease key={:?} device={} offset={} size={} {}>",
            self.key,
            self.device,
            self.offset,
            self.size,
            if self.is_open() { "open" } else { "ended" }
        )
    }
}

/// A readable slot kept from being freed or reused
/// (`DaxConnector.lease_load`): read `size` bytes at `ptr` (a GPU copy
/// from the registered mapping, or `read(buf)` into host memory), then
/// `release()` (or leave the `with` block, or drop it). Finish every copy
/// before you release.
#[pyclass(module = "daxkv._daxkv", frozen)]
pub(crate) struct ReadLease {
    lease: Mutex<Option<EngineReadLease>>,
    /// As for [`StoreLease`]: in a forked child every call raises and
    /// release / drop do nothing (the pin is the parent's).
    owner: crate::fork::Owner,
    /// Where the payload is.
    #[pyo3(get)]
    ptr: usize,
    /// The payload's length, bytes.
    #[pyo3(get)]
    size: usize,
    /// The slot's byte offset in its device's mapping.
    #[pyo3(get)]
    offset: usize,
    /// The device the slot is on.
    #[pyo3(get)]
    device: u32,
    /// The epoch of the mapping `ptr` is in.
    #[pyo3(get)]
    epoch: u64,
}

#[pymethods]
impl ReadLease {
    /// Copy the payload from byte `at` into the writable buffer `buf` (as
    /// much as fits): the number of bytes copied.
    #[pyo3(signature = (buf, at = 0))]
    fn read(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, at: usize) -> PyResult<usize> {
        self.owner.check("ReadLease")?;
        let view = View::get(buf, true)?;
        // Again: exporting `buf` may run Python code, which may fork.
        self.owner.check("ReadLease")?;
        let (addr, len) = (view.addr(), view.len());
        let r = crate::gil::release(py, || {
            let g = self.lease.lock().unwrap_or_else(PoisonError::into_inner);
            let l = g.as_ref().ok_or_else(|| ended("read lease"))?;
            // SAFETY: a writable export of `len` bytes at `addr`, alive
            // while `view` lives (past this call); the caller does not
            // touch it while the call runs (the method's contract).
            let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            l.read(at, dst)
                .map_err(|e| PyValueError::new_err(format!("daxkv: read: {e}")))
        });
        drop(view);
        r
    }

    /// End the lease (nothing if already ended, or in a forked child).
    fn release(&self, py: Python<'_>) {
        if self.owner.forked() {
            return;
        }
        crate::gil::release(py, || {
            // Out of the mutex before it drops: the drop may end a removed
            // device's mapping, whose observer may be a Python callback
            // waiting for the GIL, which a thread asking `is_open` may
            // hold while it waits for this mutex.
            let l = self
                .lease
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            drop(l);
        });
    }

    /// True until released.
    #[getter]
    fn is_open(&self) -> bool {
        self.lease
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.release(py);
    }

    fn __repr__(&self) -> String {
        format!(
            "<daxkv.ReadLease device={} offset={} size={} {}>",
            self.device,
            self.offset,
            self.size,
            if self.is_open() { "open" } else { "ended" }
        )
    }
}

/// In a forked child, take the lease out and forget it: ending it there
/// would free the parent's slot, or unpin it (its state word is in the
/// shared mapping), under the parent.
fn leave_in_child<L>(owner: crate::fork::Owner, lease: &mut Mutex<Option<L>>) {
    if owner.forked() {
        if let Some(l) = lease
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            std::mem::forget(l);
        }
    }
}

impl Drop for StoreLease {
    fn drop(&mut self) {
        leave_in_child(self.owner, &mut self.lease);
    }
}

impl Drop for ReadLease {
    fn drop(&mut self) {
        leave_in_child(self.owner, &mut self.lease);
    }
}

/// `DaxConnector.lease_store`: per key a `StoreLease`, `None` (stored or
/// leased already) or a `LeaseError` instance (refused: the reason).
pub(crate) fn lease_store(
    py: Python<'_>,
    engine: &Arc<Engine>,
    keys: Vec<Key>,
    sizes: Vec<usize>,
) -> PyResult<Py<PyList>> {
    let given = crate::gil::release(py, || engine.lease_store(&keys, &sizes))
        .map_err(|e| PyValueError::new_err(format!("daxkv: {e}")))?;
    let out = PyList::empty(py);
    for r in given {
        match r {
            Ok(EngineLeased::Leased(l)) => out.append(Py::new(py, StoreLease::new(l))?)?,
            Ok(EngineLeased::AlreadyPresent) => out.append(py.None())?,
            Err(e) => out.append(lease_err(&e).value(py))?,
        }
    }
    Ok(out.unbind())
}

/// `DaxConnector.commit_leases`: commit each open lease of `leases` in
/// one batch (the listeners told once): per lease, committed or not.
pub(crate) fn commit_leases(
    py: Python<'_>,
    engine: &Arc<Engine>,
    leases: &Bound<'_, PyAny>,
) -> PyResult<Vec<bool>> {
    let objs: Vec<Py<StoreLease>> = {
        let _stretch = crate::gil::held(py);
        leases
            .try_iter()?
            .map(|o| o.and_then(|o| o.extract::<Py<StoreLease>>()))
            .collect::<PyResult<_>>()?
    };
    // A lease opened in another process (a parent, before a fork): refuse
    // the batch before any lease is taken, whichever connector commits it.
    for o in &objs {
        o.get().owner.check("StoreLease")?;
    }
    Ok(crate::gil::release(py, || {
        let mut open = Vec::with_capacity(objs.len());
        let mut at = Vec::with_capacity(objs.len());
        for (i, o) in objs.iter().enumerate() {
            if let Some(l) = o.get().take() {
                open.push(l);
                at.push(i);
            }
        }
        let mut answers = Vec::with_capacity(open.len());
        engine.commit_into(&mut open, &mut answers);
        let mut out = vec![false; objs.len()];
        for (i, r) in at.into_iter().zip(answers) {
            out[i] = r.is_ok();
        }
        out
    }))
}

/// `DaxConnector.lease_load`: per key a `ReadLease`, `None` on a miss, or
/// a `LeaseError` instance.
pub(crate) fn lease_load(
    py: Python<'_>,
    engine: &Arc<Engine>,
    keys: Vec<Key>,
) -> PyResult<Py<PyList>> {
    let got = crate::gil::release(py, || engine.lease_load(&keys));
    let out = PyList::empty(py);
    for r in got {
        match r {
            Ok(Some(l)) => out.append(Py::new(
                py,
                ReadLease {
                    owner: crate::fork::Owner::here(),
                    ptr: l.ptr() as usize,
                    size: l.len(),
                    offset: l.offset(),
                    device: l.device().0,
                    epoch: l.epoch(),
                    lease: Mutex::new(Some(l)),
                },
            )?)?,
            Ok(None) => out.append(py.None())?,
            Err(e) => out.append(lease_err(&e).value(py))?,
        }
    }
    Ok(out.unbind())
}

/// `DaxConnector.regions()`: `(device, base, length, epoch)` per mapping.
pub(crate) fn regions(py: Python<'_>, engine: &Arc<Engine>) -> Vec<(u32, usize, usize, u64)> {
    crate::gil::release(py, || {
        engine
            .regions()
            .into_iter()
            .map(|(d, r)| (d.0, r.base, r.len, r.epoch))
            .collect()
    })
}

/// A Python object with `mapped(device, base, length, epoch)` and
/// `unmapping(device, base, length, epoch)` as an engine observer. Its
/// callbacks run on whichever thread maps or unmaps (a remap's, a
/// close's, the last lease's), with the GIL taken for them; an exception
/// is printed and ignored (the mapping's life goes on).
pub(crate) struct PyObserver(pub(crate) Py<PyAny>);

impl PyObserver {
    fn call(&self, name: &str, device: DeviceId, r: &Region) {
        crate::gil::with_gil(|py| {
            let args = (device.0, r.base, r.len, r.epoch);
            if let Err(e) = self.0.bind(py).call_method1(name, args) {
                e.print(py);
            }
        });
    }
}

impl DeviceObserver for PyObserver {
    fn mapped(&self, device: DeviceId, region: &Region) {
        self.call("mapped", device, region);
    }

    fn unmapping(&self, device: DeviceId, region: &Region) {
        self.call("unmapping", device, region);
    }
}

/// The connector's observers, by the Python object's identity.
#[derive(Default)]
pub(crate) struct Observers(Mutex<Vec<(usize, Arc<dyn DeviceObserver>)>>);

impl Observers {
    /// Register `obj` (once) on `engine`; the replay's callbacks run now.
    pub(crate) fn observe(
        &self,
        py: Python<'_>,
        engine: &Arc<Engine>,
        obj: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        for m in ["mapped", "unmapping"] {
            if !obj.hasattr(m)? {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "daxkv: an observer needs a {m}(device, base, length, epoch) method"
                )));
            }
        }
        // From a callback: refused before our own lock (held around the
        // engine's replay on this very thread).
        if daxkv::device::arena::in_observer_callback() {
            return Ok(false);
        }
        let id = obj.as_ptr() as usize;
        let obs: Arc<dyn DeviceObserver> = Arc::new(PyObserver(obj.clone().unbind()));
        Ok(crate::gil::release(py, || {
            let mut g = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            if g.iter().any(|(i, _)| *i == id) {
                return false;
            }
            let ok = engine.observe(obs.clone());
            if ok {
                g.push((id, obs));
            }
            ok
        }))
    }

    /// Unregister `obj`; false if it was not registered.
    pub(crate) fn unobserve(
        &self,
        py: Python<'_>,
        engine: &Arc<Engine>,
        obj: &Bound<'_, PyAny>,
    ) -> bool {
        if daxkv::device::arena::in_observer_callback() {
            return false;
        }
        let id = obj.as_ptr() as usize;
        crate::gil::release(py, || {
            let mut g = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(i) = g.iter().position(|(x, _)| *x == id) else {
                return false;
            };
            let (_, obs) = g.remove(i);
            engine.unobserve(&obs)
        })
    }
}
