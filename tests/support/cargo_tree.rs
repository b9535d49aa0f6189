//! `cargo tree` as the tests read it (tests/images.rs, tests/layering.rs, `#[path]`-included).

use std::collections::BTreeSet;
use std::process::Command;

/// `cargo tree`'s crates with their features (one line each: `name version [features]`). `--locked`
/// fails when Cargo.lock is stale, as the image build's `cargo build --locked` would.
pub fn resolved(edges: &str, packages: &[&str]) -> BTreeSet<String> {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "--locked", "--prefix", "none", "-e", edges, "-f", "{p} [{f}]"])
        .args(packages)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    assert!(out.status.success(), "cargo tree: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(|l| l.trim_end_matches(" (*)").to_string()).collect()
}
