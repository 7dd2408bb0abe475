//! # Device probe: what a path is, without opening it
//!
//! [`probe`] classifies a device path the way the LMCache fork's
//! `probe_device` does (docs/lmcache-dax-behavior.md §9.5): from `stat` and
//! sysfs alone. The path is **never opened**: opening a device-dax node
//! that has no driver bound makes the kernel look for one (`request_module`,
//! which can run `modprobe`), and a probe must have no side effects. Only
//! `stat` (following symbolic links), `statfs` (the file system of a regular
//! file) and reads under the sysfs root are used.
//!
//! | class | from |
//! |---|---|
//! | [`DeviceClass::DevDax`] | char device, sysfs subsystem `dax`, driver `device_dax` |
//! | [`DeviceClass::SystemRam`] | char device, subsystem `dax`, driver `kmem` (onlined as system RAM) |
//! | [`DeviceClass::Unbound`] | char device, subsystem `dax`, no driver |
//! | [`DeviceClass::Unknown`] | subsystem `dax` with another driver, or a `stat` that failed other than "not found" |
//! | [`DeviceClass::Tmpfs`] | regular file whose `statfs` type is `TMPFS_MAGIC` (`/dev/shm`) |
//! | [`DeviceClass::RegularFile`] | a regular file on another allowed file system ([`crate::host::fstype`]: ext4, xfs, hugetlbfs, …) |
//! | [`DeviceClass::NotADevice`] | another char device (`/dev/null`: subsystem `mem`), a char device with no sysfs entry, a block device, a directory, a fifo, a socket, a regular file on a file system off the allow-list (sysfs, procfs, debugfs pseudo-files) |
//! | [`DeviceClass::Absent`] | nothing at the path (or a dangling symbolic link) |
//!
//! ## The sysfs layout read
//!
//! The path's `st_rdev` gives `MAJ:MIN`; everything else is read under
//! `E = {sysfs_root}/dev/char/MAJ:MIN`. On a real kernel `E` is a symbolic
//! link to the device's directory, e.g.
//! `../../devices/platform/hmem.0/dax0.0`, the same directory as
//! `/sys/bus/dax/devices/dax0.0` (Documentation/ABI/testing/sysfs-bus-dax):
//!
//! ```text
//! E/subsystem  -> …/bus/dax  (…/class/dax on pre-5.1 kernels)   last component must be "dax"
//! E/driver     -> …/bus/dax/drivers/device_dax | …/kmem         absent: unbound
//! E/size                                                          bytes (decimal, or 0x hex)
//! E/align                                                         bytes (kernel ≥ 5.10)
//! E/target_node, E/numa_node                                      node, -1 for none
//! E/uevent                                                        DEVNAME=dax0.0
//! E/../dax_region/align                                           the region's alignment
//! ```
//!
//! Liberal in what it accepts, for older and compat layouts: `driver`,
//! `size`, `align`, `target_node` and `numa_node` are also looked for under
//! `E/device/`, `align` under `E/device/dax_region/` too; the kernel name
//! comes from `uevent`'s `DEVNAME`, else from the last component of `E`'s
//! link target. The node is `target_node` (the memory's own node, what the
//! `numa` module uses) before `numa_node`. With no `align` anywhere the
//! alignment is the arena's default, [`DEFAULT_DEVDAX_ALIGN_BYTES`], and the
//! detail says so. Device-dax has no `mode` attribute: the bound driver is
//! what decides devdax versus system-ram.
//!
//! The sysfs root is a parameter: tests build a fake tree and give the
//! entry of a real character device every Linux machine has (`/dev/null`,
//! 1:3) the attributes of a DAX device.
//!
//! ## Add and resize gates
//!
//! [`check_add`] and [`check_grow`] refuse, before anything is mapped, what
//! the arena would refuse or what would fail later: a kmem-bound or unbound
//! DAX device (the fork's messages, docs/lmcache-dax-behavior.md §9.5), a
//! device smaller than asked for (mapping past its end maps fine and
//! SIGBUSes on touch, docs/lmcache-dax-behavior.md §9.4 item 10), a length
//! that is not a multiple of the device's `align` (`mmap` fails with
//! `EINVAL`), and a regular file shorter than asked for (the arena maps an
//! existing file as it is and never grows it: `OpenError::FileTooSmall`).
//! Their messages never contain the path (docs/lmcache-dax-behavior.md §4.3
//! item 5: the path is never echoed back).

#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::host::devdax;
pub use crate::host::devdax::DEFAULT_DEVDAX_ALIGN_BYTES;
use crate::host::sys;
use crate::host::units::human;

/// Where sysfs is mounted on a real machine.
pub const DEFAULT_SYSFS_ROOT: &str = "/sys";

/// What a path is (the `mode` of the fork's `physical` block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DeviceClass {
    /// A device-dax node bound to `device_dax`: mappable.
    #[serde(rename = "devdax")]
    DevDax,
    /// A DAX device bound to `kmem`: onlined as system RAM, not mappable.
    #[serde(rename = "system_ram")]
    SystemRam,
    /// A DAX device with no driver bound (opening it could run modprobe).
    #[serde(rename = "unbound")]
    Unbound,
    /// A regular file not on tmpfs (fsdax, ext4, …).
    #[serde(rename = "regular_file")]
    RegularFile,
    /// A regular file on tmpfs (`/dev/shm`).
    #[serde(rename = "tmpfs")]
    Tmpfs,
    /// Something else: another character device, a block device, a
    /// directory, a fifo, a socket.
    #[serde(rename = "not_a_device")]
    NotADevice,
    /// A DAX device bound to a driver that is neither `device_dax` nor
    /// `kmem`, or a path `stat` could not inspect (e.g. permission denied).
    #[serde(rename = "unknown")]
    Unknown,
    /// Nothing at the path.
    #[serde(rename = "absent")]
    Absent,
}

impl DeviceClass {
    /// The snake_case name used in JSON ("devdax", "system_ram", …).
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceClass::DevDax => "devdax",
            DeviceClass::SystemRam => "system_ram",
            DeviceClass::Unbound => "unbound",
            DeviceClass::RegularFile => "regular_file",
            DeviceClass::Tmpfs => "tmpfs",
            DeviceClass::NotADevice => "not_a_device",
            DeviceClass::Unknown => "unknown",
            DeviceClass::Absent => "absent",
        }
    }
}

impl std::fmt::Display for DeviceClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What [`probe`] found: the fork's `physical` block (less `probed_at`,
/// which the status document adds). Serializes as `{device_path, mode,
/// present, major, minor, kernel_name, driver, size_bytes, align_bytes,
/// numa_node, detail}`, `null` for what does not apply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Probe {
    /// The path as given (not resolved).
    pub device_path: String,
    /// The class.
    #[serde(rename = "mode")]
    pub class: DeviceClass,
    /// Whether `stat` found something at the path.
    pub present: bool,
    /// Major device number (character devices only).
    pub major: Option<u32>,
    /// Minor device number (character devices only).
    pub minor: Option<u32>,
    /// The kernel's name for the device ("dax0.0"), from sysfs.
    pub kernel_name: Option<String>,
    /// The bound driver ("device_dax", "kmem"), from sysfs.
    pub driver: Option<String>,
    /// A DAX device's size from sysfs, or a regular file's length, bytes.
    pub size_bytes: Option<u64>,
    /// A DAX device's alignment from sysfs (the arena's default when sysfs
    /// has none), or the page size for a regular file (informational: the
    /// gates put no alignment rule on files), bytes.
    pub align_bytes: Option<u64>,
    /// A DAX device's NUMA node (`target_node`, else `numa_node`).
    pub numa_node: Option<u32>,
    /// One human sentence on what was found and what to do about it.
    pub detail: String,
}

/// Classify `path` from `stat` and `{sysfs_root}/dev/char/MAJ:MIN/` without
/// opening it (module doc). Never fails: what cannot be read is a class
/// ([`DeviceClass::Absent`], [`DeviceClass::Unknown`], …) and a detail.
pub fn probe(path: &Path, sysfs_root: &Path) -> Probe {
    let mut p = Probe {
        device_path: path.to_string_lossy().into_owned(),
        class: DeviceClass::Unknown,
        present: false,
        major: None,
        minor: None,
        kernel_name: None,
        driver: None,
        size_bytes: None,
        align_bytes: None,
        numa_node: None,
        detail: String::new(),
    };
    let md = match std::fs::metadata(path) {
        Ok(md) => md,
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                || e.raw_os_error() == Some(libc::ENOTDIR) =>
        {
            p.class = DeviceClass::Absent;
            p.detail = if std::fs::symlink_metadata(path).is_ok() {
                "dangling symbolic link: nothing at its target".into()
            } else {
                "nothing at this path".into()
            };
            return p;
        }
        Err(e) => {
            p.detail = format!("cannot stat the path: {e}");
            return p;
        }
    };
    p.present = true;
    let ft = md.file_type();
    if ft.is_char_device() {
        probe_char(&mut p, md.rdev(), sysfs_root);
    } else if ft.is_file() {
        p.size_bytes = Some(md.len());
        p.align_bytes = Some(sys::page_size());
        let on = match sys::fs_magic(path) {
            Ok(m) if m == sys::TMPFS_MAGIC => {
                p.class = DeviceClass::Tmpfs;
                "on tmpfs".to_string()
            }
            Ok(m) if crate::host::fstype::is_allowed(m) => {
                p.class = DeviceClass::RegularFile;
                format!("on {}", crate::host::fstype::describe(m))
            }
            Ok(m) => {
                // sysfs / procfs / debugfs pseudo-files are regular files
                // too; mapping one shared writes into kernel state.
                p.class = DeviceClass::NotADevice;
                p.detail = format!(
                    "a file on {}, not memory: only files on tmpfs, hugetlbfs or a disk \
                     file system are mapped",
                    crate::host::fstype::describe(m)
                );
                return p;
            }
            Err(e) => {
                p.class = DeviceClass::Unknown;
                p.detail = format!("regular file on a file system statfs cannot name ({e})");
                return p;
            }
        };
        p.detail = format!(
            "regular file {on}, {}: mapped as it is (never grown on add)",
            human(md.len())
        );
    } else {
        p.class = DeviceClass::NotADevice;
        let kind = if ft.is_dir() {
            "a directory"
        } else if ft.is_block_device() {
            "a block device (for fsdax, mount it and use a file on it)"
        } else if ft.is_fifo() {
            "a fifo"
        } else if ft.is_socket() {
            "a socket"
        } else {
            "neither a device nor a regular file"
        };
        p.detail = kind.to_string();
    }
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
        if let Ok(t) = std::fs::canonicalize(path) {
            p.detail = format!("{} (via a symbolic link to {})", p.detail, t.display());
        }
    }
    p
}

/// A character device: everything from `{root}/dev/char/MAJ:MIN`.
fn probe_char(p: &mut Probe, rdev: u64, root: &Path) {
    let (maj, min) = sys::major_minor(rdev);
    p.major = Some(maj);
    p.minor = Some(min);
    let entry = devdax::char_dir(root, rdev);
    if !entry.is_dir() {
        p.class = DeviceClass::NotADevice;
        p.detail = format!(
            "character device {maj}:{min} with no entry under {}: not a DAX \
             device, or sysfs is not mounted there",
            root.join("dev/char").display()
        );
        return;
    }
    p.kernel_name = kernel_name(&entry);
    let name = p
        .kernel_name
        .clone()
        .unwrap_or_else(|| format!("{maj}:{min}"));
    match link_name(&entry.join("subsystem")) {
        Some(s) if s == "dax" => {}
        other => {
            p.class = DeviceClass::NotADevice;
            p.detail = match other {
                Some(s) => format!("character device {name} of subsystem {s}, not dax"),
                None => format!("character device {name} with no sysfs subsystem link"),
            };
            return;
        }
    }
    p.driver = link_name(&entry.join("driver")).or_else(|| link_name(&entry.join("device/driver")));
    p.size_bytes = read_attr(&entry, &["size", "device/size"]);
    let region_align = std::fs::canonicalize(&entry)
        .ok()
        .and_then(|d| d.parent().map(|r| r.join("dax_region/align")));
    let mut align_from = vec![
        entry.join("align"),
        entry.join("device/align"),
        entry.join("device/dax_region/align"),
    ];
    align_from.extend(region_align);
    let align = align_from
        .iter()
        .find_map(|f| read_u64(f).filter(|a| *a > 0));
    p.align_bytes = Some(align.unwrap_or(DEFAULT_DEVDAX_ALIGN_BYTES as u64));
    p.numa_node = [
        "target_node",
        "numa_node",
        "device/target_node",
        "device/numa_node",
    ]
    .iter()
    .find_map(|a| {
        std::fs::read_to_string(entry.join(a))
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok())
    });
    let size = p
        .size_bytes
        .map_or_else(|| "size unknown (no size attribute)".into(), human);
    let node = p
        .numa_node
        .map_or_else(|| "no NUMA node".into(), |n| format!("NUMA node {n}"));
    let align_note = match align {
        Some(a) => format!("align {}", human(a)),
        None => format!(
            "no align attribute (assuming {}, as the arena does)",
            human(DEFAULT_DEVDAX_ALIGN_BYTES as u64)
        ),
    };
    let (class, detail) = match p.driver.as_deref() {
        Some("device_dax") => (
            DeviceClass::DevDax,
            format!("device-dax {name} bound to device_dax: {size}, {align_note}, {node}"),
        ),
        Some("kmem") => (
            DeviceClass::SystemRam,
            format!(
                "DAX device {name} bound to kmem: onlined as system RAM ({size}, {node}), \
                 not mappable; `daxctl reconfigure-device --mode=devdax {name}` gives it back"
            ),
        ),
        None => (
            DeviceClass::Unbound,
            format!(
                "DAX device {name} with no driver bound ({size}): opening it could run \
                 modprobe; `daxctl reconfigure-device --mode=devdax {name}` binds device_dax"
            ),
        ),
        Some(d) => (
            DeviceClass::Unknown,
            format!("DAX device {name} bound to {d}, neither device_dax nor kmem"),
        ),
    };
    p.class = class;
    p.detail = detail;
}

/// The last component of a symbolic link's target (`…/bus/dax` → "dax").
fn link_name(link: &Path) -> Option<String> {
    let t = std::fs::read_link(link).ok()?;
    Some(t.file_name()?.to_string_lossy().into_owned())
}

/// The kernel's name of the device behind a `dev/char` entry: `uevent`'s
/// `DEVNAME` (the node's name relative to /dev), else the last component
/// of the entry's link target.
fn kernel_name(entry: &Path) -> Option<String> {
    if let Ok(u) = std::fs::read_to_string(entry.join("uevent")) {
        if let Some(n) = u
            .lines()
            .find_map(|l| l.trim().strip_prefix("DEVNAME="))
            .filter(|n| !n.is_empty())
        {
            return Some(n.to_string());
        }
    }
    link_name(entry)
}

/// The first of `attrs` (relative to `dir`) that holds a number.
fn read_attr(dir: &Path, attrs: &[&str]) -> Option<u64> {
    attrs.iter().find_map(|a| read_u64(&dir.join(a)))
}

/// A sysfs number ([`devdax::parse_number`]).
fn read_u64(file: &Path) -> Option<u64> {
    devdax::parse_number(&std::fs::read_to_string(file).ok()?).ok()
}

/// The add gate (docs/lmcache-dax-behavior.md §9.5): whether mapping
/// `requested_bytes` of the probed path can work, checked before anything
/// is opened or mapped. The messages are the fork's for its three cases
/// (kmem, unbound, too small) and never contain the path.
///
/// - device-dax: `size_bytes` ≥ requested (past the end it would SIGBUS on
///   touch) and requested a multiple of `align_bytes` (else `mmap` fails
///   with `EINVAL`);
/// - regular file and tmpfs: at least `requested_bytes` long (the arena
///   maps an existing file as it is; it grows only files it creates);
/// - system-ram, unbound, another driver, not a device, absent, unknown:
///   refused, naming the class.
pub fn check_add(probe: &Probe, requested_bytes: u64) -> Result<(), String> {
    if requested_bytes == 0 {
        return Err("size_bytes must be > 0".into());
    }
    match probe.class {
        DeviceClass::DevDax => {
            let Some(size) = probe.size_bytes else {
                return Err("DAX device size is unknown (no sysfs size attribute)".into());
            };
            if size < requested_bytes {
                return Err(format!(
                    "DAX device size {size} < requested {requested_bytes}"
                ));
            }
            let align = probe
                .align_bytes
                .filter(|a| *a > 0)
                .unwrap_or(DEFAULT_DEVDAX_ALIGN_BYTES as u64);
            if !requested_bytes.is_multiple_of(align) {
                return Err(format!(
                    "requested size {requested_bytes} is not a multiple of the DAX device \
                     alignment {align} (mmap would fail with EINVAL)"
                ));
            }
            Ok(())
        }
        DeviceClass::RegularFile | DeviceClass::Tmpfs => {
            let size = probe.size_bytes.unwrap_or(0);
            if size < requested_bytes {
                return Err(format!(
                    "file size {size} < requested {requested_bytes} (an existing file is \
                     mapped as it is, never grown)"
                ));
            }
            Ok(())
        }
        DeviceClass::SystemRam => Err("DAX device is bound to kmem (system-ram)".into()),
        DeviceClass::Unbound => Err("DAX device has no device_dax driver bound".into()),
        DeviceClass::Unknown => Err(match &probe.driver {
            Some(d) => format!("DAX device is bound to {d}, not device_dax"),
            None => "failed to identify DAX device: the path cannot be inspected (unknown)".into(),
        }),
        DeviceClass::NotADevice => Err(
            "failed to identify DAX device: neither a DAX device nor a regular file \
             on tmpfs, hugetlbfs or a disk file system (not_a_device)"
                .into(),
        ),
        DeviceClass::Absent => {
            Err("failed to identify DAX device: nothing at the path (absent)".into())
        }
    }
}

/// The resize gate: whether the probed path can be mapped again at
/// `new_bytes`. The same device-side rules as [`check_add`], which is what
/// a remap needs: a device-dax grow past the device's end would map fine
/// and SIGBUS on touch (docs/lmcache-dax-behavior.md §4.5 item 7), a length
/// off the device's `align` fails with `EINVAL` (this holds for a shrink
/// too), a device rebound to kmem or unbound since the add cannot be
/// mapped, and a regular file is never grown past its length. The arena's
/// own limit (the largest size fixed at open) is checked by the remap
/// itself.
pub fn check_grow(probe: &Probe, new_bytes: u64) -> Result<(), String> {
    check_add(probe, new_bytes)
}

impl Probe {
    /// A readable table, one `field  value` line per JSON field.
    pub fn table(&self) -> String {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        let bytes = |v: Option<u64>| opt(v.map(|b| format!("{b} ({})", human(b))));
        let rows = [
            ("device_path", self.device_path.clone()),
            ("mode", self.class.to_string()),
            ("present", if self.present { "yes" } else { "no" }.into()),
            (
                "major:minor",
                opt(self.major.zip(self.minor).map(|(a, b)| format!("{a}:{b}"))),
            ),
            ("kernel_name", opt(self.kernel_name.clone())),
            ("driver", opt(self.driver.clone())),
            ("size_bytes", bytes(self.size_bytes)),
            ("align_bytes", bytes(self.align_bytes)),
            ("numa_node", opt(self.numa_node.map(|n| n.to_string()))),
            ("detail", self.detail.clone()),
        ];
        let mut out = String::new();
        for (k, v) in rows {
            // Writing into a String cannot fail.
            let _ = writeln!(out, "{k:<12} {v}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `Probe` of `class` with the given size and alignment.
    fn fake(class: DeviceClass, size: Option<u64>, align: Option<u64>) -> Probe {
        Probe {
            device_path: "/dev/secret-path".into(),
            class,
            present: class != DeviceClass::Absent,
            major: None,
            minor: None,
            kernel_name: None,
            driver: None,
            size_bytes: size,
            align_bytes: align,
            numa_node: None,
            detail: String::new(),
        }
    }

    #[test]
    fn class_names_match_their_json() {
        for c in [
            DeviceClass::DevDax,
            DeviceClass::SystemRam,
            DeviceClass::Unbound,
            DeviceClass::RegularFile,
            DeviceClass::Tmpfs,
            DeviceClass::NotADevice,
            DeviceClass::Unknown,
            DeviceClass::Absent,
        ] {
            let j = serde_json::to_value(c).unwrap();
            assert_eq!(j, serde_json::Value::from(c.as_str()));
            assert_eq!(serde_json::from_value::<DeviceClass>(j).unwrap(), c);
        }
    }

    #[test]
    fn numbers_parse_decimal_and_hex() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("n");
        for (text, want) in [
            ("2097152\n", Some(2 << 20)),
            ("0x200000\n", Some(2 << 20)),
            ("junk", None),
            ("", None),
        ] {
            std::fs::write(&f, text).unwrap();
            assert_eq!(read_u64(&f), want, "{text:?}");
        }
        assert_eq!(read_u64(&d.path().join("missing")), None);
    }

    #[test]
    fn devdax_gate_checks_size_then_alignment() {
        let mib = 1u64 << 20;
        let p = fake(DeviceClass::DevDax, Some(1 << 30), Some(2 * mib));
        assert_eq!(check_add(&p, 512 * mib), Ok(()));
        assert_eq!(check_add(&p, 1 << 30), Ok(()), "the whole device");
        assert_eq!(
            check_add(&p, 2 << 30),
            Err(format!(
                "DAX device size {} < requested {}",
                1u64 << 30,
                2u64 << 30
            ))
        );
        let e = check_add(&p, 3 * mib).unwrap_err();
        assert!(
            e.contains(&(3 * mib).to_string()) && e.contains(&(2 * mib).to_string()),
            "{e}"
        );
        assert!(e.contains("EINVAL"), "{e}");
        assert_eq!(check_add(&p, 0), Err("size_bytes must be > 0".into()));
        // Grow: the same rules.
        assert_eq!(check_grow(&p, 1 << 30), Ok(()));
        assert!(check_grow(&p, (1 << 30) + 2 * mib)
            .unwrap_err()
            .starts_with("DAX device size "));
        assert!(check_grow(&p, 5 * mib).unwrap_err().contains("EINVAL"));
        // No align attribute: the arena's default.
        let p = fake(DeviceClass::DevDax, Some(1 << 30), None);
        assert!(check_add(&p, 4096).unwrap_err().contains("2097152"));
        // No size attribute: refused (the arena needs it).
        let p = fake(DeviceClass::DevDax, None, Some(2 * mib));
        assert!(check_add(&p, 2 * mib).unwrap_err().contains("unknown"));
    }

    #[test]
    fn refusals_name_the_class_and_never_the_path() {
        let cases = [
            (
                DeviceClass::SystemRam,
                "DAX device is bound to kmem (system-ram)",
            ),
            (
                DeviceClass::Unbound,
                "DAX device has no device_dax driver bound",
            ),
            (DeviceClass::NotADevice, "not_a_device"),
            (DeviceClass::Absent, "absent"),
            (DeviceClass::Unknown, "unknown"),
        ];
        for (class, want) in cases {
            let p = fake(class, Some(1 << 30), Some(2 << 20));
            let e = check_add(&p, 2 << 20).unwrap_err();
            assert!(e.contains(want), "{class}: {e}");
            assert!(!e.contains("secret-path"), "{class} echoes the path: {e}");
            assert_eq!(check_grow(&p, 2 << 20).unwrap_err(), e);
        }
        let mut p = fake(DeviceClass::Unknown, None, None);
        p.driver = Some("dax_pmem".into());
        assert_eq!(
            check_add(&p, 4096),
            Err("DAX device is bound to dax_pmem, not device_dax".into())
        );
    }

    #[test]
    fn files_must_hold_the_request() {
        for class in [DeviceClass::RegularFile, DeviceClass::Tmpfs] {
            let p = fake(class, Some(1 << 20), Some(4096));
            assert_eq!(check_add(&p, 1 << 20), Ok(()));
            assert_eq!(check_add(&p, 12345), Ok(()), "no alignment rule for files");
            let e = check_add(&p, 2 << 20).unwrap_err();
            assert!(
                e.starts_with("file size 1048576 < requested 2097152"),
                "{e}"
            );
            assert_eq!(check_grow(&p, 2 << 20).unwrap_err(), e);
        }
    }

    #[test]
    fn table_lists_every_field() {
        let p = fake(DeviceClass::DevDax, Some(1 << 30), Some(2 << 20));
        let t = p.table();
        for k in [
            "device_path",
            "mode",
            "present",
            "major:minor",
            "kernel_name",
            "driver",
            "size_bytes",
            "align_bytes",
            "numa_node",
            "detail",
        ] {
            assert!(t.contains(k), "{k} missing from\n{t}");
        }
        assert!(t.contains("1073741824 (1 GiB)"), "{t}");
        assert!(t.contains("devdax"), "{t}");
    }
}
