//! The `daxkv bench` workload at a tiny size: every phase runs, the data
//! verification passes, and the JSON carries the documented names.

use daxkv::bench::{run, BenchConfig, Progress};

#[test]
fn tiny_bench_is_complete_and_verified() {
    let cfg = BenchConfig {
        sizes: vec![4096, 64 << 10],
        total_bytes: 1 << 20,
        max_objects: 40,
        prefault: true,
        verify_every: 1,
        load_workers: 2,
        ..BenchConfig::default()
    };
    let (mut rows, mut phases) = (0, Vec::new());
    let report = run(&cfg, |p| match p {
        Progress::Row(_) => rows += 1,
        Progress::Phase {
            index,
            sizes,
            phase,
            ..
        } => {
            assert_eq!(sizes, 2);
            phases.push((index, phase));
        }
    })
    .unwrap();
    assert_eq!(rows, 10, "one row per phase per size");
    assert_eq!(phases.len(), 8, "four progress steps per size: {phases:?}");
    assert_eq!(phases[4], (1, "store"));
    assert_eq!(report.limits.len(), 2);
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
        assert!(r.objects_per_s > 0.0 && r.seconds > 0.0, "{r:?}");
        assert!(r.p50_us <= r.p99_us && r.p99_us <= r.max_us, "{r:?}");
    }
    let load = report.results.iter().find(|r| r.phase == "load").unwrap();
    assert_eq!(load.verified, Some(true));
    assert!(load.gb_per_s.unwrap() > 0.0 && load.ratio_to_limit.unwrap() > 0.0);

    let j: serde_json::Value = serde_json::from_str(&report.json()).unwrap();
    assert!(j["machine"]["cpu"].is_string());
    assert!(j["machine"]["cores"].as_u64().unwrap() >= 1);
    assert!(j["machine"]["numa_nodes"].as_u64().unwrap() >= 1);
    assert!(j["eventfd_ping_pong_us"].as_f64().unwrap() > 0.0);
    assert_eq!(j["mode"], "engine");
    assert_eq!(j["workers"]["load"], 2);
    for size in ["4096", "65536"] {
        for f in ["nt_copy_in_gb_s", "memcpy_in_gb_s", "copy_out_gb_s"] {
            assert!(
                j["limits"][size][f].as_f64().unwrap() > 0.0,
                "limits.{size}.{f}"
            );
        }
    }
    let results = j["results"].as_array().unwrap();
    assert_eq!(results.len(), 10);
    for r in results {
        for f in [
            "size_bytes",
            "phase",
            "objects",
            "seconds",
            "objects_per_s",
            "gb_per_s",
            "p50_us",
            "p99_us",
            "max_us",
            "ratio_to_limit",
            "verified",
        ] {
            assert!(r.get(f).is_some(), "result lacks {f}: {r}");
        }
    }
    assert!(report.table().contains("verified"));
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

/// A user error is one clear line and a non-zero exit, also with
/// `RUST_BACKTRACE=1` (it used to print anyhow's debug form with a
/// backtrace).
#[test]
fn a_user_error_is_one_line_even_with_backtraces_on() {
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small.bin");
    std::fs::write(&small, vec![0u8; 1000]).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_daxkv"))
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
