//! The brake between plans: the memory and hold each plan leaves for the next, an operator's
//! confirmation until a plan has seen it, and `--force-prune`, spent on the first plan.

use state::plan::{BrakeHold, BrakeMemory, HoldKind, Plan};

use super::Reconciler;
use crate::kernel::Kernel;
use crate::telemetry::reconcile::RECONCILER;

/// The brake as the reconciler keeps it between plans.
pub(super) struct Brake {
    /// What the brake remembers of recent removals, for the next plan.
    pub memory: BrakeMemory,
    /// The last plan's hold.
    pub hold: Option<BrakeHold>,
    /// The hold an operator confirmed, until a plan has seen it.
    pub confirmed: Option<String>,
}

impl Brake {
    /// The brake of a reconciler just started, with the memory restored.
    pub(super) fn restored(memory: BrakeMemory) -> Self {
        Self {
            memory,
            hold: None,
            confirmed: None,
        }
    }
}

impl<K: Kernel> Reconciler<K> {
    /// As a daemon, a fresh full list after the confirm delay releases a hold; one-shot runs
    /// only release with `--force-prune`.
    pub fn confirm_by_relist(&mut self, yes: bool) {
        self.plan_config.confirm_by_relist = yes;
    }

    /// An operator confirmed the hold `id` (`node-agent prune confirm`); the next plan releases
    /// it if it is still exactly that hold.
    pub fn confirm_hold(&mut self, id: String) {
        tracing::warn!(target: RECONCILER, hold = %id, "an operator confirmed a held prune");
        self.brake.confirmed = Some(id);
    }

    /// After the apply: keeps the memory and the hold `plan` left for the next plan, writing
    /// the removals it let through into the kernel first, and spends `--force-prune`.
    pub(super) fn keep_brake(&mut self, plan: &Plan) {
        self.remember_removal(&plan.brake_memory);
        self.brake.memory = plan.brake_memory.clone();
        self.brake.hold = plan.brake.clone();
        self.spend_force_prune(plan);
    }

    /// `--force-prune` in the daemon is for the plan after a restart, the one the operator
    /// looked at: kept for every plan, as a setting left in a DaemonSet's environment would
    /// be, it turned the brake off for good, near-total wipes included.
    /// A plan of no view (no local node) is not the one: it released nothing.
    fn spend_force_prune(&mut self, plan: &Plan) {
        let no_view = plan
            .brake
            .as_ref()
            .is_some_and(|b| b.kind == HoldKind::NoLocalNode);
        if self.plan_config.force_prune && self.plan_config.confirm_by_relist && !no_view {
            self.plan_config.force_prune = false;
            tracing::warn!(
                target: RECONCILER,
                "--force-prune applied to the first plan after start; the brake holds again \
                 from now on (`node-agent prune confirm` releases a later hold)"
            );
        }
    }

    /// Writes the removals this plan let through (the entry it added to the window: the one the
    /// last window lacks, whatever the clock did) into the kernel's record of recent removals,
    /// which outlives a lost checkpoint.
    fn remember_removal(&mut self, next: &BrakeMemory) {
        let Some(&added) = next.window.last() else {
            return;
        };
        if self.brake.memory.window.contains(&added) {
            return;
        }
        let keep_since = added.at.saturating_sub(self.plan_config.confirm_delay);
        if let Err(e) = self.kernel.remember_removal(added, keep_since) {
            tracing::warn!(
                target: RECONCILER,
                "remembering the removals just made in the kernel (the checkpoint has them): {e}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use state::plan::HoldKind;

    use super::super::testing::*;
    use crate::source::SourceEvent;

    #[tokio::test(flavor = "current_thread")]
    async fn the_brake_window_survives_a_lost_checkpoint_through_the_kernel() {
        let nodes = ten();
        let mut rec = reconciler(&nodes);
        rec.reconcile().await.unwrap();
        // Four of ten go: within the ratio, and the kernel remembers it.
        for (n, _) in &nodes[..4] {
            rec.on_event(SourceEvent::Delete((*n).into()));
        }
        let o = rec.reconcile().await.unwrap();
        assert!(o.plan.brake.is_none() && o.pruned.len() == 4);
        let kept = rec.kernel().removals.clone().unwrap_or_default();
        assert_eq!(kept.iter().map(|r| r.nodes).sum::<u32>(), 4, "{kept:?}");
        // A restart without the checkpoint, on a kernel that remembers no freed ID either: two
        // more are six of ten within the window.
        let mut kernel = std::mem::take(rec.kernel());
        kernel.freed.clear();
        let mut rec = reconciler_with(config(), kernel, &nodes[6..]);
        let o = rec.reconcile().await.unwrap();
        let hold = o.plan.brake.as_ref().expect("held");
        assert_eq!(
            (hold.count.removed_nodes(), hold.count.known_nodes),
            (6, 10)
        );
        assert!(o.pruned.is_empty());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn force_prune_in_the_daemon_releases_the_first_plans_hold_only() {
        let nodes = ten();
        // Six of ten go while the agent is down: the restarted daemon holds them.
        let mut rec = reconciler(&nodes);
        rec.reconcile().await.unwrap();
        let record = rec.stamp_record().cloned();
        let kernel = std::mem::take(rec.kernel());
        let restart = |config: AgentConfig, kernel: FakeKernel| {
            let mut rec = restarted(config, record.clone(), kernel, &nodes[6..]);
            rec.confirm_by_relist(true);
            rec
        };
        let mut held = restart(config(), kernel);
        assert!(held.reconcile().await.unwrap().plan.brake.is_some());
        let kernel = std::mem::take(held.kernel());
        // Restarted with --force-prune: the first plan releases the six...
        let mut forced = config();
        forced.force_prune = true;
        let mut rec = restart(forced, kernel);
        let o = rec.reconcile().await.unwrap();
        assert!(o.plan.brake.is_none());
        assert_eq!(o.pruned.len(), 6);
        // ... and no later one: three of the four left go, held.
        for (n, _) in &nodes[6..9] {
            rec.on_event(SourceEvent::Delete((*n).into()));
        }
        let o = rec.reconcile().await.unwrap();
        assert!(
            o.plan.brake.is_some(),
            "three of four, held: {:?}",
            o.pruned
        );
        assert!(o.pruned.is_empty());
    }

    /// A relist reconciles while a hold waits for one: only a ratio hold whose confirm delay
    /// has passed. A hold no list confirms (a wipe's, or one not yet ripe) made every relist a
    /// plan of the whole cluster.
    #[tokio::test(flavor = "current_thread")]
    async fn only_a_ripe_ratio_hold_makes_a_relist_reconcile() {
        let nodes = ten();
        for (kept, kind) in [(1, HoldKind::Wipe), (4, HoldKind::Ratio)] {
            let mut rec = reconciler(&nodes);
            rec.confirm_by_relist(true);
            rec.reconcile().await.unwrap();
            relist(&mut rec, &nodes[..kept]);
            let o = rec.reconcile().await.unwrap();
            assert_eq!(o.plan.brake.as_ref().map(|b| b.kind), Some(kind));
            assert!(
                !relist(&mut rec, &nodes[..kept]),
                "{kind:?}: the same list again"
            );
        }
        // Ripe: with no confirm delay, the list after the hold's is the one it waits for.
        let mut ripe = config();
        ripe.prune_confirm_delay = Duration::ZERO;
        let mut rec = reconciler_with(ripe, FakeKernel::default(), &nodes);
        rec.confirm_by_relist(true);
        rec.reconcile().await.unwrap();
        relist(&mut rec, &nodes[..4]);
        assert!(rec.reconcile().await.unwrap().plan.brake.is_some());
        assert!(relist(&mut rec, &nodes[..4]), "a ripe hold's list");
    }
}
