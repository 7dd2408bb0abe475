//! The engine allocates nothing per task after start-up, on either side: a
//! counting global allocator counts, separately, on threads the kernel
//! knows as `daxkv-*` (the workers; read with `prctl(PR_GET_NAME)`, which
//! allocates nothing) and on every other thread (the submitting and
//! collecting caller), while stores, lookups, loads, unlocks and deletes
//! run through the shared `&self` methods and through a `Submitter`.
//!
//! The caller's own vectors (keys, sources, destinations) are built before
//! the counting window: they are the caller's allocations, moved into the
//! task and dropped (freed, not allocated) at collection.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceSpec, Engine, EngineLeased, EngineOptions};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static WORKER_ALLOCS: AtomicUsize = AtomicUsize::new(0);
static OTHER_ALLOCS: AtomicUsize = AtomicUsize::new(0);

fn on_worker_thread() -> bool {
    let mut name = [0u8; 16];
    // SAFETY: PR_GET_NAME writes at most 16 bytes into the buffer.
    let r = unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) };
    r == 0 && name.starts_with(b"daxkv-")
}

fn count() {
    if COUNTING.load(Ordering::Relaxed) {
        if on_worker_thread() {
            WORKER_ALLOCS.fetch_add(1, Ordering::Relaxed);
        } else {
            OTHER_ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
    }
}

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract is System's contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const T: Duration = Duration::from_secs(10);

fn open() -> Engine {
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(TASKS * 16 * SLOT), SLOT),
    };
    let opts = EngineOptions {
        num_load_workers: 2,
        num_store_workers: 2,
        ..EngineOptions::default()
    };
    Engine::open(vec![dev], SLOT, false, opts).unwrap()
}

const SLOT: usize = 4096;
const TASKS: usize = 32;

/// Every task of one round, built before the counting window.
struct Round {
    stores: Vec<(Vec<Key>, Vec<Buf>)>,
    lookups: Vec<Vec<Key>>,
    loads: Vec<(Vec<Key>, Vec<Vec<u8>>)>,
}

fn build(keys: &[Vec<Key>], src: &std::sync::Arc<[u8]>) -> Round {
    Round {
        stores: keys
            .iter()
            .map(|k| {
                (
                    k.clone(),
                    k.iter().map(|_| Buf::Shared(src.clone())).collect(),
                )
            })
            .collect(),
        lookups: keys.to_vec(),
        loads: keys
            .iter()
            .map(|k| (k.clone(), vec![vec![0u8; SLOT]; 16]))
            .collect(),
    }
}

/// Run `rounds` (the first one uncounted: thread-locals, lazily
/// initialised state) and return the (worker, caller) allocation counts of
/// the rest. `submit` runs one round's tasks.
fn count_allocs(mut rounds: Vec<Round>, mut run: impl FnMut(Round)) -> (usize, usize) {
    let first = rounds.remove(0);
    run(first);
    WORKER_ALLOCS.store(0, Ordering::SeqCst);
    OTHER_ALLOCS.store(0, Ordering::SeqCst);
    for r in rounds {
        COUNTING.store(true, Ordering::SeqCst);
        run(r);
        COUNTING.store(false, Ordering::SeqCst);
    }
    (
        WORKER_ALLOCS.load(Ordering::SeqCst),
        OTHER_ALLOCS.load(Ordering::SeqCst),
    )
}

fn task_keys() -> Vec<Vec<Key>> {
    (0..TASKS as u64)
        .map(|t| {
            (0..16u64)
                .map(|i| Key::digest(&(t * 16 + i).to_le_bytes()))
                .collect()
        })
        .collect()
}

// One test function: the counters are process-wide, so the two paths run
// one after the other, not as parallel tests.
#[test]
fn no_allocation_per_task_on_either_side() {
    let e = open();
    let keys = task_keys();
    let src: std::sync::Arc<[u8]> = vec![7u8; SLOT].into();
    // Enough rounds that the counted ones reuse task-table records the
    // first round did not touch (ids move on through the table).
    let rounds = || (0..4).map(|_| build(&keys, &src)).collect::<Vec<_>>();
    let mut done = Vec::with_capacity(TASKS);
    let mut gone = Vec::with_capacity(16);

    // The shared `&self` methods.
    let (w, o) = count_allocs(rounds(), |r| {
        for (k, b) in r.stores {
            e.submit_store(k, b).unwrap();
            done.clear();
            assert_eq!(e.wait_stores_into(&mut done, T), 1);
            assert!(done[0].1.success);
        }
        for k in r.lookups {
            let id = e.submit_lookup_and_lock(k).unwrap();
            assert_eq!(e.wait_lookup(id, T).ready().unwrap().count_ones(), 16);
        }
        for (k, b) in r.loads {
            let id = e.submit_load(k, b).unwrap();
            let got = e.wait_load(id, T).ready().unwrap();
            assert_eq!(got.bitmap.count_ones(), 16);
            assert!(got.bufs.iter().all(|b| b.iter().all(|&x| x == 7)));
        }
        for k in &keys {
            e.submit_unlock(k);
            gone.clear();
            assert_eq!(e.delete_into(k, &mut gone), 16);
        }
    });
    println!("shared path: {w} worker and {o} caller allocations over 3 x 96 tasks");
    assert_eq!(w, 0, "engine workers allocated on the data path");
    assert_eq!(o, 0, "the submitting / collecting caller allocated");

    // A `Submitter` (created outside the window: it allocates its rings).
    let mut sub = e.submitter().unwrap();
    let (w, o) = count_allocs(rounds(), |r| {
        for (k, b) in r.stores {
            sub.submit_store(k, b).unwrap();
            done.clear();
            assert_eq!(e.wait_stores_into(&mut done, T), 1);
            assert!(done[0].1.success);
        }
        for k in r.lookups {
            let id = sub.submit_lookup_and_lock(k).unwrap();
            assert_eq!(e.wait_lookup(id, T).ready().unwrap().count_ones(), 16);
        }
        for (k, b) in r.loads {
            let id = sub.submit_load(k, b).unwrap();
            let got = e.wait_load(id, T).ready().unwrap();
            assert_eq!(got.bitmap.count_ones(), 16);
        }
        for k in &keys {
            e.submit_unlock(k);
            gone.clear();
            assert_eq!(e.delete_into(k, &mut gone), 16);
        }
    });
    println!("submitter path: {w} worker and {o} caller allocations over 3 x 96 tasks");
    assert_eq!(w, 0, "engine workers allocated on the data path");
    assert_eq!(o, 0, "the submitting / collecting caller allocated");

    // Slot leases (docs/leases.md), with the `_into` calls into vectors
    // reserved outside the window: lease, fill through the pointer,
    // commit, look up and lock, read lease, check, release, unlock,
    // delete.
    let lens = [SLOT; 16];
    let mut leased = Vec::with_capacity(16);
    let mut leases = Vec::with_capacity(16);
    let mut commits = Vec::with_capacity(16);
    let mut reads = Vec::with_capacity(16);
    let (w, o) = count_allocs(rounds(), |r| {
        for (k, lookup) in keys.iter().zip(r.lookups) {
            leased.clear();
            assert_eq!(e.lease_store_into(k, &lens, &mut leased).unwrap(), 16);
            for r in leased.drain(..) {
                let Ok(EngineLeased::Leased(l)) = r else {
                    panic!("{r:?}");
                };
                // SAFETY: the lease hands out `len()` writable bytes at
                // `ptr()` until it ends; nothing else touches them.
                unsafe { std::ptr::write_bytes(l.ptr(), 7, l.len()) };
                leases.push(l);
            }
            commits.clear();
            assert_eq!(e.commit_into(&mut leases, &mut commits), 16);
            let id = e.submit_lookup_and_lock(lookup).unwrap();
            assert_eq!(e.wait_lookup(id, T).ready().unwrap().count_ones(), 16);
            reads.clear();
            assert_eq!(e.lease_load_into(k, &mut reads), 16);
            for r in reads.drain(..) {
                let l = r.unwrap().unwrap();
                // SAFETY: a read lease hands out `len()` readable bytes at
                // `ptr()` until it ends.
                let got = unsafe { std::slice::from_raw_parts(l.ptr(), l.len()) };
                assert!(got.iter().all(|&x| x == 7));
            }
            e.submit_unlock(k);
            gone.clear();
            assert_eq!(e.delete_into(k, &mut gone), 16);
        }
    });
    println!("lease path: {w} worker and {o} caller allocations over 3 x 32 x 16 leases");
    assert_eq!(w, 0, "engine workers allocated");
    assert_eq!(o, 0, "the leasing caller allocated");
}
