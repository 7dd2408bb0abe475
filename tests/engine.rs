//! Engine scenarios: docs/lmcache-dax-behavior.md §8.1 items 1 and 12-18 and
//! §8.3 item 1, with bytes verified on every load, plus concurrency, task
//! splitting, close and fault injection. Real memfds / tmpfs files, real
//! eventfds, real threads.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use daxkv::device::arena::{ArenaSource, ArenaSpec};
use daxkv::engine::{Answer, DeviceSpec, Engine, EngineOptions, Listener, Signal, TaskId};
use daxkv::plumbing::buf::{Buf, RawBuf};
use daxkv::{CoreConfig, Key};

const SLOT: usize = 4096;
const T: Duration = Duration::from_secs(10);

fn memfd_dev(slots: usize) -> DeviceSpec {
    DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(slots * SLOT), SLOT),
    }
}

fn engine_with(devs: Vec<DeviceSpec>, opts: EngineOptions) -> Engine {
    Engine::open(devs, SLOT, false, opts).unwrap()
}

fn engine(slots: usize) -> Engine {
    engine_with(vec![memfd_dev(slots)], EngineOptions::default())
}

fn k(i: u32) -> Key {
    Key::digest(format!("model@00000000@0@{i:064x}").as_bytes())
}

fn payload(i: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u32).wrapping_mul(7).wrapping_add(i * 13) as u8)
        .collect()
}

fn store(e: &Engine, ids: &[u32], len: usize) -> bool {
    let keys = ids.iter().map(|&i| k(i)).collect();
    let bufs = ids.iter().map(|&i| Buf::from(payload(i, len))).collect();
    let id = e.submit_store(keys, bufs).unwrap();
    let mut got = Vec::new();
    while got.is_empty() {
        got = e.wait_stores(T);
    }
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, id);
    got[0].1.success
}

/// Raw descriptors of `bufs`, for `submit_load_raw`.
///
/// # Safety
/// `bufs` must outlive the task and stay untouched until its completion is
/// observed (`RawBuf`'s lifetime rule).
unsafe fn raw_views(bufs: &mut [Vec<u8>]) -> Vec<RawBuf> {
    bufs.iter_mut()
        // SAFETY: the caller's promise, passed on.
        .map(|b| unsafe { RawBuf::new(b.as_mut_ptr(), b.len()) })
        .collect()
}

#[derive(Default)]
struct Events {
    stored: Mutex<Vec<Key>>,
    accessed: Mutex<Vec<Key>>,
    deleted: Mutex<Vec<Key>>,
}
impl Listener for Events {
    fn on_keys_stored(&self, keys: &[Key], sizes: &[usize]) {
        assert!(sizes.iter().all(|&s| s == SLOT), "usage is slot-based");
        self.stored.lock().unwrap().extend_from_slice(keys);
    }
    fn on_keys_accessed(&self, keys: &[Key]) {
        self.accessed.lock().unwrap().extend_from_slice(keys);
    }
    fn on_keys_deleted(&self, keys: &[Key]) {
        self.deleted.lock().unwrap().extend_from_slice(keys);
    }
}

/// docs/lmcache-dax-behavior.md §8.1 item 1: three distinct, non-blocking,
/// close-on-exec eventfds.
#[test]
fn three_distinct_nonblocking_event_fds() {
    let e = engine(4);
    let fds = e.event_fds();
    assert!(fds[0] != fds[1] && fds[1] != fds[2] && fds[0] != fds[2]);
    for fd in fds {
        // SAFETY: fcntl queries on live fds.
        let (fl, fdfl) = unsafe {
            (
                libc::fcntl(fd, libc::F_GETFL),
                libc::fcntl(fd, libc::F_GETFD),
            )
        };
        assert!(fl & libc::O_NONBLOCK != 0 && fdfl & libc::FD_CLOEXEC != 0);
    }
    let other = engine(4);
    assert!(
        other.event_fds().iter().all(|f| !fds.contains(f)),
        "distinct across engines too"
    );
}

/// docs/lmcache-dax-behavior.md §8.1 item 12: store, lookup, load round trip
/// with holes, one-shot queries, untouched miss buffers and listener events.
#[test]
fn store_lookup_load_round_trip() {
    let e = engine(8);
    let ev = Arc::new(Events::default());
    let l: Arc<dyn Listener> = ev.clone();
    e.register_listener(&l);
    assert!(store(&e, &[0, 2], 3000));
    assert_eq!(*ev.stored.lock().unwrap(), vec![k(0), k(2)]);

    let id = e.submit_lookup_and_lock(vec![k(0), k(1), k(2)]).unwrap();
    let bm = e.wait_lookup(id, T).ready().unwrap();
    assert_eq!(bm.to_vec(), vec![true, false, true]);
    assert_eq!(bm.count_leading_ones(), 1);
    assert!(e.query_lookup(id).ready().is_none(), "one-shot");

    let id = e
        .submit_load(vec![k(0), k(1), k(2)], vec![vec![0xEE; SLOT]; 3])
        .unwrap();
    let r = e.wait_load(id, T).ready().unwrap();
    assert_eq!(r.bitmap.to_vec(), vec![true, false, true]);
    assert_eq!(&r.bufs[0][..3000], &payload(0, 3000)[..]);
    assert!(
        r.bufs[0][3000..].iter().all(|&b| b == 0xEE),
        "bytes past the payload untouched"
    );
    assert!(
        r.bufs[1].iter().all(|&b| b == 0xEE),
        "miss buffer untouched"
    );
    assert_eq!(&r.bufs[2][..3000], &payload(2, 3000)[..]);
    assert!(e.query_load(id).ready().is_none(), "one-shot");
    assert_eq!(*ev.accessed.lock().unwrap(), vec![k(0), k(2)]);
    e.submit_unlock(&[k(0), k(2)]);
    assert_eq!(e.delete(&[k(0), k(1)]), vec![k(0)]);
    assert_eq!(*ev.deleted.lock().unwrap(), vec![k(0)]);
}

/// docs/lmcache-dax-behavior.md §8.1 item 13: two lookups need two unlocks
/// before delete succeeds.
#[test]
fn lock_refcount_across_tasks() {
    let e = engine(4);
    assert!(store(&e, &[1], 100));
    for _ in 0..2 {
        let id = e.submit_lookup_and_lock(vec![k(1)]).unwrap();
        assert!(e.wait_lookup(id, T).ready().unwrap().test(0));
    }
    assert_eq!(e.status()["locked_key_count"], 1);
    assert!(e.delete(&[k(1)]).is_empty());
    e.submit_unlock(&[k(1)]);
    assert!(e.delete(&[k(1)]).is_empty(), "one lock left");
    e.submit_unlock(&[k(1)]);
    assert_eq!(e.delete(&[k(1)]), vec![k(1)]);
}

// docs/lmcache-dax-behavior.md §8.1 item 14 (deleting a borrowed slot keeps usage until the read ends)
// needs a borrowed read of a device's core: it is a unit test beside the
// pool (`engine::pool::tests`).

/// docs/lmcache-dax-behavior.md §8.1 item 15: a full arena fails the store
/// task; no internal eviction.
#[test]
fn full_arena_fails_the_store_task() {
    let e = engine(2);
    assert!(!store(&e, &[1, 2, 3], 10), "third key does not fit");
    assert_eq!(e.usage(), ((2 * SLOT) as u64, (2 * SLOT) as u64));
    let id = e.submit_lookup_and_lock(vec![k(1), k(2), k(3)]).unwrap();
    assert_eq!(
        e.wait_lookup(id, T).ready().unwrap().to_vec(),
        vec![true, true, false]
    );
    e.submit_unlock(&[k(1), k(2)]);
}

/// docs/lmcache-dax-behavior.md §8.1 item 18 and §8.3 item 1: a reopened engine
/// on the same file starts empty.
#[test]
fn restart_is_volatile() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dax.img");
    let spec = |src| DeviceSpec {
        path: path.display().to_string(),
        core: CoreConfig::new(ArenaSpec::new(src, 4 * SLOT), SLOT),
    };
    let e = engine_with(
        vec![spec(ArenaSource::CreateFile(path.clone()))],
        EngineOptions::default(),
    );
    assert!(store(&e, &[1], 10));
    e.close();
    drop(e);
    let e = engine_with(
        vec![spec(ArenaSource::Path(path.clone()))],
        EngineOptions::default(),
    );
    let id = e.submit_lookup_and_lock(vec![k(1)]).unwrap();
    assert!(!e.wait_lookup(id, T).ready().unwrap().test(0));
    assert_eq!(e.usage().0, 0);
}

/// Two devices: new keys go to the emptier one, existing keys stay, and
/// lookups and loads find keys on either.
#[test]
fn two_devices_balance_and_serve() {
    let e = engine_with(vec![memfd_dev(4), memfd_dev(4)], EngineOptions::default());
    assert!(store(&e, &[1, 2, 3, 4], 100));
    let live: Vec<usize> = e.devices().iter().map(|d| d.live_slots).collect();
    assert_eq!(live, vec![2, 2], "lowest usage first");
    assert!(store(&e, &[1], 100), "re-store is a no-op success");
    assert_eq!(e.devices().iter().map(|d| d.live_slots).sum::<usize>(), 4);
    // Lookup batches per device over the keys still missing.
    let id = e
        .submit_lookup_and_lock(vec![k(1), k(9), k(2), k(3), k(4)])
        .unwrap();
    assert_eq!(
        e.wait_lookup(id, T).ready().unwrap().to_vec(),
        vec![true, false, true, true, true]
    );
    assert_eq!(
        e.status()["locked_key_count"],
        4,
        "each hit locked once, on its own device"
    );
    e.submit_unlock(&[k(1), k(2), k(3), k(4)]);
    assert_eq!(e.status()["locked_key_count"], 0);
    let keys: Vec<Key> = (1..=4).map(k).collect();
    let id = e.submit_load(keys, vec![vec![0; 100]; 4]).unwrap();
    let r = e.wait_load(id, T).ready().unwrap();
    assert_eq!(r.bitmap.count_ones(), 4);
    for i in 0..4 {
        assert_eq!(r.bufs[i], payload(i as u32 + 1, 100));
    }
    assert_eq!(e.status()["num_devices"], 2);
}

/// Many tasks in flight from two submitting threads: every store completes
/// exactly once and every key reads back.
#[test]
fn many_tasks_from_two_threads() {
    let e = Arc::new(engine(512));
    let hs: Vec<_> = (0..2u32)
        .map(|t| {
            let e = e.clone();
            std::thread::spawn(move || {
                let mut ids = Vec::new();
                for n in 0..100u32 {
                    let id0 = t * 1000 + n * 2;
                    let keys = vec![k(id0), k(id0 + 1)];
                    let bufs = vec![Buf::from(payload(id0, 64)), Buf::from(payload(id0 + 1, 64))];
                    ids.push(e.submit_store(keys, bufs).unwrap());
                }
                ids
            })
        })
        .collect();
    let mut submitted: Vec<TaskId> = hs.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let mut done = Vec::new();
    while done.len() < submitted.len() {
        let got = e.wait_stores(T);
        assert!(
            !got.is_empty(),
            "timed out with {} of {} done",
            done.len(),
            submitted.len()
        );
        for (id, r) in got {
            assert!(r.success);
            assert_eq!(r.bytes_transferred, 2 * SLOT as u64);
            done.push(id);
        }
    }
    submitted.sort();
    done.sort();
    assert_eq!(done, submitted, "each store task exactly once");
    assert!(e.pop_completed_stores().is_empty());
    let keys: Vec<Key> = (0..2u32)
        .flat_map(|t| (0..200).map(move |n| k(t * 1000 + n)))
        .collect();
    let id = e
        .submit_load(keys.clone(), vec![vec![0; 64]; keys.len()])
        .unwrap();
    let r = e.wait_load(id, T).ready().unwrap();
    assert_eq!(r.bitmap.count_ones(), 400);
}

/// A load of many keys is split across the load workers and completes once,
/// with every destination written by exactly one part.
#[test]
fn split_load_completes_exactly_once() {
    let opts = EngineOptions {
        num_load_workers: 4,
        ..EngineOptions::default()
    };
    let e = engine_with(vec![memfd_dev(128)], opts);
    let ids: Vec<u32> = (0..100).collect();
    assert!(store(&e, &ids, 1000));
    let keys: Vec<Key> = ids.iter().map(|&i| k(i)).collect();
    let mut bufs: Vec<Vec<u8>> = vec![vec![0; 1000]; 100];
    // SAFETY: `bufs` outlives the task (we wait for it below) and is not
    // touched until then.
    let raw = unsafe { raw_views(&mut bufs) };
    let id = e.submit_load_raw(keys, raw).unwrap();
    let r = e.wait_load(id, T).ready().unwrap();
    assert_eq!(r.bitmap.count_ones(), 100);
    assert!(r.bufs.is_empty(), "raw buffers are the caller's");
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(*b, payload(i as u32, 1000), "key {i}");
    }
    assert!(e.query_load(id).ready().is_none());
    assert_eq!(e.status()["inflight_load_tasks"], 0);
}

/// An injected worker panic fails its task, is counted, and the pool keeps
/// serving other tasks.
#[test]
fn worker_panic_fails_one_task_only() {
    let opts = EngineOptions {
        panic_on_key: Some(k(666)),
        ..EngineOptions::default()
    };
    let e = engine_with(vec![memfd_dev(8)], opts);
    assert!(store(&e, &[1], 10));
    let bad = e.submit_lookup_and_lock(vec![k(1), k(666)]).unwrap();
    let good = e.submit_lookup_and_lock(vec![k(1)]).unwrap();
    assert_eq!(
        e.wait_lookup(bad, T).ready().unwrap().count_ones(),
        0,
        "the panicking task fails as a whole"
    );
    assert!(e.wait_lookup(good, T).ready().unwrap().test(0));
    assert_eq!(e.status()["worker_panics"], 1);
    assert!(store(&e, &[2], 10), "the store pool is unaffected");
    e.submit_unlock(&[k(1)]);
}

/// Unequal lists and closing are errors that say what was wrong.
#[test]
fn bad_submissions_are_refused_cleanly() {
    let e = engine(4);
    let err = e
        .submit_store(vec![k(1), k(2)], vec![Buf::from(vec![1u8])])
        .unwrap_err();
    assert_eq!(err.to_string(), "submit_store: 2 keys but 1 buffers");
    let err = e.submit_load(vec![k(1)], vec![]).unwrap_err();
    assert_eq!(err.to_string(), "submit_load: 1 keys but 0 buffers");
    let err = Engine::open(vec![], SLOT, false, EngineOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "devices may be empty only when hotplug_enabled is true"
    );
    let err = Engine::open(
        vec![memfd_dev(2)],
        SLOT,
        false,
        EngineOptions {
            num_load_workers: 0,
            ..EngineOptions::default()
        },
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "num_load_workers must be a positive integer (got 0)"
    );
    let err = Engine::open(
        vec![memfd_dev(2)],
        SLOT,
        false,
        EngineOptions {
            task_slots: 1 << 20,
            task_keys: 1 << 10,
            ..EngineOptions::default()
        },
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "task_slots × task_keys = 1048576 × 1024 keys of preallocated task records exceeds 16777216 (16 bytes each)"
    );
    assert_eq!(
        e.status()["inflight_store_tasks"],
        0,
        "refused tasks are not counted"
    );
    assert_eq!(e.devices()[0].live_slots, 0);
}

/// Worker threads are gone after close (no thread leak).
#[test]
fn close_joins_every_worker() {
    #[path = "common/threads.rs"]
    mod count;
    use count::threads;
    let counter = Arc::new(AtomicUsize::new(0));
    let before = threads();
    for _ in 0..3 {
        let e = engine(2);
        counter.fetch_add(1, Ordering::Relaxed);
        e.close();
    }
    // Other tests run in parallel threads; allow their churn but not ours
    // (3 engines x 6 workers = 18).
    assert!(threads() < before + 18, "{before} -> {}", threads());
}

/// LMCache's adapter JSON opens an engine; `cpus` pins every worker.
#[test]
fn config_json_opens_and_pins_workers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dax0.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let json = format!(
        r#"{{"type":"dax","slot_bytes":4096,"devices":[{{"device_path":"{}","max_dax_size_gb":0.0009765625}}],
            "num_store_workers":1,"num_lookup_workers":1,"num_load_workers":2,"cpus":[0],"spin_us":10}}"#,
        path.display()
    );
    let cfg = daxkv::control::config::EngineConfig::from_json(&json).unwrap();
    let e = cfg.open().unwrap();
    assert_eq!(e.devices()[0].max_slots, 256);
    assert!(store(&e, &[5], 100));
    // Every worker of this engine is pinned to CPU 0, as the kernel says.
    // Each is read by its tid: a walk of /proc/self/task can skip live
    // threads while other tests' threads exit (the kernel resumes the walk
    // by index), which once made this count 3 of 4.
    let placed = e.worker_placement();
    assert_eq!(placed.len(), 4, "{placed:?}");
    for w in &placed {
        let status = std::fs::read_to_string(format!("/proc/self/task/{}/status", w.tid))
            .unwrap_or_else(|err| panic!("{}: {err}", w.name));
        let allowed = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .map(str::trim);
        assert_eq!(allowed, Some("0"), "{} (tid {})", w.name, w.tid);
        let comm = std::fs::read_to_string(format!("/proc/self/task/{}/comm", w.tid)).unwrap();
        assert_eq!(comm.trim(), w.name, "tid {} is this worker", w.tid);
    }
    let bad = daxkv::control::config::EngineConfig::from_json(r#"{"slot_bytes":4096,"devices":[{"device_path":"/nonexistent/dax9.9","max_dax_size_gb":1}]}"#).unwrap();
    let err = bad.open().unwrap_err();
    assert!(err.to_string().contains("/nonexistent/dax9.9"), "{err}");
}

/// Close while a large load is running: close waits for it, and its result
/// (bytes included) can still be collected afterwards.
#[test]
fn close_while_a_load_runs_lets_it_finish() {
    const BIG: usize = 64 << 10;
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(64 * BIG), BIG),
    };
    let e = Engine::open(vec![dev], BIG, false, EngineOptions::default()).unwrap();
    let keys: Vec<Key> = (0..64).map(k).collect();
    let bufs = (0..64).map(|i| Buf::from(payload(i, BIG))).collect();
    e.submit_store(keys.clone(), bufs).unwrap();
    assert!(e.wait_stores(T)[0].1.success);
    let id = e.submit_load(keys, vec![vec![0; BIG]; 64]).unwrap();
    e.close();
    let r = e.query_load(id).ready().expect("close waited for the load");
    assert_eq!(r.bitmap.count_ones(), 64);
    for (i, b) in r.bufs.iter().enumerate() {
        assert_eq!(*b, payload(i as u32, BIG), "key {i}");
    }
}

/// `Signal::WhenWaiting`: a caller that finds its results while spinning
/// costs the workers no eventfd write; a parked caller is still woken.
/// `Signal::Always` (LMCache's contract) writes after every completion.
#[test]
fn completion_signals_are_coalesced_when_asked() {
    // Eventfd writes the workers made (the engine counts them; reading
    // the fd here would hand it out, which switches signalling on).
    let counter = |e: &Engine| e.status()["signals"]["lookup"].as_u64().unwrap();
    // A 5 s spin: the caller finds each result while spinning, even on a
    // loaded machine.
    for (signal, spin) in [
        (Signal::WhenWaiting, Duration::from_secs(5)),
        (Signal::Always, Duration::from_secs(5)),
    ] {
        let e = engine_with(
            vec![memfd_dev(8)],
            EngineOptions {
                signal,
                spin,
                // The caller spins as long: it must find each result while
                // spinning (a parked caller drains the eventfd).
                wait_spin: spin,
                ..EngineOptions::default()
            },
        );
        assert!(store(&e, &[1], 10));
        let before = counter(&e);
        for _ in 0..20 {
            let id = e.submit_lookup_and_lock(vec![k(1)]).unwrap();
            assert!(
                e.wait_lookup(id, T).ready().unwrap().test(0),
                "found while spinning"
            );
            e.submit_unlock(&[k(1)]);
        }
        let writes = counter(&e) - before;
        match signal {
            Signal::WhenWaiting => assert_eq!(writes, 0, "no eventfd write for a spinning caller"),
            Signal::Always => assert_eq!(writes, 20, "one write per completion"),
        }
    }
    // A parked caller (no spin) is still woken in WhenWaiting mode: by the
    // eventfd, not by the 50 ms re-check (median well under 40 ms; without
    // the signal every wait would take ~50 ms).
    let e = engine_with(
        vec![memfd_dev(8)],
        EngineOptions {
            signal: Signal::WhenWaiting,
            spin: Duration::ZERO,
            ..EngineOptions::default()
        },
    );
    assert!(store(&e, &[1], 10));
    let mut took: Vec<Duration> = (0..21)
        .map(|_| {
            let t0 = std::time::Instant::now();
            let id = e.submit_lookup_and_lock(vec![k(1)]).unwrap();
            assert!(e.wait_lookup(id, T).ready().unwrap().test(0));
            e.submit_unlock(&[k(1)]);
            t0.elapsed()
        })
        .collect();
    took.sort();
    assert!(
        took[10] < Duration::from_millis(40),
        "median wait {:?}",
        took[10]
    );
}

/// `Signal::WhenWaiting` cannot hang an fd poller: once the lookup fd is
/// handed out, its poller counts as a waiter for good, so a completion it
/// polls for is signalled although no `wait_*` caller is parked (and the
/// handout itself writes the fd once, for results that finished before
/// it). With the handout not counted, `poll` times out.
#[test]
fn when_waiting_signals_an_fd_poller() {
    let e = engine_with(
        vec![memfd_dev(8)],
        EngineOptions {
            signal: Signal::WhenWaiting,
            ..EngineOptions::default()
        },
    );
    assert!(store(&e, &[1], 10));
    let poll_in = |fd: i32, ms: i32| -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd on the stack.
        unsafe { libc::poll(&raw mut p, 1, ms) == 1 }
    };
    let drain = |fd: i32| {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes from the engine's live non-blocking eventfd
        // into a local.
        let _ = unsafe { libc::read(fd, std::ptr::from_mut(&mut v).cast(), 8) };
    };
    // A lookup finished before anyone took the fd: not signalled then.
    let early = e.submit_lookup_and_lock(vec![k(1)]).unwrap();
    while e.status()["inflight_lookup_tasks"] != 0 {
        std::thread::yield_now();
    }
    assert_eq!(e.status()["signals"]["lookup"], 0, "nobody was waiting");
    let fd = e.lookup_event_fd();
    assert!(poll_in(fd, 5_000), "the handout signals earlier results");
    drain(fd);
    assert!(matches!(e.query_lookup(early), Answer::Ready(_)));
    for _ in 0..10 {
        let id = e.submit_lookup_and_lock(vec![k(1)]).unwrap();
        assert!(poll_in(fd, 5_000), "an fd poller was not signalled");
        drain(fd);
        // Poll, then collect (LMCache's controller does this).
        let got = loop {
            match e.query_lookup(id) {
                Answer::Pending => std::thread::yield_now(),
                a => break a,
            }
        };
        assert!(matches!(got, Answer::Ready(b) if b.test(0)));
    }
    e.submit_unlock(&[k(1); 11]);
    assert_eq!(e.status()["locked_key_count"], 0);
}

/// Per-thread `Submitter`s submit without the shared lock: two threads,
/// each with its own rings to every worker, 100 store tasks each, then
/// lookups and loads through them; every task completes exactly once.
#[test]
fn submitters_give_each_thread_its_own_rings() {
    let opts = EngineOptions {
        num_load_workers: 2,
        ..EngineOptions::default()
    };
    let e = Arc::new(engine_with(vec![memfd_dev(512)], opts));
    let ids: Vec<TaskId> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u32)
            .map(|t| {
                let e = &e;
                s.spawn(move || {
                    let mut sub = e.submitter().unwrap();
                    (0..100u32)
                        .map(|n| {
                            let id0 = t * 1000 + n;
                            sub.submit_store(vec![k(id0)], vec![Buf::from(payload(id0, 64))])
                                .unwrap()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let mut done = Vec::new();
    while done.len() < ids.len() {
        let got = e.wait_stores(T);
        assert!(
            !got.is_empty(),
            "timed out at {} of {}",
            done.len(),
            ids.len()
        );
        done.extend(got.into_iter().map(|(id, r)| {
            assert!(r.success);
            id
        }));
    }
    done.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(done, want, "each task exactly once");
    let mut sub = e.submitter().unwrap();
    let keys: Vec<Key> = (0..2u32)
        .flat_map(|t| (0..100).map(move |n| k(t * 1000 + n)))
        .collect();
    let id = sub.submit_lookup_and_lock(keys.clone()).unwrap();
    assert_eq!(e.wait_lookup(id, T).ready().unwrap().count_ones(), 200);
    e.submit_unlock(&keys);
    let id = sub
        .submit_load(keys.clone(), vec![vec![0; 64]; 200])
        .unwrap();
    let r = e.wait_load(id, T).ready().unwrap();
    assert_eq!(r.bitmap.count_ones(), 200);
    assert_eq!(r.bufs[150], payload(1050, 64));
    // Raw destinations through the submitter.
    let mut raw_bufs = vec![vec![0u8; 64]; 200];
    // SAFETY: `raw_bufs` outlives the task (waited for below) and is not
    // touched until then.
    let raw = unsafe { raw_views(&mut raw_bufs) };
    let id = sub.submit_load_raw(keys.clone(), raw).unwrap();
    assert_eq!(e.wait_load(id, T).ready().unwrap().bitmap.count_ones(), 200);
    assert_eq!(raw_bufs[7], payload(7, 64));
    assert!(
        sub.submit_store(vec![k(1)], vec![]).is_err(),
        "unequal lists are refused"
    );
    e.close();
    assert!(matches!(
        sub.submit_lookup_and_lock(vec![k(1)]),
        Err(daxkv::engine::Refused {
            error: daxkv::engine::EngineError::Closing,
            ..
        })
    ));
}

/// A store task of many keys is split over the store workers (both run a
/// part), completes once, and every key reads back its own bytes.
#[test]
fn split_store_spreads_over_store_workers() {
    let opts = EngineOptions {
        num_store_workers: 2,
        ..EngineOptions::default()
    };
    let e = engine_with(vec![memfd_dev(128)], opts);
    let ids: Vec<u32> = (0..64).collect();
    assert!(store(&e, &ids, 3000));
    let parts: Vec<u64> = serde_json::from_value(e.status()["parts_run"]["store"].clone()).unwrap();
    assert_eq!(parts, vec![1, 1], "one part on each store worker");
    let keys: Vec<Key> = ids.iter().map(|&i| k(i)).collect();
    let id = e.submit_load(keys, vec![vec![0; 3000]; 64]).unwrap();
    let r = e.wait_load(id, T).ready().unwrap();
    assert_eq!(r.bitmap.count_ones(), 64);
    for (i, b) in r.bufs.iter().enumerate() {
        assert_eq!(*b, payload(i as u32, 3000), "key {i}");
    }
    assert!(
        e.pop_completed_stores().is_empty(),
        "the task completed once"
    );
    assert_eq!(e.status()["inflight_store_tasks"], 0);
}

/// A full task table refuses the next task with an error naming the
/// capacity; nothing is lost, and collecting one result frees its record.
#[test]
fn full_task_table_refuses_then_recovers() {
    let opts = EngineOptions {
        task_slots: 2,
        ..EngineOptions::default()
    };
    let e = engine_with(vec![memfd_dev(8)], opts);
    assert!(store(&e, &[1, 2], 10));
    let a = e.submit_lookup_and_lock(vec![k(1)]).unwrap();
    let b = e.submit_lookup_and_lock(vec![k(2)]).unwrap();
    // Both finish, uncollected: their records stay taken.
    while e.status()["inflight_lookup_tasks"] != 0 {
        std::thread::yield_now();
    }
    let err = e
        .submit_lookup_and_lock(vec![k(1)])
        .expect_err("accepted with the table full");
    assert_eq!(
        err.to_string(),
        "task table full: 2 tasks in flight or awaiting collection"
    );
    assert_eq!(e.status()["inflight_lookup_tasks"], 0, "refusal undone");
    assert!(e.wait_lookup(a, T).ready().unwrap().test(0));
    // Table slot of `a` is free again: some later id maps onto it.
    // (An id that maps to `b`'s record is refused and skipped.)
    let c = loop {
        if let Ok(id) = e.submit_lookup_and_lock(vec![k(1)]) {
            break id;
        }
    };
    assert!(e.wait_lookup(b, T).ready().unwrap().test(0));
    assert!(e.wait_lookup(c, T).ready().unwrap().test(0));
    e.submit_unlock(&[k(1), k(1), k(2)]);
    assert_eq!(e.status()["locked_key_count"], 0, "no lock left behind");
}

/// Tasks larger than `task_keys` (and than an inline bitmap's 256 keys)
/// grow their record once and report every key.
#[test]
fn tasks_larger_than_the_record_grow_it() {
    let opts = EngineOptions {
        task_keys: 4,
        task_slots: 4,
        ..EngineOptions::default()
    };
    let e = engine_with(vec![memfd_dev(400)], opts);
    let ids: Vec<u32> = (0..300).collect();
    assert!(store(&e, &ids, 100));
    // Every other key missing, so the bitmap's words are checked bit by bit.
    let mut keys: Vec<Key> = ids.iter().map(|&i| k(i)).collect();
    for (j, key) in keys.iter_mut().enumerate() {
        if j % 2 == 1 {
            *key = k(100_000 + j as u32);
        }
    }
    for _ in 0..3 {
        // Three rounds: the grown records are reused.
        let id = e.submit_lookup_and_lock(keys.clone()).unwrap();
        let b = e.wait_lookup(id, T).ready().unwrap();
        assert_eq!(b.len(), 300);
        assert_eq!(b.to_vec(), (0..300).map(|j| j % 2 == 0).collect::<Vec<_>>());
        let hits: Vec<Key> = keys.iter().step_by(2).copied().collect();
        e.submit_unlock(&hits);
        let id = e
            .submit_load(keys.clone(), vec![vec![0; 100]; 300])
            .unwrap();
        let r = e.wait_load(id, T).ready().unwrap();
        assert_eq!(r.bitmap.count_ones(), 150);
        for (j, b) in r.bufs.iter().enumerate() {
            if j % 2 == 0 {
                assert_eq!(*b, payload(j as u32, 100), "key {j}");
            } else {
                assert!(b.iter().all(|&x| x == 0), "a miss leaves its buffer alone");
            }
        }
    }
}

/// Two threads polling the same lookup: exactly one gets the result.
#[test]
fn a_result_is_handed_out_once_under_racing_pollers() {
    let e = engine(64);
    assert!(store(&e, &[1], 10));
    for _ in 0..200 {
        let id = e.submit_lookup_and_lock(vec![k(1)]).unwrap();
        let got = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    let start = std::time::Instant::now();
                    // Poll until one of the two has it (or give up late).
                    while got.load(Ordering::Relaxed) == 0 && start.elapsed() < T {
                        if let Some(b) = e.query_lookup(id).ready() {
                            assert!(b.test(0));
                            got.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        std::thread::yield_now();
                    }
                });
            }
        });
        assert_eq!(got.load(Ordering::Relaxed), 1);
        assert!(e.query_lookup(id).ready().is_none(), "and never again");
        e.submit_unlock(&[k(1)]);
    }
    assert_eq!(e.status()["locked_key_count"], 0);
}

/// Loads of 1 MiB and more are written with streaming stores
/// (`device::core::STREAM_LOAD_MIN_BYTES`): lengths on and off a cache
/// line, into destinations at odd offsets (raw descriptors into one
/// buffer), arrive whole, and nothing past a payload is written.
#[test]
fn large_loads_arrive_whole_at_any_length_and_offset() {
    const BIG: usize = 2 << 20;
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(4 * BIG), BIG),
    };
    let e = Engine::open(vec![dev], BIG, false, EngineOptions::default()).unwrap();
    let lens = [1 << 20, (1 << 20) + 13, BIG - 1];
    let keys: Vec<Key> = (0..3).map(k).collect();
    let bufs = lens
        .iter()
        .zip(0u32..)
        .map(|(&len, i)| Buf::from(payload(i, len)))
        .collect();
    let id = e.submit_store(keys.clone(), bufs).unwrap();
    assert!(e.wait_store(id, T).ready().unwrap().success);
    // One buffer, destinations at 1, 3 and 7 bytes past 2 MiB boundaries.
    let mut big = vec![0xEEu8; 3 * (BIG + 64)];
    let at = [1usize, BIG + 64 + 3, 2 * (BIG + 64) + 7];
    let raws: Vec<RawBuf> = at
        .iter()
        .map(|&o| {
            // SAFETY: `big` outlives the task (waited for below) and is
            // not touched until its completion; the ranges are disjoint.
            unsafe { RawBuf::new(big.as_mut_ptr().add(o), BIG) }
        })
        .collect();
    let id = e.submit_load_raw(keys, raws).unwrap();
    let r = e.wait_load(id, T).ready().unwrap();
    assert_eq!(r.bitmap.to_vec(), [true; 3]);
    for ((&o, &len), i) in at.iter().zip(&lens).zip(0u32..) {
        assert_eq!(&big[o..o + len], &payload(i, len)[..], "object {i}");
        assert!(
            big[o + len..o + BIG].iter().all(|&b| b == 0xEE),
            "past object {i}"
        );
        assert_eq!(big[o - 1], 0xEE, "before object {i}");
    }
    e.close();
}
