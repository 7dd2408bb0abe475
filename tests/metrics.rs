//! Engine metrics: real stores, lookups, loads, unlocks and deletes on a
//! memfd device, then `daxkv::control::metrics::encode` parsed back and checked for
//! exact counter values, histogram shape, and text-format validity (every
//! sample after its family's TYPE line, label values escaped and read back).
// Counter values are small integers, exact in f64: compared exactly.
#![allow(clippy::float_cmp)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{
    DeviceSpec, Engine, EngineOptions, HotplugOp, HotplugOutcome, DURATION_BUCKETS,
};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key};

const SLOT: usize = 4096;
const T: Duration = Duration::from_secs(10);
/// A device path with every character the text format must escape.
const WEIRD: &str = "/dev/we\"ird\\dax\nx";

fn k(i: u32) -> Key {
    Key::digest(format!("metrics-{i}").as_bytes())
}

fn open(path: &str, opts: EngineOptions) -> Engine {
    let dev = DeviceSpec {
        path: path.into(),
        core: CoreConfig::new(ArenaSpec::memfd(16 * SLOT), SLOT),
    };
    Engine::open(vec![dev], SLOT, false, opts).unwrap()
}

/// One sample: name, labels, value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parse the text format strictly enough to catch what Prometheus rejects:
/// HELP then TYPE before a family's first sample, one TYPE per family,
/// families contiguous, label values with only the three escapes.
fn parse(text: &str) -> Vec<Sample> {
    assert!(text.ends_with('\n'), "the text ends with a newline");
    let mut typed: HashMap<String, String> = HashMap::new();
    let mut done: HashSet<String> = HashSet::new();
    let mut current: Option<String> = None;
    let mut helped: Option<String> = None;
    let mut out = Vec::new();
    for line in text.lines() {
        assert!(!line.is_empty(), "no empty lines");
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap();
            helped = Some(name.to_string());
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split(' ');
            let (name, ty) = (it.next().unwrap(), it.next().unwrap());
            assert!(it.next().is_none(), "{line}");
            assert!(["counter", "gauge", "histogram"].contains(&ty), "type {ty}");
            assert_eq!(helped.as_deref(), Some(name), "HELP precedes TYPE: {line}");
            assert!(
                typed.insert(name.into(), ty.into()).is_none(),
                "one TYPE: {name}"
            );
            if let Some(c) = current.replace(name.into()) {
                done.insert(c);
            }
            continue;
        }
        assert!(!line.starts_with('#'), "unknown comment {line}");
        let s = parse_sample(line);
        let fam = current.as_deref().expect("a sample before any TYPE line");
        let ty = &typed[fam];
        let ok = if ty == "histogram" {
            [
                format!("{fam}_bucket"),
                format!("{fam}_sum"),
                format!("{fam}_count"),
            ]
            .contains(&s.name)
        } else {
            s.name == fam
        };
        assert!(ok, "sample {} under family {fam} ({ty})", s.name);
        if ty == "counter" {
            assert!(fam.ends_with("_total"), "counter {fam} ends in _total");
        }
        assert!(!done.contains(fam), "family {fam} not contiguous");
        out.push(s);
    }
    out
}

fn parse_sample(line: &str) -> Sample {
    let name_end = line.find(['{', ' ']).unwrap();
    let name = &line[..name_end];
    assert!(
        name.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
        "name {name}"
    );
    let mut labels = BTreeMap::new();
    let mut rest = &line[name_end..];
    if let Some(r) = rest.strip_prefix('{') {
        let mut chars = r.char_indices().peekable();
        loop {
            let (start, c) = chars.next().expect("unterminated labels");
            if c == '}' {
                rest = &r[start + 1..];
                break;
            }
            let eq = r[start..].find('=').unwrap() + start;
            let lname = r[start..eq].to_string();
            while chars.peek().unwrap().0 < eq {
                chars.next();
            }
            assert_eq!(chars.next().unwrap().1, '=');
            assert_eq!(chars.next().unwrap().1, '"', "label value quoted");
            let mut v = String::new();
            loop {
                match chars.next().expect("unterminated value").1 {
                    '"' => break,
                    '\\' => match chars.next().unwrap().1 {
                        '\\' => v.push('\\'),
                        '"' => v.push('"'),
                        'n' => v.push('\n'),
                        e => panic!("bad escape \\{e} in {line}"),
                    },
                    '\n' => panic!("raw newline"),
                    c => v.push(c),
                }
            }
            assert!(labels.insert(lname, v).is_none(), "duplicate label");
            if chars.peek().unwrap().1 == ',' {
                chars.next();
            }
        }
    }
    let value = rest.strip_prefix(' ').expect("one space before the value");
    let value = match value {
        "+Inf" => f64::INFINITY,
        v => v
            .parse()
            .unwrap_or_else(|_| panic!("value {v:?} in {line}")),
    };
    Sample {
        name: name.into(),
        labels,
        value,
    }
}

/// The value of the one sample `name{labels}` (labels given as pairs; the
/// sample's labels must be exactly these).
fn get(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let want: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect();
    let hits: Vec<_> = samples
        .iter()
        .filter(|s| s.name == name && s.labels == want)
        .collect();
    assert_eq!(hits.len(), 1, "{name} {labels:?}");
    hits[0].value
}

#[test]
fn counters_histograms_and_text_format() {
    let e = open(WEIRD, EngineOptions::default());
    // 3 store tasks of 2 keys, 1000-byte payloads.
    for t in 0..3 {
        let keys = vec![k(2 * t), k(2 * t + 1)];
        let bufs = vec![Buf::from(vec![1u8; 1000]), Buf::from(vec![2u8; 1000])];
        let id = e.submit_store(keys, bufs).unwrap();
        assert!(e.wait_store(id, T).ready().unwrap().success);
    }
    // A lookup of 2 hits and 1 miss.
    let id = e.submit_lookup_and_lock(vec![k(0), k(1), k(99)]).unwrap();
    assert_eq!(e.wait_lookup(id, T).ready().unwrap().count_ones(), 2);
    // A load of 2 hits and 1 miss.
    let id = e
        .submit_load(vec![k(2), k(3), k(98)], vec![vec![0u8; SLOT]; 3])
        .unwrap();
    let got = e.wait_load(id, T).ready().unwrap();
    assert_eq!(got.bitmap.count_ones(), 2);
    // Unlock the two locked keys; delete 2 present and 1 missing key.
    e.submit_unlock(&[k(0), k(1)]);
    assert_eq!(e.delete(&[k(4), k(5), k(97)]).len(), 2);
    e.record_hotplug(HotplugOp::Add, HotplugOutcome::Ok);
    e.record_hotplug(HotplugOp::Add, HotplugOutcome::Ok);
    e.record_hotplug(HotplugOp::Resize, HotplugOutcome::Rejected);

    let text = daxkv::control::metrics::encode(&e);
    let s = parse(&text);
    let ops = |op| get(&s, "daxkv_ops_total", &[("op", op)]);
    let keys = |op, r| get(&s, "daxkv_keys_total", &[("op", op), ("result", r)]);
    let bytes = |op| get(&s, "daxkv_bytes_total", &[("op", op)]);
    assert_eq!(ops("store"), 3.0);
    assert_eq!(keys("store", "ok"), 6.0);
    assert_eq!(keys("store", "miss_or_fail"), 0.0);
    assert_eq!(bytes("store"), 6000.0);
    assert_eq!(ops("lookup"), 1.0);
    assert_eq!(keys("lookup", "ok"), 2.0);
    assert_eq!(keys("lookup", "miss_or_fail"), 1.0);
    assert_eq!(ops("load"), 1.0);
    assert_eq!(keys("load", "ok"), 2.0);
    assert_eq!(keys("load", "miss_or_fail"), 1.0);
    assert_eq!(bytes("load"), 2000.0);
    assert_eq!(ops("unlock"), 1.0);
    assert_eq!(keys("unlock", "ok"), 2.0);
    assert_eq!(ops("delete"), 1.0);
    assert_eq!(keys("delete", "ok"), 2.0);
    assert_eq!(keys("delete", "miss_or_fail"), 1.0);
    let hp = |o, r| {
        get(
            &s,
            "daxkv_hotplug_operations_total",
            &[("operation", o), ("outcome", r)],
        )
    };
    assert_eq!(hp("add", "ok"), 2.0);
    assert_eq!(hp("resize", "rejected"), 1.0);
    assert_eq!(hp("drain", "failed"), 0.0);
    assert_eq!(get(&s, "daxkv_worker_panics_total", &[]), 0.0);

    // Histograms: count per op, cumulative buckets monotone, +Inf = count.
    let name = "daxkv_task_duration_seconds";
    for (op, n) in [("store", 3.0), ("lookup", 1.0), ("load", 1.0)] {
        assert_eq!(get(&s, &format!("{name}_count"), &[("op", op)]), n);
        assert!(get(&s, &format!("{name}_sum"), &[("op", op)]) > 0.0);
        let buckets: Vec<(f64, f64)> = s
            .iter()
            .filter(|x| x.name == format!("{name}_bucket") && x.labels["op"] == op)
            .map(|x| {
                let le = &x.labels["le"];
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap()
                };
                (le, x.value)
            })
            .collect();
        assert_eq!(buckets.len(), DURATION_BUCKETS.len() + 1);
        for w in buckets.windows(2) {
            assert!(w[0].0 < w[1].0, "le increasing");
            assert!(w[0].1 <= w[1].1, "cumulative counts monotone: {op}");
        }
        assert_eq!(buckets.last().unwrap(), &(f64::INFINITY, n));
    }

    // Devices: the weird path read back through the escapes; a state set.
    let dev = [("device", "0"), ("path", WEIRD)];
    assert_eq!(get(&s, "daxkv_slots_total", &dev), 16.0);
    assert_eq!(get(&s, "daxkv_slots_used", &dev), 4.0);
    for st in ["active", "draining", "removed", "failed"] {
        let want = if st == "active" { 1.0 } else { 0.0 };
        let l = [dev[0], dev[1], ("state", st)];
        assert_eq!(get(&s, "daxkv_device_state", &l), want);
    }
    assert!(text.contains(r#"path="/dev/we\"ird\\dax\nx""#), "{text}");

    // The same numbers in status().
    let st = e.status();
    assert_eq!(st["metrics"]["ops"]["store"], 3);
    assert_eq!(st["metrics"]["bytes"]["load"], 2000);
    assert_eq!(st["metrics"]["duration_count"]["store"], 3);
    assert_eq!(st["metrics"]["hotplug"]["add"]["ok"], 2);
    assert_eq!(
        daxkv::control::metrics::encode(&e).lines().count(),
        text.lines().count()
    );
}

#[test]
fn worker_panic_and_failed_keys_are_counted() {
    let opts = EngineOptions {
        panic_on_key: Some(k(666)),
        ..EngineOptions::default()
    };
    let e = open("memfd", opts);
    let id = e.submit_lookup_and_lock(vec![k(1), k(666)]).unwrap();
    assert_eq!(e.wait_lookup(id, T).ready().unwrap().count_ones(), 0);
    let s = parse(&daxkv::control::metrics::encode(&e));
    assert_eq!(get(&s, "daxkv_worker_panics_total", &[]), 1.0);
    assert_eq!(
        get(
            &s,
            "daxkv_keys_total",
            &[("op", "lookup"), ("result", "miss_or_fail")]
        ),
        2.0
    );
    assert_eq!(
        get(&s, "daxkv_task_duration_seconds_count", &[("op", "lookup")]),
        1.0
    );
}

#[test]
fn handler_serves_the_text() {
    let e = std::sync::Arc::new(open("memfd", EngineOptions::default()));
    let h = daxkv::control::metrics::handler(e.clone());
    let text = h();
    parse(&text);
    assert!(text.contains("daxkv_ops_total{op=\"store\"} 0\n"));
    assert!(daxkv::control::metrics::CONTENT_TYPE.contains("version=0.0.4"));
}

/// `encode_labeled` puts the constant label on every sample (with and
/// without labels of its own, histogram buckets included), escapes its
/// value, keeps the text valid, and leaves values unchanged.
#[test]
fn constant_labels_reach_every_sample() {
    let e = open(WEIRD, EngineOptions::default());
    let id = e
        .submit_store(vec![k(1)], vec![Buf::from(vec![7u8; 100])])
        .unwrap();
    assert!(e.wait_store(id, T).ready().unwrap().success);
    let plain = parse(&daxkv::control::metrics::encode(&e));
    let name = "l2 \"a\"\\b";
    let text = daxkv::control::metrics::encode_labeled(&e, &[("l2_name", name)]);
    let labeled = parse(&text);
    assert_eq!(plain.len(), labeled.len(), "one sample per sample");
    for (p, l) in plain.iter().zip(&labeled) {
        assert_eq!(p.name, l.name);
        assert_eq!(p.value.to_bits(), l.value.to_bits(), "{}", p.name);
        let mut want = p.labels.clone();
        assert!(want.insert("l2_name".into(), name.into()).is_none());
        assert_eq!(want, l.labels, "{}", p.name);
    }
    // A sample without labels of its own and a histogram bucket.
    assert!(text.contains("daxkv_worker_panics_total{l2_name=\"l2 \\\"a\\\"\\\\b\"} 0\n"));
    assert!(text.contains("daxkv_task_duration_seconds_bucket{l2_name="));
    // No labels: the text as it was.
    assert_eq!(
        daxkv::control::metrics::with_const_labels("a 1\n# x\nb{c=\"d\"} 2\n", &[]),
        "a 1\n# x\nb{c=\"d\"} 2\n"
    );
    assert_eq!(
        daxkv::control::metrics::with_const_labels("a 1\nb{c=\"d\"} 2\nz{} 3\n", &[("l", "v")]),
        "a{l=\"v\"} 1\nb{l=\"v\",c=\"d\"} 2\nz{l=\"v\"} 3\n"
    );
}

#[test]
#[should_panic(expected = "invalid Prometheus label name")]
fn constant_label_names_are_checked() {
    daxkv::control::metrics::with_const_labels("a 1\n", &[("l2-name", "x")]);
}

/// A controller that adds and removes devices for weeks: every removed
/// device stays a tombstone in `status()` (ids are never reused), but
/// its series leave `/metrics` (as a gone disk's do in node_exporter):
/// were they kept, each would hold 12 series for ever (`slots_used`, `slots_total`,
/// the two lease gauges and the 8-state set), so that 3000 cycles would make a
/// 2.2 MB scrape of 36 000 dead series, growing with every cycle.
#[test]
fn removed_devices_leave_metrics() {
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(16 * SLOT), SLOT),
    };
    let e = Engine::open(vec![dev], SLOT, true, EngineOptions::default()).unwrap();
    let device_lines = |e: &Engine| {
        daxkv::control::metrics::encode(e)
            .lines()
            .filter(|l| l.contains("device=\""))
            .count()
    };
    let before = device_lines(&e);
    assert_eq!(
        before, 12,
        "one device: used, total, leases, lease age and 8 states"
    );
    for c in 0..50 {
        let id = e
            .add_device(&DeviceSpec {
                path: format!("memfd:c{c}"),
                core: CoreConfig::new(ArenaSpec::memfd(16 * SLOT), SLOT),
            })
            .unwrap();
        assert_eq!(device_lines(&e), 24, "cycle {c}: a live device shows");
        e.remove_device(id, daxkv::engine::RemoveMode::Evict, true)
            .unwrap();
    }
    assert_eq!(
        device_lines(&e),
        before,
        "removed devices left series behind"
    );
    assert_eq!(e.devices().len(), 51, "tombstones still in the device list");
}
