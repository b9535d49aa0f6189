//! The scorer plug-in point: each concern rates a candidate placement from 0.0 (worst) to 1.0 (best),
//! and a [`Profile`](crate::placement::profile::Profile) weighs them, as kube-scheduler's framework does.

use crate::placement::feasibility::Placement;
use crate::placement::mix::WorkloadMix;
use crate::placement::views::GroupView;
use crate::placement::views::ReserveView;
use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::resources::{PackingPolicy, PodRequest};

/// What every scorer may look at besides the node itself.
#[derive(Debug, Clone, Copy)]
pub struct ScoreContext<'a> {
    pub cluster: &'a Cluster,
    pub request: &'a PodRequest,
    /// Node packing policy after per-pod overrides.
    pub node_policy: PackingPolicy,
    /// The typical request mix, for fragmentation.
    pub mix: &'a WorkloadMix,
    /// Now, in Unix milliseconds (utilization samples older than `max_sample_age_ms` are ignored).
    pub now_unix_ms: i64,
    pub max_sample_age_ms: i64,
    /// Where the pod's group stands (`None` for pods without a group).
    pub group: Option<&'a GroupView>,
    /// The reserve classes and which of them are scarce in the cluster right now (a cluster-wide
    /// fact, see `scorers::reserve`).
    pub reserve: &'a ReserveView,
}

/// One concern of node choice.
pub trait Scorer: Send + Sync + std::fmt::Debug {
    /// Short name used in placement logs and profiles.
    fn name(&self) -> &'static str;
    /// 0.0 (worst) ..= 1.0 (best) for putting the pod on `node` as `placement` says.
    fn score(&self, ctx: &ScoreContext<'_>, node: &Node, placement: &Placement) -> f64;
    /// Whether the scorer has anything to say about this pod at all. One that has not is left out of
    /// the weighting for every node alike, so it neither moves nor compresses the others' scores.
    fn applies(&self, _ctx: &ScoreContext<'_>) -> bool {
        true
    }
}
