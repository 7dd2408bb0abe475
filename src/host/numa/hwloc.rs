//! # Topology through hwloc (the `hwloc` feature)
//!
//! Reads NUMA nodes, their CPUs and the distance matrix through the
//! `hwlocality` binding (needs the system libhwloc >= 2.0 and pkg-config:
//! `libhwloc-dev` on Debian) and builds the same [`Topology`] the sysfs
//! reader does. Not the default: sysfs needs no C library, and it is where
//! hwloc itself reads these on Linux.
//!
//! hwloc and sysfs describe a CPU-less node differently: the kernel lists
//! no CPUs for it, while hwloc gives every NUMA node the cpuset of the
//! object it is attached to (its locality). So a node's CPUs here are the
//! PUs whose *local* node it is: for each PU, the nearest ancestor with
//! memory children, and of those children the lowest node number (the DRAM
//! node, where an HBM or CXL node hangs off the same package). HMAT access
//! classes are not read through hwloc ([`Node::access0`] / `access1` stay
//! `None`); hwloc uses them only to choose where to attach CPU-less nodes.
//!
//! [`Node::access0`]: super::Node::access0

use hwlocality::object::distance::DistancesKind;
use hwlocality::object::types::ObjectType;
use hwlocality::object::TopologyObject;

use super::{Node, Topology};

/// The kernel's distances when firmware gives none (`LOCAL_DISTANCE`,
/// `REMOTE_DISTANCE`).
const LOCAL: u32 = 10;
const REMOTE: u32 = 20;

/// hwloc could not build a topology.
#[derive(Debug, thiserror::Error)]
#[error("hwloc: {0}")]
pub struct HwlocError(String);

impl Topology {
    /// This machine's NUMA topology, through hwloc.
    pub fn from_hwloc() -> Result<Topology, HwlocError> {
        let t = hwlocality::Topology::new().map_err(|e| HwlocError(e.to_string()))?;
        Ok(convert(&t))
    }

    /// The NUMA topology an hwloc XML export describes (`lstopo t.xml`).
    pub fn from_hwloc_xml(xml: &str) -> Result<Topology, HwlocError> {
        let t = hwlocality::Topology::builder()
            .from_xml(xml)
            .map_err(|e| HwlocError(e.to_string()))?
            .build()
            .map_err(|e| HwlocError(e.to_string()))?;
        Ok(convert(&t))
    }
}

/// An hwloc topology as daxkv's [`Topology`].
fn convert(t: &hwlocality::Topology) -> Topology {
    let mut nodes: Vec<Node> = t
        .objects_with_type(ObjectType::NUMANode)
        .filter_map(TopologyObject::os_index)
        .map(|id| Node {
            id: id as u32,
            cpus: Vec::new(),
            distances: Vec::new(),
            access0: None,
            access1: None,
        })
        .collect();
    nodes.sort_by_key(|n| n.id);
    nodes.dedup_by_key(|n| n.id);
    for pu in t.objects_with_type(ObjectType::PU) {
        let Some(cpu) = pu.os_index() else { continue };
        let local = pu.ancestors().find(|a| a.memory_arity() > 0).and_then(|a| {
            a.memory_children()
                .filter_map(TopologyObject::os_index)
                .min()
        });
        if let Some(n) = local.and_then(|l| nodes.iter_mut().find(|n| n.id as usize == l)) {
            n.cpus.push(cpu);
        }
    }
    // Without a firmware matrix the kernel reports 10 to itself and 20 to
    // every other node; ids the machine lacks are u32::MAX, as in the sysfs
    // reader.
    let ids: Vec<u32> = nodes.iter().map(|n| n.id).collect();
    let len = ids.last().map_or(0, |&m| m as usize + 1);
    for n in &mut nodes {
        n.cpus.sort_unstable();
        n.distances = (0..len as u32)
            .map(|m| match m {
                m if m == n.id => LOCAL,
                m if ids.contains(&m) => REMOTE,
                _ => u32::MAX,
            })
            .collect();
    }
    // The firmware matrix: hwloc's "NUMALatency" (from the OS, meaning
    // latency), when there is one.
    let matrices = t
        .distances_with_type(Some(DistancesKind::MEANS_LATENCY), ObjectType::NUMANode)
        .unwrap_or_default();
    if let Some(m) = matrices.first() {
        for ((from, to), d) in m.object_distances() {
            let (Some(from), Some(to)) = (
                from.and_then(TopologyObject::os_index),
                to.and_then(TopologyObject::os_index),
            ) else {
                continue;
            };
            if let Some(n) = nodes.iter_mut().find(|n| n.id as usize == from) {
                if let Some(slot) = n.distances.get_mut(to) {
                    *slot = u32::try_from(d).unwrap_or(u32::MAX);
                }
            }
        }
    }
    Topology { nodes }
}

#[cfg(test)]
mod tests {
    use super::super::tests::fake_sysfs;
    use super::*;

    /// The machine of the sysfs tests' fake tree, as an hwloc XML export:
    /// two packages (node 0 with CPUs 0-1, node 1 with CPUs 2-3) and a
    /// CPU-less CXL memory node 2 attached to the machine, with the same
    /// distance matrix (10 21 40 / 21 10 24 / 40 24 10).
    pub(crate) const TWO_SOCKETS_AND_CXL: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE topology SYSTEM "hwloc2.dtd">
<topology version="2.0">
  <object type="Machine" os_index="0" cpuset="0x0000000f" complete_cpuset="0x0000000f" allowed_cpuset="0x0000000f" nodeset="0x00000007" complete_nodeset="0x00000007" allowed_nodeset="0x00000007" gp_index="1">
    <object type="Package" os_index="0" cpuset="0x00000003" complete_cpuset="0x00000003" nodeset="0x00000001" complete_nodeset="0x00000001" gp_index="2">
      <object type="NUMANode" os_index="0" cpuset="0x00000003" complete_cpuset="0x00000003" nodeset="0x00000001" complete_nodeset="0x00000001" gp_index="3" local_memory="1073741824">
        <page_type size="4096" count="262144"/>
      </object>
      <object type="Core" os_index="0" cpuset="0x00000001" complete_cpuset="0x00000001" nodeset="0x00000001" complete_nodeset="0x00000001" gp_index="4">
        <object type="PU" os_index="0" cpuset="0x00000001" complete_cpuset="0x00000001" nodeset="0x00000001" complete_nodeset="0x00000001" gp_index="5"/>
      </object>
      <object type="Core" os_index="1" cpuset="0x00000002" complete_cpuset="0x00000002" nodeset="0x00000001" complete_nodeset="0x00000001" gp_index="6">
        <object type="PU" os_index="1" cpuset="0x00000002" complete_cpuset="0x00000002" nodeset="0x00000001" complete_nodeset="0x00000001" gp_index="7"/>
      </object>
    </object>
    <object type="Package" os_index="1" cpuset="0x0000000c" complete_cpuset="0x0000000c" nodeset="0x00000002" complete_nodeset="0x00000002" gp_index="8">
      <object type="NUMANode" os_index="1" cpuset="0x0000000c" complete_cpuset="0x0000000c" nodeset="0x00000002" complete_nodeset="0x00000002" gp_index="9" local_memory="1073741824">
        <page_type size="4096" count="262144"/>
      </object>
      <object type="Core" os_index="0" cpuset="0x00000004" complete_cpuset="0x00000004" nodeset="0x00000002" complete_nodeset="0x00000002" gp_index="10">
        <object type="PU" os_index="2" cpuset="0x00000004" complete_cpuset="0x00000004" nodeset="0x00000002" complete_nodeset="0x00000002" gp_index="11"/>
      </object>
      <object type="Core" os_index="1" cpuset="0x00000008" complete_cpuset="0x00000008" nodeset="0x00000002" complete_nodeset="0x00000002" gp_index="12">
        <object type="PU" os_index="3" cpuset="0x00000008" complete_cpuset="0x00000008" nodeset="0x00000002" complete_nodeset="0x00000002" gp_index="13"/>
      </object>
    </object>
    <object type="NUMANode" os_index="2" cpuset="0x0000000f" complete_cpuset="0x0000000f" nodeset="0x00000004" complete_nodeset="0x00000004" gp_index="14" local_memory="4294967296">
      <page_type size="4096" count="1048576"/>
    </object>
  </object>
  <distances2 type="NUMANode" nbobjs="3" kind="5" name="NUMALatency" indexing="os">
    <indexes length="6">0 1 2 </indexes>
    <u64values length="27">10 21 40 21 10 24 40 24 10 </u64values>
  </distances2>
</topology>
"#;

    #[test]
    fn hwloc_xml_agrees_with_the_sysfs_reader() {
        let hw = Topology::from_hwloc_xml(TWO_SOCKETS_AND_CXL).unwrap();
        let root = fake_sysfs();
        let fs = Topology::from_sysfs(root.path());
        assert_eq!(hw, fs);
        assert!(
            hw.node(2).unwrap().cpus.is_empty(),
            "the CXL node has no CPUs"
        );
        assert_eq!(hw.cpus_for(2), vec![2, 3]);
    }

    #[test]
    fn bad_xml_is_an_error() {
        assert!(Topology::from_hwloc_xml("<topology>").is_err());
    }

    /// On the machine running the tests: the same nodes and distances as
    /// sysfs, and CPUs within sysfs's (hwloc leaves out CPUs a cgroup
    /// forbids).
    #[test]
    fn this_machine_agrees_with_sysfs() {
        let sys = std::path::Path::new("/sys");
        if !sys.join("devices/system/node").is_dir() {
            return;
        }
        let hw = Topology::from_hwloc().unwrap();
        let fs = Topology::from_sysfs(sys);
        let ids = |t: &Topology| t.nodes.iter().map(|n| n.id).collect::<Vec<_>>();
        assert_eq!(ids(&hw), ids(&fs));
        for (h, f) in hw.nodes.iter().zip(&fs.nodes) {
            assert_eq!(h.distances, f.distances, "node {}", h.id);
            assert!(h.cpus.iter().all(|c| f.cpus.contains(c)), "node {}", h.id);
        }
    }
}
