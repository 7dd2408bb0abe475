//! Hotplug under traffic, measured (reported in docs/performance.md, not gated):
//!
//! 1. Lookup + load latency of keys on an *untouched* device, in
//!    alternating rounds: while another device is migrated away, and
//!    while nothing happens (same engine, same keys), p50 / p99 / max of
//!    each.
//! 2. A forced detach (remove, evict, force) of a device whose keys are
//!    being read by two threads: how long the operation takes.
//!
//! `cargo run --release --example hotplug_latency -- [rounds] [keys]`

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceId, DeviceSpec, DeviceState, Engine, EngineOptions, RemoveMode};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key};

const SLOT: usize = 256 << 10;
const T: Duration = Duration::from_secs(30);

fn k(dev: u32, i: u32) -> Key {
    Key::digest(format!("lat@{dev}@{i}").as_bytes())
}

fn memfd(slots: usize) -> DeviceSpec {
    DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(
            ArenaSpec::memfd(slots * SLOT)
                .max_size_bytes(4 * slots * SLOT)
                .populate(true),
            SLOT,
        ),
    }
}

/// Store `n` keys of tag `dev` while only device `on` is active.
fn fill(e: &Engine, on: DeviceId, dev: u32, n: u32) {
    let others: Vec<DeviceId> = e
        .devices()
        .iter()
        .filter(|d| d.id != on && d.state == DeviceState::Active)
        .map(|d| d.id)
        .collect();
    for &d in &others {
        e.set_device_state(d, DeviceState::Draining).unwrap();
    }
    for chunk in (0..n).collect::<Vec<_>>().chunks(16) {
        let keys = chunk.iter().map(|&i| k(dev, i)).collect();
        let bufs = chunk
            .iter()
            .map(|_| Buf::from(vec![dev as u8; SLOT]))
            .collect();
        let id = e.submit_store(keys, bufs).unwrap();
        assert!(e.wait_store(id, T).ready().unwrap().success);
    }
    for &d in &others {
        e.set_device_state(d, DeviceState::Active).unwrap();
    }
}

/// Lookup + load + unlock of one key, `iters` times: latencies in µs.
fn probe(e: &Engine, dev: u32, n: u32, iters: u32) -> Vec<f64> {
    let mut out = Vec::with_capacity(iters as usize);
    let mut buf = Some(vec![0u8; SLOT]);
    for j in 0..iters {
        let key = k(dev, j % n);
        let t = Instant::now();
        let id = e.submit_lookup_and_lock(vec![key]).unwrap();
        assert!(e.wait_lookup(id, T).ready().unwrap().test(0));
        let id = e.submit_load(vec![key], vec![buf.take().unwrap()]).unwrap();
        let mut r = e.wait_load(id, T).ready().unwrap();
        assert!(r.bitmap.test(0));
        e.submit_unlock(&[key]);
        out.push(t.elapsed().as_secs_f64() * 1e6);
        buf = r.bufs.pop();
    }
    out
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[allow(clippy::too_many_lines)] // two measurements, one after the other
fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: u32 = args.next().and_then(|s| s.parse().ok()).unwrap_or(5);
    let n: u32 = args.next().and_then(|s| s.parse().ok()).unwrap_or(256);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    println!(
        "CPU: {cpu}; {} CPUs; slot {} KiB, {n} keys per device",
        std::thread::available_parallelism().map_or(1, usize::from),
        SLOT >> 10
    );
    let opts = EngineOptions::default();
    // Device 0: untouched (its keys are probed); device 1: migrated away
    // each round, onto device 2 and back.
    let e = Arc::new(
        Engine::open(
            vec![
                memfd(n as usize * 2),
                memfd(n as usize * 2),
                memfd(n as usize * 2),
            ],
            SLOT,
            true,
            opts,
        )
        .unwrap(),
    );
    fill(&e, DeviceId(0), 0, n);
    let (mut quiet, mut busy) = (Vec::new(), Vec::new());
    let mut migrate_ms = Vec::new();
    // Round 0 fills device 1; every round migrates the non-0 device that
    // holds the keys onto the other active one (device 0 is drained for
    // the migration so it is never a target: untouched, still readable),
    // then adds a fresh device for the next round.
    fill(&e, DeviceId(1), 1, n);
    for _ in 0..rounds {
        let src = e
            .devices()
            .iter()
            .filter(|d| d.id != DeviceId(0) && d.state == DeviceState::Active)
            .max_by_key(|d| d.live_slots)
            .map(|d| d.id)
            .unwrap();
        quiet.extend(probe(&e, 0, n, 400));
        e.set_device_state(DeviceId(0), DeviceState::Draining)
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let prober = {
            let (e, stop) = (e.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut v = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    v.extend(probe(&e, 0, n, 20));
                }
                v
            })
        };
        let t0 = Instant::now();
        let r = e.remove_device(src, RemoveMode::Migrate, false).unwrap();
        migrate_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        stop.store(true, Ordering::Relaxed);
        busy.extend(prober.join().unwrap());
        e.set_device_state(DeviceId(0), DeviceState::Active)
            .unwrap();
        assert_eq!(r.moved_keys, n as usize);
        e.hotplug_add("memfd:", n as usize * 2 * SLOT, |_, _| Ok(()))
            .unwrap();
    }
    let (qp50, qp99, qmax) = (
        pct(&mut quiet, 0.5),
        pct(&mut quiet, 0.99),
        pct(&mut quiet, 1.0),
    );
    let (bp50, bp99, bmax) = (
        pct(&mut busy, 0.5),
        pct(&mut busy, 0.99),
        pct(&mut busy, 1.0),
    );
    println!(
        "untouched device, lookup+load+unlock of one {} KiB key (µs):",
        SLOT >> 10
    );
    println!(
        "  quiet:             p50 {qp50:8.1}  p99 {qp99:8.1}  max {qmax:8.1}  ({} ops)",
        quiet.len()
    );
    println!(
        "  during migration:  p50 {bp50:8.1}  p99 {bp99:8.1}  max {bmax:8.1}  ({} ops)",
        busy.len()
    );
    println!(
        "  migration of {n} keys ({} MiB): {:.1} ms median",
        (n as usize * SLOT) >> 20,
        pct(&mut migrate_ms, 0.5)
    );

    // Forced detach under load.
    let victim = e
        .devices()
        .iter()
        .rev()
        .find(|d| d.state == DeviceState::Active)
        .map(|d| d.id)
        .unwrap();
    fill(&e, victim, 7, n);
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (e, stop) = (e.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut buf = Some(vec![0u8; SLOT]);
                let mut j = 0;
                while !stop.load(Ordering::Relaxed) {
                    let key = k(7, j % n);
                    j += 1;
                    let id = e.submit_load(vec![key], vec![buf.take().unwrap()]).unwrap();
                    let mut r = e.wait_load(id, T).ready().unwrap();
                    if let Some(p) = r.payload(0) {
                        assert!(p.iter().all(|&b| b == 7), "wrong bytes");
                    }
                    buf = r.bufs.pop();
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    e.remove_device(victim, RemoveMode::Evict, true).unwrap();
    let took = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    println!(
        "forced detach (evict, force) of {n} keys under 2 reading threads: {:.2} ms",
        took.as_secs_f64() * 1e3
    );
}
