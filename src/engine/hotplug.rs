//! # Hotplug: add, drain, migrate, evict, remove and resize devices at run time
//!
//! The control plane's operations on the device pool
//! (docs/lmcache-dax-behavior.md §4.3–§4.5), typed: each returns a report
//! or a [`HotplugError`] that says what blocked it; the generic
//! reconfiguration layer ([`crate::control::reconfigure`]) turns those into LMCache's
//! status codes and payloads. Every operation runs under the pool's admin
//! mutex (one control-plane change at a time, and no remap can become
//! pending under a claim holder), while the data path keeps running: the
//! device list is read lock-free, and status answers at once, showing a
//! device as `migrating` / `removing` / `resizing` while it is.
//!
//! ## Listeners
//!
//! An evicting remove or shrink tells the listeners (`on_keys_deleted`)
//! after it has let go of the admin mutex, on the calling thread, with no
//! engine state held, as [`crate::engine::Listener`] promises: a listener
//! may call `Engine::close`, `set_device_state` or another hotplug
//! operation (each takes the admin mutex; under it they would wait for
//! themselves for ever, and every later control-plane call behind them).
//! The keys are collected while the operation runs and told once it ends,
//! whether it succeeded or stopped (the keys deleted before it stopped).
//!
//! ## Moving a key (migration, shrink)
//!
//! Under the key's claim: read the payload from the source, put it on the
//! least-used writable device (the next one if full), then delete it from
//! the source; the steps, including which copy goes when a lookup locks
//! one meanwhile and how a forced move hands the locks over, are written
//! once in `docs/key-ownership.md` ("Migration"). So at every moment
//! outside a claim each key has exactly one copy, and a migration that
//! stops halfway (no room left) leaves no duplicates: the keys moved so far
//! live on their targets, the rest on the source, whose state goes back to
//! what it was, and a retry moves the rest (better than upstream,
//! docs/lmcache-dax-behavior.md §9.4 item 2).

#![forbid(unsafe_code)]

use std::sync::{Arc, MutexGuard};

use super::pool::{next_writable, Device, DeviceSpec, DeviceState};
use super::{DeviceId, DeviceInfo, Engine, EngineError, HotplugOp, HotplugOutcome};
use crate::device::arena::{ArenaSource, ArenaSpec, DeviceIdentity};
use crate::device::core::{CoreConfig, PutOutcome};
use crate::device::error::{OpenError, PutError};
use crate::key::Key;

/// How far a memfd device (hotplugged or configured) may grow by default
/// (× its first size; `max_size_bytes` at add sets another limit): the
/// slot tables are sized for the largest size, so the headroom costs DRAM
/// (a flat 64 GiB would take 800 MiB of tables at 4 KiB slots).
pub const MEMFD_GROW_FACTOR: usize = 4;

/// The longest NAME of a `memfd:NAME` device.
pub const MEMFD_NAME_MAX: usize = 64;

/// Whether `path` names an anonymous (memfd) device rather than a file:
/// `memfd` (the first anonymous device) or `memfd:NAME` (further ones).
/// Such a name is compared as a string, never opened.
pub fn is_memfd_name(path: &str) -> bool {
    path == "memfd" || path.starts_with("memfd:")
}

/// Check an anonymous device name: `memfd`, or `memfd:NAME` with NAME of
/// 1 to [`MEMFD_NAME_MAX`] characters of `A-Z a-z 0-9 . _ -`. With
/// `allow_unnamed`, `memfd:` (NAME left to daxkv: an add) passes too.
pub fn check_memfd_name(path: &str, allow_unnamed: bool) -> Result<(), &'static str> {
    let Some(name) = path.strip_prefix("memfd:") else {
        return if path == "memfd" {
            Ok(())
        } else {
            Err("not an anonymous device name (memfd or memfd:NAME)")
        };
    };
    if name.is_empty() {
        return if allow_unnamed {
            Ok(())
        } else {
            Err("memfd:NAME needs a NAME")
        };
    }
    if name.len() > MEMFD_NAME_MAX
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err("memfd:NAME: NAME must be 1 to 64 of A-Z a-z 0-9 . _ -");
    }
    Ok(())
}

/// How `remove_device` empties a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoveMode {
    /// Stop new stores on it; its keys stay readable; it stays in the pool
    /// (`draining`).
    Drain,
    /// Move every key to other active devices, then remove it.
    Migrate,
    /// Delete its keys (listeners told), then remove it.
    Evict,
}

impl RemoveMode {
    /// LMCache's name.
    pub fn name(self) -> &'static str {
        match self {
            RemoveMode::Drain => "drain",
            RemoveMode::Migrate => "migrate",
            RemoveMode::Evict => "evict",
        }
    }
}

/// What a shrink does with keys in slots past the new end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShrinkMode {
    /// Move them to other active devices.
    Migrate,
    /// Delete them (only with `force`; never silently).
    Evict,
}

/// Why a hotplug operation did not happen (or stopped). Each maps to one
/// of LMCache's status codes ([`HotplugError::status`]).
#[derive(Debug, thiserror::Error)]
pub enum HotplugError {
    /// The engine was opened with hotplug off.
    #[error("DAX hotplug is disabled")]
    Disabled,
    /// A request value is wrong (the message says which).
    #[error("{0}")]
    Invalid(&'static str),
    /// The device failed the probe before mapping (the reason).
    #[error("{0}")]
    Probe(String),
    /// The path could not be identified (not a device or file, or not
    /// readable).
    #[error("failed to identify DAX device")]
    Unidentified,
    /// Nothing at the path, and the add did not ask to create it.
    #[error("failed to identify DAX device: {path} does not exist: create it first, e.g. `truncate -s {size} {path}`, or pass --create (`create: true` in an HTTP add)")]
    Missing {
        /// The path asked for.
        path: String,
        /// The size asked for, as `truncate -s` reads it (`256M`).
        size: String,
    },
    /// A file `--create` was to make could not be made (the reason,
    /// naming the path).
    #[error("{0}")]
    Create(String),
    /// A migrating remove of the last device new keys may go to.
    #[error("{path}: no other device can take its keys: add one first, or use --mode evict (drops the keys) or --mode drain")]
    LastDevice {
        /// The device's path (or memfd name).
        path: String,
    },
    /// Mapping failed (details in the log, never the path).
    #[error("failed to map DAX device")]
    MapFailed,
    /// The device would take more memory than the process may use (a
    /// memfd's size, or the slot tables), or its tables could not be
    /// allocated: the reason, with the sizes.
    #[error("{0}")]
    Memory(String),
    /// No live device has this path.
    #[error("DAX device not found")]
    NotFound,
    /// Several live devices share the path.
    #[error("multiple active DAX devices have the same device_path")]
    Ambiguous {
        /// `(index, id, state)` of each.
        matches: Vec<(usize, DeviceId, DeviceState)>,
    },
    /// The device is mapped already, at another size.
    #[error("device_path already active with a different size")]
    SizeConflict,
    /// The device at this path (or the same physical device) failed and
    /// is still in the pool (docs/hotplug.md, "Failed devices").
    #[error("device {index} ({path}) failed: remove it first, then add it again")]
    Failed {
        /// Its status index.
        index: usize,
        /// Its path.
        path: String,
    },
    /// An anonymous device of this name is live at another size.
    #[error("device_path already active with a different size: {name} has {existing_bytes} bytes, not {requested_bytes}; add another anonymous device as memfd:NAME")]
    AnonymousSizeConflict {
        /// `memfd` or `memfd:NAME`.
        name: String,
        /// Its mapped size.
        existing_bytes: usize,
        /// The size asked for.
        requested_bytes: usize,
    },
    /// Slot leases are open on the device: a remap (grow, shrink) cannot
    /// move a mapping callers hold pointers into, and a remove waits for
    /// them to end (or, with `force`, cancels the store leases).
    #[error("device has {leases} open slot leases: commit, abort or release them and retry{}", if *forced_ok { ", or remove with force" } else { "" })]
    Leased {
        /// Leases open when it was refused.
        leases: u64,
        /// Whether `force` would go ahead (a remove; a remap never does).
        forced_ok: bool,
    },
    /// Locked or borrowed slots block it (pass `force`).
    #[error("device has externally locked or borrowed slots")]
    Blocked {
        /// Keys holding lookup locks.
        locked: usize,
        /// Slots with reads in flight.
        borrowed: usize,
    },
    /// Keys copied elsewhere could not be deleted from the source (locked
    /// meanwhile); their copies were removed again.
    #[error("source device still has locked migrated keys")]
    SourceLocked {
        /// Keys that stayed on the source.
        locked: usize,
        /// Keys moved before it stopped.
        moved: usize,
    },
    /// Keys to move and no other active device.
    #[error("no active destination DAX capacity")]
    NoDestination,
    /// The other devices filled up; `moved` keys moved, the rest stayed.
    #[error("insufficient destination DAX capacity")]
    InsufficientCapacity {
        /// Keys moved before it stopped.
        moved: usize,
        /// Keys that had to move.
        total: usize,
    },
    /// A shrink would drop keys without `force`.
    #[error("resize shrink would drop live keys without migration")]
    ShrinkWouldDrop,
    /// Live slots stayed past the new end.
    #[error("resize shrink still has live high slots")]
    ShrinkStillLive,
    /// The remap itself failed (the reason).
    #[error("failed to remap DAX device: {0}")]
    Remap(String),
    /// Called from a mapping observer's callback, which runs under the
    /// locks this operation takes (`Engine::observe`).
    #[error("hotplug operation called from a mapping observer callback: observers must not call back into the engine")]
    Reentrant,
    /// Other engine errors (closing, …).
    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl HotplugError {
    /// LMCache's HTTP status code for it.
    pub fn status(&self) -> u16 {
        match self {
            HotplugError::Disabled => 403,
            HotplugError::NotFound => 404,
            HotplugError::Ambiguous { .. }
            | HotplugError::SizeConflict
            | HotplugError::AnonymousSizeConflict { .. }
            | HotplugError::Failed { .. }
            | HotplugError::Blocked { .. }
            | HotplugError::Leased { .. }
            | HotplugError::SourceLocked { .. }
            | HotplugError::ShrinkWouldDrop
            | HotplugError::ShrinkStillLive
            | HotplugError::LastDevice { .. } => 409,
            HotplugError::NoDestination
            | HotplugError::InsufficientCapacity { .. }
            | HotplugError::Memory(_) => 507,
            HotplugError::Engine(EngineError::Closing) => 503,
            _ => 400,
        }
    }
}

/// What `remove_device` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoveReport {
    /// The device's position in the list (tombstones keep theirs).
    pub index: usize,
    /// Its id.
    pub id: DeviceId,
    /// Its path.
    pub path: String,
    /// The mode run.
    pub mode: RemoveMode,
    /// Keys moved to other devices.
    pub moved_keys: usize,
    /// Payload bytes moved.
    pub moved_bytes: u64,
    /// Keys deleted.
    pub deleted_keys: usize,
    /// Slots freed on the device.
    pub source_slots_freed: usize,
    /// Its state now (`draining` or `removed`).
    pub state: DeviceState,
}

/// What `resize_device_to` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResizeReport {
    /// The device's position in the list.
    pub index: usize,
    /// Its id.
    pub id: DeviceId,
    /// Its path.
    pub path: String,
    /// Mapping size before.
    pub old_size_bytes: usize,
    /// Mapping size now.
    pub new_size_bytes: usize,
    /// Keys moved off the cut-off slots (shrink, migrate).
    pub moved_keys: usize,
    /// Keys deleted from the cut-off slots (shrink, evict + force).
    pub deleted_keys: usize,
    /// Its state now.
    pub state: DeviceState,
}

/// Characters a device path may not hold: controls, Unicode's format
/// characters that reorder or hide text (bidirectional embeddings,
/// overrides, isolates and marks; zero-width spaces and joiners; the BOM;
/// the soft hyphen, the Mongolian and interlinear-annotation marks, the
/// tag block), the characters that print as nothing (the combining
/// grapheme joiner, the Hangul and Khmer fillers, variation selectors) and
/// the line and paragraph separators. A path is written to the log,
/// `daxkv status` and `/metrics` labels: these would forge lines, garble a
/// terminal or make two names look alike (`/dev/shm/kv\u{AD}0` prints as
/// `/dev/shm/kv0`).
fn is_hidden_or_control(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{00AD}' | '\u{034F}' | '\u{061C}' | '\u{115F}' | '\u{1160}'
            | '\u{17B4}' | '\u{17B5}' | '\u{180B}'..='\u{180F}'
            | '\u{200B}'..='\u{200F}' | '\u{2028}'..='\u{202E}'
            | '\u{2060}'..='\u{206F}' | '\u{3164}' | '\u{FE00}'..='\u{FE0F}'
            | '\u{FEFF}' | '\u{FFA0}' | '\u{FFF0}'..='\u{FFFB}'
            | '\u{1BCA0}'..='\u{1BCA3}' | '\u{1D173}'..='\u{1D17A}'
            | '\u{E0000}'..='\u{E0FFF}')
}

/// Refuse a device path holding a character of `is_hidden_or_control`'s
/// set (the add of every face, and config files).
pub fn check_device_path(path: &str) -> Result<(), &'static str> {
    if path.chars().any(is_hidden_or_control) {
        return Err("must not contain control, invisible or bidirectional-formatting characters");
    }
    Ok(())
}

/// `bytes` as `truncate -s` reads it: `256M` for 256 MiB (its K, M, G
/// and T are binary), else the byte count.
fn truncate_size(bytes: usize) -> String {
    for (shift, unit) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// Where `add --create` may make files: directories under these (their
/// real paths), the memory file systems meant for it. A server usually
/// runs as root: creating anywhere else would let a client make files
/// such as `/etc/nologin` or `/run/nologin`.
pub const CREATE_ROOTS: [&str; 2] = ["/dev/shm", "/dev/hugepages"];

/// A file an add with `create` made: a handle on its directory, its name
/// there and its inode, so that undoing the add removes that file and no
/// other (a directory swapped for a symlink, or a file put in its place,
/// changes nothing).
#[derive(Debug)]
pub(super) struct Created {
    dir: std::fs::File,
    name: std::ffi::OsString,
    id: (u64, u64),
}

impl Created {
    /// Remove the file if its name still names it.
    fn undo(&self) {
        if crate::host::sys::identity_at(&self.dir, &self.name).ok() == Some(self.id) {
            let _ = crate::host::sys::unlink_at(&self.dir, &self.name);
        }
    }

    /// Whether the file at `path` is this one.
    fn is_at(&self, path: &std::path::Path) -> bool {
        matches!(
            DeviceIdentity::of_path(path),
            Some(DeviceIdentity::File { dev, ino }) if (dev, ino) == self.id
        )
    }
}

/// Undoes a create when dropped, unless disarmed. Declared after the
/// admin guard, it drops first: the file is removed while no other add
/// can map it.
struct Undo(Option<Created>);

impl Drop for Undo {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.undo();
        }
    }
}

/// An add with `create` of a path that already holds a file takes it only
/// if it could be this server's own (an add run again): owned by this
/// process's user, one link, writable by nobody else. A file a local user
/// put there first (`/dev/shm` is world-writable) would otherwise become a
/// cache device its owner can read and write.
fn check_not_someone_elses(
    path: &std::path::Path,
    md: &std::fs::Metadata,
) -> Result<(), HotplugError> {
    use std::os::unix::fs::MetadataExt as _;
    if md.is_file()
        && (md.uid() != crate::host::sys::euid() || md.nlink() != 1 || md.mode() & 0o022 != 0)
    {
        return Err(HotplugError::Create(format!(
            "cannot create {}: a file is already there that this server did not make (owner uid {}, mode {:o}, {} links); remove it, or add it without --create",
            path.display(),
            md.uid(),
            md.mode() & 0o7777,
            md.nlink()
        )));
    }
    Ok(())
}

/// Create `path` as a regular file of `bytes` for an add with `create`:
/// in a real directory under [`CREATE_ROOTS`], on a file system the arena
/// maps, with room for it (its blocks reserved now), never over an
/// existing file or through a symlink. Everything after the directory is
/// opened is relative to that handle.
fn create_file(path: &std::path::Path, bytes: usize) -> Result<Created, HotplugError> {
    use std::os::fd::AsRawFd as _;
    use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
    let shown = path.display();
    let fail = |why: String| HotplugError::Create(format!("cannot create {shown}: {why}"));
    // `a/` and `a/.` have a file name to `Path` (`a`) but name a
    // directory; a relative path depends on where the server runs.
    let spelled = path.as_os_str().as_encoded_bytes();
    if !path.is_absolute() || spelled.ends_with(b"/") || spelled.ends_with(b"/.") {
        return Err(fail(
            "--create needs an absolute path that ends in a file name".into(),
        ));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("/"),
    };
    let Some(name) = path.file_name() else {
        return Err(fail("it does not end in a file name".into()));
    };
    let dirf = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                fail(format!("its directory {} does not exist", dir.display()))
            } else {
                fail(format!("cannot open its directory {}: {e}", dir.display()))
            }
        })?;
    let real = std::fs::read_link(format!("/proc/self/fd/{}", dirf.as_raw_fd()))
        .map_err(|e| fail(format!("cannot resolve its directory: {e}")))?;
    let under_a_root = CREATE_ROOTS
        .iter()
        .any(|r| std::fs::canonicalize(r).is_ok_and(|r| real.starts_with(r)));
    if !under_a_root {
        return Err(fail(format!(
            "--create makes files only under {} (its directory is {}); make it yourself elsewhere, e.g. `truncate -s {} {shown}`",
            CREATE_ROOTS.join(" or "),
            real.display(),
            truncate_size(bytes)
        )));
    }
    let magic = crate::host::sys::fs_magic_fd(&dirf);
    // A tmpfs file is memory: checked as a memfd is (MemAvailable, the
    // cgroup's limit), not only against the file system's free space,
    // which may be larger than RAM.
    if magic
        .as_ref()
        .is_ok_and(|m| *m == crate::host::sys::TMPFS_MAGIC)
    {
        crate::host::memlimit::check(
            "a tmpfs file",
            bytes,
            &crate::host::memlimit::MemRoots::default(),
        )
        .map_err(|e| fail(e.to_string()))?;
    }
    match magic {
        Ok(m) if !crate::host::fstype::is_allowed(m) => {
            return Err(HotplugError::Create(format!(
                "cannot create {shown}: {}",
                crate::host::fstype::NotMemory {
                    path: path.to_path_buf(),
                    fs: crate::host::fstype::describe(m),
                }
            )));
        }
        _ => {}
    }
    // A file larger than the space left would map, and fail (SIGBUS) on
    // the first store past the space.
    if let Ok(free) = crate::host::fstype::available_bytes(&real) {
        if bytes as u64 > free {
            return Err(fail(format!(
                "{} is more than the {} free on its file system",
                crate::host::units::human(bytes as u64),
                crate::host::units::human(free)
            )));
        }
    }
    let file = crate::host::sys::create_at(&dirf, name, 0o600).map_err(|e| fail(e.to_string()))?;
    let md = file.metadata().map_err(|e| fail(e.to_string()))?;
    let created = Created {
        dir: dirf,
        name: name.to_os_string(),
        id: (md.dev(), md.ino()),
    };
    // Sized, then its blocks reserved: two creates that each fit the space
    // left cannot both succeed (a sparse file would let them).
    let sized = file
        .set_len(bytes as u64)
        .and_then(|()| crate::host::sys::allocate(&file, bytes as u64));
    if let Err(e) = sized {
        created.undo();
        return Err(fail(format!(
            "cannot reserve {} for it: {e}",
            crate::host::units::human(bytes as u64)
        )));
    }
    Ok(created)
}

/// Restores a device's state unless disarmed (an operation that fails
/// leaves the device as it found it).
struct RestoreState<'a>(&'a Device, DeviceState, bool);

impl Drop for RestoreState<'_> {
    fn drop(&mut self) {
        if self.2 && !self.0.state().is_tombstone() {
            self.0.set_state(self.1);
        }
    }
}

/// Outcome of moving one key.
enum Move {
    Moved(usize),
    /// Not on the source any more (deleted or moved by someone else).
    Gone,
    /// No target had room.
    NoRoom,
    /// The source copy could not be deleted (locked); undone.
    Locked,
}

impl HotplugError {
    /// How the metrics count it: refused requests are `rejected`; an
    /// operation that ran and could not finish (no room, a failed map or
    /// remap) is `failed`.
    fn outcome(&self) -> HotplugOutcome {
        match self {
            HotplugError::NoDestination
            | HotplugError::InsufficientCapacity { .. }
            | HotplugError::MapFailed
            | HotplugError::Memory(_)
            | HotplugError::Remap(_)
            | HotplugError::SourceLocked { .. } => HotplugOutcome::Failed,
            _ => HotplugOutcome::Rejected,
        }
    }
}

/// `Blocked` if a key of `dev` is locked or a read of it borrowed
/// (upstream checks the whole device, not only the keys it will touch).
fn unblocked(dev: &Device) -> Result<(), HotplugError> {
    let (leases, _) = dev.core().lease_ages();
    if leases > 0 {
        return Err(HotplugError::Leased {
            leases: leases as u64,
            forced_ok: true,
        });
    }
    let st = dev.core().status();
    if st.locked_key_count > 0 || st.borrowed_slot_count > 0 {
        return Err(HotplugError::Blocked {
            locked: st.locked_key_count,
            borrowed: st.borrowed_slot_count,
        });
    }
    Ok(())
}

/// Wait until every operation that entered `dev` before its state change
/// has left: a store that chose the device while it was still writable,
/// and committed after its keys were listed, would be lost with it. Puts
/// that enter later see the new state and go elsewhere
/// (`store_one` checks writability inside its session). A guard held past
/// the drain timeout (a long borrowed read) blocks, unless `force`.
///
/// Slot leases are not operations: `quiesce` answers `Leased` at once
/// while one is open. For a resize (`removing` false) that is a 409
/// (`HotplugError::Leased`) whatever `force`. For a remove it is a 409
/// without `force`; with it the operations are waited for without the
/// leases (`DaxCore::drain`). A remove then cancels the store leases open
/// now (a forced remove's walk; without `force` none is open but one
/// racing the state change, which the walk or its own state check ends:
/// `lease.rs` module doc), so no lease commits a key after the caller
/// lists the device's keys.
fn quiesce(dev: &Device, force: bool, removing: bool) -> Result<(), HotplugError> {
    use crate::device::error::{CoreError, GateError};
    let r = match dev.core().quiesce() {
        Err(CoreError::Busy(GateError::Busy { guards, .. })) if !force => {
            Err(HotplugError::Blocked {
                locked: 0,
                borrowed: guards,
            })
        }
        // A resize never cancels a lease (its remap could not go on under
        // one anyway), forced or not; a remove does only when forced.
        Err(CoreError::Busy(GateError::Leased { leases })) if !force || !removing => {
            Err(HotplugError::Leased {
                leases,
                forced_ok: removing,
            })
        }
        Err(CoreError::Busy(GateError::Leased { .. })) => {
            // Done, closed, or still busy at the deadline: go on, as a
            // forced quiesce does.
            let _ = dev.core().drain();
            Ok(())
        }
        // Done, closed, or (forced) still busy: go on.
        _ => Ok(()),
    };
    if r.is_ok() && removing {
        dev.core().cancel_store_leases();
    }
    r
}

/// [`HotplugError::Leased`] for a remap refused for its leases.
fn remap_error(dev: &Device, e: &crate::device::error::CoreError) -> HotplugError {
    use crate::device::error::{CoreError, GateError};
    if let CoreError::Busy(GateError::Leased { leases }) = e {
        return HotplugError::Leased {
            leases: *leases,
            forced_ok: false,
        };
    }
    // The reason goes to the caller, the path left out (the log has it
    // whole).
    log_line!("daxkv: resize: {e}");
    let why = e.to_string();
    HotplugError::Remap(if is_memfd_name(dev.path()) {
        why
    } else {
        why.replace(dev.path(), "the device")
    })
}

/// `Failed` if `dev` failed: an add of its path (or of the same device)
/// is not answered with a device that serves nothing.
fn not_failed(dev: &Device) -> Result<(), HotplugError> {
    if dev.state() == DeviceState::Failed {
        return Err(HotplugError::Failed {
            index: dev.index(),
            path: dev.path().to_string(),
        });
    }
    Ok(())
}

/// Take `n` lookup locks on `key` on `dev` (locks handed over from a
/// moved copy). Called under the key's claim, which every unlock takes
/// too (`Engine::submit_unlock`): no unlock sees the locks in transit,
/// off the source copy and not yet on this one.
fn lock_n(dev: &Device, key: Key, n: u32) {
    for _ in 0..n {
        dev.core().exists(key, true);
    }
}

/// Count `r` as one `op` in the metrics, and pass it on.
fn counted<T>(e: &Engine, op: HotplugOp, r: Result<T, HotplugError>) -> Result<T, HotplugError> {
    let outcome = match &r {
        Ok(_) => HotplugOutcome::Ok,
        Err(err) => err.outcome(),
    };
    e.record_hotplug(op, outcome);
    r
}

impl Engine {
    /// Whether hotplug is on.
    pub fn hotplug_enabled(&self) -> bool {
        self.inner.hotplug_enabled
    }

    /// The one live (not closed or removed) device with this exact path
    /// string; a failed device is found too (remove accepts it).
    pub fn find_device(&self, path: &str) -> Result<DeviceId, HotplugError> {
        let path = path.trim();
        if path.is_empty() {
            return Err(HotplugError::Invalid("device_path must be non-empty"));
        }
        let devs = self.inner.pool.list();
        let m: Vec<(usize, DeviceId, DeviceState)> = devs
            .iter()
            .enumerate()
            .filter(|(_, d)| {
                let s = d.state();
                !s.is_tombstone() && d.path() == path
            })
            .map(|(_, d)| (d.index(), d.id(), d.state()))
            .collect();
        match m.len() {
            0 => Err(HotplugError::NotFound),
            1 => Ok(m[0].1),
            _ => Err(HotplugError::Ambiguous { matches: m }),
        }
    }

    /// The live (not closed or removed; failed counts) device of status index
    /// `index` (`Device::index`: tombstones keep theirs). Not a position
    /// in the pool's list, which a removed device leaves: after a removal
    /// that position named the next device (`tests/hotplug.rs::
    /// a_device_index_names_the_status_index_after_a_removal`).
    pub fn find_device_at(&self, index: usize) -> Result<DeviceId, HotplugError> {
        let devs = self.inner.pool.list();
        match devs.iter().find(|d| d.index() == index) {
            Some(d) if !d.state().is_tombstone() => Ok(d.id()),
            _ => Err(HotplugError::NotFound),
        }
    }

    /// The device's list position and info.
    pub fn device_index(&self, id: DeviceId) -> Option<(usize, DeviceInfo)> {
        self.inner
            .pool
            .list()
            .iter()
            .find(|d| d.id() == id)
            .map(|d| (d.index(), d.info()))
    }

    /// Whether a device this engine has open (not a tombstone) is the same
    /// physical device or file as `path`, whatever path it was opened by
    /// (LMCache's `owns_device`, docs/lmcache-dax-behavior.md §3.2). A
    /// missing or unidentifiable path, and an anonymous memfd device, is
    /// never owned.
    pub fn owns_device(&self, path: &std::path::Path) -> bool {
        self.inner
            .pool
            .list()
            .iter()
            .any(|d| !d.state().is_tombstone() && d.core().owns_device(path))
    }

    fn device(&self, id: DeviceId) -> Result<(usize, Arc<Device>), HotplugError> {
        self.inner
            .pool
            .list()
            .iter()
            .find(|d| d.id() == id && !d.state().is_tombstone())
            .map(|d| (d.index(), d.clone()))
            .ok_or(HotplugError::NotFound)
    }

    fn hotplug_admin(&self) -> Result<MutexGuard<'_, ()>, HotplugError> {
        if !self.inner.hotplug_enabled {
            return Err(HotplugError::Disabled);
        }
        if crate::device::arena::in_observer_callback() {
            return Err(HotplugError::Reentrant);
        }
        let admin = self.inner.pool.admin();
        // ORDERING: Acquire — observes `request_close`; `close` takes
        // `admin` before it closes the devices, so an operation that passed
        // this check finishes before that; pairs with `close`.
        if self
            .inner
            .closing
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Err(EngineError::Closing.into());
        }
        Ok(admin)
    }

    /// Add the device at `path` with `size_bytes` mapped (the control
    /// plane's add, docs/lmcache-dax-behavior.md §4.3). Anonymous devices
    /// are known by name ([`is_memfd_name`]): `"memfd"` names the first,
    /// `"memfd:NAME"` further ones, and `"memfd:"` asks daxkv to name it
    /// (`memfd:N`, in the answer's `device_path`); a live device of that
    /// name at the same size is the answer, at another size
    /// [`HotplugError::AnonymousSizeConflict`]. Any other path must exist.
    /// The same physical device (by identity, whatever the path) or the
    /// same path string at the same size is answered with the existing
    /// device, untouched (idempotent); at another size,
    /// [`HotplugError::SizeConflict`].
    /// `gate` runs before anything is mapped (the device probe) and may
    /// refuse with a reason.
    pub fn hotplug_add(
        &self,
        path: &str,
        size_bytes: usize,
        gate: impl FnOnce(&std::path::Path, usize) -> Result<(), String>,
    ) -> Result<(usize, DeviceInfo), HotplugError> {
        self.hotplug_add_with_max(path, size_bytes, None, gate)
    }

    /// [`Engine::hotplug_add`] with the largest size a later resize may
    /// grow the device to (`max_size_bytes`, at least `size_bytes`; the
    /// slot tables are sized for it). Default: [`MEMFD_GROW_FACTOR`] × the
    /// size for a memfd, the file's (or device's) length now for a path.
    /// A file may be extended later and grown into, up to this limit.
    pub fn hotplug_add_with_max(
        &self,
        path: &str,
        size_bytes: usize,
        max_size_bytes: Option<usize>,
        gate: impl FnOnce(&std::path::Path, usize) -> Result<(), String>,
    ) -> Result<(usize, DeviceInfo), HotplugError> {
        self.hotplug_add_or_create(path, size_bytes, max_size_bytes, false, gate)
    }

    /// [`Engine::hotplug_add_with_max`], and with `create` a missing path
    /// is first created as a regular file of `size_bytes` (its directory on
    /// a file system the arena maps: tmpfs, hugetlbfs, ext4, xfs, …; never
    /// over an existing file). A created file that is then not added
    /// (refused by `gate`, too large for the memory limit, …) is removed
    /// again. Without `create` a missing path is
    /// [`HotplugError::Missing`], which says how to create it.
    pub fn hotplug_add_or_create(
        &self,
        path: &str,
        size_bytes: usize,
        max_size_bytes: Option<usize>,
        create: bool,
        gate: impl FnOnce(&std::path::Path, usize) -> Result<(), String>,
    ) -> Result<(usize, DeviceInfo), HotplugError> {
        let r = self.add_inner(path, size_bytes, max_size_bytes, create, gate);
        counted(self, HotplugOp::Add, r)
    }

    #[allow(clippy::too_many_lines)] // memfd names, then paths, then the map
    fn add_inner(
        &self,
        path: &str,
        size_bytes: usize,
        max_size_bytes: Option<usize>,
        create: bool,
        gate: impl FnOnce(&std::path::Path, usize) -> Result<(), String>,
    ) -> Result<(usize, DeviceInfo), HotplugError> {
        let admin = self.hotplug_admin()?;
        // After `admin`: a file made here and not added is removed while
        // `admin` is held (no other add can have mapped it meanwhile).
        let mut undo = Undo(None);
        let path = path.trim();
        if path.is_empty() {
            return Err(HotplugError::Invalid("device_path must be non-empty"));
        }
        // A name that would forge a log line, garble a terminal or reorder
        // what an operator reads (status, /metrics labels, the log).
        if check_device_path(path).is_err() {
            return Err(HotplugError::Invalid(
                "device_path must not contain control, invisible or bidirectional-formatting characters",
            ));
        }
        if size_bytes == 0 {
            return Err(HotplugError::Invalid("size_bytes must be > 0"));
        }
        if size_bytes / self.inner.slot_bytes == 0 {
            return Err(HotplugError::Invalid("size_bytes does not fit one slot"));
        }
        if max_size_bytes.is_some_and(|m| m < size_bytes) {
            return Err(HotplugError::Invalid(
                "max_size_bytes must be at least size_bytes",
            ));
        }
        let mut name = path.to_string();
        // Under `admin` from the name's check to the append: two adds of
        // one name map one device.
        let source = if is_memfd_name(path) {
            check_memfd_name(path, true).map_err(HotplugError::Invalid)?;
            if path == "memfd:" {
                // Named by daxkv: `memfd:N`, N from the number of devices
                // ever added (the id it is about to get) up to the first
                // name no device, tombstones included, has had: of these
                // len + 1 candidates at most len are taken.
                let all = self.inner.pool.entries();
                let taken = |n: usize| all.iter().any(|e| e.info().path == format!("memfd:{n}"));
                let len = all.len();
                let n = (len..=2 * len).find(|&n| !taken(n)).unwrap_or(len);
                name = format!("memfd:{n}");
            } else if let Some(d) = self
                .inner
                .pool
                .list()
                .iter()
                .find(|d| !d.state().is_tombstone() && d.path() == path)
            {
                // One live device per name, as for a path: the same size
                // is answered with it, another is a conflict.
                not_failed(d)?;
                let existing_bytes = d.core().arena_bytes();
                return if existing_bytes == size_bytes {
                    Ok((d.index(), d.info()))
                } else {
                    Err(HotplugError::AnonymousSizeConflict {
                        name: path.to_string(),
                        existing_bytes,
                        requested_bytes: size_bytes,
                    })
                };
            }
            ArenaSource::Memfd
        } else {
            let p = std::path::Path::new(path);
            match std::fs::metadata(p) {
                Ok(md) if create => check_not_someone_elses(p, &md)?,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
                    undo.0 = Some(create_file(p, size_bytes)?);
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(HotplugError::Missing {
                        path: path.to_string(),
                        size: truncate_size(size_bytes),
                    })
                }
                Err(_) => return Err(HotplugError::Unidentified),
            }
            gate(p, size_bytes).map_err(HotplugError::Probe)?;
            // The same path string (an entry whose file was replaced
            // counts too).
            let devs = self.inner.pool.list();
            if let Some(d) = devs
                .iter()
                .find(|d| !d.state().is_tombstone() && d.path() == path)
            {
                if undo.0.is_some() {
                    // The file was just made: the live device of this name
                    // maps one that is no longer here.
                    return Err(HotplugError::Create(format!(
                        "cannot add {path}: device {} maps a file that is no longer at this path; remove it first",
                        d.index()
                    )));
                }
                not_failed(d)?;
                return if d.core().arena_bytes() == size_bytes {
                    Ok((d.index(), d.info()))
                } else {
                    Err(HotplugError::SizeConflict)
                };
            }
            if undo.0.as_ref().is_some_and(|c| !c.is_at(p)) {
                return Err(HotplugError::Create(format!(
                    "cannot add {path}: the file at this path changed while it was added"
                )));
            }
            ArenaSource::Path(p.to_path_buf())
        };
        let anonymous = matches!(source, ArenaSource::Memfd);
        let mut arena = ArenaSpec::new(source, size_bytes);
        if let Some(c) = &undo.0 {
            // Map the file made here, whatever the path names by now.
            arena = arena.expect_file(c.id.0, c.id.1);
        }
        // Room to grow: the tables are sized for it (a file or device
        // defaults to its own length, which the arena reads at open).
        let default_max = anonymous.then(|| size_bytes.saturating_mul(MEMFD_GROW_FACTOR));
        if let Some(max) = max_size_bytes.or(default_max) {
            arena = arena.max_size_bytes(max);
        }
        let spec = DeviceSpec {
            path: name,
            core: CoreConfig::new(arena, self.inner.slot_bytes),
        };
        let id = match self
            .inner
            .pool
            .add_locked(&admin, &spec, &self.inner.closing, &|d| {
                self.inner.observers.attach(d);
            }) {
            Ok(id) => id,
            Err(EngineError::SizeConflict { .. }) => return Err(HotplugError::SizeConflict),
            // Sizes only, no path: the caller is told why.
            Err(EngineError::Device {
                source:
                    source @ (OpenError::MemoryLimit { .. }
                    | OpenError::TableAlloc { .. }
                    | OpenError::TooManySlots { .. }),
                ..
            }) => return Err(HotplugError::Memory(source.to_string())),
            Err(EngineError::Device { source, .. }) => {
                log_line!("daxkv: hotplug add: {source}");
                return Err(HotplugError::MapFailed);
            }
            Err(e) => return Err(e.into()),
        };
        // Added: the file stays.
        undo.0 = None;
        drop(admin);
        // The same physical device under another path is answered with
        // the existing one: not if that one failed.
        let (index, info) = self.device_index(id).ok_or(HotplugError::NotFound)?;
        if info.state == DeviceState::Failed {
            return Err(HotplugError::Failed {
                index,
                path: info.path,
            });
        }
        Ok((index, info))
    }

    /// Remove (or drain) device `id` (docs/lmcache-dax-behavior.md §4.4).
    /// Migrate and evict check first that no key is locked and no read is
    /// borrowed (unless `force`), then empty the device, close it and leave
    /// a `removed` tombstone. On an error the device keeps the state it had.
    pub fn remove_device(
        &self,
        id: DeviceId,
        mode: RemoveMode,
        force: bool,
    ) -> Result<RemoveReport, HotplugError> {
        let op = if mode == RemoveMode::Drain {
            HotplugOp::Drain
        } else {
            HotplugOp::Remove
        };
        let mut deleted = Vec::new();
        let r = self.remove_inner(id, mode, force, &mut deleted);
        // The admin mutex is released: a listener may call back into the
        // control plane (module doc, "Listeners").
        self.tell_deleted(&deleted);
        counted(self, op, r)
    }

    fn remove_inner(
        &self,
        id: DeviceId,
        mode: RemoveMode,
        force: bool,
        told: &mut Vec<Key>,
    ) -> Result<RemoveReport, HotplugError> {
        let admin = self.hotplug_admin()?;
        let (index, dev) = self.device(id)?;
        if dev.state() == DeviceState::Failed {
            return Ok(self.remove_failed(&admin, index, &dev, mode, told));
        }
        if mode == RemoveMode::Migrate
            && !self
                .inner
                .pool
                .list()
                .iter()
                .any(|d| d.id() != id && d.state().is_writable())
        {
            // Explicit modes only: evict drops the keys, drain keeps the
            // device; a migrate would remove the pool's last store target.
            return Err(HotplugError::LastDevice {
                path: dev.path().to_string(),
            });
        }
        let old = dev.state();
        let report = |moved_keys, moved_bytes, deleted_keys, freed| RemoveReport {
            index,
            id,
            path: dev.path().to_string(),
            mode,
            moved_keys,
            moved_bytes,
            deleted_keys,
            source_slots_freed: freed,
            state: dev.state(),
        };
        if mode == RemoveMode::Drain {
            dev.set_state(DeviceState::Draining);
            return Ok(report(0, 0, 0, 0));
        }
        let during = match mode {
            RemoveMode::Migrate => DeviceState::Migrating,
            _ => DeviceState::Draining,
        };
        dev.set_state(during);
        // ORDERING: SeqCst fence — the Dekker pair with `lease_one`
        // (`lease.rs` module doc): the state before the lease table is
        // read (`unblocked`, `quiesce`'s walk).
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let mut restore = RestoreState(&dev, old, true);
        if !force {
            unblocked(&dev)?;
        }
        quiesce(&dev, force, true)?;
        let keys = dev.core().snapshot_keys();
        let (mut moved, mut bytes, mut deleted) = (0, 0u64, 0);
        match mode {
            RemoveMode::Migrate => {
                let (m, b) = self.move_keys(&dev, &keys, force)?;
                moved = m;
                bytes = b;
            }
            RemoveMode::Evict => {
                deleted = Self::evict_keys(&dev, &keys, force, told)?;
            }
            RemoveMode::Drain => unreachable!(),
        }
        // The device failed under the remove (a SIGBUS in one of its
        // copies): the keys it could no longer read were left on it, and
        // once it is retired no report finds it. Report them now, before
        // it closes (docs/hotplug.md, "Failed devices").
        if dev.state() == DeviceState::Failed {
            if let Some(keys) = dev.report_failure_once(true, || self.inner.evict_failed(&dev)) {
                deleted += keys.len();
                told.extend(keys);
            }
        }
        restore.2 = false;
        dev.set_state(DeviceState::Removing);
        dev.core().close();
        // A tombstone: out of the list; the core (mapping, fd, tables)
        // goes with the last holder of an older list.
        self.inner
            .pool
            .retire(&admin, |d| d.id() == id, DeviceState::Removed);
        Ok(report(moved, bytes, deleted, moved + deleted))
    }

    /// Remove failed device `dev` (docs/hotplug.md, "Failed devices"):
    /// migrate and evict both evict (its keys cannot be read; those not yet
    /// reported go to `told`), with nothing to block them (a lock or a
    /// borrow on a device that serves nothing holds nothing), and leave a
    /// `removed` tombstone. Drain changes nothing: a failed device already
    /// takes no stores.
    fn remove_failed(
        &self,
        admin: &MutexGuard<'_, ()>,
        index: usize,
        dev: &Arc<Device>,
        mode: RemoveMode,
        told: &mut Vec<Key>,
    ) -> RemoveReport {
        let report = |mode, deleted_keys, state| RemoveReport {
            index,
            id: dev.id(),
            path: dev.path().to_string(),
            mode,
            moved_keys: 0,
            moved_bytes: 0,
            deleted_keys,
            source_slots_freed: deleted_keys,
            state,
        };
        if mode == RemoveMode::Drain {
            return report(mode, 0, DeviceState::Failed);
        }
        // `evict_failed` first waits (up to the drain timeout) for the
        // operations still inside the device, so a store that commits on
        // it late is listed and reported, not closed with it unreported.
        if let Some(keys) = dev.report_failure_once(true, || self.inner.evict_failed(dev)) {
            told.extend(keys);
        }
        let deleted = told.len();
        // Copies still running on it end with the device's failure (their
        // operations fail): wait for them up to the drain timeout.
        let _ = quiesce(dev, true, true);
        dev.set_state(DeviceState::Removing);
        dev.core().close();
        self.inner
            .pool
            .retire(admin, |d| d.id() == dev.id(), DeviceState::Removed);
        report(RemoveMode::Evict, deleted, DeviceState::Removed)
    }

    /// Resize device `id` to `size_bytes` (docs/lmcache-dax-behavior.md
    /// §4.5): a grow remaps in place (no data moves); a shrink first moves
    /// (or, with `force` and `Evict`, deletes) the keys in slots past the
    /// new end, and never drops data silently. `gate` checks the new size
    /// against the device before a grow (the probe: devdax size and
    /// alignment, so a grow never maps past the device's end).
    pub fn resize_device_to(
        &self,
        id: DeviceId,
        size_bytes: usize,
        mode: ShrinkMode,
        force: bool,
        gate: impl FnOnce(&std::path::Path, usize) -> Result<(), String>,
    ) -> Result<ResizeReport, HotplugError> {
        let mut deleted = Vec::new();
        let r = self.resize_inner(id, size_bytes, mode, force, gate, &mut deleted);
        // The admin mutex is released (as in `remove_device`).
        self.tell_deleted(&deleted);
        counted(self, HotplugOp::Resize, r)
    }

    fn resize_inner(
        &self,
        id: DeviceId,
        size_bytes: usize,
        mode: ShrinkMode,
        force: bool,
        gate: impl FnOnce(&std::path::Path, usize) -> Result<(), String>,
        told: &mut Vec<Key>,
    ) -> Result<ResizeReport, HotplugError> {
        let _admin = self.hotplug_admin()?;
        let slot = self.inner.slot_bytes;
        if size_bytes == 0 {
            return Err(HotplugError::Invalid("size_bytes must be > 0"));
        }
        let new_slots = size_bytes / slot;
        if new_slots == 0 {
            return Err(HotplugError::Invalid("size_bytes does not fit one slot"));
        }
        let (index, dev) = self.device(id)?;
        let old_size = dev.core().arena_bytes();
        let old = dev.state();
        let report = |moved, deleted, dev: &Device| ResizeReport {
            index,
            id,
            path: dev.path().to_string(),
            old_size_bytes: old_size,
            new_size_bytes: dev.core().arena_bytes(),
            moved_keys: moved,
            deleted_keys: deleted,
            state: dev.state(),
        };
        if size_bytes == old_size {
            return Ok(report(0, 0, &dev));
        }
        if size_bytes > old_size && !is_memfd_name(dev.path()) {
            gate(std::path::Path::new(dev.path()), size_bytes).map_err(HotplugError::Probe)?;
        }
        dev.set_state(DeviceState::Resizing);
        // ORDERING: SeqCst fence — the Dekker pair with `lease_one`, as in
        // `remove_inner`: a lease taken from here on sees the device not
        // writable and gives its slot back, or the check below sees it.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let mut restore = RestoreState(&dev, old, true);
        // A remap cannot move a mapping leases point into, forced or not:
        // refused before anything is moved or evicted (the remap checks
        // again, for a lease taken meanwhile).
        let (leases, _) = dev.core().lease_ages();
        if leases > 0 {
            return Err(HotplugError::Leased {
                leases: leases as u64,
                forced_ok: false,
            });
        }
        let (mut moved, mut deleted) = (0, 0);
        if new_slots < dev.core().max_slots() {
            if !force {
                unblocked(&dev)?;
            }
            quiesce(&dev, force, false)?;
            // A put that began before the state change may still land in a
            // high slot: look again a few times.
            for _ in 0..4 {
                if dev.core().can_shrink_to(new_slots) {
                    break;
                }
                let high = dev.core().snapshot_keys_from(new_slots);
                match mode {
                    ShrinkMode::Migrate => moved += self.move_keys(&dev, &high, force)?.0,
                    ShrinkMode::Evict if force => {
                        deleted += Self::evict_keys(&dev, &high, true, told)?;
                    }
                    ShrinkMode::Evict => {
                        if !high.is_empty() {
                            return Err(HotplugError::ShrinkWouldDrop);
                        }
                    }
                }
                if high.is_empty() {
                    // Live slots that are not readable (in flight, or
                    // pending free under a borrowed read): wait a little.
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
            if !dev.core().can_shrink_to(new_slots) {
                return Err(HotplugError::ShrinkStillLive);
            }
        }
        // No lease can be open here but for an instant: one taken before
        // the state change was refused above (409, nothing moved), and one
        // taken since gives itself back on seeing `Resizing` (store leases
        // in `lease_one`, read leases in `lease_load_into`). The remap may
        // still meet such an instant (or a lease being refused, counted
        // for an instant too): after the keys have moved, a 409 would
        // leave them moved and the device unresized (the second review's
        // `a_shrink_answering_leased_has_moved_nothing`), so it tries again,
        // for at most a second.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        loop {
            match dev.core().remap(size_bytes) {
                Ok(()) => break,
                Err(crate::device::error::CoreError::Busy(
                    crate::device::error::GateError::Leased { .. },
                )) if std::time::Instant::now() < deadline => std::thread::yield_now(),
                Err(e) => return Err(remap_error(&dev, &e)),
            }
        }
        restore.2 = false;
        dev.set_state(old);
        Ok(report(moved, deleted, &dev))
    }

    /// Move `keys` off `src` (module doc, "Moving a key"). Returns keys and
    /// payload bytes moved; stops at the first key no target has room for.
    fn move_keys(
        &self,
        src: &Arc<Device>,
        keys: &[Key],
        force: bool,
    ) -> Result<(usize, u64), HotplugError> {
        let pool = &self.inner.pool;
        let has_target = pool
            .list()
            .iter()
            .any(|d| d.id() != src.id() && d.state().is_writable());
        if !keys.is_empty() && !has_target {
            return Err(HotplugError::NoDestination);
        }
        let mut buf = vec![0u8; self.inner.slot_bytes];
        let (mut moved, mut bytes, mut locked) = (0, 0u64, 0);
        for &k in keys {
            match self.move_key(src, k, &mut buf, force) {
                Move::Moved(n) => {
                    moved += 1;
                    bytes += n as u64;
                }
                Move::Gone => {}
                Move::Locked => locked += 1,
                Move::NoRoom => {
                    return Err(HotplugError::InsufficientCapacity {
                        moved,
                        total: keys.len(),
                    })
                }
            }
        }
        if locked > 0 {
            return Err(HotplugError::SourceLocked { locked, moved });
        }
        Ok((moved, bytes))
    }

    fn move_key(&self, src: &Arc<Device>, key: Key, buf: &mut [u8], force: bool) -> Move {
        let pool = &self.inner.pool;
        let _claim = pool.claims.claim(key);
        let Some((_, meta)) = src.core().payload_len(key) else {
            return Move::Gone;
        };
        // A locked key stays where its lock is (a lookup holds it), unless
        // `force`; with `force` its locks move with it (below).
        let locks = src.core().lock_count(key);
        if locks > 0 && !force {
            return Move::Locked;
        }
        let Some(n) = src.core().load_into(key, buf) else {
            return Move::Gone;
        };
        let devs = pool.list();
        let mut last = None;
        for _ in 0..devs.len() {
            let Some((usage, i)) = next_writable(&devs, last, Some(src.id())) else {
                return Move::NoRoom;
            };
            last = Some((usage, i));
            let target = &devs[i];
            // Writable is checked again inside the target's session (as
            // `store_one` does): a target that fails (or is set failed)
            // since `next_writable` is quiesced before its keys are listed
            // for the failure's report, so a put under a session entered
            // later must see the failure, or the key would be moved onto a
            // device that serves nothing, after its keys were listed, and
            // never be reported.
            let put = target.core().session().and_then(|s| {
                target
                    .state()
                    .is_writable()
                    .then(|| s.put(key, &buf[..n], meta))
            });
            let Some(put) = put else {
                continue;
            };
            match put {
                Ok(PutOutcome::Stored | PutOutcome::AlreadyPresent) => {
                    // Deletes take the claim too, so the source copy is
                    // still there. Forced: its locks, counted atomically
                    // with its removal, move to the new copy
                    // (docs/key-ownership.md, Migration).
                    if force {
                        let locks = src.core().delete_taking_locks(key).unwrap_or(0);
                        lock_n(target, key, locks);
                        return Move::Moved(n);
                    }
                    if src.core().delete(key, false) {
                        return Move::Moved(n);
                    }
                    // A lookup locked the source copy since the check: the
                    // new copy goes again, unless a reader locked it too
                    // meanwhile; then the source's locks move onto it and
                    // the source copy goes (one copy, no lock lost, and an
                    // unlock releases a lock its reader took).
                    if target.core().delete(key, false) {
                        return Move::Locked;
                    }
                    let locks = src.core().delete_taking_locks(key).unwrap_or(0);
                    lock_n(target, key, locks);
                    return Move::Moved(n);
                }
                Err(
                    PutError::Full
                    | PutError::IndexFull
                    | PutError::Closed
                    | PutError::DeviceFailed,
                ) => {}
                Err(e) => {
                    log_line!("daxkv: migrating a key: {e}");
                    return Move::NoRoom;
                }
            }
        }
        Move::NoRoom
    }

    /// Delete `keys` from `dev` (forced or not) and add the ones deleted
    /// to `told`, for the listeners once the admin mutex is released, even
    /// when some were blocked (better than upstream,
    /// docs/lmcache-dax-behavior.md §9.4 item 4).
    fn evict_keys(
        dev: &Device,
        keys: &[Key],
        force: bool,
        told: &mut Vec<Key>,
    ) -> Result<usize, HotplugError> {
        let ok = dev.core().delete_many(keys, force);
        let before = told.len();
        told.extend(keys.iter().zip(&ok).filter(|(_, &d)| d).map(|(k, _)| *k));
        let n = told.len() - before;
        // A key another thread deleted meanwhile is gone, not blocked (a
        // forced evict must not be refused for it).
        let blocked = keys
            .iter()
            .zip(&ok)
            .filter(|(k, &d)| !d && dev.core().contains_live(**k))
            .count();
        if blocked > 0 {
            return Err(HotplugError::Blocked {
                locked: blocked,
                borrowed: 0,
            });
        }
        Ok(n)
    }

    /// Tell the listeners about keys a remove or shrink deleted. Called
    /// with no engine lock held (never under the admin mutex): a listener
    /// may call `close`, `set_device_state` or another hotplug operation.
    /// Told later than the deletes happened, never earlier, so every order
    /// a listener could rely on before (a key's "stored" before its
    /// "deleted") still holds.
    fn tell_deleted(&self, keys: &[Key]) {
        if !keys.is_empty() {
            self.inner
                .tell_listeners("on_keys_deleted", |l| l.on_keys_deleted(keys));
        }
    }
}
