//! The control daemon's `control.log`, read as it grows (pure: lines in, events and counts out).
//!
//! The lines the plugin acts on (the control daemon's wording; anything else is ignored):
//!
//! - `Starting new server <pid> for user <uid>`: the server of `<uid>` now serves every GPU of the
//!   daemon; clients of other users wait.
//! - `NEW CLIENT <n> from user <uid>: ...`: a client connected. One whose user is not the running
//!   server's waits for that server to end (the one-server-per-UID pitfall).
//! - `Server <pid> exited with status <n>`: a server ended; a non-zero status is a fault.
//! - any line with `fatal` (any case): a client's fatal GPU fault, which makes the server end
//!   every client it has.
//!
//! One fault is counted once per server, however many lines tell of it.

use std::collections::{BTreeMap, BTreeSet};

/// Something the log told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogEvent {
    ServerStarted {
        pid: u32,
        uid: u32,
    },
    /// A client of `uid` queued behind the running server of `server_uid`.
    ClientWaiting {
        uid: u32,
        server_uid: u32,
    },
    ServerExited {
        pid: u32,
        status: i32,
    },
    /// A fault that ended every client of a server (`pid` when the log names it); `line` as logged.
    Fault {
        pid: Option<u32>,
        line: String,
    },
}

/// The number after `word ` in `line`, if any.
fn number_after(line: &str, word: &str) -> Option<i64> {
    let rest = &line[line.find(word)? + word.len()..];
    let digits: String = rest.trim_start().chars().take_while(|c| c.is_ascii_digit() || *c == '-').collect();
    digits.parse().ok()
}

/// What the daemon's log has told so far.
#[derive(Debug, Default, Clone)]
pub struct LogState {
    /// The running server's PID and user.
    server: Option<(u32, u32)>,
    /// Users with clients waiting, and how many each.
    waiting: BTreeMap<u32, u64>,
    faulted: BTreeSet<u32>,
    /// A line not ended yet (the file is read while the daemon writes it).
    partial: String,
}

impl LogState {
    /// Clients waiting for another user's server to end.
    pub fn waiting(&self) -> u64 {
        self.waiting.values().sum()
    }

    /// Reads `chunk`, the bytes appended since the last call, and returns what happened.
    pub fn feed(&mut self, chunk: &str) -> Vec<LogEvent> {
        self.partial.push_str(chunk);
        let Some(end) = self.partial.rfind('\n') else { return Vec::new() };
        let complete: String = self.partial.drain(..=end).collect();
        complete.lines().filter_map(|l| self.line(l)).collect()
    }

    /// A new daemon writes a new log story: its servers and queues are its own.
    pub fn reset(&mut self) {
        *self = Self::default();
    }

    fn line(&mut self, line: &str) -> Option<LogEvent> {
        if line.to_ascii_lowercase().contains("fatal") {
            let pid = number_after(line, "Server").or_else(|| number_after(line, "server")).map(|p| p as u32);
            if pid.is_some_and(|p| !self.faulted.insert(p)) {
                return None;
            }
            return Some(LogEvent::Fault { pid, line: line.trim().to_string() });
        }
        if line.contains("Starting new server") {
            let pid = number_after(line, "Starting new server")? as u32;
            let uid = number_after(line, "for user")? as u32;
            self.server = Some((pid, uid));
            self.waiting.remove(&uid);
            return Some(LogEvent::ServerStarted { pid, uid });
        }
        if line.contains("NEW CLIENT") {
            let uid = number_after(line, "from user")? as u32;
            let (_, server_uid) = self.server?;
            if uid == server_uid {
                return None;
            }
            *self.waiting.entry(uid).or_insert(0) += 1;
            return Some(LogEvent::ClientWaiting { uid, server_uid });
        }
        if line.contains("exited with status") {
            let pid = number_after(line, "Server")? as u32;
            let status = number_after(line, "exited with status")? as i32;
            if self.server.is_some_and(|(p, _)| p == pid) {
                self.server = None;
            }
            if status != 0 && self.faulted.insert(pid) {
                return Some(LogEvent::Fault { pid: Some(pid), line: line.trim().to_string() });
            }
            return Some(LogEvent::ServerExited { pid, status });
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
[2024-05-01 10:00:00.000 Control 100] Starting control daemon using socket /run/gpuplace/mps/pipe/control
[2024-05-01 10:00:01.000 Control 100] NEW CLIENT 0 from user 1000: Server is not ready, push client to pending list
[2024-05-01 10:00:01.000 Control 100] Starting new server 200 for user 1000
[2024-05-01 10:00:02.000 Control 100] NEW CLIENT 0 from user 1000: Server already exists
[2024-05-01 10:00:03.000 Control 100] NEW CLIENT 0 from user 2000: Server already exists for another user, pushing to pending list
";

    #[test]
    fn other_users_queue_behind_the_running_server_until_theirs_starts() {
        let mut st = LogState::default();
        let events = st.feed(LOG);
        assert_eq!(
            events,
            [LogEvent::ServerStarted { pid: 200, uid: 1000 }, LogEvent::ClientWaiting { uid: 2000, server_uid: 1000 }]
        );
        assert_eq!(st.waiting(), 1);
        let events = st.feed(
            "[x Control 100] Server 200 exited with status 0\n[x Control 100] Starting new server 300 for user 2000\n",
        );
        assert_eq!(
            events,
            [LogEvent::ServerExited { pid: 200, status: 0 }, LogEvent::ServerStarted { pid: 300, uid: 2000 }]
        );
        assert_eq!(st.waiting(), 0);
    }

    #[test]
    fn a_fault_is_counted_once_per_server_and_half_lines_wait() {
        let mut st = LogState::default();
        st.feed("[x Control 100] Starting new server 200 for user 0\n");
        // the line arrives in two reads
        assert!(st.feed("[x Control 100] Server 200 has encountered a fatal ").is_empty());
        let e = st.feed("exception, terminating its clients\n[x Control 100] Server 200 exited with status 1\n");
        // the fault once; the exit that follows is only an exit
        assert_eq!(e.len(), 2);
        assert!(matches!(&e[0], LogEvent::Fault { pid: Some(200), line } if line.contains("fatal exception")));
        assert_eq!(e[1], LogEvent::ServerExited { pid: 200, status: 1 });
        // a non-zero exit alone is a fault too
        let e = st.feed("[x Control 100] Server 300 exited with status 139\n");
        assert!(matches!(&e[0], LogEvent::Fault { pid: Some(300), .. }));
    }
}
