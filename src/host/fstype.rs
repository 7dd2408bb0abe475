//! # Which file systems a device file may live on
//!
//! A regular file is mapped shared and written with KV bytes, so it must be
//! memory or a file on a real file system. sysfs, procfs, debugfs and the
//! other pseudo file systems also show regular files (a PCI `resourceN`
//! BAR, `/proc/self/mem`, a debugfs knob), and mapping one shared would
//! write KV bytes into device registers or kernel state. So the arena's
//! open (every face that opens a path: config devices, hotplug `add`,
//! `daxkv bench --path`, Python's `device_path`) and the probe accept a
//! regular file only on the file systems of [`ALLOWED`], by the `f_type`
//! of `statfs` on the path before it is opened and of `fstatfs` on the
//! opened descriptor (a rename between the two cannot slip a pseudo-file
//! in). Device-DAX character devices are recognised by their sysfs
//! attributes instead (`arena`), whatever file system holds the node.
//!
//! | file system | `f_type` | why it is allowed |
//! |---|---|---|
//! | tmpfs (`/dev/shm`, memfd) | `0x01021994` | memory |
//! | ramfs | `0x858458f6` | memory |
//! | hugetlbfs | `0x958458f6` | memory in huge pages |
//! | ext2 / ext3 / ext4 | `0xef53` | fsdax, or a file on disk |
//! | xfs | `0x58465342` | fsdax, or a file on disk |
//! | btrfs | `0x9123683e` | a file on disk |
//! | f2fs | `0xf2f52010` | a file on disk |
//! | bcachefs | `0xca451a4e` | a file on disk |
//! | zfs | `0x2fc12fc1` | a file on disk |
//! | overlayfs | `0x794c7630` | a container's root over one of these |
//! | nfs, virtiofs, 9p | `0x6969`, `0x6a656a63`, `0x01021997` | a file shared from a host (VMs, containers, test machines) |
//!
//! Everything else is refused, with the file system's name where it is a
//! known pseudo file system (sysfs, procfs, debugfs, …) and its `f_type`
//! in hex otherwise.

#![forbid(unsafe_code)]

/// The allowed file systems: `(f_type, name)`.
pub const ALLOWED: [(i64, &str); 14] = [
    (0x0102_1994, "tmpfs"),
    (0x8584_58f6, "ramfs"),
    (0x9584_58f6, "hugetlbfs"),
    (0xef53, "ext4"),
    (0x5846_5342, "xfs"),
    (0x9123_683e, "btrfs"),
    (0xf2f5_2010, "f2fs"),
    (0xca45_1a4e, "bcachefs"),
    (0x2fc1_2fc1, "zfs"),
    (0x794c_7630, "overlayfs"),
    (0x6969, "nfs"),
    (0x6a65_6a63, "virtiofs"),
    (0x0102_1997, "9p"),
    // The 32-bit kernel's sign-extended view of hugetlbfs' magic.
    (0x9584_58f6_u32.cast_signed() as i64, "hugetlbfs"),
];

/// Known file systems that are refused (named in the error).
const REFUSED: [(i64, &str); 16] = [
    (0x6265_6572, "sysfs"),
    (0x9fa0, "procfs"),
    (0x6462_6720, "debugfs"),
    (0x7472_6163, "tracefs"),
    (0x7363_6673, "securityfs"),
    (0x0027_e0eb, "cgroup"),
    (0x6367_7270, "cgroup2"),
    (0x6265_6570, "configfs"),
    (0x6e73_6673, "nsfs"),
    (0xcafe_4a11, "bpf"),
    (0x6573_5546, "fuse"),
    (0x1cd1, "devpts"),
    (0xde5e_81e4, "efivarfs"),
    (0x7375_7245, "coda"),
    (0xff53_4d42, "cifs"),
    (0x4249_4e4d, "binfmt_misc"),
];

/// The `f_type` of the file system holding `path` (`statfs`; nothing is
/// opened).
pub fn of_path(path: &std::path::Path) -> std::io::Result<i64> {
    crate::host::sys::fs_magic(path)
}

/// A regular file on a file system off the allow-list: the message of
/// the device layer's `OpenError::FileSystem`, which carries these fields.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: a file on {fs} is not memory; a device file must be on tmpfs, hugetlbfs or a disk file system (ext4, xfs, btrfs, …), or be a device-DAX node")]
pub struct NotMemory {
    /// The path given.
    pub path: std::path::PathBuf,
    /// The file system's name and `f_type` ([`describe`]).
    pub fs: String,
}

/// Refuse a regular file at `path` on a file system off the allow-list:
/// the arena's own message (naming the path and the file system), for
/// faces that check before they open (`daxkv bench`'s preflight).
pub fn check_path(path: &std::path::Path) -> Result<(), NotMemory> {
    match of_path(path) {
        Ok(m) if !is_allowed(m) => Err(NotMemory {
            path: path.into(),
            fs: describe(m),
        }),
        _ => Ok(()),
    }
}

/// The bytes still free (for an unprivileged user) on the file system
/// holding `path` (`statfs`; nothing is opened).
pub fn available_bytes(path: &std::path::Path) -> std::io::Result<u64> {
    crate::host::sys::fs_available_bytes(path)
}

/// Whether a regular file on the file system `magic` may be mapped.
pub fn is_allowed(magic: i64) -> bool {
    ALLOWED.iter().any(|(m, _)| *m == magic)
}

/// A readable name for the file system `magic`: its name where known,
/// else `f_type 0x…`.
pub fn describe(magic: i64) -> String {
    ALLOWED
        .iter()
        .chain(REFUSED.iter())
        .find(|(m, _)| *m == magic)
        .map_or_else(
            || format!("f_type {magic:#x}"),
            |(_, name)| format!("{name} ({magic:#x})"),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_and_disk_file_systems_pass_pseudo_ones_do_not() {
        for m in [0x0102_1994, 0xef53, 0x5846_5342, 0x9584_58f6] {
            assert!(is_allowed(m), "{m:#x}");
        }
        for m in [0x6265_6572, 0x9fa0, 0x6462_6720, 0x7472_6163, 0] {
            assert!(!is_allowed(m), "{m:#x}");
        }
        assert_eq!(describe(0x9fa0), "procfs (0x9fa0)");
        assert_eq!(describe(0x1234), "f_type 0x1234");
    }
}
