//! The record a reconcile's outcome implies: the plan's checkpoint less what failed (failed
//! cleanups stay pending deletes), spliced into the agent's record for an event-sized plan, in
//! its place for a full one; and the nodes it pruned.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use state::checkpoint::Checkpoint;
use state::ids::{AllocatorState, FreedId};
use state::objects::Op;
use state::plan::{DeleteReason, Plan};

use super::Reconciler;
use super::apply::OpResult;
use crate::kernel::Kernel;
use crate::telemetry::reconcile::RECONCILER;

/// The agent's record, and the node IDs it allocated.
pub(super) struct Books {
    /// The restored checkpoint at first, then the one each reconcile implies.
    pub record: Option<Checkpoint>,
    pub ids: AllocatorState,
}

/// What keeping the record found.
pub(super) struct Spliced {
    /// The nodes the plan pruned ([`pruned_by`]).
    pub pruned: BTreeSet<String>,
    /// The record differs from the one before in more than when it was made.
    pub changed: bool,
}

impl<K: Kernel> Reconciler<K> {
    /// Keeps the record the outcome of `plan` implies, where `failed` did not happen, and
    /// writes the IDs it freed into the kernel's record of freed IDs.
    pub(super) fn splice(&mut self, plan: &Plan, failed: &[OpResult]) -> Spliced {
        let failed_ops: Vec<Op> = failed.iter().map(|f| f.op.clone()).collect();
        let failed_nodes: BTreeSet<&str> =
            failed.iter().filter_map(|f| f.node.as_deref()).collect();
        let cp = plan.checkpoint_after(&failed_ops);
        let pruned = pruned_by(plan, self.books.record.as_ref(), &cp, &failed_nodes);
        self.remember_freed(plan, &cp);
        let changed = match (&plan.scope, self.books.record.as_mut()) {
            (Some(names), Some(record)) => {
                if let Some(index) = &mut self.events.claims {
                    index.splice(record, names, &cp.nodes);
                }
                record.splice(names, cp).changed
            }
            _ => {
                let changed = self
                    .books
                    .record
                    .as_ref()
                    .is_none_or(|old| !old.same_content(&cp));
                self.books.record = Some(cp);
                changed
            }
        };
        if let Some(record) = &self.books.record {
            self.books.ids = record.ids.clone();
        }
        Spliced { pruned, changed }
    }

    /// Writes the IDs this reconcile freed into the kernel's record of freed IDs.
    fn remember_freed(&mut self, plan: &Plan, cp: &Checkpoint) {
        let frees: HashSet<_> = plan.frees.iter().collect();
        let freed: Vec<FreedId> = cp
            .ids
            .freed
            .iter()
            .filter(|f| frees.contains(&f.id))
            .copied()
            .collect();
        if freed.is_empty() {
            return;
        }
        if let Err(e) = self.kernel.remember_freed(&freed) {
            tracing::warn!(
                target: RECONCILER,
                "remembering freed node IDs in the kernel (the checkpoint has them): {e}"
            );
        }
    }
}

/// The nodes a plan pruned: those whose stale objects it deleted, and the removals it carried
/// out (released by the brake now, or pending deletes released before) that left the record
/// with or without writes (a retry that finds nothing left to delete completes a removal too),
/// never a node with a failed op.
fn pruned_by(
    plan: &Plan,
    before: Option<&Checkpoint>,
    after: &Checkpoint,
    failed_nodes: &BTreeSet<&str>,
) -> BTreeSet<String> {
    let still_pending: BTreeSet<&str> = after
        .pending_deletes
        .iter()
        .map(|p| p.node.name.as_str())
        .collect();
    let retried = before
        .into_iter()
        .flat_map(|r| &r.pending_deletes)
        .filter(|p| p.held.is_none())
        .map(|p| &p.node.name);
    let completed = retried
        .chain(&plan.released_nodes)
        .filter(|n| !still_pending.contains(n.as_str()));
    plan.deletes
        .iter()
        .filter(|d| d.reason == DeleteReason::StaleNode)
        .filter_map(|d| d.node.as_ref())
        .chain(completed)
        .filter(|n| !failed_nodes.contains(n.as_str()))
        .cloned()
        .collect()
}

/// Merges freed IDs the kernel remembers into the checkpoint's, keeping the later time of each:
/// the safer cool-down.
pub(super) fn merge_freed(ids: &mut AllocatorState, kernel: Vec<FreedId>) {
    let mut by_id: BTreeMap<u16, FreedId> = ids.freed.iter().map(|f| (f.id.get(), *f)).collect();
    for f in kernel {
        by_id
            .entry(f.id.get())
            .and_modify(|e| e.freed_at = e.freed_at.max(f.freed_at))
            .or_insert(f);
    }
    ids.freed = by_id.into_values().collect();
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::Arc;
    use std::time::Duration;

    use state::objects::ObjectKind;

    use super::super::testing::*;
    use crate::source::SourceEvent;
    use crate::telemetry::Telemetry;

    #[tokio::test(flavor = "current_thread")]
    async fn a_failed_delete_keeps_the_node_pending_with_its_id() {
        let mut rec = reconciler(&[("a", 1), ("b", 2), ("c", 3)]);
        rec.reconcile().await.unwrap();
        rec.on_event(SourceEvent::Delete("c".into()));
        rec.kernel().faults.kinds = vec![ObjectKind::Route];
        let o = rec.reconcile().await.unwrap();
        assert_eq!(o.failed.len(), 1);
        assert!(o.pruned.is_empty());
        let cp = rec.record().unwrap();
        assert_eq!(cp.pending_deletes.len(), 1);
        assert_eq!(cp.pending_deletes[0].attempts, 1);
        assert!(cp.ids.freed.is_empty(), "its ID is still in use");
        // The kernel lets go: the retry deletes it, without the brake counting it again.
        rec.kernel().faults.kinds.clear();
        let o = rec.reconcile().await.unwrap();
        assert!(o.failed.is_empty() && o.plan.brake.is_none());
        assert_eq!(o.pruned.len(), 1);
        assert!(rec.record().unwrap().pending_deletes.is_empty());
        assert_eq!(
            rec.kernel().freed.len(),
            1,
            "the kernel remembers the freed ID"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_pending_delete_whose_retry_finds_nothing_left_is_reported_pruned() {
        let mut rec = reconciler(&[("a", 1), ("b", 2), ("c", 3)]);
        rec.reconcile().await.unwrap();
        rec.on_event(SourceEvent::Delete("c".into()));
        rec.kernel().faults.kinds = vec![ObjectKind::Route];
        let o = rec.reconcile().await.unwrap();
        assert!(o.pruned.is_empty());
        assert_eq!(rec.record().unwrap().pending_deletes.len(), 1);
        // Someone else deleted the route that failed: the retry has nothing left to write.
        rec.kernel().faults.kinds.clear();
        rec.kernel()
            .ours
            .retain(|_, o| !(o.kind() == ObjectKind::Route && o.to_string().contains(".3.")));
        let o = rec.reconcile().await.unwrap();
        assert!(o.plan.deletes.is_empty(), "{:?}", o.plan.deletes);
        assert!(rec.record().unwrap().pending_deletes.is_empty());
        assert_eq!(o.pruned, BTreeSet::from(["c".to_string()]));
        assert_eq!(rec.pruned(), &BTreeSet::from(["c".to_string()]));
        println!("pruned without writes: {:?}", o.pruned);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_cooldown_survives_a_lost_checkpoint_through_the_kernel() {
        let mut rec = reconciler(&[("a", 1), ("b", 2)]);
        rec.reconcile().await.unwrap();
        rec.on_event(SourceEvent::Delete("b".into()));
        rec.reconcile().await.unwrap();
        let freed: Vec<u16> = rec.kernel().freed.keys().copied().collect();
        assert_eq!(freed.len(), 1);
        // A restart without the checkpoint, on the same kernel: a newcomer must not get it.
        let kernel = std::mem::take(rec.kernel());
        let mut config = AgentConfig::new("local", "/nonexistent-state", "/nonexistent-bpffs");
        config.max_node_id = 2;
        let telemetry = Arc::new(Telemetry::new(Duration::MAX));
        let mut rec = Reconciler::new(config, None, kernel, telemetry);
        rec.on_event(SourceEvent::Init);
        rec.on_event(SourceEvent::InitApply(raw(
            "local",
            &["10.0.0.100"],
            &["10.1.100.0/24"],
        )));
        rec.on_event(SourceEvent::InitApply(raw(
            "a",
            &["10.0.0.1"],
            &["10.1.1.0/24"],
        )));
        rec.on_event(SourceEvent::InitApply(raw(
            "z",
            &["10.0.0.9"],
            &["10.1.9.0/24"],
        )));
        rec.on_event(SourceEvent::InitDone);
        let o = rec.reconcile().await.unwrap();
        assert!(
            o.plan
                .errors
                .iter()
                .any(|e| e.node == "z" && e.to_string().contains("cooling")),
            "{:?}",
            o.plan.errors
        );
    }
}
