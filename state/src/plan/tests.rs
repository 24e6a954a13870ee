//! One scenario per rule of the planner, in the order of `docs/design.md`.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;

use super::*;
use crate::ids::{AllocatorState, FreedId, IdError};
use crate::inventory::Inventory;
use crate::node::{AddressKind, NodeAddress};
use crate::objects::{
    KernelObject, KeyTag, MapEntry, Nexthop, NexthopId, ObjectKind, Route, Via, XfrmDir, XfrmState,
};

const NOW: Duration = Duration::from_secs(1_000_000);

fn id(v: u16) -> NodeId {
    NodeId::new(v).unwrap()
}
fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}
fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

/// A node with InternalIPs and pod CIDRs.
fn node(name: &str, ips: &[&str], cidrs: &[&str]) -> Node {
    Node {
        name: name.into(),
        uid: format!("uid-{name}").into(),
        addresses: ips
            .iter()
            .map(|s| NodeAddress {
                kind: AddressKind::InternalIP,
                ip: ip(s),
            })
            .collect(),
        pod_cidrs: cidrs.iter().map(|s| net(s)).collect(),
        boot_id: Default::default(),
        node_id: None,
    }
}

fn with_id(mut n: Node, v: u16) -> Node {
    n.node_id = Some(id(v));
    n
}

fn external(mut n: Node, addr: &str) -> Node {
    n.addresses.push(NodeAddress {
        kind: AddressKind::ExternalIP,
        ip: ip(addr),
    });
    n
}

fn local() -> Node {
    node("local", &["10.0.0.100", "fd00::100"], &["10.1.100.0/24"])
}

fn cfg() -> PlanConfig {
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

fn map(a: &str, v: u16) -> KernelObject {
    KernelObject::MapEntry(MapEntry {
        ip: ip(a),
        node_id: id(v),
        spi: 0,
    })
}
fn route(dst: &str, gw: &str) -> KernelObject {
    let dst = net(dst);
    KernelObject::Route(Route {
        dst,
        via: Via::Gateway(ip(gw)),
        metric: Route::default_metric(&dst),
    })
}

/// The model kernel: our objects by identity, foreign objects by identity, ops applied as a
/// backend would (a create onto a foreign object fails).
#[derive(Clone, Debug, Default)]
struct Kernel {
    ours: BTreeMap<ObjectId, KernelObject>,
    foreign: BTreeMap<ObjectId, String>,
    /// Our objects that foreign ones use.
    used_by: BTreeMap<ObjectId, String>,
}

impl Kernel {
    fn apply(&mut self, ops: &[Op]) {
        for op in ops {
            match op {
                Op::Create(o) => {
                    assert!(
                        !self.foreign.contains_key(&o.id()) && !self.ours.contains_key(&o.id()),
                        "create onto an occupied identity: {o}"
                    );
                    self.ours.insert(o.id(), o.clone());
                }
                Op::Replace(o) => {
                    assert!(self.ours.contains_key(&o.id()), "replace of nothing: {o}");
                    self.ours.insert(o.id(), o.clone());
                }
                Op::Delete(o) => {
                    assert!(
                        self.ours.remove(&o.id()).is_some(),
                        "delete of something not ours: {o}"
                    );
                    // The kernel deletes the routes through a nexthop with it.
                    let users: Vec<&KernelObject> = self
                        .ours
                        .values()
                        .filter(|u| u.uses() == Some(o.id()))
                        .collect();
                    assert!(users.is_empty(), "{o} deleted while {users:?} use it");
                }
            }
        }
    }
    fn put(&mut self, o: KernelObject) {
        self.ours.insert(o.id(), o);
    }
    fn inventory(&self) -> Inventory {
        let mut inv: Inventory = self.ours.values().cloned().collect();
        for (id, what) in &self.foreign {
            inv.occupy(id.clone(), what.clone());
        }
        for (id, what) in &self.used_by {
            inv.use_by_foreign(id.clone(), what.clone());
        }
        inv
    }
    fn has(&self, o: &KernelObject) -> bool {
        self.ours.get(&o.id()) == Some(o)
    }
    fn len(&self) -> usize {
        self.ours.len()
    }
}

/// How a test runs the planner: the config, and what the live view looks like besides the
/// nodes it lists.
struct Run {
    cfg: PlanConfig,
    synced: bool,
    /// Whether the live view lists the local node (every real list does).
    with_local: bool,
    malformed: Vec<MalformedNode>,
    relists: u64,
    brake: BrakeMemory,
    now: Duration,
}

impl Run {
    fn new() -> Self {
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
    fn view(&self, live: &[Node]) -> LiveView {
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
    fn plan(&self, record: Option<&Checkpoint>, live: &[Node], kernel: &Kernel) -> Plan {
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
    fn reconcile(
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

fn deleted(p: &Plan) -> Vec<(ObjectId, DeleteReason)> {
    let mut d: Vec<_> = p
        .deletes
        .iter()
        .map(|d| (d.object.id(), d.reason))
        .collect();
    d.sort();
    d
}

fn problems(p: &Plan) -> Vec<(&str, &InputProblem)> {
    p.errors
        .iter()
        .map(|e| (e.node.as_str(), &e.problem))
        .collect()
}

fn ids_of(cp: &Checkpoint) -> BTreeMap<String, u16> {
    cp.nodes
        .iter()
        .map(|n| (n.name.clone(), n.node_id.map_or(0, NodeId::get)))
        .collect()
}

fn a() -> Node {
    node("a", &["10.0.0.1"], &["10.1.1.0/24"])
}
fn b() -> Node {
    node("b", &["10.0.0.2"], &["10.1.2.0/24"])
}
fn c() -> Node {
    node("c", &["10.0.0.3"], &["10.1.3.0/24"])
}
fn d() -> Node {
    node("d", &["10.0.0.4"], &["10.1.4.0/24"])
}

// ---- The basics: programming, restarts, ownership by identity ----

#[test]
fn first_start_programs_map_entries_and_routes_with_fresh_ids() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (p, cp) = r.reconcile(None, &[b(), a()], &mut k);
    assert!(p.deletes.is_empty() && p.errors.is_empty());
    let allocated: Vec<(&str, u16)> = p
        .allocations
        .iter()
        .map(|a| (a.node.as_str(), a.id.get()))
        .collect();
    assert_eq!(allocated, [("a", 1), ("b", 2)]);
    assert!(k.has(&map("10.0.0.1", 1)));
    assert!(k.has(&route("10.1.2.0/24", "10.0.0.2")));
    assert_eq!(k.len(), 4);
    assert_eq!(cp.nodes, [with_id(a(), 1), with_id(b(), 2)]);
    assert!(
        p.ops().iter().all(|o| matches!(o, Op::Create(_))),
        "new objects are created exclusively"
    );
}

#[test]
fn unchanged_restart_plans_nothing() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    let p = r.plan(Some(&cp), &[a(), b()], &k);
    assert!(p.is_empty(), "{p:?}");
    assert!(p.ops().is_empty() && p.allocations.is_empty() && p.frees.is_empty());
    assert_eq!(p.checkpoint.nodes, cp.nodes);
}

#[test]
fn a_route_of_ours_with_another_metric_is_not_taken_for_the_one_desired() {
    // Our routes at a node's pod CIDR with a metric the agent does not write (an older
    // version's, or one changed by hand) are other objects: the route with the agent's metric
    // is kept or created, the odd one deleted.
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    let odd = |o: KernelObject| match o {
        KernelObject::Route(rt) => KernelObject::Route(Route { metric: 77, ..rt }),
        _ => unreachable!(),
    };
    // a has its route and an odd one beside it; b only an odd one.
    k.put(odd(route("10.1.1.0/24", "10.0.0.1")));
    k.ours.remove(&route("10.1.2.0/24", "10.0.0.2").id());
    k.put(odd(route("10.1.2.0/24", "10.0.0.2")));
    let p = r.plan(Some(&cp), &[a(), b()], &k);
    let upserts: Vec<Op> = p.upserts.iter().map(Upsert::op).collect();
    assert_eq!(upserts, [Op::Create(route("10.1.2.0/24", "10.0.0.2"))]);
    assert_eq!(
        deleted(&p),
        [
            (
                odd(route("10.1.1.0/24", "10.0.0.1")).id(),
                DeleteReason::Superseded
            ),
            (
                odd(route("10.1.2.0/24", "10.0.0.2")).id(),
                DeleteReason::Superseded
            ),
        ]
    );
    k.apply(&p.ops());
    assert!(k.has(&route("10.1.1.0/24", "10.0.0.1")) && k.has(&route("10.1.2.0/24", "10.0.0.2")));
    assert_eq!(k.len(), 4);
}

#[test]
fn stale_node_is_deleted_with_all_its_objects_and_never_re_added() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c()], &mut k);
    // An object only the inventory knows (not derivable from b's record) but carrying b's ID.
    let extra = KernelObject::XfrmState(XfrmState {
        src: ip("10.0.0.100"),
        dst: ip("10.9.9.9"),
        spi: 3,
        dir: XfrmDir::Out,
        node_id: id(2),
        key: KeyTag::default(),
    });
    k.put(extra.clone());
    let p = r.plan(Some(&cp), &[a(), c()], &k);
    let mut want = vec![
        (map("10.0.0.2", 2).id(), DeleteReason::StaleNode),
        (
            route("10.1.2.0/24", "10.0.0.2").id(),
            DeleteReason::StaleNode,
        ),
        (extra.id(), DeleteReason::StaleNode),
    ];
    want.sort();
    assert_eq!(deleted(&p), want);
    assert!(p.deletes.iter().all(|d| d.node.as_deref() == Some("b")));
    assert!(p.upserts.is_empty(), "no resurrection: {:?}", p.upserts);
    assert_eq!(p.frees, [id(2)]);
    assert_eq!(p.released_nodes, ["b"]);
    assert!(p.checkpoint.nodes.iter().all(|n| n.name != "b"));
    assert!(p.checkpoint.pending_deletes.is_empty());
    k.apply(&p.ops());
    assert!(r.plan(Some(&p.checkpoint), &[a(), c()], &k).is_empty());
}

#[test]
fn only_objects_the_kernel_shows_as_ours_are_ever_deleted() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c()], &mut k);
    // b's route is gone from our inventory (someone removed it, or replaced it with theirs):
    // the record alone never makes a delete.
    k.ours.remove(&route("10.1.2.0/24", "10.0.0.2").id());
    k.foreign.insert(
        route("10.1.2.0/24", "10.0.0.2").id(),
        "route 10.1.2.0/24 proto static".into(),
    );
    let p = r.plan(Some(&cp), &[a(), c()], &k);
    assert_eq!(
        deleted(&p),
        [(map("10.0.0.2", 2).id(), DeleteReason::StaleNode)]
    );
}

#[test]
fn ip_recycled_to_new_node_while_down_is_not_deleted() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c()], &mut k);
    // b is deleted while down and a new node e gets b's IP (but a new CIDR).
    let e = node("e", &["10.0.0.2"], &["10.1.5.0/24"]);
    let p = r.plan(Some(&cp), &[a(), c(), e.clone()], &k);
    // ID 2 is b's (the checkpoint says so), not the address's: e gets a fresh ID and the entry
    // is updated in place, so the dead node's ID is not handed out again without cool-down.
    assert_eq!(p.allocations.len(), 1);
    let e_id = p.allocations[0].id;
    assert_ne!(e_id, id(2));
    assert!(p.checkpoint.nodes.contains(&with_id(e.clone(), e_id.get())));
    assert!(
        p.upserts
            .iter()
            .any(|u| u.object == map("10.0.0.2", e_id.get()) && u.update)
    );
    assert_eq!(
        deleted(&p),
        [(
            route("10.1.2.0/24", "10.0.0.2").id(),
            DeleteReason::StaleNode
        )]
    );
    k.apply(&p.ops());
    assert!(k.has(&map("10.0.0.2", e_id.get())));
    assert!(k.has(&route("10.1.5.0/24", "10.0.0.2")));
}

#[test]
fn ip_recycled_without_a_checkpoint_keeps_the_map_id() {
    let r = Run::new();
    let mut k = Kernel::default();
    r.reconcile(None, &[a(), b(), c()], &mut k);
    // The checkpoint is lost: the map entry is all that says which ID the address had.
    let e = node("e", &["10.0.0.2"], &["10.1.5.0/24"]);
    let p = r.plan(None, &[a(), c(), e.clone()], &k);
    assert!(p.allocations.is_empty());
    assert!(p.checkpoint.nodes.contains(&with_id(e, 2)));
}

#[test]
fn ip_recycled_to_a_node_with_an_id_of_its_own_is_updated_not_deleted() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c()], &mut k);
    // While down, b is deleted and a readdressed onto b's old IP (keeping its v6 and map ID 1).
    let a2 = node("a", &["10.0.0.2", "fd00::1"], &["10.1.1.0/24"]);
    let mut k2 = k.clone();
    k2.put(map("fd00::1", 1));
    let mut cp2 = cp.clone();
    cp2.nodes[0] = with_id(node("a", &["10.0.0.1", "fd00::1"], &["10.1.1.0/24"]), 1);
    let p = r.plan(Some(&cp2), &[a2, c()], &k2);
    assert!(
        p.upserts
            .iter()
            .any(|u| u.object == map("10.0.0.2", 1) && u.update)
    );
    assert!(deleted(&p).contains(&(map("10.0.0.1", 1).id(), DeleteReason::ChangedWhileDown)));
    assert!(
        !deleted(&p)
            .iter()
            .any(|(oid, _)| *oid == map("10.0.0.2", 1).id())
    );
}

#[test]
fn node_renamed_keeping_its_ips_keeps_its_objects_under_a_fresh_id() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    let renamed = node("b-new", &["10.0.0.2"], &["10.1.2.0/24"]);
    let p = r.plan(Some(&cp), &[a(), renamed.clone()], &k);
    // A rename is a new Node object: it gets its own ID, and its objects are updated in place,
    // never deleted.
    assert!(p.deletes.is_empty(), "{:?}", p.deletes);
    assert_eq!(p.allocations.len(), 1);
    let new_id = p.allocations[0].id;
    assert!(
        p.upserts
            .iter()
            .all(|u| u.update || u.object.kind() != ObjectKind::MapEntry)
    );
    assert!(p.checkpoint.nodes.contains(&with_id(renamed, new_id.get())));
    assert_eq!(p.frees, [id(2)], "b's ID starts its cool-down");
}

#[test]
fn pod_cidr_reassigned_to_another_node_is_updated_not_deleted() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c()], &mut k);
    // b is gone; its CIDR now belongs to d.
    let d2 = node("d", &["10.0.0.4"], &["10.1.2.0/24"]);
    let p = r.plan(Some(&cp), &[a(), c(), d2], &k);
    assert!(
        p.upserts
            .iter()
            .any(|u| u.object == route("10.1.2.0/24", "10.0.0.4") && u.update)
    );
    assert_eq!(
        deleted(&p),
        [(map("10.0.0.2", 2).id(), DeleteReason::StaleNode)]
    );
}

#[test]
fn node_readdressed_while_down_gets_old_objects_removed_and_new_added() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    let b2 = node("b", &["10.0.0.22"], &["10.1.22.0/24"]);
    let p = r.plan(Some(&cp), &[a(), b2.clone()], &k);
    assert_eq!(
        deleted(&p),
        [
            (map("10.0.0.2", 2).id(), DeleteReason::ChangedWhileDown),
            (
                route("10.1.2.0/24", "10.0.0.2").id(),
                DeleteReason::ChangedWhileDown
            ),
        ]
    );
    k.apply(&p.ops());
    assert!(k.has(&map("10.0.0.22", 2)), "the record's ID carries over");
    assert!(k.has(&route("10.1.22.0/24", "10.0.0.22")));
    assert!(p.frees.is_empty());
}

#[test]
fn nothing_is_deleted_before_sync() {
    let mut r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    k.put(map("10.0.0.77", 77));
    r.synced = false;
    r.with_local = false;
    let b2 = node("b", &["10.0.0.22"], &["10.1.22.0/24"]);
    let p = r.plan(Some(&cp), &[b2], &k);
    assert!(p.deletes.is_empty() && p.brake.is_none() && p.frees.is_empty());
    assert_eq!(p.upserts.len(), 2, "adds for known live nodes are fine");
    // a, not seen yet, is carried over unchanged, and its ID is not reused.
    assert!(p.checkpoint.nodes.contains(&with_id(a(), 1)));
    assert!(p.allocations.is_empty());
}

#[test]
fn live_node_without_addresses_keeps_its_previous_objects() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    let registering = node("b", &[], &[]);
    let p = r.plan(Some(&cp), &[a(), registering], &k);
    assert!(p.is_empty(), "{p:?}");
    assert!(p.frees.is_empty());
    assert!(
        p.checkpoint.nodes.contains(&with_id(b(), 2)),
        "record kept for next time"
    );
    // And no other node gets its ID or its address meanwhile.
    let thief = node("c", &["10.0.0.2"], &["10.1.3.0/24"]);
    let p = r.plan(Some(&cp), &[a(), node("b", &[], &[]), thief, d()], &k);
    assert_eq!(p.allocations.len(), 1);
    assert_eq!(p.allocations[0].node, "d");
    assert_eq!(p.allocations[0].id, id(3));
    assert!(matches!(
        problems(&p)[..],
        [(
            "c",
            InputProblem::Conflict {
                why: ConflictWhy::Held,
                ..
            }
        )]
    ));
}

#[test]
fn orphans_are_swept_without_a_checkpoint() {
    let r = Run::new();
    let mut k = Kernel::default();
    r.reconcile(None, &[a(), b()], &mut k);
    k.put(map("10.0.0.9", 9));
    let p = r.plan(None, &[a(), b()], &k);
    assert_eq!(
        deleted(&p),
        [(map("10.0.0.9", 9).id(), DeleteReason::Orphan)]
    );
    assert!(
        p.upserts.is_empty(),
        "IDs restored from the map: {:?}",
        p.upserts
    );
    assert_eq!(p.frees, [id(9)]);
}

/// Without a record, the nodes the map carries are the known ones even when no map entry is an
/// orphan: a route nobody claims any more, swept just after a node's removal (in the window),
/// is one removal of several known nodes, not of none.
#[test]
fn without_a_record_the_map_tells_the_known_nodes_when_only_a_route_is_an_orphan() {
    let mut r = Run::new();
    let mut k = Kernel::default();
    r.reconcile(None, &[a(), b(), c(), d()], &mut k);
    r.brake.window.push(crate::checkpoint::RecentRemovals {
        at: NOW,
        nodes: 1,
        objects: 0,
    });
    k.put(route("10.1.77.0/24", "10.0.0.9"));
    let p = r.plan(None, &[a(), b(), c(), d()], &k);
    assert!(p.brake.is_none(), "{:?}", p.brake);
    assert_eq!(
        deleted(&p),
        [(route("10.1.77.0/24", "10.0.0.9").id(), DeleteReason::Orphan)]
    );
}

#[test]
fn failed_stale_delete_stays_pending_with_attempts_and_keeps_its_id() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c()], &mut k);
    let p = r.plan(Some(&cp), &[a(), c()], &k);
    let failed = [Op::Delete(route("10.1.2.0/24", "10.0.0.2"))];
    let next = p.checkpoint_after(&failed);
    assert_eq!(
        next.pending_deletes,
        [PendingDelete {
            node: with_id(b(), 2),
            attempts: 1,
            held: None,
        }]
    );
    assert!(next.ids.freed.is_empty());
    // Applied all but the failed op; after a restart it is retried, and counted again, but not
    // by the brake: its removal was released before.
    let ops: Vec<Op> = p.ops().into_iter().filter(|o| *o != failed[0]).collect();
    k.apply(&ops);
    let p2 = r.plan(Some(&next), &[a(), c()], &k);
    assert!(p2.brake.is_none());
    assert_eq!(
        deleted(&p2),
        [(
            route("10.1.2.0/24", "10.0.0.2").id(),
            DeleteReason::StaleNode
        )]
    );
    assert_eq!(p2.checkpoint_after(&failed).pending_deletes[0].attempts, 2);
    assert!(p2.checkpoint_after(&[]).pending_deletes.is_empty());
}

const TAG: KeyTag = KeyTag(0x1111);

/// A state exists only where a packet uses it: dual-stack hosts with IPv4 pods only get no
/// IPv6 states (nothing marks IPv6 traffic toward a pod), and a remote node without pod CIDRs
/// gets no OUT state while ours has pod CIDRs of the family to receive for.
#[test]
fn ipsec_states_exist_only_in_the_families_pod_traffic_uses() {
    let mut r = Run::new();
    r.cfg.ipsec = Some(IpsecConfig::single(3, TAG));
    let mut k = Kernel::default();
    let v4_pods = node("a", &["10.0.0.1", "fd00::1"], &["10.1.1.0/24"]);
    let no_pods = node("b", &["10.0.0.2", "fd00::2"], &[]);
    r.reconcile(None, &[v4_pods, no_pods], &mut k);
    let mut states: Vec<(NodeId, XfrmDir, bool)> = k
        .ours
        .values()
        .filter_map(|o| match o {
            KernelObject::XfrmState(s) => Some((s.node_id, s.dir, s.src.is_ipv4())),
            _ => None,
        })
        .collect();
    states.sort();
    assert_eq!(
        states,
        [
            (id(1), XfrmDir::Out, true),
            (id(1), XfrmDir::In, true),
            (id(2), XfrmDir::In, true),
        ]
    );
}

#[test]
fn ipsec_adds_states_both_ways_and_a_policy_per_cidr_for_each_shared_family() {
    let mut r = Run::new();
    r.cfg.ipsec = Some(IpsecConfig::single(3, TAG));
    r.cfg.local_addresses = vec![ip("10.0.0.100")];
    let mut k = Kernel::default();
    let dual = node(
        "a",
        &["10.0.0.1", "fd00::1"],
        &["10.1.1.0/24", "fd01:1::/64"],
    );
    let (p, cp) = r.reconcile(None, std::slice::from_ref(&dual), &mut k);
    let count = |kind| k.ours.values().filter(|o| o.kind() == kind).count();
    assert_eq!(count(ObjectKind::MapEntry), 2);
    // The IPv6 pod CIDR is not routed: with no local IPv6 endpoint, nothing would encrypt its
    // traffic (invariant 18). The local node has no IPv6 pods either: nothing to report.
    assert_eq!(count(ObjectKind::Route), 1);
    assert!(p.errors.is_empty(), "{:?}", p.errors);
    assert_eq!(count(ObjectKind::XfrmState), 2, "IPv4 only: no local IPv6");
    assert_eq!(count(ObjectKind::XfrmPolicy), 1);
    assert_eq!(
        count(ObjectKind::PodCidrEntry),
        1,
        "only the CIDR with policies is marked"
    );
    assert_eq!(count(ObjectKind::XfrmGuard), 2, "block and accept, IPv4");
    assert!(
        p.upserts
            .iter()
            .all(|u| u.object.node_id().is_none_or(|i| i == id(1)))
    );
    assert!(k.ours.values().any(|o| matches!(o,
            KernelObject::PodCidrEntry(e) if e.spi == 3 && e.cidr == net("10.1.1.0/24"))));
    let again = r.plan(Some(&cp), &[dual], &k);
    assert!(again.is_empty());
    assert_eq!(
        again.steady,
        Some(Vec::new()),
        "settled: events stay event-sized"
    );
}

/// With IPsec, a local node with pod CIDRs of a family it has no InternalIP in routes no remote
/// pod CIDR of that family, and says so once, for itself: a problem per remote node made the
/// plan unsettled by every one of them (each event a full plan at 65,000 nodes).
#[test]
fn a_family_the_local_node_cannot_encrypt_in_is_reported_once() {
    let mut r = Run::new();
    r.cfg.ipsec = Some(IpsecConfig::single(3, TAG));
    r.cfg.local_addresses = vec![ip("10.0.0.100")];
    r.with_local = false;
    let local = node("local", &["10.0.0.100"], &["10.1.100.0/24", "fd01:64::/64"]);
    let dual = |n: &str, i: u8| {
        node(
            n,
            &[&format!("10.0.0.{i}"), &format!("fd00::{i}")],
            &[&format!("10.1.{i}.0/24"), &format!("fd01:{i}::/64")],
        )
    };
    let mut k = Kernel::default();
    let live = [local, dual("a", 1), dual("b", 2)];
    let (p, cp) = r.reconcile(None, &live, &mut k);
    assert!(
        matches!(
            problems(&p)[..],
            [(
                "local",
                InputProblem::NoLocalEndpoint { family: Family::V6 }
            )]
        ),
        "{:?}",
        p.errors
    );
    let routes = k.ours.values().filter(|o| o.kind() == ObjectKind::Route);
    assert_eq!(routes.count(), 2, "IPv4 only");
    assert_eq!(r.plan(Some(&cp), &live, &k).steady, Some(Vec::new()));
}

#[test]
fn the_guards_go_in_before_any_mark_and_the_marks_before_routes_and_xfrm() {
    let mut r = Run::new();
    r.cfg.ipsec = Some(IpsecConfig::single(3, TAG));
    let p = r.plan(None, &[a()], &Kernel::default());
    let kinds: Vec<ObjectKind> = p.ops().iter().map(|o| o.object().kind()).collect();
    let first = |k| kinds.iter().position(|x| *x == k).unwrap();
    assert!(first(ObjectKind::XfrmGuard) < first(ObjectKind::MapEntry));
    assert!(first(ObjectKind::MapEntry) < first(ObjectKind::PodCidrEntry));
    assert!(first(ObjectKind::PodCidrEntry) < first(ObjectKind::Route));
    assert!(first(ObjectKind::XfrmState) < first(ObjectKind::XfrmPolicy));
}

#[test]
fn spi_change_supersedes_old_xfrm_objects_without_the_brake() {
    let mut r = Run::new();
    r.cfg.ipsec = Some(IpsecConfig::single(3, TAG));
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a()], &mut k);
    r.cfg.ipsec = Some(IpsecConfig::single(4, KeyTag(0x2222)));
    let p = r.plan(Some(&cp), &[a()], &k);
    assert!(p.brake.is_none(), "replacing objects is not removing nodes");
    let reasons: Vec<_> = p.deletes.iter().map(|d| d.reason).collect();
    assert_eq!(reasons.len(), 3);
    assert!(reasons.iter().all(|r| *r == DeleteReason::Superseded));
    k.apply(&p.ops());
    assert!(r.plan(Some(&p.checkpoint), &[a()], &k).is_empty());
}

#[test]
fn a_rotation_keeps_both_keys_states_and_switches_only_the_marks() {
    let mut r = Run::new();
    let (old, new) = (
        KeyInUse { spi: 3, tag: TAG },
        KeyInUse {
            spi: 4,
            tag: KeyTag(0x2222),
        },
    );
    r.cfg.ipsec = Some(IpsecConfig::single(3, TAG));
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a()], &mut k);
    // The new key arrives: its states and policies go in, the marks still say SPI 3.
    r.cfg.ipsec = Some(IpsecConfig {
        send_spi: 3,
        keys: vec![old, new],
        seen: Vec::new(),
        tags: Arc::new(GlobalTags),
    });
    let p = r.plan(Some(&cp), &[a()], &k);
    assert!(p.deletes.is_empty());
    assert!(
        p.upserts.iter().all(|u| !u.update),
        "adds only: {:?}",
        p.upserts
    );
    k.apply(&p.ops());
    let states = |k: &Kernel| {
        k.ours
            .values()
            .filter(|o| o.kind() == ObjectKind::XfrmState)
            .count()
    };
    assert_eq!(states(&k), 4, "two keys, both directions");
    // The switch: only the marks change, in place.
    r.cfg.ipsec = Some(IpsecConfig {
        send_spi: 4,
        keys: vec![old, new],
        seen: Vec::new(),
        tags: Arc::new(GlobalTags),
    });
    let p = r.plan(Some(&p.checkpoint), &[a()], &k);
    assert!(p.deletes.is_empty());
    let kinds: BTreeSet<ObjectKind> = p.upserts.iter().map(|u| u.object.kind()).collect();
    assert_eq!(
        kinds,
        BTreeSet::from([ObjectKind::MapEntry, ObjectKind::PodCidrEntry])
    );
    assert!(p.upserts.iter().all(|u| u.update));
    k.apply(&p.ops());
    // The old key retires: its states and policy go, as superseded.
    r.cfg.ipsec = Some(IpsecConfig {
        send_spi: 4,
        keys: vec![new],
        seen: Vec::new(),
        tags: Arc::new(GlobalTags),
    });
    let p = r.plan(Some(&p.checkpoint), &[a()], &k);
    assert!(p.upserts.is_empty());
    assert_eq!(p.deletes.len(), 3);
    assert!(
        p.deletes
            .iter()
            .all(|d| d.reason == DeleteReason::Superseded
                && matches!(&d.object, KernelObject::XfrmState(s) if s.spi == 3)
                    | matches!(&d.object, KernelObject::XfrmPolicy(p) if p.spi == 3))
    );
    k.apply(&p.ops());
    assert_eq!(states(&k), 2);
}

#[test]
fn a_state_whose_key_changed_under_the_same_spi_is_replaced_in_place() {
    let mut r = Run::new();
    r.cfg.ipsec = Some(IpsecConfig::single(3, TAG));
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a()], &mut k);
    r.cfg.ipsec = Some(IpsecConfig::single(3, KeyTag(0x9999)));
    let p = r.plan(Some(&cp), &[a()], &k);
    assert!(p.deletes.is_empty());
    assert_eq!(p.upserts.len(), 2, "{:?}", p.upserts);
    assert!(
        p.upserts
            .iter()
            .all(|u| u.update && u.object.kind() == ObjectKind::XfrmState)
    );
}

#[test]
fn a_recycled_address_under_a_new_node_id_leaves_none_of_the_old_nodes_states() {
    let mut r = Run::new();
    r.cfg.ipsec = Some(IpsecConfig::single(3, TAG));
    r.cfg.max_prune_ratio = 1.0;
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), c()], &mut k);
    let id_c = cp
        .nodes
        .iter()
        .find(|n| n.name == "c")
        .unwrap()
        .node_id
        .unwrap();
    // While the agent was down, c went and d came up on c's address and CIDR. The kernel keys
    // a state by destination, SPI and mark, and the mark holds the node ID: d's states are new
    // objects beside c's, and c's must be deleted, not "replaced".
    let d_on_c = node("d", &["10.0.0.3"], &["10.1.3.0/24"]);
    let (p, cp) = r.reconcile(Some(&cp), &[a(), d_on_c.clone()], &mut k);
    let deleted_c_states = p
        .deletes
        .iter()
        .filter(|d| matches!(&d.object, KernelObject::XfrmState(s) if s.node_id == id_c))
        .count();
    assert_eq!(deleted_c_states, 2, "{:?}", p.deletes);
    let id_d = cp
        .nodes
        .iter()
        .find(|n| n.name == "d")
        .unwrap()
        .node_id
        .unwrap();
    let states: Vec<&XfrmState> = k
        .ours
        .values()
        .filter_map(|o| match o {
            KernelObject::XfrmState(s) if s.src == ip("10.0.0.3") || s.dst == ip("10.0.0.3") => {
                Some(s)
            }
            _ => None,
        })
        .collect();
    assert_eq!(states.len(), 2, "only d's two states: {states:?}");
    assert!(states.iter().all(|s| s.node_id == id_d), "{states:?}");
    assert!(r.plan(Some(&cp), &[a(), d_on_c], &k).is_empty());
}

/// Per-pair keys for tests: a tag made of the pair's addresses and boot IDs.
#[derive(Debug)]
struct PairTags;

impl KeyTags for PairTags {
    fn tag(&self, key: &KeyInUse, pair: &Pair<'_>) -> KeyTag {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (key.spi, pair.src, pair.dst, pair.src_boot, pair.dst_boot).hash(&mut h);
        KeyTag(h.finish())
    }
}

#[test]
fn per_pair_keys_differ_by_pair_and_direction_and_a_reboot_replaces_that_nodes_states() {
    let mut r = Run::new();
    r.cfg.ipsec = Some(IpsecConfig {
        tags: Arc::new(PairTags),
        ..IpsecConfig::single(3, TAG)
    });
    r.cfg.local_boot_id = "boot-local".into();
    let mut k = Kernel::default();
    let mut a2 = a();
    a2.boot_id = "boot-a-1".into();
    let (_, cp) = r.reconcile(None, &[a2.clone(), b()], &mut k);
    let tags: BTreeSet<KeyTag> = k
        .ours
        .values()
        .filter_map(|o| match o {
            KernelObject::XfrmState(s) => Some(s.key),
            _ => None,
        })
        .collect();
    assert_eq!(tags.len(), 4, "a key per node and direction (IPv4 nodes)");
    // node a rebooted: both its states get new keys, in place; b's stay.
    a2.boot_id = "boot-a-2".into();
    let p = r.plan(Some(&cp), &[a2, b()], &k);
    assert!(p.deletes.is_empty(), "{:?}", p.deletes);
    assert_eq!(p.upserts.len(), 2, "{:?}", p.upserts);
    assert!(p.upserts.iter().all(|u| u.update && u.node == "a"));
}

#[test]
fn ipsec_off_removes_the_guards_and_the_marks_whatever_the_brake() {
    let mut r = Run::new();
    r.cfg.ipsec = Some(IpsecConfig::single(3, TAG));
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a()], &mut k);
    r.cfg.ipsec = None;
    r.cfg.max_prune_ratio = 0.0;
    let p = r.plan(Some(&cp), &[a()], &k);
    assert!(p.brake.is_none(), "{:?}", p.brake);
    let guards: Vec<_> = p
        .deletes
        .iter()
        .filter(|d| d.object.kind() == ObjectKind::XfrmGuard)
        .collect();
    assert_eq!(guards.len(), 4, "block and accept, both families");
    assert!(
        guards
            .iter()
            .all(|d| d.reason == DeleteReason::Disabled && d.node.is_none())
    );
    k.apply(&p.ops());
    assert!(
        k.ours
            .values()
            .all(|o| matches!(o.kind(), ObjectKind::MapEntry | ObjectKind::Route))
    );
    assert!(r.plan(Some(&p.checkpoint), &[a()], &k).is_empty());
}

#[test]
fn guards_without_a_record_are_neither_orphans_nor_counted_by_the_brake() {
    let mut r = Run::new();
    r.cfg.ipsec = Some(IpsecConfig::single(3, TAG));
    let mut k = Kernel::default();
    r.reconcile(None, &[a()], &mut k);
    // The checkpoint is lost and the cluster is empty but for the local node.
    let p = r.plan(None, &[], &k);
    assert!(
        p.deletes
            .iter()
            .all(|d| d.object.kind() != ObjectKind::XfrmGuard),
        "{:?}",
        p.deletes
    );
}

#[test]
fn ops_delete_first_and_never_delete_what_they_upsert() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c()], &mut k);
    let d2 = node("d", &["10.0.0.2"], &["10.1.2.0/24"]);
    let p = r.plan(Some(&cp), &[a(), c(), d2, d()], &k);
    let ops = p.ops();
    let first_upsert = ops
        .iter()
        .position(|o| !matches!(o, Op::Delete(_)))
        .unwrap_or(ops.len());
    assert!(
        ops[first_upsert..]
            .iter()
            .all(|o| !matches!(o, Op::Delete(_)))
    );
    let upserted: HashSet<ObjectId> = p.upserts.iter().map(|u| u.object.id()).collect();
    assert!(p.deletes.iter().all(|d| !upserted.contains(&d.object.id())));
}

#[test]
fn duplicate_live_name_keeps_the_first_entry() {
    let r = Run::new();
    let mut k = Kernel::default();
    let other = node("a", &["10.0.0.50"], &[]);
    let (p, _) = r.reconcile(None, &[a(), other], &mut k);
    assert!(matches!(
        problems(&p)[..],
        [("a", InputProblem::DuplicateName)]
    ));
    assert!(k.has(&map("10.0.0.1", 1)));
}

#[test]
fn cidr_without_gateway_is_skipped_and_the_rest_programmed() {
    let r = Run::new();
    let mut k = Kernel::default();
    let v6_cidr_v4_only = node("c", &["10.0.0.3"], &["10.1.3.0/24", "fd01:3::/64"]);
    let (p, _) = r.reconcile(None, &[v6_cidr_v4_only], &mut k);
    assert!(matches!(
        problems(&p)[..],
        [(
            "c",
            InputProblem::NoGateway {
                family: Family::V6,
                ..
            }
        )]
    ));
    assert!(k.has(&route("10.1.3.0/24", "10.0.0.3")));
}

// ---- Invariant 13: a node is one node ----

#[test]
fn an_internal_ip_that_is_also_the_external_ip_is_one_address_and_programmed() {
    let mut r = Run::new();
    r.cfg.include_external_ips = true;
    let raw = crate::node::RawNode {
        name: "a".into(),
        uid: "uid-a".into(),
        addresses: vec![
            ("InternalIP".into(), "10.0.0.1".into()),
            ("ExternalIP".into(), "10.0.0.1".into()),
        ],
        pod_cidrs: vec!["10.1.1.0/24".into()],
        boot_id: String::new(),
    };
    let a = Node::from_raw(raw).unwrap();
    let mut k = Kernel::default();
    let (p, _) = r.reconcile(None, &[a], &mut k);
    assert!(p.errors.is_empty(), "{:?}", p.errors);
    assert!(k.has(&map("10.0.0.1", 1)));
    assert!(k.has(&route("10.1.1.0/24", "10.0.0.1")));
}

#[test]
fn nodes_behind_one_unmapped_nat_address_are_all_programmed() {
    let mut r = Run::new();
    r.cfg.include_external_ips = false;
    let nat = "203.0.113.7";
    let nodes = [external(a(), nat), external(b(), nat), external(c(), nat)];
    let mut k = Kernel::default();
    let (p, _) = r.reconcile(None, &nodes, &mut k);
    assert!(p.errors.is_empty(), "{:?}", p.errors);
    assert_eq!(k.len(), 6, "three map entries and three routes");
    assert!(!k.ours.contains_key(&map(nat, 1).id()));
    // Mapped, the shared address is a conflict again: one node keeps it.
    r.cfg.include_external_ips = true;
    let p = r.plan(None, &nodes, &Kernel::default());
    assert_eq!(p.errors.len(), 2, "{:?}", p.errors);
}

// ---- Invariant 14: the incumbent keeps what it has ----

#[test]
fn the_incumbent_keeps_its_address_against_a_newcomer_whose_name_sorts_first() {
    let r = Run::new();
    let mut k = Kernel::default();
    let old = node("z-old", &["10.0.0.1"], &["10.1.1.0/24"]);
    let (_, cp) = r.reconcile(None, std::slice::from_ref(&old), &mut k);
    let newcomer = node("a-new", &["10.0.0.1"], &["10.1.9.0/24"]);
    let p = r.plan(Some(&cp), &[old.clone(), newcomer.clone()], &k);
    assert!(p.is_empty(), "nothing changes for the incumbent: {p:?}");
    assert!(matches!(
        problems(&p)[..],
        [(
            "a-new",
            InputProblem::Conflict {
                resource: Resource::Address(_),
                why: ConflictWhy::Incumbent,
                ..
            }
        )]
    ));
    assert_eq!(ids_of(&p.checkpoint), BTreeMap::from([("z-old".into(), 1)]));
    // Once the incumbent lets go of the address, the newcomer gets it.
    let moved = node("z-old", &["10.0.0.5"], &["10.1.1.0/24"]);
    let p = r.plan(Some(&cp), &[moved, newcomer], &k);
    assert!(p.errors.is_empty(), "{:?}", p.errors);
    assert_eq!(ids_of(&p.checkpoint).len(), 2);
}

#[test]
fn the_incumbent_keeps_its_pod_cidr_against_a_newcomer() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[b()], &mut k);
    let newcomer = node("a", &["10.0.0.1"], &["10.1.2.0/24"]);
    let p = r.plan(Some(&cp), &[b(), newcomer], &k);
    assert!(p.is_empty(), "{p:?}");
    assert!(matches!(
        problems(&p)[..],
        [(
            "a",
            InputProblem::Conflict {
                why: ConflictWhy::Incumbent,
                ..
            }
        )]
    ));
    assert!(k.has(&route("10.1.2.0/24", "10.0.0.2")));
}

#[test]
fn without_a_record_name_order_decides_the_same_way_every_time() {
    let r = Run::new();
    let twin_a = node("a", &["10.0.0.1"], &["10.1.1.0/24"]);
    let twin_b = node("b", &["10.0.0.1"], &["10.1.2.0/24"]);
    for live in [
        [twin_a.clone(), twin_b.clone()],
        [twin_b.clone(), twin_a.clone()],
    ] {
        let p = r.plan(None, &live, &Kernel::default());
        assert!(matches!(
            problems(&p)[..],
            [(
                "b",
                InputProblem::Conflict {
                    why: ConflictWhy::Order,
                    ..
                }
            )]
        ));
    }
}

#[test]
fn a_node_held_over_a_conflict_does_not_block_what_it_moved_away_from() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    // b moves onto a's pod CIDR (a keeps it: the incumbent) and leaves its own, which a
    // newcomer takes.
    let b_moved = node("b", &["10.0.0.2"], &["10.1.1.0/24"]);
    let taker = node("c", &["10.0.0.3"], &["10.1.2.0/24"]);
    let (p, _) = r.reconcile(Some(&cp), &[a(), b_moved, taker], &mut k);
    assert!(matches!(
        problems(&p)[..],
        [(
            "b",
            InputProblem::Conflict {
                why: ConflictWhy::Incumbent,
                ..
            }
        )]
    ));
    assert!(
        k.has(&route("10.1.2.0/24", "10.0.0.3")),
        "c took b's old CIDR"
    );
    assert!(k.has(&map("10.0.0.2", 2)), "b keeps its entry");
    assert!(k.has(&route("10.1.1.0/24", "10.0.0.1")));
}

#[test]
fn the_local_node_keeps_its_addresses_and_pod_cidr() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, mut cp) = r.reconcile(None, &[a()], &mut k);
    // A checkpoint (say from a bug) lists the local node, and the map has an entry for its IP.
    // The entry is deleted as an orphan: ID 0 is the local node, we never write its IPs.
    cp.nodes.push(with_id(local(), 5));
    k.put(map("10.0.0.100", 5));
    let p = r.plan(Some(&cp), &[a()], &k);
    assert_eq!(
        deleted(&p),
        [(map("10.0.0.100", 5).id(), DeleteReason::Orphan)]
    );
    assert!(p.upserts.is_empty() && p.errors.is_empty() && p.brake.is_none());
    assert!(p.checkpoint.nodes.iter().all(|n| n.name != "local"));
    // Remote nodes claiming a local address, or the local pod CIDR, are held and reported.
    let addr_thief = node("y", &["10.0.0.100"], &[]);
    let cidr_thief = node("z", &["10.0.0.26"], &["10.1.100.0/24"]);
    let p = r.plan(Some(&cp), &[a(), addr_thief, cidr_thief], &k);
    assert!(matches!(
        problems(&p)[..],
        [
            ("y", InputProblem::LocalResource { .. }),
            ("z", InputProblem::LocalResource { .. })
        ]
    ));
    assert!(p.upserts.is_empty(), "{:?}", p.upserts);
}

/// A pod CIDR that overlaps the local node's without being equal to it is the local node's
/// too: inside its pod CIDR (the more specific route would take half its pods' traffic),
/// around it, or around one of its addresses (a `/0` beat the host's default route, a host
/// route took its own address). Each is held and reported; the rest is programmed.
#[test]
fn a_pod_cidr_overlapping_the_local_nodes_is_held() {
    let r = Run::new();
    let mut k = Kernel::default();
    let inside = node("v", &["10.0.0.21"], &["10.1.100.0/25"]);
    let around = node("w", &["10.0.0.22"], &["10.1.0.0/16"]);
    let default = node("x", &["10.0.0.23"], &["0.0.0.0/0"]);
    let host = node("y", &["10.0.0.24"], &["10.0.0.100/32"]);
    let (p, _) = r.reconcile(None, &[a(), inside, around, default, host], &mut k);
    let held: Vec<(&str, String)> = p
        .errors
        .iter()
        .map(|e| match &e.problem {
            InputProblem::OverlapsLocal { cidr, .. } => (e.node.as_str(), cidr.to_string()),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        held,
        [
            ("v", "10.1.100.0/25".to_owned()),
            ("w", "10.1.0.0/16".to_owned()),
            ("x", "0.0.0.0/0".to_owned()),
            ("y", "10.0.0.100/32".to_owned()),
        ]
    );
    let routes: Vec<&KernelObject> = k
        .ours
        .values()
        .filter(|o| o.kind() == ObjectKind::Route)
        .collect();
    assert_eq!(routes.len(), 1, "only a's: {routes:?}");
    assert!(k.has(&route("10.1.1.0/24", "10.0.0.1")));
}

/// A pod CIDR that covers another node's address (or its own) would take the traffic toward
/// that address, and the gateway of that node's routes with it: the node that claims the CIDR
/// is held and reported, naming the address and whose it is; the covered node is programmed.
#[test]
fn a_pod_cidr_covering_a_nodes_address_holds_the_node_that_claims_it() {
    let r = Run::new();
    let mut k = Kernel::default();
    let other = node("m", &["10.0.0.30"], &["10.0.0.0/28"]);
    let own = node("n", &["10.9.0.5"], &["10.9.0.0/24"]);
    let (p, _) = r.reconcile(None, &[a(), b(), other, own], &mut k);
    let held: Vec<(&str, String, String, &str)> = p
        .errors
        .iter()
        .map(|e| match &e.problem {
            InputProblem::CoversAddress { cidr, ip, holder } => (
                e.node.as_str(),
                cidr.to_string(),
                ip.to_string(),
                holder.as_str(),
            ),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        held,
        [
            ("m", "10.0.0.0/28".into(), "10.0.0.1".into(), "a"),
            ("n", "10.9.0.0/24".into(), "10.9.0.5".into(), "n"),
        ]
    );
    let text = p.errors[0].to_string();
    assert!(
        text.starts_with("node m: pod CIDR 10.0.0.0/28 covers 10.0.0.1, the address of node a"),
        "{text}"
    );
    assert!(k.has(&route("10.1.1.0/24", "10.0.0.1")));
    assert!(k.has(&route("10.1.2.0/24", "10.0.0.2")));
    let routes = k.ours.values().filter(|o| o.kind() == ObjectKind::Route);
    assert_eq!(routes.count(), 2, "only a's and b's");

    // Once it no longer covers the address, it is programmed.
    let moved = node("m", &["10.0.0.30"], &["10.1.30.0/24"]);
    let (p, _) = r.reconcile(None, &[a(), b(), moved], &mut k);
    assert!(p.errors.is_empty(), "{:?}", p.errors);
    assert!(k.has(&route("10.1.30.0/24", "10.0.0.30")));
}

// ---- Invariant 8: transient is not gone ----

#[test]
fn a_malformed_node_keeps_every_object_after_a_restart() {
    let mut r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    // After the restart b's record does not validate; only the checkpoint knows its objects.
    r.malformed = vec![MalformedNode::named("b")];
    let p = r.plan(Some(&cp), &[a()], &k);
    assert!(p.is_empty(), "{p:?}");
    assert!(p.brake.is_none());
    assert!(p.checkpoint.nodes.contains(&with_id(b(), 2)));
    assert!(p.frees.is_empty());
    // Its address stays its own.
    let thief = node("c", &["10.0.0.2"], &["10.1.3.0/24"]);
    let p = r.plan(Some(&cp), &[a(), thief], &k);
    assert!(k.has(&map("10.0.0.2", 2)));
    assert!(p.upserts.is_empty(), "{:?}", p.upserts);
}

// ---- Invariant 6: foreign objects ----

#[test]
fn a_foreign_route_at_our_identity_is_a_conflict_and_never_replaced() {
    let r = Run::new();
    let mut k = Kernel::default();
    k.foreign.insert(
        route("10.1.2.0/24", "10.0.0.2").id(),
        "route 10.1.2.0/24 dev cni0 proto kernel".into(),
    );
    let (p, cp) = r.reconcile(None, &[a(), b()], &mut k);
    assert!(matches!(
        problems(&p)[..],
        [("b", InputProblem::Foreign { foreign, .. })] if foreign.contains("proto kernel")
    ));
    assert!(!k.ours.contains_key(&route("10.1.2.0/24", "10.0.0.2").id()));
    assert!(
        k.has(&map("10.0.0.2", 2)),
        "the node's other objects are programmed"
    );
    assert!(k.has(&route("10.1.1.0/24", "10.0.0.1")));
    // Nothing to do next time but report the conflict again.
    let p = r.plan(Some(&cp), &[a(), b()], &k);
    assert!(p.is_empty() && p.errors.len() == 1);
}

// ---- Invariant 9: the brake sees every mass deletion ----

#[test]
fn brake_holds_mass_stale_deletion_and_keeps_the_nodes_pending() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c(), d()], &mut k);
    // 3 of 4 known nodes vanish: 75% > 50%.
    let p = r.plan(Some(&cp), &[a()], &k);
    let hold = p.brake.as_ref().expect("brake");
    assert_eq!(hold.kind, HoldKind::Ratio);
    assert_eq!((hold.count.removed_nodes(), hold.count.known_nodes), (3, 4));
    assert_eq!(hold.nodes, ["b", "c", "d"]);
    assert_eq!(hold.deletes.len(), 6);
    assert!(hold.to_string().contains("75%"), "{hold}");
    assert!(p.deletes.is_empty());
    let pending: Vec<_> = p
        .checkpoint
        .pending_deletes
        .iter()
        .map(|p| p.node.name.as_str())
        .collect();
    assert_eq!(pending, ["b", "c", "d"]);
    assert!(p.frees.is_empty(), "held nodes keep their IDs");
    // Still held on the next restart; released by force-prune.
    let p2 = r.plan(Some(&p.checkpoint), &[a()], &k);
    assert!(p2.brake.is_some() && p2.deletes.is_empty());
    let mut forced = Run::new();
    forced.cfg.force_prune = true;
    let p3 = forced.plan(Some(&p.checkpoint), &[a()], &k);
    assert!(p3.brake.is_none());
    assert_eq!(p3.deletes.len(), 6);
    assert!(p3.checkpoint.pending_deletes.is_empty());
}

fn numbered(prefix: &str, net: u8, count: u8) -> Vec<Node> {
    (0..count)
        .map(|i| {
            node(
                &format!("{prefix}{i}"),
                &[&format!("10.{net}.0.{i}")],
                &[&format!("10.{}.{i}.0/24", net + 100)],
            )
        })
        .collect()
}

/// The record after a restart: written, read back, and the brake's memory restored from it.
fn restarted(r: &mut Run, cp: &Checkpoint) -> Checkpoint {
    let cp = crate::checkpoint::decode(&crate::checkpoint::encode(cp).unwrap()).unwrap();
    r.brake = BrakeMemory::restored(Some(&cp), None, &cp.ids);
    cp
}

/// Ten nodes converged, all but `kept` of them gone (held, as `kind`), ten newcomers joined
/// while the same process held them, then a restart: the run, its kernel, the record as read
/// back, and the live nodes.
fn held_diluted_restarted(kept: usize, kind: HoldKind) -> (Run, Kernel, Checkpoint, Vec<Node>) {
    let mut r = Run::new();
    r.cfg.confirm_by_relist = true;
    let mut k = Kernel::default();
    let ten = numbered("n", 1, 10);
    let (_, cp) = r.reconcile(None, &ten, &mut k);
    let (p, cp) = r.reconcile(Some(&cp), &ten[..kept], &mut k);
    assert_eq!(p.brake.as_ref().map(|h| h.kind), Some(kind));
    r.brake = p.brake_memory.clone();
    let live: Vec<Node> = ten[..kept]
        .iter()
        .cloned()
        .chain(numbered("new", 2, 10))
        .collect();
    let (p, cp) = r.reconcile(Some(&cp), &live, &mut k);
    let held = p
        .checkpoint
        .pending_deletes
        .iter()
        .filter(|p| p.held.is_some());
    assert_eq!(held.count(), 10 - kept, "the record keeps the holds");
    let cp = restarted(&mut r, &cp);
    (r, k, cp, live)
}

/// A restart never releases a hold (invariant 16): the record keeps which removals were held,
/// since when and whether as a wipe, so nodes that joined while the hold lasted dilute nothing
/// after it. Without that, 9 held of 20 known (45%) went through at the first plan.
#[test]
fn a_restart_keeps_every_hold_however_the_ratio_looks_after_it() {
    // A wipe, an hour after the restart and with a fresh list: for an operator only.
    let (mut r, k, cp, live) = held_diluted_restarted(1, HoldKind::Wipe);
    r.now += Duration::from_secs(3600);
    let p = r.plan(Some(&cp), &live, &k);
    let hold = p.brake.as_ref().expect("held after the restart");
    assert_eq!((hold.kind, hold.nodes.len()), (HoldKind::Wipe, 9));
    assert!(p.deletes.is_empty());

    // A hold over the ratio only stays one: a fresh list after the confirm delay releases it,
    // as it would have without the restart.
    let (mut r, k, cp, live) = held_diluted_restarted(4, HoldKind::Ratio);
    let p = r.plan(Some(&cp), &live, &k);
    assert_eq!(
        p.brake.as_ref().map(|h| h.nodes.len()),
        Some(6),
        "6 of 20 would pass"
    );
    r.now += r.cfg.confirm_delay;
    let p = r.plan(Some(&cp), &live, &k);
    assert!(p.brake.is_none(), "a list after the delay confirms it");
    assert_eq!(p.released_nodes.len(), 6);

    // A record may say anything: a hold that began at the end of time is held, not a panic.
    let (mut r, k, mut cp, live) = held_diluted_restarted(4, HoldKind::Ratio);
    for p in &mut cp.pending_deletes {
        p.held = p.held.map(|h| crate::checkpoint::Held {
            at: Duration::new(u64::MAX, 0),
            ..h
        });
    }
    let cp = restarted(&mut r, &cp);
    let p = r.plan(Some(&cp), &live, &k);
    assert_eq!(p.brake.as_ref().map(|h| h.nodes.len()), Some(6));
}

/// Held orphans stay held across a restart too: the record says since when orphans were held,
/// and every orphan the first plan after it finds is held from then.
#[test]
fn a_restart_keeps_orphans_held() {
    let mut r = Run::new();
    let mut k = Kernel::default();
    let ten = numbered("n", 1, 10);
    r.reconcile(None, &ten, &mut k);
    // The checkpoint is lost and the list names one node: nine nodes' objects are orphans.
    let (p, cp) = r.reconcile(None, &ten[..1], &mut k);
    let hold = p.brake.as_ref().expect("orphans held");
    assert!(hold.orphans > 0 && p.deletes.is_empty(), "{hold}");
    assert!(p.checkpoint.orphans_held.is_some());
    // Newcomers join, and the agent restarts.
    r.brake = p.brake_memory.clone();
    let live: Vec<Node> = ten[..1]
        .iter()
        .cloned()
        .chain(numbered("new", 2, 30))
        .collect();
    let (_, cp) = r.reconcile(Some(&cp), &live, &mut k);
    let cp = restarted(&mut r, &cp);
    assert!(r.brake.orphans_held.is_some());
    let p = r.plan(Some(&cp), &live, &k);
    let held = p.brake.as_ref().expect("still held after the restart");
    assert_eq!(held.orphans, hold.orphans);
    assert!(p.deletes.is_empty());
}

#[test]
fn a_newcomer_on_a_held_removal_address_waits_for_the_brake() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c(), d()], &mut k);
    let on_b = node("e", &["10.0.0.2"], &["10.1.5.0/24"]);
    let p = r.plan(Some(&cp), &[a(), on_b], &k);
    assert!(p.brake.is_some());
    assert!(matches!(
        problems(&p)[..],
        [(
            "e",
            InputProblem::Conflict {
                why: ConflictWhy::HeldRemoval,
                ..
            }
        )]
    ));
    assert!(p.upserts.is_empty() && p.deletes.is_empty());
}

#[test]
fn a_wrong_cluster_with_more_nodes_than_before_is_held() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c(), d()], &mut k);
    let other: Vec<Node> = (0..20)
        .map(|i| {
            node(
                &format!("other-{i}"),
                &[&format!("10.50.0.{i}")],
                &[&format!("10.60.{i}.0/24")],
            )
        })
        .collect();
    let p = r.plan(Some(&cp), &other, &k);
    let hold = p.brake.as_ref().expect("held");
    assert_eq!(hold.kind, HoldKind::Wipe, "all 4 known nodes would go");
    assert_eq!(
        hold.count.known_nodes, 4,
        "counted against what the agent knows"
    );
    assert!(p.deletes.is_empty());
}

#[test]
fn the_same_names_with_other_uids_are_removals_the_brake_counts() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c(), d()], &mut k);
    let impostors: Vec<Node> = [a(), b(), c()]
        .into_iter()
        .enumerate()
        .map(|(i, mut n)| {
            n.uid = format!("other-{i}").into();
            n.addresses[0].ip = ip(&format!("10.70.0.{i}"));
            n.pod_cidrs = vec![net(&format!("10.71.{i}.0/24"))].into();
            n
        })
        .chain([d()])
        .collect();
    let p = r.plan(Some(&cp), &impostors, &k);
    let hold = p.brake.as_ref().expect("held");
    assert_eq!(hold.nodes, ["a", "b", "c"]);
    assert!(p.deletes.is_empty(), "{:?}", p.deletes);
    // The impostors are new nodes: none of them inherits a known node's ID.
    assert!(
        p.allocations.iter().all(|a| a.id.get() > 4),
        "{:?}",
        p.allocations
    );
}

#[test]
fn a_malformed_node_keeps_its_own_record_among_several_of_its_name() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c(), d()], &mut k);
    // A list from another cluster with the same names: its nodes are programmed as new ones
    // while the brake holds the removal of ours, so the record has two nodes named "b".
    let other_b = {
        let mut n = node("b", &["10.70.0.2"], &["10.71.2.0/24"]);
        n.uid = "other-b".into();
        n
    };
    let (p, cp) = r.reconcile(Some(&cp), &[other_b, d()], &mut k);
    assert!(p.brake.is_some());
    // Our cluster again, b's record malformed: b is uid-b, whose record keeps 10.0.0.2, and a
    // newcomer claiming that address is held, whichever "b" record sorts first.
    let mut again = Run::new();
    again.brake = p.brake_memory.clone();
    again.malformed = vec![MalformedNode {
        name: "b".into(),
        uid: "uid-b".into(),
    }];
    let thief = node("e", &["10.0.0.2"], &["10.1.5.0/24"]);
    let p = again.plan(Some(&cp), &[a(), c(), d(), thief], &k);
    assert!(
        problems(&p)
            .iter()
            .any(|(n, e)| *n == "e" && matches!(e, InputProblem::Conflict { .. })),
        "{:?}",
        p.errors
    );
    assert!(
        !p.upserts
            .iter()
            .any(|u| u.object.id() == map("10.0.0.2", 2).id()),
        "{:?}",
        p.upserts
    );
    assert!(k.has(&map("10.0.0.2", 2)));
    // The other cluster's b is a removal now, not the malformed node's.
    let named: Vec<&str> = p.checkpoint.nodes.iter().map(|n| n.uid.as_str()).collect();
    assert!(named.contains(&"uid-b"), "{named:?}");
}

#[test]
fn a_held_removal_of_a_node_replaced_under_its_name_stays_held_across_passes() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a()], &mut k);
    // The only known node, replaced under its name: the old one's removal is a wipe.
    let mut impostor = node("a", &["10.0.0.9"], &["10.1.9.0/24"]);
    impostor.uid = "another-uid".into();
    let (p, cp2) = r.reconcile(Some(&cp), std::slice::from_ref(&impostor), &mut k);
    assert_eq!(p.brake.as_ref().map(|b| b.kind), Some(HoldKind::Wipe));
    assert!(p.deletes.is_empty());
    // The record now holds both: the new node, and the old one's pending delete.
    assert_eq!(cp2.nodes.len(), 1);
    assert_eq!(cp2.pending_deletes.len(), 1);
    let mut again = Run::new();
    again.brake = p.brake_memory.clone();
    let p2 = again.plan(Some(&cp2), std::slice::from_ref(&impostor), &k);
    assert!(p2.deletes.is_empty(), "{:?}", p2.deletes);
    assert!(p2.brake.is_some());
    assert!(k.has(&map("10.0.0.1", 1)), "the old node's entry is kept");
}

#[test]
fn orphans_without_a_checkpoint_are_counted_in_objects() {
    let r = Run::new();
    let mut k = Kernel::default();
    r.reconcile(None, &[a(), b(), c(), d()], &mut k);
    // The checkpoint is lost and the list is partial: 6 of 8 objects would be swept.
    let p = r.plan(None, &[a()], &k);
    let hold = p.brake.as_ref().expect("held");
    assert_eq!(hold.orphans, 6);
    assert!(p.deletes.is_empty());
    // A smaller sweep goes ahead.
    let p = r.plan(None, &[a(), b(), c()], &k);
    assert!(p.brake.is_none());
    assert_eq!(p.deletes.len(), 2);
}

#[test]
fn nodes_a_lost_checkpoint_forgot_count_as_nodes_when_a_record_exists_again() {
    // Three nodes with many pod CIDRs, four with one: the four are few of our objects, but
    // more than half of the nodes.
    let many = |i: usize| -> Vec<String> { (0..6).map(|c| format!("10.{i}.{c}.0/24")).collect() };
    let nodes: Vec<Node> = (1..=7)
        .map(|i| {
            let cidrs = match i <= 3 {
                true => many(i),
                false => vec![format!("10.9.{i}.0/24")],
            };
            let cidrs: Vec<&str> = cidrs.iter().map(String::as_str).collect();
            node(&format!("n{i}"), &[&format!("10.0.1.{i}")], &cidrs)
        })
        .collect();
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &nodes, &mut k);
    // The checkpoint was lost while the four's removal was held, and a run that held it again
    // wrote a new one: it knows the three, the kernel still has the four's objects.
    let mut forgot = cp.clone();
    forgot.nodes.retain(|n| n.name.as_str() <= "n3");
    let p = r.plan(Some(&forgot), &nodes[..3], &k);
    let hold = p
        .brake
        .as_ref()
        .expect("four of seven nodes, by the IDs their entries carry");
    assert_eq!((hold.count.removed_nodes(), hold.count.known_nodes), (4, 7));
    assert!(
        hold.count.orphan_ratio() < 0.5,
        "as objects they pass: {hold:?}"
    );
    assert!(p.deletes.is_empty(), "{:?}", p.deletes);
    // Two of them are within the ratio, and the window remembers them as nodes.
    let p = r.plan(Some(&forgot), &[&nodes[..3], &nodes[5..]].concat(), &k);
    assert!(p.brake.is_none(), "{:?}", p.brake);
    assert_eq!(p.brake_memory.window.last().map(|w| w.nodes), Some(2));
}

/// A local node that does not validate (after a restart: no good record of it in this
/// process) or has no InternalIP leaves this node's own addresses and xfrm endpoint unknown:
/// with IPsec, every state, policy, guard and mark looked superseded and went, the routes
/// stayed, and pod traffic left in the clear. Such a list is no view from this node.
#[test]
fn a_local_node_without_a_usable_record_changes_nothing() {
    let mut r = Run::new();
    r.cfg.ipsec = Some(IpsecConfig::single(3, TAG));
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    assert!(k.ours.values().any(|o| o.kind() == ObjectKind::XfrmState));
    let unknown = PlanConfig {
        local_addresses: Vec::new(),
        local_pod_cidrs: Vec::new(),
        ..r.cfg.clone()
    };
    // The local node malformed.
    let malformed = Run {
        cfg: unknown.clone(),
        with_local: false,
        malformed: vec![MalformedNode::named("local")],
        ..Run::new()
    };
    // The local node listed without an InternalIP (registering).
    let registering = node("local", &[], &["10.1.100.0/24"]);
    let bare = Run {
        cfg: unknown,
        with_local: false,
        ..Run::new()
    };
    for (what, run, live) in [
        ("malformed", &malformed, vec![a(), b()]),
        ("registering", &bare, vec![a(), b(), registering]),
    ] {
        let p = run.plan(Some(&cp), &live, &k);
        assert!(p.is_empty(), "{what}: {p:?}");
        assert_eq!(
            p.brake.as_ref().map(|b| b.kind),
            Some(HoldKind::NoLocalNode),
            "{what}"
        );
    }
}

#[test]
fn a_list_without_the_local_node_changes_nothing() {
    let mut r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    r.with_local = false;
    let e = node("e", &["10.0.0.5"], &["10.1.5.0/24"]);
    let p = r.plan(Some(&cp), &[a(), e], &k);
    assert!(p.is_empty(), "no deletes and no adds: {p:?}");
    assert!(p.allocations.is_empty() && p.frees.is_empty());
    assert_eq!(
        p.brake.as_ref().map(|b| b.kind),
        Some(HoldKind::NoLocalNode)
    );
    assert_eq!(p.checkpoint, cp, "the record stays as it was");
    // Also an empty list, which a plain ratio would miss with nothing known.
    let p = r.plan(None, &[], &k);
    assert!(p.is_empty() && p.brake.is_some());
    // Without a record, the window rebuilt from the kernel's freed IDs is kept for next time.
    r.brake = BrakeMemory::restored(None, None, &cp.ids);
    r.brake.window.push(crate::checkpoint::RecentRemovals {
        at: NOW,
        nodes: 3,
        objects: 0,
    });
    let p = r.plan(None, &[], &k);
    assert_eq!(p.checkpoint.removals, r.brake.window);
}

#[test]
fn removals_just_released_count_against_the_next_plan() {
    let mut r = Run::new();
    let mut k = Kernel::default();
    let nodes: Vec<Node> = (1..=10)
        .map(|i| {
            node(
                &format!("n{i:02}"),
                &[&format!("10.0.1.{i}")],
                &[&format!("10.2.{i}.0/24")],
            )
        })
        .collect();
    let (_, cp) = r.reconcile(None, &nodes, &mut k);
    // Four go (40%): fine.
    let (p1, cp1) = r.reconcile(Some(&cp), &nodes[4..], &mut k);
    assert!(p1.brake.is_none());
    r.brake = p1.brake_memory.clone();
    // Two more a moment later: six of ten within the window, held.
    r.now = NOW + Duration::from_secs(1);
    let p2 = r.plan(Some(&cp1), &nodes[6..], &k);
    assert!(p2.brake.is_some(), "{:?}", p2.deletes);
    // The window survives a restart through the checkpoint.
    r.brake = BrakeMemory::restored(Some(&cp1), None, &cp1.ids);
    let p3 = r.plan(Some(&cp1), &nodes[6..], &k);
    assert!(p3.brake.is_some());
    // After the window, two of six are fine.
    r.now = NOW + Duration::from_secs(120);
    let p4 = r.plan(Some(&cp1), &nodes[6..], &k);
    assert!(p4.brake.is_none());
}

#[test]
fn a_lost_checkpoint_does_not_forget_the_removals_just_made() {
    let mut r = Run::new();
    let mut k = Kernel::default();
    let nodes: Vec<Node> = (1..=10)
        .map(|i| {
            node(
                &format!("n{i:02}"),
                &[&format!("10.0.1.{i}")],
                &[&format!("10.2.{i}.0/24")],
            )
        })
        .collect();
    let (_, cp) = r.reconcile(None, &nodes, &mut k);
    let (_, cp1) = r.reconcile(Some(&cp), &nodes[4..], &mut k);
    // The checkpoint is lost with its window; the kernel still remembers the freed IDs (the
    // reconciler merges them into the allocator state the planner gets).
    r.now = NOW + Duration::from_secs(1);
    let view = r.view(&nodes[6..]);
    let inventory = k.inventory();
    let p = plan(&PlanInput {
        record: None,
        live: &view,
        inventory: &inventory,
        allocator: &cp1.ids,
        brake: &BrakeMemory::restored(None, None, &cp1.ids),
        confirmed_hold: None,
        now: r.now,
        config: &r.cfg,
    });
    let hold = p.brake.as_ref().expect("six of ten within the window");
    assert_eq!(
        (hold.count.removed_nodes(), hold.count.known_nodes),
        (6, 10)
    );
    assert!(p.deletes.is_empty(), "{:?}", p.deletes);
}

#[test]
fn a_confirming_list_releases_what_was_held_and_holds_what_it_adds() {
    let mut r = Run::new();
    r.cfg.confirm_by_relist = true;
    let mut k = Kernel::default();
    let nodes: Vec<Node> = (1..=10)
        .map(|i| {
            node(
                &format!("n{i:02}"),
                &[&format!("10.0.1.{i}")],
                &[&format!("10.2.{i}.0/24")],
            )
        })
        .collect();
    let (_, cp) = r.reconcile(None, &nodes, &mut k);
    let held = r.plan(Some(&cp), &nodes[6..], &k);
    assert_eq!(held.brake.as_ref().map(|h| h.nodes.len()), Some(6));
    r.brake = held.brake_memory.clone();
    // After the delay a newer list asks for the six and one more.
    r.now = NOW + Duration::from_secs(61);
    r.relists = 2;
    let p = r.plan(Some(&held.checkpoint), &nodes[7..], &k);
    assert_eq!(p.released_nodes.len(), 6);
    let hold = p.brake.as_ref().expect("the seventh is held anew");
    assert_eq!(hold.nodes, ["n07"]);
    assert_eq!(p.deletes.len(), 12);
}

// ---- Invariant 17: map room ----

#[test]
fn a_full_map_never_displaces_a_programmed_node() {
    let mut r = Run::new();
    r.cfg.map_capacity = 2;
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[b(), c()], &mut k);
    // A new node whose name sorts first arrives while the map is full.
    let p = r.plan(Some(&cp), &[a(), b(), c()], &k);
    assert!(matches!(
        problems(&p)[..],
        [("a", InputProblem::MapFull { limit: 2, .. })]
    ));
    assert!(p.is_empty(), "{p:?}");
    // Room freed by a removal goes to the newcomer.
    let (p, _) = r.reconcile(Some(&cp), &[a(), c()], &mut k);
    assert!(p.errors.is_empty(), "{:?}", p.errors);
    assert!(k.has(&map("10.0.0.1", 3)));
}

#[test]
fn map_room_counts_the_entries_held_nodes_keep() {
    let mut r = Run::new();
    r.cfg.map_capacity = 3;
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c()], &mut k);
    // b registers again (no addresses): it keeps its entry, so there is no room for d.
    let p = r.plan(Some(&cp), &[a(), node("b", &[], &[]), c(), d()], &k);
    assert!(matches!(
        problems(&p)[..],
        [("d", InputProblem::MapFull { .. })]
    ));
}

// ---- Invariant 5: stable IDs ----

#[test]
fn a_drifted_map_id_is_rewritten_to_the_recorded_id() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    // Someone rewrites a's entry with another ID.
    k.put(map("10.0.0.1", 40));
    let p = r.plan(Some(&cp), &[a(), b()], &k);
    assert_eq!(ids_of(&p.checkpoint)["a"], 1);
    assert_eq!(p.upserts.len(), 1);
    assert_eq!(p.upserts[0].object, map("10.0.0.1", 1));
    assert!(p.upserts[0].update);
    assert!(p.allocations.is_empty() && p.deletes.is_empty());
}

#[test]
fn without_a_record_the_map_id_wins_but_never_one_another_record_owns() {
    let r = Run::new();
    let mut k = Kernel::default();
    k.put(map("10.0.0.1", 40));
    k.put(map("10.0.0.2", 7));
    let mut cp = Checkpoint::default();
    cp.nodes.push(with_id(c(), 7));
    let p = r.plan(Some(&cp), &[a(), b(), c()], &k);
    let ids = ids_of(&p.checkpoint);
    assert_eq!(ids["a"], 40, "no record: the map's ID");
    assert_eq!(ids["c"], 7, "the record's ID");
    assert_ne!(ids["b"], 7, "7 is c's by the record");
}

#[test]
fn freed_ids_wait_out_the_cooldown_and_longest_freed_is_reused_first() {
    let r = Run::new();
    let k = Kernel::default();
    // Everything but 5 and 6 is cooling; 6 was freed longer ago.
    let mut freed: Vec<FreedId> = (1..=u16::MAX)
        .map(|v| FreedId {
            id: id(v),
            freed_at: NOW,
        })
        .collect();
    freed[4].freed_at = NOW - Duration::from_secs(3600);
    freed[5].freed_at = NOW - Duration::from_secs(7200);
    let cp = Checkpoint {
        ids: AllocatorState { freed },
        ..Checkpoint::default()
    };
    let p = r.plan(Some(&cp), &[a(), b(), c()], &k);
    let allocated: Vec<(&str, u16, Option<Duration>)> = p
        .allocations
        .iter()
        .map(|a| (a.node.as_str(), a.id.get(), a.reused_after))
        .collect();
    assert_eq!(
        allocated,
        [
            ("a", 6, Some(NOW - Duration::from_secs(7200))),
            ("b", 5, Some(NOW - Duration::from_secs(3600)))
        ]
    );
    assert!(matches!(
        problems(&p)[..],
        [(
            "c",
            InputProblem::Ids(IdError::Exhausted { limit: 65535, .. })
        )]
    ));
}

#[test]
fn an_exhausted_id_space_holds_new_nodes_and_keeps_programmed_ones() {
    let mut r = Run::new();
    r.cfg.max_node_id = 2;
    let mut k = Kernel::default();
    let (p, cp) = r.reconcile(None, &[a(), b(), c()], &mut k);
    assert!(matches!(
        problems(&p)[..],
        [("c", InputProblem::Ids(IdError::Exhausted { limit: 2, .. }))]
    ));
    assert_eq!(k.len(), 4);
    let e = p.errors[0].to_string();
    assert!(e.contains("node c") && e.contains("all 2 IDs"), "{e}");
    // Once a freed ID has cooled down, the next node gets it.
    let (_, cp2) = r.reconcile(Some(&cp), &[a(), c()], &mut k);
    assert!(!ids_of(&cp2).contains_key("c"), "2 is cooling");
    let mut later = Run::new();
    later.cfg.max_node_id = 2;
    later.now = NOW + later.cfg.id_cooldown;
    let p = later.plan(Some(&cp2), &[a(), c()], &k);
    assert_eq!(ids_of(&p.checkpoint)["c"], 2);
    assert!(p.allocations[0].reused_after.is_some());
}

// ---- Routes through nexthop objects ----

fn with_nexthops() -> Run {
    let mut r = Run::new();
    r.cfg.route_nexthops = true;
    r
}
fn nh(node: u16, gw: &str) -> KernelObject {
    KernelObject::Nexthop(Nexthop {
        node_id: id(node),
        gateway: ip(gw),
        second: false,
    })
}
fn nh_id(node: u16, family: Family) -> NexthopId {
    NexthopId::of(id(node), family)
}
fn nh_route(dst: &str, node: u16) -> KernelObject {
    let dst = net(dst);
    KernelObject::Route(Route {
        dst,
        via: Via::Nexthop(nh_id(node, Family::of_net(&dst))),
        metric: Route::default_metric(&dst),
    })
}

#[test]
fn routes_go_through_one_nexthop_per_node_and_family_created_before_them() {
    let r = with_nexthops();
    let mut k = Kernel::default();
    let dual = node(
        "a",
        &["10.0.0.1", "fd00::1"],
        &["10.1.1.0/24", "10.1.101.0/24", "fd01:1::/64"],
    );
    let (p, _) = r.reconcile(None, &[dual], &mut k);
    assert!(p.errors.is_empty(), "{:?}", p.errors);
    for o in [
        nh(1, "10.0.0.1"),
        nh(1, "fd00::1"),
        nh_route("10.1.1.0/24", 1),
        nh_route("10.1.101.0/24", 1),
        nh_route("fd01:1::/64", 1),
    ] {
        assert!(k.has(&o), "{o} missing");
    }
    assert_eq!(k.len(), 2 + 2 + 3);
    let ops = p.ops();
    let first_route = ops
        .iter()
        .position(|o| o.object().kind() == ObjectKind::Route);
    let last_nexthop = ops
        .iter()
        .rposition(|o| o.object().kind() == ObjectKind::Nexthop);
    assert!(last_nexthop < first_route, "{ops:?}");
}

fn ops_of(p: &Plan) -> Vec<String> {
    p.ops()
        .iter()
        .map(|o| format!("{} {}", o.verb(), o.object()))
        .collect()
}

/// Converges nodes a and b with nexthops, lets `before` change the kernel, then readdresses a to
/// 10.0.0.9, keeping its pod CIDR: that plan, and the record it left.
fn readdress_a(k: &mut Kernel, before: impl FnOnce(&mut Kernel)) -> (Run, Plan, Checkpoint) {
    let r = with_nexthops();
    let (_, cp) = r.reconcile(None, &[a(), b()], k);
    before(k);
    let moved = node("a", &["10.0.0.9"], &["10.1.1.0/24"]);
    let (p, cp) = r.reconcile(Some(&cp), &[moved, b()], k);
    (r, p, cp)
}

/// Orphan nexthops count in the brake's ratio with the other orphans: without a record, two
/// nodes of four gone (50%, not over) leave their map entries, routes and nexthops, 6 of 8 of
/// our objects. Counted without their nexthops (4 of 8, 50%) they went through.
#[test]
fn orphan_nexthops_count_in_the_brakes_ratio() {
    let r = with_nexthops();
    let mut k = Kernel::default();
    let p_ = node("p", &["10.0.0.5"], &[]);
    let q = node("q", &["10.0.0.6"], &[]);
    r.reconcile(None, &[p_.clone(), q.clone(), c(), d()], &mut k);
    let p = r.plan(None, &[p_, q], &k);
    let hold = p.brake.as_ref().expect("the orphans are held");
    assert_eq!(hold.orphans, 6, "{hold}");
    assert!(p.deletes.is_empty(), "{:?}", ops_of(&p));
}

/// Make before break: replacing an IPv4 nexthop that routes use makes the kernel walk every
/// IPv4 route, so a readdressed node's new nexthop is made at the other ID of its pair, its
/// routes move there, and the old one goes last; the next readdress moves it back.
#[test]
fn readdressing_a_node_moves_its_routes_to_a_new_nexthop_at_its_other_id() {
    let mut k = Kernel::default();
    let (r, p, cp) = readdress_a(&mut k, |_| {});
    assert_eq!(
        ops_of(&p),
        [
            "delete map 10.0.0.1 -> node 1",
            "create map 10.0.0.9 -> node 1",
            "create nexthop 201500001 via 10.0.0.9 node 1",
            "replace route 10.1.1.0/24 nhid 201500001 metric 0",
            "delete nexthop 201400001 via 10.0.0.1 node 1",
        ]
    );
    assert!(p.errors.is_empty(), "{:?}", p.errors);
    let (p, cp) = r.reconcile(
        Some(&cp),
        &[node("a", &["10.0.0.9"], &["10.1.1.0/24"]), b()],
        &mut k,
    );
    assert!(p.is_empty(), "settled on the second ID: {:?}", ops_of(&p));
    let back = node("a", &["10.0.0.7"], &["10.1.1.0/24"]);
    let (p, _) = r.reconcile(Some(&cp), &[back, b()], &mut k);
    assert_eq!(
        ops_of(&p)[2..],
        [
            "create nexthop 201400001 via 10.0.0.7 node 1",
            "replace route 10.1.1.0/24 nhid 201400001 metric 0",
            "delete nexthop 201500001 via 10.0.0.9 node 1",
        ]
    );
}

/// Where the other ID is not free (a foreign nexthop holds it), the nexthop is replaced in
/// place, as before nexthops had pairs: slower at scale, but nothing foreign is touched and no
/// route is left behind.
#[test]
fn a_readdressed_nodes_nexthop_is_replaced_in_place_when_its_other_id_is_not_free() {
    let mut k = Kernel::default();
    let (_, p, _) = readdress_a(&mut k, |k| {
        k.foreign.insert(
            ObjectId::Nexthop {
                id: NexthopId::of_pair(id(1), Family::V4, true),
            },
            "nexthop 201500001 proto static".into(),
        );
    });
    assert_eq!(
        ops_of(&p),
        [
            "delete map 10.0.0.1 -> node 1",
            "create map 10.0.0.9 -> node 1",
            "replace nexthop 201400001 via 10.0.0.9 node 1",
        ]
    );
    assert!(p.errors.is_empty(), "{:?}", p.errors);
    assert!(k.has(&nh_route("10.1.1.0/24", 1)));
}

/// A nexthop a foreign route uses is never changed under it: a readdressed node's routes move
/// to a new nexthop at the other ID, and the old one stays as it is, kept and reported (a
/// replace in place would send their traffic to the node's new address). The next readdress
/// replaces the node's own nexthop, the one nothing foreign uses.
#[test]
fn a_nexthop_a_foreign_route_uses_is_never_changed_under_it() {
    let mut k = Kernel::default();
    let theirs = "route 192.168.7.0/24 table 100 proto static";
    let (r, p, cp) = readdress_a(&mut k, |k| {
        let ours = ObjectId::Nexthop {
            id: nh_id(1, Family::V4),
        };
        k.used_by.insert(ours, theirs.into());
    });
    assert_eq!(
        ops_of(&p),
        [
            "delete map 10.0.0.1 -> node 1",
            "create map 10.0.0.9 -> node 1",
            "create nexthop 201500001 via 10.0.0.9 node 1",
            "replace route 10.1.1.0/24 nhid 201500001 metric 0",
        ]
    );
    assert!(
        matches!(&problems(&p)[..], [("a", InputProblem::InUse { user, .. })] if user == theirs),
        "{:?}",
        p.errors
    );
    let moved = node("a", &["10.0.0.7"], &["10.1.1.0/24"]);
    let (p, _) = r.reconcile(Some(&cp), &[moved, b()], &mut k);
    assert_eq!(
        ops_of(&p)[2..],
        ["replace nexthop 201500001 via 10.0.0.7 node 1"],
        "the shared one stays at 10.0.0.1"
    );
}

/// With neither ID of the pair to spare (a foreign nexthop at the other, a foreign route on
/// ours, or ours at both IDs, each used by something foreign), ours is not given the new
/// gateway under its user: it stays as it is, reported as in use, and the node's routes stay
/// on the old gateway.
#[test]
fn a_shared_nexthop_keeps_its_gateway_when_no_other_id_is_to_be_had() {
    let theirs = "route 192.168.7.0/24 table 100 proto static";
    let mut k = Kernel::default();
    let (_, p, _) = readdress_a(&mut k, |k| {
        k.used_by.insert(
            ObjectId::Nexthop {
                id: nh_id(1, Family::V4),
            },
            theirs.into(),
        );
        k.foreign.insert(
            ObjectId::Nexthop {
                id: NexthopId::of_pair(id(1), Family::V4, true),
            },
            "nexthop 201500001 proto static".into(),
        );
    });
    kept_in_use(&p, "nexthop");
    assert!(k.has(&nh_route("10.1.1.0/24", 1)), "the routes stay");

    // Ours at both IDs, both used by foreign routes.
    let mut k = Kernel::default();
    let (_, p, _) = readdress_a(&mut k, |k| {
        let second = Nexthop {
            node_id: id(1),
            gateway: ip("10.0.0.1"),
            second: true,
        };
        let second = KernelObject::Nexthop(second);
        for nh in [
            nh_id(1, Family::V4),
            NexthopId::of_pair(id(1), Family::V4, true),
        ] {
            k.used_by
                .insert(ObjectId::Nexthop { id: nh }, theirs.into());
        }
        k.ours.insert(second.id(), second);
    });
    kept_in_use(&p, "nexthop 2014");
}

/// No operation of `p` names `untouched`, and a's nexthop is reported in use.
fn kept_in_use(p: &Plan, untouched: &str) {
    assert!(
        ops_of(p).iter().all(|op| !op.contains(untouched)),
        "{:?}",
        ops_of(p)
    );
    assert!(
        problems(p)
            .iter()
            .any(|(n, e)| *n == "a" && matches!(e, InputProblem::InUse { .. })),
        "{:?}",
        p.errors
    );
}

/// A crash between making the new nexthop and deleting the old leaves both: the one with the
/// node's gateway is kept, whichever ID it holds, the routes still on the other move to it,
/// and the other goes last.
#[test]
fn of_a_pair_left_by_a_crash_the_nexthop_with_the_gateway_stays() {
    let r = with_nexthops();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    let second = Nexthop {
        node_id: id(1),
        gateway: ip("10.0.0.9"),
        second: true,
    };
    let second = KernelObject::Nexthop(second);
    k.ours.insert(second.id(), second);
    let moved = node("a", &["10.0.0.9"], &["10.1.1.0/24"]);
    let (p, _) = r.reconcile(Some(&cp), &[moved, b()], &mut k);
    assert_eq!(
        ops_of(&p),
        [
            "delete map 10.0.0.1 -> node 1",
            "create map 10.0.0.9 -> node 1",
            "replace route 10.1.1.0/24 nhid 201500001 metric 0",
            "delete nexthop 201400001 via 10.0.0.1 node 1",
        ]
    );
}

#[test]
fn a_new_node_id_moves_the_routes_before_the_old_nexthop_goes() {
    let r = with_nexthops();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c(), d()], &mut k);
    // `a` is replaced under its name: a new node, a new ID, the same CIDR.
    let mut again = a();
    again.uid = "uid-a-2".into();
    // The model kernel fails the test if a nexthop goes while a route still uses it.
    let (p, cp) = r.reconcile(Some(&cp), &[again, b(), c(), d()], &mut k);
    assert_eq!(ids_of(&cp)["a"], 5);
    let late: Vec<ObjectId> = p
        .late_delete_ops()
        .iter()
        .map(|(o, _)| o.object().id())
        .collect();
    assert_eq!(
        late,
        [ObjectId::Nexthop {
            id: nh_id(1, Family::V4)
        }]
    );
    assert!(
        p.delete_ops()
            .iter()
            .all(|(o, _)| o.object().kind() != ObjectKind::Nexthop)
    );
    assert!(k.has(&nh_route("10.1.1.0/24", 5)) && k.has(&nh(5, "10.0.0.1")));
    assert!(!k.ours.contains_key(&ObjectId::Nexthop {
        id: nh_id(1, Family::V4)
    }));
}

#[test]
fn a_foreign_nexthop_at_a_nodes_id_keeps_its_routes_of_that_family_unwritten() {
    let r = with_nexthops();
    let mut k = Kernel::default();
    let taken = ObjectId::Nexthop {
        id: nh_id(1, Family::V4),
    };
    k.foreign
        .insert(taken.clone(), "nexthop 201400001 proto static".into());
    let dual = node(
        "a",
        &["10.0.0.1", "fd00::1"],
        &["10.1.1.0/24", "fd01:1::/64"],
    );
    let (p, _) = r.reconcile(None, &[dual], &mut k);
    assert!(matches!(
        problems(&p)[..],
        [("a", InputProblem::Foreign { .. })]
    ));
    assert!(!k.ours.contains_key(&taken));
    assert!(
        !k.ours.values().any(|o| o.uses() == Some(taken.clone())),
        "no route through it"
    );
    assert!(
        k.has(&nh_route("fd01:1::/64", 1)),
        "the other family is programmed"
    );
    assert!(k.has(&map("10.0.0.1", 1)));
}

#[test]
fn a_nexthop_that_a_foreign_route_uses_outlives_its_node() {
    let r = with_nexthops();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c(), d()], &mut k);
    let a_nh = ObjectId::Nexthop {
        id: nh_id(1, Family::V4),
    };
    k.used_by.insert(
        a_nh.clone(),
        "route 192.168.7.0/24 table 100 proto static".into(),
    );
    let (p, _) = r.reconcile(Some(&cp), &[b(), c(), d()], &mut k);
    assert!(
        k.ours.contains_key(&a_nh),
        "deleting it would delete their route"
    );
    assert!(!k.has(&nh_route("10.1.1.0/24", 1)) && !k.has(&map("10.0.0.1", 1)));
    let e = p.errors.iter().find(|e| e.node == "a").expect("reported");
    assert!(matches!(e.problem, InputProblem::InUse { .. }), "{e}");
    assert!(e.to_string().contains("table 100"), "{e}");
}

#[test]
fn routes_that_carry_their_gateway_move_to_nexthops_in_place() {
    let r = with_nexthops();
    let mut k = Kernel::default();
    let (_, cp) = Run::new().reconcile(None, &[a()], &mut k);
    assert!(
        k.has(&route("10.1.1.0/24", "10.0.0.1")),
        "written without nexthops"
    );
    let (p, _) = r.reconcile(Some(&cp), &[a()], &mut k);
    assert!(p.deletes.is_empty());
    let ops: Vec<String> = p
        .ops()
        .iter()
        .map(|o| format!("{} {}", o.verb(), o.object()))
        .collect();
    assert_eq!(
        ops,
        [
            "create nexthop 201400001 via 10.0.0.1 node 1",
            "replace route 10.1.1.0/24 nhid 201400001 metric 0",
        ]
    );
    // And back, for kernels or operators without nexthops: the routes first.
    let (p, _) = Run::new().reconcile(Some(&cp), &[a()], &mut k);
    assert!(k.has(&route("10.1.1.0/24", "10.0.0.1")) && k.len() == 2);
    assert_eq!(p.late_delete_ops().len(), 1);
}

#[test]
fn a_nexthop_goes_in_only_with_a_route_through_it() {
    let r = with_nexthops();
    let mut k = Kernel::default();
    k.foreign.insert(
        ObjectId::Route {
            dst: net("10.1.1.0/24"),
            metric: 0,
        },
        "route 10.1.1.0/24 proto static".into(),
    );
    let (p, _) = r.reconcile(None, &[a()], &mut k);
    assert!(matches!(
        problems(&p)[..],
        [("a", InputProblem::Foreign { .. })]
    ));
    assert_eq!(
        k.ours.values().cloned().collect::<Vec<_>>(),
        [map("10.0.0.1", 1)]
    );
}

/// One removal step of the brake-counting scenarios: plans without `gone` at `now`, applies every
/// op but the deletes of the nodes in `failing` (their cleanup fails), and returns the plan and
/// the checkpoint it implies.
fn remove_step(
    r: &mut Run,
    record: &Checkpoint,
    live: &[Node],
    failing: bool,
    k: &mut Kernel,
) -> (Plan, Checkpoint) {
    let p = r.plan(Some(record), live, k);
    let stale: BTreeSet<ObjectId> = p
        .deletes
        .iter()
        .filter(|d| failing && d.reason == DeleteReason::StaleNode)
        .map(|d| d.object.id())
        .collect();
    let (failed, ok): (Vec<Op>, Vec<Op>) = p
        .ops()
        .into_iter()
        .partition(|op| matches!(op, Op::Delete(o) if stale.contains(&o.id())));
    k.apply(&ok);
    let cp = p.checkpoint_after(&failed);
    r.brake = p.brake_memory.clone();
    (p, cp)
}

/// Where the removals of a scenario are recorded when the agent restarts.
#[derive(Clone, Copy, Debug)]
enum Recorded {
    /// The kernel's ring only: the checkpoint is lost.
    Ring,
    /// The checkpoint's window only: the kernel kept no ring.
    Checkpoint,
    /// Both.
    CheckpointAndRing,
    /// The ring, and an older checkpoint that still lists the nodes (a crash between the
    /// kernel writes and the checkpoint write).
    RingAndOlderRecord,
    /// The ring, and an older checkpoint that names them as held pending deletes, released
    /// (by --force-prune) before the crash.
    RingAndHeldPendingDelete,
    /// The checkpoint's window and its pending deletes (cleanup failed); no ring.
    PendingDeleteAndCheckpoint,
    /// The checkpoint's window, its pending deletes, and the ring.
    AllThree,
}

/// Seven nodes; two go (in one plan, or `split` over two), recorded as `recorded` says; then
/// a restart, and a third goes. Returns the restarted plan's hold (every removal is held: the
/// ratio allowed is 0) and the nodes its window counts.
fn seven_two_gone_restarted(recorded: Recorded, split: bool) -> (BrakeHold, usize) {
    use Recorded::*;
    let mut r = Run::new();
    let mut k = Kernel::default();
    let seven = numbered("n", 1, 7);
    let (_, cp0) = r.reconcile(None, &seven, &mut k);
    let failing = matches!(recorded, PendingDeleteAndCheckpoint | AllThree);
    let mut before = cp0.clone();
    if matches!(recorded, RingAndHeldPendingDelete) {
        r.cfg.max_prune_ratio = 0.1;
        r.now = NOW + Duration::from_secs(1);
        let (p, cp) = remove_step(&mut r, &cp0, &seven[2..], false, &mut k);
        assert_eq!(p.brake.map(|h| h.nodes.len()), Some(2));
        before = cp;
        r.cfg.max_prune_ratio = 0.5;
        r.cfg.force_prune = true;
    }
    let mut ring = Vec::new();
    let mut record = before.clone();
    let mut freed = before.ids.clone();
    let steps: &[&[Node]] = if split {
        &[&seven[1..], &seven[2..]]
    } else {
        &[&seven[2..]]
    };
    for (i, live) in steps.iter().enumerate() {
        r.now = NOW + Duration::from_secs(10 + i as u64);
        let (p, cp) = remove_step(&mut r, &record, live, failing, &mut k);
        assert!(p.brake.is_none(), "{:?}", p.brake);
        ring.push(*p.brake_memory.window.last().unwrap());
        freed = cp.ids.clone();
        // Split in two, the crash cases' checkpoint is the one written between them.
        if i == 0 && split || !matches!(recorded, RingAndOlderRecord | RingAndHeldPendingDelete) {
            record = cp;
        }
    }
    r.cfg.force_prune = false;
    if failing {
        assert_eq!(record.pending_deletes.len(), 2);
    }
    let (cp, kept) = match recorded {
        Ring => (None, Some(ring)),
        Checkpoint | PendingDeleteAndCheckpoint => (Some(record), None),
        _ => (Some(record), Some(ring)),
    };
    r.now = NOW + Duration::from_secs(30);
    r.brake = BrakeMemory::restored(cp.as_ref(), kept, &freed);
    r.cfg.max_prune_ratio = 0.0;
    let p = r.plan(cp.as_ref(), &seven[2..6], &k);
    let window = p.brake_memory.window.iter().map(|w| w.nodes as usize).sum();
    (p.brake.expect("a ratio of 0 holds every removal"), window)
}

#[test]
fn a_restart_on_a_checkpoint_older_than_the_kernel_counts_each_removal_once() {
    // Seven nodes, two removed just before a crash that cut the checkpoint write: the ring has
    // them, the older checkpoint still lists them. The restarted plan must count 2 of 7, not
    // 4 of 9, and hold nothing under a ratio of 2/7.
    let mut r = Run::new();
    let mut k = Kernel::default();
    let seven = numbered("n", 1, 7);
    let (_, cp0) = r.reconcile(None, &seven, &mut k);
    r.now = NOW + Duration::from_secs(5);
    let (p1, cp1) = remove_step(&mut r, &cp0, &seven[2..], false, &mut k);
    let ring = vec![*p1.brake_memory.window.last().unwrap()];
    r.now = NOW + Duration::from_secs(10);
    r.brake = BrakeMemory::restored(Some(&cp0), Some(ring), &cp1.ids);
    r.cfg.max_prune_ratio = 0.3;
    let p = r.plan(Some(&cp0), &seven[2..], &k);
    assert!(p.brake.is_none(), "{:?}", p.brake.map(|h| h.to_string()));
    let window: u32 = p.brake_memory.window.iter().map(|w| w.nodes).sum();
    assert_eq!(window, 2, "{:?}", p.brake_memory.window);
    assert!(
        p.checkpoint
            .nodes
            .iter()
            .all(|n| !["n0", "n1"].contains(&n.name.as_str()))
    );
    // The same restart asked for one more: 3 of 7 (43 %), held over 30 %.
    let p = r.plan(Some(&cp0), &seven[2..6], &k);
    let hold = p.brake.expect("3 of 7 is over 30 %");
    assert_eq!((hold.count.removed_nodes(), hold.count.known_nodes), (3, 7));
    assert_eq!(hold.nodes, ["n6"]);
}

#[test]
fn each_removal_is_counted_once_whatever_records_name_it() {
    use Recorded::*;
    let all = [
        Ring,
        Checkpoint,
        CheckpointAndRing,
        RingAndOlderRecord,
        RingAndHeldPendingDelete,
        PendingDeleteAndCheckpoint,
        AllThree,
    ];
    for recorded in all {
        for split in [false, true] {
            let (hold, window) = seven_two_gone_restarted(recorded, split);
            let case = format!("{recorded:?}, split {split}: {hold:?}");
            assert_eq!(
                (hold.count.removed_nodes(), hold.count.known_nodes),
                (3, 7),
                "{case}"
            );
            // Without a record, n6's objects are orphans (its node counted by their ID).
            match recorded {
                Ring => assert_eq!((hold.nodes.len(), hold.orphans), (0, 2), "{case}"),
                _ => assert_eq!(hold.nodes, ["n6"], "{case}"),
            }
            assert_eq!(window, 2, "{case}");
        }
    }
    println!(
        "brake: {} record combinations x 2 orders (one plan, two), each removal counted once",
        all.len()
    );
}

/// The numbers in a hold's message, in order.
fn numbers_in(message: &str) -> Vec<usize> {
    message
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty())
        .map(|w| w.parse().unwrap())
        .collect()
}

#[test]
fn a_holds_message_prints_the_numbers_the_decision_used() {
    // Ten nodes; three go (30 %), then three more within the window: 6 of 10, held. The message
    // printed the three held "of 10 (60 %)" before, the held count without the window and the
    // known count and ratio with it.
    let mut r = Run::new();
    let mut k = Kernel::default();
    let ten = numbered("n", 1, 10);
    let (_, cp) = r.reconcile(None, &ten, &mut k);
    let (_, cp) = remove_step(&mut r, &cp, &ten[3..], false, &mut k);
    r.now = NOW + Duration::from_secs(1);
    let p = r.plan(Some(&cp), &ten[6..], &k);
    let hold = p.brake.expect("6 of 10 within the window");
    let c = hold.count;
    assert_eq!(
        (
            c.asked_nodes,
            c.window_nodes,
            c.known_nodes,
            c.removed_nodes()
        ),
        (3, 3, 10, 6)
    );
    let message = hold.to_string();
    let pct = |r: f64| (r * 100.0).round() as usize;
    assert_eq!(
        numbers_in(&message)[..12],
        [
            hold.nodes.len(),
            hold.orphans,
            hold.deletes.len(),
            c.removed_nodes(),
            c.known_nodes,
            pct(c.node_ratio()),
            c.removed_objects(),
            c.objects,
            pct(c.orphan_ratio()),
            c.window_nodes,
            c.window_objects,
            pct(hold.max_ratio),
        ],
        "{message}"
    );
    println!("brake message: {message}");
}
