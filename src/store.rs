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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use crate::core::{CoreConfig, DaxCore, PutOutcome, Reservation};
use crate::error::{OpenError, PutError};
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
}

impl StoreConfig {
    /// LMCache's defaults: restore workers `min(8, cpus)`, regions = workers,
    /// slab `max(256 MiB, regions × slot)`, one async put worker.
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

/// The synchronous store. `Send + Sync`; share it with an `Arc`.
pub struct DaxStore {
    core: Arc<DaxCore>,
    auto_evict: bool,
    restore_workers: usize,
    restore_max_regions: usize,
    staging_slab_bytes: usize,
    closing: AtomicBool,
    jobs: Mutex<Option<Sender<Job>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
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
                            // A panicking `on_complete` (or put) is logged
                            // and this worker keeps serving (issue 8,
                            // defect 5).
                            Ok(job) => {
                                if let Err(p) =
                                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(job))
                                {
                                    let msg = p
                                        .downcast_ref::<&str>()
                                        .map(|s| (*s).to_string())
                                        .or_else(|| p.downcast_ref::<String>().cloned())
                                        .unwrap_or_default();
                                    eprintln!(
                                        "daxkv: a put_async job panicked: {msg}; the put \
                                         worker keeps serving"
                                    );
                                }
                            }
                            Err(_) => return,
                        }
                    })
                    .map_err(|e| StoreError::Config {
                        field: "async_put_workers",
                        rule: format!("cannot start worker thread: {e}"),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DaxStore {
            core,
            auto_evict: cfg.auto_evict,
            restore_workers: cfg.restore_workers,
            restore_max_regions: cfg.restore_max_regions,
            staging_slab_bytes: cfg.staging_slab_bytes,
            closing: AtomicBool::new(false),
            jobs: Mutex::new((cfg.async_put_workers > 0).then_some(tx)),
            workers: Mutex::new(workers),
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
            // position would panic on (issue 9).
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
            // position would panic on (issue 9).
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

    /// Stop: refuse new work, wait for queued async puts, then close the
    /// core (which waits for in-flight reads and writes). Idempotent.
    ///
    /// Called on a put worker (from an `on_complete` callback, or by its
    /// dropping the last `Arc<DaxStore>`), that worker is not joined — a
    /// thread cannot wait for itself: it finishes the callback it is in and
    /// exits, since the job queue is closed. The other workers are joined.
    pub fn close(&self) {
        // ORDERING: Release — later calls see closing (pairs with `is_closing`).
        self.closing.store(true, Ordering::Release);
        drop(
            self.jobs
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        let workers =
            std::mem::take(&mut *self.workers.lock().unwrap_or_else(PoisonError::into_inner));
        let me = std::thread::current().id();
        for w in workers {
            if w.thread().id() == me {
                // Detached: it exits after this callback (queue closed).
                continue;
            }
            let _ = w.join();
        }
        *self.slab.lock().unwrap_or_else(PoisonError::into_inner) = Vec::new();
        self.core.close();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slot::{Generation, SlotId};

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
