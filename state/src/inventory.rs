//! What the kernel holds, as the planner sees it: our objects by identity, and the identities
//! that objects of others occupy.
//!
//! Backends fill it from a dump; the reconciler may keep it between reconciles and apply the
//! results of its own operations to it, so a plan can be made without dumping again.
//!
//! Our objects sit in a dense vector, each at a slot, with an index from identity to slot: a
//! plan looks each desired identity up once, marks its slot ([`Marks`]), and finds what is not
//! desired by walking the vector in order instead of hashing every object again.

use std::hash::BuildHasher;

use foldhash::HashMap;
use foldhash::fast::RandomState;
use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use crate::ids::IdMap;
use crate::objects::{KernelObject, NodeId, ObjectId, ObjectKind, Op};

/// Our objects in the kernel, and the foreign objects at identities we might write.
#[derive(Clone, Debug, Default)]
pub struct Inventory {
    /// Identity -> slot in `slots`: the table holds slot numbers alone, found by their object's
    /// identity. At 65,000 nodes (390,000 objects) a table holding each identity beside its slot
    /// took 20 MiB, and every insert of a dump missed the cache; slot numbers take 2 MiB.
    index: HashTable<u32>,
    hasher: RandomState,
    slots: Vec<KernelObject>,
    /// Identity -> what the foreign object is, in words (`route 10.1.0.0/24 proto static`).
    foreign: HashMap<ObjectId, String>,
    /// Identity of ours -> a foreign object that uses it (a route of someone else's through one
    /// of our nexthops), in words: deleting ours would take that along.
    used_by: HashMap<ObjectId, String>,
    /// Our objects by kind, kept as they come and go: metrics and map room read them at every
    /// reconcile, and counting a large inventory each time is work that grows with the cluster.
    counts: [usize; ObjectKind::ALL.len()],
    /// How many of our objects carry each node ID, kept as they come and go: a plan asks which
    /// IDs the kernel holds, and reading the counts is cheaper than walking hundreds of
    /// thousands of objects.
    by_id: IdMap<u32>,
}

impl Inventory {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_capacity(objects: usize) -> Self {
        Self {
            index: HashTable::with_capacity(objects),
            slots: Vec::with_capacity(objects),
            ..Self::default()
        }
    }

    /// Makes room for `more` objects at once, so that a large apply grows the view once rather
    /// than by doubling (each doubling briefly holds the old and the new table).
    pub fn reserve(&mut self, more: usize) {
        self.slots.reserve(more);
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.index
            .reserve(more, |&s| hasher.hash_one(slots[s as usize].id()));
    }

    /// Our objects at `ids` (those that are there), and every foreign object and foreign user:
    /// the part of the kernel an event-sized plan looks at. Foreign objects come whole because
    /// they are few and a node's new identities (its nexthop's, for one) are known only once the
    /// plan has given it an ID.
    pub fn part(&self, ids: impl IntoIterator<Item = ObjectId>) -> Self {
        let mut part = Self {
            foreign: self.foreign.clone(),
            used_by: self.used_by.clone(),
            ..Self::default()
        };
        for id in ids {
            if let Some(o) = self.get(&id) {
                part.insert(o.clone());
            }
        }
        part
    }

    /// Adds an object of ours. A dump that lists an identity twice keeps the last copy.
    pub fn insert(&mut self, object: KernelObject) {
        let id = object.id();
        let (slots, hasher) = (&self.slots, &self.hasher);
        let entry = self.index.entry(
            hasher.hash_one(&id),
            |&s| slots[s as usize].id() == id,
            |&s| hasher.hash_one(slots[s as usize].id()),
        );
        match entry {
            Entry::Occupied(e) => {
                let slot = *e.get() as usize;
                let old = std::mem::replace(&mut self.slots[slot], object);
                count_id(&mut self.by_id, &old, false);
                count_id(&mut self.by_id, &self.slots[slot], true);
            }
            Entry::Vacant(e) => {
                e.insert(self.slots.len() as u32);
                self.counts[object.kind() as usize] += 1;
                count_id(&mut self.by_id, &object, true);
                self.slots.push(object);
            }
        }
    }

    /// The node IDs our objects carry, in order.
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.by_id.iter().filter(|(_, n)| *n > 0).map(|(id, _)| id)
    }

    /// Removes our object at `id`; the last slot's object moves into its slot.
    fn remove(&mut self, id: &ObjectId) {
        let slots = &self.slots;
        let found = self
            .index
            .find_entry(self.hasher.hash_one(id), |&s| slots[s as usize].id() == *id);
        let Ok(entry) = found else {
            return;
        };
        let slot = entry.remove().0 as usize;
        let gone = self.slots.swap_remove(slot);
        self.counts[gone.kind() as usize] -= 1;
        count_id(&mut self.by_id, &gone, false);
        if let Some(moved) = self.slots.get(slot) {
            let from = self.slots.len() as u32;
            let hash = self.hasher.hash_one(moved.id());
            if let Some(s) = self.index.find_mut(hash, |&s| s == from) {
                *s = slot as u32;
            }
        }
    }

    /// Records that an object that is not ours sits at `id`.
    pub fn occupy(&mut self, id: ObjectId, what: impl Into<String>) {
        self.foreign.insert(id, what.into());
    }

    /// Records that a foreign object, `what`, uses the object at `id`.
    pub fn use_by_foreign(&mut self, id: ObjectId, what: impl Into<String>) {
        self.used_by.insert(id, what.into());
    }

    /// A foreign object that uses ours at `id`, if any.
    pub fn foreign_user(&self, id: &ObjectId) -> Option<&str> {
        self.used_by.get(id).map(String::as_str)
    }

    pub fn get(&self, id: &ObjectId) -> Option<&KernelObject> {
        self.slot(id).map(|s| &self.slots[s])
    }

    pub fn contains(&self, id: &ObjectId) -> bool {
        self.slot(id).is_some()
    }

    /// Our object at `slot`.
    pub fn at(&self, slot: usize) -> &KernelObject {
        &self.slots[slot]
    }

    /// The slot of our object at `id`, if there is one (for [`Marks`]).
    pub fn slot(&self, id: &ObjectId) -> Option<usize> {
        self.index
            .find(self.hasher.hash_one(id), |&s| {
                self.slots[s as usize].id() == *id
            })
            .map(|&s| s as usize)
    }

    /// What a foreign object at `id` is, if one is there.
    pub fn foreign(&self, id: &ObjectId) -> Option<&str> {
        self.foreign.get(id).map(String::as_str)
    }

    /// Our objects, in slot order (no order of meaning).
    pub fn objects(&self) -> impl Iterator<Item = &KernelObject> {
        self.slots.iter()
    }

    /// Our objects with their slots.
    pub fn slotted(&self) -> impl Iterator<Item = (usize, &KernelObject)> {
        self.slots.iter().enumerate()
    }

    /// The foreign objects at identities of our kinds, in no particular order.
    pub fn foreign_objects(&self) -> impl Iterator<Item = (&ObjectId, &str)> {
        self.foreign.iter().map(|(id, what)| (id, what.as_str()))
    }

    /// How many objects of ours there are.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// How many objects of ours of `kind` there are.
    pub fn count(&self, kind: ObjectKind) -> usize {
        self.counts[kind as usize]
    }

    /// Folds in an operation the kernel carried out.
    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::Create(o) | Op::Replace(o) => {
                self.foreign.remove(&o.id());
                self.insert(o.clone());
            }
            Op::Delete(o) => self.remove(&o.id()),
        }
    }
}

impl FromIterator<KernelObject> for Inventory {
    fn from_iter<I: IntoIterator<Item = KernelObject>>(iter: I) -> Self {
        let iter = iter.into_iter();
        let mut inv = Self::with_capacity(iter.size_hint().0);
        for o in iter {
            inv.insert(o);
        }
        inv
    }
}

/// One more object carries the node ID `o` carries, if any (`add`), or one fewer.
fn count_id(by_id: &mut IdMap<u32>, o: &KernelObject, add: bool) {
    if let Some(id) = o.node_id() {
        let n = by_id.get_mut(id);
        *n = if add { *n + 1 } else { n.saturating_sub(1) };
    }
}

/// One mark per slot of an [`Inventory`]: which of our objects a plan wants kept.
#[derive(Clone, Debug)]
pub struct Marks(Vec<bool>);

impl Marks {
    /// No slot of `inventory` marked.
    pub fn for_inventory(inventory: &Inventory) -> Self {
        Self(vec![false; inventory.len()])
    }

    pub fn mark(&mut self, slot: usize) {
        self.0[slot] = true;
    }

    pub fn is_marked(&self, slot: usize) -> bool {
        self.0[slot]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::Family;
    use crate::objects::{MapEntry, Nexthop, NexthopId, NodeId, Route, Via};

    fn entry(last: u8, id: u16) -> KernelObject {
        KernelObject::MapEntry(MapEntry {
            ip: [10, 0, 0, last].into(),
            node_id: NodeId::new(id).unwrap(),
            spi: 0,
        })
    }

    #[test]
    fn slots_stay_consistent_across_inserts_replaces_and_deletes() {
        let mut inv: Inventory = (1..=4).map(|i| entry(i, u16::from(i))).collect();
        inv.apply(&Op::Replace(entry(2, 9)));
        inv.apply(&Op::Delete(entry(1, 1)));
        inv.apply(&Op::Delete(entry(7, 7)));
        inv.apply(&Op::Create(entry(5, 5)));
        assert_eq!(inv.len(), 4);
        for o in [entry(2, 9), entry(3, 3), entry(4, 4), entry(5, 5)] {
            let slot = inv.slot(&o.id()).expect("indexed");
            assert_eq!(inv.objects().nth(slot), Some(&o));
            assert_eq!(inv.get(&o.id()), Some(&o));
        }
        assert!(!inv.contains(&entry(1, 1).id()));
        assert_eq!(inv.count(ObjectKind::MapEntry), 4);
    }

    #[test]
    fn node_ids_are_counted_across_the_whole_id_space() {
        let ids = [1u16, 255, 256, 4097, 65_535];
        let mut inv: Inventory = ids
            .iter()
            .enumerate()
            .map(|(k, id)| entry(k as u8 + 1, *id))
            .collect();
        let all: Vec<u16> = inv.node_ids().map(NodeId::get).collect();
        assert_eq!(all, ids);
        inv.apply(&Op::Replace(entry(3, 255)));
        inv.apply(&Op::Delete(entry(5, 65_535)));
        let left: Vec<u16> = inv.node_ids().map(NodeId::get).collect();
        assert_eq!(left, [1, 255, 4097]);
    }

    /// One of a few objects of each kind and family the agent owns in bulk, drawn by `kind`;
    /// `last` picks which one (its identity), `id` what it carries.
    fn any_object(kind: u8, last: u8, id: u16) -> KernelObject {
        let node_id = NodeId::new(id).unwrap();
        let v6 = std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, u16::from(last));
        match kind {
            0 => entry(last, id),
            1 => KernelObject::MapEntry(MapEntry {
                ip: v6.into(),
                node_id,
                spi: 0,
            }),
            // Nexthops are identified by their node, family and which of the pair: `last` names
            // the node and the pair's ID.
            2 | 3 => {
                let node_id = NodeId::new(u16::from(last / 2 + 1)).unwrap();
                let gateway = match kind {
                    2 => [10, 0, 0, id as u8].into(),
                    _ => std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, id).into(),
                };
                KernelObject::Nexthop(Nexthop {
                    node_id,
                    gateway,
                    second: last % 2 == 1,
                })
            }
            4 => KernelObject::Route(Route {
                dst: format!("10.1.{last}.0/24").parse().unwrap(),
                via: Via::Nexthop(NexthopId::of(node_id, Family::V4)),
                metric: Route::DEFAULT_METRIC_V4,
            }),
            _ => KernelObject::Route(Route {
                dst: format!("fd01:{last}::/64").parse().unwrap(),
                via: Via::Gateway(v6.into()),
                metric: Route::DEFAULT_METRIC_V6,
            }),
        }
    }

    proptest::proptest! {
        /// Any sequence of creates, replaces and deletes, of every kind and family the index
        /// holds, leaves the inventory holding what a map by identity holds, every object
        /// findable at its slot, and the counts right, of kinds and of the node IDs objects carry
        /// (deletes move the last slot's object; the table grows from empty as a dump's does).
        #[test]
        fn the_index_follows_any_sequence_of_operations(
            ops in proptest::collection::vec((0u8..3, 0u8..6, 1u8..40, 1u16..5), 1..300)
        ) {
            let mut inv = Inventory::new();
            let mut model = std::collections::BTreeMap::new();
            for (verb, kind, last, id) in ops {
                let o = any_object(kind, last, id);
                match verb {
                    0 => inv.apply(&Op::Create(o.clone())),
                    1 => inv.apply(&Op::Replace(o.clone())),
                    _ => inv.apply(&Op::Delete(o.clone())),
                }
                match verb {
                    0 | 1 => model.insert(o.id(), o),
                    _ => model.remove(&o.id()),
                };
            }
            proptest::prop_assert_eq!(inv.len(), model.len());
            for kind in [ObjectKind::MapEntry, ObjectKind::Nexthop, ObjectKind::Route] {
                let want = model.values().filter(|o| o.kind() == kind).count();
                proptest::prop_assert_eq!(inv.count(kind), want, "{:?}", kind);
            }
            let ids: std::collections::BTreeSet<NodeId> =
                model.values().filter_map(KernelObject::node_id).collect();
            proptest::prop_assert_eq!(inv.node_ids().collect::<std::collections::BTreeSet<_>>(), ids);
            for (id, o) in &model {
                let slot = inv.slot(id);
                proptest::prop_assert!(slot.is_some(), "{id:?} not found");
                proptest::prop_assert_eq!(inv.at(slot.unwrap()), o);
            }
            for kind in 0u8..6 {
                for last in 1u8..40 {
                    let id = any_object(kind, last, 1).id();
                    proptest::prop_assert_eq!(inv.contains(&id), model.contains_key(&id));
                }
            }
        }
    }
}
