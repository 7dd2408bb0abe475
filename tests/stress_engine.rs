//! Hunting stress over the whole engine: two memfd devices, two store
//! workers, two load workers, a tiny key set (so the same key meets itself
//! in one task, in back-to-back tasks and across devices), and one device
//! remapped (grown and shrunk) in a loop while everything runs.
//!
//! What it hunts: a thread holding a session on one device while
//! entering another that is being remapped (use after unmap), a store
//! completion dropped when the completion ring fills, a key stored on two
//! devices, slots leaked by racing deletes, and records left taken.
//!
//! Every payload is stamped with its key id and a nonce and carries a
//! checksum, so a load that returns another key's bytes, or torn bytes,
//! fails. At the end: every submitted store was reported exactly once, no
//! key sits on two devices, and after unlocking and deleting everything each
//! device is empty with its invariants intact.
//!
//! `DAXKV_STRESS_SECS` sets the run time (default 3 s); `DAXKV_STRESS_SEED`
//! replays a seed (printed at the start).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceId, DeviceSpec, Engine, EngineOptions, TaskId};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key};

#[path = "common/stress.rs"]
mod common;
use common::{payload, secs, seed, verify, Rng};

const SLOT: usize = 4096;
const SLOTS_PER_DEVICE: usize = 24;
const KEYS: u64 = 40;
const WAIT: Duration = Duration::from_secs(20);

fn key(i: u64) -> Key {
    Key::digest(&i.to_le_bytes())
}

fn device(i: usize, grow: bool) -> DeviceSpec {
    let bytes = SLOTS_PER_DEVICE * SLOT;
    let mut spec = ArenaSpec::memfd(bytes).populate(true);
    if grow {
        spec = spec.max_size_bytes(2 * bytes);
    }
    DeviceSpec {
        path: format!("stress-dev{i}"),
        core: CoreConfig::new(spec, SLOT),
    }
}

/// Store ids submitted but not yet reported, shared by the store threads
/// (the store pop is global, so any thread may collect any id).
#[derive(Default)]
struct Outstanding {
    ids: Mutex<Ledger>,
}

/// Store ids submitted and collected. Any client collects any store
/// (`wait_stores` is global), so a store can be collected by another
/// client before its submitter has written its id down: such an id waits
/// in `early` until the submitter records it.
#[derive(Default)]
struct Ledger {
    /// Submitted, not yet collected.
    pending: HashSet<u64>,
    /// Collected before the submitter recorded it.
    early: HashSet<u64>,
    /// Every id ever collected (to catch one reported twice).
    done: HashSet<u64>,
    reported_twice: u64,
}

impl Outstanding {
    fn submitted(&self, id: TaskId) {
        let mut l = self.ids.lock().unwrap();
        if !l.early.remove(&id.0) {
            assert!(
                l.pending.insert(id.0),
                "task id {} reused while pending",
                id.0
            );
        }
    }
    fn collect(&self, engine: &Engine, timeout: Duration) {
        for (id, _) in engine.wait_stores(timeout) {
            let mut l = self.ids.lock().unwrap();
            if !l.done.insert(id.0) {
                l.reported_twice += 1;
            } else if !l.pending.remove(&id.0) {
                l.early.insert(id.0);
            }
        }
    }
    fn missing(&self) -> usize {
        self.ids.lock().unwrap().pending.len()
    }
}

/// One client thread: random stores (duplicates inside a task on purpose),
/// lookups that lock, loads checked byte for byte, unlocks and deletes.
fn client(engine: &Engine, out: &Outstanding, ops: &AtomicU64, seed: u64, run: Duration) {
    let mut rng = Rng(seed);
    let mut locked: Vec<Key> = Vec::new();
    let deadline = Instant::now() + run;
    while Instant::now() < deadline {
        ops.fetch_add(1, Ordering::Relaxed);
        let n = 1 + rng.below(6) as usize;
        // Duplicates inside one task on purpose.
        let ids: Vec<u64> = (0..n).map(|_| rng.below(KEYS)).collect();
        let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
        match rng.below(10) {
            0..=3 => {
                let bufs: Vec<Buf> = ids
                    .iter()
                    .map(|&i| {
                        let len = 24 + 8 * rng.below((SLOT as u64 - 24) / 8) as usize;
                        Buf::from(payload(i, rng.next(), len))
                    })
                    .collect();
                if let Ok(id) = engine.submit_store(keys, bufs) {
                    out.submitted(id);
                }
                out.collect(engine, Duration::ZERO);
            }
            4 | 5 => {
                let Ok(id) = engine.submit_lookup_and_lock(keys.clone()) else {
                    continue;
                };
                let bm = engine
                    .wait_lookup(id, WAIT)
                    .ready()
                    .expect("lookup never completed");
                for (i, k) in keys.iter().enumerate() {
                    if bm.test(i) {
                        locked.push(*k);
                    }
                }
                if locked.len() > 8 || rng.below(2) == 0 {
                    engine.submit_unlock(&locked);
                    locked.clear();
                }
            }
            6 | 7 => {
                let bufs = vec![vec![0u8; SLOT]; n];
                let Ok(id) = engine.submit_load(keys, bufs) else {
                    continue;
                };
                let r = engine
                    .wait_load(id, WAIT)
                    .ready()
                    .expect("load never completed");
                for (i, b) in r.bufs.iter().enumerate() {
                    if r.bitmap.test(i) {
                        verify(ids[i], b);
                    }
                }
            }
            _ => {
                engine.delete(&keys);
            }
        }
    }
    engine.submit_unlock(&locked);
}

/// After the run: one copy per key in the pool; after deleting everything,
/// every device is empty with its invariants intact, and the task table
/// takes a full load of submits again (no record left taken).
fn check_end(engine: &Engine) {
    // One copy per key in the pool.
    for i in 0..KEYS {
        let on = engine.devices_holding(key(i));
        assert!(on.len() <= 1, "key {i} stored on devices {on:?}");
    }

    // Delete everything: every device must come back empty and consistent,
    // and the task table must take a full load of submits again.
    let all: Vec<Key> = (0..KEYS).map(key).collect();
    engine.delete(&all);
    engine.check_invariants().unwrap_or_else(|e| panic!("{e}"));
    for d in engine.devices() {
        assert_eq!(d.live_slots, 0, "device {} leaked slots", d.id.0);
    }
    let probe: Vec<TaskId> = (0..32)
        .map(|i| {
            engine
                .submit_lookup_and_lock(vec![key(i)])
                .unwrap_or_else(|e| panic!("idle engine refused submit {i}: {e}"))
        })
        .collect();
    for id in probe {
        engine.wait_lookup(id, WAIT).ready().expect("probe lookup");
    }
}

#[test]
fn engine_two_devices_with_remaps_loses_and_corrupts_nothing() {
    let seed = seed();
    let run = Duration::from_secs(secs());
    eprintln!("stress_engine: seed {seed} (DAXKV_STRESS_SEED), {run:?} (DAXKV_STRESS_SECS)");
    let opts = EngineOptions {
        num_store_workers: 2,
        num_lookup_workers: 1,
        num_load_workers: 2,
        task_slots: 32,
        task_keys: 8,
        spin: Duration::from_micros(20),
        wait_spin: Duration::from_micros(20),
        ..EngineOptions::default()
    };
    let engine =
        Arc::new(Engine::open(vec![device(0, false), device(1, true)], SLOT, false, opts).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let out = Arc::new(Outstanding::default());
    let ops = Arc::new(AtomicU64::new(0));
    let remaps = Arc::new(AtomicU64::new(0));

    // The remapper: device 1 grows to twice its size and shrinks back
    // (a shrink that would cut live slots is refused, which is fine).
    let remapper = {
        let (engine, stop, remaps) = (engine.clone(), stop.clone(), remaps.clone());
        std::thread::spawn(move || {
            let base = SLOTS_PER_DEVICE * SLOT;
            let mut big = false;
            while !stop.load(Ordering::Relaxed) {
                let want = if big { base } else { 2 * base };
                if engine.resize_device(DeviceId(1), want).is_ok() {
                    big = !big;
                    remaps.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };

    let clients: Vec<_> = (0..3u64)
        .map(|t| {
            let (engine, out, ops) = (engine.clone(), out.clone(), ops.clone());
            std::thread::spawn(move || {
                client(&engine, &out, &ops, Rng::for_thread(seed, t).0, run);
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    remapper.join().unwrap();

    // Every store submitted is reported, exactly once.
    let drain_deadline = Instant::now() + WAIT;
    while out.missing() > 0 && Instant::now() < drain_deadline {
        out.collect(&engine, Duration::from_millis(50));
    }
    let missing = out.missing();
    assert_eq!(missing, 0, "{missing} store completions never reported");
    let l = out.ids.lock().unwrap();
    assert_eq!(l.reported_twice, 0, "store ids reported twice");
    assert!(
        l.early.is_empty(),
        "{} store ids collected but never submitted",
        l.early.len()
    );
    drop(l);

    check_end(&engine);
    eprintln!(
        "stress_engine: {} ops, {} remaps of device 1",
        ops.load(Ordering::Relaxed),
        remaps.load(Ordering::Relaxed)
    );
    engine.close();
}
