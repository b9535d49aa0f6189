//! `gpuplace report` and `gpuplace simulate --from-placement-log`, end to end with the real binary: a
//! placement log written by `gpuplace serve` for kube-scheduler's own requests (the v1.36 fixtures,
//! renamed and resized), and a `simulate --json` result of the bundled demo.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use gpuplace::extender::http_client;
use serde_json::{json, Value};

const ALL_NODES: [&str; 4] = ["gpu-node-0", "gpu-node-1", "gpu-node-2", "gpu-node-3"];
/// The fixture cluster's H100s.
const GPU_MEMORY_MIB: f64 = 81559.0;

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn cluster_file() -> PathBuf {
    manifest().join("examples/clusters/fixture-cluster.yaml")
}

fn fixture_json(rel: &str) -> Value {
    let p = manifest().join(format!("../shared/fixtures/kube-scheduler-v1.36/{rel}.request.json"));
    let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_slice(&bytes).unwrap()
}

fn gpuplace(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpuplace")).args(args).env_remove("RUST_LOG").output().expect("run gpuplace")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "exit {:?}; stderr: {}", out.status, text(&out.stderr));
    text(&out.stdout)
}

/// A scratch folder of this test's own, removed first.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gpuplace-report-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Kills the server if the test fails before it is done with it.
struct Reap(Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A pod the test sends: a fixture pod's filter request, renamed and with its own GPU request.
struct TestPod {
    name: String,
    resources: Value,
}

impl TestPod {
    fn whole(name: &str, gpus: u32) -> Self {
        Self { name: name.into(), resources: json!({ "gpuplace.io/gpu": gpus.to_string() }) }
    }

    fn frac(name: &str) -> Self {
        // the c-frac fixture's share, 30 % of the compute and 20480 MiB, of one GPU
        Self {
            name: name.into(),
            resources: json!({ "gpuplace.io/gpu": "1", "gpuplace.io/gpu-core": "30", "gpuplace.io/gpu-mem": "20480" }),
        }
    }

    fn filter_body(&self) -> Vec<u8> {
        let mut v = fixture_json("cache/filter-002");
        v["Pod"]["metadata"]["name"] = json!(self.name);
        v["Pod"]["metadata"]["uid"] = json!(format!("uid-{}", self.name));
        v["Pod"]["spec"]["containers"][0]["resources"] =
            json!({ "limits": self.resources, "requests": self.resources });
        v["NodeNames"] = json!(ALL_NODES);
        v.to_string().into_bytes()
    }

    fn bind_body(&self, node: &str) -> Vec<u8> {
        json!({ "PodName": self.name, "PodNamespace": "default", "PodUID": format!("uid-{}", self.name), "Node": node })
            .to_string()
            .into_bytes()
    }
}

/// What the test sent, to check the report against.
struct Traffic {
    log: PathBuf,
    bound: usize,
    allocated_gpus: f64,
}

/// Runs `gpuplace serve` on the fixture cluster with a placement log and sends it, as kube-scheduler
/// would (filter, then bind to the first node that passed): seven 4-GPU pods (28 of the 32 GPUs),
/// three 30 % shares, an 8-GPU pod that no node can take any more, and the fixtures' invalid
/// memory-only pod, which the contract refuses.
fn placement_log(dir: &Path) -> Traffic {
    serve_traffic(&dir.join("placement.jsonl"), &[], 1)
}

/// [`placement_log`] into `log`, with `flags` added to `serve` and each pod filtered `filters` times
/// (kube-scheduler's retries) before its bind; the server is stopped with SIGTERM, as kubelet does.
fn serve_traffic(log: &Path, flags: &[&str], filters: usize) -> Traffic {
    let listen = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let mut server = Reap(
        Command::new(env!("CARGO_BIN_EXE_gpuplace"))
            .args(["serve", "--cluster", cluster_file().to_str().unwrap(), "--listen", &listen, "--workers", "1"])
            .args(["--placement-log", log.to_str().unwrap()])
            .args(flags)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("run gpuplace serve"),
    );
    let until = Instant::now() + Duration::from_secs(30);
    while !http_client::request(&listen, "GET", "/healthz", b"", Duration::from_secs(2)).is_ok_and(|r| r.status == 200)
    {
        assert!(Instant::now() < until, "gpuplace serve never answered /healthz");
        std::thread::sleep(Duration::from_millis(50));
    }
    let post = |verb: &str, body: &[u8]| -> Value {
        let r =
            http_client::request(&listen, "POST", &format!("/gpuplace/{verb}"), body, Duration::from_secs(10)).unwrap();
        assert_eq!(r.status, 200, "{verb}: {}", r.text());
        serde_json::from_slice(&r.body).unwrap()
    };
    let mut pods: Vec<TestPod> = (0..7).map(|i| TestPod::whole(&format!("w4-{i}"), 4)).collect();
    pods.extend((0..3).map(|i| TestPod::frac(&format!("frac-{i}"))));
    pods.push(TestPod::whole("big-8", 8));
    let mut traffic = Traffic { log: log.to_path_buf(), bound: 0, allocated_gpus: 0.0 };
    for pod in &pods {
        for _ in 1..filters {
            post("filter", &pod.filter_body());
        }
        let answer = post("filter", &pod.filter_body());
        let passed: Vec<String> = answer["NodeNames"]
            .as_array()
            .map(|a| a.iter().filter_map(|n| n.as_str().map(str::to_string)).collect())
            .unwrap_or_default();
        if pod.name == "big-8" {
            assert!(passed.is_empty(), "no node has 8 idle GPUs left: {answer}");
            continue;
        }
        let node = passed.first().unwrap_or_else(|| panic!("{} fits somewhere: {answer}", pod.name));
        let bound = post("bind", &pod.bind_body(node));
        assert_eq!(bound["Error"].as_str().unwrap_or_default(), "", "{}: {bound}", pod.name);
        traffic.bound += 1;
        // a share counts as the larger of its compute and memory fractions
        traffic.allocated_gpus +=
            if pod.name.starts_with("frac") { f64::max(0.30, 20480.0 / GPU_MEMORY_MIB) } else { 4.0 };
        // binds a few milliseconds apart, so the time axis has some length
        std::thread::sleep(Duration::from_millis(15));
    }
    let answer = post("filter", &fixture_json("cache/filter-004").to_string().into_bytes());
    assert!(
        answer["Error"].as_str().is_some_and(|e| !e.is_empty())
            || answer["NodeNames"].as_array().is_none_or(|a| a.is_empty()),
        "{answer}"
    );
    let pid = server.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    assert!(server.0.wait().unwrap().success(), "a clean exit on SIGTERM");
    traffic
}

/// The bundled demo under three policies, two seeds.
fn simulate_json(dir: &Path) -> (PathBuf, Vec<Value>) {
    let out = gpuplace(&["simulate", "--policy", "fgd,bestfit,packing", "--seeds", "42-43", "--json"]);
    let stdout = ok(&out);
    let path = dir.join("sim.jsonl");
    std::fs::write(&path, &stdout).unwrap();
    (path, stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect())
}

/// The text of an SVG `<text>` element as plotters writes it.
fn svg_text(s: &str) -> String {
    format!(">\n{s}\n</text>")
}

/// The `<figure id=...>` of a chart.
fn figure<'a>(html: &'a str, id: &str) -> &'a str {
    let start = html.find(&format!("<figure id=\"{id}\">")).unwrap_or_else(|| panic!("no figure {id}"));
    let end = html[start..].find("</figure>").unwrap() + start;
    &html[start..end]
}

#[test]
fn report_of_a_real_placement_log_and_simulation() {
    let dir = scratch("both");
    let traffic = placement_log(&dir);
    let (sim, policies) = simulate_json(&dir);
    let html_path = dir.join("report.html");
    let out = gpuplace(&[
        "report",
        "--placement-log",
        traffic.log.to_str().unwrap(),
        "--simulate",
        sim.to_str().unwrap(),
        "-o",
        html_path.to_str().unwrap(),
    ]);
    let summary = ok(&out);
    let html = std::fs::read_to_string(&html_path).unwrap();

    // the log, read back independently
    let lines: Vec<Value> =
        std::fs::read_to_string(&traffic.log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let binds = lines.iter().filter(|l| l["verb"] == "bind" && l["outcome"] == "bound").count();
    assert_eq!(binds, traffic.bound);
    let filters = lines.iter().filter(|l| l["verb"] == "filter").count();
    assert!(html.contains(&format!("id=\"lines\">{}<", lines.len())), "line count");
    assert!(html.contains(&format!("id=\"bind-bound\">{binds}<")), "bind count");
    assert!(html.contains(&format!("id=\"pods-bound\">{binds}<")));
    assert!(html.contains(&format!("id=\"verb-filter\">{filters}<")));
    assert!(html.contains("id=\"gpus\">32.00<"), "the fixture cluster's GPUs");
    assert!(
        html.contains(&format!("id=\"allocated-last\">{:.2}<", traffic.allocated_gpus)),
        "allocated at the last bind"
    );
    // the 8-GPU pod and the memory-only pod, still pending
    assert!(html.contains("id=\"turned-away\">2<") && html.contains("id=\"still-pending\">2<"));
    assert!(summary.contains(&format!("bound {binds} ({binds} pods bound)")), "{summary}");
    assert!(summary.contains("pods turned away: 2 (2 still pending, 0 bound later)"), "{summary}");

    // every chart: an inline SVG with its title and axis labels
    assert_eq!(html.matches("<svg").count(), 9, "nine charts");
    assert!(
        !html.contains("<script") && !html.contains("src=\"http") && !html.contains("href=\"http"),
        "self-contained"
    );
    let capacity = figure(&html, "chart-capacity");
    for s in [
        "GPU capacity over time: allocated, fragmented and idle",
        "GPUs",
        "Time since the log&apos;s first line (seconds)",
        "allocated",
        "fragmented (free share of partly held GPUs)",
        "idle (no one holds the GPU)",
    ] {
        assert!(capacity.contains(&svg_text(s)), "capacity chart lacks {s:?}");
    }
    let frag = figure(&html, "chart-fragmentation");
    assert!(frag.contains(&svg_text("Fragmented, % of free GPU capacity")));
    // the room jobs had, as the last bind line recorded it
    let last_room = &lines.iter().rev().find(|l| l["verb"] == "bind" && l["cluster"]["room"].is_object()).unwrap()
        ["cluster"]["room"];
    let whole8 = last_room["whole_nodes"]["8"].as_u64().map_or("none".to_string(), |n| format!("{n} of 8 GPUs"));
    let tor = last_room["levels"].as_array().unwrap().last().unwrap();
    let row = format!(
        "whole nodes {whole8}; tor: {} of {} whole, largest job {} x 8 GPUs",
        tor["whole"], tor["switches"], tor["largest_job_pods"]
    );
    assert!(html.contains(&format!("id=\"room-last\">{row}")), "room row {row:?}");
    assert!(summary.contains(&format!("at the last bind, room: {row}")), "{summary}");
    let room = figure(&html, "chart-room");
    for s in [
        "Room for jobs over time: whole nodes and whole switches",
        "whole 8-GPU nodes (every GPU free)",
        "whole tors, of 2 (every node under it whole)",
    ] {
        assert!(room.contains(&svg_text(s)), "room chart lacks {s:?}");
    }
    let job = figure(&html, "chart-largest-job");
    for s in ["largest job under one tor (pods of 8 GPUs)", "idle GPUs stranded on broken 8-GPU nodes"] {
        assert!(job.contains(&svg_text(s)), "largest-job chart lacks {s:?}");
    }
    let models = figure(&html, "chart-models");
    assert!(
        models.contains(&svg_text("NVIDIA H100 80GB HBM3"))
            && models.contains(&svg_text("GPU usage by model, at the last bind"))
    );
    let reasons = figure(&html, "chart-reasons");
    for s in ["Pods turned away, by reason class", "contract", "still pending at the end of the log", "bound later"] {
        assert!(reasons.contains(&svg_text(s)), "reasons chart lacks {s:?}");
    }
    let shapes = figure(&html, "chart-shapes");
    assert!(shapes.contains(&svg_text("8 GPU")) && shapes.contains(&svg_text("invalid request")), "{shapes}");
    let heat = figure(&html, "chart-heatmap");
    assert!(heat.contains(&svg_text("Node")) && heat.contains(&svg_text("no bind yet")));
    let bound_nodes: std::collections::BTreeSet<&str> =
        lines.iter().filter(|l| l["verb"] == "bind").filter_map(|l| l["chosen"]["node"].as_str()).collect();
    for n in &bound_nodes {
        assert!(heat.contains(&svg_text(n)), "heat map row for {n}");
    }

    // the simulation: a curve and a legend entry per policy, and the JSON's numbers in the tables
    let curves = figure(&html, "chart-unallocated");
    for s in [
        "Unallocated GPU % against arrived workload, per policy",
        "Arrived workload (% of cluster GPU capacity)",
        "Unallocated GPU (% of capacity)",
    ] {
        assert!(curves.contains(&svg_text(s)), "curve chart lacks {s:?}");
    }
    for p in &policies {
        let name = p["policy"].as_str().unwrap();
        assert!(curves.contains(&svg_text(name)), "legend entry for {name}");
        for (col, v) in p["unallocated_gpu_pct"].as_object().unwrap() {
            let cell = format!("data-policy=\"{name}\" data-column=\"{col}\">{:.2}<", v.as_f64().unwrap());
            assert!(html.contains(&cell), "{cell}");
        }
        let frag = format!(
            "data-policy=\"{name}\" data-field=\"frag_rate_pct_at_80\">{:.2}<",
            p["frag_rate_pct_at_80"].as_f64().unwrap()
        );
        assert!(html.contains(&frag), "{frag}");
        // and the terminal summary's table
        let row = summary.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {summary}"));
        assert!(row.contains(&format!("{:.2}", p["unallocated_gpu_pct"]["100"].as_f64().unwrap())), "{row}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn report_of_a_simulation_alone_and_without_output_file() {
    let dir = scratch("sim");
    let (sim, policies) = simulate_json(&dir);
    let html_path = dir.join("r.html");
    let summary = ok(&gpuplace(&["report", "--simulate", sim.to_str().unwrap(), "-o", html_path.to_str().unwrap()]));
    let html = std::fs::read_to_string(&html_path).unwrap();
    assert_eq!(html.matches("<svg").count(), 1);
    assert!(!html.contains("Placement log"));
    // one row per policy in the unallocated table (the jobs table after it has its own)
    let first_table = summary.lines().skip_while(|l| !l.starts_with("Unallocated")).take_while(|l| !l.is_empty());
    assert_eq!(
        first_table.filter(|l| policies.iter().any(|p| l.starts_with(p["policy"].as_str().unwrap()))).count(),
        3
    );
    assert_eq!(summary.lines().filter(|l| l.starts_with("Jobs (groups")).count(), 1, "{summary}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Fails with a non-zero exit, no panic, and a message on stderr holding every needle.
fn assert_refused(args: &[&str], needles: &[&str]) {
    let out = gpuplace(args);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(out.status.code().is_some() && !err.contains("panicked"), "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: stderr lacks {n:?}: {err}");
    }
}

#[test]
fn bad_inputs_are_refused_naming_file_and_line() {
    let dir = scratch("bad");
    let (sim, _) = simulate_json(&dir);
    let good = r#"{"v":1,"ts_unix_ms":1,"verb":"filter","pod":"a/b","uid":"u","mode":"names","requests":null,"refused":null,"candidates":0,"feasible":0,"rejections":{},"rejection_classes":{},"rejection_details":{},"top":[],"chosen":null,"outcome":null,"error":null,"latency_us":5}"#;
    let write = |name: &str, body: &str| {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        p.to_str().unwrap().to_string()
    };
    let corrupt = write("corrupt.jsonl", &format!("{good}\n{good}\n{{\"v\":1,\"verb\"\n"));
    assert_refused(&["report", "--placement-log", &corrupt, "-o", "/dev/null"], &["corrupt.jsonl, line 3: not JSON"]);
    let empty = write("empty.jsonl", "");
    assert_refused(&["report", "--placement-log", &empty], &["empty.jsonl: no placement decisions in it"]);
    let unknown = write("unknown.jsonl", &format!("{good}\n{}\n", good.replace("\"pod\"", "\"extra\":1,\"pod\"")));
    assert_refused(&["report", "--placement-log", &unknown], &["unknown.jsonl, line 2: unknown field \"extra\""]);
    // the two inputs swapped
    assert_refused(&["report", "--placement-log", sim.to_str().unwrap()], &["sim.jsonl, line 1: unknown field"]);
    let log = write("log.jsonl", good);
    assert_refused(&["report", "--simulate", &log], &["log.jsonl, line 1: not a simulate --json result"]);
    let sim_text = std::fs::read_to_string(&sim).unwrap();
    let sim_bad = write(
        "sim-bad.jsonl",
        &format!("{sim_text}{}\n", sim_text.lines().next().unwrap().replace("\"policy\"", "\"polcy\"")),
    );
    assert_refused(&["report", "--simulate", &sim_bad], &["sim-bad.jsonl, line 4:", "polcy"]);
    assert_refused(&["report", "--simulate", &empty], &["empty.jsonl: no simulate results in it"]);
    assert_refused(&["report", "--placement-log", "/nonexistent/p.jsonl"], &["/nonexistent/p.jsonl"]);
    assert_refused(&["report"], &["--placement-log", "--simulate"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn simulate_replays_a_placement_log_on_the_same_and_a_larger_cluster() {
    let dir = scratch("replay");
    let traffic = placement_log(&dir);
    let log = traffic.log.to_str().unwrap();
    let replay = |cluster: &str, policies: &str| -> Vec<Value> {
        let out = gpuplace(&[
            "simulate",
            "--from-placement-log",
            log,
            "--cluster",
            cluster,
            "--policy",
            policies,
            "--seeds",
            "1-2",
            "--json",
        ]);
        ok(&out).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    // the same cluster: the 8-GPU pod that was turned away does not fit under any policy either
    let same = replay(cluster_file().to_str().unwrap(), "bestfit,fgd,random");
    assert_eq!(same.len(), 3);
    for r in &same {
        assert_eq!(r["pods_per_seed"], json!(11.0), "the ten bound pods and the pending one: {r}");
        assert_eq!(r["failed_pods"], json!(1.0), "{r}");
        assert_eq!(r["workload"], json!("placement-log:placement.jsonl"));
    }
    // twice the nodes: everything fits (under policies that keep whole nodes free for it; random
    // placement may not)
    let yaml = std::fs::read_to_string(cluster_file()).unwrap();
    assert!(yaml.contains("count: 4"));
    let bigger = dir.join("bigger.yaml");
    std::fs::write(&bigger, yaml.replace("count: 4", "count: 8")).unwrap();
    let more = replay(bigger.to_str().unwrap(), "bestfit,fgd");
    for r in &more {
        assert_eq!(r["failed_pods"], json!(0.0), "{r}");
    }
    // and the table form says the same
    let table = ok(&gpuplace(&[
        "simulate",
        "--from-placement-log",
        log,
        "--cluster",
        bigger.to_str().unwrap(),
        "--policy",
        "bestfit",
        "--seeds",
        "1",
    ]));
    assert!(table.contains("11 pods on 64 GPUs"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("bestfit") && l.split_whitespace().nth(2) == Some("0.0")), "{table}");
    // the replay's result is a simulate result the report reads
    let replayed = dir.join("replay.jsonl");
    std::fs::write(&replayed, same.iter().map(|v| v.to_string() + "\n").collect::<String>()).unwrap();
    let html_path = dir.join("replay.html");
    ok(&gpuplace(&["report", "--simulate", replayed.to_str().unwrap(), "-o", html_path.to_str().unwrap()]));
    assert!(std::fs::read_to_string(&html_path).unwrap().contains("<figure id=\"chart-unallocated\">"));
    // no cluster: refused, saying why
    assert_refused(&["simulate", "--from-placement-log", log], &["--cluster"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `serve --placement-log-every-call` writes every retry; without it a retry that repeats the pod's
/// verdict is counted on the pod's next line; `gpuplace compact-log` turns the first log into the
/// second, and the report and the replay of either agree, but for the lines written and the latency
/// percentiles (of the lines).
#[test]
fn an_every_call_log_compacts_to_the_default_and_reports_the_same() {
    let dir = scratch("compact");
    let every = serve_traffic(&dir.join("every.jsonl"), &["--placement-log-every-call"], 3).log;
    let default = serve_traffic(&dir.join("default.jsonl"), &[], 3).log;
    let read = |p: &Path| -> Vec<Value> {
        std::fs::read_to_string(p).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let filter_lines = |l: &[Value]| l.iter().filter(|d| d["verb"] == "filter").count();
    let repeated = |l: &[Value]| l.iter().filter_map(|d| d["repeats"]["count"].as_u64()).sum::<u64>() as usize;
    let (every_lines, default_lines) = (read(&every), read(&default));
    // 11 pods filtered 3 times, the refused one once
    assert_eq!(filter_lines(&every_lines), 34);
    assert!(every_lines.iter().all(|d| d.get("repeats").is_none()));
    // one line per pod, and the 8-GPU pod's last retry, written at SIGTERM with the one before it
    assert_eq!(filter_lines(&default_lines), 13);
    assert_eq!(filter_lines(&default_lines) + repeated(&default_lines), 34);
    let bound_with_repeats = default_lines.iter().filter(|d| d["verb"] == "bind" && d["repeats"]["count"] == 2);
    assert_eq!(bound_with_repeats.count(), 10);

    let compact = dir.join("compact.jsonl");
    let args = ["compact-log", "--placement-log", every.to_str().unwrap(), "--output", compact.to_str().unwrap()];
    let said = ok(&gpuplace(&args));
    assert!(said.contains(&format!("{} lines read, {} written", every_lines.len(), default_lines.len())), "{said}");
    let shape = |l: &[Value]| -> Vec<(Value, Value, Value)> {
        l.iter().map(|d| (d["verb"].clone(), d["pod"].clone(), d["repeats"]["count"].clone())).collect()
    };
    assert_eq!(shape(&read(&compact)), shape(&default_lines), "compact-log writes what serve writes");

    // the report: every row but the lines and the percentiles, and every chart, the same
    let page = |log: &Path| -> String {
        let html = dir.join(format!("{}.html", log.file_name().unwrap().to_string_lossy()));
        ok(&gpuplace(&["report", "--placement-log", log.to_str().unwrap(), "-o", html.to_str().unwrap()]));
        let text = std::fs::read_to_string(&html).unwrap().replace(log.to_str().unwrap(), "LOG");
        assert!(text.contains("id=\"verb-filter\">34<") && text.contains("id=\"latency-calls-filter\""), "{text}");
        let varies = |l: &&str| l.contains("id=\"lines\"") || l.contains("id=\"latency-filter\"");
        text.lines().filter(|l| !varies(l)).collect::<Vec<_>>().join("\n")
    };
    let (full, compacted) = (page(&every), page(&compact));
    assert!(full.contains("<svg"), "charts compared too");
    assert_eq!(full, compacted);

    // the replay: the same pods, placed the same
    let replay = |log: &Path| -> Vec<(Value, Value, Value)> {
        let out = ok(&gpuplace(&[
            "simulate",
            "--from-placement-log",
            log.to_str().unwrap(),
            "--cluster",
            cluster_file().to_str().unwrap(),
            "--policy",
            "bestfit,gpuplace",
            "--json",
        ]));
        out.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .map(|r| (r["pods_per_seed"].clone(), r["failed_pods"].clone(), r["unallocated_gpu_pct"].clone()))
            .collect()
    };
    assert_eq!(replay(&every), replay(&compact));

    assert_refused(&["serve", "--placement-log-every-call"], &["--placement-log"]);
    let _ = std::fs::remove_dir_all(&dir);
}
