//! # Failed devices: evicted, reported, and the pool serves on
//!
//! A device fails when a SIGBUS in one of its copies fails its mapping (a
//! file truncated under it, a poisoned memory line: `crate::device::fault`),
//! when the control plane sets it `failed`, or (the `failpoints` feature)
//! when a test fails it. From then on (docs/hotplug.md, "Failed devices"):
//!
//! - it is neither readable nor writable: its keys read as misses, and a
//!   store tries the next writable device (`pool::store_one`);
//! - its keys are deleted from its index and reported through the
//!   listeners' `on_keys_deleted`, once ([`Engine::report_failed_devices`]:
//!   at the first status, health check, device list, `/metrics` scrape,
//!   remove or worker idle tick after the failure);
//! - `/health` stays 200 and says `degraded`, naming it, while another
//!   device takes stores ([`Engine::health`]);
//! - remove (any mode but drain) accepts it and evicts: it leaves a
//!   `removed` tombstone, like any removed device.
//!
//! Each key is deleted and reported under its claim, after checking that no
//! other readable device holds it: a key stored again elsewhere since the
//! failure (under that key's claim too) is not reported gone.

#![forbid(unsafe_code)]

use std::sync::Arc;

use super::pool::{Device, DeviceState};
use super::{Engine, Inner};
use crate::device::arena::TryEnterError;
use crate::key::Key;

impl Engine {
    /// Delete the keys of every failed device not yet reported and tell
    /// the listeners (on this thread, with no engine lock held). Returns
    /// how many keys were reported. Cheap when nothing failed: one state
    /// load per device.
    pub fn report_failed_devices(&self) -> usize {
        self.inner.report_failed_devices()
    }
}

/// Remap waits `evict_failed` spends on one key before it skips it.
const KEY_WAITS: usize = 8;
/// Remap waits one `evict_failed` walk spends in all; past them each busy
/// key gets one try.
const TOTAL_WAITS: usize = 4 * super::pool::STORE_ROUNDS_MAX;

impl Inner {
    /// [`Engine::report_failed_devices`] (also run by an idle worker).
    pub(super) fn report_failed_devices(&self) -> usize {
        let mut n = 0;
        for d in self.pool.list().iter() {
            if d.state() != DeviceState::Failed {
                continue;
            }
            let Some(keys) = d.report_failure_once(false, || self.evict_failed(d)) else {
                continue;
            };
            log_line!(
                "daxkv: device {} ({}) failed: {} keys reported deleted; the other devices serve on",
                d.index(),
                d.path(),
                keys.len()
            );
            n += keys.len();
            if !keys.is_empty() {
                self.tell_listeners("on_keys_deleted", |l| l.on_keys_deleted(&keys));
            }
        }
        n
    }

    /// Delete every key of failed device `d` (forced: a lock or a borrow
    /// on a device that serves nothing holds nothing), each under its
    /// claim; returns the keys no other readable device holds.
    ///
    /// First waits (up to the drain timeout, holding no claim) for every
    /// operation that entered `d` before it failed: a store that chose it
    /// while it was writable and commits after the keys are listed would
    /// be answered success, read as a miss, and never be reported. Puts
    /// that enter later see the failure (`store_one` and migrations check
    /// writability inside their session; a core that failed refuses puts)
    /// and go elsewhere. A guard held past the timeout (a long borrowed
    /// read) does not stop the report.
    pub(super) fn evict_failed(&self, d: &Arc<Device>) -> Vec<Key> {
        let _ = d.core().quiesce();
        let keys = d.core().snapshot_keys();
        let mut out = Vec::with_capacity(keys.len());
        let mut i = 0;
        let mut rounds = 0usize;
        let mut skipped = 0usize;
        let mut total = 0usize;
        while i < keys.len() {
            let k = keys[i];
            let claim = self.pool.claims.claim(k);
            // A claim holder never waits on an arena (a remap may wait for
            // a worker that waits for this claim): enter without waiting;
            // on a pending remap (here, or on a device that may hold the
            // key again) let go of the claim, wait, and retry. The key is
            // looked for elsewhere before it is deleted here, both under
            // its claim (no store of it meanwhile): a device that cannot be
            // entered now is waited for, not taken for one without it.
            let mut wait_for: Option<Arc<Device>> = None;
            let mut elsewhere = false;
            for o in self.pool.list().iter() {
                if o.id() == d.id() || !o.state().is_readable() {
                    continue;
                }
                match o.core().try_session() {
                    Ok(s) if s.contains_live(k) => {
                        elsewhere = true;
                        break;
                    }
                    Ok(_) | Err(TryEnterError::Closed) => {}
                    Err(TryEnterError::Busy) => {
                        wait_for = Some(o.clone());
                        break;
                    }
                }
            }
            let deleted = match wait_for {
                Some(_) => None,
                None => match d.core().try_session() {
                    Ok(held) => Some(held.delete(k, true)),
                    Err(TryEnterError::Closed) => Some(false),
                    Err(TryEnterError::Busy) => {
                        wait_for = Some(d.clone());
                        None
                    }
                },
            };
            let Some(deleted) = deleted else {
                drop(claim);
                if let Some(w) = wait_for {
                    drop(w.core().session());
                }
                // Each key has its own budget (a key that waited through
                // remaps back to back must not use up the next keys'
                // waits: every later key would get one try), and the walk
                // a total one (it runs on the caller of a health check or
                // a status: it must end in bounded time).
                rounds += 1;
                total += 1;
                if rounds >= KEY_WAITS || total >= TOTAL_WAITS {
                    skipped += 1;
                    rounds = 0;
                    i += 1;
                }
                continue;
            };
            drop(claim);
            if deleted && !elsewhere {
                out.push(k);
            }
            rounds = 0;
            i += 1;
        }
        if skipped > 0 {
            log_line!(
                "daxkv: device {} ({}) failed: {skipped} keys not reported deleted (remaps on \
                 the other devices kept them from being checked); they read as misses",
                d.index(),
                d.path()
            );
        }
        out
    }
}
