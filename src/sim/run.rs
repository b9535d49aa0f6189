//! One replay: pods arrive in the seed's order and are placed once (no retries, no departures);
//! after each arrival the allocation and fragmentation are recorded.

use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::placement::mix::WorkloadMix;
use crate::placement::profile::ProfileConfig;
use crate::sim::arrivals::{is_job, rearrange, Arrival};
use crate::sim::policies::{Choice, MixSource, Policy, PolicyKind};
use crate::sim::protocol::{arrival_order, gpu_milli_total};
use crate::sim::state::SimState;
use crate::sim::trace::{TraceNode, TracePod};

/// Arrived-workload columns reported, as % of cluster GPU capacity (the paper's 0..130).
pub const MAX_COLUMN: usize = 130;

/// What one pod's arrival left behind.
#[derive(Debug, Clone, Copy)]
struct Event {
    arrived_milli: u64,
    used_milli: u64,
    frag_milli: f64,
    idle_milli: u64,
}

/// Results of one seed.
#[derive(Debug, Clone)]
pub struct SeedResult {
    pub seed: u64,
    /// GPU allocation ratio (%) per arrived-workload column (`None` where no pod arrived near it).
    pub allocated_pct: Vec<Option<f64>>,
    /// Fragment rate (% of idle GPU that is fragmented) per column.
    pub frag_rate_pct: Vec<Option<f64>>,
    pub pods: usize,
    pub failed_pods: usize,
    pub wall_s: f64,
    /// Groups of the replay (none without `gangs=P`).
    pub groups: GroupOutcome,
    /// Jobs of the replay: groups, and pods of two or more GPUs (`sim::arrivals`).
    pub jobs: JobOutcome,
    /// Where the first pod was turned away: the workload arrived so far, % of GPU capacity (`None`:
    /// none was).
    pub first_refusal_pct: Option<f64>,
    /// Pods turned away while 75 to 100 % of the capacity had arrived: the part of the curve a
    /// cluster lives in.
    pub refused_75_to_100: usize,
}

/// How a replay's jobs fared: groups and pods of two or more GPUs, each counted once.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct JobOutcome {
    pub jobs: usize,
    /// Not started whole (the replay has no retries: a job that is turned away waits for good).
    pub waited: usize,
    /// Of those, the ones that arrived while the cluster had as many idle GPUs as they need: room
    /// that shares and other pods held in pieces.
    pub waited_with_room: usize,
    /// Summed over job arrivals: GPUs holding shares on nodes that hold nothing but shares.
    pub share_gpus_alone_sum: f64,
}

impl JobOutcome {
    /// GPUs holding shares on nodes that hold nothing but shares (pods of part of a GPU).
    fn share_gpus_alone(state: &SimState) -> f64 {
        let mut held = 0usize;
        for n in state.cluster.nodes() {
            let mut any = false;
            let mut gpus = 0u64;
            let only_shares = n.pods().all(|p| {
                p.containers.iter().flat_map(|c| &c.slices).all(|s| {
                    any = true;
                    gpus |= 1u64 << (s.gpu % 64);
                    !s.exclusive
                })
            });
            if any && only_shares {
                held += gpus.count_ones() as usize;
            }
        }
        held as f64
    }

    /// Idle GPUs (nothing allocated on them) in the cluster.
    fn idle_gpus(state: &SimState) -> u64 {
        state.cluster.nodes().iter().map(|n| n.idle_gpus() as u64).sum()
    }
}

/// How a replay's groups ended (no departures: a group partly placed holds its GPUs to the end).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GroupOutcome {
    pub groups: usize,
    /// Every member placed.
    pub whole: usize,
    /// Some members placed, not all.
    pub partial: usize,
    /// GPUs (a share as its fraction) held by the placed members of partial groups.
    pub gpus_held_by_incomplete: f64,
    /// Sum and maximum, over whole groups, of the leaf switches their members span.
    pub tors_spanned_sum: usize,
    pub tors_spanned_max: usize,
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round_ties_even() / 100.0
}

/// How the `gpuplace` policy is set up in a replay (the other policies ignore it).
#[derive(Debug, Clone, Copy)]
pub struct GpuplaceSetup<'a> {
    pub profile: &'a ProfileConfig,
    pub mix: MixSource,
}

/// How much of the workload arrives (`tune` times the cluster's GPU capacity) and in which order.
#[derive(Debug, Clone, Copy)]
pub struct Size {
    pub tune: f64,
    pub arrival: Arrival,
}

/// Replays `pods` on `nodes` under `kind` with the seed's arrival order, resized and rearranged as
/// `size` says (`sim::protocol`, `sim::arrivals`). `mix` is the whole
/// workload's typical mix: FGD's (as the paper defines it), and the reported fragment rate's.
pub fn run_seed(
    nodes: &[TraceNode],
    pods: &[TracePod],
    mix: &WorkloadMix,
    kind: PolicyKind,
    gpuplace: GpuplaceSetup<'_>,
    seed: u64,
    size: Size,
) -> SeedResult {
    let start = Instant::now();
    let state = SimState::new(nodes, mix.clone());
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let order = rearrange(arrival_order(pods, state.capacity_milli, size.tune, &mut rng), size.arrival);
    place_in_order(state, &order, kind, gpuplace, seed, rng, start)
}

/// Replays `order` as given, neither shuffled nor resized (`simulate --from-placement-log`: the
/// log's own order); the seed only drives the policies' random choices.
pub fn run_in_order(
    nodes: &[TraceNode],
    order: &[TracePod],
    mix: &WorkloadMix,
    kind: PolicyKind,
    gpuplace: GpuplaceSetup<'_>,
    seed: u64,
) -> SeedResult {
    let start = Instant::now();
    let state = SimState::new(nodes, mix.clone());
    place_in_order(state, order, kind, gpuplace, seed, ChaCha8Rng::seed_from_u64(seed), start)
}

/// Places each pod of `order` in turn and records what each arrival left behind.
fn place_in_order(
    mut state: SimState,
    order: &[TracePod],
    kind: PolicyKind,
    gpuplace: GpuplaceSetup<'_>,
    seed: u64,
    mut rng: ChaCha8Rng,
    start: Instant,
) -> SeedResult {
    let mut policy = Policy::new(kind, &state, gpuplace.profile, gpuplace.mix);
    let mut events = Vec::with_capacity(order.len());
    let mut arrived = 0u64;
    let mut failed = 0usize;
    let (mut first_refusal_pct, mut refused_75_to_100) = (None, 0usize);
    let mut groups = GroupOutcome::default();
    let mut jobs = JobOutcome::default();
    // the job arriving now: its last pod's index, whether it had room on arrival, its pods placed
    let mut job: Option<(usize, bool, usize)> = None;
    // a group's members arrive together (`order[group_start..group_end]`): its plan, if the policy
    // makes plans, is made at the first; otherwise its members are placed one by one as they come
    let mut planned: Vec<Option<Choice>> = Vec::new();
    let (mut group_start, mut group_end) = (0usize, 0usize);
    let mut group_placed: Vec<usize> = Vec::new();
    for (at, pod) in order.iter().enumerate() {
        arrived += gpu_milli_total(pod);
        if at >= group_end {
            if let Some(g) = &pod.group {
                let members = order[at..].iter().take_while(|p| p.group.as_ref() == Some(g)).count();
                (group_start, group_end) = (at, at + members);
                planned = if policy.plans_groups() {
                    // no plan: no member is placed
                    policy
                        .plan_group(&mut state, &order[at..group_end])
                        .map_or_else(|| vec![None; members], |choices| choices.into_iter().map(Some).collect())
                } else {
                    Vec::new()
                };
                group_placed.clear();
                groups.groups += 1;
            }
        }
        let in_group = at < group_end;
        if job.is_none_or(|(last, _, _)| at > last) {
            let unit = if in_group { &order[group_start..group_end] } else { std::slice::from_ref(pod) };
            let start_of_unit = !in_group || at == group_start;
            if start_of_unit && is_job(unit) {
                let need = unit.iter().map(gpu_milli_total).sum::<u64>().div_ceil(1000);
                jobs.jobs += 1;
                jobs.share_gpus_alone_sum += JobOutcome::share_gpus_alone(&state);
                let room = JobOutcome::idle_gpus(&state) >= need;
                job = Some((at + unit.len() - 1, room, 0));
            }
        }
        let choice = if in_group && !planned.is_empty() {
            planned.get(at - group_start).cloned().flatten()
        } else {
            policy.choose(&state, pod, &mut rng)
        };
        let placed = match choice {
            Some((node, gpus)) => match state.apply(node, pod, &gpus) {
                Ok(()) => {
                    if in_group {
                        group_placed.push(node);
                    }
                    true
                }
                Err(e) => {
                    // a policy bug, never a silent over-commit: count it and say so
                    tracing::error!(policy = %kind, pod = %pod.name, error = %e, "placement refused by the cluster model");
                    false
                }
            },
            None => false,
        };
        if in_group && at + 1 == group_end {
            groups.record(&state, &order[group_start..group_end], &group_placed);
        }
        if let Some((last, room, placed_so_far)) = job.as_mut() {
            if at <= *last {
                *placed_so_far += usize::from(placed);
                if at == *last {
                    let members = if in_group { group_end - group_start } else { 1 };
                    if *placed_so_far < members {
                        jobs.waited += 1;
                        jobs.waited_with_room += usize::from(*room);
                    }
                }
            }
        }
        failed += usize::from(!placed);
        if !placed {
            let arrived_pct = arrived as f64 / state.capacity_milli.max(1) as f64 * 100.0;
            first_refusal_pct.get_or_insert(arrived_pct);
            refused_75_to_100 += usize::from((75.0..=100.0).contains(&arrived_pct));
            // which pods a policy turns away, and how full the cluster was (RUST_LOG=gpuplace::sim=debug)
            tracing::debug!(
                policy = %kind,
                seed,
                pod = %pod.name,
                gpus = pod.num_gpu,
                gpu_milli = pod.gpu_milli,
                cpu_milli = pod.cpu_milli,
                memory_mib = pod.memory_mib,
                gpu_spec = %pod.gpu_spec,
                arrived_pct = arrived as f64 / state.capacity_milli as f64 * 100.0,
                used_pct = state.used_milli() as f64 / state.capacity_milli as f64 * 100.0,
                "pod not placed"
            );
        }
        events.push(Event {
            arrived_milli: arrived,
            used_milli: state.used_milli(),
            frag_milli: state.frag_total,
            idle_milli: state.idle_total,
        });
    }
    let total_gpus = state.capacity_milli as f64 / 1000.0;
    let (allocated_pct, frag_rate_pct) = discretize(&events, total_gpus);
    SeedResult {
        seed,
        allocated_pct,
        frag_rate_pct,
        pods: order.len(),
        failed_pods: failed,
        wall_s: start.elapsed().as_secs_f64(),
        groups,
        jobs,
        first_refusal_pct,
        refused_75_to_100,
    }
}

impl GroupOutcome {
    /// Counts one group whose members (in order) were placed on `nodes` (one per placed member).
    fn record(&mut self, state: &SimState, members: &[TracePod], nodes: &[usize]) {
        if nodes.len() == members.len() {
            self.whole += 1;
            let tor = gpuplace_core::cluster::DEFAULT_NETWORK_LEVELS[1];
            let tors: std::collections::BTreeSet<&str> = nodes
                .iter()
                .filter_map(|&n| state.cluster.nodes().get(n)?.labels.get(tor).map(String::as_str))
                .collect();
            self.tors_spanned_sum += tors.len();
            self.tors_spanned_max = self.tors_spanned_max.max(tors.len());
        } else if !nodes.is_empty() {
            self.partial += 1;
            // the members that were placed (any of them may be the one left out)
            self.gpus_held_by_incomplete += members
                .iter()
                .filter(|p| state.cluster.assignment(&p.name).is_some())
                .map(|p| gpu_milli_total(p) as f64 / 1000.0)
                .sum::<f64>();
        }
    }
}

/// Buckets events by arrived workload (% of capacity, rounded half to even) as the paper's scripts do:
/// a column averages the events that round to it, or those within one point when none do.
fn discretize(events: &[Event], total_gpus: f64) -> (Vec<Option<f64>>, Vec<Option<f64>>) {
    let arr: Vec<f64> = events.iter().map(|e| (e.arrived_milli as f64 / total_gpus / 10.0).round_ties_even()).collect();
    let alloc: Vec<f64> = events.iter().map(|e| round2(e.used_milli as f64 / total_gpus / 10.0)).collect();
    let ratio: Vec<f64> = events
        .iter()
        .map(|e| if e.idle_milli == 0 { 0.0 } else { 100.0 * e.frag_milli / e.idle_milli as f64 })
        .collect();
    let mut a = Vec::with_capacity(MAX_COLUMN + 1);
    let mut f = Vec::with_capacity(MAX_COLUMN + 1);
    for k in 0..=MAX_COLUMN {
        let k = k as f64;
        let mut rows: Vec<usize> = (0..events.len()).filter(|&i| arr[i] == k).collect();
        if rows.is_empty() {
            rows = (0..events.len()).filter(|&i| arr[i] >= k - 1.0 && arr[i] <= k + 1.0).collect();
        }
        if rows.is_empty() {
            a.push(None);
            f.push(None);
            continue;
        }
        let n = rows.len() as f64;
        a.push(Some(round2(rows.iter().map(|&i| alloc[i]).sum::<f64>() / n)));
        f.push(Some(rows.iter().map(|&i| ratio[i]).sum::<f64>() / n));
    }
    (a, f)
}
