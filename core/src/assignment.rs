//! What a pod holds: the allocation record bind writes and restarts read ([`PodAssignment`]: per
//! container, its slices of GPUs), and the arithmetic of a share of one GPU ([`share_milli`],
//! [`share_fraction`]) that the cluster model and the placement engine both count by.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The share of one GPU that `mem_mib` of its `capacity_mib` memory and `core_pct` of its compute
/// amount to, in thousandths: the larger of the two fractions, rounded up, at most 1000 (a GPU without
/// memory counts as taken). The one place this arithmetic lives: a free share is 1000 minus the share
/// of what is used, so it rounds down and never promises room that is not there.
#[inline]
pub fn share_milli(mem_mib: u64, core_pct: u32, capacity_mib: u64) -> u32 {
    let core = u64::from(core_pct).saturating_mul(10);
    let mem = if capacity_mib == 0 { 1000 } else { mem_mib.saturating_mul(1000).div_ceil(capacity_mib) };
    core.max(mem).min(1000) as u32
}

/// The same share as a fraction at full precision, 0.0..=1.0 (scores are not rounded to thousandths).
/// A GPU without memory counts by compute alone here: nothing can hold memory on it.
#[inline]
pub fn share_fraction(mem_mib: u64, core_pct: u32, capacity_mib: u64) -> f64 {
    let mem = if capacity_mib == 0 { 0.0 } else { mem_mib as f64 / capacity_mib as f64 };
    // the same quotients, looked up: this runs for every GPU of every feasible node
    let core = match CORE_FRACTION.get(core_pct as usize) {
        Some(&f) => f,
        None => f64::from(core_pct) / 100.0,
    };
    core.max(mem).min(1.0)
}

/// `pct as f64 / 100.0` for each percentage (compile-time float division rounds as run-time does).
const CORE_FRACTION: [f64; 101] = {
    let mut t = [0.0; 101];
    let mut i = 0;
    while i < t.len() {
        t[i] = i as f64 / 100.0;
        i += 1;
    }
    t
};

/// The slice of one GPU given to one container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuSlice {
    /// GPU index on the node.
    pub gpu: u32,
    pub mem_mib: u64,
    pub core_pct: u32,
    /// A whole GPU that nobody else may use.
    pub exclusive: bool,
}

impl GpuSlice {
    /// Share of a GPU of `capacity_mib` this slice takes, in thousandths (see [`share_milli`]).
    #[inline]
    pub fn milli_on(&self, capacity_mib: u64) -> u32 {
        if self.exclusive {
            1000
        } else {
            share_milli(self.mem_mib, self.core_pct, capacity_mib)
        }
    }

    /// The same share as a fraction (see [`share_fraction`]).
    #[inline]
    pub fn fraction_on(&self, capacity_mib: u64) -> f64 {
        if self.exclusive {
            1.0
        } else {
            share_fraction(self.mem_mib, self.core_pct, capacity_mib)
        }
    }
}

/// The GPUs one container got.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ContainerAssignment {
    pub name: String,
    /// Init containers run alone before the app containers and reuse their slices.
    #[serde(default)]
    pub init: bool,
    pub slices: Vec<GpuSlice>,
}

/// Everything one pod holds on one node: the allocation record that bind writes and restarts read.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PodAssignment {
    /// `namespace/name`.
    pub pod: String,
    pub node: String,
    pub containers: Vec<ContainerAssignment>,
    #[serde(default)]
    pub cpu_milli: u64,
    #[serde(default)]
    pub memory_mib: u64,
    /// The group (`namespace/label`) the pod belongs to, for network locality.
    #[serde(default)]
    pub group: Option<String>,
}

/// What a pod takes from one GPU while it lives: app containers hold their slices together, and each
/// init container runs alone, so the footprint is the larger of the two in each dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Footprint {
    pub(crate) mem_mib: u64,
    pub(crate) core_pct: u32,
    pub(crate) exclusive: bool,
    /// Device-plugin slots (kubelet devices) the pod holds on the GPU: one per app container using
    /// it; init containers need one only where no app container has one, since kubelet hands an init
    /// container's devices on to the app containers.
    pub(crate) slots: u32,
}

impl PodAssignment {
    pub(crate) fn footprints(&self) -> BTreeMap<u32, Footprint> {
        let mut app: BTreeMap<u32, Footprint> = BTreeMap::new();
        let mut init: BTreeMap<u32, Footprint> = BTreeMap::new();
        for c in &self.containers {
            for s in &c.slices {
                if c.init {
                    let f = init.entry(s.gpu).or_default();
                    f.mem_mib = f.mem_mib.max(s.mem_mib);
                    f.core_pct = f.core_pct.max(s.core_pct);
                    f.exclusive |= s.exclusive;
                    f.slots = 1;
                } else {
                    let f = app.entry(s.gpu).or_default();
                    f.mem_mib = f.mem_mib.saturating_add(s.mem_mib);
                    f.core_pct = f.core_pct.saturating_add(s.core_pct);
                    f.exclusive |= s.exclusive;
                    f.slots = f.slots.saturating_add(1);
                }
            }
        }
        for (gpu, i) in init {
            let f = app.entry(gpu).or_default();
            f.mem_mib = f.mem_mib.max(i.mem_mib);
            f.core_pct = f.core_pct.max(i.core_pct);
            f.exclusive |= i.exclusive;
            f.slots = f.slots.max(i.slots);
        }
        app
    }

    /// GPU indices the app containers use, without repeats.
    #[inline]
    pub fn gpus(&self) -> Vec<u32> {
        let mut g: Vec<u32> = self.containers.iter().flat_map(|c| c.slices.iter().map(|s| s.gpu)).collect();
        g.sort_unstable();
        g.dedup();
        g
    }

    /// What the pod holds of each GPU it uses, as the node counts it (app containers together, an
    /// init container alone): (GPU index, memory MiB, compute percent, held whole).
    #[inline]
    pub fn holdings(&self) -> impl Iterator<Item = (u32, u64, u32, bool)> {
        self.footprints().into_iter().map(|(gpu, f)| (gpu, f.mem_mib, f.core_pct, f.exclusive))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_share_helper_keeps_the_old_arithmetic() {
        for (i, &f) in CORE_FRACTION.iter().enumerate() {
            assert_eq!(f.to_bits(), (i as f64 / 100.0).to_bits());
        }
        for cap in [0u64, 1, 7, 1000, 15109, 81559] {
            for mem in (0..=cap + 3).step_by((cap as usize / 97).max(1)) {
                for core in 0..=101u32 {
                    // free share: the smaller free fraction, rounded down, as the scorers computed it
                    let free_mem = cap.saturating_sub(mem);
                    let old_free = ((100u32.saturating_sub(core)) * 10)
                        .min((free_mem * 1000).checked_div(cap).unwrap_or(0) as u32);
                    assert_eq!(1000 - share_milli(mem, core, cap), old_free, "{mem} {core} {cap}");
                    // a slice's share, rounded up, as the fragmentation scorer took it
                    if mem <= cap && core <= 100 && cap > 0 {
                        let old_take = (core * 10).max((mem * 1000).div_ceil(cap) as u32);
                        assert_eq!(share_milli(mem, core, cap), old_take);
                    }
                    let old_frac =
                        (f64::from(core) / 100.0).max(if cap == 0 { 0.0 } else { mem as f64 / cap as f64 }).min(1.0);
                    assert_eq!(share_fraction(mem, core, cap).to_bits(), old_frac.to_bits());
                }
            }
        }
    }
}
