//! The last few pods' filter evaluations, reused by the prioritize call that follows each.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::placement_log::TopScore;
use gpuplace_core::resources::PodRequest;

/// A cached evaluation is reused at most this long after it was made: prioritize follows filter
/// within milliseconds, and the cache is not meant to serve later pods. (Scores that depend on the
/// clock are covered by the evaluation's validity window, not by this.)
const EVAL_CACHE_MAX_AGE: Duration = Duration::from_secs(1);

/// In [`CachedEval::scores`]: a node the evaluation did not cover, and one it rejected.
pub(super) const NOT_JUDGED: i8 = -1;
pub(super) const REJECTED: i8 = -2;

/// A pod's filter evaluation, reused by the prioritize call that follows it.
pub(super) struct CachedEval {
    pub(super) uid: String,
    pub(super) request: PodRequest,
    pub(super) generation: u64,
    pub(super) made: Instant,
    /// When (Unix ms) the scores hold: every judged node's utilization samples keep their
    /// freshness in it.
    pub(super) window: (i64, i64),
    /// Per node index: score, [`REJECTED`] or [`NOT_JUDGED`].
    pub(super) scores: Vec<i8>,
    /// For the placement log (empty without one).
    pub(super) top: Vec<TopScore>,
}

/// The last few pods' evaluations, oldest dropped first.
#[derive(Default)]
pub(super) struct EvalCache {
    entries: VecDeque<CachedEval>,
    cap: usize,
    pub(super) hits: u64,
    pub(super) misses: u64,
}

impl EvalCache {
    /// An empty cache that keeps at most `cap` evaluations (0: none).
    pub(super) fn new(cap: usize) -> Self {
        Self { cap, ..Self::default() }
    }

    pub(super) fn insert(&mut self, e: CachedEval) {
        if self.cap == 0 {
            return;
        }
        self.entries.retain(|x| x.uid != e.uid);
        while self.entries.len() >= self.cap {
            self.entries.pop_front();
        }
        self.entries.push_back(e);
    }

    /// Per candidate position, the cached score, when an evaluation of exactly this pod (UID and
    /// request) at this generation, recent enough and valid at `now`, covered every known candidate.
    pub(super) fn scores(
        &mut self,
        uid: &str,
        req: &PodRequest,
        generation: u64,
        now: i64,
        at: &[Option<usize>],
    ) -> Option<(Vec<i8>, Vec<TopScore>)> {
        let found = self.entries.iter().find(|e| {
            e.uid == uid
                && e.generation == generation
                && e.made.elapsed() <= EVAL_CACHE_MAX_AGE
                && e.window.0 <= now
                && now < e.window.1
                && e.request == *req
        });
        let out = found.and_then(|e| {
            let scores = at
                .iter()
                .map(|i| match i {
                    None => Some(REJECTED),
                    Some(i) => e.scores.get(*i).copied().filter(|&s| s != NOT_JUDGED),
                })
                .collect::<Option<Vec<i8>>>()?;
            Some((scores, e.top.clone()))
        });
        if out.is_some() {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        out
    }
}
