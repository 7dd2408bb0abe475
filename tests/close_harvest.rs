//! `Engine::close` pops the last store completion entries, waiting for a
//! collector that holds the rings' lock: a store whose result a waiter
//! took before its entry was popped must not stay counted in use after
//! close. A review found close's first version (a `try_lock` harvest)
//! skipped it while another collector (here: a global pop dropping a large
//! store source inside its harvest) held the lock.
//!
//! Deterministic: a test allocator parks the one deallocation of a
//! magic-size buffer (the heavy store's source, freed by `rec.clear()`
//! inside the global pop's harvest, under the completion lock). Its own
//! test binary: the allocator is global.
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceSpec, Engine, EngineOptions};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key};

const MAGIC: usize = 3_333_331;
static PARKED: AtomicBool = AtomicBool::new(false);
static RELEASE: AtomicBool = AtomicBool::new(false);

struct Parking;
// SAFETY: forwards to System; only waits in dealloc for one size.
unsafe impl GlobalAlloc for Parking {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if l.size() == MAGIC {
            PARKED.store(true, Ordering::SeqCst);
            while !RELEASE.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
        }
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(p, l) };
    }
}
#[global_allocator]
static A: Parking = Parking;

const SLOT: usize = 4096;

fn wait_idle(e: &Engine) {
    let t = Instant::now();
    while e.status()["inflight_store_tasks"].as_u64() != Some(0) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "store never finished"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn close_frees_a_collected_store_record_while_another_collector_holds_the_ring() {
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(64 * SLOT), SLOT),
    };
    let e = Arc::new(Engine::open(vec![dev], SLOT, false, EngineOptions::default()).unwrap());
    // A store whose source is a MAGIC-capacity vector; finished, not collected.
    let mut heavy = Vec::with_capacity(MAGIC);
    heavy.extend_from_slice(&[1u8; 100]);
    let h = e
        .submit_store(vec![Key::digest(b"heavy")], vec![Buf::from(heavy)])
        .unwrap();
    wait_idle(&e);
    // Thread B: LMCache's global pop. It pops H's entry and, taking H's
    // result, frees H's source while holding the completion lock: parked.
    let b = {
        let e = e.clone();
        std::thread::spawn(move || e.pop_completed_stores())
    };
    let t = Instant::now();
    while !PARKED.load(Ordering::SeqCst) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "pop never freed the source"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // Store T finishes after B popped the ring; its waiter takes it by id.
    let t_id = e
        .submit_store(vec![Key::digest(b"t")], vec![Buf::from(vec![2u8; 100])])
        .unwrap();
    wait_idle(&e);
    let got = e.wait_store(t_id, Duration::from_secs(5));
    assert!(
        got.ready().is_some_and(|r| r.success),
        "T's result taken by id"
    );
    // The engine closes while B is still inside its pop: close waits for
    // the lock (a `try_lock` lost it and left T's entry in the ring).
    let closer = {
        let e = e.clone();
        std::thread::spawn(move || e.close())
    };
    std::thread::sleep(Duration::from_millis(300));
    RELEASE.store(true, Ordering::SeqCst);
    closer.join().unwrap();
    let popped = b.join().unwrap();
    assert_eq!(popped.len(), 1, "B took H only");
    assert_eq!(popped[0].0, h);
    // Every result was collected: H by the pop, T by its waiter.
    assert_eq!(
        e.status()["task_records_in_use"],
        0,
        "a closed engine holds a record whose result was collected"
    );
}
