//! The placement engine: filter nodes, choose GPUs on each, score with the profile, rank.
//! Pure and deterministic: the same cluster and request always give the same answer.

use crate::placement::compact::{self, Outcome, Plan};
use crate::placement::facts::FactsMemo;
use crate::placement::feasibility::{
    place_on_node, reject_cause, reject_reason, Cause, GpuChoice, Infeasible, Placement, Why,
};
use crate::placement::gpu_select::ShareChoice;
use crate::placement::mix::WorkloadMix;
use crate::placement::mix::{BoundDemand, ReserveClass};
use crate::placement::profile::Profile;
use crate::placement::registry::REGISTRY;
use crate::placement::scorer::{Data, ScoreContext, Scorer, Shared};
use crate::placement::scorers::model_supply::{self, SupplyFacts};
use crate::placement::scorers::reserve::{self, ReserveFacts};
use gpuplace_core::assignment::PodAssignment;
use gpuplace_core::cluster::{AllocError, Cluster, Node};
use gpuplace_core::resources::PodRequest;

/// The extender protocol's score range is 0..=10.
pub const MAX_NODE_SCORE: i64 = 10;

/// A node's score with each scorer's weighted share, for placement logs.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeScore {
    /// Weighted mean of the scorers, 0.0..=1.0.
    pub total: f64,
    /// `total` on the extender's 0..=10 scale.
    pub score: i64,
    /// (scorer, weighted contribution to `total`).
    pub parts: Vec<(&'static str, f64)>,
}

/// Best score first, ties by node name. Node names are unique, so integer keys (score bits, name
/// rank) order candidates as comparing scores and names would; sorting 16-byte keys and then building
/// each record in place is cheaper than sorting the records.
fn rank_candidates(cluster: &Cluster, mut found: Vec<(usize, f64, Pick)>) -> Vec<Candidate> {
    let rank = cluster.name_rank();
    let mut keys: Vec<(u64, u32, u32)> = found
        .iter()
        .enumerate()
        .map(|(i, &(node, total, _))| (!total_order_key(total), rank.get(node).copied().unwrap_or(u32::MAX), i as u32))
        .collect();
    keys.sort_unstable();
    keys.iter()
        .filter_map(|&(_, _, i)| {
            let (node, total, pick) = found.get_mut(i as usize)?;
            let pick = std::mem::replace(pick, Pick(PickRepr::One(0)));
            Some(Candidate { node: *node, total: *total, score: scale(*total), pick })
        })
        .collect()
}

/// An unsigned key that sorts as [`f64::total_cmp`] does.
fn total_order_key(x: f64) -> u64 {
    let b = x.to_bits() as i64;
    ((b ^ ((((b >> 63) as u64) >> 1) as i64)) as u64) ^ (1 << 63)
}

/// `total` (0.0..=1.0) on the extender's 0..=10 scale.
fn scale(total: f64) -> i64 {
    round_half_up((total * MAX_NODE_SCORE as f64).clamp(0.0, MAX_NODE_SCORE as f64))
}

/// `x.round() as i64` for `0.0 <= x <= 2^52`, inline: without SSE4.1 in the baseline target,
/// `f64::round` is a library call, once per ranked node. The fraction `x - trunc(x)` is exact there.
fn round_half_up(x: f64) -> i64 {
    let t = x as i64;
    t + i64::from(x - t as f64 >= 0.5)
}

/// The GPUs a pod would get on one node, kept compact: ranking builds one per feasible node, and only
/// the chosen one is usually turned into a [`Placement`].
#[derive(Debug, Clone, PartialEq)]
pub struct Pick(PickRepr);

#[derive(Debug, Clone, PartialEq)]
enum PickRepr {
    /// A pod of one container (the common case): its GPUs as a bitmask.
    One(u64),
    /// One bitmask per container: app containers, then init containers, in spec order.
    Masks(Box<[u64]>),
    /// Nodes too large for bitmasks keep the general path's record.
    Placed(Box<Placement>),
}

impl Pick {
    fn from_masks(masks: &[u64]) -> Self {
        match masks {
            [one] => Pick(PickRepr::One(*one)),
            _ => Pick(PickRepr::Masks(masks.into())),
        }
    }

    /// The per-container masks (none for a general-path record).
    fn masks(&self) -> &[u64] {
        match &self.0 {
            PickRepr::One(m) => std::slice::from_ref(m),
            PickRepr::Masks(m) => m,
            PickRepr::Placed(_) => &[],
        }
    }

    /// Every GPU index any container uses, ascending (as [`Placement::gpus`]).
    pub fn gpus(&self) -> Vec<u32> {
        match &self.0 {
            PickRepr::Placed(p) => p.gpus(),
            _ => compact::bits(self.masks().iter().fold(0, |a, m| a | m)).map(|g| g as u32).collect(),
        }
    }
}

/// A feasible node with its GPUs and score.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub node: usize,
    /// Weighted mean of the scorers, 0.0..=1.0 (each scorer's part: [`Engine::score`]).
    pub total: f64,
    /// `total` on the extender's 0..=10 scale.
    pub score: i64,
    pub pick: Pick,
}

impl Candidate {
    /// Every GPU index the pod would use.
    pub fn gpus(&self) -> Vec<u32> {
        self.pick.gpus()
    }

    /// The full allocation record, for the `cluster` and `req` this candidate was evaluated for
    /// (`None` when the node is not in `cluster`).
    pub fn placement(&self, cluster: &Cluster, req: &PodRequest) -> Option<Placement> {
        let node = cluster.nodes().get(self.node)?;
        Some(match &self.pick.0 {
            PickRepr::Placed(p) => (**p).clone(),
            _ => {
                let mut p = compact::blank_placement(req);
                compact::fill_placement(&mut p, node, req, self.pick.masks());
                p
            }
        })
    }
}

/// A node that was filtered out. Its cause is worked out on demand by [`Engine::classify_rejection`]
/// and its detail by [`Engine::explain`]: rejections can be thousands per pod, and their detail is
/// rarely read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rejection {
    pub node: usize,
    /// Would not fit even on the emptied node: preemption cannot help.
    pub unresolvable: bool,
}

/// Filter and score results for one pod over a set of nodes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Evaluation {
    /// Best first; ties by node name.
    pub ranked: Vec<Candidate>,
    pub rejected: Vec<Rejection>,
}

/// The engine: a profile and the workload mix it fights fragmentation for.
#[derive(Debug)]
pub struct Engine {
    pub profile: Profile,
    pub mix: WorkloadMix,
    /// The scorers' cluster-wide facts, by name, per cluster state (see [`Engine::shared_key`]).
    facts: FactsMemo,
}

impl Default for Engine {
    fn default() -> Self {
        Self::new(Profile::default(), WorkloadMix::default())
    }
}

/// The scorers' weights for one pod: which of them apply ([`Scorer::applies`]) and their sum.
#[derive(Debug, Clone, Copy)]
struct Weighting {
    /// Bit `i` set: the profile's scorer `i` is left out.
    skip: u64,
    total: f64,
}

/// One pod's scoring, prepared by [`Engine::scoring`].
pub struct Scoring<'a> {
    engine: &'a Engine,
    ctx: ScoreContext<'a>,
    /// Per scorer of the profile (in its order), the data it prepared.
    data: Vec<Option<Shared>>,
    weighting: Weighting,
}

impl Scoring<'_> {
    /// Weighted mean of the scorers that apply; `part` sees each scorer with its weighted share (0
    /// for one left out).
    fn weigh(&self, node: &Node, placement: &Placement, mut part: impl FnMut(&dyn Scorer, f64)) -> f64 {
        let ctx = &self.ctx;
        let asked = ctx.request.node_policy.is_some();
        let total_w = self.weighting.total;
        let mut total = 0.0;
        for (i, ((s, w), d)) in self.engine.profile.weights_for(asked).zip(&self.data).enumerate() {
            if i < 64 && (self.weighting.skip >> i) & 1 == 1 {
                part(s, 0.0);
                continue;
            }
            let v = s.score(ctx, Data::of(d.as_ref()), node, placement);
            let v = if v.is_finite() { v.clamp(0.0, 1.0) } else { 0.0 };
            let share = if total_w > 0.0 { v * w / total_w } else { 0.0 };
            part(s, share);
            total += share;
        }
        total.clamp(0.0, 1.0)
    }

    /// The weighted mean of the scorers that apply for `placement` on `node`.
    pub fn total(&self, node: &Node, placement: &Placement) -> f64 {
        self.weigh(node, placement, |_, _| {})
    }

    /// [`Scoring::total`] with each scorer's part, for node `node` of the cluster (0 for a node
    /// not in it).
    pub fn score(&self, node: usize, placement: &Placement) -> NodeScore {
        let Some(n) = self.ctx.cluster.nodes().get(node) else {
            return NodeScore { total: 0.0, score: 0, parts: Vec::new() };
        };
        let mut parts = Vec::with_capacity(self.data.len());
        let total = self.weigh(n, placement, |s, share| parts.push((s.name(), share)));
        NodeScore { total, score: scale(total), parts }
    }
}

impl Engine {
    pub fn new(profile: Profile, mix: WorkloadMix) -> Self {
        // every registered scorer's facts, weighted or not: `/inspect` reports them all
        let facts = REGISTRY.iter().filter_map(|r| Some((r.name, (r.build)().facts()?))).collect();
        Self { profile, mix, facts: FactsMemo::new(facts) }
    }

    /// What a node's verdict depends on besides the request, the node itself ([`Node::generation`])
    /// and the clock: the scorers' cluster-wide facts ([`Scorer::facts`]: which reserve classes
    /// are scarce, which model lists short, which switches whole). A cache of per-node verdicts must
    /// hold this key too, and drop what it keeps when the key changes. Cheap: only nodes whose stamp
    /// changed since the last call are looked at.
    pub fn shared_key(&self, cluster: &Cluster) -> u64 {
        self.facts.snapshot(cluster, &self.mix).key
    }

    /// The reserve classes of `scorers::reserve` in `cluster` (the mix's and the inventory's), each
    /// with its free hosts now and whether it is scarce (what `/inspect` shows).
    pub fn reserve_classes(&self, cluster: &Cluster) -> Vec<(ReserveClass, u32, bool)> {
        let read = ReserveFacts::classes_with_hosts;
        self.facts.read(cluster, &self.mix, reserve::NAME, read).unwrap_or_default()
    }

    /// The model lists of `scorers::model_supply` in `cluster`, each with the GPUs its pods could
    /// use now (thousandths) and whether it is short (what `/inspect` shows).
    pub fn model_lists(&self, cluster: &Cluster) -> Vec<(BoundDemand, u64, bool)> {
        let read = SupplyFacts::lists_with_supply;
        self.facts.read(cluster, &self.mix, model_supply::NAME, read).unwrap_or_default()
    }

    /// How GPUs are picked for this pod (profile defaults after the pod's overrides).
    pub fn gpu_choice<'a>(&'a self, req: &PodRequest) -> GpuChoice<'a> {
        let cfg = &self.profile.config;
        let policy = req.gpu_policy.unwrap_or(cfg.gpu_policy);
        let share = if req.gpu_policy.is_none() && cfg.share_by_fragmentation && !self.mix.is_empty() {
            ShareChoice::Fragmentation {
                mix: &self.mix,
                host_cpu_milli: req.cpu_milli,
                host_memory_mib: req.memory_mib,
            }
        } else {
            ShareChoice::Pack(policy)
        };
        let numa = if req.numa == gpuplace_core::resources::NumaPolicy::Preferred { cfg.numa } else { req.numa };
        GpuChoice { policy, numa, share }
    }

    /// Where the pod would go on one node, or why not. No side effects.
    pub fn place(&self, cluster: &Cluster, req: &PodRequest, node: usize) -> Result<Placement, Infeasible> {
        let Some(n) = cluster.nodes().get(node) else {
            return Err(Infeasible::Unresolvable(Why::new(Cause::UnknownNode, format!("no node with index {node}"))));
        };
        let plan = Plan::new(req, self.gpu_choice(req));
        let mut sc = compact::Scratch::new();
        if compact::with_memo(|memo| compact::place(n, &plan, memo, &mut sc)) == Outcome::Fits {
            let mut p = compact::blank_placement(req);
            compact::fill_placement(&mut p, n, req, &sc.masks);
            return Ok(p);
        }
        // rejected (the general path writes the reason) or too large for the compact path
        place_on_node(n, req, &plan.how)
    }

    /// Why the pod does not fit on a node (`None` when it does).
    pub fn explain(&self, cluster: &Cluster, req: &PodRequest, node: usize) -> Option<Infeasible> {
        self.place(cluster, req, node).err()
    }

    /// Why the pod does not fit on a node that [`Engine::evaluate`] rejected: the same answer as
    /// [`Engine::explain`], cheaper, as the evaluation already classified the rejection (filter writes
    /// a reason for every rejected node, thousands per pod in a large cluster).
    pub fn explain_rejection(&self, cluster: &Cluster, req: &PodRequest, r: &Rejection) -> Option<Infeasible> {
        let node = cluster.nodes().get(r.node)?;
        reject_reason(node, req, &self.gpu_choice(req), r.unresolvable).or_else(|| self.explain(cluster, req, r.node))
    }

    /// [`Engine::explain_rejection`] without the detail (usually left empty): the cause and the
    /// classification, which is what kube-scheduler is told, for every rejected node.
    pub fn classify_rejection(&self, cluster: &Cluster, req: &PodRequest, r: &Rejection) -> Option<Infeasible> {
        let node = cluster.nodes().get(r.node)?;
        reject_cause(node, req, &self.gpu_choice(req), r.unresolvable).or_else(|| self.explain(cluster, req, r.node))
    }

    /// One pod's scoring, prepared once before its nodes are scored (kube-scheduler's PreScore):
    /// each scorer's data, looked up by the scorer's name, and which scorers apply.
    pub fn scoring<'a>(&'a self, cluster: &'a Cluster, req: &'a PodRequest, now_unix_ms: i64) -> Scoring<'a> {
        let ctx = ScoreContext {
            cluster,
            request: req,
            node_policy: req.node_policy.unwrap_or(self.profile.config.node_policy),
            mix: &self.mix,
            now_unix_ms,
            max_sample_age_ms: self.max_sample_age_ms(),
        };
        let facts = self.facts.snapshot(cluster, &self.mix);
        let data: Vec<Option<Shared>> =
            self.profile.scorers.iter().map(|(s, _)| s.prepare(&ctx, facts.get(s.name()))).collect();
        let weighting = self.weighting(&ctx, &data);
        Scoring { engine: self, ctx, data, weighting }
    }

    /// Which scorers count for the pod of `ctx`, and their total weight (the sum is taken in the
    /// profile's order, as it always was, so scores do not move by a rounding when all apply).
    fn weighting(&self, ctx: &ScoreContext<'_>, data: &[Option<Shared>]) -> Weighting {
        let asked = ctx.request.node_policy.is_some();
        let mut skip = 0u64;
        let mut total = 0.0;
        for (i, ((s, w), d)) in self.profile.weights_for(asked).zip(data).enumerate() {
            if i < 64 && !s.applies(ctx, Data::of(d.as_ref())) {
                skip |= 1 << i;
            } else {
                total += w;
            }
        }
        Weighting { skip, total }
    }

    fn max_sample_age_ms(&self) -> i64 {
        i64::try_from(self.profile.config.max_sample_age_s).unwrap_or(i64::MAX).saturating_mul(1000)
    }

    /// When (Unix ms, `[from, until)`) a verdict on `node` made at `now` for a pod without a group
    /// still holds, as far as the clock goes: the node's utilization samples keep their freshness
    /// throughout. Such a verdict depends on nothing else but the request, the node's state (its
    /// [`Node::generation`]) and [`Engine::shared_key`]: feasibility and every scorer but the group's
    /// network locality and the reserve's scarcity read the node alone.
    pub fn verdict_window(&self, node: &Node, now: i64) -> (i64, i64) {
        crate::placement::scorers::utilization::stable_window(node, now, self.max_sample_age_ms())
    }

    /// Scores a feasible placement, with each scorer's part (0 for a node not in `cluster`). To
    /// score several nodes for one pod, prepare once with [`Engine::scoring`].
    pub fn score(
        &self,
        cluster: &Cluster,
        req: &PodRequest,
        node: usize,
        placement: &Placement,
        now_unix_ms: i64,
    ) -> NodeScore {
        self.scoring(cluster, req, now_unix_ms).score(node, placement)
    }

    /// Filters and scores the given nodes (indices into the cluster; others are skipped).
    pub fn evaluate(&self, cluster: &Cluster, req: &PodRequest, nodes: &[usize], now_unix_ms: i64) -> Evaluation {
        self.evaluate_in_order(cluster, req, nodes, now_unix_ms, true)
    }

    /// [`Engine::evaluate`], leaving `ranked` in the order of `nodes` unless `rank` is set: the
    /// extender's filter and prioritize answer per node and only need the order for placement logs.
    pub fn evaluate_in_order(
        &self,
        cluster: &Cluster,
        req: &PodRequest,
        nodes: &[usize],
        now_unix_ms: i64,
        rank: bool,
    ) -> Evaluation {
        let scoring = self.scoring(cluster, req, now_unix_ms);
        let plan = Plan::new(req, self.gpu_choice(req));
        // one record, refilled per node, is what the scorers see
        let mut scratch = compact::blank_placement(req);
        let mut sc = compact::Scratch::new();
        let mut found = Vec::with_capacity(nodes.len());
        let mut rejected = Vec::new();
        compact::with_memo(|memo| {
            for &i in nodes {
                let Some(node) = cluster.nodes().get(i) else { continue };
                let (total, pick) = match compact::place(node, &plan, memo, &mut sc) {
                    Outcome::Fits => {
                        compact::fill_placement(&mut scratch, node, req, &sc.masks);
                        (scoring.total(node, &scratch), Pick::from_masks(&sc.masks))
                    }
                    Outcome::Rejected { unresolvable } => {
                        rejected.push(Rejection { node: i, unresolvable });
                        continue;
                    }
                    Outcome::TooLarge => match place_on_node(node, req, &plan.how) {
                        Ok(p) => (scoring.total(node, &p), Pick(PickRepr::Placed(Box::new(p)))),
                        Err(why) => {
                            rejected.push(Rejection { node: i, unresolvable: why.is_unresolvable() });
                            continue;
                        }
                    },
                };
                found.push((i, total, pick));
            }
        });
        let ranked = if rank {
            rank_candidates(cluster, found)
        } else {
            found.into_iter().map(|(node, total, pick)| Candidate { node, total, score: scale(total), pick }).collect()
        };
        Evaluation { ranked, rejected }
    }

    /// Evaluates every node of the cluster.
    pub fn evaluate_all(&self, cluster: &Cluster, req: &PodRequest, now_unix_ms: i64) -> Evaluation {
        let all: Vec<usize> = (0..cluster.nodes().len()).collect();
        self.evaluate(cluster, req, &all, now_unix_ms)
    }

    /// Places the pod on the best node and counts the allocation.
    pub fn schedule(
        &self,
        cluster: &mut Cluster,
        req: &PodRequest,
        now_unix_ms: i64,
    ) -> Result<PodAssignment, ScheduleError> {
        let ev = self.evaluate_all(cluster, req, now_unix_ms);
        let Some(a) = ev.ranked.first().and_then(|best| best.placement(cluster, req)).map(|p| p.assignment) else {
            return Err(ScheduleError::NoFit(
                ev.rejected
                    .iter()
                    .filter_map(|r| {
                        Some((cluster.nodes().get(r.node)?.name.clone(), self.explain(cluster, req, r.node)?))
                    })
                    .collect(),
            ));
        };
        cluster.allocate(a.clone()).map_err(ScheduleError::Alloc)?;
        Ok(a)
    }
}

/// Why a pod could not be scheduled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScheduleError {
    #[error("no node fits ({} rejected)", .0.len())]
    NoFit(Vec<(String, Infeasible)>),
    #[error(transparent)]
    Alloc(AllocError),
}

#[cfg(test)]
mod tests {
    use super::total_order_key;

    #[test]
    fn inline_rounding_matches_f64_round() {
        let mut x = 0.0f64;
        while x <= 10.0 {
            // x and its neighbours (no next_up in the minimum supported Rust)
            let up = f64::from_bits(x.to_bits() + 1);
            let down = if x > 0.0 { f64::from_bits(x.to_bits() - 1) } else { 0.0 };
            for y in [x, up, down] {
                assert_eq!(super::round_half_up(y), y.round() as i64, "{y}");
            }
            x += 0.0005;
        }
        for y in [0.49999999999999994, 0.5, 2.5, 9.5, 9.999999999999998, 10.0] {
            assert_eq!(super::round_half_up(y), y.round() as i64, "{y}");
        }
    }

    #[test]
    fn order_key_sorts_as_total_cmp() {
        let xs = [f64::NEG_INFINITY, -1.0, -1e-300, -0.0, 0.0, 1e-300, 0.1, 0.5, 1.0, f64::INFINITY, f64::NAN];
        for a in xs {
            for b in xs {
                assert_eq!(total_order_key(a).cmp(&total_order_key(b)), a.total_cmp(&b), "{a} {b}");
            }
        }
    }
}
