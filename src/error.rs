//! Errors, split by operation (the redb habit): small `Copy` enums on the hot
//! path, `thiserror` enums with the offending values on the cold path.
#![forbid(unsafe_code)]

use std::path::PathBuf;

/// Opening or mapping an arena (cold path).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("{what} must be > 0 (got {value})")]
    Zero { what: &'static str, value: usize },
    #[error("arena of {size_bytes} bytes does not fit one slot of {slot_bytes} bytes")]
    NoSlot {
        size_bytes: usize,
        slot_bytes: usize,
    },
    #[error("slot_bytes {slot_bytes} is too large (at most {max} bytes)")]
    SlotTooLarge { slot_bytes: usize, max: usize },
    #[error("arena of {slots} slots is too large (at most {max} slots)")]
    TooManySlots { slots: usize, max: usize },
    #[error("{path}: no such file or device")]
    Missing { path: PathBuf },
    #[error("{path}: is a directory, not a DAX device or file")]
    IsDirectory { path: PathBuf },
    #[error("{path}: unsupported file type ({kind}); expected a device-dax character device or a regular file")]
    Unsupported { path: PathBuf, kind: &'static str },
    #[error(
        "{path}: file is {file_bytes} bytes, smaller than the requested {requested_bytes} bytes"
    )]
    FileTooSmall {
        path: PathBuf,
        file_bytes: u64,
        requested_bytes: usize,
    },
    #[error("{path}: device-dax size {device_bytes} bytes is smaller than the requested {requested_bytes} bytes")]
    DeviceTooSmall {
        path: PathBuf,
        device_bytes: u64,
        requested_bytes: usize,
    },
    #[error("{path}: mapping length {len} bytes is not a multiple of the device alignment {align_bytes} bytes")]
    Misaligned {
        path: PathBuf,
        len: usize,
        align_bytes: usize,
    },
    #[error("{path}: cannot read device-dax attribute {attr} under {sysfs}: {source}")]
    Sysfs {
        path: PathBuf,
        attr: &'static str,
        sysfs: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: cannot open: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: cannot size to {len} bytes: {source}")]
    Truncate {
        what: String,
        len: usize,
        source: std::io::Error,
    },
    #[error("{what}: mmap of {len} bytes failed: {source}")]
    Map {
        what: String,
        len: usize,
        source: std::io::Error,
    },
    #[error("{what}: cannot grow to {requested_bytes} bytes; the largest this arena can map is {max_bytes} bytes")]
    BeyondCapacity {
        what: String,
        requested_bytes: usize,
        max_bytes: usize,
    },
    #[error("arena is closed")]
    Closed,
}

/// Why a single put was refused (hot path: `Copy`, no allocation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PutError {
    #[error("object of {len} bytes exceeds the slot size of {slot_bytes} bytes")]
    TooLarge { len: usize, slot_bytes: usize },
    #[error("no free slots available; eviction required")]
    Full,
    #[error("the index has no free bucket near this key's home (it is sized for the arena; this is a bug if the arena is not full)")]
    IndexFull,
    #[error("the key was deleted (forced) while its store was in flight")]
    Canceled,
    #[error("the copy into the device failed")]
    CopyFailed,
    #[error("the core is closing")]
    Closed,
}

/// Errors of core operations other than put.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("{what}: {keys} keys but {bufs} buffers")]
    LengthMismatch {
        what: &'static str,
        keys: usize,
        bufs: usize,
    },
    #[error("remap to {new_bytes} bytes would cut off live slots (new slot count {new_slots})")]
    WouldCutLiveSlots { new_bytes: usize, new_slots: usize },
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("the core is closed")]
    Closed,
    #[error("remap not done: {0}")]
    Busy(crate::arena::GateError),
}
