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
//! (`DaxReconfigure`) translates payloads into the engine's typed pool
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
