//! One scenario per rule of the planner, in the order of `docs/design.md`, for the rules that
//! take several steps. The tests of one step are beside it (`classify/tests.rs`,
//! `brake/tests.rs` with `brake/tests/scenarios.rs`, `assign/tests.rs`, `upserts/tests.rs`,
//! `deletes/tests.rs`); the fixtures of all of them are in `tests/support.rs`.

pub(super) mod support;

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;

use self::support::*;
use super::*;
use crate::objects::{
    KernelObject, KeyTag, Nexthop, NexthopId, ObjectKind, Route, SpiLayout, XfrmDir, XfrmState,
};

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
    // To a key of either SPI layout: the per-sender one is how a cluster moves to it.
    for layout in [SpiLayout::Key, SpiLayout::PerSender] {
        rotation_to_a_key_of(layout);
    }
}

fn rotation_to_a_key_of(layout: SpiLayout) {
    let mut r = Run::new();
    let (old, new) = (
        KeyInUse {
            spi: 3,
            tag: TAG,
            layout: SpiLayout::Key,
        },
        KeyInUse {
            spi: 4,
            tag: KeyTag(0x2222),
            layout,
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
    let layouts: BTreeSet<(u8, SpiLayout)> = k
        .ours
        .values()
        .filter_map(|o| match o {
            KernelObject::XfrmState(s) => Some((s.spi.key(), s.spi.layout())),
            KernelObject::XfrmPolicy(p) => Some((p.spi.key(), p.spi.layout())),
            _ => None,
        })
        .collect();
    assert_eq!(
        layouts,
        BTreeSet::from([(3, SpiLayout::Key), (4, layout)]),
        "each key's states and policies in its layout"
    );
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
                && matches!(&d.object, KernelObject::XfrmState(s) if s.spi.key() == 3)
                    | matches!(&d.object, KernelObject::XfrmPolicy(p) if p.spi.key() == 3))
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

// ---- Routes through nexthop objects ----

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

/// A foreign nexthop at a node's first ID sends its nexthop to the second, as a node readdressed
/// there keeps it (a fresh start and a long-running agent agree); at both IDs, the node's routes
/// of that family stay unwritten and the foreign nexthop is reported.
#[test]
fn a_foreign_nexthop_at_a_nodes_first_id_sends_it_to_the_second_and_at_both_keeps_its_routes_unwritten()
 {
    let dual = || {
        node(
            "a",
            &["10.0.0.1", "fd00::1"],
            &["10.1.1.0/24", "fd01:1::/64"],
        )
    };
    let first = ObjectId::Nexthop {
        id: nh_id(1, Family::V4),
    };
    let second = ObjectId::Nexthop {
        id: NexthopId::of_pair(NodeId::new(1).unwrap(), Family::V4, true),
    };
    for held in [vec![first.clone()], vec![first.clone(), second.clone()]] {
        let r = with_nexthops();
        let mut k = Kernel::default();
        for id in &held {
            k.foreign.insert(id.clone(), format!("{id:?} proto static"));
        }
        let (p, _) = r.reconcile(None, &[dual()], &mut k);
        for id in &held {
            assert!(!k.ours.contains_key(id), "{id:?} stays theirs");
        }
        let v4_route = k
            .ours
            .values()
            .find(|o| matches!(o, KernelObject::Route(r) if r.dst.to_string() == "10.1.1.0/24"))
            .cloned();
        if held.len() == 1 {
            assert!(problems(&p).is_empty(), "{:?}", problems(&p));
            assert!(
                k.ours.contains_key(&second),
                "the nexthop went to the second ID"
            );
            assert_eq!(
                v4_route.and_then(|r| r.uses()),
                Some(second.clone()),
                "the route goes through the second ID"
            );
        } else {
            assert!(matches!(
                problems(&p)[..],
                [("a", InputProblem::Foreign { .. })]
            ));
            assert!(v4_route.is_none(), "no route through either");
        }
        assert!(
            k.has(&nh_route("fd01:1::/64", 1)),
            "the other family is programmed"
        );
        assert!(k.has(&map("10.0.0.1", 1)));
    }
}

/// A nexthop stays only with a route through it, as it goes in only with one: when a foreign
/// route takes a node's only destination, the node's nexthop goes, and the kernel is what a
/// fresh agent leaves from the same record.
#[test]
fn a_nexthop_whose_routes_a_foreign_route_took_goes() {
    let r = with_nexthops();
    let mut k = Kernel::default();
    let (_, cp) = r.reconcile(None, &[a()], &mut k);
    assert!(k.ours.contains_key(&ObjectId::Nexthop {
        id: nh_id(1, Family::V4)
    }));
    let route = ObjectId::Route {
        dst: net("10.1.1.0/24"),
        metric: 0,
    };
    k.ours.remove(&route);
    k.foreign
        .insert(route.clone(), "route 10.1.1.0/24 proto static".into());
    let (_, cp2) = r.reconcile(Some(&cp), &[a()], &mut k);
    let mut fresh = Kernel::default();
    fresh
        .foreign
        .insert(route, "route 10.1.1.0/24 proto static".into());
    r.reconcile(Some(&cp2), &[a()], &mut fresh);
    assert_eq!(k.ours, fresh.ours);
    assert_eq!(
        k.ours.values().cloned().collect::<Vec<_>>(),
        [map("10.0.0.1", 1)]
    );
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
