//! A SIGBUS in a device copy fails that device, not the process
//! (`daxkv::device::fault`): a tmpfs device file truncated under
//! stored keys, a poisoned memory line (`BUS_MCEERR_AR`) consumed by a
//! copy, and the faults that must still kill the process (outside any
//! copy, or in a copy but outside the device).
//!
//! Every scenario runs in a child process (this test binary, re-run on one
//! test with `DAXKV_FAULT_CHILD` set), so a scenario that dies of SIGBUS
//! is reported as such instead of taking the test binary down; the parent
//! asserts how the child ended and what it printed.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use daxkv::device::arena::{Arena, ArenaSource, ArenaSpec, CopyError};
use daxkv::engine::{DeviceId, DeviceSpec, DeviceState, Engine, EngineOptions, Listener};
use daxkv::plumbing::buf::Buf;
use daxkv::{CoreConfig, DaxCore, Key, PutError};

const SLOT: usize = 4096;
const SLOTS: usize = 64;
const T: Duration = Duration::from_secs(20);
const CHILD: &str = "DAXKV_FAULT_CHILD";
const SURVIVED: &str = "daxkv-fault-child: survived";

/// Whether this process is the child for scenario `name`.
fn child(name: &str) -> bool {
    std::env::var(CHILD).as_deref() == Ok(name)
}

/// Run scenario `name` in a child process: this binary, that test only.
fn run_child(name: &str) -> Output {
    Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn assert_survived(name: &str, o: &Output) {
    let (so, se) = (text(&o.stdout), text(&o.stderr));
    assert!(
        o.status.success() && so.contains(SURVIVED),
        "{name}: the child did not survive ({:?}, signal {:?})\nstdout:\n{so}\nstderr:\n{se}",
        o.status,
        o.status.signal()
    );
}

fn assert_killed_by_sigbus(name: &str, o: &Output) {
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGBUS),
        "{name}: the child should die of SIGBUS ({:?})\nstdout:\n{}\nstderr:\n{}",
        o.status,
        text(&o.stdout),
        text(&o.stderr)
    );
}

fn k(i: u32) -> Key {
    Key::digest(&i.to_le_bytes())
}

fn payload(i: u32) -> Vec<u8> {
    (0..SLOT)
        .map(|j| (j as u32).wrapping_mul(31).wrapping_add(i * 7) as u8)
        .collect()
}

/// A tmpfs file of `SLOTS` slots in a fresh directory under /dev/shm.
fn shm_file() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("daxkv-fault")
        .tempdir_in("/dev/shm")
        .expect("/dev/shm (tmpfs) is needed for this test");
    let p = dir.path().join("dev0.img");
    std::fs::File::create(&p)
        .unwrap()
        .set_len((SLOTS * SLOT) as u64)
        .unwrap();
    (dir, p)
}

fn truncate(p: &Path) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(0)
        .unwrap();
}

fn store(e: &Engine, i: u32) -> bool {
    let id = e
        .submit_store(vec![k(i)], vec![Buf::from(payload(i))])
        .unwrap();
    e.wait_store(id, T).ready().expect("store answered").success
}

/// A core over the tmpfs file at `p`, `SLOTS` slots of `SLOT` bytes.
fn file_core(p: &std::path::Path) -> DaxCore {
    DaxCore::open(&CoreConfig::new(
        ArenaSpec::new(ArenaSource::Path(p.to_path_buf()), SLOTS * SLOT),
        SLOT,
    ))
    .unwrap()
}

/// (a) Two devices: a tmpfs file (device 0) and a memfd (device 1), one
/// key on each. The file is truncated under its mapping; a load of both
/// keys: the process survives, device 0's key is a miss, device 1's key
/// loads with its bytes; device 0 is `failed`, its key is a lookup miss,
/// a new store goes to device 1, health is degraded naming device 0, and
/// its key is reported deleted.
///
/// On the code before `daxkv::device::fault`: the child died of SIGBUS (signal 7)
/// in the load worker's copy.
#[test]
fn a_truncated_device_file_fails_the_device_and_the_engine_serves_on() {
    const NAME: &str = "a_truncated_device_file_fails_the_device_and_the_engine_serves_on";
    if !child(NAME) {
        return assert_survived(NAME, &run_child(NAME));
    }
    let (_dir, p) = shm_file();
    let devs = vec![
        DeviceSpec {
            path: p.display().to_string(),
            core: CoreConfig::new(
                ArenaSpec::new(ArenaSource::Path(p.clone()), SLOTS * SLOT),
                SLOT,
            ),
        },
        DeviceSpec {
            path: "memfd".into(),
            core: CoreConfig::new(ArenaSpec::memfd(SLOTS * SLOT), SLOT),
        },
    ];
    let e = Engine::open(devs, SLOT, false, EngineOptions::default()).unwrap();
    let told = Arc::new(Deleted::default());
    let l: Arc<dyn Listener> = told.clone();
    e.register_listener(&l);
    // Key 0 on device 0, key 1 on device 1.
    e.set_device_state(DeviceId(1), DeviceState::Draining)
        .unwrap();
    assert!(store(&e, 0));
    e.set_device_state(DeviceId(1), DeviceState::Active)
        .unwrap();
    e.set_device_state(DeviceId(0), DeviceState::Draining)
        .unwrap();
    assert!(store(&e, 1));
    e.set_device_state(DeviceId(0), DeviceState::Active)
        .unwrap();
    let live: Vec<_> = e.devices().iter().map(|d| d.live_slots).collect();
    assert_eq!(live, [1, 1]);

    truncate(&p);

    let id = e
        .submit_load(vec![k(0), k(1)], vec![vec![0u8; SLOT]; 2])
        .unwrap();
    let r = e.wait_load(id, T).ready().expect("load answered");
    assert!(!r.bitmap.test(0), "device 0's key must be a miss");
    assert_eq!(r.payload(1), Some(&payload(1)[..]), "device 1 serves on");
    let states: Vec<_> = e.devices().iter().map(|d| d.state).collect();
    assert_eq!(states, [DeviceState::Failed, DeviceState::Active]);
    assert_eq!(e.exists(&[k(0), k(1)]), [false, true]);
    // A new key goes to the healthy device.
    assert!(store(&e, 2));
    let live: Vec<_> = e.devices().iter().map(|d| d.live_slots).collect();
    assert_eq!(live[1], 2, "{live:?}");
    let id = e.submit_load(vec![k(2)], vec![vec![0u8; SLOT]]).unwrap();
    let r = e.wait_load(id, T).ready().expect("load answered");
    assert_eq!(r.payload(0), Some(&payload(2)[..]));
    assert!(daxkv::device::fault::recovered_faults() >= 1);
    // The pool serves on, degraded, and the failed device's key is
    // reported deleted (once, whoever reports first).
    let reason = e.health().unwrap().expect("degraded");
    assert!(
        reason.starts_with(&format!("device 0 ({}) failed", p.display())),
        "{reason}"
    );
    assert_eq!(*told.0.lock().unwrap(), [k(0)]);
    e.close();
    println!("{SURVIVED}");
}

/// Keys the listeners were told are deleted.
#[derive(Default)]
struct Deleted(std::sync::Mutex<Vec<Key>>);

impl Listener for Deleted {
    fn on_keys_deleted(&self, keys: &[Key]) {
        self.0.lock().unwrap().extend_from_slice(keys);
    }
}

/// (a) at the core: a store into a truncated device file fails with
/// `DeviceFailed` (the slot is freed, nothing left in flight), loads and
/// lookups of the device's keys are misses, and another core's keys still
/// load with their bytes.
///
/// On the code before `daxkv::device::fault`: the child died of SIGBUS.
#[test]
fn a_truncated_device_file_fails_puts_and_loads_at_the_core() {
    const NAME: &str = "a_truncated_device_file_fails_puts_and_loads_at_the_core";
    if !child(NAME) {
        return assert_survived(NAME, &run_child(NAME));
    }
    let (_dir, p) = shm_file();
    let a = file_core(&p);
    let b = DaxCore::open(&CoreConfig::new(ArenaSpec::memfd(SLOTS * SLOT), SLOT)).unwrap();
    a.put(k(0), &payload(0), 0).unwrap();
    b.put(k(1), &payload(1), 0).unwrap();
    truncate(&p);
    assert_eq!(a.put(k(2), &payload(2), 0), Err(PutError::DeviceFailed));
    assert!(a.is_failed());
    assert_eq!(a.live_slot_count(), 1, "the failed put freed its slot");
    let mut buf = vec![0u8; SLOT];
    assert_eq!(a.load_into(k(0), &mut buf), None);
    assert!(!a.exists(k(0), false));
    assert!(!b.is_failed());
    assert_eq!(b.load_into(k(1), &mut buf), Some(SLOT));
    assert_eq!(buf, payload(1));
    a.check_invariants().unwrap();
    println!("{SURVIVED}");
}

static ARMED: AtomicBool = AtomicBool::new(false);

/// The copy hook: once armed, send this very thread a SIGBUS as the
/// kernel reports a consumed poisoned line (`si_code` `BUS_MCEERR_AR`,
/// `si_addr` in the device), while it is inside the copy.
fn poison_hook(base: *const u8) {
    if !ARMED.swap(false, Ordering::SeqCst) {
        return;
    }
    // siginfo_t: si_signo, si_errno, si_code (i32 each), then on 64-bit
    // targets the union at offset 16, whose first field is si_addr.
    let mut info = [0u64; 16];
    let words = info.as_mut_ptr().cast::<i32>();
    // SAFETY: `info` is 128 bytes, the size of `siginfo_t`; the writes are
    // inside it and aligned. rt_tgsigqueueinfo reads 128 bytes from it; a
    // thread may send itself a signal with a positive `si_code`.
    let r = unsafe {
        words.write(libc::SIGBUS);
        words.add(2).write(daxkv::device::fault::BUS_MCEERR_AR);
        info[2] = base as u64 + 100;
        libc::syscall(
            libc::SYS_rt_tgsigqueueinfo,
            libc::getpid(),
            libc::gettid(),
            libc::SIGBUS,
            info.as_ptr(),
        )
    };
    assert_eq!(
        r,
        0,
        "rt_tgsigqueueinfo: {}",
        std::io::Error::last_os_error()
    );
}

/// (b) A poisoned line consumed by a load's copy: a synthetic SIGBUS with
/// `si_code` `BUS_MCEERR_AR` and `si_addr` inside the device, delivered to
/// the copying thread while it is inside the copy (a test hook in the
/// copy path sends it with `rt_tgsigqueueinfo`; `MADV_HWPOISON` would
/// offline a page of the shared test host for good). The load is a miss,
/// the device is failed, the other device's key loads with its bytes.
///
/// On the code before `daxkv::device::fault`: the child died of SIGBUS.
#[test]
fn a_poisoned_line_in_a_copy_fails_the_device_not_the_process() {
    const NAME: &str = "a_poisoned_line_in_a_copy_fails_the_device_not_the_process";
    if !child(NAME) {
        return assert_survived(NAME, &run_child(NAME));
    }
    let a = DaxCore::open(&CoreConfig::new(ArenaSpec::memfd(SLOTS * SLOT), SLOT)).unwrap();
    let b = DaxCore::open(&CoreConfig::new(ArenaSpec::memfd(SLOTS * SLOT), SLOT)).unwrap();
    a.put(k(0), &payload(0), 0).unwrap();
    b.put(k(1), &payload(1), 0).unwrap();
    daxkv::device::fault::set_test_copy_hook(Some(poison_hook));
    ARMED.store(true, Ordering::SeqCst);
    let mut buf = vec![0u8; SLOT];
    assert_eq!(a.load_into(k(0), &mut buf), None, "a poisoned load misses");
    assert!(!ARMED.load(Ordering::SeqCst), "the hook fired");
    daxkv::device::fault::set_test_copy_hook(None);
    assert!(a.is_failed() && !b.is_failed());
    assert!(!a.exists(k(0), false));
    assert_eq!(a.put(k(3), &payload(3), 0), Err(PutError::DeviceFailed));
    assert_eq!(b.load_into(k(1), &mut buf), Some(SLOT));
    assert_eq!(buf, payload(1));
    println!("{SURVIVED}");
}

/// (c) A SIGBUS outside any copy still kills the process: a truncated
/// memfd mapped by hand (not a device) and touched, with the handler
/// installed (an arena is open).
#[test]
fn a_sigbus_outside_a_copy_still_kills_the_process() {
    const NAME: &str = "a_sigbus_outside_a_copy_still_kills_the_process";
    if !child(NAME) {
        return assert_killed_by_sigbus(NAME, &run_child(NAME));
    }
    let _a = Arena::open(&ArenaSpec::memfd(SLOT)).unwrap();
    let (_f, p) = truncated_mapping();
    // SAFETY: `p` is a live mapping of 4096 bytes; reading it faults
    // (SIGBUS), which is the point.
    let v = unsafe { p.read_volatile() };
    println!("read {v}: {SURVIVED}");
}

/// (c) A SIGBUS inside a daxkv copy but outside the device (the caller's
/// source buffer is a truncated mapping) still kills the process.
#[test]
fn a_sigbus_in_a_copy_but_outside_the_device_still_kills_the_process() {
    const NAME: &str = "a_sigbus_in_a_copy_but_outside_the_device_still_kills_the_process";
    if !child(NAME) {
        return assert_killed_by_sigbus(NAME, &run_child(NAME));
    }
    let a = Arena::open(&ArenaSpec::memfd(SLOT)).unwrap();
    let (_f, p) = truncated_mapping();
    let g = a.enter().unwrap();
    // SAFETY: nobody else uses the arena; `p` is a live 4096-byte mapping
    // (whose pages fault: the point of the test).
    let r = unsafe { g.write_from_ptr(0, p, SLOT) };
    println!("{r:?}: {SURVIVED}");
}

/// A memfd of one page, mapped shared, then truncated to 0: any access
/// faults with SIGBUS. Not a device (never registered).
fn truncated_mapping() -> (std::fs::File, *mut u8) {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: a plain memfd_create with a static name.
    let fd = unsafe { libc::memfd_create(c"daxkv-fault-test".as_ptr(), 0) };
    assert!(fd >= 0);
    // SAFETY: `fd` is fresh and owned by nobody else.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(SLOT as u64).unwrap();
    // SAFETY: a fresh shared mapping of the memfd; nothing else is there.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            SLOT,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    f.set_len(0).unwrap();
    (f, p.cast())
}

/// A failed device's copies fail with `CopyError::DeviceFailed` at the
/// arena, before and after the fault.
#[test]
fn a_failed_arena_refuses_copies() {
    const NAME: &str = "a_failed_arena_refuses_copies";
    if !child(NAME) {
        return assert_survived(NAME, &run_child(NAME));
    }
    let (_dir, p) = shm_file();
    let a = Arena::open(&ArenaSpec::new(ArenaSource::Path(p.clone()), SLOTS * SLOT)).unwrap();
    let g = a.enter().unwrap();
    let mut buf = vec![0u8; SLOT];
    // SAFETY: nobody else uses the arena.
    unsafe { g.write(0, &payload(0)).unwrap() };
    truncate(&p);
    // SAFETY: as above.
    let r = unsafe { g.read(0, &mut buf) };
    // Read `buf` afterwards: a destination never read again lets the
    // optimizer drop the copy, and with it the fault (the release build
    // answered `Ok` here).
    std::hint::black_box(&buf);
    assert_eq!(r, Err(CopyError::DeviceFailed));
    assert!(a.is_failed());
    // SAFETY: as above.
    let r = unsafe { g.write(SLOT, &payload(1)) };
    assert_eq!(r, Err(CopyError::DeviceFailed));
    println!("{SURVIVED}");
}

/// A process that ignores SIGBUS (`SIG_IGN` before daxkv installed its
/// handler) still ignores one sent with `kill`: the handler passes on
/// what it does not own as the disposition it replaced would have. Failed
/// with `SIG_IGN` chained as `SIG_DFL`: the child died of the `kill`
/// (a signal it ignored before the first arena opened).
#[test]
fn a_sigbus_sent_by_kill_to_a_process_that_ignores_it_is_still_ignored() {
    const NAME: &str = "a_sigbus_sent_by_kill_to_a_process_that_ignores_it_is_still_ignored";
    if !child(NAME) {
        return assert_survived(NAME, &run_child(NAME));
    }
    // SAFETY: setting a signal's disposition to SIG_IGN (no handler code).
    unsafe { libc::signal(libc::SIGBUS, libc::SIG_IGN) };
    let _a = Arena::open(&ArenaSpec::memfd(SLOT)).unwrap();
    for _ in 0..3 {
        // SAFETY: kill to this process; SIGBUS was ignored before daxkv.
        unsafe { libc::kill(libc::getpid(), libc::SIGBUS) };
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("{SURVIVED}");
}

/// A hostile peer's `kill -BUS` does not disarm the recovery: the
/// previous handler (Rust's own stack-overflow handler, in this binary
/// and in `daxkv serve`) answers a SIGBUS that is not a stack overflow by
/// resetting SIGBUS to the default action (so that a real fault kills on
/// re-execution). The process survives the `kill`, as it would without
/// daxkv; then a device file truncated under its mapping must still fail
/// the device, not kill the process. Failed with the reset left in place:
/// the child survived the `kill` and then died of SIGBUS in the put.
#[test]
fn a_sigbus_sent_by_kill_does_not_disarm_the_recovery() {
    const NAME: &str = "a_sigbus_sent_by_kill_does_not_disarm_the_recovery";
    if !child(NAME) {
        return assert_survived(NAME, &run_child(NAME));
    }
    let (_dir, p) = shm_file();
    let a = file_core(&p);
    // SAFETY: kill to this process.
    unsafe { libc::kill(libc::getpid(), libc::SIGBUS) };
    std::thread::sleep(Duration::from_millis(50));
    println!("survived the kill");
    a.put(k(0), &payload(0), 0).unwrap();
    truncate(&p);
    assert_eq!(a.put(k(2), &payload(2), 0), Err(PutError::DeviceFailed));
    assert!(a.is_failed());
    println!("{SURVIVED}");
}
