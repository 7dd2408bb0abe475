//! `daxkv`: the command-line face.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};

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

#[derive(Subcommand)]
enum Cmd {
    /// Store, look up, load, unlock and delete chunks through the engine on
    /// memfds (or the given devices) and print objects/s, GB/s and task
    /// latency next to the raw copy bandwidth of the same mapping and a raw
    /// eventfd ping-pong.
    Bench {
        /// Object sizes, comma separated (e.g. 4K,64K,256K,2M,8M).
        #[arg(long, default_value = "4K,64K,256K,2M,8M")]
        sizes: String,
        /// Bytes of objects per size.
        #[arg(long, default_value = "1GiB")]
        total_bytes: String,
        /// Most objects per size.
        #[arg(long, default_value_t = 20_000)]
        max_objects: usize,
        /// A device-dax node or tmpfs file to use instead of memfds
        /// (repeat for several devices).
        #[arg(long)]
        path: Vec<PathBuf>,
        /// Number of memfd devices (without --path).
        #[arg(long, default_value_t = 1)]
        devices: usize,
        /// Store workers.
        #[arg(long, default_value_t = 1)]
        store_workers: usize,
        /// Lookup workers.
        #[arg(long, default_value_t = 1)]
        lookup_workers: usize,
        /// Load workers.
        #[arg(long, default_value_t = 1)]
        load_workers: usize,
        /// Spin this long before parking (workers and the waiting caller).
        #[arg(long, default_value_t = 250)]
        spin_us: u64,
        /// How long the waiting caller spins before parking (default: the
        /// same as --spin-us). On a machine with fewer CPUs than workers
        /// plus the caller, a short caller spin leaves the CPUs to them.
        #[arg(long)]
        wait_spin_us: Option<u64>,
        /// Park at once (eventfd wakes only); same as --spin-us 0.
        #[arg(long)]
        park: bool,
        /// Tasks in flight per phase.
        #[arg(long, default_value_t = 8)]
        inflight: usize,
        /// Do not pre-fault the mapping.
        #[arg(long)]
        no_prefault: bool,
        /// Write the results as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

/// A one-line progress bar on a terminal; plain lines otherwise.
fn progress_printer(tty: bool) -> impl FnMut(daxkv::bench::Progress<'_>) {
    let started = std::time::Instant::now();
    move |p| match p {
        daxkv::bench::Progress::Phase {
            index,
            sizes,
            size_bytes,
            phase,
            objects,
        } => {
            let step = ["store", "lookup", "load"]
                .iter()
                .position(|x| *x == phase)
                .unwrap_or(3);
            let width = 30;
            let filled = (index * 4 + step) * width / (sizes * 4).max(1);
            let bar: String = (0..width)
                .map(|i| if i < filled { '#' } else { '.' })
                .collect();
            let line = format!(
                "[{bar}] size {}/{sizes} ({size_bytes} B x {objects}) {phase} {:.1}s",
                index + 1,
                started.elapsed().as_secs_f64()
            );
            if tty {
                eprint!("\r{line:<90}");
            } else {
                eprintln!("{line}");
            }
        }
        daxkv::bench::Progress::Row(row) => {
            if !tty {
                eprintln!("done: {row}");
            }
        }
    }
}

/// A user error is one clear line on stderr and exit status 1, whatever
/// `RUST_BACKTRACE` says (returning `anyhow::Result` from `main` would print
/// the error's debug form, with a backtrace when that variable is set).
fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("daxkv: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Bench {
            sizes,
            total_bytes,
            max_objects,
            path,
            devices,
            store_workers,
            lookup_workers,
            load_workers,
            spin_us,
            wait_spin_us,
            park,
            inflight,
            no_prefault,
            json,
        } => {
            for (name, v) in [
                ("--devices", devices),
                ("--store-workers", store_workers),
                ("--lookup-workers", lookup_workers),
                ("--load-workers", load_workers),
                ("--inflight", inflight),
            ] {
                if v == 0 {
                    bail!("{name} must be > 0");
                }
            }
            let sizes = sizes
                .split(',')
                .map(|s| {
                    daxkv::bench::parse_size(s)
                        .with_context(|| format!("--sizes: {s:?} is not a size like 4K or 2MiB"))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let Some(total_bytes) = daxkv::bench::parse_size(&total_bytes) else {
                bail!("--total-bytes: {total_bytes:?} is not a size like 1GiB");
            };
            if max_objects == 0 {
                bail!("--max-objects must be > 0");
            }
            let cfg = daxkv::bench::BenchConfig {
                sizes,
                total_bytes,
                max_objects,
                paths: path,
                devices,
                store_workers,
                lookup_workers,
                load_workers,
                spin: std::time::Duration::from_micros(if park { 0 } else { spin_us }),
                wait_spin: if park {
                    Some(std::time::Duration::ZERO)
                } else {
                    wait_spin_us.map(std::time::Duration::from_micros)
                },
                inflight_tasks: inflight,
                prefault: !no_prefault,
                ..Default::default()
            };
            eprintln!(
                "running: sizes {:?}, up to {} objects / {} bytes per size",
                cfg.sizes, cfg.max_objects, cfg.total_bytes
            );
            let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
            let report = daxkv::bench::run(&cfg, progress_printer(tty))?;
            if tty {
                eprintln!();
            }
            print!("{}", report.table());
            if let Some(p) = json {
                std::fs::write(&p, report.json())
                    .with_context(|| format!("writing {}", p.display()))?;
            }
            if report.results.iter().any(|r| r.verified == Some(false)) {
                bail!("data verification failed");
            }
        }
    }
    Ok(())
}
