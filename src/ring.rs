//! # SPSC rings: the submission and completion queues
//!
//! A single-producer single-consumer ring of fixed-size `#[repr(C)]`
//! entries (io_uring's SQ / CQ shape, rtrb's split halves). The same code
//! runs over heap memory, over a memfd that another process maps, and over
//! loom's atomics.
//!
//! ## Layout
//!
//! ```text
//! offset 0      tail   (CachePadded<AtomicU32>)  written by the producer
//! offset 128    head   (CachePadded<AtomicU32>)  written by the consumer
//! offset 256    flags  (CachePadded<AtomicU32>)  NEED_WAKEUP, set by the consumer
//! offset 384    magic, version, capacity, entry_bytes (u32 each)
//! offset 512    entries[capacity]
//! ```
//!
//! Indices are free-running `u32`s (wrapping); `capacity` is a power of two
//! and an entry lives at `index & (capacity - 1)`. Entries carry no
//! pointers, only ids and offsets ([`Pod`]).
//!
//! ## Batching
//!
//! `Producer::push` writes the entry but publishes nothing; `sync` (or drop)
//! publishes every pushed entry with one Release store of `tail`. Likewise
//! `Consumer::pop` reads entries and `sync` hands the space back with one
//! Release store of `head`. Each side caches the other's index and re-reads
//! it only when the ring looks full (producer) or empty (consumer).
//!
//! ## Sleep / wake (io_uring's `NEED_WAKEUP`)
//!
//! A consumer about to sleep sets `NEED_WAKEUP`, then re-checks `tail`; a
//! producer publishes `tail`, then checks `NEED_WAKEUP` and signals the
//! consumer's eventfd only if it is set. That is a store-buffering (Dekker)
//! pattern: each side writes one location and then reads the other's, and
//! Release/Acquire alone allows both reads to miss both writes (a lost
//! wakeup: the consumer sleeps on a non-empty ring). One `fence(SeqCst)` on
//! each side between its write and its read forbids that outcome: the fences
//! are totally ordered, so whichever side's fence comes second sees the
//! other side's write. This is the only `SeqCst` in the ring; a busy
//! consumer never sets the flag, so a busy producer never makes a syscall.
//!
//! ## Safety
//!
//! Memory shared with another process is never turned into `&E` or `&[E]`:
//! each entry is copied out with a volatile read (the peer may be writing
//! it, if it is broken), and every index read from the peer is checked
//! (`tail - head <= capacity`) before use; a violation is
//! [`RingError::Corrupt`], never an out-of-bounds access. [`Pod`] entries are
//! valid for every bit pattern, so a torn or garbage entry is still a value
//! the engine can validate and reject.

// Casts from the mapping's `*u8` to `*Header` / `*E` / `*u32`: the mapping is
// page-aligned, the header sits at offset 0 and the entries at HEADER_BYTES
// (512), which satisfies every alignment involved.
#![allow(clippy::cast_ptr_alignment)]

use std::marker::PhantomData;
use std::sync::Arc;

use crossbeam_utils::CachePadded;

use crate::sync::{fence, AtomicU32, Ordering};

/// Plain old data that may cross a process boundary.
///
/// # Safety
/// - `#[repr(C)]` with explicitly sized fields and no padding-dependent
///   invariants;
/// - every bit pattern is a valid value (no `bool`, `char`, enums,
///   references or pointers);
/// - no `Drop`.
pub unsafe trait Pod: Copy + Send + 'static {}

// SAFETY: integers are valid for every bit pattern.
unsafe impl Pod for u64 {}
// SAFETY: as above.
unsafe impl Pod for u32 {}

/// A submission: one part of a task (keys `start..start+len` of task
/// `task`). Ids and offsets only, no pointers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct Sqe {
    pub task: u64,
    pub start: u32,
    pub len: u32,
}

/// A completion: task `task` finished; `ok` is 1 when every key succeeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct Cqe {
    pub task: u64,
    pub ok: u32,
    pub keys_ok: u32,
}

const _: () = assert!(std::mem::size_of::<Sqe>() == 16);
const _: () = assert!(std::mem::size_of::<Cqe>() == 16);
// SAFETY: repr(C), integers only, no padding (size asserted above).
unsafe impl Pod for Sqe {}
// SAFETY: as above.
unsafe impl Pod for Cqe {}

const MAGIC: u32 = 0x4441_5852; // "DAXR"
const VERSION: u32 = 1;
const NEED_WAKEUP: u32 = 1;
/// Bytes before the first entry.
pub const HEADER_BYTES: usize = 512;
/// Largest capacity (entries).
pub const CAPACITY_MAX: u32 = 1 << 24;

#[repr(C)]
struct Header {
    tail: CachePadded<AtomicU32>,
    head: CachePadded<AtomicU32>,
    flags: CachePadded<AtomicU32>,
    magic: u32,
    version: u32,
    capacity: u32,
    entry_bytes: u32,
}

#[cfg(not(daxkv_loom))]
const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);

/// Ring errors (cold path).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RingError {
    #[error("ring capacity {0} must be a power of two between 1 and {CAPACITY_MAX}")]
    Capacity(u32),
    #[error("shared ring is corrupt: head {head}, tail {tail}, capacity {capacity}")]
    Corrupt { head: u32, tail: u32, capacity: u32 },
    #[error("shared ring header does not match: {0}")]
    BadHeader(String),
    #[error("ring memory: {0}")]
    Io(String),
}

/// `push` on a full ring hands the entry back (the rtrb habit).
#[derive(Debug, PartialEq, Eq)]
pub enum PushError<E> {
    Full(E),
    Corrupt(RingError),
}

enum Storage<E> {
    #[cfg(not(daxkv_loom))]
    Heap {
        header: Box<Header>,
        entries: Box<[std::cell::UnsafeCell<E>]>,
    },
    #[cfg(not(daxkv_loom))]
    Mapped { map: memmap2::MmapRaw },
    #[cfg(daxkv_loom)]
    Loom {
        header: Box<Header>,
        entries: Box<[loom::cell::UnsafeCell<E>]>,
    },
}

/// The memory of one ring. Shared by its two halves through an `Arc`.
pub struct Ring<E: Pod> {
    storage: Storage<E>,
    capacity: u32,
    _e: PhantomData<E>,
}

// SAFETY: the header is atomics; entries are accessed only by the producer
// (slots between head and tail it has not published) and the consumer
// (published slots it has not released), as the index protocol guarantees.
unsafe impl<E: Pod> Sync for Ring<E> {}
// SAFETY: the ring owns its memory; nothing is tied to a thread.
unsafe impl<E: Pod> Send for Ring<E> {}

impl<E: Pod> std::fmt::Debug for Ring<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

fn check_capacity(capacity: u32) -> Result<(), RingError> {
    if capacity == 0 || capacity > CAPACITY_MAX || !capacity.is_power_of_two() {
        return Err(RingError::Capacity(capacity));
    }
    Ok(())
}

fn new_header(capacity: u32, entry_bytes: usize) -> Header {
    Header {
        tail: CachePadded::new(AtomicU32::new(0)),
        head: CachePadded::new(AtomicU32::new(0)),
        flags: CachePadded::new(AtomicU32::new(0)),
        magic: MAGIC,
        version: VERSION,
        capacity,
        entry_bytes: entry_bytes as u32,
    }
}

impl<E: Pod> Ring<E> {
    /// Bytes a shared ring of `capacity` entries needs.
    pub fn shared_bytes(capacity: u32) -> usize {
        HEADER_BYTES + capacity as usize * std::mem::size_of::<E>()
    }

    /// A ring in this process's heap.
    pub fn heap(capacity: u32) -> Result<Arc<Ring<E>>, RingError> {
        check_capacity(capacity)?;
        let header = Box::new(new_header(capacity, std::mem::size_of::<E>()));
        // SAFETY: `E: Pod`, so the all-zero pattern is a valid `E`.
        let zero: E = unsafe { std::mem::zeroed() };
        #[cfg(not(daxkv_loom))]
        let storage = Storage::Heap {
            header,
            entries: (0..capacity)
                .map(|_| std::cell::UnsafeCell::new(zero))
                .collect(),
        };
        #[cfg(daxkv_loom)]
        let storage = Storage::Loom {
            header,
            entries: (0..capacity)
                .map(|_| loom::cell::UnsafeCell::new(zero))
                .collect(),
        };
        Ok(Arc::new(Ring {
            storage,
            capacity,
            _e: PhantomData,
        }))
    }

    /// A ring in a fresh memfd, which another process can map with
    /// [`Ring::attach`] (pass it the fd). Returns the ring and the memfd.
    #[cfg(not(daxkv_loom))]
    pub fn memfd(capacity: u32) -> Result<(Arc<Ring<E>>, std::fs::File), RingError> {
        check_capacity(capacity)?;
        let len = Self::shared_bytes(capacity);
        let file =
            crate::sys::memfd_create("daxkv-ring").map_err(|e| RingError::Io(e.to_string()))?;
        file.set_len(len as u64)
            .map_err(|e| RingError::Io(e.to_string()))?;
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| RingError::Io(e.to_string()))?;
        let h = new_header(capacity, std::mem::size_of::<E>());
        // SAFETY: the mapping is fresh, private to us until we return, at
        // least HEADER_BYTES long and page-aligned (so aligned for Header).
        unsafe { map.as_mut_ptr().cast::<Header>().write(h) };
        Ok((
            Arc::new(Ring {
                storage: Storage::Mapped { map },
                capacity,
                _e: PhantomData,
            }),
            file,
        ))
    }

    /// Map a ring another process created (or the same memfd again) and
    /// validate its header against `E` before use.
    #[cfg(not(daxkv_loom))]
    pub fn attach(file: &std::fs::File) -> Result<Arc<Ring<E>>, RingError> {
        let len = file
            .metadata()
            .map_err(|e| RingError::Io(e.to_string()))?
            .len() as usize;
        if len < HEADER_BYTES {
            return Err(RingError::BadHeader(format!(
                "{len} bytes is smaller than the header"
            )));
        }
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(file)
            .map_err(|e| RingError::Io(e.to_string()))?;
        let base = map.as_ptr();
        // SAFETY: the mapping is at least HEADER_BYTES long; the plain
        // fields sit at fixed offsets after the three cache-padded atomics
        // and are read by value (volatile: the peer could change them).
        let (magic, version, capacity, entry_bytes) = unsafe {
            let p = base
                .add(3 * std::mem::size_of::<CachePadded<AtomicU32>>())
                .cast::<u32>();
            (
                p.read_volatile(),
                p.add(1).read_volatile(),
                p.add(2).read_volatile(),
                p.add(3).read_volatile(),
            )
        };
        if magic != MAGIC || version != VERSION {
            return Err(RingError::BadHeader(format!(
                "magic {magic:#x} version {version}"
            )));
        }
        check_capacity(capacity)?;
        if entry_bytes as usize != std::mem::size_of::<E>() {
            return Err(RingError::BadHeader(format!(
                "entry size {entry_bytes}, expected {}",
                std::mem::size_of::<E>()
            )));
        }
        if len < Self::shared_bytes(capacity) {
            return Err(RingError::BadHeader(format!(
                "{len} bytes cannot hold {capacity} entries"
            )));
        }
        Ok(Arc::new(Ring {
            storage: Storage::Mapped { map },
            capacity,
            _e: PhantomData,
        }))
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    fn header(&self) -> &Header {
        match &self.storage {
            #[cfg(not(daxkv_loom))]
            Storage::Heap { header, .. } => header,
            // SAFETY: the mapping starts with an initialized `Header` (we
            // wrote it, or `attach` validated it) and lives as long as
            // `self`. Only its atomics and immutable fields are read.
            #[cfg(not(daxkv_loom))]
            Storage::Mapped { map } => unsafe { &*map.as_ptr().cast::<Header>() },
            #[cfg(daxkv_loom)]
            Storage::Loom { header, .. } => header,
        }
    }

    /// Copy `e` into slot `i` (masked).
    ///
    /// # Safety
    /// The caller is the producer and slot `i` is between the consumer's
    /// published head and `head + capacity` (not readable by the consumer).
    unsafe fn write(&self, i: u32, e: E) {
        let i = (i & (self.capacity - 1)) as usize;
        match &self.storage {
            #[cfg(not(daxkv_loom))]
            // SAFETY: per the contract no one else accesses slot i.
            Storage::Heap { entries, .. } => unsafe { entries[i].get().write(e) },
            #[cfg(not(daxkv_loom))]
            // SAFETY: i < capacity and the mapping holds `capacity` entries
            // after the header (checked at create / attach); HEADER_BYTES is
            // a multiple of any Pod's alignment up to 512. Volatile: the
            // memory is shared with another process.
            Storage::Mapped { map } => unsafe {
                map.as_mut_ptr()
                    .add(HEADER_BYTES)
                    .cast::<E>()
                    .add(i)
                    .write_volatile(e);
            },
            #[cfg(daxkv_loom)]
            // SAFETY: as for Heap; loom checks the claim.
            Storage::Loom { entries, .. } => entries[i].with_mut(|p| unsafe { p.write(e) }),
        }
    }

    /// Copy slot `i` (masked) out.
    ///
    /// # Safety
    /// The caller is the consumer and slot `i` was published by the producer
    /// and not yet released.
    unsafe fn read(&self, i: u32) -> E {
        let i = (i & (self.capacity - 1)) as usize;
        match &self.storage {
            #[cfg(not(daxkv_loom))]
            // SAFETY: per the contract the producer does not touch slot i.
            Storage::Heap { entries, .. } => unsafe { entries[i].get().read() },
            #[cfg(not(daxkv_loom))]
            // SAFETY: in bounds as in `write`; a volatile copy, never a
            // reference, since a broken peer could be writing it.
            Storage::Mapped { map } => unsafe {
                map.as_ptr()
                    .add(HEADER_BYTES)
                    .cast::<E>()
                    .add(i)
                    .read_volatile()
            },
            #[cfg(daxkv_loom)]
            // SAFETY: as for Heap; loom checks the claim.
            Storage::Loom { entries, .. } => entries[i].with(|p| unsafe { p.read() }),
        }
    }

    /// Split into the two halves. Exactly one producer and one consumer may
    /// exist per ring (across processes too): call this once per ring, or
    /// [`Producer::new`] / [`Consumer::new`] once each.
    pub fn split(self: &Arc<Self>) -> (Producer<E>, Consumer<E>) {
        (Producer::new(self.clone()), Consumer::new(self.clone()))
    }

    fn check(&self, head: u32, tail: u32) -> Result<u32, RingError> {
        let used = tail.wrapping_sub(head);
        if used > self.capacity {
            return Err(RingError::Corrupt {
                head,
                tail,
                capacity: self.capacity,
            });
        }
        Ok(used)
    }
}

/// The producing half. `Send`, not `Sync`.
pub struct Producer<E: Pod> {
    ring: Arc<Ring<E>>,
    /// Next slot to write (published up to `published`).
    tail: u32,
    published: u32,
    head_cache: u32,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

impl<E: Pod> Producer<E> {
    /// The producer of `ring`; see [`Ring::split`] for the one-producer rule.
    pub fn new(ring: Arc<Ring<E>>) -> Producer<E> {
        let h = ring.header();
        // ORDERING: Acquire — start from the indices the previous owner
        // published.
        let tail = h.tail.load(Ordering::Acquire);
        let head = h.head.load(Ordering::Acquire);
        Producer {
            ring,
            tail,
            published: tail,
            head_cache: head,
            _not_sync: PhantomData,
        }
    }

    pub fn capacity(&self) -> u32 {
        self.ring.capacity
    }

    /// Free slots, re-reading the consumer's head.
    pub fn free(&mut self) -> Result<u32, RingError> {
        // ORDERING: Acquire — pairs with the consumer's Release in `sync`:
        // slots it released are no longer read.
        self.head_cache = self.ring.header().head.load(Ordering::Acquire);
        Ok(self.ring.capacity - self.ring.check(self.head_cache, self.tail)?)
    }

    /// Write `e` into the next slot; visible to the consumer after `sync`.
    pub fn push(&mut self, e: E) -> Result<(), PushError<E>> {
        if self.tail.wrapping_sub(self.head_cache) >= self.ring.capacity {
            match self.free() {
                Ok(0) => return Err(PushError::Full(e)),
                Ok(_) => {}
                Err(c) => return Err(PushError::Corrupt(c)),
            }
        }
        // SAFETY: tail - head < capacity, so slot `tail` is not readable by
        // the consumer, and we are the only producer.
        unsafe { self.ring.write(self.tail, e) };
        self.tail = self.tail.wrapping_add(1);
        Ok(())
    }

    /// Entries pushed but not yet published.
    pub fn pending(&self) -> u32 {
        self.tail.wrapping_sub(self.published)
    }

    /// Publish every pushed entry. Returns true when the consumer asked to
    /// be woken (the caller then signals its eventfd).
    pub fn sync(&mut self) -> bool {
        if self.published == self.tail {
            return false;
        }
        let h = self.ring.header();
        // ORDERING: Release — publishes the entries written by `push` to the
        // consumer's Acquire load of `tail`.
        h.tail.store(self.tail, Ordering::Release);
        self.published = self.tail;
        // ORDERING: SeqCst fence — the Dekker handshake with
        // `Consumer::prepare_wait` (module doc): our tail store and its flag
        // store cannot both be missed by the two loads.
        fence(Ordering::SeqCst);
        // ORDERING: Relaxed — ordered by the fence above.
        h.flags.load(Ordering::Relaxed) & NEED_WAKEUP != 0
    }
}

impl<E: Pod> Drop for Producer<E> {
    fn drop(&mut self) {
        self.sync();
    }
}

/// The consuming half. `Send`, not `Sync`.
pub struct Consumer<E: Pod> {
    ring: Arc<Ring<E>>,
    /// Next slot to read (released up to `released`).
    head: u32,
    released: u32,
    tail_cache: u32,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

impl<E: Pod> Consumer<E> {
    /// The consumer of `ring`; see [`Ring::split`] for the one-consumer rule.
    pub fn new(ring: Arc<Ring<E>>) -> Consumer<E> {
        let h = ring.header();
        // ORDERING: Acquire — start from the published indices.
        let head = h.head.load(Ordering::Acquire);
        let tail = h.tail.load(Ordering::Acquire);
        Consumer {
            ring,
            head,
            released: head,
            tail_cache: tail,
            _not_sync: PhantomData,
        }
    }

    /// Published entries not yet popped, re-reading the producer's tail.
    pub fn available(&mut self) -> Result<u32, RingError> {
        // ORDERING: Acquire — pairs with the producer's Release in `sync`,
        // so the entries up to `tail` are fully written.
        self.tail_cache = self.ring.header().tail.load(Ordering::Acquire);
        self.ring.check(self.released, self.tail_cache)?;
        Ok(self.tail_cache.wrapping_sub(self.head))
    }

    /// Copy the next published entry out, if any.
    pub fn pop(&mut self) -> Result<Option<E>, RingError> {
        if self.head == self.tail_cache && self.available()? == 0 {
            return Ok(None);
        }
        // SAFETY: head < tail (published, checked against capacity) and the
        // slot is not released, so the producer does not write it.
        let e = unsafe { self.ring.read(self.head) };
        self.head = self.head.wrapping_add(1);
        Ok(Some(e))
    }

    /// Release the popped slots to the producer.
    pub fn sync(&mut self) {
        if self.released != self.head {
            // ORDERING: Release — our reads of the released slots happen
            // before the producer's Acquire of `head` lets it overwrite them.
            self.ring.header().head.store(self.head, Ordering::Release);
            self.released = self.head;
        }
    }

    /// About to sleep: ask for a wakeup, then re-check. Returns true if the
    /// ring is still empty (sleep on the eventfd, then call `end_wait`);
    /// false if an entry arrived meanwhile (the flag is already cleared).
    pub fn prepare_wait(&mut self) -> Result<bool, RingError> {
        let h = self.ring.header();
        // ORDERING: Relaxed RMW, ordered by the fence below.
        h.flags.fetch_or(NEED_WAKEUP, Ordering::Relaxed);
        // ORDERING: SeqCst fence — the Dekker handshake with
        // `Producer::sync` (module doc).
        fence(Ordering::SeqCst);
        if self.available()? > 0 {
            self.end_wait();
            return Ok(false);
        }
        Ok(true)
    }

    /// True when no producer half of this (heap) ring exists any more:
    /// whatever it published is all there will ever be.
    pub fn is_orphaned(&self) -> bool {
        Arc::strong_count(&self.ring) == 1
    }

    /// Woken (or done waiting): stop asking for wakeups.
    pub fn end_wait(&mut self) {
        // ORDERING: Relaxed — a producer that still sees the flag only
        // makes a spurious (coalesced) eventfd write.
        self.ring
            .header()
            .flags
            .fetch_and(!NEED_WAKEUP, Ordering::Relaxed);
    }
}

impl<E: Pod> Drop for Consumer<E> {
    fn drop(&mut self) {
        self.sync();
    }
}

#[cfg(all(test, not(daxkv_loom)))]
#[allow(clippy::many_single_char_names)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[repr(C)]
    struct Sqe {
        id: u64,
        op: u32,
        n: u32,
    }
    // SAFETY: repr(C), integers only, no padding.
    unsafe impl Pod for Sqe {}
    const _: () = assert!(std::mem::size_of::<Sqe>() == 16);

    #[test]
    fn push_is_invisible_until_sync_and_full_hands_back() {
        let r = Ring::<Sqe>::heap(4).unwrap();
        let (mut p, mut c) = r.split();
        for i in 0..4 {
            p.push(Sqe { id: i, op: 1, n: 0 }).unwrap();
        }
        let e = Sqe { id: 9, op: 0, n: 0 };
        assert_eq!(p.push(e), Err(PushError::Full(e)));
        assert_eq!(c.pop().unwrap(), None, "not published yet");
        assert_eq!(p.pending(), 4);
        assert!(!p.sync(), "no one asked for a wakeup");
        for i in 0..4 {
            assert_eq!(c.pop().unwrap().unwrap().id, i);
        }
        assert_eq!(c.pop().unwrap(), None);
        assert_eq!(p.push(e), Err(PushError::Full(e)), "slots not released yet");
        c.sync();
        p.push(e).unwrap();
        drop(p); // drop publishes
        assert_eq!(c.pop().unwrap(), Some(e));
    }

    #[test]
    fn wakeup_flag_is_seen_by_the_producer() {
        let r = Ring::<u64>::heap(8).unwrap();
        let (mut p, mut c) = r.split();
        assert!(c.prepare_wait().unwrap(), "empty: may sleep");
        p.push(1).unwrap();
        assert!(p.sync(), "consumer asked for a wakeup");
        c.end_wait();
        p.push(2).unwrap();
        assert!(!p.sync(), "flag cleared after waking");
        p.push(3).unwrap();
        p.sync();
        assert!(!c.prepare_wait().unwrap(), "not empty: do not sleep");
        assert_eq!(
            (c.pop().unwrap(), c.pop().unwrap(), c.pop().unwrap()),
            (Some(1), Some(2), Some(3))
        );
    }

    #[test]
    fn capacity_must_be_a_power_of_two() {
        assert_eq!(Ring::<u64>::heap(3).unwrap_err(), RingError::Capacity(3));
        assert_eq!(Ring::<u64>::heap(0).unwrap_err(), RingError::Capacity(0));
        assert!(Ring::<u64>::heap(3)
            .unwrap_err()
            .to_string()
            .contains("power of two"));
    }

    /// Two mappings of one memfd stand in for two processes.
    #[test]
    fn memfd_ring_works_across_two_mappings() {
        let (mine, fd) = Ring::<Sqe>::memfd(16).unwrap();
        let theirs = Ring::<Sqe>::attach(&fd).unwrap();
        let mut p = Producer::new(mine);
        let mut c = Consumer::new(theirs);
        let t = std::thread::spawn(move || {
            let mut got = Vec::new();
            while got.len() < 1000 {
                if let Some(e) = c.pop().unwrap() {
                    got.push(e.id);
                } else {
                    c.sync();
                    std::hint::spin_loop();
                }
            }
            got
        });
        let mut i = 0;
        while i < 1000 {
            match p.push(Sqe { id: i, op: 2, n: 3 }) {
                Ok(()) => i += 1,
                Err(PushError::Full(_)) => {
                    p.sync();
                    std::hint::spin_loop();
                }
                Err(PushError::Corrupt(e)) => panic!("{e}"),
            }
        }
        p.sync();
        assert_eq!(t.join().unwrap(), (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn attach_validates_the_header() {
        let (_r, fd) = Ring::<Sqe>::memfd(16).unwrap();
        let e = Ring::<u64>::attach(&fd).unwrap_err();
        assert!(e.to_string().contains("entry size 16, expected 8"), "{e}");
        let junk = crate::sys::memfd_create("junk").unwrap();
        junk.set_len(4096).unwrap();
        assert!(matches!(
            Ring::<Sqe>::attach(&junk),
            Err(RingError::BadHeader(_))
        ));
        let tiny = crate::sys::memfd_create("tiny").unwrap();
        tiny.set_len(16).unwrap();
        assert!(Ring::<Sqe>::attach(&tiny)
            .unwrap_err()
            .to_string()
            .contains("smaller than the header"));
    }

    /// A broken peer that scribbles a wild tail cannot make the consumer read
    /// out of bounds: it gets `Corrupt`.
    #[test]
    fn wild_peer_index_is_corrupt_not_ub() {
        let (mine, fd) = Ring::<u64>::memfd(8).unwrap();
        let mut c = Consumer::new(mine);
        let peer = memmap2::MmapOptions::new()
            .len(HEADER_BYTES)
            .map_raw(&fd)
            .unwrap();
        // SAFETY: the peer mapping is HEADER_BYTES long; `tail` is the
        // first u32 of the header.
        unsafe { peer.as_mut_ptr().cast::<u32>().write_volatile(1000) };
        assert!(matches!(
            c.pop(),
            Err(RingError::Corrupt { tail: 1000, .. })
        ));
    }
}
