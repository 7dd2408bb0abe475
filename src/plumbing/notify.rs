//! # Eventfd notifier
//!
//! A non-blocking, close-on-exec eventfd: the pollable completion signal of the
//! engine (LMCache's adapter contract, docs/lmcache-dax-behavior.md §1.4).
//! Signalling is binary and coalescing: `notify` adds one, `drain` reads the
//! counter back to zero. Both are safe to call from any thread.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// An eventfd (`EFD_NONBLOCK | EFD_CLOEXEC`). Closed on drop.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
    /// Writes still to fail (the `failpoints` feature: an eventfd write
    /// that fails).
    #[cfg(feature = "failpoints")]
    fail_writes: std::sync::atomic::AtomicU32,
}

impl EventFd {
    /// A fresh eventfd with its counter at 0.
    ///
    /// # Errors
    /// The OS error of `eventfd(2)` (e.g. `EMFILE` when out of fds).
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd takes no pointers; a negative return is an error.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(EventFd {
            fd,
            #[cfg(feature = "failpoints")]
            fail_writes: std::sync::atomic::AtomicU32::new(0),
        })
    }

    /// Fault hook (the `failpoints` feature): the next `n` calls of
    /// [`EventFd::notify`] fail with `EIO` and write nothing.
    #[cfg(feature = "failpoints")]
    pub fn inject_write_failures(&self, n: u32) {
        // ORDERING: Relaxed — a test knob.
        self.fail_writes
            .store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Signal: add one to the counter. A full counter (2^64 − 2) already
    /// signals, so EAGAIN is success.
    pub fn notify(&self) -> io::Result<()> {
        #[cfg(feature = "failpoints")]
        if self
            .fail_writes
            // ORDERING: Relaxed — a test knob; which write fails is any
            // fine choice.
            .fetch_update(
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
                |n| n.checked_sub(1),
            )
            .is_ok()
        {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own fd.
        let n = unsafe { libc::write(self.fd.as_raw_fd(), std::ptr::from_ref(&one).cast(), 8) };
        if n == 8 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::WouldBlock {
            Ok(())
        } else {
            Err(e)
        }
    }

    /// Read and reset the counter; 0 if it was not signalled.
    pub fn drain(&self) -> io::Result<u64> {
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live u64 from our own fd.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), std::ptr::from_mut(&mut v).cast(), 8) };
        if n == 8 {
            return Ok(v);
        }
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::WouldBlock {
            Ok(0)
        } else {
            Err(e)
        }
    }

    /// Wait until readable or `timeout` passes; true if readable. Does not
    /// drain.
    pub fn wait(&self, timeout: Duration) -> io::Result<bool> {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        loop {
            // SAFETY: one live pollfd.
            let n = unsafe { libc::poll(&raw mut p, 1, ms) };
            if n >= 0 {
                return Ok(n > 0 && p.revents & libc::POLLIN != 0);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notify_coalesces_and_drain_resets() {
        let e = EventFd::new().unwrap();
        assert!(!e.wait(Duration::ZERO).unwrap());
        assert_eq!(
            e.drain().unwrap(),
            0,
            "non-blocking read of an unsignalled fd"
        );
        e.notify().unwrap();
        e.notify().unwrap();
        assert!(e.wait(Duration::ZERO).unwrap());
        assert_eq!(e.drain().unwrap(), 2);
        assert!(!e.wait(Duration::from_millis(1)).unwrap());
    }

    #[test]
    fn flags_are_nonblock_and_cloexec() {
        let e = EventFd::new().unwrap();
        // SAFETY: fcntl queries on our own live fd.
        let (fl, fd) = unsafe {
            (
                libc::fcntl(e.as_raw_fd(), libc::F_GETFL),
                libc::fcntl(e.as_raw_fd(), libc::F_GETFD),
            )
        };
        assert!(fl & libc::O_NONBLOCK != 0);
        assert!(fd & libc::FD_CLOEXEC != 0);
    }

    #[test]
    fn wakes_a_waiter_on_another_thread() {
        let e = std::sync::Arc::new(EventFd::new().unwrap());
        let e2 = e.clone();
        let t = std::thread::spawn(move || e2.wait(Duration::from_secs(10)).unwrap());
        std::thread::sleep(Duration::from_millis(20));
        e.notify().unwrap();
        assert!(t.join().unwrap());
    }
}
