//! `gpuplace-device-plugin discover`: what the node has, for an operator's first look.
//!
//! The JSON form is a superset of the `shared/topologies` schema (`name`, `description`,
//! `nvlink_fabric`, `gpus`, `links`), so a real node's output can be replayed by the simulator and
//! used as a test topology as is.

use std::fmt::Write;

use serde_json::Value;

use crate::nvml::Inventory;

/// The JSON document.
pub fn to_json(inv: &Inventory) -> Value {
    let mut v = serde_json::to_value(inv).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        m.insert("description".into(), Value::String(inv.to_topology_file().description));
    }
    v
}

/// nvidia-smi's cell for a pair: `NV#` when NVLinked, else the PCIe level.
fn cell(inv: &Inventory, a: u32, b: u32) -> String {
    if a == b {
        return "X".into();
    }
    match inv.link(a, b) {
        Some(l) if l.nvlinks > 0 => format!("NV{}", l.nvlinks),
        Some(l) => serde_json::to_value(l.pcie).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default(),
        None => "?".into(),
    }
}

/// The human form: a GPU table, then a link matrix like `nvidia-smi topo -m`.
pub fn to_text(inv: &Inventory) -> String {
    let mut s = String::new();
    let fabric =
        serde_json::to_value(inv.nvlink_fabric).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
    let _ = writeln!(
        s,
        "{} GPU(s) on {} ({} backend), NVLink fabric: {fabric}, driver: {}",
        inv.gpus.len(),
        inv.name,
        inv.backend,
        inv.driver_version.as_deref().unwrap_or("-")
    );
    if inv.gpus.is_empty() {
        return s;
    }
    let _ = writeln!(s);
    let model_w = inv.gpus.iter().map(|g| g.model.len()).max().unwrap_or(5).max(5);
    let _ = writeln!(
        s,
        "GPU  {:<40}  {:<model_w$}  {:>10}  {:>4}  {:<12}  {:>8}",
        "UUID", "MODEL", "MEMORY MiB", "NUMA", "PCI BUS", "NVSWITCH"
    );
    for g in &inv.gpus {
        let numa = g.numa_node.map_or_else(|| "-".to_string(), |n| n.to_string());
        let _ = writeln!(
            s,
            "{:<3}  {:<40}  {:<model_w$}  {:>10}  {:>4}  {:<12}  {:>8}",
            g.index, g.uuid, g.model, g.memory_mib, numa, g.pci_bus_id, g.nvswitch_links
        );
    }
    let _ = writeln!(s, "\nLinks (NV# = NVLink lanes, through NVSwitch where the fabric says so; else PCIe level):");
    let _ = write!(s, "      ");
    for g in &inv.gpus {
        let _ = write!(s, "{:>6}", format!("GPU{}", g.index));
    }
    let _ = writeln!(s, "  NUMA");
    for a in &inv.gpus {
        let _ = write!(s, "{:<6}", format!("GPU{}", a.index));
        for b in &inv.gpus {
            let _ = write!(s, "{:>6}", cell(inv, a.index, b.index));
        }
        let _ = writeln!(s, "  {}", a.numa_node.map_or_else(|| "-".to_string(), |n| n.to_string()));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvml::fake::FakeBackend;
    use crate::nvml::GpuBackend;
    use std::path::Path;

    #[test]
    fn text_shows_the_matrix_and_json_is_a_topology_file() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/topologies/dgx1-volta.json");
        let inv = FakeBackend::load(&path, "n").unwrap().inventory().unwrap();
        let text = to_text(&inv);
        assert!(text.contains("8 GPU(s) on dgx1-volta (fake backend), NVLink fabric: direct"), "{text}");
        assert!(text.contains("NV2") && text.contains("NV1") && text.contains("SYS"), "{text}");
        let json = to_json(&inv);
        let back: gpuplace_core::topology::TopologyFile = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back.gpus.len(), 8);
        assert_eq!(back.gpus[3].uuid.as_deref(), Some(inv.gpus[3].uuid.as_str()));
        let (t1, t2) = (back.graph().unwrap(), inv.topology().unwrap());
        for a in 0..8 {
            for b in 0..8 {
                if a != b {
                    assert_eq!(t1.pair_score(a, b), t2.pair_score(a, b));
                }
            }
        }
        assert_eq!(json["backend"], "fake");
    }
}
