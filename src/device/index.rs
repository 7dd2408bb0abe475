//! # Index: lock-free key → slot map
//!
//! Open addressing with linear probing over a fixed table of `AtomicU64`
//! buckets, sized once for the largest slot count the device can reach
//! (2 buckets per slot, so the live load factor stays at or below 1/2).
//!
//! ## Bucket layout
//!
//! ```text
//! bits 0..30   slot id
//! bits 30..32  state: 0 EMPTY (whole word 0), 1 TOMB, 2 PROVISIONAL, 3 OWNED
//! bits 32..64  fingerprint: 32 bits of the key digest
//! ```
//!
//! The full 128-bit key lives with the slot (`core`), so a bucket is 8 bytes
//! and the index costs 18 bytes per slot (two buckets and their two hint
//! bytes; [`Index::bytes`]). A fingerprint match is confirmed
//! by the caller's `is_key(slot)` check. Buckets never return to EMPTY, so a
//! probe may stop at the first EMPTY bucket; each home bucket also keeps the
//! largest displacement of any key inserted for it (`hints`, monotonic), so
//! in an old table full of tombstones a miss still scans only a short run.
//!
//! ## Insert (put-if-absent), lock-free
//!
//! Two puts of the same key may race, and tombstones are reused, so the two
//! can land in different buckets. They agree through a claim-then-verify
//! protocol on the buckets themselves:
//!
//! 1. scan the key's run; a live (PROVISIONAL or OWNED) entry for the key
//!    means "present". Otherwise CAS the first TOMB / EMPTY bucket to
//!    PROVISIONAL.
//! 2. verify: rescan the run. Another entry for the key that is OWNED, or
//!    PROVISIONAL at a *lower* position, wins: retract ours (→ TOMB) and
//!    report present. A PROVISIONAL one at a higher position is killed
//!    (CAS → TOMB); if that CAS finds it OWNED, we lose.
//! 3. confirm: CAS ours PROVISIONAL → OWNED. If it fails, a lower racer
//!    killed us: report present.
//!
//! Every conflict between two entries is settled by a CAS on the higher
//! one's bucket (its owner's confirm against the lower one's kill), so at
//! most one entry per key is ever OWNED, and the lowest racer always wins
//! unless an OWNED entry exists. Step 1 and step 2 are the two halves of a
//! Dekker handshake (each writes its bucket, then reads the other's), so
//! the insert path uses `SeqCst`; lookups and removals do not need it.
#![forbid(unsafe_code)]

use crate::sync::{fence, AtomicU64, AtomicU8, Ordering};

use crate::device::slot::SlotId;
use crate::key::Key;

/// The longest probe run an insert may use from a key's home bucket. With a
/// live load factor of 1/2 a run this long and full of live keys has
/// probability well below 2^-64; reaching it reports `IndexFull`.
pub const PROBE_MAX: usize = 128;
/// Largest slot id a bucket can hold.
pub const SLOT_MAX: usize = (1 << 30) - 1;

const SLOT_MASK: u64 = (1 << 30) - 1;
const STATE_SHIFT: u32 = 30;
const TOMB: u64 = 1;
const PROVISIONAL: u64 = 2;
const OWNED: u64 = 3;

#[inline]
fn enc(fp: u32, state: u64, slot: SlotId) -> u64 {
    (u64::from(fp) << 32) | (state << STATE_SHIFT) | u64::from(slot.0)
}
#[inline]
fn state_of(b: u64) -> u64 {
    (b >> STATE_SHIFT) & 3
}
#[inline]
fn slot_of(b: u64) -> SlotId {
    SlotId((b & SLOT_MASK) as u32)
}
#[inline]
fn tomb_of(b: u64) -> u64 {
    (b & !(3 << STATE_SHIFT)) | (TOMB << STATE_SHIFT)
}
/// The fingerprint and the high state bit: a word `w` is a live entry
/// (PROVISIONAL or OWNED) with fingerprint `fp` iff
/// `w & LIVE_FP_MASK == live_fp(fp)`.
const LIVE_FP_MASK: u64 = !((1 << (STATE_SHIFT + 1)) - 1);
/// The fingerprint and both state bits (an OWNED entry with the fingerprint).
const FP_STATE_MASK: u64 = !((1 << STATE_SHIFT) - 1);
const _: () = assert!(PROVISIONAL == 0b10 && OWNED == 0b11 && TOMB == 0b01);
#[inline]
fn live_fp(fp: u32) -> u64 {
    (u64::from(fp) << 32) | (PROVISIONAL << STATE_SHIFT)
}

/// Where a key's entry sits (handed back to [`Index::remove`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Bucket position in the table.
    pub pos: usize,
    /// The slot the bucket names.
    pub slot: SlotId,
    word: u64,
}

/// Outcome of an insert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Insert {
    /// The key now has this entry (OWNED).
    Inserted(Entry),
    /// The key is present (or being inserted by a racer that will win).
    Present,
    /// No free bucket within [`PROBE_MAX`] of the key's home.
    Full,
}

/// The index table.
#[derive(Debug)]
pub struct Index {
    buckets: Box<[AtomicU64]>,
    hints: Box<[AtomicU8]>,
}

impl Index {
    /// A table for up to `slots` live keys.
    pub fn with_slots(slots: usize) -> Index {
        Index::try_with_slots(slots).expect("index allocation failed")
    }

    /// Buckets an index for `slots` slots has (two per slot, at least 64).
    pub fn buckets_for(slots: usize) -> usize {
        slots.saturating_mul(2).max(64).next_multiple_of(64)
    }

    /// [`Index::with_slots`], or `None` if the tables cannot be allocated.
    pub fn try_with_slots(slots: usize) -> Option<Index> {
        let n = Index::buckets_for(slots);
        Some(Index {
            buckets: crate::host::memlimit::try_boxed(n, || AtomicU64::new(0))?,
            hints: crate::host::memlimit::try_boxed(n, || AtomicU8::new(0))?,
        })
    }

    /// Buckets in the table (two per slot, at least 64).
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// DRAM bytes this table uses.
    pub fn bytes(&self) -> usize {
        self.buckets.len() * (std::mem::size_of::<AtomicU64>() + std::mem::size_of::<AtomicU8>())
    }

    #[inline]
    fn home(&self, key: Key) -> usize {
        // Lemire's multiply-shift range reduction: no power-of-two size needed.
        ((u128::from(key.lo()) * self.buckets.len() as u128) >> 64) as usize
    }

    #[inline]
    fn fp(key: Key) -> u32 {
        (key.hi() >> 32) as u32
    }

    #[inline]
    fn at(&self, home: usize, d: usize) -> usize {
        let p = home + d;
        if p >= self.buckets.len() {
            p - self.buckets.len()
        } else {
            p
        }
    }

    /// Is bucket `pos` (read as `b`) a live entry for the key? Reads the
    /// slot's key through `is_key`, then re-reads the bucket, seqlock style,
    /// so the answer held at one instant: a slot is freed only after its
    /// bucket became a tombstone, so if the bucket still reads `b` after the
    /// key was read, the key read belongs to the incarnation `b` names
    /// (or to a later incarnation of the same slot whose bucket has the same
    /// word, which names the same key: the fingerprint and `is_key` agree).
    ///
    /// The core does not rely on this answer alone: it pins the slot and
    /// re-validates under the pin (`core`, "pin, validate, act").
    #[inline]
    fn is_entry(
        &self,
        pos: usize,
        b: u64,
        fp: u32,
        is_key: &impl Fn(SlotId) -> bool,
        order: Ordering,
    ) -> bool {
        b & LIVE_FP_MASK == live_fp(fp) && Self::holds_key(&self.buckets[pos], b, is_key, order)
    }

    /// [`Index::is_entry`] for a word `b` read from `bucket` and already
    /// known to be live with the key's fingerprint: the key check and the
    /// seqlock re-read of the same bucket (no second index into the table).
    #[inline]
    fn holds_key(
        bucket: &AtomicU64,
        b: u64,
        is_key: &impl Fn(SlotId) -> bool,
        order: Ordering,
    ) -> bool {
        if !is_key(slot_of(b)) {
            return false;
        }
        // ORDERING: Acquire fence — the key loads inside `is_key` are
        // Relaxed; this fence pairs with the Release fence the core's writer
        // issues after reserving a slot and before storing its key
        // (`DaxCore::put_with`): reading a later incarnation's key then
        // makes the tombstoning of this bucket (which happened before that
        // slot was freed) visible to the re-read below.
        fence(Ordering::Acquire);
        // ORDERING: `order` (Acquire, or SeqCst in the insert handshake) —
        // the re-read half of the seqlock above.
        bucket.load(order) == b
    }

    /// The OWNED entry of `key`, if any. Inlined into its few callers (the
    /// lookup, unlock and delete paths): as a call it spent about a third
    /// of its instructions saving and restoring registers.
    #[allow(clippy::inline_always)] // measured: perf/README.md
    #[inline(always)]
    pub fn find(&self, key: Key, is_key: impl Fn(SlotId) -> bool) -> Option<Entry> {
        self.scan::<true>(key, &is_key)
    }

    /// The key's live entry (OWNED, or PROVISIONAL: an insert still
    /// settling), if any: where [`Index::contains_live`] found it.
    #[inline]
    pub fn find_live(&self, key: Key, is_key: impl Fn(SlotId) -> bool) -> Option<Entry> {
        self.scan::<false>(key, &is_key)
    }

    /// The key's entry in its run: OWNED only, or any live one.
    ///
    /// One masked compare per bucket (state and fingerprint at once), the
    /// position advanced and wrapped by hand (no `home + d` reduction per
    /// step), and the seqlock re-read through the bucket already in hand.
    #[allow(clippy::inline_always)] // as `find`
    #[inline(always)]
    fn scan<const OWNED_ONLY: bool>(
        &self,
        key: Key,
        is_key: &impl Fn(SlotId) -> bool,
    ) -> Option<Entry> {
        let buckets = &*self.buckets;
        let home = self.home(key);
        let fp = Self::fp(key);
        // OWNED: both state bits; live (OWNED or PROVISIONAL): the high one.
        let (mask, want) = if OWNED_ONLY {
            (
                FP_STATE_MASK,
                (u64::from(fp) << 32) | (OWNED << STATE_SHIFT),
            )
        } else {
            (LIVE_FP_MASK, live_fp(fp))
        };
        // ORDERING: Acquire — pairs with the SeqCst `fetch_max` in `insert`;
        // an insert that completed before this lookup is within the hint.
        let h = usize::from(self.hints[home].load(Ordering::Acquire));
        let mut pos = home;
        let mut left = h + 1;
        loop {
            let bucket = &buckets[pos];
            // ORDERING: Acquire — pairs with the confirm CAS in `insert`, so
            // the slot's key (written before the bucket was published) is
            // visible to `is_key`.
            let b = bucket.load(Ordering::Acquire);
            if b == 0 {
                return None;
            }
            if b & mask == want && Self::holds_key(bucket, b, is_key, Ordering::Acquire) {
                return Some(Entry {
                    pos,
                    slot: slot_of(b),
                    word: b,
                });
            }
            left -= 1;
            if left == 0 {
                return None;
            }
            pos += 1;
            if pos == buckets.len() {
                pos = 0;
            }
        }
    }

    /// Whether the key has a live entry (OWNED or PROVISIONAL).
    #[inline]
    pub fn contains_live(&self, key: Key, is_key: impl Fn(SlotId) -> bool) -> bool {
        self.find_live(key, is_key).is_some()
    }

    /// Insert `key → slot` unless the key is present. The slot's key must
    /// already be readable through `is_key` (written before this call).
    pub fn insert(&self, key: Key, slot: SlotId, is_key: impl Fn(SlotId) -> bool) -> Insert {
        assert!(slot.0 as usize <= SLOT_MAX);
        let home = self.home(key);
        let fp = Self::fp(key);
        // A lost CAS means the run changed; each retry re-scans. Bounded: a
        // retry needs another thread's successful CAS in this run.
        for _ in 0..1024 {
            // Step 1: scan for the key and for the first reusable bucket.
            // ORDERING: SeqCst — the Dekker handshake (module doc).
            let h = usize::from(self.hints[home].load(Ordering::SeqCst));
            let mut free: Option<(usize, usize, u64)> = None;
            let mut d = 0;
            let mut pos = home;
            while d < PROBE_MAX {
                let bucket = &self.buckets[pos];
                // ORDERING: SeqCst — Dekker handshake.
                let b = bucket.load(Ordering::SeqCst);
                if b == 0 {
                    free.get_or_insert((d, pos, b));
                    break;
                }
                if state_of(b) == TOMB {
                    free.get_or_insert((d, pos, b));
                } else if b & LIVE_FP_MASK == live_fp(fp)
                    && Self::holds_key(bucket, b, &is_key, Ordering::SeqCst)
                {
                    return Insert::Present;
                }
                if d >= h && free.is_some() {
                    break;
                }
                d += 1;
                pos += 1;
                if pos == self.buckets.len() {
                    pos = 0;
                }
            }
            let Some((d, pos, old)) = free else {
                return Insert::Full;
            };
            // Publish the displacement before the entry, so any lookup that
            // can see the entry also scans far enough to find it.
            // (Skipped when the hint we loaded already covers `d`: hints only grow.)
            if d > h {
                // ORDERING: SeqCst — Dekker handshake; also orders before the CAS.
                self.hints[home].fetch_max(d as u8, Ordering::SeqCst);
            }
            let mine = enc(fp, PROVISIONAL, slot);
            // ORDERING: SeqCst — Dekker handshake; Release part publishes the
            // slot's key to scanners.
            if self.buckets[pos]
                .compare_exchange(old, mine, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                continue;
            }
            // Step 2: verify.
            if !self.verify(home, fp, d, pos, &is_key) {
                // ORDERING: SeqCst — retract; failure means a racer killed us.
                let _ = self.buckets[pos].compare_exchange(
                    mine,
                    tomb_of(mine),
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                );
                return Insert::Present;
            }
            // Step 3: confirm.
            let owned = enc(fp, OWNED, slot);
            // ORDERING: SeqCst — settles against a lower racer's kill CAS.
            return match self.buckets[pos].compare_exchange(
                mine,
                owned,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => Insert::Inserted(Entry {
                    pos,
                    slot,
                    word: owned,
                }),
                Err(_) => Insert::Present,
            };
        }
        Insert::Full
    }

    /// Step 2 of insert: true if our PROVISIONAL entry at `my_d` may confirm.
    fn verify(
        &self,
        home: usize,
        fp: u32,
        my_d: usize,
        my_pos: usize,
        is_key: &impl Fn(SlotId) -> bool,
    ) -> bool {
        // ORDERING: SeqCst — Dekker handshake.
        let h = usize::from(self.hints[home].load(Ordering::SeqCst));
        for d in 0..=h.min(PROBE_MAX - 1) {
            let pos = self.at(home, d);
            if pos == my_pos {
                continue;
            }
            // ORDERING: SeqCst — Dekker handshake.
            let mut b = self.buckets[pos].load(Ordering::SeqCst);
            if b == 0 {
                break;
            }
            if !self.is_entry(pos, b, fp, is_key, Ordering::SeqCst) {
                continue;
            }
            if state_of(b) == OWNED || d < my_d {
                return false;
            }
            // A higher PROVISIONAL racer: kill it.
            loop {
                // ORDERING: SeqCst — settles against its confirm CAS.
                match self.buckets[pos].compare_exchange(
                    b,
                    tomb_of(b),
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                ) {
                    Err(actual) if actual == enc(fp, OWNED, slot_of(b)) => return false,
                    // ORDERING: SeqCst re-read inside `is_entry` — Dekker
                    // handshake, as in the scan above.
                    Err(actual)
                        if state_of(actual) == PROVISIONAL
                            && self.is_entry(pos, actual, fp, is_key, Ordering::SeqCst) =>
                    {
                        b = actual;
                    }
                    // Killed, or it retracted / changed on its own.
                    Ok(_) | Err(_) => break,
                }
            }
        }
        true
    }

    /// Whether bucket `e.pos` still holds the word `find` returned.
    #[inline]
    pub fn still_holds(&self, e: Entry) -> bool {
        // ORDERING: Acquire — pairs with the insert's confirm CAS, so the
        // slot's key written before it is visible to the caller's check.
        self.buckets[e.pos].load(Ordering::Acquire) == e.word
    }

    /// Remove the entry found by `find` (OWNED → TOMB). False if it changed
    /// meanwhile.
    pub fn remove(&self, e: Entry) -> bool {
        // ORDERING: AcqRel — Release orders the slot's detach before the
        // bucket disappears; Acquire pairs with the confirm CAS.
        self.buckets[e.pos]
            .compare_exchange(e.word, tomb_of(e.word), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Forget everything (close; no concurrent users).
    pub fn clear(&self) {
        for b in &*self.buckets {
            // ORDERING: Relaxed — no concurrent users (arena closed).
            b.store(0, Ordering::Relaxed);
        }
        for h in &*self.hints {
            // ORDERING: Relaxed — as above.
            h.store(0, Ordering::Relaxed);
        }
    }

    /// Number of OWNED entries (tests and status; O(table)).
    pub fn owned_count(&self) -> usize {
        self.buckets
            .iter()
            // ORDERING: Relaxed — a statistic.
            .filter(|b| state_of(b.load(Ordering::Relaxed)) == OWNED)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;
    use std::sync::{Arc, Barrier};

    /// Slot → key table standing in for the core's slot metadata.
    struct Keys(Vec<std::sync::Mutex<Option<Key>>>);
    impl Keys {
        fn new(n: usize) -> Keys {
            Keys((0..n).map(|_| std::sync::Mutex::new(None)).collect())
        }
        fn set(&self, s: SlotId, k: Option<Key>) {
            *self.0[s.0 as usize].lock().unwrap() = k;
        }
        fn is(&self, k: Key) -> impl Fn(SlotId) -> bool + '_ {
            move |s| *self.0[s.0 as usize].lock().unwrap() == Some(k)
        }
    }

    #[test]
    fn insert_find_remove_reuse() {
        let idx = Index::with_slots(64);
        let keys = Keys::new(64);
        let k = Key::digest(b"a");
        keys.set(SlotId(5), Some(k));
        let Insert::Inserted(e) = idx.insert(k, SlotId(5), keys.is(k)) else {
            panic!()
        };
        assert_eq!(idx.find(k, keys.is(k)).unwrap().slot, SlotId(5));
        keys.set(SlotId(6), Some(k));
        assert_eq!(idx.insert(k, SlotId(6), keys.is(k)), Insert::Present);
        assert!(idx.remove(e));
        assert!(!idx.remove(e), "second remove of the same entry fails");
        assert_eq!(idx.find(k, keys.is(k)), None);
        let Insert::Inserted(e2) = idx.insert(k, SlotId(6), keys.is(k)) else {
            panic!()
        };
        assert_eq!(e2.pos, e.pos, "the tombstone is reused");
    }

    #[test]
    fn churn_keeps_probe_runs_short() {
        // Insert and delete 50 000 distinct keys through a 64-slot table:
        // tombstones are reused, so it never fills.
        let idx = Index::with_slots(64);
        let keys = Keys::new(64);
        let mut live: Vec<(Key, Entry)> = Vec::new();
        for i in 0..50_000u32 {
            let k = Key::digest(&i.to_le_bytes());
            let slot = SlotId(i % 64);
            if live.len() == 32 {
                let (ok, e) = live.remove(0);
                assert!(idx.remove(e));
                keys.set(e.slot, None);
                assert_eq!(idx.find(ok, keys.is(ok)), None);
            }
            let slot = (0..64)
                .map(|j| SlotId((slot.0 + j) % 64))
                .find(|s| keys.0[s.0 as usize].lock().unwrap().is_none())
                .unwrap();
            keys.set(slot, Some(k));
            match idx.insert(k, slot, keys.is(k)) {
                Insert::Inserted(e) => live.push((k, e)),
                other => panic!("insert {i}: {other:?}"),
            }
        }
        for (k, e) in &live {
            assert_eq!(idx.find(*k, keys.is(*k)).unwrap().slot, e.slot);
        }
        assert_eq!(idx.owned_count(), 32);
    }

    #[test]
    fn racing_inserts_of_one_key_agree_on_one_winner() {
        // Many rounds of 2 threads inserting the same key into different
        // slots while a third churns tombstones near it.
        let idx = Arc::new(Index::with_slots(32));
        let keys = Arc::new(Keys::new(32));
        for round in 0..2000u32 {
            let k = Key::digest(&round.to_le_bytes());
            let barrier = Arc::new(Barrier::new(2));
            let wins = Arc::new(AtomicU32::new(0));
            let hs: Vec<_> = (0..2u32)
                .map(|t| {
                    let (idx, keys, barrier, wins) =
                        (idx.clone(), keys.clone(), barrier.clone(), wins.clone());
                    std::thread::spawn(move || {
                        let slot = SlotId(t);
                        keys.set(slot, Some(k));
                        barrier.wait();
                        match idx.insert(k, slot, keys.is(k)) {
                            Insert::Inserted(e) => {
                                wins.fetch_add(1, Ordering::SeqCst);
                                Some(e)
                            }
                            Insert::Present => None,
                            Insert::Full => panic!("full"),
                        }
                    })
                })
                .collect();
            let entries: Vec<_> = hs.into_iter().filter_map(|h| h.join().unwrap()).collect();
            assert_eq!(
                wins.load(Ordering::SeqCst),
                1,
                "round {round}: exactly one insert wins"
            );
            assert_eq!(idx.owned_count(), 1);
            let e = entries[0];
            assert_eq!(idx.find(k, keys.is(k)).unwrap(), e);
            assert!(idx.remove(e));
            keys.set(SlotId(0), None);
            keys.set(SlotId(1), None);
        }
    }
}
