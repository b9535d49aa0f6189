//! The open-file limit (`RLIMIT_NOFILE`), raised at start in both binaries.
//!
//! A container starts with the runtime's default, often a soft limit of 1024 under a hard limit of
//! 524,288 or more. Every TCP connection a listener accepts takes a descriptor, and once they are
//! gone the process can neither accept kube-scheduler's next call nor open a file (issue 48: 2,000
//! idle connections to the extender's metrics port did that). Raising the soft limit to the hard one
//! needs no privilege; the listeners' connection caps (the extender's `extender::ports`, the
//! device plugin's `metrics`) keep the total below it whatever it is.

/// The soft and hard limits, before and after [`raise_to_hard`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdLimit {
    pub soft: u64,
    pub hard: u64,
}

/// Why the limit could not be read or raised.
#[derive(Debug, thiserror::Error)]
pub enum FdLimitError {
    #[error("reading RLIMIT_NOFILE: {0}")]
    Read(#[source] std::io::Error),
    #[error("raising RLIMIT_NOFILE's soft limit from {from} to {to}: {source}")]
    Raise { from: u64, to: u64, source: std::io::Error },
}

/// The current limits.
pub fn current() -> Result<FdLimit, FdLimitError> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit through a valid pointer to a local.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    if rc != 0 {
        return Err(FdLimitError::Read(std::io::Error::last_os_error()));
    }
    // rlim_t is u64 on Linux, the only target
    Ok(FdLimit { soft: lim.rlim_cur, hard: lim.rlim_max })
}

/// Sets both limits: what a process started from tests gets to run under a container's limit (called
/// between fork and exec, so it only makes the system call and allocates nothing).
pub fn set(limit: FdLimit) -> std::io::Result<()> {
    let lim = libc::rlimit { rlim_cur: limit.soft, rlim_max: limit.hard };
    // SAFETY: setrlimit reads one rlimit through a valid pointer to a local.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Sets the soft limit to the hard one; returns the limits before and after. `RLIM_INFINITY` as the
/// hard limit is kept as it is (Linux then refuses a soft limit above `fs.nr_open`, so it is capped
/// there by the kernel's own check: the error says so).
pub fn raise_to_hard() -> Result<(FdLimit, FdLimit), FdLimitError> {
    let before = current()?;
    if before.soft >= before.hard {
        return Ok((before, before));
    }
    set(FdLimit { soft: before.hard, hard: before.hard }).map_err(|source| FdLimitError::Raise {
        from: before.soft,
        to: before.hard,
        source,
    })?;
    Ok((before, current()?))
}

/// [`raise_to_hard`], logged: the new soft limit at info, a failure as a warning (the process then
/// runs with the limit it got, and the listeners' caps are sized to it). Returns the soft limit in
/// force.
pub fn raise_and_log(binary: &str) -> Option<u64> {
    match raise_to_hard() {
        Ok((before, after)) => {
            tracing::info!(
                binary,
                soft_before = before.soft,
                soft = after.soft,
                hard = after.hard,
                "open-file limit (RLIMIT_NOFILE): the soft limit is the hard one"
            );
            Some(after.soft)
        }
        Err(e) => {
            tracing::warn!(binary, error = %e, "the open-file limit stays as it is");
            current().ok().map(|l| l.soft)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raising_leaves_the_soft_limit_at_the_hard_one() {
        let (before, after) = raise_to_hard().expect("raise");
        assert_eq!(after.hard, before.hard);
        assert_eq!(after.soft, after.hard);
        assert_eq!(current().expect("read"), after);
    }
}
