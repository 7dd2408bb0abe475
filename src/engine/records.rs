//! # Task records: the free set, and completions popped before records free
//!
//! The task table is a fixed array of records ([`crate::plumbing::cell::Mailbox`]).
//! A submit takes *any* free record from [`RecordSet`] (one bit per record,
//! set while the record holds a task in flight or a result not yet
//! collected) and names it in the task id: `id = (sequence << bits) |
//! record` (see `Engine` in the parent module). A result left uncollected
//! therefore holds exactly one record; a submit is refused only when every
//! record is taken (with `record = id mod slots`, one uncollected result
//! would refuse every N-th submit forever).
//!
//! ## Protocol
//!
//! ```text
//! record bit:  0 (free) ──claim: fetch_or, Acquire──► 1 (taken)
//!              1 (taken) ──release: fetch_and, Release──► 0 (free)
//! ```
//!
//! | step | who | what |
//! |---|---|---|
//! | claim | submitter | lowest clear bit of some word, set with `fetch_or`; the record's mailbox is then empty |
//! | fill, run, publish | submitter, workers | the mailbox protocol; the worker pushes the CQE |
//! | pop | the one collector | [`pop_released`]: pop CQEs, then hand the ring space back |
//! | take, release | the collector | empty the record, *then* clear its bit |
//!
//! ## Why the completion ring never overflows
//!
//! A store CQE is pushed while its record is taken, and its record is
//! released only by the collector that popped it. [`pop_released`] hands the
//! popped ring space back (`Consumer::sync`) *before* the collector frees
//! any of the popped records, so at every moment
//!
//! ```text
//! unreleased CQEs in one worker's ring ≤ records taken ≤ task_slots ≤ ring capacity
//! ```
//!
//! and a worker's push always finds room. A collector that freed each
//! record as it popped and released the ring space after its loop would
//! let a freed record be refilled, run and published into a ring whose
//! space was still held, and the completion would be dropped.
//! `tests/loom_task_table.rs` checks this with a popper racing a worker.
//!
//! ## Taking a store result by id ([`Collect`])
//!
//! A store result can also be taken by its id (`Engine::query_store`,
//! `Engine::wait_store`) by a caller that never pops the ring. Freeing the
//! record at that take would break the bound above (its entry would still
//! sit in the ring while the refilled record publishes another), so a
//! store record has two things to wait for, in either order:
//!
//! ```text
//! collect:  0 ──take: fetch_or TAKEN──► TAKEN ──pop: fetch_or HARVESTED──► both: the popper frees
//!           0 ──pop: fetch_or HARVESTED──► HARVESTED ──take: fetch_or TAKEN──► both: the taker frees
//! ```
//!
//! Whoever sets the second bit releases the record, so the bound holds
//! (a record with an unreleased entry is never free), and the record is
//! released exactly once. Callers waiting by id pop the ring too (or their
//! records would never free): an entry they pop for a task whose result is
//! still in its record is marked in a [`ReadySet`], where the global pop
//! finds it; each result is delivered once, to whoever takes it first.
//!
//! Built on [`crate::sync`] atomics so the loom models run the real code.

#![forbid(unsafe_code)]

use crate::plumbing::ring::{Consumer, Cqe, RingError};
use crate::sync::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};

/// The free set of task records. See the module documentation.
#[derive(Debug)]
pub struct RecordSet {
    /// Bit `i` of word `w` set: record `64 * w + i` is taken. Bits past
    /// `len` are set for good.
    words: Box<[AtomicU64]>,
    len: usize,
    /// Word where the next claim starts looking (spreads claimers; only a
    /// hint).
    hint: AtomicUsize,
    /// Claims that lost a bit to another claimer (`fetch_or` found it set):
    /// the one place two submitters can make each other retry. Written
    /// only on a loss, so the uncontended claim never touches it. A
    /// statistic that orders nothing, so a `std` atomic: the loom models
    /// need not explore it.
    retries: std::sync::atomic::AtomicU64,
}

impl RecordSet {
    /// `len` records, all free.
    pub fn new(len: usize) -> RecordSet {
        assert!(len > 0 && u32::try_from(len).is_ok(), "record count {len}");
        let words = (0..len.div_ceil(64))
            .map(|w| {
                let first_past = len.saturating_sub(w * 64).min(64);
                let past = if first_past == 64 {
                    0
                } else {
                    u64::MAX << first_past
                };
                AtomicU64::new(past)
            })
            .collect();
        RecordSet {
            words,
            len,
            hint: AtomicUsize::new(0),
            retries: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a set has at least one record).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Take a free record; `None` only when every word was seen full.
    /// Bounded: at most `words × 65` atomic operations (a failed `fetch_or`
    /// means another claimer took that bit; each word is given up after 64
    /// such losses).
    pub fn claim(&self) -> Option<u32> {
        let n = self.words.len();
        // ORDERING: Relaxed — a starting point only; the bits decide.
        let start = self.hint.load(Ordering::Relaxed) % n;
        for k in 0..n {
            let w = (start + k) % n;
            let word = &self.words[w];
            // ORDERING: Relaxed — a first look; the fetch_or decides.
            let mut cur = word.load(Ordering::Relaxed);
            for _ in 0..64 {
                if cur == u64::MAX {
                    break;
                }
                let bit = 1u64 << (!cur).trailing_zeros();
                // ORDERING: Acquire — observes the collector's Release in
                // `release` (its emptying of the record happens before our
                // fill); pairs with `release`.
                let prev = word.fetch_or(bit, Ordering::Acquire);
                if prev & bit == 0 {
                    // ORDERING: Relaxed — a hint.
                    self.hint.store(w, Ordering::Relaxed);
                    return Some((w * 64) as u32 + bit.trailing_zeros());
                }
                // ORDERING: Relaxed — a statistic (`retries`).
                self.retries
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                cur = prev | bit;
            }
        }
        None
    }

    /// Free record `i` (taken by `claim`).
    pub fn release(&self, i: u32) {
        let (w, bit) = (i as usize / 64, 1u64 << (i % 64));
        assert!((i as usize) < self.len, "record {i} of {}", self.len);
        // ORDERING: Release — publishes the emptied record (and, in the
        // engine, the ring space handed back before it) to the next
        // claimer's Acquire `fetch_or` in `claim`.
        let prev = self.words[w].fetch_and(!bit, Ordering::Release);
        assert!(prev & bit != 0, "record {i} released twice");
    }

    /// Claims so far that lost a bit to another claimer and looked again.
    pub fn claim_retries(&self) -> u64 {
        // ORDERING: Relaxed — a statistic.
        self.retries.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records taken now (a racy snapshot, for status and tests).
    pub fn in_use(&self) -> usize {
        let past = self.words.len() * 64 - self.len;
        self.words
            .iter()
            // ORDERING: Relaxed — a statistic.
            .map(|w| w.load(Ordering::Relaxed).count_ones() as usize)
            .sum::<usize>()
            - past
    }
}

const TAKEN: u8 = 1;
const HARVESTED: u8 = 2;

/// A store record's two conditions for being freed: its result taken, its
/// completion entry popped (module doc, "Taking a store result by id").
#[derive(Debug, Default)]
pub struct Collect(AtomicU8);

impl Collect {
    /// Neither yet (by the submitter that claimed the record, before the
    /// task is published).
    pub fn reset(&self) {
        // ORDERING: Relaxed — the record is the claimer's alone; the task's
        // publication (SQE push, `done`) orders this before any reader.
        self.0.store(0, Ordering::Relaxed);
    }

    /// The result was taken. True if the entry was popped already: the
    /// caller frees the record.
    pub fn taken(&self) -> bool {
        // ORDERING: AcqRel — the second of the two sees the first's work
        // (the emptied mailbox, or the ring space handed back) before it
        // frees the record; pairs with `harvested`.
        self.0.fetch_or(TAKEN, Ordering::AcqRel) & HARVESTED != 0
    }

    /// Whether the completion entry has been popped.
    pub fn is_harvested(&self) -> bool {
        // ORDERING: Acquire — pairs with `harvested`.
        self.0.load(Ordering::Acquire) & HARVESTED != 0
    }

    /// The completion entry was popped and its ring space handed back.
    /// True if the result was taken already: the caller frees the record.
    pub fn harvested(&self) -> bool {
        // ORDERING: AcqRel — as in `taken`; pairs with `taken`.
        self.0.fetch_or(HARVESTED, Ordering::AcqRel) & TAKEN != 0
    }
}

/// Records whose store entry was popped by a caller waiting for another
/// task, with the result still inside: the global pop collects them.
#[derive(Debug)]
pub struct ReadySet {
    words: Box<[AtomicU64]>,
    /// Set after a bit is set; the global pop scans only when it is.
    any: AtomicBool,
}

impl ReadySet {
    /// Room for `len` records, none marked.
    pub fn new(len: usize) -> ReadySet {
        ReadySet {
            words: (0..len.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            any: AtomicBool::new(false),
        }
    }

    /// Mark record `r`.
    pub fn mark(&self, r: usize) {
        // ORDERING: Release (both) — a scanner that sees `any` sees the
        // bit; pairs with the Acquire swap in `drain`.
        self.words[r / 64].fetch_or(1 << (r % 64), Ordering::Release);
        self.any.store(true, Ordering::Release);
    }

    /// Unmark record `r` (its result was taken by id).
    pub fn unmark(&self, r: usize) {
        // ORDERING: Relaxed — a stale mark only costs a scanner one look.
        self.words[r / 64].fetch_and(!(1 << (r % 64)), Ordering::Relaxed);
    }

    /// Call `f` with every marked record, unmarking it. Cheap when none is
    /// marked (one load).
    pub fn drain(&self, mut f: impl FnMut(usize)) {
        // ORDERING: Relaxed — a first look; the swap decides.
        if !self.any.load(Ordering::Relaxed) {
            return;
        }
        // ORDERING: Acquire — pairs with `mark`: a mark whose `any` we
        // consumed has its bit visible below; a later mark sets `any`
        // again for the next drain.
        if !self.any.swap(false, Ordering::Acquire) {
            return;
        }
        for (w, word) in self.words.iter().enumerate() {
            // ORDERING: Relaxed — the swap of `any` above is the Acquire.
            let mut bits = word.swap(0, Ordering::Relaxed);
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                f(w * 64 + b);
            }
        }
    }
}

/// Pop up to `out.len()` completions into `out` and hand their ring space
/// back to the producer before returning, so a caller that then frees the
/// popped tasks' records can never let a refilled record's completion meet
/// a full ring (module doc). Returns how many were popped (in `out`), and
/// the ring error that stopped it, if any: entries popped before an error
/// are still handed back, never dropped.
pub fn pop_released(cq: &mut Consumer<Cqe>, out: &mut [Cqe]) -> (usize, Option<RingError>) {
    let mut n = 0;
    let r = loop {
        if n == out.len() {
            break Ok(());
        }
        match cq.pop() {
            Ok(Some(c)) => {
                out[n] = c;
                n += 1;
            }
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    // The popped entries are copied out: release their slots now. The
    // ones popped before an error are handed back with it, never dropped.
    cq.sync();
    (n, r.err())
}

#[cfg(all(test, not(daxkv_loom)))]
mod tests {
    use super::*;

    #[test]
    fn claims_every_record_once_then_refuses_and_reuses_a_freed_one() {
        for len in [1, 3, 64, 65, 130] {
            let s = RecordSet::new(len);
            let mut got: Vec<u32> = (0..len).map(|_| s.claim().unwrap()).collect();
            assert_eq!(s.claim(), None, "len {len}: full");
            assert_eq!(s.in_use(), len);
            got.sort_unstable();
            assert_eq!(got, (0..len as u32).collect::<Vec<_>>());
            s.release(len as u32 / 2);
            assert_eq!(s.claim(), Some(len as u32 / 2));
            assert_eq!(s.claim(), None);
        }
    }

    #[test]
    #[should_panic(expected = "released twice")]
    fn double_release_is_a_bug() {
        let s = RecordSet::new(4);
        let r = s.claim().unwrap();
        s.release(r);
        s.release(r);
    }
}
