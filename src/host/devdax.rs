//! # Device-DAX facts from sysfs
//!
//! A device-dax character device `MAJ:MIN` is described under
//! `{sysfs_root}/dev/char/MAJ:MIN/` (on a real kernel a link into
//! `/sys/devices/…/daxX.Y`): its `size`, its `align` and its node. These
//! are read without opening the device node: opening an unbound node can
//! fork modprobe. The arena checks a mapping against them, the probe
//! classifies a path from them and NUMA placement reads the node.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use crate::host::sys;

/// Device-dax alignment assumed when sysfs has no `align` attribute.
pub const DEFAULT_DEVDAX_ALIGN_BYTES: usize = 2 << 20;

/// `{sysfs_root}/dev/char/MAJ:MIN` of the character device `rdev`.
pub fn char_dir(sysfs_root: &Path, rdev: u64) -> PathBuf {
    let (maj, min) = sys::major_minor(rdev);
    sysfs_root.join(format!("dev/char/{maj}:{min}"))
}

/// A sysfs number: decimal, or hex with `0x`.
pub fn parse_number(text: &str) -> Result<u64, std::num::ParseIntError> {
    let t = text.trim();
    match t.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => t.parse(),
    }
}

/// Read a device-dax attribute (`size`, `align`) of the character device
/// `rdev` from sysfs: `attr` under [`char_dir`], or under its `device/`.
pub fn attr(sysfs_root: &Path, rdev: u64, attr: &'static str) -> std::io::Result<u64> {
    let dir = char_dir(sysfs_root, rdev);
    let text = std::fs::read_to_string(dir.join(attr))
        .or_else(|_| std::fs::read_to_string(dir.join("device").join(attr)))?;
    parse_number(&text).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_decimal_or_0x_hex() {
        assert_eq!(parse_number("2097152\n"), Ok(2 << 20));
        assert_eq!(parse_number("0x200000"), Ok(2 << 20));
        assert!(parse_number("2M").is_err());
        assert!(parse_number("").is_err());
    }

    #[test]
    fn attributes_are_read_from_the_entry_or_its_device() {
        let root = tempfile::tempdir().unwrap();
        let rdev = libc::makedev(251, 3);
        let dir = root.path().join("dev/char/251:3");
        std::fs::create_dir_all(dir.join("device")).unwrap();
        std::fs::write(dir.join("size"), "4096\n").unwrap();
        std::fs::write(dir.join("device/align"), "0x1000\n").unwrap();
        assert_eq!(attr(root.path(), rdev, "size").unwrap(), 4096);
        assert_eq!(attr(root.path(), rdev, "align").unwrap(), 4096);
        let e = attr(root.path(), rdev, "missing").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
        std::fs::write(dir.join("size"), "lots\n").unwrap();
        let e = attr(root.path(), rdev, "size").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    }
}
