//! # What a caller holds: task ids and results
//!
//! A submit hands back a [`TaskId`]; collecting a task
//! ([`collect`](super::collect) module) hands back an [`Answer`] with its
//! result: a [`StoreResult`], a per-key [`Bitmap`], or a [`LoadResult`]
//! with each hit's length ([`Lens`]). These are plain values: none of them
//! refers to the engine or its task table.

#![forbid(unsafe_code)]

/// A task id: unique per engine, increasing, shared by stores, lookups and
/// loads. Its low bits name the task's record in the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskId(pub u64);

/// What a task does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaskKind {
    /// `submit_store`: copy sources into the pool.
    Store,
    /// `submit_lookup_and_lock`: find keys and take a read lock on each hit.
    Lookup,
    /// `submit_load` / `submit_load_raw`: copy stored payloads out.
    Load,
}

impl TaskKind {
    /// The pool (and completion ring, and eventfd) index of this kind.
    pub(super) fn idx(self) -> usize {
        self as usize
    }

    /// Lower-case name, as in `status()`.
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Store => "store",
            TaskKind::Lookup => "lookup",
            TaskKind::Load => "load",
        }
    }
}

/// Result of a store task (LMCache's `L2StoreResult`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreResult {
    /// Every key was stored (or was already present).
    pub success: bool,
    /// Slot bytes of the keys that succeeded (LMCache counts whole chunks).
    pub bytes_transferred: u64,
}

/// Words a [`Bitmap`] keeps inline: tasks of up to 256 keys hand their
/// result back without allocating.
const INLINE_WORDS: usize = 4;

/// A per-key result bitmap (LMCache's `Bitmap`): bit `i` says key `i` of
/// the task succeeded (stored, found and locked, loaded).
#[derive(Clone, PartialEq, Eq)]
pub struct Bitmap {
    /// Bits of tasks of up to `64 * INLINE_WORDS` keys (zero otherwise).
    inline: [u64; INLINE_WORDS],
    /// Bits of larger tasks (empty otherwise).
    heap: Vec<u64>,
    len: usize,
}

impl Bitmap {
    pub(super) fn from_words(len: usize, words: impl ExactSizeIterator<Item = u64>) -> Bitmap {
        let mut b = Bitmap {
            inline: [0; INLINE_WORDS],
            heap: Vec::new(),
            len,
        };
        if len.div_ceil(64) <= INLINE_WORDS {
            for (dst, w) in b.inline.iter_mut().zip(words) {
                *dst = w;
            }
        } else {
            b.heap.extend(words);
        }
        b
    }

    fn words(&self) -> &[u64] {
        let n = self.len.div_ceil(64);
        if n <= INLINE_WORDS {
            &self.inline[..n]
        } else {
            &self.heap
        }
    }

    /// Number of keys (bits).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a task of no keys.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether key `i` succeeded (false past the end).
    pub fn test(&self, i: usize) -> bool {
        i < self.len && self.words()[i / 64] & (1 << (i % 64)) != 0
    }

    /// Keys that succeeded.
    pub fn count_ones(&self) -> usize {
        self.words().iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Hits before the first miss (LMCache's prefix lookups).
    pub fn count_leading_ones(&self) -> usize {
        (0..self.len).take_while(|&i| self.test(i)).count()
    }

    /// One `bool` per key.
    pub fn to_vec(&self) -> Vec<bool> {
        (0..self.len).map(|i| self.test(i)).collect()
    }
}

impl std::fmt::Debug for Bitmap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s: String = self
            .to_vec()
            .iter()
            .map(|&b| if b { '1' } else { '0' })
            .collect();
        write!(f, "Bitmap({s})")
    }
}

/// Lengths a [`Lens`] keeps inline: tasks of up to 64 keys (the default
/// `task_keys`) hand them back without allocating.
const INLINE_LENS: usize = 64;

/// Each key's payload length in bytes after a load (0 for a miss): a tail
/// chunk is shorter than the slot, and the bytes past its length in the
/// destination are untouched.
#[derive(Clone, PartialEq, Eq)]
pub struct Lens {
    inline: [u32; INLINE_LENS],
    heap: Vec<u32>,
    len: usize,
}

impl Lens {
    pub(super) fn from_iter(len: usize, lens: impl Iterator<Item = usize>) -> Lens {
        let mut l = Lens {
            inline: [0; INLINE_LENS],
            heap: Vec::new(),
            len,
        };
        let lens = lens.map(|n| u32::try_from(n).unwrap_or(u32::MAX));
        if len <= INLINE_LENS {
            for (dst, n) in l.inline.iter_mut().zip(lens) {
                *dst = n;
            }
        } else {
            l.heap.extend(lens.take(len));
        }
        l
    }

    fn as_slice(&self) -> &[u32] {
        if self.len <= INLINE_LENS {
            &self.inline[..self.len]
        } else {
            &self.heap
        }
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a task of no keys.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Key `i`'s payload length (0 for a miss, and past the end).
    pub fn get(&self, i: usize) -> usize {
        self.as_slice().get(i).map_or(0, |&n| n as usize)
    }

    /// Every key's payload length, in key order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.as_slice().iter().map(|&n| n as usize)
    }

    /// The lengths as a vector.
    pub fn to_vec(&self) -> Vec<usize> {
        self.iter().collect()
    }
}

impl std::fmt::Debug for Lens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Result of a load task.
#[derive(Debug)]
pub struct LoadResult {
    /// Which keys were loaded.
    pub bitmap: Bitmap,
    /// The owned destinations, handed back in key order (empty when the
    /// task used raw buffers). Each keeps its length; the payload is its
    /// first `lens.get(i)` bytes.
    pub bufs: Vec<Vec<u8>>,
    /// Each key's payload length (0 for a miss).
    pub lens: Lens,
}

impl LoadResult {
    /// Key `i`'s payload in its owned destination, `None` for a miss (or a
    /// task with raw destinations).
    pub fn payload(&self, i: usize) -> Option<&[u8]> {
        if !self.bitmap.test(i) {
            return None;
        }
        self.bufs
            .get(i)
            .map(|b| &b[..self.lens.get(i).min(b.len())])
    }
}

/// The answer to "where is task `id`'s result?".
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub enum Answer<T> {
    /// Finished; here is its result (taken: the next call says `Unknown`).
    Ready(T),
    /// Still running (for a `wait_*`: the timeout passed first).
    Pending,
    /// No task with this id is pending or ready here: never handed out by
    /// this engine, or its result was already taken.
    Unknown,
    /// The id names a task of another kind (asked a lookup for a load id).
    WrongKind(TaskKind),
    /// The engine is closed and this task will never finish.
    Closed,
}

impl<T> Answer<T> {
    /// The result, if ready.
    pub fn ready(self) -> Option<T> {
        match self {
            Answer::Ready(r) => Some(r),
            _ => None,
        }
    }

    /// True while the task runs.
    pub fn is_pending(&self) -> bool {
        matches!(self, Answer::Pending)
    }

    /// Apply `f` to a ready result; every other answer is kept.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Answer<U> {
        match self {
            Answer::Ready(r) => Answer::Ready(f(r)),
            Answer::Pending => Answer::Pending,
            Answer::Unknown => Answer::Unknown,
            Answer::WrongKind(k) => Answer::WrongKind(k),
            Answer::Closed => Answer::Closed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lens_inline_and_on_the_heap() {
        for n in [0, 1, 64, 65, 300] {
            let l = Lens::from_iter(n, (0..n).map(|i| i * 3));
            assert_eq!(l.len(), n);
            assert_eq!(l.to_vec(), (0..n).map(|i| i * 3).collect::<Vec<_>>());
            assert_eq!(l.get(n), 0, "past the end");
        }
    }

    #[test]
    fn answer_helpers() {
        assert_eq!(Answer::Ready(3).ready(), Some(3));
        assert_eq!(Answer::<u8>::Pending.ready(), None);
        assert!(Answer::<u8>::Pending.is_pending());
        assert_eq!(Answer::Ready(2).map(|x| x * 2), Answer::Ready(4));
        assert_eq!(
            Answer::<u8>::WrongKind(TaskKind::Load).map(u16::from),
            Answer::WrongKind(TaskKind::Load)
        );
    }
}
