//! The typical request mix the extender scores fragmentation against, learned from the pods it sees.
//!
//! `gpuplace serve` learns the mix online with [`MixLearner`], the learner the simulator's
//! `gpuplace` policy uses, so that the shipped extender and the simulated policy score alike after
//! the same requests. `--mix FILE` fixes the mix instead (an override, for what-ifs): nothing is
//! learned then.
//!
//! - Each GPU pod is one observation, counted once by UID: at its first filter request; or, for a
//!   pod this replica never filtered, when it is first counted as bound (its own bind, the pod watch,
//!   the start-up rebuild). The UIDs counted are remembered, the oldest forgotten beyond
//!   [`DEFAULT_SEEN_UIDS`].
//! - The engine takes a fresh mix when [`MixLearner::refreshed`] gives one (the simulator's rule: at
//!   a [`MixLearner::refresh_due`] point, when the mix moved by more than
//!   [`MIX_CHANGE`](crate::placement::mix_learner::MIX_CHANGE)). Every cached score and verdict was
//!   made with the old mix, so taking one invalidates them all (`Scheduler::take_mix`).
//! - `--mix-state FILE` keeps what was learned across restarts: read at start ([`load_learner`]: a
//!   missing file is a fresh start, a bad one a warning and a fresh start), written atomically every
//!   [`SAVE_EVERY`] when something was learned and at shutdown ([`MixSaver`]). The file is the
//!   [`MixLearnerState`] JSON that `GET /mix` exports. A learner restored from it does not count
//!   the pods of the start-up rebuild: it counted them before the restart.

use std::collections::{HashSet, VecDeque};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::placement::mix::BoundDemand;
use crate::placement::mix::ReserveClass;
use crate::placement::mix::{MixEntry, WorkloadMix};
use crate::placement::mix_learner::{bundled_prior, LearnerConfig, MixLearner, MixLearnerState};
use gpuplace_core::resources::PodRequest;

/// Pod UIDs remembered as counted; beyond it the oldest are forgotten (a forgotten pod that comes
/// back to filter would count again, which needs 100,000 newer pods in between).
pub const DEFAULT_SEEN_UIDS: usize = 100_000;

/// How often `--mix-state` is written (when something was learned since).
pub const SAVE_EVERY: Duration = Duration::from_secs(60);

/// A bounded set of UIDs, oldest forgotten first.
#[derive(Debug, Default)]
struct SeenUids {
    set: HashSet<String>,
    order: VecDeque<String>,
    cap: usize,
}

impl SeenUids {
    /// Whether `uid` is new (and now remembered).
    fn insert(&mut self, uid: &str) -> bool {
        if self.cap == 0 || self.set.contains(uid) {
            return self.cap == 0;
        }
        self.set.insert(uid.to_string());
        self.order.push_back(uid.to_string());
        while self.order.len() > self.cap {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        true
    }
}

/// The learner of a `gpuplace serve` that learns its mix, and the pods it counted.
#[derive(Debug)]
pub(crate) struct Learning {
    learner: MixLearner,
    /// The mix last handed out (the engine's, once taken), which the next is measured against:
    /// decided here, under the learner's lock, so that concurrent arrivals decide in turn as the
    /// simulator's single thread does.
    current: WorkloadMix,
    seen: SeenUids,
    /// Whether pods counted at the start-up rebuild are observations: only for a learner that has
    /// seen nothing yet (one restored from `--mix-state` counted them before the restart).
    count_rebuild: bool,
}

impl Learning {
    pub fn new(learner: MixLearner) -> Self {
        let count_rebuild = learner.observed() == 0;
        let seen = SeenUids { cap: DEFAULT_SEEN_UIDS, ..SeenUids::default() };
        Self { current: learner.mix(), learner, seen, count_rebuild }
    }

    /// The mix the engine starts with.
    pub fn current(&self) -> &WorkloadMix {
        &self.current
    }

    pub fn learner(&self) -> &MixLearner {
        &self.learner
    }

    pub fn count_rebuild(&self) -> bool {
        self.count_rebuild
    }

    pub fn is_seen(&self, uid: &str) -> bool {
        self.seen.set.contains(uid)
    }

    /// Remembers a pod as counted without counting it.
    pub fn mark_seen(&mut self, uid: &str) {
        self.seen.insert(uid);
    }

    /// Counts the pod `uid` once. `Some((mix, observed))` when the user of the mix should take a
    /// fresh one now.
    pub fn observe(&mut self, uid: &str, req: &PodRequest, gpu_memory_mib: u64) -> Option<(WorkloadMix, u64)> {
        let entry = MixEntry::from_request(req, gpu_memory_mib)?;
        if !self.seen.insert(uid) {
            return None;
        }
        self.learner.observe(&entry);
        let next = self.learner.refreshed(&self.current)?;
        self.current = next.clone();
        Some((next, self.learner.observed()))
    }
}

/// Where the mix in use comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MixSource {
    /// Learned from the pods seen (the default).
    Learned,
    /// Given with `--mix FILE` (or by the embedding program): nothing is learned.
    Fixed,
}

/// The mix in `/inspect`: what fragmentation is scored against right now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixReport {
    pub source: MixSource,
    /// GPU pods observed (lifetime, those before a restart with `--mix-state` included; 0 when fixed).
    pub observed: u64,
    /// Observations counted when the mix in use was taken (it is looked at again after 1, 2, 4, ..
    /// 512 observations, then every 1,024, and taken when it moved).
    pub taken_at: u64,
    /// The learner's half-life, in observations (none when fixed).
    pub half_life: Option<f64>,
    /// The mix in use: gpus, milli (per-GPU share, 1000 = whole), cpu_milli, memory_mib, models,
    /// weight (they sum to 1), most popular first.
    pub entries: Vec<MixEntry>,
    /// The reserve (`placement::scorers::reserve`): the request types whose last free hosts are
    /// kept back, learned and from the node inventory, with how many hosts are free now.
    #[serde(default)]
    pub reserve: Vec<ReserveReport>,
    /// The lists of GPU models whose GPUs are kept for the pods bound to them when they run short
    /// (`placement::scorers::model_supply`): learned, and one per model of the node inventory.
    #[serde(default)]
    pub model_lists: Vec<ModelListReport>,
}

/// One list of GPU models as `/inspect` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelListReport {
    /// models, share (of the GPU demand bound to the list), gpus_per_pod, cpu_milli_per_pod,
    /// memory_mib_per_pod.
    #[serde(flatten)]
    pub demand: BoundDemand,
    /// Whether the list is the node inventory's (no pod bound to the model alone seen yet).
    pub inventory: bool,
    /// Free GPUs of the list's models that their hosts can still feed, for pods of its size.
    pub usable_gpus: f64,
    /// Pods that could run elsewhere score 0 on the list's GPUs.
    pub short: bool,
}

/// One reserve class as `/inspect` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReserveReport {
    /// gpus, milli, cpu_milli, memory_mib, models, keep (free hosts kept back).
    #[serde(flatten)]
    pub class: ReserveClass,
    /// Nodes that could take one request of the class now.
    pub free_hosts: u32,
    /// At most `keep` free hosts are left: pods smaller than the class (or, for a class that names
    /// models, not bound to them) score 0 on the reserve where they would take one.
    pub scarce: bool,
}

impl MixReport {
    /// One line for `gpuplace inspect`'s table: the source and the most popular entries.
    pub fn summary(&self) -> String {
        const SHOWN: usize = 5;
        let source = match self.source {
            MixSource::Learned => format!("learned from {} pod(s)", self.observed),
            MixSource::Fixed => "fixed (--mix)".to_string(),
        };
        if self.entries.is_empty() {
            return format!("mix: {source}; empty (fragmentation not scored)");
        }
        let mut parts: Vec<String> = self
            .entries
            .iter()
            .take(SHOWN)
            .map(|e| {
                let share = if e.milli >= 1000 { String::new() } else { format!("x{}", f64::from(e.milli) / 1000.0) };
                let models = if e.models.is_empty() { String::new() } else { format!(" {}", e.models.join("|")) };
                format!("{}{share} GPU{models} {:.0}%", e.gpus, e.weight * 100.0)
            })
            .collect();
        if self.entries.len() > SHOWN {
            parts.push(format!("+{} more", self.entries.len() - SHOWN));
        }
        let scarce = self.reserve.iter().filter(|r| r.scarce).count();
        let reserve = match self.reserve.len() {
            0 => String::new(),
            n => format!("; reserve: {n} class(es), {scarce} scarce"),
        };
        let short: Vec<String> =
            self.model_lists.iter().filter(|l| l.short).map(|l| l.demand.models.join("|")).collect();
        let lists = match (self.model_lists.len(), short.is_empty()) {
            (0, _) => String::new(),
            (n, true) => format!("; model lists: {n}, none short"),
            (n, false) => format!("; model lists: {n}, short: {}", short.join(", ")),
        };
        format!("mix: {source}: {}{reserve}{lists}", parts.join(", "))
    }
}

/// Why `--mix-state` could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum MixStateError {
    #[error("reading mix state {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("mix state {path} is not a learner state (JSON of GET /mix): {source}")]
    Parse { path: PathBuf, source: serde_json::Error },
    #[error("mix state {path}: {why}")]
    Invalid { path: PathBuf, why: String },
    #[error("writing mix state {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
}

/// Whether a learner may run with this configuration.
fn check_config(c: &LearnerConfig) -> Result<(), String> {
    if !(c.half_life.is_finite() && c.half_life > 0.0) {
        return Err(format!("half_life must be a positive number, got {}", c.half_life));
    }
    if !(c.prior_weight.is_finite() && c.prior_weight >= 0.0) {
        return Err(format!("prior_weight must be 0 or more, got {}", c.prior_weight));
    }
    if !(c.coverage > 0.0 && c.coverage <= 1.0) {
        return Err(format!("coverage must be in (0, 1], got {}", c.coverage));
    }
    Ok(())
}

/// The state saved at `path`; `Ok(None)` when there is no file.
pub fn read_state(path: &Path) -> Result<Option<MixLearnerState>, MixStateError> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(MixStateError::Read { path: path.into(), source }),
    };
    let state: MixLearnerState =
        serde_json::from_slice(&text).map_err(|source| MixStateError::Parse { path: path.into(), source })?;
    check_config(&state.config).map_err(|why| MixStateError::Invalid { path: path.into(), why })?;
    Ok(Some(state))
}

/// Writes `state` to `path` atomically: a temporary file beside it, synced, renamed over it, so a
/// crash leaves the old state or the new one, never half of one.
pub fn write_state(path: &Path, state: &MixLearnerState) -> Result<(), MixStateError> {
    let err = |source| MixStateError::Write { path: path.into(), source };
    let text = serde_json::to_vec_pretty(state).map_err(|e| err(std::io::Error::other(e)))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "mix-state".into());
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(&text)?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(e));
    }
    Ok(())
}

/// The learner `gpuplace serve` starts with: the one saved at `state` when there is one (a bad file
/// is a warning and a fresh start, never a failure to start), else a fresh one on the bundled prior.
/// `half_life`, when given, replaces the saved one from now on.
pub fn load_learner(state: Option<&Path>, half_life: Option<f64>) -> MixLearner {
    let fresh = || {
        let config = LearnerConfig {
            half_life: half_life.unwrap_or(LearnerConfig::default().half_life),
            ..LearnerConfig::default()
        };
        MixLearner::new(config, bundled_prior())
    };
    let Some(path) = state else {
        return fresh();
    };
    match read_state(path) {
        Ok(Some(mut s)) => {
            if let Some(h) = half_life {
                s.config.half_life = h;
            }
            tracing::info!(path = %path.display(), observed = s.observed, "learned mix restored");
            MixLearner::restore(&s, bundled_prior())
        }
        Ok(None) => {
            tracing::info!(path = %path.display(), "no mix state yet; learning from the bundled prior");
            fresh()
        }
        Err(e) => {
            tracing::warn!(error = %e, "mix state not usable; learning afresh from the bundled prior (the file is replaced at the next save)");
            fresh()
        }
    }
}

/// Writes the learner's state (what `state` reads, `Scheduler::mix_state` in `gpuplace serve`) to
/// `path` every `every` when it changed, and once more when finished.
#[derive(Debug)]
pub struct MixSaver {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MixSaver {
    pub fn spawn(
        state: impl Fn() -> Option<MixLearnerState> + Send + 'static,
        path: PathBuf,
        every: Duration,
    ) -> std::io::Result<Self> {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new().name("gpuplace-mix-state".into()).spawn(move || {
            // what the file holds: a restored learner's count is already there
            let mut saved = state().map(|s| s.observed);
            loop {
                let last = match stopped.recv_timeout(every) {
                    Err(RecvTimeoutError::Timeout) => false,
                    // finished (or its owner is gone): a last save, then out
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => true,
                };
                if let Some(state) = state().filter(|s| Some(s.observed) != saved) {
                    match write_state(&path, &state) {
                        Ok(()) => {
                            tracing::debug!(path = %path.display(), observed = state.observed, "mix state saved");
                            saved = Some(state.observed);
                        }
                        Err(e) => tracing::warn!(error = %e, "mix state not saved; retried later"),
                    }
                }
                if last {
                    return;
                }
            }
        })?;
        Ok(Self { stop: Some(stop), thread: Some(thread) })
    }

    /// Saves a last time (if anything changed) and waits for it.
    pub fn finish(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for MixSaver {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuplace_core::resources::{GpuDemand, MemoryDemand};

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gpuplace-mix-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("state.json")
    }

    fn share(name: &str, mib: u64) -> PodRequest {
        PodRequest::single(name, GpuDemand::Shared { gpus: 1, memory: MemoryDemand::Mib(mib), core_pct: 10 })
    }

    #[test]
    fn seen_uids_are_bounded_and_counted_once() {
        let mut s = SeenUids { cap: 2, ..SeenUids::default() };
        assert!(s.insert("a") && s.insert("b"));
        assert!(!s.insert("a"), "known");
        assert!(s.insert("c"));
        assert!(!s.set.contains("a"), "the oldest is forgotten");
        assert!(s.insert("a"));
        assert_eq!(s.order.len(), 2);
    }

    #[test]
    fn a_pod_counts_once_and_gpu_free_pods_not_at_all() {
        let mut l = Learning::new(MixLearner::default());
        assert!(l.count_rebuild());
        let due = l.observe("u1", &share("p", 8192), 32768);
        let (mix, at) = due.expect("the first observation moves the prior's mix");
        assert_eq!(at, 1);
        assert_eq!((&mix, &mix), (&l.learner().mix(), l.current()));
        assert!(l.observe("u1", &share("p", 8192), 32768).is_none());
        let mut cpu_only = share("q", 1);
        cpu_only.containers.clear();
        assert!(l.observe("u2", &cpu_only, 32768).is_none());
        assert!(!l.is_seen("u2"), "a pod without GPUs is no observation");
        l.mark_seen("u3");
        assert!(l.observe("u3", &share("r", 8192), 32768).is_none());
        assert_eq!(l.learner().observed(), 1);
    }

    #[test]
    fn state_round_trips_through_the_file_and_a_bad_file_is_a_fresh_start() {
        let path = temp("roundtrip");
        assert!(read_state(&path).unwrap().is_none(), "no file: nothing to restore");
        let fresh = load_learner(Some(&path), Some(500.0));
        assert_eq!((fresh.observed(), fresh.config().half_life), (0, 500.0));

        let mut l = Learning::new(MixLearner::default());
        for i in 0..100 {
            l.observe(&format!("u{i}"), &share("p", 4096 * (1 + i % 3)), 32768);
        }
        write_state(&path, &l.learner().state()).unwrap();
        let back = load_learner(Some(&path), None);
        assert_eq!(back.observed(), 100);
        assert_eq!(back.mix().entries.len(), l.learner().mix().entries.len());
        assert!(!Learning::new(back).count_rebuild(), "a restored learner counted the running pods already");
        assert_eq!(load_learner(Some(&path), Some(300.0)).config().half_life, 300.0, "the flag wins");
        let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temporary file left behind");

        std::fs::write(&path, b"{\"config\": 1").unwrap();
        assert!(matches!(read_state(&path), Err(MixStateError::Parse { .. })));
        assert_eq!(load_learner(Some(&path), None).observed(), 0, "corrupt: a fresh learner");
        let mut bad = l.learner().state();
        bad.config.half_life = -5.0;
        std::fs::write(&path, serde_json::to_vec(&bad).unwrap()).unwrap();
        let e = read_state(&path).unwrap_err();
        assert!(matches!(e, MixStateError::Invalid { .. }) && e.to_string().contains("half_life"), "{e}");
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn the_summary_names_the_source_and_the_top_entries() {
        let l = MixLearner::default();
        let r = MixReport {
            source: MixSource::Learned,
            observed: 0,
            taken_at: 0,
            half_life: Some(2000.0),
            entries: l.mix().entries,
            reserve: Vec::new(),
            model_lists: Vec::new(),
        };
        let s = r.summary();
        assert!(s.starts_with("mix: learned from 0 pod(s): 1 GPU 30%, 1x0.5 GPU 20%"), "{s}");
        assert!(s.ends_with("+2 more"), "{s}");
        let class = ReserveClass { gpus: 8, milli: 1000, cpu_milli: 96_001, memory_mib: 0, models: vec![], keep: 2 };
        let reserve = vec![
            ReserveReport { class: class.clone(), free_hosts: 2, scarce: true },
            ReserveReport { class: ReserveClass { keep: 1, ..class }, free_hosts: 2, scarce: false },
        ];
        let with_reserve = MixReport { reserve, ..r };
        assert!(
            with_reserve.summary().ends_with("+2 more; reserve: 2 class(es), 1 scarce"),
            "{}",
            with_reserve.summary()
        );
        let list = |models: &str, short: bool| ModelListReport {
            demand: BoundDemand {
                models: models.split('|').map(str::to_string).collect(),
                share: 0.1,
                gpus_per_pod: 1.0,
                cpu_milli_per_pod: 8000.0,
                memory_mib_per_pod: 0.0,
            },
            inventory: false,
            usable_gpus: 12.0,
            short,
        };
        let with_lists =
            MixReport { model_lists: vec![list("T4", true), list("V100M16|V100M32", false)], ..with_reserve.clone() };
        assert!(with_lists.summary().ends_with("1 scarce; model lists: 2, short: T4"), "{}", with_lists.summary());
        let json = serde_json::to_value(&with_lists.model_lists[0]).unwrap();
        assert_eq!((json["share"].as_f64(), json["short"].as_bool()), (Some(0.1), Some(true)));
        let json = serde_json::to_value(&with_reserve.reserve[0]).unwrap();
        assert_eq!(
            (json["gpus"].as_u64(), json["keep"].as_u64(), json["free_hosts"].as_u64()),
            (Some(8), Some(2), Some(2))
        );
        let fixed = MixReport {
            source: MixSource::Fixed,
            observed: 0,
            taken_at: 0,
            half_life: None,
            entries: vec![],
            reserve: vec![],
            model_lists: vec![],
        };
        assert!(fixed.summary().contains("fixed (--mix); empty"), "{}", fixed.summary());
    }
}
