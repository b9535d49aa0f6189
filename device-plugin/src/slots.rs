//! Slot device IDs: each physical GPU is advertised to kubelet as K devices `<uuid>::<slot>`.
//!
//! kubelet counts `gpuplace.io/gpu` in devices, and a container asking for N GPUs gets N devices. K
//! slots per GPU let up to K containers share one GPU; the extender decides who actually fits (memory
//! and compute), kubelet only needs a free device on the right GPU. IDs carry the UUID (not the
//! index) so they stay valid when indices change across reboots or driver reloads.

use std::collections::HashMap;

use gpuplace_core::annotations::MAX_SLOTS_PER_GPU;

/// Between the GPU UUID and the slot number.
pub const SEPARATOR: &str = "::";

/// kubelet refuses device IDs longer than this (device plugin API).
pub const MAX_DEVICE_ID_LEN: usize = 63;

/// Default slots per GPU. In the Alibaba GPU-sharing trace 99.8 % of sharing pods ask for at least
/// 11 % of a GPU, so no more than 9 of them fit on one; 10 covers that with one to spare, keeps an
/// 8-GPU node at 80 devices in each ListAndWatch message, and stays far below MPS's 48 clients per
/// GPU. Nodes that pack smaller shares raise it with `--slots-per-gpu`.
pub const DEFAULT_SLOTS_PER_GPU: u32 = 10;

/// Why a device ID or the slot layout was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    #[error("device ID {0:?} is not <gpu-uuid>::<slot>")]
    Malformed(String),
    #[error("device ID {id:?} names GPU {uuid}, which this node does not have")]
    UnknownGpu { id: String, uuid: String },
    #[error("device ID {id:?} names slot {slot}, but GPUs have {k} slots")]
    SlotOutOfRange { id: String, slot: u32, k: u32 },
    #[error("device ID {0:?} is longer than kubelet's 63 characters")]
    TooLong(String),
    #[error("slots per GPU must be 1 to 1000, not {0}")]
    BadSlotCount(u32),
}

/// Formats a slot's device ID.
pub fn slot_id(uuid: &str, slot: u32) -> String {
    format!("{uuid}{SEPARATOR}{slot}")
}

/// Splits a device ID into UUID and slot number.
pub fn parse_slot_id(id: &str) -> Result<(&str, u32), SlotError> {
    let (uuid, slot) = id.rsplit_once(SEPARATOR).ok_or_else(|| SlotError::Malformed(id.to_string()))?;
    // digits only: "+1" or " 1" would parse but are not IDs we issued
    if uuid.is_empty() || slot.is_empty() || !slot.bytes().all(|b| b.is_ascii_digit()) {
        return Err(SlotError::Malformed(id.to_string()));
    }
    let slot = slot.parse().map_err(|_| SlotError::Malformed(id.to_string()))?;
    Ok((uuid, slot))
}

/// The slot layout of one node: which device IDs exist and which GPU each belongs to.
#[derive(Debug, Clone)]
pub struct SlotTable {
    uuids: Vec<String>,
    by_uuid: HashMap<String, u32>,
    per_gpu: u32,
}

/// A parsed slot of this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot {
    /// GPU index.
    pub gpu: u32,
    pub slot: u32,
}

impl SlotTable {
    /// `uuids` by GPU index.
    pub fn new(uuids: Vec<String>, per_gpu: u32) -> Result<Self, SlotError> {
        if !(1..=MAX_SLOTS_PER_GPU).contains(&per_gpu) {
            return Err(SlotError::BadSlotCount(per_gpu));
        }
        for u in &uuids {
            let longest = slot_id(u, per_gpu - 1);
            if longest.len() > MAX_DEVICE_ID_LEN {
                return Err(SlotError::TooLong(longest));
            }
        }
        let by_uuid = uuids.iter().enumerate().map(|(i, u)| (u.clone(), i as u32)).collect();
        Ok(Self { uuids, by_uuid, per_gpu })
    }

    pub fn per_gpu(&self) -> u32 {
        self.per_gpu
    }

    pub fn gpus(&self) -> usize {
        self.uuids.len()
    }

    pub fn uuid(&self, gpu: u32) -> Option<&str> {
        self.uuids.get(gpu as usize).map(String::as_str)
    }

    pub fn id(&self, s: Slot) -> String {
        slot_id(self.uuid(s.gpu).unwrap_or_default(), s.slot)
    }

    /// Every device ID of one GPU, slot order.
    pub fn ids_of(&self, gpu: u32) -> impl Iterator<Item = String> + '_ {
        let uuid = self.uuid(gpu).unwrap_or_default();
        (0..self.per_gpu).map(move |s| slot_id(uuid, s))
    }

    /// Resolves a device ID kubelet sent.
    pub fn parse(&self, id: &str) -> Result<Slot, SlotError> {
        let (uuid, slot) = parse_slot_id(id)?;
        let gpu = *self
            .by_uuid
            .get(uuid)
            .ok_or_else(|| SlotError::UnknownGpu { id: id.to_string(), uuid: uuid.to_string() })?;
        if slot >= self.per_gpu {
            return Err(SlotError::SlotOutOfRange { id: id.to_string(), slot, k: self.per_gpu });
        }
        Ok(Slot { gpu, slot })
    }

    /// Resolves a list of device IDs; the first bad one is the error.
    pub fn parse_all<S: AsRef<str>>(&self, ids: &[S]) -> Result<Vec<Slot>, SlotError> {
        ids.iter().map(|id| self.parse(id.as_ref())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const U0: &str = "GPU-fef8089b-4820-abfc-e83e-94318197576e";
    const U1: &str = "GPU-0a1b2c3d-4820-abfc-e83e-94318197576e";

    #[test]
    fn ids_round_trip_and_bad_ids_are_errors() {
        let t = SlotTable::new(vec![U0.into(), U1.into()], 10).unwrap();
        assert_eq!(t.id(Slot { gpu: 1, slot: 7 }), format!("{U1}::7"));
        assert_eq!(t.parse(&format!("{U1}::7")).unwrap(), Slot { gpu: 1, slot: 7 });
        assert_eq!(t.ids_of(0).count(), 10);
        assert!(matches!(t.parse(&format!("{U1}::10")), Err(SlotError::SlotOutOfRange { slot: 10, .. })));
        assert!(matches!(t.parse("GPU-nope::1"), Err(SlotError::UnknownGpu { .. })));
        for bad in [U0, "::1", &format!("{U0}::"), &format!("{U0}::+1"), &format!("{U0}::99999999999")] {
            assert!(matches!(t.parse(bad), Err(SlotError::Malformed(_))), "{bad}");
        }
        // MIG-style UUIDs with "::" inside would still split at the last separator
        assert_eq!(parse_slot_id("a::b::3").unwrap(), ("a::b", 3));
    }

    #[test]
    fn slot_counts_and_lengths_are_checked() {
        assert_eq!(SlotTable::new(vec![U0.into()], 0).unwrap_err(), SlotError::BadSlotCount(0));
        // a 40-character NVML UUID leaves room for "::" and three digits
        assert!(SlotTable::new(vec![U0.into()], 1000).is_ok());
        let long = format!("{U0}-extra-long-suffix-xx");
        assert!(matches!(SlotTable::new(vec![long], 10), Err(SlotError::TooLong(_))));
    }
}
