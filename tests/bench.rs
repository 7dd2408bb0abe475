//! The `daxkv bench` workload at a tiny size: every phase runs in every
//! round, the data verification passes, the JSON carries the documented
//! names; and the real binary's checks, warnings and output (each run takes
//! a fraction of a second: a few objects, two rounds).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use daxkv::cli::bench::{run, BenchConfig, Progress};

#[test]
fn tiny_bench_is_complete_and_verified() {
    let cfg = BenchConfig {
        sizes: vec![4096, 64 << 10],
        total_bytes: 1 << 20,
        max_objects: 40,
        prefault: true,
        verify_every: 1,
        store_workers: 1,
        load_workers: 2,
        rounds: 2,
        ..BenchConfig::default()
    };
    let (mut rows, mut phases, mut prepared) = (0, Vec::new(), Vec::new());
    let report = run(&cfg, |p| match p {
        Progress::Row(_) => rows += 1,
        Progress::Preparing {
            index,
            prefault_bytes,
            ..
        } => prepared.push((index, prefault_bytes)),
        Progress::Phase {
            index,
            sizes,
            phase,
            round,
            rounds,
            ..
        } => {
            assert_eq!((sizes, rounds), (2, 2));
            phases.push((index, round, phase));
        }
    })
    .unwrap();
    assert_eq!(rows, 10, "one row per phase per size");
    assert_eq!(prepared, [(0, 40 * 4096), (1, 16 * 65536)]);
    assert_eq!(
        phases.len(),
        16,
        "four steps per round per size: {phases:?}"
    );
    assert_eq!(phases[4], (0, 1, "store"));
    assert_eq!(phases[8], (1, 0, "store"));
    assert_eq!(report.limits.len(), 2);
    for l in &report.limits {
        assert_eq!(l.rounds.len(), 2);
        assert_eq!((l.store_threads, l.load_threads), (1, 2));
        assert!(l.copy_out_threads_gb_s > 0.0 && l.nt_copy_in_gb_s > 0.0);
    }
    let phases: Vec<(usize, &str)> = report
        .results
        .iter()
        .map(|r| (r.size_bytes, r.phase))
        .collect();
    let mut want = Vec::new();
    for s in [4096, 65536] {
        for p in ["store", "lookup", "load", "unlock", "delete"] {
            want.push((s, p));
        }
    }
    assert_eq!(phases, want);
    for r in &report.results {
        assert_eq!(r.objects, if r.size_bytes == 4096 { 40 } else { 16 });
        assert_eq!(r.rounds, 2);
        assert!(r.objects_per_s > 0.0 && r.seconds > 0.0, "{r:?}");
        assert!(r.p50_us <= r.p99_us && r.p99_us <= r.max_us, "{r:?}");
    }
    for r in report
        .results
        .iter()
        .filter(|r| r.phase == "store" || r.phase == "load")
    {
        assert_eq!(r.ratio_rounds.len(), 2, "{r:?}");
        let (lo, hi) = (
            r.ratio_rounds.iter().copied().fold(f64::INFINITY, f64::min),
            r.ratio_rounds.iter().copied().fold(0.0, f64::max),
        );
        let (m, s) = (r.ratio_to_limit.unwrap(), r.ratio_spread.unwrap());
        assert!(lo > 0.0 && (lo..=hi).contains(&m), "{r:?}");
        assert!((s - (hi - lo)).abs() < 1e-12, "{r:?}");
        assert_eq!(r.limit_threads, Some(if r.phase == "load" { 2 } else { 1 }));
    }
    let load = report.results.iter().find(|r| r.phase == "load").unwrap();
    assert_eq!(load.verified, Some(true));
    check_library_json(&report);
}

/// The library's JSON document of the tiny run above.
fn check_library_json(report: &daxkv::cli::bench::Report) {
    let j: serde_json::Value = serde_json::from_str(&report.json()).unwrap();
    assert!(j["machine"]["cpu"].is_string());
    assert!(j["machine"]["cores"].as_u64().unwrap() >= 1);
    assert!(j["machine"]["numa_nodes"].as_u64().unwrap() >= 1);
    assert!(j["eventfd_ping_pong_us"].as_f64().unwrap() > 0.0);
    assert_eq!(j["mode"], "engine");
    assert_eq!(j["workers"]["load"], 2);
    for size in ["4096", "65536"] {
        for f in [
            "nt_copy_in_gb_s",
            "memcpy_in_gb_s",
            "copy_out_gb_s",
            "nt_copy_in_threads_gb_s",
            "copy_out_threads_gb_s",
        ] {
            assert!(
                j["limits"][size][f].as_f64().unwrap() > 0.0,
                "limits.{size}.{f}"
            );
        }
        assert_eq!(j["limits"][size]["rounds"].as_array().unwrap().len(), 2);
    }
    let results = j["results"].as_array().unwrap();
    assert_eq!(results.len(), 10);
    for r in results {
        for f in [
            "size_bytes",
            "phase",
            "objects",
            "rounds",
            "seconds",
            "objects_per_s",
            "gb_per_s",
            "p50_us",
            "p99_us",
            "max_us",
            "limit_threads",
            "ratio_to_limit",
            "ratio_spread",
            "ratio_rounds",
            "ratio_to_single_thread_limit",
            "verified",
            "cpu_s_per_gb",
            "raw_cpu_s_per_gb",
            "submitters",
            "contention",
        ] {
            assert!(r.get(f).is_some(), "result lacks {f}: {r}");
        }
    }
    let table = report.table();
    assert!(table.contains("verified") && table.contains("spread"));
}

#[test]
fn bench_refuses_a_zero_size() {
    let cfg = BenchConfig {
        sizes: vec![0],
        ..BenchConfig::default()
    };
    assert!(run(&cfg, |_| ())
        .unwrap_err()
        .to_string()
        .contains("object size must be > 0"));
}

/// The options of a tiny run: two sizes, a few objects each, two rounds.
const TINY: [&str; 9] = [
    "bench",
    "--sizes",
    "4K,64K",
    "--total-bytes",
    "1MiB",
    "--max-objects",
    "64",
    "--rounds",
    "2",
];

fn daxkv(args: &[&str], extra: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_daxkv"))
        .args(args)
        .args(extra)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A run refused before it starts: exit 1, one `daxkv:` line, nothing on
/// stdout, no stage of the run on stderr. Returns that line.
fn refused(out: &Output) -> String {
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "stdout:\n{so}\nstderr:\n{se}");
    assert!(so.is_empty(), "nothing runs: {so}");
    assert!(!se.contains("preparing"), "nothing runs: {se}");
    let errors: Vec<&str> = se
        .lines()
        .filter(|l| l.starts_with("daxkv: ") && !l.starts_with("daxkv: warning:"))
        .collect();
    assert_eq!(errors.len(), 1, "{se}");
    errors[0].to_string()
}

/// A tmpfs directory when there is one (the real use: a file in
/// /dev/shm), else the temp dir.
fn shm_dir() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
}

/// A user error is one clear line and a non-zero exit, also with
/// `RUST_BACKTRACE=1` (not anyhow's debug form with a backtrace).
#[test]
fn a_user_error_is_one_line_even_with_backtraces_on() {
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small.bin");
    std::fs::write(&small, vec![0u8; 1000]).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_daxkv"))
        .args(["bench", "--sizes", "4K", "--total-bytes", "1MiB", "--path"])
        .arg(&small)
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("daxkv: ")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(
        errors[0].contains("small.bin") && errors[0].contains("1000 bytes"),
        "{err}"
    );
    assert!(
        !err.contains("backtrace") && !err.contains("Caused by"),
        "{err}"
    );
}

/// The JSON records the version, every option, the signal mode, the copy
/// kernel, the CPU model and the core count, with real values.
#[test]
fn json_records_version_options_kernel_and_machine() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let out = daxkv(
        &[
            &TINY[..],
            &["--store-workers", "2", "--load-workers", "2", "--json"],
        ]
        .concat(),
        &[&json],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(j["version"], env!("CARGO_PKG_VERSION"));
    let o = &j["options"];
    let want = serde_json::json!({
        "sizes": [4096, 65536],
        "total_bytes": 1 << 20,
        "max_objects": 64,
        "paths": [],
        "create": false,
        "force": false,
        "devices": 1,
        "store_workers": 2,
        "lookup_workers": 1,
        "load_workers": 2,
        "spin_us": 250,
        "wait_spin_us": null,
        "park": false,
        "signal": "when_waiting",
        "inflight": 8,
        "rounds": 2,
        "prefault": true,
        "verify_every": 64,
        "pin": true,
        "submitters": 1,
        "idle_s": 1.0,
        "json": json.display().to_string(),
    });
    assert_eq!(o, &want);
    // Two store and two load workers: pinned only with a CPU more than
    // that for the caller (bench::Placement::choose).
    let cores = std::thread::available_parallelism().unwrap().get();
    let p = &j["placement"];
    if cores > 2 {
        let caller = p["caller"].as_u64().unwrap();
        let workers = p["workers"].as_array().unwrap();
        assert!(
            !workers.is_empty() && !workers.contains(&caller.into()),
            "{p}"
        );
    } else {
        assert!(p.is_null(), "{p}");
    }
    assert_eq!(j["signal"], "when_waiting");
    assert_eq!(j["spin_us"], 250);
    assert_eq!(j["wait_spin_us"], 250);
    let kernel = j["copy_kernel"].as_str().unwrap();
    assert!(
        ["avx512", "avx2", "sse2", "portable"].contains(&kernel),
        "{kernel}"
    );
    assert_eq!(kernel, daxkv::device::copy::selected().name());
    assert!(!j["copy_kernel_description"].as_str().unwrap().is_empty());
    let cpu = j["machine"]["cpu"].as_str().unwrap();
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string());
    match model {
        Some(m) => assert_eq!(cpu, m),
        None => assert!(!cpu.is_empty()),
    }
    assert_eq!(
        j["machine"]["cores"].as_u64().unwrap() as usize,
        std::thread::available_parallelism().unwrap().get()
    );
    // Interference: the share of the CPUs other processes used, a
    // fraction, for the run and per size.
    // A span shorter than one clock tick has no share: null, not a guess.
    let others = &j["other_cpu"]["run"];
    let sizes = ["4096", "65536"].map(|s| &j["other_cpu"]["by_size"][s]);
    for o in std::iter::once(others).chain(sizes) {
        match o.as_f64() {
            Some(v) => assert!((0.0..=1.0).contains(&v), "{v}"),
            None => assert!(o.is_null(), "{o}"),
        }
    }
    assert_eq!(j["limits"]["4096"]["store_threads"], 2);
    assert_eq!(j["limits"]["65536"]["load_threads"], 2);
    for r in j["results"].as_array().unwrap() {
        if r["phase"] == "store" || r["phase"] == "load" {
            assert_eq!(r["limit_threads"], 2, "{r}");
            assert!(r["ratio_to_limit"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["ratio_spread"].as_f64().unwrap() >= 0.0, "{r}");
            assert_eq!(r["ratio_rounds"].as_array().unwrap().len(), 2, "{r}");
        }
    }
}

/// With stderr not a terminal: the table once, on stdout, with its units
/// and the ratio's median and spread; stderr has one stage line per size
/// and no progress bar, no `done:` rows.
#[test]
fn output_is_once_table_on_stdout_and_no_rows_on_a_piped_stderr() {
    let out = daxkv(&TINY, &[]);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{se}");
    for size in ["4 KiB", "64 KiB"] {
        for phase in ["store", "lookup", "load", "unlock", "delete"] {
            let rows = so
                .lines()
                .filter(|l| {
                    let mut w = l.split_whitespace();
                    let s = format!("{} {}", w.next().unwrap_or(""), w.next().unwrap_or(""));
                    s == size && w.next() == Some(phase)
                })
                .count();
            assert_eq!(rows, 1, "{size} {phase}:\n{so}");
        }
    }
    assert!(
        so.contains("GB/s (10^9 bytes/s)") && so.contains("1 KiB = 1024 bytes"),
        "units stated in the header:\n{so}"
    );
    assert!(so.contains("other load: other processes used"), "{so}");
    let head = so
        .lines()
        .find(|l| l.trim_start().starts_with("size phase"))
        .unwrap();
    assert!(head.contains("ratio") && head.contains("spread"), "{head}");
    for l in so.lines().filter(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        w.len() > 2 && w[1] == "KiB" && (w[2] == "store" || w[2] == "load")
    }) {
        assert!(l.contains('%') && l.contains("pt"), "ratio and spread: {l}");
    }
    assert!(
        !se.contains("done:") && !se.contains('\r') && !se.contains("[#"),
        "{se}"
    );
    assert!(!se.contains(" store ") && !se.contains("objects/s"), "{se}");
    let stages: Vec<&str> = se.lines().filter(|l| l.contains("preparing")).collect();
    assert_eq!(stages.len(), 2, "{se}");
    assert!(stages[0].contains("pre-faulting 256.0 KiB"), "{se}");
}

#[test]
fn a_size_above_the_total_is_refused() {
    let e = refused(&daxkv(
        &["bench", "--sizes", "4K,2GiB", "--total-bytes", "1GiB"],
        &[],
    ));
    assert!(
        e.contains("--sizes 2 GiB") && e.contains("--total-bytes 1 GiB"),
        "{e}"
    );
}

#[test]
fn more_memory_than_available_is_refused_before_anything_runs() {
    let t = std::time::Instant::now();
    let e = refused(&daxkv(
        &[
            "bench",
            "--sizes",
            "8M",
            "--total-bytes",
            "64TiB",
            "--max-objects",
            "100000000",
        ],
        &[],
    ));
    // Both amounts are named: "needs about X TiB ... MemAvailable is Y GiB".
    assert!(
        e.contains("needs about") && e.contains("TiB") && e.contains("MemAvailable is"),
        "{e}"
    );
    let avail = e.split("MemAvailable is ").nth(1).unwrap();
    assert!(avail.contains("iB"), "{e}");
    assert!(t.elapsed().as_secs() < 10, "refused before allocating");
}

#[test]
fn an_unwritable_json_path_is_refused_before_the_run() {
    let p = PathBuf::from("/nonexistent-daxkv-dir/out.json");
    let e = refused(&daxkv(&[&TINY[..], &["--json"]].concat(), &[&p]));
    assert!(e.contains("/nonexistent-daxkv-dir/out.json"), "{e}");
}

#[test]
fn a_missing_path_needs_create() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("nope.bin");
    let e = refused(&daxkv(&[&TINY[..], &["--path"]].concat(), &[&p]));
    assert!(e.contains("nope.bin") && e.contains("--create"), "{e}");
    assert!(!p.exists());
}

/// A character device (a real device-dax node is one) is overwritten only
/// with --force; /dev/null and /dev/zero stand in (refused, never run).
#[test]
fn a_character_device_needs_force() {
    for dev in ["/dev/null", "/dev/zero"] {
        if !Path::new(dev).exists() {
            continue;
        }
        let e = refused(&daxkv(&[&TINY[..], &["--path", dev]].concat(), &[]));
        assert!(
            e.contains(dev) && e.contains("character device") && e.contains("--force"),
            "{e}"
        );
    }
}

/// `--create` makes the file on tmpfs, sizes it, runs on it, and removes it
/// (the run created it); an existing file is used and kept. Flags another
/// flag overrides warn, one line each, and the run goes on.
#[test]
fn create_makes_and_removes_a_file_and_an_existing_one_is_kept() {
    let dir = shm_dir();
    let p = dir.path().join("bench.bin");
    let out = daxkv(&[&TINY[..], &["--create", "--path"]].concat(), &[&p]);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{se}");
    assert!(so.contains(&p.display().to_string()), "device named:\n{so}");
    assert_eq!(so.matches(" ok").count(), 2, "verified:\n{so}");
    assert!(!p.exists(), "a file the run created is removed");
    assert!(!se.contains("warning"), "{se}");

    std::fs::write(&p, vec![7u8; 1 << 20]).unwrap();
    let out = daxkv(
        &[
            &TINY[..],
            &[
                "--devices",
                "2",
                "--park",
                "--spin-us",
                "10",
                "--wait-spin-us",
                "5",
                "--path",
            ],
        ]
        .concat(),
        &[&p],
    );
    let se = text(&out.stderr);
    assert!(out.status.success(), "{se}");
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 1 << 20, "kept");
    let warnings: Vec<&str> = se
        .lines()
        .filter(|l| l.starts_with("daxkv: warning: "))
        .collect();
    assert_eq!(warnings.len(), 3, "{se}");
    assert!(
        warnings[0].contains("--park overrides --spin-us 10"),
        "{se}"
    );
    assert!(
        warnings[1].contains("--park overrides --wait-spin-us 5"),
        "{se}"
    );
    assert!(
        warnings[2].contains("--devices 2 is ignored with --path"),
        "{se}"
    );
    assert!(text(&out.stdout).contains("spin 0 us, caller wait spin 0 us"));
}

/// The warnings also come with a refused run (they are printed first), and
/// --create / --force without --path warn.
#[test]
fn moot_create_and_force_warn() {
    let out = daxkv(
        &[
            "bench",
            "--create",
            "--force",
            "--sizes",
            "2GiB",
            "--total-bytes",
            "1GiB",
        ],
        &[],
    );
    let e = refused(&out);
    assert!(e.contains("--sizes 2 GiB"), "{e}");
    let se = text(&out.stderr);
    assert!(
        se.contains("daxkv: warning: --create has no effect without --path")
            && se.contains("daxkv: warning: --force has no effect without --path"),
        "{se}"
    );
}

/// One worker per pool on a machine with two CPUs or more: the caller is
/// pinned to the first CPU it may use and the workers to the others, and
/// the table says so and where they ran, read back; `--no-pin` leaves them
/// unpinned.
#[test]
fn one_worker_per_pool_runs_pinned_unless_told_not_to() {
    let allowed: Vec<u64> = {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let list = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim()
            .to_string();
        list.split(',')
            .flat_map(|part| match part.split_once('-') {
                Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect::<Vec<u64>>(),
                None => vec![part.parse().unwrap()],
            })
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let one = [
        "--store-workers",
        "1",
        "--lookup-workers",
        "1",
        "--load-workers",
        "1",
    ];
    for pin in [true, false] {
        let json = dir.path().join(format!("pin-{pin}.json"));
        let no_pin: &[&str] = if pin { &[] } else { &["--no-pin"] };
        let out = daxkv(&[&TINY[..], &one, no_pin, &["--json"]].concat(), &[&json]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let j: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let table = text(&out.stdout);
        // Where the threads ran, read back: pinned, each worker on the
        // CPU after the caller's and none sharing the caller's (before
        // the workers set their masks directly, every worker inherited the
        // pinned caller's CPU and stayed there); unpinned, every mask
        // overlaps the caller's.
        let ran = &j["ran_on"];
        let workers = ran["workers"].as_array().unwrap();
        assert_eq!(workers.len(), 3, "{ran}");
        if pin && allowed.len() >= 2 {
            assert_eq!(j["placement"]["caller"], allowed[0]);
            assert_eq!(j["placement"]["workers"], serde_json::json!(allowed[1..]));
            assert!(
                table.contains(&format!("placement: caller on CPU {}", allowed[0])),
                "{table}"
            );
            assert_eq!(ran["caller"], serde_json::json!([allowed[0]]), "{ran}");
            for w in workers {
                assert_eq!(w["cpus"], serde_json::json!([allowed[1]]), "{ran}");
                assert_eq!(w["last_cpu"], allowed[1], "{ran}");
            }
            for c in ran["raw_copies"].as_array().unwrap() {
                assert_eq!(c, &serde_json::json!([allowed[1]]), "{ran}");
            }
            assert_eq!(ran["sharing_with_caller"], serde_json::json!([]), "{ran}");
            assert!(
                table.contains("; no worker shares a CPU with the caller"),
                "{table}"
            );
        } else {
            assert!(j["placement"].is_null(), "{}", j["placement"]);
            assert!(table.contains("placement: unpinned"), "{table}");
            assert_eq!(ran["caller"], serde_json::json!(allowed), "{ran}");
            for w in workers {
                assert_eq!(w["cpus"], serde_json::json!(allowed), "{ran}");
            }
            if allowed.len() >= 2 {
                assert_eq!(ran["sharing_with_caller"].as_array().unwrap().len(), 3);
                assert!(
                    table.contains("3 worker(s) could share a CPU with the caller (masks overlap)"),
                    "{table}"
                );
            }
        }
        assert_eq!(j["options"]["pin"], pin);
    }
}

/// `--path` of a sysfs or procfs pseudo-file is refused
/// before anything runs, naming the path and the file system. Read-only
/// files, so a broken check cannot write into kernel state. Without the
/// allow-list the bench would go on to "preparing" and fail at the open
/// with an error that does not name the file system.
#[test]
fn a_pseudo_file_path_is_refused() {
    let mut tried = 0;
    for (path, fs) in [
        (
            "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size",
            "sysfs",
        ),
        ("/proc/self/status", "procfs"),
    ] {
        if !Path::new(path).is_file() {
            eprintln!("skipping {path}: not on this machine");
            continue;
        }
        tried += 1;
        let e = refused(&daxkv(&[&TINY[..], &["--path", path]].concat(), &[]));
        assert!(e.contains(path) && e.contains(fs), "{e}");
    }
    assert!(tried > 0, "no pseudo-file to try on this machine");
}

/// `--submitters 4`, the one command a many-core host runs: four threads,
/// each with its own `Submitter`, split every phase's tasks; the loaded
/// bytes are checked object by object; the JSON gives each thread's share,
/// the contention counted in every round, the CPU per GB of the store and
/// the load next to the raw copy's, and the idle engine's CPU.
#[test]
fn four_submitters_verify_bytes_and_report_shares_contention_and_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("subs.json");
    let out = daxkv(
        &[
            "bench",
            "--sizes",
            "4K,64K",
            "--total-bytes",
            "4MiB",
            "--max-objects",
            "200",
            "--rounds",
            "2",
            "--submitters",
            "4",
            "--json",
        ],
        &[&json],
    );
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stdout:\n{so}\nstderr:\n{se}");
    assert!(so.contains("4 submitter(s)"), "{so}");
    assert!(so.contains("per submitter, objects/s"), "{so}");
    assert!(so.contains("contention (record-claim retries"), "{so}");
    assert!(
        so.contains("cpu/GB") && so.contains("idle: the whole process used"),
        "{so}"
    );
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(j["options"]["submitters"], 4);
    assert_eq!(j["submitters"], 4);
    let finite = |v: &serde_json::Value, what: &str| -> f64 {
        let x = v
            .as_f64()
            .unwrap_or_else(|| panic!("{what} is not a number: {v}"));
        assert!(x.is_finite() && x >= 0.0, "{what} = {x}");
        x
    };
    let results = j["results"].as_array().unwrap();
    assert_eq!(results.len(), 10);
    for r in results {
        let phase = r["phase"].as_str().unwrap();
        let objects = r["objects"].as_u64().unwrap();
        let tasks = objects.div_ceil(16);
        let subs = r["submitters"].as_array().unwrap();
        if !["store", "lookup", "load"].contains(&phase) {
            assert!(subs.is_empty() && r["contention"].is_null(), "{r}");
            continue;
        }
        // Every task and object went through exactly one submitter.
        assert_eq!(subs.len(), 4, "{r}");
        let sum = |f: &str| subs.iter().map(|s| s[f].as_u64().unwrap()).sum::<u64>();
        assert_eq!((sum("tasks"), sum("objects")), (tasks, objects), "{r}");
        for s in subs {
            assert!(s["objects_per_s"].as_f64().unwrap() > 0.0, "{r}");
        }
        let c = &r["contention"];
        finite(&c["record_claim_retries"], "record_claim_retries");
        for k in ["store", "lookup", "load"] {
            finite(&c["completion_lock_misses"][k], "completion_lock_misses");
        }
        assert_eq!(c["rounds"].as_array().unwrap().len(), 2, "{r}");
        if phase == "lookup" {
            assert!(r["cpu_s_per_gb"].is_null(), "{r}");
        } else {
            finite(&r["cpu_s_per_gb"], "cpu_s_per_gb");
            finite(&r["raw_cpu_s_per_gb"], "raw_cpu_s_per_gb");
        }
        if phase == "load" {
            assert_eq!(r["verified"], true, "{r}");
        }
    }
    // The idle engine: its workers park, so over a second the whole
    // process uses well under half a CPU.
    let idle = &j["idle_cpu"];
    let secs = finite(&idle["seconds"], "idle seconds");
    assert!(secs >= 1.0, "{idle}");
    let cpu = finite(&idle["cpu_s"], "idle cpu_s");
    finite(&idle["user_s"], "idle user_s");
    finite(&idle["sys_s"], "idle sys_s");
    assert!(cpu < 0.5, "idle engine used {cpu} CPU s over {secs} s");
}

/// Zero submitters is refused before anything runs, naming the option.
#[test]
fn zero_submitters_is_refused() {
    let mut args = TINY.to_vec();
    args.extend(["--submitters", "0"]);
    let line = refused(&daxkv(&args, &[]));
    assert!(line.contains("--submitters must be > 0"), "{line}");
}
