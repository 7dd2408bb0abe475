//! Loom: the SPSC ring's index protocol, its sleep / wake handshake, and
//! the close / orphan handshake.
//!
//! `RUSTFLAGS="--cfg daxkv_loom" CARGO_TARGET_DIR=target/loom cargo test --release --test loom_ring`
#![cfg(daxkv_loom)]

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

use daxkv::plumbing::ring::Ring;

#[path = "common/loom.rs"]
mod common;
use common::model;

/// Three entries through a two-slot ring arrive complete and in order
/// (loom's cells check that no slot is read while it is written).
#[test]
fn entries_arrive_in_order_through_a_small_ring() {
    model(|| {
        let r = Ring::<u64>::heap(2).unwrap();
        let (mut p, mut c) = r.split();
        let t = thread::spawn(move || {
            let mut i = 0;
            while i < 3 {
                if p.push(10 + i).is_ok() {
                    i += 1;
                    p.sync();
                } else {
                    thread::yield_now();
                }
            }
        });
        let mut got = Vec::new();
        while got.len() < 3 {
            match c.pop().unwrap() {
                Some(v) => {
                    got.push(v);
                    c.sync();
                }
                None => thread::yield_now(),
            }
        }
        t.join().unwrap();
        assert_eq!(got, vec![10, 11, 12]);
    });
}

/// No lost wakeup: if the consumer decides to sleep on an empty ring, the
/// producer's publish sees its NEED_WAKEUP flag and signals.
#[test]
fn no_lost_wakeup() {
    model(|| {
        let r = Ring::<u64>::heap(2).unwrap();
        let (mut p, mut c) = r.split();
        let signalled = Arc::new(AtomicBool::new(false));
        let s2 = signalled.clone();
        let t = thread::spawn(move || {
            p.push(7).unwrap();
            if p.sync() {
                s2.store(true, Ordering::SeqCst);
            }
        });
        let sleeps = c.prepare_wait().unwrap();
        t.join().unwrap();
        if sleeps {
            assert!(
                signalled.load(Ordering::SeqCst),
                "consumer slept and nobody woke it"
            );
            c.end_wait();
        }
        assert_eq!(c.pop().unwrap(), Some(7));
    });
}

/// `is_orphaned` never gives up on a ring with an entry in it: the
/// producer's drop publishes, then sets CLOSED
/// (Release); the consumer reads CLOSED (Acquire), then `tail`. With both
/// made Relaxed, loom finds the run where the consumer sees CLOSED but a
/// stale tail, calls the ring orphaned and loses the entry. An
/// `Arc::strong_count` test would have the same hole, out of loom's sight
/// (std's `Arc`).
#[test]
fn orphan_check_sees_the_last_publish() {
    model(|| {
        let r = Ring::<u64>::heap(2).unwrap();
        let (mut p, mut c) = r.split();
        let t = thread::spawn(move || {
            p.push(7).unwrap();
            drop(p);
        });
        let mut got = Vec::new();
        loop {
            if let Some(v) = c.pop().unwrap() {
                got.push(v);
            } else if c.is_orphaned() {
                break;
            } else {
                thread::yield_now();
            }
        }
        t.join().unwrap();
        assert_eq!(got, vec![7], "the ring was dropped with an entry in it");
    });
}
