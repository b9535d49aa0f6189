//! Shared by tests/monitoring.rs and device-plugin/tests/monitoring.rs (`#[path]`-included): reading
//! scheduler-config/monitoring/ and checking its PromQL against scraped `/metrics` pages.
//!
//! The check is a small PromQL scanner, not a parser: it finds metric names (identifiers that are
//! not functions, keywords or label names), the labels of their selectors, and the labels of
//! `by`/`without`/`on`/`ignoring`/`group_left`/`group_right`, and refuses functions it does not know
//! (among them `label_replace`, whose made-up labels it could not check).

// each including test target uses a different part
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use serde_norway::Value as Yaml;

/// Labels Prometheus adds to every series it scrapes (the monitors here drop the rest).
pub const TARGET_LABELS: [&str; 2] = ["job", "instance"];

/// scheduler-config/monitoring/ of the checkout at `repo`.
pub fn monitoring(repo: &Path) -> PathBuf {
    repo.join("scheduler-config/monitoring")
}

// -------------------------------------------------------------------------------------------------
// the exposition format
// -------------------------------------------------------------------------------------------------

/// Series names seen on `/metrics` (histograms by their `_bucket`/`_sum`/`_count` names), with the
/// label names their samples carry and how many samples there were.
#[derive(Debug, Default)]
pub struct Exported {
    pub series: BTreeMap<String, (BTreeSet<String>, usize)>,
}

impl Exported {
    pub fn add(&mut self, page: &str) {
        for line in page.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                if let Some(name) = rest.split_whitespace().next() {
                    self.series.entry(name.to_string()).or_default();
                }
                continue;
            }
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let (name, labels) = sample_line(line).unwrap_or_else(|| panic!("not a sample line: {line:?}"));
            let e = self.series.entry(name).or_default();
            e.0.extend(labels);
            e.1 += 1;
        }
    }

    pub fn labels(&self, name: &str) -> Option<&BTreeSet<String>> {
        self.series.get(name).filter(|(_, n)| *n > 0).map(|(l, _)| l)
    }
}

/// The name and label names of one sample line (`name{a="x",b="y"} value`).
pub fn sample_line(line: &str) -> Option<(String, Vec<String>)> {
    let end = line.find(['{', ' '])?;
    let name = line[..end].to_string();
    let mut labels = Vec::new();
    if line[end..].starts_with('{') {
        let mut rest = &line[end + 1..];
        loop {
            rest = rest.trim_start_matches(',');
            if let Some(r) = rest.strip_prefix('}') {
                rest = r;
                break;
            }
            let (label, r) = rest.split_once("=\"")?;
            labels.push(label.to_string());
            // the value: up to the first quote not escaped by a backslash
            let mut escaped = false;
            let close = r.char_indices().find(|&(_, c)| {
                let end = c == '"' && !escaped;
                escaped = c == '\\' && !escaped;
                end
            })?;
            rest = &r[close.0 + 1..];
        }
        rest.trim().parse::<f64>().ok()?;
    } else {
        line[end..].trim().parse::<f64>().ok()?;
    }
    Some((name, labels))
}

// -------------------------------------------------------------------------------------------------
// PromQL
// -------------------------------------------------------------------------------------------------

/// What an expression refers to.
#[derive(Debug, Default, PartialEq)]
pub struct Refs {
    /// Metric names, each with the label names of its selector.
    pub metrics: Vec<(String, Vec<String>)>,
    /// Labels named by `by`, `without`, `on`, `ignoring`, `group_left` and `group_right`.
    pub grouping: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Tok {
    Ident(String),
    Str,
    Num,
    /// A Grafana variable (`$node`, `${datasource}`, `$__rate_interval`).
    Var,
    Punct(char),
}

pub fn tokens(expr: &str) -> Result<Vec<Tok>, String> {
    let cs: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '#' {
            while i < cs.len() && cs[i] != '\n' {
                i += 1;
            }
        } else if c == '"' || c == '\'' || c == '`' {
            i += 1;
            while i < cs.len() && cs[i] != c {
                i += if cs[i] == '\\' && c != '`' { 2 } else { 1 };
            }
            if i >= cs.len() {
                return Err(format!("unterminated string in {expr:?}"));
            }
            i += 1;
            out.push(Tok::Str);
        } else if c == '$' {
            i += 1;
            if cs.get(i) == Some(&'{') {
                while i < cs.len() && cs[i] != '}' {
                    i += 1;
                }
                i += 1;
            } else {
                while i < cs.len() && (cs[i].is_alphanumeric() || cs[i] == '_') {
                    i += 1;
                }
            }
            out.push(Tok::Var);
        } else if c.is_ascii_digit() || (c == '.' && cs.get(i + 1).is_some_and(char::is_ascii_digit)) {
            // numbers and durations (5m, 1h30m, 1e3, 0x1f)
            while i < cs.len() && (cs[i].is_alphanumeric() || cs[i] == '.' || cs[i] == '_') {
                i += 1;
            }
            out.push(Tok::Num);
        } else if c.is_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < cs.len() && (cs[i].is_alphanumeric() || cs[i] == '_' || cs[i] == ':') {
                i += 1;
            }
            out.push(Tok::Ident(cs[start..i].iter().collect()));
        } else {
            out.push(Tok::Punct(c));
            i += 1;
        }
    }
    Ok(out)
}

/// Functions and aggregations the scanner accepts (`label_replace`, `label_join` and `count_values`
/// are left out: they make up labels the check could not follow).
pub const FUNCTIONS: &[&str] = &[
    "abs",
    "absent",
    "absent_over_time",
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atanh",
    "avg",
    "avg_over_time",
    "bottomk",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "cos",
    "cosh",
    "count",
    "count_over_time",
    "day_of_month",
    "day_of_week",
    "day_of_year",
    "days_in_month",
    "deg",
    "delta",
    "deriv",
    "exp",
    "floor",
    "group",
    "histogram_avg",
    "histogram_count",
    "histogram_fraction",
    "histogram_quantile",
    "histogram_sum",
    "hour",
    "idelta",
    "increase",
    "irate",
    "last_over_time",
    "ln",
    "log10",
    "log2",
    "max",
    "max_over_time",
    "min",
    "min_over_time",
    "minute",
    "month",
    "pi",
    "predict_linear",
    "present_over_time",
    "quantile",
    "quantile_over_time",
    "rad",
    "rate",
    "resets",
    "round",
    "scalar",
    "sgn",
    "sin",
    "sinh",
    "sort",
    "sort_desc",
    "sqrt",
    "stddev",
    "stddev_over_time",
    "stdvar",
    "stdvar_over_time",
    "sum",
    "sum_over_time",
    "tan",
    "tanh",
    "time",
    "timestamp",
    "topk",
    "vector",
    "year",
];

pub const GROUPING: &[&str] = &["by", "without", "on", "ignoring", "group_left", "group_right"];
pub const KEYWORDS: &[&str] = &["and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"];

/// The metric names and labels `expr` refers to.
pub fn scan(expr: &str) -> Result<Refs, String> {
    let toks = tokens(expr)?;
    let mut refs = Refs::default();
    let mut i = 0;
    let next_is = |i: usize, c: char| matches!(toks.get(i), Some(Tok::Punct(p)) if *p == c);
    // the label names of a `{...}` selector starting at toks[i] (the brace), and the index after it
    let selector = |mut i: usize| -> Result<(Vec<String>, usize), String> {
        let mut labels = Vec::new();
        i += 1;
        loop {
            match toks.get(i) {
                Some(Tok::Punct('}')) => return Ok((labels, i + 1)),
                Some(Tok::Punct(',')) => i += 1,
                Some(Tok::Ident(l)) => {
                    labels.push(l.clone());
                    i += 1;
                    // the operator (=, !=, =~, !~), then the value
                    while matches!(toks.get(i), Some(Tok::Punct('=' | '!' | '~'))) {
                        i += 1;
                    }
                    if toks.get(i) != Some(&Tok::Str) {
                        return Err(format!("label {l} without a quoted value in {expr:?}"));
                    }
                    i += 1;
                }
                other => return Err(format!("unexpected {other:?} in a selector of {expr:?}")),
            }
        }
    };
    while i < toks.len() {
        match &toks[i] {
            Tok::Punct('{') => return Err(format!("a selector without a metric name in {expr:?}")),
            Tok::Punct('[') => {
                // a range or subquery: durations and Grafana variables only
                while i < toks.len() && toks[i] != Tok::Punct(']') {
                    i += 1;
                }
                i += 1;
            }
            Tok::Ident(id) => {
                let lower = id.to_ascii_lowercase();
                if next_is(i + 1, '(') && GROUPING.contains(&lower.as_str()) {
                    i += 2;
                    while !next_is(i, ')') {
                        match toks.get(i) {
                            Some(Tok::Ident(l)) => refs.grouping.push(l.clone()),
                            Some(Tok::Punct(',')) => {}
                            other => return Err(format!("unexpected {other:?} in {id}(...) of {expr:?}")),
                        }
                        i += 1;
                    }
                    i += 1;
                } else if next_is(i + 1, '(') {
                    if !FUNCTIONS.contains(&lower.as_str()) {
                        return Err(format!("unknown or unsupported function {id}() in {expr:?}"));
                    }
                    i += 1;
                } else if FUNCTIONS.contains(&lower.as_str())
                    && matches!(toks.get(i + 1), Some(Tok::Ident(k)) if matches!(k.to_ascii_lowercase().as_str(), "by" | "without"))
                {
                    // an aggregation with its clause first: `sum by (l) (x)`
                    i += 1;
                } else if KEYWORDS.contains(&lower.as_str()) {
                    i += 1;
                } else if next_is(i + 1, '{') {
                    let (labels, after) = selector(i + 1)?;
                    refs.metrics.push((id.clone(), labels));
                    i = after;
                } else {
                    refs.metrics.push((id.clone(), Vec::new()));
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    let depth = toks.iter().fold(0i32, |d, t| match t {
        Tok::Punct('(') => d + 1,
        Tok::Punct(')') => d - 1,
        _ => d,
    });
    if depth != 0 {
        return Err(format!("unbalanced parentheses in {expr:?}"));
    }
    if refs.metrics.is_empty() {
        return Err(format!("no metric in {expr:?}"));
    }
    Ok(refs)
}

/// Every problem with `expr` against what was exported.
pub fn check(expr: &str, exported: &Exported) -> Vec<String> {
    let refs = match scan(expr) {
        Ok(r) => r,
        Err(e) => return vec![e],
    };
    let mut problems = Vec::new();
    let mut all_labels: BTreeSet<&str> = TARGET_LABELS.into_iter().collect();
    for (name, labels) in &refs.metrics {
        let Some(have) = exported.labels(name) else {
            problems.push(format!("{expr}: no series {name} on either binary's /metrics"));
            continue;
        };
        all_labels.extend(have.iter().map(String::as_str));
        for l in labels {
            if !have.contains(l) && !TARGET_LABELS.contains(&l.as_str()) {
                problems.push(format!("{expr}: {name} has no label {l} (it has {have:?})"));
            }
        }
    }
    for l in &refs.grouping {
        if !all_labels.contains(l.as_str()) {
            problems.push(format!("{expr}: no series of the expression has the label {l}"));
        }
    }
    problems
}

/// A Grafana `label_values(expr, label)` variable query.
pub fn check_label_values(query: &str, exported: &Exported) -> Vec<String> {
    let Some((expr, label)) =
        query.trim().strip_prefix("label_values(").and_then(|q| q.strip_suffix(')')).and_then(|q| q.rsplit_once(','))
    else {
        return vec![format!("variable query {query:?} is not label_values(metric, label)")];
    };
    let mut problems = check(expr, exported);
    let label = label.trim();
    let has = scan(expr)
        .map(|r| r.metrics.iter().any(|(m, _)| exported.labels(m).is_some_and(|l| l.contains(label))))
        .unwrap_or(false);
    if !has {
        problems.push(format!("{query}: {expr} has no label {label}"));
    }
    problems
}

// -------------------------------------------------------------------------------------------------
// the files
// -------------------------------------------------------------------------------------------------

pub fn dashboard(repo: &Path) -> Json {
    let path = monitoring(repo).join("grafana-dashboard.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `expr` anywhere in the dashboard (panel targets, also inside collapsed rows).
pub fn dashboard_exprs(v: &Json, out: &mut Vec<String>) {
    match v {
        Json::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", Json::String(e)) => out.push(e.clone()),
                    _ => dashboard_exprs(v, out),
                }
            }
        }
        Json::Array(a) => a.iter().for_each(|v| dashboard_exprs(v, out)),
        _ => {}
    }
}

/// The queries of the dashboard's query variables.
pub fn variable_queries(d: &Json) -> Vec<String> {
    let vars = d["templating"]["list"].as_array().cloned().unwrap_or_default();
    vars.iter()
        .filter(|v| v["type"] == "query")
        .map(|v| v["query"]["query"].as_str().or(v["query"].as_str()).unwrap_or_default().to_string())
        .collect()
}

/// Every document of a YAML file (split on `---` lines, as tests/scheduler_config.rs does).
pub fn yaml_documents(path: &Path) -> Vec<Yaml> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.split("\n---")
        .map(|d| serde_norway::from_str::<Yaml>(d).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|v| !v.is_null())
        .collect()
}

/// (alert name, expression) of every rule.
pub fn rules(repo: &Path) -> Vec<(String, String)> {
    let docs = yaml_documents(&monitoring(repo).join("prometheus-rules.yaml"));
    assert_eq!(docs.len(), 1);
    let groups = docs[0]["spec"]["groups"].as_sequence().expect("spec.groups").clone();
    let mut out = Vec::new();
    for g in &groups {
        for r in g["rules"].as_sequence().expect("rules") {
            let name = r["alert"].as_str().or(r["record"].as_str()).expect("alert or record").to_string();
            out.push((name, r["expr"].as_str().expect("expr").to_string()));
        }
    }
    out
}
