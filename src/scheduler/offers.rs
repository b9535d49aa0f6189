//! Offer holds' bookkeeping: which pod holds GPUs on which node until its bind, and until when.
//! What the holds are for and when they end: `service::offers`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use gpuplace_core::resources::PodRequest;

/// How long an offer holds GPUs without a bind. kube-scheduler sends the bind moments after its
/// cycle (later only behind a Permit or PreBind wait); past this the GPUs go back.
pub const OFFER_HOLD: Duration = Duration::from_secs(10);

/// The cluster-model key of a pod's hold: a key no pod has (`#` marks reservations, which counts of
/// bound pods and audits skip).
pub fn hold_key(pod_key: &str) -> String {
    format!("{pod_key}#offer")
}

/// One pod's hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    pub node: String,
    /// The allocation's key in the cluster model ([`hold_key`]).
    pub key: String,
    pub until: Instant,
    /// The node's stamp with the hold counted: while it is unchanged, nothing else moved on the
    /// node and the pod's bind may take the held GPUs over as they are.
    pub stamp: u64,
    /// What the hold was placed for.
    pub request: PodRequest,
}

/// The holds, by pod UID.
#[derive(Debug, Default)]
pub struct Offers {
    by_uid: HashMap<String, Offer>,
}

impl Offers {
    pub fn insert(&mut self, uid: &str, offer: Offer) {
        self.by_uid.insert(uid.to_string(), offer);
    }

    pub fn remove(&mut self, uid: &str) -> Option<Offer> {
        self.by_uid.remove(uid)
    }

    pub fn contains(&self, uid: &str) -> bool {
        self.by_uid.contains_key(uid)
    }

    /// The UIDs whose hold is past its time at `now`.
    pub fn due(&self, now: Instant) -> Vec<String> {
        self.by_uid.iter().filter(|(_, o)| o.until <= now).map(|(uid, _)| uid.clone()).collect()
    }

    /// (UID, node) of every hold, sorted.
    pub fn list(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = self.by_uid.iter().map(|(u, o)| (u.clone(), o.node.clone())).collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_fall_due_at_their_time() {
        let mut offers = Offers::default();
        let t = Instant::now();
        let at = |s: u64, node: &str| Offer {
            node: node.into(),
            key: hold_key("ns/p"),
            until: t + Duration::from_secs(s),
            stamp: 1,
            request: PodRequest::single("ns/p", gpuplace_core::resources::GpuDemand::Whole { gpus: 1 }),
        };
        offers.insert("a", at(1, "n1"));
        offers.insert("b", at(5, "n2"));
        assert!(offers.due(t).is_empty());
        assert_eq!(offers.due(t + Duration::from_secs(1)), ["a"]);
        assert_eq!(offers.list(), [("a".to_string(), "n1".to_string()), ("b".to_string(), "n2".to_string())]);
        assert_eq!(offers.remove("a").map(|o| o.node), Some("n1".to_string()));
        assert!(!offers.contains("a") && offers.contains("b"));
        assert!(hold_key("ns/p").contains('#'));
    }
}
