//! Which placement-log lines are written: kube-scheduler retries a pod that did not fit, and each
//! retry would write a 1.5-3 KB filter line repeating the verdict already logged. [`Compactor`] takes
//! decisions in order and returns the lines to write: a pod's filter is written when its verdict
//! changes; a filter that repeats the pod's last written verdict is held and counted, and the count
//! goes out as `repeats` on the pod's next written line. Pure and I/O-free, so the live writer
//! ([`super::PlacementLog`], under its lock) and `gpuplace compact-log` share it.
//!
//! Every line returned is a call that happened (a held repeat goes out as itself, never as a line
//! made up from a summary), so a reader counts calls as lines plus `repeats.count`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::{Decision, Repeats, Requests};

/// A re-statement interval of 10 minutes: a pod waiting an hour writes about 6 filter lines.
pub const DEFAULT_RESTATE_MS: i64 = 10 * 60 * 1000;
/// Pods whose last verdict is remembered. Beyond it the least recently seen pod's held repeats are
/// written and it is forgotten (its next filter is written whole). A pod with repeats held keeps its
/// last call whole, about 3 KB: 30 MB at most.
pub const DEFAULT_MAX_PODS: usize = 10_000;

impl Repeats {
    /// One call, `d` itself (and whatever `d` already carried).
    fn of(d: &Decision) -> Self {
        let one = Self {
            count: 1,
            first_ts_unix_ms: d.ts_unix_ms,
            last_ts_unix_ms: d.ts_unix_ms,
            latency_us_max: d.latency_us,
            latency_us_sum: d.latency_us,
        };
        merge(Some(one), d.repeats).unwrap_or(one)
    }
}

/// Both summaries as one.
fn merge(a: Option<Repeats>, b: Option<Repeats>) -> Option<Repeats> {
    match (a, b) {
        (Some(a), Some(b)) => Some(Repeats {
            count: a.count + b.count,
            first_ts_unix_ms: a.first_ts_unix_ms.min(b.first_ts_unix_ms),
            last_ts_unix_ms: a.last_ts_unix_ms.max(b.last_ts_unix_ms),
            latency_us_max: a.latency_us_max.max(b.latency_us_max),
            latency_us_sum: a.latency_us_sum.saturating_add(b.latency_us_sum),
        }),
        (a, b) => a.or(b),
    }
}

/// What the compactor does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompactOptions {
    /// One line per call, as before repeats were counted (`serve --placement-log-every-call`).
    pub every_call: bool,
    /// A repeat arriving this long after the pod's last written line is written, with the repeats
    /// before it, so that a pod that waits for hours still shows up now and then.
    pub restate_ms: i64,
    /// See [`DEFAULT_MAX_PODS`].
    pub max_pods: usize,
}

impl Default for CompactOptions {
    fn default() -> Self {
        Self { every_call: false, restate_ms: DEFAULT_RESTATE_MS, max_pods: DEFAULT_MAX_PODS }
    }
}

/// What a filter line decided, for comparing with the pod's previous one: whether the pod fits,
/// which reasons it was given and of which classes (the most common class too, which `gpuplace
/// report` files a turned-away pod under), and what was asked. Not when (`ts_unix_ms`), how fast
/// (`latency_us`), how many nodes were sent, fit or gave each reason (`candidates`, `feasible`, the
/// counts), the per-node figures (`rejection_details`), the scores (`top`) or how many were named
/// (`offered`): those move with every bind elsewhere in the cluster, and kube-scheduler retries
/// every pending pod after each bind, without changing what the pod was told.
#[derive(Debug, Clone, PartialEq)]
struct Told {
    fits: bool,
    reasons: BTreeSet<String>,
    classes: BTreeSet<String>,
    main_class: Option<String>,
    refused: Option<String>,
    error: Option<String>,
    requests: Option<Requests>,
    group: Option<String>,
    planned_node: Option<String>,
    mode: Option<String>,
}

impl Told {
    fn of(d: &Decision) -> Self {
        Self {
            fits: d.feasible > 0,
            reasons: d.rejections.keys().cloned().collect(),
            classes: d.rejection_classes.keys().cloned().collect(),
            main_class: d.main_rejection_class().map(str::to_string),
            refused: d.refused.clone(),
            error: d.error.clone(),
            requests: d.requests.clone(),
            group: d.group.clone(),
            planned_node: d.planned_node.clone(),
            mode: d.mode.clone(),
        }
    }

    /// `Told::of(d) == *self`, without copying `d`'s fields (every filter of a pod with a
    /// placement log asks, repeats above all).
    fn matches(&self, d: &Decision) -> bool {
        self.fits == (d.feasible > 0)
            && self.reasons.iter().eq(d.rejections.keys())
            && self.classes.iter().eq(d.rejection_classes.keys())
            && self.main_class.as_deref() == d.main_rejection_class()
            && self.refused == d.refused
            && self.error == d.error
            && self.requests == d.requests
            && self.group == d.group
            && self.planned_node == d.planned_node
            && self.mode == d.mode
    }
}

/// Repeats held for a pod: the latest call whole (written as itself if nothing follows), and a
/// summary of those before it.
#[derive(Debug)]
struct Held {
    earlier: Option<Repeats>,
    last: Decision,
}

impl Held {
    /// Every held call as one summary, for the line that follows them.
    fn summary(&self) -> Repeats {
        merge(self.earlier, Some(Repeats::of(&self.last))).unwrap_or_else(|| Repeats::of(&self.last))
    }

    /// The last held call, carrying the ones before it.
    fn into_line(self) -> Decision {
        let mut d = self.last;
        d.repeats = self.earlier;
        d
    }
}

#[derive(Debug)]
struct PodState {
    verdict: Told,
    /// `ts_unix_ms` of the pod's last written filter line.
    written_ms: i64,
    held: Option<Held>,
    /// Position in [`Compactor::order`].
    seen: u64,
}

impl PodState {
    /// A repeat answered at `ts_unix_ms` is written again: the pod's last line is that old.
    fn restate_due(&self, ts_unix_ms: i64, restate_ms: i64) -> bool {
        ts_unix_ms.saturating_sub(self.written_ms) >= restate_ms
    }
}

/// Decisions in, lines to write out (see the module documentation).
#[derive(Debug, Default)]
pub struct Compactor {
    opts: CompactOptions,
    /// Pod key (UID, or `namespace/name` without one) → its last written filter verdict.
    pods: HashMap<String, PodState>,
    /// Least recently seen first, for forgetting on overflow.
    order: BTreeMap<u64, String>,
    next: u64,
}

/// The key a pod's lines are compared under.
fn key_of(d: &Decision) -> &str {
    if d.uid.is_empty() {
        &d.pod
    } else {
        &d.uid
    }
}

impl Compactor {
    pub fn new(opts: CompactOptions) -> Self {
        Self { opts: CompactOptions { max_pods: opts.max_pods.max(1), ..opts }, ..Self::default() }
    }

    pub fn options(&self) -> CompactOptions {
        self.opts
    }

    /// The lines `d` makes to write now, in order (none when it is a repeat that is held).
    pub fn push(&mut self, mut d: Decision) -> Vec<Decision> {
        if self.opts.every_call {
            return vec![d];
        }
        match d.verb.as_str() {
            "filter" => self.filter(d),
            "bind" => {
                // a bind ends the pod's run, whatever its outcome: its held repeats go with it and
                // its next filter (a failed bind is retried) is written whole
                if let Some(st) = self.remove(key_of(&d).to_string()) {
                    d.repeats = merge(st.held.map(|h| h.summary()), d.repeats);
                }
                vec![d]
            }
            // prioritize, preempt and group lines are always written and leave held repeats alone
            _ => vec![d],
        }
    }

    /// Whether [`Compactor::push`] would write `d` itself now (false: it would be held).
    pub fn writes(&self, d: &Decision) -> bool {
        if self.opts.every_call || d.verb != "filter" {
            return true;
        }
        match self.pods.get(key_of(d)) {
            None => true,
            Some(st) => !st.verdict.matches(d) || st.restate_due(d.ts_unix_ms, self.opts.restate_ms),
        }
    }

    fn filter(&mut self, mut d: Decision) -> Vec<Decision> {
        let restate_ms = self.opts.restate_ms;
        let key = key_of(&d).to_string();
        let seen = self.touch(&key);
        let Some(st) = self.pods.get_mut(&key) else {
            let (verdict, written_ms) = (Told::of(&d), d.ts_unix_ms);
            self.pods.insert(key, PodState { verdict, written_ms, held: None, seen });
            let mut out = self.overflow();
            out.push(d);
            return out;
        };
        st.seen = seen;
        if !st.verdict.matches(&d) {
            // a new verdict: written, with the calls that repeated the old one
            d.repeats = merge(st.held.take().map(|h| h.summary()), d.repeats);
            st.verdict = Told::of(&d);
            st.written_ms = d.ts_unix_ms;
            return vec![d];
        }
        let earlier = match st.held.take() {
            Some(h) => merge(Some(h.summary()), d.repeats.take()),
            None => d.repeats.take(),
        };
        let held = Held { earlier, last: d };
        if st.restate_due(held.last.ts_unix_ms, restate_ms) {
            st.written_ms = held.last.ts_unix_ms;
            return vec![held.into_line()];
        }
        st.held = Some(held);
        Vec::new()
    }

    /// `key` as the most recently seen pod; its new position.
    fn touch(&mut self, key: &str) -> u64 {
        if let Some(st) = self.pods.get(key) {
            self.order.remove(&st.seen);
        }
        let seen = self.next;
        self.next += 1;
        self.order.insert(seen, key.to_string());
        seen
    }

    fn remove(&mut self, key: String) -> Option<PodState> {
        let st = self.pods.remove(&key)?;
        self.order.remove(&st.seen);
        Some(st)
    }

    /// Over the cap: the least recently seen pods forgotten, their held calls written.
    fn overflow(&mut self) -> Vec<Decision> {
        let mut out = Vec::new();
        while self.pods.len() > self.opts.max_pods {
            let Some((_, key)) = self.order.pop_first() else { break };
            if let Some(held) = self.pods.remove(&key).and_then(|st| st.held) {
                out.push(held.into_line());
            }
        }
        out
    }

    /// The pod is gone (deleted, or its watch lost it): its held calls, as a line to write.
    pub fn forget(&mut self, key: &str) -> Option<Decision> {
        self.remove(key.to_string())?.held.map(Held::into_line)
    }

    /// After a re-list of pods by UID: every pod with a UID not in `listed` forgotten
    /// ([`Compactor::forget`]). Pods known only by name are left to the cap.
    pub fn forget_unlisted(&mut self, listed: &HashSet<String>) -> Vec<Decision> {
        let gone: Vec<String> = self
            .pods
            .keys()
            // a UID never holds a '/'; a `namespace/name` key is no UID
            .filter(|k| !k.contains('/') && !listed.contains(k.as_str()))
            .cloned()
            .collect();
        self.forget_all(gone)
    }

    /// Every held call written and every pod forgotten (shutdown, the end of an offline rewrite).
    pub fn finish(&mut self) -> Vec<Decision> {
        let all: Vec<String> = self.order.values().cloned().collect();
        self.forget_all(all)
    }

    fn forget_all(&mut self, keys: Vec<String>) -> Vec<Decision> {
        let mut out: Vec<Decision> = keys.iter().filter_map(|k| self.forget(k)).collect();
        // in the order they happened, for readers that go by position
        out.sort_by_key(|d| d.ts_unix_ms);
        out
    }

    /// Pods whose last verdict is remembered.
    pub fn pods(&self) -> usize {
        self.pods.len()
    }
}

/// Draws below `n` from a small xorshift generator seeded with `seed`, for the random logs of the
/// compactor's and the report's tests.
#[cfg(test)]
pub(crate) fn draws(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1;
    move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    }
}

#[cfg(test)]
#[path = "compactor_tests.rs"]
mod tests;
