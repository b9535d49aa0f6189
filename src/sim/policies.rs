//! The scheduling policies the simulator compares: the FGD paper's five baselines and FGD itself,
//! re-implemented from the paper's description, gpuplace's own engine, and kube-scheduler's native
//! DRA placement (`sim::native_dra`).

use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasherDefault;

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::placement::compact::KeyHasher;
use crate::placement::engine::Engine;
use crate::placement::feasibility::Placement;
use crate::placement::group_plan::{plan_group, GroupAsk};
use crate::placement::mix_learner::{typical_gpu_memory_mib, MixLearner};
use crate::placement::profile::{Profile, ProfileConfig};
use crate::sim::native_dra::{first_fit, NativeDra};
use crate::sim::state::{SimNode, SimState};
use crate::sim::trace::TracePod;

/// A policy name as given on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    Random,
    DotProd,
    Clustering,
    Packing,
    BestFit,
    Fgd,
    Gpuplace,
    /// kube-scheduler v1.36 placing pods whose GPUs come from ResourceClaims, without gpuplace.
    NativeDra,
    DraSteer,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 9] = [
        PolicyKind::Random,
        PolicyKind::DotProd,
        PolicyKind::Clustering,
        PolicyKind::Packing,
        PolicyKind::BestFit,
        PolicyKind::Fgd,
        PolicyKind::Gpuplace,
        PolicyKind::NativeDra,
        PolicyKind::DraSteer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Random => "random",
            PolicyKind::DotProd => "dotprod",
            PolicyKind::Clustering => "clustering",
            PolicyKind::Packing => "packing",
            PolicyKind::BestFit => "bestfit",
            PolicyKind::Fgd => "fgd",
            PolicyKind::Gpuplace => "gpuplace",
            PolicyKind::NativeDra => "native-dra",
            PolicyKind::DraSteer => "dra-steer",
        }
    }

    /// The paper's name for the policy in `fgd-paper-results/` (none for gpuplace and native DRA).
    pub fn paper_name(self) -> Option<&'static str> {
        match self {
            PolicyKind::Random => Some("01-Random"),
            PolicyKind::DotProd => Some("02-DotProd"),
            PolicyKind::Clustering => Some("03-GpuClustering"),
            PolicyKind::Packing => Some("04-GpuPacking"),
            PolicyKind::BestFit => Some("05-BestFit"),
            PolicyKind::Fgd => Some("06-FGD"),
            PolicyKind::Gpuplace | PolicyKind::NativeDra | PolicyKind::DraSteer => None,
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        PolicyKind::ALL.into_iter().find(|p| p.name().eq_ignore_ascii_case(s.trim())).ok_or_else(|| {
            let names: Vec<&str> = PolicyKind::ALL.iter().map(|p| p.name()).collect();
            format!("unknown policy {s:?}; choose from {}", names.join(", "))
        })
    }
}

/// Where the `gpuplace` policy's typical request mix comes from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MixSource {
    /// Learned online from the pods that have arrived so far, as the extender learns it
    /// ([`MixLearner`]): what a scheduler can know.
    #[default]
    Learned,
    /// What-if: the whole workload's mix, known before the first pod arrives (FGD's assumption).
    Trace,
}

impl MixSource {
    /// The policy's name in reports: the what-if is labelled as one.
    pub fn policy_name(self) -> &'static str {
        match self {
            MixSource::Learned => "gpuplace",
            MixSource::Trace => "gpuplace(what-if: trace mix)",
        }
    }
}

impl std::str::FromStr for MixSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "learned" => Ok(MixSource::Learned),
            "trace" => Ok(MixSource::Trace),
            other => Err(format!("unknown mix source {other:?}; choose learned or trace")),
        }
    }
}

/// Where a pod goes: node index and GPU indices.
pub type Choice = (usize, Vec<usize>);

/// Keeps the first node with the highest score. The reference simulator's scheduler resolves ties
/// to the first node in list order; with uniform random ties FGD loses about 5 points (its integer
/// scores tie often), so this is part of reproducing the paper.
struct TopPicker {
    best: Option<(i64, usize, Vec<usize>)>,
}

impl TopPicker {
    fn new() -> Self {
        Self { best: None }
    }

    fn offer(&mut self, score: i64, node: usize, gpus: impl FnOnce() -> Vec<usize>) {
        if self.best.as_ref().is_none_or(|(b, _, _)| score > *b) {
            self.best = Some((score, node, gpus()));
        }
    }

    fn take(self) -> Option<Choice> {
        self.best.map(|(_, n, g)| (n, g))
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// FGD's score for a fragmentation change: sigmoid of the decrease in GPUs, as an integer percent.
fn fgd_score(before: f64, after: f64) -> i64 {
    (sigmoid((before - after) / 1000.0) * 100.0) as i64
}

/// A node's score for a pod and the GPUs it would get.
type Scored = (i64, Vec<usize>);

/// (node, request shape) -> (node generation, score and GPUs, `None` where it does not fit).
type ScoreCache = HashMap<(usize, u32), (u64, Option<Scored>), BuildHasherDefault<KeyHasher>>;

/// A policy with its per-run caches.
pub struct Policy {
    kind: PolicyKind,
    engine: Option<Engine>,
    /// Nodes change one at a time, so most evaluations repeat.
    cache: ScoreCache,
    shapes: HashMap<(u64, u64, u32, u32, String), u32>,
    /// The `gpuplace` policy's learner ([`MixSource::Learned`]) and the GPU memory it reads shares by.
    learner: Option<(MixLearner, u64)>,
    /// The `gpuplace` engine's [`Engine::shared_key`] the cached scores were made with.
    shared_key: u64,
    /// Where kube-scheduler's next search for feasible nodes starts (`native-dra`).
    native: NativeDra,
}

impl Policy {
    /// `profile` and `mix` configure the `gpuplace` policy (the others ignore them). FGD always
    /// knows the whole workload's mix in advance, as the paper defines it.
    pub fn new(kind: PolicyKind, state: &SimState, profile: &ProfileConfig, mix: MixSource) -> Self {
        // dra-steer scores nodes with gpuplace's engine too
        let gpuplace = matches!(kind, PolicyKind::Gpuplace | PolicyKind::DraSteer);
        let learner = (gpuplace && mix == MixSource::Learned)
            .then(|| (MixLearner::default(), typical_gpu_memory_mib(&state.cluster)));
        let engine = gpuplace.then(|| {
            let start = match &learner {
                Some((l, _)) => l.mix(),
                None => state.mix.clone(),
            };
            Engine::new(Profile::new(profile.clone()), start)
        });
        Self {
            kind,
            engine,
            cache: ScoreCache::default(),
            shapes: HashMap::new(),
            learner,
            shared_key: 0,
            native: NativeDra::default(),
        }
    }

    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    fn shape(&mut self, pod: &TracePod) -> u32 {
        let key = (pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.milli(), pod.gpu_spec.clone());
        let next = self.shapes.len() as u32;
        *self.shapes.entry(key).or_insert(next)
    }

    /// Chooses a node and GPUs for the pod, or `None` when no node fits.
    pub fn choose(&mut self, state: &SimState, pod: &TracePod, rng: &mut ChaCha8Rng) -> Option<Choice> {
        let models = pod.models();
        let shape = self.shape(pod);
        let mut pick = TopPicker::new();
        match self.kind {
            PolicyKind::Random => {
                let feasible: Vec<usize> =
                    (0..state.nodes.len()).filter(|&i| state.nodes[i].fits(pod, &models)).collect();
                if feasible.is_empty() {
                    return None;
                }
                let node = feasible[rng.random_range(0..feasible.len())];
                let s = &state.nodes[node];
                let milli = pod.milli();
                let gpus = if milli == 0 {
                    Vec::new()
                } else if pod.num_gpu == 1 && milli < 1000 {
                    let fit: Vec<usize> = (0..s.left.len()).filter(|&g| s.left[g] >= milli).collect();
                    vec![fit[rng.random_range(0..fit.len())]]
                } else {
                    s.first_idle(pod.num_gpu)
                };
                return Some((node, gpus));
            }
            PolicyKind::Gpuplace => return self.choose_gpuplace(state, pod, shape, &models),
            PolicyKind::NativeDra => return self.native.choose(state, pod, rng),
            PolicyKind::DraSteer => return self.choose_steered(state, pod, shape, &models),
            _ => {}
        }
        for (i, s) in state.nodes.iter().enumerate() {
            if !s.fits(pod, &models) {
                continue;
            }
            let kind = self.kind;
            let cached = self.cache.get(&(i, shape)).filter(|(g, _)| *g == s.generation).map(|(_, v)| v.clone());
            let (score, gpus) = match cached {
                Some(Some(v)) => v,
                _ => {
                    let v = match kind {
                        PolicyKind::Fgd => fgd(state, i, pod),
                        PolicyKind::DotProd => (dot_prod(s, pod), s.best_fit(pod)),
                        PolicyKind::Clustering => (clustering(s, pod), s.best_fit(pod)),
                        PolicyKind::Packing => packing(s, pod),
                        PolicyKind::BestFit => (best_fit(s, pod), s.best_fit(pod)),
                        PolicyKind::Random | PolicyKind::Gpuplace | PolicyKind::NativeDra | PolicyKind::DraSteer => {
                            unreachable!("handled above")
                        }
                    };
                    self.cache.insert((i, shape), (s.generation, Some(v.clone())));
                    v
                }
            };
            pick.offer(score, i, || gpus);
        }
        pick.take()
    }

    /// Whether the policy places a group whole ([`Policy::plan_group`]): only `gpuplace`, as the
    /// extender does. The others place a group's members one by one, as kube-scheduler would.
    pub fn plans_groups(&self) -> bool {
        self.kind == PolicyKind::Gpuplace
    }

    /// The `gpuplace` policy's place for a whole group (the extender's plan, `placement::group_plan`):
    /// one choice per member, in order, or `None` when no plan holds every member (or the policy
    /// makes no plans, see [`Policy::plans_groups`]).
    pub fn plan_group(&mut self, state: &mut SimState, members: &[TracePod]) -> Option<Vec<Choice>> {
        if !self.plans_groups() {
            return None;
        }
        let reqs: Vec<gpuplace_core::resources::PodRequest> = members
            .iter()
            .map(|p| {
                let req = p.request(&p.name);
                self.observe(&req);
                req
            })
            .collect();
        let engine = self.engine.as_ref()?;
        let key = members.first()?.group.clone().unwrap_or_default();
        let ask = GroupAsk { key: &key, members: &reqs, placed_nodes: &[], required_keys: &[], excluded: &[] };
        let plan = plan_group(engine, &mut state.cluster, &ask, 0).ok()?;
        plan.slots
            .iter()
            .map(|a| Some((state.cluster.node_index(&a.node)?, a.gpus().into_iter().map(|g| g as usize).collect())))
            .collect()
    }

    /// The learner counts an arrived pod before it is placed, as the extender counts a pod at its
    /// first filter.
    fn observe(&mut self, req: &gpuplace_core::resources::PodRequest) {
        if let (Some((learner, gpu_memory)), Some(engine)) = (self.learner.as_mut(), self.engine.as_mut()) {
            learner.observe_request(req, *gpu_memory);
            if let Some(mix) = learner.refreshed(&engine.mix) {
                // a new reserve alone shows in the engine's shared key, when it can move a score
                if mix.entries != engine.mix.entries {
                    self.cache.clear();
                }
                engine.mix = mix;
            }
        }
    }

    /// The pod's request, seen by the learner, with the score cache voided when the cluster-wide
    /// facts changed: scores depend on the whole cluster too (the reserve's scarcity).
    fn engine_request(&mut self, state: &SimState, pod: &TracePod) -> Option<gpuplace_core::resources::PodRequest> {
        let req = pod.request(&pod.name);
        self.observe(&req);
        let key = self.engine.as_ref()?.shared_key(&state.cluster);
        if key != self.shared_key {
            self.shared_key = key;
            self.cache.clear();
        }
        Some(req)
    }

    fn choose_gpuplace(&mut self, state: &SimState, pod: &TracePod, shape: u32, models: &[String]) -> Option<Choice> {
        let req = self.engine_request(state, pod)?;
        let engine = self.engine.as_ref()?;
        let stale: Vec<usize> = (0..state.nodes.len())
            .filter(|&i| state.nodes[i].fits(pod, models) && fresh(&self.cache, state, i, shape).is_none())
            .collect();
        if !stale.is_empty() {
            let ev = engine.evaluate_in_order(&state.cluster, &req, &stale, 0, false);
            for c in &ev.ranked {
                // scores kept at 1e-9 resolution so the cache stays integral and ties are exact
                let v = ((c.total * 1e9).round() as i64, c.gpus().into_iter().map(|g| g as usize).collect());
                self.cache.insert((c.node, shape), (state.nodes[c.node].generation, Some(v)));
            }
            for r in &ev.rejected {
                self.cache.insert((r.node, shape), (state.nodes[r.node].generation, None));
            }
        }
        let mut best: Option<(i64, usize)> = None;
        for (i, s) in state.nodes.iter().enumerate() {
            if !s.fits(pod, models) {
                continue;
            }
            if let Some(Some((score, _))) = fresh(&self.cache, state, i, shape) {
                if best.is_none_or(|(b, _)| *score > b) {
                    best = Some((*score, i));
                }
            }
        }
        let (_, node) = best?;
        let gpus = fresh(&self.cache, state, node, shape).and_then(|v| v.as_ref()).map(|(_, g)| g.clone())?;
        Some((node, gpus))
    }
}

impl Policy {
    /// `dra-steer`: gpuplace steering kube-scheduler's native DRA (issue 32, item 3, the first way
    /// in). gpuplace picks the node, but the DRA allocator then takes the first devices with room
    /// on it ([`first_fit`]); so each feasible node is scored with gpuplace's engine on the placement
    /// the allocator would make there, and the pod gets the best node and that placement. Members
    /// of a group come one by one (no plan), as kube-scheduler sends them.
    fn choose_steered(&mut self, state: &SimState, pod: &TracePod, shape: u32, models: &[String]) -> Option<Choice> {
        let req = self.engine_request(state, pod)?;
        let engine = self.engine.as_ref()?;
        let scoring = engine.scoring(&state.cluster, &req, 0);
        let mut best: Option<(i64, usize)> = None;
        for (i, s) in state.nodes.iter().enumerate() {
            if !s.fits(pod, models) {
                continue;
            }
            let scored = match fresh(&self.cache, state, i, shape).cloned() {
                Some(v) => v,
                None => {
                    let gpus = first_fit(s, pod);
                    let v = engine.place(&state.cluster, &req, i).ok().and_then(|mut p| {
                        retarget(&mut p, &gpus)?;
                        let node = state.cluster.nodes().get(i)?;
                        Some(((scoring.total(node, &p) * 1e9).round() as i64, gpus))
                    });
                    self.cache.insert((i, shape), (s.generation, v.clone()));
                    v
                }
            };
            if let Some((score, _)) = scored {
                if best.is_none_or(|(b, _)| score > b) {
                    best = Some((score, i));
                }
            }
        }
        let (_, node) = best?;
        let gpus = self.cache.get(&(node, shape)).and_then(|(_, v)| v.as_ref()).map(|(_, g)| g.clone())?;
        Some((node, gpus))
    }
}

/// `p` moved onto `gpus` (its app containers' slices in order), as the allocator would place the
/// same request; `None` when the counts differ.
fn retarget(p: &mut Placement, gpus: &[usize]) -> Option<()> {
    for c in p.assignment.containers.iter_mut().filter(|c| !c.init) {
        if c.slices.len() != gpus.len() {
            return None;
        }
        for (s, &g) in c.slices.iter_mut().zip(gpus) {
            s.gpu = u32::try_from(g).ok()?;
        }
    }
    Some(())
}

/// The cached score of node `i` for pod shape `shape`, if the node has not changed since.
fn fresh<'c>(c: &'c ScoreCache, state: &SimState, i: usize, shape: u32) -> Option<&'c Option<Scored>> {
    c.get(&(i, shape)).filter(|(g, _)| *g == state.nodes[i].generation).map(|(_, v)| v)
}

/// FGD: the node and GPU that raise the node's fragmentation least.
fn fgd(state: &SimState, node: usize, pod: &TracePod) -> (i64, Vec<usize>) {
    let s = &state.nodes[node];
    let mix = &state.mix;
    let before = mix.fgd_fragmentation(&s.left, Some(s.cpu_left), &s.model);
    let cpu_after = s.cpu_left - pod.cpu_milli;
    let milli = pod.milli();
    let mut left = s.left.clone();
    if pod.num_gpu == 1 && milli > 0 && milli < 1000 {
        let mut best: Option<(i64, usize)> = None;
        for g in 0..left.len() {
            if left[g] < milli {
                continue;
            }
            left[g] -= milli;
            let sc = fgd_score(before, mix.fgd_fragmentation(&left, Some(cpu_after), &s.model));
            left[g] += milli;
            if best.is_none_or(|(b, _)| sc > b) {
                best = Some((sc, g));
            }
        }
        let (sc, g) = best.unwrap_or((0, 0));
        (sc, vec![g])
    } else {
        let gpus = if milli == 0 { Vec::new() } else { s.first_idle(pod.num_gpu) };
        for &g in &gpus {
            left[g] -= milli.min(left[g]);
        }
        (fgd_score(before, mix.fgd_fragmentation(&left, Some(cpu_after), &s.model)), gpus)
    }
}

/// Tetris-style dot product of free resources and the request (smaller is better).
fn dot_prod(s: &SimNode, pod: &TracePod) -> i64 {
    let node = [s.cpu_left as f64 / 128_000.0, f64::from(s.gpu_left()) / 8000.0];
    let want = [pod.cpu_milli as f64 / 128_000.0, f64::from(pod.milli() * pod.num_gpu) / 8000.0];
    let dot = node[0] * want[0] + node[1] * want[1];
    (100.0 * (1.0 - dot / 2.0)) as i64
}

/// GPU clustering: put pods that ask for the same kind of GPU together.
fn clustering(s: &SimNode, pod: &TracePod) -> i64 {
    let milli = pod.milli();
    if milli == 0 {
        return 0;
    }
    let kind = if pod.num_gpu == 1 && milli < 1000 { 0 } else { pod.num_gpu };
    let mine = s.kinds.get(&kind).copied().unwrap_or(0);
    let others: u32 = s.kinds.iter().filter(|(k, _)| **k != kind).map(|(_, v)| v).sum();
    let base = match (mine > 0, others > 0) {
        (true, false) => 75,
        (true, true) => 50,
        (false, false) => 25,
        (false, true) => 0,
    };
    base + 25 * (8000 - i64::from(s.gpu_left()).min(8000)) / 8000
}

/// GPU packing: prefer partly used GPUs, then nodes with used GPUs, then empty nodes.
fn packing(s: &SimNode, pod: &TracePod) -> (i64, Vec<usize>) {
    let gpus = s.best_fit(pod);
    if pod.milli() == 0 {
        return (0, gpus);
    }
    let n = s.left.len() as i64;
    let idle = s.left.iter().filter(|&&l| l >= 1000).count() as i64;
    let score = if idle == n {
        (33 - idle).max(idle)
    } else {
        let idle_used = gpus.iter().filter(|&&g| s.left[g] >= 1000).count() as i64;
        if idle_used > 0 {
            (50 - idle_used).max(33)
        } else {
            let left: i64 = gpus.iter().map(|&g| i64::from(s.left[g])).sum();
            (100 - (left * 100 / 1000) / 10).max(50)
        }
    };
    (score, gpus)
}

/// Best fit: least CPU and GPU left over after the placement.
fn best_fit(s: &SimNode, pod: &TracePod) -> i64 {
    let cpu = (s.cpu_left - pod.cpu_milli) as f64 / 128_000.0;
    let gpu = f64::from(s.gpu_left() - pod.milli() * pod.num_gpu) / 8000.0;
    (100.0 * (1.0 - (0.5 * cpu + 0.5 * gpu))) as i64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::mix::WorkloadMix;
    use crate::sim::trace::TraceNode;
    use rand::SeedableRng;

    fn share(name: &str, gpu_milli: u32) -> TracePod {
        TracePod {
            name: name.into(),
            cpu_milli: 1000,
            memory_mib: 4096,
            num_gpu: 1,
            gpu_milli,
            gpu_spec: String::new(),
            group: None,
        }
    }

    /// dra-steer picks the node as gpuplace scores it, but always takes the allocator's first GPU
    /// with room there; gpuplace itself may choose another GPU on the node.
    #[test]
    fn dra_steer_takes_the_first_gpu_with_room_on_the_node_gpuplace_scores_best() {
        let nodes: Vec<TraceNode> = (0..3)
            .map(|i| TraceNode {
                name: format!("n{i}"),
                cpu_milli: 96_000,
                memory_mib: 262_144,
                gpu: 4,
                model: "V100M16".into(),
                nvswitch: false,
            })
            .collect();
        let mut state = SimState::new(&nodes, WorkloadMix::default());
        // n1 holds half a GPU on GPU 2: binpacking scorers prefer it for the next share
        state.apply(1, &share("a", 500), &[2]).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut steer = Policy::new(PolicyKind::DraSteer, &state, &ProfileConfig::default(), MixSource::Learned);
        let mut full = Policy::new(PolicyKind::Gpuplace, &state, &ProfileConfig::default(), MixSource::Learned);
        let pod = share("b", 300);
        let (node, gpus) = steer.choose(&state, &pod, &mut rng).unwrap();
        let (full_node, full_gpus) = full.choose(&state, &pod, &mut rng).unwrap();
        assert_eq!(node, full_node, "the same node as gpuplace");
        // the first GPU with room, not the half-used one gpuplace packs onto
        assert_eq!(gpus, first_fit(&state.nodes[node], &pod));
        assert_eq!(gpus, vec![0]);
        assert_eq!((full_node, full_gpus), (1, vec![2]));
        // no node fits: no choice
        state.nodes.iter_mut().for_each(|n| n.left = vec![0; 4]);
        assert!(steer.choose(&state, &pod, &mut rng).is_none());
    }

    #[test]
    fn a_placement_moves_onto_the_gpus_given_or_not_at_all() {
        let mut p = Placement {
            assignment: gpuplace_core::assignment::PodAssignment {
                pod: "ns/p".into(),
                node: "n".into(),
                containers: vec![gpuplace_core::assignment::ContainerAssignment {
                    name: "c".into(),
                    init: false,
                    slices: vec![gpuplace_core::assignment::GpuSlice {
                        gpu: 3,
                        mem_mib: 1,
                        core_pct: 1,
                        exclusive: false,
                    }],
                }],
                cpu_milli: 0,
                memory_mib: 0,
                group: None,
            },
            set_scores: vec![0],
        };
        assert_eq!(retarget(&mut p, &[1]), Some(()));
        assert_eq!(p.gpus(), vec![1]);
        assert_eq!(retarget(&mut p, &[1, 2]), None);
    }
}
