//! `Engine::signal`: writes the engine's own completion eventfd while it is
//! open, and nothing once `close` has begun — not even into a file opened
//! afterwards under the number the closed eventfd had. Its own test binary
//! (one process, one test), so no other test takes that number first.

use std::os::fd::RawFd;

use daxkv::device::arena::ArenaSpec;
use daxkv::engine::{DeviceSpec, Engine, EngineOptions, TaskKind};
use daxkv::CoreConfig;

const SLOT: usize = 4096;

/// The eventfd's count, read (and so reset); 0 when it was not written.
fn take(fd: RawFd) -> u64 {
    let mut v = 0u64;
    // SAFETY: reads 8 bytes into a local from a non-blocking eventfd.
    let n = unsafe { libc::read(fd, std::ptr::addr_of_mut!(v).cast(), 8) };
    if n == 8 {
        v
    } else {
        0
    }
}

#[test]
fn signal_after_close_writes_nothing() {
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(4 * SLOT), SLOT),
    };
    let e = Engine::open(vec![dev], SLOT, false, EngineOptions::default()).unwrap();
    let fd = e.event_fd(TaskKind::Store);
    take(fd);
    assert_eq!(take(fd), 0, "nothing pending");

    // Open: the store fd is written, the others are not.
    assert!(e.signal(TaskKind::Store));
    assert_eq!(take(fd), 1);
    assert_eq!(take(e.event_fd(TaskKind::Load)), 0);

    e.close();
    // SAFETY: F_GETFD on an integer is harmless.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    assert_eq!(flags, -1, "close closed it");
    // Another file now answers to that number (as one would, opened by
    // any thread of the process after the close).
    // SAFETY: a fresh eventfd, moved onto the free number; both ours.
    let other = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    assert!(other >= 0);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::dup2(other, fd) }, fd);
    assert!(!e.signal(TaskKind::Store), "closed: nothing written");
    assert_eq!(take(fd), 0, "the file now at the old number was written");
    // SAFETY: closing the two fds this test opened.
    unsafe {
        libc::close(fd);
        libc::close(other);
    }
}
