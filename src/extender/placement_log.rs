//! The placement log: one JSON object per line for every filter, prioritize, bind and preempt
//! decision, for capacity planners (docs/placement-log.md is the schema they read).
//!
//! Lines go to stdout or to a file that rotates by size (the full file is renamed to `PATH.1`,
//! replacing the previous one). Each line is flushed as it is written, so `tail -f` and a crash both
//! see every decision; a write error is counted in metrics and never fails the request.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::core::resources::ContainerDemand;

/// Schema version of a line (`"v"`); bumped on incompatible changes, fields may be added.
pub const PLACEMENT_LOG_VERSION: u32 = 1;

/// One decision.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub v: u32,
    /// When the answer was sent, Unix milliseconds.
    pub ts_unix_ms: i64,
    /// `filter`, `prioritize`, `bind` or `preempt`.
    pub verb: String,
    /// `namespace/name`.
    pub pod: String,
    pub uid: String,
    /// `names` (nodeCacheCapable) or `nodes` (full Node objects); null for bind and preempt.
    pub mode: Option<String>,
    /// The pod's GPU containers as the contract reads them; null when the request was refused.
    pub requests: Option<Requests>,
    /// Why the resource contract refused the pod (it then fits nowhere).
    pub refused: Option<String>,
    /// Nodes offered (filter, prioritize, preempt) or 1 (bind).
    pub candidates: usize,
    /// Nodes where the pod fits (filter, prioritize), or preempt nodes kept.
    pub feasible: usize,
    /// Exact rejection reason → how many nodes gave it.
    pub rejections: BTreeMap<String, usize>,
    /// Reason class (`contract`, `unknown_node`, `unresolvable`, `preemptable`) → nodes.
    pub rejection_classes: BTreeMap<String, usize>,
    /// Node → its own figures behind the reason it was given (which `rejections` leaves out, so that
    /// nodes group): filter, for the first 32 rejected candidates in the order sent; bind, for the
    /// chosen node when the pod no longer fits there.
    #[serde(default)]
    pub rejection_details: BTreeMap<String, String>,
    /// The best nodes, best first (at most 5), with each scorer's share of the total.
    pub top: Vec<TopScore>,
    /// Bind: where the pod went and on which GPUs.
    pub chosen: Option<Chosen>,
    /// Bind: `bound`, `repeated`, `unknown_pod`, `refused`, `unknown_node`, `no_fit`, `conflict`,
    /// `binder_failed`. Preempt: null.
    pub outcome: Option<String>,
    /// The error answered to kube-scheduler, if any.
    pub error: Option<String>,
    /// From the request's arrival to the answer (bind: including the Binding), microseconds.
    pub latency_us: u64,
}

/// The pod's GPU containers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Requests {
    pub containers: Vec<ContainerDemand>,
    pub init_containers: Vec<ContainerDemand>,
    pub group: Option<String>,
}

/// One node's score.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TopScore {
    pub node: String,
    /// What kube-scheduler gets, 0..=10.
    pub score: i64,
    /// Weighted mean of the scorers, 0..=1.
    pub total: f64,
    /// Scorer → its weighted contribution to `total` (the parts add up to `total`).
    pub parts: BTreeMap<String, f64>,
}

/// A bind's result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Chosen {
    pub node: String,
    pub bind_seq: u64,
    pub gpus: Vec<ChosenGpu>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChosenGpu {
    pub container: String,
    pub init: bool,
    pub index: u32,
    pub uuid: String,
    pub memory_mib: u64,
    pub core_percent: u32,
    pub exclusive: bool,
}

/// Where lines go.
#[derive(Debug)]
pub enum PlacementLog {
    Stdout,
    File(Mutex<RotatingFile>),
}

/// A file rotated to `PATH.1` when the next line would take it past `max_bytes`.
#[derive(Debug)]
pub struct RotatingFile {
    path: PathBuf,
    max_bytes: u64,
    file: File,
    size: u64,
}

impl RotatingFile {
    fn open(path: &Path) -> io::Result<(File, u64)> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let size = file.metadata()?.len();
        Ok((file, size))
    }

    fn write_line(&mut self, line: &[u8]) -> io::Result<()> {
        if self.size > 0 && self.size + line.len() as u64 > self.max_bytes {
            let mut rotated = self.path.clone().into_os_string();
            rotated.push(".1");
            std::fs::rename(&self.path, &rotated)?;
            (self.file, self.size) = Self::open(&self.path)?;
        }
        self.file.write_all(line)?;
        self.size += line.len() as u64;
        Ok(())
    }
}

impl PlacementLog {
    /// `-` for stdout, else a file path (created or appended to).
    pub fn open(target: &str, max_bytes: u64) -> io::Result<Self> {
        if target == "-" {
            return Ok(Self::Stdout);
        }
        let path = PathBuf::from(target);
        let (file, size) = RotatingFile::open(&path)?;
        Ok(Self::File(Mutex::new(RotatingFile { path, max_bytes: max_bytes.max(1), file, size })))
    }

    /// Writes one line.
    pub fn write(&self, d: &Decision) -> io::Result<()> {
        let mut line = serde_json::to_vec(d).map_err(io::Error::other)?;
        line.push(b'\n');
        match self {
            Self::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(&line)?;
                out.flush()
            }
            Self::File(f) => f.lock().unwrap_or_else(|e| e.into_inner()).write_line(&line),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_rotates_by_size_and_keeps_whole_lines() {
        let dir = std::env::temp_dir().join(format!("gpuplace-rotate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.jsonl");
        let log = PlacementLog::open(path.to_str().unwrap(), 600).unwrap();
        let d = Decision { v: 1, verb: "filter".into(), pod: "ns/p".into(), ..Decision::default() };
        for _ in 0..5 {
            log.write(&d).unwrap();
        }
        let current = std::fs::read_to_string(&path).unwrap();
        let rotated = std::fs::read_to_string(dir.join("p.jsonl.1")).unwrap();
        assert!(current.len() <= 600 && rotated.len() <= 600, "{} {}", current.len(), rotated.len());
        for line in current.lines().chain(rotated.lines()) {
            assert_eq!(serde_json::from_str::<Decision>(line).unwrap(), d);
        }
        assert!(current.lines().count() + rotated.lines().count() <= 5);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
