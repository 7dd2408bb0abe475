//! The connector's metrics label and optional control plane.
//!
//! LMCache's `native_plugin` path has no reconfigure route, so
//! `adapter_params` may ask the connector to start daxkv's own HTTP control
//! plane (the same server as `daxkv serve`: `/reconfigure/dax/l2/*`,
//! `/metrics`, `/health`). On the `plugin` path the same key starts it with
//! `/metrics` and `/health` only: LMCache routes that adapter's hotplug
//! itself, and `lmcache server` serves no Prometheus `/metrics` of its own
//! (python/README.md, "Metrics"). It is off unless `"http"` is given. Two
//! keys are taken out of `adapter_params` before the engine's config is
//! read:
//!
//! - `"l2_name"` (string, default the adapter type LMCache labels its own
//!   L2 metrics with: `"native_plugin"` for `DaxConnector`, `"plugin"`
//!   ([`PLUGIN_L2_NAME`]) for `DaxL2Adapter`): the constant `l2_name` label
//!   on every daxkv series, so they join LMCache's `lmcache_mp.l2_*` ones;
//! - `"http"` (object): `host` (default `"127.0.0.1"`), `port` (default 0:
//!   a free port, read back from `DaxConnector.http_address`), `token`
//!   (bearer token for every route but `/health`), `allow_prefixes` (the
//!   device paths an `add` may name; not on the `plugin` path, which has
//!   no `add` route here), `allow_non_loopback` (default
//!   false), `allow_hosts` (the `Host` / `Origin` names accepted besides
//!   127.0.0.1, [::1] and localhost at the port; for non-loopback hosts).
//!   Unknown keys are an error, as in the engine's config.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use daxkv::control::http::{HttpConfig, HttpHooks, HttpServer};
use daxkv::control::reconfigure::{DaxReconfigure, Registry};
use daxkv::engine::Engine;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde_json::Value;

/// The `l2_name` label of the `native_plugin` connector when
/// `adapter_params` names none (the `plugin` adapter's is
/// [`PLUGIN_L2_NAME`]).
pub const DEFAULT_L2_NAME: &str = "native_plugin";

/// The `l2_name` label of the `plugin` adapter when `adapter_params` names
/// none: the adapter type LMCache labels it with.
pub const PLUGIN_L2_NAME: &str = "plugin";

/// What `adapter_params` asked for besides the engine.
#[derive(Debug)]
pub struct ControlParams {
    /// The `l2_name` label value.
    pub l2_name: String,
    /// The control plane's config, when asked for.
    pub http: Option<HttpConfig>,
}

fn bad(what: &str, why: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("config: {what}: {why}"))
}

/// Remove `l2_name` and `http` from `params` (a copy of the caller's) and
/// parse them.
pub fn take_control_params(
    py: Python<'_>,
    params: &Bound<'_, PyDict>,
    default_l2_name: &str,
) -> PyResult<ControlParams> {
    let l2_name = match params.get_item("l2_name")? {
        Some(v) => {
            params.del_item("l2_name")?;
            let s: String = v
                .extract()
                .map_err(|_| bad("l2_name", "must be a string"))?;
            if s.is_empty() {
                return Err(bad("l2_name", "must not be empty"));
            }
            s
        }
        None => default_l2_name.to_string(),
    };
    let http = match params.get_item("http")? {
        Some(v) => {
            params.del_item("http")?;
            let json: String = py.import("json")?.call_method1("dumps", (v,))?.extract()?;
            let v: Value = serde_json::from_str(&json).map_err(|e| bad("http", e))?;
            Some(http_config(&v)?)
        }
        None => None,
    };
    Ok(ControlParams { l2_name, http })
}

/// `"http": {…}` → the server's config (strict: unknown keys are errors).
fn http_config(v: &Value) -> PyResult<HttpConfig> {
    let obj = v
        .as_object()
        .ok_or_else(|| bad("http", format!("must be an object (got {v})")))?;
    let mut cfg = HttpConfig::default();
    let mut host: IpAddr = cfg.addr.ip();
    let mut port: u16 = 0;
    for (k, v) in obj {
        let what = format!("http.{k}");
        match k.as_str() {
            "host" => {
                let s = v.as_str().ok_or_else(|| bad(&what, "must be a string"))?;
                host = s
                    .parse()
                    .map_err(|_| bad(&what, format!("not an IP address: {s:?}")))?;
            }
            "port" => {
                port = v
                    .as_u64()
                    .and_then(|p| u16::try_from(p).ok())
                    .ok_or_else(|| {
                        bad(&what, format!("must be a port number 0-65535 (got {v})"))
                    })?;
            }
            "token" => {
                cfg.token = match v {
                    Value::Null => None,
                    Value::String(s) => Some(s.clone()),
                    _ => return Err(bad(&what, "must be a string")),
                };
            }
            "allow_prefixes" => {
                let arr = v
                    .as_array()
                    .ok_or_else(|| bad(&what, "must be a list of paths"))?;
                cfg.allow_prefixes = arr
                    .iter()
                    .map(|p| {
                        p.as_str()
                            .map(PathBuf::from)
                            .ok_or_else(|| bad(&what, format!("not a path: {p}")))
                    })
                    .collect::<PyResult<_>>()?;
            }
            "allow_hosts" => {
                let arr = v
                    .as_array()
                    .ok_or_else(|| bad(&what, "must be a list of host names"))?;
                cfg.allow_hosts = arr
                    .iter()
                    .map(|h| {
                        h.as_str()
                            .map(str::to_owned)
                            .ok_or_else(|| bad(&what, format!("not a host name: {h}")))
                    })
                    .collect::<PyResult<_>>()?;
            }
            "allow_non_loopback" => {
                cfg.allow_non_loopback = v
                    .as_bool()
                    .ok_or_else(|| bad(&what, "must be true or false"))?;
            }
            _ => return Err(bad(&what, "unknown key")),
        }
    }
    cfg.addr = SocketAddr::new(host, port);
    Ok(cfg)
}

/// The prometheus text of `engine` with the `l2_name` label.
pub fn metrics_text(engine: &Engine, l2_name: &str) -> String {
    daxkv::control::metrics::encode_labeled(engine, &[("l2_name", l2_name)])
}

/// Start the control plane for `engine` (reconfigure gated by the device
/// probe under `sysfs_root`, metrics with `l2_name`, health): the
/// `native_plugin` connector's.
pub fn start_http(
    cfg: HttpConfig,
    engine: Arc<Engine>,
    sysfs_root: PathBuf,
    l2_name: &str,
) -> PyResult<HttpServer> {
    let mut registry = Registry::new();
    registry.register(Arc::new(DaxReconfigure::probing(
        engine.clone(),
        sysfs_root,
    )));
    serve(cfg, registry, engine, l2_name)
}

/// Start `/metrics` and `/health` for `engine`, with no reconfigure
/// backend (`/reconfigure/…` answers as for an unknown backend): the
/// `plugin` adapter's, whose hotplug LMCache routes itself
/// (`/reconfigure/plugin/l2/*`, with its check of the other adapters'
/// devices), so one device has one way in.
pub fn start_metrics_http(
    cfg: HttpConfig,
    engine: Arc<Engine>,
    l2_name: &str,
) -> PyResult<HttpServer> {
    serve(cfg, Registry::new(), engine, l2_name)
}

/// Run `start` (one of the above) with the GIL released and note the
/// server's listening socket for `fork`; if it fails, close `engine` (its
/// devices and workers) before handing the error back: the constructor
/// that called this returns no object to close later.
pub fn start_or_close<F>(py: Python<'_>, engine: &Engine, start: F) -> PyResult<HttpServer>
where
    F: Send + pyo3::marker::Ungil + FnOnce() -> PyResult<HttpServer>,
{
    match crate::gil::release(py, start) {
        Ok(s) => {
            crate::fork::listening(py, s.listener_fd());
            Ok(s)
        }
        Err(err) => {
            engine.close();
            Err(err)
        }
    }
}

/// `"host:port"` of a face's control plane while it runs (`addr`, read
/// at start), `None` when none was started or once `close()` stopped it.
pub fn running_address(
    http: &std::sync::Mutex<Option<HttpServer>>,
    addr: Option<SocketAddr>,
) -> Option<String> {
    let running = http
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .is_some();
    running.then(|| addr.map(|a| a.to_string())).flatten()
}

fn serve(
    cfg: HttpConfig,
    registry: Registry,
    engine: Arc<Engine>,
    l2_name: &str,
) -> PyResult<HttpServer> {
    let metrics = {
        let (engine, l2_name) = (engine.clone(), l2_name.to_string());
        Arc::new(move || metrics_text(&engine, &l2_name))
    };
    let health = daxkv::control::http::engine_health(engine);
    let hooks = HttpHooks {
        metrics: Some(metrics),
        health: Some(health),
        owners: None,
    };
    daxkv::control::http::serve(cfg, registry, hooks)
        .map_err(|e| PyRuntimeError::new_err(format!("daxkv: control plane: {e}")))
}
