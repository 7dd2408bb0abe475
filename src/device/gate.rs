//! # Gate: the arena's admission word, and leases
//!
//! The atomics of [`crate::device::arena`]'s gate (its module doc,
//! "Gate protocol"), apart from the mapping they guard so that loom can
//! check them (`tests/loom_gate.rs`): one word counts the live guards and
//! holds the `EXCLUSIVE` (a remap is pending or running) and `CLOSED`
//! bits; a second counts **leases**.
//!
//! ## Leases
//!
//! A lease is a guard that is not tied to a thread: a caller holds it
//! across calls (a GPU copy engine writes into a leased slot between
//! `lease_store` and `commit`), so it may last as long as the caller
//! likes. It counts in the guard word like a guard (the mapping stays
//! while it lives) and also in `leases`, and it differs from a guard in
//! two ways:
//!
//! - **A lease never waits.** [`Gate::try_lease`] answers `Busy` while a
//!   remap is pending and `Closed` once closing, at once; there is no
//!   nested-guard exception for it.
//! - **A remap never waits for a lease.** [`Gate::begin_exclusive`]
//!   answers `Leased` at once when a lease is live, *before* it closes the
//!   gate (so the device's other traffic never stalls behind a slow
//!   lease), and again after, if a lease slipped in between.
//!
//! The second check is a Dekker pair, so all four accesses are `SeqCst`:
//!
//! ```text
//! try_lease:        leases += 1 ; prev = word += 1 ; prev has EXCLUSIVE|CLOSED → undo both
//! begin_exclusive:  word |= EXCLUSIVE ; leases > 0 → word &= !EXCLUSIVE, Leased
//! ```
//!
//! In the single total order of `SeqCst` operations, if the exclusive
//! section reads `leases == 0`, the lease's `leases += 1` comes after that
//! read, so its `word += 1` comes after the `word |= EXCLUSIVE` and reads
//! EXCLUSIVE: the lease backs out. Either the lease sees the section or the
//! section sees the lease (both may back off, neither proceeds over the
//! other). The section then waits for guards as before; no lease is among
//! them.
//!
//! ## Guards and leases in one word
//!
//! A guard counts 1 in the word, a lease [`LEASE_UNIT`]: one load tells
//! the guards apart from the leases ([`Gate::guards`]). A forced drain
//! ([`Gate::begin_drain`]: a forced hotplug remove) holds new guards and
//! leases off and waits for the guards alone, whatever leases are live: a
//! drain that read guards and leases from two words could subtract a lease
//! that had already left the word and see no guard while one is live (a
//! lease ending between the two loads).
#![forbid(unsafe_code)]

use crate::sync::{AtomicU64, Ordering};

/// The live guards and leases (bits 0..48 of the word).
pub const COUNT_MASK: u64 = (1 << 48) - 1;
/// What a lease counts in the word (guards count 1): leases in bits 24..48.
pub const LEASE_UNIT: u64 = 1 << 24;
/// The live guards (bits 0..24 of the word).
pub const GUARD_MASK: u64 = LEASE_UNIT - 1;
/// A remap is pending or running: new guards wait, leases are refused.
pub const EXCLUSIVE: u64 = 1 << 62;
/// Closing or closed: nothing is admitted.
pub const CLOSED: u64 = 1 << 63;

/// Why a lease or an exclusive section was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Closing or closed.
    Closed,
    /// A remap is pending (for a lease) or running.
    Busy,
    /// Leases are live (for an exclusive section): this many.
    Leased(u64),
}

/// The admission word and the lease count.
#[derive(Debug, Default)]
pub struct Gate {
    word: AtomicU64,
    leases: AtomicU64,
}

impl Gate {
    /// An open gate with nothing admitted.
    pub fn new() -> Gate {
        Gate::default()
    }

    /// Admit a guard: `Ok` unless EXCLUSIVE (and not `nested`) or CLOSED
    /// was set; a refused increment is undone (and `Err` carries whether
    /// the undo must wake a waiter, see [`Gate::leave`]).
    #[inline]
    pub fn enter(&self, nested: bool) -> Result<(), (Refused, bool)> {
        // ORDERING: Acquire — pairs with the Release `fetch_and` in
        // `end_exclusive` (through the RMW release sequence on the word),
        // so a guard admitted after a remap sees the new mapping; and the
        // increment is in the word's modification order before or after
        // `begin_exclusive`'s `fetch_or`: before → that section waits for
        // us; after → we see EXCLUSIVE and back out.
        let prev = self.word.fetch_add(1, Ordering::Acquire);
        if prev & CLOSED == 0 && (prev & EXCLUSIVE == 0 || nested) {
            return Ok(());
        }
        Err(self.back_out(prev))
    }

    /// Undo a refused increment that read `prev`: why it was refused, and
    /// whether a waiter must be woken ([`Gate::leave`]).
    fn back_out(&self, prev: u64) -> (Refused, bool) {
        self.back_out_by(prev, 1)
    }

    /// [`Gate::back_out`] of an increment by `unit` (1, or [`LEASE_UNIT`]).
    fn back_out_by(&self, prev: u64, unit: u64) -> (Refused, bool) {
        let wake = self.leave_by(unit);
        let why = if prev & CLOSED != 0 {
            Refused::Closed
        } else {
            Refused::Busy
        };
        (why, wake)
    }

    /// Another guard next to a live one (the arena's `reenter`): the count
    /// is above zero, so nothing is mutating.
    #[inline]
    pub fn reenter(&self) {
        // ORDERING: Relaxed — the caller's live guard already ordered it
        // after the last mutation.
        self.word.fetch_add(1, Ordering::Relaxed);
    }

    /// Drop a guard (or the word's part of a lease); true when a waiter
    /// (an exclusive section or close) should be woken: it was the last.
    #[inline]
    pub fn leave(&self) -> bool {
        self.leave_by(1)
    }

    /// Take `unit` (1 for a guard, [`LEASE_UNIT`] for a lease) off the
    /// word; true when a waiter should be woken: it was the last guard (a
    /// drain waits for guards only), or the last of everything.
    #[inline]
    fn leave_by(&self, unit: u64) -> bool {
        // ORDERING: Release — this guard's copies happen-before the Acquire
        // load in `live` / `guards` that sees the count reach zero.
        let prev = self.word.fetch_sub(unit, Ordering::Release);
        prev & (EXCLUSIVE | CLOSED) != 0
            && (prev & COUNT_MASK == unit || (unit == 1 && prev & GUARD_MASK == 1))
    }

    /// Take a lease (module doc, "Leases"): never waits.
    pub fn try_lease(&self) -> Result<(), (Refused, bool)> {
        // ORDERING: SeqCst — the Dekker pair with `begin_exclusive` (module
        // doc): the lease count first, then the word.
        self.leases.fetch_add(1, Ordering::SeqCst);
        // ORDERING: SeqCst — as above; also Acquire, as in `enter`.
        let prev = self.word.fetch_add(LEASE_UNIT, Ordering::SeqCst);
        if prev & (CLOSED | EXCLUSIVE) == 0 {
            return Ok(());
        }
        let refused = self.back_out_by(prev, LEASE_UNIT);
        // ORDERING: Release — nothing was done under this lease; the order
        // against the exclusive section is carried by the SeqCst pair.
        self.leases.fetch_sub(1, Ordering::Release);
        Err(refused)
    }

    /// Drop a lease; true when a waiter should be woken (as [`Gate::leave`]).
    pub fn end_lease(&self) -> bool {
        // ORDERING: Release — the lease holder's copies (finished before
        // it commits or releases, the lease contract) happen-before a
        // section that later reads the count at zero (Acquire).
        self.leases.fetch_sub(1, Ordering::Release);
        self.leave_by(LEASE_UNIT)
    }

    /// Live leases now.
    pub fn leases(&self) -> u64 {
        // ORDERING: Acquire — a zero here orders the released leases'
        // accesses before the caller's next step (`close` unmapping).
        self.leases.load(Ordering::Acquire)
    }

    /// Set EXCLUSIVE (module doc). `Closed` (bit left clear) once closing;
    /// `Leased(n)` at once while `n` leases are live — checked before the
    /// bit is set, so a live lease does not even pause new guards, and
    /// after, for a lease that slipped in between.
    pub fn begin_exclusive(&self) -> Result<(), Refused> {
        // The early check: a section that will be refused anyway does not
        // hold new guards off for its duration.
        let n = self.leases();
        if n > 0 {
            return Err(Refused::Leased(n));
        }
        // ORDERING: SeqCst — the Dekker pair with `try_lease` (module doc);
        // also AcqRel: the bit is in the word's modification order before
        // the count is read, so every later `enter` sees it.
        let prev = self.word.fetch_or(EXCLUSIVE, Ordering::SeqCst);
        if prev & CLOSED != 0 {
            self.end_exclusive();
            return Err(Refused::Closed);
        }
        // ORDERING: SeqCst — the second half of the Dekker pair.
        let n = self.leases.load(Ordering::SeqCst);
        if n > 0 {
            self.end_exclusive();
            return Err(Refused::Leased(n));
        }
        Ok(())
    }

    /// Set EXCLUSIVE whatever the leases (a forced drain: module doc,
    /// "Guards and leases in one word"): new guards wait and new leases
    /// are refused until [`Gate::end_exclusive`]; the caller then waits for
    /// [`Gate::guards`] to reach zero. Live leases stay live: the mapping
    /// must not change under them. `Closed` (bit left clear) once closing.
    pub fn begin_drain(&self) -> Result<(), Refused> {
        // ORDERING: SeqCst — as in `begin_exclusive`: in the word's
        // modification order before the guard count is read, so every
        // later `enter` sees the bit.
        let prev = self.word.fetch_or(EXCLUSIVE, Ordering::SeqCst);
        if prev & CLOSED != 0 {
            self.end_exclusive();
            return Err(Refused::Closed);
        }
        Ok(())
    }

    /// Clear EXCLUSIVE.
    pub fn end_exclusive(&self) {
        // ORDERING: Release — publishes the new mapping to the Acquire
        // `fetch_add` in `enter`.
        self.word.fetch_and(!EXCLUSIVE, Ordering::Release);
    }

    /// Set CLOSED; false if it was set already.
    pub fn close(&self) -> bool {
        // ORDERING: SeqCst — as in `begin_exclusive`: in the word's order
        // before the count is read; and against `try_lease`, so a lease
        // either sees CLOSED or is counted by `leases()` after this.
        self.word.fetch_or(CLOSED, Ordering::SeqCst) & CLOSED == 0
    }

    /// Live guards and leases (Acquire: pairs with `leave`'s Release, so
    /// the departed guards' copies happen-before the caller's next step).
    pub fn live(&self) -> u64 {
        // ORDERING: Acquire — as the doc says.
        self.word.load(Ordering::Acquire) & COUNT_MASK
    }

    /// Live guards, leases left out (Acquire, as [`Gate::live`]).
    pub fn guards(&self) -> u64 {
        // ORDERING: Acquire — as in `live`.
        self.word.load(Ordering::Acquire) & GUARD_MASK
    }

    /// The word, for advisory reads (status, tests).
    pub fn peek(&self) -> u64 {
        // ORDERING: Relaxed — advisory.
        self.word.load(Ordering::Relaxed)
    }
}
