//! The SPSC ring against a `VecDeque` oracle: random push / sync / pop /
//! release sequences, one thread, heap and memfd storage.

use std::collections::VecDeque;

use bolero::{check, TypeGenerator};
use daxkv::ring::{PushError, Ring};

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
