//! The online scheduler: the state behind every front end (the kube-scheduler extender today),
//! with the decisions of each verb over the placement engine, the node cache and the bind records.
//! It takes typed inputs ([`input`]: a pod as a [`PodView`](input::PodView), the candidates' names
//! and Node objects, a bind order, preemption victims) and returns typed decisions (a verdict per
//! candidate, scores, a bind's outcome, the victims kept); how they travel is the front end's
//! concern (`crate::extender`: JSON over HTTP). docs/architecture.md, "How to add a front end".
//!
//! - [`service`]: [`Scheduler`], its state and its verbs (filter, prioritize, bind, preempt) and
//!   seams for the API-server watchers (`crate::k8s`).
//! - [`input`]: what a front end passes in.
//! - [`verdict_cache`]: the shape cache of node verdicts per request shape, and the verdicts
//!   ([`Answer`](verdict_cache::Answer)) each verb decides.
//! - [`binder`]: the seam to the API server for binds ([`binder::RecordingBinder`] in static mode).
//! - [`books`]: gpuplace's own record of who holds what per node, kept where tenants cannot write.
//! - [`reasons`]: the texts kube-scheduler shows (reasons that group across nodes, never a `%`).
//! - [`groups`]: groups placed whole (gangs and `gpuplace.io/group` jobs): their plans and the
//!   reservations that hold the plans' GPUs.
//! - [`offers`]: the GPUs a filter answer promised a single pod, held until its bind.
//! - [`requeue`]: pods just turned away for want of GPUs, sent back to kube-scheduler's queue when
//!   those GPUs are freed (its watch can be ahead of ours).
//! - [`mix`]: the typical request mix, learned from the pods seen (or fixed), and its state file.
//! - [`metrics`], [`inspect`]: what operators and planners see (the placement log is
//!   `crate::placement_log`'s); [`exposition`]: the Prometheus text format's primitives;
//!   [`room_gauges`]: the room jobs have, as gauges.

pub mod binder;
pub mod books;
pub mod exposition;
pub mod groups;
pub mod input;
pub mod inspect;
pub mod metrics;
pub mod mix;
pub mod offers;
pub mod reasons;
pub mod requeue;
pub mod room_gauges;
pub mod service;
pub mod verdict_cache;

pub use service::Scheduler;
