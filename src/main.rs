//! `daxkv`: the command-line face.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use daxkv::cli::client::Expect;

#[derive(Parser)]
#[command(
    name = "daxkv",
    version,
    about = "KV-cache store for LLM inference caches in CXL / DAX memory"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum SignalArg {
    /// Signal every completion (LMCache's default: it polls the fds).
    Always,
    /// Signal only a parked `wait_*` caller (what the bench waits with).
    WhenWaiting,
}

#[derive(Subcommand)]
enum Cmd {
    /// Store, look up, load, unlock and delete chunks through the engine on
    /// memfds (or the given devices) and print objects/s, GB/s and task
    /// latency next to the raw copy bandwidth of the same mapping, measured
    /// in alternating rounds, and a raw eventfd ping-pong.
    ///
    /// Units: sizes are binary (4K = 4KiB = 4096 bytes, 2M = 2MiB);
    /// throughput is decimal GB/s (10^9 bytes/s).
    Bench {
        /// Object sizes, comma separated (e.g. 4K,64K,256K,2M,8M).
        #[arg(long, default_value = "4K,64K,256K,2M,8M")]
        sizes: String,
        /// Bytes of objects per size (each size stores total / size
        /// objects, at most --max-objects).
        #[arg(long, default_value = "1GiB")]
        total_bytes: String,
        /// Most objects per size.
        #[arg(long, default_value_t = 20_000)]
        max_objects: usize,
        /// A device-dax node or (tmpfs) file to use instead of memfds
        /// (repeat for several devices). The bench overwrites what it holds.
        #[arg(long)]
        path: Vec<PathBuf>,
        /// Create a missing --path as a file sized for the run (removed at
        /// the end; an existing file is kept, and grown if too small).
        #[arg(long)]
        create: bool,
        /// Allow a character device (device-dax) as --path: its contents
        /// are destroyed.
        #[arg(long)]
        force: bool,
        /// Number of memfd devices (without --path) [default: 1]
        #[arg(long)]
        devices: Option<usize>,
        /// Store workers [default: the engine's, 1]
        #[arg(long)]
        store_workers: Option<usize>,
        /// Lookup workers [default: the engine's, 1]
        #[arg(long)]
        lookup_workers: Option<usize>,
        /// Load workers [default: the engine's, min(4, CPUs)]
        #[arg(long)]
        load_workers: Option<usize>,
        /// Spin this long before parking (workers and the waiting caller)
        /// [default: the engine's, 250]
        #[arg(long)]
        spin_us: Option<u64>,
        /// How long the waiting caller spins before parking (default: the
        /// same as --spin-us). On a machine with fewer CPUs than workers
        /// plus the caller, a short caller spin leaves the CPUs to them.
        #[arg(long)]
        wait_spin_us: Option<u64>,
        /// Park at once (eventfd wakes only); overrides --spin-us and
        /// --wait-spin-us.
        #[arg(long)]
        park: bool,
        /// When workers signal completions.
        #[arg(long, value_enum, default_value_t = SignalArg::WhenWaiting)]
        signal: SignalArg,
        /// Tasks in flight per phase (per submitter).
        #[arg(long, default_value_t = 8)]
        inflight: usize,
        /// Submitting threads, each with its own Submitter, splitting each
        /// phase's tasks and collecting their own results by id.
        #[arg(long, default_value_t = 1)]
        submitters: usize,
        /// Milliseconds the engine sits open with nothing submitted while
        /// the process's CPU time is measured (0 skips it).
        #[arg(long, default_value_t = 1000)]
        idle_ms: u64,
        /// Rounds per size, each measuring the raw limit before and after
        /// the phase it bounds; ratios are the median of the rounds.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Do not pin threads (by default, with more CPUs than the largest
        /// worker pool, the caller runs on one CPU and the workers and the
        /// raw copies on the others).
        #[arg(long)]
        no_pin: bool,
        /// Do not pre-fault the mapping.
        #[arg(long)]
        no_prefault: bool,
        /// Write the results as JSON to this file (created before the run).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Mixed traffic under hotplug for a bounded time, every key checked:
    /// threads store (payloads stamped with key and number), look up and
    /// lock, load (every byte checked), unlock and delete while a control
    /// thread adds, drains, migrates, evicts, resizes and force-removes
    /// devices over the real HTTP control plane. Ends with
    /// `soak: seed=… ops=… … lost=0 corrupted=0 leaked=0`; exits 1 on any
    /// lost or corrupted key, leaked slot / lock / task / thread / fd /
    /// mapping, stuck task or 5xx answer.
    Soak {
        /// Stop after this many seconds.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Stop after this many operations (tasks and deletes), if sooner.
        #[arg(long)]
        max_ops: Option<u64>,
        /// Seed of every random choice [default: from the clock; printed].
        #[arg(long)]
        seed: Option<u64>,
        /// Traffic threads.
        #[arg(long, default_value_t = 3)]
        threads: usize,
        /// Bytes per slot (payloads are 64 bytes to one slot).
        #[arg(long, default_value = "64K")]
        slot_bytes: String,
        /// Devices at the start (named memfds).
        #[arg(long, default_value_t = 2)]
        devices: usize,
        /// Bytes of each starting device (added ones are 0.5-1.5 times it).
        #[arg(long, default_value = "32M")]
        device_bytes: String,
        /// No hotplug: traffic alone.
        #[arg(long)]
        no_hotplug: bool,
        /// Milliseconds between hotplug operations (at random up to twice).
        #[arg(long, default_value_t = 100)]
        hotplug_every_ms: u64,
        /// Inject faults (needs a build with `--features failpoints`).
        #[arg(long)]
        faults: bool,
        /// Write the report as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Say what a device path is (devdax, system_ram, unbound,
    /// regular_file, tmpfs, not_a_device, unknown, absent), its size,
    /// alignment and NUMA node, from `stat` and sysfs alone: the path is
    /// never opened (opening an unbound DAX node can run modprobe).
    ///
    /// Exits 0 whenever the probe ran, an absent path included.
    Probe {
        /// The device node or file (e.g. /dev/dax0.0, /dev/shm/kv).
        path: PathBuf,
        /// Print the JSON `physical` block instead of a table.
        #[arg(long)]
        json: bool,
        /// Read sysfs under this root (tests use a fake tree).
        #[arg(long, hide = true, default_value = daxkv::host::probe::DEFAULT_SYSFS_ROOT)]
        sysfs_root: PathBuf,
    },
    /// Run the engine with its HTTP control plane until SIGINT / SIGTERM.
    ///
    /// Without --config: one memfd device of 1 GiB in 2 MiB slots, hotplug
    /// on. Prints `daxkv: serving on http://ADDR` on stdout once ready.
    Serve {
        /// LMCache's adapter JSON, or the same keys in a .toml file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Control-plane address (loopback; port 0 picks a free one).
        #[arg(long, default_value = daxkv::cli::serve::DEFAULT_HTTP)]
        http: std::net::SocketAddr,
        /// Require `Authorization: Bearer TOKEN` (every route but /health).
        #[arg(long, env = "DAXKV_TOKEN")]
        token: Option<String>,
        /// Allow `add` only under this path prefix (repeatable).
        #[arg(long)]
        allow_prefix: Vec<PathBuf>,
        /// Listen on a non-loopback address too (put a proxy in front).
        #[arg(long)]
        allow_non_loopback: bool,
        /// Accept requests naming this host (`Host` / `Origin`): NAME,
        /// NAME:PORT or an IP address (repeatable). 127.0.0.1, [::1] and
        /// localhost at the listening port are always accepted; others get
        /// 403 (a browser page's DNS rebinding). For non-loopback listeners.
        #[arg(long, value_name = "HOST")]
        allow_host: Vec<String>,
        /// Run the bench workload continuously against the engine (bytes
        /// verified; figures in /metrics), to watch hotplug under load.
        #[arg(long)]
        traffic: bool,
    },
    /// Show a running server's devices.
    Status {
        #[command(flatten)]
        server: ServerArgs,
    },
    /// Add a device to a running server: a path, or an anonymous one
    /// (`memfd` for the first; `memfd:NAME` for more, or `memfd:` to let
    /// the server name it). Adding a live device at its size again answers
    /// with it.
    Add {
        /// Device path, `memfd`, `memfd:NAME` or `memfd:`.
        path: String,
        /// Size: bytes, or a string like 64GiB.
        size: String,
        /// The largest size a later resize may grow it to (bytes or a
        /// string like 256GiB; default: 4 × SIZE for memfd, the file's or
        /// device's length for a path).
        #[arg(long)]
        max_size: Option<String>,
        /// Create PATH as a file of SIZE if it does not exist (on tmpfs,
        /// hugetlbfs or a disk file system; removed again if the add
        /// fails). Without it a missing PATH is an error.
        #[arg(long)]
        create: bool,
        #[command(flatten)]
        server: ServerArgs,
    },
    /// Remove (or drain) a device of a running server.
    Remove {
        /// Device path, `memfd` or `memfd:NAME` (or give --index).
        #[arg(required_unless_present = "index")]
        path: Option<String>,
        /// The device's index, as `daxkv status` lists it.
        #[arg(long)]
        index: Option<u64>,
        /// migrate (default: the keys move to the other devices; refused
        /// for the last device new keys may go to), evict (drops the keys)
        /// or drain (no new keys; the device stays).
        #[arg(long, default_value = "migrate")]
        mode: String,
        /// Discard locks and borrowed reads.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        server: ServerArgs,
    },
    /// Resize a device of a running server.
    Resize {
        /// [PATH] SIZE: the device path, `memfd` or `memfd:NAME` (left
        /// out with --index), and the new size: bytes, or a string like
        /// 64GiB.
        #[arg(num_args = 1..=2, required = true, value_names = ["PATH", "SIZE"])]
        args: Vec<String>,
        /// The device's index, as `daxkv status` lists it.
        #[arg(long)]
        index: Option<u64>,
        /// What a shrink does with keys past the new end: migrate
        /// (default) or evict (with --force).
        #[arg(long, default_value = "migrate")]
        mode: String,
        /// Allow evicting, and discard locks.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        server: ServerArgs,
    },
}

/// Where a running server is.
#[derive(clap::Args)]
struct ServerArgs {
    /// The server's control-plane address: host:port or http://host:port.
    #[arg(long, default_value = daxkv::cli::serve::DEFAULT_HTTP)]
    server: String,
    /// Give up after this many seconds without a whole answer (an
    /// operation may still finish on the server).
    #[arg(long, value_name = "SECONDS", default_value_t = daxkv::cli::client::DEFAULT_TIMEOUT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    timeout: u64,
    /// Bearer token, if the server wants one.
    #[arg(long, env = "DAXKV_TOKEN")]
    token: Option<String>,
    /// Print the server's JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Progress on stderr: a live one-line bar on a terminal; otherwise one
/// line per size as it starts (the table rows go to stdout only, once).
fn progress_printer(tty: bool) -> impl FnMut(daxkv::cli::bench::Progress<'_>) {
    use daxkv::cli::bench::{human, human_amount, Progress};
    let started = std::time::Instant::now();
    let bar = |done: usize, total: usize| -> String {
        let width = 30;
        let filled = done * width / total.max(1);
        (0..width)
            .map(|i| if i < filled { '#' } else { '.' })
            .collect()
    };
    move |p| match p {
        Progress::Preparing {
            index,
            sizes,
            size_bytes,
            objects,
            prefault_bytes,
        } => {
            let what = if prefault_bytes > 0 {
                format!("pre-faulting {}", human_amount(prefault_bytes))
            } else {
                "allocating".into()
            };
            let head = format!(
                "size {}/{sizes} ({} x {objects})",
                index + 1,
                human(size_bytes)
            );
            if tty {
                let line = format!("[{}] {head} preparing ({what})", bar(index, sizes));
                eprint!("\r{line:<100}");
            } else {
                eprintln!("daxkv bench: {head}: preparing ({what})");
            }
        }
        Progress::Phase {
            index,
            sizes,
            size_bytes,
            phase,
            objects,
            round,
            rounds,
        } if tty => {
            let step = ["store", "lookup", "load"]
                .iter()
                .position(|x| *x == phase)
                .unwrap_or(3);
            let per_size = rounds * 4;
            let line = format!(
                "[{}] size {}/{sizes} ({} x {objects}) round {}/{rounds} {phase} {:.1}s",
                bar(index * per_size + round * 4 + step, sizes * per_size),
                index + 1,
                human(size_bytes),
                round + 1,
                started.elapsed().as_secs_f64()
            );
            eprint!("\r{line:<100}");
        }
        Progress::Phase { .. } | Progress::Row(_) => {}
    }
}

/// Flags another flag overrides or makes moot: one warning line each.
fn bench_warnings(
    park: bool,
    spin_us: Option<u64>,
    wait_spin_us: Option<u64>,
    paths: &[PathBuf],
    devices: Option<usize>,
    create: bool,
    force: bool,
) -> Vec<String> {
    let mut w = Vec::new();
    if park {
        if let Some(v) = spin_us {
            w.push(format!(
                "--park overrides --spin-us {v}: workers and the waiting caller park at once"
            ));
        }
        if let Some(v) = wait_spin_us {
            w.push(format!(
                "--park overrides --wait-spin-us {v}: the waiting caller parks at once"
            ));
        }
    }
    if paths.is_empty() {
        if create {
            w.push("--create has no effect without --path".into());
        }
        if force {
            w.push("--force has no effect without --path".into());
        }
    } else if let Some(d) = devices {
        w.push(format!(
            "--devices {d} is ignored with --path (one device per --path, {} here)",
            paths.len()
        ));
    }
    w
}

/// A user error is one clear line on stderr and exit status 1, whatever
/// `RUST_BACKTRACE` says (returning `anyhow::Result` from `main` would print
/// the error's debug form, with a backtrace when that variable is set).
#[allow(clippy::too_many_lines)] // one arm per command
fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if matches!(
        cli.cmd,
        Cmd::Probe { .. }
            | Cmd::Status { .. }
            | Cmd::Add { .. }
            | Cmd::Remove { .. }
            | Cmd::Resize { .. }
    ) {
        daxkv::cli::client::quiet_on_closed_stdout();
    }
    let result = match cli.cmd {
        Cmd::Probe {
            path,
            json,
            sysfs_root,
        } => probe(&path, json, &sysfs_root),
        Cmd::Serve {
            config,
            http,
            token,
            allow_prefix,
            allow_non_loopback,
            allow_host,
            traffic,
        } => serve(&daxkv::cli::serve::ServeConfig {
            config,
            http: daxkv::control::http::HttpConfig {
                addr: http,
                token,
                allow_prefixes: allow_prefix,
                allow_non_loopback,
                allow_hosts: allow_host,
                ..daxkv::control::http::HttpConfig::default()
            },
            traffic,
        }),
        Cmd::Status { server } => client(
            &server,
            "GET",
            "/reconfigure/dax/l2/status",
            None,
            Expect::Status,
        ),
        Cmd::Add {
            path,
            size,
            max_size,
            create,
            server,
        } => {
            let mut body = serde_json::json!({"device_path": path, "size": size_arg(&size)});
            if let Some(m) = max_size {
                body["max_size"] = size_arg(&m);
            }
            if create {
                body["create"] = true.into();
            }
            client(
                &server,
                "POST",
                "/reconfigure/dax/l2/add",
                Some(&body),
                Expect::Operation(&["add"]),
            )
        }
        Cmd::Remove {
            path,
            index,
            mode,
            force,
            server,
        } => client(
            &server,
            "POST",
            "/reconfigure/dax/l2/remove",
            Some(&with_device(
                serde_json::json!({"mode": mode, "force": force}),
                path,
                index,
            )),
            Expect::Operation(&["remove", "drain"]),
        ),
        Cmd::Resize {
            mut args,
            index,
            mode,
            force,
            server,
        } => {
            if args.len() == 1 && index.is_none() {
                Err(anyhow::anyhow!("resize: give PATH SIZE, or --index N SIZE"))
            } else {
                let size = args.pop().unwrap_or_default();
                client(
                    &server,
                    "POST",
                    "/reconfigure/dax/l2/resize",
                    Some(&with_device(
                        serde_json::json!({"size": size_arg(&size), "mode": mode, "force": force}),
                        args.pop(),
                        index,
                    )),
                    Expect::Operation(&["resize"]),
                )
            }
        }
        cmd @ Cmd::Bench { .. } => run(cmd),
        cmd @ Cmd::Soak { .. } => soak(cmd),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("daxkv: {}", one_line(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// `e` and its causes on one line, each said once: many errors print
/// their cause in their own message and also return it as `source()`, so
/// `{:#}` would repeat it (`engine: device 0: X: X`). A cause already
/// contained in what is printed is left out.
fn one_line(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !c.is_empty() && !out.contains(&c) {
            out.push_str(": ");
            out.push_str(&c);
        }
    }
    out
}

/// `daxkv serve`: start, say where, wait for SIGINT / SIGTERM, stop. A
/// signal during start-up ends the process before the port opens
/// ([`daxkv::cli::serve::ShutdownSignals`]).
fn serve(cfg: &daxkv::cli::serve::ServeConfig) -> anyhow::Result<()> {
    // Before any thread starts: every thread inherits the blocked mask, so
    // the signal reaches the signal thread and nothing dies of it.
    let signals = daxkv::cli::serve::ShutdownSignals::start().context("taking SIGINT / SIGTERM")?;
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        // A log line that cannot be written (stderr a broken pipe) is
        // dropped: by default the subscriber says so with `eprintln!`,
        // which panics there, and the panic of the shutdown's log line
        // aborted the process (SIGABRT instead of exit 0).
        .log_internal_errors(false)
        .try_init();
    let prepared = daxkv::cli::serve::Server::prepare(cfg)?;
    if !cfg.http.addr.ip().is_loopback() {
        // Reachable from other hosts: `Host` / `Origin` keep browsers out,
        // not a client that sends `Host: 127.0.0.1` itself.
        if cfg.http.token.is_none() {
            tracing::warn!(addr = %cfg.http.addr, "listening beyond loopback without --token: any host that can reach the port can reconfigure the devices");
        }
        if cfg.http.allow_prefixes.is_empty() {
            tracing::warn!(addr = %cfg.http.addr, "listening beyond loopback without --allow-prefix: add may map any file this process can open");
        }
    }
    let server = signals.serving(|| prepared.listen())?;
    if let Some(addr) = server.addr() {
        println!("daxkv: serving on http://{addr}");
    }
    std::io::Write::flush(&mut std::io::stdout())?;
    let sig = signals.wait();
    tracing::info!(signal = sig, "shutting down");
    server.stop();
    Ok(())
}

/// `body` with the device it names: `device_path`, `device_index`, or both
/// (the server checks that they agree).
fn with_device(
    mut body: serde_json::Value,
    path: Option<String>,
    index: Option<u64>,
) -> serde_json::Value {
    if let Some(p) = path {
        body["device_path"] = p.into();
    }
    if let Some(i) = index {
        body["device_index"] = i.into();
    }
    body
}

/// A size argument: a plain integer is sent as a JSON integer, anything
/// else as the string (the server parses `64GiB`).
fn size_arg(s: &str) -> serde_json::Value {
    s.trim()
        .parse::<u64>()
        .map_or_else(|_| serde_json::json!(s), |n| serde_json::json!(n))
}

/// `daxkv status | add | remove | resize`: one request, bounded in time and
/// size; the answer as a table (or JSON); exit 1 with the server's message
/// on an error status, and when the answer is not a daxkv answer.
fn client(
    a: &ServerArgs,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
    expect: Expect,
) -> anyhow::Result<()> {
    let c = daxkv::cli::client::Client::new(
        &a.server,
        a.token.as_deref(),
        std::time::Duration::from_secs(a.timeout),
    )?;
    let (status, text) = c.request(method, path, body)?;
    let parsed: Option<serde_json::Value> = serde_json::from_str(&text).ok();
    if !(200..300).contains(&status) {
        // A daxkv error is a JSON object with one of these; anything else
        // is shown cut short.
        let msg = parsed
            .as_ref()
            .and_then(|v| {
                v.get("error")
                    .or_else(|| v.get("reason"))
                    .or_else(|| v.get("detail"))
            })
            .map_or_else(
                || {
                    let cut: String = text.chars().take(200).collect();
                    format!("not a daxkv answer: {cut:?}")
                },
                ToString::to_string,
            );
        bail!("{method} {path}: {status}: {msg}");
    }
    let v = parsed.unwrap_or_default();
    daxkv::cli::client::check_answer(expect, &v).map_err(|why| {
        daxkv::cli::client::ClientError::NotDaxkv {
            server: c.authority().to_string(),
            status,
            why,
        }
    })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else if expect == Expect::Status {
        print!("{}", daxkv::cli::serve::status_table(&v));
    } else {
        for (k, val) in v.as_object().into_iter().flatten() {
            if k != "device" {
                // The key is the server's: escaped like the table's text.
                println!("{:>20}: {val}", daxkv::cli::serve::printable(k));
            }
        }
        // An add's device: where it is and what it is called (a `memfd:`
        // add is named by the server).
        for k in ["index", "device_path"] {
            if let Some(val) = v.get("device").and_then(|d| d.get(k)) {
                println!("{k:>20}: {val}");
            }
        }
    }
    Ok(())
}

/// Write a line to stderr, ignoring a closed pipe (the soak's reader may
/// be gone: `daxkv soak | tee log` and a Ctrl-C that ended `tee` too).
fn say_err(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// `println!` that ignores a closed stdout (see [`say_err`]).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// A shell's exit status for a process stopped by SIGINT or SIGTERM.
fn signal_exit_code(name: &str) -> i32 {
    128 + if name == "SIGINT" {
        libc::SIGINT
    } else {
        libc::SIGTERM
    }
}

/// The name of the signal that stopped a soak early, once one came.
type SignalSeen = std::sync::Arc<std::sync::Mutex<Option<&'static str>>>;

/// SIGINT / SIGTERM stop the soak early and orderly (its devices' files in
/// /dev/shm are removed, every key is still checked): blocked here, before
/// any thread starts, and taken by a thread of their own that raises the
/// soak's stop flag; a second signal ends the process at once. The thread
/// lives as long as the process (the soak's leak check counts it before
/// and after).
fn soak_signals() -> anyhow::Result<(std::sync::Arc<std::sync::atomic::AtomicBool>, SignalSeen)> {
    daxkv::cli::serve::block_shutdown_signals().context("soak: blocking SIGINT/SIGTERM")?;
    let interrupt = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let signal = SignalSeen::default();
    let (flag, seen) = (interrupt.clone(), signal.clone());
    std::thread::Builder::new()
        .name("daxkv-signals".into())
        .spawn(move || loop {
            let Ok(name) = daxkv::cli::serve::wait_for_shutdown_signal() else {
                continue;
            };
            let mut seen = seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let code = signal_exit_code(name);
            if seen.is_some() {
                // A second one: the operator will not wait.
                say_err(&format!(
                    "soak: {name} again: exiting now (device files may be left in /dev/shm)"
                ));
                std::process::exit(code);
            }
            // The flag first, then the line: stderr may be a pipe whose
            // reader the same Ctrl-C ended (`| tee`), and a failed write
            // must not keep the soak from stopping.
            *seen = Some(name);
            // ORDERING: Relaxed — a stop flag the soak polls.
            flag.store(true, std::sync::atomic::Ordering::Relaxed);
            drop(seen);
            say_err(&format!(
                "soak: {name}: stopping early (checking every key, removing the devices; \
                 again to exit at once)"
            ));
        })
        .context("soak: starting the signal thread")?;
    Ok((interrupt, signal))
}

/// `daxkv soak`: run, print progress on stderr and the report on stdout.
fn soak(cmd: Cmd) -> anyhow::Result<()> {
    let Cmd::Soak {
        seconds,
        max_ops,
        seed,
        threads,
        slot_bytes,
        devices,
        device_bytes,
        no_hotplug,
        hotplug_every_ms,
        faults,
        json,
    } = cmd
    else {
        unreachable!("dispatched by main")
    };
    if faults && !cfg!(feature = "failpoints") {
        bail!("--faults: fault injection is compiled out of this build (rebuild with `cargo build --release --features failpoints`)");
    }
    let size = |flag: &str, s: &str| {
        daxkv::cli::bench::parse_size(s)
            .with_context(|| format!("{flag}: {s:?} is not a size like 64K or 32MiB"))
    };
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let (interrupt, signal) = soak_signals()?;
    let cfg = daxkv::cli::soak::SoakConfig {
        interrupt: Some(interrupt),
        duration: std::time::Duration::from_secs(seconds),
        max_ops: max_ops.unwrap_or(u64::MAX),
        seed,
        threads,
        slot_bytes: size("--slot-bytes", &slot_bytes)?,
        devices,
        device_bytes: size("--device-bytes", &device_bytes)?,
        hotplug: !no_hotplug,
        hotplug_every_ms,
        faults,
        ..daxkv::cli::soak::SoakConfig::default()
    };
    say_err(&format!(
        "soak: seed={seed} seconds={seconds} threads={threads} hotplug={}",
        !no_hotplug
    ));
    let report = daxkv::cli::soak::run(&cfg, &mut |line| say_err(line))
        .map_err(|e| anyhow::anyhow!("soak: {e}"))?;
    for f in &report.findings {
        say!("soak: finding: {f}");
    }
    for e in &report.control_errors {
        say!("soak: control error: {e}");
    }
    for l in &report.leaked {
        say!("soak: leaked: {l}");
    }
    if let Some((first, last, ratio)) = report.held((report.ops_per_second.len() / 2).min(300)) {
        say!("soak: ops/s held: first {first}/s, last {last}/s ({ratio:.2}x)");
    }
    say!(
        "soak: acknowledged={} reported_gone={} reported_twice={} reported_but_held={} transient_misses={} hotplug_refused={} stuck={} control_errors={}",
        report.keys_acknowledged,
        report.reported_gone,
        report.reported_twice,
        report.reported_but_held,
        report.transient_misses,
        report.hotplug_refused,
        report.stuck,
        report.control_errors.len()
    );
    let signal = *signal
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(name) = signal {
        say!(
            "soak: stopped early by {name} after {} s of {seconds}",
            report.ops_per_second.len()
        );
    }
    say!("{}", report.summary());
    if let Some(p) = json {
        std::fs::write(&p, report.json())
            .with_context(|| format!("--json {}: writing", p.display()))?;
    }
    if !report.clean() {
        bail!("soak failed: {}", report.summary());
    }
    if let Some(name) = signal {
        // Clean as far as it ran; a shell reports it as stopped by the
        // signal (128 + its number).
        std::process::exit(signal_exit_code(name));
    }
    Ok(())
}

/// `daxkv probe`: the report on stdout; exit 0 whatever the path is.
fn probe(path: &std::path::Path, json: bool, sysfs_root: &std::path::Path) -> anyhow::Result<()> {
    let p = daxkv::host::probe::probe(path, sysfs_root);
    if json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print!("{}", p.table());
    }
    Ok(())
}

#[allow(clippy::too_many_lines)] // the bench's options, one after another
fn run(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Bench {
            sizes,
            total_bytes,
            max_objects,
            path,
            create,
            force,
            devices,
            store_workers,
            lookup_workers,
            load_workers,
            spin_us,
            wait_spin_us,
            park,
            signal,
            inflight,
            submitters,
            idle_ms,
            rounds,
            no_prefault,
            no_pin,
            json,
        } => {
            for w in bench_warnings(park, spin_us, wait_spin_us, &path, devices, create, force) {
                eprintln!("daxkv: warning: {w}");
            }
            let sizes = sizes
                .split(',')
                .map(|s| {
                    daxkv::cli::bench::parse_size(s)
                        .with_context(|| format!("--sizes: {s:?} is not a size like 4K or 2MiB"))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let Some(total_bytes) = daxkv::cli::bench::parse_size(&total_bytes) else {
                bail!("--total-bytes: {total_bytes:?} is not a size like 1GiB");
            };
            let d = daxkv::cli::bench::BenchConfig::default();
            let cfg = daxkv::cli::bench::BenchConfig {
                sizes,
                total_bytes,
                max_objects,
                paths: path,
                create,
                force,
                devices: devices.unwrap_or(d.devices),
                store_workers: store_workers.unwrap_or(d.store_workers),
                lookup_workers: lookup_workers.unwrap_or(d.lookup_workers),
                load_workers: load_workers.unwrap_or(d.load_workers),
                spin: spin_us.map_or(d.spin, std::time::Duration::from_micros),
                wait_spin: wait_spin_us.map(std::time::Duration::from_micros),
                park,
                signal: match signal {
                    SignalArg::Always => daxkv::engine::Signal::Always,
                    SignalArg::WhenWaiting => daxkv::engine::Signal::WhenWaiting,
                },
                inflight_tasks: inflight,
                submitters,
                idle: std::time::Duration::from_millis(idle_ms),
                rounds,
                prefault: !no_prefault,
                pin: !no_pin,
                json: json.clone(),
                ..d
            };
            // Everything that can be checked is checked before the run: the
            // options, the paths, the memory, and the JSON file (created now,
            // so a typo in its directory does not cost a whole run).
            daxkv::cli::bench::preflight(&cfg)?;
            let json_file = json
                .as_ref()
                .map(|p| {
                    let existed = p.exists();
                    std::fs::File::create(p)
                        .map(|f| (p, f, existed))
                        .with_context(|| format!("--json {}: cannot create it", p.display()))
                })
                .transpose()?;
            let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
            let result = daxkv::cli::bench::run(&cfg, progress_printer(tty));
            if tty {
                eprint!("\r{:100}\r", "");
            }
            let report = match result {
                Ok(r) => r,
                Err(e) => {
                    // Do not leave an empty JSON file this run created.
                    if let Some((p, f, false)) = json_file {
                        drop(f);
                        let _ = std::fs::remove_file(p);
                    }
                    return Err(e.into());
                }
            };
            print!("{}", report.table());
            if let Some((p, mut f, _)) = json_file {
                std::io::Write::write_all(&mut f, report.json().as_bytes())
                    .with_context(|| format!("--json {}: writing", p.display()))?;
            }
            if report.results.iter().any(|r| r.verified == Some(false)) {
                bail!("data verification failed");
            }
        }
        _ => unreachable!("dispatched by main"),
    }
    Ok(())
}
