//! The FGD paper's cached per-seed results (`fgd-paper-results/analysis_allo_discrete.csv`), to print
//! beside ours.

use std::collections::HashMap;
use std::path::Path;

use crate::sim::policies::PolicyKind;

/// Allocation ratio (%) per (workload file, policy, seed) and column.
#[derive(Debug, Default)]
pub struct PaperResults {
    rows: HashMap<(String, String, u64), Vec<Option<f64>>>,
}

impl PaperResults {
    pub fn load(trace_dir: &Path) -> Result<Self, csv::Error> {
        let path = trace_dir.join("fgd-paper-results/analysis_allo_discrete.csv");
        let mut rdr = csv::Reader::from_path(path)?;
        let headers = rdr.headers()?.clone();
        let col0 = headers.iter().position(|h| h == "0").unwrap_or(5);
        let mut rows = HashMap::new();
        for rec in rdr.records() {
            let rec = rec?;
            let (Some(w), Some(p), Some(seed)) = (rec.get(0), rec.get(1), rec.get(3).and_then(|s| s.parse().ok()))
            else {
                continue;
            };
            let vals = rec.iter().skip(col0).map(|v| v.parse::<f64>().ok()).collect();
            rows.insert((w.to_string(), p.to_string(), seed), vals);
        }
        Ok(Self { rows })
    }

    /// Mean unallocated GPU % at `column` over the seeds the paper has.
    pub fn unallocated_at(&self, workload: &str, policy: PolicyKind, column: usize, seeds: &[u64]) -> Option<f64> {
        let p = policy.paper_name()?;
        let key_w = format!("openb_pod_list_{workload}");
        let vals: Vec<f64> = seeds
            .iter()
            .filter_map(|s| self.rows.get(&(key_w.clone(), p.to_string(), *s)))
            .filter_map(|v| v.get(column).copied().flatten())
            .map(|a| 100.0 - a)
            .collect();
        (!vals.is_empty()).then(|| vals.iter().sum::<f64>() / vals.len() as f64)
    }
}
