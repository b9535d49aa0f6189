//! Driver-enforced GPU memory limits (docs/isolation.md, mode `driver-limits`): on drivers with
//! per-cgroup memory limits (NVML 615's `nvmlDeviceSetMemoryLimits_v1`, cgroup v2), each share's
//! cgroup is capped at its grant on each of its GPUs, so an allocation past the grant fails in the
//! offender itself and its neighbours keep theirs. The guard keeps running as the backstop (the
//! moments before a cap is set, memory the driver does not count).
//!
//! The cap goes on the pod's cgroup where the kubelet makes pod cgroups: it exists before any of the
//! pod's containers starts, so the cap is usually set before the first allocation. A pod's cap on a
//! GPU is the sum of its containers' grants there (init containers run one at a time, before them:
//! the larger of that sum and the largest init container's), each with one CUDA context
//! (`--context-overhead-mib`). A kubelet with `cgroupsPerQOS: false` makes no pod cgroups: then each
//! container's cgroup is capped, once its ID shows in the pod's status. Whole-GPU grants are not
//! capped. This module is the pure part: what to cap ([`plan`]) and where the cgroups are
//! ([`CgroupIndex`]); [`run`] sets the caps.

pub mod run;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::guard::cgroup::{container_id_of_segment, pod_uid_of_segment};
use crate::guard::Grant;

/// A pod of this node with a trusted gpuplace assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodGrants {
    /// `namespace/name`, for logs.
    pub pod: String,
    pub uid: String,
    pub containers: Vec<ContainerGrants>,
}

/// One container's grants, by GPU index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerGrants {
    pub name: String,
    /// The runtime's ID once the pod's status has it (bare, 64 hex digits).
    pub container_id: Option<String>,
    pub init: bool,
    pub grants: BTreeMap<u32, Grant>,
}

/// The runtime's ID of container `name` (app or init) from the pod's status, bare and lowercase as
/// cgroups name it; `None` until the container has started.
pub fn status_container_id(pod: &k8s_openapi::api::core::v1::Pod, name: &str) -> Option<String> {
    let status = pod.status.as_ref()?;
    [&status.container_statuses, &status.init_container_statuses]
        .into_iter()
        .flatten()
        .flatten()
        .find(|c| c.name == name)
        .and_then(|c| c.container_id.as_deref())
        .map(|id| crate::guard::cgroup::bare_container_id(id).to_ascii_lowercase())
}

/// This node's pods and their grants (the pod watch of the assignments mode).
pub trait GrantedPods: Send + Sync {
    fn granted_pods(&self) -> Vec<PodGrants>;
}

/// One cap: a cgroup on a GPU.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Target {
    pub gpu: u32,
    pub cgroup: PathBuf,
}

/// What a target should be capped at, and whose it is (for logs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cap {
    pub limit_mib: u64,
    pub holder: String,
}

/// The pod and container cgroups under a cgroup root, by pod UID and container ID.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupIndex {
    pub pods: HashMap<String, PathBuf>,
    pub containers: HashMap<String, PathBuf>,
}

/// How deep a pod or container cgroup can be below the root: `kubepods.slice/kubepods-burstable.slice/
/// kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope` is 4; a controller directory (cgroup
/// v1) or a kubelet `--cgroup-root` adds one or two.
const MAX_DEPTH: usize = 7;

impl CgroupIndex {
    /// Walks `root` (shallowest match wins; directories in name order, so the answer is stable);
    /// unreadable directories are skipped.
    pub fn scan(root: &Path) -> Self {
        let mut index = Self::default();
        let mut level = vec![root.to_path_buf()];
        for _ in 0..MAX_DEPTH {
            let mut next = Vec::new();
            for dir in level {
                let Ok(entries) = std::fs::read_dir(&dir) else { continue };
                let mut subdirs: Vec<(String, PathBuf)> = entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
                    .collect();
                subdirs.sort();
                for (name, path) in subdirs {
                    if let Some(id) = container_id_of_segment(&name) {
                        // a container's cgroup has no pod or container below it
                        index.containers.entry(id).or_insert(path);
                        continue;
                    }
                    if let Some(uid) = pod_uid_of_segment(&name) {
                        index.pods.entry(uid).or_insert_with(|| path.clone());
                    }
                    next.push(path);
                }
            }
            if next.is_empty() {
                break;
            }
            level = next;
        }
        index
    }

    /// Whether every pod's cgroup is known or, where it has none (yet), the cgroup of each of its
    /// started containers, at least one: otherwise the tree is walked again.
    pub fn covers(&self, pods: &[PodGrants]) -> bool {
        pods.iter().all(|p| {
            let mut ids = p.containers.iter().filter_map(|c| c.container_id.as_ref()).peekable();
            self.pods.contains_key(&p.uid) || (ids.peek().is_some() && ids.all(|id| self.containers.contains_key(id)))
        })
    }
}

/// The cap of each target: per pod cgroup where it has one, else per started container.
pub fn plan(pods: &[PodGrants], index: &CgroupIndex, context_overhead_mib: u64) -> BTreeMap<Target, Cap> {
    let mut out = BTreeMap::new();
    let share = |g: &Grant| (!g.exclusive).then_some(g.mem_mib + context_overhead_mib);
    for pod in pods {
        if let Some(cgroup) = index.pods.get(&pod.uid) {
            let gpus: std::collections::BTreeSet<u32> =
                pod.containers.iter().flat_map(|c| c.grants.keys().copied()).collect();
            for gpu in gpus {
                let on_gpu = || pod.containers.iter().filter_map(|c| c.grants.get(&gpu).map(|g| (c.init, g)));
                // a whole GPU anywhere in the pod: no cap on that GPU
                if on_gpu().any(|(_, g)| g.exclusive) {
                    continue;
                }
                let apps: u64 = on_gpu().filter(|(init, _)| !init).filter_map(|(_, g)| share(g)).sum();
                let init = on_gpu().filter(|(init, _)| *init).filter_map(|(_, g)| share(g)).max().unwrap_or(0);
                out.insert(
                    Target { gpu, cgroup: cgroup.clone() },
                    Cap { limit_mib: apps.max(init), holder: pod.pod.clone() },
                );
            }
            continue;
        }
        for c in &pod.containers {
            let Some(cgroup) = c.container_id.as_ref().and_then(|id| index.containers.get(id)) else { continue };
            for (gpu, g) in &c.grants {
                if let Some(limit_mib) = share(g) {
                    out.insert(
                        Target { gpu: *gpu, cgroup: cgroup.clone() },
                        Cap { limit_mib, holder: format!("{}/{}", pod.pod, c.name) },
                    );
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f6e2b1c-3a4d-4e5f-8a9b-0c1d2e3f4a5b";

    fn share(mem_mib: u64) -> Grant {
        Grant { mem_mib, core_pct: 30, exclusive: false }
    }

    fn container(name: &str, id: Option<&str>, init: bool, grants: &[(u32, Grant)]) -> ContainerGrants {
        ContainerGrants {
            name: name.into(),
            container_id: id.map(str::to_string),
            init,
            grants: grants.iter().copied().collect(),
        }
    }

    fn pod(containers: Vec<ContainerGrants>) -> PodGrants {
        PodGrants { pod: "ml/train".into(), uid: UID.into(), containers }
    }

    fn cid(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    #[test]
    fn a_pod_cgroup_is_capped_at_the_sum_of_its_containers_grants_per_gpu() {
        let index = CgroupIndex { pods: [(UID.to_string(), PathBuf::from("/cg/pod"))].into(), ..Default::default() };
        let p = pod(vec![
            container("a", None, false, &[(0, share(10_000)), (1, share(4_000))]),
            container("b", None, false, &[(0, share(6_000))]),
            container("setup", None, true, &[(0, share(20_000))]),
        ]);
        let caps = plan(&[p], &index, 500);
        let at = |gpu| caps.get(&Target { gpu, cgroup: "/cg/pod".into() }).map(|c| c.limit_mib);
        // GPU 0: apps 10,500 + 6,500 = 17,000 < the init container's 20,500
        assert_eq!(at(0), Some(20_500));
        assert_eq!(at(1), Some(4_500));
        assert_eq!(caps.len(), 2);
        assert_eq!(caps.values().next().unwrap().holder, "ml/train");
    }

    #[test]
    fn whole_gpus_are_never_capped() {
        let index = CgroupIndex { pods: [(UID.to_string(), PathBuf::from("/cg/pod"))].into(), ..Default::default() };
        let whole = Grant { mem_mib: 80_000, core_pct: 100, exclusive: true };
        let p = pod(vec![container("a", None, false, &[(0, whole), (1, share(1_000))])]);
        let caps = plan(&[p], &index, 0);
        assert_eq!(caps.keys().map(|t| t.gpu).collect::<Vec<_>>(), vec![1]);
    }

    #[test]
    fn without_pod_cgroups_each_started_container_is_capped() {
        let index =
            CgroupIndex { containers: [(cid('a'), PathBuf::from("/cg/k8s.io/a"))].into(), ..Default::default() };
        let a = cid('a');
        let b = cid('b');
        let p = pod(vec![
            container("a", Some(a.as_str()), false, &[(0, share(20_480))]),
            // started, but its cgroup is not found yet; and one not started
            container("b", Some(b.as_str()), false, &[(0, share(1_000))]),
            container("c", None, false, &[(0, share(1_000))]),
        ]);
        let caps = plan(std::slice::from_ref(&p), &index, 512);
        assert_eq!(caps.len(), 1);
        let (t, c) = caps.iter().next().unwrap();
        assert_eq!((t.gpu, t.cgroup.as_path(), c.limit_mib), (0, Path::new("/cg/k8s.io/a"), 20_992));
        assert_eq!(c.holder, "ml/train/a");
        assert!(!index.covers(std::slice::from_ref(&p)), "b's cgroup is missing: scan again");
        let full = CgroupIndex { pods: [(UID.to_string(), PathBuf::from("/cg/pod"))].into(), ..Default::default() };
        assert!(full.covers(std::slice::from_ref(&p)));
        // no pod cgroup and nothing started: the pod cgroup may appear, so look again
        let unstarted = pod(vec![container("c", None, false, &[(0, share(1_000))])]);
        assert!(!index.covers(std::slice::from_ref(&unstarted)) && full.covers(&[unstarted]));
    }

    #[test]
    fn the_index_finds_pod_and_container_cgroups_of_both_drivers() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let systemd_uid = UID.replace('-', "_");
        let systemd_pod =
            r.join(format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{systemd_uid}.slice"));
        std::fs::create_dir_all(systemd_pod.join(format!("cri-containerd-{}.scope", cid('a')))).unwrap();
        let other = "11111111-2222-3333-4444-555555555555";
        let cgroupfs_pod = r.join(format!("kubepods/pod{other}"));
        std::fs::create_dir_all(cgroupfs_pod.join(cid('b'))).unwrap();
        // no pod cgroups (cgroupsPerQOS: false), and a cgroup v1 controller above it
        std::fs::create_dir_all(r.join(format!("memory/k8s.io/{}", cid('c')))).unwrap();
        std::fs::create_dir_all(r.join("system.slice/containerd.service")).unwrap();
        let index = CgroupIndex::scan(r);
        assert_eq!(index.pods.get(UID), Some(&systemd_pod));
        assert_eq!(index.pods.get(other), Some(&cgroupfs_pod));
        assert_eq!(
            index.containers.get(&cid('a')),
            Some(&systemd_pod.join(format!("cri-containerd-{}.scope", cid('a'))))
        );
        assert_eq!(index.containers.get(&cid('b')), Some(&cgroupfs_pod.join(cid('b'))));
        assert_eq!(index.containers.get(&cid('c')), Some(&r.join(format!("memory/k8s.io/{}", cid('c')))));
        assert_eq!(index.pods.len() + index.containers.len(), 5);
        // a missing root is an empty index, not an error
        assert_eq!(CgroupIndex::scan(&r.join("nowhere")), CgroupIndex::default());
    }
}
