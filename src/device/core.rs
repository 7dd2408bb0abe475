//! # DaxCore: one device's slots, index and copies
//!
//! The operations of LMCache's `DaxCore` (docs/lmcache-dax-behavior.md §2.4)
//! with the same results, without its lock: every data-path operation is a few
//! CASes on a slot's state word and an index bucket, plus the copy.
//!
//! ## Protocol
//!
//! ```text
//! put:     claim bitmap bit → state.reserve (WRITING, gen+1) → write key/len
//!          → index.insert (put-if-absent) → copy (NT stores + sfence)
//!          → state.commit (Release)
//!          copy failed, or canceled by a forced delete:
//!          → leave WRITING → index.remove (own bucket) → state.unlink
//! lookup:  pin_readable → [state.lock] → state.release
//! read:    pin_readable → copy out → state.release
//! delete:  pin_published → state.detach → index.remove → state.unlink
//!          → state.release
//! ```
//!
//! ## Pin, validate, act
//!
//! `index.find` answers "bucket p names slot s for this key" at one instant;
//! by the time the caller touches slot s, the key may have been deleted and
//! s reused, for this key or another, in the same bucket or another one, and
//! the 24-bit generation may have wrapped (see `slot`, "Generations"). So no
//! operation acts on a slot it found through the index until it has:
//!
//! 1. **pinned** the slot's current incarnation (borrow + 1, one CAS): from
//!    then on that incarnation cannot be freed, so its generation, key and
//!    bucket stay put;
//! 2. **validated** it under the pin: `pin_readable` checks the slot is
//!    readable and holds the key (a readable incarnation with the key *is*
//!    the key's one live copy: commit happens after the insert won, and a
//!    detach makes it unreadable before its bucket goes); `pin_published`
//!    (delete, unlock, in-flight checks, which also act on WRITING slots)
//!    checks that the index names this very slot for the key *after* the
//!    pin: any live bucket naming a pinned slot belongs to the pinned
//!    incarnation, since earlier incarnations' buckets were tombstoned
//!    before those incarnations were freed.
//!
//! ## Who removes a bucket
//!
//! Exactly one party per incarnation, decided by the state word:
//! - the **deleter** whose `detach` moved a COMMITTED slot to PENDING_FREE;
//! - the **writer** otherwise: its copy failed, or a forced delete canceled
//!   it while WRITING (the deleter only sets CANCELED and reports the key
//!   deleted), or its insert lost (then there is no bucket to remove).
//!
//! The remover then sets UNLINKED. Removing "the bucket it found" instead
//! would be wrong for a deleter: after a delete / re-put that bucket can be
//! another incarnation's; and without one remover, a failing writer and a
//! forced deleter could both claim one incarnation's bucket.
//!
//! A slot is freed by whichever transition completes its free condition (see
//! `slot`): the remover's unlink, or the last pin / reader's release.
//! Exactly one caller sees `freed` and clears the bitmap bit.
//!
//! All operations run under an arena guard (one per call, or one per
//! [`Session`]), so `remap` and `close` wait for them and new ones wait for a
//! pending remap; a lease (`device::lease`) holds an arena lease instead,
//! which no remap or close waits for and which never waits.
//!
//! ```text
//! lease_store: the put up to the copy (reserve, key, lease table entry,
//!              index.insert); commit / abort later, from any thread
//! lease_load:  pin_readable; the pin is released when the lease drops
//! ```
//!
//! ## Memory
//!
//! DRAM per slot of capacity: 32 bytes of metadata (state word, 128-bit
//! key, length and a caller tag), 18 bytes of index (two 8-byte buckets and
//! their two probe-hint bytes, `index`'s "Bucket layout"), and one bitmap
//! bit: 50.1 bytes ([`DaxCore::dram_bytes_per_slot`]; `tests/core.rs`
//! asserts at most 64). A 1 TiB device in 64 KiB slots (16 Mi slots) costs
//! about 840 MB of DRAM; in 2 MiB slots, 26 MB. The tables are sized once,
//! for the largest slot count the device can reach, so a grow never
//! reallocates them (why: docs/design.md §5.3). This is the one place these
//! numbers are written; docs/design.md links here. Beside them, per device
//! and whatever its size, the lease table (`device::lease`): 16 KiB.
// Unsafe code here is limited to the copies into and out of the mapping:
// their safety (no other thread touching the bytes) is what the slot state
// machine in this module provides, so the obligation is discharged where it
// is known. Each such block is allowed one by one, with its SAFETY note
// naming the state that makes the range exclusive (docs/design.md §3.1
// lists the unsafe modules; this is the one addition, for that reason).
#![deny(unsafe_code)]

use crate::sync::{fence, AtomicU64, AtomicUsize, Ordering};

use std::sync::Arc;

use crossbeam_utils::CachePadded;

use crate::device::arena::{
    Arena, ArenaGuard, ArenaKind, ArenaLease, ArenaSpec, CopyError, DeviceIdentity, OutOfBounds,
    TryEnterError,
};
use crate::device::error::{CoreError, GateError, OpenError, PutError};
use crate::device::index::{Entry, Index, Insert, SLOT_MAX};
use crate::device::lease::{LeaseError, LeaseTable};
use crate::device::slot::{
    Bitmap, Commit, Generation, SlotError, SlotId, SlotState, State, Transition, PENDING_FREE,
    REFERENCED, WRITING,
};
use crate::key::Key;

/// Stall points of the fault hook `DaxCore::inject_stall` (`failpoints`).
const STALL_AFTER_FIND: u8 = 0;
const STALL_AFTER_LOAD: u8 = 1;

/// Retries of an operation whose slot changed generation under it. Each
/// retry needs another thread to complete a transition on the same key.
const RETRY_MAX: usize = 64;

/// Retries of a put whose key is present but leaving (`DaxCore::present`),
/// each after a yield: the remover has a few steps left, but on a busy
/// host it may be preempted for a while.
#[cfg(not(daxkv_loom))]
const GONE_RETRIES: usize = 4096;
#[cfg(daxkv_loom)]
const GONE_RETRIES: usize = 4;

/// What a put that found its key present is to answer ([`DaxCore::present`]).
enum Present {
    /// This.
    Answer(Result<PutOutcome, PutError>),
    /// The copy found is leaving (detached, aborted, canceled); `leased`:
    /// a store lease's. Store the key after all.
    Gone { leased: bool },
}

/// How to open a core.
#[derive(Clone, Debug)]
pub struct CoreConfig {
    /// The mapping.
    pub arena: ArenaSpec,
    /// Size of every slot, bytes: the largest object the core stores.
    pub slot_bytes: usize,
}

impl CoreConfig {
    /// `arena` cut into slots of `slot_bytes`.
    pub fn new(arena: ArenaSpec, slot_bytes: usize) -> CoreConfig {
        CoreConfig { arena, slot_bytes }
    }
}

/// A successful put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    /// The bytes were copied in and committed.
    Stored,
    /// The key was already stored or being stored: a successful no-op.
    AlreadyPresent,
}

/// [`Session::presence`]: a key as a store deciding its placement sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presence {
    /// Not here (or leaving).
    Absent,
    /// Stored, or being stored by a plain put.
    Stored,
    /// Reserved by a store lease that has not committed.
    Leased,
}

/// A [`DaxCore::lease_store`].
#[derive(Debug)]
pub enum LeasedStore<'a> {
    /// The slot is the caller's to fill, then commit.
    Leased(StoreLease<'a>),
    /// The key is stored or in flight already: no slot, no pointer.
    AlreadyPresent,
}

/// `put_reserved_from` results (docs/lmcache-dax-behavior.md
/// §2.4 `DaxPutFromPtrResult`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutFromPtrResult {
    /// Copied and committed on this core.
    Inserted,
    /// The key is already committed here; nothing copied.
    AlreadyExists,
    /// A store of the key is in flight here; nothing copied.
    InFlight,
    /// No free slot (or index bucket) here: try another target.
    NoSpace,
    /// This core is closing or closed.
    Closed,
    /// The reservation is not one of `src`'s, is empty, or does not fit a
    /// slot of this core.
    Invalid,
    /// The copy failed; the slot was freed.
    CopyFailed,
    /// A forced delete of the key on this device canceled the copy while it
    /// ran (daxkv's addition: upstream folds this into `CopyFailed`,
    /// which would make a migration treat a racing delete as an I/O error).
    Canceled,
}

/// One reserved read: the slot stays readable (borrowed) until its
/// [`ReadSet`] drops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// Position of the key in the caller's list.
    pub index: usize,
    /// The key read.
    pub key: Key,
    /// The slot holding it.
    pub slot: SlotId,
    /// The slot's generation when it was borrowed.
    pub generation: Generation,
    /// Byte offset of the slot in the device.
    pub offset: usize,
    /// Payload bytes.
    pub len: usize,
    /// The caller's tag given at put (e.g. a dtype / format code).
    pub meta: u32,
    /// Position in its read set: `ReadSet::read` checks the reservation is
    /// the set's own (and so borrowed) in O(1). Private, so a reservation
    /// cannot be made up outside the crate.
    pub(crate) pos: u32,
}

/// Reserved reads plus the arena guard that keeps their bytes mapped.
/// Dropping it finalizes the reads (upstream's `finalize_reads`).
pub struct ReadSet<'a> {
    core: &'a DaxCore,
    guard: Option<ArenaGuard<'a>>,
    items: Vec<Reservation>,
}

impl std::fmt::Debug for ReadSet<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadSet")
            .field("items", &self.items)
            .finish_non_exhaustive()
    }
}

impl ReadSet<'_> {
    /// The reservations, in the order of the keys asked for (hits only).
    pub fn items(&self) -> &[Reservation] {
        &self.items
    }

    /// True when no key was reserved.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Reservations in the set.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether `r` is one of this set's own reservations (so its slot is
    /// borrowed by this set, and has no writer while the set lives).
    #[inline]
    pub fn holds(&self, r: &Reservation) -> bool {
        self.items.get(r.pos as usize) == Some(r)
    }

    /// Copy reservation `r`'s payload into `dst`; `None` (and `dst`
    /// untouched) when `dst` is shorter than the payload, or `r` is not
    /// one of this set's reservations (another set's, whose borrow may be
    /// gone). Bytes of `dst` beyond the payload are untouched.
    pub fn read(&self, r: &Reservation, dst: &mut [u8]) -> Option<usize> {
        if dst.len() < r.len || !self.holds(r) {
            return None;
        }
        self.read_part(r, 0, &mut dst[..r.len]).then_some(r.len)
    }

    /// [`ReadSet::read`] with streaming stores into `dst` (fenced before it
    /// returns): for restores larger than the caches.
    pub fn read_streaming(&self, r: &Reservation, dst: &mut [u8]) -> Option<usize> {
        if dst.len() < r.len || !self.holds(r) {
            return None;
        }
        let g = self.guard.as_ref()?;
        #[allow(unsafe_code)]
        // SAFETY: `ArenaGuard::read_streaming`'s contract (`read`'s), as in
        // `read_part`: 1. `r` is this set's (checked), so its slot is
        // borrowed and has no writer while the set lives, and the range is
        // exactly its payload; 2. `dst` is a caller slice, outside the
        // mapping.
        let ok = unsafe { g.read_streaming(r.offset, &mut dst[..r.len]) }.is_ok();
        ok.then_some(r.len)
    }

    /// Copy `dst.len()` bytes of `r`'s payload from payload offset `at`;
    /// false (nothing copied) if `r` is not this set's or the range passes
    /// the payload's end.
    pub fn read_part(&self, r: &Reservation, at: usize, dst: &mut [u8]) -> bool {
        let in_payload = at.checked_add(dst.len()).is_some_and(|end| end <= r.len);
        let Some(g) = self.guard.as_ref() else {
            return false;
        };
        self.core.fault_delay();
        #[allow(unsafe_code)]
        // SAFETY: `ArenaGuard::read`'s contract: 1. `r` is this set's
        // (checked first), so its slot is borrowed by this set: no writer
        // touches the payload while the set lives, and the range lies
        // inside the payload (checked); 2. `dst` is a caller slice, outside
        // the mapping.
        let ok = in_payload && self.holds(r) && unsafe { g.read(r.offset + at, dst) }.is_ok();
        ok
    }

    /// Copy the payloads of `run`, reservations of this set that lie back
    /// to back on the device, with one copy into `dst` (batched restore
    /// merges adjacent full slots). False, and nothing copied, unless every
    /// one is this set's, each ends where the next begins, and `dst` is as
    /// long as all of them.
    pub(crate) fn read_span(&self, run: &[Reservation], dst: &mut [u8]) -> bool {
        let Some(first) = run.first() else {
            return dst.is_empty();
        };
        let total: usize = run.iter().map(|r| r.len).sum();
        let contiguous = run
            .windows(2)
            .all(|w| w[0].offset + w[0].len == w[1].offset);
        if total != dst.len() || !contiguous || !run.iter().all(|r| self.holds(r)) {
            return false;
        }
        let Some(g) = self.guard.as_ref() else {
            return false;
        };
        #[allow(unsafe_code)]
        // SAFETY: `ArenaGuard::read`'s contract: 1. the range is exactly the
        // payloads of `run`, all borrowed by this set (checked): no writer
        // touches them while it lives; 2. `dst` is a caller slice, outside
        // the mapping.
        let ok = unsafe { g.read(first.offset, dst) }.is_ok();
        ok
    }

    /// The guard over the source device (migration copies from it).
    pub(crate) fn guard(&self) -> Option<&ArenaGuard<'_>> {
        self.guard.as_ref()
    }
}

impl Drop for ReadSet<'_> {
    fn drop(&mut self) {
        if self.items.is_empty() {
            return;
        }
        for r in &self.items {
            self.core.unpin(r.slot, r.generation);
        }
        // ORDERING: Relaxed — a statistic.
        self.core.active_reads.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Write access to one reserved slot, bounded to the payload length.
pub struct SlotWriter<'a> {
    guard: &'a ArenaGuard<'a>,
    offset: usize,
    len: usize,
    /// Not `Sync`: one thread writes the slot (see `write`).
    _one_thread: std::marker::PhantomData<std::cell::Cell<()>>,
}

impl std::fmt::Debug for SlotWriter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotWriter")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl SlotWriter<'_> {
    /// Payload length being stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copy `src` to payload offset `at`; false if it would pass the end.
    pub fn write(&self, at: usize, src: &[u8]) -> bool {
        let in_payload = at.checked_add(src.len()).is_some_and(|end| end <= self.len);
        #[allow(unsafe_code)]
        // SAFETY: `ArenaGuard::write`'s contract: 1. the range lies in this
        // writer's slot (checked), which is WRITING and owned by this put:
        // no reader can borrow it and no other writer can reserve it; and
        // `SlotWriter` is not `Sync`, so the writer callback cannot copy
        // into it from two threads at once; 2. `src` is a caller slice,
        // outside the mapping.
        let ok = in_payload && unsafe { self.guard.write(self.offset + at, src) }.is_ok();
        ok
    }
}

/// What every lease holds: the slot's incarnation, its place in the lease
/// table and the mapping (`device::lease`, "What a lease holds").
pub(crate) struct LeasedSlot<'a> {
    pub(crate) core: &'a DaxCore,
    pub(crate) arena: ArenaLease<'a>,
    pub(crate) slot: SlotId,
    pub(crate) generation: Generation,
    pub(crate) table_at: usize,
    pub(crate) len: usize,
}

impl LeasedSlot<'_> {
    fn offset(&self) -> usize {
        self.slot.0 as usize * self.core.slot_bytes()
    }

    fn ptr(&self) -> *mut u8 {
        self.arena
            .ptr(self.offset())
            .expect("a leased slot lies inside the mapping its lease holds")
    }

    fn debug(&self, name: &str, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(name)
            .field("slot", &self.slot)
            .field("offset", &self.offset())
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// A slot reserved for a key, for the caller to fill
/// ([`DaxCore::lease_store`](DaxCore::lease_store); `device::lease`).
/// Commit it, abort it, or drop it (which aborts). `Send`: any thread may
/// end it.
#[must_use = "dropping a store lease aborts it"]
pub struct StoreLease<'a> {
    pub(crate) held: LeasedSlot<'a>,
    pub(crate) key: Key,
    pub(crate) entry: Entry,
    /// Committed or aborted: nothing left for `drop`.
    pub(crate) ended: bool,
}

impl std::fmt::Debug for StoreLease<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.held.debug("StoreLease", f)
    }
}

impl StoreLease<'_> {
    /// Where the payload goes: `len()` bytes from here are the caller's
    /// to write until it commits or aborts.
    pub fn ptr(&self) -> *mut u8 {
        self.held.ptr()
    }

    /// The payload's length, bytes (as asked for).
    pub fn len(&self) -> usize {
        self.held.len
    }

    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.held.len == 0
    }

    /// Byte offset of the slot in the device's mapping.
    pub fn offset(&self) -> usize {
        self.held.offset()
    }

    /// The key this lease stores.
    pub fn key(&self) -> Key {
        self.key
    }

    /// Copy `src` into the payload at byte `at` (for a caller that fills
    /// the slot from host memory: the store kernel, a SIGBUS on the device
    /// caught as `DeviceFailed`). `&mut`: one writer at a time.
    pub fn write(&mut self, at: usize, src: &[u8]) -> Result<(), CopyError> {
        OutOfBounds::check(at, src.len(), self.held.len)?;
        #[allow(unsafe_code)]
        // SAFETY: `ArenaLease::write`'s contract: the range lies in this
        // lease's slot (checked against the payload length), which is
        // WRITING and owned by this lease, so no reader borrows it and no
        // other writer reserves it; `&mut self` keeps this lease's own
        // writes one at a time; `src` is a caller slice, outside the mapping.
        unsafe {
            self.held.arena.write(self.held.offset() + at, src)
        }
    }

    /// The epoch of the mapping [`StoreLease::ptr`] points into
    /// (`arena::Region::epoch`): a registrant checks it against the
    /// region it registered.
    pub fn epoch(&self) -> u64 {
        self.held.arena.epoch()
    }

    /// The key is stored: readable from now on, as after a put. The
    /// caller's copy into [`StoreLease::ptr`] must be finished
    /// (`device::lease`, "The contract"). [`LeaseError::Canceled`] if a
    /// forced delete hit the key meanwhile (the slot is freed, the key not
    /// stored).
    pub fn commit(mut self) -> Result<(), LeaseError> {
        self.ended = true;
        self.held.core.lease_commit(&self)
    }

    /// Give the slot back without storing the key. The caller's copy must
    /// be finished, as for a commit.
    pub fn abort(mut self) {
        self.ended = true;
        self.held.core.lease_abort(&self);
    }
}

impl Drop for StoreLease<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.held.core.lease_abort(self);
        }
    }
}

/// A readable slot kept from being freed or reused, for the caller to
/// read ([`DaxCore::lease_load`](DaxCore::lease_load); `device::lease`).
/// Dropping it releases the slot. `Send`.
pub struct ReadLease<'a> {
    pub(crate) held: LeasedSlot<'a>,
    pub(crate) meta: u32,
}

impl std::fmt::Debug for ReadLease<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.held.debug("ReadLease", f)
    }
}

impl ReadLease<'_> {
    /// Where the payload is: `len()` bytes from here, to read only.
    pub fn ptr(&self) -> *const u8 {
        self.held.ptr().cast_const()
    }

    /// The payload's length, bytes.
    pub fn len(&self) -> usize {
        self.held.len
    }

    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.held.len == 0
    }

    /// The caller's tag stored with the payload.
    pub fn meta(&self) -> u32 {
        self.meta
    }

    /// Copy the payload's bytes from `at` into `dst` (as many as fit):
    /// how many were copied. A SIGBUS on the device is caught
    /// (`DeviceFailed`).
    pub fn read(&self, at: usize, dst: &mut [u8]) -> Result<usize, CopyError> {
        let n = self.held.len.saturating_sub(at).min(dst.len());
        #[allow(unsafe_code)]
        // SAFETY: `ArenaLease::read`'s contract: the slot is readable and
        // borrowed by this lease, so no writer can reserve it until the
        // lease ends; the range lies in it (clamped to the payload).
        unsafe {
            self.held
                .arena
                .read(self.held.offset() + at.min(self.held.len), &mut dst[..n])
        }?;
        Ok(n)
    }

    /// The epoch of the mapping [`ReadLease::ptr`] points into.
    pub fn epoch(&self) -> u64 {
        self.held.arena.epoch()
    }

    /// Byte offset of the slot in the device's mapping.
    pub fn offset(&self) -> usize {
        self.held.offset()
    }
}

impl Drop for ReadLease<'_> {
    fn drop(&mut self) {
        self.held.core.lease_release(self);
    }
}

/// A lease that holds what it borrows: the core's lease and an `Arc` of
/// the thing that holds the core (an engine's device), so the lease can
/// outlive the call that made it ([`DaxCore::lease_store_owned`],
/// [`DaxCore::lease_load_owned`]).
///
/// The lease borrows the core through `owner`'s `AsRef` for as long as
/// `owner` lives: an `Arc`'s contents never move, and while this struct
/// holds a clone nobody can drop them or borrow them mutably, so a shared
/// borrow taken from them stays valid that long (the pattern of
/// `owning_ref` / `yoke` over a stable `Deref`). The lease's lifetime is
/// widened to `'static` to be stored, ended before `owner` in `Drop`,
/// and only ever handed out shortened to a borrow of `self`.
pub struct Owned<L: 'static, T: AsRef<DaxCore>> {
    /// `Some` until ended; taken in `Drop` before `owner` drops.
    lease: Option<L>,
    owner: Arc<T>,
}

/// [`Owned`] store lease.
pub type OwnedStoreLease<T> = Owned<StoreLease<'static>, T>;
/// [`Owned`] read lease.
pub type OwnedReadLease<T> = Owned<ReadLease<'static>, T>;

/// [`DaxCore::lease_store_owned`]'s answer.
#[derive(Debug)]
pub enum OwnedLeasedStore<T: AsRef<DaxCore>> {
    /// The slot is the caller's to fill, then commit.
    Leased(OwnedStoreLease<T>),
    /// The key is stored or in flight already: no slot, no pointer.
    AlreadyPresent,
}

impl<L: std::fmt::Debug + 'static, T: AsRef<DaxCore>> std::fmt::Debug for Owned<L, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Owned").field(&self.lease).finish()
    }
}

impl<L: 'static, T: AsRef<DaxCore>> Owned<L, T> {
    /// What holds the core.
    pub fn owner(&self) -> &Arc<T> {
        &self.owner
    }

    fn take(&mut self) -> L {
        self.lease.take().expect("an owned lease ends once")
    }
}

impl<T: AsRef<DaxCore>> OwnedStoreLease<T> {
    /// The lease, borrowed for as long as `self`.
    pub fn get(&self) -> &StoreLease<'_> {
        self.lease.as_ref().expect("a live owned lease")
    }

    /// [`StoreLease::write`]. (No `&mut` to the lease itself is handed
    /// out: swapping two owned leases' insides would pair a lease with
    /// another owner.)
    pub fn write(&mut self, at: usize, src: &[u8]) -> Result<(), CopyError> {
        self.lease
            .as_mut()
            .expect("a live owned lease")
            .write(at, src)
    }

    /// [`StoreLease::commit`].
    pub fn commit(mut self) -> Result<(), LeaseError> {
        self.take().commit()
    }

    /// [`StoreLease::abort`].
    pub fn abort(mut self) {
        self.take().abort();
    }
}

impl<T: AsRef<DaxCore>> OwnedReadLease<T> {
    /// The lease, borrowed for as long as `self`.
    pub fn get(&self) -> &ReadLease<'_> {
        self.lease.as_ref().expect("a live owned lease")
    }
}

impl<L: 'static, T: AsRef<DaxCore>> Drop for Owned<L, T> {
    fn drop(&mut self) {
        // Before `owner` (the struct's doc).
        drop(self.lease.take());
    }
}

impl DaxCore {
    /// [`DaxCore::lease_store`] on the core `owner` holds, as a lease that
    /// holds `owner` ([`Owned`]).
    pub fn lease_store_owned<T: AsRef<DaxCore>>(
        owner: &Arc<T>,
        key: Key,
        len: usize,
        meta: u32,
    ) -> Result<OwnedLeasedStore<T>, LeaseError> {
        let owner = Arc::clone(owner);
        let l = match (*owner).as_ref().lease_store(key, len, meta)? {
            LeasedStore::Leased(l) => l,
            LeasedStore::AlreadyPresent => return Ok(OwnedLeasedStore::AlreadyPresent),
        };
        #[allow(unsafe_code)]
        // SAFETY: only the lifetime changes (same type, same layout); `l`
        // borrows the core inside `owner`'s allocation, which the clone
        // stored next to it keeps alive and unmoved until `Owned`'s drop
        // has ended `l` (the struct's doc).
        let l = unsafe { std::mem::transmute::<StoreLease<'_>, StoreLease<'static>>(l) };
        Ok(OwnedLeasedStore::Leased(Owned {
            lease: Some(l),
            owner,
        }))
    }

    /// [`DaxCore::lease_load`] on the core `owner` holds, as a lease that
    /// holds `owner` ([`Owned`]).
    pub fn lease_load_owned<T: AsRef<DaxCore>>(
        owner: &Arc<T>,
        key: Key,
    ) -> Result<Option<OwnedReadLease<T>>, LeaseError> {
        let owner = Arc::clone(owner);
        let Some(l) = (*owner).as_ref().lease_load(key)? else {
            return Ok(None);
        };
        #[allow(unsafe_code)]
        // SAFETY: as in `lease_store_owned`.
        let l = unsafe { std::mem::transmute::<ReadLease<'_>, ReadLease<'static>>(l) };
        Ok(Some(Owned {
            lease: Some(l),
            owner,
        }))
    }
}

/// Per-slot metadata next to the state word: 32 bytes.
#[derive(Debug, Default)]
struct SlotMeta {
    state: SlotState,
    key_hi: AtomicU64,
    key_lo: AtomicU64,
    /// Payload length (low 32 bits) and the caller's tag (high 32 bits).
    len_meta: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<SlotMeta>() == 32);

impl SlotMeta {
    /// The key stored next to the state word.
    #[inline]
    fn key(&self) -> Key {
        // ORDERING: Relaxed — ordered by the Acquire load of the bucket or of
        // the state word that led here (both published after these stores).
        Key::from_parts(
            self.key_hi.load(Ordering::Relaxed),
            self.key_lo.load(Ordering::Relaxed),
        )
    }
}

/// Status fields (docs/lmcache-dax-behavior.md §2.4 `report_status`).
#[derive(Clone, Debug, PartialEq)]
pub struct CoreStatus {
    /// Not closing or closed, and not failed by a fault (`crate::device::fault`).
    pub is_healthy: bool,
    /// The arena's description: its path, `"memfd"` or `"anonymous"`.
    pub device_path: String,
    /// Bytes currently addressable as slots (`max_slots × slot_bytes`).
    pub max_dax_size_bytes: usize,
    /// Slot size, bytes.
    pub slot_bytes: usize,
    /// Slots at the current size.
    pub max_slots: usize,
    /// Slots the tables are sized for (the largest size a grow can reach).
    pub capacity_slots: usize,
    /// Slots in use: in flight, committed or pending free.
    pub live_slot_count: usize,
    /// Readable (committed, not detached) slots.
    pub committed_key_count: usize,
    /// Slots with at least one lookup lock (distinct keys, not the sum of
    /// the counts, as upstream).
    pub locked_key_count: usize,
    /// Slots with at least one reader (or pin).
    pub borrowed_slot_count: usize,
    /// Slots detached from their key, waiting for their last reader.
    pub pending_free_slot_count: usize,
    /// Read sets and sessions that have reserved or loaded something and
    /// are still alive.
    pub active_read_count: usize,
    /// Stores in flight (WRITING slots).
    pub active_write_count: usize,
    /// Closing or closed.
    pub closing: bool,
    /// Always false: nothing survives a restart.
    pub supports_restart_recovery: bool,
    /// DRAM held by the slot table, index and bitmap, bytes.
    pub dram_bytes: usize,
    /// Leases alive (`device::lease`), store and read.
    pub lease_count: usize,
    /// How long the oldest lease alive has been held (a leaked lease shows
    /// as an age that only grows).
    pub oldest_lease_age: Option<std::time::Duration>,
}

/// One DAX device: a mapped arena of fixed-size slots and its index.
#[derive(Debug)]
pub struct DaxCore {
    arena: Arena,
    slot_bytes: usize,
    capacity_slots: usize,
    max_slots: AtomicUsize,
    slots: Box<[SlotMeta]>,
    bitmap: Bitmap,
    index: Index,
    /// Slots whose bitmap bit is set (in flight, committed, pending free).
    live: CachePadded<AtomicUsize>,
    /// Slots detached but not yet free.
    pending: CachePadded<AtomicUsize>,
    active_reads: AtomicUsize,
    clock_hand: AtomicUsize,
    /// The leases this device has handed out (`device::lease`).
    leases: LeaseTable,
    /// Fault hooks (the `failpoints` feature), this device's own.
    #[cfg(any(test, feature = "failpoints"))]
    faults: CopyFaults,
}

/// Fault hooks of one device (the `failpoints` feature). Plain std
/// atomics, also under loom: a knob of the tests, not part of any protocol
/// a loom model explores. Every knob is Relaxed: it publishes no data, and
/// a put or load that reads a stale value is a fine choice of which
/// operation the fault hits.
#[cfg(any(test, feature = "failpoints"))]
#[derive(Default)]
struct CopyFaults {
    /// Fail one payload copy in every `every` (0 = never): drives the
    /// writer's failure path (own bucket removal racing forced deletes).
    every: std::sync::atomic::AtomicU32,
    count: std::sync::atomic::AtomicU32,
    /// Every payload copy (put or load) sleeps this long first, µs (0 =
    /// none): a slow device.
    delay_us: std::sync::atomic::AtomicU64,
    /// New puts find no free slot ([`PutError::Full`]): a full device,
    /// whatever its bitmap says.
    full: std::sync::atomic::AtomicBool,
    /// True while `stall` holds a hook: an operation that finds it false
    /// takes no lock, so benches (built with the feature) measure the
    /// lookup path without a shared lock in it.
    stall_armed: std::sync::atomic::AtomicBool,
    /// Run once between an index lookup and the pin that follows it: a
    /// stalled thread, with the world moving on meanwhile.
    #[allow(clippy::type_complexity)]
    stall: std::sync::Mutex<Option<(StallPoint, Box<dyn FnOnce(&DaxCore) + Send>)>>,
}

/// Where [`DaxCore::inject_stall`] stalls an operation that reached a slot
/// through the index (the `failpoints` feature).
#[cfg(any(test, feature = "failpoints"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StallPoint {
    /// After `index.find`, before the slot's state word is loaded.
    AfterFind,
    /// After the state word is loaded, before the CAS that pins the slot.
    AfterLoad,
}

#[cfg(any(test, feature = "failpoints"))]
impl std::fmt::Debug for CopyFaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyFaults")
            .field("every", &self.every)
            .finish_non_exhaustive()
    }
}

impl DaxCore {
    /// Map the arena and build the slot tables. Tables are sized for the
    /// largest the device can grow to (`Arena::max_len`).
    pub fn open(cfg: &CoreConfig) -> Result<DaxCore, OpenError> {
        let slot_bytes = cfg.slot_bytes;
        if slot_bytes == 0 {
            return Err(OpenError::Zero {
                what: "slot_bytes",
                value: 0,
            });
        }
        if slot_bytes > u32::MAX as usize {
            return Err(OpenError::SlotTooLarge {
                slot_bytes,
                max: u32::MAX as usize,
            });
        }
        if cfg.arena.size_bytes / slot_bytes == 0 {
            return Err(OpenError::NoSlot {
                size_bytes: cfg.arena.size_bytes,
                slot_bytes,
            });
        }
        let arena = Arena::open(&cfg.arena)?;
        let max_slots = cfg.arena.size_bytes / slot_bytes;
        let capacity_slots = (arena.max_len() / slot_bytes).max(max_slots);
        if capacity_slots > SLOT_MAX {
            return Err(OpenError::TooManySlots {
                slots: capacity_slots,
                max: SLOT_MAX,
            });
        }
        // The tables are DRAM sized by a caller's number (a file's length,
        // a request's size): checked against the memory the process may
        // use, then allocated fallibly, so a too-large device is an error
        // that names the size, never an abort of the whole process.
        let table_bytes = DaxCore::table_bytes(capacity_slots);
        crate::host::memlimit::check(
            &format!("slot tables for {capacity_slots} slots"),
            table_bytes,
            &cfg.arena.mem_roots,
        )?;
        let alloc_failed = || OpenError::TableAlloc {
            slots: capacity_slots,
            bytes: table_bytes,
        };
        let slots = crate::host::memlimit::try_boxed(capacity_slots, SlotMeta::default)
            .ok_or_else(alloc_failed)?;
        let bitmap = Bitmap::try_new(capacity_slots, max_slots).ok_or_else(alloc_failed)?;
        let index = Index::try_with_slots(capacity_slots).ok_or_else(alloc_failed)?;
        Ok(DaxCore {
            slots,
            bitmap,
            index,
            arena,
            slot_bytes,
            capacity_slots,
            max_slots: AtomicUsize::new(max_slots),
            live: CachePadded::new(AtomicUsize::new(0)),
            pending: CachePadded::new(AtomicUsize::new(0)),
            active_reads: AtomicUsize::new(0),
            clock_hand: AtomicUsize::new(0),
            leases: LeaseTable::new(),
            #[cfg(any(test, feature = "failpoints"))]
            faults: CopyFaults::default(),
        })
    }

    /// Slot size, bytes.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Slots at the current size (changes with `remap`).
    pub fn max_slots(&self) -> usize {
        // ORDERING: Relaxed — changes only inside `Arena::exclusive`, whose
        // gate Release/Acquire orders it for every guarded operation.
        self.max_slots.load(Ordering::Relaxed)
    }

    /// Bytes currently addressable as slots.
    pub fn arena_bytes(&self) -> usize {
        self.max_slots() * self.slot_bytes
    }

    /// The arena's description: its path, `"memfd"` or `"anonymous"`.
    pub fn describe(&self) -> &str {
        self.arena.describe()
    }

    /// What kind of mapping the core is on.
    pub fn kind(&self) -> ArenaKind {
        self.arena.kind()
    }

    /// The physical identity of the mapped device or file (`None` for a
    /// memfd or anonymous memory): two cores must never share one.
    pub fn identity(&self) -> Option<DeviceIdentity> {
        self.arena.identity()
    }

    /// True if `path` is the same physical device or file as this core's.
    pub fn owns_device(&self, path: &std::path::Path) -> bool {
        !self.is_closing()
            && self.identity().is_some()
            && DeviceIdentity::of_path(path) == self.identity()
    }

    /// True once a SIGBUS in a copy (the device file truncated under its
    /// mapping, a poisoned memory line) failed the device (`crate::device::fault`):
    /// its keys read as misses and puts fail with
    /// [`PutError::DeviceFailed`], for good.
    pub fn is_failed(&self) -> bool {
        self.arena.is_failed()
    }

    /// True once `close` has started; operations then refuse or miss.
    pub fn is_closing(&self) -> bool {
        self.arena.is_closed()
    }

    /// True while a remap (grow / shrink) is pending or running.
    pub fn remap_pending(&self) -> bool {
        self.arena.is_exclusive_pending()
    }

    test_hooks_pub! {
    /// A guard over the whole mapping that bypasses the slot states, for
    /// benchmarks (raw copy bandwidth of this very mapping) and diagnostics.
    /// Writes through it can overwrite stored keys' bytes. Public with the
    /// `test-hooks` feature only.
    fn raw_guard(&self) -> Option<ArenaGuard<'_>> {
        self.arena.enter().ok()
    }
    }

    /// Fault hook (the `failpoints` feature): from now on one payload
    /// copy in every `every` fails as if the copy had failed (`0` turns it
    /// off). Every put path (`put`, sessions, `put_with_writer`,
    /// `put_reserved_from`, engine stores) goes through it.
    #[cfg(any(test, feature = "failpoints"))]
    pub fn inject_copy_faults(&self, every: u32) {
        // ORDERING: Relaxed — a test knob; no data is published through it.
        self.faults.every.store(every, Ordering::Relaxed);
    }

    /// Fault hook (the `failpoints` feature): every payload copy into or
    /// out of this device sleeps `delay` first (a slow device;
    /// `Duration::ZERO` turns it off). The copy then runs as usual.
    #[cfg(any(test, feature = "failpoints"))]
    pub fn inject_copy_delay(&self, delay: std::time::Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        // ORDERING: Relaxed — a test knob.
        self.faults.delay_us.store(us, Ordering::Relaxed);
    }

    /// Fault hook (the `failpoints` feature): while `full`, a put that
    /// needs a new slot fails with [`PutError::Full`] (a full device under
    /// load, without filling it).
    #[cfg(any(test, feature = "failpoints"))]
    pub fn inject_full(&self, full: bool) {
        // ORDERING: Relaxed — a test knob.
        self.faults.full.store(full, Ordering::Relaxed);
    }

    /// Fault hook (the `failpoints` feature): fail the device now, as a
    /// SIGBUS in one of its copies would (`crate::device::fault`, a
    /// poisoned line found but not consumed): [`DaxCore::is_failed`] from
    /// now on, puts fail with [`PutError::DeviceFailed`], a copy running
    /// now fails its operation, and the device never serves again.
    #[cfg(any(test, feature = "failpoints"))]
    pub fn inject_device_failure(&self) {
        self.arena.mark_failed();
    }

    /// Fault hook (the `failpoints` feature): run `f` once, the next
    /// time an operation that found a key in the index passes `at` (as if
    /// that thread stalled there while `f` ran).
    #[cfg(any(test, feature = "failpoints"))]
    pub fn inject_stall(&self, at: StallPoint, f: impl FnOnce(&DaxCore) + Send + 'static) {
        let mut stall = self
            .faults
            .stall
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *stall = Some((at, Box::new(f)));
        // ORDERING: Relaxed — only tells `stall_point` to look; the hook
        // itself is handed over by the mutex.
        self.faults.stall_armed.store(true, Ordering::Relaxed);
    }

    /// The test-only stall hook: one Relaxed load and a branch when
    /// disarmed (inlined into every lookup), the rest out of line.
    // Always: a call per lookup step cost ~50 instructions (perf/README.md).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    #[cfg_attr(not(any(test, feature = "failpoints")), allow(clippy::unused_self))]
    fn stall_point(&self, here: u8) {
        #[cfg(any(test, feature = "failpoints"))]
        {
            // ORDERING: Relaxed — see `inject_stall`.
            if self.faults.stall_armed.load(Ordering::Relaxed) {
                self.stall_armed_point(here);
            }
        }
        #[cfg(not(any(test, feature = "failpoints")))]
        let _ = here;
    }

    /// [`DaxCore::stall_point`]'s armed path.
    #[cfg(any(test, feature = "failpoints"))]
    #[cold]
    #[inline(never)]
    fn stall_armed_point(&self, here: u8) {
        let here = if here == STALL_AFTER_FIND {
            StallPoint::AfterFind
        } else {
            StallPoint::AfterLoad
        };
        let f = self.faults.stall.try_lock().ok().and_then(|mut g| {
            if g.as_ref().is_some_and(|(at, _)| *at == here) {
                // ORDERING: Relaxed — as above; stored under the
                // mutex, as `inject_stall` stores true.
                self.faults.stall_armed.store(false, Ordering::Relaxed);
                g.take().map(|(_, f)| f)
            } else {
                None
            }
        });
        if let Some(f) = f {
            f(self);
        }
    }

    /// Whether the fault hook fails this copy (after the slow-device
    /// delay, if one is set).
    #[inline]
    #[cfg_attr(not(any(test, feature = "failpoints")), allow(clippy::unused_self))]
    fn fault_copy(&self) -> bool {
        #[cfg(any(test, feature = "failpoints"))]
        {
            self.fault_delay();
            // ORDERING: Relaxed — a test knob (see `inject_copy_faults`).
            let every = self.faults.every.load(Ordering::Relaxed);
            // ORDERING: Relaxed — a counter; any interleaving is a fine
            // choice of which copies fail.
            every != 0 && self.faults.count.fetch_add(1, Ordering::Relaxed) % every == every - 1
        }
        #[cfg(not(any(test, feature = "failpoints")))]
        false
    }

    /// The slow-device hook (`inject_copy_delay`): sleep before a copy.
    #[inline]
    #[cfg_attr(not(any(test, feature = "failpoints")), allow(clippy::unused_self))]
    fn fault_delay(&self) {
        #[cfg(any(test, feature = "failpoints"))]
        {
            // ORDERING: Relaxed — a test knob (see `inject_copy_delay`).
            let us = self.faults.delay_us.load(Ordering::Relaxed);
            if us > 0 {
                std::thread::sleep(std::time::Duration::from_micros(us));
            }
        }
    }

    /// Whether the full-device hook (`inject_full`) refuses a new slot.
    #[inline]
    #[cfg_attr(not(any(test, feature = "failpoints")), allow(clippy::unused_self))]
    fn fault_full(&self) -> bool {
        #[cfg(any(test, feature = "failpoints"))]
        {
            // ORDERING: Relaxed — a test knob (see `inject_full`).
            self.faults.full.load(Ordering::Relaxed)
        }
        #[cfg(not(any(test, feature = "failpoints")))]
        false
    }

    /// DRAM bytes the tables of a core of `capacity_slots` slots take
    /// (about what [`DaxCore::dram_bytes`] will report).
    pub fn table_bytes(capacity_slots: usize) -> usize {
        let index = Index::buckets_for(capacity_slots)
            .saturating_mul(std::mem::size_of::<u64>() + std::mem::size_of::<u8>());
        capacity_slots
            .saturating_mul(std::mem::size_of::<SlotMeta>())
            .saturating_add(index)
            .saturating_add(capacity_slots.div_ceil(64).max(1) * 8)
    }

    /// DRAM bytes of slot metadata, index and bitmap.
    pub fn dram_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<SlotMeta>()
            + self.index.bytes()
            + self.bitmap.capacity().div_ceil(8)
    }

    /// [`DaxCore::dram_bytes`] per slot of capacity.
    pub fn dram_bytes_per_slot(&self) -> f64 {
        self.dram_bytes() as f64 / self.capacity_slots as f64
    }

    #[inline]
    fn meta(&self, s: SlotId) -> &SlotMeta {
        &self.slots[s.0 as usize]
    }

    #[inline]
    fn slot_key(&self, s: SlotId) -> Key {
        self.meta(s).key()
    }

    #[inline]
    fn len_meta(&self, s: SlotId) -> (usize, u32) {
        // ORDERING: Relaxed — as in `slot_key`.
        let v = self.meta(s).len_meta.load(Ordering::Relaxed);
        ((v & 0xFFFF_FFFF) as usize, (v >> 32) as u32)
    }

    #[inline]
    fn is_key(&self, key: Key) -> impl Fn(SlotId) -> bool + '_ {
        move |s| self.slot_key(s) == key
    }

    /// Book-keeping after a transition: the pending-free count, and the
    /// bitmap bit when the transition freed the slot.
    #[inline]
    fn settle(&self, s: SlotId, t: Transition) {
        if t.next.has(PENDING_FREE) && !t.prev.has(PENDING_FREE) {
            // ORDERING: Relaxed — a counter for `usage`.
            self.pending.fetch_add(1, Ordering::Relaxed);
        }
        if t.freed {
            if t.prev.has(PENDING_FREE) {
                // ORDERING: Relaxed — a counter for `usage`.
                self.pending.fetch_sub(1, Ordering::Relaxed);
            }
            self.bitmap.release(s);
            // ORDERING: Relaxed — a counter for `usage`.
            self.live.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Pin `key`'s readable copy: `(slot, generation)` with the slot
    /// borrowed (release it with [`DaxCore::unpin`]). `None` on a miss, an
    /// in-flight store, or a saturated borrow count. See "Pin, validate,
    /// act" in the module doc.
    #[inline]
    fn pin_readable(&self, key: Key) -> Option<(SlotId, Generation)> {
        if self.arena.is_failed() {
            // A device that faulted serves nothing: its keys are misses.
            return None;
        }
        self.pin_readable_unfailed(key)
    }

    /// [`DaxCore::pin_readable`] for a caller that has just checked the
    /// device is not failed: a batch checks once for all its keys (the
    /// fault is asynchronous, so a batch that checked first answers as if
    /// a fault arriving during it came after it; a copy out of a failed
    /// device still fails, in `ArenaGuard::read`). Inlined into the batch
    /// loops: as a call it spent about a sixth of its instructions on the
    /// call itself and its `Option` returned through memory.
    #[allow(clippy::inline_always)] // measured: docs/performance.md
    #[inline(always)]
    fn pin_readable_unfailed(&self, key: Key) -> Option<(SlotId, Generation)> {
        for _ in 0..RETRY_MAX {
            let e = self.index.find(key, self.is_key(key))?;
            self.stall_point(STALL_AFTER_FIND);
            let m = self.meta(e.slot);
            let st = m.state.load();
            if !st.is_readable() {
                // In flight, or being deleted: a miss at this instant (a
                // newer copy cannot be in the index while this bucket is).
                return None;
            }
            self.stall_point(STALL_AFTER_LOAD);
            match m.state.borrow(st.generation()) {
                Ok(_) => {}
                Err(SlotError::Stale) => continue,
                Err(_) => return None,
            }
            // Pinned and readable. The borrow's Acquire CAS read from the
            // release sequence of this incarnation's commit, which follows
            // the writer's key stores: the key read here is the pinned
            // incarnation's.
            if m.key() == key {
                return Some((e.slot, st.generation()));
            }
            self.unpin(e.slot, st.generation()); // slot reused since `find`
        }
        None
    }

    /// Pin `key`'s published entry, readable or in flight: its bucket,
    /// the generation and the state after the pin; released with
    /// [`DaxCore::unpin`]. Validated under the pin (module doc): the bucket
    /// `find` returned still holds the same OWNED word naming the slot, and
    /// the slot holds the key. Any live bucket naming a pinned slot is the
    /// pinned incarnation's (earlier incarnations' buckets were tombstoned
    /// before they were freed, which happens-before this incarnation's
    /// reservation, which our pin CAS read from), and re-reading it with
    /// Acquire also makes that incarnation's key visible (its writer stored
    /// the key before publishing the bucket).
    #[allow(clippy::inline_always)] // as `pin_readable_unfailed`
    #[inline(always)]
    fn pin_published(&self, key: Key) -> Option<(Entry, Generation, State)> {
        let mut e = self.index.find(key, self.is_key(key))?;
        for _ in 0..RETRY_MAX {
            self.stall_point(STALL_AFTER_FIND);
            let m = self.meta(e.slot);
            let st = m.state.load();
            self.stall_point(STALL_AFTER_LOAD);
            match m.state.pin(st.generation()) {
                Ok(t) => {
                    if self.index.still_holds(e) && m.key() == key {
                        return Some((e, st.generation(), t.next));
                    }
                    self.unpin(e.slot, st.generation());
                }
                Err(SlotError::Saturated) => return None,
                Err(_) => {}
            }
            e = self.index.find(key, self.is_key(key))?;
        }
        None
    }

    /// Drop a pin or borrow taken by `pin_*` (or a [`ReadSet`]); frees the
    /// slot if it was the last thing keeping a deleted incarnation alive.
    #[inline]
    fn unpin(&self, s: SlotId, gen: Generation) {
        let t = self
            .meta(s)
            .state
            .release(gen)
            .expect("a pinned incarnation keeps its generation");
        self.settle(s, t);
    }

    /// Remove bucket `e` of the incarnation `gen` of slot `s`, which the
    /// caller owns (module doc, "Who removes a bucket"), and set UNLINKED.
    /// With `pinned`, the same CAS drops the caller's pin.
    fn unlink_owned(&self, s: SlotId, gen: Generation, e: Entry, pinned: bool) {
        debug_assert_eq!(e.slot, s);
        assert!(
            self.index.remove(e),
            "only the remover changes an OWNED bucket"
        );
        let st = &self.meta(s).state;
        let t = if pinned {
            st.unlink_and_unpin(gen)
        } else {
            st.unlink(gen)
        }
        .expect("the remover unlinks once");
        self.settle(s, t);
    }

    // ----- put -----

    /// `TooLarge` for a payload longer than a slot.
    #[inline]
    fn fits(&self, len: usize) -> Result<(), PutError> {
        if len > self.slot_bytes {
            return Err(PutError::TooLarge {
                len,
                slot_bytes: self.slot_bytes,
            });
        }
        Ok(())
    }

    /// A put's first steps: claim a free slot (`None`: none is free),
    /// reserve it (WRITING, a new generation) and write the key, length
    /// and tag next to it, for the index insert that publishes them.
    #[inline]
    fn reserve_slot(&self, key: Key, len: usize, meta: u32) -> Option<(SlotId, Generation)> {
        let s = self.bitmap.claim()?;
        // ORDERING: Relaxed — a counter for `usage`.
        self.live.fetch_add(1, Ordering::Relaxed);
        let m = self.meta(s);
        let gen = m.state.reserve();
        // ORDERING: Release fence — the index's seqlock reader (`is_entry`:
        // Relaxed key loads, Acquire fence, bucket re-read) that reads this
        // new key synchronizes with this fence, so it also sees everything
        // before our reservation, the old incarnation's bucket tombstone
        // included, and rejects that bucket (a release RMW alone orders
        // only what precedes it, not the Relaxed stores after it).
        fence(Ordering::Release);
        // ORDERING: Relaxed — published by the index insert (SeqCst CAS) and
        // by the commit (Release); see the fence above for seqlock readers.
        m.key_hi.store(key.hi(), Ordering::Relaxed);
        m.key_lo.store(key.lo(), Ordering::Relaxed);
        m.len_meta
            .store(len as u64 | (u64::from(meta) << 32), Ordering::Relaxed);
        Some((s, gen))
    }

    /// Store `data` under `key` with the caller's tag `meta`.
    pub fn put(&self, key: Key, data: &[u8], meta: u32) -> Result<PutOutcome, PutError> {
        self.fits(data.len())?;
        self.session().ok_or(PutError::Closed)?.put(key, data, meta)
    }

    /// A batch of single-key operations under one arena guard (see
    /// [`Session`]). `None` once the core is closing.
    pub fn session(&self) -> Option<Session<'_>> {
        Some(Session {
            core: self,
            g: self.arena.enter().ok()?,
            reading: std::cell::Cell::new(false),
        })
    }

    /// [`DaxCore::session`] without waiting for a pending remap
    /// ([`Arena::try_enter`]).
    pub fn try_session(&self) -> Result<Session<'_>, TryEnterError> {
        Ok(Session {
            core: self,
            g: self.arena.try_enter()?,
            reading: std::cell::Cell::new(false),
        })
    }

    /// `put` for many keys: per-key success (a full arena or a failed copy is
    /// `false`, never an error). Unequal lengths are an error.
    pub fn put_many(&self, keys: &[Key], bufs: &[&[u8]]) -> Result<Vec<bool>, CoreError> {
        if keys.len() != bufs.len() {
            return Err(CoreError::LengthMismatch {
                what: "put_many",
                keys: keys.len(),
                bufs: bufs.len(),
            });
        }
        let Ok(g) = self.arena.enter() else {
            return Ok(vec![false; keys.len()]);
        };
        Ok(keys
            .iter()
            .zip(bufs)
            .map(|(&k, b)| {
                b.len() <= self.slot_bytes
                    && self.put_with(&g, k, b.len(), 0, |w| w.write(0, b)).is_ok()
            })
            .collect())
    }

    /// The put protocol with the copy left to `copy(offset) -> ok`. The
    /// caller holds an arena guard and checked `len <= slot_bytes`.
    fn put_with(
        &self,
        guard: &ArenaGuard<'_>,
        key: Key,
        len: usize,
        meta: u32,
        copy: impl FnOnce(&SlotWriter<'_>) -> bool,
    ) -> Result<PutOutcome, PutError> {
        // One check of the device for the whole put (it was two: here and
        // in `put_absent_with`); a fault arriving after it is found by the
        // copy, which then fails.
        if self.arena.is_failed() {
            return Err(PutError::DeviceFailed);
        }
        // Cheap early exit for re-stores, the common case in LMCache.
        let snap = self.leases.snapshot();
        if self.index.contains_live(key, self.is_key(key)) {
            if let Present::Answer(r) = self.present(key, snap) {
                return r;
            }
            // Going away as we looked (`present`): store it (the insert
            // below settles any race).
        }
        self.put_unfailed_with(guard, key, len, meta, copy)
    }

    /// [`DaxCore::put_with`] without its early presence check, for a
    /// caller that has just found the key absent (the engine, under the
    /// key's claim). Still correct for a present key: the index insert
    /// refuses it and the put answers `AlreadyPresent`.
    fn put_absent_with(
        &self,
        guard: &ArenaGuard<'_>,
        key: Key,
        len: usize,
        meta: u32,
        copy: impl FnOnce(&SlotWriter<'_>) -> bool,
    ) -> Result<PutOutcome, PutError> {
        if self.arena.is_failed() {
            return Err(PutError::DeviceFailed);
        }
        self.put_unfailed_with(guard, key, len, meta, copy)
    }

    /// [`DaxCore::put_absent_with`] once the caller found the device not
    /// failed.
    #[inline]
    fn put_unfailed_with(
        &self,
        guard: &ArenaGuard<'_>,
        key: Key,
        len: usize,
        meta: u32,
        copy: impl FnOnce(&SlotWriter<'_>) -> bool,
    ) -> Result<PutOutcome, PutError> {
        if self.fault_full() {
            return Err(PutError::Full);
        }
        let (s, gen) = self.reserve_slot(key, len, meta).ok_or(PutError::Full)?;
        let m = self.meta(s);
        // A present key that is going away (`present` says None) is
        // inserted again with the same reservation: its slot and key are
        // ready, and an answer of "present" for a key that is leaving would
        // be a success for a key not stored.
        let mut tries = 0;
        let e = loop {
            let snap = self.leases.snapshot();
            let answer = match self.index.insert(key, s, self.is_key(key)) {
                Insert::Inserted(e) => break e,
                Insert::Full => Err(PutError::IndexFull),
                Insert::Present => match self.present(key, snap) {
                    Present::Answer(r) => r,
                    Present::Gone { .. } if tries < GONE_RETRIES => {
                        tries += 1;
                        crate::sync::yield_now();
                        continue;
                    }
                    // Still leaving after every retry (its remover is
                    // preempted): a lease's copy is not claimed as
                    // present; any other keeps a plain put's answer.
                    Present::Gone { leased: true } => Err(PutError::Leased),
                    Present::Gone { leased: false } => Ok(PutOutcome::AlreadyPresent),
                },
            };
            // Never published (or retracted): nobody else can reach it.
            let t = m
                .state
                .abort(gen, true)
                .expect("a fresh reservation aborts");
            self.settle(s, t);
            return answer;
        };
        let copied = !self.fault_copy() && {
            let writer = SlotWriter {
                guard,
                offset: s.0 as usize * self.slot_bytes,
                len,
                _one_thread: std::marker::PhantomData,
            };
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| copy(&writer))) {
                Ok(ok) => ok,
                Err(panic) => {
                    // A panicking writer would leave the slot WRITING and
                    // the key in flight for good: undo the
                    // put as for a failed copy, then go on unwinding.
                    let aborted = m
                        .state
                        .abort(gen, false)
                        .expect("only the writer clears WRITING");
                    self.settle(s, aborted);
                    self.unlink_owned(s, gen, e, false);
                    std::panic::resume_unwind(panic);
                }
            }
        };
        if copied {
            match m.state.commit(gen).expect("only the writer clears WRITING") {
                Commit::Committed => return Ok(PutOutcome::Stored),
                Commit::Canceled(t) => self.settle(s, t),
            }
        } else {
            let t = m
                .state
                .abort(gen, false)
                .expect("only the writer clears WRITING");
            self.settle(s, t);
        }
        // Canceled by a forced delete, or the copy failed: the writer
        // removes its own bucket (module doc, "Who removes a bucket").
        self.unlink_owned(s, gen, e, false);
        Err(if copied {
            PutError::Canceled
        } else if self.arena.is_failed() {
            PutError::DeviceFailed
        } else {
            PutError::CopyFailed
        })
    }

    /// Store a payload written by `writer` (upstream's `put_one(writer=...)`):
    /// the slot is reserved and the key in flight while `writer` runs;
    /// returning false fails the store and frees the slot.
    pub fn put_with_writer(
        &self,
        key: Key,
        len: usize,
        meta: u32,
        writer: impl FnOnce(&SlotWriter<'_>) -> bool,
    ) -> Result<PutOutcome, PutError> {
        self.fits(len)?;
        let g = self.arena.enter().map_err(|_| PutError::Closed)?;
        self.put_with(&g, key, len, meta, writer)
    }

    /// Store a payload read from another device's reservation (migration;
    /// upstream's `put_reserved_from_ptr`). `src` must be a live read set of
    /// the source core that contains `r`.
    pub fn put_reserved_from(
        &self,
        key: Key,
        src: &ReadSet<'_>,
        r: &Reservation,
    ) -> PutFromPtrResult {
        if r.len == 0 || r.len > self.slot_bytes || !src.holds(r) {
            return PutFromPtrResult::Invalid;
        }
        let Some(sg) = src.guard() else {
            return PutFromPtrResult::Invalid;
        };
        // A second guard on the source's own arena comes from the source
        // guard (`reenter`); another arena is entered normally (see
        // `arena`, "No exception for nested guards").
        let g = if std::ptr::eq(src.core, self) {
            sg.reenter()
        } else {
            let Ok(g) = self.arena.enter() else {
                return PutFromPtrResult::Closed;
            };
            g
        };
        if let Some(present) = self.present_as(key) {
            return present;
        }
        let res = self.put_with(&g, key, r.len, r.meta, |w| {
            let mut ok = true;
            // Stream through a bounded stack buffer: two mappings, no heap.
            let mut buf = [0u8; 16 * 1024];
            let mut done = 0;
            while done < r.len && ok {
                let n = (r.len - done).min(buf.len());
                ok = src.read_part(r, done, &mut buf[..n]) && w.write(done, &buf[..n]);
                done += n;
            }
            ok
        });
        match res {
            Ok(PutOutcome::Stored) => PutFromPtrResult::Inserted,
            Ok(PutOutcome::AlreadyPresent) => self
                .present_as(key)
                .unwrap_or(PutFromPtrResult::AlreadyExists),
            Err(PutError::Full | PutError::IndexFull) => PutFromPtrResult::NoSpace,
            Err(PutError::Closed) => PutFromPtrResult::Closed,
            Err(PutError::Canceled) => PutFromPtrResult::Canceled,
            Err(_) => PutFromPtrResult::CopyFailed,
        }
    }

    /// `InFlight` or `AlreadyExists` if `key` has a published entry.
    fn present_as(&self, key: Key) -> Option<PutFromPtrResult> {
        let (e, gen, st) = self.pin_published(key)?;
        self.unpin(e.slot, gen);
        Some(if st.has(WRITING) {
            PutFromPtrResult::InFlight
        } else {
            PutFromPtrResult::AlreadyExists
        })
    }

    /// A put found `key` present: its answer, or [`Present::Gone`] when the
    /// entry it found is going away (the put should store the key after
    /// all).
    ///
    /// When no store lease can be behind the entry the put saw after
    /// `snap` ([`LeaseTable::quiet`], one load): a successful no-op, as
    /// ever. Otherwise the key's incarnation is
    /// pinned and validated first ("Pin, validate, act"), so what is read
    /// belongs to this key's copy, not to a slot freed and reused
    /// meanwhile, and then:
    /// - WRITING under a store lease (the table names this very
    ///   incarnation, slot and generation): [`PutError::Leased`], since the
    ///   lease may never commit (a forced delete's cancel included: the
    ///   slot is the lease's until it ends);
    /// - WRITING by a plain put, or readable: `AlreadyPresent`;
    /// - detached, aborted or canceled and no longer WRITING: `Gone`
    ///   (`leased`: the table named it a store lease's).
    ///
    /// An entry not yet confirmed (PROVISIONAL: an insert settling) is
    /// looked at again; one whose pin failed is retried (loom,
    /// `tests/loom_core.rs`, and the review's hunts found each of these
    /// windows: an OWNED-only check, a check across PROVISIONAL → OWNED, a
    /// table released before the abort, a slot reused under the check).
    fn present(&self, key: Key, snap: u64) -> Present {
        if self.leases.quiet(snap) {
            return Present::Answer(Ok(PutOutcome::AlreadyPresent));
        }
        for _ in 0..RETRY_MAX {
            if let Some((e, gen, _)) = self.pin_published(key) {
                // The table first, then the state: a lease gives its table
                // entry back only after its abort, so a state still WRITING
                // after an entry was seen gone is a plain put's, and one
                // no longer WRITING after it was seen is a lease that
                // ended (committed: readable; aborted: going away).
                let leased = self.leases.holds_store(e.slot, gen);
                let st = self.meta(e.slot).state.load();
                let answer = if st.has(WRITING) {
                    Present::Answer(if leased {
                        Err(PutError::Leased)
                    } else {
                        Ok(PutOutcome::AlreadyPresent)
                    })
                } else if st.is_readable() {
                    Present::Answer(Ok(PutOutcome::AlreadyPresent))
                } else {
                    Present::Gone { leased }
                };
                self.unpin(e.slot, gen);
                return answer;
            }
            if !self.index.contains_live(key, self.is_key(key)) {
                return Present::Gone { leased: false };
            }
            // PROVISIONAL: its insert is settling.
            crate::sync::yield_now();
        }
        Present::Gone { leased: false }
    }

    // ----- leases (`device::lease`) -----

    /// Reserve a slot for `key` and hand it to the caller to fill
    /// (`device::lease` has the contract): `len` bytes (at most a slot)
    /// with the caller's tag `meta`. The key is in flight until
    /// [`StoreLease::commit`]: lookups and loads miss it, a plain put of
    /// it answers [`PutError::Leased`], a delete skips it and a forced one
    /// cancels it. A key stored or in flight already answers
    /// [`LeasedStore::AlreadyPresent`]. Never waits: `Busy` while a remap
    /// is pending.
    pub fn lease_store(
        &self,
        key: Key,
        len: usize,
        meta: u32,
    ) -> Result<LeasedStore<'_>, LeaseError> {
        if len > self.slot_bytes {
            return Err(LeaseError::TooLarge {
                len,
                slot_bytes: self.slot_bytes,
            });
        }
        // First the mapping: no remap can change `max_slots` (and so which
        // slots the bitmap hands out) or move the mapping from here on.
        let arena = self.arena_lease()?;
        if self.arena.is_failed() {
            return Err(LeaseError::DeviceFailed);
        }
        if self.index.contains_live(key, self.is_key(key)) {
            return Ok(LeasedStore::AlreadyPresent);
        }
        if self.fault_full() {
            return Err(LeaseError::Full);
        }
        // The put protocol up to the copy (`put_absent_with`).
        let (s, gen) = self.reserve_slot(key, len, meta).ok_or(LeaseError::Full)?;
        let m = self.meta(s);
        // The table entry before the index entry (both SeqCst): a put that
        // finds the key through the index also finds its lease (`present`).
        let undo = |s: SlotId| {
            let t = m
                .state
                .abort(gen, true)
                .expect("a fresh reservation aborts");
            self.settle(s, t);
        };
        let Some(table_at) = self.leases.claim(s, gen, true) else {
            undo(s);
            return Err(LeaseError::TooMany {
                max: crate::device::lease::LEASES_MAX,
            });
        };
        let entry = match self.index.insert(key, s, self.is_key(key)) {
            Insert::Inserted(e) => e,
            other => {
                self.leases.release(table_at);
                undo(s);
                return match other {
                    Insert::Full => Err(LeaseError::IndexFull),
                    _ => Ok(LeasedStore::AlreadyPresent),
                };
            }
        };
        Ok(LeasedStore::Leased(StoreLease {
            held: LeasedSlot {
                core: self,
                arena,
                slot: s,
                generation: gen,
                table_at,
                len,
            },
            key,
            entry,
            ended: false,
        }))
    }

    /// The mapping held for a lease (never waits: `Busy` while a remap is
    /// pending, `Closed` once closing).
    fn arena_lease(&self) -> Result<ArenaLease<'_>, LeaseError> {
        self.arena.try_lease().map_err(|e| match e {
            TryEnterError::Closed => LeaseError::Closed,
            TryEnterError::Busy => LeaseError::Busy,
        })
    }

    /// [`StoreLease::commit`]: the put's commit, or its cancel path.
    pub(crate) fn lease_commit(&self, l: &StoreLease<'_>) -> Result<(), LeaseError> {
        // A device that failed meanwhile serves nothing: a commit there
        // would answer stored for a key every read then misses.
        if self.arena.is_failed() {
            self.lease_abort(l);
            return Err(LeaseError::DeviceFailed);
        }
        let m = self.meta(l.held.slot);
        // The commit's Release CAS publishes the caller's copy to readers,
        // which borrow with an Acquire CAS (the copy finished before this
        // call: the lease contract).
        match m
            .state
            .commit(l.held.generation)
            .expect("only the lease holder clears WRITING")
        {
            Commit::Committed => {
                // After the commit: a put that still finds the entry finds
                // it readable (`present`). The table entry names this
                // incarnation, so a stale one never speaks for the next.
                self.leases.release(l.held.table_at);
                Ok(())
            }
            Commit::Canceled(t) => {
                // No longer WRITING: a put that pins it now is told to
                // store (`present`). The table entry goes last, as in
                // `lease_abort`.
                self.settle(l.held.slot, t);
                self.unlink_owned(l.held.slot, l.held.generation, l.entry, false);
                self.leases.release(l.held.table_at);
                Err(LeaseError::Canceled)
            }
        }
    }

    /// [`StoreLease::abort`] (and its drop): the put's failed-copy path.
    pub(crate) fn lease_abort(&self, l: &StoreLease<'_>) {
        // Until the abort a put that pins the slot sees WRITING and the
        // table entry (`Leased`); after it, no longer WRITING (told to
        // store). The table entry goes last, after the index entry: while
        // the index still shows the key, `any_store` must not say "no
        // lease" (a put would take the key for present; the review's hunt
        // found that). An entry released after the slot was freed and
        // reused names the old generation, so it never speaks for the new
        // key.
        let t = self
            .meta(l.held.slot)
            .state
            .abort(l.held.generation, false)
            .expect("only the lease holder clears WRITING");
        self.settle(l.held.slot, t);
        self.unlink_owned(l.held.slot, l.held.generation, l.entry, false);
        self.leases.release(l.held.table_at);
    }

    /// Borrow `key`'s readable slot for the caller to read
    /// (`device::lease`): `None` on a miss (absent, in flight, detached).
    /// The slot is not freed or reused until the lease drops; a delete
    /// meanwhile detaches the key. Never waits: `Busy` while a remap is
    /// pending.
    pub fn lease_load(&self, key: Key) -> Result<Option<ReadLease<'_>>, LeaseError> {
        let arena = self.arena_lease()?;
        let Some((s, gen)) = self.pin_readable(key) else {
            return Ok(None);
        };
        let Some(table_at) = self.leases.claim(s, gen, false) else {
            self.unpin(s, gen);
            return Err(LeaseError::TooMany {
                max: crate::device::lease::LEASES_MAX,
            });
        };
        // ORDERING: Relaxed — ordered by the borrow's Acquire CAS, which
        // read from this incarnation's commit (after the writer's stores).
        let lm = self.meta(s).len_meta.load(Ordering::Relaxed);
        Ok(Some(ReadLease {
            held: LeasedSlot {
                core: self,
                arena,
                slot: s,
                generation: gen,
                table_at,
                len: (lm & 0xFFFF_FFFF) as usize,
            },
            meta: (lm >> 32) as u32,
        }))
    }

    /// [`ReadLease`]'s drop.
    pub(crate) fn lease_release(&self, l: &ReadLease<'_>) {
        self.leases.release(l.held.table_at);
        self.unpin(l.held.slot, l.held.generation);
    }

    /// The device's mapping as a registrant sees it (`arena::Region`):
    /// where it is and which mapping it is (the epoch changes on every
    /// remap). Empty once unmapped.
    pub fn regions(&self) -> Vec<crate::device::arena::Region> {
        self.arena.regions()
    }

    /// Follow the mapping's life (`arena::MappingObserver`): told of the
    /// mapping alive now at once, then of every remap and of the unmap
    /// (at close, or when the core drops if a lease kept close from
    /// unmapping). False from inside an observer callback. Hold the core
    /// weakly in the observer: the device keeps its observers until
    /// [`DaxCore::unobserve`] or its drop.
    pub fn observe(
        &self,
        observer: std::sync::Arc<dyn crate::device::arena::MappingObserver>,
    ) -> bool {
        self.arena.observe(observer)
    }

    /// Stop telling `observer` anything (`arena::Arena::unobserve`).
    pub fn unobserve(
        &self,
        observer: &std::sync::Arc<dyn crate::device::arena::MappingObserver>,
    ) -> bool {
        self.arena.unobserve(observer)
    }

    /// Leases alive on this device and the oldest one's age.
    pub fn lease_ages(&self) -> (usize, Option<std::time::Duration>) {
        self.leases.ages()
    }

    /// Cancel every store lease open on this device now, as a forced
    /// delete of each leased key would (a forced hotplug remove): each
    /// one's commit answers [`LeaseError::Canceled`] and frees its slot.
    /// A lease that committed first keeps its key (`SlotState::cancel`
    /// never touches a committed copy), so the caller's later listing of
    /// the committed keys finds it. Returns how many were canceled.
    pub fn cancel_store_leases(&self) -> usize {
        let mut n = 0;
        for (s, gen) in self.leases.stores_now() {
            if s.0 as usize >= self.capacity_slots {
                continue;
            }
            if let Ok(t) = self.meta(s).state.cancel(gen) {
                self.settle(s, t);
                n += 1;
            }
        }
        n
    }

    /// Wait for every operation inside the device now to leave (at most
    /// the drain timeout), holding new ones off meanwhile, whatever leases
    /// are live (`Arena::drain`): [`DaxCore::quiesce`] for a forced remove,
    /// which answers [`GateError::Leased`] while a lease lives.
    pub fn drain(&self) -> Result<(), CoreError> {
        self.arena.drain().map_err(|e| match e {
            GateError::Closed => CoreError::Closed,
            busy => CoreError::Busy(busy),
        })
    }

    // ----- lookup -----

    /// Per key: committed and readable? With `lock`, each hit takes one
    /// lookup lock (released by `unlock_many`). In-flight keys are misses.
    pub fn exists_many(&self, keys: &[Key], lock: bool) -> Vec<bool> {
        let Ok(_g) = self.arena.enter() else {
            return vec![false; keys.len()];
        };
        // Once per batch (`pin_readable_unfailed`): a failed device's keys
        // are misses.
        if self.arena.is_failed() {
            return vec![false; keys.len()];
        }
        keys.iter()
            .map(|&k| self.exists_unfailed(k, lock))
            .collect()
    }

    /// `exists_many` for one key.
    pub fn exists(&self, key: Key, lock: bool) -> bool {
        let Ok(_g) = self.arena.enter() else {
            return false;
        };
        self.exists_in(key, lock)
    }

    fn exists_in(&self, key: Key, lock: bool) -> bool {
        !self.arena.is_failed() && self.exists_unfailed(key, lock)
    }

    /// [`DaxCore::exists_in`] once the caller found the device not failed
    /// (`pin_readable_unfailed`).
    #[inline]
    fn exists_unfailed(&self, key: Key, lock: bool) -> bool {
        let Some((s, gen)) = self.pin_readable_unfailed(key) else {
            return false;
        };
        if !lock {
            self.unpin(s, gen);
            return true;
        }
        // The pin keeps the generation: the lock lands on this incarnation,
        // and the same CAS drops the pin.
        if let Ok(t) = self.meta(s).state.lock_and_unpin(gen) {
            self.settle(s, t);
            true
        } else {
            self.unpin(s, gen);
            false
        }
    }

    /// True if `key` is committed or its store is in flight (a put of it
    /// would be a no-op).
    pub fn contains_live(&self, key: Key) -> bool {
        self.session().is_some_and(|s| s.contains_live(key))
    }

    /// True while a store of `key` is in flight.
    pub fn has_inflight(&self, key: Key) -> bool {
        let Ok(_g) = self.arena.enter() else {
            return false;
        };
        self.present_as(key) == Some(PutFromPtrResult::InFlight)
    }

    /// Release one lookup lock per key. Unknown or unlocked keys do nothing.
    pub fn unlock_many(&self, keys: &[Key]) {
        let Ok(_g) = self.arena.enter() else {
            return;
        };
        for &k in keys {
            self.unlock_in(k);
        }
    }

    #[inline]
    fn unlock_in(&self, key: Key) -> bool {
        let Some((e, gen, _)) = self.pin_published(key) else {
            return false;
        };
        if let Ok(t) = self.meta(e.slot).state.unlock_and_unpin(gen) {
            self.settle(e.slot, t);
            true
        } else {
            self.unpin(e.slot, gen);
            false
        }
    }

    /// Lock count of a key (0 if absent).
    pub fn lock_count(&self, key: Key) -> u32 {
        let Ok(_g) = self.arena.enter() else {
            return 0;
        };
        self.pin_readable(key).map_or(0, |(s, gen)| {
            let n = self.meta(s).state.load().lock_count();
            self.unpin(s, gen);
            n
        })
    }

    // ----- read -----

    /// Borrow the readable keys. Positional (`prefix_only = false`): misses
    /// are skipped and each reservation carries its position. Prefix-only:
    /// stop at the first miss. The reads finalize when the set drops.
    pub fn reserve_reads(&self, keys: &[Key], prefix_only: bool) -> ReadSet<'_> {
        let mut set = ReadSet {
            core: self,
            guard: None,
            // Room for a task's keys up front (one allocation instead of
            // a grow per doubling); a long list of misses stays cheap.
            items: Vec::with_capacity(keys.len().min(64)),
        };
        let Ok(g) = self.arena.enter() else {
            return set;
        };
        // A failed device's keys are misses: checked once for the batch
        // (`pin_readable_unfailed`).
        let keys = if self.arena.is_failed() { &[] } else { keys };
        for (i, &k) in keys.iter().enumerate() {
            match self.pin_readable_unfailed(k) {
                Some((s, gen)) => {
                    let (len, meta) = self.len_meta(s);
                    let pos = set.items.len() as u32;
                    set.items.push(Reservation {
                        index: i,
                        key: k,
                        slot: s,
                        generation: gen,
                        offset: s.0 as usize * self.slot_bytes,
                        len,
                        meta,
                        pos,
                    });
                }
                None if prefix_only => break,
                None => {}
            }
        }
        if !set.items.is_empty() {
            // ORDERING: Relaxed — a statistic.
            self.active_reads.fetch_add(1, Ordering::Relaxed);
        }
        set.guard = Some(g);
        set
    }

    fn borrow_in(&self, key: Key) -> Option<(SlotId, Generation)> {
        self.pin_readable(key)
    }

    /// Copy each key's payload into its buffer: per key, true when copied.
    /// A miss or a buffer shorter than the payload gives false and leaves the
    /// buffer untouched; bytes beyond the payload are untouched too.
    pub fn load_many_into(
        &self,
        keys: &[Key],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<bool>, CoreError> {
        if keys.len() != bufs.len() {
            return Err(CoreError::LengthMismatch {
                what: "load_many_into",
                keys: keys.len(),
                bufs: bufs.len(),
            });
        }
        // Each key is borrowed, copied and released in turn, under one
        // guard, as `Session::load_into` does: no read set (its
        // allocation, its reservation records, the membership check its
        // public `read` needs, a second pass to release). The answers are
        // the same: each key's is its own, taken at its borrow.
        let Ok(g) = self.arena.enter() else {
            return Ok(vec![false; keys.len()]);
        };
        // A failed device's keys are misses: checked once for the batch
        // (`pin_readable_unfailed`); a copy it fails meanwhile fails.
        if self.arena.is_failed() {
            return Ok(vec![false; keys.len()]);
        }
        let mut reading = false;
        let out = keys
            .iter()
            .zip(bufs.iter_mut())
            .map(|(&k, dst)| {
                let Some((s, gen)) = self.pin_readable_unfailed(k) else {
                    return false;
                };
                if !reading {
                    reading = true;
                    // ORDERING: Relaxed — a statistic.
                    self.active_reads.fetch_add(1, Ordering::Relaxed);
                }
                let (len, _) = self.len_meta(s);
                self.fault_delay();
                #[allow(unsafe_code)]
                // SAFETY: `ArenaGuard::read`'s contract: 1. slot `s` is
                // borrowed (pinned and readable) until the `unpin` below: no
                // writer can reserve it meanwhile, and readers only read; the
                // range is its payload, inside the slot; 2. `dst` is a caller
                // slice, outside the mapping.
                let ok = dst.len() >= len
                    && unsafe { g.read(s.0 as usize * self.slot_bytes, &mut dst[..len]) }.is_ok();
                self.unpin(s, gen);
                ok
            })
            .collect();
        if reading {
            // ORDERING: Relaxed — a statistic.
            self.active_reads.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(out)
    }

    /// Copy one key's payload into `dst`: `Some(len)` on a hit, `None` on a
    /// miss or when `dst` is too short (then untouched).
    pub fn load_into(&self, key: Key, dst: &mut [u8]) -> Option<usize> {
        self.session()?.load_into(key, dst)
    }

    /// Look up (and lock) each key, writing hits into `out` (no allocation).
    /// `out` must be as long as `keys`.
    pub fn exists_many_into(
        &self,
        keys: &[Key],
        lock: bool,
        out: &mut [bool],
    ) -> Result<(), CoreError> {
        if keys.len() != out.len() {
            return Err(CoreError::LengthMismatch {
                what: "exists_many_into",
                keys: keys.len(),
                bufs: out.len(),
            });
        }
        let Ok(_g) = self.arena.enter() else {
            out.fill(false);
            return Ok(());
        };
        // Once per batch, as in `exists_many`.
        if self.arena.is_failed() {
            out.fill(false);
            return Ok(());
        }
        for (o, &k) in out.iter_mut().zip(keys) {
            *o = self.exists_unfailed(k, lock);
        }
        Ok(())
    }

    /// For each `out[i]` still `false`, whether `keys[i]` is committed and
    /// readable here (no lock taken): the engine's `exists` over its
    /// devices, a device at a time. One arena entry for the batch, not one
    /// per key: the entry is an atomic on a word every worker of this
    /// device writes too, so per key it was a cache-line transfer each way
    /// (docs/performance.md, "The plugin path's submit").
    pub fn exists_missing_into(&self, keys: &[Key], out: &mut [bool]) {
        let Ok(_g) = self.arena.enter() else {
            return;
        };
        // Once per batch, as in `exists_many`.
        if self.arena.is_failed() {
            return;
        }
        for (o, &k) in out.iter_mut().zip(keys) {
            if !*o {
                *o = self.exists_unfailed(k, false);
            }
        }
    }

    /// Delete one key (see `delete_many`); no allocation.
    pub fn delete(&self, key: Key, force: bool) -> bool {
        let Ok(_g) = self.arena.enter() else {
            return false;
        };
        self.delete_in(key, force)
    }

    /// Payload length and tag of a readable key.
    pub fn payload_len(&self, key: Key) -> Option<(usize, u32)> {
        let _g = self.arena.enter().ok()?;
        let (s, gen) = self.pin_readable(key)?;
        let lm = self.len_meta(s);
        self.unpin(s, gen);
        Some(lm)
    }

    // ----- delete -----

    /// Delete keys: per key, true when deleted. Locked and in-flight keys are
    /// skipped unless `force`; a forced in-flight key is canceled (its writer
    /// frees the slot). A borrowed slot becomes pending-free and the last
    /// reader frees it. Works while closing is not yet complete; after close,
    /// all false.
    pub fn delete_many(&self, keys: &[Key], force: bool) -> Vec<bool> {
        let Ok(_g) = self.arena.enter() else {
            return vec![false; keys.len()];
        };
        keys.iter().map(|&k| self.delete_in(k, force)).collect()
    }

    #[inline]
    fn delete_in(&self, key: Key, force: bool) -> bool {
        self.delete_locks_in(key, force).is_some()
    }

    /// Delete `key`; `Some(lock count of the copy deleted)` if it was.
    #[inline]
    fn delete_locks_in(&self, key: Key, force: bool) -> Option<u32> {
        let (e, gen, _) = self.pin_published(key)?;
        let s = e.slot;
        match self.meta(s).state.detach(gen, force) {
            Ok(t) if !t.prev.has(WRITING) => {
                self.settle(s, t);
                // We detached a committed copy: its bucket (validated under
                // the pin) is ours to remove; the unlink drops the pin too.
                self.unlink_owned(s, gen, e, true);
                Some(t.prev.lock_count())
            }
            Ok(t) => {
                // Canceled a store in flight: its writer removes its bucket.
                self.settle(s, t);
                self.unpin(s, gen);
                Some(t.prev.lock_count())
            }
            Err(_) => {
                self.unpin(s, gen);
                None
            }
        }
    }

    /// Forced delete of `key` that returns the lock count its copy had at
    /// the moment it was detached (`None`: not present). A migration hands
    /// those locks to the key's new copy, so no lookup lock is lost or
    /// released by another reader's unlock.
    pub fn delete_taking_locks(&self, key: Key) -> Option<u32> {
        let _g = self.arena.enter().ok()?;
        self.delete_locks_in(key, true)
    }

    // ----- capacity -----

    /// `(current, after pending frees)` as fractions of the slot count.
    pub fn usage(&self) -> (f64, f64) {
        let max = self.max_slots();
        if max == 0 || self.is_closing() {
            return (0.0, 0.0);
        }
        // ORDERING: Relaxed — statistics.
        let live = self.live.load(Ordering::Relaxed);
        let pending = self.pending.load(Ordering::Relaxed);
        (
            live as f64 / max as f64,
            live.saturating_sub(pending) as f64 / max as f64,
        )
    }

    /// Slots in use (in flight, committed or pending free).
    pub fn live_slot_count(&self) -> usize {
        // ORDERING: Relaxed — a statistic.
        self.live.load(Ordering::Relaxed)
    }

    /// The committed, readable keys (a copy).
    pub fn snapshot_keys(&self) -> Vec<Key> {
        self.snapshot_keys_from(0)
    }

    /// The committed, readable keys in slots `first..` (a copy): what a
    /// shrink to `first` slots must move or evict.
    pub fn snapshot_keys_from(&self, first: usize) -> Vec<Key> {
        let Ok(_g) = self.arena.enter() else {
            return Vec::new();
        };
        (first..self.max_slots())
            .filter_map(|i| self.key_of_readable(SlotId(i as u32)))
            .collect()
    }

    /// The key of slot `s` if it holds a readable copy, read under a pin so
    /// the two halves come from one incarnation.
    fn key_of_readable(&self, s: SlotId) -> Option<Key> {
        let st = self.meta(s).state.load();
        if !st.is_readable() {
            return None;
        }
        // `pin`, not `borrow`: a scan must not set the CLOCK bit.
        let t = self.meta(s).state.pin(st.generation()).ok()?;
        let k = t.next.is_readable().then(|| self.slot_key(s));
        self.unpin(s, st.generation());
        k
    }

    /// Up to `n` unlocked committed keys to evict, by CLOCK (second chance):
    /// a slot whose REFERENCED bit is set gets it cleared and is skipped
    /// once. At most two sweeps.
    pub fn eviction_candidates(&self, n: usize) -> Vec<Key> {
        let mut out = Vec::new();
        let Ok(_g) = self.arena.enter() else {
            return out;
        };
        let max = self.max_slots();
        for _ in 0..2 * max {
            if out.len() >= n {
                break;
            }
            // ORDERING: Relaxed — the hand is a hint shared by sweepers.
            let i = self.clock_hand.fetch_add(1, Ordering::Relaxed) % max;
            let s = SlotId(i as u32);
            let st = self.meta(s).state.load();
            if !st.is_readable() || st.lock_count() > 0 {
                continue;
            }
            if st.has(REFERENCED) && self.meta(s).state.clear_referenced(st.generation()) {
                continue;
            }
            if let Some(k) = self.key_of_readable(s) {
                if !out.contains(&k) {
                    out.push(k);
                }
            }
        }
        out
    }

    /// True if every live slot sits below `new_slots`.
    pub fn can_shrink_to(&self, new_slots: usize) -> bool {
        if new_slots == 0 || self.is_closing() {
            return false;
        }
        !self.bitmap.any_taken(new_slots, self.max_slots())
    }

    /// Wait until no operation is inside the mapping (new ones wait behind
    /// this), then let them in again: after it returns, every operation
    /// that began before it has finished. Bounded by the drain timeout
    /// (`Busy` with the number of guards still held).
    pub fn quiesce(&self) -> Result<(), CoreError> {
        self.arena.exclusive(|_| ()).map_err(|e| match e {
            GateError::Closed => CoreError::Closed,
            busy @ (GateError::Busy { .. } | GateError::Leased { .. }) => CoreError::Busy(busy),
        })
    }

    /// Grow or shrink the mapping to `new_bytes`. Waits for in-flight
    /// operations (new ones wait behind it); a shrink that would cut off a
    /// live slot is refused and changes nothing; a failed remap keeps the
    /// old mapping. The index and generations are kept.
    pub fn remap(&self, new_bytes: usize) -> Result<(), CoreError> {
        let new_slots = new_bytes / self.slot_bytes;
        if new_slots == 0 {
            return Err(OpenError::NoSlot {
                size_bytes: new_bytes,
                slot_bytes: self.slot_bytes,
            }
            .into());
        }
        if new_slots > self.capacity_slots {
            return Err(OpenError::BeyondCapacity {
                what: self.describe().to_string(),
                requested_bytes: new_bytes,
                max_bytes: self.capacity_slots * self.slot_bytes,
            }
            .into());
        }
        self.arena
            .exclusive(|ex| {
                let cur = self.max_slots();
                if new_slots < cur && self.bitmap.any_taken(new_slots, cur) {
                    return Err(CoreError::WouldCutLiveSlots {
                        new_bytes,
                        new_slots,
                    });
                }
                ex.remap(new_bytes)?;
                self.bitmap.set_available(cur.min(new_slots), new_slots);
                // ORDERING: Relaxed — published by the gate's Release.
                self.max_slots.store(new_slots, Ordering::Relaxed);
                Ok(())
            })
            .map_err(|e| match e {
                GateError::Closed => CoreError::Closed,
                busy @ (GateError::Busy { .. } | GateError::Leased { .. }) => CoreError::Busy(busy),
            })?
    }

    /// Refuse new work, wait for in-flight reads and writes, forget every
    /// key and unmap. Idempotent.
    pub fn close(&self) {
        self.arena.close(|| {
            self.index.clear();
            for m in &*self.slots {
                m.state.reset();
            }
            self.bitmap.set_available(0, self.max_slots());
            // ORDERING: Relaxed — no users remain.
            self.live.store(0, Ordering::Relaxed);
            self.pending.store(0, Ordering::Relaxed);
        });
    }

    /// Status fields (docs/lmcache-dax-behavior.md §2.4). Scans the slot table:
    /// cold path.
    pub fn status(&self) -> CoreStatus {
        let closing = self.is_closing();
        let (lease_count, oldest_lease_age) = self.leases.ages();
        let (mut committed, mut locked, mut borrowed, mut writing) = (0, 0, 0, 0);
        if !closing {
            for m in &self.slots[..self.max_slots()] {
                let st = m.state.load();
                // Stores in flight are counted here rather than with a
                // shared counter on the put path.
                writing += usize::from(st.has(WRITING));
                committed += usize::from(st.is_readable());
                locked += usize::from(st.lock_count() > 0);
                borrowed += usize::from(st.borrow_count() > 0);
            }
        }
        CoreStatus {
            is_healthy: !closing && !self.arena.is_failed(),
            device_path: self.describe().to_string(),
            max_dax_size_bytes: self.arena_bytes(),
            slot_bytes: self.slot_bytes,
            max_slots: self.max_slots(),
            capacity_slots: self.capacity_slots,
            live_slot_count: self.live_slot_count(),
            committed_key_count: committed,
            locked_key_count: locked,
            borrowed_slot_count: borrowed,
            // ORDERING: Relaxed — statistics.
            pending_free_slot_count: self.pending.load(Ordering::Relaxed),
            active_read_count: self.active_reads.load(Ordering::Relaxed),
            active_write_count: writing,
            closing,
            supports_restart_recovery: false,
            dram_bytes: self.dram_bytes(),
            lease_count,
            oldest_lease_age,
        }
    }

    /// Check the bookkeeping invariants (tests and model checks): every set
    /// bitmap bit below `max_slots` is a non-free slot and vice versa, the
    /// live count matches, and every OWNED index entry points at a slot that
    /// holds its key. Only meaningful while no operation is in flight.
    pub fn check_invariants(&self) -> Result<(), String> {
        let max = self.max_slots();
        let mut live = 0;
        let mut pending = 0;
        for i in 0..max {
            let st = self.slots[i].state.load();
            let taken = self.bitmap.is_taken(i);
            if taken == st.is_free() {
                return Err(format!("slot {i}: bitmap taken={taken} but state {st:?}"));
            }
            live += usize::from(taken);
            pending += usize::from(st.has(PENDING_FREE));
            if st.has(WRITING) {
                return Err(format!("slot {i}: WRITING with no store in flight: {st:?}"));
            }
        }
        if live != self.live_slot_count() {
            return Err(format!(
                "live count {} but {live} slots taken",
                self.live_slot_count()
            ));
        }
        // ORDERING: Relaxed — quiescent check.
        let pc = self.pending.load(Ordering::Relaxed);
        if pending != pc {
            return Err(format!("pending count {pc} but {pending} slots pending"));
        }
        let committed = self.slots[..max]
            .iter()
            .filter(|m| m.state.load().is_readable())
            .count();
        if committed != self.index.owned_count() {
            return Err(format!(
                "{committed} committed slots but {} index entries",
                self.index.owned_count()
            ));
        }
        Ok(())
    }
}

impl Drop for DaxCore {
    fn drop(&mut self) {
        self.close();
    }
}

/// A session's load of at least this many bytes writes its destination
/// with streaming stores ([`crate::device::copy::from_dax_streaming`]): a
/// task of 16 such objects moves 16 MiB or more, past what a cache keeps,
/// and skipping each destination line's read-for-ownership is what makes
/// a large copy out of the mapping run at the speed of a copy in.
pub const STREAM_LOAD_MIN_BYTES: usize = 1 << 20;

/// Single-key operations under one arena guard, for a worker running a
/// batch of keys (an engine task part).
///
/// Every `DaxCore` call enters the arena's gate, a counter shared by every
/// thread using the device, and a load also counts itself in the shared
/// `active_read_count`: two read-modify-writes of shared cache lines per
/// call, which two workers copying 4 KiB objects bounce between their
/// cores on every object. A session pays both once per batch. It holds the
/// guard for its whole life, so a remap waits for the batch (bounded by
/// its length), and it counts as one active read while it has loaded
/// anything. Not `Send`: the guard belongs to the thread that took it.
pub struct Session<'a> {
    core: &'a DaxCore,
    g: ArenaGuard<'a>,
    /// Counted in `active_reads` (set by the first load).
    reading: std::cell::Cell<bool>,
}

impl std::fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("reading", &self.reading.get())
            .finish_non_exhaustive()
    }
}

impl Session<'_> {
    /// [`DaxCore::put`] under this session's guard.
    pub fn put(&self, key: Key, data: &[u8], meta: u32) -> Result<PutOutcome, PutError> {
        let c = self.core;
        c.fits(data.len())?;
        c.put_with(&self.g, key, data.len(), meta, |w| w.write(0, data))
    }

    /// [`Session::put`] for a key the caller has just found absent on
    /// this device's index under the engine's key claim: skips the early
    /// presence check (the insert still refuses a present key).
    pub(crate) fn put_absent(
        &self,
        key: Key,
        data: &[u8],
        meta: u32,
    ) -> Result<PutOutcome, PutError> {
        let c = self.core;
        c.fits(data.len())?;
        c.put_absent_with(&self.g, key, data.len(), meta, |w| w.write(0, data))
    }

    /// [`DaxCore::load_into`] under this session's guard. The slot is
    /// borrowed directly: no read set, no allocation.
    pub fn load_into(&self, key: Key, dst: &mut [u8]) -> Option<usize> {
        let c = self.core;
        let (s, gen) = c.borrow_in(key)?;
        if !self.reading.replace(true) {
            // ORDERING: Relaxed — a statistic.
            c.active_reads.fetch_add(1, Ordering::Relaxed);
        }
        let (len, _) = c.len_meta(s);
        let at = s.0 as usize * c.slot_bytes;
        c.fault_delay();
        #[allow(unsafe_code)]
        // SAFETY: `ArenaGuard::read`'s contract (`read_streaming` has the
        // same): 1. `borrow_in` borrowed slot `s` (pinned and readable): no
        // writer can reserve it until `unpin` below, and readers only read;
        // 2. `dst` is a caller slice, outside the mapping.
        let ok = dst.len() >= len
            && unsafe {
                if len >= STREAM_LOAD_MIN_BYTES {
                    self.g.read_streaming(at, &mut dst[..len])
                } else {
                    self.g.read(at, &mut dst[..len])
                }
            }
            .is_ok();
        c.unpin(s, gen);
        ok.then_some(len)
    }

    /// True while a remap of this session's device is pending: it waits
    /// for this session to end.
    pub fn remap_pending(&self) -> bool {
        self.core.remap_pending()
    }

    /// [`DaxCore::contains_live`] under this session's guard.
    pub fn contains_live(&self, key: Key) -> bool {
        self.core.index.contains_live(key, self.core.is_key(key))
    }

    /// Whether `key` is here for a store deciding where it goes: absent,
    /// stored (or stored in flight by a plain put), or under a store lease
    /// that has not committed (a store of it must not succeed: the lease
    /// may never commit). One extra load over `contains_live` while no
    /// store lease is open on the device.
    pub fn presence(&self, key: Key) -> Presence {
        let c = self.core;
        let snap = c.leases.snapshot();
        if !c.index.contains_live(key, c.is_key(key)) {
            return Presence::Absent;
        }
        match c.present(key, snap) {
            Present::Answer(Err(PutError::Leased)) => Presence::Leased,
            Present::Answer(_) => Presence::Stored,
            Present::Gone { .. } => Presence::Absent,
        }
    }

    /// Release one lookup lock on `key` under this session's guard; false
    /// if the key is absent or unlocked here.
    pub fn unlock(&self, key: Key) -> bool {
        self.core.unlock_in(key)
    }

    /// [`DaxCore::delete`] under this session's guard.
    pub fn delete(&self, key: Key, force: bool) -> bool {
        self.core.delete_in(key, force)
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        if self.reading.get() {
            // ORDERING: Relaxed — a statistic.
            self.core.active_reads.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(all(test, not(daxkv_loom)))]
mod tests {
    use super::*;

    /// Anonymous memory, so these tests also run under Miri.
    fn core(slots: usize) -> DaxCore {
        let arena = ArenaSpec::new(crate::device::arena::ArenaSource::Anonymous, slots * 4096);
        DaxCore::open(&CoreConfig::new(arena, 4096)).unwrap()
    }

    /// Two keys with the same home bucket (the index's home is the high
    /// bits of `lo * buckets`), different fingerprints.
    fn same_home(fp: u64) -> Key {
        Key::from_parts(fp << 32, fp)
    }

    /// Arm the stall: once an operation has loaded slot 0's state word
    /// (K1's, as `seen`), K1 is deleted and slot 0 is reused by K2 with its
    /// generation forced back to `seen`'s (a 24-bit wrap), so the word the
    /// stalled thread holds is current again, for another key.
    fn wrap_slot0_onto(c: &DaxCore, k1: Key, k2: Key, len: usize) {
        let seen = c.meta(SlotId(0)).state.load();
        c.inject_stall(StallPoint::AfterLoad, move |c| {
            assert!(c.delete(k1, false));
            c.meta(SlotId(0))
                .state
                .set_next_generation(seen.generation());
            assert_eq!(c.put(k2, &vec![2; len], 0), Ok(PutOutcome::Stored));
            assert_eq!(c.meta(SlotId(0)).state.load(), seen, "the word came back");
        });
    }

    /// A reader that loaded K1's state word, stalled, and came back after
    /// K1 was deleted and slot 0 went through a wrapped generation holding
    /// K2 (an identical state word), must not read K2's bytes as K1's.
    /// Fails without `pin_readable`'s key check under the pin (the load
    /// returns `Some(4096)` with K2's bytes).
    #[test]
    fn a_stalled_reader_never_reads_a_wrapped_incarnation() {
        let c = core(2);
        let (k1, k2) = (Key::digest(b"k1"), Key::digest(b"k2"));
        c.put(k1, &[1; 4096], 0).unwrap();
        wrap_slot0_onto(&c, k1, k2, 4096);
        let mut out = vec![0u8; 4096];
        assert_eq!(c.load_into(k1, &mut out), None, "K1 is gone");
        assert_eq!(c.load_into(k2, &mut out), Some(4096));
        assert!(out.iter().all(|&b| b == 2));
        c.check_invariants().unwrap();
        assert_eq!(c.status().borrowed_slot_count, 0, "no pin left behind");
    }

    /// The same stall on the delete path: a deleter of K1 that comes back to
    /// a wrapped word holding K2 must not detach K2 (detached, its bucket
    /// would never be removed, the slot would leak and `put(K2)` would
    /// answer `AlreadyPresent` forever).
    #[test]
    fn a_stalled_deleter_never_detaches_a_wrapped_incarnation() {
        let c = core(2);
        let (k1, k2) = (Key::digest(b"k1"), Key::digest(b"k2"));
        c.put(k1, &[1; 100], 0).unwrap();
        wrap_slot0_onto(&c, k1, k2, 100);
        assert!(!c.delete(k1, true), "K1 was already deleted");
        assert!(c.exists(k2, false), "K2 untouched");
        assert_eq!(c.payload_len(k2), Some((100, 0)));
        assert_eq!(c.live_slot_count(), 1);
        c.check_invariants().unwrap();
        assert!(c.delete(k2, false));
        assert_eq!(c.live_slot_count(), 0);
        c.check_invariants().unwrap();
    }

    /// Made deterministic with a stall: deleter A finds K in slot s at
    /// bucket p1 and stalls; meanwhile K is deleted and re-put into the same
    /// slot s but another bucket p2 (a tombstone earlier in the run). A
    /// then deletes the *new* copy completely, or nothing: never a detached
    /// slot whose bucket stays (that would leave 1 live slot, 0 keys,
    /// `put(K)` = `AlreadyPresent` forever, every load a miss).
    #[test]
    fn a_delete_racing_delete_and_reput_in_another_bucket_leaks_nothing() {
        let c = core(2);
        let (y, k) = (same_home(1), same_home(2));
        c.put(y, b"y", 0).unwrap(); // slot 0, bucket h
        c.put(k, b"k", 0).unwrap(); // slot 1, bucket h+1
        assert!(c.delete(y, false)); // bucket h: tombstone, slot 0 free
        c.put(Key::digest(b"x"), b"x", 0).unwrap(); // slot 0 taken again
        c.inject_stall(StallPoint::AfterFind, move |c| {
            assert!(c.delete(k, false));
            // Slot 1 again (the only free one), bucket h this time.
            assert_eq!(c.put(k, b"k2", 0), Ok(PutOutcome::Stored));
        });
        assert!(c.delete(k, false), "the deleter deletes the current copy");
        assert!(!c.exists(k, false));
        assert_eq!(c.live_slot_count(), 1, "only x is left");
        c.check_invariants().unwrap();
        assert_eq!(c.put(k, b"k3", 0), Ok(PutOutcome::Stored));
        c.check_invariants().unwrap();
    }

    /// A forced delete that cancels a store whose copy then fails. The
    /// writer removes its own bucket, the deleter reports the key deleted,
    /// nothing panics or leaks, and the key can be stored again at once
    /// (the deleter never goes on to remove a bucket the writer already
    /// removed, nor to free its slot again).
    #[test]
    fn a_forced_delete_of_a_failing_store_leaks_nothing() {
        let c = std::sync::Arc::new(core(2));
        let k = Key::digest(b"k");
        let r = c.put_with_writer(k, 64, 0, |_w| {
            assert!(c.delete(k, true), "a forced delete cancels the store");
            assert!(!c.exists(k, false));
            false // and the copy fails
        });
        assert_eq!(r, Err(PutError::CopyFailed));
        assert_eq!(c.live_slot_count(), 0);
        c.check_invariants().unwrap();
        assert_eq!(c.put(k, &[7; 64], 0), Ok(PutOutcome::Stored));
        c.inject_copy_faults(1);
        assert_eq!(
            c.put(Key::digest(b"other"), &[1; 8], 0),
            Err(PutError::CopyFailed)
        );
        c.inject_copy_faults(0);
        assert_eq!(c.live_slot_count(), 1);
        c.check_invariants().unwrap();
    }
}
