//! # The engine's slot leases: `DaxCore` leases across the device pool
//!
//! [`Engine::lease_store_into`] places each key as a store task would (the
//! least used writable device, under the key's claim, one copy per key)
//! and hands back a [`EngineStoreLease`]: where the bytes go (device id,
//! mapping epoch, offset, pointer, length). [`EngineStoreLease::commit`]
//! (or [`Engine::commit_into`] for a batch) makes the key stored exactly
//! as a store task's worker does: readable from then on, the listeners
//! told `on_keys_stored`, the store counted in the metrics. An
//! [`EngineReadLease`] ([`Engine::lease_load_into`]) keeps a readable slot
//! from being freed or reused until it is released. `docs/leases.md` has
//! the contract and the rules; this module doc has the reasoning.
//!
//! ## Owning a device's lease
//!
//! A core lease borrows its core; an engine lease must outlive the call
//! that made it, so it is a `device::core::Owned` lease: the core's lease
//! next to an `Arc<Device>` that keeps the core alive and unmoved until
//! the lease has ended (the unsafe part lives there, in the device layer;
//! this module has none).
//!
//! ## Placement, and a forced remove
//!
//! Under the key's claim (`claims`), as a store task's `store_one`: the
//! key is looked for on every readable device first (stored, in flight or
//! leased: `AlreadyPresent`), then leased on the least used writable one.
//! The claim makes the look and the reservation one step for every other
//! store, lease or move of the key. The device's writability is checked
//! again *after* the core lease is in the device's lease table, against a
//! forced hotplug remove that changes the state and then walks that table
//! to cancel what it finds (`hotplug.rs`, `remove_inner`):
//!
//! ```text
//! lease_one:   table entry (SeqCst CAS) ; fence(SeqCst) ; state writable?  no → abort
//! remove:      state = Draining/Migrating ; fence(SeqCst) ; walk table → cancel
//! ```
//!
//! A Dekker pair through the two fences: either the lease sees the new
//! state and gives its slot back, or the walk sees its entry and cancels
//! it (its commit answers `Canceled`). Without it a lease taken as the
//! remove began could commit on a device the remove had already listed,
//! and the key, answered stored, would go with the device
//! (`tests/lease_engine.rs` hunts it).
//!
//! Taking a lease never waits on a gate: a pending remap answers `Busy`
//! (the claim is let go of first), as the core's `lease_*` do.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::pool::{next_writable, Device, DeviceId, DeviceListCache};
use super::{DeviceState, Engine, EngineError, Inner, TaskKind};
use crate::device::arena::{CopyError, TryEnterError};
use crate::device::core::{
    DaxCore, OwnedLeasedStore, OwnedReadLease, OwnedStoreLease, Presence, ReadLease, StoreLease,
};
use crate::device::lease::LeaseError;
use crate::key::Key;

/// An [`Engine::lease_store_into`] answer for one key.
#[derive(Debug)]
pub enum EngineLeased {
    /// The slot is the caller's to fill, then commit.
    Leased(EngineStoreLease),
    /// The key is stored (or being stored by a store task) already: no
    /// slot, no pointer.
    AlreadyPresent,
}

/// A slot reserved for a key on one of the engine's devices, for the
/// caller to fill through [`EngineStoreLease::ptr`] and then
/// [`commit`](EngineStoreLease::commit); dropping it aborts. `Send`: any
/// thread may end it. It keeps its device's mapping (and, after a forced
/// remove, the device itself) alive until it ends.
#[must_use = "dropping a store lease aborts it"]
pub struct EngineStoreLease {
    /// `None` once ended.
    lease: Option<OwnedStoreLease<Device>>,
    inner: Arc<Inner>,
    since: Instant,
}

impl std::fmt::Debug for EngineStoreLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineStoreLease")
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl EngineStoreLease {
    fn core(&self) -> &StoreLease<'_> {
        self.lease
            .as_ref()
            .expect("a live engine lease holds its core lease")
            .get()
    }

    fn dev(&self) -> &Device {
        self.lease
            .as_ref()
            .expect("a live engine lease holds its core lease")
            .owner()
    }

    /// Where the payload goes: [`len`](Self::len) bytes from here are the
    /// caller's to write until it commits or aborts.
    pub fn ptr(&self) -> *mut u8 {
        self.core().ptr()
    }

    /// The payload's length, bytes (as asked for).
    pub fn len(&self) -> usize {
        self.core().len()
    }

    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Byte offset of the slot in its device's mapping.
    pub fn offset(&self) -> usize {
        self.core().offset()
    }

    /// The device the slot is on.
    pub fn device(&self) -> DeviceId {
        self.dev().id()
    }

    /// The epoch of the mapping the pointer is in (`Engine::regions`).
    pub fn epoch(&self) -> u64 {
        self.core().epoch()
    }

    /// The key this lease stores.
    pub fn key(&self) -> Key {
        self.core().key()
    }

    /// Copy `src` into the payload at byte `at`, for a caller filling the
    /// slot from host memory (a SIGBUS on the device caught as
    /// `DeviceFailed`, as for a store task's copy); a copy engine writes
    /// through [`ptr`](Self::ptr) instead.
    pub fn write(&mut self, at: usize, src: &[u8]) -> Result<(), CopyError> {
        self.lease
            .as_mut()
            .expect("a live engine lease holds its core lease")
            .write(at, src)
    }

    /// Commit without telling anyone: `Ok(bytes)` when the key is stored.
    fn commit_quiet(&mut self) -> Result<usize, LeaseError> {
        let l = self.lease.take().expect("a lease ends once");
        let len = l.get().len();
        // ORDERING: Acquire — observes `close`'s store; a commit racing it
        // stores into a pool nobody reads again, which is harmless.
        if self.inner.closing.load(Ordering::Acquire) {
            l.abort();
            return Err(LeaseError::Closed);
        }
        if l.owner().state() == super::DeviceState::Failed {
            l.abort();
            return Err(LeaseError::DeviceFailed);
        }
        l.commit().map(|()| len)
    }

    /// The key is stored: readable from now on, the listeners told
    /// (`on_keys_stored`), counted as a store of one key. The caller's copy
    /// into [`ptr`](Self::ptr) must be finished (docs/leases.md, "The
    /// contract"). [`LeaseError::Canceled`] if a forced delete, evict or
    /// remove hit the key meanwhile, `Closed` once the engine is closing,
    /// `DeviceFailed` if its device failed: the slot is freed and the key
    /// not stored.
    pub fn commit(mut self) -> Result<(), LeaseError> {
        let key = self.key();
        let r = self.commit_quiet();
        let inner = &self.inner;
        let bytes = r.as_ref().map_or(0, |&n| n as u64);
        inner.metrics.record_task(
            usize::MAX,
            TaskKind::Store,
            1,
            usize::from(r.is_ok()),
            bytes,
            self.since.elapsed(),
        );
        if r.is_ok() {
            let size = [inner.slot_bytes];
            inner.tell_listeners("on_keys_stored", |l| l.on_keys_stored(&[key], &size));
        }
        r.map(|_| ())
    }

    /// Give the slot back without storing the key. The caller's copy must
    /// be finished, as for a commit.
    pub fn abort(mut self) {
        if let Some(l) = self.lease.take() {
            l.abort();
        }
    }
}

/// A readable slot on one of the engine's devices, kept from being freed
/// or reused until this is dropped (or [`released`](Self::release)). A
/// delete meanwhile detaches the key (later lookups miss it) and the slot
/// is freed when the lease goes. `Send`.
pub struct EngineReadLease {
    lease: OwnedReadLease<Device>,
}

impl std::fmt::Debug for EngineReadLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineReadLease")
            .field("lease", &self.lease)
            .finish()
    }
}

impl EngineReadLease {
    fn core(&self) -> &ReadLease<'_> {
        self.lease.get()
    }

    /// Where the payload is: [`len`](Self::len) bytes from here, to read
    /// only.
    pub fn ptr(&self) -> *const u8 {
        self.core().ptr()
    }

    /// The payload's length, bytes.
    pub fn len(&self) -> usize {
        self.core().len()
    }

    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Byte offset of the slot in its device's mapping.
    pub fn offset(&self) -> usize {
        self.core().offset()
    }

    /// The device the slot is on.
    pub fn device(&self) -> DeviceId {
        self.lease.owner().id()
    }

    /// The epoch of the mapping the pointer is in.
    pub fn epoch(&self) -> u64 {
        self.core().epoch()
    }

    /// Copy the payload from byte `at` into `dst` (as much as fits): how
    /// many bytes (a SIGBUS on the device caught as `DeviceFailed`).
    pub fn read(&self, at: usize, dst: &mut [u8]) -> Result<usize, CopyError> {
        self.core().read(at, dst)
    }

    /// End the lease (as dropping it does). The caller's reads must be
    /// finished.
    pub fn release(self) {}
}

impl Engine {
    /// Reserve a slot per key for the caller to fill (docs/leases.md,
    /// "The engine's leases"): per key, in order, appended to `out`, an
    /// [`EngineLeased::Leased`] with where its `lens[i]` bytes go, an
    /// [`EngineLeased::AlreadyPresent`] (stored, or being stored by a
    /// store task), or why not ([`LeaseError`]: `InFlight` under another
    /// open store lease, `TooLarge`, `Full` when no writable device has
    /// room, `Busy` while a remap is pending on a device the key had to be
    /// looked for on, `TooMany`, `Closed`).
    /// Never waits on a device. Until its commit a leased key is in
    /// flight: lookups and loads miss it, a store of it fails, a delete
    /// skips it. Returns the number of leases given; nothing is allocated
    /// when `out` has room.
    pub fn lease_store_into(
        &self,
        keys: &[Key],
        lens: &[usize],
        out: &mut Vec<Result<EngineLeased, LeaseError>>,
    ) -> Result<usize, EngineError> {
        if keys.len() != lens.len() {
            return Err(EngineError::LengthMismatch {
                what: "lease_store",
                keys: keys.len(),
                bufs: lens.len(),
            });
        }
        let mut devs = self.inner.pool.list_cache();
        let mut n = 0;
        for (&k, &len) in keys.iter().zip(lens) {
            let r = self.lease_one(k, len, &mut devs);
            n += usize::from(matches!(r, Ok(EngineLeased::Leased(_))));
            out.push(r);
        }
        Ok(n)
    }

    /// [`Engine::lease_store_into`] into a new vector.
    pub fn lease_store(
        &self,
        keys: &[Key],
        lens: &[usize],
    ) -> Result<Vec<Result<EngineLeased, LeaseError>>, EngineError> {
        let mut out = Vec::with_capacity(keys.len());
        self.lease_store_into(keys, lens, &mut out)?;
        Ok(out)
    }

    /// One key of [`Engine::lease_store_into`] (module doc, "Placement").
    fn lease_one(
        &self,
        key: Key,
        len: usize,
        devs_now: &mut DeviceListCache<'_>,
    ) -> Result<EngineLeased, LeaseError> {
        let inner = &self.inner;
        // ORDERING: Acquire — observes `close`'s store (each core's own
        // closing gate keeps a racing lease safe).
        if inner.closing.load(Ordering::Acquire) {
            return Err(LeaseError::Closed);
        }
        if len > inner.slot_bytes {
            return Err(LeaseError::TooLarge {
                len,
                slot_bytes: inner.slot_bytes,
            });
        }
        let claim = inner.pool.claims.claim(key);
        // Read under the claim (see `DevicePool::list_cache`).
        let devs = devs_now.load();
        for d in devs.iter().filter(|d| d.state().is_readable()) {
            match d.core().try_session() {
                Ok(s) => match s.presence(key) {
                    Presence::Absent => {}
                    Presence::Stored => return Ok(EngineLeased::AlreadyPresent),
                    // Not stored: answering present would let a caller take
                    // the key for stored (a lease that may never commit).
                    Presence::Leased => return Err(LeaseError::InFlight),
                },
                Err(TryEnterError::Closed) => {}
                // A claim holder never waits on an arena.
                Err(TryEnterError::Busy) => return Err(LeaseError::Busy),
            }
        }
        let mut why = LeaseError::Full;
        let mut last = None;
        for _ in 0..devs.len() {
            let Some((usage, i)) = next_writable(devs, last, None) else {
                break;
            };
            last = Some((usage, i));
            let dev = &devs[i];
            let l = match DaxCore::lease_store_owned(dev, key, len, 0) {
                Ok(OwnedLeasedStore::Leased(l)) => l,
                Ok(OwnedLeasedStore::AlreadyPresent) => return Ok(EngineLeased::AlreadyPresent),
                Err(e @ (LeaseError::Busy | LeaseError::TooLarge { .. })) => return Err(e),
                Err(e) => {
                    why = e;
                    continue;
                }
            };
            // ORDERING: SeqCst fence — the Dekker pair with a forced
            // remove (module doc): our table entry (written in
            // `lease_store`) is before this, the state read after.
            fence(Ordering::SeqCst);
            if !dev.state().is_writable() {
                l.abort();
                why = LeaseError::Closed;
                continue;
            }
            drop(claim);
            return Ok(EngineLeased::Leased(EngineStoreLease {
                lease: Some(l),
                inner: Arc::clone(inner),
                since: Instant::now(),
            }));
        }
        Err(why)
    }

    /// Commit a batch of this engine's store leases, in order, each
    /// answer appended to `out` (as [`EngineStoreLease::commit`]), and
    /// tell the listeners once for all the keys stored. Empties `leases`;
    /// returns the number committed. Allocates only for the listeners'
    /// key list, when a listener is registered.
    pub fn commit_into(
        &self,
        leases: &mut Vec<EngineStoreLease>,
        out: &mut Vec<Result<(), LeaseError>>,
    ) -> usize {
        let start = Instant::now();
        let tell = !self.inner.listeners.load().is_empty();
        let mut stored = Vec::new();
        let (mut n, mut ok, mut foreign_ok, mut bytes) = (0, 0, 0, 0u64);
        for mut l in leases.drain(..) {
            if !Arc::ptr_eq(&l.inner, &self.inner) {
                // Another engine's: committed (and counted) on its own terms.
                let r = l.commit();
                foreign_ok += usize::from(r.is_ok());
                out.push(r);
                continue;
            }
            n += 1;
            let key = l.key();
            let r = l.commit_quiet();
            if let Ok(b) = r {
                ok += 1;
                bytes += b as u64;
                if tell {
                    stored.push(key);
                }
            }
            out.push(r.map(|_| ()));
        }
        if n > 0 {
            self.inner.metrics.record_task(
                usize::MAX,
                TaskKind::Store,
                n,
                ok,
                bytes,
                start.elapsed(),
            );
        }
        if !stored.is_empty() {
            let sizes = vec![self.inner.slot_bytes; stored.len()];
            self.inner
                .tell_listeners("on_keys_stored", |l| l.on_keys_stored(&stored, &sizes));
        }
        ok + foreign_ok
    }

    /// Borrow each key's readable slot for the caller to read
    /// (docs/leases.md): per key, in order, appended to `out`,
    /// `Ok(Some(lease))` on a hit, `Ok(None)` on a miss (absent, in flight
    /// or leased for a store), or why not (`Busy` while a remap is pending
    /// on a device that may hold it, `TooMany`, `Closed`). Hits are told
    /// to the listeners (`on_keys_accessed`) and counted as one load.
    /// Never waits on a device. Take it after a lookup-and-lock to be sure
    /// of a hit: the lock keeps the key from being deleted meanwhile.
    /// Returns the number of hits; nothing is allocated when `out` has
    /// room and no listener is registered.
    pub fn lease_load_into(
        &self,
        keys: &[Key],
        out: &mut Vec<Result<Option<EngineReadLease>, LeaseError>>,
    ) -> usize {
        let start = Instant::now();
        let inner = &self.inner;
        // ORDERING: Acquire — observes `close`'s store, as in `lease_one`.
        if inner.closing.load(Ordering::Acquire) {
            out.extend(keys.iter().map(|_| Err(LeaseError::Closed)));
            return 0;
        }
        let devs = inner.pool.list();
        let first = out.len();
        let (mut hits, mut bytes) = (0, 0u64);
        for &k in keys {
            let mut r = Ok(None);
            for d in devs.iter().filter(|d| d.state().is_readable()) {
                match DaxCore::lease_load_owned(d, k) {
                    Ok(Some(lease)) => {
                        // A resize refuses to remap under a lease, and
                        // checks for leases before it moves anything: a
                        // read lease taken once it began backs off, or the
                        // resize would move keys and then answer 409 (the
                        // second review's
                        // `a_shrink_answering_leased_has_moved_nothing`).
                        // ORDERING: SeqCst fence — the Dekker pair with
                        // `resize_inner`'s (state, fence, lease check), as
                        // in `lease_one`.
                        fence(Ordering::SeqCst);
                        if d.state() == DeviceState::Resizing {
                            drop(lease);
                            r = Err(LeaseError::Busy);
                            continue;
                        }
                        hits += 1;
                        bytes += lease.get().len() as u64;
                        r = Ok(Some(EngineReadLease { lease }));
                        break;
                    }
                    Ok(None) | Err(LeaseError::Closed) => {}
                    // Told only if no other device has it.
                    Err(e) => r = Err(e),
                }
            }
            out.push(r);
        }
        inner.metrics.record_task(
            usize::MAX,
            TaskKind::Load,
            keys.len(),
            hits,
            bytes,
            start.elapsed(),
        );
        if hits > 0 && !inner.listeners.load().is_empty() {
            let accessed: Vec<Key> = keys
                .iter()
                .zip(&out[first..])
                .filter(|(_, r)| matches!(r, Ok(Some(_))))
                .map(|(&k, _)| k)
                .collect();
            inner.tell_listeners("on_keys_accessed", |l| l.on_keys_accessed(&accessed));
        }
        hits
    }

    /// [`Engine::lease_load_into`] into a new vector.
    pub fn lease_load(&self, keys: &[Key]) -> Vec<Result<Option<EngineReadLease>, LeaseError>> {
        let mut out = Vec::with_capacity(keys.len());
        self.lease_load_into(keys, &mut out);
        out
    }
}
