//! Prioritize: a 0..10 score per candidate, from the evaluation filter kept when there is one.

use super::*;

impl Scheduler {
    /// The prioritize verb: 0..=[`MAX_SCORE`] per candidate, in the order given, from the engine;
    /// 0 where the pod does not fit. Answers from the shape cache, or for uncached shapes from
    /// filter's evaluation of the same pod when nothing changed since (see `EvalCache`). Returns the
    /// candidates' names (handed back, not copied) beside their scores.
    pub fn prioritize<'a>(&self, mut q: NodeQuery<'a>) -> (Vec<&'a str>, Vec<u8>) {
        let started = Instant::now();
        let mut d = self.candidates_decision("prioritize", &q, started);
        let names = std::mem::take(&mut q.names);
        let q = &q;
        let req = match self.remember_pod(q.pod) {
            Ok(r) => r,
            Err(reason) => {
                d.refused = Some(prefixed(&reason));
                let zeros = vec![0; names.len()];
                return self.finish(d, started, (names, zeros));
            }
        };
        d.requests = Some(requests_of(&req));
        if req.is_gpu_free() {
            let zeros = vec![0; names.len()];
            return self.finish(d, started, (names, zeros));
        }
        if let Some(objects) = &q.objects {
            self.learn_nodes(objects);
        }
        if let Some(scores) = self.group_priorities(q.pod.uid(), &req, &names) {
            d.feasible = scores.iter().filter(|&&s| s > 0).count();
            return self.finish(d, started, (names, scores));
        }
        let st = self.read();
        let c = self.names.resolve(&st.cluster, names);
        let now = self.now_ms();
        // per position: the score, or REJECTED
        let (scores, top): (Vec<i8>, Vec<TopScore>) = match self.cached_shape(&req) {
            Some(shape) => {
                let mut scores = Vec::with_capacity(c.at.len());
                // the log's top scores are made from these; without a log nothing is kept
                let mut fits = Vec::new();
                let logged = self.log.is_some();
                self.with_cached(&st, &shape, &req, &c, now, |p, a| {
                    scores.push(match a {
                        Some(Answer::Fits(s, t)) => {
                            if let (true, Some(i), true) = (logged, c.at[p], c.first[p]) {
                                fits.push((i, *s, *t));
                            }
                            *s as i8
                        }
                        _ => REJECTED,
                    })
                });
                let top = if logged { Self::top_of_cached(&st, &shape, &req, fits, now) } else { Vec::new() };
                (scores, top)
            }
            None => {
                let uid = q.pod.uid();
                let cached =
                    if uid.is_empty() { None } else { self.evals().scores(uid, &req, st.generation, now, &c.at) };
                match cached {
                    Some(hit) => hit,
                    None => {
                        let judged = self.judge(&st, &req, &c, now, false);
                        let scores = c.at.iter().map(|i| i.map_or(REJECTED, |i| judged.scores[i])).collect();
                        let top = if self.log.is_some() {
                            Self::top_scores(&st, &req, &judged.evaluation, now)
                        } else {
                            Vec::new()
                        };
                        (scores, top)
                    }
                }
            }
        };
        drop(st);
        d.feasible = scores.iter().filter(|&&s| s >= 0).count();
        d.top = top;
        let scores = scores.iter().map(|&s| s.clamp(0, MAX_SCORE as i8) as u8).collect();
        self.finish(d, started, (c.names, scores))
    }

    // -----------------------------------------------------------------------------------------------
    // bind
    // -----------------------------------------------------------------------------------------------
}
