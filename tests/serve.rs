//! `daxkv serve` as a process: started on a free loopback port, driven
//! over real HTTP (by the test's client and by the `daxkv status | add |
//! remove | resize` commands), stopped by SIGTERM / SIGINT (exit 0, port
//! closed). With `--traffic`, hotplug runs under load: a device is added,
//! the first one migrated away and the new one force-removed while the
//! workload verifies every object it reads back, and `/metrics` shows it.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use daxkv::cli::serve::request;
use serde_json::{json, Value};

#[path = "common/serve.rs"]
mod serve_common;
use serve_common::{Serve, BIN};

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no sample {name}"))
}

/// A tmpfs folder holding a device file `dax.img` of `bytes`.
fn shm_device(bytes: u64) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::Builder::new().tempdir_in("/dev/shm").unwrap();
    let dev = dir.path().join("dax.img");
    std::fs::File::create(&dev).unwrap().set_len(bytes).unwrap();
    (dir, dev)
}

/// The embedded default starts, answers /health, /metrics and both status
/// routes, takes an add through the CLI, and stops cleanly on SIGTERM.
#[test]
fn serve_starts_on_the_default_answers_and_stops_on_sigterm() {
    let s = Serve::start(&[]);
    let (code, body) = s.get("/health");
    assert_eq!((code, body.as_str()), (200, r#"{"status":"ok"}"#));
    let (code, m) = s.get("/metrics");
    assert_eq!(code, 200);
    assert_eq!(
        metric(&m, "daxkv_slots_total{device=\"0\",path=\"memfd\"}"),
        512
    );
    for route in ["/reconfigure/dax/l2/status", "/reconfigure/dax/status"] {
        let (code, st) = s.get(route);
        let st: Value = serde_json::from_str(&st).unwrap();
        assert_eq!(code, 200, "{route}");
        assert_eq!(st["num_adapters"], 1);
        assert_eq!(st["adapters"][0]["status"]["slot_bytes"], 2 << 20);
        assert_eq!(st["adapters"][0]["status"]["enabled"], true);
    }
    // The CLI: add a device, see it in the table, then JSON.
    let out = s.cli(&["add", "memfd:b", "64MiB"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("add"));
    let out = s.cli(&["status"]);
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(table.contains("2 devices"), "{table}");
    assert_eq!(table.matches("memfd").count(), 2, "{table}");
    assert!(table.contains("memfd:b"), "{table}");
    let out = s.cli(&["status", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["adapters"][0]["status"]["devices"][1]["max_slots"], 32);
    // A refused operation: one line, exit 1.
    let out = s.cli(&["remove", "/dev/nothing"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "daxkv: POST /reconfigure/dax/l2/remove: 404: \"DAX device not found\""
    );
    let log = s.stop_with(libc::SIGTERM);
    assert!(log.contains("mapped device"), "{log}");
    assert!(log.contains("workers started"), "{log}");
    assert!(log.contains("devices unmapped"), "{log}");
}

/// Hotplug over HTTP under `--traffic`: add a tmpfs device, migrate the
/// first device away, grow and force-remove the new one, all while the
/// workload runs; it never reads wrong bytes; SIGINT stops it.
#[test]
fn hotplug_over_http_under_traffic() {
    let dir = tempfile::Builder::new().tempdir_in("/dev/shm").unwrap();
    let cfg = dir.path().join("serve.json");
    std::fs::write(
        &cfg,
        json!({"type": "dax", "slot_bytes": 65536, "hotplug_enabled": true,
               "devices": [{"device_path": "memfd", "max_dax_size_gb": 0.03125}]})
        .to_string(),
    )
    .unwrap();
    let s = Serve::start(&["--config", cfg.to_str().unwrap(), "--traffic"]);
    let dev = dir.path().join("dax.img");
    std::fs::File::create(&dev)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let dev = dev.display().to_string();
    let rounds = |s: &Serve| metric(&s.get("/metrics").1, "daxkv_traffic_rounds_total");
    let wait_rounds = |s: &Serve, n: u64| {
        let t0 = Instant::now();
        while rounds(s) < n {
            assert!(t0.elapsed() < Duration::from_secs(30), "traffic stalled");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    wait_rounds(&s, 5);
    let (code, out) = s.post(
        "/reconfigure/dax/l2/add",
        &json!({"device_path": dev, "size": "32MiB"}),
    );
    assert_eq!(code, 200, "{out}");
    let r = rounds(&s);
    wait_rounds(&s, r + 5);
    // The embedded memfd is the first device: migrate it away.
    let (code, out) = s.post(
        "/reconfigure/dax/l2/remove",
        &json!({"device_path": "memfd", "mode": "migrate", "force": true}),
    );
    assert_eq!(code, 200, "{out}");
    assert_eq!(out["state"], "removed");
    let r = rounds(&s);
    wait_rounds(&s, r + 5);
    let (code, out) = s.post(
        "/reconfigure/dax/l2/resize",
        &json!({"device_path": dev, "size": "64MiB"}),
    );
    assert_eq!(code, 200, "{out}");
    assert_eq!(out["new_size_bytes"], 64 << 20);
    let r = rounds(&s);
    wait_rounds(&s, r + 5);
    let t0 = Instant::now();
    let (code, out) = s.post(
        "/reconfigure/dax/l2/remove",
        &json!({"device_path": dev, "mode": "evict", "force": true}),
    );
    let detach = t0.elapsed();
    assert_eq!(code, 200, "{out}");
    let m = s.get("/metrics").1;
    assert_eq!(metric(&m, "daxkv_traffic_wrong_bytes_total"), 0);
    assert!(metric(&m, "daxkv_traffic_verified_total") > 0);
    assert_eq!(
        metric(
            &m,
            "daxkv_hotplug_operations_total{operation=\"remove\",outcome=\"ok\"}"
        ),
        2
    );
    eprintln!("forced detach under --traffic: {detach:?}");
    s.stop_with(libc::SIGINT);
}

/// A bad config is one line and exit 1, before anything listens.
#[test]
fn a_bad_config_is_one_line_and_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "slot_bytes = \"big\"\n").unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--http", "127.0.0.1:0", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("daxkv: --config "), "{err}");
    assert!(err.contains("slot_bytes"), "{err}");
    let out = Command::new(BIN)
        .args(["serve", "--http", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("loopback"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `daxkv serve` with at most `nofile` open files (RLIMIT_NOFILE).
fn start_with_fd_limit(nofile: u64) -> Serve {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--http", "127.0.0.1:0"]);
    // SAFETY: the closure runs in the forked child before exec and calls
    // setrlimit(2) only, which is async-signal-safe; it touches no lock or
    // allocation of the parent.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: nofile,
                rlim_max: nofile,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    Serve::spawn(&mut cmd)
}

/// Idle connections until the server runs out of file descriptors: its
/// accepts fail with EMFILE while they are held (logged), and once they are
/// closed `/health` and status answer again; the process never stopped
/// serving. (Without timers in the HTTP runtime, the back-off after the
/// first EMFILE panicked and the port closed for good.)
#[test]
fn the_control_plane_survives_running_out_of_fds() {
    let s = start_with_fd_limit(64);
    assert_eq!(s.get("/health").0, 200);
    // More connections than the limit allows fds for, bounded in count and
    // time: past the kernel's accept queue a connect times out.
    let mut held = Vec::new();
    for _ in 0..200 {
        let Ok(c) = std::net::TcpStream::connect_timeout(
            &s.addr.parse().unwrap(),
            Duration::from_millis(500),
        ) else {
            break;
        };
        held.push(c);
    }
    assert!(held.len() > 64, "only {} connections opened", held.len());
    // Let the server try (and fail) to accept them; the process lives on.
    std::thread::sleep(Duration::from_millis(500));
    let mut s = s;
    assert!(
        s.child.try_wait().unwrap().is_none(),
        "serve exited under fd exhaustion"
    );
    drop(held);
    let t0 = Instant::now();
    let health = loop {
        match request(&s.addr, "GET", "/health", None, None) {
            Ok((200, body)) => break body,
            other => {
                assert!(
                    t0.elapsed() < Duration::from_secs(30),
                    "the control plane did not recover: {other:?}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    assert_eq!(health, r#"{"status":"ok"}"#);
    let (code, st) = s.get("/reconfigure/dax/l2/status");
    assert_eq!(code, 200, "{st}");
    let log = s.stop_with(libc::SIGTERM);
    assert!(
        log.contains("accept failed"),
        "EMFILE was never hit:\n{log}"
    );
}

/// A raw request to a running server with exactly these header lines.
fn raw_request(addr: &str, head: &str, body: &str) -> u16 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "{head}Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// What a web page on the same host could send to `daxkv serve`: a form
/// or `text/plain` POST that would add a memfd device (415), a request
/// through a rebound DNS name (403); `--allow-host` admits a name. No
/// device is added by any of them.
#[test]
fn serve_refuses_browser_requests_and_admits_allowed_hosts() {
    let s = Serve::start(&["--allow-host", "kv.internal"]);
    let port = s.addr.rsplit(':').next().unwrap().to_string();
    let add = "POST /reconfigure/dax/l2/add HTTP/1.1\r\n";
    let body = r#"{"device_path": "memfd", "size": "64MiB"}"#;
    let host = format!("Host: {}\r\n", s.addr);
    for ct in [
        "",
        "Content-Type: text/plain\r\n",
        "Content-Type: application/x-www-form-urlencoded\r\n",
    ] {
        assert_eq!(
            raw_request(&s.addr, &format!("{add}{host}{ct}"), body),
            415,
            "{ct:?}"
        );
    }
    let json = "Content-Type: application/json\r\n";
    let evil = format!("Host: evil.example:{port}\r\n");
    assert_eq!(
        raw_request(&s.addr, &format!("{add}{evil}{json}"), body),
        403
    );
    let origin = "Origin: http://evil.example\r\n";
    assert_eq!(
        raw_request(&s.addr, &format!("{add}{host}{json}{origin}"), body),
        403
    );
    let status = "GET /reconfigure/dax/l2/status HTTP/1.1\r\n";
    assert_eq!(raw_request(&s.addr, &format!("{status}{evil}"), ""), 403);
    let named = format!("Host: kv.internal:{port}\r\n");
    assert_eq!(raw_request(&s.addr, &format!("{status}{named}"), ""), 200);
    let (_, st) = s.get("/reconfigure/dax/l2/status");
    let st: Value = serde_json::from_str(&st).unwrap();
    assert_eq!(st["adapters"][0]["status"]["num_devices"], 1, "{st}");
    s.stop_with(libc::SIGTERM);
}

/// A device file truncated under a running `daxkv serve --traffic`: the
/// server lives on, the device reads `failed` in the status and in
/// `/metrics`, `/health` stays 200 and says `degraded` naming it, the
/// workload goes on on the other device with no wrong bytes, the CLI's
/// `remove` (default mode, migrate) accepts the failed device and evicts
/// it, after which `/health` is `ok` again, and SIGINT still stops the
/// server with exit 0. Without `daxkv::device::fault` the server died of
/// SIGBUS at the next copy into or out of the file; before failed devices
/// had their semantics, `/health` answered 503 (a supervisor restarted the
/// server, losing every device's cache) and remove could not find it.
#[test]
fn a_truncated_device_file_under_traffic_fails_the_device_not_the_server() {
    let (dir, dev) = shm_device(32 << 20);
    let cfg = dir.path().join("serve.json");
    std::fs::write(
        &cfg,
        json!({"type": "dax", "slot_bytes": 65536, "hotplug_enabled": true,
               "devices": [{"device_path": dev.display().to_string(), "max_dax_size_gb": 0.03125},
                           {"device_path": "memfd", "max_dax_size_gb": 0.03125}]})
        .to_string(),
    )
    .unwrap();
    let s = Serve::start(&["--config", cfg.to_str().unwrap(), "--traffic"]);
    let rounds = |s: &Serve| metric(&s.get("/metrics").1, "daxkv_traffic_rounds_total");
    let wait_rounds = |s: &Serve, n: u64| {
        let t0 = Instant::now();
        while rounds(s) < n {
            assert!(t0.elapsed() < Duration::from_secs(30), "traffic stalled");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    wait_rounds(&s, 5);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&dev)
        .unwrap()
        .set_len(0)
        .unwrap();
    let r = rounds(&s);
    wait_rounds(&s, r + 20);
    let (code, body) = s.get("/reconfigure/dax/l2/status");
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let states: Vec<String> = v["adapters"][0]["status"]["devices"]
        .as_array()
        .unwrap_or_else(|| panic!("no devices in {body}"))
        .iter()
        .map(|d| d["state"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(states, ["failed", "active"], "{body}");
    let st = &v["adapters"][0]["status"];
    assert_eq!(st["devices"][0]["is_healthy"], false, "{body}");
    // The pool serves on: healthy, degraded, the failed device named.
    assert_eq!(st["is_healthy"], true, "{body}");
    assert_eq!(st["degraded"], true, "{body}");
    assert_eq!(st["failed_devices"], json!([0]), "{body}");
    // `/health` stays 200 and says which device failed.
    let (code, health) = s.get("/health");
    assert_eq!(
        (code, serde_json::from_str::<Value>(&health).unwrap()),
        (
            200,
            json!({"status": "degraded", "reason": format!(
                "device 0 ({}) failed; the other devices serve (remove it)", dev.display())})
        )
    );
    let m = s.get("/metrics").1;
    let failed_series = format!(
        "daxkv_device_state{{device=\"0\",path=\"{}\",state=\"failed\"}} 1",
        dev.display()
    );
    assert!(m.contains(&failed_series), "{failed_series} not in\n{m}");
    assert_eq!(metric(&m, "daxkv_traffic_wrong_bytes_total"), 0);
    let before = metric(&m, "daxkv_traffic_verified_total");
    let r = rounds(&s);
    wait_rounds(&s, r + 5);
    let after = metric(&s.get("/metrics").1, "daxkv_traffic_verified_total");
    assert!(
        after > before,
        "the memfd device serves on ({before} -> {after})"
    );
    // The CLI's remove (migrate by default) accepts the failed device and
    // evicts it: a removed tombstone, and the pool is healthy again.
    let out = s.cli(&["remove", dev.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "remove of the failed device: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_, body) = s.get("/reconfigure/dax/l2/status");
    let v: Value = serde_json::from_str(&body).unwrap();
    let states: Vec<&str> = v["adapters"][0]["status"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["state"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(states, ["removed", "active"], "{body}");
    let (code, health) = s.get("/health");
    assert_eq!((code, health.as_str()), (200, r#"{"status":"ok"}"#));
    s.stop_with(libc::SIGINT);
}

/// A port no one listens on now (bound, then released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Wait (bounded) for `child` to exit; kill it and panic if it does not.
fn exit_of(child: &mut Child, what: &str) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM while start-up is stuck (the config is a FIFO no one writes:
/// the read never ends) stops the process with one clear line, and the
/// port never opens. A signal that waited, blocked, until start-up
/// finished would hang the process for ever (only SIGKILL ending it), and
/// an interrupted start would still open the port.
#[test]
fn sigterm_during_a_hung_start_up_exits_and_never_listens() {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("config.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) on a NUL-terminated path we own.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let port = free_port();
    let mut child = Command::new(BIN)
        .args(["serve", "--http", &format!("127.0.0.1:{port}"), "--config"])
        .arg(&fifo)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Open the write end once serve has the read end open (ENXIO until
    // then); serve then waits in read() for bytes that never come.
    let t0 = Instant::now();
    let _writer = loop {
        match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
        {
            Ok(w) => break w,
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {}
            Err(e) => panic!("{e}"),
        }
        assert!(child.try_wait().unwrap().is_none(), "serve exited early");
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "serve never opened its config"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id().cast_signed(), libc::SIGTERM) };
    let status = exit_of(&mut child, "serve ignored SIGTERM during start-up");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{err}");
    assert_eq!(
        err.trim(),
        "daxkv: SIGTERM during start-up: stopped before serving"
    );
    assert!(out.is_empty(), "{out}");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the port was opened"
    );
}

/// A bad HTTP flag (token, address, allow-list) fails before any device
/// is mapped: the config's 256 MiB tmpfs device is never pre-faulted (no
/// block of it is allocated), rather than checking the flags after the
/// devices are mapped and pre-faulted.
#[test]
fn bad_http_flags_fail_before_devices_are_mapped() {
    use std::os::unix::fs::MetadataExt;
    let (dir, dev) = shm_device(256 << 20);
    let cfg = dir.path().join("serve.json");
    std::fs::write(
        &cfg,
        json!({"type": "dax", "slot_bytes": 2_097_152, "prefault": true,
               "devices": [{"device_path": dev, "max_dax_size_gb": 0.25}]})
        .to_string(),
    )
    .unwrap();
    let port = format!("127.0.0.1:{}", free_port());
    let cases: [(&[&str], &str); 3] = [
        (
            &["--http", &port, "--token", "two words"],
            "daxkv: http: invalid HTTP config: token must be non-empty printable ASCII without spaces",
        ),
        (
            &["--http", "0.0.0.0:0"],
            "daxkv: http: refusing to listen on non-loopback address 0.0.0.0:0 (allow_non_loopback is off)",
        ),
        (
            &["--http", &port, "--allow-prefix", "no/such/dir"],
            "daxkv: http: invalid HTTP config: allow_prefixes: no/such/dir is neither absolute nor under an existing directory",
        ),
    ];
    for (flags, want) in cases {
        let out = Command::new(BIN)
            .arg("serve")
            .args(flags)
            .arg("--config")
            .arg(&cfg)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let blocks = std::fs::metadata(&dev).unwrap().blocks();
        assert_eq!(
            blocks, 0,
            "{flags:?}: the device was mapped and pre-faulted"
        );
        assert_eq!(out.status.code(), Some(1), "{flags:?}: {err}");
        assert_eq!(err.trim(), want, "{flags:?}");
    }
}

/// Each start-up error is printed once: a missing device, a device file
/// too small; the cause is not repeated two or three times on the line
/// ("engine: device 0: X: device 0: X: X").
#[test]
fn start_up_errors_are_printed_once() {
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small.img");
    std::fs::File::create(&small)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let missing = dir.path().join("missing");
    for (dev, cause) in [
        (&missing, "no such file or device".to_string()),
        (
            &small,
            "file is 4096 bytes, smaller than the requested 2097152 bytes".to_string(),
        ),
    ] {
        let cfg = dir.path().join("serve.json");
        std::fs::write(
            &cfg,
            json!({"type": "dax", "slot_bytes": 1_048_576,
                   "devices": [{"device_path": dev, "max_dax_size_gb": 2.0 / 1024.0}]})
            .to_string(),
        )
        .unwrap();
        let out = Command::new(BIN)
            .args(["serve", "--http", "127.0.0.1:0", "--config"])
            .arg(&cfg)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(
            err.trim(),
            format!("daxkv: engine: device 0: {}: {cause}", dev.display())
        );
    }
}

/// The CLI names anonymous devices: `add memfd` at its size is the
/// configured device (no second one), at another size a 409 that says
/// what to do; `memfd:NAME` adds more; `memfd:` lets the server name it;
/// remove and resize take the name or `--index`. Were `add memfd` to make
/// a second `memfd`, `remove memfd` would be 409 for ever.
#[test]
fn the_cli_names_anonymous_devices() {
    let s = Serve::start(&[]);
    let ok = |args: &[&str]| s.ok(args);
    let devices = || s.devices();
    ok(&["add", "memfd", "1GiB"]);
    assert_eq!(devices(), [("memfd".into(), "active".into())]);
    let out = s.cli(&["add", "memfd", "64MiB"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(": 409: "), "{err}");
    assert!(err.contains("memfd:NAME"), "{err}");
    ok(&["add", "memfd:b", "64MiB"]);
    ok(&["add", "memfd:b", "64MiB"]);
    let out = ok(&["add", "memfd:", "64MiB"]);
    assert!(out.contains("device_path: \"memfd:2\""), "{out}");
    assert!(out.contains("index: 2"), "{out}");
    assert_eq!(
        devices(),
        [
            ("memfd".into(), "active".into()),
            ("memfd:b".into(), "active".into()),
            ("memfd:2".into(), "active".into()),
        ]
    );
    ok(&["remove", "memfd:b", "--mode", "drain"]);
    ok(&["resize", "--index", "2", "128MiB"]);
    ok(&["remove", "--index", "2", "--mode", "evict"]);
    // `memfd` is the last device new keys may go to (memfd:b drains): a
    // migrate is refused, an explicit evict removes it.
    let out = s.cli(&["remove", "memfd"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains(": 409: "));
    ok(&["remove", "memfd", "--mode", "evict"]);
    assert_eq!(
        devices(),
        [
            ("memfd".into(), "removed".into()),
            ("memfd:b".into(), "draining".into()),
            ("memfd:2".into(), "removed".into()),
        ]
    );
    let out = s.cli(&["resize", "128MiB"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--index N SIZE"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    s.stop_with(libc::SIGTERM);
}

/// A device path is whatever a file may be named: a local user who can
/// reach the control plane adds a file named with terminal control
/// sequences (clear the screen, set the window title, a carriage return
/// that overwrites the line). The add is refused (400, naming the rule):
/// such a name would reach the log, `daxkv status` and `/metrics` labels.
/// The table stays clean and its columns line up.
#[test]
fn the_status_table_never_prints_control_characters() {
    let dir = tempfile::tempdir().unwrap();
    let name = "x\u{1b}[2J\u{1b}]0;pwned\u{7}\rfake\u{9b}31m";
    let f = dir.path().join(name);
    std::fs::File::create(&f).unwrap().set_len(4 << 20).unwrap();
    let s = Serve::start(&[]);
    let out = s.cli(&["add", f.to_str().unwrap(), "4MiB"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("400")
            && err.contains("control, invisible or bidirectional-formatting characters"),
        "{err}"
    );
    assert!(
        !err.chars().any(|c| c.is_control() && c != '\n'),
        "raw control characters in the error: {err:?}"
    );
    let out = s.cli(&["status"]);
    assert!(out.status.success());
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        !table.chars().any(|c| c.is_control() && c != '\n'),
        "raw control characters in the table: {table:?}"
    );
    assert_eq!(table.lines().count(), 3, "nothing was added: {table}");
    s.stop_with(libc::SIGTERM);
}

/// `daxkv serve 2>&1 | tee log`, and the reader of its stderr goes away
/// (the `tee` is killed, a log collector restarts): stderr is a broken
/// pipe. A control-plane error that the engine also logs (a resize past
/// the device's `max_size`) still answers with its reason, and the device
/// and the server go on. A log line written with `eprintln!` would panic
/// on the broken pipe: 500 `internal error` instead of the 400 that says
/// why; and SIGTERM would abort the process (SIGABRT, not exit 0) if the
/// subscriber reported a line it cannot write with `eprintln!`, whose
/// panic in the shutdown's log line would unwind into the server's drop.
#[test]
fn a_broken_stderr_does_not_turn_logged_errors_into_500s() {
    let mut s = Serve::start(&[]);
    // The log's reader goes away.
    drop(s.child.stderr.take());
    let (st, _) = s.post(
        "/reconfigure/dax/l2/add",
        &json!({"device_path": "memfd:g", "size": "8MiB"}),
    );
    assert_eq!(st, 200);
    for _ in 0..2 {
        let (st, body) = s.post(
            "/reconfigure/dax/l2/resize",
            &json!({"device_path": "memfd:g", "size": "64MiB"}),
        );
        assert_eq!(st, 400, "{body}");
        assert!(
            body["error"].as_str().unwrap().contains("cannot grow"),
            "{body}"
        );
    }
    let (st, body) = s.post(
        "/reconfigure/dax/l2/resize",
        &json!({"device_path": "memfd:g", "size": "16MiB"}),
    );
    assert_eq!(st, 200, "{body}");
    assert_eq!(s.get("/health").0, 200);
    let mut s = s;
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(s.child.id().cast_signed(), libc::SIGTERM) };
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "serve did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit {status:?}");
}

/// `--config` given something that is not a config: a device file (the
/// arguments swapped: `--config /dev/shm/kv`, 64 GiB), or an endless
/// stream (`/dev/zero`). Exit 1 at once, naming the limit, without
/// reading it into memory. Reading the whole file would take a 64 GiB
/// tmpfs device into RAM (here, under a 2 GiB address-space limit, "out
/// of memory"; on a host, the OOM killer's choice).
#[test]
fn a_config_that_is_a_device_or_a_stream_is_refused_unread() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("kv");
    // Sparse: no disk or memory is used until it is read.
    std::fs::File::create(&dev)
        .unwrap()
        .set_len(64 << 30)
        .unwrap();
    for cfg in [dev.as_path(), std::path::Path::new("/dev/zero")] {
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--http", "127.0.0.1:0", "--config"])
            .arg(cfg)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // A sanitizer's shadow memory needs terabytes of address space: the
        // limit that bounds a server reading 64 GiB is left off there.
        let limit_as = std::env::var_os("DAXKV_SANITIZER").is_none();
        // SAFETY: the closure runs in the forked child before exec and
        // calls setrlimit(2) only, which is async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                if !limit_as {
                    return Ok(());
                }
                let lim = libc::rlimit {
                    rlim_cur: 2 << 30,
                    rlim_max: 2 << 30,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &raw const lim) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        let t0 = Instant::now();
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {err}", cfg.display());
        assert!(
            err.contains("larger than a config file may be (1 MiB)"),
            "{}: {err}",
            cfg.display()
        );
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", cfg.display());
    }
}
