//! The shipped extender scores with the request mix it learns (`scheduler::mix`): it reports the mix
//! a [`MixLearner`] fed the same pods would have, its prioritize answers are exactly those of the
//! engine the simulator's `gpuplace` policy runs with that learner's mix (through every refresh,
//! with the shape cache and with the per-pod evaluation cache: a cached score never outlives its
//! mix), a pod counts once however often it is filtered, and `--mix-state` survives a restart (and
//! a corrupt file is only a warning).
//!
//! The API-server paths (a pod counted from the watch or the start-up rebuild) are in
//! tests/apiserver_extender.rs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuplace::extender::http::{spawn, HttpOptions};
use gpuplace::extender::http_client::{self, Connection};
use gpuplace::extender::wire::{decode, ExtenderBindingResult, ExtenderFilterResult, HostPriorityList, Pod};
use gpuplace::extender::Extender;
use gpuplace::placement::engine::Engine;
use gpuplace::placement::mix::WorkloadMix;
use gpuplace::placement::mix_learner::{
    bundled_prior, typical_gpu_memory_mib, LearnerConfig, MixLearner, MixLearnerState,
};
use gpuplace::placement::{
    profile::{Profile, ProfileConfig},
    registry::Weights,
};
use gpuplace::scheduler::inspect::InspectReport;
use gpuplace::scheduler::mix::MixSource;
use gpuplace::scheduler::service::ServiceOptions;
use gpuplace_core::cluster::Cluster;
use gpuplace_core::inventory::Board;
use gpuplace_core::resources::PodRequest;
use harness::{args, block_on, Harness, NOW};
use serde_json::{json, Value};

#[path = "support/harness.rs"]
mod harness;

const TIMEOUT: Duration = Duration::from_secs(30);

/// 4 H100 boards of 8, 2 L40S boards of 8, 2 T4 boards of 4: three GPU memory sizes, so shares
/// given in memory are read by the cluster's typical GPU memory.
fn cluster() -> Cluster {
    let h100 = Board::Nvswitch { gpus: 8, model: "H100".into(), memory_mib: 81559, numa_nodes: 2, nvlinks: 18 };
    let l40s =
        Board::Pcie { model: "L40S".into(), memory_mib: 46068, sockets: 2, switches_per_socket: 2, gpus_per_switch: 2 };
    let t4 = Board::Flat { gpus: 4, model: "T4".into(), memory_mib: 15109 };
    let mut nodes = Vec::new();
    for (prefix, board, n) in [("h100-", h100, 4), ("l40s-", l40s, 2), ("t4-", t4, 2)] {
        let board = board.resolve(Path::new(".")).unwrap();
        for i in 0..n {
            nodes.push(board.node(&format!("{prefix}{i}"), BTreeMap::new(), 96_000, 1 << 20));
        }
    }
    Cluster::new(nodes)
}

fn node_names(c: &Cluster) -> Vec<String> {
    c.nodes().iter().map(|n| n.name.clone()).collect()
}

/// Only fragmentation counts: every change of the mix shows in the 0..10 scores (with the default
/// weights most changes round away, and a stale cached score could go unnoticed).
fn fragmentation_only() -> ProfileConfig {
    let weights = Weights::none().with("fragmentation", 1.0);
    ProfileConfig { weights, requested_packing_weight: 0.0, ..ProfileConfig::default() }
}

fn extender(learner: Option<MixLearner>, opts: ServiceOptions) -> Extender {
    extender_with(ProfileConfig::default(), learner, opts)
}

fn extender_with(profile: ProfileConfig, learner: Option<MixLearner>, opts: ServiceOptions) -> Extender {
    Harness::new(cluster()).profile(profile).options(opts).clock(NOW).learner(learner).build()
}

/// The `i`th pod of a workload that drifts: whole GPUs and half shares at first, then mostly pods
/// of 8 whole GPUs (three in five: the measure weighs a type by its popularity over the square root
/// of its GPUs, so it takes that many for the drift to move a 0..10 score) and quarter shares given
/// in memory, with host CPU, so the learned mix moves away from the prior; and a fifth bound to T4
/// GPUs, which gives the reserve a class of its own.
fn workload_pod(i: usize) -> Value {
    let res = |gpu: &str, mem: Option<&str>, core: Option<&str>| {
        let mut limits = json!({ "gpuplace.io/gpu": gpu });
        if let Some(m) = mem {
            limits["gpuplace.io/gpu-mem"] = json!(m);
        }
        if let Some(c) = core {
            limits["gpuplace.io/gpu-core"] = json!(c);
        }
        limits
    };
    let (limits, cpu) = if i < 24 {
        match i % 4 {
            0 => (res("1", None, None), "8"),
            1 => (res("2", None, None), "16"),
            2 => (res("1", None, Some("50")), "4"),
            _ => (res("1", Some("40000"), Some("40")), "4"),
        }
    } else {
        match i % 5 {
            0 | 2 | 3 => (res("8", None, None), "32"),
            1 => (res("1", None, Some("30")), "2"),
            _ => (res("1", Some("20000"), Some("25")), "6"),
        }
    };
    let mut p = pod(&format!("w{i}"), limits, cpu);
    if i >= 24 && i % 5 == 1 {
        p["metadata"]["annotations"] = json!({ "gpuplace.io/gpu-model": "T4" });
    }
    p
}

/// [`harness::pod`] asking `cpu` cores too.
fn pod(name: &str, limits: Value, cpu: &str) -> Value {
    let mut p = harness::pod(name, limits);
    p["spec"]["containers"][0]["resources"]["requests"] = json!({ "cpu": cpu });
    p
}

fn request(pod: &Value) -> PodRequest {
    serde_json::from_value::<Pod>(pod.clone()).unwrap().request().unwrap()
}

/// What the simulator's `gpuplace` policy does with the same pods: a learner counts each arrival and
/// the engine takes the mix the learner's refresh rule gives ([`MixLearner::refreshed`]).
struct Mirror {
    profile: ProfileConfig,
    learner: MixLearner,
    /// The engine that scores with `mix`, kept from pod to pod as the extender's is: which model
    /// lists are short depends on the states it has seen (`placement::scorers::model_supply`).
    engine: Engine,
    mix: WorkloadMix,
    /// The mix before the last refresh.
    previous: WorkloadMix,
    /// Observations when `mix` was taken.
    taken_at: u64,
    gpu_memory: u64,
}

impl Mirror {
    fn new(profile: ProfileConfig, learner: MixLearner, cluster: &Cluster) -> Self {
        let mix = learner.mix();
        let taken_at = learner.observed();
        let engine = Engine::new(Profile::new(profile.clone()), mix.clone());
        let gpu_memory = typical_gpu_memory_mib(cluster);
        Self { profile, engine, previous: mix.clone(), mix, learner, taken_at, gpu_memory }
    }

    fn arrive(&mut self, req: &PodRequest) {
        self.learner.observe_request(req, self.gpu_memory);
        if let Some(mix) = self.learner.refreshed(&self.mix) {
            self.engine.mix = mix.clone();
            self.previous = std::mem::replace(&mut self.mix, mix);
            self.taken_at = self.learner.observed();
        }
    }

    /// Per node, the 0..10 score of a fresh `Engine::new(Profile::new(profile), mix)` (0 where the
    /// pod does not fit).
    fn scores_with(&self, mix: &WorkloadMix, cluster: &Cluster, req: &PodRequest) -> BTreeMap<String, i64> {
        Self::scores_of(&Engine::new(Profile::new(self.profile.clone()), mix.clone()), cluster, req)
    }

    fn scores_of(engine: &Engine, cluster: &Cluster, req: &PodRequest) -> BTreeMap<String, i64> {
        let all: Vec<usize> = (0..cluster.nodes().len()).collect();
        let ev = engine.evaluate(cluster, req, &all, NOW);
        let mut out: BTreeMap<String, i64> = cluster.nodes().iter().map(|n| (n.name.clone(), 0)).collect();
        for c in &ev.ranked {
            out.insert(cluster.nodes()[c.node].name.clone(), c.score);
        }
        out
    }

    /// The scores of the engine of the simulator's gpuplace policy, kept with the learner's mix.
    fn scores(&self, cluster: &Cluster, req: &PodRequest) -> BTreeMap<String, i64> {
        Self::scores_of(&self.engine, cluster, req)
    }
}

/// Nodes by score, best first, ties by name (the order kube-scheduler would see).
fn ranking(scores: &BTreeMap<String, i64>) -> Vec<(String, i64)> {
    let mut v: Vec<(String, i64)> = scores.iter().map(|(n, s)| (n.clone(), *s)).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v
}

fn assert_same_mix(got: &WorkloadMix, want: &WorkloadMix, what: &str) {
    assert_eq!(got.entries.len(), want.entries.len(), "{what}: {got:?} vs {want:?}");
    for (g, w) in got.entries.iter().zip(&want.entries) {
        assert_eq!(
            (g.gpus, g.milli, g.cpu_milli, g.memory_mib, &g.models),
            (w.gpus, w.milli, w.cpu_milli, w.memory_mib, &w.models),
            "{what}"
        );
        assert!((g.weight - w.weight).abs() < 1e-12, "{what}: {} vs {}", g.weight, w.weight);
    }
}

fn prioritized(ext: &Extender, body: &[u8]) -> BTreeMap<String, i64> {
    let answer = decode::<HostPriorityList>(&ext.prioritize_json(body).unwrap()).unwrap();
    answer.into_iter().map(|h| (h.host, h.score)).collect()
}

/// Runs the drifting workload through filter, prioritize and bind (to the best node), checking
/// every prioritize answer against the engine with the mirror's mix, and every bind's GPUs against
/// that engine's placement. Returns the mirror and how many answers the mix before the last refresh
/// would have scored otherwise (what a cache left stale would have answered): a comparison that
/// could not fail proves nothing.
fn run_workload(ext: &Extender, profile: ProfileConfig, learner: MixLearner, pods: usize) -> (Mirror, usize) {
    let names = node_names(&ext.cluster());
    let mut mirror = Mirror::new(profile, learner, &ext.cluster());
    let mut moved = 0;
    for i in 0..pods {
        let p = workload_pod(i);
        let req = request(&p);
        let body = args(&p, &names);
        let filtered = decode::<ExtenderFilterResult>(&ext.filter_json(&body).unwrap()).unwrap();
        mirror.arrive(&req);
        assert_eq!(ext.mix_report().observed, i as u64 + 1, "pod {i} counted at its filter");
        let cluster = ext.cluster();
        let want = mirror.scores(&cluster, &req);
        // twice: the second answer comes from a cache, which must hold the current mix's scores
        for round in 0..2 {
            let got = prioritized(ext, &body);
            assert_eq!(ranking(&got), ranking(&want), "pod {i} round {round}: the order of the nodes");
            assert_eq!(got, want, "pod {i} round {round}: the scores");
        }
        if want != mirror.scores_with(&mirror.previous, &cluster, &req) {
            moved += 1;
        }
        let fits = filtered.node_names.unwrap_or_default();
        // pods of 8 GPUs only arrive (they would soon fill the cluster): kube-scheduler places them
        // elsewhere, or they wait
        let best = ranking(&want).into_iter().find(|(n, _)| fits.contains(n)).filter(|_| req.total_gpus() < 8);
        if let Some((best, _)) = best {
            let bind = json!({ "PodName": format!("w{i}"), "PodNamespace": "ns", "PodUID": format!("uid-w{i}"), "Node": best });
            let r: ExtenderBindingResult = block_on(ext.bind(bind.to_string().as_bytes())).unwrap();
            assert_eq!(r.error, "", "pod {i} binds to {best}");
            // the GPUs on the node are chosen with the same mix (shares go where they fragment least)
            let engine = Engine::new(Profile::new(mirror.profile.clone()), mirror.mix.clone());
            let index = cluster.node_index(&best).unwrap();
            let placed = engine.place(&cluster, &req, index).unwrap();
            assert_eq!(ext.cluster().assignment(&req.key), Some(&placed.assignment), "pod {i}: its GPUs");
        }
    }
    (mirror, moved)
}

/// A learner whose mix swings with the workload: little prior, a short memory.
fn swift() -> MixLearner {
    MixLearner::new(LearnerConfig { half_life: 16.0, prior_weight: 2.0, coverage: 0.95 }, bundled_prior())
}

/// THE test: with the shape cache (the default), prioritize ranks and scores every node exactly as
/// `Engine::new(profile, learner.mix())` does, the engine of the simulator's gpuplace policy, pod
/// after pod, across the refreshes (looked at after 1, 2, 4, .. 64 pods); binds take the GPUs that engine
/// chooses. With gpuplace's default profile and learner (whose mix rarely moves a 0..10 score), and
/// with fragmentation alone and a swift learner, where a stale score would show.
#[test]
fn prioritize_scores_as_the_engine_with_the_learners_mix() {
    for (profile, learner) in [(ProfileConfig::default(), MixLearner::default()), (fragmentation_only(), swift())] {
        let ext = extender_with(profile.clone(), Some(learner.clone()), ServiceOptions::default());
        let (mirror, moved) = run_workload(&ext, profile.clone(), learner, 70);
        let report = ext.mix_report();
        assert_eq!((report.source, report.observed, report.taken_at), (MixSource::Learned, 70, mirror.taken_at));
        assert!(mirror.taken_at >= 32, "the drifting workload moved the mix late too");
        assert_same_mix(&WorkloadMix::new(report.entries, Vec::new()), &mirror.mix, "the mix in use");
        let (hits, _) = ext.shape_cache_stats();
        assert!(hits > 0, "the shape cache answered");
        if profile == fragmentation_only() {
            assert!(moved > 0, "the learned mix never changed a score: the comparison proves nothing");
        }
    }
}

/// The same through the per-pod evaluation cache (shape cache off): prioritize right after filter
/// reuses filter's evaluation only while the mix is the one it was made with.
#[test]
fn prioritize_through_the_evaluation_cache_follows_the_mix_too() {
    let opts = ServiceOptions { shape_cache: 0, ..ServiceOptions::default() };
    let ext = extender_with(fragmentation_only(), Some(swift()), opts);
    let (_, moved) = run_workload(&ext, fragmentation_only(), swift(), 70);
    assert!(moved > 0);
    let (hits, _) = ext.eval_cache_stats();
    assert!(hits > 0, "prioritize reused filter's evaluation");
}

/// A new mix empties every cache: verdicts cached per shape on nodes that did not change since, and
/// the evaluation filter left for the prioritize of the same pod when another pod's arrival brought
/// a new mix in between. Each answer is the new mix's, and the old one's would have differed.
#[test]
fn a_new_mix_leaves_no_cached_score_behind() {
    let probe = |name: &str| pod(name, json!({ "gpuplace.io/gpu": "1", "gpuplace.io/gpu-core": "25" }), "1");
    let eight = |i: usize| pod(&format!("eight-{i}"), json!({ "gpuplace.io/gpu": "8" }), "8");
    for opts in [ServiceOptions::default(), ServiceOptions { shape_cache: 0, ..ServiceOptions::default() }] {
        let ext = extender_with(fragmentation_only(), Some(MixLearner::default()), opts);
        let names = node_names(&ext.cluster());
        let mut mirror = Mirror::new(fragmentation_only(), MixLearner::default(), &ext.cluster());
        // 63 pods of 8 GPUs arrive (filtered, never bound: no node changes) and a share, and the
        // 64th pod brings a mix with more 8-GPU pods than the one taken at the 32nd
        for i in 0..62 {
            ext.filter_json(&args(&eight(i), &names)).unwrap();
            mirror.arrive(&request(&eight(i)));
        }
        let a = probe("a");
        ext.filter_json(&args(&a, &names)).unwrap();
        mirror.arrive(&request(&a));
        let before = mirror.scores(&ext.cluster(), &request(&a));
        ext.filter_json(&args(&eight(62), &names)).unwrap();
        mirror.arrive(&request(&eight(62)));
        assert_eq!(ext.mix_report().taken_at, 64);
        let after = mirror.scores(&ext.cluster(), &request(&a));
        assert_ne!(before, after, "the two mixes must score the probe differently for this test to mean anything");
        // the same pod (its filter's evaluation was made with the old mix)...
        assert_eq!(prioritized(&ext, &args(&a, &names)), after, "the pod filtered before the new mix");
        // ...and another pod of its shape (the shape's verdicts were made with the old mix)
        let b = probe("b");
        ext.filter_json(&args(&b, &names)).unwrap();
        mirror.arrive(&request(&b));
        assert_eq!(prioritized(&ext, &args(&b, &names)), mirror.scores(&ext.cluster(), &request(&b)));
    }
}

/// /inspect and GET /mix over HTTP report what a learner fed the same pods has; /metrics counts it.
#[test]
fn inspect_and_mix_report_the_learners_mix() {
    let ext = Arc::new(extender(Some(MixLearner::default()), ServiceOptions::default()));
    let running = spawn(ext.clone(), HttpOptions::default(), "127.0.0.1:0", 1).unwrap();
    let mut conn = Connection::open(&running.addr.to_string(), TIMEOUT).unwrap();
    let names = node_names(&ext.cluster());
    let mut mirror = Mirror::new(ProfileConfig::default(), MixLearner::default(), &ext.cluster());
    for i in 0..40 {
        let p = workload_pod(i);
        let r = conn.request("POST", "/gpuplace/filter", &args(&p, &names)).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        mirror.arrive(&request(&p));
    }
    let r = conn.request("GET", "/inspect", b"").unwrap();
    let report: InspectReport = serde_json::from_slice(&r.body).unwrap();
    let mix = report.mix.clone().expect("a running extender reports its mix");
    assert_eq!(
        (mix.source, mix.observed, mix.taken_at, mix.half_life),
        (MixSource::Learned, 40, mirror.taken_at, Some(LearnerConfig::default().half_life))
    );
    assert_same_mix(&WorkloadMix::new(mix.entries.clone(), Vec::new()), &mirror.mix, "/inspect");
    // the JSON names every field of an entry
    let raw: Value = serde_json::from_slice(&r.body).unwrap();
    let first = &raw["mix"]["entries"][0];
    for field in ["gpus", "milli", "cpu_milli", "memory_mib", "models", "weight"] {
        assert!(first.get(field).is_some(), "{field} in {first}");
    }
    assert!(report.table().contains("mix: learned from 40 pod(s): "), "{}", report.table());

    let r = conn.request("GET", "/mix", b"").unwrap();
    assert_eq!(r.status, 200);
    let state: MixLearnerState = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(state.observed, 40);
    assert_same_mix(&MixLearner::restore(&state, bundled_prior()).mix(), &mirror.learner.mix(), "GET /mix");

    let metrics = conn.request("GET", "/metrics", b"").unwrap().text();
    assert!(
        metrics.contains("# TYPE gpuplace_mix_observed_total counter\ngpuplace_mix_observed_total 40\n"),
        "{metrics}"
    );
    let entries = format!("# TYPE gpuplace_mix_entries gauge\ngpuplace_mix_entries {}\n", mirror.mix.entries.len());
    assert!(metrics.contains(&entries), "{metrics}");
    // the reserve: as many classes in the metrics as /inspect lists, by scarcity
    let reserve = raw["mix"]["reserve"].as_array().cloned().unwrap_or_default();
    assert!(!reserve.is_empty(), "the reserve in /inspect: {raw}");
    let scarce = reserve.iter().filter(|r| r["scarce"] == true).count();
    for (state, n) in [("scarce", scarce), ("plenty", reserve.len() - scarce)] {
        assert!(
            metrics.contains(&format!("gpuplace_reserve_classes{{state=\"{state}\"}} {n}\n")),
            "{state}: {metrics}"
        );
    }
    assert!(reserve.iter().all(|r| r["free_hosts"].is_u64() && r["keep"].is_u64()), "{reserve:?}");
}

/// kube-scheduler filters a pending pod again and again (and prioritizes and binds it): one
/// observation. A new pod under a reused name is another pod.
#[test]
fn a_pod_counts_once_however_often_it_is_filtered() {
    let ext = extender(Some(MixLearner::default()), ServiceOptions::default());
    let names = node_names(&ext.cluster());
    let p = workload_pod(0);
    for _ in 0..5 {
        ext.filter_json(&args(&p, &names)).unwrap();
        ext.prioritize_json(&args(&p, &names)).unwrap();
    }
    assert_eq!(ext.mix_report().observed, 1);
    let bind = json!({ "PodName": "w0", "PodNamespace": "ns", "PodUID": "uid-w0", "Node": "h100-0" });
    assert_eq!(block_on(ext.bind(bind.to_string().as_bytes())).unwrap().error, "");
    assert_eq!(ext.mix_report().observed, 1, "its bind counts nothing more");
    let mut again = workload_pod(0);
    again["metadata"]["uid"] = json!("uid-w0-again");
    ext.filter_json(&args(&again, &names)).unwrap();
    assert_eq!(ext.mix_report().observed, 2);
    // a pod without GPUs is not part of the mix
    let cpu = json!({ "metadata": { "name": "cpu", "namespace": "ns", "uid": "uid-cpu" }, "spec": { "containers": [ { "name": "c" } ] } });
    ext.filter_json(&args(&cpu, &names)).unwrap();
    assert_eq!(ext.mix_report().observed, 2);
}

/// `--mix FILE` (a fixed mix) learns nothing: the mix stays, /mix is 404, /inspect says fixed.
#[test]
fn a_fixed_mix_learns_nothing() {
    let ext = Arc::new(extender(None, ServiceOptions::default()));
    let names = node_names(&ext.cluster());
    for i in 0..10 {
        ext.filter_json(&args(&workload_pod(i), &names)).unwrap();
    }
    let report = ext.mix_report();
    assert_eq!((report.source, report.observed, report.entries.len()), (MixSource::Fixed, 0, 0));
    assert!(ext.mix_state().is_none());
    let running = spawn(ext.clone(), HttpOptions::default(), "127.0.0.1:0", 1).unwrap();
    let r = http_client::get(&format!("http://{}/mix", running.addr), TIMEOUT).unwrap();
    assert_eq!(r.status, 404);
    assert!(r.text().contains("the mix is fixed"), "{}", r.text());
    assert!(ext.render_metrics().contains("gpuplace_mix_observed_total 0\n"));
}

// ---------------------------------------------------------------------------------------------------
// The binary: --mix-state across a restart
// ---------------------------------------------------------------------------------------------------

/// Kills the child if the test fails before it exits.
struct Reap(Option<std::process::Child>);

impl Drop for Reap {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn serve(state: &Path, extra: &[&str]) -> (Reap, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let child = Command::new(env!("CARGO_BIN_EXE_gpuplace"))
        .args(["serve", "--cluster", "examples/clusters/fixture-cluster.yaml", "--listen", &listen, "--workers", "1"])
        .arg("--mix-state")
        .arg(state)
        .args(extra)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run gpuplace serve");
    let deadline = Instant::now() + Duration::from_secs(20);
    while Connection::open(&listen, TIMEOUT).is_err() {
        assert!(Instant::now() < deadline, "gpuplace serve did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    (Reap(Some(child)), listen)
}

/// SIGTERM, a clean exit; returns what it wrote on stderr.
fn stop(mut child: Reap) -> String {
    let c = child.0.take().unwrap();
    assert!(Command::new("kill").args(["-TERM", &c.id().to_string()]).status().unwrap().success());
    let out = c.wait_with_output().unwrap();
    assert!(out.status.success(), "a clean exit on SIGTERM");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn get_json(listen: &str, path: &str) -> Value {
    let r = http_client::get(&format!("http://{listen}{path}"), TIMEOUT).unwrap();
    assert_eq!(r.status, 200, "{path}: {}", r.text());
    serde_json::from_slice(&r.body).unwrap()
}

fn scratch_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gpuplace-learned-mix-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn mix_state_survives_a_restart_and_a_corrupt_file_is_only_a_warning() {
    let dir = scratch_dir();
    let state = dir.join("mix-state.json");
    std::fs::write(&state, b"{ not a learner state").unwrap();

    let (child, listen) = serve(&state, &[]);
    let fixture_nodes: Vec<String> = (0..4).map(|i| format!("gpu-node-{i}")).collect();
    let mut conn = Connection::open(&listen, TIMEOUT).unwrap();
    for i in 0..3 {
        let r = conn.request("POST", "/gpuplace/filter", &args(&workload_pod(i), &fixture_nodes)).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(get_json(&listen, "/mix")["observed"], 3);
    drop(conn);
    let stderr = stop(child);
    assert!(stderr.contains("mix state not usable") && stderr.contains("learning afresh"), "{stderr}");
    let saved: MixLearnerState = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    assert_eq!(saved.observed, 3, "saved at shutdown");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "no temporary file left");

    // restarted with the file (and another half-life): it goes on from 3
    let (child, listen) = serve(&state, &["--mix-half-life", "500"]);
    let mix = get_json(&listen, "/mix");
    assert_eq!((mix["observed"].as_u64(), mix["config"]["half_life"].as_f64()), (Some(3), Some(500.0)));
    let inspect = get_json(&listen, "/inspect");
    assert_eq!(inspect["mix"]["observed"], 3);
    assert_eq!(inspect["mix"]["source"], "learned");
    let table = Command::new(env!("CARGO_BIN_EXE_gpuplace"))
        .args(["inspect", "--url", &format!("http://{listen}")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("mix: learned from 3 pod(s): "), "{text}");
    let stderr = stop(child);
    assert!(!stderr.contains("not usable"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_fixed_mix_excludes_learning_flags() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuplace"))
        .args(["serve", "--cluster", "x.yaml", "--mix", "m.yaml", "--mix-state", "s.json"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--mix-state") && err.contains("--mix"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_gpuplace"))
        .args(["serve", "--cluster", "x.yaml", "--mix-half-life", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("1 or more"));
}
