//! The HTTP control plane over a real socket on 127.0.0.1, in front of a
//! real engine: random request sequences (methods, routes, headers, JSON
//! bodies built of the schema's fields with values of every type, size
//! strings, raw bytes).
//!
//! Each input gets a fresh engine (one anonymous device holding a few
//! keys, hotplug on) behind `serve` with an allow-list of `memfd` only (no
//! path on this machine can be added or created). What must hold for each
//! request: an answer comes (never a 500 or a dropped connection); every
//! refusal is a 4xx whose JSON body says why (`{"error": non-empty}` or
//! FastAPI's `{"detail": [{"loc": ["body", ...], "msg", ...}]}`), and a bad
//! size is a 400 that names `size`; a refused request leaves the engine as
//! it was (its devices, their states and sizes, and the keys it holds).
//!
//! `cargo test -p daxkv-fuzz --test http_control` runs it on random inputs
//! (bounded: [`ITERATIONS`] sequences or `BOLERO_RANDOM_TEST_TIME_MS`);
//! `cargo +nightly bolero test -p daxkv-fuzz --test http_control
//! http_control` runs it coverage-guided.

use std::fmt::Write as _;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use bolero::{check, TypeGenerator};
use daxkv::control::http::{serve, HttpConfig, HttpHooks};
use daxkv::control::reconfigure::{DaxReconfigure, Registry};
use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceSpec, Engine, EngineOptions};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key};
use serde_json::{json, Map, Value};

const SLOT: usize = 4096;
/// Sequences per plain `cargo test` run (a few seconds on a 2-vCPU VM).
const ITERATIONS: usize = 400;

#[derive(Clone, Debug, TypeGenerator)]
enum Method {
    Get,
    Post,
    Put,
    Delete,
    Other(u8),
}

#[derive(Clone, Debug, TypeGenerator)]
enum Route {
    Dax(u8),
    L2(u8, u8),
    Health,
    Metrics,
    Any(Vec<u8>),
}

const OPS: &[&str] = &["add", "remove", "resize", "status", "ADD ", "", "bogus"];
const BACKENDS: &[&str] = &["dax", " DAX", "other", ""];

#[derive(Clone, Debug, TypeGenerator)]
enum Header {
    Host(Vec<u8>),
    Origin(Vec<u8>),
    ContentType(u8, Vec<u8>),
    Authorization(Vec<u8>),
    Expect,
    Other(u8, Vec<u8>),
    /// No Host header at all.
    NoHost,
}

#[derive(Clone, Debug, TypeGenerator)]
enum Size {
    Int(i64),
    Big(u64),
    Float(f64),
    Unit(u16, u8, bool),
    Text(String),
}

const UNITS: &[&str] = &[
    "", "B", "K", "KB", "KiB", "kib", "M", "MB", "MiB", "G", "GiB", "T", "TiB", "P", "E", "x",
    "ki b",
];

#[derive(Clone, Debug, TypeGenerator)]
enum Val {
    Null,
    Bool(bool),
    Int(i64),
    Str(String),
    Size(Size),
    Path(u8),
    Mode(u8),
    List,
    Obj,
    /// A value valid for its field (`n` picks among them).
    Good(u16),
}

#[derive(Clone, Debug, TypeGenerator)]
enum Body {
    None,
    Fields(Vec<(u8, Val, bool)>),
    Raw(Vec<u8>),
}

const FIELDS: &[&str] = &[
    "device_path",
    "size",
    "max_size",
    "create",
    "mode",
    "force",
    "device_index",
    "adapter_index",
    "extra",
];

#[derive(Clone, Debug, TypeGenerator)]
struct Request {
    /// `None`: POST (most requests reach a backend).
    method: Option<Method>,
    /// `dax` `add` / `remove` / `resize`, unless `route` says otherwise.
    op: u8,
    route: Option<Route>,
    /// `None`: Host and Content-Type as a controller sends them.
    headers: Option<Vec<Header>>,
    body: Body,
}

fn size_value(s: &Size) -> Value {
    match s {
        Size::Int(n) => json!(n % (1 << 24)),
        Size::Big(n) => json!(n),
        Size::Float(f) => json!(f),
        Size::Unit(n, u, space) => json!(format!(
            "{}{}{}",
            n % 512,
            if *space { " " } else { "" },
            UNITS[usize::from(*u) % UNITS.len()]
        )),
        Size::Text(t) => json!(t),
    }
}

fn good(field: &str, n: u16) -> Value {
    match field {
        "device_path" => json!(["memfd", "memfd:f1", "memfd:f2", "memfd:"][usize::from(n % 4)]),
        "size" | "max_size" => match n % 3 {
            0 => json!(format!("{}KiB", 4 * (1 + n % 32))),
            1 => json!(4096 * (1 + u64::from(n % 32))),
            _ => json!(format!("{} kb", 4 * (1 + n % 8))),
        },
        "mode" => json!(["drain", "migrate", "evict"][usize::from(n % 3)]),
        "force" | "create" => json!(n.is_multiple_of(2)),
        "device_index" => json!(n % 3),
        _ => json!(0),
    }
}

fn value(field: &str, v: &Val) -> Value {
    match v {
        Val::Good(n) => good(field, *n),
        Val::Null => Value::Null,
        Val::Bool(b) => json!(b),
        Val::Int(n) => json!(n),
        Val::Str(s) => json!(s),
        Val::Size(s) => size_value(s),
        Val::Path(p) => json!(
            [
                "memfd",
                "memfd:",
                "memfd:f1",
                "memfd:f2",
                "/dev/shm/daxkv-fuzz-nope",
                "/etc/passwd",
                " memfd ",
                "memfd:a/b"
            ][usize::from(*p) % 8]
        ),
        Val::Mode(m) => {
            json!(["drain", "migrate", "evict", "DRAIN", "", "shrink"][usize::from(*m) % 6])
        }
        Val::List => json!([1, "a"]),
        Val::Obj => json!({"a": 1}),
    }
}

fn visible(b: &[u8]) -> String {
    b.iter()
        .take(64)
        .map(|&c| {
            if (0x20..0x7f).contains(&c) {
                c as char
            } else {
                'x'
            }
        })
        .collect::<String>()
        .trim()
        .to_string()
}

/// The request's bytes, and whether its body had a `size` field.
fn render(addr: SocketAddr, r: &Request) -> (String, Vec<u8>) {
    let method = match r.method.as_ref().unwrap_or(&Method::Post) {
        Method::Get => "GET".to_string(),
        Method::Post | Method::Other(0..=127) => "POST".to_string(),
        Method::Put => "PUT".to_string(),
        Method::Delete => "DELETE".to_string(),
        Method::Other(n) => ["PATCH", "OPTIONS", "HEAD", "FOO"][usize::from(*n) % 4].to_string(),
    };
    let dax = Route::Dax(r.op % 3);
    let path = match r.route.as_ref().unwrap_or(&dax) {
        Route::Dax(op) => format!("/reconfigure/dax/{}", OPS[usize::from(*op) % OPS.len()]),
        Route::L2(b, op) => format!(
            "/reconfigure/{}/l2/{}",
            BACKENDS[usize::from(*b) % BACKENDS.len()],
            OPS[usize::from(*op) % OPS.len()]
        ),
        Route::Health => "/health".into(),
        Route::Metrics => "/metrics".into(),
        Route::Any(bytes) => {
            let mut p = String::from("/");
            for &b in bytes.iter().take(40) {
                if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
                    p.push(b as char);
                } else {
                    let _ = write!(p, "%{b:02X}");
                }
            }
            p
        }
    };
    let path = path.replace(' ', "%20");
    let body = match &r.body {
        Body::None => Vec::new(),
        Body::Fields(fields) => {
            let mut o = Map::new();
            for (k, v, really) in fields.iter().take(8) {
                let k = FIELDS[usize::from(*k) % FIELDS.len()];
                // Mostly valid values: the backend is reached.
                let v = if *really {
                    value(k, v)
                } else {
                    let n = match v {
                        Val::Good(n) => *n,
                        Val::Int(i) => *i as u16,
                        Val::Path(p) | Val::Mode(p) => u16::from(*p),
                        _ => 0,
                    };
                    good(k, n)
                };
                o.insert(k.into(), v);
            }
            Value::Object(o).to_string().into_bytes()
        }
        Body::Raw(b) => b.iter().take(256).copied().collect(),
    };
    let mut head = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    let mut host = true;
    let mut content_type = false;
    for h in r.headers.iter().flatten().take(6) {
        match h {
            Header::Host(v) => {
                let _ = write!(head, "Host: {}\r\n", visible(v));
                host = false;
            }
            Header::NoHost => host = false,
            Header::Origin(v) => {
                let _ = write!(head, "Origin: {}\r\n", visible(v));
            }
            Header::ContentType(n, v) => {
                let ct = match n % 4 {
                    0 => "application/json".to_string(),
                    1 => "application/json; charset=utf-8".to_string(),
                    2 => "text/plain".to_string(),
                    _ => visible(v),
                };
                let _ = write!(head, "Content-Type: {ct}\r\n");
                content_type = true;
            }
            Header::Authorization(v) => {
                let _ = write!(head, "Authorization: Bearer {}\r\n", visible(v));
            }
            Header::Expect => head.push_str("Expect: 100-continue\r\n"),
            Header::Other(n, v) => {
                let _ = write!(head, "X-Fuzz-{n}: {}\r\n", visible(v));
            }
        }
    }
    if host {
        let _ = write!(head, "Host: {addr}\r\n");
    }
    if !content_type && method == "POST" {
        head.push_str("Content-Type: application/json\r\n");
    }
    let _ = write!(head, "Content-Length: {}\r\n\r\n", body.len());
    (head, body)
}

struct Resp {
    status: u16,
    body: Vec<u8>,
}

fn send(addr: SocketAddr, head: &str, body: &[u8]) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset && !buf.is_empty() => break,
            Err(e) => panic!("no answer to {head:?}: {e}"),
        }
    }
    // An interim `100 Continue` (after `Expect`) comes before the answer.
    while buf.starts_with(b"HTTP/1.1 100 ") {
        match buf.windows(4).position(|w| w == b"\r\n\r\n") {
            Some(e) => drop(buf.drain(..e + 4)),
            None => break,
        }
    }
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no answer to {head:?}: {:?}", String::from_utf8_lossy(&buf)));
    let head_text = String::from_utf8_lossy(&buf[..end]).into_owned();
    let status = head_text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("status line {head_text:?}"));
    let len = head_text
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(usize::MAX);
    let mut body = buf[end + 4..].to_vec();
    body.truncate(len);
    Resp { status, body }
}

fn key(i: u8) -> Key {
    Key::digest(&[b'h', i])
}

/// Each device's path, state, mapped bytes and live slots; which keys exist.
type Snapshot = (Vec<(String, String, usize, usize)>, Vec<bool>);

/// What a refused request must not change.
fn snapshot(engine: &Engine) -> Snapshot {
    let devices = engine
        .devices()
        .into_iter()
        .map(|d| {
            (
                d.path,
                d.state.name().to_string(),
                d.arena_bytes,
                d.live_slots,
            )
        })
        .collect();
    let keys: Vec<Key> = (0..4).map(key).collect();
    (devices, engine.exists(&keys))
}

/// A refusal is a 4xx, or LMCache's 507 when the other devices have no room
/// for the keys a remove or shrink must move (docs/hotplug.md).
fn is_refusal(status: u16) -> bool {
    (400..500).contains(&status) || status == 507
}

fn check_refusal(what: &str, r: &Resp, body: &[u8]) {
    assert!(
        is_refusal(r.status),
        "{what}: answered {} {:?}",
        r.status,
        String::from_utf8_lossy(&r.body)
    );
    let v: Value = serde_json::from_slice(&r.body).unwrap_or_else(|e| {
        panic!(
            "{what}: {} with a body that is not JSON ({e}): {:?}",
            r.status,
            String::from_utf8_lossy(&r.body)
        )
    });
    if let Some(detail) = v.get("detail") {
        let items = detail.as_array().expect("detail is a list");
        assert!(!items.is_empty(), "{what}: empty detail");
        for it in items {
            let loc = it["loc"].as_array().expect("loc is a list");
            assert_eq!(loc.first(), Some(&json!("body")), "{what}: {it}");
            assert!(
                it["msg"].as_str().is_some_and(|m| !m.is_empty()),
                "{what}: {it}"
            );
        }
    } else {
        let msg = v["error"].as_str().unwrap_or_default();
        assert!(!msg.is_empty(), "{what}: {v}");
        // A size the grammar refuses is named as such.
        if msg.starts_with("size must be") {
            let sent: Value = serde_json::from_slice(body).unwrap();
            assert!(sent.get("size").is_some(), "{what}: {msg} without a size");
        }
    }
}

fn run(reqs: &[Request]) {
    let opts = EngineOptions {
        num_store_workers: 1,
        num_lookup_workers: 1,
        num_load_workers: 1,
        task_slots: 8,
        task_keys: 4,
        spin: Duration::from_micros(5),
        wait_spin: Duration::from_micros(5),
        ..EngineOptions::default()
    };
    let spec = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(
            ArenaSpec::memfd(16 * SLOT)
                .max_size_bytes(64 * SLOT)
                .populate(false),
            SLOT,
        ),
    };
    let engine = Arc::new(Engine::open(vec![spec], SLOT, true, opts).unwrap());
    let keys: Vec<Key> = (0..4).map(key).collect();
    let bufs: Vec<Buf> = (0..4).map(|i| Buf::from(vec![i; 100])).collect();
    let id = engine.submit_store(keys, bufs).unwrap();
    assert!(
        engine
            .wait_store(id, Duration::from_secs(20))
            .ready()
            .unwrap()
            .success
    );

    let mut reg = Registry::new();
    reg.register(Arc::new(DaxReconfigure::new(
        Arc::clone(&engine),
        |_, _, _| Ok(()),
    )));
    let cfg = HttpConfig {
        allow_prefixes: vec!["memfd".into()],
        body_limit: 512,
        ..HttpConfig::default()
    };
    let srv = serve(cfg, reg, HttpHooks::default()).expect("serve");
    let addr = srv.local_addr();
    for (i, r) in reqs.iter().take(8).enumerate() {
        let before = snapshot(&engine);
        let (head, body) = render(addr, r);
        let resp = send(addr, &head, &body);
        if std::env::var_os("HTTP_CONTROL_STATS").is_some() {
            eprintln!(
                "status {} {}",
                resp.status,
                head.lines().next().unwrap_or_default()
            );
        }
        let what = format!("request {i} {head:?} {:?}", String::from_utf8_lossy(&body));
        assert_ne!(
            resp.status,
            500,
            "{what}: 500 {:?}",
            String::from_utf8_lossy(&resp.body)
        );
        if resp.status >= 300 {
            if head.starts_with("HEAD ") {
                // A HEAD answer has no body.
                assert!((400..500).contains(&resp.status), "{what}: {}", resp.status);
            } else {
                check_refusal(&what, &resp, &body);
            }
            let after = snapshot(&engine);
            if resp.status == 507 {
                // A migration that stopped halfway may leave some keys on
                // the other devices: every key still exists, on exactly one
                // device (the live slots add up), and no device changed.
                let shape = |s: &Snapshot| {
                    let devices: Vec<_> =
                        s.0.iter()
                            .map(|(p, st, b, _)| (p.clone(), st.clone(), *b))
                            .collect();
                    let live: usize = s.0.iter().map(|d| d.3).sum();
                    (devices, live, s.1.clone())
                };
                assert_eq!(
                    shape(&after),
                    shape(&before),
                    "{what}: 507 but lost, duplicated or changed something"
                );
            } else {
                assert_eq!(
                    after, before,
                    "{what}: refused with {} but changed the engine",
                    resp.status
                );
            }
        }
    }
    srv.shutdown();
    engine.close();
}

#[test]
fn http_control() {
    check!()
        .with_iterations(ITERATIONS)
        .with_type::<Vec<Request>>()
        .for_each(|r| run(r));
}
