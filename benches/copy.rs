//! copy/*: non-temporal kernels vs plain memcpy into a cold mapping.
//!
//! The destination walks through a prefaulted 256 MiB memfd mapping so
//! every copy lands on lines that are not in cache, as stores into a DAX
//! device do. `copy/threshold/*` picks `NT_THRESHOLD_BYTES`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use daxkv::arena::{Arena, ArenaSpec};
use daxkv::copy::{self, Kernel};
use std::time::Duration;

const MAP: usize = 256 << 20;

fn bench_to_dax(c: &mut Criterion) {
    let arena = Arena::open(&ArenaSpec::memfd(MAP).populate(true)).unwrap();
    let g = arena.enter().unwrap();
    g.prefault();
    let mut group = c.benchmark_group("copy/to_dax");
    group
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(20);
    for size in [4 << 10, 64 << 10, 256 << 10, 2 << 20, 8 << 20, 32 << 20] {
        let src = vec![0x5Au8; size];
        group.throughput(Throughput::Bytes(size as u64));
        let slots = MAP / size;
        for kernel in Kernel::ALL
            .into_iter()
            .filter(|k| k.is_available() && *k != Kernel::Portable)
        {
            let mut i = 0;
            group.bench_with_input(
                BenchmarkId::new(format!("nt_{}", kernel.name()), size),
                &size,
                |b, _| {
                    b.iter(|| {
                        i = (i + 1) % slots;
                        let dst = g.as_ptr(i * size);
                        // SAFETY: (i + 1) * size <= MAP, `g` keeps the mapping
                        // alive, `src` is a separate buffer, kernel available.
                        unsafe { copy::stream_with(kernel, dst, src.as_ptr(), size) };
                    });
                },
            );
        }
        let mut i = 0;
        group.bench_with_input(BenchmarkId::new("memcpy", size), &size, |b, _| {
            b.iter(|| {
                i = (i + 1) % slots;
                g.write_plain(i * size, &src).unwrap();
            });
        });
    }
    group.finish();

    let mut group = c.benchmark_group("copy/from_dax");
    group
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(20);
    for size in [4 << 10, 256 << 10, 8 << 20] {
        let mut dst = vec![0u8; size];
        let slots = MAP / size;
        let mut i = 0;
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::new("memcpy", size), &size, |b, _| {
            b.iter(|| {
                i = (i + 1) % slots;
                g.read(i * size, &mut dst).unwrap();
            });
        });
    }
    group.finish();
}

fn bench_threshold(c: &mut Criterion) {
    let arena = Arena::open(&ArenaSpec::memfd(MAP).populate(true)).unwrap();
    let g = arena.enter().unwrap();
    g.prefault();
    let kernel = copy::selected();
    let mut group = c.benchmark_group("copy/threshold");
    group
        .measurement_time(Duration::from_secs(1))
        .warm_up_time(Duration::from_millis(200))
        .sample_size(20);
    for size in [256usize, 512, 1024, 2048, 4096, 8192, 16384] {
        let src = vec![0x33u8; size];
        let slots = MAP / size;
        group.throughput(Throughput::Bytes(size as u64));
        let mut i = 0;
        group.bench_with_input(
            BenchmarkId::new(format!("nt_{}", kernel.name()), size),
            &size,
            |b, _| {
                b.iter(|| {
                    i = (i + 7919) % slots;
                    let dst = g.as_ptr(i * size);
                    // SAFETY: in bounds (i < slots), distinct buffers, kernel available.
                    unsafe { copy::stream_with(kernel, dst, src.as_ptr(), size) };
                });
            },
        );
        let mut i = 0;
        group.bench_with_input(BenchmarkId::new("memcpy", size), &size, |b, _| {
            b.iter(|| {
                i = (i + 7919) % slots;
                g.write_plain(i * size, &src).unwrap();
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench_to_dax, bench_threshold);
criterion_main!(benches);
