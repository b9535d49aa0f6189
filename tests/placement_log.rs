//! The placement log through the extender's verbs (static mode): kube-scheduler's retries of a pod
//! are counted on the pod's next line, not written one by one, unless every call is asked for; a
//! deleted pod, or the end of the process, writes what is held; the report counts calls either way.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpuplace::extender::Extender;
use gpuplace::placement_log::compactor::CompactOptions;
use gpuplace::placement_log::writer::PlacementLog;
use gpuplace::placement_log::Decision;
use gpuplace::report::model::LogModel;
use gpuplace_core::cluster::Cluster;
use gpuplace_core::inventory::Board;
use harness::{passed, pod_in, whole, Harness};
use serde_json::Value;

#[path = "support/harness.rs"]
mod harness;

/// Two nodes of 8 H100s.
fn cluster() -> Cluster {
    let board = Board::Flat { gpus: 8, model: "H100".into(), memory_mib: 81920 }.resolve(Path::new(".")).unwrap();
    Cluster::new((0..2).map(|i| board.node(&format!("gpu-{i}"), BTreeMap::new(), 0, 0)).collect())
}

fn extender(log: PlacementLog) -> Extender {
    Harness::new(cluster()).placement_log(log).build()
}

fn pod(name: &str, gpus: u32) -> Value {
    pod_in("ml", name, whole(gpus))
}

/// The nodes filter passed.
fn filter(e: &Extender, pod: &Value) -> Vec<String> {
    passed(&harness::filter(e, pod))
}

fn bind(e: &Extender, pod: &Value, node: &str) {
    assert_eq!(harness::bind(e, pod, node), "", "bind");
}

struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let d = std::env::temp_dir().join(format!("gpuplace-plog-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Self(d)
    }

    fn log(&self, opts: CompactOptions) -> (PathBuf, PlacementLog) {
        let path = self.0.join("placement.jsonl");
        let log = PlacementLog::open(path.to_str().unwrap(), 1 << 20).unwrap().with_options(opts);
        (path, log)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn lines(path: &Path) -> Vec<Decision> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// (verb, pod name, filter calls counted in `repeats`) of each line.
fn shape(lines: &[Decision]) -> Vec<(String, String, u64)> {
    lines.iter().map(|d| (d.verb.clone(), d.pod.clone(), d.repeats.map_or(0, |r| r.count))).collect()
}

/// The traffic of both tests: a 4-GPU pod filtered three times then bound, a 16-GPU pod (fits
/// nowhere) filtered four times then deleted, a 12-GPU pod filtered twice and still waiting.
fn traffic(e: &Extender) {
    let fits = pod("fits", 4);
    for _ in 0..3 {
        assert_eq!(filter(e, &fits).len(), 2);
    }
    bind(e, &fits, "gpu-0");
    let never = pod("never", 16);
    for _ in 0..4 {
        assert!(filter(e, &never).is_empty());
    }
    assert!(!e.release_pod("uid-never"), "it held nothing");
    let waits = pod("waits", 12);
    for _ in 0..2 {
        assert!(filter(e, &waits).is_empty());
    }
}

/// A line as [`shape`] gives it: verb, pod of the `ml` namespace, repeats carried.
fn line(verb: &str, pod: &str, repeats: u64) -> (String, String, u64) {
    (verb.to_string(), format!("ml/{pod}"), repeats)
}

#[test]
fn retries_are_counted_on_the_pods_next_line() {
    let dir = Scratch::new("default");
    let (path, log) = dir.log(CompactOptions::default());
    let e = extender(log);
    traffic(&e);
    let written = lines(&path);
    // the bind carries fits' two repeats; never's deletion writes its last call with the two before
    assert_eq!(
        shape(&written),
        [
            line("filter", "fits", 0),
            line("bind", "fits", 2),
            line("filter", "never", 0),
            line("filter", "never", 2),
            line("filter", "waits", 0)
        ]
    );
    let r = written[3].repeats.unwrap();
    assert!(r.first_ts_unix_ms <= r.last_ts_unix_ms && r.last_ts_unix_ms <= written[3].ts_unix_ms, "{r:?}");
    assert!(r.latency_us_max > 0 && r.latency_us_sum >= r.latency_us_max, "{r:?}");
    assert_eq!(written[3].feasible, 0);
    // the process ends: waits' one held call goes out as itself
    drop(e);
    let at_exit = lines(&path);
    assert_eq!(shape(&at_exit[5..]), [line("filter", "waits", 0)]);
    // and the report counts every call
    let read = gpuplace::placement_log::read::read_placement_log(&path).unwrap();
    let m = LogModel::build(vec![(path.clone(), read)]);
    assert_eq!((m.lines, m.verbs["filter"], m.verbs["bind"], m.latency["filter"].count), (6, 9, 1, 9));
}

#[test]
fn every_call_mode_writes_a_line_per_call_and_compacts_to_the_default() {
    let dir = Scratch::new("every");
    let (path, log) = dir.log(CompactOptions { every_call: true, ..CompactOptions::default() });
    let e = extender(log);
    traffic(&e);
    drop(e);
    let every = lines(&path);
    let verbs: Vec<&str> = every.iter().map(|d| d.verb.as_str()).collect();
    assert_eq!(verbs.iter().filter(|v| **v == "filter").count(), 9);
    assert!(every.iter().all(|d| d.repeats.is_none()));
    // what the default would have written, but for the deletion (which a log does not record): the
    // deleted pod's calls go out at the end instead, with the same counts
    let mut c = gpuplace::placement_log::compactor::Compactor::new(CompactOptions::default());
    let mut compact: Vec<Decision> = every.into_iter().flat_map(|d| c.push(d)).collect();
    compact.extend(c.finish());
    assert_eq!(
        shape(&compact),
        [
            line("filter", "fits", 0),
            line("bind", "fits", 2),
            line("filter", "never", 0),
            line("filter", "waits", 0),
            line("filter", "never", 2),
            line("filter", "waits", 0)
        ]
    );
}
