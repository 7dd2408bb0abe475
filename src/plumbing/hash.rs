//! # A keyed fast hasher for maps of digests and ids
//!
//! `std`'s `HashMap` hashes with SipHash-1-3: about 150 instructions for a
//! 16-byte [`crate::Key`] on the machines in docs/performance.md, several
//! times per key on the FFI faces' bookkeeping (the plugin adapter records
//! every stored key, python/src/l2/known.rs). What those maps hash is
//! already uniform (a key is an xxh3-128 digest; a task id is a counter),
//! so the hasher only has to spread the words over the table and keep a
//! peer from choosing colliding inputs: each word is mixed with a folded
//! 64 × 64 → 128-bit multiply (as `foldhash` does), from a per-map random
//! seed. The seed is what keeps flooding off: key digests come from key
//! strings a remote user can shape (prompt content), so a fixed function
//! would let one search offline for keys that share a bucket.
//!
//! Not for persistent or cross-process hashing: the value differs per map.

#![forbid(unsafe_code)]

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

/// A `HashMap` with this hasher (`Map::default()` seeds it).
pub type Map<K, V> = std::collections::HashMap<K, V, Keyed>;

/// Odd 64-bit multiplier (the fractional part of π, as in `foldhash`).
const MULTIPLE: u64 = 0x243f_6a88_85a3_08d3;

/// The high and low words of `a × b`, folded together.
#[inline]
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

/// The [`BuildHasher`] of a map: a random seed of its own.
#[derive(Clone, Debug)]
pub struct Keyed {
    seed: u64,
    /// Mixed into the multiplier (kept odd), so every fold depends on it.
    tweak: u64,
}

impl Keyed {
    /// A fresh seed, from `std`'s per-process random keys (stepped per
    /// `RandomState`, so two maps differ).
    pub fn new() -> Keyed {
        let rs = RandomState::new();
        Keyed {
            seed: rs.hash_one(0x5eed_u64),
            tweak: rs.hash_one(0x7ea4_u64),
        }
    }
}

impl Default for Keyed {
    fn default() -> Self {
        Keyed::new()
    }
}

impl BuildHasher for Keyed {
    type Hasher = KeyedHasher;

    #[inline]
    fn build_hasher(&self) -> KeyedHasher {
        KeyedHasher {
            h: self.seed,
            // Odd, as the multiplier of a multiplicative hash must be.
            m: (MULTIPLE ^ self.tweak) | 1,
        }
    }
}

/// The state of one hash ([`Keyed`]).
#[derive(Clone, Debug)]
pub struct KeyedHasher {
    h: u64,
    m: u64,
}

impl Hasher for KeyedHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Slices: their `Hash` impls write the length first, so inputs of
        // different lengths that pad alike do not collide.
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.write_u64(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.write_u64(u64::from_le_bytes(w));
        }
    }

    #[inline]
    fn write_u8(&mut self, x: u8) {
        self.write_u64(u64::from(x));
    }

    #[inline]
    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.h = fold(self.h ^ x, self.m);
    }

    #[inline]
    fn write_u128(&mut self, x: u128) {
        self.write_u64(x as u64);
        self.write_u64((x >> 64) as u64);
    }

    #[inline]
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // One more round, so the last word reaches every bit (hashbrown
        // takes the bucket from the low bits and a tag from the top 7).
        fold(self.h, self.m.rotate_left(32) | 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};
    use std::hash::Hash;

    fn hash<T: Hash>(b: &Keyed, v: T) -> u64 {
        b.hash_one(v)
    }

    #[test]
    fn equal_inputs_hash_equal_and_two_maps_differ() {
        let (a, b) = (Keyed::new(), Keyed::new());
        assert_eq!(hash(&a, (7u64, 9u64)), hash(&a, (7u64, 9u64)));
        // Two builders: different seeds (a fixed function is what a
        // flooding peer would search against).
        assert_ne!(hash(&a, 1u64), hash(&b, 1u64));
    }

    #[test]
    fn word_order_and_length_matter() {
        let k = Keyed::new();
        assert_ne!(hash(&k, (1u64, 2u64)), hash(&k, (2u64, 1u64)));
        assert_ne!(hash(&k, [0u8; 3].as_slice()), hash(&k, [0u8; 4].as_slice()));
        assert_ne!(hash(&k, 5i128), hash(&k, -5i128));
    }

    /// Counters (task ids) and keys differing in one bit spread over both
    /// the low bits (the bucket) and the top 7 (hashbrown's tag).
    #[test]
    fn sequential_inputs_spread_over_low_and_high_bits() {
        let k = Keyed::new();
        let n = 4096u64;
        let low: HashSet<u64> = (0..n).map(|i| hash(&k, i) & 0xfff).collect();
        let high: HashSet<u64> = (0..n).map(|i| hash(&k, i) >> 57).collect();
        // 4096 balls in 4096 bins: about 2589 distinct expected; a hash
        // that keeps the low bits of a counter would give 4096, one that
        // drops them far fewer. Bound both ways loosely.
        assert!(
            (2300..=2900).contains(&low.len()),
            "{} low buckets",
            low.len()
        );
        assert_eq!(high.len(), 128, "every tag value is reached");
        let bits: HashSet<u64> = (0..128u32).map(|b| hash(&k, 1u128 << b) & 0xffff).collect();
        assert!(
            bits.len() > 120,
            "{} of 128 one-bit keys collide",
            128 - bits.len()
        );
    }

    #[test]
    fn a_map_with_it_behaves_as_a_map() {
        let mut m: HashMap<u128, u32, Keyed> = HashMap::default();
        for i in 0..10_000u128 {
            m.insert(i << 64 | i, i as u32);
        }
        for i in 0..10_000u128 {
            assert_eq!(m.remove(&(i << 64 | i)), Some(i as u32));
        }
        assert!(m.is_empty());
    }
}
