//! # Runtime reconfiguration: the generic protocol the control plane drives
//!
//! LMCache's reconfiguration protocol (docs/lmcache-dax-behavior.md §4.1,
//! §4.2): a backend that can be changed at run time answers
//! `reconfigure(operation, payload, owners)` with a JSON result, or an
//! error carrying an HTTP-style status code and a JSON payload, and
//! `reconfigure_status()` with the envelope
//! `{backend, supported_operations, status}`. The HTTP layer routes
//! `/reconfigure/{backend}/...` through a [`Registry`] of such backends and
//! never reaches into device or slot state; the DAX backend
//! ([`DaxReconfigure`]) translates payloads into the engine's typed pool
//! API.

#![forbid(unsafe_code)]

use std::sync::Arc;

use serde_json::{json, Value};

/// "Who else maps this physical device?" (LMCache's `device_owners`): for
/// a device path, the names of other owners (other backends or processes
/// that map it). Non-empty answers make `add` a 409.
pub type Owners<'a> = Option<&'a (dyn Fn(&str) -> Vec<String> + Sync)>;

/// A refused or failed reconfiguration: an HTTP status code and the JSON
/// payload to answer with (`{"error": msg}` unless the operation defines a
/// richer one).
#[derive(Clone, Debug, PartialEq)]
pub struct ReconfigureError {
    /// 400, 403, 404, 409, 507, … (docs/lmcache-dax-behavior.md §4).
    pub status: u16,
    /// The answer's body.
    pub body: Value,
}

impl ReconfigureError {
    /// `{"error": msg}` with `status`.
    pub fn msg(status: u16, msg: impl Into<String>) -> ReconfigureError {
        ReconfigureError {
            status,
            body: json!({ "error": msg.into() }),
        }
    }

    /// A richer payload with `status`.
    pub fn with_body(status: u16, body: Value) -> ReconfigureError {
        ReconfigureError { status, body }
    }
}

impl std::fmt::Display for ReconfigureError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.body.get("error").and_then(Value::as_str) {
            Some(m) => write!(f, "{} {m}", self.status),
            None => write!(f, "{} {}", self.status, self.body),
        }
    }
}

impl std::error::Error for ReconfigureError {}

/// A backend the control plane can reconfigure at run time.
pub trait Reconfigurable: Send + Sync {
    /// Its backend name (`"dax"`), as in `/reconfigure/{backend}/...`.
    fn backend(&self) -> &str;

    /// The operations `reconfigure` accepts (`["add", "remove", "resize"]`
    /// for DAX; `"status"` is always accepted too).
    fn supported_operations(&self) -> Vec<String>;

    /// The backend's own status document (for DAX: the hotplug status).
    fn status(&self) -> Value;

    /// Run `operation` with `payload` (a JSON object). `owners` reports
    /// other owners of a physical device. Blocks until the operation
    /// completes; status requests must keep answering meanwhile.
    fn reconfigure(
        &self,
        operation: &str,
        payload: &Value,
        owners: Owners<'_>,
    ) -> Result<Value, ReconfigureError>;

    /// LMCache's envelope: `{backend, supported_operations, status}`.
    fn reconfigure_status(&self) -> Value {
        json!({
            "backend": self.backend(),
            "supported_operations": self.supported_operations(),
            "status": self.status(),
        })
    }
}

/// The reconfigurable backends of one server, in registration order: the
/// generic index of a backend is its position here; a backend-local index
/// counts only the backends of one name.
#[derive(Clone, Default)]
pub struct Registry {
    backends: Vec<Arc<dyn Reconfigurable>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.backends.iter().map(|b| b.backend().to_string()))
            .finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Register `b`; returns its generic index.
    pub fn register(&mut self, b: Arc<dyn Reconfigurable>) -> usize {
        self.backends.push(b);
        self.backends.len() - 1
    }

    /// Every backend with its generic index.
    pub fn all(&self) -> impl Iterator<Item = (usize, &Arc<dyn Reconfigurable>)> {
        self.backends.iter().enumerate()
    }

    /// The backends named `name` (case-insensitive), as `(generic index,
    /// backend)`, in order: position `i` of this list is backend-local
    /// index `i`.
    pub fn named(&self, name: &str) -> Vec<(usize, &Arc<dyn Reconfigurable>)> {
        self.all()
            .filter(|(_, b)| b.backend().eq_ignore_ascii_case(name))
            .collect()
    }

    /// Backend `name`'s local index `local`: `(generic index, backend)`.
    pub fn get(&self, name: &str, local: usize) -> Option<(usize, &Arc<dyn Reconfigurable>)> {
        self.named(name).into_iter().nth(local)
    }
}

/// The DAX backend: LMCache's `DaxL2Adapter.reconfigure`
/// (docs/lmcache-dax-behavior.md §4.2–§4.5) over the engine's typed
/// hotplug API. Payloads are validated with upstream's messages; results
/// and errors carry upstream's fields and status codes.
pub struct DaxReconfigure {
    engine: Arc<crate::engine::Engine>,
    /// Checks a path before it is mapped (add) or grown (resize): the
    /// device probe. Returns the reason to refuse.
    gate: Arc<Gate>,
}

/// A check run on a device path and size before it is mapped (`grow`
/// false) or grown (`grow` true): the device probe. `Err(reason)` refuses.
pub type Gate = dyn Fn(&std::path::Path, usize, bool) -> Result<(), String> + Send + Sync;

impl std::fmt::Debug for DaxReconfigure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaxReconfigure").finish_non_exhaustive()
    }
}

impl DaxReconfigure {
    /// The DAX backend of `engine`, with `gate` run before a device is
    /// mapped or grown.
    pub fn new(
        engine: Arc<crate::engine::Engine>,
        gate: impl Fn(&std::path::Path, usize, bool) -> Result<(), String> + Send + Sync + 'static,
    ) -> DaxReconfigure {
        DaxReconfigure {
            engine,
            gate: Arc::new(gate),
        }
    }

    /// The DAX backend of `engine` gated by the device probe
    /// ([`crate::host::probe`]) read under `sysfs_root`: a kmem-bound, unbound,
    /// too small or misaligned device is refused before it is mapped or
    /// grown, with the probe's reason.
    pub fn probing(
        engine: Arc<crate::engine::Engine>,
        sysfs_root: std::path::PathBuf,
    ) -> DaxReconfigure {
        DaxReconfigure::new(engine, move |path, bytes, grow| {
            let p = crate::host::probe::probe(path, &sysfs_root);
            if grow {
                crate::host::probe::check_grow(&p, bytes as u64)
            } else {
                crate::host::probe::check_add(&p, bytes as u64)
            }
        })
    }

    /// The engine it reconfigures.
    pub fn engine(&self) -> &Arc<crate::engine::Engine> {
        &self.engine
    }

    fn device_json(&self, index: usize, info: &crate::engine::DeviceInfo) -> Value {
        // That device's entry alone: a whole `status()` here made every add
        // walk every tombstone.
        self.engine.device_status(index).unwrap_or_else(|| {
            json!({
                "index": index,
                "device_id": info.id.0,
                "device_path": info.path,
                "state": info.state.name(),
            })
        })
    }
}

fn hotplug_err(e: &crate::engine::HotplugError) -> ReconfigureError {
    use crate::engine::HotplugError as H;
    let status = e.status();
    match e {
        H::Ambiguous { matches } => ReconfigureError::with_body(
            status,
            json!({
                "error": e.to_string(),
                "matches": matches.iter().map(|(i, id, st)| json!({
                    "index": i, "device_id": id.0, "state": st.name(),
                })).collect::<Vec<_>>(),
            }),
        ),
        H::Blocked { locked, borrowed } => ReconfigureError::with_body(
            status,
            json!({
                "status": "blocked",
                "reason": e.to_string(),
                "locked_key_count": locked,
                "borrowed_slot_count": borrowed,
            }),
        ),
        H::Leased { leases, .. } => ReconfigureError::with_body(
            status,
            json!({
                "status": "blocked",
                "reason": e.to_string(),
                "lease_count": leases,
            }),
        ),
        H::SourceLocked { locked, moved } => ReconfigureError::with_body(
            status,
            json!({
                "status": "blocked",
                "reason": e.to_string(),
                "locked_key_count": locked,
                "borrowed_slot_count": 0,
                "moved_keys": moved,
            }),
        ),
        H::InsufficientCapacity { moved, total } => ReconfigureError::with_body(
            status,
            json!({ "error": e.to_string(), "moved_keys": moved, "total_keys": total }),
        ),
        _ => ReconfigureError::msg(status, e.to_string()),
    }
}

fn path_of(payload: &Value) -> Result<String, ReconfigureError> {
    match payload
        .get("device_path")
        .and_then(Value::as_str)
        .map(str::trim)
    {
        Some(p) if !p.is_empty() => Ok(p.to_string()),
        _ => Err(ReconfigureError::msg(
            400,
            "device_path must be a non-empty string",
        )),
    }
}

/// Which device a remove or resize names: `device_path` (a path, `memfd`
/// or `memfd:NAME`), or `device_index` (its position in the status list),
/// or both (they must agree).
struct Target {
    path: Option<String>,
    index: Option<usize>,
}

fn target_of(payload: &Value) -> Result<Target, ReconfigureError> {
    let index = match payload.get("device_index") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) if n.as_u64().is_some() => {
            Some(usize::try_from(n.as_u64().unwrap_or(0)).unwrap_or(usize::MAX))
        }
        Some(_) => {
            return Err(ReconfigureError::msg(
                400,
                "device_index must be a non-negative integer",
            ))
        }
    };
    let path = match (payload.get("device_path"), index) {
        (None | Some(Value::Null), Some(_)) => None,
        _ => Some(path_of(payload)?),
    };
    Ok(Target { path, index })
}

impl Target {
    fn resolve(
        &self,
        e: &crate::engine::Engine,
    ) -> Result<crate::engine::DeviceId, ReconfigureError> {
        let Some(index) = self.index else {
            let path = self.path.as_deref().unwrap_or_default();
            return e.find_device(path).map_err(|err| hotplug_err(&err));
        };
        let id = e.find_device_at(index).map_err(|err| hotplug_err(&err))?;
        if let Some(path) = &self.path {
            let at = e.device_index(id).map(|(_, info)| info.path);
            if at.as_deref() != Some(path.as_str()) {
                return Err(ReconfigureError::msg(
                    409,
                    format!("device_index {index} is not device_path {path}"),
                ));
            }
        }
        Ok(id)
    }
}

fn size_of(payload: &Value) -> Result<usize, ReconfigureError> {
    match payload.get("size_bytes") {
        Some(Value::Number(n)) if n.as_u64().is_some_and(|v| v > 0) => {
            usize::try_from(n.as_u64().unwrap_or(0))
                .map_err(|_| ReconfigureError::msg(400, "size_bytes must be a positive integer"))
        }
        _ => Err(ReconfigureError::msg(
            400,
            "size_bytes must be a positive integer",
        )),
    }
}

/// The optional `max_size_bytes` of an add: a positive integer, or absent.
fn max_size_of(payload: &Value) -> Result<Option<usize>, ReconfigureError> {
    const BAD: &str = "max_size_bytes must be a positive integer";
    match payload.get("max_size_bytes") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_u64().map(usize::try_from) {
            Some(Ok(v)) if v > 0 => Ok(Some(v)),
            _ => Err(ReconfigureError::msg(400, BAD)),
        },
        Some(_) => Err(ReconfigureError::msg(400, BAD)),
    }
}

fn force_of(payload: &Value) -> Result<bool, ReconfigureError> {
    match payload.get("force") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ReconfigureError::msg(400, "force must be a boolean")),
    }
}

/// 403 when hotplug is off, before the path is looked up (upstream answers
/// a remove or resize with hotplug off 403, whatever the path).
fn disabled_first(e: &crate::engine::Engine) -> Result<(), ReconfigureError> {
    if e.hotplug_enabled() {
        Ok(())
    } else {
        Err(hotplug_err(&crate::engine::HotplugError::Disabled))
    }
}

impl Reconfigurable for DaxReconfigure {
    fn backend(&self) -> &'static str {
        "dax"
    }

    fn supported_operations(&self) -> Vec<String> {
        ["status", "add", "remove", "resize"]
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    fn status(&self) -> Value {
        let mut st = self.engine.status();
        st["enabled"] = json!(self.engine.hotplug_enabled());
        // LMCache's `hotplug_status()` names the capacity so (the engine
        // status calls it `max_dax_size_bytes`, as `report_status` does).
        st["total_capacity_bytes"] = st["max_dax_size_bytes"].clone();
        st
    }

    #[allow(clippy::too_many_lines)] // one operation after another, as upstream
    fn reconfigure(
        &self,
        operation: &str,
        payload: &Value,
        owners: Owners<'_>,
    ) -> Result<Value, ReconfigureError> {
        use crate::engine::{RemoveMode, ShrinkMode};
        let e = &self.engine;
        match operation {
            "status" => Ok(self.reconfigure_status()),
            "add" => {
                let path = path_of(payload)?;
                if let Some(owners) = owners {
                    let who = owners(&path);
                    if !who.is_empty() {
                        return Err(ReconfigureError::msg(
                            409,
                            format!("physical device is already mapped by {}", who.join(", ")),
                        ));
                    }
                }
                let size = size_of(payload)?;
                let max = max_size_of(payload)?;
                let create = match payload.get("create") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(_) => return Err(ReconfigureError::msg(400, "create must be a boolean")),
                };
                let (index, info) = e
                    .hotplug_add_or_create(&path, size, max, create, |p, n| {
                        (self.gate)(p, n, false)
                    })
                    .map_err(|err| hotplug_err(&err))?;
                Ok(json!({
                    "status": "ok",
                    "operation": "add",
                    "adapter_index": 0,
                    "device": self.device_json(index, &info),
                }))
            }
            "remove" => {
                const BAD_MODE: &str = "mode must be migrate, evict, or drain";
                let target = target_of(payload)?;
                // Upstream's order: the payload's types (400), hotplug off
                // (403), the mode's value (400), the path (404 / 409).
                let mode = match payload.get("mode") {
                    None | Some(Value::Null) => "migrate",
                    Some(Value::String(m)) => m.as_str(),
                    Some(_) => return Err(ReconfigureError::msg(400, BAD_MODE)),
                };
                let force = force_of(payload)?;
                disabled_first(e)?;
                let mode = match mode {
                    "migrate" => RemoveMode::Migrate,
                    "evict" => RemoveMode::Evict,
                    "drain" => RemoveMode::Drain,
                    _ => return Err(ReconfigureError::msg(400, BAD_MODE)),
                };
                let id = target.resolve(e)?;
                let r = e
                    .remove_device(id, mode, force)
                    .map_err(|err| hotplug_err(&err))?;
                if mode == RemoveMode::Drain {
                    return Ok(json!({
                        "status": "ok",
                        "operation": "drain",
                        "adapter_index": 0,
                        "device_path": r.path,
                        "index": r.index,
                        "state": r.state.name(),
                    }));
                }
                Ok(json!({
                    "status": "ok",
                    "operation": "remove",
                    "adapter_index": 0,
                    "device_path": r.path,
                    "index": r.index,
                    "moved_keys": r.moved_keys,
                    "moved_bytes": r.moved_bytes,
                    "deleted_keys": r.deleted_keys,
                    "source_slots_freed": r.source_slots_freed,
                    "state": r.state.name(),
                }))
            }
            "resize" => {
                const BAD_MODE: &str = "mode must be migrate or evict";
                let target = target_of(payload)?;
                let size = size_of(payload)?;
                let mode = match payload.get("mode") {
                    None | Some(Value::Null) => "migrate",
                    Some(Value::String(m)) => m.as_str(),
                    Some(_) => return Err(ReconfigureError::msg(400, BAD_MODE)),
                };
                let force = force_of(payload)?;
                disabled_first(e)?;
                let mode = match mode {
                    "migrate" => ShrinkMode::Migrate,
                    "evict" => ShrinkMode::Evict,
                    _ => return Err(ReconfigureError::msg(400, BAD_MODE)),
                };
                let id = target.resolve(e)?;
                let r = e
                    .resize_device_to(id, size, mode, force, |p, n| (self.gate)(p, n, true))
                    .map_err(|err| hotplug_err(&err))?;
                Ok(json!({
                    "status": "ok",
                    "operation": "resize",
                    "adapter_index": 0,
                    "device_path": r.path,
                    "index": r.index,
                    "old_size_bytes": r.old_size_bytes,
                    "new_size_bytes": r.new_size_bytes,
                    "moved_keys": r.moved_keys,
                    "deleted_keys": r.deleted_keys,
                    "state": r.state.name(),
                }))
            }
            other => Err(ReconfigureError::msg(
                400,
                format!("unsupported DAX reconfigure operation: {other}"),
            )),
        }
    }
}
