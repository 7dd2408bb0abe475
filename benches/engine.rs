//! engine/*: the whole path (submit → worker → completion) next to its
//! limits in the same run: a one-key lookup round trip in spin and park
//! modes (compare with `ring/round_trip/eventfd_ping_pong`), store and load
//! GB/s per object size next to the raw streaming copy, lookup-and-lock
//! keys/s with one worker, and one vs two load workers for 4 KiB objects.
#![allow(clippy::many_single_char_names)]

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use daxkv::arena::ArenaSpec;
use daxkv::buf::Buf;
use daxkv::engine::{DeviceSpec, Engine, EngineOptions, Signal};
use daxkv::{CoreConfig, Key};

const T: Duration = Duration::from_secs(10);

fn engine(slot: usize, slots: usize, load_workers: usize, spin: Duration) -> Engine {
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(slot * slots).populate(true), slot),
    };
    let opts = EngineOptions {
        num_load_workers: load_workers,
        spin,
        // The benches wait with the `wait_*` helpers.
        signal: Signal::WhenWaiting,
        ..EngineOptions::default()
    };
    let e = Engine::open(vec![dev], slot, false, opts).unwrap();
    e.devices()[0].core.raw_guard().unwrap().prefault();
    e
}

fn keys(n: usize) -> Vec<Key> {
    (0..n as u64)
        .map(|i| Key::digest(&i.to_le_bytes()))
        .collect()
}

fn fill(e: &Engine, ks: &[Key], size: usize) {
    let src: std::sync::Arc<[u8]> = vec![0x5Au8; size].into();
    for chunk in ks.chunks(16) {
        e.submit_store(
            chunk.to_vec(),
            chunk.iter().map(|_| Buf::Owned(src.clone())).collect(),
        )
        .unwrap();
    }
    let mut done = 0;
    while done < ks.len().div_ceil(16) {
        done += e.wait_stores(T).len();
    }
}

fn bench_round_trip(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine/round_trip");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(20);
    for (mode, spin) in [
        ("lookup1_spin", Duration::from_micros(200)),
        ("lookup1_park", Duration::ZERO),
    ] {
        let e = engine(4096, 64, 1, spin);
        let ks = keys(1);
        fill(&e, &ks, 64);
        g.bench_function(mode, |b| {
            b.iter(|| {
                let id = e.submit_lookup_and_lock(ks.clone()).unwrap();
                let bm = e.wait_lookup(id, T).unwrap();
                e.submit_unlock(&ks);
                bm
            });
        });
    }
    g.finish();
}

fn bench_copy_paths(c: &mut Criterion) {
    for (phase, store) in [("store", true), ("load", false)] {
        let mut g = c.benchmark_group(format!("engine/{phase}"));
        g.measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(300))
            .sample_size(10);
        for size in [4usize << 10, 256 << 10] {
            let n = ((64usize << 20) / size).max(16) / 16 * 16;
            let e = engine(size, n, 1, Duration::from_micros(50));
            let ks = keys(n);
            g.throughput(Throughput::Bytes((n * size) as u64));
            if store {
                let src: std::sync::Arc<[u8]> = vec![0xA5u8; size].into();
                g.bench_with_input(BenchmarkId::new("daxkv", size), &size, |b, _| {
                    b.iter_custom(|iters| {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            let t = Instant::now();
                            fill_with(&e, &ks, &src);
                            total += t.elapsed();
                            e.delete(&ks);
                        }
                        total
                    });
                });
                let devs = e.devices();
                let guard = devs[0].core.raw_guard().unwrap();
                let srcv = vec![0xA5u8; size];
                g.bench_with_input(BenchmarkId::new("raw_nt", size), &size, |b, _| {
                    b.iter(|| {
                        for i in 0..n {
                            guard.write(i * size, &srcv).unwrap();
                        }
                    });
                });
            } else {
                fill(&e, &ks, size);
                let mut bufs: Option<Vec<Vec<u8>>> = Some(vec![vec![0u8; size]; 16]);
                g.bench_with_input(BenchmarkId::new("daxkv", size), &size, |b, _| {
                    b.iter(|| {
                        for chunk in ks.chunks(16) {
                            let id = e.submit_load(chunk.to_vec(), bufs.take().unwrap()).unwrap();
                            let r = e.wait_load(id, T).unwrap();
                            assert_eq!(r.bitmap.count_ones(), 16);
                            bufs = Some(r.bufs);
                        }
                    });
                });
                let devs = e.devices();
                let guard = devs[0].core.raw_guard().unwrap();
                let mut dst = vec![0u8; size];
                g.bench_with_input(BenchmarkId::new("raw_copy_out", size), &size, |b, _| {
                    b.iter(|| {
                        for i in 0..n {
                            guard.read(i * size, &mut dst).unwrap();
                        }
                    });
                });
            }
        }
        g.finish();
    }
}

fn fill_with(e: &Engine, ks: &[Key], src: &std::sync::Arc<[u8]>) {
    // Up to 8 tasks of 16 keys in flight.
    let mut inflight = 0;
    for chunk in ks.chunks(16) {
        while inflight >= 8 {
            inflight -= e.wait_stores(T).len();
        }
        e.submit_store(
            chunk.to_vec(),
            chunk.iter().map(|_| Buf::Owned(src.clone())).collect(),
        )
        .unwrap();
        inflight += 1;
    }
    while inflight > 0 {
        inflight -= e.wait_stores(T).len();
    }
}

fn bench_lookup_and_workers(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine/lookup");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(20);
    let e = engine(4096, 4096, 1, Duration::from_micros(50));
    let ks = keys(4096);
    fill(&e, &ks, 64);
    g.throughput(Throughput::Elements(256));
    let mut i = 0;
    g.bench_function("keys_per_task256", |b| {
        b.iter(|| {
            i = (i + 256) % ks.len();
            let chunk = ks[i..i + 256].to_vec();
            let id = e.submit_lookup_and_lock(chunk).unwrap();
            let bm = e.wait_lookup(id, T).unwrap();
            e.submit_unlock(&ks[i..i + 256]);
            bm
        });
    });
    g.finish();

    let mut g = c.benchmark_group("engine/load_workers");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(10);
    for workers in [1usize, 2] {
        let e = engine(4096, 2048, workers, Duration::from_micros(50));
        let ks = keys(2048);
        fill(&e, &ks, 4096);
        g.throughput(Throughput::Elements(256));
        let mut bufs = Some(vec![vec![0u8; 4096]; 256]);
        let mut i = 0;
        g.bench_with_input(BenchmarkId::new("4k_task256", workers), &workers, |b, _| {
            b.iter(|| {
                i = (i + 256) % ks.len();
                let id = e
                    .submit_load(ks[i..i + 256].to_vec(), bufs.take().unwrap())
                    .unwrap();
                let r = e.wait_load(id, T).unwrap();
                bufs = Some(r.bufs);
            });
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_round_trip,
    bench_copy_paths,
    bench_lookup_and_workers
);
criterion_main!(benches);
