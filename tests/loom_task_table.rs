//! Loom: the task table's record free set with a store completion ring,
//! a popper racing a worker (issue 8, defects 4 and 12).
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
//! Fails with the fix reverted (checked once): with `pop_released` not
//! syncing (the collector's `sync` moved after its loop, as before the
//! fix), loom finds the schedule where a record freed by the collector is
//! refilled and its completion meets a full ring ("completion dropped").
#![cfg(daxkv_loom)]

use loom::sync::Arc;
use loom::thread;

use daxkv::engine::records::{pop_released, RecordSet};
use daxkv::ring::{Cqe, Ring};

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
            // Where the collector used to hand the space back (harmless
            // now: `pop_released` already did).
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
