//! How a node makes a GPU share's limits hold (docs/isolation.md): the mode its device plugin runs
//! in, published with the node's inventory, and what a pod may require of it.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What enforces a share's memory and compute on a node, strongest first.
///
/// - `driver-limits`: the driver caps each container's memory itself (recent drivers, non-MIG).
/// - `mps`: the node's device plugin runs the MPS control daemon; the MPS server caps each client's
///   pinned memory and SM share, and the guard backs up what a client could escape.
/// - `guard`: the plugin's guard samples each GPU's processes and kills one that holds more memory
///   than its container was granted, after a short grace; compute overuse is reported.
/// - `advisory`: limits are accounted by the scheduler, nothing on the node enforces them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IsolationMode {
    DriverLimits,
    Mps,
    Guard,
    Advisory,
}

impl IsolationMode {
    pub const ALL: [IsolationMode; 4] = [Self::DriverLimits, Self::Mps, Self::Guard, Self::Advisory];

    pub fn name(self) -> &'static str {
        match self {
            Self::DriverLimits => "driver-limits",
            Self::Mps => "mps",
            Self::Guard => "guard",
            Self::Advisory => "advisory",
        }
    }

    /// Whether a share that overruns its memory grant is stopped (by the driver, MPS or the guard)
    /// rather than left to fail its neighbours.
    pub fn enforces_memory(self) -> bool {
        self != Self::Advisory
    }
}

impl fmt::Display for IsolationMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The pod annotation that requires an isolation mode: `enforced` (any mode that enforces memory:
/// driver-limits, mps or guard) or a comma list of accepted modes (`mps,driver-limits`). A node
/// whose published mode is not accepted is turned down; one that publishes none counts as
/// `advisory`.
pub const ANNOTATION_ISOLATION: &str = "gpuplace.io/isolation";

/// What [`ANNOTATION_ISOLATION`] accepts, as its error messages say it.
pub const REQUIREMENT_SYNTAX: &str =
    "enforced, or a comma-separated list of driver-limits, mps, guard, advisory (e.g. mps,driver-limits)";

/// The modes a pod's [`ANNOTATION_ISOLATION`] value accepts, strongest first, each once; `Err` with
/// the value for anything else (an empty list included).
pub fn parse_requirement(value: &str) -> Result<Vec<IsolationMode>, UnknownMode> {
    let v = value.trim().to_ascii_lowercase();
    let mut modes: Vec<IsolationMode> = if v == "enforced" {
        IsolationMode::ALL.into_iter().filter(|m| m.enforces_memory()).collect()
    } else {
        let mut out = Vec::new();
        for part in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            out.push(part.parse().map_err(|_| UnknownMode(value.to_string()))?);
        }
        out
    };
    if modes.is_empty() {
        return Err(UnknownMode(value.to_string()));
    }
    modes.sort();
    modes.dedup();
    Ok(modes)
}

/// Whether a node that publishes `node` (`None`: nothing, read as advisory) satisfies a pod that
/// accepts `accepted` (empty: any mode).
#[inline]
pub fn satisfies(accepted: &[IsolationMode], node: Option<IsolationMode>) -> bool {
    accepted.is_empty() || accepted.contains(&node.unwrap_or(IsolationMode::Advisory))
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an isolation mode (driver-limits, mps, guard or advisory)")]
pub struct UnknownMode(pub String);

impl FromStr for IsolationMode {
    type Err = UnknownMode;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|m| m.name() == s.trim()).ok_or_else(|| UnknownMode(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_round_trip_by_name_and_as_json() {
        for m in IsolationMode::ALL {
            assert_eq!(m.name().parse::<IsolationMode>(), Ok(m));
            assert_eq!(serde_json::to_string(&m).unwrap(), format!("\"{}\"", m.name()));
        }
        assert!("MPS".parse::<IsolationMode>().is_err());
        assert!(IsolationMode::Guard.enforces_memory() && !IsolationMode::Advisory.enforces_memory());
    }

    #[test]
    fn requirements_parse_and_decide() {
        use IsolationMode::*;
        assert_eq!(parse_requirement("enforced"), Ok(vec![DriverLimits, Mps, Guard]));
        assert_eq!(parse_requirement(" Enforced "), Ok(vec![DriverLimits, Mps, Guard]));
        assert_eq!(parse_requirement("mps, driver-limits,mps"), Ok(vec![DriverLimits, Mps]));
        assert_eq!(parse_requirement("advisory"), Ok(vec![Advisory]));
        for bad in ["", " , ", "strict", "mps;guard", "mps,magic"] {
            assert_eq!(parse_requirement(bad), Err(UnknownMode(bad.to_string())), "{bad:?}");
        }
        let enforced = parse_requirement("enforced").unwrap();
        assert!(satisfies(&enforced, Some(Guard)) && satisfies(&enforced, Some(DriverLimits)));
        assert!(!satisfies(&enforced, Some(Advisory)) && !satisfies(&enforced, None));
        assert!(satisfies(&[], None) && satisfies(&[], Some(Advisory)));
        assert!(!satisfies(&[Mps], Some(Guard)) && satisfies(&[Advisory], None));
    }
}
