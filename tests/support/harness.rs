//! The in-process harness: an extender in static mode over a cluster the test builds, pods as
//! kube-scheduler sends them, and the verbs called with the bodies kube-scheduler sends. Every test
//! that builds a cluster and an extender goes through here (`#[path = "support/harness.rs"] mod
//! harness;`), so a change to how the extender is built or called is made once.
// each test binary uses a part of it
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use gpuplace::extender::wire::{ExtenderFilterResult, HostPriorityList};
use gpuplace::extender::Extender;
use gpuplace::placement::engine::Engine;
use gpuplace::placement::mix::WorkloadMix;
use gpuplace::placement::mix_learner::MixLearner;
use gpuplace::placement::profile::{Profile, ProfileConfig};
use gpuplace::placement_log::writer::PlacementLog;
use gpuplace::scheduler::binder::{Binder, RecordingBinder};
use gpuplace::scheduler::service::ServiceOptions;
use gpuplace::scheduler::Scheduler;
use gpuplace_core::cluster::Cluster;
use serde_json::{json, Value};

/// The clock of tests that set one (utilization samples are judged against it).
pub const NOW: i64 = 1_700_000_000_000;

/// How an extender is made: `Harness::new(cluster)`, then what differs from the defaults (the
/// default profile, an empty mix, `RecordingBinder`, default options, no log, the wall clock).
pub struct Harness {
    cluster: Cluster,
    profile: ProfileConfig,
    mix: Option<WorkloadMix>,
    learner: Option<MixLearner>,
    options: ServiceOptions,
    binder: Arc<dyn Binder>,
    log: Option<PlacementLog>,
    clock: Option<i64>,
}

impl Harness {
    pub fn new(cluster: Cluster) -> Self {
        Self {
            cluster,
            profile: ProfileConfig::default(),
            mix: None,
            learner: None,
            options: ServiceOptions::default(),
            binder: Arc::new(RecordingBinder::new()),
            log: None,
            clock: None,
        }
    }

    pub fn profile(mut self, profile: ProfileConfig) -> Self {
        self.profile = profile;
        self
    }

    /// A fixed mix (else the learner's, else none).
    pub fn mix(mut self, mix: WorkloadMix) -> Self {
        self.mix = Some(mix);
        self
    }

    /// The mix is learned, starting from the learner's (`None`: not learned, as without the call).
    pub fn learner(mut self, learner: impl Into<Option<MixLearner>>) -> Self {
        self.learner = learner.into();
        self
    }

    pub fn options(mut self, options: ServiceOptions) -> Self {
        self.options = options;
        self
    }

    pub fn binder(mut self, binder: Arc<dyn Binder>) -> Self {
        self.binder = binder;
        self
    }

    /// Decisions written to `log` (`None`: no log, as without the call).
    pub fn placement_log(mut self, log: impl Into<Option<PlacementLog>>) -> Self {
        self.log = log.into();
        self
    }

    /// The clock fixed at `now_unix_ms` ([`NOW`] in most tests).
    pub fn clock(mut self, now_unix_ms: i64) -> Self {
        self.clock = Some(now_unix_ms);
        self
    }

    pub fn build(self) -> Extender {
        let mix = self.mix.or_else(|| self.learner.as_ref().map(MixLearner::mix)).unwrap_or_default();
        let engine = Engine::new(Profile::new(self.profile), mix);
        let mut scheduler = Scheduler::new(self.cluster, engine, self.binder, self.options);
        if let Some(l) = self.learner {
            scheduler = scheduler.with_mix_learner(l);
        }
        if let Some(log) = self.log {
            scheduler = scheduler.with_placement_log(log);
        }
        if let Some(now) = self.clock {
            scheduler.set_clock(Some(now));
        }
        Extender::from(scheduler)
    }
}

/// An extender with every default over `cluster`.
pub fn extender(cluster: Cluster) -> Extender {
    Harness::new(cluster).build()
}

/// Every node's name, in the cluster's order.
pub fn node_names(ext: &Extender) -> Vec<String> {
    ext.cluster().nodes().iter().map(|n| n.name.clone()).collect()
}

/// `n` whole GPUs, as limits.
pub fn whole(n: u32) -> Value {
    json!({ "gpuplace.io/gpu": n.to_string() })
}

/// A pod of one container `main` with `limits`, in namespace `ns`, UID `uid-<name>`.
pub fn pod_in(namespace: &str, name: &str, limits: Value) -> Value {
    json!({
        "metadata": { "name": name, "namespace": namespace, "uid": format!("uid-{name}") },
        "spec": { "containers": [ { "name": "main", "resources": { "limits": limits } } ] }
    })
}

/// [`pod_in`] namespace `ns`.
pub fn pod(name: &str, limits: Value) -> Value {
    pod_in("ns", name, limits)
}

/// A filter or prioritize body for `pod` over `names` (kube-scheduler's names-only mode).
pub fn args(pod: &Value, names: &[String]) -> Vec<u8> {
    json!({ "Pod": pod, "Nodes": null, "NodeNames": names }).to_string().into_bytes()
}

/// Filter over `names`.
pub fn filter_on(ext: &Extender, pod: &Value, names: &[String]) -> ExtenderFilterResult {
    ext.filter(&args(pod, names)).expect("a well-formed filter body")
}

/// Filter over every node.
pub fn filter(ext: &Extender, pod: &Value) -> ExtenderFilterResult {
    filter_on(ext, pod, &node_names(ext))
}

/// The nodes a filter passed.
pub fn passed(r: &ExtenderFilterResult) -> Vec<String> {
    r.node_names.clone().unwrap_or_default()
}

/// Prioritize over `names`.
pub fn prioritize(ext: &Extender, pod: &Value, names: &[String]) -> HostPriorityList {
    ext.prioritize(&args(pod, names)).expect("a well-formed prioritize body")
}

/// A bind body for `pod` on `node`.
pub fn bind_args(pod: &Value, node: &str) -> Vec<u8> {
    let m = &pod["metadata"];
    json!({ "PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"], "Node": node })
        .to_string()
        .into_bytes()
}

/// Bind `pod` to `node`; the answer's error ("" when bound).
pub fn bind(ext: &Extender, pod: &Value, node: &str) -> String {
    block_on(ext.bind(&bind_args(pod, node))).expect("a well-formed bind body").error
}

/// Runs an async verb (bind) to completion on a fresh actix system, as the HTTP server would.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    actix_web::rt::System::new().block_on(f)
}

/// `../shared/fixtures/kube-scheduler-v1.36/`: kube-scheduler's real extender requests.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/kube-scheduler-v1.36")
}

/// The body of the fixture `<rel>.request.json` (`rel` like `nocache/filter-0001`).
pub fn fixture(rel: &str) -> Vec<u8> {
    let p = fixtures().join(format!("{rel}.request.json"));
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}
