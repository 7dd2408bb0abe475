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

    /// The bytes, for a load destination. Only the task's worker calls this,
    /// once per buffer.
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

/// Owned load destinations lent to a task: the vectors stay here, untouched,
/// while workers write through descriptors borrowed from this value; they
/// go back to the caller with the result.
#[derive(Debug)]
pub struct Lent {
    owned: Vec<Vec<u8>>,
    raw: Vec<RawBuf>,
}

impl Lent {
    pub fn new(mut owned: Vec<Vec<u8>>) -> Lent {
        let raw = owned
            .iter_mut()
            // SAFETY: each vector's heap buffer is valid for `len` bytes and
            // stays put (we never touch `owned` again until `into_owned`,
            // which consumes `self` and so every borrowed descriptor).
            .map(|v| unsafe { RawBuf::new(v.as_mut_ptr(), v.len()) })
            .collect();
        Lent { owned, raw }
    }

    /// The descriptors, borrowed from this value.
    pub fn bufs(&self) -> &[RawBuf] {
        &self.raw
    }

    pub fn into_owned(self) -> Vec<Vec<u8>> {
        drop(self.raw);
        self.owned
    }
}

/// Load destinations of one task.
#[derive(Debug)]
pub enum Dsts {
    Raw(Vec<RawBuf>),
    Lent(Lent),
}

impl Dsts {
    pub fn bufs(&self) -> &[RawBuf] {
        match self {
            Dsts::Raw(r) => r,
            Dsts::Lent(l) => l.bufs(),
        }
    }

    pub fn len(&self) -> usize {
        self.bufs().len()
    }

    pub fn is_empty(&self) -> bool {
        self.bufs().is_empty()
    }

    /// The owned vectors back (empty for raw destinations).
    pub fn into_owned(self) -> Vec<Vec<u8>> {
        match self {
            Dsts::Raw(_) => Vec::new(),
            Dsts::Lent(l) => l.into_owned(),
        }
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
