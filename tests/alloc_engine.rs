//! Engine workers allocate nothing per task after start-up: a counting
//! global allocator that counts only on threads the kernel knows as
//! `daxkv-*` (read with `prctl(PR_GET_NAME)`, which allocates nothing)
//! while stores, lookups, loads, unlocks and deletes run.
//!
//! The submitting side still allocates one task record per task (the task
//! and its result bits); that is counted and reported, not asserted.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use daxkv::arena::ArenaSpec;
use daxkv::buf::Buf;
use daxkv::engine::{DeviceSpec, Engine, EngineOptions};
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

#[test]
fn workers_do_not_allocate_per_task() {
    const SLOT: usize = 4096;
    const TASKS: usize = 32;
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(TASKS * 16 * SLOT), SLOT),
    };
    let opts = EngineOptions {
        num_load_workers: 2,
        ..EngineOptions::default()
    };
    let e = Engine::open(vec![dev], SLOT, false, opts).unwrap();
    let keys: Vec<Vec<Key>> = (0..TASKS as u64)
        .map(|t| {
            (0..16u64)
                .map(|i| Key::digest(&(t * 16 + i).to_le_bytes()))
                .collect()
        })
        .collect();
    let src: std::sync::Arc<[u8]> = vec![7u8; SLOT].into();
    let round = |counting: bool| {
        // Build every submission before the window: those are the caller's.
        let stores: Vec<(Vec<Key>, Vec<Buf>)> = keys
            .iter()
            .map(|k| {
                (
                    k.clone(),
                    k.iter().map(|_| Buf::Owned(src.clone())).collect(),
                )
            })
            .collect();
        let lookups: Vec<Vec<Key>> = keys.clone();
        let loads: Vec<(Vec<Key>, Vec<Vec<u8>>)> = keys
            .iter()
            .map(|k| (k.clone(), vec![vec![0u8; SLOT]; 16]))
            .collect();
        COUNTING.store(counting, Ordering::SeqCst);
        for (k, b) in stores {
            e.submit_store(k, b).unwrap();
            assert!(e.wait_stores(T).iter().all(|(_, r)| r.success));
        }
        for k in lookups {
            let id = e.submit_lookup_and_lock(k).unwrap();
            assert_eq!(e.wait_lookup(id, T).unwrap().count_ones(), 16);
        }
        for (k, b) in loads {
            let id = e.submit_load(k, b).unwrap();
            let r = e.wait_load(id, T).unwrap();
            assert_eq!(r.bitmap.count_ones(), 16);
            assert!(r.bufs.iter().all(|b| b.iter().all(|&x| x == 7)));
        }
        for k in &keys {
            e.submit_unlock(k);
            assert_eq!(e.delete(k).len(), 16);
        }
        COUNTING.store(false, Ordering::SeqCst);
    };
    round(false); // warm-up: thread-locals, lazily initialised state
    WORKER_ALLOCS.store(0, Ordering::SeqCst);
    OTHER_ALLOCS.store(0, Ordering::SeqCst);
    round(true);
    let (w, o) = (
        WORKER_ALLOCS.load(Ordering::SeqCst),
        OTHER_ALLOCS.load(Ordering::SeqCst),
    );
    println!(
        "allocations: workers {w}, submitting thread {o} for {} tasks",
        3 * TASKS
    );
    assert_eq!(w, 0, "engine workers allocated on the data path");
}
