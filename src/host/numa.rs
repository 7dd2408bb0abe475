//! # NUMA placement
//!
//! Which CPUs should serve a device: the device's NUMA node comes from
//! sysfs (`target_node`, else `numa_node`, of the device-dax node). CXL
//! memory nodes have no CPUs, so the workers go to a node with CPUs chosen
//! by, in order:
//!
//! 1. **HMAT** access classes, where the kernel exposes them
//!    (`nodeN/access1/initiators/`: the CPU initiators with the best
//!    performance to memory node N; else `access0`, any initiator, kept to
//!    nodes with CPUs), ties among several initiators broken by distance;
//! 2. the firmware **distance** matrix (SLIT, `nodeN/distance`): the node
//!    itself when it has CPUs, else the nearest node with CPUs.
//!
//! [`Resolved::source`] says which of them decided, for status and logs.
//! See the kernel's `Documentation/admin-guide/mm/numaperf.rst` for the
//! access classes.
//!
//! Topology is read from sysfs (`/sys/devices/system/node/node*/{cpulist,
//! distance, access0, access1}`), not hwloc: sysfs is where hwloc itself
//! reads NUMA distances on Linux, it needs no C library, and the `hwloc2`
//! crate panics on NUMA nodes with hwloc 2.x. The optional `hwloc` feature
//! adds a reader through the `hwlocality` binding that builds the same
//! [`Topology`] (`Topology::from_hwloc`). The sysfs root is a parameter, so
//! a fake tree (a two-socket machine with a CPU-less CXL node, in the tests)
//! stands in for hardware.
#![forbid(unsafe_code)]

use std::ffi::OsStr;
use std::path::Path;

pub mod affinity;
#[cfg(feature = "hwloc")]
mod hwloc;
#[cfg(feature = "hwloc")]
pub use hwloc::HwlocError;

/// One NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// The node number (`nodeN`).
    pub id: u32,
    /// Its CPUs (`cpulist`); empty for a CPU-less (e.g. CXL memory) node.
    pub cpus: Vec<usize>,
    /// Distance to node `i` (the firmware SLIT row), indexed by node id;
    /// `u32::MAX` for an id the machine does not have (sparse node ids).
    pub distances: Vec<u32>,
    /// HMAT access class 0 (`access0/initiators/`: the best initiators of
    /// any kind, CPU or not), when the kernel exposes it for this node.
    pub access0: Option<Access>,
    /// HMAT access class 1 (`access1/initiators/`: the best CPU
    /// initiators), when the kernel exposes it for this node.
    pub access1: Option<Access>,
}

/// One HMAT access class of a memory node
/// (`nodeN/accessC/initiators/`): the initiator nodes with the best
/// performance to it, and that performance.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Access {
    /// The best initiators (the `nodeM` entries), by id.
    pub initiators: Vec<u32>,
    /// `read_bandwidth`, MB/s.
    pub read_bandwidth: Option<u64>,
    /// `write_bandwidth`, MB/s.
    pub write_bandwidth: Option<u64>,
    /// `read_latency`, ns.
    pub read_latency: Option<u64>,
    /// `write_latency`, ns.
    pub write_latency: Option<u64>,
}

/// Which data chose the CPUs a pool is pinned to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PlacementSource {
    /// The HMAT access classes (`access1`, else `access0`, initiators).
    Hmat,
    /// The firmware distance matrix (SLIT): the node itself when it has
    /// CPUs, else the nearest node with CPUs.
    Distance,
    /// An explicit CPU list (`cpus` in the config).
    Explicit,
    /// Nothing: no pinning (`numa: "off"`, no device node, an unknown
    /// node, or no node with CPUs).
    #[default]
    None,
}

impl PlacementSource {
    /// The name status and logs use: `"hmat"`, `"distance"`, `"explicit"`
    /// or `"none"`.
    pub fn as_str(self) -> &'static str {
        match self {
            PlacementSource::Hmat => "hmat",
            PlacementSource::Distance => "distance",
            PlacementSource::Explicit => "explicit",
            PlacementSource::None => "none",
        }
    }
}

impl std::fmt::Display for PlacementSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A resolved [`Placement`]: the CPUs, and why.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Resolved {
    /// The CPUs to pin workers to; empty: no pinning.
    pub cpus: Vec<usize>,
    /// The memory node placement was asked for (the device's node, or
    /// `Placement::Node`'s), if any.
    pub target: Option<u32>,
    /// The node whose CPUs were chosen, if one was.
    pub node: Option<u32>,
    /// Which data decided.
    pub source: PlacementSource,
}

/// The candidate nearest `from` by distance (ties to the lower id).
fn nearest_of<'a>(from: &Node, cands: impl Iterator<Item = &'a Node>) -> Option<&'a Node> {
    cands.min_by_key(|n| {
        (
            from.distances
                .get(n.id as usize)
                .copied()
                .unwrap_or(u32::MAX),
            n.id,
        )
    })
}

/// `nodeN` -> N; `None` for another name and for `N` at or above
/// [`MAX_NODES`] (such an entry is skipped).
fn node_id(name: &OsStr) -> Option<u32> {
    name.to_str()?
        .strip_prefix("node")?
        .parse()
        .ok()
        .filter(|&n: &u32| (n as usize) < MAX_NODES)
}

/// One HMAT access class of the node at `node_dir`, if the kernel exposes
/// it.
fn read_access(node_dir: &Path, class: u32) -> Option<Access> {
    let dir = node_dir.join(format!("access{class}/initiators"));
    let rd = std::fs::read_dir(&dir).ok()?;
    let mut initiators: Vec<u32> = rd
        .filter_map(Result::ok)
        .filter_map(|e| node_id(&e.file_name()))
        .collect();
    initiators.sort_unstable();
    initiators.dedup();
    let num = |f: &str| {
        std::fs::read_to_string(dir.join(f))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    };
    Some(Access {
        initiators,
        read_bandwidth: num("read_bandwidth"),
        write_bandwidth: num("write_bandwidth"),
        read_latency: num("read_latency"),
        write_latency: num("write_latency"),
    })
}

/// The machine's NUMA nodes.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Topology {
    /// Every node found, in directory order.
    pub nodes: Vec<Node>,
}

/// CPU numbers the readers accept: a CPU list naming one at or above it is
/// unreadable ([`parse_cpulist`] gives `None`). Linux's `NR_CPUS` is at most
/// 8192 on every architecture; a larger number is a broken or hostile file,
/// and a range up to it would be expanded into memory.
pub const MAX_CPUS: usize = 1 << 16;

/// NUMA node ids the readers accept: a `nodeN` directory with `N` at or
/// above it is skipped. Linux's `MAX_NUMNODES` is at most 1024; the
/// distance rows are indexed by id, so a huge id would size every row.
pub const MAX_NODES: usize = 1 << 12;

/// Parse a kernel CPU list ("0-3,8,10-11"). `None` for a list that is not
/// one, and for one naming a CPU at or above [`MAX_CPUS`] or more than
/// `MAX_CPUS` entries in all (repeated ranges): what is expanded into
/// memory stays bounded whatever the file holds.
pub fn parse_cpulist(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b): (usize, usize) = if let Some((a, b)) = part.split_once('-') {
            (a.trim().parse().ok()?, b.trim().parse().ok()?)
        } else {
            let c = part.trim().parse().ok()?;
            (c, c)
        };
        if a > b || b >= MAX_CPUS || out.len() + (b - a) >= MAX_CPUS {
            return None;
        }
        out.extend(a..=b);
    }
    Some(out)
}

impl Topology {
    /// Read `<root>/devices/system/node`. A machine without that directory
    /// (or a container hiding it) is one node holding every CPU.
    pub fn from_sysfs(root: &Path) -> Topology {
        let dir = root.join("devices/system/node");
        let mut nodes = Vec::new();
        if let Ok(rd) = std::fs::read_dir(&dir) {
            for e in rd.filter_map(Result::ok) {
                let Some(id) = node_id(&e.file_name()) else {
                    continue;
                };
                let cpus = std::fs::read_to_string(e.path().join("cpulist"))
                    .ok()
                    .and_then(|s| parse_cpulist(&s))
                    .unwrap_or_default();
                let distances = std::fs::read_to_string(e.path().join("distance"))
                    .ok()
                    .map(|s| {
                        s.split_whitespace()
                            .filter_map(|d| d.parse().ok())
                            .collect()
                    })
                    .unwrap_or_default();
                nodes.push(Node {
                    id,
                    cpus,
                    distances,
                    access0: read_access(&e.path(), 0),
                    access1: read_access(&e.path(), 1),
                });
            }
        }
        nodes.sort_by_key(|n| n.id);
        // A `distance` row lists the online nodes in id order; with sparse
        // ids (nodes 0, 1, 4) position i is the i-th node, not node i.
        let ids: Vec<u32> = nodes.iter().map(|n| n.id).collect();
        if ids.iter().enumerate().any(|(i, &id)| id as usize != i) {
            let len = ids.last().map_or(0, |&m| m as usize + 1);
            for n in &mut nodes {
                if n.distances.len() == ids.len() {
                    let mut row = vec![u32::MAX; len];
                    for (&id, &d) in ids.iter().zip(&n.distances) {
                        row[id as usize] = d;
                    }
                    n.distances = row;
                }
            }
        }
        if nodes.is_empty() {
            let n = std::thread::available_parallelism().map_or(1, usize::from);
            nodes.push(Node {
                id: 0,
                cpus: (0..n).collect(),
                distances: vec![10],
                access0: None,
                access1: None,
            });
        }
        Topology { nodes }
    }

    /// Node `id`, if the machine has it.
    pub fn node(&self, id: u32) -> Option<&Node> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// The node with CPUs nearest `node` by the distance matrix alone
    /// (itself if it has CPUs; ties go to the lower id), or `None` if
    /// `node` is unknown.
    pub fn nearest_cpu_node(&self, node: u32) -> Option<&Node> {
        let from = self.node(node)?;
        if !from.cpus.is_empty() {
            return Some(from);
        }
        nearest_of(from, self.nodes.iter().filter(|n| !n.cpus.is_empty()))
    }

    /// The node with CPUs whose CPUs should serve memory on `node`, and the
    /// data that chose it: the HMAT initiators (`access1`, else `access0`
    /// kept to nodes with CPUs; among several, the nearest by distance,
    /// then the lower id) when the kernel lists any with CPUs, else the
    /// distance matrix ([`Topology::nearest_cpu_node`]). `None` if `node`
    /// is unknown or no node has CPUs.
    pub fn serving_node(&self, node: u32) -> Option<(&Node, PlacementSource)> {
        let from = self.node(node)?;
        for access in [&from.access1, &from.access0].into_iter().flatten() {
            let cands = access
                .initiators
                .iter()
                .filter_map(|&i| self.node(i))
                .filter(|n| !n.cpus.is_empty());
            if let Some(n) = nearest_of(from, cands) {
                return Some((n, PlacementSource::Hmat));
            }
        }
        self.nearest_cpu_node(node)
            .map(|n| (n, PlacementSource::Distance))
    }

    /// The CPUs to serve a device on `node` (see [`Topology::serving_node`]).
    pub fn cpus_for(&self, node: u32) -> Vec<usize> {
        self.place(node).cpus
    }

    /// Placement for a device on `node`: its CPUs and which data chose
    /// them (see [`Topology::serving_node`]).
    pub fn place(&self, node: u32) -> Resolved {
        match self.serving_node(node) {
            Some((n, source)) => Resolved {
                cpus: n.cpus.clone(),
                target: Some(node),
                node: Some(n.id),
                source,
            },
            None => Resolved {
                target: Some(node),
                ..Resolved::default()
            },
        }
    }
}

/// The NUMA node of a device-dax character device, from sysfs
/// (`target_node`, then `numa_node`; -1 means none). Files and memfds have
/// no node here: `None`.
pub fn device_node(sysfs_root: &Path, path: &Path) -> Option<u32> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let md = std::fs::metadata(path).ok()?;
    if !md.file_type().is_char_device() {
        return None;
    }
    let dir = crate::host::devdax::char_dir(sysfs_root, md.rdev());
    for attr in [
        "target_node",
        "numa_node",
        "device/target_node",
        "device/numa_node",
    ] {
        if let Ok(s) = std::fs::read_to_string(dir.join(attr)) {
            if let Ok(n) = s.trim().parse::<i64>() {
                if n >= 0 {
                    return u32::try_from(n).ok();
                }
            }
        }
    }
    None
}

/// Where workers run.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Placement {
    /// Near the first device's node, when it has one; else unpinned.
    #[default]
    Auto,
    /// No pinning.
    Off,
    /// The CPUs nearest this node.
    Node(u32),
    /// Exactly these CPUs.
    Cpus(Vec<usize>),
}

impl Placement {
    /// The CPUs for a pool serving `first_device`, and which data chose
    /// them ([`Resolved::source`]).
    pub fn resolve(
        &self,
        topo: &Topology,
        sysfs_root: &Path,
        first_device: Option<&Path>,
    ) -> Resolved {
        match self {
            Placement::Off => Resolved::default(),
            Placement::Cpus(c) => Resolved {
                cpus: c.clone(),
                source: PlacementSource::Explicit,
                ..Resolved::default()
            },
            Placement::Node(n) => topo.place(*n),
            Placement::Auto => first_device
                .and_then(|p| device_node(sysfs_root, p))
                .map(|n| topo.place(n))
                .unwrap_or_default(),
        }
    }
}

/// The CPUs online on the host (under `sysfs_root`), and where that was
/// read: `devices/system/cpu/online`, else the union of the nodes'
/// `cpulist`s; `None` when sysfs shows neither.
pub fn online_cpus(sysfs_root: &Path) -> Option<(Vec<usize>, String)> {
    let online = sysfs_root.join("devices/system/cpu/online");
    if let Some(c) = std::fs::read_to_string(&online)
        .ok()
        .and_then(|s| parse_cpulist(&s))
        .filter(|c| !c.is_empty())
    {
        return Some((c, online.display().to_string()));
    }
    let dir = sysfs_root.join("devices/system/node");
    if !dir.is_dir() {
        return None;
    }
    let mut cpus: Vec<usize> = Topology::from_sysfs(sysfs_root)
        .nodes
        .into_iter()
        .flat_map(|n| n.cpus)
        .collect();
    cpus.sort_unstable();
    cpus.dedup();
    (!cpus.is_empty()).then(|| (cpus, format!("{}/node*/cpulist", dir.display())))
}

/// A placement that names a NUMA node or CPU the host does not have.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{field}: {rule}")]
pub struct PlacementError {
    /// The config field (`numa`, `cpus[2]`).
    pub field: String,
    /// What is wrong, and what the host has.
    pub rule: String,
}

impl Placement {
    /// Check that the node or CPUs named exist on the host (`topo` and
    /// `sysfs_root` describe it). A node or CPU that does not exist is an
    /// error, not a fallback: the config was written for another machine
    /// or mistyped, and no placement can honour it, while running
    /// unpinned instead would only show as lost throughput. (A CPU that
    /// exists but is outside the process's cpuset is a warning at open:
    /// see [`affinity`].)
    pub fn check(&self, topo: &Topology, sysfs_root: &Path) -> Result<(), PlacementError> {
        match self {
            Placement::Auto | Placement::Off => Ok(()),
            Placement::Node(n) => {
                if topo.node(*n).is_some() {
                    return Ok(());
                }
                let dir = sysfs_root.join("devices/system/node");
                let ids: Vec<usize> = topo.nodes.iter().map(|n| n.id as usize).collect();
                let from = if dir.is_dir() {
                    format!("from {}", dir.display())
                } else {
                    format!("no {}: one node assumed", dir.display())
                };
                Err(PlacementError {
                    field: "numa".into(),
                    rule: format!(
                        "node {n} does not exist on this host (nodes: {}, {from})",
                        affinity::format_cpulist(&ids)
                    ),
                })
            }
            Placement::Cpus(list) if list.is_empty() => Err(PlacementError {
                field: "cpus".into(),
                rule: "must name at least one CPU (\"numa\": \"off\" for no pinning)".into(),
            }),
            Placement::Cpus(list) => {
                let Some((online, from)) = online_cpus(sysfs_root) else {
                    return Ok(());
                };
                match list.iter().position(|c| online.binary_search(c).is_err()) {
                    None => Ok(()),
                    Some(i) => Err(PlacementError {
                        field: format!("cpus[{i}]"),
                        rule: format!(
                            "CPU {} does not exist on this host (online CPUs: {}, from {from})",
                            list[i],
                            affinity::format_cpulist(&online)
                        ),
                    }),
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Two sockets (nodes 0 and 1, two CPUs each) and a CPU-less CXL memory
    /// node 2 attached closer to socket 1.
    pub(crate) fn fake_sysfs() -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for (id, cpus, dist) in [
            (0, "0-1", "10 21 40"),
            (1, "2-3", "21 10 24"),
            (2, "", "40 24 10"),
        ] {
            let d = root.path().join(format!("devices/system/node/node{id}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cpulist"), format!("{cpus}\n")).unwrap();
            std::fs::write(d.join("distance"), format!("{dist}\n")).unwrap();
        }
        root
    }

    #[test]
    fn cpulists_parse() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpulist(""), Some(vec![]));
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("a"), None);
    }

    #[test]
    fn cxl_node_gets_the_nearest_socket() {
        let root = fake_sysfs();
        let t = Topology::from_sysfs(root.path());
        assert_eq!(t.nodes.len(), 3);
        assert!(t.node(2).unwrap().cpus.is_empty());
        assert_eq!(t.nearest_cpu_node(2).unwrap().id, 1, "distance 24 beats 40");
        assert_eq!(t.cpus_for(2), vec![2, 3]);
        assert_eq!(t.cpus_for(0), vec![0, 1], "a node with CPUs serves itself");
        assert_eq!(
            t.cpus_for(9),
            Vec::<usize>::new(),
            "unknown node: no pinning"
        );
        // No HMAT in this tree: the distance matrix decides.
        assert!(t
            .nodes
            .iter()
            .all(|n| n.access0.is_none() && n.access1.is_none()));
        let (n, src) = t.serving_node(2).unwrap();
        assert_eq!((n.id, src), (1, PlacementSource::Distance));
        assert_eq!(t.serving_node(0).unwrap().1, PlacementSource::Distance);
        assert_eq!(
            t.place(9),
            Resolved {
                target: Some(9),
                ..Resolved::default()
            }
        );
        assert_eq!(t.place(9).source.as_str(), "none");
    }

    /// Give `node` an HMAT access class: `initiators` as `nodeM` symlinks
    /// (as the kernel lays them out) and the four performance files.
    pub(crate) fn add_access(root: &Path, node: u32, class: u32, initiators: &[u32]) {
        let dir = root.join(format!(
            "devices/system/node/node{node}/access{class}/initiators"
        ));
        std::fs::create_dir_all(&dir).unwrap();
        for i in initiators {
            std::os::unix::fs::symlink(format!("../../../node{i}"), dir.join(format!("node{i}")))
                .unwrap();
        }
        for (f, v) in [
            ("read_bandwidth", 30_000),
            ("write_bandwidth", 20_000),
            ("read_latency", 250),
            ("write_latency", 300),
        ] {
            std::fs::write(dir.join(f), format!("{v}\n")).unwrap();
        }
    }

    #[test]
    fn hmat_initiators_beat_the_distance_matrix() {
        let root = fake_sysfs();
        // Distance says socket 1 (24 < 40); HMAT's best CPU initiator for
        // the CXL node is socket 0 (e.g. a SLIT the firmware got wrong).
        add_access(root.path(), 2, 1, &[0]);
        // access0 names socket 1, but access1 (CPU initiators) comes first.
        add_access(root.path(), 2, 0, &[1]);
        let t = Topology::from_sysfs(root.path());
        let a1 = t.node(2).unwrap().access1.clone().unwrap();
        assert_eq!(
            a1,
            Access {
                initiators: vec![0],
                read_bandwidth: Some(30_000),
                write_bandwidth: Some(20_000),
                read_latency: Some(250),
                write_latency: Some(300),
            }
        );
        assert_eq!(t.nearest_cpu_node(2).unwrap().id, 1, "distance alone");
        let (n, src) = t.serving_node(2).unwrap();
        assert_eq!((n.id, src), (0, PlacementSource::Hmat), "HMAT wins");
        assert_eq!(t.cpus_for(2), vec![0, 1]);
        assert_eq!(
            t.place(2),
            Resolved {
                cpus: vec![0, 1],
                target: Some(2),
                node: Some(0),
                source: PlacementSource::Hmat
            }
        );
        assert_eq!(t.place(2).source.to_string(), "hmat");
        assert_eq!(
            t.place(1).source,
            PlacementSource::Distance,
            "no HMAT for node 1"
        );
    }

    #[test]
    fn access0_counts_only_initiators_with_cpus() {
        let root = fake_sysfs();
        // A CPU-less initiator (node 3, say an accelerator's node) and
        // socket 0; no access1.
        let d = root.path().join("devices/system/node/node3");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("cpulist"), "\n").unwrap();
        add_access(root.path(), 2, 0, &[3, 0]);
        let t = Topology::from_sysfs(root.path());
        assert!(t.node(2).unwrap().access1.is_none());
        let (n, src) = t.serving_node(2).unwrap();
        assert_eq!((n.id, src), (0, PlacementSource::Hmat));

        // Only CPU-less initiators listed: HMAT cannot decide, distance does.
        let root = fake_sysfs();
        let d = root.path().join("devices/system/node/node3");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("cpulist"), "\n").unwrap();
        add_access(root.path(), 2, 0, &[3]);
        add_access(root.path(), 2, 1, &[]);
        let t = Topology::from_sysfs(root.path());
        let (n, src) = t.serving_node(2).unwrap();
        assert_eq!((n.id, src), (1, PlacementSource::Distance));
    }

    #[test]
    fn several_hmat_initiators_are_split_by_distance() {
        let root = fake_sysfs();
        add_access(root.path(), 2, 1, &[0, 1]);
        let t = Topology::from_sysfs(root.path());
        assert_eq!(
            t.node(2).unwrap().access1.as_ref().unwrap().initiators,
            vec![0, 1]
        );
        let (n, src) = t.serving_node(2).unwrap();
        assert_eq!((n.id, src), (1, PlacementSource::Hmat), "24 beats 40");

        // Equal distances: the lower id.
        let root = fake_sysfs();
        std::fs::write(
            root.path().join("devices/system/node/node2/distance"),
            "30 30 10\n",
        )
        .unwrap();
        add_access(root.path(), 2, 1, &[1, 0]);
        let t = Topology::from_sysfs(root.path());
        let (n, src) = t.serving_node(2).unwrap();
        assert_eq!((n.id, src), (0, PlacementSource::Hmat));
    }

    /// A CPU list naming a CPU past any kernel's, or repeating ranges past
    /// that many entries, is unreadable instead of expanded into memory (a
    /// `0-4294967295` took 32 GiB).
    #[test]
    fn cpulists_past_the_cpu_bound_are_refused_unexpanded() {
        let last = MAX_CPUS - 1;
        assert_eq!(parse_cpulist(&format!("{last}")), Some(vec![last]));
        assert_eq!(parse_cpulist(&format!("{MAX_CPUS}")), None);
        assert_eq!(parse_cpulist("0-4294967295"), None);
        assert_eq!(parse_cpulist(&format!("0-{}", usize::MAX)), None);
        assert_eq!(
            parse_cpulist(&format!("0-{last}")).map(|c| c.len()),
            Some(MAX_CPUS)
        );
        assert_eq!(parse_cpulist(&format!("0-{last},0")), None);
        assert_eq!(parse_cpulist(&vec!["0-9999"; 100].join(",")), None);
    }

    /// A `nodeN` with `N` past any kernel's is skipped: the distance rows
    /// are indexed by id (`node4000000000` sized each at 16 GB).
    #[test]
    fn node_ids_past_the_node_bound_are_skipped() {
        let root = tempfile::tempdir().unwrap();
        for (id, cpus, dist) in [(0, "0-1", "10 20"), (4_000_000_000u64, "2", "20 10")] {
            let d = root.path().join(format!("devices/system/node/node{id}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cpulist"), format!("{cpus}\n")).unwrap();
            std::fs::write(d.join("distance"), format!("{dist}\n")).unwrap();
        }
        let t = Topology::from_sysfs(root.path());
        assert_eq!(t.nodes.len(), 1, "{t:?}");
        assert_eq!(t.nodes[0].id, 0);
        assert_eq!(
            node_id(OsStr::new(&format!("node{}", MAX_NODES - 1))),
            Some(MAX_NODES as u32 - 1)
        );
        assert_eq!(node_id(OsStr::new(&format!("node{MAX_NODES}"))), None);
    }

    #[test]
    fn sparse_node_ids_index_distances_by_id() {
        let root = tempfile::tempdir().unwrap();
        for (id, cpus, dist) in [
            (0, "0-1", "10 21 30"),
            (1, "2-3", "21 10 20"),
            (4, "", "30 20 10"),
        ] {
            let d = root.path().join(format!("devices/system/node/node{id}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cpulist"), format!("{cpus}\n")).unwrap();
            std::fs::write(d.join("distance"), format!("{dist}\n")).unwrap();
        }
        let t = Topology::from_sysfs(root.path());
        assert_eq!(
            t.node(4).unwrap().distances,
            vec![30, 20, u32::MAX, u32::MAX, 10]
        );
        assert_eq!(t.nearest_cpu_node(4).unwrap().id, 1);
    }

    #[test]
    fn device_node_comes_from_the_char_device_sysfs_entry() {
        use std::os::unix::fs::MetadataExt;
        let root = fake_sysfs();
        let md = std::fs::metadata("/dev/null").unwrap();
        let dir = root.path().join(format!(
            "dev/char/{}:{}",
            libc::major(md.rdev()),
            libc::minor(md.rdev())
        ));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(
            device_node(root.path(), Path::new("/dev/null")),
            None,
            "no attribute"
        );
        std::fs::write(dir.join("numa_node"), "-1\n").unwrap();
        assert_eq!(
            device_node(root.path(), Path::new("/dev/null")),
            None,
            "-1 is no node"
        );
        std::fs::write(dir.join("target_node"), "2\n").unwrap();
        assert_eq!(device_node(root.path(), Path::new("/dev/null")), Some(2));
        let t = Topology::from_sysfs(root.path());
        assert_eq!(
            Placement::Auto.resolve(&t, root.path(), Some(Path::new("/dev/null"))),
            Resolved {
                cpus: vec![2, 3],
                target: Some(2),
                node: Some(1),
                source: PlacementSource::Distance
            }
        );
        assert_eq!(
            Placement::Node(0).resolve(&t, root.path(), None).cpus,
            vec![0, 1]
        );
        assert_eq!(
            Placement::Off.resolve(&t, root.path(), Some(Path::new("/dev/null"))),
            Resolved::default()
        );
        let explicit = Placement::Cpus(vec![7]).resolve(&t, root.path(), None);
        assert_eq!(explicit.cpus, vec![7]);
        assert_eq!(explicit.source, PlacementSource::Explicit);
        assert_eq!(
            Placement::Auto.resolve(&t, root.path(), None).source,
            PlacementSource::None,
            "no device: no pinning"
        );
        let f = root.path().join("file");
        std::fs::write(&f, b"x").unwrap();
        assert_eq!(
            device_node(root.path(), &f),
            None,
            "files have no node here"
        );
    }

    #[test]
    fn a_node_or_cpu_the_host_lacks_is_an_error_naming_what_exists() {
        let root = fake_sysfs();
        let t = Topology::from_sysfs(root.path());
        let node_dir = root.path().join("devices/system/node");
        assert_eq!(
            Placement::Node(9).check(&t, root.path()).unwrap_err(),
            PlacementError {
                field: "numa".into(),
                rule: format!(
                    "node 9 does not exist on this host (nodes: 0-2, from {})",
                    node_dir.display()
                ),
            }
        );
        assert_eq!(Placement::Node(2).check(&t, root.path()), Ok(()));
        // No cpu/online in the fake tree: the nodes' cpulists (0-3).
        let e = Placement::Cpus(vec![3, 0, 4, 7])
            .check(&t, root.path())
            .unwrap_err();
        assert_eq!(e.field, "cpus[2]");
        assert_eq!(
            e.rule,
            format!(
                "CPU 4 does not exist on this host (online CPUs: 0-3, from {}/node*/cpulist)",
                node_dir.display()
            )
        );
        assert_eq!(Placement::Cpus(vec![3, 0]).check(&t, root.path()), Ok(()));
        // `cpu/online` wins where sysfs has it (offline CPUs cannot run
        // anything either).
        let cpu = root.path().join("devices/system/cpu");
        std::fs::create_dir_all(&cpu).unwrap();
        std::fs::write(cpu.join("online"), "0-1\n").unwrap();
        let e = Placement::Cpus(vec![1, 2])
            .check(&t, root.path())
            .unwrap_err();
        assert_eq!(e.field, "cpus[1]");
        assert!(e.rule.contains("online CPUs: 0-1, from"), "{}", e.rule);
        assert_eq!(
            Placement::Cpus(vec![])
                .check(&t, root.path())
                .unwrap_err()
                .field,
            "cpus"
        );
        for p in [Placement::Auto, Placement::Off] {
            assert_eq!(p.check(&t, root.path()), Ok(()));
        }
        // A host (container) without the node tree: one node assumed, and
        // said; CPUs cannot be checked there and are let through (the
        // cpuset check at open still warns).
        let bare = tempfile::tempdir().unwrap();
        let t = Topology::from_sysfs(bare.path());
        let e = Placement::Node(1).check(&t, bare.path()).unwrap_err();
        assert!(e.rule.contains("nodes: 0, no "), "{}", e.rule);
        assert_eq!(Placement::Cpus(vec![4095]).check(&t, bare.path()), Ok(()));
        // This host's own sysfs: its online CPUs pass, one past them fails.
        let sys = Path::new("/sys");
        if let Some((online, _)) = online_cpus(sys) {
            let t = Topology::from_sysfs(sys);
            assert_eq!(Placement::Cpus(online.clone()).check(&t, sys), Ok(()));
            let past = online.last().unwrap() + 1;
            assert!(Placement::Cpus(vec![past]).check(&t, sys).is_err());
        }
    }

    #[test]
    fn missing_sysfs_is_one_node_with_every_cpu() {
        let t = Topology::from_sysfs(Path::new("/nonexistent"));
        assert_eq!(t.nodes.len(), 1);
        assert!(!t.nodes[0].cpus.is_empty());
    }
}
