//! A network namespace for the real node, and TCP forwards across its border, so that every address
//! the node uses (its node IP, the pods' bridge, the `kubernetes` Service's IP) lives inside a
//! namespace this test creates and nothing is added to the host's interfaces.
//!
//! The control plane stays on the host's loopback. Two kinds of forward join the two sides, each a
//! listening socket made in one namespace and connections made in the other (a socket keeps the
//! namespace of the thread that made it, so a thread enters the namespace with `setns` to make it):
//! - [`Forward::into_ns`]: a listener inside the namespace (the API server's loopback port for the
//!   kubelet, `10.96.0.1:443` for in-cluster clients: a one-Service kube-proxy) to a host address;
//! - [`Forward::out_of_ns`]: a host loopback listener to the ready endpoints of a Service inside the
//!   namespace (kube-scheduler to the extender's pods, as kube-proxy would route it).

use std::fs::File;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A network namespace made with `ip netns add`, deleted when dropped.
pub struct NetNs {
    pub name: String,
    pub path: PathBuf,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip {args:?}: {e} (install iproute2)"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl NetNs {
    /// A fresh namespace `name` (an old one of that name, left by a killed run, is deleted first)
    /// with its loopback up and `addresses` (`a.b.c.d/32`) on it.
    pub fn create(name: &str, addresses: &[&str]) -> NetNs {
        let _ = ip(&["netns", "delete", name]);
        ip(&["netns", "add", name]).unwrap_or_else(|e| panic!("e2e: {e}"));
        let ns = NetNs { name: name.to_string(), path: PathBuf::from("/var/run/netns").join(name) };
        ip(&["-n", name, "link", "set", "lo", "up"]).unwrap_or_else(|e| panic!("e2e: {e}"));
        for a in addresses {
            ip(&["-n", name, "addr", "add", a, "dev", "lo"]).unwrap_or_else(|e| panic!("e2e: {e}"));
        }
        ns
    }

    /// `program` run inside the namespace (`nsenter --net`, which execs it: the pid is the program's;
    /// the mount namespace stays the host's, unlike `ip netns exec`).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net={}", self.path.display())).arg("--").arg(program);
        c
    }

    /// Runs `f` on a thread that has entered the namespace: sockets it makes belong to it.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> io::Result<T> + Send + 'static) -> io::Result<T> {
        run_in(self.path.clone(), f)
    }
}

/// [`NetNs::run`] for the namespace at `path`.
fn run_in<T: Send + 'static>(path: PathBuf, f: impl FnOnce() -> io::Result<T> + Send + 'static) -> io::Result<T> {
    std::thread::spawn(move || {
        let file = File::open(&path)?;
        // SAFETY: setns on this thread only, with a valid namespace file descriptor
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error());
        }
        f()
    })
    .join()
    .map_err(|_| io::Error::other("the namespace thread panicked"))?
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = ip(&["netns", "delete", &self.name]);
    }
}

/// A running forward; stops accepting when dropped (connections in flight finish on their own).
pub struct Forward {
    /// Where it listens (inside the namespace for [`Forward::into_ns`]).
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Forward {
    /// Listens at `listen` inside `ns` and forwards each connection to `to` on the host.
    pub fn into_ns(ns: &NetNs, listen: SocketAddr, to: SocketAddr) -> Forward {
        let listener = ns
            .run(move || TcpListener::bind(listen))
            .unwrap_or_else(|e| panic!("e2e: listening at {listen} in netns {}: {e}", ns.name));
        Self::serve(listener, move || TcpStream::connect_timeout(&to, Duration::from_secs(5)))
    }

    /// Listens on the host's loopback (a free port) and forwards each connection to the first of
    /// `targets` (kept current by the caller) that accepts one inside `ns`.
    pub fn out_of_ns(ns: &NetNs, targets: Arc<Mutex<Vec<SocketAddr>>>) -> Forward {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
        let path = ns.path.clone();
        Self::serve(listener, move || {
            let list = targets.lock().map(|t| t.clone()).unwrap_or_default();
            run_in(path.clone(), move || {
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no ready endpoint");
                for t in list {
                    match TcpStream::connect_timeout(&t, Duration::from_secs(2)) {
                        Ok(s) => return Ok(s),
                        Err(e) => last = e,
                    }
                }
                Err(last)
            })
        })
    }

    fn serve(listener: TcpListener, connect: impl Fn() -> io::Result<TcpStream> + Send + 'static) -> Forward {
        let addr = listener.local_addr().expect("the listener's address");
        listener.set_nonblocking(true).expect("a non-blocking listener");
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let _ = client.set_nonblocking(false);
                        match connect() {
                            Ok(server) => pipe(client, server),
                            Err(_) => {
                                let _ = client.shutdown(Shutdown::Both);
                            }
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        });
        Forward { addr, stop }
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Copies both ways until each side closes.
fn pipe(a: TcpStream, b: TcpStream) {
    let _ = a.set_nodelay(true);
    let _ = b.set_nodelay(true);
    let (Ok(a2), Ok(b2)) = (a.try_clone(), b.try_clone()) else { return };
    let one = |mut from: TcpStream, mut to: TcpStream| {
        std::thread::spawn(move || {
            let _ = io::copy(&mut from, &mut to);
            let _ = to.shutdown(Shutdown::Write);
        });
    };
    one(a, b2);
    one(b, a2);
}
