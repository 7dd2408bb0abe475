//! Mapping observers called back into, nested and held in odd ways (from
//! a hostile review, which found each of the first four failing): each
//! test runs the suspect call on a helper thread and fails (instead of
//! hanging) if it does not finish.

use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use daxkv::device::arena::{Arena, ArenaSpec, MappingObserver, Region};
use daxkv::{CoreConfig, DaxCore, Key};

const SLOT: usize = 4096;

fn core(slots: usize) -> DaxCore {
    DaxCore::open(&CoreConfig::new(
        ArenaSpec::memfd(slots * SLOT).max_size_bytes(8 * slots * SLOT),
        SLOT,
    ))
    .unwrap()
}

fn finishes_within<T: Send + 'static>(
    d: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(d).ok()
}

struct Noop;
impl MappingObserver for Noop {
    fn mapped(&self, _: &Region) {}
    fn unmapping(&self, _: &Region) {}
}

// ---------------------------------------------------------------------
// 1. regions() from a callback: not refused, locks `admin` again.
struct CallsRegions {
    core: Mutex<Weak<DaxCore>>,
}
impl MappingObserver for CallsRegions {
    fn mapped(&self, _: &Region) {
        if let Some(c) = self.core.lock().unwrap().upgrade() {
            let _ = c.regions();
        }
    }
    fn unmapping(&self, _: &Region) {}
}

#[test]
fn regions_from_an_observer_callback_is_refused_not_deadlocked() {
    let c = Arc::new(core(4));
    let obs = Arc::new(CallsRegions {
        core: Mutex::new(Arc::downgrade(&c)),
    });
    let c2 = c.clone();
    let done = finishes_within(Duration::from_secs(5), move || c2.observe(obs));
    assert!(
        done.is_some(),
        "DaxCore::regions() called from a MappingObserver callback (the replay in observe) never returned: self-deadlock on the arena's admin lock"
    );
}

// ---------------------------------------------------------------------
// 2. A nested tell (another arena dropped inside a callback) clears
//    IN_OBSERVER for the rest of the outer callback.
struct DropsOtherThenPuts {
    me: Mutex<Weak<DaxCore>>,
    other: Mutex<Option<DaxCore>>,
    result: Mutex<Option<String>>,
}
impl MappingObserver for DropsOtherThenPuts {
    fn mapped(&self, _: &Region) {}
    fn unmapping(&self, _: &Region) {
        // Let go of another device (it has an observer of its own).
        drop(self.other.lock().unwrap().take());
        let Some(c) = self.me.lock().unwrap().upgrade() else {
            return;
        };
        // The contract: a data-path call from a callback answers Closed.
        let put = c.put(Key::digest(b"inside"), &[1; 8], 0);
        *self.result.lock().unwrap() = Some(format!("{put:?}"));
    }
}

#[test]
fn dropping_another_device_inside_a_callback_keeps_calls_back_refused() {
    let a = Arc::new(core(4));
    let b = core(4);
    assert!(b.observe(Arc::new(Noop)));
    let obs = Arc::new(DropsOtherThenPuts {
        me: Mutex::new(Arc::downgrade(&a)),
        other: Mutex::new(Some(b)),
        result: Mutex::new(None),
    });
    assert!(a.observe(obs.clone()));
    let a2 = a.clone();
    let done = finishes_within(Duration::from_secs(5), move || {
        a2.remap(8 * SLOT).map_err(|e| e.to_string())
    });
    let res = obs.result.lock().unwrap().clone();
    assert!(
        done.is_some(),
        "remap never returned: after the nested Arena::drop's tell reset IN_OBSERVER to false, the put inside the outer unmapping callback was not refused and waits forever for the remap it runs inside (result so far: {res:?})"
    );
}

// Same thing, no deadlock needed: observe() on a third device from the
// callback should answer false, and answers true after the nested drop.
struct DropsOtherThenObserves {
    other: Mutex<Option<DaxCore>>,
    third: DaxCore,
    before: Mutex<Option<bool>>,
    after: Mutex<Option<bool>>,
}
impl MappingObserver for DropsOtherThenObserves {
    fn mapped(&self, _: &Region) {
        *self.before.lock().unwrap() = Some(self.third.observe(Arc::new(Noop)));
        drop(self.other.lock().unwrap().take());
        *self.after.lock().unwrap() = Some(self.third.observe(Arc::new(Noop)));
    }
    fn unmapping(&self, _: &Region) {}
}

#[test]
fn in_observer_is_restored_not_cleared_by_a_nested_tell() {
    let a = core(4);
    let b = core(4);
    assert!(b.observe(Arc::new(Noop)));
    let obs = Arc::new(DropsOtherThenObserves {
        other: Mutex::new(Some(b)),
        third: core(4),
        before: Mutex::new(None),
        after: Mutex::new(None),
    });
    assert!(a.observe(obs.clone()));
    let before = *obs.before.lock().unwrap();
    let after = *obs.after.lock().unwrap();
    assert_eq!(
        (before, after),
        (Some(false), Some(false)),
        "observe() from inside a callback: refused before a nested drop, accepted after it (IN_OBSERVER cleared)"
    );
}

// ---------------------------------------------------------------------
// 3. An observer that holds an Arc to its core makes a cycle through the
//    device's observer list (documented: hold it weakly); `unobserve`
//    breaks it, and the core's drop then unmaps and tells the others.
struct Holds {
    core: Mutex<Option<Arc<DaxCore>>>,
}
impl MappingObserver for Holds {
    fn mapped(&self, _: &Region) {}
    fn unmapping(&self, _: &Region) {}
}

#[derive(Default)]
struct Counts(Mutex<usize>);
impl MappingObserver for Counts {
    fn mapped(&self, _: &Region) {}
    fn unmapping(&self, _: &Region) {
        *self.0.lock().unwrap() += 1;
    }
}

#[test]
fn unobserve_breaks_an_observers_cycle_through_its_core() {
    let c = Arc::new(core(4));
    let holds = Arc::new(Holds {
        core: Mutex::new(None),
    });
    let as_observer: Arc<dyn MappingObserver> = holds.clone();
    assert!(c.observe(as_observer.clone()));
    *holds.core.lock().unwrap() = Some(c.clone());
    let counts = Arc::new(Counts::default());
    assert!(c.observe(counts.clone()));
    let weak = Arc::downgrade(&c);
    {
        let lease = match c.lease_store(Key::digest(b"k"), 10, 0).unwrap() {
            daxkv::LeasedStore::Leased(l) => l,
            daxkv::LeasedStore::AlreadyPresent => unreachable!(),
        };
        c.close(); // a lease: the unmap (and the observers' last word) go to the drop
        lease.commit().unwrap_or_default();
    }
    assert!(c.unobserve(&as_observer));
    assert!(!c.unobserve(&as_observer), "once");
    drop(c);
    assert!(weak.upgrade().is_some(), "the observer still holds it");
    holds.core.lock().unwrap().take();
    assert!(weak.upgrade().is_none(), "the cycle is gone");
    assert_eq!(*counts.0.lock().unwrap(), 1, "the drop told the others");
}

// ---------------------------------------------------------------------
// 4. observe() / regions() from a thread holding a guard while a remap is
//    draining: refused at once (the remap holds the admin lock and waits
//    for that guard), not after the whole drain timeout with the remap
//    failed.
#[test]
fn observe_from_a_guard_holder_during_a_pending_remap_is_refused_at_once() {
    let a = Arc::new(Arena::open(&ArenaSpec::memfd(1 << 16).max_size_bytes(1 << 20)).unwrap());
    a.set_drain_timeout(Duration::from_secs(2));
    let g = a.enter().unwrap();
    let a2 = a.clone();
    let remapper = std::thread::spawn(move || a2.exclusive(|ex| ex.remap(1 << 17)));
    while !a.is_exclusive_pending() {
        std::thread::yield_now();
    }
    let t = Instant::now();
    let ok = a.observe(Arc::new(Noop));
    let regions = a.regions();
    let took = t.elapsed();
    drop(g);
    let remap = remapper.join().unwrap();
    assert!(!ok && regions.is_empty(), "refused: {ok} {regions:?}");
    assert!(took < Duration::from_millis(500), "at once: {took:?}");
    assert!(matches!(remap, Ok(Ok(()))), "the remap went on: {remap:?}");
    // Without the guard, both work.
    assert!(a.observe(Arc::new(Noop)));
    assert_eq!(a.regions().len(), 1);
}

struct PanicsInUnmapping;
impl MappingObserver for PanicsInUnmapping {
    fn mapped(&self, _: &Region) {}
    fn unmapping(&self, _: &Region) {
        panic!("observer fails in unmapping");
    }
}

#[test]
fn a_panicking_observer_in_a_drop_during_unwinding() {
    let c = DaxCore::open(&CoreConfig::new(ArenaSpec::memfd(4 * 4096), 4096)).unwrap();
    assert!(c.observe(Arc::new(PanicsInUnmapping)));
    let r = std::thread::spawn(move || {
        let _owned = c;
        panic!("the worker owning the device fails");
    })
    .join();
    assert!(r.is_err());
}
