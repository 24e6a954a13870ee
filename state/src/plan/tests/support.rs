//! Fixtures the planner's tests share: nodes, the configuration, the workspace's model kernel,
//! and a way to run the planner over them. Defined once here, so a
//! test beside any step builds its nodes the same way.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::{
    BrakeMemory, DeleteReason, InputProblem, LiveView, MalformedNode, Plan, PlanConfig, PlanInput,
    plan,
};
use crate::checkpoint::Checkpoint;
use crate::family::Family;
use crate::node::Node;
use crate::objects::{
    KernelObject, KeyTag, MapEntry, Nexthop, NexthopId, NodeId, ObjectId, Route, Via,
};
pub(crate) use crate::testing::{external, id, ip, net, node, with_id};

pub(crate) const NOW: Duration = Duration::from_secs(1_000_000);

pub(crate) fn local() -> Node {
    node("local", &["10.0.0.100", "fd00::100"], &["10.1.100.0/24"])
}

pub(crate) fn cfg() -> PlanConfig {
    PlanConfig {
        local_node: "local".into(),
        local_addresses: vec![ip("10.0.0.100"), ip("fd00::100")],
        local_pod_cidrs: local().pod_cidrs.to_vec(),
        agent_version: "test".into(),
        // The rules below are about nodes, not how routes reach them: their routes carry their
        // gateways, and the nexthop rules have a section of their own.
        route_nexthops: false,
        ..PlanConfig::default()
    }
}

/// The key tag of the tests' one IPsec key.
pub(crate) const TAG: KeyTag = KeyTag(0x1111);

pub(crate) fn map(a: &str, v: u16) -> KernelObject {
    KernelObject::MapEntry(MapEntry {
        ip: ip(a),
        node_id: id(v),
        spi: 0,
    })
}
pub(crate) fn route(dst: &str, gw: &str) -> KernelObject {
    let dst = net(dst);
    KernelObject::Route(Route {
        dst,
        via: Via::Gateway(ip(gw)),
        metric: Route::default_metric(&dst),
    })
}

/// The model kernel the planner's tests apply plans to (strictly: [`Kernel::apply`] panics on
/// an operation a sound plan would not make).
pub(crate) use crate::testing::ModelKernel as Kernel;

/// How a test runs the planner: the config, and what the live view looks like besides the
/// nodes it lists.
pub(crate) struct Run {
    pub(crate) cfg: PlanConfig,
    pub(crate) synced: bool,
    /// Whether the live view lists the local node (every real list does).
    pub(crate) with_local: bool,
    pub(crate) malformed: Vec<MalformedNode>,
    pub(crate) relists: u64,
    pub(crate) brake: BrakeMemory,
    pub(crate) now: Duration,
}

impl Run {
    pub(crate) fn new() -> Self {
        Self {
            cfg: cfg(),
            synced: true,
            with_local: true,
            malformed: Vec::new(),
            relists: 1,
            brake: BrakeMemory::default(),
            now: NOW,
        }
    }
    pub(crate) fn view(&self, live: &[Node]) -> LiveView {
        let mut nodes = live.to_vec();
        if self.with_local {
            nodes.push(local());
        }
        LiveView {
            nodes: nodes.into_iter().map(Arc::new).collect(),
            malformed: self.malformed.clone(),
            synced: self.synced,
            relists: self.relists,
        }
    }
    pub(crate) fn plan(&self, record: Option<&Checkpoint>, live: &[Node], kernel: &Kernel) -> Plan {
        let view = self.view(live);
        let inventory = kernel.inventory();
        let allocator = record.map(|c| c.ids.clone()).unwrap_or_default();
        plan(&PlanInput {
            record,
            live: &view,
            inventory: &inventory,
            allocator: &allocator,
            brake: &self.brake,
            confirmed_hold: None,
            now: self.now,
            config: &self.cfg,
        })
    }
    /// Plans, applies every op, and returns the checkpoint to write.
    pub(crate) fn reconcile(
        &self,
        record: Option<&Checkpoint>,
        live: &[Node],
        kernel: &mut Kernel,
    ) -> (Plan, Checkpoint) {
        let p = self.plan(record, live, kernel);
        kernel.apply(&p.ops());
        let cp = p.checkpoint_after(&[]);
        (p, cp)
    }
}

pub(crate) fn deleted(p: &Plan) -> Vec<(ObjectId, DeleteReason)> {
    let mut d: Vec<_> = p
        .deletes
        .iter()
        .map(|d| (d.object.id(), d.reason))
        .collect();
    d.sort();
    d
}

pub(crate) fn problems(p: &Plan) -> Vec<(&str, &InputProblem)> {
    p.errors
        .iter()
        .map(|e| (e.node.as_str(), &e.problem))
        .collect()
}

pub(crate) fn ids_of(cp: &Checkpoint) -> BTreeMap<String, u16> {
    cp.nodes
        .iter()
        .map(|n| (n.name.clone(), n.node_id.map_or(0, NodeId::get)))
        .collect()
}

pub(crate) fn a() -> Node {
    node("a", &["10.0.0.1"], &["10.1.1.0/24"])
}
pub(crate) fn b() -> Node {
    node("b", &["10.0.0.2"], &["10.1.2.0/24"])
}
pub(crate) fn c() -> Node {
    node("c", &["10.0.0.3"], &["10.1.3.0/24"])
}
pub(crate) fn d() -> Node {
    node("d", &["10.0.0.4"], &["10.1.4.0/24"])
}

/// Routes through nexthop objects, the daemon's default where the kernel has them.
pub(crate) fn with_nexthops() -> Run {
    let mut r = Run::new();
    r.cfg.route_nexthops = true;
    r
}
pub(crate) fn nh(node: u16, gw: &str) -> KernelObject {
    KernelObject::Nexthop(Nexthop {
        node_id: id(node),
        gateway: ip(gw),
        second: false,
    })
}
pub(crate) fn nh_id(node: u16, family: Family) -> NexthopId {
    NexthopId::of(id(node), family)
}
pub(crate) fn nh_route(dst: &str, node: u16) -> KernelObject {
    let dst = net(dst);
    KernelObject::Route(Route {
        dst,
        via: Via::Nexthop(nh_id(node, Family::of_net(&dst))),
        metric: Route::default_metric(&dst),
    })
}
