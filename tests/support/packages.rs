//! The Debian packages the tests' outside tools come from, in one list, and their installation on
//! first need: `cargo test --workspace` (the README's command) passes on a fresh Debian machine as
//! root, and `.ci/run` installs nothing itself, so no second list can drift from this one.
//! `#[path]`-included by tests/e2e (the real node needs all of them, the control plane `openssl`)
//! and tests/helm_chart/main.rs (`xz`, through `support/xz.rs`).
//!
//! A missing package is installed with apt-get when the test runs as root on a machine that has it;
//! otherwise the test fails with the packages named. Nothing is ever skipped.

#![allow(dead_code)] // each including test target uses part of it

use std::fs::File;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

/// Each package with the paths the tests use from it: an absolute path, found there or (its file
/// name) on `PATH`, so a machine with the tools installed another way needs no apt-get.
pub const PACKAGES: &[(&str, &[&str])] = &[
    ("runc", &["/usr/sbin/runc"]),
    ("buildah", &["/usr/bin/buildah"]),
    ("containernetworking-plugins", &["/usr/lib/cni/bridge", "/usr/lib/cni/host-local", "/usr/lib/cni/loopback"]),
    // static: it is copied into images FROM scratch (the busybox and pause images)
    ("busybox-static", &["/bin/busybox"]),
    ("iproute2", &["/usr/sbin/ip"]),
    ("util-linux", &["/usr/bin/nsenter", "/usr/bin/unshare"]),
    ("xz-utils", &["/usr/bin/xz"]),
    ("openssl", &["/usr/bin/openssl"]),
    // images/build.sh copies the CA bundle into the images and strips the binaries with objcopy
    ("ca-certificates", &["/etc/ssl/certs/ca-certificates.crt"]),
    ("binutils", &["/usr/bin/objcopy"]),
];

/// Every package of [`PACKAGES`] present, installed first if need be (the real node).
pub fn require_all() {
    let all: Vec<&str> = PACKAGES.iter().map(|(p, _)| *p).collect();
    require(&all);
}

/// `packages` (names from [`PACKAGES`]) present: when one is missing, the first call in this process
/// installs every missing package of [`PACKAGES`] (one `apt-get update` and one install per
/// machine, not one per test target); panics naming what is still missing and why.
pub fn require(packages: &[&str]) {
    for p in packages {
        assert!(PACKAGES.iter().any(|(name, _)| name == p), "{p} is not in tests/support/packages.rs");
    }
    if missing(packages).is_empty() {
        return;
    }
    // other threads wait here while the first installs
    static TRIED: OnceLock<Result<(), String>> = OnceLock::new();
    let tried = TRIED.get_or_init(install_missing);
    let still = missing(packages);
    if still.is_empty() {
        return;
    }
    let why = match tried {
        Err(why) => why.clone(),
        Ok(()) => "apt-get installed them, yet they are still missing".into(),
    };
    panic!("test prerequisites missing: {}; {why}", describe(&still));
}

fn present(path: &str) -> bool {
    let p = Path::new(path);
    p.exists()
        || p.file_name().and_then(|n| n.to_str()).is_some_and(|name| {
            std::env::var_os("PATH").is_some_and(|dirs| std::env::split_paths(&dirs).any(|d| d.join(name).is_file()))
        })
}

/// The packages of `names` with a path missing, each with those paths.
fn missing(names: &[&str]) -> Vec<(&'static str, Vec<&'static str>)> {
    PACKAGES
        .iter()
        .filter(|(p, _)| names.contains(p))
        .map(|(p, paths)| (*p, paths.iter().copied().filter(|path| !present(path)).collect::<Vec<_>>()))
        .filter(|(_, gone)| !gone.is_empty())
        .collect()
}

fn describe(missing: &[(&str, Vec<&str>)]) -> String {
    missing.iter().map(|(p, paths)| format!("{} ({p})", paths.join(", "))).collect::<Vec<_>>().join(", ")
}

fn names(missing: &[(&str, Vec<&str>)]) -> String {
    missing.iter().map(|(p, _)| *p).collect::<Vec<_>>().join(" ")
}

/// Installs the missing packages of [`PACKAGES`] with apt-get, or says why it cannot.
fn install_missing() -> Result<(), String> {
    let all: Vec<&str> = PACKAGES.iter().map(|(p, _)| *p).collect();
    let wanted = names(&missing(&all));
    // SAFETY: geteuid has no preconditions
    if unsafe { libc::geteuid() } != 0 {
        return Err(format!(
            "not root, so the tests cannot install them: as root, `apt-get install -y {wanted}` (Debian), or run the \
             tests as root on a machine with apt-get"
        ));
    }
    if !present("/usr/bin/apt-get") {
        return Err(format!("no apt-get on this machine: install what provides them (Debian: {wanted})"));
    }
    // One install at a time on the machine (test targets of other checkouts): apt-get would wait
    // for its own lock, but the second would then install what the first already did.
    let lock_path = std::env::temp_dir().join("gpuplace-test-packages.lock");
    let lock = File::create(&lock_path).map_err(|e| format!("create {}: {e}", lock_path.display()))?;
    use std::os::fd::AsRawFd;
    // SAFETY: a valid descriptor, kept open (and so locked) until `lock` drops at the end
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(format!("lock {}: {}", lock_path.display(), std::io::Error::last_os_error()));
    }
    let wanted = missing(&all);
    if wanted.is_empty() {
        return Ok(());
    }
    let t = Instant::now();
    eprintln!("test prerequisites: installing {} with apt-get (tests/support/packages.rs)", names(&wanted));
    let apt = |args: &[&str]| -> Result<(), String> {
        let out = Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            // wait for another apt (unattended upgrades) instead of failing at once
            .args(["-o", "DPkg::Lock::Timeout=600", "-qq"])
            .args(args)
            .output()
            .map_err(|e| format!("running apt-get: {e}"))?;
        if out.status.success() {
            return Ok(());
        }
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect();
        Err(format!("`apt-get {}` failed ({}):\n{}", args.join(" "), out.status, tail.join("\n")))
    };
    apt(&["update"])?;
    let mut install = vec!["install", "-y"];
    install.extend(wanted.iter().map(|(p, _)| *p));
    apt(&install)?;
    eprintln!("test prerequisites: installed in {:.1} s", t.elapsed().as_secs_f64());
    Ok(())
}
