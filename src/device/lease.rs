//! # Leases: a slot's bytes handed to the caller across calls
//!
//! A lease lets a caller copy into or out of a slot itself, for as long as
//! it likes, with whatever engine it likes (a GPU's copy engine into a
//! CUDA-registered mapping): daxkv hands out where the bytes are and keeps
//! the slot and the mapping still until the lease ends.
//!
//! - [`DaxCore::lease_store`](crate::device::core::DaxCore::lease_store) reserves a slot
//!   for a key (the put protocol up to the copy: the key is in flight,
//!   invisible to lookups and loads) and returns a [`StoreLease`](crate::device::core::StoreLease): its
//!   pointer and length. [`StoreLease::commit`](crate::device::core::StoreLease::commit) makes the key readable,
//!   exactly as a put's commit does; [`StoreLease::abort`](crate::device::core::StoreLease::abort) (or dropping
//!   the lease) frees the slot. A key already stored or in flight answers
//!   [`LeasedStore::AlreadyPresent`](crate::device::core::LeasedStore::AlreadyPresent), with no pointer.
//! - [`DaxCore::lease_load`](crate::device::core::DaxCore::lease_load) borrows a
//!   readable slot and returns a [`ReadLease`](crate::device::core::ReadLease): its pointer, the payload's
//!   length and the caller's tag. The slot is not freed or reused until
//!   the lease drops; a delete meanwhile detaches the key (a later lookup
//!   misses) and the slot is freed when the lease goes.
//!
//! ## The contract
//!
//! The caller finishes its copy before it commits, aborts or drops a
//! lease (for a GPU: the stream synchronized or its event waited for).
//! A copy still running after that writes into a slot that may already
//! hold another key's bytes. Writes through a store lease's pointer must
//! stay within [`StoreLease::len`](crate::device::core::StoreLease::len) bytes; a read lease's pointer is for
//! reading only. The copy is the caller's own: a SIGBUS in it (a device
//! file truncated under the mapping) is not caught by `device::fault`.
//!
//! ## What a lease holds
//!
//! - **The slot**, through its state word (`slot`): a store lease owns the
//!   WRITING incarnation it reserved, a read lease one borrow of a
//!   readable one. A forced delete (or evict) of a leased key cancels a
//!   store lease: its commit answers [`LeaseError::Canceled`] and frees the
//!   slot. A plain put of a key under a store lease answers
//!   [`PutError::Leased`](crate::device::error::PutError::Leased) — never
//!   success, since the lease may never commit.
//! - **The mapping**, through an arena lease (`device::gate`, "Leases"): a
//!   remap (grow, shrink) answers
//!   [`GateError::Leased`](crate::device::error::GateError::Leased) at
//!   once while any lease is alive, without holding the device's other
//!   traffic off; taking a lease never waits (`Busy` while a remap is
//!   pending); `close` does not wait for leases and leaves the unmap to
//!   the core's drop, which a lease (borrowing the core) precedes.
//! - **A place in a fixed table** of [`LEASES_MAX`] per device: a lease
//!   beyond it is refused with [`LeaseError::TooMany`], never waited for,
//!   and the table gives the count and the oldest lease's age for status
//!   (a leaked lease shows as an age that only grows).
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use crate::device::slot::{Generation, SlotId};
use crate::sync::{AtomicU64, AtomicUsize, Ordering};

/// Leases one device holds at most (store and read together).
#[cfg(not(daxkv_loom))]
pub const LEASES_MAX: usize = 1024;
/// Leases one device holds at most (a small table under loom, whose
/// every atomic is a modelled object).
#[cfg(daxkv_loom)]
pub const LEASES_MAX: usize = 4;

/// The kind bit of a table entry: a store lease.
const STORE: u64 = 1 << 63;

/// `LeaseTable::stores`: one claim in the sequence (bits 32..64).
const STORE_SEQ: u64 = 1 << 32;
/// `LeaseTable::stores`: the live count (bits 0..32).
const STORE_LIVE: u64 = STORE_SEQ - 1;

/// A table entry: `slot + 1` (bits 0..31), the incarnation's generation
/// (bits 32..56) and the kind. The generation makes an entry name one
/// incarnation, so an entry released a moment late never speaks for the
/// slot's next key (the review's hunt found a put told "leased" by a stale
/// slot-only entry).
fn entry_word(slot: SlotId, generation: Generation, store: bool) -> u64 {
    (u64::from(slot.0) + 1) | (u64::from(generation.0) << 32) | if store { STORE } else { 0 }
}

/// Why a lease was not given or did not commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// The payload is longer than a slot.
    #[error("object of {len} bytes exceeds the slot size of {slot_bytes} bytes")]
    TooLarge {
        /// Payload length asked for, bytes.
        len: usize,
        /// Slot size, bytes.
        slot_bytes: usize,
    },
    /// Every slot is taken.
    #[error("no free slots available; eviction required")]
    Full,
    /// The index found no free bucket near the key (a full arena).
    #[error("the index has no free bucket near this key's home")]
    IndexFull,
    /// The device faulted and takes no new keys.
    #[error("the device faulted (SIGBUS) and is marked failed")]
    DeviceFailed,
    /// The core is closing or closed.
    #[error("the core is closing")]
    Closed,
    /// A remap is pending; a lease never waits for it: try again.
    #[error("the device is being remapped; try again")]
    Busy,
    /// The device's lease table is full ([`LEASES_MAX`]).
    #[error("{max} leases are already held on this device")]
    TooMany {
        /// The table's size.
        max: usize,
    },
    /// A forced delete (or evict) of the key canceled the store lease; its
    /// slot is freed and the key is not stored.
    #[error("the key was deleted (forced) while its store lease was open")]
    Canceled,
    /// The key is under another caller's open store lease (the engine's
    /// `lease_store`): not stored yet, and it may never be.
    #[error("the key is under another open store lease (in flight, not stored)")]
    InFlight,
}

/// The fixed lease table of one device (module doc).
#[derive(Debug)]
pub(crate) struct LeaseTable {
    /// 0: free; else an [`entry_word`].
    entries: Box<[AtomicU64]>,
    /// When each entry was taken, nanoseconds after `epoch`.
    since: Box<[AtomicU64]>,
    epoch: Instant,
    /// Where the next claim starts looking.
    hint: AtomicUsize,
    /// Store leases: alive (bits 0..32) and ever claimed (bits 32..64, a
    /// sequence). A put that finds its key present asks [`LeaseTable::quiet`]
    /// whether a store lease can be behind that entry at all.
    stores: AtomicU64,
}

impl LeaseTable {
    pub(crate) fn new() -> LeaseTable {
        LeaseTable {
            entries: (0..LEASES_MAX).map(|_| AtomicU64::new(0)).collect(),
            since: (0..LEASES_MAX).map(|_| AtomicU64::new(0)).collect(),
            epoch: Instant::now(),
            hint: AtomicUsize::new(0),
            stores: AtomicU64::new(0),
        }
    }

    /// An entry for a lease on incarnation `generation` of `slot`; `None`
    /// when the table is full.
    pub(crate) fn claim(&self, slot: SlotId, generation: Generation, store: bool) -> Option<usize> {
        let word = entry_word(slot, generation, store);
        if store {
            // ORDERING: SeqCst — before the entry and before the lease's
            // index entry (`DaxCore::lease_store`): a put that saw that
            // index entry reads this (`quiet`).
            self.stores.fetch_add(1 | STORE_SEQ, Ordering::SeqCst);
        }
        // ORDERING: Relaxed — a starting point only.
        let start = self.hint.load(Ordering::Relaxed);
        for i in 0..LEASES_MAX {
            let at = (start + i) % LEASES_MAX;
            // ORDERING: SeqCst on success — the entry is in the single
            // order before the index insert that a put's check follows
            // (`holds_store`); the slot number it carries is all a reader
            // needs. Relaxed on failure: nothing is read through it.
            if self.entries[at]
                .compare_exchange(0, word, Ordering::SeqCst, Ordering::Relaxed)
                .is_ok()
            {
                // At least 1: 0 means "just taken" to `ages`.
                let ns = u64::try_from(self.epoch.elapsed().as_nanos())
                    .unwrap_or(u64::MAX)
                    .max(1);
                // ORDERING: Relaxed — statistics.
                self.since[at].store(ns, Ordering::Relaxed);
                // ORDERING: Relaxed — a hint.
                self.hint.store((at + 1) % LEASES_MAX, Ordering::Relaxed);
                return Some(at);
            }
        }
        if store {
            // ORDERING: Relaxed — undoes our own live count (the sequence
            // stays moved: a put that saw it only looks closer); no entry
            // was published under it.
            self.stores.fetch_sub(1, Ordering::Relaxed);
        }
        None
    }

    /// Give entry `at` back.
    pub(crate) fn release(&self, at: usize) {
        // Zeroed while the entry is still ours, so a free entry's time is
        // always 0 and the next holder's is written after its claim.
        // ORDERING: Relaxed — statistics.
        self.since[at].store(0, Ordering::Relaxed);
        // ORDERING: SeqCst — pairs with `claim`; a put that reads the
        // entry free afterwards reads the slot's state after what the
        // releaser did before (its commit).
        let prev = self.entries[at].swap(0, Ordering::SeqCst);
        debug_assert_ne!(prev, 0, "a lease releases its own entry once");
        if prev & STORE != 0 {
            // ORDERING: SeqCst — as in `claim`. The lease's index entry was
            // removed before this (`DaxCore::lease_abort`): a put that
            // reads the live count at 0 here sees that entry gone.
            self.stores.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// The store leases' word, before a put looks for its key.
    pub(crate) fn snapshot(&self) -> u64 {
        // ORDERING: SeqCst — pairs with `claim` and `release`.
        self.stores.load(Ordering::SeqCst)
    }

    /// Whether no store lease can be behind an index entry the put saw
    /// after `snap` (one load): none was alive at `snap`, and none was
    /// claimed since. A lease's table claim comes before its index entry,
    /// and its release after the entry is gone, so an entry seen between
    /// two such reads is not a lease's.
    pub(crate) fn quiet(&self, snap: u64) -> bool {
        // ORDERING: SeqCst — as in `snapshot`.
        snap & STORE_LIVE == 0 && self.stores.load(Ordering::SeqCst) >> 32 == snap >> 32
    }

    /// Whether a store lease holds incarnation `generation` of `slot`.
    pub(crate) fn holds_store(&self, slot: SlotId, generation: Generation) -> bool {
        let word = entry_word(slot, generation, true);
        // ORDERING: SeqCst — pairs with `claim`'s CAS (module doc of
        // `DaxCore::lease_store`).
        self.entries
            .iter()
            .any(|e| e.load(Ordering::SeqCst) == word)
    }

    /// The incarnations (slot, generation) of the store leases in the
    /// table now. An entry released meanwhile may still be listed: it
    /// names its own incarnation, which a caller acts on only through a
    /// generation-checked state CAS.
    pub(crate) fn stores_now(&self) -> impl Iterator<Item = (SlotId, Generation)> + '_ {
        self.entries.iter().filter_map(|e| {
            // ORDERING: SeqCst — pairs with `claim`'s CAS: a forced
            // remove's walk (`DaxCore::cancel_store_leases`) and an engine
            // lease's state check form a Dekker pair through it.
            let w = e.load(Ordering::SeqCst);
            (w & STORE != 0).then(|| {
                (
                    SlotId(((w & 0xFFFF_FFFF) - 1) as u32),
                    Generation(((w & !STORE) >> 32) as u32),
                )
            })
        })
    }

    /// Leases alive and the oldest one's age.
    pub(crate) fn ages(&self) -> (usize, Option<Duration>) {
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let mut n = 0;
        let mut oldest: Option<u64> = None;
        for (e, s) in self.entries.iter().zip(self.since.iter()) {
            // ORDERING: Relaxed — statistics.
            if e.load(Ordering::Relaxed) != 0 {
                n += 1;
                // 0: taken a moment ago, its time not yet written.
                let t = match s.load(Ordering::Relaxed) {
                    0 => now,
                    t => t,
                };
                oldest = Some(oldest.map_or(t, |o| o.min(t)));
            }
        }
        (
            n,
            oldest.map(|t| Duration::from_nanos(now.saturating_sub(t))),
        )
    }
}
