//! index/*: the key digest and the lock-free index next to `Mutex<HashMap>`
//! and `DashMap`, at 1 and 2 threads. Cross-thread timing uses
//! `iter_custom` with a `Barrier`.

use std::collections::HashMap;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dashmap::DashMap;
use daxkv::device::index::{Index, Insert};
use daxkv::device::slot::SlotId;
use daxkv::Key;

const N: usize = 1 << 16;

fn keys() -> Vec<Key> {
    (0..N)
        .map(|i| Key::digest(format!("llama-3-8b@{:08x}@0@{i:064x}", i % 8).as_bytes()))
        .collect()
}

fn bench_digest(c: &mut Criterion) {
    let mut g = c.benchmark_group("index/digest");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    let key = format!("llama-3-8b@{:08x}@{:x}@{:064x}", 3, 0, 0xdead_beef_u64);
    g.throughput(Throughput::Bytes(key.len() as u64));
    g.bench_function("xxh3_128", |b| {
        b.iter(|| xxhash_rust::xxh3::xxh3_128(std::hint::black_box(key.as_bytes())));
    });
    g.bench_function("blake3", |b| {
        b.iter(|| blake3::hash(std::hint::black_box(key.as_bytes())));
    });
    g.finish();
}

/// Run `op(thread, i)` `iters` times on each of `threads` threads; the time
/// is the slowest thread's.
fn threaded(
    threads: usize,
    iters: u64,
    op: impl Fn(usize, u64) + Send + Sync + 'static,
) -> Duration {
    let op = Arc::new(op);
    let barrier = Arc::new(Barrier::new(threads));
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (op, barrier) = (op.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let start = Instant::now();
                for i in 0..iters {
                    op(t, i);
                }
                start.elapsed()
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).max().unwrap()
}

fn bench_find(c: &mut Criterion) {
    let ks = Arc::new(keys());
    let mut g = c.benchmark_group("index/find");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));

    let idx = Arc::new(Index::with_slots(N));
    for (i, k) in ks.iter().enumerate() {
        let ks2 = ks.clone();
        assert!(matches!(
            idx.insert(*k, SlotId(i as u32), move |s| ks2[s.0 as usize] == *k),
            Insert::Inserted(_)
        ));
    }
    let mutex: Arc<Mutex<HashMap<Key, u32>>> = Arc::new(Mutex::new(
        ks.iter().enumerate().map(|(i, k)| (*k, i as u32)).collect(),
    ));
    let dash: Arc<DashMap<Key, u32>> =
        Arc::new(ks.iter().enumerate().map(|(i, k)| (*k, i as u32)).collect());

    for threads in [1usize, 2] {
        g.throughput(Throughput::Elements(threads as u64));
        let (idx2, ks2) = (idx.clone(), ks.clone());
        g.bench_with_input(BenchmarkId::new("daxkv", threads), &threads, |b, &t| {
            let (idx, ks) = (idx2.clone(), ks2.clone());
            b.iter_custom(move |iters| {
                let (idx, ks) = (idx.clone(), ks.clone());
                threaded(t, iters, move |th, i| {
                    let k = ks[(i as usize * 7 + th * 31) % N];
                    let e = idx.find(k, |s| ks[s.0 as usize] == k);
                    assert!(e.is_some());
                })
            });
        });
        let (m2, ks2) = (mutex.clone(), ks.clone());
        g.bench_with_input(
            BenchmarkId::new("mutex_hashmap", threads),
            &threads,
            |b, &t| {
                let (m, ks) = (m2.clone(), ks2.clone());
                b.iter_custom(move |iters| {
                    let (m, ks) = (m.clone(), ks.clone());
                    threaded(t, iters, move |th, i| {
                        let k = ks[(i as usize * 7 + th * 31) % N];
                        assert!(m.lock().unwrap().get(&k).is_some());
                    })
                });
            },
        );
        let (d2, ks2) = (dash.clone(), ks.clone());
        g.bench_with_input(BenchmarkId::new("dashmap", threads), &threads, |b, &t| {
            let (d, ks) = (d2.clone(), ks2.clone());
            b.iter_custom(move |iters| {
                let (d, ks) = (d.clone(), ks.clone());
                threaded(t, iters, move |th, i| {
                    let k = ks[(i as usize * 7 + th * 31) % N];
                    assert!(d.get(&k).is_some());
                })
            });
        });
    }
    g.finish();
}

fn bench_insert_remove(c: &mut Criterion) {
    let ks = Arc::new(keys());
    let mut g = c.benchmark_group("index/insert_remove");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    for threads in [1usize, 2] {
        g.throughput(Throughput::Elements(threads as u64));
        let ks2 = ks.clone();
        g.bench_with_input(BenchmarkId::new("daxkv", threads), &threads, |b, &t| {
            let ks = ks2.clone();
            b.iter_custom(move |iters| {
                // Half the slots live, the other half churned by the threads.
                let idx = Arc::new(Index::with_slots(N));
                let ks = ks.clone();
                threaded(t, iters, move |th, i| {
                    let slot = (th * (N / 2) + (i as usize % (N / 2))) as u32;
                    let k = ks[slot as usize];
                    let is = |s: SlotId| ks[s.0 as usize] == k;
                    if let Insert::Inserted(e) = idx.insert(k, SlotId(slot), is) {
                        assert!(idx.remove(e));
                    }
                })
            });
        });
        let ks2 = ks.clone();
        g.bench_with_input(
            BenchmarkId::new("mutex_hashmap", threads),
            &threads,
            |b, &t| {
                let ks = ks2.clone();
                b.iter_custom(move |iters| {
                    let m: Arc<Mutex<HashMap<Key, u32>>> =
                        Arc::new(Mutex::new(HashMap::with_capacity(N)));
                    let ks = ks.clone();
                    threaded(t, iters, move |th, i| {
                        let slot = (th * (N / 2) + (i as usize % (N / 2))) as u32;
                        let k = ks[slot as usize];
                        m.lock().unwrap().insert(k, slot);
                        m.lock().unwrap().remove(&k);
                    })
                });
            },
        );
        let ks2 = ks.clone();
        g.bench_with_input(BenchmarkId::new("dashmap", threads), &threads, |b, &t| {
            let ks = ks2.clone();
            b.iter_custom(move |iters| {
                let d: Arc<DashMap<Key, u32>> = Arc::new(DashMap::with_capacity(N));
                let ks = ks.clone();
                threaded(t, iters, move |th, i| {
                    let slot = (th * (N / 2) + (i as usize % (N / 2))) as u32;
                    let k = ks[slot as usize];
                    d.insert(k, slot);
                    d.remove(&k);
                })
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench_digest, bench_find, bench_insert_remove);
criterion_main!(benches);
