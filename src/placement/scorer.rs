//! The scorer plug-in point: each concern rates a candidate placement from 0.0 (worst) to 1.0 (best),
//! and a [`Profile`](crate::placement::profile::Profile) weighs them, as kube-scheduler's framework does.
//!
//! A scorer that reads more of the cluster than the node it scores keeps that data itself, as
//! kube-scheduler's plugins keep theirs in the cycle state under their own name:
//! - [`Scorer::facts`]: cluster-wide facts kept per cluster state (which reserve classes are scarce,
//!   which switches are whole), updated by the engine only for the nodes that changed;
//! - [`Scorer::prepare`]: its data for one pod, worked out once before the nodes are scored
//!   (kube-scheduler's PreScore), from those facts or from the cluster (where a group's pods are).
//!
//! The engine looks both up by the scorer's name and hands each scorer its own ([`Data`]): a new
//! scorer with data of its own is still one file and one line in the registry.

use std::any::Any;
use std::sync::Arc;

use crate::placement::feasibility::Placement;
use crate::placement::mix::WorkloadMix;
use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::resources::{PackingPolicy, PodRequest};

/// What every scorer may look at besides the node itself and its own [`Data`].
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
}

/// A scorer's data, of its own type, shared without a copy between the facts that keep it and the
/// pods that read it.
pub type Shared = Arc<dyn Any + Send + Sync>;

/// The data a scorer prepared for the pod being scored (nothing for most scorers).
#[derive(Clone, Copy, Default)]
pub struct Data<'a>(Option<&'a (dyn Any + Send + Sync)>);

impl<'a> Data<'a> {
    /// Nothing prepared.
    pub const NONE: Data<'static> = Data(None);

    pub fn of(shared: Option<&'a Shared>) -> Self {
        Data(shared.map(|s| &**s))
    }

    /// The data as the scorer's own type (`None` when nothing or something else was prepared).
    pub fn get<T: Any>(self) -> Option<&'a T> {
        self.0?.downcast_ref()
    }
}

impl std::fmt::Debug for Data<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Data(..)" } else { "Data(none)" })
    }
}

/// Cluster-wide facts one scorer reads, kept per cluster state. The engine brings them up to date
/// ([`FactsMemo`](crate::placement::facts::FactsMemo)): from scratch when the node layout or a
/// node's GPUs or host CPU change (what the node inventory's classes and lists read) or they say
/// they are stale, else node by node for the nodes whose stamp changed.
pub trait Facts: Send + std::fmt::Debug {
    /// Whether they must be worked out anew for `mix` or `cluster` (what they were built from
    /// changed in a way a node's update does not cover).
    fn stale(&self, cluster: &Cluster, mix: &WorkloadMix) -> bool;
    /// Worked out from scratch.
    fn rebuild(&mut self, cluster: &Cluster, mix: &WorkloadMix);
    /// Node `i` of `cluster` changed. `false` when only a rebuild will do.
    fn update(&mut self, cluster: &Cluster, i: usize) -> bool;
    /// What the scorer reads now, and a key that differs whenever its scores may (verdict caches
    /// hold it: [`Engine::shared_key`](crate::placement::engine::Engine::shared_key)).
    fn snapshot(&mut self) -> (Shared, u64);
    /// For reports that read more of them than the scorer does (`/inspect`).
    fn as_any(&self) -> &dyn Any;
}

/// One concern of node choice.
pub trait Scorer: Send + Sync + std::fmt::Debug {
    /// Short name used in placement logs and profiles.
    fn name(&self) -> &'static str;
    /// The cluster-wide facts it reads, fresh (the engine keeps them); `None` for a scorer that
    /// reads the node alone.
    fn facts(&self) -> Option<Box<dyn Facts>> {
        None
    }
    /// Its data for the pod of `ctx`, worked out once before the nodes are scored; by default its
    /// facts as they stand.
    fn prepare(&self, _ctx: &ScoreContext<'_>, facts: Option<&Shared>) -> Option<Shared> {
        facts.cloned()
    }
    /// 0.0 (worst) ..= 1.0 (best) for putting the pod on `node` as `placement` says.
    fn score(&self, ctx: &ScoreContext<'_>, data: Data<'_>, node: &Node, placement: &Placement) -> f64;
    /// Whether the scorer has anything to say about this pod at all. One that has not is left out of
    /// the weighting for every node alike, so it neither moves nor compresses the others' scores.
    fn applies(&self, _ctx: &ScoreContext<'_>, _data: Data<'_>) -> bool {
        true
    }
}
