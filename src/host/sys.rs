//! # Thin syscall wrappers
//!
//! `memfd_create` and seals, device numbers, `statfs`, thread affinity, the
//! process's CPU time, the page size and `SIGPIPE`: each a safe function
//! around one libc call. The host layer's only unsafe code (the layer rule, docs/design.md §3).

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};

/// `memfd_create(name, MFD_CLOEXEC)`.
pub(crate) fn memfd_create(name: &str) -> io::Result<File> {
    memfd_create_with(name, libc::MFD_CLOEXEC)
}

/// `memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING)`: a memfd that
/// [`add_seals`] can seal (memory shared with another process).
pub(crate) fn memfd_create_sealable(name: &str) -> io::Result<File> {
    memfd_create_with(name, libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
}

fn memfd_create_with(name: &str, flags: libc::c_uint) -> io::Result<File> {
    let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `cname` is a valid NUL-terminated string that outlives the call.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by no one else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// `fcntl(F_ADD_SEALS, seals)` (`libc::F_SEAL_*` bits).
pub(crate) fn add_seals(file: &File, seals: libc::c_int) -> io::Result<()> {
    // SAFETY: fcntl on a live fd we borrow; F_ADD_SEALS takes an int, no
    // pointers.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `fcntl(F_GET_SEALS)`: the file's seals (a memfd created without
/// `MFD_ALLOW_SEALING` reports `F_SEAL_SEAL` only); 0 for a kind of file
/// that has no seals.
pub(crate) fn seals(file: &File) -> io::Result<libc::c_int> {
    // SAFETY: fcntl on a live fd we borrow; F_GET_SEALS takes no argument.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if r >= 0 {
        return Ok(r);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EINVAL) {
        // Not a sealable kind of file: no seals.
        return Ok(0);
    }
    Err(e)
}

/// Major and minor numbers of a device number.
pub(crate) fn major_minor(rdev: u64) -> (u32, u32) {
    (libc::major(rdev), libc::minor(rdev))
}

/// `statfs(path)`: nothing is opened.
fn statfs(path: &std::path::Path) -> io::Result<libc::statfs> {
    let cpath = c_name(path.as_os_str())?;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `cpath` is a valid NUL-terminated string that outlives the
    // call; `st` is writable memory of the right size, filled by the kernel
    // on success.
    let r = unsafe { libc::statfs(cpath.as_ptr(), st.as_mut_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statfs returned 0, so it initialized `st`.
    Ok(unsafe { st.assume_init() })
}

/// `statfs(path)`: the bytes an unprivileged user may still write on the
/// file system holding `path` (`f_bavail × f_bsize`). Nothing is opened.
pub(crate) fn fs_available_bytes(path: &std::path::Path) -> io::Result<u64> {
    let st = statfs(path)?;
    #[allow(clippy::unnecessary_cast)] // the field types differ across targets
    Ok((st.f_bavail as u64).saturating_mul(st.f_bsize as u64))
}

/// `statfs(path).f_type`: the magic number of the file system holding
/// `path` (e.g. `libc::TMPFS_MAGIC`). Path-based: nothing is opened.
pub(crate) fn fs_magic(path: &std::path::Path) -> io::Result<i64> {
    let st = statfs(path)?;
    #[allow(clippy::unnecessary_cast)] // `__fsword_t` differs across targets
    Ok(st.f_type as i64)
}

/// `fstatfs(fd).f_type`: [`fs_magic`] of an opened file (the check that
/// cannot be raced by renaming the path between the check and the open).
pub(crate) fn fs_magic_fd(file: &File) -> io::Result<i64> {
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `file` owns an open fd for the duration of the call; `st` is
    // writable memory of the right size, filled by the kernel on success.
    let r = unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstatfs returned 0, so it initialized `st`.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)] // `__fsword_t` differs across targets
    Ok(st.f_type as i64)
}

/// `name` as a C string (`InvalidInput` for a name with a NUL byte).
fn c_name(name: &std::ffi::OsStr) -> io::Result<CString> {
    use std::os::unix::ffi::OsStrExt as _;
    CString::new(name.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// `openat(dir, name, O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW | O_CLOEXEC,
/// mode)`: a new regular file in the directory `dir` is open on, never an
/// existing file and never a symlink's target.
pub(crate) fn create_at(dir: &File, name: &std::ffi::OsStr, mode: u32) -> io::Result<File> {
    let cname = c_name(name)?;
    let flags = libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: `dir` owns an open fd for the duration of the call; `cname`
    // is a NUL-terminated string that outlives it.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), cname.as_ptr(), flags, mode) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by openat and is owned by no one else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`: `(st_dev, st_ino)` of the
/// entry `name` itself (a symlink's own, never its target's).
pub(crate) fn identity_at(dir: &File, name: &std::ffi::OsStr) -> io::Result<(u64, u64)> {
    let cname = c_name(name)?;
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `dir` owns an open fd for the call; `cname` is NUL-terminated
    // and outlives it; `st` is writable memory of the right size.
    let r = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            cname.as_ptr(),
            st.as_mut_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstatat returned 0, so it initialized `st`.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)] // field types differ across targets
    Ok((st.st_dev as u64, st.st_ino as u64))
}

/// `unlinkat(dir, name, 0)`: remove the entry `name` of the directory
/// `dir` is open on.
pub(crate) fn unlink_at(dir: &File, name: &std::ffi::OsStr) -> io::Result<()> {
    let cname = c_name(name)?;
    // SAFETY: `dir` owns an open fd for the call; `cname` is NUL-terminated
    // and outlives it.
    let r = unsafe { libc::unlinkat(dir.as_raw_fd(), cname.as_ptr(), 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `posix_fallocate(file, 0, len)`: the file's blocks reserved now, so a
/// store into it never finds its file system full.
pub(crate) fn allocate(file: &File, len: u64) -> io::Result<()> {
    let len =
        libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `file` owns an open fd for the duration of the call.
    let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// `geteuid()`: the user this process acts as.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid takes no arguments, touches no memory and cannot fail.
    unsafe { libc::geteuid() }
}

/// `libc::TMPFS_MAGIC` in [`fs_magic`]'s type.
#[allow(clippy::unnecessary_cast)]
pub(crate) const TMPFS_MAGIC: i64 = libc::TMPFS_MAGIC as i64;

/// Give SIGPIPE its default action back: the process ends quietly when
/// the reader of its output goes away (`daxkv status | head -1`), as
/// command-line tools do. Rust's runtime ignores SIGPIPE, which turns a
/// closed pipe into a panic of `println!`.
pub(crate) fn default_sigpipe() {
    // SAFETY: signal(2) with SIG_DFL installs no handler and touches no
    // memory of ours; the previous action is not needed.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// The system page size (`sysconf(_SC_PAGESIZE)`), 4096 if it cannot be
/// read.
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf takes a constant name and touches no memory of ours.
    let r = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if r > 0 {
        r as u64
    } else {
        4096
    }
}

/// The calling thread's CPU affinity mask (`sched_getaffinity(0)`).
pub(crate) fn thread_affinity() -> io::Result<libc::cpu_set_t> {
    // SAFETY: cpu_set_t is plain data (a bit array); all-zero is the empty
    // set, and sched_getaffinity fills it below.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable cpu_set_t of the size passed.
    let r =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw mut set) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(set)
}

/// Set the calling thread's CPU affinity mask (`sched_setaffinity(0)`).
pub(crate) fn set_thread_affinity(set: &libc::cpu_set_t) -> io::Result<()> {
    // SAFETY: `set` is a valid cpu_set_t of the size passed; only read.
    let r = unsafe {
        libc::sched_setaffinity(
            0,
            std::mem::size_of::<libc::cpu_set_t>(),
            std::ptr::from_ref(set),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The CPUs of a mask, in order.
pub(crate) fn cpus_of(set: &libc::cpu_set_t) -> Vec<usize> {
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: CPU_ISSET reads one bit of a valid set; the index is
        // below CPU_SETSIZE.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, set) })
        .collect()
}

/// Pin the calling thread to `cpu` alone.
pub(crate) fn pin_thread(cpu: usize) -> io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: as in `thread_affinity`: the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` < CPU_SETSIZE (checked above); `set` is ours.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    set_thread_affinity(&set)
}

/// A mask holding `cpus`; `Err(InvalidInput)` when one is at or past
/// `CPU_SETSIZE` (a `cpu_set_t` cannot name it).
pub(crate) fn cpu_set(cpus: &[usize]) -> io::Result<libc::cpu_set_t> {
    // SAFETY: as in `thread_affinity`: the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        // SAFETY: `cpu` < CPU_SETSIZE (checked above); `set` is ours.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    Ok(set)
}

/// Set the calling thread's mask to exactly `cpus` (`sched_setaffinity(0)`;
/// inside a cpuset the kernel keeps only the cpuset's CPUs of the mask, and
/// refuses a mask with none of them with `EINVAL`).
pub(crate) fn set_thread_cpus(cpus: &[usize]) -> io::Result<()> {
    set_thread_affinity(&cpu_set(cpus)?)
}

/// The calling thread's CPUs, read back from the kernel.
pub(crate) fn thread_cpus() -> io::Result<Vec<usize>> {
    thread_affinity().map(|s| cpus_of(&s))
}

/// The calling thread's kernel thread id (`gettid`).
pub(crate) fn gettid() -> i32 {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// The CPU the calling thread runs on now (`sched_getcpu`).
pub(crate) fn current_cpu() -> Option<usize> {
    // SAFETY: sched_getcpu takes no arguments.
    let r = unsafe { libc::sched_getcpu() };
    usize::try_from(r).ok()
}

/// User and system CPU time of the whole process, all threads, so far
/// (`getrusage(RUSAGE_SELF)`), in seconds.
pub(crate) fn process_cpu_seconds() -> io::Result<(f64, f64)> {
    // SAFETY: `rusage` is plain old data; all-zero is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: one live `rusage` for the kernel to fill.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &raw mut ru) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Ok((secs(ru.ru_utime), secs(ru.ru_stime)))
}

#[cfg(all(test, not(miri)))]
mod tests {
    use super::*;

    #[test]
    fn statfs_names_tmpfs_and_page_size_is_sane() {
        let shm = std::path::Path::new("/dev/shm");
        if shm.is_dir() {
            assert_eq!(fs_magic(shm).unwrap(), TMPFS_MAGIC);
        }
        assert!(fs_magic(std::path::Path::new("/nonexistent/x")).is_err());
        assert!(fs_magic(std::path::Path::new("a\0b")).is_err());
        let p = page_size();
        assert!(p >= 4096 && p.is_power_of_two(), "{p}");
    }

    #[test]
    fn sealed_memfd_refuses_shrink_and_grow() {
        let f = memfd_create_sealable("seal-test").unwrap();
        f.set_len(8192).unwrap();
        assert_eq!(seals(&f).unwrap(), 0);
        add_seals(
            &f,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
        .unwrap();
        let s = seals(&f).unwrap();
        assert_eq!(
            s,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL
        );
        assert!(f.set_len(4096).is_err());
        assert!(f.set_len(1 << 20).is_err());
        assert!(
            add_seals(&f, libc::F_SEAL_WRITE).is_err(),
            "seals are sealed"
        );
        let plain = memfd_create("plain").unwrap();
        assert_eq!(seals(&plain).unwrap(), libc::F_SEAL_SEAL);
        assert!(add_seals(&plain, libc::F_SEAL_SHRINK).is_err());
    }

    #[test]
    fn a_thread_pins_to_one_cpu_and_restores_its_mask() {
        std::thread::spawn(|| {
            let all = thread_affinity().unwrap();
            let cpus = cpus_of(&all);
            assert!(!cpus.is_empty());
            let last = *cpus.last().unwrap();
            pin_thread(last).unwrap();
            assert_eq!(cpus_of(&thread_affinity().unwrap()), [last]);
            // SAFETY: sched_getcpu takes no arguments.
            let on = unsafe { libc::sched_getcpu() };
            assert_eq!(
                usize::try_from(on).unwrap(),
                last,
                "runs where it is pinned"
            );
            set_thread_affinity(&all).unwrap();
            assert_eq!(cpus_of(&thread_affinity().unwrap()), cpus);
            assert!(pin_thread(libc::CPU_SETSIZE as usize).is_err());
        })
        .join()
        .unwrap();
    }
}

/// Block `signals` in the calling thread (threads it spawns afterwards
/// inherit the mask), so that [`wait_signal`] can take them synchronously.
pub(crate) fn block_signals(signals: &[libc::c_int]) -> io::Result<()> {
    let set = sigset(signals)?;
    // SAFETY: `set` is an initialized sigset_t; a null old-set pointer is
    // allowed.
    let r = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &raw const set, std::ptr::null_mut()) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Wait for one of `signals` (blocked beforehand with [`block_signals`])
/// and return it.
pub(crate) fn wait_signal(signals: &[libc::c_int]) -> io::Result<libc::c_int> {
    let set = sigset(signals)?;
    let mut sig: libc::c_int = 0;
    // SAFETY: `set` is an initialized sigset_t and `sig` a valid out pointer.
    let r = unsafe { libc::sigwait(&raw const set, &raw mut sig) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(sig)
}

fn sigset(signals: &[libc::c_int]) -> io::Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain data; sigemptyset initializes it below
    // before any other use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t we own.
    if unsafe { libc::sigemptyset(&raw mut set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    for &s in signals {
        // SAFETY: as above; `s` is checked by the call.
        if unsafe { libc::sigaddset(&raw mut set, s) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(set)
}
