//! The placement engine: pure, deterministic, no I/O.

pub mod compact;
pub mod engine;
pub mod facts;
pub mod feasibility;
pub mod gpu_select;
pub mod group_plan;
pub mod mix;
pub mod mix_learner;
pub mod profile;
pub mod registry;
pub mod scorer;
pub mod scorers;
#[cfg(test)]
pub(crate) mod test_fixtures;
pub mod whole_units;
