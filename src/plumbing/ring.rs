//! # SPSC rings: the submission and completion queues
//!
//! A single-producer single-consumer ring of fixed-size `#[repr(C)]`
//! entries (io_uring's SQ / CQ shape, rtrb's split halves). The same code
//! runs over heap memory, over a memfd that another process maps, and over
//! loom's atomics.
//!
//! ## Layout (the wire format of a shared ring; offsets in [`layout`])
//!
//! ```text
//! offset 0      tail   u32 (atomic)  written by the producer
//! offset 128    head   u32 (atomic)  written by the consumer
//! offset 256    flags  u32 (atomic)  bit 0 NEED_WAKEUP (consumer), bit 1 CLOSED (producer)
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
//! ## Closing
//!
//! Dropping the [`Producer`] publishes what it pushed, then sets `CLOSED`
//! (Release). [`Consumer::is_orphaned`] answers true once it sees `CLOSED`
//! (Acquire) and nothing is left to pop: whatever the producer published is
//! then all there will ever be. `CLOSED` is final; a producer that is never
//! dropped (`mem::forget`, a peer process that died) never closes its ring.
//!
//! ## The index window (what the consumer accepts)
//!
//! The consumer has released up to `released`, popped up to `head` and
//! accepted `tail` values up to `tail_cache` (`released <= head <=
//! tail_cache`, all mod 2^32). A new `tail` is accepted only if
//! `tail - released <= capacity` (the producer cannot be more than one ring
//! ahead) and `tail - released >= tail_cache - released` (a published entry
//! cannot be taken back). Likewise the producer accepts a new `head` only in
//! `head_cache ..= published`. Anything else is [`RingError::Corrupt`], and the
//! half keeps its last good view.
//!
//! | event                                   | consumer answers                  |
//! |-----------------------------------------|-----------------------------------|
//! | tail in `tail_cache ..= released + cap` | `Ok(tail - head)` available       |
//! | tail behind `tail_cache` (retracted)    | `Corrupt`                         |
//! | tail past `released + capacity`         | `Corrupt`                         |
//! | a fresh `Consumer` on a used ring       | trusts no `tail` until it checks  |
//!
//! ## Safety (the peer is untrusted)
//!
//! Memory shared with another process is never turned into `&Header`,
//! `&E` or `&[E]`: each index word is reached through a raw pointer as an
//! atomic (`AtomicU32::from_ptr`, whose `UnsafeCell` makes no promise that
//! the word does not change), every plain header field and every entry is
//! copied out with a volatile read and validated before use, and every index
//! read from the peer is checked against the window above; a violation is
//! [`RingError::Corrupt`], never an out-of-bounds access. [`Pod`] entries
//! are valid for every bit pattern, so a torn or garbage entry is still a
//! value the engine can validate and reject.
//!
//! A shared ring's memfd is sealed against shrinking and growing
//! (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`) before anyone else can see
//! it, and [`Ring::attach`] refuses a file not sealed against shrinking, or
//! one too short for the capacity its header claims: a peer cannot truncate
//! the file under our mapping (SIGBUS).
//!
//! In one process, each `Ring` value hands out at most one [`Producer`] and
//! one [`Consumer`] ever ([`Ring::split`], [`Producer::new`],
//! [`Consumer::new`]): two producers would write the same heap slots.

// Casts from the mapping's `*u8` to `*E` / `*u32`: the mapping is
// page-aligned, the header words sit at multiples of 4 and the entries at
// HEADER_BYTES (512), which satisfies every alignment involved.
#![allow(clippy::cast_ptr_alignment)]

use std::marker::PhantomData;
use std::sync::atomic::AtomicBool;
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
    /// The task id.
    pub task: u64,
    /// First key of the part (index into the task's keys).
    pub start: u32,
    /// Keys in the part.
    pub len: u32,
}

/// A completion: task `task` finished; `ok` is 1 when every key succeeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct Cqe {
    /// The task id.
    pub task: u64,
    /// 1 when every key succeeded, else 0.
    pub ok: u32,
    /// Keys that succeeded.
    pub keys_ok: u32,
}

const _: () = assert!(std::mem::size_of::<Sqe>() == 16);
const _: () = assert!(std::mem::size_of::<Cqe>() == 16);
// SAFETY: repr(C), integers only, no padding (size asserted above).
unsafe impl Pod for Sqe {}
// SAFETY: as above.
unsafe impl Pod for Cqe {}

const MAGIC: u32 = 0x4441_5852; // "DAXR"
/// 2: `CLOSED` in `flags`, and shared rings must be sealed.
const VERSION: u32 = 2;
/// `flags` bit: the consumer is about to sleep; signal its eventfd.
const NEED_WAKEUP: u32 = 1;
/// `flags` bit: the producer half was dropped after its last publish.
const CLOSED: u32 = 2;
/// Bytes before the first entry.
pub const HEADER_BYTES: usize = 512;
/// Largest capacity (entries).
pub const CAPACITY_MAX: u32 = 1 << 24;

/// Byte offsets of a shared ring's header words (the wire format a peer in
/// another process, or another language, relies on).
pub mod layout {
    /// `u32`, atomic: the producer's published index.
    pub const TAIL: usize = 0;
    /// `u32`, atomic: the consumer's released index.
    pub const HEAD: usize = 128;
    /// `u32`, atomic: bit 0 `NEED_WAKEUP` (consumer), bit 1 `CLOSED`
    /// (producer).
    pub const FLAGS: usize = 256;
    /// `u32`: `0x4441_5852` ("DAXR").
    pub const MAGIC: usize = 384;
    /// `u32`: 2.
    pub const VERSION: usize = 388;
    /// `u32`: entries, a power of two.
    pub const CAPACITY: usize = 392;
    /// `u32`: `size_of::<E>()`.
    pub const ENTRY_BYTES: usize = 396;
}

const _: () = assert!(layout::ENTRY_BYTES + 4 <= HEADER_BYTES);
const _: () = assert!(
    layout::TAIL.is_multiple_of(4)
        && layout::HEAD.is_multiple_of(4)
        && layout::FLAGS.is_multiple_of(4)
        && layout::MAGIC.is_multiple_of(4)
        && layout::VERSION == layout::MAGIC + 4
        && layout::CAPACITY == layout::MAGIC + 8
        && layout::ENTRY_BYTES == layout::MAGIC + 12
);

/// The header of an in-process (heap or loom) ring. A shared ring has the
/// same words at the [`layout`] offsets, reached only through raw pointers.
#[repr(C)]
struct Header {
    tail: CachePadded<AtomicU32>,
    head: CachePadded<AtomicU32>,
    flags: CachePadded<AtomicU32>,
}

/// The three index words.
#[derive(Clone, Copy, Debug)]
enum Word {
    Tail,
    Head,
    Flags,
}

impl Word {
    #[cfg(not(daxkv_loom))]
    const fn offset(self) -> usize {
        match self {
            Word::Tail => layout::TAIL,
            Word::Head => layout::HEAD,
            Word::Flags => layout::FLAGS,
        }
    }
}

impl Header {
    fn new() -> Header {
        Header {
            tail: CachePadded::new(AtomicU32::new(0)),
            head: CachePadded::new(AtomicU32::new(0)),
            flags: CachePadded::new(AtomicU32::new(0)),
        }
    }

    fn word(&self, w: Word) -> &AtomicU32 {
        match w {
            Word::Tail => &self.tail,
            Word::Head => &self.head,
            Word::Flags => &self.flags,
        }
    }
}

/// Ring errors (cold path).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RingError {
    /// The capacity asked for is not a power of two in
    /// `1..=`[`CAPACITY_MAX`].
    #[error("ring capacity {0} must be a power of two between 1 and {CAPACITY_MAX}")]
    Capacity(u32),
    /// The peer published an index outside the window this half accepts
    /// (module doc, "The index window"); the half keeps its last good view.
    #[error("shared ring is corrupt: head {head}, tail {tail}, capacity {capacity}")]
    Corrupt {
        /// The head this half holds (or the one the peer published).
        head: u32,
        /// The tail this half holds (or the one the peer published).
        tail: u32,
        /// The ring's capacity, entries.
        capacity: u32,
    },
    /// `attach` found a header that does not match (magic, version,
    /// capacity, entry size, or a file too short for the capacity).
    #[error("shared ring header does not match: {0}")]
    BadHeader(String),
    /// `attach` of a memfd that is not sealed against shrinking: a peer could
    /// truncate it under the mapping (SIGBUS).
    #[error(
        "shared ring memfd is not sealed against shrinking (seals {seals:#x}, \
         F_SEAL_SHRINK missing): a peer could truncate it under the mapping; \
         create it with Ring::memfd"
    )]
    Unsealed {
        /// The file's seals (`F_GET_SEALS`).
        seals: u32,
    },
    /// The ring already handed out this half (`"producer"` or
    /// `"consumer"`).
    #[error("this ring already has a {0} (one producer and one consumer per ring)")]
    HalfTaken(&'static str),
    /// Creating, sealing or mapping the ring's memfd failed (the OS error,
    /// as text).
    #[error("ring memory: {0}")]
    Io(String),
}

/// `push` on a full ring hands the entry back (the rtrb habit).
#[derive(Debug, PartialEq, Eq)]
pub enum PushError<E> {
    /// No room: the entry, handed back.
    Full(E),
    /// The consumer's head is out of its window; nothing was pushed.
    Corrupt(RingError),
}

enum Storage<E> {
    #[cfg(not(daxkv_loom))]
    Heap {
        header: Box<Header>,
        entries: Box<[std::cell::UnsafeCell<E>]>,
    },
    /// A memfd mapping of exactly `shared_bytes(capacity)` bytes, whose
    /// file is sealed against shrinking.
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
    /// Our own copy, validated once: never re-read from shared memory.
    capacity: u32,
    /// Set once each by the one `Producer` / `Consumer` of this value.
    producer_taken: AtomicBool,
    consumer_taken: AtomicBool,
    _e: PhantomData<E>,
}

// SAFETY: the header words are atomics; heap entries are accessed only by
// the one producer (slots between head and tail it has not published) and
// the one consumer (published slots it has not released): the index
// protocol and the one-half-of-each-kind rule (`producer_taken` /
// `consumer_taken`) guarantee it. Mapped entries are only copied in and out
// with volatile accesses through raw pointers.
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

#[cfg(not(daxkv_loom))]
fn io_err(e: &std::io::Error) -> RingError {
    RingError::Io(e.to_string())
}

impl<E: Pod> Ring<E> {
    /// Bytes a shared ring of `capacity` entries needs.
    pub fn shared_bytes(capacity: u32) -> usize {
        HEADER_BYTES + capacity as usize * std::mem::size_of::<E>()
    }

    fn with_storage(storage: Storage<E>, capacity: u32) -> Arc<Ring<E>> {
        Arc::new(Ring {
            storage,
            capacity,
            producer_taken: AtomicBool::new(false),
            consumer_taken: AtomicBool::new(false),
            _e: PhantomData,
        })
    }

    /// A ring in this process's heap.
    pub fn heap(capacity: u32) -> Result<Arc<Ring<E>>, RingError> {
        check_capacity(capacity)?;
        let header = Box::new(Header::new());
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
        Ok(Self::with_storage(storage, capacity))
    }

    /// A ring in a fresh memfd, which another process can map with
    /// [`Ring::attach`] (pass it the fd). Returns the ring and the memfd.
    /// The memfd is sealed (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`)
    /// before this returns, so no holder of the fd can resize it.
    #[cfg(not(daxkv_loom))]
    pub fn memfd(capacity: u32) -> Result<(Arc<Ring<E>>, std::fs::File), RingError> {
        check_capacity(capacity)?;
        let len = Self::shared_bytes(capacity);
        let file = crate::host::sys::memfd_create_sealable("daxkv-ring").map_err(|e| io_err(&e))?;
        file.set_len(len as u64).map_err(|e| io_err(&e))?;
        crate::host::sys::add_seals(
            &file,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
        .map_err(|e| io_err(&e))?;
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| io_err(&e))?;
        let base = map.as_mut_ptr();
        // The file is zero-filled, so tail, head and flags start at 0.
        for (off, v) in [
            (layout::MAGIC, MAGIC),
            (layout::VERSION, VERSION),
            (layout::CAPACITY, capacity),
            (layout::ENTRY_BYTES, std::mem::size_of::<E>() as u32),
        ] {
            // SAFETY: `off + 4 <= HEADER_BYTES <= len` (const-asserted) and
            // 4-aligned in a page-aligned mapping; volatile, since the
            // memory is shared (though no one else has the fd yet).
            unsafe { base.add(off).cast::<u32>().write_volatile(v) };
        }
        Ok((Self::with_storage(Storage::Mapped { map }, capacity), file))
    }

    /// Map a ring another process created (or the same memfd again) and
    /// validate it before use: the file must be sealed against shrinking
    /// ([`RingError::Unsealed`] otherwise: a peer could truncate it under
    /// us), its header must match `E`, and it must be long enough for the
    /// capacity the header claims. The header is read with `pread`, and only
    /// the validated length is mapped.
    #[cfg(not(daxkv_loom))]
    pub fn attach(file: &std::fs::File) -> Result<Arc<Ring<E>>, RingError> {
        use std::os::unix::fs::FileExt;
        // Seals first: once F_SEAL_SHRINK is on it never comes off, so the
        // length read after it is a lower bound for good.
        let seals = crate::host::sys::seals(file).map_err(|e| io_err(&e))?;
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(RingError::Unsealed {
                seals: seals as u32,
            });
        }
        let len = file.metadata().map_err(|e| io_err(&e))?.len();
        if len < HEADER_BYTES as u64 {
            return Err(RingError::BadHeader(format!(
                "{len} bytes is smaller than the header"
            )));
        }
        let mut fields = [0u8; 16];
        file.read_exact_at(&mut fields, layout::MAGIC as u64)
            .map_err(|e| io_err(&e))?;
        let field = |i: usize| u32::from_ne_bytes(fields[4 * i..4 * i + 4].try_into().unwrap());
        let (magic, version, capacity, entry_bytes) = (field(0), field(1), field(2), field(3));
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
        let need = Self::shared_bytes(capacity);
        if len < need as u64 {
            return Err(RingError::BadHeader(format!(
                "{len} bytes cannot hold {capacity} entries"
            )));
        }
        let map = memmap2::MmapOptions::new()
            .len(need)
            .map_raw(file)
            .map_err(|e| io_err(&e))?;
        Ok(Self::with_storage(Storage::Mapped { map }, capacity))
    }

    /// Entries the ring holds.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// One of the three index words. For a shared ring this is an atomic
    /// view of a raw pointer into the mapping, never a reference to the
    /// header (whose plain fields the peer may be rewriting).
    fn word(&self, w: Word) -> &AtomicU32 {
        match &self.storage {
            #[cfg(not(daxkv_loom))]
            Storage::Heap { header, .. } => header.word(w),
            // SAFETY:
            // 1. in bounds: the mapping is `shared_bytes(capacity)` >=
            //    HEADER_BYTES long and `w.offset() + 4 <= HEADER_BYTES`;
            // 2. aligned: the mapping is page-aligned, the offsets are
            //    multiples of 4;
            // 3. valid for `&self`'s lifetime: the mapping lives as long as
            //    `self`, and the file is sealed against shrinking
            //    (`memfd` sealed it, `attach` checked), so it cannot turn
            //    into a SIGBUS;
            // 4. every access to the word from this process is atomic; the
            //    peer's accesses are outside our program: an aligned 4-byte
            //    store by a broken peer is still seen whole, and every value
            //    read is validated (`available`, `free`).
            #[cfg(not(daxkv_loom))]
            Storage::Mapped { map } => unsafe {
                AtomicU32::from_ptr(map.as_mut_ptr().add(w.offset()).cast::<u32>())
            },
            #[cfg(daxkv_loom)]
            Storage::Loom { header, .. } => header.word(w),
        }
    }

    /// Copy `e` into slot `i` (masked).
    ///
    /// # Safety
    /// The caller is the producer (the only one: `Ring::take`) and slot `i`
    /// is between the consumer's published head, loaded with Acquire, and
    /// `head + capacity` (not readable by the consumer).
    unsafe fn write(&self, i: u32, e: E) {
        let i = (i & (self.capacity - 1)) as usize;
        match &self.storage {
            #[cfg(not(daxkv_loom))]
            // SAFETY: this function's contract: no one else accesses slot i
            // (the consumer released it before the head we loaded).
            Storage::Heap { entries, .. } => unsafe { entries[i].get().write(e) },
            #[cfg(not(daxkv_loom))]
            // SAFETY: i < capacity and the mapping holds `capacity` entries
            // after the header (checked at create / attach, size sealed);
            // HEADER_BYTES is a multiple of any Pod's alignment up to 512.
            // Volatile: the memory is shared with another process.
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
    /// The caller is the consumer (the only one: `Ring::take`) and slot `i`
    /// was published by the producer (in a tail the caller loaded with
    /// Acquire) and not yet released.
    unsafe fn read(&self, i: u32) -> E {
        let i = (i & (self.capacity - 1)) as usize;
        match &self.storage {
            #[cfg(not(daxkv_loom))]
            // SAFETY: this function's contract: the producer's write of slot
            // i happened before (published, Acquire) and it does not touch
            // the slot again until we release it.
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

    /// Split into the two halves.
    ///
    /// # Panics
    /// If this ring already handed out a producer or a consumer: exactly
    /// one of each may exist per `Ring` value (two producers would write the
    /// same slots). [`Producer::new`] / [`Consumer::new`] return the error
    /// instead.
    pub fn split(self: &Arc<Self>) -> (Producer<E>, Consumer<E>) {
        let p = Producer::new(self.clone()).unwrap_or_else(|e| panic!("Ring::split: {e}"));
        let c = Consumer::new(self.clone()).unwrap_or_else(|e| panic!("Ring::split: {e}"));
        (p, c)
    }

    /// Claim the producer or consumer role of this value, once.
    fn take(&self, producer: bool) -> Result<(), RingError> {
        let (flag, half) = if producer {
            (&self.producer_taken, "producer")
        } else {
            (&self.consumer_taken, "consumer")
        };
        // ORDERING: Relaxed — only the RMW's atomicity matters (exactly one
        // caller sees `false`); the half's accesses to entries are ordered by
        // the index protocol, not by this flag. Pairs with itself.
        if flag.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return Err(RingError::HalfTaken(half));
        }
        Ok(())
    }
}

/// The producing half. `Send`, not `Sync`.
pub struct Producer<E: Pod> {
    ring: Arc<Ring<E>>,
    /// Next slot to write (published up to `published`).
    tail: u32,
    published: u32,
    /// The last `head` accepted from the consumer (`tail - head_cache <=
    /// capacity`).
    head_cache: u32,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

impl<E: Pod> Producer<E> {
    /// The producer of `ring`: one per `Ring` value ([`RingError::HalfTaken`]
    /// for a second). Trusts no `head` in the memory until `free` checks it.
    pub fn new(ring: Arc<Ring<E>>) -> Result<Producer<E>, RingError> {
        ring.take(true)?;
        // ORDERING: Acquire — start from the tail the previous owner
        // published (our own word; the peer's head is re-read, and checked,
        // on the first push).
        let tail = ring.word(Word::Tail).load(Ordering::Acquire);
        let p = Producer {
            head_cache: tail.wrapping_sub(ring.capacity),
            ring,
            tail,
            published: tail,
            _not_sync: PhantomData,
        };
        p.invariants();
        Ok(p)
    }

    fn invariants(&self) {
        debug_assert!(self.tail.wrapping_sub(self.head_cache) <= self.ring.capacity);
        debug_assert!(
            self.published.wrapping_sub(self.head_cache) <= self.tail.wrapping_sub(self.head_cache)
        );
    }

    /// Entries the ring holds.
    pub fn capacity(&self) -> u32 {
        self.ring.capacity
    }

    /// Free slots, re-reading the consumer's head. A head behind the one
    /// accepted before, or past the published tail, is
    /// [`RingError::Corrupt`] (the view is kept).
    pub fn free(&mut self) -> Result<u32, RingError> {
        // ORDERING: Acquire — pairs with the consumer's Release in `sync`:
        // slots it released are no longer read.
        let head = self.ring.word(Word::Head).load(Ordering::Acquire);
        // `head_cache ..= published` is the only legal place for it (the
        // consumer cannot release what it never saw); this also bounds
        // `tail - head` by `tail - head_cache <= capacity`.
        if head.wrapping_sub(self.head_cache) > self.published.wrapping_sub(self.head_cache) {
            return Err(RingError::Corrupt {
                head,
                tail: self.published,
                capacity: self.ring.capacity,
            });
        }
        self.head_cache = head;
        self.invariants();
        Ok(self.ring.capacity - self.tail.wrapping_sub(head))
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
        // the consumer, and we are the only producer (`Ring::take`).
        unsafe { self.ring.write(self.tail, e) };
        self.tail = self.tail.wrapping_add(1);
        self.invariants();
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
        // ORDERING: Release — publishes the entries written by `push` to the
        // consumer's Acquire load of `tail` in `Consumer::available`.
        self.ring
            .word(Word::Tail)
            .store(self.tail, Ordering::Release);
        self.published = self.tail;
        // ORDERING: SeqCst fence — the Dekker handshake with
        // `Consumer::prepare_wait` (module doc): our tail store and its flag
        // store cannot both be missed by the two loads.
        fence(Ordering::SeqCst);
        // ORDERING: Relaxed — ordered by the fence above; pairs with the
        // fetch_or in `Consumer::prepare_wait`.
        self.ring.word(Word::Flags).load(Ordering::Relaxed) & NEED_WAKEUP != 0
    }
}

impl<E: Pod> std::fmt::Debug for Producer<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("tail", &self.tail)
            .field("published", &self.published)
            .field("head_cache", &self.head_cache)
            .finish_non_exhaustive()
    }
}

impl<E: Pod> Drop for Producer<E> {
    fn drop(&mut self) {
        self.sync();
        // ORDERING: Release — comes after our last tail store (in `sync`
        // just above), so a consumer whose Acquire load sees CLOSED also
        // sees that final tail; pairs with `Consumer::is_orphaned`.
        self.ring
            .word(Word::Flags)
            .fetch_or(CLOSED, Ordering::Release);
    }
}

/// The consuming half. `Send`, not `Sync`.
pub struct Consumer<E: Pod> {
    ring: Arc<Ring<E>>,
    /// Next slot to read (released up to `released`).
    head: u32,
    released: u32,
    /// The last `tail` accepted from the producer (module doc: the window).
    tail_cache: u32,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

impl<E: Pod> Consumer<E> {
    /// The consumer of `ring`: one per `Ring` value ([`RingError::HalfTaken`]
    /// for a second). Trusts no `tail` in the memory until `available`
    /// checks it.
    pub fn new(ring: Arc<Ring<E>>) -> Result<Consumer<E>, RingError> {
        ring.take(false)?;
        // ORDERING: Acquire — start from the head the previous owner
        // released (our own word).
        let head = ring.word(Word::Head).load(Ordering::Acquire);
        let c = Consumer {
            ring,
            head,
            released: head,
            tail_cache: head,
            _not_sync: PhantomData,
        };
        c.invariants();
        Ok(c)
    }

    fn invariants(&self) {
        let seen = self.tail_cache.wrapping_sub(self.released);
        debug_assert!(seen <= self.ring.capacity);
        debug_assert!(self.head.wrapping_sub(self.released) <= seen);
    }

    /// Published entries not yet popped, re-reading the producer's tail.
    /// A tail outside the window (module doc) is [`RingError::Corrupt`]; the
    /// consumer keeps its last good view.
    pub fn available(&mut self) -> Result<u32, RingError> {
        // ORDERING: Acquire — pairs with the producer's Release in `sync`,
        // so the entries up to `tail` are fully written.
        let tail = self.ring.word(Word::Tail).load(Ordering::Acquire);
        let used = tail.wrapping_sub(self.released);
        if used > self.ring.capacity || used < self.tail_cache.wrapping_sub(self.released) {
            return Err(RingError::Corrupt {
                head: self.head,
                tail,
                capacity: self.ring.capacity,
            });
        }
        self.tail_cache = tail;
        self.invariants();
        Ok(tail.wrapping_sub(self.head))
    }

    /// Copy the next published entry out, if any.
    pub fn pop(&mut self) -> Result<Option<E>, RingError> {
        if self.head == self.tail_cache && self.available()? == 0 {
            return Ok(None);
        }
        // SAFETY: head < tail_cache, a tail accepted by `available` (within
        // one capacity of `released`), so the slot is published and not
        // released: the producer does not write it.
        let e = unsafe { self.ring.read(self.head) };
        self.head = self.head.wrapping_add(1);
        self.invariants();
        Ok(Some(e))
    }

    /// Release the popped slots to the producer.
    pub fn sync(&mut self) {
        if self.released != self.head {
            // ORDERING: Release — our reads of the released slots happen
            // before the producer's Acquire of `head` (in `Producer::free`)
            // lets it overwrite them.
            self.ring
                .word(Word::Head)
                .store(self.head, Ordering::Release);
            self.released = self.head;
        }
    }

    /// About to sleep: ask for a wakeup, then re-check. Returns true if the
    /// ring is still empty (sleep on the eventfd, then call `end_wait`);
    /// false if an entry arrived meanwhile (the flag is already cleared).
    pub fn prepare_wait(&mut self) -> Result<bool, RingError> {
        // ORDERING: Relaxed RMW, ordered by the fence below; pairs with the
        // flags load in `Producer::sync`.
        self.ring
            .word(Word::Flags)
            .fetch_or(NEED_WAKEUP, Ordering::Relaxed);
        // ORDERING: SeqCst fence — the Dekker handshake with
        // `Producer::sync` (module doc).
        fence(Ordering::SeqCst);
        if self.available()? > 0 {
            self.end_wait();
            return Ok(false);
        }
        Ok(true)
    }

    /// True when the producer half is gone and nothing is left to pop:
    /// whatever it published is all there will ever be, so the ring can be
    /// dropped without losing an entry.
    ///
    /// The contract: the producer sets `CLOSED` when it is dropped, after
    /// its last publish; this reads `CLOSED` (Acquire), then `tail`. So a
    /// `true` answer has seen the producer's final tail, and a producer
    /// that is still alive (in this process or another) always gets
    /// `false`. A producer that is never dropped (`mem::forget`, a peer
    /// process that died) never closes its ring: the answer stays `false`
    /// (the ring leaks; no entry is lost). A shared ring's flag is the
    /// peer's word like any other: a broken peer that sets `CLOSED` early
    /// only loses its own entries. A corrupt, closed ring counts as drained:
    /// nothing more can be taken from it.
    pub fn is_orphaned(&mut self) -> bool {
        // ORDERING: Acquire — pairs with the Release fetch_or in
        // `Producer::drop`, which follows the producer's last tail store;
        // so the tail load in `available` below reads that final tail (or
        // a later value), never an older one.
        let closed = self.ring.word(Word::Flags).load(Ordering::Acquire) & CLOSED != 0;
        closed && !matches!(self.available(), Ok(n) if n > 0)
    }

    /// Woken (or done waiting): stop asking for wakeups.
    pub fn end_wait(&mut self) {
        // ORDERING: Relaxed — a producer that still sees the flag only
        // makes a spurious (coalesced) eventfd write; pairs with the flags
        // load in `Producer::sync`.
        self.ring
            .word(Word::Flags)
            .fetch_and(!NEED_WAKEUP, Ordering::Relaxed);
    }
}

impl<E: Pod> std::fmt::Debug for Consumer<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("head", &self.head)
            .field("released", &self.released)
            .field("tail_cache", &self.tail_cache)
            .finish_non_exhaustive()
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
    #[cfg_attr(miri, ignore = "memfd and mmap")]
    fn memfd_ring_works_across_two_mappings() {
        let (mine, fd) = Ring::<Sqe>::memfd(16).unwrap();
        let theirs = Ring::<Sqe>::attach(&fd).unwrap();
        let mut p = Producer::new(mine).unwrap();
        let mut c = Consumer::new(theirs).unwrap();
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
    #[cfg_attr(miri, ignore = "memfd and mmap")]
    fn attach_validates_the_header() {
        let (_r, fd) = Ring::<Sqe>::memfd(16).unwrap();
        let e = Ring::<u64>::attach(&fd).unwrap_err();
        assert!(e.to_string().contains("entry size 16, expected 8"), "{e}");
        let sealed = |len: u64| {
            let f = crate::host::sys::memfd_create_sealable("junk").unwrap();
            f.set_len(len).unwrap();
            crate::host::sys::add_seals(&f, libc::F_SEAL_SHRINK).unwrap();
            f
        };
        assert!(matches!(
            Ring::<Sqe>::attach(&sealed(4096)),
            Err(RingError::BadHeader(_))
        ));
        assert!(Ring::<Sqe>::attach(&sealed(16))
            .unwrap_err()
            .to_string()
            .contains("smaller than the header"));
        let unsealed = crate::host::sys::memfd_create("unsealed").unwrap();
        unsealed.set_len(4096).unwrap();
        assert!(matches!(
            Ring::<Sqe>::attach(&unsealed),
            Err(RingError::Unsealed { .. })
        ));
    }

    /// A broken peer that scribbles a wild tail cannot make the consumer read
    /// out of bounds: it gets `Corrupt`.
    #[test]
    #[cfg_attr(miri, ignore = "memfd and mmap")]
    fn wild_peer_index_is_corrupt_not_ub() {
        let (mine, fd) = Ring::<u64>::memfd(8).unwrap();
        let mut c = Consumer::new(mine).unwrap();
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

    /// One producer and one consumer per ring value: a second of either
    /// would race the first on the heap slots.
    #[test]
    fn a_ring_hands_out_one_half_of_each_kind() {
        let r = Ring::<u64>::heap(4).unwrap();
        let p = Producer::new(r.clone()).unwrap();
        assert_eq!(
            Producer::new(r.clone()).err(),
            Some(RingError::HalfTaken("producer"))
        );
        drop(p);
        assert!(
            Producer::new(r.clone()).is_err(),
            "not even after the first is dropped: CLOSED is final"
        );
        let _c = Consumer::new(r.clone()).unwrap();
        assert_eq!(
            Consumer::new(r.clone()).err(),
            Some(RingError::HalfTaken("consumer"))
        );
        let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.split())) else {
            panic!("a third half was handed out");
        };
        assert!(e
            .downcast_ref::<String>()
            .unwrap()
            .contains("already has a producer"));
    }

    /// The consumer's index window (module doc table), on a heap ring whose
    /// tail the test scribbles as a broken producer would: a retracted or
    /// overlong tail is `Corrupt` and the last good view is kept. Heap
    /// memory only, so it runs under Miri.
    #[test]
    fn consumer_window_table() {
        let r = Ring::<u64>::heap(4).unwrap();
        let (mut p, mut c) = r.split();
        for i in 0..3 {
            p.push(i).unwrap();
        }
        p.sync();
        assert_eq!(c.pop().unwrap(), Some(0));
        assert_eq!(c.pop().unwrap(), Some(1));
        let tail = r.word(Word::Tail);
        let corrupt = |t| RingError::Corrupt {
            head: 2,
            tail: t,
            capacity: 4,
        };
        // ORDERING (all stores here): Release — the test acts as a broken
        // producer; pairs with the Acquire in `available`.
        tail.store(1, Ordering::Release); // behind head
        assert_eq!(c.available(), Err(corrupt(1)));
        tail.store(2, Ordering::Release); // behind the accepted tail 3
        assert_eq!(c.available(), Err(corrupt(2)));
        tail.store(5, Ordering::Release); // more than a ring ahead of released
        assert_eq!(c.available(), Err(corrupt(5)));
        tail.store(u32::MAX, Ordering::Release);
        assert_eq!(c.available(), Err(corrupt(u32::MAX)));
        tail.store(4, Ordering::Release); // exactly one ring: fine
        assert_eq!(c.available(), Ok(2));
        c.sync();
        tail.store(6, Ordering::Release); // released 2: up to 6 is fine
        assert_eq!(c.available(), Ok(4));
    }

    /// The producer's window: a head behind the accepted one or past the
    /// published tail is `Corrupt`. Heap only (Miri).
    #[test]
    fn producer_window_table() {
        let r = Ring::<u64>::heap(4).unwrap();
        let (mut p, _c) = r.split();
        for i in 0..4 {
            p.push(i).unwrap();
        }
        p.push(9).unwrap_err();
        p.sync();
        let head = r.word(Word::Head);
        // ORDERING (all stores here): Release — the test acts as a broken
        // consumer; pairs with the Acquire in `free`.
        head.store(2, Ordering::Release);
        assert_eq!(p.free(), Ok(2));
        head.store(1, Ordering::Release);
        assert!(matches!(p.free(), Err(RingError::Corrupt { head: 1, .. })));
        head.store(5, Ordering::Release);
        assert!(matches!(p.free(), Err(RingError::Corrupt { head: 5, .. })));
        head.store(4, Ordering::Release);
        assert_eq!(p.free(), Ok(4));
        p.push(4).unwrap();
        head.store(5, Ordering::Release); // past the published tail (4)
        assert!(matches!(p.free(), Err(RingError::Corrupt { head: 5, .. })));
    }

    /// `is_orphaned`: false while the producer lives or entries are left,
    /// true once both are over. Heap only (Miri).
    #[test]
    fn orphaned_after_the_producer_is_dropped_and_drained() {
        let (mut p, mut c) = Ring::<u64>::heap(4).unwrap().split();
        assert!(!c.is_orphaned());
        p.push(1).unwrap();
        drop(p);
        assert!(!c.is_orphaned(), "one entry left");
        assert_eq!(c.pop().unwrap(), Some(1));
        assert!(c.is_orphaned());
    }

    /// Threads on a heap ring (Miri checks the slot accesses for races).
    #[test]
    fn heap_ring_across_threads() {
        const N: u64 = if cfg!(miri) { 50 } else { 10_000 };
        let (mut p, mut c) = Ring::<u64>::heap(4).unwrap().split();
        let t = std::thread::spawn(move || {
            let mut got = 0;
            while got < N {
                if let Some(v) = c.pop().unwrap() {
                    assert_eq!(v, got);
                    got += 1;
                } else {
                    c.sync();
                    std::thread::yield_now();
                }
            }
            c
        });
        let mut i = 0;
        while i < N {
            match p.push(i) {
                Ok(()) => i += 1,
                Err(PushError::Full(_)) => {
                    p.sync();
                    std::thread::yield_now();
                }
                Err(PushError::Corrupt(e)) => panic!("{e}"),
            }
        }
        drop(p);
        let mut c = t.join().unwrap();
        assert!(c.is_orphaned());
    }
}
