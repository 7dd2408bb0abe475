//! # Releasing the GIL safely near interpreter exit
//!
//! When CPython finalizes, a daemon thread that takes the GIL back is ended
//! with `pthread_exit` (3.11–3.13). Its forced unwind would run through
//! the Rust frames of the daxkv call it is in (PyO3's `allow_threads`
//! restores the GIL from Rust) and the process aborts ("FATAL: exception
//! not rethrown", SIGABRT). LMCache's controllers are daemon threads that
//! call the adapter in a loop, so a script that exits without closing them
//! would die this way.
//!
//! So no thread inside daxkv takes the GIL back once finalization may have
//! begun. CPython runs `atexit` callbacks *before* it marks itself
//! finalizing, with every daemon thread still running normally; the hook
//! [`at_exit`] (registered at import) sets [`FINALIZING`] and then waits,
//! with the GIL released, until no thread is between "checked the flag"
//! and "done with the GIL inside daxkv" ([`WINDOW`]). A thread that finds
//! the flag set while outside the GIL parks for ever (it is a daemon thread
//! at exit: the process ends under it, as CPython 3.14 ends such threads).
//! The main thread (the one running the hook, and finalization after it)
//! never parks, nor does a thread already in the window (a daxkv call
//! made from a callback daxkv runs: the hook waits for the outer entry).
//!
//! ## The handshake (a Dekker pair, hence `SeqCst`)
//!
//! ```text
//! thread T (GIL released)            at_exit (main thread)
//! WINDOW += 1                        FINALIZING = true
//! if FINALIZING { WINDOW -= 1; park }  release GIL
//! take GIL; …; WINDOW -= 1           wait until WINDOW == 0; take GIL
//! ```
//!
//! The interleaving this rules out: T reads `FINALIZING == false`, the hook
//! sets it and sees `WINDOW == 0`, finalization begins, T takes the GIL and
//! is `pthread_exit`ed inside Rust. With both sides `SeqCst` (a store then
//! a load on each side), at least one sees the other's write: either T sees
//! the flag and parks, or the hook sees T in the window and waits for it to
//! leave — which T does while the interpreter is still in `atexit` (the
//! hook has released the GIL). Acquire/Release would allow both loads to
//! read the old values (store→load reordering).
//!
//! A daxkv call that runs Python code under its own Rust frame with the
//! GIL held (a key's `to_string()`, LMCache's `byte_array` property,
//! `json.dumps`, iterating a caller's keys or buffers — a generator —, a
//! callback through [`with_gil`]) is the same door: that
//! code may hand the GIL to another thread and take it back. Such a
//! stretch is counted in the window too ([`held`], [`with_gil`]); the hook
//! waits for it to end.
//!
//! The tests are hunting ones (`python/tests/test_edges.py`: daemon
//! threads looping on every face's calls when a script exits, on CPython
//! 3.11, 3.12 and 3.13, three runs each; before this module most runs died
//! with SIGABRT, and without [`held`] in the backend's key conversion the
//! `to_string()` variant still did). loom cannot check this pair: it
//! models `SeqCst` as acquire/release, under which a correct Dekker pair
//! reports a failure.
//!
//! The wait is bounded ([`EXIT_WAIT`]): a thread inside a Python callback
//! called by daxkv (an allocator, a hook) that never returns cannot hold
//! the exit up for ever.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use pyo3::marker::Ungil;
use pyo3::prelude::*;

/// Set by [`at_exit`]: the interpreter is about to finalize.
static FINALIZING: AtomicBool = AtomicBool::new(false);
/// Threads between "checked [`FINALIZING`]" and "done with the GIL inside
/// daxkv".
static WINDOW: AtomicUsize = AtomicUsize::new(0);
/// The thread that ran [`at_exit`] (it finalizes: it never parks). Set
/// before [`FINALIZING`] is stored.
static MAIN: OnceLock<ThreadId> = OnceLock::new();

/// How long [`at_exit`] waits for the threads in the window.
const EXIT_WAIT: Duration = Duration::from_secs(5);

thread_local! {
    /// This thread's own entries in [`WINDOW`] (stretches nest: a callback
    /// under [`with_gil`] may make another daxkv call). A forked child
    /// keeps the forking thread's entries ([`_after_fork_in_child`]).
    static MINE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Whether this thread is in the window already: a stretch inside a
/// callback (`with_gil`) or inside another stretch. Such a thread never
/// parks: the hook waits for its outer entry, so it must run on to the end
/// of it (parking there held the exit up for the hook's whole bound, and
/// parked the thread inside the outer call — a restore holding its
/// locks).
fn in_window() -> bool {
    MINE.with(|m| m.get() > 0)
}

/// Count this thread into [`WINDOW`].
fn window_add() {
    MINE.with(|m| m.set(m.get() + 1));
    // ORDERING: SeqCst — the Dekker pair with `at_exit` (module doc):
    // this increment is ordered before the caller's flag load.
    WINDOW.fetch_add(1, Ordering::SeqCst);
}

/// Count this thread out of [`WINDOW`].
fn window_sub() {
    MINE.with(|m| m.set(m.get() - 1));
    // ORDERING: SeqCst — the hook's wait loads it; the thread's GIL work
    // is done (module doc).
    WINDOW.fetch_sub(1, Ordering::SeqCst);
}

/// Leaves the window on drop (also when the section panics).
#[must_use = "the stretch ends when this is dropped"]
pub(crate) struct InWindow;

impl Drop for InWindow {
    fn drop(&mut self) {
        window_sub();
    }
}

/// Enter the window, or park for ever if the interpreter is finalizing
/// (on any thread but the one finalizing it). Call without the GIL.
fn enter_window() -> InWindow {
    if enter_or_must_park() {
        park_forever();
    }
    InWindow
}

/// Count this thread into [`WINDOW`]; or, when the interpreter may be
/// finalizing and this is a fresh (not nested) entry on a thread other
/// than the one finalizing it, count it back out and say it must park
/// (out of the window first, so the hook's wait ends).
fn enter_or_must_park() -> bool {
    let nested = in_window();
    window_add();
    // ORDERING: SeqCst — pairs with the store in `at_exit`.
    let park = !nested
        && FINALIZING.load(Ordering::SeqCst)
        && MAIN.get() != Some(&std::thread::current().id());
    if park {
        window_sub();
    }
    park
}

/// A daemon thread at interpreter exit: never come back to Python.
fn park_forever() -> ! {
    loop {
        std::thread::park();
    }
}

/// `py.allow_threads(f)`, except that the thread never takes the GIL back
/// once the interpreter may be finalizing (module doc): every daxkv method
/// that releases the GIL goes through here.
pub(crate) fn release<T, F>(py: Python<'_>, f: F) -> T
where
    F: Ungil + Send + FnOnce() -> T,
    T: Ungil + Send,
{
    #[allow(clippy::disallowed_methods)] // the one wrapper
    let (r, window) = py.allow_threads(|| {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        // Still without the GIL: PyO3 takes it back when this returns.
        (r, enter_window())
    });
    drop(window);
    match r {
        Ok(v) => v,
        Err(p) => std::panic::resume_unwind(p),
    }
}

/// Mark a stretch where this thread holds the GIL inside a daxkv call and
/// may run Python code (a key's `to_string()`, LMCache's `byte_array`
/// property, `json.dumps`): that code may hand the GIL to another thread
/// and take it back, which at exit would end this thread inside Rust. The
/// hook waits for the stretch to end (the thread runs: the hook has
/// released the GIL); a thread that would start one after the flag is set
/// releases the GIL and parks instead. The GIL orders this check against
/// the hook's flag store (both hold it), so no Dekker pair is needed here;
/// `SeqCst` keeps one ordering for every access of the pair.
pub(crate) fn held(py: Python<'_>) -> InWindow {
    if enter_or_must_park() {
        // Parking with the GIL held would stop the interpreter's exit.
        #[allow(clippy::disallowed_methods)]
        py.allow_threads(|| -> () { park_forever() });
    }
    InWindow
}

/// `Python::with_gil(f)` from inside a [`release`]d section (a callback
/// into Python): parks instead if the interpreter may be finalizing, and
/// holds the exit hook off while the callback runs.
pub(crate) fn with_gil<T, F>(f: F) -> T
where
    F: for<'py> FnOnce(Python<'py>) -> T,
{
    let _window = enter_window();
    Python::with_gil(f)
}

/// The `atexit` hook (module doc): registered by the module's init.
#[pyfunction]
pub(crate) fn _at_exit(py: Python<'_>) {
    let _ = MAIN.set(std::thread::current().id());
    // ORDERING: SeqCst — the Dekker pair with `enter_window`: this store
    // is ordered before the `WINDOW` loads below.
    FINALIZING.store(true, Ordering::SeqCst);
    // The main thread, which finalizes after this: never parks.
    #[allow(clippy::disallowed_methods)]
    py.allow_threads(|| {
        let start = Instant::now();
        // ORDERING: SeqCst — pairs with `enter_window` / `InWindow::drop`.
        while WINDOW.load(Ordering::SeqCst) > 0 && start.elapsed() < EXIT_WAIT {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

/// In a forked child: of the threads in the window only the forking one
/// exists here (the others, waiting for the GIL it held, are gone), but
/// the count was copied; left as it was, the child's exit hook would wait
/// its full bound for threads that are gone. The forking thread keeps its
/// own entries: it may have forked inside a stretch (a key's
/// `to_string()`, a callback), whose end in the child takes its entry out
/// again — a reset to 0 then went below zero (`usize::MAX`), and the
/// child's exit hook waited its whole bound.
/// Also closes the child's copies of the control planes' listening
/// sockets (`fork` module doc).
#[pyfunction]
pub(crate) fn _after_fork_in_child(py: Python<'_>) {
    // ORDERING: SeqCst — the child has one thread; the handshake's
    // ordering is kept for uniformity.
    WINDOW.store(MINE.with(std::cell::Cell::get), Ordering::SeqCst);
    crate::fork::close_listeners_in_child(py);
}

/// Threads in the window now (tests).
#[pyfunction]
pub(crate) fn _window_count() -> usize {
    // ORDERING: Relaxed — a diagnostic read.
    WINDOW.load(Ordering::Relaxed)
}

/// Register [`_at_exit`] with Python's `atexit`, and the fork reset
/// [`_after_fork_in_child`] with `os.register_at_fork`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let f = wrap_pyfunction!(_at_exit, m)?;
    m.add_function(f.clone())?;
    py.import("atexit")?.call_method1("register", (f,))?;
    let child = wrap_pyfunction!(_after_fork_in_child, m)?;
    m.add_function(child.clone())?;
    let kw = pyo3::types::PyDict::new(py);
    kw.set_item("after_in_child", child)?;
    py.import("os")?
        .call_method("register_at_fork", (), Some(&kw))?;
    m.add_function(wrap_pyfunction!(_window_count, m)?)?;
    m.add_function(wrap_pyfunction!(_finalizing, m)?)?;
    Ok(())
}

/// Whether the interpreter is at exit (tests of the handshake).
#[pyfunction]
pub(crate) fn _finalizing() -> bool {
    // ORDERING: Relaxed — a diagnostic read.
    FINALIZING.load(Ordering::Relaxed)
}
