//! A profile: the default policies plus the weighted scorers that rank nodes.

use serde::{Deserialize, Serialize};

use crate::placement::registry::{Weights, REGISTRY};
use crate::placement::scorer::Scorer;
use crate::placement::scorers::packing;
use gpuplace_core::resources::{NumaPolicy, PackingPolicy};

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
        for (r, (_, weight)) in REGISTRY.iter().zip(w.iter()) {
            let is_packing = r.name == packing::NAME;
            // packing stays (at its own weight, possibly 0) while pods may ask for a policy, so
            // the annotation always works
            if usable(weight) || (is_packing && usable(requested)) {
                if is_packing {
                    packing = Some(scorers.len());
                }
                scorers.push(((r.build)(), if weight.is_finite() { weight.max(0.0) } else { 0.0 }));
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
