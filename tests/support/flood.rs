//! Connection floods against a port on loopback, and what the process under attack holds meanwhile
//! (issue 48): idle connections, connections sending half a request line, and a recycling flood
//! (connections opened and reset as fast as they go). Bounded in count and time. Shared by
//! tests/ports.rs and device-plugin/tests/metrics_port.rs.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use tokio::net::{TcpSocket, TcpStream};

/// The open-file limit a container gets by default, which the processes under test run with.
pub const CONTAINER_NOFILE: u64 = 1024;

/// The process under attack, killed and reaped however the test ends.
pub struct Reap(pub std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What the test process itself needs: 2,000 flood sockets at once and its own files.
pub fn raise_own_limit(need: u64) {
    let (_, now) = gpuplace_core::fd_limit::raise_to_hard().expect("raise the test's open-file limit");
    assert!(
        now.soft >= need,
        "the test needs {need} open files and the hard limit is {}: raise it (ulimit -Hn)",
        now.hard
    );
}

/// `cmd` runs under `soft`/`hard` open files, as under a container runtime's default.
pub fn under_nofile(cmd: &mut Command, soft: u64, hard: u64) {
    use std::os::unix::process::CommandExt;
    let limit = gpuplace_core::fd_limit::FdLimit { soft, hard };
    // SAFETY: between fork and exec the closure only makes the setrlimit system call.
    unsafe {
        cmd.pre_exec(move || gpuplace_core::fd_limit::set(limit));
    }
}

/// The descriptors `pid` holds now.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// The soft open-file limit of `pid`, from /proc.
pub fn nofile_of(pid: u32) -> Option<u64> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Connections opened and held: `held` established (the server's kernel completed them, accepted
/// or in its backlog), of `attempted`.
pub struct Flood {
    pub attempted: usize,
    pub held: Vec<TcpStream>,
    pub took: Duration,
}

impl Flood {
    pub fn summary(&self) -> String {
        format!(
            "{} of {} connections established in {:?} (the others found the server's backlog full)",
            self.held.len(),
            self.attempted,
            self.took
        )
    }
}

/// Opens `n` connections to `addr` at once, each given `connect_within` to establish, and sends
/// `first` on each (nothing: idle connections; half a request line: slow ones).
pub async fn open_many(addr: SocketAddr, n: usize, first: &'static [u8], connect_within: Duration) -> Flood {
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..n {
        set.spawn(async move {
            let socket = TcpSocket::new_v4().ok()?;
            let s = tokio::time::timeout(connect_within, socket.connect(addr)).await.ok()?.ok()?;
            write_first(&s, first).await.ok()?;
            Some(s)
        });
    }
    let mut held = Vec::new();
    while let Some(r) = set.join_next().await {
        if let Ok(Some(s)) = r {
            held.push(s);
        }
    }
    Flood { attempted: n, held, took: start.elapsed() }
}

/// Writes `bytes` (a few, into an empty send buffer: one write).
async fn write_first(s: &TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    s.writable().await?;
    s.try_write(bytes).map(|_| ())
}

/// Reads what arrives; `Ok(0)` at the end.
async fn read_some(s: &TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        s.readable().await?;
        match s.try_read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}

/// How many of `held` the server has closed (a read sees the end, or a reset) within `within`.
pub async fn closed_by_server(held: &[TcpStream], within: Duration) -> usize {
    // one deadline for all: the streams are read one after the other, each until its end
    let deadline = tokio::time::Instant::now() + within;
    let mut closed = 0;
    for s in held {
        let mut buf = [0u8; 512];
        loop {
            match tokio::time::timeout_at(deadline, read_some(s, &mut buf)).await {
                // a 408 answer first, then the end
                Ok(Ok(n)) if n > 0 => continue,
                Ok(_) => {
                    closed += 1;
                    break;
                }
                Err(_) => break,
            }
        }
    }
    closed
}

/// Opens and resets connections to `addr` on `tasks` tasks until `until` or `max` connections,
/// sending `first` on each; returns the number opened.
pub async fn recycle(addr: SocketAddr, tasks: usize, until: Instant, max: usize, first: &'static [u8]) -> usize {
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..tasks {
        let count = count.clone();
        set.spawn(async move {
            while Instant::now() < until && count.load(std::sync::atomic::Ordering::Relaxed) < max {
                let Ok(socket) = TcpSocket::new_v4() else { break };
                match tokio::time::timeout(Duration::from_millis(200), socket.connect(addr)).await {
                    Ok(Ok(s)) => {
                        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let _ = write_first(&s, first).await;
                        // a reset, not a FIN: no TIME_WAIT left on either side to run out of ports
                        let _ = s.set_zero_linger();
                    }
                    _ => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
        });
    }
    while set.join_next().await.is_some() {}
    count.load(std::sync::atomic::Ordering::Relaxed)
}

/// Latencies of one kind of request, and its failures.
#[derive(Default)]
pub struct Answers {
    pub latencies: Vec<Duration>,
    pub failures: Vec<String>,
}

impl Answers {
    pub fn record(&mut self, what: &str, started: Instant, ok: Result<(), String>) {
        match ok {
            Ok(()) => self.latencies.push(started.elapsed()),
            Err(e) => self.failures.push(format!("{what} after {:?}: {e}", started.elapsed())),
        }
    }

    pub fn worst(&self) -> Duration {
        self.latencies.iter().copied().max().unwrap_or_default()
    }

    /// `n answered, median, worst` for a figure line.
    pub fn summary(&self) -> String {
        let mut l = self.latencies.clone();
        l.sort();
        let median = l.get(l.len() / 2).copied().unwrap_or_default();
        format!("{} answered (median {median:?}, worst {:?}), {} failed", l.len(), self.worst(), self.failures.len())
    }
}

/// Seconds until the server closes one connection that sends `first` and then nothing.
pub async fn closes_after(addr: SocketAddr, first: &'static [u8]) -> Duration {
    let t = Instant::now();
    let f = open_many(addr, 1, first, Duration::from_secs(1)).await;
    assert_eq!(f.held.len(), 1, "{addr} refused a connection");
    assert_eq!(closed_by_server(&f.held, Duration::from_secs(10)).await, 1, "{addr} kept {first:?} open");
    t.elapsed()
}
