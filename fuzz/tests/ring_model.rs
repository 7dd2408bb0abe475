//! The SPSC ring against a `VecDeque` oracle: random push / sync / pop /
//! release sequences, one thread, heap and memfd storage; and the consumer
//! against a hostile peer writing garbage into the shared header and
//! entries, with the index window as the oracle.

use std::collections::VecDeque;

use bolero::{check, TypeGenerator};
use daxkv::plumbing::ring::{PushError, Ring, RingError};

#[derive(Clone, Copy, Debug, TypeGenerator)]
enum Op {
    Push(u64),
    PublishP,
    Pop,
    ReleaseC,
}

fn run(ops: &[Op], memfd: bool) {
    const CAP: u32 = 8;
    let r = if memfd {
        Ring::<u64>::memfd(CAP).unwrap().0
    } else {
        Ring::<u64>::heap(CAP).unwrap()
    };
    let (mut p, mut c) = r.split();
    // Oracle: pushed-unpublished, published-unpopped, popped-unreleased.
    let (mut staged, mut visible) = (VecDeque::new(), VecDeque::new());
    let mut unreleased = 0u32;
    for (step, &op) in ops.iter().enumerate() {
        match op {
            Op::Push(v) => {
                let used = (staged.len() + visible.len()) as u32 + unreleased;
                match p.push(v) {
                    Ok(()) => {
                        assert!(used < CAP, "step {step}: push into a full ring");
                        staged.push_back(v);
                    }
                    Err(PushError::Full(back)) => {
                        assert_eq!(back, v, "step {step}: Full hands the entry back");
                        assert_eq!(used, CAP, "step {step}: Full with space left");
                    }
                    Err(PushError::Corrupt(e)) => panic!("step {step}: {e}"),
                }
            }
            Op::PublishP => {
                p.sync();
                visible.extend(staged.drain(..));
            }
            Op::Pop => {
                let got = c.pop().unwrap();
                assert_eq!(got, visible.pop_front(), "step {step}");
                if got.is_some() {
                    unreleased += 1;
                }
            }
            Op::ReleaseC => {
                c.sync();
                unreleased = 0;
            }
        }
    }
}

#[test]
fn ring_model() {
    check!().with_type::<Vec<Op>>().for_each(|ops| {
        run(ops, false);
        run(ops, true);
    });
}

/// What the other process does to a shared ring (or the consumer here).
#[derive(Clone, Copy, Debug, TypeGenerator)]
enum PeerOp {
    /// A well-behaved publish of one entry (it may overrun the ring: the
    /// peer does not look at `head`).
    Publish(u64),
    /// Garbage in `tail`: any value, or one near the current one.
    Tail(u32),
    TailNear(i8),
    /// Garbage in the words the peer does not own, or in plain fields.
    Head(u32),
    Flags(u32),
    Plain(u8, u32),
    /// Garbage in an entry.
    Entry(u8, u64),
    // The real consumer's operations.
    Pop,
    Release,
    Available,
    PrepareWait,
    IsOrphaned,
}

/// The real consumer over a real memfd while the test plays a broken
/// producer on the other side (writing the file with `pwrite`, which the
/// mapping sees): the oracle states the consumer's window (ring module doc)
/// — a tail more than a ring past `released`, or behind the last tail
/// accepted, is `Corrupt` and changes nothing; otherwise exactly the
/// entries up to it are served, with whatever bytes the peer left in them;
/// plain header fields and `head` scribbles change nothing.
///
/// Without the window check (`available` checking only `tail - released`
/// and returning `tail - head`) this model fails at once: the first
/// failing input (22 steps) has a tail moved back behind the accepted one
/// answered `Ok` instead of `Corrupt`.
fn run_hostile(ops: &[PeerOp]) {
    use daxkv::plumbing::ring::{layout, Consumer, HEADER_BYTES};
    use std::os::unix::fs::FileExt;
    const CAP: u32 = 8;
    let (ring, fd) = Ring::<u64>::memfd(CAP).unwrap();
    let mut c = Consumer::new(ring).unwrap();
    let put32 = |off: usize, v: u32| fd.write_all_at(&v.to_ne_bytes(), off as u64).unwrap();
    let entry_off = |i: u32| (HEADER_BYTES + (i & (CAP - 1)) as usize * 8) as u64;
    // Oracle.
    let (mut released, mut head, mut accepted, mut tail) = (0u32, 0u32, 0u32, 0u32);
    let mut flags = 0u32;
    let mut mem = [0u64; CAP as usize];
    // The consumer's window (ring module doc): `None` is Corrupt.
    let window = |accepted: &mut u32, tail: u32, released: u32, head: u32| {
        let used = tail.wrapping_sub(released);
        if used > CAP || used < accepted.wrapping_sub(released) {
            None
        } else {
            *accepted = tail;
            Some(tail.wrapping_sub(head))
        }
    };
    for (step, &op) in ops.iter().enumerate() {
        match op {
            PeerOp::Publish(v) => {
                mem[(tail & (CAP - 1)) as usize] = v;
                fd.write_all_at(&v.to_ne_bytes(), entry_off(tail)).unwrap();
                tail = tail.wrapping_add(1);
                put32(layout::TAIL, tail);
            }
            PeerOp::Tail(t) => {
                tail = t;
                put32(layout::TAIL, tail);
            }
            PeerOp::TailNear(d) => {
                tail = tail.wrapping_add(i32::from(d) as u32);
                put32(layout::TAIL, tail);
            }
            PeerOp::Head(h) => put32(layout::HEAD, h),
            PeerOp::Flags(f) => {
                flags = f;
                put32(layout::FLAGS, f);
            }
            PeerOp::Plain(which, v) => {
                let off = [
                    layout::MAGIC,
                    layout::VERSION,
                    layout::CAPACITY,
                    layout::ENTRY_BYTES,
                ][usize::from(which % 4)];
                put32(off, v);
            }
            PeerOp::Entry(i, v) => {
                let i = u32::from(i);
                mem[(i & (CAP - 1)) as usize] = v;
                fd.write_all_at(&v.to_ne_bytes(), entry_off(i)).unwrap();
            }
            PeerOp::Pop => {
                let got = c.pop();
                if head == accepted {
                    match window(&mut accepted, tail, released, head) {
                        None => expect_corrupt(&got, tail, step),
                        Some(0) => assert_eq!(got, Ok(None), "step {step}"),
                        Some(_) => {
                            assert_eq!(
                                got,
                                Ok(Some(mem[(head & (CAP - 1)) as usize])),
                                "step {step}"
                            );
                            head = head.wrapping_add(1);
                        }
                    }
                } else {
                    assert_eq!(
                        got,
                        Ok(Some(mem[(head & (CAP - 1)) as usize])),
                        "step {step}"
                    );
                    head = head.wrapping_add(1);
                }
            }
            PeerOp::Release => {
                c.sync();
                released = head;
            }
            PeerOp::Available => {
                let got = c.available();
                match window(&mut accepted, tail, released, head) {
                    None => expect_corrupt(&got, tail, step),
                    Some(n) => assert_eq!(got, Ok(n), "step {step}"),
                }
            }
            PeerOp::PrepareWait => {
                let got = c.prepare_wait();
                flags |= 1;
                match window(&mut accepted, tail, released, head) {
                    None => expect_corrupt(&got, tail, step),
                    Some(0) => assert_eq!(got, Ok(true), "step {step}"),
                    Some(_) => assert_eq!(got, Ok(false), "step {step}"),
                }
                c.end_wait();
                flags &= !1;
            }
            PeerOp::IsOrphaned => {
                let got = c.is_orphaned();
                let want = flags & 2 != 0
                    && !matches!(window(&mut accepted, tail, released, head), Some(n) if n > 0);
                assert_eq!(got, want, "step {step}");
            }
        }
    }
}

fn expect_corrupt<T: std::fmt::Debug>(r: &Result<T, RingError>, tail: u32, step: usize) {
    match r {
        Err(RingError::Corrupt { tail: t, .. }) => assert_eq!(*t, tail, "step {step}"),
        other => panic!("step {step}: expected Corrupt for tail {tail}, got {other:?}"),
    }
}

#[test]
fn ring_model_hostile_peer() {
    check!()
        .with_type::<Vec<PeerOp>>()
        .for_each(|ops| run_hostile(ops));
}
