//! Engine mapping observers (`engine/observe.rs`, docs/leases.md
//! "Following the mapping"): every device's mapping followed across add,
//! resize, remove and close, each callback checked against
//! `/proc/self/maps`; a new device reached by no lease before its
//! observers returned; calls back into the engine refused. Real memfd
//! mappings, real threads.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use daxkv::device::arena::Region;
use daxkv::engine::{
    DeviceId, DeviceObserver, Engine, EngineLeased, HotplugError, RemoveMode, ShrinkMode,
};
use daxkv::plumbing::buf::Buf;
use daxkv::Key;

#[path = "common/leases.rs"]
mod common;
use common::{k, SLOT, T};

fn engine(devs: &[usize]) -> Arc<Engine> {
    Arc::new(common::engine(devs))
}

/// Whether `[base, base + len)` lies inside this process's mappings.
fn mapped(base: usize, len: usize) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let ranges: Vec<(usize, usize)> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.split_once('-'))
        .map(|(a, b)| {
            (
                usize::from_str_radix(a, 16).unwrap(),
                usize::from_str_radix(b, 16).unwrap(),
            )
        })
        .collect();
    // Adjacent mappings may split one region: walk it.
    let mut at = base;
    while at < base + len {
        let Some(&(_, b)) = ranges.iter().find(|(a, b)| (*a..*b).contains(&at)) else {
            return false;
        };
        at = b;
    }
    true
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Ev {
    Mapped(DeviceId, u64),
    Unmapping(DeviceId, u64),
}

/// Records every callback, checking at each that its range is mapped.
#[derive(Default)]
struct Log {
    events: Mutex<Vec<Ev>>,
    /// The engine, to call back into (the reentry test).
    engine: Mutex<Option<Weak<Engine>>>,
    reentry: Mutex<Vec<String>>,
}

impl Log {
    fn take(&self) -> Vec<Ev> {
        std::mem::take(&mut *self.events.lock().unwrap())
    }
}

impl DeviceObserver for Log {
    fn mapped(&self, device: DeviceId, r: &Region) {
        assert!(mapped(r.base, r.len), "told mapped of an unmapped range");
        self.events
            .lock()
            .unwrap()
            .push(Ev::Mapped(device, r.epoch));
        self.call_back();
    }
    fn unmapping(&self, device: DeviceId, r: &Region) {
        assert!(mapped(r.base, r.len), "told unmapping of an unmapped range");
        self.events
            .lock()
            .unwrap()
            .push(Ev::Unmapping(device, r.epoch));
    }
}

impl Log {
    /// From inside a callback: every control call is refused at once.
    fn call_back(&self) {
        let Some(e) = self.engine.lock().unwrap().as_ref().and_then(Weak::upgrade) else {
            return;
        };
        let mut out = self.reentry.lock().unwrap();
        let other: Arc<dyn DeviceObserver> = Arc::new(Log::default());
        out.push(format!("observe={}", e.observe(other.clone())));
        out.push(format!("unobserve={}", e.unobserve(&other)));
        out.push(format!(
            "add={}",
            matches!(
                e.hotplug_add("memfd:again", 4 * SLOT, |_, _| Ok(())),
                Err(HotplugError::Reentrant)
            )
        ));
        out.push(format!(
            "remove={}",
            matches!(
                e.remove_device(DeviceId(0), RemoveMode::Evict, true),
                Err(HotplugError::Reentrant)
            )
        ));
    }
}

fn observe(e: &Engine) -> Arc<Log> {
    let log = Arc::new(Log::default());
    assert!(e.observe(log.clone()));
    log
}

#[test]
fn every_mapping_is_followed_across_hotplug_and_close() {
    let e = engine(&[8, 8]);
    let log = observe(&e);
    // The replay: each device mapped now, once.
    assert_eq!(
        log.take(),
        vec![Ev::Mapped(DeviceId(0), 1), Ev::Mapped(DeviceId(1), 1)]
    );
    let regions = e.regions();
    assert_eq!(regions.len(), 2);
    assert!(regions
        .iter()
        .all(|(_, r)| r.epoch == 1 && r.len == 8 * SLOT && mapped(r.base, r.len)));
    // Add, grow, remove.
    let (_, info) = e
        .hotplug_add("memfd:third", 8 * SLOT, |_, _| Ok(()))
        .unwrap();
    assert_eq!(log.take(), vec![Ev::Mapped(info.id, 1)]);
    e.resize_device_to(
        DeviceId(0),
        16 * SLOT,
        ShrinkMode::Migrate,
        false,
        |_, _| Ok(()),
    )
    .unwrap();
    assert_eq!(
        log.take(),
        vec![Ev::Unmapping(DeviceId(0), 1), Ev::Mapped(DeviceId(0), 2)]
    );
    assert_eq!(e.regions()[0].1.epoch, 2);
    e.remove_device(DeviceId(1), RemoveMode::Evict, true)
        .unwrap();
    assert_eq!(log.take(), vec![Ev::Unmapping(DeviceId(1), 1)]);
    // Unobserve stops it; a second observer still hears the close.
    let second = observe(&e);
    let first: Arc<dyn DeviceObserver> = log.clone();
    assert!(e.unobserve(&first));
    assert!(!e.unobserve(&first), "already gone");
    e.close();
    assert_eq!(log.take(), vec![]);
    let mut closed = second.take();
    closed.retain(|ev| matches!(ev, Ev::Unmapping(..)));
    assert_eq!(
        closed,
        vec![Ev::Unmapping(DeviceId(0), 2), Ev::Unmapping(info.id, 1)]
    );
    assert!(!e.observe(Arc::new(Log::default())), "closing");
}

#[test]
fn a_read_lease_moves_the_last_word_to_its_drop() {
    let e = engine(&[8, 8]);
    let id = e
        .submit_store(
            vec![k(1), k(2)],
            vec![Buf::Vec(vec![1; 100]), Buf::Vec(vec![2; 100])],
        )
        .unwrap();
    assert!(e.wait_store(id, T).ready().unwrap().success);
    let log = observe(&e);
    log.take();
    let key = [k(1), k(2)]
        .into_iter()
        .find(|&k| e.devices_holding(k) == vec![DeviceId(1)])
        .unwrap();
    let r = e.lease_load(&[key]).pop().unwrap().unwrap().unwrap();
    e.remove_device(DeviceId(1), RemoveMode::Migrate, true)
        .unwrap();
    assert_eq!(log.take(), vec![], "unmapped under a live lease");
    // The lease ends on another thread: the unmap (and its word) there.
    std::thread::spawn(move || drop(r)).join().unwrap();
    assert_eq!(log.take(), vec![Ev::Unmapping(DeviceId(1), 1)]);
}

/// A new device takes no lease before its observers returned: the
/// observer's `mapped` for it holds a while, as a CUDA registration of a
/// large mapping does, while another thread leases keys as fast as it
/// can; no lease may land on the new device until `mapped` returned.
#[test]
fn a_new_device_takes_leases_only_after_its_observers_returned() {
    struct Slow {
        returned: AtomicBool,
    }
    impl DeviceObserver for Slow {
        fn mapped(&self, device: DeviceId, _: &Region) {
            if device == DeviceId(1) {
                std::thread::sleep(Duration::from_millis(100));
                self.returned.store(true, Ordering::SeqCst);
            }
        }
        fn unmapping(&self, _: DeviceId, _: &Region) {}
    }
    // Device 0 nearly full, so the new empty device is the least used.
    let e = engine(&[64]);
    let keys: Vec<Key> = (1_000..1_032).map(k).collect();
    let id = e
        .submit_store(
            keys.clone(),
            keys.iter().map(|_| Buf::Vec(vec![0; 8])).collect(),
        )
        .unwrap();
    assert!(e.wait_store(id, T).ready().unwrap().success);
    let slow = Arc::new(Slow {
        returned: AtomicBool::new(false),
    });
    assert!(e.observe(slow.clone()));
    let stop = Arc::new(AtomicBool::new(false));
    let (e2, stop2, slow2) = (e.clone(), stop.clone(), slow.clone());
    let leaser = std::thread::spawn(move || {
        let mut i = 0;
        let mut early = 0;
        let mut on_new = 0;
        while !stop2.load(Ordering::SeqCst) {
            i += 1;
            let before = slow2.returned.load(Ordering::SeqCst);
            if let Ok(EngineLeased::Leased(l)) =
                e2.lease_store(&[k(i)], &[8]).unwrap().pop().unwrap()
            {
                if l.device() == DeviceId(1) {
                    on_new += 1;
                    early += usize::from(!before && !slow2.returned.load(Ordering::SeqCst));
                }
                l.abort();
            }
        }
        (early, on_new)
    });
    std::thread::sleep(Duration::from_millis(20));
    e.hotplug_add("memfd:new", 64 * SLOT, |_, _| Ok(()))
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    stop.store(true, Ordering::SeqCst);
    let (early, on_new) = leaser.join().unwrap();
    assert_eq!(
        early, 0,
        "a lease reached the new device before its observer returned"
    );
    assert!(on_new > 0, "the new device took leases after");
}

#[test]
fn observers_calling_back_into_the_engine_are_refused_at_once() {
    let e = engine(&[8]);
    let log = Arc::new(Log::default());
    *log.engine.lock().unwrap() = Some(Arc::downgrade(&e));
    assert!(e.observe(log.clone()));
    // The replay's callback tried every control call: each refused.
    let want = [
        "observe=false",
        "unobserve=false",
        "add=true",
        "remove=true",
    ];
    assert_eq!(*log.reentry.lock().unwrap(), want);
    log.reentry.lock().unwrap().clear();
    // And during an add (the pool's admin lock held around the callback).
    e.hotplug_add("memfd:b", 4 * SLOT, |_, _| Ok(())).unwrap();
    assert_eq!(*log.reentry.lock().unwrap(), want);
    // The engine still works.
    assert_eq!(e.devices().len(), 2);
    let l = e.lease_store(&[k(1)], &[1]).unwrap().pop().unwrap();
    assert!(matches!(l, Ok(EngineLeased::Leased(_))));
}

#[test]
fn an_observer_is_registered_once() {
    let e = engine(&[8]);
    let log = observe(&e);
    let again: Arc<dyn DeviceObserver> = log.clone();
    assert!(
        !e.observe(again.clone()),
        "a second registration of one observer"
    );
    assert_eq!(
        log.take(),
        vec![Ev::Mapped(DeviceId(0), 1)],
        "replayed once"
    );
    assert!(e.unobserve(&again));
    e.close();
    assert_eq!(log.take(), vec![], "not told after its one unobserve");
}
