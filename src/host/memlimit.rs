//! # Memory limits: how much a memfd or a slot table may take
//!
//! A memfd device is RAM, and a device's slot tables are DRAM (about 50
//! bytes a slot): a size from a request or a config file must fit what the
//! process may actually use, or the kernel answers later with the OOM
//! killer (or, under an rlimit, the allocator with an abort). Before either
//! is allocated it is checked against the tightest of:
//!
//! - `MemAvailable` in `<proc>/meminfo`;
//! - for each cgroup of the process (`<proc>/self/cgroup`) and each of its
//!   ancestors, its limit minus its current usage: cgroup v2 `memory.max`
//!   and `memory.current` under `<sys>/fs/cgroup` (or its `unified`
//!   mount), cgroup v1 `memory.limit_in_bytes` and `memory.usage_in_bytes`
//!   under `<sys>/fs/cgroup/memory`.
//!
//! Files that are missing or unreadable impose no limit (a fake tree in a
//! test, a kernel without cgroups). The check is advisory — memory taken
//! after it is not reserved — so the allocations themselves stay fallible
//! too (`DaxCore::open`).

#![forbid(unsafe_code)]

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// The memfds this process has open (weakly: a closed one drops out), so
/// that a new memfd is checked against the memory the earlier ones may
/// still take when they are touched (their size less their resident
/// pages): otherwise each of many requests would pass on its own.
/// `pending` is the bytes of memfd opens and grows that passed the check
/// and are not yet counted there ([`MemfdReservation`]).
static MEMFDS: Mutex<Memfds> = Mutex::new(Memfds {
    files: Vec::new(),
    pending: 0,
});

struct Memfds {
    files: Vec<Weak<File>>,
    pending: u64,
}

/// The roots the limits are read under (fake trees in tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemRoots {
    /// Where procfs is mounted (`/proc`).
    pub proc_root: PathBuf,
    /// Where sysfs is mounted (`/sys`); cgroups are under `fs/cgroup`.
    pub sys_root: PathBuf,
}

impl Default for MemRoots {
    fn default() -> MemRoots {
        MemRoots {
            proc_root: PathBuf::from("/proc"),
            sys_root: PathBuf::from("/sys"),
        }
    }
}

/// The tightest limit found: bytes still usable, and where that came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Headroom {
    /// Bytes the process may still take.
    pub bytes: u64,
    /// Which limit (`MemAvailable`, `cgroup /a/b memory.max`, …).
    pub source: String,
}

/// cgroup limits at or above this are "no limit" (v1 writes
/// `PAGE_COUNTER_MAX` pages rounded, about 2^63).
const UNLIMITED: u64 = 1 << 62;

fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

fn mem_available(proc_root: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(proc_root.join("meminfo")).ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut it = line.split_whitespace().skip(1);
    let v: u64 = it.next()?.parse().ok()?;
    Some(match it.next() {
        Some("kB") => v.saturating_mul(1024),
        _ => v,
    })
}

/// `(limit file, usage file)` directories to look at: every level from the
/// process's cgroup up to the root of each hierarchy.
fn cgroup_levels(roots: &MemRoots) -> Vec<(PathBuf, &'static str, &'static str)> {
    let Ok(text) = std::fs::read_to_string(roots.proc_root.join("self/cgroup")) else {
        return Vec::new();
    };
    let base = roots.sys_root.join("fs/cgroup");
    let mut out = Vec::new();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let rel = path.trim_start_matches('/');
        if rel.split('/').any(|c| c == "..") {
            continue;
        }
        let mounts: Vec<(PathBuf, &str, &str)> = if id == "0" && ctrls.is_empty() {
            vec![
                (base.clone(), "memory.max", "memory.current"),
                (base.join("unified"), "memory.max", "memory.current"),
            ]
        } else if ctrls.split(',').any(|c| c == "memory") {
            vec![(
                base.join("memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )]
        } else {
            continue;
        };
        for (mount, max, cur) in mounts {
            let mut dir = mount.join(rel);
            loop {
                out.push((dir.clone(), max, cur));
                if dir == mount || !dir.pop() {
                    break;
                }
            }
        }
    }
    out
}

/// The tightest memory headroom under `roots`, or `None` if nothing limits
/// it (no readable file).
pub fn headroom(roots: &MemRoots) -> Option<Headroom> {
    let mut best: Option<Headroom> = mem_available(&roots.proc_root).map(|b| Headroom {
        bytes: b,
        source: "MemAvailable in /proc/meminfo".into(),
    });
    for (dir, max_file, cur_file) in cgroup_levels(roots) {
        // "max" (v2) does not parse: no limit at this level.
        let Some(max) = read_u64(&dir.join(max_file)) else {
            continue;
        };
        if max >= UNLIMITED {
            continue;
        }
        let used = read_u64(&dir.join(cur_file)).unwrap_or(0);
        let left = max.saturating_sub(used);
        if best.as_ref().is_none_or(|b| left < b.bytes) {
            let shown = dir.strip_prefix(&roots.sys_root).unwrap_or(&dir);
            best = Some(Headroom {
                bytes: left,
                source: format!(
                    "cgroup limit {max_file} = {max} bytes, {used} bytes in use, in /sys/{}",
                    shown.display()
                ),
            });
        }
    }
    best
}

/// An allocation that would not fit the memory the process may still
/// use: the device layer's `OpenError::MemoryLimit` carries these fields.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} of {bytes} bytes exceeds the memory this process may still use: {limit_bytes} bytes ({limit})")]
pub struct OverLimit {
    /// What was to be allocated ("memfd", "slot tables for N slots").
    pub what: String,
    /// Bytes asked for.
    pub bytes: usize,
    /// Bytes the process may still take.
    pub limit_bytes: u64,
    /// Which limit that is.
    pub limit: String,
}

/// Refuse `bytes` of `what` (a memfd, slot tables) if it exceeds the
/// memory the process may still use ([`headroom`]).
pub fn check(what: &str, bytes: usize, roots: &MemRoots) -> Result<(), OverLimit> {
    match headroom(roots) {
        Some(h) if bytes as u64 > h.bytes => Err(OverLimit {
            what: what.to_string(),
            bytes,
            limit_bytes: h.bytes,
            limit: h.source,
        }),
        _ => Ok(()),
    }
}

/// Count `f`, a memfd device's file, in what later memfds are checked
/// against ([`check_memfd`]) while it is open.
pub(crate) fn register_memfd(f: &Arc<File>) {
    let mut m = MEMFDS.lock().unwrap_or_else(PoisonError::into_inner);
    m.files.retain(|w| w.strong_count() > 0);
    m.files.push(Arc::downgrade(f));
}

/// Bytes the open memfds may still take: their sizes less what is
/// resident already (which `MemAvailable` and cgroup usage count).
fn memfds_untouched(m: &mut Memfds) -> u64 {
    m.files.retain(|w| w.strong_count() > 0);
    m.files
        .iter()
        .filter_map(Weak::upgrade)
        .filter_map(|f| f.metadata().ok())
        .map(|m| m.len().saturating_sub(m.blocks().saturating_mul(512)))
        .sum()
}

/// Memory a memfd open or grow passed [`check_memfd`] for: counted
/// against later checks until it drops, which its holder does once the
/// memfd has its new size and is registered (`register_memfd`), so
/// that two checks at once cannot both pass on the same headroom.
#[must_use = "the memory is counted as promised only while this lives"]
#[derive(Debug)]
pub struct MemfdReservation {
    bytes: u64,
}

impl Drop for MemfdReservation {
    fn drop(&mut self) {
        let mut m = MEMFDS.lock().unwrap_or_else(PoisonError::into_inner);
        m.pending = m.pending.saturating_sub(self.bytes);
    }
}

/// Refuse a memfd of `bytes` (or a grow by `bytes`) if it does not fit
/// the memory the process may still use, less what the memfds already
/// open may still take and what other opens and grows in flight were
/// promised. The check and the promise are one step under `MEMFDS`'s
/// lock: checked and promised separately, two opens at once each fitted
/// on their own and both opened
/// (`tests/device_limits.rs::memfds_opened_at_once_are_checked_together`).
pub fn check_memfd(bytes: usize, roots: &MemRoots) -> Result<MemfdReservation, OverLimit> {
    let Some(h) = headroom(roots) else {
        return Ok(MemfdReservation { bytes: 0 });
    };
    let mut m = MEMFDS.lock().unwrap_or_else(PoisonError::into_inner);
    let promised = memfds_untouched(&mut m).saturating_add(m.pending);
    let left = h.bytes.saturating_sub(promised);
    if bytes as u64 > left {
        return Err(OverLimit {
            what: "memfd".into(),
            bytes,
            limit_bytes: left,
            limit: if promised > 0 {
                format!(
                    "{}, less {promised} bytes the open memfd devices may still take",
                    h.source
                )
            } else {
                h.source
            },
        });
    }
    m.pending = m.pending.saturating_add(bytes as u64);
    Ok(MemfdReservation {
        bytes: bytes as u64,
    })
}

/// `n` values made by `f`, in a boxed slice, or `None` if the allocation
/// fails (instead of aborting the process, as `collect` would).
pub(crate) fn try_boxed<T>(n: usize, mut f: impl FnMut() -> T) -> Option<Box<[T]>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).ok()?;
    v.extend((0..n).map(|_| f()));
    Some(v.into_boxed_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> (tempfile::TempDir, MemRoots) {
        let d = tempfile::tempdir().unwrap();
        let roots = MemRoots {
            proc_root: d.path().join("proc"),
            sys_root: d.path().join("sys"),
        };
        std::fs::create_dir_all(roots.proc_root.join("self")).unwrap();
        (d, roots)
    }

    fn write(p: PathBuf, s: &str) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, s).unwrap();
    }

    #[test]
    fn an_impossible_table_is_none_not_an_abort() {
        assert!(try_boxed::<u64>(usize::MAX / 16, || 0).is_none());
        assert_eq!(try_boxed(3, || 7u8).as_deref(), Some(&[7u8, 7, 7][..]));
    }

    #[test]
    fn an_empty_tree_limits_nothing() {
        let (_d, roots) = tree();
        assert_eq!(headroom(&roots), None);
        check("memfd", usize::MAX, &roots).unwrap();
    }

    #[test]
    fn the_tightest_of_meminfo_and_cgroup_v2_ancestors_wins() {
        let (_d, roots) = tree();
        write(
            roots.proc_root.join("meminfo"),
            "MemTotal: 100 kB\nMemAvailable:    1048576 kB\n",
        );
        write(roots.proc_root.join("self/cgroup"), "0::/a/b\n");
        let cg = roots.sys_root.join("fs/cgroup");
        write(cg.join("a/b/memory.max"), "max\n");
        write(cg.join("a/memory.max"), "536870912\n");
        write(cg.join("a/memory.current"), "268435456\n");
        let h = headroom(&roots).unwrap();
        assert_eq!(h.bytes, 256 << 20);
        assert!(h.source.contains("memory.max"), "{}", h.source);
        let e = check("memfd", 1 << 30, &roots).unwrap_err().to_string();
        assert!(e.contains("1073741824") && e.contains("268435456"), "{e}");
        check("memfd", 1 << 20, &roots).unwrap();
    }

    #[test]
    fn cgroup_v1_memory_controller() {
        let (_d, roots) = tree();
        write(
            roots.proc_root.join("self/cgroup"),
            "4:memory:/job\n1:cpu:/job\n0::/\n",
        );
        let cg = roots.sys_root.join("fs/cgroup/memory");
        write(cg.join("job/memory.limit_in_bytes"), "1048576\n");
        write(cg.join("job/memory.usage_in_bytes"), "4096\n");
        write(cg.join("memory.limit_in_bytes"), "9223372036854771712\n");
        assert_eq!(headroom(&roots).unwrap().bytes, 1_048_576 - 4096);
    }
}
