//! `add` with `create` through the engine's API: where a file may be made,
//! that a failed add removes the file it made and no other, and what a
//! created file under the name of a live device gets. The HTTP and CLI
//! faces of the same rules are in `tests/serve_ops.rs`.

use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceSpec, Engine, EngineOptions, HotplugError};
use daxkv::CoreConfig;

const SLOT: usize = 64 << 10;
const SIZE: usize = 16 * SLOT;

fn engine() -> Engine {
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(16 * SLOT), SLOT),
    };
    Engine::open(vec![dev], SLOT, true, EngineOptions::default()).unwrap()
}

fn shm_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("daxkv-create-")
        .tempdir_in("/dev/shm")
        .unwrap()
}

fn add(
    e: &Engine,
    p: &Path,
    gate: impl FnOnce(&Path, usize) -> Result<(), String>,
) -> Result<usize, HotplugError> {
    e.hotplug_add_or_create(p.to_str().unwrap(), SIZE, None, true, gate)
        .map(|(index, _)| index)
}

fn create_message(r: Result<usize, HotplugError>) -> String {
    match r {
        Err(HotplugError::Create(m)) => m,
        other => panic!("expected a create refusal, got {other:?}"),
    }
}

/// A created file has its size and its blocks (a sparse file would let
/// two creates that each fit the space left both succeed).
#[test]
fn a_created_file_has_its_blocks_reserved() {
    let e = engine();
    let dir = shm_dir();
    let p = dir.path().join("kv");
    add(&e, &p, |_, _| Ok(())).unwrap();
    let md = std::fs::metadata(&p).unwrap();
    assert_eq!(md.len(), SIZE as u64);
    assert!(md.blocks() * 512 >= SIZE as u64, "{} blocks", md.blocks());
    e.close();
}

/// An add refused after its file was made removes that file, and only
/// that file: one put in its place meanwhile (another inode under the same
/// name) is left alone. Without the inode check the second file is
/// deleted.
#[test]
fn a_failed_add_removes_the_file_it_made_and_no_other() {
    let e = engine();
    let dir = shm_dir();
    let p = dir.path().join("kv");
    let err = add(&e, &p, |_, _| Err("refused by the gate".into())).unwrap_err();
    assert!(err.to_string().contains("refused by the gate"), "{err}");
    assert!(!p.exists(), "the file this add made was left");

    // The gate runs after the create: it swaps the file for another.
    let swapped = add(&e, &p, |path, _| {
        std::fs::remove_file(path).unwrap();
        std::fs::write(path, b"not the server's").unwrap();
        Err("refused by the gate".into())
    });
    assert!(swapped.is_err());
    assert_eq!(
        std::fs::read(&p).unwrap(),
        b"not the server's",
        "a file the server did not make was removed"
    );
    e.close();
}

/// Files are made only in real directories under /dev/shm or
/// /dev/hugepages: a path elsewhere, or a symlinked directory that leads
/// out of them, is refused and nothing is made at the link's target.
#[test]
fn create_makes_files_only_under_the_memory_roots() {
    let e = engine();
    let outside = tempfile::Builder::new()
        .prefix("daxkv-create-")
        .tempdir_in(std::env::temp_dir())
        .unwrap();
    let m = create_message(add(&e, &outside.path().join("kv"), |_, _| Ok(())));
    assert!(m.contains("only under /dev/shm or /dev/hugepages"), "{m}");
    assert!(!outside.path().join("kv").exists());

    let dir = shm_dir();
    let link = dir.path().join("sw");
    std::os::unix::fs::symlink(outside.path(), &link).unwrap();
    let m = create_message(add(&e, &link.join("victim"), |_, _| Ok(())));
    assert!(m.contains(&outside.path().display().to_string()), "{m}");
    assert!(
        !outside.path().join("victim").exists(),
        "made through the link"
    );

    // A symlink as the file's own name is never followed.
    let target = outside.path().join("target");
    std::os::unix::fs::symlink(&target, dir.path().join("kv")).unwrap();
    assert!(add(&e, &dir.path().join("kv"), |_, _| Ok(())).is_err());
    assert!(!target.exists(), "made through a symlink");
    e.close();
}

/// A live device whose file was deleted keeps its name: an add with
/// create of that path makes a new file, which is refused (the device
/// maps another) and removed, not left as an orphan that no device maps.
#[test]
fn a_created_file_under_a_live_devices_name_is_refused_and_removed() {
    let e = engine();
    let dir = shm_dir();
    let p = dir.path().join("kv");
    let index = add(&e, &p, |_, _| Ok(())).unwrap();
    std::fs::remove_file(&p).unwrap();
    let m = create_message(add(&e, &p, |_, _| Ok(())));
    assert!(
        m.contains(&format!(
            "device {index} maps a file that is no longer at this path"
        )),
        "{m}"
    );
    assert!(!p.exists(), "an orphan file was left");
    e.close();
}

/// Control and bidirectional-formatting characters in a device path are
/// refused before anything is made: they would forge log lines or garble
/// the operator's terminal.
#[test]
fn control_characters_in_a_path_are_refused() {
    let e = engine();
    let dir = shm_dir();
    // Also the ones that print as nothing: `kv\u{AD}0` shows as `kv0` (a
    // review found the soft hyphen, tag characters, the Mongolian vowel
    // separator, interlinear annotation marks, the Hangul filler and the
    // combining grapheme joiner accepted).
    for bad in [
        "a\nb",
        "a\u{1b}[2Jb",
        "a\u{202e}b",
        "kv\u{AD}0",
        "kv\u{E0061}0",
        "kv\u{180E}0",
        "kv\u{FFF9}0",
        "kv\u{3164}0",
        "kv\u{34F}0",
        "kv\u{FE0F}0",
    ] {
        let p = dir.path().join(bad);
        match add(&e, &p, |_, _| Ok(())) {
            Err(HotplugError::Invalid(m)) => assert!(m.contains("control"), "{m}"),
            other => panic!("{bad:?}: {other:?}"),
        }
        assert!(!p.exists());
    }
    e.close();
}

/// `/health`'s verdict: a device whose mapping is being resized takes
/// stores again once the remap is done (stores wait for it), so the
/// engine stays healthy; a draining one does not, and the reason names
/// the device and its state.
#[test]
fn health_counts_a_resizing_device_as_serving() {
    use daxkv::engine::DeviceState;
    let e = engine();
    let id = e.devices()[0].id;
    assert_eq!(e.health(), Ok(None));
    e.set_device_state(id, DeviceState::Resizing).unwrap();
    assert_eq!(e.health(), Ok(None), "a resize is not an outage");
    e.set_device_state(id, DeviceState::Draining).unwrap();
    assert_eq!(
        e.health(),
        Err("no device can take a store: device 0 (memfd) is draining (add one)".into())
    );
    e.set_device_state(id, DeviceState::Active).unwrap();
    e.close();
}

/// The arena maps the file the add made, not whatever the path names by
/// the time it opens it: a spec that expects one inode refuses another.
#[test]
fn an_arena_that_expects_a_file_refuses_another_at_its_path() {
    use daxkv::device::arena::{Arena, ArenaSource};
    let dir = shm_dir();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for p in [&a, &b] {
        std::fs::File::create(p)
            .unwrap()
            .set_len(SIZE as u64)
            .unwrap();
    }
    let md = std::fs::metadata(&b).unwrap();
    let spec = ArenaSpec::new(ArenaSource::Path(a.clone()), SIZE).expect_file(md.dev(), md.ino());
    let err = Arena::open(&spec).unwrap_err().to_string();
    assert!(err.contains("no longer the one just created"), "{err}");
    let ok = ArenaSpec::new(ArenaSource::Path(b.clone()), SIZE).expect_file(md.dev(), md.ino());
    assert!(Arena::open(&ok).is_ok());
}

/// `create` of a path where a file already is takes it only if it could
/// be this server's own: one writable by others, or with a second link,
/// is refused (a local user put it there first); without `create` the
/// operator's add of an existing file is as before.
#[test]
fn create_refuses_a_file_someone_else_put_there() {
    use std::os::unix::fs::PermissionsExt as _;
    let e = engine();
    let dir = shm_dir();
    let squat = dir.path().join("squat");
    std::fs::File::create(&squat)
        .unwrap()
        .set_len(SIZE as u64)
        .unwrap();
    std::fs::set_permissions(&squat, std::fs::Permissions::from_mode(0o666)).unwrap();
    let m = create_message(add(&e, &squat, |_, _| Ok(())));
    assert!(m.contains("did not make") && m.contains("mode 666"), "{m}");
    assert!(squat.exists(), "the refusal removed someone's file");

    let linked = dir.path().join("linked");
    std::fs::File::create(&linked)
        .unwrap()
        .set_len(SIZE as u64)
        .unwrap();
    std::fs::hard_link(&linked, dir.path().join("other-name")).unwrap();
    let m = create_message(add(&e, &linked, |_, _| Ok(())));
    assert!(m.contains("2 links"), "{m}");

    // Without create, an existing file is the operator's to add.
    std::fs::set_permissions(&squat, std::fs::Permissions::from_mode(0o600)).unwrap();
    let r = e.hotplug_add_or_create(squat.to_str().unwrap(), SIZE, None, false, |_, _| Ok(()));
    assert!(r.is_ok(), "{r:?}");
    // And an add run again with create answers with the device it made.
    let p = dir.path().join("kv");
    let first = add(&e, &p, |_, _| Ok(())).unwrap();
    assert_eq!(add(&e, &p, |_, _| Ok(())).unwrap(), first);
    e.close();
}

/// `create` needs an absolute path ending in a file name: `a/`, `a/.`
/// and relative paths are refused before anything is made.
#[test]
fn create_needs_an_absolute_path_to_a_file_name() {
    let e = engine();
    let dir = shm_dir();
    let base = dir.path().display().to_string();
    for bad in [
        format!("{base}/a/"),
        format!("{base}/b/."),
        "relative-kv".to_string(),
    ] {
        let m = create_message(
            e.hotplug_add_or_create(&bad, SIZE, None, true, |_, _| Ok(()))
                .map(|(i, _)| i),
        );
        assert!(
            m.contains("absolute path that ends in a file name"),
            "{bad}: {m}"
        );
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "something was made"
    );
    e.close();
}

/// Config files go through the same path check as an add.
#[test]
fn a_config_device_path_with_control_characters_is_refused() {
    for bad in [
        "/dev/shm/a\u{1b}[2J",
        "/dev/shm/a\u{202e}b",
        "/dev/shm/a\u{200b}b",
        "/dev/shm/a\u{2028}b",
    ] {
        let json = serde_json::json!({"type": "dax", "slot_bytes": SLOT,
            "devices": [{"device_path": bad, "max_dax_size_gb": 1}]});
        let err = daxkv::control::config::EngineConfig::from_json(&json.to_string())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("device_path") && err.contains("control"),
            "{bad:?}: {err}"
        );
    }
}
