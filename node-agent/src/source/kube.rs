//! The Kubernetes source: a kube-runtime watcher on core/v1 Nodes.
//!
//! The watcher's protocol is the source protocol (`Init`, `InitApply`, `InitDone`, `Apply`,
//! `Delete`), so events pass through one for one: the first `InitDone` is the sync barrier, and
//! every relist (after a `410 Gone`, a compaction, a long disconnect) replaces the live view, so a
//! node deleted while the watch was broken disappears at the next `InitDone` and goes through the
//! same planner rules as a restart, the brake included. Objects are turned into the agent's
//! string record at once, so nothing else of them (`managedFields` included) is ever kept.
//!
//! Failures never make nodes look deleted: disconnects, timeouts and API errors (403 from
//! missing RBAC, 401 from an expired token) become [`SourceEvent::Error`], the live view stays,
//! the agent reports itself not ready, and the watcher retries with a backoff that only a
//! healthy spell resets. What ends the failure is the source's own probe, retried on that
//! backoff until it succeeds, or data: never an event that a quiet cluster may not send.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Config};
use tokio::sync::mpsc;

use state::input::{self, Input, InputError};

use super::node_object::raw_node;
use super::{SourceEvent, SourceRequest};
use crate::runtime::Backoff;

#[derive(Debug, thiserror::Error)]
pub enum KubeSourceError {
    #[error("reading kubeconfig {path}: {source}")]
    Kubeconfig {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error(
        "in-cluster configuration (is the agent running in a pod? pass --kubeconfig otherwise): {0}"
    )]
    InCluster(kube::config::InClusterError),
    /// Built from `from`: the kubeconfig, or the in-cluster service account, whose files a
    /// failure (a key that does not parse, say) is in.
    #[error("building the Kubernetes client from {from}: {source}")]
    Client {
        from: String,
        #[source]
        source: kube::Error,
    },
    #[error(transparent)]
    KubeconfigRefused(InputError),
    /// A file the client would read, refused by the input gate: `origin` says which
    /// kubeconfig field, or the in-cluster service account, named it.
    #[error("{origin}: {source}")]
    ClientFileRefused {
        origin: String,
        #[source]
        source: InputError,
    },
}

/// Where kube's in-cluster configuration reads the pod's service account: a path fixed in kube,
/// as in every Kubernetes client.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// A file the Kubernetes client reads itself: where it was named, its path, and its kind.
type ClientFile = (String, PathBuf, Input);

/// Every file `kc` names that kube reads: each cluster's `certificate-authority`, each user's
/// `tokenFile`, `client-certificate` and `client-key` (kube has already made the relative ones
/// relative to the kubeconfig's directory). Every context's, not only the current one's: which
/// one kube picks is kube's logic, and a file of the wrong kind is wrong wherever it is named.
fn kubeconfig_files(path: &Path, kc: &Kubeconfig) -> Vec<ClientFile> {
    let mut files = Vec::new();
    let mut add = |whose: String, field: &str, file: &Option<String>, what| {
        if let Some(file) = file {
            let origin = format!("kubeconfig {}: {whose} {field}", path.display());
            files.push((origin, PathBuf::from(file), what));
        }
    };
    for named in &kc.clusters {
        if let Some(c) = &named.cluster {
            let whose = format!("cluster {:?}", named.name);
            add(
                whose,
                "certificate-authority",
                &c.certificate_authority,
                Input::CaBundle,
            );
        }
    }
    for named in &kc.auth_infos {
        if let Some(u) = &named.auth_info {
            let whose = || format!("user {:?}", named.name);
            add(whose(), "tokenFile", &u.token_file, Input::Token);
            add(
                whose(),
                "client-certificate",
                &u.client_certificate,
                Input::ClientCertificate,
            );
            add(whose(), "client-key", &u.client_key, Input::ClientKey);
        }
    }
    files
}

/// The files kube's in-cluster configuration reads in the service account directory `dir`.
fn in_cluster_files(dir: &Path) -> Vec<ClientFile> {
    [
        ("token", Input::Token),
        ("ca.crt", Input::CaBundle),
        ("namespace", Input::Namespace),
    ]
    .into_iter()
    .map(|(name, what)| {
        (
            "in-cluster service account".to_owned(),
            dir.join(name),
            what,
        )
    })
    .collect()
}

/// Passes each of the client's files through the input gate's checks before kube reads it
/// whole: kube reads them itself, and re-reads a token file as it rotates, which a
/// configuration built from bytes read here would lose. A missing file is left to kube, which
/// names it if it is one it reads (a stale context's missing file harms nothing).
fn gate(files: Vec<ClientFile>) -> Result<(), KubeSourceError> {
    for (origin, path, what) in files {
        match input::open(&path, what) {
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(source) => return Err(KubeSourceError::ClientFileRefused { origin, source }),
        }
    }
    Ok(())
}

/// Where the API server is: a kubeconfig file, or the pod's in-cluster service account.
#[derive(Clone, Debug)]
pub struct KubeSource {
    pub kubeconfig: Option<PathBuf>,
}

impl KubeSource {
    pub async fn client(&self) -> Result<Client, KubeSourceError> {
        let config = match &self.kubeconfig {
            Some(path) => {
                let err = |source| KubeSourceError::Kubeconfig {
                    path: path.clone(),
                    source,
                };
                // Looked at by the input gate first; kube then reads it again itself, to resolve
                // the certificate paths in it against its directory.
                input::open(path, Input::Kubeconfig).map_err(KubeSourceError::KubeconfigRefused)?;
                let kc = Kubeconfig::read_from(path).map_err(err)?;
                gate(kubeconfig_files(path, &kc))?;
                Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                    .await
                    .map_err(err)?
            }
            None => {
                gate(in_cluster_files(Path::new(SERVICE_ACCOUNT_DIR)))?;
                Config::incluster().map_err(KubeSourceError::InCluster)?
            }
        };
        let from = match &self.kubeconfig {
            Some(path) => format!("kubeconfig {}", path.display()),
            None => format!("the in-cluster service account ({SERVICE_ACCOUNT_DIR})"),
        };
        Client::try_from(config).map_err(|source| KubeSourceError::Client { from, source })
    }

    /// Watches until the receiver is dropped. A [`SourceRequest::Relist`] starts the watch
    /// over from a fresh list.
    ///
    /// Errors back off exponentially with jitter (1 s doubling to [`MAX_BACKOFF`]), reset only
    /// once the source has been healthy for [`MAX_BACKOFF`]: a reset by any event retried a
    /// failing API server about every second forever (kube-runtime's watcher announces every
    /// new list attempt with `Init`, before the list is even sent), and a reset by data did the
    /// same wherever lists succeed and watches fail at once (`410 Expired` from a proxy that
    /// keeps no history), each retry a list of the whole cluster.
    ///
    /// A failure is ended by the source's own check, never by waiting for an event: a watch
    /// that resumes quietly sends none, in a quiet cluster for good. So while failing, the
    /// source asks the API server for one node (`limit=1`) at the end of each error's wait and
    /// then again after each backoff period, beside the watch, until a probe succeeds
    /// ([`SourceEvent::Healthy`]) or data comes; each failed probe counts as a failure for the
    /// backoff, so the probes never outpace it.
    pub async fn run(
        self,
        client: Client,
        tx: mpsc::Sender<SourceEvent>,
        mut requests: mpsc::Receiver<SourceRequest>,
    ) {
        let api: Api<Node> = Api::all(client);
        let mut health = Health::new(Instant::now());
        let mut requests_open = true;
        loop {
            let mut stream = watcher::watcher(api.clone(), watcher::Config::default()).boxed();
            let mut revisions = Revisions::default();
            loop {
                let probe_at = health.probe_at();
                let step = tokio::select! {
                    req = requests.recv(), if requests_open => {
                        match req {
                            Some(SourceRequest::Relist) => {
                                tracing::info!("starting the node watch over from a fresh list");
                                break;
                            }
                            None => {
                                requests_open = false;
                                continue;
                            }
                        }
                    }
                    () = tokio::time::sleep_until(probe_at.unwrap_or_else(Instant::now).into()),
                        if probe_at.is_some() => Step::Probe,
                    item = stream.next() => match item {
                        None => return,
                        Some(Ok(ev)) => {
                            let revision = revisions.announce(&ev);
                            Step::Event(convert(ev), revision)
                        }
                        Some(Err(e)) => Step::Failed(e),
                    },
                };
                let event = match step {
                    Step::Event(ev, revision) => {
                        if ev.clears_failure() {
                            health.recovered(Instant::now());
                        }
                        if let Some(r) = revision
                            && tx.send(SourceEvent::Revision(r)).await.is_err()
                        {
                            return;
                        }
                        Some(ev)
                    }
                    Step::Failed(e) => {
                        let msg = describe(&e);
                        let delay = health.failed(Instant::now());
                        tracing::warn!(
                            retry_in_ms = delay.as_millis() as u64,
                            "Kubernetes node watch: {msg}; keeping the last view"
                        );
                        if tx.send(SourceEvent::Error(msg)).await.is_err() {
                            return;
                        }
                        // The watcher retries as soon as it is polled again: not before the wait.
                        tokio::time::sleep(delay).await;
                        probe(&api, &mut health).await
                    }
                    Step::Probe => probe(&api, &mut health).await,
                };
                if let Some(event) = event
                    && tx.send(event).await.is_err()
                {
                    return;
                }
            }
        }
    }
}

/// What the watch loop does next.
enum Step {
    /// An event, and the resourceVersion to announce before it.
    Event(SourceEvent, Option<u64>),
    Failed(watcher::Error),
    Probe,
}

/// One probe: `Healthy` if the API server lists a node for the agent; otherwise the next probe
/// is scheduled one backoff period on.
async fn probe(api: &Api<Node>, health: &mut Health) -> Option<SourceEvent> {
    let params = ListParams::default().limit(1);
    let list = api.list(&params);
    let answer = match tokio::time::timeout(PROBE_TIMEOUT, list).await {
        Ok(answer) => answer.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer in {PROBE_TIMEOUT:?}")),
    };
    match answer {
        Ok(_) => {
            health.recovered(Instant::now());
            Some(SourceEvent::Healthy)
        }
        Err(e) => {
            let delay = health.probe_failed(Instant::now());
            tracing::debug!(
                retry_in_ms = delay.as_millis() as u64,
                "probe list while the node source fails: {e}"
            );
            None
        }
    }
}

/// Whether the source is failing, and when it asks the API server next: the backoff that
/// spaces the watch's retries and the probes alike. Time comes in as an argument.
struct Health {
    backoff: Jittered,
    /// Since when the source has been healthy; `None` while it fails.
    healthy_since: Option<Instant>,
    /// While failing: when to probe next.
    probe_at: Option<Instant>,
}

impl Health {
    fn new(now: Instant) -> Self {
        Self {
            backoff: Jittered::new(Duration::from_secs(1), MAX_BACKOFF),
            healthy_since: Some(now),
            probe_at: None,
        }
    }

    /// A request failed (the watch, or a probe): failing from now; the wait before the next
    /// attempt. The backoff starts over only after [`MAX_BACKOFF`] of health.
    fn failed(&mut self, now: Instant) -> Duration {
        if self
            .healthy_since
            .is_some_and(|t| now.saturating_duration_since(t) >= MAX_BACKOFF)
        {
            self.backoff.reset();
        }
        self.healthy_since = None;
        // The probe that ends this wait is made by whoever waits (the error path), or by the
        // timer a failed probe sets.
        self.probe_at = None;
        self.backoff.next_delay()
    }

    /// A probe failed: probe again one backoff period from now (until then the watch runs).
    fn probe_failed(&mut self, now: Instant) -> Duration {
        let delay = self.failed(now);
        self.probe_at = Some(now + delay);
        delay
    }

    /// The API server answered (a probe, or data): healthy, unless it was already.
    fn recovered(&mut self, now: Instant) {
        self.healthy_since.get_or_insert(now);
        self.probe_at = None;
    }

    fn probe_at(&self) -> Option<Instant> {
        self.probe_at
    }

    #[cfg(test)]
    fn failing(&self) -> bool {
        self.healthy_since.is_none()
    }
}

/// The longest wait between two attempts on a failing API server.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// How long a probe may take before it counts as failed: a list of one node is quick, and one
/// that hangs must not hold up the watch loop (and the probes after it) for the client's read
/// timeout.
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// The resourceVersions to announce ([`SourceEvent::Revision`]): a change's own, and for a
/// list the newest of its items' at its end (the watcher does not pass on the list's).
#[derive(Default)]
struct Revisions {
    list: Option<u64>,
}

impl Revisions {
    fn announce(&mut self, ev: &Event<Node>) -> Option<u64> {
        let of = |n: &Node| n.metadata.resource_version.as_deref()?.parse::<u64>().ok();
        match ev {
            Event::Init => {
                self.list = None;
                None
            }
            Event::InitApply(n) => {
                self.list = self.list.max(of(n));
                None
            }
            Event::InitDone => self.list.take(),
            Event::Apply(n) | Event::Delete(n) => of(n),
        }
    }
}

fn convert(ev: Event<Node>) -> SourceEvent {
    match ev {
        Event::Init => SourceEvent::Init,
        Event::InitApply(n) => SourceEvent::InitApply(raw_node(&n)),
        Event::InitDone => SourceEvent::InitDone,
        Event::Apply(n) => SourceEvent::Apply(raw_node(&n)),
        Event::Delete(n) => SourceEvent::Delete(n.metadata.name.unwrap_or_default()),
    }
}

/// Capped exponential backoff with full jitter: each wait is drawn from [d/2, d], so agents on
/// every node of a cluster spread their retries against a struggling API server.
struct Jittered {
    backoff: Backoff,
    rng: u64,
}

impl Jittered {
    fn new(base: Duration, cap: Duration) -> Self {
        // Seeded per process: enough to keep a cluster's agents apart.
        let seed = u64::from(std::process::id()) ^ crate::runtime::wall_clock().as_nanos() as u64;
        Self {
            backoff: Backoff::new(base, cap),
            rng: seed | 1,
        }
    }

    fn next_delay(&mut self) -> Duration {
        let d = self.backoff.next_delay();
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let half = d / 2;
        half + Duration::from_nanos(r % (half.as_nanos() as u64 + 1))
    }

    fn reset(&mut self) {
        self.backoff.reset();
    }
}

/// The error in words an operator can act on; a 403 names the permission that is missing.
pub fn describe(e: &watcher::Error) -> String {
    let status = match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => Some(s.as_ref()),
        watcher::Error::WatchError(s) => Some(s.as_ref()),
        _ => None,
    };
    match status {
        Some(s) if s.code == 403 => format!(
            "forbidden (403): the agent's service account needs `get`, `list` and `watch` on \
             `nodes` (cluster scope, API group \"\"); the API server said: {}",
            s.message
        ),
        Some(s) if s.code == 401 => format!(
            "unauthorized (401): the API server rejected the agent's credentials (an expired or \
             revoked service account token?); the API server said: {}",
            s.message
        ),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each file of the in-cluster service account, as a FIFO, a directory or one byte over its
    /// kind's cap (the rest regular), is refused naming the service account and the file; all
    /// regular, or missing (left to kube's own error), passes. The kubeconfig's files are walked
    /// by `tests/tests/it/input_gate.rs`, through the client itself.
    #[test]
    fn every_in_cluster_file_of_the_wrong_kind_or_size_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let files = in_cluster_files(dir.path());
        let reset = || {
            for (_, path, _) in &files {
                let _ = std::fs::remove_file(path);
                let _ = std::fs::remove_dir(path);
                std::fs::write(path, "x\n").unwrap();
            }
        };
        let mut cases = 0;
        for (_, path, what) in &files {
            let bad: [(&str, &dyn Fn()); 3] = [
                ("is a FIFO", &|| {
                    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
                    // SAFETY: a valid NUL-terminated path.
                    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
                }),
                ("is a directory", &|| std::fs::create_dir(path).unwrap()),
                ("bytes such a file can hold", &|| {
                    let f = std::fs::File::create(path).unwrap();
                    f.set_len(what.cap() + 1).unwrap();
                }),
            ];
            for (says, make) in bad {
                reset();
                std::fs::remove_file(path).unwrap();
                make();
                let e = gate(in_cluster_files(dir.path())).unwrap_err().to_string();
                assert!(
                    e.contains("in-cluster service account")
                        && e.contains(path.to_str().unwrap())
                        && e.contains(says),
                    "{e}"
                );
                cases += 1;
            }
        }
        reset();
        gate(in_cluster_files(dir.path())).unwrap();
        std::fs::remove_file(&files[0].1).unwrap();
        gate(in_cluster_files(dir.path())).unwrap();
        println!(
            "in-cluster files: {} files x 3 wrong kinds = {cases} refused; all regular and one missing passed",
            files.len()
        );
    }

    #[test]
    fn jittered_backoff_grows_to_its_cap_and_stays_within_half_to_full() {
        let mut b = Jittered::new(Duration::from_secs(1), MAX_BACKOFF);
        let mut nominal = Backoff::new(Duration::from_secs(1), MAX_BACKOFF);
        for _ in 0..12 {
            let d = b.next_delay();
            let n = nominal.next_delay();
            assert!(d >= n / 2 && d <= n, "{d:?} outside [{:?}, {n:?}]", n / 2);
        }
        assert!(b.next_delay() >= MAX_BACKOFF / 2);
        b.reset();
        assert!(b.next_delay() <= Duration::from_secs(1));
    }

    /// While failing, the next probe is always due, one backoff period after the last failed
    /// one: nothing waits for an event. The periods grow like the watch's retries, so probes
    /// never outpace the backoff, and only a healthy spell of [`MAX_BACKOFF`] starts it over.
    #[test]
    fn a_failure_is_probed_on_the_backoff_until_a_probe_succeeds() {
        let t0 = Instant::now();
        let mut h = Health::new(t0);
        let mut now = t0 + Duration::from_secs(1);
        let wait = h.failed(now);
        assert!(h.failing());
        assert_eq!(
            h.probe_at(),
            None,
            "the error path probes at the end of its wait"
        );
        now += wait;
        let mut last = wait;
        for _ in 0..10 {
            let d = h.probe_failed(now);
            assert_eq!(
                h.probe_at(),
                Some(now + d),
                "a probe is always due while failing"
            );
            assert!(d >= last / 2 && d <= MAX_BACKOFF, "{d:?} after {last:?}");
            assert!(h.failing());
            now += d;
            last = d;
        }
        assert!(last >= MAX_BACKOFF / 2, "the probes back off: {last:?}");
        h.recovered(now);
        assert!(!h.failing());
        assert_eq!(h.probe_at(), None);
        // Another failure within MAX_BACKOFF of the recovery keeps the grown backoff...
        now += Duration::from_secs(5);
        assert!(h.failed(now) >= MAX_BACKOFF / 2);
        h.recovered(now);
        // ...and one after a healthy MAX_BACKOFF starts over.
        now += MAX_BACKOFF;
        assert!(h.failed(now) <= Duration::from_secs(1));
    }
}
