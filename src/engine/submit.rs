//! # Submitting tasks
//!
//! A submit claims a free task record, fills it with the caller's vectors
//! (moved, not copied), and pushes one submission entry per part onto
//! worker queues: a CAS on a worker's shared lock-free queue for the
//! `&self` methods of [`Engine`], or a plain store on one of a
//! [`Submitter`]'s own SPSC rings. A store or load task of many keys is
//! split into parts of at least [`SPLIT_MIN_KEYS`] keys spread over its
//! pool's workers; the parts write disjoint result bits (and destination
//! buffers), and the task completes once (an atomic countdown).
//!
//! A refused submit ([`Refused`]) hands the caller's keys and buffers back
//! with the reason, so a caller can retry (after collecting results, when
//! the table was full) without rebuilding them.

#![forbid(unsafe_code)]
// A refusal carries the caller's inputs back by value (about 140 bytes with
// the reason). Boxing it would allocate on the refusal path, which a
// server takes in a retry loop exactly when the table is full; the `Ok`
// path is a task id either way.
#![allow(clippy::result_large_err)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError};

use super::answer::{TaskId, TaskKind};
use super::worker::WorkerPool;
use super::{Engine, EngineError, Inner};
use crate::key::Key;
use crate::plumbing::buf::{Buf, Dsts, RawBuf};
use crate::plumbing::notify::EventFd;
use crate::plumbing::ring::{Producer, PushError, Ring, Sqe};

/// Smallest part when a store or load task is split across workers.
pub const SPLIT_MIN_KEYS: usize = 8;

/// A submit the engine refused, with the caller's inputs handed back:
/// `keys` and `bufs` (the sources of a store, the destinations of a load,
/// `()` for a lookup) are exactly what was passed in.
///
/// Converts into [`EngineError`] (dropping the inputs) for `?`.
pub struct Refused<B> {
    /// Why the submit was refused.
    pub error: EngineError,
    /// The task's keys.
    pub keys: Vec<Key>,
    /// The task's buffers.
    pub bufs: B,
}

impl<B> Refused<B> {
    /// The inputs, for a retry.
    pub fn into_inputs(self) -> (Vec<Key>, B) {
        (self.keys, self.bufs)
    }
}

impl<B> std::fmt::Debug for Refused<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Refused")
            .field("error", &self.error)
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

/// Displays as its reason (the inputs are the caller's to keep).
impl<B> std::fmt::Display for Refused<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

/// Transparent: the reason's own source, if any.
impl<B> std::error::Error for Refused<B> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}

impl<B> From<Refused<B>> for EngineError {
    fn from(r: Refused<B>) -> EngineError {
        r.error
    }
}

/// What a submit moves into the task record.
struct Inputs {
    keys: Vec<Key>,
    srcs: Vec<Buf>,
    dsts: Option<Dsts>,
}

type Enqueued = Result<TaskId, (EngineError, Inputs)>;

fn store_refused(r: Enqueued) -> Result<TaskId, Refused<Vec<Buf>>> {
    r.map_err(|(error, i)| Refused {
        error,
        keys: i.keys,
        bufs: i.srcs,
    })
}

fn lookup_refused(r: Enqueued) -> Result<TaskId, Refused<()>> {
    r.map_err(|(error, i)| Refused {
        error,
        keys: i.keys,
        bufs: (),
    })
}

fn load_refused(r: Enqueued) -> Result<TaskId, Refused<Vec<Vec<u8>>>> {
    r.map_err(|(error, i)| Refused {
        error,
        keys: i.keys,
        bufs: match i.dsts {
            Some(Dsts::Owned(v)) => v,
            _ => Vec::new(),
        },
    })
}

fn load_raw_refused(r: Enqueued) -> Result<TaskId, Refused<Vec<RawBuf>>> {
    r.map_err(|(error, i)| Refused {
        error,
        keys: i.keys,
        bufs: match i.dsts {
            Some(Dsts::Raw(v)) => v,
            _ => Vec::new(),
        },
    })
}

/// Refuse unless there is one buffer per key.
fn same_len(what: &'static str, i: Inputs, bufs: usize) -> Result<Inputs, (EngineError, Inputs)> {
    if i.keys.len() == bufs {
        Ok(i)
    } else {
        let keys = i.keys.len();
        Err((EngineError::LengthMismatch { what, keys, bufs }, i))
    }
}

fn store_inputs(keys: Vec<Key>, bufs: Vec<Buf>) -> Result<Inputs, (EngineError, Inputs)> {
    let n = bufs.len();
    let i = Inputs {
        keys,
        srcs: bufs,
        dsts: None,
    };
    same_len("submit_store", i, n)
}

fn load_inputs(keys: Vec<Key>, dsts: Dsts) -> Result<Inputs, (EngineError, Inputs)> {
    let n = dsts.len();
    let i = Inputs {
        keys,
        srcs: Vec::new(),
        dsts: Some(dsts),
    };
    same_len("submit_load", i, n)
}

fn lookup_inputs(keys: Vec<Key>) -> Inputs {
    Inputs {
        keys,
        srcs: Vec::new(),
        dsts: None,
    }
}

impl Engine {
    /// Store `bufs[i]` under `keys[i]`. Task success = every key stored (or
    /// already present). A refusal hands both vectors back.
    pub fn submit_store(
        &self,
        keys: Vec<Key>,
        bufs: Vec<Buf>,
    ) -> Result<TaskId, Refused<Vec<Buf>>> {
        store_refused(store_inputs(keys, bufs).and_then(|i| self.inner.enqueue(TaskKind::Store, i)))
    }

    /// Look up and lock: each hit takes one lock (release with
    /// `submit_unlock`).
    pub fn submit_lookup_and_lock(&self, keys: Vec<Key>) -> Result<TaskId, Refused<()>> {
        lookup_refused(self.inner.enqueue(TaskKind::Lookup, lookup_inputs(keys)))
    }

    /// Load into owned buffers, handed back by `query_load` / `wait_load`
    /// with each key's payload length. A buffer shorter than a payload
    /// gets nothing (that key misses).
    pub fn submit_load(
        &self,
        keys: Vec<Key>,
        bufs: Vec<Vec<u8>>,
    ) -> Result<TaskId, Refused<Vec<Vec<u8>>>> {
        load_refused(
            load_inputs(keys, Dsts::Owned(bufs))
                .and_then(|i| self.inner.enqueue(TaskKind::Load, i)),
        )
    }

    /// Load into caller memory (see [`crate::plumbing::buf`] for the lifetime rule).
    pub fn submit_load_raw(
        &self,
        keys: Vec<Key>,
        bufs: Vec<RawBuf>,
    ) -> Result<TaskId, Refused<Vec<RawBuf>>> {
        load_raw_refused(
            load_inputs(keys, Dsts::Raw(bufs)).and_then(|i| self.inner.enqueue(TaskKind::Load, i)),
        )
    }

    /// A submission handle for one thread: its own SPSC ring to every
    /// worker, so its submits take no lock. Owned (`Send + 'static`): it
    /// can live in a struct beside the engine or move into a thread.
    /// Results are collected through the engine as usual. Creating one is
    /// a cold-path operation (it allocates the rings). After the engine
    /// closes, its submits are refused with [`EngineError::Closing`].
    pub fn submitter(&self) -> Result<Submitter, EngineError> {
        let workers = self.inner.workers.load_full().ok_or(EngineError::Closing)?;
        let mut sqs: [Vec<Producer<Sqe>>; 3] = Default::default();
        for (c, pool) in workers.iter().enumerate() {
            for (w, inbox) in pool.inboxes.iter().enumerate() {
                let (p, cons) = Ring::<Sqe>::heap(pool.ring_capacity)
                    .expect("power-of-two capacity")
                    .split();
                inbox
                    .pending
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(cons);
                // ORDERING: Release — the worker's Acquire sees the ring.
                inbox.has_new.store(true, Ordering::Release);
                // Wake the worker so it adopts (and, when it next parks,
                // arms) the new ring.
                let _ = pool.wakes[w].notify();
                sqs[c].push(p);
            }
        }
        // The workers are not kept: after `close` their eventfds must close.
        Ok(Submitter {
            inner: self.inner.clone(),
            sqs,
            rr: [0; 3],
        })
    }
}

impl Inner {
    /// The shared submit path: a CAS on the worker's MPMC queue. A thread
    /// with a `Submitter` pushes to rings of its own instead.
    fn enqueue(&self, kind: TaskKind, i: Inputs) -> Enqueued {
        self.enqueue_with(kind, i, None, |pool, w, e| {
            pool.shared[w].push(&pool.wakes[w], e);
        })
    }

    /// Record the task in the table, then hand its parts to `push`
    /// (worker index, entry). Parts go round-robin over the pool's workers:
    /// by `rr` when the caller has a counter of its own (a [`Submitter`]),
    /// else by the pool's shared one.
    fn enqueue_with(
        &self,
        kind: TaskKind,
        i: Inputs,
        rr: Option<&mut usize>,
        push: impl FnMut(&WorkerPool, usize, Sqe),
    ) -> Enqueued {
        // Count the task before checking `closing` (the arena-gate habit):
        // close sets `closing`, then waits for the count, so a task that
        // got past the check always runs on live workers. This is a Dekker
        // handshake (each side writes its flag, then reads the other's), so
        // it needs SeqCst: with Release / Acquire both sides could miss the
        // other's write (store-load reordering) and a task would be pushed
        // to workers that `close` is already stopping.
        // ORDERING: SeqCst — publishes "a submit is under way" before we
        // read `closing`; pairs with the SeqCst store of `closing` and the
        // SeqCst loads of `inflight` in `close`.
        self.inflight[kind.idx()].fetch_add(1, Ordering::SeqCst);
        // Undone unless the task was handed to the workers: on a refusal,
        // and on a panic inside `record_and_push` too (else `close` would
        // wait for it forever).
        let mut undo = UndoInflight(&self.inflight[kind.idx()], true);
        // ORDERING: SeqCst — the read half of the handshake above; pairs
        // with the SeqCst store in `close` / `request_close`.
        let r = if self.closing.load(Ordering::SeqCst) {
            Err((EngineError::Closing, i))
        } else {
            self.record_and_push(kind, i, rr, push)
        };
        undo.1 = r.is_err();
        r
    }

    fn record_and_push(
        &self,
        kind: TaskKind,
        i: Inputs,
        mut rr: Option<&mut usize>,
        mut push: impl FnMut(&WorkerPool, usize, Sqe),
    ) -> Enqueued {
        // A borrow, not a counted reference: no shared reference count is
        // written per submit (`close` waits for `inflight` first, and its
        // `swap` turns any borrow left into a counted reference).
        let workers = self.workers.load();
        let Some(workers) = workers.as_ref() else {
            return Err((EngineError::Closing, i));
        };
        let pool = &workers[kind.idx()];
        // Any free record; refused only when every record holds a task in
        // flight or a result not yet collected.
        // A record may wait only for its store completion entry to be
        // popped (its result already taken by id): pop the store rings once
        // and look again, so a caller that only ever waits by id is never
        // refused with nothing in flight.
        let claimed = self.tasks.claim().or_else(|| {
            self.harvest_stores(None);
            self.tasks.claim()
        });
        let Some((record, id)) = claimed else {
            let capacity = self.tasks.len();
            return Err((EngineError::TooManyInFlight { capacity }, i));
        };
        let n = i.keys.len();
        let workers = pool.shared.len();
        // Parts: a store or load of many keys is spread over the pool's
        // workers (lookups stay whole: one batched probe per device).
        let per = if kind != TaskKind::Lookup && workers > 1 && n >= 2 * SPLIT_MIN_KEYS {
            n.div_ceil(workers).max(SPLIT_MIN_KEYS)
        } else {
            n.max(1)
        };
        let nparts = n.div_ceil(per).max(1);
        let slot = self.tasks.slot_at(record as usize);
        let filled = slot.rec.fill(move |rec| {
            rec.reset(id, kind, n, nparts);
            rec.keys = i.keys;
            rec.srcs = i.srcs;
            if let Some(d) = i.dsts {
                rec.dsts.lend(d);
            }
        });
        if filled.is_none() {
            // A record is freed only after its mailbox is emptied (`take`
            // stores 0 before `release`), so a claimed record is empty.
            self.tasks.unclaim(record);
            unreachable!("claimed task record {record} was not empty");
        }
        for p in 0..nparts {
            let start = p * per;
            let e = Sqe {
                task: id,
                start: start as u32,
                len: per.min(n - start.min(n)) as u32,
            };
            let w = match rr.as_deref_mut() {
                // A submitter's own counter: no shared write per part.
                Some(own) => {
                    let next = *own % workers;
                    *own = own.wrapping_add(1);
                    next
                }
                // ORDERING: Relaxed — round-robin spreading only.
                None => pool.rr.fetch_add(1, Ordering::Relaxed) % workers,
            };
            push(pool, w, e);
        }
        Ok(TaskId(id))
    }
}

/// Takes back a submit's `inflight` count when dropped armed (see
/// `enqueue_with`).
struct UndoInflight<'a>(&'a AtomicUsize, bool);

impl Drop for UndoInflight<'_> {
    fn drop(&mut self) {
        if self.1 {
            // ORDERING: Release — a refused (or panicked) submit touched
            // nothing `close` must wait for; Release keeps the count a
            // release sequence for `close`'s loads; pairs with `close`.
            self.0.fetch_sub(1, Ordering::Release);
        }
    }
}

/// Push one entry and publish it, waking the worker if it asked. The SQ
/// holds `task_slots` entries, more than can be in flight, so it is never
/// full for long: a full ring is retried (bounded by the worker draining it).
fn push_sqe(sq: &mut Producer<Sqe>, wake: &EventFd, mut e: Sqe) {
    loop {
        match sq.push(e) {
            Ok(()) => break,
            Err(PushError::Full(back)) => {
                e = back;
                if sq.sync() {
                    let _ = wake.notify();
                }
                std::thread::yield_now();
            }
            Err(PushError::Corrupt(c)) => unreachable!("in-process ring corrupt: {c}"),
        }
    }
    if sq.sync() {
        let _ = wake.notify();
    }
}

/// Lock-free submission for one thread (see [`Engine::submitter`]).
/// Owned: `Send + 'static`, not `Sync`.
pub struct Submitter {
    inner: Arc<Inner>,
    /// Per kind, one ring to each worker.
    sqs: [Vec<Producer<Sqe>>; 3],
    /// Per kind, this submitter's round-robin position over the workers.
    rr: [usize; 3],
}

impl std::fmt::Debug for Submitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Submitter").finish_non_exhaustive()
    }
}

impl Submitter {
    fn submit(&mut self, kind: TaskKind, i: Inputs) -> Enqueued {
        let sqs = &mut self.sqs[kind.idx()];
        let rr = &mut self.rr[kind.idx()];
        self.inner.enqueue_with(kind, i, Some(rr), |pool, w, e| {
            push_sqe(&mut sqs[w], &pool.wakes[w], e);
        })
    }

    /// [`Engine::submit_store`], without a lock.
    pub fn submit_store(
        &mut self,
        keys: Vec<Key>,
        bufs: Vec<Buf>,
    ) -> Result<TaskId, Refused<Vec<Buf>>> {
        store_refused(store_inputs(keys, bufs).and_then(|i| self.submit(TaskKind::Store, i)))
    }

    /// [`Engine::submit_lookup_and_lock`], without a lock.
    pub fn submit_lookup_and_lock(&mut self, keys: Vec<Key>) -> Result<TaskId, Refused<()>> {
        lookup_refused(self.submit(TaskKind::Lookup, lookup_inputs(keys)))
    }

    /// [`Engine::submit_load`], without a lock.
    pub fn submit_load(
        &mut self,
        keys: Vec<Key>,
        bufs: Vec<Vec<u8>>,
    ) -> Result<TaskId, Refused<Vec<Vec<u8>>>> {
        load_refused(
            load_inputs(keys, Dsts::Owned(bufs)).and_then(|i| self.submit(TaskKind::Load, i)),
        )
    }

    /// [`Engine::submit_load_raw`], on this thread's rings.
    pub fn submit_load_raw(
        &mut self,
        keys: Vec<Key>,
        bufs: Vec<RawBuf>,
    ) -> Result<TaskId, Refused<Vec<RawBuf>>> {
        load_raw_refused(
            load_inputs(keys, Dsts::Raw(bufs)).and_then(|i| self.submit(TaskKind::Load, i)),
        )
    }
}
