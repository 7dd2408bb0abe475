//! # Plumbing: how work and completions move between threads
//!
//! Device-agnostic parts the engine is built from; none of them knows a
//! device or a key.
//!
//! | module | owns |
//! |---|---|
//! | [`ring`] | SPSC submission / completion rings (heap or memfd) |
//! | [`notify`] | the non-blocking eventfd completions signal |
//! | [`cell`] | [`cell::Mailbox`]: the engine's reusable task-table cell |
//! | [`buf`] | caller buffers handed to the engine (owned, or raw with a lifetime rule) |
//! | [`busy`] | the caller memory of an FFI face's tasks in flight (no two tasks write one byte) |
//! | [`hash`] | a keyed fast hasher for the FFI faces' maps of digests and task ids |

pub mod buf;
pub mod busy;
pub mod cell;
pub mod hash;
pub mod notify;
pub mod ring;
