//! Making a plan again until it stands: from a fresh dump where someone else changed a route
//! at a destination it replaces since its view was read, and after the maps grew where it held
//! a node for want of room.

use std::time::Duration;

use ipnet::IpNet;
use state::objects::KernelObject;
use state::plan::{InputProblem, Plan, PlanConfig};

use super::Reconciler;
use super::view::Seen;
use crate::agent::AgentError;
use crate::kernel::Kernel;
use crate::kernel::RoutesSinceDump;

/// Dumps a reconcile takes again when someone else keeps changing routes at destinations its
/// plan would replace; then the rest of the plan goes ahead, and those replaces wait for the
/// retry (with backoff).
const MAX_REDUMPS: usize = 2;

/// The plan that stands.
pub(super) struct Replanned {
    pub plan: Plan,
    /// The configuration of the next plan: grown maps included.
    pub config: PlanConfig,
    /// The destinations whose route replaces are not tried: someone else keeps changing a
    /// route there.
    pub contested: Vec<IpNet>,
}

impl<K: Kernel> Reconciler<K> {
    /// Makes `plan` (from `seen`, under `config`) again until it stands. Every plan is checked
    /// against the routes changed since its view was read, the plan made again after the maps
    /// grew included. The maps grow once per reconcile at most.
    pub(super) async fn replan(
        &mut self,
        mut plan: Plan,
        mut config: PlanConfig,
        seen: &mut Seen,
        now: Duration,
    ) -> Result<Replanned, AgentError> {
        let mut grown = false;
        loop {
            let (checked, contested) = self.uncontested(plan, seen, now, &config).await?;
            if grown || !self.grow_maps_for(&checked, &seen.inventory) {
                return Ok(Replanned {
                    plan: checked,
                    config,
                    contested,
                });
            }
            grown = true;
            config = self.plan_config();
            // Only nodes held for want of room see the new capacity: without any, the plan
            // stands as it is, and a second full plan (on every cold start of a cluster past
            // 49,000 dual-stack nodes, which grows the maps) would only make it again.
            if !checked
                .errors
                .iter()
                .any(|e| matches!(e.problem, InputProblem::MapFull { .. }))
            {
                return Ok(Replanned {
                    plan: checked,
                    config,
                    contested,
                });
            }
            // One plan at a time: at scale, two would be the reconcile's peak memory.
            drop(checked);
            plan = self.make_plan(&seen.inventory, now, &config);
        }
    }

    /// `plan`, made again from a fresh dump while someone changed a route at a destination it
    /// replaces since its view was read, up to [`MAX_REDUMPS`] times; with the destinations
    /// still contested then, whose replaces the rest of the plan goes ahead without.
    async fn uncontested(
        &mut self,
        mut plan: Plan,
        seen: &mut Seen,
        now: Duration,
        config: &PlanConfig,
    ) -> Result<(Plan, Vec<IpNet>), AgentError> {
        let mut redumps = 0;
        loop {
            let contested = self.contested(&plan, seen.dumped);
            if contested.is_empty() || redumps == MAX_REDUMPS {
                return Ok((plan, contested));
            }
            drop(plan);
            self.look_again(seen).await?;
            redumps += 1;
            plan = self.make_plan(&seen.inventory, now, config);
        }
    }

    /// The destinations of the routes `plan` replaces where the view it was made from no
    /// longer holds: someone else changed a route there since the last dump began (a replace
    /// takes whatever route is at its destination). A view from the last reconcile (`dumped`
    /// false) holds nowhere where that is not known; a fresh dump's holds then, as nothing
    /// says otherwise.
    fn contested(&mut self, plan: &Plan, dumped: bool) -> Vec<IpNet> {
        let replaced = replaced_routes(plan);
        if replaced.is_empty() {
            return replaced;
        }
        match self.kernel.routes_since_dump(&replaced) {
            RoutesSinceDump::Untouched => Vec::new(),
            RoutesSinceDump::Unknown if dumped => Vec::new(),
            RoutesSinceDump::Unknown => replaced,
            RoutesSinceDump::Touched => replaced
                .into_iter()
                .filter(|d| {
                    self.kernel.routes_since_dump(std::slice::from_ref(d))
                        == RoutesSinceDump::Touched
                })
                .collect(),
        }
    }
}

/// The destinations where a plan made from the last reconcile's view replaces a route: it is
/// made again from a dump unless the kernel can tell that no one else changed a route at any
/// of them since the last one (a replace matches the destination, whoever's route is there
/// now; a readdressed node's routes move to its new nexthop so). A plan that deletes a nexthop
/// needs none: the backend reads the routes before it deletes one, and leaves alone a nexthop
/// something goes through.
fn replaced_routes(plan: &Plan) -> Vec<IpNet> {
    plan.upserts
        .iter()
        .filter(|u| u.update)
        .filter_map(|u| match &u.object {
            KernelObject::Route(r) => Some(r.dst),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use state::objects::{KernelObject, ObjectId, Op};

    use super::super::testing::*;
    use crate::source::SourceEvent;

    /// A readdressed node's routes move to its new nexthop by replace, which matches the
    /// destination whoever's route is there: from the last reconcile's view only while the
    /// kernel says no one else changed a route at those destinations since the last dump, else
    /// from a fresh dump.
    #[tokio::test(flavor = "current_thread")]
    async fn a_readdress_replaces_routes_from_the_last_view_only_while_no_one_else_changed_one_there()
     {
        let kernel = FakeKernel {
            nexthops: true,
            ..FakeKernel::default()
        };
        let mut rec = reconciler_with(config(), kernel, &[("a", 1), ("b", 2)]);
        rec.reconcile().await.unwrap();
        // Someone else changed a route at a destination that is none of ours: no matter.
        let elsewhere: ipnet::IpNet = "192.168.50.0/24".parse().unwrap();
        rec.kernel().routes_touched.push(elsewhere);
        rec.on_event(SourceEvent::Apply(raw(
            "a",
            &["10.0.0.11"],
            &["10.1.1.0/24"],
        )));
        let out = rec.reconcile_event().await.unwrap();
        assert!(out.plan.scope.is_some() && out.plan.settled);
        assert_eq!(rec.kernel().dumps, 1, "planned from the last view");
        assert!(
            out.plan
                .ops()
                .iter()
                .any(|op| matches!(op, Op::Replace(KernelObject::Route(_)))),
            "the route moved to the new nexthop: {:?}",
            out.plan.ops()
        );
        // Someone else's route took b's destination since: the view no longer holds.
        let dst: ipnet::IpNet = "10.1.2.0/24".parse().unwrap();
        let theirs = ObjectId::Route { dst, metric: 0 };
        rec.kernel().ours.remove(&theirs);
        rec.kernel()
            .foreign
            .insert(theirs.clone(), "route 10.1.2.0/24 proto static".into());
        rec.kernel().routes_touched.push(dst);
        rec.on_event(SourceEvent::Apply(raw(
            "b",
            &["10.0.0.12"],
            &["10.1.2.0/24"],
        )));
        let out = rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().dumps, 2, "made again from a dump");
        assert!(out.plan.scope.is_none());
        assert!(
            !out.plan.ops().iter().any(|op| op.object().id() == theirs),
            "theirs is left alone: {:?}",
            out.plan.ops()
        );
        assert!(
            out.plan.errors.iter().any(|e| e.node == "b"),
            "and reported: {:?}",
            out.plan.errors
        );
    }

    /// A fresh dump is checked too: a route someone else changed at a destination the plan
    /// replaces while the dump was read means a dump again; if it keeps changing, that route
    /// is not replaced (a failed operation, retried with backoff), and the rest goes ahead.
    #[tokio::test(flavor = "current_thread")]
    async fn a_route_changed_while_the_kernel_was_dumped_is_never_replaced_from_that_dump() {
        let kernel = FakeKernel {
            nexthops: true,
            ..FakeKernel::default()
        };
        let mut rec = reconciler_with(config(), kernel, &[("a", 1), ("b", 2)]);
        rec.reconcile().await.unwrap();
        let dst: ipnet::IpNet = "10.1.1.0/24".parse().unwrap();
        rec.kernel().touched_during_dumps = vec![vec![dst]];
        rec.on_event(SourceEvent::Apply(raw(
            "a",
            &["10.0.0.11"],
            &["10.1.1.0/24"],
        )));
        let out = rec.reconcile().await.unwrap();
        assert_eq!(
            rec.kernel().dumps,
            3,
            "dumped again once the first was in doubt"
        );
        assert!(
            out.plan
                .ops()
                .iter()
                .any(|op| matches!(op, Op::Replace(KernelObject::Route(r)) if r.dst == dst)),
            "{:?}",
            out.plan.ops()
        );

        rec.kernel().touched_during_dumps = vec![vec![dst]; 3];
        rec.on_event(SourceEvent::Apply(raw(
            "a",
            &["10.0.0.21"],
            &["10.1.1.0/24"],
        )));
        rec.on_event(SourceEvent::Apply(raw(
            "c",
            &["10.0.0.3"],
            &["10.1.3.0/24"],
        )));
        let before = rec.kernel().applied.len();
        let out = rec.reconcile().await.unwrap();
        assert_eq!(rec.kernel().dumps, 6, "one dump and two more, then no more");
        let contested = out
            .failed
            .iter()
            .filter(|f| matches!(f.result, Err(crate::kernel::OpError::RouteContested(at)) if at == dst))
            .count();
        assert_eq!(contested, 1, "{:?}", out.failed);
        assert!(
            !rec.kernel().applied[before..].iter().any(
                |op| matches!(op, Op::Replace(KernelObject::Route(r)) if r.dst == dst)
                    || matches!(op, Op::Delete(KernelObject::Nexthop(_)))
            ),
            "neither the route nor the nexthop it may still use is touched"
        );
        let routed =
            rec.kernel().ours.keys().any(
                |k| matches!(k, ObjectId::Route { dst, .. } if dst.to_string() == "10.1.3.0/24"),
            );
        assert!(routed, "the rest of the plan went ahead");
    }
}
