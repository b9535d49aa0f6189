//! The extender over real HTTP, at its limits: HTTP errors that are clear and leave the state alone,
//! requests naming more nodes than a cluster has, bodies of millions of names, slow, idle and
//! chunked bodies, and a property test of arbitrary request bodies (seeded from the kube-scheduler
//! v1.36 fixtures).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::harness::fixture;
use gpuplace::extender::http::HttpOptions;
use gpuplace::extender::http_client::Connection;
use gpuplace::scheduler::binder::RecordingBinder;
use gpuplace::scheduler::inspect::InspectReport;
use gpuplace_core::cluster::Cluster;
use proptest::prelude::*;
use serde_json::{json, Value};

use crate::fuzz;
use crate::http_server::*;

#[test]
fn http_errors_are_clear_and_leave_state_alone() {
    let s = Server::with(
        Arc::new(RecordingBinder::new()),
        HttpOptions { prefix: "/gpuplace".into(), max_body_bytes: 8 * 1024, ..HttpOptions::default() },
        None,
    );
    s.fixture("cache/filter-002");
    bind_ok(&s.fixture("cache/bind-002"), "setup");
    let before = s.ext.cluster();

    // over the body limit: 413 (the full-Nodes fixture is ~10 KiB)
    let big = fixture("nocache/filter-002");
    assert!(big.len() > 8 * 1024);
    let r = s.post("filter", &big);
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(r.text().contains("--max-body-bytes"));
    // unknown verbs and paths: 404; a verb with GET: 405
    let r = s.post("filters", b"{}");
    assert_eq!(r.status, 404);
    assert!(r.text().contains("unknown extender verb \"filters\""), "{}", r.text());
    assert_eq!(s.call("POST", "/other/filter", b"{}").status, 404);
    assert_eq!(s.call("GET", "/gpuplace/filter", b"").status, 405);
    // malformed, truncated, wrong types, missing pod, no candidates: 400 with the decoder's message
    for (verb, body, needle) in [
        ("filter", &b"not json"[..], "not valid JSON"),
        ("filter", &b""[..], "ends early"),
        ("filter", &fixture("cache/filter-002")[..100], "ends early"),
        ("prioritize", br#"{"Pod":{},"NodeNames":"gpu-node-0"}"#, "at NodeNames"),
        ("filter", br#"{"NodeNames":["gpu-node-0"]}"#, "missing field `Pod`"),
        ("filter", br#"{"Pod":{}}"#, "neither Nodes nor NodeNames"),
        ("bind", br#"{"PodName":"p","PodNamespace":"ns","Node":"n"}"#, "PodUID"),
        ("bind", br#"[]"#, "expected a JSON object (ExtenderBindingArgs)"),
        ("preempt", br#"{"Pod":{},"NodeNameToMetaVictims":{"n":{"Pods":[{"UID":5}]}}}"#, "ExtenderPreemptionArgs"),
        (
            "prioritize",
            br#"{"Pod":{"spec":{"containers":[{"resources":{"limits":{"gpuplace.io/gpu":[]}}}]}},"NodeNames":[]}"#,
            "expected a quantity",
        ),
    ] {
        let r = s.post(verb, body);
        assert_eq!(r.status, 400, "{verb} {}: {}", String::from_utf8_lossy(body), r.text());
        assert!(r.text().contains(needle), "{verb}: {} should mention {needle}", r.text());
    }
    // empty candidate lists: valid, empty answers
    let pod = fixture_json("cache/filter-002")["Pod"].clone();
    let a = s.ok("filter", json!({"Pod": pod, "NodeNames": []}).to_string().as_bytes());
    assert_eq!(
        a,
        json!({"Nodes": null, "NodeNames": [], "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": ""})
    );
    let a = s.ok("filter", json!({"Pod": pod, "Nodes": {"metadata": {}, "items": null}}).to_string().as_bytes());
    assert_eq!(a["Nodes"], json!({"metadata": {}, "items": []}));
    assert_eq!(s.ok("prioritize", json!({"Pod": pod, "NodeNames": []}).to_string().as_bytes()), json!([]));
    // unknown node names: unresolvable with a reason, never an error
    let a = s.ok("filter", json!({"Pod": pod, "NodeNames": ["cpu-node-1", "gpu-node-0"]}).to_string().as_bytes());
    assert_eq!(a["NodeNames"], json!(["gpu-node-0"]));
    assert!(a["FailedAndUnresolvableNodes"]["cpu-node-1"].as_str().unwrap().contains("not in gpuplace's node cache"));
    let a = s.ok("prioritize", json!({"Pod": pod, "NodeNames": ["cpu-node-1"]}).to_string().as_bytes());
    assert_eq!(a, json!([{"Host": "cpu-node-1", "Score": 0}]));
    // a pod without gpuplace resources is not gpuplace's to refuse
    let plain = json!({"metadata": {"name": "web", "namespace": "default", "uid": "w"}, "spec": {"containers": [{"name": "c"}]}});
    let a = s.ok("filter", json!({"Pod": plain, "NodeNames": ["gpu-node-3", "anything"]}).to_string().as_bytes());
    assert_eq!(a["NodeNames"], json!(["gpu-node-3", "anything"]));
    assert_eq!(s.ext.cluster(), before, "no request above changed any allocation");

    // probes, metrics, inspect
    assert_eq!(s.call("GET", "/healthz", b"").status, 200);
    assert_eq!(s.call("GET", "/readyz", b"").status, 200);
    s.ext.set_ready(false);
    assert_eq!(s.call("GET", "/readyz", b"").status, 503);
    // not ready: no decision from an incomplete state
    let a = s.fixture("cache/filter-003");
    assert!(a["Error"].as_str().unwrap().contains("not ready"), "{a}");
    assert!(s.fixture("cache/bind-002")["Error"].as_str().unwrap().contains("not ready"));
    assert_eq!(s.post("prioritize", &fixture("cache/prioritize-003")).status, 503);
    assert_eq!(s.post("preempt", &fixture("cache/preempt-005")).status, 503);
    assert_eq!(s.ext.cluster(), before);
    s.ext.set_ready(true);
    let one = s.call("GET", "/inspect/gpu-node-3", b"");
    assert_eq!(one.status, 200);
    let r: InspectReport = serde_json::from_slice(&one.body).unwrap();
    assert_eq!(r.nodes.len(), 1);
    let held: Vec<&str> = r.nodes[0].gpus.iter().flat_map(|g| g.holders.iter().map(|h| h.pod.as_str())).collect();
    assert_eq!(held, ["default/c-whole4"; 4]);
    assert_eq!(s.call("GET", "/inspect/nope", b"").status, 404);
    let metrics = s.call("GET", "/metrics", b"").text();
    for line in [
        "gpuplace_requests_total{verb=\"filter\",code=\"4xx\"} 6",
        "gpuplace_requests_total{verb=\"bind\",code=\"2xx\"} 2",
        "gpuplace_binds_total{result=\"not_ready\"} 1",
        "gpuplace_binds_total{result=\"bound\"} 1",
        "gpuplace_filter_rejections_total{reason=\"unknown_node\"} 1",
        "gpuplace_gpus{state=\"exclusive\"} 4",
        "gpuplace_gpus{state=\"idle\"} 28",
        "gpuplace_gpu_memory_mib{state=\"allocated\"} 326236",
        "gpuplace_gpu_core_percent{state=\"free\"} 2800",
        "gpuplace_pods_bound 1",
        "gpuplace_ready 1",
        "gpuplace_fragmentation_ratio 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "missing {line:?} in\n{metrics}");
    }
    assert!(metrics.contains("gpuplace_request_duration_seconds_bucket{verb=\"filter\",le=\"+Inf\"}"));
}

#[test]
fn requests_naming_more_nodes_than_a_cluster_has_are_refused_while_decoded() {
    let s = Server::with(
        Arc::new(RecordingBinder::new()),
        HttpOptions { max_request_nodes: 100, ..HttpOptions::default() },
        None,
    );
    let pod = fixture_json("cache/filter-002")["Pod"].clone();
    let names = |n: usize, prefix: &str| (0..n).map(|i| format!("{prefix}{i}")).collect::<Vec<_>>();
    let mut at_limit = names(96, "x");
    at_limit.extend(ALL_NODES.iter().map(|n| n.to_string()));
    // exactly the limit: answered, the known nodes judged and the unknown ones refused
    let a = s.ok("filter", json!({"Pod": pod, "NodeNames": at_limit}).to_string().as_bytes());
    let unknown = a["FailedAndUnresolvableNodes"].as_object().unwrap().keys().filter(|k| k.starts_with('x')).count();
    assert_eq!(unknown, 96);
    let over = |verb: &str, body: Value| {
        let r = s.post(verb, body.to_string().as_bytes());
        assert_eq!(r.status, 413, "{verb}: {}", r.text());
        assert!(r.text().contains("more than 100 nodes (serve --max-request-nodes)"), "{verb}: {}", r.text());
    };
    // one over: the scanner's path, serde_json's path (a name with an escape), and full Nodes
    over("filter", json!({"Pod": pod, "NodeNames": names(101, "x")}));
    over("prioritize", json!({"Pod": pod, "NodeNames": names(101, "x")}));
    let mut escaped = names(101, "x");
    escaped[0] = "a\"b".into();
    over("filter", json!({"Pod": pod, "NodeNames": escaped}));
    let items: Vec<Value> = names(101, "n").iter().map(|n| json!({"metadata": {"name": n}})).collect();
    over("filter", json!({"Pod": pod, "Nodes": {"metadata": {}, "items": items}}));
    // preempt: victims keyed by node
    let victims: serde_json::Map<String, Value> =
        names(101, "n").into_iter().map(|n| (n, json!({"Pods": [], "NumPDBViolations": 0}))).collect();
    over("preempt", json!({"Pod": pod, "NodeNameToMetaVictims": victims}));

    // a body over LARGE_BODY_BYTES is decided off the HTTP workers, with the same answer
    let small = fixture("cache/filter-003");
    let expected = s.ok("filter", &small);
    let mut padded = small.clone();
    padded.extend(std::iter::repeat_n(b' ', gpuplace::extender::http::LARGE_BODY_BYTES + 1));
    assert_eq!(s.ok("filter", &padded), expected);
    let metrics = s.call("GET", "/metrics", b"").text();
    assert!(metrics.lines().any(|l| l == "gpuplace_requests_total{verb=\"filter\",code=\"4xx\"} 3"), "{metrics}");
}

/// A 55 MB filter body naming five million unknown nodes, as issue 12 sent: refused within a second
/// while probes keep answering, and the server's memory stays bounded.
#[test]
fn a_body_of_millions_of_unknown_nodes_is_refused_quickly_and_probes_answer_meanwhile() {
    // a full-Nodes deployment's body limit (the default, 4 MiB, is sized for names only)
    let opts = HttpOptions { max_body_bytes: 64 << 20, ..HttpOptions::default() };
    let s = Server::with(Arc::new(RecordingBinder::new()), opts, None);
    let pod = fixture_json("cache/filter-002")["Pod"].to_string();
    let mut body = format!("{{\"Pod\":{pod},\"Nodes\":null,\"NodeNames\":[").into_bytes();
    for i in 0..5_000_000u32 {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(format!("\"x{i:07}\"").as_bytes());
    }
    body.extend_from_slice(b"]}");
    assert!(body.len() > 50 << 20 && body.len() < 64 << 20);
    let addr = s.running.addr.to_string();
    let started = Instant::now();
    let sender = std::thread::spawn(move || {
        let mut conn = Connection::open(&addr, TIMEOUT).expect("connect");
        conn.request("POST", "/gpuplace/filter", &body).expect("answer")
    });
    // probes on their own connection while the body is sent and decided
    let mut probes = 0;
    while !sender.is_finished() {
        let t = Instant::now();
        let mut conn = Connection::open(&s.running.addr.to_string(), TIMEOUT).expect("connect");
        assert_eq!(conn.request("GET", "/healthz", b"").expect("healthz").status, 200);
        assert!(t.elapsed() < Duration::from_secs(1), "healthz took {:?}", t.elapsed());
        probes += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = sender.join().unwrap();
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(r.text().contains("more than 15000 nodes"), "{}", r.text());
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    assert!(probes > 0);
    // the server still decides ordinary requests
    s.fixture("cache/filter-002");
}

/// Sends request headers (and `body`) on a raw connection, leaving it open: a slow or idle client.
fn raw_request(addr: &str, headers: &str, body: &[u8]) -> std::net::TcpStream {
    use std::io::Write;
    let mut c = std::net::TcpStream::connect(addr).expect("connect");
    c.set_read_timeout(Some(TIMEOUT)).unwrap();
    c.write_all(
        format!("POST /gpuplace/filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}\r\n")
            .as_bytes(),
    )
    .unwrap();
    c.write_all(body).unwrap();
    c
}

/// The status line's code of what the server answered on `c` (0 when it closed without one).
fn status_of(c: &mut std::net::TcpStream) -> u16 {
    use std::io::Read;
    let mut buf = [0u8; 512];
    let n = c.read(&mut buf).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// Issue 29's H3: a connection that declares a 2 MB body and sends nothing holds neither the
/// large-body gate nor a worker: a real 2 MiB filter is answered meanwhile as fast as without it,
/// and the idle connection is answered 408 once the grace is over. Trickling clients are cut the
/// same way, and a chunked body is read under the same limits (the gate, the size cap).
#[test]
fn slow_idle_and_chunked_bodies_hold_nothing_and_are_cut() {
    let grace = Duration::from_millis(500);
    let opts = HttpOptions { body_grace: grace, ..HttpOptions::default() };
    let s = Server::with(Arc::new(RecordingBinder::new()), opts, None);
    let addr = s.running.addr.to_string();
    let small = fixture("cache/filter-003");
    let expected = s.ok("filter", &small);
    let mut padded = small.clone();
    padded.extend(std::iter::repeat_n(b' ', 2 << 20));
    let timed = |s: &Server| {
        let t = Instant::now();
        assert_eq!(s.ok("filter", &padded), expected);
        t.elapsed()
    };
    let alone = timed(&s);
    let mut idle = raw_request(&addr, "Content-Length: 2000000\r\n", b"");
    std::thread::sleep(Duration::from_millis(50));
    let beside = timed(&s);
    println!(
        "figure: a 2 MiB filter alone {alone:?}, beside a connection declaring 2 MB and sending nothing {beside:?}"
    );
    assert!(beside < alone + Duration::from_secs(1), "alone {alone:?}, beside an idle declared body {beside:?}");
    let t = Instant::now();
    assert_eq!(status_of(&mut idle), 408);
    assert!(t.elapsed() < grace + Duration::from_secs(2), "cut after {:?}", t.elapsed());

    // 500 clients trickling a byte every 100 ms (issue 29's count): every one cut soon after the
    // grace, and a real filter answered meanwhile
    let t = Instant::now();
    let trickling: Vec<_> = (0..500)
        .map(|_| {
            let addr = addr.clone();
            std::thread::Builder::new().stack_size(128 << 10).spawn(move || {
                use std::io::Write;
                let mut c = raw_request(&addr, "Content-Length: 100000\r\n", b"{");
                for _ in 0..100 {
                    std::thread::sleep(Duration::from_millis(100));
                    if c.write_all(b" ").is_err() {
                        break;
                    }
                }
                status_of(&mut c)
            })
        })
        .collect::<Result<_, _>>()
        .expect("a client thread");
    std::thread::sleep(Duration::from_millis(200));
    let meanwhile = timed(&s);
    let statuses: Vec<u16> = trickling.into_iter().map(|h| h.join().unwrap()).collect();
    println!("figure: 500 trickling clients cut after {:?}; a 2 MiB filter meanwhile {meanwhile:?}", t.elapsed());
    assert!(meanwhile < alone + Duration::from_secs(1), "alone {alone:?}, beside 500 trickling clients {meanwhile:?}");
    assert!(statuses.iter().all(|&c| c == 408), "{statuses:?}");
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());

    // chunked: a large body is decided as the same body sent with a length; over the cap is 413
    let chunked = |body: &[u8]| {
        let mut framed = Vec::new();
        for part in body.chunks(64 << 10) {
            framed.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
            framed.extend_from_slice(part);
            framed.extend_from_slice(b"\r\n");
        }
        framed.extend_from_slice(b"0\r\n\r\n");
        let mut c = raw_request(&addr, "Transfer-Encoding: chunked\r\nConnection: close\r\n", &framed);
        use std::io::Read;
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    };
    let answer = chunked(&padded);
    assert!(answer.starts_with("HTTP/1.1 200"), "{}", &answer[..answer.len().min(300)]);
    let mut over = small.clone();
    over.extend(std::iter::repeat_n(b' ', gpuplace::extender::http::DEFAULT_MAX_BODY_BYTES));
    let answer = chunked(&over);
    assert!(
        answer.starts_with("HTTP/1.1 413") && answer.contains("--max-body-bytes"),
        "{}",
        &answer[..answer.len().min(300)]
    );
    // and the server still answers
    assert_eq!(s.ok("filter", &small), expected);
}

// ---------------------------------------------------------------------------------------------------
// Arbitrary bodies over HTTP
// ---------------------------------------------------------------------------------------------------

const SEEDS: [&str; 6] = [
    "cache/filter-003",
    "nocache/filter-002",
    "cache/prioritize-002",
    "cache/bind-005",
    "cache/preempt-005",
    "nocache-preempt/preempt-001",
];

fn fuzz_server() -> &'static Server {
    static S: std::sync::OnceLock<Server> = std::sync::OnceLock::new();
    S.get_or_init(Server::start)
}

proptest! {
    // 1,000 cases each over a kept-alive connection: about 0.1 s per property in the test profile on
    // the 2-core machine (docs/performance.md).
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Real requests with bytes flipped, dropped or inserted, to every verb (and to the wrong verb):
    /// the answer is 200 or 400, never a 5xx or a dropped connection, and a 400 leaves the state alone.
    #[test]
    fn mutated_bodies_get_200_or_400(
        which in 0usize..SEEDS.len(),
        verb in prop::sample::select(vec!["filter", "prioritize", "bind", "preempt"]),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), 0u8..3, any::<u8>()), 0..6),
    ) {
        let s = fuzz_server();
        let mut body = fixture(SEEDS[which]);
        fuzz::mutate(&mut body, edits);
        let before = s.ext.cluster();
        let r = s.post(verb, &body);
        prop_assert!(r.status == 200 || r.status == 400, "{} {}: {}", verb, r.status, r.text());
        if r.status == 400 {
            prop_assert!(!r.body.is_empty());
            prop_assert!(s.ext.cluster() == before, "a refused body changed the state");
        } else if verb != "bind" {
            // a group member's filter may reserve its group's plan, never change a pod's allocation
            prop_assert!(pods_only(s.ext.cluster()) == pods_only(before), "{} changed the state", verb);
        }
    }
}

/// The cluster without group reservations (`namespace/group#slot`) and offer holds (`namespace/pod#offer`).
fn pods_only(mut c: Cluster) -> Cluster {
    let reserved: Vec<String> =
        c.nodes().iter().flat_map(|n| n.pods().map(|a| a.pod.clone())).filter(|k| k.contains('#')).collect();
    for k in reserved {
        c.release(&k).unwrap();
    }
    c
}

fn arb_quantity() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        Just(None),
        (0i64..12).prop_map(|n| Some(n.to_string())),
        (1u64..200_000).prop_map(|n| Some(n.to_string())),
        "[-0-9a-zA-Z.]{0,6}".prop_map(Some),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Well-formed filter and prioritize requests with arbitrary GPU resources and candidates (known,
    /// unknown, repeated; names or full Nodes): always 200, every candidate answered exactly once
    /// (passing, FailedNodes or FailedAndUnresolvableNodes), scores 0..=10, no pod's allocation changed.
    #[test]
    fn any_wellformed_request_is_answered_for_every_candidate(
        gpu in arb_quantity(), mem in arb_quantity(), core in arb_quantity(),
        picks in proptest::collection::vec(0usize..6, 0..8),
        full in any::<bool>(),
    ) {
        let s = fuzz_server();
        let pool = ["gpu-node-0", "gpu-node-1", "gpu-node-2", "gpu-node-3", "ghost-0", "ghost-1"];
        let mut limits = serde_json::Map::new();
        for (k, v) in [("gpuplace.io/gpu", gpu), ("gpuplace.io/gpu-mem", mem), ("gpuplace.io/gpu-core", core)] {
            if let Some(v) = v {
                limits.insert(k.into(), json!(v));
            }
        }
        let gpu_free = limits.is_empty();
        let pod = json!({"metadata": {"name": "p", "namespace": "fuzz", "uid": "fuzz-uid"},
            "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]}});
        let names: Vec<&str> = picks.iter().map(|&i| pool[i]).collect();
        let body = if full {
            let items: Vec<Value> = names.iter().map(|n| node_object(n, json!({}), "8")).collect();
            json!({"Pod": pod, "Nodes": {"metadata": {}, "items": items}, "NodeNames": null})
        } else {
            json!({"Pod": pod, "Nodes": null, "NodeNames": names})
        };
        let body = body.to_string();
        let before = s.ext.cluster();
        let r = s.post("filter", body.as_bytes());
        prop_assert_eq!(r.status, 200, "{}", r.text());
        let a: Value = serde_json::from_slice(&r.body).unwrap();
        let pass = passing(&a);
        let failed = names_of(&a["FailedNodes"]);
        let unres = names_of(&a["FailedAndUnresolvableNodes"]);
        prop_assert!(pass.is_disjoint(&failed) && pass.is_disjoint(&unres) && failed.is_disjoint(&unres), "{}", a);
        let all: BTreeSet<String> = pass.iter().chain(&failed).chain(&unres).cloned().collect();
        prop_assert_eq!(all, names.iter().map(|n| n.to_string()).collect::<BTreeSet<_>>());
        // a node gpuplace knows nothing about passes only a pod that asks for no gpuplace resource
        prop_assert!(!pass.contains("ghost-0") || gpu_free, "{}", a);
        let r = s.post("prioritize", body.as_bytes());
        prop_assert_eq!(r.status, 200);
        let p: Value = serde_json::from_slice(&r.body).unwrap();
        let p = p.as_array().unwrap();
        prop_assert_eq!(p.len(), names.len());
        for h in p {
            let score = h["Score"].as_i64().unwrap();
            prop_assert!((0..=10).contains(&score));
            if !pass.contains(h["Host"].as_str().unwrap()) {
                prop_assert_eq!(score, 0);
            }
        }
        // a filter naming one node holds its GPUs for the pod's bind (`offers`), never more
        prop_assert!(pods_only(s.ext.cluster()) == pods_only(before));
    }
}

fn names_of(v: &Value) -> BTreeSet<String> {
    v.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default()
}

/// Keeps the fuzz server honest: after arbitrary traffic, it still answers a real request right.
#[test]
fn fuzz_server_still_answers() {
    let s = fuzz_server();
    let r = s.post("filter", &fixture("cache/filter-004"));
    assert_eq!(r.status, 200);
}
