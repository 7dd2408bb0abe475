//! `daxkv serve` operated from another terminal, as a newcomer does it: a
//! real server on a free loopback port, driven by the real `daxkv status |
//! add | remove | resize` commands. What the user sees is asserted: exit
//! codes, the messages (a missing path named with the way to create it,
//! the 409 on the last device), `/health`'s 503 and its reason, the status
//! table's columns and sizes, and the server's log line per operation.

use std::path::Path;

use daxkv::cli::serve::request;
use serde_json::{json, Value};

#[path = "common/serve.rs"]
mod serve_common;
use serve_common::Serve;

/// A fresh folder in /dev/shm (tmpfs), removed at the end.
fn shm_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("daxkv-ops-")
        .tempdir_in("/dev/shm")
        .unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `add PATH SIZE` of a missing file says which path, that it does not
/// exist and how to fix it, and creates nothing; `--create` (the HTTP
/// body's `"create": true`) makes it at SIZE and adds it. The allow-list
/// refuses a path outside it before anything is created, and a created
/// file that cannot be added is removed again.
#[test]
fn add_create_makes_a_missing_file_and_without_it_says_how() {
    let dir = shm_dir();
    let outside = shm_dir();
    let s_dir = s(dir.path());
    let srv = Serve::start(&["--allow-prefix", s_dir, "--allow-prefix", "memfd"]);
    let kv1 = dir.path().join("kv1");

    let err = srv.fails(&["add", s(&kv1), "64MiB"]);
    assert!(err.contains(": 400: "), "{err}");
    for says in [
        format!("{} does not exist", kv1.display()),
        format!("truncate -s 64M {}", kv1.display()),
        "--create".to_string(),
    ] {
        assert!(err.contains(&says), "{says:?} not in {err}");
    }
    assert!(!kv1.exists(), "a refused add created the file");

    let out = srv.ok(&["add", s(&kv1), "64MiB", "--create"]);
    assert!(out.contains("index: 1"), "{out}");
    assert_eq!(std::fs::metadata(&kv1).unwrap().len(), 64 << 20);
    assert_eq!(srv.devices()[1], (s(&kv1).to_string(), "active".into()));

    // The HTTP body's field, as a controller sends it.
    let kv2 = dir.path().join("kv2");
    let (code, body) = request(
        &srv.addr,
        "POST",
        "/reconfigure/dax/l2/add",
        Some(&json!({"device_path": s(&kv2), "size": "32MiB", "create": true})),
        None,
    )
    .unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(std::fs::metadata(&kv2).unwrap().len(), 32 << 20);
    let (code, body) = request(
        &srv.addr,
        "POST",
        "/reconfigure/dax/l2/add",
        Some(&json!({"device_path": s(&kv2), "size": "32MiB", "create": "maybe"})),
        None,
    )
    .unwrap();
    assert_eq!(code, 422, "{body}");
    assert!(body.contains("create"), "{body}");

    // Outside the allow-list: refused before anything is created.
    let far = outside.path().join("kv");
    let err = srv.fails(&["add", s(&far), "64MiB", "--create"]);
    assert!(err.contains(": 403: "), "{err}");
    assert!(!far.exists(), "a file outside the allow-list was created");

    // Created, then refused (the slot tables for the largest size are
    // beyond any limit): nothing is left behind, and nothing was added.
    let big = dir.path().join("big");
    let err = srv.fails(&[
        "add",
        s(&big),
        "64MiB",
        "--create",
        "--max-size",
        "4503599627370496",
    ]);
    assert!(err.contains(": 507: "), "{err}");
    assert!(!big.exists(), "a created file that was not added is left");
    // Its directory must exist: refused with the reason.
    let err = srv.fails(&["add", s(&dir.path().join("no/kv")), "64MiB", "--create"]);
    assert!(err.contains("does not exist"), "{err}");
    assert_eq!(srv.devices().len(), 3);
    srv.stop();
}

/// Every command that takes a device takes its path, its memfd name or
/// `--index N` (the index `daxkv status` prints): two anonymous devices
/// and a file are told apart, and a path with an index that is not its
/// own is refused.
#[test]
fn devices_are_addressed_by_path_name_or_index() {
    let dir = shm_dir();
    let f = dir.path().join("kv");
    std::fs::File::create(&f)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let srv = Serve::start(&[]);
    srv.ok(&["add", "memfd:two", "64MiB"]);
    srv.ok(&["add", "memfd:three", "64MiB"]);
    srv.ok(&["add", s(&f), "32MiB"]);
    // Resize: by name, by index, by path.
    srv.ok(&["resize", "memfd:two", "128MiB"]);
    srv.ok(&["resize", "--index", "2", "128MiB"]);
    srv.ok(&["resize", s(&f), "64MiB"]);
    let v: Value = serde_json::from_str(&srv.ok(&["status", "--json"])).unwrap();
    let sizes: Vec<u64> = v["adapters"][0]["status"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["max_dax_size_bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [1 << 30, 128 << 20, 128 << 20, 64 << 20]);
    // A path with another device's index.
    let err = srv.fails(&["remove", "memfd:two", "--index", "2"]);
    assert!(err.contains(": 409: "), "{err}");
    // Drain by index, remove by name, by index, by path.
    srv.ok(&["remove", "--index", "1", "--mode", "drain"]);
    srv.ok(&["remove", "memfd:two"]);
    srv.ok(&["remove", "--index", "2"]);
    srv.ok(&["remove", s(&f)]);
    assert_eq!(
        srv.devices(),
        [
            ("memfd".into(), "active".into()),
            ("memfd:two".into(), "removed".into()),
            ("memfd:three".into(), "removed".into()),
            (s(&f).to_string(), "removed".into()),
        ]
    );
    let err = srv.fails(&["remove", "--index", "1"]);
    assert!(err.contains(": 404: "), "{err}");
    srv.stop();
}

/// `remove` of the last device new keys may go to, in the default migrate
/// mode, is refused with a 409 that names it and says what to do; the
/// device stays and serves. An explicit drain or evict still runs.
#[test]
fn migrating_the_last_device_away_is_refused() {
    let srv = Serve::start(&[]);
    let err = srv.fails(&["remove", "memfd"]);
    assert!(
        err.trim_end().ends_with(
            ": 409: \"memfd: no other device can take its keys: add one first, \
             or use --mode evict (drops the keys) or --mode drain\""
        ),
        "{err}"
    );
    assert_eq!(srv.devices(), [("memfd".into(), "active".into())]);
    assert_eq!(srv.health().0, 200);
    // By index too; and with another device only draining.
    srv.ok(&["add", "memfd:two", "64MiB"]);
    srv.ok(&["remove", "memfd:two", "--mode", "drain"]);
    let err = srv.fails(&["remove", "--index", "0"]);
    assert!(err.contains(": 409: "), "{err}");
    // With an active one to take the keys, the migrate runs.
    srv.ok(&["add", "memfd:three", "64MiB"]);
    srv.ok(&["remove", "memfd"]);
    // Explicit modes of the last one run.
    srv.ok(&["remove", "memfd:three", "--mode", "drain"]);
    srv.ok(&["remove", "memfd:three", "--mode", "evict"]);
    srv.stop();
}

/// `/health` is 200 `{"status":"ok"}` while a device can take a store, and
/// 503 with a reason when none can (every device draining, or none left):
/// an operator's probe sees a server that cannot store.
#[test]
fn health_is_503_with_a_reason_when_no_device_can_take_a_store() {
    let srv = Serve::start(&[]);
    assert_eq!(srv.health(), (200, json!({"status": "ok"})));
    srv.ok(&["remove", "memfd", "--mode", "drain"]);
    assert_eq!(
        srv.health(),
        (
            503,
            json!({"status": "unhealthy", "reason": "no device can take a store: device 0 (memfd) is draining (add one)"})
        )
    );
    srv.ok(&["add", "memfd:two", "64MiB"]);
    assert_eq!(srv.health(), (200, json!({"status": "ok"})));
    srv.ok(&["remove", "memfd:two", "--mode", "evict"]);
    srv.ok(&["remove", "memfd", "--mode", "evict"]);
    assert_eq!(
        srv.health(),
        (
            503,
            json!({"status": "unhealthy", "reason": "no device can take a store: there is no device (add one)"})
        )
    );
    srv.stop();
}

/// Where each column of `line` starts: after two spaces, or at 0.
fn column_starts(line: &str) -> Vec<usize> {
    let b = line.as_bytes();
    (0..b.len())
        .filter(|&i| b[i] != b' ' && (i == 0 || (i >= 2 && b[i - 1] == b' ' && b[i - 2] == b' ')))
        .collect()
}

/// `daxkv status`: the adapter's line says `X of Y used` in binary units;
/// the devices' columns start at the same offsets on every row, whatever
/// the widths of their cells; sizes are binary units; `--json` is the
/// server's JSON with raw byte counts.
#[test]
fn the_status_table_lines_up_in_binary_units() {
    let dir = shm_dir();
    let f = dir.path().join("a-rather-long-device-file-name");
    std::fs::File::create(&f)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    let srv = Serve::start(&[]);
    let one = srv.ok(&["status"]);
    assert_eq!(
        one.lines().next(),
        Some("adapter 0: 1 device, 0 B of 1 GiB used, healthy: true"),
        "{one}"
    );
    srv.ok(&["add", "memfd:two", "64MiB"]);
    srv.ok(&["add", s(&f), "32MiB"]);
    srv.ok(&["remove", "memfd:two", "--mode", "drain"]);
    let table = srv.ok(&["status"]);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(
        lines[0], "adapter 0: 3 devices, 0 B of 1120 MiB used, healthy: true",
        "{table}"
    );
    assert_eq!(lines.len(), 5, "{table}");
    let head = column_starts(lines[1]);
    let names: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(
        names,
        ["index", "id", "state", "used", "size", "slots", "locked", "path"]
    );
    for row in &lines[2..] {
        assert_eq!(column_starts(row), head, "misaligned:\n{table}");
    }
    let cells = |row: &str| -> Vec<String> {
        let starts = column_starts(row);
        starts
            .iter()
            .enumerate()
            .map(|(i, &a)| {
                let end = starts.get(i + 1).copied().unwrap_or(row.len());
                row[a..end].trim_end().to_string()
            })
            .collect()
    };
    assert_eq!(
        cells(lines[2]),
        ["0", "0", "active", "0 B", "1 GiB", "512", "0", "memfd"]
    );
    assert_eq!(
        cells(lines[3]),
        [
            "1",
            "1",
            "draining",
            "0 B",
            "64 MiB",
            "32",
            "0",
            "memfd:two"
        ]
    );
    assert_eq!(
        cells(lines[4]),
        ["2", "2", "active", "0 B", "32 MiB", "16", "0", s(&f)]
    );
    // No device takes new keys: the adapter's line says so.
    srv.ok(&["remove", s(&f), "--mode", "drain"]);
    srv.ok(&["remove", "memfd", "--mode", "drain"]);
    let table = srv.ok(&["status"]);
    assert_eq!(
        table.lines().next(),
        Some("adapter 0: 3 devices, 0 B of 1120 MiB used, healthy: true, no device takes new keys (add one)"),
        "{table}"
    );
    // --json: the server's answer, pretty-printed, byte counts raw.
    let json_out = srv.ok(&["status", "--json"]);
    let v: Value = serde_json::from_str(&json_out).unwrap();
    assert_eq!(
        json_out,
        format!("{}\n", serde_json::to_string_pretty(&v).unwrap())
    );
    assert_eq!(
        v["adapters"][0]["status"]["max_dax_size_bytes"],
        json!(1120u64 << 20)
    );
    assert_eq!(
        v["adapters"][0]["status"]["devices"][1]["max_dax_size_bytes"],
        json!(64u64 << 20)
    );
    // A removed device stays listed but is not counted.
    srv.ok(&["remove", "memfd:two", "--mode", "evict"]);
    let table = srv.ok(&["status"]);
    assert!(
        table
            .lines()
            .next()
            .is_some_and(|l| l.starts_with("adapter 0: 2 devices, ")),
        "{table}"
    );
    assert!(table.contains("removed"), "{table}");
    srv.stop();
}

/// `daxkv serve` logs each hotplug operation on stderr, one line: what,
/// which device (path and index), the outcome (ok, or refused with the
/// status and message), the time taken.
#[test]
fn serve_logs_each_hotplug_operation() {
    let dir = shm_dir();
    let kv = dir.path().join("kv1");
    let srv = Serve::start(&[]);
    srv.fails(&["add", s(&kv), "64MiB"]);
    srv.ok(&["add", s(&kv), "64MiB", "--create"]);
    srv.ok(&["add", "memfd:two", "64MiB"]);
    srv.ok(&["resize", "--index", "2", "128MiB"]);
    srv.ok(&["remove", "memfd:two", "--mode", "drain"]);
    srv.ok(&["remove", "--index", "1"]);
    srv.fails(&["remove", "memfd"]);
    srv.fails(&["remove", "--index", "7"]);
    let err = srv.stop();
    let ops: Vec<&str> = err.lines().filter(|l| l.starts_with("daxkv: ")).collect();
    let kv = kv.display();
    let expect = [
        format!("daxkv: add {kv}: refused (400): failed to identify DAX device: {kv} does not exist: create it first, e.g. `truncate -s 64M {kv}`, or pass --create (`create: true` in an HTTP add), "),
        format!("daxkv: add {kv} (device 1): ok, 64 MiB, "),
        "daxkv: add memfd:two (device 2): ok, 64 MiB, ".into(),
        "daxkv: resize memfd:two (device 2): ok, 64 MiB -> 128 MiB, ".into(),
        "daxkv: drain memfd:two (device 2): ok, draining, ".into(),
        format!("daxkv: remove {kv} (device 1): ok, 0 keys moved, 0 deleted, "),
        "daxkv: remove memfd (device 0): refused (409): memfd: no other device can take its keys: add one first, or use --mode evict (drops the keys) or --mode drain, ".into(),
        "daxkv: remove device 7: refused (404): DAX device not found, ".into(),
    ];
    assert_eq!(ops.len(), expect.len(), "{err}");
    for (line, head) in ops.iter().zip(&expect) {
        let rest = line
            .strip_prefix(head.as_str())
            .unwrap_or_else(|| panic!("{line:?} does not start with {head:?}"));
        let ms = rest
            .strip_suffix(" ms")
            .unwrap_or_else(|| panic!("{line:?}"));
        assert!(ms.parse::<u64>().is_ok(), "{line:?}");
    }
}
