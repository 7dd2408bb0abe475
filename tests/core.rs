//! DaxCore scenarios: docs/lmcache-dax-behavior.md §8.4 (core level) and §8.1
//! (lock refcount, borrowed delete, full arena, close blocking on a load,
//! volatile restart), on real memfd / tmpfs mappings.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use daxkv::device::arena::{ArenaSource, ArenaSpec};
use daxkv::{CoreConfig, DaxCore, Key, OpenError, PutError, PutFromPtrResult, PutOutcome};

const SLOT: usize = 4096;

fn core(slots: usize) -> DaxCore {
    DaxCore::open(&CoreConfig::new(ArenaSpec::memfd(slots * SLOT), SLOT)).unwrap()
}

fn k(i: u32) -> Key {
    Key::digest(format!("model@0@0@{i:08x}").as_bytes())
}

fn payload(i: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u32).wrapping_mul(31).wrapping_add(i) as u8)
        .collect()
}

#[test]
fn round_trip_and_restore_is_a_no_op() {
    let c = core(4);
    let data = payload(1, 3000);
    assert_eq!(c.put(k(1), &data, 7), Ok(PutOutcome::Stored));
    assert_eq!(
        c.put(k(1), &payload(9, 10), 0),
        Ok(PutOutcome::AlreadyPresent),
        "second put is a no-op"
    );
    let mut buf = vec![0xEEu8; SLOT];
    assert_eq!(c.load_into(k(1), &mut buf), Some(3000));
    assert_eq!(&buf[..3000], &data[..]);
    assert!(
        buf[3000..].iter().all(|&b| b == 0xEE),
        "bytes beyond the payload untouched"
    );
    assert_eq!(c.payload_len(k(1)), Some((3000, 7)));
    assert_eq!(c.live_slot_count(), 1);
    c.check_invariants().unwrap();
}

#[test]
fn oversized_put_names_both_sizes_and_leaks_nothing() {
    let c = core(2);
    let e = c.put(k(1), &vec![0u8; SLOT + 1], 0).unwrap_err();
    assert_eq!(
        e,
        PutError::TooLarge {
            len: SLOT + 1,
            slot_bytes: SLOT
        }
    );
    assert!(
        e.to_string().contains("4097") && e.to_string().contains("4096"),
        "{e}"
    );
    let big = vec![0u8; SLOT + 1];
    let small = vec![1u8; 10];
    assert_eq!(
        c.put_many(&[k(1), k(2)], &[&big, &small]).unwrap(),
        vec![false, true]
    );
    assert_eq!(c.live_slot_count(), 1);
    c.check_invariants().unwrap();
}

#[test]
fn unequal_lengths_are_an_error_that_names_the_counts() {
    let c = core(2);
    let e = c.put_many(&[k(1), k(2)], &[&[1u8][..]]).unwrap_err();
    assert_eq!(e.to_string(), "put_many: 2 keys but 1 buffers");
    let mut b = [0u8; 4];
    let e = c
        .load_many_into(&[k(1)], &mut [&mut b[..], &mut [0u8; 1][..]])
        .unwrap_err();
    assert!(e.to_string().contains("load_many_into"), "{e}");
    assert_eq!(c.live_slot_count(), 0);
}

#[test]
fn lookup_lock_is_a_refcount() {
    let c = core(4);
    c.put(k(1), b"x", 0).unwrap();
    assert_eq!(c.exists_many(&[k(1), k(2)], true), vec![true, false]);
    assert_eq!(c.exists_many(&[k(1)], true), vec![true]);
    assert_eq!(c.lock_count(k(1)), 2);
    assert_eq!(
        c.status().locked_key_count,
        1,
        "distinct locked keys, not the sum"
    );
    assert_eq!(
        c.delete_many(&[k(1)], false),
        vec![false],
        "locked keys are skipped"
    );
    c.unlock_many(&[k(1)]);
    assert_eq!(
        c.delete_many(&[k(1)], false),
        vec![false],
        "one lock still held"
    );
    c.unlock_many(&[k(1), k(2)]);
    c.unlock_many(&[k(1)]); // unlocking an unlocked key does nothing
    assert_eq!(c.delete_many(&[k(1)], false), vec![true]);
    assert!(!c.exists(k(1), false));
    c.check_invariants().unwrap();
}

#[test]
fn delete_of_a_borrowed_slot_is_deferred_to_the_last_reader() {
    let c = core(2);
    c.put(k(1), b"hello", 0).unwrap();
    let set = c.reserve_reads(&[k(1)], false);
    assert_eq!(set.len(), 1);
    assert_eq!(c.delete_many(&[k(1)], false), vec![true]);
    assert!(
        !c.exists(k(1), false),
        "deleted keys leave the index at once"
    );
    assert_eq!(c.usage(), (0.5, 0.0));
    let st = c.status();
    assert_eq!(
        (
            st.live_slot_count,
            st.borrowed_slot_count,
            st.pending_free_slot_count
        ),
        (1, 1, 1)
    );
    // The reader still sees its bytes.
    let mut out = [0u8; 5];
    assert_eq!(set.read(&set.items()[0], &mut out), Some(5));
    assert_eq!(&out, b"hello");
    // No free slot while the read is in progress (1 of 2 is pending).
    c.put(k(2), b"a", 0).unwrap();
    assert_eq!(
        c.put(k(3), b"b", 0),
        Err(PutError::Full),
        "pending slot not reused early"
    );
    drop(set);
    assert_eq!(c.put(k(3), b"b", 0), Ok(PutOutcome::Stored));
    assert_eq!(c.usage(), (1.0, 1.0));
    c.check_invariants().unwrap();
}

#[test]
fn full_arena_fails_without_internal_eviction() {
    let c = core(2);
    assert_eq!(
        c.put_many(&[k(1), k(2), k(3)], &[b"a", b"b", b"c"])
            .unwrap(),
        vec![true, true, false]
    );
    assert_eq!(c.put(k(3), b"c", 0), Err(PutError::Full));
    assert_eq!(
        c.put(k(3), b"c", 0).unwrap_err().to_string(),
        "no free slots available; eviction required"
    );
    assert!((c.usage().0 - 1.0).abs() < f64::EPSILON);
    assert_eq!(
        c.exists_many(&[k(1), k(2), k(3)], true),
        vec![true, true, false]
    );
    c.check_invariants().unwrap();
}

#[test]
fn load_reports_misses_and_short_buffers_positionally() {
    let c = core(4);
    c.put(k(1), &payload(1, 100), 0).unwrap();
    c.put(k(3), &payload(3, 100), 0).unwrap();
    let mut hit = vec![0u8; 100];
    let mut miss = vec![0x11u8; 100];
    let mut short = vec![0x22u8; 99];
    let r = c
        .load_many_into(&[k(1), k(2), k(3)], &mut [&mut hit, &mut miss, &mut short])
        .unwrap();
    assert_eq!(r, vec![true, false, false]);
    assert_eq!(hit, payload(1, 100));
    assert!(miss.iter().all(|&x| x == 0x11), "miss buffer untouched");
    assert!(short.iter().all(|&x| x == 0x22), "short buffer untouched");
    // Positional holes vs prefix only.
    let pos: Vec<usize> = c
        .reserve_reads(&[k(1), k(2), k(3)], false)
        .items()
        .iter()
        .map(|r| r.index)
        .collect();
    assert_eq!(pos, vec![0, 2]);
    assert_eq!(c.reserve_reads(&[k(1), k(2), k(3)], true).len(), 1);
    assert_eq!(
        c.status().active_read_count,
        0,
        "read sets finalize on drop"
    );
    c.check_invariants().unwrap();
}

#[test]
fn in_flight_keys_are_misses_and_second_put_is_a_no_op() {
    let c = Arc::new(core(4));
    let inside = Arc::new(Barrier::new(2));
    let release = Arc::new(Barrier::new(2));
    let t = {
        let (c, inside, release) = (c.clone(), inside.clone(), release.clone());
        std::thread::spawn(move || {
            c.put_with_writer(k(1), 8, 0, |w| {
                inside.wait();
                release.wait();
                w.write(0, b"12345678")
            })
        })
    };
    inside.wait();
    assert!(c.has_inflight(k(1)));
    assert_eq!(
        c.exists_many(&[k(1)], false),
        vec![false],
        "in-flight is a miss"
    );
    assert_eq!(c.put(k(1), b"other", 0), Ok(PutOutcome::AlreadyPresent));
    assert_eq!(
        c.delete_many(&[k(1)], false),
        vec![false],
        "in-flight skipped without force"
    );
    release.wait();
    assert_eq!(t.join().unwrap(), Ok(PutOutcome::Stored));
    let mut b = [0u8; 8];
    assert_eq!(c.load_into(k(1), &mut b), Some(8));
    assert_eq!(&b, b"12345678");
    c.check_invariants().unwrap();
}

#[test]
fn forced_delete_of_an_in_flight_key_reclaims_its_slot() {
    let c = Arc::new(core(1));
    let inside = Arc::new(Barrier::new(2));
    let release = Arc::new(Barrier::new(2));
    let t = {
        let (c, inside, release) = (c.clone(), inside.clone(), release.clone());
        std::thread::spawn(move || {
            c.put_with_writer(k(1), 4, 0, |w| {
                inside.wait();
                release.wait();
                w.write(0, b"abcd")
            })
        })
    };
    inside.wait();
    assert_eq!(c.delete_many(&[k(1)], true), vec![true]);
    release.wait();
    assert_eq!(t.join().unwrap(), Err(PutError::Canceled));
    assert!(!c.exists(k(1), false));
    assert_eq!(c.live_slot_count(), 0, "the writer freed the canceled slot");
    assert_eq!(c.put(k(2), b"z", 0), Ok(PutOutcome::Stored));
    c.check_invariants().unwrap();
}

#[test]
fn failed_writer_frees_its_slot_and_key() {
    let c = core(1);
    assert_eq!(
        c.put_with_writer(k(1), 4, 0, |_| false),
        Err(PutError::CopyFailed)
    );
    assert!(!c.exists(k(1), false));
    assert_eq!(c.live_slot_count(), 0);
    assert!(
        c.put_with_writer(k(1), 4, 0, |w| w.write(2, b"xyz"))
            .is_err(),
        "writes past the payload are refused"
    );
    c.check_invariants().unwrap();
}

#[test]
fn forced_delete_drops_locks() {
    let c = core(2);
    c.put(k(1), b"a", 0).unwrap();
    assert!(c.exists(k(1), true));
    assert_eq!(c.delete_many(&[k(1)], true), vec![true]);
    c.unlock_many(&[k(1)]); // stale unlock of a forced-deleted key: no effect
    assert_eq!(c.live_slot_count(), 0);
    c.check_invariants().unwrap();
}

#[test]
fn close_waits_for_an_in_flight_load_and_refuses_new_work() {
    let c = Arc::new(core(2));
    c.put(k(1), b"data", 0).unwrap();
    let closed = Arc::new(AtomicBool::new(false));
    let set = c.reserve_reads(&[k(1)], false);
    let t = {
        let (c, closed) = (c.clone(), closed.clone());
        std::thread::spawn(move || {
            c.close();
            closed.store(true, Ordering::SeqCst);
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !closed.load(Ordering::SeqCst),
        "close returned while a load was in flight"
    );
    let mut out = [0u8; 4];
    assert_eq!(set.read(&set.items()[0], &mut out), Some(4));
    assert_eq!(&out, b"data");
    drop(set);
    t.join().unwrap();
    assert!(closed.load(Ordering::SeqCst));
    assert_eq!(c.put(k(2), b"x", 0), Err(PutError::Closed));
    assert_eq!(c.exists_many(&[k(1)], false), vec![false]);
    assert_eq!(c.delete_many(&[k(1)], true), vec![false]);
    assert!(c.snapshot_keys().is_empty());
    assert_eq!(c.usage(), (0.0, 0.0));
    let st = c.status();
    assert!(!st.is_healthy && st.closing);
    c.close(); // idempotent
}

#[test]
fn restart_is_volatile() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dax.img");
    let cfg = CoreConfig::new(
        ArenaSpec::new(ArenaSource::CreateFile(path.clone()), 4 * SLOT),
        SLOT,
    );
    let c = DaxCore::open(&cfg).unwrap();
    c.put(k(1), b"persist?", 0).unwrap();
    c.close();
    drop(c);
    let c = DaxCore::open(&CoreConfig::new(
        ArenaSpec::new(ArenaSource::Path(path), 4 * SLOT),
        SLOT,
    ))
    .unwrap();
    assert!(!c.exists(k(1), false), "a reopened device starts empty");
    assert_eq!(c.usage(), (0.0, 0.0));
}

#[test]
fn remap_grows_and_shrinks_without_moving_data() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dax.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(4 * SLOT as u64)
        .unwrap();
    let c = DaxCore::open(&CoreConfig::new(
        ArenaSpec::new(ArenaSource::Path(path), 2 * SLOT),
        SLOT,
    ))
    .unwrap();
    c.put(k(1), &payload(1, 100), 0).unwrap();
    c.put(k(2), &payload(2, 100), 0).unwrap();
    assert_eq!(c.put(k(3), b"x", 0), Err(PutError::Full));
    c.remap(4 * SLOT).unwrap();
    assert_eq!(c.max_slots(), 4);
    c.put(k(3), &payload(3, 100), 0).unwrap();
    assert!(c.exists(k(3), true), "key 3 in slot 2, locked");
    assert!(!c.can_shrink_to(2));
    let e = c.remap(2 * SLOT).unwrap_err();
    assert!(e.to_string().contains("cut off live slots"), "{e}");
    assert_eq!(c.max_slots(), 4, "a refused shrink changes nothing");
    c.unlock_many(&[k(3)]);
    assert_eq!(c.delete_many(&[k(3)], false), vec![true]);
    assert!(c.can_shrink_to(2));
    c.remap(2 * SLOT).unwrap();
    assert_eq!(c.max_slots(), 2);
    let mut b = vec![0u8; 100];
    assert_eq!(c.load_into(k(1), &mut b), Some(100));
    assert_eq!(b, payload(1, 100), "data survives grow and shrink");
    let e = c.remap(8 * SLOT).unwrap_err();
    assert!(
        e.to_string().contains("cannot grow"),
        "grow past the file is refused: {e}"
    );
    assert!(c.remap(SLOT - 1).is_err());
    assert_eq!(c.max_slots(), 2);
    c.check_invariants().unwrap();
}

#[test]
fn put_reserved_from_reports_every_result() {
    let src = core(4);
    let dst = core(2);
    src.put(k(1), &payload(1, 500), 3).unwrap();
    src.put(k(2), &payload(2, 500), 0).unwrap();
    src.put(k(3), &payload(3, 500), 0).unwrap();
    dst.put(k(2), b"already", 0).unwrap();
    let set = src.reserve_reads(&[k(1), k(2), k(3)], false);
    let r = set.items().to_vec();
    assert_eq!(
        dst.put_reserved_from(k(1), &set, &r[0]),
        PutFromPtrResult::Inserted
    );
    assert_eq!(
        dst.put_reserved_from(k(2), &set, &r[1]),
        PutFromPtrResult::AlreadyExists
    );
    assert_eq!(
        dst.put_reserved_from(k(3), &set, &r[2]),
        PutFromPtrResult::NoSpace
    );
    let mut bogus = r[0];
    bogus.len = 0;
    assert_eq!(
        dst.put_reserved_from(k(4), &set, &bogus),
        PutFromPtrResult::Invalid
    );
    drop(set);
    let mut b = vec![0u8; 500];
    assert_eq!(dst.load_into(k(1), &mut b), Some(500));
    assert_eq!(b, payload(1, 500));
    assert_eq!(
        dst.payload_len(k(1)),
        Some((500, 3)),
        "the caller's tag moves with the bytes"
    );
    let set = src.reserve_reads(&[k(3)], false);
    dst.close();
    assert_eq!(
        dst.put_reserved_from(k(3), &set, &set.items()[0]),
        PutFromPtrResult::Closed
    );
}

#[test]
fn snapshot_and_clock_candidates() {
    let c = core(8);
    for i in 0..4 {
        c.put(k(i), b"v", 0).unwrap();
    }
    let mut snap = c.snapshot_keys();
    snap.sort();
    let mut want: Vec<Key> = (0..4).map(k).collect();
    want.sort();
    assert_eq!(snap, want);
    assert!(c.exists(k(0), true), "lock key 0");
    // First sweep clears the referenced bits set by the puts, second picks.
    let cands = c.eviction_candidates(8);
    assert_eq!(cands.len(), 3);
    assert!(!cands.contains(&k(0)), "locked keys are never candidates");
    // Touch key 1: it gets a second chance, so key 2 or 3 come first.
    let _ = c.reserve_reads(&[k(1)], false);
    let first = c.eviction_candidates(1);
    assert_eq!(first.len(), 1);
    assert_ne!(first[0], k(1), "a referenced key gets a second chance");
}

#[test]
fn status_and_dram_overhead() {
    let c = DaxCore::open(&CoreConfig::new(ArenaSpec::memfd(1 << 24), 4096)).unwrap();
    let st = c.status();
    assert!(st.is_healthy);
    assert_eq!(st.max_slots, 4096);
    assert_eq!(st.slot_bytes, 4096);
    assert!(!st.supports_restart_recovery);
    let per_slot = c.dram_bytes_per_slot();
    assert!(
        per_slot <= 64.0,
        "DRAM overhead {per_slot} bytes per slot exceeds 64"
    );
    assert!(
        per_slot >= 32.0,
        "the slot metadata alone is 32 bytes: {per_slot}"
    );
}

#[test]
fn open_errors_name_the_path_and_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let e = DaxCore::open(&CoreConfig::new(
        ArenaSpec::new(ArenaSource::Path(missing.clone()), 8192),
        4096,
    ))
    .unwrap_err();
    assert!(matches!(e, OpenError::Missing { .. }));
    assert!(
        e.to_string().contains(&missing.display().to_string()),
        "{e}"
    );

    let e = DaxCore::open(&CoreConfig::new(
        ArenaSpec::new(ArenaSource::Path(dir.path().into()), 8192),
        4096,
    ))
    .unwrap_err();
    assert!(e.to_string().contains("is a directory"), "{e}");

    let small = dir.path().join("small");
    std::fs::write(&small, vec![0u8; 4096]).unwrap();
    let e = DaxCore::open(&CoreConfig::new(
        ArenaSpec::new(ArenaSource::Path(small), 8192),
        4096,
    ))
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("4096 bytes, smaller than the requested 8192"),
        "{e}"
    );

    let e = DaxCore::open(&CoreConfig::new(ArenaSpec::memfd(4095), 4096)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "arena of 4095 bytes does not fit one slot of 4096 bytes"
    );
    let e = DaxCore::open(&CoreConfig::new(ArenaSpec::memfd(4096), 0)).unwrap_err();
    assert_eq!(e.to_string(), "slot_bytes must be > 0 (got 0)");
    let e = DaxCore::open(&CoreConfig::new(ArenaSpec::memfd(0), 1)).unwrap_err();
    assert!(e.to_string().contains("does not fit one slot"), "{e}");
}

/// A character device with a fake sysfs root: size and alignment are checked
/// before the device is opened (no SIGBUS, no EINVAL).
#[test]
fn devdax_size_and_alignment_come_from_sysfs() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let dev = std::path::Path::new("/dev/null");
    let md = std::fs::metadata(dev).unwrap();
    assert!(md.file_type().is_char_device());
    let (maj, min) = (libc::major(md.rdev()), libc::minor(md.rdev()));
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join(format!("dev/char/{maj}:{min}"));
    std::fs::create_dir_all(&dir).unwrap();
    let spec = |len| ArenaSpec::new(ArenaSource::Path(dev.into()), len).sysfs_root(root.path());

    let e = DaxCore::open(&CoreConfig::new(spec(4 << 20), 1 << 20)).unwrap_err();
    assert!(
        e.to_string()
            .contains("cannot read device-dax attribute size"),
        "{e}"
    );

    std::fs::write(dir.join("size"), format!("{}\n", 8u64 << 20)).unwrap();
    std::fs::write(dir.join("align"), "2097152\n").unwrap();
    let e = DaxCore::open(&CoreConfig::new(spec(3 << 20), 1 << 20)).unwrap_err();
    assert!(
        e.to_string()
            .contains("not a multiple of the device alignment 2097152"),
        "{e}"
    );
    let e = DaxCore::open(&CoreConfig::new(spec(16 << 20), 1 << 20)).unwrap_err();
    assert!(
        e.to_string()
            .contains("device-dax size 8388608 bytes is smaller than the requested 16777216"),
        "{e}"
    );
    // Valid size and alignment: the checks pass and mapping /dev/null fails
    // with an error that names the device.
    let e = DaxCore::open(&CoreConfig::new(spec(4 << 20), 1 << 20)).unwrap_err();
    assert!(e.to_string().contains("/dev/null"), "{e}");
}

#[test]
fn no_fd_leaks_on_failed_open() {
    fn fds() -> usize {
        std::fs::read_dir("/proc/self/fd").unwrap().count()
    }
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small");
    std::fs::write(&small, vec![0u8; 4096]).unwrap();
    let before = fds();
    for _ in 0..20 {
        let _ = DaxCore::open(&CoreConfig::new(
            ArenaSpec::new(ArenaSource::Path(small.clone()), 8192),
            4096,
        ));
        let _ = DaxCore::open(&CoreConfig::new(ArenaSpec::memfd(100), 4096));
    }
    assert!(fds() <= before + 2, "fds grew from {before} to {}", fds());
}
