//! Mapping observers (`arena::MappingObserver`): a registrant (a CUDA host
//! registration) follows a device mapping's life. Each callback checks,
//! in `/proc/self/maps`, that the range it is told of is mapped at that
//! moment; real memfd mappings, real remaps, real threads.

use std::sync::{Arc, Mutex, Weak};

use daxkv::device::arena::{ArenaSpec, MappingObserver, Region};
use daxkv::device::error::{CoreError, GateError};
use daxkv::{CoreConfig, DaxCore, Key, LeasedStore, PutError};

const SLOT: usize = 4096;

fn core(slots: usize) -> DaxCore {
    DaxCore::open(&CoreConfig::new(
        ArenaSpec::memfd(slots * SLOT).max_size_bytes(8 * slots * SLOT),
        SLOT,
    ))
    .unwrap()
}

/// Whether `[base, base + len)` is covered by this process's mappings now.
fn is_mapped(base: usize, len: usize) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let mut want = base;
    let end = base + len;
    let mut ranges: Vec<(usize, usize)> = maps
        .lines()
        .filter_map(|l| {
            let (a, b) = l.split_whitespace().next()?.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        })
        .collect();
    ranges.sort_unstable();
    for (a, b) in ranges {
        if a <= want && want < b {
            want = b;
        }
        if want >= end {
            return true;
        }
    }
    false
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Mapped(Region),
    Unmapping(Region),
}

/// Records what it is told, checking each range is mapped when told.
#[derive(Default)]
struct Recorder {
    events: Mutex<Vec<Event>>,
}

impl MappingObserver for Recorder {
    fn mapped(&self, r: &Region) {
        assert!(is_mapped(r.base, r.len), "told mapped: {r:?} is not mapped");
        self.events.lock().unwrap().push(Event::Mapped(*r));
    }
    fn unmapping(&self, r: &Region) {
        assert!(
            is_mapped(r.base, r.len),
            "told unmapping: {r:?} is already unmapped"
        );
        self.events.lock().unwrap().push(Event::Unmapping(*r));
    }
}

impl Recorder {
    fn take(&self) -> Vec<Event> {
        std::mem::take(&mut *self.events.lock().unwrap())
    }
}

#[test]
fn an_observer_follows_open_remap_and_close() {
    let c = core(8);
    let rec = Arc::new(Recorder::default());
    let regions = c.regions();
    assert_eq!(regions.len(), 1);
    let first = regions[0];
    assert_eq!((first.len, first.epoch), (8 * SLOT, 1));
    assert!(c.observe(rec.clone()));
    // The replay: the mapping alive now, at once.
    assert_eq!(rec.take(), vec![Event::Mapped(first)]);
    c.put(Key::digest(b"k"), &[7; 100], 0).unwrap();
    c.remap(32 * SLOT).unwrap();
    let second = c.regions()[0];
    assert_eq!((second.len, second.epoch), (32 * SLOT, 2));
    assert_eq!(
        rec.take(),
        vec![Event::Unmapping(first), Event::Mapped(second)],
        "the old mapping let go before the new one is told"
    );
    c.close();
    assert_eq!(rec.take(), vec![Event::Unmapping(second)]);
    assert!(c.regions().is_empty());
    drop(c);
    assert_eq!(rec.take(), vec![], "nothing more at the drop");
}

#[test]
fn a_lease_moves_the_last_word_to_the_drop_on_the_dropping_thread() {
    let c = core(4);
    let rec = Arc::new(Recorder::default());
    assert!(c.observe(rec.clone()));
    let r = c.regions()[0];
    rec.take();
    std::thread::scope(|s| {
        let lease = match c.lease_store(Key::digest(b"k"), 10, 0).unwrap() {
            LeasedStore::Leased(l) => l,
            LeasedStore::AlreadyPresent => unreachable!(),
        };
        c.close();
        assert_eq!(rec.take(), vec![], "close leaves a leased mapping alone");
        assert!(c.regions().len() == 1, "still mapped while the lease lives");
        s.spawn(move || lease.commit().unwrap()).join().unwrap();
    });
    let dropper = std::thread::spawn(move || {
        drop(c);
        std::thread::current().id()
    });
    let _ = dropper.join().unwrap();
    assert_eq!(rec.take(), vec![Event::Unmapping(r)]);
}

/// An observer that calls back into its own device from the callback.
struct Reentrant {
    core: Mutex<Weak<DaxCore>>,
    seen: Mutex<Vec<String>>,
}

impl MappingObserver for Reentrant {
    fn mapped(&self, r: &Region) {
        let Some(c) = self.core.lock().unwrap().upgrade() else {
            return;
        };
        let put = c.put(Key::digest(b"again"), &[1; 8], 0);
        let remap = c.remap(r.len * 2);
        let observe = c.observe(Arc::new(Recorder::default()));
        self.seen
            .lock()
            .unwrap()
            .push(format!("{put:?} {remap:?} {observe}"));
    }
    fn unmapping(&self, _: &Region) {}
}

#[test]
fn calls_back_into_the_device_are_refused_not_deadlocked() {
    let c = Arc::new(core(4));
    let obs = Arc::new(Reentrant {
        core: Mutex::new(Arc::downgrade(&c)),
        seen: Mutex::new(Vec::new()),
    });
    assert!(c.observe(obs.clone()));
    c.remap(8 * SLOT).unwrap();
    let seen = obs.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "the replay and the remap: {seen:?}");
    for line in &seen {
        assert!(
            line.starts_with(&format!("{:?}", Err::<(), _>(PutError::Closed))),
            "{line}"
        );
        assert!(
            line.contains(&format!(
                "{:?}",
                Err::<(), _>(CoreError::Busy(GateError::Busy {
                    guards: 0,
                    waited: std::time::Duration::ZERO
                }))
            )),
            "{line}"
        );
        assert!(line.ends_with("false"), "{line}");
    }
    // The device works on afterwards.
    assert!(c.put(Key::digest(b"after"), &[2; 8], 0).is_ok());
    assert_eq!(c.regions()[0].epoch, 2);
}

struct Panics;

impl MappingObserver for Panics {
    fn mapped(&self, _: &Region) {
        panic!("observer fails");
    }
    fn unmapping(&self, _: &Region) {
        panic!("observer fails");
    }
}

#[test]
fn a_panicking_observer_does_not_stop_the_mapping_or_the_others() {
    let c = core(4);
    let rec = Arc::new(Recorder::default());
    assert!(c.observe(Arc::new(Panics)));
    assert!(c.observe(rec.clone()));
    c.remap(8 * SLOT).unwrap();
    c.close();
    let ev = rec.take();
    assert_eq!(ev.len(), 4, "{ev:?}");
}

/// Observers added while another thread remaps: each sees a well-formed
/// life (mapped, unmapping, mapped, … with rising epochs, never two
/// mapped in a row), whatever the interleaving.
#[test]
fn observers_added_during_remaps_see_each_mapping_once() {
    let c = core(8);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let recs: Vec<Arc<Recorder>> = (0..12).map(|_| Arc::new(Recorder::default())).collect();
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut big = false;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                big = !big;
                c.remap(if big { 16 * SLOT } else { 8 * SLOT }).unwrap();
                // Remaps are operator actions; back to back, this one
                // would hold the admin lock nearly always.
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
        });
        for r in &recs {
            assert!(c.observe(r.clone()));
            std::thread::sleep(std::time::Duration::from_micros(300));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    c.close();
    let mut longest = 0;
    for r in &recs {
        let ev = r.take();
        longest = longest.max(ev.len());
        let mut last_epoch = 0;
        for (i, e) in ev.iter().enumerate() {
            match (i % 2, e) {
                (0, Event::Mapped(reg)) => {
                    assert!(reg.epoch > last_epoch, "{ev:?}");
                    last_epoch = reg.epoch;
                }
                (1, Event::Unmapping(reg)) => assert_eq!(reg.epoch, last_epoch, "{ev:?}"),
                _ => panic!("out of order: {ev:?}"),
            }
        }
        assert!(
            matches!(ev.last(), Some(Event::Unmapping(_))),
            "ends unmapped: {ev:?}"
        );
    }
    assert!(
        longest >= 4,
        "no observer lived through a remap ({longest} events)"
    );
}
