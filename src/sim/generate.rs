//! Workload generators for the openb variant families that `../shared` does not carry: more
//! multi-GPU pods, more pods that constrain the GPU model, more (or fewer) sharing pods.
//!
//! A generated workload is named `BASE+KIND=PERCENT` (several may follow each other, applied left to
//! right), for example `default+multigpu=30`, and is one fixed pod list, like a published CSV: the
//! generators draw from a fixed seed, and the replay's seeds then shuffle it as usual.
//!
//! - `multigpu=P`: pods of 2 or more GPUs make up P percent of the GPU request (in GPUs), with the
//!   total GPU request unchanged. Pods are drawn with replacement from the base's multi-GPU pods and
//!   from its other GPU pods. (The published `multigpu20..50` raise the same share.)
//! - `gpuspec=P`: P percent of GPU pods name the GPU models they may use (`gpu_spec`). The pods that
//!   already do count toward it; others are picked at random and given one model present in the node
//!   list on a node with enough GPUs for them, drawn in proportion to the model's GPUs. (The published
//!   `gpuspec10..33` constrain the same share of pods, but differently: see the next one.)
//! - `gpuspec-openb=P`: P percent of GPU pods name their models as the published `gpuspec05..33`
//!   do ([`PUBLISHED_SPECS`]): a model list drawn by the pod's shape, mostly `T4` (about half),
//!   then `G2`, `P100`, `V100M16|V100M32`, `P100|V100M16|V100M32`, `G3`, and a few lists of up to
//!   all the models, some naming one twice (`V100M16|V100M32|V100M32`). Shares are bound to `T4` or
//!   `P100` (rarely to five models), whole GPUs to any list, 8-GPU pods to `G2` or `G3`. A whole
//!   single GPU is picked 1.4 times as often as a share (their weights 1.16 and 0.84), so about 60
//!   percent of the constrained pods are whole GPUs. The pods that already name models count
//!   toward P; a list that no node with enough GPUs offers is never drawn.
//! - `sharing=P`: sharing pods (a part of one GPU) are P percent of GPU pods, with the number of GPU
//!   pods unchanged, drawn with replacement from the base's sharing and non-sharing GPU pods. (The
//!   published `gpushare40..100` set the same share.)
//!
//! - `gangs=P`: groups of pods that must start together make up P percent of the GPU request (in
//!   GPUs), with the total GPU request unchanged: random GPU pods are dropped until P percent is
//!   freed, and groups are added in their place until as many GPUs are back, half of them (in GPUs)
//!   as training jobs of 2 or 4 pods x 8 whole GPUs, half as hyperparameter-search trials of 8 pods
//!   x a quarter of one GPU. Each member takes the host CPU and memory of a base pod of its shape
//!   (an 8-GPU pod, with its model constraint if it has one; a pod sharing one GPU, without). The replay keeps each group's pods together: they
//!   arrive at once, where the group's first pod falls in the seed's order (`sim::protocol`).
//!
//! CPU-only pods are kept as they are.

use std::collections::BTreeMap;

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::sim::trace::{TraceError, TraceNode, TracePod};

/// The generators' own seed: a generated workload is the same list on every run.
const GENERATOR_SEED: u64 = 2023;

/// One generator step of a workload name.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Variation {
    MultiGpu(f64),
    GpuSpec(f64),
    GpuSpecOpenb(f64),
    Sharing(f64),
    Gangs(f64),
}

/// Splits `default+multigpu=30+gpuspec=20` into the base workload and its steps.
pub fn parse_workload(name: &str) -> Result<(String, Vec<Variation>), TraceError> {
    let mut parts = name.split('+');
    let base = parts.next().unwrap_or_default().trim().to_string();
    if base.is_empty() {
        return Err(TraceError::Invalid(format!("workload {name:?}: no base workload before '+'")));
    }
    let mut steps = Vec::new();
    for part in parts {
        let bad = |why: &str| TraceError::Invalid(format!("workload {name:?}: {part:?}: {why}"));
        let (kind, pct) = part.split_once('=').ok_or_else(|| bad("expected KIND=PERCENT"))?;
        let pct: f64 = pct.trim().parse().map_err(|_| bad("the percent is not a number"))?;
        if !(0.0..=100.0).contains(&pct) {
            return Err(bad("the percent must be within 0..=100"));
        }
        steps.push(match kind.trim() {
            "multigpu" => Variation::MultiGpu(pct),
            "gpuspec" => Variation::GpuSpec(pct),
            "gpuspec-openb" => Variation::GpuSpecOpenb(pct),
            "sharing" => Variation::Sharing(pct),
            "gangs" => Variation::Gangs(pct),
            other => {
                return Err(bad(&format!(
                    "unknown kind {other:?}; choose multigpu, gpuspec, gpuspec-openb, sharing or gangs"
                )))
            }
        });
    }
    Ok((base, steps))
}

/// Applies the steps to `pods` (see the module documentation).
pub fn generate(pods: &[TracePod], nodes: &[TraceNode], steps: &[Variation]) -> Result<Vec<TracePod>, TraceError> {
    let mut rng = ChaCha8Rng::seed_from_u64(GENERATOR_SEED);
    let mut out = pods.to_vec();
    for (i, step) in steps.iter().enumerate() {
        let tag = format!("g{i}");
        out = match *step {
            Variation::MultiGpu(p) => multigpu(&out, p / 100.0, &tag, &mut rng)?,
            Variation::GpuSpec(p) => gpuspec(&out, nodes, p / 100.0, &mut rng)?,
            Variation::GpuSpecOpenb(p) => gpuspec_openb(&out, nodes, p / 100.0, &mut rng)?,
            Variation::Sharing(p) => sharing(&out, p / 100.0, &tag, &mut rng)?,
            Variation::Gangs(p) => gangs(&out, p / 100.0, &tag, &mut rng)?,
        };
    }
    Ok(out)
}

fn gpus_of(p: &TracePod) -> f64 {
    f64::from(p.milli()) * f64::from(p.num_gpu) / 1000.0
}

fn is_gpu(p: &TracePod) -> bool {
    p.milli() > 0
}

/// Draws copies from `from` (with replacement), named uniquely, until `enough` says stop.
fn draw(
    from: &[&TracePod],
    tag: &str,
    rng: &mut ChaCha8Rng,
    mut enough: impl FnMut(&TracePod) -> bool,
) -> Vec<TracePod> {
    let mut out = Vec::new();
    while let Some(p) = from.choose(rng) {
        if enough(p) {
            break;
        }
        let mut copy = (*p).clone();
        copy.name = format!("{}-{tag}-{}", p.name, out.len());
        out.push(copy);
    }
    out
}

/// Pods per training job (each of 8 whole GPUs), drawn uniformly.
const JOB_SIZES: [usize; 2] = [2, 4];
/// Pods per trial group, and each trial's share of one GPU in thousandths.
const TRIALS: usize = 8;
const TRIAL_MILLI: u32 = 250;

fn gangs(pods: &[TracePod], share: f64, tag: &str, rng: &mut ChaCha8Rng) -> Result<Vec<TracePod>, TraceError> {
    let eight: Vec<&TracePod> =
        pods.iter().filter(|p| p.group.is_none() && p.num_gpu == 8 && p.milli() >= 1000).collect();
    let shared: Vec<&TracePod> =
        pods.iter().filter(|p| p.group.is_none() && p.num_gpu == 1 && is_gpu(p) && p.milli() < 1000).collect();
    if share > 0.0 && (eight.is_empty() || shared.is_empty()) {
        return Err(TraceError::Invalid("gangs: the base has no 8-GPU pods or no pods sharing a GPU".into()));
    }
    let total: f64 = pods.iter().map(gpus_of).sum();
    let target = share * total;
    // drop random GPU pods (never members of groups already there) until `target` GPUs are freed
    let mut candidates: Vec<usize> = (0..pods.len()).filter(|&i| is_gpu(&pods[i]) && pods[i].group.is_none()).collect();
    let mut dropped = vec![false; pods.len()];
    let mut freed = 0.0;
    while freed < target && !candidates.is_empty() {
        let k = rng.random_range(0..candidates.len());
        let i = candidates.swap_remove(k);
        dropped[i] = true;
        freed += gpus_of(&pods[i]);
    }
    let mut out: Vec<TracePod> = pods.iter().zip(&dropped).filter(|(_, d)| !**d).map(|(p, _)| p.clone()).collect();
    let (mut jobs, mut trials, mut added) = (0.0, 0.0, 0.0);
    let mut n = 0usize;
    while added < freed {
        let group = format!("{tag}-gang-{n}");
        let members: Vec<TracePod> = if jobs <= trials {
            let size = *JOB_SIZES.choose(rng).unwrap_or(&2);
            let base = eight.choose(rng).copied().ok_or_else(|| TraceError::Invalid("gangs: no 8-GPU pod".into()))?;
            (0..size)
                .map(|i| TracePod { name: format!("{group}-{i}"), group: Some(group.clone()), ..base.clone() })
                .collect()
        } else {
            let base = shared.choose(rng).copied().ok_or_else(|| TraceError::Invalid("gangs: no shared pod".into()))?;
            (0..TRIALS)
                .map(|i| TracePod {
                    name: format!("{group}-{i}"),
                    group: Some(group.clone()),
                    gpu_milli: TRIAL_MILLI,
                    gpu_spec: String::new(),
                    ..base.clone()
                })
                .collect()
        };
        let gpus: f64 = members.iter().map(gpus_of).sum();
        if members[0].num_gpu == 8 {
            jobs += gpus;
        } else {
            trials += gpus;
        }
        added += gpus;
        out.extend(members);
        n += 1;
    }
    Ok(out)
}

fn multigpu(pods: &[TracePod], share: f64, tag: &str, rng: &mut ChaCha8Rng) -> Result<Vec<TracePod>, TraceError> {
    let (multi, single): (Vec<&TracePod>, Vec<&TracePod>) =
        pods.iter().filter(|p| is_gpu(p)).partition(|p| p.num_gpu >= 2);
    if (share > 0.0 && multi.is_empty()) || (share < 1.0 && single.is_empty()) {
        return Err(TraceError::Invalid("multigpu: the base has no multi-GPU pods or no other GPU pods".into()));
    }
    let total: f64 = pods.iter().map(gpus_of).sum();
    let mut out: Vec<TracePod> = pods.iter().filter(|p| !is_gpu(p)).cloned().collect();
    let (mut m, mut s) = (0.0, 0.0);
    out.extend(draw(&multi, &format!("{tag}m"), rng, |p| {
        let stop = m + gpus_of(p) > share * total;
        m += if stop { 0.0 } else { gpus_of(p) };
        stop
    }));
    out.extend(draw(&single, &format!("{tag}s"), rng, |p| {
        let stop = s + gpus_of(p) > (1.0 - share) * total;
        s += if stop { 0.0 } else { gpus_of(p) };
        stop
    }));
    Ok(out)
}

/// One item drawn in proportion to its weight (`None` when they sum to 0).
fn weighted_pick<'a, T>(items: &'a [(T, u32)], rng: &mut ChaCha8Rng) -> Option<&'a T> {
    let total: u32 = items.iter().map(|(_, w)| w).sum();
    if total == 0 {
        return None;
    }
    let mut pick = rng.random_range(0..total);
    items
        .iter()
        .find(|(_, w)| {
            let hit = pick < *w;
            pick = pick.saturating_sub(*w);
            hit
        })
        .map(|(t, _)| t)
}

/// The GPU pods of `pods` that name no model yet, in order, and how many more must name one for
/// `share` of the GPU pods to (those that already do count).
fn to_bind(pods: &[TracePod], share: f64) -> (Vec<usize>, usize) {
    let gpu_pods: Vec<usize> = (0..pods.len()).filter(|&i| is_gpu(&pods[i])).collect();
    let want = (share * gpu_pods.len() as f64).round() as usize;
    let (free, bound): (Vec<usize>, Vec<usize>) = gpu_pods.into_iter().partition(|&i| pods[i].gpu_spec.is_empty());
    (free, want.saturating_sub(bound.len()))
}

fn gpuspec(
    pods: &[TracePod],
    nodes: &[TraceNode],
    share: f64,
    rng: &mut ChaCha8Rng,
) -> Result<Vec<TracePod>, TraceError> {
    let mut out = pods.to_vec();
    let (mut free, mut more) = to_bind(&out, share);
    while more > 0 && !free.is_empty() {
        more -= 1;
        let pod = free.swap_remove(rng.random_range(0..free.len()));
        // models on nodes big enough for this pod, weighted by their GPUs there
        let mut weight: BTreeMap<&str, u32> = BTreeMap::new();
        for n in nodes.iter().filter(|n| n.gpu >= out[pod].num_gpu && !n.model.is_empty()) {
            *weight.entry(n.model.as_str()).or_default() += n.gpu;
        }
        let weighted: Vec<(&str, u32)> = weight.into_iter().collect();
        let Some(model) = weighted_pick(&weighted, rng) else {
            return Err(TraceError::Invalid(format!("gpuspec: no node has {} GPUs", out[pod].num_gpu)));
        };
        out[pod].gpu_spec = model.to_string();
    }
    Ok(out)
}

/// The model lists of the published `gpuspec05..33` pod lists, by the pod's shape, with how many
/// constrained pods of that shape named each, over the five files (6,692 constrained pods). The
/// files keep every pod of `default` as it is and add a `gpu_spec` to a share of the GPU pods,
/// drawn afresh for each file (a pod bound in two files names the same list a third of the time).
pub const PUBLISHED_SPECS: [(SpecShape, &[(&str, u32)]); 5] = [
    (SpecShape::Share, &[("T4", 1609), ("P100", 839), ("G2|P100|T4|V100M16|V100M32", 45)]),
    (
        SpecShape::Whole(1),
        &[
            ("T4", 1865),
            ("G2", 933),
            ("V100M16|V100M32", 435),
            ("P100|V100M16|V100M32", 268),
            ("G3", 209),
            ("P100|T4|V100M16|V100M32", 76),
            ("G2|P100|T4|V100M16|V100M32", 74),
            ("A10|G2|T4|V100M16|V100M32", 64),
            ("V100M16|V100M32|V100M32", 63),
            ("V100M32", 48),
            ("P100|V100M16", 31),
            ("A10|T4", 21),
            ("V100M16", 17),
            ("P100", 10),
            ("A10|G2|P100|T4|V100M16|V100M32|V100M32", 10),
            ("P100|T4", 1),
            ("T4|V100M16|V100M32", 1),
        ],
    ),
    (
        SpecShape::Whole(2),
        &[("P100|V100M16|V100M32", 6), ("T4|V100M16|V100M32", 3), ("V100M16|V100M32", 3), ("V100M32", 3)],
    ),
    (SpecShape::Whole(4), &[("G2", 12), ("V100M16|V100M32|V100M32", 7), ("V100M16|V100M32", 2)]),
    (SpecShape::Whole(8), &[("G2", 21), ("G3", 16)]),
];

/// A pod's shape as [`PUBLISHED_SPECS`] reads it: a share of one GPU, or N whole GPUs (3 reads as
/// 4, more than 4 as 8: the published files have 1, 2, 4 and 8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecShape {
    Share,
    Whole(u32),
}

impl SpecShape {
    /// The shape of `p`.
    pub fn of(p: &TracePod) -> Self {
        match (p.num_gpu, p.milli()) {
            (1, m) if m < 1000 => Self::Share,
            (n @ (1 | 2 | 4), _) => Self::Whole(n),
            (3, _) => Self::Whole(4),
            _ => Self::Whole(8),
        }
    }

    /// How likely a pod of this shape is to be picked, against a pod picked uniformly (the
    /// published files' constrained share of each shape over its share of the GPU pods).
    fn pick_weight(self) -> f64 {
        match self {
            Self::Share => 0.84,
            Self::Whole(1) => 1.16,
            Self::Whole(_) => 1.0,
        }
    }
}

fn gpuspec_openb(
    pods: &[TracePod],
    nodes: &[TraceNode],
    share: f64,
    rng: &mut ChaCha8Rng,
) -> Result<Vec<TracePod>, TraceError> {
    let mut out = pods.to_vec();
    let (free, more) = to_bind(&out, share);
    // weighted picks without replacement (Efraimidis-Spirakis): the largest u^(1/w) win
    let mut keyed: Vec<(f64, usize)> =
        free.into_iter().map(|i| (rng.random::<f64>().powf(1.0 / SpecShape::of(&out[i]).pick_weight()), i)).collect();
    keyed.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, pod) in keyed.iter().take(more) {
        let shape = SpecShape::of(&out[pod]);
        let table = PUBLISHED_SPECS.iter().find(|(s, _)| *s == shape).map_or(&[][..], |(_, t)| *t);
        // only lists that some node with enough GPUs offers
        let gpus = out[pod].num_gpu;
        let offered = |list: &str| {
            list.split('|').any(|m| nodes.iter().any(|n| n.gpu >= gpus && n.model.eq_ignore_ascii_case(m)))
        };
        let choices: Vec<(&str, u32)> = table.iter().copied().filter(|(list, _)| offered(list)).collect();
        let Some(list) = weighted_pick(&choices, rng) else {
            return Err(TraceError::Invalid(format!(
                "gpuspec-openb: no published model list for a pod of {gpus} GPU(s) is on a node with that many"
            )));
        };
        out[pod].gpu_spec = list.to_string();
    }
    Ok(out)
}

fn sharing(pods: &[TracePod], share: f64, tag: &str, rng: &mut ChaCha8Rng) -> Result<Vec<TracePod>, TraceError> {
    let (shared, whole): (Vec<&TracePod>, Vec<&TracePod>) =
        pods.iter().filter(|p| is_gpu(p)).partition(|p| p.milli() < 1000);
    if (share > 0.0 && shared.is_empty()) || (share < 1.0 && whole.is_empty()) {
        return Err(TraceError::Invalid("sharing: the base has no sharing pods or no whole-GPU pods".into()));
    }
    let n = shared.len() + whole.len();
    let want_shared = (share * n as f64).round() as usize;
    let mut out: Vec<TracePod> = pods.iter().filter(|p| !is_gpu(p)).cloned().collect();
    let mut k = 0;
    out.extend(draw(&shared, &format!("{tag}s"), rng, |_| {
        k += 1;
        k > want_shared
    }));
    let mut k = 0;
    out.extend(draw(&whole, &format!("{tag}w"), rng, |_| {
        k += 1;
        k > n - want_shared
    }));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::trace::tests::pod;

    fn base() -> Vec<TracePod> {
        let mut pods: Vec<TracePod> = (0..400).map(|i| pod(&format!("s{i}"), 1, 250 + (i % 3) * 100)).collect();
        pods.extend((0..400).map(|i| pod(&format!("w{i}"), 1, 1000)));
        pods.extend((0..20).map(|i| pod(&format!("m{i}"), 2 + (i % 3) * 2, 1000)));
        pods.extend((0..50).map(|i| pod(&format!("c{i}"), 0, 0)));
        pods
    }

    fn nodes() -> Vec<TraceNode> {
        let n = |name: &str, gpu: u32, model: &str| TraceNode {
            name: name.into(),
            cpu_milli: 64000,
            memory_mib: 262144,
            gpu,
            model: model.into(),
            nvswitch: false,
        };
        vec![n("a", 8, "G2"), n("b", 2, "T4"), n("c", 2, "T4")]
    }

    #[test]
    fn names_parse_and_bad_ones_say_why() {
        assert_eq!(
            parse_workload("default+multigpu=30+gpuspec=20").unwrap(),
            ("default".into(), vec![Variation::MultiGpu(30.0), Variation::GpuSpec(20.0)])
        );
        assert_eq!(parse_workload("cpu050").unwrap(), ("cpu050".into(), vec![]));
        for bad in ["+multigpu=30", "default+multigpu", "default+multigpu=x", "default+multigpu=130", "default+more=3"]
        {
            let e = parse_workload(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn multigpu_reaches_its_share_and_keeps_the_total() {
        let pods = base();
        let total: f64 = pods.iter().map(gpus_of).sum();
        let out = generate(&pods, &nodes(), &[Variation::MultiGpu(40.0)]).unwrap();
        let multi: f64 = out.iter().filter(|p| p.num_gpu >= 2).map(gpus_of).sum();
        let new_total: f64 = out.iter().map(gpus_of).sum();
        assert!((multi / new_total - 0.4).abs() < 0.03, "{}", multi / new_total);
        assert!((new_total - total).abs() / total < 0.03, "{new_total} vs {total}");
        assert_eq!(out.iter().filter(|p| !is_gpu(p)).count(), 50, "CPU-only pods kept");
        let names: std::collections::BTreeSet<&str> = out.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names.len(), out.len(), "names unique");
        assert_eq!(out, generate(&pods, &nodes(), &[Variation::MultiGpu(40.0)]).unwrap(), "deterministic");
    }

    #[test]
    fn gpuspec_constrains_its_share_to_models_that_can_host_the_pod() {
        let out = generate(&base(), &nodes(), &[Variation::GpuSpec(25.0)]).unwrap();
        let gpu: Vec<&TracePod> = out.iter().filter(|p| is_gpu(p)).collect();
        let constrained: Vec<&&TracePod> = gpu.iter().filter(|p| !p.gpu_spec.is_empty()).collect();
        assert_eq!(constrained.len(), (0.25 * gpu.len() as f64).round() as usize);
        for p in &constrained {
            assert!(p.gpu_spec == "G2" || (p.gpu_spec == "T4" && p.num_gpu <= 2), "{p:?}");
        }
        assert!(constrained.iter().any(|p| p.gpu_spec == "T4") && constrained.iter().any(|p| p.gpu_spec == "G2"));
    }

    #[test]
    fn gpuspec_openb_names_the_published_lists_by_shape() {
        let n = |name: &str, gpu: u32, model: &str| TraceNode {
            name: name.into(),
            cpu_milli: 96000,
            memory_mib: 393216,
            gpu,
            model: model.into(),
            nvswitch: false,
        };
        let every_model = vec![
            n("g2", 8, "G2"),
            n("g3", 8, "G3"),
            n("t4", 2, "T4"),
            n("p100", 2, "P100"),
            n("v16", 4, "V100M16"),
            n("v32", 8, "V100M32"),
            n("a10", 1, "A10"),
        ];
        let mut pods = base();
        pods.extend((0..40).map(|i| pod(&format!("e{i}"), 8, 1000)));
        let step = [Variation::GpuSpecOpenb(50.0)];
        let out = generate(&pods, &every_model, &step).unwrap();
        assert_eq!(out, generate(&pods, &every_model, &step).unwrap(), "deterministic");
        let gpu: Vec<&TracePod> = out.iter().filter(|p| is_gpu(p)).collect();
        let bound: Vec<&&TracePod> = gpu.iter().filter(|p| !p.gpu_spec.is_empty()).collect();
        assert_eq!(bound.len(), (0.5 * gpu.len() as f64).round() as usize);
        for p in &bound {
            match SpecShape::of(p) {
                SpecShape::Share => {
                    assert!(["T4", "P100", "G2|P100|T4|V100M16|V100M32"].contains(&p.gpu_spec.as_str()))
                }
                SpecShape::Whole(8) => assert!(p.gpu_spec == "G2" || p.gpu_spec == "G3", "{p:?}"),
                _ => {}
            }
        }
        // whole single GPUs are picked more often than shares (400 of each in the base)
        let (whole, shares) = (
            bound.iter().filter(|p| SpecShape::of(p) == SpecShape::Whole(1)).count(),
            bound.iter().filter(|p| SpecShape::of(p) == SpecShape::Share).count(),
        );
        assert!(whole > shares + 20, "{whole} whole, {shares} shares");
        // T4 alone is the most named list, about half of all
        let t4 = bound.iter().filter(|p| p.gpu_spec == "T4").count() as f64 / bound.len() as f64;
        assert!((0.4..0.65).contains(&t4), "{t4}");
        // a list that no node with enough GPUs offers is never drawn: 8-GPU pods on a cluster whose
        // only 8-GPU nodes are G2 all name G2
        let no_g3 = vec![n("g2", 8, "G2"), n("t4", 2, "T4")];
        let out = generate(&pods, &no_g3, &[Variation::GpuSpecOpenb(100.0)]).unwrap();
        assert!(out.iter().filter(|p| p.num_gpu == 8).all(|p| p.gpu_spec == "G2"));
        let no_big = vec![n("t4", 2, "T4")];
        let e = generate(&pods, &no_big, &[Variation::GpuSpecOpenb(100.0)]).unwrap_err().to_string();
        assert!(e.contains("gpuspec-openb: no published model list"), "{e}");
    }

    #[test]
    fn gangs_take_their_share_of_gpus_in_whole_groups() {
        let mut pods = base();
        pods.extend((0..10).map(|i| pod(&format!("e{i}"), 8, 1000)));
        let total: f64 = pods.iter().map(gpus_of).sum();
        let out = generate(&pods, &nodes(), &[Variation::Gangs(20.0)]).unwrap();
        let grouped: f64 = out.iter().filter(|p| p.group.is_some()).map(gpus_of).sum();
        // the last group added may overshoot by one group (at most 4 x 8 GPUs), and the last pod
        // dropped by one pod (at most 8 GPUs)
        assert!(grouped >= 0.2 * total && grouped <= 0.2 * total + 40.0, "{grouped} of {total}");
        let out_total: f64 = out.iter().map(gpus_of).sum();
        assert!((out_total - total).abs() <= 40.0, "{out_total} vs {total}");
        let mut groups: BTreeMap<&str, Vec<&TracePod>> = BTreeMap::new();
        for p in out.iter().filter(|p| p.group.is_some()) {
            groups.entry(p.group.as_deref().unwrap_or_default()).or_default().push(p);
        }
        let (mut jobs, mut trials) = (0.0, 0.0);
        for members in groups.values() {
            let whole = members.iter().all(|p| p.num_gpu == 8 && p.milli() == 1000);
            let trial = members.iter().all(|p| p.num_gpu == 1 && p.milli() == TRIAL_MILLI);
            assert!(whole && JOB_SIZES.contains(&members.len()) || trial && members.len() == TRIALS, "{members:?}");
            *if whole { &mut jobs } else { &mut trials } += members.iter().map(|p| gpus_of(p)).sum::<f64>();
        }
        // about half and half in GPUs (each side within one group of the other)
        assert!((jobs - trials).abs() <= 32.0, "jobs {jobs} trials {trials}");
        assert_eq!(out, generate(&pods, &nodes(), &[Variation::Gangs(20.0)]).unwrap(), "deterministic");
        assert!(generate(&base(), &nodes(), &[Variation::Gangs(20.0)]).is_err(), "no 8-GPU pod to copy");
    }

    #[test]
    fn sharing_sets_the_share_of_gpu_pods() {
        let pods = base();
        let gpu_pods = pods.iter().filter(|p| is_gpu(p)).count();
        for pct in [20.0, 80.0] {
            let out = generate(&pods, &nodes(), &[Variation::Sharing(pct)]).unwrap();
            let gpu: Vec<&TracePod> = out.iter().filter(|p| is_gpu(p)).collect();
            assert_eq!(gpu.len(), gpu_pods);
            let shared = gpu.iter().filter(|p| p.milli() < 1000).count();
            assert_eq!(shared, (pct / 100.0 * gpu_pods as f64).round() as usize);
        }
    }
}
