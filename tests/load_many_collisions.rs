//! A second hostile review (issue 20's per-object work), kept as evidence
//! (it passed): `load_many_into` after
//! 2250aff (borrow, copy, release per key; no read set) racing deletes and
//! re-puts of the same keys, all with one home bucket (their buckets share
//! one probe run, tombstones reused across keys). Every hit must carry the
//! key's own stamp; a miss is fine.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use daxkv::device::arena::{ArenaSource, ArenaSpec};
use daxkv::{CoreConfig, DaxCore, Key};

const SLOT: usize = 4096;
const KEYS: u64 = 12;

/// Home bucket 0, fingerprint `fp` (as `tests/loom_core.rs`'s `home0`).
fn home0(fp: u64) -> Key {
    Key::from_u128((u128::from(fp) << 96) | u128::from(fp))
}

fn stamp(i: u64, round: u64, len: usize) -> Vec<u8> {
    let mut v = vec![(i as u8) ^ 0x5a; len];
    v[..8].copy_from_slice(&i.to_le_bytes());
    v[8..16].copy_from_slice(&round.to_le_bytes());
    v
}

#[test]
fn load_many_into_never_returns_another_keys_bytes_under_colliding_deletes_and_reputs() {
    let core = Arc::new(
        DaxCore::open(&CoreConfig::new(
            ArenaSpec::new(ArenaSource::Memfd, 32 * SLOT),
            SLOT,
        ))
        .unwrap(),
    );
    let keys: Vec<Key> = (1..=KEYS).map(home0).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let puts = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..2)
        .map(|w| {
            let (core, keys, stop, puts) = (
                Arc::clone(&core),
                keys.clone(),
                Arc::clone(&stop),
                Arc::clone(&puts),
            );
            std::thread::spawn(move || {
                let mut round = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    round += 1;
                    for (i, &k) in keys.iter().enumerate() {
                        if (i as u64 + round + w).is_multiple_of(3) {
                            core.delete(k, round.is_multiple_of(2));
                        } else {
                            // Lengths differ per key and round: a wrong
                            // length would show as well as wrong bytes.
                            let len = 64 + ((i * 131 + round as usize * 17) % 3000);
                            let _ = core.put(k, &stamp(i as u64, round, len), 0);
                            puts.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    let t0 = Instant::now();
    let (mut hits, mut loads) = (0u64, 0u64);
    let mut bufs: Vec<Vec<u8>> = (0..KEYS).map(|_| vec![0u8; SLOT]).collect();
    while t0.elapsed() < Duration::from_secs(3) {
        for b in &mut bufs {
            b.fill(0xee);
        }
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let out = core.load_many_into(&keys, &mut slices).unwrap();
        loads += 1;
        for (i, &hit) in out.iter().enumerate() {
            if !hit {
                continue;
            }
            hits += 1;
            let b = &bufs[i];
            let id = u64::from_le_bytes(b[..8].try_into().unwrap());
            assert_eq!(id, i as u64, "key {i} loaded key {id}'s bytes");
            let round = u64::from_le_bytes(b[8..16].try_into().unwrap());
            let len = 64 + ((i * 131 + round as usize * 17) % 3000);
            let want = (i as u8) ^ 0x5a;
            assert!(
                b[16..len].iter().all(|&x| x == want),
                "key {i} round {round}: torn or foreign payload"
            );
            assert!(
                b[len..].iter().all(|&x| x == 0xee),
                "key {i}: bytes written past its payload"
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    eprintln!(
        "{loads} batches, {hits} hits, {} puts",
        puts.load(Ordering::Relaxed)
    );
    assert!(hits > 0);
    core.check_invariants().unwrap();
}
