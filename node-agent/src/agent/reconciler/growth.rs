//! Map growth: the node-ID and pod-CIDR maps grow online before a plan would fill them.

use state::inventory::Inventory;
use state::objects::ObjectKind;
use state::plan::{InputProblem, Plan};

use super::Reconciler;
use crate::kernel::Kernel;
use crate::telemetry::reconcile::RECONCILER;

impl<K: Kernel> Reconciler<K> {
    /// Grows the maps when `plan` would leave them more than three quarters full or could not
    /// place a node for want of room; returns whether they grew (the plan is then made again if
    /// it held a node for want of room). A capacity the kernel refused is not asked for again by
    /// this agent.
    pub(super) fn grow_maps_for(&mut self, plan: &Plan, inventory: &Inventory) -> bool {
        let capacity = self.plan_config.map_capacity;
        if !self.config.node_map_grow {
            return false;
        }
        let Some(target) = map_growth(plan, inventory, capacity) else {
            return false;
        };
        if self.grow_refused == Some(target) {
            return false;
        }
        match self.kernel.grow_maps(target) {
            Ok(()) => {
                tracing::info!(target: RECONCILER, from = capacity, to = target, "node-ID map grown online");
                self.plan_config.map_capacity = target as usize;
                self.config.datapath.node_map_max = target;
                true
            }
            Err(e) => {
                tracing::error!(target: RECONCILER, "{e}; the maps keep their {capacity} entries");
                self.grow_refused = Some(target);
                false
            }
        }
    }
}

/// The capacity the maps should grow to for `plan`, if they should: when the entries it leaves
/// in either map, plus those of nodes it held for want of room, fill more than three quarters of
/// `capacity`, double it until they do not (a hash map that full keeps its lookups short, and a
/// burst of new nodes finds room), up to the largest map the agent makes.
fn map_growth(plan: &Plan, inventory: &Inventory, capacity: usize) -> Option<u32> {
    let after = |kind: ObjectKind| {
        let creates = plan
            .upserts
            .iter()
            .filter(|u| !u.update && u.object.kind() == kind)
            .count();
        let deletes = plan
            .deletes
            .iter()
            .filter(|d| d.object.kind() == kind)
            .count();
        (inventory.count(kind) + creates).saturating_sub(deletes)
    };
    let waiting: usize = plan
        .errors
        .iter()
        .filter_map(|e| match e.problem {
            InputProblem::MapFull { needed, .. } => Some(needed),
            _ => None,
        })
        .sum();
    let need = after(ObjectKind::MapEntry).max(after(ObjectKind::PodCidrEntry)) + waiting;
    let max = node_agent_common::MAX_NODE_MAP_MAX as usize;
    let mut target = capacity.max(1);
    while need * 4 > target * 3 && target < max {
        target = (target * 2).min(max);
    }
    (target > capacity).then_some(target as u32)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use state::ids::AllocatorState;
    use state::objects::KernelObject;
    use state::plan::{BrakeMemory, PlanConfig};

    use super::super::testing::*;
    use super::*;
    use crate::source::SourceEvent;

    #[tokio::test(flavor = "current_thread")]
    async fn a_map_that_would_be_full_grows_before_the_plan_is_applied() {
        let mut config = config();
        config.datapath.node_map_max = 4;
        let nodes = [
            ("n1", 1),
            ("n2", 2),
            ("n3", 3),
            ("n4", 4),
            ("n5", 5),
            ("n6", 6),
        ];
        let mut rec = reconciler_with(config, FakeKernel::default(), &nodes);
        let out = rec.reconcile().await.unwrap();
        assert_eq!(
            rec.kernel().grown,
            [8],
            "six entries do not fit 4, nor 3/4 of 4"
        );
        assert!(out.plan.errors.is_empty(), "{:?}", out.plan.errors);
        assert_eq!(count(&mut rec, ObjectKind::MapEntry), 6);
        assert_eq!(metric(&rec, "node_agent_node_map_fill_ratio"), Some(0.75));
        // Room enough now: the next reconcile grows nothing.
        rec.reconcile().await.unwrap();
        assert_eq!(rec.kernel().grown, [8]);
        // A seventh fits in 8 but fills more than 3/4 of it: the map grows, nothing was held,
        // and the plan made before the growth is applied. The next event is still planned
        // event-sized, under the grown capacity.
        rec.prepare_event_plans();
        rec.on_event(SourceEvent::Apply(raw(
            "n7",
            &["10.0.0.7"],
            &["10.1.7.0/24"],
        )));
        let out = rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().grown, [8, 16]);
        assert!(out.plan.errors.is_empty(), "{:?}", out.plan.errors);
        assert_eq!(count(&mut rec, ObjectKind::MapEntry), 7);
        rec.on_event(SourceEvent::Apply(raw(
            "n8",
            &["10.0.0.8"],
            &["10.1.8.0/24"],
        )));
        let out = rec.reconcile_event().await.unwrap();
        assert!(
            out.plan.scope.is_some(),
            "event-sized under the grown capacity"
        );
        assert_eq!(count(&mut rec, ObjectKind::MapEntry), 8);
    }

    #[test]
    fn maps_grow_past_three_quarters_by_doubling_and_never_past_the_largest() {
        let plan_with = |entries: usize| {
            let live = state::plan::LiveView {
                nodes: Vec::new(),
                synced: false,
                ..Default::default()
            };
            let inventory: Inventory = (1..=entries as u32)
                .map(|i| {
                    KernelObject::MapEntry(state::objects::MapEntry {
                        ip: std::net::IpAddr::from(i.to_be_bytes()),
                        node_id: state::objects::NodeId::new(1).unwrap(),
                        spi: 0,
                    })
                })
                .collect();
            let plan = state::plan::plan(&state::plan::PlanInput {
                record: None,
                live: &live,
                inventory: &inventory,
                allocator: &AllocatorState::default(),
                brake: &BrakeMemory::default(),
                confirmed_hold: None,
                now: Duration::from_secs(1),
                config: &PlanConfig::default(),
            });
            (plan, inventory)
        };
        let (p, inv) = plan_with(75);
        assert_eq!(map_growth(&p, &inv, 100), None, "three quarters is fine");
        let (p, inv) = plan_with(76);
        assert_eq!(map_growth(&p, &inv, 100), Some(200));
        let (p, inv) = plan_with(200);
        assert_eq!(
            map_growth(&p, &inv, 100),
            Some(400),
            "doubled until under 3/4"
        );
        let max = node_agent_common::MAX_NODE_MAP_MAX as usize;
        assert_eq!(map_growth(&p, &inv, max), None);
    }
}
