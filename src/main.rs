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
    /// Store, look up, load, unlock and delete chunks on a memfd (or the
    /// given device) and print objects/s and GB/s next to the raw copy
    /// bandwidth of the same mapping.
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
        /// A device-dax node or tmpfs file to use instead of a memfd.
        #[arg(long)]
        path: Option<PathBuf>,
        /// Do not pre-fault the mapping.
        #[arg(long)]
        no_prefault: bool,
        /// Write the results as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Bench {
            sizes,
            total_bytes,
            max_objects,
            path,
            no_prefault,
            json,
        } => {
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
                path,
                prefault: !no_prefault,
                ..Default::default()
            };
            eprintln!(
                "running: sizes {:?}, up to {} objects / {} bytes per size",
                cfg.sizes, cfg.max_objects, cfg.total_bytes
            );
            let report = daxkv::bench::run(&cfg, |line| eprintln!("done: {line}"))?;
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
