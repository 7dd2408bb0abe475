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
//! The check compares a token the face recorded when it was opened with a
//! word the kernel clears in every child (a page marked
//! `MADV_WIPEONFORK`), not the pid with `getpid()`: that is a system call
//! (about 90 ns on a VM, several per task on the plugin path's hot calls),
//! the word one load. The first face opened in a process writes a fresh
//! random non-zero token into the word; the kernel zeroes the page in the
//! child of every fork, by whatever route: the C library's `fork()` and
//! `_Fork()` (which runs no `pthread_atfork` handler), a raw `fork` /
//! `clone` system call without `CLONE_VM`. So in a child the word is 0,
//! or, once the child opened a face of its own, a token of the child's:
//! never the parent's. (A pid would not do: a child in a new pid
//! namespace, or one that got a dead parent's pid number, can have its
//! parent's pid.) A `pthread_atfork` handler was tried first and missed
//! `_Fork()`, raw system calls, and a handler registered while another
//! thread was inside `fork()`; the pid in the word missed the pid
//! namespace child (`test_edges.py`: `test_fork_by_the_c_library_is_seen`,
//! `test_first_face_opened_while_another_thread_forks`,
//! `test_a_child_with_its_parents_pid_is_refused`; where `getrandom` is
//! refused, its `refused` case). On a kernel
//! without `MADV_WIPEONFORK` (before Linux 4.14) the check compares pids
//! with `getpid()` as before.
//!
//! A child also inherits the sockets the parent's control planes listen
//! on; it closes its copies at once ([`close_listeners_in_child`]), else
//! the port stays bound after the parent's `close()` for as long as the
//! child lives (a reopen fails with EADDRINUSE, a client hangs in the
//! backlog).

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

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

/// The word the kernel clears in a child (module doc), once mapped; null
/// before, or where `MADV_WIPEONFORK` is refused.
static MARK: AtomicPtr<AtomicU64> = AtomicPtr::new(std::ptr::null_mut());

/// The word (mapping its page on the first call), or `None` where the
/// kernel does not wipe pages on fork. Never blocks: a thread that forks
/// while another maps the page leaves the child to map its own.
pub(crate) fn mark() -> Option<&'static AtomicU64> {
    // ORDERING: Acquire — pairs with the Release of the CAS below: the
    // page is mapped and advised before its address is seen.
    let p = MARK.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: a page mapped below and never unmapped once published.
        return Some(unsafe { &*p });
    }
    let len = 4096;
    // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if page == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: `page` is the mapping just made, `len` long.
    if unsafe { libc::madvise(page, len, libc::MADV_WIPEONFORK) } != 0 {
        // SAFETY: unmapping the unpublished page just made.
        unsafe { libc::munmap(page, len) };
        return None;
    }
    let page = page.cast::<AtomicU64>();
    // ORDERING: Release on success — publishes the advised page; Acquire
    // on failure — the winner's page, as for the load above.
    match MARK.compare_exchange(
        std::ptr::null_mut(),
        page,
        Ordering::Release,
        Ordering::Acquire,
    ) {
        // SAFETY: zero-filled, page-aligned memory that stays mapped.
        Ok(_) => Some(unsafe { &*page }),
        Err(won) => {
            // SAFETY: our page was never published.
            unsafe { libc::munmap(page.cast(), len) };
            // SAFETY: the winner's page, published and never unmapped.
            Some(unsafe { &*won })
        }
    }
}

/// The last token this process (or, in a child, its parent) wrote into
/// the mark. Ordinary memory, so a child inherits it: a child's token is
/// never its parent's, even where `getrandom` fails and the child has the
/// parent's pid, stack address and (a frozen) clock.
static LAST: AtomicU64 = AtomicU64::new(0);

/// A fresh token for this process's mark: non-zero and not the parent's.
/// Random (`getrandom`), else the parent's token, the pid, the clock and
/// an address mixed.
fn fresh_token() -> u64 {
    // ORDERING: Relaxed — written only with the GIL held (faces are opened
    // from Python), read here under it too.
    let last = LAST.load(Ordering::Relaxed);
    let mut t = 0u64;
    // SAFETY: writes at most 8 bytes into `t`.
    let n = unsafe { libc::getrandom(std::ptr::addr_of_mut!(t).cast(), 8, 0) };
    if n != 8 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let here = std::ptr::addr_of!(t) as u64;
        t = last.rotate_left(29)
            ^ (u64::from(std::process::id()) << 32)
            ^ nanos
            ^ here.rotate_left(17);
        t = (t ^ (t >> 31)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    while t == 0 || t == last {
        t = t.wrapping_add(0x9e37_79b9_7f4a_7c15);
    }
    t
}

/// The process a face was opened in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Owner {
    /// For the messages, and the check where there is no mark.
    pid: u32,
    /// The wiped word and the token it held when the face was opened, or
    /// `None`: compare pids with `getpid()`.
    mark: Option<(&'static AtomicU64, u64)>,
}

impl Owner {
    /// The calling process.
    pub(crate) fn here() -> Owner {
        let pid = std::process::id();
        let mark = mark().map(|m| {
            // 0 on a fresh page and in a child until it opens a face: the
            // first face writes a token of its own; the rest read it.
            // ORDERING: AcqRel/Acquire — a face reaches other threads
            // through Python (the GIL), which orders this write before
            // their checks anyway.
            let held = m.load(Ordering::Acquire);
            if held != 0 {
                return (m, held);
            }
            let token = fresh_token();
            match m.compare_exchange(0, token, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    // ORDERING: Relaxed — see `fresh_token`.
                    LAST.store(token, Ordering::Relaxed);
                    (m, token)
                }
                Err(held) => (m, held),
            }
        });
        Owner { pid, mark }
    }

    /// True in a process other than the one that opened it (a child).
    pub(crate) fn forked(self) -> bool {
        match self.mark {
            // ORDERING: Acquire — pairs with the write in `here`.
            Some((m, token)) => m.load(Ordering::Acquire) != token,
            None => std::process::id() != self.pid,
        }
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
