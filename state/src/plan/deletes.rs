//! Step 6: every object of ours that no programmed node desires, with the reason it goes, or
//! who keeps it.
//!
//! Ownership is by identity (invariant 3): an object is attributed through its key resource (a
//! map entry's address, a route's or policy's destination, a state's remote endpoint), then its
//! node ID, then a secondary resource (a route's gateway, a policy's tunnel endpoint). Among
//! several owners the strongest decides: held live nodes and held removals keep what they had;
//! then programmed nodes (`superseded`), records of live nodes (`changed while down`), and
//! released removals (`stale node`). No owner makes an orphan. A held node's claim on the key
//! yields to an owner that is not held when the object carries that owner's node ID (or, with
//! none, runs through its address): see [`OwnerIndex::owner`].

use foldhash::{HashMap, HashMapExt, HashSet};

use super::brake_memory::Brake;
use super::desired::desired_objects;
use super::nodes::{Live, LiveClass, Record};
use super::ops::{Delete, DeleteReason};
use super::parallel;
use super::resource::secondary_resource;
use super::resource_index::{NodeResources, Res, ResourceIndex};
use super::view::{Local, PlanInput, is_local_entry};
use crate::ids::{IdMap, IdSet};
use crate::inventory::Marks;
use crate::node::Node;
use crate::objects::{KernelObject, NodeId, ObjectId, ObjectKind};

/// Who an undesired object belongs to, strongest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Owner {
    /// A held live node (index into the live nodes).
    Held(usize),
    /// A removal the brake holds (index into the records).
    HeldRemoval(usize),
    /// A programmed live node (index into the live nodes).
    Current(usize),
    /// The record of a programmed live node that changed (index into the records).
    Old(usize),
    /// A removal that goes ahead (index into the records).
    Released(usize),
}

/// The strongest owner of each resource (by [`Res`]) and node ID.
struct OwnerIndex<'i> {
    index: &'i ResourceIndex,
    resources: Vec<Option<Owner>>,
    ids: IdMap<Option<Owner>>,
}

fn put(slot: &mut Option<Owner>, o: Owner) {
    *slot = Some(slot.map_or(o, |e| e.min(o)));
}

impl<'i> OwnerIndex<'i> {
    /// The owners the live nodes (as they are now, and as recorded where that differs) and the
    /// gone nodes' records give.
    fn new(
        resources: &'i ResourceIndex,
        live: &[Live<'_>],
        records: &[Record<'_>],
        brake: &Brake,
    ) -> Self {
        let mut index = OwnerIndex {
            index: resources,
            resources: vec![None; resources.len()],
            ids: IdMap::default(),
        };
        for (i, l) in live.iter().enumerate() {
            let record = l.record.map(|r| records[r].node);
            let now = &resources.live[i];
            match l.class {
                LiveClass::Programmed(id) => {
                    index.add(now, Owner::Current(i), Some(id));
                    if let (Some(r), Some(rec)) = (l.record, record)
                        && !unchanged(rec, l.node, id)
                    {
                        index.add(&resources.records[r], Owner::Old(r), rec.node_id);
                    }
                }
                LiveClass::Held(_) | LiveClass::Candidate => {
                    index.add(now, Owner::Held(i), record.and_then(|r| r.node_id));
                    if let (Some(r), Some(rec)) = (l.record, record) {
                        index.add(&resources.records[r], Owner::Held(i), rec.node_id);
                    }
                }
            }
        }
        for (r, rec) in records.iter().enumerate().filter(|(_, r)| r.live.is_none()) {
            let owner = if brake.releases(rec) {
                Owner::Released(r)
            } else {
                Owner::HeldRemoval(r)
            };
            index.add(&resources.records[r], owner, rec.node.node_id);
        }
        index
    }

    fn add(&mut self, n: &NodeResources, o: Owner, id: Option<NodeId>) {
        for &r in n.addresses.iter().chain(n.cidrs()) {
            put(&mut self.resources[r as usize], o);
        }
        if let Some(id) = id {
            put(self.ids.get_mut(id), o);
        }
    }

    /// The owner of our object `o`, at inventory slot `slot`: its key resource's, else its node
    /// ID's, else its secondary resource's.
    ///
    /// A held node keeps what it had, and what it had carries its own node ID (or, for a route
    /// that names its gateway, runs through an address of its own). So when a held node's claim
    /// is the key but the object's ID or gateway belongs to another node, the object is that
    /// other node's (say, the entry of an address a programmed node left and a held newcomer
    /// took): it goes or stays by that owner, as it would if no held node claimed the key.
    fn owner(&self, slot: usize, o: &KernelObject) -> Option<Owner> {
        let of = |r: Option<Res>| r.and_then(|r| self.resources[r as usize]);
        let by_id = || o.node_id().and_then(|id| self.ids.get(id));
        let by_secondary = || of(secondary_resource(o).and_then(|r| self.index.get(&r)));
        match of(self.index.key(slot)) {
            Some(held @ Owner::Held(_)) => {
                let other = if o.node_id().is_some() {
                    by_id()
                } else {
                    by_secondary()
                };
                match other {
                    Some(other) if !matches!(other, Owner::Held(_)) => Some(other),
                    _ => Some(held),
                }
            }
            Some(owner) => Some(owner),
            None => by_id().or_else(by_secondary),
        }
    }
}

/// Whether `rec` derives exactly the objects the programmed node desires: the common case. Such
/// a record adds no owner (the live node owns the same resources, at a higher priority).
fn unchanged(rec: &Node, node: &Node, id: NodeId) -> bool {
    rec.node_id == Some(id) && rec.addresses == node.addresses && rec.pod_cidrs == node.pod_cidrs
}

pub(super) struct Deleted {
    /// In kind order, then identity order.
    pub deletes: Vec<Delete>,
    /// Objects the brake keeps, with the reason they would have gone.
    pub held: Vec<Delete>,
    /// IDs that kept objects carry.
    pub kept_ids: IdSet,
    /// Objects kept because a foreign object uses them: the object, its node, the user.
    pub in_use: Vec<(KernelObject, Option<String>, String)>,
    /// Some object stays that no record derives: a held node's claim as it is now (not as
    /// recorded) keeps it, or an object that stays uses it. Then the kernel is more than the
    /// record needs, and only a full plan sees that object again ([`super::Plan::steady`]).
    pub kept_unrecorded: bool,
}

pub(super) fn decide(
    input: &PlanInput<'_>,
    live: &[Live<'_>],
    records: &[Record<'_>],
    brake: &Brake,
    resources: &ResourceIndex,
    desired: &Marks,
    local: &Local,
) -> Deleted {
    let mut pool: Vec<(usize, &KernelObject)> = input
        .inventory
        .slotted()
        .filter(|(s, _)| !desired.is_marked(*s))
        .collect();
    // Slots of the objects that go, for what kept objects use.
    let mut going = Marks::for_inventory(input.inventory);
    let mut out = Deleted {
        deletes: Vec::new(),
        held: Vec::new(),
        kept_ids: IdSet::new(),
        in_use: Vec::new(),
        kept_unrecorded: false,
    };
    if pool.is_empty() {
        return out;
    }
    // The pool in order, and who owns what: apart, at once.
    let ((), index) = parallel::both(
        pool.len() >= parallel::WORTH_A_THREAD,
        || pool.sort_by_cached_key(|(_, o)| (o.kind().rank(), o.id())),
        || OwnerIndex::new(resources, live, records, brake),
    );
    let synced = input.live.synced;
    let mut derived = Derived {
        input,
        live,
        records,
        found: HashMap::new(),
    };
    for (slot, o) in pool {
        let keep = |out: &mut Deleted| {
            if let Some(id) = o.node_id() {
                out.kept_ids.insert(id);
            }
        };
        if !synced {
            keep(&mut out);
            continue;
        }
        let (reason, node) = match fate(slot, o, &index, brake, local, live, records) {
            Fate::HeldNode(i) => {
                keep(&mut out);
                out.kept_unrecorded |= !derived.derives(i, o);
                continue;
            }
            Fate::Held(delete) => {
                keep(&mut out);
                out.held.push(delete);
                continue;
            }
            Fate::Goes(reason, node) => (reason, node),
        };
        if let Some(user) = input.inventory.foreign_user(&o.id()) {
            keep(&mut out);
            out.in_use.push((o.clone(), node, user.to_string()));
            continue;
        }
        going.mark(slot);
        out.deletes.push(Delete {
            object: o.clone(),
            reason,
            node,
        });
    }
    keep_what_kept_objects_use(input, desired, &going, &mut out);
    out
}

/// What becomes of one undesired object of ours, after sync.
enum Fate {
    /// A held live node keeps it (index into the live nodes).
    HeldNode(usize),
    /// The brake keeps it: the delete it holds.
    Held(Delete),
    /// It goes, for this reason, reached through this node (unless a foreign object uses it).
    Goes(DeleteReason, Option<String>),
}

/// The fate of object `o` at `slot`, by its strongest owner.
fn fate(
    slot: usize,
    o: &KernelObject,
    index: &OwnerIndex<'_>,
    brake: &Brake,
    local: &Local,
    live: &[Live<'_>],
    records: &[Record<'_>],
) -> Fate {
    let node_of = |n: &Node| Some(n.name.clone());
    if is_local_entry(o, local) {
        return Fate::Goes(DeleteReason::Orphan, None);
    }
    if o.kind() == ObjectKind::XfrmGuard {
        // Undesired only when IPsec is off; belongs to no node, the brake does not count it.
        return Fate::Goes(DeleteReason::Disabled, None);
    }
    match index.owner(slot, o) {
        Some(Owner::Held(i)) => Fate::HeldNode(i),
        Some(Owner::HeldRemoval(r)) => Fate::Held(Delete {
            object: o.clone(),
            reason: DeleteReason::StaleNode,
            node: node_of(records[r].node),
        }),
        Some(Owner::Current(i)) => Fate::Goes(DeleteReason::Superseded, node_of(live[i].node)),
        Some(Owner::Old(r)) => Fate::Goes(DeleteReason::ChangedWhileDown, node_of(records[r].node)),
        Some(Owner::Released(r)) => Fate::Goes(DeleteReason::StaleNode, node_of(records[r].node)),
        None if brake.releases_orphan(&o.id()) => Fate::Goes(DeleteReason::Orphan, None),
        None => Fate::Held(Delete {
            object: o.clone(),
            reason: DeleteReason::Orphan,
            node: None,
        }),
    }
}

/// What each held node's record derives, found once for the nodes that keep something.
struct Derived<'p, 'a> {
    input: &'p PlanInput<'a>,
    live: &'p [Live<'a>],
    records: &'p [Record<'a>],
    found: HashMap<usize, HashSet<ObjectId>>,
}

impl Derived<'_, '_> {
    /// Whether the record of held live node `i` derives `o`.
    fn derives(&mut self, i: usize, o: &KernelObject) -> bool {
        let (input, live, records) = (self.input, self.live, self.records);
        let ids = self.found.entry(i).or_insert_with(|| {
            let mut objects = Vec::new();
            let rec = live[i].record.map(|r| records[r].node);
            if let Some((rec, id)) = rec.and_then(|r| Some((r, r.node_id?))) {
                desired_objects(
                    rec,
                    id,
                    input.config,
                    input.inventory,
                    &mut objects,
                    &mut Vec::new(),
                );
            }
            objects.iter().map(KernelObject::id).collect()
        });
        ids.contains(&o.id())
    }
}

/// An object that stays keeps what it uses: a route kept (its CIDR's owner is held, say)
/// keeps its nexthop even where the nexthop's own owner lets it go, since deleting the nexthop
/// would delete the route with it.
/// `going` marks the slots of the objects `out` deletes.
fn keep_what_kept_objects_use(
    input: &PlanInput<'_>,
    desired: &Marks,
    going: &Marks,
    out: &mut Deleted,
) {
    // Only an object something uses can be needed: with no such delete there is nothing to do.
    if !out.deletes.iter().any(|d| d.object.kind().deleted_last()) {
        return;
    }
    let needed: HashSet<ObjectId> = input
        .inventory
        .slotted()
        .filter(|(s, _)| !desired.is_marked(*s) && !going.is_marked(*s))
        .filter_map(|(_, o)| o.uses())
        .collect();
    if needed.is_empty() {
        return;
    }
    let (kept, deletes): (Vec<Delete>, Vec<Delete>) = std::mem::take(&mut out.deletes)
        .into_iter()
        .partition(|d| needed.contains(&d.object.id()));
    out.deletes = deletes;
    out.kept_unrecorded |= !kept.is_empty();
    for d in kept {
        if let Some(id) = d.object.node_id() {
            out.kept_ids.insert(id);
        }
    }
}

#[cfg(test)]
mod tests;
