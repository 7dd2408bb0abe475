//! # The HTTP control plane
//!
//! LMCache's reconfigure API (docs/lmcache-dax-behavior.md §5), `/health`
//! and `/metrics`, served by axum on **one** current-thread tokio runtime in
//! its own thread: the data path stays thread-based and free of async.
//!
//! | route | answer |
//! |---|---|
//! | `GET /reconfigure/{backend}/l2/status` | the status envelope (docs/lmcache-dax-behavior.md §5.3) `{enabled, backend, num_adapters, adapters: [{backend, supported_operations, status, adapter_index, l2_adapter_index}]}`: that backend's adapters only, `adapter_index` backend-local, `l2_adapter_index` generic; an unknown backend is 200 with `enabled: false` |
//! | `POST /reconfigure/{backend}/l2/{operation}` | the backend's result (docs/lmcache-dax-behavior.md §5.4), with `adapter_index` set to the **generic** index (the quirk below) |
//! | `GET /reconfigure/dax/status`, `POST /reconfigure/dax/{add,remove,resize}` | the same for `dax`: the seed's v2 routes, kept for the fork's coordinator (upstream's latest answers 404 there) |
//! | `GET /health` | 200 `{"status":"ok"}`; 200 `{"status":"degraded","reason":"device 0 (…) failed; …"}` while a failed device waits for its remove and the others serve; 503 `{"status":"unhealthy","reason":"…"}` when [`HttpHooks::health`] gives a reason (for an engine: [`engine_health`]) |
//! | `GET /metrics` | [`HttpHooks::metrics`]' text (`text/plain; version=0.0.4; charset=utf-8`), 404 without one |
//!
//! `{backend}` and `{operation}` are stripped and lower-cased; an empty one
//! is 400 (`"backend must be non-empty"` / `"operation must be
//! non-empty"`). The request bodies and what the backend receives are in
//! docs/control-plane.md; the size grammar is
//! [`parse_size`]'s.
//!
//! Every request goes through the [`Registry`]: this module never reaches
//! into device or slot state.
//!
//! **Answer at once.** Every call into a backend or a hook runs on the
//! runtime's blocking pool, never on the event loop, and mutations hold one
//! of [`HttpConfig::max_concurrent_mutations`] permits while they run (the
//! pool has room for the others beyond them): a status request, `/health`
//! and `/metrics` answer while a long `add` / `remove` / `resize` runs
//! (upstream's status waits for it), and the mutating request answers when
//! its operation completes. A client that hangs up does not cancel an
//! operation that has started.
//!
//! **Errors.** A domain error ([`ReconfigureError`]) answers with its own
//! status and body. A body that breaks the schema is FastAPI's 422
//! `{"detail": [{"type", "loc": ["body", field, ...], "msg", "input"}]}`
//! (`extra_forbidden`, `missing`, `int_type` / `string_type`,
//! `literal_error`, `bool_parsing`, `json_invalid`,
//! `model_attributes_type`); axum's own rejections never leak. Everything
//! else is `{"error": msg}`: 400 for an empty backend or operation, an
//! unsupported DAX operation or a bad size (see [`parse_size`]; the input
//! is never echoed and never reaches a backend), 401, 403, 404 (`"<backend>
//! adapter not found"`, `"not found"`), 405, 408 (a body not received in
//! [`HttpConfig::body_read_timeout`]), 413, 415 (a POST that is not
//! `application/json`, refused before its body is read), and 500
//! (`"internal error"`) if a backend call or a hook panics.
//!
//! **The `adapter_index` quirk.** A POST's `adapter_index` counts among the
//! adapters of that backend (backend-local); the 200 answer carries the
//! *generic* index (the position in the [`Registry`]) in `adapter_index`,
//! as upstream does (docs/lmcache-dax-behavior.md §9.4 item 6), so that
//! existing controllers see the same numbers.
//!
//! **Security.** The server listens on loopback only unless
//! [`HttpConfig::allow_non_loopback`] is set; an optional bearer token
//! guards every route but `/health` (compared in constant time); an
//! allow-list of path prefixes guards DAX `add`, comparing canonical paths
//! (symlinks and `..` resolved; for an add with `"create": true`, before
//! the file is created); bodies are limited to
//! [`HttpConfig::body_limit`] bytes (413). The allow-list is checked before
//! the backend opens the path: it keeps a mistaken or hostile controller
//! off other devices, not a local user who can write inside the allowed
//! directories. Browsers on the same host are kept out by the `Host`,
//! `Origin` and `Content-Type` rules of `guard.rs`; connections are capped,
//! idle and slow ones timed out, and an accept error (`EMFILE`) retried
//! after a back-off (`conn.rs`).
//! Anonymous devices (`memfd`, `memfd:NAME`) are not paths:
//! with an allow-list set they are refused (403) unless the list holds the
//! entry `memfd`, since each one takes RAM (bounded by the engine's memory
//! check, not by the allow-list).

#![forbid(unsafe_code)]
// `Err(Response)` is axum's early-return idiom; every such path is cold.
#![allow(clippy::result_large_err)]

mod conn;
mod guard;
mod schema;
mod size;

use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::path::{Component, Path as FsPath, PathBuf};
use std::pin::pin;
use std::sync::{mpsc, Arc};
use std::task::Poll;
use std::thread::JoinHandle;
use std::time::Duration;

use axum::body::{to_bytes, Body};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::{oneshot, Semaphore};

use crate::control::reconfigure::{ReconfigureError, Registry};
use schema::{Accepted, Refusal};
pub use size::{parse_size, MAX_SIZE_CHARS};

/// The `/metrics` body (Prometheus text format 0.0.4), produced on demand.
pub type MetricsFn = Arc<dyn Fn() -> String + Send + Sync>;

/// `/health`: `Ok(None)` when healthy (200 `ok`), `Ok(Some(reason))` when
/// it serves degraded (200 `degraded`), `Err(reason)` for 503.
pub type HealthFn = Arc<dyn Fn() -> Result<Option<String>, String> + Send + Sync>;

/// `/health` for `engine`: [`Engine::health`](crate::engine::Engine::health)
/// (unhealthy while it closes, with an unhealthy device, and when no
/// device can take a store; degraded while a failed device waits for its
/// remove and the others serve).
pub fn engine_health(engine: Arc<crate::engine::Engine>) -> HealthFn {
    Arc::new(move || engine.health())
}

/// LMCache's `device_owners` for the backend at a generic index: the
/// *other* owners of a device path (`"L1"`, other adapters' names). A
/// non-empty answer makes a DAX `add` a 409.
pub type OwnersFn = Arc<dyn Fn(usize, &str) -> Vec<String> + Send + Sync>;

/// How the control plane listens and what it allows.
#[derive(Clone, Debug)]
pub struct HttpConfig {
    /// Where to listen; the default `127.0.0.1:0` picks a free port (see
    /// [`HttpServer::local_addr`]).
    pub addr: SocketAddr,
    /// Allow a non-loopback `addr` (`0.0.0.0` included). Off by default:
    /// [`serve`] refuses one with [`HttpError::NonLoopback`]. Set a
    /// [`token`](Self::token) too when turning it on.
    pub allow_non_loopback: bool,
    /// A bearer token every route but `/health` requires
    /// (`Authorization: Bearer <token>`); `None` requires none.
    pub token: Option<String>,
    /// The device path prefixes a DAX `add` may name, compared component by
    /// component on canonical paths; empty allows every path and anonymous
    /// device. The entry `memfd` is not a path: it allows anonymous devices
    /// (`memfd`, `memfd:NAME`), which a non-empty list otherwise refuses.
    pub allow_prefixes: Vec<PathBuf>,
    /// The largest request body, in bytes (413 beyond it).
    pub body_limit: usize,
    /// How many mutations may run at once; later ones wait for a permit
    /// (without holding a thread).
    pub max_concurrent_mutations: usize,
    /// How long [`HttpServer::shutdown`] waits for requests in flight
    /// before closing their connections.
    pub shutdown_grace: Duration,
    /// Open connections at most (each holds an fd); further callers wait
    /// in the kernel's accept queue until one closes.
    pub max_connections: usize,
    /// The longest wait for a request head, and for the next request on an
    /// idle keep-alive connection; the connection is closed after it.
    pub header_read_timeout: Duration,
    /// The longest wait for a whole request body (408 after it).
    pub body_read_timeout: Duration,
    /// `Host` / `Origin` authorities allowed besides `127.0.0.1`, `[::1]`
    /// and `localhost` at the listening port (and the listening address
    /// itself): `name`, `name:port`, `10.0.0.5`, `[fe80::1]:8765`; a
    /// name without a port means the listening port. For non-loopback
    /// listeners: the names clients reach this server by.
    pub allow_hosts: Vec<String>,
}

impl Default for HttpConfig {
    fn default() -> HttpConfig {
        HttpConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            allow_non_loopback: false,
            token: None,
            allow_prefixes: Vec::new(),
            body_limit: 64 << 10,
            max_concurrent_mutations: 4,
            shutdown_grace: Duration::from_secs(5),
            max_connections: 128,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            allow_hosts: Vec::new(),
        }
    }
}

impl HttpConfig {
    /// Check every field without binding or starting anything (what
    /// [`serve`] refuses, but binding): `daxkv serve` runs it before it maps
    /// a device, so a bad flag fails at once.
    pub fn validate(&self) -> Result<(), HttpError> {
        self.checked().map(drop)
    }

    /// The checks; the canonical allow-list and whether it holds `memfd`.
    fn checked(&self) -> Result<(Vec<PathBuf>, bool), HttpError> {
        if !self.addr.ip().is_loopback() && !self.allow_non_loopback {
            return Err(HttpError::NonLoopback(self.addr));
        }
        if let Some(t) = &self.token {
            if t.is_empty() || !t.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(HttpError::Config(
                    "token must be non-empty printable ASCII without spaces".into(),
                ));
            }
        }
        if self.body_limit == 0 {
            return Err(HttpError::Config("body_limit must be > 0".into()));
        }
        if self.max_concurrent_mutations == 0 {
            return Err(HttpError::Config(
                "max_concurrent_mutations must be > 0".into(),
            ));
        }
        if self.max_connections == 0 {
            return Err(HttpError::Config("max_connections must be > 0".into()));
        }
        for (name, d) in [
            ("header_read_timeout", self.header_read_timeout),
            ("body_read_timeout", self.body_read_timeout),
        ] {
            if d.is_zero() {
                return Err(HttpError::Config(format!("{name} must be > 0")));
            }
        }
        // The names are checked before binding; the port is known after.
        guard::Hosts::new(self.addr, &self.allow_hosts).map_err(HttpError::Config)?;
        // `memfd` in the list is not a path: it lets `add` make anonymous
        // devices (`memfd`, `memfd:NAME`), which an allow-list otherwise refuses.
        let allow_memfd = self.allow_prefixes.iter().any(|p| p.as_os_str() == "memfd");
        let allow = self
            .allow_prefixes
            .iter()
            .filter(|p| p.as_os_str() != "memfd")
            .map(|p| {
                canonical(p).ok_or_else(|| {
                    HttpError::Config(format!(
                        "allow_prefixes: {} is neither absolute nor under an existing directory",
                        p.display()
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((allow, allow_memfd))
    }
}

/// The callbacks the server calls besides the [`Registry`]; each runs on
/// the blocking pool, never on the event loop.
#[derive(Clone, Default)]
pub struct HttpHooks {
    /// The `/metrics` body; `None` makes `/metrics` a 404.
    pub metrics: Option<MetricsFn>,
    /// `/health`'s verdict; `None` is always healthy.
    pub health: Option<HealthFn>,
    /// Other owners of a device path, handed to
    /// [`Reconfigurable::reconfigure`](crate::control::reconfigure::Reconfigurable::reconfigure);
    /// `None` reports none.
    pub owners: Option<OwnersFn>,
}

impl std::fmt::Debug for HttpHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpHooks")
            .field("metrics", &self.metrics.is_some())
            .field("health", &self.health.is_some())
            .field("owners", &self.owners.is_some())
            .finish()
    }
}

/// Why [`serve`] did not start.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// A non-loopback address without [`HttpConfig::allow_non_loopback`].
    #[error("refusing to listen on non-loopback address {0} (allow_non_loopback is off)")]
    NonLoopback(SocketAddr),
    /// A config value out of range (names the field).
    #[error("invalid HTTP config: {0}")]
    Config(String),
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The runtime or its thread could not be started.
    #[error("cannot start the HTTP runtime: {0}")]
    Runtime(#[source] std::io::Error),
}

/// How long a stopping server waits for its blocking threads: the idle
/// ones exit at once; one running a backend operation goes on alone after.
const BLOCKING_JOIN_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// A running control plane. Dropping it shuts it down like
/// [`shutdown`](Self::shutdown).
#[derive(Debug)]
pub struct HttpServer {
    addr: SocketAddr,
    grace: Option<oneshot::Sender<()>>,
    force: Option<oneshot::Sender<()>>,
    done: mpsc::Receiver<()>,
    thread: Option<JoinHandle<()>>,
    grace_period: Duration,
    listener_fd: std::os::fd::RawFd,
}

impl HttpServer {
    /// The address it listens on (with the port picked for `:0`).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The listening socket's descriptor, open until the server stops: a
    /// process forked meanwhile has a copy that keeps the port bound after
    /// the server stops, unless it closes it (the Python package does).
    pub fn listener_fd(&self) -> std::os::fd::RawFd {
        self.listener_fd
    }

    /// Stop accepting, let requests in flight finish (up to
    /// [`HttpConfig::shutdown_grace`], then close their connections), and
    /// join the server thread. A backend operation already running goes on
    /// to its end on its own thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        if let Some(g) = self.grace.take() {
            let _ = g.send(());
        }
        // Disconnected (the thread ended) or timed out: either way, force.
        let _ = self.done.recv_timeout(self.grace_period);
        if let Some(f) = self.force.take() {
            let _ = f.send(());
        }
        let _ = thread.join();
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start the control plane for `registry` on its own thread; returns once
/// it listens.
pub fn serve(
    cfg: HttpConfig,
    registry: Registry,
    hooks: HttpHooks,
) -> Result<HttpServer, HttpError> {
    let (allow, allow_memfd) = cfg.checked()?;

    let listener = std::net::TcpListener::bind(cfg.addr).map_err(|source| HttpError::Bind {
        addr: cfg.addr,
        source,
    })?;
    let addr = listener.local_addr().map_err(HttpError::Runtime)?;
    let listener_fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
    listener.set_nonblocking(true).map_err(HttpError::Runtime)?;
    let hosts = guard::Hosts::new(addr, &cfg.allow_hosts).map_err(HttpError::Config)?;
    // Timers: the read timeouts and the back-off after an accept error.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_name("daxkv-http")
        // Mutations take at most `max_concurrent_mutations` blocking
        // threads; the rest serve status, health and metrics.
        .max_blocking_threads(cfg.max_concurrent_mutations + 16)
        .build()
        .map_err(HttpError::Runtime)?;
    let listener = {
        let _in_rt = rt.enter();
        tokio::net::TcpListener::from_std(listener).map_err(HttpError::Runtime)?
    };

    let app = Arc::new(App {
        registry,
        token: cfg.token.map(String::into_bytes),
        allow_all: cfg.allow_prefixes.is_empty(),
        allow,
        allow_memfd,
        body_limit: cfg.body_limit,
        body_read_timeout: cfg.body_read_timeout,
        hosts,
        hooks,
        mutations: Arc::new(Semaphore::new(cfg.max_concurrent_mutations)),
    });
    let router = router(app);
    let limits = conn::Limits {
        max_connections: cfg.max_connections,
        header_read_timeout: cfg.header_read_timeout,
    };
    let (grace_tx, grace_rx) = oneshot::channel::<()>();
    let (force_tx, mut force_rx) = oneshot::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("daxkv-http".into())
        .spawn(move || {
            let _done = done_tx;
            rt.block_on(async move {
                let server = conn::run(listener, router, limits, async move {
                    let _ = grace_rx.await;
                });
                let mut server = pin!(server);
                // Whichever ends first: the graceful shutdown, or the force
                // signal (sent, or dropped with the handle).
                poll_fn(|cx| {
                    if server.as_mut().poll(cx).is_ready()
                        || std::pin::Pin::new(&mut force_rx).poll(cx).is_ready()
                    {
                        Poll::Ready(())
                    } else {
                        Poll::Pending
                    }
                })
                .await;
            });
            // Connections still open are dropped. The idle blocking
            // threads are joined (they exit at once); an operation still
            // running finishes on its own thread after this bounded wait.
            // (`shutdown_background` left even the idle ones running past
            // the server's end: LeakSanitizer found their thread state
            // behind each stopped server, `fuzz/tests/http_control.rs`.)
            rt.shutdown_timeout(BLOCKING_JOIN_WAIT);
        })
        .map_err(HttpError::Runtime)?;
    Ok(HttpServer {
        addr,
        grace: Some(grace_tx),
        force: Some(force_tx),
        done: done_rx,
        thread: Some(thread),
        grace_period: cfg.shutdown_grace,
        listener_fd,
    })
}

struct App {
    registry: Registry,
    token: Option<Vec<u8>>,
    /// No allow-list: every path and anonymous device may be added.
    allow_all: bool,
    /// Canonical path prefixes `add` may name.
    allow: Vec<PathBuf>,
    /// `memfd` was on the allow-list: anonymous devices may be added.
    allow_memfd: bool,
    body_limit: usize,
    body_read_timeout: Duration,
    hosts: guard::Hosts,
    hooks: HttpHooks,
    mutations: Arc<Semaphore>,
}

type AppState = State<Arc<App>>;

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route(
            "/reconfigure/dax/{operation}",
            get(seed_get).post(seed_post),
        )
        .route(
            "/reconfigure/{backend}/l2/{operation}",
            get(l2_get).post(l2_post),
        )
        .fallback(|| async { error(StatusCode::NOT_FOUND, "not found") })
        .method_not_allowed_fallback(|| async {
            error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        })
        .layer(from_fn_with_state(Arc::clone(&app), auth))
        // Outermost: a browser's cross-site request is refused before the
        // token is looked at.
        .layer(from_fn_with_state(Arc::clone(&app), browser_guard))
        .with_state(app)
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn error(status: StatusCode, msg: &str) -> Response {
    json_response(status, &json!({ "error": msg }))
}

/// Run `f` on the blocking pool; a panic there is a 500.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Response> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "internal error"))
}

async fn browser_guard(State(app): AppState, req: Request, next: Next) -> Response {
    match guard::check_request(&app.hosts, req.version(), req.uri(), req.headers()) {
        Ok(()) => next.run(req).await,
        Err((status, msg)) => error(status, msg),
    }
}

async fn auth(State(app): AppState, req: Request, next: Next) -> Response {
    if let Some(token) = &app.token {
        if req.uri().path() != "/health" && !authorized(req.headers(), token) {
            let mut r = error(StatusCode::UNAUTHORIZED, "unauthorized");
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            return r;
        }
    }
    next.run(req).await
}

fn authorized(headers: &HeaderMap, token: &[u8]) -> bool {
    let Some(v) = headers.get(header::AUTHORIZATION) else {
        return false;
    };
    let v = v.as_bytes();
    let Some(sp) = v.iter().position(|&b| b == b' ') else {
        return false;
    };
    let (scheme, given) = (&v[..sp], v[sp..].trim_ascii());
    scheme.eq_ignore_ascii_case(b"bearer") & ct_eq(token, given)
}

/// `expected == given` in time that depends on `expected`'s length only.
fn ct_eq(expected: &[u8], given: &[u8]) -> bool {
    let mut diff = expected.len() ^ given.len();
    for (i, &e) in expected.iter().enumerate() {
        diff |= usize::from(e ^ given.get(i).copied().unwrap_or(!e));
    }
    std::hint::black_box(diff) == 0
}

/// `p` canonicalized: symlinks and `..` resolved through its longest
/// existing ancestor, the rest normalized lexically. `None` when no
/// ancestor exists (a relative path under a missing directory).
fn canonical(p: &FsPath) -> Option<PathBuf> {
    if p.as_os_str().is_empty() {
        return None;
    }
    for anc in p.ancestors() {
        if anc.as_os_str().is_empty() {
            break;
        }
        let Ok(mut out) = std::fs::canonicalize(anc) else {
            continue;
        };
        let rest = p.strip_prefix(anc).ok()?;
        for c in rest.components() {
            match c {
                Component::Normal(n) => out.push(n),
                Component::ParentDir => {
                    out.pop();
                }
                Component::CurDir => {}
                Component::RootDir | Component::Prefix(_) => return None,
            }
        }
        return Some(out);
    }
    None
}

fn path_allowed(allow: &[PathBuf], path: &str) -> bool {
    allow.is_empty()
        || canonical(FsPath::new(path)).is_some_and(|c| allow.iter().any(|a| c.starts_with(a)))
}

/// `{backend}` / `{operation}` as upstream reads them: stripped,
/// lower-cased.
fn normalize(s: &str) -> String {
    s.trim().to_lowercase()
}

fn params<T>(p: Result<Path<T>, PathRejection>) -> Result<T, Response> {
    p.map(|Path(t)| t)
        .map_err(|_| error(StatusCode::BAD_REQUEST, "invalid path"))
}

async fn health(State(app): AppState) -> Response {
    let verdict = match app.hooks.health.clone() {
        None => Ok(None),
        Some(h) => match blocking(move || h()).await {
            Ok(v) => v,
            Err(r) => return r,
        },
    };
    match verdict {
        Ok(None) => json_response(StatusCode::OK, &json!({"status": "ok"})),
        Ok(Some(reason)) => json_response(
            StatusCode::OK,
            &json!({"status": "degraded", "reason": reason}),
        ),
        Err(reason) => json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "unhealthy", "reason": reason}),
        ),
    }
}

async fn metrics(State(app): AppState) -> Response {
    let Some(m) = app.hooks.metrics.clone() else {
        return error(StatusCode::NOT_FOUND, "not found");
    };
    match blocking(move || m()).await {
        Ok(text) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(r) => r,
    }
}

async fn seed_get(State(app): AppState, op: Result<Path<String>, PathRejection>) -> Response {
    match params(op) {
        Ok(op) => get_op(app, "dax".into(), op).await,
        Err(r) => r,
    }
}

async fn seed_post(
    State(app): AppState,
    op: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match params(op) {
        Ok(op) => post_op(app, "dax", &op, &headers, body).await,
        Err(r) => r,
    }
}

async fn l2_get(
    State(app): AppState,
    p: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    match params(p) {
        Ok((backend, op)) => get_op(app, backend, op).await,
        Err(r) => r,
    }
}

async fn l2_post(
    State(app): AppState,
    p: Result<Path<(String, String)>, PathRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match params(p) {
        Ok((backend, op)) => post_op(app, &backend, &op, &headers, body).await,
        Err(r) => r,
    }
}

async fn get_op(app: Arc<App>, backend: String, op: String) -> Response {
    let backend = normalize(&backend);
    if backend.is_empty() {
        return error(StatusCode::BAD_REQUEST, "backend must be non-empty");
    }
    if normalize(&op) != "status" {
        return error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed");
    }
    match blocking(move || envelope(&app.registry, &backend)).await {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(r) => r,
    }
}

/// The status envelope (docs/lmcache-dax-behavior.md §5.3): `backend`'s
/// adapters only, `adapter_index` backend-local, `l2_adapter_index`
/// generic.
fn envelope(registry: &Registry, backend: &str) -> Value {
    let adapters: Vec<Value> = registry
        .named(backend)
        .into_iter()
        .enumerate()
        .map(|(local, (generic, b))| {
            let mut s = match b.reconfigure_status() {
                Value::Object(o) => o,
                other => [("status".to_string(), other)].into_iter().collect(),
            };
            s.insert("backend".into(), b.backend().into());
            s.insert("adapter_index".into(), local.into());
            s.insert("l2_adapter_index".into(), generic.into());
            Value::Object(s)
        })
        .collect();
    json!({
        "enabled": !adapters.is_empty(),
        "backend": backend,
        "num_adapters": adapters.len(),
        "adapters": adapters,
    })
}

async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    timeout: Duration,
) -> Result<axum::body::Bytes, Response> {
    // A declared length over the limit answers before the body is read (a
    // client that sent `Expect: 100-continue` never sends it).
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request body too large",
        ));
    }
    let Ok(read) = tokio::time::timeout(timeout, to_bytes(body, limit)).await else {
        return Err(error(
            StatusCode::REQUEST_TIMEOUT,
            "request body not received in time",
        ));
    };
    read.map_err(|e| {
        if e.into_inner().is::<http_body_util::LengthLimitError>() {
            error(StatusCode::PAYLOAD_TOO_LARGE, "request body too large")
        } else {
            error(StatusCode::BAD_REQUEST, "could not read the request body")
        }
    })
}

fn unprocessable(detail: &[Value]) -> Response {
    json_response(
        StatusCode::UNPROCESSABLE_ENTITY,
        &json!({ "detail": detail }),
    )
}

/// Whether the allow-list lets `add` name `p` (a path, or an anonymous
/// device); the refusal otherwise.
async fn add_allowed(app: &Arc<App>, p: String) -> Result<(), Response> {
    // The engine opens the trimmed path: check the same one.
    let p = p.trim().to_string();
    if crate::engine::is_memfd_name(&p) {
        // Not a path: allowed without an allow-list, or with `memfd` on it.
        if !app.allow_all && !app.allow_memfd {
            return Err(error(
                StatusCode::FORBIDDEN,
                "anonymous devices not allowed (add memfd to the allow-list)",
            ));
        }
    } else if !app.allow_all {
        let app2 = Arc::clone(app);
        // canonicalize touches the file system: off the event loop.
        // An allow-list of `memfd` alone allows no path.
        let allowed = move || !app2.allow.is_empty() && path_allowed(&app2.allow, &p);
        match blocking(allowed).await {
            Ok(true) => {}
            Ok(false) => return Err(error(StatusCode::FORBIDDEN, "device path not allowed")),
            Err(r) => return Err(r),
        }
    }
    Ok(())
}

async fn post_op(
    app: Arc<App>,
    backend: &str,
    op: &str,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    // Every POST mutates: a browser must not be able to send one without
    // a CORS preflight (module guard).
    if !guard::json_content_type(headers) {
        return error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            guard::CONTENT_TYPE_REFUSED,
        );
    }
    let (backend, op) = (normalize(backend), normalize(op));
    if backend.is_empty() {
        return error(StatusCode::BAD_REQUEST, "backend must be non-empty");
    }
    if op.is_empty() {
        return error(StatusCode::BAD_REQUEST, "operation must be non-empty");
    }
    let bytes = match read_body(headers, body, app.body_limit, app.body_read_timeout).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let value: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => return unprocessable(&[schema::json_error(&bytes, &e)]),
    };
    let big = schema::BigInts::scan(&bytes);
    let accepted = if backend == "dax" {
        schema::dax(&op, &value, &big)
    } else {
        schema::generic(&value, &big)
    };
    let Accepted {
        local_index,
        payload,
        add_path,
    } = match accepted {
        Ok(a) => a,
        Err(Refusal::Unsupported) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("unsupported dax reconfigure operation: {op}"),
            )
        }
        Err(Refusal::Invalid(detail)) => return unprocessable(&detail),
        Err(Refusal::BadSize) => {
            return error(
                StatusCode::BAD_REQUEST,
                "size must be a positive integer byte count or a string like '100GiB'",
            )
        }
    };
    if let Some(p) = add_path {
        if let Err(r) = add_allowed(&app, p).await {
            return r;
        }
    }
    let Some((generic, b)) = local_index
        .and_then(|i| app.registry.get(&backend, i))
        .map(|(g, b)| (g, Arc::clone(b)))
    else {
        return error(
            StatusCode::NOT_FOUND,
            &format!("{backend} adapter not found"),
        );
    };
    let Ok(permit) = Arc::clone(&app.mutations).acquire_owned().await else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "shutting down");
    };
    let owners = app.hooks.owners.clone();
    let result = blocking(move || {
        let _permit = permit;
        let for_backend = owners.as_ref().map(|o| move |path: &str| o(generic, path));
        let owners_ref = for_backend
            .as_ref()
            .map(|f| f as &(dyn Fn(&str) -> Vec<String> + Sync));
        b.reconfigure(&op, &payload, owners_ref)
    })
    .await;
    match result {
        Ok(Ok(mut v)) => {
            // Upstream's quirk, kept: the generic index (module docs).
            if let Some(o) = v.as_object_mut() {
                o.insert("adapter_index".into(), generic.into());
            }
            json_response(StatusCode::OK, &v)
        }
        Ok(Err(ReconfigureError { status, body })) => json_response(
            StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            &body,
        ),
        Err(r) => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_compare() {
        assert!(ct_eq(b"secret", b"secret"));
        assert!(!ct_eq(b"secret", b"secreT"));
        assert!(!ct_eq(b"secret", b"secret1"));
        assert!(!ct_eq(b"secret", b"secre"));
        assert!(!ct_eq(b"secret", b""));
        // A prefix padded with what `!e` would give still differs by length.
        assert!(!ct_eq(b"ab", b"a"));
    }

    #[test]
    fn bearer_header() {
        let mut h = HeaderMap::new();
        assert!(!authorized(&h, b"t0k"));
        h.insert(header::AUTHORIZATION, "Bearer t0k".parse().unwrap());
        assert!(authorized(&h, b"t0k"));
        h.insert(header::AUTHORIZATION, "bearer  t0k ".parse().unwrap());
        assert!(authorized(&h, b"t0k"));
        h.insert(header::AUTHORIZATION, "Basic t0k".parse().unwrap());
        assert!(!authorized(&h, b"t0k"));
        h.insert(header::AUTHORIZATION, "Bearer t0kk".parse().unwrap());
        assert!(!authorized(&h, b"t0k"));
    }

    #[test]
    fn canonical_paths() {
        let d = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(d.path()).unwrap();
        std::fs::create_dir(root.join("devs")).unwrap();
        std::fs::write(root.join("devs/a"), b"").unwrap();
        std::os::unix::fs::symlink("/etc", root.join("devs/etc")).unwrap();
        let allow = vec![canonical(&root.join("devs")).unwrap()];
        let ok = |p: PathBuf| path_allowed(&allow, p.to_str().unwrap());
        assert!(ok(root.join("devs/a")));
        assert!(ok(root.join("devs/missing")));
        assert!(ok(root.join("devs/./x/../b")));
        assert!(!ok(root.join("devs/../outside")));
        assert!(!ok(root.join("devs/etc/passwd")));
        assert!(!ok(root.join("devsX")));
        assert!(!ok(PathBuf::from("/etc/passwd")));
        assert!(!path_allowed(&allow, ""));
        assert!(!path_allowed(&allow, "relative/missing/dir"));
        assert!(path_allowed(&[], "anything"));
    }
}
