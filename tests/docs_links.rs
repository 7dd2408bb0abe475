//! The repository stands on its own: no file cites documents outside it,
//! and every `docs/<name>.md §N` citation names a section that exists.
//!
//! Checked over every `.rs`, `.md` and `.sh` file of the repository
//! (build outputs excluded):
//! - no mention of the notes the project started from, which live outside
//!   the repository (the parent folder's `shared` notes, the design and
//!   style notes by their old file names); their content is in `docs/`;
//! - every mentioned `docs/<name>.md` exists;
//! - every section sign followed by a number N (8.1, "3.6 step 3", "1–6")
//!   is attributed to the last `docs/<name>.md` mentioned before it on its
//!   line or, outside `docs/`, on the two lines before (a citation may wrap);
//!   inside `docs/<name>.md` a number with no other document before it on its
//!   line cites that file itself. The cited file must have a heading
//!   numbered N (`## 8. …`, `### 8.1 …`). A number that names no document
//!   is an error: cite it with the document's path.
//! - every repository path mentioned (`src/device/slot.rs`, `tests/`,
//!   `python/src/l2.rs`, `src/engine/`: a path under one of [`TREES`] that
//!   ends in a file name with an extension, or in `/`) exists, relative to
//!   the root, to the mentioning file's folder, or to the Python or fuzz
//!   crate that holds it; so a moved file leaves no stale path behind.
//!   `docs/lmcache-dax-behavior.md` is exempt: it cites LMCache's tree
//!   (its own test folders), not this one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Lines before a `§` searched for the document it cites (a citation may
/// wrap in a comment or paragraph).
const LOOKBACK_LINES: usize = 2;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The repository's top-level folders whose paths the documents cite.
const TREES: [&str; 9] = [
    "src", "tests", "benches", "examples", "fuzz", "scripts", "perf", "docs", "python",
];

/// Files that cite another repository's paths, not this one's.
const FOREIGN_PATHS: [&str; 1] = ["docs/lmcache-dax-behavior.md"];

/// Repository paths mentioned in `line`: `TREE/…` not preceded by a path
/// character, ending in `.ext` (a file) or followed by `/` (a folder).
/// Globs and brace lists (`tests/loom_*.rs`, `src/{a,b}.rs`) stop at their
/// first special character, and then name no file (or name the folder).
fn path_mentions(line: &str) -> Vec<String> {
    let is_path = |c: char| c.is_ascii_alphanumeric() || "_./-".contains(c);
    let mut out = Vec::new();
    for (at, _) in line.char_indices() {
        if line[..at].chars().next_back().is_some_and(is_path) {
            continue;
        }
        let rest = &line[at..];
        if !TREES
            .iter()
            .any(|t| rest.starts_with(t) && rest[t.len()..].starts_with('/'))
        {
            continue;
        }
        let end = rest.find(|c: char| !is_path(c)).unwrap_or(rest.len());
        let token = rest[..end].trim_end_matches(['.', '-']);
        let folder = token.ends_with('/');
        let name = token.rsplit('/').next().unwrap_or("");
        let file = name.rsplit_once('.').is_some_and(|(stem, ext)| {
            !stem.is_empty() && matches!(ext, "rs" | "md" | "sh" | "py" | "toml")
        });
        if folder || file {
            out.push(token.to_string());
        }
    }
    out
}

/// Whether `path`, mentioned in the file `rel`, exists.
fn path_exists(root: &Path, rel: &str, path: &str) -> bool {
    let here = Path::new(rel).parent().unwrap_or(Path::new(""));
    let mut bases = vec![root.to_path_buf(), root.join(here)];
    for krate in ["python", "fuzz"] {
        if rel.starts_with(&format!("{krate}/")) {
            bases.push(root.join(krate));
        }
    }
    bases.iter().any(|b| b.join(path).exists())
}

/// Every `.rs`, `.md` and `.sh` file under `dir`, skipping build outputs,
/// fuzzing corpora and VCS metadata.
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if p.is_dir() {
            if !matches!(
                name.as_str(),
                "target" | ".git" | "corpus" | "artifacts" | "node_modules"
            ) {
                files(&p, out);
            }
        } else if p
            .extension()
            .is_some_and(|x| x == "rs" || x == "md" || x == "sh")
        {
            out.push(p);
        }
    }
}

/// The section numbers of `text`'s headings: `## 8. Upstream` gives "8",
/// `### 8.1 tests/…` gives "8.1".
fn sections(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.starts_with('#'))
        .filter_map(|l| {
            let t = l.trim_start_matches('#').trim();
            let first = t.split_whitespace().next()?.trim_end_matches('.');
            (!first.is_empty() && first.chars().all(|c| c.is_ascii_digit() || c == '.'))
                .then(|| first.to_string())
        })
        .collect()
}

/// `docs/<name>.md` mentions in `line`, with their byte offsets.
fn doc_mentions(line: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = line[from..].find("docs/") {
        let start = from + at;
        let rest = &line[start..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || "/-_.".contains(c)))
            .unwrap_or(rest.len());
        let name = rest[..end].trim_end_matches('.');
        if let Some(stem) = name.strip_suffix(".md") {
            if !stem.contains('/') || stem.starts_with("docs/") {
                out.push((start, name.to_string()));
            }
        }
        from = start + "docs/".len();
    }
    out
}

/// The section number after each `§` in `line`, with its byte offset.
fn citations(line: &str) -> Vec<(usize, String)> {
    line.match_indices('§')
        .filter_map(|(at, s)| {
            let rest = &line[at + s.len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .unwrap_or(rest.len());
            let n = rest[..end].trim_end_matches('.');
            (!n.is_empty()).then(|| (at, n.to_string()))
        })
        .collect()
}

fn problems() -> Vec<String> {
    let root = root();
    let mut all = Vec::new();
    files(&root, &mut all);
    all.sort();
    // Assembled so this file does not trip its own check.
    let forbidden = [
        format!("../{}", "shared"),
        format!("{}.md", "DESIGN"),
        format!("{}.md", "STYLE"),
    ];
    let mut heads: HashMap<String, Option<Vec<String>>> = HashMap::new();
    let mut bad = Vec::new();
    for f in all {
        let rel = f
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let text = std::fs::read_to_string(&f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let at = format!("{rel}:{}", i + 1);
            if !FOREIGN_PATHS.contains(&rel.as_str()) {
                for path in path_mentions(line) {
                    if !path_exists(&root, &rel, &path) {
                        bad.push(format!("{at}: `{path}` does not exist"));
                    }
                }
            }
            for word in &forbidden {
                if line.contains(word.as_str()) {
                    bad.push(format!(
                        "{at}: mentions `{word}`, outside the repository: cite docs/ instead"
                    ));
                }
            }
            let mentions = doc_mentions(line);
            for (_, doc) in &mentions {
                let known = heads.entry(doc.clone()).or_insert_with(|| {
                    std::fs::read_to_string(root.join(doc))
                        .ok()
                        .map(|t| sections(&t))
                });
                if known.is_none() {
                    bad.push(format!("{at}: `{doc}` does not exist"));
                }
            }
            for (pos, n) in citations(line) {
                let same_line = mentions.iter().rev().find(|(p, _)| *p < pos);
                let in_docs = rel.starts_with("docs/");
                let earlier = || {
                    if in_docs {
                        return None;
                    }
                    lines[i.saturating_sub(LOOKBACK_LINES)..i]
                        .iter()
                        .rev()
                        .find_map(|l| doc_mentions(l).pop())
                };
                let doc = same_line
                    .cloned()
                    .or_else(earlier)
                    .map(|(_, d)| d)
                    .or_else(|| in_docs.then(|| rel.clone()));
                let Some(doc) = doc else {
                    bad.push(format!(
                        "{at}: `§{n}` names no document: write `docs/<name>.md §{n}`"
                    ));
                    continue;
                };
                let known = heads.entry(doc.clone()).or_insert_with(|| {
                    std::fs::read_to_string(root.join(&doc))
                        .ok()
                        .map(|t| sections(&t))
                });
                match known {
                    None => {} // reported with the mention
                    Some(s) if s.contains(&n) => {}
                    Some(_) => bad.push(format!("{at}: `{doc} §{n}`: no such section")),
                }
            }
        }
    }
    bad
}

#[test]
fn sections_are_parsed_from_numbered_headings() {
    let s = sections("# Title\n## 1. Intro\n### 1.1 Types\n## 10. Numbers\n#### Not numbered\n");
    assert_eq!(s, ["1", "1.1", "10"]);
    assert_eq!(
        citations("(x.md \u{a7}8.1 items 1 and 12, \u{a7}8.3 item 1; \u{a7}1\u{2013}\u{a7}6.)")
            .into_iter()
            .map(|(_, n)| n)
            .collect::<Vec<_>>(),
        ["8.1", "8.3", "1", "6"]
    );
    assert_eq!(
        doc_mentions("see `docs/design.md` and docs/lmcache-dax-behavior.md, and docs/x.txt")
            .into_iter()
            .map(|(_, d)| d)
            .collect::<Vec<_>>(),
        ["docs/design.md", "docs/lmcache-dax-behavior.md"]
    );
}

#[test]
fn paths_are_found_in_prose_and_code() {
    assert_eq!(
        path_mentions("see `src/device/slot.rs`, src/engine/ and (tests/loom_*.rs); x/src/a.rs"),
        ["src/device/slot.rs", "src/engine/"]
    );
    assert_eq!(
        path_mentions("`python/tests/test_edges.py::test_fork`, scripts/test.sh."),
        ["python/tests/test_edges.py", "scripts/test.sh"]
    );
    assert_eq!(
        path_mentions("src/host/{numa,probe}.rs and docs/x.txt and tests/foo"),
        ["src/host/"]
    );
}

#[test]
fn the_repository_cites_only_its_own_documents_and_existing_sections() {
    let bad = problems();
    assert!(
        bad.is_empty(),
        "{} broken or outside citations:\n{}",
        bad.len(),
        bad.join("\n")
    );
}
