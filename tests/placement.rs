//! Worker placement: workers run where they were asked to, whatever the
//! mask of the thread that opens the engine (`numa::affinity`), report the
//! CPUs they read back, and a config naming a node or CPU the host does not
//! have is refused. Real threads, real `sched_setaffinity`, the masks read
//! back independently from `/proc/self/task/<tid>/status`.

use std::collections::BTreeMap;
use std::sync::Mutex;

use daxkv::control::config::EngineConfig;
use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceSpec, Engine, EngineOptions};
use daxkv::host::numa::affinity::ProcessCpus;
use daxkv::CoreConfig;

const SLOT: usize = 4096;

/// One engine at a time in this binary: a test tells its engine's workers
/// from others' by the threads that appeared while it opened.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn memfd_dev() -> DeviceSpec {
    DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(16 * SLOT), SLOT),
    }
}

/// One thread of this process as the kernel reports it: (name,
/// `Cpus_allowed_list`). Read by tid, never by walking `/proc/self/task`:
/// that walk resumes by index and can skip live threads while other
/// tests' threads exit.
fn thread(tid: i32) -> (String, String) {
    let dir = format!("/proc/self/task/{tid}");
    let comm = std::fs::read_to_string(format!("{dir}/comm")).unwrap();
    let status = std::fs::read_to_string(format!("{dir}/status")).unwrap();
    let allowed = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string();
    (comm.trim().to_string(), allowed)
}

/// Open an engine from a thread pinned to `opener_cpu` alone; returns it
/// and its workers as the kernel reports them: name -> allowed CPUs.
fn open_from_pinned_thread(
    opener_cpu: usize,
    opts: EngineOptions,
) -> (Engine, BTreeMap<String, String>) {
    let e = std::thread::spawn(move || {
        // SAFETY: cpu_set_t is plain data (all-zero is the empty set);
        // CPU_SET sets one bit below CPU_SETSIZE; the call only reads it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(opener_cpu, &mut set);
            assert_eq!(
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw const set),
                0
            );
        }
        // SAFETY: gettid takes no arguments.
        let tid = unsafe { libc::gettid() };
        let me = thread(tid);
        assert_eq!(me.1, opener_cpu.to_string(), "the opener is narrowed");
        Engine::open(vec![memfd_dev()], SLOT, false, opts).unwrap()
    })
    .join()
    .unwrap();
    // The workers' own tids; their names and masks as the kernel has them.
    let workers = e
        .worker_placement()
        .iter()
        .map(|w| {
            let (name, allowed) = thread(w.tid);
            assert_eq!(name, w.name, "tid {} is this worker", w.tid);
            (name, allowed)
        })
        .collect();
    (e, workers)
}

/// The process's CPUs, or `None` (with the reason printed) when there are
/// fewer than two.
fn two_cpus() -> Option<(usize, usize)> {
    let p = ProcessCpus::current();
    if p.cpus.len() < 2 {
        eprintln!("skipped: the process may use one CPU only ({p:?})");
        return None;
    }
    Some((p.cpus[0], p.cpus[p.cpus.len() - 1]))
}

fn opts(workers: usize, cpus: Vec<usize>) -> EngineOptions {
    EngineOptions {
        num_store_workers: workers,
        num_lookup_workers: workers,
        num_load_workers: workers,
        cpus,
        ..EngineOptions::default()
    }
}

/// The opener is pinned to CPU `a`; the engine asks for `a` and `b`:
/// worker `w` of every pool runs on the `w`-th of them (not every worker
/// left on `a`, the opener's CPU, with nothing saying so), and
/// `status()` reports the CPUs each worker read back.
#[test]
fn an_opener_narrower_than_the_cpus_asked_for_does_not_confine_the_workers() {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some((a, b)) = two_cpus() else { return };
    let (e, workers) = open_from_pinned_thread(a, opts(2, vec![a, b]));
    assert_eq!(workers.len(), 6, "{workers:?}");
    for (name, allowed) in &workers {
        let want = if name.ends_with("-0") { a } else { b };
        assert_eq!(allowed, &want.to_string(), "{name}: {workers:?}");
    }
    // status() says the same, from the workers' own read-back.
    let st = e.status();
    let listed = st["numa"]["workers"].as_array().unwrap();
    assert_eq!(listed.len(), 6, "{st}");
    for w in listed {
        let name = w["name"].as_str().unwrap();
        let want = if name.ends_with("-0") { a } else { b };
        assert_eq!(w["cpus"], serde_json::json!([want]), "{w}");
        assert_eq!(w["mask"], serde_json::json!([want]), "{w}");
        assert_eq!(w["error"], serde_json::Value::Null, "{w}");
        let last = w["last_cpu"].as_u64().unwrap();
        assert_eq!(
            last, want as u64,
            "a worker pinned alone last ran there: {w}"
        );
        assert_eq!(workers[name], want.to_string(), "{w}");
    }
    assert_eq!(st["numa"]["warnings"], serde_json::json!([]), "{st}");
    assert!(e.placement_warnings().is_empty());
    e.close();
    assert!(e.worker_placement().is_empty(), "no workers once closed");
}

/// The process may use more CPUs than asked for: asked for `b` alone,
/// every worker runs on `b` alone; asked for nothing, every worker may run
/// on any CPU of the process, not just the opener's (they do not inherit
/// the opener's one CPU).
#[test]
fn a_process_wider_than_the_cpus_asked_for_places_workers_as_asked() {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some((a, b)) = two_cpus() else { return };
    let (e, workers) = open_from_pinned_thread(a, opts(2, vec![b]));
    assert_eq!(workers.len(), 6);
    assert!(workers.values().all(|c| c == &b.to_string()), "{workers:?}");
    e.close();

    let all = ProcessCpus::current();
    let listed = daxkv::host::numa::affinity::format_cpulist(&all.cpus);
    let (e, workers) = open_from_pinned_thread(a, opts(1, vec![]));
    assert_eq!(workers.len(), 3);
    assert!(
        workers.values().all(|c| c == &listed),
        "{workers:?} vs {listed}"
    );
    let st = e.status();
    assert_eq!(st["numa"]["process_cpus"], serde_json::json!(all.cpus));
    for w in st["numa"]["workers"].as_array().unwrap() {
        assert_eq!(w["cpus"], serde_json::json!(all.cpus), "{w}");
    }
    e.close();
}

/// CPUs asked for outside the process's set (here: past any CPU the host
/// has) are a warning naming them and the set, and a fallback: the others
/// asked for, else the whole set. Nothing fails silently.
#[test]
fn cpus_outside_the_process_set_warn_and_fall_back() {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let all = ProcessCpus::current();
    let a = all.cpus[0];
    let e = Engine::open(vec![memfd_dev()], SLOT, false, opts(1, vec![4000, a])).unwrap();
    let warnings = e.placement_warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].starts_with("cpus 4000 asked for are outside the process's allowed CPUs")
            && warnings[0].ends_with(&format!("workers are pinned to the rest, cpus {a}")),
        "{warnings:?}"
    );
    for w in e.worker_placement() {
        assert_eq!(w.cpus, [a], "{w:?}");
    }
    assert_eq!(e.status()["numa"]["warnings"], serde_json::json!(warnings));
    e.close();
    let e = Engine::open(vec![memfd_dev()], SLOT, false, opts(1, vec![4000])).unwrap();
    assert!(
        e.placement_warnings()[0].contains("not pinned"),
        "{:?}",
        e.placement_warnings()
    );
    for w in e.worker_placement() {
        assert_eq!(w.cpus, all.cpus, "{w:?}");
    }
    e.close();
}

/// A config naming a NUMA node or CPU this host does not have is refused
/// with an error naming it and what exists (not accepted with the
/// workers run unpinned without a word).
#[test]
fn a_config_naming_a_missing_node_or_cpu_is_refused() {
    let root = tempfile::tempdir().unwrap();
    for (id, cpus) in [(0, "0-1"), (1, "2-3")] {
        let d = root.path().join(format!("devices/system/node/node{id}"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("cpulist"), format!("{cpus}\n")).unwrap();
        std::fs::write(d.join("distance"), "10 20\n").unwrap();
    }
    let sysfs = serde_json::to_string(root.path()).unwrap();
    let cfg = |extra: &str| {
        EngineConfig::from_json(&format!(
            r#"{{"slot_bytes":4096,"devices":[],"hotplug_enabled":true,"sysfs_root":{sysfs},{extra}}}"#
        ))
    };
    let e = cfg(r#""numa":2"#).unwrap_err();
    assert_eq!(e.field, "numa");
    assert_eq!(
        e.rule,
        format!(
            "node 2 does not exist on this host (nodes: 0-1, from {}/devices/system/node)",
            root.path().display()
        )
    );
    let e = cfg(r#""cpus":[1,4]"#).unwrap_err();
    assert_eq!(e.field, "cpus[1]");
    assert!(
        e.to_string().starts_with(
            "config: cpus[1]: CPU 4 does not exist on this host (online CPUs: 0-3, from "
        ),
        "{e}"
    );
    assert_eq!(cfg(r#""cpus":[]"#).unwrap_err().field, "cpus");
    assert!(cfg(r#""numa":1"#).is_ok());
    assert!(cfg(r#""cpus":[3,0]"#).is_ok());
    // The real host: one CPU past the online ones is refused.
    if let Some((online, _)) = daxkv::host::numa::online_cpus(std::path::Path::new("/sys")) {
        let past = online.last().unwrap() + 1;
        let e = EngineConfig::from_json(&format!(
            r#"{{"slot_bytes":4096,"devices":[],"hotplug_enabled":true,"cpus":[{past}]}}"#
        ))
        .unwrap_err();
        assert_eq!(e.field, "cpus[0]", "{e}");
        assert!(
            e.rule.contains(&format!("CPU {past} does not exist")),
            "{e}"
        );
    }
}

/// `daxkv serve` started with its whole process narrowed to CPU `a` (as
/// `taskset -c a` would), asked for CPU `b` in its config: the workers run
/// on `b`, and the start-up log names every worker and the CPUs it read
/// back. A config naming a CPU the host lacks stops the start with the
/// field named.
#[test]
fn serve_logs_where_every_worker_runs() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    let Some((a, b)) = two_cpus() else { return };
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.json");
    let write = |cpus: &str| {
        std::fs::write(
            &config,
            format!(
                r#"{{"slot_bytes":4096,"devices":[{{"device_path":"memfd","max_dax_size_gb":0.001}}],"num_load_workers":2,"cpus":{cpus}}}"#
            ),
        )
        .unwrap();
    };
    let serve = || {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_daxkv"));
        cmd.args(["serve", "--http", "127.0.0.1:0", "--config"])
            .arg(&config)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: between fork and exec only sched_setaffinity (async-
        // signal-safe) on a set built before the fork.
        let set = {
            // SAFETY: cpu_set_t is plain data; all-zero is the empty set
            // and CPU_SET sets one bit below CPU_SETSIZE.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(a, &mut set);
                set
            }
        };
        // SAFETY: as above.
        unsafe {
            cmd.pre_exec(move || {
                if libc::sched_setaffinity(
                    0,
                    std::mem::size_of::<libc::cpu_set_t>(),
                    &raw const set,
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.spawn().unwrap()
    };
    write(&format!("[{b}]"));
    let mut child = serve();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("daxkv: serving on http://"), "{line:?}");
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id().cast_signed(), libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let log = String::from_utf8_lossy(&out.stderr);
    for w in [
        "daxkv-store-0",
        "daxkv-lookup-0",
        "daxkv-load-0",
        "daxkv-load-1",
    ] {
        let placed = log
            .lines()
            .find(|l| l.contains("worker placed") && l.contains(&format!("worker={w} ")))
            .unwrap_or_else(|| panic!("no line for {w}:\n{log}"));
        assert!(placed.contains(&format!("cpus={b} ")), "{placed}");
    }
    assert!(!log.contains("WARN"), "{log}");
    // A CPU the host does not have: refused at start, naming it.
    let past = daxkv::host::numa::online_cpus(std::path::Path::new("/sys"))
        .map_or(4095, |(c, _)| c.last().unwrap() + 1);
    write(&format!("[{b},{past}]"));
    let out = serve().wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("cpus[1]: CPU {past} does not exist on this host")),
        "{err}"
    );
}
