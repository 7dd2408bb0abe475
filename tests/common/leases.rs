//! Shared by the engine lease and observer tests (`lease_engine`,
//! `lease_review`, `lease_review_resize`, `observer_engine`; included with
//! `#[path]`, not a test crate): keys, memfd devices, an engine over them,
//! leases taken or panicking, and loads and stores by task.
#![allow(dead_code)]

use std::time::Duration;

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceSpec, Engine, EngineLeased, EngineOptions, EngineStoreLease};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key};

pub const SLOT: usize = 4096;
pub const T: Duration = Duration::from_secs(20);

pub fn k(i: u64) -> Key {
    Key::digest(&i.to_le_bytes())
}

/// A memfd device of `slots` slots named `name`, that may grow to four
/// times that.
pub fn memfd_named(name: &str, slots: usize) -> DeviceSpec {
    DeviceSpec {
        path: name.into(),
        core: CoreConfig::new(
            ArenaSpec::memfd(slots * SLOT).max_size_bytes(4 * slots * SLOT),
            SLOT,
        ),
    }
}

/// An engine (hotplug on) over one memfd device per entry of `devs`, of
/// that many slots.
pub fn engine(devs: &[usize]) -> Engine {
    Engine::open(
        devs.iter()
            .enumerate()
            .map(|(i, &s)| memfd_named(&format!("memfd:dev{i}"), s))
            .collect(),
        SLOT,
        true,
        EngineOptions::default(),
    )
    .unwrap()
}

/// A lease for each key, each expected to be given.
pub fn lease(e: &Engine, keys: &[Key], len: usize) -> Vec<EngineStoreLease> {
    let lens = vec![len; keys.len()];
    e.lease_store(keys, &lens)
        .unwrap()
        .into_iter()
        .map(|r| match r {
            Ok(EngineLeased::Leased(l)) => l,
            other => panic!("no lease: {other:?}"),
        })
        .collect()
}

/// Fill a store lease with `byte` through its pointer, as a copy engine
/// would.
pub fn fill(l: &EngineStoreLease, byte: u8) {
    // SAFETY: a store lease hands out `len()` writable bytes at `ptr()`
    // until it ends; nothing else touches them meanwhile.
    unsafe { std::ptr::write_bytes(l.ptr(), byte, l.len()) };
}

/// `key`'s bytes through a load task, `None` on a miss.
pub fn load(e: &Engine, key: Key) -> Option<Vec<u8>> {
    let id = e.submit_load(vec![key], vec![vec![0u8; SLOT]]).unwrap();
    let r = e.wait_load(id, T).ready().unwrap();
    r.bitmap
        .test(0)
        .then(|| r.bufs[0][..r.lens.get(0)].to_vec())
}

/// Store each key (1000 bytes of `byte`) by its own task: whether each
/// succeeded.
pub fn store(e: &Engine, keys: Vec<Key>, byte: u8) -> Vec<bool> {
    keys.into_iter()
        .map(|key| {
            let id = e
                .submit_store(vec![key], vec![Buf::Vec(vec![byte; 1000])])
                .unwrap();
            e.wait_store(id, T).ready().unwrap().success
        })
        .collect()
}
