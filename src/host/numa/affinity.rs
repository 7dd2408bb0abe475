//! # Worker CPU masks: which CPUs a worker may run on
//!
//! Workers may run on any CPU of the **process's** allowed set, whatever
//! the mask of the thread that opens the engine: a server may have narrowed
//! that thread to one CPU (torch / OpenMP binding, `daxkv bench`'s pinned
//! caller), and threads inherit their creator's mask, so a worker that only
//! looked at its own mask would stay on the opener's CPU (every pool on one
//! CPU, the throughput of one worker). The process's set is its cgroup
//! cpuset, found through `/proc/self/cgroup` and `/proc/self/mountinfo`:
//! `cpuset.cpus.effective` (cgroup v2), `cpuset.effective_cpus` (v1), the
//! nearest ancestor that has the file; where neither can be read, the main
//! thread's `Cpus_allowed_list` in `/proc/self/status`. (A `taskset` on the
//! whole process narrows every thread's mask but not the cpuset: to confine
//! the workers, give `cpus` or run the process in a cpuset.)
//!
//! Each worker sets its own mask with `sched_setaffinity` and reads it back
//! (`status()["numa"]["workers"]`):
//!
//! | CPUs asked for (`cpus`, or a NUMA node's) | in the process's set | worker `w` gets | warning |
//! |---|---|---|---|
//! | none | — | the whole process set | — |
//! | some | all | `asked[w % n]` alone | — |
//! | some | some | `kept[w % k]` alone (the asked ones in the set, in order) | names the CPUs dropped and the set |
//! | some | none | the whole process set | names them and the set |
//! | any | the set unreadable | the asked CPU, else nothing set (the opener's mask) | says so |
//!
//! A CPU outside the set is a warning and a fallback, not an error: the
//! same config runs in containers of different sizes, and inside a cpuset
//! `sched_setaffinity` refuses a mask with no CPU of the set (`EINVAL`).
//! A CPU or node the *host* does not have is a config error instead
//! ([`super::Placement::check`]).
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use super::parse_cpulist;

/// The CPUs this process may run on, and where that was read.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ProcessCpus {
    /// The CPUs, ascending; empty when nothing could be read.
    pub cpus: Vec<usize>,
    /// Where they came from: the cpuset file's path, `/proc/self/status
    /// Cpus_allowed_list`, or `"unknown"`.
    pub source: String,
}

impl ProcessCpus {
    /// The running process's set (see the module doc).
    pub fn current() -> ProcessCpus {
        ProcessCpus::from_proc(Path::new("/proc/self"))
    }

    /// The set of the process whose `/proc/<pid>` is `proc_self` (tests
    /// point it at a fake tree: `cgroup`, `mountinfo`, `status`; the cpuset
    /// files are read where `mountinfo` says the hierarchies are mounted).
    pub fn from_proc(proc_self: &Path) -> ProcessCpus {
        let limit = libc::CPU_SETSIZE as usize;
        if let Some((mut cpus, file)) = cpuset_of(proc_self) {
            cpus.retain(|&c| c < limit);
            if !cpus.is_empty() {
                return ProcessCpus {
                    cpus,
                    source: file.display().to_string(),
                };
            }
        }
        let status = std::fs::read_to_string(proc_self.join("status")).unwrap_or_default();
        if let Some(mut cpus) = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .and_then(parse_cpulist)
        {
            cpus.retain(|&c| c < limit);
            if !cpus.is_empty() {
                return ProcessCpus {
                    cpus,
                    source: format!("{} Cpus_allowed_list", proc_self.join("status").display()),
                };
            }
        }
        ProcessCpus {
            cpus: Vec::new(),
            source: "unknown".into(),
        }
    }
}

/// One line of `mountinfo`: what the policy needs of it.
struct Mount {
    root: String,
    point: PathBuf,
    fstype: String,
    superopts: String,
}

/// `\040`-style escapes of `mountinfo` fields.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let v = u32::from(b[i + 1] - b'0') * 64
                + u32::from(b[i + 2] - b'0') * 8
                + u32::from(b[i + 3] - b'0');
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn mounts(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let pre: Vec<&str> = pre.split(' ').collect();
            let mut post = post.split(' ');
            Some(Mount {
                root: unescape(pre.get(3)?),
                point: PathBuf::from(unescape(pre.get(4)?)),
                fstype: post.next()?.to_string(),
                superopts: post.nth(1).unwrap_or("").to_string(),
            })
        })
        .collect()
}

/// The cgroup cpuset of the process at `proc_self`, and the file it was
/// read from. The v1 `cpuset` hierarchy first (on a hybrid host the
/// controller lives there and the v2 tree has no cpuset files), then v2.
fn cpuset_of(proc_self: &Path) -> Option<(Vec<usize>, PathBuf)> {
    let cgroup = std::fs::read_to_string(proc_self.join("cgroup")).ok()?;
    let mountinfo = std::fs::read_to_string(proc_self.join("mountinfo")).unwrap_or_default();
    let mounts = mounts(&mountinfo);
    let (mut v1, mut v2) = (None, None);
    for line in cgroup.lines() {
        let mut it = line.splitn(3, ':');
        let (Some(hid), Some(ctrls), Some(path)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        if ctrls.split(',').any(|c| c == "cpuset") {
            v1 = Some(path);
        } else if hid == "0" && ctrls.is_empty() {
            v2 = Some(path);
        }
    }
    if let Some(path) = v1 {
        let m = mounts
            .iter()
            .find(|m| m.fstype == "cgroup" && m.superopts.split(',').any(|o| o == "cpuset"));
        let (root, point) = m.map_or(("/", Path::new("/sys/fs/cgroup/cpuset")), |m| {
            (m.root.as_str(), m.point.as_path())
        });
        if let Some(r) = walk_up(point, root, path, &["cpuset.effective_cpus", "cpuset.cpus"]) {
            return Some(r);
        }
    }
    if let Some(path) = v2 {
        let m = mounts.iter().find(|m| m.fstype == "cgroup2");
        let (root, point) = m.map_or(("/", Path::new("/sys/fs/cgroup")), |m| {
            (m.root.as_str(), m.point.as_path())
        });
        return walk_up(point, root, path, &["cpuset.cpus.effective"]);
    }
    None
}

/// From the cgroup `path` (as `/proc/self/cgroup` names it) up to the
/// mount point, the first directory with one of `files` holding a
/// non-empty CPU list. A cgroup where the controller is not enabled has no
/// such file and runs on its parent's set.
fn walk_up(point: &Path, root: &str, path: &str, files: &[&str]) -> Option<(Vec<usize>, PathBuf)> {
    // The mount shows the hierarchy from `root` down (a container's
    // namespace); the process's path is relative to the hierarchy's top.
    let rel = path
        .strip_prefix(root.trim_end_matches('/'))
        .filter(|r| r.is_empty() || r.starts_with('/'))
        .unwrap_or(path)
        .trim_start_matches('/');
    let mut dir = point.join(rel);
    // Bounded by the path's depth; `..` or a symlink cannot lead the walk
    // anywhere but up to `point`.
    for _ in 0..=rel.split('/').count() {
        for f in files {
            let file = dir.join(f);
            if let Some(cpus) = std::fs::read_to_string(&file)
                .ok()
                .and_then(|s| parse_cpulist(&s))
                .filter(|c| !c.is_empty())
            {
                return Some((cpus, file));
            }
        }
        if dir == point || !dir.pop() {
            break;
        }
    }
    None
}

/// A CPU list in the kernel's form ("0-3,8"), ascending and deduplicated.
pub fn format_cpulist(cpus: &[usize]) -> String {
    let mut v = cpus.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut out = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", v[i], v[j])
        } else {
            v[i].to_string()
        });
        i = j + 1;
    }
    if out.is_empty() {
        "(none)".into()
    } else {
        out.join(",")
    }
}

/// The masks a pool's workers get (the module doc's table).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct CpuPlan {
    /// The CPUs asked for, as given (empty: no placement).
    pub asked: Vec<usize>,
    /// The process's set the plan was made against.
    pub process: ProcessCpus,
    /// The asked CPUs kept, in the asked order: worker `w` runs on
    /// `pinned[w % len]` alone. Empty: every worker gets `fallback`.
    pub pinned: Vec<usize>,
    /// The mask of every worker when `pinned` is empty: the process's set
    /// (`None` when it could not be read: the mask is left as inherited).
    pub fallback: Option<Vec<usize>>,
    /// What did not go as asked, in words (logged at open and reported in
    /// `status()["numa"]["warnings"]`).
    pub warnings: Vec<String>,
}

impl CpuPlan {
    /// The plan for workers asked to run on `asked` in a process allowed
    /// `process`.
    pub fn new(asked: &[usize], process: &ProcessCpus) -> CpuPlan {
        let mut plan = CpuPlan {
            asked: asked.to_vec(),
            process: process.clone(),
            ..CpuPlan::default()
        };
        if process.cpus.is_empty() {
            plan.pinned = asked.to_vec();
            plan.warnings.push(format!(
                "the process's allowed CPUs could not be read ({}): {}",
                process.source,
                if asked.is_empty() {
                    "workers keep the opening thread's CPUs".to_string()
                } else {
                    format!(
                        "workers are pinned to cpus {} as asked, unchecked",
                        format_cpulist(asked)
                    )
                }
            ));
            return plan;
        }
        let allowed = |c: &usize| process.cpus.binary_search(c).is_ok();
        plan.pinned = asked.iter().copied().filter(allowed).collect();
        let mut dropped: Vec<usize> = asked.iter().copied().filter(|c| !allowed(c)).collect();
        dropped.sort_unstable();
        dropped.dedup();
        if plan.pinned.is_empty() {
            plan.fallback = Some(process.cpus.clone());
        }
        if !dropped.is_empty() {
            let what = if plan.pinned.is_empty() {
                "workers may run on any of them instead (not pinned)".to_string()
            } else {
                format!(
                    "workers are pinned to the rest, cpus {}",
                    format_cpulist(&plan.pinned)
                )
            };
            plan.warnings.push(format!(
                "cpus {} asked for are outside the process's allowed CPUs {} ({}): {what}",
                format_cpulist(&dropped),
                format_cpulist(&process.cpus),
                process.source,
            ));
        }
        plan
    }

    /// Worker `w`'s mask; `None`: leave the inherited one.
    pub fn mask(&self, w: usize) -> Option<Vec<usize>> {
        if self.pinned.is_empty() {
            self.fallback.clone()
        } else {
            Some(vec![self.pinned[w % self.pinned.len()]])
        }
    }
}

/// The CPU a thread of this process last ran on: field 39 (`processor`)
/// of `/proc/self/task/<tid>/stat`; `None` once the thread is gone.
pub fn last_cpu(tid: i32) -> Option<usize> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    last_cpu_of_stat(&stat)
}

/// Field 39 of a `stat` line. The command name (field 2) is in
/// parentheses and may hold spaces and parentheses itself: fields are
/// counted from the last `)`.
fn last_cpu_of_stat(stat: &str) -> Option<usize> {
    let (_, rest) = stat.rsplit_once(')')?;
    // `rest` starts at field 3 (the state): field 39 is its 37th word.
    rest.split_whitespace().nth(36)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(cpus: std::ops::Range<usize>) -> ProcessCpus {
        ProcessCpus {
            cpus: cpus.collect(),
            source: "test".into(),
        }
    }

    /// Worker masks for `n` workers.
    fn masks(p: &CpuPlan, n: usize) -> Vec<Option<Vec<usize>>> {
        (0..n).map(|w| p.mask(w)).collect()
    }

    #[test]
    fn asked_cpus_inside_a_wide_process_set_are_pinned_round_robin() {
        for width in [16, 64, 128] {
            let p = CpuPlan::new(&[3, 5], &set(0..width));
            assert!(p.warnings.is_empty(), "{:?}", p.warnings);
            assert_eq!(
                masks(&p, 5),
                [
                    Some(vec![3]),
                    Some(vec![5]),
                    Some(vec![3]),
                    Some(vec![5]),
                    Some(vec![3])
                ]
            );
        }
        // A whole 128-CPU node asked for: one CPU each, in the asked order.
        let node: Vec<usize> = (64..128).collect();
        let p = CpuPlan::new(&node, &set(0..128));
        assert!(p.warnings.is_empty());
        assert_eq!(p.mask(0), Some(vec![64]));
        assert_eq!(p.mask(63), Some(vec![127]));
        assert_eq!(p.mask(64), Some(vec![64]));
    }

    #[test]
    fn no_placement_gives_every_worker_the_whole_process_set() {
        // Whatever the opening thread's mask: the plan never reads it.
        for width in [16, 64, 128] {
            let p = CpuPlan::new(&[], &set(0..width));
            assert!(p.warnings.is_empty());
            let all: Vec<usize> = (0..width).collect();
            assert_eq!(masks(&p, 3), vec![Some(all); 3]);
        }
    }

    #[test]
    fn cpus_outside_a_narrow_cpuset_are_a_warning_and_a_fallback() {
        // A container's cpuset 8-11 on a 64-CPU host; cpus 2, 9, 40 asked.
        let narrow = set(8..12);
        let p = CpuPlan::new(&[2, 9, 40], &narrow);
        assert_eq!(masks(&p, 2), [Some(vec![9]), Some(vec![9])]);
        assert_eq!(
            p.warnings,
            [
                "cpus 2,40 asked for are outside the process's allowed CPUs 8-11 (test): \
              workers are pinned to the rest, cpus 9"
            ]
        );
        // None of them inside: not pinned, the whole cpuset.
        let p = CpuPlan::new(&[0, 1], &narrow);
        assert_eq!(masks(&p, 2), vec![Some(vec![8, 9, 10, 11]); 2]);
        assert_eq!(
            p.warnings,
            [
                "cpus 0-1 asked for are outside the process's allowed CPUs 8-11 (test): \
              workers may run on any of them instead (not pinned)"
            ]
        );
        // A CPU number no mask can hold.
        let p = CpuPlan::new(&[1 << 20], &set(0..128));
        assert_eq!(p.mask(0), Some((0..128).collect()));
        assert_eq!(p.warnings.len(), 1);
    }

    #[test]
    fn an_unreadable_process_set_is_said_and_the_asked_cpus_kept() {
        let none = ProcessCpus {
            cpus: vec![],
            source: "unknown".into(),
        };
        let p = CpuPlan::new(&[1], &none);
        assert_eq!(p.mask(0), Some(vec![1]));
        assert!(
            p.warnings[0].contains("could not be read (unknown)"),
            "{:?}",
            p.warnings
        );
        let p = CpuPlan::new(&[], &none);
        assert_eq!(p.mask(0), None, "inherited");
        assert!(p.warnings[0].contains("keep the opening thread's CPUs"));
    }

    #[test]
    fn cpulists_format_as_the_kernel_writes_them() {
        assert_eq!(format_cpulist(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpulist(&[5, 1, 5]), "1,5");
        assert_eq!(format_cpulist(&[]), "(none)");
    }

    #[test]
    fn the_last_cpu_is_field_39_counted_from_the_last_parenthesis() {
        let mut fields: Vec<String> = (3..=52).map(|i| i.to_string()).collect();
        fields[39 - 3] = "7".into();
        let line = format!("1234 (odd) name (x)) {}\n", fields.join(" "));
        assert_eq!(last_cpu_of_stat(&line), Some(7));
        assert_eq!(last_cpu_of_stat("1 (x) S 1"), None);
        // This thread's own entry is readable and names a CPU it may use.
        let me = crate::host::sys::gettid();
        let on = last_cpu(me).unwrap();
        let mine = crate::host::sys::thread_cpus().unwrap();
        assert!(mine.contains(&on), "{on} not in {mine:?}");
        assert_eq!(last_cpu(-5), None);
    }

    /// A fake `/proc/self` and cgroup mounts under one temporary root.
    fn fake_proc(cgroup: &str, mountinfo: &str, status: &str) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("proc");
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("cgroup"), cgroup).unwrap();
        std::fs::write(p.join("mountinfo"), mountinfo).unwrap();
        std::fs::write(p.join("status"), status).unwrap();
        d
    }

    fn write(root: &Path, rel: &str, text: &str) {
        let f = root.join(rel);
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, text).unwrap();
    }

    #[test]
    fn cgroup_v2_cpuset_is_read_from_the_nearest_cgroup_that_has_it() {
        let status = "Name:\tx\nCpus_allowed_list:\t0\n";
        let d = fake_proc("0::/machine/app.scope/leaf\n", "", status);
        let mnt = d.path().join("cg2");
        let mi = format!(
            "30 1 0:26 / {} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
            mnt.display()
        );
        std::fs::write(d.path().join("proc/mountinfo"), mi).unwrap();
        write(&mnt, "cpuset.cpus.effective", "0-127\n");
        write(
            &mnt,
            "machine/app.scope/cpuset.cpus.effective",
            "8-15,64-71\n",
        );
        std::fs::create_dir_all(mnt.join("machine/app.scope/leaf")).unwrap();
        let p = ProcessCpus::from_proc(&d.path().join("proc"));
        let want: Vec<usize> = (8..16).chain(64..72).collect();
        assert_eq!(p.cpus, want, "the leaf has no cpuset file: its parent's");
        assert!(
            p.source
                .ends_with("machine/app.scope/cpuset.cpus.effective"),
            "{}",
            p.source
        );
        // The opening thread's mask (`Cpus_allowed_list` 0) plays no part.
    }

    #[test]
    fn cgroup_v1_cpuset_wins_on_a_hybrid_host_and_status_is_the_last_resort() {
        let cg = "12:cpu,cpuacct:/\n3:cpuset:/docker/abc\n0::/\n";
        let d = fake_proc(cg, "", "Cpus_allowed_list:\t0-3\n");
        let v1 = d.path().join("cg1 cpuset");
        let v2 = d.path().join("cg2");
        let mi = format!(
            "25 1 0:22 / {} rw - cgroup cgroup rw,cpuset\n\
             26 1 0:23 / {} rw - cgroup2 cgroup2 rw\n",
            v1.display().to_string().replace(' ', "\\040"),
            v2.display()
        );
        std::fs::write(d.path().join("proc/mountinfo"), mi).unwrap();
        write(&v1, "docker/abc/cpuset.effective_cpus", "2-3\n");
        write(&v2, "cpuset.cpus.effective", "0-63\n");
        let p = ProcessCpus::from_proc(&d.path().join("proc"));
        assert_eq!(p.cpus, [2, 3]);
        // A container whose mount shows the hierarchy from its own cgroup.
        let mi = format!(
            "25 1 0:22 /docker/abc {} rw - cgroup cgroup rw,cpuset\n",
            v1.display().to_string().replace(' ', "\\040"),
        );
        std::fs::write(d.path().join("proc/mountinfo"), mi).unwrap();
        write(&v1, "cpuset.effective_cpus", "5\n");
        std::fs::remove_file(v1.join("docker/abc/cpuset.effective_cpus")).unwrap();
        assert_eq!(ProcessCpus::from_proc(&d.path().join("proc")).cpus, [5]);
        // No cpuset anywhere: the status file's list.
        std::fs::write(d.path().join("proc/mountinfo"), "").unwrap();
        std::fs::write(d.path().join("proc/cgroup"), "1:memory:/\n").unwrap();
        let p = ProcessCpus::from_proc(&d.path().join("proc"));
        assert_eq!(p.cpus, [0, 1, 2, 3]);
        assert!(
            p.source.ends_with("status Cpus_allowed_list"),
            "{}",
            p.source
        );
        // Nothing readable.
        let p = ProcessCpus::from_proc(Path::new("/nonexistent"));
        assert_eq!((p.cpus.len(), p.source.as_str()), (0, "unknown"));
    }

    #[test]
    fn this_process_has_a_set_holding_every_cpu_of_this_thread() {
        let p = ProcessCpus::current();
        assert!(!p.cpus.is_empty(), "{p:?}");
        for c in crate::host::sys::thread_cpus().unwrap() {
            assert!(p.cpus.contains(&c), "{c} not in {p:?}");
        }
    }
}
