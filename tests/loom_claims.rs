//! Loom: the pool's one-copy-per-key rule with two
//! store workers and two devices.
//!
//! `RUSTFLAGS="--cfg daxkv_loom" CARGO_TARGET_DIR=target/loom cargo test --release --test loom_claims`
//!
//! The engine's own [`ClaimTable`]; the devices are stand-ins: a device
//! "holds the key" flag per device, read and written with Relaxed
//! atomics, so the only ordering between the two workers is the claim's
//! (a real device's index adds its own; the claim must not rely on it).
//! Each worker does what `store_one` does: claim the key, look for it on
//! every device, put it on its preferred device (the two workers prefer
//! different devices, as two least-used choices made at different moments
//! do), release.
//!
//! Checked: the key ends on exactly one device, whatever the interleaving;
//! a second stripe key stored meanwhile is not held up for good.
//!
//! Fails without the rule: with the claim taken and released but its CAS
//! Relaxed and its release store Relaxed, loom finds the schedule where
//! the second worker does not see the first's put ("stored on both
//! devices"); with no claim at all, likewise.
#![cfg(daxkv_loom)]

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

use daxkv::engine::claims::ClaimTable;
use daxkv::Key;

#[path = "common/loom.rs"]
mod common;
use common::model;

struct Pool {
    claims: ClaimTable,
    /// Device d holds the key.
    on: [AtomicBool; 2],
}

/// `store_one`'s protocol for one key: claim, look everywhere, put on one.
fn store(pool: &Pool, key: Key, preferred: usize) {
    let _claim = pool.claims.claim(key);
    // ORDERING: Relaxed — a stand-in device; the claim orders it.
    let present = pool.on.iter().any(|d| d.load(Ordering::Relaxed));
    if !present {
        // ORDERING: Relaxed — as above.
        pool.on[preferred].store(true, Ordering::Relaxed);
    }
}

#[test]
fn two_workers_two_devices_one_copy() {
    model(|| {
        let pool = Arc::new(Pool {
            claims: ClaimTable::new(2),
            on: [AtomicBool::new(false), AtomicBool::new(false)],
        });
        let key = Key::from_u128(7);
        let p2 = pool.clone();
        let t = thread::spawn(move || store(&p2, key, 1));
        store(&pool, key, 0);
        t.join().unwrap();
        let copies = pool.on.iter().filter(|d| d.load(Ordering::Relaxed)).count();
        assert_eq!(copies, 1, "stored on both devices (or none)");
        assert_eq!(pool.claims.held(), 0, "a claim left held");
    });
}

/// One key's copies on two stand-in devices, `[T, S]` in list order (the
/// order lookups, unlocks and deletes scan them): `None` (absent) or
/// `Some(lock count)`. Each device operation is atomic (a device's own
/// slot word makes it so); the protocol between them is the claim.
struct Held {
    claims: ClaimTable,
    dev: [loom::sync::Mutex<Option<u32>>; 2],
}

const T: usize = 0;
const S: usize = 1;

impl Held {
    /// Lookup-and-lock: no claim; the first device holding the key.
    fn lookup_lock(&self) -> bool {
        self.dev.iter().any(|d| match &mut *d.lock().unwrap() {
            Some(n) => {
                *n += 1;
                true
            }
            None => false,
        })
    }

    /// `Engine::submit_unlock` for one key: under its claim, one lock on
    /// the device that holds it. (With an unlock that takes no claim and
    /// one lock off every device, loom finds "locked for ever: [Some(1),
    /// None]", and with that check off, "a plain delete removed a key the
    /// reader holds".)
    fn unlock(&self) {
        let _claim = self.claims.claim(Key::from_u128(7));
        for d in &self.dev {
            if let Some(n) = &mut *d.lock().unwrap() {
                if *n > 0 {
                    *n -= 1;
                    return;
                }
            }
        }
    }

    /// `Engine::delete` (not forced): under the claim, an unlocked copy.
    fn delete(&self) -> bool {
        let _claim = self.claims.claim(Key::from_u128(7));
        self.dev.iter().any(|d| {
            let mut g = d.lock().unwrap();
            if *g == Some(0) {
                *g = None;
                true
            } else {
                false
            }
        })
    }

    /// `move_key`, forced: under the claim, put on T, delete S taking its
    /// locks, take them again on T one by one (`lock_n`).
    fn migrate(&self) {
        let _claim = self.claims.claim(Key::from_u128(7));
        *self.dev[T].lock().unwrap() = Some(0);
        let taken = self.dev[S].lock().unwrap().take().unwrap_or(0);
        for _ in 0..taken {
            if let Some(n) = &mut *self.dev[T].lock().unwrap() {
                *n += 1;
            }
        }
    }
}

/// A forced migration's lock hand-over against a
/// reader that takes two lookup locks (the second may find the new copy,
/// first in list order, while the first is on the source) and releases
/// them one by one. Checked: while the reader still holds a lock a plain
/// delete leaves the key (no unlock released two), and once it has
/// unlocked both no lock is left (none was released zero times) and the
/// one copy deletes.
#[test]
fn unlock_is_ordered_against_a_moves_lock_hand_over() {
    // Two claimers spin (with a yield per try under loom) while the other
    // holds: more branches per execution than loom's default allows.
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.max_branches = 100_000;
    b.check(|| {
        let h = Arc::new(Held {
            claims: ClaimTable::new(2),
            dev: [
                loom::sync::Mutex::new(None),
                loom::sync::Mutex::new(Some(0)),
            ],
        });
        let reader = {
            let h = h.clone();
            thread::spawn(move || {
                let n = u32::from(h.lookup_lock()) + u32::from(h.lookup_lock());
                if n == 0 {
                    return;
                }
                h.unlock();
                if n == 2 {
                    assert!(!h.delete(), "a plain delete removed a key the reader holds");
                    h.unlock();
                }
            })
        };
        h.migrate();
        reader.join().unwrap();
        let left: Vec<Option<u32>> = h.dev.iter().map(|d| *d.lock().unwrap()).collect();
        assert_eq!(left.iter().flatten().count(), 1, "one copy: {left:?}");
        assert!(h.delete(), "locked for ever: {left:?}");
        assert_eq!(h.claims.held(), 0, "a claim left held");
    });
}
