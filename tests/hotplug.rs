//! Hotplug over a real HTTP socket on 127.0.0.1 (`daxkv::control::http` serving
//! the DAX reconfigure backend; validation cases that HTTP's schema
//! answers with 422 call the backend directly): docs/lmcache-dax-behavior.md §8.1 items 2–8 and §8.3 items 2–3,
//! with bytes verified after every migration and resize, plus the places
//! daxkv does better than upstream (a migration that stops halfway leaves
//! no duplicates and a retry succeeds; tombstones keep status healthy; a
//! pool started empty; a forced detach under load). Real memfds and tmpfs
//! files, real threads.

#![allow(clippy::many_single_char_names, clippy::too_many_lines)] // scenario tests

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use daxkv::control::reconfigure::{
    DaxReconfigure, Owners, Reconfigurable, ReconfigureError, Registry,
};
use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{Answer, DeviceSpec, DeviceState, Engine, EngineOptions, Listener};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key};
use serde_json::{json, Value};

const SLOT: usize = 4096;
const T: Duration = Duration::from_secs(20);

fn k(i: u32) -> Key {
    Key::digest(&i.to_le_bytes())
}

fn payload(i: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u32).wrapping_mul(13).wrapping_add(i * 101) as u8)
        .collect()
}

fn memfd(slots: usize) -> DeviceSpec {
    DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(slots * SLOT), SLOT),
    }
}

/// A tmpfs file of `slots` slots under `dir`, as a device spec mapping
/// all of it.
fn file(dir: &std::path::Path, name: &str, slots: usize) -> (String, DeviceSpec) {
    file_of(dir, name, slots, slots)
}

/// A tmpfs file of `file_slots` slots, mapping `slots` of them (the rest
/// is room to grow into: a file is never grown past its length).
fn file_of(
    dir: &std::path::Path,
    name: &str,
    file_slots: usize,
    slots: usize,
) -> (String, DeviceSpec) {
    let p = dir.join(name);
    std::fs::File::create(&p)
        .unwrap()
        .set_len((file_slots * SLOT) as u64)
        .unwrap();
    let path = p.display().to_string();
    (
        path.clone(),
        DeviceSpec {
            path,
            core: CoreConfig::new(
                ArenaSpec::new(daxkv::device::arena::ArenaSource::Path(p), slots * SLOT),
                SLOT,
            ),
        },
    )
}

/// The control plane of a test: the DAX backend behind a real HTTP
/// server on 127.0.0.1.
struct Ctl {
    backend: Arc<DaxReconfigure>,
    http: daxkv::control::http::HttpServer,
}

impl Ctl {
    /// `operation` with `payload` (the backend's keys: `size_bytes`) as a
    /// POST to `/reconfigure/dax/l2/{operation}` (the body's `size`).
    /// `status`, and calls with an owners callback, go to the backend.
    fn reconfigure(
        &self,
        op: &str,
        payload: &Value,
        owners: Owners<'_>,
    ) -> Result<Value, ReconfigureError> {
        if owners.is_some() || op == "status" {
            return self.backend.reconfigure(op, payload, owners);
        }
        let mut body = payload.clone();
        if let Some(size) = body.as_object_mut().and_then(|o| o.remove("size_bytes")) {
            body["size"] = size;
        }
        let (status, text) = daxkv::cli::serve::request(
            &self.http.local_addr().to_string(),
            "POST",
            &format!("/reconfigure/dax/l2/{op}"),
            Some(&body),
            None,
        )
        .unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        if status == 200 {
            Ok(v)
        } else {
            Err(ReconfigureError::with_body(status, v))
        }
    }

    fn reconfigure_status(&self) -> Value {
        self.backend.reconfigure_status()
    }
}

fn control(e: &Arc<Engine>) -> Ctl {
    let backend = Arc::new(DaxReconfigure::new(e.clone(), |_, _, _| Ok(())));
    let mut registry = Registry::new();
    registry.register(backend.clone());
    let http = daxkv::control::http::serve(
        daxkv::control::http::HttpConfig::default(),
        registry,
        daxkv::control::http::HttpHooks::default(),
    )
    .unwrap();
    Ctl { backend, http }
}

fn open(devs: Vec<DeviceSpec>) -> (Arc<Engine>, Ctl) {
    let e = Arc::new(Engine::open(devs, SLOT, true, EngineOptions::default()).unwrap());
    let r = control(&e);
    (e, r)
}

fn store(e: &Engine, ids: &[u32], len: usize) -> bool {
    let keys = ids.iter().map(|&i| k(i)).collect();
    let bufs = ids.iter().map(|&i| Buf::from(payload(i, len))).collect();
    let id = e.submit_store(keys, bufs).unwrap();
    e.wait_store(id, T).ready().unwrap().success
}

/// Every key loads with its own bytes, from exactly one device.
fn all_load(e: &Engine, ids: &[u32], len: usize) {
    let keys: Vec<Key> = ids.iter().map(|&i| k(i)).collect();
    let id = e
        .submit_load(keys.clone(), vec![vec![0; SLOT]; ids.len()])
        .unwrap();
    let r = e.wait_load(id, T).ready().unwrap();
    for (j, &i) in ids.iter().enumerate() {
        assert_eq!(r.payload(j), Some(&payload(i, len)[..]), "key {i}");
        assert_eq!(e.devices_holding(keys[j]).len(), 1, "key {i}: one copy");
    }
}

fn states(e: &Engine) -> Vec<DeviceState> {
    e.devices().iter().map(|d| d.state).collect()
}

/// Records the keys listeners hear deleted.
#[derive(Default)]
struct Deleted(Arc<Mutex<Vec<Key>>>);

impl Listener for Deleted {
    fn on_keys_deleted(&self, keys: &[Key]) {
        self.0.lock().unwrap().extend_from_slice(keys);
    }
}

fn tmpdir() -> tempfile::TempDir {
    tempfile::Builder::new().tempdir_in("/dev/shm").unwrap()
}

/// docs/lmcache-dax-behavior.md §8.1 item 2: remove(migrate) between two devices moves
/// the key; no
/// delete events; lookup and load still hit with the right bytes.
#[test]
fn migrate_moves_keys_and_removes_the_source() {
    let dir = tmpdir();
    let (a, spec_a) = file(dir.path(), "a", 8);
    let (e, r) = open(vec![spec_a, memfd(8)]);
    let l = Arc::new(Deleted::default());
    e.register_listener(&(l.clone() as Arc<dyn Listener>));
    // Device 1 is drained so the key lands on device 0 (the source).
    e.set_device_state(daxkv::engine::DeviceId(1), DeviceState::Draining)
        .unwrap();
    assert!(store(&e, &[1], 3000));
    e.set_device_state(daxkv::engine::DeviceId(1), DeviceState::Active)
        .unwrap();
    let out = r
        .reconfigure(
            "remove",
            &json!({"device_path": a, "mode": "migrate"}),
            None,
        )
        .unwrap();
    assert_eq!(out["state"], "removed");
    assert_eq!(out["moved_keys"], 1);
    assert_eq!(out["moved_bytes"], 3000);
    assert_eq!(out["deleted_keys"], 0);
    assert_eq!(out["source_slots_freed"], 1);
    assert_eq!(out["index"], 0);
    assert!(l.0.lock().unwrap().is_empty(), "no delete events");
    all_load(&e, &[1], 3000);
    assert_eq!(states(&e), [DeviceState::Removed, DeviceState::Active]);
    // Better than upstream: a tombstone does not make status unhealthy.
    assert_eq!(e.status()["is_healthy"], true);
    e.check_invariants().unwrap();
}

/// docs/lmcache-dax-behavior.md §8.1 item 3: status is the standard envelope.
#[test]
fn status_is_the_envelope() {
    let (_e, r) = open(vec![memfd(4)]);
    let s = r.reconfigure("status", &json!({}), None).unwrap();
    assert_eq!(s["backend"], "dax");
    assert_eq!(
        s["supported_operations"],
        json!(["status", "add", "remove", "resize"])
    );
    assert_eq!(s["status"]["enabled"], true);
    assert_eq!(s["status"]["num_devices"], 1);
    assert_eq!(steady(s), steady(r.reconfigure_status()));
}

/// `v` without the fields that change while nothing happens: a worker's
/// `last_cpu` is read from /proc when asked, and a parked worker that
/// wakes for its timeout may have moved.
fn steady(mut v: Value) -> Value {
    match &mut v {
        Value::Object(m) => {
            m.remove("last_cpu");
            for x in m.values_mut() {
                *x = steady(x.take());
            }
        }
        Value::Array(a) => {
            for x in a.iter_mut() {
                *x = steady(x.take());
            }
        }
        _ => {}
    }
    v
}

/// docs/lmcache-dax-behavior.md §8.1 item 4: drain keeps the data readable, new
/// stores go elsewhere.
#[test]
fn drain_sends_new_stores_elsewhere() {
    let dir = tmpdir();
    let (a, spec_a) = file(dir.path(), "a", 8);
    let (e, r) = open(vec![spec_a, memfd(8)]);
    assert!(store(&e, &[1], 100));
    let before = e.devices()[0].live_slots;
    let out = r
        .reconfigure("remove", &json!({"device_path": a, "mode": "drain"}), None)
        .unwrap();
    assert_eq!(
        (out["operation"].clone(), out["state"].clone()),
        (json!("drain"), json!("draining"))
    );
    assert!(store(&e, &[2, 3], 100));
    assert_eq!(
        e.devices()[0].live_slots,
        before,
        "the source took nothing new"
    );
    all_load(&e, &[1, 2, 3], 100);
    // Idempotent.
    r.reconfigure("remove", &json!({"device_path": a, "mode": "drain"}), None)
        .unwrap();
}

/// docs/lmcache-dax-behavior.md §8.1 item 5 and docs/lmcache-dax-behavior.md §8.3 item 2: a
/// locked key blocks migrate (409, the
/// blocked payload) and the state goes back; after unlock it migrates.
#[test]
fn a_locked_key_blocks_migrate_then_unlock_lets_it_go() {
    let dir = tmpdir();
    let (a, spec_a) = file(dir.path(), "a", 8);
    let (e, r) = open(vec![spec_a]);
    assert!(store(&e, &[1], 100));
    let id = e.submit_lookup_and_lock(vec![k(1)]).unwrap();
    assert!(e.wait_lookup(id, T).ready().unwrap().test(0));
    // docs/lmcache-dax-behavior.md §8.3 item 2: add a device at runtime.
    let added = r
        .reconfigure(
            "add",
            &json!({"device_path": "memfd", "size_bytes": 8 * SLOT}),
            None,
        )
        .unwrap();
    assert_eq!(added["device"]["state"], "active");
    let err = r
        .reconfigure("remove", &json!({"device_path": a}), None)
        .unwrap_err();
    assert_eq!(err.status, 409);
    assert_eq!(
        err.body,
        json!({"status": "blocked", "reason": "device has externally locked or borrowed slots",
               "locked_key_count": 1, "borrowed_slot_count": 0})
    );
    assert_eq!(states(&e)[0], DeviceState::Active, "state restored");
    e.submit_unlock(&[k(1)]);
    let out = r
        .reconfigure(
            "remove",
            &json!({"device_path": a, "mode": "migrate"}),
            None,
        )
        .unwrap();
    assert_eq!(out["moved_keys"], 1);
    all_load(&e, &[1], 100);
}

/// docs/lmcache-dax-behavior.md §8.1 item 7: evict deletes and tells the listeners.
#[test]
fn evict_deletes_and_tells_listeners() {
    let dir = tmpdir();
    let (a, spec_a) = file(dir.path(), "a", 8);
    let (e, r) = open(vec![spec_a]);
    let l = Arc::new(Deleted::default());
    e.register_listener(&(l.clone() as Arc<dyn Listener>));
    assert!(store(&e, &[1], 100));
    let out = r
        .reconfigure("remove", &json!({"device_path": a, "mode": "evict"}), None)
        .unwrap();
    assert_eq!(
        (
            out["deleted_keys"].clone(),
            out["source_slots_freed"].clone()
        ),
        (json!(1), json!(1))
    );
    assert_eq!(*l.0.lock().unwrap(), vec![k(1)]);
    let id = e.submit_lookup_and_lock(vec![k(1)]).unwrap();
    assert!(!e.wait_lookup(id, T).ready().unwrap().test(0));
    // A pool whose only device is removed reports no capacity, healthy.
    assert_eq!(e.usage(), (0, 0));
    assert_eq!(e.status()["is_healthy"], true);
}

/// docs/lmcache-dax-behavior.md §8.1 item 8 and docs/lmcache-dax-behavior.md §4.2–4.4 validation:
/// errors name what was wrong. A missing path keeps upstream's status and
/// message, and goes on to name the path and how to create it (the one
/// caller who can fix it is the one who sent the path).
#[test]
fn bad_requests_are_refused_with_upstreams_messages() {
    let e = Arc::new(Engine::open(vec![], SLOT, true, EngineOptions::default()).unwrap());
    let r = DaxReconfigure::new(e.clone(), |_, _, _| Ok(()));
    let call = |op: &str, p: Value| r.reconfigure(op, &p, None).unwrap_err();
    let missing = "/nonexistent/dax9.9";
    let err = call("add", json!({"device_path": missing, "size_bytes": 8192}));
    assert_eq!(
        (err.status, err.body.clone()),
        (
            400,
            json!({"error": "failed to identify DAX device: /nonexistent/dax9.9 does not exist: \
                create it first, e.g. `truncate -s 8K /nonexistent/dax9.9`, or pass --create \
                (`create: true` in an HTTP add)"})
        )
    );
    let err = call("add", json!({"device_path": "  ", "size_bytes": 8192}));
    assert_eq!(err.body["error"], "device_path must be a non-empty string");
    let err = call("add", json!({"device_path": "memfd", "size_bytes": true}));
    assert_eq!(err.body["error"], "size_bytes must be a positive integer");
    let err = call("add", json!({"device_path": "memfd", "size_bytes": 100}));
    assert_eq!(err.body["error"], "size_bytes does not fit one slot");
    let err = call("remove", json!({"device_path": "memfd", "mode": 3}));
    assert_eq!(err.body["error"], "mode must be migrate, evict, or drain");
    let err = call("remove", json!({"device_path": "memfd", "force": "yes"}));
    assert_eq!(err.body["error"], "force must be a boolean");
    let err = call(
        "resize",
        json!({"device_path": "memfd", "size_bytes": 8192, "mode": "drain"}),
    );
    assert_eq!(err.body["error"], "mode must be migrate or evict");
    let err = call("remove", json!({"device_path": "/dev/nothing"}));
    assert_eq!(
        (err.status, err.body["error"].clone()),
        (404, json!("DAX device not found"))
    );
    let err = call("flip", json!({}));
    assert_eq!(
        err.body["error"],
        "unsupported DAX reconfigure operation: flip"
    );
    let owners = |_: &str| vec!["l1".to_string(), "other".to_string()];
    let err = r
        .reconfigure(
            "add",
            &json!({"device_path": "memfd", "size_bytes": 8192}),
            Some(&owners),
        )
        .unwrap_err();
    assert_eq!(
        (err.status, err.body["error"].clone()),
        (409, json!("physical device is already mapped by l1, other"))
    );
    // A pool started empty works once a device is added (capacity,
    // stores), better than upstream's hotplug-only start.
    r.reconfigure(
        "add",
        &json!({"device_path": "memfd", "size_bytes": 4 * SLOT}),
        None,
    )
    .unwrap();
    assert_eq!(e.usage(), (0, 4 * SLOT as u64));
    assert!(store(&e, &[7], 10));
    assert_eq!(e.usage().0, SLOT as u64);
    // Hotplug disabled: 403.
    let off =
        Arc::new(Engine::open(vec![memfd(2)], SLOT, false, EngineOptions::default()).unwrap());
    let r = DaxReconfigure::new(off, |_, _, _| Ok(()));
    let err = r
        .reconfigure(
            "add",
            &json!({"device_path": "memfd", "size_bytes": 8192}),
            None,
        )
        .unwrap_err();
    assert_eq!(
        (err.status, err.body["error"].clone()),
        (403, json!("DAX hotplug is disabled"))
    );
    // Upstream answers remove and resize 403 with hotplug off before it
    // looks the path up (not 404), and checks the mode's type first (400).
    for (op, p) in [
        ("remove", json!({"device_path": "/dev/nothing"})),
        (
            "remove",
            json!({"device_path": "/dev/nothing", "mode": "bogus"}),
        ),
        (
            "resize",
            json!({"device_path": "/dev/nothing", "size_bytes": 8192}),
        ),
    ] {
        let err = r.reconfigure(op, &p, None).unwrap_err();
        assert_eq!(err.status, 403, "{op} {p}");
    }
    let err = r
        .reconfigure("remove", &json!({"device_path": "memfd", "mode": 1}), None)
        .unwrap_err();
    assert_eq!(err.status, 400);
}

/// `owns_device` answers by physical identity (a symlink to a mapped file
/// is owned), never for a missing path, another file or a memfd, and no
/// longer once the device is removed; the status names the capacity as
/// LMCache's `hotplug_status()` does.
#[test]
fn owns_device_by_identity_until_removed() {
    let dir = tmpdir();
    let (path, spec) = file(dir.path(), "dax0", 4);
    let (e, r) = open(vec![spec, memfd(4)]);
    let link = dir.path().join("alias");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    let other = dir.path().join("other");
    std::fs::File::create(&other)
        .unwrap()
        .set_len(4096)
        .unwrap();
    assert!(e.owns_device(std::path::Path::new(&path)));
    assert!(e.owns_device(&link));
    assert!(!e.owns_device(&other));
    assert!(!e.owns_device(&dir.path().join("missing")));
    assert!(!e.owns_device(std::path::Path::new("memfd")));
    let st = r.reconfigure_status();
    assert_eq!(st["status"]["total_capacity_bytes"], json!(8 * SLOT as u64));
    r.reconfigure(
        "remove",
        &json!({"device_path": path, "mode": "evict"}),
        None,
    )
    .unwrap();
    assert!(!e.owns_device(std::path::Path::new(&path)));
    assert!(!e.owns_device(&link));
}

/// Re-adding the same physical device at the same size is idempotent (by
/// identity, not the path string: a symlink alias too); another size 409.
#[test]
fn re_adding_a_device_is_idempotent_or_a_conflict() {
    let dir = tmpdir();
    let (a, _) = file(dir.path(), "a", 8);
    let alias = dir.path().join("alias");
    std::os::unix::fs::symlink(&a, &alias).unwrap();
    let (e, r) = open(vec![]);
    let first = r
        .reconfigure(
            "add",
            &json!({"device_path": a, "size_bytes": 8 * SLOT}),
            None,
        )
        .unwrap();
    let again = r
        .reconfigure(
            "add",
            &json!({"device_path": alias.display().to_string(), "size_bytes": 8 * SLOT}),
            None,
        )
        .unwrap();
    assert_eq!(first["device"]["device_id"], again["device"]["device_id"]);
    assert_eq!(again["device"]["device_path"], a, "the original path");
    assert_eq!(e.devices().len(), 1);
    let err = r
        .reconfigure(
            "add",
            &json!({"device_path": a, "size_bytes": 4 * SLOT}),
            None,
        )
        .unwrap_err();
    assert_eq!(
        (err.status, err.body["error"].clone()),
        (
            409,
            json!("device_path already active with a different size")
        )
    );
    // The gate runs before mapping and refuses with its reason.
    let gated = DaxReconfigure::new(e.clone(), |_, _, _| {
        Err("DAX device has no device_dax driver bound".into())
    });
    let (b, _) = file(dir.path(), "b", 8);
    let err = gated
        .reconfigure(
            "add",
            &json!({"device_path": b, "size_bytes": 8 * SLOT}),
            None,
        )
        .unwrap_err();
    assert_eq!(
        err.body["error"],
        "DAX device has no device_dax driver bound"
    );
    assert_eq!(e.devices().len(), 1, "nothing mapped");
}

/// Better than upstream (docs/lmcache-dax-behavior.md §9.4 item 2): a migration
/// whose destination
/// fills halfway answers 507 with how many moved, leaves every key on
/// exactly one device with its bytes, restores the source's state, and a
/// retry with room succeeds.
#[test]
fn a_migration_that_fills_its_destination_leaves_no_duplicates_and_retries() {
    let dir = tmpdir();
    let (a, spec_a) = file(dir.path(), "a", 8);
    let (e, r) = open(vec![spec_a]);
    let ids: Vec<u32> = (0..8).collect();
    assert!(store(&e, &ids, 2000));
    r.reconfigure(
        "add",
        &json!({"device_path": "memfd", "size_bytes": 3 * SLOT}),
        None,
    )
    .unwrap();
    let err = r
        .reconfigure("remove", &json!({"device_path": a}), None)
        .unwrap_err();
    assert_eq!(err.status, 507);
    assert_eq!(err.body["error"], "insufficient destination DAX capacity");
    assert_eq!(err.body["moved_keys"], 3);
    assert_eq!(states(&e), [DeviceState::Active, DeviceState::Active]);
    all_load(&e, &ids, 2000);
    // A second anonymous device needs a name of its own.
    r.reconfigure(
        "add",
        &json!({"device_path": "memfd:more", "size_bytes": 8 * SLOT}),
        None,
    )
    .unwrap();
    let out = r
        .reconfigure("remove", &json!({"device_path": a}), None)
        .unwrap();
    assert_eq!(out["moved_keys"], 5);
    all_load(&e, &ids, 2000);
    // The metrics count each outcome.
    let m = daxkv::control::metrics::encode(&e);
    for line in [
        "daxkv_hotplug_operations_total{operation=\"remove\",outcome=\"failed\"} 1",
        "daxkv_hotplug_operations_total{operation=\"remove\",outcome=\"ok\"} 1",
        "daxkv_hotplug_operations_total{operation=\"add\",outcome=\"ok\"} 2",
    ] {
        assert!(m.lines().any(|l| l == line), "missing {line}");
    }
    e.check_invariants().unwrap();
    // No other device: 507 at once, state kept.
    let (_e2, r2) = open(vec![memfd(4)]);
    let _ = r2; // (memfd devices share a path: see the next test)
}

/// docs/lmcache-dax-behavior.md §8.3 item 3: resize grows 2 → 4 slots; a shrink
/// back to 2 with a locked
/// key in a high slot is 409 and keeps the capacity; after unlock the
/// shrink moves the high keys (or evicts them with force) and data
/// survives.
#[test]
fn resize_grows_in_place_and_shrinks_without_dropping_data() {
    let dir = tmpdir();
    let (a, spec_a) = file_of(dir.path(), "a", 4, 2);
    let (e, r) = open(vec![spec_a]);
    assert!(store(&e, &[1, 2], 500));
    // Past the file's end: refused before anything is mapped (no SIGBUS).
    let err = r
        .reconfigure(
            "resize",
            &json!({"device_path": a, "size_bytes": 8 * SLOT}),
            None,
        )
        .unwrap_err();
    // The body says why, without the path.
    let why = err.body["error"].as_str().unwrap_or_default();
    assert_eq!(err.status, 400);
    assert!(
        why.starts_with("failed to remap DAX device: ") && why.contains("at most 16384 bytes"),
        "{why}"
    );
    assert!(!why.contains(&a), "{why}");
    assert_eq!(e.devices()[0].max_slots, 2);
    let out = r
        .reconfigure(
            "resize",
            &json!({"device_path": a, "size_bytes": 4 * SLOT}),
            None,
        )
        .unwrap();
    assert_eq!(
        (out["old_size_bytes"].clone(), out["new_size_bytes"].clone()),
        (json!(2 * SLOT), json!(4 * SLOT))
    );
    assert_eq!(out["state"], "active");
    assert!(store(&e, &[3, 4], 500), "the new slots take keys");
    all_load(&e, &[1, 2, 3, 4], 500);
    // Lock a key: the shrink is blocked, capacity stays.
    let id = e.submit_lookup_and_lock(vec![k(3)]).unwrap();
    assert!(e.wait_lookup(id, T).ready().unwrap().test(0));
    let err = r
        .reconfigure(
            "resize",
            &json!({"device_path": a, "size_bytes": 2 * SLOT}),
            None,
        )
        .unwrap_err();
    assert_eq!(err.status, 409);
    assert_eq!(e.devices()[0].max_slots, 4);
    e.submit_unlock(&[k(3)]);
    // Without another device the high keys cannot move: 507.
    let err = r
        .reconfigure(
            "resize",
            &json!({"device_path": a, "size_bytes": 2 * SLOT}),
            None,
        )
        .unwrap_err();
    assert_eq!(
        (err.status, err.body["error"].clone()),
        (507, json!("no active destination DAX capacity"))
    );
    // Evict without force never drops data.
    let err = r
        .reconfigure(
            "resize",
            &json!({"device_path": a, "size_bytes": 2 * SLOT, "mode": "evict"}),
            None,
        )
        .unwrap_err();
    assert_eq!(
        err.body["error"],
        "resize shrink would drop live keys without migration"
    );
    all_load(&e, &[1, 2, 3, 4], 500);
    // With room elsewhere the shrink moves the high keys.
    r.reconfigure(
        "add",
        &json!({"device_path": "memfd", "size_bytes": 4 * SLOT}),
        None,
    )
    .unwrap();
    let out = r
        .reconfigure(
            "resize",
            &json!({"device_path": a, "size_bytes": 2 * SLOT}),
            None,
        )
        .unwrap();
    assert_eq!(out["new_size_bytes"], 2 * SLOT);
    assert_eq!(out["moved_keys"], 2);
    assert_eq!(e.devices()[0].max_slots, 2);
    all_load(&e, &[1, 2, 3, 4], 500);
    e.check_invariants().unwrap();
}

/// A forced detach (remove, evict, force) under load finishes in bounded
/// time, and every key reads as a miss or its own bytes, never another's.
#[test]
fn a_forced_detach_under_load_is_bounded_and_never_serves_wrong_bytes() {
    let dir = tmpdir();
    let (a, spec_a) = file(dir.path(), "a", 64);
    let (e, r) = open(vec![spec_a, memfd(64)]);
    let ids: Vec<u32> = (0..100).collect();
    assert!(store(&e, &ids, 1500));
    let stop = Arc::new(AtomicBool::new(false));
    let checked = Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = (0..2)
        .map(|t| {
            let (e, stop, checked) = (e.clone(), stop.clone(), checked.clone());
            std::thread::spawn(move || {
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    let key = (i % 100) as u32;
                    i += 7;
                    let id = e.submit_lookup_and_lock(vec![k(key)]).unwrap();
                    let hit = e.wait_lookup(id, T).ready().unwrap().test(0);
                    let id = e.submit_load(vec![k(key)], vec![vec![0; SLOT]]).unwrap();
                    let got = e.wait_load(id, T).ready().unwrap();
                    if let Some(p) = got.payload(0) {
                        assert_eq!(p, &payload(key, 1500)[..], "key {key}: wrong bytes");
                    }
                    if hit {
                        e.submit_unlock(&[k(key)]);
                    }
                    checked.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    while checked.load(Ordering::Relaxed) < 50 {
        std::thread::yield_now();
    }
    let t0 = Instant::now();
    let out = r
        .reconfigure(
            "remove",
            &json!({"device_path": a, "mode": "evict", "force": true}),
            None,
        )
        .unwrap();
    let took = t0.elapsed();
    assert_eq!(out["state"], "removed");
    assert!(
        took < Duration::from_secs(10),
        "forced detach took {took:?}"
    );
    let at = checked.load(Ordering::Relaxed);
    while checked.load(Ordering::Relaxed) < at + 50 {
        std::thread::yield_now();
    }
    stop.store(true, Ordering::Relaxed);
    for h in readers {
        h.join().unwrap();
    }
    assert_eq!(e.status()["locked_key_count"], 0, "no lock left");
    eprintln!("forced detach under load: {took:?}");
}

/// Stores, lookups and loads with per-key checksums keep running while
/// devices are added, drained, migrated away, resized and force-removed;
/// at the end every acknowledged key loads with its own bytes or was
/// reported deleted, each from one device, and no slot, lock or borrow
/// leaked.
#[test]
fn traffic_survives_every_hotplug_operation() {
    let dir = tmpdir();
    let (a, spec_a) = file(dir.path(), "a", 256);
    let (e, r) = open(vec![spec_a, memfd(256)]);
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(Vec::<u32>::new()));
    let deleted = Arc::new(Mutex::new(Vec::<Key>::new()));
    e.register_listener(&(Arc::new(Deleted(deleted.clone())) as Arc<dyn Listener>));
    // Writers store while `stored < allowed`; each step allows 20 more
    // and waits for them, so traffic runs through every step and the pool
    // never fills.
    let stored = Arc::new(AtomicUsize::new(0));
    let allowed = Arc::new(AtomicUsize::new(40));
    let writers: Vec<_> = (0..2u32)
        .map(|t| {
            let (e, stop, acked, stored, allowed) = (
                e.clone(),
                stop.clone(),
                acked.clone(),
                stored.clone(),
                allowed.clone(),
            );
            std::thread::spawn(move || {
                let mut n = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    if stored.load(Ordering::Relaxed) >= allowed.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_micros(200));
                        continue;
                    }
                    let key = t * 100_000 + n;
                    n += 1;
                    let id = e
                        .submit_store(vec![k(key)], vec![Buf::from(payload(key, 700))])
                        .unwrap();
                    if let Answer::Ready(res) = e.wait_store(id, T) {
                        if res.success {
                            acked.lock().unwrap().push(key);
                            stored.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    // Read back something acknowledged earlier.
                    let back = {
                        let a = acked.lock().unwrap();
                        (!a.is_empty()).then(|| a[(n as usize * 7) % a.len()])
                    };
                    if let Some(b) = back {
                        let id = e.submit_load(vec![k(b)], vec![vec![0; SLOT]]).unwrap();
                        let got = e.wait_load(id, T).ready().unwrap();
                        if let Some(p) = got.payload(0) {
                            assert_eq!(p, &payload(b, 700)[..], "key {b}: wrong bytes");
                        }
                    }
                }
            })
        })
        .collect();
    // Each step waits for 20 more stores, so traffic runs through all.
    let step = |what: &str, op: &str, p: Value| {
        let want = allowed.fetch_add(20, Ordering::Relaxed) + 20;
        let t0 = Instant::now();
        while stored.load(Ordering::Relaxed) < want && t0.elapsed() < T {
            std::thread::sleep(Duration::from_millis(1));
        }
        let res = r.reconfigure(op, &p, None);
        eprintln!(
            "{what}: {:?}",
            res.as_ref().map(|_| "ok").map_err(ToString::to_string)
        );
        res
    };
    step(
        "add",
        "add",
        json!({"device_path": "memfd", "size_bytes": 256 * SLOT}),
    )
    .unwrap();
    step(
        "drain a",
        "remove",
        json!({"device_path": a, "mode": "drain"}),
    )
    .unwrap();
    step(
        "migrate a away",
        "remove",
        json!({"device_path": a, "mode": "migrate", "force": true}),
    )
    .unwrap();
    let (b, _) = file(dir.path(), "b", 256);
    step(
        "add b",
        "add",
        json!({"device_path": b, "size_bytes": 128 * SLOT}),
    )
    .unwrap();
    step(
        "grow b",
        "resize",
        json!({"device_path": b, "size_bytes": 256 * SLOT}),
    )
    .unwrap();
    let _ = step(
        "shrink b",
        "resize",
        json!({"device_path": b, "size_bytes": 128 * SLOT, "force": true}),
    );
    // New keys go to b, the emptiest device, while the traffic runs.
    allowed.fetch_add(20, Ordering::Relaxed);
    let t0 = Instant::now();
    while e.devices().last().unwrap().live_slots == 0 && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(1));
    }
    step(
        "force-remove b",
        "remove",
        json!({"device_path": b, "mode": "evict", "force": true}),
    )
    .unwrap();
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    let deleted = deleted.lock().unwrap().clone();
    assert!(
        !deleted.is_empty(),
        "the forced remove evicted keys under traffic"
    );
    let mut missing = 0;
    for &key in &acked {
        let id = e.submit_load(vec![k(key)], vec![vec![0; SLOT]]).unwrap();
        let got = e.wait_load(id, T).ready().unwrap();
        if let Some(p) = got.payload(0) {
            assert_eq!(p, &payload(key, 700)[..], "key {key}");
            assert_eq!(e.devices_holding(k(key)).len(), 1, "key {key}: one copy");
        } else {
            assert!(
                deleted.contains(&k(key)),
                "key {key} acknowledged, not deleted, gone"
            );
            missing += 1;
        }
    }
    eprintln!("{} acknowledged, {missing} reported deleted", acked.len());
    let st = e.status();
    assert_eq!(st["locked_key_count"], 0);
    assert_eq!(st["borrowed_slot_count"], 0);
    e.check_invariants().unwrap();
}

/// `add` of a sysfs or procfs pseudo-file over HTTP:
/// refused by the arena's open even with no probe gate in front (the
/// probing gate refuses it too, as `not_a_device`), with nothing added;
/// a tmpfs file is still added. Read-only files, so a broken check cannot
/// write into kernel state.
#[test]
fn add_of_a_pseudo_file_is_refused() {
    let (e, r) = open(vec![memfd(16)]);
    let mut tried = 0;
    for path in [
        "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size",
        "/proc/self/status",
    ] {
        if !std::path::Path::new(path).is_file() {
            continue;
        }
        tried += 1;
        let err = r
            .reconfigure(
                "add",
                &json!({"device_path": path, "size_bytes": 4096}),
                None,
            )
            .unwrap_err();
        assert_eq!(err.status, 400, "{:?}", err.body);
        assert_eq!(e.devices().len(), 1, "nothing added");
        let probing = DaxReconfigure::probing(e.clone(), "/sys".into());
        let err = probing
            .reconfigure(
                "add",
                &json!({"device_path": path, "size_bytes": 4096}),
                None,
            )
            .unwrap_err();
        assert!(
            err.body.to_string().contains("not_a_device"),
            "{:?}",
            err.body
        );
        assert_eq!(e.devices().len(), 1, "nothing added");
    }
    assert!(tried > 0, "no pseudo-file to try on this machine");
    let dir = tmpdir();
    let (path, _) = file(dir.path(), "ok.img", 16);
    r.reconfigure(
        "add",
        &json!({"device_path": path, "size_bytes": 16 * SLOT}),
        None,
    )
    .unwrap();
    assert_eq!(e.devices().len(), 2);
}

/// `memfd` names the first anonymous device: adding it again at its size
/// answers with it (idempotent, as a path), at another size 409 with the
/// sizes and the way out; further anonymous devices are `memfd:NAME`,
/// named by the caller or (`memfd:`) by daxkv in the answer; remove,
/// drain and resize reach each by that name or by its index, and the
/// configured `memfd` stays reachable throughout. If each `add memfd`
/// made another device named `memfd`, remove of `memfd` would be 409
/// (ambiguous) for ever.
#[test]
fn anonymous_devices_are_named_and_adding_one_twice_is_idempotent() {
    let (e, r) = open(vec![memfd(8)]);
    assert!(store(&e, &[1, 2], 300));
    let add = |p: &str, slots: usize| {
        r.reconfigure(
            "add",
            &json!({"device_path": p, "size_bytes": slots * SLOT}),
            None,
        )
    };
    // The configured one, at its size: answered with it, untouched.
    let out = add("memfd", 8).unwrap();
    assert_eq!(
        (
            out["device"]["index"].clone(),
            out["device"]["device_path"].clone()
        ),
        (json!(0), json!("memfd"))
    );
    assert_eq!(e.devices().len(), 1, "no second device named memfd");
    let err = add("memfd", 4).unwrap_err();
    assert_eq!(err.status, 409);
    assert_eq!(
        err.body["error"],
        format!(
            "device_path already active with a different size: memfd has {} bytes, not {}; \
             add another anonymous device as memfd:NAME",
            8 * SLOT,
            4 * SLOT
        )
    );
    // Named by the caller; again at its size is the same device.
    let b = add("memfd:b", 4).unwrap();
    assert_eq!(b["device"]["index"], 1);
    assert_eq!(b["device"]["device_path"], "memfd:b");
    assert_eq!(add("memfd:b", 4).unwrap()["device"]["index"], 1);
    assert_eq!(add("memfd:b", 8).unwrap_err().status, 409);
    // Named by daxkv, in the answer; each `memfd:` is a new device.
    let c = add("memfd:", 4).unwrap();
    assert_eq!(c["device"]["device_path"], "memfd:2");
    let d = add("memfd:", 4).unwrap();
    assert_eq!(d["device"]["device_path"], "memfd:3");
    assert_eq!(e.devices().len(), 4);
    for bad in [
        "memfd:a/b",
        "memfd:..x y",
        &format!("memfd:{}", "n".repeat(65)),
    ] {
        let err = add(bad, 4).unwrap_err();
        assert_eq!(err.status, 400, "{bad}");
        assert_eq!(
            err.body["error"],
            "memfd:NAME: NAME must be 1 to 64 of A-Z a-z 0-9 . _ -"
        );
    }
    // Remove, drain and resize by name and by index.
    let out = r
        .reconfigure(
            "remove",
            &json!({"device_path": "memfd:b", "mode": "drain"}),
            None,
        )
        .unwrap();
    assert_eq!(
        (out["index"].clone(), out["state"].clone()),
        (json!(1), json!("draining"))
    );
    let out = r
        .reconfigure(
            "resize",
            &json!({"device_index": 2, "size_bytes": 8 * SLOT}),
            None,
        )
        .unwrap();
    assert_eq!(
        (out["device_path"].clone(), out["new_size_bytes"].clone()),
        (json!("memfd:2"), json!(8 * SLOT))
    );
    let out = r
        .reconfigure(
            "remove",
            &json!({"device_index": 3, "device_path": "memfd:3", "mode": "evict"}),
            None,
        )
        .unwrap();
    assert_eq!(out["state"], "removed");
    let err = r
        .reconfigure(
            "remove",
            &json!({"device_index": 2, "device_path": "memfd:b"}),
            None,
        )
        .unwrap_err();
    assert_eq!(
        (err.status, err.body["error"].clone()),
        (409, json!("device_index 2 is not device_path memfd:b"))
    );
    for gone in [3, 9] {
        let err = r
            .reconfigure("remove", &json!({"device_index": gone}), None)
            .unwrap_err();
        assert_eq!(err.status, 404, "index {gone}");
    }
    // The configured `memfd` is still one device, reachable by its name:
    // its keys migrate away and it is removed.
    let out = r
        .reconfigure("remove", &json!({"device_path": "memfd"}), None)
        .unwrap();
    assert_eq!(
        (out["index"].clone(), out["moved_keys"].clone()),
        (json!(0), json!(2))
    );
    all_load(&e, &[1, 2], 300);
    // With it removed, `memfd` names a new first anonymous device.
    assert_eq!(add("memfd", 2).unwrap()["device"]["index"], 4);
    e.close();
}

/// Racing adds of one anonymous name map one device: the name's check and
/// the append are one step under the pool's admin mutex. Each of 4 threads
/// adds `memfd:x` 25 times; every answer is the same device, and the pool
/// holds it once.
#[test]
fn racing_adds_of_one_anonymous_name_map_one_device() {
    let e = Arc::new(Engine::open(vec![memfd(4)], SLOT, true, EngineOptions::default()).unwrap());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let e = e.clone();
            std::thread::spawn(move || {
                (0..25)
                    .map(|_| {
                        e.hotplug_add("memfd:x", 4 * SLOT, |_, _| Ok(()))
                            .unwrap()
                            .1
                            .id
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let ids: Vec<_> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    assert!(ids.iter().all(|&id| id == ids[0]), "{ids:?}");
    let named: Vec<_> = e
        .devices()
        .into_iter()
        .filter(|d| d.path == "memfd:x")
        .collect();
    assert_eq!(named.len(), 1);
    e.close();
}

// ----- listeners run outside the admin mutex -----

/// A listener that calls back into the engine from `on_keys_deleted`.
struct CallsBack {
    engine: std::sync::OnceLock<std::sync::Weak<Engine>>,
    call: fn(&Engine),
    told: AtomicUsize,
}

impl Listener for CallsBack {
    fn on_keys_deleted(&self, keys: &[Key]) {
        self.told.fetch_add(keys.len(), Ordering::SeqCst);
        if let Some(e) = self.engine.get().and_then(std::sync::Weak::upgrade) {
            (self.call)(&e);
        }
    }
}

fn calling_back(e: &Arc<Engine>, call: fn(&Engine)) -> Arc<CallsBack> {
    let l = Arc::new(CallsBack {
        engine: std::sync::OnceLock::new(),
        call,
        told: AtomicUsize::new(0),
    });
    l.engine.set(Arc::downgrade(e)).unwrap();
    e.register_listener(&(l.clone() as Arc<dyn Listener>));
    l
}

/// Run `f` on its own thread; fail, instead of hanging, when it has not
/// returned within 30 s (a deadlock guard, not a timing assertion).
fn returns<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{what} did not return (deadlock?): {e}"))
}

/// An evicting remove tells the listeners; one that changes another
/// device's state from `on_keys_deleted` (the `Listener` doc promises
/// calls outside any engine state) must not wait for the remove's own
/// admin mutex. A listener run under it would keep the remove from ever
/// returning, and every later control-plane call would hang behind it
/// ("remove did not return (deadlock?)").
#[test]
fn a_listener_may_change_device_state_from_an_evicting_remove() {
    let (e, _r) = open(vec![memfd(8), memfd(8)]);
    e.set_device_state(daxkv::engine::DeviceId(1), DeviceState::Draining)
        .unwrap();
    assert!(store(&e, &[1, 2], 100)); // on device 0
    e.set_device_state(daxkv::engine::DeviceId(1), DeviceState::Active)
        .unwrap();
    let l = calling_back(&e, |e| {
        e.set_device_state(daxkv::engine::DeviceId(1), DeviceState::Draining)
            .unwrap();
    });
    let e2 = e.clone();
    let r = returns("remove", move || {
        e2.remove_device(
            daxkv::engine::DeviceId(0),
            daxkv::engine::RemoveMode::Evict,
            false,
        )
    });
    assert_eq!(r.unwrap().deleted_keys, 2);
    assert_eq!(l.told.load(Ordering::SeqCst), 2, "both keys told deleted");
    assert_eq!(
        states(&e),
        [DeviceState::Removed, DeviceState::Draining],
        "the listener's state change happened"
    );
    // Later control-plane calls go through.
    let e2 = e.clone();
    returns("a later state change", move || {
        e2.set_device_state(daxkv::engine::DeviceId(1), DeviceState::Active)
    })
    .unwrap();
    assert!(store(&e, &[3], 100));
    all_load(&e, &[3], 100);
}

/// A listener that closes the engine from `on_keys_deleted` during a
/// forced evicting shrink: the shrink returns, the close finishes (it
/// takes the admin mutex to close the devices), and later control-plane
/// calls answer (refused: the engine is closed) instead of hanging.
/// With the listener under the admin mutex: "shrink did not return
/// (deadlock?)".
#[test]
fn a_listener_may_close_the_engine_from_an_evicting_shrink() {
    let (e, _r) = open(vec![DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(8 * SLOT), SLOT),
    }]);
    assert!(store(&e, &[1, 2, 3, 4, 5, 6], 100));
    let l = calling_back(&e, Engine::close);
    let e2 = e.clone();
    let r = returns("shrink", move || {
        e2.resize_device_to(
            daxkv::engine::DeviceId(0),
            2 * SLOT,
            daxkv::engine::ShrinkMode::Evict,
            true,
            |_, _| Ok(()),
        )
    });
    eprintln!("shrink: {r:?}");
    assert!(
        l.told.load(Ordering::SeqCst) >= 4,
        "the evicted keys were told"
    );
    assert_eq!(
        e.status()["closing"],
        true,
        "the listener closed the engine"
    );
    let e2 = e.clone();
    let add = returns("an add after the close", move || {
        e2.hotplug_add("memfd", 4 * SLOT, |_, _| Ok(()))
    });
    assert_eq!(add.unwrap_err().status(), 503, "refused: closing");
    let e2 = e.clone();
    returns("a close after the close", move || e2.close());
}

/// `device_index` is the index `status()` shows (the device id:
/// tombstones keep theirs), also once a device before it was removed:
/// with devices 0, 1, 2 and device 0 removed, a drain of `device_index`
/// 1 drains device 1 (`memfd:b`), and index 0 is gone (404). Failed with
/// the index taken as a position in the list of live devices (which a
/// removed device leaves): index 1 drained device 2 (`memfd:c`), the
/// wrong device, and a resize or an evicting remove there would have hit
/// it as well.
#[test]
fn a_device_index_names_the_status_index_after_a_removal() {
    let (e, r) = open(vec![memfd(8)]);
    for name in ["memfd:b", "memfd:c"] {
        r.reconfigure(
            "add",
            &json!({"device_path": name, "size_bytes": 4 * SLOT}),
            None,
        )
        .unwrap();
    }
    r.reconfigure("remove", &json!({"device_index": 0, "mode": "evict"}), None)
        .unwrap();
    let shown: Vec<(Value, Value)> = e.status()["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["index"].clone(), d["device_path"].clone()))
        .collect();
    assert_eq!(shown[1], (json!(1), json!("memfd:b")), "{shown:?}");
    let out = r
        .reconfigure("remove", &json!({"device_index": 1, "mode": "drain"}), None)
        .unwrap();
    assert_eq!(
        (out["index"].clone(), out["device_path"].clone()),
        (json!(1), json!("memfd:b")),
        "{out}"
    );
    let states: Vec<DeviceState> = e.devices().iter().map(|d| d.state).collect();
    assert_eq!(
        states,
        [
            DeviceState::Removed,
            DeviceState::Draining,
            DeviceState::Active
        ]
    );
    let err = r
        .reconfigure("remove", &json!({"device_index": 0}), None)
        .unwrap_err();
    assert_eq!(err.status, 404);
    e.close();
}

/// An operator's controller adds and removes devices for weeks: every
/// remove leaves a tombstone (ids are never reused), and an `add` must
/// not get slower with each. Its answer carries the new device's status
/// entry, which was cut out of a whole `status()` built for it: every
/// tombstone's JSON on every add, ~13 µs each, so that after 3000 cycles
/// an add took 40 ms instead of 2 (quadratic over the run). Checked as a
/// ratio between the first cycles and cycles after 2000 tombstones, with
/// room for a busy machine; the answer's entry is still the status one.
#[test]
fn add_does_not_slow_down_with_tombstones() {
    const WARM: usize = 100;
    const TOMBSTONES: usize = 2000;
    let e = Arc::new(Engine::open(vec![memfd(16)], SLOT, true, EngineOptions::default()).unwrap());
    let r = DaxReconfigure::new(e.clone(), |_, _, _| Ok(()));
    let cycle = || {
        let t0 = Instant::now();
        let a = r
            .reconfigure(
                "add",
                &json!({"device_path": "memfd:c", "size_bytes": 64 * SLOT}),
                None,
            )
            .unwrap();
        let took = t0.elapsed();
        r.reconfigure(
            "remove",
            &json!({"device_path": "memfd:c", "mode": "evict", "force": true}),
            None,
        )
        .unwrap();
        (took, a)
    };
    // The minimum of a batch: what the add costs, not what the machine
    // did meanwhile.
    let batch = |n: usize| (0..n).map(|_| cycle().0).min().unwrap();
    let early = batch(WARM);
    for _ in WARM..TOMBSTONES {
        cycle();
    }
    let late = batch(WARM);
    assert!(
        late < early * 5 + Duration::from_micros(500),
        "an add took {late:?} after {TOMBSTONES} tombstones, {early:?} at first"
    );
    let a = r
        .reconfigure(
            "add",
            &json!({"device_path": "memfd:d", "size_bytes": 64 * SLOT}),
            None,
        )
        .unwrap();
    let index = a["device"]["index"].as_u64().unwrap() as usize;
    assert_eq!(index, TOMBSTONES + WARM + 1);
    assert_eq!(a["device"], e.status()["devices"][index]);
    assert_eq!(a["device"]["state"], "active");
    assert_eq!(a["device"]["max_slots"], 64);
}
