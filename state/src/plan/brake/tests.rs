//! The brake's rule on its own: what [`super::decide`] releases, holds and remembers; the
//! brake in whole plans is in `scenarios`.

mod scenarios;

use super::*;
use crate::checkpoint::Checkpoint;
use crate::ids::AllocatorState;
use crate::objects::ObjectId;

const MIN: Duration = Duration::from_secs(60);

fn removal(n: &str) -> Removal {
    Removal::Node {
        name: n.into(),
        uid: format!("uid-{n}"),
    }
}

fn brake_cfg(relist: bool) -> PlanConfig {
    PlanConfig {
        confirm_delay: MIN,
        confirm_by_relist: relist,
        ..PlanConfig::default()
    }
}

fn ask(items: &[&str]) -> BTreeSet<Removal> {
    items.iter().map(|n| removal(n)).collect()
}

const TEN: Ask = Ask::known(10, 40);

#[test]
fn at_most_the_ratio_goes_ahead_and_enters_the_window() {
    let m = BrakeMemory::default();
    let d = decide(
        &ask(&["a", "b", "c", "d", "e"]),
        TEN,
        &m,
        1,
        None,
        MIN,
        &brake_cfg(true),
    );
    assert_eq!(d.released.len(), 5, "50% is not over 50%");
    assert!(d.hold.is_none());
    assert_eq!(d.memory.window.len(), 1);
    assert_eq!(d.memory.window[0].nodes, 5);
}

#[test]
fn nodes_swept_as_orphans_without_a_record_count_as_nodes_in_the_window() {
    // A lost checkpoint: two nodes' objects (4 of 10 objects, 2 of 4 node IDs) go as orphans.
    let orphans: BTreeSet<Removal> = (1..=4u8)
        .map(|i| {
            Removal::Orphan(ObjectId::MapEntry {
                ip: std::net::IpAddr::from([10, 0, 0, i]),
            })
        })
        .collect();
    let lost = Ask {
        orphan_nodes: 2,
        ..Ask::known(4, 10)
    };
    let c = brake_cfg(true);
    let first = decide(&orphans, lost, &BrakeMemory::default(), 1, None, MIN, &c);
    assert_eq!(first.released.len(), 4, "2 of 4 nodes, 4 of 10 objects");
    assert_eq!(first.memory.window[0].nodes, 2);
    // With a record again, one more of the two remaining nodes is 3 of 4 within the window.
    let later = MIN + Duration::from_secs(5);
    let second = decide(
        &ask(&["c"]),
        Ask::known(2, 6),
        &first.memory,
        2,
        None,
        later,
        &c,
    );
    assert!(
        second.released.is_empty(),
        "the split mass deletion is seen whole"
    );
}

#[test]
fn removals_within_the_window_count_so_a_mass_deletion_cannot_be_split() {
    let first = decide(
        &ask(&["a", "b", "c"]),
        TEN,
        &BrakeMemory::default(),
        1,
        None,
        MIN,
        &brake_cfg(true),
    );
    assert_eq!(first.released.len(), 3);
    // Seven nodes left; three more a little later: 6 of 10 within the window.
    let known = Ask::known(7, 28);
    let later = MIN + Duration::from_secs(5);
    let second = decide(
        &ask(&["d", "e", "f"]),
        known,
        &first.memory,
        2,
        None,
        later,
        &brake_cfg(true),
    );
    assert!(second.released.is_empty());
    assert_eq!(second.hold.map(|h| h.0), Some(HoldKind::Ratio));
    // Once the window has passed, the same three are fine on their own (3 of 7).
    let much_later = MIN * 3;
    let third = decide(
        &ask(&["d", "e", "f"]),
        known,
        &second.memory,
        3,
        None,
        much_later,
        &brake_cfg(true),
    );
    assert_eq!(third.released.len(), 3);
}

#[test]
fn a_fresh_list_after_the_delay_releases_exactly_what_was_held_and_holds_the_rest() {
    let c = brake_cfg(true);
    let t0 = MIN;
    let held = decide(
        &ask(&["a", "b", "c", "d", "e", "f"]),
        TEN,
        &BrakeMemory::default(),
        1,
        None,
        t0,
        &c,
    );
    assert!(held.released.is_empty());
    // The delay has passed but no newer list came: still held.
    let t1 = t0 + MIN;
    let same_list = decide(
        &ask(&["a", "b", "c", "d", "e", "f"]),
        TEN,
        &held.memory,
        1,
        None,
        t1,
        &c,
    );
    assert!(same_list.released.is_empty());
    // A newer list that asks for more: the six held are released, the seventh waits.
    let more = decide(
        &ask(&["a", "b", "c", "d", "e", "f", "g"]),
        TEN,
        &same_list.memory,
        2,
        None,
        t1,
        &c,
    );
    assert_eq!(more.released, ask(&["a", "b", "c", "d", "e", "f"]));
    assert_eq!(
        more.memory.held.keys().cloned().collect::<BTreeSet<_>>(),
        ask(&["g"])
    );
    assert_eq!(more.memory.held[&removal("g")].at, t1);
}

#[test]
fn a_newer_list_before_the_delay_releases_nothing() {
    let c = brake_cfg(true);
    let held = decide(
        &ask(&["a", "b", "c", "d", "e", "f"]),
        TEN,
        &BrakeMemory::default(),
        1,
        None,
        MIN,
        &c,
    );
    let early = decide(
        &ask(&["a", "b", "c", "d", "e", "f"]),
        TEN,
        &held.memory,
        5,
        None,
        MIN + MIN / 2,
        &c,
    );
    assert!(early.released.is_empty());
}

#[test]
fn one_shot_runs_are_never_confirmed_by_a_list() {
    let c = brake_cfg(false);
    let held = decide(
        &ask(&["a", "b", "c", "d", "e", "f"]),
        TEN,
        &BrakeMemory::default(),
        1,
        None,
        MIN,
        &c,
    );
    let later = decide(
        &ask(&["a", "b", "c", "d", "e", "f"]),
        TEN,
        &held.memory,
        9,
        None,
        MIN * 10,
        &c,
    );
    assert!(later.released.is_empty());
}

#[test]
fn a_wipe_needs_the_operator_and_the_operator_confirms_only_the_held_set() {
    let c = brake_cfg(true);
    let all = ask(&["a", "b", "c", "d", "e", "f", "g", "h", "i"]);
    let held = decide(&all, TEN, &BrakeMemory::default(), 1, None, MIN, &c);
    assert_eq!(held.hold.map(|h| h.0), Some(HoldKind::Wipe));
    let id = hold_id(held.memory.held.keys());
    let relisted = decide(&all, TEN, &held.memory, 7, None, MIN * 10, &c);
    assert!(
        relisted.released.is_empty(),
        "a relist never confirms a wipe"
    );
    let stale = decide(
        &all,
        TEN,
        &held.memory,
        7,
        Some("0123456789ab"),
        MIN * 10,
        &c,
    );
    assert!(stale.released.is_empty(), "a confirmation of another hold");
    let mut more = all.clone();
    more.insert(removal("j"));
    let grown = decide(&more, TEN, &held.memory, 7, Some(&id), MIN * 10, &c);
    assert_eq!(grown.released, all, "exactly what was confirmed");
    assert_eq!(
        grown.memory.held.keys().cloned().collect::<BTreeSet<_>>(),
        ask(&["j"]),
        "the difference is held anew"
    );
    let ok = decide(&all, TEN, &held.memory, 7, Some(&id), MIN * 10, &c);
    assert_eq!(ok.released, all);
}

#[test]
fn orphans_are_counted_in_objects_and_force_releases_everything() {
    let orphans: BTreeSet<Removal> = (0..30u16)
        .map(|i| {
            Removal::Orphan(ObjectId::MapEntry {
                ip: std::net::IpAddr::from([10, 0, 0, i as u8]),
            })
        })
        .collect();
    let none_known = Ask::known(0, 40);
    let held = decide(
        &orphans,
        none_known,
        &BrakeMemory::default(),
        1,
        None,
        MIN,
        &brake_cfg(true),
    );
    assert!(held.released.is_empty(), "30 of 40 objects");
    let forced = decide(
        &orphans,
        none_known,
        &BrakeMemory::default(),
        1,
        None,
        MIN,
        &PlanConfig {
            force_prune: true,
            ..brake_cfg(true)
        },
    );
    assert_eq!(forced.released.len(), 30);
    assert_eq!(forced.memory.window[0].objects, 30);
}

#[test]
fn a_held_item_is_never_released_by_a_ratio_that_drops_later() {
    let c = brake_cfg(false);
    let four = Ask::known(4, 16);
    let all = ask(&["a", "b", "c", "d"]);
    let held = decide(&all, four, &BrakeMemory::default(), 1, None, MIN, &c);
    assert!(held.released.is_empty());
    // Twenty newcomers joined the record meanwhile: 4 of 24 would pass, the hold stays.
    let diluted = Ask::known(24, 96);
    let later = decide(&all, diluted, &held.memory, 1, None, MIN * 2, &c);
    assert!(later.released.is_empty());
    assert_eq!(
        later.hold.map(|h| h.0),
        Some(HoldKind::Wipe),
        "once a wipe, a wipe"
    );
    // Two came back: the other two stay held.
    let fewer = decide(
        &ask(&["a", "b"]),
        diluted,
        &later.memory,
        1,
        None,
        MIN * 3,
        &c,
    );
    assert!(fewer.released.is_empty());
    assert_eq!(fewer.memory.held.len(), 2);
}

#[test]
fn a_ripe_hold_is_not_released_by_a_list_that_is_itself_a_wipe() {
    let c = brake_cfg(true);
    let six = ask(&["a", "b", "c", "d", "e", "f"]);
    let held = decide(&six, TEN, &BrakeMemory::default(), 1, None, MIN, &c);
    assert_eq!(held.hold.map(|h| h.0), Some(HoldKind::Ratio));
    // After the delay, a fresh list without any of the ten.
    let all = ask(&["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]);
    let wiped = decide(&all, TEN, &held.memory, 2, None, MIN * 2, &c);
    assert!(wiped.released.is_empty(), "{:?}", wiped.released);
    assert_eq!(wiped.hold.map(|h| h.0), Some(HoldKind::Wipe));
    // The same six asked for again by a sane list later are still held: once a wipe's, the
    // operator's.
    let sane = decide(&six, TEN, &wiped.memory, 3, None, MIN * 4, &c);
    assert!(sane.released.is_empty());
}

#[test]
fn orphans_held_before_a_restart_wait_a_whole_delay_from_the_restart() {
    let orphan = |i: u8| {
        Removal::Orphan(ObjectId::MapEntry {
            ip: std::net::IpAddr::from([10, 0, 0, i]),
        })
    };
    let c = brake_cfg(true);
    let restarted = BrakeMemory {
        orphans_held: Some(HeldSince {
            at: MIN,
            relists: 0,
            wipe: false,
        }),
        ..BrakeMemory::default()
    };
    let asked: BTreeSet<Removal> = (1..=6).map(orphan).collect();
    let objects = Ask::known(0, 10);
    // Long after the recorded hold, the restarted agent's first list.
    let first = decide(&asked, objects, &restarted, 1, None, MIN * 10, &c);
    assert!(first.released.is_empty(), "{:?}", first.released);
    let early = decide(
        &asked,
        objects,
        &first.memory,
        2,
        None,
        MIN * 10 + MIN / 2,
        &c,
    );
    assert!(early.released.is_empty());
    let ripe = decide(&asked, objects, &early.memory, 3, None, MIN * 11, &c);
    assert_eq!(ripe.released, asked);
}

#[test]
fn a_stale_checkpoint_window_is_completed_by_the_kernels_record() {
    let at = |secs, nodes| RecentRemovals {
        at: Duration::from_secs(secs),
        nodes,
        objects: 0,
    };
    // Twenty nodes. The checkpoint was last written after the first two removals; the
    // kernel saw the three after them too.
    let stale = Checkpoint {
        written_at: Duration::from_secs(101),
        removals: vec![at(100, 2)],
        ..Checkpoint::default()
    };
    let kept = vec![at(100, 2), at(130, 3)];
    let m = BrakeMemory::restored(Some(&stale), Some(kept), &AllocatorState::default());
    assert_eq!(m.window, [at(100, 2), at(130, 3)]);
    // Six of the fifteen left, 20 s later: 11 of 20 within the window (by the stale
    // checkpoint alone, 8 of 17, which would pass).
    let six = ask(&["a", "b", "c", "d", "e", "f"]);
    let now = Duration::from_secs(150);
    let d = decide(&six, Ask::known(15, 60), &m, 1, None, now, &brake_cfg(true));
    assert!(d.released.is_empty());
}

#[test]
fn hold_ids_are_stable_and_tell_sets_apart() {
    assert_eq!(hold_id(&ask(&["a", "b"])), hold_id(&ask(&["a", "b"])));
    assert_ne!(hold_id(&ask(&["a", "b"])), hold_id(&ask(&["a", "c"])));
    assert_eq!(hold_id(&ask(&["a"])).len(), 12);
}
