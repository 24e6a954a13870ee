//! Step 3: the brake on mass deletion (invariants 9, 15 and 16).
//!
//! A partial list, another cluster's list, or a list read through a broken proxy all look like
//! "most nodes are gone". The brake counts what a plan would remove, against what the agent
//! knows (never against the new list), together with what it removed within the window, and
//! holds every removal when that is too much. A hold is released item by item, and only by a
//! confirmation: an item is released once it has been held for the confirm delay and a full
//! list that arrived after its hold began still asks for it (or by `--force-prune`, or an
//! operator's confirmation of the held set). A ratio that drops later (newcomers in the record,
//! or items that came back) never releases what is held. Whatever a list asks for beyond the
//! held items starts its own hold when the whole is too much. A near-total wipe is released
//! only by an operator.
//!
//! [`decide`] is the rule, pure and small; [`Brake::new`] applies it to a plan. What the brake
//! remembers and what later steps ask of its decision are in [`super::brake_memory`].

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use foldhash::{HashSet, HashSetExt};

use super::brake_memory::{Brake, Decision};
use super::config::PlanConfig;
use super::nodes::Record;
use super::resource_index::ResourceIndex;
use super::view::{Elsewhere, Local, PlanInput, is_local_entry};
use crate::checkpoint::RecentRemovals;
use crate::objects::{KernelObject, NodeId};

pub use super::brake_memory::{
    BrakeCount, BrakeHold, BrakeMemory, HeldSince, HoldKind, Removal, hold_id,
};

/// The brake's rule, given what is asked for now.
#[derive(Clone, Copy, Debug)]
pub(super) struct Ask {
    /// Known remote nodes (the record's) before this plan; without a record, the node IDs the
    /// map carries.
    pub known_nodes: usize,
    /// Our objects in the kernel.
    pub our_objects: usize,
    /// Without a record: nodes (by ID) every map entry of which is an orphan. They are node
    /// removals too, so the node ratio counts them.
    pub orphan_nodes: usize,
}

impl Ask {
    #[cfg(test)]
    pub const fn known(known_nodes: usize, our_objects: usize) -> Self {
        Self {
            known_nodes,
            our_objects,
            orphan_nodes: 0,
        }
    }
}

/// The rule. `asked` is every removal the plan would make; the result says which go ahead.
pub(super) fn decide(
    asked: &BTreeSet<Removal>,
    counts: Ask,
    memory: &BrakeMemory,
    relists: u64,
    confirmed_hold: Option<&str>,
    now: Duration,
    cfg: &PlanConfig,
) -> Decision {
    let mut window: Vec<RecentRemovals> = memory
        .window
        .iter()
        .filter(|w| now.saturating_sub(w.at) < cfg.confirm_delay)
        .copied()
        .collect();
    let tally = Tally::of(asked, counts, memory, &window, cfg);
    let (released, held) = release(asked, &tally, memory, relists, confirmed_hold, now, cfg);
    if let Some(entry) = released_now(&released, &tally, counts, now) {
        window.push(entry);
    }
    let hold = (!held.is_empty()).then(|| {
        let kind = if held.values().any(|s: &HeldSince| s.wipe) {
            HoldKind::Wipe
        } else {
            HoldKind::Ratio
        };
        (kind, tally.count)
    });
    Decision {
        released,
        memory: BrakeMemory {
            held,
            window,
            orphans_held: None,
            done: BTreeSet::new(),
        },
        hold,
    }
}

/// What [`decide`] counted, and what the count says.
struct Tally {
    count: BrakeCount,
    /// Removals asked for that the window counts already ([`BrakeMemory::done`]).
    done: usize,
    /// Over the allowed share.
    over: bool,
    /// Over it, and a near-total wipe.
    wipe: bool,
}

impl Tally {
    /// Counts what is asked for now with what the window (of entries still within it) holds.
    fn of(
        asked: &BTreeSet<Removal>,
        counts: Ask,
        memory: &BrakeMemory,
        window: &[RecentRemovals],
        cfg: &PlanConfig,
    ) -> Self {
        let window_nodes: usize = window.iter().map(|w| w.nodes as usize).sum();
        let window_objects: usize = window.iter().map(|w| w.objects as usize).sum();
        // Removals made before a restart that the window's entries from the kernel count already
        // (the checkpoint, older, still names them): counted there, and not again here.
        let done = asked.iter().filter(|r| memory.done.contains(*r)).count();
        let asked_nodes = asked
            .iter()
            .filter(|r| matches!(r, Removal::Node { .. }))
            .count()
            - done;
        let asked_orphans = asked.len() - done - asked_nodes;
        let removed_nodes = asked_nodes + counts.orphan_nodes;
        let known_nodes = counts.known_nodes - done;
        let count = BrakeCount {
            asked_nodes: removed_nodes,
            window_nodes,
            known_nodes: known_nodes + window_nodes,
            asked_orphans,
            window_objects,
            objects: counts.our_objects + window_objects,
        };
        let ratios = (count.node_ratio(), count.orphan_ratio());
        let over = ratios.0 > cfg.max_prune_ratio || ratios.1 > cfg.max_prune_ratio;
        let wipe = over
            && ((removed_nodes > 0 && ratios.0 >= cfg.wipe_ratio)
                || (asked_orphans > 0 && ratios.1 >= cfg.wipe_ratio));
        Self {
            count,
            done,
            over,
            wipe,
        }
    }
}

/// Each item asked for, released or held (and since when): one the window counts already goes
/// ahead; one held before goes only on a confirmation; a new one goes unless the whole is over
/// the share.
fn release(
    asked: &BTreeSet<Removal>,
    tally: &Tally,
    memory: &BrakeMemory,
    relists: u64,
    confirmed_hold: Option<&str>,
    now: Duration,
    cfg: &PlanConfig,
) -> (BTreeSet<Removal>, BTreeMap<Removal, HeldSince>) {
    let Tally { over, wipe, .. } = *tally;
    // What was held before and is still asked for: only a confirmation releases it, never a
    // ratio that has since dropped (newcomers in the record, or time, would dilute it).
    let held_before: BTreeSet<&Removal> = asked
        .iter()
        .filter(|r| {
            memory.held.contains_key(*r)
                || (memory.orphans_held.is_some() && matches!(r, Removal::Orphan(_)))
        })
        .collect();
    let operator = !held_before.is_empty()
        && confirmed_hold.is_some_and(|id| id == hold_id(held_before.iter().copied()));
    let mut released = BTreeSet::new();
    let mut held = BTreeMap::new();
    // After a restart, an orphan is held as the record says orphans were, its delay counted
    // from the restart: the record does not say which orphans were held, and one found only
    // now must wait a whole delay like any new hold.
    let held_before_as = |item: &Removal| match (memory.held.get(item), item) {
        (Some(since), _) => Some(*since),
        (None, Removal::Orphan(_)) => memory.orphans_held.map(|since| HeldSince {
            at: since.at.max(now),
            ..since
        }),
        (None, Removal::Node { .. }) => None,
    };
    for item in asked {
        if memory.done.contains(item) {
            released.insert(item.clone());
            continue;
        }
        match held_before_as(item).as_ref() {
            Some(since) => {
                // A list that is itself a near-total wipe confirms nothing: it is the likeliest
                // of all to be broken.
                let ripe = cfg.confirm_by_relist
                    && !since.wipe
                    && !wipe
                    && now.saturating_sub(since.at) >= cfg.confirm_delay
                    && relists > since.relists;
                if cfg.force_prune || operator || ripe {
                    released.insert(item.clone());
                } else {
                    let since = HeldSince {
                        wipe: since.wipe || wipe,
                        ..*since
                    };
                    held.insert(item.clone(), since);
                }
            }
            None if !over || cfg.force_prune => {
                released.insert(item.clone());
            }
            None => {
                held.insert(
                    item.clone(),
                    HeldSince {
                        at: now,
                        relists,
                        wipe,
                    },
                );
            }
        }
    }
    (released, held)
}

/// The window's entry for what goes ahead now, those the window counts already left out;
/// `None` when nothing new does.
fn released_now(
    released: &BTreeSet<Removal>,
    tally: &Tally,
    counts: Ask,
    now: Duration,
) -> Option<RecentRemovals> {
    let done = tally.done;
    let asked_orphans = tally.count.asked_orphans;
    let newly_released = released.len() - done;
    if newly_released == 0 {
        return None;
    }
    let nodes = released
        .iter()
        .filter(|r| matches!(r, Removal::Node { .. }))
        .count()
        - done;
    let orphans = newly_released - nodes;
    // Orphans swept without a record were counted as nodes too, by the IDs their map entries
    // carry; the window remembers them as nodes, so that a later plan with a record counts
    // them with its own removals (rounded up where only some of them went).
    let orphan_nodes = if asked_orphans == 0 {
        0
    } else {
        (counts.orphan_nodes * orphans).div_ceil(asked_orphans)
    };
    Some(RecentRemovals {
        at: now,
        nodes: (nodes + orphan_nodes) as u32,
        objects: orphans as u32,
    })
}

impl Brake {
    pub fn new(
        cfg: &PlanConfig,
        input: &PlanInput<'_>,
        records: &[Record<'_>],
        index: &ResourceIndex,
        local: &Local,
        elsewhere: Option<&Elsewhere>,
    ) -> Self {
        let mut brake = Self {
            synced: input.live.synced,
            decision: Decision {
                memory: input.brake.clone(),
                ..Decision::default()
            },
            released_nodes: HashSet::new(),
            max_ratio: cfg.max_prune_ratio,
            confirm_delay: cfg.confirm_delay,
            confirm_by_relist: cfg.confirm_by_relist,
        };
        if !brake.synced {
            // Nothing is removed before sync (invariant 1), and nothing is forgotten either.
            return brake;
        }
        let mut asked = BTreeSet::new();
        let mut known = 0;
        for r in records {
            if r.released_before() {
                // A released removal whose cleanup failed: retried, not counted again.
                if r.live.is_none() {
                    brake
                        .released_nodes
                        .insert((r.node.name.clone(), r.node.uid.to_string()));
                }
                continue;
            }
            known += 1;
            if r.live.is_none() {
                asked.insert(Removal::Node {
                    name: r.node.name.clone(),
                    uid: r.node.uid.to_string(),
                });
            }
        }
        let mut orphaned_ids = HashSet::new();
        for (slot, o) in input.inventory.slotted() {
            if !index.owns_slot(slot) && !is_local_entry(o, local) {
                asked.insert(Removal::Orphan(o.id()));
                if let KernelObject::MapEntry(e) = o {
                    orphaned_ids.insert(e.node_id);
                }
            }
        }
        let counts = Ask {
            known_nodes: known + elsewhere.map_or(0, |e| e.known_nodes),
            our_objects: input.inventory.len() + elsewhere.map_or(0, |e| e.objects),
            orphan_nodes: 0,
        };
        // Without a record, nodes are told apart by the IDs the map carries, orphans or not.
        let unrecorded = records.is_empty() && elsewhere.is_none_or(|e| e.known_nodes == 0);
        let counts = match orphaned_ids.is_empty() && !unrecorded {
            true => counts,
            false => with_orphan_nodes(counts, orphaned_ids, input, records, index, elsewhere),
        };
        brake.decision = decide(
            &asked,
            counts,
            input.brake,
            input.live.relists,
            input.confirmed_hold,
            input.now,
            cfg,
        );
        for r in &brake.decision.released {
            if let Removal::Node { name, uid } = r {
                brake.released_nodes.insert((name.clone(), uid.clone()));
            }
        }
        brake
    }
}

/// The node counts with the nodes that only orphan map entries still tell of, by the IDs those
/// entries carry (`orphaned`): an ID that no entry we keep and no record carries is a node
/// removed by the sweep, and a node known until now. Without a record these are all the nodes
/// there are; with one, they are nodes a lost checkpoint forgot (a removal held before it was
/// lost, say), and counting them only as objects would let the sweep walk around the brake.
fn with_orphan_nodes(
    counts: Ask,
    orphaned: HashSet<NodeId>,
    input: &PlanInput<'_>,
    records: &[Record<'_>],
    index: &ResourceIndex,
    elsewhere: Option<&Elsewhere>,
) -> Ask {
    let mut accounted: HashSet<NodeId> = records.iter().filter_map(|r| r.node.node_id).collect();
    for (slot, o) in input.inventory.slotted() {
        if let KernelObject::MapEntry(e) = o
            && index.owns_slot(slot)
        {
            accounted.insert(e.node_id);
        }
    }
    let unaccounted = orphaned
        .iter()
        .filter(|id| !accounted.contains(*id) && !elsewhere.is_some_and(|e| e.ids.contains(**id)))
        .count();
    let known_nodes = match records.is_empty() && elsewhere.is_none_or(|e| e.known_nodes == 0) {
        true => accounted.union(&orphaned).count(),
        false => counts.known_nodes + unaccounted,
    };
    Ask {
        known_nodes,
        orphan_nodes: unaccounted,
        ..counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::ids::AllocatorState;
    use crate::objects::ObjectId;

    const MIN: Duration = Duration::from_secs(60);

    fn node(n: &str) -> Removal {
        Removal::Node {
            name: n.into(),
            uid: format!("uid-{n}"),
        }
    }

    fn cfg(relist: bool) -> PlanConfig {
        PlanConfig {
            confirm_delay: MIN,
            confirm_by_relist: relist,
            ..PlanConfig::default()
        }
    }

    fn ask(items: &[&str]) -> BTreeSet<Removal> {
        items.iter().map(|n| node(n)).collect()
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
            &cfg(true),
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
        let c = cfg(true);
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
            &cfg(true),
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
            &cfg(true),
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
            &cfg(true),
        );
        assert_eq!(third.released.len(), 3);
    }

    #[test]
    fn a_fresh_list_after_the_delay_releases_exactly_what_was_held_and_holds_the_rest() {
        let c = cfg(true);
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
        assert_eq!(more.memory.held[&node("g")].at, t1);
    }

    #[test]
    fn a_newer_list_before_the_delay_releases_nothing() {
        let c = cfg(true);
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
        let c = cfg(false);
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
        let c = cfg(true);
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
        more.insert(node("j"));
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
            &cfg(true),
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
                ..cfg(true)
            },
        );
        assert_eq!(forced.released.len(), 30);
        assert_eq!(forced.memory.window[0].objects, 30);
    }

    #[test]
    fn a_held_item_is_never_released_by_a_ratio_that_drops_later() {
        let c = cfg(false);
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
        let c = cfg(true);
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
        let c = cfg(true);
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
        let d = decide(&six, Ask::known(15, 60), &m, 1, None, now, &cfg(true));
        assert!(d.released.is_empty());
    }

    #[test]
    fn hold_ids_are_stable_and_tell_sets_apart() {
        assert_eq!(hold_id(&ask(&["a", "b"])), hold_id(&ask(&["a", "b"])));
        assert_ne!(hold_id(&ask(&["a", "b"])), hold_id(&ask(&["a", "c"])));
        assert_eq!(hold_id(&ask(&["a"])).len(), 12);
    }
}
