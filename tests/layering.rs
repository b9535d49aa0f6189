//! The layout docs/architecture.md describes, kept so:
//! - the layers of the library (`gpuplace-core` → `placement`, `placement_log` → `scheduler`, `sim`
//!   → `extender`, `report` → `k8s` → the binaries): no `use` from a lower layer into a higher
//!   one, nor between two modules of one layer (a front end such as `extender` builds on the
//!   online scheduler, which knows no front end);
//! - in `gpuplace-core` (`core/`), the model never uses the edges (logs, the Kubernetes client);
//! - no circle of imports between the files of `src/`, `core/src/` or `device-plugin/src/`;
//! - the device plugin depends on `gpuplace-core` only: its normal dependency tree has neither the
//!   `gpuplace` crate nor what only it needs (actix-web, plotters, rayon, csv);
//! - the test doubles (`gpuplace-testkit`) are in no shipped binary's normal dependency tree;
//! - no source file of the shipped crates is over [`MAX_FILE_LINES`] lines (generated code lives in
//!   `OUT_DIR`, not here).
//!
//! Imports are read from the source text: `crate::`, `super::`, `self::` and child-module paths,
//! with `{...}` groups, outside comments, string literals and `#[cfg(test)]` items (tests may
//! reach anywhere).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use cargo_tree::resolved;

#[path = "support/cargo_tree.rs"]
mod cargo_tree;

/// The library's top-level modules, lowest layer first (`gpuplace-core` is below them all); a
/// module may import only from lower layers. A new top-level module must be placed here (and in
/// docs/architecture.md).
const LAYERS: &[&[&str]] =
    &[&["placement", "placement_log"], &["scheduler", "sim"], &["extender", "dra", "report"], &["k8s"]];

/// `gpuplace-core`'s edges: what the model (every other file of `core/src/`) never uses.
const CORE_EDGES: &[&str] = &["api_client", "logging"];

/// What only the `gpuplace` crate needs, never in the device plugin's build.
const NOT_FOR_THE_DEVICE_PLUGIN: &[&str] = &["gpuplace", "actix-web", "plotters", "rayon", "csv"];

/// A file longer than this holds more than one concern: split it along them.
const MAX_FILE_LINES: usize = 900;

/// Circles of imports between files that docs/architecture.md explains (none today).
const ALLOWED_CIRCLES: &[&[&str]] = &[];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Source text with comments, string and char literals blanked (newlines kept).
fn code_only(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && !ident_char(i.checked_sub(1).map(|k| b[k])) {
            // raw string r"..." or r#"..."#
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                match b.get(j) {
                    None => break,
                    Some('"') if (1..=hashes).all(|h| b.get(j + h) == Some(&'#')) => {
                        j += 1 + hashes;
                        break;
                    }
                    _ => j += 1,
                }
            }
            out.extend(b[i..j.min(b.len())].iter().map(|&c| blank(c)));
            i = j;
        } else if c == '"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != '"' {
                j += if b[j] == '\\' { 2 } else { 1 };
            }
            out.extend(b[i..(j + 1).min(b.len())].iter().map(|&c| blank(c)));
            i = j + 1;
        } else if c == '\'' {
            // a char literal ('x', '\n', '\u{..}'), or a lifetime (left as is)
            let end = if next == Some('\\') {
                (i + 2..b.len()).find(|&k| b[k] == '\'')
            } else if b.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(e) => {
                    out.extend(std::iter::repeat_n(' ', e + 1 - i));
                    i = e + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn ident_char(c: Option<char>) -> bool {
    c.is_some_and(|c| c.is_alphanumeric() || c == '_')
}

/// The end (exclusive) of the item that starts at `at`: its matching `}` or its `;`.
fn item_end(code: &[u8], at: usize) -> usize {
    let mut depth = 0usize;
    let mut k = at;
    while k < code.len() {
        match code[k] {
            b'{' => depth += 1,
            b'}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return k + 1;
                }
            }
            b';' if depth == 0 => return k + 1,
            _ => {}
        }
        k += 1;
    }
    code.len()
}

/// `code` without its `#[cfg(test)]` items (tests may import anything).
fn without_tests(code: &str) -> String {
    let mut out = code.to_string();
    while let Some(at) = out.find("#[cfg(test)]") {
        let end = item_end(out.as_bytes(), at);
        out.replace_range(at..end, &" ".repeat(end - at));
    }
    out
}

struct Source {
    /// Path relative to the crate's `src/`.
    files: BTreeMap<String, String>,
}

fn module_of(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel.trim_end_matches(".rs").split('/').map(String::from).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        parts.pop();
    }
    parts
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out
}

fn read_crate(src: &Path) -> Source {
    let mut files = BTreeMap::new();
    // main.rs is the binary's crate: it imports the library by name, from on top
    for p in rust_files(src).into_iter().filter(|p| *p != src.join("main.rs")) {
        let rel = p.strip_prefix(src).unwrap().to_string_lossy().replace('\\', "/");
        files.insert(rel, std::fs::read_to_string(&p).unwrap());
    }
    // files that only tests include (`#[cfg(test)] #[path = "x_tests.rs"] mod tests;`)
    let mut test_only = BTreeSet::new();
    for (rel, text) in &files {
        let mut rest = text.as_str();
        while let Some(at) = rest.find("#[cfg(test)]") {
            let tail = &rest[at..];
            let head: String = tail.lines().take(3).collect::<Vec<_>>().join("\n");
            if let Some(p) = head.split("#[path = \"").nth(1).and_then(|s| s.split('"').next()) {
                let dir = Path::new(rel).parent().unwrap_or(Path::new(""));
                test_only.insert(dir.join(p).to_string_lossy().replace('\\', "/"));
            }
            rest = &tail[12..];
        }
    }
    files.retain(|rel, _| !test_only.contains(rel));
    Source { files }
}

/// Paths written after `crate::`, `super::`, `self::`, a child module's name or `gpuplace::`, with
/// `{...}` groups expanded, as (head, segments).
fn paths_in(code: &str, children: &BTreeSet<String>) -> Vec<(String, Vec<String>)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if !(b[i].is_ascii_alphabetic() || b[i] == b'_')
            || (i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b':'))
        {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
            i += 1;
        }
        let word = &code[start..i];
        let is_head = matches!(word, "crate" | "super" | "self" | "gpuplace") || children.contains(word);
        if !is_head || !code[i..].starts_with("::") {
            continue;
        }
        let mut prefix = Vec::new();
        let mut j = i;
        expand(code, &mut j, &mut prefix, &mut |segs| out.push((word.to_string(), segs)));
        i = j.max(i + 1);
    }
    out
}

/// Reads `::a::b::{c, d::e}` at `*j` onto `prefix`, calling `emit` for each full path.
fn expand(code: &str, j: &mut usize, prefix: &mut Vec<String>, emit: &mut dyn FnMut(Vec<String>)) {
    let b = code.as_bytes();
    let depth = prefix.len();
    while code[*j..].starts_with("::") {
        *j += 2;
        while *j < b.len() && b[*j].is_ascii_whitespace() {
            *j += 1;
        }
        if b.get(*j) == Some(&b'{') {
            *j += 1;
            loop {
                while *j < b.len() && (b[*j].is_ascii_whitespace() || b[*j] == b',') {
                    *j += 1;
                }
                if *j >= b.len() || b[*j] == b'}' {
                    *j += 1;
                    break;
                }
                let s = *j;
                while *j < b.len() && (b[*j].is_ascii_alphanumeric() || b[*j] == b'_' || b[*j] == b'*') {
                    *j += 1;
                }
                let mut inner = prefix.clone();
                let seg = &code[s..*j];
                if !seg.is_empty() && seg != "self" && seg != "*" {
                    inner.push(seg.to_string());
                }
                expand(code, j, &mut inner, emit);
                // skip `as name` and anything up to the next `,` or `}`
                while *j < b.len() && b[*j] != b',' && b[*j] != b'}' {
                    *j += 1;
                }
            }
            prefix.truncate(depth);
            return;
        }
        let s = *j;
        while *j < b.len() && (b[*j].is_ascii_alphanumeric() || b[*j] == b'_') {
            *j += 1;
        }
        if s == *j {
            break;
        }
        prefix.push(code[s..*j].to_string());
    }
    emit(prefix.clone());
    prefix.truncate(depth);
}

/// Per file, the files of the same crate it imports from, and (for `gpuplace::` paths) the
/// library's top-level modules it uses.
struct Graph {
    edges: BTreeMap<String, BTreeSet<String>>,
    external: BTreeMap<String, BTreeSet<String>>,
}

fn graph(src: &Path) -> Graph {
    let source = read_crate(src);
    let by_module: BTreeMap<Vec<String>, String> =
        source.files.keys().map(|rel| (module_of(rel), rel.clone())).collect();
    let resolve = |parts: &[String]| -> Option<String> {
        (1..=parts.len()).rev().find_map(|k| by_module.get(&parts[..k]).cloned())
    };
    let mut g = Graph { edges: BTreeMap::new(), external: BTreeMap::new() };
    for (rel, text) in &source.files {
        let me = module_of(rel);
        let code = without_tests(&code_only(text));
        let children: BTreeSet<String> = by_module
            .keys()
            .filter(|m| m.len() == me.len() + 1 && m.starts_with(&me))
            .map(|m| m[me.len()].clone())
            .collect();
        let edges = g.edges.entry(rel.clone()).or_default();
        for (head, segs) in paths_in(&code, &children) {
            let full: Vec<String> = match head.as_str() {
                "crate" => segs,
                "self" => me.iter().cloned().chain(segs).collect(),
                "super" => {
                    let mut base = me.clone();
                    base.pop();
                    let mut rest = segs.as_slice();
                    while rest.first().map(String::as_str) == Some("super") {
                        base.pop();
                        rest = &rest[1..];
                    }
                    base.into_iter().chain(rest.iter().cloned()).collect()
                }
                "gpuplace" => {
                    if let Some(top) = segs.first() {
                        g.external.entry(rel.clone()).or_default().insert(top.clone());
                    }
                    continue;
                }
                child => me.iter().cloned().chain(std::iter::once(child.to_string())).chain(segs).collect(),
            };
            if let Some(to) = resolve(&full) {
                if &to != rel {
                    edges.insert(to);
                }
            }
        }
    }
    g
}

/// Strongly connected components of more than one file (Tarjan).
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for w in t.edges.get(v).into_iter().flatten() {
            if !t.index.contains_key(w.as_str()) {
                visit(t, w);
                let lw = t.low[w.as_str()];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w.as_str()) {
                let iw = t.index[w.as_str()];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
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
    for v in edges.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

fn describe(edges: &BTreeMap<String, BTreeSet<String>>, comp: &[String]) -> String {
    comp.iter()
        .map(|f| {
            let to: Vec<&str> = edges[f].iter().filter(|t| comp.contains(t)).map(String::as_str).collect();
            format!("  {f} -> {}", to.join(", "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn check_no_circles(src: &Path) {
    let g = graph(src);
    assert!(g.edges.len() > 10, "read too few files under {}: {:?}", src.display(), g.edges.keys());
    let bad: Vec<String> = circles(&g.edges)
        .into_iter()
        .filter(|c| !ALLOWED_CIRCLES.iter().any(|a| a.iter().map(|s| s.to_string()).collect::<Vec<_>>() == *c))
        .map(|c| describe(&g.edges, &c))
        .collect();
    assert!(
        bad.is_empty(),
        "files under {} import each other in a circle (move the shared items to a file both can import, \
         or explain the circle in docs/architecture.md and ALLOWED_CIRCLES):\n{}",
        src.display(),
        bad.join("\n\n")
    );
}

#[test]
fn no_circle_of_imports_between_the_files_of_the_library() {
    check_no_circles(&repo().join("src"));
}

#[test]
fn no_circle_of_imports_between_the_files_of_the_device_plugin() {
    check_no_circles(&repo().join("device-plugin/src"));
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

#[test]
fn lower_layers_never_import_higher_ones() {
    let g = graph(&repo().join("src"));
    let mut bad = Vec::new();
    for (from, tos) in &g.edges {
        if from == "lib.rs" {
            continue;
        }
        let top = |f: &str| f.split('/').next().unwrap().trim_end_matches(".rs").to_string();
        let a = top(from);
        let Some(la) = layer_of(&a) else {
            bad.push(format!("{from}: module `{a}` is in no layer (add it to LAYERS and docs/architecture.md)"));
            continue;
        };
        for to in tos {
            let b = top(to);
            if a == b {
                continue;
            }
            match layer_of(&b) {
                Some(lb) if lb < la => {}
                Some(lb) => bad.push(format!(
                    "{from} (layer {la}, `{a}`) imports {to} (layer {lb}, `{b}`): {}",
                    if lb == la { "two modules of one layer" } else { "a higher layer" }
                )),
                None => bad.push(format!("{to}: module `{b}` is in no layer")),
            }
        }
    }
    assert!(bad.is_empty(), "the layering of docs/architecture.md is broken:\n{}", bad.join("\n"));
}

#[test]
fn no_circle_of_imports_between_the_files_of_the_core_crate() {
    check_no_circles(&repo().join("core/src"));
}

#[test]
fn the_core_model_never_uses_the_edges() {
    let g = graph(&repo().join("core/src"));
    let edge = |f: &str| CORE_EDGES.iter().any(|e| f == format!("{e}.rs") || f.starts_with(&format!("{e}/")));
    let bad: Vec<String> = g
        .edges
        .iter()
        .filter(|(from, _)| !edge(from) && from.as_str() != "lib.rs")
        .flat_map(|(from, tos)| tos.iter().filter(|to| edge(to)).map(move |to| format!("{from} uses {to}")))
        .collect();
    assert!(
        g.edges.contains_key("cluster.rs") && g.edges.contains_key("api_client/connect.rs"),
        "{:?}",
        g.edges.keys()
    );
    assert!(bad.is_empty(), "gpuplace-core's model uses its edges {CORE_EDGES:?}:\n{}", bad.join("\n"));
}

#[test]
fn the_device_plugin_builds_on_the_core_crate_only() {
    let g = graph(&repo().join("device-plugin/src"));
    assert!(g.external.is_empty(), "the device plugin uses the gpuplace crate: {:?}", g.external);
    let tree = normal_tree("gpuplace-device-plugin");
    assert!(tree.contains("gpuplace-core") && tree.contains("kube"), "{tree:?}");
    let bad: Vec<&&str> = NOT_FOR_THE_DEVICE_PLUGIN.iter().filter(|p| tree.contains(**p)).collect();
    assert!(bad.is_empty(), "in the device plugin's normal dependency tree: {bad:?}");
}

/// `cargo tree`'s package names for one package's normal (shipped) dependencies.
fn normal_tree(package: &str) -> BTreeSet<String> {
    resolved("normal", &["-p", package]).iter().filter_map(|l| l.split_whitespace().next().map(String::from)).collect()
}

#[test]
fn the_test_doubles_ship_in_no_binary() {
    for package in ["gpuplace", "gpuplace-core", "gpuplace-device-plugin"] {
        let tree = normal_tree(package);
        assert!(tree.contains(package) && tree.contains("kube"), "{package}: {tree:?}");
        assert!(!tree.contains("gpuplace-testkit"), "{package} links the test doubles: {tree:?}");
    }
    // and the library holds no fake of its own any more
    for dir in ["src", "core/src", "device-plugin/src"] {
        let g = read_crate(&repo().join(dir));
        let fakes: Vec<&String> = g
            .files
            .iter()
            .filter(|(_, t)| t.contains("struct FakeApiServer") || t.contains("struct FakeKubelet"))
            .map(|(f, _)| f)
            .collect();
        assert!(fakes.is_empty(), "{dir}: test doubles in a shipped crate: {fakes:?}");
    }
}

#[test]
fn no_rust_file_is_over_the_line_limit() {
    let mut long = Vec::new();
    let dirs =
        ["src", "core/src", "device-plugin/src", "testkit/src", "tests", "device-plugin/tests", "benches", "examples"];
    for dir in dirs {
        for p in rust_files(&repo().join(dir)) {
            let lines = std::fs::read_to_string(&p).unwrap().lines().count();
            if lines > MAX_FILE_LINES {
                long.push(format!("{} ({lines} lines)", p.strip_prefix(repo()).unwrap().display()));
            }
        }
    }
    assert!(long.is_empty(), "over {MAX_FILE_LINES} lines, split along its concerns: {long:?}");
}

#[test]
fn the_reader_sees_imports_as_rustc_does() {
    let code = code_only(
        "use crate::a::{b, c::{d, e as f}, self};\n// use crate::nope;\nlet s = \"crate::nope\";\n\
         let c = '\"'; fn x<'a>() { super::g::h(); child::k::l(); }\n#[cfg(test)]\nmod tests { use crate::t; }\n",
    );
    let code = without_tests(&code);
    let children: BTreeSet<String> = ["child".to_string()].into();
    let got: BTreeSet<String> =
        paths_in(&code, &children).into_iter().map(|(h, s)| format!("{h}::{}", s.join("::"))).collect();
    let want: BTreeSet<String> =
        ["crate::a::b", "crate::a::c::d", "crate::a::c::e", "crate::a", "super::g::h", "child::k::l"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    assert_eq!(got, want);
}
