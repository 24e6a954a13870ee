//! Step 5: the objects each programmed node should have ([`super::desired`]) and the upserts
//! they need, leaving alone what a foreign object keeps from being written (invariant 6).

use ipnet::IpNet;

use super::desired::{desired_objects, global_objects};
use super::nodes::{Live, LiveClass};
use super::ops::{AGENT_OWNED, Upsert};
use super::problem::{InputError, InputProblem, err};
use super::resource_index::{IndexedNexthops, ResourceIndex};
use super::view::PlanInput;
use crate::inventory::{Inventory, Marks};
use crate::objects::{KernelObject, ObjectId};

/// What step 5 found for a run of live nodes.
pub(super) struct Wanted {
    upserts: Vec<Upsert>,
    slots: Vec<u32>,
    errors: Vec<InputError>,
}

/// Step 5, for the live nodes in `range`: the upserts their desired objects need, the slots of
/// those already in the kernel (which the deletes leave alone), and the nodes' input errors.
/// Runs of nodes are independent, so two runs can be found on two cores.
pub(super) fn wanted(
    input: &PlanInput<'_>,
    live: &[Live<'_>],
    index: &ResourceIndex,
    range: std::ops::Range<usize>,
) -> Wanted {
    let cfg = input.config;
    let nexthops = IndexedNexthops {
        index,
        inventory: input.inventory,
    };
    let mut out = Wanted {
        upserts: Vec::new(),
        slots: Vec::new(),
        errors: Vec::new(),
    };
    let mut objects = Vec::new();
    let mut problems = Vec::new();
    for (i, l) in live.iter().enumerate().take(range.end).skip(range.start) {
        let LiveClass::Programmed(id) = l.class else {
            continue;
        };
        objects.clear();
        desired_objects(l.node, id, cfg, &nexthops, &mut objects, &mut problems);
        for p in problems.drain(..) {
            err(&mut out.errors, &l.node.name, p);
        }
        let blocked = Blocked::find(&objects, input.inventory, &l.node.name, &mut out.errors);
        for o in &objects {
            let oid = o.id();
            if input.inventory.foreign(&oid).is_some() || blocked.blocks(o, &objects) {
                continue;
            }
            let slot = index.slot(input.inventory, i, l.node, o);
            let have = slot.map(|s| input.inventory.at(s));
            out.slots.extend(slot.map(|s| s as u32));
            if have != Some(o) {
                out.upserts.push(Upsert {
                    update: have.is_some(),
                    object: o.clone(),
                    node: l.node.name.clone(),
                });
            }
        }
    }
    out
}

/// Step 5, put together: the runs' upserts and errors in node order, then the agent's own
/// objects; and every desired object already in the kernel, marked by slot.
pub(super) fn gather(
    input: &PlanInput<'_>,
    runs: [Wanted; 2],
    errors: &mut Vec<InputError>,
) -> (Vec<Upsert>, Marks) {
    let mut desired = Marks::for_inventory(input.inventory);
    let mut upserts = Vec::with_capacity(runs.iter().map(|r| r.upserts.len()).sum());
    for run in runs {
        upserts.extend(run.upserts);
        errors.extend(run.errors);
        for s in run.slots {
            desired.mark(s as usize);
        }
    }
    for o in global_objects(input.config) {
        let slot = input.inventory.slot(&o.id());
        if slot.map(|s| input.inventory.at(s)) != Some(&o) {
            upserts.push(Upsert {
                update: slot.is_some(),
                object: o,
                node: AGENT_OWNED.to_string(),
            });
        }
        if let Some(s) = slot {
            desired.mark(s);
        }
    }
    (upserts, desired)
}

/// The pod CIDR an object is keyed by (route and policy destinations), if any: a foreign route
/// at that CIDR keeps all of them from being written (invariant 6).
fn key_cidr(o: &KernelObject) -> Option<IpNet> {
    match o {
        KernelObject::Route(r) => Some(r.dst),
        KernelObject::XfrmPolicy(p) => Some(p.dst),
        KernelObject::PodCidrEntry(e) => Some(e.cidr),
        KernelObject::MapEntry(_)
        | KernelObject::Nexthop(_)
        | KernelObject::XfrmState(_)
        | KernelObject::XfrmGuard(_) => None,
    }
}

/// What foreign objects keep from being written for one node: every object keyed by a CIDR
/// whose route identity is foreign, and every object that would use a foreign one (a route
/// through a nexthop ID someone else holds would send the node's traffic their way).
struct Blocked {
    cidrs: Vec<IpNet>,
    ids: Vec<ObjectId>,
}

impl Blocked {
    /// Finds what is blocked among `objects`, reporting each foreign object once.
    fn find(
        objects: &[KernelObject],
        inventory: &Inventory,
        node: &str,
        errors: &mut Vec<InputError>,
    ) -> Self {
        let mut out = Self {
            cidrs: Vec::new(),
            ids: Vec::new(),
        };
        for o in objects {
            let id = o.id();
            if let Some(foreign) = inventory.foreign(&id) {
                err(
                    errors,
                    node,
                    InputProblem::Foreign {
                        object: o.to_string(),
                        foreign: foreign.to_string(),
                    },
                );
                out.cidrs.extend(key_cidr(o));
                out.ids.push(id);
            }
        }
        out
    }

    /// Whether `o` is not written: keyed by a blocked CIDR, using a foreign object, or a
    /// nexthop that no route of `objects` that is written would use.
    fn blocks(&self, o: &KernelObject, objects: &[KernelObject]) -> bool {
        if let KernelObject::Nexthop(_) = o {
            let id = o.id();
            return !objects.iter().any(|r| {
                r.uses().as_ref() == Some(&id)
                    && key_cidr(r).is_none_or(|c| !self.cidrs.contains(&c))
            });
        }
        key_cidr(o).is_some_and(|c| self.cidrs.contains(&c))
            || o.uses().is_some_and(|u| self.ids.contains(&u))
    }
}

#[cfg(test)]
mod tests;
