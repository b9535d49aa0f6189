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
}
