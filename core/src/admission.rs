//! Which pods bound to one node the node's device plugin could confuse when kubelet admits them.
//!
//! kubelet's `Allocate` carries device IDs, never the pod (docs/device-plugin.md). The device plugin
//! tells the pods waiting on its node apart by the GPU set each container was assigned; pods whose
//! containers wait for the same GPU set are told apart by nothing, and kubelet may admit them in any
//! order (after a kubelet restart it admitted two share pods in the opposite order to their bind
//! order, and each ran with the other's memory and compute limits: issue 28). This is the rule both
//! sides apply, pure, so that a container never starts with another pod's limits:
//!
//! - [`interchangeable`]: two pods whose GPU containers, in kubelet's admission order, have the same
//!   GPUs and the same slices (memory, compute, exclusive flag), and no GPU set of theirs appears
//!   with two different slices. Whichever of them kubelet admits, matching it with either gives every
//!   container the right limits; only the record of which pod got which devices may name the twin,
//!   and the device plugin corrects that from kubelet's pod-resources API.
//! - [`confusable`]: two pods with a container each on one GPU set that are not interchangeable. The
//!   extender never has two such pods waiting for their Allocate on a node at once (its bind waits
//!   until the first is [`admitted`]); the device plugin refuses an Allocate for which it finds two
//!   of them waiting rather than guess.
//! - [`admitted`]: the device plugin's `gpuplace.io/allocated` marker confirms every GPU container of
//!   the pod (a container matched among interchangeable twins counts only once pod-resources has
//!   confirmed or corrected it).
//!
//! Pods without a shared GPU set are never confused: the plugin matches an Allocate only to a
//! container whose assigned GPU set equals the GPUs of the devices kubelet sent.

use crate::annotations::AllocatedAnnotation;
use crate::assignment::{ContainerAssignment, GpuSlice, PodAssignment};

/// The containers kubelet allocates devices for, in its order: init containers, then app
/// containers, each in listed order; containers without GPUs are not allocated by the plugin.
pub fn admission_order(a: &PodAssignment) -> impl Iterator<Item = &ContainerAssignment> {
    let inits = a.containers.iter().filter(|c| c.init);
    let apps = a.containers.iter().filter(|c| !c.init);
    inits.chain(apps).filter(|c| !c.slices.is_empty())
}

/// A container's GPU indices, sorted, each once: what an Allocate for it names.
pub fn gpu_set(c: &ContainerAssignment) -> Vec<u32> {
    let mut g: Vec<u32> = c.slices.iter().map(|s| s.gpu).collect();
    g.sort_unstable();
    g.dedup();
    g
}

/// A container's slices sorted by GPU index: the limits it is started with.
pub fn sorted_slices(c: &ContainerAssignment) -> Vec<GpuSlice> {
    let mut s = c.slices.clone();
    s.sort_by_key(|s| s.gpu);
    s
}

/// What the device plugin can see of a pod: per container in admission order, whether it is an init
/// container and its slices.
pub fn signature(a: &PodAssignment) -> Vec<(bool, Vec<GpuSlice>)> {
    admission_order(a).map(|c| (c.init, sorted_slices(c))).collect()
}

/// Whether the containers of `a` from its `i`th in admission order on have the limits of those of `b`
/// from its `j`th on, one for one. When the plugin matched `a`'s `i`th container for an Allocate that
/// was `b`'s `j`th, each later Allocate of `b`'s admission then finds a container of `a` with its
/// limits waiting: the guess stays harmless to the end of that admission.
pub fn same_from(a: &PodAssignment, i: usize, b: &PodAssignment, j: usize) -> bool {
    let (sa, sb) = (signature(a), signature(b));
    sa.get(i..).is_some_and(|x| sb.get(j..).is_some_and(|y| x == y))
}

/// No GPU set of the pod appears with two different slices: otherwise the plugin, having matched one
/// twin's container in the other's place, could not know which of the two slices the next Allocate
/// on that set is for.
fn self_consistent(sig: &[(bool, Vec<GpuSlice>)]) -> bool {
    let same_set = |a: &[GpuSlice], b: &[GpuSlice]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.gpu == y.gpu);
    sig.iter().enumerate().all(|(i, (_, a))| sig[i + 1..].iter().all(|(_, b)| !same_set(a, b) || a == b))
}

/// See the module docs. Symmetric; container names do not matter (kubelet's call has none).
pub fn interchangeable(a: &PodAssignment, b: &PodAssignment) -> bool {
    let sig = signature(a);
    sig == signature(b) && self_consistent(&sig)
}

/// See the module docs. Symmetric.
pub fn confusable(a: &PodAssignment, b: &PodAssignment) -> bool {
    let sets_a: Vec<Vec<u32>> = admission_order(a).map(gpu_set).collect();
    let shares_a_set = admission_order(b).any(|c| sets_a.contains(&gpu_set(c)));
    shares_a_set && !interchangeable(a, b)
}

/// Whether the device plugin has given every GPU container of the pod (UID `uid`) its devices, as its
/// marker says: listed in `containers` and not among the `unconfirmed` matches. A marker written for
/// another UID (copied with a manifest) confirms nothing.
pub fn admitted(a: &PodAssignment, uid: &str, marker: Option<&AllocatedAnnotation>) -> bool {
    let Some(m) = marker.filter(|m| m.pod_uid == uid) else {
        return admission_order(a).next().is_none();
    };
    admission_order(a).all(|c| m.containers.contains(&c.name) && !m.unconfirmed.contains(&c.name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pod(name: &str, containers: &[(&str, bool, Vec<GpuSlice>)]) -> PodAssignment {
        PodAssignment {
            pod: name.into(),
            node: "n".into(),
            containers: containers
                .iter()
                .map(|(c, init, s)| ContainerAssignment { name: c.to_string(), init: *init, slices: s.clone() })
                .collect(),
            cpu_milli: 0,
            memory_mib: 0,
            group: None,
        }
    }

    fn share(gpu: u32, mem_mib: u64, core_pct: u32) -> GpuSlice {
        GpuSlice { gpu, mem_mib, core_pct, exclusive: false }
    }

    #[test]
    fn equal_slices_on_one_gpu_are_interchangeable_and_different_ones_confusable() {
        let a = pod("ns/a", &[("main", false, vec![share(1, 20480, 25)])]);
        let b = pod("ns/b", &[("worker", false, vec![share(1, 20480, 25)])]);
        let c = pod("ns/c", &[("main", false, vec![share(1, 10240, 10)])]);
        let d = pod("ns/d", &[("main", false, vec![share(2, 10240, 10)])]);
        // names differ, limits do not: either match is right
        assert!(interchangeable(&a, &b) && !confusable(&a, &b));
        // same GPU, other limits: only bind order would tell them apart
        assert!(!interchangeable(&a, &c) && confusable(&a, &c) && confusable(&c, &a));
        // another GPU: the Allocate's devices tell them apart
        assert!(!confusable(&c, &d));
        // the exclusive flag is part of the slice
        let whole = pod("ns/w", &[("main", false, vec![GpuSlice { exclusive: true, ..share(1, 20480, 25) }])]);
        assert!(confusable(&a, &whole));
    }

    #[test]
    fn pods_are_compared_whole_in_kubelets_order() {
        // the same init container, different app containers on another GPU: a guess at the init
        // container's Allocate would leave the app container with the wrong pod's limits
        let a = pod("ns/a", &[("app", false, vec![share(2, 5000, 50)]), ("init", true, vec![share(1, 1000, 10)])]);
        let b = pod("ns/b", &[("app", false, vec![share(2, 8000, 50)]), ("init", true, vec![share(1, 1000, 10)])]);
        assert!(confusable(&a, &b));
        // listed in another order but admitted in the same one (inits first): interchangeable
        let c = pod("ns/c", &[("init", true, vec![share(1, 1000, 10)]), ("app", false, vec![share(2, 5000, 50)])]);
        assert!(interchangeable(&a, &c));
        // one GPU set with two slices in a pod: never interchangeable, not even with its twin
        let twin = |n: &str| pod(n, &[("x", false, vec![share(1, 1000, 10)]), ("y", false, vec![share(1, 2000, 10)])]);
        assert!(confusable(&twin("ns/t1"), &twin("ns/t2")));
        // a two-GPU container and a one-GPU container on one of its GPUs: the device sets differ
        let pair = pod("ns/p", &[("main", false, vec![share(1, 1000, 10), share(2, 1000, 10)])]);
        assert!(!confusable(&pair, &a));
    }

    #[test]
    fn admitted_needs_every_gpu_container_confirmed_on_the_pods_own_marker() {
        let a = pod("ns/a", &[("app", false, vec![share(2, 5000, 50)]), ("init", true, vec![share(1, 1000, 10)])]);
        assert!(!admitted(&a, "u1", None));
        let m = AllocatedAnnotation::new("u1", ["app".to_string()]);
        assert!(!admitted(&a, "u1", Some(&m)));
        let m = AllocatedAnnotation::new("u1", ["app".to_string(), "init".to_string()]);
        assert!(admitted(&a, "u1", Some(&m)));
        // another pod's marker says nothing about this one
        assert!(!admitted(&a, "u2", Some(&m)));
        // a match among twins not confirmed by pod-resources yet
        let mut m = m;
        m.unconfirmed.insert("app".into());
        assert!(!admitted(&a, "u1", Some(&m)));
        // a pod without GPU containers has nothing to wait for
        assert!(admitted(&pod("ns/cpu", &[("main", false, vec![])]), "u1", None));
    }

    fn arb_pod(name: &'static str) -> impl Strategy<Value = PodAssignment> {
        // few GPUs and few sizes, so that shared sets and equal slices are common
        let container = (
            any::<bool>(),
            prop::collection::btree_set(0u32..3, 1..3),
            prop::sample::select(vec![1000u64, 2000]),
            prop::sample::select(vec![10u32, 20]),
        );
        prop::collection::vec(container, 1..4).prop_map(move |cs| {
            let containers: Vec<(String, bool, Vec<GpuSlice>)> = cs
                .into_iter()
                .enumerate()
                .map(|(i, (init, gpus, mem, core))| {
                    (format!("c{i}"), init, gpus.into_iter().map(|g| share(g, mem, core)).collect())
                })
                .collect();
            let refs: Vec<(&str, bool, Vec<GpuSlice>)> =
                containers.iter().map(|(n, i, s)| (n.as_str(), *i, s.clone())).collect();
            pod(name, &refs)
        })
    }

    proptest! {
        #[test]
        fn the_rule_is_symmetric_and_never_calls_confusable_pods_interchangeable(
            a in arb_pod("ns/a"), b in arb_pod("ns/b"),
        ) {
            prop_assert_eq!(interchangeable(&a, &b), interchangeable(&b, &a));
            prop_assert_eq!(confusable(&a, &b), confusable(&b, &a));
            prop_assert!(!(confusable(&a, &b) && interchangeable(&a, &b)));
            // a copy under other names is interchangeable unless the pod itself uses one set twice
            // with different slices
            let mut renamed = a.clone();
            for c in &mut renamed.containers {
                c.name.push('x');
            }
            prop_assert_eq!(interchangeable(&a, &renamed), self_consistent(&signature(&a)));
            // two pods with no GPU set in common are never confusable
            let sets_a: Vec<Vec<u32>> = admission_order(&a).map(gpu_set).collect();
            if admission_order(&b).all(|c| !sets_a.contains(&gpu_set(c))) {
                prop_assert!(!confusable(&a, &b));
            }
        }

        #[test]
        fn between_interchangeable_pods_any_container_on_a_set_has_the_limits_of_any_other(
            a in arb_pod("ns/a"), b in arb_pod("ns/b"),
        ) {
            // what lets the plugin guess: a container of one twin on a GPU set has the slices of
            // every container of the other twin on that set
            if interchangeable(&a, &b) {
                for x in admission_order(&a) {
                    for y in admission_order(&b).filter(|y| gpu_set(y) == gpu_set(x)) {
                        prop_assert_eq!(sorted_slices(x), sorted_slices(y));
                    }
                }
            }
        }
    }
}
