//! The house rules for unsafe code and atomics, checked over `src/`:
//! every atomic operation has an `// ORDERING:` note just above it, and
//! every `unsafe` block a `// SAFETY:` note
//! (clippy's `undocumented_unsafe_blocks` checks blocks; this also covers
//! `unsafe impl`). Test modules (`mod tests` onwards) are exempt.

use std::path::{Path, PathBuf};

/// How many lines above an atomic operation its note may stand (a note
/// covers one statement, which rustfmt may spread over several lines).
const WINDOW_LINES: usize = 16;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn missing(needle: &str, note: &str, skip: impl Fn(&str) -> bool) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    files.sort();
    let mut bad = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let t = l.trim();
            if t.starts_with("mod tests") || t.starts_with("pub mod tests") {
                break;
            }
            if !t.contains(needle) || t.starts_with("//") || skip(t) {
                continue;
            }
            let from = i.saturating_sub(WINDOW_LINES);
            if !lines[from..=i].iter().any(|w| w.contains(note)) {
                bad.push(format!("{}:{}: {t}", f.display(), i + 1));
            }
        }
    }
    bad
}

#[test]
fn every_atomic_operation_has_an_ordering_note() {
    let bad = missing("Ordering::", "ORDERING:", |t| {
        t.starts_with("use ") || t.starts_with("pub use ")
    });
    assert!(
        bad.is_empty(),
        "atomics without an ORDERING note:\n{}",
        bad.join("\n")
    );
}

#[test]
fn every_unsafe_block_and_impl_has_a_safety_note() {
    let bad = missing("unsafe ", "SAFETY:", |t| {
        t.starts_with("pub unsafe fn")
            || t.starts_with("unsafe fn")
            || t.starts_with("pub(crate) unsafe fn")
            || t.contains("unsafe trait")
            || t.contains("unsafe_op_in_unsafe_fn")
            || t.contains("#![forbid(unsafe_code)]")
    });
    assert!(
        bad.is_empty(),
        "unsafe without a SAFETY note:\n{}",
        bad.join("\n")
    );
}
