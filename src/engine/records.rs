//! # Task records: the free set, and completions popped before records free
//!
//! The task table is a fixed array of records ([`crate::cell::Mailbox`]).
//! A submit takes *any* free record from [`RecordSet`] (one bit per record,
//! set while the record holds a task in flight or a result not yet
//! collected) and names it in the task id: `id = (sequence << bits) |
//! record` (see `Engine` in the parent module). A result left uncollected
//! therefore holds exactly one record; a submit is refused only when every
//! record is taken (issue 8, defect 12: with `record = id mod slots`, one
//! uncollected result refused every N-th submit forever).
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
//! ## Why the completion ring never overflows (defect 4)
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
//! and a worker's push always finds room. Before the fix the collector
//! freed each record as it popped and released the ring space after its
//! loop: a freed record was refilled, run and published into a ring whose
//! space was still held, and the completion was dropped.
//! `tests/loom_task_table.rs` checks this with a popper racing a worker.
//!
//! Built on [`crate::sync`] atomics so the loom models run the real code.

#![forbid(unsafe_code)]

use crate::ring::{Consumer, Cqe, RingError};
use crate::sync::{AtomicU64, AtomicUsize, Ordering};

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
