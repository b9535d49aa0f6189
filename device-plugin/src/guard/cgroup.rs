//! Which container a process belongs to, from its cgroup (`/proc/<pid>/cgroup`): the kubelet puts
//! every container in a cgroup named after its pod's UID and its container ID, under both cgroup
//! drivers and both cgroup versions:
//!
//! - systemd: `…/kubepods-besteffort-pod<uid with _>.slice/cri-containerd-<id>.scope`
//! - cgroupfs: `…/kubepods/besteffort/pod<uid>/<id>`
//!
//! Runtimes name the leaf `cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope` or
//! just `<id>`. A kubelet with `cgroupsPerQOS: false` makes no pod cgroups: containerd then puts a
//! container in `/k8s.io/<id>` or `/<id>`, and only the container ID is known (it is unique on the
//! node; the pod is found from its status). A process in no container's cgroup (a host daemon) has
//! none.

use std::path::Path;

/// A process's pod and container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerOfProcess {
    /// The pod's UID with dashes, as in `metadata.uid`, where the cgroup path names it.
    pub pod_uid: Option<String>,
    /// The runtime's container ID (64 hex digits), as in `containerStatuses[].containerID` after
    /// `<runtime>://`.
    pub container_id: String,
}

/// Reads `<proc_root>/<pid>/cgroup`; `None` when the process is gone or in no pod.
pub fn container_of(proc_root: &Path, pid: u32) -> Option<ContainerOfProcess> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok()?;
    parse(&text)
}

/// The pod and container of a `/proc/<pid>/cgroup` text: the first line whose last segment is a
/// container, with the pod's UID when the segment before it names one.
pub fn parse(text: &str) -> Option<ContainerOfProcess> {
    text.lines().find_map(|line| {
        // `hierarchy-ID:controllers:path`; the path may itself hold colons on odd systems
        let path = line.splitn(3, ':').nth(2)?;
        let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        let (last, before) = segments.split_last()?;
        let container_id = container_id_of_segment(last)?;
        let pod_uid = before.last().and_then(|s| pod_uid_of_segment(s));
        Some(ContainerOfProcess { pod_uid, container_id })
    })
}

/// `pod<uid>` (cgroupfs) or `kubepods[-qos]-pod<uid_with_underscores>.slice` (systemd).
pub(crate) fn pod_uid_of_segment(segment: &str) -> Option<String> {
    let s = segment.strip_suffix(".slice").unwrap_or(segment);
    let start = s.rfind("pod")?;
    let before = &s[..start];
    if !(before.is_empty() || before.ends_with('-')) {
        return None;
    }
    let uid = s[start + 3..].replace('_', "-");
    let parts: Vec<&str> = uid.split('-').collect();
    let shape = [8, 4, 4, 4, 12];
    let ok = parts.len() == 5
        && parts.iter().zip(shape).all(|(p, n)| p.len() == n && p.bytes().all(|b| b.is_ascii_hexdigit()));
    ok.then_some(uid)
}

pub(crate) fn container_id_of_segment(segment: &str) -> Option<String> {
    let s = segment.strip_suffix(".scope").unwrap_or(segment);
    let id = ["cri-containerd-", "crio-", "docker-", "containerd-"].iter().find_map(|p| s.strip_prefix(p)).unwrap_or(s);
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_ascii_lowercase())
}

/// `containerd://<id>` (any runtime prefix) to the bare ID.
pub fn bare_container_id(status_id: &str) -> &str {
    status_id.split_once("://").map_or(status_id, |(_, id)| id)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f6e2b1c-3a4d-4e5f-8a9b-0c1d2e3f4a5b";
    const CID: &str = "4c1b5a9e0d2f3e4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f80";

    fn want() -> Option<ContainerOfProcess> {
        Some(ContainerOfProcess { pod_uid: Some(UID.into()), container_id: CID.into() })
    }

    #[test]
    fn systemd_and_cgroupfs_under_both_versions() {
        let u = UID.replace('-', "_");
        let systemd_v2 = format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/cri-containerd-{CID}.scope\n"
        );
        assert_eq!(parse(&systemd_v2), want());
        let guaranteed = format!("0::/kubepods.slice/kubepods-pod{u}.slice/crio-{CID}.scope");
        assert_eq!(parse(&guaranteed), want());
        let cgroupfs_v2 = format!("0::/kubepods/burstable/pod{UID}/{CID}");
        assert_eq!(parse(&cgroupfs_v2), want());
        // cgroup v1: many lines, some without the pod (a controller not delegated)
        let v1 = format!("12:pids:/\n11:memory:/kubepods/besteffort/pod{UID}/{CID}\n0::/\n");
        assert_eq!(parse(&v1), want());
        // nested under a kubelet's own cgroup root (as the e2e node runs)
        let nested = format!("0::/e2e-node/kubepods/besteffort/pod{UID}/{CID}");
        assert_eq!(parse(&nested), want());
        // no pod cgroups (cgroupsPerQOS: false): the container alone
        let bare = Some(ContainerOfProcess { pod_uid: None, container_id: CID.into() });
        assert_eq!(parse(&format!("4:memory:/k8s.io/{CID}\n")), bare);
        assert_eq!(parse(&format!("0::/{CID}")), bare);
    }

    #[test]
    fn processes_outside_pods_have_none() {
        assert_eq!(parse("0::/system.slice/containerd.service\n"), None);
        assert_eq!(parse("0::/user.slice/user-0.slice/session-1.scope"), None);
        // the pod's own cgroup (the pause process's parent) names no container
        assert_eq!(parse(&format!("0::/kubepods/besteffort/pod{UID}")), None);
        // look-alikes are not pods, and a leaf that is no container ID is nothing
        assert_eq!(parse(&format!("0::/ipod{UID}/{CID}")).and_then(|c| c.pod_uid), None);
        assert_eq!(parse(&format!("0::/kubepods/pod{UID}/not-a-container")), None);
        assert_eq!(parse("4:memory:/process_api/936fc985dacf96da625b1000668994b7"), None);
        assert_eq!(parse(""), None);
        assert_eq!(parse("garbage"), None);
    }

    #[test]
    fn status_ids_lose_their_runtime() {
        assert_eq!(bare_container_id(&format!("containerd://{CID}")), CID);
        assert_eq!(bare_container_id(CID), CID);
    }

    #[test]
    fn reads_this_process_without_failing() {
        // this test process is in no pod: None, never a panic
        let _ = container_of(Path::new("/proc"), std::process::id());
        assert_eq!(container_of(Path::new("/proc"), u32::MAX), None);
    }
}
