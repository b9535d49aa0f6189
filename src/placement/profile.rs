//! A profile: the default policies plus the weighted scorers that rank nodes.

use serde::{Deserialize, Serialize};

use crate::core::resources::{NumaPolicy, PackingPolicy};
use crate::placement::scorer::Scorer;
use crate::placement::scorers::{
    fragmentation::FragmentationScorer, model_supply::ModelSupplyScorer, network::NetworkScorer,
    packing::PackingScorer, reserve::ReserveScorer, topology::TopologyScorer, utilization::UtilizationScorer,
    whole::WholeScorer,
};

/// Scorer weights; a weight of 0 switches a scorer off.
///
/// Packing is only a tie-break by default: on the Alibaba trace even a weight of 0.1 next to
/// fragmentation's 6 costs half a point of unallocated GPUs (docs/performance.md), because
/// consolidating nodes and avoiding fragments pull apart. A pod that asks for `binpack` or `spread`
/// gets [`ProfileConfig::requested_packing_weight`] instead.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Weights {
    pub fragmentation: f64,
    pub packing: f64,
    pub topology: f64,
    pub network: f64,
    pub utilization: f64,
    /// Keeping back the last free hosts of the largest requests seen (`scorers::reserve`). It counts
    /// only for pods that would take one; high, so that such a pod goes elsewhere whenever it can.
    pub reserve: f64,
    /// Keeping the GPUs of a model whose free GPUs run short for the pods bound to it
    /// (`scorers::model_supply`). It counts only for pods that could run elsewhere.
    pub model_supply: f64,
    /// Keeping whole nodes, ToRs and spines for the node-sized pods and jobs the cluster is built
    /// for (`scorers::whole`): a pod breaks one only when no broken node takes it. High, so that
    /// live utilization or a fragmentation tie never spreads shares over empty nodes.
    pub whole: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self {
            fragmentation: 6.0,
            packing: 0.01,
            topology: 2.0,
            network: 3.0,
            utilization: 1.0,
            reserve: 6.0,
            model_supply: 6.0,
            whole: 6.0,
        }
    }
}

/// Policies and weights, as written in a config file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProfileConfig {
    pub name: String,
    pub node_policy: PackingPolicy,
    pub gpu_policy: PackingPolicy,
    pub numa: NumaPolicy,
    /// Place single-GPU shares on the GPU that fragments the node least (else by `gpu_policy`).
    pub share_by_fragmentation: bool,
    /// Utilization samples older than this are ignored.
    pub max_sample_age_s: u64,
    pub weights: Weights,
    /// Packing weight for a pod whose `gpuplace.io/node-policy` annotation asks for binpack or
    /// spread: the pod's explicit wish outranks the profile's tie-break.
    pub requested_packing_weight: f64,
}

impl Default for ProfileConfig {
    fn default() -> Self {
        Self {
            name: "gpuplace".into(),
            node_policy: PackingPolicy::Binpack,
            gpu_policy: PackingPolicy::Binpack,
            numa: NumaPolicy::Preferred,
            share_by_fragmentation: true,
            max_sample_age_s: 60,
            weights: Weights::default(),
            requested_packing_weight: 6.0,
        }
    }
}

/// A ready-to-use profile.
#[derive(Debug)]
pub struct Profile {
    pub config: ProfileConfig,
    pub scorers: Vec<(Box<dyn Scorer>, f64)>,
    /// Index of the packing scorer in `scorers` (its weight changes with the pod's node policy).
    packing: Option<usize>,
}

impl Profile {
    pub fn new(config: ProfileConfig) -> Self {
        let w = config.weights;
        let usable = |w: f64| w > 0.0 && w.is_finite();
        let requested = config.requested_packing_weight;
        let mut scorers: Vec<(Box<dyn Scorer>, f64)> = Vec::new();
        let mut packing = None;
        for (s, weight) in [
            (Box::new(FragmentationScorer) as Box<dyn Scorer>, w.fragmentation),
            (Box::new(PackingScorer), w.packing),
            (Box::new(TopologyScorer), w.topology),
            (Box::new(NetworkScorer), w.network),
            (Box::new(UtilizationScorer), w.utilization),
            (Box::new(ReserveScorer), w.reserve),
            (Box::new(ModelSupplyScorer), w.model_supply),
            (Box::new(WholeScorer), w.whole),
        ] {
            let is_packing = s.name() == PackingScorer.name();
            // packing stays (at its own weight, possibly 0) while pods may ask for a policy, so
            // the annotation always works
            if usable(weight) || (is_packing && usable(requested)) {
                if is_packing {
                    packing = Some(scorers.len());
                }
                scorers.push((s, if weight.is_finite() { weight.max(0.0) } else { 0.0 }));
            }
        }
        Self { config, scorers, packing }
    }

    /// The scorers' weights for a pod: the profile's, with packing raised when the pod asked for a
    /// node policy.
    pub fn weights_for(&self, pod_asked_node_policy: bool) -> impl Iterator<Item = (&dyn Scorer, f64)> + '_ {
        let raise = pod_asked_node_policy && self.config.requested_packing_weight.is_finite();
        self.scorers.iter().enumerate().map(move |(i, (s, w))| {
            let w = if raise && Some(i) == self.packing { w.max(self.config.requested_packing_weight) } else { *w };
            (s.as_ref(), w)
        })
    }

    /// gpuplace's default profile.
    pub fn gpuplace() -> Self {
        Self::new(ProfileConfig::default())
    }

    /// Sum of the weights a pod is scored with when every scorer applies (one that has nothing to
    /// say about a pod, `Scorer::applies`, is left out of it then).
    pub fn total_weight(&self, pod_asked_node_policy: bool) -> f64 {
        self.weights_for(pod_asked_node_policy).map(|(_, w)| w).sum()
    }
}

impl Default for Profile {
    fn default() -> Self {
        Self::gpuplace()
    }
}
