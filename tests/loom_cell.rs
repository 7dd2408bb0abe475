//! Loom: the task-table mailbox (fill / read / take).
//!
//! `RUSTFLAGS="--cfg daxkv_loom" CARGO_TARGET_DIR=target/loom cargo test --release --test loom_cell`
//!
//! Loom's `UnsafeCell` tracking turns any write that could overlap a read
//! (a taker writing while a worker still reads, a filler writing while a
//! poller reads) into a failure, so these models check the exclusion
//! claims, not only the values.
#![cfg(daxkv_loom)]

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

use daxkv::plumbing::cell::Mailbox;

#[path = "common/loom.rs"]
mod common;
use common::model;

/// A worker reading the value while a collector takes it: the collector
/// writes only after the worker's guard is gone, and sees the filled value.
#[test]
fn take_waits_for_readers() {
    model(|| {
        let m = Arc::new(Mailbox::new((0u64, 0u64)));
        m.fill(|v| *v = (7, 8)).unwrap();
        let m2 = m.clone();
        let worker = thread::spawn(move || {
            if let Some(g) = m2.read() {
                assert_eq!(*g, (7, 8));
            }
        });
        let g = m.read().expect("published");
        let got = g.take(std::mem::take).expect("only taker");
        assert_eq!(got, (7, 8));
        worker.join().unwrap();
        assert!(m.is_empty());
    });
}

/// Two collectors race for one result: exactly one gets it.
#[test]
fn one_of_two_takers_wins() {
    model(|| {
        let m = Arc::new(Mailbox::new(0u64));
        m.fill(|v| *v = 3).unwrap();
        let wins = Arc::new(AtomicUsize::new(0));
        let hs: Vec<_> = (0..2)
            .map(|_| {
                let (m, wins) = (m.clone(), wins.clone());
                thread::spawn(move || {
                    if let Some(v) = m.read().and_then(|g| g.take(|v| *v)) {
                        assert_eq!(v, 3);
                        wins.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(wins.load(Ordering::Relaxed), 1);
        assert!(m.is_empty());
    });
}

/// A refill after a take, racing a poller: the poller sees either nothing
/// or a whole value, never a value being written.
#[test]
fn refill_is_never_seen_half_written() {
    model(|| {
        let m = Arc::new(Mailbox::new((0u64, 0u64)));
        m.fill(|v| *v = (1, 1)).unwrap();
        let m2 = m.clone();
        let poller = thread::spawn(move || {
            if let Some(g) = m2.read() {
                let (a, b) = *g;
                assert_eq!(a, b, "torn value");
            }
        });
        m.read().unwrap().take(|_| ()).unwrap();
        m.fill(|v| {
            v.0 = 2;
            v.1 = 2;
        })
        .unwrap();
        poller.join().unwrap();
    });
}
