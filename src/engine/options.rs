//! # Engine options: worker pools, spinning, the task table, signalling
//!
//! Plain values with LMCache's defaults; the JSON config
//! ([`crate::control::config`]) builds them, and so may an embedding server.

#![forbid(unsafe_code)]

use std::time::Duration;

use crate::host::numa::PlacementSource;
use crate::key::Key;

/// Worker pool sizes and behaviour.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Store workers (LMCache's `num_store_workers`, default 1).
    pub num_store_workers: usize,
    /// Lookup workers (LMCache's `num_lookup_workers`, default 1).
    pub num_lookup_workers: usize,
    /// Load workers (LMCache's `num_load_workers`, default `min(4, cpus)`).
    pub num_load_workers: usize,
    /// How long an idle worker (or a waiting caller) spins before parking.
    /// Default 250 µs: longer than a cross-vCPU eventfd wake (100-200 µs on
    /// the VM this was tuned on), so a caller woken from park can resubmit
    /// before the worker parks again; with 50 µs both sides could fall into
    /// paying a wake per task.
    pub spin: Duration,
    /// How long a `wait_*` caller spins before parking on the eventfd.
    /// A caller that spins holds a CPU the workers could use: with more
    /// runnable workers than CPUs (two load workers and the caller on two
    /// vCPUs), a short wait spin lets both workers run (see docs/performance.md). Default: `spin`.
    pub wait_spin: Duration,
    /// Size of the task table: tasks in flight plus results not collected.
    pub task_slots: usize,
    /// Keys per task the table is sized for: a task of at most this many
    /// keys allocates nothing in the engine (each record holds this many
    /// destination descriptors and result bits, 16 bytes and 1 bit a key:
    /// about 4 MiB for 4096 slots × 64 keys). A larger task grows its
    /// record once; the record keeps the room.
    pub task_keys: usize,
    /// CPUs to pin workers to: worker `w` of each pool on `cpus[w % len]`
    /// alone. Empty: not pinned, every worker may use the process's whole
    /// allowed set (not just the opening thread's CPUs). CPUs outside the
    /// process's set are dropped with a warning
    /// ([`Engine::placement_warnings`](super::Engine::placement_warnings));
    /// `crate::host::numa::affinity` has the policy.
    pub cpus: Vec<usize>,
    /// Which data chose `cpus` (HMAT, distance, an explicit list, or
    /// none); status reports it as `numa.source`. Set by
    /// [`EngineConfig::options`](crate::control::config::EngineConfig::options).
    pub cpus_source: PlacementSource,
    /// The NUMA node whose CPUs `cpus` are, when placement chose one
    /// (status: `numa.node`).
    pub cpus_node: Option<u32>,
    /// Fault injection for tests: a task part that meets this key panics.
    pub panic_on_key: Option<Key>,
    /// When workers write the completion eventfds.
    pub signal: Signal,
}

/// When a worker writes its class's completion eventfd.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Signal {
    /// After every completion: the fds are polled by someone who does not
    /// use the `wait_*` helpers (LMCache's controllers). The default.
    #[default]
    Always,
    /// Only while a `wait_*` caller is parked (it counts itself in the
    /// pool's waiters before sleeping): a busy caller that finds its
    /// results while spinning costs the workers no syscall per task.
    ///
    /// An fd poller is never left hanging: once a kind's eventfd has been
    /// handed out ([`Engine::event_fds`](super::Engine::event_fds) and
    /// friends), its poller counts as a waiter for good and that kind
    /// signals after every completion, as with `Always` (the handout also
    /// writes the fd once, for tasks that finished before it).
    WhenWaiting,
}

impl Default for EngineOptions {
    /// LMCache's defaults: 1 store worker, 1 lookup worker,
    /// `min(4, cpus)` load workers.
    fn default() -> EngineOptions {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        EngineOptions {
            num_store_workers: 1,
            num_lookup_workers: 1,
            num_load_workers: cpus.min(4),
            spin: Duration::from_micros(250),
            wait_spin: Duration::from_micros(250),
            task_slots: 4096,
            task_keys: 64,
            cpus: Vec::new(),
            cpus_source: PlacementSource::None,
            cpus_node: None,
            panic_on_key: None,
            signal: Signal::Always,
        }
    }
}
