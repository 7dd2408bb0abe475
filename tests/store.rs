//! DaxStore (the non-MP facade): docs/lmcache-dax-behavior.md §8.4 scenarios on
//! memfd arenas.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use daxkv::device::arena::{ArenaSource, ArenaSpec};
use daxkv::{CoreConfig, DaxStore, Key, PutOutcome, StoreConfig, StoreError};

const SLOT: usize = 4096;

fn cfg(slots: usize) -> StoreConfig {
    let mut c = StoreConfig::new(CoreConfig::new(ArenaSpec::memfd(slots * SLOT), SLOT));
    c.restore_workers = 2;
    c.restore_max_regions = 2;
    c.staging_slab_bytes = 3 * SLOT;
    c
}

fn store(slots: usize) -> DaxStore {
    DaxStore::open(&cfg(slots)).unwrap()
}

fn k(i: u32) -> Key {
    Key::digest(format!("m@0@0@{i}").as_bytes())
}

fn payload(i: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u32 ^ i.wrapping_mul(2_654_435_761)) as u8)
        .collect()
}

#[test]
fn round_trip_with_tag() {
    let s = store(4);
    assert_eq!(
        s.put_tagged(k(1), &payload(1, 1000), 42).unwrap(),
        PutOutcome::Stored
    );
    let mut b = vec![0u8; 1000];
    assert_eq!(s.get(k(1), &mut b).unwrap(), Some(1000));
    assert_eq!(b, payload(1, 1000));
    assert_eq!(
        s.info(k(1)),
        Some((1000, 42)),
        "the stored format tag comes back"
    );
    assert_eq!(s.get_vec(k(1)).unwrap(), payload(1, 1000));
    assert_eq!(s.get(k(2), &mut b).unwrap(), None);
}

#[test]
fn oversized_put_and_short_buffers_are_errors_that_name_sizes() {
    let s = store(2);
    let e = s.put(k(1), &vec![0u8; SLOT + 5]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "object of 4101 bytes exceeds the slot size of 4096 bytes"
    );
    s.put(k(1), &payload(1, 100)).unwrap();
    let mut small = vec![7u8; 50];
    let e = s.get(k(1), &mut small).unwrap_err();
    assert_eq!(
        e.to_string(),
        "buffer of 50 bytes is too small for the 100 byte payload"
    );
    assert!(small.iter().all(|&b| b == 7), "untouched");
    let e = s
        .batched_get(&[k(1), k(2)], &mut [&mut [0u8; 4][..]])
        .unwrap_err();
    assert_eq!(e.to_string(), "batched_get: 2 keys but 1 buffers");
    assert_eq!(s.core().live_slot_count(), 1);
}

#[test]
fn config_errors_name_the_field_and_leak_no_fds() {
    fn fds() -> usize {
        std::fs::read_dir("/proc/self/fd").unwrap().count()
    }
    let before = fds();
    let mut c = cfg(2);
    c.staging_slab_bytes = SLOT;
    let e = DaxStore::open(&c).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid config: staging_slab_bytes must be at least restore_max_regions x slot_bytes = 8192 (got 4096)"
    );
    let mut c = cfg(2);
    c.restore_workers = 0;
    assert!(DaxStore::open(&c)
        .unwrap_err()
        .to_string()
        .contains("restore_workers must be a positive integer"));
    let mut c = cfg(2);
    c.core.arena = ArenaSpec::new(ArenaSource::Path("/nonexistent/dax0.0".into()), 2 * SLOT);
    assert!(DaxStore::open(&c)
        .unwrap_err()
        .to_string()
        .contains("/nonexistent/dax0.0"));
    for _ in 0..10 {
        let mut c = cfg(2);
        c.core.slot_bytes = 3 * SLOT;
        let _ = DaxStore::open(&c);
    }
    assert!(fds() <= before + 1, "fds {before} -> {}", fds());
}

#[test]
fn batched_get_has_positional_holes_and_prefix_stops_at_first_miss() {
    let s = store(8);
    for i in [0, 1, 3] {
        s.put(k(i), &payload(i, 200)).unwrap();
    }
    let keys: Vec<Key> = (0..4).map(k).collect();
    let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; 200]; 4];
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(
        s.batched_get(&keys, &mut refs).unwrap(),
        vec![Some(200), Some(200), None, Some(200)]
    );
    assert_eq!(bufs[3], payload(3, 200));
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(s.batched_get_prefix(&keys, &mut refs).unwrap(), 2);
    assert_eq!(s.batched_contains(&keys, false), 2);
}

#[test]
fn batched_restore_handles_heterogeneous_sizes_and_holes() {
    let s = store(16);
    // Full chunks and short tails, stored out of order so slots interleave.
    let sizes = [SLOT, SLOT, 1000, SLOT, 17, SLOT, SLOT, 2048];
    for (i, &n) in sizes.iter().enumerate().rev() {
        s.put(k(i as u32), &payload(i as u32, n)).unwrap();
    }
    let mut keys: Vec<Key> = (0..8).map(k).collect();
    keys.insert(3, k(99)); // a miss in the middle
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; SLOT]).collect();
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = s.batched_restore(&keys, &mut refs).unwrap();
    let mut want: Vec<Option<usize>> = sizes.iter().map(|&n| Some(n)).collect();
    want.insert(3, None);
    assert_eq!(got, want);
    for (j, key_i) in [0u32, 1, 2, 99, 3, 4, 5, 6, 7].iter().enumerate() {
        if *key_i != 99 {
            let n = sizes[*key_i as usize];
            assert_eq!(&bufs[j][..n], &payload(*key_i, n)[..], "key {key_i}");
        }
    }
    // Concurrent restores from two threads serialize on the slab and agree.
    let s = Arc::new(s);
    let hs: Vec<_> = (0..2)
        .map(|_| {
            let s = s.clone();
            std::thread::spawn(move || {
                for _ in 0..20 {
                    let keys: Vec<Key> = (0..8).map(k).collect();
                    let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; SLOT]; 8];
                    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                    let got = s.batched_restore(&keys, &mut refs).unwrap();
                    for i in 0..8 {
                        assert_eq!(got[i], Some(sizes[i]));
                        assert_eq!(&bufs[i][..sizes[i]], &payload(i as u32, sizes[i])[..]);
                    }
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn pins_are_refcounted_and_never_auto_evicted() {
    let mut c = cfg(2);
    c.auto_evict = true;
    let s = DaxStore::open(&c).unwrap();
    s.put(k(1), b"one").unwrap();
    s.put(k(2), b"two").unwrap();
    assert!(s.pin(k(1)));
    assert!(s.pin(k(1)), "overlapping pins");
    assert!(s.unpin(k(1)), "still exists after one unpin");
    // Full: auto-evict must pick key 2 (key 1 is pinned).
    assert_eq!(s.put(k(3), b"three").unwrap(), PutOutcome::Stored);
    assert!(s.contains(k(1), false));
    assert!(!s.contains(k(2), false));
    assert!(s.unpin(k(1)));
    // Pin both remaining keys: nothing evictable, so the put fails.
    assert!(s.pin(k(1)) && s.pin(k(3)));
    assert!(matches!(s.put(k(4), b"four"), Err(StoreError::Full)));
}

#[test]
fn full_arena_without_auto_evict_is_an_error() {
    let s = store(1);
    s.put(k(1), b"a").unwrap();
    let e = s.put(k(2), b"b").unwrap_err();
    assert_eq!(e.to_string(), "no free slots available; eviction required");
}

#[test]
fn remove_is_forced_by_default() {
    let s = store(2);
    s.put(k(1), b"a").unwrap();
    s.put(k(2), b"b").unwrap();
    assert!(s.pin(k(1)));
    assert!(
        !s.remove_with(k(1), false),
        "a pinned key survives an unforced remove"
    );
    assert!(s.remove(k(1)), "the default remove is forced");
    assert_eq!(s.batched_remove(&[k(1), k(2), k(3)]), 1);
    assert_eq!(s.core().live_slot_count(), 0);
    s.core().check_invariants().unwrap();
}

#[test]
fn remove_during_a_read_finishes_and_defers_slot_reuse() {
    let s = store(1);
    s.put(k(1), &payload(1, 64)).unwrap();
    let set = s.core().reserve_reads(&[k(1)], false);
    assert!(s.remove(k(1)), "remove does not wait for the read");
    assert!(
        matches!(s.put(k(2), b"x"), Err(StoreError::Full)),
        "no free slot until the read finishes"
    );
    let mut out = vec![0u8; 64];
    assert_eq!(set.read(&set.items()[0], &mut out), Some(64));
    assert_eq!(out, payload(1, 64));
    drop(set);
    assert_eq!(s.put(k(2), b"x").unwrap(), PutOutcome::Stored);
}

#[test]
fn async_put_completes_through_the_callback_and_close_waits_for_it() {
    let s = store(8);
    let (tx, rx) = mpsc::channel();
    for i in 0..4 {
        let tx = tx.clone();
        s.put_async(k(i), payload(i, 500).into(), move |r| {
            tx.send((i, r.is_ok())).unwrap();
        })
        .unwrap();
    }
    let e = s
        .put_async(k(9), vec![0u8; SLOT + 1].into(), |_| {
            panic!("oversized put must not run")
        })
        .unwrap_err();
    assert!(matches!(e, StoreError::TooLarge { .. }));
    let mut seen: Vec<(u32, bool)> = (0..4)
        .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..4).map(|i| (i, true)).collect::<Vec<_>>());
    for i in 0..4 {
        assert_eq!(s.get_vec(k(i)).unwrap(), payload(i, 500));
    }
    // close waits for a queued slow async put.
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    s.put_async(k(20), payload(20, 10).into(), move |_| {
        std::thread::sleep(Duration::from_millis(100));
        d.store(true, Ordering::SeqCst);
    })
    .unwrap();
    s.close();
    assert!(
        done.load(Ordering::SeqCst),
        "close returned before the async put finished"
    );
    assert!(matches!(s.put(k(1), b"x"), Err(StoreError::Closed)));
    assert!(matches!(
        s.put_async(k(1), vec![1u8].into(), |_| ()),
        Err(StoreError::Closed)
    ));
    assert_eq!(
        s.get(k(1), &mut [0u8; 500]).unwrap(),
        None,
        "gets after close are misses"
    );
    // Batched reads after close are an error (a caller indexes their
    // result by position; an empty vector would make it panic).
    let mut b = [0u8; 500];
    assert!(matches!(
        s.batched_get(&[k(1)], &mut [&mut b[..]]),
        Err(StoreError::Closed)
    ));
    assert!(matches!(
        s.batched_get_prefix(&[k(1)], &mut [&mut b[..]]),
        Err(StoreError::Closed)
    ));
    assert!(matches!(
        s.batched_restore(&[k(1)], &mut [&mut b[..]]),
        Err(StoreError::Closed)
    ));
    s.close();
}

#[test]
fn close_waits_for_an_active_get() {
    let s = Arc::new(store(2));
    s.put(k(1), &payload(1, 100)).unwrap();
    let set_taken = Arc::new(std::sync::Barrier::new(2));
    let closed = Arc::new(AtomicBool::new(false));
    let reader = {
        let (s, b, closed) = (s.clone(), set_taken.clone(), closed.clone());
        std::thread::spawn(move || {
            let set = s.core().reserve_reads(&[k(1)], false);
            b.wait();
            std::thread::sleep(Duration::from_millis(100));
            assert!(
                !closed.load(Ordering::SeqCst),
                "close finished during the read"
            );
            let mut out = vec![0u8; 100];
            assert_eq!(set.read(&set.items()[0], &mut out), Some(100));
            assert_eq!(out, payload(1, 100));
        })
    };
    set_taken.wait();
    s.close();
    closed.store(true, Ordering::SeqCst);
    reader.join().unwrap();
}

#[test]
fn multithreaded_put_get_smoke() {
    let s = Arc::new(store(256));
    let ok = Arc::new(AtomicUsize::new(0));
    let hs: Vec<_> = (0..4u32)
        .map(|t| {
            let (s, ok) = (s.clone(), ok.clone());
            std::thread::spawn(move || {
                for i in 0..200u32 {
                    let id = t * 1000 + i % 50;
                    let _ = s.put(k(id), &payload(id, 300));
                    if let Some(v) = s.get_vec(k(id)) {
                        assert_eq!(v, payload(id, 300));
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    if i % 7 == 0 {
                        s.remove(k(id));
                    }
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert!(ok.load(Ordering::Relaxed) > 0);
    s.core().check_invariants().unwrap();
}

// ----- callbacks on put workers -----

/// Run `f` on a helper thread; fail (instead of hanging) if it does not
/// finish within 30 s (a hang guard, not a timing assertion).
fn within_watchdog<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{what}: hung or panicked ({e})"))
}

/// An `on_complete` that drops the last `Arc<DaxStore>` closes the store on
/// its own put worker: the close must not join that worker (std panics
/// joining a thread with itself, which would kill the worker mid-close).
#[test]
fn put_async_callback_dropping_the_last_store_closes_it() {
    let mut c = cfg(4);
    c.async_put_workers = 2;
    let s = Arc::new(DaxStore::open(&c).unwrap());
    let core_seen = Arc::new(AtomicBool::new(false));
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<bool>();
    let mine = s.clone();
    let seen = core_seen.clone();
    s.put_async(k(1), payload(1, 100).into(), move |r| {
        assert!(r.is_ok());
        go_rx.recv().unwrap();
        // The last handle: dropping it runs close() here.
        drop(mine);
        seen.store(true, Ordering::SeqCst);
        done_tx.send(true).unwrap();
    })
    .unwrap();
    drop(s);
    go_tx.send(()).unwrap();
    let closed = within_watchdog("the callback's close", move || done_rx.recv().unwrap());
    assert!(closed && core_seen.load(Ordering::SeqCst));
}

/// A panicking `on_complete` is logged; the put worker keeps serving (a
/// panic that killed the only worker would leave later async puts never
/// run).
#[test]
fn a_panicking_on_complete_keeps_the_put_worker() {
    let s = Arc::new(store(4)); // one async put worker
    s.put_async(k(1), payload(1, 100).into(), |_| panic!("callback fails"))
        .unwrap();
    let (tx, rx) = mpsc::channel();
    s.put_async(k(2), payload(2, 100).into(), move |r| {
        tx.send(r.is_ok()).unwrap();
    })
    .unwrap();
    let ok = within_watchdog("the next async put", move || rx.recv().unwrap());
    assert!(ok);
    assert!(s.contains(k(1), false) && s.contains(k(2), false));
    let s2 = s.clone();
    within_watchdog("close", move || s2.close());
}

/// `close` called from an `on_complete` returns (the calling worker is
/// not joined) and the store is closed.
#[test]
fn close_from_on_complete_returns() {
    let s = Arc::new(store(4));
    let (tx, rx) = mpsc::channel();
    let s2 = s.clone();
    s.put_async(k(1), payload(1, 100).into(), move |_| {
        s2.close();
        tx.send(()).unwrap();
    })
    .unwrap();
    within_watchdog("close from on_complete", move || rx.recv().unwrap());
    assert!(matches!(
        s.put(k(2), &payload(2, 10)),
        Err(StoreError::Closed)
    ));
}

// ----- restore_into (the non-MP backend's Rust restore) -----

/// A store of `slots` slots of `slot` bytes, restores on 2 threads in
/// regions of at most `region` bytes.
fn restore_store(slots: usize, slot: usize, region: usize) -> DaxStore {
    let mut c = StoreConfig::new(CoreConfig::new(ArenaSpec::memfd(slots * slot), slot));
    c.async_put_workers = 0;
    c.restore_workers = 2;
    c.restore_max_regions = 2;
    c.staging_slab_bytes = 2 * region;
    DaxStore::open(&c).unwrap()
}

/// Heterogeneous payloads (full slots and tails), stored out of order, a
/// miss in the middle: the outputs are allocated after the reservation
/// (sized from it, as LMCache allocates by stored shape), filled straight
/// from the device on two `dax-restore-*` threads, and bytes past each
/// payload are untouched. Prefix-only stops at the miss.
#[test]
fn restore_into_fills_outputs_allocated_after_the_reservation() {
    const MIB: usize = 1 << 20;
    let s = restore_store(12, MIB, 3 * MIB);
    let sizes = [MIB, MIB, 4096, MIB, MIB, 17, MIB, MIB];
    for (i, &n) in sizes.iter().enumerate().rev() {
        s.put_tagged(k(i as u32), &payload(i as u32, n), 100 + i as u32)
            .unwrap();
    }
    let mut keys: Vec<Key> = (0..8).map(k).collect();
    keys.insert(3, k(99));
    let mut outs: Vec<Vec<u8>> = Vec::new();
    let got = s
        .restore_into(&keys, false, |rs| {
            // Tags come back with the reservation, in key order.
            let tags: Vec<u32> = rs.iter().map(|r| r.meta).collect();
            assert_eq!(tags, (100..108).collect::<Vec<u32>>());
            outs = rs.iter().map(|r| vec![0xEE; r.len + 3]).collect();
            Ok::<_, String>(outs.iter_mut().map(|o| &mut o[..]).collect())
        })
        .unwrap();
    let idx: Vec<usize> = got.iter().map(|r| r.index).collect();
    assert_eq!(idx, vec![0, 1, 2, 4, 5, 6, 7, 8], "position 3 is a hole");
    for (j, r) in got.iter().enumerate() {
        let i = (j) as u32;
        assert_eq!(r.len, sizes[j]);
        assert_eq!(&outs[j][..r.len], &payload(i, r.len)[..], "key {i}");
        assert_eq!(&outs[j][r.len..], &[0xEE; 3], "bytes past the payload");
    }
    let pre = s
        .restore_into(&keys, true, |rs| {
            outs = rs.iter().map(|r| vec![0; r.len]).collect();
            Ok::<_, String>(outs.iter_mut().map(|o| &mut o[..]).collect())
        })
        .unwrap();
    assert_eq!(pre.len(), 3, "prefix-only stops at the first miss");
    let st = s.core().status();
    assert_eq!(st.borrowed_slot_count, 0, "every read pin was dropped");
    s.core().check_invariants().unwrap();
}

/// The remove-during-restore interleaving: a key removed (forced) after its
/// slot was reserved, while the outputs are being allocated, keeps its slot:
/// a put into the full arena fails until the restore returns, the restored
/// bytes are the removed key's, and the slot is reusable afterwards. Without
/// the read pin the remove would free the slot, the put would reuse it and
/// the restore would copy the new key's bytes (or a torn mix) out.
#[test]
fn restore_into_keeps_a_removed_keys_slot_until_it_returns() {
    let s = restore_store(1, SLOT, SLOT);
    s.put(k(1), &payload(1, SLOT)).unwrap();
    let mut out = vec![0u8; SLOT];
    let got = s
        .restore_into(&[k(1)], false, |_| {
            assert!(s.remove(k(1)), "remove does not wait for the restore");
            assert!(!s.contains(k(1), false));
            assert!(
                matches!(s.put(k(2), &payload(2, SLOT)), Err(StoreError::Full)),
                "the removed key's slot is still borrowed"
            );
            Ok::<_, String>(vec![&mut out[..]])
        })
        .unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(out, payload(1, SLOT), "the removed key's bytes, intact");
    assert_eq!(
        s.put(k(2), &payload(2, SLOT)).unwrap(),
        PutOutcome::Stored,
        "the slot is free once the restore returned"
    );
    s.core().check_invariants().unwrap();
}

/// A failed allocation, a short destination or a wrong count copy nothing
/// and drop every read pin; the keys stay readable. After close: `Closed`.
#[test]
fn restore_into_errors_copy_nothing_and_release_the_pins() {
    let s = restore_store(4, SLOT, SLOT);
    s.put(k(1), &payload(1, 100)).unwrap();
    s.put(k(2), &payload(2, 200)).unwrap();
    let keys = [k(1), k(2)];
    let e = s
        .restore_into(&keys, false, |_| Err::<Vec<&mut [u8]>, _>("no memory"))
        .unwrap_err();
    assert!(matches!(e, daxkv::RestoreError::Alloc("no memory")));
    let (mut a, mut b) = (vec![7u8; 100], vec![7u8; 199]);
    let e = s
        .restore_into(&keys, false, |_| {
            Ok::<_, String>(vec![&mut a[..], &mut b[..]])
        })
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "destination for key 1 is 199 bytes, too small for its 200 byte payload"
    );
    assert!(a.iter().all(|&x| x == 7), "nothing copied");
    let e = s
        .restore_into(&keys, false, |_| Ok::<_, ()>(vec![&mut a[..]]))
        .unwrap_err();
    assert!(matches!(
        e,
        daxkv::RestoreError::Destinations { want: 2, got: 1 }
    ));
    assert_eq!(s.core().status().borrowed_slot_count, 0);
    assert!(s.contains(k(1), false) && s.contains(k(2), false));
    // A miss calls no allocator.
    let none = s
        .restore_into(&[k(9)], false, |_| -> Result<Vec<&mut [u8]>, ()> {
            panic!("alloc called for no hit")
        })
        .unwrap();
    assert!(none.is_empty());
    s.close();
    assert!(matches!(
        s.restore_into(&keys, false, |_| Ok::<_, ()>(Vec::new())),
        Err(daxkv::RestoreError::Closed)
    ));
}

/// `put_with_writer`: the writer runs while the key is in flight; a writer
/// that fails frees the slot; oversize and closed are errors.
#[test]
fn put_with_writer_runs_in_flight_and_a_failure_frees_the_slot() {
    let s = restore_store(1, SLOT, SLOT);
    let data = payload(3, 500);
    let r = s.put_with_writer(k(3), 500, 9, |w| {
        assert!(s.exists_in_put_tasks(k(3)), "in flight while writing");
        w.write(0, &data)
    });
    assert_eq!(r.unwrap(), PutOutcome::Stored);
    assert_eq!(s.info(k(3)), Some((500, 9)));
    assert!(s.remove(k(3)));
    let r = s.put_with_writer(k(4), 10, 0, |_| false);
    assert!(matches!(
        r,
        Err(StoreError::Put(daxkv::PutError::CopyFailed))
    ));
    assert_eq!(
        s.core().live_slot_count(),
        0,
        "the failed put freed its slot"
    );
    assert!(matches!(
        s.put_with_writer(k(5), SLOT + 1, 0, |_| true),
        Err(StoreError::TooLarge { .. })
    ));
    s.close();
    assert!(matches!(
        s.put_with_writer(k(5), 1, 0, |_| true),
        Err(StoreError::Closed)
    ));
}

/// `put_batch_with` in order: the items before the first one that finds
/// the arena full are stored, that one and the rest are not tried.
#[test]
fn put_batch_with_stops_at_the_first_full_item() {
    let s = store(3);
    s.put(k(0), b"x").unwrap();
    let items: Vec<(Key, usize, u32)> = (1..6).map(|i| (k(i), 100, i)).collect();
    let b = s.put_batch_with(&items, |i, w| w.write(0, &payload(i as u32 + 1, 100)));
    assert_eq!(b.full_at, Some(2));
    let stored: Vec<bool> = b
        .results
        .iter()
        .map(|r| matches!(r, Some(Ok(PutOutcome::Stored))))
        .collect();
    assert_eq!(stored, [true, true, false, false, false]);
    assert!(b.results[2..].iter().all(Option::is_none));
    assert_eq!(s.get_vec(k(2)).unwrap(), payload(2, 100));
    assert!(!s.contains(k(3), false));
    s.core().check_invariants().unwrap();
}

/// A batch of at least 2 MiB that fits is shared by the caller and
/// `put_workers - 1` `dax-put-*` threads: item 0's copy waits until another
/// item was copied by another thread (so the batch would hang if it were
/// not copied in parallel); every item is stored with its own bytes and
/// tag; present keys are no-ops; a batch that does not fit the free slots
/// runs in order on the caller (so exactly its prefix is stored).
#[test]
fn put_batch_with_copies_a_large_batch_on_several_threads() {
    const N: usize = 48;
    const LEN: usize = 64 << 10;
    let mut c = StoreConfig::new(CoreConfig::new(ArenaSpec::memfd(64 * LEN), LEN));
    c.put_workers = 3;
    let s = DaxStore::open(&c).unwrap();
    s.put(k(5), &payload(5, LEN)).unwrap();
    let srcs: Vec<Vec<u8>> = (0..N as u32).map(|i| payload(i, LEN)).collect();
    let items: Vec<(Key, usize, u32)> = (0..N as u32).map(|i| (k(i), LEN, i)).collect();
    let threads = std::sync::Mutex::new(std::collections::BTreeSet::new());
    let first = std::sync::Mutex::new(None);
    let other_done = AtomicBool::new(false);
    let b = s.put_batch_with(&items, |i, w| {
        let me = std::thread::current();
        threads
            .lock()
            .unwrap()
            .insert(me.name().unwrap_or("").to_string());
        if i == 0 {
            *first.lock().unwrap() = Some(me.id());
            let t0 = std::time::Instant::now();
            while !other_done.load(Ordering::SeqCst) {
                assert!(
                    t0.elapsed() < Duration::from_secs(20),
                    "no other thread copied"
                );
                std::thread::yield_now();
            }
        } else if *first.lock().unwrap() != Some(me.id()) {
            other_done.store(true, Ordering::SeqCst);
        }
        w.write(0, &srcs[i])
    });
    assert_eq!(b.full_at, None);
    for (i, r) in b.results.iter().enumerate() {
        let want = if i == 5 {
            PutOutcome::AlreadyPresent
        } else {
            PutOutcome::Stored
        };
        assert_eq!(*r.as_ref().unwrap().as_ref().unwrap(), want, "item {i}");
        assert_eq!(s.get_vec(k(i as u32)).unwrap(), srcs[i]);
        let tag = if i == 5 { 0 } else { i as u32 };
        assert_eq!(s.info(k(i as u32)).unwrap().1, tag);
    }
    let caller = std::thread::current().name().unwrap_or("").to_string();
    let threads = threads.into_inner().unwrap();
    assert!(threads.len() >= 2, "{threads:?}");
    assert!(
        threads
            .iter()
            .all(|t| *t == caller || t == "dax-put-1" || t == "dax-put-2"),
        "{threads:?}"
    );
    // 48 live, 16 free: a batch of 20 new keys runs in order.
    let items: Vec<(Key, usize, u32)> = (100..120).map(|i| (k(i), LEN, 0)).collect();
    let caller = std::thread::current().id();
    let b = s.put_batch_with(&items, |_, w| {
        assert_eq!(
            std::thread::current().id(),
            caller,
            "in order, on the caller"
        );
        w.write(0, &srcs[0])
    });
    assert_eq!(b.full_at, Some(16));
    assert!(b.results[..16]
        .iter()
        .all(|r| matches!(r, Some(Ok(PutOutcome::Stored)))));
    assert!(b.results[16..].iter().all(Option::is_none));
    s.core().check_invariants().unwrap();
}

/// The one way a batch on threads can see a full arena: another writer takes
/// a slot after the batch checked it fits. Here the first item's copy does
/// it (one slot), so exactly one item finds no slot. Whatever the
/// scheduling: `full_at` is that item, every item before it was tried, and
/// each result matches what the store holds (no slot leaked, none lost).
#[test]
fn put_batch_with_on_threads_racing_another_writer_stays_consistent() {
    const N: usize = 32;
    const LEN: usize = 128 << 10;
    let mut c = StoreConfig::new(CoreConfig::new(ArenaSpec::memfd(N * LEN), LEN));
    c.put_workers = 2;
    let s = DaxStore::open(&c).unwrap();
    let src = payload(1, LEN);
    let items: Vec<(Key, usize, u32)> = (0..N as u32).map(|i| (k(i), LEN, 0)).collect();
    let intruder = AtomicBool::new(false);
    let b = s.put_batch_with(&items, |i, w| {
        if i == 0 && !intruder.swap(true, Ordering::SeqCst) {
            assert_eq!(s.put(k(1000), b"x").unwrap(), PutOutcome::Stored);
        }
        w.write(0, &src)
    });
    let full = b.full_at.expect("one item found the arena full");
    assert!(
        b.results[..full].iter().all(Option::is_some),
        "all tried before it"
    );
    assert!(b.results[full].is_none());
    for (i, r) in b.results.iter().enumerate() {
        let stored = matches!(r, Some(Ok(PutOutcome::Stored)));
        assert_eq!(s.contains(k(i as u32), false), stored, "item {i}");
    }
    let stored = b.results.iter().flatten().count();
    assert_eq!(s.core().live_slot_count(), stored + 1);
    s.core().check_invariants().unwrap();
}

/// A restore of at least `RESTORE_STREAM_MIN_BYTES` writes its outputs
/// with streaming stores: odd lengths into odd-aligned destinations come
/// back exact, and the bytes around each output are untouched.
#[test]
fn restore_into_a_large_batch_streams_into_unaligned_outputs() {
    const MIB: usize = 1 << 20;
    let n = daxkv::store::RESTORE_STREAM_MIN_BYTES / MIB + 2;
    let s = restore_store(n, MIB, 4 * MIB);
    let sizes: Vec<usize> = (0..n).map(|i| MIB - i * 4097).collect();
    for (i, &len) in sizes.iter().enumerate() {
        s.put(k(i as u32), &payload(i as u32, len)).unwrap();
    }
    // One buffer; output i starts at an odd offset with guard bytes around.
    let mut starts = Vec::new();
    let mut at = 3;
    for &len in &sizes {
        starts.push(at);
        at += len + 5;
    }
    let mut big = vec![0xA5u8; at];
    let keys: Vec<Key> = (0..n as u32).map(k).collect();
    s.restore_into(&keys, false, |rs| {
        assert_eq!(rs.len(), n);
        let mut outs = Vec::new();
        let mut rest = &mut big[..];
        let mut done = 0;
        for (&st, &len) in starts.iter().zip(&sizes) {
            let (_, tail) = rest.split_at_mut(st - done);
            let (out, tail) = tail.split_at_mut(len);
            outs.push(out);
            rest = tail;
            done = st + len;
        }
        Ok::<_, String>(outs)
    })
    .unwrap();
    let mut prev_end = 0;
    for (i, (&st, &len)) in starts.iter().zip(&sizes).enumerate() {
        assert!(
            big[prev_end..st].iter().all(|&b| b == 0xA5),
            "guard before {i}"
        );
        assert_eq!(
            &big[st..st + len],
            &payload(i as u32, len)[..],
            "output {i}"
        );
        prev_end = st + len;
    }
    assert!(big[prev_end..].iter().all(|&b| b == 0xA5));
}

// ----- closers are serialized; accepted jobs complete -----

/// Queue `n` async puts behind a first one whose callback waits for
/// `gate`; every result lands in `results` (in completion order).
fn queue_behind_a_gate(
    s: &DaxStore,
    n: u32,
    gate: mpsc::Receiver<()>,
    results: &Arc<std::sync::Mutex<Vec<Result<PutOutcome, StoreError>>>>,
) {
    let r = results.clone();
    s.put_async(k(0), payload(0, 100).into(), move |res| {
        gate.recv().unwrap();
        r.lock().unwrap().push(res);
    })
    .unwrap();
    for i in 1..=n {
        let r = results.clone();
        s.put_async(k(i), payload(i, 100).into(), move |res| {
            r.lock().unwrap().push(res);
        })
        .unwrap();
    }
}

/// Two closers race while accepted `put_async` jobs are queued: the
/// second `close` must wait for the first (not return at once and close
/// the core under the queue), and every accepted job completes with `Ok`
/// before either returns. A second close that returned at once and
/// closed the core would fail with "jobs done when the second close
/// returned: 0 of 201", then every queued put would end `Err(Closed)`.
#[test]
fn a_second_close_waits_for_the_first_and_accepted_puts_complete() {
    const N: u32 = 200;
    let s = Arc::new(store(256)); // one async put worker
    let results = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (gate_tx, gate_rx) = mpsc::channel();
    queue_behind_a_gate(&s, N, gate_rx, &results);
    let first = {
        let s = s.clone();
        std::thread::spawn(move || s.close())
    };
    // The first close has begun once puts are refused.
    within_watchdog("the first close to begin", {
        let s = s.clone();
        move || {
            while !matches!(s.put(k(9999), &[1]), Err(StoreError::Closed)) {
                std::thread::yield_now();
            }
        }
    });
    let second = {
        let (s, results) = (s.clone(), results.clone());
        std::thread::spawn(move || {
            s.close();
            results.lock().unwrap().len()
        })
    };
    // Give the second closer time to reach `close` (a schedule aid: the
    // assertions below hold on any schedule).
    std::thread::sleep(Duration::from_millis(50));
    gate_tx.send(()).unwrap();
    let done_at_second = within_watchdog("the second close", move || second.join().unwrap());
    within_watchdog("the first close", move || first.join().unwrap());
    let results = results.lock().unwrap();
    eprintln!(
        "jobs done when the second close returned: {done_at_second} of {}",
        N + 1
    );
    assert_eq!(
        done_at_second,
        N as usize + 1,
        "the second close returned before the first had finished"
    );
    let failed: Vec<_> = results.iter().filter(|r| r.is_err()).collect();
    assert!(
        failed.is_empty(),
        "{} accepted puts failed, first {:?}",
        failed.len(),
        failed[0]
    );
    assert!(s.core().is_closing(), "closed");
}

/// `close` from an `on_complete` with jobs queued behind it (one worker:
/// only this worker could run them) runs them before the core closes:
/// every accepted job completes `Ok`, none `Err(Closed)`.
#[test]
fn close_from_on_complete_runs_the_puts_queued_behind_it() {
    const N: u32 = 50;
    let s = Arc::new(store(256)); // one async put worker
    let results = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (gate_tx, gate_rx) = mpsc::channel::<()>();
    let (closed_tx, closed_rx) = mpsc::channel();
    {
        let s2 = s.clone();
        s.put_async(k(0), payload(0, 100).into(), move |res| {
            gate_rx.recv().unwrap();
            assert!(res.is_ok());
            s2.close();
            closed_tx.send(()).unwrap();
        })
        .unwrap();
    }
    for i in 1..=N {
        let r = results.clone();
        s.put_async(k(i), payload(i, 100).into(), move |res| {
            r.lock().unwrap().push(res);
        })
        .unwrap();
    }
    gate_tx.send(()).unwrap();
    within_watchdog("close from on_complete", move || closed_rx.recv().unwrap());
    let results = results.lock().unwrap();
    assert_eq!(results.len(), N as usize, "every queued put ran");
    assert!(
        results.iter().all(Result::is_ok),
        "queued puts failed: {:?}",
        results
            .iter()
            .filter(|r| r.is_err())
            .take(3)
            .collect::<Vec<_>>()
    );
    assert!(s.core().is_closing());
}

/// `close` called from a `put_with_writer` writer (a binding's hook runs
/// there, while the put holds the device): it cannot wait for the put it
/// is inside, so it refuses new work and returns at once; the mapping
/// goes when the store drops. Failed with a close that waited for every
/// guard: the writer's own kept it waiting the whole drain timeout (5 s)
/// before it gave up.
#[test]
fn close_from_a_put_writer_returns_at_once() {
    let s = Arc::new(store(4));
    let s2 = s.clone();
    let took = within_watchdog("close from a writer", move || {
        let s3 = s2.clone();
        let mut took = Duration::ZERO;
        let _ = s2.put_with_writer(k(1), 100, 0, |w| {
            let t = std::time::Instant::now();
            s3.close();
            took = t.elapsed();
            w.write(0, &payload(1, 100))
        });
        took
    });
    assert!(
        took < Duration::from_secs(1),
        "close in a writer took {took:?}"
    );
    assert!(matches!(
        s.put(k(2), &payload(2, 10)),
        Err(StoreError::Closed)
    ));
    assert_eq!(s.get_vec(k(1)), None);
}

/// A remap from inside a `put_with_writer` writer (the thread holds the
/// device for the put) cannot wait for its own put: it is refused at
/// once as busy, nothing changed. Failed with a remap that waited for
/// every guard: the writer's own held it the whole drain timeout (5 s).
#[test]
fn remap_from_a_put_writer_is_busy_at_once() {
    let c = StoreConfig::new(CoreConfig::new(
        ArenaSpec::memfd(4 * SLOT).max_size_bytes(8 * SLOT),
        SLOT,
    ));
    let s = Arc::new(DaxStore::open(&c).unwrap());
    let s2 = s.clone();
    let (took, r) = within_watchdog("remap from a writer", move || {
        let mut out = (Duration::ZERO, String::new());
        let put = s2.put_with_writer(k(1), 100, 0, |w| {
            let t = std::time::Instant::now();
            let r = s2.core().remap(8 * SLOT);
            out = (t.elapsed(), format!("{r:?}"));
            w.write(0, &payload(1, 100))
        });
        assert!(put.is_ok(), "{put:?}");
        out
    });
    assert!(
        took < Duration::from_secs(1),
        "remap in a writer took {took:?}: {r}"
    );
    assert!(r.contains("Busy"), "{r}");
    assert_eq!(s.core().arena_bytes(), 4 * SLOT, "nothing changed");
    assert_eq!(s.get_vec(k(1)).as_deref(), Some(&payload(1, 100)[..]));
}
