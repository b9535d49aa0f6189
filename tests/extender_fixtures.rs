//! Contract tests of the extender wire format against real kube-scheduler v1.36 requests
//! (`shared/fixtures/kube-scheduler-v1.36/`, see its README), and of decoding malformed bodies.
//!
//! Expected values (from the fixtures and their README): `*-frac` (gpu-mem 20480 + gpu-core 30, no gpu: refused),
//! `*-whole4` (gpu 4), `*-gang-0` (gpu 8, group of 2), `*-memonly` (refused), `filler-*` (gpu 2), `urgent` (gpu 8).

#[path = "support/fuzz.rs"]
mod fuzz;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use std::sync::Arc;

use gpuplace::extender::adapt::{NodeListMode, PodRefused};
use gpuplace::extender::answers;
use gpuplace::extender::wire::{
    decode, ExtenderArgs, ExtenderArgsRef, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult,
    ExtenderPreemptionArgs, ExtenderPreemptionResult, HostPriority, HostPriorityList, Node, WireError, WireNode,
};
use gpuplace::placement::feasibility::Cause;
use gpuplace::scheduler::verdict_cache::RejectClass;
use gpuplace::scheduler::verdict_cache::{Answer, Candidates, Reason};
use gpuplace_core::resources::{
    ContainerDemand, GpuDemand, GroupSpec, NumaPolicy, PodRequest, RequestError, RESOURCE_GPU, RESOURCE_GPU_MEM,
};
use proptest::prelude::*;
use serde_json::{json, Value};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/kube-scheduler-v1.36")
}

const MODES: [&str; 3] = ["cache", "nocache", "nocache-preempt"];
const ALL_NODES: [&str; 4] = ["gpu-node-0", "gpu-node-1", "gpu-node-2", "gpu-node-3"];

/// (folder, verb, sequence, path) of every fixture, sorted.
fn fixture_files() -> Vec<(String, String, u32, PathBuf)> {
    let mut out = Vec::new();
    for mode in MODES {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(fixtures().join(mode))
            .unwrap_or_else(|e| panic!("fixture folder {mode}: {e}"))
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            let file = p.file_name().unwrap().to_str().unwrap().to_string();
            let stem = file.strip_suffix(".request.json").unwrap_or_else(|| panic!("unexpected file {file}"));
            let (verb, seq) = stem.rsplit_once('-').unwrap();
            out.push((mode.to_string(), verb.to_string(), seq.parse().unwrap(), p));
        }
    }
    out
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn fixture(rel: &str) -> (Vec<u8>, PathBuf) {
    let p = fixtures().join(rel);
    (read(&p), p)
}

fn args(rel: &str) -> ExtenderArgs {
    decode(&fixture(rel).0).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The filter answer `serve` sends for one verdict per candidate (`verdict` gets each name in request
/// order), through the encoders it uses: the wire type, held equal to the JSON written directly.
fn filter_answer(a: &ExtenderArgs, verdict: impl Fn(&str) -> Answer) -> Result<ExtenderFilterResult, WireError> {
    let args = ExtenderArgsRef::from(a.clone());
    let names = args.candidate_names()?;
    let verdicts: Vec<Answer> = names.iter().map(|n| verdict(n)).collect();
    let c = Candidates::unresolved(names);
    let typed = answers::filter_result(&args, &c, &verdicts);
    let json: ExtenderFilterResult = decode(&answers::filter_json(&args, &c, &verdicts)).expect("the JSON decodes");
    assert_eq!(json, typed, "the JSON written directly says what the wire type says");
    Ok(typed)
}

/// A node turned down: `Preemptable` goes to `FailedNodes`, any other class to
/// `FailedAndUnresolvableNodes`.
fn no(class: RejectClass, text: &str) -> Answer {
    Answer::No(Arc::new(Reason::new(class, text.to_string())))
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object().expect("an object").keys().cloned().collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

// ---------------------------------------------------------------------------------------------------
// Every fixture parses into its type, and round-trips under Go's field names
// ---------------------------------------------------------------------------------------------------

#[test]
fn every_fixture_parses_into_its_wire_type() {
    let files = fixture_files();
    let mut per_kind: BTreeMap<(String, String), usize> = BTreeMap::new();
    for (mode, verb, _, path) in &files {
        let body = read(path);
        let original: Value = serde_json::from_slice(&body).unwrap();
        let what = path.display();
        match verb.as_str() {
            "filter" | "prioritize" => {
                let a: ExtenderArgs = decode(&body).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(keys(&original), set(&["Pod", "Nodes", "NodeNames"]), "{what}");
                if mode == "cache" {
                    assert_eq!(a.mode().unwrap(), NodeListMode::NamesOnly, "{what}");
                    assert!(a.nodes.is_none() && original["Nodes"].is_null(), "{what}");
                } else {
                    assert_eq!(a.mode().unwrap(), NodeListMode::FullNodes, "{what}");
                    assert!(a.node_names.is_none() && original["NodeNames"].is_null(), "{what}");
                    for n in &a.nodes.as_ref().unwrap().items {
                        check_fixture_node(n.view());
                    }
                }
                assert!(!a.candidate_names().unwrap().is_empty(), "{what}");
                assert_eq!(a.pod.metadata.namespace, "default", "{what}");
                assert_eq!(a.pod.status.phase, "Pending", "{what}");
            }
            "bind" => {
                let b: ExtenderBindingArgs = decode(&body).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(keys(&original), set(&["PodName", "PodNamespace", "PodUID", "Node"]), "{what}");
                assert_eq!(b.pod_namespace, "default");
                assert!(ALL_NODES.contains(&b.node.as_str()), "{what}");
                assert_eq!(b.pod_uid.len(), 36, "{what}: a UID");
            }
            "preempt" => {
                let p: ExtenderPreemptionArgs = decode(&body).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(keys(&original), set(&["Pod", "NodeNameToVictims", "NodeNameToMetaVictims"]), "{what}");
                if mode == "cache" {
                    assert!(p.node_name_to_victims.is_none() && p.node_name_to_meta_victims.is_some(), "{what}");
                } else {
                    assert!(p.node_name_to_victims.is_some() && p.node_name_to_meta_victims.is_none(), "{what}");
                }
            }
            other => panic!("{what}: unknown verb {other}"),
        }
        *per_kind.entry((mode.clone(), verb.clone())).or_default() += 1;
    }
    let expected: BTreeMap<(String, String), usize> = [
        ("cache", "bind", 8),
        ("cache", "filter", 8),
        ("cache", "preempt", 5),
        ("cache", "prioritize", 4),
        ("nocache", "bind", 4),
        ("nocache", "filter", 4),
        ("nocache", "prioritize", 4),
        ("nocache-preempt", "bind", 16),
        ("nocache-preempt", "filter", 16),
        ("nocache-preempt", "preempt", 1),
        ("nocache-preempt", "prioritize", 12),
    ]
    .into_iter()
    .map(|(m, v, n)| ((m.to_string(), v.to_string()), n))
    .collect();
    assert_eq!(per_kind, expected);
    assert_eq!(files.len(), 82);
}

/// The README's nodes: 8 H100s as extended resources, network labels.
fn check_fixture_node(n: &Node) {
    let name = n.metadata.name.as_str();
    let idx: u32 = name.strip_prefix("gpu-node-").unwrap().parse().unwrap();
    assert!(idx < 4);
    for list in [&n.status.capacity, &n.status.allocatable] {
        assert_eq!(list.get(RESOURCE_GPU).map(String::as_str), Some("8"), "{name}");
        assert_eq!(list.get("gpuplace.io/gpu-core").map(String::as_str), Some("800"), "{name}");
        assert_eq!(list.get(RESOURCE_GPU_MEM).map(String::as_str), Some("652472"), "{name}");
        assert_eq!(list.get("cpu").map(String::as_str), Some("96"));
        assert_eq!(list.get("memory").map(String::as_str), Some("1000Gi"));
    }
    let labels = &n.metadata.labels;
    assert_eq!(labels.get("network.gpuplace.io/spine").map(String::as_str), Some("s1"));
    let tor = if idx < 2 { "tor-0" } else { "tor-1" };
    assert_eq!(labels.get("network.gpuplace.io/tor").map(String::as_str), Some(tor), "{name}");
    assert_eq!(labels.get("nvidia.com/gpu.product").map(String::as_str), Some("NVIDIA-H100-80GB-HBM3"));
}

/// Every leaf we write is in the original with the same value: views drop fields, never invent or alter.
fn assert_subset(ours: &Value, original: &Value, path: &str) {
    match (ours, original) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                let o = b.get(k).unwrap_or_else(|| panic!("{path}.{k}: written but not in the original"));
                assert_subset(v, o, &format!("{path}.{k}"));
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            assert_eq!(a.len(), b.len(), "{path}");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert_subset(x, y, &format!("{path}[{i}]"));
            }
        }
        _ => assert_eq!(ours, original, "{path}"),
    }
}

#[test]
fn round_trip_keeps_go_field_names_and_node_bytes() {
    for (_, verb, _, path) in fixture_files() {
        let body = read(&path);
        let original: Value = serde_json::from_slice(&body).unwrap();
        let what = path.display();
        let text = String::from_utf8(body.clone()).unwrap();
        let written: Value = match verb.as_str() {
            "filter" | "prioritize" => {
                let a: ExtenderArgs = decode(&body).unwrap();
                let out = serde_json::to_string(&a).unwrap();
                let again: ExtenderArgs = decode(out.as_bytes()).unwrap();
                assert_eq!(again, a, "{what}");
                for n in a.nodes.iter().flat_map(|l| &l.items) {
                    // byte for byte: what kube-scheduler sent is what a filter answer returns
                    assert!(text.contains(n.raw_json()), "{what}: node {} altered", n.name());
                }
                let written: Value = serde_json::from_str(&out).unwrap();
                assert_eq!(written["Nodes"], original["Nodes"], "{what}: Nodes must round-trip losslessly");
                assert_eq!(written["NodeNames"], original["NodeNames"], "{what}");
                assert_subset(&written["Pod"], &original["Pod"], "Pod");
                written
            }
            "bind" => {
                let b: ExtenderBindingArgs = decode(&body).unwrap();
                let written = serde_json::to_value(&b).unwrap();
                assert_eq!(written, original, "{what}");
                written
            }
            "preempt" => {
                let p: ExtenderPreemptionArgs = decode(&body).unwrap();
                let out = serde_json::to_string(&p).unwrap();
                assert_eq!(decode::<ExtenderPreemptionArgs>(out.as_bytes()).unwrap(), p, "{what}");
                let written: Value = serde_json::from_str(&out).unwrap();
                assert_eq!(written["NodeNameToMetaVictims"], original["NodeNameToMetaVictims"], "{what}");
                assert_subset(&written["NodeNameToVictims"], &original["NodeNameToVictims"], "Victims");
                assert_subset(&written["Pod"], &original["Pod"], "Pod");
                written
            }
            _ => unreachable!(),
        };
        assert_eq!(keys(&written), keys(&original), "{what}: Go field names, every field present");
    }
}

// ---------------------------------------------------------------------------------------------------
// The pod of every filter/prioritize/preempt fixture converts to the expected request or refusal
// ---------------------------------------------------------------------------------------------------

#[derive(Debug)]
enum Expect {
    Whole(u32),
    WholeInGroup(u32, &'static str, u32),
    /// Refused: a slice resource without `gpuplace.io/gpu` (the contract names gpu-mem first).
    MissingGpu,
}

fn expected_for(pod: &str) -> Expect {
    match pod {
        "c-frac" | "nc-frac" | "c-memonly" | "nc-memonly" => Expect::MissingGpu,
        "c-whole4" | "nc-whole4" => Expect::Whole(4),
        "c-gang-0" => Expect::WholeInGroup(8, "default/c-job", 2),
        "nc-gang-0" => Expect::WholeInGroup(8, "default/nc-job", 2),
        "urgent" => Expect::Whole(8),
        p if p.starts_with("filler-") => Expect::Whole(2),
        other => panic!("no expectation for pod {other}"),
    }
}

fn whole(key: &str, gpus: u32, group: Option<GroupSpec>) -> PodRequest {
    PodRequest {
        key: key.into(),
        containers: vec![ContainerDemand { name: "main".into(), demand: GpuDemand::Whole { gpus } }],
        init_containers: vec![],
        cpu_milli: 0,
        memory_mib: 0,
        node_policy: None,
        gpu_policy: None,
        numa: NumaPolicy::Preferred,
        allowed_models: vec![],
        group,
        isolation: vec![],
    }
}

fn check_pod(pod: &gpuplace::extender::wire::Pod, what: &str) {
    let name = pod.metadata.name.as_str();
    let key = format!("default/{name}");
    let got = pod.request();
    match expected_for(name) {
        Expect::Whole(n) => assert_eq!(got, Ok(whole(&key, n, None)), "{what}"),
        Expect::WholeInGroup(n, group, size) => {
            let g = GroupSpec::labelled(group, size);
            assert_eq!(got, Ok(whole(&key, n, Some(g))), "{what}")
        }
        Expect::MissingGpu => {
            let err = got.expect_err(what);
            assert_eq!(
                err,
                PodRefused {
                    pod: key.clone(),
                    source: Box::new(RequestError::MissingGpuCount {
                        container: "main".into(),
                        resource: RESOURCE_GPU_MEM
                    }),
                },
                "{what}"
            );
            let msg = err.to_string();
            assert!(msg.starts_with(&format!("pod {key}: container \"main\"")), "{what}: {msg}");
            assert!(msg.contains("add `gpuplace.io/gpu: 1`"), "{what}: the fix is named: {msg}");
        }
    }
}

/// (fixture, pod, candidates in the order sent). Mode follows the folder.
const SCHEDULING: &[(&str, &str, &[&str])] = &[
    ("cache/filter-001", "c-frac", &["gpu-node-1", "gpu-node-2", "gpu-node-3", "gpu-node-0"]),
    ("cache/filter-002", "c-whole4", &["gpu-node-0", "gpu-node-1", "gpu-node-3"]),
    ("cache/filter-003", "c-gang-0", &["gpu-node-0", "gpu-node-1"]),
    ("cache/filter-004", "c-memonly", &ALL_NODES),
    ("cache/filter-005", "filler-0", &["gpu-node-0"]),
    ("cache/filter-006", "filler-1", &["gpu-node-0"]),
    ("cache/filter-007", "filler-2", &["gpu-node-0"]),
    ("cache/filter-008", "filler-3", &["gpu-node-0"]),
    ("cache/prioritize-001", "c-frac", &["gpu-node-1", "gpu-node-2", "gpu-node-3", "gpu-node-0"]),
    ("cache/prioritize-002", "c-whole4", &["gpu-node-0", "gpu-node-1", "gpu-node-3"]),
    ("cache/prioritize-003", "c-gang-0", &["gpu-node-0", "gpu-node-1"]),
    ("cache/prioritize-004", "c-memonly", &ALL_NODES),
    ("nocache/filter-001", "nc-frac", &["gpu-node-1", "gpu-node-2", "gpu-node-3", "gpu-node-0"]),
    ("nocache/filter-002", "nc-whole4", &ALL_NODES),
    ("nocache/filter-003", "nc-gang-0", &["gpu-node-0", "gpu-node-1", "gpu-node-2"]),
    ("nocache/filter-004", "nc-memonly", &ALL_NODES),
    ("nocache/prioritize-001", "nc-frac", &["gpu-node-1", "gpu-node-2", "gpu-node-3", "gpu-node-0"]),
    ("nocache/prioritize-002", "nc-whole4", &ALL_NODES),
    ("nocache/prioritize-003", "nc-gang-0", &["gpu-node-0", "gpu-node-1", "gpu-node-2"]),
    ("nocache/prioritize-004", "nc-memonly", &ALL_NODES),
];

/// nocache-preempt: filler-(N-1) in filter-N (1..=16) and prioritize-N (1..=12); each group of four
/// fillers fills a node (two GPUs each), so kube-scheduler offers one node fewer every four pods.
fn storm_candidates(seq: u32) -> Vec<&'static str> {
    ALL_NODES[..(4 - (seq as usize - 1) / 4)].to_vec()
}

#[test]
fn scheduling_fixtures_give_the_expected_requests() {
    let mut seen = 0;
    for (rel, pod, candidates) in SCHEDULING {
        let a = args(&format!("{rel}.request.json"));
        assert_eq!(a.pod.metadata.name, *pod, "{rel}");
        let mode = if rel.starts_with("cache/") { NodeListMode::NamesOnly } else { NodeListMode::FullNodes };
        assert_eq!(a.mode().unwrap(), mode, "{rel}");
        assert_eq!(a.candidate_names().unwrap(), *candidates, "{rel}");
        check_pod(&a.pod, rel);
        seen += 1;
    }
    for (verb, last) in [("filter", 16), ("prioritize", 12)] {
        for seq in 1..=last {
            let rel = format!("nocache-preempt/{verb}-{seq:03}");
            let a = args(&format!("{rel}.request.json"));
            assert_eq!(a.pod.metadata.name, format!("filler-{}", seq - 1), "{rel}");
            assert_eq!(a.pod.spec.priority, Some(10), "{rel}");
            assert_eq!(a.mode().unwrap(), NodeListMode::FullNodes, "{rel}");
            assert_eq!(a.candidate_names().unwrap(), storm_candidates(seq), "{rel}");
            check_pod(&a.pod, &rel);
            seen += 1;
        }
    }
    // every filter and prioritize fixture is in one of the two tables
    let all = fixture_files().into_iter().filter(|(_, v, _, _)| v == "filter" || v == "prioritize").count();
    assert_eq!(seen, all);
}

#[test]
fn bind_fixtures_pair_with_their_filter_requests() {
    for (mode, verb, seq, path) in fixture_files() {
        if verb != "bind" {
            continue;
        }
        let b: ExtenderBindingArgs = decode(&read(&path)).unwrap();
        let filter = args(&format!("{mode}/filter-{seq:03}.request.json"));
        let what = path.display();
        assert_eq!(b.pod_name, filter.pod.metadata.name, "{what}");
        assert_eq!(b.pod_uid, filter.pod.metadata.uid, "{what}");
        assert_eq!(b.pod_key(), filter.pod.key(), "{what}");
        assert!(filter.candidate_names().unwrap().contains(&b.node.as_str()), "{what}: bound to a candidate");
    }
    let b: ExtenderBindingArgs = decode(&fixture("cache/bind-003.request.json").0).unwrap();
    assert_eq!(
        b,
        ExtenderBindingArgs {
            pod_name: "c-gang-0".into(),
            pod_namespace: "default".into(),
            pod_uid: "0637ed23-1096-4ffd-922f-212474de4e2c".into(),
            node: "gpu-node-1".into(),
        }
    );
}

/// UID -> (pod, node) from every bind fixture: the cluster state the preemptions ran against.
fn bound_pods() -> BTreeMap<String, (String, String)> {
    fixture_files()
        .into_iter()
        .filter(|(_, v, _, _)| v == "bind")
        .map(|(_, _, _, p)| decode::<ExtenderBindingArgs>(&read(&p)).unwrap())
        .map(|b| (b.pod_uid, (b.pod_name, b.node)))
        .collect()
}

#[test]
fn preempt_fixtures_name_victims_bound_on_their_nodes() {
    let bound = bound_pods();
    let victim_names = |p: &ExtenderPreemptionArgs| -> BTreeMap<String, Vec<String>> {
        p.meta_victims()
            .into_iter()
            .map(|(node, v)| {
                assert_eq!(v.num_pdb_violations, 0);
                let mut names: Vec<String> = v
                    .pods
                    .iter()
                    .map(|m| {
                        let (pod, on) = bound.get(&m.uid).unwrap_or_else(|| panic!("victim {} never bound", m.uid));
                        assert_eq!(on, &node, "victim {pod} is on the node it is listed under");
                        pod.clone()
                    })
                    .collect();
                names.sort();
                (node, names)
            })
            .collect()
    };
    let owned = |pairs: &[(&str, &[&str])]| -> BTreeMap<String, Vec<String>> {
        pairs.iter().map(|(n, ps)| (n.to_string(), ps.iter().map(|p| p.to_string()).collect())).collect()
    };
    // cache/: fillers 4..7 (gpu 2) then urgent (gpu 8) preempting; the earlier runs' pods are the victims
    let three = [("gpu-node-1", &["c-gang-0"][..]), ("gpu-node-2", &["nc-gang-0"]), ("gpu-node-3", &["nc-whole4"])];
    for (seq, filler) in [(1, 4), (2, 5), (3, 6)] {
        let p: ExtenderPreemptionArgs = decode(&fixture(&format!("cache/preempt-{seq:03}.request.json")).0).unwrap();
        assert_eq!(p.pod.metadata.name, format!("filler-{filler}"));
        check_pod(&p.pod, "cache preempt");
        assert_eq!(victim_names(&p), owned(&three));
    }
    let p: ExtenderPreemptionArgs = decode(&fixture("cache/preempt-004.request.json").0).unwrap();
    assert_eq!(p.pod.metadata.name, "filler-7");
    assert_eq!(
        victim_names(&p),
        owned(&[("gpu-node-1", &["c-gang-0"]), ("gpu-node-2", &["nc-gang-0"]), ("gpu-node-3", &["c-whole4"])])
    );
    let p: ExtenderPreemptionArgs = decode(&fixture("cache/preempt-005.request.json").0).unwrap();
    assert_eq!(p.pod.metadata.name, "urgent");
    assert_eq!(p.pod.spec.priority, Some(1000));
    check_pod(&p.pod, "urgent");
    assert_eq!(
        victim_names(&p),
        owned(&[
            ("gpu-node-0", &["filler-0", "filler-1", "filler-2", "filler-3"]),
            ("gpu-node-1", &["c-gang-0"]),
            ("gpu-node-2", &["nc-gang-0"]),
            ("gpu-node-3", &["c-whole4", "nc-whole4"]),
        ])
    );

    // nocache-preempt/: urgent against 16 fillers, four per node, sent as full pods
    let p: ExtenderPreemptionArgs = decode(&fixture("nocache-preempt/preempt-001.request.json").0).unwrap();
    assert_eq!(p.pod.metadata.name, "urgent");
    check_pod(&p.pod, "urgent");
    let full = p.node_name_to_victims.as_ref().unwrap();
    for (node, v) in full {
        assert_eq!(v.pods.len(), 4, "{node}");
        for victim in &v.pods {
            assert_eq!(&victim.spec.node_name, node, "victims carry their node");
            assert_eq!(victim.spec.priority, Some(10));
            check_pod(victim, "victim");
        }
    }
    let fillers = |r: std::ops::Range<u32>| -> Vec<String> {
        let mut v: Vec<String> = r.map(|i| format!("filler-{i}")).collect();
        v.sort();
        v
    };
    let expected: BTreeMap<String, Vec<String>> = [
        ("gpu-node-0", fillers(12..16)),
        ("gpu-node-1", fillers(8..12)),
        ("gpu-node-2", fillers(4..8)),
        ("gpu-node-3", fillers(0..4)),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_string(), v))
    .collect();
    assert_eq!(victim_names(&p), expected);
}

// ---------------------------------------------------------------------------------------------------
// Answers in the shape kube-scheduler reads, for both modes
// ---------------------------------------------------------------------------------------------------

fn answer_json<T: serde::Serialize>(v: &T) -> Value {
    serde_json::from_str(&serde_json::to_string(v).unwrap()).unwrap()
}

#[test]
fn refused_pods_are_unresolvable_everywhere_with_the_fix() {
    for rel in ["cache/filter-001", "cache/filter-004", "nocache/filter-001", "nocache/filter-004"] {
        let a = args(&format!("{rel}.request.json"));
        let reason = a.pod.request().unwrap_err().to_string();
        let r = filter_answer(&a, |_| no(RejectClass::Contract, &reason)).unwrap();
        let v = answer_json(&r);
        assert_eq!(
            keys(&v),
            set(&["Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"]),
            "{rel}"
        );
        assert_eq!(v["Error"], "", "{rel}: a refused pod is a verdict, not an extender error");
        assert_eq!(v["FailedNodes"], json!({}), "{rel}: no preemption can help");
        let unresolvable = v["FailedAndUnresolvableNodes"].as_object().unwrap();
        assert_eq!(unresolvable.keys().cloned().collect::<BTreeSet<_>>(), set(&ALL_NODES), "{rel}");
        assert!(unresolvable.values().all(|m| m.as_str().unwrap().contains("add `gpuplace.io/gpu: 1`")));
        if rel.starts_with("cache/") {
            assert_eq!(v["NodeNames"], json!([]), "{rel}");
            assert_eq!(v["Nodes"], Value::Null, "{rel}");
        } else {
            assert_eq!(v["Nodes"], json!({"metadata": {}, "items": []}), "{rel}");
            assert_eq!(v["NodeNames"], Value::Null, "{rel}");
        }
        // Go's decoder would read it back: the same names, and our own decoder agrees
        let back: ExtenderFilterResult = decode(serde_json::to_string(&r).unwrap().as_bytes()).unwrap();
        assert_eq!(back, r);
    }
}

#[test]
fn filter_answers_mirror_the_request_mode() {
    let verdict = |n: &str| match n {
        "gpu-node-0" | "gpu-node-2" => Answer::Fits(5, 0.5),
        // the verdict carries the cause's text; the node's own figures stay out of it
        "gpu-node-1" => no(RejectClass::Preemptable, &Cause::Idle { gpus: 4 }.to_string()),
        _ => no(RejectClass::Unresolvable, &Cause::Model.to_string()),
    };
    // names only: the passing names, in request order
    let a = args("cache/filter-002.request.json");
    let r = filter_answer(&a, verdict).unwrap();
    assert_eq!(r.node_names, Some(vec!["gpu-node-0".to_string()]));
    assert_eq!(r.nodes, None);
    assert_eq!(r.failed_nodes, BTreeMap::from([("gpu-node-1".into(), "fewer than 4 idle GPUs".into())]));
    assert_eq!(
        r.failed_and_unresolvable_nodes,
        BTreeMap::from([("gpu-node-3".into(), "no GPU of a model allowed by gpuplace.io/gpu-model".into())])
    );

    // full nodes: the very objects received
    let (body, _) = fixture("nocache/filter-002.request.json");
    let a: ExtenderArgs = decode(&body).unwrap();
    let r = filter_answer(&a, verdict).unwrap();
    assert_eq!(r.node_names, None);
    let passed = &r.nodes.as_ref().unwrap().items;
    assert_eq!(passed.iter().map(WireNode::name).collect::<Vec<_>>(), ["gpu-node-0", "gpu-node-2"]);
    let original: Value = serde_json::from_slice(&body).unwrap();
    let sent = answer_json(&r);
    assert_eq!(sent["Nodes"]["items"][0], original["Nodes"]["items"][0]);
    assert_eq!(sent["Nodes"]["items"][1], original["Nodes"]["items"][2]);
    assert_eq!(sent["FailedNodes"], json!({"gpu-node-1": "fewer than 4 idle GPUs"}));
    assert_eq!(
        sent["FailedAndUnresolvableNodes"],
        json!({"gpu-node-3": "no GPU of a model allowed by gpuplace.io/gpu-model"})
    );
    assert_eq!(sent["Error"], "");
    assert_eq!(answer_json(&ExtenderFilterResult::error("cache not synced"))["Error"], "cache not synced");
}

#[test]
fn prioritize_bind_and_preempt_answers_use_go_names() {
    let a = args("nocache-preempt/prioritize-005.request.json");
    let names = a.candidate_names().unwrap();
    let list = answers::priorities(&names, &[10, 0, 7]);
    assert_eq!(
        answer_json(&list),
        json!([{"Host": "gpu-node-0", "Score": 10}, {"Host": "gpu-node-1", "Score": 0}, {"Host": "gpu-node-2", "Score": 7}])
    );
    assert_eq!(decode::<HostPriorityList>(serde_json::to_string(&list).unwrap().as_bytes()).unwrap(), list);
    assert_eq!(decode::<HostPriorityList>(&answers::priorities_json(&names, false, &[10, 0, 7])).unwrap(), list);
    assert_eq!(HostPriority::new("n", i64::MAX).score, 10);

    assert_eq!(answer_json(&ExtenderBindingResult::ok()), json!({"Error": ""}));
    assert_eq!(answer_json(&ExtenderBindingResult::error("GPU 3 taken")), json!({"Error": "GPU 3 taken"}));

    let p: ExtenderPreemptionArgs = decode(&fixture("nocache-preempt/preempt-001.request.json").0).unwrap();
    let mut victims = p.meta_victims();
    victims.retain(|n, _| n == "gpu-node-3");
    let v = answer_json(&ExtenderPreemptionResult { node_name_to_meta_victims: victims });
    assert_eq!(keys(&v), set(&["NodeNameToMetaVictims"]));
    let node3 = &v["NodeNameToMetaVictims"]["gpu-node-3"];
    assert_eq!(keys(node3), set(&["Pods", "NumPDBViolations"]));
    assert_eq!(node3["Pods"].as_array().unwrap().len(), 4);
    assert_eq!(keys(&node3["Pods"][0]), set(&["UID"]));
    // a Go nil map decodes as no victims
    let empty: ExtenderPreemptionResult = decode(br#"{"NodeNameToMetaVictims": null}"#).unwrap();
    assert!(empty.node_name_to_meta_victims.is_empty());
}

// ---------------------------------------------------------------------------------------------------
// Malformed input: a clear error value, never a panic
// ---------------------------------------------------------------------------------------------------

const POD: &str = r#"{"metadata":{"name":"p","namespace":"ns","uid":"u"},"spec":{"containers":[{"name":"main","resources":{"requests":{"gpuplace.io/gpu":"1"}}}]}}"#;

fn with_pod(rest: &str) -> String {
    format!(r#"{{"Pod":{POD}{rest}}}"#)
}

#[test]
fn truncated_bodies_are_reported_as_truncated() {
    assert!(matches!(decode::<ExtenderArgs>(b""), Err(WireError::Truncated { .. })));
    assert!(matches!(decode::<ExtenderBindingArgs>(b"   "), Err(WireError::Truncated { .. })));
    for rel in ["cache/filter-003", "nocache/filter-002", "cache/bind-001", "nocache-preempt/preempt-001"] {
        let (body, _) = fixture(&format!("{rel}.request.json"));
        // every 7th cut, plus the last few bytes
        let cuts = (0..body.len()).step_by(7).chain(body.len().saturating_sub(3)..body.len());
        for cut in cuts {
            let part = &body[..cut];
            let err = if rel.contains("bind") {
                decode::<ExtenderBindingArgs>(part).map(|_| ()).unwrap_err()
            } else if rel.contains("preempt") {
                decode::<ExtenderPreemptionArgs>(part).map(|_| ()).unwrap_err()
            } else {
                decode::<ExtenderArgs>(part).map(|_| ()).unwrap_err()
            };
            assert!(matches!(err, WireError::Truncated { .. }), "{rel} cut at {cut}: {err}");
            assert!(err.to_string().contains("ends early"), "{err}");
        }
    }
}

#[test]
fn malformed_bodies_give_clear_errors() {
    let shape = |body: &str, needle: &str| {
        let err = decode::<ExtenderArgs>(body.as_bytes()).expect_err(body);
        assert!(matches!(err, WireError::Shape { .. }), "{body}: {err}");
        let msg = err.to_string();
        assert!(msg.starts_with("ExtenderArgs"), "{msg}");
        assert!(msg.contains(needle), "{body}: {msg} should mention {needle}");
    };
    shape(r#"{"NodeNames":["gpu-node-0"]}"#, "missing field `Pod`");
    shape(r#"{"Pod":null,"NodeNames":["gpu-node-0"]}"#, "invalid type: null");
    shape(r#"{"Pod":"default/p","NodeNames":null}"#, "invalid type: string");
    shape(&with_pod(r#","NodeNames":"gpu-node-0""#), "expected a sequence");
    shape(&with_pod(r#","NodeNames":[1,2]"#), "expected a string");
    // Go refuses an array for a struct; serde would read it positionally unless told not to
    shape(&with_pod(r#","Nodes":[]"#), "expected a JSON object (NodeList)");
    shape(r#"{"Pod":[],"NodeNames":[]}"#, "expected a JSON object (Pod)");
    shape(r#"{"Pod":{"spec":{"containers":[["main"]]}},"NodeNames":[]}"#, "expected a JSON object (Container)");
    shape(&with_pod(r#","Nodes":{"items":[[]]}"#), "expected a JSON object (Node)");
    shape(
        &with_pod(r#","Nodes":{"items":[{"metadata":{"name":7}}]}"#),
        "at Nodes.items[0]: Node object at metadata.name",
    );
    shape(&with_pod(r#","Nodes":{"items":[null]}"#), "Node object");
    shape(r#"{"Pod":{"spec":{"containers":{}}},"NodeNames":[]}"#, "expected a sequence");
    shape(r#"{"Pod":{"spec":{"priority":1e10}},"NodeNames":[]}"#, "priority");
    shape(
        r#"{"Pod":{"spec":{"containers":[{"name":"m","resources":{"limits":{"gpuplace.io/gpu":true}}}]}}}"#,
        "resource \"gpuplace.io/gpu\": expected a quantity",
    );
    shape(r#"[]"#, "expected a JSON object (ExtenderArgs)");
    shape(r#"[{"metadata":{}}, null, ["n"]]"#, "expected a JSON object (ExtenderArgs)");

    let syntax = |body: &[u8]| {
        let err = decode::<ExtenderArgs>(body).expect_err("syntax");
        assert!(matches!(err, WireError::Syntax { .. }), "{err}");
        assert!(err.to_string().contains("not valid JSON"), "{err}");
    };
    syntax(b"not json");
    syntax(b"{\"Pod\": {}} trailing");
    syntax(b"\xff\xfe{}");
    syntax(br#"{"Pod": {"metadata": {"name": "a\u12"}}}"#);

    for body in [
        r#"{"PodName":"p","PodNamespace":"ns","Node":"n"}"#,
        r#"{"PodName":"p","PodNamespace":"ns","PodUID":null,"Node":"n"}"#,
    ] {
        let err = decode::<ExtenderBindingArgs>(body.as_bytes()).unwrap_err();
        assert!(matches!(err, WireError::Shape { .. }) && err.to_string().contains("PodUID"), "{err}");
    }
    let err =
        decode::<ExtenderPreemptionArgs>(with_pod(r#","NodeNameToMetaVictims":{"n":{"Pods":[{"UID":5}]}}"#).as_bytes())
            .unwrap_err();
    assert!(err.to_string().contains("ExtenderPreemptionArgs"), "{err}");
    let err = decode::<HostPriorityList>(br#"[{"Host":"n","Score":"5"}]"#).unwrap_err();
    assert!(matches!(err, WireError::Shape { .. }), "{err}");
}

#[test]
fn nulls_and_missing_fields_read_as_go_zero_values() {
    // both candidate fields null or absent: decodes (as Go would), but there is nothing to answer about
    for body in [with_pod(r#","Nodes":null,"NodeNames":null"#), with_pod("")] {
        let a: ExtenderArgs = decode(body.as_bytes()).unwrap();
        assert!(matches!(a.mode(), Err(WireError::NoCandidates)));
        assert!(matches!(filter_answer(&a, |_| Answer::Fits(1, 0.1)), Err(WireError::NoCandidates)));
        assert!(a.candidate_names().is_err());
        assert!(WireError::NoCandidates.to_string().contains("nodeCacheCapable"));
    }
    // empty candidate lists are answered with empty lists
    let a: ExtenderArgs = decode(with_pod(r#","NodeNames":[]"#).as_bytes()).unwrap();
    assert_eq!(filter_answer(&a, |_| Answer::Fits(1, 0.1)).unwrap().node_names, Some(vec![]));
    let a: ExtenderArgs = decode(with_pod(r#","Nodes":{"metadata":{},"items":null}"#).as_bytes()).unwrap();
    assert_eq!(a.mode().unwrap(), NodeListMode::FullNodes);
    assert_eq!(filter_answer(&a, |_| Answer::Fits(1, 0.1)).unwrap().nodes.unwrap().items.len(), 0);
    assert!(a.candidate_names().unwrap().is_empty());
    // Nodes wins over NodeNames when a client sends both
    let a: ExtenderArgs =
        decode(with_pod(r#","Nodes":{"items":[{"metadata":{"name":"x"}}]},"NodeNames":["y"]"#).as_bytes()).unwrap();
    assert_eq!(a.candidate_names().unwrap(), ["x"]);

    // nulls everywhere inside the pod
    let body = r#"{"Pod":{"metadata":{"name":"p","namespace":"ns","labels":null,"annotations":null,"ownerReferences":null},
        "spec":{"containers":[{"name":"c","resources":{"requests":null,"limits":{"gpuplace.io/gpu":"2"}}}],"initContainers":null,"nodeName":null,"priority":null},
        "status":null},"NodeNames":["n"]}"#;
    let a: ExtenderArgs = decode(body.as_bytes()).unwrap();
    let r = a.pod.request().unwrap();
    assert_eq!(r.containers[0].demand, GpuDemand::Whole { gpus: 2 }, "limits alone stand for the request");
    let result: ExtenderFilterResult =
        decode(br#"{"Nodes":null,"NodeNames":null,"FailedNodes":null,"FailedAndUnresolvableNodes":null,"Error":null}"#)
            .unwrap();
    assert_eq!(result, ExtenderFilterResult::default());
    let v: ExtenderPreemptionArgs =
        decode(with_pod(r#","NodeNameToVictims":{"n":{"Pods":null,"NumPDBViolations":null}}"#).as_bytes()).unwrap();
    assert_eq!(v.meta_victims()["n"].pods.len(), 0);
}

/// A pod with one container whose resources are the given JSON.
fn pod_with_resources(resources: &str) -> ExtenderArgs {
    let body = format!(
        r#"{{"Pod":{{"metadata":{{"name":"p","namespace":"ns"}},"spec":{{"containers":[{{"name":"main","resources":{resources}}}]}}}},"NodeNames":["n"]}}"#
    );
    decode(body.as_bytes()).unwrap_or_else(|e| panic!("{resources}: {e}"))
}

#[test]
fn bad_quantities_are_refused_by_the_contract() {
    use RequestError as E;
    let refused = |resources: &str| -> RequestError {
        let err = pod_with_resources(resources).pod.request().expect_err(resources);
        assert_eq!(err.pod, "ns/p");
        assert!(err.to_string().starts_with("pod ns/p: container \"main\""), "{err}");
        *err.source
    };
    let gpu = |v: &str| format!(r#"{{"requests":{{"gpuplace.io/gpu":{v}}},"limits":{{"gpuplace.io/gpu":{v}}}}}"#);
    assert!(matches!(refused(&gpu(r#""-1""#)), E::NotPositive { value: -1, .. }));
    assert!(matches!(refused(&gpu("-2")), E::NotPositive { value: -2, .. }));
    assert!(matches!(refused(&gpu(r#""0""#)), E::NotPositive { value: 0, .. }));
    assert!(matches!(refused(&gpu("null")), E::NotPositive { value: 0, .. }), "Go's null quantity is zero");
    assert!(matches!(refused(&gpu(r#""1.5""#)), E::NotInteger { .. }));
    assert!(matches!(refused(&gpu("1.5")), E::NotInteger { .. }));
    assert!(matches!(refused(&gpu(r#""500m""#)), E::NotInteger { .. }));
    assert!(matches!(refused(&gpu(r#""two""#)), E::BadQuantity { .. }));
    assert!(matches!(refused(&gpu(r#""""#)), E::BadQuantity { .. }));
    assert!(matches!(refused(&gpu(r#""99999999999999999999999999999999999""#)), E::BadQuantity { .. }));
    assert!(matches!(refused(&gpu("18446744073709551615")), E::BadQuantity { .. }));
    assert!(matches!(refused(&gpu("1e300")), E::BadQuantity { .. }));
    assert!(matches!(refused(&gpu(r#""1e3""#)), E::TooManyGpus { gpus: 1000, .. }));
    assert!(matches!(refused(&gpu(r#""65""#)), E::TooManyGpus { gpus: 65, .. }));
    assert!(matches!(
        refused(r#"{"requests":{"gpuplace.io/gpu":"1"},"limits":{"gpuplace.io/gpu":"2"}}"#),
        E::RequestLimitMismatch { .. }
    ));
    assert!(matches!(
        refused(r#"{"limits":{"gpuplace.io/gpu":"1","gpuplace.io/gpus":"1"}}"#),
        E::UnknownResource { .. }
    ));
    assert!(matches!(
        refused(r#"{"limits":{"gpuplace.io/gpu":"1","gpuplace.io/gpu-mem":"1Ei"}}"#),
        E::AbsurdMemory { .. }
    ));
    assert!(matches!(
        refused(r#"{"limits":{"gpuplace.io/gpu-core":"30"}}"#),
        E::MissingGpuCount { resource: "gpuplace.io/gpu-core", .. }
    ));
    // quantities as JSON numbers are read like Go's resource.Quantity reads them
    let ok =
        pod_with_resources(r#"{"limits":{"gpuplace.io/gpu":2,"gpuplace.io/gpu-mem":8192,"gpuplace.io/gpu-core":60}}"#);
    assert_eq!(
        ok.pod.request().unwrap().containers[0].demand,
        GpuDemand::Shared { gpus: 2, memory: gpuplace_core::resources::MemoryDemand::Mib(4096), core_pct: 30 }
    );
    // non-gpuplace resources are not ours to judge
    let cpu = pod_with_resources(r#"{"requests":{"cpu":"lots","memory":null}}"#);
    assert!(cpu.pod.request().unwrap().is_gpu_free());
}

#[test]
fn huge_numbers_and_deep_nesting_are_errors_not_crashes() {
    for body in [
        format!(r#"{{"Pod":{POD},"NodeNameToMetaVictims":{{"n":{{"Pods":[],"NumPDBViolations":1e400}}}}}}"#),
        r#"{"Pod":{"spec":{"priority":-99999999999999999999999999999999999999999}},"NodeNames":[]}"#.to_string(),
        format!(r#"{{"Pod":{POD},"NodeNameToMetaVictims":{{"n":{{"Pods":[],"NumPDBViolations":1e30}}}}}}"#),
        format!(
            r#"{{"Pod":{POD},"NodeNameToMetaVictims":{{"n":{{"Pods":[],"NumPDBViolations":9223372036854775808}}}}}}"#
        ),
    ] {
        let a = decode::<ExtenderArgs>(body.as_bytes()).map(|_| ());
        let p = decode::<ExtenderPreemptionArgs>(body.as_bytes()).map(|_| ());
        assert!(a.is_err() || p.is_err(), "{body}");
    }
    // like Go, unknown fields are skipped for their syntax only, whatever number they hold
    assert!(decode::<ExtenderArgs>(with_pod(r#","NodeNames":[],"Extra":1e400"#).as_bytes()).is_ok());
    let ok: ExtenderPreemptionArgs = decode(
        format!(
            r#"{{"Pod":{POD},"NodeNameToMetaVictims":{{"n":{{"Pods":[],"NumPDBViolations":9223372036854775807}}}}}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(ok.meta_victims()["n"].num_pdb_violations, i64::MAX);
    let deep = |inner: &str| "[".repeat(100_000) + inner;
    for body in [
        format!(r#"{{"Pod":{{"spec":{{"volumes":{}"#, deep("")),
        format!(r#"{{"Pod":{POD},"Nodes":{{"items":[{{"metadata":{}}}]}}}}"#, deep("]")),
        format!(r#"{{"Pod":{POD},"NodeNames":[],"Unknown":{}}}"#, deep("1")),
    ] {
        assert!(decode::<ExtenderArgs>(body.as_bytes()).is_err());
    }
}

fn arb_quantity() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map(Value::Number).unwrap_or(Value::Null)),
        "[-+]?[0-9]{0,40}(\\.[0-9]{0,5})?([KMGTPE]i?|[numkMGTPE]|[eE][-+]?[0-9]{1,4})?".prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
        Just(Value::Null),
        Just(Value::Bool(true)),
        Just(json!([])),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Arbitrary bytes never panic the decoders.
    #[test]
    fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode::<ExtenderArgs>(&body);
        let _ = decode::<ExtenderBindingArgs>(&body);
        let _ = decode::<ExtenderPreemptionArgs>(&body);
        let _ = decode::<ExtenderFilterResult>(&body);
        let _ = decode::<HostPriorityList>(&body);
    }

    /// Real requests with bytes flipped, dropped or inserted: decoding, adaptation and answering
    /// either work or fail with an error value.
    #[test]
    fn mutated_fixtures_never_panic(
        which in 0usize..4,
        edits in proptest::collection::vec((any::<prop::sample::Index>(), 0u8..3, any::<u8>()), 1..8),
    ) {
        let rel = ["cache/filter-003", "nocache/filter-002", "cache/preempt-005", "nocache-preempt/preempt-001"][which];
        let (mut body, _) = fixture(&format!("{rel}.request.json"));
        fuzz::mutate(&mut body, edits);
        if let Ok(a) = decode::<ExtenderArgs>(&body) {
            let refused = a.pod.request().err().map(|e| e.to_string());
            let _ = filter_answer(&a, |n| if n.len() % 2 == 0 { Answer::Fits(3, 0.3) } else { no(RejectClass::Preemptable, "x") });
            if let Some(reason) = refused {
                prop_assert!(!reason.is_empty());
                let _ = filter_answer(&a, |_| no(RejectClass::Contract, &reason));
            }
            if let Ok(names) = a.candidate_names() {
                let scores: Vec<u8> = names.iter().map(|n| (n.len() % 11) as u8).collect();
                let _ = answers::priorities_json(&names, false, &scores);
            }
            let _ = serde_json::to_string(&a);
        }
        if let Ok(p) = decode::<ExtenderPreemptionArgs>(&body) {
            let _ = p.pod.request();
            let _ = p.meta_victims();
        }
    }

    /// Any JSON value as a gpuplace quantity: either a clear refusal or a valid demand.
    #[test]
    fn arbitrary_quantities_are_refused_or_valid(gpu in arb_quantity(), mem in arb_quantity(), core in arb_quantity()) {
        let resources = json!({"limits": {RESOURCE_GPU: gpu, RESOURCE_GPU_MEM: mem, "gpuplace.io/gpu-core": core}});
        let body = json!({"Pod": {"metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [{"name": "main", "resources": resources}]}}, "NodeNames": ["n"]});
        match decode::<ExtenderArgs>(body.to_string().as_bytes()) {
            Err(e) => prop_assert!(matches!(e, WireError::Shape { .. }), "{}", e),
            Ok(a) => match a.pod.request() {
                Ok(r) => {
                    let d = r.containers[0].demand;
                    prop_assert!((1..=64).contains(&d.gpus()));
                    prop_assert!(d.core_on() <= 100);
                }
                Err(e) => prop_assert!(e.to_string().starts_with("pod ns/p: container \"main\": ")),
            },
        }
    }
}
