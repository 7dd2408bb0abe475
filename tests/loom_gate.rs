//! Loom: the arena gate's leases against its exclusive section and close
//! (`device::gate`, "Leases").
//!
//! `RUSTFLAGS="--cfg daxkv_loom" CARGO_TARGET_DIR=target/loom cargo test --release --test loom_gate`
//!
//! The claim checked: an exclusive section (a remap) never runs while a
//! lease is admitted, and a lease is never admitted while a section runs;
//! close never sees the lease count at zero while a lease is admitted.
//! A `Mutex`-free shadow of "who is inside" (`inside`) turns an overlap
//! into a failed assertion.
#![cfg(daxkv_loom)]

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

use daxkv::device::gate::{Gate, Refused};

#[path = "common/loom.rs"]
mod common;
use common::model;

const LEASE: usize = 1;
const SECTION: usize = 2;

/// A lease and a remap race: a lease is never admitted while a section
/// runs (from its `begin_exclusive` to its `end_exclusive`). Shadow flags
/// set and checked with `SeqCst` on both sides catch any overlap in any
/// order: whichever of the two sets its flag second sees the other's. A
/// lease that saw the section, or a section that saw the lease, backs off
/// and leaves the gate as it found it.
#[test]
fn a_lease_and_an_exclusive_section_never_overlap() {
    model(|| {
        let g = Arc::new(Gate::new());
        let inside = Arc::new(AtomicUsize::new(0));
        let (g2, in2) = (g.clone(), inside.clone());
        let leaser = thread::spawn(move || match g2.try_lease() {
            Ok(()) => {
                let was = in2.fetch_or(LEASE, Ordering::SeqCst);
                assert_eq!(was & SECTION, 0, "a lease admitted inside a section");
                in2.fetch_and(!LEASE, Ordering::SeqCst);
                g2.end_lease();
            }
            Err((Refused::Busy, _)) => {}
            Err(e) => panic!("{e:?}"),
        });
        match g.begin_exclusive() {
            Ok(()) => {
                let was = inside.fetch_or(SECTION, Ordering::SeqCst);
                assert_eq!(was & LEASE, 0, "a section began with a lease admitted");
                inside.fetch_and(!SECTION, Ordering::SeqCst);
                g.end_exclusive();
            }
            Err(Refused::Leased(n)) => assert!(n > 0),
            Err(e) => panic!("{e:?}"),
        }
        leaser.join().unwrap();
        assert_eq!(g.live(), 0, "every admission was undone");
        assert_eq!(g.leases(), 0);
    });
}

/// Close against a lease: either the lease is refused (`Closed`) or close
/// sees it counted (and leaves the unmap to the arena's drop).
#[test]
fn close_sees_every_admitted_lease() {
    model(|| {
        let g = Arc::new(Gate::new());
        let admitted = Arc::new(AtomicUsize::new(0));
        let (g2, a2) = (g.clone(), admitted.clone());
        let leaser = thread::spawn(move || {
            if g2.try_lease().is_ok() {
                a2.store(1, Ordering::SeqCst);
                // Held past close: ended after the close thread looked.
                true
            } else {
                false
            }
        });
        assert!(g.close());
        let saw = g.leases();
        let leased = leaser.join().unwrap();
        if leased {
            assert!(
                saw > 0 || g.live() > 0,
                "close saw no lease while one was admitted and unmapped"
            );
            g.end_lease();
        }
        assert_eq!(g.live(), 0);
        assert_eq!(g.leases(), 0);
        let _ = admitted.load(Ordering::SeqCst);
    });
}

/// A forced drain (`Gate::begin_drain`, a forced remove with leases
/// open) against a guard and a lease that comes and goes: the drain never
/// reads zero guards while a guard admitted before it is inside, whatever
/// the lease does; the guard is either admitted before (and waited for) or
/// refused. Guards and leases share one word (a lease counts
/// `LEASE_UNIT`), so one load tells them apart. Seen failing with
/// `guards()` computed from the word and the lease count read apart.
#[test]
fn a_drain_waits_for_every_guard_whatever_the_leases_do() {
    const GUARD: usize = 4;
    model(|| {
        let g = Arc::new(Gate::new());
        let inside = Arc::new(AtomicUsize::new(0));
        let (g2, in2) = (g.clone(), inside.clone());
        let guard = thread::spawn(move || {
            if g2.enter(false).is_ok() {
                in2.fetch_or(GUARD, Ordering::SeqCst);
                in2.fetch_and(!GUARD, Ordering::SeqCst);
                g2.leave();
            }
        });
        let g3 = g.clone();
        let leaser = thread::spawn(move || {
            if g3.try_lease().is_ok() {
                g3.end_lease();
            }
        });
        if g.begin_drain().is_ok() {
            while g.guards() != 0 {
                thread::yield_now();
            }
            assert_eq!(
                inside.load(Ordering::SeqCst) & GUARD,
                0,
                "the drain passed a live guard"
            );
            g.end_exclusive();
        }
        guard.join().unwrap();
        leaser.join().unwrap();
        assert_eq!(g.live(), 0);
        assert_eq!(g.leases(), 0);
    });
}
