//! # The task table: ids, records, and who takes a result
//!
//! A task lives in one record of a fixed table allocated at start-up
//! (`task_slots` records with room for `task_keys` keys each) and reused.
//! A submit claims any free record ([`RecordSet`]) and the task id names it:
//! `id = (sequence << id_bits) | record`. The record is a [`Mailbox`]:
//! filled by the submitter, read by the workers running the task's parts
//! and by pollers, taken (emptied) by one collector.
//!
//! When the record is free again depends on the kind:
//!
//! - **lookup, load**: when its result is taken (their completion-ring
//!   entries only wake waiters; losing one loses nothing).
//! - **store**: when its result is taken *and* its completion-ring entry
//!   has been popped with the ring space handed back ([`Collect`]), in
//!   either order. That keeps the store rings from overflowing
//!   ([`records`](super::records) module doc) now that a store result can
//!   be taken by id (`query_store`, `wait_store`) as well as by the global
//!   pop.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use super::answer::{Answer, Bitmap, Lens, TaskKind};
use super::records::{Collect, RecordSet};
use crate::key::Key;
use crate::plumbing::buf::{Buf, Lent};
use crate::plumbing::cell::Mailbox;
use crate::plumbing::ring::CAPACITY_MAX;

/// Keys of preallocated room in the whole task table (`task_slots` ×
/// `task_keys`): 16 M keys, 256 MiB of destination descriptors.
pub const MAX_TABLE_KEYS: usize = 1 << 24;

// Every completion ring holds at least `task_slots` entries (the store
// CQ's no-overflow argument, `records` module doc): `task_slots` is at most
// `MAX_TABLE_KEYS` (each record holds at least one key).
const _: () = assert!(MAX_TABLE_KEYS <= CAPACITY_MAX as usize);

/// One task-table record. Allocated at start-up (with room for
/// `task_keys` keys) and reused: a submit fills it, workers and pollers
/// read it, the collector takes the result out and leaves it empty
/// ([`Mailbox`]). The caller's vectors are moved in and dropped (or handed
/// back) at collection; the record's own vectors keep their capacity.
pub(super) struct TaskRec {
    pub(super) id: u64,
    pub(super) kind: TaskKind,
    pub(super) keys: Vec<Key>,
    pub(super) srcs: Vec<Buf>,
    /// Load destinations; read-only while the task runs.
    pub(super) dsts: Lent,
    /// One bit per key: the key succeeded.
    results: Vec<AtomicU64>,
    /// Loads: each hit's payload length.
    lens: Vec<AtomicU32>,
    pub(super) parts_left: AtomicU32,
    pub(super) panicked: AtomicBool,
    /// When the record was filled (the task-duration histogram's start).
    pub(super) submitted: Instant,
}

impl TaskRec {
    fn with_capacity(keys: usize) -> TaskRec {
        TaskRec {
            id: u64::MAX,
            kind: TaskKind::Store,
            keys: Vec::new(),
            srcs: Vec::new(),
            dsts: Lent::with_capacity(keys),
            results: (0..keys.div_ceil(64).max(1))
                .map(|_| AtomicU64::new(0))
                .collect(),
            lens: (0..keys).map(|_| AtomicU32::new(0)).collect(),
            parts_left: AtomicU32::new(0),
            panicked: AtomicBool::new(false),
            submitted: Instant::now(),
        }
    }

    /// Make the record ready for task `id` of `n` keys in `parts` parts.
    /// Grows its vectors only for a task larger than any before.
    pub(super) fn reset(&mut self, id: u64, kind: TaskKind, n: usize, parts: usize) {
        self.id = id;
        self.kind = kind;
        let words = n.div_ceil(64).max(1);
        self.results.truncate(words);
        for w in &mut self.results {
            *w.get_mut() = 0;
        }
        self.results.resize_with(words, || AtomicU64::new(0));
        if kind == TaskKind::Load {
            self.lens.truncate(n);
            for l in &mut self.lens {
                *l.get_mut() = 0;
            }
            self.lens.resize_with(n, || AtomicU32::new(0));
        }
        *self.parts_left.get_mut() = u32::try_from(parts).unwrap_or(u32::MAX);
        *self.panicked.get_mut() = false;
        self.submitted = Instant::now();
    }

    /// Whether key `i` succeeded so far.
    pub(super) fn is_set(&self, i: usize) -> bool {
        // ORDERING: Relaxed — only this part's worker writes bit `i`.
        self.results[i / 64].load(Ordering::Relaxed) & (1 << (i % 64)) != 0
    }

    /// Mark key `i` as succeeded (only the part that owns index `i`).
    pub(super) fn set(&self, i: usize) {
        // ORDERING: Relaxed — published by the Release of `done`.
        self.results[i / 64].fetch_or(1 << (i % 64), Ordering::Relaxed);
    }

    /// Mark key `i` of a load as hit with a payload of `len` bytes.
    pub(super) fn set_loaded(&self, i: usize, len: usize) {
        // Payloads are at most a slot (`u32` bytes: slots are < 4 GiB).
        // ORDERING: Relaxed — published by the Release of `done`.
        self.lens[i].store(u32::try_from(len).unwrap_or(u32::MAX), Ordering::Relaxed);
        self.set(i);
    }

    /// Keys that succeeded (0 if a part panicked).
    pub(super) fn ok_count(&self) -> usize {
        // ORDERING: Acquire — pairs with the Release in `WorkerCtx::run`.
        if self.panicked.load(Ordering::Acquire) {
            return 0;
        }
        self.results
            .iter()
            // ORDERING: Relaxed — read after the last part's AcqRel countdown.
            .map(|w| w.load(Ordering::Relaxed).count_ones() as usize)
            .sum()
    }

    /// Payload bytes of the keys that succeeded (metrics): a store's
    /// source lengths, a load's loaded lengths; 0 for a lookup or a task a
    /// part of which panicked. Read after the last part's countdown.
    pub(super) fn ok_bytes(&self) -> u64 {
        // ORDERING: Acquire — pairs with the Release in `WorkerCtx::run`.
        if self.kind == TaskKind::Lookup || self.panicked.load(Ordering::Acquire) {
            return 0;
        }
        let mut total = 0u64;
        for (w, word) in self.results.iter().enumerate() {
            // ORDERING: Relaxed — read after the last part's AcqRel countdown.
            let mut bits = word.load(Ordering::Relaxed);
            while bits != 0 {
                let i = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                total += match self.kind {
                    TaskKind::Store => self.srcs.get(i).map_or(0, |b| b.len() as u64),
                    // ORDERING: Relaxed — as above.
                    _ => self
                        .lens
                        .get(i)
                        .map_or(0, |l| u64::from(l.load(Ordering::Relaxed))),
                };
            }
        }
        total
    }

    /// The per-key result (all false if a part panicked).
    pub(super) fn bitmap(&self) -> Bitmap {
        // ORDERING: Acquire — pairs with the Release in `WorkerCtx::run`
        // (also ordered by the countdown and `done`).
        let panicked = self.panicked.load(Ordering::Acquire);
        Bitmap::from_words(
            self.keys.len(),
            self.results.iter().map(|w| {
                if panicked {
                    0
                } else {
                    // ORDERING: Relaxed — read after the Acquire of `done`.
                    w.load(Ordering::Relaxed)
                }
            }),
        )
    }

    /// Each key's payload length (0 for a miss), for a finished load.
    pub(super) fn lens(&self) -> Lens {
        let bits = self.bitmap();
        Lens::from_iter(
            self.keys.len(),
            self.lens.iter().enumerate().map(|(i, l)| {
                if bits.test(i) {
                    // ORDERING: Relaxed — read after the Acquire of `done`.
                    l.load(Ordering::Relaxed) as usize
                } else {
                    0
                }
            }),
        )
    }

    /// Drop the caller's vectors (the record keeps its own capacity).
    pub(super) fn clear(&mut self) {
        self.keys = Vec::new();
        self.srcs = Vec::new();
        drop(self.dsts.take_back());
    }
}

/// One entry of the task table.
pub(super) struct TaskSlot {
    /// The id of the last task finished in this slot (Release by the
    /// worker that finished it, after it let go of the record, so a
    /// collector that sees it never waits for that worker).
    pub(super) done: AtomicU64,
    /// Stores: result taken / completion popped (module doc).
    pub(super) collect: Collect,
    pub(super) rec: Mailbox<TaskRec>,
}

/// The table: records, their free set, and the id counter.
pub(super) struct TaskTable {
    slots: Box<[TaskSlot]>,
    free: RecordSet,
    /// Bits of a task id that name its record.
    id_bits: u32,
    /// Task sequence numbers (the high bits of task ids).
    next_seq: AtomicU64,
}

impl TaskTable {
    /// `slots` records with room for `keys` keys each.
    pub(super) fn new(slots: usize, keys: usize) -> TaskTable {
        TaskTable {
            slots: (0..slots)
                .map(|_| TaskSlot {
                    done: AtomicU64::new(u64::MAX),
                    collect: Collect::default(),
                    rec: Mailbox::new(TaskRec::with_capacity(keys)),
                })
                .collect(),
            free: RecordSet::new(slots),
            id_bits: slots.next_power_of_two().trailing_zeros().max(1),
            next_seq: AtomicU64::new(0),
        }
    }

    /// Records in the table.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Record claims that lost a bit to another submitter ([`RecordSet::claim_retries`]).
    pub(super) fn claim_retries(&self) -> u64 {
        self.free.claim_retries()
    }

    /// Records holding a task in flight or a result not collected, and
    /// collected stores whose completion entry is not popped yet (freed by
    /// the next harvest; `Engine::close` runs one).
    pub(super) fn in_use(&self) -> usize {
        self.free.in_use()
    }

    /// The record index task `id` names (its low `id_bits` bits).
    pub(super) fn record_of(&self, id: u64) -> usize {
        (id & ((1u64 << self.id_bits) - 1)) as usize
    }

    /// The entry of task `id`; `None` for an id that names no record
    /// (never handed out by this engine).
    pub(super) fn slot(&self, id: u64) -> Option<&TaskSlot> {
        self.slots.get(self.record_of(id))
    }

    /// The entry of record `r`.
    pub(super) fn slot_at(&self, r: usize) -> &TaskSlot {
        &self.slots[r]
    }

    /// Claim a free record and name a new task in it: `(record, id)`.
    /// `None` when every record is taken.
    pub(super) fn claim(&self) -> Option<(u32, u64)> {
        let record = self.free.claim()?;
        // The id names its record in its low bits: `(sequence << id_bits) |
        // record`, unique and increasing. The sequence has `64 - id_bits`
        // bits (52 with the default 4096 records; 40 with the largest
        // table): at 10 M tasks/s that is 14 years (30 hours for the
        // largest table) before an id repeats, and a repeat only matters to
        // a caller still holding the old id.
        // ORDERING: Relaxed — ids need only be unique (the RMW gives that).
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        // The record is ours alone (its bit is set, its mailbox empty):
        // nobody reads `collect` until the task is published.
        self.slots[record as usize].collect.reset();
        Some((record, (seq << self.id_bits) | u64::from(record)))
    }

    /// Give back a record that was claimed and never filled.
    pub(super) fn unclaim(&self, record: u32) {
        self.free.release(record);
    }

    /// Take task `id`'s result out of its record if it is finished and of
    /// kind `kind`: one caller gets `Ready`, every later call `Unknown`.
    /// Frees the record when nothing else needs it (module doc).
    pub(super) fn take<R>(
        &self,
        id: u64,
        kind: TaskKind,
        f: impl FnOnce(&mut TaskRec) -> R,
    ) -> Answer<R> {
        let Some(slot) = self.slot(id) else {
            return Answer::Unknown;
        };
        // Empty, being filled or being taken: not (or no longer) ours.
        let Some(rec) = slot.rec.read() else {
            return Answer::Unknown;
        };
        if rec.id != id {
            return Answer::Unknown;
        }
        if rec.kind != kind {
            return Answer::WrongKind(rec.kind);
        }
        // ORDERING: Acquire — pairs with the Release in `publish`, which
        // comes after the result bits, the destination bytes and every
        // worker's guard release.
        if slot.done.load(Ordering::Acquire) != id {
            return Answer::Pending;
        }
        // Another collector may win the take (then it is theirs).
        let Some(r) = rec.take(f) else {
            return Answer::Unknown;
        };
        // Emptied (the mailbox is 0 again). A store's record also waits
        // for its completion entry to be popped.
        if kind != TaskKind::Store || slot.collect.taken() {
            self.free.release(self.record_of(id) as u32);
        }
        Answer::Ready(r)
    }

    /// A store's completion entry for task `id` was popped and its ring
    /// space handed back. Returns whether its result is still in the
    /// record (not taken yet); frees the record if it was.
    pub(super) fn harvested(&self, id: u64) -> bool {
        let Some(slot) = self.slot(id) else {
            return false;
        };
        if slot.collect.harvested() {
            self.free.release(self.record_of(id) as u32);
            false
        } else {
            true
        }
    }

    /// Whether record `r`'s completion entry has been popped (stores).
    pub(super) fn is_harvested(&self, r: usize) -> bool {
        self.slots[r].collect.is_harvested()
    }

    /// The id of the task record `r` holds, if it holds one now.
    pub(super) fn id_at(&self, r: usize) -> Option<u64> {
        self.slots[r].rec.read().map(|rec| rec.id)
    }
}
