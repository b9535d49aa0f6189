//! Sets the caps [`super::plan`] asks for, through the driver, and keeps them: a new pod's cgroup is
//! capped at the next pass, a changed grant re-capped, a finished pod's cap cleared (or dropped with
//! its cgroup). A cap the driver refuses is logged once per target and counted, and retried at every
//! pass; the guard still holds that container to its grant.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::{plan, CgroupIndex, GrantedPods, Target};
use crate::nvml::GpuBackend;
use crate::sampler::Telemetry;

/// What one pass changed (for tests and logs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Capped { target: Target, limit_mib: u64 },
    Cleared(Target),
    Failed { target: Target, error: String },
}

/// See the module docs.
pub struct DriverLimiter {
    backend: Arc<dyn GpuBackend>,
    pods: Arc<dyn GrantedPods>,
    telemetry: Arc<Telemetry>,
    cgroup_root: PathBuf,
    context_overhead_mib: u64,
    index: CgroupIndex,
    applied: BTreeMap<Target, u64>,
    /// Targets the driver refused, with the error as logged.
    failing: HashMap<Target, String>,
}

impl DriverLimiter {
    pub fn new(
        backend: Arc<dyn GpuBackend>,
        pods: Arc<dyn GrantedPods>,
        telemetry: Arc<Telemetry>,
        cgroup_root: PathBuf,
        context_overhead_mib: u64,
    ) -> Self {
        telemetry.enable_driver_limits();
        Self {
            backend,
            pods,
            telemetry,
            cgroup_root,
            context_overhead_mib,
            index: CgroupIndex::default(),
            applied: BTreeMap::new(),
            failing: HashMap::new(),
        }
    }

    /// A pass every `interval`, forever.
    pub async fn run(mut self, interval: Duration) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            // a walk of the cgroup tree and driver calls: off the async workers
            self = match tokio::task::spawn_blocking(move || {
                self.pass();
                self
            })
            .await
            {
                Ok(me) => me,
                Err(e) => {
                    tracing::error!(error = %e, "the driver-limits pass panicked; memory caps are no longer kept");
                    return;
                }
            };
        }
    }

    /// One pass: the caps the pods need now, against those set.
    pub fn pass(&mut self) -> Vec<Change> {
        let pods = self.pods.granted_pods();
        if !self.index.covers(&pods) {
            self.index = CgroupIndex::scan(&self.cgroup_root);
        }
        let wanted = plan(&pods, &self.index, self.context_overhead_mib);
        let mut changes = Vec::new();
        for (target, cap) in &wanted {
            if self.applied.get(target) == Some(&cap.limit_mib) {
                continue;
            }
            match self.backend.set_memory_limit(target.gpu, &target.cgroup, Some(cap.limit_mib)) {
                Ok(()) => {
                    self.failing.remove(target);
                    self.applied.insert(target.clone(), cap.limit_mib);
                    tracing::info!(holder = %cap.holder, gpu = target.gpu, cgroup = %target.cgroup.display(), limit_mib = cap.limit_mib, "the driver caps this share's GPU memory");
                    changes.push(Change::Capped { target: target.clone(), limit_mib: cap.limit_mib });
                }
                Err(e) => {
                    let error = e.to_string();
                    self.telemetry.driver_limit_error();
                    if self.failing.get(target) != Some(&error) {
                        tracing::warn!(holder = %cap.holder, gpu = target.gpu, cgroup = %target.cgroup.display(), error = %error, "the driver did not cap this share's GPU memory; the guard holds it to its grant");
                        self.failing.insert(target.clone(), error.clone());
                    }
                    changes.push(Change::Failed { target: target.clone(), error });
                }
            }
        }
        let gone: Vec<Target> = self.applied.keys().filter(|t| !wanted.contains_key(t)).cloned().collect();
        for target in gone {
            self.applied.remove(&target);
            // a removed cgroup takes its limits with it; one still there (a grant that ended while
            // the pod lives on) is cleared
            if target.cgroup.is_dir() {
                if let Err(e) = self.backend.set_memory_limit(target.gpu, &target.cgroup, None) {
                    tracing::warn!(gpu = target.gpu, cgroup = %target.cgroup.display(), error = %e, "clearing a GPU memory cap failed");
                    self.telemetry.driver_limit_error();
                    continue;
                }
            }
            changes.push(Change::Cleared(target));
        }
        self.failing.retain(|t, _| wanted.contains_key(t));
        self.telemetry.driver_limits_applied(self.applied.len());
        changes
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::driver_limits::{ContainerGrants, PodGrants};
    use crate::guard::Grant;
    use crate::nvml::fake::FakeBackend;

    const UID: &str = "0f6e2b1c-3a4d-4e5f-8a9b-0c1d2e3f4a5b";

    struct Pods(Mutex<Vec<PodGrants>>);

    impl GrantedPods for Pods {
        fn granted_pods(&self) -> Vec<PodGrants> {
            self.0.lock().unwrap().clone()
        }
    }

    fn h100(limits: Option<PathBuf>) -> Arc<FakeBackend> {
        let topo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/topologies/hgx-h100-8.json");
        let b = FakeBackend::load(&topo, "node-a").unwrap();
        Arc::new(match limits {
            Some(f) => b.with_driver_limits_file(f),
            None => b,
        })
    }

    fn train(mem_mib: u64) -> PodGrants {
        PodGrants {
            pod: "ml/train".into(),
            uid: UID.into(),
            containers: vec![ContainerGrants {
                name: "main".into(),
                container_id: None,
                init: false,
                grants: [(0, Grant { mem_mib, core_pct: 25, exclusive: false })].into(),
            }],
        }
    }

    #[test]
    fn caps_are_set_once_changed_with_the_grant_and_cleared_with_the_pod() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("cgroup");
        let pod_cg = root.join(format!("kubepods/burstable/pod{UID}"));
        std::fs::create_dir_all(&pod_cg).unwrap();
        let file = dir.path().join("limits.json");
        let backend = h100(Some(file.clone()));
        let pods = Arc::new(Pods(Mutex::new(vec![train(20_480)])));
        let telemetry = Telemetry::new(8, false);
        let mut l = DriverLimiter::new(backend.clone(), pods.clone(), telemetry.clone(), root, 512);
        let target = Target { gpu: 0, cgroup: pod_cg.clone() };
        assert_eq!(l.pass(), vec![Change::Capped { target: target.clone(), limit_mib: 20_992 }]);
        assert_eq!(l.pass(), vec![], "nothing changed: no driver call");
        let written: crate::nvml::fake::FakeLimits =
            serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!((written.limits[0].cgroup.as_path(), written.limits[0].limit_mib), (pod_cg.as_path(), 20_992));
        assert_eq!(telemetry.snapshot().driver_limits.map(|d| d.applied), Some(1));

        *pods.0.lock().unwrap() = vec![train(10_240)];
        assert_eq!(l.pass(), vec![Change::Capped { target: target.clone(), limit_mib: 10_752 }]);

        pods.0.lock().unwrap().clear();
        assert_eq!(l.pass(), vec![Change::Cleared(target)]);
        assert!(backend.memory_limits().is_empty());
        assert_eq!(telemetry.snapshot().driver_limits.map(|d| d.applied), Some(0));
    }

    #[test]
    fn a_refused_cap_is_counted_and_retried_and_a_late_cgroup_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("cgroup");
        std::fs::create_dir_all(&root).unwrap();
        // a driver without limits refuses every cap
        let pods = Arc::new(Pods(Mutex::new(vec![train(1_000)])));
        let telemetry = Telemetry::new(8, false);
        let mut l = DriverLimiter::new(h100(None), pods.clone(), telemetry.clone(), root.clone(), 0);
        assert_eq!(l.pass(), vec![], "no cgroup yet: nothing to cap");
        let pod_cg = root.join(format!("kubepods/pod{UID}"));
        std::fs::create_dir_all(&pod_cg).unwrap();
        let changes = l.pass();
        assert!(
            matches!(&changes[..], [Change::Failed { error, .. }] if error.contains("--fake-driver-limits")),
            "{changes:?}"
        );
        assert_eq!(l.pass().len(), 1, "retried");
        let stats = telemetry.snapshot().driver_limits.unwrap();
        assert_eq!((stats.applied, stats.errors), (0, 2));
    }
}
