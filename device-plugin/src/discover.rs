//! `gpuplace-device-plugin discover`: what the node has, for an operator's first look.
//!
//! The JSON form is a superset of the `shared/topologies` schema (`name`, `description`,
//! `nvlink_fabric`, `gpus`, `links`), so a real node's output can be replayed by the simulator and
//! used as a test topology as is.

use std::fmt::Write;

use serde_json::Value;

use crate::isolation::IsolationStatus;
use crate::nvml::Inventory;

/// The JSON document; with `isolation`, the mode the plugin would run in, the modes it could, and
/// the driver's memory limits (`isolation`, as [`IsolationStatus`] serializes).
pub fn to_json(inv: &Inventory, isolation: Option<&IsolationStatus>) -> Value {
    let mut v = serde_json::to_value(inv).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        m.insert("description".into(), Value::String(inv.to_topology_file().description));
        if let Some(s) = isolation {
            m.insert("isolation".into(), serde_json::to_value(s).unwrap_or(Value::Null));
        }
    }
    v
}

/// The isolation lines of the text form.
fn isolation_text(s: &mut String, status: &IsolationStatus) {
    let _ = writeln!(s, "Isolation: {}", status.mode);
    for m in gpuplace_core::isolation::IsolationMode::ALL {
        let state = match status.capabilities.why_not(m) {
            None => "available".to_string(),
            Some(why) => format!("unavailable: {why}"),
        };
        let _ = writeln!(s, "  {:<13} {state}", m.name());
    }
    let d = &status.driver_memory_limits;
    let _ =
        writeln!(s, "Driver memory limits: {} ({})", if d.supported { "supported" } else { "not supported" }, d.detail);
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

/// The human form: a GPU table (memory as total, the driver's reserve, what is kept for contexts
/// and what is advertised), then a link matrix like `nvidia-smi topo -m`, then the isolation mode.
pub fn to_text(inv: &Inventory, isolation: Option<&IsolationStatus>) -> String {
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
    if let Some(status) = isolation {
        isolation_text(&mut s, status);
    }
    if inv.gpus.is_empty() {
        return s;
    }
    let _ = writeln!(s);
    let model_w = inv.gpus.iter().map(|g| g.model.len()).max().unwrap_or(5).max(5);
    let _ = writeln!(
        s,
        "GPU  {:<40}  {:<model_w$}  {:>9}  {:>8}  {:>8}  {:>10}  {:>4}  {:<12}  {:>8}",
        "UUID", "MODEL", "TOTAL MiB", "RESERVED", "CONTEXTS", "ADVERTISED", "NUMA", "PCI BUS", "NVSWITCH"
    );
    for g in &inv.gpus {
        let numa = g.numa_node.map_or_else(|| "-".to_string(), |n| n.to_string());
        let reserved = g.reserved_mib.map_or_else(|| "?".to_string(), |r| r.to_string());
        let _ = writeln!(
            s,
            "{:<3}  {:<40}  {:<model_w$}  {:>9}  {:>8}  {:>8}  {:>10}  {:>4}  {:<12}  {:>8}",
            g.index,
            g.uuid,
            g.model,
            g.total_mib,
            reserved,
            g.context_reserve_mib,
            g.memory_mib,
            numa,
            g.pci_bus_id,
            g.nvswitch_links
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
        let mut inv = FakeBackend::load(&path, "n").unwrap().inventory().unwrap();
        inv.reserve_contexts(10, 512);
        let text = to_text(&inv, None);
        assert!(text.contains("8 GPU(s) on dgx1-volta (fake backend), NVLink fabric: direct"), "{text}");
        assert!(text.contains("NV2") && text.contains("NV1") && text.contains("SYS"), "{text}");
        // total, the driver's reserve (none on the fake), the contexts' and what is advertised
        let total = inv.gpus[0].total_mib;
        let row = format!("{total}         0      5120  {:>10}", total - 5120);
        assert!(text.contains("TOTAL MiB  RESERVED  CONTEXTS  ADVERTISED") && text.contains(&row), "{text}");
        let json = to_json(&inv, None);
        assert_eq!(json["gpus"][0]["total_mib"], total);
        assert_eq!(json["gpus"][0]["context_reserve_mib"], 5120);
        assert_eq!(json["gpus"][0]["memory_mib"], total - 5120);
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

    #[test]
    fn the_isolation_mode_and_driver_limits_are_shown() {
        use crate::isolation::{Capabilities, IsolationStatus};
        use crate::nvml::DriverMemoryLimits;
        use gpuplace_core::isolation::IsolationMode;
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/topologies/dgx1-volta.json");
        let inv = FakeBackend::load(&path, "n").unwrap().inventory().unwrap();
        let status = IsolationStatus {
            mode: IsolationMode::Guard,
            capabilities: Capabilities::new(Err("driver 550: no symbol".into()), Err("no MPS daemon".into()), Ok(())),
            driver_memory_limits: DriverMemoryLimits::absent("driver 550: no symbol"),
        };
        let text = to_text(&inv, Some(&status));
        assert!(text.contains("Isolation: guard\n"), "{text}");
        assert!(text.contains("  mps           unavailable: no MPS daemon\n"), "{text}");
        assert!(text.contains("  guard         available\n"), "{text}");
        assert!(text.contains("Driver memory limits: not supported (driver 550: no symbol)"), "{text}");
        let json = to_json(&inv, Some(&status));
        assert_eq!(json["isolation"]["mode"], "guard");
        assert_eq!(json["isolation"]["capabilities"]["missing"]["mps"], "no MPS daemon");
        assert_eq!(json["isolation"]["driver_memory_limits"]["supported"], false);
    }
}
