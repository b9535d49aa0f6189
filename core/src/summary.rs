//! Totals over the cluster model: GPUs idle, shared, exclusive and unhealthy, memory and compute
//! allocated, and free capacity split into whole and partly used GPUs (fragmentation), for the
//! extender's gauges and `/inspect`. Pure: read from a [`Cluster`].

use crate::cluster::Cluster;

/// Totals over the cluster, for gauges and `/inspect`.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ClusterSummary {
    pub nodes: u64,
    pub gpus: u64,
    pub idle: u64,
    pub shared: u64,
    pub exclusive: u64,
    pub unhealthy: u64,
    pub mem_total: u64,
    pub mem_alloc: u64,
    pub core_total: u64,
    pub core_alloc: u64,
    /// Free share (thousandths of a GPU) on GPUs nobody holds, and on GPUs partly held.
    pub free_milli_idle: u64,
    pub free_milli_partial: u64,
}

impl ClusterSummary {
    pub fn of(cluster: &Cluster) -> Self {
        let mut s = Self::default();
        for n in cluster.nodes() {
            s.nodes += 1;
            for (g, gpu) in n.gpus.iter().enumerate() {
                let u = n.usage(g);
                s.gpus += 1;
                s.mem_total += gpu.memory_mib;
                s.core_total += 100;
                // an exclusive GPU is all taken, whatever its slice records say
                s.mem_alloc += if u.exclusive { gpu.memory_mib } else { u.mem_mib.min(gpu.memory_mib) };
                s.core_alloc += if u.exclusive { 100 } else { u64::from(u.core_pct.min(100)) };
                if !gpu.healthy {
                    s.unhealthy += 1;
                    continue;
                }
                if u.exclusive {
                    s.exclusive += 1;
                } else if u.holders > 0 {
                    s.shared += 1;
                    s.free_milli_partial += ((1.0 - n.gpu_used_fraction(g)) * 1000.0).round() as u64;
                } else {
                    s.idle += 1;
                    s.free_milli_idle += 1000;
                }
            }
        }
        s
    }

    /// Free capacity on partly used GPUs over all free capacity (0 when nothing is free).
    pub fn fragmentation(&self) -> f64 {
        let free = self.free_milli_idle + self.free_milli_partial;
        if free == 0 {
            0.0
        } else {
            self.free_milli_partial as f64 / free as f64
        }
    }
}
