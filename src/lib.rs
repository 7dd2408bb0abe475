//! # daxkv
//!
//! A KV-cache store for LLM inference servers that keeps fixed-size cache
//! chunks in CXL / DAX memory (device-dax, fsdax or tmpfs files, memfds, or
//! anonymous memory for tests).
//!
//! The crate is grouped by layer, bottom to top: [`key`] and [`sync`],
//! [`host`] (what the machine and its kernel say), [`plumbing`] (rings,
//! eventfds, cells, buffers), [`device`] (the code that touches DAX memory:
//! [`DaxCore`]), [`store`] ([`DaxStore`], the synchronous facade),
//! [`engine`] ([`Engine`]: worker pools, task table, device pool),
//! [`control`] (config, metrics, reconfiguration, HTTP) and [`cli`] (what
//! the `daxkv` commands do). Each folder's module doc lists its modules.
//! What a layer may import and where unsafe code may live is the layer
//! rule of docs/design.md §3, checked by `tests/layers.rs`.

#![deny(missing_docs)]
#![warn(unreachable_pub)]
#![warn(missing_debug_implementations)]

/// `eprintln!` that never panics. The log line of an error the caller is
/// also told about, or of a worker's trouble, is dropped when stderr is
/// gone (`daxkv serve 2>&1 | tee log` and the `tee` killed, a full disk):
/// `eprintln!` would panic there, turning a control-plane refusal into a
/// 500 and killing a worker in its panic handler.
macro_rules! log_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

/// A function that is `pub` with the `test-hooks` feature and
/// `pub(crate)` without it: the raw-copy baselines that `daxkv bench` uses
/// and this crate's benches and tests reach from outside (Cargo.toml,
/// `[features]`). Written once, emitted twice, one per visibility.
macro_rules! test_hooks_pub {
    ($(#[$attr:meta])* fn $($rest:tt)*) => {
        #[cfg(feature = "test-hooks")]
        $(#[$attr])* pub fn $($rest)*
        #[cfg(not(feature = "test-hooks"))]
        $(#[$attr])* pub(crate) fn $($rest)*
    };
    // A qualified function (`unsafe fn`).
    ($(#[$attr:meta])* $qualifier:ident fn $($rest:tt)*) => {
        #[cfg(feature = "test-hooks")]
        $(#[$attr])* pub $qualifier fn $($rest)*
        #[cfg(not(feature = "test-hooks"))]
        $(#[$attr])* pub(crate) $qualifier fn $($rest)*
    };
}

pub mod key;
pub mod sync;

pub mod host;

pub mod plumbing;

pub mod device;

pub mod store;

pub mod engine;

pub mod control;

pub mod cli;

pub use crate::device::arena::{ArenaSource, ArenaSpec};
#[cfg(feature = "failpoints")]
pub use crate::device::core::StallPoint;
pub use crate::device::core::{
    CoreConfig, CoreStatus, DaxCore, LeasedStore, PutFromPtrResult, PutOutcome, ReadLease, ReadSet,
    Reservation, SlotWriter, StoreLease,
};
pub use crate::device::error::{CoreError, OpenError, PutError};
pub use crate::device::lease::{LeaseError, LEASES_MAX};
pub use crate::device::slot::{Generation, SlotId};
pub use crate::engine::{Answer, Engine, Submitter, TaskId};
pub use crate::key::Key;

pub use crate::store::{BatchPut, DaxStore, RestoreError, StoreConfig, StoreError};

/// The README's Rust examples, compiled and run by `cargo test --doc` so
/// they cannot drift from the API. Exists only while rustdoc collects
/// doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The Rust examples of `docs/engine.md`, compiled and run by `cargo test
/// --doc` as the README's are.
#[cfg(doctest)]
#[doc = include_str!("../docs/engine.md")]
pub struct EngineDocDoctests;

/// The Rust example of `docs/control-plane.md`, compiled and run by `cargo
/// test --doc` as the README's are.
#[cfg(doctest)]
#[doc = include_str!("../docs/control-plane.md")]
pub struct ControlPlaneDocDoctests;
