//! The MPS control daemon's command interface (pure): what `nvidia-cuda-mps-control`, run as a
//! client with the daemon's `CUDA_MPS_PIPE_DIRECTORY`, reads on its stdin (one command a line) and
//! what it answers on its stdout.

use std::fmt;

/// One command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// The running servers' PIDs, one a line.
    GetServerList,
    /// Stops the daemon (and its servers).
    Quit,
    /// Thread percentage for servers started from now on (MPS has no per-device one).
    SetDefaultActiveThreadPercentage(u32),
    /// Thread percentage of a running server, for its clients that connect from now on.
    SetActiveThreadPercentage { server: u32, pct: u32 },
    /// Pinned device memory per client on daemon ordinal `dev`, for servers started from now on.
    SetDefaultDevicePinnedMemLimit { dev: u32, mib: u64 },
    /// The same for a running server.
    SetDevicePinnedMemLimit { server: u32, dev: u32, mib: u64 },
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::GetServerList => write!(f, "get_server_list"),
            Self::Quit => write!(f, "quit"),
            Self::SetDefaultActiveThreadPercentage(p) => write!(f, "set_default_active_thread_percentage {p}"),
            Self::SetActiveThreadPercentage { server, pct } => write!(f, "set_active_thread_percentage {server} {pct}"),
            // MiB with MPS's `M` suffix, as the client variable takes it
            Self::SetDefaultDevicePinnedMemLimit { dev, mib } => {
                write!(f, "set_default_device_pinned_mem_limit {dev} {mib}M")
            }
            Self::SetDevicePinnedMemLimit { server, dev, mib } => {
                write!(f, "set_device_pinned_mem_limit {server} {dev} {mib}M")
            }
        }
    }
}

/// An answer the plugin could not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnswerError {
    #[error("the MPS control daemon answered {line:?} where a server PID was expected")]
    NotAPid { line: String },
    #[error("the MPS control daemon refused the command: {0}")]
    Refused(String),
}

/// `get_server_list`'s answer: one PID a line (none when no server runs), sorted.
pub fn parse_server_list(out: &str) -> Result<Vec<u32>, AnswerError> {
    let mut pids = Vec::new();
    for line in out.lines().map(str::trim).filter(|l| !l.is_empty()) {
        pids.push(line.parse().map_err(|_| AnswerError::NotAPid { line: line.to_string() })?);
    }
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

/// The `set_*` commands answer nothing when they succeed; the daemon's complaints (an unknown
/// server, a value it cannot take) are text on stdout.
pub fn check_silent(out: &str) -> Result<(), AnswerError> {
    let text: Vec<&str> = out.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    if text.is_empty() {
        Ok(())
    } else {
        Err(AnswerError::Refused(text.join("; ")))
    }
}

/// The daemon's commands as one stdin text, a line each.
pub fn script(commands: &[Command]) -> String {
    commands.iter().map(|c| format!("{c}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_are_the_daemons() {
        let lines: Vec<String> = [
            Command::GetServerList,
            Command::Quit,
            Command::SetDefaultActiveThreadPercentage(50),
            Command::SetActiveThreadPercentage { server: 4242, pct: 25 },
            Command::SetDefaultDevicePinnedMemLimit { dev: 1, mib: 20480 },
            Command::SetDevicePinnedMemLimit { server: 4242, dev: 0, mib: 2000 },
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        assert_eq!(
            lines,
            [
                "get_server_list",
                "quit",
                "set_default_active_thread_percentage 50",
                "set_active_thread_percentage 4242 25",
                "set_default_device_pinned_mem_limit 1 20480M",
                "set_device_pinned_mem_limit 4242 0 2000M",
            ]
        );
        assert_eq!(script(&[Command::GetServerList, Command::Quit]), "get_server_list\nquit\n");
    }

    #[test]
    fn answers_are_read_strictly() {
        assert_eq!(parse_server_list(""), Ok(vec![]));
        assert_eq!(parse_server_list("4242\n 17 \n\n4242\n"), Ok(vec![17, 4242]));
        assert!(matches!(
            parse_server_list("Cannot find MPS control daemon process"),
            Err(AnswerError::NotAPid { .. })
        ));
        assert_eq!(check_silent("\n"), Ok(()));
        assert_eq!(check_silent("Server 17 not found\n"), Err(AnswerError::Refused("Server 17 not found".into())));
    }
}
