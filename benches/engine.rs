//! engine/*: the whole path (submit → worker → completion) next to its
//! limits in the same run: a one-key lookup round trip in spin and park
//! modes (compare with `ring/round_trip/eventfd_ping_pong`), store and load
//! GB/s per object size next to the raw streaming copy, lookup-and-lock
//! keys/s with one worker, and one vs two load workers for 4 KiB objects.
#![allow(clippy::many_single_char_names)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};
use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceId, DeviceSpec, Engine, EngineOptions, Signal};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key};

const T: Duration = Duration::from_secs(10);

fn engine(slot: usize, slots: usize, load_workers: usize, spin: Duration) -> Engine {
    engine_waiting(slot, slots, load_workers, spin, spin)
}

fn engine_waiting(
    slot: usize,
    slots: usize,
    load_workers: usize,
    spin: Duration,
    wait_spin: Duration,
) -> Engine {
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(slot * slots).populate(true), slot),
    };
    let opts = EngineOptions {
        num_load_workers: load_workers,
        spin,
        wait_spin,
        // The benches wait with the `wait_*` helpers.
        signal: Signal::WhenWaiting,
        ..EngineOptions::default()
    };
    let e = Engine::open(vec![dev], slot, false, opts).unwrap();
    // SAFETY: no task is in flight while the raw baseline copies; with two
    // threads each copies its own half of the iteration's objects (disjoint
    // ranges), and iterations are ordered by the generation handshake.
    unsafe {
        e.raw_device(DeviceId(0))
            .unwrap()
            .raw_guard()
            .unwrap()
            .prefault();
    }
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
            chunk.iter().map(|_| Buf::Shared(src.clone())).collect(),
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
                let bm = e.wait_lookup(id, T).ready().unwrap();
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
                let dev = e.raw_device(DeviceId(0)).unwrap();
                let guard = dev.raw_guard().unwrap();
                let srcv = vec![0xA5u8; size];
                g.bench_with_input(BenchmarkId::new("raw_nt", size), &size, |b, _| {
                    b.iter(|| {
                        for i in 0..n {
                            // SAFETY: no task is in flight while the raw baseline copies; with two
                            // threads each copies its own half of the iteration's objects (disjoint
                            // ranges), and iterations are ordered by the generation handshake.
                            unsafe { guard.write(i * size, &srcv).unwrap() };
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
                            let r = e.wait_load(id, T).ready().unwrap();
                            assert_eq!(r.bitmap.count_ones(), 16);
                            bufs = Some(r.bufs);
                        }
                    });
                });
                let dev = e.raw_device(DeviceId(0)).unwrap();
                let guard = dev.raw_guard().unwrap();
                let mut dst = vec![0u8; size];
                g.bench_with_input(BenchmarkId::new("raw_copy_out", size), &size, |b, _| {
                    b.iter(|| {
                        for i in 0..n {
                            // SAFETY: no task is in flight while the raw baseline copies; with two
                            // threads each copies its own half of the iteration's objects (disjoint
                            // ranges), and iterations are ordered by the generation handshake.
                            unsafe { guard.read(i * size, &mut dst).unwrap() };
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
            chunk.iter().map(|_| Buf::Shared(src.clone())).collect(),
        )
        .unwrap();
        inflight += 1;
    }
    while inflight > 0 {
        inflight -= e.wait_stores(T).len();
    }
}

fn bench_lookup(c: &mut Criterion) {
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
            let bm = e.wait_lookup(id, T).ready().unwrap();
            e.submit_unlock(&ks[i..i + 256]);
            bm
        });
    });
    g.finish();
}

fn bench_load_workers(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine/load_workers");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(10);
    // The caller either spins while it waits (as long as the workers do)
    // or parks almost at once (2 µs), leaving the CPUs to the workers.
    for (mode, wait_spin) in [("spin", 50), ("park", 2)] {
        for workers in [1usize, 2] {
            let e = engine_waiting(
                4096,
                2048,
                workers,
                Duration::from_micros(50),
                Duration::from_micros(wait_spin),
            );
            let ks = keys(2048);
            fill(&e, &ks, 4096);
            g.throughput(Throughput::Elements(256));
            let mut bufs = Some(vec![vec![0u8; 4096]; 256]);
            let mut i = 0;
            let id = BenchmarkId::new(format!("4k_task256_{mode}"), workers);
            g.bench_with_input(id, &workers, |b, _| {
                b.iter(|| {
                    i = (i + 256) % ks.len();
                    let id = e
                        .submit_load(ks[i..i + 256].to_vec(), bufs.take().unwrap())
                        .unwrap();
                    let r = e.wait_load(id, T).ready().unwrap();
                    bufs = Some(r.bufs);
                });
            });
        }
    }
    raw_copy_scaling(&mut g);
    g.finish();
}

fn raw_copy_scaling(g: &mut BenchmarkGroup<'_, WallTime>) {
    // The hardware's own scaling for the same work: the same 256 objects
    // copied out of the same mapping by one thread, or split between two.
    let e = engine(4096, 2048, 1, Duration::from_micros(50));
    let ks = keys(2048);
    fill(&e, &ks, 4096);
    let dev = e.raw_device(DeviceId(0)).unwrap();
    let guard = dev.raw_guard().unwrap();
    raw_scaling(g, "raw_copy_out", |first, count, dst| {
        for (j, d) in dst.iter_mut().enumerate().take(count) {
            // SAFETY: no task is in flight while the raw baseline copies; with two
            // threads each copies its own half of the iteration's objects (disjoint
            // ranges), and iterations are ordered by the generation handshake.
            unsafe { guard.read(((first + j) % 2048) * 4096, d).unwrap() };
        }
    });
}

/// Run `op(first object, count, buffers)` over 256 objects per iteration,
/// by one thread, or split between this thread and a spinning helper
/// (released by a generation counter): the baseline for worker scaling.
fn raw_scaling(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    op: impl Fn(usize, usize, &mut [Vec<u8>]) + Sync,
) {
    for threads in [1usize, 2] {
        g.throughput(Throughput::Elements(256));
        let go = AtomicU64::new(0);
        let done = AtomicU64::new(0);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            if threads == 2 {
                let (go, done, stop, op) = (&go, &done, &stop, &op);
                s.spawn(move || {
                    let mut mine = vec![vec![0u8; 4096]; 128];
                    let mut seen = 0;
                    while !stop.load(Ordering::Acquire) {
                        let g = go.load(Ordering::Acquire);
                        if g == seen {
                            std::hint::spin_loop();
                            continue;
                        }
                        seen = g;
                        op((g as usize * 256 + 128) % 2048, 128, &mut mine);
                        done.store(g, Ordering::Release);
                    }
                });
            }
            let mut bufs = vec![vec![0u8; 4096]; 256];
            let mut gen = 0u64;
            g.bench_with_input(BenchmarkId::new(name, threads), &threads, |b, _| {
                b.iter(|| {
                    gen += 1;
                    let first = (gen as usize * 256) % 2048;
                    if threads == 1 {
                        op(first, 256, &mut bufs);
                    } else {
                        go.store(gen, Ordering::Release);
                        op(first, 128, &mut bufs);
                        while done.load(Ordering::Acquire) != gen {
                            std::hint::spin_loop();
                        }
                    }
                });
            });
            stop.store(true, Ordering::Release);
        });
    }
}

fn bench_store_workers(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine/store_workers");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(10);
    let src: std::sync::Arc<[u8]> = vec![0x5Au8; 4096].into();
    for workers in [1usize, 2] {
        let dev = DeviceSpec {
            path: "memfd".into(),
            core: CoreConfig::new(ArenaSpec::memfd(4096 * 2048).populate(true), 4096),
        };
        let opts = EngineOptions {
            num_store_workers: workers,
            spin: Duration::from_micros(50),
            wait_spin: Duration::from_micros(50),
            signal: Signal::WhenWaiting,
            ..EngineOptions::default()
        };
        let e = Engine::open(vec![dev], 4096, false, opts).unwrap();
        // SAFETY: no task is in flight while the raw baseline copies; with two
        // threads each copies its own half of the iteration's objects (disjoint
        // ranges), and iterations are ordered by the generation handshake.
        unsafe {
            e.raw_device(DeviceId(0))
                .unwrap()
                .raw_guard()
                .unwrap()
                .prefault();
        }
        let ks = keys(2048);
        g.throughput(Throughput::Elements(256));
        let mut i = 0;
        let mut done = Vec::new();
        let mut gone = Vec::new();
        g.bench_with_input(BenchmarkId::new("4k_task256", workers), &workers, |b, _| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    i = (i + 256) % ks.len();
                    let chunk = &ks[i..i + 256];
                    let bufs = chunk.iter().map(|_| Buf::Shared(src.clone())).collect();
                    let t = Instant::now();
                    e.submit_store(chunk.to_vec(), bufs).unwrap();
                    done.clear();
                    while e.wait_stores_into(&mut done, T) == 0 {}
                    total += t.elapsed();
                    assert!(done[0].1.success);
                    gone.clear();
                    e.delete_into(chunk, &mut gone);
                }
                total
            });
        });
    }
    let e = engine(4096, 2048, 1, Duration::from_micros(50));
    let dev = e.raw_device(DeviceId(0)).unwrap();
    let guard = dev.raw_guard().unwrap();
    raw_scaling(&mut g, "raw_nt_in", |first, count, src| {
        for (j, s) in src.iter().enumerate().take(count) {
            // SAFETY: no task is in flight while the raw baseline copies; with two
            // threads each copies its own half of the iteration's objects (disjoint
            // ranges), and iterations are ordered by the generation handshake.
            unsafe { guard.write(((first + j) % 2048) * 4096, s).unwrap() };
        }
    });
    g.finish();
}

criterion_group!(
    benches,
    bench_round_trip,
    bench_copy_paths,
    bench_lookup,
    bench_load_workers,
    bench_store_workers
);
criterion_main!(benches);
