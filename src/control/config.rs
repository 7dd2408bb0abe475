//! # Engine configuration: LMCache's `dax` adapter JSON, plus daxkv's keys
//!
//! Accepted (docs/lmcache-dax-behavior.md §3.1):
//!
//! ```json
//! {"type": "dax", "slot_bytes": 2097152,
//!  "devices": [{"device_path": "/dev/dax0.0", "max_dax_size_gb": 64}],
//!  "hotplug_enabled": false,
//!  "num_store_workers": 1, "num_lookup_workers": 1, "num_load_workers": 4}
//! ```
//!
//! or the legacy single-device form (`device_path` and `max_dax_size_gb` at
//! the top level). This table is the one list of the keys and their
//! defaults (docs/control-plane.md and the Python faces link here):
//!
//! | key | value | default |
//! |---|---|---|
//! | `type` | `"dax"` | — (may be left out) |
//! | `slot_bytes` | bytes per slot (LMCache's chunk size), an integer > 0 | required |
//! | `devices` | a list of `{device_path, max_dax_size_gb, max_size_gb}` | required, unless `hotplug_enabled` (then it may be empty) |
//! | `devices[i].device_path` | a devdax node, an existing file, `"memfd"` or `"memfd:NAME"` (NAME: 1–64 of `A-Z a-z 0-9 . _ -`, each name once) | required |
//! | `devices[i].max_dax_size_gb` | GiB to map, a number > 0, at most 128 TiB ([`MAX_DEVICE_BYTES`]) | required |
//! | `devices[i].max_size_gb` (daxkv) | the largest a resize may grow the device to, ≥ `max_dax_size_gb`, at most 128 TiB; its slot tables are sized for it | 4 × the size for an anonymous device, the file's or device's length for a path |
//! | `hotplug_enabled` | `true` / `false` | `false` |
//! | `num_store_workers`, `num_lookup_workers`, `num_load_workers` | an integer from 1 to [`MAX_WORKERS_PER_POOL`] (1024) | 1, 1, `min(4, cpus)` |
//! | `numa` (daxkv) | `"auto"`, `"off"` or a node number (below 4096, [`MAX_NODES`](crate::host::numa::MAX_NODES)) | `"auto"` |
//! | `cpus` (daxkv) | a non-empty list of CPU numbers; wins over `numa` | none |
//! | `spin_us` (daxkv) | how long an idle worker spins before parking, µs | 250 |
//! | `wait_spin_us` (daxkv) | how long a `wait_*` caller spins before parking, µs | `spin_us` |
//! | `prefault` (daxkv) | touch every page of the mapping at open | `true` |
//! | `task_slots` (daxkv) | records in the task table, an integer > 0 | 4096 |
//! | `task_keys` (daxkv) | keys each record is sized for, an integer > 0 | 64 |
//! | `sysfs_root` (daxkv) | where NUMA topology is read (tests use a fake tree) | `/sys` |
//! | `signal` (daxkv) | `"always"` or `"when_waiting"` (see `engine::Signal`) | `"always"` |
//!
//! LMCache's common keys (`eviction`, `shared`, `persist_enabled`, `serde`,
//! the fork's `watch_directory` and `watch_interval_seconds`) are accepted
//! and ignored here. A `device_path` of `"memfd"` maps an anonymous memfd
//! (embedded use and tests).
//!
//! Every invalid value is an error that names the field and the rule; an
//! unknown key is an error too (a typo should not silently fall back to a
//! default). Unlike upstream, a JSON `true` is not a positive integer.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::device::arena::{ArenaSource, ArenaSpec};
use crate::device::core::CoreConfig;
use crate::engine::{DeviceSpec, Engine, EngineError, EngineOptions};
use crate::host::numa::Placement;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The largest device a config may name: 128 TiB, the x86-64 user address
/// space with 4-level page tables (no single mapping can be larger).
pub const MAX_DEVICE_BYTES: usize = 1 << 47;

/// The keys of one `devices[i]` entry: LMCache's (docs/lmcache-dax-behavior.md §3.1) and daxkv's `max_size_gb`.
pub const DEVICE_KEYS: &[&str] = &["device_path", "max_dax_size_gb", "max_size_gb"];

/// Top-level keys LMCache's adapter JSON may carry that daxkv accepts
/// and does not use (its own `type` among them).
pub const LMCACHE_KEYS: &[&str] = &[
    "type",
    "eviction",
    "shared",
    "persist_enabled",
    "serde",
    "watch_directory",
    "watch_interval_seconds",
];

/// Top-level keys daxkv reads (any key in neither list is refused,
/// naming it).
pub const DAXKV_KEYS: &[&str] = &[
    "slot_bytes",
    "devices",
    "device_path",
    "max_dax_size_gb",
    "max_size_gb",
    "hotplug_enabled",
    "num_store_workers",
    "num_lookup_workers",
    "num_load_workers",
    "numa",
    "cpus",
    "spin_us",
    "wait_spin_us",
    "prefault",
    "task_slots",
    "task_keys",
    "sysfs_root",
    "signal",
];

/// A config error: the field and what is wrong with it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("config: {field}: {rule}")]
pub struct ConfigError {
    /// The field, as a JSON path (`devices[0].max_dax_size_gb`).
    pub field: String,
    /// What is wrong with it.
    pub rule: String,
}

fn err(field: impl Into<String>, rule: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        rule: rule.into(),
    }
}

/// One configured device.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceConfig {
    /// A devdax node, an existing file (on tmpfs or fsdax, at least
    /// `max_dax_size_bytes` long), `"memfd"` or `"memfd:NAME"`.
    pub device_path: String,
    /// Bytes to map (`max_dax_size_gb` × 2³⁰, whole slots).
    pub max_dax_size_bytes: usize,
    /// The largest size a resize may grow it to (`max_size_gb` × 2³⁰; the
    /// slot tables are sized for it). `None`: 4 × the size for `memfd`,
    /// the file's or device's length for a path.
    pub max_size_bytes: Option<usize>,
}

/// A validated engine configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Bytes per slot (LMCache's chunk size), required.
    pub slot_bytes: usize,
    /// The devices, in order (ids from 0).
    pub devices: Vec<DeviceConfig>,
    /// Devices may be added at run time (and the list may start empty).
    pub hotplug_enabled: bool,
    /// Store workers (default 1).
    pub num_store_workers: usize,
    /// Lookup workers (default 1).
    pub num_lookup_workers: usize,
    /// Load workers (default `min(4, cpus)`).
    pub num_load_workers: usize,
    /// Where workers run: `numa` (`"auto"`, `"off"`, a node) or `cpus`.
    pub placement: Placement,
    /// `spin_us`: how long an idle worker spins before parking.
    pub spin: Duration,
    /// `wait_spin_us`: how long a `wait_*` caller spins before parking.
    pub wait_spin: Duration,
    /// `prefault`: touch every page of the mapping at open.
    pub prefault: bool,
    /// `task_slots`: records in the task table.
    pub task_slots: usize,
    /// `task_keys`: keys each record is sized for.
    pub task_keys: usize,
    /// `sysfs_root`: where NUMA topology is read (tests use a fake tree).
    pub sysfs_root: PathBuf,
    /// `signal`: when workers write the completion eventfds.
    pub signal: crate::engine::Signal,
}

/// The most workers one pool may have (`num_store_workers`,
/// `num_lookup_workers`, `num_load_workers`): a fixed bound, not one
/// relative to the CPU count, so a config valid on one host is valid on
/// every host. Far more threads than any host uses well; few enough that
/// the per-worker tables (metrics, rings) and the spawn stay small.
pub const MAX_WORKERS_PER_POOL: usize = 1024;

/// A worker count: a positive integer at most [`MAX_WORKERS_PER_POOL`].
fn worker_count(
    obj: &Map<String, Value>,
    field: &str,
    default: usize,
) -> Result<usize, ConfigError> {
    let n = positive_int(obj, field, Some(default))?;
    if n > MAX_WORKERS_PER_POOL {
        return Err(err(
            field,
            format!("must be at most {MAX_WORKERS_PER_POOL} workers per pool (got {n})"),
        ));
    }
    Ok(n)
}

fn positive_int(
    obj: &Map<String, Value>,
    field: &str,
    default: Option<usize>,
) -> Result<usize, ConfigError> {
    match obj.get(field) {
        None => default.ok_or_else(|| err(field, "is required")),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(v) if v > 0 => usize::try_from(v).map_err(|_| err(field, "is too large")),
            _ => Err(err(field, format!("must be a positive integer (got {n})"))),
        },
        Some(v) => Err(err(field, format!("must be a positive integer (got {v})"))),
    }
}

fn device(
    obj: &Map<String, Value>,
    prefix: &str,
    slot_bytes: usize,
) -> Result<DeviceConfig, ConfigError> {
    let f = |name: &str| {
        if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}.{name}")
        }
    };
    // A typo inside an entry is an error, as at the top level (the legacy
    // form's keys are checked there).
    if !prefix.is_empty() {
        if let Some(k) = obj.keys().find(|k| !DEVICE_KEYS.contains(&k.as_str())) {
            return Err(err(f(k), "unknown key"));
        }
    }
    let path = match obj.get("device_path") {
        Some(Value::String(s)) if !s.trim().is_empty() => s.trim().to_string(),
        Some(_) => return Err(err(f("device_path"), "must be a non-empty string")),
        None => return Err(err(f("device_path"), "is required")),
    };
    let gb = match obj.get("max_dax_size_gb") {
        Some(Value::Number(n)) => n.as_f64().filter(|g| *g > 0.0 && g.is_finite()),
        Some(_) => None,
        None => return Err(err(f("max_dax_size_gb"), "is required")),
    }
    .ok_or_else(|| {
        err(
            f("max_dax_size_gb"),
            format!("must be a number > 0 (got {})", obj["max_dax_size_gb"]),
        )
    })?;
    if gb * GIB > MAX_DEVICE_BYTES as f64 {
        return Err(err(
            f("max_dax_size_gb"),
            format!(
                "{gb} GiB is beyond the largest device, {} GiB (128 TiB)",
                MAX_DEVICE_BYTES >> 30
            ),
        ));
    }
    let bytes = (gb * GIB) as usize;
    if bytes / slot_bytes == 0 {
        let who = if prefix.is_empty() {
            "device".to_string()
        } else {
            prefix.to_string()
        };
        return Err(err(f("max_dax_size_gb"), format!("{who} configured DAX arena ({bytes} bytes) does not fit one slot of {slot_bytes} bytes")));
    }
    let max_size_bytes = match obj.get("max_size_gb") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_f64().filter(|g| *g > 0.0 && g.is_finite()) {
            Some(g) if g * GIB > MAX_DEVICE_BYTES as f64 => {
                return Err(err(
                    f("max_size_gb"),
                    format!(
                        "{v} GiB is beyond the largest device, {} GiB (128 TiB)",
                        MAX_DEVICE_BYTES >> 30
                    ),
                ))
            }
            Some(g) if (g * GIB) as usize >= bytes => Some((g * GIB) as usize),
            _ => {
                return Err(err(
                    f("max_size_gb"),
                    format!("must be a number ≥ max_dax_size_gb (got {v})"),
                ))
            }
        },
    };
    crate::engine::check_device_path(&path).map_err(|why| err(f("device_path"), why))?;
    if crate::engine::is_memfd_name(&path) {
        crate::engine::check_memfd_name(&path, false).map_err(|why| err(f("device_path"), why))?;
    }
    Ok(DeviceConfig {
        device_path: path,
        max_dax_size_bytes: bytes,
        max_size_bytes,
    })
}

impl EngineConfig {
    /// Map the configured devices and start the engine (the dependency
    /// runs one way: the config builds the engine's inputs).
    pub fn open(&self) -> Result<Engine, EngineError> {
        Engine::open(
            self.device_specs(),
            self.slot_bytes,
            self.hotplug_enabled,
            self.options(),
        )
    }

    /// Parse and validate the adapter JSON.
    pub fn from_json(text: &str) -> Result<EngineConfig, ConfigError> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| err("(document)", format!("not valid JSON: {e}")))?;
        Self::from_value(&v)
    }

    /// Validate an already parsed adapter JSON value.
    #[allow(clippy::too_many_lines)] // one field after another, in order
    pub fn from_value(v: &Value) -> Result<EngineConfig, ConfigError> {
        let obj = v
            .as_object()
            .ok_or_else(|| err("(document)", "must be a JSON object"))?;
        if let Some(k) = obj
            .keys()
            .find(|k| !DAXKV_KEYS.contains(&k.as_str()) && !LMCACHE_KEYS.contains(&k.as_str()))
        {
            return Err(err(k.clone(), "unknown key"));
        }
        if let Some(t) = obj.get("type") {
            if t != "dax" {
                return Err(err("type", format!("must be \"dax\" (got {t})")));
            }
        }
        let slot_bytes = positive_int(obj, "slot_bytes", None)?;
        let hotplug_enabled = match obj.get("hotplug_enabled") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(err(
                    "hotplug_enabled",
                    format!("must be true or false (got {v})"),
                ))
            }
        };
        let devices = match obj.get("devices") {
            Some(Value::Array(list)) => {
                if obj.contains_key("device_path") || obj.contains_key("max_dax_size_gb") {
                    return Err(err(
                        "devices",
                        "give either devices or the legacy device_path / max_dax_size_gb, not both",
                    ));
                }
                list.iter()
                    .enumerate()
                    .map(|(i, d)| {
                        let d = d
                            .as_object()
                            .ok_or_else(|| err(format!("devices[{i}]"), "must be an object"))?;
                        device(d, &format!("devices[{i}]"), slot_bytes)
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            Some(_) => return Err(err("devices", "must be a list of objects")),
            None if obj.contains_key("device_path") || obj.contains_key("max_dax_size_gb") => {
                vec![device(obj, "", slot_bytes)?]
            }
            None => Vec::new(),
        };
        // An anonymous device is known by its name alone: two of one name
        // could never be told apart (removed, drained or resized).
        for (i, d) in devices.iter().enumerate() {
            if crate::engine::is_memfd_name(&d.device_path) {
                if let Some(j) = devices[..i]
                    .iter()
                    .position(|e| e.device_path == d.device_path)
                {
                    return Err(err(
                        format!("devices[{i}].device_path"),
                        format!(
                            "{} is devices[{j}] already; name further anonymous devices memfd:NAME",
                            d.device_path
                        ),
                    ));
                }
            }
        }
        if devices.is_empty() && !hotplug_enabled {
            return Err(err(
                "devices",
                "may be empty only when hotplug_enabled is true",
            ));
        }
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        let placement = match (obj.get("numa"), obj.get("cpus")) {
            (_, Some(Value::Array(list))) => Placement::Cpus(
                list.iter()
                    .enumerate()
                    .map(|(i, c)| {
                        c.as_u64().map(|c| c as usize).ok_or_else(|| {
                            err(
                                format!("cpus[{i}]"),
                                format!("must be a CPU number (got {c})"),
                            )
                        })
                    })
                    .collect::<Result<_, _>>()?,
            ),
            (_, Some(v)) => {
                return Err(err(
                    "cpus",
                    format!("must be a list of CPU numbers (got {v})"),
                ))
            }
            (None, None) => Placement::Auto,
            (Some(Value::String(s)), None) if s == "auto" => Placement::Auto,
            (Some(Value::String(s)), None) if s == "off" => Placement::Off,
            (Some(Value::Number(n)), None) if n.as_u64().is_some() => {
                match n
                    .as_u64()
                    .filter(|&n| n < crate::host::numa::MAX_NODES as u64)
                {
                    // Below MAX_NODES, so it fits a u32.
                    Some(n) => Placement::Node(n as u32),
                    None => {
                        return Err(err(
                            "numa",
                            format!(
                                "node {n} is past any host's nodes (ids below {})",
                                crate::host::numa::MAX_NODES
                            ),
                        ))
                    }
                }
            }
            (Some(v), None) => {
                return Err(err(
                    "numa",
                    format!("must be \"auto\", \"off\" or a node number (got {v})"),
                ))
            }
        };
        let micros = |field: &str, default: u64| match obj.get(field) {
            None => Ok(default),
            Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64().unwrap_or_default()),
            Some(v) => Err(err(
                field,
                format!("must be a whole number of microseconds (got {v})"),
            )),
        };
        let spin_us = micros("spin_us", 250)?;
        // A waiting caller spins as long as a worker unless told otherwise.
        let wait_spin_us = micros("wait_spin_us", spin_us)?;
        let prefault = match obj.get("prefault") {
            None => true,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(err("prefault", format!("must be true or false (got {v})"))),
        };
        let sysfs_root = match obj.get("sysfs_root") {
            None => PathBuf::from("/sys"),
            Some(Value::String(s)) if !s.is_empty() => PathBuf::from(s),
            Some(v) => return Err(err("sysfs_root", format!("must be a path (got {v})"))),
        };
        let signal = match obj.get("signal") {
            None => crate::engine::Signal::Always,
            Some(Value::String(s)) if s == "always" => crate::engine::Signal::Always,
            Some(Value::String(s)) if s == "when_waiting" => crate::engine::Signal::WhenWaiting,
            Some(v) => {
                return Err(err(
                    "signal",
                    format!("must be \"always\" or \"when_waiting\" (got {v})"),
                ))
            }
        };
        // A node or CPU the host lacks is an error here, naming what it has
        // (host::numa::Placement::check says why not a fallback).
        placement
            .check(
                &crate::host::numa::Topology::from_sysfs(&sysfs_root),
                &sysfs_root,
            )
            .map_err(|e| err(e.field, e.rule))?;
        Ok(EngineConfig {
            signal,
            slot_bytes,
            devices,
            hotplug_enabled,
            num_store_workers: worker_count(obj, "num_store_workers", 1)?,
            num_lookup_workers: worker_count(obj, "num_lookup_workers", 1)?,
            num_load_workers: worker_count(obj, "num_load_workers", cpus.min(4))?,
            placement,
            spin: Duration::from_micros(spin_us),
            wait_spin: Duration::from_micros(wait_spin_us),
            prefault,
            task_slots: positive_int(obj, "task_slots", Some(4096))?,
            task_keys: positive_int(obj, "task_keys", Some(64))?,
            sysfs_root,
        })
    }

    /// The devices as engine specs.
    pub fn device_specs(&self) -> Vec<DeviceSpec> {
        self.devices
            .iter()
            .map(|d| {
                let source = if crate::engine::is_memfd_name(&d.device_path) {
                    ArenaSource::Memfd
                } else {
                    ArenaSource::Path(PathBuf::from(&d.device_path))
                };
                let mut arena = ArenaSpec::new(source, d.max_dax_size_bytes)
                    .populate(self.prefault)
                    .sysfs_root(&self.sysfs_root);
                // Room to grow, as for a hotplugged device (the tables are
                // sized for it; a memfd's memory comes with a grow, checked
                // then).
                let default_max = crate::engine::is_memfd_name(&d.device_path).then(|| {
                    d.max_dax_size_bytes
                        .saturating_mul(crate::engine::MEMFD_GROW_FACTOR)
                });
                if let Some(max) = d.max_size_bytes.or(default_max) {
                    arena = arena.max_size_bytes(max);
                }
                DeviceSpec {
                    path: d.device_path.clone(),
                    core: CoreConfig::new(arena, self.slot_bytes),
                }
            })
            .collect()
    }

    /// Engine options, with the worker CPUs resolved from the placement.
    pub fn options(&self) -> EngineOptions {
        let topo = crate::host::numa::Topology::from_sysfs(&self.sysfs_root);
        let first = self.devices.first().map(|d| PathBuf::from(&d.device_path));
        let placed = self
            .placement
            .resolve(&topo, &self.sysfs_root, first.as_deref());
        EngineOptions {
            num_store_workers: self.num_store_workers,
            num_lookup_workers: self.num_lookup_workers,
            num_load_workers: self.num_load_workers,
            spin: self.spin,
            wait_spin: self.wait_spin,
            task_slots: self.task_slots,
            task_keys: self.task_keys,
            cpus: placed.cpus,
            cpus_source: placed.source,
            cpus_node: placed.node,
            panic_on_key: None,
            signal: self.signal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<EngineConfig, ConfigError> {
        EngineConfig::from_json(s)
    }

    #[test]
    fn lmcache_json_parses_with_defaults() {
        let c = parse(r#"{"type":"dax","slot_bytes":4096,"devices":[{"device_path":" /dev/dax0.0 ","max_dax_size_gb":0.5}],"eviction":{"eviction_policy":"LRU"}}"#).unwrap();
        assert_eq!(
            c.devices,
            vec![DeviceConfig {
                device_path: "/dev/dax0.0".into(),
                max_dax_size_bytes: 1 << 29,
                max_size_bytes: None,
            }]
        );
        assert_eq!((c.num_store_workers, c.num_lookup_workers), (1, 1));
        assert!(c.num_load_workers >= 1 && c.num_load_workers <= 4);
        assert_eq!(c.placement, Placement::Auto);
        assert!(!c.hotplug_enabled);
        let legacy =
            parse(r#"{"slot_bytes":4096,"device_path":"/dev/dax1.0","max_dax_size_gb":1}"#)
                .unwrap();
        assert_eq!(legacy.devices[0].max_dax_size_bytes, 1 << 30);
        let hp = parse(
            r#"{"slot_bytes":4096,"devices":[],"hotplug_enabled":true,"numa":"off","spin_us":0}"#,
        )
        .unwrap();
        assert!(
            hp.devices.is_empty() && hp.placement == Placement::Off && hp.spin == Duration::ZERO
        );
        assert_eq!(
            hp.wait_spin,
            Duration::ZERO,
            "a waiting caller spins as long as a worker"
        );
        assert_eq!(hp.task_keys, 64);
        let w = parse(
            r#"{"slot_bytes":4096,"devices":[],"hotplug_enabled":true,"wait_spin_us":2,"task_keys":300}"#,
        )
        .unwrap();
        assert_eq!(
            (w.spin, w.wait_spin),
            (Duration::from_micros(250), Duration::from_micros(2))
        );
        assert_eq!(w.options().task_keys, 300);
        assert_eq!(
            parse(r#"{"slot_bytes":1,"device_path":"memfd","max_dax_size_gb":1,"cpus":[1,0]}"#)
                .unwrap()
                .placement,
            Placement::Cpus(vec![1, 0])
        );
    }

    /// Placement's source travels from the config to `status()["numa"]`:
    /// HMAT on a fake tree names socket 0 for the CXL node, an explicit
    /// list is "explicit", no device is "none".
    #[test]
    fn placement_source_reaches_status() {
        let root = crate::host::numa::tests::fake_sysfs();
        crate::host::numa::tests::add_access(root.path(), 2, 1, &[0]);
        let json = format!(
            r#"{{"slot_bytes":4096,"devices":[],"hotplug_enabled":true,"numa":2,"sysfs_root":{}}}"#,
            serde_json::to_string(root.path()).unwrap()
        );
        let o = parse(&json).unwrap().options();
        assert_eq!(
            (o.cpus.clone(), o.cpus_source, o.cpus_node),
            (
                vec![0, 1],
                crate::host::numa::PlacementSource::Hmat,
                Some(0)
            )
        );
        let dev = DeviceSpec {
            path: "memfd".into(),
            core: CoreConfig::new(ArenaSpec::memfd(16 * 4096), 4096),
        };
        let e = Engine::open(vec![dev], 4096, false, o).unwrap();
        let numa = &e.status()["numa"];
        assert_eq!(
            (&numa["source"], &numa["node"], &numa["cpus"]),
            (
                &serde_json::json!("hmat"),
                &serde_json::json!(0),
                &serde_json::json!([0, 1])
            )
        );
        e.close();
        let o = parse(r#"{"slot_bytes":1,"devices":[],"hotplug_enabled":true,"cpus":[1,0]}"#)
            .unwrap()
            .options();
        assert_eq!(o.cpus_source, crate::host::numa::PlacementSource::Explicit);
        let o = parse(r#"{"slot_bytes":1,"devices":[],"hotplug_enabled":true}"#)
            .unwrap()
            .options();
        assert_eq!(
            (o.cpus.is_empty(), o.cpus_source, o.cpus_node),
            (true, crate::host::numa::PlacementSource::None, None)
        );
    }

    #[test]
    fn named_anonymous_devices_map_as_memfds() {
        let c = parse(r#"{"slot_bytes":4096,"devices":[{"device_path":"memfd","max_dax_size_gb":0.001},{"device_path":"memfd:b","max_dax_size_gb":0.001}]}"#).unwrap();
        let specs = c.device_specs();
        assert_eq!(specs[1].path, "memfd:b");
        assert!(matches!(specs[1].core.arena.source, ArenaSource::Memfd));
        let e = c.open().unwrap();
        let paths: Vec<String> = e.devices().into_iter().map(|d| d.path).collect();
        assert_eq!(paths, ["memfd", "memfd:b"]);
        e.close();
    }

    #[test]
    fn every_bad_value_names_its_field() {
        let cases = [
            (r#"{"devices":[]}"#, "config: slot_bytes: is required"),
            (r#"{"slot_bytes":true,"devices":[]}"#, "config: slot_bytes: must be a positive integer (got true)"),
            (r#"{"slot_bytes":0,"devices":[]}"#, "config: slot_bytes: must be a positive integer (got 0)"),
            (r#"{"slot_bytes":1.5,"devices":[]}"#, "config: slot_bytes: must be a positive integer (got 1.5)"),
            (r#"{"slot_bytes":4096,"devices":[]}"#, "config: devices: may be empty only when hotplug_enabled is true"),
            (r#"{"slot_bytes":4096,"devices":{}}"#, "config: devices: must be a list of objects"),
            (r#"{"slot_bytes":4096,"devices":[7]}"#, "config: devices[0]: must be an object"),
            (r#"{"slot_bytes":4096,"devices":[{"max_dax_size_gb":1}]}"#, "config: devices[0].device_path: is required"),
            (r#"{"slot_bytes":4096,"devices":[{"device_path":"  ","max_dax_size_gb":1}]}"#, "config: devices[0].device_path: must be a non-empty string"),
            (r#"{"slot_bytes":4096,"devices":[{"device_path":"/d","max_dax_size_gb":-1}]}"#, "config: devices[0].max_dax_size_gb: must be a number > 0 (got -1)"),
            (r#"{"slot_bytes":4096,"devices":[{"device_path":"/d","max_dax_size_gb":"1"}]}"#, "config: devices[0].max_dax_size_gb: must be a number > 0 (got \"1\")"),
            (r#"{"slot_bytes":2147483648,"devices":[{"device_path":"/d","max_dax_size_gb":1}]}"#, "config: devices[0].max_dax_size_gb: devices[0] configured DAX arena (1073741824 bytes) does not fit one slot of 2147483648 bytes"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"num_load_workers":0}"#, "config: num_load_workers: must be a positive integer (got 0)"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"num_store_workers":"2"}"#, "config: num_store_workers: must be a positive integer (got \"2\")"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"num_load_workers":100000}"#, "config: num_load_workers: must be at most 1024 workers per pool (got 100000)"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"num_store_workers":4294967296}"#, "config: num_store_workers: must be at most 1024 workers per pool (got 4294967296)"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"num_lookup_workers":1025}"#, "config: num_lookup_workers: must be at most 1024 workers per pool (got 1025)"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"slot_byte":1}"#, "config: slot_byte: unknown key"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"numa":"near"}"#, "config: numa: must be \"auto\", \"off\" or a node number (got \"near\")"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"cpus":[0,"x"]}"#, "config: cpus[1]: must be a CPU number (got \"x\")"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"hotplug_enabled":1}"#, "config: hotplug_enabled: must be true or false (got 1)"),
            (r#"{"type":"redis","slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1}"#, "config: type: must be \"dax\" (got \"redis\")"),
            ("[1]", "config: (document): must be a JSON object"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"signal":"never"}"#, "config: signal: must be \"always\" or \"when_waiting\" (got \"never\")"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"spin_us":-1}"#, "config: spin_us: must be a whole number of microseconds (got -1)"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"wait_spin_us":"2"}"#, "config: wait_spin_us: must be a whole number of microseconds (got \"2\")"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"task_keys":0}"#, "config: task_keys: must be a positive integer (got 0)"),
            // A typo inside a device entry is an error too, naming its index.
            (r#"{"slot_bytes":4096,"devices":[{"device_path":"/d","max_dax_size_gb":1},{"device_path":"/e","max_dax_size_gbs":1}]}"#, "config: devices[1].max_dax_size_gbs: unknown key"),
            (r#"{"slot_bytes":4096,"devices":[{"device_path":"/d","max_dax_size_gb":1,"numa":0}]}"#, "config: devices[0].numa: unknown key"),
            // A size no mapping can have.
            (r#"{"slot_bytes":4096,"devices":[{"device_path":"/d","max_dax_size_gb":1e12}]}"#, "config: devices[0].max_dax_size_gb: 1000000000000 GiB is beyond the largest device, 131072 GiB (128 TiB)"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":131073}"#, "config: max_dax_size_gb: 131073 GiB is beyond the largest device, 131072 GiB (128 TiB)"),
            (r#"{"slot_bytes":4096,"devices":[{"device_path":"/d","max_dax_size_gb":1,"max_size_gb":1e300}]}"#, "config: devices[0].max_size_gb: 1e+300 GiB is beyond the largest device, 131072 GiB (128 TiB)"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"max_size_gb":131073}"#, "config: max_size_gb: 131073 GiB is beyond the largest device, 131072 GiB (128 TiB)"),
            // A node past u32 was read modulo 2^32 (4294967296 as node 0).
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"numa":4294967296}"#, "config: numa: node 4294967296 is past any host's nodes (ids below 4096)"),
            (r#"{"slot_bytes":4096,"device_path":"/d","max_dax_size_gb":1,"numa":4096}"#, "config: numa: node 4096 is past any host's nodes (ids below 4096)"),
            // Anonymous devices: one per name, names checked.
            (r#"{"slot_bytes":4096,"devices":[{"device_path":"memfd","max_dax_size_gb":1},{"device_path":"memfd","max_dax_size_gb":1}]}"#, "config: devices[1].device_path: memfd is devices[0] already; name further anonymous devices memfd:NAME"),
            (r#"{"slot_bytes":4096,"devices":[{"device_path":"memfd:a","max_dax_size_gb":1},{"device_path":"memfd:a","max_dax_size_gb":2}]}"#, "config: devices[1].device_path: memfd:a is devices[0] already; name further anonymous devices memfd:NAME"),
            (r#"{"slot_bytes":4096,"devices":[{"device_path":"memfd:","max_dax_size_gb":1}]}"#, "config: devices[0].device_path: memfd:NAME needs a NAME"),
            (r#"{"slot_bytes":4096,"devices":[{"device_path":"memfd:a/b","max_dax_size_gb":1}]}"#, "config: devices[0].device_path: memfd:NAME: NAME must be 1 to 64 of A-Z a-z 0-9 . _ -"),
        ];
        for (json, want) in cases {
            assert_eq!(parse(json).unwrap_err().to_string(), want, "{json}");
        }
    }
}
