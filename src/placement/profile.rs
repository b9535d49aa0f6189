//! A profile: the default policies plus the weighted scorers that rank nodes.

use serde::{Deserialize, Serialize};

use crate::core::resources::{NumaPolicy, PackingPolicy};
use crate::placement::scorer::Scorer;
use crate::placement::scorers::{
    fragmentation::FragmentationScorer, network::NetworkScorer, packing::PackingScorer, topology::TopologyScorer,
    utilization::UtilizationScorer,
};

/// Scorer weights; a weight of 0 switches a scorer off.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Weights {
    pub fragmentation: f64,
    pub packing: f64,
    pub topology: f64,
    pub network: f64,
    pub utilization: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self { fragmentation: 6.0, packing: 1.0, topology: 2.0, network: 3.0, utilization: 1.0 }
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
        }
    }
}

/// A ready-to-use profile.
#[derive(Debug)]
pub struct Profile {
    pub config: ProfileConfig,
    pub scorers: Vec<(Box<dyn Scorer>, f64)>,
}

impl Profile {
    pub fn new(config: ProfileConfig) -> Self {
        let w = config.weights;
        let all: Vec<(Box<dyn Scorer>, f64)> = vec![
            (Box::new(FragmentationScorer), w.fragmentation),
            (Box::new(PackingScorer), w.packing),
            (Box::new(TopologyScorer), w.topology),
            (Box::new(NetworkScorer), w.network),
            (Box::new(UtilizationScorer), w.utilization),
        ];
        let scorers = all.into_iter().filter(|(_, w)| *w > 0.0 && w.is_finite()).collect();
        Self { config, scorers }
    }

    /// gpuplace's default profile.
    pub fn gpuplace() -> Self {
        Self::new(ProfileConfig::default())
    }

    pub fn total_weight(&self) -> f64 {
        self.scorers.iter().map(|(_, w)| w).sum()
    }
}

impl Default for Profile {
    fn default() -> Self {
        Self::gpuplace()
    }
}
