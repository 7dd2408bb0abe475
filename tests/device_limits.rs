//! Sizes a request or a config can ask for:
//! a memfd larger than the memory the process may use, and slot tables
//! that cannot be allocated, are errors that name the size (never an
//! abort); a device grows up to the `max_size` set when it was added (a
//! file extended after the add included), and a grow past it is refused
//! with the reason in the HTTP body. Real memfds, tmpfs files, `daxkv
//! serve` under a real `RLIMIT_DATA`, HTTP on 127.0.0.1.

#![allow(clippy::many_single_char_names)] // scenario tests

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::Duration;

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceSpec, Engine, EngineError, EngineOptions};
use daxkv::host::memlimit::MemRoots;
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key, OpenError};
use serde_json::{json, Value};

const SLOT: usize = 4096;
const T: Duration = Duration::from_secs(20);
const BIN: &str = env!("CARGO_BIN_EXE_daxkv");

/// The memfd check counts every memfd the process has open: tests that
/// open memfds run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn mem_available() -> u64 {
    let s = std::fs::read_to_string("/proc/meminfo").unwrap();
    let l = s.lines().find(|l| l.starts_with("MemAvailable:")).unwrap();
    l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

fn http(e: &std::sync::Arc<Engine>) -> daxkv::control::http::HttpServer {
    let backend = std::sync::Arc::new(daxkv::control::reconfigure::DaxReconfigure::probing(
        e.clone(),
        "/sys".into(),
    ));
    let mut registry = daxkv::control::reconfigure::Registry::new();
    registry.register(backend);
    daxkv::control::http::serve(
        daxkv::control::http::HttpConfig::default(),
        registry,
        daxkv::control::http::HttpHooks::default(),
    )
    .unwrap()
}

fn post(h: &daxkv::control::http::HttpServer, op: &str, body: &Value) -> (u16, Value) {
    let (s, text) = daxkv::cli::serve::request(
        &h.local_addr().to_string(),
        "POST",
        &format!("/reconfigure/dax/l2/{op}"),
        Some(body),
        None,
    )
    .unwrap();
    (
        s,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn mem_total() -> u64 {
    let s = std::fs::read_to_string("/proc/meminfo").unwrap();
    let l = s.lines().find(|l| l.starts_with("MemTotal:")).unwrap();
    l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

fn store_and_load(e: &Engine, i: u64) {
    let key = Key::digest(&i.to_le_bytes());
    let data = vec![i as u8; 3000];
    let id = e
        .submit_store(vec![key], vec![Buf::from(data.clone())])
        .unwrap();
    assert!(
        e.wait_store(id, T).ready().unwrap().success,
        "key {i} stored"
    );
    let id = e.submit_load(vec![key], vec![vec![0; SLOT]]).unwrap();
    let r = e.wait_load(id, T).ready().unwrap();
    assert_eq!(r.payload(0), Some(&data[..]), "key {i} read back");
}

/// Extend the file at `p` to `bytes`, then resize the device (`path`)
/// to it over HTTP.
fn extend_and_resize(
    h: &daxkv::control::http::HttpServer,
    p: &std::path::Path,
    path: &str,
    bytes: usize,
) -> (u16, Value) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(bytes as u64)
        .unwrap();
    post(h, "resize", &json!({"device_path": path, "size": bytes}))
}

/// A tmpfs folder holding a device file `dev` of `bytes`.
fn shm_file(bytes: usize) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::Builder::new().tempdir_in("/dev/shm").unwrap();
    let p = dir.path().join("dev");
    std::fs::File::create(&p)
        .unwrap()
        .set_len(bytes as u64)
        .unwrap();
    (dir, p)
}

/// `add memfd` of twice the machine's RAM is refused over HTTP with a
/// body that names the size and the limit; nothing is added (not a 200
/// for a sparse memfd whose pages come on touch).
#[test]
fn http_add_of_a_memfd_beyond_memory_names_the_size() {
    const BIG_SLOT: usize = 1 << 20;
    let _s = serial();
    let e = std::sync::Arc::new(
        Engine::open(vec![], BIG_SLOT, true, EngineOptions::default()).unwrap(),
    );
    let h = http(&e);
    let size = (2 * mem_total()).next_multiple_of(BIG_SLOT as u64);
    let (status, body) = post(&h, "add", &json!({"device_path": "memfd", "size": size}));
    let msg = body["error"].as_str().unwrap_or_default().to_string();
    assert_eq!(status, 507, "{body}");
    assert!(msg.contains(&size.to_string()), "{msg}");
    assert!(
        msg.contains("MemAvailable") || msg.contains("cgroup"),
        "{msg}"
    );
    assert!(e.devices().is_empty(), "nothing added");
}

/// Two memfds of 60 % of the available memory each: the first is
/// mapped (sparse, untouched), the second is refused, counting what the
/// first may still take; once the first is closed, the second fits.
/// Fails with a per-request check only (both were mapped: 120 % of the
/// memory promised).
#[test]
fn memfds_are_checked_together() {
    use daxkv::device::arena::Arena;
    let _s = serial();
    let size = usize::try_from(mem_available() / 10 * 6).unwrap();
    let first = Arena::open(&ArenaSpec::memfd(size)).unwrap();
    let err = Arena::open(&ArenaSpec::memfd(size)).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, OpenError::MemoryLimit { bytes, .. } if bytes == size),
        "{msg}"
    );
    assert!(msg.contains("open memfd devices may still take"), "{msg}");
    drop(first);
    Arena::open(&ArenaSpec::memfd(size)).unwrap();
}

/// A configured memfd is checked too, against the cgroup limit read
/// from a fake `/proc` + `/sys` tree (cgroup v2, limit on an ancestor).
#[test]
fn a_configured_memfd_over_the_cgroup_limit_is_refused() {
    let _s = serial();
    let d = tempfile::tempdir().unwrap();
    let roots = MemRoots {
        proc_root: d.path().join("proc"),
        sys_root: d.path().join("sys"),
    };
    let w = |p: std::path::PathBuf, s: &str| {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, s).unwrap();
    };
    w(roots.proc_root.join("self/cgroup"), "0::/svc/daxkv\n");
    w(
        roots.sys_root.join("fs/cgroup/svc/memory.max"),
        "67108864\n",
    );
    w(roots.sys_root.join("fs/cgroup/svc/memory.current"), "0\n");
    let spec = |bytes: usize| DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(bytes).mem_roots(roots.clone()), SLOT),
    };
    let err =
        Engine::open(vec![spec(128 << 20)], SLOT, false, EngineOptions::default()).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            EngineError::Device {
                source: OpenError::MemoryLimit { bytes, limit_bytes: 67_108_864, .. },
                ..
            } if bytes == 128 << 20
        ),
        "{msg}"
    );
    assert!(
        msg.contains("134217728") && msg.contains("memory.max"),
        "{msg}"
    );
    // Under the limit it opens.
    Engine::open(vec![spec(16 << 20)], SLOT, false, EngineOptions::default()).unwrap();
}

/// `daxkv serve` with a 64 GiB sparse tmpfs file in 4 KiB slots (16 Mi
/// slots, ~800 MiB of tables) under `prlimit --data` of 512 MiB exits
/// with an error naming the slot count and the bytes, instead of
/// aborting: killed by SIGABRT ("memory allocation of … bytes failed")
/// when the tables are allocated infallibly.
#[test]
fn serve_with_tables_beyond_rlimit_data_exits_with_the_size() {
    if std::env::var_os("DAXKV_SANITIZER").is_some() {
        // A sanitizer reserves terabytes of shadow at start: under a
        // data limit the process cannot start at all.
        eprintln!("skipped under a sanitizer: RLIMIT_DATA leaves no room for its shadow memory");
        return;
    }
    if Command::new("prlimit").arg("--version").output().is_err() {
        eprintln!("skipped: prlimit (util-linux) is not installed");
        return;
    }
    let dir = tempfile::Builder::new().tempdir_in("/dev/shm").unwrap();
    let dev = dir.path().join("big");
    std::fs::File::create(&dev)
        .unwrap()
        .set_len(64 << 30)
        .unwrap();
    let cfg = dir.path().join("cfg.json");
    std::fs::write(
        &cfg,
        json!({
            "slot_bytes": SLOT,
            "devices": [{"device_path": dev.display().to_string(), "max_dax_size_gb": 64}],
            "prefault": false,
            "num_load_workers": 1,
        })
        .to_string(),
    )
    .unwrap();
    let out = Command::new("prlimit")
        .arg(format!("--data={}", 512u64 << 20))
        .arg(BIN)
        .args(["serve", "--http", "127.0.0.1:0", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.signal(),
        None,
        "killed: {:?}; stderr:\n{err}",
        out.status
    );
    assert!(!out.status.success(), "started under the limit?\n{err}");
    assert!(err.contains("16777216 slots"), "{err}");
    assert!(err.contains("bytes of DRAM"), "{err}");
}

/// A file device added with `max_size` grows after the file is
/// extended, up to that limit; past it the refusal says why in the HTTP
/// body; past the file's length too (not a bare 400 "failed to remap DAX
/// device").
#[test]
fn a_file_grows_after_it_is_extended_up_to_max_size() {
    let (_dir, p) = shm_file(16 * SLOT);
    let path = p.display().to_string();
    let e =
        std::sync::Arc::new(Engine::open(vec![], SLOT, true, EngineOptions::default()).unwrap());
    let h = http(&e);
    let (s, b) = post(
        &h,
        "add",
        &json!({"device_path": path, "size": 16 * SLOT, "max_size": 64 * SLOT}),
    );
    assert_eq!(s, 200, "{b}");
    store_and_load(&e, 1);
    // Past the file's length: refused, with the reason.
    let (s, b) = post(
        &h,
        "resize",
        &json!({"device_path": path, "size": 32 * SLOT}),
    );
    assert_eq!(s, 400, "{b}");
    let msg = b["error"].as_str().unwrap_or_default();
    assert!(
        msg.contains("extend it first") || msg.contains("file"),
        "{b}"
    );
    // Extend the file, then grow: works.
    let (s, b) = extend_and_resize(&h, &p, &path, 64 * SLOT);
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["new_size_bytes"], 64 * SLOT);
    store_and_load(&e, 2);
    store_and_load(&e, 1);
    // Past max_size: refused, and the body says why.
    let (s, b) = extend_and_resize(&h, &p, &path, 128 * SLOT);
    assert_eq!(s, 400, "{b}");
    let msg = b["error"].as_str().unwrap_or_default();
    assert!(
        msg.contains("max_size_bytes") && msg.contains(&(64 * SLOT).to_string()),
        "{b}"
    );
    assert!(!msg.contains(&path), "the body names no path: {msg}");
    // A bad max_size is refused by name.
    let (s, b) = post(
        &h,
        "add",
        &json!({"device_path": "memfd", "size": 16 * SLOT, "max_size": 8 * SLOT}),
    );
    assert_eq!(s, 400, "{b}");
    assert!(
        b["error"]
            .as_str()
            .unwrap_or_default()
            .contains("max_size_bytes"),
        "{b}"
    );
}

/// The default (configured) memfd device can grow: through the engine
/// API and over HTTP, up to 4 × its size; past that the refusal says
/// why. Tables sized with no room for growth would refuse it ("cannot
/// grow … largest … 65536 bytes", a bare 400 over HTTP).
#[test]
fn the_configured_memfd_device_grows() {
    let _s = serial();
    let cfg = daxkv::control::config::EngineConfig::from_json(
        r#"{"slot_bytes": 4096, "devices": [{"device_path": "memfd", "max_dax_size_gb": 0.015625}],
            "hotplug_enabled": true, "prefault": false, "numa": "off"}"#,
    )
    .unwrap();
    let size = cfg.devices[0].max_dax_size_bytes;
    let e = std::sync::Arc::new(
        Engine::open(cfg.device_specs(), SLOT, true, EngineOptions::default()).unwrap(),
    );
    store_and_load(&e, 1);
    let id = e.devices()[0].id;
    e.resize_device(id, 2 * size).unwrap();
    assert_eq!(e.devices()[0].arena_bytes, 2 * size);
    let h = http(&e);
    let (s, b) = post(
        &h,
        "resize",
        &json!({"device_path": "memfd", "size": 4 * size}),
    );
    assert_eq!(s, 200, "{b}");
    store_and_load(&e, 2);
    store_and_load(&e, 1);
    let (s, b) = post(
        &h,
        "resize",
        &json!({"device_path": "memfd", "size": 8 * size}),
    );
    assert_eq!(s, 400, "{b}");
    let msg = b["error"].as_str().unwrap_or_default();
    assert!(
        msg.contains("max_size_bytes") && msg.contains(&(4 * size).to_string()),
        "{b}"
    );
}

/// `daxkv add --max-size` sets the limit a later resize grows to.
#[test]
fn cli_add_takes_max_size() {
    let _s = serial();
    let e =
        std::sync::Arc::new(Engine::open(vec![], SLOT, true, EngineOptions::default()).unwrap());
    let h = http(&e);
    let out = Command::new(BIN)
        .args(["add", "memfd", "64KiB", "--max-size", "256KiB", "--server"])
        .arg(h.local_addr().to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (s, b) = post(
        &h,
        "resize",
        &json!({"device_path": "memfd", "size": "256KiB"}),
    );
    assert_eq!(s, 200, "{b}");
    let (s, b) = post(
        &h,
        "resize",
        &json!({"device_path": "memfd", "size": "512KiB"}),
    );
    assert_eq!(s, 400, "{b}");
    assert!(
        b["error"].as_str().unwrap_or_default().contains("262144"),
        "{b}"
    );
}

/// A configured file device with `max_size_gb` grows after its file is
/// extended (engine API), up to that limit; a `max_size_gb` below the
/// size is a config error naming the field.
#[test]
fn a_configured_file_grows_up_to_max_size_gb() {
    let (_dir, p) = shm_file(16 * SLOT);
    let gb = |slots: usize| (slots * SLOT) as f64 / f64::from(1u32 << 30);
    let json = |max: f64| {
        json!({
            "slot_bytes": SLOT,
            "devices": [{"device_path": p.display().to_string(),
                         "max_dax_size_gb": gb(16), "max_size_gb": max}],
            "prefault": false,
        })
        .to_string()
    };
    let err = daxkv::control::config::EngineConfig::from_json(&json(gb(8))).unwrap_err();
    assert_eq!(err.field, "devices[0].max_size_gb", "{err}");
    let cfg = daxkv::control::config::EngineConfig::from_json(&json(gb(64))).unwrap();
    let e = Engine::open(cfg.device_specs(), SLOT, false, EngineOptions::default()).unwrap();
    store_and_load(&e, 1);
    let id = e.devices()[0].id;
    let msg = e.resize_device(id, 32 * SLOT).unwrap_err().to_string();
    assert!(msg.contains("extend it first"), "{msg}");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(128 * SLOT as u64)
        .unwrap();
    e.resize_device(id, 64 * SLOT).unwrap();
    store_and_load(&e, 2);
    store_and_load(&e, 1);
    let msg = e.resize_device(id, 128 * SLOT).unwrap_err().to_string();
    assert!(
        msg.contains("max_size_bytes") && msg.contains("262144"),
        "{msg}"
    );
}

/// Two memfd opens at once, each fitting the memory left on its own but
/// not together (60 + 60 MiB of a fake 100 MiB `MemAvailable`): at most
/// one may open. 300 rounds of two threads released by a barrier. Failed
/// with the check that counted only memfds already registered (both
/// passed the check before either was registered: both opened, 120 % of
/// the memory promised, within a few rounds).
#[test]
fn memfds_opened_at_once_are_checked_together() {
    use daxkv::device::arena::Arena;
    let _s = serial();
    let d = tempfile::tempdir().unwrap();
    let roots = MemRoots {
        proc_root: d.path().join("proc"),
        sys_root: d.path().join("sys"),
    };
    std::fs::create_dir_all(&roots.proc_root).unwrap();
    std::fs::write(
        roots.proc_root.join("meminfo"),
        "MemTotal: 1048576 kB\nMemAvailable: 102400 kB\n",
    )
    .unwrap();
    let spec = ArenaSpec::memfd(60 << 20).mem_roots(roots);
    let barrier = std::sync::Barrier::new(2);
    let deadline = std::time::Instant::now() + T;
    for round in 0..300 {
        if std::time::Instant::now() > deadline {
            break;
        }
        let opened: Vec<Option<Arena>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        Arena::open(&spec).ok()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let n = opened.iter().filter(|a| a.is_some()).count();
        assert!(
            n <= 1,
            "round {round}: {n} memfds of 60 MiB opened against 100 MiB"
        );
        assert_eq!(n, 1, "round {round}: one of them fits");
    }
}
