//! # Following every device's mapping: engine observers
//!
//! A registrant of the pool's memory (a CUDA host registration of each
//! device mapping, for GPU-direct copies into leased slots) must follow
//! every mapping's life across hotplug: registered after a device is
//! mapped, unregistered before it is unmapped or remapped.
//! [`Engine::observe`] gives a [`DeviceObserver`] exactly that, for every
//! device now and later, on top of each device's own observer list
//! (`arena::MappingObserver`, docs/leases.md "Following the mapping"):
//!
//! - **Atomic replay.** `observe` holds the pool's admin lock (which every
//!   add, remove, resize and close takes) while it adds the observer to
//!   the engine's list and to each device, and each device's replay runs
//!   under that device's own admin lock: no hotplug step and no remap
//!   falls between the replay and the registration.
//! - **New devices.** An added device is given the engine's observers
//!   (and so its `mapped` replay runs) before it is published to the data
//!   path's list: no lease, store or load can use it before its observers
//!   have returned.
//! - **Removed devices.** The registration stays with the device until it
//!   is dropped (its `unmapping` comes then if a lease kept the mapping
//!   past the remove) or the observer is taken off ([`Engine::unobserve`]
//!   reaches removed devices still alive through weak references).
//! - **No calls back.** Callbacks run under the device's admin lock, and
//!   often under the pool's: an observer must not call into the engine.
//!   The device refuses data-path calls from a callback (`Closed`), and
//!   the engine refuses its control calls: `observe` / `unobserve` answer
//!   `false`, hotplug operations [`HotplugError::Reentrant`](super::HotplugError::Reentrant),
//!   `add_device`, `set_device_state` and `resize_device`
//!   [`EngineError::Reentrant`](super::EngineError::Reentrant), `close`
//!   only refuses new work.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use super::pool::{Device, DeviceId};
use super::Engine;
use crate::device::arena::{in_observer_callback, MappingObserver, Region};

/// Told of every device mapping of an engine: after it is mapped, and
/// before it is unmapped or replaced by a remap (the epoch of the next
/// mapping is one more). Must not call back into the engine (module doc).
pub trait DeviceObserver: Send + Sync {
    /// Device `device`'s mapping `region` is mapped and usable.
    fn mapped(&self, device: DeviceId, region: &Region);
    /// Device `device`'s mapping `region` is about to go (still mapped).
    fn unmapping(&self, device: DeviceId, region: &Region);
}

/// One device's shim for one engine observer: a `MappingObserver` that
/// names the device, and says nothing once its registration is taken off.
struct Shim {
    device: DeviceId,
    observer: Arc<dyn DeviceObserver>,
    live: Arc<Live>,
}

/// Whether a registration is on, and its callbacks in progress: once
/// `unobserve` has turned it off and seen no callback in progress, none
/// runs or starts. A device dropped on another thread (its last lease)
/// tells the observers its arena still lists, which `unobserve` could no
/// longer reach (the review's
/// `an_observer_is_never_told_after_unobserve_returned_true`). Counters,
/// not a lock held across the callback: a callback may run another on the
/// same thread (a Python callback whose garbage collection drops a removed
/// device's last lease), which a lock would deadlock on.
///
/// ```text
/// callback:   active += 1 ; on?  → call ; active -= 1
/// unobserve:  on = false ; wait until active == 0
/// ```
///
/// A Dekker pair (all four `SeqCst`): either the callback sees `on` false
/// and does not call, or `unobserve` sees it active and waits for it.
#[derive(Debug)]
struct Live {
    on: AtomicBool,
    active: AtomicUsize,
}

impl Live {
    fn new() -> Live {
        Live {
            on: AtomicBool::new(true),
            active: AtomicUsize::new(0),
        }
    }

    /// Turn it off and wait for the callbacks in progress (on other
    /// threads: `unobserve` is refused inside a callback).
    fn off(&self) {
        // ORDERING: SeqCst — the Dekker pair with `Shim::tell` (doc above).
        self.on.store(false, Ordering::SeqCst);
        // ORDERING: SeqCst — as above; a zero also orders the callbacks'
        // effects before our return.
        while self.active.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
    }
}

impl Shim {
    fn tell(&self, f: impl FnOnce(&dyn DeviceObserver)) {
        /// Counts the callback out, even if it panics.
        struct Out<'a>(&'a AtomicUsize);
        impl Drop for Out<'_> {
            fn drop(&mut self) {
                // ORDERING: SeqCst — as in `tell`; Release would do for
                // `off`'s wait, SeqCst keeps one order for the pair.
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        // ORDERING: SeqCst — the Dekker pair with `Live::off`.
        self.live.active.fetch_add(1, Ordering::SeqCst);
        let _out = Out(&self.live.active);
        // ORDERING: SeqCst — the Dekker pair with `Live::off`.
        if self.live.on.load(Ordering::SeqCst) {
            f(&*self.observer);
        }
    }
}

impl MappingObserver for Shim {
    fn mapped(&self, region: &Region) {
        self.tell(|o| o.mapped(self.device, region));
    }

    fn unmapping(&self, region: &Region) {
        self.tell(|o| o.unmapping(self.device, region));
    }
}

/// An engine observer and where it is registered.
struct Registered {
    observer: Arc<dyn DeviceObserver>,
    live: Arc<Live>,
    on: Vec<(Weak<Device>, Arc<dyn MappingObserver>)>,
}

/// The engine's observers (changed only under the pool's admin lock).
#[derive(Default)]
pub(super) struct Observers(Mutex<Vec<Registered>>);

impl std::fmt::Debug for Observers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observers").finish_non_exhaustive()
    }
}

impl Observers {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Registered>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Give new device `dev` every observer (called under the pool's
    /// admin lock, before `dev` is published): each is told `mapped` now.
    pub(super) fn attach(&self, dev: &Arc<Device>) {
        let mut regs = self.lock();
        for r in regs.iter_mut() {
            // Devices dropped since: their entries go.
            r.on.retain(|(d, _)| d.strong_count() > 0);
            register(r, dev);
        }
    }
}

/// Register `r`'s observer on `dev` (the device replays its mapping).
fn register(r: &mut Registered, dev: &Arc<Device>) {
    let shim: Arc<dyn MappingObserver> = Arc::new(Shim {
        device: dev.id(),
        observer: Arc::clone(&r.observer),
        live: Arc::clone(&r.live),
    });
    if dev.core().observe(Arc::clone(&shim)) {
        r.on.push((Arc::downgrade(dev), shim));
    }
}

impl Engine {
    /// Every device mapping now: `(device, region)`, in device order.
    pub fn regions(&self) -> Vec<(DeviceId, Region)> {
        self.inner
            .pool
            .list()
            .iter()
            .flat_map(|d| d.core().regions().into_iter().map(|r| (d.id(), r)))
            .collect()
    }

    /// Follow every device mapping of this engine, now and after any
    /// hotplug (module doc): `observer.mapped` runs at once for each
    /// device mapped now, then after every add and remap, and
    /// `unmapping` before every remap, remove and close. False (nothing
    /// registered) from inside an observer callback, once the engine is
    /// closing, or for an observer registered already. Hold the engine
    /// weakly in the observer.
    pub fn observe(&self, observer: Arc<dyn DeviceObserver>) -> bool {
        if in_observer_callback() {
            return false;
        }
        let _admin = self.inner.pool.admin();
        // ORDERING: Acquire — observes `request_close`; `close` takes the
        // admin lock before it closes the devices, so a registration that
        // passed this check is in place before they unmap (and told).
        if self
            .inner
            .closing
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return false;
        }
        // Once: a second registration would be left behind by the one
        // `unobserve` that takes the first off.
        if self
            .inner
            .observers
            .lock()
            .iter()
            .any(|r| std::ptr::addr_eq(Arc::as_ptr(&r.observer), Arc::as_ptr(&observer)))
        {
            return false;
        }
        let mut reg = Registered {
            observer,
            live: Arc::new(Live::new()),
            on: Vec::new(),
        };
        for d in self.inner.pool.list().iter() {
            register(&mut reg, d);
        }
        self.inner.observers.lock().push(reg);
        true
    }

    /// Stop telling `observer` anything, on every device it was given to
    /// (removed ones still alive included): once this returns, no callback
    /// of it runs or starts. False if it was not registered, or from
    /// inside an observer callback.
    pub fn unobserve(&self, observer: &Arc<dyn DeviceObserver>) -> bool {
        if in_observer_callback() {
            return false;
        }
        let _admin = self.inner.pool.admin();
        let reg = {
            let mut regs = self.inner.observers.lock();
            let Some(i) = regs
                .iter()
                .position(|r| std::ptr::addr_eq(Arc::as_ptr(&r.observer), Arc::as_ptr(observer)))
            else {
                return false;
            };
            regs.remove(i)
        };
        // Silenced first (waiting for a callback in progress), then taken
        // off the devices still alive.
        reg.live.off();
        for (d, shim) in reg.on {
            if let Some(d) = d.upgrade() {
                d.core().unobserve(&shim);
            }
        }
        true
    }
}
