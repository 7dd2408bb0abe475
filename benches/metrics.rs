//! metrics/*: the data-path cost of recording a task's metrics, the
//! engine's way (Relaxed `fetch_add`s on a cache-padded per-worker shard,
//! `daxkv::engine::Metrics`) next to `prometheus-client`'s `Counter`,
//! `Family` and `Histogram` — alone and with two threads recording at
//! once — plus the `Instant::now()` a task's duration costs and one scrape
//! (`daxkv::control::metrics::encode`). The choice this measures is recorded in the
//! `daxkv::engine::Metrics` module doc and docs/performance.md ("Metrics on the data path").
#![allow(clippy::too_many_lines, clippy::many_single_char_names)]

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use crossbeam_utils::CachePadded;
use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceSpec, Engine, EngineOptions, Metrics, TaskKind};
use daxkv::CoreConfig;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
enum OpName {
    Store,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: OpName,
}

/// The same five things the engine records per task, with
/// `prometheus-client` handles resolved once (the cheapest way to use it:
/// no `Family` lookup per task).
struct Prom {
    ops: Counter,
    ok: Counter,
    miss: Counter,
    bytes: Counter,
    dur: Histogram,
}

impl Prom {
    fn new() -> Prom {
        Prom {
            ops: Counter::default(),
            ok: Counter::default(),
            miss: Counter::default(),
            bytes: Counter::default(),
            // 1 µs … ~10 s, as many buckets as the engine's.
            dur: Histogram::new(exponential_buckets(1e-6, 2.08, 22)),
        }
    }

    #[inline]
    fn record(&self, keys: u64, ok: u64, bytes: u64, secs: f64) {
        self.ops.inc();
        self.ok.inc_by(ok);
        self.miss.inc_by(keys - ok);
        self.bytes.inc_by(bytes);
        self.dur.observe(secs);
    }
}

/// A spread of task durations (ns), so bucket choice is not one branch.
const DURS: [u64; 8] = [
    800, 3_000, 12_000, 40_000, 90_000, 300_000, 2_000_000, 15_000,
];

/// Time `iters` records on each of two threads, started together; the
/// slower thread's time (per record and thread, criterion divides by
/// `iters`).
fn two_threads(iters: u64, f: impl Fn(usize, u64) + Sync) -> Duration {
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|t| {
                let (f, barrier) = (&f, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    for i in 0..iters {
                        f(t, i);
                    }
                    start.elapsed()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).max().unwrap()
    })
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("metrics/record");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(20);

    let padded = CachePadded::new(AtomicU64::new(0));
    g.bench_function("daxkv_counter_fetch_add", |b| {
        b.iter(|| padded.fetch_add(black_box(1), Ordering::Relaxed));
    });
    // A worker's own shard: one writer, so a Relaxed load and store.
    g.bench_function("daxkv_counter_single_writer", |b| {
        b.iter(|| {
            padded.store(
                padded.load(Ordering::Relaxed) + black_box(1),
                Ordering::Relaxed,
            );
        });
    });
    let m = Metrics::new(2);
    let mut i = 0usize;
    g.bench_function("daxkv_task", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            m.record_task(
                0,
                TaskKind::Store,
                black_box(16),
                black_box(16),
                black_box(65536),
                Duration::from_nanos(DURS[i % DURS.len()]),
            );
        });
    });
    let counter = Counter::<u64>::default();
    g.bench_function("prom_counter_inc", |b| b.iter(|| counter.inc()));
    let family = Family::<OpLabels, Counter>::default();
    let labels = OpLabels { op: OpName::Store };
    g.bench_function("prom_family_get_or_create_inc", |b| {
        b.iter(|| family.get_or_create(black_box(&labels)).inc());
    });
    let hist = Histogram::new(exponential_buckets(1e-6, 2.08, 22));
    let mut i = 0usize;
    g.bench_function("prom_histogram_observe", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            hist.observe(DURS[i % DURS.len()] as f64 / 1e9);
        });
    });
    let prom = Prom::new();
    let mut i = 0usize;
    g.bench_function("prom_task", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            prom.record(
                black_box(16),
                black_box(16),
                black_box(65536),
                DURS[i % DURS.len()] as f64 / 1e9,
            );
        });
    });
    g.bench_function("instant_now", |b| b.iter(Instant::now));
    g.finish();

    // Two workers finishing tasks at once: each on its own shard (the
    // engine), or both on prometheus-client's shared handles.
    let mut g = c.benchmark_group("metrics/record_2threads");
    g.measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(15);
    let m = Metrics::new(2);
    g.bench_function("daxkv_task", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, |t, i| {
                m.record_task(
                    t,
                    TaskKind::Store,
                    16,
                    16,
                    65536,
                    Duration::from_nanos(DURS[i as usize % DURS.len()]),
                );
            })
        });
    });
    let prom = Prom::new();
    g.bench_function("prom_task", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, |_, i| {
                prom.record(16, 16, 65536, DURS[i as usize % DURS.len()] as f64 / 1e9);
            })
        });
    });
    let counter = Counter::<u64>::default();
    g.bench_function("prom_counter_inc", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, |_, _| {
                counter.inc();
            })
        });
    });
    g.finish();

    // One scrape of a one-device engine (cold path; for scale).
    let mut g = c.benchmark_group("metrics/scrape");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(20);
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(64 * 4096), 4096),
    };
    let e = Engine::open(vec![dev], 4096, false, EngineOptions::default()).unwrap();
    g.bench_function("encode", |b| b.iter(|| daxkv::control::metrics::encode(&e)));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
