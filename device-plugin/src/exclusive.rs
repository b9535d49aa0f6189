//! No GPU that one pod holds exclusively is handed to another, and no GPU another pod holds is
//! handed to a pod that asks for it exclusively.
//!
//! The extender never assigns such a pair, and its signature makes a forged one unverifiable; this
//! is the node's own check, in case the extender's view was wrong (two leaders for a moment, a record
//! lost and assigned again). Among the pods on this node with a verified assignment (finished and
//! terminating pods excluded), two that both name a GPU, one of them exclusively, conflict. The one
//! that came first keeps its GPUs: a pod with a container already given its devices comes before one
//! with none, then the earlier bind (`bindSeq`), then the UID. The other is not a candidate for
//! Allocate until the first is gone, so its container is refused rather than started on a GPU that
//! is not free.

use std::cmp::Ordering;
use std::collections::HashMap;

use crate::assign::PendingPod;

/// Why a pod may not be given its GPUs now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", if *.holder_exclusive {
    format!("GPU {gpu} is held exclusively by pod {holder}")
} else {
    format!("it asks for GPU {gpu} exclusively, and pod {holder} holds a share of it")
})]
pub struct Conflict {
    pub gpu: u32,
    /// `namespace/name` of the pod that keeps the GPU.
    pub holder: String,
    /// The holder's slice of it is exclusive (else the refused pod's is).
    pub holder_exclusive: bool,
}

/// `a` before `b`: see the module docs.
fn order(a: &PendingPod, b: &PendingPod) -> Ordering {
    let started = |p: &PendingPod| !p.allocated.is_empty();
    started(b).cmp(&started(a)).then(a.bind_seq.cmp(&b.bind_seq)).then(a.key.uid.cmp(&b.key.uid))
}

/// Every pod of `pods` refused, by UID, with the conflict that refused it. `pods`: this node's live
/// pods with a verified assignment, allocated or not. Pods are taken in order and each keeps its
/// GPUs unless one taken before holds one of them in a way that excludes it, so a refused pod
/// refuses nobody.
pub fn conflicts(pods: &[PendingPod]) -> HashMap<String, Conflict> {
    let mut sorted: Vec<&PendingPod> = pods.iter().collect();
    sorted.sort_by(|a, b| order(a, b));
    // per GPU, the pods kept so far: (pod, its slice is exclusive)
    let mut kept: HashMap<u32, Vec<(&PendingPod, bool)>> = HashMap::new();
    let mut out = HashMap::new();
    for p in sorted {
        let slices = || p.assignment.containers.iter().flat_map(|c| &c.slices);
        let conflict = slices().find_map(|s| {
            let holders = kept.get(&s.gpu)?;
            let (q, q_excl) = holders.iter().find(|(q, q_excl)| q.key.uid != p.key.uid && (s.exclusive || *q_excl))?;
            Some(Conflict { gpu: s.gpu, holder: q.key.pod.clone(), holder_exclusive: *q_excl })
        });
        match conflict {
            Some(c) => {
                out.insert(p.key.uid.clone(), c);
            }
            None => {
                for s in slices() {
                    kept.entry(s.gpu).or_default().push((p, s.exclusive));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assign::pending_pod;
    use gpuplace_core::assignment::GpuSlice;

    fn whole(gpu: u32) -> GpuSlice {
        GpuSlice { gpu, mem_mib: 81559, core_pct: 100, exclusive: true }
    }

    fn share(gpu: u32) -> GpuSlice {
        GpuSlice { gpu, mem_mib: 4096, core_pct: 20, exclusive: false }
    }

    fn refused(pods: &[PendingPod]) -> Vec<(String, Conflict)> {
        let by_uid = conflicts(pods);
        let mut v: Vec<_> =
            pods.iter().filter_map(|p| by_uid.get(&p.key.uid).map(|c| (p.key.pod.clone(), c.clone()))).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    #[test]
    fn shares_live_together_and_whole_gpus_apart() {
        let pods = [
            pending_pod("ns/a", 1, &[("main", false, vec![share(0)])]),
            pending_pod("ns/b", 2, &[("main", false, vec![share(0)])]),
            pending_pod("ns/c", 3, &[("main", false, vec![whole(1), whole(2)])]),
            pending_pod("ns/d", 4, &[("main", false, vec![whole(3)])]),
        ];
        assert!(conflicts(&pods).is_empty());
    }

    #[test]
    fn the_later_pod_is_refused_whichever_side_is_exclusive() {
        // b asks for a whole GPU a shares; d shares a GPU c holds whole
        let pods = [
            pending_pod("ns/a", 1, &[("main", false, vec![share(0)])]),
            pending_pod("ns/b", 2, &[("main", false, vec![whole(0)])]),
            pending_pod("ns/c", 3, &[("main", false, vec![whole(5)])]),
            pending_pod("ns/d", 4, &[("main", false, vec![share(6)]), ("side", false, vec![share(5)])]),
        ];
        let r = refused(&pods);
        assert_eq!(
            r,
            [
                ("ns/b".into(), Conflict { gpu: 0, holder: "ns/a".into(), holder_exclusive: false }),
                ("ns/d".into(), Conflict { gpu: 5, holder: "ns/c".into(), holder_exclusive: true }),
            ]
        );
        assert_eq!(r[0].1.to_string(), "it asks for GPU 0 exclusively, and pod ns/a holds a share of it");
        assert_eq!(r[1].1.to_string(), "GPU 5 is held exclusively by pod ns/c");
    }

    #[test]
    fn a_started_pod_keeps_its_gpu_over_an_earlier_bind() {
        // the pod that edited its assignment has the later seq here, but what matters first is that
        // `holder` already has its devices
        let mut holder = pending_pod("ns/holder", 9, &[("main", false, vec![whole(2)])]);
        holder.allocated.insert("main".into());
        let thief = pending_pod("ns/thief", 1, &[("main", false, vec![share(2)])]);
        let r = refused(&[thief, holder]);
        assert_eq!(r, [("ns/thief".into(), Conflict { gpu: 2, holder: "ns/holder".into(), holder_exclusive: true })]);
    }

    #[test]
    fn a_pod_never_conflicts_with_itself_and_exactly_one_of_a_pair_is_refused() {
        // init container exclusive, app container a share of the same GPU: one pod
        let p = pending_pod("ns/p", 1, &[("init", true, vec![whole(0)]), ("main", false, vec![share(0)])]);
        assert!(conflicts(&[p]).is_empty());
        // same bind seq: the UID decides, one way only
        let a = pending_pod("ns/a", 7, &[("main", false, vec![whole(1)])]);
        let b = pending_pod("ns/b", 7, &[("main", false, vec![whole(1)])]);
        assert_eq!(refused(&[a.clone(), b.clone()]).len(), 1);
        let (r1, r2) = (refused(&[a.clone(), b.clone()]), refused(&[b, a]));
        assert_eq!(r1, r2, "the order of the list does not matter");
    }

    #[test]
    fn a_refused_pod_takes_nothing_from_those_after_it() {
        // b loses GPU 0 to a, so c, which wants GPU 1 that b also named, keeps it
        let pods = [
            pending_pod("ns/a", 1, &[("main", false, vec![whole(0)])]),
            pending_pod("ns/b", 2, &[("main", false, vec![whole(0), whole(1)])]),
            pending_pod("ns/c", 3, &[("main", false, vec![whole(1)])]),
        ];
        assert_eq!(
            refused(&pods),
            [("ns/b".into(), Conflict { gpu: 0, holder: "ns/a".into(), holder_exclusive: true })]
        );
    }
}
