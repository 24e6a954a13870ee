//! The kernel as every unit test models it: the planner's tests, its property tests, and the
//! agent's fake kernel (`node-agent/src/kernel/fake.rs`, which adds failures on command).

use std::collections::BTreeMap;

use crate::inventory::Inventory;
use crate::objects::{KernelObject, ObjectId, ObjectKind, Op};

/// Our objects by identity, foreign objects by identity, and which of ours foreign ones use.
#[derive(Clone, Debug, Default)]
pub struct ModelKernel {
    pub ours: BTreeMap<ObjectId, KernelObject>,
    pub foreign: BTreeMap<ObjectId, String>,
    /// Our objects that foreign ones use: what uses each.
    pub used_by: BTreeMap<ObjectId, String>,
}

/// Why the kernel (through a backend) refuses an operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A create onto an identity something holds.
    Occupied,
    /// A delete of an object something goes through (a foreign user, or a route of ours
    /// through a nexthop).
    InUse { user: String },
}

impl ModelKernel {
    /// Carries out `op` as a backend does: a create onto any object is refused, and so is the
    /// delete of an object something uses (only a nexthop has users of ours); a replace writes
    /// whatever is there; deleting what is not there succeeds.
    pub fn write(&mut self, op: &Op) -> Result<(), Refusal> {
        let id = op.object().id();
        match op {
            Op::Create(o) => {
                if self.foreign.contains_key(&id) || self.ours.contains_key(&id) {
                    return Err(Refusal::Occupied);
                }
                self.ours.insert(id, o.clone());
            }
            Op::Replace(o) => {
                self.ours.insert(id, o.clone());
            }
            Op::Delete(o) => {
                if let Some(user) = self.user_of(o) {
                    return Err(Refusal::InUse { user });
                }
                self.ours.remove(&id);
            }
        }
        Ok(())
    }

    /// Carries out a plan's operations, each as a sound plan has it: none refused, and a
    /// replace or a delete finds the object it names. Panics naming the operation otherwise.
    pub fn apply(&mut self, ops: &[Op]) {
        for op in ops {
            let there = self.ours.contains_key(&op.object().id());
            assert!(
                there || matches!(op, Op::Create(_)),
                "{} of nothing: {}",
                op.verb(),
                op.object()
            );
            if let Err(e) = self.write(op) {
                panic!("{} {} refused: {e:?}", op.verb(), op.object());
            }
        }
    }

    /// What a foreign object or a route of ours goes through `o` by, if anything does.
    fn user_of(&self, o: &KernelObject) -> Option<String> {
        let id = o.id();
        self.used_by.get(&id).cloned().or_else(|| {
            (o.kind() == ObjectKind::Nexthop)
                .then(|| self.ours.values().find(|u| u.uses().as_ref() == Some(&id)))
                .flatten()
                .map(ToString::to_string)
        })
    }

    /// What a dump of this kernel finds.
    pub fn inventory(&self) -> Inventory {
        let mut inv: Inventory = self.ours.values().cloned().collect();
        for (id, what) in &self.foreign {
            inv.occupy(id.clone(), what.clone());
        }
        for (id, what) in &self.used_by {
            inv.use_by_foreign(id.clone(), what.clone());
        }
        inv
    }

    /// Puts `o` in as ours, whatever was there.
    pub fn put(&mut self, o: KernelObject) {
        self.ours.insert(o.id(), o);
    }

    /// Whether `o` is there, exactly.
    pub fn has(&self, o: &KernelObject) -> bool {
        self.ours.get(&o.id()) == Some(o)
    }

    /// Our objects there.
    pub fn len(&self) -> usize {
        self.ours.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ours.is_empty()
    }
}
