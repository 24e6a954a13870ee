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
mod tests;
