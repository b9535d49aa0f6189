//! When to start, restart and stop the MPS control daemon (pure: the loop in [`super::daemon`]
//! reports what it saw, this decides).
//!
//! The daemon is wanted while at least one GPU can serve shares (managed mode on, a healthy GPU).
//! It is started at once, checked every health interval with `get_server_list`, and started again
//! when it stops answering, after a backoff that doubles with each failure in a row (so a binary
//! that dies at start is not spun) and is forgiven once the daemon has stayed up for a while. When
//! the set of GPUs that serve shares changes (a GPU turned unhealthy or recovered), the daemon is
//! restarted with the new set only while no MPS server runs: restarting under a server would end
//! its clients. When no GPU serves shares any more, it is told to `quit`.

use std::time::{Duration, Instant};

/// How the backoff grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
    /// Up this long in a row: the failures are forgiven.
    pub stable: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { first: Duration::from_secs(1), max: Duration::from_secs(60), stable: Duration::from_secs(60) }
    }
}

impl Backoff {
    /// The wait after `failures` failed starts in a row (the first start waits nothing).
    pub fn after(&self, failures: u32) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        let factor = 1u32.checked_shl(failures.saturating_sub(1).min(16)).unwrap_or(u32::MAX);
        self.first.saturating_mul(factor).min(self.max)
    }
}

/// What the last health check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Not started by us (yet), or told to quit.
    NotRunning,
    /// Answered `get_server_list`: these servers run.
    Up { servers: Vec<u32> },
    /// Did not answer (dead, or hung past the command timeout).
    Down,
}

/// What to do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Nothing,
    /// Start the daemon for these GPUs (node indices, ascending). `restart`: it ran before.
    Start {
        gpus: Vec<u32>,
        restart: bool,
    },
    /// Quit the running daemon, then start it for these GPUs.
    Replace {
        gpus: Vec<u32>,
    },
    /// Quit the running daemon; nothing serves shares.
    Quit,
}

/// The supervisor's memory between checks.
#[derive(Debug, Clone)]
pub struct Supervisor {
    backoff: Backoff,
    /// The GPUs the running (or last started) daemon was given.
    running: Option<Vec<u32>>,
    failures: u32,
    not_before: Option<Instant>,
    up_since: Option<Instant>,
    /// A GPU-set change waits for its servers to end: logged once.
    deferred: bool,
}

impl Supervisor {
    pub fn new(backoff: Backoff) -> Self {
        Self { backoff, running: None, failures: 0, not_before: None, up_since: None, deferred: false }
    }

    /// Failed or died starts in a row.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Whether a GPU-set change is waiting for the servers to end.
    pub fn deferred(&self) -> bool {
        self.deferred
    }

    /// Decides, from what was seen at `now` and the GPUs that serve shares now (`want`, ascending).
    pub fn decide(&mut self, now: Instant, want: &[u32], seen: &Seen) -> Action {
        if want.is_empty() {
            self.deferred = false;
            return match seen {
                Seen::Up { .. } => {
                    self.running = None;
                    Action::Quit
                }
                _ => {
                    self.running = None;
                    Action::Nothing
                }
            };
        }
        match seen {
            Seen::Up { servers } => {
                let since = *self.up_since.get_or_insert(now);
                if now.saturating_duration_since(since) >= self.backoff.stable {
                    self.failures = 0;
                }
                if self.running.as_deref() == Some(want) {
                    self.deferred = false;
                    return Action::Nothing;
                }
                if servers.is_empty() {
                    self.deferred = false;
                    self.start(now, want);
                    return Action::Replace { gpus: want.to_vec() };
                }
                self.deferred = true;
                Action::Nothing
            }
            Seen::NotRunning | Seen::Down => {
                self.up_since = None;
                if self.not_before.is_some_and(|t| now < t) {
                    return Action::Nothing;
                }
                let restart = self.running.is_some() || self.failures > 0;
                self.start(now, want);
                Action::Start { gpus: want.to_vec(), restart }
            }
        }
    }

    /// A start is under way: the next one waits the backoff unless this one is seen up long enough.
    fn start(&mut self, now: Instant, gpus: &[u32]) {
        self.failures = self.failures.saturating_add(1);
        self.not_before = Some(now + self.backoff.after(self.failures));
        self.running = Some(gpus.to_vec());
        self.up_since = None;
    }

    /// The daemon was stopped on purpose (shutdown): nothing runs.
    pub fn stopped(&mut self) {
        self.running = None;
        self.up_since = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Backoff =
        Backoff { first: Duration::from_secs(1), max: Duration::from_secs(8), stable: Duration::from_secs(30) };

    fn up(servers: &[u32]) -> Seen {
        Seen::Up { servers: servers.to_vec() }
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let waits: Vec<u64> = (0..7).map(|f| B.after(f).as_secs()).collect();
        assert_eq!(waits, [0, 1, 2, 4, 8, 8, 8]);
        assert_eq!(Backoff::default().after(u32::MAX), Duration::from_secs(60));
    }

    #[test]
    fn started_at_once_restarted_with_backoff_and_forgiven_when_stable() {
        let t0 = Instant::now();
        let mut s = Supervisor::new(B);
        assert_eq!(s.decide(t0, &[0, 1], &Seen::NotRunning), Action::Start { gpus: vec![0, 1], restart: false });
        assert_eq!(s.decide(t0 + Duration::from_millis(10), &[0, 1], &up(&[])), Action::Nothing);
        // it dies: the first restart waits 1 s after the last start
        let t = t0 + Duration::from_millis(500);
        assert_eq!(s.decide(t, &[0, 1], &Seen::Down), Action::Nothing);
        let t = t0 + Duration::from_secs(1);
        assert_eq!(s.decide(t, &[0, 1], &Seen::Down), Action::Start { gpus: vec![0, 1], restart: true });
        // and dies again at once: 2 s this time
        assert_eq!(s.decide(t + Duration::from_millis(1999), &[0, 1], &Seen::Down), Action::Nothing);
        let t = t + Duration::from_secs(2);
        assert!(matches!(s.decide(t, &[0, 1], &Seen::Down), Action::Start { restart: true, .. }));
        assert_eq!(s.failures(), 3);
        // up for the stable time: forgiven
        assert_eq!(s.decide(t + Duration::from_secs(1), &[0, 1], &up(&[])), Action::Nothing);
        assert_eq!(s.decide(t + Duration::from_secs(31), &[0, 1], &up(&[])), Action::Nothing);
        assert_eq!(s.failures(), 0);
        let t = t + Duration::from_secs(32);
        assert_eq!(s.decide(t, &[0, 1], &Seen::Down), Action::Start { gpus: vec![0, 1], restart: true });
    }

    #[test]
    fn gpu_set_changes_wait_for_the_servers_and_no_gpu_means_quit() {
        let t0 = Instant::now();
        let mut s = Supervisor::new(B);
        s.decide(t0, &[0, 1], &Seen::NotRunning);
        // GPU 1 turned unhealthy while a server runs: deferred, not restarted under its clients
        assert_eq!(s.decide(t0, &[0], &up(&[4242])), Action::Nothing);
        assert!(s.deferred());
        // the server ended: restarted for GPU 0 alone
        assert_eq!(s.decide(t0, &[0], &up(&[])), Action::Replace { gpus: vec![0] });
        assert!(!s.deferred());
        assert_eq!(s.decide(t0 + Duration::from_secs(2), &[0], &up(&[])), Action::Nothing);
        assert_eq!(s.decide(t0 + Duration::from_secs(3), &[], &up(&[])), Action::Quit);
        assert_eq!(s.decide(t0 + Duration::from_secs(4), &[], &Seen::NotRunning), Action::Nothing);
    }
}
