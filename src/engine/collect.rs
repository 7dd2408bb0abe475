//! # Collecting results: how a caller takes what a task hands back
//!
//! A finished task's result stays in its record until one caller takes it.
//! Three ways to take it, all lock-free for the caller (nobody waits on a
//! lock: the completion rings of a class are drained by whoever wins a
//! `try_lock`, and a caller that loses simply looks at the records):
//!
//! - **by id**: [`Engine::query_store`] / [`Engine::query_lookup`] /
//!   [`Engine::query_load`] answer at once; the `wait_*` forms spin, then
//!   park on the class's eventfd. Each answers with an [`Answer`]: ready,
//!   pending, unknown id, wrong kind, or closed.
//! - **all finished stores** ([`Engine::pop_completed_stores`], LMCache's
//!   contract): every store result not yet taken, each exactly once.
//! - Mixing the two for stores is allowed: each result goes to whoever
//!   takes it first (so a thread waiting by id for a store that another
//!   thread's global pop took gets [`Answer::Unknown`]). A server picks one
//!   style per engine.
//!
//! After [`Engine::close`] every result of a task that `close` waited for
//! can still be taken, and a waiter returns at once: with its result, or
//! [`Answer::Closed`] for a task that will never finish (only an engine
//! dropped on its own worker thread leaves such tasks).

#![forbid(unsafe_code)]

use std::sync::atomic::{fence, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use super::answer::{Answer, Bitmap, LoadResult, StoreResult, TaskId, TaskKind};
use super::records::pop_released;
use super::{Engine, Inner, Signal};
use crate::plumbing::ring::{Consumer, Cqe};
use crate::sync::spin_pause;

/// Completions a collector pops (and hands the ring space back for) before
/// it frees their records; on the stack, so collecting allocates nothing.
const POP_BATCH: usize = 32;

/// `Closed` for a task still pending when the engine had already stopped
/// before the answer was read (`stopped` is loaded *before* the take: a
/// task that finished while `close` ran is `Ready`, never `Closed`).
fn closed_if_pending<T>(a: Answer<T>, stopped: bool) -> Answer<T> {
    if stopped && a.is_pending() {
        Answer::Closed
    } else {
        a
    }
}

impl Inner {
    /// Whether `close` has stopped the workers.
    pub(super) fn stopped(&self) -> bool {
        // ORDERING: Acquire — pairs with the Release store of `stop` in
        // `close` (everything finished before it is visible).
        self.stop.load(Ordering::Acquire)
    }

    /// Take store `id`'s result out of its record.
    pub(super) fn take_store(&self, id: u64) -> Answer<StoreResult> {
        let slot_bytes = self.slot_bytes as u64;
        let record = self.tasks.record_of(id);
        self.tasks.take(id, TaskKind::Store, |rec| {
            // Unmark while the record is still ours: once `take` frees it,
            // a mark for the record's next task must not be erased (that
            // task's result would never be delivered).
            self.ready.unmark(record);
            let ok = rec.ok_count();
            let n = rec.keys.len();
            rec.clear();
            StoreResult {
                success: ok == n,
                bytes_transferred: ok as u64 * slot_bytes,
            }
        })
    }

    /// Pop the store completion rings (if no other thread is popping them)
    /// and hand the ring space back, then mark each popped task harvested
    /// (`records` module doc). With `out` (the global pop), take each
    /// popped result and every result another caller's harvest left
    /// marked, appending them; without (a caller waiting by id), leave the
    /// results in their records, marked for the global pop. Returns how
    /// many were appended.
    pub(super) fn harvest_stores(&self, out: Option<&mut Vec<(TaskId, StoreResult)>>) -> usize {
        let Some(cqs) = try_lock(&self.cqs[TaskKind::Store.idx()]) else {
            self.metrics.record_cq_lock_miss(TaskKind::Store);
            return 0;
        };
        self.harvest_stores_locked(cqs, out)
    }

    /// [`Inner::harvest_stores`] without results, waiting for the rings'
    /// lock: `Engine::close`'s last harvest, once no worker pushes any
    /// more. A `try_lock` there lost to a collector inside its own harvest
    /// (which pops the rings first, then takes results with the lock
    /// held), and an entry pushed after that collector's pop stayed in the
    /// ring, its record counted in use for good (`tests/close_harvest.rs`).
    /// A collector holds the lock for a bounded time (its batch of takes).
    pub(super) fn harvest_stores_waiting(&self) {
        let cqs = self.cqs[TaskKind::Store.idx()]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.harvest_stores_locked(cqs, None);
    }

    fn harvest_stores_locked(
        &self,
        mut cqs: MutexGuard<'_, Vec<Consumer<Cqe>>>,
        mut out: Option<&mut Vec<(TaskId, StoreResult)>>,
    ) -> usize {
        let inner = self;
        let mut got = 0;
        let mut batch = [Cqe {
            task: 0,
            ok: 0,
            keys_ok: 0,
        }; POP_BATCH];
        for cq in cqs.iter_mut() {
            // Pop a batch and hand its ring space back *before* any of the
            // batch's records can be freed: a refilled record's completion
            // then always finds room (`records` module doc).
            loop {
                let (n, err) = pop_released(cq, &mut batch);
                if let Some(e) = err {
                    log_line!("daxkv: store completion ring: {e}");
                }
                for c in &batch[..n] {
                    if let Some(out) = out.as_deref_mut() {
                        if let Answer::Ready(r) = self.take_store(c.task) {
                            out.push((TaskId(c.task), r));
                            got += 1;
                        }
                    }
                    if inner.tasks.harvested(c.task) {
                        inner.ready.mark(inner.tasks.record_of(c.task));
                    }
                }
                if n < POP_BATCH {
                    break;
                }
            }
        }
        if let Some(out) = out {
            inner.ready.drain(|r| {
                // Only a record whose entry was popped: a stale mark must
                // not take a task whose completion is still in a ring.
                if !inner.tasks.is_harvested(r) {
                    return;
                }
                if let Some(id) = inner.tasks.id_at(r) {
                    if let Answer::Ready(res) = self.take_store(id) {
                        out.push((TaskId(id), res));
                        got += 1;
                    }
                }
            });
        }
        got
    }
}

/// Lock `m` if nobody holds it; never waits.
pub(super) fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

impl Engine {
    /// Every finished store task not taken before, each exactly once
    /// (LMCache's `pop_completed_store_tasks`). Allocates the returned
    /// vector; [`Engine::pop_completed_stores_into`] reuses one.
    pub fn pop_completed_stores(&self) -> Vec<(TaskId, StoreResult)> {
        let mut out = Vec::new();
        self.pop_completed_stores_into(&mut out);
        out
    }

    /// Append every finished store task not taken before to `out` (each
    /// exactly once); returns how many were appended. When another thread
    /// is collecting stores at the same moment, this call may append none
    /// (that thread pops the ring; results it does not take stay for the
    /// next call).
    pub fn pop_completed_stores_into(&self, out: &mut Vec<(TaskId, StoreResult)>) -> usize {
        self.inner.harvest_stores(Some(out))
    }

    /// The store result of task `id`, if finished (one-shot).
    pub fn query_store(&self, id: TaskId) -> Answer<StoreResult> {
        let stopped = self.inner.stopped();
        self.inner.harvest_stores(None);
        closed_if_pending(self.inner.take_store(id.0), stopped)
    }

    /// Wait for store `id` (spin for `wait_spin`, then park on the store
    /// eventfd), up to `timeout`. Several threads may each wait for their
    /// own stores; see the module doc for mixing with the global pop.
    pub fn wait_store(&self, id: TaskId, timeout: Duration) -> Answer<StoreResult> {
        self.wait(TaskKind::Store, timeout, || self.query_store(id))
    }

    /// The lookup bitmap once the task is done (one-shot). Allocates
    /// nothing for tasks of up to 256 keys.
    pub fn query_lookup(&self, id: TaskId) -> Answer<Bitmap> {
        let stopped = self.inner.stopped();
        self.drain_cqs(TaskKind::Lookup);
        let a = self.inner.tasks.take(id.0, TaskKind::Lookup, |rec| {
            let b = rec.bitmap();
            rec.clear();
            b
        });
        closed_if_pending(a, stopped)
    }

    /// The load result once done (one-shot, like `query_lookup`). The owned
    /// destinations come back in `bufs` (the caller's vector, moved back),
    /// each key's payload length in `lens`.
    pub fn query_load(&self, id: TaskId) -> Answer<LoadResult> {
        let stopped = self.inner.stopped();
        self.drain_cqs(TaskKind::Load);
        let a = self.inner.tasks.take(id.0, TaskKind::Load, |rec| {
            let bitmap = rec.bitmap();
            let lens = rec.lens();
            let bufs = rec.dsts.take_back();
            rec.clear();
            LoadResult { bitmap, bufs, lens }
        });
        closed_if_pending(a, stopped)
    }

    /// Wait for a lookup: spin for `wait_spin`, then sleep on the eventfd,
    /// up to `timeout` (then `Pending`).
    pub fn wait_lookup(&self, id: TaskId, timeout: Duration) -> Answer<Bitmap> {
        self.wait(TaskKind::Lookup, timeout, || self.query_lookup(id))
    }

    /// Wait for a load (see `wait_lookup`).
    pub fn wait_load(&self, id: TaskId, timeout: Duration) -> Answer<LoadResult> {
        self.wait(TaskKind::Load, timeout, || self.query_load(id))
    }

    /// Wait until at least one store finishes (or `timeout`), then pop
    /// them all (see [`Engine::pop_completed_stores`]).
    pub fn wait_stores(&self, timeout: Duration) -> Vec<(TaskId, StoreResult)> {
        let mut out = Vec::new();
        self.wait_stores_into(&mut out, timeout);
        out
    }

    /// [`Engine::wait_stores`] appending to `out`; returns how many.
    pub fn wait_stores_into(
        &self,
        out: &mut Vec<(TaskId, StoreResult)>,
        timeout: Duration,
    ) -> usize {
        let r = self.wait(TaskKind::Store, timeout, || {
            match self.pop_completed_stores_into(out) {
                0 => Answer::Pending,
                n => Answer::Ready(n),
            }
        });
        r.ready().unwrap_or(0)
    }

    /// Poll until `poll` answers anything but `Pending`: spin for
    /// `wait_spin`, then park on `kind`'s eventfd (re-checking every 50 ms
    /// and on every wake), up to `timeout`.
    fn wait<R>(
        &self,
        kind: TaskKind,
        timeout: Duration,
        mut poll: impl FnMut() -> Answer<R>,
    ) -> Answer<R> {
        let start = Instant::now();
        // Spin first: a cross-vCPU eventfd wake costs 100-200 µs here.
        let mut spins = 0u32;
        while start.elapsed() < self.inner.opts.wait_spin {
            let r = poll();
            if !r.is_pending() {
                return r;
            }
            spin_pause(&mut spins);
        }
        // Holding the workers keeps their eventfds open while we sleep on
        // one: `close` waits for every such holder to let go (waking us
        // until we do) before it drops them, so it closes the fds before it
        // returns and never under a sleeper.
        let Some(workers) = self.inner.workers.load_full() else {
            return poll();
        };
        let pool = &workers[kind.idx()];
        let on_demand = self.inner.opts.signal == Signal::WhenWaiting;
        loop {
            // ORDERING: Acquire — observes `close`'s Release store of
            // `stop` (everything is finished; answer with what is there).
            // A waiter that misses it is woken by `close`, which writes our
            // eventfd until we have let go of the workers; pairs with
            // `close`.
            if self.inner.stop.load(Ordering::Acquire) {
                drop(workers);
                return poll();
            }
            // Announce the wait, then re-check before sleeping: a worker
            // publishes, then checks `waiters` (each side writes, fences,
            // reads the other: no lost wakeup, as in the ring's handshake).
            if on_demand {
                // ORDERING: Relaxed — ordered by the SeqCst fence below,
                // the Dekker pair of the fence in `WorkerCtx::publish`:
                // either that worker sees our count, or we see its done id.
                pool.waiters.fetch_add(1, Ordering::Relaxed);
                // ORDERING: SeqCst fence — sleep / wake handshake (see
                // above); pairs with the fence in `WorkerCtx::publish`.
                fence(Ordering::SeqCst);
            }
            let r = poll();
            if r.is_pending() {
                if let Some(left) = timeout.checked_sub(start.elapsed()) {
                    let _ = pool.fd.wait(left.min(Duration::from_millis(50)));
                }
            }
            if on_demand {
                // ORDERING: Relaxed — leaving only ends wake-ups; a worker
                // that still counts us makes one spurious (coalesced) write.
                pool.waiters.fetch_sub(1, Ordering::Relaxed);
            }
            if !r.is_pending() {
                return r;
            }
            let _ = pool.fd.drain();
            if start.elapsed() >= timeout {
                return poll();
            }
        }
    }

    /// Drain a class's completion rings (lookup and load entries only wake
    /// waiters; the record's `done` id is the result), unless another
    /// thread is draining them now.
    fn drain_cqs(&self, kind: TaskKind) {
        if let Some(mut cqs) = try_lock(&self.inner.cqs[kind.idx()]) {
            for cq in cqs.iter_mut() {
                while let Ok(Some(_)) = cq.pop() {}
                cq.sync();
            }
        } else {
            self.inner.metrics.record_cq_lock_miss(kind);
        }
    }
}

#[cfg(all(test, not(daxkv_loom)))]
mod tests {
    use super::*;
    use crate::device::arena::ArenaSpec;
    use crate::device::core::CoreConfig;
    use crate::engine::{DeviceSpec, EngineError, EngineOptions};
    use crate::key::Key;
    use crate::plumbing::buf::Buf;

    /// A store result taken by id while its completion entry is still in
    /// the ring keeps its record until the entry is popped: freeing it at
    /// the take would let the refilled record's completion meet a ring
    /// still holding the old entry (`records` module doc). Here the
    /// completion rings are held (as by a popper that won the `try_lock`)
    /// while four results are taken by id. With the take freeing the
    /// record at once this fails: 0 records in use, the submit accepted.
    #[test]
    fn a_store_taken_by_id_keeps_its_record_until_its_entry_is_popped() {
        const SLOT: usize = 4096;
        let dev = DeviceSpec {
            path: "memfd".into(),
            core: CoreConfig::new(ArenaSpec::memfd(16 * SLOT), SLOT),
        };
        let opts = EngineOptions {
            task_slots: 4,
            num_store_workers: 1,
            ..EngineOptions::default()
        };
        let e = Engine::open(vec![dev], SLOT, false, opts).unwrap();
        let ids: Vec<TaskId> = (0..4u8)
            .map(|i| {
                let key = Key::digest(&[i]);
                e.submit_store(vec![key], vec![Buf::from(vec![i; 10])])
                    .unwrap()
            })
            .collect();
        while e.status()["inflight_store_tasks"] != 0 {
            std::thread::yield_now();
        }
        let held = e.inner.cqs[TaskKind::Store.idx()].lock().unwrap();
        for &id in &ids {
            assert!(e.query_store(id).ready().unwrap().success);
        }
        assert_eq!(e.inner.tasks.in_use(), 4, "records wait for their entries");
        let refused = e
            .submit_store(vec![Key::digest(b"x")], vec![Buf::from(vec![1u8])])
            .unwrap_err();
        assert!(matches!(refused.error, EngineError::TooManyInFlight { .. }));
        drop(held);
        assert_eq!(e.query_store(ids[0]), Answer::Unknown);
        assert_eq!(e.inner.tasks.in_use(), 0, "popping freed them");
        assert!(
            e.pop_completed_stores().is_empty(),
            "nothing delivered twice"
        );
    }

    /// A collector that finds the completion rings held by another skips
    /// the drain and is counted (`Engine::contention`); one that gets the
    /// lock is not.
    #[test]
    fn a_missed_completion_lock_is_counted() {
        const SLOT: usize = 4096;
        let dev = DeviceSpec {
            path: "memfd".into(),
            core: CoreConfig::new(ArenaSpec::memfd(16 * SLOT), SLOT),
        };
        let e = Engine::open(vec![dev], SLOT, false, EngineOptions::default()).unwrap();
        let before = e.contention();
        let _ = e.query_load(TaskId(0));
        assert_eq!(e.contention(), before, "free lock: nothing counted");
        let held = e.inner.cqs[TaskKind::Load.idx()].lock().unwrap();
        let _ = e.query_load(TaskId(0));
        let _ = e.query_lookup(TaskId(0));
        let d = e.contention().since(&before);
        assert_eq!(d.completion_lock_misses, [0, 0, 1]);
        assert_eq!(d.record_claim_retries, 0);
        drop(held);
    }
}
