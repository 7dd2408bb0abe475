//! # Key claims: the pool-wide table behind "one copy of a key"
//!
//! A fixed table of [`STRIPES`] cache-padded words, indexed by key bits.
//! A store holds its key's stripe from before it looks for the key on any
//! device until its put on the chosen device has inserted the key (the
//! whole put, in practice): two stores of one key (or of two keys sharing a
//! stripe) never decide at the same time. The full protocol, and how
//! lookup / unlock / delete / migration use it, is in the parent module's
//! doc and in `docs/key-ownership.md`.
//!
//! ## Protocol
//!
//! ```text
//! stripe word: 0 (free) ──claim: CAS 0 → tag, Acquire──► tag (held)
//!              tag      ──drop of the Claim: store 0, Release──► 0
//! ```
//!
//! `tag` is a nonzero 64-bit digest of the key (for debugging and status;
//! the protocol never trusts it: a store that finds the stripe held, by any
//! tag, waits, so two distinct keys with equal tags cannot be mistaken for
//! one). The Release store of a holder and the Acquire CAS of the next one
//! order the first's index insert before the second's "is it anywhere?"
//! check. `tests/loom_claims.rs` checks it with two store workers and two
//! devices.
//!
//! ## Storing mark (what a delete skips)
//!
//! ```text
//! tag (held) ──mark_storing: store tag|1 (Relaxed)──► tag|1 (held, placing a new copy)
//! ```
//!
//! The holder's own tag has its low bit clear. A store that found the key
//! on no device and is about to place it sets the low bit
//! ([`Claim::mark_storing`]) for the rest of its hold: the key's store is
//! in flight. [`ClaimTable::claim_unless_storing`] (used by
//! `Engine::delete`) gives up on a stripe that shows this key's storing tag
//! and waits for any other holder (a move, an unlock, a delete of the key,
//! or a stripe mate), so a delete skips a key whose store is in flight,
//! like a locked key, and never misses a committed key that is being moved
//! (`docs/key-ownership.md`, "Delete"). The mark is only a hint for that
//! choice: a stripe mate with an equal tag (2^-63) can only make a delete
//! skip, never make two holders. Without the mark a delete waits for the
//! store and removes the key the moment it commits, before its store task
//! reports it (`engine::hotplug_interleavings::
//! delete_skips_a_key_being_stored_and_waits_for_a_move` fails so).
//!
//! ## Waiting
//!
//! A held stripe is waited for: [`SPIN_MAX`] spins with a CPU hint, then a
//! yield per retry. The wait is bounded by the holder's put (index insert
//! and one slot copy); a holder holds one claim at a time and takes nothing
//! else that waits while holding it (not even an arena guard: it enters
//! devices with `try_session`, see `docs/key-ownership.md`), so there is
//! no cycle. A holder that
//! panics releases on unwind ([`Claim`]'s drop).
//!
//! Built on [`crate::sync`] atomics so the loom models run the real code.

#![forbid(unsafe_code)]

use crossbeam_utils::CachePadded;

use crate::key::Key;
use crate::sync::{AtomicU64, Ordering};

/// Stripes of the pool's table: 4096 × 128 B = 512 KiB of DRAM, once per
/// engine. Two stores collide on a stripe (and serialize) with probability
/// about `stores in flight / 4096`.
pub const STRIPES: usize = 4096;
const _: () = assert!(STRIPES.is_power_of_two());

/// Spins before a waiting claimer starts yielding.
pub const SPIN_MAX: u32 = 128;

/// The claim table. See the module documentation.
pub struct ClaimTable {
    stripes: Box<[CachePadded<AtomicU64>]>,
}

impl std::fmt::Debug for ClaimTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimTable")
            .field("stripes", &self.stripes.len())
            .field("held", &self.held())
            .finish()
    }
}

impl Default for ClaimTable {
    fn default() -> ClaimTable {
        ClaimTable::new(STRIPES)
    }
}

/// The storing mark: the low bit of a held stripe's word (module doc).
const STORING: u64 = 1;

/// A held stripe; released (Release store of 0) when dropped.
#[must_use = "the claim is released when dropped"]
#[derive(Debug)]
pub struct Claim<'a> {
    word: &'a AtomicU64,
}

impl Claim<'_> {
    /// Mark the claim as placing a new copy of its key (module doc,
    /// "Storing mark"), until it is dropped.
    pub fn mark_storing(&self) {
        // ORDERING: Relaxed — only the holder writes a held word, and the
        // mark publishes nothing: a deleter reads it as a hint to skip
        // (`claim_unless_storing`); the claim's own ordering stays the
        // Release in `drop` / Acquire CAS in `try_claim`.
        let t = self.word.load(Ordering::Relaxed);
        // ORDERING: Relaxed — as above.
        self.word.store(t | STORING, Ordering::Relaxed);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        // ORDERING: Release — publishes everything the holder did (its
        // index insert on the chosen device) to the next claimer's Acquire
        // CAS in `ClaimTable::try_claim`.
        self.word.store(0, Ordering::Release);
    }
}

impl ClaimTable {
    /// A table of `stripes` words (a power of two; [`STRIPES`] in the
    /// engine, fewer in models).
    pub fn new(stripes: usize) -> ClaimTable {
        assert!(stripes.is_power_of_two(), "stripes {stripes}");
        ClaimTable {
            stripes: (0..stripes)
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
        }
    }

    fn stripe(&self, key: Key) -> &AtomicU64 {
        // The digest's low bits are uniform; the tag uses the high half.
        &self.stripes[(key.lo() as usize) & (self.stripes.len() - 1)]
    }

    /// The holder's tag: nonzero, low bit clear (the storing mark's bit).
    fn tag(key: Key) -> u64 {
        match (key.hi() ^ key.lo().rotate_left(32)) & !STORING {
            0 => 2,
            t => t,
        }
    }

    /// Claim `key`'s stripe if it is free now.
    pub fn try_claim(&self, key: Key) -> Option<Claim<'_>> {
        let word = self.stripe(key);
        // ORDERING: Acquire on success — observes the previous holder's
        // Release in `Claim::drop`, so its insert is visible to our checks;
        // Relaxed on failure: nothing is read from a held stripe.
        word.compare_exchange(0, Self::tag(key), Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Claim { word })
    }

    /// Claim `key`'s stripe, waiting while another store holds it (see the
    /// module doc for the bound).
    pub fn claim(&self, key: Key) -> Claim<'_> {
        let mut spins = 0u32;
        loop {
            if let Some(c) = self.try_claim(key) {
                return c;
            }
            spins = spins.saturating_add(1);
            if cfg!(daxkv_loom) || spins > SPIN_MAX {
                crate::sync::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Claim `key`'s stripe as [`ClaimTable::claim`] does, except that
    /// while the stripe shows a store of `key` placing a new copy (the
    /// storing mark) it gives up: `None`, the key's store is in flight.
    /// Any other holder is waited for.
    pub fn claim_unless_storing(&self, key: Key) -> Option<Claim<'_>> {
        let storing = Self::tag(key) | STORING;
        let word = self.stripe(key);
        let mut spins = 0u32;
        loop {
            if let Some(c) = self.try_claim(key) {
                return Some(c);
            }
            // ORDERING: Relaxed — a hint (module doc, "Storing mark"); the
            // claim itself is taken by `try_claim`'s Acquire CAS.
            if word.load(Ordering::Relaxed) == storing {
                return None;
            }
            spins = spins.saturating_add(1);
            if cfg!(daxkv_loom) || spins > SPIN_MAX {
                crate::sync::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Stripes held now (a racy snapshot, for status and tests).
    pub fn held(&self) -> usize {
        self.stripes
            .iter()
            // ORDERING: Relaxed — a statistic.
            .filter(|w| w.load(Ordering::Relaxed) != 0)
            .count()
    }
}

#[cfg(all(test, not(daxkv_loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_held_stripe_refuses_until_released() {
        let t = ClaimTable::new(4);
        let a = Key::from_u128(1);
        let same_stripe = Key::from_u128(5);
        let other = Key::from_u128(2);
        let c = t.try_claim(a).unwrap();
        assert!(t.try_claim(a).is_none(), "the same key waits");
        assert!(t.try_claim(same_stripe).is_none(), "a stripe mate waits");
        let o = t.try_claim(other).unwrap();
        assert_eq!(t.held(), 2);
        drop(c);
        drop(o);
        assert_eq!(t.held(), 0);
        drop(t.claim(same_stripe));
    }

    #[test]
    fn a_storing_mark_makes_only_its_key_skip() {
        let t = ClaimTable::new(4);
        let k = Key::from_u128(1);
        let mate = Key::from_u128(5);
        let c = t.try_claim(k).unwrap();
        // Held, not storing: a deleter of k would wait (checked with a
        // thread below); mark it storing: k's deleter skips.
        c.mark_storing();
        assert!(t.claim_unless_storing(k).is_none(), "k's store in flight");
        std::thread::scope(|s| {
            let h = s.spawn(|| t.claim_unless_storing(mate).is_some());
            std::thread::yield_now();
            drop(c);
            assert!(h.join().unwrap(), "a stripe mate waits, then claims");
        });
        let plain = t.try_claim(k).unwrap();
        std::thread::scope(|s| {
            let h = s.spawn(|| t.claim_unless_storing(k).is_some());
            std::thread::yield_now();
            drop(plain);
            assert!(
                h.join().unwrap(),
                "a holder that is not storing is waited for"
            );
        });
        assert_eq!(t.held(), 0);
    }

    #[test]
    fn a_waiter_gets_the_stripe_when_the_holder_lets_go() {
        let t = ClaimTable::new(1);
        let c = t.try_claim(Key::from_u128(1)).unwrap();
        std::thread::scope(|s| {
            let h = s.spawn(|| drop(t.claim(Key::from_u128(2))));
            std::thread::yield_now();
            drop(c);
            h.join().unwrap();
        });
        assert_eq!(t.held(), 0);
    }
}
