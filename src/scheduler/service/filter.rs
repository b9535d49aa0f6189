//! Filter: which candidate nodes the pod fits, each with the reason it does not (short, groupable
//! across nodes), served from the shape cache where it can be; the evaluation is kept for the
//! prioritize call that follows (`eval_cache`).

use super::eval_cache::CachedEval;
use super::*;
use crate::placement::feasibility::{largest_gpus, oversized, Infeasible};

/// Placement log lines name at most this many top nodes.
const TOP_NODES: usize = 5;

/// A node that fits, as the answer ranks it: (its position or index, score, the engine's total).
type Ranked = (usize, u8, f32);

/// Keeps the `n` best of `fits` (any order among them): by score, then total, then the first.
fn keep_best(fits: &mut Vec<Ranked>, n: usize) {
    if n == 0 || fits.len() <= n {
        return;
    }
    let best = |a: &Ranked, b: &Ranked| b.1.cmp(&a.1).then(b.2.total_cmp(&a.2)).then(a.0.cmp(&b.0));
    if n > FEW {
        fits.select_nth_unstable_by(n - 1, best);
        fits.truncate(n);
        return;
    }
    // a few of a thousand (the answer's node, the log's top): one pass keeps them in order, and
    // most nodes lose to the last of them in one comparison
    let mut top: Vec<Ranked> = Vec::with_capacity(n + 1);
    for f in fits.iter() {
        if top.len() == n && top.last().is_some_and(|last| best(f, last).is_ge()) {
            continue;
        }
        let at = top.partition_point(|t| best(t, f).is_lt());
        top.insert(at, *f);
        top.truncate(n);
    }
    *fits = top;
}

/// Up to this many, [`keep_best`] keeps the best in one pass.
const FEW: usize = 8;

/// Filter's and prioritize's evaluation of the known candidates without the shape cache.
pub(super) struct Judged {
    /// Per node index: the score (0..=10) where the pod fits, [`REJECTED`] or [`NOT_JUDGED`].
    pub(super) scores: Vec<i8>,
    /// Why each rejected node (by index) was turned down (filter only).
    rejects: HashMap<usize, Arc<Reason>>,
    /// The engine's total behind each score, by node index.
    totals: HashMap<usize, f32>,
    pub(super) evaluation: Evaluation,
}

impl Judged {
    /// The verdict on node `i` (`None` when not judged, or rejected without a reason).
    fn answer(&self, i: usize) -> Option<Answer> {
        match self.scores.get(i).copied() {
            Some(s) if s >= 0 => Some(Answer::Fits(s as u8, self.totals.get(&i).copied().unwrap_or(0.0))),
            Some(REJECTED) => self.rejects.get(&i).map(|r| Answer::No(r.clone())),
            _ => None,
        }
    }
}

/// Reasons for candidates not in the node cache, one per kind (they name no node).
struct Unknown<'a> {
    objects: Option<&'a [NodeObject<'a>]>,
    reasons: [Option<Arc<Reason>>; UnknownNode::ALL.len()],
}

impl<'a> Unknown<'a> {
    fn new(q: &'a NodeQuery<'a>) -> Self {
        Self { objects: q.objects.as_deref(), reasons: Default::default() }
    }

    /// The verdict on the unknown candidate at position `p`.
    fn answer(&mut self, p: usize) -> Answer {
        let kind = UnknownNode::of(self.objects.and_then(|o| o.get(p)));
        // a fieldless enum in `ALL` order: its discriminant is its index
        let slot = &mut self.reasons[kind as usize];
        let r = slot.get_or_insert_with(|| Arc::new(Reason::new(RejectClass::UnknownNode, kind.reason())));
        Answer::No(r.clone())
    }
}

impl Scheduler {
    /// The shape cache entry for this pod, unless its verdicts are not cacheable (a group's pod).
    /// With a placement log too: the log's top scores come from [`Self::top_of_cached`].
    pub(super) fn cached_shape(&self, req: &PodRequest) -> Option<Arc<Shape>> {
        self.shapes.shape(req)
    }

    /// The placement log's `top` where the verdicts came from the shape cache: the best
    /// [`TOP_NODES`] of `fits` (node index, score, total) by score, then total, each with its
    /// scorers' parts. A node's parts are kept with its cached verdict ([`TopParts`]); the nodes
    /// without are placed and scored in full, and theirs kept. Only for a line that is written.
    pub(super) fn top_of_cached(
        st: &State,
        shape: &Shape,
        req: &PodRequest,
        mut fits: Vec<Ranked>,
        now: i64,
    ) -> Vec<TopScore> {
        keep_best(&mut fits, TOP_NODES);
        let cluster = &st.cluster;
        let stamps = cluster.stamps();
        let mut full: Vec<Option<Arc<TopParts>>> = {
            let table = shape.table();
            fits.iter().map(|f| table.top(f.0, stamps[f.0], now)).collect()
        };
        if full.iter().any(Option::is_none) {
            let scoring = st.engine.scoring(cluster, req, now);
            let mut made = Vec::new();
            for (f, top) in fits.iter().zip(&mut full).filter(|(_, t)| t.is_none()) {
                // the placement the verdict was made from: the same pure function of the node
                if let Ok(p) = st.engine.place(cluster, req, f.0) {
                    let score = scoring.score(f.0, &p);
                    let parts = Arc::new(TopParts { total: score.total, parts: score.parts });
                    made.push((f.0, parts.clone()));
                    *top = Some(parts);
                }
            }
            let mut table = shape.table();
            for (i, parts) in made {
                table.set_top(i, stamps[i], parts);
            }
        }
        let rank = cluster.name_rank();
        let mut top: Vec<(&Ranked, Option<Arc<TopParts>>)> = fits.iter().zip(full).collect();
        // the engine's ranking: total, then name
        let total = |(f, t): &(&Ranked, Option<Arc<TopParts>>)| t.as_ref().map_or(f.2 as f64, |t| t.total);
        top.sort_by(|a, b| total(b).total_cmp(&total(a)).then_with(|| rank.get(a.0 .0).cmp(&rank.get(b.0 .0))));
        top.iter()
            .map(|entry| TopScore {
                node: cluster.nodes()[entry.0 .0].name.clone(),
                score: entry.0 .1 as i64,
                total: total(entry),
                parts: entry.1.iter().flat_map(|t| t.parts.iter()).map(|(n, v)| (n.to_string(), *v)).collect(),
            })
            .collect()
    }

    /// When the scores of the judged nodes (`scores` by index) hold: the intersection of their windows.
    fn window_of(st: &State, scores: &[i8], now: i64) -> (i64, i64) {
        let judged = st.cluster.nodes().iter().zip(scores).filter(|(_, &s)| s != NOT_JUDGED);
        judged.fold((i64::MIN, i64::MAX), |(from, until), (n, _)| {
            let (f, u) = st.engine.verdict_window(n, now);
            (from.max(f), until.min(u))
        })
    }

    /// Why the engine rejected a node, as the answer says it: the class and the cause (no text, and
    /// no detail, which only logs read).
    fn rejection(st: &State, req: &PodRequest, r: &Rejection) -> ReasonKey {
        let why = st.engine.classify_rejection(&st.cluster, req, r);
        let unresolvable = why.as_ref().map_or(r.unresolvable, |w| w.is_unresolvable());
        let class = if unresolvable { RejectClass::Unresolvable } else { RejectClass::Preemptable };
        (class, why.map(|w| w.cause()))
    }

    /// The verdict on every candidate from the shape's cache, judging (and caching) the nodes whose
    /// entry is missing, made for another state of the node, or expired. `emit` gets each position
    /// in order with its verdict (`None` for names not in the node cache).
    pub(super) fn with_cached(
        &self,
        st: &State,
        shape: &Shape,
        req: &PodRequest,
        c: &Candidates<'_>,
        now: i64,
        mut emit: impl FnMut(usize, Option<&Answer>),
    ) {
        let cluster = &st.cluster;
        let stamps = cluster.stamps();
        let mut table = shape.table();
        table.keep_only(st.engine.shared_key(cluster));
        // each node once: what the cache cannot answer
        let mut stale = Vec::new();
        let mut unique = 0;
        for (&i, &first) in c.at.iter().zip(&c.first) {
            if let (Some(i), true) = (i, first) {
                unique += 1;
                if table.get(i, stamps[i], now).is_none() {
                    stale.push(i);
                }
            }
        }
        self.shapes.count(unique - stale.len(), stale.len());
        let mut fresh = HashMap::with_capacity(stale.len());
        if !stale.is_empty() {
            let nodes = cluster.nodes();
            let ev = st.engine.evaluate_in_order(cluster, req, &stale, now, false);
            for cand in &ev.ranked {
                let score = cand.score.clamp(0, MAX_SCORE) as u8;
                fresh.insert(cand.node, Answer::Fits(score, cand.total as f32));
            }
            for r in &ev.rejected {
                let key = Self::rejection(st, req, r);
                let unresolvable = key.0 == RejectClass::Unresolvable;
                fresh.insert(r.node, Answer::No(table.intern(key, || reasons::rejection(key.1, unresolvable))));
            }
            for (&i, a) in &fresh {
                table.set(i, stamps[i], st.engine.verdict_window(&nodes[i], now), a.clone());
            }
        }
        for (p, &i) in c.at.iter().enumerate() {
            // `fresh` too: a verdict whose window does not reach past now is answered but not kept
            emit(p, i.and_then(|i| table.get(i, stamps[i], now).or_else(|| fresh.get(&i))));
        }
    }

    /// Filters and scores the known candidates without the shape cache (each evaluated once however
    /// often it is named). Rejection reasons are written only when `reasons` is set (prioritize
    /// does not send them).
    pub(super) fn judge(&self, st: &State, req: &PodRequest, c: &Candidates<'_>, now: i64, reasons: bool) -> Judged {
        let cluster = &st.cluster;
        let mut scores = vec![NOT_JUDGED; cluster.nodes().len()];
        let indices: Vec<usize> = c.unique().filter_map(|p| c.at[p]).collect();
        for &i in &indices {
            // marks the node as listed; the evaluation below overwrites the ones that fit
            scores[i] = REJECTED;
        }
        let evaluation = st.engine.evaluate_in_order(cluster, req, &indices, now, self.log.is_some());
        let mut totals = HashMap::with_capacity(evaluation.ranked.len());
        for cand in &evaluation.ranked {
            scores[cand.node] = cand.score.clamp(0, MAX_SCORE) as i8;
            totals.insert(cand.node, cand.total as f32);
        }
        let mut rejects = HashMap::with_capacity(if reasons { evaluation.rejected.len() } else { 0 });
        // the engine filters without classifying rejections; only rejected nodes pay for it, and
        // nodes rejected for the same cause share one reason
        let mut texts: HashMap<ReasonKey, Arc<Reason>> = HashMap::new();
        for r in evaluation.rejected.iter().filter(|_| reasons) {
            let key = Self::rejection(st, req, r);
            let reason = texts.entry(key).or_insert_with(|| {
                let text = reasons::rejection(key.1, key.0 == RejectClass::Unresolvable);
                Arc::new(Reason::new(key.0, text))
            });
            rejects.insert(r.node, reason.clone());
        }
        Judged { scores, rejects, totals, evaluation }
    }

    /// The first [`MAX_DETAILED_NODES`] rejected candidates, in the order sent, with the node's own
    /// figures behind the reason each was given. With the pod's shape (`cached`), each rejection's
    /// detail is kept with its verdict, for the next pods of the shape.
    fn rejection_details(
        st: &State,
        req: &PodRequest,
        q: &NodeQuery<'_>,
        c: &Candidates<'_>,
        answers: &[Answer],
        cached: Option<(&Shape, i64)>,
    ) -> Vec<(String, String, Arc<Reason>)> {
        let objects = q.objects.as_deref();
        let stamps = st.cluster.stamps();
        let mut table = cached.map(|(shape, now)| (shape.table(), now));
        let rejected = c.unique().filter_map(|p| match answers.get(p) {
            Some(Answer::No(r)) => Some((p, r)),
            _ => None,
        });
        rejected
            .take(MAX_DETAILED_NODES)
            .map(|(p, r)| {
                let name = c.names[p];
                let text_of = |why: Option<Infeasible>| why.map_or_else(|| r.text.clone(), |w| w.why().detail.clone());
                let detail = match (c.at[p], r.class) {
                    // the same node state the answer was made from (the read lock is held). The
                    // answer's class says whether the emptied node would take the pod: placing it
                    // there again to find out was 17 % of the extender's CPU in a burst
                    (Some(i), RejectClass::Preemptable | RejectClass::Unresolvable) => {
                        match table.as_ref().and_then(|(t, now)| t.detail(i, stamps[i], *now)) {
                            Some(kept) => kept.to_string(),
                            None => {
                                let unresolvable = r.class == RejectClass::Unresolvable;
                                let rejection = Rejection { node: i, unresolvable };
                                let text = text_of(st.engine.explain_rejection(&st.cluster, req, &rejection));
                                if let Some((t, _)) = table.as_mut() {
                                    t.set_detail(i, stamps[i], Arc::from(text.as_str()));
                                }
                                text
                            }
                        }
                    }
                    (Some(i), RejectClass::Contract | RejectClass::UnknownNode) => {
                        text_of(st.engine.explain(&st.cluster, req, i))
                    }
                    (None, _) => UnknownNode::of(objects.and_then(|o| o.get(p))).detail(name),
                };
                (name.to_string(), detail, r.clone())
            })
            .collect()
    }

    /// The best nodes with each scorer's share, re-scored in full (the ranking pass keeps only totals).
    pub(super) fn top_scores(st: &State, req: &PodRequest, ev: &Evaluation, now: i64) -> Vec<TopScore> {
        let cluster = &st.cluster;
        let scoring = st.engine.scoring(cluster, req, now);
        ev.ranked
            .iter()
            .take(TOP_NODES)
            .map(|c| {
                let parts = c.placement(cluster, req).map(|p| scoring.score(c.node, &p).parts).unwrap_or_default();
                TopScore {
                    node: cluster.nodes()[c.node].name.clone(),
                    score: c.score,
                    total: c.total,
                    parts: parts.iter().map(|(n, v)| (n.to_string(), *v)).collect(),
                }
            })
            .collect()
    }

    /// The reason of a pod that asks one GPU for more memory than any GPU of the cluster has
    /// (`placement::feasibility::oversized`): it never fits, and saying "no GPU with that much
    /// free" would read like a full cluster. Unresolvable, so no preemption is tried for it.
    fn never_fits(st: &State, req: &PodRequest) -> Option<Arc<Reason>> {
        let largest = {
            let mut cached = st.largest_gpus.lock().unwrap_or_else(|e| e.into_inner());
            // nodes change only under the write lock, so this stays right until they do
            cached.get_or_insert_with(|| Arc::new(largest_gpus(st.cluster.nodes()))).clone()
        };
        let o = oversized(req, &largest)?;
        Some(Arc::new(Reason::new(RejectClass::Unresolvable, prefixed(&o.to_string()))))
    }

    /// The filter verb: the pod's verdict on every candidate, each rejection with a reason that
    /// names no node (kube-scheduler groups nodes by it); what it decided goes to the placement log.
    pub fn filter<'a>(&self, mut q: NodeQuery<'a>) -> FilterDecision<'a> {
        let started = Instant::now();
        let mut d = self.candidates_decision("filter", &q, started);
        // the decision's candidates own the names from here (thousands: not copied)
        let names = std::mem::take(&mut q.names);
        let q = &q;
        if !self.is_ready() {
            // an answer from an incomplete state could place a pod on GPUs that are taken
            d.error = Some(NOT_READY.into());
            return self.finish(d, started, FilterDecision::Error(NOT_READY.into()));
        }
        let req = match self.remember_pod(q.pod) {
            Ok(r) => r,
            Err(reason) => {
                let reason = Arc::new(Reason::new(RejectClass::Contract, prefixed(&reason)));
                self.metrics.rejection(RejectClass::Contract, names.len() as u64);
                self.metrics.pod_filtered(q.pod.uid(), Some(RejectClass::Contract), Instant::now());
                d.rejections.insert(reason.text.clone(), names.len());
                d.rejection_classes.insert(RejectClass::Contract.name().into(), names.len());
                d.refused = Some(reason.text.clone());
                let answers = vec![Answer::No(reason); names.len()];
                return self.finish(d, started, FilterDecision::Judged(Candidates::unresolved(names), answers));
            }
        };
        d.requests = Some(requests_of(&req));
        if req.is_gpu_free() {
            // not ours to judge: kube-scheduler only asks about it when no managedResources are set
            d.feasible = names.len();
            let answers = vec![Answer::Fits(0, 0.0); names.len()];
            return self.finish(d, started, FilterDecision::Judged(Candidates::unresolved(names), answers));
        }
        if let Some(objects) = &q.objects {
            self.learn_nodes(objects);
        }
        // the pod has arrived: counted into the learned mix before it is judged, as the simulator's
        // gpuplace policy counts a pod before it places it
        self.observe_arrival(q.pod.uid(), &req);
        self.expire_groups();
        if req.group.is_some() {
            if let Some(out) = self.group_filter(q.pod, &req, &names, &mut d) {
                return self.finish(d, started, out);
            }
        }
        // a pod filtered again is past its previous attempt: its own hold must not turn it away
        self.drop_offer(q.pod.uid());
        let st = self.read();
        // after the read lock: a freeing stamped later than this is not in the verdict
        let read_at = Instant::now();
        let c = self.names.resolve(&st.cluster, names);
        let now = self.now_ms();
        let mut unknown = Unknown::new(q);
        let mut answers = Vec::with_capacity(c.names.len());
        let from_cache = self.cached_shape(&req);
        let top = match (Self::never_fits(&st, &req), &from_cache) {
            (Some(reason), _) => {
                // no node is worth judging, and the reason is the pod's, the same on every node
                for (p, i) in c.at.iter().enumerate() {
                    answers.push(if i.is_some() { Answer::No(reason.clone()) } else { unknown.answer(p) });
                }
                Vec::new()
            }
            (None, Some(shape)) => {
                self.with_cached(&st, shape, &req, &c, now, |p, a| {
                    answers.push(match a {
                        Some(a) => a.clone(),
                        None => unknown.answer(p),
                    })
                });
                Vec::new()
            }
            (None, None) => {
                let judged = self.judge(&st, &req, &c, now, true);
                // the placement log's top scores re-score nodes in full: only when there is a log
                let top =
                    if self.log.is_some() { Self::top_scores(&st, &req, &judged.evaluation, now) } else { Vec::new() };
                for (p, i) in c.at.iter().enumerate() {
                    answers.push(match i.and_then(|i| judged.answer(i)) {
                        Some(a) => a,
                        None => unknown.answer(p),
                    });
                }
                if !q.pod.uid().is_empty() {
                    // for the prioritize call that follows (kube-scheduler sends it next, for the same pod)
                    self.evals().insert(CachedEval {
                        uid: q.pod.uid().to_string(),
                        request: req.clone(),
                        generation: st.generation,
                        made: Instant::now(),
                        window: Self::window_of(&st, &judged.scores, now),
                        scores: judged.scores,
                        top: top.clone(),
                    });
                }
                top
            }
        };
        let mut class_counts = [0u64; 4];
        let mut feasible = 0;
        for p in c.unique() {
            match &answers[p] {
                Answer::Fits(..) => feasible += 1,
                Answer::No(r) => class_counts[r.class.index()] += 1,
                Answer::NotOffered => {}
            }
        }
        d.feasible = feasible;
        if self.log.is_some() {
            d.top = top;
            for (class, &n) in RejectClass::ALL.iter().zip(&class_counts) {
                if n > 0 {
                    d.rejection_classes.insert(class.name().into(), n as usize);
                }
            }
            for p in c.unique() {
                if let Answer::No(r) = &answers[p] {
                    *d.rejections.entry(r.text.clone()).or_default() += 1;
                }
            }
        }
        // the reasons name no node's figures (kube-scheduler groups nodes by them): those go to the
        // placement log and the debug log, written only for them, and not for a retry whose line
        // the log only counts (its verdict is the pod's last one)
        let logged = self.log.as_ref().is_some_and(|log| log.writes(&d));
        if let (true, Some(shape)) = (logged, &from_cache) {
            let fits = c
                .unique()
                .filter_map(|p| match (&answers[p], c.at[p]) {
                    (Answer::Fits(s, t), Some(i)) => Some((i, *s, *t)),
                    _ => None,
                })
                .collect();
            d.top = Self::top_of_cached(&st, shape, &req, fits, now);
        }
        if logged || tracing::enabled!(tracing::Level::DEBUG) {
            let cached = from_cache.as_deref().map(|shape| (shape, now));
            for (node, detail, reason) in Self::rejection_details(&st, &req, q, &c, &answers, cached) {
                tracing::debug!(pod = %d.pod, node = %node, reason = %reason.text, detail = %detail, "node rejected");
                d.rejection_details.insert(node, detail);
            }
        }
        drop(st);
        for (class, &n) in RejectClass::ALL.iter().zip(&class_counts) {
            if n > 0 {
                self.metrics.rejection(*class, n);
            }
        }
        let waits_on = if feasible > 0 { None } else { RejectClass::of_pending(&class_counts) };
        self.metrics.pod_filtered(q.pod.uid(), waits_on, read_at);
        self.note_verdict(q.pod, &c, &answers, feasible, read_at);
        d.offered = self.offer(q.pod, &c, &mut answers, feasible);
        self.hold_offer(q.pod, &req, &c, &answers);
        self.finish(d, started, FilterDecision::Judged(c, answers))
    }

    /// Narrows an answer where more nodes fit than kube-scheduler is to score ([`NodesToScore`]):
    /// the best by score, then by the engine's total, ties in the order sent (kube-scheduler
    /// rotates where its list starts); the others, and the nodes that do not fit, are left out of
    /// the answer (kube-scheduler reads the failed nodes only when the pod fits nowhere). Returns
    /// how many nodes the answer names, when it was narrowed.
    fn offer(&self, pod: &dyn PodView, c: &Candidates<'_>, answers: &mut [Answer], feasible: usize) -> Option<usize> {
        let n = if pod.has_soft_preferences() { self.nodes_to_score.soft } else { self.nodes_to_score.plain };
        if n == 0 || feasible <= n {
            return None;
        }
        let mut fits: Vec<Ranked> = c
            .unique()
            .filter_map(|p| match answers[p] {
                Answer::Fits(s, t) => Some((p, s, t)),
                _ => None,
            })
            .collect();
        keep_best(&mut fits, n);
        // by node index, which a name named twice shares (a node that fits is a known one): a
        // thousand names are not hashed again
        let mut keep: Vec<usize> = fits.iter().filter_map(|&(p, ..)| c.at[p]).collect();
        keep.sort_unstable();
        for (a, i) in answers.iter_mut().zip(&c.at) {
            if !matches!(a, Answer::Fits(..)) || !i.is_some_and(|i| keep.binary_search(&i).is_ok()) {
                *a = Answer::NotOffered;
            }
        }
        Some(n)
    }

    pub(super) fn finish<T>(&self, mut d: Decision, started: Instant, out: T) -> T {
        d.latency_us = started.elapsed().as_micros() as u64;
        self.log(d);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The one-pass way and the partition keep the same nodes as a full sort: the best by
        /// score, then total, then the first (ties of score and total included).
        #[test]
        fn keep_best_keeps_what_a_full_sort_ranks_first(
            raw in prop::collection::vec((0u8..4, 0u8..4), 0..60),
            n in 0usize..14,
        ) {
            let fits: Vec<Ranked> = raw.iter().enumerate().map(|(p, &(s, t))| (p, s, f32::from(t) / 2.0)).collect();
            let mut sorted = fits.clone();
            sorted.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.total_cmp(&a.2)).then(a.0.cmp(&b.0)));
            let mut kept = fits.clone();
            keep_best(&mut kept, n);
            kept.sort_by_key(|f| f.0);
            let mut want: Vec<Ranked> = if n == 0 { fits } else { sorted.into_iter().take(n).collect() };
            want.sort_by_key(|f| f.0);
            prop_assert_eq!(kept, want);
        }
    }
}
