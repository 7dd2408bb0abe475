//! # Caller buffers handed to the engine
//!
//! A task's buffers outlive the `submit_*` call, so they are either owned by
//! the task ([`Buf::Owned`], [`BufMut::Owned`], the safe path: the engine hands
//! them back with the result) or described by pointer and length
//! ([`RawBuf`], for callers such as the LMCache plugin whose buffers live in
//! memory the engine does not own).
//!
//! ## Lifetime rule for raw buffers
//!
//! A `RawBuf` must stay valid, and must not be read or written by anyone but
//! the engine (for load destinations) or written by anyone (for store
//! sources), from the `submit_*` call until that task's completion has been
//! observed (`pop_completed_stores` returned its id, or `query_*` returned
//! its result). The unsafe constructor is where the caller promises this;
//! everything after it is safe.
//!
//! This is the one module outside `arena`, `copy`, `ring` and the syscall
//! wrappers with `unsafe`: it is the boundary with caller memory, as the
//! ring is the boundary with another process's.

use std::sync::Arc;

/// Caller memory described by pointer and length. Not `Clone`: one
/// descriptor per buffer, so the engine can hand each to exactly one worker.
#[derive(Debug)]
pub struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the constructor's contract makes the memory exclusively the
// engine's until completion, so moving the descriptor to a worker thread is
// sound.
unsafe impl Send for RawBuf {}
// SAFETY: as above; shared access only reads the descriptor.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// # Safety
    /// - `ptr` is valid for reads and writes of `len` bytes;
    /// - the memory follows the module's lifetime rule: valid and untouched
    ///   by anyone else from submit until the task's completion is observed.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> RawBuf {
        RawBuf { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, for a store source.
    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the constructor's contract: valid for `len` bytes and not
        // written by anyone while the task runs.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, for a load destination. Only the worker running the part
    /// that owns this buffer calls this, and it keeps one borrow at a time
    /// (it may try one device, drop the borrow, then try the next).
    #[allow(clippy::mut_from_ref)] // the contract makes the memory the task's alone
    pub fn as_mut_slice(&self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: the constructor's contract: valid for `len` bytes and
        // accessed by no one else until completion; the engine gives each
        // destination to exactly one worker part.
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
    pub fn len(&self) -> usize {
        match self {
            Dsts::Raw(r) => r.len(),
            Dsts::Owned(o) => o.len(),
        }
    }

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
#[derive(Debug, Default)]
pub struct Lent {
    owned: Vec<Vec<u8>>,
    views: Vec<RawBuf>,
}

impl Lent {
    /// Room for `n` descriptors without allocating.
    pub fn with_capacity(n: usize) -> Lent {
        Lent {
            owned: Vec::new(),
            views: Vec::with_capacity(n),
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
                        // `len` bytes and stays put: `owned` is reachable
                        // only through `take_back` / `lend` / drop, which
                        // clear (or drop) every descriptor first or with it.
                        .map(|v| unsafe { RawBuf::new(v.as_mut_ptr(), v.len()) }),
                );
                self.owned = owned;
            }
        }
    }

    /// The descriptors, borrowed from this value.
    pub fn bufs(&self) -> &[RawBuf] {
        &self.views
    }

    /// The owned vectors back (empty for raw destinations); the descriptors
    /// are dropped, the capacity kept.
    pub fn take_back(&mut self) -> Vec<Vec<u8>> {
        self.views.clear();
        std::mem::take(&mut self.owned)
    }
}

/// A store source.
#[derive(Debug)]
pub enum Buf {
    Owned(Arc<[u8]>),
    Raw(RawBuf),
}

impl Buf {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Buf::Owned(b) => b,
            Buf::Raw(r) => r.as_slice(),
        }
    }
}

impl From<Vec<u8>> for Buf {
    fn from(v: Vec<u8>) -> Buf {
        Buf::Owned(v.into())
    }
}

impl From<Arc<[u8]>> for Buf {
    fn from(v: Arc<[u8]>) -> Buf {
        Buf::Owned(v)
    }
}
