//! The `daxkv status | add | remove | resize` client as a process, against
//! servers on 127.0.0.1 that are not daxkv: one that answers 2xx with
//! something else, one that never answers, one whose answer never ends;
//! and `--server` values that are not `host:port`. Each is exit 1 and one
//! line that names what was wrong, in bounded time.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_daxkv");

/// A server that hands every connection to `answer` on its own thread.
fn fake(answer: fn(TcpStream)) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for c in l.incoming().take(64) {
            let Ok(c) = c else { continue };
            std::thread::spawn(move || answer(c));
        }
    });
    addr
}

/// Read the request head (so that the client is done sending).
fn read_head(s: &mut TcpStream) {
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut got = Vec::new();
    let mut b = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut b) {
            Ok(0) | Err(_) => return,
            Ok(n) => got.extend_from_slice(&b[..n]),
        }
    }
}

/// Run the CLI; it must exit within 30 s (killed and failed otherwise).
fn cli(args: &[&str]) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(30) {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "daxkv {args:?} did not exit within 30 s; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Exit 1 and one stderr line containing every one of `says`.
fn fails_saying(out: &Output, says: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    for s in says {
        assert!(err.contains(s), "{s:?} not in {err}");
    }
}

const COMMANDS: &[&[&str]] = &[
    &["status"],
    &["status", "--json"],
    &["add", "memfd", "64MiB"],
    &["remove", "/dev/shm/x"],
    &["remove", "/dev/shm/x", "--mode", "drain"],
    &["resize", "/dev/shm/x", "1GiB"],
];

fn run(cmd: &[&str], server: &str, extra: &[&str]) -> Output {
    let mut args: Vec<&str> = cmd.to_vec();
    args.extend(["--server", server]);
    args.extend(extra);
    cli(&args)
}

/// A 2xx that is not daxkv's (another web server on the port, a JSON
/// that is not the status or an operation's result) is exit 1, not
/// success.
#[test]
fn a_2xx_that_is_not_a_daxkv_answer_fails() {
    let answers: [fn(TcpStream); 4] = [
        |mut s| {
            read_head(&mut s);
            let _ = s.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 13\r\n\r\n<html></html>",
            );
        },
        |mut s| {
            read_head(&mut s);
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"ok\":true}");
        },
        |mut s| {
            read_head(&mut s);
            let _ = s.write_all(b"HTTP/1.1 204 No Content\r\n\r\n");
        },
        |mut s| {
            // A daxkv-looking status for an operation, and vice versa.
            read_head(&mut s);
            let b = br#"{"status":"ok","operation":"flush","backend":"x","adapters":[],"num_adapters":0}"#;
            let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", b.len());
            let _ = s.write_all(b);
        },
    ];
    for (i, answer) in answers.into_iter().enumerate() {
        let addr = fake(answer).to_string();
        for cmd in COMMANDS {
            let out = run(cmd, &addr, &[]);
            fails_saying(&out, &["is not a daxkv answer", "is this a daxkv server?"]);
            assert!(out.stdout.is_empty(), "answer {i} {cmd:?}");
        }
    }
}

/// A server that takes the request and never answers: exit 1 after
/// `--timeout`, saying so (the default is 60 s, not 600).
#[test]
fn a_silent_server_times_out() {
    let addr = fake(|mut s| {
        read_head(&mut s);
        // Hold the connection until the client goes (bounded: 30 s).
        let mut b = [0u8; 64];
        let _ = s.read(&mut b);
    })
    .to_string();
    for cmd in [&["status"][..], &["add", "memfd", "64MiB"]] {
        let out = run(cmd, &addr, &["--timeout", "1"]);
        fails_saying(
            &out,
            &[
                &addr,
                "no answer within 1 s",
                "an operation may still be running",
            ],
        );
    }
    // A server that trickles its answer forever is held to the same
    // deadline.
    let addr = fake(|mut s| {
        read_head(&mut s);
        let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n");
        for _ in 0..300 {
            if s.write_all(b" ").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .to_string();
    fails_saying(
        &run(&["status"], &addr, &["--timeout", "1"]),
        &["no answer within 1 s"],
    );
    let help = cli(&["status", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--timeout <SECONDS>"), "{help}");
    assert!(help.contains("[default: 60]"), "{help}");
    // Zero is a usage error (clap's exit 2).
    let out = run(&["status"], &addr, &["--timeout", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("'--timeout <SECONDS>': 0 is not in 1..=86400"));
}

/// An answer that never ends is cut off: its body at 64 MiB, its head at
/// 64 KiB.
#[test]
fn an_endless_answer_is_cut_off() {
    let answers: [fn(TcpStream); 2] = [
        |mut s| {
            read_head(&mut s);
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\n");
            let chunk = vec![b'x'; 64 << 10];
            // At most 256 MiB, until the client hangs up.
            for _ in 0..4096 {
                if s.write_all(&chunk).is_err() {
                    return;
                }
            }
        },
        |mut s| {
            read_head(&mut s);
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\n");
            let line = format!("X-Pad: {}\r\n", "y".repeat(1000));
            for _ in 0..262_144 {
                if s.write_all(line.as_bytes()).is_err() {
                    return;
                }
            }
        },
    ];
    // The body at 64 MiB, the head at 64 KiB.
    for (answer, limit) in answers.into_iter().zip([
        "the answer is larger than 67108864 bytes",
        "the answer is larger than 65536 bytes",
    ]) {
        let addr = fake(answer).to_string();
        for cmd in [&["status"][..], &["add", "memfd", "64MiB"]] {
            fails_saying(&run(cmd, &addr, &[]), &[limit]);
        }
    }
}

/// `--server` values that are not `host:port`: each says what is wrong,
/// and nothing is sent.
#[test]
fn server_values_that_are_not_host_port_say_why() {
    for (server, says) in [
        (
            "https://127.0.0.1:8765",
            "the scheme https:// is not supported: the control plane speaks plain HTTP",
        ),
        (
            "127.0.0.1:8765/reconfigure/dax/l2",
            "has a path (/reconfigure/dax/l2): give host:port only",
        ),
        ("http://localhost:8765/x", "has a path (/x)"),
        ("/run/daxkv.sock", "is a path, not host:port"),
        ("localhost", "no port: give host:port"),
        ("127.0.0.1:http", "bad port \"http\""),
        ("token@127.0.0.1:8765", "user info"),
    ] {
        for cmd in [&["status"][..], &["add", "memfd", "64MiB"]] {
            let out = run(cmd, server, &[]);
            fails_saying(&out, &[&format!("--server {server:?}: "), says]);
        }
    }
    // A trailing slash and the http:// scheme are fine: this one is
    // refused by the (absent) server, not by the parser.
    let free = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let out = run(&["status"], &format!("http://{free}/"), &[]);
    fails_saying(
        &out,
        &[&format!(
            "{free}: cannot reach the server: Connection refused"
        )],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("Connection refused").count(), 1, "{err}");
}

/// A hostile server (or a port taken by something else) puts terminal
/// control sequences in what the CLI prints as text: a device's state and
/// path in the status table, a key of an operation's answer. Nothing of it
/// reaches the terminal raw.
#[test]
fn a_hostile_answer_prints_no_control_characters() {
    let answers: [fn(TcpStream); 2] = [
        |mut s| {
            read_head(&mut s);
            let b = r#"{"backend":"dax","num_adapters":1,"adapters":[{"adapter_index":0,
                "status":{"devices":[{"index":0,"state":"act\u001b[2Jive","device_path":"/dev/\u001b]0;t\u0007x\r"}]}}]}"#;
            let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", b.len());
            let _ = s.write_all(b.as_bytes());
        },
        |mut s| {
            read_head(&mut s);
            let b = r#"{"status":"ok","operation":"add","\u001b[2Jk\r":1}"#;
            let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", b.len());
            let _ = s.write_all(b.as_bytes());
        },
    ];
    for (answer, cmd) in answers
        .into_iter()
        .zip([&["status"][..], &["add", "memfd", "64MiB"]])
    {
        let addr = fake(answer).to_string();
        let out = run(cmd, &addr, &[]);
        assert!(
            out.status.success(),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "{cmd:?}: raw control characters: {text:?}"
        );
    }
}

/// A server that has run for weeks: every removed device stays in the
/// status as a tombstone (ids are never reused), ~390 bytes each, so
/// 12 000 add / remove cycles make a 4.7 MB status. `daxkv status` shows
/// it. A 4 MiB cap on the whole answer would refuse it as "not a daxkv
/// server?" (against a real `daxkv serve`, after 11 500 cycles); the head
/// stays capped small, the body may be 64 MiB.
#[test]
fn a_status_of_many_tombstones_is_shown() {
    let addr = fake(|mut s| {
        read_head(&mut s);
        let tomb = |i: usize| {
            format!(
                r#"{{"active_read_count":0,"active_write_count":0,"borrowed_slot_count":0,"closing":true,"device_id":{i},"device_path":"memfd:c","index":{i},"inflight_load_tasks":0,"inflight_lookup_tasks":0,"inflight_store_tasks":0,"is_healthy":false,"live_slot_count":0,"locked_key_count":0,"max_dax_size_bytes":0,"max_slots":0,"slot_bytes":2097152,"state":"removed","supports_restart_recovery":false}}"#
            )
        };
        let devices: Vec<String> = (0..12_000).map(tomb).collect();
        let b = format!(
            r#"{{"enabled":true,"backend":"dax","num_adapters":1,"adapters":[{{"adapter_index":0,"backend":"dax","l2_adapter_index":0,"status":{{"num_devices":12000,"devices":[{}]}}}}]}}"#,
            devices.join(",")
        );
        let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", b.len());
        let _ = s.write_all(b.as_bytes());
    })
    .to_string();
    // Not `cli`: 12 000 lines fill the stdout pipe it does not drain.
    let out = Command::new(BIN)
        .args(["status", "--timeout", "20", "--server", &addr])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 12_002);
}

/// `daxkv status | head -1`: the reader of stdout goes away before the
/// table is printed. The client ends quietly by SIGPIPE, as command-line
/// tools do; before, Rust's ignored SIGPIPE turned the closed pipe into a
/// panic ("failed printing to stdout", exit 101).
#[test]
fn a_closed_stdout_ends_the_client_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let addr = fake(|mut s| {
        read_head(&mut s);
        // Answer once the test has closed the client's stdout.
        std::thread::sleep(std::time::Duration::from_millis(500));
        let b = r#"{"enabled":true,"backend":"dax","num_adapters":1,"adapters":[{"adapter_index":0,"backend":"dax","l2_adapter_index":0,"status":{"num_devices":0,"devices":[]}}]}"#;
        let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", b.len());
        let _ = s.write_all(b.as_bytes());
    })
    .to_string();
    let mut child = Command::new(BIN)
        .args(["status", "--timeout", "20", "--server", &addr])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?} {err}",
        out.status
    );
}
