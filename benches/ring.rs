//! ring/*: a one-entry round trip through two SPSC rings between two
//! threads, next to the raw baselines measured in the same run: an atomic
//! flag ping-pong (spinning) and an eventfd ping-pong (blocking).
#![allow(clippy::many_single_char_names, clippy::too_many_lines)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use daxkv::plumbing::notify::EventFd;
use daxkv::plumbing::ring::Ring;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("ring/round_trip");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(20);

    g.bench_function("spsc_spin", |b| {
        b.iter_custom(|iters| {
            let (mut ping_p, mut ping_c) = Ring::<u64>::heap(64).unwrap().split();
            let (mut pong_p, mut pong_c) = Ring::<u64>::heap(64).unwrap().split();
            let t = std::thread::spawn(move || {
                for _ in 0..iters {
                    let v = loop {
                        if let Some(v) = ping_c.pop().unwrap() {
                            break v;
                        }
                        std::hint::spin_loop();
                    };
                    ping_c.sync();
                    pong_p.push(v + 1).unwrap();
                    pong_p.sync();
                }
            });
            let start = Instant::now();
            for i in 0..iters {
                ping_p.push(i).unwrap();
                ping_p.sync();
                loop {
                    if let Some(v) = pong_c.pop().unwrap() {
                        assert_eq!(v, i + 1);
                        break;
                    }
                    std::hint::spin_loop();
                }
                pong_c.sync();
            }
            let d = start.elapsed();
            t.join().unwrap();
            d
        });
    });

    g.bench_function("atomic_ping_pong", |b| {
        b.iter_custom(|iters| {
            let flag = Arc::new(AtomicU64::new(0));
            let f2 = flag.clone();
            let t = std::thread::spawn(move || {
                for i in 0..iters {
                    while f2.load(Ordering::Acquire) != 2 * i + 1 {
                        std::hint::spin_loop();
                    }
                    f2.store(2 * i + 2, Ordering::Release);
                }
            });
            let start = Instant::now();
            for i in 0..iters {
                flag.store(2 * i + 1, Ordering::Release);
                while flag.load(Ordering::Acquire) != 2 * i + 2 {
                    std::hint::spin_loop();
                }
            }
            let d = start.elapsed();
            t.join().unwrap();
            d
        });
    });

    g.bench_function("eventfd_ping_pong", |b| {
        b.iter_custom(|iters| {
            let (a, bfd) = (
                Arc::new(EventFd::new().unwrap()),
                Arc::new(EventFd::new().unwrap()),
            );
            let (a2, b2) = (a.clone(), bfd.clone());
            let t = std::thread::spawn(move || {
                for _ in 0..iters {
                    while !a2.wait(Duration::from_secs(5)).unwrap() {}
                    a2.drain().unwrap();
                    b2.notify().unwrap();
                }
            });
            let start = Instant::now();
            for _ in 0..iters {
                a.notify().unwrap();
                while !bfd.wait(Duration::from_secs(5)).unwrap() {}
                bfd.drain().unwrap();
            }
            let d = start.elapsed();
            t.join().unwrap();
            d
        });
    });
    g.finish();

    let mut g = c.benchmark_group("ring/push_pop");
    g.measurement_time(Duration::from_secs(1))
        .warm_up_time(Duration::from_millis(200));
    g.throughput(Throughput::Elements(16));
    let (mut p, mut cons) = Ring::<daxkv::plumbing::ring::Sqe>::heap(64)
        .unwrap()
        .split();
    g.bench_function("batch16", |b| {
        b.iter(|| {
            for i in 0..16u32 {
                p.push(daxkv::plumbing::ring::Sqe {
                    task: u64::from(i),
                    start: i,
                    len: 1,
                })
                .unwrap();
            }
            p.sync();
            let mut n = 0;
            while let Some(e) = cons.pop().unwrap() {
                n += e.len;
            }
            cons.sync();
            n
        });
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
