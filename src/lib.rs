//! # daxkv
//!
//! A KV-cache store for LLM inference servers that keeps fixed-size cache
//! chunks in CXL / DAX memory (device-dax, fsdax or tmpfs files, memfds, or
//! anonymous memory for tests).
//!
//! The layers, bottom to top (one concept per module; docs/design.md §3):
//!
//! | module | owns |
//! |---|---|
//! | [`arena`] | one mapping, its size / alignment checks, the remap / close gate |
//! | [`fault`] | the SIGBUS handler: a device that faults in a copy fails, the process lives on |
//! | [`copy`] | non-temporal `to_dax` / `from_dax` with run-time CPU dispatch |
//! | [`slot`] | the atomic free bitmap and the per-slot state word |
//! | [`index`] | the lock-free key → slot index |
//! | [`core`] | [`DaxCore`]: one device's put / lookup+lock / load / delete |
//! | [`ring`] | SPSC submission / completion rings (heap or memfd) |
//! | [`notify`] | the non-blocking eventfd completions signal |
//! | [`cell`] | [`cell::Mailbox`]: the engine's reusable task-table cell |
//! | [`buf`] | caller buffers handed to the engine (owned, or raw with a lifetime rule) |
//! | [`numa`] | device NUMA node, topology and nearest CPUs from sysfs |
//! | [`memlimit`] | memory a memfd or slot table may take (MemAvailable, cgroup limits) |
//! | [`fstype`] | the file systems a device file may live on (no sysfs / procfs pseudo-files) |
//! | [`probe`] | what a device path is (devdax, kmem, unbound, file, …) from `stat` and sysfs, never opening it; the add / resize gates |
//! | [`config`] | LMCache's `dax` adapter JSON, validated with errors that name the field |
//! | [`engine`] | [`engine::Engine`]: worker pools, task table, device pool |
//! | [`metrics`] | the engine's counters in the Prometheus text format |
//! | [`store`] | [`DaxStore`]: the synchronous facade (LMCache's non-MP backend) |
//! | [`bench`](mod@bench) | the standard `daxkv bench` workload |
//! | [`reconfigure`] | the run-time reconfiguration protocol and [`reconfigure::Registry`] |
//! | [`http`] | the HTTP control plane (reconfigure API, `/health`, `/metrics`) |
//! | [`client`] | the control plane's bounded client (`daxkv status \| add \| remove \| resize`) |
//!
//! Unsafe code lives in `arena`, `copy`, `fault`, `ring`, `cell`, `buf`, `notify` and
//! `sys`; `core` and `bench` are `#![deny(unsafe_code)]` with single blocks
//! allowed where they copy into or out of the mapping (the arena's copies
//! are `unsafe fn`s whose contract, exclusive use of the range, only the
//! slot protocol in `core` can vouch for); every other module is
//! `#![forbid(unsafe_code)]`.

#![deny(missing_docs)]

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

pub mod arena;
pub mod bench;
pub mod buf;
pub mod busy;
pub mod cell;
pub mod client;
pub mod config;
pub mod copy;
pub mod core;
pub mod engine;
pub mod error;
pub mod fault;
pub mod fstype;
pub mod http;
pub mod index;
pub mod key;
pub mod memlimit;
pub mod metrics;
pub mod notify;
pub mod numa;
pub mod probe;
pub mod reconfigure;
pub mod ring;
pub mod serve;
pub mod slot;
pub mod store;
pub mod sync;
mod sys;

pub use crate::arena::{ArenaSource, ArenaSpec};
#[cfg(debug_assertions)]
pub use crate::core::StallPoint;
pub use crate::core::{
    CoreConfig, CoreStatus, DaxCore, PutFromPtrResult, PutOutcome, ReadSet, Reservation, SlotWriter,
};
pub use crate::error::{CoreError, OpenError, PutError};
pub use crate::key::Key;
pub use crate::slot::{Generation, SlotId};

pub use crate::store::{BatchPut, DaxStore, RestoreError, StoreConfig, StoreError};

/// The README's Rust examples, compiled and run by `cargo test --doc` so
/// they cannot drift from the API. Exists only while rustdoc collects
/// doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
