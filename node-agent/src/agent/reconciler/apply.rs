//! Applying a plan to the kernel, in phases.
//!
//! Deletes go first (users before what they use), so map room and identities are free before
//! anything new takes them. Then the datapath's entries (the node-ID map's and, with IPsec, the
//! pod-CIDR map's) and the guards. Then every other object, but only of nodes whose entries all
//! went in: a node the datapath cannot identify, or whose traffic it cannot mark for
//! encryption, gets no route or xfrm object either (invariant 17), so its pod traffic is never
//! routed in the clear. Nexthops go in before the routes through them, and a route whose nexthop
//! failed is not written. Last, the deletes that must wait until no route of ours uses what they
//! delete ([`state::objects::ObjectKind::deleted_last`]: a nexthop, and an IPsec mark, whose
//! route without it would carry pod traffic in the clear); one waits for the next reconcile when
//! a route operation that failed or was not tried leaves a route that may still use it: through
//! that nexthop in the view the plan was made from, or at that mark's CIDR. A failing route
//! elsewhere holds back nothing else (it held back every such delete of the cluster, for as long
//! as one node's nexthop could not be made).
//!
//! [`apply_plan`] runs the phases; [`Reconciler::apply`] is the reconcile's step around it,
//! which keeps the view, counts and logs each operation.

use std::collections::{BTreeSet, HashMap, HashSet};

use ipnet::IpNet;
use state::objects::{KernelObject, NexthopId, ObjectId, ObjectKind, Op, XfrmDir};
use state::plan::{DeleteReason, Plan};

use super::Reconciler;
use super::view::Seen;
use crate::agent::AgentError;
use crate::agent::drift::Found;
use crate::kernel::Kernel;
use crate::kernel::OpError;
use crate::telemetry::Telemetry;
use crate::telemetry::reconcile::RECONCILER;

/// One operation and what became of it.
#[derive(Debug)]
pub struct OpResult {
    pub op: Op,
    /// The node it was for; `None` for orphans.
    pub node: Option<String>,
    pub result: Result<(), OpError>,
}

/// What the apply step did.
pub(super) struct Applied {
    /// Kernel mutations performed.
    pub writes: usize,
    /// Operations that failed or were not tried.
    pub failed: Vec<OpResult>,
}

impl<K: Kernel> Reconciler<K> {
    /// Removes the invalid node-ID map entries a dump of a synced view found (`dumped`), before
    /// the plan's operations.
    pub(super) async fn purge_junk(&mut self, dumped: bool) -> Result<(), AgentError> {
        if dumped && self.live.synced() {
            let purged = self.kernel.purge_junk().await?;
            self.totals.writes += purged;
        }
        Ok(())
    }

    /// Applies `plan` ([`apply_plan`]), keeping `seen`'s inventory what the kernel holds after
    /// each operation; counts each, and logs each delete (with its reason), each repair of what
    /// had drifted, and each failure.
    pub(super) async fn apply(
        &mut self,
        plan: &Plan,
        seen: &mut Seen,
        contested: &[IpNet],
    ) -> Applied {
        let reasons: HashMap<ObjectId, DeleteReason> = plan
            .deletes
            .iter()
            .map(|d| (d.object.id(), d.reason))
            .collect();
        let Seen {
            inventory, drift, ..
        } = seen;
        inventory.reserve(plan.upserts.iter().filter(|u| !u.update).count());
        let telemetry = &self.telemetry;
        let mut writes = 0;
        let mut failed = Vec::new();
        let routes = routes_now(plan, inventory);
        apply_plan(
            &mut self.kernel,
            plan,
            &routes,
            contested,
            |op, node, result| {
                telemetry.count_op(&op, result.is_ok());
                match result {
                    Ok(()) => {
                        writes += 1;
                        match &op {
                            Op::Delete(o) => {
                                let reason = reasons.get(&o.id()).map_or("", |r| r.as_str());
                                let node = node.unwrap_or("-");
                                tracing::info!(target: RECONCILER, node, reason, "deleted {o}");
                            }
                            Op::Create(o) | Op::Replace(o) => {
                                if let Some(found) = drift.at(&o.id()) {
                                    repaired(telemetry, node, o, found);
                                }
                            }
                        }
                        inventory.apply(&op);
                    }
                    Err(e) => {
                        tracing::error!(target: RECONCILER, node = node.unwrap_or("-"), "{e}");
                        failed.push(OpResult {
                            op,
                            node: node.map(str::to_owned),
                            result: Err(e),
                        });
                    }
                }
            },
        )
        .await;
        Applied { writes, failed }
    }
}

/// Counts and logs the repair of an object that drifted.
fn repaired(telemetry: &Telemetry, node: Option<&str>, o: &KernelObject, found: &Found) {
    telemetry.count_repair(o.kind());
    let node = node.unwrap_or("-");
    match found {
        Found::Missing if matches!(o, KernelObject::XfrmState(x) if x.dir == XfrmDir::Out) => {
            tracing::error!(
                target: RECONCILER,
                node,
                "repaired drift: {o} had gone from the kernel; written back with the same \
                 key, so its sequence numbers start over: the peer's anti-replay window \
                 drops its packets (and GCM nonces repeat) until the IPsec key is rotated; \
                 rotate it (docs/ipsec.md)"
            );
        }
        Found::Missing => {
            tracing::warn!(
                target: RECONCILER,
                node,
                "repaired drift: {o} had gone from the kernel; written back"
            );
        }
        Found::Changed(was) => {
            tracing::warn!(
                target: RECONCILER,
                node,
                "repaired drift: found {was}, written back as {o}"
            );
        }
    }
}

/// One phase's operations with their nodes, and what became of each, in the order they ran.
type Ran<'p> = Vec<(Op, Option<&'p str>, Result<(), OpError>)>;

/// Operations of nodes, waiting for their phase.
type Ops<'p> = Vec<(Op, &'p str)>;

/// Applies `ops` through the kernel, pairing each result with its op and node. The ops are
/// moved, never copied: at 65,000 nodes a phase holds a quarter of a million of them.
async fn run<'p, K: Kernel>(kernel: &mut K, ops: Vec<(Op, Option<&'p str>)>) -> Ran<'p> {
    if ops.is_empty() {
        return Vec::new();
    }
    let (ops, nodes): (Vec<Op>, Vec<Option<&str>>) = ops.into_iter().unzip();
    let results = kernel.apply(&ops).await;
    ops.into_iter()
        .zip(nodes)
        .zip(results)
        .map(|((op, node), result)| (op, node, result))
        .collect()
}

/// The routes of `ran` whose operation failed.
fn failed_routes<'a>(ran: &'a Ran<'_>) -> impl Iterator<Item = &'a Op> {
    ran.iter()
        .filter(|(op, _, r)| r.is_err() && op.object().kind() == ObjectKind::Route)
        .map(|(op, _, _)| op)
}

/// The nexthop each route the plan touches goes through in the view it was made from: where a
/// route whose operation fails still goes.
pub type RoutesNow = HashMap<ObjectId, ObjectId>;

/// [`RoutesNow`] of `plan`, from `view`.
pub fn routes_now(plan: &Plan, view: &state::inventory::Inventory) -> RoutesNow {
    let touched = plan
        .deletes
        .iter()
        .map(|d| &d.object)
        .chain(plan.upserts.iter().map(|u| &u.object))
        .filter(|o| o.kind() == ObjectKind::Route);
    touched
        .filter_map(|o| {
            let id = o.id();
            let via = view.get(&id)?.uses()?;
            Some((id, via))
        })
        .collect()
}

/// What routes that may still be there keep: the nexthops they go through and their CIDRs.
#[derive(Default)]
struct StillRouted {
    nexthops: HashSet<ObjectId>,
    cidrs: HashSet<IpNet>,
}

impl StillRouted {
    fn add(&mut self, route: &Op, now: &RoutesNow) {
        let o = route.object();
        self.nexthops.extend(now.get(&o.id()).cloned());
        if let KernelObject::Route(r) = o {
            self.cidrs.insert(r.dst);
        }
    }

    /// Whether late delete `op` must wait.
    fn keeps(&self, op: &Op) -> bool {
        match op.object() {
            KernelObject::PodCidrEntry(e) => self.cidrs.contains(&e.cidr),
            o => self.nexthops.contains(&o.id()),
        }
    }
}

/// Applies every operation of `plan`, handing each to `each` with its node and result as soon
/// as its phase is over, phase by phase in the order they ran, then the operations that were
/// not tried (with why). Nothing holds the whole plan's operations and results at once.
///
/// | phase | runs | does not try |
/// |---|---|---|
/// | `deletes` | the deletes, users before what they use | |
/// | `not_contested` | | replaces of routes at `contested` destinations (someone else keeps changing a route there): failed route operations |
/// | `entries` | the datapath's entries and the guards | every other operation of a node whose entry failed |
/// | `nexthops` | the nexthops | the routes through one that failed |
/// | `routed_through_ours` | | routes through a nexthop this plan did not write that is not ours now |
/// | `rest` | routes and xfrm objects | |
/// | `late_deletes` | nexthops and marks no route of ours may still use | those one may still use: left for the next reconcile |
pub async fn apply_plan<'p, K: Kernel>(
    kernel: &mut K,
    plan: &'p Plan,
    routes: &RoutesNow,
    contested: &[IpNet],
    each: impl FnMut(Op, Option<&'p str>, Result<(), OpError>),
) {
    let mut a = Applying {
        kernel,
        routes,
        still: StillRouted::default(),
        skipped: Vec::new(),
        each,
    };
    a.deletes(plan.delete_ops()).await;
    let (entries, rest): (Ops<'p>, Ops<'p>) = plan.upsert_ops().into_iter().partition(|(op, _)| {
        let kind = op.object().kind();
        kind.is_datapath_entry() || kind == ObjectKind::XfrmGuard
    });
    let rest = a.not_contested(rest, contested);
    let rest = a.entries(entries, rest).await;
    let (rest, written) = a.nexthops(rest).await;
    // Routes through a nexthop this plan did not write go through one the view showed as
    // ours: read back now, as someone may have put theirs at its ID since.
    let rest = routed_through_ours(&mut *a.kernel, rest, &written, &mut a.skipped).await;
    a.rest(rest).await;
    a.late_deletes(plan.late_delete_ops()).await;
    a.hand_over_skipped();
}

/// One apply under way: the phases' shared state.
struct Applying<'k, 'p, K, F> {
    kernel: &'k mut K,
    /// Where each route the plan touches goes in the view it was made from.
    routes: &'k RoutesNow,
    /// What the routes that failed or were not tried may still keep.
    still: StillRouted,
    /// Operations not tried, and why: handed over last.
    skipped: Vec<(Op, &'p str, OpError)>,
    /// Where each result goes.
    each: F,
}

impl<'p, K: Kernel, F: FnMut(Op, Option<&'p str>, Result<(), OpError>)> Applying<'_, 'p, K, F> {
    fn hand_over(&mut self, ran: Ran<'p>) {
        for (op, node, result) in ran {
            (self.each)(op, node, result);
        }
    }

    /// Routes whose operation failed in `ran` may still be there.
    fn still_routed(&mut self, ran: &Ran<'p>) {
        for op in failed_routes(ran) {
            self.still.add(op, self.routes);
        }
    }

    async fn deletes(&mut self, ops: Vec<(Op, Option<&'p str>)>) {
        let deleted = run(&mut *self.kernel, ops).await;
        self.still_routed(&deleted);
        self.hand_over(deleted);
    }

    /// `ops` without the replaces of routes at `contested` destinations, which are not tried.
    fn not_contested(&mut self, ops: Ops<'p>, contested: &[IpNet]) -> Ops<'p> {
        let (taken, rest): (Ops<'p>, Ops<'p>) = ops.into_iter().partition(|(op, _)| match op {
            Op::Replace(KernelObject::Route(r)) => contested.contains(&r.dst),
            _ => false,
        });
        self.skipped.extend(taken.into_iter().map(|(op, n)| {
            let dst = match op.object() {
                KernelObject::Route(r) => r.dst,
                _ => unreachable!("only route replaces are contested"),
            };
            (op, n, OpError::RouteContested(dst))
        }));
        rest
    }

    /// Runs `entries`; returns `rest` without the operations of nodes whose entry failed.
    async fn entries(&mut self, entries: Ops<'p>, rest: Ops<'p>) -> Ops<'p> {
        let entered = run(&mut *self.kernel, with_nodes(entries)).await;
        let unmapped: BTreeSet<&str> = entered
            .iter()
            .filter(|(_, _, r)| r.is_err())
            .filter_map(|(_, node, _)| *node)
            .collect();
        self.hand_over(entered);
        let (unmapped_ops, rest): (Ops<'p>, Ops<'p>) = rest
            .into_iter()
            .partition(|(_, node)| unmapped.contains(*node));
        self.skipped.extend(
            unmapped_ops
                .into_iter()
                .map(|(op, n)| (op, n, OpError::Skipped)),
        );
        rest
    }

    /// Runs the nexthops of `rest`; returns the rest without the routes through one that
    /// failed, and the nexthops written. Nexthops go before the routes through them: a route
    /// whose nexthop could not be written is not written either (the ID may be someone else's
    /// now, and the route would go their way).
    async fn nexthops(&mut self, rest: Ops<'p>) -> (Ops<'p>, HashSet<ObjectId>) {
        let (nexthops, rest): (Ops<'p>, Ops<'p>) = rest
            .into_iter()
            .partition(|(op, _)| op.object().kind() == ObjectKind::Nexthop);
        let written = run(&mut *self.kernel, with_nodes(nexthops)).await;
        let written_ok = written_ids(&written);
        let missing: HashSet<ObjectId> = written
            .iter()
            .filter(|(_, _, r)| r.is_err())
            .map(|(op, _, _)| op.object().id())
            .collect();
        self.hand_over(written);
        let (unrouted, rest): (Ops<'p>, Ops<'p>) = rest
            .into_iter()
            .partition(|(op, _)| op.object().uses().is_some_and(|u| missing.contains(&u)));
        self.skipped.extend(
            unrouted
                .into_iter()
                .map(|(op, n)| (op, n, OpError::NexthopMissing)),
        );
        (rest, written_ok)
    }

    async fn rest(&mut self, rest: Ops<'p>) {
        let ran = run(&mut *self.kernel, with_nodes(rest)).await;
        self.still_routed(&ran);
        self.hand_over(ran);
    }

    /// A nexthop goes only once every route of ours was moved off it or deleted: a route whose
    /// operation failed or was not tried may still use it, and the kernel would delete that
    /// route along. A mark goes only once its route is gone. Such deletes wait for the next
    /// reconcile.
    async fn late_deletes(&mut self, ops: Vec<(Op, Option<&'p str>)>) {
        for (op, _, _) in self
            .skipped
            .iter()
            .filter(|(op, _, _)| op.object().kind() == ObjectKind::Route)
        {
            self.still.add(op, self.routes);
        }
        let (waiting, late): (Vec<_>, Vec<_>) =
            ops.into_iter().partition(|(op, _)| self.still.keeps(op));
        let ran = run(&mut *self.kernel, late).await;
        self.hand_over(ran);
        self.hand_over(
            waiting
                .into_iter()
                .map(|(op, node)| (op, node, Err(OpError::RoutesUnsettled)))
                .collect(),
        );
    }

    fn hand_over_skipped(&mut self) {
        let skipped = std::mem::take(&mut self.skipped);
        self.hand_over(
            skipped
                .into_iter()
                .map(|(op, node, e)| (op, Some(node), Err(e)))
                .collect(),
        );
    }
}

/// The nexthops `written` wrote.
fn written_ids(written: &Ran<'_>) -> HashSet<ObjectId> {
    written
        .iter()
        .filter(|(_, _, r)| r.is_ok())
        .map(|(op, _, _)| op.object().id())
        .collect()
}

/// `ops` without the routes through a nexthop that is not in `written` and is not ours now
/// (read back in one batch): those go to `skipped`, with what is there instead.
async fn routed_through_ours<'p, K: Kernel>(
    kernel: &mut K,
    ops: Vec<(Op, &'p str)>,
    written: &HashSet<ObjectId>,
    skipped: &mut Vec<(Op, &'p str, OpError)>,
) -> Vec<(Op, &'p str)> {
    let through = |op: &Op| match op {
        Op::Delete(_) => None,
        _ => op.object().uses().filter(|u| !written.contains(u)),
    };
    let mut ids: Vec<NexthopId> = ops
        .iter()
        .filter_map(|(op, _)| match through(op)? {
            ObjectId::Nexthop { id } => Some(id),
            _ => None,
        })
        .collect();
    if ids.is_empty() {
        return ops;
    }
    ids.sort_unstable();
    ids.dedup();
    let answers = kernel.nexthops_ours(&ids).await;
    let not_ours: HashMap<ObjectId, OpError> = ids
        .into_iter()
        .zip(answers)
        .filter_map(|(id, r)| Some((ObjectId::Nexthop { id }, r.err()?)))
        .collect();
    let mut kept = Vec::with_capacity(ops.len());
    for (op, node) in ops {
        match through(&op).and_then(|u| not_ours.get(&u)) {
            Some(why) => {
                // One answer per nexthop, and an error per route through it.
                let why = match why {
                    OpError::NexthopMissing => OpError::NexthopMissing,
                    other => OpError::Kernel {
                        what: other.to_string(),
                        source: std::io::Error::from_raw_os_error(libc::EPERM),
                    },
                };
                skipped.push((op, node, why));
            }
            None => kept.push((op, node)),
        }
    }
    kept
}

fn with_nodes(ops: Vec<(Op, &str)>) -> Vec<(Op, Option<&str>)> {
    ops.into_iter().map(|(op, n)| (op, Some(n))).collect()
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;
    use std::time::Duration;

    use state::checkpoint::Checkpoint;
    use state::inventory::Inventory;
    use state::node::Family;
    use state::node::Node;
    use state::objects::{KernelObject, NexthopId, NodeId, ObjectId};
    use state::plan::{BrakeMemory, LiveView, PlanConfig, PlanInput, plan};
    use state::testing::node;

    use super::*;

    /// Every result of `apply_plan`, in the order it handed them over.
    async fn applied(k: &mut FakeKernel, p: &Plan) -> Vec<OpResult> {
        let mut out = Vec::new();
        let view: state::inventory::Inventory = k.ours.values().cloned().collect();
        apply_plan(k, p, &routes_now(p, &view), &[], |op, node, result| {
            out.push(OpResult {
                op,
                node: node.map(str::to_owned),
                result,
            })
        })
        .await;
        out
    }
    use crate::kernel::fake::FakeKernel;

    #[tokio::test(flavor = "current_thread")]
    async fn a_node_whose_map_entry_fails_gets_no_route() {
        let cfg = PlanConfig {
            local_node: "local".into(),
            ..PlanConfig::default()
        };
        let live = LiveView {
            nodes: vec![
                node("local", &["10.0.0.100"], &["10.1.100.0/24"]).into(),
                node("a", &["10.0.0.1"], &["10.1.1.0/24"]).into(),
                node("b", &["10.0.0.2"], &["10.1.2.0/24"]).into(),
            ],
            synced: true,
            ..LiveView::default()
        };
        let p = plan(&PlanInput {
            record: None,
            live: &live,
            inventory: &Inventory::new(),
            allocator: &Default::default(),
            brake: &BrakeMemory::default(),
            confirmed_hold: None,
            now: Duration::from_secs(1000),
            config: &cfg,
        });
        let mut k = FakeKernel::default();
        let a_ip: IpAddr = "10.0.0.1".parse().unwrap();
        k.faults.ids.push(ObjectId::MapEntry { ip: a_ip });
        let results = applied(&mut k, &p).await;
        let a: Vec<_> = results
            .iter()
            .filter(|r| r.node.as_deref() == Some("a"))
            .collect();
        assert_eq!(a.len(), 3, "map entry, nexthop, route");
        assert!(matches!(a[0].result, Err(OpError::Kernel { .. })));
        assert!(matches!(a[1].result, Err(OpError::Skipped)));
        assert!(matches!(a[2].result, Err(OpError::Skipped)));
        assert!(
            !k.applied
                .iter()
                .any(|op| op.object().kind() == ObjectKind::Route
                    && op.object().to_string().contains("10.1.1.0/24")),
            "no route for a: {:?}",
            k.applied
        );
        assert_eq!(k.ours.len(), 3, "b is programmed in full");
    }

    fn plan_for(nodes: Vec<Node>, k: &FakeKernel, record: Option<&Checkpoint>) -> Plan {
        let cfg = PlanConfig {
            local_node: "local".into(),
            ..PlanConfig::default()
        };
        plan_with(&cfg, nodes, k, record)
    }

    fn plan_with(
        cfg: &PlanConfig,
        nodes: Vec<Node>,
        k: &FakeKernel,
        record: Option<&Checkpoint>,
    ) -> Plan {
        let mut all = vec![node("local", &["10.0.0.100"], &["10.1.100.0/24"])];
        all.extend(nodes);
        let live = LiveView {
            nodes: all.into_iter().map(Into::into).collect(),
            synced: true,
            ..LiveView::default()
        };
        let inventory: Inventory = k.ours.values().cloned().collect();
        plan(&PlanInput {
            record,
            live: &live,
            inventory: &inventory,
            allocator: &record.map(|r| r.ids.clone()).unwrap_or_default(),
            brake: &BrakeMemory::default(),
            confirmed_hold: None,
            now: Duration::from_secs(1000),
            config: cfg,
        })
    }

    fn cluster() -> Vec<Node> {
        ["a", "b", "c", "d"]
            .iter()
            .enumerate()
            .map(|(i, n)| {
                node(
                    n,
                    &[&format!("10.0.0.{}", i + 1)],
                    &[&format!("10.1.{}.0/24", i + 1)],
                )
            })
            .collect()
    }

    fn nexthop(id: u16) -> ObjectId {
        ObjectId::Nexthop {
            id: NexthopId::of(NodeId::new(id).unwrap(), Family::V4),
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_old_nexthop_stays_while_a_route_may_still_go_through_it() {
        let mut k = FakeKernel::default();
        let first = plan_for(cluster(), &k, None);
        applied(&mut k, &first).await;
        let record = first.checkpoint_after(&[]);
        // `a` comes back under a new UID: a new ID, its route moves to a new nexthop.
        let mut nodes = cluster();
        nodes[0].uid = "uid-a-2".into();
        let second = plan_for(nodes, &k, Some(&record));
        assert_eq!(second.late_delete_ops().len(), 1, "a's old nexthop");
        k.faults.kinds = vec![ObjectKind::Route];
        let results = applied(&mut k, &second).await;
        let late = results
            .iter()
            .find(|r| r.op.object().id() == nexthop(1))
            .expect("the old nexthop's delete is reported");
        assert!(
            matches!(late.result, Err(OpError::RoutesUnsettled)),
            "{late:?}"
        );
        assert!(k.ours.contains_key(&nexthop(1)), "not deleted");
        let route = ObjectId::Route {
            dst: "10.1.1.0/24".parse().unwrap(),
            metric: 0,
        };
        assert!(
            k.ours.contains_key(&route),
            "a's route is still there, through its nexthop"
        );
    }

    /// A route that cannot be written holds back only what it may still use: one node whose
    /// nexthop cannot be made (a gateway on no connected prefix, failing at every reconcile)
    /// held back every nexthop delete of the cluster, so removed nodes stayed pending for good.
    #[tokio::test(flavor = "current_thread")]
    async fn a_failing_route_holds_back_only_the_nexthop_it_may_use() {
        let mut k = FakeKernel::default();
        let first = plan_for(cluster(), &k, None);
        applied(&mut k, &first).await;
        let record = first.checkpoint_after(&[]);
        // b is gone; a newcomer e's nexthop cannot be made, so its route is not tried.
        let mut nodes = cluster();
        nodes.remove(1);
        nodes.push(node("e", &["10.0.0.5"], &["10.1.5.0/24"]));
        let second = plan_for(nodes, &k, Some(&record));
        let e_nexthop = second
            .upserts
            .iter()
            .find(|u| u.node == "e" && u.object.kind() == ObjectKind::Nexthop)
            .map(|u| u.object.id())
            .expect("e's nexthop");
        k.faults.ids.push(e_nexthop);
        let results = applied(&mut k, &second).await;
        let b_nexthop = results
            .iter()
            .find(|r| r.op.object().id() == nexthop(2))
            .expect("b's nexthop delete is reported");
        assert!(b_nexthop.result.is_ok(), "{b_nexthop:?}");
        assert!(!k.ours.contains_key(&nexthop(2)));
    }

    /// A removed node's IPsec mark goes only after its route: a route whose delete failed
    /// and that lost its mark carried pod traffic in the clear; with the mark, the block guard
    /// drops it.
    #[tokio::test(flavor = "current_thread")]
    async fn a_mark_stays_while_its_route_may_still_be_there() {
        let cfg = PlanConfig {
            local_node: "local".into(),
            local_addresses: vec!["10.0.0.100".parse().unwrap()],
            local_pod_cidrs: vec!["10.1.100.0/24".parse().unwrap()],
            ipsec: Some(state::plan::IpsecConfig::single(
                3,
                state::objects::KeyTag(1),
            )),
            ..PlanConfig::default()
        };
        let mut k = FakeKernel::default();
        let first = plan_with(&cfg, cluster(), &k, None);
        applied(&mut k, &first).await;
        let record = first.checkpoint_after(&[]);
        let mark = ObjectId::PodCidrEntry {
            cidr: "10.1.1.0/24".parse().unwrap(),
        };
        assert!(k.ours.contains_key(&mark));
        // `a` is gone; its route's delete fails.
        let second = plan_with(&cfg, cluster()[1..].to_vec(), &k, Some(&record));
        k.faults.kinds = vec![ObjectKind::Route];
        let results = applied(&mut k, &second).await;
        let held = results
            .iter()
            .find(|r| r.op.object().id() == mark)
            .expect("the mark's delete is reported");
        assert!(
            matches!(held.result, Err(OpError::RoutesUnsettled)),
            "{held:?}"
        );
        assert!(k.ours.contains_key(&mark), "the mark stays");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_route_whose_nexthop_could_not_be_written_is_not_written() {
        let mut k = FakeKernel::default();
        k.foreign
            .insert(nexthop(1), "nexthop 201400001 proto static".into());
        // The nexthop appeared after the plan was made: the plan does not know it is taken.
        let p = plan_for(cluster(), &FakeKernel::default(), None);
        let results = applied(&mut k, &p).await;
        let of_a: Vec<_> = results
            .iter()
            .filter(|r| r.node.as_deref() == Some("a"))
            .collect();
        assert!(matches!(
            of_a.iter()
                .find(|r| r.op.object().id() == nexthop(1))
                .unwrap()
                .result,
            Err(OpError::Occupied { .. })
        ));
        let route = of_a
            .iter()
            .find(|r| matches!(r.op.object(), KernelObject::Route(_)))
            .unwrap();
        assert!(
            matches!(route.result, Err(OpError::NexthopMissing)),
            "{route:?}"
        );
        assert!(!k.ours.values().any(|o| o.uses() == Some(nexthop(1))));
    }
}

/// The phases as a reconcile runs them, with the view it keeps.
#[cfg(test)]
mod through_the_reconciler {
    use state::objects::{KernelObject, ObjectId, ObjectKind};

    use super::super::testing::*;
    use crate::source::SourceEvent;

    #[tokio::test(flavor = "current_thread")]
    async fn drift_is_repaired_counted_and_foreign_objects_are_not_repaired() {
        let mut rec = reconciler(&[("a", 1), ("b", 2)]);
        rec.reconcile().await.unwrap();
        let k = rec.kernel();
        let route_a = k
            .ours
            .values()
            .find(|o| o.kind() == ObjectKind::Route && o.to_string().contains("10.1.1.0/24"))
            .cloned()
            .unwrap();
        let entry_b = k
            .ours
            .values()
            .find(|o| matches!(o, KernelObject::MapEntry(e) if e.ip.to_string() == "10.0.0.2"))
            .cloned()
            .unwrap();
        // Someone deletes a's route and rewrites b's entry; someone else's route takes the place
        // of... nothing of ours: it stands beside them.
        k.ours.remove(&route_a.id());
        if let KernelObject::MapEntry(mut e) = entry_b.clone() {
            e.node_id = state::objects::NodeId::new(999).unwrap();
            k.ours.insert(entry_b.id(), KernelObject::MapEntry(e));
        }
        let o = rec.reconcile().await.unwrap();
        assert_eq!(o.writes, 2);
        assert!(rec.kernel().ours.contains_key(&route_a.id()));
        assert_eq!(rec.kernel().ours[&entry_b.id()], entry_b);
        assert_eq!(
            metric(&rec, "node_agent_drift_repaired_total{kind=\"route\"}"),
            Some(1.0)
        );
        assert_eq!(
            metric(&rec, "node_agent_drift_repaired_total{kind=\"map_entry\"}"),
            Some(1.0)
        );
        // A foreign route replaces ours: reported, never "repaired".
        let k = rec.kernel();
        k.ours.remove(&route_a.id());
        k.foreign.insert(
            route_a.id(),
            "route 10.1.1.0/24 metric 0 proto static".into(),
        );
        let o = rec.reconcile().await.unwrap();
        assert_eq!(o.writes, 0);
        assert!(o.plan.errors.iter().any(|e| e.problem.is_conflict()));
        assert_eq!(
            metric(&rec, "node_agent_drift_repaired_total{kind=\"route\"}"),
            Some(1.0)
        );
    }

    /// A route through a nexthop the plan did not write goes only through one that is ours
    /// now: someone may have put theirs at its ID since the view was read, and the kernel
    /// routes by ID alone.
    #[tokio::test(flavor = "current_thread")]
    async fn a_route_never_goes_through_a_nexthop_someone_took_since_the_view() {
        let kernel = FakeKernel {
            nexthops: true,
            ..FakeKernel::default()
        };
        let mut rec = reconciler_with(config(), kernel, &[("a", 1), ("b", 2)]);
        rec.reconcile().await.unwrap();
        let taken = ObjectId::Nexthop {
            id: state::objects::NexthopId(201_400_001),
        };
        assert!(rec.kernel().ours.remove(&taken).is_some());
        rec.kernel()
            .foreign
            .insert(taken.clone(), "nexthop 201400001 proto static".into());
        // a's pod CIDR moves: a new route through its nexthop, which the view holds as ours.
        rec.on_event(SourceEvent::Apply(raw(
            "a",
            &["10.0.0.1"],
            &["10.1.9.0/24"],
        )));
        let out = rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().dumps, 1, "planned from the last view");
        assert!(
            matches!(&out.failed[..], [f] if f.op.object().to_string().contains("10.1.9.0/24")
                && f.result.as_ref().is_err_and(|e| e.to_string().contains("proto static"))),
            "{:?}",
            out.failed
        );
        let routed =
            rec.kernel().ours.keys().any(
                |k| matches!(k, ObjectId::Route { dst, .. } if dst.to_string() == "10.1.9.0/24"),
            );
        assert!(!routed, "no route through their nexthop");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_event_plan_never_deletes_a_nexthop_a_route_came_to_use_since_the_last_dump() {
        let kernel = FakeKernel {
            nexthops: true,
            ..FakeKernel::default()
        };
        let nodes = [("n1", 1), ("n2", 2), ("n3", 3), ("n4", 4)];
        let mut rec = reconciler_with(config(), kernel, &nodes);
        rec.reconcile().await.unwrap();
        assert_eq!(count(&mut rec, ObjectKind::Nexthop), 4);
        rec.on_event(SourceEvent::Delete("n4".into()));
        rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().dumps, 1, "a removal needs no dump");
        assert_eq!(count(&mut rec, ObjectKind::Nexthop), 3);
        // A foreign route came to use n1's nexthop since the last dump.
        let n1 = ObjectId::Nexthop {
            id: state::objects::NexthopId(201_400_001),
        };
        rec.kernel()
            .used_by
            .insert(n1.clone(), "route 192.168.7.0/24 table 100".into());
        rec.on_event(SourceEvent::Delete("n1".into()));
        let out = rec.reconcile_event().await.unwrap();
        assert!(
            matches!(&out.failed[..], [f] if matches!(f.result, Err(crate::kernel::OpError::InUse { .. }))),
            "{:?}",
            out.failed
        );
        assert!(
            rec.kernel().ours.contains_key(&n1),
            "kept for the route that uses it"
        );
        // The failure makes the next reconcile dump, see the user and report it.
        let out = rec.reconcile_event().await.unwrap();
        assert_eq!(rec.kernel().dumps, 2);
        assert!(rec.kernel().ours.contains_key(&n1));
        assert!(
            out.plan.errors.iter().any(|e| e.node == "n1"),
            "{:?}",
            out.plan.errors
        );
    }
}
