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
//! The API mirrors LMCache's L2 adapter contract (reference §1): task ids
//! are one counter shared by all kinds; store results are drained with
//! `pop_completed_stores` (each id exactly once); lookup and load results are
//! one-shot per id; `submit_unlock` never fails and is applied to every
//! device; three distinct non-blocking close-on-exec eventfds signal
//! completions.
//!
//! ## Tasks and parts
//!
//! A task lives in a fixed table of `task_slots` records, allocated at
//! start-up with room for `task_keys` keys and reused
//! ([`crate::cell::Mailbox`]: filled by the submitter, read by workers and
//! pollers with a reader count, taken by one collector). A submit takes any
//! free record from a lock-free free set ([`records::RecordSet`]) and the
//! task id names it: `id = (sequence << bits) | record`, so one result left
//! uncollected holds one record, and a submit is refused (`TooManyInFlight`)
//! only when every record is taken. The collector frees a record after it
//! has emptied it, and (for stores) after it has handed the popped
//! completions' ring space back, so a store completion always finds room
//! in its ring ([`records`] module doc). A store or load
//! task of many keys is split into parts of at least [`SPLIT_MIN_KEYS`]
//! keys spread over its pool's workers; the parts write disjoint result bits
//! (and destination buffers), and the task completes once (an atomic
//! countdown).
//!
//! ## No lock and no allocation on the data path
//!
//! After start-up, a task of at most `task_keys` keys allocates nothing
//! inside the engine and takes no lock that anyone waits on, from submit to
//! collection (`tests/alloc_engine.rs` counts allocations on both sides):
//! - submit: an id from a counter, one CAS to fill the record, one push per
//!   part: a CAS on the worker's shared [`ArrayQueue`] for the `&self`
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
//! [`Submitter`] (polled round-robin) and produces one CQ. Tasks go to
//! workers round-robin. An idle worker spins for `spin_us`, then sets
//! NEED_WAKEUP on all its queues and sleeps on its own eventfd, which a
//! submitter writes only when that flag is set.
//!
//! A panic inside a task part fails that task (all keys false), is logged
//! and counted in `status().worker_panics`, and the worker keeps serving.
//! A panic inside a listener is logged and counted in
//! `status().listener_panics`; the task is published as it finished.
//! `close` called from a listener (on a worker) only requests the close.
//!
//! ## Key ownership (one copy of a key in the pool)
//!
//! Written down in full in `docs/key-ownership.md`; hotplug builds on it.
//!
//! - **Who decides.** The device that holds a key is the one device whose
//!   index holds it; the pool never has two. What keeps it so is the
//!   pool-wide claim table ([`claims::ClaimTable`], 4096 cache-padded
//!   stripes indexed by key bits): every decision to *place* a key is made
//!   under that key's stripe.
//! - **Store.** `store_one`: (1) claim the key's stripe (CAS `0 → tag`,
//!   Acquire; a held stripe is waited for: bounded spin, then yield — the
//!   holder is doing one put); (2) load the device list *now* (a device
//!   added after the part began may hold the key); (3) if any readable
//!   device has the key live (committed or in flight), done: success, no
//!   copy; (4) else put it on the least-used writable device, the next one
//!   on `Full`; the put inserts the key into that device's index; (5)
//!   release the stripe (Release store of 0) when the put returns. A second
//!   store of the key claims after the first released, and its Acquire
//!   sees the first's insert, so step 3 finds it.
//! - **Lookup / load.** No claim: they look on every readable device and
//!   stop at the first hit. With one copy there is one hit.
//! - **Unlock.** Applied on every device (a lock lives where the key was
//!   found; unlocking a device without it does nothing).
//! - **Delete.** On every device, no claim needed: a delete never creates
//!   a copy. A store racing a delete leaves zero or one copy.
//! - **Migration (hotplug, later).** Under the key's claim: copy to the
//!   target and commit there (two copies now, both the same bytes; a
//!   reader may hit either: same bytes, so invisible), flip ownership (mark
//!   the source device not-readable for this key by deleting it there, the
//!   last step), release the claim. A store of the key during the move
//!   waits on the claim, so it cannot add a third copy; a store of the key
//!   that ran before the move finds the source copy and is a no-op.
//! - **Limits.** Stores through the engine follow the protocol; code that
//!   calls `DaxCore::put` on a device directly bypasses it. A device that
//!   is no longer readable (removing, closed) is not consulted by step 3:
//!   the removal protocol must migrate or delete its keys under their
//!   claims before new stores can reach other devices with them.
#![forbid(unsafe_code)]

use std::panic::AssertUnwindSafe;
use std::sync::atomic::fence;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use crossbeam_queue::ArrayQueue;

use crate::cell::Mailbox;

pub mod claims;
pub mod records;

use claims::ClaimTable;
use records::{pop_released, RecordSet};

use crate::arena::TryEnterError;
use crate::buf::{Buf, Dsts, Lent, RawBuf};
use crate::core::{CoreConfig, DaxCore, Session};
use crate::error::{OpenError, PutError};
use crate::key::Key;
use crate::notify::EventFd;
use crate::ring::{Consumer, Cqe, Producer, PushError, Ring, Sqe, CAPACITY_MAX};

/// Keys a worker's lookup scratch holds without growing.
const SCRATCH_KEYS: usize = 4096;

/// Keys of preallocated room in the whole task table (`task_slots` ×
/// `task_keys`): 16 M keys, 256 MiB of destination descriptors.
pub const MAX_TABLE_KEYS: usize = 1 << 24;

/// Smallest load part when a task is split across workers.
pub const SPLIT_MIN_KEYS: usize = 8;

// Every completion ring holds at least `task_slots` entries (the store
// CQ's no-overflow argument, `records` module doc): `task_slots` is at most
// `MAX_TABLE_KEYS` (each record holds at least one key).
const _: () = assert!(MAX_TABLE_KEYS <= CAPACITY_MAX as usize);

/// Completions a collector pops (and hands the ring space back for) before
/// it frees their records; on the stack, so collecting allocates nothing.
const POP_BATCH: usize = 32;

std::thread_local! {
    /// On an engine worker thread: the address of its engine's `Inner`
    /// (0 elsewhere). `close` and `drop` on a worker of their own engine
    /// (a listener calling them) must not wait for that worker.
    static WORKER_OF: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A task id: one counter from 0, shared by stores, lookups and loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskId(pub u64);

/// A device id: from 0, never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId(pub u32);

/// Device states (reference §3.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum DeviceState {
    Active = 0,
    Draining = 1,
    Migrating = 2,
    Resizing = 3,
    Removing = 4,
    Closed = 5,
    Failed = 6,
    Removed = 7,
}

impl DeviceState {
    fn from_u8(v: u8) -> DeviceState {
        match v {
            0 => DeviceState::Active,
            1 => DeviceState::Draining,
            2 => DeviceState::Migrating,
            3 => DeviceState::Resizing,
            4 => DeviceState::Removing,
            5 => DeviceState::Closed,
            6 => DeviceState::Failed,
            _ => DeviceState::Removed,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DeviceState::Active => "active",
            DeviceState::Draining => "draining",
            DeviceState::Migrating => "migrating",
            DeviceState::Resizing => "resizing",
            DeviceState::Removing => "removing",
            DeviceState::Closed => "closed",
            DeviceState::Failed => "failed",
            DeviceState::Removed => "removed",
        }
    }

    /// Lookups and loads may use it.
    pub fn is_readable(self) -> bool {
        matches!(
            self,
            DeviceState::Active
                | DeviceState::Draining
                | DeviceState::Migrating
                | DeviceState::Resizing
        )
    }

    /// New keys may go to it.
    pub fn is_writable(self) -> bool {
        self == DeviceState::Active
    }

    /// Its slots count in capacity and usage.
    pub fn counts_capacity(self) -> bool {
        self.is_readable() || self == DeviceState::Removing
    }
}

/// One device of the pool.
#[derive(Debug)]
pub struct Device {
    pub id: DeviceId,
    pub path: String,
    state: AtomicU8,
    pub core: DaxCore,
}

impl Device {
    pub fn state(&self) -> DeviceState {
        // ORDERING: Acquire — pairs with `set_state`.
        DeviceState::from_u8(self.state.load(Ordering::Acquire))
    }

    pub fn set_state(&self, s: DeviceState) {
        // ORDERING: Release — a state change is seen with what preceded it.
        self.state.store(s as u8, Ordering::Release);
    }

    fn usage(&self) -> f64 {
        let max = self.core.max_slots();
        if max == 0 {
            1.0
        } else {
            self.core.live_slot_count() as f64 / max as f64
        }
    }
}

/// Callbacks for keys stored, accessed and deleted (reference §1.1). Called
/// on worker threads (or the deleting thread), outside any engine state.
pub trait Listener: Send + Sync {
    fn on_keys_stored(&self, _keys: &[Key], _sizes: &[usize]) {}
    fn on_keys_accessed(&self, _keys: &[Key]) {}
    fn on_keys_deleted(&self, _keys: &[Key]) {}
}

/// Worker pool sizes and behaviour.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub num_store_workers: usize,
    pub num_lookup_workers: usize,
    pub num_load_workers: usize,
    /// How long an idle worker (or a waiting caller) spins before parking.
    /// Default 250 µs: longer than a cross-vCPU eventfd wake (100-200 µs on
    /// the VM this was tuned on), so a caller woken from park can resubmit
    /// before the worker parks again; with 50 µs both sides could fall into
    /// paying a wake per task.
    pub spin: Duration,
    /// How long a `wait_*` caller spins before parking on the eventfd.
    /// A caller that spins holds a CPU the workers could use: with more
    /// runnable workers than CPUs (two load workers and the caller on two
    /// vCPUs), a short wait spin lets both workers run (see the README's
    /// Performance section). Default: `spin`.
    pub wait_spin: Duration,
    /// Size of the task table: tasks in flight plus results not collected.
    pub task_slots: usize,
    /// Keys per task the table is sized for: a task of at most this many
    /// keys allocates nothing in the engine (each record holds this many
    /// destination descriptors and result bits, 16 bytes and 1 bit a key:
    /// about 4 MiB for 4096 slots × 64 keys). A larger task grows its
    /// record once; the record keeps the room.
    pub task_keys: usize,
    /// CPUs to pin workers to (round-robin); empty: no pinning.
    pub cpus: Vec<usize>,
    /// Fault injection for tests: a task part that meets this key panics.
    pub panic_on_key: Option<Key>,
    /// When workers write the completion eventfds.
    pub signal: Signal,
}

/// When a worker writes its class's completion eventfd.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Signal {
    /// After every completion: the fds are polled by someone who does not
    /// use the `wait_*` helpers (LMCache's controllers). The default.
    #[default]
    Always,
    /// Only while a `wait_*` caller is parked (it counts itself in the
    /// pool's waiters before sleeping): a busy caller that finds its
    /// results while spinning costs the workers no syscall per task.
    WhenWaiting,
}

impl Default for EngineOptions {
    /// LMCache's defaults: 1 store worker, 1 lookup worker,
    /// `min(4, cpus)` load workers.
    fn default() -> EngineOptions {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        EngineOptions {
            num_store_workers: 1,
            num_lookup_workers: 1,
            num_load_workers: cpus.min(4),
            spin: Duration::from_micros(250),
            wait_spin: Duration::from_micros(250),
            task_slots: 4096,
            task_keys: 64,
            cpus: Vec::new(),
            panic_on_key: None,
            signal: Signal::Always,
        }
    }
}

/// Engine errors (cold path, and submit refusals).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("engine is closing")]
    Closing,
    #[error("{what}: {keys} keys but {bufs} buffers")]
    LengthMismatch {
        what: &'static str,
        keys: usize,
        bufs: usize,
    },
    #[error("{field} must be a positive integer (got {value})")]
    Invalid { field: &'static str, value: usize },
    #[error("task table full: {capacity} tasks in flight or awaiting collection")]
    TooManyInFlight { capacity: usize },
    #[error("devices may be empty only when hotplug_enabled is true")]
    NoDevices,
    #[error("task_slots × task_keys = {task_slots} × {task_keys} keys of preallocated task records exceeds {max} (16 bytes each)")]
    TableTooLarge {
        task_slots: usize,
        task_keys: usize,
        max: usize,
    },
    #[error("device {path} is already mapped by this engine")]
    AlreadyMapped { path: String },
    #[error("device {path} is already mapped by this engine (device {id}) with {existing_bytes} bytes; cannot add it with {requested_bytes} bytes")]
    SizeConflict {
        path: String,
        id: u32,
        existing_bytes: usize,
        requested_bytes: usize,
    },
    #[error("device {index}: {source}")]
    Device { index: usize, source: OpenError },
    #[error("cannot start a worker thread: {0}")]
    Spawn(std::io::Error),
    #[error("eventfd: {0}")]
    EventFd(std::io::Error),
}

/// Result of a store task (LMCache's `L2StoreResult`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreResult {
    pub success: bool,
    pub bytes_transferred: u64,
}

/// Words a [`Bitmap`] keeps inline: tasks of up to 256 keys hand their
/// result back without allocating.
const INLINE_WORDS: usize = 4;

/// A per-key result bitmap (LMCache's `Bitmap`).
#[derive(Clone, PartialEq, Eq)]
pub struct Bitmap {
    /// Bits of tasks of up to `64 * INLINE_WORDS` keys (zero otherwise).
    inline: [u64; INLINE_WORDS],
    /// Bits of larger tasks (empty otherwise).
    heap: Vec<u64>,
    len: usize,
}

impl Bitmap {
    fn from_words(len: usize, words: impl ExactSizeIterator<Item = u64>) -> Bitmap {
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

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn test(&self, i: usize) -> bool {
        i < self.len && self.words()[i / 64] & (1 << (i % 64)) != 0
    }

    pub fn count_ones(&self) -> usize {
        self.words().iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Hits before the first miss.
    pub fn count_leading_ones(&self) -> usize {
        (0..self.len).take_while(|&i| self.test(i)).count()
    }

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

/// Result of a load task: the bitmap, plus the owned destinations handed
/// back (empty when the task used raw buffers).
#[derive(Debug)]
pub struct LoadResult {
    pub bitmap: Bitmap,
    pub bufs: Vec<Vec<u8>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Store,
    Lookup,
    Load,
}

/// One task-table record. Allocated at start-up (with room for
/// `task_keys` keys) and reused: a submit fills it, workers and pollers
/// read it, the collector takes the result out and leaves it empty
/// ([`Mailbox`]). The caller's vectors are moved in and dropped at
/// collection; the record's own vectors keep their capacity.
struct TaskRec {
    id: u64,
    op: Op,
    keys: Vec<Key>,
    srcs: Vec<Buf>,
    /// Load destinations; read-only while the task runs.
    dsts: Lent,
    results: Vec<AtomicU64>,
    parts_left: AtomicU32,
    panicked: AtomicBool,
}

/// One entry of the task table.
struct TaskSlot {
    /// The id of the last task finished in this slot (Release by the
    /// worker that finished it, after it let go of the record, so a
    /// collector that sees it never waits for that worker).
    done: AtomicU64,
    rec: Mailbox<TaskRec>,
}

impl TaskRec {
    fn with_capacity(keys: usize) -> TaskRec {
        TaskRec {
            id: u64::MAX,
            op: Op::Store,
            keys: Vec::new(),
            srcs: Vec::new(),
            dsts: Lent::with_capacity(keys),
            results: (0..keys.div_ceil(64).max(1))
                .map(|_| AtomicU64::new(0))
                .collect(),
            parts_left: AtomicU32::new(0),
            panicked: AtomicBool::new(false),
        }
    }

    fn is_set(&self, i: usize) -> bool {
        // ORDERING: Relaxed — only this part's worker writes bit `i`.
        self.results[i / 64].load(Ordering::Relaxed) & (1 << (i % 64)) != 0
    }

    fn set(&self, i: usize) {
        // ORDERING: Relaxed — published by the Release of `done`.
        self.results[i / 64].fetch_or(1 << (i % 64), Ordering::Relaxed);
    }

    /// Keys that succeeded (0 if a part panicked).
    fn ok_count(&self) -> usize {
        // ORDERING: Acquire — pairs with the Release in `run`.
        if self.panicked.load(Ordering::Acquire) {
            return 0;
        }
        self.results
            .iter()
            // ORDERING: Relaxed — read after the last part's AcqRel countdown.
            .map(|w| w.load(Ordering::Relaxed).count_ones() as usize)
            .sum()
    }

    fn bitmap(&self) -> Bitmap {
        // ORDERING: Acquire — pairs with the Release in `run` (also
        // ordered by the countdown and `done`).
        let panicked = self.panicked.load(Ordering::Acquire);
        Bitmap::from_words(
            self.keys.len(),
            self.results.iter().map(|w| {
                if panicked {
                    0
                } else {
                    // ORDERING: Relaxed — read after the Acquire of `done`.
                    w.load(Ordering::Relaxed)
                }
            }),
        )
    }

    /// Drop the caller's vectors (the record keeps its own capacity).
    fn clear(&mut self) {
        self.keys = Vec::new();
        self.srcs = Vec::new();
        drop(self.dsts.take_back());
    }
}

/// Submission rings a worker has not adopted yet (from new `Submitter`s).
#[derive(Default)]
struct Inbox {
    pending: Mutex<Vec<Consumer<Sqe>>>,
    has_new: AtomicBool,
}

struct Pool {
    name: &'static str,
    /// Per worker, the queue the shared `&self` submit methods push to.
    shared: Vec<Arc<SharedSq>>,
    inboxes: Vec<Arc<Inbox>>,
    ring_capacity: u32,
    wakes: Vec<Arc<EventFd>>,
    cqs: Mutex<Vec<Consumer<Cqe>>>,
    /// `wait_*` callers about to park on `fd` (with `Signal::WhenWaiting`
    /// workers signal only while this is non-zero).
    waiters: Arc<AtomicUsize>,
    fd: Arc<EventFd>,
    rr: AtomicUsize,
    /// Task parts each worker has run (status; shows how work spread).
    parts: Vec<Arc<AtomicU64>>,
    handles: Mutex<Vec<JoinHandle<()>>>,
}

impl Inner {
    /// The record index task `id` names (its low `id_bits` bits).
    fn record_of(&self, id: u64) -> usize {
        (id & ((1u64 << self.id_bits) - 1)) as usize
    }

    /// The task-table record of task `id`; `None` for an id that names no
    /// record (never handed out by this engine).
    fn task(&self, id: u64) -> Option<&TaskSlot> {
        self.tasks.get(self.record_of(id))
    }

    /// Call every listener with `f`, each isolated like a task part: a
    /// panic is logged and counted (`status().listener_panics`), and the
    /// next listener still runs.
    fn tell_listeners(&self, what: &str, f: impl Fn(&dyn Listener)) {
        for l in self.listeners.load().iter() {
            if let Err(p) = std::panic::catch_unwind(AssertUnwindSafe(|| f(&**l))) {
                eprintln!(
                    "daxkv: a listener panicked in {what}: {}; ignored",
                    panic_message(&*p)
                );
                // ORDERING: Relaxed — a statistic.
                self.listener_panics.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The text of a panic payload (empty if it is not a string).
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

struct Inner {
    opts: EngineOptions,
    slot_bytes: usize,
    hotplug_enabled: bool,
    /// The device list: read lock-free by the data path; replaced only
    /// under `admin`.
    devices: ArcSwap<Vec<Arc<Device>>>,
    /// Serializes the control plane's device-list changes (`add_device`):
    /// the identity check and the append are one step.
    admin: Mutex<()>,
    /// Next device id; advanced only under `admin`.
    next_device: AtomicU32,
    /// Key ownership: a store holds its key's stripe while it decides
    /// which device gets the key (module doc, "Key ownership").
    claims: ClaimTable,
    tasks: Box<[TaskSlot]>,
    /// Free records of `tasks` (module doc, "Tasks and parts").
    records: RecordSet,
    /// Bits of a task id that name its record.
    id_bits: u32,
    /// Task sequence numbers (the high bits of task ids).
    next_task: AtomicU64,
    /// Tasks submitted and not yet finished (close waits for zero).
    inflight: [AtomicUsize; 3],
    /// Set by `close` (or requested by a listener): submits are refused.
    closing: AtomicBool,
    /// Set by `close` once nothing is in flight: workers exit, waiters
    /// return.
    stop: AtomicBool,
    panics: AtomicU64,
    listener_panics: AtomicU64,
    listeners: ArcSwap<Vec<Arc<dyn Listener>>>,
}

/// How a device is opened.
#[derive(Clone, Debug)]
pub struct DeviceSpec {
    /// Shown in status; for a file or device, its path.
    pub path: String,
    pub core: CoreConfig,
}

/// The engine. `Send + Sync`; all methods take `&self`.
pub struct Engine {
    inner: Arc<Inner>,
    pools: ArcSwapOption<[Pool; 3]>,
    close_lock: Mutex<bool>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").finish_non_exhaustive()
    }
}

fn idx(op: Op) -> usize {
    op as usize
}

impl Engine {
    /// Map the devices and start the worker pools. Any failure releases
    /// everything opened so far.
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
        let mut devs: Vec<Arc<Device>> = Vec::new();
        for (i, spec) in devices.into_iter().enumerate() {
            let mut cfg = spec.core.clone();
            cfg.slot_bytes = slot_bytes;
            let core =
                DaxCore::open(&cfg).map_err(|source| EngineError::Device { index: i, source })?;
            if let Some(id) = core.identity() {
                if devs.iter().any(|d| d.core.identity() == Some(id)) {
                    return Err(EngineError::AlreadyMapped { path: spec.path });
                }
            }
            devs.push(Arc::new(Device {
                id: DeviceId(i as u32),
                path: spec.path,
                state: AtomicU8::new(DeviceState::Active as u8),
                core,
            }));
        }
        let n_dev = devs.len() as u32;
        let inner = Arc::new(Inner {
            slot_bytes,
            hotplug_enabled,
            devices: ArcSwap::from_pointee(devs),
            admin: Mutex::new(()),
            next_device: AtomicU32::new(n_dev),
            claims: ClaimTable::default(),
            tasks: (0..opts.task_slots)
                .map(|_| TaskSlot {
                    done: AtomicU64::new(u64::MAX),
                    rec: Mailbox::new(TaskRec::with_capacity(opts.task_keys)),
                })
                .collect(),
            records: RecordSet::new(opts.task_slots),
            id_bits: opts.task_slots.next_power_of_two().trailing_zeros().max(1),
            next_task: AtomicU64::new(0),
            inflight: Default::default(),
            closing: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            panics: AtomicU64::new(0),
            listener_panics: AtomicU64::new(0),
            listeners: ArcSwap::from_pointee(Vec::new()),
            opts,
        });
        let engine = Engine {
            inner: inner.clone(),
            pools: ArcSwapOption::empty(),
            close_lock: Mutex::new(false),
        };
        let pools = [
            start_pool(&inner, Op::Store, inner.opts.num_store_workers),
            start_pool(&inner, Op::Lookup, inner.opts.num_lookup_workers),
            start_pool(&inner, Op::Load, inner.opts.num_load_workers),
        ];
        let mut ok = Vec::new();
        let mut err = None;
        for p in pools {
            match p {
                Ok(p) => ok.push(p),
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
            for d in inner.devices.load().iter() {
                d.core.close();
            }
            return Err(e);
        }
        let pools: [Pool; 3] = ok
            .try_into()
            .unwrap_or_else(|_| unreachable!("three pools"));
        engine.pools.store(Some(Arc::new(pools)));
        Ok(engine)
    }

    /// Open from a validated config (LMCache's adapter JSON).
    pub fn from_config(cfg: &crate::config::EngineConfig) -> Result<Engine, EngineError> {
        Engine::open(
            cfg.device_specs(),
            cfg.slot_bytes,
            cfg.hotplug_enabled,
            cfg.options(),
        )
    }

    pub fn slot_bytes(&self) -> usize {
        self.inner.slot_bytes
    }

    /// The device list (a snapshot).
    pub fn devices(&self) -> Arc<Vec<Arc<Device>>> {
        self.inner.devices.load_full()
    }

    /// Append a device (the control plane's add). Returns its id.
    ///
    /// Never two cores over one device: a device (or file) the pool already
    /// maps — same `st_rdev`, or same `(st_dev, st_ino)` — is answered with
    /// its existing id when the size matches (idempotent) and with
    /// [`EngineError::SizeConflict`] otherwise. The check and the append are
    /// one step under the admin mutex (the data path never takes it: it
    /// reads the list through the `ArcSwap`), so two racing adds of one
    /// device map it once.
    pub fn add_device(&self, spec: &DeviceSpec) -> Result<DeviceId, EngineError> {
        let inner = &self.inner;
        let _admin = inner.admin.lock().unwrap_or_else(PoisonError::into_inner);
        // ORDERING: Acquire — observes `request_close`; `close` takes
        // `admin` before it closes the devices, so an add that passed this
        // check has appended before that; pairs with `close`.
        if inner.closing.load(Ordering::Acquire) {
            return Err(EngineError::Closing);
        }
        let requested = spec.core.arena.size_bytes;
        // A path we can stat is checked before it is mapped a second time.
        let by_path = match &spec.core.arena.source {
            crate::arena::ArenaSource::Path(p) | crate::arena::ArenaSource::CreateFile(p) => {
                crate::arena::DeviceIdentity::of_path(p)
            }
            _ => None,
        };
        if let Some(found) = self.mapped_as(by_path, &spec.path, requested) {
            return found;
        }
        let mut cfg = spec.core.clone();
        cfg.slot_bytes = inner.slot_bytes;
        let core = DaxCore::open(&cfg).map_err(|source| EngineError::Device {
            index: self.devices().len(),
            source,
        })?;
        // The identity of what was opened (a path that appeared meanwhile,
        // or one reached through another name).
        if let Some(found) = self.mapped_as(core.identity(), &spec.path, core.arena_bytes()) {
            return found;
        }
        // ORDERING: Relaxed — advanced only under `admin`, which orders it.
        let id = DeviceId(inner.next_device.fetch_add(1, Ordering::Relaxed));
        let mut v = Vec::clone(&inner.devices.load());
        v.push(Arc::new(Device {
            id,
            path: spec.path.clone(),
            state: AtomicU8::new(DeviceState::Active as u8),
            core,
        }));
        // Under `admin`: nobody else replaces the list meanwhile.
        inner.devices.store(Arc::new(v));
        Ok(id)
    }

    /// The answer for a device of identity `id` the pool already maps (and
    /// serves: tombstones don't count): its id at the same size, a conflict
    /// at another. `None` if not mapped. Called under `admin`.
    fn mapped_as(
        &self,
        id: Option<crate::arena::DeviceIdentity>,
        path: &str,
        requested_bytes: usize,
    ) -> Option<Result<DeviceId, EngineError>> {
        let id = id?;
        let devs = self.inner.devices.load();
        let d = devs.iter().find(|d| {
            !matches!(d.state(), DeviceState::Closed | DeviceState::Removed)
                && d.core.identity() == Some(id)
        })?;
        let existing_bytes = d.core.arena_bytes();
        Some(if existing_bytes == requested_bytes {
            Ok(d.id)
        } else {
            Err(EngineError::SizeConflict {
                path: path.to_string(),
                id: d.id.0,
                existing_bytes,
                requested_bytes,
            })
        })
    }

    pub fn register_listener(&self, l: &Arc<dyn Listener>) {
        self.inner.listeners.rcu(|cur| {
            let mut v = Vec::clone(cur);
            v.push(l.clone());
            v
        });
    }

    /// The completion eventfds (store, lookup, load): distinct,
    /// non-blocking, close-on-exec. -1 after close.
    pub fn event_fds(&self) -> [i32; 3] {
        use std::os::fd::AsRawFd;
        match self.pools.load().as_ref() {
            Some(p) => [
                p[0].fd.as_raw_fd(),
                p[1].fd.as_raw_fd(),
                p[2].fd.as_raw_fd(),
            ],
            None => [-1; 3],
        }
    }

    pub fn store_event_fd(&self) -> i32 {
        self.event_fds()[0]
    }

    pub fn lookup_event_fd(&self) -> i32 {
        self.event_fds()[1]
    }

    pub fn load_event_fd(&self) -> i32 {
        self.event_fds()[2]
    }

    // ----- submit -----

    /// Store `bufs[i]` under `keys[i]`. Task success = every key stored (or
    /// already present).
    pub fn submit_store(&self, keys: Vec<Key>, bufs: Vec<Buf>) -> Result<TaskId, EngineError> {
        same_len("submit_store", keys.len(), bufs.len())?;
        self.enqueue(Op::Store, keys, bufs, None)
    }

    /// Look up and lock: each hit takes one lock (release with
    /// `submit_unlock`).
    pub fn submit_lookup_and_lock(&self, keys: Vec<Key>) -> Result<TaskId, EngineError> {
        self.enqueue(Op::Lookup, keys, Vec::new(), None)
    }

    /// Load into owned buffers, handed back by `query_load`.
    pub fn submit_load(&self, keys: Vec<Key>, bufs: Vec<Vec<u8>>) -> Result<TaskId, EngineError> {
        same_len("submit_load", keys.len(), bufs.len())?;
        self.enqueue(Op::Load, keys, Vec::new(), Some(Dsts::Owned(bufs)))
    }

    /// Load into caller memory (see `buf` for the lifetime rule).
    pub fn submit_load_raw(
        &self,
        keys: Vec<Key>,
        bufs: Vec<RawBuf>,
    ) -> Result<TaskId, EngineError> {
        same_len("submit_load", keys.len(), bufs.len())?;
        self.enqueue(Op::Load, keys, Vec::new(), Some(Dsts::Raw(bufs)))
    }

    fn enqueue(
        &self,
        op: Op,
        keys: Vec<Key>,
        srcs: Vec<Buf>,
        dsts: Option<Dsts>,
    ) -> Result<TaskId, EngineError> {
        // The shared submit path: a CAS on the worker's MPMC queue. A thread
        // with a `Submitter` pushes to rings of its own instead.
        self.enqueue_with(op, keys, srcs, dsts, |pool, w, e| {
            pool.shared[w].push(&pool.wakes[w], e);
        })
    }

    /// Record the task in the table, then hand its parts to `push`
    /// (worker index, entry).
    fn enqueue_with(
        &self,
        op: Op,
        keys: Vec<Key>,
        srcs: Vec<Buf>,
        dsts: Option<Dsts>,
        push: impl FnMut(&Pool, usize, Sqe),
    ) -> Result<TaskId, EngineError> {
        let inner = &self.inner;
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
        inner.inflight[idx(op)].fetch_add(1, Ordering::SeqCst);
        // Undone unless the task was handed to the workers: on a refusal,
        // and on a panic inside `record_and_push` too (else `close` would
        // wait for it forever).
        let mut undo = UndoInflight(&inner.inflight[idx(op)], true);
        // ORDERING: SeqCst — the read half of the handshake above; pairs
        // with the SeqCst store in `close` / `request_close`.
        let r = if inner.closing.load(Ordering::SeqCst) {
            Err(EngineError::Closing)
        } else {
            self.record_and_push(op, keys, srcs, dsts, push)
        };
        undo.1 = r.is_err();
        r
    }

    fn record_and_push(
        &self,
        op: Op,
        keys: Vec<Key>,
        srcs: Vec<Buf>,
        dsts: Option<Dsts>,
        mut push: impl FnMut(&Pool, usize, Sqe),
    ) -> Result<TaskId, EngineError> {
        let inner = &self.inner;
        let pools = self.pools.load_full().ok_or(EngineError::Closing)?;
        let pool = &pools[idx(op)];
        // Any free record; refused only when every record holds a task in
        // flight or a result not yet collected.
        let Some(record) = inner.records.claim() else {
            return Err(EngineError::TooManyInFlight {
                capacity: inner.tasks.len(),
            });
        };
        // The id names its record in its low bits: `(sequence << id_bits) |
        // record`, unique and increasing. The sequence has `64 - id_bits`
        // bits (52 with the default 4096 records; 40 with the largest
        // table): at 10 M tasks/s that is 14 years (30 hours for the
        // largest table) before an id repeats, and a repeat only matters to
        // a caller still holding the old id.
        // ORDERING: Relaxed — ids need only be unique (the RMW gives that).
        let seq = inner.next_task.fetch_add(1, Ordering::Relaxed);
        let id = (seq << inner.id_bits) | u64::from(record);
        let n = keys.len();
        let workers = pool.shared.len();
        // Parts: a store or load of many keys is spread over the pool's
        // workers (lookups stay whole: one batched probe per device).
        let per = if op != Op::Lookup && workers > 1 && n >= 2 * SPLIT_MIN_KEYS {
            n.div_ceil(workers).max(SPLIT_MIN_KEYS)
        } else {
            n.max(1)
        };
        let nparts = n.div_ceil(per).max(1);
        let words = n.div_ceil(64).max(1);
        let slot = &inner.tasks[record as usize];
        let filled = slot.rec.fill(move |rec| {
            rec.id = id;
            rec.op = op;
            rec.keys = keys;
            rec.srcs = srcs;
            if let Some(d) = dsts {
                rec.dsts.lend(d);
            }
            rec.results.clear();
            rec.results.resize_with(words, || AtomicU64::new(0));
            *rec.parts_left.get_mut() = nparts as u32;
            *rec.panicked.get_mut() = false;
        });
        if filled.is_none() {
            // A record is freed only after its mailbox is emptied (`take`
            // stores 0 before `release`), so a claimed record is empty.
            inner.records.release(record);
            unreachable!("claimed task record {record} was not empty");
        }
        for p in 0..nparts {
            let start = p * per;
            let e = Sqe {
                task: id,
                start: start as u32,
                len: per.min(n - start.min(n)) as u32,
            };
            // ORDERING: Relaxed — round-robin spreading only.
            let w = pool.rr.fetch_add(1, Ordering::Relaxed) % workers;
            push(pool, w, e);
        }
        Ok(TaskId(id))
    }

    /// A submission handle for one thread: its own SPSC ring to every
    /// worker, so its submits take no lock. Results are collected through
    /// the engine as usual (`pop_completed_stores`, `query_*`, `wait_*`).
    /// Creating one is a cold-path operation (it allocates the rings).
    pub fn submitter(&self) -> Result<Submitter<'_>, EngineError> {
        let pools = self.pools.load_full().ok_or(EngineError::Closing)?;
        let mut sqs: [Vec<Producer<Sqe>>; 3] = Default::default();
        for (c, pool) in pools.iter().enumerate() {
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
        // The pools are not kept: after `close` their eventfds must close.
        Ok(Submitter { engine: self, sqs })
    }

    // ----- results -----
    //
    // Collection takes no lock that anyone waits on: the result lives in
    // the task's record (a `Mailbox`: readers counted, one taker), and the
    // completion rings of a class are drained by whichever caller wins a
    // `try_lock` (a concurrent caller skips the drain; for stores, the
    // winner hands out the ids it popped, each exactly once).

    /// Every completed store task not popped before, each exactly once.
    /// Allocates the returned vector; [`Engine::pop_completed_stores_into`]
    /// reuses one.
    pub fn pop_completed_stores(&self) -> Vec<(TaskId, StoreResult)> {
        let mut out = Vec::new();
        self.pop_completed_stores_into(&mut out);
        out
    }

    /// Append every completed store task not popped before to `out` (each
    /// exactly once); returns how many were appended. When another thread
    /// is popping at the same moment, it gets them instead and this call
    /// appends none.
    pub fn pop_completed_stores_into(&self, out: &mut Vec<(TaskId, StoreResult)>) -> usize {
        let Some(pools) = self.pools.load_full() else {
            return 0;
        };
        let Some(mut cqs) = try_lock(&pools[0].cqs) else {
            return 0;
        };
        let before = out.len();
        let slot_bytes = self.inner.slot_bytes as u64;
        let mut batch = [Cqe {
            task: 0,
            ok: 0,
            keys_ok: 0,
        }; POP_BATCH];
        for cq in cqs.iter_mut() {
            // Pop a batch and hand its ring space back *before* freeing the
            // batch's records: a refilled record's completion then always
            // finds room (`records` module doc; issue 8, defect 4).
            loop {
                let (n, err) = pop_released(cq, &mut batch);
                if let Some(e) = err {
                    eprintln!("daxkv: store completion ring: {e}");
                }
                for c in &batch[..n] {
                    let r = self.take_done(c.task, Op::Store, |rec| {
                        let ok = rec.ok_count();
                        let n = rec.keys.len();
                        rec.clear();
                        StoreResult {
                            success: ok == n,
                            bytes_transferred: ok as u64 * slot_bytes,
                        }
                    });
                    if let Some(r) = r {
                        out.push((TaskId(c.task), r));
                    }
                }
                if n < POP_BATCH {
                    break;
                }
            }
        }
        out.len() - before
    }

    /// The lookup bitmap once the task is done (`None` while pending, and
    /// for every call after the one that returned it). Allocates nothing
    /// for tasks of up to 256 keys.
    pub fn query_lookup(&self, id: TaskId) -> Option<Bitmap> {
        self.drain_cqs(Op::Lookup);
        self.take_done(id.0, Op::Lookup, |rec| {
            let b = rec.bitmap();
            rec.clear();
            b
        })
    }

    /// The load result once done (one-shot, like `query_lookup`). The owned
    /// destinations come back in `bufs` (the caller's vector, moved back).
    pub fn query_load(&self, id: TaskId) -> Option<LoadResult> {
        self.drain_cqs(Op::Load);
        self.take_done(id.0, Op::Load, |rec| {
            let bitmap = rec.bitmap();
            let bufs = rec.dsts.take_back();
            rec.clear();
            LoadResult { bitmap, bufs }
        })
    }

    /// Wait for a lookup: spin for `spin`, then sleep on the eventfd, up to
    /// `timeout`.
    pub fn wait_lookup(&self, id: TaskId, timeout: Duration) -> Option<Bitmap> {
        self.wait(Op::Lookup, timeout, || self.query_lookup(id))
    }

    /// Wait for a load (see `wait_lookup`).
    pub fn wait_load(&self, id: TaskId, timeout: Duration) -> Option<LoadResult> {
        self.wait(Op::Load, timeout, || self.query_load(id))
    }

    /// Wait until at least one store completes, then pop them all.
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
        self.wait(Op::Store, timeout, || {
            let n = self.pop_completed_stores_into(out);
            (n > 0).then_some(n)
        })
        .unwrap_or(0)
    }

    fn wait<R>(&self, op: Op, timeout: Duration, mut poll: impl FnMut() -> Option<R>) -> Option<R> {
        let start = Instant::now();
        // Spin first: a cross-vCPU eventfd wake costs 100-200 µs here.
        let mut spins = 0u32;
        while start.elapsed() < self.inner.opts.wait_spin {
            if let Some(r) = poll() {
                return Some(r);
            }
            spin_pause(&mut spins);
        }
        // Holding the pools keeps their eventfds open while we sleep on
        // one: `close` waits for every such holder to let go (waking us
        // until we do) before it drops them, so it closes the fds before it
        // returns (issue 8, defect 13) and never under a sleeper.
        let pools = self.pools.load_full()?;
        let pool = &pools[idx(op)];
        let on_demand = self.inner.opts.signal == Signal::WhenWaiting;
        loop {
            // ORDERING: Acquire — observes `close`'s Release store of
            // `stop` (everything is finished; return what is there). A
            // waiter that misses it is woken by `close`, which writes our
            // eventfd until we have let go of the pools; pairs with `close`.
            if self.inner.stop.load(Ordering::Acquire) {
                drop(pools);
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
            if r.is_none() {
                if let Some(left) = timeout.checked_sub(start.elapsed()) {
                    let _ = pool.fd.wait(left.min(Duration::from_millis(50)));
                }
            }
            if on_demand {
                // ORDERING: Relaxed — leaving only ends wake-ups; a worker
                // that still counts us makes one spurious (coalesced) write.
                pool.waiters.fetch_sub(1, Ordering::Relaxed);
            }
            if r.is_some() {
                return r;
            }
            let _ = pool.fd.drain();
            if start.elapsed() >= timeout {
                return poll();
            }
        }
    }

    /// Drain a class's completion rings (lookup and load entries only wake
    /// waiters; the record's `done` flag is the result), unless another
    /// thread is draining them now.
    fn drain_cqs(&self, op: Op) {
        if let Some(pools) = self.pools.load_full() {
            if let Some(mut cqs) = try_lock(&pools[idx(op)].cqs) {
                for cq in cqs.iter_mut() {
                    while let Ok(Some(_)) = cq.pop() {}
                    cq.sync();
                }
            }
        }
    }

    /// Take task `id`'s result out of its record if it is done and of kind
    /// `op`; one caller wins, every later call gets `None`.
    fn take_done<R>(&self, id: u64, op: Op, f: impl FnOnce(&mut TaskRec) -> R) -> Option<R> {
        let inner = &self.inner;
        let slot = inner.task(id)?;
        // ORDERING: Acquire — pairs with the Release in `publish`, which
        // comes after the result bits, the destination bytes and every
        // worker's guard release.
        if slot.done.load(Ordering::Acquire) != id {
            return None;
        }
        // The record may already be taken (and refilled by a later id).
        let rec = slot.rec.read()?;
        if rec.id != id || rec.op != op {
            return None;
        }
        let r = rec.take(f)?;
        // Emptied (the mailbox is 0 again): the record is free for the
        // next submit.
        inner.records.release(inner.record_of(id) as u32);
        Some(r)
    }

    // ----- synchronous operations -----

    /// Release one lookup lock per key on every device (a key may have moved
    /// between lookup and unlock). Never fails.
    pub fn submit_unlock(&self, keys: &[Key]) {
        for d in self.inner.devices.load().iter() {
            d.core.unlock_many(keys);
        }
    }

    /// Delete unlocked, committed keys from every device; returns the keys
    /// deleted (each once) and tells the listeners.
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
            return 0;
        }
        let before = out.len();
        let devs = self.inner.devices.load();
        for &k in keys {
            // Every device: a key being migrated may sit on two.
            let mut hit = false;
            for d in devs.iter() {
                hit |= d.core.delete(k, false);
            }
            if hit {
                out.push(k);
            }
        }
        let deleted = &out[before..];
        if !deleted.is_empty() {
            self.inner
                .tell_listeners("on_keys_deleted", |l| l.on_keys_deleted(deleted));
        }
        deleted.len()
    }

    /// `(bytes used, capacity bytes)` over the devices that count capacity,
    /// by slots (reference §3.10).
    pub fn usage(&self) -> (u64, u64) {
        let sb = self.inner.slot_bytes as u64;
        self.inner
            .devices
            .load()
            .iter()
            .filter(|d| d.state().counts_capacity() && !d.core.is_closing())
            .fold((0, 0), |(u, c), d| {
                (
                    u + sb * d.core.live_slot_count() as u64,
                    c + sb * d.core.max_slots() as u64,
                )
            })
    }

    /// Status fields (reference §3.10), as a JSON value.
    pub fn status(&self) -> serde_json::Value {
        let devs = self.inner.devices.load();
        // ORDERING: Acquire — a snapshot for status; pairs with
        // `request_close`.
        let closing = self.inner.closing.load(Ordering::Acquire);
        let inflight: Vec<usize> = self
            .inner
            .inflight
            .iter()
            // ORDERING: Relaxed — a statistic.
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        let mut devices = Vec::new();
        let (mut live, mut locked, mut borrowed) = (0, 0, 0);
        let mut healthy = !closing;
        for (i, d) in devs.iter().enumerate() {
            let st = d.core.status();
            let state = d.state();
            if state.counts_capacity() {
                live += st.live_slot_count;
                locked += st.locked_key_count;
                borrowed += st.borrowed_slot_count;
                healthy &= st.is_healthy;
            }
            // Closed and removed entries are tombstones, not failures
            // (upstream counts them unhealthy forever, reference §9.4).
            healthy &= state != DeviceState::Failed;
            devices.push(serde_json::json!({
                "index": i,
                "device_id": d.id.0,
                "device_path": d.path,
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
                "closing": st.closing,
                "inflight_store_tasks": inflight[0],
                "inflight_lookup_tasks": inflight[1],
                "inflight_load_tasks": inflight[2],
                "supports_restart_recovery": false,
            }));
        }
        let (used, cap) = self.usage();
        let parts = |c: usize| -> Vec<u64> {
            self.pools.load().as_ref().map_or_else(Vec::new, |p| {
                // ORDERING: Relaxed — statistics.
                p[c].parts
                    .iter()
                    .map(|n| n.load(Ordering::Relaxed))
                    .collect()
            })
        };
        serde_json::json!({
            "is_healthy": healthy,
            "type": "dax",
            "device_path": devs.first().map(|d| d.path.clone()).unwrap_or_default(),
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
            "task_records_in_use": self.inner.records.in_use(),
            "parts_run": {"store": parts(0), "lookup": parts(1), "load": parts(2)},
            "num_devices": devs.len(),
            "devices": devices,
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
        if self.on_own_worker() {
            self.request_close();
            eprintln!(
                "daxkv: Engine::close called on one of its own worker threads (from a \
                 listener): new tasks are refused; the close finishes on the next close \
                 or drop outside the workers"
            );
            return;
        }
        let mut closed = self
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
        if let Some(pools) = self.pools.swap(None) {
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
        // Under `admin`: a racing `add_device` either appended before this
        // (and its device is closed here) or sees `closing` and refuses.
        let _admin = inner.admin.lock().unwrap_or_else(PoisonError::into_inner);
        for d in inner.devices.load().iter() {
            d.core.close();
            d.set_state(DeviceState::Closed);
        }
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
        WORKER_OF.with(std::cell::Cell::get) == Arc::as_ptr(&self.inner) as usize
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
            if let Some(pools) = self.pools.swap(None) {
                for p in pools.iter() {
                    for w in &p.wakes {
                        let _ = w.notify();
                    }
                    // Detach (not join) the workers.
                    p.handles
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clear();
                }
            }
            eprintln!(
                "daxkv: the engine was dropped on one of its own worker threads (from a \
                 listener): its workers stop and are detached, tasks not yet run are dropped"
            );
            return;
        }
        self.close();
    }
}

fn start_pool(inner: &Arc<Inner>, class: Op, n: usize) -> Result<Pool, EngineError> {
    let name = match class {
        Op::Store => "daxkv-store",
        Op::Lookup => "daxkv-lookup",
        Op::Load => "daxkv-load",
    };
    let fd = Arc::new(EventFd::new().map_err(EngineError::EventFd)?);
    let waiters = Arc::new(AtomicUsize::new(0));
    let cap = (inner.opts.task_slots as u32)
        .next_power_of_two()
        .clamp(64, crate::ring::CAPACITY_MAX);
    let mut shareds = Vec::new();
    let mut parts = Vec::new();
    let mut inboxes = Vec::new();
    let mut wakes = Vec::new();
    let mut cqs = Vec::new();
    let mut handles = Vec::new();
    // Workers report once pinned, so `open` returns with placement done.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    for w in 0..n {
        let shared = Arc::new(SharedSq {
            q: ArrayQueue::new(cap as usize),
            need_wakeup: AtomicBool::new(false),
        });
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
            cpu: (!inner.opts.cpus.is_empty()).then(|| inner.opts.cpus[w % inner.opts.cpus.len()]),
            name: format!("{name}-{w}"),
            class,
            scratch: Scratch::with_capacity(SCRATCH_KEYS),
        };
        let ready = ready_tx.clone();
        let h = std::thread::Builder::new()
            .name(ctx.name.clone())
            .spawn(move || {
                if let Some(cpu) = ctx.cpu {
                    pin_to(cpu);
                }
                let _ = ready.send(());
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
    for _ in 0..n {
        let _ = ready_rx.recv();
    }
    Ok(Pool {
        name,
        shared: shareds,
        inboxes,
        ring_capacity: cap,
        wakes,
        cqs: Mutex::new(cqs),
        waiters,
        fd,
        rr: AtomicUsize::new(0),
        parts,
        handles: Mutex::new(handles),
    })
}

/// Lock `m` if nobody holds it; never waits.
fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

fn same_len(what: &'static str, keys: usize, bufs: usize) -> Result<(), EngineError> {
    if keys == bufs {
        Ok(())
    } else {
        Err(EngineError::LengthMismatch { what, keys, bufs })
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

/// The shared submission queue of one worker: bounded lock-free MPMC
/// (`&self` submitters from any thread, one consuming worker; a push is a
/// CAS and allocates nothing) with the ring's NEED_WAKEUP handshake.
struct SharedSq {
    q: ArrayQueue<Sqe>,
    /// Set by the worker before it sleeps (see `worker_loop`).
    need_wakeup: AtomicBool,
}

impl SharedSq {
    /// Push and wake the worker if it asked. The queue holds `task_slots`
    /// entries, more than can be in flight, so it is never full for long.
    fn push(&self, wake: &EventFd, mut e: Sqe) {
        while let Err(back) = self.q.push(e) {
            e = back;
            let _ = wake.notify();
            std::thread::yield_now();
        }
        // ORDERING: SeqCst fence — the Dekker pair of the worker's fence
        // between setting `need_wakeup` and re-checking the queue (the
        // ring module's sleep / wake argument).
        fence(Ordering::SeqCst);
        if self.need_wakeup.load(Ordering::Relaxed) {
            let _ = wake.notify();
        }
    }
}

/// Lock-free submission for one thread (see [`Engine::submitter`]).
/// `Send`, not `Sync`.
pub struct Submitter<'e> {
    engine: &'e Engine,
    /// Per class, one ring to each worker.
    sqs: [Vec<Producer<Sqe>>; 3],
}

impl Submitter<'_> {
    fn submit(
        &mut self,
        op: Op,
        keys: Vec<Key>,
        srcs: Vec<Buf>,
        dsts: Option<Dsts>,
    ) -> Result<TaskId, EngineError> {
        let sqs = &mut self.sqs[idx(op)];
        self.engine
            .enqueue_with(op, keys, srcs, dsts, |pool, w, e| {
                push_sqe(&mut sqs[w], &pool.wakes[w], e);
            })
    }

    /// [`Engine::submit_store`], without a lock.
    pub fn submit_store(&mut self, keys: Vec<Key>, bufs: Vec<Buf>) -> Result<TaskId, EngineError> {
        same_len("submit_store", keys.len(), bufs.len())?;
        self.submit(Op::Store, keys, bufs, None)
    }

    /// [`Engine::submit_lookup_and_lock`], without a lock.
    pub fn submit_lookup_and_lock(&mut self, keys: Vec<Key>) -> Result<TaskId, EngineError> {
        self.submit(Op::Lookup, keys, Vec::new(), None)
    }

    /// [`Engine::submit_load`], without a lock.
    pub fn submit_load(
        &mut self,
        keys: Vec<Key>,
        bufs: Vec<Vec<u8>>,
    ) -> Result<TaskId, EngineError> {
        same_len("submit_load", keys.len(), bufs.len())?;
        self.submit(Op::Load, keys, Vec::new(), Some(Dsts::Owned(bufs)))
    }

    /// [`Engine::submit_load_raw`], on this thread's rings.
    pub fn submit_load_raw(
        &mut self,
        keys: Vec<Key>,
        bufs: Vec<RawBuf>,
    ) -> Result<TaskId, EngineError> {
        same_len("submit_load", keys.len(), bufs.len())?;
        self.submit(Op::Load, keys, Vec::new(), Some(Dsts::Raw(bufs)))
    }
}

fn stop_pool(p: &Pool) {
    for w in &p.wakes {
        let _ = w.notify();
    }
    for h in std::mem::take(&mut *p.handles.lock().unwrap_or_else(PoisonError::into_inner)) {
        if h.join().is_err() {
            eprintln!("daxkv: a {} worker exited by panic", p.name);
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
    cpu: Option<usize>,
    name: String,
    /// The pool's task kind.
    class: Op,
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

fn pin_to(cpu: usize) {
    let ids = core_affinity::get_core_ids().unwrap_or_default();
    if let Some(id) = ids.into_iter().find(|c| c.id == cpu) {
        core_affinity::set_for_current(id);
    }
}

/// One step of a bounded spin. Every 32nd step yields the CPU: when the
/// scheduler has put the waiter and the thread it waits for on the same
/// (v)CPU, a pure spin would hold that CPU for the whole spin window while
/// the other thread cannot run (seen here: each task then cost about twice
/// the spin time). A yield costs well under a microsecond when nothing else
/// is runnable.
fn spin_pause(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    if spins.is_multiple_of(32) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
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
            let _ = w.wake.wait(Duration::from_millis(100));
            let _ = w.wake.drain();
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
                        eprintln!("daxkv: {}: submission ring {i}: {e}", self.name);
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
        let Some(slot) = inner.task(sqe.task) else {
            eprintln!("daxkv: {}: SQE for unknown task {}", self.name, sqe.task);
            return;
        };
        let Some(task) = slot.rec.read().filter(|t| t.id == sqe.task) else {
            eprintln!("daxkv: {}: SQE for unknown task {}", self.name, sqe.task);
            return;
        };
        let (start, len) = (sqe.start as usize, sqe.len as usize);
        if start
            .checked_add(len)
            .is_none_or(|end| end > task.keys.len())
        {
            eprintln!(
                "daxkv: {}: SQE range {start}+{len} outside task {}",
                self.name, sqe.task
            );
            return;
        }
        // ORDERING: Relaxed — a statistic.
        self.parts.fetch_add(1, Ordering::Relaxed);
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| self.run_part(&task, start, len)));
        if let Err(p) = r {
            eprintln!(
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
        let cqe = last.then(|| self.finish(&task));
        // Let go of the record before publishing: a collector that sees
        // the task done can take it at once, without waiting for us.
        drop(task);
        if let Some(cqe) = cqe {
            self.publish(slot, cqe);
        }
    }

    fn run_part(&mut self, task: &TaskRec, start: usize, len: usize) {
        let inner = &self.inner;
        let devs = inner.devices.load();
        let keys = &task.keys[start..start + len];
        if let Some(bad) = inner.opts.panic_on_key {
            assert!(!keys.contains(&bad), "injected panic");
        }
        match task.op {
            Op::Store => store_part(inner, &devs, task, start, len),
            Op::Lookup => {
                // One batched call per readable device over the keys still
                // missing (upstream's grouping, reference §3.6 step 3).
                let Scratch {
                    left,
                    keys: batch,
                    hits,
                } = &mut self.scratch;
                left.clear();
                left.extend(0..len);
                for d in devs.iter().filter(|d| d.state().is_readable()) {
                    if left.is_empty() {
                        break;
                    }
                    batch.clear();
                    batch.extend(left.iter().map(|&i| keys[i]));
                    hits.clear();
                    hits.resize(batch.len(), false);
                    if d.core.exists_many_into(batch, true, hits).is_err() {
                        continue;
                    }
                    let mut j = 0;
                    left.retain(|&i| {
                        let hit = hits[j];
                        j += 1;
                        if hit {
                            task.set(start + i);
                        }
                        !hit
                    });
                }
            }
            Op::Load => {
                // Parts cover disjoint index ranges; the claim checks it (a
                // duplicated part gets `None` and loads nothing).
                let Some(mut dsts) = task.dsts.claim(start, len) else {
                    return;
                };
                // Device by device, one arena session each, over the keys
                // not found yet (the result bits say which).
                for d in devs.iter().filter(|d| d.state().is_readable()) {
                    let Some(mut sess) = d.core.session() else {
                        continue;
                    };
                    let mut missing = false;
                    for (i, k) in keys.iter().enumerate() {
                        if task.is_set(start + i) {
                            continue;
                        }
                        if d.core.remap_pending() && i > 0 {
                            // Let a pending remap in instead of holding it
                            // off for the rest of a long part: re-entering
                            // waits for it (review finding).
                            drop(sess);
                            let Some(again) = d.core.session() else {
                                missing = true;
                                break;
                            };
                            sess = again;
                        }
                        if sess.load_into(*k, dsts.get_mut(i)).is_some() {
                            task.set(start + i);
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

    /// The last part is done: tell the listeners, and build the CQE.
    fn finish(&mut self, task: &TaskRec) -> Cqe {
        let ok = task.ok_count();
        // Tell the listeners before publishing, so a caller that sees the
        // result also sees the events. (Nothing is built when no listener
        // is registered: the common embedded case allocates nothing here.)
        // A listener that panics is isolated like a task part: logged,
        // counted, the task still published (issue 8, defect 5).
        let has_listeners = !self.inner.listeners.load().is_empty();
        if ok > 0 && has_listeners && task.op != Op::Lookup {
            let bitmap = task.bitmap();
            let hits: Vec<Key> = task
                .keys
                .iter()
                .enumerate()
                .filter(|(i, _)| bitmap.test(*i))
                .map(|(_, k)| *k)
                .collect();
            match task.op {
                Op::Store => {
                    let sizes = vec![self.inner.slot_bytes; hits.len()];
                    self.inner
                        .tell_listeners("on_keys_stored", |l| l.on_keys_stored(&hits, &sizes));
                }
                Op::Load => self
                    .inner
                    .tell_listeners("on_keys_accessed", |l| l.on_keys_accessed(&hits)),
                Op::Lookup => {}
            }
        }
        Cqe {
            task: task.id,
            ok: u32::from(ok == task.keys.len()),
            keys_ok: ok as u32,
        }
    }

    /// Publish a finished task: done id, CQE, in-flight count, eventfd.
    fn publish(&mut self, slot: &TaskSlot, cqe: Cqe) {
        let op = self.class;
        // ORDERING: Release — publishes the result bits, the destination
        // bytes and our guard's release to `take_done`'s Acquire.
        slot.done.store(cqe.task, Ordering::Release);
        if op == Op::Store {
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
                            eprintln!(
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
        self.inner.inflight[idx(op)].fetch_sub(1, Ordering::Release);
        let wake = match self.inner.opts.signal {
            Signal::Always => true,
            Signal::WhenWaiting => {
                // ORDERING: SeqCst fence — sleep / wake (Dekker) handshake
                // with `Engine::wait`: either we see its `waiters` count, or
                // it sees our done id (and the CQE) before it sleeps; pairs
                // with the fence in `Engine::wait`.
                fence(Ordering::SeqCst);
                // ORDERING: Relaxed — ordered by the fence above.
                self.waiters.load(Ordering::Relaxed) > 0
            }
        };
        if wake {
            let _ = self.done_fd.notify();
        }
    }
}

/// Devices a task part opens an arena session on up front.
const SESSION_DEVICES: usize = 4;

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
        // pending remap is fine (module doc, "Key ownership").
        let sessions: [Option<Session<'_>>; SESSION_DEVICES] =
            std::array::from_fn(|d| devs.get(d).and_then(|d| d.core.session()));
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
            match store_one(inner, devs, &sessions, keys[i], src) {
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
            drop(dev.core.session());
        }
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

/// Rounds of "a device was being remapped: drop the sessions, wait for
/// it, retry" one store part may take before its remaining keys fail.
const STORE_ROUNDS_MAX: usize = 64;

/// What `store_one` did.
enum Stored {
    Yes,
    No,
    /// A device it needed has a remap pending; entering would have waited
    /// while holding the key's claim. Nothing was stored; the claim is
    /// released; retry once that device's remap is over.
    WouldWait(Arc<Device>),
}

/// Run `f` under device `i`'s session: the part's own if it has one, else
/// a session for this call (a device beyond the first few, or a device
/// list that changed since the part began). `Ok(None)` if the device is
/// closing; `Err` if a remap is pending on it: the caller holds a claim
/// and must not wait (module doc, "Key ownership", and
/// `engine::tests::a_claim_holder_never_waits_for_a_remap`).
fn in_session<R>(
    devs: &[Arc<Device>],
    sessions: &[Option<Session<'_>>],
    i: usize,
    f: impl FnOnce(&Session<'_>) -> R,
) -> Result<Option<R>, Arc<Device>> {
    match sessions.get(i).and_then(Option::as_ref) {
        Some(s) => Ok(Some(f(s))),
        None => match devs[i].core.try_session() {
            Ok(s) => Ok(Some(f(&s))),
            Err(TryEnterError::Closed) => Ok(None),
            Err(TryEnterError::Busy) => Err(devs[i].clone()),
        },
    }
}

/// Store one key under its claim (module doc, "Key ownership"): a key
/// already on a readable device stays there (success, no copy); a new key
/// goes to the active device with the lowest slot usage, then the next on a
/// full device.
fn store_one(
    inner: &Inner,
    part_devs: &Arc<Vec<Arc<Device>>>,
    part_sessions: &[Option<Session<'_>>],
    key: Key,
    data: &[u8],
) -> Stored {
    // Held until we return: no other store of this key decides meanwhile.
    let _claim = inner.claims.claim(key);
    // The device list as of now, not as of the part's start: a device
    // added since may hold the key (stored there under an earlier claim,
    // whose Release our claim's Acquire observed, and with it that store's
    // list). The part's sessions serve when the list is unchanged.
    let cur = inner.devices.load();
    let (devs, sessions): (&[Arc<Device>], &[Option<Session<'_>>]) = if Arc::ptr_eq(&cur, part_devs)
    {
        (part_devs, part_sessions)
    } else {
        (&cur, &[])
    };
    for (i, d) in devs.iter().enumerate() {
        if d.state().is_readable() {
            match in_session(devs, sessions, i, |s| s.contains_live(key)) {
                Ok(Some(true)) => return Stored::Yes,
                Ok(_) => {}
                Err(dev) => return Stored::WouldWait(dev),
            }
        }
    }
    // Try writable devices in ascending usage: pick the least used one not
    // yet tried, each round (devices are few; no allocation per key).
    let mut tried: u64 = 0;
    for _ in 0..devs.len().min(64) {
        let Some((i, _)) = devs
            .iter()
            .enumerate()
            .take(64)
            .filter(|(i, d)| tried & (1 << i) == 0 && d.state().is_writable())
            .min_by(|a, b| a.1.usage().total_cmp(&b.1.usage()))
        else {
            return Stored::No;
        };
        tried |= 1 << i;
        match in_session(devs, sessions, i, |s| s.put(key, data, 0)) {
            Ok(Some(Ok(_))) => return Stored::Yes,
            Ok(Some(Err(PutError::Full | PutError::IndexFull | PutError::Closed)) | None) => {}
            Ok(Some(Err(_))) => return Stored::No,
            Err(dev) => return Stored::WouldWait(dev),
        }
    }
    Stored::No
}

#[cfg(all(test, not(daxkv_loom)))]
mod tests {
    use super::*;
    use crate::arena::ArenaSpec;

    /// Key claims met the arena gate: a store holding key K's claim entered
    /// a device per call (the device list had changed since its part
    /// began) while that device's remap was pending; the remap waited for
    /// another worker's part session on the device, and that worker waited
    /// for K's claim: a cycle, broken only when the remap gave up after the
    /// drain timeout. A claim holder must never wait on an arena: here a
    /// remap of device 0 is pending (held up by a session standing in for
    /// the other worker's part), and `store_one` with a stale device list
    /// must come back at once with `WouldWait`, having stored nothing and
    /// released the claim. Checked once with `in_session` entering through
    /// the blocking `session()`: `store_one` did not return while the
    /// remap was pending (the watchdog fired).
    #[test]
    fn a_claim_holder_never_waits_for_a_remap() {
        const SLOT: usize = 4096;
        let dev = DeviceSpec {
            path: "memfd".into(),
            core: CoreConfig::new(ArenaSpec::memfd(16 * SLOT).max_size_bytes(32 * SLOT), SLOT),
        };
        let e = Engine::open(vec![dev], SLOT, false, EngineOptions::default()).unwrap();
        let inner = e.inner.clone();
        let dev0 = inner.devices.load()[0].clone();
        let other_part = dev0.core.session().unwrap();
        let remap = {
            let dev0 = dev0.clone();
            std::thread::spawn(move || dev0.core.remap(32 * SLOT))
        };
        while !dev0.core.remap_pending() {
            std::thread::yield_now();
        }
        let key = Key::digest(b"claimed");
        let (tx, rx) = std::sync::mpsc::channel();
        let storer = {
            let inner = inner.clone();
            std::thread::spawn(move || {
                let stale = Arc::new(Vec::new()); // "the list changed since the part began"
                let r = store_one(&inner, &stale, &[], key, &[1; 64]);
                let _ = tx.send(matches!(r, Stored::WouldWait(_)));
            })
        };
        let would_wait = rx.recv_timeout(Duration::from_secs(3));
        drop(other_part); // let the remap (and a blocked storer) go
        remap.join().unwrap().unwrap();
        storer.join().unwrap();
        assert_eq!(
            would_wait,
            Ok(true),
            "store_one waited for a remap while holding a claim"
        );
        assert_eq!(inner.claims.held(), 0, "the claim was released");
        assert!(!dev0.core.exists(key, false), "nothing was stored");
    }
}
