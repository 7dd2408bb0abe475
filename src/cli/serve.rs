//! # `daxkv serve`: the engine with its control plane, as a process
//!
//! Opens the engine from a config file (LMCache's adapter JSON, or the
//! same keys in TOML) or from the embedded default (one memfd device of
//! 1 GiB in 2 MiB slots, hotplug on), registers its DAX backend with the
//! HTTP control plane ([`crate::control::http`]) on loopback, logs what it mapped
//! and where its workers run, and with `traffic` runs the bench workload
//! against its own engine (bytes verified) so hotplug can be watched under
//! load in `/metrics`. [`Server::stop`] shuts down in order: traffic, HTTP,
//! then the engine (in-flight tasks finish, devices unmapped).
//!
//! [`request`] is the small HTTP/1.1 client the `daxkv status | add |
//! remove | resize` commands use.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::Value;

use crate::control::config::EngineConfig;
use crate::control::http::{HttpConfig, HttpHooks, HttpServer};
use crate::control::reconfigure::{
    DaxReconfigure, Owners, Reconfigurable, ReconfigureError, Registry,
};
use crate::engine::{Answer, Engine};
use crate::key::Key;
use crate::plumbing::buf::Buf;

/// The default control-plane address.
pub const DEFAULT_HTTP: &str = "127.0.0.1:8765";

/// The embedded default: one memfd device of 1 GiB in 2 MiB slots,
/// hotplug on (devices can be added over HTTP).
pub const DEFAULT_CONFIG: &str = r#"{"type": "dax", "slot_bytes": 2097152,
  "devices": [{"device_path": "memfd", "max_dax_size_gb": 1}],
  "hotplug_enabled": true}"#;

/// What `daxkv serve` runs.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The engine config file (`.toml` is read as TOML, anything else as
    /// LMCache's JSON); `None`: [`DEFAULT_CONFIG`].
    pub config: Option<PathBuf>,
    /// The control plane's settings (address, token, allow-list, …).
    pub http: HttpConfig,
    /// Run the bench workload against the engine until stopped.
    pub traffic: bool,
}

/// A serve error: one line naming what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The config file could not be read or parsed.
    #[error("--config {path}: {why}")]
    Config {
        /// The file.
        path: String,
        /// What was wrong.
        why: String,
    },
    /// The engine did not open.
    #[error("engine: {0}")]
    Engine(#[from] crate::engine::EngineError),
    /// The control plane did not start.
    #[error("http: {0}")]
    Http(#[from] crate::control::http::HttpError),
}

/// The largest config file read: a real one is a few hundred bytes. A
/// device file given by mistake (`--config /dev/shm/kv`) or a stream
/// (`/dev/zero`) is refused instead of read into memory.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// At most `limit` bytes of `path`; a longer file or stream is an error
/// that says so (a regular file's length is checked before reading).
fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    use std::io::Read as _;
    let too_big = || {
        format!(
            "larger than a config file may be ({} MiB): is it the device?",
            limit >> 20
        )
    };
    let f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    if f.metadata().is_ok_and(|m| m.is_file() && m.len() > limit) {
        return Err(too_big());
    }
    let mut bytes = Vec::new();
    f.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > limit {
        return Err(too_big());
    }
    Ok(bytes)
}

/// Read an engine config: `path` (TOML when its extension is `toml` in
/// any case, else JSON), or the embedded default. A UTF-8 byte-order mark
/// is skipped (editors on Windows write one; RFC 8259 lets a parser ignore
/// it); a UTF-16 file, other bytes that are not UTF-8, and a TOML `nan` or
/// `inf` are refused with a message that says so.
pub fn load_config(path: Option<&Path>) -> Result<EngineConfig, ServeError> {
    let Some(path) = path else {
        return EngineConfig::from_json(DEFAULT_CONFIG).map_err(|e| ServeError::Config {
            path: "(default)".into(),
            why: e.to_string(),
        });
    };
    let err = |why: String| ServeError::Config {
        path: path.display().to_string(),
        why,
    };
    let bytes = read_bounded(path, MAX_CONFIG_BYTES).map_err(err)?;
    let text = config_text(&bytes).map_err(err)?;
    let toml = path
        .extension()
        .is_some_and(|x| x.eq_ignore_ascii_case("toml"));
    let value: Value = if toml {
        let t: toml::Value =
            toml::from_str(text).map_err(|e| err(format!("not valid TOML: {e}")))?;
        finite_toml(&t, &mut String::new()).map_err(err)?;
        serde_json::to_value(t).map_err(|e| err(e.to_string()))?
    } else {
        serde_json::from_str(text).map_err(|e| err(format!("not valid JSON: {e}")))?
    };
    EngineConfig::from_value(&value).map_err(|e| err(e.to_string()))
}

/// A config file's text: UTF-8, without a leading byte-order mark.
fn config_text(bytes: &[u8]) -> Result<&str, String> {
    if bytes.starts_with(&[0xFF, 0xFE]) || bytes.starts_with(&[0xFE, 0xFF]) {
        return Err(
            "not UTF-8: the file starts with a UTF-16 byte-order mark (save it as UTF-8)".into(),
        );
    }
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    std::str::from_utf8(bytes)
        .map_err(|e| format!("not UTF-8: invalid byte at offset {}", e.valid_up_to()))
}

/// Refuse a TOML float that is not finite (`nan`, `inf`: JSON has no such
/// number, so it would reach the config as `null`), naming its key.
fn finite_toml(v: &toml::Value, at: &mut String) -> Result<(), String> {
    use std::fmt::Write as _;
    match v {
        toml::Value::Float(f) if !f.is_finite() => Err(format!(
            "config: {}: must be a finite number (got {f})",
            if at.is_empty() {
                "(document)"
            } else {
                at.as_str()
            }
        )),
        toml::Value::Table(t) => t.iter().try_for_each(|(k, v)| {
            let len = at.len();
            if !at.is_empty() {
                at.push('.');
            }
            at.push_str(k);
            let r = finite_toml(v, at);
            at.truncate(len);
            r
        }),
        toml::Value::Array(a) => a.iter().enumerate().try_for_each(|(i, v)| {
            let len = at.len();
            let _ = write!(at, "[{i}]");
            let r = finite_toml(v, at);
            at.truncate(len);
            r
        }),
        _ => Ok(()),
    }
}

/// A running server.
pub struct Server {
    engine: Arc<Engine>,
    http: Option<HttpServer>,
    traffic: Option<Traffic>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.addr())
            .finish_non_exhaustive()
    }
}

/// Counters of the `--traffic` workload, shared with `/metrics`.
#[derive(Debug, Default)]
struct TrafficStats {
    rounds: AtomicU64,
    verified: AtomicU64,
    /// Read back with bytes that are not the object's: a real error.
    wrong: AtomicU64,
    /// Not read back (not stored: the pool was full or had no device; or
    /// gone with a device removed under it): not an error.
    missed: AtomicU64,
}

struct Traffic {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

/// A server whose engine is open and whose control plane does not listen
/// yet ([`Server::prepare`]); [`Prepared::listen`] opens the port.
/// Dropping it closes the engine.
pub struct Prepared {
    engine: Arc<Engine>,
    sysfs_root: PathBuf,
    cfg: ServeConfig,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared").finish_non_exhaustive()
    }
}

impl Server {
    /// Open the engine, start the control plane (and the traffic):
    /// [`Server::prepare`], then [`Prepared::listen`].
    pub fn start(cfg: &ServeConfig) -> Result<Server, ServeError> {
        Server::prepare(cfg)?.listen()
    }

    /// Everything before the port opens, cheapest check first: the HTTP
    /// settings (token, address, allow-list), the config file, then the
    /// devices (mapped and pre-faulted: the slow part).
    pub fn prepare(cfg: &ServeConfig) -> Result<Prepared, ServeError> {
        cfg.http.validate()?;
        let ecfg = load_config(cfg.config.as_deref())?;
        let engine = Arc::new(ecfg.open()?);
        log_engine(&engine);
        Ok(Prepared {
            engine,
            sysfs_root: ecfg.sysfs_root,
            cfg: cfg.clone(),
        })
    }
}

impl Prepared {
    /// Open the port and start the traffic.
    pub fn listen(self) -> Result<Server, ServeError> {
        let Prepared {
            engine,
            sysfs_root,
            cfg,
        } = self;
        let stats = Arc::new(TrafficStats::default());
        let mut registry = Registry::new();
        registry.register(Arc::new(Logged(DaxReconfigure::probing(
            engine.clone(),
            sysfs_root,
        ))));
        let metrics = {
            let (engine, stats) = (engine.clone(), stats.clone());
            let traffic = cfg.traffic;
            Arc::new(move || {
                let mut text = crate::control::metrics::encode(&engine);
                if traffic {
                    text.push_str(&traffic_metrics(&stats));
                }
                text
            })
        };
        let health = crate::control::http::engine_health(engine.clone());
        let hooks = HttpHooks {
            metrics: Some(metrics),
            health: Some(health),
            owners: None,
        };
        let http = crate::control::http::serve(cfg.http.clone(), registry, hooks)?;
        tracing::info!(addr = %http.local_addr(), "control plane listening");
        let traffic = cfg.traffic.then(|| start_traffic(engine.clone(), stats));
        Ok(Server {
            engine,
            http: Some(http),
            traffic,
        })
    }
}

impl Server {
    /// The control plane's address.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(HttpServer::local_addr)
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Stop: the traffic, then the control plane, then the engine (in-
    /// flight tasks finish; devices are unmapped).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(t) = self.traffic.take() {
            // ORDERING: Relaxed — a stop request; the join orders the rest.
            t.stop.store(true, Ordering::Relaxed);
            let _ = t.thread.join();
        }
        if let Some(h) = self.http.take() {
            h.shutdown();
        }
        self.engine.close();
        tracing::info!("stopped: tasks finished, devices unmapped");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.http.is_some() {
            self.shutdown();
        }
    }
}

/// The DAX backend with each hotplug operation (add, remove, drain,
/// resize) logged on stderr in one line ([`hotplug_log_line`]): what, which
/// device, the outcome, the time taken.
struct Logged(DaxReconfigure);

impl Logged {
    /// The device a remove or resize names, as far as it can be told
    /// before it runs: `(path, index)`.
    fn named(&self, payload: &Value) -> (Option<String>, Option<u64>) {
        let e = self.0.engine();
        let path = payload["device_path"]
            .as_str()
            .map(|p| p.trim().to_string());
        let index = payload["device_index"].as_u64();
        match (path, index) {
            (None, Some(i)) => {
                let p = usize::try_from(i)
                    .ok()
                    .and_then(|i| e.device_status(i))
                    .and_then(|d| d["device_path"].as_str().map(str::to_string));
                (p, Some(i))
            }
            (Some(p), None) => {
                let i = e
                    .find_device(&p)
                    .ok()
                    .and_then(|id| e.device_index(id))
                    .map(|(i, _)| i as u64);
                (Some(p), i)
            }
            named => named,
        }
    }
}

impl Reconfigurable for Logged {
    fn backend(&self) -> &str {
        self.0.backend()
    }

    fn supported_operations(&self) -> Vec<String> {
        self.0.supported_operations()
    }

    fn status(&self) -> Value {
        self.0.status()
    }

    fn reconfigure(
        &self,
        operation: &str,
        payload: &Value,
        owners: Owners<'_>,
    ) -> Result<Value, ReconfigureError> {
        if !matches!(operation, "add" | "remove" | "resize") {
            return self.0.reconfigure(operation, payload, owners);
        }
        let started = std::time::Instant::now();
        let named = if operation == "add" {
            (
                payload["device_path"]
                    .as_str()
                    .map(|p| p.trim().to_string()),
                None,
            )
        } else {
            self.named(payload)
        };
        let r = self.0.reconfigure(operation, payload, owners);
        log_line!(
            "{}",
            hotplug_log_line(operation, payload, named, &r, started.elapsed())
        );
        r
    }
}

/// The log line of one hotplug operation: `daxkv: add /dev/shm/kv1
/// (device 1): ok, 256 MiB, 3 ms`, `daxkv: remove memfd (device 0):
/// refused (409): …, 1 ms`. `named` is the device as named before it ran
/// (path, index); the answer's own fields win. Paths and messages are
/// escaped ([`printable`]): a file name cannot forge log lines.
pub fn hotplug_log_line(
    operation: &str,
    payload: &Value,
    named: (Option<String>, Option<u64>),
    r: &Result<Value, ReconfigureError>,
    took: Duration,
) -> String {
    let what = if operation == "remove" && payload["mode"] == "drain" {
        "drain"
    } else {
        operation
    };
    let ok = r.as_ref().ok();
    // An add's answer holds the device; the others' hold its fields.
    let answer = ok.map(|v| if operation == "add" { &v["device"] } else { v });
    let path = answer
        .and_then(|d| d["device_path"].as_str().map(str::to_string))
        .or(named.0);
    let index = answer.and_then(|d| d["index"].as_u64()).or(named.1);
    let device = match (path, index) {
        (Some(p), Some(i)) => format!("{} (device {i})", printable(&p)),
        (Some(p), None) => printable(&p).into_owned(),
        (None, Some(i)) => format!("device {i}"),
        (None, None) => "?".into(),
    };
    let size = |v: &Value| {
        v.as_u64()
            .map_or_else(|| "?".into(), crate::host::units::human)
    };
    let outcome = match r {
        Ok(v) => {
            let detail = match what {
                "add" => size(&payload["size_bytes"]),
                "resize" => format!(
                    "{} -> {}",
                    size(&v["old_size_bytes"]),
                    size(&v["new_size_bytes"])
                ),
                "remove" => format!(
                    "{} keys moved, {} deleted",
                    v["moved_keys"].as_u64().unwrap_or(0),
                    v["deleted_keys"].as_u64().unwrap_or(0)
                ),
                _ => v["state"].as_str().unwrap_or("ok").to_string(),
            };
            format!("ok, {detail}")
        }
        Err(e) => {
            let msg = e.body["error"]
                .as_str()
                .or_else(|| e.body["reason"].as_str())
                .map_or_else(|| e.body.to_string(), str::to_string);
            format!("refused ({}): {}", e.status, printable(&msg))
        }
    };
    format!("daxkv: {what} {device}: {outcome}, {} ms", took.as_millis())
}

/// Log what was mapped and where the workers run.
fn log_engine(e: &Engine) {
    for d in e.devices() {
        tracing::info!(
            device = d.id.0,
            path = %d.path,
            bytes = d.arena_bytes,
            slot_bytes = d.slot_bytes,
            slots = d.max_slots,
            "mapped device"
        );
    }
    let st = e.status();
    let o = e.options();
    tracing::info!(
        store = o.num_store_workers,
        lookup = o.num_lookup_workers,
        load = o.num_load_workers,
        cpus = %st["numa"]["cpus"],
        placement = %st["numa"]["source"],
        node = %st["numa"]["node"],
        process_cpus = %crate::host::numa::affinity::format_cpulist(
            &serde_json::from_value::<Vec<usize>>(st["numa"]["process_cpus"].clone())
                .unwrap_or_default()
        ),
        "workers started"
    );
    // Where each worker actually runs, as it read its mask back.
    for w in e.worker_placement() {
        tracing::info!(
            worker = %w.name,
            tid = w.tid,
            cpus = %crate::host::numa::affinity::format_cpulist(&w.cpus),
            last_cpu = %w.last_cpu.map_or_else(|| "?".to_string(), |c| c.to_string()),
            "worker placed"
        );
    }
    for w in e.placement_warnings() {
        tracing::warn!("worker placement: {w}");
    }
}

fn traffic_metrics(stats: &TrafficStats) -> String {
    // ORDERING: Relaxed — statistics.
    let (r, v, w, m) = (
        stats.rounds.load(Ordering::Relaxed),
        stats.verified.load(Ordering::Relaxed),
        stats.wrong.load(Ordering::Relaxed),
        stats.missed.load(Ordering::Relaxed),
    );
    format!(
        "# HELP daxkv_traffic_rounds_total Rounds of the --traffic workload.\n\
         # TYPE daxkv_traffic_rounds_total counter\n\
         daxkv_traffic_rounds_total {r}\n\
         # HELP daxkv_traffic_verified_total Objects the --traffic workload loaded back with the right bytes.\n\
         # TYPE daxkv_traffic_verified_total counter\n\
         daxkv_traffic_verified_total {v}\n\
         # HELP daxkv_traffic_wrong_bytes_total Objects the --traffic workload read back with wrong bytes (errors).\n\
         # TYPE daxkv_traffic_wrong_bytes_total counter\n\
         daxkv_traffic_wrong_bytes_total {w}\n\
         # HELP daxkv_traffic_missed_total Objects the --traffic workload did not read back (not stored, or removed with a device).\n\
         # TYPE daxkv_traffic_missed_total counter\n\
         daxkv_traffic_missed_total {m}\n"
    )
}

/// Bytes of object `i` of round `r` (the bench's source pattern).
fn pattern(r: u64, i: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    crate::cli::bench::fill(&mut v, (r << 20) as usize | i);
    v
}

/// The bench workload, continuously: each round stores 16 objects of
/// 64 KiB (or the slot, if smaller), looks them up and locks them, loads
/// and verifies them, unlocks and deletes them. Wrong bytes are errors; a
/// miss (the pool was full or empty, or a device was removed under the
/// object) is counted apart.
fn start_traffic(engine: Arc<Engine>, stats: Arc<TrafficStats>) -> Traffic {
    let stop = Arc::new(AtomicBool::new(false));
    let thread = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("daxkv-traffic".into())
            .spawn(move || {
                let len = engine.slot_bytes().min(64 << 10);
                let wait = Duration::from_secs(10);
                let mut round = 0u64;
                // ORDERING: Relaxed — a stop request; nothing is read on it.
                while !stop.load(Ordering::Relaxed) {
                    round += 1;
                    let keys: Vec<Key> = (0..16)
                        .map(|i| Key::digest(format!("traffic@{round}@{i}").as_bytes()))
                        .collect();
                    let bufs = (0..16).map(|i| Buf::from(pattern(round, i, len))).collect();
                    let Ok(id) = engine.submit_store(keys.clone(), bufs) else {
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    };
                    let _ = engine.wait_store(id, wait);
                    if let Ok(id) = engine.submit_lookup_and_lock(keys.clone()) {
                        let _ = engine.wait_lookup(id, wait);
                    }
                    if let Ok(id) = engine.submit_load(keys.clone(), vec![vec![0; len]; 16]) {
                        if let Answer::Ready(r) = engine.wait_load(id, wait) {
                            for i in 0..16 {
                                let counter = match r.payload(i) {
                                    Some(p) if p == pattern(round, i, len) => &stats.verified,
                                    Some(_) => {
                                        tracing::error!(round, object = i, "traffic: wrong bytes");
                                        &stats.wrong
                                    }
                                    None => &stats.missed,
                                };
                                // ORDERING: Relaxed — a statistic.
                                counter.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    engine.submit_unlock(&keys);
                    engine.delete(&keys);
                    // ORDERING: Relaxed — a statistic.
                    stats.rounds.fetch_add(1, Ordering::Relaxed);
                }
            })
            .expect("spawn the traffic thread")
    };
    Traffic { stop, thread }
}

/// One HTTP/1.1 request to `server` (`host:port`, or `http://host:port`):
/// `(status, body)`, within [`crate::cli::client::DEFAULT_TIMEOUT`] and
/// [`crate::cli::client::MAX_ANSWER_BYTES`]. See [`crate::cli::client::Client`].
pub fn request(
    server: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    token: Option<&str>,
) -> std::io::Result<(u16, String)> {
    crate::cli::client::Client::new(server, token, crate::cli::client::DEFAULT_TIMEOUT)
        .and_then(|c| c.request(method, path, body))
        .map_err(|e| match e {
            crate::cli::client::ClientError::Connect { error, .. } => error,
            e => std::io::Error::other(e.to_string()),
        })
}

/// The devices of a `/reconfigure/dax/l2/status` answer as a table: one
/// line per adapter (`32 MiB of 1 GiB used`), then its devices in
/// columns as wide as their widest cell, sizes in binary units
/// ([`crate::host::units::human`]: exact, else bytes).
pub fn status_table(status: &Value) -> String {
    use std::fmt::Write as _;
    let size = |v: &Value| {
        v.as_u64()
            .map_or_else(|| "?".into(), crate::host::units::human)
    };
    let mut out = String::new();
    for a in status["adapters"].as_array().into_iter().flatten() {
        let st = &a["status"];
        let devices = st["devices"].as_array().map_or(&[][..], Vec::as_slice);
        // Status's `is_healthy` is LMCache's (a pool without a device is
        // healthy there); `/health` is not, and says so: so does the table.
        let stalled = if devices.iter().any(|d| d["state"] == "active") {
            ""
        } else {
            ", no device takes new keys (add one)"
        };
        // Removed devices stay listed (their ids are never reused) but
        // are not counted: the header is what serves now.
        let n = devices.iter().filter(|d| d["state"] != "removed").count();
        let _ = writeln!(
            out,
            "adapter {}: {n} device{}, {} of {} used, healthy: {}{stalled}",
            a["adapter_index"],
            if n == 1 { "" } else { "s" },
            size(&st["total_used_bytes"]),
            size(&st["max_dax_size_bytes"]),
            st["is_healthy"],
        );
        let mut rows: Vec<[String; 8]> = vec![[
            "index", "id", "state", "used", "size", "slots", "locked", "path",
        ]
        .map(String::from)];
        for d in devices {
            let n = |k: &str| d[k].as_u64().map_or_else(|| "?".into(), |v| v.to_string());
            let used = d["live_slot_count"]
                .as_u64()
                .zip(d["slot_bytes"].as_u64())
                .map_or_else(
                    || "?".into(),
                    |(n, b)| crate::host::units::human(n.saturating_mul(b)),
                );
            rows.push([
                n("index"),
                n("device_id"),
                printable(d["state"].as_str().unwrap_or("?")).into_owned(),
                used,
                size(&d["max_dax_size_bytes"]),
                n("max_slots"),
                n("locked_key_count"),
                printable(d["device_path"].as_str().unwrap_or("?")).into_owned(),
            ]);
        }
        let mut width = [0usize; 8];
        for r in &rows {
            for (w, c) in width.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        for r in &rows {
            let mut line = String::new();
            for (i, c) in r.iter().enumerate() {
                if i + 1 == r.len() {
                    line.push_str(c);
                } else {
                    let _ = write!(line, "{c:<w$}  ", w = width[i]);
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
    }
    out
}

/// `s` for a terminal: control characters (ESC, CR, BEL, C1 such as
/// U+009B) escaped as `\u{1b}`, `\r`, …, the rest as it is. A device path
/// is any file name a local user could create, and the answer may come
/// from a server that is not daxkv: printed raw, either could clear the
/// operator's screen, retitle the window or overwrite a line.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return s.into();
    }
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

/// Block SIGINT and SIGTERM in the calling thread and every thread it
/// starts afterwards: call it first in `main`, so that
/// [`wait_for_shutdown_signal`] takes them and no worker dies of them.
pub fn block_shutdown_signals() -> std::io::Result<()> {
    crate::host::sys::block_signals(&[libc::SIGINT, libc::SIGTERM])
}

/// Wait for SIGINT or SIGTERM (blocked with [`block_shutdown_signals`]);
/// returns its name.
pub fn wait_for_shutdown_signal() -> std::io::Result<&'static str> {
    let s = crate::host::sys::wait_signal(&[libc::SIGINT, libc::SIGTERM])?;
    Ok(signal_name(s))
}

fn signal_name(s: libc::c_int) -> &'static str {
    if s == libc::SIGINT {
        "SIGINT"
    } else {
        "SIGTERM"
    }
}

/// Where `daxkv serve` is, for its signal thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Reading the config, mapping and pre-faulting devices: a signal ends
    /// the process at once.
    Starting,
    /// The port is open: a signal is handed to [`ShutdownSignals::wait`].
    Serving,
}

/// SIGINT / SIGTERM for `daxkv serve`, taken by a thread of their own from
/// before start-up, so that start-up never runs deaf: a config read hung
/// on a FIFO, or the pre-fault of a large device, cannot be interrupted
/// in place, so a signal during start-up prints one line and ends the
/// process (exit status 128 + the signal's number, as a shell reports a
/// process killed by it). The port is opened under the same lock
/// ([`ShutdownSignals::serving`]), so a start-up interrupted by a signal
/// never opens it. Once serving, a signal is handed to
/// [`ShutdownSignals::wait`] for an orderly stop.
#[derive(Debug)]
pub struct ShutdownSignals {
    phase: Arc<std::sync::Mutex<Phase>>,
    rx: std::sync::mpsc::Receiver<&'static str>,
}

impl ShutdownSignals {
    /// Block SIGINT and SIGTERM ([`block_shutdown_signals`]: call it before
    /// any other thread starts) and start the thread that takes them.
    pub fn start() -> std::io::Result<ShutdownSignals> {
        block_shutdown_signals()?;
        let phase = Arc::new(std::sync::Mutex::new(Phase::Starting));
        let (tx, rx) = std::sync::mpsc::channel();
        let p = phase.clone();
        std::thread::Builder::new()
            .name("daxkv-signals".into())
            .spawn(move || loop {
                let Ok(sig) = crate::host::sys::wait_signal(&[libc::SIGINT, libc::SIGTERM]) else {
                    continue;
                };
                let phase = p.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if *phase == Phase::Starting {
                    // Held to the end: `serving` cannot open the port now.
                    log_line!(
                        "daxkv: {} during start-up: stopped before serving",
                        signal_name(sig)
                    );
                    std::process::exit(128 + sig);
                }
                if tx.send(signal_name(sig)).is_err() {
                    return;
                }
            })?;
        Ok(ShutdownSignals { phase, rx })
    }

    /// Run `open` (the step that opens the port) unless a signal came
    /// during start-up, and count as serving from then on.
    pub fn serving<T>(&self, open: impl FnOnce() -> T) -> T {
        let mut phase = self
            .phase
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let out = open();
        *phase = Phase::Serving;
        out
    }

    /// Wait for SIGINT or SIGTERM once serving; returns its name.
    pub fn wait(&self) -> &'static str {
        // The sender lives as long as the signal thread, which never ends
        // while serving.
        self.rx.recv().unwrap_or("SIGTERM")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_config_is_one_memfd_gib_in_2mib_slots_with_hotplug() {
        let c = load_config(None).unwrap();
        assert_eq!(c.slot_bytes, 2 << 20);
        assert_eq!(c.devices.len(), 1);
        assert_eq!(c.devices[0].device_path, "memfd");
        assert_eq!(c.devices[0].max_dax_size_bytes, 1 << 30);
        assert!(c.hotplug_enabled);
    }

    #[test]
    fn toml_and_json_configs_read_the_same_keys() {
        let dir = tempfile::tempdir().unwrap();
        let j = dir.path().join("c.json");
        let t = dir.path().join("c.toml");
        std::fs::write(
            &j,
            r#"{"type":"dax","slot_bytes":4096,"hotplug_enabled":true,
                "devices":[{"device_path":"memfd","max_dax_size_gb":0.0625}],"num_load_workers":2}"#,
        )
        .unwrap();
        std::fs::write(
            &t,
            "type = \"dax\"\nslot_bytes = 4096\nhotplug_enabled = true\nnum_load_workers = 2\n\
             [[devices]]\ndevice_path = \"memfd\"\nmax_dax_size_gb = 0.0625\n",
        )
        .unwrap();
        assert_eq!(
            load_config(Some(&j)).unwrap(),
            load_config(Some(&t)).unwrap()
        );
        std::fs::write(&t, "slot_bytes = [").unwrap();
        let e = load_config(Some(&t)).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("--config {}: not valid TOML", t.display())),
            "{e}"
        );
        std::fs::write(&j, r#"{"type":"dax","slot_bytes":0}"#).unwrap();
        let e = load_config(Some(&j)).unwrap_err().to_string();
        assert!(e.contains("slot_bytes"), "{e}");
    }

    /// A number reads as the same f64 in JSON and in TOML: serde_json's
    /// default parser read this one a unit in the last place off, so the
    /// two files answered with different numbers (`float_roundtrip`).
    #[test]
    fn toml_and_json_read_a_long_float_alike() {
        let dir = tempfile::tempdir().unwrap();
        let j = dir.path().join("c.json");
        let t = dir.path().join("c.toml");
        std::fs::write(&j, r#"{"slot_bytes":4096,"type":8.510527052557487e291}"#).unwrap();
        std::fs::write(&t, "slot_bytes = 4096\ntype = 8.510527052557487e291\n").unwrap();
        let why = |p: &Path| match load_config(Some(p)).unwrap_err() {
            ServeError::Config { why, .. } => why,
            e => panic!("{e}"),
        };
        assert_eq!(why(&j), why(&t));
        assert!(why(&j).contains("8.510527052557487e+291"), "{}", why(&j));
    }

    /// What an editor or a typo puts in a config file gets a message that
    /// names it: a UTF-8 BOM is skipped, a UTF-16 file is named as such, a
    /// `.TOML` file is TOML, a TOML `nan` / `inf` names its key (it would
    /// reach the config as `null`), a 1e12 GiB device names the limit.
    #[test]
    fn config_files_from_editors_and_typos() {
        let dir = tempfile::tempdir().unwrap();
        let json = r#"{"type":"dax","slot_bytes":4096,"hotplug_enabled":true,"devices":[]}"#;
        let p = dir.path().join("bom.json");
        std::fs::write(&p, [&b"\xEF\xBB\xBF"[..], json.as_bytes()].concat()).unwrap();
        assert_eq!(load_config(Some(&p)).unwrap().slot_bytes, 4096);
        let p = dir.path().join("utf16.json");
        let wide: Vec<u8> = [0xFF, 0xFE]
            .into_iter()
            .chain(json.bytes().flat_map(|b| [b, 0]))
            .collect();
        std::fs::write(&p, wide).unwrap();
        let e = load_config(Some(&p)).unwrap_err().to_string();
        assert!(
            e.ends_with(
                "not UTF-8: the file starts with a UTF-16 byte-order mark (save it as UTF-8)"
            ),
            "{e}"
        );
        let p = dir.path().join("latin1.json");
        std::fs::write(&p, b"{\"type\":\"d\xE4x\"}").unwrap();
        let e = load_config(Some(&p)).unwrap_err().to_string();
        assert!(e.ends_with("not UTF-8: invalid byte at offset 10"), "{e}");
        let toml =
            "slot_bytes = 4096\nhotplug_enabled = true\n[[devices]]\ndevice_path = \"memfd\"\n";
        let p = dir.path().join("UPPER.TOML");
        std::fs::write(&p, format!("{toml}max_dax_size_gb = 0.001\n")).unwrap();
        assert_eq!(load_config(Some(&p)).unwrap().devices.len(), 1);
        let p = dir.path().join("bom.toml");
        std::fs::write(&p, format!("\u{feff}{toml}max_dax_size_gb = 0.001\n")).unwrap();
        assert_eq!(load_config(Some(&p)).unwrap().devices.len(), 1);
        for (v, shown) in [("nan", "NaN"), ("inf", "inf"), ("-inf", "-inf")] {
            let p = dir.path().join("nan.toml");
            std::fs::write(&p, format!("{toml}max_dax_size_gb = {v}\n")).unwrap();
            let e = load_config(Some(&p)).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "--config {}: config: devices[0].max_dax_size_gb: must be a finite number (got {shown})",
                    p.display()
                )
            );
        }
        let p = dir.path().join("huge.toml");
        std::fs::write(&p, format!("{toml}max_dax_size_gb = 1e12\n")).unwrap();
        let e = load_config(Some(&p)).unwrap_err().to_string();
        assert!(
            e.ends_with("devices[0].max_dax_size_gb: 1000000000000 GiB is beyond the largest device, 131072 GiB (128 TiB)"),
            "{e}"
        );
    }
}
