//! # Failpoints: faults injected into one engine or one of its devices
//!
//! Compiled only with the `failpoints` cargo feature (this crate's tests
//! build with it; a default build has none of it: no field, no load, no
//! branch). Every hook belongs to one engine or one device, never to the
//! process, so tests running in parallel, and a fault aimed at one device,
//! do not interfere with one another.
//!
//! | fault | hook | what the engine promises meanwhile |
//! |---|---|---|
//! | a copy that fails | [`DeviceFaults::copy_faults`] | the store of that key fails; no slot leaks; other keys keep their bytes |
//! | a slow device | [`DeviceFaults::copy_delay`] | every task still completes; close waits for it |
//! | a full device under load | [`DeviceFaults::full`] | new keys go to other devices, or fail when none has room |
//! | a device that fails mid-run | [`Engine::inject_device_failure`] | its keys read as misses and are reported deleted; other devices serve (docs/hotplug.md, "Failed devices") |
//! | a worker that panics | [`Engine::inject_worker_panics`] | the task fails, the worker serves on, nothing stays locked |
//! | an eventfd write that fails | [`Engine::inject_eventfd_write_failures`] | waiters re-check on their own (every 50 ms), workers wake on their park timeout (100 ms): every task completes |

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::pool::Device;
use super::{DeviceId, Engine, EngineError};
use crate::device::core::{DaxCore, StallPoint};

/// The engine-wide hooks (in `Inner`).
#[derive(Debug, Default)]
pub(super) struct EngineFaults {
    /// Task parts still to panic in their worker.
    panic_parts: AtomicU32,
}

impl EngineFaults {
    /// Called by a worker at the start of every task part: panics while
    /// [`Engine::inject_worker_panics`] has parts left to fail.
    #[inline]
    pub(super) fn worker_panic_point(&self) {
        // ORDERING: Relaxed — a test knob; which part panics is any fine
        // choice, the count alone matters.
        let hit = self
            .panic_parts
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        assert!(!hit, "failpoint: injected worker panic");
    }
}

/// One device's fault hooks, held by a test: keeps the device's core alive
/// (as a task part would) even after the device is removed.
#[derive(Debug, Clone)]
pub struct DeviceFaults(Arc<Device>);

impl DeviceFaults {
    /// Its id.
    pub fn id(&self) -> DeviceId {
        self.0.id()
    }

    /// One payload copy into the device in every `every` fails (`0`: off).
    pub fn copy_faults(&self, every: u32) {
        self.core().inject_copy_faults(every);
    }

    /// Every payload copy into or out of the device sleeps `delay` first.
    pub fn copy_delay(&self, delay: Duration) {
        self.core().inject_copy_delay(delay);
    }

    /// While `full`, puts that need a new slot on the device fail as full.
    pub fn full(&self, full: bool) {
        self.core().inject_full(full);
    }

    /// Run `f` once, the next time an operation on this device that found
    /// a key in its index passes `at`.
    pub fn stall(&self, at: StallPoint, f: impl FnOnce(&DaxCore) + Send + 'static) {
        self.core().inject_stall(at, f);
    }

    /// The device's core (its live-slot and lock counts, for tests that
    /// check nothing leaked).
    pub fn core(&self) -> &DaxCore {
        self.0.core()
    }
}

impl Engine {
    /// Device `id`'s fault hooks (`None` once it is closed or removed).
    pub fn device_faults(&self, id: DeviceId) -> Option<DeviceFaults> {
        self.device_list()
            .iter()
            .find(|d| d.id() == id)
            .map(|d| DeviceFaults(d.clone()))
    }

    /// Fail device `id` now, as a SIGBUS in one of its copies would
    /// (`crate::device::fault`), and report its keys deleted to the
    /// listeners (docs/hotplug.md, "Failed devices").
    pub fn inject_device_failure(&self, id: DeviceId) -> Result<(), EngineError> {
        let d = self
            .device_faults(id)
            .ok_or(EngineError::NoSuchDevice { id: id.0 })?;
        d.core().inject_device_failure();
        self.report_failed_devices();
        Ok(())
    }

    /// The next `n` task parts (any kind) panic in their worker.
    pub fn inject_worker_panics(&self, n: u32) {
        // ORDERING: Relaxed — a test knob.
        self.inner.faults.panic_parts.store(n, Ordering::Relaxed);
    }

    /// The next `n` writes of each of this engine's eventfds (the
    /// completion eventfds handed to pollers, and the workers' wake-ups)
    /// fail with `EIO`.
    pub fn inject_eventfd_write_failures(&self, n: u32) {
        if let Some(pools) = self.inner.workers.load_full() {
            for p in pools.iter() {
                p.fd.inject_write_failures(n);
                for w in &p.wakes {
                    w.inject_write_failures(n);
                }
            }
        }
    }
}
