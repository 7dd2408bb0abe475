//! # daxkv
//!
//! A KV-cache store for LLM inference servers that keeps fixed-size cache
//! chunks in CXL / DAX memory (device-dax, fsdax or tmpfs files, memfds, or
//! anonymous memory for tests).
//!
//! The crate is grouped by layer, bottom to top; a module imports only from
//! its own layer and the layers below (docs/design.md §3, checked by
//! `tests/layers.rs`):
//!
//! | layer | modules | owns |
//! |---|---|---|
//! | root | [`key`], [`sync`] | the 128-bit key digest; the std / loom atomics switch |
//! | [`host`] | `sys`, [`host::devdax`], [`host::numa`], [`host::memlimit`], [`host::fstype`], [`host::probe`] | what the machine, its devices and its kernel say |
//! | [`plumbing`] | [`plumbing::ring`], [`plumbing::notify`], [`plumbing::cell`], [`plumbing::buf`], [`plumbing::busy`] | how work and completions move between threads |
//! | [`device`] | [`device::arena`], [`device::fault`], [`device::copy`], [`device::slot`], [`device::index`], [`device::core`], [`device::error`] | the code that touches DAX memory: [`DaxCore`] |
//! | root | [`store`] | [`DaxStore`]: the synchronous facade (LMCache's non-MP backend) |
//! | [`engine`] | options, submit, task, worker, pool, claims, hotplug, metrics, … | [`Engine`]: worker pools, task table, device pool |
//! | [`control`] | [`control::config`], [`control::metrics`], [`control::reconfigure`], [`control::http`] | what an operator drives at run time |
//! | [`cli`] | [`cli::bench`](mod@cli::bench), [`cli::serve`], [`cli::client`] | what the `daxkv` commands do |
//!
//! Unsafe code lives in `host::sys`, the `plumbing` modules but `busy`,
//! and `device::{arena, copy, fault}`; `device::core` and `cli::bench` are
//! `#![deny(unsafe_code)]` with single blocks allowed where they copy into
//! or out of the mapping (the arena's copies are `unsafe fn`s whose
//! contract, exclusive use of the range, only the slot protocol in `core`
//! can vouch for); every other module is `#![forbid(unsafe_code)]`.

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
#[cfg(feature = "test-hooks")]
pub use crate::device::core::StallPoint;
pub use crate::device::core::{
    CoreConfig, CoreStatus, DaxCore, PutFromPtrResult, PutOutcome, ReadSet, Reservation, SlotWriter,
};
pub use crate::device::error::{CoreError, OpenError, PutError};
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
