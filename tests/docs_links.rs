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

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Lines before a `§` searched for the document it cites (a citation may
/// wrap in a comment or paragraph).
const LOOKBACK_LINES: usize = 2;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
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
fn the_repository_cites_only_its_own_documents_and_existing_sections() {
    let bad = problems();
    assert!(
        bad.is_empty(),
        "{} broken or outside citations:\n{}",
        bad.len(),
        bad.join("\n")
    );
}
