//! # `daxkv soak`: hours of mixed traffic under hotplug, checked key by key
//!
//! A [`Server`] runs in the process (the engine and
//! its real HTTP control plane on 127.0.0.1, a free port). For a bounded
//! time (and at most a bounded number of operations):
//!
//! - **traffic threads**, each with its own [`Submitter`] and its own keys
//!   (never shared, so each thread's model of its keys is exact), store
//!   tasks of 1–16 new keys, look up and lock, load, unlock and delete;
//!   and through slot leases (docs/leases.md): store 1–8 new keys by
//!   lease (filled, committed as a batch; an `Ok` commit acknowledges the
//!   key as a store task's success does) and read keys by read lease.
//!   Every payload (64 bytes to one slot, random length) is stamped with
//!   its thread, its number and its length, and filled from a generator
//!   seeded by them: a load checks every byte.
//! - **a control thread** drives hotplug over HTTP, as an operator or a
//!   supervisor would: add (a `/dev/shm` file made by the server, or a
//!   named memfd), drain, remove with `migrate` or `evict`, forced remove,
//!   resize grow and shrink, and re-add of a removed path.
//!
//! **What counts.** A key is *acknowledged* when its store task succeeded
//! (or its lease committed).
//! It is *reported gone* when a delete, an evicting remove or shrink, or a
//! forced removal told the listeners (`on_keys_deleted`). An acknowledged
//! key that a lookup misses and nothing reported gone is a *suspect*; the
//! soak keeps it (never deletes it) and looks again once hotplug has
//! stopped: found with its bytes, it was a transient miss (counted, not an
//! error); not found and still not reported gone, it is **lost**. Every
//! other acknowledged key is looked at then too (a key dropped without a
//! report is lost whether or not a lookup picked it during the run). A key
//! reported gone while already reported (the soak never stores a key
//! twice) is **reported twice**. A hit with
//! bytes other than the key's own is **corrupted**, whenever it happens. At
//! the end every key is deleted and the engine must hold no live or
//! borrowed slot, no lock and no task; once the server has stopped, the
//! process must have as many threads, fds and device mappings as before it
//! started (**leaked** otherwise). A task that never completes (past
//! [`TASK_TIMEOUT`]) is **stuck**, and an HTTP answer 5xx (but 507, no
//! room for the keys elsewhere: a refusal) is a **control error**; either fails the run.
//!
//! The last line reads
//! `soak: seed=… ops=… bytes_verified=… hotplug_ops=… faults_injected=… lost=0 corrupted=0 leaked=0`.

#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::client::Client;
use super::serve::{ServeConfig, Server};
use crate::control::http::HttpConfig;
use crate::engine::{Answer, Engine, EngineLeased, Listener, Submitter};
use crate::key::Key;
use crate::plumbing::buf::Buf;

/// How long a task may take before the soak calls it stuck: far past any
/// drain (a forced remove finishes in bounded time) on a loaded machine.
pub const TASK_TIMEOUT: Duration = Duration::from_secs(60);

/// What a soak runs.
#[derive(Clone, Debug)]
pub struct SoakConfig {
    /// Stop after this long.
    pub duration: Duration,
    /// Stop after this many operations (tasks and deletes) in all.
    pub max_ops: u64,
    /// Seeds every thread's choices (printed, so a run can be repeated).
    pub seed: u64,
    /// Traffic threads.
    pub threads: usize,
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// Devices at the start (named memfds of `device_bytes` each).
    pub devices: usize,
    /// Bytes of each starting device, and about those of each added one.
    pub device_bytes: usize,
    /// Drive hotplug over HTTP.
    pub hotplug: bool,
    /// Milliseconds between two hotplug operations (at random up to twice
    /// this).
    pub hotplug_every_ms: u64,
    /// Where added device files are made (a tmpfs directory).
    pub shm_dir: std::path::PathBuf,
    /// Inject faults (a build with the `failpoints` feature only): copies
    /// that fail, slow and full devices, devices that fail, worker panics,
    /// eventfd writes that fail.
    pub faults: bool,
    /// Milliseconds between two faults (at random up to twice this).
    pub fault_every_ms: u64,
    /// Set (by `daxkv soak`'s SIGINT / SIGTERM thread) to stop early, as at
    /// the end of `duration`: the threads stop, every key is checked, the
    /// devices and their files are removed and the report covers what ran.
    pub interrupt: Option<Arc<AtomicBool>>,
}

impl Default for SoakConfig {
    fn default() -> Self {
        SoakConfig {
            duration: Duration::from_secs(10),
            max_ops: u64::MAX,
            seed: 1,
            threads: 3,
            slot_bytes: 64 << 10,
            devices: 2,
            device_bytes: 32 << 20,
            hotplug: true,
            hotplug_every_ms: 100,
            shm_dir: "/dev/shm".into(),
            faults: false,
            fault_every_ms: 300,
            interrupt: None,
        }
    }
}

/// What a soak found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SoakReport {
    /// The seed it ran with.
    pub seed: u64,
    /// Operations completed (store, lookup, load and unlock tasks, deletes).
    pub ops: u64,
    /// Payload bytes read back and checked.
    pub bytes_verified: u64,
    /// Keys stored and acknowledged.
    pub keys_acknowledged: u64,
    /// Hotplug operations the server carried out (2xx).
    pub hotplug_ops: u64,
    /// Hotplug operations the server refused (4xx: busy, locked keys; 507:
    /// no room elsewhere): expected under traffic.
    pub hotplug_refused: u64,
    /// Hotplug answers 5xx other than 507, or no answer: each one a defect.
    pub control_errors: Vec<String>,
    /// Faults injected (0 in a build without `failpoints`).
    pub faults_injected: u64,
    /// Keys acknowledged, not reported gone and not found at the end.
    pub lost: u64,
    /// Loads that handed back bytes other than the key's own.
    pub corrupted: u64,
    /// Acknowledged keys that missed while hotplug ran but were found,
    /// with their bytes, once it stopped.
    pub transient_misses: u64,
    /// Keys reported gone by listeners (evictions, forced removals).
    pub reported_gone: u64,
    /// Reports of a key already reported gone (and not stored again: the
    /// soak never stores a key twice): each one a defect ("reported once").
    pub reported_twice: u64,
    /// Loads that found a key reported gone before the load began (never
    /// stored again): the listeners were told of a delete that did not
    /// happen. Each one a defect.
    pub reported_but_held: u64,
    /// Tasks that did not complete within [`TASK_TIMEOUT`].
    pub stuck: u64,
    /// What was left behind (slots, locks, tasks, threads, fds, mappings).
    pub leaked: Vec<String>,
    /// Operations per second, one entry per second of the run.
    pub ops_per_second: Vec<u64>,
    /// Notes on the first few losses and corruptions (key, thread, number).
    pub findings: Vec<String>,
}

impl SoakReport {
    /// No loss, corruption, leak, stuck task or control error.
    pub fn clean(&self) -> bool {
        self.lost == 0
            && self.corrupted == 0
            && self.leaked.is_empty()
            && self.stuck == 0
            && self.control_errors.is_empty()
            && self.reported_twice == 0
            && self.reported_but_held == 0
    }

    /// The median operations per second of the first and of the last
    /// `window` seconds, and their ratio: whether throughput held.
    pub fn held(&self, window: usize) -> Option<(u64, u64, f64)> {
        let s = &self.ops_per_second;
        if window == 0 || s.len() < 2 * window {
            return None;
        }
        let first = median(&s[..window]);
        let last = median(&s[s.len() - window..]);
        Some((first, last, last as f64 / first.max(1) as f64))
    }

    /// The report as JSON (what `--json` writes).
    pub fn json(&self) -> String {
        let held = self.held((self.ops_per_second.len() / 2).min(300));
        serde_json::to_string_pretty(&json!({
            "seed": self.seed,
            "ops": self.ops,
            "bytes_verified": self.bytes_verified,
            "keys_acknowledged": self.keys_acknowledged,
            "hotplug_ops": self.hotplug_ops,
            "hotplug_refused": self.hotplug_refused,
            "control_errors": self.control_errors,
            "faults_injected": self.faults_injected,
            "lost": self.lost,
            "corrupted": self.corrupted,
            "transient_misses": self.transient_misses,
            "reported_gone": self.reported_gone,
            "reported_twice": self.reported_twice,
            "reported_but_held": self.reported_but_held,
            "stuck": self.stuck,
            "leaked": self.leaked,
            "findings": self.findings,
            "ops_per_second": self.ops_per_second,
            "held": held.map(|(first, last, ratio)| json!({"first_median": first, "last_median": last, "ratio": ratio})),
            "clean": self.clean(),
        }))
        .unwrap_or_default()
    }

    /// The closing line.
    pub fn summary(&self) -> String {
        format!(
            "soak: seed={} ops={} bytes_verified={} hotplug_ops={} faults_injected={} lost={} corrupted={} leaked={}",
            self.seed,
            self.ops,
            self.bytes_verified,
            self.hotplug_ops,
            self.faults_injected,
            self.lost,
            self.corrupted,
            self.leaked.len()
        )
    }
}

fn median(v: &[u64]) -> u64 {
    let mut s = v.to_vec();
    s.sort_unstable();
    s[s.len() / 2]
}

/// splitmix64: small, fast, and enough for choosing operations.
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0), close enough for test choices.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The key of a thread's `n`-th object.
fn key_of(thread: u64, n: u64) -> Key {
    let mut b = [0u8; 24];
    b[..8].copy_from_slice(b"daxsoak\0");
    b[8..16].copy_from_slice(&thread.to_le_bytes());
    b[16..].copy_from_slice(&n.to_le_bytes());
    Key::digest(&b)
}

const HEADER: usize = 24;

/// Fill `out` (the payload of `(thread, n)`, `out.len()` bytes): a header
/// of thread, number and length, then bytes seeded by them.
fn stamp(thread: u64, n: u64, out: &mut [u8]) {
    let len = out.len() as u64;
    let mut head = [0u8; HEADER];
    head[..8].copy_from_slice(&thread.to_le_bytes());
    head[8..16].copy_from_slice(&n.to_le_bytes());
    head[16..].copy_from_slice(&len.to_le_bytes());
    let h = HEADER.min(out.len());
    out[..h].copy_from_slice(&head[..h]);
    // The bench's source pattern, seeded by all three.
    let seed = thread.rotate_left(32) ^ n ^ len.rotate_left(17);
    super::bench::fill(&mut out[h..], seed as usize);
}

/// Whether `got` is exactly the payload of `(thread, n)` of `len` bytes.
fn check(thread: u64, n: u64, len: usize, got: &[u8], scratch: &mut Vec<u8>) -> bool {
    if got.len() != len {
        return false;
    }
    scratch.clear();
    scratch.resize(len, 0);
    stamp(thread, n, scratch);
    got == &scratch[..]
}

/// Keys the listeners reported gone (evictions, forced removals, deletes
/// the traffic threads have not yet taken back out).
#[derive(Debug, Default)]
struct Gone {
    keys: Mutex<HashSet<Key>>,
    reported: AtomicU64,
    /// Keys reported while already in `keys`.
    twice: AtomicU64,
}

impl Listener for Gone {
    fn on_keys_deleted(&self, keys: &[Key]) {
        // ORDERING: Relaxed — a counter read after the threads are joined.
        self.reported
            .fetch_add(keys.len() as u64, Ordering::Relaxed);
        let mut g = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        for k in keys {
            if !g.insert(*k) {
                // ORDERING: Relaxed — a counter read after the threads
                // are joined.
                self.twice.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl Gone {
    fn contains(&self, k: &Key) -> bool {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(k)
    }

    fn forget(&self, keys: &[Key]) {
        let mut g = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        for k in keys {
            g.remove(k);
        }
    }
}

/// A key's state in its thread's model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// Its store succeeded: it must load with its bytes until reported gone.
    Acked,
    /// Its store task failed: it may or may not be there, but if it loads
    /// its bytes must be its own.
    Maybe,
    /// Acknowledged, missed, not reported gone: looked at again at the end.
    Suspect,
}

#[derive(Clone, Copy, Debug)]
struct Obj {
    n: u64,
    len: usize,
    held: Held,
}

/// Counters shared by the traffic threads.
#[derive(Debug, Default)]
struct Counts {
    ops: AtomicU64,
    bytes_verified: AtomicU64,
    acked: AtomicU64,
    corrupted: AtomicU64,
    reported_but_held: AtomicU64,
    stuck: AtomicU64,
    findings: Mutex<Vec<String>>,
}

impl Counts {
    fn finding(&self, s: String) {
        let mut f = self.findings.lock().unwrap_or_else(PoisonError::into_inner);
        if f.len() < 20 {
            f.push(s);
        }
    }
}

/// One traffic thread: its keys, its model, its submitter.
struct Traffic {
    id: u64,
    engine: Arc<Engine>,
    sub: Submitter,
    rng: Rng,
    next_n: u64,
    keys: HashMap<Key, Obj>,
    /// Keys in `keys` that are not suspects, for random picks.
    live: Vec<Key>,
    counts: Arc<Counts>,
    gone: Arc<Gone>,
    slot_bytes: usize,
    /// Keep at most this many keys (a share of the smallest pool).
    max_keys: usize,
    scratch: Vec<u8>,
}

impl Traffic {
    fn op(&mut self) {
        let r = self.rng.below(100);
        if self.live.len() >= self.max_keys || ((45..55).contains(&r) && !self.live.is_empty()) {
            self.delete_some();
        } else if r < 35 || self.live.is_empty() {
            self.store_some();
        } else if r < 45 {
            self.lease_some();
        } else if r < 63 {
            self.read_lease_some();
        } else {
            self.load_some();
        }
    }

    /// Store 1–8 new keys through slot leases (docs/leases.md): each
    /// filled from host memory, committed as a batch; a key whose commit
    /// answered `Ok` is acknowledged, as after a store task's success. A
    /// lease refused or canceled (a forced remove of its device) stores
    /// nothing.
    fn lease_some(&mut self) {
        let batch = 1 + self.rng.below(8) as usize;
        let mut keys = Vec::with_capacity(batch);
        let mut lens = Vec::with_capacity(batch);
        let mut objs = Vec::with_capacity(batch);
        for _ in 0..batch {
            let n = self.next_n;
            self.next_n += 1;
            let len = 64 + self.rng.below((self.slot_bytes - 64 + 1) as u64) as usize;
            keys.push(key_of(self.id, n));
            lens.push(len);
            objs.push(Obj {
                n,
                len,
                held: Held::Maybe,
            });
        }
        let Ok(given) = self.engine.lease_store(&keys, &lens) else {
            return;
        };
        let mut leases = Vec::with_capacity(batch);
        let mut leased = Vec::with_capacity(batch);
        for ((r, k), o) in given.into_iter().zip(&keys).zip(&objs) {
            let Ok(EngineLeased::Leased(mut l)) = r else {
                continue;
            };
            let mut b = vec![0u8; o.len];
            stamp(self.id, o.n, &mut b);
            // A failed device fails the copy: the commit then fails too.
            let _ = l.write(0, &b);
            leases.push(l);
            leased.push((*k, *o));
        }
        let mut answers = Vec::with_capacity(leases.len());
        self.engine.commit_into(&mut leases, &mut answers);
        self.count(1);
        for ((k, mut o), r) in leased.into_iter().zip(answers) {
            if r.is_ok() {
                o.held = Held::Acked;
                // ORDERING: Relaxed — a counter.
                self.counts.acked.fetch_add(1, Ordering::Relaxed);
                self.keys.insert(k, o);
                self.live.push(k);
            }
        }
    }

    /// Read 1–16 of this thread's keys through read leases, checking every
    /// byte, then release them. A miss counts as a lookup's would.
    fn read_lease_some(&mut self) {
        let keys = self.pick(16);
        let was_gone: Vec<bool> = keys.iter().map(|k| self.gone.contains(k)).collect();
        let got = self.engine.lease_load(&keys);
        self.count(1);
        let mut buf = vec![0u8; self.slot_bytes];
        for ((k, r), gone) in keys.iter().zip(got).zip(was_gone) {
            match r {
                Ok(Some(l)) => {
                    if gone {
                        self.held_after_report(k);
                    }
                    // A device failed under the read gives no bytes.
                    if let Ok(n) = l.read(0, &mut buf) {
                        self.verify(k, &buf[..n]);
                    }
                }
                Ok(None) => self.missed(*k),
                // Busy (a remap pending), TooMany: no answer either way.
                Err(_) => {}
            }
        }
    }

    fn count(&self, n: u64) {
        // ORDERING: Relaxed — statistics.
        self.counts.ops.fetch_add(n, Ordering::Relaxed);
    }

    fn store_some(&mut self) {
        let batch = 1 + self.rng.below(16) as usize;
        let mut keys = Vec::with_capacity(batch);
        let mut bufs = Vec::with_capacity(batch);
        let mut objs = Vec::with_capacity(batch);
        for _ in 0..batch {
            let n = self.next_n;
            self.next_n += 1;
            let len = 64 + self.rng.below((self.slot_bytes - 64 + 1) as u64) as usize;
            let mut b = vec![0u8; len];
            stamp(self.id, n, &mut b);
            keys.push(key_of(self.id, n));
            bufs.push(Buf::from(b));
            objs.push(Obj {
                n,
                len,
                held: Held::Maybe,
            });
        }
        // Refused (closing, table full): nothing was stored.
        let Ok(id) = self.sub.submit_store(keys.clone(), bufs) else {
            return;
        };
        let ok = match self.engine.wait_store(id, TASK_TIMEOUT) {
            Answer::Ready(r) => r.success,
            Answer::Pending => {
                // ORDERING: Relaxed — a counter.
                self.counts.stuck.fetch_add(1, Ordering::Relaxed);
                self.counts
                    .finding(format!("store task {id:?} of thread {} stuck", self.id));
                false
            }
            _ => false,
        };
        self.count(1);
        for (k, mut o) in keys.into_iter().zip(objs) {
            if ok {
                o.held = Held::Acked;
                // ORDERING: Relaxed — a counter.
                self.counts.acked.fetch_add(1, Ordering::Relaxed);
            }
            self.keys.insert(k, o);
            self.live.push(k);
        }
    }

    fn pick(&mut self, most: usize) -> Vec<Key> {
        let want = 1 + self.rng.below(most as u64) as usize;
        let mut out = Vec::with_capacity(want);
        for _ in 0..want.min(self.live.len()) {
            let k = self.live[self.rng.below(self.live.len() as u64) as usize];
            if !out.contains(&k) {
                out.push(k);
            }
        }
        out
    }

    fn forget(&mut self, k: &Key) {
        self.keys.remove(k);
        if let Some(p) = self.live.iter().position(|x| x == k) {
            self.live.swap_remove(p);
        }
    }

    /// A miss of `k`: expected for a `Maybe` key; for an acknowledged one,
    /// expected only if a listener reported it gone; else a suspect.
    fn missed(&mut self, k: Key) {
        let Some(o) = self.keys.get_mut(&k) else {
            return;
        };
        if o.held == Held::Acked {
            if self.gone.contains(&k) {
                self.gone.forget(&[k]);
                self.forget(&k);
            } else {
                o.held = Held::Suspect;
                if let Some(p) = self.live.iter().position(|x| *x == k) {
                    self.live.swap_remove(p);
                }
            }
        }
    }

    fn verify(&mut self, k: &Key, got: &[u8]) {
        let Some(o) = self.keys.get(k).copied() else {
            return;
        };
        if check(self.id, o.n, o.len, got, &mut self.scratch) {
            // ORDERING: Relaxed — a counter.
            self.counts
                .bytes_verified
                .fetch_add(got.len() as u64, Ordering::Relaxed);
            if o.held == Held::Maybe {
                // Found after a failed store task: it is there now.
                if let Some(x) = self.keys.get_mut(k) {
                    x.held = Held::Acked;
                }
            }
        } else {
            // ORDERING: Relaxed — a counter.
            self.counts.corrupted.fetch_add(1, Ordering::Relaxed);
            let head: Vec<u8> = got.iter().take(HEADER).copied().collect();
            self.counts.finding(format!(
                "corrupted: thread {} object {} ({} bytes) read {} bytes starting {head:02x?}",
                self.id,
                o.n,
                o.len,
                got.len()
            ));
        }
    }

    fn load_some(&mut self) {
        let keys = self.pick(16);
        // Reported gone before the lookup began: a hit on one of them is a
        // report of a delete that did not happen (keys are never stored
        // twice). Taken before the submit, so a report racing the load
        // is not one.
        let was_gone: Vec<bool> = keys.iter().map(|k| self.gone.contains(k)).collect();
        let Ok(id) = self.sub.submit_lookup_and_lock(keys.clone()) else {
            return;
        };
        let found = match self.engine.wait_lookup(id, TASK_TIMEOUT) {
            Answer::Ready(b) => b,
            Answer::Pending => {
                // ORDERING: Relaxed — a counter.
                self.counts.stuck.fetch_add(1, Ordering::Relaxed);
                self.counts
                    .finding(format!("lookup task {id:?} of thread {} stuck", self.id));
                return;
            }
            _ => return,
        };
        self.count(1);
        let mut hits = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            if found.test(i) {
                hits.push(*k);
            } else {
                self.missed(*k);
            }
        }
        if hits.is_empty() {
            return;
        }
        let bufs = vec![vec![0u8; self.slot_bytes]; hits.len()];
        if let Ok(id) = self.sub.submit_load(hits.clone(), bufs) {
            match self.engine.wait_load(id, TASK_TIMEOUT) {
                Answer::Ready(r) => {
                    self.count(1);
                    for (i, k) in hits.iter().enumerate() {
                        match r.payload(i) {
                            Some(p) => {
                                if keys.iter().zip(&was_gone).any(|(x, g)| x == k && *g) {
                                    self.held_after_report(k);
                                }
                                self.verify(k, p);
                            }
                            None => self.missed(*k),
                        }
                    }
                }
                Answer::Pending => {
                    // ORDERING: Relaxed — a counter.
                    self.counts.stuck.fetch_add(1, Ordering::Relaxed);
                    self.counts
                        .finding(format!("load task {id:?} of thread {} stuck", self.id));
                }
                _ => {}
            }
        }
        self.engine.submit_unlock(&hits);
        self.count(1);
    }

    fn held_after_report(&mut self, k: &Key) {
        // ORDERING: Relaxed — a counter.
        self.counts
            .reported_but_held
            .fetch_add(1, Ordering::Relaxed);
        let n = self.keys.get(k).map_or(0, |o| o.n);
        self.counts.finding(format!(
            "reported gone but still held: thread {} object {n}",
            self.id
        ));
    }

    fn delete_some(&mut self) {
        let keys = self.pick(16);
        let _ = self.engine.delete(&keys);
        self.count(1);
        // Our own deletes were reported too: take them back out of the set.
        self.gone.forget(&keys);
        for k in &keys {
            self.forget(k);
        }
    }

    /// After hotplug has stopped: look at every acknowledged key (the
    /// suspects again, and every key no lookup happened to pick during the
    /// run: a key dropped unreported is lost whether or not traffic looked
    /// at it), then delete every key. Returns (lost, transient misses).
    fn finish(&mut self) -> (u64, u64) {
        let suspects: Vec<Key> = self
            .keys
            .iter()
            .filter(|(_, o)| o.held != Held::Maybe)
            .map(|(k, _)| *k)
            .collect();
        let (mut lost, mut transient) = (0, 0);
        for chunk in suspects.chunks(16) {
            let bufs = vec![vec![0u8; self.slot_bytes]; chunk.len()];
            let got = self
                .sub
                .submit_load(chunk.to_vec(), bufs)
                .ok()
                .and_then(|id| self.engine.wait_load(id, TASK_TIMEOUT).ready());
            for (i, k) in chunk.iter().enumerate() {
                match got.as_ref().and_then(|r| r.payload(i)) {
                    Some(p) => {
                        if self.keys.get(k).is_some_and(|o| o.held == Held::Suspect) {
                            transient += 1;
                        }
                        self.verify(k, p);
                    }
                    None if self.gone.contains(k) => {}
                    None => {
                        lost += 1;
                        let n = self.keys.get(k).map_or(0, |o| o.n);
                        self.counts.finding(format!(
                            "lost: thread {} object {n}, acknowledged, never reported gone",
                            self.id
                        ));
                    }
                }
            }
        }
        let all: Vec<Key> = self.keys.keys().copied().collect();
        for chunk in all.chunks(64) {
            let _ = self.engine.delete(chunk);
            self.gone.forget(chunk);
        }
        self.keys.clear();
        self.live.clear();
        (lost, transient)
    }
}

/// The control thread's view of one device.
#[derive(Clone, Debug)]
struct Dev {
    path: String,
    index: u64,
    state: String,
    bytes: u64,
    max_bytes: u64,
    live: u64,
}

fn devices(client: &Client) -> Result<Vec<Dev>, String> {
    let (code, body) = client
        .request("GET", "/reconfigure/dax/l2/status", None)
        .map_err(|e| e.to_string())?;
    if code != 200 {
        return Err(format!("status answered {code}: {body}"));
    }
    let v: Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
    let list = v["adapters"][0]["status"]["devices"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    Ok(list
        .iter()
        .filter_map(|d| {
            Some(Dev {
                path: d["device_path"].as_str()?.to_string(),
                index: d["index"].as_u64()?,
                state: d["state"].as_str().unwrap_or("").to_string(),
                bytes: d["max_dax_size_bytes"].as_u64().unwrap_or(0),
                max_bytes: d["max_slots"].as_u64().unwrap_or(0)
                    * d["slot_bytes"].as_u64().unwrap_or(0),
                live: d["live_slot_count"].as_u64().unwrap_or(0),
            })
        })
        .collect())
}

/// What the control thread did.
#[derive(Debug, Default)]
struct ControlCounts {
    ok: u64,
    refused: u64,
    errors: Vec<String>,
    made: Vec<std::path::PathBuf>,
}

/// A failed device (a fault, or a file cut short) serves nothing until it
/// is removed: the operator's first job. Whether there was one.
fn remove_failed(client: &Client, devs: &[Dev], out: &mut ControlCounts) -> bool {
    let Some(d) = devs.iter().find(|d| d.state == "failed") else {
        return false;
    };
    let body = json!({"device_index": d.index, "mode": "evict"});
    match client.request("POST", "/reconfigure/dax/l2/remove", Some(&body)) {
        Ok((code, _)) if (200..300).contains(&code) => out.ok += 1,
        Ok((code, text)) => out.errors.push(format!(
            "remove of failed device {body} answered {code}: {text}"
        )),
        Err(e) => out
            .errors
            .push(format!("remove of failed device {body}: {e}")),
    }
    true
}

/// Raises a stop flag when dropped (by an unwinding panic too).
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        // ORDERING: Relaxed — a stop flag the threads poll.
        self.0.store(true, Ordering::Relaxed);
    }
}

/// How many removed paths the control thread keeps for re-adding. The
/// files it made that neither a device (not a tombstone) nor this pool
/// holds are deleted: a `/dev/shm` file holds the memory its device's
/// stores touched, and keeping every removed one (and every one whose
/// re-add was refused) filled the machine's memory over a long run (one
/// killed after 5 minutes had left 4 GB there; a 30-minute run slowed to
/// 0.65x).
const READD_POOL: usize = 8;

/// Drive hotplug until `stop`: one operation every `every` (at random up
/// to twice that), chosen by `rng` among what the devices allow.
#[allow(clippy::too_many_lines)] // one loop: look, choose an operation, send it, count the answer
fn control(
    client: &Client,
    cfg: &SoakConfig,
    mut rng: Rng,
    stop: &AtomicBool,
    out: &mut ControlCounts,
) {
    let tag = format!("daxkv-soak-{}-{}", std::process::id(), cfg.seed);
    let mut removed: Vec<String> = Vec::new();
    // The device files this thread made that still exist.
    let mut files: Vec<String> = Vec::new();
    let mut added = 0u64;
    let slot = cfg.slot_bytes as u64;
    // ORDERING: Relaxed — a stop flag polled between operations.
    while !stop.load(Ordering::Relaxed) {
        let nap = cfg.hotplug_every_ms + rng.below(cfg.hotplug_every_ms.max(1) + 1);
        std::thread::sleep(Duration::from_millis(nap));
        let devs = match devices(client) {
            Ok(d) => d,
            Err(e) => {
                out.errors.push(format!("status: {e}"));
                continue;
            }
        };
        // Files that no device and no re-add can use any more.
        files.retain(|f| {
            let keep = removed.contains(f)
                || devs
                    .iter()
                    .any(|d| &d.path == f && d.state != "removed" && d.state != "closed");
            if !keep {
                let _ = std::fs::remove_file(f);
            }
            keep
        });
        if remove_failed(client, &devs, out) {
            continue;
        }
        let active: Vec<&Dev> = devs.iter().filter(|d| d.state == "active").collect();
        let open: Vec<&Dev> = devs
            .iter()
            .filter(|d| d.state == "active" || d.state == "draining")
            .collect();
        // Half the time the fullest device, so removes and shrinks move
        // keys; else any.
        let pick = |rng: &mut Rng, v: &[&Dev]| {
            if rng.below(2) == 0 {
                v.iter().max_by_key(|d| d.live).map(|d| (*d).clone())
            } else {
                Some(v[rng.below(v.len() as u64) as usize].clone())
            }
            .unwrap_or_else(|| v[0].clone())
        };
        let choice = rng.below(100);
        let (op, body) = if open.len() < 2 || (choice < 20 && open.len() < 5) {
            // Add: a re-add of a removed path, a new file, or a named memfd.
            let size = cfg.device_bytes as u64 / 2 + rng.below(cfg.device_bytes as u64);
            let size = size / slot * slot;
            let path = if !removed.is_empty() && rng.below(2) == 0 {
                removed.swap_remove(rng.below(removed.len() as u64) as usize)
            } else if rng.below(3) == 0 {
                added += 1;
                format!("memfd:{tag}-{added}")
            } else {
                added += 1;
                let p = cfg.shm_dir.join(format!("{tag}-{added}"));
                out.made.push(p.clone());
                let p = p.to_string_lossy().into_owned();
                files.push(p.clone());
                p
            };
            let create = !path.starts_with("memfd");
            let mut body = json!({"device_path": path, "size": size, "max_size": 2 * size});
            if create {
                body["create"] = json!(true);
            }
            ("add", body)
        } else if choice < 35 && !active.is_empty() {
            let d = pick(&mut rng, &active);
            ("remove", json!({"device_index": d.index, "mode": "drain"}))
        } else if choice < 55 {
            let d = pick(&mut rng, &open);
            let mode = if rng.below(2) == 0 {
                "migrate"
            } else {
                "evict"
            };
            // Traffic nearly always holds a lock somewhere: half the removes
            // are forced, or most would be refused.
            let force = rng.below(2) == 0;
            if !removed.contains(&d.path) {
                removed.push(d.path.clone());
            }
            if removed.len() > READD_POOL {
                removed.remove(0);
            }
            (
                "remove",
                json!({"device_index": d.index, "mode": mode, "force": force}),
            )
        } else if !active.is_empty() {
            let d = pick(&mut rng, &active);
            let grow = rng.below(2) == 0 && d.max_bytes > d.bytes;
            let size = if grow {
                d.bytes + slot * (1 + rng.below((d.max_bytes - d.bytes) / slot))
            } else {
                (d.bytes / 2 + rng.below(d.bytes / 2 + 1)).max(slot)
            };
            let size = (size / slot).max(1) * slot;
            let mode = if rng.below(3) == 0 {
                "evict"
            } else {
                "migrate"
            };
            let force = rng.below(2) == 0;
            (
                "resize",
                json!({"device_index": d.index, "size": size, "mode": mode, "force": force}),
            )
        } else {
            continue;
        };
        match client.request("POST", &format!("/reconfigure/dax/l2/{op}"), Some(&body)) {
            Ok((code, _)) if (200..300).contains(&code) => out.ok += 1,
            // 4xx, and 507 (no other device has room for the keys): a
            // refusal that leaves everything as it was.
            Ok((code, _)) if (400..500).contains(&code) || code == 507 => out.refused += 1,
            Ok((code, text)) => out
                .errors
                .push(format!("{op} {body} answered {code}: {text}")),
            Err(e) => out.errors.push(format!("{op} {body}: {e}")),
        }
    }
}

/// Inject faults until `stop`, one every `every` (at random up to twice
/// that), each lasting up to `every`, and take them all back at the end.
/// Returns how many were injected.
#[cfg(feature = "failpoints")]
fn faults(engine: &Engine, cfg: &SoakConfig, mut rng: Rng, stop: &AtomicBool) -> u64 {
    use crate::engine::DeviceFaults;
    let mut injected = 0;
    let devices = |engine: &Engine| -> Vec<DeviceFaults> {
        (0..engine.status()["devices"].as_array().map_or(0, Vec::len))
            .filter_map(|i| engine.find_device_at(i).ok())
            .filter_map(|id| engine.device_faults(id))
            .collect()
    };
    let mut on: Vec<DeviceFaults> = Vec::new();
    // ORDERING: Relaxed — a stop flag polled between faults.
    while !stop.load(Ordering::Relaxed) {
        let every = cfg.fault_every_ms.max(1);
        std::thread::sleep(Duration::from_millis(every + rng.below(every + 1)));
        for d in on.drain(..) {
            d.copy_faults(0);
            d.copy_delay(Duration::ZERO);
            d.full(false);
        }
        let devs = devices(engine);
        if devs.is_empty() {
            continue;
        }
        let d = devs[rng.below(devs.len() as u64) as usize].clone();
        match rng.below(100) {
            0..=29 => d.copy_faults(2 + rng.below(6) as u32),
            30..=49 => d.copy_delay(Duration::from_micros(100 + rng.below(2000))),
            50..=69 => d.full(true),
            // A device fails: rarely, and never the last one standing.
            70..=74 if devs.len() > 1 => {
                let _ = engine.inject_device_failure(d.id());
            }
            70..=84 => engine.inject_worker_panics(1 + rng.below(3) as u32),
            _ => engine.inject_eventfd_write_failures(1 + rng.below(4) as u32),
        }
        injected += 1;
        on.push(d);
    }
    for d in on {
        d.copy_faults(0);
        d.copy_delay(Duration::ZERO);
        d.full(false);
    }
    engine.inject_worker_panics(0);
    engine.inject_eventfd_write_failures(0);
    injected
}

/// What the process holds that a stopped server must give back.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Footprint {
    threads: usize,
    fds: usize,
    /// Device mappings (memfds and files of this soak).
    maps: usize,
}

/// What the process holds that the server could have left behind: its
/// threads are all named `daxkv…` (workers, the control plane and its
/// blocking pool; an unnamed thread one of them starts inherits the name),
/// so threads the host starts meanwhile (a test harness starting its next
/// test) are not counted; nor are pipes (a child process's), which the
/// server never opens.
fn footprint(tag: &str) -> Footprint {
    let entries = |dir: &str| -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default()
    };
    let threads = entries("/proc/self/task")
        .iter()
        .filter(|t| std::fs::read_to_string(t.join("comm")).is_ok_and(|c| c.starts_with("daxkv")))
        .count();
    let fds = entries("/proc/self/fd")
        .iter()
        .filter(|f| std::fs::read_link(f).is_ok_and(|l| !l.to_string_lossy().starts_with("pipe:")))
        .count();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    Footprint {
        threads,
        fds,
        maps: maps
            .lines()
            .filter(|l| l.contains(tag) || l.contains("/memfd:"))
            .count(),
    }
}

/// The engine's own count of what is still held, as leak lines.
fn engine_leaks(engine: &Engine) -> Vec<String> {
    let s = engine.status();
    let mut out = Vec::new();
    for field in [
        "live_slot_count",
        "borrowed_slot_count",
        "locked_key_count",
        "inflight_store_tasks",
        "inflight_lookup_tasks",
        "inflight_load_tasks",
    ] {
        let n = s[field].as_u64().unwrap_or(0);
        if n != 0 {
            out.push(format!("{field}={n} after every key was deleted"));
        }
    }
    out
}

/// Run a soak; `progress` gets a line every ten seconds.
#[allow(clippy::too_many_lines)] // setup, the threads, the checks at the end, in order
pub fn run(cfg: &SoakConfig, progress: &mut dyn FnMut(&str)) -> Result<SoakReport, String> {
    if cfg.threads == 0 || cfg.devices == 0 {
        return Err("--threads and --devices must be at least 1".into());
    }
    if cfg.slot_bytes < 4096 || cfg.device_bytes < 4 * cfg.slot_bytes {
        return Err(format!(
            "--slot-bytes must be at least 4096 and --device-bytes at least 4 slots (got {} and {})",
            cfg.slot_bytes, cfg.device_bytes
        ));
    }
    if cfg.faults && !cfg!(feature = "failpoints") {
        return Err("faults: fault injection is compiled out of this build (rebuild with `--features failpoints`)".into());
    }
    let tag = format!("daxkv-soak-{}-{}", std::process::id(), cfg.seed);
    let before = footprint(&tag);
    let mut report = SoakReport {
        seed: cfg.seed,
        ..SoakReport::default()
    };
    // The engine config, written where the server reads it.
    let devs: Vec<Value> = (0..cfg.devices)
        .map(|i| {
            json!({"device_path": format!("memfd:{tag}-start{i}"),
                   "max_dax_size_gb": cfg.device_bytes as f64 / (1u64 << 30) as f64,
                   "max_size_gb": 2.0 * cfg.device_bytes as f64 / (1u64 << 30) as f64})
        })
        .collect();
    let conf = json!({"type": "dax", "slot_bytes": cfg.slot_bytes, "devices": devs,
                      "hotplug_enabled": true});
    let conf_path = std::env::temp_dir().join(format!("{tag}.json"));
    std::fs::write(&conf_path, conf.to_string())
        .map_err(|e| format!("{}: {e}", conf_path.display()))?;
    let started = Server::start(&ServeConfig {
        config: Some(conf_path.clone()),
        http: HttpConfig::default(),
        traffic: false,
    });
    let _ = std::fs::remove_file(&conf_path);
    let server = started.map_err(|e| e.to_string())?;
    let engine = server.engine().clone();
    let gone = Arc::new(Gone::default());
    let listener: Arc<dyn Listener> = gone.clone();
    engine.register_listener(&listener);
    let addr = server.addr().ok_or("the control plane has no address")?;
    let client = Client::new(&addr.to_string(), None, Duration::from_secs(120))
        .map_err(|e| e.to_string())?;

    let counts = Arc::new(Counts::default());
    let stop = Arc::new(AtomicBool::new(false));
    let total_slots = cfg.devices * (cfg.device_bytes / cfg.slot_bytes);
    // A third of the starting pool, shared: room for migrations to land.
    let max_keys = (total_slots / 3 / cfg.threads).max(16);
    let t0 = Instant::now();
    let mut ctl = ControlCounts::default();
    #[cfg_attr(not(feature = "failpoints"), allow(unused_mut))]
    let mut faults_injected = 0;
    let (lost, transient) = std::thread::scope(|s| {
        // A panic on this thread (a progress line to a closed pipe, say)
        // must stop the threads, or the scope would join them for ever.
        let _stop_on_unwind = StopOnDrop(&stop);
        let mut workers = Vec::new();
        for t in 0..cfg.threads as u64 {
            let sub = engine.submitter().map_err(|e| e.to_string())?;
            let mut tr = Traffic {
                id: t,
                engine: engine.clone(),
                sub,
                rng: Rng(cfg.seed ^ (t + 1).wrapping_mul(0x2545_F491_4F6C_DD1D)),
                next_n: 0,
                keys: HashMap::new(),
                live: Vec::new(),
                counts: counts.clone(),
                gone: gone.clone(),
                slot_bytes: cfg.slot_bytes,
                max_keys,
                scratch: Vec::new(),
            };
            let (stop, counts) = (stop.clone(), counts.clone());
            let max_ops = cfg.max_ops;
            workers.push(s.spawn(move || {
                // ORDERING: Relaxed — stop flag and op budget: advisory.
                while !stop.load(Ordering::Relaxed) && counts.ops.load(Ordering::Relaxed) < max_ops
                {
                    tr.op();
                }
                tr
            }));
        }
        let ctl_thread = cfg.hotplug.then(|| {
            let (client, stop, ctl) = (&client, &stop, &mut ctl);
            let rng = Rng(cfg.seed ^ 0xC0_17_20_11);
            s.spawn(move || control(client, cfg, rng, stop, ctl))
        });
        #[cfg(feature = "failpoints")]
        let fault_thread = cfg.faults.then(|| {
            let (engine, stop) = (&engine, &stop);
            let rng = Rng(cfg.seed ^ 0xFA_17_5E_ED);
            s.spawn(move || faults(engine, cfg, rng, stop))
        });
        // The clock: one ops/s sample a second, a progress line every ten.
        let mut last = 0;
        let mut tick = t0;
        while t0.elapsed() < cfg.duration
            // ORDERING: Relaxed — statistics.
            && counts.ops.load(Ordering::Relaxed) < cfg.max_ops
            && !workers.iter().any(std::thread::ScopedJoinHandle::is_finished)
            // ORDERING: Relaxed — a stop flag polled every 50 ms.
            && !cfg.interrupt.as_ref().is_some_and(|f| f.load(Ordering::Relaxed))
        {
            std::thread::sleep(Duration::from_millis(50));
            if tick.elapsed() >= Duration::from_secs(1) {
                tick += Duration::from_secs(1);
                // ORDERING: Relaxed — statistics.
                let now = counts.ops.load(Ordering::Relaxed);
                report.ops_per_second.push(now - last);
                last = now;
                if report.ops_per_second.len().is_multiple_of(10) {
                    progress(&format!(
                        "soak: {}s ops={now} ({}/s) acked={} corrupted={} gone={}",
                        report.ops_per_second.len(),
                        report.ops_per_second.last().copied().unwrap_or(0),
                        // ORDERING: Relaxed — statistics.
                        counts.acked.load(Ordering::Relaxed),
                        counts.corrupted.load(Ordering::Relaxed),
                        gone.reported.load(Ordering::Relaxed),
                    ));
                }
            }
        }
        // ORDERING: Relaxed — the joins order the rest.
        stop.store(true, Ordering::Relaxed);
        if let Some(c) = ctl_thread {
            let _ = c.join();
        }
        #[cfg(feature = "failpoints")]
        if let Some(f) = fault_thread {
            faults_injected = f.join().unwrap_or(0);
        }
        let mut traffic: Vec<Traffic> = workers.into_iter().filter_map(|w| w.join().ok()).collect();
        if traffic.len() != cfg.threads {
            return Err("a traffic thread panicked".to_string());
        }
        let (mut lost, mut transient) = (0, 0);
        for t in &mut traffic {
            let (l, tr) = t.finish();
            lost += l;
            transient += tr;
        }
        Ok((lost, transient))
    })?;
    report.lost = lost;
    report.transient_misses = transient;
    report.faults_injected = faults_injected;
    // ORDERING: Relaxed — every thread is joined.
    report.ops = counts.ops.load(Ordering::Relaxed);
    report.bytes_verified = counts.bytes_verified.load(Ordering::Relaxed);
    report.keys_acknowledged = counts.acked.load(Ordering::Relaxed);
    report.corrupted = counts.corrupted.load(Ordering::Relaxed);
    report.stuck = counts.stuck.load(Ordering::Relaxed);
    report.reported_gone = gone.reported.load(Ordering::Relaxed);
    report.reported_twice = gone.twice.load(Ordering::Relaxed);
    report.reported_but_held = counts.reported_but_held.load(Ordering::Relaxed);
    report.hotplug_ops = ctl.ok;
    report.hotplug_refused = ctl.refused;
    report.control_errors = ctl.errors;
    report.findings = std::mem::take(
        &mut *counts
            .findings
            .lock()
            .unwrap_or_else(PoisonError::into_inner),
    );
    report.leaked = engine_leaks(&engine);
    drop(engine);
    drop(listener);
    server.stop();
    for p in &ctl.made {
        let _ = std::fs::remove_file(p);
    }
    let after = footprint(&tag);
    if after != before {
        report.leaked.push(format!(
            "the process held threads/fds/device mappings {}/{}/{} before the server started and {}/{}/{} after it stopped",
            before.threads, before.fds, before.maps, after.threads, after.fds, after.maps
        ));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_checks_only_its_own_key_and_length() {
        let mut s = Vec::new();
        for len in [1, 23, 24, 25, 64, 4097] {
            let mut b = vec![0u8; len];
            stamp(3, 7, &mut b);
            assert!(check(3, 7, len, &b, &mut s), "len {len}");
            if len < 16 {
                // Too short to hold the number (the soak stores 64 bytes
                // or more).
                continue;
            }
            assert!(!check(3, 8, len, &b, &mut s), "another number, len {len}");
            assert!(!check(4, 7, len, &b, &mut s), "another thread, len {len}");
            if len > 1 {
                assert!(!check(3, 7, len, &b[..len - 1], &mut s));
                let mut c = b.clone();
                c[len - 1] ^= 1;
                assert!(!check(3, 7, len, &c, &mut s), "last byte, len {len}");
            }
        }
    }

    /// An engine on one memfd of 64 slots of 4 KiB, and one traffic thread
    /// over it whose `Gone` set the engine does not know of.
    fn one_traffic_thread() -> (Arc<Engine>, Traffic) {
        use crate::device::arena::ArenaSpec;
        use crate::device::core::CoreConfig;
        use crate::engine::{DeviceSpec, EngineOptions};
        const SLOT: usize = 4096;
        let dev = DeviceSpec {
            path: "memfd".into(),
            core: CoreConfig::new(ArenaSpec::memfd(64 * SLOT), SLOT),
        };
        let engine =
            Arc::new(Engine::open(vec![dev], SLOT, false, EngineOptions::default()).unwrap());
        let tr = Traffic {
            id: 0,
            engine: engine.clone(),
            sub: engine.submitter().unwrap(),
            rng: Rng(3),
            next_n: 0,
            keys: HashMap::new(),
            live: Vec::new(),
            counts: Arc::new(Counts::default()),
            gone: Arc::new(Gone::default()),
            slot_bytes: SLOT,
            max_keys: 32,
            scratch: Vec::new(),
        };
        (engine, tr)
    }

    /// An acknowledged key that vanishes with no report is lost, whether
    /// or not a traffic lookup happened to pick it during the run: the
    /// end looks at every acknowledged key, not only the suspects (a key
    /// stored, silently dropped and never picked was not counted).
    #[test]
    fn a_key_dropped_unreported_and_never_looked_up_is_lost() {
        // Its `Gone` is not registered: the engine tells it nothing.
        let (engine, mut tr) = one_traffic_thread();
        tr.store_some();
        let acked: Vec<Key> = tr
            .keys
            .iter()
            .filter(|(_, o)| o.held == Held::Acked)
            .map(|(k, _)| *k)
            .collect();
        assert!(!acked.is_empty(), "the store was acknowledged");
        // Dropped behind the soak's back: no listener hears of it.
        engine.delete(&acked);
        let (lost, _) = tr.finish();
        assert_eq!(lost, acked.len() as u64, "every dropped key counted lost");
        engine.close();
    }

    /// A key that loads after it was reported gone is counted (and fails
    /// the run): a report of a delete that did not happen.
    #[test]
    fn a_key_held_after_its_report_is_counted() {
        let (engine, mut tr) = one_traffic_thread();
        let (counts, gone) = (tr.counts.clone(), tr.gone.clone());
        while tr.live.is_empty() || tr.keys.values().any(|o| o.held != Held::Acked) {
            tr.keys.clear();
            tr.live.clear();
            tr.store_some();
        }
        // Told gone, though nothing deleted it.
        gone.on_keys_deleted(&tr.live.clone());
        tr.load_some();
        assert!(counts.reported_but_held.load(Ordering::Relaxed) > 0);
        let r = SoakReport {
            reported_but_held: 1,
            ..SoakReport::default()
        };
        assert!(!r.clean());
        engine.close();
    }

    /// A key reported gone twice is counted (and fails the run): the
    /// soak checks "reported once", not only "reported".
    #[test]
    fn a_key_reported_twice_is_counted() {
        let g = Gone::default();
        let (a, b) = (key_of(0, 1), key_of(0, 2));
        g.on_keys_deleted(&[a, b]);
        g.on_keys_deleted(&[b]);
        assert_eq!(g.twice.load(Ordering::Relaxed), 1);
        let r = SoakReport {
            reported_twice: 1,
            ..SoakReport::default()
        };
        assert!(!r.clean());
    }

    #[test]
    fn held_compares_medians_of_the_first_and_last_windows() {
        let r = SoakReport {
            ops_per_second: vec![10, 12, 11, 5, 9, 9, 8],
            ..SoakReport::default()
        };
        // The last three seconds, 9 9 8: median 9.
        assert_eq!(r.held(3), Some((11, 9, 9.0 / 11.0)));
        assert_eq!(r.held(4), None);
    }
}
