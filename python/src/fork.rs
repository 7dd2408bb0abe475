//! # Use after `fork()`
//!
//! A forked child shares the parent's device mappings (`MAP_SHARED`) but
//! not its worker threads: a task submitted there would never run, and a
//! write would land in the parent's slots. Each face records the process
//! that opened it; in any other process every call raises `RuntimeError`
//! and `close()` / drop do nothing (the engine is leaked in the child:
//! closing it would join threads that do not exist there, and touch the
//! parent's slots).
//!
//! A call checks twice: first, and again once its arguments are converted
//! and before it reaches the engine. The conversion runs the caller's
//! Python code (a key's `to_string()`, a keys generator), which may fork:
//! the child then goes on inside the parent's call, and a `put_batch`
//! wrote its copy of the caller's buffer into the parent's slots.
//!
//! The check reads a process generation, not the pid: `getpid()` is a
//! system call (about 90 ns on a VM, several per task on the plugin
//! path's hot calls), while the generation is one atomic load. The
//! generation is bumped in every child of `fork()` by a `pthread_atfork`
//! child handler, registered before any face records its owner; it runs
//! for every `fork()` through the C library (Python's `os.fork`,
//! `multiprocessing`, a C extension's `fork()`), before the child's first
//! instruction after the call. A child made by a raw `clone` system call
//! that bypasses the C library's `fork()` would not be seen; nothing in a
//! Python process does that and then goes on running Python code
//! (`posix_spawn` / `vfork` children exec at once).
//!
//! A child also inherits the sockets the parent's control planes listen
//! on; it closes its copies at once ([`close_listeners_in_child`]), else
//! the port stays bound after the parent's `close()` for as long as the
//! child lives (a reopen fails with EADDRINUSE, a client hangs in the
//! backlog).

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once, PoisonError};

use pyo3::exceptions::PyRuntimeError;
use pyo3::{PyErr, Python};

/// The control planes' listening sockets open in this process. Only
/// touched with the GIL held (hence the `Python` tokens), so no other
/// thread holds the lock when the forking thread (which holds the GIL)
/// forks: the child's hook never waits on a lock of a thread that is gone.
static LISTENERS: Mutex<Vec<RawFd>> = Mutex::new(Vec::new());

/// A control plane started listening on `fd`.
pub(crate) fn listening(_py: Python<'_>, fd: RawFd) {
    LISTENERS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(fd);
}

/// The control plane on `fd` is about to stop (its socket to be closed):
/// a child forked after this must not close the number, which may by then
/// name another file.
pub(crate) fn stops_listening(_py: Python<'_>, fd: RawFd) {
    LISTENERS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .retain(|&f| f != fd);
}

/// In a forked child (the `os.register_at_fork` hook, with the GIL):
/// close the copies of the parent's listening sockets (module doc). The
/// servers' objects are leaked here (the faces' drop in a child), so
/// nothing uses these numbers again.
pub(crate) fn close_listeners_in_child(_py: Python<'_>) {
    let fds = std::mem::take(&mut *LISTENERS.lock().unwrap_or_else(PoisonError::into_inner));
    for fd in fds {
        // SAFETY: `fd` is this child's copy of a listening socket that no
        // object here will close or use (above); closing it only drops
        // the child's reference to the socket.
        unsafe { libc::close(fd) };
    }
}

/// How many `fork()`s lie between the first process and this one (module
/// doc): 0 in the process that loaded daxkv, bumped in each child.
static GENERATION: AtomicU64 = AtomicU64::new(0);
static AT_FORK: Once = Once::new();

/// The `pthread_atfork` child handler: runs in the child, on its only
/// thread, before `fork()` returns there.
extern "C" fn in_child() {
    // ORDERING: Relaxed — read later by this same thread (program order)
    // or by threads it starts (spawning synchronizes).
    GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// The process a face was opened in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Owner {
    pid: u32,
    generation: u64,
}

impl Owner {
    /// The calling process.
    pub(crate) fn here() -> Owner {
        AT_FORK.call_once(|| {
            // SAFETY: registers a handler that only bumps an atomic
            // (async-signal-safe, as a child handler must be); no prepare
            // or parent handler.
            let rc = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
            // It fails only with ENOMEM. Without the handler a child could
            // not be told apart: refuse to open (a panic here is a Python
            // exception) rather than let a child write into its parent's
            // slots.
            assert_eq!(rc, 0, "daxkv: pthread_atfork failed ({rc})");
        });
        Owner {
            pid: std::process::id(),
            // ORDERING: Relaxed — see `in_child`.
            generation: GENERATION.load(Ordering::Relaxed),
        }
    }

    /// True in a process other than the one that opened it (a child).
    pub(crate) fn forked(self) -> bool {
        // ORDERING: Relaxed — see `in_child`.
        GENERATION.load(Ordering::Relaxed) != self.generation
    }

    /// `RuntimeError` in a forked child (module doc).
    pub(crate) fn check(self, what: &str) -> Result<(), PyErr> {
        if self.forked() {
            return Err(PyRuntimeError::new_err(format!(
                "daxkv: this {what} was opened in process {} and cannot be used in process {} \
                 (a fork): its workers do not exist here; open a new one in this process",
                self.pid,
                std::process::id()
            )));
        }
        Ok(())
    }
}
