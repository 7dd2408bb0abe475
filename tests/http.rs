//! The HTTP control plane over a real socket on 127.0.0.1: LMCache's
//! reconfigure API contract (docs/lmcache-dax-behavior.md §5, the
//! scenarios of §8.5), the seed's `/reconfigure/dax/*` routes, security
//! (token, allow-list, body limit, loopback), `/health`, `/metrics`, and
//! the answer-at-once rule while a mutation blocks.
//!
//! The backends here are test doubles that record what they receive: the
//! HTTP layer's contract is what is under test, not the DAX engine.

use std::fmt::Write as _;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use daxkv::control::http::{serve, HttpConfig, HttpError, HttpHooks, HttpServer};
use daxkv::control::reconfigure::{Owners, Reconfigurable, ReconfigureError, Registry};
use serde_json::{json, Value};

// ---------------------------------------------------------------- client

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(&self.body)))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A minimal blocking HTTP/1.1 client: one request per connection.
fn raw(addr: SocketAddr, head: &str, body: &[u8]) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    // The server may answer (and close) before reading all of it.
    let _ = s.write_all(body);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset && !buf.is_empty() => break,
            Err(e) => panic!("read: {e}"),
        }
    }
    parse(&buf)
}

fn parse(buf: &[u8]) -> Resp {
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {:?}", String::from_utf8_lossy(buf)));
    let head = std::str::from_utf8(&buf[..end]).unwrap();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.trim().to_string(), v.trim().to_string())
        })
        .collect();
    let mut body = buf[end + 4..].to_vec();
    if let Some((_, n)) = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
    {
        body.truncate(n.parse().unwrap());
    }
    Resp {
        status,
        headers,
        body,
    }
}

fn req(
    addr: SocketAddr,
    method: &str,
    path: &str,
    extra: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Resp {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in extra {
        write!(head, "{k}: {v}\r\n").unwrap();
    }
    if let Some(b) = body {
        write!(
            head,
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        )
        .unwrap();
    }
    head.push_str("\r\n");
    raw(addr, &head, body.unwrap_or_default())
}

fn get(addr: SocketAddr, path: &str) -> Resp {
    req(addr, "GET", path, &[], None)
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    req(addr, "POST", path, &[], Some(body.to_string().as_bytes()))
}

fn post_raw(addr: SocketAddr, path: &str, body: &[u8]) -> Resp {
    req(addr, "POST", path, &[], Some(body))
}

// -------------------------------------------------------------- backends

/// What a recording backend answers.
#[derive(Clone)]
enum Canned {
    /// `{"ok": true, "operation": op, "adapter_index": 99, "tag": tag}`
    /// (the 99 shows the server overwrites it).
    Ok,
    Err(ReconfigureError),
}

/// One recorded call: operation, payload, and what the owners hook said
/// about its `device_path`.
type Call = (String, Value, Option<Vec<String>>);

/// A backend that records its calls.
struct Recording {
    name: &'static str,
    tag: &'static str,
    canned: Mutex<Canned>,
    calls: Mutex<Vec<Call>>,
    /// When set: announce entry, then block until released.
    gate: Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>,
}

impl Recording {
    fn new(name: &'static str, tag: &'static str) -> Arc<Recording> {
        Arc::new(Recording {
            name,
            tag,
            canned: Mutex::new(Canned::Ok),
            calls: Mutex::new(Vec::new()),
            gate: Mutex::new(None),
        })
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn last(&self) -> (String, Value) {
        let c = self.calls();
        let (op, p, _) = c.last().expect("the backend was not called").clone();
        (op, p)
    }
}

impl Reconfigurable for Recording {
    fn backend(&self) -> &str {
        self.name
    }

    fn supported_operations(&self) -> Vec<String> {
        vec!["add".into(), "remove".into(), "resize".into()]
    }

    fn status(&self) -> Value {
        json!({ "tag": self.tag, "devices": [] })
    }

    fn reconfigure(
        &self,
        operation: &str,
        payload: &Value,
        owners: Owners<'_>,
    ) -> Result<Value, ReconfigureError> {
        let owned = match (owners, payload.get("device_path").and_then(Value::as_str)) {
            (Some(f), Some(p)) => Some(f(p)),
            _ => None,
        };
        self.calls
            .lock()
            .unwrap()
            .push((operation.to_string(), payload.clone(), owned));
        let gate = self.gate.lock().unwrap().take();
        if let Some((entered, release)) = gate {
            entered.send(()).unwrap();
            release.recv().unwrap();
        }
        match self.canned.lock().unwrap().clone() {
            Canned::Ok => Ok(json!({
                "ok": true,
                "operation": operation,
                "adapter_index": 99,
                "tag": self.tag,
            })),
            Canned::Err(e) => Err(e),
        }
    }
}

fn start(backends: &[Arc<Recording>]) -> HttpServer {
    start_with(HttpConfig::default(), backends, HttpHooks::default())
}

fn start_with(cfg: HttpConfig, backends: &[Arc<Recording>], hooks: HttpHooks) -> HttpServer {
    let mut reg = Registry::new();
    for b in backends {
        reg.register(Arc::clone(b) as Arc<dyn Reconfigurable>);
    }
    serve(cfg, reg, hooks).unwrap()
}

const BAD_SIZE: &str = "size must be a positive integer byte count or a string like '100GiB'";

// ------------------------------------------------------------- scenarios

/// docs/lmcache-dax-behavior.md §8.5 #1: status, then add / resize / remove pass the exact payloads,
/// on the latest routes and on the seed's.
#[test]
fn exact_payloads_pass_through() {
    let dax = Recording::new("dax", "a");
    let srv = start(&[Arc::clone(&dax)]);
    let a = srv.local_addr();
    for prefix in ["/reconfigure/dax/l2", "/reconfigure/dax"] {
        let st = get(a, &format!("{prefix}/status"));
        assert_eq!(st.status, 200, "{prefix}");
        assert_eq!(st.json()["num_adapters"], 1);

        let r = post(
            a,
            &format!("{prefix}/add"),
            &json!({"device_path": "/dev/dax0.0", "size": "2GiB"}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(
            dax.last(),
            (
                "add".into(),
                json!({"device_path": "/dev/dax0.0", "size_bytes": 2_147_483_648u64})
            )
        );
        assert_eq!(r.json()["ok"], true);

        let r = post(
            a,
            &format!("{prefix}/resize"),
            &json!({"device_path": "/dev/dax0.0", "size": "1536MiB", "force": true}),
        );
        assert_eq!(r.status, 200);
        assert_eq!(
            dax.last(),
            (
                "resize".into(),
                json!({"device_path": "/dev/dax0.0", "size_bytes": 1_610_612_736u64, "mode": "migrate", "force": true})
            )
        );

        let r = post(
            a,
            &format!("{prefix}/remove"),
            &json!({"device_path": "/dev/dax0.0", "mode": "drain"}),
        );
        assert_eq!(r.status, 200);
        assert_eq!(
            dax.last(),
            (
                "remove".into(),
                json!({"device_path": "/dev/dax0.0", "mode": "drain", "force": false})
            )
        );

        let r = post(
            a,
            &format!("{prefix}/add"),
            &json!({"device_path": "/dev/dax0.1", "size": 4096}),
        );
        assert_eq!(r.status, 200);
        assert_eq!(
            dax.last().1,
            json!({"device_path": "/dev/dax0.1", "size_bytes": 4096})
        );
    }
    srv.shutdown();
}

/// docs/lmcache-dax-behavior.md §8.5 #2, #3: status keeps `{backend}`'s adapters with backend-local
/// `adapter_index` and generic `l2_adapter_index`; a POST's local index
/// reaches the right adapter and answers with the generic one.
#[test]
fn status_filtering_and_index_translation() {
    let fake = Recording::new("fake", "f");
    let d0 = Recording::new("dax", "d0");
    let other = Recording::new("other", "o");
    let d1 = Recording::new("dax", "d1");
    let srv = start(&[Arc::clone(&fake), Arc::clone(&d0), other, Arc::clone(&d1)]);
    let a = srv.local_addr();

    let st = get(a, "/reconfigure/dax/l2/status").json();
    assert_eq!(st["enabled"], true);
    assert_eq!(st["backend"], "dax");
    assert_eq!(st["num_adapters"], 2);
    let ad = st["adapters"].as_array().unwrap();
    assert_eq!(ad.len(), 2);
    for (i, (generic, tag)) in [(1, "d0"), (3, "d1")].into_iter().enumerate() {
        assert_eq!(ad[i]["backend"], "dax");
        assert_eq!(ad[i]["adapter_index"], i);
        assert_eq!(ad[i]["l2_adapter_index"], generic);
        assert_eq!(ad[i]["status"]["tag"], tag);
        assert_eq!(
            ad[i]["supported_operations"],
            json!(["add", "remove", "resize"])
        );
    }
    // The seed route and a case / space variant answer the same.
    assert_eq!(get(a, "/reconfigure/dax/status").json(), st);
    assert_eq!(get(a, "/reconfigure/%20DAX%20/l2/STATUS").json(), st);

    let r = post(
        a,
        "/reconfigure/dax/l2/remove",
        &json!({"adapter_index": 1, "device_path": "/dev/dax1.0"}),
    );
    assert_eq!(r.status, 200);
    let body = r.json();
    assert_eq!(body["tag"], "d1");
    // Upstream's quirk: the generic index, not the local 1 sent (nor the
    // backend's own 99).
    assert_eq!(body["adapter_index"], 3);
    assert!(d0.calls().is_empty());
    assert_eq!(d1.calls().len(), 1);

    for idx in [json!(2), json!(-1), json!(u64::MAX)] {
        let r = post(
            a,
            "/reconfigure/dax/l2/remove",
            &json!({"adapter_index": idx, "device_path": "p"}),
        );
        assert_eq!(r.status, 404, "{idx}");
        assert_eq!(r.json(), json!({"error": "dax adapter not found"}));
    }

    // An unknown backend's status: 200, disabled, no adapters.
    let st = get(a, "/reconfigure/nosuch/l2/status").json();
    assert_eq!(
        st,
        json!({"enabled": false, "backend": "nosuch", "num_adapters": 0, "adapters": []})
    );
    assert!(fake.calls().is_empty());
}

fn detail_types(r: &Resp) -> Vec<(String, Value)> {
    assert_eq!(r.status, 422, "{}", r.text());
    r.json()["detail"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            assert!(d["msg"].is_string());
            assert!(d.get("input").is_some());
            (d["type"].as_str().unwrap().to_string(), d["loc"].clone())
        })
        .collect()
}

/// docs/lmcache-dax-behavior.md §8.5 #4, #5, #7 and the missing `device_path`: FastAPI-shaped 422s,
/// and the backend never called.
#[test]
fn schema_violations_are_422() {
    let dax = Recording::new("dax", "a");
    let srv = start(&[Arc::clone(&dax)]);
    let a = srv.local_addr();
    let add = "/reconfigure/dax/l2/add";

    let r = post(
        a,
        add,
        &json!({"device_path": "/dev/dax0.0", "size_bytes": 4096}),
    );
    let t = detail_types(&r);
    assert!(
        t.contains(&("extra_forbidden".into(), json!(["body", "size_bytes"]))),
        "{t:?}"
    );
    assert!(
        t.contains(&("missing".into(), json!(["body", "size"]))),
        "{t:?}"
    );

    let r = post(a, add, &json!({"device_path": "/dev/dax0.0", "size": true}));
    assert_eq!(
        detail_types(&r),
        [
            ("int_type".into(), json!(["body", "size", "int"])),
            ("string_type".into(), json!(["body", "size", "str"]))
        ]
    );
    let r = post(
        a,
        add,
        &json!({"device_path": "/dev/dax0.0", "size": 4096.0}),
    );
    assert_eq!(detail_types(&r)[0].0, "int_type");

    let r = post(
        a,
        "/reconfigure/dax/l2/remove",
        &json!({"device_path": "/dev/dax0.0", "timeout_s": 30}),
    );
    assert_eq!(
        detail_types(&r),
        [("extra_forbidden".into(), json!(["body", "timeout_s"]))]
    );

    let r = post(
        a,
        "/reconfigure/dax/l2/resize",
        &json!({"device_path": "/dev/dax0.0", "size": "1GiB", "mode": "drain"}),
    );
    assert_eq!(
        detail_types(&r),
        [("literal_error".into(), json!(["body", "mode"]))]
    );
    assert_eq!(r.json()["detail"][0]["input"], "drain");

    let r = post(a, add, &json!({"size": "1GiB"}));
    assert_eq!(
        detail_types(&r),
        [("missing".into(), json!(["body", "device_path"]))]
    );

    // The seed routes take the same schema.
    let r = post(
        a,
        "/reconfigure/dax/add",
        &json!({"device_path": "p", "size": 1, "timeout_s": 1}),
    );
    assert_eq!(
        detail_types(&r),
        [("extra_forbidden".into(), json!(["body", "timeout_s"]))]
    );

    // Not JSON, not an object, no body.
    let r = post_raw(a, add, b"{\"device_path\": ");
    assert_eq!(detail_types(&r)[0].0, "json_invalid");
    let r = post_raw(a, add, b"[1, 2]");
    assert_eq!(
        detail_types(&r),
        [("model_attributes_type".into(), json!(["body"]))]
    );
    let r = post_raw(a, add, b"");
    assert_eq!(detail_types(&r), [("missing".into(), json!(["body"]))]);
    let r = post_raw(a, "/reconfigure/fake/l2/x", b"nope");
    assert_eq!(detail_types(&r)[0].0, "json_invalid");

    assert!(dax.calls().is_empty());
}

/// docs/lmcache-dax-behavior.md §8.5 #4, #6: a bad size is 400 with a fixed message, never echoed,
/// never reaching the backend.
#[test]
fn bad_sizes_are_400_and_not_echoed() {
    let dax = Recording::new("dax", "a");
    let srv = start(&[Arc::clone(&dax)]);
    let a = srv.local_addr();
    let patho = format!("1{}GiB<script>'; DROP TABLE devices; --", "0".repeat(200));
    for size in [
        json!("many"),
        json!(patho),
        json!("1.5.GiB"),
        json!(""),
        json!("0"),
        json!(0),
        json!(-4096),
        json!("16777216TiB"),
    ] {
        for (route, extra) in [
            ("/reconfigure/dax/l2/add", json!({})),
            ("/reconfigure/dax/l2/resize", json!({"mode": "evict"})),
            ("/reconfigure/dax/add", json!({})),
        ] {
            let mut body = json!({"device_path": "/dev/dax0.0", "size": size});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let r = post(a, route, &body);
            assert_eq!(r.status, 400, "{size} {route}");
            assert_eq!(r.json(), json!({ "error": BAD_SIZE }));
            assert!(!r.text().contains("DROP"));
        }
    }
    assert!(dax.calls().is_empty());
}

/// docs/lmcache-dax-behavior.md §8.5 #8: a domain error keeps its status and payload.
#[test]
fn domain_errors_pass_through() {
    let dax = Recording::new("dax", "a");
    let body = json!({"error": "not enough capacity", "needed_bytes": 123, "free_bytes": 7});
    *dax.canned.lock().unwrap() = Canned::Err(ReconfigureError::with_body(507, body.clone()));
    let srv = start(&[Arc::clone(&dax)]);
    let r = post(
        srv.local_addr(),
        "/reconfigure/dax/l2/remove",
        &json!({"device_path": "/dev/dax0.0", "mode": "migrate"}),
    );
    assert_eq!(r.status, 507);
    assert_eq!(r.json(), body);

    *dax.canned.lock().unwrap() = Canned::Err(ReconfigureError::msg(
        409,
        "physical device is already mapped by L1",
    ));
    let r = post(
        srv.local_addr(),
        "/reconfigure/dax/l2/add",
        &json!({"device_path": "/dev/dax0.0", "size": "1G"}),
    );
    assert_eq!(r.status, 409);
    assert_eq!(
        r.json(),
        json!({"error": "physical device is already mapped by L1"})
    );
}

/// docs/lmcache-dax-behavior.md §8.5 #9, #10: a generic backend gets the body minus `adapter_index`;
/// an unknown backend is 404 `"<backend> adapter not found"`.
#[test]
fn generic_backends_and_unknown_ones() {
    let fake = Recording::new("fake", "f");
    let srv = start(&[Arc::clone(&fake)]);
    let a = srv.local_addr();
    let body =
        json!({"adapter_index": 0, "anything": [1, {"x": null}], "size": true, "timeout_s": 3});
    let r = post(a, "/reconfigure/fake/l2/Flush", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["adapter_index"], 0);
    assert_eq!(
        fake.last(),
        (
            "flush".into(),
            json!({"anything": [1, {"x": null}], "size": true, "timeout_s": 3})
        )
    );
    let r = post(
        a,
        "/reconfigure/fake/l2/flush",
        &json!({"adapter_index": 1}),
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json(), json!({"error": "fake adapter not found"}));
    let r = post(
        a,
        "/reconfigure/fake/l2/flush",
        &json!({"adapter_index": "0"}),
    );
    assert_eq!(
        detail_types(&r),
        [("int_type".into(), json!(["body", "adapter_index"]))]
    );
    drop(srv);

    // No "fake" registered at all.
    let dax = Recording::new("dax", "a");
    let srv = start(&[dax]);
    let r = post(
        srv.local_addr(),
        "/reconfigure/fake/l2/add",
        &json!({"device_path": "p"}),
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json(), json!({"error": "fake adapter not found"}));
    let r = post(srv.local_addr(), "/reconfigure/Fake/l2/add", &json!({}));
    assert_eq!(r.json(), json!({"error": "fake adapter not found"}));
}

/// Path normalization: empty backend / operation, unsupported DAX
/// operations, a POSTed status, upper case, unknown routes and methods.
#[test]
fn routes_and_path_rules() {
    let dax = Recording::new("dax", "a");
    let srv = start(&[Arc::clone(&dax)]);
    let a = srv.local_addr();
    let r = get(a, "/reconfigure/%20/l2/status");
    assert_eq!(
        (r.status, r.json()),
        (400, json!({"error": "backend must be non-empty"}))
    );
    let r = post(a, "/reconfigure/%20%09/l2/add", &json!({}));
    assert_eq!(
        (r.status, r.json()),
        (400, json!({"error": "backend must be non-empty"}))
    );
    let r = post(a, "/reconfigure/dax/l2/%20", &json!({}));
    assert_eq!(
        (r.status, r.json()),
        (400, json!({"error": "operation must be non-empty"}))
    );
    for op in ["status", "Flush"] {
        let r = post(a, &format!("/reconfigure/dax/l2/{op}"), &json!({}));
        assert_eq!(r.status, 400);
        assert_eq!(
            r.json(),
            json!({ "error": format!("unsupported dax reconfigure operation: {}", op.to_lowercase()) })
        );
    }
    let r = post(
        a,
        "/reconfigure/dax/l2/ADD",
        &json!({"device_path": "/d", "size": "1k"}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        dax.last(),
        (
            "add".into(),
            json!({"device_path": "/d", "size_bytes": 1024})
        )
    );

    let r = get(a, "/reconfigure/dax/l2/add");
    assert_eq!(
        (r.status, r.json()),
        (405, json!({"error": "method not allowed"}))
    );
    let r = req(a, "DELETE", "/reconfigure/dax/l2/status", &[], None);
    assert_eq!(r.status, 405);
    assert!(r.json()["error"].is_string());
    for path in [
        "/",
        "/reconfigure",
        "/reconfigure/dax/l1/x/y",
        "/dax/status",
    ] {
        let r = get(a, path);
        assert_eq!(
            (r.status, r.json()),
            (404, json!({"error": "not found"})),
            "{path}"
        );
    }
    // Bad percent-encoding in a path parameter: our 400, not axum's text.
    let r = get(a, "/reconfigure/%FF/l2/status");
    assert_eq!(r.status, 400);
    assert!(r.json()["error"].is_string());
}

/// docs/lmcache-dax-behavior.md §8.5 #12, improved: a status request, `/health` and `/metrics` answer
/// at once while a mutation blocks; the mutation answers when it completes.
#[test]
fn status_answers_while_a_mutation_blocks() {
    let dax = Recording::new("dax", "a");
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    *dax.gate.lock().unwrap() = Some((entered_tx, release_rx));
    let hooks = HttpHooks {
        metrics: Some(Arc::new(|| "daxkv_up 1\n".to_string())),
        ..HttpHooks::default()
    };
    let srv = start_with(HttpConfig::default(), &[Arc::clone(&dax)], hooks);
    let a = srv.local_addr();

    let (done_tx, done_rx) = mpsc::channel();
    let mutation = std::thread::spawn(move || {
        let r = post(
            a,
            "/reconfigure/dax/l2/remove",
            &json!({"device_path": "/dev/dax0.0"}),
        );
        done_tx.send(()).unwrap();
        r
    });
    entered_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the backend was never called");

    for _ in 0..3 {
        let t = Instant::now();
        let st = get(a, "/reconfigure/dax/l2/status");
        assert_eq!(st.status, 200);
        assert_eq!(st.json()["num_adapters"], 1);
        assert_eq!(get(a, "/reconfigure/dax/status").status, 200);
        assert_eq!(get(a, "/health").status, 200);
        assert_eq!(get(a, "/metrics").text(), "daxkv_up 1\n");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }
    // Another mutation may run meanwhile (a permit is free); it does not
    // wait for the blocked one either.
    let r = post(
        a,
        "/reconfigure/dax/l2/add",
        &json!({"device_path": "/dev/dax1.0", "size": 1}),
    );
    assert_eq!(r.status, 200);
    // The blocked one has not answered yet.
    assert!(done_rx.recv_timeout(Duration::from_millis(200)).is_err());

    release_tx.send(()).unwrap();
    let r = mutation.join().unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["operation"], "remove");
    srv.shutdown();
}

/// Mutations beyond `max_concurrent_mutations` wait for a permit without
/// blocking status.
#[test]
fn mutations_past_the_cap_wait() {
    let dax = Recording::new("dax", "a");
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    *dax.gate.lock().unwrap() = Some((entered_tx, release_rx));
    let cfg = HttpConfig {
        max_concurrent_mutations: 1,
        ..HttpConfig::default()
    };
    let srv = start_with(cfg, &[Arc::clone(&dax)], HttpHooks::default());
    let a = srv.local_addr();
    let first = std::thread::spawn(move || {
        post(
            a,
            "/reconfigure/dax/l2/remove",
            &json!({"device_path": "/a"}),
        )
    });
    entered_rx.recv_timeout(Duration::from_secs(20)).unwrap();
    let (done_tx, done_rx) = mpsc::channel();
    let second = std::thread::spawn(move || {
        let r = post(
            a,
            "/reconfigure/dax/l2/remove",
            &json!({"device_path": "/b"}),
        );
        done_tx.send(()).unwrap();
        r
    });
    assert!(done_rx.recv_timeout(Duration::from_millis(300)).is_err());
    assert_eq!(dax.calls().len(), 1);
    assert_eq!(get(a, "/reconfigure/dax/l2/status").status, 200);
    release_tx.send(()).unwrap();
    assert_eq!(first.join().unwrap().status, 200);
    assert_eq!(second.join().unwrap().status, 200);
    assert_eq!(dax.calls().len(), 2);
}

#[test]
fn bearer_token() {
    let dax = Recording::new("dax", "a");
    let cfg = HttpConfig {
        token: Some("s3cret-t0ken".into()),
        ..HttpConfig::default()
    };
    let hooks = HttpHooks {
        metrics: Some(Arc::new(String::new)),
        ..HttpHooks::default()
    };
    let srv = start_with(cfg, &[Arc::clone(&dax)], hooks);
    let a = srv.local_addr();
    let body = json!({"device_path": "/dev/dax0.0", "size": "1G"}).to_string();
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("Bearer s3cret-t0ke"),
        Some("Basic s3cret-t0ken"),
        Some("s3cret-t0ken"),
    ] {
        let h: Vec<(&str, &str)> = auth.iter().map(|v| ("Authorization", *v)).collect();
        for (m, p, b) in [
            ("POST", "/reconfigure/dax/l2/add", Some(body.as_bytes())),
            ("GET", "/reconfigure/dax/l2/status", None),
            ("GET", "/reconfigure/dax/status", None),
            ("GET", "/metrics", None),
            ("GET", "/nowhere", None),
        ] {
            let r = req(a, m, p, &h, b);
            assert_eq!(r.status, 401, "{auth:?} {p}");
            assert_eq!(r.json(), json!({"error": "unauthorized"}));
            assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        }
    }
    assert!(dax.calls().is_empty());
    // /health needs no token.
    assert_eq!(get(a, "/health").status, 200);
    let h = [("Authorization", "Bearer s3cret-t0ken")];
    assert_eq!(
        req(a, "GET", "/reconfigure/dax/l2/status", &h, None).status,
        200
    );
    assert_eq!(req(a, "GET", "/metrics", &h, None).status, 200);
    let r = req(
        a,
        "POST",
        "/reconfigure/dax/l2/add",
        &h,
        Some(body.as_bytes()),
    );
    assert_eq!(r.status, 200);
    assert_eq!(dax.calls().len(), 1);
}

#[test]
fn allow_list_guards_add() {
    let dir = tempfile::tempdir().unwrap();
    let devs = dir.path().join("devs");
    std::fs::create_dir(&devs).unwrap();
    std::fs::write(devs.join("dax0"), b"").unwrap();
    std::os::unix::fs::symlink("/etc", devs.join("escape")).unwrap();
    let dax = Recording::new("dax", "a");
    let cfg = HttpConfig {
        allow_prefixes: vec![devs.clone()],
        ..HttpConfig::default()
    };
    let srv = start_with(cfg, &[Arc::clone(&dax)], HttpHooks::default());
    let a = srv.local_addr();
    let add = |p: &str| {
        post(
            a,
            "/reconfigure/dax/l2/add",
            &json!({"device_path": p, "size": "2MiB"}),
        )
    };

    let inside = devs.join("dax0");
    let r = add(inside.to_str().unwrap());
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(dax.last().1["device_path"], inside.to_str().unwrap());
    assert_eq!(add(devs.join("not-yet").to_str().unwrap()).status, 200);

    let outside = [
        "/etc/passwd".to_string(),
        format!("{}/../x", devs.display()),
        format!("{}/escape/passwd", devs.display()),
        format!("{}x/dax0", devs.display()),
        "devs/dax0".to_string(),
        String::new(),
    ];
    for p in &outside {
        let r = add(p);
        assert_eq!(r.status, 403, "{p}");
        assert_eq!(r.json(), json!({"error": "device path not allowed"}));
    }
    assert_eq!(dax.calls().len(), 2);
    // remove / resize name devices already attached: not checked.
    let r = post(
        a,
        "/reconfigure/dax/l2/remove",
        &json!({"device_path": "/etc/passwd"}),
    );
    assert_eq!(r.status, 200);
}

#[test]
fn body_limit_is_413() {
    let dax = Recording::new("dax", "a");
    let cfg = HttpConfig {
        body_limit: 1024,
        ..HttpConfig::default()
    };
    let srv = start_with(cfg, &[Arc::clone(&dax)], HttpHooks::default());
    let a = srv.local_addr();
    let big = json!({"device_path": "x".repeat(2000), "size": 1}).to_string();
    // Declared too long: answered before the body is read.
    let head = format!(
        "POST /reconfigure/dax/l2/add HTTP/1.1\r\nHost: {a}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        big.len()
    );
    let r = raw(a, &head, b"");
    assert_eq!(r.status, 413);
    assert_eq!(r.json(), json!({"error": "request body too large"}));
    // Chunked, no declared length: cut off while reading.
    let mut chunked = String::new();
    for c in big.as_bytes().chunks(300) {
        write!(
            chunked,
            "{:x}\r\n{}\r\n",
            c.len(),
            std::str::from_utf8(c).unwrap()
        )
        .unwrap();
    }
    chunked.push_str("0\r\n\r\n");
    let head = format!(
        "POST /reconfigure/dax/l2/add HTTP/1.1\r\nHost: {a}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    );
    let r = raw(a, &head, chunked.as_bytes());
    assert_eq!(r.status, 413);
    assert_eq!(r.json(), json!({"error": "request body too large"}));
    // Under the limit: fine.
    let r = post(
        a,
        "/reconfigure/dax/l2/add",
        &json!({"device_path": "/d", "size": 1}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(dax.calls().len(), 1);
}

#[test]
fn health_and_metrics() {
    let srv = start(&[]);
    let a = srv.local_addr();
    let r = get(a, "/health");
    assert_eq!((r.status, r.json()), (200, json!({"status": "ok"})));
    let r = get(a, "/metrics");
    assert_eq!((r.status, r.json()), (404, json!({"error": "not found"})));
    drop(srv);

    let healthy = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let h = Arc::clone(&healthy);
    let hooks = HttpHooks {
        metrics: Some(Arc::new(|| {
            "# TYPE daxkv_devices gauge\ndaxkv_devices 2\n".to_string()
        })),
        health: Some(Arc::new(move || {
            if h.load(std::sync::atomic::Ordering::SeqCst) {
                Ok(None)
            } else {
                Err("device 0 (memfd) failed".to_string())
            }
        })),
        owners: None,
    };
    let srv = start_with(HttpConfig::default(), &[], hooks);
    let a = srv.local_addr();
    let r = get(a, "/metrics");
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    assert_eq!(r.text(), "# TYPE daxkv_devices gauge\ndaxkv_devices 2\n");
    assert_eq!(get(a, "/health").status, 200);
    healthy.store(false, std::sync::atomic::Ordering::SeqCst);
    let r = get(a, "/health");
    assert_eq!(
        (r.status, r.json()),
        (
            503,
            json!({"status": "unhealthy", "reason": "device 0 (memfd) failed"})
        )
    );
}

/// The owners hook reaches the backend, asked for the generic index.
#[test]
fn owners_hook_reaches_the_backend() {
    let other = Recording::new("other", "o");
    let dax = Recording::new("dax", "a");
    let asked = Arc::new(Mutex::new(Vec::new()));
    let asked2 = Arc::clone(&asked);
    let hooks = HttpHooks {
        owners: Some(Arc::new(move |generic, path: &str| {
            asked2.lock().unwrap().push((generic, path.to_string()));
            if path == "/dev/shared" {
                vec!["L1".to_string()]
            } else {
                Vec::new()
            }
        })),
        ..HttpHooks::default()
    };
    let srv = start_with(HttpConfig::default(), &[other, Arc::clone(&dax)], hooks);
    let r = post(
        srv.local_addr(),
        "/reconfigure/dax/l2/add",
        &json!({"device_path": "/dev/shared", "size": 1}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(dax.calls()[0].2, Some(vec!["L1".to_string()]));
    assert_eq!(*asked.lock().unwrap(), [(1, "/dev/shared".to_string())]);
}

#[test]
fn non_loopback_is_refused_unless_allowed() {
    for addr in ["0.0.0.0:0", "[::]:0", "192.0.2.1:8080"] {
        let cfg = HttpConfig {
            addr: addr.parse().unwrap(),
            ..HttpConfig::default()
        };
        match serve(cfg, Registry::new(), HttpHooks::default()) {
            Err(HttpError::NonLoopback(a)) => assert_eq!(a.to_string(), addr),
            other => panic!("{addr}: {other:?}"),
        }
    }
    let cfg = HttpConfig {
        addr: "0.0.0.0:0".parse().unwrap(),
        allow_non_loopback: true,
        token: Some("t".into()),
        ..HttpConfig::default()
    };
    let srv = serve(cfg, Registry::new(), HttpHooks::default()).unwrap();
    let port = srv.local_addr().port();
    assert_eq!(
        get(SocketAddr::from(([127, 0, 0, 1], port)), "/health").status,
        200
    );
    srv.shutdown();

    for bad in [
        HttpConfig {
            token: Some(String::new()),
            ..HttpConfig::default()
        },
        HttpConfig {
            token: Some("has space".into()),
            ..HttpConfig::default()
        },
        HttpConfig {
            body_limit: 0,
            ..HttpConfig::default()
        },
        HttpConfig {
            allow_prefixes: vec!["relative/missing".into()],
            ..HttpConfig::default()
        },
    ] {
        assert!(matches!(
            serve(bad, Registry::new(), HttpHooks::default()),
            Err(HttpError::Config(_))
        ));
    }
}

#[test]
fn shutdown_closes_the_port() {
    let srv = start(&[]);
    let a = srv.local_addr();
    assert_eq!(get(a, "/health").status, 200);
    // A keep-alive connection left open does not hold shutdown up.
    let mut idle = TcpStream::connect(a).unwrap();
    write!(idle, "GET /health HTTP/1.1\r\nHost: {a}\r\n\r\n").unwrap();
    let t = Instant::now();
    srv.shutdown();
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    assert!(TcpStream::connect(a).is_err());

    // Drop shuts down too.
    let srv = start(&[]);
    let a = srv.local_addr();
    drop(srv);
    assert!(TcpStream::connect(a).is_err());
}

/// A mutation that never finishes holds shutdown up for `shutdown_grace`
/// only; the operation goes on to its end on its own thread.
#[test]
fn shutdown_does_not_wait_for_a_blocked_mutation_forever() {
    let dax = Recording::new("dax", "a");
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    *dax.gate.lock().unwrap() = Some((entered_tx, release_rx));
    let cfg = HttpConfig {
        shutdown_grace: Duration::from_millis(300),
        ..HttpConfig::default()
    };
    let srv = start_with(cfg, &[Arc::clone(&dax)], HttpHooks::default());
    let a = srv.local_addr();
    let client = std::thread::spawn(move || {
        let mut s = TcpStream::connect(a).unwrap();
        let body = json!({"device_path": "/d"}).to_string();
        write!(
            s,
            "POST /reconfigure/dax/l2/remove HTTP/1.1\r\nHost: {a}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut buf = Vec::new();
        // The connection is closed without an answer (or reset).
        let _ = s.read_to_end(&mut buf);
        buf
    });
    entered_rx.recv_timeout(Duration::from_secs(20)).unwrap();
    let t = Instant::now();
    srv.shutdown();
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(250), "{took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(client.join().unwrap().is_empty());
    assert!(TcpStream::connect(a).is_err());
    release_tx.send(()).unwrap();
    assert_eq!(dax.calls().len(), 1);
}

// ------------------------------------------------------------- browsers

/// A POST with exactly these header lines (no `Content-Type` unless
/// given), as a browser's form or `fetch` could send it.
fn post_with(addr: SocketAddr, path: &str, lines: &[&str], body: &[u8]) -> Resp {
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for l in lines {
        head.push_str(l);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    raw(addr, &head, body)
}

/// A GET with exactly these header lines.
fn get_with(addr: SocketAddr, path: &str, lines: &[&str]) -> Resp {
    let mut head = format!("GET {path} HTTP/1.1\r\nConnection: close\r\n");
    for l in lines {
        head.push_str(l);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    raw(addr, &head, b"")
}

const CT_REFUSED: &str = "Content-Type must be application/json";

/// Cross-site request forgery by content type: a form (urlencoded or
/// multipart), `text/plain`, or an untyped body (a `fetch` of a Blob sends
/// none) needs no CORS preflight, so every mutating route refuses all of
/// them with 415 before reading the body; the backend is never called.
#[test]
fn mutations_need_a_json_content_type() {
    let dax = Recording::new("dax", "a");
    let fake = Recording::new("fake", "f");
    let srv = start(&[Arc::clone(&dax), Arc::clone(&fake)]);
    let a = srv.local_addr();
    let host = format!("Host: {a}");
    let body = json!({"device_path": "/dev/shm/x", "size": "1GiB"}).to_string();
    for route in [
        "/reconfigure/dax/l2/add",
        "/reconfigure/dax/l2/remove",
        "/reconfigure/dax/l2/resize",
        "/reconfigure/dax/add",
        "/reconfigure/fake/l2/flush",
    ] {
        for ct in [
            None,
            Some("Content-Type: text/plain"),
            Some("Content-Type: text/plain;charset=UTF-8"),
            Some("Content-Type: application/x-www-form-urlencoded"),
            Some("Content-Type: multipart/form-data; boundary=xyz"),
            Some("Content-Type: application/jsonp"),
            Some("Content-Type: "),
        ] {
            let mut lines = vec![host.as_str()];
            lines.extend(ct);
            let r = post_with(a, route, &lines, body.as_bytes());
            assert_eq!(r.status, 415, "{route} {ct:?}: {}", r.text());
            assert_eq!(r.json(), json!({ "error": CT_REFUSED }));
        }
        let r = post_with(
            a,
            route,
            &[
                &host,
                "Content-Type: application/json",
                "Content-Type: text/plain",
            ],
            body.as_bytes(),
        );
        assert_eq!(r.status, 415, "{route}: two Content-Types");
    }
    assert!(dax.calls().is_empty());
    assert!(fake.calls().is_empty());
    // JSON with parameters, in any case, passes.
    let r = post_with(
        a,
        "/reconfigure/dax/l2/add",
        &[&host, "Content-Type: Application/JSON; charset=utf-8"],
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(dax.calls().len(), 1);
}

/// DNS rebinding and cross-site pages: a `Host` that is not ours, an
/// `Origin` of another site (or `null`), `Sec-Fetch-Site: cross-site` are
/// 403 on every route but `/health`, mutations and reads alike; ours pass.
#[test]
fn foreign_hosts_and_cross_site_origins_are_403() {
    let dax = Recording::new("dax", "a");
    let hooks = HttpHooks {
        metrics: Some(Arc::new(|| "daxkv_up 1\n".to_string())),
        ..HttpHooks::default()
    };
    let srv = start_with(HttpConfig::default(), &[Arc::clone(&dax)], hooks);
    let a = srv.local_addr();
    let port = a.port();
    let ct = "Content-Type: application/json";
    let body = json!({"device_path": "/dev/shm/x", "size": 4096}).to_string();
    let add = "/reconfigure/dax/l2/add";
    let mut allowed_posts = 0;

    let foreign_hosts = [
        format!("evil.example:{port}"),
        format!("127.0.0.1:{}", port.wrapping_add(1)),
        format!("localhost.:{port}"),
        format!("127.0.0.1.evil.example:{port}"),
        format!("0.0.0.0:{port}"),
        "127.0.0.1".to_string(),
        "localhost".to_string(),
        format!("user@127.0.0.1:{port}"),
    ];
    for h in &foreign_hosts {
        let host = format!("Host: {h}");
        let r = post_with(a, add, &[&host, ct], body.as_bytes());
        assert_eq!(r.status, 403, "{h}: {}", r.text());
        assert!(r.json()["error"]
            .as_str()
            .unwrap()
            .starts_with("Host not allowed"));
        for path in [
            "/reconfigure/dax/l2/status",
            "/reconfigure/dax/status",
            "/metrics",
        ] {
            assert_eq!(get_with(a, path, &[&host]).status, 403, "{h} {path}");
        }
        // /health answers whoever asks (as without the token).
        assert_eq!(get_with(a, "/health", &[&host]).status, 200, "{h}");
    }
    let host = format!("Host: {a}");
    let foreign_origins = [
        "http://evil.example".to_string(),
        "null".to_string(),
        format!("https://127.0.0.1:{port}"),
        format!("http://127.0.0.1:{}", port.wrapping_add(1)),
        "http://localhost".to_string(),
        format!("http://evil.example:{port}"),
        "file://".to_string(),
    ];
    for o in &foreign_origins {
        let origin = format!("Origin: {o}");
        let r = post_with(a, add, &[&host, ct, &origin], body.as_bytes());
        assert_eq!(r.status, 403, "{o}: {}", r.text());
        assert_eq!(
            r.json(),
            json!({"error": "cross-site request refused (Origin)"})
        );
        let r = get_with(a, "/reconfigure/dax/l2/status", &[&host, &origin]);
        assert_eq!(r.status, 403, "{o}");
    }
    for site in ["cross-site", "same-site", "Cross-Site"] {
        let h = format!("Sec-Fetch-Site: {site}");
        let r = post_with(a, add, &[&host, ct, &h], body.as_bytes());
        assert_eq!(r.status, 403, "{site}");
    }
    assert!(dax.calls().is_empty());

    // Ours: every loopback spelling at our port, our origins, a request a
    // page of our own origin would send.
    for h in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("LocalHost:{port}"),
        format!("[::1]:{port}"),
    ] {
        let host = format!("Host: {h}");
        let r = post_with(a, add, &[&host, ct], body.as_bytes());
        assert_eq!(r.status, 200, "{h}: {}", r.text());
        allowed_posts += 1;
        assert_eq!(get_with(a, "/metrics", &[&host]).status, 200, "{h}");
    }
    for o in [
        format!("http://127.0.0.1:{port}"),
        format!("http://localhost:{port}"),
        format!("http://[::1]:{port}"),
    ] {
        let origin = format!("Origin: {o}");
        for site in ["same-origin", "none"] {
            let s = format!("Sec-Fetch-Site: {site}");
            let r = post_with(a, add, &[&host, ct, &origin, &s], body.as_bytes());
            assert_eq!(r.status, 200, "{o} {site}: {}", r.text());
            allowed_posts += 1;
        }
    }
    assert_eq!(dax.calls().len(), allowed_posts);
}

/// No `Host`: HTTP/1.1 requires one (400); HTTP/1.0 may omit it, and no
/// browser does, so it passes. Two `Host`s: 400. An absolute-form target
/// names its authority too.
#[test]
fn requests_without_exactly_one_host_of_ours() {
    let srv = start(&[Recording::new("dax", "a")]);
    let a = srv.local_addr();
    let port = a.port();
    let host = format!("Host: {a}");
    let r = raw(
        a,
        "GET /reconfigure/dax/l2/status HTTP/1.1\r\nConnection: close\r\n\r\n",
        b"",
    );
    assert_eq!(
        (r.status, r.json()),
        (400, json!({"error": "missing Host header"}))
    );
    let r = raw(a, "GET /reconfigure/dax/l2/status HTTP/1.0\r\n\r\n", b"");
    assert_eq!(r.status, 200, "{}", r.text());
    let r = get_with(
        a,
        "/reconfigure/dax/l2/status",
        &[&host, "Host: evil.example"],
    );
    assert_eq!(r.status, 400);
    let r = raw(
        a,
        &format!("GET http://evil.example:{port}/reconfigure/dax/l2/status HTTP/1.1\r\n{host}\r\nConnection: close\r\n\r\n"),
        b"",
    );
    assert_eq!(r.status, 403);
}

/// `allow_hosts` admits the names a non-loopback listener is reached by;
/// an entry that is no authority is a config error naming it.
#[test]
fn allow_hosts_admits_configured_names() {
    let dax = Recording::new("dax", "a");
    let cfg = HttpConfig {
        allow_hosts: vec!["kv.internal".into(), "10.9.8.7:9999".into()],
        ..HttpConfig::default()
    };
    let srv = start_with(cfg, &[Arc::clone(&dax)], HttpHooks::default());
    let a = srv.local_addr();
    let port = a.port();
    let st = "/reconfigure/dax/l2/status";
    for (h, code) in [
        (format!("kv.internal:{port}"), 200),
        (format!("KV.Internal:{port}"), 200),
        ("10.9.8.7:9999".to_string(), 200),
        ("kv.internal:1".to_string(), 403),
        (format!("10.9.8.7:{port}"), 403),
    ] {
        let host = format!("Host: {h}");
        assert_eq!(get_with(a, st, &[&host]).status, code, "{h}");
    }
    let origin = format!("Origin: http://kv.internal:{port}");
    let host = format!("Host: kv.internal:{port}");
    let r = post_with(
        a,
        "/reconfigure/dax/l2/remove",
        &[&host, &origin, "Content-Type: application/json"],
        br#"{"device_path": "/d"}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    drop(srv);
    for bad in ["kv internal", "http://kv", "kv:99999", ""] {
        let cfg = HttpConfig {
            allow_hosts: vec![bad.into()],
            ..HttpConfig::default()
        };
        match serve(cfg, Registry::new(), HttpHooks::default()) {
            Err(HttpError::Config(m)) => {
                assert!(
                    m.contains("allow_hosts") && m.contains(&format!("{bad:?}")),
                    "{m}"
                );
            }
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

// ----------------------------------------------------------- connections

/// Read until the server closes (or resets) the connection, within 20 s;
/// `None` if it kept it open that long.
fn read_until_closed(s: &mut TcpStream) -> Option<Vec<u8>> {
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => return Some(buf),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return Some(buf),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return None
            }
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// A connection that sends nothing, half a head, or stays idle after an
/// answer is closed after `header_read_timeout`; a body that does not
/// arrive is 408 after `body_read_timeout`, and the backend never sees it.
#[test]
fn idle_and_slow_connections_are_closed() {
    let dax = Recording::new("dax", "a");
    let cfg = HttpConfig {
        header_read_timeout: Duration::from_millis(300),
        body_read_timeout: Duration::from_millis(300),
        ..HttpConfig::default()
    };
    let srv = start_with(cfg, &[Arc::clone(&dax)], HttpHooks::default());
    let a = srv.local_addr();

    let mut silent = TcpStream::connect(a).unwrap();
    let got = read_until_closed(&mut silent).expect("a silent connection was kept open");
    assert!(
        got.is_empty() || got.starts_with(b"HTTP/1.1 408"),
        "{got:?}"
    );

    let mut half = TcpStream::connect(a).unwrap();
    half.write_all(b"GET /health HTTP/1.1\r\nHost: ").unwrap();
    assert!(
        read_until_closed(&mut half).is_some(),
        "a half-sent head was kept open"
    );

    let mut keep = TcpStream::connect(a).unwrap();
    write!(keep, "GET /health HTTP/1.1\r\nHost: {a}\r\n\r\n").unwrap();
    let got = read_until_closed(&mut keep).expect("an idle keep-alive connection was kept open");
    assert_eq!(parse(&got).status, 200);

    let mut slow = TcpStream::connect(a).unwrap();
    write!(
        slow,
        "POST /reconfigure/dax/l2/remove HTTP/1.1\r\nHost: {a}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"device_path\""
    )
    .unwrap();
    let got = read_until_closed(&mut slow).expect("a stalled body was kept open");
    let r = parse(&got);
    assert_eq!(
        (r.status, r.json()),
        (408, json!({"error": "request body not received in time"}))
    );
    assert!(dax.calls().is_empty());
    // The server still answers.
    assert_eq!(get(a, "/health").status, 200);
}

/// At `max_connections` open connections the next caller waits (in the
/// kernel's queue, no fd taken) and is served once one closes.
#[test]
fn connections_past_the_cap_wait_for_a_slot() {
    let cfg = HttpConfig {
        max_connections: 2,
        header_read_timeout: Duration::from_secs(60),
        ..HttpConfig::default()
    };
    let srv = start_with(cfg, &[], HttpHooks::default());
    let a = srv.local_addr();
    // Two keep-alive connections, each answered once (so surely accepted),
    // then left open.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(a).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        write!(s, "GET /health HTTP/1.1\r\nHost: {a}\r\n\r\n").unwrap();
        let mut buf = [0u8; 512];
        let n = s.read(&mut buf).unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        held.push(s);
    }
    let (tx, rx) = mpsc::channel();
    let third = std::thread::spawn(move || {
        let r = get(a, "/health");
        tx.send(()).unwrap();
        r
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(500)).is_err(),
        "a third connection was served past the cap of 2"
    );
    held.pop();
    assert_eq!(third.join().unwrap().status, 200);
}

/// JSON integers beyond u64 are what pydantic makes of them (valid
/// integers): a huge `size` is the 400 size message, a huge
/// `adapter_index` 404; a float stays a 422.
#[test]
fn integers_beyond_u64_answer_as_upstream() {
    let dax = Recording::new("dax", "a");
    let fake = Recording::new("fake", "f");
    let srv = start(&[Arc::clone(&dax), Arc::clone(&fake)]);
    let a = srv.local_addr();
    let huge = "1180591620717411303424"; // 2^70
    for n in [
        huge.to_string(),
        format!("-{huge}"),
        "18446744073709551616".into(),
    ] {
        for (route, extra) in [
            ("/reconfigure/dax/l2/add", ""),
            ("/reconfigure/dax/l2/resize", r#", "mode": "evict""#),
            ("/reconfigure/dax/add", ""),
        ] {
            let body = format!(r#"{{"device_path": "/d", "size": {n}{extra}}}"#);
            let r = post_raw(a, route, body.as_bytes());
            assert_eq!(r.status, 400, "{route} {n}: {}", r.text());
            assert_eq!(r.json(), json!({ "error": BAD_SIZE }));
        }
        let body = format!(r#"{{"adapter_index": {n}, "device_path": "/d"}}"#);
        let r = post_raw(a, "/reconfigure/dax/l2/remove", body.as_bytes());
        assert_eq!(
            (r.status, r.json()),
            (404, json!({"error": "dax adapter not found"})),
            "{n}"
        );
        let body = format!(r#"{{"adapter_index": {n}}}"#);
        let r = post_raw(a, "/reconfigure/fake/l2/flush", body.as_bytes());
        assert_eq!(
            (r.status, r.json()),
            (404, json!({"error": "fake adapter not found"})),
            "{n}"
        );
    }
    let r = post_raw(
        a,
        "/reconfigure/dax/l2/add",
        br#"{"device_path": "/d", "size": 1e21}"#,
    );
    assert_eq!(detail_types(&r)[0].0, "int_type");
    assert!(dax.calls().is_empty());
    assert!(fake.calls().is_empty());
}

/// Anonymous devices (`memfd`, `memfd:NAME`) are not paths: with no
/// allow-list they pass; with one they are refused (they take RAM) unless
/// the list holds `memfd`; a list of `memfd` alone allows no path.
#[test]
fn allow_list_and_anonymous_devices() {
    let dir = tempfile::tempdir().unwrap();
    let devs = dir.path().join("devs");
    std::fs::create_dir(&devs).unwrap();
    let inside = devs.join("dax0").display().to_string();
    let add = |a: SocketAddr, p: &str| {
        post(
            a,
            "/reconfigure/dax/l2/add",
            &json!({"device_path": p, "size": "2MiB"}),
        )
    };
    let cases: [(Vec<std::path::PathBuf>, [u16; 4]); 4] = [
        // [memfd, memfd:b, memfd:, a path inside devs]
        (vec![], [200, 200, 200, 200]),
        (vec![devs.clone()], [403, 403, 403, 200]),
        (vec![devs.clone(), "memfd".into()], [200, 200, 200, 200]),
        (vec!["memfd".into()], [200, 200, 200, 403]),
    ];
    for (allow, want) in cases {
        let dax = Recording::new("dax", "a");
        let cfg = HttpConfig {
            allow_prefixes: allow.clone(),
            ..HttpConfig::default()
        };
        let srv = start_with(cfg, &[Arc::clone(&dax)], HttpHooks::default());
        let a = srv.local_addr();
        for (p, want) in ["memfd", "memfd:b", "memfd:", inside.as_str()]
            .into_iter()
            .zip(want)
        {
            let r = add(a, p);
            assert_eq!(r.status, want, "{allow:?} {p}: {}", r.text());
            if want == 403 && p.starts_with("memfd") {
                assert_eq!(
                    r.json(),
                    json!({"error": "anonymous devices not allowed (add memfd to the allow-list)"})
                );
            }
        }
    }
}

/// remove and resize name a device by `device_path`, by `device_index`
/// (its position in the status list), or by both; the index is a
/// non-negative integer (422 otherwise) and reaches the backend as given.
#[test]
fn remove_and_resize_take_a_device_index() {
    let dax = Recording::new("dax", "a");
    let srv = start(&[Arc::clone(&dax)]);
    let a = srv.local_addr();
    let r = post(a, "/reconfigure/dax/l2/remove", &json!({"device_index": 2}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        dax.last(),
        (
            "remove".into(),
            json!({"device_index": 2, "mode": "migrate", "force": false})
        )
    );
    let r = post(
        a,
        "/reconfigure/dax/l2/resize",
        &json!({"device_index": 1, "device_path": "memfd:b", "size": "4MiB"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(dax.last().1["device_index"], 1);
    assert_eq!(dax.last().1["device_path"], "memfd:b");
    for bad in [json!(-1), json!("1"), json!(1.5), json!(true)] {
        let r = post(
            a,
            "/reconfigure/dax/l2/remove",
            &json!({"device_index": bad}),
        );
        assert_eq!(r.status, 422, "{bad}");
        assert_eq!(
            r.json()["detail"][0]["loc"],
            json!(["body", "device_index"])
        );
    }
    // Neither: device_path is missing, as before.
    let r = post(a, "/reconfigure/dax/l2/remove", &json!({"mode": "drain"}));
    assert_eq!(r.status, 422);
    assert_eq!(r.json()["detail"][0]["loc"], json!(["body", "device_path"]));
    // add names a device by path only.
    let r = post(
        a,
        "/reconfigure/dax/l2/add",
        &json!({"device_index": 0, "size": 4096}),
    );
    assert_eq!(r.status, 422);
}

/// The allow-list judges the path the engine will open: `add` trims
/// `device_path`, so the check trims it too. A padded path inside the
/// allowed directory is the same device (allowed); a padded path outside
/// it is refused as the bare one is.
#[test]
fn the_allow_list_checks_the_trimmed_path() {
    let dir = tempfile::tempdir().unwrap();
    let devs = dir.path().join("devs");
    std::fs::create_dir(&devs).unwrap();
    let inside = devs.join("dax0").display().to_string();
    let outside = dir.path().join("dax1").display().to_string();
    let dax = Recording::new("dax", "a");
    let cfg = HttpConfig {
        allow_prefixes: vec![devs],
        ..HttpConfig::default()
    };
    let srv = start_with(cfg, &[Arc::clone(&dax)], HttpHooks::default());
    let a = srv.local_addr();
    for (p, want) in [
        (format!("  {inside} "), 200),
        (format!("\t{inside}\n"), 200),
        (format!(" {outside} "), 403),
        (outside.clone(), 403),
    ] {
        let r = post(
            a,
            "/reconfigure/dax/l2/add",
            &json!({"device_path": p, "size": "2MiB"}),
        );
        assert_eq!(r.status, want, "{p:?}: {}", r.text());
    }
}
