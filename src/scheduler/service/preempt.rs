//! Preempt: for each node kube-scheduler proposes, the fewest of its victims whose GPUs let the pod
//! fit.

use super::*;

impl Scheduler {
    /// The preempt verb: per node, the smallest set of kube-scheduler's victims whose removal lets
    /// the pod's GPUs fit (no victim can be spared without breaking the fit); nodes where evicting
    /// every GPU victim still does not make room are dropped. Victims gpuplace holds no GPU record
    /// for are kept as sent: kube-scheduler chose them for resources gpuplace does not see. The
    /// answer is the victims kept, per node.
    pub fn preempt(&self, q: PreemptQuery<'_>) -> BTreeMap<String, NodeVictims> {
        let started = Instant::now();
        let meta = q.nodes;
        let mut d = self.decision("preempt", q.pod, started);
        d.candidates = meta.len();
        let req = match q.pod.request() {
            Ok(r) => r,
            Err(e) => {
                // fits nowhere, so no eviction helps
                d.refused = Some(prefixed(&e));
                return self.finish(d, started, BTreeMap::new());
            }
        };
        d.requests = Some(requests_of(&req));
        if req.is_gpu_free() {
            d.feasible = meta.len();
            return self.finish(d, started, meta);
        }
        let st = self.read();
        let mut out = BTreeMap::new();
        for (node_name, victims) in meta {
            match self.minimal_victims(&st, &req, &node_name, &victims) {
                Some(kept) => {
                    let spared = victims.pods.len().saturating_sub(kept.pods.len());
                    self.metrics.preempt_node(true, spared as u64);
                    out.insert(node_name, kept);
                }
                None => {
                    self.metrics.preempt_node(false, 0);
                    *d.rejections.entry(format!("no victim set frees room on {node_name}")).or_default() += 1;
                }
            }
        }
        drop(st);
        d.feasible = out.len();
        self.finish(d, started, out)
    }

    fn minimal_victims(
        &self,
        st: &State,
        req: &PodRequest,
        node_name: &str,
        victims: &NodeVictims,
    ) -> Option<NodeVictims> {
        let node = st.cluster.node(node_name)?;
        // (position in kube-scheduler's list, record, priority)
        let mut gpu_victims: Vec<(usize, PodAssignment, Option<i32>)> = Vec::new();
        let mut foreign: Vec<usize> = Vec::new();
        let mut uids = HashSet::with_capacity(victims.pods.len());
        for (pos, p) in victims.pods.iter().enumerate() {
            // a UID listed twice is one pod: answered once
            if !uids.insert(p.uid.as_str()) {
                continue;
            }
            let (key, prio) = match &p.pod {
                Some((k, prio)) => (Some(k.clone()), *prio),
                None => (st.bound.get(&p.uid).map(|b| b.key.clone()), None),
            };
            match key.as_deref().and_then(|k| node.pod(k)) {
                Some(a) => gpu_victims.push((pos, a.clone(), prio)),
                None => foreign.push(pos),
            }
        }
        // a one-node copy is enough: placement on a node depends on that node alone
        let mut scratch = Cluster::new(vec![node.clone()]);
        scratch.network_levels = st.cluster.network_levels.clone();
        for (_, a, _) in &gpu_victims {
            let _ = scratch.release(&a.pod);
        }
        st.engine.place(&scratch, req, 0).ok()?;
        // Reprieve as kube-scheduler does: highest priority first (then in the order sent), keeping a
        // victim whenever the pod still fits with it back. Fit only gets harder as pods come back, so
        // no victim left in the set could be spared given the others: the set is minimal.
        let mut order: Vec<usize> = (0..gpu_victims.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(gpu_victims[i].2.unwrap_or(i32::MIN)));
        let mut evicted = vec![false; gpu_victims.len()];
        for i in order {
            let a = &gpu_victims[i].1;
            if scratch.allocate(a.clone()).is_ok() {
                if st.engine.place(&scratch, req, 0).is_ok() {
                    continue;
                }
                let _ = scratch.release(&a.pod);
            }
            evicted[i] = true;
        }
        let mut keep: Vec<usize> =
            gpu_victims.iter().zip(&evicted).filter(|(_, &e)| e).map(|((pos, _, _), _)| *pos).collect();
        keep.extend(foreign);
        keep.sort_unstable();
        let pods: Vec<Victim> = keep.iter().map(|&i| victims.pods[i].clone()).collect();
        // spared victims can only lower the PDB violations; the exact count is kube-scheduler's
        let pdb_violations = victims.pdb_violations.min(pods.len() as i64);
        Some(NodeVictims { pods, pdb_violations })
    }

    // -----------------------------------------------------------------------------------------------
    // inspect and metrics
    // -----------------------------------------------------------------------------------------------
}
