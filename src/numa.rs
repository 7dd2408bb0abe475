//! # NUMA placement
//!
//! Which CPUs should serve a device: the device's NUMA node comes from
//! sysfs (`target_node`, else `numa_node`, of the device-dax node); CXL
//! memory nodes have no CPUs, so the workers go to the node with CPUs that
//! is nearest by the firmware distance matrix.
//!
//! Topology is read from sysfs (`/sys/devices/system/node/node*/{cpulist,
//! distance}`), not hwloc: sysfs is where hwloc itself reads NUMA distances
//! on Linux, it needs no C library, and the `hwloc2` crate panics on NUMA
//! nodes with hwloc 2.x. The sysfs root is a parameter, so a fake tree
//! (a two-socket machine with a CPU-less CXL node, in the tests) stands in
//! for hardware.
#![forbid(unsafe_code)]

use std::path::Path;

/// One NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// The node number (`nodeN`).
    pub id: u32,
    /// Its CPUs (`cpulist`); empty for a CPU-less (e.g. CXL memory) node.
    pub cpus: Vec<usize>,
    /// Distance to node `i` (the firmware SLIT row), indexed by node id.
    pub distances: Vec<u32>,
}

/// The machine's NUMA nodes.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Topology {
    /// Every node found, in directory order.
    pub nodes: Vec<Node>,
}

/// Parse a kernel CPU list ("0-3,8,10-11").
pub fn parse_cpulist(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if a > b {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.trim().parse().ok()?),
        }
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
                let name = e.file_name();
                let Some(id) = name
                    .to_str()
                    .and_then(|n| n.strip_prefix("node"))
                    .and_then(|n| n.parse::<u32>().ok())
                else {
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
                });
            }
        }
        nodes.sort_by_key(|n| n.id);
        if nodes.is_empty() {
            let n = std::thread::available_parallelism().map_or(1, usize::from);
            nodes.push(Node {
                id: 0,
                cpus: (0..n).collect(),
                distances: vec![10],
            });
        }
        Topology { nodes }
    }

    /// Node `id`, if the machine has it.
    pub fn node(&self, id: u32) -> Option<&Node> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// The node with CPUs nearest `node` (itself if it has CPUs; ties go to
    /// the lower id), or `None` if `node` is unknown.
    pub fn nearest_cpu_node(&self, node: u32) -> Option<&Node> {
        let from = self.node(node)?;
        if !from.cpus.is_empty() {
            return Some(from);
        }
        self.nodes
            .iter()
            .filter(|n| !n.cpus.is_empty())
            .min_by_key(|n| {
                (
                    from.distances
                        .get(n.id as usize)
                        .copied()
                        .unwrap_or(u32::MAX),
                    n.id,
                )
            })
    }

    /// The CPUs to serve a device on `node`.
    pub fn cpus_for(&self, node: u32) -> Vec<usize> {
        self.nearest_cpu_node(node)
            .map(|n| n.cpus.clone())
            .unwrap_or_default()
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
    let (maj, min) = (libc::major(md.rdev()), libc::minor(md.rdev()));
    let dir = sysfs_root.join(format!("dev/char/{maj}:{min}"));
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
    /// The CPU list for a pool serving `first_device`.
    pub fn resolve(
        &self,
        topo: &Topology,
        sysfs_root: &Path,
        first_device: Option<&Path>,
    ) -> Vec<usize> {
        match self {
            Placement::Off => Vec::new(),
            Placement::Cpus(c) => c.clone(),
            Placement::Node(n) => topo.cpus_for(*n),
            Placement::Auto => first_device
                .and_then(|p| device_node(sysfs_root, p))
                .map(|n| topo.cpus_for(n))
                .unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
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
            vec![2, 3]
        );
        assert_eq!(
            Placement::Node(0).resolve(&t, root.path(), None),
            vec![0, 1]
        );
        assert_eq!(
            Placement::Off.resolve(&t, root.path(), Some(Path::new("/dev/null"))),
            Vec::<usize>::new()
        );
        assert_eq!(
            Placement::Cpus(vec![7]).resolve(&t, root.path(), None),
            vec![7]
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
    fn missing_sysfs_is_one_node_with_every_cpu() {
        let t = Topology::from_sysfs(Path::new("/nonexistent"));
        assert_eq!(t.nodes.len(), 1);
        assert!(!t.nodes[0].cpus.is_empty());
    }
}
