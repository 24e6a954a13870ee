//! The view a reconcile plans from: a dump of the kernel, or the last reconcile's result where
//! that can stand in for one; and what drifted since the last reconcile, found by the dump.

use std::collections::BTreeSet;

use state::inventory::Inventory;

use super::Reconciler;
use crate::agent::AgentError;
use crate::agent::drift::Drift;
use crate::kernel::Kernel;
use crate::source::live::Changes;

/// Where a reconcile's view of the kernel comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum InventoryFrom {
    /// A dump, always.
    Dump,
    /// The last reconcile's result when it can stand in for a dump.
    Cached,
}

/// What the kernel holds as far as the agent knows, between reconciles.
#[derive(Default)]
pub(super) struct View {
    /// What the kernel should hold after the last reconcile: the next dump's drift is measured
    /// against it, and a reconcile for a source event plans against it without dumping.
    expected: Option<Inventory>,
    /// Every operation of the last reconcile succeeded, so [`Self::expected`] is what the
    /// kernel holds as far as the agent knows; after a failure the next reconcile dumps.
    exact: bool,
    /// The dump taken while the source synced at start, until the first reconcile uses it.
    early_dump: Option<Inventory>,
}

impl View {
    /// Keeps what the kernel holds after a reconcile: `exact` when every operation succeeded.
    pub(super) fn keep(&mut self, inventory: Inventory, exact: bool) {
        self.expected = Some(inventory);
        self.exact = exact;
    }
}

/// What one reconcile saw of the kernel.
pub(super) struct Seen {
    /// What the kernel holds; the apply keeps it so, operation by operation.
    pub inventory: Inventory,
    /// What had drifted from what the last reconcile left.
    pub drift: Drift,
    /// The kernel was dumped (not planned from the last reconcile's result).
    pub dumped: bool,
}

impl Seen {
    /// The nodes a source event changed, when an event-sized plan may do: only from the last
    /// reconcile's result (a dump may find anything changed).
    pub(super) fn event_names<'c>(&self, changes: &'c Changes) -> Option<&'c BTreeSet<String>> {
        match changes {
            Changes::Names(names) if !self.dumped => Some(names),
            _ => None,
        }
    }
}

impl<K: Kernel> Reconciler<K> {
    /// The view a reconcile plans from: the last reconcile's result for an event (`from`
    /// [`InventoryFrom::Cached`]) when every operation of it succeeded, else a dump.
    pub(super) async fn look(&mut self, from: InventoryFrom) -> Result<Seen, AgentError> {
        let cached = match from {
            InventoryFrom::Cached if self.view.exact => self.view.expected.take(),
            _ => None,
        };
        Ok(match cached {
            Some(inventory) => Seen {
                inventory,
                drift: Drift::default(),
                dumped: false,
            },
            None => {
                let (inventory, drift) = self.dump().await?;
                Seen {
                    inventory,
                    drift,
                    dumped: true,
                }
            }
        })
    }

    /// Dumps again within a reconcile: what changed since `seen` was read is added to its
    /// drift.
    pub(super) async fn look_again(&mut self, seen: &mut Seen) -> Result<(), AgentError> {
        // The next dump is compared with this view: with a dump's, what changed since is added
        // to what that dump found.
        self.view.expected = Some(std::mem::take(&mut seen.inventory));
        let later;
        (seen.inventory, later) = self.dump().await?;
        seen.drift.merge(later);
        seen.dumped = true;
        Ok(())
    }

    /// Dumps the kernel, and what drifted from the view the last reconcile left. Until a dump
    /// succeeds, no reconcile plans from the view it was to check.
    async fn dump(&mut self) -> Result<(Inventory, Drift), AgentError> {
        self.view.exact = false;
        let inventory = self.dump_kernel().await?;
        // The view is done with once compared: at scale it is as large as the dump, and the
        // plan about to be made is the reconcile's peak memory.
        let drift = self
            .view
            .expected
            .take()
            .map(|e| Drift::detect(&e, &inventory))
            .unwrap_or_default();
        Ok((inventory, drift))
    }

    /// The kernel's objects: the early dump the first time, if there is one. What the host
    /// holds is read with it and kept for the plans until the next dump (a plan from the last
    /// reconcile's result uses the last one read).
    pub(super) async fn dump_kernel(&mut self) -> Result<Inventory, AgentError> {
        let inventory = match self.view.early_dump.take() {
            Some(inventory) => inventory,
            None => self.kernel.dump().await?,
        };
        self.host = self.kernel.host().await?;
        Ok(inventory)
    }

    /// A dump of the kernel taken while the source synced at start: the first reconcile (or
    /// plan) starts from it instead of dumping again. Nothing of the agent's has written to the
    /// kernel since, and a foreign change since is what any dump can miss before its apply:
    /// creates are exclusive and deletes carry our markers, and the nexthop users' watch counts
    /// from the start of this dump.
    pub fn keep_early_dump(&mut self, inventory: Inventory) {
        self.view.early_dump = Some(inventory);
    }

    /// Forgets the view the last reconcile left, so that the next one dumps without comparing:
    /// a one-shot run's pass after a failed one, milliseconds after its writes, has no drift to
    /// find, and the view is as large as the dump it would be compared with.
    pub fn forget_view(&mut self) {
        self.view.expected = None;
        self.view.exact = false;
    }
}

#[cfg(test)]
mod tests {
    use state::objects::ObjectKind;

    use super::super::testing::*;
    use crate::source::SourceEvent;

    #[tokio::test(flavor = "current_thread")]
    async fn an_event_reconcile_plans_from_the_last_result_and_a_failure_or_a_resync_dumps() {
        let mut rec = reconciler(&[("a", 1)]);
        rec.reconcile().await.unwrap();
        assert_eq!(rec.kernel().dumps, 1);
        rec.on_event(SourceEvent::Apply(raw(
            "b",
            &["10.0.0.2"],
            &["10.1.2.0/24"],
        )));
        rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().dumps, 1, "planned from the last result");
        assert_eq!(count(&mut rec, ObjectKind::Route), 2);
        // A failed operation leaves the view uncertain: the next event reconcile dumps.
        rec.kernel().faults.kinds = vec![ObjectKind::Route];
        rec.on_event(SourceEvent::Apply(raw(
            "c",
            &["10.0.0.3"],
            &["10.1.3.0/24"],
        )));
        let out = rec.reconcile_event().await.unwrap();
        assert_eq!((out.failed.len(), rec.kernel().dumps), (1, 1));
        rec.kernel().faults.kinds.clear();
        rec.on_event(SourceEvent::Delete("a".into()));
        rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().dumps, 2);
        assert_eq!(
            count(&mut rec, ObjectKind::Route),
            2,
            "c's route retried, a's gone"
        );
        // What changed behind the agent's back is found by the resync, which always dumps.
        rec.kernel()
            .ours
            .retain(|_, o| o.kind() != ObjectKind::Route);
        rec.on_event(SourceEvent::Apply(raw(
            "d",
            &["10.0.0.4"],
            &["10.1.4.0/24"],
        )));
        rec.reconcile_event().await.unwrap();
        assert_eq!(
            count(&mut rec, ObjectKind::Route),
            1,
            "only d's, until the resync"
        );
        rec.reconcile().await.unwrap();
        assert_eq!(rec.kernel().dumps, 3);
        assert_eq!(
            count(&mut rec, ObjectKind::Route),
            3,
            "the resync repaired b and c"
        );
    }
}
