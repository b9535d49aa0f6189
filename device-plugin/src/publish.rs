//! When to publish live utilization (the `gpuplace.io/utilization` value, in this node's utilization
//! ConfigMap), and the seam that writes it.
//!
//! [`decide`] is the policy, pure: publish the first sweep; then publish when any GPU's SM utilization
//! or memory use moved by more than the threshold (percent points of the whole GPU) since the last
//! *published* value (so slow drift adds up), when the set of GPUs that answer changed (one fell off
//! the bus, or came back), or when the maximum interval passed. Changes are held back while the
//! minimum interval since the last publish has not passed, which bounds the API write rate whatever
//! the load does (docs/device-plugin.md has the arithmetic for 10,000 nodes).
//!
//! The value is the shared schema of `gpuplace_core::annotations`; [`UtilizationSink`] writes it:
//! `crate::k8s::utilization::KubeUtilizationSink` with an API server, [`MemorySink`] in tests,
//! [`LogSink`] without an API server.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuplace_core::annotations::{GpuUtilization, UtilizationAnnotation, ANNOTATION_UTILIZATION, UTILIZATION_VERSION};

/// The knobs of [`decide`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishPolicy {
    /// Publish when SM utilization or memory use moved by more than this many percent points.
    pub threshold_pct: u32,
    /// Changes wait until this long after the last publish.
    pub min_interval: Duration,
    /// Publish at least this often, changed or not (keeps the sample fresher than the extender's
    /// `max_sample_age_s`, 60 s by default).
    pub max_interval: Duration,
}

impl Default for PublishPolicy {
    fn default() -> Self {
        Self { threshold_pct: 10, min_interval: Duration::from_secs(10), max_interval: Duration::from_secs(30) }
    }
}

/// One GPU's current reading, as the policy and the annotation need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuReading {
    pub uuid: String,
    /// Total memory: memory movement is measured in percent of it.
    pub memory_mib: u64,
    pub sm_percent: u32,
    pub memory_used_mib: u64,
}

/// What was published last, and when (monotonic time since the sampler started).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastPublished {
    pub at: Duration,
    pub gpus: Vec<GpuReading>,
}

/// Why a sweep is published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublishReason {
    First,
    /// The first GPU found that moved by more than the threshold.
    Moved {
        uuid: String,
    },
    /// A GPU stopped answering (fell off the bus) or started again.
    GpusChanged,
    MaxInterval,
}

impl PublishReason {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Self::First => "first",
            Self::Moved { .. } => "moved",
            Self::GpusChanged => "gpus_changed",
            Self::MaxInterval => "max_interval",
        }
    }

    pub const LABELS: [&'static str; 4] = ["first", "moved", "gpus_changed", "max_interval"];
}

/// What to do with the current sweep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Publish(PublishReason),
    /// Something changed, but the minimum interval has not passed: published at a later sweep.
    Hold(PublishReason),
    /// Nothing moved enough.
    Skip,
}

/// The policy; see the module docs. `now` is monotonic time since the sampler started.
pub fn decide(policy: &PublishPolicy, last: Option<&LastPublished>, current: &[GpuReading], now: Duration) -> Decision {
    let Some(last) = last else { return Decision::Publish(PublishReason::First) };
    let elapsed = now.saturating_sub(last.at);
    if elapsed >= policy.max_interval {
        return Decision::Publish(PublishReason::MaxInterval);
    }
    let before: BTreeMap<&str, &GpuReading> = last.gpus.iter().map(|g| (g.uuid.as_str(), g)).collect();
    let now_set: BTreeMap<&str, &GpuReading> = current.iter().map(|g| (g.uuid.as_str(), g)).collect();
    let reason = if !before.keys().eq(now_set.keys()) {
        Some(PublishReason::GpusChanged)
    } else {
        let threshold = u64::from(policy.threshold_pct);
        current
            .iter()
            .find(|g| {
                before.get(g.uuid.as_str()).is_some_and(|b| {
                    let sm = u64::from(g.sm_percent.min(100).abs_diff(b.sm_percent.min(100)));
                    // "more than the threshold": a move of exactly the threshold does not publish; memory
                    // compared exactly (d * 100 > threshold * total) rather than through rounded points
                    // (a GPU reporting no memory: any change is a move of the whole)
                    let mem_d = g.memory_used_mib.abs_diff(b.memory_used_mib);
                    let mem = if g.memory_mib == 0 {
                        mem_d > 0 && threshold < 100
                    } else {
                        mem_d.saturating_mul(100) > threshold.saturating_mul(g.memory_mib)
                    };
                    sm > threshold || mem
                })
            })
            .map(|g| PublishReason::Moved { uuid: g.uuid.clone() })
    };
    match reason {
        None => Decision::Skip,
        Some(r) if elapsed < policy.min_interval => Decision::Hold(r),
        Some(r) => Decision::Publish(r),
    }
}

/// The annotation value for a sweep (GPUs that answered, in the order given).
pub fn annotation(current: &[GpuReading], at_unix_ms: i64) -> UtilizationAnnotation {
    UtilizationAnnotation {
        version: UTILIZATION_VERSION,
        at_unix_ms,
        gpus: current
            .iter()
            .map(|g| GpuUtilization {
                uuid: g.uuid.clone(),
                // the schema refuses values above 100
                sm_percent: g.sm_percent.min(100),
                memory_used_mib: g.memory_used_mib,
            })
            .collect(),
    }
}

/// Why a sink could not publish (retried at the next sweep the policy allows).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("publishing {ANNOTATION_UTILIZATION}: {0}")]
pub struct SinkError(pub String);

/// Where the value goes. The Kubernetes sink merge-patches this node's utilization ConfigMap (never
/// the Node: every Node update wakes kube-scheduler's unschedulable pods), creating it when absent.
#[tonic::async_trait]
pub trait UtilizationSink: Send + Sync {
    async fn publish(&self, value: &UtilizationAnnotation) -> Result<(), SinkError>;
}

/// Keeps what it is given (tests), and fails on demand.
#[derive(Debug, Default)]
pub struct MemorySink {
    published: Mutex<Vec<UtilizationAnnotation>>,
    fail: AtomicBool,
}

impl MemorySink {
    pub fn published(&self) -> Vec<UtilizationAnnotation> {
        self.published.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn fail(&self, fail: bool) {
        self.fail.store(fail, Ordering::Relaxed);
    }
}

#[tonic::async_trait]
impl UtilizationSink for MemorySink {
    async fn publish(&self, value: &UtilizationAnnotation) -> Result<(), SinkError> {
        if self.fail.load(Ordering::Relaxed) {
            return Err(SinkError("memory sink told to fail".into()));
        }
        self.published.lock().unwrap_or_else(|e| e.into_inner()).push(value.clone());
        Ok(())
    }
}

/// Logs the value (at debug) instead of writing it: the binary's sink without an API server, so the
/// policy runs and its publish counters show the write rate a node would cause.
#[derive(Debug, Default)]
pub struct LogSink;

#[tonic::async_trait]
impl UtilizationSink for LogSink {
    async fn publish(&self, value: &UtilizationAnnotation) -> Result<(), SinkError> {
        tracing::debug!(value = %value.to_json(), "utilization (not written: no API server)");
        Ok(())
    }
}

/// What [`Publisher::offer`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Published(PublishReason),
    Held(PublishReason),
    Skipped,
    Failed(SinkError),
}

/// The policy's state: the last published sweep, and the sink.
pub struct Publisher {
    policy: PublishPolicy,
    sink: Arc<dyn UtilizationSink>,
    last: Option<LastPublished>,
    /// After a failed write, no new attempt before this time: a failing API server gets no more
    /// writes than a busy node would make.
    retry_at: Option<Duration>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher").field("policy", &self.policy).field("last", &self.last).finish_non_exhaustive()
    }
}

impl Publisher {
    pub fn new(policy: PublishPolicy, sink: Arc<dyn UtilizationSink>) -> Self {
        Self { policy, sink, last: None, retry_at: None }
    }

    pub fn policy(&self) -> &PublishPolicy {
        &self.policy
    }

    /// Offers one sweep. A failed write leaves the last published value as it was, so a later sweep
    /// tries again, once the minimum interval after the failed attempt has passed.
    pub async fn offer(&mut self, current: Vec<GpuReading>, now: Duration, at_unix_ms: i64) -> Outcome {
        match decide(&self.policy, self.last.as_ref(), &current, now) {
            Decision::Skip => Outcome::Skipped,
            Decision::Hold(r) => Outcome::Held(r),
            Decision::Publish(r) if self.retry_at.is_some_and(|t| now < t) => Outcome::Held(r),
            Decision::Publish(r) => match self.sink.publish(&annotation(&current, at_unix_ms)).await {
                Ok(()) => {
                    self.last = Some(LastPublished { at: now, gpus: current });
                    self.retry_at = None;
                    Outcome::Published(r)
                }
                Err(e) => {
                    self.retry_at = Some(now + self.policy.min_interval);
                    Outcome::Failed(e)
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEM: u64 = 80_000;

    fn gpu(uuid: &str, sm: u32, mem: u64) -> GpuReading {
        GpuReading { uuid: uuid.into(), memory_mib: MEM, sm_percent: sm, memory_used_mib: mem }
    }

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    fn policy() -> PublishPolicy {
        PublishPolicy { threshold_pct: 10, min_interval: s(10), max_interval: s(30) }
    }

    fn last(at: u64, gpus: Vec<GpuReading>) -> LastPublished {
        LastPublished { at: s(at), gpus }
    }

    #[test]
    fn the_first_sweep_is_published() {
        assert_eq!(decide(&policy(), None, &[gpu("a", 0, 0)], s(0)), Decision::Publish(PublishReason::First));
        // even a node whose GPUs all fail to answer says so once
        assert_eq!(decide(&policy(), None, &[], s(0)), Decision::Publish(PublishReason::First));
    }

    #[test]
    fn threshold_is_strictly_more_than_and_counts_from_the_last_publish() {
        let p = policy();
        let l = last(0, vec![gpu("a", 50, 40_000), gpu("b", 0, 0)]);
        // exactly 10 points of SM, exactly 10 % of memory (8,000 MiB): not more than the threshold
        assert_eq!(decide(&p, Some(&l), &[gpu("a", 60, 48_000), gpu("b", 0, 0)], s(15)), Decision::Skip);
        assert_eq!(decide(&p, Some(&l), &[gpu("a", 40, 32_000), gpu("b", 0, 0)], s(15)), Decision::Skip);
        // 11 points of SM on b
        assert_eq!(
            decide(&p, Some(&l), &[gpu("a", 50, 40_000), gpu("b", 11, 0)], s(15)),
            Decision::Publish(PublishReason::Moved { uuid: "b".into() })
        );
        // one MiB more than 10 % of memory
        assert_eq!(
            decide(&p, Some(&l), &[gpu("a", 50, 48_001), gpu("b", 0, 0)], s(15)),
            Decision::Publish(PublishReason::Moved { uuid: "a".into() })
        );
        // drift of 4 points per sweep is measured against the published value, so it adds up
        let mut sm = 50;
        let mut published = false;
        for t in 11..14 {
            sm += 4;
            published |= matches!(
                decide(&p, Some(&l), &[gpu("a", sm, 40_000), gpu("b", 0, 0)], s(t)),
                Decision::Publish(PublishReason::Moved { .. })
            );
        }
        assert!(published, "12 points of drift over three sweeps");
        // values above 100 % (a driver glitch) count as 100
        let l = last(0, vec![gpu("a", 100, 0)]);
        assert_eq!(decide(&p, Some(&l), &[gpu("a", 250, 0)], s(15)), Decision::Skip);
    }

    #[test]
    fn max_interval_publishes_unchanged_values_and_min_interval_holds_changes() {
        let p = policy();
        let l = last(100, vec![gpu("a", 50, 0)]);
        let same = [gpu("a", 50, 0)];
        assert_eq!(decide(&p, Some(&l), &same, s(129)), Decision::Skip);
        assert_eq!(decide(&p, Some(&l), &same, s(130)), Decision::Publish(PublishReason::MaxInterval));
        // a big move 5 s after the last publish waits for the minimum interval
        let busy = [gpu("a", 100, 0)];
        assert_eq!(decide(&p, Some(&l), &busy, s(105)), Decision::Hold(PublishReason::Moved { uuid: "a".into() }));
        assert_eq!(decide(&p, Some(&l), &busy, s(110)), Decision::Publish(PublishReason::Moved { uuid: "a".into() }));
        // a clock that went backwards (it cannot, monotonic, but a caller could pass one) holds
        assert_eq!(decide(&p, Some(&l), &busy, s(50)), Decision::Hold(PublishReason::Moved { uuid: "a".into() }));
        // zero intervals: every change is published at once
        let eager = PublishPolicy { threshold_pct: 0, min_interval: s(0), max_interval: s(3600) };
        assert_eq!(
            decide(&eager, Some(&l), &[gpu("a", 51, 0)], s(100)),
            Decision::Publish(PublishReason::Moved { uuid: "a".into() })
        );
        assert_eq!(decide(&eager, Some(&l), &same, s(100)), Decision::Skip);
    }

    #[test]
    fn a_gpu_falling_off_the_bus_or_coming_back_publishes() {
        let p = policy();
        let l = last(0, vec![gpu("a", 50, 0), gpu("b", 50, 0)]);
        // b no longer answers: the sweep without it is published, values unchanged or not
        let without_b = [gpu("a", 50, 0)];
        assert_eq!(decide(&p, Some(&l), &without_b, s(12)), Decision::Publish(PublishReason::GpusChanged));
        assert_eq!(decide(&p, Some(&l), &without_b, s(3)), Decision::Hold(PublishReason::GpusChanged));
        let ann = annotation(&without_b, 1_000);
        assert_eq!(ann.gpus.len(), 1);
        // and when it is back
        let l = last(0, without_b.to_vec());
        assert_eq!(
            decide(&p, Some(&l), &[gpu("a", 50, 0), gpu("b", 0, 0)], s(12)),
            Decision::Publish(PublishReason::GpusChanged)
        );
        // a replaced GPU (same count, another UUID) is a change too
        assert_eq!(decide(&p, Some(&l), &[gpu("c", 50, 0)], s(12)), Decision::Publish(PublishReason::GpusChanged));
    }

    #[test]
    fn the_annotation_uses_the_shared_schema() {
        let ann = annotation(&[gpu("GPU-a", 130, 1234)], 1_795_246_607_571);
        let text = ann.to_json();
        assert_eq!(
            text,
            r#"{"version":1,"atUnixMs":1795246607571,"gpus":[{"uuid":"GPU-a","smPercent":100,"memoryUsedMiB":1234}]}"#
        );
        assert_eq!(UtilizationAnnotation::parse(&text).unwrap(), ann);
    }

    #[tokio::test]
    async fn the_publisher_retries_a_failed_write_and_remembers_what_it_wrote() {
        let sink = Arc::new(MemorySink::default());
        let mut p = Publisher::new(policy(), sink.clone());
        sink.fail(true);
        assert!(matches!(p.offer(vec![gpu("a", 0, 0)], s(0), 1).await, Outcome::Failed(_)));
        sink.fail(false);
        // the retry waits for the minimum interval after the failed attempt
        assert_eq!(p.offer(vec![gpu("a", 0, 0)], s(5), 2).await, Outcome::Held(PublishReason::First));
        assert_eq!(p.offer(vec![gpu("a", 0, 0)], s(10), 2).await, Outcome::Published(PublishReason::First));
        assert_eq!(p.offer(vec![gpu("a", 5, 0)], s(20), 3).await, Outcome::Skipped);
        assert_eq!(p.offer(vec![gpu("a", 5, 0)], s(40), 4).await, Outcome::Published(PublishReason::MaxInterval));
        let got = sink.published();
        assert_eq!(got.iter().map(|a| a.at_unix_ms).collect::<Vec<_>>(), [2, 4]);
        assert_eq!(got[1].gpus[0].sm_percent, 5);
    }
}
