//! copy/*: non-temporal kernels vs plain memcpy into a cold mapping.
//!
//! The destination walks through a prefaulted 256 MiB memfd mapping so
//! every copy lands on lines that are not in cache, as stores into a DAX
//! device do. `copy/threshold/*` picks `NT_THRESHOLD_BYTES`.

use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};
use daxkv::device::arena::{Arena, ArenaGuard, ArenaSpec};
use daxkv::device::copy::{self, Kernel};

const MAP: usize = 256 << 20;

/// Streaming copies with each kernel in `kernels`, then plain memcpy, of
/// `size` bytes to destinations `stride` slots apart.
fn nt_vs_memcpy(
    group: &mut BenchmarkGroup<'_, WallTime>,
    g: &ArenaGuard<'_>,
    kernels: &[Kernel],
    size: usize,
    stride: usize,
) {
    let src = vec![0x5Au8; size];
    let slots = MAP / size;
    group.throughput(Throughput::Bytes(size as u64));
    for &kernel in kernels {
        let mut i = 0;
        group.bench_with_input(
            BenchmarkId::new(format!("nt_{}", kernel.name()), size),
            &size,
            |b, _| {
                b.iter(|| {
                    i = (i + stride) % slots;
                    let dst = g.as_ptr(i * size);
                    // SAFETY: i < slots, so the copy ends inside the mapping `g`
                    // keeps alive; `src` is a separate buffer; the caller passes
                    // only available kernels.
                    unsafe { copy::stream_with(kernel, dst, src.as_ptr(), size) };
                });
            },
        );
    }
    let mut i = 0;
    group.bench_with_input(BenchmarkId::new("memcpy", size), &size, |b, _| {
        b.iter(|| {
            i = (i + stride) % slots;
            // SAFETY: one thread copies; nothing else uses this arena.
            unsafe { g.write_plain(i * size, &src).unwrap() };
        });
    });
}

fn mapping() -> Arena {
    let arena = Arena::open(&ArenaSpec::memfd(MAP).populate(true)).unwrap();
    // SAFETY: one thread copies; nothing else uses this arena.
    unsafe { arena.enter().unwrap().prefault() };
    arena
}

fn bench_to_dax(c: &mut Criterion) {
    let arena = mapping();
    let g = arena.enter().unwrap();
    let kernels: Vec<Kernel> = Kernel::ALL
        .into_iter()
        .filter(|k| k.is_available() && *k != Kernel::Portable)
        .collect();
    let mut group = c.benchmark_group("copy/to_dax");
    group
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(20);
    for size in [4 << 10, 64 << 10, 256 << 10, 2 << 20, 8 << 20, 32 << 20] {
        nt_vs_memcpy(&mut group, &g, &kernels, size, 1);
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
                // SAFETY: one thread copies; nothing else uses this arena.
                unsafe { g.read(i * size, &mut dst).unwrap() };
            });
        });
    }
    group.finish();
}

fn bench_threshold(c: &mut Criterion) {
    let arena = mapping();
    let g = arena.enter().unwrap();
    let mut group = c.benchmark_group("copy/threshold");
    group
        .measurement_time(Duration::from_secs(1))
        .warm_up_time(Duration::from_millis(200))
        .sample_size(20);
    for size in [256usize, 512, 1024, 2048, 4096, 8192, 16384] {
        // A large prime stride: random-looking, cache-cold destinations.
        nt_vs_memcpy(&mut group, &g, &[copy::selected()], size, 7919);
    }
    group.finish();
}

criterion_group!(benches, bench_to_dax, bench_threshold);
criterion_main!(benches);
