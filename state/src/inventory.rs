//! What the kernel holds, as the planner sees it: our objects by identity, and the identities
//! that objects of others occupy.
//!
//! Backends fill it from a dump; the reconciler may keep it between reconciles and apply the
//! results of its own operations to it, so a plan can be made without dumping again.

use foldhash::{HashMap, HashMapExt};

use crate::objects::{KernelObject, ObjectId, ObjectKind, Op};

/// Our objects in the kernel, and the foreign objects at identities we might write.
#[derive(Clone, Debug, Default)]
pub struct Inventory {
    ours: HashMap<ObjectId, KernelObject>,
    /// Identity -> what the foreign object is, in words (`route 10.1.0.0/24 proto static`).
    foreign: HashMap<ObjectId, String>,
    /// Identity of ours -> a foreign object that uses it (a route of someone else's through one
    /// of our nexthops), in words: deleting ours would take that along.
    used_by: HashMap<ObjectId, String>,
}

impl Inventory {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_capacity(objects: usize) -> Self {
        Self {
            ours: HashMap::with_capacity(objects),
            foreign: HashMap::new(),
            used_by: HashMap::new(),
        }
    }

    /// Adds an object of ours. A dump that lists an identity twice keeps the last copy.
    pub fn insert(&mut self, object: KernelObject) {
        self.ours.insert(object.id(), object);
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
        self.ours.get(id)
    }

    pub fn contains(&self, id: &ObjectId) -> bool {
        self.ours.contains_key(id)
    }

    /// What a foreign object at `id` is, if one is there.
    pub fn foreign(&self, id: &ObjectId) -> Option<&str> {
        self.foreign.get(id).map(String::as_str)
    }

    /// Our objects, in no particular order.
    pub fn objects(&self) -> impl Iterator<Item = &KernelObject> {
        self.ours.values()
    }

    /// The foreign objects at identities of our kinds, in no particular order.
    pub fn foreign_objects(&self) -> impl Iterator<Item = (&ObjectId, &str)> {
        self.foreign.iter().map(|(id, what)| (id, what.as_str()))
    }

    /// How many objects of ours there are.
    pub fn len(&self) -> usize {
        self.ours.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ours.is_empty()
    }

    /// How many objects of ours of `kind` there are.
    pub fn count(&self, kind: ObjectKind) -> usize {
        self.ours.values().filter(|o| o.kind() == kind).count()
    }

    /// Folds in an operation the kernel carried out.
    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::Create(o) | Op::Replace(o) => {
                self.foreign.remove(&o.id());
                self.insert(o.clone());
            }
            Op::Delete(o) => {
                self.ours.remove(&o.id());
            }
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
