//! Reading the report's inputs: `simulate --json` results (README.md), JSON Lines like the placement
//! logs (read by [`crate::placement_log::read`]); every problem names the file and the line.

use std::path::Path;

use crate::placement_log::read::{parse_lines, read, InputError};
use crate::sim::figures::PolicyReport;

/// Reads a `simulate --json` file: one object per policy per line.
pub fn read_simulate(path: &Path) -> Result<Vec<PolicyReport>, InputError> {
    parse_simulate(path, &read(path)?)
}

/// Parses `simulate --json` output; `path` only names it in errors.
pub fn parse_simulate(path: &Path, text: &str) -> Result<Vec<PolicyReport>, InputError> {
    parse_lines(path, text, "simulate results", |_, raw| {
        let r: PolicyReport = serde_json::from_str(raw).map_err(|e| {
            let hint = if raw.contains("\"verb\"") { " (a placement log goes to --placement-log)" } else { "" };
            format!("not a simulate --json result: {e}{hint}")
        })?;
        if let Some((k, v)) = r.unallocated_gpu_pct.iter().find(|(k, v)| k.parse::<u32>().is_err() || !v.is_finite()) {
            return Err(format!("unallocated_gpu_pct: column {k:?} = {v} is not a percentage of arrived workload"));
        }
        Ok(r)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("p.jsonl")
    }

    #[test]
    fn simulate_errors_name_the_line() {
        let e = parse_simulate(p(), "{\"policy\":\"fgd\"}").unwrap_err().to_string();
        assert!(e.starts_with("p.jsonl, line 1: not a simulate --json result"), "{e}");
        let e = parse_simulate(p(), "{\"v\":1,\"verb\":\"bind\"}").unwrap_err().to_string();
        assert!(e.contains("a placement log goes to --placement-log"), "{e}");
        let e = parse_simulate(p(), "\n").unwrap_err().to_string();
        assert_eq!(e, "p.jsonl: no simulate results in it (the file is empty)");
    }
}
