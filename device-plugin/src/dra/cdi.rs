//! The CDI spec files of prepared claims, one per claim, in the runtime's CDI directory
//! (`--cdi-dir`, `/var/run/cdi`): written whole (a temporary file renamed into place, so the runtime
//! never reads half a spec) and removed at unprepare. The files outlive a restart of the plugin, as
//! kubelet's own record of prepared claims does, so a container started after the restart still
//! finds its claim's spec.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tokio::sync::watch;

use crate::mps::daemon::ShareSource;
use crate::mps::limits::ShareSlice;
use crate::plugin::Plugin;

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

/// The specs of every claim of `driver` prepared in `dir` (unreadable or malformed ones left out).
pub fn prepared_specs(dir: &Path, driver: &str) -> Vec<Value> {
    let uids = prepared_uids(dir, driver).unwrap_or_default();
    uids.iter()
        .filter_map(|uid| std::fs::read_to_string(spec_path(dir, driver, uid)).ok())
        .filter_map(|text| serde_json::from_str::<Value>(&text).ok())
        .collect()
}

/// A CDI device's environment (`containerEdits.env`), by variable.
pub fn device_env(device: &Value) -> std::collections::BTreeMap<&str, &str> {
    device["containerEdits"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e.as_str()?.split_once('='))
        .collect()
}

/// A comma-separated list of numbers in `env[key]` (none when absent; entries that are not numbers
/// left out).
pub fn env_numbers(env: &std::collections::BTreeMap<&str, &str>, key: &str) -> Vec<u64> {
    env.get(key).map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect()).unwrap_or_default()
}

/// The shares in one spec: each CDI device's environment names its GPUs
/// (`GPUPLACE_GPU_INDICES`), their limits (`GPUPLACE_GPU_MEM_MIB`, `GPUPLACE_GPU_CORE_PCT`), whether
/// they are whole (`GPUPLACE_EXCLUSIVE`) and the claim (`GPUPLACE_CLAIM`, as `claim:namespace/name`), as
/// [`super::prepare`] wrote them. Whole GPUs are left out.
pub fn spec_shares(spec: &Value) -> Vec<ShareSlice> {
    let mut out = Vec::new();
    for device in spec["devices"].as_array().into_iter().flatten() {
        let env = device_env(device);
        if env.get("GPUPLACE_EXCLUSIVE") != Some(&"false") {
            continue;
        }
        let list = |k: &str| env_numbers(&env, k);
        let (gpus, mem, core) =
            (list("GPUPLACE_GPU_INDICES"), list("GPUPLACE_GPU_MEM_MIB"), list("GPUPLACE_GPU_CORE_PCT"));
        let pod = format!("claim:{}", env.get("GPUPLACE_CLAIM").copied().unwrap_or_default());
        for (i, &gpu) in gpus.iter().enumerate() {
            out.push(ShareSlice {
                gpu: gpu as u32,
                mem_mib: mem.get(i).copied().unwrap_or(0),
                core_pct: core.get(i).copied().unwrap_or(0) as u32,
                pod: pod.clone(),
            });
        }
    }
    out
}

/// Managed MPS's view of a DRA node: the shares of the prepared claims (their specs, which outlive
/// a restart of the plugin), the healthy GPUs as those that serve shares.
pub struct CdiShares {
    pub dir: PathBuf,
    pub driver: String,
    pub plugin: std::sync::Arc<Plugin>,
}

impl ShareSource for CdiShares {
    fn shares(&self) -> Vec<ShareSlice> {
        prepared_specs(&self.dir, &self.driver).iter().flat_map(spec_shares).collect()
    }

    fn serving(&self) -> Vec<u32> {
        self.plugin.serving()
    }

    fn changes(&self) -> Option<watch::Receiver<u64>> {
        self.plugin.changes()
    }
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

    #[test]
    fn shares_are_read_back_from_the_specs_and_whole_gpus_left_out() {
        let env = |v: &[&str]| serde_json::json!({"env": v});
        let spec = serde_json::json!({"devices": [
            {"name": "u1-share", "containerEdits": env(&["GPUPLACE_CLAIM=ns/c", "GPUPLACE_EXCLUSIVE=false",
                "GPUPLACE_GPU_INDICES=2,5", "GPUPLACE_GPU_MEM_MIB=20000,20000", "GPUPLACE_GPU_CORE_PCT=25,25"])},
            {"name": "u1-whole", "containerEdits": env(&["GPUPLACE_CLAIM=ns/c", "GPUPLACE_EXCLUSIVE=true",
                "GPUPLACE_GPU_INDICES=7", "GPUPLACE_GPU_MEM_MIB=81559", "GPUPLACE_GPU_CORE_PCT=100"])},
        ]});
        let share = |gpu| ShareSlice { gpu, mem_mib: 20000, core_pct: 25, pod: "claim:ns/c".into() };
        assert_eq!(spec_shares(&spec), [share(2), share(5)]);
    }
}
