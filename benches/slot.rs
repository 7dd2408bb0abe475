//! slot/*: the free bitmap and the state word, next to a `Mutex<Vec>` free
//! list (the baseline a locked allocator would be).

use std::sync::Mutex;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use daxkv::device::slot::{Bitmap, Commit, SlotState};

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("slot/claim_release");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    let bm = Bitmap::new(1 << 16, 1 << 16);
    // Half full, so claims scan past taken words.
    for _ in 0..(1 << 15) {
        bm.claim().unwrap();
    }
    g.bench_function("bitmap", |b| {
        b.iter(|| {
            let s = bm.claim().unwrap();
            bm.release(s);
        });
    });
    let list = Mutex::new((0..(1u32 << 15)).collect::<Vec<u32>>());
    g.bench_function("mutex_freelist", |b| {
        b.iter(|| {
            let s = list.lock().unwrap().pop().unwrap();
            list.lock().unwrap().push(s);
        });
    });
    g.finish();

    let mut g = c.benchmark_group("slot/state");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    let st = SlotState::new();
    let gen = st.reserve();
    assert_eq!(st.commit(gen), Ok(Commit::Committed));
    g.bench_function("lock_unlock", |b| {
        b.iter(|| {
            st.lock(gen).unwrap();
            st.unlock(gen).unwrap();
        });
    });
    g.bench_function("borrow_release", |b| {
        b.iter(|| {
            st.borrow(gen).unwrap();
            st.release(gen).unwrap();
        });
    });
    let cyc = SlotState::new();
    g.bench_function("reserve_commit_detach_unlink", |b| {
        b.iter(|| {
            let gen = cyc.reserve();
            cyc.commit(gen).unwrap();
            cyc.detach(gen, false).unwrap();
            assert!(cyc.unlink(gen).unwrap().freed);
        });
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
