//! One file per scoring concern; each implements [`Scorer`](crate::placement::scorer::Scorer).

pub mod fragmentation;
pub mod model_supply;
pub mod network;
pub mod numa;
pub mod packing;
pub mod reserve;
pub mod topology;
pub mod utilization;
pub mod whole;
