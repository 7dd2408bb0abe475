//! # Mailbox: a reusable cell filled by one thread, read by many, emptied by one
//!
//! The engine's task table is a fixed array of task records allocated at
//! start-up. A record is *filled* by the submitting thread, *read* by the
//! workers running its parts and by callers polling for its result, and
//! *taken* (read exclusively, then emptied for reuse) by the one caller
//! that collects the result. [`Mailbox`] is that cell: one atomic word and
//! the value, no allocation and no lock. The one wait is a taker's, for
//! guards still alive; the engine makes it short: its workers drop their
//! guard before they publish a task as done, so what a collector can find
//! inside is another poller between two loads.
//!
//! ## State word
//!
//! ```text
//! bit 63  FULL     the value is published
//! bit 62  EXCL     one thread has the value exclusively:
//!                  a filler (FULL clear) or a taker (FULL set)
//! 0..61   readers  shared guards alive
//! ```
//!
//! | state | meaning | who moves it |
//! |---|---|---|
//! | `0` | empty | `fill`: CAS `0 → EXCL`, write, store `FULL` (Release) |
//! | `FULL \| n` | published, `n` readers | `read`: CAS `+1` (Acquire); guard drop: `-1` (Release) |
//! | `FULL \| EXCL \| n` | a taker waits for the other `n - 1` readers | `take`: CAS sets `EXCL` from inside a guard, waits for `n == 1` (Acquire), writes, stores `0` (Release) |
//!
//! Every transition is one CAS or one store; a reader never sees a value
//! being written (it needs `FULL` without `EXCL`), and a taker writes only
//! once it is the last reader. The taker holds a guard while it checks the
//! value (the task id) and while it sets `EXCL`, so the value it checked is
//! the value it takes. Loom checks these claims (`tests/loom_cell.rs`).
//!
//! A filler or taker whose closure panics leaves the mailbox empty (the
//! value as the closure left it), never locked for good.

use std::marker::PhantomData;

use crate::sync::{AtomicU64, Ordering};

const FULL: u64 = 1 << 63;
const EXCL: u64 = 1 << 62;
const READERS: u64 = EXCL - 1;

#[cfg(not(daxkv_loom))]
type Inner<T> = std::cell::UnsafeCell<T>;
#[cfg(daxkv_loom)]
type Inner<T> = loom::cell::UnsafeCell<T>;

/// See the module documentation.
pub struct Mailbox<T> {
    state: AtomicU64,
    value: Inner<T>,
}

// SAFETY: the value moves between threads only through the state word's
// Release/Acquire pairs; `T: Send` lets it be filled and taken on different
// threads.
unsafe impl<T: Send> Send for Mailbox<T> {}
// SAFETY: shared access hands out `&T` to several threads at once (needs
// `T: Sync`) and `&mut T` to one thread at a time (needs `T: Send`).
unsafe impl<T: Send + Sync> Sync for Mailbox<T> {}

impl<T> std::fmt::Debug for Mailbox<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // ORDERING: Relaxed — a diagnostic snapshot; nothing is read
        // through it.
        let s = self.state.load(Ordering::Relaxed);
        f.debug_struct("Mailbox")
            .field("full", &(s & FULL != 0))
            .field("exclusive", &(s & EXCL != 0))
            .field("readers", &(s & READERS))
            .finish_non_exhaustive()
    }
}

impl<T> Mailbox<T> {
    /// An empty mailbox holding `value` (kept for reuse: a filler gets it
    /// back as `&mut T` and overwrites what it needs).
    pub fn new(value: T) -> Mailbox<T> {
        Mailbox {
            state: AtomicU64::new(0),
            value: Inner::new(value),
        }
    }

    /// Fill an empty mailbox: `f` gets the value exclusively and the result
    /// is published when it returns. `None` (and `f` not called) when the
    /// mailbox is not empty.
    pub fn fill<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        // ORDERING: Acquire — pairs with the taker's Release store of 0,
        // so its writes (the emptied value) are seen here.
        self.state
            .compare_exchange(0, EXCL, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        // A panic in `f` leaves the mailbox empty, not locked for good.
        let empty_on_unwind = Empty(&self.state);
        let r = self.with_mut(f);
        std::mem::forget(empty_on_unwind);
        // ORDERING: Release — publishes the value to `read`'s Acquire.
        self.state.store(FULL, Ordering::Release);
        Some(r)
    }

    /// Share a published value. `None` when empty, being filled or being
    /// taken.
    pub fn read(&self) -> Option<Ref<'_, T>> {
        // ORDERING: Relaxed — the CAS below is the Acquire.
        let mut s = self.state.load(Ordering::Relaxed);
        loop {
            if s & (FULL | EXCL) != FULL {
                return None;
            }
            debug_assert!(s & READERS < READERS, "reader count overflow");
            // ORDERING: Acquire — pairs with `fill`'s Release store.
            match self
                .state
                .compare_exchange_weak(s, s + 1, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => {
                    return Some(Ref {
                        mb: self,
                        #[cfg(daxkv_loom)]
                        ptr: Some(self.value.get()),
                        _not_send: PhantomData,
                    })
                }
                Err(cur) => s = cur,
            }
        }
    }

    /// Whether the mailbox holds nothing (a racy snapshot, for status).
    pub fn is_empty(&self) -> bool {
        // ORDERING: Relaxed — a racy snapshot for status; the contents are
        // never read on its word.
        self.state.load(Ordering::Relaxed) == 0
    }

    fn with_mut<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        #[cfg(not(daxkv_loom))]
        {
            // SAFETY: callers hold EXCL with no other reader (fill: FULL
            // clear, so `read` refuses; take: waited for the readers to
            // leave, and `read` refuses while EXCL is set).
            f(unsafe { &mut *self.value.get() })
        }
        #[cfg(daxkv_loom)]
        {
            // SAFETY: as above; loom checks the claim.
            self.value.with_mut(|p| f(unsafe { &mut *p }))
        }
    }
}

/// Stores "empty" when dropped (Release: the value as left is seen by the
/// next `fill`).
struct Empty<'a>(&'a AtomicU64);

impl Drop for Empty<'_> {
    fn drop(&mut self) {
        // ORDERING: Release — see the type's doc.
        self.0.store(0, Ordering::Release);
    }
}

/// A shared guard on a published value.
pub struct Ref<'a, T> {
    mb: &'a Mailbox<T>,
    /// Under loom, the tracked shared access, alive as long as the guard.
    #[cfg(daxkv_loom)]
    ptr: Option<loom::cell::ConstPtr<T>>,
    /// A guard stays on the thread that took it (a taker waits for the
    /// other guards; one sent elsewhere and forgotten would stall it).
    _not_send: PhantomData<*const ()>,
}

impl<T> std::fmt::Debug for Ref<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ref").finish_non_exhaustive()
    }
}

impl<T> std::ops::Deref for Ref<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        #[cfg(not(daxkv_loom))]
        {
            // SAFETY: a live guard keeps FULL set and blocks EXCL writers:
            // a taker writes only after every other guard is dropped, and
            // `fill` needs state 0.
            unsafe { &*self.mb.value.get() }
        }
        #[cfg(daxkv_loom)]
        {
            // SAFETY: as above; loom tracks the access while the guard lives.
            unsafe { self.ptr.as_ref().expect("guard in use").deref() }
        }
    }
}

impl<T> Ref<'_, T> {
    /// Become the one taker: refuse new readers, wait for the other guards
    /// to drop, then `f` gets the value exclusively and the mailbox is left
    /// empty. `None` when another taker got there first (this guard is then
    /// released).
    ///
    /// A thread must not hold a second guard on the same mailbox while it
    /// takes (it would wait for itself).
    #[allow(unused_mut)] // mutated under loom only
    pub fn take<R>(mut self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        #[cfg(daxkv_loom)]
        drop(self.ptr.take());
        let mb = self.mb;
        // Our own reader count is handed to the taking protocol below.
        std::mem::forget(self);
        // ORDERING: Relaxed — the CAS below decides.
        let mut s = mb.state.load(Ordering::Relaxed);
        loop {
            if s & EXCL != 0 {
                // Another taker won; it waits for us to leave.
                // ORDERING: Release — as in a guard's drop.
                mb.state.fetch_sub(1, Ordering::Release);
                return None;
            }
            // ORDERING: Relaxed — we hold a reader count, so the value is
            // already visible; the Acquire is the wait below.
            match mb
                .state
                .compare_exchange_weak(s, s | EXCL, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(cur) => s = cur,
            }
        }
        let mut spins = 0u32;
        // ORDERING: Acquire — pairs with each guard's Release decrement, so
        // their reads of the value happen before our writes.
        while mb.state.load(Ordering::Acquire) & READERS != 1 {
            spins = spins.wrapping_add(1);
            if cfg!(daxkv_loom) || spins.is_multiple_of(64) {
                crate::sync::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // Left empty when `f` returns, and also if it panics.
        let _empty = Empty(&mb.state);
        Some(mb.with_mut(f))
    }
}

impl<T> Drop for Ref<'_, T> {
    fn drop(&mut self) {
        // Under loom the tracked access ends before the count drops.
        #[cfg(daxkv_loom)]
        drop(self.ptr.take());
        // ORDERING: Release — our reads happen before a taker's writes.
        self.mb.state.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(all(test, not(daxkv_loom)))]
mod tests {
    use super::*;

    #[test]
    fn fill_read_take_cycle() {
        let m = Mailbox::new(Vec::<u32>::with_capacity(8));
        assert!(m.read().is_none(), "empty mailbox is not readable");
        assert_eq!(m.fill(|v| v.push(1)), Some(()));
        assert!(m.fill(|_| ()).is_none(), "full mailbox refuses a fill");
        let a = m.read().unwrap();
        let b = m.read().unwrap();
        assert_eq!(*a, vec![1]);
        drop(b);
        let got = a.take(std::mem::take).unwrap();
        assert_eq!(got, vec![1]);
        assert!(m.is_empty());
        assert!(m.read().is_none());
        assert_eq!(m.fill(|v| v.len()), Some(0));
    }

    #[test]
    fn second_taker_loses_and_releases_its_guard() {
        let m = Mailbox::new(5u32);
        m.fill(|v| *v = 6).unwrap();
        let a = m.read().unwrap();
        let b = m.read().unwrap();
        std::thread::scope(|s| {
            // The first taker waits for `a` and `b` to go.
            let h = s.spawn(|| m.read().unwrap().take(|v| *v));
            // Once it has set EXCL, new readers are refused.
            while m.read().is_some() {
                std::thread::yield_now();
            }
            assert!(!h.is_finished(), "a taker waits for the other guards");
            assert_eq!(b.take(|v| *v), None, "the second taker loses at once");
            drop(a);
            assert_eq!(h.join().unwrap(), Some(6));
        });
        assert!(m.is_empty());
    }

    #[test]
    fn a_panicking_filler_or_taker_leaves_the_mailbox_usable() {
        let m = Mailbox::new(0u32);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            m.fill(|_| panic!("filler fails"));
        }));
        assert!(r.is_err());
        assert!(m.is_empty(), "a failed fill leaves it empty");
        m.fill(|v| *v = 1).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            m.read().unwrap().take(|_| panic!("taker fails"));
        }));
        assert!(r.is_err());
        assert!(m.is_empty(), "a failed take leaves it empty");
        assert_eq!(m.fill(|v| *v), Some(1));
    }

    #[test]
    fn many_threads_fill_read_take_without_loss() {
        use std::sync::atomic::AtomicUsize;
        let m = Mailbox::new(0u64);
        let taken = AtomicUsize::new(0);
        let filled = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (m, taken, filled) = (&m, &taken, &filled);
                s.spawn(move || {
                    for i in 0..2000u64 {
                        if m.fill(|v| *v = t * 10_000 + i).is_some() {
                            filled.fetch_add(1, Ordering::Relaxed);
                        }
                        if let Some(g) = m.read() {
                            let seen = *g;
                            if let Some(v) = g.take(|v| *v) {
                                assert_eq!(v, seen, "took a value other than the one read");
                                taken.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                });
            }
        });
        if let Some(g) = m.read() {
            g.take(|_| ()).unwrap();
            taken.fetch_add(1, Ordering::Relaxed);
        }
        assert_eq!(
            filled.load(Ordering::Relaxed),
            taken.load(Ordering::Relaxed)
        );
        assert!(m.is_empty());
    }
}
