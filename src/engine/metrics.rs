//! # Metrics: counters and histograms recorded on the data path
//!
//! The engine counts, per op class ([`Op`]: `store`, `lookup`, `load` —
//! tasks, recorded by the worker that publishes them; `lookup` also
//! [`Engine::exists_counted`] calls, recorded on the caller — and
//! `unlock`, `delete` — calls, recorded on the caller):
//!
//! - ops: tasks (or calls);
//! - keys by result: `ok` and `miss_or_fail`;
//! - bytes: store — the payload bytes of the keys stored (a key already in
//!   the pool counts: the task succeeded for it); load — the payload bytes
//!   loaded (the per-key lengths in the task record);
//! - task duration, submit (record filled) to publish, as a histogram with
//!   fixed log-spaced buckets ([`DURATION_BUCKETS`], 1 µs … 10 s, one
//!   atomic per bucket, plus `+Inf`);
//!
//! and, per engine, worker panics, listener panics and hotplug operations
//! by operation and outcome ([`HotplugOp`] × [`HotplugOutcome`], recorded
//! by the control plane through [`Engine::record_hotplug`]).
//!
//! ## No lock, no allocation, no shared cache line
//!
//! Every counter is an `AtomicU64` written with Relaxed ordering. They
//! live in shards ([`Metrics`]), one cache-padded shard per worker and
//! [`CALLER_SHARDS`] more for callers (`submit_unlock`, `delete_into`; a
//! thread picks one on its first call, round-robin, through a `const`
//! thread-local: no allocation). A worker is its shard's only writer, so
//! its increments are a Relaxed load and store (no locked RMW; the line
//! stays in that core's cache); callers share theirs, so theirs are
//! Relaxed `fetch_add`s. A scrape ([`Engine::metrics`]) sums the shards;
//! it is the only reader. Recording a task costs five or six plain
//! loads / stores on a line the worker owns plus a bucket search, and the
//! two `Instant::now()` reads (at submit and at publish) — the clock is
//! the larger part (docs/performance.md, "Metrics on the data path").
//!
//! Relaxed is enough: the counters order nothing. A caller that collected
//! a task's result sees that task counted, because the worker records
//! before its Release store of the done id, which the collector's Acquire
//! load observes (write-read coherence then makes the scrape's loads see
//! the increments).
//!
//! ## Why not `prometheus-client` on the data path
//!
//! Measured (benches/metrics.rs; numbers in docs/performance.md, "Metrics on the data path"): its
//! `Counter` is a Relaxed `fetch_add` on one atomic shared by every
//! thread that records it (a contended line across workers), its
//! `Family` lookup takes an `RwLock` and hashes the labels, and its
//! `Histogram::observe` takes a `Mutex` — a lock on the data path, which
//! the engine does not take (engine module doc). So the counters are the
//! engine's own atomics and the text is encoded by hand at scrape time
//! ([`crate::control::metrics`]); `prometheus-client` is only a dev-dependency, the
//! baseline of that bench.

#![forbid(unsafe_code)]

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use super::answer::TaskKind;
use super::Engine;
use crate::key::Key;

/// Upper bounds (`le`, seconds) of the task-duration histogram buckets:
/// 1-2.5-5 steps per decade from 1 µs to 10 s; a `+Inf` bucket follows.
pub const DURATION_BUCKETS: [f64; BUCKETS] = [
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
    5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Finite buckets of the duration histogram.
const BUCKETS: usize = 22;

/// [`DURATION_BUCKETS`] in nanoseconds (what the data path compares).
const BUCKET_NS: [u64; BUCKETS] = [
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// Caller shards (for `submit_unlock` and `delete_into`, which run on the
/// calling thread).
pub const CALLER_SHARDS: usize = 8;

/// An op class: the three task kinds, and the two calls that run on the
/// caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Store tasks.
    Store,
    /// Lookup-and-lock tasks.
    Lookup,
    /// Load tasks.
    Load,
    /// `submit_unlock` calls (every key counts as `ok`: unlock never
    /// fails; a key not locked is left as it is).
    Unlock,
    /// `delete` / `delete_into` calls (`ok` = keys deleted).
    Delete,
}

impl Op {
    /// Every op class, in index order.
    pub const ALL: [Op; 5] = [Op::Store, Op::Lookup, Op::Load, Op::Unlock, Op::Delete];

    /// Lower-case name (the `op` label).
    pub fn name(self) -> &'static str {
        match self {
            Op::Store => "store",
            Op::Lookup => "lookup",
            Op::Load => "load",
            Op::Unlock => "unlock",
            Op::Delete => "delete",
        }
    }

    /// The op class of a task kind.
    pub fn of(kind: TaskKind) -> Op {
        match kind {
            TaskKind::Store => Op::Store,
            TaskKind::Lookup => Op::Lookup,
            TaskKind::Load => Op::Load,
        }
    }

    /// Its index in [`Op::ALL`] (and in [`MetricsSnapshot`]'s arrays).
    pub fn idx(self) -> usize {
        self as usize
    }
}

/// A hotplug operation (the `operation` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HotplugOp {
    /// Add a device.
    Add,
    /// Remove a device.
    Remove,
    /// Resize a device's mapping.
    Resize,
    /// Drain a device.
    Drain,
}

impl HotplugOp {
    /// Every operation, in index order.
    pub const ALL: [HotplugOp; 4] = [
        HotplugOp::Add,
        HotplugOp::Remove,
        HotplugOp::Resize,
        HotplugOp::Drain,
    ];

    /// Lower-case name (the label value).
    pub fn name(self) -> &'static str {
        match self {
            HotplugOp::Add => "add",
            HotplugOp::Remove => "remove",
            HotplugOp::Resize => "resize",
            HotplugOp::Drain => "drain",
        }
    }

    /// The operation named `name` (as [`HotplugOp::name`] spells it).
    pub fn from_name(name: &str) -> Option<HotplugOp> {
        HotplugOp::ALL.into_iter().find(|o| o.name() == name)
    }
}

/// How a hotplug operation ended (the `outcome` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HotplugOutcome {
    /// Done.
    Ok,
    /// Refused before anything changed (bad request, wrong state, closing).
    Rejected,
    /// Began and failed.
    Failed,
}

impl HotplugOutcome {
    /// Every outcome, in index order.
    pub const ALL: [HotplugOutcome; 3] = [
        HotplugOutcome::Ok,
        HotplugOutcome::Rejected,
        HotplugOutcome::Failed,
    ];

    /// Lower-case name (the label value).
    pub fn name(self) -> &'static str {
        match self {
            HotplugOutcome::Ok => "ok",
            HotplugOutcome::Rejected => "rejected",
            HotplugOutcome::Failed => "failed",
        }
    }

    /// The outcome named `name` (as [`HotplugOutcome::name`] spells it).
    pub fn from_name(name: &str) -> Option<HotplugOutcome> {
        HotplugOutcome::ALL.into_iter().find(|o| o.name() == name)
    }
}

/// One duration histogram: a count per bucket (not cumulative; the last
/// is `+Inf`) and the sum in nanoseconds.
#[derive(Default)]
struct Hist {
    buckets: [AtomicU64; BUCKETS + 1],
    sum_ns: AtomicU64,
}

/// The counters one thread (a worker, or the callers sharing a caller
/// shard) writes.
#[derive(Default)]
struct Shard {
    ops: [AtomicU64; 5],
    keys_ok: [AtomicU64; 5],
    keys_miss: [AtomicU64; 5],
    bytes: [AtomicU64; 5],
    /// Task durations, per task kind.
    hist: [Hist; 3],
}

/// Add `n` to `a`. `SOLE`: the calling thread is the only one that ever
/// writes `a` (a worker on its own shard), so a Relaxed load and store is
/// an exact increment without the locked read-modify-write (measured: the
/// RMW is most of the recording cost, benches/metrics.rs); otherwise a
/// Relaxed `fetch_add`. Zero adds nothing (the common `miss_or_fail` and
/// lookup `bytes`).
// ORDERING: Relaxed — statistics; they order nothing (module doc: the
// collector's Acquire of the done id makes a collected task's increments
// visible to a later scrape).
#[inline]
fn add<const SOLE: bool>(a: &AtomicU64, n: u64) {
    if n == 0 {
        return;
    }
    if SOLE {
        a.store(a.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    } else {
        a.fetch_add(n, Ordering::Relaxed);
    }
}

impl Shard {
    #[inline]
    fn count<const SOLE: bool>(&self, op: Op, keys: usize, ok: usize, bytes: u64) {
        let i = op.idx();
        add::<SOLE>(&self.ops[i], 1);
        add::<SOLE>(&self.keys_ok[i], ok as u64);
        add::<SOLE>(&self.keys_miss[i], keys.saturating_sub(ok) as u64);
        add::<SOLE>(&self.bytes[i], bytes);
    }

    #[inline]
    fn observe<const SOLE: bool>(&self, kind: TaskKind, elapsed: Duration) {
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let h = &self.hist[kind.idx()];
        add::<SOLE>(&h.buckets[BUCKET_NS.partition_point(|&b| b < ns)], 1);
        add::<SOLE>(&h.sum_ns, ns);
    }
}

std::thread_local! {
    /// This thread's caller shard (`usize::MAX` until its first call).
    static CALLER: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// Hands caller shards out round-robin.
static NEXT_CALLER: AtomicUsize = AtomicUsize::new(0);

fn caller_index() -> usize {
    CALLER.with(|c| {
        let mut v = c.get();
        if v == usize::MAX {
            // ORDERING: Relaxed — spreads threads over shards only.
            v = NEXT_CALLER.fetch_add(1, Ordering::Relaxed) % CALLER_SHARDS;
            c.set(v);
        }
        v
    })
}

/// An engine's counters (module doc): one cache-padded shard per worker
/// plus [`CALLER_SHARDS`] for callers, and the hotplug counts. Allocated
/// once, at `Engine::open`; recording allocates nothing and takes no lock.
/// Public so that the recording cost can be benchmarked on its own
/// (benches/metrics.rs); an engine's are read with [`Engine::metrics`].
pub struct Metrics {
    /// Worker shards first (`workers` of them), then the caller shards.
    shards: Box<[CachePadded<Shard>]>,
    workers: usize,
    /// `[operation][outcome]` (cold path: one shared line is fine).
    hotplug: [[AtomicU64; 3]; 4],
    /// Per task kind, collectors that found the completion rings' lock
    /// held by another collector ([`Contention`]). Written only on a miss.
    cq_lock_misses: [AtomicU64; 3],
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("workers", &self.workers)
            .finish_non_exhaustive()
    }
}

impl Metrics {
    /// Counters for `workers` worker shards (numbered from 0) plus the
    /// caller shards, all zero.
    pub fn new(workers: usize) -> Metrics {
        Metrics {
            shards: (0..workers + CALLER_SHARDS)
                .map(|_| CachePadded::new(Shard::default()))
                .collect(),
            workers,
            hotplug: Default::default(),
            cq_lock_misses: Default::default(),
        }
    }

    /// A collector of `kind` found the completion rings' lock held.
    #[inline]
    pub(super) fn record_cq_lock_miss(&self, kind: TaskKind) {
        // ORDERING: Relaxed — a statistic.
        self.cq_lock_misses[kind.idx()].fetch_add(1, Ordering::Relaxed);
    }

    /// Record a finished task on worker shard `worker`: `keys` keys of
    /// which `ok` succeeded, `bytes` payload bytes moved, `elapsed` from
    /// submit to publish.
    ///
    /// A worker shard has one writer: only one thread may ever record on
    /// shard `worker` (each engine worker has its own). Two threads
    /// recording on one shard lose increments (never memory-unsafe: the
    /// counters are atomics written without a read-modify-write). A shard
    /// out of range records on a caller shard (with `fetch_add`).
    #[inline]
    pub fn record_task(
        &self,
        worker: usize,
        kind: TaskKind,
        keys: usize,
        ok: usize,
        bytes: u64,
        elapsed: Duration,
    ) {
        if worker < self.workers {
            let s = &self.shards[worker];
            s.count::<true>(Op::of(kind), keys, ok, bytes);
            s.observe::<true>(kind, elapsed);
        } else {
            let s = self.caller_shard();
            s.count::<false>(Op::of(kind), keys, ok, bytes);
            s.observe::<false>(kind, elapsed);
        }
    }

    /// Record a call that ran on the caller (`Unlock`, `Delete`): `keys`
    /// keys of which `ok` succeeded.
    #[inline]
    pub fn record_call(&self, op: Op, keys: usize, ok: usize) {
        self.caller_shard().count::<false>(op, keys, ok, 0);
    }

    /// Count one hotplug operation's outcome.
    pub fn record_hotplug(&self, op: HotplugOp, outcome: HotplugOutcome) {
        // ORDERING: Relaxed — a statistic.
        self.hotplug[op as usize][outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn caller_shard(&self) -> &Shard {
        &self.shards[self.workers + caller_index()]
    }

    /// The sums over every shard now (each counter read once, Relaxed:
    /// counters recorded concurrently may or may not be in it).
    pub fn snapshot(&self) -> MetricsSnapshot {
        let mut m = MetricsSnapshot::default();
        // ORDERING: Relaxed — statistics (module doc).
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        for s in &*self.shards {
            for i in 0..5 {
                m.ops[i] += get(&s.ops[i]);
                m.keys_ok[i] += get(&s.keys_ok[i]);
                m.keys_miss_or_fail[i] += get(&s.keys_miss[i]);
                m.bytes[i] += get(&s.bytes[i]);
            }
            for (h, sh) in m.durations.iter_mut().zip(&s.hist) {
                for (b, sb) in h.buckets.iter_mut().zip(&sh.buckets) {
                    *b += get(sb);
                }
                h.sum_ns += get(&sh.sum_ns);
            }
        }
        for (o, so) in m.hotplug.iter_mut().zip(&self.hotplug) {
            for (c, sc) in o.iter_mut().zip(so) {
                *c = get(sc);
            }
        }
        m
    }
}

/// A task-duration histogram, summed over the shards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HistogramSnapshot {
    /// Observations per bucket, not cumulative: `buckets[i]` counts the
    /// durations in `(DURATION_BUCKETS[i-1], DURATION_BUCKETS[i]]`; the
    /// last entry counts those above 10 s (`+Inf`).
    pub buckets: [u64; BUCKETS + 1],
    /// Sum of the observations, nanoseconds.
    pub sum_ns: u64,
}

impl HistogramSnapshot {
    /// Observations (the `+Inf` cumulative bucket).
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Sum of the observations, seconds.
    pub fn sum_seconds(&self) -> f64 {
        self.sum_ns as f64 / 1e9
    }

    /// Cumulative counts, as Prometheus's `_bucket{le}` series: one per
    /// [`DURATION_BUCKETS`] entry, then `+Inf` (equal to [`count`](Self::count)).
    pub fn cumulative(&self) -> [u64; BUCKETS + 1] {
        let mut out = self.buckets;
        for i in 1..out.len() {
            out[i] += out[i - 1];
        }
        out
    }
}

/// An engine's counters summed at one moment ([`Engine::metrics`]). Arrays
/// indexed by [`Op::idx`] (ops, keys, bytes), by task kind (durations) and
/// by `[HotplugOp as usize][HotplugOutcome as usize]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MetricsSnapshot {
    /// Tasks (store, lookup, load) or calls (unlock, delete).
    pub ops: [u64; 5],
    /// Keys that succeeded.
    pub keys_ok: [u64; 5],
    /// Keys that missed or failed.
    pub keys_miss_or_fail: [u64; 5],
    /// Payload bytes (store: of the keys stored; load: loaded; 0 for the
    /// others).
    pub bytes: [u64; 5],
    /// Task durations (submit to publish), per task kind.
    pub durations: [HistogramSnapshot; 3],
    /// Hotplug operations by operation and outcome.
    pub hotplug: [[u64; 3]; 4],
    /// Task parts that panicked (`status().worker_panics`).
    pub worker_panics: u64,
    /// Listener calls that panicked (`status().listener_panics`).
    pub listener_panics: u64,
}

impl MetricsSnapshot {
    /// The same numbers as JSON (`status()["metrics"]`): per op `ops`,
    /// `keys_ok`, `keys_miss_or_fail`, `bytes`; per task kind
    /// `duration_count` and `duration_sum_seconds`; `hotplug` as
    /// `{operation: {outcome: n}}`.
    pub fn to_json(&self) -> serde_json::Value {
        let per_op = |v: &[u64; 5]| -> serde_json::Value {
            Op::ALL
                .iter()
                .map(|o| (o.name().to_string(), v[o.idx()].into()))
                .collect::<serde_json::Map<_, _>>()
                .into()
        };
        let per_kind = |f: &dyn Fn(&HistogramSnapshot) -> serde_json::Value| -> serde_json::Value {
            [TaskKind::Store, TaskKind::Lookup, TaskKind::Load]
                .iter()
                .map(|k| (k.name().to_string(), f(&self.durations[k.idx()])))
                .collect::<serde_json::Map<_, _>>()
                .into()
        };
        let hotplug: serde_json::Map<_, _> = HotplugOp::ALL
            .iter()
            .map(|o| {
                let outcomes: serde_json::Map<_, _> = HotplugOutcome::ALL
                    .iter()
                    .map(|r| {
                        (
                            r.name().to_string(),
                            self.hotplug[*o as usize][*r as usize].into(),
                        )
                    })
                    .collect();
                (o.name().to_string(), outcomes.into())
            })
            .collect();
        serde_json::json!({
            "ops": per_op(&self.ops),
            "keys_ok": per_op(&self.keys_ok),
            "keys_miss_or_fail": per_op(&self.keys_miss_or_fail),
            "bytes": per_op(&self.bytes),
            "duration_count": per_kind(&|h| h.count().into()),
            "duration_sum_seconds": per_kind(&|h| h.sum_seconds().into()),
            "hotplug": hotplug,
            "worker_panics": self.worker_panics,
            "listener_panics": self.listener_panics,
        })
    }
}

/// Where submitters and collectors met each other on a shared structure,
/// counted since the engine opened ([`Engine::contention`]). These are the
/// only points of the submit and collect paths where one thread's
/// operation fails because of another's and is retried or skipped; every
/// other shared word they write is a single read-modify-write that always
/// succeeds (docs/performance.md, "Many submitters"). Each counter is
/// written only when the event happens, so an uncontended run adds no
/// shared write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Contention {
    /// Record claims that lost a bit of the task table's free set to
    /// another submitter and looked again.
    pub record_claim_retries: u64,
    /// Per task kind (store, lookup, load), collectors that found the
    /// completion rings' lock held by another and skipped the drain (they
    /// then look at their own record only: nobody waits on the lock).
    pub completion_lock_misses: [u64; 3],
}

impl Contention {
    /// What happened between `earlier` and `self`.
    #[must_use]
    pub fn since(&self, earlier: &Contention) -> Contention {
        let mut m = [0; 3];
        for (i, v) in m.iter_mut().enumerate() {
            *v = self.completion_lock_misses[i].saturating_sub(earlier.completion_lock_misses[i]);
        }
        Contention {
            record_claim_retries: self
                .record_claim_retries
                .saturating_sub(earlier.record_claim_retries),
            completion_lock_misses: m,
        }
    }
}

impl Engine {
    /// The contention counters now ([`Contention`]; a racy snapshot).
    pub fn contention(&self) -> Contention {
        // ORDERING: Relaxed — statistics.
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let m = &self.inner.metrics.cq_lock_misses;
        Contention {
            record_claim_retries: self.inner.tasks.claim_retries(),
            completion_lock_misses: [get(&m[0]), get(&m[1]), get(&m[2])],
        }
    }

    /// The engine's counters summed now (a scrape; cold path). Encoded as
    /// Prometheus text by the control plane (`control::metrics::encode`).
    pub fn metrics(&self) -> MetricsSnapshot {
        let mut m = self.inner.metrics.snapshot();
        // ORDERING: Relaxed — statistics.
        m.worker_panics = self.inner.panics.load(Ordering::Relaxed);
        m.listener_panics = self.inner.listener_panics.load(Ordering::Relaxed);
        m
    }

    /// Count one hotplug operation's outcome
    /// (`daxkv_hotplug_operations_total{operation,outcome}`). For the
    /// control plane: call once per add / remove / resize / drain request,
    /// with how it ended.
    pub fn record_hotplug(&self, op: HotplugOp, outcome: HotplugOutcome) {
        self.inner.metrics.record_hotplug(op, outcome);
    }

    /// [`Engine::exists`], counted as a lookup (`op="lookup"`: one op, its
    /// keys by hit / miss, its duration), on a caller shard. For clients
    /// whose lookups are these calls, such as LMCache's native-connector
    /// bridge (python/README.md); [`Engine::exists`] itself is not
    /// counted, as bindings also call it for their own bookkeeping.
    pub fn exists_counted(&self, keys: &[Key]) -> Vec<bool> {
        let start = Instant::now();
        let mut out = vec![false; keys.len()];
        let hits = self.exists_into(keys, &mut out);
        // `usize::MAX` is no worker's shard: a caller shard records it.
        self.inner.metrics.record_task(
            usize::MAX,
            TaskKind::Lookup,
            keys.len(),
            hits,
            0,
            start.elapsed(),
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_agree_and_bucketing_is_le() {
        for (s, ns) in DURATION_BUCKETS.iter().zip(BUCKET_NS) {
            assert_eq!((s * 1e9).round() as u64, ns);
        }
        let m = Metrics::new(1);
        for ns in [0, 1_000, 1_001, 10_000_000_000, 10_000_000_001] {
            m.record_task(0, TaskKind::Load, 1, 1, 0, Duration::from_nanos(ns));
        }
        let h = m.snapshot().durations[TaskKind::Load.idx()];
        assert_eq!(h.buckets[0], 2, "0 and 1 µs are ≤ 1 µs");
        assert_eq!(h.buckets[1], 1);
        assert_eq!(h.buckets[BUCKETS - 1], 1, "10 s is ≤ 10 s");
        assert_eq!(h.buckets[BUCKETS], 1, "above 10 s is +Inf only");
        assert_eq!(h.count(), 5);
        assert_eq!(h.cumulative()[BUCKETS], 5);
    }

    #[test]
    fn shards_sum() {
        let m = Metrics::new(2);
        m.record_task(0, TaskKind::Store, 2, 2, 2000, Duration::from_micros(3));
        m.record_task(1, TaskKind::Store, 2, 1, 1000, Duration::from_micros(3));
        m.record_task(7, TaskKind::Store, 2, 0, 0, Duration::from_micros(3));
        m.record_call(Op::Delete, 4, 3);
        m.record_hotplug(HotplugOp::Resize, HotplugOutcome::Rejected);
        let s = m.snapshot();
        assert_eq!(s.ops[Op::Store.idx()], 3);
        assert_eq!(s.keys_ok[Op::Store.idx()], 3);
        assert_eq!(s.keys_miss_or_fail[Op::Store.idx()], 3);
        assert_eq!(s.bytes[Op::Store.idx()], 3000);
        assert_eq!(s.ops[Op::Delete.idx()], 1);
        assert_eq!(s.keys_miss_or_fail[Op::Delete.idx()], 1);
        assert_eq!(s.hotplug[2][1], 1);
        assert_eq!(s.durations[0].sum_ns, 9000);
        assert_eq!(HotplugOp::from_name("drain"), Some(HotplugOp::Drain));
        assert_eq!(HotplugOutcome::from_name("nope"), None);
    }
}
