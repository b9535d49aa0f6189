//! Bind: re-check and count the allocation under the write lock, run the [`Binder`] without it, then
//! confirm or roll back; the assignment annotation the Binding carries.

use super::*;

/// How long bind waits for the pod watcher to deliver a pod it has not seen yet (API-server mode).
const WATCH_WAIT: Duration = Duration::from_secs(2);
const WATCH_POLL: Duration = Duration::from_millis(10);

/// A bind ready for the [`Binder`], and the UIDs of the pods awaiting admission it must wait for.
type Prepared = (BindRequest, Vec<String>);

impl Scheduler {
    /// The bind verb: the pod's GPUs re-checked and counted, then the [`Binder`] run. `Err` is
    /// the message kube-scheduler shows, after the allocation is rolled back.
    pub async fn bind(&self, order: &BindOrder) -> Result<(), String> {
        let started = Instant::now();
        let mut d = Decision {
            v: PLACEMENT_LOG_VERSION,
            verb: "bind".into(),
            pod: order.pod_key(),
            uid: order.uid.clone(),
            candidates: 1,
            ..Decision::default()
        };
        if self.is_ready() && self.pods_watched() && self.seen_pod(&order.uid).is_none() {
            self.await_watched(&order.uid).await;
        }
        let mut offered_on = None;
        let prepared = if self.is_ready() {
            self.prepare_bind(order, &mut d, &mut offered_on)
        } else {
            Err((BindOutcome::NotReady, NOT_READY.into()))
        };
        let prepared = match prepared {
            Ok(Some((request, blockers))) if !blockers.is_empty() => {
                self.await_admissions(order, &mut d, request, blockers).await
            }
            other => other.map(|p| p.map(|(request, _)| request)),
        };
        let (outcome, error) = match prepared {
            Err((outcome, message)) => (outcome, Some(message)),
            Ok(None) => (BindOutcome::Repeated, None),
            Ok(Some(request)) => match self.binder.bind(&request).await {
                Ok(()) => {
                    {
                        let mut st = self.write();
                        if let Some(b) = st.bound.get_mut(&order.uid) {
                            b.confirmed = true;
                            let node = b.node.clone();
                            st.books.mark(&node);
                            st.bound_at.insert(order.uid.clone(), Instant::now());
                        }
                        let done = st.groups.settle(&order.uid).into_iter().collect();
                        let done = st.groups.stamped(&st.cluster, done);
                        drop(st);
                        self.group_events(done);
                    }
                    // counted here if this replica never filtered it (the filter went to another
                    // leader, or the pod watcher remembered it)
                    if let Some(SeenPod { request: Ok(req), .. }) = self.seen_pod(&order.uid) {
                        self.observe_arrival(&order.uid, &req);
                    }
                    (BindOutcome::Bound, None)
                }
                Err(e) => {
                    self.rollback(order);
                    tracing::warn!(pod = %order.pod_key(), node = %order.node, error = %e, "Binding failed; allocation rolled back");
                    (BindOutcome::BinderFailed, Some(prefixed(&format!("binding failed, GPUs released: {e}"))))
                }
            },
        };
        self.metrics.bind(outcome);
        if outcome.is_success() {
            self.metrics.pod_settled(&order.uid);
        } else if let Some(node) = offered_on {
            // the GPUs its filter held are free again: pods turned away meanwhile may fit
            self.note_freed(&node);
        }
        d.outcome = Some(outcome.name().into());
        d.feasible = usize::from(outcome.is_success());
        d.ts_unix_ms = now_unix_ms();
        d.error = error.clone();
        if outcome.is_success() {
            tracing::debug!(pod = %order.pod_key(), node = %order.node, outcome = outcome.name(), "bound");
        } else {
            d.chosen = None;
        }
        if let Some(log) = &self.log {
            // the cluster after this bind, for capacity reports (docs/placement-log.md)
            let st = self.read();
            d.cluster = Some(log.capacity(&st.cluster, &order.node));
            if d.group.is_some() {
                d.group_totals = Some(st.groups.totals(&st.cluster));
            }
        }
        let out = match error {
            None => Ok(()),
            Some(e) => Err(e),
        };
        self.finish(d, started, out)
    }

    /// Waits for the pods this bind could be confused with to be admitted (the `admission`
    /// submodule); when they are not in time, rolls the allocation back and refuses, retryable.
    async fn await_admissions(
        &self,
        order: &BindOrder,
        d: &mut Decision,
        request: BindRequest,
        blockers: Vec<String>,
    ) -> Result<Option<BindRequest>, (BindOutcome, String)> {
        let started = Instant::now();
        match self.wait_for_admissions(&order.node, blockers).await {
            Ok(()) => {
                tracing::debug!(pod = %order.pod_key(), node = %order.node, waited_ms = started.elapsed().as_millis() as u64, "pods with other limits on the same GPUs admitted; binding");
                Ok(Some(request))
            }
            Err(waiting) => {
                self.rollback(order);
                // binds waiting behind this one look again
                self.admissions_changed();
                d.chosen = None;
                tracing::info!(pod = %order.pod_key(), node = %order.node, waiting = %waiting, "bind refused: pods with other limits on the same GPUs still await their Allocate");
                Err((
                    BindOutcome::AdmissionWait,
                    prefixed(&format!(
                        "pod {} would wait on {} for GPUs where {waiting} still awaits its device-plugin Allocate with \
                         other limits, and kubelet's Allocate cannot tell them apart; GPUs released, retry",
                        order.pod_key(),
                        order.node
                    )),
                ))
            }
        }
    }

    /// Waits up to [`WATCH_WAIT`] for the pod watcher to see pod `uid`: kube-scheduler's own filter
    /// and bind can come moments after the pod was created, before the watch delivered it.
    async fn await_watched(&self, uid: &str) {
        let deadline = Instant::now() + WATCH_WAIT;
        while self.seen_pod(uid).is_none() && Instant::now() < deadline {
            tokio::time::sleep(WATCH_POLL).await;
        }
    }

    /// Re-checks and counts the allocation. `Ok(None)`: a retry of a bind already done. With the
    /// request, the pods awaiting admission it must wait for (the `admission` submodule).
    /// `offered_on`: the node of the hold its filter made, which this ends (`offers`).
    fn prepare_bind(
        &self,
        order: &BindOrder,
        d: &mut Decision,
        offered_on: &mut Option<String>,
    ) -> Result<Option<Prepared>, (BindOutcome, String)> {
        let key = order.pod_key();
        let fail = |o: BindOutcome, m: String| Err((o, prefixed(&m)));
        let seen = self.seen_pod(&order.uid);
        let mut st = self.write();
        let st = &mut *st;
        // whatever comes of it, the bind ends the hold its filter made: the pod is placed below
        // on the node kube-scheduler chose, with the held GPUs free again (or those GPUs counted as
        // they are, when nothing changed: `end_offer`)
        let offer = Self::end_offer(st, &order.uid);
        *offered_on = offer.as_ref().map(|(o, _)| o.node.clone());
        if let Some(b) = st.bound.get(&order.uid) {
            return if b.node != order.node {
                fail(BindOutcome::Conflict, format!("pod {key} is already bound to {}", b.node))
            } else if !b.confirmed {
                fail(BindOutcome::Conflict, format!("a bind of pod {key} to {} is in flight; retry", b.node))
            } else {
                d.chosen = b.annotation.as_deref().and_then(chosen_of);
                Ok(None)
            };
        }
        let Some(seen) = seen else {
            let seen_by = if self.pods_watched() { "by the pod watcher" } else { "in a filter request" };
            return fail(
                BindOutcome::UnknownPod,
                format!("pod {key} (UID {}) was not seen {seen_by}, so its GPU request is unknown; it will be scheduled again", order.uid),
            );
        };
        if seen.key != key {
            return fail(BindOutcome::UnknownPod, format!("UID {} belongs to pod {}, not {key}", order.uid, seen.key));
        }
        let req = match &seen.request {
            Ok(r) => r.clone(),
            Err(reason) => return fail(BindOutcome::Refused, reason.clone()),
        };
        d.requests = Some(requests_of(&req));
        d.group = req.group.as_ref().map(|g| g.key.clone());
        let Some(index) = st.cluster.node_index(&order.node) else {
            return fail(BindOutcome::UnknownNode, format!("node {} is not in gpuplace's node cache", order.node));
        };
        if self.pods_watched() {
            // the pod as the API server has it against the Node's labels: a bind kube-scheduler's
            // own cycle would never send is refused, whoever sent it
            let admits = match (&seen.constraints, st.cluster.node(&order.node)) {
                (Ok(c), Some(node)) => c.admits(&node.name, &node.labels, &self.taints_of(&node.name)),
                (Err(e), _) => Err(e.clone()),
                (_, None) => Ok(()),
            };
            if let Err(why) = admits {
                return fail(BindOutcome::Refused, format!("pod {key} cannot go to {}: {why}", order.node));
            }
        }
        if let Some(old) = st.uid_of.get(&key).cloned() {
            // two live pods cannot share a name: the old UID's pod is gone and its release was missed
            self.metrics.conflict(ConflictKind::StaleUid);
            tracing::warn!(pod = %key, old_uid = %old, new_uid = %order.uid, "pod name bound again under a new UID; releasing the old record");
            let _ = st.cluster.release(&key);
            if let Some(b) = st.bound.remove(&old) {
                st.books.mark(&b.node);
            }
            st.uid_of.remove(&key);
        }
        let mut record = BoundPod {
            key: key.clone(),
            uid: order.uid.clone(),
            node: order.node.clone(),
            bind_seq: 0,
            annotation: None,
            confirmed: false,
            signed_by: None,
        };
        let mut annotations = BTreeMap::new();
        let mut blockers = Vec::new();
        if !req.is_gpu_free() {
            // a group member binding where its plan put it takes its reservation's GPUs
            let reserved = Self::take_reservation(st, &order.uid, &key, &order.node);
            let elsewhere = reserved.is_none();
            if elsewhere {
                let events = st.groups.leave_plan(&mut st.cluster, &order.uid, &order.node);
                self.group_events(st.groups.stamped(&st.cluster, events));
            }
            let held = offer.and_then(|(o, held)| held.filter(|_| o.node == order.node && o.request == req));
            let placement = match (reserved, held) {
                (Some(assignment), _) => {
                    crate::placement::feasibility::Placement { assignment, set_scores: Vec::new() }
                }
                (None, Some(mut assignment)) => {
                    assignment.pod = key.clone();
                    crate::placement::feasibility::Placement { assignment, set_scores: Vec::new() }
                }
                (None, None) => match st.engine.place(&st.cluster, &req, index) {
                    Ok(p) => p,
                    Err(why) => {
                        // the event gets the cause; the node's figures go to the logs
                        tracing::debug!(pod = %key, node = %order.node, detail = %why.detail(), "pod no longer fits on the chosen node");
                        d.rejection_details.insert(order.node.clone(), why.detail().to_string());
                        return fail(
                            BindOutcome::NoFit,
                            format!("pod {key} no longer fits on {}: {}", order.node, why.cause()),
                        );
                    }
                },
            };
            let seq = st.last_seq.get(&order.node).copied().unwrap_or(0) + 1;
            let node = &st.cluster.nodes()[index];
            let annotation = match AssignmentAnnotation::from_assignment(&placement.assignment, &order.uid, node, seq) {
                Ok(a) => a,
                Err(e) => {
                    Self::restore_reservation(st, &order.uid, &order.node);
                    return Err((BindOutcome::NoFit, prefixed(&e.to_string())));
                }
            };
            // signed, so that a restarted replica (or the standby) can tell it from a forgery
            let Some(keys) = self.key_ring() else {
                Self::restore_reservation(st, &order.uid, &order.node);
                return fail(BindOutcome::NotReady, "no assignment key to sign the assignment with; retry".into());
            };
            let annotation = annotation.signed(&keys);
            record.signed_by = Some(keys.primary().to_string());
            if let Err(e) = st.cluster.allocate(placement.assignment.clone()) {
                Self::restore_reservation(st, &order.uid, &order.node);
                return Err((
                    BindOutcome::NoFit,
                    prefixed(&format!("pod {key} cannot be counted on {}: {e}", order.node)),
                ));
            }
            if elsewhere {
                st.groups.mark_bound(&order.uid, &order.node);
            } else {
                st.groups.slot_taken(&order.uid, &order.node);
            }
            st.last_seq.insert(order.node.clone(), seq);
            blockers = Self::awaiting_confusable(st, &order.node, &order.uid, &placement.assignment);
            let text = annotation.to_json();
            d.chosen = chosen_of(&text);
            annotations.insert(ANNOTATION_ASSIGNMENT.to_string(), text.clone());
            record.bind_seq = seq;
            record.annotation = Some(text);
        } else {
            d.chosen = Some(Chosen { node: order.node.clone(), bind_seq: 0, gpus: Vec::new() });
        }
        st.uid_of.insert(key, order.uid.clone());
        st.bound.insert(order.uid.clone(), record);
        let request = BindRequest {
            namespace: order.namespace.clone(),
            name: order.name.clone(),
            uid: order.uid.clone(),
            node: order.node.clone(),
            annotations,
        };
        Ok(Some((request, blockers)))
    }

    /// Undoes `prepare_bind` after a failed Binding, if the record is still the one it made.
    fn rollback(&self, order: &BindOrder) {
        let mut st = self.write();
        let key = order.pod_key();
        let ours = st.bound.get(&order.uid).is_some_and(|b| !b.confirmed && b.node == order.node);
        if !ours {
            return;
        }
        Self::forget_awaiting(&mut st, &order.node, &order.uid);
        if let Some(text) = st.bound.remove(&order.uid).and_then(|b| b.annotation) {
            // more rolled-back binds than are ever in flight at once: forget the old ones
            if st.withdrawn.len() >= DEFAULT_POD_CACHE {
                st.withdrawn.clear();
            }
            st.withdrawn.insert(order.uid.clone(), text);
        }
        if st.uid_of.get(&key) == Some(&order.uid) {
            st.uid_of.remove(&key);
        }
        if st.cluster.assignment(&key).is_some_and(|a| a.node == order.node) {
            let _ = st.cluster.release(&key);
        }
        Self::return_slot(&mut st, &order.uid);
    }

    // -----------------------------------------------------------------------------------------------
    // preempt
    // -----------------------------------------------------------------------------------------------
}

/// The placement log's view of an assignment annotation.
fn chosen_of(annotation: &str) -> Option<Chosen> {
    let a = AssignmentAnnotation::parse(annotation).ok()?;
    let gpus = a
        .containers
        .iter()
        .flat_map(|c| {
            c.gpus.iter().map(move |g| ChosenGpu {
                container: c.name.clone(),
                init: c.init,
                index: g.index,
                uuid: g.uuid.clone(),
                memory_mib: g.memory_mib,
                core_percent: g.core_percent,
                exclusive: g.exclusive,
            })
        })
        .collect();
    Some(Chosen { node: a.node, bind_seq: a.bind_seq, gpus })
}
