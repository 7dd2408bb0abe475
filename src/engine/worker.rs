//! # Workers: one pool per task kind, each worker a loop over its queues
//!
//! Each worker consumes one shared queue (the `&self` submit methods) plus
//! one SPSC ring per [`Submitter`](super::Submitter) (polled round-robin),
//! runs the task parts it pops, and produces one completion ring. An idle
//! worker spins for `spin`, then sets NEED_WAKEUP on all its queues and
//! sleeps on its own eventfd, which a submitter writes only when that flag
//! is set.
//!
//! A part runs against the device pool: a store part places each key under
//! its claim ([`store_one`]); a lookup part asks each readable device in
//! one batch for the keys still missing; a load part copies from each
//! readable device in one arena session. The last part to finish tells the
//! listeners, lets go of the record, then publishes: done id (Release) →
//! completion entry → in-flight count → eventfd.
//!
//! A panic inside a task part fails that task (all keys false), is logged
//! and counted in `status().worker_panics`, and the worker keeps serving.
//! A panic inside a listener is logged and counted in
//! `status().listener_panics`; the task is published as it finished.

#![forbid(unsafe_code)]

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use super::answer::TaskKind;
use super::pool::{lock_lookup, store_one, Device, Stored, SESSION_DEVICES, STORE_ROUNDS_MAX};
use super::task::{TaskRec, TaskSlot};
use super::{panic_message, EngineError, Inner, Signal};
use crate::device::core::Session;
use crate::host::numa::affinity::{format_cpulist, last_cpu};
use crate::key::Key;
use crate::plumbing::notify::EventFd;
use crate::plumbing::ring::{Consumer, Cqe, Producer, PushError, Ring, Sqe};
use crate::sync::spin_pause;

/// Keys a worker's lookup scratch holds without growing.
const SCRATCH_KEYS: usize = 4096;

std::thread_local! {
    /// On an engine worker thread: the address of its engine's `Inner`
    /// (0 elsewhere). `close` and `drop` on a worker of their own engine
    /// (a listener calling them) must not wait for that worker.
    pub(super) static WORKER_OF: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Submission rings a worker has not adopted yet (from new `Submitter`s).
#[derive(Default)]
pub(super) struct Inbox {
    pub(super) pending: Mutex<Vec<Consumer<Sqe>>>,
    pub(super) has_new: AtomicBool,
}

/// The workers of one task kind, and what submitters and waiters need of
/// them. Dropped (closing its eventfds) by `close` once nobody uses it.
pub(super) struct WorkerPool {
    name: &'static str,
    /// Per worker, the queue the shared `&self` submit methods push to.
    pub(super) shared: Vec<Arc<SharedSq>>,
    pub(super) inboxes: Vec<Arc<Inbox>>,
    pub(super) ring_capacity: u32,
    pub(super) wakes: Vec<Arc<EventFd>>,
    /// `wait_*` callers about to park on `fd` (with `Signal::WhenWaiting`
    /// workers signal only while this is non-zero).
    pub(super) waiters: Arc<AtomicUsize>,
    /// The kind's completion eventfd.
    pub(super) fd: Arc<EventFd>,
    /// Round-robin cursor over the workers.
    pub(super) rr: AtomicUsize,
    /// Task parts each worker has run (status; shows how work spread).
    pub(super) parts: Vec<Arc<AtomicU64>>,
    /// Where each worker was placed (read back by the worker itself).
    placed: Vec<Placed>,
    handles: Mutex<Vec<JoinHandle<()>>>,
}
/// Start `n` workers of kind `class`. Returns the pool and the consumer
/// ends of its completion rings (kept by the engine: results outlive the
/// workers).
pub(super) fn start_pool(
    inner: &Arc<Inner>,
    class: TaskKind,
    n: usize,
) -> Result<(WorkerPool, Vec<Consumer<Cqe>>), EngineError> {
    let name = match class {
        TaskKind::Store => "daxkv-store",
        TaskKind::Lookup => "daxkv-lookup",
        TaskKind::Load => "daxkv-load",
    };
    let fd = Arc::new(EventFd::new().map_err(EngineError::EventFd)?);
    let waiters = Arc::new(AtomicUsize::new(0));
    let cap = (inner.opts.task_slots as u32)
        .next_power_of_two()
        .clamp(64, crate::plumbing::ring::CAPACITY_MAX);
    let mut shareds = Vec::new();
    let mut parts = Vec::new();
    let mut inboxes = Vec::new();
    let mut wakes = Vec::new();
    let mut cqs = Vec::new();
    let mut handles = Vec::new();
    // This pool's first metrics shard: workers are numbered store, lookup,
    // load (`Metrics::new` gets their total).
    let shard_base = match class {
        TaskKind::Store => 0,
        TaskKind::Lookup => inner.opts.num_store_workers,
        TaskKind::Load => inner.opts.num_store_workers + inner.opts.num_lookup_workers,
    };
    // Workers report once placed (with where they run), so `open` returns
    // with placement done.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<(usize, Placed)>();
    for w in 0..n {
        let shared = Arc::new(SharedSq::new(cap as usize));
        let (cq_p, cq_c) = Ring::<Cqe>::heap(cap)
            .expect("power-of-two capacity")
            .split();
        let wake = Arc::new(EventFd::new().map_err(EngineError::EventFd)?);
        let inbox = Arc::new(Inbox::default());
        let ran = Arc::new(AtomicU64::new(0));
        let ctx = WorkerCtx {
            inner: inner.clone(),
            shared: shared.clone(),
            parts: ran.clone(),
            sqs: Vec::new(),
            cursor: 0,
            inbox: inbox.clone(),
            cq: cq_p,
            wake: wake.clone(),
            done_fd: fd.clone(),
            waiters: waiters.clone(),
            name: format!("{name}-{w}"),
            class,
            shard: shard_base + w,
            scratch: Scratch::with_capacity(SCRATCH_KEYS),
        };
        let ready = ready_tx.clone();
        let mask = inner.cpu_plan.mask(w);
        let h = std::thread::Builder::new()
            .name(ctx.name.clone())
            .spawn(move || {
                let _ = ready.send((w, place_self(&ctx.name, mask)));
                worker_loop(ctx);
            })
            .map_err(EngineError::Spawn)?;
        shareds.push(shared);
        parts.push(ran);
        inboxes.push(inbox);
        wakes.push(wake);
        cqs.push(cq_c);
        handles.push(h);
    }
    // Only the workers hold senders now: a worker that died before
    // reporting ends the wait instead of hanging it.
    drop(ready_tx);
    let mut placed: Vec<Option<Placed>> = vec![None; n];
    for _ in 0..n {
        match ready_rx.recv() {
            Ok((w, p)) => placed[w] = Some(p),
            Err(_) => break,
        }
    }
    let pool = WorkerPool {
        name,
        shared: shareds,
        inboxes,
        ring_capacity: cap,
        wakes,
        waiters,
        fd,
        rr: AtomicUsize::new(0),
        parts,
        placed: placed.into_iter().flatten().collect(),
        handles: Mutex::new(handles),
    };
    Ok((pool, cqs))
}

impl WorkerPool {
    /// Where each worker runs: as placed, with the CPU it last ran on
    /// read now.
    pub(super) fn placement(&self) -> impl Iterator<Item = WorkerPlacement> + '_ {
        self.placed.iter().map(|p| WorkerPlacement {
            name: p.name.clone(),
            tid: p.tid,
            mask: p.mask.clone(),
            cpus: p.cpus.clone(),
            last_cpu: last_cpu(p.tid),
            error: p.error.clone(),
        })
    }

    /// Let the workers go without joining them (the engine dropped on one
    /// of its own workers).
    pub(super) fn detach(&self) {
        self.handles
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

/// Wake every worker of `p` and join them (they exit once `stop` is set).
pub(super) fn stop_pool(p: &WorkerPool) {
    for w in &p.wakes {
        let _ = w.notify();
    }
    for h in std::mem::take(&mut *p.handles.lock().unwrap_or_else(PoisonError::into_inner)) {
        if h.join().is_err() {
            log_line!("daxkv: a {} worker exited by panic", p.name);
        }
    }
}

struct WorkerCtx {
    inner: Arc<Inner>,
    /// The queue of the shared `&self` submit methods.
    shared: Arc<SharedSq>,
    /// One SPSC ring per `Submitter`.
    sqs: Vec<Consumer<Sqe>>,
    /// Parts run (status).
    parts: Arc<AtomicU64>,
    /// Where the next pop starts (round-robin over the shared queue, then
    /// `sqs`, so no submitter starves another).
    cursor: usize,
    inbox: Arc<Inbox>,
    cq: Producer<Cqe>,
    wake: Arc<EventFd>,
    done_fd: Arc<EventFd>,
    waiters: Arc<AtomicUsize>,
    name: String,
    /// The pool's task kind.
    class: TaskKind,
    /// Its metrics shard (only this worker writes it).
    shard: usize,
    /// Scratch for batched lookups, sized at start-up (grown only by a task
    /// larger than any before), so a worker allocates nothing per task.
    scratch: Scratch,
}

#[derive(Default)]
struct Scratch {
    left: Vec<usize>,
    keys: Vec<Key>,
    hits: Vec<bool>,
}

impl Scratch {
    fn with_capacity(n: usize) -> Scratch {
        Scratch {
            left: Vec::with_capacity(n),
            keys: Vec::with_capacity(n),
            hits: Vec::with_capacity(n),
        }
    }
}

/// Where one worker runs ([`crate::engine::Engine::worker_placement`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerPlacement {
    /// The thread's name (`daxkv-store-0`).
    pub name: String,
    /// Its kernel thread id.
    pub tid: i32,
    /// The mask it set (`host::numa::affinity::CpuPlan::mask`); `None`: it kept
    /// the opening thread's.
    pub mask: Option<Vec<usize>>,
    /// Its CPUs, read back with `sched_getaffinity` by the worker itself
    /// once placed.
    pub cpus: Vec<usize>,
    /// The CPU it last ran on (`/proc/self/task/<tid>/stat`), read when
    /// asked; `None` if unreadable.
    pub last_cpu: Option<usize>,
    /// Why setting `mask` failed, if it did.
    pub error: Option<String>,
}

impl WorkerPlacement {
    /// As `status()["numa"]["workers"]` lists it.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.name,
            "tid": self.tid,
            "mask": self.mask,
            "cpus": self.cpus,
            "last_cpu": self.last_cpu,
            "error": self.error,
        })
    }
}

/// A worker's placement as it read it back at start.
#[derive(Clone, Debug)]
struct Placed {
    name: String,
    tid: i32,
    mask: Option<Vec<usize>>,
    cpus: Vec<usize>,
    error: Option<String>,
}

/// Set the calling worker's mask (directly: `sched_setaffinity` takes any
/// CPU of the process's cpuset, whatever the mask this thread inherited)
/// and read back where it may run. A failure is logged and reported, and
/// the worker runs on where it is.
fn place_self(name: &str, mask: Option<Vec<usize>>) -> Placed {
    let error = mask.as_deref().and_then(|m| {
        crate::host::sys::set_thread_cpus(m)
            .err()
            .map(|e| format!("could not set its CPUs to {}: {e}", format_cpulist(m)))
    });
    let cpus = crate::host::sys::thread_cpus().unwrap_or_default();
    if let Some(e) = &error {
        log_line!(
            "daxkv: worker placement: {name}: {e}; it runs on CPUs {}",
            format_cpulist(&cpus)
        );
    }
    Placed {
        name: name.to_string(),
        tid: crate::host::sys::gettid(),
        mask,
        cpus,
        error,
    }
}

/// The shared submission queue of one worker: bounded lock-free MPMC
/// (`&self` submitters from any thread, one consuming worker; a push is a
/// CAS and allocates nothing) with the ring's NEED_WAKEUP handshake.
pub(super) struct SharedSq {
    pub(super) q: ArrayQueue<Sqe>,
    /// Set by the worker before it sleeps (see `worker_loop`).
    pub(super) need_wakeup: AtomicBool,
}

impl SharedSq {
    /// An empty queue of `cap` entries.
    pub(super) fn new(cap: usize) -> SharedSq {
        SharedSq {
            q: ArrayQueue::new(cap),
            need_wakeup: AtomicBool::new(false),
        }
    }

    /// Push and wake the worker if it asked. The queue holds `task_slots`
    /// entries, more than can be in flight, so it is never full for long.
    pub(super) fn push(&self, wake: &EventFd, mut e: Sqe) {
        while let Err(back) = self.q.push(e) {
            e = back;
            let _ = wake.notify();
            std::thread::yield_now();
        }
        // ORDERING: SeqCst fence — the Dekker pair of the worker's fence
        // between setting `need_wakeup` and re-checking the queue (the
        // ring module's sleep / wake argument).
        fence(Ordering::SeqCst);
        // ORDERING: Relaxed — ordered by the fence above.
        if self.need_wakeup.load(Ordering::Relaxed) {
            let _ = wake.notify();
        }
    }
}

fn worker_loop(mut w: WorkerCtx) {
    WORKER_OF.with(|c| c.set(Arc::as_ptr(&w.inner) as usize));
    loop {
        // ORDERING: Acquire — pairs with the Release in `Engine::submitter`.
        if w.inbox.has_new.load(Ordering::Acquire) {
            w.adopt();
        }
        if let Some(sqe) = w.pop_any() {
            w.run(sqe);
            continue;
        }
        for sq in &mut w.sqs {
            sq.sync();
        }
        // ORDERING: Acquire — observes `close`'s Release store (made once
        // nothing is in flight); pairs with `Engine::close`.
        if w.inner.stop.load(Ordering::Acquire) {
            return;
        }
        // Spin, then park on our eventfd.
        let start = Instant::now();
        let mut got = false;
        let mut spins = 0u32;
        while start.elapsed() < w.inner.opts.spin {
            // ORDERING: Relaxed — only ends the spin early; the checks at
            // the top of the loop are the ones that act.
            if !w.shared.q.is_empty()
                || w.sqs.iter_mut().any(|sq| sq.available().unwrap_or(0) > 0)
                || w.inner.stop.load(Ordering::Relaxed)
                || w.inbox.has_new.load(Ordering::Relaxed)
            {
                got = true;
                break;
            }
            spin_pause(&mut spins);
        }
        if got {
            continue;
        }
        // Arm every queue; sleep only if all are still empty.
        // ORDERING: Relaxed — ordered by the SeqCst fence below: the sleep
        // / wake (Dekker) handshake with `SharedSq::push`, which pushes,
        // fences, then reads this flag: either it sees the flag and writes
        // our eventfd, or we see its entry below and do not sleep.
        w.shared.need_wakeup.store(true, Ordering::Relaxed);
        // ORDERING: SeqCst fence — see above; pairs with the fence in
        // `SharedSq::push`.
        fence(Ordering::SeqCst);
        let mut empty = w.shared.q.is_empty();
        for sq in &mut w.sqs {
            empty &= sq.prepare_wait().unwrap_or(false);
        }
        if empty {
            let woken = w.wake.wait(Duration::from_millis(100));
            let _ = w.wake.drain();
            if matches!(woken, Ok(false)) {
                // An idle tick (nothing came for 100 ms): tell the
                // listeners about a device that failed meanwhile
                // (`super::failed`), if no status or health check has.
                w.inner.report_failed_devices();
            }
        }
        // ORDERING: Relaxed — clearing only saves a submitter an eventfd
        // write; one that still sees the flag makes a spurious (coalesced)
        // wake-up.
        w.shared.need_wakeup.store(false, Ordering::Relaxed);
        for sq in &mut w.sqs {
            sq.end_wait();
        }
    }
}

impl WorkerCtx {
    /// Take the rings of new submitters; drop rings whose submitter is
    /// gone and which are drained.
    fn adopt(&mut self) {
        let mut pending = self
            .inbox
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // ORDERING: Relaxed — under the inbox mutex, which orders it with
        // `Engine::submitter`'s push and Release store.
        self.inbox.has_new.store(false, Ordering::Relaxed);
        self.sqs.append(&mut pending);
        drop(pending);
        let mut i = 0;
        while i < self.sqs.len() {
            // A ring whose producer is gone and which is drained is dropped.
            // `is_orphaned` reads the producer's CLOSED flag (Acquire; set
            // with Release after its last publish) before `tail`, and is
            // true only with nothing left to pop (see its contract).
            if self.sqs[i].is_orphaned() {
                self.sqs.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// The next entry from any queue, round-robin (position 0 is the
    /// shared queue, then the submitters' rings).
    fn pop_any(&mut self) -> Option<Sqe> {
        let n = self.sqs.len() + 1;
        for k in 0..n {
            let i = (self.cursor + k) % n;
            let got = if i == 0 {
                self.shared.q.pop()
            } else {
                match self.sqs[i - 1].pop() {
                    Ok(e) => e,
                    Err(e) => {
                        log_line!("daxkv: {}: submission ring {i}: {e}", self.name);
                        None
                    }
                }
            };
            if got.is_some() {
                self.cursor = i + 1;
                return got;
            }
        }
        None
    }

    fn run(&mut self, sqe: Sqe) {
        let inner = self.inner.clone();
        // Validate everything read from the ring before use.
        let Some(slot) = inner.tasks.slot(sqe.task) else {
            log_line!("daxkv: {}: SQE for unknown task {}", self.name, sqe.task);
            return;
        };
        let Some(task) = slot.rec.read().filter(|t| t.id == sqe.task) else {
            log_line!("daxkv: {}: SQE for unknown task {}", self.name, sqe.task);
            return;
        };
        let (start, len) = (sqe.start as usize, sqe.len as usize);
        if start
            .checked_add(len)
            .is_none_or(|end| end > task.keys.len())
        {
            log_line!(
                "daxkv: {}: SQE range {start}+{len} outside task {}",
                self.name,
                sqe.task
            );
            return;
        }
        // ORDERING: Relaxed — a statistic.
        self.parts.fetch_add(1, Ordering::Relaxed);
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| self.run_part(&task, start, len)));
        if let Err(p) = r {
            log_line!(
                "daxkv: {} panicked in task {}: {}; the task fails",
                self.name,
                task.id,
                panic_message(&*p)
            );
            // ORDERING: Release — ordered before our AcqRel countdown
            // below, through which the last part (and, via `done`, the
            // collector) observes it; pairs with the Acquire in `ok_count`
            // / `bitmap`.
            task.panicked.store(true, Ordering::Release);
            // ORDERING: Relaxed — a statistic.
            inner.panics.fetch_add(1, Ordering::Relaxed);
        }
        // ORDERING: AcqRel — the last part sees every part's result bits.
        let last = task.parts_left.fetch_sub(1, Ordering::AcqRel) == 1;
        let fin = last.then(|| self.finish(&task));
        // Let go of the record before publishing: a collector that sees
        // the task done can take it at once, without waiting for us.
        drop(task);
        if let Some((cqe, done)) = fin {
            self.publish(slot, cqe, &done);
        }
    }

    fn run_part(&mut self, task: &TaskRec, start: usize, len: usize) {
        let inner = &self.inner;
        let devs = inner.pool.snapshot();
        let keys = &task.keys[start..start + len];
        if let Some(bad) = inner.opts.panic_on_key {
            assert!(!keys.contains(&bad), "injected panic");
        }
        #[cfg(feature = "failpoints")]
        inner.faults.worker_panic_point();
        match task.kind {
            TaskKind::Store => store_part(inner, &devs, task, start, len),
            TaskKind::Lookup => {
                let Scratch {
                    left,
                    keys: batch,
                    hits,
                } = &mut self.scratch;
                lock_lookup(&devs, keys, left, batch, hits, |i| task.set(start + i));
            }
            TaskKind::Load => {
                // Parts cover disjoint index ranges; the claim checks it (a
                // duplicated part gets `None` and loads nothing).
                let Some(mut dsts) = task.dsts.claim(start, len) else {
                    return;
                };
                // Device by device, one arena session each, over the keys
                // not found yet (the result bits say which).
                for d in devs.iter().filter(|d| d.state().is_readable()) {
                    let Some(mut sess) = d.core().session() else {
                        continue;
                    };
                    let mut missing = false;
                    for (i, k) in keys.iter().enumerate() {
                        if task.is_set(start + i) {
                            continue;
                        }
                        if d.core().remap_pending() && i > 0 {
                            // Let a pending remap in instead of holding it
                            // off for the rest of a long part: re-entering
                            // waits for it.
                            drop(sess);
                            let Some(again) = d.core().session() else {
                                missing = true;
                                break;
                            };
                            sess = again;
                        }
                        if let Some(n) = sess.load_into(*k, dsts.get_mut(i)) {
                            task.set_loaded(start + i, n);
                        } else {
                            missing = true;
                        }
                    }
                    if !missing {
                        break;
                    }
                }
            }
        }
    }

    /// The last part is done: tell the listeners, and build the CQE and
    /// what the metrics need of the record.
    fn finish(&mut self, task: &TaskRec) -> (Cqe, Finished) {
        let ok = task.ok_count();
        // Tell the listeners before publishing, so a caller that sees the
        // result also sees the events. (Nothing is built when no listener
        // is registered: the common embedded case allocates nothing here.)
        // A listener that panics is isolated like a task part: logged,
        // counted, the task still published.
        let has_listeners = !self.inner.listeners.load().is_empty();
        if ok > 0 && has_listeners && task.kind != TaskKind::Lookup {
            let bitmap = task.bitmap();
            let hits: Vec<Key> = task
                .keys
                .iter()
                .enumerate()
                .filter(|(i, _)| bitmap.test(*i))
                .map(|(_, k)| *k)
                .collect();
            match task.kind {
                TaskKind::Store => {
                    let sizes = vec![self.inner.slot_bytes; hits.len()];
                    self.inner
                        .tell_listeners("on_keys_stored", |l| l.on_keys_stored(&hits, &sizes));
                }
                TaskKind::Load => self
                    .inner
                    .tell_listeners("on_keys_accessed", |l| l.on_keys_accessed(&hits)),
                TaskKind::Lookup => {}
            }
        }
        let cqe = Cqe {
            task: task.id,
            ok: u32::from(ok == task.keys.len()),
            keys_ok: ok as u32,
        };
        let done = Finished {
            keys: task.keys.len(),
            ok,
            bytes: task.ok_bytes(),
            submitted: task.submitted,
        };
        (cqe, done)
    }

    /// Publish a finished task: metrics, done id, CQE, in-flight count,
    /// eventfd.
    fn publish(&mut self, slot: &TaskSlot, cqe: Cqe, done: &Finished) {
        let op = self.class;
        // Before the done id: a collector that sees the task done sees it
        // counted (metrics module doc).
        self.inner.metrics.record_task(
            self.shard,
            op,
            done.keys,
            done.ok,
            done.bytes,
            done.submitted.elapsed(),
        );
        // ORDERING: Release — publishes the result bits, the destination
        // bytes and our guard's release to `TaskTable::take`'s Acquire.
        slot.done.store(cqe.task, Ordering::Release);
        if op == TaskKind::Store {
            // A store's CQE is its only report: never dropped. It always
            // fits: each unreleased entry of this ring belongs to a record
            // still taken, and collectors release ring space before they
            // free records (`records` module doc), so entries ≤ records ≤
            // capacity. The loop is that argument's safety net, bounded by
            // the collector's next pop.
            let mut e = cqe;
            let mut spins = 0u32;
            loop {
                match self.cq.push(e) {
                    Ok(()) => break,
                    Err(PushError::Full(back)) => {
                        // Not a panic (it would kill this worker and leave
                        // the task in flight forever): say it once, wait
                        // for the collector.
                        if spins == 0 {
                            log_line!(
                                "daxkv: bug: store completion ring full (records invariant); waiting for the collector"
                            );
                        }
                        e = back;
                        self.cq.sync();
                        spin_pause(&mut spins);
                    }
                    Err(PushError::Corrupt(c)) => unreachable!("in-process ring corrupt: {c}"),
                }
            }
        } else {
            // Lookup / load CQEs only wake a collector (the done id is the
            // result), so one that meets a full ring is not needed.
            let _ = self.cq.push(cqe);
        }
        self.cq.sync();
        // ORDERING: Release — our publication (done id, CQE) happens
        // before `close` sees the count reach zero and stops the workers;
        // pairs with the SeqCst (hence Acquire) loads in `Engine::close`.
        self.inner.inflight[op.idx()].fetch_sub(1, Ordering::Release);
        let wake = match self.inner.opts.signal {
            Signal::Always => true,
            Signal::WhenWaiting => {
                // ORDERING: SeqCst fence — sleep / wake (Dekker) handshake
                // with `Engine::wait`: either we see its `waiters` count, or
                // it sees our done id (and the CQE) before it sleeps; pairs
                // with the fence in `Engine::wait`.
                fence(Ordering::SeqCst);
                // ORDERING: Relaxed — ordered by the fence above. An fd
                // handed out counts as a waiter for good (its poller is
                // not counted in `waiters`): the flag was set before the
                // task was submitted, so this load sees it.
                self.waiters.load(Ordering::Relaxed) > 0
                    || self.inner.fd_pollers[op.idx()].load(Ordering::Relaxed)
            }
        };
        if wake {
            // ORDERING: Relaxed — a statistic.
            self.inner.signals[op.idx()].fetch_add(1, Ordering::Relaxed);
            let _ = self.done_fd.notify();
        }
    }
}

/// What `publish` records of a finished task (read from its record in
/// `finish`, before the record is let go of).
struct Finished {
    keys: usize,
    ok: usize,
    bytes: u64,
    submitted: Instant,
}

/// Run a store part: its keys one by one under one arena session per
/// device (the first few), each stored under its key's claim; a pending
/// remap is let in between keys (sessions dropped, the remap waited for
/// claim-free, sessions reopened).
fn store_part(
    inner: &Inner,
    devs: &Arc<Vec<Arc<Device>>>,
    task: &TaskRec,
    start: usize,
    len: usize,
) {
    let keys = &task.keys[start..start + len];
    let mut i = 0;
    let mut rounds = 0;
    while i < len {
        // One arena session per device for the whole part (the
        // first few devices; others enter per key), opened
        // while this worker holds no claim: waiting here for a
        // pending remap is fine (parent module doc, "Key ownership").
        let sessions: [Option<Session<'_>>; SESSION_DEVICES] =
            std::array::from_fn(|d| devs.get(d).and_then(|d| d.core().session()));
        let mut blocked = None;
        let round_start = i;
        while i < len {
            // A remap pending on a device this part holds a
            // session on waits for the part: let it in between
            // keys instead (drop the sessions, wait, reopen),
            // after at least one key per round so a remapper
            // that never pauses cannot starve the part either.
            if i > round_start {
                if let Some(d) = sessions
                    .iter()
                    .position(|s| s.as_ref().is_some_and(Session::remap_pending))
                {
                    blocked = Some((devs[d].clone(), false));
                    break;
                }
            }
            let src = task.srcs[start + i].as_slice();
            match store_one(&inner.pool, devs, &sessions, keys[i], src) {
                Stored::Yes => task.set(start + i),
                Stored::No => {}
                Stored::WouldWait(dev) => {
                    blocked = Some((dev, true));
                    break;
                }
            }
            i += 1;
        }
        drop(sessions);
        if let Some((dev, no_progress)) = blocked {
            // Only rounds that stored nothing count towards the
            // bound (a key that keeps meeting remaps fails).
            rounds += usize::from(no_progress);
            if rounds > STORE_ROUNDS_MAX {
                break; // the rest of the part fails
            }
            // Claim-free now: wait for the device's remap here
            // (entering waits for it), then go on.
            drop(dev.core().session());
        }
    }
}
