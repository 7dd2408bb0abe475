//! Multi-threaded stress on one DaxCore: every payload carries its key id and
//! a checksum, so a load that returns another key's bytes or torn bytes
//! fails. At the end every lock is released, every key deleted, and every
//! slot must be free again.

use std::sync::Arc;

use daxkv::device::arena::ArenaSpec;
use daxkv::{CoreConfig, DaxCore, Key, PutOutcome};

const SLOT: usize = 8192;
const KEYS: u32 = 96;
const SLOTS: usize = 48;

fn k(i: u32) -> Key {
    Key::digest(&i.to_le_bytes())
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// [key id u32][seed u32][body][fnv64 of everything before]
fn make(id: u32, seed: u32, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&id.to_le_bytes());
    v.extend_from_slice(&seed.to_le_bytes());
    let mut r = Rng(u64::from(seed) | 1);
    while v.len() < len - 8 {
        v.push(r.next() as u8);
    }
    let h = fnv(&v);
    v.extend_from_slice(&h.to_le_bytes());
    v
}

fn verify(id: u32, got: &[u8]) {
    assert!(got.len() >= 16, "short payload {}", got.len());
    let (body, tail) = got.split_at(got.len() - 8);
    assert_eq!(
        u32::from_le_bytes(body[..4].try_into().unwrap()),
        id,
        "another key's bytes"
    );
    assert_eq!(
        fnv(body),
        u64::from_le_bytes(tail.try_into().unwrap()),
        "torn or corrupted payload of key {id}"
    );
}

#[test]
fn concurrent_mixed_operations_lose_and_corrupt_nothing() {
    let core =
        Arc::new(DaxCore::open(&CoreConfig::new(ArenaSpec::memfd(SLOTS * SLOT), SLOT)).unwrap());
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let core = core.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9 ^ ((t + 1) * 0x1234_5678_9ABC));
                let mut my_locks: Vec<u32> = Vec::new();
                let mut buf = vec![0u8; SLOT];
                let mut stats = [0usize; 4];
                for _ in 0..20_000 {
                    let id = (rng.next() % u64::from(KEYS)) as u32;
                    match rng.next() % 8 {
                        0 | 1 => {
                            let len = 16 + (rng.next() as usize % (SLOT - 16));
                            if let Ok(PutOutcome::Stored) =
                                core.put(k(id), &make(id, rng.next() as u32, len), 0)
                            {
                                stats[0] += 1;
                            }
                        }
                        2 | 3 => {
                            if let Some(n) = core.load_into(k(id), &mut buf) {
                                verify(id, &buf[..n]);
                                stats[1] += 1;
                            }
                        }
                        4 => {
                            if core.exists(k(id), true) {
                                my_locks.push(id);
                                stats[2] += 1;
                            }
                        }
                        5 => {
                            if let Some(i) = my_locks.pop() {
                                core.unlock_many(&[k(i)]);
                            }
                        }
                        6 => {
                            // Hold a read across a delete of the same key.
                            let set = core.reserve_reads(&[k(id)], false);
                            let deleted = core.delete_many(&[k(id)], false)[0];
                            if let Some(r) = set.items().first() {
                                let n = set.read(r, &mut buf).unwrap();
                                verify(id, &buf[..n]);
                            }
                            stats[3] += usize::from(deleted);
                        }
                        _ => {
                            let force = rng.next().is_multiple_of(4);
                            stats[3] += usize::from(core.delete_many(&[k(id)], force)[0]);
                        }
                    }
                }
                for i in my_locks {
                    core.unlock_many(&[k(i)]);
                }
                stats
            })
        })
        .collect();
    let mut total = [0usize; 4];
    for h in threads {
        let s = h.join().unwrap();
        for i in 0..4 {
            total[i] += s[i];
        }
    }
    assert!(
        total.iter().all(|&n| n > 100),
        "every operation kind ran: {total:?}"
    );
    core.check_invariants().unwrap();
    let st = core.status();
    assert_eq!(st.borrowed_slot_count, 0);
    assert_eq!(st.active_read_count, 0);
    assert_eq!(st.active_write_count, 0);
    // Whatever survived is intact; then everything goes.
    let keys: Vec<Key> = (0..KEYS).map(k).collect();
    let mut buf = vec![0u8; SLOT];
    for i in 0..KEYS {
        if let Some(n) = core.load_into(k(i), &mut buf) {
            verify(i, &buf[..n]);
        }
    }
    let live_keys = core.snapshot_keys().len();
    assert_eq!(
        core.live_slot_count(),
        live_keys,
        "every live slot is a committed key"
    );
    assert_eq!(
        core.delete_many(&keys, false)
            .into_iter()
            .filter(|&d| d)
            .count(),
        live_keys,
        "no lock was left behind"
    );
    assert_eq!(core.live_slot_count(), 0, "no slot leaked");
    assert_eq!(core.usage(), (0.0, 0.0));
    core.check_invariants().unwrap();
}
