//! # The caller memory of an FFI face's tasks in flight
//!
//! The engine's [`RawBuf`](crate::plumbing::buf::RawBuf) contract is that a
//! descriptor's bytes are reached only through it while its task runs.
//! A foreign caller (the Python connector) can break that with nothing
//! but safe calls of its own language: the same
//! `bytearray` twice in one `submit_batch_get`, a destination that is also
//! the source of a set in flight, or a get into a buffer an earlier get is
//! still writing. Two workers would then hold `&mut` to the same bytes (or
//! one `&` and one `&mut`): undefined behaviour in Rust, torn data in
//! practice. [`Busy`], kept by the face next to its pending tasks,
//! refuses such a submit before anything reaches the
//! engine, naming both buffers.
//!
//! Rules: a load destination shares no byte with any other buffer in
//! flight; store sources may share bytes with each other (both only read).
//! Empty buffers share nothing. A task's ranges are held from its submit
//! until its completion is collected (when its exports are released), so
//! the check covers exactly the time the engine may touch them.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

/// The ranges of one task, to give back when it is collected.
#[derive(Debug, Default)]
pub struct Held {
    writes: Vec<usize>,
    reads: Vec<(usize, u64)>,
}

/// Why a buffer was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Clash {
    /// Another buffer of the same batch, by index.
    Batch(usize),
    /// A buffer of the task whose future id this is.
    InFlight(u64),
}

/// The memory of every task in flight.
#[derive(Debug, Default)]
pub struct Busy {
    /// Load destinations, disjoint: start → (end, future id).
    writes: BTreeMap<usize, (usize, u64)>,
    /// Store sources: (start, serial) → (end, future id); each at most
    /// `max_read` bytes long, so a query scans a bounded window.
    reads: BTreeMap<(usize, u64), (usize, u64)>,
    max_read: usize,
    /// The longest merged run of sources ([`Busy::hold_reads`]): 16 ×
    /// `max_read` as built, so the window a destination check scans stays
    /// bounded however many consecutive sources one task has.
    max_run: usize,
    serial: u64,
}

impl Busy {
    /// `max_read`: the longest store source ever held (the slot size:
    /// longer sources are refused before they get here).
    pub fn new(max_read: usize) -> Busy {
        Busy {
            max_read,
            max_run: max_read.saturating_mul(16),
            ..Busy::default()
        }
    }

    /// The destination overlapping `[s, e)`, if any. The destinations are
    /// disjoint, so sorted by start they are sorted by end too: only the
    /// last one starting before `e` can reach past `s`.
    fn write_at(&self, s: usize, e: usize) -> Option<u64> {
        self.writes
            .range(..e)
            .next_back()
            .and_then(|(_, &(end, fid))| (end > s).then_some(fid))
    }

    /// A source overlapping `[s, e)`, if any.
    fn read_at(&self, s: usize, e: usize) -> Option<u64> {
        self.reads
            .range((s.saturating_sub(self.max_read), 0)..(e, 0))
            .find(|(_, &(end, _))| end > s)
            .map(|(_, &(_, fid))| fid)
    }

    /// Hold `ranges` (`(ptr, len)`) as load destinations of future `fid`,
    /// or refuse the first that clashes (`(its index, with what)`),
    /// holding nothing.
    pub fn hold_writes(
        &mut self,
        fid: u64,
        ranges: &[(usize, usize)],
    ) -> Result<Held, (usize, Clash)> {
        let mut held = Held::default();
        for (i, &(s, len)) in ranges.iter().enumerate() {
            let e = s.saturating_add(len);
            if len == 0 {
                continue;
            }
            let clash = match self.write_at(s, e).or_else(|| self.read_at(s, e)) {
                Some(other) if other == fid => {
                    // One of this batch: say which.
                    let j = ranges[..i]
                        .iter()
                        .position(|&(s2, l2)| l2 > 0 && s2 < e && s2.saturating_add(l2) > s)
                        .unwrap_or(0);
                    Some(Clash::Batch(j))
                }
                Some(other) => Some(Clash::InFlight(other)),
                None => None,
            };
            if let Some(c) = clash {
                self.release(held);
                return Err((i, c));
            }
            self.writes.insert(s, (e, fid));
            held.writes.push(s);
        }
        Ok(held)
    }

    /// Hold `ranges` as store sources of future `fid`, or refuse the first
    /// that overlaps a load destination in flight, holding nothing.
    ///
    /// Sources that touch or overlap, in the order given, are held as one
    /// range, up to `16 × max_read` long: a task's objects are often
    /// consecutive (LMCache's L1 allocator hands out neighbours; the
    /// bench's views are), and one entry costs one tree insert and one
    /// remove instead of one per object. What is refused is unchanged: a
    /// destination overlaps the merged range exactly when it overlaps one
    /// of its sources. The cap keeps `max_read`, and with it the window
    /// every later destination check scans, bounded: one task of 4,096
    /// consecutive sources would otherwise widen it for good.
    pub fn hold_reads(
        &mut self,
        fid: u64,
        ranges: &[(usize, usize)],
    ) -> Result<Held, (usize, Clash)> {
        let mut held = Held::default();
        // The run being merged: (start, end).
        let mut run: Option<(usize, usize)> = None;
        for (i, &(s, len)) in ranges.iter().enumerate() {
            if len == 0 {
                continue;
            }
            let e = s.saturating_add(len);
            if let Some(other) = self.write_at(s, e) {
                self.release(held);
                return Err((i, Clash::InFlight(other)));
            }
            run = match run {
                Some((rs, re)) if s >= rs && s <= re && re.max(e) - rs <= self.max_run => {
                    Some((rs, re.max(e)))
                }
                Some(r) => {
                    self.hold_read(fid, r, &mut held);
                    Some((s, e))
                }
                None => Some((s, e)),
            };
        }
        if let Some(r) = run {
            self.hold_read(fid, r, &mut held);
        }
        Ok(held)
    }

    fn hold_read(&mut self, fid: u64, (s, e): (usize, usize), held: &mut Held) {
        self.serial += 1;
        let key = (s, self.serial);
        self.max_read = self.max_read.max(e - s);
        self.reads.insert(key, (e, fid));
        held.reads.push(key);
    }

    /// Give a task's ranges back.
    pub fn release(&mut self, held: Held) {
        for s in held.writes {
            self.writes.remove(&s);
        }
        for k in held.reads {
            self.reads.remove(&k);
        }
    }

    /// Ranges held (for tests and status).
    pub fn len(&self) -> usize {
        self.writes.len() + self.reads.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_are_exclusive_sources_are_shared() {
        let mut b = Busy::new(100);
        let a = b.hold_writes(1, &[(1000, 100), (1200, 50)]).unwrap();
        // Touching ends do not overlap; one byte in does.
        let c = b.hold_writes(2, &[(1100, 100)]).unwrap();
        assert_eq!(
            b.hold_writes(3, &[(0, 10), (1249, 1)]).unwrap_err(),
            (1, Clash::InFlight(1))
        );
        assert_eq!(b.len(), 3, "a refused batch holds nothing");
        assert_eq!(
            b.hold_writes(3, &[(5000, 10), (5005, 10)]).unwrap_err(),
            (1, Clash::Batch(0))
        );
        assert_eq!(
            b.hold_reads(4, &[(0, 10), (1150, 10)]).unwrap_err(),
            (1, Clash::InFlight(2))
        );
        let r1 = b.hold_reads(5, &[(3000, 80), (3000, 80)]).unwrap();
        let r2 = b.hold_reads(6, &[(3040, 80)]).unwrap();
        assert_eq!(
            b.hold_writes(7, &[(3119, 5)]).unwrap_err(),
            (0, Clash::InFlight(6))
        );
        assert_eq!(
            b.hold_writes(7, &[(2990, 11)]).unwrap_err(),
            (0, Clash::InFlight(5))
        );
        assert!(b.hold_writes(7, &[(3120, 5), (0, 0), (3125, 0)]).is_ok());
        for h in [a, c, r1, r2] {
            b.release(h);
        }
        assert_eq!(b.len(), 1);
        assert!(b.hold_writes(8, &[(1000, 300)]).is_ok());
    }

    /// Busy against a brute-force model: random batches of sources and
    /// destinations (touching, overlapping, repeated, empty), random
    /// releases; every answer (held, or which index clashed with whom)
    /// must be the model's.
    #[test]
    fn answers_as_a_brute_force_model_would() {
        /// A task in flight in the model: what it holds.
        struct Live {
            fid: u64,
            write: bool,
            ranges: Vec<(usize, usize)>,
            held: Held,
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut busy = Busy::new(64);
        // The model: per task in flight, what it holds.
        let mut live: Vec<Live> = Vec::new();
        for fid in 1..4000u64 {
            if !live.is_empty() && next(3) == 0 {
                let gone = live.swap_remove(next(live.len() as u64) as usize);
                busy.release(gone.held);
                continue;
            }
            let write = next(2) == 0;
            let count = 1 + next(6) as usize;
            let mut ranges = Vec::new();
            let mut at = next(40) as usize * 16;
            for _ in 0..count {
                let len = [0, 8, 16, 32, 64][next(5) as usize];
                ranges.push((at, len));
                at = match next(4) {
                    0 => at,                               // the same again
                    1 => at + len,                         // touching
                    2 => at + len / 2,                     // overlapping
                    _ => at + len + 16 * next(4) as usize, // a gap
                };
            }
            let overlap = |a: (usize, usize), b: (usize, usize)| {
                a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1
            };
            // The model's answer: the first range that clashes.
            let mut want: Result<(), (usize, Clash)> = Ok(());
            'outer: for (i, &r) in ranges.iter().enumerate() {
                for t in &live {
                    if (write || t.write) && t.ranges.iter().any(|&o| overlap(r, o)) {
                        want = Err((i, Clash::InFlight(t.fid)));
                        break 'outer;
                    }
                }
                if write {
                    if let Some(j) = ranges[..i].iter().position(|&o| overlap(r, o)) {
                        want = Err((i, Clash::Batch(j)));
                        break 'outer;
                    }
                }
            }
            let got = if write {
                busy.hold_writes(fid, &ranges)
            } else {
                busy.hold_reads(fid, &ranges)
            };
            match (got, want) {
                (Ok(held), Ok(())) => live.push(Live {
                    fid,
                    write,
                    ranges,
                    held,
                }),
                (Err((i, c)), Err((wi, _))) => {
                    assert_eq!(i, wi, "task {fid}: clashing index");
                    // When several clash (tasks in flight, or one of them
                    // and the batch), any one may be named; it must be one
                    // that does.
                    match c {
                        Clash::InFlight(o) => {
                            let t = live.iter().find(|t| t.fid == o).unwrap();
                            assert!(
                                (write || t.write)
                                    && t.ranges.iter().any(|&x| overlap(ranges[i], x))
                            );
                        }
                        Clash::Batch(j) => {
                            let first = ranges[..i].iter().position(|&o| overlap(ranges[i], o));
                            assert!(write && first == Some(j), "task {fid}: Batch({j})");
                        }
                    }
                }
                (g, w) => panic!(
                    "task {fid} {ranges:?} write={write}: got {:?}, model {w:?}",
                    g.map(|_| ())
                ),
            }
        }
        for t in live {
            busy.release(t.held);
        }
        assert!(busy.is_empty());
    }

    /// However many consecutive sources a task has, a merged run stays
    /// within 16 × `max_read`: the window later destination checks scan
    /// (`max_read`) does not grow with it (found by review: one task of
    /// 4,096 consecutive 64 KiB sources made every later check scan 256
    /// MiB of sources, 36× slower).
    #[test]
    fn a_long_run_of_sources_does_not_widen_the_scan_window() {
        const SLOT: usize = 64 << 10;
        let mut busy = Busy::new(SLOT);
        let ranges: Vec<_> = (0..4096).map(|i| (i * SLOT, SLOT)).collect();
        let h = busy.hold_reads(1, &ranges).unwrap();
        assert_eq!(busy.max_read, 16 * SLOT, "runs are capped");
        assert_eq!(busy.len(), 4096 / 16, "one entry per 16 sources");
        // Still refused anywhere inside, and nothing held past the end.
        for at in [0, SLOT * 16 - 1, SLOT * 16, SLOT * 4095 + 5] {
            assert_eq!(
                busy.hold_writes(2, &[(at, 1)]).unwrap_err(),
                (0, Clash::InFlight(1))
            );
        }
        assert!(busy.hold_writes(2, &[(SLOT * 4096, 1)]).is_ok());
        busy.release(h);
    }

    /// Consecutive sources are held as one range, and refuse exactly
    /// the destinations their parts would: one inside any part, none in
    /// a gap between runs; a release gives all of it back.
    #[test]
    fn consecutive_sources_merge_without_changing_what_is_refused() {
        let mut b = Busy::new(64);
        // 0..64, 64..128, 128..192 touch: one run; 256..320 after a gap.
        let r = b
            .hold_reads(1, &[(0, 64), (64, 64), (128, 64), (256, 64)])
            .unwrap();
        assert_eq!(b.len(), 2, "two runs, not four entries");
        for (s, len) in [(10, 1), (100, 1), (191, 1), (256, 1), (319, 1), (150, 200)] {
            assert_eq!(
                b.hold_writes(2, &[(s, len)]).unwrap_err(),
                (0, Clash::InFlight(1)),
                "destination {s}+{len}"
            );
        }
        let gap = b.hold_writes(2, &[(192, 64)]).unwrap();
        b.release(gap);
        // Out of order: no merge across a step back (still correct).
        let r2 = b
            .hold_reads(3, &[(1000, 10), (990, 10), (1000, 5)])
            .unwrap();
        assert_eq!(
            b.hold_writes(4, &[(995, 1)]).unwrap_err(),
            (0, Clash::InFlight(3))
        );
        b.release(r);
        b.release(r2);
        assert!(b.is_empty());
        assert!(b.hold_writes(5, &[(0, 2000)]).is_ok());
    }
}
