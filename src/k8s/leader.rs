//! Leader election through a `coordination.k8s.io/v1` Lease (kube-rs has none), as client-go does it.
//!
//! Every replica reads the Lease each retry period. The holder renews it; the others wait until
//! they have seen it unchanged for a whole lease duration *by their own clock* (no comparison of
//! clocks across machines), then take it over. Writes replace the Lease with the resourceVersion
//! just read, so when two candidates race the API server accepts one and answers 409 to the other.
//!
//! A leader counts itself as leading for `renew_deadline` after its last successful write, which is
//! shorter than the lease duration the others wait: it stops binding and deciding before anyone else
//! can take over, even if it cannot reach the API server to find out.
//!
//! The leader also writes where the other replicas reach its verbs ([`ANNOTATION_LEADER_URL`], from
//! `--advertise-url`) on the Lease at every write; the others read it each round and forward their
//! verbs there ([`Leadership::leader_url`], `extender::forward`).
//!
//! [`Elector`] is the decision alone (unit-tested with made-up instants); [`run`] does the calls.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::time::Instant;

/// The Lease annotation with the URL prefix at which the holder answers the extender's verbs
/// (`http://10.0.0.5:8888/gpuplace`); absent when the holder published none.
pub const ANNOTATION_LEADER_URL: &str = "gpuplace.io/leader-url";

/// Where the Lease is, who this replica is, and the timings.
#[derive(Debug, Clone)]
pub struct LeaderConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's name in `holderIdentity` (the pod name).
    pub identity: String,
    /// How long the others wait, after the Lease last changed, before taking it over.
    pub lease_duration: Duration,
    /// How long the leader counts itself leading after its last successful renewal.
    pub renew_deadline: Duration,
    /// How often every replica reads (and the leader renews) the Lease.
    pub retry_period: Duration,
    /// Where the others reach this replica's verbs while it leads (written on the Lease).
    pub advertise_url: Option<String>,
}

impl LeaderConfig {
    /// The usual timings (client-go's defaults): 15 s, 10 s, 2 s.
    pub fn new(namespace: &str, name: &str, identity: &str) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            advertise_url: None,
        }
    }

    /// Refuses timings under which two replicas could both lead.
    pub fn check(&self) -> Result<(), String> {
        if self.identity.is_empty() {
            return Err("leader election needs an identity (--leader-elect-identity, or POD_NAME / HOSTNAME)".into());
        }
        if self.renew_deadline >= self.lease_duration {
            return Err(format!(
                "the renew deadline ({:?}) must be shorter than the lease duration ({:?})",
                self.renew_deadline, self.lease_duration
            ));
        }
        if self.retry_period.is_zero() || self.retry_period >= self.renew_deadline {
            return Err(format!(
                "the retry period ({:?}) must be above zero and shorter than the renew deadline ({:?})",
                self.retry_period, self.renew_deadline
            ));
        }
        Ok(())
    }
}

/// Whether this replica leads right now: read by the binder (before every bind) and readiness.
#[derive(Debug)]
pub struct Leadership {
    /// No election: always leading (one replica).
    always: bool,
    /// Leading until then (the last successful write plus the renew deadline).
    until: Mutex<Option<Instant>>,
    /// Where the current holder (another replica) answers, as last read from the Lease.
    leader_url: Mutex<Option<String>>,
}

impl Leadership {
    /// Leader election is off: this replica always leads.
    pub fn always() -> Arc<Self> {
        Arc::new(Self { always: true, until: Mutex::new(None), leader_url: Mutex::new(None) })
    }

    /// Not leading until [`run`] wins the Lease.
    pub fn elected() -> Arc<Self> {
        Arc::new(Self { always: false, until: Mutex::new(None), leader_url: Mutex::new(None) })
    }

    pub fn is_elected(&self) -> bool {
        !self.always
    }

    pub fn is_leader(&self) -> bool {
        self.always || self.lock().is_some_and(|t| Instant::now() < t)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        // a plain value: a panic elsewhere cannot leave it half-written
        self.until.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lead_until(&self, until: Option<Instant>) {
        *self.lock() = until;
    }

    /// Stops leading now (a replica shutting down), whatever its last renewal allowed.
    pub fn resign(&self) {
        self.lead_until(None);
    }

    /// Where another replica that holds the Lease answers the verbs (`None`: this replica leads, no
    /// one holds it, or the holder published no URL).
    pub fn leader_url(&self) -> Option<String> {
        self.leader_url.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set_leader_url(&self, url: Option<String>) {
        *self.leader_url.lock().unwrap_or_else(|e| e.into_inner()) = url;
    }
}

/// What the Lease says, as far as the decision goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseView {
    pub holder: Option<String>,
    /// Changes with every write: what "the Lease changed" means.
    pub resource_version: String,
}

impl LeaseView {
    pub fn of(lease: &Lease) -> Self {
        Self {
            holder: lease.spec.as_ref().and_then(|s| s.holder_identity.clone()).filter(|h| !h.is_empty()),
            resource_version: lease.metadata.resource_version.clone().unwrap_or_default(),
        }
    }
}

/// What to do with the Lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// There is none: create it, held by this replica.
    Create,
    /// This replica holds it: renew.
    Renew,
    /// Nobody holds it, or its holder stopped renewing: take it over.
    TakeOver,
    /// Someone else holds it and renews it.
    Wait,
}

/// The decision, from what was read and when.
#[derive(Debug, Clone)]
pub struct Elector {
    identity: String,
    lease_duration: Duration,
    /// The Lease as last seen, and when it was first seen that way (by this replica's clock).
    observed: Option<(LeaseView, Instant)>,
}

impl Elector {
    pub fn new(identity: &str, lease_duration: Duration) -> Self {
        Self { identity: identity.into(), lease_duration, observed: None }
    }

    pub fn decide(&mut self, lease: Option<&LeaseView>, now: Instant) -> Action {
        let Some(lease) = lease else {
            self.observed = None;
            return Action::Create;
        };
        let since = match &self.observed {
            Some((seen, at)) if seen == lease => *at,
            _ => {
                self.observed = Some((lease.clone(), now));
                now
            }
        };
        match lease.holder.as_deref() {
            Some(h) if h == self.identity => Action::Renew,
            None => Action::TakeOver,
            Some(_) if now.saturating_duration_since(since) >= self.lease_duration => Action::TakeOver,
            Some(_) => Action::Wait,
        }
    }
}

fn micro_now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

/// The Lease as this replica writes it for `action` (`current` is what was read, if any).
pub fn lease_for(cfg: &LeaderConfig, action: Action, current: Option<&Lease>) -> Lease {
    let mut lease = current.cloned().unwrap_or_else(|| Lease {
        metadata: ObjectMeta {
            name: Some(cfg.name.clone()),
            namespace: Some(cfg.namespace.clone()),
            ..ObjectMeta::default()
        },
        spec: None,
    });
    // written at every write (a renewal too), so a changed --advertise-url is published by a restart
    let annotations = lease.metadata.annotations.get_or_insert_with(Default::default);
    match &cfg.advertise_url {
        Some(url) => {
            annotations.insert(ANNOTATION_LEADER_URL.into(), url.clone());
        }
        None => {
            annotations.remove(ANNOTATION_LEADER_URL);
        }
    }
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    let now = micro_now();
    let secs = i32::try_from(cfg.lease_duration.as_secs().max(1)).unwrap_or(i32::MAX);
    spec.lease_duration_seconds = Some(secs);
    spec.renew_time = Some(now.clone());
    if action != Action::Renew {
        if action == Action::TakeOver {
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        } else {
            spec.lease_transitions = Some(0);
        }
        spec.holder_identity = Some(cfg.identity.clone());
        spec.acquire_time = Some(now);
    }
    lease
}

/// Why one round of the election failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("lease {namespace}/{name}: {call}: {source}")]
    Api {
        namespace: String,
        name: String,
        call: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("lease {namespace}/{name}: {call} took longer than {timeout:?}")]
    Timeout { namespace: String, name: String, call: &'static str, timeout: Duration },
    /// Creating the Lease found no such namespace: nothing will lead until someone creates it.
    #[error(
        "lease {namespace}/{name}: namespace {namespace:?} does not exist; create it \
         (kubectl create namespace {namespace}) or pass --leader-elect-namespace with one that exists; \
         no replica leads or turns ready until then"
    )]
    NoNamespace { namespace: String, name: String },
}

/// How often a failing election round repeats the same error at warning level (every round, every
/// retry period, would bury the log in copies).
const REPEAT_ERROR_EVERY: Duration = Duration::from_secs(60);

/// Runs the election forever: reads the Lease every retry period, renews or takes it over, and
/// keeps `leadership` current. `changed` is called after every round with whether this replica
/// leads (readiness and metrics follow it).
pub async fn run(client: Client, cfg: LeaderConfig, leadership: Arc<Leadership>, changed: impl Fn(bool)) {
    let api = LeaseApi::new(client, &cfg);
    let mut elector = Elector::new(&cfg.identity, cfg.lease_duration);
    let mut was_leader = false;
    let mut last_error: Option<(String, Instant)> = None;
    loop {
        let started = Instant::now();
        match round(&api, &mut elector, started).await {
            Ok(Round::Leading) => {
                leadership.lead_until(Some(started + cfg.renew_deadline));
                leadership.set_leader_url(None);
            }
            Ok(Round::Following(url)) => {
                leadership.lead_until(None);
                leadership.set_leader_url(url);
            }
            // the last renewal still holds until its deadline, which then lapses by itself
            Err(e) => {
                let text = e.to_string();
                let repeated =
                    last_error.as_ref().is_some_and(|(t, at)| *t == text && at.elapsed() < REPEAT_ERROR_EVERY);
                if repeated {
                    tracing::debug!(error = %text, "leader election round failed again");
                } else if matches!(e, LeaseError::NoNamespace { .. }) {
                    tracing::error!(error = %text, "leader election cannot start");
                    last_error = Some((text, Instant::now()));
                } else {
                    tracing::warn!(error = %text, "leader election round failed");
                    last_error = Some((text, Instant::now()));
                }
            }
        }
        let leader = leadership.is_leader();
        if leader != was_leader {
            tracing::info!(identity = %cfg.identity, leader, "leadership changed");
            was_leader = leader;
        }
        changed(leader);
        tokio::time::sleep_until(started + cfg.retry_period).await;
    }
}

/// The Lease's API calls, each limited to one retry period: kube's client retries 503s for a long
/// while, and a round must end before the renew deadline.
struct LeaseApi<'a> {
    api: Api<Lease>,
    cfg: &'a LeaderConfig,
}

impl<'a> LeaseApi<'a> {
    fn new(client: Client, cfg: &'a LeaderConfig) -> Self {
        Self { api: Api::namespaced(client, &cfg.namespace), cfg }
    }

    fn error(&self, call: &'static str, source: kube::Error) -> LeaseError {
        LeaseError::Api { namespace: self.cfg.namespace.clone(), name: self.cfg.name.clone(), call, source }
    }

    /// Runs `f` within the limit; the API's own answer is left to the caller (a 409 is not an error).
    async fn limited<T>(
        &self,
        call: &'static str,
        f: impl std::future::Future<Output = Result<T, kube::Error>>,
    ) -> Result<Result<T, kube::Error>, LeaseError> {
        let timeout = self.cfg.retry_period;
        tokio::time::timeout(timeout, f).await.map_err(|_| LeaseError::Timeout {
            namespace: self.cfg.namespace.clone(),
            name: self.cfg.name.clone(),
            call,
            timeout,
        })
    }

    async fn get(&self) -> Result<Option<Lease>, LeaseError> {
        self.limited("get", self.api.get_opt(&self.cfg.name)).await?.map_err(|e| self.error("get", e))
    }

    /// Creates or replaces the Lease (the resourceVersion read is the precondition); `Ok(false)`
    /// when another replica wrote it first (409).
    async fn write(&self, call: &'static str, lease: &Lease, create: bool) -> Result<bool, LeaseError> {
        let pp = PostParams::default();
        let written = if create {
            self.limited(call, self.api.create(&pp, lease)).await?
        } else {
            self.limited(call, self.api.replace(&self.cfg.name, &pp, lease)).await?
        };
        match written {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            // a create answered 404 names the namespace (the Lease itself is what is being made)
            Err(kube::Error::Api(s)) if create && s.code == 404 => {
                Err(LeaseError::NoNamespace { namespace: self.cfg.namespace.clone(), name: self.cfg.name.clone() })
            }
            Err(e) => Err(self.error(call, e)),
        }
    }
}

/// Hands the Lease back if this replica holds it (a graceful shutdown, as client-go's
/// `ReleaseOnCancel`): the holder is cleared, so a standby takes it over at its next read instead of
/// waiting a whole lease duration. `Ok(true)` when it was released; `Ok(false)` when another replica
/// holds it (or wrote it first). Call it only after [`Leadership::resign`] and once no bind is in flight.
pub async fn release(client: Client, cfg: &LeaderConfig) -> Result<bool, LeaseError> {
    let api = LeaseApi::new(client, cfg);
    let held = api.get().await?.filter(|l| LeaseView::of(l).holder.as_deref() == Some(cfg.identity.as_str()));
    let Some(mut lease) = held else { return Ok(false) };
    if let Some(a) = lease.metadata.annotations.as_mut() {
        a.remove(ANNOTATION_LEADER_URL);
    }
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(micro_now());
    // a lease taken over since the read is left alone (409)
    api.write("release", &lease, false).await
}

/// What one round found.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Round {
    /// This replica wrote the Lease as its holder.
    Leading,
    /// Another replica holds it (or won the write), answering at this URL if it published one.
    Following(Option<String>),
}

/// The URL the holder published, if someone holds the Lease.
fn holder_url(lease: &Lease) -> Option<String> {
    LeaseView::of(lease).holder?;
    lease.metadata.annotations.as_ref()?.get(ANNOTATION_LEADER_URL).filter(|u| !u.is_empty()).cloned()
}

/// One round of the election.
async fn round(api: &LeaseApi<'_>, elector: &mut Elector, now: Instant) -> Result<Round, LeaseError> {
    let cfg = api.cfg;
    let current = api.get().await?;
    let action = elector.decide(current.as_ref().map(LeaseView::of).as_ref(), now);
    if action == Action::Wait {
        return Ok(Round::Following(current.as_ref().and_then(holder_url)));
    }
    let lease = lease_for(cfg, action, current.as_ref());
    let wrote = api.write("write", &lease, action == Action::Create).await?;
    if !wrote {
        // someone else wrote it first (resourceVersion precondition, or created it): not leading
        tracing::info!(identity = %cfg.identity, ?action, "another replica wrote the lease first");
    } else if action != Action::Renew {
        tracing::info!(identity = %cfg.identity, ?action, "acquired the leader lease");
    }
    // the winner of a race is found at the next read
    Ok(if wrote { Round::Leading } else { Round::Following(None) })
}

/// The Lease identity outside a pod: the host name (`HOSTNAME`, which shells do not always export,
/// else the kernel's) and the process id, as client-go adds a unique suffix: two replicas on one host
/// must not both believe they hold the Lease.
pub fn host_identity() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_string()))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "gpuplace".into());
    format!("{host}_{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(holder: Option<&str>, rv: &str) -> LeaseView {
        LeaseView { holder: holder.map(str::to_owned), resource_version: rv.into() }
    }

    #[test]
    fn creates_renews_waits_and_takes_over_after_a_full_unchanged_duration() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut e = Elector::new("me", s(15));
        assert_eq!(e.decide(None, t0), Action::Create);
        assert_eq!(e.decide(Some(&view(Some("me"), "1")), t0), Action::Renew);
        assert_eq!(e.decide(Some(&view(None, "2")), t0), Action::TakeOver);
        // held by another: wait while it keeps changing, however long in total
        assert_eq!(e.decide(Some(&view(Some("other"), "3")), t0), Action::Wait);
        assert_eq!(e.decide(Some(&view(Some("other"), "3")), t0 + s(14)), Action::Wait);
        assert_eq!(e.decide(Some(&view(Some("other"), "4")), t0 + s(16)), Action::Wait, "renewed: the clock restarts");
        assert_eq!(e.decide(Some(&view(Some("other"), "4")), t0 + s(30)), Action::Wait);
        assert_eq!(e.decide(Some(&view(Some("other"), "4")), t0 + s(31)), Action::TakeOver);
    }

    #[test]
    fn lease_written_for_each_action() {
        let cfg = LeaderConfig::new("ns", "gpuplace", "me");
        let created = lease_for(&cfg, Action::Create, None);
        let spec = created.spec.clone().unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("me"));
        assert_eq!((spec.lease_duration_seconds, spec.lease_transitions), (Some(15), Some(0)));
        assert_eq!(created.metadata.name.as_deref(), Some("gpuplace"));
        let mut other = created.clone();
        other.spec.as_mut().unwrap().holder_identity = Some("other".into());
        let taken = lease_for(&cfg, Action::TakeOver, Some(&other)).spec.unwrap();
        assert_eq!((taken.holder_identity.as_deref(), taken.lease_transitions), (Some("me"), Some(1)));
        let renewed = lease_for(&cfg, Action::Renew, Some(&created)).spec.unwrap();
        assert_eq!((renewed.holder_identity.as_deref(), renewed.acquire_time), (Some("me"), spec.acquire_time));
    }

    /// The holder's URL travels on the Lease: written at every write, read by the others only while
    /// someone holds it.
    #[test]
    fn the_leader_url_is_written_with_the_lease_and_read_while_held() {
        let mut cfg = LeaderConfig::new("ns", "gpuplace", "me");
        assert_eq!(holder_url(&lease_for(&cfg, Action::Create, None)), None, "none published");
        cfg.advertise_url = Some("http://10.0.0.5:8888/gpuplace".into());
        let created = lease_for(&cfg, Action::Create, None);
        assert_eq!(holder_url(&created).as_deref(), Some("http://10.0.0.5:8888/gpuplace"));
        cfg.advertise_url = Some("http://10.0.0.6:8888/gpuplace".into());
        let renewed = lease_for(&cfg, Action::Renew, Some(&created));
        assert_eq!(holder_url(&renewed).as_deref(), Some("http://10.0.0.6:8888/gpuplace"));
        let mut released = renewed.clone();
        released.spec.as_mut().unwrap().holder_identity = None;
        assert_eq!(holder_url(&released), None, "nobody holds it");
    }

    #[test]
    fn timings_that_allow_two_leaders_are_refused() {
        let mut cfg = LeaderConfig::new("ns", "l", "me");
        assert!(cfg.check().is_ok());
        cfg.renew_deadline = cfg.lease_duration;
        assert!(cfg.check().is_err());
        cfg = LeaderConfig::new("ns", "l", "");
        assert!(cfg.check().is_err());
    }

    /// The API server answers a Lease create in a missing namespace with 404: the error names the
    /// namespace and what to do, and the round does not lead.
    #[tokio::test]
    async fn a_missing_lease_namespace_says_what_to_create() {
        let fake = gpuplace_testkit::FakeApiServer::start().await.unwrap();
        fake.fail_next("POST", "/apis/coordination.k8s.io/v1/namespaces/*/leases", 1, 404);
        let cfg = LeaderConfig::new("gpuplace-missing", "gpuplace-extender", "replica-a");
        let api = LeaseApi::new(fake.client().unwrap(), &cfg);
        let mut elector = Elector::new(&cfg.identity, cfg.lease_duration);
        let err = round(&api, &mut elector, Instant::now()).await.unwrap_err();
        assert!(matches!(err, LeaseError::NoNamespace { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("kubectl create namespace gpuplace-missing"), "{text}");
        assert!(text.contains("--leader-elect-namespace"), "{text}");
        // the next round, with the namespace there, creates the Lease and leads
        assert_eq!(round(&api, &mut elector, Instant::now()).await.unwrap(), Round::Leading);
    }

    #[tokio::test]
    async fn leadership_lapses_by_itself() {
        let l = Leadership::elected();
        assert!(!l.is_leader());
        l.lead_until(Some(Instant::now() + Duration::from_millis(30)));
        assert!(l.is_leader());
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert!(!l.is_leader());
        assert!(Leadership::always().is_leader());
    }
}
