//! What goes and what stays, by identity (invariant 3): stale nodes, objects recycled to
//! another node or changed while the agent was down, orphans, and what nothing may delete
//! (before sync, a node without addresses, what is not ours).

use std::collections::BTreeSet;

use crate::objects::{KernelObject, KeyTag, ObjectKind, Spi, XfrmDir, XfrmState};
use crate::plan::tests::support::*;
use crate::plan::*;

#[test]
fn stale_node_is_deleted_with_all_its_objects_and_never_re_added() {
    let r = Run::new();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a(), b(), c()], &mut k);
    // An object only the inventory knows (not derivable from b's record) but carrying b's ID.
    let extra = KernelObject::XfrmState(XfrmState {
        src: ip("10.0.0.100"),
        dst: ip("10.9.9.9"),
        spi: Spi::from_wire(3).unwrap(),
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
    let a1 = with_id(node("a", &["10.0.0.1", "fd00::1"], &["10.1.1.0/24"]), 1);
    cp2.nodes.replace("a", [a1]);
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

/// A held node keeps what it had, and nothing that carries another node's ID: here a newcomer
/// held (no ID is left for it, or its claims conflict with a held removal) takes the address
/// and pod CIDR that node b left, whether b moved, is gone, or is gone with the brake holding
/// its removal, in both route modes. (The end-to-end checker
/// found the first case: seed 179597179593651, history 74.)
#[test]
fn a_held_newcomer_keeps_nothing_that_carries_another_nodes_id() {
    let c = node("c", &["10.0.0.2"], &["10.1.2.0/24"]);
    let b2 = node("b", &["10.0.0.22"], &["10.1.22.0/24"]);
    let mut walked = Vec::new();
    for nexthops in [false, true] {
        for (case, live) in [
            ("moved", vec![a(), b2.clone(), c.clone()]),
            ("gone", vec![a(), c.clone()]),
            ("gone-held", vec![a(), c.clone()]),
        ] {
            let mut r = Run::new();
            r.cfg.route_nexthops = nexthops;
            r.cfg.max_node_id = 2;
            if case == "gone-held" {
                r.cfg.max_prune_ratio = 0.1;
            }
            let mut k = Kernel::default();
            let (_, cp) = r.reconcile(None, &[a(), b()], &mut k);
            let p = r.plan(Some(&cp), &live, &k);
            assert!(
                matches!(problems(&p)[..], [("c", _)]),
                "{case}: {:?}",
                problems(&p)
            );
            k.apply(&p.ops());
            // What still carries b's ID 2 is exactly what b desires now, or (brake holding) had.
            let carrying: BTreeSet<String> = k
                .ours
                .values()
                .filter(|o| o.node_id() == Some(id(2)))
                .map(|o| o.to_string())
                .collect();
            let still_mapped = k.has(&map("10.0.0.2", 2));
            match case {
                "moved" => {
                    assert!(!still_mapped, "{case} nexthops={nexthops}: {:?}", k.ours);
                    assert!(k.has(&map("10.0.0.22", 2)));
                }
                "gone" => assert!(
                    carrying.is_empty(),
                    "{case} nexthops={nexthops}: {carrying:?}"
                ),
                _ => {
                    assert!(still_mapped, "the brake keeps a held removal's objects");
                    assert!(p.brake.is_some());
                }
            }
            if nexthops && case == "moved" {
                let through_b = k.ours.values().any(|o| {
                    matches!(o, KernelObject::Route(r) if r.dst == net("10.1.2.0/24"))
                        && o.node_id() == Some(id(2))
                });
                assert!(!through_b, "c's pod CIDR routed to b");
            }
            walked.push(format!("{case}/nexthops={nexthops}"));
        }
    }
    println!(
        "held newcomer at another node's claims: {}",
        walked.join(" ")
    );
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

/// The same rule without a record: after a lost checkpoint, a node that lost its addresses (held
/// while it registers) still claims its pod CIDR, and a newcomer at its old address gets its old
/// ID from the map. The held node's route through that ID now leads to the newcomer: it goes,
/// and the newcomer's objects take the ID. (The end-to-end checker met this case: seed
/// 1795920953632136446, history 40.)
#[test]
fn after_a_lost_checkpoint_a_held_nodes_route_through_a_newcomers_id_goes() {
    let r = with_nexthops();
    let mut k = Kernel::default();
    r.reconcile(None, &[a(), b()], &mut k);
    let newcomer = node("c", &["10.0.0.2"], &["10.1.3.0/24"]);
    let p = r.plan(None, &[a(), node("b", &[], &["10.1.2.0/24"]), newcomer], &k);
    assert!(
        deleted(&p).contains(&(nh_route("10.1.2.0/24", 2).id(), DeleteReason::Superseded)),
        "{:?}",
        deleted(&p)
    );
    k.apply(&p.ops());
    assert!(k.has(&map("10.0.0.2", 2)) && k.has(&nh_route("10.1.3.0/24", 2)));
    assert!(!k.has(&nh_route("10.1.2.0/24", 2)));
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
