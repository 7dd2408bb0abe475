//! The per-object path in a loop, for `valgrind --tool=callgrind` and
//! `perf record` (see perf/README.md): N puts, lock-lookups, loads, unlocks
//! and deletes of small objects in tasks of 16 keys on a memfd arena.
//!
//! `cargo run --release --example per_object -- [objects] [size_bytes]`

use daxkv::device::arena::ArenaSpec;
use daxkv::{CoreConfig, DaxCore, Key};

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(4096);
    let size: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(4096);
    let core = DaxCore::open(&CoreConfig::new(
        ArenaSpec::memfd(n * size).populate(true),
        size,
    ))
    .expect("open");
    let keys: Vec<Key> = (0..n as u64)
        .map(|i| Key::digest(&i.to_le_bytes()))
        .collect();
    let src = vec![0x5Au8; size];
    let mut dst: Vec<Vec<u8>> = (0..16).map(|_| vec![0u8; size]).collect();
    let bufs: Vec<&[u8]> = (0..16).map(|_| &src[..]).collect();
    for round in 0..4 {
        for chunk in keys.chunks(16) {
            let ok = core.put_many(chunk, &bufs[..chunk.len()]).expect("put");
            assert!(ok.iter().all(|&b| b));
        }
        for chunk in keys.chunks(16) {
            assert!(core.exists_many(chunk, true).iter().all(|&b| b));
        }
        for chunk in keys.chunks(16) {
            let mut d: Vec<&mut [u8]> = dst
                .iter_mut()
                .take(chunk.len())
                .map(|v| &mut v[..])
                .collect();
            assert!(core
                .load_many_into(chunk, &mut d)
                .expect("load")
                .iter()
                .all(|&b| b));
        }
        for chunk in keys.chunks(16) {
            core.unlock_many(chunk);
        }
        for chunk in keys.chunks(16) {
            assert!(core.delete_many(chunk, false).iter().all(|&b| b));
        }
        assert_eq!(core.live_slot_count(), 0, "round {round}");
    }
}
