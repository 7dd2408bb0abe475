//! # The standard `daxkv bench` workload
//!
//! For each object size: N = min(max_objects, total_bytes / size) objects
//! go through the phases store → lookup-and-lock → load → unlock → delete
//! through the public [`Engine`] API (the path a user takes): tasks of 16
//! keys, up to 8 tasks in flight, on fresh devices (memfds by default) with
//! one slot per object.
//!
//! Each size runs `rounds` rounds on the same engine and mapping. In every
//! round the raw limit is measured around the phase it bounds, on the
//! same bytes of the same mapping: the non-temporal copy of the N objects
//! into the mapping (and a plain `memcpy` in) right before the store and
//! again once the round has deleted every object (a pass right after the
//! store would overwrite objects the engine put in other slots), the copy
//! out into the same destination buffers right before the load and right
//! after it (once its bytes are checked). A phase is compared with the mean
//! of its two passes, so a drift of the machine's speed during the phase
//! (another process, frequency) moves both sides of the ratio. With
//! more than one store (load) worker the limit is also measured with that
//! many threads copying disjoint parts, and the phase is compared with it.
//! A phase's ratio is the median of its per-round ratios, reported with
//! their spread (max − min), so a limit that came out low in one pass no
//! longer skews the ratio; throughput and objects/s are the medians of the
//! rounds, the latency percentiles pool every task of every round.
//!
//! Placement: with [`BenchConfig::pin`] (the default) and more CPUs than
//! the largest worker pool, the submitting thread is pinned to one CPU and
//! the workers to the others (worker `w` of each pool on the `w`-th), and
//! each raw pass copies on the CPU of the worker whose phase it bounds.
//! Where the threads ran is read back from the kernel ([`RanOn`]: the
//! caller's CPUs, each worker's read-back CPUs and last CPU, each raw copy
//! thread's CPUs) and the table says when workers shared the caller's CPU.
//! Unpinned, a worker and the raw pass ran on whichever vCPUs the
//! scheduler chose, and one vCPU of a VM can be slower than the other for
//! seconds (a busy hyperthread sibling on the host, invisible in
//! `/proc/stat`): the same tree's store ratio at 8 MiB went 97 / 75 / 87 %
//! in three runs in a row unpinned, 99–101 % pinned (docs/performance.md).
//!
//! Many submitters: [`BenchConfig::submitters`] threads, each with its
//! own [`Submitter`], split each store, lookup and load pass in contiguous
//! shares of tasks, keep `inflight_tasks` each in flight and collect their
//! own results by id (stores too: the global pop would take another
//! thread's). One submitter runs on the caller. Around each pass the
//! engine's [`Contention`] counts are read (the only points where one
//! submitter or collector makes another retry or skip: a lost record
//! claim, a missed completion-ring `try_lock`), and the process's CPU time
//! (`getrusage`), which is reported per GB moved next to the raw copy's
//! with the same thread count, measured the same way in the same round.
//! The idle engine's CPU time is measured once, before the first round.
//!
//! Units: object sizes are binary (`4K` = `4KiB` = 4096 bytes), throughput
//! is decimal GB/s (10^9 bytes per second), latency is µs per task.
// Unsafe only for the raw-copy baselines on the device's own mapping
// (`ArenaGuard` copies are unsafe: their contract is that no other thread
// touches the range); each block says why the engine is idle there.
#![deny(unsafe_code)]

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use crate::device::arena::{ArenaGuard, ArenaSource, ArenaSpec};
use crate::device::core::CoreConfig;
use crate::engine::{
    Contention, DeviceSpec, Engine, EngineOptions, Signal, Submitter, TaskId, WorkerPlacement,
};
use crate::key::Key;
use crate::plumbing::buf::Buf;
use crate::plumbing::notify::EventFd;

/// Keys per task.
pub const TASK_KEYS: usize = 16;

/// Distinct source objects (a ring the objects cycle through).
const SOURCE_RING: usize = 64;

/// Engine memory besides the per-slot tables (task table, rings, workers'
/// stacks), for the memory check.
const ENGINE_FIXED_BYTES: u64 = 32 << 20;

/// Engine DRAM per slot (index, slot metadata, bitmap; `DaxCore`'s 50 bytes
/// rounded up) plus the bench's key (16 bytes), for the memory check.
const PER_OBJECT_BYTES: u64 = 64 + 16;

/// What to run. The defaults are the engine's own (`EngineOptions::default`,
/// LMCache's worker counts), so a run shows what a user of the defaults
/// gets.
#[derive(Clone, Debug)]
#[allow(clippy::struct_excessive_bools)] // the command line's switches
pub struct BenchConfig {
    /// Object sizes in bytes.
    pub sizes: Vec<usize>,
    /// Bytes of objects per size (`--total-bytes`).
    pub total_bytes: usize,
    /// Most objects per size (`--max-objects`).
    pub max_objects: usize,
    /// Devices or files to use instead of memfds (together they must hold
    /// `total_bytes`); empty: `devices` memfds.
    pub paths: Vec<PathBuf>,
    /// Create a missing `paths` entry as a regular file sized for the run
    /// (and grow an existing regular file that is too small); a file the
    /// run created is removed at its end. Without it a missing path is an
    /// error.
    pub create: bool,
    /// Allow a character device (device-dax) in `paths`: the bench
    /// overwrites what the device holds. Without it such a path is refused.
    pub force: bool,
    /// Number of memfd devices when `paths` is empty.
    pub devices: usize,
    /// Store workers (`--store-workers`; default the engine's, 1).
    pub store_workers: usize,
    /// Lookup workers (default the engine's, 1).
    pub lookup_workers: usize,
    /// Load workers (`--load-workers`; default the engine's, `min(4, cpus)`).
    pub load_workers: usize,
    /// Spin before parking (workers and the waiting caller).
    pub spin: Duration,
    /// How long the waiting caller spins before parking (`None`: `spin`).
    pub wait_spin: Option<Duration>,
    /// Park at once (eventfd wakes only): overrides `spin` and `wait_spin`.
    pub park: bool,
    /// When the workers write the completion eventfds. The bench waits with
    /// the `wait_*` helpers, so `WhenWaiting` (signal only a parked waiter)
    /// is what a Rust caller like it would choose.
    pub signal: Signal,
    /// Tasks in flight per phase.
    pub inflight_tasks: usize,
    /// Alternating limit / engine rounds per size.
    pub rounds: usize,
    /// Pre-fault the mapping (first-touch faults of fresh tmpfs pages would
    /// otherwise dominate; a real DAX device has none).
    pub prefault: bool,
    /// Every `verify_every`-th loaded object is compared byte for byte, in
    /// every round.
    pub verify_every: usize,
    /// Where the caller writes the JSON document (only recorded in it).
    pub json: Option<PathBuf>,
    /// Pin the submitting thread to one CPU and the workers and the raw
    /// copies to the others, when there are enough CPUs (module doc,
    /// "Placement").
    pub pin: bool,
    /// Submitting threads (`--submitters`), each with its own
    /// [`Submitter`], splitting each phase's tasks (module doc, "Many
    /// submitters").
    pub submitters: usize,
    /// How long the engine sits open with nothing submitted while the
    /// process's CPU time is measured (first size, before its first round);
    /// zero skips it.
    pub idle: Duration,
}

/// Where a run's threads ran ([`BenchConfig::pin`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The submitting (and waiting) thread's CPU.
    pub caller: usize,
    /// Each submitting thread's CPU (the first is `caller`'s).
    pub submitters: Vec<usize>,
    /// The workers' CPUs: worker `w` of each pool on `workers[w % len]`,
    /// and copy thread `k` of a raw pass on `workers[k % len]`, the CPU of
    /// the worker whose work it bounds.
    pub workers: Vec<usize>,
}

impl Placement {
    /// The placement for `cfg` given the CPUs the thread may use: the
    /// first `submitters` for the submitting threads (the caller on the
    /// first), the rest for the workers, when there are at least as many
    /// as the submitters plus the largest pool (else `None`: unpinned, as
    /// two threads sharing one CPU would measure the sharing).
    pub fn choose(cfg: &BenchConfig, allowed: &[usize]) -> Option<Placement> {
        let pool = cfg
            .store_workers
            .max(cfg.lookup_workers)
            .max(cfg.load_workers)
            .max(1);
        let subs = cfg.submitters.max(1);
        (cfg.pin && allowed.len() >= pool + subs).then(|| Placement {
            caller: allowed[0],
            submitters: allowed[..subs].to_vec(),
            workers: allowed[subs..].to_vec(),
        })
    }
}

/// Where a run's threads ran, read back from the kernel whatever was asked
/// ([`Placement`] is what was asked): a worker or copy thread that could not
/// be placed shows here, and so does one sharing the caller's CPU.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct RanOn {
    /// The submitting (and waiting) thread's CPUs (`sched_getaffinity`).
    pub caller: Vec<usize>,
    /// The CPU it last ran on, at the end of the first size.
    pub caller_last_cpu: Option<usize>,
    /// The first size's workers: the CPUs each read back at start, and the
    /// CPU it last ran on at the end of that size.
    pub workers: Vec<WorkerPlacement>,
    /// The CPUs each thread of the first size's widest raw pass read back
    /// (thread `k`), or the caller's for a pass run on the caller.
    pub raw_copies: Vec<Vec<usize>>,
    /// The CPUs each submitting thread read back (the first size's first
    /// store); with one submitter, the caller's.
    pub submitters: Vec<Vec<usize>>,
}

impl RanOn {
    /// The workers whose CPUs include one of the caller's (or another
    /// submitting thread's): they compete with a submitting thread for a
    /// CPU.
    pub fn sharing_with_caller(&self) -> Vec<&WorkerPlacement> {
        let mine =
            |c: &usize| self.caller.contains(c) || self.submitters.iter().any(|s| s.contains(c));
        self.workers
            .iter()
            .filter(|w| w.cpus.iter().any(mine))
            .collect()
    }

    /// The read-back placement in words, saying which workers shared (or,
    /// unpinned, could share) the caller's CPU.
    pub fn line(&self) -> String {
        use crate::host::numa::affinity::format_cpulist;
        let mut groups: Vec<(String, Vec<&str>)> = Vec::new();
        for w in &self.workers {
            let cpus = format_cpulist(&w.cpus);
            let short = w.name.strip_prefix("daxkv-").unwrap_or(&w.name);
            match groups.iter_mut().find(|(c, _)| *c == cpus) {
                Some((_, names)) => names.push(short),
                None => groups.push((cpus, vec![short])),
            }
        }
        let workers: Vec<String> = groups
            .iter()
            .map(|(c, names)| format!("{} on {c}", names.join(" ")))
            .collect();
        let raw: Vec<String> = self.raw_copies.iter().map(|c| format_cpulist(c)).collect();
        let shared = self.sharing_with_caller();
        let sharing = if shared.is_empty() {
            "no worker shares a CPU with the caller".to_string()
        } else {
            let names: Vec<&str> = shared.iter().map(|w| w.name.as_str()).collect();
            let verb = if self.caller.len() == 1 && shared.iter().all(|w| w.cpus == self.caller) {
                "SHARED the caller's CPU"
            } else {
                "could share a CPU with the caller (masks overlap)"
            };
            format!("{} worker(s) {verb}: {}", names.len(), names.join(", "))
        };
        let subs = if self.submitters.len() > 1 {
            let s: Vec<String> = self.submitters.iter().map(|c| format_cpulist(c)).collect();
            format!("; submitters {}", s.join(" "))
        } else {
            String::new()
        };
        format!(
            "ran on (read back): caller CPUs {}{}{subs}; workers {}; raw copies {}; {sharing}",
            format_cpulist(&self.caller),
            self.caller_last_cpu
                .map_or(String::new(), |c| format!(" (last on {c})")),
            workers.join(", "),
            raw.join(" "),
        )
    }

    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "caller": self.caller,
            "caller_last_cpu": self.caller_last_cpu,
            "workers": self.workers.iter().map(WorkerPlacement::to_json).collect::<Vec<_>>(),
            "raw_copies": self.raw_copies,
            "submitters": self.submitters,
            "sharing_with_caller": self
                .sharing_with_caller()
                .iter()
                .map(|w| w.name.as_str())
                .collect::<Vec<_>>(),
        })
    }
}

/// Pins the calling thread for a run and puts its mask back on drop.
struct Pinned {
    old: libc::cpu_set_t,
}

impl Pinned {
    fn new(cpu: usize) -> Option<Pinned> {
        let old = crate::host::sys::thread_affinity().ok()?;
        crate::host::sys::pin_thread(cpu).ok()?;
        Some(Pinned { old })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = crate::host::sys::set_thread_affinity(&self.old);
    }
}

impl Default for BenchConfig {
    fn default() -> BenchConfig {
        let e = EngineOptions::default();
        BenchConfig {
            sizes: vec![4 << 10, 64 << 10, 256 << 10, 2 << 20, 8 << 20],
            total_bytes: 1 << 30,
            max_objects: 20_000,
            paths: Vec::new(),
            create: false,
            force: false,
            devices: 1,
            store_workers: e.num_store_workers,
            lookup_workers: e.num_lookup_workers,
            load_workers: e.num_load_workers,
            spin: e.spin,
            wait_spin: None,
            park: false,
            signal: Signal::WhenWaiting,
            inflight_tasks: 8,
            rounds: 5,
            prefault: true,
            verify_every: 64,
            json: None,
            pin: true,
            submitters: 1,
            idle: Duration::from_secs(1),
        }
    }
}

impl BenchConfig {
    /// The spin the workers get (zero with `park`).
    pub fn effective_spin(&self) -> Duration {
        if self.park {
            Duration::ZERO
        } else {
            self.spin
        }
    }

    /// The spin the waiting caller gets (zero with `park`).
    pub fn effective_wait_spin(&self) -> Duration {
        if self.park {
            Duration::ZERO
        } else {
            self.wait_spin.unwrap_or(self.spin)
        }
    }

    fn device_count(&self) -> usize {
        if self.paths.is_empty() {
            self.devices.max(1)
        } else {
            self.paths.len()
        }
    }

    /// How one size is laid out.
    pub fn plan(&self, size_bytes: usize) -> Plan {
        let objects = self
            .max_objects
            .min(self.total_bytes / size_bytes.max(1))
            .max(1);
        let devices = self.device_count();
        Plan {
            size_bytes,
            objects,
            devices,
            per_device: objects.div_ceil(devices),
            sources: objects.min(SOURCE_RING),
        }
    }
}

/// How one size is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Object size.
    pub size_bytes: usize,
    /// Objects stored, looked up, loaded and deleted per round.
    pub objects: usize,
    /// Devices the objects are spread over.
    pub devices: usize,
    /// Slots (objects) per device; each device maps `per_device * size`.
    pub per_device: usize,
    /// Distinct source objects.
    pub sources: usize,
}

/// What one size allocates in RAM (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryNeed {
    /// Object size.
    pub size_bytes: usize,
    /// The devices' mappings, where they take RAM (memfds, tmpfs pages not
    /// yet allocated; a device-dax node takes none).
    pub mapping: u64,
    /// One destination buffer per object.
    pub destinations: u64,
    /// The ring of source objects.
    pub sources: u64,
    /// Engine tables and the bench's keys.
    pub engine: u64,
}

impl MemoryNeed {
    /// All of it.
    pub fn total(&self) -> u64 {
        self.mapping + self.destinations + self.sources + self.engine
    }
}

/// Raw limits of one mapping for one object size, in one round (GB/s).
/// Each but `memcpy_in` is the mean of a pass right before the phase it
/// bounds and one after it (module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct LimitRound {
    /// One thread, non-temporal stores into the mapping.
    pub nt_copy_in: f64,
    /// One thread, plain `memcpy` into the mapping.
    pub memcpy_in: f64,
    /// One thread, copy out of the mapping.
    pub copy_out: f64,
    /// `store_threads` threads, non-temporal stores, disjoint parts.
    pub nt_copy_in_threads: f64,
    /// `load_threads` threads, copy out, disjoint parts.
    pub copy_out_threads: f64,
}

/// Raw limits of one mapping for one object size: medians of the rounds.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// Object size.
    pub size_bytes: usize,
    /// One thread, non-temporal stores into the mapping.
    pub nt_copy_in_gb_s: f64,
    /// One thread, plain `memcpy` into the mapping.
    pub memcpy_in_gb_s: f64,
    /// One thread, copy out of the mapping.
    pub copy_out_gb_s: f64,
    /// Threads of the multi-thread copy-in limit (the store worker count).
    pub store_threads: usize,
    /// `store_threads` threads, non-temporal stores, disjoint parts.
    pub nt_copy_in_threads_gb_s: f64,
    /// Threads of the multi-thread copy-out limit (the load worker count).
    pub load_threads: usize,
    /// `load_threads` threads, copy out, disjoint parts.
    pub copy_out_threads_gb_s: f64,
    /// Every round's limits, in round order.
    pub rounds: Vec<LimitRound>,
}

/// One phase's result over the rounds.
#[derive(Clone, Debug, PartialEq)]
pub struct PhaseResult {
    /// Object size.
    pub size_bytes: usize,
    /// `store`, `lookup`, `load`, `unlock` or `delete`.
    pub phase: &'static str,
    /// Objects per round.
    pub objects: usize,
    /// Rounds measured.
    pub rounds: usize,
    /// Median seconds of a round's phase.
    pub seconds: f64,
    /// Median of the rounds.
    pub objects_per_s: f64,
    /// Median of the rounds.
    pub gb_per_s: Option<f64>,
    /// Task latency percentiles over every task of every round.
    pub p50_us: f64,
    /// 99th percentile task latency.
    pub p99_us: f64,
    /// Slowest task.
    pub max_us: f64,
    /// Threads of the limit the ratio is taken against (the phase's worker
    /// count).
    pub limit_threads: Option<usize>,
    /// Median of the per-round ratios to the same round's limit.
    pub ratio_to_limit: Option<f64>,
    /// Max − min of the per-round ratios.
    pub ratio_spread: Option<f64>,
    /// The per-round ratios, in round order.
    pub ratio_rounds: Vec<f64>,
    /// Median ratio to the single-thread limit (equal to `ratio_to_limit`
    /// with one worker).
    pub ratio_to_single_thread_limit: Option<f64>,
    /// Every verified load matched its source (`None`: not a load).
    pub verified: Option<bool>,
    /// Store and load: user + system CPU seconds of the whole process per
    /// GB moved (10^9 bytes) over the timed pass, the waiting callers and
    /// every worker included; median of the rounds.
    pub cpu_s_per_gb: Option<f64>,
    /// The same for the raw copy with the phase's worker count in the same
    /// round (mean of its passes before and after the phase).
    pub raw_cpu_s_per_gb: Option<f64>,
    /// Store, lookup and load: what each submitting thread did (in thread
    /// order); empty for the calls the caller makes itself.
    pub submitters: Vec<SubmitterResult>,
    /// Store, lookup and load: contention counted during the phase's
    /// timed passes, one entry per round ([`Contention`]).
    pub contention_rounds: Vec<Contention>,
}

/// One submitting thread's share of a phase.
#[derive(Clone, Debug, PartialEq)]
pub struct SubmitterResult {
    /// Tasks it submitted and collected per round.
    pub tasks: usize,
    /// Objects in them.
    pub objects: usize,
    /// Median over the rounds of its objects / its own seconds.
    pub objects_per_s: f64,
}

/// The whole process's CPU time while the engine sat open with nothing
/// submitted ([`BenchConfig::idle`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IdleCpu {
    /// Wall seconds measured.
    pub seconds: f64,
    /// User CPU seconds of the process in them.
    pub user_s: f64,
    /// System CPU seconds.
    pub sys_s: f64,
}

/// A whole run.
#[derive(Clone, Debug)]
pub struct Report {
    /// daxkv's version.
    pub version: &'static str,
    /// The options it ran with.
    pub config: BenchConfig,
    /// Raw eventfd ping-pong round trip between two threads, µs.
    pub eventfd_ping_pong_us: f64,
    /// Store, lookup and load workers.
    pub workers: (usize, usize, usize),
    /// Worker spin before parking, µs.
    pub spin_us: u64,
    /// Caller spin before parking, µs.
    pub wait_spin_us: u64,
    /// `always` or `when_waiting`.
    pub signal: &'static str,
    /// CPU model (`/proc/cpuinfo`).
    pub cpu: String,
    /// CPUs available to the process.
    pub cores: usize,
    /// NUMA nodes (sysfs).
    pub numa_nodes: usize,
    /// The copy kernel's name (`device::copy::Kernel::name`).
    pub kernel: &'static str,
    /// What it is, in words.
    pub kernel_description: &'static str,
    /// What the devices were (`memfd`, or the paths).
    pub device: String,
    /// Share of all CPUs that other processes (and the hypervisor, as
    /// steal) used while the run went on, from `/proc/stat` less this
    /// process's own CPU time: interference the ratios cannot cancel.
    /// `None` where `/proc` is unreadable.
    pub other_cpu: Option<f64>,
    /// The same per size, in `sizes` order.
    pub other_cpu_by_size: Vec<Option<f64>>,
    /// Where the threads were asked to run; `None`: unpinned.
    pub placement: Option<Placement>,
    /// Where they ran, read back (the first size's threads).
    pub ran_on: RanOn,
    /// Every size's limits, in `sizes` order.
    pub limits: Vec<Limits>,
    /// Every phase of every size.
    pub results: Vec<PhaseResult>,
    /// The idle engine's CPU time (`None`: `idle` was zero).
    pub idle_cpu: Option<IdleCpu>,
}

/// Errors of a bench run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    /// A device could not be opened.
    Open(#[from] crate::device::error::OpenError),
    /// Refused before anything ran (a check of the options or the machine).
    #[error("{0}")]
    Check(String),
    #[error("bench: {0}")]
    /// The run failed (a phase error, a wrong byte).
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

/// The copy kernel in words.
pub fn kernel_description(k: crate::device::copy::Kernel) -> &'static str {
    match k {
        crate::device::copy::Kernel::Avx512 => "AVX-512 non-temporal stores",
        crate::device::copy::Kernel::Avx2 => "AVX2 non-temporal stores",
        crate::device::copy::Kernel::Sse2 => "SSE2 non-temporal stores",
        crate::device::copy::Kernel::Portable => "portable copy (no streaming stores)",
    }
}

fn signal_name(s: Signal) -> &'static str {
    match s {
        Signal::Always => "always",
        Signal::WhenWaiting => "when_waiting",
    }
}

/// The mean of a limit measured before a phase and after it.
fn mean2(before: f64, after: f64) -> f64 {
    f64::midpoint(before, after)
}

fn gb_s(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-9) / 1e9
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// The median (the mean of the middle two for an even count); 0 if empty.
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => f64::midpoint(v[n / 2 - 1], v[n / 2]),
    }
}

/// Max − min; 0 if empty.
pub fn spread(xs: &[f64]) -> f64 {
    let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
    if xs.is_empty() {
        0.0
    } else {
        max - min
    }
}

/// CPU time counters (in `USER_HZ` ticks, the unit of both files).
#[derive(Clone, Copy, Debug)]
struct CpuSample {
    /// All CPUs, busy (user, nice, system, irq, softirq, steal).
    busy: u64,
    /// All CPUs, busy or idle.
    total: u64,
    /// This process (all its threads), user and system.
    own: u64,
}

impl CpuSample {
    fn now() -> Option<CpuSample> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let f: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        // user nice system idle iowait irq softirq steal ...
        let get = |i: usize| f.get(i).copied().unwrap_or(0);
        let busy = get(0) + get(1) + get(2) + get(5) + get(6) + get(7);
        let total = busy + get(3) + get(4);
        let me = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the command name's closing parenthesis; utime and
        // stime are fields 14 and 15 of the whole line.
        let rest: Vec<&str> = me.rsplit_once(')')?.1.split_whitespace().collect();
        let own = rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?;
        Some(CpuSample { busy, total, own })
    }

    /// Share of all CPUs used by others between `a` and `b`.
    fn others_share(a: Option<CpuSample>, b: Option<CpuSample>) -> Option<f64> {
        let (a, b) = (a?, b?);
        let total = b.total.checked_sub(a.total).filter(|&t| t > 0)?;
        let others = (b.busy.saturating_sub(a.busy)).saturating_sub(b.own.saturating_sub(a.own));
        Some(others as f64 / total as f64)
    }
}

/// A source object: distinct bytes per object id.
pub(crate) fn fill(buf: &mut [u8], id: usize) {
    let mut x = (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// A size for messages: [`crate::host::units::human`] of a `usize`.
pub fn human(size: usize) -> String {
    crate::host::units::human(size as u64)
}

/// An amount of memory for messages: binary units, rounded.
pub fn human_amount(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes >= 1 << 40 {
        format!("{:.2} TiB", b / (1u64 << 40) as f64)
    } else if bytes >= 1 << 30 {
        format!("{:.2} GiB", b / f64::from(1u32 << 30))
    } else if bytes >= 1 << 20 {
        format!("{:.1} MiB", b / f64::from(1u32 << 20))
    } else if bytes >= 1 << 10 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

/// What a `paths` entry is before the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PathKind {
    Missing,
    /// A regular file with this many bytes allocated.
    File {
        allocated: u64,
    },
    CharDevice,
    Other,
}

fn path_kind(p: &Path) -> Result<PathKind, BenchError> {
    match std::fs::metadata(p) {
        Ok(md) if md.file_type().is_char_device() => Ok(PathKind::CharDevice),
        Ok(md) if md.is_file() => Ok(PathKind::File {
            allocated: md.blocks().saturating_mul(512),
        }),
        Ok(_) => Ok(PathKind::Other),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(PathKind::Missing),
        Err(e) => Err(BenchError::Check(format!("{}: {e}", p.display()))),
    }
}

/// MemAvailable from `/proc/meminfo`, in bytes (`None` where unreadable).
pub fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb.saturating_mul(1024))
}

impl BenchConfig {
    /// What one size allocates in RAM: the mappings (for memfds, and for
    /// files the pages not yet allocated; nothing for a character device),
    /// one destination buffer per object, the source ring, the engine's
    /// tables. Sizes run one after another and free everything between, so
    /// the run needs the largest of these.
    pub fn memory_need(&self, size_bytes: usize) -> MemoryNeed {
        let kinds: Vec<PathKind> = self
            .paths
            .iter()
            .map(|p| path_kind(p).unwrap_or(PathKind::Other))
            .collect();
        self.memory_need_with(size_bytes, &kinds)
    }

    fn memory_need_with(&self, size_bytes: usize, kinds: &[PathKind]) -> MemoryNeed {
        let plan = self.plan(size_bytes);
        let per_dev = (plan.per_device as u64).saturating_mul(size_bytes as u64);
        let mapping = if self.paths.is_empty() {
            per_dev.saturating_mul(plan.devices as u64)
        } else {
            kinds
                .iter()
                .map(|k| match k {
                    PathKind::Missing | PathKind::Other => per_dev,
                    PathKind::File { allocated } => per_dev.saturating_sub(*allocated),
                    PathKind::CharDevice => 0,
                })
                .sum()
        };
        let n = plan.objects as u64;
        MemoryNeed {
            size_bytes,
            mapping,
            destinations: n.saturating_mul(size_bytes as u64),
            sources: (plan.sources as u64).saturating_mul(size_bytes as u64),
            engine: ENGINE_FIXED_BYTES
                + (plan.per_device as u64 * plan.devices as u64).saturating_mul(PER_OBJECT_BYTES),
        }
    }
}

/// The checks that run before anything is allocated or written: the
/// options (sizes, counts), the sizes against `total_bytes`, the paths
/// (missing without `create`, a character device without `force`) and the
/// memory the largest size needs against MemAvailable. Each error is one
/// sentence naming what it checked.
pub fn preflight(cfg: &BenchConfig) -> Result<(), BenchError> {
    let check = |m: String| Err(BenchError::Check(m));
    if cfg.sizes.is_empty() {
        return check("--sizes: no object size given".into());
    }
    for (name, v) in [
        ("--rounds", cfg.rounds),
        ("--devices", cfg.devices),
        ("--store-workers", cfg.store_workers),
        ("--lookup-workers", cfg.lookup_workers),
        ("--load-workers", cfg.load_workers),
        ("--submitters", cfg.submitters),
        ("--inflight", cfg.inflight_tasks),
        ("--max-objects", cfg.max_objects),
        ("--total-bytes", cfg.total_bytes),
    ] {
        if v == 0 {
            return check(format!("{name} must be > 0"));
        }
    }
    for &size in &cfg.sizes {
        if size == 0 {
            return check("object size must be > 0".into());
        }
        if size > cfg.total_bytes {
            return check(format!(
                "--sizes {} is larger than --total-bytes {}: each size stores --total-bytes / size objects; raise --total-bytes or drop that size",
                human(size),
                human(cfg.total_bytes)
            ));
        }
    }
    let mut kinds = Vec::with_capacity(cfg.paths.len());
    for p in &cfg.paths {
        let kind = path_kind(p)?;
        match kind {
            PathKind::Missing if !cfg.create => {
                return check(format!(
                    "{}: no such file or device; pass --create to create it as a file for the run (removed afterwards)",
                    p.display()
                ))
            }
            PathKind::CharDevice if !cfg.force => {
                return check(format!(
                    "{} is a character device (a device-dax node?): the bench overwrites what it holds; pass --force to use it",
                    p.display()
                ))
            }
            PathKind::File { .. } => {
                // sysfs / procfs pseudo-files: refused before anything runs
                // (the arena's open refuses them too).
                crate::host::fstype::check_path(p).map_err(|e| BenchError::Check(e.to_string()))?;
            }
            _ => {}
        }
        kinds.push(kind);
    }
    if let Some(avail) = mem_available() {
        let need = cfg
            .sizes
            .iter()
            .map(|&s| cfg.memory_need_with(s, &kinds))
            .max_by_key(MemoryNeed::total)
            .expect("sizes is not empty");
        if need.total() > avail {
            return check(format!(
                "the bench needs about {} of memory at size {} ({} mapping, {} destination buffers, {} sources, {} engine) but MemAvailable is {}; lower --total-bytes or --max-objects",
                human_amount(need.total()),
                human(need.size_bytes),
                human_amount(need.mapping),
                human_amount(need.destinations),
                human_amount(need.sources),
                human_amount(need.engine),
                human_amount(avail)
            ));
        }
    }
    Ok(())
}

/// Files the run created (`create`), removed when it ends, also on error.
struct Created(Vec<PathBuf>);

impl Drop for Created {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
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

/// A raw copy pass over all objects of a size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    /// Non-temporal stores into the mapping.
    NtIn,
    /// Plain `memcpy` into the mapping.
    MemcpyIn,
    /// Copy out of the mapping into the destination buffers.
    Out,
}

/// Copy every object in (from the source ring) or out (into its
/// destination buffer) at object `i`'s place: device `i / per_dev`, offset
/// `(i % per_dev) * size`. `threads` threads copy disjoint contiguous
/// parts. Returns GB/s.
///
/// The caller guarantees that no engine task is in flight (every phase
/// before has been collected), so no worker touches the mappings. The
/// module's unsafe code: the three raw copies below, each citing the
/// contract it meets, and the pre-fault in `run_size`.
#[allow(unsafe_code)]
#[allow(clippy::too_many_arguments)] // the pass's whole setting, all used
fn raw_pass(
    guards: &[ArenaGuard<'_>],
    per_dev: usize,
    size: usize,
    sources: &[Arc<[u8]>],
    dests: &mut [Option<Vec<u8>>],
    pass: Pass,
    threads: usize,
    cpus: &[usize],
    ran_on: &std::cell::RefCell<Vec<Vec<usize>>>,
) -> Result<f64, BenchError> {
    let n = dests.len();
    let threads = threads.clamp(1, n.max(1));
    let copy = |lo: usize, part: &mut [Option<Vec<u8>>]| -> Result<(), BenchError> {
        for (j, d) in part.iter_mut().enumerate() {
            let i = lo + j;
            let g = &guards[i / per_dev];
            let at = (i % per_dev) * size;
            let src = &sources[i % sources.len()];
            let r = match pass {
                // SAFETY: `ArenaGuard::write`'s contract: 1. no engine task
                // is in flight (the caller's guarantee), and the threads of
                // this pass copy disjoint objects, so nothing else touches
                // `at..at + size`; 2. `src` is a heap buffer, outside the
                // mapping.
                Pass::NtIn => unsafe { g.write(at, src) },
                // SAFETY: `write_plain`'s contract is `write`'s: as above.
                Pass::MemcpyIn => unsafe { g.write_plain(at, src) },
                // SAFETY: `ArenaGuard::read`'s contract: 1. as above, no
                // one writes the range; 2. `d` is this thread's own heap
                // buffer, outside the mapping.
                Pass::Out => unsafe { g.read(at, d.as_mut().expect("buffer home")) },
            };
            r.map_err(|e| BenchError::Failed(e.to_string()))?;
        }
        Ok(())
    };
    if threads == 1 && cpus.is_empty() {
        if ran_on.borrow().is_empty() {
            *ran_on.borrow_mut() = vec![crate::host::sys::thread_cpus().unwrap_or_default()];
        }
        let t = Instant::now();
        copy(0, dests)?;
        return Ok(gb_s(n * size, t.elapsed().as_secs_f64()));
    }
    let barrier = Barrier::new(threads);
    std::thread::scope(|s| {
        let mut rest = dests;
        let mut lo = 0;
        let mut handles = Vec::with_capacity(threads);
        for k in 0..threads {
            let hi = (k + 1) * n / threads;
            let (part, tail) = rest.split_at_mut(hi - lo);
            rest = tail;
            let (barrier, copy) = (&barrier, &copy);
            let cpu = (!cpus.is_empty()).then(|| cpus[k % cpus.len()]);
            handles.push(s.spawn(move || {
                if let Some(cpu) = cpu {
                    // Where the engine's worker `k` runs: the limit is
                    // measured on the same CPU as the work it bounds.
                    // A failure shows in the CPUs read back (`RanOn`).
                    let _ = crate::host::sys::pin_thread(cpu);
                }
                let on = crate::host::sys::thread_cpus().unwrap_or_default();
                barrier.wait();
                let start = Instant::now();
                copy(lo, part).map(|()| (start, Instant::now(), on))
            }));
            lo = hi;
        }
        // Each thread times itself: the pass runs from the first start to
        // the last end (the spawning thread may not get a CPU back until the
        // copies are done, so its own clock would be wrong).
        let mut first: Option<Instant> = None;
        let mut last: Option<Instant> = None;
        let mut ran = Vec::with_capacity(threads);
        for h in handles {
            let (a, b, on) = h
                .join()
                .map_err(|_| BenchError::Failed("copy thread panicked".into()))??;
            ran.push(on);
            first = Some(first.map_or(a, |f| f.min(a)));
            last = Some(last.map_or(b, |l| l.max(b)));
        }
        let secs = match (first, last) {
            (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
            _ => 0.0,
        };
        // The widest pass's threads are the ones reported.
        if ran.len() > ran_on.borrow().len() {
            *ran_on.borrow_mut() = ran;
        }
        Ok(gb_s(n * size, secs))
    })
}

/// One phase's measurements over the rounds.
#[derive(Default)]
struct Acc {
    secs: Vec<f64>,
    lat_us: Vec<f64>,
    /// The limit of each round (GB/s) at the phase's worker count.
    limit: Vec<f64>,
    /// The single-thread limit of each round.
    limit1: Vec<f64>,
    verified: Option<bool>,
    /// Process CPU seconds of each round's pass.
    cpu_s: Vec<f64>,
    /// Process CPU seconds of each round's raw pass at the phase's worker
    /// count (mean of before and after).
    raw_cpu_s: Vec<f64>,
    /// Per submitting thread: tasks, objects, and seconds per round.
    lanes: Vec<(usize, usize, Vec<f64>)>,
    contention: Vec<Contention>,
}

impl Acc {
    fn finish(
        mut self,
        size: usize,
        phase: &'static str,
        objects: usize,
        bytes: Option<usize>,
        limit_threads: Option<usize>,
    ) -> PhaseResult {
        self.lat_us.sort_by(f64::total_cmp);
        let gbs: Vec<f64> = bytes
            .map(|b| self.secs.iter().map(|&s| gb_s(b, s)).collect())
            .unwrap_or_default();
        let ratio = |lim: &[f64]| -> Vec<f64> {
            if lim.len() == gbs.len() {
                gbs.iter().zip(lim).map(|(g, l)| g / l).collect()
            } else {
                Vec::new()
            }
        };
        let ratios = ratio(&self.limit);
        let ratios1 = ratio(&self.limit1);
        let per_gb = |cpu: &[f64]| -> Option<f64> {
            let b = bytes? as f64 / 1e9;
            let v: Vec<f64> = cpu.iter().map(|c| c / b).collect();
            (!v.is_empty()).then(|| median(&v))
        };
        let submitters = self
            .lanes
            .iter()
            .map(|(tasks, objects, secs)| SubmitterResult {
                tasks: *tasks,
                objects: *objects,
                objects_per_s: median(
                    &secs
                        .iter()
                        .map(|&s| *objects as f64 / s.max(1e-9))
                        .collect::<Vec<_>>(),
                ),
            })
            .collect();
        let some = |v: &[f64], x: f64| (!v.is_empty()).then_some(x);
        let ops: Vec<f64> = self
            .secs
            .iter()
            .map(|&s| objects as f64 / s.max(1e-9))
            .collect();
        PhaseResult {
            size_bytes: size,
            phase,
            objects,
            rounds: self.secs.len(),
            seconds: median(&self.secs),
            objects_per_s: median(&ops),
            gb_per_s: some(&gbs, median(&gbs)),
            p50_us: percentile(&self.lat_us, 0.5),
            p99_us: percentile(&self.lat_us, 0.99),
            max_us: self.lat_us.last().copied().unwrap_or(0.0),
            limit_threads: limit_threads.filter(|_| !ratios.is_empty()),
            ratio_to_limit: some(&ratios, median(&ratios)),
            ratio_spread: some(&ratios, spread(&ratios)),
            ratio_to_single_thread_limit: some(&ratios1, median(&ratios1)),
            ratio_rounds: ratios,
            verified: self.verified,
            cpu_s_per_gb: per_gb(&self.cpu_s),
            raw_cpu_s_per_gb: per_gb(&self.raw_cpu_s),
            submitters,
            contention_rounds: self.contention,
        }
    }
}

/// Run `tasks` tasks with at most `depth` in flight: `submit(t)` starts task
/// `t`, `wait(id)` blocks for its completion (oldest first); each task's
/// latency in µs goes to `lat_us`.
fn pipeline<R>(
    lat_us: &mut Vec<f64>,
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
        lat_us.push(at.elapsed().as_secs_f64() * 1e6);
        done(t, r);
    }
    Ok(())
}

/// A phase run through submitters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Store,
    Lookup,
    Load,
}

/// What a phase's tasks read: the keys, the source ring, the objects.
struct Work<'a> {
    engine: &'a Engine,
    keys: &'a [Key],
    sources: &'a [Arc<[u8]>],
    /// Objects in the phase.
    n: usize,
    /// Tasks in flight per submitter.
    depth: usize,
}

/// What one submitting thread did in one pass.
struct LaneOut {
    start: Instant,
    end: Instant,
    lat_us: Vec<f64>,
    /// Stores: tasks that succeeded; lookups and loads: keys found.
    ok: usize,
    /// The thread's CPUs, read back.
    cpus: Vec<usize>,
}

/// One submitting thread's part of a pass: tasks `tasks` through `sub`,
/// at most `w.depth` in flight, each result collected by its id (so that
/// no thread takes another's). `dests` holds the destination buffers of
/// the part's objects (from object `tasks.start * TASK_KEYS`).
fn lane(
    w: &Work<'_>,
    sub: &mut Submitter,
    phase: Phase,
    tasks: std::ops::Range<usize>,
    dests: &mut [Option<Vec<u8>>],
) -> Result<LaneOut, BenchError> {
    let fail = |e: &dyn std::fmt::Display| BenchError::Failed(e.to_string());
    let range = |t: usize| t * TASK_KEYS..((t + 1) * TASK_KEYS).min(w.n);
    let base = tasks.start * TASK_KEYS;
    let cpus = crate::host::sys::thread_cpus().unwrap_or_default();
    let mut lat_us = Vec::with_capacity(tasks.len());
    let mut ok = 0;
    let t0 = tasks.start;
    let start = Instant::now();
    match phase {
        Phase::Store => pipeline(
            &mut lat_us,
            tasks.len(),
            w.depth,
            |t| {
                let r = range(t0 + t);
                let bufs = r
                    .clone()
                    .map(|i| Buf::Shared(w.sources[i % w.sources.len()].clone()))
                    .collect();
                sub.submit_store(w.keys[r].to_vec(), bufs)
                    .map_err(|e| fail(&e))
            },
            |id| w.engine.wait_store(id, WAIT).ready(),
            |_, r| ok += usize::from(r.success),
        )?,
        Phase::Lookup => pipeline(
            &mut lat_us,
            tasks.len(),
            w.depth,
            |t| {
                sub.submit_lookup_and_lock(w.keys[range(t0 + t)].to_vec())
                    .map_err(|e| fail(&e))
            },
            |id| w.engine.wait_lookup(id, WAIT).ready(),
            |_, bm| ok += bm.count_ones(),
        )?,
        Phase::Load => {
            let dests = std::cell::RefCell::new(dests);
            pipeline(
                &mut lat_us,
                tasks.len(),
                w.depth,
                |t| {
                    let bufs: Vec<Vec<u8>> = range(t0 + t)
                        .map(|i| dests.borrow_mut()[i - base].take().expect("buffer home"))
                        .collect();
                    sub.submit_load(w.keys[range(t0 + t)].to_vec(), bufs)
                        .map_err(|e| fail(&e))
                },
                |id| w.engine.wait_load(id, WAIT).ready(),
                |t, r| {
                    ok += r.bitmap.count_ones();
                    for (i, b) in range(t0 + t).zip(r.bufs) {
                        dests.borrow_mut()[i - base] = Some(b);
                    }
                },
            )?;
        }
    }
    Ok(LaneOut {
        start,
        end: Instant::now(),
        lat_us,
        ok,
        cpus,
    })
}

/// One pass of `phase` over every task, split between the submitters in
/// contiguous parts (submitter `k` takes tasks `k·T/N .. (k+1)·T/N`). One
/// submitter runs on the calling thread; more run on threads of their own,
/// pinned to `cpus[k]` when `cpus` is not empty, released together by a
/// barrier. The pass runs from the first thread's start to the last one's
/// end.
fn drive(
    w: &Work<'_>,
    subs: &mut [Submitter],
    phase: Phase,
    dests: &mut [Option<Vec<u8>>],
    cpus: &[usize],
) -> Result<(f64, Vec<LaneOut>), BenchError> {
    let tasks = w.n.div_ceil(TASK_KEYS);
    let n = subs.len().max(1);
    let outs = if n == 1 {
        vec![lane(w, &mut subs[0], phase, 0..tasks, dests)?]
    } else {
        let barrier = Barrier::new(n);
        std::thread::scope(|s| {
            let mut rest = dests;
            let mut handles = Vec::with_capacity(n);
            for (k, sub) in subs.iter_mut().enumerate() {
                let (lo, hi) = (k * tasks / n, (k + 1) * tasks / n);
                let objects = (hi * TASK_KEYS).min(w.n) - (lo * TASK_KEYS).min(w.n);
                let (part, tail) = std::mem::take(&mut rest)
                    .split_at_mut(if phase == Phase::Load { objects } else { 0 });
                rest = tail;
                let barrier = &barrier;
                let cpu = cpus.get(k).copied();
                handles.push(s.spawn(move || {
                    if let Some(cpu) = cpu {
                        // A failure shows in the CPUs read back (`RanOn`).
                        let _ = crate::host::sys::pin_thread(cpu);
                    }
                    barrier.wait();
                    lane(w, sub, phase, lo..hi, part)
                }));
            }
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .map_err(|_| BenchError::Failed("submitter thread panicked".into()))?
                })
                .collect::<Result<Vec<_>, _>>()
        })?
    };
    let first = outs.iter().map(|o| o.start).min().expect("a lane");
    let last = outs.iter().map(|o| o.end).max().expect("a lane");
    Ok((last.duration_since(first).as_secs_f64(), outs))
}

/// The whole process's user + system CPU seconds so far (0 where
/// `getrusage` fails, which it does not for `RUSAGE_SELF`).
fn cpu_now() -> f64 {
    crate::host::sys::process_cpu_seconds().map_or(0.0, |(u, s)| u + s)
}

/// What `run` reports while it works.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress<'a> {
    /// Size `index` of `sizes` is being prepared: the engine opens, the
    /// mapping of `prefault_bytes` is pre-faulted (0 without pre-faulting)
    /// and the buffers are allocated.
    Preparing {
        /// Position of the size in `sizes`.
        index: usize,
        /// Number of sizes.
        sizes: usize,
        /// Object size.
        size_bytes: usize,
        /// Objects per round.
        objects: usize,
        /// Bytes pre-faulted (0 without pre-faulting).
        prefault_bytes: u64,
    },
    /// Size `index` of `sizes` starts phase `phase` (with its limit) of
    /// round `round` of `rounds` over `objects` objects.
    Phase {
        /// Position of the size in `sizes`.
        index: usize,
        /// Number of sizes.
        sizes: usize,
        /// Object size.
        size_bytes: usize,
        /// The phase.
        phase: &'static str,
        /// Objects per round.
        objects: usize,
        /// Round, from 1.
        round: usize,
        /// Rounds per size.
        rounds: usize,
    },
    /// A finished phase's table row (every round done).
    Row(&'a str),
}

/// Run the workload; `progress` hears each size's preparation, each phase
/// start of each round and each finished row. Runs [`preflight`] first.
pub fn run(
    cfg: &BenchConfig,
    mut progress: impl FnMut(Progress<'_>),
) -> Result<Report, BenchError> {
    preflight(cfg)?;
    let (cpu, cores, numa_nodes) = machine();
    let kernel = crate::device::copy::selected();
    // How each path is opened, decided once: a file this run creates stays
    // `CreateFile` for every size (a later, larger size grows it) and is
    // removed when the run ends; with `create`, an existing regular file
    // too small for a size is grown.
    let mut created = Created(Vec::new());
    let mut sources_of = Vec::with_capacity(cfg.paths.len());
    for p in &cfg.paths {
        sources_of.push(match path_kind(p)? {
            PathKind::Missing => {
                created.0.push(p.clone());
                ArenaSource::CreateFile(p.clone())
            }
            PathKind::File { .. } if cfg.create => ArenaSource::CreateFile(p.clone()),
            _ => ArenaSource::Path(p.clone()),
        });
    }
    let mut report = Report {
        version: env!("CARGO_PKG_VERSION"),
        config: cfg.clone(),
        eventfd_ping_pong_us: eventfd_ping_pong_us(2000)?,
        workers: (cfg.store_workers, cfg.lookup_workers, cfg.load_workers),
        spin_us: cfg.effective_spin().as_micros() as u64,
        wait_spin_us: cfg.effective_wait_spin().as_micros() as u64,
        signal: signal_name(cfg.signal),
        cpu,
        cores,
        numa_nodes,
        kernel: kernel.name(),
        kernel_description: kernel_description(kernel),
        device: if cfg.paths.is_empty() {
            format!("{} memfd", cfg.devices.max(1))
        } else {
            cfg.paths
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(",")
        },
        other_cpu: None,
        other_cpu_by_size: Vec::new(),
        placement: None,
        ran_on: RanOn::default(),
        limits: Vec::new(),
        results: Vec::new(),
        idle_cpu: None,
    };
    let allowed = crate::host::sys::thread_affinity()
        .map(|s| crate::host::sys::cpus_of(&s))
        .unwrap_or_default();
    let placement = Placement::choose(cfg, &allowed);
    // Pinned for the run only: the caller's mask comes back on return.
    let pinned = placement.as_ref().and_then(|p| Pinned::new(p.caller));
    report.placement = placement.filter(|_| pinned.is_some());
    let workers_cpus = report
        .placement
        .as_ref()
        .map_or(&[][..], |p| &p.workers[..]);
    // One submitter runs on the (pinned) caller; more get a CPU each.
    let subs_cpus = report
        .placement
        .as_ref()
        .filter(|p| p.submitters.len() > 1)
        .map_or(&[][..], |p| &p.submitters[..]);
    let run_start = CpuSample::now();
    for (index, &size) in cfg.sizes.iter().enumerate() {
        let size_start = CpuSample::now();
        let (limits, results, ran_on, idle) = run_size(
            cfg,
            index,
            size,
            &sources_of,
            workers_cpus,
            subs_cpus,
            &mut progress,
        )?;
        report.idle_cpu = report.idle_cpu.or(idle);
        if report.ran_on.workers.is_empty() {
            report.ran_on = ran_on;
        }
        report
            .other_cpu_by_size
            .push(CpuSample::others_share(size_start, CpuSample::now()));
        for r in &results {
            progress(Progress::Row(&format_row(r)));
        }
        report.limits.push(limits);
        report.results.extend(results);
    }
    report.other_cpu = CpuSample::others_share(run_start, CpuSample::now());
    drop(pinned);
    drop(created);
    Ok(report)
}

/// One size: open the engine, then `rounds` rounds of limit / phase pairs.
#[allow(clippy::too_many_lines)] // one phase after another
fn run_size(
    cfg: &BenchConfig,
    index: usize,
    size: usize,
    sources_of: &[ArenaSource],
    cpus: &[usize],
    placement_subs: &[usize],
    progress: &mut impl FnMut(Progress<'_>),
) -> Result<(Limits, [PhaseResult; 5], RanOn, Option<IdleCpu>), BenchError> {
    let fail = |e: &dyn std::fmt::Display| BenchError::Failed(e.to_string());
    let plan = cfg.plan(size);
    let (n, per_dev, ndev) = (plan.objects, plan.per_device, plan.devices);
    progress(Progress::Preparing {
        index,
        sizes: cfg.sizes.len(),
        size_bytes: size,
        objects: n,
        prefault_bytes: if cfg.prefault {
            (per_dev * size * ndev) as u64
        } else {
            0
        },
    });
    let specs: Vec<DeviceSpec> = (0..ndev)
        .map(|i| {
            let source = sources_of.get(i).cloned().unwrap_or(ArenaSource::Memfd);
            let path = match &source {
                ArenaSource::Path(p) | ArenaSource::CreateFile(p) => p.display().to_string(),
                _ => "memfd".to_string(),
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
        spin: cfg.effective_spin(),
        wait_spin: cfg.effective_wait_spin(),
        signal: cfg.signal,
        cpus: cpus.to_vec(),
        ..EngineOptions::default()
    };
    let engine = Engine::open(specs, size, false, opts).map_err(|e| fail(&e))?;
    let devs = engine.device_list();
    // Each submitting thread gets rings of its own (no submit lock).
    let mut subs = (0..cfg.submitters.max(1))
        .map(|_| engine.submitter().map_err(|e| fail(&e)))
        .collect::<Result<Vec<_>, _>>()?;
    if cfg.prefault {
        for d in devs.iter() {
            if let Some(g) = d.core().raw_guard() {
                #[allow(unsafe_code)]
                // SAFETY: `ArenaGuard::prefault`'s contract: nothing has
                // been submitted yet, so no worker reads or writes the
                // mapping while it is pre-faulted.
                unsafe {
                    g.prefault();
                }
            }
        }
    }
    // Sources: a ring of distinct objects (bounded memory); destinations:
    // one buffer per object, touched before timing.
    let ring = plan.sources;
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
    let verify_ids: Vec<usize> = (0..n).step_by(cfg.verify_every.max(1)).collect();
    let depth = cfg.inflight_tasks.max(1);
    let (store_threads, load_threads) = (cfg.store_workers.max(1), cfg.load_workers.max(1));
    let guards = || {
        devs.iter()
            .map(|d| {
                d.core()
                    .raw_guard()
                    .ok_or_else(|| BenchError::Failed("device closed".into()))
            })
            .collect::<Result<Vec<_>, _>>()
    };
    // One raw pass with one thread, and with `threads` (the phase's worker
    // count) when that is more: `(x1, xN)`, GB/s.
    let raw_cpus = std::cell::RefCell::new(Vec::new());
    // Also the process's CPU seconds of the pass with `threads` threads.
    let limits = |dests: &mut [Option<Vec<u8>>], pass: Pass, threads: usize| {
        let g = guards()?;
        let c0 = cpu_now();
        let one = raw_pass(&g, per_dev, size, &sources, dests, pass, 1, cpus, &raw_cpus)?;
        let mut cpu = cpu_now() - c0;
        let many = if threads > 1 {
            let c0 = cpu_now();
            let many = raw_pass(
                &g, per_dev, size, &sources, dests, pass, threads, cpus, &raw_cpus,
            )?;
            cpu = cpu_now() - c0;
            many
        } else {
            one
        };
        Ok::<_, BenchError>((one, many, cpu))
    };
    // The idle engine: open, workers started, nothing submitted yet.
    let idle_cpu = (index == 0 && !cfg.idle.is_zero()).then(|| {
        let (u0, s0) = crate::host::sys::process_cpu_seconds().unwrap_or_default();
        let t = Instant::now();
        std::thread::sleep(cfg.idle);
        let (u1, s1) = crate::host::sys::process_cpu_seconds().unwrap_or_default();
        IdleCpu {
            seconds: t.elapsed().as_secs_f64(),
            user_s: u1 - u0,
            sys_s: s1 - s0,
        }
    });
    let work = Work {
        engine: &engine,
        keys: &keys,
        sources: &sources,
        n,
        depth,
    };
    let sub_cpus = placement_subs;
    let mut sub_ran_on: Vec<Vec<usize>> = Vec::new();
    // One pass of a phase through the submitters: (seconds, latencies,
    // ok count), with the phase's CPU, contention and per-submitter
    // seconds recorded in `acc`.
    let mut pass =
        |acc: &mut Acc, phase: Phase, dests: &mut [Option<Vec<u8>>]| -> Result<usize, BenchError> {
            let (c0, k0) = (cpu_now(), engine.contention());
            let (secs, outs) = drive(&work, &mut subs, phase, dests, sub_cpus)?;
            acc.cpu_s.push(cpu_now() - c0);
            acc.contention.push(engine.contention().since(&k0));
            acc.secs.push(secs);
            if sub_ran_on.is_empty() {
                sub_ran_on = outs.iter().map(|o| o.cpus.clone()).collect();
            }
            let total = outs.len();
            if acc.lanes.is_empty() {
                for k in 0..total {
                    let (lo, hi) = (k * tasks / total, (k + 1) * tasks / total);
                    let objects = (hi * TASK_KEYS).min(n) - (lo * TASK_KEYS).min(n);
                    acc.lanes.push((hi - lo, objects, Vec::new()));
                }
            }
            let mut ok = 0;
            for (o, l) in outs.into_iter().zip(acc.lanes.iter_mut()) {
                l.2.push(o.end.duration_since(o.start).as_secs_f64());
                acc.lat_us.extend(o.lat_us);
                ok += o.ok;
            }
            Ok(ok)
        };

    let mut limit_rounds = Vec::with_capacity(cfg.rounds);
    let (mut store, mut lookup, mut load, mut unlock, mut delete) = (
        Acc::default(),
        Acc::default(),
        Acc::default(),
        Acc::default(),
        Acc::default(),
    );
    for round in 0..cfg.rounds {
        let mut tell = |phase| {
            progress(Progress::Phase {
                index,
                sizes: cfg.sizes.len(),
                size_bytes: size,
                phase,
                objects: n,
                round,
                rounds: cfg.rounds,
            });
        };
        // The copy-in limits, the one the store is compared with last (right
        // before the store). No task is in flight: the previous round's
        // phases have all been collected.
        tell("store");
        let (memcpy_in, nt_in, nt_in_threads, nt_cpu) = {
            let (mc, _, _) = limits(&mut dests, Pass::MemcpyIn, 1)?;
            let (nt, ntn, cpu) = limits(&mut dests, Pass::NtIn, store_threads)?;
            (mc, nt, ntn, cpu)
        };

        // store: each submitter collects its own results by id.
        let stored_ok = pass(&mut store, Phase::Store, &mut dests)?;
        if stored_ok != tasks {
            return Err(BenchError::Failed(format!(
                "{} of {tasks} store tasks failed ({size} bytes)",
                tasks - stored_ok
            )));
        }

        // lookup-and-lock
        tell("lookup");
        let hits = pass(&mut lookup, Phase::Lookup, &mut dests)?;
        if hits != n {
            return Err(BenchError::Failed(format!("lookup found {hits} of {n}")));
        }

        // The copy-out limits into the same destination buffers (reading
        // committed slots while no task is in flight), the load's last.
        tell("load");
        let (out, out_threads, out_cpu) = limits(&mut dests, Pass::Out, load_threads)?;
        // The raw pass may have left the right bytes in a buffer (slot i
        // can hold object i): clear the sampled ones so that the check
        // below sees what the load wrote.
        for &i in &verify_ids {
            if let Some(d) = dests[i].as_mut() {
                d.fill(0);
            }
        }
        // load: each task's destinations go in and come back.
        let loaded = pass(&mut load, Phase::Load, &mut dests)?;
        let ok = loaded == n
            && verify_ids
                .iter()
                .all(|&i| dests[i].as_deref() == Some(&sources[i % ring][..]));
        load.verified = Some(load.verified.unwrap_or(true) && ok);
        // The copy-out limits again, right after the load (the buffers
        // have been checked; reading the mapping changes nothing): the
        // load is compared with the mean of the passes around it.
        let (out, out_threads) = {
            let (o, on, cpu) = limits(&mut dests, Pass::Out, load_threads)?;
            load.raw_cpu_s.push(mean2(out_cpu, cpu));
            (mean2(out, o), mean2(out_threads, on))
        };
        load.limit.push(out_threads);
        load.limit1.push(out);

        // unlock and delete are synchronous calls.
        tell("unlock/delete");
        let t0 = Instant::now();
        for t in 0..tasks {
            let at = Instant::now();
            engine.submit_unlock(&keys[range(t)]);
            unlock.lat_us.push(at.elapsed().as_secs_f64() * 1e6);
        }
        unlock.secs.push(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        let mut deleted = 0;
        let mut gone = Vec::with_capacity(TASK_KEYS);
        for t in 0..tasks {
            gone.clear();
            let at = Instant::now();
            deleted += engine.delete_into(&keys[range(t)], &mut gone);
            delete.lat_us.push(at.elapsed().as_secs_f64() * 1e6);
        }
        delete.secs.push(t0.elapsed().as_secs_f64());
        let live: usize = devs.iter().map(|d| d.core().live_slot_count()).sum();
        if deleted != n || live != 0 {
            return Err(BenchError::Failed(format!(
                "deleted {deleted} of {n}; {live} slots still live"
            )));
        }
        // The copy-in limit again, now that every slot is free (a pass
        // right after the store would overwrite objects it stored in
        // other slots): the store is compared with the mean of the passes
        // around it.
        let (nt_in, nt_in_threads) = {
            let (nt, ntn, cpu) = limits(&mut dests, Pass::NtIn, store_threads)?;
            store.raw_cpu_s.push(mean2(nt_cpu, cpu));
            (mean2(nt_in, nt), mean2(nt_in_threads, ntn))
        };
        store.limit.push(nt_in_threads);
        store.limit1.push(nt_in);
        limit_rounds.push(LimitRound {
            nt_copy_in: nt_in,
            memcpy_in,
            copy_out: out,
            nt_copy_in_threads: nt_in_threads,
            copy_out_threads: out_threads,
        });
    }
    // Read back before close: the CPU each worker last ran on is where it
    // ran the phases.
    let ran_on = RanOn {
        caller: crate::host::sys::thread_cpus().unwrap_or_default(),
        caller_last_cpu: crate::host::sys::current_cpu(),
        workers: engine.worker_placement(),
        raw_copies: raw_cpus.take(),
        submitters: sub_ran_on,
    };
    drop(devs);
    drop(subs);
    engine.close();

    let med = |f: fn(&LimitRound) -> f64| median(&limit_rounds.iter().map(f).collect::<Vec<_>>());
    let limits = Limits {
        size_bytes: size,
        nt_copy_in_gb_s: med(|r| r.nt_copy_in),
        memcpy_in_gb_s: med(|r| r.memcpy_in),
        copy_out_gb_s: med(|r| r.copy_out),
        store_threads,
        nt_copy_in_threads_gb_s: med(|r| r.nt_copy_in_threads),
        load_threads,
        copy_out_threads_gb_s: med(|r| r.copy_out_threads),
        rounds: limit_rounds,
    };
    let bytes = Some(n * size);
    Ok((
        limits,
        [
            store.finish(size, "store", n, bytes, Some(store_threads)),
            lookup.finish(size, "lookup", n, None, None),
            load.finish(size, "load", n, bytes, Some(load_threads)),
            unlock.finish(size, "unlock", n, None, None),
            delete.finish(size, "delete", n, None, None),
        ],
        ran_on,
        idle_cpu,
    ))
}

fn format_row(r: &PhaseResult) -> String {
    format!(
        "{:>8} {:<7} {:>7} {:>12.0} {:>8} {:>9.2} {:>9.2} {:>9.2} {:>6} {:>7} {:>8} {:>7} {:>7}",
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
        r.ratio_spread
            .map_or("-".into(), |x| format!("{:.1}pt", x * 100.0)),
        r.verified.map_or("-", |v| if v { "ok" } else { "FAILED" }),
        r.cpu_s_per_gb.map_or("-".into(), |x| format!("{x:.3}")),
        r.raw_cpu_s_per_gb.map_or("-".into(), |x| format!("{x:.3}")),
    )
}

/// The sum of per-round contention counts.
fn contention_sum(rounds: &[Contention]) -> Contention {
    let mut c = Contention::default();
    for r in rounds {
        c.record_claim_retries += r.record_claim_retries;
        for (a, b) in c
            .completion_lock_misses
            .iter_mut()
            .zip(r.completion_lock_misses)
        {
            *a += b;
        }
    }
    c
}

fn contention_json(c: &Contention) -> serde_json::Value {
    serde_json::json!({
        "record_claim_retries": c.record_claim_retries,
        "completion_lock_misses": {
            "store": c.completion_lock_misses[0],
            "lookup": c.completion_lock_misses[1],
            "load": c.completion_lock_misses[2],
        },
    })
}

impl Report {
    /// Where the threads ran, in words.
    pub fn placement_line(&self) -> String {
        match &self.placement {
            Some(p) if p.submitters.len() > 1 => format!(
                "placement: submitters on CPU {:?} (the caller on {}); workers and raw copies on CPU {:?} (--no-pin: unpinned)",
                p.submitters, p.caller, p.workers
            ),
            Some(p) => format!(
                "placement: caller on CPU {}; workers and raw copies on CPU {:?} (--no-pin: unpinned)",
                p.caller, p.workers
            ),
            None if self.config.pin => "placement: unpinned (fewer CPUs than the largest pool + the submitters, or no affinity)".into(),
            None => "placement: unpinned (--no-pin)".into(),
        }
    }

    /// How much of the CPUs other processes took during the run, per size,
    /// with a warning when that disturbs the ratios.
    fn other_load_line(&self) -> Option<String> {
        let o = self.other_cpu?;
        let by_size: Vec<String> = self
            .config
            .sizes
            .iter()
            .zip(&self.other_cpu_by_size)
            .filter_map(|(&sz, o)| o.map(|o| format!("{} {:.0}%", human(sz), o * 100.0)))
            .collect();
        Some(format!(
            "other load: other processes used {:.0}% of the CPUs during the run ({}){}",
            o * 100.0,
            by_size.join(", "),
            if o > 0.05 {
                "; ratios and their spread are disturbed, rerun on an idle machine"
            } else {
                ""
            }
        ))
    }

    /// The human-readable table (stdout).
    pub fn table(&self) -> String {
        let c = &self.config;
        let (st, lt) = (c.store_workers.max(1), c.load_workers.max(1));
        let mut s = String::new();
        let _ = writeln!(
            s,
            "daxkv bench {}: engine path, {} submitter(s), workers store/lookup/load {}/{}/{}, spin {} us, caller wait spin {} us, signal {}, tasks of {TASK_KEYS} keys, {} in flight per submitter, {} rounds per size, device {}",
            self.version,
            c.submitters.max(1),
            self.workers.0,
            self.workers.1,
            self.workers.2,
            self.spin_us,
            self.wait_spin_us,
            self.signal,
            c.inflight_tasks,
            c.rounds,
            self.device,
        );
        let _ = writeln!(
            s,
            "copy kernel {} ({}); machine: {}, {} cores, {} NUMA node(s); raw eventfd ping-pong {:.1} us",
            self.kernel, self.kernel_description, self.cpu, self.cores, self.numa_nodes, self.eventfd_ping_pong_us
        );
        let _ = writeln!(
            s,
            "units: sizes binary (1 KiB = 1024 bytes, 1 MiB = 1024 KiB); throughput decimal GB/s (10^9 bytes/s); latency us per task"
        );
        if let Some(line) = self.other_load_line() {
            let _ = writeln!(s, "{line}");
        }
        let _ = writeln!(s, "{}", self.placement_line());
        let _ = writeln!(s, "{}", self.ran_on.line());
        let _ = writeln!(
            s,
            "\nlimits, GB/s (raw copies of the same objects on the same mapping, xN = N threads on disjoint parts; median of {} rounds):",
            c.rounds
        );
        let mut head = format!(
            "{:>8} {:>10} {:>12} {:>10}",
            "size", "nt_in x1", "memcpy_in x1", "out x1"
        );
        if st > 1 {
            let _ = write!(head, " {:>10}", format!("nt_in x{st}"));
        }
        if lt > 1 {
            let _ = write!(head, " {:>10}", format!("out x{lt}"));
        }
        let _ = writeln!(s, "{head}");
        for l in &self.limits {
            let _ = write!(
                s,
                "{:>8} {:>10.2} {:>12.2} {:>10.2}",
                human(l.size_bytes),
                l.nt_copy_in_gb_s,
                l.memcpy_in_gb_s,
                l.copy_out_gb_s
            );
            if st > 1 {
                let _ = write!(s, " {:>10.2}", l.nt_copy_in_threads_gb_s);
            }
            if lt > 1 {
                let _ = write!(s, " {:>10.2}", l.copy_out_threads_gb_s);
            }
            s.push('\n');
        }
        let _ = writeln!(
            s,
            "\nphases (objects/s and GB/s: median of {} rounds; ratio: median of the per-round ratios store / nt_in x{st}, load / out x{lt}, each limit measured in the same round; spread: max - min of those ratios, in percentage points; cpu/GB: user + sys CPU seconds of the whole process per GB moved over the timed pass, median of rounds; raw/GB: the same for the raw copy nt_in x{st} / out x{lt} in the same round):",
            c.rounds
        );
        let _ = writeln!(
            s,
            "{:>8} {:<7} {:>7} {:>12} {:>8} {:>9} {:>9} {:>9} {:>6} {:>7} {:>8} {:>7} {:>7}",
            "size",
            "phase",
            "objects",
            "objects/s",
            "GB/s",
            "p50 us",
            "p99 us",
            "max us",
            "ratio",
            "spread",
            "verified",
            "cpu/GB",
            "raw/GB"
        );
        for r in &self.results {
            let _ = writeln!(s, "{}", format_row(r));
        }
        if let Some(line) = self.submitters_line() {
            let _ = writeln!(s, "{line}");
        }
        let _ = writeln!(s, "{}", self.contention_line());
        if let Some(line) = self.idle_line() {
            let _ = writeln!(s, "{line}");
        }
        s
    }

    /// The idle engine's CPU time, in words.
    fn idle_line(&self) -> Option<String> {
        let i = self.idle_cpu?;
        Some(format!(
            "idle: the whole process used {:.4} CPU s (user {:.4} + sys {:.4}) over {:.2} s with the engine open and nothing submitted ({:.2}% of one CPU)",
            i.user_s + i.sys_s,
            i.user_s,
            i.sys_s,
            i.seconds,
            (i.user_s + i.sys_s) / i.seconds.max(1e-9) * 100.0
        ))
    }

    /// With more than one submitter: each one's objects/s per phase (the
    /// first size's and every other size's, in thread order).
    fn submitters_line(&self) -> Option<String> {
        if self.config.submitters <= 1 {
            return None;
        }
        let parts: Vec<String> = self
            .results
            .iter()
            .filter(|r| !r.submitters.is_empty())
            .map(|r| {
                let each: Vec<String> = r
                    .submitters
                    .iter()
                    .map(|x| format!("{:.0}", x.objects_per_s))
                    .collect();
                format!("{} {} {}", human(r.size_bytes), r.phase, each.join("/"))
            })
            .collect();
        Some(format!(
            "per submitter, objects/s (median of rounds, each over its own time): {}",
            parts.join("; ")
        ))
    }

    /// Contention counted in the timed passes, summed over the rounds.
    fn contention_line(&self) -> String {
        let parts: Vec<String> = self
            .results
            .iter()
            .filter(|r| !r.contention_rounds.is_empty())
            .map(|r| {
                let c = contention_sum(&r.contention_rounds);
                format!(
                    "{} {} {}/{}",
                    human(r.size_bytes),
                    r.phase,
                    c.record_claim_retries,
                    c.completion_lock_misses.iter().sum::<u64>()
                )
            })
            .collect();
        format!(
            "contention (record-claim retries / completion-lock misses, all rounds): {}",
            parts.join("; ")
        )
    }

    /// The `--json` document (its names are a stable interface; fields may be
    /// added, never renamed). Non-finite numbers are `null`.
    #[allow(clippy::too_many_lines)] // one field after another
    pub fn json(&self) -> String {
        use serde_json::json;
        let c = &self.config;
        let options = json!({
            "sizes": c.sizes,
            "total_bytes": c.total_bytes,
            "max_objects": c.max_objects,
            "paths": c.paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "create": c.create,
            "force": c.force,
            "devices": c.devices,
            "store_workers": c.store_workers,
            "lookup_workers": c.lookup_workers,
            "load_workers": c.load_workers,
            "spin_us": c.spin.as_micros() as u64,
            "wait_spin_us": c.wait_spin.map(|d| d.as_micros() as u64),
            "park": c.park,
            "signal": signal_name(c.signal),
            "inflight": c.inflight_tasks,
            "rounds": c.rounds,
            "prefault": c.prefault,
            "verify_every": c.verify_every,
            "pin": c.pin,
            "submitters": c.submitters,
            "idle_s": c.idle.as_secs_f64(),
            "json": c.json.as_ref().map(|p| p.display().to_string()),
        });
        let limits: serde_json::Map<String, serde_json::Value> = self
            .limits
            .iter()
            .map(|l| {
                let rounds: Vec<_> = l
                    .rounds
                    .iter()
                    .map(|r| {
                        json!({
                            "nt_copy_in_gb_s": r.nt_copy_in,
                            "memcpy_in_gb_s": r.memcpy_in,
                            "copy_out_gb_s": r.copy_out,
                            "nt_copy_in_threads_gb_s": r.nt_copy_in_threads,
                            "copy_out_threads_gb_s": r.copy_out_threads,
                        })
                    })
                    .collect();
                (
                    l.size_bytes.to_string(),
                    json!({
                        "nt_copy_in_gb_s": l.nt_copy_in_gb_s,
                        "memcpy_in_gb_s": l.memcpy_in_gb_s,
                        "copy_out_gb_s": l.copy_out_gb_s,
                        "store_threads": l.store_threads,
                        "nt_copy_in_threads_gb_s": l.nt_copy_in_threads_gb_s,
                        "load_threads": l.load_threads,
                        "copy_out_threads_gb_s": l.copy_out_threads_gb_s,
                        "rounds": rounds,
                    }),
                )
            })
            .collect();
        let results: Vec<_> = self
            .results
            .iter()
            .map(|r| {
                json!({
                    "size_bytes": r.size_bytes,
                    "phase": r.phase,
                    "objects": r.objects,
                    "rounds": r.rounds,
                    "seconds": r.seconds,
                    "objects_per_s": r.objects_per_s,
                    "gb_per_s": r.gb_per_s,
                    "p50_us": r.p50_us,
                    "p99_us": r.p99_us,
                    "max_us": r.max_us,
                    "limit_threads": r.limit_threads,
                    "ratio_to_limit": r.ratio_to_limit,
                    "ratio_spread": r.ratio_spread,
                    "ratio_rounds": r.ratio_rounds,
                    "ratio_to_single_thread_limit": r.ratio_to_single_thread_limit,
                    "verified": r.verified,
                    "cpu_s_per_gb": r.cpu_s_per_gb,
                    "raw_cpu_s_per_gb": r.raw_cpu_s_per_gb,
                    "submitters": r.submitters.iter().map(|x| json!({
                        "tasks": x.tasks,
                        "objects": x.objects,
                        "objects_per_s": x.objects_per_s,
                    })).collect::<Vec<_>>(),
                    "contention": (!r.contention_rounds.is_empty()).then(|| {
                        let mut j = contention_json(&contention_sum(&r.contention_rounds));
                        j["rounds"] = r.contention_rounds.iter().map(contention_json).collect();
                        j
                    }),
                })
            })
            .collect();
        json!({
            "version": self.version,
            "mode": "engine",
            "options": options,
            "units": {
                "sizes": "bytes (input sizes are binary: 1K = 1KiB = 1024)",
                "throughput": "GB/s = 10^9 bytes/s",
                "latency": "us per task",
                "ratio": "fraction of the limit (median of rounds); ratio_spread: max - min",
                "cpu": "cpu_s_per_gb: user + sys CPU seconds of the whole process (getrusage) per 10^9 bytes moved",
            },
            "machine": {
                "cpu": self.cpu,
                "cores": self.cores,
                "numa_nodes": self.numa_nodes,
            },
            "workers": {
                "store": self.workers.0,
                "lookup": self.workers.1,
                "load": self.workers.2,
            },
            "spin_us": self.spin_us,
            "wait_spin_us": self.wait_spin_us,
            "signal": self.signal,
            "placement": self.placement.as_ref().map(|p| json!({
                "caller": p.caller,
                "submitters": p.submitters,
                "workers": p.workers,
            })),
            "ran_on": self.ran_on.to_json(),
            "copy_kernel": self.kernel,
            "copy_kernel_description": self.kernel_description,
            "device": self.device,
            "rounds": c.rounds,
            "limits": limits,
            "eventfd_ping_pong_us": self.eventfd_ping_pong_us,
            "other_cpu": {
                "run": self.other_cpu,
                "by_size": c
                    .sizes
                    .iter()
                    .zip(&self.other_cpu_by_size)
                    .map(|(sz, o)| (sz.to_string(), json!(o)))
                    .collect::<serde_json::Map<_, _>>(),
            },
            "results": results,
            "submitters": c.submitters,
            "idle_cpu": self.idle_cpu.map(|i| json!({
                "seconds": i.seconds,
                "user_s": i.user_s,
                "sys_s": i.sys_s,
                "cpu_s": i.user_s + i.sys_s,
            })),
        })
        .to_string()
    }
}

/// Parse a size like `4K`, `64KiB`, `2M`, `1.5GiB` or `4096`. Every suffix
/// is binary, with or without the `i`: `K` = `KB` = `KiB` = 1024 bytes.
pub fn parse_size(s: &str) -> Option<usize> {
    // One grammar for every size the project reads: the control plane's
    // (docs/lmcache-dax-behavior.md §5.4, exact on integers).
    crate::control::http::parse_size(s).and_then(|n| usize::try_from(n).ok())
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

    /// Every size suffix is binary, with or without the `i`: the units are
    /// stated once (docs/performance.md, table header) and mean the same everywhere.
    #[test]
    fn size_suffixes_are_binary() {
        for (s, want) in [
            ("4K", 4 << 10),
            ("4KiB", 4 << 10),
            ("4KB", 4 << 10),
            ("2M", 2 << 20),
            ("2MiB", 2 << 20),
            ("2mib", 2 << 20),
            ("1G", 1 << 30),
            ("1GiB", 1 << 30),
            ("8 MiB", 8 << 20),
            ("512B", 512),
        ] {
            assert_eq!(parse_size(s), Some(want), "{s}");
        }
        assert_eq!(human(4 << 10), "4 KiB");
        assert_eq!(human(1 << 30), "1 GiB");
        assert_eq!(human(3 << 19), "1536 KiB");
        assert_eq!(human(1000), "1000 B");
        assert_eq!(human_amount(3 << 29), "1.50 GiB");
    }

    #[test]
    fn median_and_spread() {
        assert!((median(&[3.0, 1.0, 2.0]) - 2.0).abs() < 1e-12);
        assert!((median(&[4.0, 1.0, 2.0, 3.0]) - 2.5).abs() < 1e-12);
        assert!((spread(&[0.9, 0.7, 0.95]) - 0.25).abs() < 1e-12);
        assert!(median(&[]).abs() < 1e-12 && spread(&[]).abs() < 1e-12);
    }

    /// The memory check counts what the run allocates at its largest size:
    /// the memfd mapping, a destination buffer per object and the source
    /// ring (for 8 MiB objects and a 1 GiB total: 1 + 1 + 0.5 GiB).
    #[test]
    fn memory_need_counts_mapping_destinations_and_sources() {
        let cfg = BenchConfig::default();
        let m = cfg.memory_need(8 << 20);
        assert_eq!(m.mapping, 1 << 30);
        assert_eq!(m.destinations, 1 << 30);
        assert_eq!(m.sources, 64 * (8 << 20));
        assert!(m.engine >= ENGINE_FIXED_BYTES && m.engine < 64 << 20);
        let small = cfg.memory_need(4 << 10);
        assert_eq!(small.destinations, 20_000 * 4096);
        assert!(small.total() < m.total());
        // A character device takes no RAM for its mapping.
        let dev = BenchConfig {
            paths: vec!["/dev/null".into()],
            ..BenchConfig::default()
        };
        assert_eq!(dev.memory_need(8 << 20).mapping, 0);
    }

    #[test]
    fn preflight_refuses_a_size_above_the_total() {
        let cfg = BenchConfig {
            sizes: vec![4096, 2 << 30],
            ..BenchConfig::default()
        };
        let e = preflight(&cfg).unwrap_err().to_string();
        assert!(
            e.contains("--sizes 2 GiB") && e.contains("--total-bytes 1 GiB"),
            "{e}"
        );
    }

    #[test]
    fn defaults_are_the_engines() {
        let (b, e) = (BenchConfig::default(), EngineOptions::default());
        assert_eq!(
            (b.store_workers, b.lookup_workers, b.load_workers, b.spin),
            (
                e.num_store_workers,
                e.num_lookup_workers,
                e.num_load_workers,
                e.spin
            )
        );
        assert!(b.rounds >= 3);
    }

    #[test]
    fn placement_needs_a_cpu_more_than_the_largest_pool() {
        let cfg = BenchConfig {
            store_workers: 1,
            lookup_workers: 1,
            load_workers: 1,
            ..BenchConfig::default()
        };
        let p = Placement::choose(&cfg, &[0, 1]).unwrap();
        assert_eq!((p.caller, p.workers), (0, vec![1]));
        let p = Placement::choose(&cfg, &[2, 5, 7]).unwrap();
        assert_eq!((p.caller, p.workers), (2, vec![5, 7]));
        assert_eq!(Placement::choose(&cfg, &[3]), None, "one CPU: unpinned");
        let two = BenchConfig {
            load_workers: 2,
            ..cfg.clone()
        };
        assert_eq!(
            Placement::choose(&two, &[0, 1]),
            None,
            "two load workers would share one CPU"
        );
        assert!(Placement::choose(&two, &[0, 1, 2]).is_some());
        let off = BenchConfig {
            pin: false,
            ..cfg.clone()
        };
        assert_eq!(Placement::choose(&off, &[0, 1, 2, 3]), None);
        // Each submitter gets a CPU of its own, the caller the first.
        let subs = BenchConfig {
            submitters: 3,
            ..cfg
        };
        assert_eq!(
            Placement::choose(&subs, &[0, 1, 2]),
            None,
            "three submitters and a worker need four CPUs"
        );
        let p = Placement::choose(&subs, &[4, 5, 6, 7, 8]).unwrap();
        assert_eq!(
            (p.caller, p.submitters, p.workers),
            (4, vec![4, 5, 6], vec![7, 8])
        );
    }
}
