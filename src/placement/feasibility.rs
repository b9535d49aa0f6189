//! Whether and how a pod fits on one node, with the exact GPUs it would get, and a reason a person
//! understands when it does not.
//!
//! This is the straightforward form of the placement rules. Ranking many nodes goes through
//! [`compact`](crate::placement::compact), which makes the same choices without allocating; this
//! path serves nodes too large for it and writes the reasons, and tests hold the two equal.

use crate::core::cluster::{ContainerAssignment, GpuSlice, Node, PodAssignment};
use crate::core::resources::{ContainerDemand, GpuDemand, NumaPolicy, PackingPolicy, PodRequest};
use crate::placement::gpu_select::{choose_one, choose_set, FreeState, ShareChoice};

/// Why a pod does not fit on a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Infeasible {
    /// Would not fit even on the node emptied of every pod: preemption cannot help.
    Unresolvable(String),
    /// Fits on the empty node, so evicting pods could make room.
    Preemptable(String),
}

impl Infeasible {
    pub fn reason(&self) -> &str {
        match self {
            Infeasible::Unresolvable(r) | Infeasible::Preemptable(r) => r,
        }
    }

    pub fn is_unresolvable(&self) -> bool {
        matches!(self, Infeasible::Unresolvable(_))
    }
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

/// The error [`assign`] returns when the first container it places has fewer GPUs to choose from
/// than it needs (the usual rejection), worked out without its bookkeeping; `None` otherwise.
fn early_failure(node: &Node, req: &PodRequest, state: &FreeState) -> Option<String> {
    // the first of `container_order` (a stable sort: the lowest index among the largest)
    let c = req.containers.iter().min_by_key(|c| order_key(c))?;
    let k = c.demand.gpus() as usize;
    let fitting = (0..node.gpus.len()).filter(|&g| state.fits(node, g, &c.demand)).count();
    (fitting < k).then(|| format!("{}; {}", describe(node, c), capacity_summary(node, state, &c.demand)))
}

/// Places containers on `state` (mutated). Returns the container assignments in spec order.
fn assign(
    node: &Node,
    req: &PodRequest,
    mut state: FreeState,
    how: &GpuChoice<'_>,
) -> Result<(Vec<ContainerAssignment>, Vec<u32>), String> {
    let before = state.clone();
    let order = container_order(req);
    let mut out: Vec<Option<(ContainerAssignment, u32)>> = vec![None; req.containers.len()];
    for i in order {
        let c = &req.containers[i];
        let (slices, score) = place_container(node, &mut state, c, how, &[])?;
        out[i] = Some((ContainerAssignment { name: c.name.clone(), init: false, slices }, score));
    }
    let (mut containers, mut scores): (Vec<_>, Vec<_>) = out.into_iter().flatten().unzip();
    // Each init container runs alone before the app containers: it may use what was free before this
    // pod, and reusing the app containers' GPUs costs nothing extra.
    let app_gpus: Vec<usize> = containers.iter().flat_map(|c| c.slices.iter().map(|s| s.gpu as usize)).collect();
    for c in &req.init_containers {
        let mut init_state = before.clone();
        let (slices, score) = place_container(node, &mut init_state, c, how, &app_gpus)?;
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
) -> Result<(Vec<GpuSlice>, u32), String> {
    let k = c.demand.gpus() as usize;
    let all: Vec<usize> = (0..node.gpus.len()).filter(|&g| state.fits(node, g, &c.demand)).collect();
    let preferred: Vec<usize> = all.iter().copied().filter(|g| prefer.contains(g)).collect();
    let fail = |state: &FreeState| format!("{}; {}", describe(node, c), capacity_summary(node, state, &c.demand));
    if all.len() < k {
        return Err(fail(state));
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
    let chosen = pick(&preferred)
        .or_else(|| pick(&all))
        .ok_or_else(|| format!("{}; numa: required and no NUMA node has {k} such GPUs", describe(node, c)))?;
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

fn host_check(node: &Node, req: &PodRequest) -> Result<(), Infeasible> {
    for (what, need, cap, free) in [
        ("millicores of CPU", req.cpu_milli, node.cpu_milli, node.cpu_free()),
        ("MiB of host memory", req.memory_mib, node.memory_mib, node.mem_free()),
    ] {
        if cap == 0 || need == 0 {
            continue;
        }
        if need > cap {
            return Err(Infeasible::Unresolvable(format!("needs {need} {what}; node has {cap}")));
        }
        if need > free {
            return Err(Infeasible::Preemptable(format!("needs {need} {what}; {free} free")));
        }
    }
    Ok(())
}

fn model_check(node: &Node, req: &PodRequest) -> Result<(), Infeasible> {
    if !req.allowed_models.is_empty() && !node.gpus.iter().any(|g| req.allows_model(&g.model)) {
        let have: Vec<&str> = {
            let mut m: Vec<&str> = node.gpus.iter().map(|g| g.model.as_str()).collect();
            m.dedup();
            m
        };
        return Err(Infeasible::Unresolvable(format!(
            "gpu-model {:?} allowed; node has {:?}",
            req.allowed_models, have
        )));
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
    if let Err(why) = model_check(node, req) {
        return Some(why);
    }
    let allows = |m: &str| req.allows_model(m);
    let state = if unresolvable { FreeState::empty(node, allows) } else { FreeState::current(node, allows) };
    let attempt = match early_failure(node, req, &state) {
        Some(e) => Err(e),
        None => assign(node, req, state, how).map(|_| ()),
    };
    let gpu = match attempt {
        Ok(()) => {
            // fits on the GPUs: the rejection can only be the host's (same precedence as below)
            return host_check(node, req).err().filter(|h| h.is_unresolvable() == unresolvable);
        }
        Err(e) if unresolvable => Infeasible::Unresolvable(e),
        Err(e) => Infeasible::Preemptable(e),
    };
    Some(match (host_check(node, req), gpu) {
        (Err(host @ Infeasible::Unresolvable(_)), _) => host,
        (_, gpu) => gpu,
    })
}

/// Where the pod's containers would go on this node now, or why they cannot.
pub fn place_on_node(node: &Node, req: &PodRequest, how: &GpuChoice<'_>) -> Result<Placement, Infeasible> {
    model_check(node, req)?;
    let allows = |m: &str| req.allows_model(m);
    let current = FreeState::current(node, allows);
    let result = match assign(node, req, current, how) {
        Ok(r) => Ok(r),
        Err(now) => match assign(node, req, FreeState::empty(node, allows), how) {
            Err(ever) => Err(Infeasible::Unresolvable(ever)),
            Ok(_) => Err(Infeasible::Preemptable(now)),
        },
    };
    let (containers, set_scores) = match result {
        Ok(r) => {
            host_check(node, req)?;
            r
        }
        Err(e) => {
            // an unresolvable host shortfall outranks a GPU shortfall that preemption could fix
            return Err(match (host_check(node, req), e) {
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
