//! Admission in whole plans: the incumbent keeps what it has (invariant 14), map room
//! (invariant 17) and stable node IDs (invariant 5).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::ids::{AllocatorState, FreedId, IdError};
use crate::objects::{KernelObject, ObjectKind};
use crate::plan::tests::support::*;
use crate::plan::*;

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

/// What the host holds is the local node's, whatever its record lists (the address policy): a
/// remote node on one of the host's addresses (a secondary one, or one of a family the record
/// leaves out) is held as one on a listed address is; a pod CIDR that overlaps an on-link
/// prefix of the host (inside, equal, around) would take the host's own link, its gateway
/// with it, and is held. A remote node's address on the host's link is how nodes are: it is
/// programmed, and so is a pod CIDR of a family the host has no link in.
#[test]
fn what_the_host_holds_is_the_local_nodes() {
    let mut r = Run::new();
    r.cfg.host = HostAddresses {
        addresses: vec![ip("10.0.0.100"), ip("10.0.0.101"), ip("fd00:88::1")],
        on_link: vec![
            OnLink {
                prefix: net("10.0.0.0/24"),
                device: "gw0".into(),
            },
            OnLink {
                prefix: net("fd00:88::/64"),
                device: "gw0".into(),
            },
            // A link route of no address of the host's (`ip route add 10.0.4.0/24 dev br0`).
            OnLink {
                prefix: net("10.0.4.0/24"),
                device: "br0".into(),
            },
            // Never one of length 0: it would hold every pod CIDR.
            OnLink {
                prefix: net("0.0.0.0/0"),
                device: "wg0".into(),
            },
        ],
    };
    let mut k = Kernel::default();
    // An entry a run before this one left at a host address goes: it is the local node's.
    k.put(map("10.0.0.101", 9));
    let secondary = node("s", &["10.0.0.101"], &["10.1.5.0/24"]);
    let unlisted = node("t", &["fd00:88::1"], &["fd01:6::/64"]);
    let inside = node("u", &["10.0.0.7"], &["10.0.0.128/25"]);
    let equal = node("v", &["10.0.0.8"], &["10.0.4.0/24"]);
    let around = node("w", &["10.0.0.9"], &["10.0.0.0/23"]);
    let v6 = node("x", &["10.0.0.10", "fd00:88::10"], &["fd01:10::/64"]);
    let live = [a(), secondary, unlisted, inside, equal, around, v6];
    let (p, _) = r.reconcile(None, &live, &mut k);
    let held: Vec<String> = p.errors.iter().map(ToString::to_string).collect();
    for line in &held {
        println!("{line}");
    }
    let starts = [
        "node s: address 10.0.0.101 belongs to the local node",
        "node t: address fd00:88::1 belongs to the local node",
        "node u: pod CIDR 10.0.0.128/25 overlaps the host's on-link prefix 10.0.0.0/24 on gw0, the local node's",
        "node v: pod CIDR 10.0.4.0/24 overlaps the host's on-link prefix 10.0.4.0/24 on br0, the local node's",
        "node w: pod CIDR 10.0.0.0/23 overlaps the address 10.0.0.100, the local node's",
    ];
    assert_eq!(held.len(), starts.len(), "{held:#?}");
    for (line, start) in held.iter().zip(starts) {
        assert!(line.starts_with(start), "{line}");
    }
    assert!(p.errors.iter().all(|e| e.problem.is_conflict()));
    assert_eq!(
        deleted(&p),
        [(map("10.0.0.101", 9).id(), DeleteReason::Orphan)]
    );
    // a (on the host's link) and x (both families on it) are programmed, and nothing else.
    assert_eq!(ids_of(&p.checkpoint).keys().collect::<Vec<_>>(), ["a", "x"]);
    assert!(k.has(&route("10.1.1.0/24", "10.0.0.1")));
    assert!(k.has(&route("fd01:10::/64", "fd00:88::10")));
    let entries: Vec<&KernelObject> = k
        .ours
        .values()
        .filter(|o| o.kind() == ObjectKind::MapEntry)
        .collect();
    assert_eq!(entries.len(), 3, "a's, and x's two: {entries:?}");
    assert_eq!(
        k.ours
            .values()
            .filter(|o| o.kind() == ObjectKind::Route)
            .count(),
        2
    );

    // Without the host's view, the same list programs s, u and v (the bug of issue 29).
    r.cfg.host = HostAddresses::default();
    let p = r.plan(None, &live, &Kernel::default());
    assert_eq!(problems(&p).len(), 1, "w covers the listed address still");
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
