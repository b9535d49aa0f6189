//! HTTP load generator for the extender: kube-scheduler's filter then prioritize for one pod at a
//! time per connection (closed loop, as kube-scheduler calls an extender), over keep-alive HTTP/1.1,
//! against `gpuplace serve --cluster examples/clusters/bench-5k.yaml`. Reports filter+prioritize pairs
//! per second and p50/p90/p99/max latency of the pair and of each verb (docs/performance.md).
//!
//! Requests are built from the real kube-scheduler v1.36 captures in
//! `../shared/fixtures/kube-scheduler-v1.36/`: their Pod objects (renamed per pair, so every pair is a
//! new pod) and, in full-Nodes mode, their Node object renamed to each of the cluster's nodes.
//! Prioritize carries the nodes filter passed, as kube-scheduler sends them.
//!
//! With `--bind-every N`, every N-th pair is followed by a bind of the pod to prioritize's best node
//! (the "churn" regime: one node changes between pairs, as when kube-scheduler places replicas one
//! after another); without it no pair changes the cluster ("steady"). Bind time is not part of the
//! pair's latency, but it is part of the wall time pairs per second are counted over.
//!
//! Before measuring, `--fill` binds a deterministic warm-up set of pods (whole GPUs and shares, one
//! node at a time) until about that fraction of GPU capacity is allocated; the pod UIDs are fixed, so
//! running again against the same server repeats those binds instead of adding to them.
//!
//! ```sh
//! cargo build --release --example http_load
//! target/release/gpuplace serve --cluster examples/clusters/bench-5k.yaml --listen 127.0.0.1:8888 &
//! target/release/examples/http_load --mode names --concurrency 1 --duration 10
//! ```
//!
//! `--mode nodes` sends whole Node objects, about 25 MiB a request at 5,000 nodes: start the server
//! with `--max-body-bytes 67108864` for it (the default, 4 MiB, is sized for names).
//!
//! The client is gpuplace's own blocking HTTP/1.1 client (`extender::http_client`) on one thread per
//! connection: no new dependency, and a thread per connection is what a closed loop needs.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use gpuplace::extender::http_client::{split_url, Connection};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;
use serde_json::{json, Value};

mod answers;

use answers::*;
const TIMEOUT: Duration = Duration::from_secs(120);
/// GPU memory of the bench cluster's H100s (examples/clusters/bench-5k.yaml).
const GPU_MEM_MIB: u64 = 81559;
const GPUS_PER_NODE: u64 = 8;
const NAME_MARK: &str = "__LOAD_POD_NAME__";
const UID_MARK: &str = "__LOAD_POD_UID__";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// `nodeCacheCapable: true`: candidates as `NodeNames`.
    Names,
    /// `nodeCacheCapable: false`: candidates as full Node objects in `Nodes`.
    Nodes,
}

#[derive(Parser, Debug)]
#[command(name = "http_load", about = "filter+prioritize load against a gpuplace extender")]
struct Args {
    /// The extender's URL prefix (kube-scheduler's urlPrefix).
    #[arg(long, default_value = "http://127.0.0.1:8888/gpuplace")]
    url: String,
    /// How candidates are sent.
    #[arg(long, value_enum, default_value_t = Mode::Names)]
    mode: Mode,
    /// Seconds measured (after the warm-up).
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Connections, each a closed loop of filter then prioritize.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Seconds of load before measuring (answers checked, latencies discarded).
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Stop each connection after this many measured pairs (0: run for --duration); with
    /// --warmup 0, a fixed amount of work, as instruction counts under callgrind want.
    #[arg(long, default_value_t = 0)]
    pairs: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Nodes in the cluster, named `{node_prefix}{i}` (as in bench-5k.yaml).
    #[arg(long, default_value_t = 5000)]
    nodes: usize,
    #[arg(long, default_value = "gpu-node-")]
    node_prefix: String,
    /// Fraction of GPU capacity to allocate with warm-up binds before measuring (0: none).
    #[arg(long, default_value_t = 0.5)]
    fill: f64,
    /// Pod templates measured, round-robin: frac (cache/filter-001's pod, 20 GiB and 30 % of one GPU),
    /// whole4 (cache/filter-002, 4 GPUs), whole2 (cache/filter-005, 2 GPUs).
    #[arg(long, value_delimiter = ',', default_value = "frac,whole2,whole4")]
    pods: Vec<String>,
    /// kube-scheduler v1.36 captures.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/fixtures/kube-scheduler-v1.36"))]
    fixtures: PathBuf,
    /// Seed of the warm-up allocation.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Churn: after every N-th pair, bind the pod to prioritize's top node (0: never), as
    /// kube-scheduler does after choosing, so one node changes between pairs. Binds accumulate (the
    /// static mode has no release), so runs with binds should start from a fresh server.
    #[arg(long, default_value_t = 0)]
    bind_every: u64,
}

#[derive(Debug, thiserror::Error)]
enum LoadError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{path}: {source}")]
    Fixture { path: PathBuf, source: std::io::Error },
    #[error("decoding: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{verb}: HTTP {status}: {body}")]
    Status { verb: &'static str, status: u16, body: String },
    #[error("{0}")]
    Answer(String),
}

type Result<T, E = LoadError> = std::result::Result<T, E>;

// ---------------------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------------------

fn fixture(dir: &std::path::Path, rel: &str) -> Result<Value> {
    let path = dir.join(format!("{rel}.request.json"));
    let bytes = std::fs::read(&path).map_err(|source| LoadError::Fixture { path, source })?;
    Ok(serde_json::from_slice(&bytes)?)
}

/// A Pod object as JSON text with markers for the name and UID.
#[derive(Clone)]
struct PodTemplate {
    text: String,
}

impl PodTemplate {
    fn from_pod(mut pod: Value, namespace: &str) -> Result<Self> {
        let meta = pod
            .get_mut("metadata")
            .and_then(Value::as_object_mut)
            .ok_or_else(|| LoadError::Answer("fixture pod without metadata".into()))?;
        meta.insert("name".into(), json!(NAME_MARK));
        meta.insert("uid".into(), json!(UID_MARK));
        meta.insert("namespace".into(), json!(namespace));
        Ok(Self { text: serde_json::to_string(&pod)? })
    }

    fn render(&self, name: &str, uid: &str) -> String {
        self.text.replace(NAME_MARK, name).replace(UID_MARK, uid)
    }
}

/// A share of one GPU, as the resource contract wants it (docs/resources.md).
fn share(mem_mib: u64, core_pct: u64) -> Value {
    json!({ "gpuplace.io/gpu": "1", "gpuplace.io/gpu-mem": mem_mib.to_string(), "gpuplace.io/gpu-core": core_pct.to_string() })
}

/// The fixture pod with its first container's GPU resources replaced.
fn with_gpu_resources(mut pod: Value, resources: Value) -> Value {
    if let Some(c) = pod.pointer_mut("/spec/containers/0/resources") {
        *c = json!({ "limits": resources.clone(), "requests": resources });
    }
    pod
}

fn measured_templates(args: &Args) -> Result<Vec<(String, PodTemplate)>> {
    let mut out = Vec::new();
    for name in &args.pods {
        let rel = match name.as_str() {
            "frac" => "cache/filter-001",
            "whole4" => "cache/filter-002",
            "whole2" => "cache/filter-005",
            other => return Err(LoadError::Answer(format!("unknown pod template {other:?} (frac, whole2, whole4)"))),
        };
        let mut pod = fixture(&args.fixtures, rel)?["Pod"].clone();
        if name == "frac" {
            // the capture's share pod lacks `gpuplace.io/gpu: 1` and is refused by the contract
            // (docs/resources.md); the load measures placement, so it asks for one GPU's share
            pod = with_gpu_resources(pod, share(20480, 30));
        }
        out.push((name.clone(), PodTemplate::from_pod(pod, "load")?));
    }
    if out.is_empty() {
        return Err(LoadError::Answer("--pods names no template".into()));
    }
    Ok(out)
}

/// The fixture's Node object renamed to each node of the bench cluster, as compact JSON.
fn node_objects(args: &Args) -> Result<Vec<String>> {
    let template = fixture(&args.fixtures, "nocache/filter-001")?
        .pointer("/Nodes/items/0")
        .cloned()
        .ok_or_else(|| LoadError::Answer("nocache/filter-001 has no Node object".into()))?;
    (0..args.nodes)
        .map(|i| {
            let mut n = template.clone();
            let name = format!("{}{i}", args.node_prefix);
            n["metadata"]["name"] = json!(name);
            n["metadata"]["uid"] = json!(format!("00000000-0000-4000-8000-{i:012x}"));
            let labels = &mut n["metadata"]["labels"];
            labels["kubernetes.io/hostname"] = json!(name);
            labels["network.gpuplace.io/tor"] = json!(format!("tor-{}", i / 250));
            labels["network.gpuplace.io/spine"] = json!(if i / 250 < 10 { "s1" } else { "s2" });
            Ok(serde_json::to_string(&n)?)
        })
        .collect()
}

/// Candidates as the body's tail after the pod: `,"Nodes":...,"NodeNames":...}`.
fn candidates_json(mode: Mode, names: &[&str], objects: &[String], index: &HashMap<String, usize>) -> String {
    match mode {
        Mode::Names => {
            let mut s = String::with_capacity(names.len() * 16 + 40);
            s.push_str(r#","Nodes":null,"NodeNames":["#);
            for (i, n) in names.iter().enumerate() {
                if i > 0 {
                    s.push(',');
                }
                s.push('"');
                s.push_str(n);
                s.push('"');
            }
            s.push_str("]}");
            s
        }
        Mode::Nodes => {
            let mut s = String::with_capacity(names.len() * 2200 + 60);
            s.push_str(r#","Nodes":{"metadata":{},"items":["#);
            let mut first = true;
            for n in names {
                if let Some(&i) = index.get(*n) {
                    if !first {
                        s.push(',');
                    }
                    first = false;
                    s.push_str(&objects[i]);
                }
            }
            s.push_str(r#"]},"NodeNames":null}"#);
            s
        }
    }
}

fn body(pod: &str, tail: &str, buf: &mut Vec<u8>) {
    buf.clear();
    buf.extend_from_slice(br#"{"Pod":"#);
    buf.extend_from_slice(pod.as_bytes());
    buf.extend_from_slice(tail.as_bytes());
}

fn post(conn: &mut Connection, path: &str, verb: &'static str, body: &[u8]) -> Result<Vec<u8>> {
    let resp = conn.request("POST", path, body)?;
    if resp.status != 200 {
        let mut text = resp.text();
        text.truncate(300);
        return Err(LoadError::Status { verb, status: resp.status, body: text });
    }
    Ok(resp.body)
}

// ---------------------------------------------------------------------------------------------------
// Warm-up allocation
// ---------------------------------------------------------------------------------------------------

/// Pods for one node: (resources, GPU-equivalents). Whole GPUs 0..=5 as one pod, then 0..=5 shares of
/// 10-90 % each, scaled so the expected allocation is `fill` of the node.
fn fill_pods(rng: &mut ChaCha8Rng, fill: f64) -> Vec<(Value, f64)> {
    let mut out = Vec::new();
    // unscaled expectation: 2.5 whole + 2.5 shares x 0.5 = 3.75 of 8 GPUs
    let scale = (fill * GPUS_PER_NODE as f64 / 3.75).clamp(0.0, 2.0);
    let whole = (rng.random_range(0..=5) as f64 * scale).round() as u64;
    if whole > 0 {
        out.push((json!({ "gpuplace.io/gpu": whole.min(GPUS_PER_NODE).to_string() }), whole as f64));
    }
    let shares = (rng.random_range(0..=5) as f64 * scale).round() as u64;
    for _ in 0..shares {
        let pct: u64 = rng.random_range(1..=9) * 10;
        let mem = GPU_MEM_MIB * pct / 100;
        out.push((share(mem, pct), pct as f64 / 100.0));
    }
    out
}

/// Binds the warm-up set, nodes split over `threads` connections. Returns (pods bound, GPU
/// equivalents bound).
fn fill(args: &Args, host: &str, prefix: &str, threads: usize) -> Result<(usize, f64)> {
    let template = fixture(&args.fixtures, "cache/filter-001")?["Pod"].clone();
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut plan: Vec<Vec<(usize, String, f64)>> = vec![Vec::new(); threads];
    let mut seq = 0usize;
    for node in 0..args.nodes {
        for (res, gpus) in fill_pods(&mut rng, args.fill) {
            let t = PodTemplate::from_pod(with_gpu_resources(template.clone(), res), "fill")?;
            let uid = format!("f1110000-0000-4000-8000-{seq:012x}");
            let pod = t.render(&format!("fill-{seq}"), &uid);
            plan[node % threads].push((node, pod, gpus));
            seq += 1;
        }
    }
    let results: Vec<Result<(usize, f64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = plan
            .into_iter()
            .map(|pods| {
                s.spawn(move || -> Result<(usize, f64)> {
                    let mut conn = Connection::open(host, TIMEOUT)?;
                    let (mut bound, mut gpus) = (0, 0.0);
                    let mut buf = Vec::new();
                    for (node, pod, g) in pods {
                        let name = format!("{}{node}", args.node_prefix);
                        let tail = format!(r#","Nodes":null,"NodeNames":["{name}"]}}"#);
                        body(&pod, &tail, &mut buf);
                        let answer = post(&mut conn, &format!("{prefix}/filter"), "filter", &buf)?;
                        if passing(Mode::Names, &answer, std::slice::from_ref(&name))?.is_empty() {
                            continue;
                        }
                        let v: Value = serde_json::from_str(&pod)?;
                        let bind = json!({
                            "PodName": v["metadata"]["name"], "PodNamespace": v["metadata"]["namespace"],
                            "PodUID": v["metadata"]["uid"], "Node": name,
                        });
                        let answer = post(&mut conn, &format!("{prefix}/bind"), "bind", &serde_json::to_vec(&bind)?)?;
                        let r: Value = serde_json::from_slice(&answer)?;
                        match r["Error"].as_str() {
                            Some("") | None => {
                                bound += 1;
                                gpus += g;
                            }
                            Some(e) => return Err(LoadError::Answer(format!("bind: {e}"))),
                        }
                    }
                    Ok((bound, gpus))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(LoadError::Answer("fill thread panicked".into()))))
            .collect()
    });
    let (mut pods, mut gpus) = (0, 0.0);
    for r in results {
        let (p, g) = r?;
        pods += p;
        gpus += g;
    }
    Ok((pods, gpus))
}

// ---------------------------------------------------------------------------------------------------
// The measured loop
// ---------------------------------------------------------------------------------------------------

#[derive(Default)]
struct Samples {
    pair: Vec<u32>,
    filter: Vec<u32>,
    prioritize: Vec<u32>,
    bind: Vec<u32>,
    bind_refused: u64,
    feasible: u64,
    no_fit: u64,
    errors: u64,
    first_error: Option<String>,
}

fn micros(d: Duration) -> u32 {
    d.as_micros().min(u32::MAX as u128) as u32
}

struct Shared {
    mode: Mode,
    bind_every: u64,
    host: String,
    prefix: String,
    names: Vec<String>,
    objects: Vec<String>,
    index: HashMap<String, usize>,
    all_tail: String,
    templates: Vec<(String, PodTemplate)>,
}

fn worker(sh: &Shared, id: usize, measure_from: Instant, end: Instant, stop: &AtomicBool, limit: usize) -> Samples {
    let mut s = Samples::default();
    let mut conn = None;
    let mut buf = Vec::new();
    let (filter_path, prio_path) = (format!("{}/filter", sh.prefix), format!("{}/prioritize", sh.prefix));
    let bind_path = format!("{}/bind", sh.prefix);
    let mut seq = 0u64;
    while !stop.load(Ordering::Relaxed) && Instant::now() < end && (limit == 0 || s.pair.len() < limit) {
        let (_, template) = &sh.templates[(seq as usize + id) % sh.templates.len()];
        let (pod_name, uid) = (format!("load-{id}-{seq}"), format!("{id:08x}-0000-4000-8000-{seq:012x}"));
        let pod = template.render(&pod_name, &uid);
        let bind_now = sh.bind_every > 0 && seq.is_multiple_of(sh.bind_every);
        seq += 1;
        let started = Instant::now();
        let c = match &mut conn {
            Some(c) => c,
            None => match Connection::open(&sh.host, TIMEOUT) {
                Ok(c) => conn.insert(c),
                Err(e) => {
                    s.errors += 1;
                    s.first_error.get_or_insert_with(|| e.to_string());
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            },
        };
        let mut pair = Duration::ZERO;
        let mut refused = false;
        let result = (|| -> Result<(Duration, Option<Duration>, usize, Option<Duration>)> {
            body(&pod, &sh.all_tail, &mut buf);
            let answer = post(c, &filter_path, "filter", &buf)?;
            let filtered = started.elapsed();
            let pass = passing(sh.mode, &answer, &sh.names)?;
            if pass.is_empty() {
                // kube-scheduler does not prioritize a pod no node passed
                pair = started.elapsed();
                return Ok((filtered, None, 0, None));
            }
            let t = Instant::now();
            body(&pod, &candidates_json(sh.mode, &pass, &sh.objects, &sh.index), &mut buf);
            let answer = post(c, &prio_path, "prioritize", &buf)?;
            let prio = t.elapsed();
            let best = check_priorities(&answer, &pass)?;
            pair = started.elapsed();
            if !bind_now {
                return Ok((filtered, Some(prio), pass.len(), None));
            }
            // kube-scheduler binds to the node it chose (here prioritize's best): one node changes
            let t = Instant::now();
            let bind = json!({ "PodName": pod_name, "PodNamespace": "load", "PodUID": uid, "Node": pass[best] });
            let answer = post(c, &bind_path, "bind", &serde_json::to_vec(&bind)?)?;
            let r: Value = serde_json::from_slice(&answer)?;
            match r["Error"].as_str() {
                Some("") | None => Ok((filtered, Some(prio), pass.len(), Some(t.elapsed()))),
                // another connection's bind took the room first: kube-scheduler would schedule the
                // pod again; the extender answered correctly, so this is not an error
                Some(e) if e.contains("no longer fits") => {
                    refused = true;
                    Ok((filtered, Some(prio), pass.len(), None))
                }
                Some(e) => Err(LoadError::Answer(format!("bind: {e}"))),
            }
        })();
        match result {
            Ok((f, p, n, b)) if started >= measure_from && Instant::now() <= end => {
                s.pair.push(micros(pair));
                s.filter.push(micros(f));
                if let Some(b) = b {
                    s.bind.push(micros(b));
                }
                s.bind_refused += u64::from(refused);
                match p {
                    Some(p) => s.prioritize.push(micros(p)),
                    None => s.no_fit += 1,
                }
                s.feasible += n as u64;
            }
            Ok(_) => {}
            Err(e) => {
                s.errors += 1;
                s.first_error.get_or_insert_with(|| e.to_string());
                conn = None;
                if s.errors > 100 {
                    stop.store(true, Ordering::Relaxed);
                }
            }
        }
    }
    s
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    // nearest rank
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1] as f64 / 1000.0
}

fn stats(mut v: Vec<u32>) -> Value {
    v.sort_unstable();
    json!({
        "count": v.len(),
        "p50_ms": percentile(&v, 50.0),
        "p90_ms": percentile(&v, 90.0),
        "p99_ms": percentile(&v, 99.0),
        "max_ms": v.last().map_or(0.0, |&m| m as f64 / 1000.0),
    })
}

fn run(args: &Args) -> Result<Value> {
    let (host, prefix) = split_url(&args.url)?;
    let prefix = prefix.trim_end_matches('/').to_string();
    let threads = args.concurrency.max(1);
    let fill_started = Instant::now();
    let filled = if args.fill > 0.0 { Some(fill(args, &host, &prefix, threads.max(2))?) } else { None };
    if let Some((pods, gpus)) = filled {
        eprintln!(
            "warm-up binds: {pods} pods, {gpus:.0} GPU equivalents ({:.1} % of {} GPUs) in {:.1} s",
            100.0 * gpus / (args.nodes as f64 * GPUS_PER_NODE as f64),
            args.nodes as u64 * GPUS_PER_NODE,
            fill_started.elapsed().as_secs_f64()
        );
    }
    let names: Vec<String> = (0..args.nodes).map(|i| format!("{}{i}", args.node_prefix)).collect();
    let objects = if args.mode == Mode::Nodes { node_objects(args)? } else { Vec::new() };
    let index: HashMap<String, usize> = names.iter().enumerate().map(|(i, n)| (n.clone(), i)).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let all_tail = candidates_json(args.mode, &refs, &objects, &index);
    let shared = Shared {
        mode: args.mode,
        bind_every: args.bind_every,
        host,
        prefix,
        names: names.clone(),
        objects,
        index,
        all_tail,
        templates: measured_templates(args)?,
    };
    let start = Instant::now();
    let measure_from = start + Duration::from_secs_f64(args.warmup.max(0.0));
    let end = measure_from + Duration::from_secs_f64(args.duration.max(0.1));
    let stop = AtomicBool::new(false);
    let sh = Arc::new(shared);
    let parts: Vec<Samples> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|id| {
                let (sh, stop) = (&sh, &stop);
                s.spawn(move || worker(sh, id, measure_from, end, stop, args.pairs))
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let mut all = Samples::default();
    for p in parts {
        all.pair.extend(p.pair);
        all.filter.extend(p.filter);
        all.prioritize.extend(p.prioritize);
        all.bind.extend(p.bind);
        all.bind_refused += p.bind_refused;
        all.feasible += p.feasible;
        all.no_fit += p.no_fit;
        all.errors += p.errors;
        if all.first_error.is_none() {
            all.first_error = p.first_error;
        }
    }
    let seconds = if args.pairs > 0 {
        measure_from.elapsed().as_secs_f64()
    } else {
        Duration::from_secs_f64(args.duration.max(0.1)).as_secs_f64()
    };
    let pairs = all.pair.len();
    Ok(json!({
        "mode": match args.mode { Mode::Names => "names", Mode::Nodes => "nodes" },
        "nodes": args.nodes,
        "concurrency": threads,
        "pods": args.pods,
        "duration_s": seconds,
        "warmup_s": args.warmup,
        "fill": filled.map(|(p, g)| json!({ "pods": p, "gpu_equivalents": g })),
        "pairs": pairs,
        "pairs_per_s": pairs as f64 / seconds,
        "feasible_mean": if pairs > 0 { all.feasible as f64 / pairs as f64 } else { 0.0 },
        "no_fit": all.no_fit,
        "errors": all.errors,
        "first_error": all.first_error,
        "pair": stats(all.pair),
        "filter": stats(all.filter),
        "prioritize": stats(all.prioritize),
        "bind_every": args.bind_every,
        "binds": all.bind.len(),
        "bind_refused": all.bind_refused,
        "bind": stats(all.bind),
    }))
}

fn table(r: &Value) -> String {
    let mut out = format!(
        "mode {}, {} nodes, concurrency {}, {} s measured: {} pairs, {:.0} pairs/s, {} errors, {:.0} nodes passed filter on average\n",
        r["mode"].as_str().unwrap_or("?"),
        r["nodes"],
        r["concurrency"],
        r["duration_s"],
        r["pairs"],
        r["pairs_per_s"].as_f64().unwrap_or(0.0),
        r["errors"],
        r["feasible_mean"].as_f64().unwrap_or(0.0),
    );
    out.push_str(&format!("{:<12}{:>9}{:>9}{:>9}{:>9}  (ms)\n", "", "p50", "p90", "p99", "max"));
    let binds = if r["binds"].as_u64().unwrap_or(0) > 0 { &["bind"][..] } else { &[] };
    for k in ["pair", "filter", "prioritize"].iter().chain(binds) {
        let s = &r[*k];
        let f = |q: &str| s[q].as_f64().unwrap_or(0.0);
        out.push_str(&format!(
            "{k:<12}{:>9.3}{:>9.3}{:>9.3}{:>9.3}\n",
            f("p50_ms"),
            f("p90_ms"),
            f("p99_ms"),
            f("max_ms")
        ));
    }
    if let Some(e) = r["first_error"].as_str() {
        out.push_str(&format!("first error: {e}\n"));
    }
    out
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(r) => {
            if args.json {
                println!("{r}");
            } else {
                print!("{}", table(&r));
            }
            if r["errors"].as_u64().unwrap_or(0) > 0 {
                std::process::ExitCode::FAILURE
            } else {
                std::process::ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
