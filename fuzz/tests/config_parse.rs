//! The engine config as `daxkv serve --config` reads it: LMCache's adapter
//! JSON and the same keys in TOML, from documents built of the known keys
//! with values of every JSON type (and raw bytes in either format).
//!
//! What must hold: nothing panics; a refusal names its field, and that
//! field is in the document (or is a required one, or `(document)`); a
//! document that parses keeps what it was given (slot size, worker counts,
//! the NUMA node, device sizes within the largest device) and parses to
//! the same config again when written back; and the TOML form of a
//! document is read exactly as its JSON form (same config, or the same
//! error).
//!
//! `cargo test -p daxkv-fuzz --test config_parse` runs it on random inputs
//! (bounded: [`ITERATIONS`] documents or `BOLERO_RANDOM_TEST_TIME_MS`);
//! `cargo +nightly bolero test -p daxkv-fuzz --test config_parse
//! config_parse` runs it coverage-guided.

use std::path::Path;
use std::sync::LazyLock;

use bolero::{check, TypeGenerator};
use daxkv::cli::serve::load_config;
use daxkv::control::config::{self, EngineConfig, DAXKV_KEYS, LMCACHE_KEYS, MAX_DEVICE_BYTES};
use daxkv::host::numa::Placement;
use serde_json::{json, Map, Value};

/// Documents per plain `cargo test` run (a few seconds on a 2-vCPU VM).
const ITERATIONS: usize = 3000;

/// Every key the config reads or accepts, from the config's own lists (so
/// a key added there is fuzzed here), and one it does not know: `type`,
/// daxkv's keys, LMCache's others, `typo_key`.
static KEYS: LazyLock<Vec<&'static str>> = LazyLock::new(|| {
    let mut k = vec!["type"];
    k.extend_from_slice(DAXKV_KEYS);
    k.extend(LMCACHE_KEYS.iter().filter(|&&k| k != "type"));
    k.push("typo_key");
    k
});

/// A device entry's keys, and one it does not know.
static DEVICE_KEYS: LazyLock<Vec<&'static str>> = LazyLock::new(|| {
    let mut k = config::DEVICE_KEYS.to_vec();
    k.push("bogus");
    k
});

#[derive(Clone, Debug, TypeGenerator)]
enum Str {
    Dax,
    Memfd,
    MemfdNamed(u8),
    Auto,
    Off,
    Always,
    WhenWaiting,
    Sys,
    Any(String),
}

#[derive(Clone, Debug, TypeGenerator)]
enum Val {
    Null,
    Bool(bool),
    Small(u16),
    Int(i64),
    UInt(u64),
    Float(f64),
    Gib(u8),
    Str(Str),
    List(Vec<u16>),
    Empty,
    /// `hi << 32 | lo`: past u32, with the low half of a small number.
    Wide(u8, u8),
    /// A value valid for the key it is given to (`n` picks among them).
    Good(u16),
}

/// A key and its value: valid for the key (`good(key, n)`) unless `bad`
/// is given and `really` set.
#[derive(Clone, Debug, TypeGenerator)]
struct Field {
    key: u8,
    n: u16,
    bad: Option<Val>,
    really: bool,
}

#[derive(Clone, Debug, TypeGenerator)]
struct Doc {
    fields: Vec<Field>,
    /// `devices`: a list of entries, each a list of fields.
    devices: Option<Vec<Vec<Field>>>,
    /// Start from a valid document (one memfd device, hotplug on) that
    /// the fields then change.
    base: bool,
    /// Raw bytes read as a JSON and as a TOML file instead.
    raw: Option<Vec<u8>>,
}

fn string(s: &Str) -> String {
    match s {
        Str::Dax => "dax".into(),
        Str::Memfd => "memfd".into(),
        Str::MemfdNamed(n) => format!("memfd:d{}", n % 4),
        Str::Auto => "auto".into(),
        Str::Off => "off".into(),
        Str::Always => "always".into(),
        Str::WhenWaiting => "when_waiting".into(),
        Str::Sys => "/sys".into(),
        Str::Any(s) => s.clone(),
    }
}

/// A valid value for `key`, picked by `n`.
fn good(key: &str, n: u16) -> Value {
    let n64 = u64::from(n);
    match key {
        "type" => json!("dax"),
        "slot_bytes" => json!(1 + n64 * 64),
        "hotplug_enabled" | "prefault" => json!(n.is_multiple_of(2)),
        "num_store_workers" | "num_lookup_workers" | "num_load_workers" => json!(1 + n64 % 8),
        "numa" => match n % 3 {
            0 => json!("auto"),
            1 => json!("off"),
            _ => json!(0),
        },
        "cpus" => json!([0]),
        "spin_us" | "wait_spin_us" | "watch_interval_seconds" => json!(n),
        "task_slots" | "task_keys" => json!(1 + n64),
        "sysfs_root" => json!("/sys"),
        "signal" => json!(if n.is_multiple_of(2) {
            "always"
        } else {
            "when_waiting"
        }),
        "device_path" => json!(format!("memfd:g{}", n % 3)),
        "max_dax_size_gb" | "max_size_gb" => json!(f64::from(n % 64 + 1) / 16.0),
        _ => json!(n),
    }
}

fn value(key: &str, v: &Val) -> Value {
    match v {
        Val::Good(n) => good(key, *n),
        Val::Wide(hi, lo) => json!((u64::from(*hi) + 1) << 32 | u64::from(*lo % 4)),
        Val::Null => Value::Null,
        Val::Bool(b) => json!(b),
        Val::Small(n) => json!(n),
        Val::Int(n) => json!(n),
        Val::UInt(n) => json!(n),
        Val::Float(f) => json!(f), // NaN and infinities become null
        Val::Gib(n) => json!(f64::from(*n) / 64.0),
        Val::Str(s) => json!(string(s)),
        Val::List(l) => json!(l),
        Val::Empty => json!({}),
    }
}

fn field(keys: &[&'static str], f: &Field) -> (&'static str, Value) {
    let k = keys[usize::from(f.key) % keys.len()];
    let v = match (&f.bad, f.really) {
        (Some(v), true) => value(k, v),
        _ => good(k, f.n),
    };
    (k, v)
}

fn document(d: &Doc) -> Value {
    let mut obj = Map::new();
    if d.base {
        obj.insert("slot_bytes".into(), json!(4096));
        obj.insert("hotplug_enabled".into(), json!(true));
        obj.insert(
            "devices".into(),
            json!([{"device_path": "memfd", "max_dax_size_gb": 0.25}]),
        );
    }
    for f in d.fields.iter().take(8) {
        let (k, v) = field(&KEYS, f);
        obj.insert(k.into(), v);
    }
    if let Some(list) = &d.devices {
        let list: Vec<Value> = list
            .iter()
            .take(4)
            .map(|fields| {
                let mut e = Map::new();
                for f in fields.iter().take(5) {
                    let (k, v) = field(&DEVICE_KEYS, f);
                    e.insert(k.into(), v);
                }
                Value::Object(e)
            })
            .collect();
        obj.insert("devices".into(), Value::Array(list));
    }
    Value::Object(obj)
}

/// `v` as a TOML value, `None` where TOML has no form for it (null, an
/// integer past i64).
fn toml_value(v: &Value) -> Option<String> {
    Some(match v {
        Value::Null => return None,
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                i.to_string()
            } else if n.is_u64() {
                return None;
            } else {
                let f = n.as_f64()?;
                let s = format!("{f:?}");
                if s.contains(['.', 'e']) {
                    s
                } else {
                    format!("{s}.0")
                }
            }
        }
        // A JSON string literal is a TOML basic string.
        Value::String(s) => serde_json::to_string(s).ok()?,
        Value::Array(a) => {
            let items: Option<Vec<String>> = a.iter().map(toml_value).collect();
            format!("[{}]", items?.join(", "))
        }
        Value::Object(o) => {
            let items: Option<Vec<String>> = o
                .iter()
                .map(|(k, v)| {
                    Some(format!(
                        "{} = {}",
                        serde_json::to_string(k).ok()?,
                        toml_value(v)?
                    ))
                })
                .collect();
            format!("{{ {} }}", items?.join(", "))
        }
    })
}

fn toml_document(v: &Value) -> Option<String> {
    let o = v.as_object()?;
    let mut out = String::new();
    for (k, v) in o {
        out.push_str(&format!(
            "{} = {}\n",
            serde_json::to_string(k).ok()?,
            toml_value(v)?
        ));
    }
    Some(out)
}

/// The JSON a parsed config writes back to: every field it holds.
fn written_back(c: &EngineConfig) -> Value {
    let devices: Vec<Value> = c
        .devices
        .iter()
        .map(|d| {
            let mut e = json!({
                "device_path": d.device_path,
                "max_dax_size_gb": d.max_dax_size_bytes as f64 / (1u64 << 30) as f64,
            });
            if let Some(m) = d.max_size_bytes {
                e["max_size_gb"] = json!(m as f64 / (1u64 << 30) as f64);
            }
            e
        })
        .collect();
    let mut v = json!({
        "type": "dax",
        "slot_bytes": c.slot_bytes,
        "devices": devices,
        "hotplug_enabled": c.hotplug_enabled,
        "num_store_workers": c.num_store_workers,
        "num_lookup_workers": c.num_lookup_workers,
        "num_load_workers": c.num_load_workers,
        "spin_us": c.spin.as_micros() as u64,
        "wait_spin_us": c.wait_spin.as_micros() as u64,
        "prefault": c.prefault,
        "task_slots": c.task_slots,
        "task_keys": c.task_keys,
        "sysfs_root": c.sysfs_root.to_str().unwrap(),
        "signal": match c.signal {
            daxkv::engine::Signal::Always => "always",
            daxkv::engine::Signal::WhenWaiting => "when_waiting",
        },
    });
    match &c.placement {
        Placement::Auto => v["numa"] = json!("auto"),
        Placement::Off => v["numa"] = json!("off"),
        Placement::Node(n) => v["numa"] = json!(n),
        Placement::Cpus(c) => v["cpus"] = json!(c),
    }
    v
}

/// A refusal names a field of the document, a required one, or the
/// document itself.
fn check_field(doc: &Value, field: &str, why: &str) {
    assert!(!field.is_empty() && !why.is_empty(), "{field}: {why}");
    let root = field.split(['.', '[']).next().unwrap();
    let known = root == "(document)"
        || doc.get(root).is_some()
        || ["slot_bytes", "devices", "device_path", "max_dax_size_gb"].contains(&root);
    assert!(known, "error names {field:?}, not in {doc}: {why}");
}

fn check_parsed(doc: &Value, c: &EngineConfig) {
    assert_eq!(Some(c.slot_bytes as u64), doc["slot_bytes"].as_u64());
    for (field, got) in [
        ("num_store_workers", c.num_store_workers),
        ("num_lookup_workers", c.num_lookup_workers),
        ("num_load_workers", c.num_load_workers),
        ("task_slots", c.task_slots),
        ("task_keys", c.task_keys),
    ] {
        if let Some(n) = doc.get(field) {
            assert_eq!(n.as_u64(), Some(got as u64), "{field} in {doc}");
        }
    }
    if let (Some(n), None) = (doc.get("numa").and_then(Value::as_u64), doc.get("cpus")) {
        assert_eq!(c.placement, Placement::Node(n as u32), "{doc}");
        assert_eq!(u64::from(n as u32), n, "numa {n} read as node {}", n as u32);
    }
    for d in &c.devices {
        assert!(d.max_dax_size_bytes >= c.slot_bytes, "{d:?}");
        assert!(d.max_dax_size_bytes <= MAX_DEVICE_BYTES, "{d:?}");
        if let Some(m) = d.max_size_bytes {
            assert!(m >= d.max_dax_size_bytes, "{d:?}");
            assert!(
                m <= MAX_DEVICE_BYTES,
                "max_size_gb beyond the largest device: {d:?}"
            );
        }
    }
    assert!(c.hotplug_enabled || !c.devices.is_empty());
    // Written back, it reads the same.
    let back = written_back(c);
    let again = EngineConfig::from_value(&back)
        .unwrap_or_else(|e| panic!("{doc} parsed, written back as {back} it does not: {e}"));
    assert_eq!(&again, c, "written back as {back}");
}

fn load(dir: &Path, name: &str, bytes: &[u8]) -> Result<EngineConfig, String> {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    load_config(Some(&p)).map_err(|e| {
        let msg = e.to_string();
        // `--config PATH: why`.
        let prefix = format!("--config {}: ", p.display());
        assert!(msg.starts_with(&prefix), "{msg}");
        msg[prefix.len()..].to_string()
    })
}

fn run(d: &Doc) {
    let dir = tempfile::Builder::new()
        .prefix("daxkv-fuzz-config")
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    if let (Some(raw), false) = (&d.raw, d.base) {
        let j = load(dir.path(), "c.json", raw);
        let t = load(dir.path(), "c.toml", raw);
        for r in [j, t] {
            if let Err(why) = r {
                assert!(!why.is_empty());
            }
        }
        return;
    }
    let doc = document(d);
    let text = doc.to_string();
    match EngineConfig::from_json(&text) {
        Ok(c) => {
            if std::env::var_os("CONFIG_PARSE_STATS").is_some() {
                eprintln!("parsed {text}");
            }
            check_parsed(&doc, &c);
        }
        Err(e) => check_field(&doc, &e.field, &e.rule),
    }
    let j = load(dir.path(), "c.json", text.as_bytes());
    assert_eq!(
        j.as_ref().map_err(|_| ()).ok(),
        EngineConfig::from_json(&text).ok().as_ref(),
        "serve's JSON reader and EngineConfig::from_json differ on {text}"
    );
    if let Some(toml) = toml_document(&doc) {
        let t = load(dir.path(), "c.TOML", toml.as_bytes());
        assert_eq!(t, j, "TOML\n{toml}\nand JSON {text} read differently");
    }
}

#[test]
fn config_parse() {
    check!()
        .with_iterations(ITERATIONS)
        .with_type::<Doc>()
        .for_each(run);
}
