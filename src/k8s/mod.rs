//! The extender's side of the Kubernetes API (the client itself and Events are
//! `gpuplace_core::api_client`'s): API-server mode as thin adapters around [`Scheduler`], one concern
//! each: [`binder`] (one Binding that carries the assignment annotation), [`nodes`], [`pods`],
//! [`utilization`] and [`pod_groups`] (watchers; [`watched_pod`]: a Pod as the pod watcher decodes it), [`leader`] (Lease election), [`keys`] (the assignment key Secret), [`certificates`] (the
//! extender's CA and kube-scheduler's client certificate, mTLS by default), [`resign`] (re-signing after
//! a key rotation), [`stale`] (assignments left on unbound pods), [`requeue`] (pending pods sent back
//! to kube-scheduler's queue when GPUs are freed), [`dra`] (the DRA front end: slices, claims and the
//! scheduling gate), [`serve`] (API-server mode wired, and readiness).
//! Named `k8s`, not `kube`, so the `kube` crate stays visible.

pub mod binder;
pub mod books;
pub mod certificates;
pub mod dra;
pub mod keys;
pub mod leader;
pub mod nodes;
pub mod pod_groups;
pub mod pod_view;
pub mod pods;
pub mod requeue;
pub mod resign;
pub mod serve;
pub mod stale;
pub mod utilization;
pub mod watch;
pub mod watched_pod;
