//! DaxCore against a plain reference model (a map with lock counts and an
//! explicit lowest-free slot allocator), on random operation sequences.
//! After every step the results must match and the core's invariants hold:
//! no slot leaked, usage consistent, bytes round-trip.
//!
//! `cargo test -p daxkv-fuzz` runs it on random inputs;
//! `cargo bolero test -p daxkv-fuzz --test core_model core_model` runs it
//! coverage-guided.

use std::collections::{BTreeSet, HashMap};

use bolero::{check, TypeGenerator};
use daxkv::device::arena::ArenaSpec;
use daxkv::{CoreConfig, DaxCore, Key, PutError, PutOutcome, ReadSet};

const SLOT: usize = 256;
const START_SLOTS: usize = 4;
const MAX_SLOTS: usize = 8;

#[derive(Clone, Copy, Debug, TypeGenerator)]
enum Op {
    Put { key: u8, len: u16, seed: u8 },
    Exists { key: u8, lock: bool },
    Unlock { key: u8 },
    Load { key: u8, short: bool },
    Delete { key: u8, force: bool },
    BeginRead { key: u8 },
    EndRead,
    Evict { n: u8 },
    Remap { slots: u8 },
}

#[derive(Debug)]
struct Entry {
    data: Vec<u8>,
    locks: u32,
    slot: usize,
}

#[derive(Default)]
struct Model {
    keys: HashMap<u8, Entry>,
    /// Slots in use: by a key or by an open read of a deleted key.
    used: BTreeSet<usize>,
    /// Open reads: (key, slot).
    reads: Vec<(u8, usize)>,
    max_slots: usize,
}

impl Model {
    fn release_slot_if_idle(&mut self, slot: usize) {
        let held = self.keys.values().any(|e| e.slot == slot)
            || self.reads.iter().any(|&(_, s)| s == slot);
        if !held {
            self.used.remove(&slot);
        }
    }
    fn lowest_free(&self) -> Option<usize> {
        (0..self.max_slots).find(|s| !self.used.contains(s))
    }
}

fn key(k: u8) -> Key {
    Key::digest(&[k % 12])
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(37) ^ seed)
        .collect()
}

fn run(ops: &[Op]) {
    let spec = ArenaSpec::memfd(START_SLOTS * SLOT).max_size_bytes(MAX_SLOTS * SLOT);
    let core = DaxCore::open(&CoreConfig::new(spec, SLOT)).unwrap();
    let mut m = Model {
        max_slots: START_SLOTS,
        ..Model::default()
    };
    let mut sets: Vec<ReadSet<'_>> = Vec::new();
    for (step, &op) in ops.iter().enumerate() {
        match op {
            Op::Put { key: kk, len, seed } => {
                let kk = kk % 12;
                let len = usize::from(len) % (SLOT + 8);
                let data = bytes(seed, len);
                let got = core.put(key(kk), &data, 0);
                // Size is checked first, as upstream's `_put_one` does.
                let want = if len > SLOT {
                    Err(PutError::TooLarge {
                        len,
                        slot_bytes: SLOT,
                    })
                } else if m.keys.contains_key(&kk) {
                    Ok(PutOutcome::AlreadyPresent)
                } else if let Some(slot) = m.lowest_free() {
                    m.used.insert(slot);
                    m.keys.insert(
                        kk,
                        Entry {
                            data,
                            locks: 0,
                            slot,
                        },
                    );
                    Ok(PutOutcome::Stored)
                } else {
                    Err(PutError::Full)
                };
                assert_eq!(got, want, "step {step}: {op:?}");
            }
            Op::Exists { key: kk, lock } => {
                let kk = kk % 12;
                let want = m
                    .keys
                    .get_mut(&kk)
                    .map(|e| {
                        if lock {
                            e.locks += 1;
                        }
                    })
                    .is_some();
                assert_eq!(core.exists(key(kk), lock), want, "step {step}: {op:?}");
            }
            Op::Unlock { key: kk } => {
                let kk = kk % 12;
                if let Some(e) = m.keys.get_mut(&kk) {
                    e.locks = e.locks.saturating_sub(1);
                }
                core.unlock_many(&[key(kk)]);
            }
            Op::Load { key: kk, short } => {
                let kk = kk % 12;
                let want_len = m.keys.get(&kk).map(|e| e.data.len());
                let cap = match (short, want_len) {
                    (true, Some(n)) if n > 0 => n - 1,
                    _ => SLOT,
                };
                let mut buf = vec![0xAAu8; cap];
                let got = core.load_into(key(kk), &mut buf);
                match (want_len, short) {
                    (Some(n), true) if n > 0 => {
                        assert_eq!(got, None, "step {step}: short buffer");
                        assert!(
                            buf.iter().all(|&b| b == 0xAA),
                            "step {step}: short buffer touched"
                        );
                    }
                    (Some(n), _) => {
                        assert_eq!(got, Some(n), "step {step}: {op:?}");
                        assert_eq!(&buf[..n], &m.keys[&kk].data[..], "step {step}: bytes");
                    }
                    (None, _) => assert_eq!(got, None, "step {step}: {op:?}"),
                }
            }
            Op::Delete { key: kk, force } => {
                let kk = kk % 12;
                let want = match m.keys.get(&kk) {
                    Some(e) if e.locks == 0 || force => {
                        let slot = e.slot;
                        m.keys.remove(&kk);
                        m.release_slot_if_idle(slot);
                        true
                    }
                    _ => false,
                };
                assert_eq!(
                    core.delete_many(&[key(kk)], force),
                    vec![want],
                    "step {step}: {op:?}"
                );
            }
            Op::BeginRead { key: kk } => {
                let kk = kk % 12;
                let set = core.reserve_reads(&[key(kk)], false);
                match m.keys.get(&kk) {
                    Some(e) => {
                        assert_eq!(set.len(), 1, "step {step}");
                        let mut buf = vec![0u8; SLOT];
                        let n = set.read(&set.items()[0], &mut buf).unwrap();
                        assert_eq!(&buf[..n], &e.data[..], "step {step}: borrowed bytes");
                        m.reads.push((kk, e.slot));
                        sets.push(set);
                    }
                    None => assert!(set.is_empty(), "step {step}"),
                }
            }
            Op::EndRead => {
                if !sets.is_empty() {
                    drop(sets.remove(0));
                    let (_, slot) = m.reads.remove(0);
                    m.release_slot_if_idle(slot);
                }
            }
            Op::Evict { n } => {
                let cands = core.eviction_candidates(usize::from(n % 6));
                let mut seen = BTreeSet::new();
                for c in &cands {
                    assert!(seen.insert(*c), "step {step}: duplicate candidate");
                    let e = m
                        .keys
                        .iter()
                        .find(|(kk, _)| key(**kk) == *c)
                        .map(|(_, e)| e);
                    let e =
                        e.unwrap_or_else(|| panic!("step {step}: candidate is not a stored key"));
                    assert_eq!(e.locks, 0, "step {step}: locked key offered for eviction");
                }
            }
            Op::Remap { slots } => {
                let new = 1 + usize::from(slots) % MAX_SLOTS;
                let can = m.used.iter().all(|&s| s < new);
                let got = if sets.is_empty() {
                    core.remap(new * SLOT).is_ok()
                } else {
                    // A remap waits for open reads; only check the predicate.
                    assert_eq!(
                        core.can_shrink_to(new) || new >= m.max_slots,
                        can || new >= m.max_slots,
                        "step {step}"
                    );
                    continue;
                };
                assert_eq!(
                    got, can,
                    "step {step}: remap to {new} slots, used {:?}",
                    m.used
                );
                if got {
                    m.max_slots = new;
                }
            }
        }
        if sets.is_empty() {
            core.check_invariants()
                .unwrap_or_else(|e| panic!("step {step} {op:?}: {e}"));
        }
        let used = m.used.len() as f64 / m.max_slots as f64;
        assert_eq!(core.usage().0, used, "step {step}: usage after {op:?}");
        assert_eq!(core.live_slot_count(), m.used.len(), "step {step}");
    }
    drop(sets);
    // Tear down: everything unlocks and deletes, nothing leaks.
    let all: Vec<Key> = (0..12).map(key).collect();
    core.delete_many(&all, true);
    assert_eq!(core.live_slot_count(), 0);
    core.check_invariants().unwrap();
}

#[test]
fn core_model() {
    check!().with_type::<Vec<Op>>().for_each(|ops| run(ops));
}
