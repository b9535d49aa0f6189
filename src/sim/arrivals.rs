//! Arrival orders that production has, besides the paper's shuffle. A platform team's cluster gets
//! inference shares all day and training jobs in bursts; a shuffled replay never shows what shares
//! that arrive first do to the room later jobs need (issue 30).
//!
//! Each order rearranges the seed's shuffled list (`sim::protocol::arrival_order`): the same pods,
//! so results compare across orders. It moves *units* (a pod, or all the pods of a group, which
//! arrive together) and keeps their relative order within each kind:
//! - a *job* is a group, or a pod of two or more GPUs;
//! - everything else (shares, single GPUs, CPU-only pods) is the *stream*.

use std::fmt;
use std::str::FromStr;

use crate::sim::trace::TracePod;

/// Jobs come in this many bursts in [`Arrival::Bursts`].
pub const BURSTS: usize = 8;

/// How the seed's pods arrive.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Arrival {
    /// The paper's protocol: shuffled.
    #[default]
    Shuffled,
    /// The whole stream first, then every job.
    SharesFirst,
    /// The stream in [`BURSTS`] parts, each followed by a burst of jobs.
    Bursts,
    /// The first half of the stream alone; the jobs spread evenly over the second half.
    JobsLate,
}

impl Arrival {
    pub const ALL: [Arrival; 4] = [Arrival::Shuffled, Arrival::SharesFirst, Arrival::Bursts, Arrival::JobsLate];

    pub fn name(self) -> &'static str {
        match self {
            Arrival::Shuffled => "shuffled",
            Arrival::SharesFirst => "shares-first",
            Arrival::Bursts => "bursts",
            Arrival::JobsLate => "jobs-late",
        }
    }
}

impl fmt::Display for Arrival {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Arrival {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| format!("unknown arrival order {s:?}; choose {}", Self::ALL.map(Arrival::name).join(", ")))
    }
}

/// Whether a unit is a job: a group, or a pod of two or more GPUs.
pub fn is_job(unit: &[TracePod]) -> bool {
    unit.len() > 1 || unit.iter().any(|p| p.group.is_some() || (p.num_gpu >= 2 && p.milli() > 0))
}

/// `order`'s units: a pod alone, or a group's consecutive pods.
fn units(order: Vec<TracePod>) -> Vec<Vec<TracePod>> {
    let mut out: Vec<Vec<TracePod>> = Vec::new();
    for p in order {
        match out.last_mut() {
            Some(last) if p.group.is_some() && last[0].group == p.group => last.push(p),
            _ => out.push(vec![p]),
        }
    }
    out
}

/// `order` rearranged as `arrival` says.
pub fn rearrange(order: Vec<TracePod>, arrival: Arrival) -> Vec<TracePod> {
    if arrival == Arrival::Shuffled {
        return order;
    }
    let (jobs, stream): (Vec<Vec<TracePod>>, Vec<Vec<TracePod>>) = units(order).into_iter().partition(|u| is_job(u));
    let out: Vec<Vec<TracePod>> = match arrival {
        Arrival::Shuffled | Arrival::SharesFirst => stream.into_iter().chain(jobs).collect(),
        Arrival::Bursts => interleave(stream, jobs, 0, BURSTS),
        Arrival::JobsLate => {
            let half = stream.len() / 2;
            let each = jobs.len();
            interleave(stream, jobs, half, each)
        }
    };
    out.into_iter().flatten().collect()
}

/// `stream[..start]`, then the rest of the stream cut into `parts` equal parts (at most one per
/// job), each followed by its share of the jobs, in order.
fn interleave(stream: Vec<Vec<TracePod>>, jobs: Vec<Vec<TracePod>>, start: usize, parts: usize) -> Vec<Vec<TracePod>> {
    let start = start.min(stream.len());
    let parts = parts.min(jobs.len()).max(1);
    let rest = stream.len() - start;
    let mut out = Vec::with_capacity(stream.len() + jobs.len());
    let mut stream = stream.into_iter();
    out.extend(stream.by_ref().take(start));
    let mut jobs = jobs.into_iter();
    let total_jobs = jobs.len();
    let (mut taken_s, mut taken_j) = (0usize, 0usize);
    for k in 1..=parts {
        let until_s = rest * k / parts;
        out.extend(stream.by_ref().take(until_s - taken_s));
        taken_s = until_s;
        let until_j = total_jobs * k / parts;
        out.extend(jobs.by_ref().take(until_j - taken_j));
        taken_j = until_j;
    }
    out.extend(stream);
    out.extend(jobs);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::trace::tests::pod;

    /// `s0..s9` shares, `m0..m2` pods of 2 GPUs, and a group `g` of 2 pods.
    fn order() -> Vec<TracePod> {
        let mut v = Vec::new();
        for i in 0..10 {
            v.push(pod(&format!("s{i}"), 1, 500));
            if i % 3 == 1 {
                v.push(pod(&format!("m{}", i / 3), 2, 1000));
            }
        }
        let mut g = vec![pod("g0", 1, 1000), pod("g1", 1, 1000)];
        for p in &mut g {
            p.group = Some("g".into());
        }
        v.splice(5..5, g);
        v
    }

    fn names(v: &[TracePod]) -> Vec<&str> {
        v.iter().map(|p| p.name.as_str()).collect()
    }

    #[test]
    fn the_same_pods_in_another_order() {
        for a in Arrival::ALL {
            let mut before = names(&order()).into_iter().map(String::from).collect::<Vec<_>>();
            let after = rearrange(order(), a);
            let mut after_names = names(&after).into_iter().map(String::from).collect::<Vec<_>>();
            before.sort();
            after_names.sort();
            assert_eq!(before, after_names, "{a}");
            // a group's pods stay together
            let at = after.iter().position(|p| p.name == "g0").unwrap();
            assert_eq!(after[at + 1].name, "g1", "{a}");
            assert_eq!(a.name().parse::<Arrival>(), Ok(a));
        }
        assert!("sorted".parse::<Arrival>().unwrap_err().contains("shares-first"));
    }

    #[test]
    fn each_order_puts_the_jobs_where_it_says() {
        assert_eq!(names(&rearrange(order(), Arrival::Shuffled)), names(&order()));
        let first = rearrange(order(), Arrival::SharesFirst);
        assert_eq!(names(&first)[..10], ["s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8", "s9"]);
        let late = rearrange(order(), Arrival::JobsLate);
        // the first half of the stream (5 of 10) alone, then jobs spread over the rest
        assert_eq!(names(&late)[..5], ["s0", "s1", "s2", "s3", "s4"]);
        assert!(names(&late)[5..].iter().any(|n| n.starts_with('m')));
        assert_eq!(names(&late)[5..], ["s5", "m0", "s6", "g0", "g1", "s7", "m1", "s8", "s9", "m2"]);
        let bursts = rearrange(order(), Arrival::Bursts);
        // 4 jobs (m0, g, m1, m2): at most one burst each, after each quarter of the stream
        assert_eq!(
            names(&bursts),
            ["s0", "s1", "m0", "s2", "s3", "s4", "g0", "g1", "s5", "s6", "m1", "s7", "s8", "s9", "m2"]
        );
    }
}
