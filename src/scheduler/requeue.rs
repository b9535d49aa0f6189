//! Pods turned away for want of free GPUs, remembered for a few seconds, so that GPUs freed just
//! after send them back to kube-scheduler's queue.
//!
//! Why: kube-scheduler and the extender learn of a pod's deletion from two different watches.
//! kube-scheduler requeues the pods an extender rejected on any cluster event, the deletion
//! included, and retries them at once; when that retry reaches the extender before its own watch has
//! delivered the deletion, the GPUs still look taken and the pod is rejected again. No event follows,
//! so the pod waits in kube-scheduler's unschedulable pool for its periodic flush (five minutes),
//! on GPUs that are free. (Measured in tests/e2e: a pod pinned to a node stayed pending for the
//! whole minute the test waited after the node's last holder was deleted.)
//!
//! So the extender remembers, for a few seconds ([`WINDOW`]), each pod it turned away on every
//! candidate and the nodes where only capacity stood in the way; when GPUs on such a node are freed within that time,
//! the pod is handed to a [`Requeuer`] (in API-server mode: a small annotation update on the pod,
//! `k8s::requeue`, an event kube-scheduler requeues it on). A pod is handed over at most once
//! per rejection, so each one costs at most one more filter call.
//!
//! A rejection computed from a state read before a freeing but recorded after it is caught too: a
//! freeing stamps its node, and a rejection made from a state older than the stamp is handed over
//! as soon as it is recorded.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a rejection (and a freeing) is remembered. A verdict was stale only if kube-scheduler
/// had seen the freeing before asking, so it came at most the extender's watch lag (milliseconds,
/// a second or two under load) before the extender saw the freeing; an older one was followed by
/// the event that requeues the pod anyway. Each pod handed over costs an API write, so the window
/// stays short.
pub const WINDOW: Duration = Duration::from_secs(3);

/// Rejections name at most this many nodes each; a pod rejected on more is handed over when GPUs
/// are freed anywhere (such a pod is requeued by most cluster events anyway).
pub const MAX_NODES: usize = 64;

/// At most this many pods are remembered; past it, the oldest rejections are forgotten.
pub const MAX_PODS: usize = 4096;

/// A pending pod to send back to kube-scheduler's queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequeuePod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The node whose GPUs were freed.
    pub node: String,
}

/// Sends pods back to kube-scheduler's queue (API-server mode: `k8s::requeue`).
pub trait Requeuer: Send + Sync {
    fn requeue(&self, pods: Vec<RequeuePod>);
}

#[derive(Debug)]
enum Nodes {
    Few(Vec<String>),
    /// More than [`MAX_NODES`]: any node.
    Many,
}

impl Nodes {
    fn contains(&self, node: &str) -> bool {
        match self {
            Nodes::Few(v) => v.iter().any(|n| n == node),
            Nodes::Many => true,
        }
    }
}

#[derive(Debug)]
struct TurnedAway {
    namespace: String,
    name: String,
    nodes: Nodes,
    /// When the state the verdict was made from was read.
    read_at: Instant,
}

/// The recent rejections and freeings (see the module doc). Times are passed in, so it is tested
/// without a clock.
#[derive(Debug, Default)]
pub struct RecentRejections {
    /// UID → the pod's last rejection, until it is handed over or expires.
    pods: HashMap<String, TurnedAway>,
    /// Node → when GPUs on it were last freed.
    freed: HashMap<String, Instant>,
}

impl RecentRejections {
    /// Records that the pod `namespace/name` (`uid`) was turned away on every candidate, by a
    /// verdict made from the state as read at `read_at`, and that capacity alone stood in the way on
    /// `nodes`. Returns the pod, to hand over now, when one of those nodes was freed since `read_at`.
    pub fn record<'a>(
        &mut self,
        uid: &str,
        namespace: &str,
        name: &str,
        nodes: impl IntoIterator<Item = &'a str>,
        read_at: Instant,
        now: Instant,
    ) -> Option<RequeuePod> {
        let mut few = Vec::new();
        let mut many = false;
        for n in nodes {
            if few.len() == MAX_NODES {
                many = true;
                break;
            }
            few.push(n.to_string());
        }
        if few.is_empty() {
            self.pods.remove(uid);
            return None;
        }
        let nodes = if many { Nodes::Many } else { Nodes::Few(few) };
        self.remember(uid, namespace, name, nodes, read_at, now)
    }

    /// Records a pod turned away until GPUs are freed on any node: a group member that waits for
    /// room for its group (which node frees it is the group's planning's to say). As
    /// [`Self::record`] otherwise.
    pub fn record_anywhere(
        &mut self,
        uid: &str,
        namespace: &str,
        name: &str,
        read_at: Instant,
        now: Instant,
    ) -> Option<RequeuePod> {
        self.remember(uid, namespace, name, Nodes::Many, read_at, now)
    }

    fn remember(
        &mut self,
        uid: &str,
        namespace: &str,
        name: &str,
        nodes: Nodes,
        read_at: Instant,
        now: Instant,
    ) -> Option<RequeuePod> {
        let freed_since = |node: &str| self.freed.get(node).is_some_and(|&t| t > read_at);
        let stale = match &nodes {
            Nodes::Few(v) => v.iter().find(|n| freed_since(n)).cloned(),
            Nodes::Many => self.freed.iter().find(|(_, &t)| t > read_at).map(|(n, _)| n.clone()),
        };
        if let Some(node) = stale {
            self.pods.remove(uid);
            return Some(RequeuePod { namespace: namespace.into(), name: name.into(), uid: uid.into(), node });
        }
        if self.pods.len() >= MAX_PODS && !self.pods.contains_key(uid) {
            self.expire(now);
            if self.pods.len() >= MAX_PODS {
                let oldest = self.pods.iter().min_by_key(|(_, r)| r.read_at).map(|(u, _)| u.clone());
                if let Some(u) = oldest {
                    self.pods.remove(&u);
                }
            }
        }
        self.pods.insert(uid.into(), TurnedAway { namespace: namespace.into(), name: name.into(), nodes, read_at });
        None
    }

    /// The pod is no longer pending (bound, or gone), or was judged to fit somewhere.
    pub fn forget(&mut self, uid: &str) {
        self.pods.remove(uid);
    }

    /// GPUs on `node` were freed at `now` (the state already shows it): the pods rejected there in
    /// the last [`WINDOW`], each handed over once.
    pub fn freed(&mut self, node: &str, now: Instant) -> Vec<RequeuePod> {
        self.expire(now);
        self.freed.insert(node.to_string(), now);
        let due: Vec<String> =
            self.pods.iter().filter(|(_, r)| r.nodes.contains(node)).map(|(uid, _)| uid.clone()).collect();
        due.into_iter()
            .filter_map(|uid| {
                let r = self.pods.remove(&uid)?;
                Some(RequeuePod { namespace: r.namespace, name: r.name, uid, node: node.to_string() })
            })
            .collect()
    }

    /// How many rejections are remembered.
    pub fn len(&self) -> usize {
        self.pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    fn expire(&mut self, now: Instant) {
        let live = |t: &Instant| now.saturating_duration_since(*t) <= WINDOW;
        self.pods.retain(|_, r| live(&r.read_at));
        self.freed.retain(|_, t| live(t));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    #[test]
    fn a_freeing_hands_over_the_pods_rejected_there_once() {
        let t = Instant::now();
        let mut r = RecentRejections::default();
        assert_eq!(r.record("u1", "ns", "a", ["n1", "n2"], at(t, 0), at(t, 1)), None);
        assert_eq!(r.record("u2", "ns", "b", ["n2"], at(t, 0), at(t, 1)), None);
        let got = r.freed("n1", at(t, 5));
        assert_eq!(
            got,
            vec![RequeuePod { namespace: "ns".into(), name: "a".into(), uid: "u1".into(), node: "n1".into() }]
        );
        // handed over once: freeing n2 now only brings b
        let got: Vec<String> = r.freed("n2", at(t, 6)).into_iter().map(|p| p.name).collect();
        assert_eq!(got, ["b"]);
        assert!(r.freed("n2", at(t, 7)).is_empty());
        assert!(r.is_empty());
    }

    #[test]
    fn rejections_expire_after_the_window() {
        let t = Instant::now();
        let mut r = RecentRejections::default();
        r.record("u1", "ns", "a", ["n1"], at(t, 0), at(t, 0));
        assert!(r.freed("n1", t + WINDOW + Duration::from_millis(1)).is_empty());
        assert!(r.is_empty());
    }

    #[test]
    fn a_verdict_from_a_state_read_before_a_freeing_is_handed_over_when_recorded() {
        let t = Instant::now();
        let mut r = RecentRejections::default();
        // the watch frees n1 while the filter, which read the state at 0, is still judging
        assert!(r.freed("n1", at(t, 3)).is_empty());
        let got = r.record("u1", "ns", "a", ["n1"], at(t, 0), at(t, 4));
        assert_eq!(got.map(|p| p.node), Some("n1".to_string()));
        assert!(r.is_empty(), "handed over, not kept");
        // a verdict made after the freeing was seen is kept, not handed over
        assert_eq!(r.record("u2", "ns", "b", ["n1"], at(t, 5), at(t, 6)), None);
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn a_pod_rejected_on_many_nodes_is_handed_over_by_a_freeing_anywhere() {
        let t = Instant::now();
        let mut r = RecentRejections::default();
        let names: Vec<String> = (0..MAX_NODES + 5).map(|i| format!("n{i}")).collect();
        r.record("u1", "ns", "a", names.iter().map(String::as_str), at(t, 0), at(t, 0));
        assert_eq!(r.freed("elsewhere", at(t, 1)).len(), 1);
    }

    #[test]
    fn a_waiting_group_member_is_handed_over_by_a_freeing_anywhere_even_one_seen_first() {
        let t = Instant::now();
        let mut r = RecentRejections::default();
        assert_eq!(r.record_anywhere("u1", "ns", "a", at(t, 0), at(t, 1)), None);
        assert_eq!(r.freed("n7", at(t, 2)).into_iter().map(|p| p.name).collect::<Vec<_>>(), ["a"]);
        // the freeing was seen while the verdict was being made: handed over as it is recorded
        let got = r.record_anywhere("u2", "ns", "b", at(t, 1), at(t, 3));
        assert_eq!(got.map(|p| p.node), Some("n7".to_string()));
        assert!(r.is_empty());
    }

    #[test]
    fn no_capacity_nodes_means_nothing_to_remember_and_a_later_fit_forgets() {
        let t = Instant::now();
        let mut r = RecentRejections::default();
        assert_eq!(r.record("u1", "ns", "a", [], at(t, 0), at(t, 0)), None);
        assert!(r.is_empty());
        r.record("u1", "ns", "a", ["n1"], at(t, 0), at(t, 0));
        r.forget("u1");
        assert!(r.freed("n1", at(t, 1)).is_empty());
    }

    #[test]
    fn memory_is_bounded() {
        let t = Instant::now();
        let mut r = RecentRejections::default();
        for i in 0..MAX_PODS + 10 {
            r.record(&format!("u{i}"), "ns", "p", ["n1"], at(t, i as u64 % 1000), at(t, 1000));
        }
        assert_eq!(r.len(), MAX_PODS);
    }
}
