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
