//! # The device: the code that touches DAX memory
//!
//! One mapped device and everything that reads or writes its bytes: the
//! mapping and its gate, the SIGBUS handler, the copies, the slot state
//! words, the index and [`core::DaxCore`], which ties them together.
//!
//! | module | owns |
//! |---|---|
//! | [`arena`] | one mapping, its size / alignment checks, the remap / close gate |
//! | [`fault`] | the SIGBUS handler: a device that faults in a copy fails, the process lives on |
//! | [`copy`] | non-temporal `to_dax` / `from_dax` with run-time CPU dispatch |
//! | [`slot`] | the atomic free bitmap and the per-slot state word |
//! | [`index`] | the lock-free key → slot index |
//! | [`core`] | [`DaxCore`](core::DaxCore): one device's put / lookup+lock / load / delete |
//! | [`error`] | the errors of opening, putting and the gate, split by operation |

pub mod arena;
pub mod copy;
pub mod core;
pub mod error;
pub mod fault;
pub mod gate;
pub mod index;
pub mod lease;
pub mod slot;
