//! GPU-set choice against NVIDIA go-gpuallocator's picks and the brute-force optimum
//! (`shared/topologies/oracle/`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use gpuplace::placement::engine::Engine;
use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
use gpuplace_core::cluster::Cluster;
use gpuplace_core::inventory::{load_topology_file, ResolvedBoard};
use gpuplace_core::resources::{GpuDemand, PodRequest};
use gpuplace_core::topology::GpuTopology;
use serde_json::Value;

fn shared() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/topologies")
}

struct Oracle {
    name: String,
    n: usize,
    pairs: Vec<Vec<u32>>,
    sequences: Vec<Value>,
    board: ResolvedBoard,
}

fn oracles() -> Vec<Oracle> {
    let dir = shared().join("oracle");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "expected the oracle files in {}", dir.display());
    files
        .into_iter()
        .map(|f| {
            let v: Value = serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
            let name = v["topology"].as_str().unwrap().to_string();
            let topo = load_topology_file(&shared().join(format!("{name}.json"))).unwrap();
            let pairs: Vec<Vec<u32>> = serde_json::from_value(v["pair_scores"].clone()).unwrap();
            Oracle {
                n: topo.gpus.len(),
                board: ResolvedBoard::from_file(&topo).unwrap(),
                name,
                pairs,
                sequences: v["sequences"].as_array().unwrap().clone(),
            }
        })
        .collect()
}

fn upstream_score(o: &Oracle, set: &[usize]) -> u32 {
    let mut s = 0;
    for (i, &a) in set.iter().enumerate() {
        for &b in &set[i + 1..] {
            s += o.pairs[a][b];
        }
    }
    s
}

/// A one-node cluster where every GPU outside `free` is held by a filler pod.
fn cluster_with_free(o: &Oracle, free: &[usize]) -> Cluster {
    let mut c = Cluster::new(vec![o.board.node("n", BTreeMap::new(), 0, 0)]);
    for g in (0..o.n).filter(|g| !free.contains(g)) {
        take(&mut c, &format!("filler/{g}"), &[g]);
    }
    c
}

fn take(c: &mut Cluster, pod: &str, gpus: &[usize]) {
    let mem = c.nodes()[0].gpus[0].memory_mib;
    c.allocate(PodAssignment {
        pod: pod.into(),
        node: "n".into(),
        containers: vec![ContainerAssignment {
            name: "c".into(),
            init: false,
            slices: gpus
                .iter()
                .map(|&g| GpuSlice { gpu: g as u32, mem_mib: mem, core_pct: 100, exclusive: true })
                .collect(),
        }],
        cpu_milli: 0,
        memory_mib: 0,
        group: None,
    })
    .unwrap();
}

fn pick(engine: &Engine, c: &Cluster, k: usize) -> Option<Vec<usize>> {
    let req = PodRequest::single("ns/p", GpuDemand::Whole { gpus: k as u32 });
    engine.place(c, &req, 0).ok().map(|p| p.gpus().into_iter().map(|g| g as usize).collect())
}

fn as_set(v: &Value) -> Vec<usize> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect()
}

#[test]
fn every_step_is_optimal_and_never_below_upstream() {
    let engine = Engine::default();
    let mut steps = 0;
    for o in oracles() {
        for seq in &o.sequences {
            for (i, step) in seq["steps"].as_array().unwrap().iter().enumerate() {
                let k = step["request"].as_u64().unwrap() as usize;
                let free = as_set(&step["free_before"]);
                let c = cluster_with_free(&o, &free);
                let got = pick(&engine, &c, k);
                let ctx = format!("{} {} step {i} (k={k}, free={free:?})", o.name, seq["name"]);
                if k > free.len() {
                    assert_eq!(got, None, "{ctx}: must refuse");
                    continue;
                }
                let got = got.unwrap_or_else(|| panic!("{ctx}: no pick"));
                assert_eq!(got.len(), k, "{ctx}");
                assert!(got.iter().all(|g| free.contains(g)), "{ctx}: picked a busy GPU {got:?}");
                let s = upstream_score(&o, &got);
                let up = step["upstream"]["score"].as_u64().unwrap() as u32;
                assert!(s >= up, "{ctx}: {got:?} scores {s} < upstream {up}");
                if o.n <= 8 {
                    let best = step["best"]["score"].as_u64().unwrap() as u32;
                    assert_eq!(s, best, "{ctx}: {got:?} scores {s}, optimum {best}");
                }
                steps += 1;
            }
        }
    }
    assert!(steps > 200, "only {steps} steps checked");
}

/// Replays each sequence with our own picks. Totals must reach the greedy step-optimal replay, and
/// upstream's total wherever a step-optimal policy can (see docs/architecture.md for the sequences
/// where upstream's look-ahead sacrifices a step on purpose).
#[test]
fn sequence_totals() {
    let engine = Engine::default();
    let mut report = Vec::new();
    let mut below_upstream = Vec::new();
    for o in oracles() {
        for seq in &o.sequences {
            let mut c = cluster_with_free(&o, &(0..o.n).collect::<Vec<_>>());
            let mut total = 0;
            for (i, k) in seq["sizes"].as_array().unwrap().iter().enumerate() {
                if let Some(set) = pick(&engine, &c, k.as_u64().unwrap() as usize) {
                    total += upstream_score(&o, &set);
                    take(&mut c, &format!("seq/{i}"), &set);
                }
            }
            let t = &seq["totals"];
            let up = t["upstream"].as_u64().unwrap() as u32;
            let greedy = t["greedy_step_optimal"].as_u64().unwrap() as u32;
            report.push(format!("{} {}: ours {total}, upstream {up}, greedy {greedy}", o.name, seq["name"]));
            assert!(total >= greedy, "{} {}: {total} < greedy {greedy}", o.name, seq["name"]);
            if total < up {
                below_upstream.push(format!("{} {}", o.name, seq["name"].as_str().unwrap()));
            }
        }
    }
    eprintln!("{}", report.join("\n"));
    // a step-optimal policy cannot reach these totals: upstream gives up score on an earlier step
    // (upstream's own step there is below the step optimum that the per-step test demands)
    let allowed = [
        "dgx1-volta extra_mixed_2_2_4",
        "dgx1-volta extra_mixed_4_2_2",
        "dgx1-volta extra_mixed_2_4_2",
        "pcie-l40s-8 extra_mixed_3_3_2",
    ];
    for b in &below_upstream {
        assert!(allowed.contains(&b.as_str()), "{b}: total below upstream");
    }
}

/// The `cases` of `dgx1-volta` (go-gpuallocator's own test cases, with must-include GPUs): the set
/// search with required GPUs finds the optimum, never below upstream, and refuses what upstream
/// refuses with an error.
#[test]
fn cases_with_required_gpus() {
    let o = oracles().into_iter().find(|o| o.name == "dgx1-volta").expect("dgx1-volta oracle");
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(shared().join("oracle/dgx1-volta.json")).unwrap()).unwrap();
    let cases = v["cases"].as_array().expect("cases array");
    assert!(cases.len() >= 11, "expected the 11 upstream cases, got {}", cases.len());
    let topo = &o.board.topology;
    let (mut solved, mut refused, mut with_required) = (0, 0, 0);
    for case in cases {
        let available = as_set(&case["available"]);
        let required = as_set(&case["required"]);
        let k = case["request"].as_u64().unwrap() as usize;
        let ctx = format!("case {} (available {available:?}, required {required:?}, request {k})", case["name"]);
        let got = topo.best_subset_including(&available, &required, k);
        if case["best"].is_null() {
            // upstream returns nothing: required GPUs missing, more required than requested, or too few
            assert!(case["upstream"]["gpus"].as_array().unwrap().is_empty(), "{ctx}");
            let err = got.expect_err(&ctx);
            assert!(!err.to_string().is_empty());
            refused += 1;
            continue;
        }
        let (score, set) = got.unwrap_or_else(|e| panic!("{ctx}: {e}"));
        assert_eq!(set.len(), k, "{ctx}: {set:?}");
        assert!(set.windows(2).all(|w| w[0] < w[1]), "{ctx}: {set:?} not sorted and distinct");
        assert!(set.iter().all(|g| available.contains(g)), "{ctx}: {set:?} takes an unavailable GPU");
        assert!(required.iter().all(|g| set.contains(g)), "{ctx}: {set:?} misses a required GPU");
        let s = upstream_score(&o, &set);
        assert_eq!(s, score, "{ctx}: reported score differs from the oracle's scoring");
        let up = case["upstream"]["score"].as_u64().unwrap() as u32;
        assert!(s >= up, "{ctx}: {set:?} scores {s} < upstream {up}");
        let best = case["best"]["score"].as_u64().unwrap() as u32;
        assert_eq!(s, best, "{ctx}: {set:?} scores {s}, optimum {best}");
        let optimal: Vec<Vec<usize>> = case["best"]["optimal_sets"].as_array().unwrap().iter().map(as_set).collect();
        assert!(optimal.contains(&set), "{ctx}: {set:?} is not among the optimal sets {optimal:?}");
        solved += 1;
        with_required += usize::from(!required.is_empty());
    }
    assert_eq!((solved, refused), (8, 3), "cases solved / refused");
    assert!(with_required >= 4, "only {with_required} solved cases had required GPUs");
}

/// Bad required-GPU input on a real board is an error with a clear message, never a panic.
#[test]
fn required_gpus_bad_input() {
    let o = oracles().into_iter().find(|o| o.name == "dgx1-volta").expect("dgx1-volta oracle");
    let topo = &o.board.topology;
    let all: Vec<usize> = (0..o.n).collect();
    let msg = |a: &[usize], r: &[usize], k: usize| match topo.best_subset_including(a, r, k) {
        Ok(x) => panic!("{a:?} {r:?} {k}: expected an error, got {x:?}"),
        Err(e) => e.to_string(),
    };
    assert!(msg(&[1, 2, 3], &[0, 1], 2).contains("required GPU 0 is not available"));
    assert!(msg(&all, &[0, 1, 2], 2).contains("3 GPUs are required but only 2 requested"));
    assert!(msg(&[0, 1, 2], &[0], 4).contains("4 GPUs requested but only 3 available"));
    assert!(msg(&all, &[], 9).contains("only 8 available"));
    assert!(msg(&all, &[], 0).contains("0 GPUs"));
    assert!(msg(&[0, 1, 8], &[], 2).contains("GPU 8 is not on this board"));
    assert!(msg(&[], &[], 1).contains("only 0 available"));
    // a required GPU already taken (not in available) is refused even when it would fit the count
    assert!(msg(&[4, 5, 6, 7], &[3], 4).contains("required GPU 3"));
}

// --- Degraded boards -----------------------------------------------------------------------------
//
// The oracle covers intact boards only. Boards with NVLinks missing (a failed link, a bridge not
// fitted) are made here from the shared topologies, and go-gpuallocator's picks on them come from
// `best_effort`, a re-implementation of its BestEffort policy as its documentation describes it:
// pad the free GPUs to a multiple of the request with empty slots, find the partition into sets of
// the requested size with the highest total score (the first found, sets enumerated with each
// set's first GPU in increasing order and the rest in lexicographic order), and return its
// highest-scoring set without padding (the first on ties). It is checked against every upstream
// pick the oracle recorded before it is trusted on the degraded boards.

/// GPU sets of `size` from `items`, in lexicographic order of positions.
fn combinations<T: Copy>(items: &[T], size: usize, out: &mut Vec<Vec<T>>) {
    fn rec<T: Copy>(items: &[T], size: usize, start: usize, cur: &mut Vec<T>, out: &mut Vec<Vec<T>>) {
        if cur.len() == size {
            out.push(cur.clone());
            return;
        }
        for i in start..items.len() {
            if items.len() - i < size - cur.len() {
                break;
            }
            cur.push(items[i]);
            rec(items, size, i + 1, cur, out);
            cur.pop();
        }
    }
    rec(items, size, 0, &mut Vec::new(), out);
}

/// A split of the padded GPU list into sets (`None`: a padding slot).
type Partition = Vec<Vec<Option<usize>>>;

/// go-gpuallocator's BestEffort pick of `k` GPUs among `available` (in this order) on `score`'s
/// pairs; `None` when there are fewer than `k`.
fn best_effort(available: &[usize], k: usize, score: &dyn Fn(usize, usize) -> u32) -> Option<Vec<usize>> {
    if k == 0 || available.len() < k {
        return None;
    }
    if k == 1 {
        return Some(vec![available[0]]);
    }
    let set_score = |set: &[Option<usize>]| -> u32 {
        let mut s = 0;
        for (i, a) in set.iter().enumerate() {
            for b in &set[i + 1..] {
                if let (Some(a), Some(b)) = (a, b) {
                    s += score(*a, *b);
                }
            }
        }
        s
    };
    let mut devices: Vec<Option<usize>> = available.iter().map(|&g| Some(g)).collect();
    while !devices.len().is_multiple_of(k) {
        devices.push(None);
    }
    let padding = devices.iter().filter(|d| d.is_none()).count();
    let mut best: Option<(u32, Partition)> = None;
    let mut visit = |partition: &Partition| {
        if !partition.iter().any(|s| s.iter().all(Option::is_some)) {
            return;
        }
        let total: u32 = partition.iter().map(|s| set_score(s)).sum();
        if best.as_ref().is_none_or(|(b, _)| total > *b) {
            best = Some((total, partition.clone()));
        }
    };
    fn iterate(
        devices: &[Option<usize>],
        k: usize,
        padding: usize,
        accum: &mut Partition,
        visit: &mut dyn FnMut(&Partition),
    ) {
        if devices.len() == k {
            accum.push(devices.to_vec());
            visit(accum);
            accum.pop();
            return;
        }
        let mut rests = Vec::new();
        combinations(&(1..devices.len()).collect::<Vec<_>>(), k - 1, &mut rests);
        for rest in rests {
            let mut set = vec![devices[0]];
            set.extend(rest.iter().map(|&i| devices[i]));
            let p = set.iter().filter(|d| d.is_none()).count();
            if !(p == 0 || p == padding) {
                continue;
            }
            let remaining: Vec<Option<usize>> =
                (1..devices.len()).filter(|i| !rest.contains(i)).map(|i| devices[i]).collect();
            accum.push(set);
            iterate(&remaining, k, padding, accum, visit);
            accum.pop();
        }
    }
    iterate(&devices, k, padding, &mut Vec::new(), &mut visit);
    let (_, partition) = best?;
    let mut pick: Option<(u32, Vec<usize>)> = None;
    for set in partition.iter().filter(|s| s.iter().all(Option::is_some)) {
        let s = set_score(set);
        if pick.as_ref().is_none_or(|(b, _)| s > *b) {
            pick = Some((s, set.iter().flatten().copied().collect()));
        }
    }
    pick.map(|(_, s)| s)
}

#[test]
fn the_best_effort_reference_makes_every_pick_upstream_made() {
    let mut steps = 0;
    for o in oracles() {
        let score = |a: usize, b: usize| o.pairs[a][b];
        for seq in &o.sequences {
            for (i, step) in seq["steps"].as_array().unwrap().iter().enumerate() {
                let k = step["request"].as_u64().unwrap() as usize;
                let free = as_set(&step["free_before"]);
                let up = as_set(&step["upstream"]["gpus"]);
                let got = best_effort(&free, k, &score).unwrap_or_default();
                assert_eq!(got, up, "{} {} step {i} (k={k}, free={free:?})", o.name, seq["name"]);
                steps += 1;
            }
        }
    }
    assert!(steps > 200, "only {steps} steps checked");
}

/// A shared board with the NVLinks of `cut` pairs removed (PCIe paths kept).
struct Degraded {
    name: String,
    board: ResolvedBoard,
    /// The request sequences of the intact board's oracle.
    sequences: Vec<Vec<usize>>,
}

fn degraded_boards() -> Vec<Degraded> {
    let mut out = Vec::new();
    for o in oracles() {
        let file = load_topology_file(&shared().join(format!("{}.json", o.name))).unwrap();
        let linked: Vec<usize> = (0..file.links.len()).filter(|&i| file.links[i].nvlinks > 0).collect();
        // direct NVLink boards only: on NVSwitch every pair's lanes go through the switch
        if linked.is_empty() || file.nvlink_fabric == gpuplace_core::topology::NvlinkFabric::Nvswitch {
            continue;
        }
        let sequences: Vec<Vec<usize>> = o
            .sequences
            .iter()
            .map(|s| s["sizes"].as_array().unwrap().iter().map(|k| k.as_u64().unwrap() as usize).collect())
            .collect();
        // every single pair cut, and every two pairs cut
        let mut cuts: Vec<Vec<usize>> = linked.iter().map(|&i| vec![i]).collect();
        combinations(&linked, 2, &mut cuts);
        for cut in cuts {
            let mut f = file.clone();
            let mut label = Vec::new();
            for &i in &cut {
                f.links[i].nvlinks = 0;
                label.push(format!("{}-{}", f.links[i].a, f.links[i].b));
            }
            out.push(Degraded {
                name: format!("{} without NVLink {}", o.name, label.join(",")),
                board: ResolvedBoard::from_file(&f).unwrap(),
                sequences: sequences.clone(),
            });
        }
    }
    out
}

/// The highest total a policy that takes a best-scoring set at every step can reach on `sizes`
/// from `free` (every tie tried).
fn best_step_optimal_total(topo: &GpuTopology, free: &[usize], sizes: &[usize]) -> u32 {
    let Some((&k, rest)) = sizes.split_first() else { return 0 };
    if k > free.len() {
        return best_step_optimal_total(topo, free, rest);
    }
    let mut sets = Vec::new();
    combinations(free, k, &mut sets);
    let top = sets.iter().map(|s| topo.set_score(s)).max().unwrap_or(0);
    sets.iter()
        .filter(|s| topo.set_score(s) == top)
        .map(|s| {
            let left: Vec<usize> = free.iter().copied().filter(|g| !s.contains(g)).collect();
            top + best_step_optimal_total(topo, &left, rest)
        })
        .max()
        .unwrap_or(0)
}

/// Sequences on degraded boards that total below upstream although a step-optimal policy could
/// reach upstream's total. Measured: 71 with the quad-and-pair look-ahead alone, 34 since the
/// look-ahead first values the split of what is left into sets of the request's size. Not yet 0
/// (issue 11, part 4): this bound only keeps it from getting worse.
const DEGRADED_BELOW_REACHABLE_UPSTREAM: usize = 34;

/// On boards with one or two NVLink pairs cut (4,923 request sequences): every step takes a
/// best-scoring set; summed over all sequences, our totals are above go-gpuallocator's BestEffort;
/// and the sequences below upstream where a step-optimal policy could reach it stay within
/// [`DEGRADED_BELOW_REACHABLE_UPSTREAM`] (upstream sometimes gives up score on a step on purpose;
/// a step-optimal policy cannot follow it there).
#[test]
fn degraded_boards_reach_upstream_totals() {
    let engine = Engine::default();
    let (mut sequences, mut below, mut unreachable) = (0, Vec::new(), 0);
    let (mut sum_ours, mut sum_upstream) = (0u64, 0u64);
    for d in degraded_boards() {
        let topo = d.board.topology.clone();
        let score = |a: usize, b: usize| topo.pair_score(a, b);
        let n = d.board.gpus.len();
        let o = Oracle { name: d.name.clone(), n, pairs: Vec::new(), sequences: Vec::new(), board: d.board };
        for sizes in &d.sequences {
            let all: Vec<usize> = (0..n).collect();
            let (mut c, mut free) = (cluster_with_free(&o, &all), all.clone());
            let (mut ours, mut upstream) = (0, 0);
            let mut up_free = all.clone();
            for (i, &k) in sizes.iter().enumerate() {
                if let Some(set) = best_effort(&up_free, k, &score) {
                    upstream += topo.set_score(&set);
                    up_free.retain(|g| !set.contains(g));
                }
                if k > free.len() {
                    continue;
                }
                let set = pick(&engine, &c, k).unwrap_or_else(|| panic!("{} {sizes:?} step {i}: no pick", d.name));
                let s = topo.set_score(&set);
                let mut all_sets = Vec::new();
                combinations(&free, k, &mut all_sets);
                let top = all_sets.iter().map(|x| topo.set_score(x)).max().unwrap_or(0);
                assert_eq!(s, top, "{} {sizes:?} step {i}: {set:?} scores {s}, optimum {top}", d.name);
                ours += s;
                free.retain(|g| !set.contains(g));
                take(&mut c, &format!("seq/{i}"), &set);
            }
            sequences += 1;
            sum_ours += u64::from(ours);
            sum_upstream += u64::from(upstream);
            if ours < upstream {
                if best_step_optimal_total(&topo, &all, sizes) < upstream {
                    unreachable += 1;
                } else {
                    below.push(format!("{} {sizes:?}: ours {ours} < upstream {upstream}", d.name));
                }
            }
        }
    }
    eprintln!(
        "degraded boards: {sequences} sequences, total score ours {sum_ours} upstream {sum_upstream}; below upstream \
         where a step-optimal policy reaches it: {}; upstream out of a step-optimal policy's reach: {unreachable}",
        below.len()
    );
    assert!(sequences > 4000, "only {sequences} sequences checked");
    assert!(sum_ours > sum_upstream, "summed totals {sum_ours} below upstream's {sum_upstream}");
    assert!(
        below.len() <= DEGRADED_BELOW_REACHABLE_UPSTREAM,
        "{} sequences below a reachable upstream total (at most {DEGRADED_BELOW_REACHABLE_UPSTREAM}):\n{}",
        below.len(),
        below.join("\n")
    );
}
