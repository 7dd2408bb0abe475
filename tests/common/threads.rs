//! Shared by tests that count this process's threads (included with
//! `#[path]`, not a test crate).

/// Live threads of this process: the kernel's count (`Threads:` of
/// `/proc/self/status`), not a walk of `/proc/self/task`, which resumes by
/// index and can skip live threads while others exit.
pub fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap()
}
