//! The compactor's rules (docs/placement-log.md, "When a filter line is written").

use std::collections::{BTreeMap, BTreeSet, HashSet};

use super::*;
use crate::placement_log::TopScore;

const MIN: i64 = 60 * 1000;

fn filter(uid: &str, ts: i64, feasible: usize, latency_us: u64) -> Decision {
    Decision {
        v: 1,
        ts_unix_ms: ts,
        verb: "filter".into(),
        pod: format!("ns/{uid}"),
        uid: uid.into(),
        mode: Some("names".into()),
        candidates: 4,
        feasible,
        rejections: if feasible < 4 {
            BTreeMap::from([("gpuplace: fewer idle GPUs".into(), 4 - feasible)])
        } else {
            BTreeMap::new()
        },
        latency_us,
        ..Decision::default()
    }
}

fn verb(uid: &str, verb: &str, ts: i64) -> Decision {
    Decision {
        v: 1,
        ts_unix_ms: ts,
        verb: verb.into(),
        pod: format!("ns/{uid}"),
        uid: uid.into(),
        ..Decision::default()
    }
}

fn bind(uid: &str, ts: i64, outcome: &str) -> Decision {
    Decision { outcome: Some(outcome.into()), ..verb(uid, "bind", ts) }
}

fn compactor() -> Compactor {
    Compactor::new(CompactOptions::default())
}

/// Every line `decisions` make, the end included.
fn run(c: &mut Compactor, decisions: impl IntoIterator<Item = Decision>) -> Vec<Decision> {
    let mut out: Vec<Decision> = decisions.into_iter().flat_map(|d| c.push(d)).collect();
    out.extend(c.finish());
    out
}

/// Filter calls the lines stand for: filter lines, and the calls counted on any line.
fn filter_calls(lines: &[Decision]) -> u64 {
    lines.iter().map(|d| u64::from(d.verb == "filter") + d.repeats.map_or(0, |r| r.count)).sum()
}

fn repeats(count: u64, first: i64, last: i64, max: u64, sum: u64) -> Option<Repeats> {
    Some(Repeats { count, first_ts_unix_ms: first, last_ts_unix_ms: last, latency_us_max: max, latency_us_sum: sum })
}

#[test]
fn repeats_are_counted_and_go_out_with_the_next_change() {
    let mut c = compactor();
    assert_eq!(c.push(filter("a", 1000, 0, 50)).len(), 1, "a pod's first filter is written");
    for (ts, lat) in [(2000, 70), (3000, 90), (4000, 60)] {
        assert!(c.push(filter("a", ts, 0, lat)).is_empty(), "the same verdict again is held");
    }
    let out = c.push(filter("a", 5000, 1, 80));
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].feasible, out[0].ts_unix_ms, out[0].latency_us), (1, 5000, 80), "the change itself");
    assert_eq!(out[0].repeats, repeats(3, 2000, 4000, 90, 220));
    // the counts are spent: the next repeat of the new verdict starts from none
    assert!(c.push(filter("a", 6000, 1, 10)).is_empty());
    let end = c.finish();
    assert_eq!(end.len(), 1);
    assert_eq!((end[0].ts_unix_ms, end[0].repeats), (6000, None), "the one held call, as itself");
    assert_eq!(c.pods(), 0);
}

#[test]
fn what_a_verdict_is() {
    let base = filter("a", 0, 2, 10);
    let mut busy = filter("a", 1, 2, 999);
    busy.rejection_details.insert("n1".into(), "figures that moved".into());
    busy.top.push(TopScore { node: "n2".into(), score: 7, ..TopScore::default() });
    let mut c = compactor();
    c.push(base.clone());
    assert!(c.push(busy).is_empty(), "time, latency, details and scores are not the verdict");
    // nor the counts, which every bind elsewhere moves
    let mut moved = filter("a", 2, 3, 10);
    moved.candidates = 5;
    moved.offered = Some(1);
    moved.rejections.values_mut().for_each(|n| *n += 7);
    assert!(c.push(moved).is_empty(), "counts of nodes are not the verdict");
    let changes: Vec<fn(&mut Decision)> = vec![
        |d| d.feasible = 0,
        |d| {
            d.rejections.insert("gpuplace: another reason".into(), 1);
        },
        |d| {
            d.rejection_classes.insert("preemptable".into(), 2);
        },
        |d| d.refused = Some("bad request".into()),
        |d| d.error = Some("no plan".into()),
        |d| d.requests = Some(Requests::default()),
        |d| d.group = Some("ns/job".into()),
        |d| d.planned_node = Some("n1".into()),
        |d| d.mode = Some("nodes".into()),
    ];
    // the most common class, which the report files a turned-away pod under
    let mut two = filter("a", 0, 0, 10);
    two.rejection_classes = BTreeMap::from([("preemptable".into(), 3), ("unresolvable".into(), 1)]);
    let mut flipped = two.clone();
    flipped.rejection_classes = BTreeMap::from([("preemptable".into(), 1), ("unresolvable".into(), 3)]);
    let mut c = compactor();
    c.push(two);
    assert_eq!(c.push(flipped).len(), 1, "another most common class is a new verdict");
    for (i, change) in changes.iter().enumerate() {
        let mut c = compactor();
        c.push(base.clone());
        let mut d = filter("a", 2, 2, 10);
        change(&mut d);
        assert_eq!(c.push(d).len(), 1, "change {i} is a new verdict");
    }
}

#[test]
fn a_bind_carries_the_repeats_and_ends_the_run() {
    for outcome in ["bound", "no_fit", "unknown_pod"] {
        let mut c = compactor();
        c.push(filter("a", 0, 2, 10));
        assert!(c.push(filter("a", 10, 2, 30)).is_empty());
        assert!(c.push(filter("a", 20, 2, 20)).is_empty());
        // a prioritize line is written and leaves the held repeats alone
        assert_eq!(c.push(verb("a", "prioritize", 25)), [verb("a", "prioritize", 25)]);
        let out = c.push(bind("a", 30, outcome));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].outcome.as_deref(), Some(outcome));
        assert_eq!(out[0].repeats, repeats(2, 10, 20, 30, 50));
        assert_eq!(c.pods(), 0, "{outcome}: forgotten");
        // a retried pod's next filter is written whole, though its verdict is the same
        assert_eq!(c.push(filter("a", 40, 2, 10)).len(), 1, "{outcome}");
    }
}

#[test]
fn a_pod_that_waits_is_restated_every_interval() {
    let mut c = Compactor::new(CompactOptions { restate_ms: 10 * MIN, ..CompactOptions::default() });
    // one hour of retries every 10 s
    let calls: Vec<Decision> = (0..=360).map(|i| filter("a", i * 10_000, 0, 40 + i as u64 % 7)).collect();
    let lines = run(&mut c, calls.clone());
    let ts: Vec<i64> = lines.iter().map(|d| d.ts_unix_ms).collect();
    assert_eq!(ts, [0, 10 * MIN, 20 * MIN, 30 * MIN, 40 * MIN, 50 * MIN, 60 * MIN], "the first, then one per interval");
    // each restatement carries the 59 calls since the line before it
    for (i, d) in lines.iter().enumerate().skip(1) {
        let prev = lines[i - 1].ts_unix_ms;
        assert_eq!(
            d.repeats.map(|r| (r.count, r.first_ts_unix_ms, r.last_ts_unix_ms)),
            Some((59, prev + 10_000, d.ts_unix_ms - 10_000))
        );
    }
    assert_eq!(filter_calls(&lines), calls.len() as u64);
    let sum: u64 = lines.iter().map(|d| d.latency_us + d.repeats.map_or(0, |r| r.latency_us_sum)).sum();
    assert_eq!(sum, calls.iter().map(|d| d.latency_us).sum::<u64>());
}

#[test]
fn a_deleted_pod_writes_its_last_held_call() {
    let mut c = compactor();
    c.push(filter("a", 0, 0, 10));
    assert!(c.forget("a").is_none(), "nothing held, nothing to write");
    assert_eq!(c.pods(), 0);
    c.push(filter("a", 100, 0, 10));
    for (ts, lat) in [(200, 11), (300, 12), (400, 13)] {
        c.push(filter("a", ts, 0, lat));
    }
    let d = c.forget("a").expect("the held calls");
    assert_eq!(
        (d.verb.as_str(), d.ts_unix_ms, d.latency_us, d.feasible),
        ("filter", 400, 13, 0),
        "the last call itself"
    );
    assert_eq!(d.repeats, repeats(2, 200, 300, 12, 23), "carrying the two before it");
    assert!(c.forget("a").is_none() && c.finish().is_empty());
}

#[test]
fn pods_not_listed_again_are_forgotten_with_their_counts() {
    let mut c = compactor();
    for uid in ["a", "b", "c"] {
        c.push(filter(uid, 0, 0, 10));
        c.push(filter(uid, 1, 0, 10));
    }
    // a pod without a UID is known by name and left to the cap
    let mut named = filter("", 0, 0, 10);
    named.pod = "ns/named".into();
    c.push(named.clone());
    let out = c.forget_unlisted(&HashSet::from(["b".to_string()]));
    let uids: BTreeSet<&str> = out.iter().map(|d| d.uid.as_str()).collect();
    assert_eq!(uids, BTreeSet::from(["a", "c"]));
    assert_eq!(c.pods(), 2);
    named.ts_unix_ms = 5;
    assert!(c.push(named).is_empty(), "still remembered by name");
}

#[test]
fn over_the_cap_the_least_recently_seen_pod_is_written_and_forgotten() {
    let mut c = Compactor::new(CompactOptions { max_pods: 2, ..CompactOptions::default() });
    c.push(filter("a", 0, 0, 10));
    c.push(filter("b", 1, 0, 10));
    assert!(c.push(filter("a", 2, 0, 10)).is_empty(), "a held, and now the most recent");
    assert!(c.push(filter("b", 3, 0, 10)).is_empty());
    assert!(c.push(filter("b", 4, 0, 10)).is_empty());
    // c arrives: a, seen least recently, goes with its held call
    let out = c.push(filter("c", 5, 0, 10));
    assert_eq!(out.iter().map(|d| (d.uid.as_str(), d.ts_unix_ms)).collect::<Vec<_>>(), [("a", 2), ("c", 5)]);
    assert_eq!(c.pods(), 2);
    // b keeps its count of 2 (one in the summary, one as the held call)
    let end = c.finish();
    assert_eq!(end.len(), 1);
    assert_eq!((end[0].uid.as_str(), end[0].ts_unix_ms, end[0].repeats.map(|r| r.count)), ("b", 4, Some(1)));
    // a pod forgotten with nothing held writes nothing: its next filter is simply written whole
    let mut c = Compactor::new(CompactOptions { max_pods: 1, ..CompactOptions::default() });
    c.push(filter("a", 0, 0, 10));
    assert_eq!(c.push(filter("b", 1, 0, 10)).len(), 1);
    assert_eq!(c.push(filter("a", 2, 0, 10)).len(), 1);
}

#[test]
fn pods_are_independent() {
    let mut c = compactor();
    let lines = run(
        &mut c,
        [
            filter("a", 0, 0, 10),
            filter("b", 1, 0, 10),
            filter("a", 2, 0, 10),
            filter("b", 3, 2, 10),
            filter("a", 4, 0, 10),
            bind("b", 5, "bound"),
            filter("a", 6, 3, 10),
        ],
    );
    let got: Vec<(&str, i64, Option<u64>)> =
        lines.iter().map(|d| (d.uid.as_str(), d.ts_unix_ms, d.repeats.map(|r| r.count))).collect();
    assert_eq!(got, [("a", 0, None), ("b", 1, None), ("b", 3, None), ("b", 5, None), ("a", 6, Some(2))]);
}

#[test]
fn every_call_mode_writes_everything() {
    let mut c = Compactor::new(CompactOptions { every_call: true, ..CompactOptions::default() });
    let calls = vec![filter("a", 0, 0, 10), filter("a", 1, 0, 10), filter("a", 2, 0, 10), bind("a", 3, "bound")];
    assert_eq!(run(&mut c, calls.clone()), calls);
    assert_eq!(c.pods(), 0);
}

#[test]
fn other_verbs_pass_through() {
    let mut c = compactor();
    c.push(filter("a", 0, 0, 10));
    c.push(filter("a", 1, 0, 10));
    let group =
        Decision { group: Some("ns/job".into()), pod: String::new(), uid: String::new(), ..verb("", "group", 2) };
    for d in [verb("a", "preempt", 2), verb("a", "prioritize", 3), group] {
        assert_eq!(c.push(d.clone()), [d]);
    }
    assert_eq!(c.finish().len(), 1, "still held");
}

/// A pseudo-random log of a few pods: runs of filters with a verdict now and then changing, binds
/// of any outcome, prioritize lines.
pub(crate) fn random_log(seed: u64, calls: usize) -> Vec<Decision> {
    let mut next = draws(seed);
    let mut out = Vec::new();
    let mut ts = 1_000_000;
    for _ in 0..calls {
        ts += next(120_000) as i64;
        let pod = format!("p{}", next(6));
        let d = match next(20) {
            0 => bind(&pod, ts, ["bound", "no_fit", "conflict"][next(3) as usize]),
            1 => verb(&pod, "prioritize", ts),
            _ => filter(&pod, ts, (next(10) / 8) as usize, 20 + next(500)),
        };
        out.push(Decision { latency_us: 20 + next(500), ..d });
    }
    out
}

#[test]
fn nothing_is_lost_and_compacting_twice_changes_nothing() {
    for seed in 0..40 {
        let log = random_log(seed, 400);
        let once = run(&mut compactor(), log.clone());
        assert!(once.len() < log.len(), "seed {seed}: {} of {}", once.len(), log.len());
        assert_eq!(filter_calls(&once), filter_calls(&log), "seed {seed}");
        for v in ["bind", "prioritize"] {
            assert_eq!(once.iter().filter(|d| d.verb == v).count(), log.iter().filter(|d| d.verb == v).count());
        }
        let sum = |l: &[Decision]| -> u64 {
            l.iter().map(|d| d.latency_us + d.repeats.map_or(0, |r| r.latency_us_sum)).sum()
        };
        assert_eq!(sum(&once), sum(&log), "seed {seed}");
        assert_eq!(run(&mut compactor(), once.clone()), once, "seed {seed}");
    }
}
