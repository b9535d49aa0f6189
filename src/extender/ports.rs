//! `gpuplace serve`'s listeners and what each may hold (issue 48): the verbs' port (`--listen`), the
//! metrics port (`--metrics-listen`: `/metrics`, `/healthz`, `/readyz`) and the probe port
//! (`--probe-listen`: `/healthz`, `/readyz`), each an actix server of its own with a cap on the
//! connections it holds at once and short timeouts for idle and slow ones.
//!
//! Why caps: every connection takes a file descriptor, and all listeners share the process's open-
//! file limit. With a container's default of 1024, 2,000 idle connections to the metrics port (or
//! 1,100 sending half a request line) left the verbs' port unable to accept (`Too many open files`),
//! and the probes on that port restarted the extender. At its cap a listener stops accepting: further
//! connections wait in the kernel's backlog, which costs the process no descriptor, so a flood on one
//! port never takes another port's descriptors. The caps are cut to fit the open-file limit when
//! they would not ([`Ports::limits`]), and the binary raises that limit to the hard one at start
//! (`gpuplace_core::fd_limit`).
//!
//! Why a probe port: a port that tenants may reach (the metrics port admits scrapers) can be held
//! full by them, whatever its cap; kubelet's probes come from the node, which a NetworkPolicy always
//! admits, so the probe port needs no rule at all and the chart's policy names none.

use std::time::Duration;

use crate::extender::tls::ClientAuth;

/// The verbs' port: kube-scheduler over HTTP/2 uses one connection, over HTTP/1.1 one per call in
/// flight; more than this wait in the backlog until one closes.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
/// The metrics port: a scraper keeps one connection.
pub const DEFAULT_METRICS_MAX_CONNECTIONS: usize = 64;
/// The probe port: kubelet opens one connection per probe and closes it.
pub const PROBE_MAX_CONNECTIONS: usize = 16;
/// Descriptors kept for everything but connections: the placement log, the API server's
/// connections, the watchers, each worker's runtime (an epoll and an event descriptor; see
/// [`reserved_descriptors`]).
const RESERVED_DESCRIPTORS: usize = 128;

/// The listeners' flags (flattened into `gpuplace serve`).
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct Ports {
    /// Also serve /metrics, /healthz and /readyz, and nothing else, on this address over plain
    /// HTTP: scrapers need no access to the verbs' port (the manifests: 0.0.0.0:9090).
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<String>,
    /// Also serve /healthz and /readyz, and nothing else, on this address over plain HTTP, for
    /// kubelet's probes: a port no NetworkPolicy rule admits (kubelet's probes come from the node,
    /// always admitted), so no tenant can fill it (the manifests: 0.0.0.0:9091).
    #[arg(long, value_name = "ADDR")]
    pub probe_listen: Option<String>,
    /// Most connections the verbs' port holds at once, over all workers; further ones wait in the
    /// kernel's backlog. Idle connections close after 5 s, a request head not complete in 5 s gets
    /// 408. Cut to fit the open-file limit (logged).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_CONNECTIONS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_connections: usize,
    /// Most connections the metrics port holds at once; further ones wait in the kernel's backlog.
    /// Idle connections and request heads not complete close after 2 s. Cut to fit the open-file
    /// limit (logged). The probe port holds 16.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_METRICS_MAX_CONNECTIONS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub metrics_max_connections: usize,
    /// Also serve per-pod series on /metrics (gpuplace_pod_gpu_memory_allocated_mib and
    /// gpuplace_pod_gpu_core_allocated_percent: every GPU pod's namespace, name, node and GPU).
    /// Off by default: whoever may scrape sees totals only, no tenant's pod names.
    #[arg(long)]
    pub metrics_pod_series: bool,
}

impl Default for Ports {
    fn default() -> Self {
        Self {
            metrics_listen: None,
            probe_listen: None,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            metrics_max_connections: DEFAULT_METRICS_MAX_CONNECTIONS,
            metrics_pod_series: false,
        }
    }
}

/// How one listener treats its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections held at once, over all the listener's workers.
    pub max_connections: usize,
    /// Connections the kernel queues once the cap is reached (no descriptor of the process).
    pub backlog: u32,
    /// The first request's head must be complete within this (408 and closed otherwise); a
    /// connection that sends nothing is closed after it.
    pub request_timeout: Duration,
    /// An idle connection between requests is closed after this.
    pub keep_alive: Duration,
    /// After the answer, how long the client may take to close before the connection is dropped.
    pub disconnect_timeout: Duration,
}

impl Limits {
    /// actix counts `max_connections` per worker: the share of each, at least one.
    pub fn per_worker(&self, workers: usize) -> usize {
        (self.max_connections / workers.max(1)).max(1)
    }
}

/// The three listeners' limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    pub verbs: Limits,
    pub metrics: Limits,
    pub probes: Limits,
    /// The caps were cut to fit the open-file limit.
    pub cut: bool,
}

/// What the side ports (metrics, probes) allow: short, since a scrape or probe is one small
/// request sent at once.
fn side(max_connections: usize) -> Limits {
    Limits {
        max_connections,
        backlog: 128,
        request_timeout: Duration::from_secs(2),
        keep_alive: Duration::from_secs(2),
        disconnect_timeout: Duration::from_secs(1),
    }
}

/// Descriptors the process needs besides its connections, with `workers` HTTP workers.
pub fn reserved_descriptors(workers: usize) -> usize {
    // each worker (verbs, metrics, probes) runs a runtime of its own
    RESERVED_DESCRIPTORS + 4 * (workers + 2)
}

/// The number of verbs workers actix starts for `--workers` (0: one per core, as actix counts).
pub fn worker_count(workers: usize) -> usize {
    if workers > 0 {
        workers
    } else {
        std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get)
    }
}

impl Ports {
    /// With a metrics port, the verbs' port asks every client for a certificate in the handshake.
    pub fn client_auth(&self) -> ClientAuth {
        ClientAuth::with_metrics_port(self.metrics_listen.is_some())
    }

    /// The listeners' limits with `workers` verbs workers, the caps cut to fit `open_files` (the
    /// soft open-file limit, when known): the probes keep theirs, the verbs' and the metrics port's
    /// shrink alike, never below one connection per worker.
    pub fn limits(&self, workers: usize, open_files: Option<u64>) -> ListenerLimits {
        let workers = workers.max(1);
        let probes = side(PROBE_MAX_CONNECTIONS);
        let mut verbs = Limits {
            max_connections: self.max_connections,
            backlog: 1024,
            request_timeout: Duration::from_secs(5),
            keep_alive: Duration::from_secs(5),
            disconnect_timeout: Duration::from_secs(1),
        };
        let mut metrics = side(self.metrics_max_connections);
        let metrics_wanted = if self.metrics_listen.is_some() { metrics.max_connections } else { 0 };
        let probes_wanted = if self.probe_listen.is_some() { probes.max_connections } else { 0 };
        let available = open_files
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
            .map(|n| n.saturating_sub(reserved_descriptors(workers) + probes_wanted));
        let wanted = verbs.max_connections + metrics_wanted;
        let cut = available.is_some_and(|a| a < wanted);
        if let Some(available) = available.filter(|_| cut) {
            // u128: no overflow for any cap times any limit
            let share = |n: usize| ((n as u128 * available as u128) / wanted.max(1) as u128) as usize;
            verbs.max_connections = share(verbs.max_connections).max(workers);
            metrics.max_connections = share(metrics.max_connections).max(1);
        }
        ListenerLimits { verbs, metrics, probes, cut }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ports() -> Ports {
        Ports { metrics_listen: Some("x".into()), probe_listen: Some("y".into()), ..Ports::default() }
    }

    #[test]
    fn caps_fit_a_containers_default_limit_uncut() {
        let l = ports().limits(2, Some(1024));
        assert!(!l.cut);
        let total = l.verbs.max_connections + l.metrics.max_connections + l.probes.max_connections;
        assert!(total + reserved_descriptors(2) <= 1024, "{total}");
        assert_eq!(l.verbs.per_worker(2), DEFAULT_MAX_CONNECTIONS / 2);
        assert_eq!(ports().limits(2, None), l);
    }

    #[test]
    fn caps_are_cut_to_the_limit_and_the_probes_keep_theirs() {
        let p = Ports { max_connections: 4000, metrics_max_connections: 1000, ..ports() };
        let l = p.limits(8, Some(1024));
        assert!(l.cut);
        assert_eq!(l.probes.max_connections, PROBE_MAX_CONNECTIONS);
        let total = l.verbs.max_connections + l.metrics.max_connections + l.probes.max_connections;
        assert!(total + reserved_descriptors(8) <= 1024, "{l:?}");
        assert!(l.verbs.max_connections > 3 * l.metrics.max_connections, "{l:?}");
        // a limit that leaves nothing: one connection per worker still
        let l = p.limits(8, Some(10));
        assert_eq!((l.verbs.max_connections, l.metrics.max_connections), (8, 1));
        assert_eq!(l.verbs.per_worker(8), 1);
    }
}
