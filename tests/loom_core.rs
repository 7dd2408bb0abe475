//! Loom: the protocols of `DaxCore` that span the index and the slot state
//! word (where a delete and a writer can both claim one bucket): delete racing
//! delete + re-put of one key with slot reuse in another bucket, and a
//! forced delete racing a failing writer and a re-put. Every interleaving
//! up to the preemption bound, over a real (anonymous) mapping.
//!
//! Run with:
//! `RUSTFLAGS="--cfg daxkv_loom" CARGO_TARGET_DIR=target/loom cargo test --release --test loom_core`
#![cfg(daxkv_loom)]

use loom::sync::Arc;
use loom::thread;

use daxkv::device::arena::{ArenaSource, ArenaSpec};
use daxkv::{CoreConfig, DaxCore, Key, PutError, PutOutcome};

#[path = "common/loom.rs"]
mod common;
use common::model;

const SLOT: usize = 4096;

fn core(slots: usize) -> DaxCore {
    DaxCore::open(&CoreConfig::new(
        ArenaSpec::new(ArenaSource::Anonymous, slots * SLOT),
        SLOT,
    ))
    .unwrap()
}

/// A key whose home bucket is 0 (the index's home is the high bits of
/// `lo × buckets`), with fingerprint `fp`.
fn home0(fp: u64) -> Key {
    Key::from_u128((u128::from(fp) << 96) | u128::from(fp))
}

/// A key whose home bucket is the middle of the table.
fn home_mid(fp: u64) -> Key {
    Key::from_u128((u128::from(fp) << 96) | (1 << 63) | u128::from(fp))
}

/// Every slot is free or accounted for; a key that is absent can be stored
/// again (not wedged, answering `AlreadyPresent` forever).
fn settle_and_check(c: &DaxCore, k: Key, others: usize) {
    c.check_invariants().unwrap();
    let present = c.exists(k, false);
    assert_eq!(c.live_slot_count(), others + usize::from(present));
    if !present {
        assert_eq!(c.put(k, b"again", 0), Ok(PutOutcome::Stored));
        assert!(c.exists(k, false));
        c.check_invariants().unwrap();
    }
}

/// Deleter A races deleter B, which then re-puts the key. The
/// re-put reuses the key's slot (the only free one) in an earlier bucket
/// (a tombstone in the same run). Fails with a `delete_in` that detaches
/// the generation seen after `find`, then removes the bucket `find`
/// returned: loom finds "A finds bucket 1 → B deletes and re-puts into
/// slot 2 / bucket 0 → A detaches the new copy and fails to remove bucket
/// 1", leaving a live slot with no key and the key wedged ("2 committed
/// slots but 3 index entries").
#[test]
fn delete_races_delete_and_reput_in_another_bucket() {
    model(|| {
        let c = Arc::new(core(3));
        let (y, k) = (home0(1), home0(2));
        c.put(y, b"y", 0).unwrap(); // slot 0, bucket 0
        c.put(home_mid(3), b"x", 0).unwrap(); // slot 1
        c.put(k, b"k", 0).unwrap(); // slot 2, bucket 1
        assert!(c.delete(y, false)); // bucket 0: tombstone; slot 0 free
        c.put(home_mid(4), b"z", 0).unwrap(); // slot 0 again
        let a = {
            let c = c.clone();
            thread::spawn(move || c.delete(k, false))
        };
        let b_deleted = c.delete(k, false);
        let b_put = c.put(k, b"k2", 0);
        let a_deleted = a.join().unwrap();
        assert!(a_deleted || b_deleted, "the first copy was deleted once");
        // A pin held by the other deleter can keep the freed slot taken for
        // a moment: `Full` is a fair answer then, never a wedge (checked
        // below: the key can be stored once things settle).
        assert!(matches!(b_put, Ok(_) | Err(PutError::Full)), "{b_put:?}");
        settle_and_check(&c, k, 2);
    });
}

/// A forced delete races a writer whose copy fails and a third thread
/// re-putting the key. Fails when both sides remove: the failing writer
/// removes its bucket and frees the slot while the canceling deleter goes
/// on to remove "its" bucket, which by then is the re-put copy's, and
/// panics on `unlink`; with such a `delete_in` the model panics ("only the
/// remover changes an OWNED bucket").
#[test]
fn forced_delete_races_failing_writer_and_reput() {
    model(|| {
        let c = Arc::new(core(2));
        let k = home0(7);
        let w = {
            let c = c.clone();
            thread::spawn(move || c.put_with_writer(k, 16, 0, |_| false))
        };
        let d = {
            let c = c.clone();
            thread::spawn(move || c.delete(k, true))
        };
        let p = c.put(k, &[5; 16], 0);
        let w = w.join().unwrap();
        assert_ne!(w, Ok(PutOutcome::Stored), "the failing writer never stores");
        let _ = d.join().unwrap();
        let _ = p;
        let mut out = [0u8; 16];
        if let Some(n) = c.load_into(k, &mut out) {
            assert_eq!((n, out), (16, [5; 16]), "only the good copy is readable");
        }
        settle_and_check(&c, k, 0);
    });
}

/// A store lease racing a plain put of its key (`device::lease`): the put
/// never succeeds on the key while the lease is open. It answers `Stored`
/// before the lease (which then finds the key present), `Leased` while it
/// is open, `AlreadyPresent` only once it committed. Fails with `present`
/// answering `AlreadyPresent` for a leased key (checked: the put's
/// `AlreadyPresent` then comes with the key not readable).
#[test]
fn a_put_never_succeeds_on_a_key_under_an_open_store_lease() {
    use daxkv::{LeaseError, LeasedStore};
    model(|| {
        let c = Arc::new(core(4));
        let k = home0(5);
        let c2 = c.clone();
        let leaser = thread::spawn(move || match c2.lease_store(k, 16, 0) {
            Ok(LeasedStore::Leased(l)) => {
                l.commit().unwrap();
                true
            }
            Ok(LeasedStore::AlreadyPresent) => false,
            Err(e @ (LeaseError::Full | LeaseError::Busy)) => panic!("{e}"),
            Err(e) => panic!("{e}"),
        });
        let put = c.put(k, b"plain", 0);
        let readable_after = c.exists(k, false);
        let leased = leaser.join().unwrap();
        match put {
            Ok(PutOutcome::Stored) => assert!(!leased, "both stored the key"),
            Ok(PutOutcome::AlreadyPresent) => {
                assert!(leased);
                assert!(readable_after, "a put succeeded on a key not yet committed");
            }
            Err(PutError::Leased) => assert!(leased),
            Err(e) => panic!("{e}"),
        }
        assert!(c.exists(k, false));
        c.check_invariants().unwrap();
    });
}

/// The engine's lease against a forced hotplug remove (`engine/lease.rs`,
/// "Placement, and a forced remove"), on the real lease table and slot
/// state word: the leaser takes its lease (table entry), fences, and
/// gives the slot back if the device is no longer writable; the remover
/// makes it not writable, fences, cancels the store leases it finds and
/// lists the committed keys, which it then moves. A commit that answers
/// `Ok` must be in that listing: else the key, answered stored, goes with
/// the device. Seen failing with either fence taken out, and with the
/// remover's walk taken out.
#[test]
fn a_lease_committed_as_a_forced_remove_lists_its_device_is_listed() {
    use daxkv::{LeaseError, LeasedStore};
    use loom::sync::atomic::{fence, AtomicBool, Ordering};
    model(|| {
        let c = Arc::new(core(2));
        let writable = Arc::new(AtomicBool::new(true));
        let k = home0(9);
        let (c2, w2) = (c.clone(), writable.clone());
        let leaser = thread::spawn(move || {
            let Ok(LeasedStore::Leased(l)) = c2.lease_store(k, 16, 0) else {
                panic!("a fresh key on an empty device is leased");
            };
            fence(Ordering::SeqCst);
            if !w2.load(Ordering::Acquire) {
                l.abort();
                return false;
            }
            match l.commit() {
                Ok(()) => true,
                Err(LeaseError::Canceled) => false,
                Err(e) => panic!("{e}"),
            }
        });
        writable.store(false, Ordering::Release);
        fence(Ordering::SeqCst);
        c.cancel_store_leases();
        let listed = c.snapshot_keys();
        let committed = leaser.join().unwrap();
        if committed {
            assert_eq!(listed, vec![k], "a commit the remove's listing missed");
        }
        c.check_invariants().unwrap();
    });
}
