//! `daxkv soak`: a short run is clean, and the checks it makes can fail.
//!
//! The soak counts the process's threads, fds and device mappings before
//! its server starts and after it stops, so the runs here take turns (one
//! lock) and nothing else in this binary starts threads meanwhile.

use std::io::{Seek, SeekFrom, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use daxkv::cli::soak::{run, SoakConfig};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn a_short_soak_under_hotplug_verifies_bytes_and_leaks_nothing() {
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cfg = SoakConfig {
        duration: Duration::from_secs(8),
        seed: 20_261_205,
        hotplug_every_ms: 50,
        ..SoakConfig::default()
    };
    let mut lines = Vec::new();
    let r = run(&cfg, &mut |l| lines.push(l.to_string())).expect("soak runs");
    println!("{}\n{:?}", r.summary(), r);
    assert!(r.clean(), "{r:?}");
    assert!(r.ops > 100, "{r:?}");
    assert!(r.keys_acknowledged > 0 && r.bytes_verified > 0, "{r:?}");
    assert!(r.hotplug_ops > 0, "the control thread did nothing: {r:?}");
    assert_eq!(r.ops_per_second.len(), 8, "{r:?}");
    assert!(r.summary().ends_with("lost=0 corrupted=0 leaked=0"));
    let v: serde_json::Value = serde_json::from_str(&r.json()).expect("json");
    assert_eq!(v["clean"], true);
    assert_eq!(v["seed"], 20_261_205);
}

/// Faults (copies that fail, slow and full devices, a device that fails,
/// worker panics, eventfd writes that fail) under hotplug: nothing
/// acknowledged is lost, nothing corrupted, nothing leaked.
#[test]
fn a_short_soak_with_faults_loses_nothing() {
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cfg = SoakConfig {
        duration: Duration::from_secs(8),
        seed: 7_777,
        hotplug_every_ms: 60,
        faults: true,
        fault_every_ms: 40,
        ..SoakConfig::default()
    };
    let r = run(&cfg, &mut |_| {}).expect("soak runs");
    println!("{}\n{:?}", r.summary(), r);
    assert!(r.clean(), "{r:?}");
    assert!(r.faults_injected > 20, "{r:?}");
    assert!(r.bytes_verified > 0 && r.hotplug_ops > 0, "{r:?}");
}

/// Scribbling over the device files while the soak runs must show up as
/// corrupted keys (the soak's check is not one that cannot fail).
#[test]
fn bytes_changed_under_the_soak_are_reported_corrupted() {
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = std::path::PathBuf::from(format!(
        "/dev/shm/daxkv-soak-scribble-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let stop = AtomicBool::new(false);
    let writes = AtomicU64::new(0);
    let cfg = SoakConfig {
        duration: Duration::from_secs(6),
        seed: 99,
        devices: 1,
        hotplug_every_ms: 30,
        shm_dir: dir.clone(),
        ..SoakConfig::default()
    };
    let r = std::thread::scope(|s| {
        s.spawn(|| {
            let junk = vec![0xA5u8; 64 << 10];
            // ORDERING: Relaxed — a stop flag.
            while !stop.load(Ordering::Relaxed) {
                for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                    let Ok(mut f) = std::fs::OpenOptions::new().write(true).open(e.path()) else {
                        continue;
                    };
                    let len = f.metadata().map_or(0, |m| m.len());
                    let mut off = 0;
                    while off + junk.len() as u64 <= len {
                        if f.seek(SeekFrom::Start(off)).is_ok() && f.write_all(&junk).is_ok() {
                            writes.fetch_add(1, Ordering::Relaxed);
                        }
                        off += 4 * junk.len() as u64;
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let r = run(&cfg, &mut |_| {});
        stop.store(true, Ordering::Relaxed);
        r
    })
    .expect("soak runs");
    let _ = std::fs::remove_dir_all(&dir);
    println!("{}\n{:?}", r.summary(), r);
    assert!(writes.load(Ordering::Relaxed) > 0, "nothing was scribbled");
    assert!(r.corrupted > 0, "scribbled devices read back clean: {r:?}");
    assert!(!r.clean());
    assert!(
        r.findings.iter().any(|f| f.starts_with("corrupted:")),
        "{r:?}"
    );
}

#[test]
fn the_command_prints_its_line_and_refuses_faults_when_compiled_out() {
    // Its pipes are fds of this process.
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let bin = env!("CARGO_BIN_EXE_daxkv");
    let out = std::process::Command::new(bin)
        .args(["soak", "--seconds", "2", "--seed", "5", "--threads", "2"])
        .output()
        .expect("run daxkv soak");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.starts_with("soak: seed=5 ops="), "{stdout}");
    assert!(last.ends_with("lost=0 corrupted=0 leaked=0"), "{stdout}");
    if !cfg!(feature = "failpoints") {
        let out = std::process::Command::new(bin)
            .args(["soak", "--seconds", "1", "--faults"])
            .output()
            .expect("run daxkv soak --faults");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(stderr.contains("compiled out"), "{stderr}");
    }
}

/// A thread the host process starts while the soak runs (here as the test
/// harness starts the next test's thread) is not the server's: the soak's
/// leak check counts the threads the server could have left behind, not
/// every thread of the process (it called such a run leaked, at random,
/// when the suite ran its tests side by side).
#[test]
fn a_bystander_thread_started_during_the_soak_is_not_a_leak() {
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cfg = SoakConfig {
        duration: Duration::from_secs(2),
        seed: 11,
        hotplug: false,
        ..SoakConfig::default()
    };
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let bystander = std::thread::Builder::new()
        .name("bystander".into())
        .spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            // Lives past the soak's end, then goes.
            let t = std::thread::Builder::new()
                .name("late-bystander".into())
                .spawn(move || {
                    let _ = rx.recv();
                })
                .unwrap();
            t.join().unwrap();
        })
        .unwrap();
    let r = run(&cfg, &mut |_| {}).expect("soak runs");
    drop(tx);
    bystander.join().unwrap();
    println!("{}\n{:?}", r.summary(), r);
    assert!(r.leaked.is_empty(), "{r:?}");
}

/// The leak check can still fail: a `daxkv…` thread (as the server names
/// its own) started during the run and alive after it is a leak.
#[test]
fn a_daxkv_thread_left_running_after_the_soak_is_a_leak() {
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cfg = SoakConfig {
        duration: Duration::from_secs(2),
        seed: 12,
        hotplug: false,
        ..SoakConfig::default()
    };
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let starter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        std::thread::Builder::new()
            .name("daxkv-stray".into())
            .spawn(move || {
                let _ = rx.recv();
            })
            .unwrap()
    });
    let r = run(&cfg, &mut |_| {}).expect("soak runs");
    drop(tx);
    starter.join().unwrap().join().unwrap();
    assert!(!r.leaked.is_empty() && !r.clean(), "{r:?}");
}

/// Ctrl-C (or a supervisor's SIGTERM) stops a long soak early and orderly:
/// every key is still checked, the report is printed, the device files it
/// made in /dev/shm are removed (a killed soak left gigabytes there), and
/// it exits 128 + the signal's number.
#[test]
fn a_signal_stops_the_soak_early_checks_every_key_and_removes_its_files() {
    use std::io::{BufRead, BufReader};
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let bin = env!("CARGO_BIN_EXE_daxkv");
    for (sig, name) in [(libc::SIGINT, "SIGINT"), (libc::SIGTERM, "SIGTERM")] {
        let mut child = std::process::Command::new(bin)
            .args([
                "soak",
                "--seconds",
                "600",
                "--seed",
                "11",
                "--hotplug-every-ms",
                "20",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run daxkv soak");
        let tag = format!("daxkv-soak-{}-11-", child.id());
        let files = || {
            std::fs::read_dir("/dev/shm").map_or(0, |d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.file_name().to_string_lossy().starts_with(&tag))
                    .count()
            })
        };
        // Wait for its first progress line (10 s in): devices were added.
        let mut err = BufReader::new(child.stderr.take().expect("stderr"));
        let mut seen = String::new();
        loop {
            let mut line = String::new();
            let n = err.read_line(&mut line).expect("read stderr");
            assert!(n > 0, "soak ended before its first progress line: {seen}");
            seen.push_str(&line);
            if line.starts_with("soak: 10s ") {
                break;
            }
        }
        // Signal it while it holds an added device's file (what a killed
        // soak left behind), so the check below can fail.
        let t0 = std::time::Instant::now();
        let mut during = files();
        while during == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "no device file added"
            );
            std::thread::sleep(Duration::from_millis(5));
            during = files();
        }
        let pid = libc::pid_t::try_from(child.id()).expect("pid");
        // SAFETY: signalling a child this test started and has not reaped.
        let rc = unsafe { libc::kill(pid, sig) };
        assert_eq!(rc, 0);
        let rest = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut err, &mut s);
            s
        });
        let out = child.wait_with_output().expect("wait");
        let stderr = rest.join().unwrap_or_default();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(128 + sig), "{stdout}\n{stderr}");
        assert!(
            stdout.contains(&format!("soak: stopped early by {name} after ")),
            "{stdout}"
        );
        let last = stdout.lines().last().unwrap_or_default();
        assert!(
            last.ends_with("lost=0 corrupted=0 leaked=0"),
            "{stdout}\n{stderr}"
        );
        assert_eq!(
            files(),
            0,
            "{name}: files left in /dev/shm (there were {during})"
        );
    }
}

/// The control thread keeps a few removed device files for re-adding and
/// deletes older ones: a long soak's `/dev/shm` stays bounded (it kept
/// every one, and 30 minutes filled the machine's memory with them).
#[test]
fn removed_device_files_do_not_pile_up() {
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = std::path::PathBuf::from(format!("/dev/shm/daxkv-soak-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let stop = AtomicBool::new(false);
    let most = AtomicU64::new(0);
    let cfg = SoakConfig {
        duration: Duration::from_secs(8),
        seed: 31,
        hotplug_every_ms: 2,
        device_bytes: 4 << 20,
        shm_dir: dir.clone(),
        ..SoakConfig::default()
    };
    let r = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let n = std::fs::read_dir(&dir).map_or(0, Iterator::count) as u64;
                most.fetch_max(n, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let r = run(&cfg, &mut |_| {});
        stop.store(true, Ordering::Relaxed);
        r
    })
    .expect("soak runs");
    let left = std::fs::read_dir(&dir).map_or(0, Iterator::count);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(r.clean(), "{r:?}");
    assert!(r.hotplug_ops > 100, "too little hotplug to tell: {r:?}");
    // Open devices (the control thread keeps fewer than 5) + the re-add
    // pool (8) + one being added.
    let most = most.load(Ordering::Relaxed);
    assert!(most <= 14, "{most} device files at once ({r:?})");
    assert_eq!(left, 0, "files left after the soak");
}

/// `daxkv soak 2>&1 | tee soak.log`, then Ctrl-C: the terminal's SIGINT
/// ends `tee` too, and the soak's stderr becomes a pipe with no reader. It
/// must still stop early and orderly (a review found its signal thread
/// panicking in `eprintln!` before it raised the stop flag, with SIGINT
/// and SIGTERM blocked everywhere: only SIGKILL ended it, and its device
/// files stayed in /dev/shm).
#[test]
fn a_signal_after_stderr_lost_its_reader_still_stops_the_soak() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    use std::time::Instant;
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let bin = env!("CARGO_BIN_EXE_daxkv");
    let seed = "9317";
    let child = Command::new(bin)
        .args([
            "soak",
            "--seconds",
            "600",
            "--seed",
            seed,
            "--hotplug-every-ms",
            "20",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    // Killed and reaped whatever happens below.
    let mut child = Reaped(child);
    let pid = libc::pid_t::try_from(child.0.id()).unwrap();
    let tag = format!("daxkv-soak-{pid}-{seed}-");
    let files = || -> Vec<String> {
        std::fs::read_dir("/dev/shm").map_or_else(
            |_| Vec::new(),
            |d| {
                d.filter_map(Result::ok)
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(&tag))
                    .collect()
            },
        )
    };
    // The first line ("soak: seed=…") is read, as tee would.
    let mut err = BufReader::new(child.0.stderr.take().unwrap());
    let mut first = String::new();
    err.read_line(&mut first).unwrap();
    assert!(first.starts_with("soak: seed="), "{first}");
    // Running, with a device file of its own in /dev/shm.
    let t0 = Instant::now();
    while files().is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(30), "no device file");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Ctrl-C: tee is gone first (its end of the pipe closes), then the
    // soak gets SIGINT.
    drop(err);
    // SAFETY: our own unreaped child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let t1 = Instant::now();
    let mut status = None;
    while t1.elapsed() < Duration::from_secs(25) {
        if let Some(s) = child.0.try_wait().unwrap() {
            status = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // A second SIGINT ("exits at once") and a SIGTERM, for good measure.
    if status.is_none() {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGINT) };
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let t2 = Instant::now();
        while t2.elapsed() < Duration::from_secs(5) {
            if let Some(s) = child.0.try_wait().unwrap() {
                status = Some(s);
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, Iterator::count);
    if status.is_none() {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let _ = child.0.wait();
    }
    let left = files();
    for f in &left {
        let _ = std::fs::remove_file(format!("/dev/shm/{f}"));
    }
    assert!(
        status.is_some(),
        "soak still running {:?} after SIGINT, SIGINT, SIGTERM ({threads} threads); \
         {} device files left in /dev/shm after SIGKILL",
        t1.elapsed(),
        left.len()
    );
    assert!(left.is_empty(), "device files left: {left:?}");
    assert_eq!(status.and_then(|s| s.code()), Some(128 + libc::SIGINT));
}

/// A child process killed (if still running) and reaped when dropped.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
