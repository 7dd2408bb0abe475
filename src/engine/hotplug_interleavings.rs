//! Hotplug against the data path, one interleaving per test, pinned with
//! a device core's stall hook (in-crate because that hook is test-only):
//! a delete against a pending remap, moves against lookup locks and
//! unlocks, a delete against a store or move holding the key's claim. Each
//! test doc says what breaks without the rule it checks.

#![allow(clippy::many_single_char_names)] // scenario tests

use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::*;
use crate::device::arena::ArenaSpec;
use crate::device::core::{CoreConfig, StallPoint};
use crate::plumbing::buf::Buf;

const SLOT: usize = 4096;
const W: Duration = Duration::from_secs(30);

fn dev(slots: usize, max: usize) -> DeviceSpec {
    DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(
            ArenaSpec::memfd(slots * SLOT).max_size_bytes(max * SLOT),
            SLOT,
        ),
    }
}

fn store(e: &Engine, k: Key) {
    let id = e
        .submit_store(vec![k], vec![Buf::from(vec![5u8; 100])])
        .unwrap();
    assert!(e.wait_store(id, W).ready().unwrap().success);
}

fn lookup_lock(e: &Engine, k: Key) -> bool {
    let id = e.submit_lookup_and_lock(vec![k]).unwrap();
    match e.wait_lookup(id, W) {
        Answer::Ready(b) => b.test(0),
        _ => panic!("lookup timed out"),
    }
}

/// A delete holding a key's claim never waits on a pending remap. If
/// `Engine::delete_into` entered each device with a blocking
/// `DaxCore::delete` (arena `enter`) under the claim, then with a store
/// worker holding its part session on device 1 and waiting for that
/// claim, a hotplug grow of device 1 (remap pending: waits for the
/// worker's session) and the delete (waits for the remap) would form the
/// cycle docs/key-ownership.md forbids, ending only when the remap gives
/// up after the drain timeout (5 s) and the resize fails.
#[test]
fn a_delete_holding_a_claim_never_waits_on_a_pending_remap() {
    let e = Arc::new(
        Engine::open(
            vec![dev(16, 16), dev(16, 64)],
            SLOT,
            true,
            EngineOptions::default(),
        )
        .unwrap(),
    );
    let k = Key::digest(b"cycle");
    e.set_device_state(DeviceId(1), DeviceState::Draining)
        .unwrap();
    store(&e, k); // on device 0
    e.set_device_state(DeviceId(1), DeviceState::Active)
        .unwrap();
    let devs = e.inner.pool.snapshot();
    let (stalled_tx, stalled_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    devs[0]
        .core()
        .inject_stall(StallPoint::AfterFind, move |_| {
            stalled_tx.send(()).unwrap();
            go_rx.recv().unwrap();
        });
    let deleter = {
        let e = e.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            let n = e.delete(&[k]).len();
            (n, t.elapsed())
        })
    };
    stalled_rx.recv().unwrap(); // the delete holds K's claim (inside device 0)
                                // A store of K: its worker opens sessions on devices 0 and 1, then
                                // waits for K's claim.
    let sid = e
        .submit_store(vec![k], vec![Buf::from(vec![6u8; 100])])
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let resizer = {
        let e = e.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            let r = e.resize_device_to(
                DeviceId(1),
                32 * SLOT,
                ShrinkMode::Migrate,
                false,
                |_, _| Ok(()),
            );
            (
                r.map(|r| r.new_size_bytes).map_err(|e| e.to_string()),
                t.elapsed(),
            )
        })
    };
    while !devs[1].core().remap_pending() {
        std::thread::yield_now();
    }
    go_tx.send(()).unwrap(); // the delete goes on to device 1
    let (resize, rt) = resizer.join().unwrap();
    let (deleted, dt) = deleter.join().unwrap();
    let _ = e.wait_store(sid, W);
    eprintln!("resize: {resize:?} after {rt:?}; delete of 1 key: {deleted} after {dt:?}");
    assert!(
        resize.is_ok() && dt < Duration::from_secs(2),
        "claim holder (delete) waited on a remap: resize {resize:?} in {rt:?}, delete took {dt:?}"
    );
}

/// A move that is rolled back (`Move::Locked`: a lookup locked the source
/// copy meanwhile) keeps a lookup lock another reader took on the target
/// copy in between. Deleting the target copy with force = true would
/// destroy that lock; the reader's unlock (applied to every device) would
/// then release the first reader's lock on the source: the key unlocked
/// while a reader still holds its lock, and a plain delete removing it.
#[test]
fn a_rolled_back_move_keeps_a_lock_on_the_target_copy() {
    let e = Arc::new(
        Engine::open(
            vec![dev(16, 16), dev(16, 16)],
            SLOT,
            true,
            EngineOptions::default(),
        )
        .unwrap(),
    );
    let k = Key::digest(b"theft");
    e.set_device_state(DeviceId(0), DeviceState::Draining)
        .unwrap();
    store(&e, k); // on device 1 (the source S); device 0 (target T) is first
    e.set_device_state(DeviceId(0), DeviceState::Active)
        .unwrap();
    let devs = e.inner.pool.snapshot();
    let (s, t) = (devs[1].clone(), devs[0].clone());
    let locked_b = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        // Finds on S by move_key: 1 payload_len, 2 the lock check (no lock
        // yet), 3 load_into: reader A locks K (found on S only), 4 the
        // source delete, after the put on T: reader B locks K, found on T
        // first. Both copies are then locked.
        let (e, locked_b) = (e.clone(), locked_b.clone());
        s.core().inject_stall(StallPoint::AfterFind, move |c| {
            c.inject_stall(StallPoint::AfterFind, move |c| {
                c.inject_stall(StallPoint::AfterFind, move |c| {
                    assert!(lookup_lock(&e, k), "reader A locks K on S");
                    c.inject_stall(StallPoint::AfterFind, move |_| {
                        // ORDERING: SeqCst — a test flag, read after the join.
                        locked_b.store(lookup_lock(&e, k), std::sync::atomic::Ordering::SeqCst);
                    });
                });
            });
        });
    }
    let r = e.remove_device(DeviceId(1), RemoveMode::Migrate, false);
    eprintln!("remove: {r:?}");
    assert!(
        // ORDERING: SeqCst — a test flag (see the store).
        locked_b.load(std::sync::atomic::Ordering::SeqCst),
        "reader B locked K"
    );
    assert_eq!(r.unwrap().moved_keys, 1, "the key moved with both locks");
    assert_eq!(e.devices_holding(k), [DeviceId(0)], "one copy, on T");
    assert_eq!(t.core().lock_count(k), 2, "A's lock joined B's on T");
    // Reader B is done: it unlocks (on every device, as the API says).
    e.submit_unlock(&[k]);
    assert_eq!(t.core().lock_count(k), 1, "reader A still holds its lock");
    assert!(e.delete(&[k]).is_empty(), "a locked key is not deleted");
    e.submit_unlock(&[k]);
    assert_eq!(e.delete(&[k]), [k]);
}

/// A forced migration hands lookup locks over (docs/key-ownership.md,
/// Migration step 2: "the lock count moves to T's copy"). Dropping them
/// (the source copy force-deleted, the new copy at lock count 0) would let
/// a plain delete remove a key a reader holds locked.
#[test]
fn a_forced_migration_hands_lookup_locks_over() {
    let e = Arc::new(
        Engine::open(
            vec![dev(16, 16), dev(16, 16)],
            SLOT,
            true,
            EngineOptions::default(),
        )
        .unwrap(),
    );
    let k = Key::digest(b"handover");
    e.set_device_state(DeviceId(0), DeviceState::Draining)
        .unwrap();
    store(&e, k); // on device 1
    e.set_device_state(DeviceId(0), DeviceState::Active)
        .unwrap();
    assert!(lookup_lock(&e, k), "a reader locks K");
    let r = e
        .remove_device(DeviceId(1), RemoveMode::Migrate, true)
        .unwrap();
    let t = e.inner.pool.snapshot()[0].clone();
    let n = t.core().lock_count(k);
    let deleted = e.delete(&[k]);
    eprintln!(
        "moved {}; lock count on the new copy {n}; plain delete while locked removed {deleted:?}",
        r.moved_keys
    );
    assert_eq!(n, 1, "the reader's lock was not handed over");
}

/// Arm a stall on `t` that fires at the first find on it once `s` no
/// longer holds `k` (a forced move has detached the source copy, taking
/// its locks, and not yet taken them on the target): there it runs
/// `submit_unlock(k)` on another thread and waits for it, up to 500 ms.
fn unlock_in_the_hand_over(
    t: &crate::device::core::DaxCore,
    s: Arc<pool::Device>,
    e: Arc<Engine>,
    k: Key,
    done: mpsc::Sender<()>,
) {
    t.inject_stall(StallPoint::AfterFind, move |t| {
        if s.core().contains_live(k) {
            // Not in the window yet (the put on T): the next find.
            unlock_in_the_hand_over(t, s, e, k, done);
            return;
        }
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            e.submit_unlock(&[k]);
            let _ = tx.send(());
            let _ = done.send(());
        });
        // The unlock waits for this move's claim (the wait times out and
        // the move goes on); an unlock that took no claim would run here,
        // in the window.
        let _ = rx.recv_timeout(Duration::from_millis(500));
    });
}

/// The interleaving of `Engine::submit_unlock`'s doc:
/// a reader's unlock that landed between a forced move's source delete
/// (which takes the copy's lock) and the lock taken again on the target
/// would find no lock anywhere and release nothing; the target copy would
/// stay locked for ever: a plain delete skips it, status counts the
/// lock, and a later non-forced remove is 409. With an unlock that takes
/// no claim (`unlock_many` on every device) this fails: "locks left 1",
/// remove `Blocked { locked: 1 }`.
#[test]
fn an_unlock_never_lands_inside_a_move() {
    let e = Arc::new(
        Engine::open(
            vec![dev(16, 16), dev(16, 16), dev(16, 16)],
            SLOT,
            true,
            EngineOptions::default(),
        )
        .unwrap(),
    );
    let k = Key::digest(b"hand-over");
    e.set_device_state(DeviceId(0), DeviceState::Draining)
        .unwrap();
    store(&e, k); // on device 1 (the source S); device 0 (target T) is first
    e.set_device_state(DeviceId(0), DeviceState::Active)
        .unwrap();
    e.set_device_state(DeviceId(2), DeviceState::Draining)
        .unwrap();
    let devs = e.inner.pool.snapshot();
    let (s, t) = (devs[1].clone(), devs[0].clone());
    assert!(lookup_lock(&e, k), "the reader locks K on S");
    let (done_tx, done_rx) = mpsc::channel();
    unlock_in_the_hand_over(t.core(), s.clone(), e.clone(), k, done_tx);
    let r = e.remove_device(DeviceId(1), RemoveMode::Migrate, true);
    assert_eq!(r.unwrap().moved_keys, 1);
    done_rx
        .recv_timeout(W)
        .expect("the reader's unlock ran and returned");
    let locks = t.core().lock_count(k);
    e.set_device_state(DeviceId(2), DeviceState::Active)
        .unwrap();
    let remove = e.remove_device(DeviceId(0), RemoveMode::Migrate, false);
    eprintln!("locks left {locks}; non-forced remove of T: {remove:?}");
    assert_eq!(locks, 0, "the reader unlocked: no lock may be left");
    assert!(remove.is_ok(), "remove after the unlock: {remove:?}");
    assert_eq!(e.delete(&[k]), [k], "unlocked: a plain delete removes it");
}

/// What `Engine::delete` does with a key another
/// party holds the claim of (docs/key-ownership.md, "Delete"): a store of
/// the key placing a new copy (the storing mark) makes the delete skip it,
/// like a locked key (LMCache's eviction retries next cycle); a move of
/// the key (a claim without the mark), or a store of another key on the
/// same stripe, is waited for, and the key is then deleted.
#[test]
fn delete_skips_a_key_being_stored_and_waits_for_a_move() {
    let e =
        Arc::new(Engine::open(vec![dev(16, 16)], SLOT, true, EngineOptions::default()).unwrap());
    let k = Key::from_parts(0x1111, 5);
    let mate = Key::from_parts(0x2222, 5 + claims::STRIPES as u64);
    store(&e, k);
    let claims = &e.inner.pool.claims;

    // K's store in flight: skipped, K stays. (A delete that waited for the
    // claim fails here: "the delete waited for the store", then deletes K.)
    let c = claims.claim(k);
    c.mark_storing();
    let (tx, rx) = mpsc::channel();
    let deleter = {
        let e = e.clone();
        std::thread::spawn(move || {
            let _ = tx.send(e.delete(&[k]));
        })
    };
    let skipped = rx.recv_timeout(Duration::from_secs(10));
    drop(c);
    deleter.join().unwrap();
    assert_eq!(
        skipped.expect("the delete waited for the store"),
        [],
        "a key being stored is skipped"
    );
    assert_eq!(e.devices_holding(k), [DeviceId(0)], "K stays");

    // A move of K, then a stripe mate's store: waited for, then deleted.
    for (holder, storing) in [(k, false), (mate, true)] {
        let c = claims.claim(holder);
        if storing {
            c.mark_storing();
        }
        let deleter = {
            let e = e.clone();
            std::thread::spawn(move || e.delete(&[k]))
        };
        // A schedule aid, not an assertion: let the delete reach the claim.
        std::thread::sleep(Duration::from_millis(50));
        let waited = !deleter.is_finished();
        drop(c);
        let deleted = deleter.join().unwrap();
        assert!(waited, "holder {holder:?}: the delete did not wait");
        assert_eq!(deleted, [k], "holder {holder:?}: deleted once free");
        store(&e, k);
    }
    assert_eq!(claims.held(), 0);
}
