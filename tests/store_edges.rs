//! Edge cases of the non-MP backend's store paths (`restore_into`,
//! `put_with_writer`, `put_batch_with`, close): races, pins, leaks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use daxkv::device::arena::ArenaSpec;
use daxkv::{CoreConfig, DaxStore, Key, PutOutcome, StoreConfig, StoreError};

const MIB: usize = 1 << 20;

fn k(i: u32) -> Key {
    Key::digest(format!("rb@{i}").as_bytes())
}

fn payload(i: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u32 ^ i.wrapping_mul(2_654_435_761)) as u8)
        .collect()
}

fn store(slots: usize, slot: usize, workers: usize) -> DaxStore {
    let mut c = StoreConfig::new(CoreConfig::new(ArenaSpec::memfd(slots * slot), slot));
    c.async_put_workers = 0;
    c.restore_workers = workers;
    c.restore_max_regions = workers;
    c.put_workers = workers;
    c.staging_slab_bytes = workers * slot.max(MIB);
    DaxStore::open(&c).unwrap()
}

/// A restore pins its slots, also on helper threads: a multi-region
/// restore (4 x 1 MiB slots, 4 restore threads, streaming path not taken) whose keys are all removed
/// and whose free slots are all refilled with other keys while `alloc`
/// runs still copies the removed keys' bytes; afterwards every slot is
/// reusable and no pin is left.
#[test]
fn restore_on_helpers_keeps_removed_slots_while_the_arena_is_refilled() {
    let n = 8u32;
    let s = store(2 * n as usize, MIB, 4);
    for i in 0..n {
        s.put(k(i), &payload(i, MIB)).unwrap();
    }
    let keys: Vec<Key> = (0..n).map(k).collect();
    let mut outs: Vec<Vec<u8>> = Vec::new();
    let got = s
        .restore_into(&keys, false, |rs| {
            for i in 0..n {
                assert!(s.remove(k(i)));
            }
            // Fill every free slot with other bytes.
            let mut j = 1000;
            while s.put(k(j), &payload(j, MIB)).is_ok() {
                j += 1;
            }
            assert_eq!(j - 1000, n, "only the n free slots were reusable");
            outs = rs.iter().map(|r| vec![0u8; r.len]).collect();
            Ok::<_, ()>(outs.iter_mut().map(|o| &mut o[..]).collect())
        })
        .unwrap();
    assert_eq!(got.len(), n as usize);
    for (i, o) in outs.iter().enumerate() {
        assert!(o == &payload(i as u32, MIB), "key {i}: removed key's bytes");
    }
    assert_eq!(s.core().status().borrowed_slot_count, 0);
    for i in 0..n {
        assert_eq!(s.put(k(i), &payload(i, MIB)).unwrap(), PutOutcome::Stored);
    }
    s.core().check_invariants().unwrap();
}

/// `close` from another thread while a restore is inside `alloc`
/// gives up after the drain timeout and leaves the mapping; the restore
/// then copies correct bytes (no fault) and the pins are dropped.
#[test]
fn close_timing_out_during_a_restore_leaves_the_mapping_for_it() {
    let s = store(4, MIB, 2);
    for i in 0..4 {
        s.put(k(i), &payload(i, MIB)).unwrap();
    }
    let keys: Vec<Key> = (0..4).map(k).collect();
    let mut outs: Vec<Vec<u8>> = Vec::new();
    let closed = AtomicBool::new(false);
    let got = std::thread::scope(|sc| {
        s.restore_into(&keys, false, |rs| {
            let t0 = Instant::now();
            sc.spawn(|| {
                s.close();
                closed.store(true, Ordering::SeqCst);
            })
            .join()
            .unwrap();
            assert!(
                t0.elapsed() >= Duration::from_secs(4),
                "close waited for the guard"
            );
            outs = rs.iter().map(|r| vec![0u8; r.len]).collect();
            Ok::<_, ()>(outs.iter_mut().map(|o| &mut o[..]).collect())
        })
    })
    .unwrap();
    assert!(closed.load(Ordering::SeqCst));
    assert_eq!(got.len(), 4);
    for (i, o) in outs.iter().enumerate() {
        assert!(o == &payload(i as u32, MIB), "key {i} intact after close");
    }
    assert!(matches!(s.put(k(9), &[1]), Err(StoreError::Closed)));
}

/// A panic in a `put_with_writer` writer (which goes on in the caller,
/// also for `put_batch_with` helpers) must not leave the slot WRITING
/// forever (the key "in flight" for good, every later put of it a no-op
/// `AlreadyPresent`, the slot never freed): `DaxCore::put_with` undoes the
/// put before the unwind goes on.
#[test]
fn a_panicking_writer_frees_its_slot_and_key() {
    let s = store(2, 4096, 1);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = s.put_with_writer(k(1), 100, 0, |_| panic!("writer panics"));
    }));
    assert!(r.is_err());
    let live = s.core().live_slot_count();
    let inflight = s.exists_in_put_tasks(k(1));
    let again = s.put(k(1), &payload(1, 100));
    assert!(
        live == 0 && !inflight && matches!(again, Ok(PutOutcome::Stored)),
        "after the panic: live slots {live}, key in flight {inflight}, re-put {again:?}"
    );
}

/// The same through `put_batch_with` on helper threads: the panic reaches
/// the caller, and the panicking item's key is not left wedged.
#[test]
fn a_panicking_batch_item_frees_its_slot_and_key() {
    let s = store(16, MIB, 4);
    let items: Vec<(Key, usize, u32)> = (0..8).map(|i| (k(i), MIB, 0)).collect();
    let data: Vec<Vec<u8>> = (0..8).map(|i| payload(i, MIB)).collect();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        s.put_batch_with(&items, |i, w| {
            assert!(i != 5, "item 5 panics");
            w.write(0, &data[i])
        })
    }));
    assert!(r.is_err(), "the helper's panic reaches the caller");
    let wedged = s.exists_in_put_tasks(k(5));
    let again = s.put(k(5), &data[5]);
    assert!(
        !wedged && matches!(again, Ok(PutOutcome::Stored)),
        "item 5 in flight forever: {wedged}, re-put {again:?}"
    );
}
