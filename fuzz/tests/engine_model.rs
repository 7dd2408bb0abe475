//! The engine against a reference model, on random task sequences: stores
//! (payloads stamped with their key and a version), lookups that lock,
//! loads checked byte for byte, unlocks, deletes, hotplug (add, drain,
//! migrate, evict, forced remove, grow and shrink) and close, one task at
//! a time. The model is a map key → (version, length, locks); the keys a
//! hotplug operation deletes are learnt from the engine's listener.
//! Slot leases join in (docs/leases.md): store leases filled through their
//! pointer and committed or aborted later (a leased key is absent to
//! lookups, loads, stores and deletes until its commit; a commit answers
//! `Ok` and the key is stored, or `Canceled` only after a forced remove of
//! its device), and read leases whose bytes are checked when taken and
//! again when released, across deletes and hotplug.
//!
//! After every step: every task completed (no `wait_*` timed out), the
//! engine's `exists` agrees with the model key by key, a locked key was
//! never deleted by a delete or a non-forced hotplug operation, and the
//! devices' live slots add up to the model's keys (no slot leaked). At the
//! end: unlocking and deleting everything leaves every device empty, the
//! task table has no record taken, and the devices' invariants hold. A
//! sequence that ends in `Close` submits tasks without waiting, closes, and
//! checks that each of them still answers.
//!
//! `cargo test -p daxkv-fuzz --test engine_model` runs it on random inputs
//! (bounded: [`ITERATIONS`] sequences or `BOLERO_RANDOM_TEST_TIME_MS`);
//! `cargo +nightly bolero test -p daxkv-fuzz --test engine_model
//! engine_model` runs it coverage-guided.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bolero::{check, TypeGenerator};
use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{
    Answer, DeviceId, DeviceSpec, Engine, EngineError, EngineLeased, EngineOptions,
    EngineReadLease, EngineStoreLease, Listener, RemoveMode, ShrinkMode,
};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key, LeaseError};

const SLOT: usize = 4096;
/// Slots per device at open: small, so devices fill and shrinks bite.
const DEV_SLOTS: usize = 6;
/// Distinct keys (ids `0..KEYS`).
const KEYS: u8 = 10;
/// Devices present at most (added ones included).
const MAX_DEVICES: usize = 4;
/// Longer than any task takes on a loaded machine; a task that has not
/// answered by then is a task that never completes.
const WAIT: Duration = Duration::from_secs(20);
/// Sequences per plain `cargo test` run (a few seconds on a 2-vCPU VM).
const ITERATIONS: usize = 300;

#[derive(Clone, Copy, Debug, TypeGenerator)]
enum Op {
    Store {
        keys: [u8; 3],
        n: u8,
        len: u16,
    },
    Lookup {
        keys: [u8; 3],
        n: u8,
    },
    Load {
        keys: [u8; 3],
        n: u8,
        short: bool,
    },
    Unlock {
        keys: [u8; 3],
        n: u8,
    },
    Delete {
        keys: [u8; 3],
        n: u8,
    },
    Add {
        slots: u8,
    },
    Remove {
        dev: u8,
        mode: u8,
        force: bool,
    },
    Resize {
        dev: u8,
        slots: u8,
        evict: bool,
        force: bool,
    },
    Close {
        pending: u8,
    },
    Lease {
        key: u8,
        len: u16,
    },
    Commit {
        key: u8,
        abort: bool,
    },
    ReadLease {
        key: u8,
    },
    Release {
        at: u8,
    },
}

/// What the engine must hold for one key.
#[derive(Clone, Copy, Debug)]
struct Entry {
    version: u32,
    len: usize,
    locks: u32,
}

thread_local! {
    /// The sequence being run, for the messages of the end-of-run checks.
    static OPS: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

#[derive(Default)]
struct Deleted(Mutex<Vec<Key>>);

impl Listener for Deleted {
    fn on_keys_deleted(&self, keys: &[Key]) {
        self.0.lock().unwrap().extend_from_slice(keys);
    }
}

/// A read lease's bytes.
fn read(l: &EngineReadLease) -> &[u8] {
    // SAFETY: a read lease hands out `len()` readable bytes at `ptr()`
    // until it ends.
    unsafe { std::slice::from_raw_parts(l.ptr(), l.len()) }
}

fn key(id: u8) -> Key {
    Key::digest(&[b'k', id])
}

/// `[id][version u32][len u16][filler]`, the filler a function of all three.
fn payload(id: u8, version: u32, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    v.push(id);
    v.extend_from_slice(&version.to_le_bytes());
    v.extend_from_slice(&(len as u16).to_le_bytes());
    let mut x = u32::from(id) << 24 ^ version ^ (len as u32).rotate_left(7) | 1;
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        v.push(x as u8);
    }
    v
}

/// Distinct key ids of a task: `n % 3 + 1` of `keys`, duplicates dropped.
fn ids(keys: [u8; 3], n: u8) -> Vec<u8> {
    let mut out = Vec::new();
    for &k in &keys[..usize::from(n % 3) + 1] {
        let k = k % KEYS;
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

fn device(name: &str, slots: usize) -> DeviceSpec {
    let bytes = slots * SLOT;
    DeviceSpec {
        path: name.into(),
        core: CoreConfig::new(
            ArenaSpec::memfd(bytes)
                .max_size_bytes(2 * bytes)
                .populate(false),
            SLOT,
        ),
    }
}

fn open() -> (Engine, Arc<Deleted>) {
    let opts = EngineOptions {
        num_store_workers: 1,
        num_lookup_workers: 1,
        num_load_workers: 2,
        task_slots: 16,
        task_keys: 4,
        spin: Duration::from_micros(5),
        wait_spin: Duration::from_micros(5),
        ..EngineOptions::default()
    };
    let engine = Engine::open(
        vec![device("memfd", DEV_SLOTS), device("memfd:b", DEV_SLOTS)],
        SLOT,
        true,
        opts,
    )
    .expect("engine opens");
    let deleted = Arc::new(Deleted::default());
    let l: Arc<dyn Listener> = deleted.clone();
    engine.register_listener(&l);
    (engine, deleted)
}

struct Run {
    // Leases first: they end (abort, release) before the engine drops.
    /// Open store leases: key id → (lease, version, length) written.
    open: BTreeMap<u8, (EngineStoreLease, u32, usize)>,
    /// Read leases: (key id, lease, version, length) read.
    reads: Vec<(u8, EngineReadLease, u32, usize)>,
    engine: Engine,
    deleted: Arc<Deleted>,
    keys: BTreeMap<u8, Entry>,
    next_version: u32,
    added: u32,
    /// Devices a forced migrate or evict was asked of (it cancels their
    /// store leases, even if it then fails for want of room).
    forced: BTreeSet<DeviceId>,
}

impl Run {
    /// Devices that are not tombstones (removed / closed).
    fn live(&self) -> Vec<daxkv::engine::DeviceInfo> {
        self.engine
            .devices()
            .into_iter()
            .filter(|d| !d.state.is_tombstone())
            .collect()
    }

    /// Apply what the listener reported deleted; `forced`: locked keys may
    /// be among them.
    fn take_deleted(&mut self, step: usize, forced: bool) {
        let gone: Vec<Key> = std::mem::take(&mut *self.deleted.0.lock().unwrap());
        for k in gone {
            let id = (0..KEYS)
                .find(|&i| key(i) == k)
                .unwrap_or_else(|| panic!("step {step}: a key never stored reported deleted"));
            let e = self
                .keys
                .remove(&id)
                .unwrap_or_else(|| panic!("step {step}: key {id} reported deleted twice"));
            assert!(
                forced || e.locks == 0,
                "step {step}: locked key {id} deleted without force"
            );
        }
    }

    fn check(&mut self, step: usize, op: &Op) {
        let all: Vec<Key> = (0..KEYS).map(key).collect();
        let got = self.engine.exists(&all);
        for id in 0..KEYS {
            assert_eq!(
                got[usize::from(id)],
                self.keys.contains_key(&id),
                "step {step} {op:?}: key {id} exists in the engine vs the model {:?}",
                self.keys
            );
        }
        let live: usize = self.live().iter().map(|d| d.live_slots).sum();
        // Exact without leases; with them, a store lease holds a slot and
        // a read lease may hold one its key left (deleted or moved).
        let leased = self.open.len() + self.reads.len();
        assert!(
            (self.keys.len()..=self.keys.len() + leased).contains(&live),
            "step {step} {op:?}: {live} live slots vs {} keys held and {leased} leases {:?}",
            self.keys.len(),
            self.engine.devices()
        );
        if leased == 0 {
            assert_eq!(live, self.keys.len(), "step {step} {op:?}: live slots");
        }
    }

    fn lease(&mut self, step: usize, id: u8, len: u16) {
        let id = id % KEYS;
        let len = 8 + usize::from(len) % (SLOT - 7);
        let version = self.next_version;
        self.next_version += 1;
        let r = self
            .engine
            .lease_store(&[key(id)], &[len])
            .unwrap()
            .pop()
            .unwrap();
        // An open lease on a device a forced remove was asked of may have
        // been canceled (its key free again) or not (the remove stopped
        // before): either answer is right then.
        let leased = self.open.get(&id).map(|o| o.0.device());
        let unsure = leased.is_some_and(|d| self.forced.contains(&d));
        let stored = self.keys.contains_key(&id);
        let present = stored || (leased.is_some() && !unsure);
        match r {
            Ok(EngineLeased::Leased(l)) => {
                assert!(
                    !present,
                    "step {step}: key {id} leased while present: model {:?}, open lease on {:?}, devices {:?}",
                    self.keys.get(&id),
                    self.open.get(&id).map(|o| o.0.device()),
                    self.engine.devices()
                );
                assert_eq!(l.len(), len);
                let bytes = payload(id, version, len);
                // SAFETY: a store lease hands out `len()` writable bytes at
                // `ptr()` until it ends; nothing else touches them.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), l.ptr(), len) };
                if let Some((old, ..)) = self.open.insert(id, (l, version, len)) {
                    // Leased again: the old lease must have been canceled.
                    assert_eq!(
                        old.commit(),
                        Err(LeaseError::Canceled),
                        "step {step}: key {id}"
                    );
                }
            }
            Ok(EngineLeased::AlreadyPresent) => {
                assert!(
                    stored,
                    "step {step}: key {id} answered stored, not stored in the model"
                );
            }
            Err(LeaseError::InFlight) => {
                assert!(
                    !stored && leased.is_some(),
                    "step {step}: key {id} answered in flight with no open lease in the model"
                );
            }
            Err(LeaseError::Full | LeaseError::IndexFull | LeaseError::Busy) => {}
            Err(e) => panic!("step {step}: lease of key {id}: {e}"),
        }
    }

    fn commit(&mut self, step: usize, id: u8, abort: bool) {
        let Some(&id) = self
            .open
            .keys()
            .nth(usize::from(id) % self.open.len().max(1))
        else {
            return;
        };
        let (l, version, len) = self.open.remove(&id).unwrap();
        let dev = l.device();
        if abort {
            l.abort();
            return;
        }
        match l.commit() {
            Ok(()) => {
                let prev = self.keys.insert(
                    id,
                    Entry {
                        version,
                        len,
                        locks: 0,
                    },
                );
                assert!(prev.is_none(), "step {step}: key {id} stored twice");
            }
            Err(LeaseError::Canceled) => {
                assert!(
                    self.forced.contains(&dev),
                    "step {step}: key {id} canceled on a device no forced remove was asked of"
                );
            }
            Err(e) => panic!("step {step}: commit of key {id}: {e}"),
        }
        // A store task's result stands for it (`check` compares `exists`).
    }

    fn read_lease(&mut self, step: usize, id: u8) {
        let id = id % KEYS;
        let r = self.engine.lease_load(&[key(id)]).pop().unwrap();
        match (r, self.keys.get(&id)) {
            (Ok(Some(l)), Some(e)) => {
                let (version, len) = (e.version, e.len);
                assert_eq!(l.len(), len, "step {step}: read lease length of key {id}");
                assert!(
                    read(&l) == payload(id, version, len).as_slice(),
                    "step {step}: read lease of key {id} sees other bytes"
                );
                self.reads.push((id, l, version, len));
            }
            (Ok(None), None) => {}
            (Err(LeaseError::Busy | LeaseError::TooMany { .. }), _) => {}
            (r, e) => panic!("step {step}: read lease of key {id}: {r:?} vs the model {e:?}"),
        }
    }

    fn release(&mut self, step: usize, at: u8) {
        if self.reads.is_empty() {
            return;
        }
        let (id, l, version, len) = self.reads.swap_remove(usize::from(at) % self.reads.len());
        // The slot was kept whatever happened to the key meanwhile.
        assert!(
            read(&l) == payload(id, version, len).as_slice(),
            "step {step}: read lease of key {id} changed under it"
        );
        l.release();
    }

    /// End every lease: commit the store leases (into the model), release
    /// the read leases.
    fn end_leases(&mut self) {
        while !self.open.is_empty() {
            self.commit(usize::MAX, 0, false);
        }
        while !self.reads.is_empty() {
            self.release(usize::MAX, 0);
        }
    }

    fn store(&mut self, step: usize, ids: &[u8], len: u16) {
        let len = 8 + usize::from(len) % (SLOT - 7);
        let version = self.next_version;
        self.next_version += 1;
        let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
        let bufs: Vec<Buf> = ids
            .iter()
            .map(|&i| Buf::from(payload(i, version, len)))
            .collect();
        let id = self
            .engine
            .submit_store(keys.clone(), bufs)
            .unwrap_or_else(|e| panic!("step {step}: store refused: {e}"));
        let r = self
            .engine
            .wait_store(id, WAIT)
            .ready()
            .unwrap_or_else(|| panic!("step {step}: store never completed"));
        let now = self.engine.exists(&keys);
        let mut present = 0;
        for (&i, &there) in ids.iter().zip(&now) {
            match self.keys.entry(i) {
                std::collections::btree_map::Entry::Occupied(_) => {
                    assert!(there, "step {step}: key {i} lost by a store of it");
                }
                std::collections::btree_map::Entry::Vacant(v) if there => {
                    v.insert(Entry {
                        version,
                        len,
                        locks: 0,
                    });
                }
                std::collections::btree_map::Entry::Vacant(_) => {}
            }
            present += usize::from(there);
        }
        assert_eq!(
            r.success,
            present == ids.len(),
            "step {step}: store success {r:?} with {present} of {} keys present",
            ids.len()
        );
        assert_eq!(
            r.bytes_transferred,
            (present * SLOT) as u64,
            "step {step}: bytes_transferred"
        );
    }

    fn lookup(&mut self, step: usize, ids: &[u8]) {
        let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
        let id = self
            .engine
            .submit_lookup_and_lock(keys)
            .unwrap_or_else(|e| panic!("step {step}: lookup refused: {e}"));
        let bm = self
            .engine
            .wait_lookup(id, WAIT)
            .ready()
            .unwrap_or_else(|| panic!("step {step}: lookup never completed"));
        for (j, &i) in ids.iter().enumerate() {
            let e = self.keys.get_mut(&i);
            assert_eq!(bm.test(j), e.is_some(), "step {step}: lookup of key {i}");
            if let Some(e) = e {
                e.locks += 1;
            }
        }
    }

    fn load(&mut self, step: usize, ids: &[u8], short: bool) {
        let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
        // `short`: the first key's buffer is one byte short of its payload.
        let cap = |j: usize, i: u8| match (short && j == 0, self.keys.get(&i)) {
            (true, Some(e)) => e.len - 1,
            _ => SLOT,
        };
        let bufs: Vec<Vec<u8>> = ids
            .iter()
            .enumerate()
            .map(|(j, &i)| vec![0xA5; cap(j, i)])
            .collect();
        let id = self
            .engine
            .submit_load(keys, bufs)
            .unwrap_or_else(|e| panic!("step {step}: load refused: {e}"));
        let r = self
            .engine
            .wait_load(id, WAIT)
            .ready()
            .unwrap_or_else(|| panic!("step {step}: load never completed"));
        for (j, &i) in ids.iter().enumerate() {
            let fits = !(short && j == 0);
            match self.keys.get(&i) {
                Some(e) if fits => {
                    assert!(r.bitmap.test(j), "step {step}: key {i} missed");
                    let got = r.payload(j).unwrap();
                    assert_eq!(got.len(), e.len, "step {step}: key {i} length");
                    assert!(
                        got == payload(i, e.version, e.len).as_slice(),
                        "step {step}: key {i} loaded other bytes than version {}",
                        e.version
                    );
                }
                _ => {
                    assert!(!r.bitmap.test(j), "step {step}: key {i} hit");
                    assert!(
                        r.bufs[j].iter().all(|&b| b == 0xA5),
                        "step {step}: a miss wrote its buffer (key {i})"
                    );
                }
            }
        }
    }

    fn unlock(&mut self, ids: &[u8]) {
        let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
        self.engine.submit_unlock(&keys);
        for i in ids {
            if let Some(e) = self.keys.get_mut(i) {
                e.locks = e.locks.saturating_sub(1);
            }
        }
    }

    fn delete(&mut self, step: usize, ids: &[u8]) {
        let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
        let got: BTreeSet<Key> = self.engine.delete(&keys).into_iter().collect();
        let want: BTreeSet<Key> = ids
            .iter()
            .filter(|i| self.keys.get(i).is_some_and(|e| e.locks == 0))
            .map(|&i| key(i))
            .collect();
        assert_eq!(got, want, "step {step}: keys deleted");
        // The listener heard of the same keys.
        self.take_deleted(step, false);
    }

    fn add(&mut self, step: usize, slots: u8) {
        if self.live().len() >= MAX_DEVICES {
            return;
        }
        self.added += 1;
        let name = format!("memfd:add{}", self.added);
        let slots = 1 + usize::from(slots) % 8;
        // Room to grow as the devices opened with the engine have, so a
        // resize below asks for no more than any device was sized for.
        let r = self.engine.hotplug_add_with_max(
            &name,
            slots * SLOT,
            Some(2 * DEV_SLOTS * SLOT),
            |_, _| Ok(()),
        );
        assert!(r.is_ok(), "step {step}: add {name}: {:?}", r.err());
    }

    fn remove(&mut self, step: usize, dev: u8, mode: u8, force: bool) {
        let live = self.live();
        if live.is_empty() {
            return;
        }
        let d = &live[usize::from(dev) % live.len()];
        let mode =
            [RemoveMode::Drain, RemoveMode::Migrate, RemoveMode::Evict][usize::from(mode % 3)];
        if force && mode != RemoveMode::Drain {
            self.forced.insert(d.id);
        }
        let r = self.engine.remove_device(d.id, mode, force);
        if let Err(e) = &r {
            // A refusal names its reason and carries an HTTP status.
            assert!(
                (400..600).contains(&e.status()) && !e.to_string().is_empty(),
                "step {step}: {e:?}"
            );
        }
        self.take_deleted(step, force);
    }

    fn resize(&mut self, step: usize, dev: u8, slots: u8, evict: bool, force: bool) {
        let live = self.live();
        if live.is_empty() {
            return;
        }
        let d = &live[usize::from(dev) % live.len()];
        let slots = 1 + usize::from(slots) % (2 * DEV_SLOTS);
        let mode = if evict {
            ShrinkMode::Evict
        } else {
            ShrinkMode::Migrate
        };
        let _ = self
            .engine
            .resize_device_to(d.id, slots * SLOT, mode, force, |_, _| Ok(()));
        self.take_deleted(step, force);
    }

    /// Submit `pending` tasks without waiting, close, and collect them:
    /// each must answer (finished, or failed with the close), none hang.
    fn close(self, step: usize, pending: u8) {
        let mut ids = Vec::new();
        for j in 0..usize::from(pending % 6) {
            let i = (j as u8) % KEYS;
            let r = match j % 3 {
                0 => self
                    .engine
                    .submit_store(vec![key(i)], vec![Buf::from(payload(i, 0, 64))])
                    .map_err(|e| e.to_string()),
                1 => self
                    .engine
                    .submit_lookup_and_lock(vec![key(i)])
                    .map_err(|e| e.to_string()),
                _ => self
                    .engine
                    .submit_load(vec![key(i)], vec![vec![0; SLOT]])
                    .map_err(|e| e.to_string()),
            };
            ids.push((j % 3, r.expect("submit before close")));
        }
        self.engine.close();
        for (kind, id) in ids {
            let answered = match kind {
                0 => !matches!(self.engine.wait_store(id, WAIT), Answer::Pending),
                1 => !matches!(self.engine.wait_lookup(id, WAIT), Answer::Pending),
                _ => !matches!(self.engine.wait_load(id, WAIT), Answer::Pending),
            };
            assert!(
                answered,
                "step {step}: a task submitted before close never answered"
            );
        }
        // After close: refused, and refused as closing.
        match self.engine.submit_lookup_and_lock(vec![key(0)]) {
            Err(r) => assert!(matches!(r.error, EngineError::Closing), "step {step}: {r}"),
            Ok(_) => panic!("step {step}: a submit after close was accepted"),
        }
        assert_eq!(self.engine.exists(&[key(0)]), vec![false]);
    }

    /// Unlock and delete everything: no slot, record or lock left.
    fn finish(mut self) {
        self.end_leases();
        self.check(usize::MAX, &Op::Close { pending: 0 });
        let locked: Vec<Key> = self
            .keys
            .iter()
            .flat_map(|(&i, e)| std::iter::repeat_n(key(i), e.locks as usize))
            .collect();
        self.engine.submit_unlock(&locked);
        for e in self.keys.values_mut() {
            e.locks = 0;
        }
        let all: Vec<u8> = (0..KEYS).collect();
        self.delete(usize::MAX, &all);
        assert!(
            self.keys.is_empty(),
            "keys left after deleting all: {:?}",
            self.keys
        );
        for d in self.live() {
            assert_eq!(d.live_slots, 0, "device {} leaked slots: {d:?}", d.path);
        }
        self.engine
            .check_invariants()
            .unwrap_or_else(|e| panic!("invariants at the end: {e}"));
        // Every store result was taken by id: draining the completion
        // rings reports none again, and hands back the records whose
        // completion entries were still queued.
        let again = self.engine.pop_completed_stores();
        assert!(again.is_empty(), "store results reported twice: {again:?}");
        // A record is let go by its worker just after the result is taken:
        // wait (bounded) for the count to come back to zero.
        let deadline = std::time::Instant::now() + WAIT;
        let st = loop {
            let st = self.engine.status();
            if st["task_records_in_use"] == 0 || std::time::Instant::now() > deadline {
                break st;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(
            st["task_records_in_use"],
            0,
            "task records left taken after {}: {st}",
            OPS.with(|o| o.borrow().clone())
        );
        // And the whole table takes submits again.
        let ids: Vec<_> = (0..16)
            .map(|i| {
                self.engine
                    .submit_lookup_and_lock(vec![key(i % KEYS)])
                    .unwrap_or_else(|e| panic!("idle engine refused submit {i}: {e}"))
            })
            .collect();
        for id in ids {
            assert!(self.engine.wait_lookup(id, WAIT).ready().is_some());
        }
        self.engine.close();
    }
}

fn run(ops: &[Op]) {
    OPS.with(|o| *o.borrow_mut() = format!("{ops:?}"));
    let (engine, deleted) = open();
    let mut r = Run {
        open: BTreeMap::new(),
        reads: Vec::new(),
        engine,
        deleted,
        keys: BTreeMap::new(),
        next_version: 1,
        added: 0,
        forced: BTreeSet::new(),
    };
    for (step, op) in ops.iter().enumerate() {
        match *op {
            Op::Store { keys, n, len } => r.store(step, &ids(keys, n), len),
            Op::Lookup { keys, n } => r.lookup(step, &ids(keys, n)),
            Op::Load { keys, n, short } => r.load(step, &ids(keys, n), short),
            Op::Unlock { keys, n } => r.unlock(&ids(keys, n)),
            Op::Delete { keys, n } => r.delete(step, &ids(keys, n)),
            Op::Add { slots } => r.add(step, slots),
            Op::Remove { dev, mode, force } => r.remove(step, dev, mode, force),
            Op::Resize {
                dev,
                slots,
                evict,
                force,
            } => r.resize(step, dev, slots, evict, force),
            // One sequence in several ends with a close.
            Op::Close { pending } if pending >= 224 => return r.close(step, pending),
            Op::Close { .. } => {}
            Op::Lease { key, len } => r.lease(step, key, len),
            Op::Commit { key, abort } => r.commit(step, key, abort),
            Op::ReadLease { key } => r.read_lease(step, key),
            Op::Release { at } => r.release(step, at),
        }
        r.check(step, op);
    }
    if std::env::var_os("ENGINE_MODEL_STATS").is_some() {
        eprintln!(
            "ops {} keys {} devices {}",
            ops.len(),
            r.keys.len(),
            r.live().len()
        );
    }
    r.finish();
}

#[test]
fn engine_model() {
    check!()
        .with_iterations(ITERATIONS)
        .with_max_len(1024)
        .with_generator(bolero::gen::<Vec<Op>>().with().len(0usize..120))
        .for_each(|ops| run(ops));
}
