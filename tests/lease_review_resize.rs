//! A second hostile review (issue 22): a read lease slipping into a
//! resize. Failed on every run before the fix (read leases now back off
//! a `Resizing` device: `Engine::lease_load_into`); passes since.
//!
//! docs/leases.md, "The engine's leases": "grow and shrink with open leases
//! answer 409 `Leased { leases }` before anything moves, forced or not".
//! c677f5b fenced a resize against *store* leases (a Dekker pair with
//! `lease_one`'s state check), but a *read* lease (`lease_load_into`)
//! checks no device state: one taken on a `Resizing` device after the
//! resize's up-front lease check (and after its quiesce) is only seen by
//! the remap at the end, after the shrink has already moved (or, forced,
//! evicted) the keys past the new end. The resize then answers 409 Leased
//! with the device at its old size and its keys gone elsewhere — or gone
//! for good with `--mode evict --force`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use daxkv::engine::{DeviceId, DeviceState, Engine, EngineOptions, HotplugError, ShrinkMode};
use daxkv::plumbing::buf::Buf;
use daxkv::Key;

#[path = "common/leases.rs"]
mod common;
use common::{k, memfd_named, SLOT, T};

const SLOTS: usize = 256;
const NEW_SLOTS: usize = 8;

/// dev0 full of keys 0..SLOTS (slot i holds key i: lowest free slot first),
/// then dev1 added as the migration target.
fn setup() -> (Arc<Engine>, DeviceId, DeviceId) {
    let e = Engine::open(
        vec![memfd_named("memfd", SLOTS)],
        SLOT,
        true,
        EngineOptions::default(),
    )
    .unwrap();
    for i in 0..SLOTS as u64 {
        let id = e
            .submit_store(vec![k(i)], vec![Buf::Vec(vec![i as u8; 1000])])
            .unwrap();
        assert!(e.wait_store(id, T).ready().unwrap().success);
    }
    let d0 = e.find_device_at(0).unwrap();
    let d1 = e.add_device(&memfd_named("memfd:x", 4 * SLOTS)).unwrap();
    (Arc::new(e), d0, d1)
}

fn state(e: &Engine, d: DeviceId) -> DeviceState {
    e.device_index(d).unwrap().1.state
}

/// Runs one shrink of dev0 (256 -> 8 slots) while a reader waits for the
/// device to show `Resizing`, waits `delay`, then read-leases key 0 (slot
/// 0: below the new end, never moved) and holds the lease until the shrink
/// returns. Returns the shrink's answer and the high keys no longer on
/// dev0.
fn round(
    mode: ShrinkMode,
    force: bool,
    delay: Duration,
) -> (Result<(), HotplugError>, usize, usize) {
    let (e, d0, _d1) = setup();
    let go = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (e, go, done) = (Arc::clone(&e), Arc::clone(&go), Arc::clone(&done));
        std::thread::spawn(move || {
            while !go.load(Ordering::SeqCst) {
                std::hint::spin_loop();
            }
            loop {
                if done.load(Ordering::SeqCst) {
                    return false;
                }
                if state(&e, d0) == DeviceState::Resizing {
                    break;
                }
                std::hint::spin_loop();
            }
            let t1 = Instant::now();
            while t1.elapsed() < delay {
                std::hint::spin_loop();
            }
            // Retried while a quiesce or remap holds the device (`Busy`).
            let mut got = e.lease_load(&[k(0)]);
            while !matches!(got.first(), Some(Ok(Some(_)))) && !done.load(Ordering::SeqCst) {
                got = e.lease_load(&[k(0)]);
            }
            let held = matches!(got.first(), Some(Ok(Some(_))));
            while !done.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            drop(got);
            held
        })
    };
    go.store(true, Ordering::SeqCst);
    let r = e
        .resize_device_to(d0, NEW_SLOTS * SLOT, mode, force, |_, _| Ok(()))
        .map(|_| ());
    done.store(true, Ordering::SeqCst);
    let _held = reader.join().unwrap();
    let high: Vec<Key> = (NEW_SLOTS as u64..SLOTS as u64).map(k).collect();
    let moved = high
        .iter()
        .filter(|&&key| {
            let on = e.devices_holding(key);
            !on.is_empty() && !on.contains(&d0)
        })
        .count();
    let gone = high
        .iter()
        .filter(|&&key| e.devices_holding(key).is_empty())
        .count();
    e.close();
    (r, moved, gone)
}

/// A shrink (migrate, not forced) that answers 409 Leased must have moved
/// nothing ("before anything moves"). Seen: Err(Leased) with dozens of
/// keys already moved to the other device, the device still at 64 slots.
#[test]
fn a_shrink_answering_leased_has_moved_nothing() {
    let t0 = Instant::now();
    let mut rounds = 0;
    let mut leased = 0;
    let mut bad = None;
    while t0.elapsed() < Duration::from_secs(4) && bad.is_none() {
        let delay = Duration::from_micros((rounds * 7) % 200);
        rounds += 1;
        let (r, moved, _) = round(ShrinkMode::Migrate, false, delay);
        if let Err(HotplugError::Leased { .. }) = r {
            leased += 1;
            if moved > 0 {
                bad = Some((delay, moved));
            }
        }
    }
    eprintln!("rounds {rounds}, answered Leased {leased}");
    if let Some((delay, moved)) = bad {
        panic!(
            "a shrink answered 409 Leased after moving {moved} of {} keys off the device \
             (read lease taken {delay:?} after the device showed Resizing)",
            SLOTS - NEW_SLOTS
        );
    }
}

/// The forced evicting shrink: a resize that answers 409 Leased (so the
/// device keeps its size) must not have deleted keys for it. Seen: keys
/// evicted (gone from every device) by a shrink that then did not happen.
#[test]
fn a_forced_evicting_shrink_answering_leased_has_deleted_nothing() {
    let t0 = Instant::now();
    let mut rounds = 0;
    let mut leased = 0;
    let mut bad = None;
    while t0.elapsed() < Duration::from_secs(6) && bad.is_none() {
        let delay = Duration::from_micros((rounds * 3) % 60);
        rounds += 1;
        let (r, _, gone) = round(ShrinkMode::Evict, true, delay);
        if let Err(HotplugError::Leased { .. }) = r {
            leased += 1;
            if gone > 0 {
                bad = Some((delay, gone));
            }
        }
    }
    eprintln!("rounds {rounds}, answered Leased {leased}");
    if let Some((delay, gone)) = bad {
        panic!(
            "a forced evicting shrink answered 409 Leased (nothing resized) after deleting \
             {gone} keys (read lease taken {delay:?} after the device showed Resizing)"
        );
    }
}
