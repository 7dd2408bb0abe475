//! The device probe and the NUMA reader over random fake sysfs trees.
//!
//! Each input builds a tree under a temporary root the way tests/probe.rs
//! does: `/dev/null` is the character device (every Linux machine has it)
//! and `dev/char/<its MAJ:MIN>` is a directory, a link into `devices/`, a
//! loop, a file or nothing; under it, and under `devices/system/node` and
//! `devices/system/cpu`, the attributes the readers look for hold random
//! bytes, numbers (decimal, hex, negative, huge), CPU lists with any ranges,
//! directories, or links.
//!
//! What must hold, whatever the tree: nothing panics or hangs or allocates
//! without bound; `probe` gives a class that agrees with the driver it
//! reports and a non-empty detail; the add / resize gates answer with a
//! message that names the problem and never echoes the path; a `Probe`
//! round-trips through its JSON; the topology's nodes are sorted, unique
//! and within the kernel's bounds; a placement check that fails names its
//! field (`numa`, `cpus`, `cpus[i]`).
//!
//! `cargo test -p daxkv-fuzz --test probe_sysfs` runs it on random inputs
//! (bounded: [`ITERATIONS`] trees or `BOLERO_RANDOM_TEST_TIME_MS`);
//! `cargo +nightly bolero test -p daxkv-fuzz --test probe_sysfs
//! probe_sysfs` runs it coverage-guided.

use std::os::unix::fs::{symlink, MetadataExt};
use std::path::Path;

use bolero::{check, TypeGenerator};
use daxkv::host::numa::{self, Placement, Topology};
use daxkv::host::probe::{check_add, check_grow, probe, DeviceClass, Probe};

const NULL: &str = "/dev/null";
/// Trees per plain `cargo test` run (a few seconds on a 2-vCPU VM).
const ITERATIONS: usize = 1500;

/// How `dev/char/MAJ:MIN` looks.
#[derive(Clone, Copy, Debug, TypeGenerator)]
enum EntryKind {
    Missing,
    Dir,
    /// The real kernel's layout: a link to `devices/platform/hmem.0/dax0.0`.
    Link,
    /// A link to itself.
    Loop,
    File,
}

/// What a link points to (`subsystem`, `driver`).
#[derive(Clone, Debug, TypeGenerator)]
enum Target {
    Dax,
    Mem,
    DeviceDax,
    Kmem,
    Other(String),
    /// A link whose target is an empty path component (`..` / `/`).
    Root,
}

#[derive(Clone, Debug, TypeGenerator)]
enum Content {
    Bytes(Vec<u8>),
    Text(String),
    Num(u64),
    Hex(u64),
    Neg(i64),
    /// A kernel CPU list: `a-b,c,...`.
    CpuList(Vec<(u32, u32, bool)>),
    Dir,
    Link(Target),
}

/// Where an attribute goes: relative to the device directory (`Dev`),
/// under node `n` (`Node`), or under `devices/system/cpu` (`Cpu`).
#[derive(Clone, Copy, Debug, TypeGenerator)]
enum Place {
    Dev(u8),
    Node(u16, u8),
    Cpu,
}

const DEV_ATTRS: &[&str] = &[
    "subsystem",
    "driver",
    "size",
    "align",
    "target_node",
    "numa_node",
    "uevent",
    "device/driver",
    "device/size",
    "device/align",
    "device/target_node",
    "device/numa_node",
    "device/dax_region/align",
    "../dax_region/align",
];

const NODE_ATTRS: &[&str] = &[
    "cpulist",
    "distance",
    "access0/initiators/node0",
    "access1/initiators/node1",
    "access1/initiators/node7",
    "access1/initiators/read_bandwidth",
    "access1/initiators/read_latency",
    "access0/initiators/write_latency",
];

#[derive(Clone, Debug, TypeGenerator)]
struct Tree {
    entry: EntryKind,
    files: Vec<(Place, Content)>,
    /// Asked of the add / resize gates.
    request: u64,
    /// A placement to check: a node, or a CPU list.
    node: u32,
    cpus: Vec<u16>,
}

fn null_numbers() -> (u32, u32) {
    let md = std::fs::metadata(NULL).unwrap();
    (libc::major(md.rdev()), libc::minor(md.rdev()))
}

fn target(t: &Target) -> String {
    match t {
        Target::Dax => "../../../../bus/dax".into(),
        Target::Mem => "../../../../class/mem".into(),
        Target::DeviceDax => "../../../../bus/dax/drivers/device_dax".into(),
        Target::Kmem => "../../../../bus/dax/drivers/kmem".into(),
        Target::Other(s) if !s.is_empty() && !s.contains('\0') => s.clone(),
        Target::Other(_) => "x".into(),
        Target::Root => "/".into(),
    }
}

fn cpulist(ranges: &[(u32, u32, bool)]) -> String {
    ranges
        .iter()
        .map(|&(a, b, range)| {
            if range {
                format!("{a}-{b}")
            } else {
                a.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Write `content` at `path` (parents made; whatever is there replaced).
fn put(path: &Path, content: &Content) {
    if let Some(parent) = path.parent() {
        if std::fs::create_dir_all(parent).is_err() {
            return; // a file sits where a parent would go
        }
    }
    let _ = std::fs::remove_file(path);
    let _ = std::fs::remove_dir_all(path);
    let _ = match content {
        Content::Bytes(b) => std::fs::write(path, b),
        Content::Text(s) => std::fs::write(path, s),
        Content::Num(n) => std::fs::write(path, format!("{n}\n")),
        Content::Hex(n) => std::fs::write(path, format!("0x{n:x}\n")),
        Content::Neg(n) => std::fs::write(path, format!("{n}\n")),
        Content::CpuList(r) => std::fs::write(path, format!("{}\n", cpulist(r))),
        Content::Dir => std::fs::create_dir_all(path),
        Content::Link(t) => symlink(target(t), path),
    };
}

fn build(root: &Path, t: &Tree) {
    let (maj, min) = null_numbers();
    let dev = root.join("devices/platform/hmem.0/dax0.0");
    std::fs::create_dir_all(&dev).unwrap();
    for d in ["device_dax", "kmem"] {
        std::fs::create_dir_all(root.join("bus/dax/drivers").join(d)).unwrap();
    }
    std::fs::create_dir_all(root.join("dev/char")).unwrap();
    let entry = root.join(format!("dev/char/{maj}:{min}"));
    let attrs_in = match t.entry {
        EntryKind::Missing => None,
        EntryKind::Dir => {
            std::fs::create_dir_all(&entry).unwrap();
            Some(entry.clone())
        }
        EntryKind::Link => {
            symlink("../../devices/platform/hmem.0/dax0.0", &entry).unwrap();
            Some(dev.clone())
        }
        EntryKind::Loop => {
            symlink(format!("{maj}:{min}"), &entry).unwrap();
            None
        }
        EntryKind::File => {
            std::fs::write(&entry, b"1:3\n").unwrap();
            None
        }
    };
    for (place, content) in t.files.iter().take(24) {
        let path = match *place {
            Place::Dev(i) => match &attrs_in {
                Some(d) => d.join(DEV_ATTRS[usize::from(i) % DEV_ATTRS.len()]),
                None => continue,
            },
            Place::Node(n, i) => root
                .join(format!("devices/system/node/node{}", n % 6))
                .join(NODE_ATTRS[usize::from(i) % NODE_ATTRS.len()]),
            Place::Cpu => root.join("devices/system/cpu/online"),
        };
        // A few node names that are not `nodeN` with small N.
        let path = match (place, content) {
            (Place::Node(n, _), _) if *n >= 60000 => {
                root.join(format!("devices/system/node/node{n}000/cpulist"))
            }
            _ => path,
        };
        put(&path, content);
    }
}

fn check_probe(p: &Probe) {
    assert!(!p.detail.is_empty(), "empty detail: {p:?}");
    assert!(p.present, "/dev/null is present: {p:?}");
    match p.class {
        DeviceClass::DevDax => assert_eq!(p.driver.as_deref(), Some("device_dax"), "{p:?}"),
        DeviceClass::SystemRam => assert_eq!(p.driver.as_deref(), Some("kmem"), "{p:?}"),
        DeviceClass::Unbound => assert_eq!(p.driver, None, "{p:?}"),
        DeviceClass::NotADevice | DeviceClass::Unknown => {}
        c => panic!("a character device classified {c}: {p:?}"),
    }
    if matches!(
        p.class,
        DeviceClass::DevDax | DeviceClass::SystemRam | DeviceClass::Unbound
    ) {
        assert!(p.align_bytes.is_some_and(|a| a > 0), "{p:?}");
    }
    let json = serde_json::to_string(p).unwrap();
    let back: Probe = serde_json::from_str(&json).unwrap();
    assert_eq!(&back, p, "JSON round trip");
    let table = p.table();
    assert!(table.contains(p.class.as_str()), "{table}");
}

fn check_gate(p: &Probe, bytes: u64) {
    for r in [check_add(p, bytes), check_grow(p, bytes)] {
        match r {
            Ok(()) => {
                assert_eq!(p.class, DeviceClass::DevDax, "only a devdax passes: {p:?}");
                let (size, align) = (p.size_bytes.unwrap(), p.align_bytes.unwrap());
                assert!(
                    bytes > 0 && bytes <= size && bytes.is_multiple_of(align),
                    "{p:?} {bytes}"
                );
            }
            Err(e) => {
                assert!(!e.is_empty());
                assert!(!e.contains(NULL), "a gate echoed the path: {e}");
            }
        }
    }
}

fn check_topology(root: &Path, t: &Tree) {
    let topo = Topology::from_sysfs(root);
    assert!(!topo.nodes.is_empty(), "at least one node");
    assert!(
        topo.nodes.windows(2).all(|w| w[0].id < w[1].id),
        "nodes sorted and unique: {topo:?}"
    );
    for n in &topo.nodes {
        assert!(n.cpus.len() <= numa::MAX_CPUS, "node {} cpus", n.id);
        assert!(
            n.distances.len() <= numa::MAX_NODES,
            "node {} distances",
            n.id
        );
    }
    let resolved = topo.place(t.node % 8);
    if let Some(n) = resolved.node {
        assert!(
            topo.node(n).is_some_and(|n| !n.cpus.is_empty()),
            "{resolved:?}"
        );
        assert_eq!(resolved.cpus, topo.node(n).unwrap().cpus);
    }
    let _ = numa::device_node(root, Path::new(NULL));
    let _ = numa::online_cpus(root);
    for placement in [
        Placement::Node(t.node),
        Placement::Node(t.node % 8),
        Placement::Cpus(t.cpus.iter().map(|&c| usize::from(c)).collect()),
        Placement::Auto,
    ] {
        if let Err(e) = placement.check(&topo, root) {
            assert!(
                e.field == "numa" || e.field == "cpus" || e.field.starts_with("cpus["),
                "{e:?}"
            );
            assert!(!e.rule.is_empty());
        }
        let _ = placement.resolve(&topo, root, Some(Path::new(NULL)));
    }
}

fn run(t: &Tree) {
    // /dev/shm: thousands of small trees a second (a disk's /tmp is slow).
    let root = tempfile::Builder::new()
        .prefix("daxkv-fuzz-sysfs")
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    build(root.path(), t);
    let p = probe(Path::new(NULL), root.path());
    check_probe(&p);
    check_gate(&p, t.request);
    check_gate(&p, t.request % (4 << 30));
    if let Some(size) = p.size_bytes {
        check_gate(&p, size);
    }
    check_topology(root.path(), t);
}

#[test]
fn probe_sysfs() {
    check!()
        .with_iterations(ITERATIONS)
        .with_type::<Tree>()
        .for_each(run);
}
