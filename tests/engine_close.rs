//! Engine close: waits for in-flight work, closes the eventfds, joins the
//! workers. Its own test binary (one process, one test), so no other test
//! reuses the closed fd numbers before they are checked.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceId, DeviceSpec, Engine, EngineError, EngineOptions, Refused};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, Key};

const SLOT: usize = 4096;
const T: Duration = Duration::from_secs(10);

fn k(i: u32) -> Key {
    Key::digest(&i.to_le_bytes())
}

fn payload(i: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u32).wrapping_mul(7).wrapping_add(i * 13) as u8)
        .collect()
}

fn fd_is_open(fd: RawFd) -> bool {
    // SAFETY: fcntl(F_GETFD) on any integer is harmless.
    unsafe { libc::fcntl(fd, libc::F_GETFD) != -1 }
}

#[path = "common/threads.rs"]
mod count;
use count::threads;

/// docs/lmcache-dax-behavior.md §8.1 item 17: close blocks until in-flight work
/// finishes (here a read borrowed on the device); §8.3 item 1: the fds are
/// invalid afterwards.
#[test]
fn close_waits_for_in_flight_work_and_closes_fds() {
    let before = threads();
    let dev_spec = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(4 * SLOT), SLOT),
    };
    let e = Arc::new(Engine::open(vec![dev_spec], SLOT, false, EngineOptions::default()).unwrap());
    assert!(threads() > before, "workers started");
    let sid = e
        .submit_store(vec![k(1)], vec![Buf::from(payload(1, SLOT))])
        .unwrap();
    assert_eq!(
        e.wait_stores(T),
        vec![(
            sid,
            daxkv::engine::StoreResult {
                success: true,
                bytes_transferred: SLOT as u64
            }
        )]
    );
    let dev = e.raw_device(DeviceId(0)).unwrap();
    let id = e.submit_load(vec![k(1)], vec![vec![0; SLOT]]).unwrap();
    let fds = e.event_fds();
    // In-flight work on the device: a guard on its mapping, as a borrowed
    // read holds one.
    let set = dev.raw_guard().unwrap();
    let closed = Arc::new(AtomicBool::new(false));
    let t = {
        let (e, closed) = (e.clone(), closed.clone());
        std::thread::spawn(move || {
            e.close();
            closed.store(true, Ordering::SeqCst);
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !closed.load(Ordering::SeqCst),
        "close returned while a read was borrowed"
    );
    drop(set);
    t.join().unwrap();
    let r = e.query_load(id).ready();
    if let Some(r) = r {
        assert_eq!(
            r.bufs[0],
            payload(1, SLOT),
            "the load settled with its bytes"
        );
    }
    for fd in fds {
        assert!(!fd_is_open(fd), "fd {fd} still open after close");
    }
    assert!(matches!(
        e.submit_lookup_and_lock(vec![k(1)]),
        Err(Refused {
            error: EngineError::Closing,
            ..
        })
    ));
    e.close(); // idempotent
}
