//! The server-side MPS limits from the shares on each GPU (pure). See the module docs of
//! [`crate::mps`] for what the server can and cannot hold a container to.

use std::collections::BTreeMap;

use super::command::Command;

/// One container's share of one GPU (never a whole GPU: those do not connect to MPS).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareSlice {
    /// The node's GPU index.
    pub gpu: u32,
    pub mem_mib: u64,
    /// 0: memory only, best-effort compute (no thread percentage of its own).
    pub core_pct: u32,
    /// `namespace/name` of the pod holding it, for reports.
    pub pod: String,
}

/// One GPU the daemon sees, at daemon ordinal = its position in the daemon's list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DaemonGpu {
    pub index: u32,
    pub memory_mib: u64,
}

/// What every server is held to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerLimits {
    /// Daemon ordinal -> pinned device memory per client (MiB).
    pub pinned_mib: BTreeMap<u32, u64>,
    /// Active thread percentage per client (1..=100).
    pub thread_pct: u32,
}

/// The limits for `gpus` (the daemon's, in its order) holding `shares`: on each GPU the largest
/// share's memory, or the whole GPU when it holds none; the largest share's compute on the node (a
/// share without compute counts as 100: it may use what is idle). Shares on GPUs the daemon does
/// not see are ignored (they cannot be its clients).
pub fn server_limits(gpus: &[DaemonGpu], shares: &[ShareSlice]) -> ServerLimits {
    let mut pinned_mib = BTreeMap::new();
    let mut thread_pct = 0;
    for (ordinal, g) in gpus.iter().enumerate() {
        let on_gpu: Vec<&ShareSlice> = shares.iter().filter(|s| s.gpu == g.index).collect();
        let mem = on_gpu.iter().map(|s| s.mem_mib).max().map_or(g.memory_mib, |m| m.min(g.memory_mib));
        pinned_mib.insert(ordinal as u32, mem);
        for s in on_gpu {
            let pct = if (1..100).contains(&s.core_pct) { s.core_pct } else { 100 };
            thread_pct = thread_pct.max(pct);
        }
    }
    ServerLimits { pinned_mib, thread_pct: if thread_pct == 0 { 100 } else { thread_pct } }
}

/// The commands that make them the defaults of servers started later.
pub fn default_commands(l: &ServerLimits) -> Vec<Command> {
    let mut out: Vec<Command> =
        l.pinned_mib.iter().map(|(&dev, &mib)| Command::SetDefaultDevicePinnedMemLimit { dev, mib }).collect();
    out.push(Command::SetDefaultActiveThreadPercentage(l.thread_pct));
    out
}

/// The commands that set them on the running server `server`.
pub fn server_commands(server: u32, l: &ServerLimits) -> Vec<Command> {
    let mut out: Vec<Command> =
        l.pinned_mib.iter().map(|(&dev, &mib)| Command::SetDevicePinnedMemLimit { server, dev, mib }).collect();
    out.push(Command::SetActiveThreadPercentage { server, pct: l.thread_pct });
    out
}

/// What has been applied, so that each change is sent once (and again to a restarted daemon or a
/// new server, which start from their own defaults).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    defaults: Option<ServerLimits>,
    servers: BTreeMap<u32, ServerLimits>,
}

impl Applied {
    /// The commands to bring a daemon whose servers are `servers` to `want`: the defaults when they
    /// changed, each server whose limits differ (new servers included). Servers gone are forgotten.
    pub fn pending(&mut self, want: &ServerLimits, servers: &[u32]) -> Vec<(Option<u32>, Vec<Command>)> {
        self.servers.retain(|pid, _| servers.contains(pid));
        let mut out = Vec::new();
        if self.defaults.as_ref() != Some(want) {
            out.push((None, default_commands(want)));
        }
        for &pid in servers {
            if self.servers.get(&pid) != Some(want) {
                out.push((Some(pid), server_commands(pid, want)));
            }
        }
        out
    }

    /// `target` (`None`: the defaults) now holds `limits`.
    pub fn done(&mut self, target: Option<u32>, limits: &ServerLimits) {
        match target {
            None => self.defaults = Some(limits.clone()),
            Some(pid) => {
                self.servers.insert(pid, limits.clone());
            }
        }
    }

    /// A new daemon: nothing of the old one's holds.
    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(gpu: u32, mem_mib: u64, core_pct: u32) -> ShareSlice {
        ShareSlice { gpu, mem_mib, core_pct, pod: format!("ns/p{gpu}-{mem_mib}") }
    }

    const GPUS: [DaemonGpu; 3] = [
        DaemonGpu { index: 0, memory_mib: 81559 },
        DaemonGpu { index: 2, memory_mib: 81559 },
        DaemonGpu { index: 5, memory_mib: 40960 },
    ];

    #[test]
    fn the_largest_share_caps_each_gpu_and_the_node_thread_percentage() {
        let l = server_limits(&GPUS, &[share(0, 20000, 25), share(0, 30000, 50), share(5, 10000, 0)]);
        // ordinal 1 (GPU 2) holds no share: whole; GPU 5's share has no compute: 100 %
        assert_eq!(l.pinned_mib, BTreeMap::from([(0, 30000), (1, 81559), (2, 10000)]));
        assert_eq!(l.thread_pct, 100);
        let l = server_limits(&GPUS, &[share(0, 20000, 25), share(2, 30000, 50), share(7, 1, 90)]);
        assert_eq!(l.thread_pct, 50, "a GPU the daemon does not see does not count");
        assert_eq!(server_limits(&GPUS, &[]).thread_pct, 100);
        let lines: Vec<String> = default_commands(&l).iter().map(ToString::to_string).collect();
        assert_eq!(
            lines,
            [
                "set_default_device_pinned_mem_limit 0 20000M",
                "set_default_device_pinned_mem_limit 1 30000M",
                "set_default_device_pinned_mem_limit 2 40960M",
                "set_default_active_thread_percentage 50",
            ]
        );
        let lines: Vec<String> = server_commands(77, &l).iter().map(ToString::to_string).collect();
        assert_eq!(lines[0], "set_device_pinned_mem_limit 77 0 20000M");
        assert_eq!(lines[3], "set_active_thread_percentage 77 50");
    }

    #[test]
    fn each_change_is_sent_once_and_new_servers_get_theirs() {
        let mut applied = Applied::default();
        let a = server_limits(&GPUS, &[share(0, 20000, 25)]);
        let first = applied.pending(&a, &[]);
        assert_eq!(first.len(), 1);
        applied.done(None, &a);
        assert!(applied.pending(&a, &[]).is_empty());
        // a server started for a user: it gets the limits too
        let p = applied.pending(&a, &[4242]);
        assert_eq!(p.iter().map(|(t, _)| *t).collect::<Vec<_>>(), [Some(4242)]);
        applied.done(Some(4242), &a);
        assert!(applied.pending(&a, &[4242]).is_empty());
        // a bigger share arrives: defaults and the running server
        let b = server_limits(&GPUS, &[share(0, 20000, 25), share(0, 40000, 60)]);
        assert_eq!(applied.pending(&b, &[4242]).len(), 2);
        applied.reset();
        assert_eq!(applied.pending(&b, &[]).len(), 1);
    }
}
