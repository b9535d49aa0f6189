//! Whether and how a pod fits on one node, with the exact GPUs it would get, and why it does not:
//! the [`Cause`] (what kube-scheduler is told, the same on every node turned down for it) and a
//! detail with the node's own figures, for logs.
//!
//! This is the straightforward form of the placement rules. Ranking many nodes goes through
//! [`compact`](crate::placement::compact), which makes the same choices without allocating; this
//! path serves nodes too large for it and writes the reasons, and tests hold the two equal.

use std::fmt;

use crate::placement::gpu_select::{choose_one, choose_set, FreeState, ShareChoice};
use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
use gpuplace_core::cluster::Node;
use gpuplace_core::isolation::ANNOTATION_ISOLATION;
use gpuplace_core::resources::{
    ContainerDemand, GpuDemand, MemoryDemand, NumaPolicy, PackingPolicy, PodRequest, ANNOTATION_GPU_MODEL,
};

/// Why a pod does not fit on a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Infeasible {
    /// Would not fit even on the node emptied of every pod: preemption cannot help.
    Unresolvable(Why),
    /// Fits on the empty node, so evicting pods could make room.
    Preemptable(Why),
}

impl Infeasible {
    pub fn why(&self) -> &Why {
        match self {
            Infeasible::Unresolvable(w) | Infeasible::Preemptable(w) => w,
        }
    }

    /// The kind of shortfall, as kube-scheduler is told it.
    pub fn cause(&self) -> Cause {
        self.why().cause
    }

    /// This node's own figures behind the cause (empty where only the cause was asked for).
    pub fn detail(&self) -> &str {
        &self.why().detail
    }

    pub fn is_unresolvable(&self) -> bool {
        matches!(self, Infeasible::Unresolvable(_))
    }
}

/// One node's rejection: its cause and the node's figures behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Why {
    pub cause: Cause,
    /// For people reading logs: which container, what the node has free. Never sent to
    /// kube-scheduler, which groups nodes by reason text: numbers of the node's own would make every
    /// node's reason different.
    pub detail: String,
}

impl Why {
    pub fn new(cause: Cause, detail: impl Into<String>) -> Self {
        Self { cause, detail: detail.into() }
    }
}

/// The kind of shortfall that turned a node down. Its text (`Display`) is the reason kube-scheduler
/// shows, and kube-scheduler counts nodes by identical reason texts ("0/16 nodes are available: 12
/// `<reason>`, 4 `<reason>`."), so it carries figures of the pod's own request only, never of the node.
/// It never contains a percent sign either: kube-scheduler uses the text as a format string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// The node is not in the cluster model.
    UnknownNode,
    /// No GPU of a model the pod allows.
    Model,
    /// The node's isolation mode is not one the pod accepts (`gpuplace.io/isolation`).
    Isolation,
    /// No healthy GPU of an allowed model.
    NoUsableGpu,
    /// Fewer healthy GPUs of an allowed model than a container spans.
    TooFewGpus { gpus: u32 },
    /// Fewer idle GPUs than a container's whole GPUs.
    Idle { gpus: u32 },
    /// Fewer GPUs with a container's share free than it spans.
    Room { demand: GpuDemand },
    /// Enough GPUs have room, but their device-plugin slots are taken.
    Slots,
    /// `numa: required`, and no NUMA node holds the container's GPUs.
    Numa { demand: GpuDemand },
    /// Host CPU the pod asks for, millicores.
    Cpu { milli: u64 },
    /// Host memory the pod asks for, MiB.
    Memory { mib: u64 },
}

/// A share as the reasons say it: "20480 MiB and 30 percent".
struct Share(GpuDemand);

impl fmt::Display for Share {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            GpuDemand::Whole { .. } => f.write_str("a whole GPU"),
            GpuDemand::Shared { memory: MemoryDemand::ProportionalToCore, core_pct, .. } => {
                write!(f, "{core_pct} percent compute and memory")
            }
            GpuDemand::Shared { memory: MemoryDemand::Mib(m), core_pct: 0, .. } => write!(f, "{m} MiB"),
            GpuDemand::Shared { memory: MemoryDemand::Mib(m), core_pct, .. } => {
                write!(f, "{m} MiB and {core_pct} percent")
            }
        }
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Cause::UnknownNode => f.write_str("node not in gpuplace's node cache"),
            Cause::Model => write!(f, "no GPU of a model allowed by {ANNOTATION_GPU_MODEL}"),
            Cause::Isolation => write!(f, "node's isolation mode is not one {ANNOTATION_ISOLATION} accepts"),
            Cause::NoUsableGpu => f.write_str("no healthy GPU of an allowed model"),
            Cause::TooFewGpus { gpus } => write!(f, "node has fewer than {gpus} usable GPUs"),
            Cause::Idle { gpus: 1 } => f.write_str("no idle GPU"),
            Cause::Idle { gpus } => write!(f, "fewer than {gpus} idle GPUs"),
            Cause::Room { demand } => match demand.gpus() {
                1 => write!(f, "no GPU with {} free", Share(demand)),
                k => write!(f, "fewer than {k} GPUs with {} free", Share(demand)),
            },
            Cause::Slots => f.write_str("no device-plugin slot left on the GPUs with room"),
            Cause::Numa { demand: GpuDemand::Whole { gpus } } => write!(f, "no NUMA node with {gpus} idle GPUs"),
            Cause::Numa { demand } => write!(f, "no NUMA node with {} GPUs with {} free", demand.gpus(), Share(demand)),
            Cause::Cpu { milli } => write!(f, "less than {milli} millicores of CPU free"),
            Cause::Memory { mib } => write!(f, "less than {mib} MiB of host memory free"),
        }
    }
}

/// A [`Why`], its detail written only when `want`ed (it is the costly part).
fn why(cause: Cause, want: bool, detail: impl FnOnce() -> String) -> Why {
    Why { cause, detail: if want { detail() } else { String::new() } }
}

/// How GPUs are picked on a node.
#[derive(Debug, Clone, Copy)]
pub struct GpuChoice<'a> {
    pub policy: PackingPolicy,
    pub numa: NumaPolicy,
    /// Single-GPU shares: pack by policy, or minimize fragmentation for this mix.
    pub share: ShareChoice<'a>,
}

/// A pod's GPUs on one node, ready to be allocated.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub assignment: PodAssignment,
    /// Topology score of each container's set (0 for one GPU).
    pub set_scores: Vec<u32>,
}

impl Placement {
    /// Every GPU index the app containers use.
    pub fn gpus(&self) -> Vec<u32> {
        self.assignment.gpus()
    }

    /// Each GPU's free share of `node` (thousandths) now and once this placement is made, for the
    /// node's first `n` GPUs (at most 64; `n` is returned too). Init containers reuse the app
    /// containers' slices, so only those count.
    pub fn free_milli_before_after(&self, node: &Node) -> ([u32; 64], [u32; 64], usize) {
        let n = node.gpus.len().min(64);
        let mut before = [0u32; 64];
        for (g, slot) in before.iter_mut().enumerate().take(n) {
            *slot = node.free_milli(g);
        }
        let mut after = before;
        for c in self.assignment.containers.iter().filter(|c| !c.init) {
            for s in &c.slices {
                let g = s.gpu as usize;
                if g < n {
                    after[g] = after[g].saturating_sub(s.milli_on(node.gpus[g].memory_mib));
                }
            }
        }
        (before, after, n)
    }
}

fn describe(node: &Node, c: &ContainerDemand) -> String {
    match c.demand {
        GpuDemand::Whole { gpus } => format!("container {:?} needs {gpus} whole GPU(s)", c.name),
        GpuDemand::Shared { gpus, core_pct, .. } => {
            let mem = node.gpus.first().map(|g| c.demand.mem_on(g.memory_mib)).unwrap_or(0);
            format!("container {:?} needs {gpus} GPU(s) with {mem} MiB and {core_pct}% free each", c.name)
        }
    }
}

fn capacity_summary(node: &Node, state: &FreeState, demand: &GpuDemand) -> String {
    let eligible: Vec<usize> = (0..node.gpus.len()).filter(|&g| state.eligible[g]).collect();
    if eligible.is_empty() {
        return "no usable GPU (all unhealthy or of another model)".into();
    }
    if demand.is_whole() {
        let idle = eligible.iter().filter(|&&g| state.idle[g]).count();
        return format!("{idle} of {} usable GPUs are idle", eligible.len());
    }
    let best = eligible.iter().map(|&g| (state.mem[g], state.core[g])).max().unwrap_or((0, 0));
    let fits = eligible.iter().filter(|&&g| state.fits(node, g, demand)).count();
    let full = eligible.iter().filter(|&&g| state.slots[g] == 0).count();
    let slots = match node.slots_per_gpu {
        Some(k) if full > 0 => format!("; {full} already hold {k} containers, the device plugin's slots per GPU"),
        _ => String::new(),
    };
    format!("{fits} usable GPU(s) have room; most free is {} MiB / {}%{slots}", best.0, best.1)
}

/// Which kind of shortfall keeps `demand` off the GPUs of `state` (fewer fit than it spans).
fn shortfall(node: &Node, state: &FreeState, demand: &GpuDemand) -> Cause {
    let k = demand.gpus() as usize;
    // (counted without collecting: this runs for every rejected node)
    let usable = || (0..node.gpus.len()).filter(|&g| state.eligible[g]);
    match usable().count() {
        0 => return Cause::NoUsableGpu,
        n if n < k => return Cause::TooFewGpus { gpus: demand.gpus() },
        _ => {}
    }
    let room = usable().filter(|&g| state.has_room(node, g, demand)).count();
    match demand {
        _ if room >= k => Cause::Slots,
        GpuDemand::Whole { gpus } => Cause::Idle { gpus: *gpus },
        GpuDemand::Shared { .. } => Cause::Room { demand: *demand },
    }
}

/// Where placing a pod's containers stopped: the container and the cause. The free capacity at that
/// moment stays with the caller ([`assign`] leaves it in its state), for the detail.
struct Failure<'r> {
    container: &'r ContainerDemand,
    cause: Cause,
}

impl Failure<'_> {
    /// `state`: the free capacity when it failed.
    fn why(&self, node: &Node, state: &FreeState, want: bool) -> Why {
        let c = self.container;
        why(self.cause, want, || match self.cause {
            Cause::Numa { demand } => {
                format!("{}; numa: required and no NUMA node has {} such GPUs", describe(node, c), demand.gpus())
            }
            _ => format!("{}; {}", describe(node, c), capacity_summary(node, state, &c.demand)),
        })
    }
}

/// The order app containers are placed in: largest demands first, as they have the fewest options.
pub(crate) fn container_order(req: &PodRequest) -> Vec<usize> {
    let mut order: Vec<usize> = (0..req.containers.len()).collect();
    order.sort_by_key(|&i| order_key(&req.containers[i]));
    order
}

fn order_key(c: &ContainerDemand) -> std::cmp::Reverse<(u32, bool, u32, u64)> {
    let d = &c.demand;
    std::cmp::Reverse((d.gpus(), d.is_whole(), d.core_on(), d.mem_on(u64::MAX / 1000)))
}

/// The container and cause [`assign`] fails with when the first container it places has fewer GPUs
/// to choose from than it needs (the usual rejection), worked out without its bookkeeping; `None`
/// otherwise.
fn early_failure<'r>(node: &Node, req: &'r PodRequest, state: &FreeState) -> Option<(&'r ContainerDemand, Cause)> {
    // the first of `container_order` (a stable sort: the lowest index among the largest)
    let c = req.containers.iter().min_by_key(|c| order_key(c))?;
    let k = c.demand.gpus() as usize;
    let fitting = (0..node.gpus.len()).filter(|&g| state.fits(node, g, &c.demand)).count();
    (fitting < k).then(|| (c, shortfall(node, state, &c.demand)))
}

/// Places containers on `state` (mutated). Returns the container assignments in spec order; on
/// failure, `state` is the free capacity the failing container saw.
fn assign<'r>(
    node: &Node,
    req: &'r PodRequest,
    state: &mut FreeState,
    how: &GpuChoice<'_>,
) -> Result<(Vec<ContainerAssignment>, Vec<u32>), Failure<'r>> {
    let before = state.clone();
    let order = container_order(req);
    let mut out: Vec<Option<(ContainerAssignment, u32)>> = vec![None; req.containers.len()];
    for i in order {
        let c = &req.containers[i];
        let (slices, score) =
            place_container(node, state, c, how, &[]).map_err(|cause| Failure { container: c, cause })?;
        out[i] = Some((ContainerAssignment { name: c.name.clone(), init: false, slices }, score));
    }
    let (mut containers, mut scores): (Vec<_>, Vec<_>) = out.into_iter().flatten().unzip();
    // Each init container runs alone before the app containers: it may use what was free before this
    // pod, and reusing the app containers' GPUs costs nothing extra.
    let app_gpus: Vec<usize> = containers.iter().flat_map(|c| c.slices.iter().map(|s| s.gpu as usize)).collect();
    for c in &req.init_containers {
        let mut init_state = before.clone();
        let (slices, score) = match place_container(node, &mut init_state, c, how, &app_gpus) {
            Ok(r) => r,
            Err(cause) => {
                *state = init_state;
                return Err(Failure { container: c, cause });
            }
        };
        containers.push(ContainerAssignment { name: c.name.clone(), init: true, slices });
        scores.push(score);
    }
    Ok((containers, scores))
}

fn place_container(
    node: &Node,
    state: &mut FreeState,
    c: &ContainerDemand,
    how: &GpuChoice<'_>,
    prefer: &[usize],
) -> Result<(Vec<GpuSlice>, u32), Cause> {
    let k = c.demand.gpus() as usize;
    let all: Vec<usize> = (0..node.gpus.len()).filter(|&g| state.fits(node, g, &c.demand)).collect();
    let preferred: Vec<usize> = all.iter().copied().filter(|g| prefer.contains(g)).collect();
    if all.len() < k {
        return Err(shortfall(node, state, &c.demand));
    }
    let pick = |cands: &[usize]| -> Option<Vec<usize>> {
        if cands.len() < k {
            None
        } else if k == 1 {
            let share = if c.demand.is_whole() { ShareChoice::Pack(how.policy) } else { how.share };
            choose_one(node, state, cands, &c.demand, share).map(|g| vec![g])
        } else {
            choose_set(node, state, cands, k, how.numa, how.policy, &c.demand)
        }
    };
    // enough GPUs fit, so only `numa: required` leaves no set to choose
    let chosen = pick(&preferred).or_else(|| pick(&all)).ok_or(Cause::Numa { demand: c.demand })?;
    let score = node.topology.set_score(&chosen);
    let slices = chosen
        .iter()
        .map(|&g| {
            let (mem_mib, core_pct) = state.take(node, g, &c.demand);
            GpuSlice { gpu: g as u32, mem_mib, core_pct, exclusive: c.demand.is_whole() }
        })
        .collect();
    Ok((slices, score))
}

fn host_check(node: &Node, req: &PodRequest, want: bool) -> Result<(), Infeasible> {
    for (what, need, cap, free, cause) in [
        ("millicores of CPU", req.cpu_milli, node.cpu_milli, node.cpu_free(), Cause::Cpu { milli: req.cpu_milli }),
        ("MiB of host memory", req.memory_mib, node.memory_mib, node.mem_free(), Cause::Memory { mib: req.memory_mib }),
    ] {
        if cap == 0 || need == 0 {
            continue;
        }
        if need > cap {
            return Err(Infeasible::Unresolvable(why(cause, want, || format!("needs {need} {what}; node has {cap}"))));
        }
        if need > free {
            return Err(Infeasible::Preemptable(why(cause, want, || format!("needs {need} {what}; {free} free"))));
        }
    }
    Ok(())
}

/// What the node is before its GPUs are looked at: of an isolation mode and a GPU model the pod
/// accepts.
fn model_check(node: &Node, req: &PodRequest, want: bool) -> Result<(), Infeasible> {
    if !req.accepts_isolation(node.isolation) {
        return Err(Infeasible::Unresolvable(why(Cause::Isolation, want, || {
            let mode = node.isolation.map_or("none published, so advisory".to_string(), |m| m.to_string());
            format!("node isolation {mode}; {ANNOTATION_ISOLATION} accepts {:?}", req.isolation)
        })));
    }
    if !req.allowed_models.is_empty() && !node.gpus.iter().any(|g| req.allows_model(&g.model)) {
        return Err(Infeasible::Unresolvable(why(Cause::Model, want, || {
            let mut have: Vec<&str> = node.gpus.iter().map(|g| g.model.as_str()).collect();
            have.dedup();
            format!("gpu-model {:?} allowed; node has {:?}", req.allowed_models, have)
        })));
    }
    Ok(())
}

/// The reason [`place_on_node`] gives for a node the compact path already rejected, with its
/// classification (`unresolvable`) taken from that path instead of being worked out again: only the
/// failing attempt is repeated (on the node as it is, or emptied when unresolvable), which fails
/// early, while `place_on_node` also searches GPU sets on the emptied node to classify a preemptable
/// rejection. `None` when the node turns out to fit after all (the caller falls back to
/// `place_on_node`).
pub fn reject_reason(node: &Node, req: &PodRequest, how: &GpuChoice<'_>, unresolvable: bool) -> Option<Infeasible> {
    rejection(node, req, how, unresolvable, true)
}

/// [`reject_reason`] without the detail (left empty): the cause alone is what kube-scheduler gets,
/// for every rejected node, and writing the detail is most of the cost.
pub fn reject_cause(node: &Node, req: &PodRequest, how: &GpuChoice<'_>, unresolvable: bool) -> Option<Infeasible> {
    rejection(node, req, how, unresolvable, false)
}

fn rejection(node: &Node, req: &PodRequest, how: &GpuChoice<'_>, unresolvable: bool, want: bool) -> Option<Infeasible> {
    if let Err(why) = model_check(node, req, want) {
        return Some(why);
    }
    let allows = |m: &str| req.allows_model(m);
    let mut state = if unresolvable { FreeState::empty(node, allows) } else { FreeState::current(node, allows) };
    let attempt = match early_failure(node, req, &state) {
        Some((container, cause)) => Err(Failure { container, cause }),
        None => assign(node, req, &mut state, how).map(|_| ()),
    };
    let gpu = match attempt {
        Ok(()) => {
            // fits on the GPUs: the rejection can only be the host's (same precedence as below)
            return host_check(node, req, want).err().filter(|h| h.is_unresolvable() == unresolvable);
        }
        Err(f) if unresolvable => Infeasible::Unresolvable(f.why(node, &state, want)),
        Err(f) => Infeasible::Preemptable(f.why(node, &state, want)),
    };
    Some(match (host_check(node, req, want), gpu) {
        (Err(host @ Infeasible::Unresolvable(_)), _) => host,
        (_, gpu) => gpu,
    })
}

/// Where the pod's containers would go on this node now, or why they cannot (with the detail).
pub fn place_on_node(node: &Node, req: &PodRequest, how: &GpuChoice<'_>) -> Result<Placement, Infeasible> {
    model_check(node, req, true)?;
    let allows = |m: &str| req.allows_model(m);
    let mut current = FreeState::current(node, allows);
    let result = match assign(node, req, &mut current, how) {
        Ok(r) => Ok(r),
        Err(now) => {
            let mut empty = FreeState::empty(node, allows);
            match assign(node, req, &mut empty, how) {
                Err(ever) => Err(Infeasible::Unresolvable(ever.why(node, &empty, true))),
                Ok(_) => Err(Infeasible::Preemptable(now.why(node, &current, true))),
            }
        }
    };
    let (containers, set_scores) = match result {
        Ok(r) => {
            host_check(node, req, true)?;
            r
        }
        Err(e) => {
            // an unresolvable host shortfall outranks a GPU shortfall that preemption could fix
            return Err(match (host_check(node, req, true), e) {
                (Err(host @ Infeasible::Unresolvable(_)), _) => host,
                (_, gpu) => gpu,
            });
        }
    };
    Ok(Placement {
        assignment: PodAssignment {
            pod: req.key.clone(),
            node: node.name.clone(),
            containers,
            cpu_milli: req.cpu_milli,
            memory_mib: req.memory_mib,
            group: req.group.as_ref().map(|g| g.key.clone()),
        },
        set_scores,
    })
}

/// A slice larger than every GPU the pod may use in the whole cluster: it can never fit, whatever
/// is freed or evicted, and the reason says so instead of reading like a full cluster. Its text is
/// the same on every node (kube-scheduler groups nodes by reason) and has no `%`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Oversized {
    /// The memory the pod asks of one GPU (its largest container's slice).
    pub mib: u64,
    /// The largest GPU of the cluster (of the models the pod allows).
    pub largest_mib: u64,
    /// The pod names GPU models.
    pub models: bool,
}

impl fmt::Display for Oversized {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // short: kube-scheduler writes it once per group of nodes into an Event of at most 1,024 characters
        let which = if self.models { "its models' largest GPU" } else { "the largest GPU" };
        write!(f, "asks {} MiB of one GPU; {which} has {} MiB", self.mib, self.largest_mib)
    }
}

/// The largest GPU memory of each model in the cluster (models lower-cased): what [`oversized`]
/// compares with. Every GPU counts, healthy or not: an unhealthy one may come back.
pub fn largest_gpus<'a>(nodes: impl IntoIterator<Item = &'a Node>) -> std::collections::HashMap<String, u64> {
    let mut out = std::collections::HashMap::new();
    for g in nodes.into_iter().flat_map(|n| &n.gpus) {
        let m = out.entry(g.model.to_lowercase()).or_insert(0);
        *m = (*m).max(g.memory_mib);
    }
    out
}

/// Whether `req` asks one GPU for more memory than any GPU of `largest` ([`largest_gpus`]) of a
/// model it allows has. `None` also when no GPU of an allowed model exists (each node then says so).
pub fn oversized(req: &PodRequest, largest: &std::collections::HashMap<String, u64>) -> Option<Oversized> {
    let mib = req
        .containers
        .iter()
        .chain(&req.init_containers)
        .filter_map(|c| match c.demand {
            GpuDemand::Shared { memory: MemoryDemand::Mib(m), .. } => Some(m),
            _ => None,
        })
        .max()?;
    let largest_mib = largest.iter().filter(|(model, _)| req.allows_model(model)).map(|(_, &m)| m).max()?;
    (mib > largest_mib).then_some(Oversized { mib, largest_mib, models: !req.allowed_models.is_empty() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::test_fixtures::node;
    use gpuplace_core::cluster::Cluster;
    use gpuplace_core::resources::NumaPolicy;

    fn how() -> GpuChoice<'static> {
        GpuChoice {
            policy: PackingPolicy::Binpack,
            numa: NumaPolicy::Preferred,
            share: ShareChoice::Pack(PackingPolicy::Binpack),
        }
    }

    /// `mem` MiB and `core` percent taken on each listed GPU of `node`.
    fn hold(c: &mut Cluster, pod: &str, node: &str, gpus: &[u32], mem: u64, core: u32, exclusive: bool) {
        let slices = gpus.iter().map(|&gpu| GpuSlice { gpu, mem_mib: mem, core_pct: core, exclusive }).collect();
        let a = PodAssignment {
            pod: pod.into(),
            node: node.into(),
            containers: vec![ContainerAssignment { name: "c".into(), init: false, slices }],
            cpu_milli: 0,
            memory_mib: 0,
            group: None,
        };
        c.allocate(a).unwrap();
    }

    fn rejected(c: &Cluster, node: &str, req: &PodRequest) -> Infeasible {
        place_on_node(c.node(node).unwrap(), req, &how()).unwrap_err()
    }

    #[test]
    fn nodes_short_of_the_same_thing_share_a_cause_and_keep_their_figures_in_the_detail() {
        let mut c = Cluster::new(vec![node("a", 4), node("b", 4), node("c", 4).with_slots_per_gpu(Some(1))]);
        // a: 500 MiB free per GPU, b: 300 MiB; c: every GPU has room but its one slot is taken
        hold(&mut c, "ns/a", "a", &[0, 1, 2, 3], 500, 10, false);
        hold(&mut c, "ns/b", "b", &[0, 1, 2, 3], 700, 10, false);
        hold(&mut c, "ns/c", "c", &[0, 1, 2, 3], 10, 1, false);
        let share = GpuDemand::Shared { gpus: 1, memory: MemoryDemand::Mib(600), core_pct: 30 };
        let req = PodRequest::single("ns/p", share);
        let (a, b) = (rejected(&c, "a", &req), rejected(&c, "b", &req));
        assert_eq!((a.cause(), b.cause()), (Cause::Room { demand: share }, Cause::Room { demand: share }));
        assert_eq!(a.cause().to_string(), "no GPU with 600 MiB and 30 percent free");
        assert!(a.detail().contains("most free is 500 MiB") && b.detail().contains("most free is 300 MiB"));
        assert!(!a.is_unresolvable(), "fits on the emptied node");
        assert_eq!(rejected(&c, "c", &req).cause(), Cause::Slots);

        // whole GPUs: one node with one idle GPU, one with none, one too small
        let whole = PodRequest::single("ns/w2", GpuDemand::Whole { gpus: 2 });
        let mut c = Cluster::new(vec![node("x", 4), node("y", 4), node("z", 1)]);
        hold(&mut c, "ns/x", "x", &[0, 1, 2], 1000, 100, true);
        hold(&mut c, "ns/y", "y", &[0, 1, 2, 3], 1000, 100, true);
        let (x, y, z) = (rejected(&c, "x", &whole), rejected(&c, "y", &whole), rejected(&c, "z", &whole));
        assert_eq!((x.cause(), y.cause()), (Cause::Idle { gpus: 2 }, Cause::Idle { gpus: 2 }));
        assert_ne!(x.detail(), y.detail(), "{} / {}", x.detail(), y.detail());
        assert_eq!((z.cause(), z.is_unresolvable()), (Cause::TooFewGpus { gpus: 2 }, true));
        let mut sick = c.node("x").unwrap().clone();
        for g in 0..4 {
            sick.set_gpu_health(g, false);
        }
        assert_eq!(place_on_node(&sick, &whole, &how()).unwrap_err().cause(), Cause::NoUsableGpu);
        // the cheap form finds the same cause and leaves the detail out
        let y_node = c.node("y").unwrap();
        let cheap = reject_cause(y_node, &whole, &how(), false).unwrap();
        assert_eq!((cheap.cause(), cheap.detail()), (Cause::Idle { gpus: 2 }, ""));
        assert_eq!(reject_reason(y_node, &whole, &how(), false).as_ref(), Some(&y));
    }

    #[test]
    fn a_slice_no_gpu_of_the_cluster_holds_is_named_as_never_fitting() {
        let c = Cluster::new(vec![node("a", 4), node("b", 2)]);
        let largest = largest_gpus(c.nodes());
        let biggest = c.nodes().iter().flat_map(|n| &n.gpus).map(|g| g.memory_mib).max().unwrap();
        let share = |mib| GpuDemand::Shared { gpus: 1, memory: MemoryDemand::Mib(mib), core_pct: 30 };
        let o = oversized(&PodRequest::single("ns/big", share(200_000)), &largest).unwrap();
        assert_eq!(o.to_string(), format!("asks 200000 MiB of one GPU; the largest GPU has {biggest} MiB"));
        assert!(!o.to_string().contains('%'));
        // what fits the largest GPU, compute alone and whole GPUs are never oversized
        assert_eq!(oversized(&PodRequest::single("ns/p", share(biggest)), &largest), None);
        let by_core = GpuDemand::Shared { gpus: 1, memory: MemoryDemand::ProportionalToCore, core_pct: 90 };
        assert_eq!(oversized(&PodRequest::single("ns/p", by_core), &largest), None);
        assert_eq!(oversized(&PodRequest::single("ns/p", GpuDemand::Whole { gpus: 8 }), &largest), None);
        // with models named, the largest of those; none of them at all is each node's to say
        let mut req = PodRequest::single("ns/big", share(200_000));
        let model = c.nodes()[0].gpus[0].model.clone();
        req.allowed_models = vec![model.to_uppercase()];
        assert!(oversized(&req, &largest).unwrap().to_string().contains("its models' largest GPU has"));
        req.allowed_models = vec!["no-such-model".into()];
        assert_eq!(oversized(&req, &largest), None);
        // as short as the other reasons at the largest figures the contract allows (1 TiB per GPU)
        let widest = Oversized { mib: 1 << 20, largest_mib: 1 << 20, models: true }.to_string();
        assert!(widest.len() <= 68, "{widest} ({})", widest.len());
    }

    #[test]
    fn cause_texts_are_short_and_never_carry_a_percent_sign() {
        let mut causes = vec![
            Cause::UnknownNode,
            Cause::Model,
            Cause::Isolation,
            Cause::NoUsableGpu,
            Cause::Slots,
            Cause::Cpu { milli: 64_000 },
            Cause::Memory { mib: 1 << 20 },
        ];
        for gpus in [1, 2, 8, 64] {
            causes.extend([Cause::TooFewGpus { gpus }, Cause::Idle { gpus }]);
            for memory in [MemoryDemand::Mib(1 << 20), MemoryDemand::Mib(1), MemoryDemand::ProportionalToCore] {
                for core_pct in [0, 1, 30, 100] {
                    let demand = GpuDemand::Shared { gpus, memory, core_pct };
                    causes.extend([Cause::Room { demand }, Cause::Numa { demand }]);
                }
            }
            causes.push(Cause::Numa { demand: GpuDemand::Whole { gpus } });
        }
        for c in causes {
            let text = c.to_string();
            assert!(!text.contains('%') && text.len() <= 68, "{c:?}: {text} ({})", text.len());
        }
    }
}
