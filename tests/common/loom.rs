//! Shared by the loom tests (included with `#[path]`, not a test crate).

/// Explore `f` under loom with a preemption bound of 3: enough for the
/// two- and three-thread protocols modelled here, small enough for CI.
pub fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}
