//! Node sources: where the agent learns which nodes exist.
//!
//! Every source speaks the same event protocol, modelled on kube-runtime's watcher: a full
//! relist is `Init`, one `InitApply` per node, then `InitDone`; between relists, `Apply` and
//! `Delete` carry single changes. The first `InitDone` is the sync barrier: before it nothing may
//! be pruned (invariant 1). An `Error` never reads as "no nodes": the live view stays as it was.
//! [`live::LiveState`] folds the events into the planner's live view, so the Kubernetes watcher
//! and the NodeList file plug in the same way.

pub mod file;
pub mod kube;
pub mod live;
pub mod node_object;

use state::node::RawNode;

/// One message from a node source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceEvent {
    /// A full list starts; the nodes that follow replace the live view at `InitDone`.
    Init,
    /// One node of the full list.
    InitApply(RawNode),
    /// The full list is complete.
    InitDone,
    /// A node was added or changed.
    Apply(RawNode),
    /// A node was deleted.
    Delete(String),
    /// The source could not read the nodes; what it said before still holds.
    Error(String),
    /// The source reached its nodes again after an error, with nothing to report.
    Healthy,
    /// Announces the event that follows (`Apply`, `Delete` or a list's `InitDone`): the
    /// Kubernetes `resourceVersion` it brings the view to, where the API server's versions are
    /// numbers (etcd's revisions are). Sent before its event, so that no reconcile can claim a
    /// version whose change it has not seen.
    Revision(u64),
}

impl SourceEvent {
    /// Whether the event says the source can read its nodes, and so ends a failure that an
    /// [`SourceEvent::Error`] began: data (a completed list, a change) or a check that
    /// succeeded. `Init` and `InitApply` do not: kube-runtime's watcher announces every list
    /// attempt with `Init` before it sends the list, and a list can fail on any page.
    pub fn clears_failure(&self) -> bool {
        matches!(
            self,
            Self::InitDone | Self::Apply(_) | Self::Delete(_) | Self::Healthy
        )
    }
}

/// What the agent may ask of its source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceRequest {
    /// Deliver a fresh full list soon (a hold of the brake waits for one; a healthy watch may
    /// never relist on its own).
    Relist,
}
