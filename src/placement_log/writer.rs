//! Writing the placement log: lines go to stdout or to a file that rotates by size (the full file
//! is renamed to `PATH.1`, replacing the previous one). Each line is flushed as it is written, so
//! `tail -f` and a crash both see every line written; a write error is counted in metrics and never
//! fails the request.
//!
//! A filter that repeats the pod's last written verdict (kube-scheduler's retries of a pending pod)
//! is counted, not written, unless every call is asked for ([`compact`](super::compact)).

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::compactor::{CompactOptions, Compactor};
use super::{Decision, MAX_LINE_BYTES};

/// Where lines go, and which (the [`Compactor`], under the same lock, so that a pod's held
/// repeats are written before its next line and lines of one pod never cross).
#[derive(Debug)]
pub struct PlacementLog {
    inner: Mutex<Inner>,
    /// When a bind line last carried the room (`room_due`).
    room_at: Mutex<Option<std::time::Instant>>,
    /// Each node's part of the bind lines' cluster figures (`capacity`).
    capacity: Mutex<super::capacity::SummaryMemo>,
}

#[derive(Debug)]
struct Inner {
    sink: Sink,
    compactor: Compactor,
}

#[derive(Debug)]
enum Sink {
    Stdout,
    File(RotatingFile),
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

/// `d` as one line, cut to [`MAX_LINE_BYTES`] if need be, with its newline.
pub fn line_of(d: &Decision) -> io::Result<Vec<u8>> {
    let mut line = serde_json::to_vec(d).map_err(io::Error::other)?;
    if line.len() > MAX_LINE_BYTES {
        line = serde_json::to_vec(&d.cut()).map_err(io::Error::other)?;
    }
    line.push(b'\n');
    Ok(line)
}

impl Inner {
    /// Writes every line; the first error, after trying them all.
    fn write(&mut self, lines: Vec<Decision>) -> io::Result<()> {
        let mut first = Ok(());
        for d in &lines {
            let done = line_of(d).and_then(|line| match &mut self.sink {
                Sink::Stdout => {
                    let mut out = io::stdout().lock();
                    out.write_all(&line)?;
                    out.flush()
                }
                Sink::File(f) => f.write_line(&line),
            });
            if first.is_ok() {
                first = done;
            }
        }
        first
    }

    /// Every held repeat written and every pod forgotten.
    fn finish(&mut self) -> io::Result<()> {
        let lines = self.compactor.finish();
        self.write(lines)
    }
}

impl PlacementLog {
    /// `-` for stdout, else a file path (created or appended to). Repeats are counted, not written
    /// ([`CompactOptions::default`]); [`PlacementLog::with_options`] changes that.
    pub fn open(target: &str, max_bytes: u64) -> io::Result<Self> {
        let sink = if target == "-" {
            Sink::Stdout
        } else {
            let path = PathBuf::from(target);
            let (file, size) = RotatingFile::open(&path)?;
            Sink::File(RotatingFile { path, max_bytes: max_bytes.max(1), file, size })
        };
        let inner = Inner { sink, compactor: Compactor::new(CompactOptions::default()) };
        Ok(Self { inner: Mutex::new(inner), room_at: Mutex::new(None), capacity: Mutex::new(Default::default()) })
    }

    pub fn with_options(mut self, opts: CompactOptions) -> Self {
        self.inner.get_mut().unwrap_or_else(|e| e.into_inner()).compactor = Compactor::new(opts);
        self
    }

    // A poisoned lock means a panic while writing: the next line is still worth writing.
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records one decision: the lines it makes are written (none for a repeat that is held).
    pub fn write(&self, d: Decision) -> io::Result<()> {
        let mut inner = self.inner();
        let lines = inner.compactor.push(d);
        inner.write(lines)
    }

    /// Whether the bind line written now carries the room: the first, then one every
    /// [`ROOM_EVERY`](super::ROOM_EVERY).
    pub fn room_due(&self) -> bool {
        let now = std::time::Instant::now();
        let mut at = self.room_at.lock().unwrap_or_else(|e| e.into_inner());
        let due = at.is_none_or(|t| now.duration_since(t) >= super::ROOM_EVERY);
        if due {
            *at = Some(now);
        }
        due
    }

    /// The cluster's figures for a bind line on `node` (`CapacitySummary`), each unchanged node's
    /// part from the last line's, with the room when it is due ([`Self::room_due`]).
    pub fn capacity(&self, cluster: &gpuplace_core::cluster::Cluster, node: &str) -> super::CapacitySummary {
        let with_room = self.room_due();
        let mut memo = self.capacity.lock().unwrap_or_else(|e| e.into_inner());
        super::CapacitySummary::sampled(cluster, node, with_room, &mut memo)
    }

    /// Whether `d` would be written now rather than counted as a repeat (so that what only a
    /// written line carries, such as `rejection_details`, is worked out only then).
    pub fn writes(&self, d: &Decision) -> bool {
        self.inner().compactor.writes(d)
    }

    /// The pod (its UID, or `namespace/name`) is gone: its held repeats are written.
    pub fn forget(&self, key: &str) -> io::Result<()> {
        let mut inner = self.inner();
        let line = inner.compactor.forget(key);
        inner.write(line.into_iter().collect())
    }

    /// After a re-list: the held repeats of pods not listed (by UID) are written.
    pub fn forget_unlisted(&self, listed: &HashSet<String>) -> io::Result<()> {
        let mut inner = self.inner();
        let lines = inner.compactor.forget_unlisted(listed);
        inner.write(lines)
    }

    /// Every held repeat written (at shutdown; dropping the log does it too).
    pub fn finish(&self) -> io::Result<()> {
        self.inner().finish()
    }
}

impl Drop for PlacementLog {
    fn drop(&mut self) {
        // counts held for pods with no next line would otherwise be lost at a clean exit
        if let Err(e) = self.inner.get_mut().unwrap_or_else(|e| e.into_inner()).finish() {
            tracing::warn!(error = %e, "placement log: held repeats not written at exit");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement_log::{PLACEMENT_LOG_VERSION, TRUNCATED_REJECTIONS};

    #[test]
    fn a_line_over_the_limit_is_cut_not_dropped() {
        let dir = std::env::temp_dir().join(format!("gpuplace-cut-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.jsonl");
        let log = PlacementLog::open(path.to_str().unwrap(), 100 << 20).unwrap();
        let mut d =
            Decision { v: PLACEMENT_LOG_VERSION, verb: "filter".into(), candidates: 60_000, ..Decision::default() };
        for i in 0..60_000 {
            d.rejections.insert(format!("gpuplace: reason number {i} with some words"), 1);
            d.rejection_details.insert(format!("node-{i}"), "figures ".repeat(4));
        }
        d.rejection_classes.insert("unresolvable".into(), 60_000);
        log.write(d).unwrap();
        log.write(Decision { verb: "bind".into(), ..Decision::default() }).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].len() <= MAX_LINE_BYTES, "{}", lines[0].len());
        let cut: Decision = serde_json::from_str(lines[0]).unwrap();
        assert!(cut.truncated && cut.rejection_details.is_empty());
        assert_eq!(cut.rejections.len(), TRUNCATED_REJECTIONS);
        assert_eq!(cut.rejection_classes["unresolvable"], 60_000);
        // an ordinary line carries no `truncated` field at all
        assert!(!lines[1].contains("truncated"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_room_goes_on_the_first_bind_line_then_once_a_second() {
        let log = PlacementLog::open("-", 1 << 20).unwrap();
        assert!(log.room_due(), "the first bind line carries it");
        assert!(!log.room_due() && !log.room_due(), "not again within ROOM_EVERY");
        *log.room_at.lock().unwrap() = Some(std::time::Instant::now() - crate::placement_log::ROOM_EVERY);
        assert!(log.room_due());
    }

    #[test]
    fn file_rotates_by_size_and_keeps_whole_lines() {
        let dir = std::env::temp_dir().join(format!("gpuplace-rotate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.jsonl");
        let every_call = CompactOptions { every_call: true, ..CompactOptions::default() };
        let log = PlacementLog::open(path.to_str().unwrap(), 600).unwrap().with_options(every_call);
        let d = Decision { v: 1, verb: "filter".into(), pod: "ns/p".into(), ..Decision::default() };
        for _ in 0..5 {
            log.write(d.clone()).unwrap();
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
