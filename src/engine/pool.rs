//! # The device pool: devices, their states, and where a key goes
//!
//! The pool is the list of mapped devices behind the engine. The data path
//! reads it lock-free (an [`ArcSwap`] snapshot per task part); the control
//! plane changes it under one admin mutex, and nothing outside this module
//! mutates a device. Its public face is small and typed: add a device
//! ([`Engine::add_device`]), change a device's state
//! ([`Engine::set_device_state`]), list the devices with their usage
//! ([`Engine::devices`]). The hotplug control plane wraps these.
//!
//! Placement ([`store_one`]) follows the key-ownership protocol of the
//! parent module: a key is decided under its claim, stays where it is if a
//! readable device holds it, and otherwise goes to the writable device with
//! the lowest slot usage.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use arc_swap::{ArcSwap, Cache, Guard};

use super::claims::ClaimTable;
use super::{Engine, EngineError};
use crate::device::arena::{ArenaSource, DeviceIdentity, TryEnterError};
use crate::device::core::{CoreConfig, DaxCore, Presence, Session};
use crate::device::error::PutError;
use crate::key::Key;

/// A device id: from 0, never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId(pub u32);

/// A device's state in the pool (the hotplug state machine: LMCache's
/// device states, docs/lmcache-dax-behavior.md §3.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum DeviceState {
    /// Serves lookups and loads, takes new keys.
    Active = 0,
    /// Serves reads; takes no new keys (being emptied by eviction).
    Draining = 1,
    /// Serves reads; takes no new keys (its keys are moving elsewhere).
    Migrating = 2,
    /// Serves reads; takes no new keys while its mapping changes size.
    Resizing = 3,
    /// Being removed: serves nothing, its slots still count in capacity.
    Removing = 4,
    /// Closed by the engine's close: a tombstone.
    Closed = 5,
    /// Failed (a SIGBUS in one of its copies, or set by the control
    /// plane): serves nothing, never again; its keys are reported deleted;
    /// the pool serves on with the others, degraded (docs/hotplug.md,
    /// "Failed devices"). Remove is the only way out.
    Failed = 6,
    /// Removed: a tombstone kept so ids are never reused.
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

    /// Lower-case name, as in `status()`.
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

    /// A tombstone: closed or removed, never serves again.
    pub fn is_tombstone(self) -> bool {
        matches!(self, DeviceState::Closed | DeviceState::Removed)
    }
}

/// One device of the pool. Read-only outside the pool.
#[derive(Debug)]
pub(crate) struct Device {
    id: DeviceId,
    path: String,
    state: AtomicU8,
    core: DaxCore,
    /// Its keys were reported deleted after it failed (once). A mutex, not
    /// a flag: a remove of the failed device waits for a report in
    /// progress, or it would close the device under the reporter, whose
    /// remaining keys would then never be reported.
    failure_reported: Mutex<bool>,
}

impl Device {
    /// Its id.
    pub(crate) fn id(&self) -> DeviceId {
        self.id
    }

    /// The path it was opened from (`"memfd"` for an anonymous one).
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// Its position in the full device list (status's `index`): ids are
    /// given in order, never reused, and tombstones keep their place, so
    /// the position is the id.
    pub(crate) fn index(&self) -> usize {
        self.id.0 as usize
    }

    /// Its state now: `Failed` once a SIGBUS in one of its copies failed
    /// its mapping (`crate::device::fault`), whatever the control plane set, unless
    /// it is a tombstone.
    pub(crate) fn state(&self) -> DeviceState {
        // ORDERING: Acquire — pairs with `set_state`.
        let s = DeviceState::from_u8(self.state.load(Ordering::Acquire));
        if !s.is_tombstone() && self.core.is_failed() {
            DeviceState::Failed
        } else {
            s
        }
    }

    /// Run `evict` once for this failed device, for the one caller that
    /// is to report its keys deleted; `None` for every other caller. With
    /// `wait`, a report in progress on another thread is waited for (a
    /// remove: it must not close the device under the reporter); without,
    /// it is left to that thread. Never hold an engine lock a listener
    /// could need across the call's result: the caller tells the
    /// listeners after it returns.
    pub(super) fn report_failure_once(
        &self,
        wait: bool,
        evict: impl FnOnce() -> Vec<Key>,
    ) -> Option<Vec<Key>> {
        let mut done = if wait {
            self.failure_reported
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        } else {
            match self.failure_reported.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return None,
            }
        };
        if *done {
            return None;
        }
        *done = true;
        Some(evict())
    }

    /// Change its state (the pool's control plane only).
    pub(super) fn set_state(&self, s: DeviceState) {
        // ORDERING: Release — a state change is seen with what preceded it.
        self.state.store(s as u8, Ordering::Release);
    }

    /// Its core (for the engine's workers and the bench's raw limit).
    pub(crate) fn core(&self) -> &DaxCore {
        &self.core
    }

    /// Slot usage in [0, 1] (1 for a device of no slots).
    pub(super) fn usage(&self) -> f64 {
        let max = self.core.max_slots();
        if max == 0 {
            1.0
        } else {
            self.core.live_slot_count() as f64 / max as f64
        }
    }

    /// A snapshot of its id, state and usage.
    pub(crate) fn info(&self) -> DeviceInfo {
        let (leases, oldest_lease_age) = self.core.lease_ages();
        DeviceInfo {
            id: self.id,
            path: self.path.clone(),
            state: self.state(),
            arena_bytes: self.core.arena_bytes(),
            slot_bytes: self.core.slot_bytes(),
            max_slots: self.core.max_slots(),
            live_slots: self.core.live_slot_count(),
            leases,
            oldest_lease_age,
        }
    }
}

impl AsRef<DaxCore> for Device {
    fn as_ref(&self) -> &DaxCore {
        &self.core
    }
}

/// A device as listed by [`Engine::devices`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Its id.
    pub id: DeviceId,
    /// The path it was opened from.
    pub path: String,
    /// Its state.
    pub state: DeviceState,
    /// Bytes mapped now.
    pub arena_bytes: usize,
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// Slots it can hold at its current size.
    pub max_slots: usize,
    /// Slots holding a key, in flight or pending free.
    pub live_slots: usize,
    /// Slot leases open on it (docs/leases.md).
    pub leases: usize,
    /// The oldest open lease's age (a leaked lease is an age that only
    /// grows).
    pub oldest_lease_age: Option<std::time::Duration>,
}

/// A device's mapping, for raw-copy baselines (the benchmarks compare the
/// engine with plain copies into the very same mapping) and diagnostics.
/// Read-only with respect to the pool: it cannot change the device's
/// state; writing through its guard is `unsafe` and bypasses the store.
/// Only with the `test-hooks` feature.
#[cfg(feature = "test-hooks")]
#[derive(Debug, Clone)]
pub struct RawDevice(Arc<Device>);

#[cfg(feature = "test-hooks")]
impl RawDevice {
    /// A guard over the whole mapping that bypasses the slot states
    /// (`None` once the device is closed). See
    /// [`DaxCore::raw_guard`](crate::device::core::DaxCore::raw_guard).
    pub fn raw_guard(&self) -> Option<crate::device::arena::ArenaGuard<'_>> {
        self.0.core.raw_guard()
    }

    /// Its id.
    pub fn id(&self) -> DeviceId {
        self.0.id
    }
}

/// How a device is opened.
#[derive(Clone, Debug)]
pub struct DeviceSpec {
    /// Shown in status; for a file or device, its path.
    pub path: String,
    /// The arena and slot layout (the engine's `slot_bytes` wins).
    pub core: CoreConfig,
}

/// What is left of a closed or removed device: enough for status. The
/// device itself (its core: mapping, fd, slot tables) leaves the pool's
/// list when it becomes a tombstone and is freed when the last task part,
/// session or [`RawDevice`] that still holds it lets go (at once if none
/// does): nothing of it stays behind, and the data path never walks it.
#[derive(Clone, Debug)]
pub(super) struct Tombstone {
    id: DeviceId,
    path: Box<str>,
    state: DeviceState,
}

impl Tombstone {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            id: self.id,
            path: self.path.to_string(),
            state: self.state,
            arena_bytes: 0,
            slot_bytes: 0,
            max_slots: 0,
            live_slots: 0,
            leases: 0,
            oldest_lease_age: None,
        }
    }
}

/// One entry of the full device list: a device, or a tombstone.
pub(super) enum Entry {
    /// A device in the pool (any state but closed / removed).
    Live(Arc<Device>),
    /// A closed or removed device.
    Gone(Tombstone),
}

impl Entry {
    /// Its id (and position).
    pub(super) fn id(&self) -> DeviceId {
        match self {
            Entry::Live(d) => d.id,
            Entry::Gone(t) => t.id,
        }
    }

    /// Its id, path, state and usage.
    pub(super) fn info(&self) -> DeviceInfo {
        match self {
            Entry::Live(d) => d.info(),
            Entry::Gone(t) => t.info(),
        }
    }
}

/// [`DevicePool::list_cache`]'s cache of the device list.
pub(super) type DeviceListCache<'a> = Cache<&'a ArcSwap<Vec<Arc<Device>>>, Arc<Vec<Arc<Device>>>>;

/// The device list and the state the control plane changes under one
/// mutex.
pub(super) struct DevicePool {
    /// The devices that are not tombstones: read lock-free by the data
    /// path; replaced only under `admin`. A device leaves it when closed
    /// or removed ([`DevicePool::retire`]), so per-operation work (unlock,
    /// delete, placement) does not grow with the number of devices ever
    /// removed.
    devices: ArcSwap<Vec<Arc<Device>>>,
    /// Closed and removed devices, for status (ids stay taken). Changed
    /// only under `admin`.
    tombstones: Mutex<Vec<Tombstone>>,
    /// Serializes the control plane's changes (add, state changes, close):
    /// an identity check and the append are one step.
    admin: Mutex<()>,
    /// Next device id; advanced only under `admin`.
    next_id: AtomicU32,
    slot_bytes: usize,
    /// Key ownership: a store holds its key's stripe while it decides
    /// which device gets the key (parent module doc, "Key ownership").
    pub(super) claims: ClaimTable,
}

impl DevicePool {
    /// Map `specs` (ids from 0). Any failure releases what was opened.
    pub(super) fn open(specs: Vec<DeviceSpec>, slot_bytes: usize) -> Result<Self, EngineError> {
        let mut devs: Vec<Arc<Device>> = Vec::new();
        for (i, spec) in specs.into_iter().enumerate() {
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
                failure_reported: Mutex::new(false),
            }));
        }
        let n = devs.len() as u32;
        Ok(DevicePool {
            devices: ArcSwap::from_pointee(devs),
            tombstones: Mutex::new(Vec::new()),
            admin: Mutex::new(()),
            next_id: AtomicU32::new(n),
            slot_bytes,
            claims: ClaimTable::default(),
        })
    }

    /// The device list through a cache, for a loop over many keys: each
    /// `load` re-reads only the list's pointer and reloads when it changed
    /// (one full load per loop instead of one per key). A `load` under a
    /// key's claim still returns every list an earlier holder of that
    /// claim saw: that holder's load read the new pointer before its
    /// claim's Release, our claim's Acquire orders that before our re-read,
    /// and a read ordered after a store sees it or a later one.
    pub(super) fn list_cache(&self) -> DeviceListCache<'_> {
        Cache::new(&self.devices)
    }

    /// The devices now, tombstones left out (lock-free; cheap).
    pub(super) fn list(&self) -> Guard<Arc<Vec<Arc<Device>>>> {
        self.devices.load()
    }

    /// Every device ever added, tombstones included, in id order (status;
    /// allocates).
    ///
    /// The list is read under the tombstones' mutex, which
    /// [`DevicePool::retire`] holds from adding a tombstone to storing the
    /// list without its device: a device is listed once, live or gone. Read
    /// apart, a listing between the two saw it twice, and `status()` (which
    /// numbers devices by position) gave every later device the next one's
    /// index (`tests/hotplug_concurrent.rs::
    /// a_listing_during_a_remove_shows_each_device_once`).
    pub(super) fn entries(&self) -> Vec<Entry> {
        let graves = self
            .tombstones
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut v: Vec<Entry> = self.list().iter().cloned().map(Entry::Live).collect();
        v.extend(graves.iter().cloned().map(Entry::Gone));
        drop(graves);
        v.sort_by_key(Entry::id);
        v
    }

    /// Turn the devices `which` picks into tombstones of state `to`
    /// (closed or removed): set the state (holders of an older list see
    /// it and skip them), then drop them from the list. Each is freed when
    /// the last holder of an older list lets go. Called under `admin`.
    pub(super) fn retire(
        &self,
        _admin: &MutexGuard<'_, ()>,
        which: impl Fn(&Device) -> bool,
        to: DeviceState,
    ) {
        debug_assert!(to.is_tombstone());
        let cur = self.list();
        let mut graves = self
            .tombstones
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut keep = Vec::with_capacity(cur.len());
        for d in cur.iter() {
            if which(d) {
                d.set_state(to);
                graves.push(Tombstone {
                    id: d.id,
                    path: d.path.as_str().into(),
                    state: to,
                });
            } else {
                keep.push(d.clone());
            }
        }
        // Stored before the tombstones' mutex is let go: a listing
        // (`entries`) sees the device in one of the two, never both.
        self.devices.store(Arc::new(keep));
        drop(graves);
    }

    /// The state of tombstone `id`, if it is one.
    fn tombstone_state(&self, id: DeviceId) -> Option<DeviceState> {
        self.tombstones
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .find(|t| t.id == id)
            .map(|t| t.state)
    }

    /// The device list now, as an owned snapshot.
    pub(super) fn snapshot(&self) -> Arc<Vec<Arc<Device>>> {
        self.devices.load_full()
    }

    /// The control plane's mutex (held for a whole hotplug operation).
    pub(super) fn admin(&self) -> MutexGuard<'_, ()> {
        self.admin.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Append a device unless the pool maps it already (see
    /// [`Engine::add_device`]). Refused once `closing` is set.
    pub(super) fn add(
        &self,
        spec: &DeviceSpec,
        closing: &AtomicBool,
        attach: &dyn Fn(&Arc<Device>),
    ) -> Result<DeviceId, EngineError> {
        let admin = self.admin();
        self.add_locked(&admin, spec, closing, attach)
    }

    /// [`DevicePool::add`] with `admin` already held. `attach` gives the new
    /// device the engine's mapping observers (`observe.rs`) before it is
    /// published.
    pub(super) fn add_locked(
        &self,
        _admin: &MutexGuard<'_, ()>,
        spec: &DeviceSpec,
        closing: &AtomicBool,
        attach: &dyn Fn(&Arc<Device>),
    ) -> Result<DeviceId, EngineError> {
        // ORDERING: Acquire — observes `request_close`; `close` takes
        // `admin` before it closes the devices, so an add that passed this
        // check has appended before that; pairs with `close`.
        if closing.load(Ordering::Acquire) {
            return Err(EngineError::Closing);
        }
        let requested = spec.core.arena.size_bytes;
        // A path we can stat is checked before it is mapped a second time.
        let by_path = match &spec.core.arena.source {
            ArenaSource::Path(p) | ArenaSource::CreateFile(p) => DeviceIdentity::of_path(p),
            _ => None,
        };
        if let Some(found) = self.mapped_as(by_path, &spec.path, requested) {
            return found;
        }
        let mut cfg = spec.core.clone();
        cfg.slot_bytes = self.slot_bytes;
        let core = DaxCore::open(&cfg).map_err(|source| EngineError::Device {
            // ORDERING: Relaxed — under `admin`, as below.
            index: self.next_id.load(Ordering::Relaxed) as usize,
            source,
        })?;
        // The identity of what was opened (a path that appeared meanwhile,
        // or one reached through another name).
        if let Some(found) = self.mapped_as(core.identity(), &spec.path, core.arena_bytes()) {
            return found;
        }
        // ORDERING: Relaxed — advanced only under `admin`, which orders it.
        let id = DeviceId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let dev = Arc::new(Device {
            id,
            path: spec.path.clone(),
            state: AtomicU8::new(DeviceState::Active as u8),
            core,
            failure_reported: Mutex::new(false),
        });
        // Its observers first: no lease (nor any other use) reaches it
        // before they have returned (`observe.rs`, "New devices").
        attach(&dev);
        let mut v = Vec::clone(&self.list());
        v.push(dev);
        // Under `admin`: nobody else replaces the list meanwhile.
        self.devices.store(Arc::new(v));
        Ok(id)
    }

    /// The answer for a device of identity `id` the pool already maps (and
    /// serves: tombstones don't count): its id at the same size, a conflict
    /// at another. `None` if not mapped. Called under `admin`.
    fn mapped_as(
        &self,
        id: Option<DeviceIdentity>,
        path: &str,
        requested_bytes: usize,
    ) -> Option<Result<DeviceId, EngineError>> {
        let id = id?;
        let devs = self.list();
        let d = devs
            .iter()
            .find(|d| !d.state().is_tombstone() && d.core.identity() == Some(id))?;
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

    /// Device `id` (if `keep` accepts it), unless the engine is closing.
    /// Called under `admin`.
    fn find_open(
        &self,
        id: DeviceId,
        closing: &AtomicBool,
        keep: impl Fn(&Device) -> bool,
    ) -> Result<Arc<Device>, EngineError> {
        // ORDERING: Acquire — as in `add`.
        if closing.load(Ordering::Acquire) {
            return Err(EngineError::Closing);
        }
        self.list()
            .iter()
            .find(|d| d.id == id && keep(d))
            .cloned()
            .ok_or(EngineError::NoSuchDevice { id: id.0 })
    }

    /// Move device `id` to `to`; returns its previous state. A tombstone
    /// (closed, removed) never changes again, and no device becomes
    /// `Closed` this way (that is `close`'s). A device set `Removed` leaves
    /// the list ([`DevicePool::retire`]).
    pub(super) fn set_state(
        &self,
        id: DeviceId,
        to: DeviceState,
        closing: &AtomicBool,
    ) -> Result<DeviceState, EngineError> {
        let admin = self.admin();
        let d = match self.find_open(id, closing, |_| true) {
            Ok(d) => d,
            Err(EngineError::NoSuchDevice { .. }) if self.tombstone_state(id).is_some() => {
                let from = self.tombstone_state(id).unwrap_or(DeviceState::Removed);
                return Err(EngineError::StateChange {
                    id: id.0,
                    from: from.name(),
                    to: to.name(),
                });
            }
            Err(e) => return Err(e),
        };
        let from = d.state();
        // A failed device never serves again: remove is its only way out
        // (its keys were reported deleted).
        let failed_out =
            from == DeviceState::Failed && to != DeviceState::Failed && !to.is_tombstone();
        if from.is_tombstone() || to == DeviceState::Closed || failed_out {
            return Err(EngineError::StateChange {
                id: id.0,
                from: from.name(),
                to: to.name(),
            });
        }
        if to.is_tombstone() {
            self.retire(&admin, |x| x.id == id, to);
        } else {
            d.set_state(to);
        }
        Ok(from)
    }

    /// Remap device `id` to `bytes` (grow, or shrink above its highest
    /// live slot). Under `admin`, so it never races another control-plane
    /// change; task parts let it in between keys.
    pub(super) fn resize(
        &self,
        id: DeviceId,
        bytes: usize,
        closing: &AtomicBool,
    ) -> Result<(), EngineError> {
        let _admin = self.admin();
        let d = self.find_open(id, closing, |d| !d.state().is_tombstone())?;
        d.core
            .remap(bytes)
            .map_err(|source| EngineError::Resize { id: id.0, source })
    }

    /// `(bytes used, capacity bytes)` over the devices that count
    /// capacity, by slots.
    pub(super) fn usage(&self) -> (u64, u64) {
        let sb = self.slot_bytes as u64;
        self.list()
            .iter()
            .filter(|d| d.state().counts_capacity() && !d.core.is_closing())
            .fold((0, 0), |(u, c), d| {
                (
                    u + sb * d.core.live_slot_count() as u64,
                    c + sb * d.core.max_slots() as u64,
                )
            })
    }

    /// Close every device (the engine's close, after its workers stopped).
    /// Under `admin`: a racing `add` either appended before this (and its
    /// device is closed here) or sees `closing` and refuses.
    pub(super) fn close_all(&self) {
        let admin = self.admin();
        for d in self.list().iter() {
            d.core.close();
        }
        // Out of the list: the tables go once the last holder lets go.
        self.retire(&admin, |_| true, DeviceState::Closed);
    }

    /// Close every device's mapping without the admin mutex (a failed
    /// `open`, before anyone else saw the pool).
    pub(super) fn close_cores(&self) {
        for d in self.list().iter() {
            d.core.close();
        }
    }
}

impl Engine {
    /// The devices with their state and usage, tombstones (closed,
    /// removed: no size, no slots) included, in id order (a snapshot;
    /// allocates).
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.inner.pool.entries().iter().map(Entry::info).collect()
    }

    /// Remap device `id` to `bytes` of mapping: grow, or shrink when no
    /// live slot lies past the new end (the hotplug resize builds on
    /// this). Task parts running on the device let the remap in between
    /// keys. Errors: [`EngineError::NoSuchDevice`], [`EngineError::Resize`]
    /// (with the core's reason), [`EngineError::Closing`].
    pub fn resize_device(&self, id: DeviceId, bytes: usize) -> Result<(), EngineError> {
        if crate::device::arena::in_observer_callback() {
            return Err(EngineError::Reentrant);
        }
        self.inner.pool.resize(id, bytes, &self.inner.closing)
    }

    /// The devices that hold `key` committed now (a diagnostic: with the
    /// engine's key ownership there is at most one).
    pub fn devices_holding(&self, key: Key) -> Vec<DeviceId> {
        self.inner
            .pool
            .list()
            .iter()
            .filter(|d| !d.state().is_tombstone() && d.core.exists(key, false))
            .map(|d| d.id)
            .collect()
    }

    /// Check every device's bookkeeping invariants (tests and
    /// diagnostics; see [`DaxCore::check_invariants`]). Only meaningful
    /// while no task is in flight.
    pub fn check_invariants(&self) -> Result<(), String> {
        for d in self.inner.pool.list().iter() {
            if !d.state().is_tombstone() {
                d.core
                    .check_invariants()
                    .map_err(|e| format!("device {}: {e}", d.id.0))?;
            }
        }
        Ok(())
    }

    /// Device `id`'s mapping, for raw-copy baselines (see [`RawDevice`]);
    /// `None` for a closed or removed device. A `RawDevice` keeps the
    /// device's mapping, fd and tables alive until it drops, even after
    /// the device is removed. Only with the `test-hooks` feature.
    #[cfg(feature = "test-hooks")]
    pub fn raw_device(&self, id: DeviceId) -> Option<RawDevice> {
        self.inner
            .pool
            .list()
            .iter()
            .find(|d| d.id == id)
            .map(|d| RawDevice(d.clone()))
    }

    /// The device list itself, for in-crate users that need a device's
    /// core (the bench's raw-copy limit).
    pub(crate) fn device_list(&self) -> Arc<Vec<Arc<Device>>> {
        self.inner.pool.snapshot()
    }

    /// Append a device (the control plane's add). Returns its id.
    ///
    /// Never two cores over one device: a device (or file) the pool already
    /// maps — same `st_rdev`, or same `(st_dev, st_ino)` — is answered with
    /// its existing id when the size matches (idempotent) and with
    /// [`EngineError::SizeConflict`] otherwise. The check and the append are
    /// one step under the pool's admin mutex (the data path never takes
    /// it: it reads the list through an `ArcSwap`), so two racing adds of
    /// one device map it once.
    pub fn add_device(&self, spec: &DeviceSpec) -> Result<DeviceId, EngineError> {
        if crate::device::arena::in_observer_callback() {
            return Err(EngineError::Reentrant);
        }
        self.inner.pool.add(spec, &self.inner.closing, &|d| {
            self.inner.observers.attach(d);
        })
    }

    /// Move device `id` to state `to` (the control plane's drain, migrate,
    /// resize and remove steps build on this); returns the state it had.
    /// Errors: [`EngineError::NoSuchDevice`], [`EngineError::StateChange`]
    /// for a tombstone, a move to `Closed`, or a failed device moved to
    /// anything but `Removed` (a failed device never serves again),
    /// [`EngineError::Closing`]. A move to `Failed` reports the device's
    /// keys deleted to the listeners before it returns
    /// ([`Engine::report_failed_devices`]).
    /// A state change takes effect for task parts that start after it;
    /// parts already running finish with the list they began with.
    pub fn set_device_state(
        &self,
        id: DeviceId,
        to: DeviceState,
    ) -> Result<DeviceState, EngineError> {
        if crate::device::arena::in_observer_callback() {
            return Err(EngineError::Reentrant);
        }
        let from = self.inner.pool.set_state(id, to, &self.inner.closing)?;
        if to == DeviceState::Failed {
            self.report_failed_devices();
        }
        Ok(from)
    }
}

/// Devices a task part opens an arena session on up front.
pub(super) const SESSION_DEVICES: usize = 4;

/// Rounds of "a device was being remapped: drop the sessions, wait for
/// it, retry" one store part may take before its remaining keys fail.
pub(super) const STORE_ROUNDS_MAX: usize = 64;

/// What `store_one` did.
pub(super) enum Stored {
    /// The key is in the pool (stored now, or already there).
    Yes,
    /// Not stored (every writable device full, or the put failed).
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
/// and must not wait (parent module doc, "Key ownership", and
/// `tests::a_claim_holder_never_waits_for_a_remap`).
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

/// The writable device to try after `after` (a `(usage, index)` already
/// tried): the least used, ties by position, skipping `except`. Called in
/// a loop it walks the writable devices in ascending usage without
/// allocating and without a limit on the list's length (tombstones stay in
/// it, so a 64-device bitmask would skip every device past the 64th).
pub(super) fn next_writable(
    devs: &[Arc<Device>],
    after: Option<(f64, usize)>,
    except: Option<DeviceId>,
) -> Option<(f64, usize)> {
    let later = |u: f64, i: usize| match after {
        None => true,
        Some((au, ai)) => u.total_cmp(&au).then(i.cmp(&ai)).is_gt(),
    };
    devs.iter()
        .enumerate()
        .filter(|(_, d)| d.state().is_writable() && Some(d.id) != except)
        .map(|(i, d)| (d.usage(), i))
        .filter(|&(u, i)| later(u, i))
        .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
}

/// Store one key under its claim (parent module doc, "Key ownership"): a
/// key already on a readable device stays there (success, no copy); a new
/// key goes to the active device with the lowest slot usage, then the next
/// on a full device.
pub(super) fn store_one(
    pool: &DevicePool,
    part_devs: &Arc<Vec<Arc<Device>>>,
    part_sessions: &[Option<Session<'_>>],
    key: Key,
    data: &[u8],
) -> Stored {
    // Held until we return: no other store of this key decides meanwhile.
    let claim = pool.claims.claim(key);
    // The device list as of now, not as of the part's start: a device
    // added since may hold the key (stored there under an earlier claim,
    // whose Release our claim's Acquire observed, and with it that store's
    // list). The part's sessions serve when the list is unchanged.
    let cur = pool.list();
    let (devs, sessions): (&[Arc<Device>], &[Option<Session<'_>>]) = if Arc::ptr_eq(&cur, part_devs)
    {
        (part_devs, part_sessions)
    } else {
        (&cur, &[])
    };
    for (i, d) in devs.iter().enumerate() {
        if d.state().is_readable() {
            match in_session(devs, sessions, i, |s| s.presence(key)) {
                Ok(Some(Presence::Stored)) => return Stored::Yes,
                // Under a store lease that has not committed: never
                // success (the lease may never commit), never a second
                // copy (docs/leases.md, "The engine's leases").
                Ok(Some(Presence::Leased)) => return Stored::No,
                Ok(_) => {}
                Err(dev) => return Stored::WouldWait(dev),
            }
        }
    }
    // The key is on no device: from here its store is in flight, and a
    // delete of it skips it (`docs/key-ownership.md`, "Delete").
    claim.mark_storing();
    // Try writable devices in ascending usage: pick the least used one not
    // yet tried, each round (devices are few; no allocation per key).
    let mut last = None;
    for _ in 0..devs.len() {
        let Some((usage, i)) = next_writable(devs, last, None) else {
            return Stored::No;
        };
        last = Some((usage, i));
        // Writable is checked again inside the session: a hotplug operation
        // takes a device out of the writable set, then waits for every
        // session on it to end before it lists the device's keys, so a put
        // under a session entered after that sees the new state and a put
        // under an older session is listed (a store committed after the
        // list would be lost with the device).
        let d = &devs[i];
        // The scan above found the key on no readable device under its
        // claim; a device that is writable but not readable was not
        // scanned, and there a plain `put` checks first.
        let scanned = d.state().is_readable();
        match in_session(devs, sessions, i, |s| {
            d.state().is_writable().then(|| {
                if scanned {
                    s.put_absent(key, data, 0)
                } else {
                    s.put(key, data, 0)
                }
            })
        }) {
            Ok(Some(Some(Ok(_)))) => return Stored::Yes,
            Ok(
                Some(
                    Some(Err(
                        PutError::Full
                        | PutError::IndexFull
                        | PutError::Closed
                        | PutError::DeviceFailed,
                    ))
                    | None,
                )
                | None,
            ) => {}
            Ok(Some(Some(Err(_)))) => return Stored::No,
            Err(dev) => return Stored::WouldWait(dev),
        }
    }
    Stored::No
}

#[cfg(all(test, not(daxkv_loom)))]
mod tests {
    use super::super::EngineOptions;
    use super::*;
    use crate::device::arena::ArenaSpec;
    use std::time::Duration;

    /// Key claims meet the arena gate: a store holding key K's claim that
    /// enters a device per call (the device list changed since its part
    /// began) while that device's remap is pending, and waits, closes a
    /// cycle: the remap waits for another worker's part session on the
    /// device, and that worker waits for K's claim, until the remap gives
    /// up after the drain timeout. A claim holder must never wait on an arena: here a
    /// remap of device 0 is pending (held up by a session standing in for
    /// the other worker's part), and `store_one` with a stale device list
    /// must come back at once with `WouldWait`, having stored nothing and
    /// released the claim. With `in_session` entering through the blocking
    /// `session()` this fails: `store_one` does not return while the remap
    /// is pending (the watchdog fires).
    #[test]
    fn a_claim_holder_never_waits_for_a_remap() {
        const SLOT: usize = 4096;
        let dev = DeviceSpec {
            path: "memfd".into(),
            core: CoreConfig::new(ArenaSpec::memfd(16 * SLOT).max_size_bytes(32 * SLOT), SLOT),
        };
        let e = Engine::open(vec![dev], SLOT, false, EngineOptions::default()).unwrap();
        let inner = e.inner.clone();
        let dev0 = inner.pool.list()[0].clone();
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
                let r = store_one(&inner.pool, &stale, &[], key, &[1; 64]);
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
        assert_eq!(inner.pool.claims.held(), 0, "the claim was released");
        assert!(!dev0.core.exists(key, false), "nothing was stored");
    }

    /// docs/lmcache-dax-behavior.md §8.1 item 14: deleting a borrowed slot keeps usage until
    /// the read ends (a borrowed read needs the device's core, so this
    /// lives beside the pool).
    #[test]
    fn delete_of_a_borrowed_slot_keeps_usage_until_the_read_ends() {
        const SLOT: usize = 4096;
        let dev = DeviceSpec {
            path: "memfd".into(),
            core: CoreConfig::new(ArenaSpec::memfd(2 * SLOT), SLOT),
        };
        let e = Engine::open(vec![dev], SLOT, false, EngineOptions::default()).unwrap();
        let k = Key::digest(b"borrowed");
        let id = e
            .submit_store(vec![k], vec![vec![7u8; 100].into()])
            .unwrap();
        assert!(
            e.wait_store(id, Duration::from_secs(10))
                .ready()
                .unwrap()
                .success
        );
        let dev = e.device_list()[0].clone();
        let set = dev.core().reserve_reads(&[k], false);
        assert_eq!(e.delete(&[k]), vec![k]);
        assert_eq!(e.usage(), (SLOT as u64, 2 * SLOT as u64), "usage stays 0.5");
        let st = e.status();
        assert_eq!(
            (
                st["live_slot_count"].as_u64(),
                st["borrowed_slot_count"].as_u64()
            ),
            (Some(1), Some(1))
        );
        assert!(
            dev.core().usage().1.abs() < f64::EPSILON,
            "usage after pending frees is 0"
        );
        drop(set);
        assert_eq!(e.usage().0, 0);
    }

    /// A removed device leaves the list the data path
    /// walks (unlock, delete, placement), so their cost does not grow
    /// with the number of devices ever removed; status still lists the
    /// tombstones, in id order. A list that kept tombstones would grow by
    /// one per cycle and fail this.
    #[test]
    fn removed_devices_leave_the_data_path_list() {
        const SLOT: usize = 4096;
        let dev = DeviceSpec {
            path: "memfd".into(),
            core: CoreConfig::new(ArenaSpec::memfd(4 * SLOT), SLOT),
        };
        let e = Engine::open(vec![dev], SLOT, true, EngineOptions::default()).unwrap();
        for c in 0..50 {
            let d = e
                .add_device(&DeviceSpec {
                    path: format!("memfd:c{c}"),
                    core: CoreConfig::new(ArenaSpec::memfd(4 * SLOT), SLOT),
                })
                .unwrap();
            e.remove_device(d, super::super::RemoveMode::Evict, false)
                .unwrap();
        }
        assert_eq!(e.inner.pool.list().len(), 1, "tombstones in the live list");
        let ids: Vec<u32> = e.devices().iter().map(|d| d.id.0).collect();
        assert_eq!(ids, (0..51).collect::<Vec<_>>());
        assert_eq!(e.status()["devices"][50]["index"], 50);
        e.close();
        assert!(e.inner.pool.list().is_empty(), "closed devices left");
    }

    #[test]
    fn state_changes_are_typed_and_tombstones_stay() {
        const SLOT: usize = 4096;
        let dev = || DeviceSpec {
            path: "memfd".into(),
            core: CoreConfig::new(ArenaSpec::memfd(4 * SLOT), SLOT),
        };
        let e = Engine::open(vec![dev(), dev()], SLOT, false, EngineOptions::default()).unwrap();
        assert_eq!(
            e.set_device_state(DeviceId(1), DeviceState::Draining)
                .unwrap(),
            DeviceState::Active
        );
        let states: Vec<_> = e.devices().iter().map(|d| d.state).collect();
        assert_eq!(states, [DeviceState::Active, DeviceState::Draining]);
        // A draining device takes no new keys: both go to device 0.
        let keys = vec![Key::digest(b"a"), Key::digest(b"b")];
        let id = e
            .submit_store(keys, vec![vec![1u8; 10].into(), vec![2u8; 10].into()])
            .unwrap();
        assert!(
            e.wait_store(id, Duration::from_secs(10))
                .ready()
                .unwrap()
                .success
        );
        let live: Vec<_> = e.devices().iter().map(|d| d.live_slots).collect();
        assert_eq!(live, [2, 0]);
        let err = e
            .set_device_state(DeviceId(9), DeviceState::Active)
            .unwrap_err();
        assert!(err.to_string().contains("no device 9"), "{err}");
        let err = e
            .set_device_state(DeviceId(0), DeviceState::Closed)
            .unwrap_err();
        assert!(err.to_string().contains("active → closed"), "{err}");
        e.set_device_state(DeviceId(1), DeviceState::Removed)
            .unwrap();
        let err = e
            .set_device_state(DeviceId(1), DeviceState::Active)
            .unwrap_err();
        assert!(err.to_string().contains("removed → active"), "{err}");
        e.close();
        assert!(matches!(
            e.set_device_state(DeviceId(0), DeviceState::Draining),
            Err(EngineError::Closing)
        ));
    }
}

/// The locking lookup a lookup task and [`Engine::lookup_and_lock_into`]
/// share: one batched `exists_many_into(.., lock = true)` per readable
/// device, in list order, over the keys still missing (upstream's
/// grouping, docs/lmcache-dax-behavior.md §3.6 step 3); `hit(i)` for each
/// key `keys[i]` found (and locked), once. `left`, `batch` and `hits` are
/// scratch; `left` ends holding the indices of the keys not found.
///
/// [`Engine::lookup_and_lock_into`]: super::Engine::lookup_and_lock_into
pub(super) fn lock_lookup(
    devs: &[Arc<Device>],
    keys: &[Key],
    left: &mut Vec<usize>,
    batch: &mut Vec<Key>,
    hits: &mut Vec<bool>,
    mut hit: impl FnMut(usize),
) {
    left.clear();
    left.extend(0..keys.len());
    for d in devs.iter().filter(|d| d.state().is_readable()) {
        if left.is_empty() {
            break;
        }
        batch.clear();
        batch.extend(left.iter().map(|&i| keys[i]));
        hits.clear();
        hits.resize(batch.len(), false);
        if d.core().exists_many_into(batch, true, hits).is_err() {
            continue;
        }
        let mut j = 0;
        left.retain(|&i| {
            let found = hits[j];
            j += 1;
            if found {
                hit(i);
            }
            !found
        });
    }
}
