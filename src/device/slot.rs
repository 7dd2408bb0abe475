//! # Slots: the free bitmap and the per-slot state word
//!
//! Every slot has one `AtomicU64` state word; every transition is a single
//! CAS on it, so the data path takes no lock. This module doc is the one
//! place the word's layout and transitions are written down
//! (`docs/design.md` links here); the tests below assert the
//! table.
//!
//! ## Bit layout
//!
//! Ranges are half-open (`0..16` is bits 0 to 15); the constants are the
//! ones of this module.
//!
//! ```text
//! bits 0..16   lock count     lookup-and-lock count (LOCK_MASK); unlock decrements
//! bits 16..32  borrow count   reads copying out, plus pins (BORROW_MASK, BORROW_SHIFT)
//! bit  32      WRITING        a store is in flight: reserved, not readable
//! bit  33      COMMITTED      readable, unless also PENDING_FREE
//! bit  34      PENDING_FREE   detached from its key; freed once unlinked and idle
//! bit  35      REFERENCED     CLOCK bit: set by lock, borrow, commit; cleared by sweep, detach
//! bit  36      CANCELED       a forced delete hit the slot while WRITING; the writer frees it
//! bit  37      UNLINKED       its index bucket is gone
//! bits 38..40  (unused)       always 0
//! bits 40..64  generation     24-bit tag (GEN_MASK, GEN_SHIFT), bumped on every reservation
//! ```
//!
//! FREE is a word with only a generation set. Both counts stop at
//! [`COUNT_MAX`] (`0xFFFF`). The generation of a new slot is 0, its first
//! reservation makes it 1, and after `0xFF_FFFF` it goes to 1 again (0
//! only ever names a slot never reserved).
//!
//! ## Transitions
//!
//! "Readable" is COMMITTED and not PENDING_FREE.
//!
//! | op | from | to | refused with |
//! |---|---|---|---|
//! | `reserve` | FREE(g) (the caller owns its bitmap bit) | WRITING(g+1) | panics: a bookkeeping bug |
//! | `commit` | WRITING | COMMITTED + REFERENCED; if CANCELED: PENDING_FREE (CANCELED kept) | `WrongState` |
//! | `abort(unlinked)` | WRITING (the writer failed) | PENDING_FREE, + UNLINKED if `unlinked` | `WrongState` |
//! | `lock` | readable | lock + 1, REFERENCED | `WrongState`, `Saturated` |
//! | `unlock` | lock > 0 | lock − 1 | `NotHeld` |
//! | `borrow` | readable | borrow + 1, REFERENCED | `WrongState`, `Saturated` |
//! | `pin` | any but FREE | borrow + 1 (dropped by `release`) | `WrongState`, `Saturated` |
//! | `release` | borrow > 0 | borrow − 1 | `NotHeld` |
//! | `detach` | readable, lock 0 (any lock count if forced) | PENDING_FREE; COMMITTED, REFERENCED and the locks cleared | `Locked` (not forced), `WrongState` |
//! | `detach` (forced) | WRITING, not CANCELED | + CANCELED | `InFlight` (not forced), `WrongState` |
//! | `unlink` | any but FREE, not UNLINKED | + UNLINKED | `WrongState` |
//! | `lock_and_unpin`, `unlock_and_unpin`, `unlink_and_unpin` | as `lock`, `unlock`, `unlink` | the same, and borrow − 1 in the one CAS | as those, `NotHeld` |
//! | `clear_referenced` (CLOCK) | REFERENCED | REFERENCED cleared | (returns false) |
//! | free, inside any of the above | PENDING_FREE + UNLINKED, not WRITING, borrow 0 | FREE(g) | — |
//!
//! A slot goes back to FREE exactly once per generation, by whichever
//! transition completes the free condition (the last reader's `release`, the
//! deleter's `unlink`, or the writer's `commit` / `abort`); that caller then
//! clears its bitmap bit (`Transition::freed`). So a slot is reusable only
//! when it is detached (PENDING_FREE), out of the index (UNLINKED), not
//! WRITING and not borrowed; its lock count is then 0 too (`detach` clears
//! it, and a WRITING slot never had one).
//!
//! Every op names the generation it saw and fails with [`SlotError::Stale`]
//! if the slot moved on. Counts saturate with an error, never wrap. Delete
//! (`detach`) skips locked and in-flight slots unless forced; forced, a
//! locked slot drops its locks and an in-flight one is CANCELED, and the
//! writer frees it. `commit` is a Release CAS after the payload copy's
//! `sfence`; [`SlotState::load`] is Acquire.
//!
//! ## Generations, wrap-around and pins
//!
//! The generation is 24 bits and is only a fast-fail tag: lowest-first
//! allocation reuses one slot on every put / delete of one key (~190 ns a
//! round), so 2^24 reservations take about 3 s and a thread preempted
//! between loading a state word and its CAS could see the same word again
//! after a wrap. Nothing relies on the tag being unique. Instead, every
//! operation that reaches a slot through the index acts in three steps
//! (`core`, "pin, validate, act"):
//!
//! 1. **pin**: one CAS adds one to the borrow count of whatever incarnation
//!    the slot holds *now* ([`SlotState::borrow`] for a readable slot,
//!    [`SlotState::pin`] for any non-free one). A borrowed slot is never
//!    freed, so from here on its generation cannot move: every later CAS
//!    with that generation names exactly the pinned incarnation, however
//!    long the thread stalls.
//! 2. **validate**: with the pin held, re-read the slot's key (and, for
//!    delete / unlock, that the index still names this slot for the key).
//!    A stale tag that wrapped onto another key's incarnation fails here;
//!    the pin is dropped and the operation retries.
//! 3. **act** (lock, unlock, detach, copy out), then drop the pin (in the
//!    same CAS where it can: the `*_and_unpin` ops).
//!
//! So a stale generation can only ever pin the current incarnation, which
//! is then checked; it can never lock, detach or read another key's copy.
//! The writer (which owns WRITING) and a reader holding a borrow name a
//! generation that cannot move under them, so they need no validation.
//! `tests/stress_core.rs` and the loom models in `tests/loom_core.rs` hunt
//! the interleavings.
#![forbid(unsafe_code)]

use crate::sync::{fence, AtomicU64, AtomicUsize, Ordering};

/// A slot number within one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotId(pub u32);

/// A slot's generation (bumped on every reservation; the first is 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(pub u32);

/// One lookup lock (the lock count is bits 0..16).
pub const LOCK_ONE: u64 = 1;
/// The lock count's bits.
pub const LOCK_MASK: u64 = 0xFFFF;
/// First bit of the borrow count.
pub const BORROW_SHIFT: u32 = 16;
/// One borrow (a reader or a pin).
pub const BORROW_ONE: u64 = 1 << BORROW_SHIFT;
/// The borrow count's bits (16..32).
pub const BORROW_MASK: u64 = 0xFFFF << BORROW_SHIFT;
/// A store is in flight: reserved, not readable.
pub const WRITING: u64 = 1 << 32;
/// Readable (unless also PENDING_FREE).
pub const COMMITTED: u64 = 1 << 33;
/// Detached from its key; freed once unlinked and idle.
pub const PENDING_FREE: u64 = 1 << 34;
/// CLOCK bit: set on lock and load hits, cleared by the eviction sweep.
pub const REFERENCED: u64 = 1 << 35;
/// A forced delete hit the slot while WRITING; the writer frees it.
pub const CANCELED: u64 = 1 << 36;
/// The slot's index bucket is gone.
pub const UNLINKED: u64 = 1 << 37;
/// First bit of the 24-bit generation.
pub const GEN_SHIFT: u32 = 40;
/// The generation's bits (40..64).
pub const GEN_MASK: u64 = 0xFF_FFFF << GEN_SHIFT;
/// Largest lock or borrow count.
pub const COUNT_MAX: u64 = 0xFFFF;

const _: () = assert!(LOCK_MASK & BORROW_MASK == 0);
const _: () = assert!(
    (BORROW_MASK | WRITING | COMMITTED | PENDING_FREE | REFERENCED | CANCELED | UNLINKED)
        >> GEN_SHIFT
        == 0
);

/// A decoded state word.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct State(pub u64);

impl State {
    /// Lookup locks held.
    pub fn lock_count(self) -> u32 {
        (self.0 & LOCK_MASK) as u32
    }
    /// Readers and pins holding the slot.
    pub fn borrow_count(self) -> u32 {
        ((self.0 & BORROW_MASK) >> BORROW_SHIFT) as u32
    }
    /// The incarnation's generation tag.
    pub fn generation(self) -> Generation {
        Generation(((self.0 & GEN_MASK) >> GEN_SHIFT) as u32)
    }
    /// Whether `flag` (one of the flag constants: [`WRITING`], …) is set.
    pub fn has(self, flag: u64) -> bool {
        self.0 & flag != 0
    }
    /// FREE: only a generation.
    pub fn is_free(self) -> bool {
        self.0 & !GEN_MASK == 0
    }
    /// Readable: committed and not detached.
    pub fn is_readable(self) -> bool {
        self.has(COMMITTED) && !self.has(PENDING_FREE)
    }
    /// The free condition (see the module doc).
    fn can_free(self) -> bool {
        self.has(PENDING_FREE)
            && self.has(UNLINKED)
            && !self.has(WRITING)
            && self.borrow_count() == 0
    }
    fn free_of(self) -> State {
        State(self.0 & GEN_MASK)
    }
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut flags = String::new();
        for (bit, name) in [
            (WRITING, "W"),
            (COMMITTED, "C"),
            (PENDING_FREE, "P"),
            (REFERENCED, "R"),
            (CANCELED, "X"),
            (UNLINKED, "U"),
        ] {
            if self.has(bit) {
                flags.push_str(name);
            }
        }
        write!(
            f,
            "State(gen={} lock={} borrow={} {flags})",
            self.generation().0,
            self.lock_count(),
            self.borrow_count()
        )
    }
}

/// Why a state transition was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotError {
    /// The slot's generation moved on.
    Stale,
    /// Not in the state the op needs (e.g. lock on a non-committed slot).
    WrongState,
    /// Lock or borrow count at its maximum.
    Saturated,
    /// Delete refused: locked (not forced).
    Locked,
    /// Delete refused: store in flight (not forced).
    InFlight,
    /// Unlock or release of a zero count.
    NotHeld,
}

/// What a transition did; `freed` means the caller must clear the bitmap bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    /// The word the CAS replaced.
    pub prev: State,
    /// The word it wrote (already FREE when `freed`).
    pub next: State,
    /// This transition completed the free condition: the caller clears the
    /// slot's bitmap bit.
    pub freed: bool,
}

/// Outcome of `commit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Commit {
    /// The slot is COMMITTED (and REFERENCED): readable.
    Committed,
    /// A forced delete canceled the store; the slot is detached (and freed
    /// if `t.freed`).
    Canceled(Transition),
}

/// One slot's state word.
#[derive(Debug, Default)]
pub struct SlotState(AtomicU64);

impl SlotState {
    /// A FREE slot at generation 0 (its first reservation is generation 1).
    pub fn new() -> SlotState {
        SlotState(AtomicU64::new(0))
    }

    /// Current state.
    #[inline]
    pub fn load(&self) -> State {
        // ORDERING: Acquire — pairs with the Release CAS in `commit`, so a
        // reader that sees COMMITTED sees the payload bytes and the slot's
        // key, length and metadata.
        State(self.0.load(Ordering::Acquire))
    }

    /// Reset to FREE at generation 0 (close; no concurrent users).
    pub fn reset(&self) {
        // ORDERING: Relaxed — only called with the arena closed (no users).
        self.0.store(0, Ordering::Relaxed);
    }

    /// Test hook: make the next reservation of this FREE slot produce
    /// generation `next` (as if the 24-bit tag had wrapped around).
    #[cfg(test)]
    pub(crate) fn set_next_generation(&self, next: Generation) {
        let cur = self.load();
        assert!(cur.is_free(), "only a free slot: {cur:?}");
        let prev = (next.0.wrapping_sub(1)) & 0xFF_FFFF;
        // ORDERING: Relaxed — test only, with the slot free and unclaimed.
        self.0
            .store(u64::from(prev) << GEN_SHIFT, Ordering::Relaxed);
    }

    /// Apply `f` to the state in a CAS loop. `f` returns the next state or
    /// an error; the loop retries only when the word changed under it.
    #[inline]
    fn update(
        &self,
        gen: Generation,
        mut f: impl FnMut(State) -> Result<State, SlotError>,
    ) -> Result<Transition, SlotError> {
        // ORDERING: Acquire — see `load`.
        let mut cur = State(self.0.load(Ordering::Acquire));
        loop {
            if cur.generation() != gen {
                return Err(SlotError::Stale);
            }
            let mut next = f(cur)?;
            let freed = next.can_free();
            if freed {
                next = next.free_of();
            }
            // ORDERING: AcqRel — Release publishes what this thread wrote to
            // the slot before the transition (payload + fields on commit);
            // Acquire sees what the previous owner wrote before its own.
            match self
                .0
                .compare_exchange_weak(cur.0, next.0, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    return Ok(Transition {
                        prev: cur,
                        next,
                        freed,
                    })
                }
                Err(actual) => cur = State(actual),
            }
        }
    }

    /// FREE(g) → WRITING(g+1). The caller owns the slot's bitmap bit, so the
    /// slot must be FREE; anything else is a bookkeeping bug.
    pub fn reserve(&self) -> Generation {
        // ORDERING: Acquire — the bitmap claim already ordered us after the
        // previous free; this load only reads the generation.
        let cur = State(self.0.load(Ordering::Acquire));
        assert!(cur.is_free(), "reserving a slot that is not free: {cur:?}");
        let g = (cur.generation().0 + 1) & 0xFF_FFFF;
        let g = if g == 0 { 1 } else { g };
        let next = (u64::from(g) << GEN_SHIFT) | WRITING;
        // ORDERING: AcqRel — as in `update`; a CAS (not a store) so a broken
        // invariant shows up as a panic instead of a lost update.
        let r = self
            .0
            .compare_exchange(cur.0, next, Ordering::AcqRel, Ordering::Acquire);
        assert!(r.is_ok(), "slot changed while reserved by its bitmap owner");
        Generation(g)
    }

    /// WRITING → COMMITTED (with REFERENCED), after the payload copy and its
    /// `sfence`. If a forced delete canceled the store, → PENDING_FREE.
    #[inline]
    pub fn commit(&self, gen: Generation) -> Result<Commit, SlotError> {
        let mut canceled = false;
        let t = self.update(gen, |s| {
            if !s.has(WRITING) {
                return Err(SlotError::WrongState);
            }
            canceled = s.has(CANCELED);
            if canceled {
                Ok(State((s.0 & !WRITING) | PENDING_FREE))
            } else {
                Ok(State((s.0 & !WRITING) | COMMITTED | REFERENCED))
            }
        })?;
        Ok(if canceled {
            Commit::Canceled(t)
        } else {
            Commit::Committed
        })
    }

    /// WRITING → PENDING_FREE: the writer gives up (copy failed, or it lost
    /// the race to insert the key). `unlinked` says the writer's index
    /// bucket is already gone (or was never published).
    pub fn abort(&self, gen: Generation, unlinked: bool) -> Result<Transition, SlotError> {
        self.update(gen, |s| {
            if !s.has(WRITING) {
                return Err(SlotError::WrongState);
            }
            let mut n = (s.0 & !WRITING) | PENDING_FREE;
            if unlinked {
                n |= UNLINKED;
            }
            Ok(State(n))
        })
    }

    /// Lookup-and-lock: lock + 1 on a readable slot; sets REFERENCED.
    pub fn lock(&self, gen: Generation) -> Result<Transition, SlotError> {
        self.update(gen, locked)
    }

    /// [`SlotState::lock`] and drop the caller's pin in the same CAS: the
    /// last step of "pin, validate, act" for a lookup-and-lock.
    #[inline]
    pub fn lock_and_unpin(&self, gen: Generation) -> Result<Transition, SlotError> {
        self.update(gen, |s| locked(s).and_then(unpinned))
    }

    /// [`SlotState::unlock`] and drop the caller's pin in the same CAS.
    #[inline]
    pub fn unlock_and_unpin(&self, gen: Generation) -> Result<Transition, SlotError> {
        self.update(gen, |s| unlocked(s).and_then(unpinned))
    }

    /// lock − 1. Works in any state that still carries the count.
    pub fn unlock(&self, gen: Generation) -> Result<Transition, SlotError> {
        self.update(gen, unlocked)
    }

    /// A read starts: borrow + 1 on a readable slot; sets REFERENCED.
    pub fn borrow(&self, gen: Generation) -> Result<Transition, SlotError> {
        self.update(gen, |s| {
            if !s.is_readable() {
                return Err(SlotError::WrongState);
            }
            if u64::from(s.borrow_count()) == COUNT_MAX {
                return Err(SlotError::Saturated);
            }
            Ok(State((s.0 + BORROW_ONE) | REFERENCED))
        })
    }

    /// Pin the current incarnation, whatever its state (not FREE): one more
    /// borrow, so it cannot be freed (and its generation cannot move) until
    /// [`SlotState::release`]. Delete and unlock pin before they validate
    /// (module doc, "pins").
    pub fn pin(&self, gen: Generation) -> Result<Transition, SlotError> {
        self.update(gen, |s| {
            if s.is_free() {
                return Err(SlotError::WrongState);
            }
            if u64::from(s.borrow_count()) == COUNT_MAX {
                return Err(SlotError::Saturated);
            }
            Ok(State(s.0 + BORROW_ONE))
        })
    }

    /// A read ends: borrow − 1; frees a detached, unlinked slot at zero.
    pub fn release(&self, gen: Generation) -> Result<Transition, SlotError> {
        self.update(gen, |s| {
            if s.borrow_count() == 0 {
                return Err(SlotError::NotHeld);
            }
            Ok(State(s.0 - BORROW_ONE))
        })
    }

    /// Delete: detach the slot from its key. A committed slot becomes
    /// PENDING_FREE (locks dropped when forced); an in-flight one becomes
    /// CANCELED when forced. The caller then removes the index bucket and
    /// calls [`SlotState::unlink`].
    #[inline]
    pub fn detach(&self, gen: Generation, force: bool) -> Result<Transition, SlotError> {
        self.update(gen, |s| {
            if s.has(WRITING) {
                if !force {
                    return Err(SlotError::InFlight);
                }
                if s.has(CANCELED) {
                    return Err(SlotError::WrongState);
                }
                return Ok(State(s.0 | CANCELED));
            }
            if !s.is_readable() {
                return Err(SlotError::WrongState);
            }
            if s.lock_count() > 0 && !force {
                return Err(SlotError::Locked);
            }
            Ok(State(
                (s.0 & !(COMMITTED | LOCK_MASK | REFERENCED)) | PENDING_FREE,
            ))
        })
    }

    /// Cancel the store in flight in incarnation `gen` (a forced remove's
    /// walk over its device's store leases): set CANCELED on a WRITING
    /// slot, so its writer's commit answers canceled and frees it. Unlike
    /// a forced [`SlotState::detach`], never touches a committed copy: a
    /// lease that committed first keeps its key (`WrongState`).
    pub fn cancel(&self, gen: Generation) -> Result<Transition, SlotError> {
        self.update(gen, |s| {
            if !s.has(WRITING) || s.has(CANCELED) {
                return Err(SlotError::WrongState);
            }
            Ok(State(s.0 | CANCELED))
        })
    }

    /// The slot's index bucket is gone: set UNLINKED, freeing it if idle.
    pub fn unlink(&self, gen: Generation) -> Result<Transition, SlotError> {
        self.update(gen, unlinked)
    }

    /// [`SlotState::unlink`] and drop the caller's pin in the same CAS
    /// (frees the slot if nothing else holds it).
    #[inline]
    pub fn unlink_and_unpin(&self, gen: Generation) -> Result<Transition, SlotError> {
        self.update(gen, |s| unlinked(s).and_then(unpinned))
    }

    /// CLOCK: clear REFERENCED; true if it was set.
    pub fn clear_referenced(&self, gen: Generation) -> bool {
        self.update(gen, |s| {
            if s.has(REFERENCED) {
                Ok(State(s.0 & !REFERENCED))
            } else {
                Err(SlotError::WrongState)
            }
        })
        .is_ok()
    }
}

/// `s` with one more lookup lock (readable slots only; sets REFERENCED).
fn locked(s: State) -> Result<State, SlotError> {
    if !s.is_readable() {
        return Err(SlotError::WrongState);
    }
    if u64::from(s.lock_count()) == COUNT_MAX {
        return Err(SlotError::Saturated);
    }
    Ok(State((s.0 + LOCK_ONE) | REFERENCED))
}

/// `s` with one lookup lock fewer.
fn unlocked(s: State) -> Result<State, SlotError> {
    if s.lock_count() == 0 {
        return Err(SlotError::NotHeld);
    }
    Ok(State(s.0 - LOCK_ONE))
}

/// `s` marked UNLINKED (its bucket is gone).
fn unlinked(s: State) -> Result<State, SlotError> {
    if s.is_free() || s.has(UNLINKED) {
        return Err(SlotError::WrongState);
    }
    Ok(State(s.0 | UNLINKED))
}

/// `s` with the caller's pin (one borrow) dropped.
fn unpinned(s: State) -> Result<State, SlotError> {
    if s.borrow_count() == 0 {
        return Err(SlotError::NotHeld);
    }
    Ok(State(s.0 - BORROW_ONE))
}

/// An atomic free bitmap: bit set = slot taken (or beyond the current slot
/// count). Allocation prefers the lowest free slot, which keeps live slots
/// packed low and makes shrink cheap (docs/lmcache-dax-behavior.md
/// §9.4 item 11).
#[derive(Debug)]
pub struct Bitmap {
    words: Box<[AtomicU64]>,
    /// No free bit below word `hint` (a lower bound, kept with `fetch_min`).
    hint: AtomicUsize,
    bits: usize,
}

impl Bitmap {
    /// `bits` slots, of which the first `available` are free.
    pub fn new(bits: usize, available: usize) -> Bitmap {
        Bitmap::try_new(bits, available).expect("bitmap allocation failed")
    }

    /// [`Bitmap::new`], or `None` if it cannot be allocated.
    pub fn try_new(bits: usize, available: usize) -> Option<Bitmap> {
        let n = bits.div_ceil(64).max(1);
        let words = crate::host::memlimit::try_boxed(n, || AtomicU64::new(0))?;
        let b = Bitmap {
            words,
            hint: AtomicUsize::new(0),
            bits,
        };
        b.set_available(0, available.min(bits));
        Some(b)
    }

    /// Slots the bitmap covers (the largest slot count the arena can grow
    /// to).
    pub fn capacity(&self) -> usize {
        self.bits
    }

    /// Mark slots `[avail, bits)` taken and `[from, avail)` free. Only with
    /// no concurrent users (construction, or inside `Arena::exclusive`),
    /// and only over slots that are free.
    pub fn set_available(&self, from: usize, avail: usize) {
        for (w, word) in self.words.iter().enumerate() {
            let lo = w * 64;
            let mut v = 0u64;
            for b in 0..64 {
                let i = lo + b;
                if i >= avail || i >= self.bits {
                    v |= 1 << b;
                }
            }
            if lo + 64 <= from {
                continue;
            }
            // ORDERING: Relaxed — exclusive section; the arena gate's
            // Release/Acquire publishes it.
            let cur = word.load(Ordering::Relaxed);
            let keep_mask = if lo >= from {
                0
            } else {
                (1u64 << (from - lo)) - 1
            };
            word.store((cur & keep_mask) | (v & !keep_mask), Ordering::Relaxed);
        }
        // ORDERING: Relaxed — as above.
        self.hint.store(0, Ordering::Relaxed);
    }

    /// Claim the lowest free slot.
    ///
    /// ## The hint handshake
    ///
    /// `hint` promises "no free bit below word `hint`". A claimer that found
    /// words `start..w` full raises it to `w`; a release in word `r` lowers
    /// it to `r` when `r < hint`. The two race: the claimer may read word `r`
    /// full, the releaser then frees a bit in it and reads the *old* hint
    /// (no store needed), and only then does the claimer raise the hint past
    /// `r`: the freed bit would hide until some release lowered the hint
    /// again, and `put` would report `Full` with free slots. So each side
    /// writes its own word, then reads the other's,
    /// in one total order (Dekker): the claimer, after raising the hint,
    /// re-reads the words it skipped and lowers the hint back if one has a
    /// free bit; the releaser, after clearing its bit, reads the hint. A
    /// `fence(SeqCst)` sits between each side's write and read, so the two
    /// fences are ordered and the later side's read sees the earlier side's
    /// write: at least one of them sees the other, and the hint is lowered.
    /// (Fences rather than `SeqCst` accesses because loom models the fence
    /// rule; the cost is one `mfence` per freed slot.)
    /// `tests/loom_slot.rs::bitmap_hint_does_not_hide_a_release` fails
    /// without the claimer's re-read.
    pub fn claim(&self) -> Option<SlotId> {
        // ORDERING: Relaxed — a lower bound to start from; the handshake
        // (doc above) keeps it honest.
        let start = self.hint.load(Ordering::Relaxed);
        let n = self.words.len();
        for w in start..n {
            // ORDERING: Relaxed — re-validated by the CAS.
            let mut cur = self.words[w].load(Ordering::Relaxed);
            while cur != u64::MAX {
                let bit = (!cur).trailing_zeros();
                // ORDERING: Acquire — pairs with the Release in `release`,
                // so the slot's last free (state word) happens-before our
                // reservation.
                match self.words[w].compare_exchange_weak(
                    cur,
                    cur | (1 << bit),
                    Ordering::Acquire,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        if w > start {
                            self.raise_hint(start, w);
                        }
                        return Some(SlotId((w * 64) as u32 + bit));
                    }
                    Err(actual) => cur = actual,
                }
            }
        }
        None
    }

    /// Raise the hint from `start` to `w` (words `start..w` were seen full),
    /// then re-check them: the claimer's half of the hint handshake.
    fn raise_hint(&self, start: usize, w: usize) {
        // ORDERING: Relaxed — ordered before the re-reads by the fence.
        if self
            .hint
            .compare_exchange(start, w, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return; // someone else moved it; they re-check their own range
        }
        // ORDERING: SeqCst fence — the claimer's half of the hint handshake;
        // pairs with the fence in `release`.
        fence(Ordering::SeqCst);
        for r in start..w {
            // ORDERING: Relaxed — ordered after the hint store by the fence.
            if self.words[r].load(Ordering::Relaxed) != u64::MAX {
                // ORDERING: Relaxed — hint only.
                self.hint.fetch_min(r, Ordering::Relaxed);
                return;
            }
        }
    }

    /// Free a slot the caller owns.
    pub fn release(&self, slot: SlotId) {
        let i = slot.0 as usize;
        let (w, b) = (i / 64, i % 64);
        // ORDERING: Release — everything the freeing thread did to the slot
        // happens-before the next `claim` of it (its Acquire CAS).
        let prev = self.words[w].fetch_and(!(1 << b), Ordering::Release);
        assert!(prev & (1 << b) != 0, "double free of slot {i}");
        // ORDERING: SeqCst fence — the releaser's half of the hint
        // handshake (`claim` doc); pairs with the fence in `raise_hint`.
        fence(Ordering::SeqCst);
        // ORDERING: Relaxed — ordered after the bit clear by the fence.
        // A load first: usually no store.
        if w < self.hint.load(Ordering::Relaxed) {
            // ORDERING: Relaxed — hint only.
            self.hint.fetch_min(w, Ordering::Relaxed);
        }
    }

    /// Whether a slot is taken.
    pub fn is_taken(&self, slot: usize) -> bool {
        // ORDERING: Acquire — status / shrink checks read it under the gate.
        self.words[slot / 64].load(Ordering::Acquire) & (1 << (slot % 64)) != 0
    }

    /// Whether any slot in `[from, to)` is taken.
    pub fn any_taken(&self, from: usize, to: usize) -> bool {
        (from..to.min(self.bits)).any(|i| self.is_taken(i))
    }
}

#[cfg(all(test, not(daxkv_loom)))]
mod tests {
    use super::*;

    fn committed(s: &SlotState) -> Generation {
        let g = s.reserve();
        assert_eq!(s.commit(g), Ok(Commit::Committed));
        g
    }

    #[test]
    fn transition_table() {
        let s = SlotState::new();
        let g = s.reserve();
        assert_eq!(g, Generation(1));
        assert!(s.load().has(WRITING));
        assert_eq!(
            s.lock(g).unwrap_err(),
            SlotError::WrongState,
            "in-flight is not readable"
        );
        assert_eq!(s.detach(g, false).unwrap_err(), SlotError::InFlight);
        assert_eq!(s.commit(g), Ok(Commit::Committed));
        assert!(s.load().is_readable() && s.load().has(REFERENCED));
        s.lock(g).unwrap();
        s.lock(g).unwrap();
        assert_eq!(s.load().lock_count(), 2);
        assert_eq!(s.detach(g, false).unwrap_err(), SlotError::Locked);
        s.unlock(g).unwrap();
        s.unlock(g).unwrap();
        assert_eq!(s.unlock(g).unwrap_err(), SlotError::NotHeld);
        s.borrow(g).unwrap();
        let t = s.detach(g, false).unwrap();
        assert!(!t.freed && t.next.has(PENDING_FREE));
        assert_eq!(
            s.borrow(g).unwrap_err(),
            SlotError::WrongState,
            "detached is not readable"
        );
        assert!(!s.unlink(g).unwrap().freed, "still borrowed");
        let t = s.release(g).unwrap();
        assert!(t.freed, "last reader frees");
        assert!(s.load().is_free());
        assert_eq!(s.lock(Generation(7)).unwrap_err(), SlotError::Stale);
        assert_eq!(s.reserve(), Generation(2));
    }

    #[test]
    fn forced_delete_of_in_flight_store() {
        let s = SlotState::new();
        let g = s.reserve();
        s.detach(g, true).unwrap();
        assert!(!s.unlink(g).unwrap().freed, "writer still copying");
        match s.commit(g).unwrap() {
            Commit::Canceled(t) => assert!(t.freed, "writer frees after unlink"),
            Commit::Committed => panic!("canceled store committed"),
        }
        // Commit first, then unlink: the unlink frees.
        let g = s.reserve();
        s.detach(g, true).unwrap();
        match s.commit(g).unwrap() {
            Commit::Canceled(t) => assert!(!t.freed),
            Commit::Committed => panic!("canceled store committed"),
        }
        assert!(s.unlink(g).unwrap().freed);
    }

    #[test]
    fn counts_saturate_instead_of_wrapping() {
        let s = SlotState::new();
        let g = committed(&s);
        for _ in 0..COUNT_MAX {
            s.lock(g).unwrap();
            s.borrow(g).unwrap();
        }
        assert_eq!(s.lock(g).unwrap_err(), SlotError::Saturated);
        assert_eq!(s.borrow(g).unwrap_err(), SlotError::Saturated);
        assert_eq!(s.load().lock_count(), 0xFFFF);
        assert!(s.load().has(COMMITTED), "saturation left the flags alone");
        let t = s.detach(g, true).unwrap();
        assert_eq!(t.next.lock_count(), 0, "forced delete drops the locks");
        assert_eq!(t.next.borrow_count(), 0xFFFF);
    }

    #[test]
    fn abort_frees_when_unlinked() {
        let s = SlotState::new();
        let g = s.reserve();
        assert!(s.abort(g, true).unwrap().freed);
        let g = s.reserve();
        assert!(!s.abort(g, false).unwrap().freed);
        assert!(s.unlink(g).unwrap().freed);
    }

    #[test]
    fn bitmap_prefers_lowest_and_respects_availability() {
        let b = Bitmap::new(130, 100);
        let got: Vec<u32> = (0..100).map(|_| b.claim().unwrap().0).collect();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
        assert_eq!(b.claim(), None, "slots >= available stay taken");
        b.release(SlotId(70));
        b.release(SlotId(3));
        assert_eq!(b.claim(), Some(SlotId(3)));
        assert_eq!(b.claim(), Some(SlotId(70)));
        // Grow to 130, then shrink back to 100 (no live slot above).
        b.set_available(100, 130);
        assert!(!b.any_taken(100, 130));
        assert_eq!(b.claim(), Some(SlotId(100)));
        b.release(SlotId(100));
        b.set_available(100, 100);
        assert!(b.any_taken(100, 130));
        assert_eq!(b.claim(), None);
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn bitmap_double_free_panics() {
        let b = Bitmap::new(64, 64);
        let s = b.claim().unwrap();
        b.release(s);
        b.release(s);
    }
}
