//! `close` with another thread parked in `wait_lookup` closes the eventfds
//! before it returns and wakes the waiter, which returns at once. A waiter
//! that held the pools (which own the fds) while it slept would keep the
//! fds open until its timeout ended.
//!
//! Its own test binary (one process, one test), so no other test reuses
//! the closed fd numbers before they are checked.

use std::os::fd::RawFd;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceSpec, Engine, EngineOptions};
use daxkv::{CoreConfig, Key};

const SLOT: usize = 4096;
const T: Duration = Duration::from_secs(10);
/// The waiter's own timeout: far longer than the test may take.
const LONG: Duration = Duration::from_secs(120);

fn fd_is_open(fd: RawFd) -> bool {
    // SAFETY: fcntl(F_GETFD) on any integer is harmless.
    unsafe { libc::fcntl(fd, libc::F_GETFD) != -1 }
}

#[test]
fn close_closes_the_fds_and_wakes_a_parked_waiter() {
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(4 * SLOT), SLOT),
    };
    let opts = EngineOptions {
        wait_spin: Duration::ZERO,
        ..EngineOptions::default()
    };
    let e = Arc::new(Engine::open(vec![dev], SLOT, false, opts).unwrap());
    let fds = e.event_fds();
    // A lookup collected once: waiting for it again waits until woken.
    let id = e.submit_lookup_and_lock(vec![Key::from_u128(1)]).unwrap();
    assert!(e.wait_lookup(id, T).ready().is_some());
    let (parked_tx, parked_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let waiter = {
        let e = e.clone();
        std::thread::spawn(move || {
            parked_tx.send(()).unwrap();
            let r = e.wait_lookup(id, LONG).ready();
            done_tx.send(r.is_none()).unwrap();
        })
    };
    parked_rx.recv().unwrap();
    // Let the waiter reach its eventfd (not required for the claim: close
    // must work wherever the waiter is).
    std::thread::sleep(Duration::from_millis(50));
    e.close();
    for fd in fds {
        assert!(!fd_is_open(fd), "fd {fd} still open after close returned");
    }
    // Hang guard, not a timing assertion: a woken waiter returns at once,
    // a broken one only after LONG.
    let none = done_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the waiter was not woken by close");
    assert!(none, "nothing to hand out after close");
    waiter.join().unwrap();
}
