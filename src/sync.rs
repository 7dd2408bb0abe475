//! Atomics shim: `std` atomics normally, loom's under `--cfg daxkv_loom`.
//!
//! A crate-specific cfg (not `loom`) so dependencies don't switch with it
//! (the crossbeam habit). Only the modules whose state machines loom checks
//! (`slot`, `index`, `core`, `ring`, `cell`) import from here.
#![forbid(unsafe_code)]

#[cfg(daxkv_loom)]
pub use loom::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};
#[cfg(not(daxkv_loom))]
pub use std::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};

#[cfg(daxkv_loom)]
pub use loom::thread::yield_now;
#[cfg(not(daxkv_loom))]
pub use std::thread::yield_now;

/// One step of a bounded spin. Every 32nd step yields the CPU: when the
/// scheduler has put the waiter and the thread it waits for on the same
/// (v)CPU, a pure spin would hold that CPU for the whole spin window while
/// the other thread cannot run (seen here: each task then cost about twice
/// the spin time). A yield costs well under a microsecond when nothing else
/// is runnable.
pub(crate) fn spin_pause(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    if spins.is_multiple_of(32) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}
