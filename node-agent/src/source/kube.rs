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
//! missing RBAC included) become [`SourceEvent::Error`], the live view stays, and the watcher
//! retries with backoff.

use std::path::PathBuf;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Config};
use tokio::sync::mpsc;

use super::SourceEvent;
use super::node_object::raw_node;

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
                let kc = Kubeconfig::read_from(path).map_err(err)?;
                Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                    .await
                    .map_err(err)?
            }
            None => Config::incluster().map_err(KubeSourceError::InCluster)?,
        };
        Client::try_from(config).map_err(KubeSourceError::Client)
    }

    /// Watches until the receiver is dropped.
    pub async fn run(self, client: Client, tx: mpsc::Sender<SourceEvent>) {
        let api: Api<Node> = Api::all(client);
        let mut stream = watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(item) = stream.next().await {
            let event = match item {
                Ok(Event::Init) => SourceEvent::Init,
                Ok(Event::InitApply(n)) => SourceEvent::InitApply(raw_node(&n)),
                Ok(Event::InitDone) => SourceEvent::InitDone,
                Ok(Event::Apply(n)) => SourceEvent::Apply(raw_node(&n)),
                Ok(Event::Delete(n)) => SourceEvent::Delete(n.metadata.name.unwrap_or_default()),
                Err(e) => {
                    let msg = describe(&e);
                    tracing::warn!(
                        "Kubernetes node watch: {msg}; keeping the last view, retrying with backoff"
                    );
                    SourceEvent::Error(msg)
                }
            };
            if tx.send(event).await.is_err() {
                return;
            }
        }
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
        _ => e.to_string(),
    }
}
