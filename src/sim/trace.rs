//! The Alibaba openb trace format (`cluster-trace-gpu-v2023`): node and pod lists as CSV.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use gpuplace_core::resources::{ContainerDemand, GpuDemand, MemoryDemand, PodRequest};

/// Host CPU (milli) or memory (MiB) that never runs out, with room left for sums.
pub const UNLIMITED: u64 = u64::MAX / 4;

/// GPU memory per model in MiB, as the trace's README gives it (G2 and G3 are Alibaba-internal).
pub const MODEL_MEMORY_MIB: [(&str, u64); 7] = [
    ("T4", 15109),
    ("P100", 16280),
    ("V100M16", 16160),
    ("V100M32", 32510),
    ("A10", 22731),
    ("G2", 20000),
    ("G3", 30000),
];

/// Memory of a model; unknown models get 16 GiB (memory never decides a placement in the trace,
/// because shares reserve memory in proportion to compute).
pub fn model_memory_mib(model: &str) -> u64 {
    MODEL_MEMORY_MIB.iter().find(|(m, _)| *m == model).map_or(16384, |(_, v)| *v)
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TraceNode {
    #[serde(rename = "sn")]
    pub name: String,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub gpu: u32,
    #[serde(default)]
    pub model: String,
    /// Its GPUs are joined by NVLink through an NVSwitch (the trace publishes no topology: set by the
    /// `--boards hgx` what-if, or from a cluster file's board).
    #[serde(skip)]
    pub nvswitch: bool,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TracePod {
    pub name: String,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub num_gpu: u32,
    pub gpu_milli: u32,
    #[serde(default)]
    pub gpu_spec: String,
    /// The group (a job of several pods that start together) the pod belongs to: set by the
    /// `gangs=P` generator (`sim::generate`); the trace's CSVs have none.
    #[serde(default)]
    pub group: Option<String>,
}

impl TracePod {
    /// Allowed models from `gpu_spec` (`V100M16|V100M32`); empty means any.
    pub fn models(&self) -> Vec<String> {
        self.gpu_spec.split('|').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect()
    }

    /// Per-GPU share in thousandths, clamped as the FGD simulator does (0 for CPU-only pods).
    pub fn milli(&self) -> u32 {
        if self.num_gpu == 0 {
            0
        } else {
            self.gpu_milli.min(1000)
        }
    }

    /// The pod in gpuplace's contract: `gpu_milli` 1000 is whole GPUs; less is one shared GPU with
    /// gpu-core = milli/10 and memory in proportion.
    pub fn request(&self, key: &str) -> PodRequest {
        let mut r = PodRequest::single(key, GpuDemand::Whole { gpus: 1 });
        r.containers.clear();
        let milli = self.milli();
        if self.num_gpu > 0 && milli > 0 {
            let demand = if milli >= 1000 {
                GpuDemand::Whole { gpus: self.num_gpu }
            } else {
                GpuDemand::Shared {
                    gpus: self.num_gpu,
                    memory: MemoryDemand::ProportionalToCore,
                    core_pct: milli.div_ceil(10),
                }
            };
            r.containers.push(ContainerDemand { name: "main".into(), demand });
        }
        r.cpu_milli = self.cpu_milli;
        r.memory_mib = self.memory_mib;
        r.allowed_models = self.models();
        r
    }
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("reading {path}: {source}")]
    Csv { path: PathBuf, source: csv::Error },
    #[error("{0}")]
    Invalid(String),
}

fn read_csv<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Vec<T>, TraceError> {
    let err = |source| TraceError::Csv { path: path.to_path_buf(), source };
    let mut rdr = csv::ReaderBuilder::new().flexible(true).from_path(path).map_err(err)?;
    rdr.deserialize().collect::<Result<Vec<T>, _>>().map_err(err)
}

/// Node list: `openb_node_list_gpu_node.csv` in `dir`.
pub fn load_nodes(dir: &Path) -> Result<Vec<TraceNode>, TraceError> {
    let nodes: Vec<TraceNode> = read_csv(&dir.join("openb_node_list_gpu_node.csv"))?;
    if let Some(n) = nodes.iter().find(|n| n.gpu > 64) {
        return Err(TraceError::Invalid(format!("node {} has {} GPUs", n.name, n.gpu)));
    }
    Ok(nodes)
}

/// Pod list of a workload: `openb_pod_list_{workload}.csv` in `dir`.
pub fn load_pods(dir: &Path, workload: &str) -> Result<Vec<TracePod>, TraceError> {
    let pods: Vec<TracePod> = read_csv(&dir.join(format!("openb_pod_list_{workload}.csv")))?;
    if let Some(p) = pods.iter().find(|p| p.num_gpu > 64) {
        return Err(TraceError::Invalid(format!("pod {} asks for {} GPUs", p.name, p.num_gpu)));
    }
    Ok(pods)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::TracePod;

    /// A pod of 1 CPU and 1 GiB asking for `num` GPUs of `milli` thousandths each, for unit tests.
    pub(crate) fn pod(name: &str, num: u32, milli: u32) -> TracePod {
        TracePod {
            group: None,
            name: name.into(),
            cpu_milli: 1000,
            memory_mib: 1024,
            num_gpu: num,
            gpu_milli: milli,
            gpu_spec: String::new(),
        }
    }
}
