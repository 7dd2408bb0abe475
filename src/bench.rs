//! # The standard `daxkv bench` workload
//!
//! For each object size: N = min(max_objects, total_bytes / size) objects
//! go through the phases store → lookup-and-lock → load → unlock → delete
//! through the public [`Engine`] API (the path a user takes): tasks of 16
//! keys, up to 8 tasks in flight, on fresh devices (memfds by default) with
//! one slot per object. Before the phases, the same mapping's raw limits
//! are measured in the same run: single-thread non-temporal copy in, plain
//! `memcpy` in, copy out, and a raw eventfd ping-pong between two threads.
//! Each phase prints its ratio to its limit.
// Unsafe only for the raw-copy baselines on the device's own mapping
// (`ArenaGuard` copies are unsafe: their contract is that no other thread
// touches the range); each block says why the engine is idle there.
#![deny(unsafe_code)]

use std::fmt::Write as _;
use std::time::Instant;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crate::arena::{ArenaSource, ArenaSpec};
use crate::buf::Buf;
use crate::core::CoreConfig;
use crate::engine::{DeviceSpec, Engine, EngineOptions, TaskId};
use crate::key::Key;
use crate::notify::EventFd;

/// Keys per task.
pub const TASK_KEYS: usize = 16;

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub sizes: Vec<usize>,
    pub total_bytes: usize,
    pub max_objects: usize,
    /// Devices or files to use instead of memfds (together they must hold
    /// `total_bytes`); empty: `devices` memfds.
    pub paths: Vec<std::path::PathBuf>,
    /// Number of memfd devices when `paths` is empty.
    pub devices: usize,
    pub store_workers: usize,
    pub lookup_workers: usize,
    pub load_workers: usize,
    /// Spin before parking (workers and the waiting caller); zero parks at
    /// once (eventfd wakes only).
    pub spin: Duration,
    /// How long the waiting caller spins before parking (`None`: `spin`).
    pub wait_spin: Option<Duration>,
    /// Tasks in flight per phase.
    pub inflight_tasks: usize,
    /// Pre-fault the mapping (first-touch faults of fresh tmpfs pages would
    /// otherwise dominate; a real DAX device has none).
    pub prefault: bool,
    /// Every `verify_every`-th loaded object is compared byte for byte.
    pub verify_every: usize,
}

impl Default for BenchConfig {
    fn default() -> BenchConfig {
        BenchConfig {
            sizes: vec![4 << 10, 64 << 10, 256 << 10, 2 << 20, 8 << 20],
            total_bytes: 1 << 30,
            max_objects: 20_000,
            paths: Vec::new(),
            devices: 1,
            store_workers: 1,
            lookup_workers: 1,
            load_workers: 1,
            spin: Duration::from_micros(250),
            wait_spin: None,
            inflight_tasks: 8,
            prefault: true,
            verify_every: 64,
        }
    }
}

/// Raw limits of one mapping for one object size.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    pub size_bytes: usize,
    pub nt_copy_in_gb_s: f64,
    pub memcpy_in_gb_s: f64,
    pub copy_out_gb_s: f64,
}

/// One phase's result.
#[derive(Clone, Debug, PartialEq)]
pub struct PhaseResult {
    pub size_bytes: usize,
    pub phase: &'static str,
    pub objects: usize,
    pub seconds: f64,
    pub objects_per_s: f64,
    pub gb_per_s: Option<f64>,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub ratio_to_limit: Option<f64>,
    pub verified: Option<bool>,
}

/// A whole run.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    pub eventfd_ping_pong_us: f64,
    pub workers: (usize, usize, usize),
    pub spin_us: u64,
    pub cpu: String,
    pub cores: usize,
    pub numa_nodes: usize,
    pub kernel: &'static str,
    pub device: String,
    pub limits: Vec<Limits>,
    pub results: Vec<PhaseResult>,
}

/// Errors of a bench run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Open(#[from] crate::error::OpenError),
    #[error("bench: {0}")]
    Failed(String),
}

fn machine() -> (String, usize, usize) {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let numa = std::fs::read_dir("/sys/devices/system/node")
        .map_or(1, |d| {
            d.filter_map(Result::ok)
                .filter(|e| {
                    let n = e.file_name();
                    let n = n.to_string_lossy();
                    n.starts_with("node") && n[4..].chars().all(|c| c.is_ascii_digit())
                })
                .count()
        })
        .max(1);
    (cpu, cores, numa)
}

fn gb_s(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// A source object: distinct bytes per object id.
fn fill(buf: &mut [u8], id: usize) {
    let mut x = (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

struct Phase {
    lat_us: Vec<f64>,
    start: Instant,
}

impl Phase {
    fn start() -> Phase {
        Phase {
            lat_us: Vec::new(),
            start: Instant::now(),
        }
    }
    fn task<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let t = Instant::now();
        let r = f();
        self.lat_us.push(t.elapsed().as_secs_f64() * 1e6);
        r
    }
    fn finish(
        mut self,
        size: usize,
        phase: &'static str,
        objects: usize,
        bytes: Option<usize>,
        limit: Option<f64>,
    ) -> PhaseResult {
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        self.lat_us.sort_by(f64::total_cmp);
        let gb = bytes.map(|b| gb_s(b, secs));
        PhaseResult {
            size_bytes: size,
            phase,
            objects,
            seconds: secs,
            objects_per_s: objects as f64 / secs,
            gb_per_s: gb,
            p50_us: percentile(&self.lat_us, 0.5),
            p99_us: percentile(&self.lat_us, 0.99),
            max_us: self.lat_us.last().copied().unwrap_or(0.0),
            ratio_to_limit: gb.zip(limit).map(|(g, l)| g / l),
            verified: None,
        }
    }
}

/// Raw eventfd ping-pong between two threads: the round-trip limit.
fn eventfd_ping_pong_us(rounds: usize) -> Result<f64, BenchError> {
    let e = |x: std::io::Error| BenchError::Failed(format!("eventfd: {x}"));
    let a = Arc::new(EventFd::new().map_err(e)?);
    let b = Arc::new(EventFd::new().map_err(e)?);
    let (a2, b2) = (a.clone(), b.clone());
    let t = std::thread::spawn(move || {
        for _ in 0..rounds {
            while !a2.wait(Duration::from_secs(5)).unwrap_or(true) {}
            let _ = a2.drain();
            let _ = b2.notify();
        }
    });
    let start = Instant::now();
    for _ in 0..rounds {
        a.notify().map_err(e)?;
        while !b.wait(Duration::from_secs(5)).map_err(e)? {}
        b.drain().map_err(e)?;
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / rounds as f64;
    t.join()
        .map_err(|_| BenchError::Failed("ping-pong thread panicked".into()))?;
    Ok(us)
}

const WAIT: Duration = Duration::from_secs(60);

/// Run `tasks` tasks with at most `depth` in flight: `submit(t)` starts task
/// `t`, `wait(id)` blocks for its completion (oldest first). Returns the
/// per-task latencies in µs.
fn pipeline<R>(
    ph: &mut Phase,
    tasks: usize,
    depth: usize,
    mut submit: impl FnMut(usize) -> Result<TaskId, BenchError>,
    mut wait: impl FnMut(TaskId) -> Option<R>,
    mut done: impl FnMut(usize, R),
) -> Result<(), BenchError> {
    let mut q: VecDeque<(usize, TaskId, Instant)> = VecDeque::new();
    let mut next = 0;
    while next < tasks || !q.is_empty() {
        while next < tasks && q.len() < depth.max(1) {
            q.push_back((next, submit(next)?, Instant::now()));
            next += 1;
        }
        let (t, id, at) = q.pop_front().expect("non-empty");
        let r = wait(id).ok_or_else(|| BenchError::Failed(format!("task {} timed out", id.0)))?;
        ph.lat_us.push(at.elapsed().as_secs_f64() * 1e6);
        done(t, r);
    }
    Ok(())
}

/// What `run` reports while it works.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress<'a> {
    /// Size `index` of `sizes` starts phase `phase` over `objects` objects.
    Phase {
        index: usize,
        sizes: usize,
        size_bytes: usize,
        phase: &'static str,
        objects: usize,
    },
    /// A finished phase's table row.
    Row(&'a str),
}

/// Run the workload; `progress` hears each phase start and each finished row.
#[allow(clippy::too_many_lines, clippy::many_single_char_names)] // one phase after another
pub fn run(
    cfg: &BenchConfig,
    mut progress: impl FnMut(Progress<'_>),
) -> Result<Report, BenchError> {
    let (cpu, cores, numa_nodes) = machine();
    let mut report = Report {
        eventfd_ping_pong_us: eventfd_ping_pong_us(2000)?,
        workers: (cfg.store_workers, cfg.lookup_workers, cfg.load_workers),
        spin_us: cfg.spin.as_micros() as u64,
        cpu,
        cores,
        numa_nodes,
        kernel: crate::copy::selected().name(),
        device: if cfg.paths.is_empty() {
            format!("{} memfd", cfg.devices.max(1))
        } else {
            cfg.paths
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(",")
        },
        limits: Vec::new(),
        results: Vec::new(),
    };
    for (index, &size) in cfg.sizes.iter().enumerate() {
        if size == 0 {
            return Err(BenchError::Failed("object size must be > 0".into()));
        }
        let n = cfg.max_objects.min(cfg.total_bytes / size).max(1);
        let ndev = if cfg.paths.is_empty() {
            cfg.devices.max(1)
        } else {
            cfg.paths.len()
        };
        let per_dev = n.div_ceil(ndev);
        let specs: Vec<DeviceSpec> = (0..ndev)
            .map(|i| {
                let (path, source) = match cfg.paths.get(i) {
                    Some(p) => (p.display().to_string(), ArenaSource::Path(p.clone())),
                    None => ("memfd".to_string(), ArenaSource::Memfd),
                };
                DeviceSpec {
                    path,
                    core: CoreConfig::new(
                        ArenaSpec::new(source, per_dev * size).populate(cfg.prefault),
                        size,
                    ),
                }
            })
            .collect();
        let opts = EngineOptions {
            num_store_workers: cfg.store_workers,
            num_lookup_workers: cfg.lookup_workers,
            num_load_workers: cfg.load_workers,
            spin: cfg.spin,
            wait_spin: cfg.wait_spin.unwrap_or(cfg.spin),
            // The bench waits with the `wait_*` helpers, so the workers
            // need to signal only while it is parked.
            signal: crate::engine::Signal::WhenWaiting,
            ..EngineOptions::default()
        };
        let engine = Engine::open(specs, size, false, opts)
            .map_err(|e| BenchError::Failed(e.to_string()))?;
        let devs = engine.device_list();
        // One submitting thread: it gets rings of its own (no submit lock).
        let mut sub = engine
            .submitter()
            .map_err(|e| BenchError::Failed(e.to_string()))?;
        if cfg.prefault {
            for d in devs.iter() {
                if let Some(g) = d.core().raw_guard() {
                    #[allow(unsafe_code)]
                    // SAFETY: nothing has been submitted yet: no worker
                    // touches the mapping while it is pre-faulted.
                    unsafe {
                        g.prefault();
                    }
                }
            }
        }
        // Sources: a ring of distinct objects (bounded memory); destinations:
        // one buffer per object, touched before timing.
        let ring = n.min(64);
        let sources: Vec<Arc<[u8]>> = (0..ring)
            .map(|i| {
                let mut v = vec![0u8; size];
                fill(&mut v, i);
                v.into()
            })
            .collect();
        let mut dests: Vec<Option<Vec<u8>>> = (0..n).map(|_| Some(vec![1u8; size])).collect();
        let keys: Vec<Key> = (0..n)
            .map(|i| Key::digest(format!("bench@0@0@{size:x}@{i:x}").as_bytes()))
            .collect();
        let tasks = n.div_ceil(TASK_KEYS);
        let range = |t: usize| t * TASK_KEYS..((t + 1) * TASK_KEYS).min(n);

        // Limits, on the first device's own mapping.
        let limits = {
            let g = devs[0]
                .core()
                .raw_guard()
                .ok_or_else(|| BenchError::Failed("device closed".into()))?;
            let m = per_dev.min(n);
            let t = Instant::now();
            for i in 0..m {
                #[allow(unsafe_code)]
                // SAFETY: no task is in flight (the engine phases below have
                // not started, or have all been collected): no worker touches
                // the mapping while the baseline copies run.
                unsafe { g.write(i * size, &sources[i % ring]) }
                    .map_err(|e| BenchError::Failed(e.to_string()))?;
            }
            let nt = gb_s(m * size, t.elapsed().as_secs_f64());
            let t = Instant::now();
            for i in 0..m {
                #[allow(unsafe_code)]
                // SAFETY: as above.
                unsafe { g.write_plain(i * size, &sources[i % ring]) }
                    .map_err(|e| BenchError::Failed(e.to_string()))?;
            }
            let mc = gb_s(m * size, t.elapsed().as_secs_f64());
            let t = Instant::now();
            for (i, d) in dests.iter_mut().take(m).enumerate() {
                let d = d.as_mut().expect("present");
                #[allow(unsafe_code)]
                // SAFETY: as above.
                unsafe { g.read(i * size, d) }.map_err(|e| BenchError::Failed(e.to_string()))?;
            }
            let out = gb_s(m * size, t.elapsed().as_secs_f64());
            Limits {
                size_bytes: size,
                nt_copy_in_gb_s: nt,
                memcpy_in_gb_s: mc,
                copy_out_gb_s: out,
            }
        };
        let depth = cfg.inflight_tasks;

        let mut tell = |phase| {
            progress(Progress::Phase {
                index,
                sizes: cfg.sizes.len(),
                size_bytes: size,
                phase,
                objects: n,
            });
        };
        // store: completions come back in batches; match them by id.
        tell("store");
        let mut ph = Phase::start();
        let mut stored_ok = 0usize;
        {
            let mut pending: HashMap<TaskId, Instant> = HashMap::new();
            let mut got = Vec::with_capacity(depth.max(1));
            let mut next = 0;
            while next < tasks || !pending.is_empty() {
                while next < tasks && pending.len() < depth.max(1) {
                    let r = range(next);
                    let bufs = r
                        .clone()
                        .map(|i| Buf::Shared(sources[i % ring].clone()))
                        .collect();
                    let id = sub
                        .submit_store(keys[r].to_vec(), bufs)
                        .map_err(|e| BenchError::Failed(e.to_string()))?;
                    pending.insert(id, Instant::now());
                    next += 1;
                }
                got.clear();
                if engine.wait_stores_into(&mut got, WAIT) == 0 {
                    return Err(BenchError::Failed("store tasks timed out".into()));
                }
                for &(id, r) in &got {
                    if let Some(at) = pending.remove(&id) {
                        ph.lat_us.push(at.elapsed().as_secs_f64() * 1e6);
                    }
                    stored_ok += usize::from(r.success);
                }
            }
        }
        if stored_ok != tasks {
            return Err(BenchError::Failed(format!(
                "{} of {tasks} store tasks failed ({size} bytes)",
                tasks - stored_ok
            )));
        }
        let store = ph.finish(
            size,
            "store",
            n,
            Some(n * size),
            Some(limits.nt_copy_in_gb_s),
        );

        // lookup-and-lock
        tell("lookup");
        let mut ph = Phase::start();
        let mut hits = 0;
        pipeline(
            &mut ph,
            tasks,
            depth,
            |t| {
                sub.submit_lookup_and_lock(keys[range(t)].to_vec())
                    .map_err(|e| BenchError::Failed(e.to_string()))
            },
            |id| engine.wait_lookup(id, WAIT).ready(),
            |_, bm| hits += bm.count_ones(),
        )?;
        if hits != n {
            return Err(BenchError::Failed(format!("lookup found {hits} of {n}")));
        }
        let lookup = ph.finish(size, "lookup", n, None, None);

        // load: each task's destinations go in and come back.
        tell("load");
        let mut ph = Phase::start();
        let mut loaded = 0;
        {
            let dests_cell = std::cell::RefCell::new(&mut dests);
            pipeline(
                &mut ph,
                tasks,
                depth,
                |t| {
                    let bufs: Vec<Vec<u8>> = range(t)
                        .map(|i| dests_cell.borrow_mut()[i].take().expect("buffer home"))
                        .collect();
                    sub.submit_load(keys[range(t)].to_vec(), bufs)
                        .map_err(|e| BenchError::Failed(e.to_string()))
                },
                |id| engine.wait_load(id, WAIT).ready(),
                |t, r| {
                    loaded += r.bitmap.count_ones();
                    for (i, b) in range(t).zip(r.bufs) {
                        dests_cell.borrow_mut()[i] = Some(b);
                    }
                },
            )?;
        }
        let mut load = ph.finish(size, "load", n, Some(n * size), Some(limits.copy_out_gb_s));
        let verified = loaded == n
            && (0..n)
                .step_by(cfg.verify_every.max(1))
                .all(|i| dests[i].as_deref() == Some(&sources[i % ring][..]));
        load.verified = Some(verified);

        // unlock and delete are synchronous calls.
        tell("unlock/delete");
        let mut ph = Phase::start();
        for t in 0..tasks {
            ph.task(|| engine.submit_unlock(&keys[range(t)]));
        }
        let unlock = ph.finish(size, "unlock", n, None, None);
        let mut ph = Phase::start();
        let mut deleted = 0;
        let mut gone = Vec::with_capacity(TASK_KEYS);
        for t in 0..tasks {
            gone.clear();
            deleted += ph.task(|| engine.delete_into(&keys[range(t)], &mut gone));
        }
        let live: usize = devs.iter().map(|d| d.core().live_slot_count()).sum();
        if deleted != n || live != 0 {
            return Err(BenchError::Failed(format!(
                "deleted {deleted} of {n}; {live} slots still live"
            )));
        }
        let delete = ph.finish(size, "delete", n, None, None);
        drop(devs);
        drop(sub);
        engine.close();

        for r in [&store, &lookup, &load, &unlock, &delete] {
            progress(Progress::Row(&format_row(r)));
        }
        report.limits.push(limits);
        report.results.extend([store, lookup, load, unlock, delete]);
    }
    Ok(report)
}

fn human(size: usize) -> String {
    if size >= 1 << 20 && size.is_multiple_of(1 << 20) {
        format!("{} MiB", size >> 20)
    } else if size >= 1 << 10 && size.is_multiple_of(1 << 10) {
        format!("{} KiB", size >> 10)
    } else {
        format!("{size} B")
    }
}

fn format_row(r: &PhaseResult) -> String {
    format!(
        "{:>8} {:<7} {:>7} {:>12.0} {:>8} {:>9.2} {:>9.2} {:>9.2} {:>6} {:>8}",
        human(r.size_bytes),
        r.phase,
        r.objects,
        r.objects_per_s,
        r.gb_per_s.map_or("-".into(), |g| format!("{g:.2}")),
        r.p50_us,
        r.p99_us,
        r.max_us,
        r.ratio_to_limit
            .map_or("-".into(), |x| format!("{:.0}%", x * 100.0)),
        r.verified.map_or("-", |v| if v { "ok" } else { "FAILED" }),
    )
}

impl Report {
    /// The human-readable table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "daxkv bench: engine, workers store/lookup/load {}/{}/{}, spin {} us, tasks of {TASK_KEYS} keys, device {}, copy kernel {}",
            self.workers.0, self.workers.1, self.workers.2, self.spin_us, self.device, self.kernel
        );
        let _ = writeln!(
            s,
            "machine: {}, {} cores, {} NUMA node(s)",
            self.cpu, self.cores, self.numa_nodes
        );
        let _ = writeln!(
            s,
            "\nlimits (same mapping, single thread); raw eventfd ping-pong {:.1} us:",
            self.eventfd_ping_pong_us
        );
        let _ = writeln!(
            s,
            "{:>8} {:>12} {:>12} {:>12}",
            "size", "nt_in GB/s", "memcpy GB/s", "out GB/s"
        );
        for l in &self.limits {
            let _ = writeln!(
                s,
                "{:>8} {:>12.2} {:>12.2} {:>12.2}",
                human(l.size_bytes),
                l.nt_copy_in_gb_s,
                l.memcpy_in_gb_s,
                l.copy_out_gb_s
            );
        }
        let _ = writeln!(s, "\nphases (ratio: store vs nt_in, load vs out):");
        let _ = writeln!(
            s,
            "{:>8} {:<7} {:>7} {:>12} {:>8} {:>9} {:>9} {:>9} {:>6} {:>8}",
            "size",
            "phase",
            "objects",
            "objects/s",
            "GB/s",
            "p50 us",
            "p99 us",
            "max us",
            "ratio",
            "verified"
        );
        for r in &self.results {
            let _ = writeln!(s, "{}", format_row(r));
        }
        s
    }

    /// The `--json` document (names fixed by the bench issue; fields may be
    /// added, never renamed).
    pub fn json(&self) -> String {
        fn num(x: f64) -> String {
            if x.is_finite() {
                format!("{x}")
            } else {
                "null".into()
            }
        }
        fn opt(x: Option<f64>) -> String {
            x.map_or("null".into(), num)
        }
        fn esc(s: &str) -> String {
            s.chars()
                .flat_map(|c| match c {
                    '"' => vec!['\\', '"'],
                    '\\' => vec!['\\', '\\'],
                    c if (c as u32) < 0x20 => format!("\\u{:04x}", c as u32).chars().collect(),
                    c => vec![c],
                })
                .collect()
        }
        let mut s = String::new();
        let _ = write!(
            s,
            "{{\"machine\":{{\"cpu\":\"{}\",\"cores\":{},\"numa_nodes\":{}}},\"mode\":\"engine\",\"workers\":{{\"store\":{},\"lookup\":{},\"load\":{}}},\"spin_us\":{},\"copy_kernel\":\"{}\",\"device\":\"{}\",\"limits\":{{",
            esc(&self.cpu),
            self.cores,
            self.numa_nodes,
            self.workers.0,
            self.workers.1,
            self.workers.2,
            self.spin_us,
            self.kernel,
            esc(&self.device)
        );
        for (i, l) in self.limits.iter().enumerate() {
            let _ = write!(
                s,
                "{}\"{}\":{{\"nt_copy_in_gb_s\":{},\"memcpy_in_gb_s\":{},\"copy_out_gb_s\":{}}}",
                if i > 0 { "," } else { "" },
                l.size_bytes,
                num(l.nt_copy_in_gb_s),
                num(l.memcpy_in_gb_s),
                num(l.copy_out_gb_s)
            );
        }
        let _ = write!(
            s,
            "}},\"eventfd_ping_pong_us\":{},\"results\":[",
            num(self.eventfd_ping_pong_us)
        );
        for (i, r) in self.results.iter().enumerate() {
            let _ = write!(
                s,
                "{}{{\"size_bytes\":{},\"phase\":\"{}\",\"objects\":{},\"seconds\":{},\"objects_per_s\":{},\"gb_per_s\":{},\"p50_us\":{},\"p99_us\":{},\"max_us\":{},\"ratio_to_limit\":{},\"verified\":{}}}",
                if i > 0 { "," } else { "" },
                r.size_bytes,
                r.phase,
                r.objects,
                num(r.seconds),
                num(r.objects_per_s),
                opt(r.gb_per_s),
                num(r.p50_us),
                num(r.p99_us),
                num(r.max_us),
                opt(r.ratio_to_limit),
                r.verified.map_or("null", |v| if v { "true" } else { "false" })
            );
        }
        s.push_str("]}");
        s
    }
}

/// Parse a size like `4K`, `64KiB`, `2M`, `1.5GiB` or `4096` (1024-based).
pub fn parse_size(s: &str) -> Option<usize> {
    let t = s.trim();
    if t.is_empty() || t.len() > 64 {
        return None;
    }
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = (t[..split].trim(), t[split..].trim().to_ascii_lowercase());
    let mult: u128 = match unit.as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty()
        || !int.chars().all(|c| c.is_ascii_digit())
        || !frac.chars().all(|c| c.is_ascii_digit())
        || (num.contains('.') && frac.is_empty())
    {
        return None;
    }
    let whole: u128 = int.parse().ok()?;
    let mut bytes = whole.checked_mul(mult)?;
    if !frac.is_empty() {
        let f: u128 = frac.parse().ok()?;
        let scale = 10u128.checked_pow(frac.len() as u32)?;
        bytes = bytes.checked_add(f.checked_mul(mult)? / scale)?;
    }
    (bytes > 0).then(|| usize::try_from(bytes).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_lmcache() {
        assert_eq!(parse_size("2GiB"), Some(2_147_483_648));
        assert_eq!(parse_size("1536MiB"), Some(1_610_612_736));
        assert_eq!(parse_size("1.5GiB"), Some(1_610_612_736));
        assert_eq!(parse_size("4k"), Some(4096));
        assert_eq!(parse_size("64 KiB"), Some(65536));
        assert_eq!(parse_size("4096"), Some(4096));
        for bad in [
            "",
            "0",
            "many",
            "1.",
            ".5G",
            "-1",
            "4 parsecs",
            &"9".repeat(65),
        ] {
            assert_eq!(parse_size(bad), None, "{bad:?}");
        }
    }
}
