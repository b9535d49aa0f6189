//! The public resource contract: what a pod may ask for and how it is read.
//!
//! `gpuplace.io/gpu` is the GPU count of a container, `gpuplace.io/gpu-mem` its total GPU memory in MiB
//! and `gpuplace.io/gpu-core` its total compute in percent of one GPU; totals are split evenly over the
//! container's GPUs. docs/resources.md is the user-facing statement of these rules.

use std::collections::BTreeMap;

use crate::isolation::{self, IsolationMode, ANNOTATION_ISOLATION};
use crate::quantity::{self, Quantity};

pub const RESOURCE_GPU: &str = "gpuplace.io/gpu";
pub const RESOURCE_GPU_MEM: &str = "gpuplace.io/gpu-mem";
pub const RESOURCE_GPU_CORE: &str = "gpuplace.io/gpu-core";

pub const ANNOTATION_NODE_POLICY: &str = "gpuplace.io/node-policy";
pub const ANNOTATION_GPU_POLICY: &str = "gpuplace.io/gpu-policy";
pub const ANNOTATION_NUMA: &str = "gpuplace.io/numa";
pub const ANNOTATION_GPU_MODEL: &str = "gpuplace.io/gpu-model";
pub const ANNOTATION_GROUP_SIZE: &str = "gpuplace.io/group-size";
/// The members an elastic group needs to start (TorchElastic's `min_nodes`, a PodGroup's `minCount`).
pub const ANNOTATION_GROUP_MIN: &str = "gpuplace.io/group-min";
pub const LABEL_GROUP: &str = "gpuplace.io/group";
pub const ANNOTATION_GROUP_TOPOLOGY: &str = "gpuplace.io/group-topology";

/// More GPUs than any node carries; a larger count is refused outright rather than searched for.
pub const MAX_GPUS_PER_CONTAINER: u32 = 64;
/// A group larger than this is refused (it would never be placed and only costs memory).
pub const MAX_GROUP_SIZE: u32 = 10_000;

/// Memory of one GPU slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryDemand {
    /// A fixed amount in MiB.
    Mib(u64),
    /// `gpu-core` without `gpu-mem`: the same fraction of the GPU's memory as of its compute.
    ProportionalToCore,
}

/// What one container needs from each of its GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum GpuDemand {
    /// `gpu` alone: whole GPUs, nobody else on them.
    Whole { gpus: u32 },
    /// `gpu` with `gpu-mem` and/or `gpu-core`: a slice of each of `gpus` GPUs.
    Shared { gpus: u32, memory: MemoryDemand, core_pct: u32 },
}

impl GpuDemand {
    #[inline]
    pub fn gpus(&self) -> u32 {
        match *self {
            GpuDemand::Whole { gpus } | GpuDemand::Shared { gpus, .. } => gpus,
        }
    }

    #[inline]
    pub fn is_whole(&self) -> bool {
        matches!(self, GpuDemand::Whole { .. })
    }

    /// Memory this demand takes on one GPU of `gpu_memory_mib`.
    pub fn mem_on(&self, gpu_memory_mib: u64) -> u64 {
        match *self {
            GpuDemand::Whole { .. } => gpu_memory_mib,
            GpuDemand::Shared { memory: MemoryDemand::Mib(m), .. } => m,
            // rounded down, so that shares adding up to 100% also fit in memory
            GpuDemand::Shared { memory: MemoryDemand::ProportionalToCore, core_pct, .. } => {
                gpu_memory_mib * u64::from(core_pct) / 100
            }
        }
    }

    /// Compute percent this demand takes on one GPU.
    #[inline]
    pub fn core_on(&self) -> u32 {
        match *self {
            GpuDemand::Whole { .. } => 100,
            GpuDemand::Shared { core_pct, .. } => core_pct,
        }
    }

    /// The share of one GPU this demand takes on a GPU of `gpu_memory_mib`, in thousandths: the larger
    /// of its compute and memory fractions. Used by the fragmentation measure and for reporting.
    #[inline]
    pub fn milli_on(&self, gpu_memory_mib: u64) -> u32 {
        crate::assignment::share_milli(self.mem_on(gpu_memory_mib), self.core_on(), gpu_memory_mib)
    }
}

/// Node and GPU packing policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PackingPolicy {
    Binpack,
    Spread,
}

/// How strictly a multi-GPU container must stay on one NUMA node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NumaPolicy {
    /// All GPUs of each container on one NUMA node, or the node is refused.
    Required,
    /// One NUMA node when possible.
    #[default]
    Preferred,
    /// NUMA plays no part in the choice.
    None,
}

/// Membership in a job of several pods that should sit close together on the network.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct GroupSpec {
    /// `namespace/name`: the PodGroup's name (`spec.schedulingGroup.podGroupName`) when the pod has
    /// one, else the `gpuplace.io/group` label's value. Groups never span namespaces.
    pub key: String,
    /// `gpuplace.io/group-size`: how many pods the group has (0 when only a PodGroup names the
    /// group: its `minCount` says).
    pub size: u32,
    /// `gpuplace.io/group-min`: the members the group needs to start (0: all of them); the rest
    /// join as room appears. A PodGroup's `minCount` says the same for a gang.
    #[serde(default)]
    pub min: u32,
    /// The group is kube-scheduler's PodGroup (a gang that kube-scheduler schedules in one cycle).
    #[serde(default)]
    pub pod_group: bool,
    /// `gpuplace.io/group-topology`: node label keys all members must share (a PodGroup adds its
    /// `schedulingConstraints.topology` keys). Empty: closeness is a preference.
    #[serde(default)]
    pub required: Vec<String>,
}

impl GroupSpec {
    /// A group of `gpuplace.io/group` and `gpuplace.io/group-size` alone.
    pub fn labelled(key: impl Into<String>, size: u32) -> Self {
        Self { key: key.into(), size, min: 0, pod_group: false, required: Vec::new() }
    }
}

/// One container's GPU need, by name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ContainerDemand {
    pub name: String,
    pub demand: GpuDemand,
}

/// Everything the placement engine needs to know about one pod.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct PodRequest {
    /// `namespace/name`.
    pub key: String,
    /// App containers that use GPUs, in spec order. They hold their GPUs together.
    pub containers: Vec<ContainerDemand>,
    /// Init containers that use GPUs. Each runs alone before the app containers, so it may reuse the
    /// slices the app containers hold (as kubelet does), and only needs extra room where it is larger.
    pub init_containers: Vec<ContainerDemand>,
    /// Host CPU in millicores and memory in MiB (checked by the simulator; kube-scheduler checks them
    /// itself in production).
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub node_policy: Option<PackingPolicy>,
    pub gpu_policy: Option<PackingPolicy>,
    pub numa: NumaPolicy,
    /// Allowed GPU models (exact, case-insensitive); empty means any.
    pub allowed_models: Vec<String>,
    pub group: Option<GroupSpec>,
    /// Isolation modes the pod accepts on its node (`gpuplace.io/isolation`), strongest first;
    /// empty means any (see [`isolation::satisfies`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub isolation: Vec<IsolationMode>,
}

impl PodRequest {
    /// A pod with one GPU container and default policies: the shape most tests and the simulator use.
    pub fn single(key: impl Into<String>, demand: GpuDemand) -> Self {
        Self { key: key.into(), containers: vec![ContainerDemand { name: "main".into(), demand }], ..Self::empty("") }
    }

    fn empty(key: &str) -> Self {
        Self {
            key: key.into(),
            containers: Vec::new(),
            init_containers: Vec::new(),
            cpu_milli: 0,
            memory_mib: 0,
            node_policy: None,
            gpu_policy: None,
            numa: NumaPolicy::default(),
            allowed_models: Vec::new(),
            group: None,
            isolation: Vec::new(),
        }
    }

    /// True when the pod asks for no GPU at all (gpuplace has nothing to say about it).
    #[inline]
    pub fn is_gpu_free(&self) -> bool {
        self.containers.is_empty() && self.init_containers.is_empty()
    }

    /// GPUs the app containers hold at once.
    #[inline]
    pub fn total_gpus(&self) -> u32 {
        self.containers.iter().map(|c| c.demand.gpus()).sum()
    }

    /// Whether a GPU of this model may be used.
    #[inline]
    pub fn allows_model(&self, model: &str) -> bool {
        self.allowed_models.is_empty() || self.allowed_models.iter().any(|m| m.eq_ignore_ascii_case(model))
    }

    /// Whether a node publishing `mode` (`None`: nothing, read as advisory) isolates this pod as it
    /// asks.
    #[inline]
    pub fn accepts_isolation(&self, mode: Option<IsolationMode>) -> bool {
        isolation::satisfies(&self.isolation, mode)
    }
}

/// A container's resource section as written in the pod spec.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerResources {
    pub name: String,
    pub requests: BTreeMap<String, String>,
    pub limits: BTreeMap<String, String>,
}

/// The parts of a pod the contract reads, independent of any Kubernetes client library.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodSpecView {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub containers: Vec<ContainerResources>,
    pub init_containers: Vec<ContainerResources>,
    /// `spec.schedulingGroup.podGroupName`: the kube-scheduler PodGroup the pod belongs to.
    pub pod_group: Option<String>,
}

/// Why a pod's GPU request was refused. Every message says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("container {container:?}: {resource} {value:?} is not a valid quantity: {source}")]
    BadQuantity { container: String, resource: &'static str, value: String, source: quantity::QuantityError },
    #[error("container {container:?}: {resource} must be a whole number, got {value:?}")]
    NotInteger { container: String, resource: &'static str, value: String },
    #[error("container {container:?}: {resource} must be positive, got {value}")]
    NotPositive { container: String, resource: &'static str, value: i128 },
    #[error("container {container:?}: {resource} request {request:?} and limit {limit:?} differ; extended resources need equal requests and limits")]
    RequestLimitMismatch { container: String, resource: &'static str, request: String, limit: String },
    #[error("container {container:?}: {resource} without {gpu}; add `{gpu}: 1` (or the number of GPUs to span), because kubelet only calls the device plugin for {gpu}", gpu = RESOURCE_GPU)]
    MissingGpuCount { container: String, resource: &'static str },
    #[error(
        "container {container:?}: {resource} {total} does not split evenly over {gpus} GPUs; use a multiple of {gpus}"
    )]
    UnevenSplit { container: String, resource: &'static str, total: i128, gpus: u32 },
    #[error("container {container:?}: {RESOURCE_GPU_CORE} {total} over {gpus} GPUs is {per_gpu}% per GPU, more than one GPU (100%); ask for more GPUs or whole GPUs")]
    CoreAboveWholeGpu { container: String, total: i128, gpus: u32, per_gpu: i128 },
    #[error("container {container:?}: {gpus} GPUs is more than any node has (at most {MAX_GPUS_PER_CONTAINER})")]
    TooManyGpus { container: String, gpus: i128 },
    #[error("container {container:?}: {RESOURCE_GPU_MEM} {total} MiB is absurd (more than 1 TiB per GPU)")]
    AbsurdMemory { container: String, total: i128 },
    #[error("container {container:?}: unknown resource {resource:?} in the gpuplace.io domain; known: {RESOURCE_GPU}, {RESOURCE_GPU_MEM}, {RESOURCE_GPU_CORE}")]
    UnknownResource { container: String, resource: String },
    #[error("annotation {key}: {value:?} is not one of {allowed}")]
    BadAnnotation { key: &'static str, value: String, allowed: &'static str },
    #[error("annotation {ANNOTATION_GROUP_SIZE}: {value:?} must be a whole number from 1 to {MAX_GROUP_SIZE}")]
    BadGroupSize { value: String },
    #[error(
        "label {LABEL_GROUP} {group:?} needs annotation {ANNOTATION_GROUP_SIZE} with the number of pods in the group"
    )]
    MissingGroupSize { group: String },
    #[error("annotation {ANNOTATION_GROUP_MIN}: {value:?} must be a whole number from 1 to the group's size ({size})")]
    BadGroupMin { value: String, size: u32 },
}

const MAX_MIB_PER_GPU: i128 = 1 << 20;

fn quantity_of(c: &ContainerResources, resource: &'static str) -> Result<Option<(Quantity, String)>, RequestError> {
    let req = c.requests.get(resource);
    let lim = c.limits.get(resource);
    let raw = match (req, lim) {
        (None, None) => return Ok(None),
        (Some(r), None) | (None, Some(r)) => r,
        (Some(r), Some(l)) => {
            let (qr, ql) = (quantity::parse(r), quantity::parse(l));
            if let (Ok(a), Ok(b)) = (&qr, &ql) {
                if a != b {
                    return Err(RequestError::RequestLimitMismatch {
                        container: c.name.clone(),
                        resource,
                        request: r.clone(),
                        limit: l.clone(),
                    });
                }
            }
            r
        }
    };
    let q = quantity::parse(raw).map_err(|source| RequestError::BadQuantity {
        container: c.name.clone(),
        resource,
        value: raw.clone(),
        source,
    })?;
    Ok(Some((q, raw.clone())))
}

fn positive_integer(c: &ContainerResources, resource: &'static str) -> Result<Option<i128>, RequestError> {
    let Some((q, raw)) = quantity_of(c, resource)? else { return Ok(None) };
    let v =
        q.as_integer().ok_or_else(|| RequestError::NotInteger { container: c.name.clone(), resource, value: raw })?;
    if v <= 0 {
        return Err(RequestError::NotPositive { container: c.name.clone(), resource, value: v });
    }
    Ok(Some(v))
}

/// Reads one container's GPU demand; `Ok(None)` when it asks for no gpuplace resource.
pub fn container_demand(c: &ContainerResources) -> Result<Option<GpuDemand>, RequestError> {
    for key in c.requests.keys().chain(c.limits.keys()) {
        if key.starts_with("gpuplace.io/")
            && ![RESOURCE_GPU, RESOURCE_GPU_MEM, RESOURCE_GPU_CORE].contains(&key.as_str())
        {
            return Err(RequestError::UnknownResource { container: c.name.clone(), resource: key.clone() });
        }
    }
    let gpus = positive_integer(c, RESOURCE_GPU)?;
    let mem = positive_integer(c, RESOURCE_GPU_MEM)?;
    let core = positive_integer(c, RESOURCE_GPU_CORE)?;
    let Some(gpus) = gpus else {
        return match (mem, core) {
            (None, None) => Ok(None),
            (Some(_), _) => {
                Err(RequestError::MissingGpuCount { container: c.name.clone(), resource: RESOURCE_GPU_MEM })
            }
            (None, Some(_)) => {
                Err(RequestError::MissingGpuCount { container: c.name.clone(), resource: RESOURCE_GPU_CORE })
            }
        };
    };
    if gpus > i128::from(MAX_GPUS_PER_CONTAINER) {
        return Err(RequestError::TooManyGpus { container: c.name.clone(), gpus });
    }
    let n = gpus as u32;
    if mem.is_none() && core.is_none() {
        return Ok(Some(GpuDemand::Whole { gpus: n }));
    }
    let split = |resource: &'static str, total: i128| -> Result<i128, RequestError> {
        if total % gpus != 0 {
            return Err(RequestError::UnevenSplit { container: c.name.clone(), resource, total, gpus: n });
        }
        Ok(total / gpus)
    };
    let memory = match mem {
        Some(total) => {
            let per = split(RESOURCE_GPU_MEM, total)?;
            if per > MAX_MIB_PER_GPU {
                return Err(RequestError::AbsurdMemory { container: c.name.clone(), total });
            }
            MemoryDemand::Mib(per as u64)
        }
        None => MemoryDemand::ProportionalToCore,
    };
    let core_pct = match core {
        Some(total) => {
            let per = split(RESOURCE_GPU_CORE, total)?;
            if per > 100 {
                return Err(RequestError::CoreAboveWholeGpu {
                    container: c.name.clone(),
                    total,
                    gpus: n,
                    per_gpu: per,
                });
            }
            per as u32
        }
        None => 0,
    };
    Ok(Some(GpuDemand::Shared { gpus: n, memory, core_pct }))
}

fn packing_annotation(
    annotations: &BTreeMap<String, String>,
    key: &'static str,
) -> Result<Option<PackingPolicy>, RequestError> {
    match annotations.get(key).map(|v| v.trim()) {
        None => Ok(None),
        Some(v) if v.eq_ignore_ascii_case("binpack") => Ok(Some(PackingPolicy::Binpack)),
        Some(v) if v.eq_ignore_ascii_case("spread") => Ok(Some(PackingPolicy::Spread)),
        Some(v) => Err(RequestError::BadAnnotation { key, value: v.to_string(), allowed: "binpack | spread" }),
    }
}

/// Reads a pod's GPU request, policies and group membership. Pods with no gpuplace resource give a
/// request with no containers (`is_gpu_free`).
pub fn pod_request(pod: &PodSpecView) -> Result<PodRequest, RequestError> {
    let mut req = PodRequest::empty(&format!("{}/{}", pod.namespace, pod.name));
    for c in &pod.containers {
        if let Some(demand) = container_demand(c)? {
            req.containers.push(ContainerDemand { name: c.name.clone(), demand });
        }
    }
    for c in &pod.init_containers {
        if let Some(demand) = container_demand(c)? {
            req.init_containers.push(ContainerDemand { name: c.name.clone(), demand });
        }
    }
    req.node_policy = packing_annotation(&pod.annotations, ANNOTATION_NODE_POLICY)?;
    req.gpu_policy = packing_annotation(&pod.annotations, ANNOTATION_GPU_POLICY)?;
    req.numa = match pod.annotations.get(ANNOTATION_NUMA).map(|v| v.trim().to_ascii_lowercase()) {
        None => NumaPolicy::Preferred,
        Some(v) if v == "required" => NumaPolicy::Required,
        Some(v) if v == "preferred" => NumaPolicy::Preferred,
        Some(v) if v == "none" => NumaPolicy::None,
        Some(v) => {
            return Err(RequestError::BadAnnotation {
                key: ANNOTATION_NUMA,
                value: v,
                allowed: "required | preferred | none",
            })
        }
    };
    if let Some(raw) = pod.annotations.get(ANNOTATION_ISOLATION) {
        req.isolation = isolation::parse_requirement(raw).map_err(|_| RequestError::BadAnnotation {
            key: ANNOTATION_ISOLATION,
            value: raw.clone(),
            allowed: isolation::REQUIREMENT_SYNTAX,
        })?;
    }
    if let Some(models) = pod.annotations.get(ANNOTATION_GPU_MODEL) {
        req.allowed_models =
            models.split([',', '|']).map(str::trim).filter(|m| !m.is_empty()).map(str::to_string).collect();
    }
    let size = match (pod.labels.get(LABEL_GROUP), pod.annotations.get(ANNOTATION_GROUP_SIZE)) {
        (_, Some(raw)) => raw
            .trim()
            .parse()
            .ok()
            .filter(|s| (1..=MAX_GROUP_SIZE).contains(s))
            .ok_or_else(|| RequestError::BadGroupSize { value: raw.clone() })?,
        (Some(group), None) if pod.pod_group.is_none() => {
            return Err(RequestError::MissingGroupSize { group: group.clone() })
        }
        _ => 0,
    };
    // the PodGroup names the group when both are set: kube-scheduler gangs by it
    let name = pod.pod_group.as_ref().or(pod.labels.get(LABEL_GROUP));
    if let Some(name) = name {
        let mut required = Vec::new();
        if let Some(raw) = pod.annotations.get(ANNOTATION_GROUP_TOPOLOGY) {
            for key in raw.split(',').map(str::trim).filter(|k| !k.is_empty()) {
                if key.chars().any(|c| c.is_whitespace() || c == '=') || key.len() > 317 {
                    return Err(RequestError::BadAnnotation {
                        key: ANNOTATION_GROUP_TOPOLOGY,
                        value: raw.clone(),
                        allowed: "node label keys, comma-separated (e.g. network.gpuplace.io/tor)",
                    });
                }
                required.push(key.to_string());
            }
        }
        let min = match pod.annotations.get(ANNOTATION_GROUP_MIN) {
            None => 0,
            Some(raw) => {
                let limit = if size > 0 { size } else { MAX_GROUP_SIZE };
                raw.trim()
                    .parse()
                    .ok()
                    .filter(|m| (1..=limit).contains(m))
                    .ok_or_else(|| RequestError::BadGroupMin { value: raw.clone(), size: limit })?
            }
        };
        req.group = Some(GroupSpec {
            key: format!("{}/{}", pod.namespace, name),
            size,
            min,
            pod_group: pod.pod_group.is_some(),
            required,
        });
    }
    Ok(req)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(pairs: &[(&str, &str)]) -> ContainerResources {
        let map: BTreeMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        ContainerResources { name: "c".into(), requests: map.clone(), limits: map }
    }

    #[test]
    fn issue_example_splits_evenly() {
        let d = container_demand(&container(&[
            (RESOURCE_GPU, "3"),
            (RESOURCE_GPU_MEM, "18432"),
            (RESOURCE_GPU_CORE, "240"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(d, GpuDemand::Shared { gpus: 3, memory: MemoryDemand::Mib(6144), core_pct: 80 });
    }

    #[test]
    fn gpu_alone_is_whole() {
        let d = container_demand(&container(&[(RESOURCE_GPU, "2")])).unwrap().unwrap();
        assert_eq!(d, GpuDemand::Whole { gpus: 2 });
        assert_eq!(d.mem_on(81559), 81559);
        assert_eq!(d.core_on(), 100);
    }

    #[test]
    fn core_alone_reserves_proportional_memory() {
        let d = container_demand(&container(&[(RESOURCE_GPU, "1"), (RESOURCE_GPU_CORE, "25")])).unwrap().unwrap();
        assert_eq!(d.mem_on(80000), 20000);
        assert_eq!(d.milli_on(80000), 250);
    }

    #[test]
    fn mem_alone_is_best_effort_compute() {
        let d = container_demand(&container(&[(RESOURCE_GPU, "1"), (RESOURCE_GPU_MEM, "4096")])).unwrap().unwrap();
        assert_eq!(d.core_on(), 0);
        assert_eq!(d.mem_on(16384), 4096);
    }

    #[test]
    fn slices_without_gpu_count_name_the_fix() {
        let err = container_demand(&container(&[(RESOURCE_GPU_MEM, "4096")])).unwrap_err();
        assert!(matches!(err, RequestError::MissingGpuCount { .. }));
        assert!(err.to_string().contains("add `gpuplace.io/gpu: 1`"), "{err}");
    }

    #[test]
    fn bad_values_are_refused_with_reasons() {
        let cases: &[&[(&str, &str)]] = &[
            &[(RESOURCE_GPU, "0")],
            &[(RESOURCE_GPU, "-1")],
            &[(RESOURCE_GPU, "1.5")],
            &[(RESOURCE_GPU, "abc")],
            &[(RESOURCE_GPU, "100")],
            &[(RESOURCE_GPU, "3"), (RESOURCE_GPU_MEM, "1000")],
            &[(RESOURCE_GPU, "2"), (RESOURCE_GPU_CORE, "300")],
            &[(RESOURCE_GPU, "1"), (RESOURCE_GPU_MEM, "1Ei")],
            &[(RESOURCE_GPU, "1"), ("gpuplace.io/gpus", "1")],
        ];
        for case in cases {
            let err = container_demand(&container(case));
            assert!(err.is_err(), "{case:?} should be refused, got {err:?}");
            assert!(!err.unwrap_err().to_string().is_empty());
        }
    }

    #[test]
    fn request_and_limit_must_agree() {
        let mut c = container(&[(RESOURCE_GPU, "1")]);
        c.limits.insert(RESOURCE_GPU.into(), "2".into());
        assert!(matches!(container_demand(&c), Err(RequestError::RequestLimitMismatch { .. })));
        // limits alone imply the request, as in Kubernetes
        let mut c = ContainerResources { name: "c".into(), ..Default::default() };
        c.limits.insert(RESOURCE_GPU.into(), "1".into());
        assert_eq!(container_demand(&c).unwrap(), Some(GpuDemand::Whole { gpus: 1 }));
    }

    #[test]
    fn annotations_and_group_are_read() {
        let mut pod = PodSpecView { namespace: "ml".into(), name: "p".into(), ..Default::default() };
        pod.containers.push(container(&[(RESOURCE_GPU, "1")]));
        pod.annotations.insert(ANNOTATION_GPU_POLICY.into(), "Spread".into());
        pod.annotations.insert(ANNOTATION_NUMA.into(), "required".into());
        pod.annotations.insert(ANNOTATION_GPU_MODEL.into(), "A100, H100".into());
        pod.labels.insert(LABEL_GROUP.into(), "job".into());
        pod.annotations.insert(ANNOTATION_GROUP_SIZE.into(), "4".into());
        let r = pod_request(&pod).unwrap();
        assert_eq!(r.gpu_policy, Some(PackingPolicy::Spread));
        assert_eq!(r.numa, NumaPolicy::Required);
        assert_eq!(r.allowed_models, vec!["A100", "H100"]);
        assert!(r.allows_model("h100"));
        assert!(!r.allows_model("H100 80GB"));
        assert_eq!(r.group, Some(GroupSpec::labelled("ml/job", 4)));

        pod.annotations.insert(ANNOTATION_NUMA.into(), "sometimes".into());
        assert!(pod_request(&pod).unwrap_err().to_string().contains("required | preferred | none"));
        pod.annotations.remove(ANNOTATION_NUMA);
        pod.annotations.insert(ANNOTATION_GROUP_SIZE.into(), "-2".into());
        assert!(matches!(pod_request(&pod), Err(RequestError::BadGroupSize { .. })));
        pod.annotations.remove(ANNOTATION_GROUP_SIZE);
        assert!(matches!(pod_request(&pod), Err(RequestError::MissingGroupSize { .. })));
    }

    #[test]
    fn the_isolation_requirement_is_read_and_a_bad_one_refused() {
        use crate::isolation::IsolationMode::*;
        let mut pod = PodSpecView { namespace: "ml".into(), name: "p".into(), ..Default::default() };
        pod.containers.push(container(&[(RESOURCE_GPU, "1"), (RESOURCE_GPU_MEM, "1000")]));
        let any = pod_request(&pod).unwrap();
        assert!(any.isolation.is_empty() && any.accepts_isolation(None));
        pod.annotations.insert(ANNOTATION_ISOLATION.into(), "enforced".into());
        let r = pod_request(&pod).unwrap();
        assert_eq!(r.isolation, vec![DriverLimits, Mps, Guard]);
        assert!(r.accepts_isolation(Some(Guard)) && !r.accepts_isolation(Some(Advisory)) && !r.accepts_isolation(None));
        pod.annotations.insert(ANNOTATION_ISOLATION.into(), "mps,driver-limits".into());
        assert_eq!(pod_request(&pod).unwrap().isolation, vec![DriverLimits, Mps]);
        pod.annotations.insert(ANNOTATION_ISOLATION.into(), "strict".into());
        let err = pod_request(&pod).unwrap_err().to_string();
        assert!(
            err.contains("gpuplace.io/isolation") && err.contains("\"strict\"") && err.contains("enforced"),
            "{err}"
        );
    }

    #[test]
    fn an_elastic_group_names_the_members_it_needs_to_start() {
        let mut pod = PodSpecView { namespace: "ml".into(), name: "el-0".into(), ..Default::default() };
        pod.containers.push(container(&[(RESOURCE_GPU, "8")]));
        pod.labels.insert(LABEL_GROUP.into(), "el".into());
        pod.annotations.insert(ANNOTATION_GROUP_SIZE.into(), "4".into());
        pod.annotations.insert(ANNOTATION_GROUP_MIN.into(), "2".into());
        let g = pod_request(&pod).unwrap().group.unwrap();
        assert_eq!((g.size, g.min), (4, 2));
        for bad in ["0", "5", "two", "-1"] {
            pod.annotations.insert(ANNOTATION_GROUP_MIN.into(), bad.into());
            let err = pod_request(&pod).unwrap_err();
            assert!(matches!(err, RequestError::BadGroupMin { size: 4, .. }), "{bad}: {err}");
        }
    }

    #[test]
    fn init_and_multi_container_pods_keep_each_container() {
        let mut pod = PodSpecView { namespace: "ns".into(), name: "p".into(), ..Default::default() };
        let mut a = container(&[(RESOURCE_GPU, "1"), (RESOURCE_GPU_CORE, "50")]);
        a.name = "a".into();
        let mut b = container(&[(RESOURCE_GPU, "2")]);
        b.name = "b".into();
        let mut sidecar = container(&[("cpu", "1")]);
        sidecar.name = "sidecar".into();
        let mut init = container(&[(RESOURCE_GPU, "1")]);
        init.name = "warmup".into();
        pod.containers = vec![a, b, sidecar];
        pod.init_containers = vec![init];
        let r = pod_request(&pod).unwrap();
        assert_eq!(r.containers.len(), 2);
        assert_eq!(r.total_gpus(), 3);
        assert_eq!(r.init_containers[0].name, "warmup");
    }
}
