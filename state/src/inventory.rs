//! What the kernel holds, as the planner sees it: our objects by identity, and the identities
//! that objects of others occupy.
//!
//! Backends fill it from a dump; the reconciler may keep it between reconciles and apply the
//! results of its own operations to it, so a plan can be made without dumping again.
//!
//! Our objects sit in a dense vector, each at a slot, with an index from identity to slot: a
//! plan looks each desired identity up once, marks its slot ([`Marks`]), and finds what is not
//! desired by walking the vector in order instead of hashing every object again.

use std::collections::hash_map::Entry;

use foldhash::{HashMap, HashMapExt};

use crate::objects::{KernelObject, ObjectId, ObjectKind, Op};

/// Our objects in the kernel, and the foreign objects at identities we might write.
#[derive(Clone, Debug, Default)]
pub struct Inventory {
    /// Identity -> slot in `slots`.
    index: HashMap<ObjectId, u32>,
    slots: Vec<KernelObject>,
    /// Identity -> what the foreign object is, in words (`route 10.1.0.0/24 proto static`).
    foreign: HashMap<ObjectId, String>,
    /// Identity of ours -> a foreign object that uses it (a route of someone else's through one
    /// of our nexthops), in words: deleting ours would take that along.
    used_by: HashMap<ObjectId, String>,
    /// Our objects by kind, kept as they come and go: metrics and map room read them at every
    /// reconcile, and counting a large inventory each time is work that grows with the cluster.
    counts: [usize; ObjectKind::ALL.len()],
}

impl Inventory {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_capacity(objects: usize) -> Self {
        Self {
            index: HashMap::with_capacity(objects),
            slots: Vec::with_capacity(objects),
            foreign: HashMap::new(),
            used_by: HashMap::new(),
            counts: [0; ObjectKind::ALL.len()],
        }
    }

    /// Makes room for `more` objects at once, so that a large apply grows the view once rather
    /// than by doubling (each doubling briefly holds the old and the new table).
    pub fn reserve(&mut self, more: usize) {
        self.slots.reserve(more);
        self.index.reserve(more);
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
        match self.index.entry(object.id()) {
            Entry::Occupied(e) => self.slots[*e.get() as usize] = object,
            Entry::Vacant(e) => {
                e.insert(self.slots.len() as u32);
                self.counts[object.kind() as usize] += 1;
                self.slots.push(object);
            }
        }
    }

    /// Removes our object at `id`; the last slot's object moves into its slot.
    fn remove(&mut self, id: &ObjectId) {
        let Some(slot) = self.index.remove(id) else {
            return;
        };
        let gone = self.slots.swap_remove(slot as usize);
        self.counts[gone.kind() as usize] -= 1;
        if let Some(moved) = self.slots.get(slot as usize) {
            self.index.insert(moved.id(), slot);
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
        self.index.contains_key(id)
    }

    /// Our object at `slot`.
    pub fn at(&self, slot: usize) -> &KernelObject {
        &self.slots[slot]
    }

    /// The slot of our object at `id`, if there is one (for [`Marks`]).
    pub fn slot(&self, id: &ObjectId) -> Option<usize> {
        self.index.get(id).map(|s| *s as usize)
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
    use crate::objects::{MapEntry, NodeId};

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
}
