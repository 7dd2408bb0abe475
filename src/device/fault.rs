//! # SIGBUS in a copy: the device fails, the process lives on
//!
//! A mapped device can fault under a copy: a file truncated under its
//! mapping (`BUS_ADRERR` past the end of file), or a CXL / DAX memory line
//! that is poisoned (`BUS_MCEERR_AR`, "action required": the copy consumed
//! it). The kernel's answer is SIGBUS, whose default action kills the
//! process, and with it every device's cache. Here the process-wide SIGBUS
//! handler (`install`, chained to the handler it replaces) recovers from
//! exactly one kind of fault and lets every other one crash as it would
//! without it:
//!
//! | the fault | what happens |
//! |---|---|
//! | the faulting thread is inside a daxkv copy of a device mapping (`ArenaGuard` copy methods), and `si_addr` lies in **that** device's registered range, `si_code` `BUS_ADRERR`, `BUS_OBJERR` or `BUS_MCEERR_AR` | the device is marked failed, anonymous zero memory is mapped over its whole range (`MAP_FIXED`), the copy finishes over zeros, and its caller sees the device failed and fails the operation |
//! | `BUS_MCEERR_AO` (poison found, not consumed) in a registered range | the device is marked failed; nothing is remapped (no copy is running into it) |
//! | anything else: outside a copy, outside the copy's device, another `si_code`, a signal sent by `kill` | the previous handler runs (Rust's own, Python's `faulthandler`, …); with none, the default action is restored and the signal raised again: the process dies as it would have without daxkv; with `SIG_IGN`, a signal sent by a process is ignored as before, and a fault dies (the kernel's answer to an ignored fault) |
//!
//! A previous handler that resets SIGBUS to the default action when it is
//! chained to (Rust's own does, for any SIGBUS that is not a stack
//! overflow) is chained as `SIG_DFL` from then on, and ours is installed
//! again: a `kill -BUS` from another process does not disarm the recovery.
//!
//! ## The registry
//!
//! [`SLOTS_MAX`] fixed entries in a static array, claimed with one CAS
//! (`FREE → TAKEN`) by an arena at open (`Registration::new`) and given
//! back when its close unmaps or it drops (`Registration::release`). An entry holds the mapping's range (`base`, `len`) and
//! the device's `failed` flag. The handler allocates nothing and takes no
//! lock: it scans the array with atomic loads, reads one thread-local
//! [`Cell`], calls `mmap`, and stores to atomics.
//!
//! The range of an entry changes only while its arena has no guard
//! (`Arena::exclusive` remap, `Arena::close`), and a copy runs under a
//! guard, so the entry the faulting thread copies from or into is stable
//! for as long as that copy runs; the thread wrote or acquired it before
//! its guard was admitted (the gate's Acquire), so its handler, running
//! on the same thread, reads it exactly. The scan of the *other* entries is
//! only a prefilter (it keeps unrelated faults away from the thread-local,
//! which a dlopen'ed library may allocate lazily); a torn read there can
//! only let a fault through to the exact check, never decide it.
//!
//! ## Why `mmap(MAP_FIXED)` in a signal handler is acceptable
//!
//! POSIX does not list `mmap` as async-signal-safe, but on Linux glibc's
//! `mmap` is the bare system call (no lock, no allocation; it only sets
//! `errno`, which the handler saves and restores), and the kernel makes
//! the replacement atomic under the mm's lock: every other thread sees
//! either the old mapping (and faults the same way, ending up here) or the
//! zero pages. Replacing the device's whole range (rather than one page)
//! keeps to the mapping's own alignment (a device-DAX or hugetlbfs mapping
//! cannot be split at a 4 KiB page) and stops every further fault on the
//! failed device at once. `MAP_NORESERVE` keeps the zero mapping from being
//! charged against the commit limit; if the kernel still refuses (a huge
//! range under strict overcommit) the handler falls back to the faulting
//! page alone (4 KiB, then 2 MiB, then 1 GiB aligned), and if that fails too
//! the fault is not recoverable and takes the default action.
//!
//! The bytes the copy then moves are zeros (a load) or go nowhere (a store):
//! harmless because the caller checks the failed flag after the copy and
//! fails the operation, and the device never serves again.

use std::cell::{Cell, UnsafeCell};
use std::mem::MaybeUninit;
#[cfg(any(test, feature = "failpoints"))]
use std::sync::atomic::AtomicPtr;
use std::sync::atomic::{compiler_fence, AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Once;

/// Devices (arenas) the registry can watch at once. An arena that finds no
/// free entry fails to open (`RegistryFull`).
pub const SLOTS_MAX: usize = 1024;

const FREE: u8 = 0;
const TAKEN: u8 = 1;

// `si_code` values for SIGBUS (asm-generic/siginfo.h; not all in `libc`).
const BUS_ADRERR: i32 = 2;
const BUS_OBJERR: i32 = 3;
/// Hardware memory error consumed by the faulting instruction.
pub const BUS_MCEERR_AR: i32 = 4;
/// Hardware memory error found, not consumed (early kill).
pub const BUS_MCEERR_AO: i32 = 5;

#[derive(Debug)]
struct Entry {
    state: AtomicU8,
    base: AtomicUsize,
    len: AtomicUsize,
    failed: AtomicBool,
}

impl Entry {
    const fn new() -> Entry {
        Entry {
            state: AtomicU8::new(FREE),
            base: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
        }
    }
}

static ENTRIES: [Entry; SLOTS_MAX] = [const { Entry::new() }; SLOTS_MAX];

/// Faults recovered since start (all devices): a statistic for tests and
/// status.
static RECOVERED: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// The registry entry (index + 1) of the device this thread is copying
    /// from or into; 0 outside a copy.
    static IN_COPY: Cell<usize> = const { Cell::new(0) };
}

/// The registry has no free entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{SLOTS_MAX} device mappings are already watched for SIGBUS; close one first")]
pub(crate) struct RegistryFull;

/// An arena's entry in the registry; freed by [`Registration::release`]
/// (the arena's close, once it unmapped) or on drop.
#[derive(Debug)]
pub(crate) struct Registration {
    slot: usize,
    /// `&ENTRIES[slot]`, kept so the per-copy `failed` check is one load
    /// with no index arithmetic or bounds check.
    entry: &'static Entry,
    /// The entry was given back; `failed_at_release` holds its last flag.
    released: AtomicBool,
    failed_at_release: AtomicBool,
}

impl Registration {
    /// Claim a free entry (empty range, not failed) and make sure the
    /// handler is installed.
    pub(crate) fn new() -> Result<Registration, RegistryFull> {
        install();
        for (i, e) in ENTRIES.iter().enumerate() {
            // ORDERING: Relaxed — a cheap pre-check; the CAS decides.
            if e.state.load(Ordering::Relaxed) != FREE {
                continue;
            }
            // ORDERING: Acquire on success — sees the previous owner's
            // cleared range and flag (its Release store of FREE in `drop`);
            // pairs with `Registration::drop`. Interleaving it prevents:
            // two opens CAS the same FREE entry; only one CAS can succeed.
            if e.state
                .compare_exchange(FREE, TAKEN, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return Ok(Registration {
                    slot: i,
                    entry: e,
                    released: AtomicBool::new(false),
                    failed_at_release: AtomicBool::new(false),
                });
            }
        }
        Err(RegistryFull)
    }

    #[inline]
    fn entry(&self) -> &'static Entry {
        self.entry
    }

    /// Watch `base..base + len` (the arena's mapping now). Called before
    /// any guard can use the mapping (at open, and inside the exclusive
    /// section of a remap).
    pub(crate) fn set_range(&self, base: *const u8, len: usize) {
        let e = self.entry();
        // ORDERING: Relaxed — a copying thread acquires these through the
        // arena gate (its guard is admitted after this), and the handler's
        // prefilter tolerates torn reads (module doc).
        e.len.store(0, Ordering::Relaxed);
        // ORDERING: Relaxed — as above.
        e.base.store(base as usize, Ordering::Relaxed);
        // ORDERING: Relaxed — as above.
        e.len.store(len, Ordering::Relaxed);
    }

    /// Stop watching any range (the mapping is about to be unmapped).
    pub(crate) fn clear_range(&self) {
        // ORDERING: Relaxed — as in `set_range`.
        self.entry().len.store(0, Ordering::Relaxed);
    }

    /// Whether a fault in this device's mapping failed it.
    #[inline]
    pub(crate) fn failed(&self) -> bool {
        // ORDERING: Acquire — pairs with the Release swap in `release`, so
        // the copied flag is seen once `released` is.
        if self.released.load(Ordering::Acquire) {
            // ORDERING: Relaxed — ordered by the Acquire load above.
            return self.failed_at_release.load(Ordering::Relaxed);
        }
        // ORDERING: Acquire — pairs with the handler's SeqCst store; the
        // caller also puts a compiler fence between its copy and this load
        // (`in_copy`), so the check cannot move above the copy. (Racing a
        // `release`, this may read the entry's next owner's flag: only the
        // answer for an arena that is closing is affected, never a copy's,
        // since no copy runs once the arena unmapped.)
        self.entry().failed.load(Ordering::Acquire)
    }

    /// Give the entry back now (the arena unmapped; no copy can run on it
    /// again). Idempotent; `failed` keeps its last answer.
    pub(crate) fn release(&self) {
        let e = self.entry();
        // ORDERING: Relaxed — published by the AcqRel swap below.
        let failed = e.failed.load(Ordering::Relaxed);
        // ORDERING: Relaxed — as above.
        self.failed_at_release.store(failed, Ordering::Relaxed);
        // ORDERING: AcqRel — publishes `failed_at_release` to `failed`'s
        // Acquire load; only the first caller frees the entry (a second
        // free could free another arena's claim).
        if self.released.swap(true, Ordering::AcqRel) {
            return;
        }
        // ORDERING: Relaxed — published by the Release store of FREE below.
        e.len.store(0, Ordering::Relaxed);
        // ORDERING: Relaxed — as above.
        e.base.store(0, Ordering::Relaxed);
        // ORDERING: Relaxed — as above.
        e.failed.store(false, Ordering::Relaxed);
        // ORDERING: Release — the next claimer's Acquire CAS sees the entry
        // cleared; pairs with `Registration::new`. Interleaving it
        // prevents: a new arena inheriting this one's failed flag.
        e.state.store(FREE, Ordering::Release);
    }

    /// Mark the device failed (a fault recovered elsewhere; the
    /// `failpoints` feature and tests).
    #[cfg(any(test, feature = "failpoints"))]
    pub(crate) fn mark_failed(&self) {
        // ORDERING: SeqCst — as the handler's store.
        self.entry().failed.store(true, Ordering::SeqCst);
    }

    /// Run `copy` marked as a copy of this device: a SIGBUS in this
    /// device's range while it runs fails the device instead of the
    /// process. Returns whether the device is failed after the copy.
    #[inline]
    pub(crate) fn in_copy(&self, copy: impl FnOnce()) -> bool {
        let prev = IN_COPY.with(|c| c.replace(self.slot + 1));
        // ORDERING: compiler fence — the marker is set before the copy's
        // first access and cleared after its last, as the handler (on
        // this thread) observes them.
        compiler_fence(Ordering::SeqCst);
        maybe_run_test_hook(self);
        copy();
        // ORDERING: compiler fence — as above.
        compiler_fence(Ordering::SeqCst);
        IN_COPY.with(|c| c.set(prev));
        self.failed()
    }

    /// The start of the watched range (tests aim injected faults at it).
    #[cfg(any(test, feature = "failpoints"))]
    pub(crate) fn base(&self) -> *const u8 {
        // ORDERING: Relaxed — read by the owner.
        self.entry().base.load(Ordering::Relaxed) as *const u8
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.release();
    }
}

/// Faults recovered since the process started.
pub fn recovered_faults() -> usize {
    // ORDERING: Relaxed — a statistic.
    RECOVERED.load(Ordering::Relaxed)
}

/// A test hook run inside the copy marker (after it is set, before the
/// kernel copies): tests use it to deliver a synthetic SIGBUS to the
/// copying thread. Compiled only with the `failpoints` feature (and in
/// this crate's unit tests): a build without it has no hook and no load.
#[cfg(any(test, feature = "failpoints"))]
static TEST_HOOK: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

/// Install (or with `None` remove) the copy hook: `hook(base)` runs on the
/// copying thread inside every device copy, with the start of the
/// device's range. For tests only (the `failpoints` feature). Process-wide
/// (a signal handler cannot find an engine): tests that use it run in a
/// child process of their own (`tests/fault.rs`).
#[cfg(feature = "failpoints")]
pub fn set_test_copy_hook(hook: Option<fn(*const u8)>) {
    let p = hook.map_or(std::ptr::null_mut(), |f| f as *mut ());
    // ORDERING: Release — publishes the function pointer; pairs with the
    // Acquire load in `maybe_run_test_hook`.
    TEST_HOOK.store(p, Ordering::Release);
}

#[cfg(any(test, feature = "failpoints"))]
#[inline]
fn maybe_run_test_hook(r: &Registration) {
    // ORDERING: Acquire — pairs with `set_test_copy_hook`.
    let p = TEST_HOOK.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: only `set_test_copy_hook` stores a non-null value, and it
        // stores a `fn(*const u8)` cast to a data pointer (same size on
        // every target Rust supports), so this is that function pointer.
        let f: fn(*const u8) = unsafe { std::mem::transmute::<*mut (), fn(*const u8)>(p) };
        f(r.base());
    }
}

#[cfg(not(any(test, feature = "failpoints")))]
#[inline(always)]
fn maybe_run_test_hook(_: &Registration) {}

/// The handler that was installed before ours (chained for faults we do
/// not own). Written once, before our handler is installed.
struct Prev(UnsafeCell<MaybeUninit<libc::sigaction>>);

// SAFETY: written once inside `INSTALL.call_once`, before `PREV_READY` is
// set with Release; read only after an Acquire load of `PREV_READY`
// returned true; never written again.
unsafe impl Sync for Prev {}

static PREV: Prev = Prev(UnsafeCell::new(MaybeUninit::uninit()));
static PREV_READY: AtomicBool = AtomicBool::new(false);
/// The previous handler reset SIGBUS to the default action when it was
/// chained to (Rust's stack-overflow handler does so for any SIGBUS that
/// is not a stack overflow): from then on it is chained as `SIG_DFL`, and
/// our handler is installed again ([`rearm`]).
static PREV_RESET: AtomicBool = AtomicBool::new(false);
static INSTALL: Once = Once::new();

/// Our `sigaction`: `handler`, SA_SIGINFO, an empty mask.
fn our_action() -> libc::sigaction {
    // SAFETY: an all-zero `sigaction` is a valid value (SIG_DFL, no flags,
    // an empty mask); the fields are set below.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = handler as *const () as usize;
    sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
    // SAFETY: `sa_mask` is a valid, owned sigset_t; `sigemptyset` is
    // async-signal-safe (this also runs inside the handler, `rearm`).
    unsafe { libc::sigemptyset(&raw mut sa.sa_mask) };
    sa
}

/// Install the process-wide SIGBUS handler (once; idempotent). Called by
/// the first [`Registration::new`].
pub(crate) fn install() {
    // Miri cannot run `sigaction`; nothing under Miri faults for real.
    if cfg!(miri) {
        return;
    }
    INSTALL.call_once(|| {
        // SAFETY:
        // 1. `sigaction` with a null new action only reads the current one
        //    into `PREV`, which nothing reads before `PREV_READY`;
        // 2. the new action is fully initialised (`our_action`);
        // 3. `handler` has the SA_SIGINFO signature.
        unsafe {
            let prev = (*PREV.0.get()).as_mut_ptr();
            if libc::sigaction(libc::SIGBUS, std::ptr::null(), prev) != 0 {
                return;
            }
            // ORDERING: Release — publishes `PREV`; pairs with the
            // handler's Acquire load.
            PREV_READY.store(true, Ordering::Release);
            let sa = our_action();
            libc::sigaction(libc::SIGBUS, &raw const sa, std::ptr::null_mut());
        }
    });
}

/// The entry whose range holds `addr`, by an atomic scan (prefilter).
fn any_range_holds(addr: usize) -> bool {
    ENTRIES.iter().any(|e| {
        // ORDERING: Relaxed — a prefilter (module doc); the exact check is
        // on the faulting thread's own entry.
        e.state.load(Ordering::Relaxed) == TAKEN && {
            // ORDERING: Relaxed — as above.
            let base = e.base.load(Ordering::Relaxed);
            // ORDERING: Relaxed — as above.
            let len = e.len.load(Ordering::Relaxed);
            addr >= base && addr - base < len
        }
    })
}

/// Map anonymous zero pages over the device's range (or, failing that,
/// over the faulting page). True when the faulting address is backed now.
///
/// # Safety
/// `base..base + len` is a live mapping owned by the faulting thread's
/// arena, which keeps it until every guard is gone (so the replacement is
/// unmapped by the arena as its own).
unsafe fn map_zeros(base: usize, len: usize, addr: usize) -> bool {
    let try_map = |at: usize, n: usize| {
        // SAFETY: `at..at + n` lies inside the arena's mapping (checked by
        // the caller or below), which MAP_FIXED replaces atomically; no
        // memory of anyone else's is touched.
        let p = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        p as usize == at
    };
    if try_map(base, len) {
        return true;
    }
    for granule in [4usize << 10, 2 << 20, 1 << 30] {
        let at = addr & !(granule - 1);
        if at >= base && at + granule <= base + len && try_map(at, granule) {
            return true;
        }
    }
    false
}

extern "C" fn handler(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid `siginfo_t` to an SA_SIGINFO
    // handler; `si_addr` is valid to read for SIGBUS.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // SAFETY: `__errno_location` returns this thread's errno slot.
    let errno = unsafe { *libc::__errno_location() };
    let owned = recover(code, addr);
    // SAFETY: as above; `mmap` may have changed errno.
    unsafe { *libc::__errno_location() = errno };
    if !owned {
        // SAFETY: `chain`'s contract: this is the SIGBUS handler, and
        // `info` and `ctx` are the kernel's, passed on unchanged.
        unsafe { chain(sig, info, ctx) };
    }
}

/// The decision of the module doc's table; true when the fault is ours
/// and handled.
fn recover(code: i32, addr: usize) -> bool {
    let recoverable = matches!(code, BUS_ADRERR | BUS_OBJERR | BUS_MCEERR_AR);
    if !(recoverable || code == BUS_MCEERR_AO) || !any_range_holds(addr) {
        return false;
    }
    if code == BUS_MCEERR_AO {
        // Found, not consumed: fail the device that holds it.
        let Some(e) = ENTRIES.iter().find(|e| {
            // ORDERING: Relaxed — prefilter reads, as in `any_range_holds`.
            let (base, len) = (
                e.base.load(Ordering::Relaxed),
                e.len.load(Ordering::Relaxed),
            );
            addr >= base && addr - base < len
        }) else {
            return false;
        };
        // ORDERING: SeqCst — published to every later `failed` load.
        e.failed.store(true, Ordering::SeqCst);
        return true;
    }
    // The thread-local is touched only for an address in a device (module
    // doc): this thread set it before its copy, so it is allocated.
    let slot = IN_COPY.with(Cell::get);
    if slot == 0 {
        return false;
    }
    let e = &ENTRIES[slot - 1];
    // ORDERING: Relaxed — stable while this thread's guard lives, and this
    // thread acquired it before entering (module doc).
    let base = e.base.load(Ordering::Relaxed);
    // ORDERING: Relaxed — as above.
    let len = e.len.load(Ordering::Relaxed);
    if !(addr >= base && addr - base < len) {
        return false;
    }
    // ORDERING: SeqCst — stored before the mapping changes: another thread
    // whose copy reads the zero pages did so after the kernel changed the
    // page tables, which it did after this store left the store buffer
    // (system call entry serialises), so that thread's Acquire load of the
    // flag after its copy sees true. Interleaving it prevents: a reader
    // copies zeros, loads the flag before it is set, and reports a hit.
    e.failed.store(true, Ordering::SeqCst);
    // SAFETY: `map_zeros`'s contract: the range is this thread's guarded
    // arena's mapping (checked above against its own entry), live while
    // the guard is.
    if !unsafe { map_zeros(base, len, addr) } {
        return false;
    }
    // ORDERING: Relaxed — a statistic.
    RECOVERED.fetch_add(1, Ordering::Relaxed);
    true
}

/// Pass a fault we do not own on: to the previous handler, or (none) to
/// the default action, raised again so the process dies of SIGBUS.
///
/// # Safety
/// Called from the SIGBUS handler (`handler`, so SIGBUS is blocked while
/// it runs), with `sig`, `info` and `ctx` the kernel's arguments to it.
unsafe fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // ORDERING: Acquire — pairs with the Release store in `install`.
    let prev = if PREV_READY.load(Ordering::Acquire) {
        // SAFETY: `PREV` was initialised before `PREV_READY` was set and is
        // never written again (`Prev`'s Sync note).
        Some(unsafe { (*PREV.0.get()).assume_init_ref() })
    } else {
        None
    };
    // ORDERING: Acquire — pairs with the Release store in `rearm`.
    let action = if PREV_RESET.load(Ordering::Acquire) {
        libc::SIG_DFL
    } else {
        prev.map_or(libc::SIG_DFL, |p| p.sa_sigaction)
    };
    // SAFETY: the kernel's `siginfo_t` for this signal (this function's
    // contract).
    let sent = unsafe { (*info).si_code } <= 0;
    if action == libc::SIG_IGN && sent {
        // Sent by a process (`kill`, `sigqueue`, `tgkill`: `si_code` <= 0)
        // to one that ignored SIGBUS: ignored, as it was before daxkv
        // (`tests/fault.rs::a_sigbus_sent_by_kill_to_a_process_that_
        // ignores_it_is_still_ignored`). An ignored *fault* (`si_code` >
        // 0) takes the default action below, as the kernel gives it.
        return;
    }
    if action == libc::SIG_DFL || action == libc::SIG_IGN {
        // SAFETY: `sigaction` and `raise` are async-signal-safe; the zeroed
        // action is SIG_DFL with an empty mask. SIGBUS is blocked while this
        // handler runs (this function's contract), so the raised signal is
        // delivered as the handler returns, with the default action: the process dies of SIGBUS (a
        // real fault would also fault again on the same instruction).
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &raw const dfl, std::ptr::null_mut());
            libc::raise(sig);
        }
        return;
    }
    let flags = prev.map_or(0, |p| p.sa_flags);
    if flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous handler was installed with SA_SIGINFO, so it
        // has this signature; it gets the kernel's own arguments.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(action) };
        f(sig, info, ctx);
    } else {
        // SAFETY: installed without SA_SIGINFO: the one-argument form.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(action) };
        f(sig);
    }
    // SAFETY: `rearm`'s contract: we run in the SIGBUS handler (this
    // function's contract), after the previous handler returned.
    unsafe { rearm(sig) };
}

/// After the previous handler returned: if it reset SIGBUS to the default
/// action (Rust's stack-overflow handler does, for a SIGBUS that is not a
/// stack overflow, so that a real fault kills when it re-executes),
/// remember that it is `SIG_DFL` from now on and install our handler
/// again. Left reset, a single `kill -BUS` from another process (which
/// the process survives, as without daxkv) disarmed the recovery: the
/// next device fault killed the process
/// (`tests/fault.rs::a_sigbus_sent_by_kill_does_not_disarm_the_recovery`).
/// A real fault still dies: it re-executes, comes back here, and is
/// chained to `SIG_DFL` (restored and raised). Any other disposition the
/// previous handler set is left as it is.
///
/// # Safety
/// Called from the SIGBUS handler (or with SIGBUS blocked).
unsafe fn rearm(sig: libc::c_int) {
    // SAFETY: an all-zero `sigaction` is a valid out-parameter.
    let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: `sigaction` is async-signal-safe; a null new action only
    // reads the current one into `cur`.
    if unsafe { libc::sigaction(sig, std::ptr::null(), &raw mut cur) } != 0
        || cur.sa_sigaction != libc::SIG_DFL
    {
        return;
    }
    // ORDERING: Release — seen by the next `chain` (Acquire) before it
    // reads the previous action; pairs with `chain`.
    PREV_RESET.store(true, Ordering::Release);
    let sa = our_action();
    // SAFETY: `sa` is fully initialised (`our_action`); `handler` has the
    // SA_SIGINFO signature; `sigaction` is async-signal-safe.
    unsafe { libc::sigaction(sig, &raw const sa, std::ptr::null_mut()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hunts the registry's claim / release protocol: 4 threads claim and
    /// release entries 20 000 times each (a third of them marked failed
    /// before release), recording each claimed entry's owner in a side
    /// table: no entry is ever held by two registrations at once, and a
    /// fresh claim never starts failed or with a range. With the claim's
    /// CAS replaced by a load-then-store, a fresh claim finds another
    /// holder's range in its entry (two holders) at once; with `drop` not
    /// clearing `failed`, a fresh claim starts failed at once.
    #[test]
    fn registry_claims_are_exclusive_and_come_back_clean() {
        const THREADS: usize = 4;
        const ROUNDS: usize = 20_000;
        let owner: Vec<AtomicUsize> = (0..SLOTS_MAX).map(|_| AtomicUsize::new(0)).collect();
        std::thread::scope(|s| {
            for t in 1..=THREADS {
                let owner = &owner;
                s.spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..ROUNDS {
                        let r = Registration::new().expect("the registry has room");
                        assert!(!r.failed(), "a fresh claim of entry {} is failed", r.slot);
                        // ORDERING: Relaxed — a test-only side table.
                        assert_eq!(r.entry().len.load(Ordering::Relaxed), 0);
                        // ORDERING: SeqCst — test bookkeeping.
                        let prev = owner[r.slot].swap(t, Ordering::SeqCst);
                        assert_eq!(prev, 0, "entry {} held by {prev} and {t}", r.slot);
                        r.set_range(std::ptr::null::<u8>().wrapping_add(4096 * t), 4096);
                        if i % 3 == 0 {
                            r.mark_failed();
                        }
                        held.push(r);
                        if held.len() > 2 || i % 2 == 0 {
                            let r = held.remove(0);
                            // ORDERING: SeqCst — test bookkeeping.
                            owner[r.slot].store(0, Ordering::SeqCst);
                            drop(r);
                        }
                    }
                    for r in held {
                        // ORDERING: SeqCst — test bookkeeping.
                        owner[r.slot].store(0, Ordering::SeqCst);
                    }
                });
            }
        });
    }

    /// The handler's decision without a signal: a fault outside a copy,
    /// outside the copy's own device, or with another `si_code` is not
    /// ours; only `BUS_MCEERR_AO` fails a device outside a copy.
    #[test]
    fn only_faults_in_the_copys_own_device_are_recovered() {
        let a = Registration::new().unwrap();
        let b = Registration::new().unwrap();
        let mem = vec![0u8; 3 * 4096];
        let base = mem.as_ptr() as usize;
        a.set_range(base as *const u8, 4096);
        b.set_range((base + 8192) as *const u8, 4096);
        // Outside any copy.
        assert!(!recover(BUS_ADRERR, base + 10));
        // In a copy of `a`, but the address is in `b` or in neither.
        let mut inside = (false, false, false);
        let _ = a.in_copy(|| {
            inside = (
                recover(BUS_ADRERR, base + 8192 + 10),
                recover(BUS_ADRERR, base + 4096 + 10),
                recover(1, base + 10), // BUS_ADRALN
            );
        });
        assert_eq!(inside, (false, false, false));
        assert!(!a.failed() && !b.failed());
        assert!(recover(BUS_MCEERR_AO, base + 8192));
        assert!(b.failed() && !a.failed());
    }

    #[test]
    fn entries_are_claimed_once_and_come_back_clean() {
        let a = Registration::new().unwrap();
        let b = Registration::new().unwrap();
        assert_ne!(a.slot, b.slot);
        a.mark_failed();
        assert!(a.failed() && !b.failed());
        let slot = a.slot;
        drop(a);
        // Whoever gets the entry next does not inherit the flag.
        let regs: Vec<_> = (0..4).map(|_| Registration::new().unwrap()).collect();
        assert!(regs.iter().all(|r| !r.failed()), "slot {slot} reused dirty");
    }
}
