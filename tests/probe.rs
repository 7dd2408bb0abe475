//! `daxkv::host::probe` and `daxkv probe`: classification of device paths from
//! `stat` and a FAKE sysfs tree (no DAX hardware needed), the add / resize
//! gates and their messages, and the real binary's table and JSON.
//!
//! A fake sysfs tree cannot create a character device with a DAX device's
//! numbers, so the probe takes `MAJ:MIN` from the path's `stat` and the
//! tests use a real character device every Linux machine has (`/dev/null`)
//! and put a DAX device's attributes under the fake root's
//! `dev/char/<null's MAJ:MIN>` entry.

use std::os::unix::fs::{symlink, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use daxkv::device::arena::{Arena, ArenaSource, ArenaSpec};
use daxkv::host::probe::{check_add, check_grow, probe, DeviceClass, Probe};
use daxkv::OpenError;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const NULL: &str = "/dev/null";

/// `/dev/null`'s major and minor numbers (1:3 on Linux).
fn null_numbers() -> (u32, u32) {
    let md = std::fs::metadata(NULL).unwrap();
    (libc::major(md.rdev()), libc::minor(md.rdev()))
}

/// A fake DAX device in the real kernel's layout: `dev/char/M:m` is a link
/// to `devices/platform/hmem.0/dax0.0`, whose `subsystem` and `driver` are
/// links into `bus/dax`; `attrs` are written into that directory.
fn fake_dax(root: &Path, driver: Option<&str>, attrs: &[(&str, &str)]) {
    let (maj, min) = null_numbers();
    let dev = root.join("devices/platform/hmem.0/dax0.0");
    std::fs::create_dir_all(&dev).unwrap();
    for d in ["device_dax", "kmem"] {
        std::fs::create_dir_all(root.join("bus/dax/drivers").join(d)).unwrap();
    }
    symlink("../../../../bus/dax", dev.join("subsystem")).unwrap();
    if let Some(d) = driver {
        symlink(
            format!("../../../../bus/dax/drivers/{d}"),
            dev.join("driver"),
        )
        .unwrap();
    }
    for (name, value) in attrs {
        std::fs::write(dev.join(name), format!("{value}\n")).unwrap();
    }
    std::fs::create_dir_all(root.join("dev/char")).unwrap();
    symlink(
        "../../devices/platform/hmem.0/dax0.0",
        root.join(format!("dev/char/{maj}:{min}")),
    )
    .unwrap();
}

/// A bound device-dax node: 1 GiB, 2 MiB aligned, memory on node 2 (a CXL
/// node), attached near node 0.
const DEVDAX_ATTRS: &[(&str, &str)] = &[
    ("size", "1073741824"),
    ("align", "2097152"),
    ("target_node", "2"),
    ("numa_node", "0"),
    ("uevent", "MAJOR=1\nMINOR=3\nDEVNAME=dax0.0"),
];

fn probe_fake(driver: Option<&str>, attrs: &[(&str, &str)]) -> Probe {
    let root = tempfile::tempdir().unwrap();
    fake_dax(root.path(), driver, attrs);
    probe(Path::new(NULL), root.path())
}

#[test]
fn devdax_is_classified_from_sysfs() {
    let p = probe_fake(Some("device_dax"), DEVDAX_ATTRS);
    let (maj, min) = null_numbers();
    assert_eq!(p.class, DeviceClass::DevDax, "{p:?}");
    assert!(p.present);
    assert_eq!((p.major, p.minor), (Some(maj), Some(min)));
    assert_eq!(p.kernel_name.as_deref(), Some("dax0.0"));
    assert_eq!(p.driver.as_deref(), Some("device_dax"));
    assert_eq!(p.size_bytes, Some(GIB));
    assert_eq!(p.align_bytes, Some(2 * MIB));
    assert_eq!(p.numa_node, Some(2), "target_node before numa_node");
    assert_eq!(p.device_path, NULL);
    assert!(p.detail.contains("device_dax"), "{}", p.detail);

    assert_eq!(check_add(&p, GIB), Ok(()));
    assert_eq!(check_add(&p, 512 * MIB), Ok(()));
    assert_eq!(
        check_add(&p, 2 * GIB),
        Err(format!("DAX device size {GIB} < requested {}", 2 * GIB))
    );
    let e = check_add(&p, 3 * MIB).unwrap_err();
    assert!(
        e.contains(&(3 * MIB).to_string()) && e.contains(&(2 * MIB).to_string()),
        "names both the request and the alignment: {e}"
    );
    assert!(check_grow(&p, GIB + 2 * MIB)
        .unwrap_err()
        .starts_with("DAX device size "));
    assert!(check_grow(&p, 1000 * MIB + 1)
        .unwrap_err()
        .contains("EINVAL"));
    assert_eq!(check_grow(&p, 1022 * MIB), Ok(()));
}

#[test]
fn kmem_and_unbound_are_refused_with_the_forks_messages() {
    let p = probe_fake(Some("kmem"), DEVDAX_ATTRS);
    assert_eq!(p.class, DeviceClass::SystemRam, "{p:?}");
    assert_eq!(p.driver.as_deref(), Some("kmem"));
    assert_eq!(p.size_bytes, Some(GIB));
    assert_eq!(
        check_add(&p, 2 * MIB),
        Err("DAX device is bound to kmem (system-ram)".into())
    );

    let p = probe_fake(None, DEVDAX_ATTRS);
    assert_eq!(p.class, DeviceClass::Unbound, "{p:?}");
    assert_eq!(p.driver, None);
    assert!(p.detail.contains("modprobe"), "{}", p.detail);
    assert_eq!(
        check_add(&p, 2 * MIB),
        Err("DAX device has no device_dax driver bound".into())
    );
    assert_eq!(
        check_grow(&p, 2 * MIB),
        Err("DAX device has no device_dax driver bound".into())
    );

    let p = probe_fake(Some("dax_pmem"), DEVDAX_ATTRS);
    assert_eq!(p.class, DeviceClass::Unknown, "{p:?}");
    assert_eq!(
        check_add(&p, 2 * MIB),
        Err("DAX device is bound to dax_pmem, not device_dax".into())
    );
}

#[test]
fn liberal_layouts_name_align_and_node() {
    // No uevent: the kernel name is the link's last component; target_node
    // -1 (none) falls back to numa_node; align only at the region.
    let root = tempfile::tempdir().unwrap();
    fake_dax(
        root.path(),
        Some("device_dax"),
        &[
            ("size", "0x40000000"),
            ("target_node", "-1"),
            ("numa_node", "1"),
        ],
    );
    std::fs::create_dir_all(root.path().join("devices/platform/hmem.0/dax_region")).unwrap();
    std::fs::write(
        root.path().join("devices/platform/hmem.0/dax_region/align"),
        "1073741824\n",
    )
    .unwrap();
    let p = probe(Path::new(NULL), root.path());
    assert_eq!(p.class, DeviceClass::DevDax);
    assert_eq!(p.kernel_name.as_deref(), Some("dax0.0"));
    assert_eq!(p.size_bytes, Some(GIB), "hex sizes parse");
    assert_eq!(p.numa_node, Some(1));
    assert_eq!(p.align_bytes, Some(GIB), "region align");
    assert!(check_add(&p, 2 * MIB).unwrap_err().contains("EINVAL"));

    // No align anywhere: the arena's default, said so in the detail.
    let p = probe_fake(Some("device_dax"), &[("size", "1073741824")]);
    assert_eq!(p.align_bytes, Some(2 * MIB));
    assert!(p.detail.contains("assuming 2 MiB"), "{}", p.detail);
    assert_eq!(p.numa_node, None);

    // An older / compat layout: a plain directory whose `device/` holds the
    // driver and size.
    let root = tempfile::tempdir().unwrap();
    let (maj, min) = null_numbers();
    let e = root.path().join(format!("dev/char/{maj}:{min}"));
    std::fs::create_dir_all(e.join("device")).unwrap();
    symlink("../../../class/dax", e.join("subsystem")).unwrap();
    symlink("../../bus/dax/drivers/device_dax", e.join("device/driver")).unwrap();
    std::fs::write(e.join("device/size"), "2147483648\n").unwrap();
    std::fs::write(e.join("device/align"), "4096\n").unwrap();
    std::fs::write(e.join("uevent"), "DEVNAME=dax3.1\n").unwrap();
    let p = probe(Path::new(NULL), root.path());
    assert_eq!(p.class, DeviceClass::DevDax, "{p:?}");
    assert_eq!(p.kernel_name.as_deref(), Some("dax3.1"));
    assert_eq!(p.size_bytes, Some(2 * GIB));
    assert_eq!(p.align_bytes, Some(4096));
}

#[test]
fn other_char_devices_are_not_devices() {
    // The real /dev/null under the real /sys: subsystem `mem` (or no entry
    // at all where /sys is not mounted).
    let p = probe(Path::new(NULL), Path::new("/sys"));
    assert_eq!(p.class, DeviceClass::NotADevice, "{p:?}");
    assert!(p.major.is_some());

    // A fake tree whose entry belongs to another subsystem.
    let root = tempfile::tempdir().unwrap();
    let (maj, min) = null_numbers();
    let e = root.path().join(format!("dev/char/{maj}:{min}"));
    std::fs::create_dir_all(&e).unwrap();
    symlink("../../../class/mem", e.join("subsystem")).unwrap();
    std::fs::write(e.join("uevent"), "DEVNAME=null\n").unwrap();
    let p = probe(Path::new(NULL), root.path());
    assert_eq!(p.class, DeviceClass::NotADevice);
    assert_eq!(p.kernel_name.as_deref(), Some("null"));
    assert!(p.detail.contains("subsystem mem"), "{}", p.detail);

    // No entry at all.
    let empty = tempfile::tempdir().unwrap();
    let p = probe(Path::new(NULL), empty.path());
    assert_eq!(p.class, DeviceClass::NotADevice);
    assert!(p.detail.contains("no entry"), "{}", p.detail);
    let e = check_add(&p, 2 * MIB).unwrap_err();
    assert!(e.contains("not_a_device"), "{e}");
}

/// Whether `dir` is on tmpfs, by `stat -f` (None when it cannot tell).
fn on_tmpfs(dir: &Path) -> Option<bool> {
    let out = Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(dir)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim() == "tmpfs")
}

#[test]
fn regular_files_and_tmpfs_files() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let f = dir.path().join("kv.img");
    std::fs::write(&f, vec![0u8; 8192]).unwrap();
    let p = probe(&f, Path::new("/nonexistent-sysfs"));
    let want = match on_tmpfs(dir.path()) {
        Some(true) => DeviceClass::Tmpfs,
        Some(false) => DeviceClass::RegularFile,
        None => p.class,
    };
    assert_eq!(p.class, want, "{p:?}");
    assert!(matches!(
        p.class,
        DeviceClass::RegularFile | DeviceClass::Tmpfs
    ));
    assert_eq!(p.size_bytes, Some(8192));
    assert!(p
        .align_bytes
        .is_some_and(|a| a >= 4096 && a.is_power_of_two()));
    assert_eq!((p.major, p.minor, p.numa_node), (None, None, None));
    assert_eq!(check_add(&p, 8192), Ok(()));
    assert_eq!(check_add(&p, 100), Ok(()), "files have no alignment rule");
    assert_eq!(
        check_add(&p, 16384),
        Err(
            "file size 8192 < requested 16384 (an existing file is mapped as it is, never grown)"
                .into()
        )
    );

    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("skipping the /dev/shm case: no /dev/shm on this machine");
        return;
    }
    let t = tempfile::Builder::new()
        .prefix("daxkv-probe")
        .tempfile_in(shm)
        .unwrap();
    t.as_file().set_len(4096).unwrap();
    let p = probe(t.path(), Path::new("/sys"));
    assert_eq!(p.class, DeviceClass::Tmpfs, "{p:?}");
    assert_eq!(p.size_bytes, Some(4096));
    assert!(p.detail.contains("tmpfs"), "{}", p.detail);
}

/// The gate refuses what the arena would refuse: a short existing file
/// (`FileTooSmall`), a device-dax length off its alignment (`Misaligned`)
/// or past its end (`DeviceTooSmall`), both checked by the arena from the
/// same fake sysfs before it opens anything.
#[test]
fn the_gate_agrees_with_the_arena() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("short");
    std::fs::write(&f, vec![0u8; 4096]).unwrap();
    let p = probe(&f, Path::new("/sys"));
    assert!(check_add(&p, 8192).is_err());
    let r = Arena::open(&ArenaSpec::new(ArenaSource::Path(f.clone()), 8192));
    assert!(matches!(r, Err(OpenError::FileTooSmall { .. })), "{r:?}");
    assert!(check_add(&p, 4096).is_ok());
    assert!(Arena::open(&ArenaSpec::new(ArenaSource::Path(f), 4096)).is_ok());

    let root = tempfile::tempdir().unwrap();
    fake_dax(root.path(), Some("device_dax"), DEVDAX_ATTRS);
    let p = probe(Path::new(NULL), root.path());
    let spec = |len: u64| {
        ArenaSpec::new(ArenaSource::Path(NULL.into()), len as usize).sysfs_root(root.path())
    };
    assert!(check_add(&p, 3 * MIB).is_err());
    let r = Arena::open(&spec(3 * MIB));
    assert!(matches!(r, Err(OpenError::Misaligned { .. })), "{r:?}");
    assert!(check_add(&p, 2 * GIB).is_err());
    let r = Arena::open(&spec(2 * GIB));
    assert!(matches!(r, Err(OpenError::DeviceTooSmall { .. })), "{r:?}");
}

#[test]
fn directories_fifos_sockets_and_missing_paths() {
    let dir = tempfile::tempdir().unwrap();
    let d = probe(dir.path(), Path::new("/sys"));
    assert_eq!(d.class, DeviceClass::NotADevice);
    assert!(d.present);
    assert!(d.detail.contains("directory"), "{}", d.detail);
    assert_eq!(d.size_bytes, None);

    let sock = dir.path().join("sock");
    let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let p = probe(&sock, Path::new("/sys"));
    assert_eq!(p.class, DeviceClass::NotADevice);
    assert!(p.detail.contains("socket"), "{}", p.detail);

    let fifo = dir.path().join("fifo");
    match Command::new("mkfifo").arg(&fifo).status() {
        Ok(s) if s.success() => {
            let p = probe(&fifo, Path::new("/sys"));
            assert_eq!(p.class, DeviceClass::NotADevice);
            assert!(p.detail.contains("fifo"), "{}", p.detail);
        }
        other => eprintln!("skipping the fifo case: mkfifo failed ({other:?})"),
    }

    let missing = dir.path().join("missing");
    let p = probe(&missing, Path::new("/sys"));
    assert_eq!(p.class, DeviceClass::Absent);
    assert!(!p.present);
    assert_eq!(p.size_bytes, None);
    let p = probe(&missing.join("below"), Path::new("/sys"));
    assert_eq!(p.class, DeviceClass::Absent);
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let p = probe(&file.join("below"), Path::new("/sys"));
    assert_eq!(p.class, DeviceClass::Absent, "ENOTDIR is absent: {p:?}");

    let dangling = dir.path().join("dangling");
    symlink(&missing, &dangling).unwrap();
    let p = probe(&dangling, Path::new("/sys"));
    assert_eq!(p.class, DeviceClass::Absent);
    assert!(p.detail.contains("dangling"), "{}", p.detail);

    let link = dir.path().join("link");
    symlink(&file, &link).unwrap();
    let p = probe(&link, Path::new("/sys"));
    assert!(matches!(
        p.class,
        DeviceClass::RegularFile | DeviceClass::Tmpfs
    ));
    assert!(p.detail.contains("symbolic link"), "{}", p.detail);
}

#[test]
fn add_gate_messages_never_echo_the_path() {
    let root = tempfile::tempdir().unwrap();
    let marker = "secret-marker-7f3a";
    let dir = root.path().join(marker);
    std::fs::create_dir(&dir).unwrap();
    let file = dir.join(format!("{marker}.img"));
    std::fs::write(&file, vec![0u8; 4096]).unwrap();
    let link = dir.join(format!("{marker}-null"));
    symlink(NULL, &link).unwrap();
    let sysfs = root.path().join("sysfs");
    for (driver, attrs) in [
        (Some("device_dax"), DEVDAX_ATTRS),
        (Some("kmem"), DEVDAX_ATTRS),
        (None, DEVDAX_ATTRS),
    ] {
        let _ = std::fs::remove_dir_all(&sysfs);
        fake_dax(&sysfs, driver, attrs);
        let p = probe(&link, &sysfs);
        assert_eq!(p.device_path, link.to_string_lossy());
        for req in [3 * MIB, 4 * GIB, 2 * MIB] {
            for r in [check_add(&p, req), check_grow(&p, req)] {
                if let Err(e) = r {
                    assert!(!e.contains(marker), "{:?}: {e}", p.class);
                    assert!(!e.contains("/dev/null"), "{:?}: {e}", p.class);
                }
            }
        }
    }
    for path in [dir.clone(), dir.join("missing"), file.clone(), link.clone()] {
        let p = probe(&path, &sysfs.join("none"));
        let e = check_add(&p, 8 * GIB).unwrap_err();
        assert!(!e.contains(marker), "{:?}: {e}", p.class);
        assert!(
            e.contains(p.class.as_str()) || e.starts_with("file size"),
            "{:?}: {e}",
            p.class
        );
    }
}

// ---- the binary ---------------------------------------------------------

fn daxkv(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_daxkv"))
        .args(args)
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The JSON keys of the fork's `physical` block (less `probed_at`).
const KEYS: [&str; 11] = [
    "device_path",
    "mode",
    "present",
    "major",
    "minor",
    "kernel_name",
    "driver",
    "size_bytes",
    "align_bytes",
    "numa_node",
    "detail",
];

fn parse(o: &Output) -> (serde_json::Value, Probe) {
    assert!(o.status.success(), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort_unstable();
    let mut want = KEYS.to_vec();
    want.sort_unstable();
    assert_eq!(keys, want);
    let p = serde_json::from_value(v.clone()).unwrap();
    (v, p)
}

#[test]
fn binary_probes_a_tmpfs_file_and_a_missing_path() {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
    };
    let t = tempfile::Builder::new()
        .prefix("daxkv-probe-bin")
        .tempfile_in(&base)
        .unwrap();
    t.as_file().set_len(2 << 20).unwrap();
    let path = t.path().to_str().unwrap();

    let o = daxkv(&["probe", path]);
    assert!(o.status.success(), "{o:?}");
    let table = stdout(&o);
    assert!(table.contains(path), "{table}");
    assert!(table.contains("2097152 (2 MiB)"), "{table}");
    let (v, p) = parse(&daxkv(&["probe", "--json", path]));
    if base == shm {
        assert_eq!(v["mode"], "tmpfs");
        assert!(table.contains("tmpfs"), "{table}");
    }
    assert_eq!(v["device_path"], path);
    assert_eq!(v["present"], true);
    assert_eq!(v["size_bytes"], 2 << 20);
    assert_eq!(v["major"], serde_json::Value::Null);
    assert_eq!(p.size_bytes, Some(2 * MIB));

    let missing = base.join("daxkv-probe-definitely-missing");
    let (v, p) = parse(&daxkv(&["probe", "--json", missing.to_str().unwrap()]));
    assert_eq!(v["mode"], "absent");
    assert_eq!(v["present"], false);
    assert_eq!(p.class, DeviceClass::Absent);
    let o = daxkv(&["probe", missing.to_str().unwrap()]);
    assert!(o.status.success(), "absent still exits 0: {o:?}");
    assert!(stdout(&o).contains("absent"));
}

#[test]
fn binary_reads_a_fake_sysfs_root() {
    let root = tempfile::tempdir().unwrap();
    fake_dax(root.path(), Some("device_dax"), DEVDAX_ATTRS);
    let fake_root = root.path().to_str().unwrap();
    let (v, p) = parse(&daxkv(&[
        "probe",
        "--json",
        "--sysfs-root",
        fake_root,
        NULL,
    ]));
    assert_eq!(v["mode"], "devdax");
    assert_eq!(v["kernel_name"], "dax0.0");
    assert_eq!(v["driver"], "device_dax");
    assert_eq!(v["size_bytes"], GIB);
    assert_eq!(v["align_bytes"], 2 * MIB);
    assert_eq!(v["numa_node"], 2);
    assert_eq!(p.class, DeviceClass::DevDax);
    let table = stdout(&daxkv(&["probe", "--sysfs-root", fake_root, NULL]));
    assert!(
        table.contains("devdax") && table.contains("dax0.0"),
        "{table}"
    );

    let help = stdout(&daxkv(&["probe", "--help"]));
    assert!(!help.contains("sysfs-root"), "hidden option: {help}");
}

#[test]
fn binary_usage_errors_exit_nonzero() {
    let o = daxkv(&["probe"]);
    assert!(!o.status.success(), "missing PATH: {o:?}");
    let o = daxkv(&["probe", "--bogus", "/dev/null"]);
    assert!(!o.status.success(), "unknown flag: {o:?}");
}

/// Pseudo-files: regular files on sysfs and procfs are
/// `not_a_device` to the probe and refused by the arena's open before
/// anything is mapped (by `statfs` of the path, then `fstatfs` of the
/// opened descriptor), with an error naming the path and the file system;
/// the engine's open refuses them the same way. Read-only and harmless
/// files are used, so a broken check cannot write into kernel state. A
/// tmpfs file is still accepted.
///
/// Without the allow-list the probe would call them `regular_file` (and
/// `add` would open them read-write and map them shared); the arena would
/// fail later, with `EACCES` / a too-small file, not naming the file
/// system.
#[test]
fn sysfs_and_procfs_pseudo_files_are_refused() {
    use daxkv::engine::{DeviceSpec, Engine, EngineOptions};
    use daxkv::CoreConfig;
    let cases = [
        (
            "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size",
            "sysfs",
        ),
        ("/sys/kernel/profiling", "sysfs"),
        ("/proc/self/status", "procfs"),
        ("/proc/self/comm", "procfs"),
    ];
    let mut tried = 0;
    for (path, fs) in cases {
        let p = Path::new(path);
        if !p.is_file() {
            eprintln!("skipping {path}: not on this machine");
            continue;
        }
        tried += 1;
        let pr = probe(p, Path::new("/sys"));
        assert_eq!(pr.class, DeviceClass::NotADevice, "{path}: {pr:?}");
        assert!(pr.detail.contains(fs), "{path}: {}", pr.detail);
        let e = check_add(&pr, 4096).unwrap_err();
        assert!(e.contains("not_a_device"), "{e}");
        for source in [
            ArenaSource::Path(p.into()),
            ArenaSource::CreateFile(p.into()),
        ] {
            let r = Arena::open(&ArenaSpec::new(source.clone(), 4096));
            let Err(OpenError::FileSystem {
                path: got,
                fs: name,
            }) = &r
            else {
                panic!("{source:?}: {r:?}");
            };
            assert_eq!(got, p);
            assert!(name.contains(fs), "{name}");
            let msg = r.unwrap_err().to_string();
            assert!(msg.contains(path) && msg.contains(fs), "{msg}");
        }
        let dev = DeviceSpec {
            path: path.into(),
            core: CoreConfig::new(ArenaSpec::new(ArenaSource::Path(p.into()), 4096), 4096),
        };
        let e = Engine::open(vec![dev.clone()], 4096, true, EngineOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains(path) && e.contains(fs), "{e}");
        let engine = Engine::open(vec![], 4096, true, EngineOptions::default()).unwrap();
        let e = engine.add_device(&dev).unwrap_err().to_string();
        assert!(e.contains(fs), "{e}");
        assert!(engine.devices().is_empty());
    }
    assert!(tried > 0, "no sysfs / procfs file to try on this machine");

    // A tmpfs file is still a device.
    if Path::new("/dev/shm").is_dir() {
        let t = tempfile::Builder::new()
            .prefix("daxkv-probe")
            .tempfile_in("/dev/shm")
            .unwrap();
        t.as_file().set_len(8192).unwrap();
        assert_eq!(probe(t.path(), Path::new("/sys")).class, DeviceClass::Tmpfs);
        Arena::open(&ArenaSpec::new(ArenaSource::Path(t.path().into()), 8192)).unwrap();
    }
}
