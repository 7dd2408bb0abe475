//! # Prometheus text exposition of an engine's metrics
//!
//! [`encode`] renders [`Engine::metrics`] and [`Engine::devices`] in the
//! Prometheus text format 0.0.4 (serve it with [`CONTENT_TYPE`]); an HTTP
//! server that takes a `Fn() -> String` gets one from [`handler`]. There is
//! no global registry: each call reads one engine. [`encode_labeled`] adds
//! constant labels to every sample (the LMCache faces add `l2_name`).
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `daxkv_slots_used` | gauge | `device`, `path` |
//! | `daxkv_slots_total` | gauge | `device`, `path` |
//! | `daxkv_device_state` | gauge | `device`, `path`, `state` |
//! | `daxkv_ops_total` | counter | `op` |
//! | `daxkv_keys_total` | counter | `op`, `result` (`ok`, `miss_or_fail`) |
//! | `daxkv_bytes_total` | counter | `op` (`store`, `load`) |
//! | `daxkv_task_duration_seconds` | histogram | `op` (`store`, `lookup`, `load`), `le` |
//! | `daxkv_hotplug_operations_total` | counter | `operation`, `outcome` |
//! | `daxkv_worker_panics_total` | counter | — |
//! | `daxkv_listener_panics_total` | counter | — |
//!
//! - `device` is the device id (never reused); `path` the path it was
//!   opened from, escaped (`\` → `\\`, `"` → `\"`, newline → `\n`).
//! - `daxkv_device_state` is a state set: every device has one series per
//!   state (`active`, `draining`, `migrating`, `resizing`, `removing`,
//!   `closed`, `failed`, `removed`), 1 for its current state and 0 for the
//!   others, so a series never disappears when a device changes state and
//!   `daxkv_device_state{state="failed"} == 1` is an alert rule. A
//!   removed device's series leave the scrape (it stays a tombstone in
//!   `status()`); `daxkv_hotplug_operations_total` counts the removes.
//! - `op` is `store`, `lookup`, `load` (tasks, counted when published by a
//!   worker) and `unlock`, `delete` (calls, counted on the caller). What
//!   each counts: [`crate::engine::Metrics`]'s module doc.
//! - The counters are recorded by the engine as per-worker cache-padded
//!   atomics (no lock, no allocation on the data path) and summed here,
//!   at scrape time; `prometheus-client` was measured against this and
//!   rejected for the data path (benches/metrics.rs; docs/performance.md, "Metrics on the data path").

#![forbid(unsafe_code)]

use std::fmt::Write;
use std::sync::Arc;

use crate::engine::{
    DeviceInfo, DeviceState, Engine, HotplugOp, HotplugOutcome, MetricsSnapshot, Op, TaskKind,
    DURATION_BUCKETS,
};

/// The `Content-Type` of [`encode`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Every device state, in the order the state set lists them.
const STATES: [DeviceState; 8] = [
    DeviceState::Active,
    DeviceState::Draining,
    DeviceState::Migrating,
    DeviceState::Resizing,
    DeviceState::Removing,
    DeviceState::Closed,
    DeviceState::Failed,
    DeviceState::Removed,
];

/// A label value escaped for the text format (`\`, `"`, newline).
pub fn escape_label_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// The `# HELP` and `# TYPE` lines of one metric family.
fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// `engine`'s metrics in the Prometheus text format 0.0.4 (module doc).
/// A scrape: reads every counter shard once and the device list; cold
/// path (it allocates the text).
pub fn encode(engine: &Engine) -> String {
    let m = engine.metrics();
    let mut devices = engine.devices();
    // A removed device is a tombstone for ever (ids are never reused):
    // its series leave the scrape, or every add / remove cycle of a
    // long-running server would add 10 dead ones for good.
    devices.retain(|d| d.state != DeviceState::Removed);
    let mut out = String::with_capacity(8192);
    encode_devices(&mut out, &devices);
    encode_ops(&mut out, &m);
    encode_durations(&mut out, &m);
    encode_engine(&mut out, &m);
    out
}

/// [`encode`] with constant labels added to every sample, first in its
/// label set: `encode_labeled(&engine, &[("l2_name", "dax0")])` is what the
/// LMCache faces serve, so one scrape target can carry several adapters.
/// Label names must be valid Prometheus names (`[a-zA-Z_][a-zA-Z0-9_]*`,
/// not starting with `__`); values are escaped here.
///
/// # Panics
/// On an invalid label name (a programming error, not input).
pub fn encode_labeled(engine: &Engine, labels: &[(&str, &str)]) -> String {
    with_const_labels(&encode(engine), labels)
}

/// Add `labels` to every sample line of a text-format document (comment
/// lines are kept as they are). Exposed for documents that append their
/// own families to [`encode`]'s (`daxkv serve --traffic`).
///
/// # Panics
/// On an invalid label name (see [`encode_labeled`]).
pub fn with_const_labels(text: &str, labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return text.to_string();
    }
    for (name, _) in labels {
        let mut bytes = name.bytes();
        let ok = bytes
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !name.starts_with("__");
        assert!(ok, "invalid Prometheus label name {name:?}");
    }
    let set: Vec<String> = labels
        .iter()
        .map(|(n, v)| format!("{n}=\"{}\"", escape_label_value(v)))
        .collect();
    let set = set.join(",");
    let mut out = String::with_capacity(text.len() + text.lines().count() * (set.len() + 3));
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            out.push_str(line);
        } else {
            // A metric name holds neither `{` nor a space: the first of
            // them ends it.
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            let (name, rest) = line.split_at(end);
            out.push_str(name);
            out.push('{');
            out.push_str(&set);
            match rest.strip_prefix('{') {
                Some(more) if more.starts_with('}') => out.push_str(more),
                Some(more) => {
                    out.push(',');
                    out.push_str(more);
                }
                None => {
                    out.push('}');
                    out.push_str(rest);
                }
            }
        }
        out.push('\n');
    }
    out
}

/// The device gauges.
fn encode_devices(out: &mut String, devices: &[DeviceInfo]) {
    let dev_labels: Vec<String> = devices
        .iter()
        .map(|d| {
            format!(
                "device=\"{}\",path=\"{}\"",
                d.id.0,
                escape_label_value(&d.path)
            )
        })
        .collect();

    header(
        out,
        "daxkv_slots_used",
        "gauge",
        "Slots holding a key (committed, in flight or pending free), per device.",
    );
    for (d, l) in devices.iter().zip(&dev_labels) {
        let _ = writeln!(out, "daxkv_slots_used{{{l}}} {}", d.live_slots);
    }
    header(
        out,
        "daxkv_slots_total",
        "gauge",
        "Slots a device can hold at its current size.",
    );
    for (d, l) in devices.iter().zip(&dev_labels) {
        let _ = writeln!(out, "daxkv_slots_total{{{l}}} {}", d.max_slots);
    }
    header(
        out,
        "daxkv_leases",
        "gauge",
        "Slot leases open on a device (store and read; docs/leases.md).",
    );
    for (d, l) in devices.iter().zip(&dev_labels) {
        let _ = writeln!(out, "daxkv_leases{{{l}}} {}", d.leases);
    }
    header(
        out,
        "daxkv_oldest_lease_age_seconds",
        "gauge",
        "Age of a device's oldest open slot lease (0 with none): a leaked lease is an age that only grows.",
    );
    for (d, l) in devices.iter().zip(&dev_labels) {
        let age = d.oldest_lease_age.map_or(0.0, |a| a.as_secs_f64());
        let _ = writeln!(out, "daxkv_oldest_lease_age_seconds{{{l}}} {age}");
    }
    header(
        out,
        "daxkv_device_state",
        "gauge",
        "Device state set: 1 for the current state, 0 for the others.",
    );
    for (d, l) in devices.iter().zip(&dev_labels) {
        for s in STATES {
            let _ = writeln!(
                out,
                "daxkv_device_state{{{l},state=\"{}\"}} {}",
                s.name(),
                u8::from(d.state == s)
            );
        }
    }
}

/// The per-op counters.
fn encode_ops(out: &mut String, m: &MetricsSnapshot) {
    header(
        out,
        "daxkv_ops_total",
        "counter",
        "Tasks (store, lookup, load) published and calls (unlock, delete) made.",
    );
    for op in Op::ALL {
        let _ = writeln!(
            out,
            "daxkv_ops_total{{op=\"{}\"}} {}",
            op.name(),
            m.ops[op.idx()]
        );
    }
    header(
        out,
        "daxkv_keys_total",
        "counter",
        "Keys of those tasks and calls, by result.",
    );
    for op in Op::ALL {
        for (result, v) in [
            ("ok", m.keys_ok[op.idx()]),
            ("miss_or_fail", m.keys_miss_or_fail[op.idx()]),
        ] {
            let _ = writeln!(
                out,
                "daxkv_keys_total{{op=\"{}\",result=\"{result}\"}} {v}",
                op.name()
            );
        }
    }
    header(
        out,
        "daxkv_bytes_total",
        "counter",
        "Payload bytes: of the keys stored (store), loaded (load).",
    );
    for op in [Op::Store, Op::Load] {
        let _ = writeln!(
            out,
            "daxkv_bytes_total{{op=\"{}\"}} {}",
            op.name(),
            m.bytes[op.idx()]
        );
    }
}

/// The task-duration histograms.
fn encode_durations(out: &mut String, m: &MetricsSnapshot) {
    let name = "daxkv_task_duration_seconds";
    header(
        out,
        name,
        "histogram",
        "Task duration from submit to publish, seconds.",
    );
    for kind in [TaskKind::Store, TaskKind::Lookup, TaskKind::Load] {
        let h = &m.durations[Op::of(kind).idx()];
        let op = kind.name();
        let cum = h.cumulative();
        for (le, c) in DURATION_BUCKETS.iter().zip(&cum) {
            let _ = writeln!(out, "{name}_bucket{{op=\"{op}\",le=\"{le}\"}} {c}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{op=\"{op}\",le=\"+Inf\"}} {}",
            cum[cum.len() - 1]
        );
        let _ = writeln!(out, "{name}_sum{{op=\"{op}\"}} {}", h.sum_seconds());
        let _ = writeln!(out, "{name}_count{{op=\"{op}\"}} {}", cum[cum.len() - 1]);
    }
}

/// The per-engine counters.
fn encode_engine(out: &mut String, m: &MetricsSnapshot) {
    header(
        out,
        "daxkv_hotplug_operations_total",
        "counter",
        "Hotplug operations by operation and outcome.",
    );
    for op in HotplugOp::ALL {
        for outcome in HotplugOutcome::ALL {
            let _ = writeln!(
                out,
                "daxkv_hotplug_operations_total{{operation=\"{}\",outcome=\"{}\"}} {}",
                op.name(),
                outcome.name(),
                m.hotplug[op as usize][outcome as usize]
            );
        }
    }
    header(
        out,
        "daxkv_worker_panics_total",
        "counter",
        "Task parts that panicked (the task failed, the worker kept serving).",
    );
    let _ = writeln!(out, "daxkv_worker_panics_total {}", m.worker_panics);
    header(
        out,
        "daxkv_listener_panics_total",
        "counter",
        "Listener calls that panicked (ignored).",
    );
    let _ = writeln!(out, "daxkv_listener_panics_total {}", m.listener_panics);
}

/// A scrape callback for an HTTP `/metrics` route that takes a
/// `Fn() -> String` (serve the text with [`CONTENT_TYPE`]).
pub fn handler(engine: Arc<Engine>) -> impl Fn() -> String + Send + Sync + 'static {
    move || encode(&engine)
}
