//! Which isolation mode this node runs in (issue 49): chosen at start from what the node can do,
//! strongest first (driver-limits, mps, guard, advisory), or as `--isolation` names it; published
//! with the node's inventory (`isolation`), as the DRA devices' `isolation` attribute, in
//! `discover` and on `/metrics`.
//!
//! The capabilities come from the parts that enforce: the driver's per-cgroup memory limits
//! ([`crate::nvml::DriverMemoryLimits`]), the MPS control daemon's supervisor and the guard. Each is
//! `Ok(())` when usable, else the reason it is not (logged at start, shown by `discover`).

use std::collections::BTreeMap;
use std::path::Path;

use gpuplace_core::isolation::IsolationMode;
use serde::Serialize;

/// What this node can enforce with, and why each missing mode is missing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    pub driver_limits: bool,
    pub mps: bool,
    pub guard: bool,
    /// Each mode the node cannot run in, with the reason (advisory is always possible).
    pub missing: BTreeMap<IsolationMode, String>,
}

impl Capabilities {
    /// From each enforcer's own report: `Ok(())` usable, `Err(why)` not.
    pub fn new(driver_limits: Result<(), String>, mps: Result<(), String>, guard: Result<(), String>) -> Self {
        let mut missing = BTreeMap::new();
        for (mode, r) in
            [(IsolationMode::DriverLimits, &driver_limits), (IsolationMode::Mps, &mps), (IsolationMode::Guard, &guard)]
        {
            if let Err(why) = r {
                missing.insert(mode, why.clone());
            }
        }
        Self { driver_limits: driver_limits.is_ok(), mps: mps.is_ok(), guard: guard.is_ok(), missing }
    }

    pub fn has(&self, mode: IsolationMode) -> bool {
        match mode {
            IsolationMode::DriverLimits => self.driver_limits,
            IsolationMode::Mps => self.mps,
            IsolationMode::Guard => self.guard,
            IsolationMode::Advisory => true,
        }
    }

    /// Why `mode` is not available (`None` when it is).
    pub fn why_not(&self, mode: IsolationMode) -> Option<&str> {
        if self.has(mode) {
            None
        } else {
            Some(self.missing.get(&mode).map_or("not available", String::as_str))
        }
    }
}

/// An `--isolation` the node cannot honour: the plugin does not start (a node that says it enforces
/// and does not would be worse than one that is advisory).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--isolation {mode}: this node cannot run in that mode: {why} (use --isolation auto to take the strongest mode it can)")]
pub struct Unavailable {
    pub mode: IsolationMode,
    pub why: String,
}

/// The mode to run in: `requested` when the node can (an error saying why not otherwise), or with
/// `None` (`auto`) the strongest the node can: driver-limits, mps, guard, then advisory.
pub fn choose(requested: Option<IsolationMode>, caps: &Capabilities) -> Result<IsolationMode, Unavailable> {
    match requested {
        Some(mode) => match caps.why_not(mode) {
            None => Ok(mode),
            Some(why) => Err(Unavailable { mode, why: why.to_string() }),
        },
        None => Ok(IsolationMode::ALL.into_iter().find(|&m| caps.has(m)).unwrap_or(IsolationMode::Advisory)),
    }
}

/// `--isolation`: `auto` (`None`) or a mode's name.
pub fn parse_flag(text: &str) -> Result<Option<IsolationMode>, String> {
    match text.trim() {
        "auto" => Ok(None),
        t => t.parse().map(Some).map_err(|_| format!("{text:?}: use auto, driver-limits, mps, guard or advisory")),
    }
}

/// What the guard needs to map GPU processes to pods and their grants: the API server (the grants)
/// and kubelet's pod-resources socket (which container holds which GPU).
pub fn guard_prerequisites(apiserver: bool, pod_resources_socket: &Path) -> Result<(), String> {
    if !apiserver {
        return Err("the guard needs the API server (runs with --no-apiserver)".into());
    }
    if !pod_resources_socket.exists() {
        return Err(format!(
            "the guard needs kubelet's pod-resources socket, and {} does not exist",
            pod_resources_socket.display()
        ));
    }
    Ok(())
}

/// The driver-limits capability: the driver has per-cgroup memory caps, and the plugin may set them
/// (`enabled`: `--driver-limits` with the host's cgroup v2 tree mounted, in assignments mode with
/// the API server, where each share's grant is known; the reason otherwise).
pub fn driver_limits_usable(
    driver: &crate::nvml::DriverMemoryLimits,
    enabled: Result<(), String>,
) -> Result<(), String> {
    if !driver.supported {
        return Err(driver.detail.clone());
    }
    enabled.map_err(|why| format!("{}, but {why}", driver.detail))
}

/// MPS as the node runs it today: a control daemon whose pipe directory is given
/// (`--mps-pipe-dir`) and has its `control` socket; containers get MPS's limits in their
/// environment. The MPS supervisor replaces this with its own report.
pub fn mps_prerequisites(pipe_dir: Option<&Path>) -> Result<(), String> {
    let Some(dir) = pipe_dir else { return Err("no MPS control daemon (--mps-pipe-dir is not set)".into()) };
    let control = dir.join("control");
    if control.exists() {
        Ok(())
    } else {
        Err(format!("no MPS control daemon: {} does not exist", control.display()))
    }
}

/// The mode chosen and what it was chosen from, as the plugin publishes and reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IsolationStatus {
    pub mode: IsolationMode,
    pub capabilities: Capabilities,
    /// Whether the driver can cap a cgroup's GPU memory, and what was found (driver, symbol, cgroup).
    pub driver_memory_limits: crate::nvml::DriverMemoryLimits,
}

impl IsolationStatus {
    /// One log line's worth: the mode and why each stronger one was not taken.
    pub fn summary(&self) -> String {
        let stronger: Vec<String> = IsolationMode::ALL
            .into_iter()
            .take_while(|&m| m != self.mode)
            .filter_map(|m| self.capabilities.why_not(m).map(|why| format!("{m}: {why}")))
            .collect();
        if stronger.is_empty() {
            format!("isolation {}", self.mode)
        } else {
            format!("isolation {} (not {})", self.mode, stronger.join("; "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use IsolationMode::*;

    fn caps(d: bool, m: bool, g: bool) -> Capabilities {
        let r = |ok: bool, why: &str| if ok { Ok(()) } else { Err(why.to_string()) };
        Capabilities::new(
            r(d, "driver 550 has no nvmlDeviceSetMemoryLimits_v1"),
            r(m, "no MPS daemon"),
            r(g, "no API server"),
        )
    }

    #[test]
    fn auto_takes_the_strongest_mode_the_node_has() {
        assert_eq!(choose(None, &caps(true, true, true)), Ok(DriverLimits));
        assert_eq!(choose(None, &caps(false, true, true)), Ok(Mps));
        assert_eq!(choose(None, &caps(false, false, true)), Ok(Guard));
        assert_eq!(choose(None, &caps(false, false, false)), Ok(Advisory));
        assert_eq!(choose(None, &caps(true, false, false)), Ok(DriverLimits));
    }

    #[test]
    fn an_explicit_mode_the_node_lacks_is_a_start_error_that_says_why() {
        let c = caps(false, true, false);
        assert_eq!(choose(Some(Mps), &c), Ok(Mps));
        assert_eq!(choose(Some(Advisory), &c), Ok(Advisory));
        let err = choose(Some(Guard), &c).unwrap_err();
        assert_eq!(err, Unavailable { mode: Guard, why: "no API server".into() });
        let text = err.to_string();
        assert!(text.starts_with("--isolation guard: this node cannot") && text.contains("--isolation auto"), "{text}");
        assert!(choose(Some(DriverLimits), &c).unwrap_err().to_string().contains("nvmlDeviceSetMemoryLimits_v1"));
        assert_eq!(c.why_not(Mps), None);
        assert_eq!(c.missing.len(), 2);
    }

    #[test]
    fn the_flag_reads_auto_or_a_mode() {
        assert_eq!(parse_flag("auto"), Ok(None));
        assert_eq!(parse_flag("driver-limits"), Ok(Some(DriverLimits)));
        assert_eq!(parse_flag("advisory"), Ok(Some(Advisory)));
        assert!(parse_flag("enforced").unwrap_err().contains("auto, driver-limits, mps, guard or advisory"));
    }

    #[test]
    fn driver_limits_and_mps_say_why_they_are_missing() {
        use crate::nvml::DriverMemoryLimits;
        let old = DriverMemoryLimits::judge(Some("550.54.15"), false, false, true);
        assert_eq!(driver_limits_usable(&old, Ok(())), Err(old.detail.clone()));
        let new = DriverMemoryLimits::judge(Some("615.1"), true, true, true);
        assert_eq!(driver_limits_usable(&new, Ok(())), Ok(()));
        let off = driver_limits_usable(&new, Err("--driver-limits is not set".into())).unwrap_err();
        assert!(
            off.starts_with("driver 615.1: nvmlDeviceSetMemoryLimits_v1")
                && off.ends_with("but --driver-limits is not set"),
            "{off}"
        );
        assert!(mps_prerequisites(None).unwrap_err().contains("--mps-pipe-dir"));
        let dir = std::env::temp_dir().join(format!("gpuplace-mps-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(mps_prerequisites(Some(&dir)).unwrap_err().contains("control"));
        std::fs::write(dir.join("control"), b"").unwrap();
        assert_eq!(mps_prerequisites(Some(&dir)), Ok(()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_guard_needs_the_api_server_and_the_pod_resources_socket() {
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        assert!(guard_prerequisites(false, here).unwrap_err().contains("API server"));
        assert!(guard_prerequisites(true, &here.join("no-such.sock")).unwrap_err().contains("no-such.sock"));
        assert_eq!(guard_prerequisites(true, here), Ok(()));
    }
}
