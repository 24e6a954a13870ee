//! One scenario per rule of the planner.

use std::collections::BTreeMap;

use super::*;
use crate::ids::FreedId;
use crate::node::{AddressKind, NodeAddress};
use crate::objects::{MapEntry, Route, XfrmState};

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
        uid: format!("uid-{name}"),
        addresses: ips
            .iter()
            .map(|s| NodeAddress {
                kind: AddressKind::InternalIP,
                ip: ip(s),
            })
            .collect(),
        pod_cidrs: cidrs.iter().map(|s| net(s)).collect(),
        boot_id: String::new(),
        node_id: None,
    }
}

fn with_id(mut n: Node, v: u16) -> Node {
    n.node_id = Some(id(v));
    n
}

fn cfg() -> PlanConfig {
    PlanConfig {
        local_node: "local".into(),
        local_addresses: vec![ip("10.0.0.100"), ip("fd00::100")],
        agent_version: "test".into(),
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
    KernelObject::Route(Route {
        dst: net(dst),
        gateway: ip(gw),
    })
}

/// The model kernel: objects by identity, ops applied as a backend would.
#[derive(Clone, Debug, Default, PartialEq)]
struct Kernel(BTreeMap<ObjectId, KernelObject>);

impl Kernel {
    fn apply(&mut self, ops: &[Op]) {
        for op in ops {
            match op {
                Op::Upsert(o) => {
                    self.0.insert(o.id(), o.clone());
                }
                Op::Delete(o) => {
                    self.0.remove(&o.id());
                }
            }
        }
    }
    fn inventory(&self) -> Vec<KernelObject> {
        self.0.values().cloned().collect()
    }
    fn has(&self, o: &KernelObject) -> bool {
        self.0.get(&o.id()) == Some(o)
    }
}

struct Run {
    cfg: PlanConfig,
    synced: bool,
}

impl Run {
    fn new() -> Self {
        Self {
            cfg: cfg(),
            synced: true,
        }
    }
    fn plan(&self, restored: Option<&Checkpoint>, live: &[Node], kernel: &Kernel) -> Plan {
        let live = LiveView {
            nodes: live.to_vec(),
            synced: self.synced,
        };
        let inventory = kernel.inventory();
        let allocator = restored.map(|c| c.ids.clone()).unwrap_or_default();
        plan(&PlanInput {
            restored,
            live: &live,
            inventory: &inventory,
            allocator: &allocator,
            now: NOW,
            config: &self.cfg,
        })
    }
    /// Plans, applies every op, and returns the checkpoint to write.
    fn reconcile(
        &self,
        restored: Option<&Checkpoint>,
        live: &[Node],
        kernel: &mut Kernel,
    ) -> (Plan, Checkpoint) {
        let p = self.plan(restored, live, kernel);
        kernel.apply(&p.ops());
        let cp = p.checkpoint_after(&[]);
        (p, cp)
    }
}

fn deleted(p: &Plan) -> Vec<(ObjectId, DeleteReason)> {
    p.deletes
        .iter()
        .map(|d| (d.object.id(), d.reason))
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

#[test]
fn first_start_programs_map_entries_and_routes_with_fresh_ids() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (p, cp) = r.reconcile(None, &[b(), a()], &mut k);
    assert!(p.deletes.is_empty() && p.errors.is_empty());
    assert_eq!(
        p.allocations,
        [
            Allocation {
                node: "a".into(),
                id: id(1)
            },
            Allocation {
                node: "b".into(),
                id: id(2)
            }
        ]
    );
    assert!(k.has(&map("10.0.0.1", 1)));
    assert!(k.has(&route("10.1.2.0/24", "10.0.0.2")));
    assert_eq!(k.0.len(), 4);
    assert_eq!(cp.nodes, [with_id(a(), 1), with_id(b(), 2)]);
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
    });
    k.0.insert(extra.id(), extra.clone());
    let p = r.plan(Some(&cp), &[a(), c()], &k);
    let mut got = deleted(&p);
    got.sort();
    let mut want = vec![
        (map("10.0.0.2", 2).id(), DeleteReason::StaleNode),
        (
            route("10.1.2.0/24", "10.0.0.2").id(),
            DeleteReason::StaleNode,
        ),
        (extra.id(), DeleteReason::StaleNode),
    ];
    want.sort();
    assert_eq!(got, want);
    assert!(p.deletes.iter().all(|d| d.node.as_deref() == Some("b")));
    assert!(p.upserts.is_empty(), "no resurrection: {:?}", p.upserts);
    assert_eq!(p.frees, [id(2)]);
    assert!(p.checkpoint.nodes.iter().all(|n| n.name != "b"));
    assert!(p.checkpoint.pending_deletes.is_empty());
    k.apply(&p.ops());
    assert!(r.plan(Some(&p.checkpoint), &[a(), c()], &k).is_empty());
}

#[test]
fn stale_record_objects_missing_from_the_inventory_are_still_deleted() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c()], &mut k);
    // The inventory misses b's route (say a backend could not dump it): the record still finds it.
    k.0.remove(&route("10.1.2.0/24", "10.0.0.2").id());
    let p = r.plan(Some(&cp), &[a(), c()], &k);
    assert!(deleted(&p).contains(&(
        route("10.1.2.0/24", "10.0.0.2").id(),
        DeleteReason::StaleNode
    )));
}

#[test]
fn ip_recycled_to_new_node_while_down_is_not_deleted() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c()], &mut k);
    // b is deleted while down and a new node e gets b's IP (but a new CIDR).
    let e = node("e", &["10.0.0.2"], &["10.1.5.0/24"]);
    let p = r.plan(Some(&cp), &[a(), c(), e.clone()], &k);
    assert!(
        !deleted(&p)
            .iter()
            .any(|(oid, _)| *oid == map("10.0.0.2", 2).id())
    );
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
    k2.0.insert(map("fd00::1", 1).id(), map("fd00::1", 1));
    let mut cp2 = cp.clone();
    cp2.nodes[0] = with_id(node("a", &["10.0.0.1", "fd00::1"], &["10.1.1.0/24"]), 1);
    let p = r.plan(Some(&cp2), &[a2, c()], &k2);
    assert!(
        !deleted(&p)
            .iter()
            .any(|(oid, _)| *oid == map("10.0.0.2", 1).id())
    );
    assert!(
        p.upserts
            .iter()
            .any(|u| u.object == map("10.0.0.2", 1) && u.update)
    );
    assert!(deleted(&p).contains(&(map("10.0.0.1", 1).id(), DeleteReason::ChangedWhileDown)));
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
        !deleted(&p)
            .iter()
            .any(|(oid, _)| *oid == route("10.1.2.0/24", "10.0.0.2").id())
    );
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
    let mut got = deleted(&p);
    got.sort();
    assert_eq!(
        got,
        [
            (map("10.0.0.2", 2).id(), DeleteReason::ChangedWhileDown),
            (
                route("10.1.2.0/24", "10.0.0.2").id(),
                DeleteReason::ChangedWhileDown
            ),
        ]
    );
    k.apply(&p.ops());
    // The record's ID carries over: no map entry said otherwise.
    assert!(k.has(&map("10.0.0.22", 2)));
    assert!(k.has(&route("10.1.22.0/24", "10.0.0.22")));
    assert!(p.frees.is_empty());
}

#[test]
fn nothing_is_deleted_before_sync() {
    let mut r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
    k.0.insert(map("10.0.0.77", 77).id(), map("10.0.0.77", 77));
    r.synced = false;
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
    // And no other node gets its ID meanwhile.
    let p = r.plan(Some(&cp), &[a(), node("b", &[], &[]), c()], &k);
    assert_eq!(
        p.allocations,
        [Allocation {
            node: "c".into(),
            id: id(3)
        }]
    );
}

#[test]
fn orphans_are_swept_without_a_checkpoint() {
    let r = Run::new();
    let mut k = Kernel::default();
    r.reconcile(None, &[a(), b()], &mut k);
    k.0.insert(map("10.0.0.9", 9).id(), map("10.0.0.9", 9));
    k.0.insert(
        route("10.1.9.0/24", "10.0.0.9").id(),
        route("10.1.9.0/24", "10.0.0.9"),
    );
    let p = r.plan(None, &[a(), b()], &k);
    let mut got = deleted(&p);
    got.sort();
    assert_eq!(
        got,
        [
            (map("10.0.0.9", 9).id(), DeleteReason::Orphan),
            (route("10.1.9.0/24", "10.0.0.9").id(), DeleteReason::Orphan),
        ]
    );
    assert!(
        p.upserts.is_empty(),
        "IDs restored from the map: {:?}",
        p.upserts
    );
    assert_eq!(p.frees, [id(9)]);
}

#[test]
fn brake_holds_mass_stale_deletion_and_keeps_the_nodes_pending() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c(), d()], &mut k);
    k.0.insert(map("10.0.0.9", 9).id(), map("10.0.0.9", 9));
    // 3 of 4 known nodes vanish: 75% > 50%.
    let p = r.plan(Some(&cp), &[a()], &k);
    let hold = p.brake.as_ref().expect("brake");
    assert_eq!((hold.stale_nodes, hold.known_nodes), (3, 4));
    assert_eq!(hold.nodes, ["b", "c", "d"]);
    assert_eq!(hold.deletes.len(), 6);
    assert!(hold.to_string().contains("75%"));
    assert_eq!(
        deleted(&p),
        [(map("10.0.0.9", 9).id(), DeleteReason::Orphan)],
        "orphans are not held"
    );
    let pending: Vec<_> = p
        .checkpoint
        .pending_deletes
        .iter()
        .map(|p| p.node.name.as_str())
        .collect();
    assert_eq!(pending, ["b", "c", "d"]);
    assert_eq!(p.frees, [id(9)], "held nodes keep their IDs");
    // Still held on the next restart; released by force-prune.
    k.apply(&p.ops());
    let p2 = r.plan(Some(&p.checkpoint), &[a()], &k);
    assert!(p2.brake.is_some() && p2.deletes.is_empty());
    let mut forced = Run::new();
    forced.cfg.force_prune = true;
    let p3 = forced.plan(Some(&p.checkpoint), &[a()], &k);
    assert!(p3.brake.is_none());
    assert_eq!(p3.deletes.len(), 6);
    assert!(p3.checkpoint.pending_deletes.is_empty());
}

#[test]
fn brake_does_not_hold_changed_while_down_deletes() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c()], &mut k);
    let a2 = node("a", &["10.0.0.11"], &["10.1.1.0/24"]);
    let p = r.plan(Some(&cp), &[a2], &k);
    assert!(p.brake.is_some());
    assert!(deleted(&p).contains(&(map("10.0.0.1", 1).id(), DeleteReason::ChangedWhileDown)));
}

#[test]
fn local_node_is_never_a_remote_node() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, mut cp) = r.reconcile(None, &[a()], &mut k);
    // A checkpoint (say from a bug) lists the local node, and the map has an entry for its IP.
    // The entry is deleted as an orphan: ID 0 is the local node, we never write its IPs.
    cp.nodes.push(with_id(
        node("local", &["10.0.0.100"], &["10.1.100.0/24"]),
        5,
    ));
    k.0.insert(map("10.0.0.100", 5).id(), map("10.0.0.100", 5));
    let local_live = node("local", &["10.0.0.100"], &["10.1.100.0/24"]);
    let p = r.plan(Some(&cp), &[a(), local_live], &k);
    assert_eq!(
        deleted(&p),
        [(map("10.0.0.100", 5).id(), DeleteReason::Orphan)]
    );
    assert!(p.upserts.is_empty() && p.errors.is_empty() && p.brake.is_none());
    assert!(p.checkpoint.nodes.iter().all(|n| n.name != "local"));
    // A remote node claiming a local address is an input error, not a map entry.
    let bad = node("z", &["10.0.0.100"], &[]);
    let p = r.plan(Some(&cp), &[a(), bad], &k);
    assert!(
        matches!(&p.errors[..], [InputError { node, problem: InputProblem::LocalAddress { .. } }] if node == "z")
    );
    assert!(
        !p.upserts
            .iter()
            .any(|u| u.object.id() == map("10.0.0.100", 1).id())
    );
}

#[test]
fn ip_claimed_by_two_live_nodes_is_an_error_for_the_later_name_only() {
    let r = Run::new();
    let mut k = Kernel::default();
    let dup = node("b-dup", &["10.0.0.1"], &["10.1.7.0/24"]);
    let (p, _) = r.reconcile(None, &[dup, a(), b()], &mut k);
    assert_eq!(
        p.errors,
        [InputError {
            node: "b-dup".into(),
            problem: InputProblem::IpClaimedTwice {
                ip: ip("10.0.0.1"),
                by: "a".into()
            }
        }]
    );
    assert!(k.has(&map("10.0.0.1", 1)));
    assert!(k.has(&map("10.0.0.2", 2)));
    assert_eq!(k.0.len(), 4, "a and b programmed, b-dup skipped");
}

#[test]
fn cidr_claimed_twice_and_cidr_without_gateway_are_input_errors() {
    let r = Run::new();
    let mut k = Kernel::default();
    let twin = node("b", &["10.0.0.2"], &["10.1.1.0/24"]);
    let v6_only_route = node("c", &["10.0.0.3"], &["10.1.3.0/24", "fd01:3::/64"]);
    let (p, _) = r.reconcile(None, &[a(), twin, v6_only_route], &mut k);
    assert!(matches!(&p.errors[0].problem, InputProblem::CidrClaimedTwice { by, .. } if by == "a"));
    assert!(matches!(
        &p.errors[1].problem,
        InputProblem::NoGateway {
            family: Family::V6,
            ..
        }
    ));
    assert!(
        k.has(&route("10.1.3.0/24", "10.0.0.3")),
        "the rest of the node is programmed"
    );
}

#[test]
fn ids_restored_from_the_map_win_over_the_checkpoint_and_fresh_allocation() {
    let r = Run::new();
    let mut k = Kernel::default();
    k.0.insert(map("10.0.0.1", 40).id(), map("10.0.0.1", 40));
    let mut cp = Checkpoint::default();
    cp.nodes.push(with_id(a(), 7));
    let p = r.plan(Some(&cp), &[a(), b()], &k);
    assert!(p.checkpoint.nodes.contains(&with_id(a(), 40)));
    // 7 was never in the kernel's map, but the record had it: it is freed, not reused at once.
    assert_eq!(
        p.allocations,
        [Allocation {
            node: "b".into(),
            id: id(1)
        }]
    );
    assert_eq!(p.frees, [id(7)]);
    assert_eq!(
        p.checkpoint.ids.freed,
        [FreedId {
            id: id(7),
            freed_at: NOW
        }]
    );
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
    assert_eq!(
        p.allocations,
        [
            Allocation {
                node: "a".into(),
                id: id(6)
            },
            Allocation {
                node: "b".into(),
                id: id(5)
            }
        ]
    );
    assert!(matches!(
        &p.errors[..],
        [InputError { node, problem: InputProblem::Ids(IdError::Exhausted { limit: 65535, .. }) }] if node == "c"
    ));
}

#[test]
fn map_capacity_exceeded_reports_the_nodes_that_do_not_fit() {
    let mut r = Run::new();
    r.cfg.map_capacity = 2;
    let mut k = Kernel::default();
    let (p, _) = r.reconcile(None, &[a(), b(), c()], &mut k);
    assert_eq!(p.errors.len(), 1);
    assert_eq!(p.errors[0].node, "c");
    assert!(p.errors[0].to_string().contains("its 2 entries"));
    assert_eq!(k.0.len(), 4);
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
            attempts: 1
        }]
    );
    assert!(next.ids.freed.is_empty());
    // Applied all but the failed op; after a restart it is retried, and counted again.
    let ops: Vec<Op> = p.ops().into_iter().filter(|o| *o != failed[0]).collect();
    k.apply(&ops);
    let p2 = r.plan(Some(&next), &[a(), c()], &k);
    // The record brings back the already-deleted map entry too: deleting an absent object is a
    // success for a backend, and cheaper than trusting that the first attempt took.
    assert!(deleted(&p2).contains(&(
        route("10.1.2.0/24", "10.0.0.2").id(),
        DeleteReason::StaleNode
    )));
    assert_eq!(p2.checkpoint_after(&failed).pending_deletes[0].attempts, 2);
    assert!(p2.checkpoint_after(&[]).pending_deletes.is_empty());
}

#[test]
fn ipsec_adds_states_both_ways_and_a_policy_per_cidr_for_each_shared_family() {
    let mut r = Run::new();
    r.cfg.ipsec = Some(IpsecConfig { spi: 3 });
    r.cfg.local_addresses = vec![ip("10.0.0.100")];
    let mut k = Kernel::default();
    let dual = node(
        "a",
        &["10.0.0.1", "fd00::1"],
        &["10.1.1.0/24", "fd01:1::/64"],
    );
    let (p, cp) = r.reconcile(None, std::slice::from_ref(&dual), &mut k);
    let kinds: Vec<ObjectKind> = k.0.values().map(KernelObject::kind).collect();
    let count = |kind| kinds.iter().filter(|k| **k == kind).count();
    assert_eq!(count(ObjectKind::MapEntry), 2);
    assert_eq!(count(ObjectKind::Route), 2);
    assert_eq!(count(ObjectKind::XfrmState), 2, "IPv4 only: no local IPv6");
    assert_eq!(count(ObjectKind::XfrmPolicy), 1);
    assert!(
        p.upserts
            .iter()
            .all(|u| u.object.node_id().is_none_or(|i| i == id(1)))
    );
    assert!(r.plan(Some(&cp), &[dual], &k).is_empty());
}

#[test]
fn spi_change_supersedes_old_xfrm_objects() {
    let mut r = Run::new();
    r.cfg.ipsec = Some(IpsecConfig { spi: 3 });
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a()], &mut k);
    r.cfg.ipsec = Some(IpsecConfig { spi: 4 });
    let p = r.plan(Some(&cp), &[a()], &k);
    let reasons: Vec<_> = p.deletes.iter().map(|d| d.reason).collect();
    assert_eq!(reasons.len(), 3);
    assert!(
        reasons
            .iter()
            .all(|r| *r == DeleteReason::Superseded || *r == DeleteReason::ChangedWhileDown)
    );
    k.apply(&p.ops());
    assert!(r.plan(Some(&p.checkpoint), &[a()], &k).is_empty());
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
        .position(|o| matches!(o, Op::Upsert(_)))
        .unwrap_or(ops.len());
    assert!(
        ops[first_upsert..]
            .iter()
            .all(|o| matches!(o, Op::Upsert(_)))
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
    assert_eq!(
        p.errors,
        [InputError {
            node: "a".into(),
            problem: InputProblem::DuplicateName
        }]
    );
    assert!(k.has(&map("10.0.0.1", 1)));
}
