//! Keys: a fixed-size 128-bit digest of the caller's key bytes.
//!
//! LMCache hands keys as strings (`model@rank@group@hash[@salt]`); the index
//! and (later) the ring entries only ever see this digest, so entries stay
//! fixed-size. The digest function is this one place: XXH3-128, chosen by
//! `benches/index.rs` (`index/digest/*`) over BLAKE3.
//!
//! With 2^24 live keys (a 1 TiB device in 64 KiB slots) the chance that a new
//! key collides with a live one is about 2^24 / 2^128 per store.
#![forbid(unsafe_code)]

use std::fmt;

/// A key digest. Never all-zero (the index reserves zero).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    hi: u64,
    lo: u64,
}

impl Key {
    /// Digest arbitrary key bytes (e.g. LMCache's key string).
    #[inline]
    pub fn digest(bytes: &[u8]) -> Key {
        Key::from_u128(xxhash_rust::xxh3::xxh3_128(bytes))
    }

    /// A key from a digest the caller computed. Zero maps to one, since the
    /// index reserves the all-zero word.
    #[inline]
    pub const fn from_u128(v: u128) -> Key {
        let v = if v == 0 { 1 } else { v };
        Key {
            hi: (v >> 64) as u64,
            lo: v as u64,
        }
    }

    /// The 128-bit digest (never 0).
    #[inline]
    pub const fn as_u128(self) -> u128 {
        ((self.hi as u128) << 64) | self.lo as u128
    }

    #[inline]
    pub(crate) const fn from_parts(hi: u64, lo: u64) -> Key {
        Key { hi, lo }
    }

    #[inline]
    pub(crate) const fn hi(self) -> u64 {
        self.hi
    }

    #[inline]
    pub(crate) const fn lo(self) -> u64 {
        self.lo
    }
}

impl From<&str> for Key {
    fn from(s: &str) -> Key {
        Key::digest(s.as_bytes())
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({:016x}{:016x})", self.hi, self.lo)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}{:016x}", self.hi, self.lo)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_stable_and_distinguishes() {
        let a = Key::digest(b"model@0@0@abc");
        assert_eq!(a, Key::digest(b"model@0@0@abc"));
        assert_ne!(a, Key::digest(b"model@0@0@abd"));
        assert_eq!(Key::from_u128(a.as_u128()), a);
    }

    #[test]
    fn zero_is_never_a_key() {
        assert_eq!(Key::from_u128(0).as_u128(), 1);
    }
}
