//! The scorers a profile can weigh, by name: one line per scorer.
//!
//! A scorer is a file in `placement/scorers/` (its `NAME`, its `DEFAULT_WEIGHT` and its [`Scorer`])
//! and one line in [`REGISTRY`]. Profiles, `serve --profile` and `simulate --profile` files, and the
//! placement log all name it by `NAME`; [`Weights`] holds one weight per line here. The order of the
//! lines is the order the engine sums the scorers' parts in, so a new line goes at the end (scores of
//! the others then do not move by a rounding).

use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};

use crate::placement::scorer::Scorer;
use crate::placement::scorers::{
    fragmentation, model_supply, network, numa, packing, reserve, topology, utilization, whole,
};

/// One scorer as profiles know it.
#[derive(Debug, Clone, Copy)]
pub struct Registration {
    pub name: &'static str,
    pub default_weight: f64,
    pub build: fn() -> Box<dyn Scorer>,
}

/// One [`REGISTRY`] line: the scorer's file (its `NAME` and `DEFAULT_WEIGHT`) and its type.
macro_rules! scorer {
    ($file:ident, $scorer:ident) => {
        Registration { name: $file::NAME, default_weight: $file::DEFAULT_WEIGHT, build: || Box::new($file::$scorer) }
    };
}

/// Every scorer, in the order their parts are summed.
pub const REGISTRY: &[Registration] = &[
    scorer!(fragmentation, FragmentationScorer),
    scorer!(packing, PackingScorer),
    scorer!(topology, TopologyScorer),
    scorer!(network, NetworkScorer),
    scorer!(utilization, UtilizationScorer),
    scorer!(reserve, ReserveScorer),
    scorer!(model_supply, ModelSupplyScorer),
    scorer!(whole, WholeScorer),
    scorer!(numa, NumaScorer),
];

/// A name no line of [`REGISTRY`] has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown scorer `{name}` (known: {})", known_names())]
pub struct UnknownScorer {
    pub name: String,
}

fn known_names() -> String {
    REGISTRY.iter().map(|r| r.name).collect::<Vec<_>>().join(", ")
}

/// Where `name` is in [`REGISTRY`].
pub fn position(name: &str) -> Result<usize, UnknownScorer> {
    REGISTRY.iter().position(|r| r.name == name).ok_or_else(|| UnknownScorer { name: name.to_string() })
}

/// Scorer weights by name, one per registered scorer; a weight of 0 switches a scorer off.
///
/// In a profile file it is a map from scorer name to weight (`weights: {whole: 0}`); a scorer left
/// out keeps its default weight, and a name not registered is refused with the known names.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights([f64; REGISTRY.len()]);

impl Default for Weights {
    fn default() -> Self {
        let mut w = [0.0; REGISTRY.len()];
        for (slot, r) in w.iter_mut().zip(REGISTRY) {
            *slot = r.default_weight;
        }
        Self(w)
    }
}

impl Weights {
    /// Every weight 0: no scorer on (a start for profiles that name the few they want).
    pub fn none() -> Self {
        Self([0.0; REGISTRY.len()])
    }

    /// The weight of the scorer called `name`.
    pub fn get(&self, name: &str) -> Result<f64, UnknownScorer> {
        Ok(self.0[position(name)?])
    }

    /// Sets the weight of the scorer called `name`.
    pub fn set(&mut self, name: &str, weight: f64) -> Result<(), UnknownScorer> {
        self.0[position(name)?] = weight;
        Ok(())
    }

    /// These weights with `name`'s set to `weight`, for code that names a scorer by its `NAME`
    /// constant.
    ///
    /// # Panics
    /// On a name not in [`REGISTRY`], which such code cannot write; names read from files go
    /// through [`Weights::set`] instead.
    #[track_caller]
    pub fn with(mut self, name: &str, weight: f64) -> Self {
        if let Err(e) = self.set(name, weight) {
            panic!("{e}");
        }
        self
    }

    /// (name, weight) in [`REGISTRY`]'s order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, f64)> + '_ {
        REGISTRY.iter().zip(self.0.iter()).map(|(r, &w)| (r.name, w))
    }
}

impl Serialize for Weights {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(REGISTRY.len()))?;
        for (name, w) in self.iter() {
            map.serialize_entry(name, &w)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Weights {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ByName;
        impl<'de> Visitor<'de> for ByName {
            type Value = Weights;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "a map from scorer name ({}) to weight", known_names())
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Weights, A::Error> {
                let mut weights = Weights::default();
                while let Some((name, weight)) = map.next_entry::<String, f64>()? {
                    weights.set(&name, weight).map_err(serde::de::Error::custom)?;
                }
                Ok(weights)
            }
        }
        deserializer.deserialize_map(ByName)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_builds_the_scorer_it_names_once() {
        for (i, r) in REGISTRY.iter().enumerate() {
            assert_eq!((r.build)().name(), r.name);
            assert_eq!(position(r.name), Ok(i), "{} registered twice", r.name);
        }
    }

    #[test]
    fn files_name_weights_and_keep_the_defaults_of_those_they_leave_out() {
        let w: Weights = serde_norway::from_str("whole: 0\nnetwork: 4.5\n").unwrap();
        assert_eq!(w.get(whole::NAME), Ok(0.0));
        assert_eq!(w.get(network::NAME), Ok(4.5));
        assert_eq!(w.get(fragmentation::NAME), Ok(fragmentation::DEFAULT_WEIGHT));
        let back: Weights = serde_json::from_str(&serde_json::to_string(&w).unwrap()).unwrap();
        assert_eq!(back, w);
    }

    #[test]
    fn a_profile_file_names_its_weights() {
        // the example of docs/extender-protocol.md, "The profile"
        let text = "name: training\nnode_policy: binpack\ngpu_policy: binpack\nnuma: preferred\n\
                    share_by_fragmentation: true\nmax_sample_age_s: 60\nrequested_packing_weight: 6\n\
                    weights:\n  numa: 2\n  utilization: 0.5\n";
        let p: crate::placement::profile::ProfileConfig = serde_norway::from_str(text).unwrap();
        assert_eq!(p.weights.get(numa::NAME), Ok(2.0));
        assert_eq!(p.weights.get(utilization::NAME), Ok(0.5));
        assert_eq!(p.weights.get(whole::NAME), Ok(whole::DEFAULT_WEIGHT));
        let names: Vec<&str> =
            crate::placement::profile::Profile::new(p).scorers.iter().map(|(s, _)| s.name()).collect();
        assert!(names.contains(&numa::NAME), "{names:?}");
    }

    #[test]
    fn an_unknown_name_is_refused_with_the_known_ones() {
        let err = serde_norway::from_str::<Weights>("wholee: 1\n").unwrap_err().to_string();
        assert!(err.contains("unknown scorer `wholee`"), "{err}");
        assert!(err.contains("fragmentation, packing, topology"), "{err}");
        assert!(Weights::default().set("nope", 1.0).is_err());
    }
}
