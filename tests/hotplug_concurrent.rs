//! Hotplug concurrent with the data path, on real threads: a store in
//! flight during a migrating remove, a delete while keys move to a device
//! added meanwhile, a forced evict while another thread deletes, unlocks
//! racing forced migrations, status listed during removes; and what a
//! long-lived pool costs: the DRAM of a hotplugged memfd's growth headroom
//! (checked, not timed) and placement past the 64th list entry.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{Answer, DeviceId, DeviceSpec, Engine, EngineOptions, RemoveMode};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key};

const W: Duration = Duration::from_secs(30);

fn memfd(slots: usize, slot: usize) -> DeviceSpec {
    DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(slots * slot), slot),
    }
}

fn key(tag: &str, i: u64) -> Key {
    Key::digest(format!("{tag}@{i}").as_bytes())
}

fn pat(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn store(e: &Engine, keys: Vec<Key>, bufs: Vec<Vec<u8>>) -> bool {
    let id = e
        .submit_store(keys, bufs.into_iter().map(Buf::from).collect())
        .unwrap();
    match e.wait_store(id, W) {
        Answer::Ready(r) => r.success,
        _ => panic!("store timed out"),
    }
}

/// A store that reported success survives a remove(migrate) that ran
/// meanwhile. The remove snapshots the committed keys once; a store that
/// chose the device before it left `Active` (its copy in flight, so not
/// in the snapshot) would commit there after the snapshot, and the close
/// would forget it, unless the remove waits for every operation on the
/// device before it lists the keys.
#[test]
fn remove_migrate_keeps_keys_whose_store_was_in_flight() {
    const SLOT: usize = 1 << 20; // 1 MiB copies: a wide in-flight window
    let e = Arc::new(
        Engine::open(vec![memfd(128, SLOT)], SLOT, true, EngineOptions::default()).unwrap(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let done: Arc<std::sync::Mutex<Vec<u64>>> = Arc::default();
    let storer = {
        let (e, stop, done) = (e.clone(), stop.clone(), done.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // Keep the unchecked keys few, so a target always has room
                // for the source's keys (the hunt is for lost stores, not
                // for a full pool).
                if done.lock().unwrap().len() >= 128 {
                    std::thread::sleep(Duration::from_micros(500));
                    continue;
                }
                i += 1;
                if store(&e, vec![key("lost", i)], vec![pat(i, SLOT)]) {
                    done.lock().unwrap().push(i);
                }
                std::thread::sleep(Duration::from_micros(500));
            }
        })
    };
    let mut cur = DeviceId(0);
    let (mut removes, mut checked, mut lost) = (0, 0, Vec::new());
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && removes < 120 && lost.is_empty() {
        // A fresh target, then migrate everything off the old one.
        let (_, info) = e.hotplug_add("memfd:", 512 * SLOT, |_, _| Ok(())).unwrap();
        std::thread::sleep(Duration::from_millis(3));
        if let Err(err) = e.remove_device(cur, RemoveMode::Migrate, true) {
            panic!("remove {removes}: {err:?}; devices {:?}", e.devices());
        }
        removes += 1;
        cur = info.id;
        // Every store that succeeded so far must be readable now; then
        // delete them (only this thread deletes).
        let ok: Vec<u64> = std::mem::take(&mut *done.lock().unwrap());
        for chunk in ok.chunks(32) {
            let keys: Vec<Key> = chunk.iter().map(|&i| key("lost", i)).collect();
            let id = e
                .submit_load(keys.clone(), vec![vec![0u8; SLOT]; chunk.len()])
                .unwrap();
            let Answer::Ready(r) = e.wait_load(id, W) else {
                panic!("load timed out")
            };
            for (j, &i) in chunk.iter().enumerate() {
                match r.payload(j) {
                    Some(p) => assert!(p == pat(i, SLOT).as_slice(), "wrong bytes for {i}"),
                    None => lost.push(i),
                }
            }
            e.delete(&keys);
        }
        checked += ok.len();
    }
    stop.store(true, Ordering::Relaxed);
    storer.join().unwrap();
    eprintln!(
        "removes: {removes}, successful stores checked: {checked}, lost after success: {}",
        lost.len()
    );
    assert!(removes >= 3 && checked > 0, "the hunt did not run");
    assert!(
        lost.is_empty(),
        "{} keys whose store succeeded are gone after remove(migrate): {:?}",
        lost.len(),
        &lost[..lost.len().min(10)]
    );
}

/// A delete of every key finds the keys a migration moved to a device
/// added meanwhile. A `delete_into` that loaded the device list once,
/// before it claimed each key, would look only at that list: a migration
/// moving a key (under its claim) before the delete reached it would leave
/// the copy on the new device, and the key would survive.
#[test]
fn delete_finds_keys_moved_to_a_device_added_meanwhile() {
    const SLOT: usize = 512;
    const N: u64 = 5_000;
    let e = Arc::new(
        Engine::open(
            vec![memfd(N as usize + 64, SLOT)],
            SLOT,
            true,
            EngineOptions::default(),
        )
        .unwrap(),
    );
    let all: Vec<Key> = (0..N).map(|i| key("del", i)).collect();
    for c in all.chunks(64) {
        assert!(store(&e, c.to_vec(), vec![vec![7u8; 64]; c.len()]));
    }
    assert_eq!(e.devices()[0].live_slots, N as usize);
    // The delete's own key list: 600k keys that are not stored (cheap
    // misses, but they keep the delete busy), then the real ones in
    // reverse slot order (the migration moves in slot order).
    let mut list: Vec<Key> = (0..3_000_000u64).map(|i| key("absent", i)).collect();
    list.extend(all.iter().rev().copied());
    let deleter = {
        let e = e.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            let n = e.delete(&list).len();
            eprintln!("delete took {:?}", t.elapsed());
            n
        })
    };
    // (A file device: a hotplugged memfd reserves 64 GiB of slot metadata.)
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dev1");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(((N as usize + 64) * SLOT) as u64)
        .unwrap();
    let t0 = Instant::now();
    // The delete loaded the device list at once; add a device and migrate
    // the old one onto it while the delete runs.
    std::thread::sleep(Duration::from_millis(20));
    let (_, info) = e
        .hotplug_add(path.to_str().unwrap(), (N as usize + 64) * SLOT, |_, _| {
            Ok(())
        })
        .unwrap();
    eprintln!("added at {:?}", t0.elapsed());
    let r = e.remove_device(DeviceId(0), RemoveMode::Migrate, false);
    eprintln!(
        "migrated at {:?}: {:?}",
        t0.elapsed(),
        r.as_ref().map(|r| r.moved_keys)
    );
    assert!(
        !deleter.is_finished(),
        "the delete finished before the migration: retune"
    );
    let deleted = deleter.join().unwrap();
    let left: usize = all
        .iter()
        .filter(|&&k| !e.devices_holding(k).is_empty())
        .count();
    eprintln!(
        "remove: {:?}; delete reported {deleted} of {N}; keys left in the pool: {left}; new device live slots {}",
        r.as_ref().map(|r| r.moved_keys),
        e.devices().iter().find(|d| d.id == info.id).unwrap().live_slots
    );
    assert_eq!(
        left, 0,
        "a delete of every key (nothing else touched them) left {left} keys in the pool"
    );
}

/// A forced evict (remove mode evict, force) goes through when a key of
/// its snapshot was deleted by a plain concurrent `Engine::delete` before
/// the evict reached it: nothing is locked or borrowed, so counting that
/// key as blocked (a "locked or borrowed" 409, the device left in the
/// pool) would be wrong.
#[test]
fn forced_evict_goes_through_when_a_key_was_deleted_meanwhile() {
    const SLOT: usize = 512;
    const N: u64 = 40_000;
    for delay_us in [0u64, 100, 300, 600, 1000, 2000, 4000] {
        let e = Arc::new(
            Engine::open(
                vec![memfd(N as usize + 64, SLOT), memfd(64, SLOT)],
                SLOT,
                true,
                EngineOptions::default(),
            )
            .unwrap(),
        );
        e.set_device_state(DeviceId(1), daxkv::engine::DeviceState::Draining)
            .unwrap();
        let all: Vec<Key> = (0..N).map(|i| key("ev", i)).collect();
        for c in all.chunks(64) {
            assert!(store(&e, c.to_vec(), vec![vec![7u8; 64]; c.len()]));
        }
        let deleter = {
            let e = e.clone();
            // Slot order is store order; delete from the far end so the
            // evict has not reached those keys yet.
            let tail: Vec<Key> = all.iter().rev().take(2000).copied().collect();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_micros(delay_us));
                e.delete(&tail).len()
            })
        };
        let r = e.remove_device(DeviceId(0), RemoveMode::Evict, true);
        let deleted = deleter.join().unwrap();
        let st = e.status();
        eprintln!(
            "delay {delay_us} us: concurrent delete removed {deleted}; forced evict: {:?}; device 0 now {} (locked {}, borrowed {})",
            r.as_ref().map(|r| r.deleted_keys),
            st["devices"][0]["state"],
            st["devices"][0]["locked_key_count"],
            st["devices"][0]["borrowed_slot_count"]
        );
        assert!(
            r.is_ok(),
            "forced evict refused although nothing was locked or borrowed: {r:?}"
        );
    }
}

fn rss_mb() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let l = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

#[test]
fn a_hotplugged_memfd_costs_dram_in_proportion_to_its_size() {
    const SLOT: usize = 4096;
    let e = Engine::open(vec![memfd(16, SLOT)], SLOT, true, EngineOptions::default()).unwrap();
    let before = rss_mb();
    e.hotplug_add("memfd:", 16 * SLOT, |_, _| Ok(())).unwrap();
    let after = rss_mb();
    // A flat 64 GiB of headroom would take 800 MiB of slot tables here.
    assert!(after < before + 64, "RSS {before} MiB -> {after} MiB");
}

/// Tombstones stay in the device list (ids are never reused), so a
/// long-lived pool outgrows 64 entries. Placement that chose only among
/// the first 64 (a bitmask) would fail stores to a device added after
/// that, and a migration onto it would report no capacity; with such a
/// bitmask the store after 70 add / remove rounds fails.
#[test]
fn placement_reaches_devices_past_the_64th_entry() {
    const SLOT: usize = 4096;
    let e = Engine::open(vec![memfd(128, SLOT)], SLOT, true, EngineOptions::default()).unwrap();
    let mut cur = DeviceId(0);
    for round in 0..70u64 {
        let (_, info) = e.hotplug_add("memfd:", 128 * SLOT, |_, _| Ok(())).unwrap();
        assert!(
            store(&e, vec![key("tomb", round)], vec![pat(round, 100)]),
            "round {round}"
        );
        e.remove_device(cur, RemoveMode::Migrate, false)
            .unwrap_or_else(|err| panic!("round {round}: {err:?}"));
        cur = info.id;
    }
    assert_eq!(e.devices().len(), 71);
    assert_eq!(e.devices_holding(key("tomb", 0)), [cur]);
}

/// A file of `bytes` under `dir` (a device for `hotplug_add`).
fn sized_file(dir: &std::path::Path, name: &str, bytes: usize) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::File::create(&path)
        .unwrap()
        .set_len(bytes as u64)
        .unwrap();
    path
}

/// A reader of the unlock hunt: lock a key (lookup), check that a plain
/// delete leaves it (this reader holds a lock), unlock; until `stop`.
/// Counts in `stolen` the times the delete removed it. Returns its rounds.
fn lock_check_unlock(
    e: &Engine,
    keys: &[Key],
    reader: u64,
    stop: &AtomicBool,
    stolen: &std::sync::atomic::AtomicUsize,
    on_caller: bool,
) -> u64 {
    let count = keys.len() as u64;
    let mut rounds = 0u64;
    let mut i = reader;
    while !stop.load(Ordering::Relaxed) && rounds < 5_000_000 {
        rounds += 1;
        i = i.wrapping_add(1);
        let k = keys[(i % count) as usize];
        let hit = if on_caller {
            let mut out = [false];
            e.lookup_and_lock_into(&[k], &mut out);
            out[0]
        } else {
            let id = e.submit_lookup_and_lock(vec![k]).unwrap();
            let Answer::Ready(hit) = e.wait_lookup(id, W) else {
                panic!("lookup timed out")
            };
            hit.test(0)
        };
        if !hit {
            continue; // a transient miss while it moves
        }
        if !e.delete(&[k]).is_empty() {
            // Our lock was released by another reader's unlock. Put the
            // key back to go on hunting.
            stolen.fetch_add(1, Ordering::Relaxed);
            store(e, vec![k], vec![pat(i % count, 256)]);
            continue;
        }
        e.submit_unlock(&[k]);
    }
    rounds
}

/// A forced migration hands a moved key's lookup locks
/// over from the source copy to the target copy (the source delete takes
/// them, then they are taken again on the target, one by one).
/// A `submit_unlock` that took no claim and released one lock on every
/// device in turn could land between the two halves: it would find the
/// source copy gone and the target copy not yet locked, release nothing,
/// and the lock then taken on the target would stay for ever (status
/// counts it, and every later non-forced remove or shrink of that device
/// is 409); or it would release one lock on each copy, two in all, taking
/// another reader's.
///
/// Hunt: a few keys, readers that lock a key (lookup), check that a plain
/// delete leaves it (they hold a lock), and unlock, against a migrator
/// that moves every key to a fresh device, over and over (forced, and
/// sometimes not). At the end every lock was released: none may be left,
/// and a non-forced remove must go through. With an unlock under no claim
/// this fails within seconds under load ("locks left after every reader
/// unlocked: 1 ... remove: Blocked"); unlock waits for the move's claim.
/// `DAXKV_HUNT_SECS` runs it longer.
#[test]
fn unlock_racing_forced_migrations_never_frees_or_keeps_a_lock() {
    unlock_racing_forced_migrations(false);
}

/// The same hunt with the locks taken on the caller
/// (`Engine::lookup_and_lock_into`, the `plugin` adapter's lookups).
#[test]
fn caller_lookups_racing_forced_migrations_never_free_or_keep_a_lock() {
    unlock_racing_forced_migrations(true);
}

fn unlock_racing_forced_migrations(on_caller: bool) {
    const SLOT: usize = 4096;
    const KEYS: u64 = 4;
    const DEV_SLOTS: usize = 64;
    let secs: u64 = std::env::var("DAXKV_HUNT_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let e = Arc::new(
        Engine::open(
            vec![memfd(DEV_SLOTS, SLOT)],
            SLOT,
            true,
            EngineOptions::default(),
        )
        .unwrap(),
    );
    let keys: Vec<Key> = (0..KEYS).map(|i| key("unlock-move", i)).collect();
    assert!(store(
        &e,
        keys.clone(),
        (0..KEYS).map(|i| pat(i, 256)).collect()
    ));
    let stop = Arc::new(AtomicBool::new(false));
    // A reader held a lock on the key and a plain delete removed it.
    let stolen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let readers: Vec<_> = (0..3u64)
        .map(|r| {
            let (e, stop, stolen, keys) = (e.clone(), stop.clone(), stolen.clone(), keys.clone());
            std::thread::spawn(move || lock_check_unlock(&e, &keys, r, &stop, &stolen, on_caller))
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let mut cur = DeviceId(0);
    let mut cur_path: Option<std::path::PathBuf> = None;
    let (mut moves, mut refused) = (0u64, 0u64);
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline && moves < 100_000 && stolen.load(Ordering::Relaxed) == 0 {
        // A fresh target (a file: each has its own path), then move every
        // key off the current device onto it.
        let path = sized_file(dir.path(), &format!("dev{moves}"), DEV_SLOTS * SLOT);
        let (_, info) = e
            .hotplug_add(path.to_str().unwrap(), DEV_SLOTS * SLOT, |_, _| Ok(()))
            .unwrap();
        let force = moves % 4 != 3;
        match e.remove_device(cur, RemoveMode::Migrate, force) {
            Ok(_) => {}
            // Not forced, a locked key blocks (or stays): try again forced.
            Err(err) if !force && err.status() == 409 => {
                refused += 1;
                e.remove_device(cur, RemoveMode::Migrate, true)
                    .unwrap_or_else(|err| panic!("forced remove {moves}: {err:?}"));
            }
            Err(err) => panic!("remove {moves} (force {force}): {err:?}"),
        }
        if let Some(p) = cur_path.replace(path) {
            let _ = std::fs::remove_file(p);
        }
        cur = info.id;
        moves += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let rounds: u64 = readers.into_iter().map(|h| h.join().unwrap()).sum();
    let locked = e.status()["locked_key_count"].as_u64().unwrap();
    // Every reader has unlocked: a non-forced remove must not be blocked.
    let path = sized_file(dir.path(), "last", DEV_SLOTS * SLOT);
    e.hotplug_add(path.to_str().unwrap(), DEV_SLOTS * SLOT, |_, _| Ok(()))
        .unwrap();
    let last = e.remove_device(cur, RemoveMode::Migrate, false);
    eprintln!(
        "moves {moves} (non-forced refused {refused}), reader rounds {rounds}, \
         keys deleted under a reader's lock {}, locks left after every reader unlocked: \
         {locked}, non-forced remove: {:?}",
        stolen.load(Ordering::Relaxed),
        last.as_ref().map(|r| r.moved_keys)
    );
    assert!(moves >= 10 && rounds > 0, "the hunt did not run");
    assert_eq!(
        stolen.load(Ordering::Relaxed),
        0,
        "a plain delete removed a key a reader held locked"
    );
    assert_eq!(locked, 0, "locks left after every reader unlocked");
    assert!(last.is_ok(), "remove after every unlock: {last:?}");
    for (i, &k) in keys.iter().enumerate() {
        let id = e.submit_load(vec![k], vec![vec![0u8; SLOT]]).unwrap();
        let Answer::Ready(r) = e.wait_load(id, W) else {
            panic!("load timed out")
        };
        assert_eq!(r.payload(0), Some(pat(i as u64, 256).as_slice()), "key {i}");
    }
}

/// Status during a remove: every device is listed once, at its index
/// (its id). A remove turns the device into a tombstone (added to the
/// tombstones, then dropped from the live list); a listing that read the
/// live list before and the tombstones after would see the device twice,
/// and every later device one index too far (`status()` numbers devices
/// by position, and a control plane names them by that index). One thread
/// adds and removes devices (at most 3 s, 30 000 cycles; a listing read
/// apart fails within 0.2 s), one lists.
#[test]
fn a_listing_during_a_remove_shows_each_device_once() {
    const SLOT: usize = 4096;
    let e =
        Arc::new(Engine::open(vec![memfd(4, SLOT)], SLOT, true, EngineOptions::default()).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let lister = {
        let (e, stop) = (e.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut seen = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let ids: Vec<u32> = e.devices().iter().map(|d| d.id.0).collect();
                let want: Vec<u32> = (0..ids.len() as u32).collect();
                if ids != want {
                    return Err(format!("after {seen} listings: ids {ids:?}"));
                }
                seen += 1;
            }
            Ok(seen)
        })
    };
    let t0 = Instant::now();
    for c in 0..30_000 {
        if t0.elapsed() > Duration::from_secs(3) || lister.is_finished() {
            break;
        }
        let d = e
            .add_device(&DeviceSpec {
                path: format!("memfd:l{c}"),
                core: CoreConfig::new(ArenaSpec::memfd(SLOT), SLOT),
            })
            .unwrap();
        e.remove_device(d, RemoveMode::Evict, false).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let seen = lister.join().unwrap().unwrap();
    assert!(seen > 0);
}

/// Engine stores skip the put's early presence check on a device their
/// claim just scanned (`Session::put_absent`). Hunt for a key held twice:
/// writers re-store the same few keys (each with its own bytes) and
/// delete them, readers lock / unlock them on the caller, while devices
/// are added and migrated away (forced or not) under them. At the end no
/// key is on two devices, every live slot holds a key, and each key that
/// loads has its own bytes.
#[test]
fn restores_racing_migrations_never_hold_a_key_twice() {
    const SLOT: usize = 4096;
    const KEYS: u64 = 16;
    const DEV_SLOTS: usize = 64;
    let e = Arc::new(
        Engine::open(
            vec![memfd(DEV_SLOTS, SLOT)],
            SLOT,
            true,
            EngineOptions::default(),
        )
        .unwrap(),
    );
    let keys: Vec<Key> = (0..KEYS).map(|i| key("twice", i)).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..3u64)
        .map(|w| {
            let (e, stop, keys) = (e.clone(), stop.clone(), keys.clone());
            std::thread::spawn(move || {
                let mut rounds = 0u64;
                while !stop.load(Ordering::Relaxed) && rounds < 2_000_000 {
                    rounds += 1;
                    let i = (rounds * 7 + w) % KEYS;
                    let k = keys[i as usize];
                    match (rounds + w) % 4 {
                        0 => {
                            e.delete(&[k]);
                        }
                        1 => {
                            let mut out = [false];
                            if e.lookup_and_lock_into(&[k], &mut out) == 1 {
                                e.submit_unlock(&[k]);
                            }
                        }
                        _ => {
                            let _ = store(&e, vec![k], vec![pat(i, 512)]);
                        }
                    }
                }
                rounds
            })
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let mut cur = DeviceId(0);
    let mut moves = 0u64;
    let deadline = Instant::now() + Duration::from_secs(4);
    let mut twice = Vec::new();
    while Instant::now() < deadline && moves < 10_000 {
        let path = sized_file(dir.path(), &format!("dev{moves}"), DEV_SLOTS * SLOT);
        let (_, info) = e
            .hotplug_add(path.to_str().unwrap(), DEV_SLOTS * SLOT, |_, _| Ok(()))
            .unwrap();
        let force = moves.is_multiple_of(2);
        if e.remove_device(cur, RemoveMode::Migrate, force).is_err() {
            e.remove_device(cur, RemoveMode::Migrate, true)
                .unwrap_or_else(|err| panic!("forced remove {moves}: {err:?}"));
        }
        let _ = std::fs::remove_file(&path);
        cur = info.id;
        moves += 1;
        for (i, &k) in keys.iter().enumerate() {
            let on = e.devices_holding(k);
            if on.len() > 1 {
                twice.push((i, on));
            }
        }
        if !twice.is_empty() {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let rounds: u64 = workers.into_iter().map(|h| h.join().unwrap()).sum();
    for (i, &k) in keys.iter().enumerate() {
        let on = e.devices_holding(k);
        if on.len() > 1 {
            twice.push((i, on));
        }
    }
    eprintln!("moves {moves}, worker rounds {rounds}, keys held twice {twice:?}");
    assert!(moves >= 5 && rounds > 0, "the hunt did not run");
    assert!(twice.is_empty(), "keys held on two devices: {twice:?}");
    assert_eq!(e.status()["locked_key_count"], 0, "locks left");
    let held = keys
        .iter()
        .filter(|&&k| !e.devices_holding(k).is_empty())
        .count();
    let live: usize = e.devices().iter().map(|d| d.live_slots).sum();
    assert_eq!(live, held, "live slots that hold no key");
    for (i, &k) in keys.iter().enumerate() {
        let id = e.submit_load(vec![k], vec![vec![0u8; SLOT]]).unwrap();
        let Answer::Ready(r) = e.wait_load(id, W) else {
            panic!("load timed out")
        };
        if let Some(p) = r.payload(0) {
            assert_eq!(p, pat(i as u64, 512).as_slice(), "key {i}: not its bytes");
        }
    }
    e.check_invariants().unwrap();
}
