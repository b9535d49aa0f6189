//! The learned mix inside the service: which pods are observations, and how a fresh mix replaces
//! the one every cached answer was made with (the rules are in `scheduler::mix`).

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use super::{Scheduler, UNKNOWN_GPU_MEMORY};
use crate::placement::mix::WorkloadMix;
use crate::placement::mix_learner::{typical_gpu_memory_mib, MixLearnerState};
use crate::scheduler::mix::{Learning, MixReport, MixSource, ModelListReport, ReserveReport};
use gpuplace_core::resources::PodRequest;

impl Scheduler {
    fn learning(&self) -> Option<MixGuard<'_>> {
        self.learning.as_ref().map(|l| l.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Counts an arriving GPU pod into the learned mix, once per UID, and takes a fresh mix when one
    /// is due. A no-op for a fixed mix, a pod without a UID or GPUs, or one counted before.
    pub(crate) fn observe_arrival(&self, uid: &str, req: &PodRequest) {
        if uid.is_empty() || req.is_gpu_free() {
            return;
        }
        // kube-scheduler filters a pending pod again and again: the common case costs a lookup
        match self.learning() {
            None => return,
            Some(l) if l.is_seen(uid) => return,
            Some(_) => {}
        }
        // outside the learner's lock: the two locks are never held together
        let gpu_memory = self.typical_gpu_memory();
        let due = self.learning().and_then(|mut l| l.observe(uid, req, gpu_memory));
        if let Some((mix, at)) = due {
            self.take_mix(mix, at);
        }
    }

    /// Pods counted at the start-up rebuild: observations for a learner that has seen nothing yet,
    /// only remembered for one restored from `--mix-state` (it counted them before the restart).
    pub(crate) fn observe_rebuilt(&self, pods: &[(String, PodRequest)]) {
        let count = match self.learning() {
            None => return,
            Some(mut l) if !l.count_rebuild() => {
                for (uid, _) in pods {
                    l.mark_seen(uid);
                }
                false
            }
            Some(_) => true,
        };
        if count {
            for (uid, req) in pods {
                self.observe_arrival(uid, req);
            }
        }
    }

    /// Scores with `mix` from now on, unless a mix taken later (`taken_at` observations) is in already.
    ///
    /// Every cached answer was made with the old mix. Under the write lock (a new generation: every
    /// cached evaluation is stale) the shape cache is emptied too: its verdicts are made and read
    /// only under the read lock, so none made with the old mix is left, and none is in the making.
    fn take_mix(&self, mix: WorkloadMix, taken_at: u64) {
        let mut st = self.write();
        if taken_at <= st.mix_taken_at {
            return;
        }
        tracing::debug!(observed = taken_at, entries = mix.entries.len(), "learned mix taken");
        st.engine.mix = mix;
        st.mix_taken_at = taken_at;
        self.shapes.clear();
    }

    /// The cluster's typical GPU memory (see [`typical_gpu_memory_mib`]), computed once per set of
    /// nodes.
    fn typical_gpu_memory(&self) -> u64 {
        let st = self.read();
        match st.gpu_memory_mib.load(Ordering::Relaxed) {
            UNKNOWN_GPU_MEMORY => {
                // nodes change only under the write lock, so this stays right until they do
                let m = typical_gpu_memory_mib(&st.cluster);
                st.gpu_memory_mib.store(m, Ordering::Relaxed);
                m
            }
            m => m,
        }
    }

    /// The mix in use, where it comes from, and how much was learned.
    pub fn mix_report(&self) -> MixReport {
        let learned = self.learning().map(|l| (l.learner().observed(), l.learner().config().half_life));
        let st = self.read();
        let reserve = (st.engine.reserve_classes(&st.cluster).into_iter())
            .map(|(class, free_hosts, scarce)| ReserveReport { class, free_hosts, scarce })
            .collect();
        let learned_lists = st.engine.mix.bound.len();
        let model_lists = st
            .engine
            .model_lists(&st.cluster)
            .into_iter()
            .enumerate()
            .map(|(k, (demand, usable, short))| ModelListReport {
                demand,
                inventory: k >= learned_lists,
                usable_gpus: usable as f64 / 1000.0,
                short,
            })
            .collect();
        MixReport {
            model_lists,
            source: if learned.is_some() { MixSource::Learned } else { MixSource::Fixed },
            observed: learned.map_or(0, |(n, _)| n),
            taken_at: st.mix_taken_at,
            half_life: learned.map(|(_, h)| h),
            entries: st.engine.mix.entries.clone(),
            reserve,
        }
    }

    /// GPU pods the learner counted (0 for a fixed mix).
    pub(crate) fn mix_observed(&self) -> u64 {
        self.learning().map_or(0, |l| l.learner().observed())
    }

    /// What the learner knows (`GET /mix`, `--mix-state`); `None` when the mix is fixed.
    pub fn mix_state(&self) -> Option<MixLearnerState> {
        self.learning().map(|l| l.learner().state())
    }
}

type MixGuard<'a> = MutexGuard<'a, Learning>;
