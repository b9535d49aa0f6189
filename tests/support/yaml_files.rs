//! Shared by test targets that read the manifests (`#[path]`-included: tests/scheduler_config.rs and
//! the e2e suite).

use std::path::{Path, PathBuf};

/// Every `.yaml` / `.yml` file under `dir`, recursively, in path order; not under a folder named
/// `helm` (scheduler-config/helm/: the Helm chart, whose templates are not plain YAML until Helm
/// renders them; tests/helm_chart/main.rs renders them and checks them against these files).
pub fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    walk(dir, &mut out);
    out
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap_or_else(|e| panic!("{}: {e}", dir.display())).path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "helm") {
                continue;
            }
            walk(&p, out);
        } else if p.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(p);
        }
    }
}
