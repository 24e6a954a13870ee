//! The oracles' own tests: each rule in both directions, on facts built by hand.

use std::collections::{BTreeMap, BTreeSet};

use state::node::Family;
use state::objects::NexthopId;

use super::*;

/// Objects a restarted daemon recorded at rest are not orphans when the step's list moves
/// their node. Seed 1795920953637136484 (history 78 of seed 1795920953637136406,
/// event-sized, brake on): n006 was killed half-programmed before any checkpoint; the next
/// step's daemon finished it at rest on the last list, then saw it readdressed and removed
/// its old map entry and route as a changed node's. With no checkpoint before the step, the
/// oracle had counted the two as orphans swept past the brake. A real orphan beside them
/// still counts.
#[test]
fn a_node_recorded_at_rest_leaves_no_orphans_behind() {
    let node = |ip: &str, cidr: &str| TestNode {
        name: "n006".into(),
        ips: vec![ip.into()],
        cidrs: vec![cidr.into()],
        uid: Some("n006-1".into()),
        ..TestNode::default()
    };
    let before = Snapshot {
        map: BTreeMap::from([("10.88.7.13".to_owned(), 1)]),
        routes: BTreeMap::from([("10.130.10.0/24".to_owned(), toward("10.88.7.13"))]),
        ..Snapshot::default()
    };
    let after = Snapshot {
        map: BTreeMap::from([("10.88.7.18".to_owned(), 1)]),
        routes: BTreeMap::from([("10.130.12.0/24".to_owned(), toward("10.88.7.18"))]),
        ..Snapshot::default()
    };
    let list = [node("10.88.7.18", "10.130.12.0/24")];
    let rested = [node("10.88.7.13", "10.130.10.0/24")];
    let waiting = BTreeSet::new();
    let facts = |rested| StepFacts {
        rested,
        event_sized: true,
        ..step(&list, &before, &after, &waiting)
    };
    assert_eq!(removals(&facts(&rested)).1, 0);
    // Without a record at all, the two are orphans.
    assert_eq!(removals(&facts(&[])).1, 2);
    // A real orphan beside the rested node is still counted.
    let mut before = before.clone();
    before.map.insert("10.88.9.9".to_owned(), 7);
    let with_orphan = StepFacts {
        before: &before,
        shown: &before,
        ..facts(&rested)
    };
    assert_eq!(removals(&with_orphan).1, 1);
}

/// A full-list step of `list` that finished, from `before` to `after`, with no record and
/// nothing else going on: each test sets what it needs.
fn step<'a>(
    list: &'a [TestNode],
    before: &'a Snapshot,
    after: &'a Snapshot,
    waiting: &'a BTreeSet<String>,
) -> StepFacts<'a> {
    StepFacts {
        list,
        previous_clean: &[],
        record_before: None,
        record_after: None,
        record_lost: false,
        before,
        shown: before,
        rested: &[],
        after,
        exit: Some(0),
        forced: false,
        confirmed: None,
        event_sized: false,
        no_local: false,
        reached: true,
        unsynced: false,
        foreign_slots: &[],
        window: (0, 0),
        max_ratio: 0.5,
        nexthops: false,
        waiting,
    }
}

/// A route or nexthop of ours (the agent's protocol) toward `gw`, as a snapshot holds it.
fn toward(gw: &str) -> (String, String) {
    (gw.to_owned(), "201".to_owned())
}

/// Adds to `s` a route of ours to `dst` through our nexthop `nhid` toward `gw`.
fn route_via(s: &mut Snapshot, dst: &str, gw: &str, nhid: u32) {
    s.routes.insert(dst.to_owned(), toward(gw));
    s.nexthops.insert(nhid, toward(gw));
    s.nhids.insert(dst.to_owned(), nhid);
}

/// A node's nexthops are those that carry its routes, or none. Seed 1795920953634136549
/// (history 143 of seed 1795920953634136406): after a lost checkpoint, a node with no
/// addresses (held while it registers) kept its route and its nexthop toward an address
/// n001 holds now; a fresh agent, with no record of the held node, has neither. The held
/// node's nexthop is not n001's, even under n001's own ID.
#[test]
fn a_nodes_nexthops_are_those_that_carry_its_routes() {
    let n = TestNode {
        name: "n001".into(),
        ips: vec!["10.88.7.10".into()],
        cidrs: vec!["10.130.10.0/24".into()],
        ..TestNode::default()
    };
    let mut fresh = Snapshot {
        map: BTreeMap::from([("10.88.7.10".to_owned(), 4)]),
        ..Snapshot::default()
    };
    route_via(
        &mut fresh,
        "10.130.10.0/24",
        "10.88.7.10",
        nexthop_id(4, false),
    );
    let mut here = fresh.clone();
    route_via(
        &mut here,
        "10.130.7.0/24",
        "10.88.7.10",
        nexthop_id(3, false),
    );
    assert_eq!(node_difference(&n, &here, &fresh), Vec::<String>::new());
    // Its own nexthop missing is a difference.
    let mut lacking = fresh.clone();
    lacking.nexthops.remove(&nexthop_id(4, false));
    assert_eq!(node_difference(&n, &here, &lacking).len(), 1);
    // Another destination's route through a nexthop under the node's own ID (a held node's,
    // from when the ID was its own, after a lost checkpoint: seed 1795920953632136446) is
    // that destination's node's.
    let mut shared = fresh.clone();
    shared.nexthops.remove(&nexthop_id(4, false));
    shared.nhids.remove("10.130.10.0/24");
    shared.routes.remove("10.130.10.0/24");
    let mut held = shared.clone();
    route_via(
        &mut held,
        "10.130.13.0/24",
        "10.88.7.10",
        nexthop_id(4, false),
    );
    assert_eq!(node_difference(&n, &held, &shared), Vec::<String>::new());
    // A leftover toward its address under another ID, carrying nothing, is one too.
    let mut leftover = fresh.clone();
    leftover
        .nexthops
        .insert(nexthop_id(3, false), toward("10.88.7.10"));
    assert_eq!(node_difference(&n, &leftover, &fresh).len(), 1);
}

/// A node a restarted daemon programmed on the last list, then saw removed, claims what it
/// had. Seed 1795920953633136419 (history 13 of seed 1795920953633136406, event-sized): a
/// daemon killed while readdressing n007 to 10.88.7.18 was started again on that list and
/// finished it; the next list gave 10.88.7.18 to n004 and dropped every other node, the
/// brake held the wipe, and n007 kept its address. The agent held n004 back, rightly; the
/// oracle, which knew only the record from before the restart, had called n004 clean.
#[test]
fn a_node_programmed_before_the_list_claims_what_it_had() {
    let node = |name: &str, ip: &str, cidr: &str| TestNode {
        name: name.into(),
        ips: vec![ip.into()],
        cidrs: vec![cidr.into()],
        ..TestNode::default()
    };
    let list = [node("n004", "10.88.7.18", "10.130.7.0/24")];
    let rested = [node("n007", "10.88.7.18", "10.130.6.0/24")];
    assert!(clean(&list, None, &rested).is_empty());
    assert_eq!(clean(&list, None, &[]).len(), 1);
    // Still listed, it claims only what the list gives it.
    let both = [list[0].clone(), node("n007", "10.88.7.19", "10.130.6.0/24")];
    assert_eq!(clean(&both, None, &rested).len(), 2);
}

/// Each kernel is judged by its own foreign routes. Seed 1795920953631136453 (history 47 of
/// seed 1795920953631136406): a node readdressed while a foreign route used its IPv4
/// nexthop; the agent kept that nexthop for its user and gave the node its other IPv4 ID,
/// while a fresh kernel (no foreign route) holds the node's nexthop at the first ID. The
/// agent's kernel is right; the oracle had left out every nexthop at an ID a foreign route
/// used in either kernel, so the fresh kernel's live one too.
#[test]
fn each_kernel_is_judged_by_its_own_foreign_routes() {
    let n = TestNode {
        name: "n004".into(),
        ips: vec!["10.88.7.18".into(), "fd00:88::7:12".into()],
        cidrs: vec!["10.130.5.0/24".into(), "fd00:130:5::/64".into()],
        ..TestNode::default()
    };
    let (v4, v4_other, v6) = (nexthop_id(1, false), 201_500_001, nexthop_id(1, true));
    assert_eq!(
        NexthopId(v4_other).decode().map(|(id, f)| (id.get(), f)),
        Some((1, Family::V4))
    );
    let routes = BTreeMap::from([
        ("10.130.5.0/24".to_owned(), toward("10.88.7.18")),
        ("fd00:130:5::/64".to_owned(), toward("fd00:88::7:12")),
    ]);
    let map = BTreeMap::from([
        ("10.88.7.18".to_owned(), 1),
        ("fd00:88::7:12".to_owned(), 1),
    ]);
    let here = Snapshot {
        map: map.clone(),
        routes: routes.clone(),
        nexthops: BTreeMap::from([
            (v4, toward("10.88.7.20")),
            (v4_other, toward("10.88.7.18")),
            (v6, toward("fd00:88::7:12")),
        ]),
        nhids: BTreeMap::from([
            ("10.130.5.0/24".to_owned(), v4_other),
            ("fd00:130:5::/64".to_owned(), v6),
        ]),
        elsewhere: BTreeMap::from([("10.130.1.0/24".to_owned(), v4)]),
        ..Snapshot::default()
    };
    let fresh = Snapshot {
        map,
        routes,
        nexthops: BTreeMap::from([(v4, toward("10.88.7.18")), (v6, toward("fd00:88::7:12"))]),
        nhids: BTreeMap::from([
            ("10.130.5.0/24".to_owned(), v4),
            ("fd00:130:5::/64".to_owned(), v6),
        ]),
        ..Snapshot::default()
    };
    assert_eq!(node_difference(&n, &here, &fresh), Vec::<String>::new());
    // Without its IPv4 nexthop, the fresh kernel differs.
    let mut lacking = fresh.clone();
    lacking.nexthops.remove(&v4);
    assert_eq!(node_difference(&n, &here, &lacking).len(), 1);
    // A live nexthop a foreign route uses too (the step before the readdress) is compared:
    // the fresh kernel, where no foreign route could use it, has it alike.
    let mut shared = fresh.clone();
    shared.elsewhere = BTreeMap::from([("10.130.1.0/24".to_owned(), v4)]);
    assert_eq!(node_difference(&n, &shared, &fresh), Vec::<String>::new());
    assert_eq!(node_difference(&n, &shared, &lacking).len(), 1);
}

/// A held node keeps what its record lists (invariant 8): a node listed without addresses
/// whose entry and route went is a violation; the same with the record lost, or for a node
/// a resting daemon programmed anew, is not judged.
#[test]
fn a_held_node_keeps_what_its_record_lists() {
    let held = TestNode {
        name: "n003".into(),
        ..TestNode::default()
    };
    let rec = Recorded {
        name: "n003".into(),
        uid: held.uid(),
        ips: vec!["10.88.7.13".into()],
        cidrs: vec!["10.130.3.0/24".into()],
        id: Some(3),
        attempts: 0,
    };
    let had = Snapshot {
        map: BTreeMap::from([("10.88.7.13".to_owned(), 3)]),
        routes: BTreeMap::from([("10.130.3.0/24".to_owned(), toward("10.88.7.13"))]),
        ..Snapshot::default()
    };
    let gone = Snapshot::default();
    let list = [held.clone()];
    let record = [rec];
    let waiting = BTreeSet::new();
    let facts = |after: &'static str| StepFacts {
        record_before: Some(&record),
        ..step(
            &list,
            &had,
            if after == "had" { &had } else { &gone },
            &waiting,
        )
    };
    assert!(held_lost(&facts("had")).is_empty());
    assert_eq!(
        held_lost(&facts("gone")).len(),
        2,
        "{:?}",
        held_lost(&facts("gone"))
    );
    let lost = StepFacts {
        record_lost: true,
        ..facts("gone")
    };
    assert!(held_lost(&lost).is_empty());
    let rested = [held.clone()];
    let anew = StepFacts {
        rested: &rested,
        ..facts("gone")
    };
    assert!(held_lost(&anew).is_empty());
    // Seed 179598179593651, history 57: event-sized, the last list (without the local node)
    // readdressed it; the events of this one pass through that version before it loses its
    // addresses, and the daemon rightly programs it there first.
    let readdressed = [TestNode {
        ips: vec!["10.88.7.18".into()],
        cidrs: vec!["10.130.11.0/24".into()],
        ..held.clone()
    }];
    let through = StepFacts {
        previous_clean: &readdressed,
        event_sized: true,
        ..facts("gone")
    };
    assert!(held_lost(&through).is_empty());
    // Listed last time as recorded, it has nothing to pass through.
    let as_recorded = [TestNode {
        ips: vec!["10.88.7.13".into()],
        cidrs: vec!["10.130.3.0/24".into()],
        ..held
    }];
    let same = StepFacts {
        previous_clean: &as_recorded,
        event_sized: true,
        ..facts("gone")
    };
    assert_eq!(held_lost(&same).len(), 2);
}

/// Before a first full list, each kind of object of ours that goes or changes (and a
/// recorded node the record forgets) is a violation; objects added, and a run that did
/// sync, are not.
#[test]
fn an_unsynced_run_deletes_nothing_of_ours_and_forgets_no_node() {
    let mut had = Snapshot {
        map: BTreeMap::from([("10.88.7.13".to_owned(), 3)]),
        routes: BTreeMap::from([("10.130.3.0/24".to_owned(), toward("10.88.7.13"))]),
        nexthops: BTreeMap::from([(nexthop_id(3, false), toward("10.88.7.13"))]),
        ..Snapshot::default()
    };
    had.xfrm
        .insert(3, BTreeSet::from(["policy out 10.130.3.0/24".to_owned()]));
    let rec = Recorded {
        name: "n003".into(),
        uid: "uid-n003".into(),
        ips: vec!["10.88.7.13".into()],
        cidrs: vec!["10.130.3.0/24".into()],
        id: Some(3),
        attempts: 0,
    };
    let record = [rec];
    let waiting = BTreeSet::new();
    let judge = |after: &Snapshot, record_after: Option<&[Recorded]>, unsynced: bool| {
        unsynced_lost(&StepFacts {
            record_before: Some(&record),
            record_after,
            exit: None,
            unsynced,
            ..step(&[], &had, after, &waiting)
        })
    };
    assert!(judge(&had, Some(&record), true).is_empty());
    let mut more = had.clone();
    more.map.insert("10.88.7.14".into(), 4);
    assert!(
        judge(&more, Some(&record), true).is_empty(),
        "adds are not deletes"
    );
    let without = |what: &str| {
        let mut s = had.clone();
        match what {
            "map" => s.map.clear(),
            "route" => s.routes.clear(),
            "nexthop" => s.nexthops.clear(),
            _ => s.xfrm.clear(),
        }
        s
    };
    let mut walked = Vec::new();
    for what in ["map", "route", "nexthop", "xfrm"] {
        let broke = judge(&without(what), Some(&record), true);
        assert_eq!(broke.len(), 1, "{what}: {broke:?}");
        assert!(judge(&without(what), Some(&record), false).is_empty());
        walked.push(what);
    }
    let mut rewritten = had.clone();
    rewritten.map.insert("10.88.7.13".into(), 9);
    assert_eq!(
        judge(&rewritten, Some(&record), true).len(),
        1,
        "an ID rewritten"
    );
    assert_eq!(judge(&had, Some(&[]), true).len(), 1, "a forgotten node");
    assert_eq!(judge(&had, None, true).len(), 1, "a lost record");
    println!(
        "unsynced oracle: each of {} gone, and the record's node",
        walked.join(" ")
    );
}

/// Past the brake, a confirmed hold's own nodes may go and nothing else: four of five
/// known nodes removed breaks the brake unless the confirmation covers enough of them.
#[test]
fn a_confirmation_releases_its_own_removals_and_no_others() {
    let names = ["a", "b", "c", "d", "e"];
    let ip = |i: usize| format!("10.88.7.{}", i + 1);
    let record: Vec<Recorded> = (names.iter().enumerate())
        .map(|(i, n)| Recorded {
            name: (*n).into(),
            uid: format!("uid-{n}"),
            ips: vec![ip(i)],
            cidrs: vec![format!("10.130.{i}.0/24")],
            id: Some(i as u16 + 1),
            attempts: 0,
        })
        .collect();
    let before = Snapshot {
        map: (0..5).map(|i| (ip(i), i as u16 + 1)).collect(),
        ..Snapshot::default()
    };
    let after = Snapshot {
        map: BTreeMap::from([(ip(0), 1)]),
        ..Snapshot::default()
    };
    let list = [TestNode {
        name: "a".into(),
        ips: vec![ip(0)],
        cidrs: vec!["10.130.0.0/24".into()],
        ..TestNode::default()
    }];
    let waiting = BTreeSet::new();
    let brake = |confirmed: Option<&Confirmed>| {
        violations(&StepFacts {
            record_before: Some(&record),
            confirmed,
            ..step(&list, &before, &after, &waiting)
        })
        .into_iter()
        .filter(|v| v.contains("past the brake"))
        .count()
    };
    let hold = |nodes: &[&str]| Confirmed {
        nodes: nodes.iter().map(|n| (*n).to_owned()).collect(),
        orphans: 0,
    };
    assert_eq!(brake(None), 1, "4 of 5 removed without a confirmation");
    assert_eq!(brake(Some(&hold(&["b", "c", "d", "e"]))), 0);
    assert_eq!(brake(Some(&hold(&["b", "c"]))), 0, "2 of 5 more: within");
    assert_eq!(brake(Some(&hold(&["b"]))), 1, "3 of 5 beyond the hold");
    assert_eq!(brake(Some(&hold(&["x", "y"]))), 1, "another hold's nodes");
    // Seed 7, history 1, step 23: a hold of nodes the step's record does not show (a
    // resting daemon programmed them) covers as many nodes only the map tells of.
    let unrecorded = Snapshot {
        map: (0..5)
            .map(|i| (ip(i), i as u16 + 1))
            .chain([("10.88.9.1".into(), 21), ("10.88.9.2".into(), 22)])
            .collect(),
        ..Snapshot::default()
    };
    let with_two_more = |hold: &Confirmed| {
        violations(&StepFacts {
            record_before: Some(&record),
            confirmed: Some(hold),
            ..step(&list, &unrecorded, &after, &waiting)
        })
        .into_iter()
        .filter(|v| v.contains("past the brake"))
        .count()
    };
    assert_eq!(
        with_two_more(&hold(&["b", "c", "x", "y"])),
        0,
        "2 of 7 beyond"
    );
    assert_eq!(
        with_two_more(&hold(&["b", "c"])),
        1,
        "4 of 7 beyond the hold"
    );
    // Seeds 179622000000000 (history 18), 179623000000000 (25), 179624000000000 (22): without
    // their record the agent holds a node only the map tells of as orphan objects; confirming
    // those covers it.
    let orphans = |nodes: &[&str]| Confirmed {
        orphans: 3,
        ..hold(nodes)
    };
    assert_eq!(
        with_two_more(&orphans(&["b", "c"])),
        0,
        "the map's two as orphans"
    );
    assert_eq!(
        with_two_more(&orphans(&["x"])),
        1,
        "orphans cover no recorded node"
    );
}

/// A list without the local node changes nothing, judged once it reached the agent: a daemon
/// ended while it rested on the last step's list did that list's work (seed 179631000000000,
/// history 18: cut at its second kernel operation, finishing a readdress).
#[test]
fn a_list_without_the_local_node_is_judged_once_it_reached_the_agent() {
    let before = Snapshot::default();
    let after = Snapshot {
        map: BTreeMap::from([("10.88.7.18".to_owned(), 9)]),
        ..Snapshot::default()
    };
    let waiting = BTreeSet::new();
    let judged = |reached: bool| {
        violations(&StepFacts {
            no_local: true,
            reached,
            exit: None,
            ..step(&[], &before, &after, &waiting)
        })
        .into_iter()
        .filter(|v| v.contains("without the local node changed"))
        .count()
    };
    assert_eq!(judged(true), 1);
    assert_eq!(judged(false), 0);
}
