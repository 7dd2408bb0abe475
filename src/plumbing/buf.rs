//! # Caller buffers handed to the engine
//!
//! A task's buffers outlive the `submit_*` call, so they are either owned by
//! the task ([`Buf::Vec`] and the other owned forms, [`Dsts::Owned`], the safe path: the engine hands
//! them back with the result) or described by pointer and length
//! ([`RawBuf`], for callers such as the LMCache plugin whose buffers live in
//! memory the engine does not own).
//!
//! ## Lifetime rule for raw buffers
//!
//! A `RawBuf` must stay valid, and must not be read or written by anyone but
//! the engine (for load destinations) or written by anyone (for store
//! sources), from its construction until that task's completion has been
//! observed (`pop_completed_stores` returned its id, or `query_*` returned
//! its result), or until the `RawBuf` is dropped if it is never submitted.
//! The unsafe constructor is where the caller promises this; everything
//! after it is safe.
//!
//! ## No aliasing `&mut` from safe code
//!
//! A `RawBuf` hands out `&[u8]` from `&self` and `&mut [u8]` only from
//! `&mut self`, so the borrow checker tracks its views. The engine's load
//! destinations are shared by several workers through `&Lent`; a worker
//! writes its part only through a [`LentPart`] from [`Lent::claim`], whose
//! claim bits make every destination part of at most one claim per lend (a
//! duplicated or overlapping submission gets `None`, not a second `&mut`),
//! and which hands out one `&mut [u8]` at a time.
//!
//! This is the one module outside `arena`, `copy`, `ring` and the syscall
//! wrappers with `unsafe`: it is the boundary with caller memory, as the
//! ring is the boundary with another process's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Caller memory described by pointer and length. Not `Clone`: one
/// descriptor per buffer, so the engine can hand each to exactly one worker.
///
/// Safe code cannot get two live `&mut` to its bytes:
///
/// ```compile_fail,E0499
/// # use daxkv::plumbing::buf::RawBuf;
/// let mut v = vec![0u8; 4];
/// // SAFETY: `v` outlives `r` and is touched only through it.
/// let mut r = unsafe { RawBuf::new(v.as_mut_ptr(), v.len()) };
/// let a = r.as_mut_slice();
/// let b = r.as_mut_slice();
/// a[0] = 1;
/// b[0] = 2;
/// ```
#[derive(Debug)]
pub struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the constructor's contract makes the memory reachable only
// through this descriptor, so moving it to a worker thread is sound.
unsafe impl Send for RawBuf {}
// SAFETY: through `&RawBuf` only `&[u8]` can be had (`as_slice`); `&mut
// [u8]` needs `&mut RawBuf` or an exclusive `LentPart` claim.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// # Safety
    /// - `ptr` is valid for reads and writes of `len` bytes (any pointer
    ///   when `len` is 0), from now until this `RawBuf` is dropped or, once
    ///   it is handed to the engine, until that task's completion has been
    ///   observed (the module's lifetime rule);
    /// - for that whole time the memory is accessed only through this
    ///   descriptor: no one else writes it, and no one else reads it while
    ///   it may be written through the descriptor (a load destination).
    pub unsafe fn new(ptr: *mut u8, len: usize) -> RawBuf {
        RawBuf { ptr, len }
    }

    /// Length of the buffer, bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, for a store source.
    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the constructor's contract: valid for `len` bytes and
        // written by no one else while this descriptor lives; writes through
        // the descriptor need `&mut self` (or an exclusive `LentPart`, which
        // owns no `&RawBuf` anyone else can reach), so none happens while
        // this shared borrow lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, for a load destination. `&mut self`: the borrow checker
    /// keeps this the only view while it lives.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `&mut self` excludes every other view made through this
        // descriptor, and the constructor's contract excludes every view
        // made without it.
        unsafe { self.view_mut() }
    }

    /// # Safety
    /// No other view of these bytes (through this descriptor or not) is live
    /// while the returned one is, and none is made until it ends.
    #[allow(clippy::mut_from_ref)] // the caller proves exclusivity
    unsafe fn view_mut(&self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: valid for reads and writes of `len` bytes (constructor's
        // contract); exclusive (this function's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Load destinations as the caller hands them to a task.
#[derive(Debug)]
pub enum Dsts {
    /// Caller memory (see the module's lifetime rule).
    Raw(Vec<RawBuf>),
    /// Owned vectors, lent to the task and handed back with its result.
    Owned(Vec<Vec<u8>>),
}

impl Dsts {
    /// Number of destinations (one per key).
    pub fn len(&self) -> usize {
        match self {
            Dsts::Raw(r) => r.len(),
            Dsts::Owned(o) => o.len(),
        }
    }

    /// True when there are no destinations.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A task's load destinations, kept in a reusable task record: one
/// descriptor per destination (moved in for raw buffers, borrowed from the
/// owned vectors otherwise), in a vector whose capacity is kept from task
/// to task, so lending allocates nothing once the record is warm.
///
/// The owned vectors stay here, untouched, while workers write through the
/// descriptors; `take_back` drops every descriptor before handing them out.
///
/// Safe code cannot get two live `&mut` to one destination: a part must be
/// claimed, a claimed index cannot be claimed again, and a claim hands out
/// one `&mut` at a time:
///
/// ```compile_fail,E0499
/// # use daxkv::plumbing::buf::{Dsts, Lent};
/// let mut lent = Lent::default();
/// lent.lend(Dsts::Owned(vec![vec![0u8; 4]]));
/// let mut part = lent.claim(0, 1).unwrap();
/// let a = part.get_mut(0);
/// let b = part.get_mut(0);
/// a[0] = 1;
/// b[0] = 2;
/// ```
///
/// ```
/// # use daxkv::plumbing::buf::{Dsts, Lent};
/// let mut lent = Lent::default();
/// lent.lend(Dsts::Owned(vec![vec![0u8; 4]; 3]));
/// let mut first = lent.claim(0, 2).unwrap();
/// assert!(lent.claim(1, 2).is_none(), "index 1 is claimed already");
/// let mut last = lent.claim(2, 1).unwrap();
/// first.get_mut(1)[0] = 7;
/// last.get_mut(0)[0] = 9;
/// assert_eq!(lent.take_back(), vec![vec![0, 0, 0, 0], vec![7, 0, 0, 0], vec![9, 0, 0, 0]]);
/// ```
///
/// The descriptors themselves are not handed out, so two `&mut` into one
/// lent buffer do not compile:
///
/// ```compile_fail
/// # use daxkv::plumbing::buf::{Dsts, Lent};
/// let mut lent = Lent::default();
/// lent.lend(Dsts::Owned(vec![vec![0u8; 4]]));
/// let a = lent.bufs()[0].as_mut_slice();
/// let b = lent.bufs()[0].as_mut_slice();
/// a[0] = 1;
/// b[0] = 2;
/// ```
#[derive(Default)]
pub struct Lent {
    owned: Vec<Vec<u8>>,
    views: Vec<RawBuf>,
    /// One bit per descriptor: set while (and after) a [`LentPart`] holds
    /// it; cleared only through `&mut self` (`lend`, `take_back`).
    claims: Vec<AtomicU64>,
}

/// By hand, never the derived one: while lent, `owned`'s bytes belong to
/// the parts writing them, so `Debug` prints shapes only (reading the bytes
/// here would alias a part's `&mut`, which Miri reports).
impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lent")
            .field("buffers", &self.views.len())
            .field("owned", &!self.owned.is_empty())
            .finish_non_exhaustive()
    }
}

impl Lent {
    /// Room for `n` descriptors without allocating.
    pub fn with_capacity(n: usize) -> Lent {
        Lent {
            owned: Vec::new(),
            views: Vec::with_capacity(n),
            claims: Vec::with_capacity(n.div_ceil(64).max(1)),
        }
    }

    /// Take `d` as this task's destinations (whatever was lent before is
    /// dropped).
    pub fn lend(&mut self, d: Dsts) {
        self.views.clear();
        match d {
            Dsts::Raw(raw) => {
                self.owned = Vec::new();
                self.views.extend(raw);
            }
            Dsts::Owned(mut owned) => {
                self.views.extend(
                    owned
                        .iter_mut()
                        // SAFETY: each vector's heap buffer is valid for
                        // `len` bytes and stays put and untouched: `owned`
                        // is reachable only through `take_back` / `lend` /
                        // drop, which clear (or drop) every descriptor
                        // first or with it.
                        .map(|v| unsafe { RawBuf::new(v.as_mut_ptr(), v.len()) }),
                );
                self.owned = owned;
            }
        }
        self.claims.clear();
        self.claims
            .resize_with(self.views.len().div_ceil(64), || AtomicU64::new(0));
    }

    /// Destinations lent.
    pub fn len(&self) -> usize {
        self.views.len()
    }

    /// True when nothing is lent.
    pub fn is_empty(&self) -> bool {
        self.views.is_empty()
    }

    /// Claim destinations `start..start + len` for one writer. `None` if
    /// the range is out of bounds or any of it was claimed before (since the
    /// last `lend`): each destination is written through at most one part.
    pub fn claim(&self, start: usize, len: usize) -> Option<LentPart<'_>> {
        let end = start.checked_add(len)?;
        let views = self.views.get(start..end)?;
        let mut i = start;
        while i < end {
            let (w, b) = (i / 64, i % 64);
            let n = (end - i).min(64 - b);
            let mask = (u64::MAX >> (64 - n)) << b;
            // ORDERING: Relaxed — exclusivity comes from the RMW order on
            // this one word (of two claims of a bit, exactly one sees it
            // clear); no bytes are handed over through the bits (the
            // written bytes reach the collector through the task's
            // completion). Pairs with the other claims' fetch_or here.
            let prev = self.claims[w].fetch_or(mask, Ordering::Relaxed);
            if prev & mask != 0 {
                self.unclaim(start, i, mask & !prev, w);
                return None;
            }
            i += n;
        }
        Some(LentPart { views })
    }

    /// Roll back a failed claim: whole words' bits in `start..done`, and
    /// `mine` in word `w`.
    fn unclaim(&self, start: usize, done: usize, mine: u64, w: usize) {
        // ORDERING: Relaxed — these bits were ours (set by this claim, seen
        // clear before), and nothing was written under them; pairs with the
        // fetch_or in `claim`.
        self.claims[w].fetch_and(!mine, Ordering::Relaxed);
        let mut i = start;
        while i < done {
            let (w, b) = (i / 64, i % 64);
            let n = (done - i).min(64 - b);
            let mask = (u64::MAX >> (64 - n)) << b;
            // ORDERING: Relaxed — as above.
            self.claims[w].fetch_and(!mask, Ordering::Relaxed);
            i += n;
        }
    }

    /// The owned vectors back (empty for raw destinations); the descriptors
    /// are dropped, the capacity kept.
    pub fn take_back(&mut self) -> Vec<Vec<u8>> {
        self.views.clear();
        self.claims.clear();
        std::mem::take(&mut self.owned)
    }
}

/// Destinations `start..start + len` of a [`Lent`], claimed by one writer
/// ([`Lent::claim`]). Index `i` here is destination `start + i`.
#[derive(Debug)]
pub struct LentPart<'a> {
    views: &'a [RawBuf],
}

impl LentPart<'_> {
    /// Destinations in this part.
    pub fn len(&self) -> usize {
        self.views.len()
    }

    /// True for an empty part.
    pub fn is_empty(&self) -> bool {
        self.views.is_empty()
    }

    /// Destination `i` of this part, writable. `&mut self`: one at a time.
    pub fn get_mut(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: destination `i` belongs to this part alone: its claim bit
        // was clear when this part set it, and it is cleared again only
        // through `&mut Lent`, which cannot coexist with this part's borrow
        // of the `Lent`; no `&RawBuf` of a lent descriptor is reachable
        // outside this module; and `&mut self` makes the returned view the
        // part's only one while it lives.
        unsafe { self.views[i].view_mut() }
    }
}

/// A store source: the bytes of one key, owned by the task until its
/// result is collected (then dropped). Every owned form is moved in as is:
/// no copy of the payload is made before the one into the device.
#[derive(Debug)]
pub enum Buf {
    /// A vector, moved in.
    Vec(Vec<u8>),
    /// A boxed slice, moved in.
    Boxed(Box<[u8]>),
    /// Shared bytes: one payload may back many tasks (a clone is a
    /// reference-count increment).
    Shared(Arc<[u8]>),
    /// Caller memory (see the module's lifetime rule).
    Raw(RawBuf),
}

impl Buf {
    /// The source bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Buf::Vec(v) => v,
            Buf::Boxed(b) => b,
            Buf::Shared(b) => b,
            Buf::Raw(r) => r.as_slice(),
        }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// True for an empty source.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Moves the vector in (no copy).
impl From<Vec<u8>> for Buf {
    fn from(v: Vec<u8>) -> Buf {
        Buf::Vec(v)
    }
}

/// Moves the box in (no copy).
impl From<Box<[u8]>> for Buf {
    fn from(v: Box<[u8]>) -> Buf {
        Buf::Boxed(v)
    }
}

/// Shares the bytes (no copy).
impl From<Arc<[u8]>> for Buf {
    fn from(v: Arc<[u8]>) -> Buf {
        Buf::Shared(v)
    }
}

/// Caller memory.
impl From<RawBuf> for Buf {
    fn from(v: RawBuf) -> Buf {
        Buf::Raw(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A derived `Debug` for `Lent` would read the lent vectors' bytes
    /// while a part holds `&mut` into them (an alias from safe code, and a
    /// data race from another thread; Miri reports UB). Its `Debug` prints
    /// shapes only; under Miri this test checks there is no aliasing.
    #[test]
    fn debug_of_a_lent_record_does_not_read_the_lent_bytes() {
        let mut lent = Lent::default();
        lent.lend(Dsts::Owned(vec![vec![0u8; 4], vec![0u8; 64]]));
        let mut part = lent.claim(0, 1).unwrap();
        let dst = part.get_mut(0);
        dst[0] = 1;
        let shown = format!("{lent:?}");
        dst[0] = 2;
        assert!(!shown.contains("[1, 0, 0, 0]"), "{shown}");
        assert!(shown.contains("buffers: 2"), "{shown}");
        // A "worker" writes its part on another thread while the record is
        // formatted: a data race if `Debug` read the bytes.
        std::thread::scope(|s| {
            let l = &lent;
            s.spawn(move || l.claim(1, 1).expect("part 1 is free").get_mut(0).fill(7));
            let _ = format!("{l:?}");
        });
    }

    fn lent(n: usize) -> Lent {
        let mut l = Lent::with_capacity(n);
        l.lend(Dsts::Owned(vec![vec![0u8; 8]; n]));
        l
    }

    #[test]
    fn claims_are_disjoint_and_roll_back() {
        let l = lent(130);
        assert!(l.claim(129, 2).is_none(), "out of bounds");
        assert!(l.claim(usize::MAX, 2).is_none(), "overflow");
        let _a = l.claim(64, 2).unwrap();
        // 10..70 spans words 0 and 1 and hits 64: refused, and its word-0
        // bits are rolled back.
        assert!(l.claim(10, 60).is_none());
        let _b = l.claim(10, 54).unwrap();
        assert!(l.claim(63, 1).is_none());
        assert!(l.claim(65, 1).is_none());
        let _c = l.claim(66, 64).unwrap();
        assert!(l.claim(0, 10).unwrap().len() == 10);
        assert!(l.claim(0, 0).is_some(), "an empty part claims nothing");
    }

    /// Threads race for overlapping parts: exactly one wins each byte, and
    /// every byte ends up written by its winner. Under Miri this also
    /// checks the writes for data races and aliasing.
    #[test]
    fn racing_claims_never_share_a_destination() {
        const N: usize = 8;
        let mut l = lent(N);
        let won: Vec<Vec<usize>> = std::thread::scope(|s| {
            let l = &l;
            let hs: Vec<_> = (0..4u8)
                .map(|t| {
                    s.spawn(move || {
                        let mut mine = Vec::new();
                        for start in 0..N {
                            if let Some(mut p) = l.claim(start, 2.min(N - start)) {
                                for i in 0..p.len() {
                                    p.get_mut(i).fill(t + 1);
                                    mine.push(start + i);
                                }
                            }
                        }
                        mine
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut all: Vec<usize> = won.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..N).collect::<Vec<_>>(), "each destination once");
        let back = l.take_back();
        for (t, mine) in won.iter().enumerate() {
            for &i in mine {
                assert_eq!(back[i], vec![t as u8 + 1; 8]);
            }
        }
        // Lending again resets the claims (and allocates no descriptor room).
        l.lend(Dsts::Owned(back));
        assert!(l.claim(0, N).is_some());
    }

    #[test]
    fn raw_buf_views() {
        let mut v = vec![1u8, 2, 3];
        // SAFETY: `v` outlives `r` and is touched only through it until
        // `r` is dropped.
        let mut r = unsafe { RawBuf::new(v.as_mut_ptr(), v.len()) };
        r.as_mut_slice()[0] = 9;
        assert_eq!(r.as_slice(), &[9, 2, 3]);
        // `r` is done (last use above).
        assert_eq!(v, [9, 2, 3]);
        // SAFETY: zero length: any pointer.
        let mut e = unsafe { RawBuf::new(std::ptr::null_mut(), 0) };
        assert!(e.as_mut_slice().is_empty() && e.as_slice().is_empty());
    }
}

#[cfg(test)]
mod source_tests {
    use super::*;

    /// Owned sources are moved in, not copied: the bytes stay where the
    /// caller allocated them.
    #[test]
    fn owned_sources_are_not_copied() {
        let vec = vec![1u8; 100];
        let at = vec.as_ptr();
        assert_eq!(Buf::from(vec).as_slice().as_ptr(), at);
        let boxed: Box<[u8]> = vec![2u8; 50].into_boxed_slice();
        let at = boxed.as_ptr();
        assert_eq!(Buf::from(boxed).as_slice().as_ptr(), at);
        let shared: Arc<[u8]> = Arc::from(vec![3u8; 10]);
        let at = shared.as_ptr();
        let (one, two) = (Buf::from(shared.clone()), Buf::from(shared));
        assert_eq!((one.as_slice().as_ptr(), two.as_slice().as_ptr()), (at, at));
        assert_eq!(one.len(), 10);
    }
}
