//! Unpacking the xz-compressed binaries of `../shared/kube/` (Kubernetes, Helm) for the tests that
//! run them (`#[path]`-included by tests/e2e and tests/helm_chart/main.rs, each with `support/packages.rs`).
//! Never into the repository.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `xz` unpacked as the executable `dir/name` once; reused after. It is written under another name
/// and renamed, so a concurrent test never runs half a binary.
pub fn unpack(xz: &Path, dir: &Path, name: &str) -> PathBuf {
    let out = dir.join(name);
    if out.is_file() {
        return out;
    }
    fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    crate::packages::require(&["xz-utils"]);
    let partial = dir.join(format!("{name}.partial.{}", std::process::id()));
    let file = fs::File::create(&partial).expect("create the unpacked binary");
    let status = Command::new("xz")
        .arg("-dc")
        .arg(xz)
        .stdout(file)
        .status()
        .unwrap_or_else(|e| panic!("running xz to unpack {}: {e} (install xz-utils)", xz.display()));
    assert!(status.success(), "xz -dc {} failed: {status}", xz.display());
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&partial, fs::Permissions::from_mode(0o755)).expect("chmod the unpacked binary");
    fs::rename(&partial, &out).expect("rename the unpacked binary");
    out
}
