//! Hunting stress at the `DaxCore` level: few keys so that collisions,
//! slot reuse and generation reuse happen constantly, every operation of
//! the public API mixed, two devices
//! with one of them remapped in a loop, and every payload stamped
//! `[key id][nonce]..[checksum]` and checked on every load.
//!
//! | test | hunts |
//! |---|---|
//! | `two_cores_every_op_with_remaps` | a guard on one core while entering another that remaps (use after unmap), and everything else in passing |
//! | `one_key_delete_reput_never_wedges` | racing deletes and re-puts leaking a slot or wedging the key |
//! | `forced_delete_racing_a_failing_writer` | a forced delete against a failing copy (a panic, a slot leaked outside the index) |
//! | `freed_slots_below_the_hint_stay_findable` | a release racing the bitmap hint, hiding a free slot |
//!
//! A 24-bit generation wrap needs a reader stalled between its lookup and
//! its borrow CAS for exactly 2^24 reservations of the slot; the public
//! API gives no way to stall a reader there, so these tests only catch it
//! if the scheduler happens to (every load is checked byte for byte, so it
//! would show as another key's bytes). The deterministic test is the
//! core's unit test `a_stalled_reader_never_reads_a_wrapped_incarnation`.
//!
//! Races that need one thread stopped inside a window of a few
//! nanoseconds (between an index lookup and the slot-word load; between
//! entering an arena and copying into it) are made likely two ways: a stall
//! injector (`common::stall`) signals random workers whose handler sleeps
//! 2–40 µs, and writers / readers on the remapped core that pause with
//! their guard held, as a copy from a slow source would. Keys 0..16 share
//! one index home on purpose (see `SAME_HOME`).
//!
//! Each test runs in rounds: threads race for a short round, then, with
//! nothing in flight, the round is checked single-threaded (every lock
//! released, nothing borrowed, invariants, every key's existence agreeing
//! with its loads and with the live slot count, bytes intact). Per-key
//! expectations are only asserted where they are unambiguous: in those
//! quiet phases, and for keys that only one thread touches.
//!
//! `DAXKV_STRESS_SECS` sets each test's run time (default 3 s);
//! `DAXKV_STRESS_SEED` replays a seed (printed at the start; it replays the
//! choice of operations, not the schedule). The tests of this file run one
//! at a time (they compare the process's open fd count).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use daxkv::device::arena::ArenaSpec;
use daxkv::{CoreConfig, CoreError, DaxCore, Key, PutError, PutFromPtrResult, PutOutcome, ReadSet};

#[path = "common/stress.rs"]
mod common;
use common::stall::Stalls;
use common::{fd_count, payload, run_time, seed, verify, verify_exact, Rng, PAYLOAD_MIN};

const SLOT: usize = 4096;

/// Ids below this get keys that share one index home on purpose: distinct
/// high words (so distinct index fingerprints) and tiny low words, which the
/// index's multiply-shift reduction sends to bucket 0. Their entries and
/// tombstones then interleave in one probe run, so a re-put lands in
/// another bucket than the copy before it (a racing delete and re-put
/// needs that to leak). Should the
/// index hash change, they are plain keys and the tests stay valid.
const SAME_HOME: u64 = 16;

fn key(id: u64) -> Key {
    if id < SAME_HOME {
        Key::from_u128(
            (u128::from((id + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)) << 64) | u128::from(id + 1),
        )
    } else {
        Key::digest(&id.to_le_bytes())
    }
}

/// The fd-count checks compare process-wide counts: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A memfd core of `slots` slots, growable to `max_slots`.
fn open(slots: usize, max_slots: usize) -> DaxCore {
    let mut spec = ArenaSpec::memfd(slots * SLOT).populate(true);
    if max_slots > slots {
        spec = spec.max_size_bytes(max_slots * SLOT);
    }
    DaxCore::open(&CoreConfig::new(spec, SLOT)).unwrap()
}

/// A payload length: a multiple of 8 (so `verify` can find the checksum in
/// a buffer without knowing the length), often short, sometimes a full slot.
fn len(rng: &mut Rng, max: usize) -> usize {
    if rng.one_in(8) {
        return max / 8 * 8;
    }
    PAYLOAD_MIN + 8 * rng.below(((max - PAYLOAD_MIN) / 8 + 1) as u64) as usize
}

/// Named operation counters, printed at the end.
struct Stats {
    names: &'static [&'static str],
    counts: Vec<AtomicU64>,
}

impl Stats {
    fn new(names: &'static [&'static str]) -> Stats {
        Stats {
            names,
            counts: names.iter().map(|_| AtomicU64::new(0)).collect(),
        }
    }
    fn bump(&self, name: &str) {
        let i = self
            .names
            .iter()
            .position(|n| *n == name)
            .unwrap_or_else(|| panic!("no counter {name}"));
        self.counts[i].fetch_add(1, Ordering::Relaxed);
    }
    fn add(&self, name: &str, n: u64) {
        let i = self.names.iter().position(|x| *x == name).unwrap();
        self.counts[i].fetch_add(n, Ordering::Relaxed);
    }
    fn report(&self, test: &str) {
        let parts: Vec<String> = self
            .names
            .iter()
            .zip(&self.counts)
            .map(|(n, c)| format!("{n} {}", c.load(Ordering::Relaxed)))
            .collect();
        eprintln!("{test}: {}", parts.join(", "));
    }
}

/// A put's result when anything may race it: the key may be present or in
/// flight, the core full, the store canceled by a forced delete. A plain
/// put never fails its copy and the core is never closed here.
fn check_put(what: &str, id: u64, r: Result<PutOutcome, PutError>) -> Option<PutOutcome> {
    match r {
        Ok(o) => Some(o),
        Err(PutError::Full | PutError::Canceled | PutError::IndexFull) => None,
        Err(e) => panic!("{what} of key {id}: {e:?}"),
    }
}

/// Every put tags its payload with the key id, except `put_many`, which
/// stores tag 0.
fn tag_ok(tag: u32, id: u64) -> bool {
    tag == id as u32 || tag == 0
}

/// Check every reservation of `set` (made for `ids`) and its bytes.
fn check_reads(set: &ReadSet<'_>, ids: &[u64], what: &str) -> usize {
    let mut buf = vec![0u8; SLOT];
    for r in set.items() {
        let id = ids[r.index];
        assert_eq!(
            r.key,
            key(id),
            "{what}: reservation {} names another key",
            r.index
        );
        assert!(
            tag_ok(r.meta, id),
            "{what}: key {id} carries the tag {} of another put",
            r.meta
        );
        let n = set.read(r, &mut buf).unwrap_or_else(|| {
            panic!(
                "{what}: key {id}: reservation of {} bytes unreadable",
                r.len
            )
        });
        assert_eq!(n, r.len);
        verify_exact(id, &buf[..n]);
    }
    set.len()
}

/// With nothing in flight: no lock, borrow or write left; every key's
/// existence agrees with its load, its length and the index (an absent key
/// must be puttable); the live slot count is the number of keys present;
/// the core's invariants hold. Returns the number of keys present.
fn check_quiet(tag: &str, core: &DaxCore, ids: impl Iterator<Item = u64>) -> usize {
    let st = core.status();
    assert_eq!(
        st.locked_key_count, 0,
        "{tag}: locks left after every lock was released: {st:?}"
    );
    assert_eq!(
        st.borrowed_slot_count, 0,
        "{tag}: borrows left with no read in flight: {st:?}"
    );
    assert_eq!(st.active_read_count, 0, "{tag}: {st:?}");
    assert_eq!(st.active_write_count, 0, "{tag}: {st:?}");
    let mut present = 0;
    let mut buf = vec![0u8; SLOT];
    for id in ids {
        let k = key(id);
        let exists = core.exists(k, false);
        let loaded = core.load_into(k, &mut buf);
        assert_eq!(
            exists,
            loaded.is_some(),
            "{tag}: key {id}: exists says {exists}, load says {loaded:?}"
        );
        if let Some(n) = loaded {
            verify_exact(id, &buf[..n]);
            let (plen, ptag) = core.payload_len(k).expect("a loaded key has a length");
            assert_eq!(plen, n, "{tag}: key {id}: payload_len");
            assert!(tag_ok(ptag, id), "{tag}: key {id} carries tag {ptag}");
            present += 1;
        } else {
            assert!(
                !core.contains_live(k),
                "{tag}: key {id} is absent (exists false, load misses) but still in the \
                 index: every put of it answers AlreadyPresent"
            );
        }
    }
    assert_eq!(
        core.live_slot_count(),
        present,
        "{tag}: {} live slots but {present} keys present: a slot leaked",
        core.live_slot_count()
    );
    assert_eq!(core.snapshot_keys().len(), present, "{tag}: snapshot_keys");
    core.check_invariants()
        .unwrap_or_else(|e| panic!("{tag}: invariants: {e}"));
    present
}

/// The end of every test: each absent key is puttable (`Stored`, or `Full`
/// only when every slot is taken), then everything is deleted and the core
/// is empty and consistent.
fn finish(tag: &str, core: &DaxCore, ids: impl Iterator<Item = u64> + Clone) {
    check_quiet(tag, core, ids.clone());
    let mut rng = Rng(0x5EED);
    for id in ids.clone() {
        let k = key(id);
        if core.exists(k, false) {
            continue;
        }
        match core.put(k, &payload(id, rng.next(), 64), id as u32) {
            Ok(PutOutcome::Stored) => {}
            Err(PutError::Full) => assert_eq!(
                core.live_slot_count(),
                core.status().max_slots,
                "{tag}: key {id}: Full with free slots"
            ),
            other => panic!("{tag}: absent key {id}: put answered {other:?}"),
        }
    }
    let present = check_quiet(tag, core, ids.clone());
    let keys: Vec<Key> = ids.clone().map(key).collect();
    let deleted = core
        .delete_many(&keys, false)
        .into_iter()
        .filter(|&d| d)
        .count();
    assert_eq!(deleted, present, "{tag}: unlocked keys refused delete");
    assert_eq!(check_quiet(tag, core, ids), 0);
    assert_eq!(core.live_slot_count(), 0, "{tag}: slots leaked");
    assert_eq!(core.status().pending_free_slot_count, 0, "{tag}");
}

/// Run `round(n, deadline)` until the run time is spent, then report.
fn in_rounds(test: &str, round_len: Duration, mut round: impl FnMut(u64, Instant)) -> u64 {
    let end = Instant::now() + run_time();
    let mut n = 0;
    while n == 0 || Instant::now() < end {
        round(n, (Instant::now() + round_len).min(end.max(Instant::now())));
        n += 1;
    }
    eprintln!("{test}: {n} rounds");
    n
}

// ---------------------------------------------------------------------------
// Two cores, every operation, core B remapped in a loop.
// ---------------------------------------------------------------------------

const KEYS: u64 = 24;
const A_SLOTS: usize = 16;
const B_SLOTS: usize = 16;
const B_MAX_SLOTS: usize = 32;

/// Worker threads of `two_cores_every_op_with_remaps`, besides the
/// remapper and the stall injector (`common::stall`: a worker stopped
/// between entering core B and copying into it is the use-after-unmap).
const MIX_THREADS: usize = 3;

const MIX_OPS: &[&str] = &[
    "stalls",
    "put",
    "session",
    "put_many",
    "writer",
    "writer_fail",
    "lock",
    "unlock",
    "exists",
    "load",
    "load_many",
    "reserve",
    "reserve_delete",
    "delete",
    "delete_forced",
    "migrate",
    "migrated",
    "cross",
    "remap",
];

/// One worker of `two_cores_every_op_with_remaps`: random operations on
/// both cores, every load checked; its locks released before it returns.
#[allow(clippy::too_many_lines)]
fn mix_worker(cores: [&DaxCore; 2], mut rng: Rng, deadline: Instant, stats: &Stats) {
    let mut locks: Vec<(usize, u64)> = Vec::new();
    while Instant::now() < deadline {
        let c = rng.below(2) as usize;
        let (core, other) = (cores[c], cores[1 - c]);
        let id = rng.below(KEYS);
        let k = key(id);
        match rng.below(17) {
            0 | 1 => {
                let data = payload(id, rng.next(), len(&mut rng, SLOT));
                check_put("put", id, core.put(k, &data, id as u32));
                stats.bump("put");
            }
            2 => {
                // A batch under one guard: puts and loads of several keys.
                let s = core.session().expect("core open");
                let mut buf = vec![0u8; SLOT];
                for _ in 0..=rng.below(4) {
                    let id = rng.below(KEYS);
                    if rng.one_in(2) {
                        let data = payload(id, rng.next(), len(&mut rng, SLOT));
                        check_put("session put", id, s.put(key(id), &data, id as u32));
                    } else if let Some(n) = s.load_into(key(id), &mut buf) {
                        verify_exact(id, &buf[..n]);
                    }
                }
                stats.bump("session");
            }
            3 => {
                let ids: Vec<u64> = (0..=rng.below(4)).map(|_| rng.below(KEYS)).collect();
                let data: Vec<Vec<u8>> = ids
                    .iter()
                    .map(|&i| payload(i, rng.next(), len(&mut rng, SLOT)))
                    .collect();
                let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
                let bufs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
                // put_many stores tag 0 (see `tag_ok`).
                let stored = core.put_many(&keys, &bufs).unwrap();
                let mut buf = vec![0u8; SLOT];
                for (ok, &i) in stored.into_iter().zip(&ids) {
                    if ok {
                        if let Some(n) = core.load_into(key(i), &mut buf) {
                            verify_exact(i, &buf[..n]);
                        }
                    }
                }
                stats.bump("put_many");
            }
            4 => {
                // A writer that copies in chunks and succeeds.
                let data = payload(id, rng.next(), len(&mut rng, SLOT));
                let cut = rng.below(data.len() as u64) as usize;
                let called = Cell::new(false);
                let r = core.put_with_writer(k, data.len(), id as u32, |w| {
                    called.set(true);
                    assert_eq!(w.len(), data.len());
                    assert!(w.write(0, &data[..cut]), "writer refused its own bytes");
                    assert!(w.write(cut, &data[cut..]), "writer refused its own bytes");
                    assert!(!w.write(data.len(), &[0]), "writer wrote past its payload");
                    true
                });
                assert!(
                    !matches!(r, Err(PutError::CopyFailed)),
                    "key {id}: a writer that succeeded got CopyFailed"
                );
                check_put("writer", id, r);
                stats.bump("writer");
            }
            5 => {
                // A failing copy: poison (another key's stamp), then false.
                let n = len(&mut rng, SLOT);
                let poison = payload((id + 1) % KEYS, rng.next(), n);
                let called = Cell::new(false);
                let r = core.put_with_writer(k, n, id as u32, |w| {
                    called.set(true);
                    assert!(w.write(0, &poison[..n / 2]), "writer refused its own bytes");
                    if rng.one_in(4) {
                        std::thread::yield_now();
                    }
                    false
                });
                if called.get() {
                    assert!(
                        matches!(r, Err(PutError::CopyFailed | PutError::Canceled)),
                        "key {id}: a failed writer's put answered {r:?}"
                    );
                } else {
                    check_put("failing writer", id, r);
                }
                stats.bump("writer_fail");
            }
            6 => {
                let ids: Vec<u64> = (0..=rng.below(4)).map(|_| rng.below(KEYS)).collect();
                let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
                for (hit, &i) in core.exists_many(&keys, true).into_iter().zip(&ids) {
                    if hit {
                        locks.push((c, i));
                    }
                }
                stats.bump("lock");
            }
            7 => {
                for _ in 0..=rng.below(locks.len() as u64 + 1) {
                    if locks.is_empty() {
                        break;
                    }
                    let (lc, li) = locks.swap_remove(rng.below(locks.len() as u64) as usize);
                    cores[lc].unlock_many(&[key(li)]);
                }
                stats.bump("unlock");
            }
            8 => {
                let _ = core.exists(k, false);
                let _ = core.lock_count(k);
                stats.bump("exists");
            }
            9 => {
                let mut buf = vec![0u8; SLOT];
                if let Some(n) = core.load_into(k, &mut buf) {
                    verify_exact(id, &buf[..n]);
                }
                stats.bump("load");
            }
            10 => {
                let ids: Vec<u64> = (0..=rng.below(4)).map(|_| rng.below(KEYS)).collect();
                let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
                let mut bufs = vec![vec![0u8; SLOT]; ids.len()];
                let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                let hits = core.load_many_into(&keys, &mut views).unwrap();
                for ((hit, b), &i) in hits.iter().zip(&bufs).zip(&ids) {
                    if *hit {
                        verify(i, b);
                    }
                }
                stats.bump("load_many");
            }
            11 => {
                let ids: Vec<u64> = (0..=rng.below(4)).map(|_| rng.below(KEYS)).collect();
                let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
                let set = core.reserve_reads(&keys, rng.one_in(2));
                check_reads(&set, &ids, "reserve_reads");
                stats.bump("reserve");
            }
            12 => {
                // Hold a read across a delete and a re-put of the same key:
                // the borrowed bytes must stay the old copy's.
                let set = core.reserve_reads(&[k], false);
                core.delete(k, rng.one_in(2));
                if rng.one_in(2) {
                    let data = payload(id, rng.next(), len(&mut rng, SLOT));
                    check_put("re-put under a read", id, core.put(k, &data, id as u32));
                }
                check_reads(&set, &[id], "read held across delete");
                stats.bump("reserve_delete");
            }
            13 => {
                core.delete(k, false);
                stats.bump("delete");
            }
            14 => {
                core.delete(k, true);
                stats.bump("delete_forced");
            }
            15 => {
                // Migration: copy keys from `core` to `other` while holding
                // `core`'s read set (enters `other` under a guard on `core`),
                // then sometimes delete the source copies.
                let ids: Vec<u64> = (0..=rng.below(3)).map(|_| rng.below(KEYS)).collect();
                let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
                let set = core.reserve_reads(&keys, false);
                for r in set.items() {
                    match other.put_reserved_from(r.key, &set, r) {
                        PutFromPtrResult::Inserted => stats.bump("migrated"),
                        PutFromPtrResult::AlreadyExists
                        | PutFromPtrResult::InFlight
                        | PutFromPtrResult::NoSpace
                        // A forced delete on `other` canceled the copy.
                        | PutFromPtrResult::Canceled => {}
                        bad => panic!("migration of key {}: {bad:?}", ids[r.index]),
                    }
                }
                let mut buf = vec![0u8; SLOT];
                for &i in &ids {
                    if let Some(n) = other.load_into(key(i), &mut buf) {
                        verify_exact(i, &buf[..n]);
                    }
                }
                check_reads(&set, &ids, "migration source");
                drop(set);
                if rng.one_in(2) {
                    core.delete_many(&keys, false);
                }
                stats.bump("migrate");
            }
            _ => {
                // Hold a read set on `core` while working on `other`.
                let ids: Vec<u64> = (0..=rng.below(3)).map(|_| rng.below(KEYS)).collect();
                let keys: Vec<Key> = ids.iter().map(|&i| key(i)).collect();
                let set = core.reserve_reads(&keys, false);
                let mut buf = vec![0u8; SLOT];
                for _ in 0..=rng.below(8) {
                    let j = rng.below(KEYS);
                    match rng.below(5) {
                        0 => {
                            let data = payload(j, rng.next(), len(&mut rng, SLOT));
                            check_put("cross put", j, other.put(key(j), &data, j as u32));
                        }
                        1 => {
                            if let Some(n) = other.load_into(key(j), &mut buf) {
                                verify_exact(j, &buf[..n]);
                            }
                        }
                        2 => {
                            // A slow copy into `other`: its guard is held
                            // across a pause, as a real copy from a slow
                            // source would (a guard taken while `other`
                            // remaps then writes into the unmapped range).
                            let data = payload(j, rng.next(), len(&mut rng, SLOT));
                            let r = other.put_with_writer(key(j), data.len(), j as u32, |w| {
                                std::thread::sleep(Duration::from_micros(20));
                                assert!(w.write(0, &data), "writer refused its own bytes");
                                true
                            });
                            check_put("cross slow writer", j, r);
                        }
                        3 => {
                            // A slow read from `other`, nested the same way.
                            let more: Vec<u64> =
                                (0..=rng.below(3)).map(|_| rng.below(KEYS)).collect();
                            let keys: Vec<Key> = more.iter().map(|&i| key(i)).collect();
                            let set = other.reserve_reads(&keys, false);
                            std::thread::sleep(Duration::from_micros(20));
                            check_reads(&set, &more, "slow read on the other core");
                        }
                        _ => {
                            other.delete(key(j), rng.one_in(2));
                        }
                    }
                }
                check_reads(&set, &ids, "read held across work on the other core");
                stats.bump("cross");
            }
        }
        if locks.len() > 12 {
            for (lc, li) in locks.drain(..6) {
                cores[lc].unlock_many(&[key(li)]);
            }
        }
    }
    for (lc, li) in locks {
        cores[lc].unlock_many(&[key(li)]);
    }
}

/// Grow core B to its maximum and shrink it back (when no live slot is in
/// the way) until `deadline`, often back to back: the longer B spends in
/// its exclusive section, the more often a thread holding a guard on A
/// tries to enter it.
fn remapper(b: &DaxCore, mut rng: Rng, deadline: Instant, stats: &Stats) {
    let pause = |rng: &mut Rng| {
        if rng.one_in(2) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20 + rng.below(200)));
        }
    };
    while Instant::now() < deadline {
        b.remap(B_MAX_SLOTS * SLOT).expect("grow");
        stats.bump("remap");
        pause(&mut rng);
        if b.can_shrink_to(B_SLOTS) {
            match b.remap(B_SLOTS * SLOT) {
                Ok(()) => stats.bump("remap"),
                Err(CoreError::WouldCutLiveSlots { .. }) => {}
                Err(e) => panic!("shrink: {e}"),
            }
        }
        pause(&mut rng);
    }
}

#[test]
fn two_cores_every_op_with_remaps() {
    let _serial = serial();
    let seed = seed();
    eprintln!(
        "two_cores_every_op_with_remaps: seed {seed} (DAXKV_STRESS_SEED), {:?} (DAXKV_STRESS_SECS)",
        run_time()
    );
    let fds = fd_count();
    {
        let a = open(A_SLOTS, A_SLOTS);
        let b = open(B_SLOTS, B_MAX_SLOTS);
        let stats = Stats::new(MIX_OPS);
        in_rounds(
            "two_cores_every_op_with_remaps",
            Duration::from_millis(250),
            |n, deadline| {
                let stalls = Stalls::new(MIX_THREADS);
                std::thread::scope(|s| {
                    for t in 0..MIX_THREADS as u64 {
                        let rng = Rng::for_thread(seed.wrapping_add(n), t);
                        let (a, b, stats, stalls) = (&a, &b, &stats, &stalls);
                        s.spawn(move || stalls.worker(|| mix_worker([a, b], rng, deadline, stats)));
                    }
                    let rng = Rng::for_thread(seed.wrapping_add(n), 99);
                    s.spawn(|| remapper(&b, rng, deadline, &stats));
                    let rng = Rng::for_thread(seed.wrapping_add(n), 98);
                    stats.add("stalls", stalls.inject(rng));
                });
                check_quiet(&format!("round {n}, core A"), &a, 0..KEYS);
                check_quiet(&format!("round {n}, core B"), &b, 0..KEYS);
            },
        );
        stats.report("two_cores_every_op_with_remaps");
        finish("core A", &a, 0..KEYS);
        finish("core B", &b, 0..KEYS);
    }
    assert!(
        fd_count() <= fds,
        "fds leaked: {fds} before, {} after",
        fd_count()
    );
}

// ---------------------------------------------------------------------------
// One key, deleted and re-put from every thread.
// ---------------------------------------------------------------------------

const ONE_KEY_OPS: &[&str] = &[
    "stalls",
    "put",
    "put_stored",
    "writer_fail",
    "delete",
    "deleted",
    "delete_forced",
    "forced_deleted",
    "load",
    "load_hit",
    "reserve",
    "lock",
];

/// Key ids of the one-key tests (all below `SAME_HOME`: one index run).
/// Round `n`'s hot key is `n % ONE_KEYS`; in three rounds of four the
/// others are stored and deleted now and then (one op in 8), so the hot
/// key's run holds other keys' entries and tombstones and a re-put can land
/// in the same slot but another bucket, which a leaking delete needs.
const ONE_KEYS: u64 = 7;
/// Worker threads of the one-key tests; a fifth stalls them at random
/// moments (`common::stall`), so that one is often stopped inside an
/// operation (between its index lookup and its slot-word load) while the
/// others delete and re-put the key.
const ONE_THREADS: u64 = 4;
/// Slots of the one-key core: more than `ONE_KEYS` plus one borrowed or
/// canceled slot per thread, so `Full` is never legitimate.
const ONE_SLOTS: usize = 16;

/// One worker: the hot key put, deleted, force-deleted, loaded, locked and
/// unlocked as fast as possible. `weights` are the odds of put / failing
/// writer / delete / forced delete / load / reserve / lock.
fn one_key_worker(
    core: &DaxCore,
    mut rng: Rng,
    deadline: Instant,
    hot: u64,
    side_keys: bool,
    weights: [u64; 7],
    stats: &Stats,
) {
    let total: u64 = weights.iter().sum();
    let mut buf = vec![0u8; SLOT];
    while Instant::now() < deadline {
        let id = if side_keys && rng.one_in(8) {
            rng.below(ONE_KEYS)
        } else {
            hot
        };
        let k = key(id);
        let mut pick = rng.below(total);
        let op = weights
            .iter()
            .position(|&w| {
                if pick < w {
                    true
                } else {
                    pick -= w;
                    false
                }
            })
            .unwrap();
        match op {
            0 => {
                let data = payload(id, rng.next(), len(&mut rng, 512));
                let r = core.put(k, &data, id as u32);
                assert!(
                    !matches!(r, Err(PutError::Full)),
                    "Full with at most {ONE_KEYS} keys on {} slots",
                    core.status().max_slots
                );
                if check_put("put", id, r) == Some(PutOutcome::Stored) {
                    stats.bump("put_stored");
                }
                stats.bump("put");
            }
            1 => {
                // A failing copy that writes another key's stamp first.
                let n = len(&mut rng, 512);
                let poison = payload(id + 100, rng.next(), n);
                let called = Cell::new(false);
                let yield_now = rng.one_in(2);
                let r = core.put_with_writer(k, n, id as u32, |w| {
                    called.set(true);
                    assert!(w.write(0, &poison), "writer refused its own bytes");
                    if yield_now {
                        std::thread::yield_now();
                    }
                    false
                });
                if called.get() {
                    assert!(
                        matches!(r, Err(PutError::CopyFailed | PutError::Canceled)),
                        "key {id}: a failed writer's put answered {r:?}"
                    );
                }
                stats.bump("writer_fail");
            }
            2 => {
                if core.delete(k, false) {
                    stats.bump("deleted");
                }
                stats.bump("delete");
            }
            3 => {
                if core.delete(k, true) {
                    stats.bump("forced_deleted");
                }
                stats.bump("delete_forced");
            }
            4 => {
                if let Some(n) = core.load_into(k, &mut buf) {
                    verify_exact(id, &buf[..n]);
                    stats.bump("load_hit");
                }
                stats.bump("load");
            }
            5 => {
                let set = core.reserve_reads(&[k], false);
                if rng.one_in(2) {
                    core.delete(k, rng.one_in(2));
                }
                check_reads(&set, &[id], "one-key read");
                stats.bump("reserve");
            }
            _ => {
                if core.exists(k, true) {
                    if rng.one_in(2) {
                        std::thread::yield_now();
                    }
                    core.unlock_many(&[k]);
                }
                stats.bump("lock");
            }
        }
    }
}

fn one_key_churn(test: &str, weights: [u64; 7]) {
    let _serial = serial();
    let seed = seed();
    eprintln!(
        "{test}: seed {seed} (DAXKV_STRESS_SEED), {:?} (DAXKV_STRESS_SECS)",
        run_time()
    );
    let fds = fd_count();
    {
        let core = open(ONE_SLOTS, ONE_SLOTS);
        let stats = Stats::new(ONE_KEY_OPS);
        in_rounds(test, Duration::from_millis(100), |n, deadline| {
            let hot = n % ONE_KEYS;
            let stalls = Stalls::new(ONE_THREADS as usize);
            std::thread::scope(|s| {
                for t in 0..ONE_THREADS {
                    let rng = Rng::for_thread(seed.wrapping_add(n), t);
                    let (core, stats, stalls) = (&core, &stats, &stalls);
                    s.spawn(move || {
                        stalls.worker(|| {
                            one_key_worker(core, rng, deadline, hot, n % 4 != 0, weights, stats);
                        });
                    });
                }
                let rng = Rng::for_thread(seed.wrapping_add(n), 99);
                let injected = stalls.inject(rng);
                stats.add("stalls", injected);
            });
            let tag = format!("{test}, round {n}, hot key {hot}");
            check_quiet(&tag, &core, 0..ONE_KEYS);
            // Not present: a put must store it (not AlreadyPresent forever).
            let k = key(hot);
            if !core.exists(k, false) {
                assert_eq!(
                    core.put(k, &payload(hot, n, 64), hot as u32),
                    Ok(PutOutcome::Stored),
                    "{tag}: the hot key is absent but cannot be stored"
                );
                assert!(core.exists(k, false), "{tag}: stored, then missing");
            }
            check_quiet(&tag, &core, 0..ONE_KEYS);
        });
        stats.report(test);
        finish(test, &core, 0..ONE_KEYS);
    }
    assert!(
        fd_count() <= fds,
        "fds leaked: {fds} before, {} after",
        fd_count()
    );
}

/// delete(K) finds K's bucket, K is deleted and re-put into the same slot
/// in another bucket meanwhile: the first delete must not detach the new
/// generation and fail to unlink it (a live slot with no key, and K
/// answering AlreadyPresent forever).
#[test]
fn one_key_delete_reput_never_wedges() {
    // put, failing writer, delete, forced delete, load, reserve, lock
    one_key_churn("one_key_delete_reput_never_wedges", [6, 0, 4, 2, 2, 1, 1]);
}

/// A forced delete detaches an in-flight store whose copy then fails; the
/// writer frees the slot, K is re-put into the same slot and bucket. A
/// stale removal by the deleter would take the new copy's bucket (then
/// panic unlinking a generation that moved on).
#[test]
fn forced_delete_racing_a_failing_writer() {
    // put, failing writer, delete, forced delete, load, reserve, lock
    one_key_churn(
        "forced_delete_racing_a_failing_writer",
        [4, 5, 1, 5, 1, 1, 0],
    );
}

// ---------------------------------------------------------------------------
// The free bitmap's hint.
// ---------------------------------------------------------------------------

const HINT_SLOTS: usize = 128;
/// Ballast: ids BALLAST..BALLAST+63 fill slots 0..63, leaving slot 63 the
/// only free slot of bitmap word 0 for the racers to fight over.
const BALLAST: u64 = 1000;
const BALLAST_N: u64 = 63;
/// Racer keys: two per thread, only that thread touches them.
const RACER: u64 = 2000;
const RACERS: u64 = 4;
/// Filler keys for the round-end count.
const FILLER: u64 = 3000;

const HINT_OPS: &[&str] = &["put", "delete", "load", "spilled"];

/// The first slot a reservation of `id` sits in.
fn slot_of(core: &DaxCore, id: u64) -> Option<u32> {
    let set = core.reserve_reads(&[key(id)], false);
    set.items().first().map(|r| r.slot.0)
}

/// One racer: puts and deletes its own two keys (its view of them is exact:
/// no other thread touches them) so that slot 63 is taken and freed while
/// other racers spill into word 1 and move the hint.
fn hint_worker(core: &DaxCore, t: u64, mut rng: Rng, deadline: Instant, stats: &Stats) {
    let mine = [RACER + 2 * t, RACER + 2 * t + 1];
    let mut present = [false; 2];
    let mut buf = vec![0u8; SLOT];
    while Instant::now() < deadline {
        let j = rng.below(2) as usize;
        let id = mine[j];
        if rng.one_in(8) {
            let got = core.load_into(key(id), &mut buf);
            assert_eq!(
                got.is_some(),
                present[j],
                "racer key {id}: only this thread touches it"
            );
            if let Some(n) = got {
                verify_exact(id, &buf[..n]);
            }
            stats.bump("load");
        } else if present[j] {
            assert!(
                core.delete(key(id), false),
                "racer key {id}: present, delete refused"
            );
            present[j] = false;
            stats.bump("delete");
        } else {
            let r = core.put(key(id), &payload(id, rng.next(), PAYLOAD_MIN), id as u32);
            assert_eq!(
                r,
                Ok(PutOutcome::Stored),
                "racer key {id}: at most {} of {HINT_SLOTS} slots taken, put answered {r:?} \
                 (a freed slot hidden below the bitmap hint)",
                BALLAST_N + 2 * RACERS
            );
            present[j] = true;
            stats.bump("put");
        }
    }
    for (j, &id) in mine.iter().enumerate() {
        if present[j] {
            assert!(core.delete(key(id), false));
        }
    }
}

/// A claimer that found word 0 full moves the hint to word 1 after a
/// release in word 0 (which saw hint 0 and left it) freed a bit: that slot
/// must still be found. Checked each round: with N of M slots
/// free, exactly N more puts succeed, the first into the lowest free slot.
#[test]
fn freed_slots_below_the_hint_stay_findable() {
    let _serial = serial();
    let test = "freed_slots_below_the_hint_stay_findable";
    let seed = seed();
    eprintln!(
        "{test}: seed {seed} (DAXKV_STRESS_SEED), {:?} (DAXKV_STRESS_SECS)",
        run_time()
    );
    let fds = fd_count();
    {
        let core = open(HINT_SLOTS, HINT_SLOTS);
        for i in 0..BALLAST_N {
            let id = BALLAST + i;
            assert_eq!(
                core.put(key(id), &payload(id, i, 64), id as u32),
                Ok(PutOutcome::Stored)
            );
            assert_eq!(
                slot_of(&core, id),
                Some(i as u32),
                "a fresh core fills lowest slot first"
            );
        }
        let stats = Stats::new(HINT_OPS);
        let ids = || {
            (BALLAST..BALLAST + BALLAST_N)
                .chain(RACER..RACER + 2 * RACERS)
                .chain(FILLER..FILLER + HINT_SLOTS as u64)
        };
        in_rounds(test, Duration::from_millis(100), |n, deadline| {
            std::thread::scope(|s| {
                for t in 0..RACERS {
                    let rng = Rng::for_thread(seed.wrapping_add(n), t);
                    let (core, stats) = (&core, &stats);
                    s.spawn(move || hint_worker(core, t, rng, deadline, stats));
                }
            });
            let tag = format!("{test}, round {n}");
            assert_eq!(check_quiet(&tag, &core, ids()), BALLAST_N as usize, "{tag}");
            // Fill every free slot: exactly as many puts as free slots
            // succeed, the first one into the lowest free slot (63).
            let free = HINT_SLOTS - core.live_slot_count();
            let mut stored = 0;
            let mut first_slot = None;
            for i in 0..HINT_SLOTS as u64 {
                let id = FILLER + i;
                match core.put(key(id), &payload(id, n, PAYLOAD_MIN), id as u32) {
                    Ok(PutOutcome::Stored) => {
                        stored += 1;
                        first_slot = first_slot.or_else(|| slot_of(&core, id));
                    }
                    Err(PutError::Full) => break,
                    other => panic!("{tag}: filler {id}: {other:?}"),
                }
            }
            if first_slot != Some(BALLAST_N as u32) {
                stats.bump("spilled");
            }
            assert_eq!(
                stored, free,
                "{tag}: {free} of {HINT_SLOTS} slots free but {stored} puts succeeded before \
                 Full (the first took slot {first_slot:?}): a freed slot is hidden below the \
                 bitmap hint"
            );
            assert_eq!(
                first_slot,
                Some(BALLAST_N as u32),
                "{tag}: the first put took slot {first_slot:?} while slot {BALLAST_N} was free \
                 (lowest-first broken)"
            );
            let fillers: Vec<Key> = (FILLER..FILLER + stored as u64).map(key).collect();
            assert!(core.delete_many(&fillers, false).into_iter().all(|d| d));
            assert_eq!(check_quiet(&tag, &core, ids()), BALLAST_N as usize, "{tag}");
        });
        stats.report(test);
        finish(test, &core, ids());
    }
    assert!(
        fd_count() <= fds,
        "fds leaked: {fds} before, {} after",
        fd_count()
    );
}
