//! Thin syscall wrappers (the only `unsafe` outside `arena` and `copy`).

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::FromRawFd;

/// `memfd_create(name, MFD_CLOEXEC)`.
pub(crate) fn memfd_create(name: &str) -> io::Result<File> {
    let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `cname` is a valid NUL-terminated string that outlives the call.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by no one else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Major and minor numbers of a device number.
pub(crate) fn major_minor(rdev: u64) -> (u32, u32) {
    (libc::major(rdev), libc::minor(rdev))
}
