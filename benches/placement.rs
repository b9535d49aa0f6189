//! Placement benchmarks: filter+score of one pod over 1k/5k/10k nodes of 8 GPUs at 50 % random
//! allocation, and GPU-set selection on 8- and 16-GPU boards: through `Engine::place` (whole-GPU
//! choices are memoized per board and mask, so repeated calls measure the memoized path) and the
//! set search itself, uncached; and the capacity summary a placement log adds to every bind line.
//! Run: `cargo bench --bench placement`; figures go to docs/performance.md.

use std::collections::BTreeMap;
use std::path::Path;

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use gpuplace::placement::engine::Engine;
use gpuplace::placement::gpu_select::{choose_one, choose_set, FreeState, ShareChoice};
use gpuplace::placement_log::CapacitySummary;
use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
use gpuplace_core::cluster::Cluster;
use gpuplace_core::inventory::Board;
use gpuplace_core::resources::{GpuDemand, MemoryDemand, PodRequest};
use gpuplace_core::resources::{NumaPolicy, PackingPolicy};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn h100_board(gpus: u32) -> gpuplace_core::inventory::ResolvedBoard {
    Board::Nvswitch { gpus, model: "H100".into(), memory_mib: 81559, numa_nodes: 2, nvlinks: 18 }
        .resolve(Path::new("."))
        .expect("generated board")
}

/// `n` nodes of 8 H100s, half of all GPU capacity allocated at random (whole GPUs and shares).
fn cluster(n: usize) -> Cluster {
    let board = h100_board(8);
    let mut c = Cluster::new((0..n).map(|i| board.node(&format!("node-{i:05}"), BTreeMap::new(), 0, 0)).collect());
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut pod = 0;
    for i in 0..n {
        let name = format!("node-{i:05}");
        for g in 0..8u32 {
            let roll: f64 = rng.random();
            let slice = if roll < 0.35 {
                Some(GpuSlice { gpu: g, mem_mib: 81559, core_pct: 100, exclusive: true })
            } else if roll < 0.65 {
                let pct = rng.random_range(1..=9) * 10;
                Some(GpuSlice { gpu: g, mem_mib: 81559 * pct / 100, core_pct: pct as u32, exclusive: false })
            } else {
                None
            };
            if let Some(s) = slice {
                pod += 1;
                c.allocate(PodAssignment {
                    pod: format!("ns/fill-{pod}"),
                    node: name.clone(),
                    containers: vec![ContainerAssignment { name: "c".into(), init: false, slices: vec![s] }],
                    cpu_milli: 0,
                    memory_mib: 0,
                    group: None,
                })
                .expect("filler fits");
            }
        }
    }
    c
}

fn filter_and_score(c: &mut Criterion) {
    let engine = Engine::default();
    let share =
        PodRequest::single("ns/share", GpuDemand::Shared { gpus: 1, memory: MemoryDemand::Mib(20480), core_pct: 30 });
    let whole = PodRequest::single("ns/whole2", GpuDemand::Whole { gpus: 2 });
    let mut group = c.benchmark_group("filter_score");
    group.sample_size(10);
    for n in [1_000usize, 5_000, 10_000] {
        let cl = cluster(n);
        group.bench_with_input(BenchmarkId::new("share", n), &cl, |b, cl| {
            b.iter(|| black_box(engine.evaluate_all(cl, &share, 0).ranked.len()))
        });
        group.bench_with_input(BenchmarkId::new("whole2", n), &cl, |b, cl| {
            b.iter(|| black_box(engine.evaluate_all(cl, &whole, 0).ranked.len()))
        });
    }
    group.finish();
}

fn gpu_set_selection(c: &mut Criterion) {
    let engine = Engine::default();
    let mut group = c.benchmark_group("gpu_set");
    for gpus in [8u32, 16] {
        let cl = Cluster::new(vec![h100_board(gpus).node("n", BTreeMap::new(), 0, 0)]);
        for k in [1u32, 2, 3, 4, 8] {
            let req = PodRequest::single("ns/p", GpuDemand::Whole { gpus: k });
            group.bench_function(BenchmarkId::new(format!("{gpus}gpu"), k), |b| {
                b.iter(|| black_box(engine.place(&cl, &req, 0).map(|p| p.gpus().len())))
            });
        }
    }
    group.finish();
}

fn gpu_set_search(c: &mut Criterion) {
    let mut group = c.benchmark_group("gpu_set_search");
    for gpus in [8u32, 16] {
        let node = h100_board(gpus).node("n", BTreeMap::new(), 0, 0);
        let state = FreeState::current(&node, |_| true);
        let cands: Vec<usize> = (0..gpus as usize).collect();
        for k in [1usize, 2, 3, 4, 8] {
            let d = GpuDemand::Whole { gpus: k as u32 };
            group.bench_function(BenchmarkId::new(format!("{gpus}gpu"), k), |b| {
                b.iter(|| {
                    if k == 1 {
                        black_box(choose_one(&node, &state, &cands, &d, ShareChoice::Pack(PackingPolicy::Binpack)))
                            .map(|g| vec![g])
                    } else {
                        black_box(choose_set(
                            &node,
                            &state,
                            &cands,
                            k,
                            NumaPolicy::Preferred,
                            PackingPolicy::Binpack,
                            &d,
                        ))
                    }
                })
            });
        }
    }
    group.finish();
}

/// `CapacitySummary::of`: written on every bind when a placement log is on, under the cluster's
/// read lock, over every GPU of the cluster.
fn capacity_summary(c: &mut Criterion) {
    let mut group = c.benchmark_group("capacity_summary");
    group.sample_size(20);
    for n in [1_000usize, 5_000] {
        let cl = cluster(n);
        group.bench_with_input(BenchmarkId::from_parameter(n), &cl, |b, cl| {
            b.iter(|| black_box(CapacitySummary::of(cl, "node-00042").idle_gpus))
        });
    }
    group.finish();
}

criterion_group!(benches, filter_and_score, gpu_set_selection, gpu_set_search, capacity_summary);
criterion_main!(benches);
