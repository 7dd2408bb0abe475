//! Loom: every interleaving of the slot state word's transitions on one slot
//! (commit / lookup+lock / borrow / delete / unlink), plus the bitmap.
//!
//! Run with:
//! `RUSTFLAGS="--cfg daxkv_loom" CARGO_TARGET_DIR=target/loom cargo test --release --test loom_slot`
#![cfg(daxkv_loom)]

use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

use daxkv::device::slot::{Bitmap, Commit, SlotError, SlotState};

#[path = "common/loom.rs"]
mod common;
use common::model;

/// The payload the slot guards, written by the writer and read by readers.
struct Slot {
    state: SlotState,
    data: UnsafeCell<u64>,
    frees: AtomicUsize,
}

// SAFETY: test harness; loom's UnsafeCell checks every access for races.
unsafe impl Sync for Slot {}

impl Slot {
    fn new() -> Slot {
        Slot {
            state: SlotState::new(),
            data: UnsafeCell::new(0),
            frees: AtomicUsize::new(0),
        }
    }
    fn note(&self, freed: bool) {
        if freed {
            self.frees.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// The writer's copy is published by commit: a reader that borrows the slot
/// sees the bytes (loom reports a data race otherwise).
#[test]
fn commit_publishes_payload_to_borrowers() {
    model(|| {
        let s = Arc::new(Slot::new());
        let gen = s.state.reserve();
        let w = {
            let s = s.clone();
            thread::spawn(move || {
                // SAFETY: the slot is WRITING: only the writer touches data.
                s.data.with_mut(|p| unsafe { *p = 42 });
                assert_eq!(s.state.commit(gen), Ok(Commit::Committed));
            })
        };
        if s.state.borrow(gen).is_ok() {
            // SAFETY: borrowed after an Acquire that saw COMMITTED.
            let v = s.data.with(|p| unsafe { *p });
            assert_eq!(v, 42);
            assert!(!s.state.release(gen).unwrap().freed);
        }
        w.join().unwrap();
    });
}

/// A forced delete racing the writer's commit frees the slot exactly once,
/// whichever wins.
#[test]
fn forced_delete_vs_commit_frees_once() {
    model(|| {
        let s = Arc::new(Slot::new());
        let gen = s.state.reserve();
        let w = {
            let s = s.clone();
            thread::spawn(move || {
                // SAFETY: WRITING: the writer owns the payload.
                s.data.with_mut(|p| unsafe { *p = 7 });
                match s.state.commit(gen).unwrap() {
                    Commit::Committed => {}
                    Commit::Canceled(t) => s.note(t.freed),
                }
            })
        };
        let t = s.state.detach(gen, true).unwrap();
        s.note(t.freed);
        let t = s.state.unlink(gen).unwrap();
        s.note(t.freed);
        w.join().unwrap();
        assert_eq!(s.frees.load(Ordering::SeqCst), 1, "freed exactly once");
        assert!(s.state.load().is_free());
    });
}

/// Delete (unforced) racing a reader and a lookup+lock: either the delete
/// is refused (locked) and the slot stays committed, or it succeeds and the
/// slot is freed exactly once — by the deleter or by the last reader — and
/// the reader's bytes are intact either way.
#[test]
fn delete_vs_reader_vs_lock() {
    model(|| {
        let s = Arc::new(Slot::new());
        let gen = s.state.reserve();
        // SAFETY: WRITING, single thread.
        s.data.with_mut(|p| unsafe { *p = 9 });
        assert_eq!(s.state.commit(gen), Ok(Commit::Committed));

        let reader = {
            let s = s.clone();
            thread::spawn(move || {
                if s.state.borrow(gen).is_ok() {
                    // SAFETY: borrowed: the slot cannot be freed or rewritten.
                    assert_eq!(s.data.with(|p| unsafe { *p }), 9);
                    let t = s.state.release(gen).unwrap();
                    s.note(t.freed);
                }
            })
        };
        let locker = {
            let s = s.clone();
            thread::spawn(move || {
                if s.state.lock(gen).is_ok() {
                    s.state.unlock(gen).unwrap();
                }
            })
        };
        let deleted = match s.state.detach(gen, false) {
            Ok(t) => {
                s.note(t.freed);
                let t = s.state.unlink(gen).unwrap();
                s.note(t.freed);
                true
            }
            Err(e) => {
                assert_eq!(e, SlotError::Locked);
                false
            }
        };
        reader.join().unwrap();
        locker.join().unwrap();
        let st = s.state.load();
        if deleted {
            assert_eq!(s.frees.load(Ordering::SeqCst), 1);
            assert!(st.is_free());
        } else {
            assert_eq!(s.frees.load(Ordering::SeqCst), 0);
            assert!(st.is_readable() && st.lock_count() == 0 && st.borrow_count() == 0);
        }
    });
}

/// Two threads claiming from a 2-slot bitmap get distinct slots; a release
/// makes the slot claimable again.
#[test]
fn bitmap_claims_are_exclusive() {
    model(|| {
        let b = Arc::new(Bitmap::new(2, 2));
        let t = {
            let b = b.clone();
            thread::spawn(move || b.claim().unwrap())
        };
        let mine = b.claim().unwrap();
        let theirs = t.join().unwrap();
        assert_ne!(mine, theirs);
        assert_eq!(b.claim(), None);
        b.release(mine);
        assert_eq!(b.claim(), Some(mine));
    });
}

/// A claimer that skipped a full word raises the hint
/// past it while a release frees a bit in that word and reads the old hint;
/// the freed bit must still be found. Fails with `raise_hint`'s re-read of
/// the skipped words removed (loom finds the interleaving
/// "claimer reads word 0 full → release of slot 5 reads hint 0 → claimer
/// raises the hint to 1", after which `claim` returns 65).
#[test]
fn bitmap_hint_does_not_hide_a_release() {
    model(|| {
        let b = Arc::new(Bitmap::new(128, 128));
        for i in 0..64 {
            assert_eq!(b.claim().map(|s| s.0), Some(i));
        }
        let c = {
            let b = b.clone();
            thread::spawn(move || b.claim().map(|s| s.0))
        };
        b.release(daxkv::device::slot::SlotId(5));
        let got = c.join().unwrap();
        assert!(matches!(got, Some(5 | 64)), "claimed {got:?}");
        let want = if got == Some(5) { 64 } else { 5 };
        assert_eq!(
            b.claim().map(|s| s.0),
            Some(want),
            "the lowest free slot was hidden by the hint"
        );
    });
}
