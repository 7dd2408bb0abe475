//! GPU-direct stores and loads with raw pointers (docs/leases.md): what
//! a Rust inference server does with the engine's slot leases and mapping
//! observer. Without a GPU this example stands a host `memcpy` in for the
//! copy engine; the comments say where the CUDA calls go.
//!
//! `cargo run --release --example gpu_direct`

use std::sync::{Arc, Mutex};

use daxkv::device::arena::{ArenaSpec, Region};
use daxkv::engine::{DeviceId, DeviceObserver, DeviceSpec, Engine, EngineLeased, EngineOptions};
use daxkv::{CoreConfig, Key};

const SLOT: usize = 256 * 1024;

/// Registers every device mapping with CUDA and unregisters it before it
/// goes: `cuMemHostRegister(base, len, PORTABLE)` in `mapped`,
/// `cuMemHostUnregister(base)` in `unmapping`. Here it only records them.
#[derive(Default)]
struct Registrar(Mutex<Vec<(DeviceId, usize, usize)>>);

impl DeviceObserver for Registrar {
    fn mapped(&self, device: DeviceId, r: &Region) {
        // cuMemHostRegister(r.base, r.len, CU_MEMHOSTREGISTER_PORTABLE)
        self.0.lock().unwrap().push((device, r.base, r.len));
    }
    fn unmapping(&self, _: DeviceId, r: &Region) {
        // cuMemHostUnregister(r.base)
        self.0.lock().unwrap().retain(|&(_, b, _)| b != r.base);
    }
}

fn main() {
    let dev = DeviceSpec {
        path: "memfd".into(),
        core: CoreConfig::new(ArenaSpec::memfd(64 * SLOT), SLOT),
    };
    let engine = Engine::open(vec![dev], SLOT, false, EngineOptions::default()).unwrap();
    let registrar = Arc::new(Registrar::default());
    assert!(engine.observe(registrar.clone()));
    println!("registered: {:?}", registrar.0.lock().unwrap());

    // "GPU memory": the KV chunks to spill.
    let chunks: Vec<Vec<u8>> = (0..8u8).map(|i| vec![i; SLOT]).collect();
    let keys: Vec<Key> = (0..8u64).map(|i| Key::digest(&i.to_le_bytes())).collect();

    // Store: lease a slot per key, copy into it, wait, commit.
    let mut leases = Vec::new();
    for r in engine.lease_store(&keys, &[SLOT; 8]).unwrap() {
        match r {
            Ok(EngineLeased::Leased(l)) => leases.push(l),
            Ok(EngineLeased::AlreadyPresent) => {}
            Err(e) => eprintln!("not leased: {e}"),
        }
    }
    for (l, c) in leases.iter().zip(&chunks) {
        // cudaMemcpyAsync(l.ptr(), gpu_chunk, l.len(), DeviceToHost, stream)
        // SAFETY: a store lease hands out `len()` writable bytes at
        // `ptr()` until it ends; `c` is at least that long.
        unsafe { std::ptr::copy_nonoverlapping(c.as_ptr(), l.ptr(), l.len()) };
    }
    // cudaStreamSynchronize(stream): every copy finished before the commit.
    let mut answers = Vec::new();
    let stored = engine.commit_into(&mut leases, &mut answers);
    println!("stored {stored} chunks by lease");

    // Load: read-lease each slot, copy out of it, wait, release.
    let mut back = vec![vec![0u8; SLOT]; keys.len()];
    let reads = engine.lease_load(&keys);
    for (r, dst) in reads.iter().zip(back.iter_mut()) {
        if let Ok(Some(l)) = r {
            // cudaMemcpyAsync(gpu_dst, l.ptr(), l.len(), HostToDevice, stream)
            // SAFETY: a read lease hands out `len()` readable bytes at
            // `ptr()` until it ends.
            unsafe { std::ptr::copy_nonoverlapping(l.ptr(), dst.as_mut_ptr(), l.len()) };
        }
    }
    // cudaStreamSynchronize(stream), then release (drop) the read leases.
    drop(reads);
    assert_eq!(back, chunks);
    println!("loaded {} chunks by lease, bytes verified", back.len());
    engine.close();
    println!("after close: {:?}", registrar.0.lock().unwrap());
}
