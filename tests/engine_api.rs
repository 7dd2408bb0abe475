//! The embedding API as a Rust inference server uses it: per-task store
//! waits from several threads, a refused submit retried with the inputs it
//! handed back, payload lengths of tail chunks, owned `Submitter`s, typed
//! answers, and what `close` leaves for waiters and collectors.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{
    Answer, DeviceSpec, Engine, EngineError, EngineOptions, Listener, Op, Refused, Submitter,
    TaskId, TaskKind,
};
use daxkv::plumbing::buf::{Buf, RawBuf};
use daxkv::{CoreConfig, Key};

const SLOT: usize = 4096;
const T: Duration = Duration::from_secs(20);

fn engine(slots: usize, opts: EngineOptions) -> Engine {
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(slots * SLOT), SLOT),
    };
    Engine::open(vec![dev], SLOT, false, opts).unwrap()
}

fn k(i: u32) -> Key {
    Key::digest(&i.to_le_bytes())
}

fn payload(i: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u32).wrapping_mul(31).wrapping_add(i * 7) as u8)
        .collect()
}

/// Four server threads each submit stores and wait for their own results
/// by id (`wait_store`), with a task table of 8 records so records must
/// be recycled through the by-id path: every task is answered once, to
/// its own thread, and no record is left taken.
#[test]
fn four_threads_each_wait_for_their_own_stores() {
    let e = Arc::new(engine(
        1024,
        EngineOptions {
            task_slots: 8,
            num_store_workers: 2,
            ..EngineOptions::default()
        },
    ));
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let e = e.clone();
            std::thread::spawn(move || {
                let mut mine = 0;
                for i in 0..200u32 {
                    let key = t * 1000 + i;
                    let mut inputs = (vec![k(key)], vec![Buf::from(payload(key, 100))]);
                    // The table is shared by four threads with two tasks in
                    // flight each: a refusal hands the inputs back to retry.
                    let id = loop {
                        match e.submit_store(inputs.0, inputs.1) {
                            Ok(id) => break id,
                            Err(r) => {
                                assert!(
                                    matches!(r.error, EngineError::TooManyInFlight { .. }),
                                    "{r}"
                                );
                                inputs = r.into_inputs();
                                std::thread::yield_now();
                            }
                        }
                    };
                    match e.wait_store(id, T) {
                        Answer::Ready(r) => {
                            assert!(r.success, "thread {t} store {i}");
                            mine += 1;
                        }
                        other => panic!("thread {t} store {i}: {other:?}"),
                    }
                    assert_eq!(e.query_store(id), Answer::Unknown, "one-shot");
                }
                mine
            })
        })
        .collect();
    let total: usize = threads.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(total, 800);
    assert!(
        e.pop_completed_stores().is_empty(),
        "nothing delivered twice"
    );
    assert_eq!(e.status()["task_records_in_use"], 0, "every record freed");
    assert_eq!(e.devices()[0].live_slots, 800);
}

/// Per-id waiters and a global popper at once: each result goes to exactly
/// one of them (whoever takes it first), none is lost, and the records all
/// come back. Store rings keep their no-overflow bound although by-id
/// takers free records in either order with the popper.
#[test]
fn per_id_waits_and_the_global_pop_share_results_exactly_once() {
    let e = Arc::new(engine(
        2048,
        EngineOptions {
            task_slots: 16,
            num_store_workers: 2,
            ..EngineOptions::default()
        },
    ));
    let delivered = Arc::new(Mutex::new(Vec::<TaskId>::new()));
    let submitted = Arc::new(Mutex::new(Vec::<TaskId>::new()));
    let done = Arc::new(AtomicUsize::new(0));
    let popper = {
        let (e, delivered, done) = (e.clone(), delivered.clone(), done.clone());
        std::thread::spawn(move || {
            while done.load(Ordering::SeqCst) < 3 {
                for (id, r) in e.wait_stores(Duration::from_millis(5)) {
                    assert!(r.success);
                    delivered.lock().unwrap().push(id);
                }
            }
        })
    };
    let waiters: Vec<_> = (0..3u32)
        .map(|t| {
            let (e, delivered, submitted, done) = (
                e.clone(),
                delivered.clone(),
                submitted.clone(),
                done.clone(),
            );
            std::thread::spawn(move || {
                for i in 0..300u32 {
                    let key = t * 10_000 + i;
                    let mut inputs = (vec![k(key)], vec![Buf::from(payload(key, 64))]);
                    let id = loop {
                        match e.submit_store(inputs.0, inputs.1) {
                            Ok(id) => break id,
                            Err(r) => {
                                inputs = r.into_inputs();
                                std::thread::yield_now();
                            }
                        }
                    };
                    submitted.lock().unwrap().push(id);
                    match e.wait_store(id, T) {
                        Answer::Ready(r) => {
                            assert!(r.success);
                            delivered.lock().unwrap().push(id);
                        }
                        // The popper took it.
                        Answer::Unknown => {}
                        other => panic!("{other:?}"),
                    }
                }
                done.fetch_add(1, Ordering::SeqCst);
            })
        })
        .collect();
    for w in waiters {
        w.join().unwrap();
    }
    popper.join().unwrap();
    // Whatever the popper had not reached yet.
    delivered
        .lock()
        .unwrap()
        .extend(e.pop_completed_stores().into_iter().map(|(id, _)| id));
    let delivered = delivered.lock().unwrap();
    let unique: HashSet<_> = delivered.iter().copied().collect();
    assert_eq!(unique.len(), delivered.len(), "a result delivered twice");
    let submitted: HashSet<_> = submitted.lock().unwrap().iter().copied().collect();
    assert_eq!(unique, submitted, "every store delivered exactly once");
    assert_eq!(e.status()["task_records_in_use"], 0, "every record freed");
}

/// A refused submit hands its inputs back untouched (the same allocations,
/// so nothing was copied), and the retry with them succeeds.
#[test]
fn a_refused_submit_is_retried_with_the_inputs_it_returned() {
    let e = engine(
        16,
        EngineOptions {
            task_slots: 1,
            ..EngineOptions::default()
        },
    );
    // Hold the one record: a lookup whose result is not collected.
    let held = e.submit_lookup_and_lock(vec![k(1)]).unwrap();
    let src = payload(2, 3000);
    let src_ptr = src.as_ptr();
    let r = e
        .submit_store(vec![k(2)], vec![Buf::from(src)])
        .expect_err("the table is full");
    assert!(
        matches!(r.error, EngineError::TooManyInFlight { capacity: 1 }),
        "{r}"
    );
    assert_eq!(
        r.to_string(),
        "task table full: 1 tasks in flight or awaiting collection"
    );
    let (keys, bufs) = r.into_inputs();
    assert_eq!(keys, vec![k(2)]);
    assert_eq!(
        bufs[0].as_slice().as_ptr(),
        src_ptr,
        "the same buffer came back"
    );
    // Loads hand their destinations back too.
    let dst = vec![0u8; SLOT];
    let dst_ptr = dst.as_ptr();
    let r = e
        .submit_load(vec![k(2)], vec![dst])
        .expect_err("still full");
    let (_, dsts) = r.into_inputs();
    assert_eq!(dsts[0].as_ptr(), dst_ptr);
    // And a length mismatch names both counts, keeping the inputs.
    let r = e
        .submit_store(vec![k(3), k(4)], vec![Buf::from(vec![1u8])])
        .unwrap_err();
    assert_eq!(r.to_string(), "submit_store: 2 keys but 1 buffers");
    assert_eq!((r.keys.len(), r.bufs.len()), (2, 1));
    // Free the record, retry with what came back.
    assert!(matches!(e.wait_lookup(held, T), Answer::Ready(_)));
    let id = e.submit_store(keys, bufs).expect("retry");
    assert!(e.wait_store(id, T).ready().unwrap().success);
    let id = e.submit_load(vec![k(2)], dsts).unwrap();
    let got = e.wait_load(id, T).ready().unwrap();
    assert_eq!(got.payload(0), Some(&payload(2, 3000)[..]));
    // `?` into EngineError works (the inputs are dropped).
    let lookup = |e: &Engine, key: Key| -> Result<TaskId, EngineError> {
        Ok(e.submit_lookup_and_lock(vec![key])?)
    };
    let id = lookup(&e, k(1)).unwrap();
    assert!(matches!(e.wait_lookup(id, T), Answer::Ready(_)));
    e.submit_unlock(&[k(1), k(1)]);
}

/// Tail chunks are shorter than the slot: a load reports each key's
/// payload length (0 for a miss), for owned and raw destinations, and the
/// bytes past the payload are untouched.
#[test]
fn loads_report_each_keys_payload_length() {
    let e = engine(16, EngineOptions::default());
    let lens = [SLOT, 1000, 1];
    let keys: Vec<Key> = (0..3).map(|i| k(100 + i)).collect();
    let srcs = (0..3)
        .map(|i| Buf::from(payload(100 + i as u32, lens[i])))
        .collect();
    let id = e.submit_store(keys.clone(), srcs).unwrap();
    assert!(e.wait_store(id, T).ready().unwrap().success);
    let mut ask = keys.clone();
    ask.push(k(999)); // a miss
    let id = e
        .submit_load(ask.clone(), vec![vec![0xEE; SLOT]; 4])
        .unwrap();
    let r = e.wait_load(id, T).ready().unwrap();
    assert_eq!(r.lens.to_vec(), vec![SLOT, 1000, 1, 0]);
    for (i, &len) in lens.iter().enumerate() {
        assert_eq!(r.payload(i), Some(&payload(100 + i as u32, len)[..]));
        assert!(
            r.bufs[i][len..].iter().all(|&b| b == 0xEE),
            "tail untouched"
        );
    }
    assert_eq!(r.payload(3), None);
    // Raw destinations: lengths come back the same way.
    let mut dsts = vec![vec![0u8; SLOT]; 4];
    let raw: Vec<RawBuf> = dsts
        .iter_mut()
        // SAFETY: `dsts` outlives the task (waited for below) and is not
        // touched until then.
        .map(|d| unsafe { RawBuf::new(d.as_mut_ptr(), d.len()) })
        .collect();
    let id = e.submit_load_raw(ask, raw).unwrap();
    let r = e.wait_load(id, T).ready().unwrap();
    assert_eq!(r.lens.to_vec(), vec![SLOT, 1000, 1, 0]);
    assert!(r.bufs.is_empty());
    assert_eq!(&dsts[1][..1000], &payload(101, 1000)[..]);
}

/// A server keeps a `Submitter` in a struct beside its `Arc<Engine>` and
/// moves it into a thread: it is `Send + 'static`.
#[test]
fn a_submitter_is_owned_and_moves_into_a_thread() {
    fn send_static<T: Send + 'static>(_: &T) {}
    struct Server {
        engine: Arc<Engine>,
        sub: Submitter,
    }
    let engine = Arc::new(engine(64, EngineOptions::default()));
    let sub = engine.submitter().unwrap();
    send_static(&sub);
    let mut server = Server {
        engine: engine.clone(),
        sub,
    };
    let h = std::thread::spawn(move || {
        let id = server
            .sub
            .submit_store(vec![k(7)], vec![Buf::from(payload(7, 10))])
            .unwrap();
        assert!(server.engine.wait_store(id, T).ready().unwrap().success);
        server
    });
    let mut server = h.join().unwrap();
    let id = server.sub.submit_lookup_and_lock(vec![k(7)]).unwrap();
    assert!(engine.wait_lookup(id, T).ready().unwrap().test(0));
    engine.submit_unlock(&[k(7)]);
    // After close the submitter is refused, with its inputs.
    engine.close();
    let r = server.sub.submit_lookup_and_lock(vec![k(7)]).unwrap_err();
    assert!(matches!(r.error, EngineError::Closing));
    assert_eq!(r.keys, vec![k(7)]);
}

/// A listener that holds every store task before it is published, until
/// released: the deterministic way to see a task pending.
struct Gate {
    entered: Mutex<mpsc::Sender<()>>,
    release: Mutex<mpsc::Receiver<()>>,
}

impl Listener for Gate {
    fn on_keys_stored(&self, _: &[Key], _: &[usize]) {
        let _ = self.entered.lock().unwrap().send(());
        let _ = self.release.lock().unwrap().recv();
    }
}

fn gated(e: &Engine) -> (mpsc::Receiver<()>, mpsc::Sender<()>) {
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    let l: Arc<dyn Listener> = Arc::new(Gate {
        entered: Mutex::new(entered_tx),
        release: Mutex::new(release_rx),
    });
    e.register_listener(&l);
    (entered_rx, release_tx)
}

/// `query_*` tell pending, ready, unknown and wrong kind apart.
#[test]
fn queries_answer_pending_ready_unknown_and_wrong_kind() {
    let e = engine(16, EngineOptions::default());
    let (entered, release) = gated(&e);
    let id = e
        .submit_store(vec![k(1)], vec![Buf::from(payload(1, 10))])
        .unwrap();
    entered.recv_timeout(T).unwrap();
    assert_eq!(e.query_store(id), Answer::Pending);
    assert_eq!(
        e.wait_store(id, Duration::from_millis(20)),
        Answer::Pending,
        "a wait that times out says pending"
    );
    assert!(matches!(
        e.query_lookup(id),
        Answer::WrongKind(TaskKind::Store)
    ));
    release.send(()).unwrap();
    assert!(e.wait_store(id, T).ready().unwrap().success);
    assert_eq!(e.query_store(id), Answer::Unknown, "taken");
    assert!(matches!(e.query_load(TaskId(u64::MAX)), Answer::Unknown));
    assert!(matches!(
        e.query_store(TaskId(12345 << 20)),
        Answer::Unknown
    ));
    let lid = e.submit_lookup_and_lock(vec![k(1)]).unwrap();
    assert!(matches!(
        e.wait_store(lid, T),
        Answer::WrongKind(TaskKind::Lookup)
    ));
    assert!(e.wait_lookup(lid, T).ready().unwrap().test(0));
    e.submit_unlock(&[k(1)]);
}

/// `close` drains in-flight tasks; a waiter blocked meanwhile returns with
/// its result as soon as its task finishes, results `close` waited for can
/// still be collected (by id and by the global pop), and any wait after
/// close returns at once.
#[test]
fn close_drains_then_waiters_and_collectors_get_their_results() {
    let e = Arc::new(engine(16, EngineOptions::default()));
    // Two finished stores, not collected.
    let early: Vec<TaskId> = (0..2)
        .map(|i| {
            e.submit_store(vec![k(10 + i)], vec![Buf::from(payload(i, 10))])
                .unwrap()
        })
        .collect();
    while e.status()["inflight_store_tasks"] != 0 {
        std::thread::yield_now();
    }
    // One held in flight.
    let (entered, release) = gated(&e);
    let held = e
        .submit_store(vec![k(20)], vec![Buf::from(payload(20, 10))])
        .unwrap();
    entered.recv_timeout(T).unwrap();
    let waiter = {
        let e = e.clone();
        std::thread::spawn(move || e.wait_store(held, Duration::from_secs(60)))
    };
    let closer = {
        let e = e.clone();
        std::thread::spawn(move || e.close())
    };
    std::thread::sleep(Duration::from_millis(50));
    assert!(!closer.is_finished(), "close waits for the task in flight");
    release.send(()).unwrap();
    closer.join().unwrap();
    assert!(waiter.join().unwrap().ready().unwrap().success);
    // After close: results are still there, once each.
    assert!(e.query_store(early[0]).ready().unwrap().success);
    let rest = e.pop_completed_stores();
    assert_eq!(rest.iter().map(|r| r.0).collect::<Vec<_>>(), vec![early[1]]);
    // A wait after close returns at once.
    let t0 = Instant::now();
    assert_eq!(
        e.wait_store(early[1], Duration::from_secs(30)),
        Answer::Unknown
    );
    assert!(e.wait_stores(Duration::from_secs(30)).is_empty());
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(matches!(
        e.submit_store(vec![k(1)], vec![Buf::from(vec![1u8])]),
        Err(Refused {
            error: EngineError::Closing,
            ..
        })
    ));
}

/// `Engine::lookup_and_lock_into` (the `plugin` adapter's lookups, done
/// on the caller) locks each hit as a lookup task would: a delete skips it
/// until `submit_unlock`; misses take nothing; extra `out` entries are
/// left; after close every key misses.
#[test]
fn lookup_and_lock_into_locks_like_a_lookup_task() {
    let e = engine(64, EngineOptions::default());
    let keys = vec![k(1), k(2), k(3)];
    let id = e
        .submit_store(
            vec![k(1), k(3)],
            vec![Buf::from(payload(1, 100)), Buf::from(payload(3, 4000))],
        )
        .unwrap();
    assert!(e.wait_store(id, T).ready().unwrap().success);
    let mut out = [false, true, false, true];
    assert_eq!(e.lookup_and_lock_into(&keys, &mut out), 2);
    assert_eq!(out, [true, false, true, true], "the extra entry is left");
    assert_eq!(e.status()["locked_key_count"], 2);
    assert!(
        e.delete(&[k(1), k(3)]).is_empty(),
        "locked hits are skipped"
    );
    e.submit_unlock(&[k(1)]);
    assert_eq!(e.delete(&[k(1), k(3)]), vec![k(1)], "k(3) is still locked");
    e.submit_unlock(&[k(3)]);
    assert_eq!(e.status()["locked_key_count"], 0);
    let m = e.metrics();
    assert_eq!(m.ops[Op::Lookup.idx()], 1, "one lookup counted");
    assert_eq!(m.keys_ok[Op::Lookup.idx()], 2);
    assert_eq!(m.keys_miss_or_fail[Op::Lookup.idx()], 1);
    e.close();
    let mut out = [true; 3];
    assert_eq!(e.lookup_and_lock_into(&keys, &mut out), 0);
    assert_eq!(out, [false; 3], "closed: every key misses");
}

/// `Engine::exists` (the native connector's `submit_batch_exists`) looks
/// up without locking: a hit pins nothing, so a delete right after it
/// succeeds, the key then misses, and a load of it misses too.
#[test]
fn exists_is_a_lookup_without_lock() {
    let e = engine(64, EngineOptions::default());
    let keys = vec![k(1), k(2), k(3)];
    let id = e
        .submit_store(
            vec![k(1), k(3)],
            vec![Buf::from(payload(1, 100)), Buf::from(payload(3, 4000))],
        )
        .unwrap();
    assert!(e.wait_store(id, T).ready().unwrap().success);
    assert_eq!(e.exists(&keys), vec![true, false, true]);
    let mut out = [true; 4];
    assert_eq!(e.exists_into(&keys, &mut out), 2);
    assert_eq!(out, [true, false, true, true], "the extra entry is left");
    assert_eq!(e.status()["locked_key_count"], 0, "exists took no lock");
    assert_eq!(e.delete(&[k(1)]), vec![k(1)], "not pinned by exists");
    assert_eq!(e.exists(&keys), vec![false, false, true]);
    let id = e.submit_load(vec![k(1)], vec![vec![0; SLOT]]).unwrap();
    assert!(!e.wait_load(id, T).ready().unwrap().bitmap.test(0));
    e.close();
    assert_eq!(e.exists(&keys), vec![false; 3], "closed: every key misses");
}
