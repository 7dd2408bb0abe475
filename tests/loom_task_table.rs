//! Loom: the task table's record free set with a store completion ring,
//! a popper racing a worker.
//!
//! `RUSTFLAGS="--cfg daxkv_loom" CARGO_TARGET_DIR=target/loom cargo test --release --test loom_task_table`
//!
//! The engine's own parts: [`RecordSet`] (claim / release of records) and
//! [`pop_released`] (pop a batch, hand the ring space back), over the real
//! SPSC ring. The submitter-and-worker thread claims a free record for each
//! task and pushes its completion; the collector pops completions and frees
//! their records, as `Engine::pop_completed_stores_into` does. The ring has
//! exactly as many entries as there are records (the engine's minimum).
//!
//! Checked: a completion always finds room (none dropped), every task is
//! collected exactly once, and a record is never handed out twice.
//!
//! Fails without the rule: with `pop_released` not syncing (the
//! collector's `sync` moved after its loop), loom finds the schedule where
//! a record freed by the collector is
//! refilled and its completion meets a full ring ("completion dropped").
#![cfg(daxkv_loom)]

use loom::sync::Arc;
use loom::thread;

use daxkv::engine::records::{pop_released, RecordSet};
use daxkv::plumbing::ring::{Cqe, Ring};

#[path = "common/loom.rs"]
mod common;
use common::model;

const RECORDS: usize = 2;
const TASKS: u64 = 3;

#[test]
fn completions_always_fit_and_records_free_once() {
    model(|| {
        let set = Arc::new(RecordSet::new(RECORDS));
        let ring = Ring::<Cqe>::heap(RECORDS as u32).unwrap();
        let (mut cq_p, mut cq_c) = ring.split();
        let worker = {
            let set = set.clone();
            thread::spawn(move || {
                for t in 0..TASKS {
                    // Submit: any free record (the collector frees them).
                    let rec = loop {
                        if let Some(r) = set.claim() {
                            break r;
                        }
                        thread::yield_now();
                    };
                    // Run and publish: the completion must fit.
                    let cqe = Cqe {
                        task: (t << 8) | u64::from(rec),
                        ok: 1,
                        keys_ok: 1,
                    };
                    assert!(cq_p.push(cqe).is_ok(), "completion dropped");
                    cq_p.sync();
                }
            })
        };
        // The collector.
        let mut seen = [false; TASKS as usize];
        let mut got = 0;
        let mut batch = [Cqe {
            task: 0,
            ok: 0,
            keys_ok: 0,
        }; RECORDS];
        while got < TASKS {
            let (n, err) = pop_released(&mut cq_c, &mut batch);
            assert!(err.is_none(), "{err:?}");
            for c in &batch[..n] {
                let t = (c.task >> 8) as usize;
                assert!(!seen[t], "task {t} collected twice");
                seen[t] = true;
                set.release((c.task & 0xff) as u32);
            }
            // A second hand-back after the loop (harmless: `pop_released`
            // already did).
            cq_c.sync();
            got += n as u64;
            if n == 0 {
                thread::yield_now();
            }
        }
        worker.join().unwrap();
        assert_eq!(set.in_use(), 0, "a record left taken");
    });
}

/// Store results taken by id (`Engine::wait_store`) racing the global pop
/// A by-id taker empties a record without popping its
/// completion; if it freed the record then, the refilled record's next
/// completion could meet a ring still holding the old entry. The record
/// is freed by whoever finishes second of "result taken" and "completion
/// popped" ([`Collect`]).
///
/// Here: one record, a ring of one entry, up to two tasks through it. The
/// worker claims the record for each task (a task that finds no free
/// record is refused, as a submit would be), publishes the result (the
/// record's result word, standing in for its mailbox) and pushes the
/// completion; a by-id taker looks once for each task; the popper pops
/// completions, takes what is still there and marks them popped, twice
/// while the others run and then until the ring is empty. No thread
/// spins (loom explores spin loops badly). Checked: a completion always
/// finds room, each published task is delivered exactly once, the record
/// is freed once per task (`RecordSet::release` asserts) and free at the
/// end.
///
/// Fails without the rule: with the taker freeing the
/// record at its take (ignoring `Collect`), loom finds "completion
/// dropped".
#[test]
fn by_id_takers_and_the_pop_free_each_record_once() {
    use daxkv::engine::records::Collect;
    use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    const NONE: u64 = u64::MAX;
    fn take(result: &AtomicU64, id: u64) -> bool {
        result
            .compare_exchange(id, NONE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
    model(|| {
        let set = Arc::new(RecordSet::new(1));
        let collect = Arc::new(Collect::default());
        let result = Arc::new(AtomicU64::new(NONE));
        let delivered = Arc::new(AtomicUsize::new(0));
        let ring = Ring::<Cqe>::heap(1).unwrap();
        let (mut cq_p, mut cq_c) = ring.split();
        let worker = {
            let (set, collect, result) = (set.clone(), collect.clone(), result.clone());
            thread::spawn(move || {
                let mut published = 0;
                for t in 0..2u64 {
                    // Refused when the record is not free yet.
                    let Some(_rec) = set.claim() else { continue };
                    collect.reset();
                    result.store(t, Ordering::Release);
                    let cqe = Cqe {
                        task: t,
                        ok: 1,
                        keys_ok: 1,
                    };
                    assert!(cq_p.push(cqe).is_ok(), "completion dropped");
                    cq_p.sync();
                    published += 1;
                }
                published
            })
        };
        let taker = {
            let (set, collect, result, delivered) = (
                set.clone(),
                collect.clone(),
                result.clone(),
                delivered.clone(),
            );
            thread::spawn(move || {
                // One look per task, as a `query_store` caller would.
                for t in 0..2u64 {
                    if take(&result, t) {
                        delivered.fetch_add(1, Ordering::Relaxed);
                        if collect.taken() {
                            set.release(0);
                        }
                    }
                }
            })
        };
        // The popper (the global pop).
        let mut batch = [Cqe {
            task: 0,
            ok: 0,
            keys_ok: 0,
        }; 1];
        let mut pop = |cq_c: &mut daxkv::plumbing::ring::Consumer<Cqe>| {
            let (n, err) = pop_released(cq_c, &mut batch);
            assert!(err.is_none(), "{err:?}");
            for c in &batch[..n] {
                if take(&result, c.task) {
                    delivered.fetch_add(1, Ordering::Relaxed);
                    // Taken first, popped second: `harvested` frees.
                    let _ = collect.taken();
                }
                if collect.harvested() {
                    set.release(0);
                }
            }
            n
        };
        pop(&mut cq_c);
        pop(&mut cq_c);
        let published = worker.join().unwrap();
        taker.join().unwrap();
        while pop(&mut cq_c) > 0 {}
        assert_eq!(
            delivered.load(Ordering::Relaxed),
            published,
            "each published task delivered once"
        );
        assert_eq!(set.in_use(), 0, "a record left taken");
    });
}
