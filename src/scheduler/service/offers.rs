//! Offer holds: the GPUs a filter answer promised a single pod, held until its bind.
//!
//! kube-scheduler "assumes" a pod on the node it picked as soon as its scheduling cycle ends and
//! binds it in the background, so the next pod's filter often reaches gpuplace before the previous
//! pod's bind does. With the answer naming only the best node (`serve --nodes-to-score`, 1 by
//! default), consecutive pods of one shape were all told the same node: the first bind took the
//! GPUs and the others failed with "no longer fits", went to kube-scheduler's back-off (1 s and
//! more) and were filtered again. Measured on the real control plane (tests/e2e `pace_on_100_nodes`,
//! 600 whole-GPU pods, 2026-12-02): 12-18 such failures a run, whose back-off was half the run's
//! time.
//!
//! So when an answer names exactly one node where the pod fits (kube-scheduler can only bind it
//! there), the pod's placement on that node is held in the cluster model as an allocation under
//! `<namespace>/<name>#offer` (a key no pod has; `#` marks reservations, which counts of bound pods
//! and audits skip). Later filters see those GPUs taken, exactly as kube-scheduler's own cache sees
//! the assumed pod. The hold ends when the pod's bind arrives (any node, any outcome: a bind to the
//! held node for the same request, with nothing else changed on the node since, counts the held
//! GPUs as they are; any other places the pod itself), when the pod is filtered again (its previous
//! attempt is over), deleted or counted bound from the watch, or after `OFFER_HOLD` (kube-scheduler
//! gave the pod up without a bind). A hold never over-commits: it is made only where the pod still
//! fits under the write lock.

use super::*;
use crate::scheduler::offers::{hold_key, Offer, OFFER_HOLD};
use crate::scheduler::verdict_cache::{Answer, Candidates};

impl Scheduler {
    /// After a filter: when the answer names exactly one node where the pod fits, the pod's
    /// placement there is held (see the module documentation). Pods of groups are never held here
    /// (their slots are reservations already), nor pods without a UID.
    pub(super) fn hold_offer(&self, pod: &dyn PodView, req: &PodRequest, c: &Candidates<'_>, answers: &[Answer]) {
        let uid = pod.uid();
        if uid.is_empty() || req.group.is_some() || req.is_gpu_free() {
            return;
        }
        // the pod's previous hold, if any, was dropped when its filter began (`filter`)
        let mut fits = c.unique().filter(|&p| matches!(answers.get(p), Some(Answer::Fits(..)))).map(|p| c.names[p]);
        let (Some(node), None) = (fits.next(), fits.next()) else {
            // several nodes (kube-scheduler picks) or none: nothing to hold
            return;
        };
        let now = Instant::now();
        let mut guard = self.write();
        let st = &mut *guard;
        let mut freed = Self::expire_offers(st, now);
        // one a concurrent filter of the same pod made meanwhile
        freed.extend(Self::release_offer(st, uid));
        let index = st.cluster.node_index(node).filter(|_| !st.bound.contains_key(uid));
        if let Some(index) = index {
            let key = hold_key(&pod.key());
            let held = st.engine.place(&st.cluster, req, index).ok().and_then(|p| {
                let mut a = p.assignment;
                a.pod = key.clone();
                st.cluster.allocate(a).ok()
            });
            if held.is_some() {
                let stamp = st.cluster.stamps()[index];
                let offer = Offer { node: node.to_string(), key, until: now + OFFER_HOLD, stamp, request: req.clone() };
                st.offers.insert(uid, offer);
            }
        }
        drop(guard);
        // a node whose hold was given back can take a pod that was turned away
        freed.retain(|n| n != node);
        self.notes_freed(freed);
    }

    /// Ends the pod's hold, if it has one (its bind arrived, or it was deleted or counted bound).
    pub(super) fn drop_offer(&self, uid: &str) {
        if !self.read().offers.contains(uid) {
            return;
        }
        let freed = Self::release_offer(&mut self.write(), uid);
        self.notes_freed(freed);
    }

    /// Releases the pod's hold under the write lock; the node it was on.
    pub(super) fn release_offer(st: &mut State, uid: &str) -> Option<String> {
        Self::end_offer(st, uid).map(|(offer, _)| offer.node)
    }

    /// Releases the pod's hold under the write lock, for its bind: the hold, and its placement
    /// when nothing else moved on the node since (the node's stamp is the hold's), so that a bind
    /// to that node for the same request can count it again as it is instead of placing the pod a
    /// second time: the engine's choice for the same node state.
    pub(super) fn end_offer(st: &mut State, uid: &str) -> Option<(Offer, Option<PodAssignment>)> {
        let offer = st.offers.remove(uid)?;
        let unchanged =
            st.cluster.node_index(&offer.node).is_some_and(|i| st.cluster.stamps().get(i) == Some(&offer.stamp));
        // gone with its node when the node was dropped or redefined
        let held = st.cluster.release(&offer.key).ok().filter(|_| unchanged);
        Some((offer, held))
    }

    /// Releases the holds past their time; the nodes they were on.
    fn expire_offers(st: &mut State, now: Instant) -> Vec<String> {
        let due = st.offers.due(now);
        if !due.is_empty() {
            tracing::debug!(holds = due.len(), "offer holds expired without a bind");
        }
        due.iter().filter_map(|uid| Self::release_offer(st, uid)).collect()
    }

    fn notes_freed(&self, nodes: impl IntoIterator<Item = String>) {
        for node in nodes {
            self.note_freed(&node);
        }
    }

    /// Holds now in place, by pod UID (for tests and `/inspect`-style checks).
    pub fn offer_holds(&self) -> Vec<(String, String)> {
        self.read().offers.list()
    }
}
