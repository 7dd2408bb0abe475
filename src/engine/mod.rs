//! # Engine: rings, worker pools and the device pool (LMCache's MP adapter)
//!
//! ```text
//! submit_*(keys, bufs) ──► fill the task's record (Mailbox) ──► SQE on a worker's queue
//!                                                                   │
//!          worker (store / lookup / load pool) ◄────────────────────┘
//!            read the record, run the part against the device pool, set
//!            result bits, count down the task's parts; the last part lets
//!            go of the record, then publishes: done id (Release) → CQE on
//!            its CQ → eventfd
//!                                                                   │
//! pop_completed_stores / query_lookup / query_load ◄────────────────┘
//!   (take the result out of the record; the record is empty for reuse)
//! ```
//!
//! The API mirrors LMCache's L2 adapter contract
//! (docs/lmcache-dax-behavior.md §1): task ids are one counter shared by
//! all kinds; store results are drained with `pop_completed_stores` (each
//! id exactly once) or taken per task (`wait_store`); lookup and load
//! results are one-shot per id; `submit_unlock` never fails and releases
//! the lock wherever the key is now; three distinct non-blocking close-on-exec eventfds
//! signal completions.
//!
//! ## Where things are
//!
//! Top to bottom, in the order a task travels:
//!
//! | file | what |
//! |---|---|
//! | [`options`](EngineOptions) | worker counts, spinning, table size, signalling |
//! | `submit.rs` | `submit_*`, [`Submitter`], [`Refused`] (inputs handed back) |
//! | `task.rs` | the task table: records, ids, who frees a record |
//! | [`records`] | the free set of records, and why the store rings never overflow |
//! | `worker.rs` | worker pools, the worker loop, running a part, publishing |
//! | `pool.rs` | devices, their states, placement of a key ([`DeviceInfo`]) |
//! | [`claims`] | the key-ownership stripes placement decides under |
//! | [`metrics`](Metrics) | counters and duration histograms recorded on the data path |
//! | `hotplug.rs` | adding, removing, draining and resizing devices at run time |
//! | `answer.rs` | what a caller holds: [`TaskId`], results ([`StoreResult`], [`Bitmap`], [`LoadResult`]), [`Answer`] |
//! | `collect.rs` | taking results: by id, all finished stores, waiting |
//! | `mod.rs` (here) | the [`Engine`] facade: open, status, delete, unlock, close |
//!
//! Dependencies run one way: the JSON config ([`crate::control::config`]) builds
//! engine options and device specs; the engine never reads the config.
//!
//! ## Tasks and parts
//!
//! A task lives in a fixed table of `task_slots` records, allocated at
//! start-up with room for `task_keys` keys and reused
//! ([`crate::plumbing::cell::Mailbox`]: filled by the submitter, read by workers and
//! pollers with a reader count, taken by one collector). A submit takes any
//! free record from a lock-free free set ([`records::RecordSet`]) and the
//! task id names it: `id = (sequence << bits) | record`, so one result left
//! uncollected holds one record, and a submit is refused (`TooManyInFlight`)
//! only when every record is taken. A record is freed once its result is
//! taken, and (for stores) once its completion entry has been popped and
//! the ring space handed back, so a store completion always finds room in
//! its ring ([`records`] module doc). A store or load task of many keys is
//! split into parts of at least [`SPLIT_MIN_KEYS`] keys spread over its
//! pool's workers; the parts write disjoint result bits (and destination
//! buffers), and the task completes once (an atomic countdown).
//!
//! ## No lock and no allocation on the data path
//!
//! After start-up, a task of at most `task_keys` keys allocates nothing
//! inside the engine and takes no lock that anyone waits on, from submit to
//! collection (`tests/alloc_engine.rs` counts allocations on both sides):
//! - submit: an id from a counter, one CAS to fill the record, one push per
//!   part: a CAS on the worker's shared `ArrayQueue` for the `&self`
//!   methods, or a plain store on a [`Submitter`]'s own SPSC ring;
//! - run: the worker reads the record under a counted guard;
//! - collect: result bits are read from the record (inline [`Bitmap`]s up
//!   to 256 keys), the owned buffers moved back; completion rings are
//!   drained by whoever wins a `try_lock` (nobody waits on it);
//!   `*_into` variants fill caller-reused vectors.
//!
//! The mutexes left are on cold paths only: adopting a new submitter's
//! rings, joining workers, and `close`.
//!
//! ## Workers
//!
//! Each worker consumes one shared queue plus one SPSC ring per
//! [`Submitter`] (polled round-robin) and produces one completion ring;
//! tasks go to workers round-robin; an idle worker spins, then parks on its
//! own eventfd (`worker.rs` module doc). A panic in a task part fails that
//! task and the worker keeps serving; `close` called from a listener (on a
//! worker) only requests the close.
//!
//! ## Key ownership (one copy of a key in the pool)
//!
//! The device that holds a key is the one device whose index holds it; the
//! pool never has two. What keeps it so is the pool-wide claim table
//! ([`claims::ClaimTable`]): every decision to *place* a key (a store's
//! choice of device, a migration's move) is made under that key's stripe,
//! and unlocks and deletes take the stripe too, so they are ordered against
//! a move; lookups and loads take none (with one copy there is one hit). A
//! claim holder never waits on an arena: on a pending remap it lets go of
//! the claim, waits, and does the key again. The protocol, step by step
//! for store (`store_one`), lookup, load, unlock ([`Engine::submit_unlock`]),
//! delete (why a key whose store is in flight is skipped) and migration
//! (`hotplug.rs`), with its limits and the tests that check it, is written
//! once, in `docs/key-ownership.md`.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption};

mod answer;
pub mod claims;
mod collect;
mod failed;
#[cfg(feature = "failpoints")]
mod failpoints;
mod hotplug;
#[cfg(all(test, not(daxkv_loom)))]
mod hotplug_interleavings;
mod lease;
mod metrics;
mod observe;
mod options;
mod pool;
pub mod records;
mod submit;
mod task;
mod worker;

pub use answer::{Answer, Bitmap, Lens, LoadResult, StoreResult, TaskId, TaskKind};
#[cfg(feature = "failpoints")]
pub use failpoints::DeviceFaults;
pub use hotplug::{
    check_device_path, check_memfd_name, is_memfd_name, HotplugError, RemoveMode, RemoveReport,
    ResizeReport, ShrinkMode, CREATE_ROOTS, MEMFD_GROW_FACTOR, MEMFD_NAME_MAX,
};
pub use lease::{EngineLeased, EngineReadLease, EngineStoreLease};
pub use metrics::{
    Contention, HistogramSnapshot, HotplugOp, HotplugOutcome, Metrics, MetricsSnapshot, Op,
    CALLER_SHARDS, DURATION_BUCKETS,
};
pub use observe::DeviceObserver;
pub use options::{EngineOptions, Signal};
#[cfg(feature = "test-hooks")]
pub use pool::RawDevice;
pub use pool::{DeviceId, DeviceInfo, DeviceSpec, DeviceState};
pub use submit::{Refused, Submitter, SPLIT_MIN_KEYS};
pub use task::MAX_TABLE_KEYS;

use pool::{DeviceListCache, DevicePool};
use records::ReadySet;
use task::TaskTable;
pub use worker::WorkerPlacement;
use worker::{start_pool, stop_pool, WorkerPool};

use crate::host::numa::affinity::{CpuPlan, ProcessCpus};

use crate::device::error::OpenError;
use crate::key::Key;
use crate::plumbing::ring::{Consumer, Cqe};

/// Callbacks for keys stored, accessed and deleted
/// (docs/lmcache-dax-behavior.md §1.1). Called on worker threads (or the
/// deleting thread, or the thread of an evicting remove or shrink once it
/// has let go of the pool's admin mutex), outside any engine state: a
/// listener may call back into the engine, control plane included; a
/// panic is caught, logged and counted (`status().listener_panics`).
pub trait Listener: Send + Sync {
    /// Keys a store task put in the pool, with their sizes (slot bytes).
    fn on_keys_stored(&self, _keys: &[Key], _sizes: &[usize]) {}
    /// Keys a load task read.
    fn on_keys_accessed(&self, _keys: &[Key]) {}
    /// Keys [`Engine::delete`] removed.
    fn on_keys_deleted(&self, _keys: &[Key]) {}
}

/// Engine errors (cold path, and the reasons of submit refusals).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// `close` has begun: no new tasks or devices.
    #[error("engine is closing")]
    Closing,
    /// A submit with a different number of keys and buffers.
    #[error("{what}: {keys} keys but {bufs} buffers")]
    LengthMismatch {
        /// The submit method.
        what: &'static str,
        /// Keys passed.
        keys: usize,
        /// Buffers passed.
        bufs: usize,
    },
    /// A size or count that must be positive was 0.
    #[error("{field} must be a positive integer (got {value})")]
    Invalid {
        /// The option.
        field: &'static str,
        /// Its value.
        value: usize,
    },
    /// Every task record holds a task in flight or a result not collected.
    #[error("task table full: {capacity} tasks in flight or awaiting collection")]
    TooManyInFlight {
        /// Records in the table (`task_slots`).
        capacity: usize,
    },
    /// No devices and hotplug off.
    #[error("devices may be empty only when hotplug_enabled is true")]
    NoDevices,
    /// `task_slots × task_keys` over [`MAX_TABLE_KEYS`].
    #[error("task_slots × task_keys = {task_slots} × {task_keys} keys of preallocated task records exceeds {max} (16 bytes each)")]
    TableTooLarge {
        /// The option.
        task_slots: usize,
        /// The option.
        task_keys: usize,
        /// The limit.
        max: usize,
    },
    /// One device listed twice in `open`.
    #[error("device {path} is already mapped by this engine")]
    AlreadyMapped {
        /// The second path.
        path: String,
    },
    /// `add_device` of a mapped device at another size.
    #[error("device {path} is already mapped by this engine (device {id}) with {existing_bytes} bytes; cannot add it with {requested_bytes} bytes")]
    SizeConflict {
        /// The path asked for.
        path: String,
        /// The id it is mapped as.
        id: u32,
        /// Its mapped size.
        existing_bytes: usize,
        /// The size asked for.
        requested_bytes: usize,
    },
    /// No device with this id.
    #[error("no device {id} in the pool")]
    NoSuchDevice {
        /// The id asked for.
        id: u32,
    },
    /// A state change the pool does not make.
    #[error("device {id}: cannot change state {from} → {to}")]
    StateChange {
        /// The device.
        id: u32,
        /// Its state.
        from: &'static str,
        /// The state asked for.
        to: &'static str,
    },
    /// A device could not be resized.
    #[error("device {id}: resize: {source}")]
    Resize {
        /// The device.
        id: u32,
        /// Why (the core's error).
        source: crate::device::error::CoreError,
    },
    /// A device failed to open.
    #[error("device {index}: {source}")]
    Device {
        /// Its position (in `open`'s list, or the pool's length for an add).
        index: usize,
        /// Why.
        source: OpenError,
    },
    /// A control call from inside a mapping observer's callback, which
    /// runs under the locks that call takes (`Engine::observe`).
    #[error(
        "called from a mapping observer callback: observers must not call back into the engine"
    )]
    Reentrant,
    /// A worker thread could not be started.
    #[error("cannot start a worker thread: {0}")]
    Spawn(std::io::Error),
    /// An eventfd could not be created.
    #[error("eventfd: {0}")]
    EventFd(std::io::Error),
}

/// The text of a panic payload (empty if it is not a string).
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

/// The engine's state, shared by the facade, [`Submitter`]s and workers.
struct Inner {
    opts: EngineOptions,
    slot_bytes: usize,
    hotplug_enabled: bool,
    pool: DevicePool,
    tasks: TaskTable,
    /// Store records whose completion a by-id waiter popped, result still
    /// inside (`records` module doc): the global pop collects them.
    ready: ReadySet,
    /// The worker pools (store, lookup, load); `None` once closed.
    workers: ArcSwapOption<[WorkerPool; 3]>,
    /// The consumer ends of each kind's completion rings: kept here, not
    /// with the workers, so results outlive `close`.
    cqs: [Mutex<Vec<Consumer<Cqe>>>; 3],
    /// Tasks submitted and not yet finished (close waits for zero).
    inflight: [AtomicUsize; 3],
    /// Set by `close` (or requested by a listener): submits are refused.
    closing: AtomicBool,
    /// Set by `close` once nothing is in flight: workers exit, waiters
    /// return.
    stop: AtomicBool,
    /// Serializes `close`; true once it finished.
    close_lock: Mutex<bool>,
    /// Per kind: its eventfd was handed out (with `Signal::WhenWaiting`,
    /// the poller counts as a waiter for good).
    fd_pollers: [AtomicBool; 3],
    /// Per kind: completion eventfd writes (status).
    signals: [AtomicU64; 3],
    panics: AtomicU64,
    listener_panics: AtomicU64,
    /// Counters recorded on the data path (`metrics.rs`).
    metrics: Metrics,
    listeners: ArcSwap<Vec<Arc<dyn Listener>>>,
    /// The mapping observers (`observe.rs`), given to every device added;
    /// changed only under the pool's admin lock.
    observers: observe::Observers,
    /// The workers' CPU masks (`host::numa::affinity`), made once at open.
    cpu_plan: CpuPlan,
    /// This engine's own fault hooks (the `failpoints` feature).
    #[cfg(feature = "failpoints")]
    faults: failpoints::EngineFaults,
}

impl Inner {
    /// Call every listener with `f`, each isolated like a task part: a
    /// panic is logged and counted (`status().listener_panics`), and the
    /// next listener still runs.
    fn tell_listeners(&self, what: &str, f: impl Fn(&dyn Listener)) {
        for l in self.listeners.load().iter() {
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&**l))) {
                log_line!(
                    "daxkv: a listener panicked in {what}: {}; ignored",
                    panic_message(&*p)
                );
                // ORDERING: Relaxed — a statistic.
                self.listener_panics.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// A closed or removed device in `status()`: its core is gone.
fn tombstone_json(
    index: usize,
    info: &DeviceInfo,
    slot_bytes: usize,
    inflight: &[usize],
) -> serde_json::Value {
    serde_json::json!({
        "index": index,
        "device_id": info.id.0,
        "device_path": info.path,
        "state": info.state.name(),
        "is_healthy": false,
        "max_dax_size_bytes": 0,
        "slot_bytes": slot_bytes,
        "max_slots": 0,
        "live_slot_count": 0,
        "locked_key_count": 0,
        "borrowed_slot_count": 0,
        "active_read_count": 0,
        "active_write_count": 0,
        "lease_count": 0,
        "oldest_lease_age_seconds": null,
        "closing": true,
        "inflight_store_tasks": inflight[0],
        "inflight_lookup_tasks": inflight[1],
        "inflight_load_tasks": inflight[2],
        "supports_restart_recovery": false,
    })
}

/// A device in the pool in `status()`, from its core's status `st` and
/// its `state`, both read once by the caller.
fn live_json(
    index: usize,
    d: &pool::Device,
    state: DeviceState,
    st: &crate::device::core::CoreStatus,
    inflight: &[usize],
) -> serde_json::Value {
    serde_json::json!({
        "index": index,
        "device_id": d.id().0,
        "device_path": d.path(),
        "state": state.name(),
        "is_healthy": st.is_healthy,
        "max_dax_size_bytes": st.max_dax_size_bytes,
        "slot_bytes": st.slot_bytes,
        "max_slots": st.max_slots,
        "live_slot_count": st.live_slot_count,
        "locked_key_count": st.locked_key_count,
        "borrowed_slot_count": st.borrowed_slot_count,
        "active_read_count": st.active_read_count,
        "active_write_count": st.active_write_count,
        "lease_count": st.lease_count,
        "oldest_lease_age_seconds": st.oldest_lease_age.map(|a| a.as_secs_f64()),
        "closing": st.closing,
        "inflight_store_tasks": inflight[0],
        "inflight_lookup_tasks": inflight[1],
        "inflight_load_tasks": inflight[2],
        "supports_restart_recovery": false,
    })
}

/// The engine. `Send + Sync`; all methods take `&self`.
pub struct Engine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").finish_non_exhaustive()
    }
}

impl Engine {
    /// Map the devices and start the worker pools. Any failure releases
    /// everything opened so far. (`crate::control::config::EngineConfig::open` opens
    /// one from LMCache's adapter JSON.)
    pub fn open(
        devices: Vec<DeviceSpec>,
        slot_bytes: usize,
        hotplug_enabled: bool,
        opts: EngineOptions,
    ) -> Result<Engine, EngineError> {
        for (field, v) in [
            ("slot_bytes", slot_bytes),
            ("num_store_workers", opts.num_store_workers),
            ("num_lookup_workers", opts.num_lookup_workers),
            ("num_load_workers", opts.num_load_workers),
            ("task_slots", opts.task_slots),
            ("task_keys", opts.task_keys),
        ] {
            if v == 0 {
                return Err(EngineError::Invalid { field, value: v });
            }
        }
        let keys = opts.task_slots.saturating_mul(opts.task_keys);
        if keys > MAX_TABLE_KEYS {
            return Err(EngineError::TableTooLarge {
                task_slots: opts.task_slots,
                task_keys: opts.task_keys,
                max: MAX_TABLE_KEYS,
            });
        }
        if devices.is_empty() && !hotplug_enabled {
            return Err(EngineError::NoDevices);
        }
        let pool = DevicePool::open(devices, slot_bytes)?;
        // Against the process's set, not this thread's mask: workers
        // inherit the mask of the thread that opens the engine.
        let cpu_plan = CpuPlan::new(&opts.cpus, &ProcessCpus::current());
        for w in &cpu_plan.warnings {
            log_line!("daxkv: worker placement: {w}");
        }
        let inner = Arc::new(Inner {
            slot_bytes,
            hotplug_enabled,
            pool,
            tasks: TaskTable::new(opts.task_slots, opts.task_keys),
            ready: ReadySet::new(opts.task_slots),
            workers: ArcSwapOption::empty(),
            cqs: Default::default(),
            inflight: Default::default(),
            closing: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            close_lock: Mutex::new(false),
            fd_pollers: Default::default(),
            signals: Default::default(),
            panics: AtomicU64::new(0),
            listener_panics: AtomicU64::new(0),
            metrics: Metrics::new(
                opts.num_store_workers + opts.num_lookup_workers + opts.num_load_workers,
            ),
            listeners: ArcSwap::from_pointee(Vec::new()),
            observers: observe::Observers::default(),
            opts,
            cpu_plan,
            #[cfg(feature = "failpoints")]
            faults: failpoints::EngineFaults::default(),
        });
        let started = [
            start_pool(&inner, TaskKind::Store, inner.opts.num_store_workers),
            start_pool(&inner, TaskKind::Lookup, inner.opts.num_lookup_workers),
            start_pool(&inner, TaskKind::Load, inner.opts.num_load_workers),
        ];
        let mut ok = Vec::new();
        let mut err = None;
        for (k, p) in started.into_iter().enumerate() {
            match p {
                Ok((p, cqs)) => {
                    *inner.cqs[k].lock().unwrap_or_else(PoisonError::into_inner) = cqs;
                    ok.push(p);
                }
                Err(e) => err = Some(e),
            }
        }
        if let Some(e) = err {
            // ORDERING: Release — the started workers' Acquire in
            // `worker_loop` sees it and exits; pairs with `worker_loop`.
            inner.stop.store(true, Ordering::Release);
            for p in &ok {
                stop_pool(p);
            }
            inner.pool.close_cores();
            return Err(e);
        }
        let pools: [WorkerPool; 3] = ok
            .try_into()
            .unwrap_or_else(|_| unreachable!("three pools"));
        inner.workers.store(Some(Arc::new(pools)));
        Ok(Engine { inner })
    }

    /// Bytes per slot (the largest payload a key holds).
    pub fn slot_bytes(&self) -> usize {
        self.inner.slot_bytes
    }

    /// The options the engine runs with.
    pub fn options(&self) -> &EngineOptions {
        &self.inner.opts
    }

    /// Where every worker runs (store, lookup, load pools in order): the
    /// mask it set and the CPUs it read back at start, and the CPU it last
    /// ran on, read now. Empty once closed.
    pub fn worker_placement(&self) -> Vec<WorkerPlacement> {
        self.inner
            .workers
            .load()
            .as_ref()
            .map_or_else(Vec::new, |pools| {
                pools.iter().flat_map(WorkerPool::placement).collect()
            })
    }

    /// What did not go as asked when the workers' CPUs were set (CPUs
    /// outside the process's allowed set, a set that could not be read, a
    /// worker whose `sched_setaffinity` failed); each was logged at open.
    /// Also `status()["numa"]["warnings"]`.
    pub fn placement_warnings(&self) -> Vec<String> {
        let mut w = self.inner.cpu_plan.warnings.clone();
        w.extend(
            self.worker_placement()
                .into_iter()
                .filter_map(|p| p.error.map(|e| format!("{}: {e}", p.name))),
        );
        w
    }

    /// Add a listener (called for every later event).
    pub fn register_listener(&self, l: &Arc<dyn Listener>) {
        self.inner.listeners.rcu(|cur| {
            let mut v = Vec::clone(cur);
            v.push(l.clone());
            v
        });
    }

    /// The completion eventfds (store, lookup, load): distinct,
    /// non-blocking, close-on-exec; owned by the engine (do not close
    /// them). -1 after close. With [`Signal::WhenWaiting`] a handed-out
    /// fd's poller counts as a waiter for good (see [`Signal`]).
    pub fn event_fds(&self) -> [i32; 3] {
        [
            self.event_fd(TaskKind::Store),
            self.event_fd(TaskKind::Lookup),
            self.event_fd(TaskKind::Load),
        ]
    }

    /// The completion eventfd of one kind of task (see
    /// [`Engine::event_fds`]).
    pub fn event_fd(&self, kind: TaskKind) -> i32 {
        use std::os::fd::AsRawFd;
        let Some(w) = self.inner.workers.load_full() else {
            return -1;
        };
        let pool = &w[kind.idx()];
        // ORDERING: SeqCst — workers read the flag after their SeqCst
        // fence in `publish`; a task submitted after this call (by any
        // thread) is ordered after it through that fence's total order as
        // well as through the submission's Release / Acquire.
        if !self.inner.fd_pollers[kind.idx()].swap(true, Ordering::SeqCst)
            && self.inner.opts.signal == Signal::WhenWaiting
        {
            // Results finished before the handout were not signalled.
            let _ = pool.fd.notify();
        }
        pool.fd.as_raw_fd()
    }

    /// Write `kind`'s completion eventfd, as a completion would, while the
    /// engine is open; `false` (nothing written) once `close` has begun.
    /// For a binding with results of its own to collect that no task
    /// completion announces (the Python `plugin` adapter's "deleted"
    /// events of a failed device's keys), so its caller's poll wakes.
    ///
    /// The pool is held for the write: `close` drops the pools (closing
    /// their fds) only once no other reference is left, so the number
    /// written is this engine's eventfd, never a file opened after a
    /// racing close got the same number (which writing a raw fd read
    /// earlier from [`Engine::event_fd`] could hit:
    /// `signal_after_close_writes_nothing`).
    pub fn signal(&self, kind: TaskKind) -> bool {
        let Some(w) = self.inner.workers.load_full() else {
            return false;
        };
        w[kind.idx()].fd.notify().is_ok()
    }

    /// The store completion eventfd.
    pub fn store_event_fd(&self) -> i32 {
        self.event_fd(TaskKind::Store)
    }

    /// The lookup completion eventfd.
    pub fn lookup_event_fd(&self) -> i32 {
        self.event_fd(TaskKind::Lookup)
    }

    /// The load completion eventfd.
    pub fn load_event_fd(&self) -> i32 {
        self.event_fd(TaskKind::Load)
    }

    /// Release one lookup lock per key, on whichever device holds the key
    /// now (it may have moved between lookup and unlock). Never fails.
    ///
    /// Each key under its claim, so an unlock never lands inside a move:
    /// a migration holds the claim from the copy on the target until the
    /// source's locks are handed over (`hotplug.rs`, `move_key`), and
    /// outside a claim the key has one copy, which holds every lock.
    /// Without the claim this breaks (docs/key-ownership.md, "Unlock"):
    ///
    /// ```text
    /// reader:    lock K on S ............ unlock: S (gone), T (0 locks): no-op
    /// migration:  put K on T; S: delete, taking 1 lock | ....... T: take 1 lock
    /// → K locked for ever (a later non-forced remove is 409).
    /// reader A:  lock K on S ............. unlock: S 1→0, T 1→0 (B's lock)
    /// reader B:             lock K on T (the new copy)
    /// migration:  put K on T ..................................... S: delete, 0 locks
    /// → B's lock gone; a plain delete removes the key B holds.
    /// ```
    ///
    /// `tests/hotplug_concurrent.rs::unlock_racing_forced_migrations_*` hunts
    /// both, `hotplug_interleavings::an_unlock_never_lands_inside_a_move` pins the
    /// first, `tests/loom_claims.rs` models the hand-over.
    pub fn submit_unlock(&self, keys: &[Key]) {
        let mut devs = self.inner.pool.list_cache();
        for &k in keys {
            self.unlock_one(k, &mut devs);
        }
        self.inner
            .metrics
            .record_call(Op::Unlock, keys.len(), keys.len());
    }

    /// Release one lock on `k` under its claim (see `submit_unlock`). A
    /// claim holder never waits on an arena: on a pending remap it lets go
    /// of the claim, waits for the remap, and does the key again (nothing
    /// was released yet: the first device that releases a lock ends it).
    fn unlock_one(&self, k: Key, devs_now: &mut DeviceListCache<'_>) {
        loop {
            let claim = self.inner.pool.claims.claim(k);
            // Read under the claim (see `DevicePool::list_cache`).
            let devs = devs_now.load();
            let mut busy = None;
            for d in devs.iter() {
                match d.core().try_session() {
                    Ok(s) => {
                        if s.unlock(k) {
                            return;
                        }
                    }
                    Err(crate::device::arena::TryEnterError::Closed) => {}
                    Err(crate::device::arena::TryEnterError::Busy) => {
                        busy = Some(d.clone());
                        break;
                    }
                }
            }
            drop(claim);
            match busy {
                Some(d) => drop(d.core().session()),
                None => return,
            }
        }
    }

    /// Look up `keys` without locking them, on the calling thread: key `i`
    /// is a hit when a readable device holds it committed now (a store in
    /// flight is a miss, as for lookups). No task, no completion, no lock:
    /// the answer may be stale as soon as it returns (a hit can be deleted
    /// or evicted before a later load, which then misses). For callers
    /// whose lookups must not pin keys, such as LMCache's native-connector
    /// bridge, which keeps its locks on its own side and never unlocks in
    /// the engine (python/README.md). Not counted in the metrics
    /// ([`Engine::exists_counted`] is).
    pub fn exists(&self, keys: &[Key]) -> Vec<bool> {
        let mut out = vec![false; keys.len()];
        self.exists_into(keys, &mut out);
        out
    }

    /// [`Engine::exists`] into `out` (as long as `keys`; extra entries are
    /// left as they are); returns the number of hits.
    pub fn exists_into(&self, keys: &[Key], out: &mut [bool]) -> usize {
        let n = keys.len().min(out.len());
        let out = &mut out[..n];
        out.fill(false);
        // ORDERING: Acquire — observes `close`'s store; a racing exists is
        // kept safe by each core's own closing gate (a closed core answers
        // miss); pairs with `request_close`.
        if self.inner.closing.load(Ordering::Acquire) {
            return 0;
        }
        for d in self.inner.pool.list().iter() {
            if !d.state().is_readable() {
                continue;
            }
            d.core().exists_missing_into(&keys[..n], out);
        }
        out.iter().filter(|&&b| b).count()
    }

    /// Look up and lock `keys` on the calling thread, as a lookup task's
    /// worker would ([`Engine::submit_lookup_and_lock`]): key `i` is a hit
    /// when a readable device holds it committed now, and each hit takes
    /// one lock there (release with [`Engine::submit_unlock`]); one batched
    /// call per readable device over the keys still missing. No task, no
    /// completion, no eventfd write: for a binding that completes the
    /// lookup itself (the Python `plugin` adapter), sparing a worker wake
    /// and the completion's round trip for what is index work only.
    /// Counted as one lookup (`op="lookup"`) on a caller shard. After
    /// `close` began: every key misses. Fills `out` (as long as `keys`);
    /// returns the number of hits.
    pub fn lookup_and_lock_into(&self, keys: &[Key], out: &mut [bool]) -> usize {
        let start = std::time::Instant::now();
        let n = keys.len().min(out.len());
        let out = &mut out[..n];
        out.fill(false);
        // ORDERING: Acquire — observes `close`'s store; a lookup racing
        // close is kept safe by each core's own closing gate (a closed
        // core answers miss and locks nothing); pairs with `request_close`.
        if self.inner.closing.load(Ordering::Acquire) {
            return 0;
        }
        let (mut left, mut batch, mut hits) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        pool::lock_lookup(
            &self.inner.pool.list(),
            &keys[..n],
            &mut left,
            &mut batch,
            &mut hits,
            |i| out[i] = true,
        );
        let found = n - left.len();
        // `usize::MAX` is no worker's shard: a caller shard records it.
        self.inner
            .metrics
            .record_task(usize::MAX, TaskKind::Lookup, n, found, 0, start.elapsed());
        found
    }

    /// Delete unlocked, committed keys from every device; returns the keys
    /// deleted (each once) and tells the listeners. Locked keys and keys
    /// whose store is in flight are skipped (not deleted, not returned: a
    /// caller such as LMCache's eviction tries them again later); a key
    /// being moved by a migration is waited for and deleted where it went
    /// (`docs/key-ownership.md`, "Delete").
    pub fn delete(&self, keys: &[Key]) -> Vec<Key> {
        let mut out = Vec::new();
        self.delete_into(keys, &mut out);
        out
    }

    /// [`Engine::delete`] appending the deleted keys to `out` (a reused
    /// vector: nothing is allocated); returns how many.
    pub fn delete_into(&self, keys: &[Key], out: &mut Vec<Key>) -> usize {
        // ORDERING: Acquire — observes `close`'s store (a racing delete
        // is also kept safe by each core's own closing gate); pairs with
        // `request_close`.
        if keys.is_empty() || self.inner.closing.load(Ordering::Acquire) {
            self.inner.metrics.record_call(Op::Delete, keys.len(), 0);
            return 0;
        }
        let before = out.len();
        let mut devs_now = self.inner.pool.list_cache();
        let mut i = 0;
        while i < keys.len() {
            let k = keys[i];
            // Under the key's claim: a migration moving it (which holds the
            // claim from copy to source delete) finishes first, so the
            // delete finds the one copy and cannot be undone by the move.
            // The device list is read under the claim (a key moved to a
            // device added meanwhile is found there).
            // A key whose store is in flight is skipped, like a locked
            // one (docs/key-ownership.md, "Delete": LMCache's eviction
            // retries it next cycle); any other holder (a move, an unlock)
            // is waited for.
            let Some(claim) = self.inner.pool.claims.claim_unless_storing(k) else {
                i += 1;
                continue;
            };
            let devs = devs_now.load();
            let mut hit = false;
            let mut busy = None;
            for d in devs.iter() {
                // A claim holder never waits on an arena (a pending remap
                // may wait for a worker that waits for this claim): enter
                // without waiting, and on a pending remap let go of the
                // claim, wait for the remap, and do the key again.
                match d.core().try_session() {
                    Ok(s) => hit |= s.delete(k, false),
                    Err(crate::device::arena::TryEnterError::Closed) => {}
                    Err(crate::device::arena::TryEnterError::Busy) => {
                        busy = Some(d.clone());
                        break;
                    }
                }
            }
            drop(claim);
            if let Some(d) = busy {
                drop(d.core().session());
                if !hit {
                    continue;
                }
            }
            if hit {
                out.push(k);
            }
            i += 1;
        }
        let deleted = &out[before..];
        self.inner
            .metrics
            .record_call(Op::Delete, keys.len(), deleted.len());
        if !deleted.is_empty() {
            self.inner
                .tell_listeners("on_keys_deleted", |l| l.on_keys_deleted(deleted));
        }
        deleted.len()
    }

    /// `(bytes used, capacity bytes)` over the devices that count capacity,
    /// by slots (docs/lmcache-dax-behavior.md §3.10).
    pub fn usage(&self) -> (u64, u64) {
        self.inner.pool.usage()
    }

    /// Status's `numa`: where the workers were asked to run and where they
    /// run (read back).
    fn placement_json(&self) -> serde_json::Value {
        serde_json::json!({
            "source": self.inner.opts.cpus_source.as_str(),
            "node": self.inner.opts.cpus_node,
            "cpus": self.inner.opts.cpus,
            "process_cpus": self.inner.cpu_plan.process.cpus,
            "process_cpus_source": self.inner.cpu_plan.process.source,
            "warnings": self.placement_warnings(),
            "workers": self.worker_placement().iter().map(WorkerPlacement::to_json).collect::<Vec<_>>(),
        })
    }

    /// The entry of [`status`](Self::status)`()["devices"]` at `index`,
    /// built alone: for a device in the pool without walking the others
    /// (an `add`'s answer stays as fast after thousands of tombstones);
    /// for a tombstone from the list; `None` past the end.
    pub fn device_status(&self, index: usize) -> Option<serde_json::Value> {
        let inflight = self.inflight_counts();
        let live = |d: &pool::Device| live_json(index, d, d.state(), &d.core().status(), &inflight);
        if let Some(d) = self.inner.pool.list().iter().find(|d| d.index() == index) {
            return Some(live(d));
        }
        let entries = self.inner.pool.entries();
        let e = entries.get(index)?;
        Some(match e {
            pool::Entry::Live(d) => live(d),
            pool::Entry::Gone(_) => {
                tombstone_json(index, &e.info(), self.inner.slot_bytes, &inflight)
            }
        })
    }

    /// Tasks in flight per kind (store, lookup, load).
    fn inflight_counts(&self) -> Vec<usize> {
        self.inner
            .inflight
            .iter()
            // ORDERING: Relaxed — a statistic.
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }

    /// Whether the engine can serve: `Err(reason)` while it closes, when a
    /// device that counts capacity reports itself unhealthy, and when no
    /// device can take a store (no device, or every one draining, failed
    /// or closed: zero writable capacity). `Ok(Some(reason))`: it serves,
    /// degraded: a device failed (named in the reason) and the others
    /// serve on (docs/hotplug.md, "Failed devices"). What `/health`
    /// answers (200 `ok` or `degraded`, 503 `unhealthy`); status's
    /// `is_healthy` keeps LMCache's meaning (a pool with no device is
    /// healthy there). Reports a failed device's keys deleted first
    /// ([`Engine::report_failed_devices`]).
    pub fn health(&self) -> Result<Option<String>, String> {
        // ORDERING: Acquire — a snapshot; pairs with `request_close`.
        if self.inner.closing.load(Ordering::Acquire) {
            return Err("shutting down".into());
        }
        self.report_failed_devices();
        let devs = self.inner.pool.list();
        let mut failed = Vec::new();
        for d in devs.iter() {
            let state = d.state();
            if state == DeviceState::Failed {
                failed.push(format!("device {} ({}) failed", d.index(), d.path()));
                continue;
            }
            if state.counts_capacity() && !d.core().status().is_healthy {
                return Err(format!("device {} ({}) is unhealthy", d.index(), d.path()));
            }
        }
        // A resizing device takes stores again once its mapping has its
        // new size, within the drain timeout (a resize that cannot drain
        // fails and restores the state); stores that find no active device
        // meanwhile fail, and LMCache counts them as misses. Not a reason
        // for a probe to pull the server from service.
        let serves = |s: DeviceState| s.is_writable() || s == DeviceState::Resizing;
        if !devs.iter().any(|d| serves(d.state())) {
            if devs.is_empty() {
                return Err("no device can take a store: there is no device (add one)".into());
            }
            // Name what each device is doing instead (a bounded list).
            let mut states: Vec<String> = devs
                .iter()
                .take(4)
                .map(|d| {
                    format!(
                        "device {} ({}) is {}",
                        d.index(),
                        d.path(),
                        d.state().name()
                    )
                })
                .collect();
            if devs.len() > 4 {
                states.push(format!("{} more", devs.len() - 4));
            }
            return Err(format!(
                "no device can take a store: {} (add one)",
                states.join(", ")
            ));
        }
        if failed.is_empty() {
            return Ok(None);
        }
        if failed.len() > 4 {
            let more = failed.len() - 4;
            failed.truncate(4);
            failed.push(format!("{more} more failed"));
        }
        Ok(Some(format!(
            "{}; the other devices serve (remove it)",
            failed.join(", ")
        )))
    }

    /// Status fields (docs/lmcache-dax-behavior.md §3.10), as a JSON value.
    pub fn status(&self) -> serde_json::Value {
        self.report_failed_devices();
        let devs = self.inner.pool.entries();
        // ORDERING: Acquire — a snapshot for status; pairs with
        // `request_close`.
        let closing = self.inner.closing.load(Ordering::Acquire);
        let inflight = self.inflight_counts();
        let mut devices = Vec::new();
        let (mut live, mut locked, mut borrowed) = (0, 0, 0);
        let mut healthy = !closing;
        let mut failed = Vec::new();
        for (i, e) in devs.iter().enumerate() {
            let pool::Entry::Live(d) = e else {
                devices.push(tombstone_json(
                    i,
                    &e.info(),
                    self.inner.slot_bytes,
                    &inflight,
                ));
                continue;
            };
            let st = d.core().status();
            let state = d.state();
            if state.counts_capacity() {
                live += st.live_slot_count;
                locked += st.locked_key_count;
                borrowed += st.borrowed_slot_count;
                healthy &= st.is_healthy;
            }
            // Closed and removed entries are tombstones, not failures
            // (upstream counts them unhealthy forever,
            // docs/lmcache-dax-behavior.md §9.4 item 1); a failed device
            // degrades the pool, which serves on with the others
            // (`degraded`, `failed_devices`; docs/hotplug.md).
            if state == DeviceState::Failed {
                failed.push(i);
            }
            devices.push(live_json(i, d, state, &st, &inflight));
        }
        let (used, cap) = self.usage();
        let parts = |c: usize| -> Vec<u64> {
            self.inner
                .workers
                .load()
                .as_ref()
                .map_or_else(Vec::new, |p| {
                    // ORDERING: Relaxed — statistics.
                    p[c].parts
                        .iter()
                        .map(|n| n.load(Ordering::Relaxed))
                        .collect()
                })
        };
        serde_json::json!({
            "is_healthy": healthy,
            "degraded": !failed.is_empty(),
            "failed_devices": failed,
            "type": "dax",
            "device_path": devs.first().map(|d| d.info().path).unwrap_or_default(),
            "max_dax_size_bytes": cap,
            "total_used_bytes": used,
            "slot_bytes": self.inner.slot_bytes,
            "live_slot_count": live,
            "locked_key_count": locked,
            "borrowed_slot_count": borrowed,
            "inflight_store_tasks": inflight[0],
            "inflight_lookup_tasks": inflight[1],
            "inflight_load_tasks": inflight[2],
            "closing": closing,
            "supports_restart_recovery": false,
            "hotplug_enabled": self.inner.hotplug_enabled,
            // ORDERING: Relaxed — statistics.
            "worker_panics": self.inner.panics.load(Ordering::Relaxed),
            "listener_panics": self.inner.listener_panics.load(Ordering::Relaxed),
            "task_records_in_use": self.inner.tasks.in_use(),
            "signals": {
                // ORDERING: Relaxed — statistics.
                "store": self.inner.signals[0].load(Ordering::Relaxed),
                "lookup": self.inner.signals[1].load(Ordering::Relaxed),
                "load": self.inner.signals[2].load(Ordering::Relaxed),
            },
            "parts_run": {"store": parts(0), "lookup": parts(1), "load": parts(2)},
            "numa": self.placement_json(),
            "num_devices": devs.len(),
            "devices": devices,
            "metrics": self.metrics().to_json(),
        })
    }

    /// Refuse new tasks, wait for the ones in flight, stop the workers,
    /// wake every `wait_*` caller, close the eventfds and every device.
    /// Idempotent. When it returns the fds are closed.
    ///
    /// Called on one of this engine's worker threads (from a listener) it
    /// cannot wait for the task that worker is running: it only *requests*
    /// the close (new submits are refused with [`EngineError::Closing`],
    /// the tasks in flight finish and can be collected), logs that, and
    /// returns; the owner's next `close` (or drop) finishes it.
    pub fn close(&self) {
        if crate::device::arena::in_observer_callback() {
            // Under a device's admin lock (and perhaps the pool's, which
            // closing takes): finishing here would wait for ever.
            self.request_close();
            log_line!(
                "daxkv: Engine::close called from a mapping observer callback: new tasks are \
                 refused; the close finishes on the next close or drop outside it"
            );
            return;
        }
        if self.on_own_worker() {
            self.request_close();
            log_line!(
                "daxkv: Engine::close called on one of its own worker threads (from a \
                 listener): new tasks are refused; the close finishes on the next close \
                 or drop outside the workers"
            );
            return;
        }
        let mut closed = self
            .inner
            .close_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *closed {
            return;
        }
        let inner = &self.inner;
        self.request_close();
        // ORDERING: SeqCst — the read half of the Dekker handshake with
        // `enqueue_with` (module doc of that fn); a zero count also
        // observes, through the workers' Release decrements in `publish`,
        // everything those tasks did; pairs with `enqueue_with`, `publish`.
        while inner.inflight.iter().any(|c| c.load(Ordering::SeqCst) > 0) {
            std::thread::sleep(Duration::from_micros(200));
        }
        // ORDERING: Release — workers (Acquire in `worker_loop`) and
        // waiters (Acquire in `wait`) see it with everything before it;
        // pairs with `worker_loop` and `wait`.
        inner.stop.store(true, Ordering::Release);
        if let Some(pools) = inner.workers.swap(None) {
            for p in pools.iter() {
                stop_pool(p);
            }
            // The workers are joined; what else holds the pools is a
            // `wait_*` caller (or a collector between two loads). Wake the
            // waiters until they have let go, so that dropping our
            // reference below is the last one and closes the fds. Bounded:
            // a woken waiter sees `stop` and returns without sleeping
            // again (`swap` turned every outstanding borrow into a counted
            // reference, so the count is exact).
            while Arc::strong_count(&pools) > 1 {
                for p in pools.iter() {
                    let _ = p.fd.notify();
                }
                std::thread::sleep(Duration::from_micros(100));
            }
            drop(pools);
        }
        // A store's record is freed once its result is taken *and* its
        // completion entry popped; a waiter may take the result (its done
        // id is published first) before the entry reaches the ring, and
        // the next harvest frees it. No harvest comes after close: pop the
        // last entries here (waiting for a collector inside its own
        // harvest), so that a closed engine holds no record whose result
        // was collected (status's `task_records_in_use` is then the results
        // nobody collected).
        inner.harvest_stores_waiting();
        inner.pool.close_all();
        *closed = true;
    }

    /// Refuse new submits from now on.
    fn request_close(&self) {
        // ORDERING: SeqCst — the write half of the Dekker handshake with
        // `enqueue_with` (count, then check `closing`); pairs with
        // `enqueue_with`.
        self.inner.closing.store(true, Ordering::SeqCst);
    }

    /// True on one of this engine's worker threads.
    fn on_own_worker(&self) -> bool {
        worker::WORKER_OF.with(std::cell::Cell::get) == Arc::as_ptr(&self.inner) as usize
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if self.on_own_worker() {
            // The last handle dropped by a listener: this worker cannot be
            // joined from itself, nor can close wait for its task. Refuse
            // new work, tell every worker to stop, and let them go; the
            // devices close when the last worker lets go of the engine's
            // state (a `DaxCore` closes on drop), the fds when the pools do.
            self.request_close();
            // ORDERING: Release — as in `close`; pairs with `worker_loop`.
            self.inner.stop.store(true, Ordering::Release);
            if let Some(pools) = self.inner.workers.swap(None) {
                for p in pools.iter() {
                    for w in &p.wakes {
                        let _ = w.notify();
                    }
                    // Detach (not join) the workers.
                    p.detach();
                }
            }
            log_line!(
                "daxkv: the engine was dropped on one of its own worker threads (from a \
                 listener): its workers stop and are detached, tasks not yet run are dropped"
            );
            return;
        }
        self.close();
    }
}
