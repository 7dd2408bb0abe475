//! Errors, split by operation (the redb habit): small `Copy` enums on the hot
//! path, `thiserror` enums with the offending values on the cold path.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

/// Opening or mapping an arena (cold path).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// A size that must be positive was 0 (`slot_bytes`, `size_bytes`).
    #[error("{what} must be > 0 (got {value})")]
    Zero {
        /// The parameter's name.
        what: &'static str,
        /// The value given.
        value: usize,
    },
    #[error("arena of {size_bytes} bytes does not fit one slot of {slot_bytes} bytes")]
    /// The arena is smaller than one slot.
    NoSlot {
        /// Requested arena size, bytes.
        size_bytes: usize,
        /// Slot size, bytes.
        slot_bytes: usize,
    },
    #[error("slot_bytes {slot_bytes} is too large (at most {max} bytes)")]
    /// `slot_bytes` does not fit the slot metadata's 32-bit length.
    SlotTooLarge {
        /// Slot size asked for, bytes.
        slot_bytes: usize,
        /// Largest slot size, bytes (`u32::MAX`).
        max: usize,
    },
    #[error("arena of {slots} slots is too large (at most {max} slots)")]
    /// The largest size the arena can grow to holds more slots than the
    /// index can address ([`crate::device::index::SLOT_MAX`]).
    TooManySlots {
        /// Slots at the arena's largest size.
        slots: usize,
        /// Largest slot count.
        max: usize,
    },
    #[error("{path}: no such file or device")]
    /// The path does not exist.
    Missing {
        /// The path given.
        path: PathBuf,
    },
    #[error("{path}: is a directory, not a DAX device or file")]
    /// The path is a directory.
    IsDirectory {
        /// The path given.
        path: PathBuf,
    },
    #[error("{path}: unsupported file type ({kind}); expected a device-dax character device or a regular file")]
    /// The path is neither a character device nor a regular file.
    Unsupported {
        /// The path given.
        path: PathBuf,
        /// What it is instead (e.g. "block device", "fifo").
        kind: &'static str,
    },
    #[error("{}", crate::host::fstype::NotMemory { path: path.clone(), fs: fs.clone() })]
    /// A regular file on a file system that is not on the allow-list
    /// ([`crate::host::fstype`]): sysfs, procfs, debugfs and other pseudo-files
    /// are never mapped.
    FileSystem {
        /// The path given.
        path: PathBuf,
        /// The file system's name and `f_type` ([`crate::host::fstype::describe`]).
        fs: String,
    },
    #[error(
        "{path}: file is {file_bytes} bytes, smaller than the requested {requested_bytes} bytes"
    )]
    /// An existing regular file is shorter than the requested mapping.
    FileTooSmall {
        /// The file.
        path: PathBuf,
        /// Its length, bytes.
        file_bytes: u64,
        /// Mapping length asked for, bytes.
        requested_bytes: usize,
    },
    #[error("{path}: device-dax size {device_bytes} bytes is smaller than the requested {requested_bytes} bytes")]
    /// A device-dax node is smaller (sysfs `size`) than the requested
    /// mapping; mapping it would SIGBUS on first touch past the end.
    DeviceTooSmall {
        /// The device node.
        path: PathBuf,
        /// Its size from sysfs, bytes.
        device_bytes: u64,
        /// Mapping length asked for, bytes.
        requested_bytes: usize,
    },
    #[error("{path}: mapping length {len} bytes is not a multiple of the device alignment {align_bytes} bytes")]
    /// The mapping length is not a multiple of the device-dax alignment
    /// (sysfs `align`); the kernel would refuse the mmap with `EINVAL`.
    Misaligned {
        /// The device node.
        path: PathBuf,
        /// Mapping length asked for, bytes.
        len: usize,
        /// The device's alignment, bytes.
        align_bytes: usize,
    },
    #[error("{path}: cannot read device-dax attribute {attr} under {sysfs}: {source}")]
    /// A device-dax attribute could not be read from sysfs.
    Sysfs {
        /// The device node.
        path: PathBuf,
        /// The attribute (`size`).
        attr: &'static str,
        /// The sysfs root searched.
        sysfs: PathBuf,
        /// The read or parse error.
        source: std::io::Error,
    },
    #[error("{path}: cannot open: {source}")]
    /// `open` of the path failed.
    Open {
        /// The path given.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    #[error("{what}: cannot size to {len} bytes: {source}")]
    /// Sizing a created file or memfd (`ftruncate`) failed.
    Truncate {
        /// The arena's description (path, or "memfd").
        what: String,
        /// Length asked for, bytes.
        len: usize,
        /// The OS error.
        source: std::io::Error,
    },
    #[error("{what}: mmap of {len} bytes failed: {source}")]
    /// `mmap` failed.
    Map {
        /// The arena's description (path, "memfd" or "anonymous").
        what: String,
        /// Mapping length asked for, bytes.
        len: usize,
        /// The OS error.
        source: std::io::Error,
    },
    #[error("{what}: cannot grow to {requested_bytes} bytes: the device's slot tables were sized when it was added for at most {max_bytes} bytes (max_size_bytes at add; by default a memfd's size × 4, a file's or device's length then); remove it and add it again with a larger max_size_bytes")]
    /// A remap asked for more than the arena's largest size
    /// ([`crate::device::arena::ArenaSpec::max_size_bytes`], or what the device or
    /// file holds).
    BeyondCapacity {
        /// The arena's description.
        what: String,
        /// Size asked for, bytes.
        requested_bytes: usize,
        /// Largest size this arena can map, bytes.
        max_bytes: usize,
    },
    /// The arena is closed.
    #[error("arena is closed")]
    Closed,
    #[error("{}", crate::host::memlimit::OverLimit { what: what.clone(), bytes: *bytes, limit_bytes: *limit_bytes, limit: limit.clone() })]
    /// A memfd or a device's slot tables would not fit the memory the
    /// process may use (`MemAvailable`, or its cgroup's limit minus usage;
    /// [`crate::host::memlimit`]).
    MemoryLimit {
        /// What was to be allocated ("memfd", "slot tables for N slots").
        what: String,
        /// Bytes asked for.
        bytes: usize,
        /// Bytes the process may still take.
        limit_bytes: u64,
        /// Which limit that is.
        limit: String,
    },
    #[error("slot tables for {slots} slots need {bytes} bytes of DRAM and could not be allocated (a memory limit, e.g. RLIMIT_DATA); use larger slots or a smaller device")]
    /// Allocating a device's slot tables failed.
    TableAlloc {
        /// Slots the tables are sized for.
        slots: usize,
        /// Bytes they need.
        bytes: usize,
    },
    #[error("{what}: cannot grow to {requested_bytes} bytes: the file holds {file_bytes} bytes; extend it first")]
    /// A grow of a file device past the file's current length (mapping
    /// past the end would SIGBUS on first touch).
    FileShorterThanGrow {
        /// The arena's description.
        what: String,
        /// Size asked for, bytes.
        requested_bytes: usize,
        /// The file's length now, bytes.
        file_bytes: u64,
    },
    #[error("{what}: cannot watch the mapping for SIGBUS: {max} mappings are already watched")]
    /// The SIGBUS registry ([`crate::device::fault`]) has no free entry.
    Watch {
        /// The arena's description.
        what: String,
        /// Entries in the registry.
        max: usize,
    },
}

/// Why a single put was refused (hot path: `Copy`, no allocation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PutError {
    #[error("object of {len} bytes exceeds the slot size of {slot_bytes} bytes")]
    /// The object is larger than a slot (checked before presence, as
    /// upstream does).
    TooLarge {
        /// Object length, bytes.
        len: usize,
        /// Slot size, bytes.
        slot_bytes: usize,
    },
    /// Every slot is taken; the caller must delete (evict) keys first.
    #[error("no free slots available; eviction required")]
    Full,
    #[error("the index has no free bucket near this key's home (it is sized for the arena; this is a bug if the arena is not full)")]
    /// The index found no free bucket within [`crate::device::index::PROBE_MAX`]
    /// of the key's home; with the index sized at two buckets per slot this
    /// is practically unreachable unless the arena is full.
    IndexFull,
    /// A forced delete of the key canceled the store while it was in
    /// flight; the slot was freed.
    #[error("the key was deleted (forced) while its store was in flight")]
    Canceled,
    /// The payload copy failed (the writer callback returned false, or an
    /// injected fault); the slot was freed.
    #[error("the copy into the device failed")]
    CopyFailed,
    /// The device faulted (SIGBUS: truncated under its mapping, or a
    /// poisoned memory line) and is marked failed; it takes no new keys.
    #[error("the device faulted (SIGBUS) and is marked failed")]
    DeviceFailed,
    /// The core is closing or closed.
    #[error("the core is closing")]
    Closed,
    /// The key's store is in flight under a store lease not yet committed
    /// (`device::lease`): not stored by this put, and not a successful
    /// no-op either, since the lease may never commit.
    #[error("the key is leased for a store not yet committed")]
    Leased,
}

/// Errors of core operations other than put.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("{what}: {keys} keys but {bufs} buffers")]
    /// A batched call got different numbers of keys and buffers.
    LengthMismatch {
        /// The operation (`put_many`, `load_many_into`).
        what: &'static str,
        /// Keys given.
        keys: usize,
        /// Buffers given.
        bufs: usize,
    },
    #[error("remap to {new_bytes} bytes would cut off live slots (new slot count {new_slots})")]
    /// A shrink would drop slots at or above the new slot count that are
    /// live (committed, in flight or borrowed).
    WouldCutLiveSlots {
        /// Size asked for, bytes.
        new_bytes: usize,
        /// Slots at that size.
        new_slots: usize,
    },
    /// Mapping the new size failed.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// The core is closed.
    #[error("the core is closed")]
    Closed,
    /// The arena's users did not drain within its drain timeout (or a
    /// remap is already running); nothing changed.
    #[error("remap not done: {0}")]
    Busy(GateError),
}

impl From<crate::host::memlimit::OverLimit> for OpenError {
    fn from(e: crate::host::memlimit::OverLimit) -> Self {
        OpenError::MemoryLimit {
            what: e.what,
            bytes: e.bytes,
            limit_bytes: e.limit_bytes,
            limit: e.limit,
        }
    }
}

/// Why [`Arena::exclusive`](crate::device::arena::Arena::exclusive) ran nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GateError {
    /// The arena is closing or closed.
    #[error("the arena is closed")]
    Closed,
    /// Guards were still alive when the drain timeout ran out.
    #[error("{guards} users still held the mapping after {waited:?}; nothing was changed")]
    Busy {
        /// Guards alive when it gave up.
        guards: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// Leases were alive: refused at once (a lease may last as long as its
    /// holder likes, so it is never waited for; `device::gate`).
    #[error("{leases} leases still hold the mapping; nothing was changed")]
    Leased {
        /// Leases alive when it was refused.
        leases: u64,
    },
}

impl From<crate::host::fstype::NotMemory> for OpenError {
    fn from(e: crate::host::fstype::NotMemory) -> Self {
        OpenError::FileSystem {
            path: e.path,
            fs: e.fs,
        }
    }
}
