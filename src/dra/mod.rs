//! The DRA front end (issue 32, item 3): gpuplace places pods whose GPUs come from ResourceClaims of
//! its DeviceClass. The claims are allocated by gpuplace, with the same engine as pods asking for
//! its own resources, and kube-scheduler binds the pods by the allocations' node selectors
//! (docs/architecture.md, "The DRA front end").
//!
//! - [`plan`]: a pod's claims as one engine request, and the placement as each claim's allocation
//!   (pure).

pub mod plan;
