//! The placement engine: filter nodes, choose GPUs on each, score with the profile, rank.
//! Pure and deterministic: the same cluster and request always give the same answer.

use crate::core::cluster::{AllocError, Cluster, PodAssignment};
use crate::core::resources::PodRequest;
use crate::placement::feasibility::{place_on_node, GpuChoice, Infeasible, Placement};
use crate::placement::gpu_select::ShareChoice;
use crate::placement::profile::Profile;
use crate::placement::scorer::ScoreContext;
use crate::placement::scorers::fragmentation::WorkloadMix;
use crate::placement::scorers::network::GroupView;

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

/// A feasible node with its GPUs and score.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub node: usize,
    pub placement: Placement,
    pub score: NodeScore,
}

/// A node that was filtered out and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    pub node: usize,
    pub why: Infeasible,
}

/// Filter and score results for one pod over a set of nodes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Evaluation {
    /// Best first; ties by node name.
    pub ranked: Vec<Candidate>,
    pub rejected: Vec<Rejection>,
}

/// The engine: a profile and the workload mix it fights fragmentation for.
#[derive(Debug, Default)]
pub struct Engine {
    pub profile: Profile,
    pub mix: WorkloadMix,
}

impl Engine {
    pub fn new(profile: Profile, mix: WorkloadMix) -> Self {
        Self { profile, mix }
    }

    fn choice<'a>(&'a self, req: &PodRequest) -> GpuChoice<'a> {
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
        let numa = if req.numa == crate::core::resources::NumaPolicy::Preferred { cfg.numa } else { req.numa };
        GpuChoice { policy, numa, share }
    }

    /// Where the pod would go on one node, or why not. No side effects.
    pub fn place(&self, cluster: &Cluster, req: &PodRequest, node: usize) -> Result<Placement, Infeasible> {
        place_on_node(&cluster.nodes()[node], req, &self.choice(req))
    }

    /// Scores a feasible placement.
    pub fn score(
        &self,
        cluster: &Cluster,
        req: &PodRequest,
        node: usize,
        placement: &Placement,
        now_unix_ms: i64,
        group: Option<&GroupView>,
    ) -> NodeScore {
        let ctx = ScoreContext {
            cluster,
            request: req,
            node_policy: req.node_policy.unwrap_or(self.profile.config.node_policy),
            mix: &self.mix,
            now_unix_ms,
            max_sample_age_ms: (self.profile.config.max_sample_age_s as i64).saturating_mul(1000),
            group,
        };
        let n = &cluster.nodes()[node];
        let asked = req.node_policy.is_some();
        let total_w = self.profile.total_weight(asked);
        let mut parts = Vec::with_capacity(self.profile.scorers.len());
        let mut total = 0.0;
        for (s, w) in self.profile.weights_for(asked) {
            let v = s.score(&ctx, n, placement);
            let v = if v.is_finite() { v.clamp(0.0, 1.0) } else { 0.0 };
            let share = if total_w > 0.0 { v * w / total_w } else { 0.0 };
            parts.push((s.name(), share));
            total += share;
        }
        let total = total.clamp(0.0, 1.0);
        NodeScore { total, score: ((total * MAX_NODE_SCORE as f64).round() as i64).clamp(0, MAX_NODE_SCORE), parts }
    }

    /// Filters and scores the given nodes (indices into the cluster).
    pub fn evaluate(&self, cluster: &Cluster, req: &PodRequest, nodes: &[usize], now_unix_ms: i64) -> Evaluation {
        let group = req.group.as_ref().map(|g| GroupView::new(cluster, g));
        let mut ev = Evaluation::default();
        for &i in nodes {
            if i >= cluster.nodes().len() {
                continue;
            }
            match self.place(cluster, req, i) {
                Ok(placement) => {
                    let score = self.score(cluster, req, i, &placement, now_unix_ms, group.as_ref());
                    ev.ranked.push(Candidate { node: i, placement, score });
                }
                Err(why) => ev.rejected.push(Rejection { node: i, why }),
            }
        }
        let nodes = cluster.nodes();
        ev.ranked.sort_by(|a, b| {
            b.score.total.total_cmp(&a.score.total).then_with(|| nodes[a.node].name.cmp(&nodes[b.node].name))
        });
        ev
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
        let Some(best) = ev.ranked.into_iter().next() else {
            return Err(ScheduleError::NoFit(
                ev.rejected.into_iter().map(|r| (cluster.nodes()[r.node].name.clone(), r.why)).collect(),
            ));
        };
        let a = best.placement.assignment;
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
