//! Slot leases on one device (`device::lease`): a caller fills or reads a
//! slot through a raw pointer between calls, on a real memfd mapping, with
//! real threads racing deletes, puts, remaps and close.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use daxkv::device::arena::ArenaSpec;
use daxkv::device::error::{CoreError, GateError};
use daxkv::{
    CoreConfig, DaxCore, Key, LeaseError, LeasedStore, PutError, PutOutcome, StoreLease, LEASES_MAX,
};

const SLOT: usize = 4096;

/// A memfd device of `slots` slots that may grow to four times that.
fn core(slots: usize) -> DaxCore {
    DaxCore::open(&CoreConfig::new(
        ArenaSpec::memfd(slots * SLOT).max_size_bytes(4 * slots * SLOT),
        SLOT,
    ))
    .unwrap()
}

fn k(i: u64) -> Key {
    Key::digest(&i.to_le_bytes())
}

fn leased(c: &DaxCore, key: Key, len: usize) -> StoreLease<'_> {
    match c.lease_store(key, len, 7).unwrap() {
        LeasedStore::Leased(l) => l,
        LeasedStore::AlreadyPresent => panic!("{key:?} is present"),
    }
}

/// Fill a store lease the way a caller's copy engine would: through its
/// raw pointer, within its length.
fn fill(l: &StoreLease<'_>, byte: u8) {
    // SAFETY: the lease hands out `len()` writable bytes at `ptr()` until it
    // ends (the lease contract); nothing else touches them meanwhile.
    unsafe { std::ptr::write_bytes(l.ptr(), byte, l.len()) };
}

fn get(c: &DaxCore, key: Key, len: usize) -> Option<Vec<u8>> {
    let mut v = vec![0u8; len];
    c.load_into(key, &mut v).map(|n| {
        v.truncate(n);
        v
    })
}

#[test]
fn a_store_lease_is_invisible_until_commit_then_stored_like_a_put() {
    let c = core(8);
    let l = leased(&c, k(1), 1000);
    assert_eq!(l.len(), 1000);
    assert_eq!(l.offset() % SLOT, 0);
    fill(&l, 0xAB);
    // In flight: lookups, loads and read leases miss it.
    assert!(!c.exists(k(1), false));
    assert_eq!(get(&c, k(1), SLOT), None);
    assert!(c.lease_load(k(1)).unwrap().is_none());
    assert_eq!(c.status().lease_count, 1);
    assert_eq!(c.status().active_write_count, 1);
    l.commit().unwrap();
    assert!(c.exists(k(1), false));
    assert_eq!(get(&c, k(1), SLOT).unwrap(), vec![0xAB; 1000]);
    assert_eq!(c.live_slot_count(), 1);
    assert_eq!(c.status().lease_count, 0);
    assert_eq!(c.status().oldest_lease_age, None);
    // Stored exactly as a put: a put of it now is the usual no-op, a
    // lease of it answers present.
    assert_eq!(
        c.put(k(1), &[1; 10], 0).unwrap(),
        PutOutcome::AlreadyPresent
    );
    assert!(matches!(
        c.lease_store(k(1), 10, 0).unwrap(),
        LeasedStore::AlreadyPresent
    ));
    c.check_invariants().unwrap();
}

#[test]
fn a_plain_put_of_a_leased_key_is_never_a_success() {
    let c = core(8);
    let l = leased(&c, k(2), 64);
    assert!(matches!(c.put(k(2), &[9; 64], 0), Err(PutError::Leased)));
    assert!(matches!(
        c.lease_store(k(2), 64, 0).unwrap(),
        LeasedStore::AlreadyPresent
    ));
    // Another key is not affected.
    assert_eq!(c.put(k(3), &[3; 64], 0).unwrap(), PutOutcome::Stored);
    fill(&l, 2);
    l.commit().unwrap();
    assert_eq!(
        c.put(k(2), &[9; 64], 0).unwrap(),
        PutOutcome::AlreadyPresent
    );
    assert_eq!(
        get(&c, k(2), SLOT).unwrap(),
        vec![2; 64],
        "the put did not touch it"
    );
}

#[test]
fn abort_and_drop_free_the_slot_and_leave_no_key() {
    let c = core(2);
    let a = leased(&c, k(1), 10);
    let b = leased(&c, k(2), 10);
    assert_eq!(c.live_slot_count(), 2);
    assert!(matches!(c.lease_store(k(3), 10, 0), Err(LeaseError::Full)));
    a.abort();
    drop(b);
    assert_eq!(c.live_slot_count(), 0);
    assert!(!c.exists(k(1), false) && !c.exists(k(2), false));
    assert_eq!(c.status().lease_count, 0);
    // The slots serve new keys.
    assert_eq!(c.put(k(1), &[1; 10], 0).unwrap(), PutOutcome::Stored);
    let l = leased(&c, k(4), 10);
    l.commit().unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn a_forced_delete_cancels_a_store_lease_and_a_plain_one_skips_it() {
    let c = core(4);
    let l = leased(&c, k(5), 100);
    assert!(
        !c.delete(k(5), false),
        "a plain delete skips a key in flight"
    );
    assert!(c.delete(k(5), true), "a forced delete reports it deleted");
    assert!(!c.exists(k(5), false));
    fill(&l, 1); // the slot is still the lease's until it ends
    assert_eq!(l.commit(), Err(LeaseError::Canceled));
    assert!(!c.exists(k(5), false));
    assert_eq!(c.live_slot_count(), 0);
    c.check_invariants().unwrap();
}

#[test]
fn a_read_lease_keeps_its_slot_through_a_delete() {
    let c = core(1);
    c.put(k(6), &[6; 300], 42).unwrap();
    let r = c.lease_load(k(6)).unwrap().expect("stored");
    assert_eq!((r.len(), r.meta()), (300, 42));
    // SAFETY: a read lease hands out `len()` readable bytes at `ptr()`
    // until it drops; no writer can reach a borrowed slot.
    let bytes = unsafe { std::slice::from_raw_parts(r.ptr(), r.len()) }.to_vec();
    assert_eq!(bytes, vec![6; 300]);
    // A delete detaches the key at once; the slot is not reused while the
    // lease holds it (the device's one slot: a put finds it full).
    assert!(c.delete(k(6), false));
    assert!(!c.exists(k(6), false));
    assert!(matches!(c.put(k(7), &[7; 10], 0), Err(PutError::Full)));
    // SAFETY: as above.
    let again = unsafe { std::slice::from_raw_parts(r.ptr(), r.len()) }.to_vec();
    assert_eq!(again, bytes, "the leased bytes stayed");
    drop(r);
    assert_eq!(c.live_slot_count(), 0);
    assert_eq!(c.put(k(7), &[7; 10], 0).unwrap(), PutOutcome::Stored);
    c.check_invariants().unwrap();
}

#[test]
fn remaps_refuse_at_once_while_a_lease_lives_and_traffic_goes_on() {
    let c = core(8);
    // A short drain timeout would hide a wait; a long one shows it.
    c.put(k(1), &[1; 10], 0).unwrap();
    for store in [true, false] {
        let sl;
        let rl;
        if store {
            sl = Some(leased(&c, k(2), 10));
            rl = None;
        } else {
            sl = None;
            rl = c.lease_load(k(1)).unwrap();
            assert!(rl.is_some());
        }
        let t = Instant::now();
        for bytes in [16 * SLOT, 4 * SLOT] {
            match c.remap(bytes) {
                Err(CoreError::Busy(GateError::Leased { leases: 1 })) => {}
                other => panic!("remap to {bytes} with a lease: {other:?}"),
            }
        }
        assert!(matches!(
            c.quiesce(),
            Err(CoreError::Busy(GateError::Leased { .. }))
        ));
        assert!(t.elapsed() < Duration::from_secs(1), "refused at once");
        // Other traffic runs meanwhile.
        assert_eq!(c.put(k(3), &[3; 10], 0).unwrap(), PutOutcome::Stored);
        assert_eq!(get(&c, k(1), SLOT).unwrap(), vec![1; 10]);
        assert!(c.delete(k(3), false));
        drop(sl);
        drop(rl);
        c.remap(16 * SLOT).unwrap();
        c.remap(8 * SLOT).unwrap();
    }
    c.check_invariants().unwrap();
}

#[test]
fn a_lease_never_waits_for_a_pending_remap() {
    let c = Arc::new(core(8));
    c.put(k(1), &[1; 10], 0).unwrap();
    // A guard held on another thread keeps a remap pending.
    let session_held = Arc::new(Barrier::new(2));
    let release = Arc::new(AtomicBool::new(false));
    let holder = {
        let (c, b, r) = (c.clone(), session_held.clone(), release.clone());
        std::thread::spawn(move || {
            let s = c.session().unwrap();
            b.wait();
            while !r.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            drop(s);
        })
    };
    session_held.wait();
    let remapper = {
        let c = c.clone();
        std::thread::spawn(move || c.remap(16 * SLOT))
    };
    let t = Instant::now();
    while !c.remap_pending() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the remap never became pending"
        );
        std::thread::yield_now();
    }
    let t = Instant::now();
    assert!(matches!(c.lease_store(k(2), 10, 0), Err(LeaseError::Busy)));
    assert!(matches!(c.lease_load(k(1)), Err(LeaseError::Busy)));
    assert!(t.elapsed() < Duration::from_secs(1), "refused at once");
    release.store(true, Ordering::Release);
    holder.join().unwrap();
    remapper.join().unwrap().unwrap();
    assert_eq!(c.max_slots(), 16);
    let l = leased(&c, k(2), 10);
    l.commit().unwrap();
}

#[test]
fn close_does_not_wait_for_leases_and_they_end_cleanly_after() {
    let c = core(4);
    c.put(k(1), &[1; 50], 0).unwrap();
    let sl = leased(&c, k(2), 50);
    let rl = c.lease_load(k(1)).unwrap().unwrap();
    let t = Instant::now();
    c.close();
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "close returned at once"
    );
    assert!(c.is_closing());
    assert!(matches!(
        c.lease_store(k(3), 10, 0),
        Err(LeaseError::Closed)
    ));
    assert!(matches!(c.lease_load(k(1)), Err(LeaseError::Closed)));
    // The mapping stays while the leases live: both still work.
    fill(&sl, 3);
    // SAFETY: the read lease's bytes, as in the test above.
    let b = unsafe { std::slice::from_raw_parts(rl.ptr(), rl.len()) }.to_vec();
    assert_eq!(b, vec![1; 50]);
    sl.commit().unwrap();
    drop(rl);
}

#[test]
fn the_lease_table_is_bounded_and_refuses_without_waiting() {
    let c = core(LEASES_MAX + 8);
    let mut held = Vec::new();
    for i in 0..LEASES_MAX as u64 {
        held.push(leased(&c, k(i), 8));
    }
    assert!(matches!(
        c.lease_store(k(1 << 40), 8, 0),
        Err(LeaseError::TooMany { max: LEASES_MAX })
    ));
    // Nothing leaked by the refusal: the slot it took went back.
    assert_eq!(c.live_slot_count(), LEASES_MAX);
    c.put(k(1 << 41), &[1; 8], 0).unwrap();
    assert!(matches!(
        c.lease_load(k(1 << 41)),
        Err(LeaseError::TooMany { .. })
    ));
    std::thread::sleep(Duration::from_millis(20));
    let st = c.status();
    assert_eq!(st.lease_count, LEASES_MAX);
    assert!(st.oldest_lease_age.unwrap() >= Duration::from_millis(20));
    for l in held.drain(..) {
        l.commit().unwrap();
    }
    assert!(c.lease_load(k(1 << 41)).unwrap().is_some());
    assert_eq!(c.live_slot_count(), LEASES_MAX + 1);
    c.check_invariants().unwrap();
}

#[test]
fn bad_input_is_refused_with_nothing_taken() {
    let c = core(2);
    assert_eq!(
        c.lease_store(k(1), SLOT + 1, 0).unwrap_err(),
        LeaseError::TooLarge {
            len: SLOT + 1,
            slot_bytes: SLOT
        }
    );
    assert!(c
        .lease_store(k(1), SLOT + 1, 0)
        .unwrap_err()
        .to_string()
        .contains(&format!("{}", SLOT + 1)));
    assert_eq!(c.live_slot_count(), 0);
    assert_eq!(c.status().lease_count, 0);
    assert!(c.lease_load(k(9)).unwrap().is_none());
    // An empty payload is a stored key of length 0.
    let l = leased(&c, k(1), 0);
    assert!(l.is_empty());
    l.commit().unwrap();
    assert_eq!(get(&c, k(1), SLOT).unwrap(), Vec::<u8>::new());
}

#[test]
fn leases_end_on_another_thread() {
    let c = core(8);
    let l = leased(&c, k(1), 128);
    let r = {
        c.put(k(2), &[2; 128], 0).unwrap();
        c.lease_load(k(2)).unwrap().unwrap()
    };
    std::thread::scope(|s| {
        s.spawn(move || {
            fill(&l, 1);
            l.commit().unwrap();
            drop(r);
        });
    });
    assert_eq!(get(&c, k(1), SLOT).unwrap(), vec![1; 128]);
    assert_eq!(c.status().lease_count, 0);
    c.check_invariants().unwrap();
}

const HUNT_KEYS: u64 = 12;

/// A hunted key's payload: its first byte names the key, the rest agree.
fn hunt_payload(key: u64, round: u64) -> Vec<u8> {
    let mut v = vec![(key as u8) ^ (round as u8).rotate_left(4); 256 + (key as usize) * 16];
    v[0] = key as u8;
    v
}

/// A read of a hunted key saw one whole payload.
fn hunt_check(bytes: &[u8]) {
    let key = bytes[0];
    assert_eq!(
        bytes.len(),
        256 + usize::from(key) * 16,
        "key {key}: a payload of another length"
    );
    assert!(
        bytes[1..].iter().all(|&b| b == bytes[1]),
        "key {key}: torn or mixed payload"
    );
}

/// Lease, fill, then commit or abort; a plain put of the key meanwhile
/// must be refused. Counts commits and cancels.
fn hunt_leaser(
    c: &DaxCore,
    stop: &AtomicBool,
    t: u64,
    committed: &AtomicUsize,
    canceled: &AtomicUsize,
) {
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        round += 1;
        let key = (round * 7 + t) % HUNT_KEYS;
        let want = hunt_payload(key, round);
        match c.lease_store(k(key), want.len(), 0) {
            Ok(LeasedStore::Leased(l)) => {
                // SAFETY: the lease's own bytes, within its length.
                unsafe {
                    std::ptr::copy_nonoverlapping(want.as_ptr(), l.ptr(), want.len());
                }
                // Refused while open, canceled by a forced delete or not
                // (its bucket stays until the lease ends).
                let put = c.put(k(key), &want, 0);
                assert!(matches!(put, Err(PutError::Leased)), "{put:?}");
                if round.is_multiple_of(3) {
                    l.abort();
                } else {
                    match l.commit() {
                        Ok(()) => committed.fetch_add(1, Ordering::Relaxed),
                        Err(LeaseError::Canceled) => canceled.fetch_add(1, Ordering::Relaxed),
                        Err(e) => panic!("commit: {e}"),
                    };
                }
            }
            Ok(LeasedStore::AlreadyPresent) | Err(LeaseError::Full | LeaseError::Busy) => {}
            Err(e) => panic!("lease_store: {e}"),
        }
    }
}

/// Force-delete, put, read-lease and load the hunted keys in turn.
fn hunt_mixer(c: &DaxCore, stop: &AtomicBool) {
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let key = i % HUNT_KEYS;
        match i % 4 {
            0 => {
                c.delete(k(key), true);
            }
            1 => {
                let _ = c.put(k(key), &hunt_payload(key, i), 0);
            }
            2 => {
                if let Ok(Some(r)) = c.lease_load(k(key)) {
                    // SAFETY: the read lease's bytes.
                    hunt_check(unsafe { std::slice::from_raw_parts(r.ptr(), r.len()) });
                }
            }
            _ => {
                if let Some(b) = get(c, k(key), SLOT) {
                    hunt_check(&b);
                }
            }
        }
    }
}

/// A hunt: two threads lease, fill, commit or abort keys of a small set
/// while another puts, force-deletes, read-leases and loads them and a
/// fourth grows and shrinks the device. Every read (a load or a read
/// lease) sees one key's whole payload, no plain put of a leased key
/// succeeds while the lease is open, a remap runs only between leases,
/// and at the end every slot is back.
#[test]
fn hunt_leases_against_deletes_puts_and_remaps() {
    let c = core(16);
    let stop = AtomicBool::new(false);
    let (committed, canceled, remapped) = (
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    );
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let (c, stop, committed, canceled) = (&c, &stop, &committed, &canceled);
            s.spawn(move || hunt_leaser(c, stop, t, committed, canceled));
        }
        s.spawn(|| hunt_mixer(&c, &stop));
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                // Grow and back; a live lease refuses both at once.
                if c.remap(24 * SLOT).is_ok() {
                    remapped.fetch_add(1, Ordering::Relaxed);
                    let _ = c.remap(16 * SLOT);
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        std::thread::sleep(Duration::from_millis(1500));
        stop.store(true, Ordering::Relaxed);
    });
    eprintln!(
        "committed {}, canceled {}, remapped {}",
        committed.load(Ordering::Relaxed),
        canceled.load(Ordering::Relaxed),
        remapped.load(Ordering::Relaxed)
    );
    assert!(
        committed.load(Ordering::Relaxed) > 0,
        "no lease ever committed"
    );
    assert!(remapped.load(Ordering::Relaxed) > 0, "no remap ever ran");
    assert_eq!(c.status().lease_count, 0);
    for key in 0..HUNT_KEYS {
        c.delete(k(key), true);
    }
    assert_eq!(c.live_slot_count(), 0, "a slot was leaked");
    c.check_invariants().unwrap();
}

/// A hunt (from a hostile review): one thread only ever leases key K and
/// aborts (it never commits); another puts K and, when its put stored K,
/// force-deletes it again. So a put answering `Ok(AlreadyPresent)` claims
/// a success for a key that is not stored and never will be. Found in the
/// first version, thousands of times a second: the table entry given back
/// before the abort, a "no lease alive" shortcut read after the put had
/// seen the lease's entry, the state read before the table, and a key
/// leaving answered as present (`DaxCore::present` has each).
#[test]
fn a_put_racing_a_lease_abort_never_answers_already_present() {
    let c = core(8);
    let key = k(1);
    let stop = AtomicBool::new(false);
    let bogus = AtomicUsize::new(0);
    let (leased, refused, stored) = (
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    );
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                match c.lease_store(key, 64, 0) {
                    Ok(LeasedStore::Leased(l)) => {
                        leased.fetch_add(1, Ordering::Relaxed);
                        l.abort();
                    }
                    Ok(LeasedStore::AlreadyPresent) => {}
                    Err(e) => panic!("lease_store: {e}"),
                }
            }
        });
        s.spawn(|| {
            let data = [5u8; 64];
            while !stop.load(Ordering::Relaxed) {
                match c.put(key, &data, 0) {
                    Ok(PutOutcome::Stored) => {
                        stored.fetch_add(1, Ordering::Relaxed);
                        assert!(c.delete(key, true), "our own stored key deletes");
                    }
                    Ok(PutOutcome::AlreadyPresent) => {
                        // Only a lease that never commits can hold the key.
                        bogus.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(PutError::Leased) => {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => panic!("put: {e}"),
                }
            }
        });
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(1500) && bogus.load(Ordering::Relaxed) == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::Relaxed);
    });
    eprintln!(
        "leased {} refused {} stored {} bogus AlreadyPresent {}",
        leased.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        stored.load(Ordering::Relaxed),
        bogus.load(Ordering::Relaxed)
    );
    assert_eq!(
        bogus.load(Ordering::Relaxed),
        0,
        "a put answered Ok(AlreadyPresent) for a key held only by a store lease that aborted"
    );
    assert_eq!(c.status().lease_count, 0);
    c.delete(key, true);
    assert_eq!(c.live_slot_count(), 0);
    c.check_invariants().unwrap();
}

/// A hunt (from a hostile review): `PutError::Leased` means "the key is
/// leased for a store not yet committed". Key K1 is never leased: one
/// thread puts and deletes it, another puts it (finding it present), a
/// third leases and aborts a different key K2 in the slots K1 keeps
/// freeing. A put of K1 never answers `Leased`. Found in the first
/// version: the check read K1's slot number, then the table, without a
/// pin, so K1 deleted and its slot reused by K2's lease read as "K1 is
/// leased"; now the incarnation is pinned and table entries name it.
#[test]
fn a_put_of_a_never_leased_key_never_answers_leased() {
    let c = core(2);
    let (k1, k2) = (k(11), k(22));
    let stop = AtomicBool::new(false);
    let bogus = AtomicUsize::new(0);
    let present = AtomicUsize::new(0);
    std::thread::scope(|s| {
        // Put and delete K1, over and over.
        s.spawn(|| {
            let d = [1u8; 32];
            while !stop.load(Ordering::Relaxed) {
                match c.put(k1, &d, 0) {
                    Err(PutError::Leased) => {
                        bogus.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) | Err(PutError::Full) => {}
                    Err(e) => panic!("put: {e}"),
                }
                c.delete(k1, true);
            }
        });
        // Put K1 (usually finding it present).
        s.spawn(|| {
            let d = [1u8; 32];
            while !stop.load(Ordering::Relaxed) {
                match c.put(k1, &d, 0) {
                    Err(PutError::Leased) => {
                        bogus.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(PutOutcome::AlreadyPresent) => {
                        present.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) | Err(PutError::Full | PutError::Canceled) => {}
                    Err(e) => panic!("put: {e}"),
                }
            }
        });
        // Lease K2 into whatever slot is free, hold it a moment, abort.
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                match c.lease_store(k2, 32, 0) {
                    Ok(LeasedStore::Leased(l)) => {
                        std::hint::spin_loop();
                        l.abort();
                    }
                    Ok(LeasedStore::AlreadyPresent) | Err(LeaseError::Full) => {}
                    Err(e) => panic!("lease_store: {e}"),
                }
            }
        });
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(1500) && bogus.load(Ordering::Relaxed) == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::Relaxed);
    });
    eprintln!(
        "present {} bogus Leased {}",
        present.load(Ordering::Relaxed),
        bogus.load(Ordering::Relaxed)
    );
    assert_eq!(
        bogus.load(Ordering::Relaxed),
        0,
        "a put of a key no lease ever held answered PutError::Leased"
    );
    c.delete(k1, true);
    assert_eq!(c.live_slot_count(), 0);
    c.check_invariants().unwrap();
}
