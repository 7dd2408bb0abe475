//! The engine's per-object path through a `Submitter` in a loop, for
//! `valgrind --tool=callgrind` (see perf/README.md): N objects stored,
//! looked up and locked, loaded (submit on the caller's own rings, run by a
//! worker, collected with `wait_*`), then unlocked and deleted, in tasks of
//! 16 keys with 8 tasks in flight, four rounds.
//!
//! Frozen for comparisons: one worker per pool, `spin` and `wait_spin`
//! zero (workers and the caller park at once, so no spin loop's count
//! depends on scheduling), default signalling. Fix the copy kernel with
//! `DAXKV_COPY_KERNEL=avx2` (valgrind hides AVX-512, so that is also what
//! it picks by itself on an AVX-512 host).
//!
//! `cargo run --release --example per_object_engine -- [objects] [size_bytes]`

use std::sync::Arc;
use std::time::Duration;

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceSpec, Engine, EngineOptions};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key};

const TASK: usize = 16;
const IN_FLIGHT: usize = 8;
const ROUNDS: usize = 4;
const T: Duration = Duration::from_secs(120);

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(2048);
    let size: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(4096);
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(n * size).populate(true), size),
    };
    let opts = EngineOptions {
        num_store_workers: 1,
        num_lookup_workers: 1,
        num_load_workers: 1,
        spin: Duration::ZERO,
        wait_spin: Duration::ZERO,
        task_slots: 4 * IN_FLIGHT,
        task_keys: TASK,
        ..EngineOptions::default()
    };
    let e = Engine::open(vec![dev], size, false, opts).expect("open");
    let mut sub = e.submitter().expect("submitter");
    let keys: Vec<Vec<Key>> = (0..n as u64)
        .map(|i| Key::digest(&i.to_le_bytes()))
        .collect::<Vec<_>>()
        .chunks(TASK)
        .map(<[Key]>::to_vec)
        .collect();
    let src: Arc<[u8]> = vec![0x5Au8; size].into();
    // Destinations handed back by each load and reused by the next.
    let mut dsts: Vec<Vec<Vec<u8>>> = (0..IN_FLIGHT)
        .map(|_| (0..TASK).map(|_| vec![0u8; size]).collect())
        .collect();
    let mut done = Vec::with_capacity(IN_FLIGHT);
    let mut ids = Vec::with_capacity(IN_FLIGHT);
    let mut gone = Vec::with_capacity(TASK);
    for round in 0..ROUNDS {
        for batch in keys.chunks(IN_FLIGHT) {
            for k in batch {
                let bufs = k.iter().map(|_| Buf::Shared(src.clone())).collect();
                sub.submit_store(k.clone(), bufs).expect("submit store");
            }
            let mut got = 0;
            while got < batch.len() {
                done.clear();
                let n = e.wait_stores_into(&mut done, T);
                assert!(n > 0, "stores timed out");
                assert!(done.iter().all(|(_, r)| r.success), "round {round}");
                got += n;
            }
        }
        for batch in keys.chunks(IN_FLIGHT) {
            ids.clear();
            for k in batch {
                ids.push(sub.submit_lookup_and_lock(k.clone()).expect("lookup"));
            }
            for (&id, k) in ids.iter().zip(batch) {
                let hits = e.wait_lookup(id, T).ready().expect("lookup result");
                assert_eq!(hits.count_ones(), k.len(), "round {round}");
            }
        }
        for batch in keys.chunks(IN_FLIGHT) {
            ids.clear();
            for (k, d) in batch.iter().zip(dsts.iter_mut()) {
                let mut bufs = std::mem::take(d);
                bufs.truncate(k.len());
                ids.push(sub.submit_load(k.clone(), bufs).expect("load"));
            }
            for ((&id, k), d) in ids.iter().zip(batch).zip(dsts.iter_mut()) {
                let r = e.wait_load(id, T).ready().expect("load result");
                assert_eq!(r.bitmap.count_ones(), k.len(), "round {round}");
                *d = r.bufs;
                while d.len() < TASK {
                    d.push(vec![0u8; size]);
                }
            }
        }
        for k in &keys {
            e.submit_unlock(k);
            gone.clear();
            assert_eq!(e.delete_into(k, &mut gone), k.len(), "round {round}");
        }
    }
    assert_eq!(dsts[0][0][0], 0x5A);
    e.close();
}
