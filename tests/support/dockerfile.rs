//! A reader for images/Containerfile (Dockerfile syntax), enough for the checks in tests/images.rs
//! and device-plugin/tests/image.rs (`#[path]`-included): stages, their instructions with line
//! continuations joined, and exec-form arguments.

#![allow(dead_code)] // each including test target uses part of it

use std::path::{Path, PathBuf};

/// The repository root (this file is included from `tests/` of both workspace members).
pub fn repo_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if here.join("images").is_dir() {
        here
    } else {
        here.parent().expect("a workspace member's parent").to_path_buf()
    }
}

pub fn read(rel: &str) -> String {
    let path = repo_root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[derive(Debug, Clone)]
pub struct Instruction {
    /// upper case, e.g. `COPY`
    pub keyword: String,
    /// the rest, continuations joined with a space
    pub args: String,
    /// 1-based line of the keyword
    pub line: usize,
}

#[derive(Debug, Clone)]
pub struct Stage {
    /// `AS name`, or the stage's index when unnamed
    pub name: String,
    /// the image after `FROM`, with global `ARG` defaults substituted
    pub base: String,
    pub instructions: Vec<Instruction>,
}

impl Stage {
    /// The arguments of every `keyword` instruction, in order.
    pub fn all(&self, keyword: &str) -> Vec<&str> {
        self.instructions.iter().filter(|i| i.keyword == keyword).map(|i| i.args.as_str()).collect()
    }

    /// The arguments of the stage's one `keyword` instruction.
    pub fn one(&self, keyword: &str) -> &str {
        let found = self.all(keyword);
        assert_eq!(found.len(), 1, "stage {}: expected one {keyword}, found {found:?}", self.name);
        found[0]
    }

    /// The exec-form (JSON array) arguments of the stage's one `keyword` instruction.
    pub fn exec(&self, keyword: &str) -> Vec<String> {
        let args = self.one(keyword);
        serde_json::from_str(args)
            .unwrap_or_else(|e| panic!("stage {}: {keyword} {args} is not exec form: {e}", self.name))
    }
}

/// The stages of a Dockerfile. Comment lines (also inside continuations) and parser directives are
/// skipped; `ARG NAME=default` before the first `FROM` is substituted into the `FROM` lines.
pub fn parse(text: &str) -> Vec<Stage> {
    let mut logical: Vec<(usize, String)> = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let t = raw.trim();
        // Docker skips comment and empty lines, also inside a continuation
        if t.starts_with('#') || t.is_empty() {
            continue;
        }
        let (body, continues) = match t.strip_suffix('\\') {
            Some(b) => (b.trim_end(), true),
            None => (t, false),
        };
        let entry = pending.get_or_insert_with(|| (i + 1, String::new()));
        if !entry.1.is_empty() && !body.is_empty() {
            entry.1.push(' ');
        }
        entry.1.push_str(body);
        if !continues {
            logical.extend(pending.take());
        }
    }
    assert!(pending.is_none(), "the Dockerfile ends in a continuation");

    let mut global_args: Vec<(String, String)> = Vec::new();
    let mut stages: Vec<Stage> = Vec::new();
    for (line, l) in logical {
        let (keyword, args) = l.split_once(char::is_whitespace).unwrap_or((l.as_str(), ""));
        let keyword = keyword.to_ascii_uppercase();
        let args = args.trim().to_string();
        if keyword == "FROM" {
            let words: Vec<&str> = args.split_whitespace().collect();
            let mut base = words[0].to_string();
            for (k, v) in &global_args {
                base = base.replace(&format!("${{{k}}}"), v).replace(&format!("${k}"), v);
            }
            let name = match words.as_slice() {
                [_, as_, name] if as_.eq_ignore_ascii_case("as") => name.to_string(),
                [_] => stages.len().to_string(),
                _ => panic!("line {line}: FROM {args}"),
            };
            stages.push(Stage { name, base, instructions: Vec::new() });
        } else if let Some(stage) = stages.last_mut() {
            stage.instructions.push(Instruction { keyword, args, line });
        } else {
            assert_eq!(keyword, "ARG", "line {line}: only ARG may come before the first FROM");
            let (k, v) = args.split_once('=').unwrap_or((args.as_str(), ""));
            global_args.push((k.to_string(), v.to_string()));
        }
    }
    stages
}

pub fn stage<'a>(stages: &'a [Stage], name: &str) -> &'a Stage {
    stages.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no stage {name}"))
}

/// `COPY [--from=X] [--chown..] SRC... DST`: (from, sources, destination).
pub fn copy_parts(args: &str) -> (Option<String>, Vec<String>, String) {
    let mut from = None;
    let mut paths = Vec::new();
    for w in args.split_whitespace() {
        if let Some(f) = w.strip_prefix("--from=") {
            from = Some(f.to_string());
        } else if !w.starts_with("--") {
            paths.push(w.to_string());
        }
    }
    let dest = paths.pop().expect("COPY has a destination");
    assert!(!paths.is_empty(), "COPY {args}: no source");
    (from, paths, dest)
}

/// Whether `rel` exists under the repository root.
pub fn exists(rel: &str) -> bool {
    Path::new(&repo_root()).join(rel).exists()
}
