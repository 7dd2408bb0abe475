//! The DaxCore data path allocates nothing after start-up: a counting
//! global allocator around put / lookup+lock / load / unlock / delete of
//! single keys and of batches through the `_into` variants.
//!
//! (The engine's task path still allocates per task: its key, result and
//! part vectors. docs/performance.md tracks that.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use daxkv::device::arena::ArenaSpec;
use daxkv::{CoreConfig, DaxCore, Key, PutOutcome};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Set on the thread that runs the data path: the core has no threads
    /// of its own, and the test harness's main thread may still be doing
    /// its own bookkeeping (allocating) after it started the test thread.
    static DATA_PATH_THREAD: Cell<bool> = const { Cell::new(false) };
}

fn count() {
    if COUNTING.load(Ordering::Relaxed) && DATA_PATH_THREAD.with(Cell::get) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
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

#[test]
fn core_data_path_does_not_allocate() {
    const SLOT: usize = 4096;
    let core = DaxCore::open(&CoreConfig::new(ArenaSpec::memfd(64 * SLOT), SLOT)).unwrap();
    let keys: Vec<Key> = (0..64u64).map(|i| Key::digest(&i.to_le_bytes())).collect();
    let src = vec![0x42u8; SLOT];
    let mut dst = vec![0u8; SLOT];
    let mut hits = vec![false; 16];
    // Warm up once (thread-locals, lazily initialised kernel choice).
    core.put(keys[0], &src, 0).unwrap();
    core.load_into(keys[0], &mut dst).unwrap();
    core.delete(keys[0], false);

    DATA_PATH_THREAD.with(|c| c.set(true));
    ALLOCS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    for round in 0..10 {
        for &k in &keys {
            assert_eq!(core.put(k, &src, round), Ok(PutOutcome::Stored));
        }
        core.exists_many_into(&keys[..16], true, &mut hits).unwrap();
        let all = hits.iter().all(|&h| h);
        core.unlock_many(&keys[..16]);
        let mut loaded = 0;
        for &k in &keys {
            loaded += usize::from(core.load_into(k, &mut dst) == Some(SLOT));
        }
        let mut deleted = 0;
        for &k in &keys {
            deleted += usize::from(core.delete(k, false));
        }
        assert!(all && loaded == 64 && deleted == 64, "round {round}");
    }
    COUNTING.store(false, Ordering::SeqCst);
    assert_eq!(
        ALLOCS.load(Ordering::SeqCst),
        0,
        "heap allocations on the data path"
    );
    assert_eq!(dst, src);
    assert_eq!(core.live_slot_count(), 0);
}
