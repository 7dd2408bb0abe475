//! # DaxStore: the synchronous facade (LMCache's non-MP `DaxBackend`)
//!
//! put / get / contains / pin / unpin / remove over one [`DaxCore`], plus what
//! the non-MP backend adds (docs/lmcache-dax-behavior.md §6): optional
//! asynchronous puts on worker threads with a completion callback, batched gets
//! with positional holes or prefix-only, a batched restore through a bounded
//! staging slab, optional auto-eviction by CLOCK, and a close that waits for
//! in-flight work.
//!
//! Differences from upstream, on purpose: `get` copies into a caller buffer
//! (no allocator callback), and a full arena with `auto_evict` evicts
//! unlocked keys by CLOCK instead of raising.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError, TryLockError};
use std::thread::{JoinHandle, ThreadId};

use crate::device::core::{CoreConfig, DaxCore, PutOutcome, Reservation, SlotWriter};
use crate::device::error::{OpenError, PutError};
use crate::key::Key;

/// Attempts of evict-then-retry before a put reports `Full` with auto-evict.
const EVICT_ROUNDS_MAX: usize = 8;

/// Configuration of a [`DaxStore`]. Validated in one place
/// ([`DaxStore::open`]); an error names the field.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// The device and slot size.
    pub core: CoreConfig,
    /// On a full arena, evict unlocked keys (CLOCK) instead of failing.
    pub auto_evict: bool,
    /// Threads serving `put_async` (LMCache `dax.async_put`). 0 disables it.
    pub async_put_workers: usize,
    /// Threads copying restore regions (`dax.restore_workers`).
    pub restore_workers: usize,
    /// Regions copied in parallel per wave (`dax.restore_max_regions`).
    pub restore_max_regions: usize,
    /// Staging slab bytes (`dax.retrieve_staging_slab_bytes`); at least
    /// `restore_max_regions × slot_bytes`. Allocated on the first restore.
    pub staging_slab_bytes: usize,
    /// Threads copying one [`DaxStore::put_batch_with`] batch (LMCache has
    /// no such key; the default is the restore default, `min(8, cpus)`).
    pub put_workers: usize,
}

impl StoreConfig {
    /// LMCache's defaults: restore workers `min(8, cpus)`, regions = workers,
    /// slab `max(256 MiB, regions × slot)`, one async put worker; batch put
    /// workers as restore workers.
    pub fn new(core: CoreConfig) -> StoreConfig {
        let workers = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .clamp(1, 8);
        let slab = (256usize << 20).max(workers * core.slot_bytes);
        StoreConfig {
            core,
            auto_evict: false,
            async_put_workers: 1,
            restore_workers: workers,
            restore_max_regions: workers,
            staging_slab_bytes: slab,
            put_workers: workers,
        }
    }
}

/// Errors of the facade.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The object is larger than a slot (upstream raises `ValueError`).
    #[error("object of {len} bytes exceeds the slot size of {slot_bytes} bytes")]
    TooLarge {
        /// Object length, bytes.
        len: usize,
        /// Slot size, bytes.
        slot_bytes: usize,
    },
    /// No free slot, and `auto_evict` is off or found nothing to evict.
    #[error("no free slots available; eviction required")]
    Full,
    /// The store is closing or closed.
    #[error("DaxStore is closing")]
    Closed,
    /// A batched call got different numbers of keys and buffers.
    #[error("{what}: {keys} keys but {bufs} buffers")]
    LengthMismatch {
        /// The operation.
        what: &'static str,
        /// Keys given.
        keys: usize,
        /// Buffers given.
        bufs: usize,
    },
    /// The destination buffer is shorter than the stored payload; nothing
    /// was copied.
    #[error("buffer of {have} bytes is too small for the {need} byte payload")]
    BufferTooSmall {
        /// Payload length, bytes.
        need: usize,
        /// Buffer length, bytes.
        have: usize,
    },
    /// A [`StoreConfig`] field is invalid (or its worker threads could not
    /// be started).
    #[error("invalid config: {field} {rule}")]
    Config {
        /// The field's name.
        field: &'static str,
        /// What is wrong with it.
        rule: String,
    },
    /// `put_async` with `async_put_workers = 0`.
    #[error("async put is disabled (async_put_workers = 0)")]
    AsyncDisabled,
    /// Opening the core failed.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// A put failed for another reason ([`PutError::Canceled`],
    /// [`PutError::CopyFailed`], [`PutError::IndexFull`]).
    #[error("put failed: {0}")]
    Put(PutError),
}

impl From<PutError> for StoreError {
    fn from(e: PutError) -> StoreError {
        match e {
            PutError::TooLarge { len, slot_bytes } => StoreError::TooLarge { len, slot_bytes },
            PutError::Full => StoreError::Full,
            PutError::Closed => StoreError::Closed,
            other => StoreError::Put(other),
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// Run one `put_async` job on the calling thread. A panicking
/// `on_complete` (or put) is logged and the caller keeps serving.
fn run_job(job: Job) {
    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)) {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        log_line!("daxkv: a put_async job panicked: {msg}; the put worker keeps serving");
    }
}

/// The synchronous store. `Send + Sync`; share it with an `Arc`.
pub struct DaxStore {
    core: Arc<DaxCore>,
    auto_evict: bool,
    restore_workers: usize,
    restore_max_regions: usize,
    staging_slab_bytes: usize,
    put_workers: usize,
    closing: AtomicBool,
    /// Held by `close` from start to end (a second closer waits for the
    /// first); true once a close finished.
    close_lock: Mutex<bool>,
    jobs: Mutex<Option<Sender<Job>>>,
    /// The queue's consumer end, shared by the put workers (and drained by
    /// a worker that closes the store, `close`).
    queue: Arc<Mutex<Receiver<Job>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    /// The put workers' thread ids (fixed at open): `close` on one of them
    /// must neither join nor wait for itself.
    worker_ids: Vec<ThreadId>,
    /// The staging slab; restores serialize on it (upstream serializes them
    /// on one dispatch thread).
    slab: Mutex<Vec<u8>>,
}

impl std::fmt::Debug for DaxStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaxStore")
            .field("core", &self.core)
            .finish_non_exhaustive()
    }
}

fn positive(field: &'static str, v: usize) -> Result<(), StoreError> {
    if v == 0 {
        return Err(StoreError::Config {
            field,
            rule: "must be a positive integer (got 0)".into(),
        });
    }
    Ok(())
}

impl DaxStore {
    /// Validate `cfg`, map the device and start the async put workers.
    /// Nothing leaks on failure (the core unmaps and closes its fd on drop).
    pub fn open(cfg: &StoreConfig) -> Result<DaxStore, StoreError> {
        positive("restore_workers", cfg.restore_workers)?;
        positive("put_workers", cfg.put_workers)?;
        positive("restore_max_regions", cfg.restore_max_regions)?;
        let need = cfg.restore_max_regions.saturating_mul(cfg.core.slot_bytes);
        if cfg.staging_slab_bytes < need {
            return Err(StoreError::Config {
                field: "staging_slab_bytes",
                rule: format!(
                    "must be at least restore_max_regions x slot_bytes = {need} (got {})",
                    cfg.staging_slab_bytes
                ),
            });
        }
        let core = Arc::new(DaxCore::open(&cfg.core)?);
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..cfg.async_put_workers)
            .map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("daxkv-put-{i}"))
                    .spawn(move || loop {
                        let job = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
                        match job {
                            Ok(job) => run_job(job),
                            Err(_) => return,
                        }
                    })
                    .map_err(|e| StoreError::Config {
                        field: "async_put_workers",
                        rule: format!("cannot start worker thread: {e}"),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let worker_ids = workers.iter().map(|w| w.thread().id()).collect();
        Ok(DaxStore {
            core,
            auto_evict: cfg.auto_evict,
            restore_workers: cfg.restore_workers,
            restore_max_regions: cfg.restore_max_regions,
            staging_slab_bytes: cfg.staging_slab_bytes,
            put_workers: cfg.put_workers,
            closing: AtomicBool::new(false),
            close_lock: Mutex::new(false),
            jobs: Mutex::new((cfg.async_put_workers > 0).then_some(tx)),
            queue: rx,
            workers: Mutex::new(workers),
            worker_ids,
            slab: Mutex::new(Vec::new()),
        })
    }

    /// The underlying core (status, usage, snapshots).
    pub fn core(&self) -> &DaxCore {
        &self.core
    }

    fn is_closing(&self) -> bool {
        // ORDERING: Acquire — pairs with the Release store in `close`.
        self.closing.load(Ordering::Acquire)
    }

    /// Store `data` under `key`. Oversized data is an error naming both
    /// sizes; a full arena is an error unless `auto_evict` is set.
    pub fn put(&self, key: Key, data: &[u8]) -> Result<PutOutcome, StoreError> {
        if self.is_closing() {
            return Err(StoreError::Closed);
        }
        put_evicting(&self.core, self.auto_evict, key, data)
    }

    /// `put` with a caller tag (e.g. a dtype / format code) kept with the
    /// payload and returned by [`DaxStore::info`].
    pub fn put_tagged(&self, key: Key, data: &[u8], tag: u32) -> Result<PutOutcome, StoreError> {
        if self.is_closing() {
            return Err(StoreError::Closed);
        }
        put_evicting_tagged(&self.core, self.auto_evict, key, data, tag)
    }

    /// Payload length and tag of a stored key.
    pub fn info(&self, key: Key) -> Option<(usize, u32)> {
        if self.is_closing() {
            return None;
        }
        self.core.payload_len(key)
    }

    /// Store on a worker thread; `on_complete` runs there with the result.
    /// Size and closing are checked here, synchronously.
    pub fn put_async(
        &self,
        key: Key,
        data: Arc<[u8]>,
        on_complete: impl FnOnce(Result<PutOutcome, StoreError>) + Send + 'static,
    ) -> Result<(), StoreError> {
        if self.is_closing() {
            return Err(StoreError::Closed);
        }
        let slot_bytes = self.core.slot_bytes();
        if data.len() > slot_bytes {
            return Err(StoreError::TooLarge {
                len: data.len(),
                slot_bytes,
            });
        }
        let jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(tx) = jobs.as_ref() else {
            return Err(if self.is_closing() {
                StoreError::Closed
            } else {
                StoreError::AsyncDisabled
            });
        };
        let core = self.core.clone();
        let auto_evict = self.auto_evict;
        tx.send(Box::new(move || {
            on_complete(put_evicting(&core, auto_evict, key, &data));
        }))
        .map_err(|_| StoreError::Closed)
    }

    /// Copy `key`'s payload into `dst`: `Some(len)` on a hit, `None` on a
    /// miss or after close. A too-short `dst` is an error and is untouched.
    pub fn get(&self, key: Key, dst: &mut [u8]) -> Result<Option<usize>, StoreError> {
        if self.is_closing() {
            return Ok(None);
        }
        let set = self.core.reserve_reads(&[key], false);
        let Some(r) = set.items().first() else {
            return Ok(None);
        };
        set.read(r, dst)
            .map(Some)
            .ok_or(StoreError::BufferTooSmall {
                need: r.len,
                have: dst.len(),
            })
    }

    /// `get` into a fresh vector.
    pub fn get_vec(&self, key: Key) -> Option<Vec<u8>> {
        if self.is_closing() {
            return None;
        }
        let set = self.core.reserve_reads(&[key], false);
        let r = set.items().first()?;
        let mut v = vec![0u8; r.len];
        set.read(r, &mut v)?;
        Some(v)
    }

    /// Whether `key` is stored; with `pin`, a hit is also pinned.
    pub fn contains(&self, key: Key, pin: bool) -> bool {
        self.core.exists(key, pin)
    }

    /// True while a put of `key` is in flight.
    pub fn exists_in_put_tasks(&self, key: Key) -> bool {
        self.core.has_inflight(key)
    }

    /// Pin (lock + 1) if present; returns whether it is present. Pins are
    /// refcounted: each pin needs an unpin.
    pub fn pin(&self, key: Key) -> bool {
        self.core.exists(key, true)
    }

    /// Unpin (lock − 1); returns whether the key still exists.
    pub fn unpin(&self, key: Key) -> bool {
        self.core.unlock_many(&[key]);
        self.core.exists(key, false)
    }

    /// Remove `key`, canceling an in-flight put and ignoring pins (LMCache's
    /// `remove(force=True)` default).
    pub fn remove(&self, key: Key) -> bool {
        self.remove_with(key, true)
    }

    /// Remove with an explicit `force`.
    pub fn remove_with(&self, key: Key, force: bool) -> bool {
        self.core.delete_many(&[key], force)[0]
    }

    /// Remove many (forced); returns how many were removed.
    pub fn batched_remove(&self, keys: &[Key]) -> usize {
        self.core
            .delete_many(keys, true)
            .into_iter()
            .filter(|&b| b)
            .count()
    }

    /// Number of consecutive hits from the start; pins each if asked.
    pub fn batched_contains(&self, keys: &[Key], pin: bool) -> usize {
        keys.iter()
            .take_while(|&&k| self.core.exists(k, pin))
            .count()
    }

    /// Load many: per key `Some(len)` or `None` (a hole: miss or short
    /// buffer). `StoreError::Closed` after close (batched reads too).
    pub fn batched_get(
        &self,
        keys: &[Key],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<Option<usize>>, StoreError> {
        check_lengths("batched_get", keys, bufs)?;
        if self.is_closing() {
            // An error, not an empty vector that a caller indexing by
            // position would panic on.
            return Err(StoreError::Closed);
        }
        let mut out = vec![None; keys.len()];
        let set = self.core.reserve_reads(keys, false);
        for r in set.items() {
            out[r.index] = set.read(r, bufs[r.index]);
        }
        Ok(out)
    }

    /// Load the consecutive hit prefix only (LMCache's non-blocking get);
    /// returns the prefix length.
    pub fn batched_get_prefix(
        &self,
        keys: &[Key],
        bufs: &mut [&mut [u8]],
    ) -> Result<usize, StoreError> {
        check_lengths("batched_get_prefix", keys, bufs)?;
        if self.is_closing() {
            return Err(StoreError::Closed);
        }
        let set = self.core.reserve_reads(keys, true);
        let mut n = 0;
        for r in set.items() {
            if set.read(r, bufs[r.index]).is_none() {
                break;
            }
            n += 1;
        }
        Ok(n)
    }

    /// Batched restore through the staging slab (docs/lmcache-dax-behavior.md
    /// §6.4): the reservations are sorted by device offset, packed into regions
    /// of at most `slab / restore_max_regions` bytes with adjacent device spans
    /// merged into one copy, each wave's regions copied in parallel, then
    /// scattered to the outputs. Same result shape as `batched_get`.
    pub fn batched_restore(
        &self,
        keys: &[Key],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<Option<usize>>, StoreError> {
        check_lengths("batched_restore", keys, bufs)?;
        if self.is_closing() {
            // An error, not an empty vector that a caller indexing by
            // position would panic on.
            return Err(StoreError::Closed);
        }
        let mut out = vec![None; keys.len()];
        let set = self.core.reserve_reads(keys, false);
        let mut items: Vec<Reservation> = set
            .items()
            .iter()
            .copied()
            .filter(|r| bufs[r.index].len() >= r.len)
            .collect();
        items.sort_by_key(|r| r.offset);
        let regions = plan_regions(&items, self.staging_slab_bytes / self.restore_max_regions);

        let mut slab = self.slab.lock().unwrap_or_else(PoisonError::into_inner);
        if slab.len() != self.staging_slab_bytes {
            *slab = vec![0u8; self.staging_slab_bytes];
        }
        let region_bytes = self.staging_slab_bytes / self.restore_max_regions;
        // Hand each output buffer to the region that fills it.
        let mut outs: Vec<Option<&mut [u8]>> = bufs.iter_mut().map(|b| Some(&mut **b)).collect();
        let set = &set;
        for wave in regions.chunks(self.restore_max_regions) {
            let mut slices = slab.chunks_mut(region_bytes);
            let jobs: Vec<_> = wave
                .iter()
                .map(|region| {
                    let dsts: Vec<(Reservation, &mut [u8])> = region
                        .items
                        .iter()
                        .map(|r| (*r, outs[r.index].take().expect("each key restores once")))
                        .collect();
                    (region, slices.next().expect("a slice per region"), dsts)
                })
                .collect();
            let run = |(region, slice, dsts): RegionJob<'_, '_>| -> Vec<(usize, usize)> {
                for sp in &region.spans {
                    if !set.read_span(
                        &region.items[sp.first..sp.first + sp.count],
                        &mut slice[sp.slab_offset..sp.slab_offset + sp.len],
                    ) {
                        return Vec::new();
                    }
                }
                dsts.into_iter()
                    .map(|(r, dst)| {
                        let at = region.slab_offset_of(&r);
                        dst[..r.len].copy_from_slice(&slice[at..at + r.len]);
                        (r.index, r.len)
                    })
                    .collect()
            };
            let done: Vec<(usize, usize)> = if jobs.len() <= 1 || self.restore_workers <= 1 {
                jobs.into_iter().flat_map(run).collect()
            } else {
                std::thread::scope(|s| {
                    let hs: Vec<_> = jobs.into_iter().map(|j| s.spawn(move || run(j))).collect();
                    hs.into_iter()
                        .flat_map(|h| h.join().unwrap_or_default())
                        .collect()
                })
            };
            for (i, len) in done {
                out[i] = Some(len);
            }
        }
        Ok(out)
    }

    /// `put_tagged` with the copy left to `writer` (upstream's
    /// `put_one(writer=...)`): the slot is reserved and the key in flight
    /// while `writer` fills `len` bytes through the [`SlotWriter`]; returning
    /// false fails the store (the slot is freed, [`PutError::CopyFailed`]).
    /// Lets a binding copy straight from caller memory, or run a hook while
    /// the store is in flight. With `auto_evict`, `writer` may be called
    /// again after an eviction, but only one call ever reaches the copy.
    pub fn put_with_writer(
        &self,
        key: Key,
        len: usize,
        tag: u32,
        mut writer: impl FnMut(&SlotWriter<'_>) -> bool,
    ) -> Result<PutOutcome, StoreError> {
        if self.is_closing() {
            return Err(StoreError::Closed);
        }
        let slot_bytes = self.core.slot_bytes();
        if len > slot_bytes {
            return Err(StoreError::TooLarge { len, slot_bytes });
        }
        for _ in 0..EVICT_ROUNDS_MAX {
            match self.core.put_with_writer(key, len, tag, &mut writer) {
                Err(PutError::Full) if self.auto_evict => {
                    let victims = self.core.eviction_candidates(1);
                    if victims.is_empty() {
                        return Err(StoreError::Full);
                    }
                    self.core.delete_many(&victims, false);
                }
                r => return r.map_err(StoreError::from),
            }
        }
        Err(StoreError::Full)
    }

    /// Store a batch: item `i` is `(key, len, tag)`, its bytes written by
    /// `write(i, writer)` while the key is in flight (as
    /// [`DaxStore::put_with_writer`]).
    ///
    /// In order on the calling thread, stopping at the first item that finds
    /// no free slot: the items before it are stored, it and the ones after
    /// are not tried (upstream's batched put). A batch of at least
    /// 2 × [`REGION_MIN_BYTES`] whose items all fit the free slots is
    /// instead shared by the caller and up to `put_workers - 1` scoped
    /// threads (`dax-put-<i>`) that take the items in order from one cursor
    /// (a descheduled worker holds up one item, not a share of the batch)
    /// and stop at any item past one found full. Only a concurrent writer
    /// can fill the arena during such a batch; then every item before
    /// `full_at` was still tried, but a few after it (taken before the full
    /// one was seen) may be stored too: each result says.
    pub fn put_batch_with(
        &self,
        items: &[(Key, usize, u32)],
        write: impl Fn(usize, &SlotWriter<'_>) -> bool + Sync,
    ) -> BatchPut {
        let n = items.len();
        let total: usize = items.iter().map(|&(_, len, _)| len).sum();
        let free = self
            .core
            .max_slots()
            .saturating_sub(self.core.live_slot_count());
        let workers = if total >= 2 * REGION_MIN_BYTES && n <= free {
            self.put_workers.min(n).min(total / REGION_MIN_BYTES).max(1)
        } else {
            1
        };
        // The next item to take, and the first item found full
        // (`usize::MAX`: none yet).
        let next = AtomicUsize::new(0);
        let full_at = AtomicUsize::new(usize::MAX);
        let work = || -> Vec<(usize, Result<PutOutcome, StoreError>)> {
            let mut done = Vec::new();
            loop {
                // ORDERING: Relaxed — the cursor only hands out indices (each
                // once); the results travel back through the joins.
                let i = next.fetch_add(1, Ordering::Relaxed);
                // ORDERING: Relaxed — a hint to stop early, as above.
                if i >= n || full_at.load(Ordering::Relaxed) < i {
                    return done;
                }
                let (key, len, tag) = items[i];
                match self.put_with_writer(key, len, tag, |w| write(i, w)) {
                    Err(StoreError::Full | StoreError::Put(PutError::IndexFull)) => {
                        // ORDERING: Relaxed — as above.
                        full_at.fetch_min(i, Ordering::Relaxed);
                        return done;
                    }
                    r => done.push((i, r)),
                }
            }
        };
        let mut results: Vec<Option<Result<PutOutcome, StoreError>>> =
            std::iter::repeat_with(|| None).take(n).collect();
        let mut place = |done: Vec<(usize, Result<PutOutcome, StoreError>)>| {
            for (i, r) in done {
                results[i] = Some(r);
            }
        };
        for part in on_threads(workers, "dax-put", &work) {
            place(part);
        }
        // ORDERING: Relaxed — the workers were joined.
        let full = full_at.load(Ordering::Relaxed);
        BatchPut {
            results,
            full_at: (full != usize::MAX).then_some(full),
        }
    }

    /// Batched restore into destinations chosen once the hits are known
    /// (LMCache allocates each output by the shape, dtype and format stored
    /// with it; docs/lmcache-dax-behavior.md §6.4).
    ///
    /// 1. The keys are reserved (positional, or the hit prefix with
    ///    `prefix_only`): each hit's slot is read-pinned, so a key removed
    ///    from now on keeps its slot (and bytes) until this call returns,
    ///    and the slot is reused only after that.
    /// 2. `alloc` gets the reservations (hits, in key order; `index` is the
    ///    key's position) and returns one destination per reservation, at
    ///    least as long as its payload. It is not called when nothing hit.
    /// 3. The reservations are sorted by device offset and cut into regions
    ///    of at most `staging_slab_bytes / restore_max_regions` bytes, about
    ///    a quarter of a `restore_max_regions`-th of the batch each, never
    ///    under [`REGION_MIN_BYTES`] (a thread costs more than it saves
    ///    below that); device-adjacent payloads stay in one region and are
    ///    read back to back. The caller and up to
    ///    `min(restore_workers, restore_max_regions) - 1` scoped threads
    ///    (`dax-restore-<i>`) take the regions in device order from one
    ///    queue: at most that many regions are copied at once.
    /// 4. The payloads go straight from the device into the destinations:
    ///    one copy, no staging slab (the slab bound is kept as the region
    ///    size); with streaming stores from [`RESTORE_STREAM_MIN_BYTES`] in
    ///    all. Bytes past a payload are untouched.
    ///
    /// Returns the reservations restored (all of them: a destination that
    /// is missing or too short fails the whole call before anything is
    /// copied). The read pins drop when it returns.
    pub fn restore_into<'d, E>(
        &self,
        keys: &[Key],
        prefix_only: bool,
        alloc: impl FnOnce(&[Reservation]) -> Result<Vec<&'d mut [u8]>, E>,
    ) -> Result<Vec<Reservation>, RestoreError<E>> {
        if self.is_closing() {
            return Err(RestoreError::Closed);
        }
        // The read pins live as long as `set`, to the end of this call. The
        // interleaving they rule out: `alloc` (Python, LMCache's allocator)
        // runs for a while; meanwhile key K is removed and a put of K2 takes
        // K's slot; the copy below would then hand K2's bytes (or a torn mix
        // of both) out as K's. Pinned, K's slot is only detached by the
        // remove (PENDING_FREE) and freed when `set` drops
        // (tests/store.rs, `restore_into_keeps_a_removed_keys_slot...`).
        let set = self.core.reserve_reads(keys, prefix_only);
        if set.is_empty() {
            return Ok(Vec::new());
        }
        let items = set.items();
        let dsts = alloc(items).map_err(RestoreError::Alloc)?;
        if dsts.len() != items.len() {
            return Err(RestoreError::Destinations {
                want: items.len(),
                got: dsts.len(),
            });
        }
        if let Some((at, (r, d))) = items
            .iter()
            .zip(&dsts)
            .enumerate()
            .find(|(_, (r, d))| d.len() < r.len)
        {
            return Err(RestoreError::BufferTooSmall {
                at,
                index: r.index,
                need: r.len,
                have: d.len(),
            });
        }
        let total_bytes: usize = items.iter().map(|r| r.len).sum();
        let mut sorted: Vec<(Reservation, &'d mut [u8])> =
            items.iter().copied().zip(dsts).collect();
        sorted.sort_by_key(|(r, _)| r.offset);
        let regions = plan_direct(
            sorted,
            self.staging_slab_bytes / self.restore_max_regions,
            self.restore_max_regions * REGIONS_PER_WORKER,
        );
        // Each destination was moved into exactly one region, so two
        // workers never write one output; they share only `set`, whose
        // reads copy out of slots no writer can take while they are pinned.
        let set = &set;
        let stream = total_bytes >= RESTORE_STREAM_MIN_BYTES;
        let copy_region = |region: Vec<(Reservation, &mut [u8])>| -> bool {
            region.into_iter().all(|(r, dst)| {
                let n = if stream {
                    set.read_streaming(&r, dst)
                } else {
                    set.read(&r, dst)
                };
                n == Some(r.len)
            })
        };
        let threads = self
            .restore_workers
            .min(self.restore_max_regions)
            .min(regions.len());
        // The regions in device order, taken one at a time by whichever
        // worker is free: at most `threads` are copied at once.
        let queue = Mutex::new(regions.into_iter());
        let work = || -> bool {
            let mut ok = true;
            loop {
                let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
                match next {
                    Some(region) => ok &= copy_region(region),
                    None => return ok,
                }
            }
        };
        let ok = on_threads(threads, "dax-restore", &work)
            .into_iter()
            .fold(true, |a, b| a & b);
        if ok {
            Ok(items.to_vec())
        } else {
            Err(RestoreError::CopyFailed)
        }
    }

    /// Stop: refuse new work, run every `put_async` job already accepted
    /// (each completes as it would have), then close the core (which waits
    /// for in-flight reads and writes). Idempotent, and closers are
    /// serialized: a second `close` returns once the first has finished,
    /// not before (a caller may free what the store wrote for it once close
    /// returns).
    ///
    /// Called on a put worker (from an `on_complete` callback, or by its
    /// dropping the last `Arc<DaxStore>`), that worker is not joined — a
    /// thread cannot wait for itself: it runs the jobs still queued itself,
    /// closes the core, and exits after the callback it is in. If another
    /// thread is closing already (and joining this worker), the worker's
    /// `close` returns at once; that closer finishes the close after this
    /// worker's jobs.
    pub fn close(&self) {
        // ORDERING: Release — later calls see closing (pairs with `is_closing`).
        self.closing.store(true, Ordering::Release);
        let me = std::thread::current().id();
        let on_worker = self.worker_ids.contains(&me);
        let mut done = if on_worker {
            match self.close_lock.try_lock() {
                Ok(g) => g,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                // A closer holds it and joins this worker: waiting here
                // would wait for ourselves. Stop new jobs; the closer
                // finishes after this callback.
                Err(TryLockError::WouldBlock) => {
                    drop(self.take_jobs());
                    return;
                }
            }
        } else {
            self.close_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        if *done {
            return;
        }
        // No job is accepted from here on; the queued ones stay queued.
        drop(self.take_jobs());
        let workers =
            std::mem::take(&mut *self.workers.lock().unwrap_or_else(PoisonError::into_inner));
        for w in workers {
            if w.thread().id() == me {
                // Detached: it exits after this callback (queue closed).
                continue;
            }
            // A worker exits once the queue is closed and empty: joining
            // it waits for the jobs it took.
            let _ = w.join();
        }
        if on_worker {
            // The other workers have exited; jobs still queued would run
            // on this worker only after the callback it is in, after the
            // core closes: run them now.
            loop {
                let job = self
                    .queue
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .try_recv();
                match job {
                    Ok(job) => run_job(job),
                    Err(_) => break,
                }
            }
        }
        *self.slab.lock().unwrap_or_else(PoisonError::into_inner) = Vec::new();
        self.core.close();
        *done = true;
    }

    fn take_jobs(&self) -> Option<Sender<Job>> {
        self.jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

impl Drop for DaxStore {
    fn drop(&mut self) {
        self.close();
    }
}

fn check_lengths(what: &'static str, keys: &[Key], bufs: &[&mut [u8]]) -> Result<(), StoreError> {
    if keys.len() == bufs.len() {
        Ok(())
    } else {
        Err(StoreError::LengthMismatch {
            what,
            keys: keys.len(),
            bufs: bufs.len(),
        })
    }
}

fn put_evicting(
    core: &DaxCore,
    auto_evict: bool,
    key: Key,
    data: &[u8],
) -> Result<PutOutcome, StoreError> {
    put_evicting_tagged(core, auto_evict, key, data, 0)
}

fn put_evicting_tagged(
    core: &DaxCore,
    auto_evict: bool,
    key: Key,
    data: &[u8],
    tag: u32,
) -> Result<PutOutcome, StoreError> {
    for _ in 0..EVICT_ROUNDS_MAX {
        match core.put(key, data, tag) {
            Err(PutError::Full) if auto_evict => {
                let victims = core.eviction_candidates(1);
                if victims.is_empty() {
                    return Err(StoreError::Full);
                }
                core.delete_many(&victims, false);
            }
            r => return r.map_err(StoreError::from),
        }
    }
    Err(StoreError::Full)
}

/// Smallest region [`DaxStore::restore_into`] gives a thread of its own
/// (and the smallest share of a [`DaxStore::put_batch_with`] batch).
pub const REGION_MIN_BYTES: usize = 1 << 20;

/// A restore of at least this many bytes writes its outputs with streaming
/// stores ([`crate::device::copy::from_dax_streaming`]): half the last-level cache
/// of the machines this was measured on (32 MiB). A batch that size evicts
/// its own outputs anyway, and skipping the read-for-ownership of each
/// output line took a 512 MiB restore from ~19 to ~33 GB/s there.
pub const RESTORE_STREAM_MIN_BYTES: usize = 16 << 20;

/// [`DaxStore::restore_into`] cuts a batch into this many regions per
/// region slot (`restore_max_regions`), so a worker that is descheduled
/// holds up a small region while the others take the rest.
const REGIONS_PER_WORKER: usize = 4;

/// Cut offset-sorted (reservation, destination) pairs into regions for
/// [`DaxStore::restore_into`]: a region closes once it holds
/// `max(total / regions, REGION_MIN_BYTES)` bytes, or when the next payload
/// would take it past `region_bytes`; a single payload always fits (the
/// store's config keeps `region_bytes >= slot_bytes`).
fn plan_direct<T>(
    sorted: Vec<(Reservation, T)>,
    region_bytes: usize,
    regions: usize,
) -> Vec<Vec<(Reservation, T)>> {
    let total: usize = sorted.iter().map(|(r, _)| r.len).sum();
    let target = total.div_ceil(regions.max(1)).max(REGION_MIN_BYTES);
    let mut out: Vec<Vec<(Reservation, T)>> = Vec::new();
    let mut used = 0usize;
    for (r, d) in sorted {
        let full = used >= target || used + r.len > region_bytes;
        if out.is_empty() || (used > 0 && full) {
            out.push(Vec::new());
            used = 0;
        }
        used += r.len;
        out.last_mut().expect("just pushed").push((r, d));
    }
    out
}

/// What [`DaxStore::put_batch_with`] did.
#[derive(Debug)]
pub struct BatchPut {
    /// Per item: its put's result, or `None` if it was not tried (it found
    /// the arena full, or came after an item that did).
    pub results: Vec<Option<Result<PutOutcome, StoreError>>>,
    /// The first item that found no free slot, if any.
    pub full_at: Option<usize>,
}

/// Why [`DaxStore::restore_into`] restored nothing.
#[derive(Debug)]
pub enum RestoreError<E> {
    /// The store is closing or closed.
    Closed,
    /// The caller's `alloc` failed; nothing was copied.
    Alloc(E),
    /// `alloc` returned `got` destinations for `want` reservations.
    Destinations {
        /// Reservations made.
        want: usize,
        /// Destinations returned.
        got: usize,
    },
    /// The destination of reservation `at` (key position `index`) is
    /// shorter than its payload; nothing was copied.
    BufferTooSmall {
        /// Position among the reservations.
        at: usize,
        /// The key's position in the caller's list.
        index: usize,
        /// Payload length, bytes.
        need: usize,
        /// Destination length, bytes.
        have: usize,
    },
    /// A copy failed (a region's worker thread could not be started); the
    /// destinations may hold partial data.
    CopyFailed,
}

impl<E: std::fmt::Display> std::fmt::Display for RestoreError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RestoreError::Closed => f.write_str("DaxStore is closing"),
            RestoreError::Alloc(e) => write!(f, "allocating the restore outputs failed: {e}"),
            RestoreError::Destinations { want, got } => {
                write!(f, "{got} destinations for {want} reservations")
            }
            RestoreError::BufferTooSmall {
                index, need, have, ..
            } => write!(
                f,
                "destination for key {index} is {have} bytes, too small for its {need} byte payload"
            ),
            RestoreError::CopyFailed => f.write_str("a restore region failed to copy"),
        }
    }
}

impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for RestoreError<E> {}

/// One region's work: its plan, its slab slice, and the outputs it fills.
type RegionJob<'r, 'b> = (&'r Region, &'b mut [u8], Vec<(Reservation, &'b mut [u8])>);

/// A contiguous device range copied into the slab in one go.
#[derive(Debug, PartialEq, Eq)]
struct Span {
    device_offset: usize,
    slab_offset: usize,
    len: usize,
    /// The region's items this span is made of: `items[first..first + count]`.
    first: usize,
    count: usize,
}

/// One slab region: its spans and the reservations they cover.
#[derive(Debug, Default)]
struct Region {
    spans: Vec<Span>,
    items: Vec<Reservation>,
    /// Slab offset of each item (parallel to `items`).
    at: Vec<usize>,
    used: usize,
}

impl Region {
    fn slab_offset_of(&self, r: &Reservation) -> usize {
        let i = self
            .items
            .iter()
            .position(|x| x == r)
            .expect("item of this region");
        self.at[i]
    }
}

/// Pack offset-sorted reservations greedily into regions of at most
/// `region_bytes`; merge device-adjacent items into one span.
fn plan_regions(items: &[Reservation], region_bytes: usize) -> Vec<Region> {
    let mut regions: Vec<Region> = Vec::new();
    for r in items {
        if regions.last().is_none_or(|g| g.used + r.len > region_bytes) {
            regions.push(Region::default());
        }
        let g = regions.last_mut().expect("just pushed");
        let at = g.used;
        match g.spans.last_mut() {
            Some(sp) if sp.device_offset + sp.len == r.offset && sp.slab_offset + sp.len == at => {
                sp.len += r.len;
                sp.count += 1;
            }
            _ => g.spans.push(Span {
                device_offset: r.offset,
                slab_offset: at,
                len: r.len,
                first: g.items.len(),
                count: 1,
            }),
        }
        g.items.push(*r);
        g.at.push(at);
        g.used += r.len;
    }
    regions
}

/// Run `work` on the caller and on `threads - 1` scoped helpers named
/// `{name}-{j}`, and return every result, the caller's first. A helper that
/// cannot start leaves its share to the others (the caller always works,
/// and `work` takes items from a shared cursor). Every helper is joined
/// before this returns, so none outlives what `work` borrows; a helper's
/// panic goes on in the caller, as it would have run there in order.
fn on_threads<R: Send>(threads: usize, name: &str, work: &(impl Fn() -> R + Sync)) -> Vec<R> {
    if threads <= 1 {
        return vec![work()];
    }
    std::thread::scope(|s| {
        let hs: Vec<_> = (1..threads)
            .filter_map(|j| {
                std::thread::Builder::new()
                    .name(format!("{name}-{j}"))
                    .spawn_scoped(s, work)
                    .ok()
            })
            .collect();
        let mut parts = vec![work()];
        for h in hs {
            parts.push(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        }
        parts
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::slot::{Generation, SlotId};

    fn res(index: usize, slot: u32, len: usize, slot_bytes: usize) -> Reservation {
        Reservation {
            index,
            key: Key::from_u128(index as u128 + 1),
            slot: SlotId(slot),
            generation: Generation(1),
            offset: slot as usize * slot_bytes,
            len,
            meta: 0,
            pos: 0,
        }
    }

    /// `plan_direct` keeps device order, makes at most `regions` regions
    /// per wave when the bound allows, never exceeds the bound (except a
    /// lone payload), and keeps small batches in one region (no threads).
    #[test]
    fn direct_regions_balance_the_wave_within_the_bound() {
        const MIB: usize = 1 << 20;
        let sb = MIB;
        let plan = |lens: &[usize], bound: usize, regions: usize| -> Vec<Vec<usize>> {
            let items: Vec<(Reservation, ())> = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| (res(i, i as u32, n, sb), ()))
                .collect();
            plan_direct(items, bound, regions)
                .into_iter()
                .map(|g| g.into_iter().map(|(r, ())| r.index).collect())
                .collect()
        };
        // 8 x 1 MiB, 2 regions, a roomy bound: two halves.
        assert_eq!(
            plan(&[MIB; 8], 64 * MIB, 2),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
        // Three payloads of 1.5 MiB over 2 regions: 2 + 1, not 1 + 1 + 1.
        assert_eq!(plan(&[3 * MIB / 2; 3], 64 * MIB, 2).len(), 2);
        // The bound wins over the balance: 2 MiB regions, 4 of them.
        let p = plan(&[MIB; 8], 2 * MIB, 2);
        assert_eq!(p, vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        // Under 2 x REGION_MIN_BYTES in all: one region.
        assert_eq!(plan(&[4096; 100], 64 * MIB, 8).len(), 1);
        assert!(plan(&[], MIB, 2).is_empty());
    }

    #[test]
    fn regions_merge_adjacent_full_slots_and_respect_the_bound() {
        let sb = 100;
        // Slots 0,1,2 full (adjacent), slot 3 partial, slot 5 full.
        let items = vec![
            res(0, 0, 100, sb),
            res(1, 1, 100, sb),
            res(2, 2, 100, sb),
            res(3, 3, 40, sb),
            res(4, 5, 100, sb),
        ];
        let regions = plan_regions(&items, 250);
        assert_eq!(regions.len(), 2);
        assert_eq!(
            regions[0].spans,
            vec![Span {
                device_offset: 0,
                slab_offset: 0,
                len: 200,
                first: 0,
                count: 2,
            }],
            "adjacent full slots merge"
        );
        assert_eq!(
            regions[1].spans,
            vec![
                Span {
                    device_offset: 200,
                    slab_offset: 0,
                    len: 140,
                    first: 0,
                    count: 2,
                },
                Span {
                    device_offset: 500,
                    slab_offset: 140,
                    len: 100,
                    first: 2,
                    count: 1,
                },
            ],
            "a full slot then a partial one merge; a device gap starts a new span"
        );
        assert_eq!(regions[1].slab_offset_of(&items[4]), 140);
        assert!(regions.iter().all(|g| g.used <= 250));
    }
}
