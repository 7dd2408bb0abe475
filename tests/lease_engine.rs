//! The engine's slot leases (docs/leases.md, "The engine's leases"):
//! placement across devices, a committed key exactly a stored one
//! (listeners, metrics, one copy), stores, deletes and hotplug against
//! open leases, and a hunt of leases racing forced removes. Real memfd
//! mappings, real threads.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use daxkv::engine::{
    DeviceId, Engine, EngineLeased, HotplugError, Listener, RemoveMode, ShrinkMode,
};
use daxkv::plumbing::buf::Buf;
use daxkv::{Key, LeaseError, LEASES_MAX};

#[path = "common/leases.rs"]
mod common;
use common::{engine, fill, k, lease, load, store, SLOT, T};

#[derive(Default)]
struct Heard {
    stored: Mutex<Vec<Key>>,
    accessed: Mutex<Vec<Key>>,
    deleted: Mutex<Vec<Key>>,
}

impl Listener for Heard {
    fn on_keys_stored(&self, keys: &[Key], sizes: &[usize]) {
        assert_eq!(keys.len(), sizes.len());
        self.stored.lock().unwrap().extend_from_slice(keys);
    }
    fn on_keys_accessed(&self, keys: &[Key]) {
        self.accessed.lock().unwrap().extend_from_slice(keys);
    }
    fn on_keys_deleted(&self, keys: &[Key]) {
        self.deleted.lock().unwrap().extend_from_slice(keys);
    }
}

fn listen(e: &Engine) -> Arc<Heard> {
    let h = Arc::new(Heard::default());
    let l: Arc<dyn Listener> = h.clone();
    e.register_listener(&l);
    h
}

#[test]
fn a_committed_lease_is_exactly_a_stored_key() {
    let e = engine(&[8, 8]);
    let heard = listen(&e);
    let mut ls = lease(&e, &[k(1), k(2)], 1000);
    // Placement as a store's: the least used device each time.
    assert_ne!(ls[0].device(), ls[1].device(), "least used first");
    for l in &ls {
        assert_eq!(l.len(), 1000);
        assert_eq!(l.offset() % SLOT, 0);
        assert_eq!(l.epoch(), 1);
        fill(l, 0x5A);
    }
    // In flight until the commit: misses everywhere, no event yet.
    assert_eq!(e.exists(&[k(1), k(2)]), vec![false, false]);
    assert_eq!(load(&e, k(1)), None);
    assert!(e.lease_load(&[k(1)])[0].as_ref().unwrap().is_none());
    assert!(heard.stored.lock().unwrap().is_empty());
    let dev_of_1 = ls[0].device();
    let mut out = Vec::new();
    assert_eq!(e.commit_into(&mut ls, &mut out), 2);
    assert!(ls.is_empty());
    assert_eq!(out, vec![Ok(()), Ok(())]);
    assert_eq!(*heard.stored.lock().unwrap(), vec![k(1), k(2)]);
    assert_eq!(load(&e, k(1)).unwrap(), vec![0x5A; 1000]);
    assert_eq!(e.devices_holding(k(1)), vec![dev_of_1]);
    // Counted as stores, and the usage moved.
    let text = daxkv::control::metrics::encode(&e);
    assert!(
        text.lines().any(
            |l| l.starts_with("daxkv_keys_total{op=\"store\",result=\"ok\"}") && l.ends_with(" 2")
        ),
        "{text}"
    );
    assert_eq!(e.usage().0, 2 * SLOT as u64);
    // A read lease: the bytes, told as an access.
    let r = e.lease_load(&[k(1)]).pop().unwrap().unwrap().unwrap();
    // SAFETY: a read lease hands out `len()` readable bytes at `ptr()`.
    let got = unsafe { std::slice::from_raw_parts(r.ptr(), r.len()) };
    assert_eq!(got, &[0x5A; 1000][..]);
    assert_eq!(r.device(), dev_of_1);
    r.release();
    // The load task above, then the read lease.
    assert_eq!(*heard.accessed.lock().unwrap(), vec![k(1), k(1)]);
    // Leasing a stored key: present, no pointer.
    let again = e.lease_store(&[k(1)], &[10]).unwrap();
    assert!(matches!(again[0], Ok(EngineLeased::AlreadyPresent)));
    e.check_invariants().unwrap();
}

#[test]
fn a_store_of_a_leased_key_never_succeeds_and_never_makes_a_second_copy() {
    // Two devices: the store would otherwise land on the emptier one.
    let e = engine(&[8, 8]);
    let l = lease(&e, &[k(7)], 100).pop().unwrap();
    let leased_on = l.device();
    // The other device is now the emptier: a store of k(7) must not go
    // there, and must not answer stored.
    assert_eq!(store(&e, vec![k(7)], 1), vec![false]);
    assert!(
        e.devices_holding(k(7)).is_empty(),
        "not readable before commit"
    );
    // A second lease of it: in flight, not present (it is not stored).
    assert_eq!(
        e.lease_store(&[k(7)], &[100]).unwrap()[0].as_ref().err(),
        Some(&LeaseError::InFlight)
    );
    // A delete skips it (in flight).
    assert!(e.delete(&[k(7)]).is_empty());
    fill(&l, 9);
    l.commit().unwrap();
    assert_eq!(e.devices_holding(k(7)), vec![leased_on]);
    assert_eq!(load(&e, k(7)).unwrap(), vec![9; 100]);
    // Stored: a store of it is the usual success, still one copy.
    assert_eq!(store(&e, vec![k(7)], 1), vec![true]);
    assert_eq!(e.devices_holding(k(7)), vec![leased_on]);
    assert_eq!(e.delete(&[k(7)]), vec![k(7)]);
    e.check_invariants().unwrap();
}

#[test]
fn aborted_and_dropped_leases_give_their_slots_back() {
    let e = engine(&[2]);
    let mut ls = lease(&e, &[k(1), k(2)], 10);
    // Full: a third lease and a store are refused, nothing is waited for.
    assert_eq!(
        e.lease_store(&[k(3)], &[10]).unwrap()[0].as_ref().err(),
        Some(&LeaseError::Full)
    );
    assert_eq!(store(&e, vec![k(3)], 1), vec![false]);
    ls.pop().unwrap().abort();
    drop(ls);
    assert_eq!(e.usage().0, 0);
    assert_eq!(e.exists(&[k(1), k(2)]), vec![false, false]);
    assert_eq!(store(&e, vec![k(1), k(2)], 1), vec![true, true]);
    assert_eq!(e.status()["devices"][0]["lease_count"], 0);
}

#[test]
fn bad_requests_name_what_was_wrong() {
    let e = engine(&[4]);
    let r = e.lease_store(&[k(1)], &[SLOT + 1]).unwrap();
    assert_eq!(
        r[0].as_ref().err(),
        Some(&LeaseError::TooLarge {
            len: SLOT + 1,
            slot_bytes: SLOT
        })
    );
    let err = e.lease_store(&[k(1), k(2)], &[1]).unwrap_err();
    assert!(err.to_string().contains("2 keys but 1"), "{err}");
    assert_eq!(e.usage().0, 0, "nothing reserved");
}

#[test]
fn a_full_lease_table_sends_leases_to_the_next_device() {
    let e = engine(&[LEASES_MAX + 8, 8]);
    // Fill device 0's table (it stays the least used: it is much larger).
    let keys: Vec<Key> = (0..=LEASES_MAX as u64).map(k).collect();
    let ls = lease(&e, &keys, 1);
    let on_second = ls.iter().filter(|l| l.device() == DeviceId(1)).count();
    assert!(
        on_second >= 1,
        "the lease past the first table's bound went on"
    );
    let st = e.status();
    let total: u64 = (0..2)
        .map(|i| st["devices"][i]["lease_count"].as_u64().unwrap())
        .sum();
    assert_eq!(total, LEASES_MAX as u64 + 1);
    assert!(
        st["devices"][0]["oldest_lease_age_seconds"]
            .as_f64()
            .unwrap()
            >= 0.0
    );
    let text = daxkv::control::metrics::encode(&e);
    assert!(text.contains("daxkv_leases{device=\"0\""), "{text}");
    drop(ls);
    assert_eq!(e.status()["devices"][0]["lease_count"], 0);
    assert!(e.status()["devices"][0]["oldest_lease_age_seconds"].is_null());
}

#[test]
fn a_read_lease_keeps_its_slot_through_a_delete() {
    let e = engine(&[1]);
    assert_eq!(store(&e, vec![k(1)], 3), vec![true]);
    let r = e.lease_load(&[k(1)]).pop().unwrap().unwrap().unwrap();
    assert_eq!(e.delete(&[k(1)]), vec![k(1)]);
    assert_eq!(e.exists(&[k(1)]), vec![false]);
    // The only slot is still the reader's: a new key has no room.
    assert_eq!(store(&e, vec![k(2)], 4), vec![false]);
    // SAFETY: as in `a_committed_lease_is_exactly_a_stored_key`.
    let got = unsafe { std::slice::from_raw_parts(r.ptr(), r.len()) };
    assert_eq!(got, &[3; 1000][..]);
    drop(r);
    assert_eq!(store(&e, vec![k(2)], 4), vec![true]);
}

#[test]
fn hotplug_refuses_leased_devices_with_the_count_and_a_forced_remove_cancels() {
    let e = engine(&[8, 8]);
    let heard = listen(&e);
    // One committed key and one open lease on device 0; a read lease too.
    let mut ls = lease(&e, &[k(1), k(2)], 100);
    let (on0, on1): (Vec<_>, Vec<_>) = ls.drain(..).partition(|l| l.device() == DeviceId(0));
    let (l0, l1) = (
        on0.into_iter().next().unwrap(),
        on1.into_iter().next().unwrap(),
    );
    let k0 = l0.key();
    let open_key = l1.key();
    fill(&l0, 1);
    l0.commit().unwrap();
    // Device 1 now holds the open lease. Non-forced remove, grow and
    // shrink: 409 with the count, nothing changed.
    let dev1 = DeviceId(1);
    for r in [
        e.remove_device(dev1, RemoveMode::Migrate, false)
            .map(|_| ()),
        e.remove_device(dev1, RemoveMode::Evict, false).map(|_| ()),
    ] {
        match r {
            Err(HotplugError::Leased { leases: 1, .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    for (size, force) in [(16 * SLOT, false), (16 * SLOT, true), (4 * SLOT, true)] {
        let r = e.resize_device_to(dev1, size, ShrinkMode::Migrate, force, |_, _| Ok(()));
        match r {
            Err(ref err @ HotplugError::Leased { leases: 1, .. }) => {
                assert_eq!(err.status(), 409);
                assert!(err.to_string().contains("1 open slot leases"), "{err}");
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(e.devices()[1].state.name(), "active");
    assert_eq!(e.devices()[1].arena_bytes, 8 * SLOT);
    // Forced: the remove goes ahead, the lease is canceled.
    fill(&l1, 2);
    let rep = e.remove_device(dev1, RemoveMode::Migrate, true).unwrap();
    assert_eq!(rep.moved_keys, 0);
    assert_eq!(l1.commit(), Err(LeaseError::Canceled));
    assert!(!heard.stored.lock().unwrap().contains(&open_key));
    assert_eq!(e.exists(&[open_key, k0]), vec![false, true]);
    // The key can be stored again, elsewhere.
    assert_eq!(store(&e, vec![open_key], 5), vec![true]);
    e.check_invariants().unwrap();
}

#[test]
fn a_forced_remove_keeps_a_read_leased_mapping_until_the_lease_goes() {
    let e = engine(&[8, 8]);
    // Put a key on device 1 (device 0 takes the first store).
    assert_eq!(store(&e, vec![k(1), k(2)], 6), vec![true, true]);
    let on1 = if e.devices_holding(k(1)) == vec![DeviceId(1)] {
        k(1)
    } else {
        k(2)
    };
    let r = e.lease_load(&[on1]).pop().unwrap().unwrap().unwrap();
    assert_eq!(r.device(), DeviceId(1));
    let addr = r.ptr() as usize;
    e.remove_device(DeviceId(1), RemoveMode::Migrate, true)
        .unwrap();
    // Moved: readable on device 0, and the old slot still readable
    // through the lease (the mapping stays).
    assert_eq!(e.devices_holding(on1), vec![DeviceId(0)]);
    assert!(
        mapped(addr),
        "the removed device's mapping went under a live read lease"
    );
    // SAFETY: the read lease keeps its slot and mapping alive.
    let got = unsafe { std::slice::from_raw_parts(r.ptr(), r.len()) };
    assert_eq!(got, &[6; 1000][..]);
    drop(r);
    assert!(!mapped(addr), "the mapping stayed after its last lease");
}

/// Whether `addr` lies in a mapping of this process (`/proc/self/maps`).
fn mapped(addr: usize) -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|r| r.split_once('-'))
        .any(|(a, b)| {
            let a = usize::from_str_radix(a, 16).unwrap();
            let b = usize::from_str_radix(b, 16).unwrap();
            (a..b).contains(&addr)
        })
}

#[test]
fn commits_after_close_answer_closed() {
    let e = engine(&[4]);
    let l = lease(&e, &[k(1)], 10).pop().unwrap();
    let r = e.lease_load(&[k(1)]);
    assert!(r[0].as_ref().unwrap().is_none());
    e.close();
    assert_eq!(l.commit(), Err(LeaseError::Closed));
    assert_eq!(
        e.lease_store(&[k(2)], &[1]).unwrap()[0].as_ref().err(),
        Some(&LeaseError::Closed)
    );
    assert_eq!(
        e.lease_load(&[k(2)])[0].as_ref().err(),
        Some(&LeaseError::Closed)
    );
}

/// The hunt (`lease.rs` module doc, "Placement, and a forced remove"):
/// leasers lease, fill and commit keys while the main thread force-removes
/// the device they are on (migrating) and adds a fresh one, over and over.
/// Every key whose commit answered `Ok` must stay readable with its bytes
/// (nothing else deletes keys); a canceled or refused one is simply not
/// stored. A lease that committed on a device after the remove had listed
/// its keys would be lost with it (seen failing with `lease_one`'s state
/// check, or the remove's cancel walk, taken out).
#[test]
fn leases_racing_forced_removes_never_lose_a_committed_key() {
    let e = Arc::new(engine(&[256, 256]));
    let stop = Arc::new(AtomicBool::new(false));
    let committed = Arc::new(Mutex::new(Vec::<(Key, u8)>::new()));
    let canceled = Arc::new(AtomicUsize::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let leasers: Vec<_> = (0..2)
        .map(|_| {
            let (e, stop, committed, canceled, next) = (
                e.clone(),
                stop.clone(),
                committed.clone(),
                canceled.clone(),
                next.clone(),
            );
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed) as u64;
                    let key = k(1_000_000 + i);
                    let byte = (i % 251) as u8;
                    let l = match e.lease_store(&[key], &[512]).unwrap().pop().unwrap() {
                        Ok(EngineLeased::Leased(l)) => l,
                        Ok(EngineLeased::AlreadyPresent) => panic!("fresh key present"),
                        Err(_) => continue, // full, busy: not stored
                    };
                    fill(&l, byte);
                    std::thread::yield_now();
                    match l.commit() {
                        Ok(()) => committed.lock().unwrap().push((key, byte)),
                        Err(LeaseError::Canceled | LeaseError::Closed) => {
                            canceled.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(other) => panic!("{other:?}"),
                    }
                    // Keep the pool from filling: delete old keys. The
                    // delete (under each key's claim, so it waits for a
                    // move) must find every committed one: nothing else
                    // deletes them. (A load racing a move may miss, so
                    // bytes are checked at the end.)
                    if i.is_multiple_of(8) {
                        let old = {
                            let mut c = committed.lock().unwrap();
                            let keep = c.len().saturating_sub(16);
                            c.drain(..keep).collect::<Vec<_>>()
                        };
                        let keys: Vec<Key> = old.iter().map(|p| p.0).collect();
                        let gone: HashSet<Key> = e.delete(&keys).into_iter().collect();
                        for key in keys {
                            assert!(gone.contains(&key), "committed key {key:?} lost");
                        }
                    }
                }
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_millis(1500);
    let mut removes = 0;
    while Instant::now() < deadline {
        // Remove the device with the highest id still in the pool.
        let last = e
            .devices()
            .iter()
            .filter(|d| !d.state.is_tombstone())
            .map(|d| d.id)
            .max()
            .unwrap();
        e.hotplug_add(&format!("memfd:hunt{removes}"), 256 * SLOT, |_, _| Ok(()))
            .unwrap();
        e.remove_device(last, RemoveMode::Migrate, true).unwrap();
        removes += 1;
        // Let some leases commit between removes, not only race them.
        std::thread::sleep(Duration::from_micros(100 * (removes % 4)));
    }
    stop.store(true, Ordering::Relaxed);
    for t in leasers {
        t.join().unwrap();
    }
    let left = committed.lock().unwrap().clone();
    check(&e, &left);
    println!(
        "{removes} forced removes, {} leases canceled, {} keys leased",
        canceled.load(Ordering::Relaxed),
        next.load(Ordering::Relaxed)
    );
    assert!(removes > 10);
    e.check_invariants().unwrap();
}

/// Every `(key, byte)` readable with its bytes.
fn check(e: &Engine, pairs: &[(Key, u8)]) {
    for &(key, byte) in pairs {
        let got = load(e, key).unwrap_or_else(|| panic!("committed key {key:?} lost"));
        assert_eq!(
            got,
            vec![byte; 512],
            "committed key {key:?} has other bytes"
        );
    }
}

#[test]
fn leases_copy_from_and_to_host_memory_within_their_bounds() {
    let e = engine(&[4]);
    let mut l = lease(&e, &[k(1)], 100).pop().unwrap();
    let err = l.write(90, &[1; 11]).unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    assert!(
        l.write(usize::MAX, &[1]).is_err(),
        "an offset that overflows"
    );
    l.write(0, &[3; 60]).unwrap();
    l.write(60, &[4; 40]).unwrap();
    l.commit().unwrap();
    let r = e.lease_load(&[k(1)]).pop().unwrap().unwrap().unwrap();
    let mut out = [0u8; 128];
    assert_eq!(r.read(0, &mut out).unwrap(), 100);
    assert_eq!(&out[..60], &[3; 60][..]);
    assert_eq!(&out[60..100], &[4; 40][..]);
    assert_eq!(r.read(90, &mut out).unwrap(), 10);
    assert_eq!(r.read(100, &mut out).unwrap(), 0);
    assert_eq!(r.read(usize::MAX, &mut out).unwrap(), 0);
}

/// The second hunt: leases against everything else at once. A leaser
/// leases, fills and commits (or aborts) fresh keys; a reader read-leases
/// committed keys and checks every byte twice, a moment apart (the slot
/// must not be reused under the lease), and re-stores some of them (a
/// store of a stored key is a success and changes nothing); a deleter
/// deletes committed keys (each delete must find its key: nothing else
/// deletes them); the main thread grows, shrinks (both refused with 409
/// while leases are open, or done), migrates devices away without and with
/// force, and adds fresh ones. At the end every committed key not deleted
/// reads back with its bytes.
#[test]
#[allow(clippy::too_many_lines)] // one scenario: four actors and their checks
fn leases_hold_through_deletes_restores_migrations_and_resizes() {
    let e = Arc::new(engine(&[128, 128]));
    let stop = Arc::new(AtomicBool::new(false));
    let committed = Arc::new(Mutex::new(Vec::<(Key, u8)>::new()));
    let reads = Arc::new(AtomicUsize::new(0));
    let byte_of = |i: u64| (i % 251) as u8 + 1;
    let leaser = {
        let (e, stop, committed) = (e.clone(), stop.clone(), committed.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let key = k(5_000_000 + i);
                let Ok(EngineLeased::Leased(mut l)) =
                    e.lease_store(&[key], &[700]).unwrap().pop().unwrap()
                else {
                    continue;
                };
                l.write(0, &[byte_of(i); 700]).unwrap();
                if i.is_multiple_of(5) {
                    l.abort();
                    continue;
                }
                if l.commit().is_ok() {
                    committed.lock().unwrap().push((key, byte_of(i)));
                }
            }
        })
    };
    let reader = {
        let (e, stop, committed, reads) =
            (e.clone(), stop.clone(), committed.clone(), reads.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 700];
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let pick = {
                    let c = committed.lock().unwrap();
                    (!c.is_empty()).then(|| c[n * 7919 % c.len()])
                };
                let Some((key, byte)) = pick else {
                    std::thread::yield_now();
                    continue;
                };
                if let Ok(Some(r)) = e.lease_load(&[key]).pop().unwrap() {
                    assert_eq!(r.read(0, &mut buf).unwrap(), 700);
                    assert!(
                        buf.iter().all(|&b| b == byte),
                        "read lease of {key:?} saw other bytes"
                    );
                    std::thread::yield_now();
                    r.read(0, &mut buf).unwrap();
                    assert!(
                        buf.iter().all(|&b| b == byte),
                        "the slot changed under a read lease"
                    );
                    reads.fetch_add(1, Ordering::Relaxed);
                }
                if n.is_multiple_of(16) {
                    // A re-store of a stored key: success, bytes unchanged.
                    let id = e
                        .submit_store(vec![key], vec![Buf::Vec(vec![0; 10])])
                        .unwrap();
                    let _ = e.wait_store(id, T).ready();
                }
            }
        })
    };
    let deleter = {
        let (e, stop, committed) = (e.clone(), stop.clone(), committed.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let old: Vec<(Key, u8)> = {
                    let mut c = committed.lock().unwrap();
                    let keep = c.len().saturating_sub(64);
                    c.drain(..keep).collect()
                };
                let keys: Vec<Key> = old.iter().map(|p| p.0).collect();
                let gone: HashSet<Key> = e.delete(&keys).into_iter().collect();
                for key in keys {
                    assert!(gone.contains(&key), "committed key {key:?} lost");
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    let (mut step, mut done, mut refused) = (0u32, 0u32, 0u32);
    while Instant::now() < deadline {
        step += 1;
        let live: Vec<_> = e
            .devices()
            .into_iter()
            .filter(|d| !d.state.is_tombstone())
            .collect();
        let d = &live[step as usize % live.len()];
        let r = match step % 5 {
            // Every device here may grow to 4 × 128 slots.
            0 if d.arena_bytes * 2 <= 512 * SLOT => e
                .resize_device_to(
                    d.id,
                    d.arena_bytes * 2,
                    ShrinkMode::Migrate,
                    false,
                    |_, _| Ok(()),
                )
                .map(|_| ()),
            0 | 1 => e
                .resize_device_to(
                    d.id,
                    (d.arena_bytes / 2).max(64 * SLOT),
                    ShrinkMode::Migrate,
                    step % 2 == 0,
                    |_, _| Ok(()),
                )
                .map(|_| ()),
            2 => e
                .remove_device(d.id, RemoveMode::Migrate, false)
                .map(|_| ()),
            3 if live.len() < 4 => e
                .hotplug_add(&format!("memfd:chaos{step}"), 128 * SLOT, |_, _| Ok(()))
                .map(|_| ()),
            _ => e.remove_device(d.id, RemoveMode::Migrate, true).map(|_| ()),
        };
        match r {
            Ok(()) => done += 1,
            Err(
                HotplugError::Leased { .. }
                | HotplugError::LastDevice { .. }
                | HotplugError::InsufficientCapacity { .. }
                | HotplugError::ShrinkStillLive
                | HotplugError::Blocked { .. },
            ) => refused += 1,
            Err(err) => panic!("step {step}: {err}"),
        }
        if e.devices()
            .iter()
            .filter(|d| !d.state.is_tombstone())
            .count()
            < 2
        {
            e.hotplug_add(&format!("memfd:refill{step}"), 128 * SLOT, |_, _| Ok(()))
                .unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in [leaser, reader, deleter] {
        t.join().unwrap();
    }
    for &(key, byte) in committed.lock().unwrap().iter() {
        let got = load(&e, key).unwrap_or_else(|| panic!("committed key {key:?} lost"));
        assert!(
            got.len() == 700 && got.iter().all(|&b| b == byte),
            "{key:?} has other bytes"
        );
    }
    println!(
        "{step} hotplug steps ({done} done, {refused} refused), {} read leases checked",
        reads.load(Ordering::Relaxed)
    );
    assert!(reads.load(Ordering::Relaxed) > 100);
    e.check_invariants().unwrap();
}
