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
//! the agent reports itself not ready, and the watcher retries with a backoff that only data
//! resets.

use std::path::PathBuf;

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Config};
use tokio::sync::mpsc;

use super::node_object::raw_node;
use super::{SourceEvent, SourceRequest};
use crate::agent::schedule::Backoff;

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
    #[error("building the Kubernetes client: {0}")]
    Client(kube::Error),
    #[error(transparent)]
    KubeconfigRefused(state::input::InputError),
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
                state::input::open(path, state::input::Input::Kubeconfig)
                    .map_err(KubeSourceError::KubeconfigRefused)?;
                let kc = Kubeconfig::read_from(path).map_err(err)?;
                Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                    .await
                    .map_err(err)?
            }
            None => Config::incluster().map_err(KubeSourceError::InCluster)?,
        };
        Client::try_from(config).map_err(KubeSourceError::Client)
    }

    /// Watches until the receiver is dropped. A [`SourceRequest::Relist`] starts the watch
    /// over from a fresh list.
    ///
    /// Errors back off exponentially with jitter (1 s doubling to [`MAX_BACKOFF`]), reset only
    /// once the watch has gone [`MAX_BACKOFF`] without an error: a reset by any event retried
    /// a failing API server about every second forever (kube-runtime's watcher announces every
    /// new list attempt with `Init`, before the list is even sent), and a reset by data did the
    /// same wherever lists succeed and watches fail at once (`410 Expired` from a proxy that
    /// keeps no history), each retry a list of the whole cluster. After an error the source also asks the API server
    /// for one node (`limit=1`) once per backoff period: a watch that resumes quietly sends no
    /// event, and that probe is what says the agent can see nodes again.
    pub async fn run(
        self,
        client: Client,
        tx: mpsc::Sender<SourceEvent>,
        mut requests: mpsc::Receiver<SourceRequest>,
    ) {
        let api: Api<Node> = Api::all(client);
        let mut backoff = Jittered::new(Duration::from_secs(1), MAX_BACKOFF);
        let mut requests_open = true;
        // When the last error's wait ended: the watch has been good since, unless another came.
        let mut last_retry: Option<std::time::Instant> = None;
        loop {
            let mut stream = watcher::watcher(api.clone(), watcher::Config::default()).boxed();
            loop {
                let item = tokio::select! {
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
                    item = stream.next() => item,
                };
                let Some(item) = item else { return };
                let event = match item {
                    Ok(ev) => convert(ev),
                    Err(e) => {
                        let msg = describe(&e);
                        if last_retry.is_some_and(|t| t.elapsed() >= MAX_BACKOFF) {
                            backoff.reset();
                        }
                        let delay = backoff.next_delay();
                        tracing::warn!(
                            retry_in_ms = delay.as_millis() as u64,
                            "Kubernetes node watch: {msg}; keeping the last view"
                        );
                        if tx.send(SourceEvent::Error(msg)).await.is_err() {
                            return;
                        }
                        tokio::time::sleep(delay).await;
                        last_retry = Some(std::time::Instant::now());
                        match api.list(&ListParams::default().limit(1)).await {
                            Ok(_) => SourceEvent::Healthy,
                            Err(e) => {
                                tracing::debug!("probe list after a watch error: {e}");
                                continue;
                            }
                        }
                    }
                };
                if tx.send(event).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// The longest wait between two attempts on a failing API server.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

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
        let seed =
            u64::from(std::process::id()) ^ crate::agent::clock::wall_clock().as_nanos() as u64;
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
}
