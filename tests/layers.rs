//! The layer rule of docs/design.md §3, enforced.
//!
//! The rule is read from the table in docs/design.md §3 (its one home):
//! each row names a layer, the layers it may import from, and the files of
//! the layer that may hold unsafe code. Every file under `src/` is parsed
//! (comments, strings and char literals skipped; `crate::`, `super::` and
//! `self::` paths followed through `use` trees), and the test fails on
//!
//! - an import of a layer the row does not name (an upward import, or a
//!   sideways one the table does not allow),
//! - an import circle between files (a child module's use of the `mod.rs`
//!   or file that declares it is not an edge: Rust's module tree is that
//!   way round by construction),
//! - `#[path]`, `include!`, `extern crate`, a bare `crate` token or a
//!   crate path in a `lib.rs` macro (each would hide an import),
//! - the `unsafe` keyword (or `#[no_mangle]`, `#[export_name]`,
//!   `#[link_section]`) in a file the table does not name, or a file
//!   without `#![forbid(unsafe_code)]` (itself or at its layer's root)
//!   where the table names none.
//!
//! `lib.rs` and `main.rs` are above every layer and are not checked for
//! imports.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// One row of the design table.
#[derive(Debug)]
struct Row {
    imports: BTreeSet<String>,
    /// File stems of the layer that may hold `unsafe`; empty: none.
    unsafe_in: BTreeSet<String>,
}

/// The table of docs/design.md §3: layer name → its row. A row naming several layers
/// (`key`, `sync`) gives each the same row.
fn rule() -> BTreeMap<String, Row> {
    let text = std::fs::read_to_string(Path::new(ROOT).join("docs/design.md")).unwrap();
    let start = text
        .find("\n## 3. Layers")
        .expect("docs/design.md has a section 3");
    let end = start + text[start + 1..].find("\n## ").unwrap() + 1;
    let mut rows = BTreeMap::new();
    let mut in_table = false;
    for line in text[start..end].lines() {
        if line.starts_with("| layer |") {
            in_table = true;
            continue;
        }
        if !in_table || line.starts_with("|---") {
            continue;
        }
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(
            cells.len(),
            4,
            "a docs/design.md §3 row has 4 cells: {line}"
        );
        let names = ticked(cells[0]);
        let imports = if cells[2] == "—" {
            BTreeSet::new()
        } else {
            ticked(cells[2]).into_iter().collect()
        };
        let unsafe_in: BTreeSet<String> = if cells[3] == "none" {
            BTreeSet::new()
        } else {
            ticked(cells[3]).into_iter().collect()
        };
        for n in names {
            let row = Row {
                imports: imports.clone(),
                unsafe_in: unsafe_in.clone(),
            };
            assert!(rows.insert(n.clone(), row).is_none(), "layer {n} twice");
        }
    }
    assert!(
        rows.len() >= 8,
        "the docs/design.md §3 table was not found whole: {rows:?}"
    );
    rows
}

/// The `backticked` words of a table cell.
fn ticked(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// A source file and its module path (`["engine", "worker"]`).
struct File {
    rel: PathBuf,
    module: Vec<String>,
    text: String,
}

fn files() -> Vec<File> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let src = Path::new(ROOT).join("src");
    let mut paths = Vec::new();
    walk(&src, &mut paths);
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let rel = p.strip_prefix(&src).unwrap().to_path_buf();
            let mut module: Vec<String> = rel
                .with_extension("")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if module.last().is_some_and(|l| l == "mod" || l == "lib") {
                module.pop();
            }
            File {
                text: std::fs::read_to_string(&p).unwrap(),
                rel,
                module,
            }
        })
        .collect()
}

/// The layer of a module path: its folder, or its root file's stem.
fn layer(module: &[String]) -> Option<&str> {
    module.first().map(String::as_str)
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Punct(char),
    PathSep,
    /// A `#![…]` / `#[…]` opener.
    Hash,
}

/// Tokens of Rust source with comments, string, byte-string, raw-string
/// and char literals dropped (lifetimes become identifiers).
fn tokens(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let n = c.len();
    while i < n {
        let ch = c[i];
        if ch == '/' && c.get(i + 1) == Some(&'/') {
            while i < n && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < n {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = skip_string(&c, i + 1);
        } else if (ch == 'r' || (prefix(&c, i) && c.get(i + 1) == Some(&'r')))
            && raw_string_start(&c, if ch == 'r' { i } else { i + 1 }).is_some()
        {
            let at = if ch == 'r' { i } else { i + 1 };
            let (hashes, body) = raw_string_start(&c, at).unwrap();
            i = body;
            loop {
                assert!(i < n, "unterminated raw string");
                if c[i] == '"' && (0..hashes).all(|k| c.get(i + 1 + k) == Some(&'#')) {
                    i += 1 + hashes;
                    break;
                }
                i += 1;
            }
        } else if prefix(&c, i) && c.get(i + 1) == Some(&'"') {
            i = skip_string(&c, i + 2);
        } else if ch == 'b' && c.get(i + 1) == Some(&'\'') {
            i = skip_char(&c, i + 1).expect("byte literal");
        } else if ch == '\'' {
            match skip_char(&c, i) {
                Some(end) => i = end,
                None => i += 1, // a lifetime: its name follows as an ident
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let s = i;
            while i < n && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(Tok::Ident(c[s..i].iter().collect()));
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push(Tok::PathSep);
            i += 2;
        } else if ch == '#' {
            out.push(Tok::Hash);
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else {
            out.push(Tok::Punct(ch));
            i += 1;
        }
    }
    out
}

/// A `b` or `c` literal prefix at `i` (not the end of an identifier).
fn prefix(c: &[char], i: usize) -> bool {
    (c[i] == 'b' || c[i] == 'c') && !(i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_'))
}

/// Past the closing quote of a string whose body starts at `i`.
fn skip_string(c: &[char], mut i: usize) -> usize {
    while i < c.len() {
        match c[i] {
            '\\' => i += 2,
            '"' => return i + 1,
            _ => i += 1,
        }
    }
    panic!("unterminated string");
}

/// `r"`, `r#"`, …: the number of hashes and where the body starts.
fn raw_string_start(c: &[char], at: usize) -> Option<(usize, usize)> {
    let lit_prefix = at > 0 && (c[at - 1] == 'b' || c[at - 1] == 'c') && prefix(c, at - 1);
    if c.get(at) != Some(&'r') || at > 0 && c[at - 1].is_alphanumeric() && !lit_prefix {
        return None;
    }
    if at > 0 && c[at - 1] == '_' {
        return None;
    }
    let mut k = at + 1;
    while c.get(k) == Some(&'#') {
        k += 1;
    }
    (c.get(k) == Some(&'"')).then_some((k - at - 1, k + 1))
}

/// Past a char literal starting at the quote `i`, or `None` for a
/// lifetime.
fn skip_char(c: &[char], i: usize) -> Option<usize> {
    if c.get(i + 1) == Some(&'\\') {
        let mut k = i + 2;
        while k < c.len() && c[k] != '\'' {
            k += 1;
        }
        return Some(k + 1);
    }
    (c.get(i + 2) == Some(&'\'')).then_some(i + 3)
}

/// Every path the file names through `crate::`, `super::` or `self::`,
/// resolved to a crate-absolute path (module segments then item names).
fn paths(f: &File) -> Vec<Vec<String>> {
    let t = tokens(&f.text);
    let mut out = Vec::new();
    // Inline modules (`mod tests { … }`): name and the brace depth inside.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < t.len() {
        match &t[i] {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth -= 1;
            }
            Tok::Ident(k) if k == "mod" => {
                if let (Some(Tok::Ident(name)), Some(Tok::Punct('{'))) =
                    (t.get(i + 1), t.get(i + 2))
                {
                    inline.push((name.clone(), depth + 1));
                }
            }
            Tok::Ident(k)
                if (k == "crate" || k == "super" || k == "self" || k == "daxkv")
                    && t.get(i + 1) == Some(&Tok::PathSep)
                    // not `a::crate`; a leading `::daxkv` is the crate
                    && !(i > 1 && t[i - 1] == Tok::PathSep && matches!(t[i - 2], Tok::Ident(_))) =>
            {
                let mut here: Vec<String> = f.module.clone();
                here.extend(inline.iter().map(|(n, _)| n.clone()));
                let (trees, next) = use_tree(&t, i);
                for p in trees {
                    let mut base = Vec::new();
                    let mut segs = p.into_iter().peekable();
                    match segs.next().as_deref() {
                        Some("crate" | "daxkv") => {}
                        Some("self") => base.clone_from(&here),
                        Some("super") => {
                            base.clone_from(&here);
                            base.pop();
                        }
                        _ => unreachable!(),
                    }
                    // `self::super::super::x`, `super::self::x`: every
                    // leading `self` / `super` moves from where we are.
                    while let Some(s) = segs.next_if(|s| s == "super" || s == "self") {
                        if s == "super" {
                            base.pop();
                        }
                    }
                    base.extend(segs.filter(|s| s != "self"));
                    out.push(base);
                }
                i = next;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The paths of the use tree (or plain path) starting at token `i`, and
/// the index past it.
fn use_tree(t: &[Tok], mut i: usize) -> (Vec<Vec<String>>, usize) {
    let mut prefix = Vec::new();
    loop {
        match t.get(i) {
            Some(Tok::Ident(s)) => {
                prefix.push(s.clone());
                i += 1;
            }
            Some(Tok::Punct('*')) => return (vec![prefix], i + 1),
            Some(Tok::Punct('{')) => {
                let mut all = Vec::new();
                i += 1;
                loop {
                    match t.get(i) {
                        Some(Tok::Punct('}')) => return (all, i + 1),
                        Some(Tok::Punct(',')) => i += 1,
                        Some(_) => {
                            let (sub, next) = use_tree(t, i);
                            for s in sub {
                                let mut p = prefix.clone();
                                p.extend(s);
                                all.push(p);
                            }
                            i = next;
                        }
                        None => panic!("unterminated use tree"),
                    }
                }
            }
            _ => return (vec![prefix], i),
        }
        if t.get(i) == Some(&Tok::PathSep) {
            i += 1;
        } else {
            return (vec![prefix], i);
        }
    }
}

/// The longest prefix of `path` that is a file's module.
fn resolve<'a>(path: &[String], modules: &'a BTreeMap<Vec<String>, usize>) -> Option<&'a usize> {
    (0..=path.len()).rev().find_map(|k| modules.get(&path[..k]))
}

/// Words that mark unsafe code: the keyword, and attributes that are
/// unsafe without it in edition 2021 (`forbid(unsafe_code)` rejects them).
const UNSAFE_WORDS: [&str; 4] = ["unsafe", "no_mangle", "export_name", "link_section"];

/// The file holds `#![forbid(unsafe_code)]` as code (not in a comment).
fn forbids(text: &str) -> bool {
    let want = [
        Tok::Hash,
        Tok::Punct('!'),
        Tok::Punct('['),
        Tok::Ident("forbid".into()),
        Tok::Punct('('),
        Tok::Ident("unsafe_code".into()),
        Tok::Punct(')'),
        Tok::Punct(']'),
    ];
    tokens(text).windows(want.len()).any(|w| w == want)
}

/// `#[path = …]` (an attribute, not a `path` identifier elsewhere).
fn mounts_a_path(t: &[Tok]) -> bool {
    t.windows(4).any(|w| {
        w[0] == Tok::Hash
            && w[1] == Tok::Punct('[')
            && w[2] == Tok::Ident("path".into())
            && w[3] == Tok::Punct('=')
    })
}

/// `crate` neither starting a path, nor in `pub(crate)`, nor after
/// `extern` (reported on its own).
fn bare_crate(t: &[Tok]) -> bool {
    (0..t.len()).any(|i| {
        t[i] == Tok::Ident("crate".into())
            && t.get(i + 1) != Some(&Tok::PathSep)
            && !(i > 0 && t[i - 1] == Tok::Punct('(') && t.get(i + 1) == Some(&Tok::Punct(')')))
            && !(i > 0 && t[i - 1] == Tok::Ident("extern".into()))
    })
}

/// Paths to the crate inside the bodies of `macro_rules!` definitions.
fn macro_paths(t: &[Tok]) -> bool {
    let mut i = 0;
    while i + 3 < t.len() {
        if t[i] == Tok::Ident("macro_rules".into()) && t[i + 1] == Tok::Punct('!') {
            let mut depth = 0usize;
            let mut k = i + 3;
            while k < t.len() {
                match &t[k] {
                    Tok::Punct('{' | '(' | '[') => depth += 1,
                    Tok::Punct('}' | ')' | ']') => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    Tok::Ident(w)
                        if (w == "crate" || w == "daxkv")
                            && t.get(k + 1) == Some(&Tok::PathSep) =>
                    {
                        return true;
                    }
                    _ => {}
                }
                k += 1;
            }
            i = k;
        }
        i += 1;
    }
    false
}

/// `include!(…)`.
fn includes(t: &[Tok]) -> bool {
    t.windows(2)
        .any(|w| w[0] == Tok::Ident("include".into()) && w[1] == Tok::Punct('!'))
}

#[derive(Default)]
struct Findings {
    against_rule: Vec<String>,
    circles: Vec<String>,
    unsafe_misplaced: Vec<String>,
}

/// Forms that would hide an import from the path scan.
fn hiding_forms(f: &File, toks: &[Tok]) -> Vec<String> {
    let mut out = Vec::new();
    if bare_crate(toks) {
        out.push(format!(
            "src/{}: a bare `crate` token (a macro can build a path from it that this check cannot follow)",
            f.rel.display()
        ));
    }
    for (k, what) in [
        (&["path"][..], "a #[path] attribute"),
        (&["include"][..], "include!"),
        (&["extern", "crate"][..], "extern crate"),
    ] {
        if toks
            .windows(k.len())
            .any(|w| w.iter().zip(k).all(|(t, k)| *t == Tok::Ident((*k).into())))
            && (k[0] != "path" || mounts_a_path(toks))
            && (k[0] != "include" || includes(toks))
        {
            out.push(format!(
                "src/{}: {what} mounts code this check cannot place in a layer",
                f.rel.display()
            ));
        }
    }
    out
}

/// A layer with no unsafe code says so once, at its root.
fn unforbidden_roots(rule: &BTreeMap<String, Row>, files: &[File]) -> Vec<String> {
    let mut out = Vec::new();
    for (name, row) in rule {
        let root = files
            .iter()
            .find(|r| r.module.len() == 1 && r.module[0] == *name);
        if let Some(r) = root {
            if row.unsafe_in.is_empty() && !forbids(&r.text) {
                out.push(format!(
                    "src/{}: layer `{name}` has no unsafe code in docs/design.md §3 but no #![forbid(unsafe_code)] at its root",
                    r.rel.display()
                ));
            }
        }
    }
    out
}

fn check(rule: &BTreeMap<String, Row>, files: &[File]) -> Findings {
    let modules: BTreeMap<Vec<String>, usize> = files
        .iter()
        .enumerate()
        .filter(|(_, f)| f.rel != Path::new("main.rs"))
        .map(|(i, f)| (f.module.clone(), i))
        .collect();
    let mut found = Findings::default();
    let mut edges: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    for (i, f) in files.iter().enumerate() {
        if f.module.is_empty() {
            // lib.rs is above every layer, but a macro it defines expands
            // in the layer that calls it.
            if macro_paths(&tokens(&f.text)) {
                found.against_rule.push(
                    "src/lib.rs: a macro names a crate path (it would import from where it is called)"
                        .to_string(),
                );
            }
            continue;
        }
        if f.rel == Path::new("main.rs") {
            continue;
        }
        let from = layer(&f.module).unwrap();
        let Some(row) = rule.get(from) else {
            found.against_rule.push(format!(
                "src/{}: layer `{from}` is not in docs/design.md §3",
                f.rel.display()
            ));
            continue;
        };
        for p in paths(f) {
            let Some(&j) = resolve(&p, &modules) else {
                continue;
            };
            if j == i {
                continue;
            }
            let to_mod = &files[j].module;
            let to = layer(to_mod).unwrap_or("lib");
            if to != from && !row.imports.contains(to) {
                found.against_rule.push(format!(
                    "src/{} ({from}) imports {} (layer {to}): `{}`",
                    f.rel.display(),
                    files[j].rel.display(),
                    p.join("::")
                ));
            }
            // A child's use of an ancestor (the file declaring it) is no edge.
            if !f.module.starts_with(to_mod) {
                edges.entry(i).or_default().insert(j);
            }
        }
        let toks = tokens(&f.text);
        let has_unsafe = toks.iter().any(|t| match t {
            Tok::Ident(s) => UNSAFE_WORDS.contains(&s.as_str()),
            _ => false,
        });
        found.against_rule.extend(hiding_forms(f, &toks));
        let stem = f.module.last().unwrap();
        let named = row.unsafe_in.contains(stem) && f.module.len() == 2;
        if has_unsafe && !named {
            found.unsafe_misplaced.push(format!(
                "src/{}: unsafe code in a file docs/design.md §3 does not name",
                f.rel.display()
            ));
        }
        // A folder's `mod.rs` holds declarations only; a forbid there would
        // cover the files the table names too.
        let folder_root = f.rel.ends_with("mod.rs") && f.module.len() == 1;
        if !named && !folder_root {
            let own = forbids(&f.text);
            // `forbid` in a module covers the modules it declares.
            let root = files.iter().any(|r| {
                !r.module.is_empty()
                    && r.module.len() < f.module.len()
                    && f.module.starts_with(&r.module)
                    && forbids(&r.text)
            });
            if !own && !root {
                found.unsafe_misplaced.push(format!(
                    "src/{}: no #![forbid(unsafe_code)] (itself or in a module above it)",
                    f.rel.display()
                ));
            }
        }
    }
    found
        .unsafe_misplaced
        .extend(unforbidden_roots(rule, files));
    for c in circles(&edges) {
        found.circles.push(
            c.iter()
                .map(|&k| format!("src/{}", files[k].rel.display()))
                .collect::<Vec<_>>()
                .join(" → "),
        );
    }
    found
}

/// The strongly connected components of more than one file (Tarjan).
fn circles(edges: &BTreeMap<usize, BTreeSet<usize>>) -> Vec<Vec<usize>> {
    struct T<'a> {
        edges: &'a BTreeMap<usize, BTreeSet<usize>>,
        index: BTreeMap<usize, usize>,
        low: BTreeMap<usize, usize>,
        stack: Vec<usize>,
        on: BTreeSet<usize>,
        out: Vec<Vec<usize>>,
    }
    fn visit(t: &mut T<'_>, v: usize) {
        let k = t.index.len();
        t.index.insert(v, k);
        t.low.insert(v, k);
        t.stack.push(v);
        t.on.insert(v);
        for &w in t.edges.get(&v).into_iter().flatten() {
            if !t.index.contains_key(&w) {
                visit(t, w);
                let l = t.low[&v].min(t.low[&w]);
                t.low.insert(v, l);
            } else if t.on.contains(&w) {
                let l = t.low[&v].min(t.index[&w]);
                t.low.insert(v, l);
            }
        }
        if t.low[&v] == t.index[&v] {
            let mut comp = Vec::new();
            loop {
                let w = t.stack.pop().unwrap();
                t.on.remove(&w);
                comp.push(w);
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.reverse();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    let nodes: Vec<usize> = edges.keys().copied().collect();
    for v in nodes {
        if !t.index.contains_key(&v) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn src_follows_the_layer_rule() {
    let rule = rule();
    let files = files();
    assert!(files.len() > 40, "src/ was not found whole");
    // Every folder and root file is a layer of the table.
    for f in files.iter().filter(|f| f.rel != Path::new("main.rs")) {
        if let Some(l) = layer(&f.module) {
            assert!(
                rule.contains_key(l),
                "src/{}: layer `{l}` is not in docs/design.md §3",
                f.rel.display()
            );
        }
    }
    let found = check(&rule, &files);
    let mut report = String::new();
    for (what, list) in [
        ("imports against docs/design.md §3", &found.against_rule),
        ("import circles", &found.circles),
        (
            "unsafe code against docs/design.md §3",
            &found.unsafe_misplaced,
        ),
    ] {
        if !list.is_empty() {
            writeln!(report, "{what}:\n  {}", list.join("\n  ")).unwrap();
        }
    }
    assert!(report.is_empty(), "{report}");
}

/// A made-up source file at `rel` (under `src/`).
fn file(rel: &str, text: &str) -> File {
    let mut module: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_string)
        .collect();
    if module.last().is_some_and(|l| l == "mod" || l == "lib") {
        module.pop();
    }
    File {
        rel: rel.into(),
        module,
        text: text.into(),
    }
}

/// The checker itself: each kind of breach is found in a made-up tree.
#[test]
fn the_checker_finds_each_kind_of_breach() {
    let rule = rule();
    let forbid = "#![forbid(unsafe_code)]\n";
    let tree = vec![
        file("lib.rs", "pub mod device; pub mod engine; pub mod key;"),
        file("key.rs", forbid),
        file("device/mod.rs", "pub mod slot; pub mod index;"),
        // upward: device → engine, in a nested use tree, past a string
        // and a comment that mention crate paths.
        file(
            "device/slot.rs",
            &format!(
                "{forbid}// use crate::control::x;\nconst S: &str = \"crate::cli::y\";\n\
                 use crate::{{engine::{{self, Engine}}, key::Key}};"
            ),
        ),
        // a circle inside the layer: slot → index → slot (via super::)
        file(
            "device/index.rs",
            &format!("{forbid}use super::slot::X; fn f() {{ crate::device::slot::g(); }}"),
        ),
        file("engine/mod.rs", "#![forbid(unsafe_code)]\nmod worker;"),
        // a child's use of its mod.rs is no circle; unsafe under a forbid root
        file(
            "engine/worker.rs",
            "use super::Engine; fn f() { unsafe { g() } } mod tests { use super::*; }",
        ),
        // no forbid at all, not named in the table
        file("device/copy2.rs", "fn f() {}"),
    ];
    let found = check(&rule, &tree);
    assert_eq!(found.against_rule.len(), 2, "{:?}", found.against_rule);
    assert!(found
        .against_rule
        .iter()
        .all(|e| e.contains("layer engine")));
    assert!(found.circles.is_empty(), "{:?}", found.circles);
    // A circle: slot imports index too.
    let mut tree = tree;
    tree[3].text.push_str("\nuse crate::device::index;");
    let found = check(&rule, &tree);
    assert_eq!(found.circles.len(), 1, "{:?}", found.circles);
    assert!(found.circles[0].contains("src/device/slot.rs"));
    assert!(found.circles[0].contains("src/device/index.rs"));
    assert_eq!(
        found.unsafe_misplaced.len(),
        2,
        "{:?}",
        found.unsafe_misplaced
    );
    assert!(found
        .unsafe_misplaced
        .iter()
        .any(|e| e.contains("engine/worker.rs")));
    assert!(found
        .unsafe_misplaced
        .iter()
        .any(|e| e.contains("device/copy2.rs")));
}

/// Each way around the checker a reviewer found is caught.
#[test]
fn the_checker_sees_through_indirect_imports() {
    let rule = rule();
    let forbid = "#![forbid(unsafe_code)]\n";
    let base = || {
        vec![
            file("lib.rs", "pub mod device; pub mod engine;"),
            file("device/mod.rs", "pub mod slot;"),
            file("engine/mod.rs", forbid),
        ]
    };
    let cases: [(&str, &str); 10] = [
        ("macro", "macro_rules! p { ($r:ident $m:ident) => { type E = $r::$m::Engine; } } p!(crate engine);"),
        ("self::super", "type E = self::super::super::engine::Engine;"),
        ("c-string", "const A: &CStr = cr#\"\"\"#; type E = crate::engine::Engine; const B: &CStr = c\"x\";"),
        ("include", "include!(\"../../docs/x.rs\");"),
        ("path", "#[path = \"../engine/x.rs\"] mod x;"),
        ("extern crate", "extern crate self as daxkv;"),
        ("daxkv path", "type E = ::daxkv::engine::Engine;"),
        ("comment forbid", "//! #![forbid(unsafe_code)]\nfn f() {}"),
        ("no_mangle", "#[no_mangle] pub extern \"C\" fn f() {}"),
        ("lib macro", ""),
    ];
    for (what, text) in cases {
        let mut tree = base();
        if what == "lib macro" {
            tree[0].text += "\nmacro_rules! eng { () => { $crate::engine::Engine } }";
            tree.push(file("device/slot.rs", forbid));
        } else {
            let body = if what == "comment forbid" || what == "no_mangle" {
                text.to_string()
            } else {
                format!("{forbid}{text}")
            };
            tree.push(file("device/slot.rs", &body));
        }
        let found = check(&rule, &tree);
        let n = found.against_rule.len() + found.circles.len() + found.unsafe_misplaced.len();
        assert!(n > 0, "{what}: not caught");
    }
    // And a clean file passes.
    let mut tree = base();
    tree.push(file(
        "device/slot.rs",
        &format!("{forbid}pub(crate) fn f() {{}} use crate::device::slot as _s;"),
    ));
    let found = check(&rule, &tree);
    assert!(
        found.against_rule.is_empty() && found.unsafe_misplaced.is_empty(),
        "{:?} {:?}",
        found.against_rule,
        found.unsafe_misplaced
    );
}

#[test]
fn the_tokenizer_skips_literals_and_comments() {
    let t = tokens(concat!(
        "let a = r#\"crate::x \"quoted\"\"#; let b = b'\"'; let c = '\\'';",
        " /* crate::y /* nested */ */ fn f<'a>() {} crate::z",
    ));
    let idents: Vec<String> = t
        .iter()
        .filter_map(|t| match t {
            Tok::Ident(s) => Some(s.clone()),
            _ => None,
        })
        .collect();
    assert!(!idents.contains(&"x".to_string()), "{idents:?}");
    assert!(!idents.contains(&"y".to_string()), "{idents:?}");
    assert!(idents.contains(&"z".to_string()), "{idents:?}");
    assert!(
        idents.contains(&"a".to_string()),
        "lifetimes stay identifiers"
    );
}
