//! Drift: what changed among our objects in the kernel since the agent's last reconcile, when
//! nothing of the agent changed them (a user's `ip route del`, another program's map write).
//!
//! The reconciler keeps what the kernel should hold after each reconcile; the next dump is
//! compared with it. An object of ours that went missing or changed and that the plan writes
//! back is a repair: counted (`node_agent_drift_repaired_total{kind}`) and logged once, with
//! what was found. A foreign object that took our object's place is not drift to repair: the
//! planner reports it as a conflict and leaves it alone.

use foldhash::{HashMap, HashMapExt};
use state::inventory::Inventory;
use state::objects::{KernelObject, ObjectId};

/// What a dump showed of one object that should have been there as it was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    Missing,
    Changed(KernelObject),
}

/// The drift of one dump against the expected inventory.
#[derive(Debug, Default)]
pub struct Drift {
    found: HashMap<ObjectId, Found>,
}

impl Drift {
    /// Compares `now` with `expected`; foreign objects at an identity are not drift of ours.
    pub fn detect(expected: &Inventory, now: &Inventory) -> Self {
        let mut found = HashMap::new();
        for o in expected.objects() {
            let id = o.id();
            match now.get(&id) {
                Some(n) if n == o => {}
                Some(n) => {
                    found.insert(id, Found::Changed(n.clone()));
                }
                None if now.foreign(&id).is_none() => {
                    found.insert(id, Found::Missing);
                }
                None => {}
            }
        }
        Self { found }
    }

    pub fn is_empty(&self) -> bool {
        self.found.is_empty()
    }

    /// This drift and that of a later dump against this one's: what a dump taken again within
    /// one reconcile found changed since, on top of what the first found.
    pub fn merge(&mut self, later: Drift) {
        self.found.extend(later.found);
    }

    /// What was found at `id`, if it had drifted.
    pub fn at(&self, id: &ObjectId) -> Option<&Found> {
        self.found.get(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use state::objects::{MapEntry, NodeId};

    fn entry(ip: &str, id: u16) -> KernelObject {
        KernelObject::MapEntry(MapEntry {
            ip: ip.parse().unwrap(),
            node_id: NodeId::new(id).unwrap(),
            spi: 0,
        })
    }

    #[test]
    fn missing_and_changed_objects_are_drift_foreign_ones_are_not() {
        let expected: Inventory = [
            entry("10.0.0.1", 1),
            entry("10.0.0.2", 2),
            entry("10.0.0.3", 3),
        ]
        .into_iter()
        .collect();
        let mut now: Inventory = [entry("10.0.0.1", 1), entry("10.0.0.2", 9)]
            .into_iter()
            .collect();
        let d = Drift::detect(&expected, &now);
        assert_eq!(d.at(&entry("10.0.0.1", 1).id()), None);
        assert_eq!(
            d.at(&entry("10.0.0.2", 2).id()),
            Some(&Found::Changed(entry("10.0.0.2", 9)))
        );
        assert_eq!(d.at(&entry("10.0.0.3", 3).id()), Some(&Found::Missing));
        now.occupy(entry("10.0.0.3", 3).id(), "someone else's");
        assert_eq!(
            Drift::detect(&expected, &now).at(&entry("10.0.0.3", 3).id()),
            None
        );
    }
}
