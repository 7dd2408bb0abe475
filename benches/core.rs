//! core/*: DaxCore put and load per object size next to the raw copy of the
//! same size into / out of the same mapping, and lookup-and-lock.
//!
//! `core/put/<size>` is put + delete of one key (the delete keeps the arena
//! from filling; it costs ~0.1 µs); `core/raw_nt/<size>` is the bare
//! non-temporal copy into the same slots.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use daxkv::device::arena::ArenaSpec;
use daxkv::{CoreConfig, DaxCore, Key};

const ARENA: usize = 256 << 20;

fn bench_put_load(c: &mut Criterion) {
    for (name, sizes) in [("put", true), ("load", false)] {
        let mut g = c.benchmark_group(format!("core/{name}"));
        g.measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(300))
            .sample_size(20);
        for size in [4usize << 10, 64 << 10, 256 << 10, 2 << 20] {
            let core = DaxCore::open(&CoreConfig::new(
                ArenaSpec::memfd(ARENA).populate(true),
                size,
            ))
            .unwrap();
            // SAFETY: the raw baseline runs alone: no core operation is in flight
            // while it copies (the daxkv rows run in other iterations).
            unsafe { core.raw_guard().unwrap().prefault() };
            let slots = core.max_slots();
            let keys: Vec<Key> = (0..slots)
                .map(|i| Key::digest(&(i as u64).to_le_bytes()))
                .collect();
            let src = vec![0xA5u8; size];
            let mut dst = vec![0u8; size];
            g.throughput(Throughput::Bytes(size as u64));
            if sizes {
                let mut i = 0;
                g.bench_with_input(BenchmarkId::new("daxkv", size), &size, |b, _| {
                    b.iter(|| {
                        i = (i + 1) % slots;
                        core.put(keys[i], &src, 0).unwrap();
                        core.delete_many(&keys[i..=i], false);
                    });
                });
                let guard = core.raw_guard().unwrap();
                let mut i = 0;
                g.bench_with_input(BenchmarkId::new("raw_nt", size), &size, |b, _| {
                    b.iter(|| {
                        i = (i + 1) % slots;
                        // SAFETY: the raw baseline runs alone: no core operation is in flight
                        // while it copies (the daxkv rows run in other iterations).
                        unsafe { guard.write(i * size, &src).unwrap() };
                    });
                });
            } else {
                for k in &keys {
                    core.put(*k, &src, 0).unwrap();
                }
                let mut i = 0;
                g.bench_with_input(BenchmarkId::new("daxkv", size), &size, |b, _| {
                    b.iter(|| {
                        i = (i + 1) % slots;
                        assert_eq!(core.load_into(keys[i], &mut dst), Some(size));
                    });
                });
                let guard = core.raw_guard().unwrap();
                let mut i = 0;
                g.bench_with_input(BenchmarkId::new("raw_copy_out", size), &size, |b, _| {
                    b.iter(|| {
                        i = (i + 1) % slots;
                        // SAFETY: the raw baseline runs alone: no core operation is in flight
                        // while it copies (the daxkv rows run in other iterations).
                        unsafe { guard.read(i * size, &mut dst).unwrap() };
                    });
                });
            }
        }
        g.finish();
    }
}

fn bench_lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("core/lookup_lock");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    let core = DaxCore::open(&CoreConfig::new(ArenaSpec::memfd(64 << 20), 4096)).unwrap();
    let keys: Vec<Key> = (0..16384u64)
        .map(|i| Key::digest(&i.to_le_bytes()))
        .collect();
    for k in &keys {
        core.put(*k, b"x", 0).unwrap();
    }
    g.throughput(Throughput::Elements(16));
    let mut i = 0;
    g.bench_function("batch16", |b| {
        b.iter(|| {
            i = (i + 16) % keys.len();
            let hits = core.exists_many(&keys[i..i + 16], true);
            core.unlock_many(&keys[i..i + 16]);
            hits
        });
    });
    g.finish();
}

criterion_group!(benches, bench_put_load, bench_lookup);
criterion_main!(benches);
