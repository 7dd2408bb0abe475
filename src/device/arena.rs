//! # Arena: one mapped DAX device, file, memfd or anonymous region
//!
//! The arena owns the mapping and the *gate* that lets it be remapped (grow /
//! shrink) or closed while other threads use it.
//!
//! ## Safety
//!
//! The mapping is memory another agent may write (a device-dax node can be
//! mapped by another process), so, like `memmap2::MmapRaw` and rust-vmm's
//! `vm-memory`, the arena never creates `&[u8]` or `&mut [u8]` into it. All
//! access is a raw-pointer copy ([`ArenaGuard::write`], [`ArenaGuard::read`]).
//! The gate guarantees the mapping outlives every [`ArenaGuard`]; it does
//! not make two copies of one range from two threads safe: those are plain
//! (and non-temporal) stores and loads, so a write racing another access to
//! the same bytes is a data race, undefined behaviour in Rust's model, not
//! merely torn bytes. So the copy methods are `unsafe fn`s whose contract
//! is exclusive use of the range, and the safe APIs above them get it from
//! the slot state machine (`slot`): a writer owns its slot while WRITING, a
//! reader copies out only under a borrow, which keeps writers away. (Were
//! these methods safe, safe code could race two guards on one range; Miri
//! shows it.)
//!
//! ## Gate protocol
//!
//! One `AtomicU64`: bits 0..48 count the live guards, bit 62 is `EXCLUSIVE`
//! (a remap is pending or running), bit 63 is `CLOSED`.
//!
//! ```text
//! enter:     prev = fetch_add(1, Acquire)
//!            prev has EXCLUSIVE|CLOSED ? fetch_sub, then wait or fail : proceed
//! exit:      fetch_sub(1, Release)  (notify the waiter if it was the last)
//! exclusive: fetch_or(EXCLUSIVE) ; wait count == 0 ; mutate ; fetch_and(!EXCLUSIVE)
//! ```
//!
//! New guards wait while a remap is pending, so a stream of readers cannot
//! starve it (upstream LMCache's remap could be starved by readers).
//!
//! ### Nested guards: only on the same arena
//!
//! A guard is admitted when the word it incremented had neither EXCLUSIVE
//! nor CLOSED set, or when the calling thread already holds a guard on
//! **this same arena** (a reader that deletes a key while holding its read
//! set, a writer callback that looks a key up): waiting there would
//! deadlock against the pending remap, which waits for the outer guard.
//! That exception is sound because the outer guard keeps the count above
//! zero, so the exclusive section has not started changing the mapping
//! and cannot until both guards are gone.
//!
//! The exception is not granted for a guard on *another* arena: with one
//! thread-local count of guards on any arena, a worker holding device A's
//! session would walk into device B while B is being remapped, read B's
//! base pointer mid-update and copy into unmapped memory (SIGSEGV in the
//! NT copy kernel). So each arena has a process-unique id
//! (never reused, so a dropped arena's address coming back is not "held"),
//! and each thread records the ids it holds guards on
//! ([`HELD_ARENAS_MAX`] of them; beyond that a guard is simply not
//! recorded, which only makes a later nested entry wait). The record is
//! a claim "this thread's undropped guards hold the count of arena `id`
//! above zero", which stays true even if a guard is leaked with
//! `mem::forget` (its increment is never undone either).
//!
//! A guard on **another** arena waits like anyone else. A thread that
//! holds guards on several arenas takes them in one global order (the
//! engine: ascending device index), and an exclusive section gives up
//! after [`Arena::drain_timeout`] (clearing EXCLUSIVE and failing with
//! [`GateError::Busy`]) instead of waiting forever, so even a caller that
//! breaks the order, or a guard leaked with `mem::forget`, delays a remap
//! by a bounded time and never deadlocks or hangs it.
//!
//! `mem::forget` of a guard (or of a `Session` / `ReadSet` holding one) is
//! safe: the count stays raised, so every later remap fails with `Busy` and
//! `close` leaves the mapping in place (unmapped when the arena drops, when
//! no borrow of it can exist any more); nothing dangles.

use std::cell::{Cell, UnsafeCell};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use memmap2::{MmapOptions, MmapRaw};

use crate::device::copy;
use crate::device::error::{GateError, OpenError};
use crate::device::fault;
use crate::host::devdax::{self, DEFAULT_DEVDAX_ALIGN_BYTES};
use crate::host::memlimit::{self, MemRoots};
use crate::host::sys;

use crate::device::gate::{Gate, Refused, CLOSED, EXCLUSIVE, GUARD_MASK};

/// Distinct arenas one thread can hold guards on and still re-enter while
/// a remap is pending (module doc, "Nested guards").
pub const HELD_ARENAS_MAX: usize = 8;

/// Source of process-unique arena ids (never reused; 2^64 opens).
static NEXT_ARENA_ID: AtomicU64 = AtomicU64::new(1);

/// The arenas this thread holds guards on and has not dropped.
struct Held {
    /// Bit `i` set: `entries[i]` is in use.
    used: Cell<u8>,
    /// `(arena id, guards)`; an entry stays at its index while its count
    /// is above zero, so a guard remembers where it was recorded.
    entries: [Cell<(u64, u32)>; HELD_ARENAS_MAX],
}

const _: () = assert!(HELD_ARENAS_MAX <= 8, "`Held::used` has a bit per entry");

impl Held {
    /// The entry of arena `id`: only the entries in use are looked at (a
    /// thread usually holds none or one).
    #[inline]
    fn find(&self, id: u64) -> Option<usize> {
        let mut m = self.used.get();
        while m != 0 {
            let at = m.trailing_zeros() as usize;
            if self.entries[at].get().0 == id {
                return Some(at);
            }
            m &= m - 1;
        }
        None
    }
}

thread_local! {
    static HELD: Held = const {
        Held {
            used: Cell::new(0),
            entries: [const { Cell::new((0, 0)) }; HELD_ARENAS_MAX],
        }
    };
}

/// Guards this thread holds on arena `id`.
fn held_on(id: u64) -> u32 {
    HELD.with(|h| h.find(id).map_or(0, |at| h.entries[at].get().1))
}

/// Record one more guard on `id`: the index of its entry, or `None` if
/// the table is full (the guard is then not recorded, see the module doc).
fn note_enter(id: u64) -> Option<u8> {
    HELD.with(|h| {
        let at = if let Some(at) = h.find(id) {
            at
        } else {
            let used = h.used.get();
            if used == u8::MAX >> (8 - HELD_ARENAS_MAX) {
                return None;
            }
            let at = (!used).trailing_zeros() as usize;
            h.used.set(used | 1 << at);
            at
        };
        let (_, n) = h.entries[at].get();
        h.entries[at].set((id, n + 1));
        Some(at as u8)
    })
}

/// Drop one guard on `id` recorded at entry `at` (by `note_enter`; a
/// guard is not `Send`, so this is the thread that recorded it).
fn note_leave(id: u64, at: u8) {
    HELD.with(|h| {
        let c = &h.entries[usize::from(at)];
        match c.get() {
            (i, n) if i == id && n > 1 => c.set((id, n - 1)),
            (i, 1) if i == id => {
                c.set((0, 0));
                h.used.set(h.used.get() & !(1 << at));
            }
            _ => debug_assert!(false, "a recorded guard's entry moved"),
        }
    });
}

/// How long an exclusive section (remap) or `close` waits for live guards
/// before giving up (module doc). A guard lives for one call or one engine
/// task part, so seconds are far beyond any healthy wait.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// What to map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ArenaSource {
    /// An existing device-dax character device or regular (e.g. tmpfs) file;
    /// the kind is read from `stat`.
    Path(PathBuf),
    /// A regular file, created if missing and sized to the requested length.
    CreateFile(PathBuf),
    /// A fresh memfd (volatile, private to this process and its children).
    Memfd,
    /// Anonymous memory (tests).
    Anonymous,
}

/// How to map it.
#[derive(Clone, Debug)]
pub struct ArenaSpec {
    /// What to map.
    pub source: ArenaSource,
    /// Bytes to map now.
    pub size_bytes: usize,
    /// The largest size a later grow may ask for. For a device or an existing
    /// file it defaults to what the device or file holds; for a memfd,
    /// anonymous memory or a created file, to `size_bytes`.
    pub max_size_bytes: Option<usize>,
    /// Pre-fault the mapping (`MAP_POPULATE`) so first-touch faults stay off
    /// the data path.
    pub populate: bool,
    /// Where sysfs lives (a fake root in tests).
    pub sysfs_root: PathBuf,
    /// Where the memory limits a memfd is checked against are read
    /// ([`crate::host::memlimit`]; fake trees in tests).
    pub mem_roots: MemRoots,
    /// For a path: the `(st_dev, st_ino)` the opened file must have (a
    /// file just created for this arena; a file put at the path since is
    /// refused, never mapped). `None`: whatever the path names.
    pub expect_file: Option<(u64, u64)>,
}

impl ArenaSpec {
    /// Map `size_bytes` of `source`, not pre-faulted, with sysfs at `/sys`
    /// and the largest size defaulting as [`ArenaSpec::max_size_bytes`]
    /// says.
    pub fn new(source: ArenaSource, size_bytes: usize) -> ArenaSpec {
        ArenaSpec {
            source,
            size_bytes,
            max_size_bytes: None,
            populate: false,
            sysfs_root: PathBuf::from("/sys"),
            mem_roots: MemRoots::default(),
            expect_file: None,
        }
    }

    /// A memfd arena of `size_bytes`.
    pub fn memfd(size_bytes: usize) -> ArenaSpec {
        ArenaSpec::new(ArenaSource::Memfd, size_bytes)
    }

    /// Pre-fault the mapping (`MAP_POPULATE`) when `yes`.
    #[must_use]
    pub fn populate(mut self, yes: bool) -> ArenaSpec {
        self.populate = yes;
        self
    }

    /// Allow a later grow up to `max` bytes (also the size the core's
    /// tables are allocated for). For a device-dax node it is capped at
    /// what the device holds; an existing file may be extended later and
    /// then grown into, up to `max` (a grow past the file's length then is
    /// refused with [`OpenError::FileShorterThanGrow`]).
    #[must_use]
    pub fn max_size_bytes(mut self, max: usize) -> ArenaSpec {
        self.max_size_bytes = Some(max);
        self
    }

    /// Read device-dax attributes under `root` instead of `/sys` (tests use
    /// a fake tree).
    #[must_use]
    pub fn sysfs_root(mut self, root: impl Into<PathBuf>) -> ArenaSpec {
        self.sysfs_root = root.into();
        self
    }

    /// Read the memory limits under `roots` instead of `/proc` and `/sys`.
    #[must_use]
    pub fn mem_roots(mut self, roots: MemRoots) -> ArenaSpec {
        self.mem_roots = roots;
        self
    }

    /// Map the path only if the file opened is `(st_dev, st_ino)`
    /// ([`ArenaSpec::expect_file`]).
    #[must_use]
    pub fn expect_file(mut self, dev: u64, ino: u64) -> ArenaSpec {
        self.expect_file = Some((dev, ino));
        self
    }
}

/// The kind of mapping, as detected at open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArenaKind {
    /// A device-dax character device (size and alignment from sysfs).
    DevDax,
    /// A regular file (fsdax, tmpfs, or any file system).
    File,
    /// A memfd.
    Memfd,
    /// Anonymous memory.
    Anonymous,
}

/// Physical identity of a device (docs/lmcache-dax-behavior.md §3.2): a
/// character device by its `st_rdev`, a regular file by `(st_dev, st_ino)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceIdentity {
    /// A character device (device-dax).
    Char {
        /// Its device number (`st_rdev`).
        rdev: u64,
    },
    /// A regular file.
    File {
        /// The file system's device number (`st_dev`).
        dev: u64,
        /// The inode number (`st_ino`).
        ino: u64,
    },
}

impl DeviceIdentity {
    /// The identity of `path`, or `None` for a missing or unsupported path.
    pub fn of_path(path: &Path) -> Option<DeviceIdentity> {
        let md = std::fs::metadata(path).ok()?;
        if md.file_type().is_char_device() {
            Some(DeviceIdentity::Char { rdev: md.rdev() })
        } else if md.is_file() {
            Some(DeviceIdentity::File {
                dev: md.dev(),
                ino: md.ino(),
            })
        } else {
            None
        }
    }
}

struct Mapped {
    map: Option<MmapRaw>,
    base: *mut u8,
    len: usize,
    /// The open file or memfd; closed with the mapping (a closed device's
    /// fd does not outlive its `close`). Shared only with the memfd
    /// registry's weak handle ([`memlimit::register_memfd`]).
    file: Option<Arc<File>>,
}

/// One mapping plus its gate. See the module doc for the protocol.
pub struct Arena {
    describe: String,
    kind: ArenaKind,
    path: Option<PathBuf>,
    identity: Option<DeviceIdentity>,
    /// The file or memfd may be ftruncate'd when growing (we created it).
    resizable_file: bool,
    align_bytes: usize,
    max_len: usize,
    populate: bool,
    /// A memfd's grows are checked against these memory limits.
    mem_roots: Option<MemRoots>,
    /// Its entry in the SIGBUS registry (`fault`): declared before
    /// `mapped`, so it stops watching the range before the unmap on drop.
    watch: Option<fault::Registration>,
    mapped: UnsafeCell<Mapped>,
    /// Process-unique id for the nested-guard record (module doc).
    id: u64,
    /// The admission word and the lease count (`gate`).
    gate: CachePadded<Gate>,
    /// Bound on `exclusive` / `close` waiting for guards, in milliseconds.
    drain_timeout_ms: AtomicU64,
    admin: Mutex<()>,
    waiters: Mutex<()>,
    wake: Condvar,
    /// Told of every mapping this arena makes and drops ([`MappingObserver`]).
    observers: Mutex<Vec<Arc<dyn MappingObserver>>>,
    /// Bumped on every remap (1 for the first mapping).
    epoch: AtomicU64,
}

/// One mapping of an arena as a registrant (a CUDA host registration)
/// sees it: where it is and which mapping it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// The arena's process-unique id.
    pub arena_id: u64,
    /// The mapping's first byte.
    pub base: usize,
    /// Its length, bytes.
    pub len: usize,
    /// Which mapping of this arena: 1 for the first, one more for every
    /// remap.
    pub epoch: u64,
}

/// Told when a mapping appears and before it goes, so that something
/// registered against it (a `cuMemHostRegister`) follows its life.
///
/// - [`MappingObserver::mapped`] runs after a mapping is made (for every
///   mapping alive when the observer is added, at once: a replay that no
///   remap can interleave with) and [`MappingObserver::unmapping`] before
///   it is unmapped or replaced: the last step before the `munmap` (in a
///   remap, before the new mapping takes its place; at close, or in the
///   drop on whichever thread drops the arena, when a lease or guard kept
///   close from unmapping).
/// - Both run with the arena's admin lock held and no guard alive (or in
///   the drop): an observer must not call back into the arena (a guard, a
///   remap, a close, another observer). Such a call is detected and
///   refused (a guard: `Closed`; a remap: `Busy`; a close: no effect;
///   adding an observer: `false`) instead of deadlocking.
pub trait MappingObserver: Send + Sync {
    /// `region` is mapped and usable.
    fn mapped(&self, region: &Region);
    /// `region` is about to be unmapped (it is still mapped now).
    fn unmapping(&self, region: &Region);
}

thread_local! {
    /// This thread is inside a [`MappingObserver`] callback.
    static IN_OBSERVER: Cell<bool> = const { Cell::new(false) };
}

fn in_observer() -> bool {
    IN_OBSERVER.with(Cell::get)
}

/// True on a thread inside a [`MappingObserver`] callback (of any arena):
/// for layers above that must refuse calls from one (the engine's control
/// calls).
pub fn in_observer_callback() -> bool {
    in_observer()
}

/// Marks this thread as inside an observer callback while it lives, and
/// puts back what was there before when it drops (a callback can run
/// another: an arena dropped inside one tells its own observers), even if
/// the callback's panic payload panics as it drops.
struct InObserver(bool);

impl InObserver {
    fn enter() -> InObserver {
        InObserver(IN_OBSERVER.with(|f| f.replace(true)))
    }
}

impl Drop for InObserver {
    fn drop(&mut self) {
        IN_OBSERVER.with(|f| f.set(self.0));
    }
}

/// Run `what` on each observer with this thread marked as inside one (so a
/// call back into the arena is refused, not deadlocked). A panicking
/// observer is caught and logged: the mapping's life goes on.
fn tell(observers: &[Arc<dyn MappingObserver>], what: impl Fn(&dyn MappingObserver)) {
    for o in observers {
        let _inside = InObserver::enter();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| what(o.as_ref())));
        if r.is_err() {
            log_line!("daxkv: a mapping observer panicked; ignored");
        }
    }
}

// SAFETY: `mapped` is mutated only by `exclusive` and `close`, which hold
// `admin` and mutate only after observing the gate count at zero with
// EXCLUSIVE or CLOSED set; while that bit is set no guard is admitted
// except next to a live guard on the same arena (a nested `enter` or
// `reenter`), i.e. while the count is non-zero, which the mutation waits
// out. So no `ArenaGuard` (the only reader) exists while `mapped` changes. The raw
// pointer it holds points into a shared mapping that any thread may access by
// copy; the other fields are immutable or themselves `Sync`.
unsafe impl Sync for Arena {}
// SAFETY: nothing in `Arena` is tied to the creating thread; the mapping and
// the file are process-wide resources.
unsafe impl Send for Arena {}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("describe", &self.describe)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

fn map_err(what: &str, len: usize, source: std::io::Error) -> OpenError {
    OpenError::Map {
        what: what.to_string(),
        len,
        source,
    }
}

fn map_fd(file: &File, len: usize, populate: bool, what: &str) -> Result<MmapRaw, OpenError> {
    let mut opts = MmapOptions::new();
    opts.len(len);
    if populate {
        opts.populate();
    }
    opts.map_raw(file).map_err(|e| map_err(what, len, e))
}

/// Refuse a regular file that is not on an allowed file system
/// ([`crate::host::fstype`]): `fstatfs` of the opened `file`, or `statfs` of
/// `path` before anything is opened (`file` `None`).
fn check_file_system(path: &Path, file: Option<&File>) -> Result<(), OpenError> {
    let magic = match file {
        Some(f) => sys::fs_magic_fd(f),
        None => sys::fs_magic(path),
    }
    .map_err(|e| OpenError::Open {
        path: path.into(),
        source: e,
    })?;
    if crate::host::fstype::is_allowed(magic) {
        Ok(())
    } else {
        Err(OpenError::FileSystem {
            path: path.into(),
            fs: crate::host::fstype::describe(magic),
        })
    }
}

/// The refusal of a path that is neither a character device nor a regular
/// file nor a directory.
fn unsupported(path: &Path, ft: std::fs::FileType) -> OpenError {
    let kind = if ft.is_block_device() {
        "block device"
    } else if ft.is_fifo() {
        "fifo"
    } else if ft.is_socket() {
        "socket"
    } else {
        "unknown"
    };
    OpenError::Unsupported {
        path: path.into(),
        kind,
    }
}

/// Before creating or opening `path` as a file: the file if it exists,
/// else the directory it would be created in, is on an allowed file
/// system. Errors name `path`.
fn check_create_target(path: &Path) -> Result<(), OpenError> {
    let at = match path.parent() {
        Some(dir) if !path.exists() && !dir.as_os_str().is_empty() => dir,
        Some(_) if !path.exists() => Path::new("."),
        _ => path,
    };
    check_file_system(at, None).map_err(|e| match e {
        OpenError::FileSystem { fs, .. } => OpenError::FileSystem {
            path: path.into(),
            fs,
        },
        OpenError::Open { source, .. } => OpenError::Open {
            path: path.into(),
            source,
        },
        other => other,
    })
}

/// After the open: the descriptor is what `stat` saw (a character device
/// stays one, a regular file stays one and is on an allowed file system),
/// so a path swapped between the check and the open is refused.
fn check_opened(path: &Path, file: &File, was_char: bool) -> Result<(), OpenError> {
    let md = file.metadata().map_err(|e| OpenError::Open {
        path: path.into(),
        source: e,
    })?;
    if was_char && md.file_type().is_char_device() {
        return Ok(());
    }
    if was_char || !md.is_file() {
        return Err(OpenError::Unsupported {
            path: path.into(),
            kind: "changed while it was being opened",
        });
    }
    check_file_system(path, Some(file))
}

fn map_anon(len: usize, populate: bool) -> Result<MmapRaw, OpenError> {
    let mut opts = MmapOptions::new();
    opts.len(len);
    if populate {
        opts.populate();
    }
    opts.map_anon()
        .map(MmapRaw::from)
        .map_err(|e| map_err("anonymous", len, e))
}

impl Arena {
    /// Open and map per `spec`. Every refusal names the path and the problem.
    /// The mapping is watched for SIGBUS ([`crate::device::fault`]): a fault in a
    /// copy fails this arena ([`Arena::is_failed`]) instead of the process.
    pub fn open(spec: &ArenaSpec) -> Result<Arena, OpenError> {
        let mut arena = Arena::open_unwatched(spec)?;
        let watch = fault::Registration::new().map_err(|_| OpenError::Watch {
            what: arena.describe.clone(),
            max: fault::SLOTS_MAX,
        })?;
        // SAFETY: we own the arena alone (no guard can exist yet).
        let m = unsafe { &*arena.mapped.get() };
        watch.set_range(m.base, m.len);
        arena.watch = Some(watch);
        Ok(arena)
    }

    fn open_unwatched(spec: &ArenaSpec) -> Result<Arena, OpenError> {
        let len = spec.size_bytes;
        if len == 0 {
            return Err(OpenError::Zero {
                what: "size_bytes",
                value: 0,
            });
        }
        let max_len = spec.max_size_bytes.unwrap_or(len).max(len);
        match &spec.source {
            ArenaSource::Anonymous => {
                let map = map_anon(len, spec.populate)?;
                Ok(Arena::new(
                    "anonymous".into(),
                    ArenaKind::Anonymous,
                    None,
                    None,
                    None,
                    false,
                    1,
                    max_len,
                    spec.populate,
                    map,
                ))
            }
            ArenaSource::Memfd => {
                // A memfd is RAM: refuse a size the process cannot hold
                // before creating it (the pages come on first touch, too
                // late to say no).
                // Held until the memfd is registered (its size counted).
                let _promised = memlimit::check_memfd(len, &spec.mem_roots)?;
                let file = sys::memfd_create("daxkv").map_err(|e| map_err("memfd", len, e))?;
                file.set_len(len as u64).map_err(|e| OpenError::Truncate {
                    what: "memfd".into(),
                    len,
                    source: e,
                })?;
                let map = map_fd(&file, len, spec.populate, "memfd")?;
                let mut a = Arena::new(
                    "memfd".into(),
                    ArenaKind::Memfd,
                    None,
                    None,
                    Some(file),
                    true,
                    1,
                    max_len,
                    spec.populate,
                    map,
                );
                a.mem_roots = Some(spec.mem_roots.clone());
                if let Some(f) = &a.mapped.get_mut().file {
                    memlimit::register_memfd(f);
                }
                Ok(a)
            }
            ArenaSource::CreateFile(path) => {
                check_create_target(path)?;
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(path)
                    .map_err(|e| OpenError::Open {
                        path: path.clone(),
                        source: e,
                    })?;
                check_opened(path, &file, false)?;
                let cur = file
                    .metadata()
                    .map_err(|e| OpenError::Open {
                        path: path.clone(),
                        source: e,
                    })?
                    .len();
                if cur < len as u64 {
                    file.set_len(len as u64).map_err(|e| OpenError::Truncate {
                        what: path.display().to_string(),
                        len,
                        source: e,
                    })?;
                }
                let what = path.display().to_string();
                let map = map_fd(&file, len, spec.populate, &what)?;
                let identity = DeviceIdentity::of_path(path);
                Ok(Arena::new(
                    what,
                    ArenaKind::File,
                    Some(path.clone()),
                    identity,
                    Some(file),
                    true,
                    1,
                    max_len,
                    spec.populate,
                    map,
                ))
            }
            ArenaSource::Path(path) => Arena::open_path(path, spec, len),
        }
    }

    fn open_path(path: &Path, spec: &ArenaSpec, len: usize) -> Result<Arena, OpenError> {
        let md = match std::fs::metadata(path) {
            Ok(md) => md,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(OpenError::Missing { path: path.into() })
            }
            Err(e) => {
                return Err(OpenError::Open {
                    path: path.into(),
                    source: e,
                })
            }
        };
        let ft = md.file_type();
        let (kind, align, max_len) = if ft.is_dir() {
            return Err(OpenError::IsDirectory { path: path.into() });
        } else if ft.is_char_device() {
            // Size and alignment come from sysfs, before the device is
            // opened: mapping past its end would SIGBUS on first touch, and a
            // length that is not a multiple of `align` fails with EINVAL.
            let sysfs = |attr| {
                devdax::attr(&spec.sysfs_root, md.rdev(), attr).map_err(|e| OpenError::Sysfs {
                    path: path.into(),
                    attr,
                    sysfs: spec.sysfs_root.clone(),
                    source: e,
                })
            };
            let device_bytes = sysfs("size")?;
            let align = match devdax::attr(&spec.sysfs_root, md.rdev(), "align") {
                Ok(a) if a > 0 => a as usize,
                _ => DEFAULT_DEVDAX_ALIGN_BYTES,
            };
            if !len.is_multiple_of(align) {
                return Err(OpenError::Misaligned {
                    path: path.into(),
                    len,
                    align_bytes: align,
                });
            }
            if len as u64 > device_bytes {
                return Err(OpenError::DeviceTooSmall {
                    path: path.into(),
                    device_bytes,
                    requested_bytes: len,
                });
            }
            let usable = (device_bytes as usize) / align * align;
            (
                ArenaKind::DevDax,
                align,
                spec.max_size_bytes.unwrap_or(usable).min(usable),
            )
        } else if ft.is_file() {
            check_file_system(path, None)?; // before opening anything
            if md.len() < len as u64 {
                return Err(OpenError::FileTooSmall {
                    path: path.into(),
                    file_bytes: md.len(),
                    requested_bytes: len,
                });
            }
            // An explicit largest size may pass the file's length now: the
            // file can be extended later and grown into (`remap` checks
            // its length then).
            let file_len = md.len() as usize;
            (ArenaKind::File, 1, spec.max_size_bytes.unwrap_or(file_len))
        } else {
            return Err(unsupported(path, ft));
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| OpenError::Open {
                path: path.into(),
                source: e,
            })?;
        check_opened(path, &file, kind == ArenaKind::DevDax)?;
        if let Some(want) = spec.expect_file {
            // The file opened, not the path: a rename over the path
            // between the create and this open cannot choose what is mapped.
            let md = file.metadata().map_err(|e| OpenError::Open {
                path: path.into(),
                source: e,
            })?;
            if (md.dev(), md.ino()) != want {
                return Err(OpenError::Open {
                    path: path.into(),
                    source: std::io::Error::other(
                        "the file at this path is no longer the one just created",
                    ),
                });
            }
        }
        let what = path.display().to_string();
        let map = map_fd(&file, len, spec.populate, &what)?;
        Ok(Arena::new(
            what,
            kind,
            Some(path.into()),
            DeviceIdentity::of_path(path),
            Some(file),
            false,
            align,
            max_len.max(len),
            spec.populate,
            map,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn new(
        describe: String,
        kind: ArenaKind,
        path: Option<PathBuf>,
        identity: Option<DeviceIdentity>,
        file: Option<File>,
        resizable_file: bool,
        align_bytes: usize,
        max_len: usize,
        populate: bool,
        map: MmapRaw,
    ) -> Arena {
        let base = map.as_mut_ptr();
        let len = map.len();
        Arena {
            describe,
            kind,
            path,
            identity,
            resizable_file,
            align_bytes,
            max_len,
            populate,
            mem_roots: None,
            watch: None,
            mapped: UnsafeCell::new(Mapped {
                map: Some(map),
                base,
                len,
                file: file.map(Arc::new),
            }),
            // ORDERING: Relaxed — only uniqueness matters.
            id: NEXT_ARENA_ID.fetch_add(1, Ordering::Relaxed),
            gate: CachePadded::new(Gate::new()),
            drain_timeout_ms: AtomicU64::new(DEFAULT_DRAIN_TIMEOUT.as_millis() as u64),
            admin: Mutex::new(()),
            waiters: Mutex::new(()),
            wake: Condvar::new(),
            observers: Mutex::new(Vec::new()),
            epoch: AtomicU64::new(1),
        }
    }

    /// The current mapping as a [`Region`]; `None` once unmapped. The
    /// caller holds `admin` or a guard or lease (the mapping is stable).
    fn region(&self) -> Option<Region> {
        // SAFETY: the caller's `admin`, guard or lease keeps `mapped` from
        // changing (`unsafe impl Sync`).
        let m = unsafe { &*self.mapped.get() };
        m.map.as_ref().map(|_| Region {
            arena_id: self.id,
            base: m.base as usize,
            len: m.len,
            // ORDERING: Relaxed — changes only under `admin`.
            epoch: self.epoch.load(Ordering::Relaxed),
        })
    }

    /// The admin lock for `regions` and `observe`, or `None` where taking
    /// it could wait for ever or for a whole drain: inside an observer
    /// callback (a remap or close holds it on this thread, or one on
    /// another arena), or on a thread that holds a guard on this arena
    /// while a remap is pending (the remap holds it and waits for that
    /// guard; `exclusive` and `close` answer such a thread at once too).
    fn admin_unless_waiting(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        if in_observer() {
            return None;
        }
        if held_on(self.id) > 0 {
            return match self.admin.try_lock() {
                Ok(g) => Some(g),
                Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            };
        }
        Some(
            self.admin
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// The mapping alive now, if any. Empty where the answer could only
    /// come after a wait that may never end ([`MappingObserver`]: from a
    /// callback, which is given its region; from a guard holder while a
    /// remap is pending).
    pub fn regions(&self) -> Vec<Region> {
        let Some(_admin) = self.admin_unless_waiting() else {
            return Vec::new();
        };
        self.region().into_iter().collect()
    }

    /// Add an observer ([`MappingObserver`]): it is told of the mapping
    /// alive now at once, under the same lock as every later change, so
    /// it misses none and sees none twice. False (and not added) from
    /// inside an observer callback, and from a thread holding a guard on
    /// this arena while a remap is pending.
    ///
    /// The arena keeps the observer until [`Arena::unobserve`] or its drop:
    /// an observer that holds its own device strongly (an `Arc` of the
    /// core) keeps both alive for good. Hold it with a `Weak`.
    pub fn observe(&self, observer: Arc<dyn MappingObserver>) -> bool {
        let Some(_admin) = self.admin_unless_waiting() else {
            return false;
        };
        if let Some(r) = self.region() {
            tell(std::slice::from_ref(&observer), |o| o.mapped(&r));
        }
        self.observers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(observer);
        true
    }

    /// Stop telling `observer` (the same `Arc`) anything; it is told
    /// nothing now either (a registrant that lets go of the mapping
    /// itself). False if it was not observing, and from a callback.
    pub fn unobserve(&self, observer: &Arc<dyn MappingObserver>) -> bool {
        let Some(_admin) = self.admin_unless_waiting() else {
            return false;
        };
        let mut list = self
            .observers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = list.len();
        list.retain(|o| !Arc::ptr_eq(o, observer));
        list.len() != before
    }

    /// Tell every observer (the caller holds `admin`, or is the drop).
    fn tell_all(&self, what: impl Fn(&dyn MappingObserver)) {
        let observers = self
            .observers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        tell(&observers, what);
    }

    /// Whether a SIGBUS during a copy (the file truncated under the
    /// mapping, a poisoned memory line) failed this arena: every copy since
    /// fails with [`CopyError::DeviceFailed`], and it never recovers.
    pub fn is_failed(&self) -> bool {
        self.watch.as_ref().is_some_and(fault::Registration::failed)
    }

    /// Fail this arena now, as a recovered SIGBUS would (the `failpoints`
    /// feature; an arena opened unwatched cannot fail and ignores it).
    #[cfg(any(test, feature = "failpoints"))]
    pub(crate) fn mark_failed(&self) {
        if let Some(w) = &self.watch {
            w.mark_failed();
        }
    }

    /// "memfd", "anonymous" or the path.
    pub fn describe(&self) -> &str {
        &self.describe
    }

    /// What kind of mapping this is.
    pub fn kind(&self) -> ArenaKind {
        self.kind
    }

    /// The mapped path (`None` for a memfd or anonymous memory).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The physical identity of the mapped device or file, taken from the
    /// open fd (`None` for a memfd or anonymous memory).
    pub fn identity(&self) -> Option<DeviceIdentity> {
        self.identity
    }

    /// The largest length a remap may ask for.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The granularity a mapping length must be a multiple of: the
    /// device-dax `align` (default [`DEFAULT_DEVDAX_ALIGN_BYTES`]), else 1.
    pub fn align_bytes(&self) -> usize {
        self.align_bytes
    }

    /// True once [`Arena::close`] has started (advisory: a guard can still
    /// be refused or admitted a moment later).
    pub fn is_closed(&self) -> bool {
        // ORDERING: Relaxed — advisory; `enter` re-checks with Acquire.
        self.gate.peek() & CLOSED != 0
    }

    /// Live guards (status only).
    pub fn active_guards(&self) -> usize {
        // ORDERING: Relaxed — a statistic.
        (self.gate.peek() & GUARD_MASK) as usize
    }

    /// How long [`Arena::exclusive`] and [`Arena::close`] wait for live
    /// guards before giving up ([`DEFAULT_DRAIN_TIMEOUT`] unless set).
    pub fn drain_timeout(&self) -> Duration {
        // ORDERING: Relaxed — a setting; nothing is published through it.
        Duration::from_millis(self.drain_timeout_ms.load(Ordering::Relaxed))
    }

    /// Change [`Arena::drain_timeout`].
    pub fn set_drain_timeout(&self, t: Duration) {
        // ORDERING: Relaxed — a setting.
        self.drain_timeout_ms
            .store(t.as_millis().max(1) as u64, Ordering::Relaxed);
    }

    /// True while an exclusive section (remap) is pending or running.
    pub fn is_exclusive_pending(&self) -> bool {
        self.gate.peek() & EXCLUSIVE != 0
    }

    /// Take a guard: the mapping stays valid until it drops. Waits while a
    /// remap is pending (at most the pending section's drain timeout plus
    /// its mutation), unless this thread already holds a guard on this
    /// arena (module doc, "Nested guards"); fails once the arena is closing
    /// or closed.
    pub fn enter(&self) -> Result<ArenaGuard<'_>, Closed> {
        if in_observer() {
            // Inside a remap or close of some arena: waiting could never end.
            return Err(Closed);
        }
        loop {
            match self.try_enter() {
                Ok(g) => return Ok(g),
                Err(TryEnterError::Closed) => return Err(Closed),
                Err(TryEnterError::Busy) => {}
            }
            let mut g = self
                .waiters
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // Advisory: `try_enter` decides (with an Acquire RMW).
            while self.gate.peek() & EXCLUSIVE != 0 {
                g = self
                    .wake
                    .wait_timeout(g, Duration::from_millis(10))
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
            }
        }
    }

    /// [`Arena::enter`] without waiting: `Busy` instead of waiting for a
    /// pending remap (a caller that holds something another thread may
    /// wait for, like the engine's key claims, must not wait here: see the
    /// engine's "Key ownership" doc).
    pub fn try_enter(&self) -> Result<ArenaGuard<'_>, TryEnterError> {
        let nested = held_on(self.id) > 0;
        // The admission (`Gate::enter` has the orderings): a guard admitted
        // after a remap sees the new `mapped`.
        if let Err((why, wake)) = self.gate.enter(nested) {
            return Err(self.refused(why, wake));
        }
        // SAFETY: our increment was admitted: either no EXCLUSIVE /
        // CLOSED was set before it, or this thread holds an undropped
        // guard on this very arena (the id is unique), whose increment
        // keeps the count above zero so the pending section is still
        // waiting. Either way no exclusive section or close mutates
        // `mapped` until this guard drops (see `unsafe impl Sync`).
        let m = unsafe { &*self.mapped.get() };
        Ok(ArenaGuard {
            arena: self,
            base: m.base,
            len: m.len,
            recorded: note_enter(self.id),
        })
    }

    /// A refused admission: wake a waiter if the undo was the last count,
    /// and say why.
    fn refused(&self, why: Refused, wake: bool) -> TryEnterError {
        if wake {
            self.notify();
        }
        if why == Refused::Closed {
            TryEnterError::Closed
        } else {
            TryEnterError::Busy
        }
    }

    /// A lease: a guard not tied to a thread, that never waits and that
    /// no remap waits for (`gate`, "Leases"). `Busy` while a remap is
    /// pending, `Closed` once closing. The mapping stays while it lives;
    /// [`Arena::exclusive`] answers [`GateError::Leased`] at once meanwhile
    /// and [`Arena::close`] leaves the unmap to the arena's drop.
    pub fn try_lease(&self) -> Result<ArenaLease<'_>, TryEnterError> {
        if let Err((why, wake)) = self.gate.try_lease() {
            return Err(self.refused(why, wake));
        }
        // SAFETY: admitted with neither EXCLUSIVE nor CLOSED set
        // (`Gate::try_lease`), and counted: no exclusive section or close
        // mutates `mapped` until it is dropped.
        let m = unsafe { &*self.mapped.get() };
        Ok(ArenaLease {
            arena: self,
            base: m.base,
            len: m.len,
            // ORDERING: Relaxed — changes only in an exclusive section,
            // whose Release `end_exclusive` our admission read (the gate
            // RMW), and none can run while this lease lives.
            epoch: self.epoch.load(Ordering::Relaxed),
        })
    }

    /// Run `copy` as a watched copy of this arena (`fault`): a SIGBUS in
    /// the mapping while it runs fails the arena, and then this copy.
    #[inline]
    fn watched(&self, copy: impl FnOnce()) -> Result<(), CopyError> {
        let failed = if let Some(w) = &self.watch {
            w.failed() || w.in_copy(copy)
        } else {
            copy();
            false
        };
        if failed {
            Err(CopyError::DeviceFailed)
        } else {
            Ok(())
        }
    }

    /// Leases alive now.
    pub fn active_leases(&self) -> u64 {
        self.gate.leases()
    }

    fn leave(&self) {
        if self.gate.leave() {
            self.notify();
        }
    }

    /// Wake the threads waiting on the gate.
    fn notify(&self) {
        let _g = self
            .waiters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.wake.notify_all();
    }

    /// Wait until no guard is alive, at most the drain timeout; the number
    /// of guards still alive if it ran out.
    fn wait_idle(&self) -> Result<(), usize> {
        let deadline = Instant::now() + self.drain_timeout();
        let mut g = self
            .waiters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            // Acquire (`Gate::guards`): every departed guard's copies
            // happen-before what we do next. Leases are not waited for
            // (`gate`, "Leases").
            let live = self.gate.guards();
            if live == 0 {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(live as usize);
            }
            g = self
                .wake
                .wait_timeout(g, (deadline - now).min(Duration::from_millis(10)))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    fn end_exclusive(&self) {
        self.gate.end_exclusive();
        self.notify();
    }

    /// The admin lock for an exclusive section or a drain; `Busy` at once
    /// inside an observer callback (the lock may be this thread's own).
    fn section_admin(&self) -> Result<std::sync::MutexGuard<'_, ()>, GateError> {
        if in_observer() {
            return Err(GateError::Busy {
                guards: 0,
                waited: Duration::ZERO,
            });
        }
        Ok(self
            .admin
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Run `f` with no guard alive and new guards held off: the place to
    /// remap and to change anything the data path reads without locks.
    /// Fails with [`GateError::Busy`] (and runs nothing) when guards are
    /// still alive after the drain timeout, or at once when the calling
    /// thread holds one itself; with [`GateError::Leased`] at once while a
    /// lease is alive (a lease is never waited for, and new guards are not
    /// held off for it: `gate`, "Leases").
    pub fn exclusive<R>(&self, f: impl FnOnce(&mut Exclusive<'_>) -> R) -> Result<R, GateError> {
        let _admin = self.section_admin()?;
        // EXCLUSIVE is in the gate's modification order before the count
        // is read, so every later `enter` sees it (`Gate::begin_exclusive`).
        match self.gate.begin_exclusive() {
            Ok(()) => {}
            Err(why) => {
                self.notify();
                return Err(match why {
                    Refused::Leased(leases) => GateError::Leased { leases },
                    Refused::Closed | Refused::Busy => GateError::Closed,
                });
            }
        }
        // A thread that holds a guard on this arena would wait for itself
        // (a writer callback that resizes the device it writes into): busy
        // at once, not after the drain timeout (`tests/store.rs::
        // remap_from_a_put_writer_is_busy_at_once`).
        let mine = held_on(self.id);
        if mine > 0 {
            self.end_exclusive();
            return Err(GateError::Busy {
                guards: mine as usize,
                waited: Duration::ZERO,
            });
        }
        if let Err(guards) = self.wait_idle() {
            self.end_exclusive();
            return Err(GateError::Busy {
                guards,
                waited: self.drain_timeout(),
            });
        }
        let r = f(&mut Exclusive {
            arena: self,
            old: Vec::new(),
        });
        self.end_exclusive();
        Ok(r)
    }

    /// Hold new guards and leases off and wait for the guards alive now to
    /// leave (at most the drain timeout), whatever leases are live, then
    /// let everything in again; the mapping does not change. A forced
    /// hotplug remove uses it where [`Arena::exclusive`] answers
    /// [`GateError::Leased`]: every operation that entered before the
    /// caller changed the device's state has left when it returns `Ok`.
    /// [`GateError::Busy`] as for `exclusive` (guards still alive at the
    /// deadline, or held by the calling thread), `Closed` once closing.
    pub fn drain(&self) -> Result<(), GateError> {
        let _admin = self.section_admin()?;
        if self.gate.begin_drain().is_err() {
            self.notify();
            return Err(GateError::Closed);
        }
        let mine = held_on(self.id);
        let r = if mine > 0 {
            Err(GateError::Busy {
                guards: mine as usize,
                waited: Duration::ZERO,
            })
        } else {
            self.wait_idle().map_err(|guards| GateError::Busy {
                guards,
                waited: self.drain_timeout(),
            })
        };
        self.end_exclusive();
        r
    }

    /// Refuse new guards, wait for the live ones (at most the drain
    /// timeout), run `f`, then unmap. Idempotent: a later call returns
    /// `false` without running `f`. If guards are still alive at the
    /// deadline (a stuck caller, or a guard leaked with `mem::forget`),
    /// or at once when the calling thread holds a guard on this arena
    /// itself or a lease is alive (a lease is never waited for), `f` does
    /// not run and the mapping stays until the arena drops (when no guard
    /// or lease can be in use any more); the arena refuses guards and
    /// leases either way.
    pub fn close(&self, f: impl FnOnce()) -> bool {
        if in_observer() {
            return false;
        }
        let _admin = self
            .admin
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !self.gate.close() {
            return false;
        }
        // A thread that holds a guard on this arena (a writer callback
        // closing the store it writes into) would wait for itself: it
        // closes the gate and returns at once, as at the drain timeout
        // (it waited out the whole timeout before,
        // `tests/store.rs::close_from_a_put_writer_returns_at_once`).
        // A lease counted before CLOSED was set is seen here; one after it
        // saw CLOSED and backs out (`Gate::close`, SeqCst). A lease being
        // refused shows in the count for an instant, so a count above zero
        // is looked at again a few times before close gives the unmap to
        // the drop.
        let leased = || {
            (0..8).all(|_| {
                let live = self.gate.leases() > 0;
                if live {
                    std::thread::yield_now();
                }
                live
            })
        };
        if held_on(self.id) > 0 || leased() || self.wait_idle().is_err() {
            return true;
        }
        f();
        if let Some(r) = self.region() {
            self.tell_all(|o| o.unmapping(&r));
        }
        // SAFETY: CLOSED is set and the count was seen at zero, so no guard
        // exists and none can be admitted (`enter` backs out on CLOSED;
        // `reenter` needs a live guard); `admin` excludes `exclusive`.
        let m = unsafe { &mut *self.mapped.get() };
        if let Some(w) = &self.watch {
            w.clear_range();
        }
        m.map = None;
        m.file = None;
        m.base = std::ptr::null_mut();
        m.len = 0;
        // Unmapped: the SIGBUS registry's entry goes back now, not when
        // the arena drops (a closed device's tombstone may live on).
        if let Some(w) = &self.watch {
            w.release();
        }
        true
    }
}

impl Drop for Arena {
    /// The observers' last word on a mapping that `close` did not unmap
    /// (a lease or a guard was alive then): it is unmapped right after,
    /// as the fields drop, on whichever thread dropped the arena.
    fn drop(&mut self) {
        if let Some(r) = self.region() {
            self.tell_all(|o| o.unmapping(&r));
        }
    }
}

/// Why [`Arena::try_enter`] gave no guard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TryEnterError {
    /// The arena is closing or closed.
    Closed,
    /// A remap is pending: [`Arena::enter`] would have waited.
    Busy,
}

/// The arena refused a guard because it is closing or closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Closed;

/// Mutation rights while no guard is alive (from [`Arena::exclusive`]).
pub struct Exclusive<'a> {
    arena: &'a Arena,
    old: Vec<MmapRaw>,
}

impl std::fmt::Debug for Exclusive<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exclusive")
            .field("arena", self.arena)
            .finish_non_exhaustive()
    }
}

impl Exclusive<'_> {
    /// Current mapping length, bytes.
    pub fn len(&self) -> usize {
        // SAFETY: we run inside `exclusive`: no guard exists.
        unsafe { (*self.arena.mapped.get()).len }
    }

    /// True for a zero-length mapping (never, once opened).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Map the same device or file at `new_len`. On failure the old mapping
    /// stays in place untouched.
    pub fn remap(&mut self, new_len: usize) -> Result<(), OpenError> {
        let a = self.arena;
        if new_len == 0 {
            return Err(OpenError::Zero {
                what: "size_bytes",
                value: 0,
            });
        }
        if new_len > a.max_len {
            return Err(OpenError::BeyondCapacity {
                what: a.describe.clone(),
                requested_bytes: new_len,
                max_bytes: a.max_len,
            });
        }
        if !new_len.is_multiple_of(a.align_bytes) {
            return Err(OpenError::Misaligned {
                path: a.path.clone().unwrap_or_default(),
                len: new_len,
                align_bytes: a.align_bytes,
            });
        }
        let cur_len = self.len();
        // SAFETY: inside `exclusive`: no guard exists and `admin` is held,
        // so nothing mutates `mapped` while this shared borrow lives (it
        // ends before the `&mut` below).
        let file = unsafe { (*a.mapped.get()).file.as_ref() };
        // Held until the memfd has its new size (counted from then on).
        let _promised = match &a.mem_roots {
            Some(roots) if a.kind == ArenaKind::Memfd && new_len > cur_len => {
                Some(memlimit::check_memfd(new_len - cur_len, roots)?)
            }
            _ => None,
        };
        let new_map = if let Some(file) = file {
            if !a.resizable_file && a.kind == ArenaKind::File {
                // Mapping past a file's end SIGBUSes on first touch.
                let file_bytes = file.metadata().map_or(0, |m| m.len());
                if file_bytes < new_len as u64 {
                    return Err(OpenError::FileShorterThanGrow {
                        what: a.describe.clone(),
                        requested_bytes: new_len,
                        file_bytes,
                    });
                }
            }
            if a.resizable_file {
                let cur = file.metadata().map_or(0, |m| m.len());
                if cur < new_len as u64 {
                    file.set_len(new_len as u64)
                        .map_err(|e| OpenError::Truncate {
                            what: a.describe.clone(),
                            len: new_len,
                            source: e,
                        })?;
                }
            }
            map_fd(file, new_len, a.populate, &a.describe)?
        } else {
            let m = map_anon(new_len, a.populate)?;
            // Anonymous memory has no backing to re-map: carry the bytes.
            let keep = cur_len.min(new_len);
            // SAFETY: no guard exists (we are inside `exclusive`); the old
            // mapping is valid for `len` bytes and the new one for
            // `new_len`; they are distinct mappings.
            unsafe {
                let old = &*a.mapped.get();
                std::ptr::copy_nonoverlapping(old.base, m.as_mut_ptr(), keep);
            }
            m
        };
        // The old mapping's registrants let go of it before it is
        // replaced (it is unmapped when `Exclusive` drops).
        if let Some(r) = a.region() {
            a.tell_all(|o| o.unmapping(&r));
        }
        // SAFETY: inside `exclusive`: no guard exists and `admin` is held.
        let m = unsafe { &mut *a.mapped.get() };
        m.base = new_map.as_mut_ptr();
        m.len = new_map.len();
        if let Some(w) = &a.watch {
            w.set_range(m.base, m.len);
        }
        if let Some(old) = m.map.replace(new_map) {
            // Unmapped when `Exclusive` drops, after the swap is complete.
            self.old.push(old);
        }
        // ORDERING: Relaxed — changes only under `admin` (held here).
        a.epoch.fetch_add(1, Ordering::Relaxed);
        if let Some(r) = a.region() {
            a.tell_all(|o| o.mapped(&r));
        }
        Ok(())
    }
}

/// A live use of the mapping. While it exists the mapping is not remapped or
/// unmapped. Accesses are raw copies (see the module's Safety section),
/// `unsafe` because two of them racing on one range would be a data race:
///
/// ```compile_fail
/// # use daxkv::device::arena::{Arena, ArenaSource, ArenaSpec};
/// let a = Arena::open(&ArenaSpec::new(ArenaSource::Anonymous, 4096)).unwrap();
/// let g = a.enter().unwrap();
/// g.write(0, &[1u8; 64]).unwrap(); // E0133: needs `unsafe` and its contract
/// ```
pub struct ArenaGuard<'a> {
    arena: &'a Arena,
    base: *mut u8,
    len: usize,
    /// The entry of this thread's nested-guard record that counts it
    /// (module doc); `None` when the record was full.
    recorded: Option<u8>,
}

impl std::fmt::Debug for ArenaGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaGuard")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

// SAFETY: a shared guard only copies through its raw pointer, which the
// module's Safety section allows from any thread while the guard keeps the
// mapping alive. It is not `Send` (the raw pointer field), so it drops on
// the thread whose nested-guard record counted it.
unsafe impl Sync for ArenaGuard<'_> {}

impl Drop for ArenaGuard<'_> {
    fn drop(&mut self) {
        if let Some(at) = self.recorded {
            note_leave(self.arena.id, at);
        }
        self.arena.leave();
    }
}

/// The mapping held open across calls and threads ([`Arena::try_lease`];
/// `gate`, "Leases"): the base and length it saw stay valid until it drops.
/// Unlike an [`ArenaGuard`] it is `Send` and not recorded per thread, and
/// gives no copy methods: its holder copies through raw pointers (a GPU's
/// copy engine), so a SIGBUS in such a copy is not caught by `fault`.
pub struct ArenaLease<'a> {
    arena: &'a Arena,
    base: *mut u8,
    len: usize,
    epoch: u64,
}

// SAFETY: the lease is a count on the arena's gate, which any thread may
// drop; `base` points into a process-wide shared mapping that the count
// keeps mapped, and the lease itself never dereferences it.
unsafe impl Send for ArenaLease<'_> {}
// SAFETY: as above; `&ArenaLease` only reads `base` and `len`.
unsafe impl Sync for ArenaLease<'_> {}

impl std::fmt::Debug for ArenaLease<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaLease")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl ArenaLease<'_> {
    /// The mapping's epoch ([`Region::epoch`]): stable while it lives.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Mapping length this lease sees, bytes (stable while it lives).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length mapping.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A raw pointer `offset` bytes into the mapping, valid while this
    /// lease lives; `None` past the end.
    pub fn ptr(&self, offset: usize) -> Option<*mut u8> {
        (offset <= self.len).then(|| self.base.wrapping_add(offset))
    }

    /// Copy `src` into the mapping at `offset` (the store kernel, a SIGBUS
    /// caught as for a guard's copy: `DeviceFailed`).
    ///
    /// # Safety
    /// No other thread reads or writes `offset..offset + src.len()` of the
    /// mapping while the call runs (a store lease's own slot), and `src`
    /// does not overlap it.
    pub unsafe fn write(&self, offset: usize, src: &[u8]) -> Result<(), CopyError> {
        self.check(offset, src.len())?;
        // SAFETY: `to_dax`'s contract: the destination is in the mapping
        // (checked) that this lease keeps mapped, and no one else touches
        // it (this function's contract); `src` is a slice, disjoint from it.
        self.arena
            .watched(|| unsafe { copy::to_dax(self.base.add(offset), src.as_ptr(), src.len()) })
    }

    /// Copy `dst.len()` bytes out of the mapping at `offset` (a SIGBUS
    /// caught: `DeviceFailed`).
    ///
    /// # Safety
    /// No other thread writes `offset..offset + dst.len()` of the mapping
    /// while the call runs (a read lease's readable slot has no writer).
    pub unsafe fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), CopyError> {
        self.check(offset, dst.len())?;
        // SAFETY: `from_dax`'s contract: the source is in the mapping
        // (checked) this lease keeps mapped and unwritten (this function's
        // contract); `dst` is a unique borrow outside the mapping (the arena
        // hands out no reference into it).
        self.arena.watched(|| unsafe {
            copy::from_dax(dst.as_mut_ptr(), self.base.add(offset), dst.len());
        })
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), OutOfBounds> {
        OutOfBounds::check(offset, len, self.len)
    }
}

impl Drop for ArenaLease<'_> {
    fn drop(&mut self) {
        if self.arena.gate.end_lease() {
            self.arena.notify();
        }
    }
}

/// Why a copy into or out of the mapping failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    /// The range is outside the mapping; nothing was copied.
    #[error(transparent)]
    OutOfBounds(#[from] OutOfBounds),
    /// The device faulted (SIGBUS: its file was truncated under the
    /// mapping, or a memory line is poisoned) during this copy or an
    /// earlier one, and is failed for good ([`crate::device::fault`]); the bytes
    /// copied are not the device's.
    #[error("the device faulted (SIGBUS) and is marked failed")]
    DeviceFailed,
}

/// An access outside the mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("access of {len} bytes at offset {offset} is outside the {mapped} byte mapping")]
pub struct OutOfBounds {
    /// Start of the access, bytes from the start of the mapping.
    pub offset: usize,
    /// Length of the access, bytes.
    pub len: usize,
    /// Mapping length the guard sees, bytes.
    pub mapped: usize,
}

impl OutOfBounds {
    /// `Ok` when `offset..offset + len` lies within `mapped` bytes (an
    /// overflowing end does not).
    #[inline]
    pub fn check(offset: usize, len: usize, mapped: usize) -> Result<(), OutOfBounds> {
        match offset.checked_add(len) {
            Some(end) if end <= mapped => Ok(()),
            _ => Err(OutOfBounds {
                offset,
                len,
                mapped,
            }),
        }
    }
}

impl<'a> ArenaGuard<'a> {
    /// A second guard on the same arena, admitted without waiting even if a
    /// remap is pending: this guard keeps the count above zero, so that
    /// remap cannot have started changing the mapping and cannot until both
    /// guards are gone. Works from any thread that can see this guard
    /// (scoped helper threads included) and needs no room in the thread's
    /// nested-guard record.
    #[must_use]
    pub fn reenter(&self) -> ArenaGuard<'a> {
        // The count is already non-zero (ours), so this increment changes
        // no admission decision; `leave`'s Release publishes what the new
        // guard does.
        self.arena.gate.reenter();
        ArenaGuard {
            arena: self.arena,
            base: self.base,
            len: self.len,
            recorded: note_enter(self.arena.id),
        }
    }

    /// Mapping length this guard sees, bytes (stable while it lives).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length mapping.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The arena this guard holds open.
    pub fn arena(&self) -> &Arena {
        self.arena
    }

    /// Run `copy` as a watched copy of this arena (`fault`): a SIGBUS in
    /// the mapping while it runs fails the arena, and then this copy.
    #[inline]
    fn watched(&self, copy: impl FnOnce()) -> Result<(), CopyError> {
        self.arena.watched(copy)
    }

    #[inline]
    fn check(&self, offset: usize, len: usize) -> Result<(), OutOfBounds> {
        OutOfBounds::check(offset, len, self.len)
    }

    /// Copy `src` into the mapping at `offset` with non-temporal stores,
    /// fenced (`sfence`) before returning.
    ///
    /// # Safety
    /// 1. No other thread reads or writes `offset..offset + src.len()` of
    ///    this mapping while the call runs (the writer of a WRITING slot has
    ///    that).
    /// 2. `src` does not overlap that range. Safe code cannot break this:
    ///    the arena hands out no reference into the mapping.
    #[inline]
    pub unsafe fn write(&self, offset: usize, src: &[u8]) -> Result<(), CopyError> {
        self.check(offset, src.len())?;
        // SAFETY: `to_dax`'s contract:
        // 1. the destination is valid for writes: offset + len <= mapping
        //    length (checked) and the guard keeps the mapping alive; `src`
        //    is a slice, valid for reads;
        // 2. the two do not overlap (this function's contract, point 2);
        // 3. no other thread touches the destination meanwhile (point 1),
        //    and none writes `src` (a shared borrow).
        self.watched(|| unsafe { copy::to_dax(self.base.add(offset), src.as_ptr(), src.len()) })
    }

    /// [`ArenaGuard::write`] from a raw source (a buffer another agent owns,
    /// or another arena's mapping).
    ///
    /// # Safety
    /// 1. No other thread reads or writes `offset..offset + len` of this
    ///    mapping while the call runs (as for [`ArenaGuard::write`]).
    /// 2. `src` is valid for reads of `len` bytes, and no other thread
    ///    writes `src..src + len`, for the duration of the call.
    /// 3. `src..src + len` does not overlap `offset..offset + len` of this
    ///    mapping.
    #[inline]
    pub unsafe fn write_from_ptr(
        &self,
        offset: usize,
        src: *const u8,
        len: usize,
    ) -> Result<(), CopyError> {
        self.check(offset, len)?;
        // SAFETY: `to_dax`'s contract: the destination is valid for writes
        // (bounds checked, the guard keeps the mapping alive) and no other
        // thread touches it (this function's contract, point 1); the source
        // is valid and unwritten meanwhile (point 2); the two are disjoint
        // (point 3).
        self.watched(|| unsafe { copy::to_dax(self.base.add(offset), src, len) })
    }

    /// Copy `dst.len()` bytes out of the mapping at `offset`.
    ///
    /// # Safety
    /// 1. No other thread writes `offset..offset + dst.len()` of this
    ///    mapping while the call runs (a borrowed slot has no writer).
    /// 2. `dst` does not overlap that range. Safe code cannot break this:
    ///    the arena hands out no reference into the mapping.
    #[inline]
    pub unsafe fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), CopyError> {
        self.check(offset, dst.len())?;
        // SAFETY: `from_dax`'s contract: the source is valid for reads
        // (bounds checked, the guard keeps the mapping alive) and no other
        // thread writes it (this function's contract, point 1); `dst` is a
        // unique borrow, valid for writes and touched by no one else; the
        // two are disjoint (point 2).
        self.watched(|| unsafe {
            copy::from_dax(dst.as_mut_ptr(), self.base.add(offset), dst.len());
        })
    }

    /// [`ArenaGuard::read`] with streaming (non-temporal) stores into `dst`,
    /// fenced before returning ([`copy::from_dax_streaming`]).
    ///
    /// # Safety
    /// The contract of [`ArenaGuard::read`].
    #[inline]
    pub unsafe fn read_streaming(&self, offset: usize, dst: &mut [u8]) -> Result<(), CopyError> {
        self.check(offset, dst.len())?;
        // SAFETY: `from_dax_streaming`'s contract, as in `read`: the source
        // valid (bounds checked) and unwritten (this function's contract,
        // point 1), `dst` a unique borrow, the two disjoint (point 2).
        self.watched(|| unsafe {
            copy::from_dax_streaming(dst.as_mut_ptr(), self.base.add(offset), dst.len());
        })
    }

    /// Copy `len` bytes at `offset` into a raw destination.
    ///
    /// # Safety
    /// 1. No other thread writes `offset..offset + len` of this mapping
    ///    while the call runs (as for [`ArenaGuard::read`]).
    /// 2. `dst` is valid for writes of `len` bytes, and no other thread
    ///    reads or writes `dst..dst + len`, for the duration of the call.
    /// 3. `dst..dst + len` does not overlap `offset..offset + len` of this
    ///    mapping.
    #[inline]
    pub unsafe fn read_to_ptr(
        &self,
        offset: usize,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), CopyError> {
        self.check(offset, len)?;
        // SAFETY: `from_dax`'s contract: the source is valid for reads
        // (bounds checked, the guard keeps the mapping alive) and no other
        // thread writes it (this function's contract, point 1); `dst` is
        // valid and touched by no one else (point 2); the two are disjoint
        // (point 3).
        self.watched(|| unsafe { copy::from_dax(dst, self.base.add(offset), len) })
    }

    /// A raw pointer `offset` bytes into the mapping (benchmarks drive the
    /// copy kernels through it). Valid while this guard lives. Only with
    /// the `test-hooks` feature.
    #[cfg(feature = "test-hooks")]
    pub fn as_ptr(&self, offset: usize) -> *mut u8 {
        assert!(
            offset <= self.len,
            "offset {offset} past the {} byte mapping",
            self.len
        );
        self.base.wrapping_add(offset)
    }

    test_hooks_pub! {
    /// Plain `memcpy` into the mapping (the benchmark baseline). Public
    /// with the `test-hooks` feature only.
    ///
    /// # Safety
    /// The contract of [`ArenaGuard::write`].
    unsafe fn write_plain(&self, offset: usize, src: &[u8]) -> Result<(), CopyError> {
        self.check(offset, src.len())?;
        // SAFETY: `plain_copy`'s contract (`to_dax`'s), as in `write`: the
        // destination valid (bounds checked) and touched by no other thread
        // (this function's contract, point 1), `src` a shared borrow, the
        // two disjoint (point 2).
        self.watched(|| unsafe { copy::plain_copy(self.base.add(offset), src.as_ptr(), src.len()) })
    }
    }

    test_hooks_pub! {
    /// Touch every page so first-touch faults happen now (benchmarks; real
    /// DAX has none). Public with the `test-hooks` feature only.
    ///
    /// # Safety
    /// No other thread reads or writes the mapping while the call runs (it
    /// reads and rewrites one byte of every page).
    unsafe fn prefault(&self) {
        let page = 4096;
        let mut off = 0;
        while off < self.len {
            // SAFETY: off < len, inside the mapping the guard keeps alive;
            // a volatile read-modify-write of one byte per page keeps its
            // value; no other thread reads or writes the mapping meanwhile
            // (this function's contract).
            unsafe {
                let p = self.base.add(off);
                p.write_volatile(p.read_volatile());
            }
            off += page;
        }
    }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    /// `ArenaGuard::write` for these tests, where no two threads ever
    /// touch the same bytes at once.
    fn w(g: &ArenaGuard<'_>, offset: usize, src: &[u8]) -> Result<(), CopyError> {
        // SAFETY: in these tests each range is written by one thread at a
        // time and not read meanwhile.
        unsafe { g.write(offset, src) }
    }

    /// Start a remap of `b` to `len` on another thread and return once it
    /// is pending (waiting for the guards alive now); the flag turns true
    /// when it has remapped.
    fn pending_remap(b: &Arc<Arena>, len: usize) -> (std::thread::JoinHandle<()>, Arc<AtomicBool>) {
        let done = Arc::new(AtomicBool::new(false));
        let remap = {
            let (b, done) = (b.clone(), done.clone());
            std::thread::spawn(move || {
                b.exclusive(|ex| {
                    ex.remap(len).unwrap();
                    done.store(true, Ordering::SeqCst);
                })
                .unwrap();
            })
        };
        while !b.is_exclusive_pending() {
            std::thread::yield_now();
        }
        (remap, done)
    }

    /// `ArenaGuard::read` for these tests (see `w`).
    fn r(g: &ArenaGuard<'_>, offset: usize, dst: &mut [u8]) -> Result<(), CopyError> {
        // SAFETY: as in `w`: no writer of the range meanwhile.
        unsafe { g.read(offset, dst) }
    }

    /// A closed arena gives its SIGBUS registry entry back at once:
    /// more arenas than the registry holds can be opened and closed while
    /// every closed one is still alive (a tombstone). With the release in
    /// `close` removed, the 1025th open fails with `OpenError::Watch`.
    #[test]
    #[cfg_attr(miri, ignore = "1088 mappings: too slow under Miri")]
    fn a_closed_arena_frees_its_registry_entry() {
        let mut closed = Vec::new();
        for i in 0..fault::SLOTS_MAX + 64 {
            let a = Arena::open(&ArenaSpec::new(ArenaSource::Anonymous, 4096))
                .unwrap_or_else(|e| panic!("open {i}: {e}"));
            assert!(a.close(|| {}));
            assert!(!a.is_failed());
            closed.push(a);
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfd_create is not supported by Miri")]
    fn memfd_round_trip_and_bounds() {
        let a = Arena::open(&ArenaSpec::memfd(1 << 16)).unwrap();
        let g = a.enter().unwrap();
        w(&g, 100, b"hello").unwrap();
        let mut out = [0u8; 5];
        r(&g, 100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        let e = w(&g, (1 << 16) - 2, b"abc").unwrap_err();
        assert!(matches!(e, CopyError::OutOfBounds(o) if o.mapped == 1 << 16));
        assert!(
            e.to_string().contains("outside the 65536 byte mapping"),
            "{e}"
        );
    }

    #[test]
    fn exclusive_waits_for_guards_and_blocks_new_ones() {
        let a = Arc::new(
            Arena::open(&ArenaSpec::new(ArenaSource::Anonymous, 1 << 16).max_size_bytes(1 << 17))
                .unwrap(),
        );
        let g = a.enter().unwrap();
        w(&g, 0, b"keep").unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let (a2, d2) = (a.clone(), done.clone());
        let t = std::thread::spawn(move || {
            a2.exclusive(|ex| {
                ex.remap(1 << 17).unwrap();
                d2.store(true, Ordering::SeqCst);
            })
            .unwrap();
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !done.load(Ordering::SeqCst),
            "remap ran while a guard was alive"
        );
        drop(g);
        t.join().unwrap();
        assert!(done.load(Ordering::SeqCst));
        let g = a.enter().unwrap();
        assert_eq!(g.len(), 1 << 17);
        let mut out = [0u8; 4];
        r(&g, 0, &mut out).unwrap();
        assert_eq!(&out, b"keep", "bytes survive a remap");
    }

    #[test]
    fn close_is_idempotent_and_refuses_guards() {
        let a = Arena::open(&ArenaSpec::new(ArenaSource::Anonymous, 4096)).unwrap();
        assert!(a.close(|| ()));
        assert!(!a.close(|| panic!("second close must not run f")));
        assert_eq!(a.enter().err(), Some(Closed));
        assert_eq!(a.exclusive(|_| ()).err(), Some(GateError::Closed));
    }

    /// A thread holding a guard on arena A must not enter arena B while B's
    /// exclusive section is pending. A "nested guard" exception keyed on a
    /// thread-local count of guards on *any* arena would admit it at once,
    /// and it would copy through B's old base while B is remapped (SIGSEGV
    /// under load); with such an `enter`, `entered_during_exclusive` is
    /// true and this test fails.
    #[test]
    fn a_guard_on_another_arena_does_not_admit_a_remap_in_progress() {
        let a = Arena::open(&ArenaSpec::new(ArenaSource::Anonymous, 1 << 16)).unwrap();
        let b = Arc::new(
            Arena::open(&ArenaSpec::new(ArenaSource::Anonymous, 1 << 16).max_size_bytes(1 << 17))
                .unwrap(),
        );
        let holder = b.enter().unwrap(); // keeps B's remap waiting
        let (remap, done) = pending_remap(&b, 1 << 17);
        let entered_during_exclusive = std::thread::scope(|s| {
            let t = s.spawn(|| {
                let _on_a = a.enter().unwrap();
                let g = b.enter().unwrap();
                let early = !done.load(Ordering::SeqCst);
                w(&g, 0, b"x").unwrap();
                (early, g.len())
            });
            std::thread::sleep(Duration::from_millis(50));
            drop(holder);
            t.join().unwrap()
        });
        remap.join().unwrap();
        assert_eq!(
            entered_during_exclusive,
            (false, 1 << 17),
            "entered B before its remap finished"
        );
    }

    /// A guard on the same arena comes from `reenter`, which is admitted
    /// while a remap is pending, and the remap waits for both.
    #[test]
    fn reenter_is_admitted_while_a_remap_waits() {
        let a = Arc::new(
            Arena::open(&ArenaSpec::new(ArenaSource::Anonymous, 1 << 16).max_size_bytes(1 << 17))
                .unwrap(),
        );
        let g = a.enter().unwrap();
        let remap = {
            let a = a.clone();
            std::thread::spawn(move || a.exclusive(|ex| ex.remap(1 << 17).unwrap()).unwrap())
        };
        while !a.is_exclusive_pending() {
            std::thread::yield_now();
        }
        let g2 = g.reenter();
        drop(g);
        w(&g2, 0, b"still mapped").unwrap();
        assert_eq!(a.active_guards(), 1);
        drop(g2);
        remap.join().unwrap();
        assert_eq!(a.enter().unwrap().len(), 1 << 17);
    }

    /// `mem::forget` of a guard (safe code) leaves the count raised: a
    /// remap gives up after the drain timeout with `Busy` instead of
    /// hanging, and close refuses new guards without unmapping.
    #[test]
    fn a_forgotten_guard_bounds_remap_and_close() {
        let a =
            Arena::open(&ArenaSpec::new(ArenaSource::Anonymous, 1 << 16).max_size_bytes(1 << 17))
                .unwrap();
        a.set_drain_timeout(Duration::from_millis(50));
        // Forgotten on another thread: this one holds no guard, so the
        // remap and close below wait out the drain timeout (a thread that
        // holds one itself is answered at once).
        std::thread::scope(|s| {
            s.spawn(|| std::mem::forget(a.enter().unwrap()));
        });
        match a.exclusive(|ex| ex.remap(1 << 17)) {
            Err(GateError::Busy { guards: 1, .. }) => {}
            other => panic!("expected Busy, got {other:?}"),
        }
        assert!(!a.is_exclusive_pending(), "a failed remap clears its bit");
        let g = a.enter().unwrap();
        assert_eq!(g.len(), 1 << 16, "nothing changed");
        drop(g);
        let mut ran = false;
        assert!(a.close(|| ran = true));
        assert!(!ran, "close does not tear down under a live count");
        assert_eq!(a.enter().err(), Some(Closed));
    }

    /// A nested `enter` on the same arena is admitted while that arena's
    /// remap waits for the outer guard (otherwise the two would wait for
    /// each other until the remap gave up).
    #[test]
    fn nested_enter_on_the_same_arena_is_admitted_while_a_remap_waits() {
        let a = Arc::new(
            Arena::open(&ArenaSpec::new(ArenaSource::Anonymous, 1 << 16).max_size_bytes(1 << 17))
                .unwrap(),
        );
        let outer = a.enter().unwrap();
        let remap = {
            let a = a.clone();
            std::thread::spawn(move || a.exclusive(|ex| ex.remap(1 << 17).unwrap()).unwrap())
        };
        while !a.is_exclusive_pending() {
            std::thread::yield_now();
        }
        let inner = a.enter().unwrap();
        w(&inner, 10, b"nested").unwrap();
        assert_eq!(inner.len(), 1 << 16, "still the old mapping, untouched");
        drop(inner);
        drop(outer);
        remap.join().unwrap();
        assert_eq!(a.enter().unwrap().len(), 1 << 17);
    }

    /// A guard leaked with `mem::forget` on an arena that is then dropped
    /// does not count as "held" on a new arena, even one at the same
    /// address: ids are never reused.
    #[test]
    fn a_forgotten_guard_on_a_dropped_arena_grants_nothing_elsewhere() {
        let old = Arena::open(&ArenaSpec::new(ArenaSource::Anonymous, 4096)).unwrap();
        let old_id = old.id;
        std::mem::forget(old.enter().unwrap());
        assert_eq!(held_on(old_id), 1);
        drop(old);
        let b = Arc::new(
            Arena::open(&ArenaSpec::new(ArenaSource::Anonymous, 1 << 16).max_size_bytes(1 << 17))
                .unwrap(),
        );
        assert_ne!(b.id, old_id);
        assert_eq!(held_on(b.id), 0);
        let holder = b.enter().unwrap();
        let (remap, done) = pending_remap(&b, 1 << 17);
        let early = std::thread::scope(|s| {
            let t = s.spawn(|| {
                let g = b.enter().unwrap();
                (!done.load(Ordering::SeqCst), g.len())
            });
            std::thread::sleep(Duration::from_millis(30));
            drop(holder);
            t.join().unwrap()
        });
        remap.join().unwrap();
        assert_eq!(early, (false, 1 << 17));
    }
}
