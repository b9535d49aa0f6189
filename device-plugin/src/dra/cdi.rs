//! The CDI spec files of prepared claims, one per claim, in the runtime's CDI directory
//! (`--cdi-dir`, `/var/run/cdi`): written whole (a temporary file renamed into place, so the runtime
//! never reads half a spec) and removed at unprepare. The files outlive a restart of the plugin, as
//! kubelet's own record of prepared claims does, so a container started after the restart still
//! finds its claim's spec.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The spec file of claim `uid` of `driver`.
pub fn spec_path(dir: &Path, driver: &str, uid: &str) -> PathBuf {
    dir.join(format!("{driver}-claim_{uid}.json"))
}

/// Writes claim `uid`'s spec, replacing an older one.
pub fn write_spec(dir: &Path, driver: &str, uid: &str, spec: &Value) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = spec_path(dir, driver, uid);
    let tmp = dir.join(format!(".{driver}-claim_{uid}.json.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(serde_json::to_string_pretty(spec).map_err(std::io::Error::other)?.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

/// Removes claim `uid`'s spec; a spec that is not there is not an error (unprepare is repeated).
pub fn remove_spec(dir: &Path, driver: &str, uid: &str) -> std::io::Result<bool> {
    match std::fs::remove_file(spec_path(dir, driver, uid)) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// The UIDs of the claims of `driver` with a spec in `dir` (prepared and not unprepared, by this run
/// of the plugin or an earlier one), sorted.
pub fn prepared_uids(dir: &Path, driver: &str) -> std::io::Result<Vec<String>> {
    let prefix = format!("{driver}-claim_");
    let mut uids = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name();
        let name = name.to_string_lossy();
        if let Some(uid) = name.strip_prefix(&prefix).and_then(|r| r.strip_suffix(".json")) {
            uids.push(uid.to_string());
        }
    }
    uids.sort();
    Ok(uids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_are_written_whole_and_removed_once() {
        let dir = std::env::temp_dir().join(format!("gpuplace-cdi-{}", std::process::id()));
        let spec = serde_json::json!({"cdiVersion": "0.6.0", "kind": "gpu.gpuplace.io/claim", "devices": []});
        let p = write_spec(&dir, "gpu.gpuplace.io", "u1", &spec).unwrap();
        assert_eq!(p, dir.join("gpu.gpuplace.io-claim_u1.json"));
        let back: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(back, spec);
        // only the spec is left in the folder
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        assert_eq!(prepared_uids(&dir, "gpu.gpuplace.io").unwrap(), ["u1"]);
        assert!(prepared_uids(&dir, "other.example.com").unwrap().is_empty());
        assert!(remove_spec(&dir, "gpu.gpuplace.io", "u1").unwrap());
        assert!(!remove_spec(&dir, "gpu.gpuplace.io", "u1").unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
