//! Shared by the hunting stress tests (`stress_engine`, `stress_core`;
//! included with `#[path]`, not a test crate): the seeded generator, payload
//! stamping and checking, and the run-time / seed / fd knobs.
#![allow(dead_code)]

use std::time::Duration;

/// xorshift64*: cheap, seedable, good enough to pick operations.
pub struct Rng(pub u64);

impl Rng {
    /// A generator for thread `t` of a run seeded with `seed` (never zero).
    pub fn for_thread(seed: u64, t: u64) -> Rng {
        Rng(seed ^ (t + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// True with probability `1 / n`.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }
}

pub fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Smallest payload `payload` makes: id, nonce, checksum.
pub const PAYLOAD_MIN: usize = 24;

/// `[key id u64][nonce u64][filler][fnv64 of everything before]`.
pub fn payload(id: u64, nonce: u64, len: usize) -> Vec<u8> {
    assert!(len >= PAYLOAD_MIN, "payload of {len} bytes");
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&id.to_le_bytes());
    v.extend_from_slice(&nonce.to_le_bytes());
    let mut r = Rng(nonce | 1);
    while v.len() < len - 8 {
        v.push(r.next() as u8);
    }
    let h = fnv(&v);
    v.extend_from_slice(&h.to_le_bytes());
    v
}

/// Check a loaded chunk whose stored length is unknown to the caller: the
/// checksum is searched at every 8-byte boundary the payload could end on
/// (payloads of `stress_engine` are multiples of 8 long).
pub fn verify(id: u64, got: &[u8]) {
    let stamped = u64::from_le_bytes(got[..8].try_into().unwrap());
    assert_eq!(stamped, id, "key {id} loaded the bytes of key {stamped}");
    let ok = (PAYLOAD_MIN..=got.len()).step_by(8).any(|end| {
        let (body, tail) = got[..end].split_at(end - 8);
        fnv(body) == u64::from_le_bytes(tail.try_into().unwrap())
    });
    assert!(ok, "key {id}: torn or corrupted payload");
}

/// Check a loaded payload of known length (`got` is exactly what the store
/// reported): right key, checksum over exactly these bytes.
pub fn verify_exact(id: u64, got: &[u8]) {
    assert!(
        got.len() >= PAYLOAD_MIN,
        "key {id}: payload of {} bytes is shorter than any stored",
        got.len()
    );
    let stamped = u64::from_le_bytes(got[..8].try_into().unwrap());
    assert_eq!(stamped, id, "key {id} loaded the bytes of key {stamped}");
    let (body, tail) = got.split_at(got.len() - 8);
    assert_eq!(
        fnv(body),
        u64::from_le_bytes(tail.try_into().unwrap()),
        "key {id}: torn or corrupted payload ({} bytes)",
        got.len()
    );
}

/// `DAXKV_STRESS_SECS`, default 3.
pub fn secs() -> u64 {
    std::env::var("DAXKV_STRESS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3)
}

/// The run time: `DAXKV_STRESS_SECS` seconds.
pub fn run_time() -> Duration {
    Duration::from_secs(secs())
}

/// `DAXKV_STRESS_SEED`, or one from the clock.
pub fn seed() -> u64 {
    seed_from("DAXKV_STRESS_SEED")
}

/// The seed in the environment variable `var`, or a nonzero one from the
/// clock (print it, so a failing run can be replayed).
pub fn seed_from(var: &str) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        })
}

/// Open file descriptors of this process (entries of /proc/self/fd; the
/// directory's own fd is counted every time, so counts compare).
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, Iterator::count)
}

/// Stall injection (the scheduler's preemption, on demand): a signal whose
/// handler sleeps, sent to a random worker at random moments, so a worker
/// stops for tens of microseconds at an arbitrary instruction — between an
/// index lookup and the slot-word load that should go with it, say — while
/// the others run on. On a 2-core host that turns a race that needs a
/// preemption inside a few-nanosecond window from once a minute into many
/// times a second.
pub mod stall {
    use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
    use std::sync::{Barrier, Mutex, Once};
    use std::time::Duration;

    use super::Rng;

    const SIGNAL: libc::c_int = libc::SIGUSR2;

    /// How long the next stall lasts (the injector sets it before each
    /// signal; a race between two signals only changes a length).
    static STALL_NS: AtomicI64 = AtomicI64::new(20_000);

    extern "C" fn on_signal(_: libc::c_int) {
        // ORDERING: Relaxed — a length, no data published with it.
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: STALL_NS.load(Ordering::Relaxed),
        };
        // SAFETY: `__errno_location` is the calling thread's errno; saving
        // and restoring it keeps the interrupted code's errno intact, and
        // `nanosleep` is async-signal-safe with a valid timespec.
        unsafe {
            let errno = *libc::__errno_location();
            libc::nanosleep(&raw const ts, std::ptr::null_mut());
            *libc::__errno_location() = errno;
        }
    }

    fn install() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            // SAFETY: a zeroed sigaction is a valid "no flags, empty mask"
            // value; the handler only calls async-signal-safe functions;
            // SA_RESTART restarts interrupted system calls.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
                sa.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&raw mut sa.sa_mask);
                assert_eq!(
                    libc::sigaction(SIGNAL, &raw const sa, std::ptr::null_mut()),
                    0
                );
            }
        });
    }

    /// Sleep with 1 ns of timer slack on this thread (the default 50 µs
    /// would stretch every short stall and every injector pause).
    fn tight_timers() {
        // SAFETY: PR_SET_TIMERSLACK takes one integer argument.
        unsafe {
            libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
        }
    }

    /// The workers of one round and the injector that stalls them. Every
    /// worker stays alive (in `leave`) until the injector has stopped, so a
    /// signal never targets a thread that has exited.
    pub struct Stalls {
        threads: Mutex<Vec<libc::pthread_t>>,
        done: AtomicUsize,
        workers: usize,
        all_left: Barrier,
    }

    impl Stalls {
        pub fn new(workers: usize) -> Stalls {
            install();
            Stalls {
                threads: Mutex::new(Vec::new()),
                done: AtomicUsize::new(0),
                workers,
                all_left: Barrier::new(workers + 1),
            }
        }

        /// Run `f` on this thread as one of the workers.
        pub fn worker<R>(&self, f: impl FnOnce() -> R) -> R {
            // SAFETY: `pthread_self` has no preconditions.
            let me = unsafe { libc::pthread_self() };
            tight_timers();
            self.threads.lock().unwrap().push(me);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            // ORDERING: Release/Acquire — a count; the barrier orders exit.
            self.done.fetch_add(1, Ordering::Release);
            self.all_left.wait();
            r.unwrap_or_else(|p| std::panic::resume_unwind(p))
        }

        /// The injector: until every worker is done, stall a random one for
        /// 2–40 µs every 5–50 µs. Returns the number of stalls.
        pub fn inject(&self, mut rng: Rng) -> u64 {
            tight_timers();
            let mut sent = 0;
            // ORDERING: Acquire — pairs with the Release in `worker`.
            while self.done.load(Ordering::Acquire) < self.workers {
                let target = {
                    let t = self.threads.lock().unwrap();
                    (!t.is_empty()).then(|| t[rng.below(t.len() as u64) as usize])
                };
                if let Some(t) = target {
                    // ORDERING: Relaxed — see `STALL_NS`.
                    STALL_NS.store(2_000 + rng.below(38_000).cast_signed(), Ordering::Relaxed);
                    // SAFETY: `t` is a registered worker, alive until it
                    // passes `all_left`, which waits for this thread.
                    let rc = unsafe { libc::pthread_kill(t, SIGNAL) };
                    assert_eq!(rc, 0, "pthread_kill");
                    sent += 1;
                }
                std::thread::sleep(Duration::from_micros(5 + rng.below(45)));
            }
            self.all_left.wait();
            sent
        }
    }
}
